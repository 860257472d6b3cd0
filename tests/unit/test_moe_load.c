/* Mixture-of-experts loading: the tiny Mixtral and Qwen2-MoE test models of
 * tests/models/make_models.py hold the same weights in GGUF (merged 3-D
 * expert tensors, or one tensor per expert) and in HF safetensors (one
 * tensor per expert under Mixtral's or Qwen2-MoE's names), so every
 * expert's matrices, the router and the shared expert must be equal value
 * for value across the formats; config fields as make_models.py writes
 * them; a tensor-parallel shard of an expert is the slice of the full one
 * (rows of gate/up, columns of down) pointing into the same mapping; and
 * the MoE forward pass split over 2 and 4 TP ranks (threads over the
 * in-process comm backend) matches the single-rank run. */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/base/threadpool.h"
#include "common/comm/comm.h"
#include "common/engine/forward.h"
#include "common/kv/kv.h"
#include "common/model/model.h"

#define N_TOK    24 /* prefill 21 tokens, then 3 decode steps */
#define N_BLOCKS 4  /* of 16 positions */

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
    /* Merged tensor: expert x is the x-th (128, 128) block of one mapping. */
    const td_layer_weights *lw = td_model_layer(g, 1);
    assert_ptr_equal((const char *)lw->experts[3].up.data,
                     (const char *)lw->experts[0].up.data + 3 * 128 * 128 * 4);
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
    /* Two mappings of one file: compare offsets from each one's embedding
     * (the shard holds its vocabulary rows from v0 on). */
    int32_t v0, v1;
    td_model_vocab_range(half, &v0, &v1);
    assert_int_equal(v0, 256);
    const char *bf = td_model_tok_embd(full)->data;
    const char *bh = (const char *)td_model_tok_embd(half)->data -
                     (ptrdiff_t)v0 * (ptrdiff_t)td_model_tok_embd(half)->stride;
