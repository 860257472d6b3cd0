/* Mixture-of-experts loading: the tiny Mixtral and Qwen2-MoE test models of
 * tests/models/make_models.py hold the same weights in GGUF (merged 3-D
 * expert tensors, or one tensor per expert) and in HF safetensors (one
 * tensor per expert under Mixtral's or Qwen2-MoE's names), so every
 * expert's matrices, the router and the shared expert must be equal value
 * for value across the formats; config fields as make_models.py writes
 * them; a tensor-parallel shard of an expert is the slice of the full one
 * (rows of gate/up, columns of down) pointing into the same mapping. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/model/model.h"

static const char *models_dir(void) { return getenv("TANDEM_TEST_MODELS"); }

static td_model *load(const char *rel, int tp_rank, int tp_size) {
    const char *dir = models_dir();
    if (!dir) {
        print_message("TANDEM_TEST_MODELS not set\n");
        skip();
    }
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, rel);
    td_model_params p = td_model_default_params();
    p.path = path;
    p.tp_rank = tp_rank;
    p.tp_size = tp_size;
    td_model *m = NULL;
    if (td_model_load(&p, &m) != TD_OK) fail_msg("%s does not load", path);
    return m;
}

/* Two F32 weights hold the same values. */
static void assert_same_f32(const td_weight *a, const td_weight *b, const char *what) {
    assert_int_equal(a->type, TD_TYPE_F32);
    assert_int_equal(b->type, TD_TYPE_F32);
    if (a->rows != b->rows || a->cols != b->cols)
        fail_msg("%s: %lldx%lld vs %lldx%lld", what, (long long)a->rows, (long long)a->cols,
                 (long long)b->rows, (long long)b->cols);
    for (int64_t r = 0; r < a->rows; r++)
        if (memcmp((const char *)a->data + (size_t)r * a->stride,
                   (const char *)b->data + (size_t)r * b->stride, (size_t)a->cols * 4) != 0)
            fail_msg("%s: row %lld differs", what, (long long)r);
}

static void check_experts_equal(const td_model *g, const td_model *h) {
    const td_model_config *c = td_model_get_config(g);
    char what[96];
    for (int l = 0; l < c->n_layer; l++) {
        const td_layer_weights *a = td_model_layer(g, l), *b = td_model_layer(h, l);
        assert_int_equal(a->n_experts_local, c->n_expert);
        assert_int_equal(b->n_experts_local, c->n_expert);
        assert_int_equal(a->router.rows, c->n_expert);
        assert_int_equal(a->router.cols, c->n_embd);
        snprintf(what, sizeof what, "layer %d router", l);
        assert_same_f32(&a->router, &b->router, what);
        for (int x = 0; x < c->n_expert; x++) {
            assert_int_equal(a->experts[x].id, x);
            assert_int_equal(b->experts[x].id, x);
            assert_int_equal(a->experts[x].gate.rows, c->n_ff_exp);
            assert_int_equal(a->experts[x].down.cols, c->n_ff_exp);
            snprintf(what, sizeof what, "layer %d expert %d gate", l, x);
            assert_same_f32(&a->experts[x].gate, &b->experts[x].gate, what);
            snprintf(what, sizeof what, "layer %d expert %d up", l, x);
            assert_same_f32(&a->experts[x].up, &b->experts[x].up, what);
            snprintf(what, sizeof what, "layer %d expert %d down", l, x);
            assert_same_f32(&a->experts[x].down, &b->experts[x].down, what);
        }
        /* The dense FFN is not there. */
        assert_null(a->w_gate.data);
        assert_null(b->w_down.data);
    }
}

static void test_mixtral(void **state) {
    (void)state;
    td_model *g = load("gguf/mixtral-f32.gguf", 0, 1);
    td_model *h = load("hf/mixtral-f32", 0, 1);
    const td_model_config *c = td_model_get_config(g), *ch = td_model_get_config(h);
    assert_int_equal(c->arch, TD_ARCH_LLAMA);
    assert_int_equal(c->n_expert, 4);
    assert_int_equal(c->n_expert_used, 2);
    assert_int_equal(c->n_ff_exp, 128);
    assert_int_equal(c->n_ff_shexp, 0);
    assert_true(c->norm_topk_prob);
    assert_int_equal(ch->n_expert, 4);
    assert_int_equal(ch->n_expert_used, 2);
    assert_int_equal(ch->n_ff_exp, 128);
    assert_true(ch->norm_topk_prob);
    check_experts_equal(g, h);
    /* Merged tensor: expert x is the x-th (128, 64) block of one mapping. */
    const td_layer_weights *lw = td_model_layer(g, 1);
    assert_ptr_equal((const char *)lw->experts[3].up.data,
                     (const char *)lw->experts[0].up.data + 3 * 128 * 64 * 4);
    assert_null(lw->shexp_inp);
    td_model_free(g);
    td_model_free(h);
}

