/* The router's scoring (common/route/score.h): the headroom filter, the prefill
 * and decode costs with the overlap credit, the measured transfer cost,
 * conditional disaggregation and its reasons, compatibility groups, and
 * the comparison policies. Expected choices are worked out by hand from
 * the formulas of score.h. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "common/route/score.h"

#define N 4 /* P0, P1, D2, D3 */

static void cluster(td_rt_inst *in) {
    for (int i = 0; i < N; i++)
        in[i] = (td_rt_inst){.prefill = i < 2,
                             .usable = true,
                             .group = 0,
                             .block_size = 16,
                             .kv_free = 1000,
                             .kv_used = 0,
                             .kv_total = 1000};
}

static td_rt_choice choose(const td_rt_score_params *sp, const td_rt_inst *in, const int32_t *ov,
                           const float *x, int32_t n_prompt, td_status want) {
    td_rt_choice c;
    memset(&c, 0xff, sizeof c);
    uint64_t rng = 1;
    assert_int_equal(td_rt_choose(sp, in, N, ov, x, N, n_prompt, 16, 0, &rng, &c), want);
    return c;
}

static void test_prefix_goes_where_cached(void **state) {
    (void)state;
    td_rt_score_params sp = td_rt_score_default_params();
    td_rt_inst in[N];
    cluster(in);
    /* 2048 tokens = 128 blocks; P1 holds 100 of them, D3 holds 10. */
    int32_t ov[N] = {0, 100, 0, 10};
    td_rt_choice c = choose(&sp, in, ov, NULL, 2048, TD_OK);
    assert_int_equal(c.p, 1);
    assert_int_equal(c.d, 3);
    assert_int_equal(c.reason, TD_RT_REMOTE);
    /* need = blocks(2048 + 16) = 129; D3: 129 - 10 = 119; P1: 28 uncached */
    assert_int_equal(c.need_blocks, 129);
    assert_true(c.cost > 119 + 28 - 1e-9 && c.cost < 119 + 28 + 1e-9);
}

static void test_queued_prefill_outweighs_overlap(void **state) {
    (void)state;
    td_rt_score_params sp = td_rt_score_default_params();
    td_rt_inst in[N];
    cluster(in);
    int32_t ov[N] = {0, 100, 0, 0};
    in[1].queued_prefill_tokens = 16 * 200; /* 200 blocks queued on P1 > its 100-block credit */
    td_rt_choice c = choose(&sp, in, ov, NULL, 2048, TD_OK);
    assert_int_equal(c.p, 0);
    sp.overlap_weight = 3.0; /* uncached blocks weigh more: P1's hit wins again */
    c = choose(&sp, in, ov, NULL, 2048, TD_OK);
    assert_int_equal(c.p, 1);
}

static void test_headroom_filter_and_again(void **state) {
    (void)state;
    td_rt_score_params sp = td_rt_score_default_params();
    td_rt_inst in[N];
    cluster(in);
    int32_t ov[N] = {0, 0, 50, 0};
    in[2].kv_free = 100; /* D2 has the prefix but not the 129 blocks */
    td_rt_choice c = choose(&sp, in, ov, NULL, 2048, TD_OK);
    assert_int_equal(c.d, 3);
    in[3].kv_free = 200;
    in[3].pending_blocks = 80; /* routed there since its report: 120 left */
    choose(&sp, in, ov, NULL, 2048, TD_AGAIN);
    in[2].usable = in[3].usable = false;
    choose(&sp, in, ov, NULL, 2048, TD_ERR_UNAVAILABLE);
}

static void test_decode_load(void **state) {
    (void)state;
    td_rt_score_params sp = td_rt_score_default_params();
    td_rt_inst in[N];
    cluster(in);
    int32_t ov[N] = {0};
    in[2].kv_used = 300;
    assert_int_equal(choose(&sp, in, ov, NULL, 2048, TD_OK).d, 3);
    in[3].kv_used = 301;
    assert_int_equal(choose(&sp, in, ov, NULL, 2048, TD_OK).d, 2);
}

static void test_transfer_cost(void **state) {
    (void)state;
    td_rt_score_params sp = td_rt_score_default_params();
    td_rt_inst in[N];
    cluster(in);
    int32_t ov[N] = {0};
    in[3].kv_used = 5; /* D2 preferred by 5 blocks */
    float x[N * N];
    for (int i = 0; i < N * N; i++) x[i] = -1;
    x[0 * N + 2] = x[1 * N + 2] = 100; /* 10 blocks at the default 0.1 */
    x[0 * N + 3] = x[1 * N + 3] = 2;
    td_rt_choice c = choose(&sp, in, ov, x, 2048, TD_OK);
    assert_int_equal(c.d, 3);
    x[1 * N + 2] = 1; /* P1 -> D2 is fast */
    c = choose(&sp, in, ov, x, 2048, TD_OK);
    assert_int_equal(c.d, 2);
    assert_int_equal(c.p, 1);
}

