/* Vocab-parallel embedding and output head, and the engine's per-call
 * compute / communication timing.
 *
 * - Shards: a TP shard of tp ranks holds rows [v0, v1) of token_embd and
 *   output (slices of ceil(n_vocab / tp) rows in rank order), byte for byte
 *   the full model's rows (F32 and quantized tables, tied and untied, a
 *   vocabulary of 515 that neither 2 nor 3 divides), and its weight bytes
 *   count only its slice of the head.
 * - Forward: TP 2, 3 and 4 against the single-rank engine (the reference,
 *   itself checked against the NumPy reference elsewhere). The layers'
 *   all-reduces change the F32 summation order, so whole-model logits are
 *   compared within a tolerance; the embedding and head are isolated with a
 *   "passthrough" model whose layers add exactly zero (o_proj and down_proj
 *   zero), where the logits must be bit-identical; and the head of quantized
 *   tables is isolated at the op the engine uses (the CPU backend's matmul
 *   over a shard's rows vs the full table's), also bit-identical. Every rank
 *   of a TP group receives the same complete logits.
 * - Timing: TP 2 spends time in comm calls (comm_s > 0) and computes
 *   (compute_s > 0), with the exact count and payload of the calls; a world
 *   of one makes no comm calls (comm_s == 0). */
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

#define N_PRE    13 /* prefill tokens (logits for every one) */
#define N_DEC    3  /* then single-token decode steps */
#define N_TOK    (N_PRE + N_DEC)
#define N_BLOCKS 2 /* of 16 positions */
#define MAX_TP   4

static td_model *load_path(const char *path, int tp_rank, int tp_size, int layer_begin) {
    td_model_params p = td_model_default_params();
    p.path = path;
    p.tp_rank = tp_rank;
    p.tp_size = tp_size;
    p.layer_begin = layer_begin;
    td_model *m = NULL;
    if (td_model_load(&p, &m) != TD_OK)
        fail_msg("%s (tp %d of %d) does not load", path, tp_rank, tp_size);
    return m;
}

static void model_path(const char *rel, char *buf, size_t cap) {
    const char *dir = getenv("TANDEM_TEST_MODELS");
    if (!dir) {
        print_message("TANDEM_TEST_MODELS not set\n");
        skip();
    }
    snprintf(buf, cap, "%s/%s", dir, rel);
}

/* ------------------------------------------------------------------ shards */

static size_t matrix_bytes(const td_weight *w) {
    return td_dtype_row_bytes(w->type, w->cols) * (size_t)w->rows;
}

/* Bytes of every matrix the shard holds, counted from its weights (the
 * embedding excluded: td_model_weight_bytes counts what a token streams). */
static size_t shard_matrix_bytes(const td_model *m) {
    size_t n = 0;
    for (int l = td_model_layer_begin(m); l < td_model_layer_end(m); l++) {
        const td_layer_weights *lw = td_model_layer(m, l);
        const td_weight *ws[] = {&lw->wq,     &lw->wk,   &lw->wv,    &lw->wo,
                                 &lw->w_gate, &lw->w_up, &lw->w_down};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) n += matrix_bytes(ws[i]);
    }
    if (td_model_output(m)) n += matrix_bytes(td_model_output(m));
    return n;
}

/* Rows [v0, v1) of full are the shard's rows, byte for byte. */
static void assert_rows_equal(const td_weight *full, const td_weight *s, int32_t v0, int32_t v1,
                              const char *what) {
    assert_int_equal(s->type, full->type);
    assert_int_equal(s->cols, full->cols);
    assert_int_equal(s->rows, v1 - v0);
    size_t rb = td_dtype_row_bytes(s->type, s->cols);
    for (int32_t v = v0; v < v1; v++)
        if (memcmp((const char *)full->data + (size_t)v * full->stride,
                   (const char *)s->data + (size_t)(v - v0) * s->stride, rb) != 0)
            fail_msg("%s: row of token %d differs from the full table's", what, v);
}

