/* The cluster simulator (planner/sim.h) against cases worked out by hand,
 * with a step model of c0 = 10 ms plus 1 ms per batch token:
 *   - one request: a 100-token prefill (110 ms), then 11 ms per token;
 *   - chunked prefill: the same prompt in chunks of 32, 32, 32, 4;
 *   - a full batch: max_running 2, three requests at once, the third
 *     admitted when the first two end;
 *   - KV exhaustion: two sequences outgrow a 3-block pool, the later one
 *     is preempted once and both finish;
 *   - a saturated prefill pool: one prefill instance taking 100 ms per
 *     prompt behind the router, a prompt every 50 ms, so the k-th waits
 *     for the k before it: TTFT_k = 0.1 (k + 1) + 10 ms transfer - 0.05 k;
 *   - the router's poll lag: two colocated instances polled at 0 (idle),
 *     r0 (16 + 150 tokens: 11 blocks) routed to 0 at 0.01, r1 (300 + 1:
 *     19 blocks) to 1 at 0.02, done at 0.33 while r0 decodes until ~1.7 s.
 *     At 0.5 r2 (16 + 2) sees, polling every second, 0's 11 routed blocks
 *     against 1's 19 (cost 11 + 2 + 1 + 1 = 15 against 19 + 2 + 19 + 1 =
 *     41): instance 0; seeing exact figures, 0 busy and 1 idle: instance
 *     1. At 1.5 r3 (the same) goes to 1 either way: the poll at 1.0 has
 *     forgotten what was routed and sees 0 busy.
 *   - neighbours on one machine: two colocated instances on host 0 whose
 *     step model beside a stepping neighbour is twice the alone one (110
 *     against 220 ms for a 100-token prompt); r0 (100 tokens, one output
 *     token) starts on an idle machine at 0; r1 (the same) at 0.05 goes to
 *     the other instance: r0's step is 50/110 done and its rest takes
 *     60/110 x 220 = 120 ms, ending at 0.17; r1's, beside until then, is
 *     120/220 done, and its rest alone takes 50 ms: both TTFTs 170 ms. r2
 *     at 1.0, the machine idle again: 110 ms. On two hosts, or with no
 *     beside model, all three take 110 ms.
 *   - a TPOT target: r0 (16 + 200) decodes when r1 (400 + 1) arrives at
 *     0.1; with no target r1's prompt takes one 411 ms step beside r0's
 *     decode; with a 50 ms target its chunks grow from one token by
 *     doubling to what the fitted step times leave (38 or 39 tokens beside
 *     one decode, the fit's rounding), so no gap of r0's passes 50 ms and
 *     r1's prompt is done in chunks, its TTFT the sum of those steps. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "planner/sim.h"

static td_sim_cluster one(int32_t max_running, int32_t mbt, int32_t n_blocks, int32_t max_ctx,
                          int32_t reserve) {
    td_sim_cluster c;
    memset(&c, 0, sizeof c);
    c.n_inst = 1;
    td_sim_instance *x = &c.inst[0];
    x->role = TD_SIM_COLOCATED;
    x->sched = td_sched_default_params();
    x->sched.max_running = max_running;
    x->sched.max_batch_tokens = mbt;
    x->sched.max_ctx = max_ctx;
    x->sched.reserve_output_tokens = reserve;
    x->n_blocks = n_blocks;
    x->block_size = 16;
    x->step = (td_step_model){.c0 = 0.010, .c_tok = 0.001};
    c.score = td_rt_score_default_params();
    return c;
}

static void run(const td_sim_cluster *c, const td_sim_request *r, int32_t n, td_sim_outcome *o,
                td_sim_stats *st) {
    char why[256] = "";
    assert_int_equal(td_sim_run(c, r, n, true, o, st, why, sizeof why), TD_OK);
}

static void test_one_request(void **state) {
    (void)state;
    td_sim_cluster c = one(16, 512, 64, 512, 256);
    td_sim_segment seg = {-1, 100};
    td_sim_request r = {.t_arrival = 0, .seg = &seg, .n_seg = 1, .n_output = 5};
    td_sim_outcome o;
    td_sim_stats st;
    run(&c, &r, 1, &o, &st);
    assert_false(o.failed);
    assert_float_equal(o.ttft, 0.110, 1e-9);
    assert_float_equal(o.e2e, 0.110 + 4 * 0.011, 1e-9);
    assert_float_equal(o.tpot, 0.011, 1e-9);
    assert_int_equal(st.steps, 5);
    assert_int_equal(st.n_itl, 4);
    free(st.itl);
}

static void test_chunked_prefill(void **state) {
    (void)state;
    td_sim_cluster c = one(16, 32, 64, 512, 256);
    td_sim_segment seg = {-1, 100};
    td_sim_request r = {.t_arrival = 0.5, .seg = &seg, .n_seg = 1, .n_output = 2};
    td_sim_outcome o;
    td_sim_stats st;
    run(&c, &r, 1, &o, &st);
    assert_float_equal(o.ttft, 3 * 0.042 + 0.014, 1e-9);
    assert_float_equal(o.e2e, 3 * 0.042 + 0.014 + 0.011, 1e-9);
    free(st.itl);
}

static void test_full_batch(void **state) {
    (void)state;
    td_sim_cluster c = one(2, 512, 64, 512, 256);
    td_sim_segment seg = {-1, 10};
    td_sim_request r[3];
    for (int i = 0; i < 3; i++) r[i] = (td_sim_request){0, &seg, 1, 3};
    td_sim_outcome o[3];
    td_sim_stats st;
    run(&c, r, 3, o, &st);
    for (int i = 0; i < 2; i++) {
        assert_float_equal(o[i].ttft, 0.030, 1e-9);
        assert_float_equal(o[i].e2e, 0.030 + 2 * 0.012, 1e-9);
    }
    assert_float_equal(o[2].ttft, 0.054 + 0.020, 1e-9);
    assert_float_equal(o[2].e2e, 0.074 + 2 * 0.011, 1e-9);
    free(st.itl);
}

static void test_kv_exhaustion(void **state) {
    (void)state;
    td_sim_cluster c = one(4, 512, 3, 48, 0);
    td_sim_segment seg = {-1, 16};
    td_sim_request r[2] = {{0, &seg, 1, 17}, {0, &seg, 1, 17}};
    td_sim_outcome o[2];
    td_sim_stats st;
    run(&c, r, 2, o, &st);
    assert_int_equal(st.preemptions, 1);
    assert_false(o[0].failed || o[1].failed);
    assert_int_equal(o[0].n_preemptions, 0);
    assert_int_equal(o[1].n_preemptions, 1);
    assert_float_equal(o[0].ttft, 0.042, 1e-9); /* both prompts in the first step */
    assert_float_equal(o[1].ttft, 0.042, 1e-9); /* its first token came before the preemption */
    assert_true(o[1].e2e > o[0].e2e);
    free(st.itl);
}