static void test_conditional_disaggregation(void **state) {
    (void)state;
    td_rt_score_params sp = td_rt_score_default_params();
    td_rt_inst in[N];
    cluster(in);
    int32_t ov[N] = {0};
    td_rt_choice c = choose(&sp, in, ov, NULL, 511, TD_OK);
    assert_int_equal(c.p, -1);
    assert_int_equal(c.reason, TD_RT_LOCAL_SHORT);
    c = choose(&sp, in, ov, NULL, 512, TD_OK);
    assert_int_equal(c.reason, TD_RT_REMOTE);
    assert_true(c.p >= 0);
    /* D3 holds 80 of 128 blocks: 768 uncached < 70% of 2048 and < 2048 */
    ov[3] = 80;
    c = choose(&sp, in, ov, NULL, 2048, TD_OK);
    assert_int_equal(c.d, 3);
    assert_int_equal(c.reason, TD_RT_LOCAL_CACHED);
    ov[3] = 0;
    in[0].queued_prefill_tokens = in[1].queued_prefill_tokens = sp.prefill_saturated_tokens;
    c = choose(&sp, in, ov, NULL, 4096, TD_OK);
    assert_int_equal(c.reason, TD_RT_LOCAL_SATURATED);
    in[0].usable = in[1].usable = false;
    c = choose(&sp, in, ov, NULL, 4096, TD_OK);
    assert_int_equal(c.reason, TD_RT_LOCAL_NO_PREFILL);
}

/* Saturation by time, the rule a prefill instance refuses jobs by: P0
 * queues 2,700 tokens at 100 tokens/s (a new prompt starts in 27,000 ms,
 * the default bound: saturated), P1 2,699 (26,990 ms: not); without a
 * measured speed only the token rule applies. The expected first token
 * counts the queue and the prompt's own tokens. */
static void test_saturated_by_time(void **state) {
    (void)state;
    td_rt_score_params sp = td_rt_score_default_params();
    td_rt_inst in[N];
    cluster(in);
    int32_t ov[N] = {0};
    in[0].queued_prefill_tokens = 2700;
    in[0].prefill_tokens_per_s = 100;
    in[1].queued_prefill_tokens = 2699;
    in[1].prefill_tokens_per_s = 100;
    assert_true(td_rt_saturated(&sp, &in[0]));
    assert_false(td_rt_saturated(&sp, &in[1]));
    td_rt_choice c = choose(&sp, in, ov, NULL, 4096, TD_OK);
    assert_int_equal(c.reason, TD_RT_REMOTE);
    assert_int_equal(c.p, 1);
    in[1].queued_prefill_tokens = 2700;
    c = choose(&sp, in, ov, NULL, 4096, TD_OK);
    assert_int_equal(c.reason, TD_RT_LOCAL_SATURATED);
    sp.prefill_saturated_ms = 0; /* off: only the token rule */
    assert_false(td_rt_saturated(&sp, &in[0]));
    in[0].prefill_tokens_per_s = 0; /* no speed: unknown */
    sp.prefill_saturated_ms = 27000;
    assert_false(td_rt_saturated(&sp, &in[0]));
    assert_true(td_rt_expected_ms(&in[0], 300) < 0);
    assert_true(td_rt_expected_ms(&in[1], 300) == 30000.0); /* (2700 + 300) / 100 s */
    assert_true(td_rt_expected_ms(&in[1], -5) == 27000.0);
}

/* The first-token extra: the first miss is taken as is, later ones move
 * the average a fifth of the way, and with no miss for a half-life it is
 * worth half (an instance refused everything for a learnt extra of 1,600
 * ms under a 1,500 ms SLO is offered requests again after well under 2 s:
 * the lock-out the overload benchmark showed without the fade). */