static void shard_case(const char *rel, int tp) {
    char path[1024];
    model_path(rel, path, sizeof path);
    td_model *full = load_path(path, 0, 1, 0);
    const td_model_config *c = td_model_get_config(full);
    const int32_t V = c->n_vocab, per = (V + tp - 1) / tp;
    int32_t f0, f1;
    td_model_vocab_range(full, &f0, &f1);
    assert_int_equal(f0, 0);
    assert_int_equal(f1, V);
    assert_int_equal(td_model_output(full)->rows, V);
    size_t sum = 0;
    int32_t covered = 0;
    for (int r = 0; r < tp; r++) {
        td_model *s = load_path(path, r, tp, 0);
        int32_t v0, v1;
        td_model_vocab_range(s, &v0, &v1);
        assert_int_equal(v0, TD_MIN(r * per, V));
        assert_int_equal(v1, TD_MIN(v0 + per, V));
        assert_int_equal(v0, covered); /* slices tile [0, V) in rank order */
        covered = v1;
        assert_rows_equal(td_model_tok_embd(full), td_model_tok_embd(s), v0, v1, "token_embd");
        assert_rows_equal(td_model_output(full), td_model_output(s), v0, v1, "output");
        if (c->tied_output)
            assert_ptr_equal(td_model_output(s)->data, td_model_tok_embd(s)->data);
        else
            assert_ptr_not_equal(td_model_output(s)->data, td_model_tok_embd(s)->data);
        assert_int_equal(td_model_weight_bytes(s), shard_matrix_bytes(s));
        sum += td_model_weight_bytes(s);
        td_model_free(s);
    }
    assert_int_equal(covered, V);
    /* Without replicated KV heads every matrix is split into disjoint
     * pieces, the head included: the shards add up to the whole exactly. */
    if (tp <= c->n_head_kv) assert_int_equal(sum, td_model_weight_bytes(full));
    /* A last pipeline stage holds its head slice and no embedding (a tied
     * head still reads its slice of token_embd). */
    if (c->n_layer > 1) {
        td_model *s = load_path(path, tp - 1, tp, c->n_layer - 1);
        int32_t v0, v1;
        td_model_vocab_range(s, &v0, &v1);
        assert_null(td_model_tok_embd(s));
        assert_rows_equal(td_model_output(full), td_model_output(s), v0, v1, "stage output");
        td_model_free(s);
    }
    td_model_free(full);
}

static void test_shards(void **state) {
    (void)state;
    shard_case("gguf/llama2-f32.gguf", 2);      /* untied */
    shard_case("gguf/llama2-q4_0.gguf", 2);     /* Q4_0 embedding and head */
    shard_case("gguf/llama3-q8_0.gguf", 2);     /* tied, Q8_0 */
    shard_case("gguf/llama3-f32.gguf", 4);      /* tied, KV heads replicated */
    shard_case("gguf/tinyllama-mixed.gguf", 4); /* Q8_0 embedding and head, Q4_1 layers */
    shard_case("hf/vocab515-f32", 2);           /* 258 + 257 rows */
    shard_case("hf/vocab515-f32", 3);           /* 172 + 172 + 171 */
}

/* The head of quantized tables, isolated at the kernel the engine calls:
 * logits of a shard's rows equal the full table's, bit for bit. */