static void test_saturated_prefill_pool(void **state) {
    (void)state;
    td_sim_cluster c = one(16, 1024, 1024, 1024, 256);
    c.router = true;
    c.n_inst = 2;
    c.inst[1] = c.inst[0];
    c.inst[1].role = TD_SIM_DECODE;
    td_sim_instance *p = &c.inst[0];
    p->role = TD_SIM_PREFILL;
    p->sched.max_running = 1;
    p->n_blocks = 128;
    p->step = (td_step_model){.c0 = 0.100};
    c.xfer_fixed_s = 0.010;
    enum { N = 10 };
    td_sim_segment seg = {-1, 600}; /* over the router's local threshold (512) */
    td_sim_request r[N];
    for (int k = 0; k < N; k++) r[k] = (td_sim_request){0.05 * k, &seg, 1, 1};
    td_sim_outcome o[N];
    td_sim_stats st;
    run(&c, r, N, o, &st);
    assert_int_equal(st.remote_prefills, N);
    for (int k = 0; k < N; k++) {
        assert_int_equal(o[k].p, 0);
        assert_int_equal(o[k].d, 1);
        assert_float_equal(o[k].ttft, 0.05 * k + 0.11, 1e-9);
    }
    assert_float_equal(st.busy_s[0], N * 0.100, 1e-9);
    free(st.itl);
}

