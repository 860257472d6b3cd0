/* Parallel plan (plan.h): rank order, validation against model shapes,
 * layer splits, traffic figures and the dry-run report. Expected values
 * are computed by hand from the formulas the header states. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/model/model.h"
#include "common/parallel/plan.h"

/* SmolLM2-135M's shape: 9 heads, 3 KV heads, 30 layers, Q4_1 (32-element blocks). */
static td_model_config smol(void) {
    td_model_config c;
    memset(&c, 0, sizeof c);
    snprintf(c.name, sizeof c.name, "smol");
    c.n_vocab = 49152;
    c.n_embd = 576;
    c.n_layer = 30;
    c.n_head = 9;
    c.n_head_kv = 3;
    c.head_dim = 64;
    c.n_ff = 1536;
    c.wtype = TD_TYPE_Q4_1;
    return c;
}

static td_plan *make(td_plan_params p, td_model_config c, int32_t ne, int32_t nu) {
    td_plan *plan = NULL;
    td_status st = td_plan_create(&p, &c, ne, nu, &plan);
    return st == TD_OK ? plan : NULL;
}

static void test_rank_order(void **state) {
    (void)state;
    td_model_config c = smol();
    c.n_head = 12;
    c.n_head_kv = 4;
    td_plan_params p = td_plan_default_params();
    p.tp = 2;
    p.cp = 3;
    p.pp = 2;
    td_plan *plan = make(p, c, 0, 0);
    assert_non_null(plan);
    assert_int_equal(td_plan_world(plan), 12);
    /* TP innermost, then CP, then PP: enumerate the same order by nesting. */
    int r = 0;
    for (int pp = 0; pp < 2; pp++)
        for (int cp = 0; cp < 3; cp++)
            for (int tp = 0; tp < 2; tp++, r++) {
                td_rank_coord rc = td_plan_rank(plan, r);
                assert_int_equal(rc.rank, r);
                assert_int_equal(rc.tp_rank, tp);
                assert_int_equal(rc.cp_rank, cp);
                assert_int_equal(rc.pp_rank, pp);
                assert_int_equal(rc.layer_begin, pp == 0 ? 0 : 15);
                assert_int_equal(rc.layer_end, pp == 0 ? 15 : 30);
                assert_int_equal(rc.ep_rank, -1);
            }
    td_plan_destroy(plan);
}

static void test_validation(void **state) {
    (void)state;
    td_model_config c = smol();
    td_plan_params p = td_plan_default_params();
    td_plan *plan;
    /* TP 3 divides 9 heads, 3 KV heads and 1536; 9*64/3 = 192 and 512 are
     * multiples of 32. */
    p.tp = 3;
    assert_non_null(plan = make(p, c, 0, 0));
    td_plan_destroy(plan);
    p.tp = 2; /* 9 heads */
    assert_null(make(p, c, 0, 0));
    p.tp = 9; /* KV heads replicated 3x, but 1536 % 9 != 0 */
    assert_null(make(p, c, 0, 0));
    c.n_ff = 1152; /* 1152 / 9 = 128 columns: divisible, on 32-element blocks */
    assert_non_null(plan = make(p, c, 0, 0));
    td_plan_destroy(plan);
    c = smol();
    c.n_head = 6;
    c.n_head_kv = 4; /* tp 3: neither 4 % 3 nor 3 % 4 */
    p.tp = 3;
    assert_null(make(p, c, 0, 0));
    /* Row-parallel slices off the quantisation blocks: 8 heads x 8 dims / 2 = 32
     * columns fine; head_dim 4 gives 16 columns: not on a Q4_1 block. */
    c = smol();
    c.n_head = 8;
    c.n_head_kv = 8;
    c.head_dim = 4;
    p.tp = 2;
    assert_null(make(p, c, 0, 0));
    c.wtype = TD_TYPE_F32;
    assert_non_null(plan = make(p, c, 0, 0));
    td_plan_destroy(plan);
    /* PP: more stages than layers; explicit splits that do not add up. */
    c = smol();
    p = td_plan_default_params();
    p.pp = 31;
    assert_null(make(p, c, 0, 0));
    p.pp = 2;
    p.pp_layers[0] = 10;
    p.pp_layers[1] = 19;
    assert_null(make(p, c, 0, 0));
    p.pp_layers[1] = 20;
    assert_non_null(plan = make(p, c, 0, 0));
    assert_int_equal(td_plan_rank(plan, 0).layer_end, 10);
    assert_int_equal(td_plan_rank(plan, 1).layer_begin, 10);
    assert_int_equal(td_plan_rank(plan, 1).layer_end, 30);
    td_plan_destroy(plan);
    p.pp = 3; /* two explicit stages for three */
    assert_null(make(p, c, 0, 0));
    /* Even split: 30 layers over 4 stages = 8, 8, 7, 7. */
    p = td_plan_default_params();
    p.pp = 4;
    assert_non_null(plan = make(p, c, 0, 0));
    const int ends[] = {8, 16, 23, 30};
    for (int s = 0; s < 4; s++) assert_int_equal(td_plan_rank(plan, s).layer_end, ends[s]);
    td_plan_destroy(plan);
}