static void head_kernel_case(const char *rel, int tp) {
    char path[1024];
    model_path(rel, path, sizeof path);
    td_model *full = load_path(path, 0, 1, 0);
    const td_model_config *c = td_model_get_config(full);
    const int n = 5, E = c->n_embd, V = c->n_vocab;
    float *x = malloc((size_t)n * (size_t)E * sizeof(float));
    float *want = malloc((size_t)n * (size_t)V * sizeof(float));
    float *got = malloc((size_t)n * (size_t)V * sizeof(float));
    assert_non_null(x);
    assert_non_null(want);
    assert_non_null(got);
    uint32_t seed = 12345;
    for (int i = 0; i < n * E; i++) {
        seed = seed * 1664525u + 1013904223u;
        x[i] = (float)((int32_t)(seed >> 8) % 2000) / 1000.0f;
    }
    td_backend *be;
    assert_int_equal(td_backend_cpu_create(NULL, &be), TD_OK);
    const size_t out_bytes = (size_t)n * (size_t)V * sizeof(float);
    td_bbuf *xb = td_backend_alloc(be, (size_t)n * (size_t)E * sizeof(float));
    td_bbuf *wb = td_backend_alloc(be, out_bytes), *gb = td_backend_alloc(be, out_bytes);
    assert_true(xb && wb && gb);
    be->i->copy_from_host(be, td_bview_of(xb), x, (size_t)n * (size_t)E * sizeof(float));
    const size_t ld = (size_t)V;
    const td_weight *w = td_model_output(full);
    td_bview yw = td_bview_of(wb);
    be->i->matmul(be, 1, &w, td_bview_of(xb), (size_t)E, &yw, &ld, n);
    memset(got, 0xff, out_bytes); /* a column no shard writes shows */
    be->i->copy_from_host(be, td_bview_of(gb), got, out_bytes);
    for (int r = 0; r < tp; r++) {
        td_model *s = load_path(path, r, tp, 0);
        int32_t v0, v1;
        td_model_vocab_range(s, &v0, &v1);
        const td_weight *ws = td_model_output(s);
        td_bview yg = td_bview_f32(td_bview_of(gb), (size_t)v0);
        be->i->matmul(be, 1, &ws, td_bview_of(xb), (size_t)E, &yg, &ld, n);
        td_model_free(s);
    }
    be->i->copy_to_host(be, want, td_bview_of(wb), out_bytes);
    be->i->copy_to_host(be, got, td_bview_of(gb), out_bytes);
    td_backend_free(be, xb);
    td_backend_free(be, wb);
    td_backend_free(be, gb);
    td_backend_destroy(be);
    assert_memory_equal(want, got, (size_t)n * (size_t)V * sizeof(float));
    free(x);
    free(want);
    free(got);
    td_model_free(full);
}

static void test_head_kernel(void **state) {
    (void)state;
    head_kernel_case("gguf/tinyllama-mixed.gguf", 4);
    head_kernel_case("gguf/llama3-q8_0.gguf", 2);
    head_kernel_case("gguf/llama2-q4_0.gguf", 2);
}

/* ----------------------------------------------------------------- forward */

typedef struct {
    const char *path;
    td_comm_group *group; /* NULL: one rank, single backend */
    int rank, size;
    const int32_t *tok;
    float *out; /* (N_TOK, n_vocab) */
    int32_t n_vocab, n_embd, n_layer;
    td_engine_timing prefill, decode; /* timing of the prefill and the last decode call */
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
    j->n_embd = c->n_embd;
    j->n_layer = c->n_layer;
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
    ep.max_batch_tokens = 64;
    if ((j->st = td_engine_create(m, kv, tp, comm, &ep, &e))) goto done;
    int32_t blocks[N_BLOCKS] = {1, 0};
    td_seq_chunk ch = {.tokens = j->tok,
                       .n_tokens = N_PRE,
                       .block_table = blocks,
                       .n_blocks = N_BLOCKS,
                       .logits_all = true};
    if ((j->st = td_engine_forward(e, &ch, 1, j->out))) goto done;
    j->prefill = td_engine_last_timing(e);
    for (int p = N_PRE; p < N_TOK; p++) {
        ch = (td_seq_chunk){.tokens = j->tok + p,
                            .n_tokens = 1,
                            .pos0 = p,
                            .block_table = blocks,
                            .n_blocks = N_BLOCKS};
        if ((j->st = td_engine_forward(e, &ch, 1, j->out + (size_t)p * (size_t)c->n_vocab)))
            goto done;
        j->decode = td_engine_last_timing(e);
    }
done:
    td_engine_destroy(e);
    td_comm_destroy(comm);
    td_threadpool_destroy(tp);
    td_kv_pool_destroy(kv);
    td_model_free(m);
    return NULL;
}

/* Runs the model on one rank and on `size` TP ranks (threads over the local
 * backend); jobs[0..size) are the TP ranks, *one the single rank. The
 * caller frees the outputs with free_jobs. */