#define OFF_F(p) ((const char *)(p)-bf)
#define OFF_H(p) ((const char *)(p)-bh)
    for (int x = 0; x < 4; x++) {
        const td_expert_weights *f = &td_model_layer(full, 0)->experts[x];
        const td_expert_weights *s = &td_model_layer(half, 0)->experts[x];
        assert_int_equal(f->gate.type, TD_TYPE_Q8_0);
        assert_int_equal(s->gate.rows, 64);
        assert_int_equal(s->gate.cols, 128);
        assert_int_equal(OFF_H(s->gate.data), OFF_F(f->gate.data) + 64 * (ptrdiff_t)f->gate.stride);
        assert_int_equal(OFF_H(s->up.data), OFF_F(f->up.data) + 64 * (ptrdiff_t)f->up.stride);
        assert_int_equal(s->down.rows, 128);
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

/* ------------------------------------------------------- tensor parallel */

typedef struct {
    const char *path;
    td_comm_group *group; /* NULL: one rank, single backend */
    int rank, size;
    const int32_t *tok;
    float *out; /* (N_TOK, n_vocab) */
    int32_t n_vocab;
    td_status st;
} rank_job;

static void *rank_main(void *arg) {
    rank_job *j = arg;
    td_model *m = NULL;
    td_kv_pool *kv = NULL;
    td_threadpool *tp = NULL;
    td_comm *comm = NULL;
    td_engine *e = NULL;
    td_model_params mp = td_model_default_params();
    mp.path = j->path;
    mp.tp_rank = j->rank;
    mp.tp_size = j->size;
    if ((j->st = td_model_load(&mp, &m))) goto done;
    const td_model_config *c = td_model_get_config(m);
    j->n_vocab = c->n_vocab;
    td_kv_params kp = td_kv_default_params();
    kp.n_layers = c->n_layer;
    kp.n_kv_heads = td_model_n_head_kv_local(m);
    kp.head_dim = c->head_dim;
    kp.n_blocks = N_BLOCKS;
    if ((j->st = td_kv_pool_create(&kp, &kv)) || (j->st = td_threadpool_create(1, &tp)) ||
        (j->st = j->group ? td_comm_create_local(j->group, j->rank, &comm)
                          : td_comm_create_single(&comm)))
        goto done;
    td_engine_params ep = td_engine_default_params();
    ep.max_ctx = N_BLOCKS * kp.block_size;
    if ((j->st = td_engine_create(m, kv, tp, comm, &ep, &e))) goto done;
    int32_t blocks[N_BLOCKS];
    for (int i = 0; i < N_BLOCKS; i++) blocks[i] = N_BLOCKS - 1 - i;
    int n_pre = N_TOK - 3;
    td_seq_chunk ch = {.tokens = j->tok,
                       .n_tokens = n_pre,
                       .block_table = blocks,
                       .n_blocks = N_BLOCKS,
                       .logits_all = true};
    if ((j->st = td_engine_forward(e, &ch, 1, j->out))) goto done;
    for (int p = n_pre; p < N_TOK; p++) {
        ch = (td_seq_chunk){.tokens = j->tok + p,
                            .n_tokens = 1,
                            .pos0 = p,
                            .block_table = blocks,
                            .n_blocks = N_BLOCKS};
        if ((j->st = td_engine_forward(e, &ch, 1, j->out + (size_t)p * (size_t)c->n_vocab)))
            goto done;
    }
done:
    td_engine_destroy(e);
    td_comm_destroy(comm);
    td_threadpool_destroy(tp);
    td_kv_pool_destroy(kv);
    td_model_free(m);
    return NULL;
}

#define N_VOCAB 512 /* make_models.py */

/* Every expert (and the shared expert) is split like a dense FFN, so TP only
 * changes the F32 summation order of the down products: logits agree within
 * tol, the ranks with each other exactly (the all-reduce adds in rank order
 * everywhere). */
static void tp_case(const char *rel, int size, double tol) {
    const char *dir = models_dir();
    if (!dir) skip();
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, rel);
    int32_t tok[N_TOK];
    for (int i = 0; i < N_TOK; i++) tok[i] = (int32_t)((i * 193 + 71) % N_VOCAB);
    size_t n_out = (size_t)N_TOK * N_VOCAB;
    rank_job one = {.path = path, .size = 1, .tok = tok, .out = calloc(n_out, sizeof(float))};
    rank_main(&one);
    assert_int_equal(one.st, TD_OK);
    assert_int_equal(one.n_vocab, N_VOCAB);
    td_comm_group *g = NULL;
    assert_int_equal(td_comm_group_create(size, &g), TD_OK);
    rank_job jobs[4];
    pthread_t th[4];
    assert_true(size <= 4);
    for (int r = 0; r < size; r++) {
        jobs[r] = (rank_job){.path = path,
                             .group = g,
                             .rank = r,
                             .size = size,
                             .tok = tok,
                             .out = calloc(n_out, sizeof(float))};
        assert_int_equal(pthread_create(&th[r], NULL, rank_main, &jobs[r]), 0);
    }
    for (int r = 0; r < size; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < size; r++) {
        assert_int_equal(jobs[r].st, TD_OK);
        assert_memory_equal(jobs[0].out, jobs[r].out, n_out * sizeof(float));
    }
    double worst = 0;
    for (int t = 0; t < N_TOK; t++) {
        double mx = 0, d = 0;
        for (int v = 0; v < N_VOCAB; v++) {
            size_t i = (size_t)t * N_VOCAB + (size_t)v;
            assert_true(isfinite(one.out[i]));
            mx = fmax(mx, fabs(one.out[i]));
            d = fmax(d, fabs((double)jobs[0].out[i] - one.out[i]));
        }
        assert_true(mx > 0);
        worst = fmax(worst, d / mx);
    }
    print_message("    %s: tp=%d vs tp=1 max relative logit difference %.2e\n", rel, size, worst);
    assert_true(worst <= tol);
    for (int r = 0; r < size; r++) free(jobs[r].out);
    free(one.out);
    td_comm_group_destroy(g);
}

static void test_tp_forward(void **state) {
    (void)state;
    /* F32 accumulation of split sums: a few ulps per layer (~1e-6 relative
     * on the dense tiny models); 1e-5 is far below what a wrong slice or a
     * routing difference would give (order 1). Q8_0 weights meet F32
     * activations (the CPU backend dequantizes on the fly), so the same bound holds. */
    tp_case("gguf/mixtral-f32.gguf", 2, 1e-5);
    tp_case("gguf/mixtral-q8_0.gguf", 4, 1e-5); /* per-expert tensors, KV heads replicated */
    tp_case("hf/qwen2moe-f32", 2, 1e-5);        /* shared expert and its gate */
    tp_case("gguf/qwen2moe-q8_0.gguf", 4, 1e-5);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mixtral),
        cmocka_unit_test(test_qwen2moe),
        cmocka_unit_test(test_tp_shard),
        cmocka_unit_test(test_tp_forward),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