static void test_experts(void **state) {
    (void)state;
    td_model_config c = smol();
    c.n_head = 8;
    c.n_head_kv = 4;
    c.wtype = TD_TYPE_F32;
    td_plan_params p = td_plan_default_params();
    p.ep = 2; /* dense model */
    assert_null(make(p, c, 0, 0));
    p = td_plan_default_params();
    p.attn_dp = true;
    assert_null(make(p, c, 0, 0));
    /* MoE, 8 experts top-2: EP defaults to the TP group. */
    p = td_plan_default_params();
    p.tp = 2;
    td_plan *plan = make(p, c, 8, 2);
    assert_non_null(plan);
    assert_int_equal(td_plan_params_get(plan)->ep, 2);
    assert_int_equal(td_plan_rank(plan, 1).ep_rank, 1);
    td_plan_destroy(plan);
    p.ep = 3; /* neither 8 experts nor 2 TP ranks */
    assert_null(make(p, c, 8, 2));
    p.ep = 4; /* divides the experts but not the 2 ranks of a TP group */
    assert_null(make(p, c, 8, 2));
    p.cp = 2; /* 4 ranks per stage, but EP stays inside a TP group */
    assert_null(make(p, c, 8, 2));
    /* tp 4, ep 2: two EP groups per TP group, ranks {0,1} and {2,3}. */
    p = td_plan_default_params();
    p.tp = 4;
    p.ep = 2;
    assert_non_null(plan = make(p, c, 8, 2));
    for (int r = 0; r < 4; r++) assert_int_equal(td_plan_rank(plan, r).ep_rank, r % 2);
    /* Each TP rank routes 1/4 of the rows; half of their 2 choices leave. */
    double hidden = 30 * 576 * 4.0;
    assert_true(td_plan_traffic(plan, 3).ep_per_token == hidden * 2 * 2 * 1 / 2 / 4);
    td_plan_destroy(plan);
    p.attn_dp = true; /* attention-DP needs ep == tp */
    assert_null(make(p, c, 8, 2));
    /* Attention-DP over tp 2: whole attention (no TP traffic, every KV
     * head), experts over the same ranks; rank 1 also sends its logit rows'
     * hidden states to rank 0. */
    p = td_plan_default_params();
    p.tp = 2;
    p.attn_dp = true;
    assert_non_null(plan = make(p, c, 8, 2));
    td_rank_traffic t0 = td_plan_traffic(plan, 0), t1 = td_plan_traffic(plan, 1);
    assert_true(t0.tp_per_token == 0);
    assert_true(t0.kv_bytes_per_token == 30 * 4 * 64 * 2 * 4.0);
    assert_true(t0.ep_per_token == hidden * 2 * 2 * 1 / 2 / 2);
    assert_true(t1.ep_per_token == t0.ep_per_token + 576 * 4.0 / 2);
    td_plan_destroy(plan);
    p.cp = 2;
    assert_null(make(p, c, 8, 2));
    /* Heads need not divide by TP under attention-DP: 6 experts over 3. */
    p = td_plan_default_params();
    p.tp = 3;
    assert_null(make(p, c, 6, 2));
    p.attn_dp = true;
    assert_non_null(plan = make(p, c, 6, 2));
    td_plan_destroy(plan);
    /* Under EP the routed experts are whole: their width need not divide
     * by TP, the shared expert's must. */
    p = td_plan_default_params();
    p.tp = 4;
    c.n_ff_exp = 96 + 2;
    assert_non_null(plan = make(p, c, 8, 2));
    td_plan_destroy(plan);
    p.ep = 1;
    assert_null(make(p, c, 8, 2));
    p.ep = 4;
    c.n_ff_shexp = 98;
    assert_null(make(p, c, 8, 2));
    p = td_plan_default_params();
    assert_null(make(p, c, 8, 9)); /* top-9 of 8 */
}

static void test_traffic(void **state) {
    (void)state;
    td_model_config c = smol();
    td_plan_params p = td_plan_default_params();
    p.tp = 3;
    p.pp = 2;
    p.cp = 2;
    td_plan *plan = make(p, c, 0, 0);
    assert_non_null(plan);
    /* Rank 0: stage 0 (15 layers), tp 3, cp 2, 1 KV head per rank. */
    td_rank_traffic t = td_plan_traffic(plan, 0);
    double layers = 15, hidden = 576 * 4.0;
    assert_true(t.tp_per_token == layers * 2 * hidden * 2 * 2 / 3);
    assert_true(t.pp_per_token == hidden);
    double kv = layers * 1 * 64 * 2 * 4.0;
    assert_true(t.kv_bytes_per_token == kv / 2);
    assert_true(t.pcp_per_token == kv / 2 * 1);
    assert_true(t.dcp_per_token == layers * 3 * (64 + 2) * 4.0 * 1 / 2);
    assert_true(t.ep_per_token == 0);
    /* Vocab-parallel embedding (first stage) and head (last stage): an
     * all-reduce of the hidden state, an all-gather of 49152 / 3 logits. */
    assert_true(t.embd_per_token == hidden * 2 * 2 / 3);
    assert_true(t.head_per_row == 0);
    td_rank_traffic last = td_plan_traffic(plan, td_plan_world(plan) - 1);
    assert_true(last.embd_per_token == 0);
    assert_true(last.head_per_row == 16384 * 4.0 * 2);
    /* Last stage sends nothing down the pipeline. */
    assert_true(last.pp_per_token == 0);
    td_plan_destroy(plan);
}