static void run_ranks(const char *path, int size, const int32_t *tok, size_t n_out, rank_job *one,
                      rank_job *jobs) {
    *one = (rank_job){.path = path, .size = 1, .tok = tok, .out = calloc(n_out, sizeof(float))};
    rank_main(one);
    assert_int_equal(one->st, TD_OK);
    td_comm_group *g = NULL;
    assert_int_equal(td_comm_group_create(size, &g), TD_OK);
    pthread_t th[MAX_TP];
    assert_true(size <= MAX_TP);
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
    td_comm_group_destroy(g);
    for (int r = 0; r < size; r++) assert_int_equal(jobs[r].st, TD_OK);
}

static void free_jobs(rank_job *one, rank_job *jobs, int size) {
    for (int r = 0; r < size; r++) free(jobs[r].out);
    free(one->out);
}

/* Tokens spread over the vocabulary, with its first and last ids (the
 * last rank's rows; for the 515-row model, ids no tokenizer text reaches). */
static void make_tokens(int32_t *tok, int32_t V) {
    for (int i = 0; i < N_TOK; i++) tok[i] = (int32_t)((i * 193 + 71) % V);
    tok[2] = V - 1;
    tok[7] = 0;
    tok[N_PRE] = V - 2;
}

/* exact: the logits must be bit-identical to one rank's; else within tol of
 * the row's largest logit. */
static void tp_case(const char *rel, int size, int32_t V, double tol, bool exact) {
    char path[1024];
    model_path(rel, path, sizeof path);
    int32_t tok[N_TOK];
    make_tokens(tok, V);
    size_t n_out = (size_t)N_TOK * (size_t)V;
    rank_job one, jobs[MAX_TP];
    run_ranks(path, size, tok, n_out, &one, jobs);
    assert_int_equal(one.n_vocab, V);
    /* The all-gather gives every TP rank the same complete logits. */
    for (int r = 1; r < size; r++)
        assert_memory_equal(jobs[0].out, jobs[r].out, n_out * sizeof(float));
    double worst = 0;
    for (int t = 0; t < N_TOK; t++) {
        double mx = 0, d = 0;
        for (int32_t v = 0; v < V; v++) {
            size_t i = (size_t)t * (size_t)V + (size_t)v;
            assert_true(isfinite(one.out[i]));
            mx = fmax(mx, fabs(one.out[i]));
            d = fmax(d, fabs((double)jobs[0].out[i] - one.out[i]));
        }
        assert_true(mx > 0);
        worst = fmax(worst, d / mx);
    }
    print_message("    %s: tp=%d vs tp=1 max relative logit difference %.2e%s\n", rel, size, worst,
                  exact ? " (bit-exact required)" : "");
    if (exact)
        assert_memory_equal(one.out, jobs[0].out, n_out * sizeof(float));
    else
        assert_true(worst <= tol);
    free_jobs(&one, jobs, size);
}

/* F32 accumulation of split sums in the layers' all-reduces: a few ulps per
 * layer (~1e-6 relative on these tiny models); 1e-5 is far below what a
 * wrong vocabulary slice or a misplaced logit block gives (order 1). */
#define TP_TOL 1e-5

static void test_forward_tied(void **state) {
    (void)state;
    tp_case("gguf/llama3-f32.gguf", 2, 512, TP_TOL, false);
    tp_case("gguf/llama3-f32.gguf", 4, 512, TP_TOL, false);
    tp_case("gguf/llama3-q8_0.gguf", 4, 512, TP_TOL, false); /* Q8_0 table */
}

static void test_forward_untied(void **state) {
    (void)state;
    tp_case("gguf/llama2-f32.gguf", 2, 512, TP_TOL, false);
    tp_case("gguf/tinyllama-mixed.gguf", 4, 512, TP_TOL, false); /* Q8_0 embd and head */
}