static void test_poll_lag(void **state) {
    (void)state;
    td_sim_cluster c = one(16, 1024, 1024, 1024, 256);
    c.router = true;
    c.n_inst = 2;
    c.inst[1] = c.inst[0];
    td_sim_segment s16 = {-1, 16}, s300 = {-1, 300};
    td_sim_request r[4] = {
        {0.01, &s16, 1, 150}, {0.02, &s300, 1, 1}, {0.5, &s16, 1, 2}, {1.5, &s16, 1, 2}};
    td_sim_outcome o[4];
    td_sim_stats st;
    const int32_t want_d[2][4] = {{0, 1, 1, 1}, {0, 1, 0, 1}}; /* exact, polled every 1 s */
    for (int lag = 0; lag < 2; lag++) {
        c.poll_interval_s = lag ? 1.0 : 0;
        run(&c, r, 4, o, &st);
        for (int k = 0; k < 4; k++) {
            assert_false(o[k].failed);
            assert_int_equal(o[k].d, want_d[lag][k]);
        }
        assert_float_equal(o[1].ttft, 0.310, 1e-9); /* alone on instance 1 */
        if (lag) {
            /* polls at 0, 1, 2 and while r0 still decodes; none once all ended */
            assert_true(st.polls >= 2 && st.polls <= (int64_t)st.t_end + 2);
        } else {
            assert_int_equal(st.polls, 0);
        }
        free(st.itl);
    }
    c.poll_interval_s = 1e-4; /* a poll per 100 us would only burn events */
    char why[256] = "";
    assert_int_equal(td_sim_run(&c, r, 4, false, o, &st, why, sizeof why), TD_ERR_INVALID);
    assert_non_null(strstr(why, "poll"));
}

static void test_neighbours(void **state) {
    (void)state;
    td_sim_cluster c = one(16, 1024, 1024, 1024, 256);
    c.router = true;
    c.n_inst = 2;
    c.inst[0].has_beside = true;
    c.inst[0].step_beside = (td_step_model){.c0 = 0.020, .c_tok = 0.002};
    c.inst[1] = c.inst[0];
    td_sim_segment seg = {-1, 100};
    td_sim_request r[3] = {{0, &seg, 1, 1}, {0.05, &seg, 1, 1}, {1.0, &seg, 1, 1}};
    td_sim_outcome o[3];
    td_sim_stats st;
    run(&c, r, 3, o, &st);
    assert_int_not_equal(o[0].d, o[1].d);
    assert_float_equal(o[0].ttft, 0.170, 1e-9);
    assert_float_equal(o[1].ttft, 0.170, 1e-9);
    assert_float_equal(o[2].ttft, 0.110, 1e-9);
    assert_int_equal(st.steps_beside, 2);
    assert_float_equal(st.busy_s[0] + st.busy_s[1], 0.170 + 0.170 + 0.110, 1e-9);
    free(st.itl);
    for (int k = 0; k < 2; k++) { /* a machine each; no beside model */
        c.inst[1].host = k == 0 ? 1 : 0;
        c.inst[0].has_beside = c.inst[1].has_beside = k == 0;
        run(&c, r, 3, o, &st);
        for (int i = 0; i < 3; i++) assert_float_equal(o[i].ttft, 0.110, 1e-9);
        assert_int_equal(st.steps_beside, 0);
        free(st.itl);
    }
    c.inst[1].host = -2;
    char why[256] = "";
    assert_int_equal(td_sim_run(&c, r, 3, false, o, &st, why, sizeof why), TD_ERR_INVALID);
    assert_non_null(strstr(why, "host"));
}