static void test_flags(void **state) {
    (void)state;
    td_plan_params p = td_plan_default_params();
    assert_true(td_plan_set_flag(&p, TD_PLAN_FLAG_TP, "4"));
    assert_int_equal(p.tp, 4);
    assert_true(td_plan_set_flag(&p, TD_PLAN_FLAG_PP_LAYERS, "3,5,7"));
    assert_int_equal(p.pp_layers[0], 3);
    assert_int_equal(p.pp_layers[2], 7);
    assert_int_equal(p.pp_layers[3], 0);
    assert_true(td_plan_set_flag(&p, TD_PLAN_FLAG_CP_MODE, "ring"));
    assert_int_equal(p.cp_mode, TD_CP_RING);
    assert_true(td_plan_set_flag(&p, TD_PLAN_FLAG_CP_MIN_TOKENS, "0"));
    assert_int_equal(p.cp_min_tokens, 0);
    assert_true(td_plan_set_flag(&p, TD_PLAN_FLAG_ATTN_DP, NULL));
    assert_true(p.attn_dp);
    assert_false(td_plan_set_flag(&p, TD_PLAN_N_FLAGS, "x"));
    /* a bad value leaves the plan as it was */
    td_plan_params before = p;
    assert_false(td_plan_set_flag(&p, TD_PLAN_FLAG_TP, "0"));
    assert_false(td_plan_set_flag(&p, TD_PLAN_FLAG_TP, "2x"));
    assert_false(td_plan_set_flag(&p, TD_PLAN_FLAG_PP_LAYERS, "3,,4"));
    assert_false(td_plan_set_flag(&p, TD_PLAN_FLAG_PP_LAYERS, "3,0"));
    assert_false(td_plan_set_flag(&p, TD_PLAN_FLAG_CP_MODE, "mesh"));
    assert_false(td_plan_set_flag(&p, TD_PLAN_FLAG_CP, NULL));
    assert_false(td_plan_set_flag(&p, TD_PLAN_FLAG_CP_MIN_TOKENS, "-1"));
    assert_memory_equal(&p, &before, sizeof p);
}

/* The report loads each shard: the weight bytes of a 1-rank plan equal a
 * plain load's, and a TP 2 x PP 2 plan's four shards add up to the whole
 * (every matrix is split, the vocab-parallel head included; the norms are
 * not counted). */
static void test_report(void **state) {
    (void)state;
    const char *dir = getenv("TANDEM_TEST_MODELS");
    assert_non_null(dir);
    char path[1024];
    snprintf(path, sizeof path, "%s/gguf/llama2-f32.gguf", dir);
    td_model_params mp = td_model_default_params();
    mp.path = path;
    td_model *m = NULL;
    assert_int_equal(td_model_load(&mp, &m), TD_OK);
    td_model_config c = *td_model_get_config(m);
    size_t whole = td_model_weight_bytes(m);
    td_model_free(m);

    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    td_plan_params p = td_plan_default_params();
    td_plan *plan = make(p, c, 0, 0);
    assert_non_null(plan);
    assert_int_equal(td_plan_report(plan, path, f), TD_OK);
    fclose(f);
    assert_non_null(strstr(buf, "what state is split"));
    assert_non_null(strstr(buf, "what is replicated"));
    assert_non_null(strstr(buf, "what crosses the interconnect"));
    assert_non_null(strstr(buf, "what the plan improves"));
    free(buf);
    td_plan_destroy(plan);

    p.tp = 2;
    p.pp = 2;
    plan = make(p, c, 0, 0);
    assert_non_null(plan);
    size_t sum = 0;
    for (int r = 0; r < 4; r++) {
        td_rank_coord rc = td_plan_rank(plan, r);
        td_model_params sp = td_model_default_params();
        sp.path = path;
        sp.tp_rank = rc.tp_rank;
        sp.tp_size = 2;
        sp.layer_begin = rc.layer_begin;
        sp.layer_end = rc.layer_end;
        assert_int_equal(td_model_load(&sp, &m), TD_OK);
        sum += td_model_weight_bytes(m);
        td_model_free(m);
    }
    assert_int_equal(sum, whole);
    buf = NULL;
    f = open_memstream(&buf, &len);
    assert_int_equal(td_plan_report(plan, path, f), TD_OK);
    fclose(f);
    assert_non_null(strstr(buf, "TP 2: attention heads"));
    assert_non_null(strstr(buf, "PP 2: layers by stage"));
    free(buf);
    td_plan_destroy(plan);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rank_order), cmocka_unit_test(test_validation),
        cmocka_unit_test(test_experts),    cmocka_unit_test(test_traffic),
        cmocka_unit_test(test_flags),      cmocka_unit_test(test_report),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