static void test_forward_uneven_vocab(void **state) {
    (void)state;
    tp_case("hf/vocab515-f32", 2, 515, TP_TOL, false);
    tp_case("hf/vocab515-f32", 3, 515, TP_TOL, false);
    /* Layers that add exactly zero: what remains is the embedding (zeros
     * from the other ranks, summed) and the head (all-gathered slices),
     * which must reproduce one rank's logits bit for bit. */
    tp_case("hf/vocab515-f32-passthrough", 2, 515, 0, true);
    tp_case("hf/vocab515-f32-passthrough", 3, 515, 0, true);
}

/* A TP shard needs the TP group as its communicator. */
static void test_comm_mismatch(void **state) {
    (void)state;
    char path[1024];
    model_path("gguf/llama2-f32.gguf", path, sizeof path);
    td_model *m = load_path(path, 1, 2, 0);
    const td_model_config *c = td_model_get_config(m);
    td_kv_params kp = td_kv_default_params();
    kp.n_layers = c->n_layer;
    kp.n_kv_heads = td_model_n_head_kv_local(m);
    kp.head_dim = c->head_dim;
    kp.n_blocks = N_BLOCKS;
    td_kv_pool *kv = NULL;
    td_comm *comm = NULL;
    td_engine *e = NULL;
    assert_int_equal(td_kv_pool_create(&kp, &kv), TD_OK);
    assert_int_equal(td_comm_create_single(&comm), TD_OK);
    assert_int_equal(td_engine_create(m, kv, NULL, comm, NULL, &e), TD_ERR_INVALID);
    assert_null(e);
    td_comm_destroy(comm);
    td_kv_pool_destroy(kv);
    td_model_free(m);
}

/* ------------------------------------------------------------------ timing */

static void test_timing(void **state) {
    (void)state;
    char path[1024];
    model_path("gguf/llama2-f32.gguf", path, sizeof path);
    const int32_t V = 512;
    int32_t tok[N_TOK];
    make_tokens(tok, V);
    size_t n_out = (size_t)N_TOK * (size_t)V;
    rank_job one, jobs[2];
    run_ranks(path, 2, tok, n_out, &one, jobs);

    /* A world of one: no comm calls, all compute. */
    assert_true(one.prefill.comm_s == 0.0);
    assert_int_equal(one.prefill.comm_calls, 0);
    assert_int_equal(one.prefill.comm_bytes, 0);
    assert_true(one.prefill.compute_s > 0.0);
    assert_true(one.decode.comm_s == 0.0);
    assert_true(one.decode.compute_s > 0.0);

    /* TP 2: per call, the embedding all-reduce, two all-reduces per layer
     * and one logit all-gather (one group of rows: the batch is small). */
    const uint64_t L = (uint64_t)one.n_layer, E = (uint64_t)one.n_embd;
    const uint64_t W = ((uint64_t)V + 1) / 2; /* logits per rank */
    for (int r = 0; r < 2; r++) {
        const td_engine_timing *p = &jobs[r].prefill, *d = &jobs[r].decode;
        print_message("    rank %d prefill: compute %.3f ms, comm %.3f ms in %llu calls, %llu "
                      "bytes\n",
                      r, p->compute_s * 1e3, p->comm_s * 1e3, (unsigned long long)p->comm_calls,
                      (unsigned long long)p->comm_bytes);
        assert_true(p->comm_s > 0.0);
        assert_true(p->compute_s > 0.0);
        assert_true(d->comm_s > 0.0);
        assert_true(d->compute_s > 0.0);
        assert_int_equal(p->comm_calls, 2 * L + 2);
        assert_int_equal(d->comm_calls, 2 * L + 2);
        assert_int_equal(p->comm_bytes, ((2 * L + 1) * N_PRE * E + N_PRE * W) * sizeof(float));
        assert_int_equal(d->comm_bytes, ((2 * L + 1) * E + W) * sizeof(float));
    }
    free_jobs(&one, jobs, 2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shards),
        cmocka_unit_test(test_head_kernel),
        cmocka_unit_test(test_forward_tied),
        cmocka_unit_test(test_forward_untied),
        cmocka_unit_test(test_forward_uneven_vocab),
        cmocka_unit_test(test_comm_mismatch),
        cmocka_unit_test(test_timing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