static void test_step_features(void **state) {
    (void)state;
    double a, a2;
    td_step_attn(2, 3, &a, &a2); /* positions 3, 4, 5 */
    assert_float_equal(a, 12, 1e-12);
    assert_float_equal(a2, 50, 1e-12);
    td_step_attn(0, 1, &a, &a2);
    assert_float_equal(a, 1, 1e-12);
    assert_float_equal(a2, 1, 1e-12);
    td_step_model m = {
        .c0 = 1, .c_tok = 2, .c_tok2 = 3, .c_attn = 4, .c_attn2 = 5, .c_ctx = 6, .c_seq = 7};
    assert_float_equal(td_step_model_eval(&m, 10, 100, 1000, 50, 2),
                       1 + 20 + 300 + 400 + 5000 + 300 + 14, 1e-9);
    /* the hinges at 2, 4, 8, 16 tokens: 10 tokens pass the first three */
    m.c_n[0] = 0.5;
    m.c_n[1] = -0.25;
    m.c_n[2] = 1;
    m.c_n[3] = 100;
    assert_float_equal(td_step_model_eval(&m, 10, 100, 1000, 50, 2),
                       1 + 20 + 300 + 400 + 5000 + 300 + 14 + 0.5 * 8 - 0.25 * 6 + 1 * 2, 1e-9);
}

static void test_tpot_target(void **state) {
    (void)state;
    td_sim_segment s0 = {-1, 16}, s1 = {-1, 400};
    td_sim_request r[2] = {{0, &s0, 1, 200}, {0.1, &s1, 1, 1}};
    for (int with = 0; with < 2; with++) {
        td_sim_cluster c = one(16, 512, 64, 1024, 256);
        c.inst[0].sched.tpot_target_s = with ? 0.050 : 0;
        td_sim_outcome o[2];
        td_sim_stats st;
        run(&c, r, 2, o, &st);
        assert_false(o[0].failed || o[1].failed);
        if (!with) {
            assert_float_equal(o[0].itl_max, 0.411, 1e-9);
        } else {
            assert_true(o[0].itl_max <= 0.050 + 1e-9);
            /* 1 + 2 + 4 + 8 + 16 + 32 tokens, then chunks of 38-39: 14
             * to 16 steps, each 11 ms of decode plus 1 ms per prompt
             * token (and up to one step of r0's before the first) */
            assert_true(o[1].ttft > 0.400 + 14 * 0.011);
            assert_true(o[1].ttft < 0.400 + 17 * 0.011);
        }
        free(st.itl);
    }
}

static void test_bad_cluster(void **state) {
    (void)state;
    td_sim_cluster c = one(16, 8, 64, 512, 256); /* max_batch_tokens < max_running */
    td_sim_segment seg = {-1, 10};
    td_sim_request r = {0, &seg, 1, 2};
    td_sim_outcome o;
    td_sim_stats st;
    char why[256] = "";
    assert_int_equal(td_sim_run(&c, &r, 1, false, &o, &st, why, sizeof why), TD_ERR_INVALID);
    assert_non_null(strstr(why, "max_batch_tokens"));
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_one_request),
                                       cmocka_unit_test(test_chunked_prefill),
                                       cmocka_unit_test(test_full_batch),
                                       cmocka_unit_test(test_kv_exhaustion),
                                       cmocka_unit_test(test_saturated_prefill_pool),
                                       cmocka_unit_test(test_poll_lag),
                                       cmocka_unit_test(test_neighbours),
                                       cmocka_unit_test(test_step_features),
                                       cmocka_unit_test(test_tpot_target),
                                       cmocka_unit_test(test_bad_cluster)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