static void test_ttft_extra_learns_and_fades(void **state) {
    (void)state;
    td_rt_extra e = {0};
    assert_true(td_rt_extra_at(&e, 100.0) == 0.0);
    td_rt_extra_learn(&e, 1000, 10.0);
    assert_true(fabs(td_rt_extra_at(&e, 10.0) - 1000) < 1e-9);
    td_rt_extra_learn(&e, 0, 10.0); /* 0.8 x 1000 */
    assert_true(fabs(td_rt_extra_at(&e, 10.0) - 800) < 1e-9);
    td_rt_extra_learn(&e, -200, 10.0); /* P faster than its queue says: down */
    assert_true(fabs(td_rt_extra_at(&e, 10.0) - 600) < 1e-9);
    assert_true(fabs(td_rt_extra_at(&e, 10.0 + TD_RT_EXTRA_HALF_LIFE_S) - 300) < 1e-9);
    assert_true(fabs(td_rt_extra_at(&e, 9.0) - 600) < 1e-9); /* a clock behind: not grown */
    /* a miss after a pause averages with what is left of the old one */
    td_rt_extra_learn(&e, 1000, 10.0 + 2 * TD_RT_EXTRA_HALF_LIFE_S); /* 0.8 x 150 + 200 */
    assert_true(fabs(td_rt_extra_at(&e, 10.0 + 2 * TD_RT_EXTRA_HALF_LIFE_S) - 320) < 1e-9);
    td_rt_extra lock = {0};
    td_rt_extra_learn(&lock, 1600, 0.0);
    double t = 0;
    while (100 + td_rt_extra_at(&lock, t) > 1500) t += 0.01;
    assert_true(t > 0.05 && t < 2 * TD_RT_EXTRA_HALF_LIFE_S);
}

static void test_groups_pair_only_compatible(void **state) {
    (void)state;
    td_rt_score_params sp = td_rt_score_default_params();
    td_rt_inst in[N];
    cluster(in);
    int32_t ov[N] = {0, 0, 0, 0};
    in[0].group = 1;
    in[2].group = 1;
    in[3].kv_used = 900; /* D3 (group 0) is loaded: D2 wins, and only P0 pairs with it */
    in[1].queued_prefill_tokens = 0;
    in[0].queued_prefill_tokens = 16 * 100;
    td_rt_choice c = choose(&sp, in, ov, NULL, 2048, TD_OK);
    assert_int_equal(c.d, 2);
    assert_int_equal(c.p, 0);
}

static void test_round_robin_spreads(void **state) {
    (void)state;
    td_rt_score_params sp = td_rt_score_default_params();
    sp.policy = TD_RT_ROUND_ROBIN;
    td_rt_inst in[N];
    cluster(in);
    int32_t ov[N] = {0, 90, 0, 90};
    int hits[N] = {0};
    for (uint64_t k = 0; k < 8; k++) {
        td_rt_choice c;
        uint64_t rng = 3;
        assert_int_equal(td_rt_choose(&sp, in, N, ov, NULL, N, 2048, 16, k, &rng, &c), TD_OK);
        hits[c.d]++;
        hits[c.p]++;
    }
    assert_int_equal(hits[2], 4);
    assert_int_equal(hits[3], 4);
    assert_int_equal(hits[0], 4);
    assert_int_equal(hits[1], 4);
}

static void test_temperature_samples_near_best(void **state) {
    (void)state;
    td_rt_score_params sp = td_rt_score_default_params();
    sp.temperature = 1.0;
    td_rt_inst in[N];
    cluster(in);
    int32_t ov[N] = {0};
    in[3].kv_used = 1; /* nearly equal: both drawn */
    int hits[N] = {0};
    uint64_t rng = 42;
    for (uint64_t k = 0; k < 200; k++) {
        td_rt_choice c;
        assert_int_equal(td_rt_choose(&sp, in, N, ov, NULL, N, 2048, 16, k, &rng, &c), TD_OK);
        hits[c.d]++;
    }
    assert_true(hits[2] > 40 && hits[3] > 40);
    sp.temperature = 0;
    for (uint64_t k = 0; k < 10; k++) {
        td_rt_choice c;
        td_rt_choose(&sp, in, N, ov, NULL, N, 2048, 16, k, &rng, &c);
        assert_int_equal(c.d, 2);
    }
}

static void test_policy_names(void **state) {
    (void)state;
    assert_int_equal(td_rt_policy_parse("kv-aware"), TD_RT_KV_AWARE);
    assert_int_equal(td_rt_policy_parse("least-loaded"), TD_RT_LEAST_LOADED);
    assert_int_equal(td_rt_policy_parse("kv"), -1);
    assert_int_equal(td_rt_policy_parse(NULL), -1);
    assert_string_equal(td_rt_reason_str(TD_RT_LOCAL_CACHED), "local_cached");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prefix_goes_where_cached),
        cmocka_unit_test(test_queued_prefill_outweighs_overlap),
        cmocka_unit_test(test_headroom_filter_and_again),
        cmocka_unit_test(test_decode_load),
        cmocka_unit_test(test_transfer_cost),
        cmocka_unit_test(test_conditional_disaggregation),
        cmocka_unit_test(test_saturated_by_time),
        cmocka_unit_test(test_ttft_extra_learns_and_fades),
        cmocka_unit_test(test_groups_pair_only_compatible),
        cmocka_unit_test(test_round_robin_spreads),
        cmocka_unit_test(test_temperature_samples_near_best),
        cmocka_unit_test(test_policy_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