static void test_qwen2moe(void **state) {
    (void)state;
    td_model *g = load("gguf/qwen2moe-f32.gguf", 0, 1);
    td_model *h = load("hf/qwen2moe-f32", 0, 1);
    const td_model_config *c = td_model_get_config(g), *ch = td_model_get_config(h);
    for (int i = 0; i < 2; i++) {
        const td_model_config *k = i ? ch : c;
        assert_int_equal(k->arch, TD_ARCH_QWEN2MOE);
        assert_int_equal(k->n_expert, 8);
        assert_int_equal(k->n_expert_used, 2);
        assert_int_equal(k->n_ff_exp, 128);
        assert_int_equal(k->n_ff_shexp, 256);
        assert_false(k->norm_topk_prob);
        assert_true(k->qkv_bias);
    }
    check_experts_equal(g, h);
    for (int l = 0; l < c->n_layer; l++) {
        const td_layer_weights *a = td_model_layer(g, l), *b = td_model_layer(h, l);
        assert_same_f32(&a->shexp_gate, &b->shexp_gate, "shared gate_proj");
        assert_same_f32(&a->shexp_up, &b->shexp_up, "shared up_proj");
        assert_same_f32(&a->shexp_down, &b->shexp_down, "shared down_proj");
        assert_int_equal(a->shexp_gate.rows, 256);
        assert_non_null(a->shexp_inp);
        assert_non_null(b->shexp_inp);
        assert_memory_equal(a->shexp_inp, b->shexp_inp, (size_t)c->n_embd * sizeof(float));
    }
    td_model_free(g);
    td_model_free(h);
}

/* Rank 1 of 2: expert rows [64, 128) of gate/up, columns [64, 128) of down
 * (Q8_0: 34-byte blocks of 32), per-expert tensors of the Q8_0 file. */
static void test_tp_shard(void **state) {
    (void)state;
    td_model *full = load("gguf/mixtral-q8_0.gguf", 0, 1);
    td_model *half = load("gguf/mixtral-q8_0.gguf", 1, 2);
    /* Two mappings of one file: compare offsets from each one's embedding. */
    const char *bf = td_model_tok_embd(full)->data, *bh = td_model_tok_embd(half)->data;
#define OFF_F(p) ((const char *)(p)-bf)
#define OFF_H(p) ((const char *)(p)-bh)
    for (int x = 0; x < 4; x++) {
        const td_expert_weights *f = &td_model_layer(full, 0)->experts[x];
        const td_expert_weights *s = &td_model_layer(half, 0)->experts[x];
        assert_int_equal(f->gate.type, TD_TYPE_Q8_0);
        assert_int_equal(s->gate.rows, 64);
        assert_int_equal(s->gate.cols, 64);
        assert_int_equal(OFF_H(s->gate.data), OFF_F(f->gate.data) + 64 * (ptrdiff_t)f->gate.stride);
        assert_int_equal(OFF_H(s->up.data), OFF_F(f->up.data) + 64 * (ptrdiff_t)f->up.stride);
        assert_int_equal(s->down.rows, 64);
        assert_int_equal(s->down.cols, 64);
        assert_int_equal(s->down.stride, f->down.stride);
        assert_int_equal(OFF_H(s->down.data), OFF_F(f->down.data) + (64 / 32) * 34);
    }
    /* The router is replicated. */
    assert_same_f32(&td_model_layer(half, 1)->router, &td_model_layer(full, 1)->router, "router");
    td_model_free(full);
    td_model_free(half);
    td_model *q = load("hf/qwen2moe-f32", 1, 2);
    assert_int_equal(td_model_layer(q, 0)->shexp_gate.rows, 128);
    assert_int_equal(td_model_layer(q, 0)->shexp_down.cols, 128);
    assert_int_equal(td_model_layer(q, 0)->experts[7].gate.rows, 64);
    td_model_free(q);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mixtral),
        cmocka_unit_test(test_qwen2moe),
        cmocka_unit_test(test_tp_shard),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
