/* The invariance contract of forward.h, one test per item: a sequence's
 * logits are bit-identical (memcmp) whatever
 *   - the batch it runs in (alone vs a batch of 8 mixed prefill/decode),
 *   - the prefill chunk boundaries,
 *   - a prefix-cache hit (shared blocks filled by an earlier sequence),
 *   - a recompute after preemption (blocks freed, everything run again),
 *   - the thread count (1 vs 2).
 * The KV cache holds TD_TEST_KV_DTYPE (f32 when unset, f16, bf16): the
 * contract holds for every KV dtype (ctest runs it with each), and with
 * TD_TEST_ACT_INT8=1 for int8 activations (--act-int8).
 * The reference for each is the same sequence run alone in one call, so
 * these tests compare the engine with itself by design: that is what the
 * contract states. Each test also checks that the logits are finite and
 * vary with the position, so a degenerate engine (all zeros) cannot pass.
 * Models: tiny random ones from $TANDEM_TEST_MODELS (quantised GQA, Qwen2
 * with biases, Llama 3 with rope_freqs), and the default model if present.
 * TD_TEST_INVARIANCE_MODEL=<name in models.json> runs the tests of the
 * contract on that tiny model alone (ctest: one run per weight type that
 * k_tiny leaves out), without the tests that do not depend on the weights. */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>

#include "common/backend/backend.h"
#include "common/base/threadpool.h"
#include "common/comm/comm.h"
#include "common/engine/forward.h"
#include "common/kv/kv.h"
#include "common/model/model.h"

#define N_BLOCKS 256
#define MAX_CTX  160
#define N_BATCH  8

typedef struct {
    td_model *m;
    td_kv_pool *kv;
    td_threadpool *tp;
    td_comm *comm;
    td_engine *e;
    int32_t V;
    int bs;
} harness;

/* The KV dtype of every pool here: $TD_TEST_KV_DTYPE, f32 when unset. */
static td_dtype kv_dtype(void) {
    const char *name = getenv("TD_TEST_KV_DTYPE");
    td_dtype t = TD_TYPE_F32;
    if (name && !td_kv_dtype_parse(name, &t)) fail_msg("TD_TEST_KV_DTYPE=%s: not a KV dtype", name);
    return t;
}

static void h_open(harness *h, const char *path, int n_threads) {
    memset(h, 0, sizeof *h);
    td_model_params mp = td_model_default_params();
    mp.path = path;
    assert_int_equal(td_model_load(&mp, &h->m), TD_OK);
    const td_model_config *c = td_model_get_config(h->m);
    td_kv_params kp = td_kv_default_params();
    kp.n_layers = c->n_layer;
    kp.n_kv_heads = c->n_head_kv;
    kp.head_dim = c->head_dim;
    kp.dtype = kv_dtype();
    kp.n_blocks = N_BLOCKS;
    assert_int_equal(td_kv_pool_create(&kp, &h->kv), TD_OK);
    assert_int_equal(td_threadpool_create(n_threads, &h->tp), TD_OK);
    assert_int_equal(td_threadpool_size(h->tp), n_threads);
    assert_int_equal(td_comm_create_single(&h->comm), TD_OK);
    td_engine_params ep = td_engine_default_params();
    ep.max_batch_tokens = 512;
    ep.max_seqs = 16;
    ep.max_ctx = MAX_CTX;
    assert_int_equal(td_engine_create(h->m, h->kv, h->tp, h->comm, &ep, &h->e), TD_OK);
    h->V = c->n_vocab;
    h->bs = kp.block_size;
}

static void h_close(harness *h) {
    assert_int_equal(td_kv_pool_n_free(h->kv), N_BLOCKS); /* every test returns its blocks */
    td_engine_destroy(h->e);
    td_comm_destroy(h->comm);
    td_threadpool_destroy(h->tp);
    td_kv_pool_destroy(h->kv);
    td_model_free(h->m);
}

static int32_t *make_tokens(int n, uint32_t seed, int32_t V) {
    int32_t *t = malloc((size_t)n * sizeof *t);
    assert_non_null(t);
    uint32_t s = seed * 2654435761u + 12345u;
    for (int i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        t[i] = 3 + (int32_t)((s >> 8) % (uint32_t)(V - 3));
    }
    return t;
}

static float *alloc_logits(const harness *h, int rows) {
    float *l = malloc((size_t)rows * (size_t)h->V * sizeof(float));
    assert_non_null(l);
    return l;
}

static int32_t n_blocks_for(const harness *h, int n) { return (n + h->bs - 1) / h->bs; }

/* Logits are finite and not the same at every position. */
static void check_sane(const harness *h, const float *l, int rows) {
    for (size_t i = 0; i < (size_t)rows * (size_t)h->V; i++) assert_true(isfinite(l[i]));
    bool varies = false;
    for (int j = 1; j < h->V && !varies; j++) varies = l[j] != l[0];
    assert_true(varies);
    if (rows > 1) assert_memory_not_equal(l, l + h->V, (size_t)h->V * sizeof(float));
}

/* Runs n tokens from position 0 in chunks of `chunk` (a single call when
 * chunk >= n) into freshly allocated blocks; logits of every position. */
static void run_chunked(harness *h, const int32_t *tok, int n, int chunk, float *out) {
    int32_t nb = n_blocks_for(h, n), blocks[MAX_CTX];
    assert_int_equal(td_kv_block_alloc(h->kv, nb, blocks), TD_OK);
    for (int p = 0; p < n; p += chunk) {
        td_seq_chunk c = {.tokens = tok + p,
                          .n_tokens = TD_MIN(chunk, n - p),
                          .pos0 = p,
                          .block_table = blocks,
                          .n_blocks = nb,
                          .logits_all = true};
        assert_int_equal(td_engine_forward(h->e, &c, 1, out + (size_t)p * (size_t)h->V), TD_OK);
    }
    td_kv_block_free(h->kv, blocks, nb);
}

static const char *test_models_dir(void) { return getenv("TANDEM_TEST_MODELS"); }

/* Tiny models exercised by every test (names from models.json). */
static const char *k_tiny[] = {"smollm2-mixed-gguf", "qwen2-f32-gguf", "llama3-q8_0-gguf",
                               "tinyllama-q4_0-gguf"};

/* $TD_TEST_INVARIANCE_MODEL, in place of k_tiny when set. */
static const char *g_only_model;

static bool tiny_path(const char *name, char *buf, size_t cap) {
    const char *dir = test_models_dir();
    if (!dir) return false;
    /* Manifest paths are "<format>/<file>"; the name encodes both. */
    char file[128];
    snprintf(file, sizeof file, "%s", name);
    char *dash = strrchr(file, '-');
    if (!dash) return false;
    *dash = '\0';
    snprintf(buf, cap, "%s/gguf/%s.gguf", dir, file);
    struct stat sb;
    return stat(buf, &sb) == 0;
}

/* The default model where the setup installs it (common/runtime/cli.c's rule). */
static bool default_model(char *buf, size_t cap) {
    const char *env = getenv("TANDEM_MODEL"), *xdg = getenv("XDG_CACHE_HOME");
    const char *home = getenv("HOME");
    if (env && env[0])
        snprintf(buf, cap, "%s", env);
    else if (xdg && xdg[0])
        snprintf(buf, cap, "%s/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf", xdg);
    else
        snprintf(buf, cap, "%s/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf",
                 home ? home : ".");
    struct stat sb;
    return stat(buf, &sb) == 0;
}

typedef void (*model_test)(const char *path, int n_threads, int len_scale);

static void for_tiny_models(model_test fn) {
    if (!test_models_dir()) {
        print_message("TANDEM_TEST_MODELS not set\n");
        skip();
    }
    if (g_only_model) {
        char path[4096];
        if (!tiny_path(g_only_model, path, sizeof path))
            fail_msg("TD_TEST_INVARIANCE_MODEL=%s: no such tiny model", g_only_model);
        fn(path, 2, 4);
        return;
    }
    for (size_t i = 0; i < TD_ARRAY_SIZE(k_tiny); i++) {
        char path[4096];
        assert_true(tiny_path(k_tiny[i], path, sizeof path));
        fn(path, 2, 4);
    }
}

static void for_default_model(model_test fn) {
    char path[4096];
    if (!default_model(path, sizeof path)) {
        print_message("default model not installed: %s\n", path);
        skip();
    }
    fn(path, 2, 1);
}

/* ---------------------------------------------------------------- chunks */

static void chunks_case(const char *path, int n_threads, int len_scale) {
    harness h;
    h_open(&h, path, n_threads);
    int n = 12 * len_scale + 5; /* crosses block boundaries */
    int32_t *tok = make_tokens(n, 7, h.V);
    float *ref = alloc_logits(&h, n), *got = alloc_logits(&h, n);
    run_chunked(&h, tok, n, n, ref);
    check_sane(&h, ref, n);
    const int chunks[] = {1, 2, 3, 7, 16, 17};
    for (size_t i = 0; i < TD_ARRAY_SIZE(chunks); i++) {
        memset(got, 0, (size_t)n * (size_t)h.V * sizeof(float));
        run_chunked(&h, tok, n, chunks[i], got);
        assert_memory_equal(ref, got, (size_t)n * (size_t)h.V * sizeof(float));
    }
    free(ref);
    free(got);
    free(tok);
    h_close(&h);
}

static void test_chunks_tiny(void **state) {
    (void)state;
    for_tiny_models(chunks_case);
}
static void test_chunks_default(void **state) {
    (void)state;
    for_default_model(chunks_case);
}

/* ----------------------------------------------------------------- batch */

/* 8 sequences of different lengths, each with a prompt prefilled in chunks
 * of its own size (starting at different steps) and then decoded one token
 * per step, all in shared calls; blocks are allocated one at a time as the
 * sequences grow, so block tables interleave. Odd sequences ask for the
 * last row only in their prefill chunks. Every logit row produced must
 * equal the row of the same position when the sequence runs alone. */
static void batch_case(const char *path, int n_threads, int len_scale) {
    harness h;
    h_open(&h, path, n_threads);
    int len[N_BATCH], prompt[N_BATCH], chunk[N_BATCH], start[N_BATCH], done[N_BATCH];
    int32_t *tok[N_BATCH], blocks[N_BATCH][MAX_CTX], nb[N_BATCH];
    float *ref[N_BATCH];
    int compared[N_BATCH];
    for (int i = 0; i < N_BATCH; i++) {
        len[i] = 3 + ((i * 5 + 3) % 9) * len_scale + i;
        prompt[i] = len[i] - 1 - i % 4;
        chunk[i] = 1 + (i * 3) % 7 + len_scale;
        start[i] = i % 3;
        done[i] = 0;
        nb[i] = 0;
        compared[i] = 0;
        tok[i] = make_tokens(len[i], 100 + (uint32_t)i, h.V);
        ref[i] = alloc_logits(&h, len[i]);
        run_chunked(&h, tok[i], len[i], len[i], ref[i]);
        check_sane(&h, ref[i], len[i]);
    }
    td_seq_chunk c[N_BATCH];
    int who[N_BATCH];
    float *out = alloc_logits(&h, 512);
    int mixed_steps = 0;
    for (int step = 0;; step++) {
        int n = 0, n_prefill = 0, n_decode = 0;
        for (int i = 0; i < N_BATCH; i++) {
            if (step < start[i] || done[i] >= len[i]) continue;
            bool pre = done[i] < prompt[i];
            int k = pre ? TD_MIN(chunk[i], prompt[i] - done[i]) : 1;
            while (nb[i] * h.bs < done[i] + k) {
                assert_int_equal(td_kv_block_alloc(h.kv, 1, &blocks[i][nb[i]]), TD_OK);
                nb[i]++;
            }
            c[n] = (td_seq_chunk){.tokens = tok[i] + done[i],
                                  .n_tokens = k,
                                  .pos0 = done[i],
                                  .block_table = blocks[i],
                                  .n_blocks = nb[i],
                                  .logits_all = !(pre && i % 2 == 1)};
            who[n++] = i;
            if (pre)
                n_prefill++;
            else
                n_decode++;
        }
        if (n == 0) break;
        if (n_prefill && n_decode) mixed_steps++;
        int32_t rows = td_engine_n_logit_rows(c, n);
        assert_int_equal(td_engine_forward(h.e, c, n, out), TD_OK);
        int32_t row = 0;
        for (int j = 0; j < n; j++) {
            int i = who[j];
            int first = c[j].logits_all ? c[j].pos0 : c[j].pos0 + c[j].n_tokens - 1;
            for (int p = first; p < c[j].pos0 + c[j].n_tokens; p++, row++) {
                assert_memory_equal(out + (size_t)row * (size_t)h.V,
                                    ref[i] + (size_t)p * (size_t)h.V, (size_t)h.V * sizeof(float));
                compared[i]++;
            }
            done[i] += c[j].n_tokens;
        }
        assert_int_equal(row, rows);
    }
    assert_true(mixed_steps > 0);
    for (int i = 0; i < N_BATCH; i++) {
        assert_true(compared[i] >= len[i] - prompt[i]);
        td_kv_block_free(h.kv, blocks[i], nb[i]);
        free(tok[i]);
        free(ref[i]);
    }
    free(out);
    h_close(&h);
}

static void test_batch_tiny(void **state) {
    (void)state;
    for_tiny_models(batch_case);
}
static void test_batch_default(void **state) {
    (void)state;
    for_default_model(batch_case);
}

/* ---------------------------------------------------------------- prefix */

/* P = prefix + suffix A runs first; Q = prefix + suffix B then reuses P's
 * full prefix blocks (by reference) and runs only its suffix. Q's suffix
 * logits must equal Q run alone from scratch; P's blocks are released
 * before Q's call, so only the reference keeps them alive. */
static void prefix_case(const char *path, int n_threads, int len_scale) {
    harness h;
    h_open(&h, path, n_threads);
    int n_prefix = 2 * h.bs, n_suffix = 3 * len_scale + 2, n = n_prefix + n_suffix;
    int32_t *p_tok = make_tokens(n, 11, h.V), *q_tok = make_tokens(n, 12, h.V);
    memcpy(q_tok, p_tok, (size_t)n_prefix * sizeof(int32_t));
    float *ref = alloc_logits(&h, n), *got = alloc_logits(&h, n);
    run_chunked(&h, q_tok, n, n, ref);
    check_sane(&h, ref, n);

    int32_t pb[MAX_CTX], qb[MAX_CTX], nb = n_blocks_for(&h, n);
    assert_int_equal(td_kv_block_alloc(h.kv, nb, pb), TD_OK);
    td_seq_chunk c = {.tokens = p_tok, .n_tokens = n, .pos0 = 0, .block_table = pb, .n_blocks = nb};
    assert_int_equal(td_engine_forward(h.e, &c, 1, got), TD_OK);
    /* Q shares the two full prefix blocks. */
    for (int b = 0; b < 2; b++) {
        td_kv_block_ref(h.kv, pb[b]);
        assert_int_equal(td_kv_block_refcount(h.kv, pb[b]), 2);
        qb[b] = pb[b];
    }
    td_kv_block_free(h.kv, pb, nb);
    assert_int_equal(td_kv_block_refcount(h.kv, qb[0]), 1);
    /* Allocate something else first so Q's own blocks differ from P's. */
    int32_t junk[3];
    assert_int_equal(td_kv_block_alloc(h.kv, 3, junk), TD_OK);
    assert_int_equal(td_kv_block_alloc(h.kv, nb - 2, qb + 2), TD_OK);
    c = (td_seq_chunk){.tokens = q_tok + n_prefix,
                       .n_tokens = n_suffix,
                       .pos0 = n_prefix,
                       .block_table = qb,
                       .n_blocks = nb,
                       .logits_all = true};
    assert_int_equal(td_engine_forward(h.e, &c, 1, got), TD_OK);
    assert_memory_equal(got, ref + (size_t)n_prefix * (size_t)h.V,
                        (size_t)n_suffix * (size_t)h.V * sizeof(float));
    /* Without the hit, the suffix logits differ from P's (different suffix). */
    td_kv_block_free(h.kv, junk, 3);
    td_kv_block_free(h.kv, qb, nb);
    free(p_tok);
    free(q_tok);
    free(ref);
    free(got);
    h_close(&h);
}

static void test_prefix_tiny(void **state) {
    (void)state;
    for_tiny_models(prefix_case);
}
static void test_prefix_default(void **state) {
    (void)state;
    for_default_model(prefix_case);
}

/* ------------------------------------------------------------- recompute */

/* Prefill a prompt, decode some tokens one at a time, free everything
 * (preemption), then recompute prompt + decoded tokens in one prefill into
 * other blocks and decode further: every position equals the alone run. */
static void recompute_case(const char *path, int n_threads, int len_scale) {
    harness h;
    h_open(&h, path, n_threads);
    int n_prompt = 5 * len_scale + 3, n_dec1 = 2 * len_scale + 3, n_dec2 = 4;
    int n = n_prompt + n_dec1 + n_dec2;
    int32_t *tok = make_tokens(n, 21, h.V);
    float *ref = alloc_logits(&h, n), *got = alloc_logits(&h, n);
    run_chunked(&h, tok, n, n, ref);
    check_sane(&h, ref, n);
    int32_t blocks[MAX_CTX], nb = n_blocks_for(&h, n);

    assert_int_equal(td_kv_block_alloc(h.kv, nb, blocks), TD_OK);
    td_seq_chunk c = {.tokens = tok,
                      .n_tokens = n_prompt,
                      .pos0 = 0,
                      .block_table = blocks,
                      .n_blocks = nb,
                      .logits_all = true};
    assert_int_equal(td_engine_forward(h.e, &c, 1, got), TD_OK);
    for (int p = n_prompt; p < n_prompt + n_dec1; p++) {
        c = (td_seq_chunk){
            .tokens = tok + p, .n_tokens = 1, .pos0 = p, .block_table = blocks, .n_blocks = nb};
        assert_int_equal(td_engine_forward(h.e, &c, 1, got + (size_t)p * (size_t)h.V), TD_OK);
    }
    assert_memory_equal(got, ref, (size_t)(n_prompt + n_dec1) * (size_t)h.V * sizeof(float));
    td_kv_block_free(h.kv, blocks, nb); /* preempted */

    int32_t junk[2];
    assert_int_equal(td_kv_block_alloc(h.kv, 2, junk), TD_OK);
    memset(got, 0, (size_t)n * (size_t)h.V * sizeof(float));
    assert_int_equal(td_kv_block_alloc(h.kv, nb, blocks), TD_OK);
    c = (td_seq_chunk){.tokens = tok,
                       .n_tokens = n_prompt + n_dec1,
                       .pos0 = 0,
                       .block_table = blocks,
                       .n_blocks = nb,
                       .logits_all = true};
    assert_int_equal(td_engine_forward(h.e, &c, 1, got), TD_OK);
    for (int p = n_prompt + n_dec1; p < n; p++) {
        c = (td_seq_chunk){
            .tokens = tok + p, .n_tokens = 1, .pos0 = p, .block_table = blocks, .n_blocks = nb};
        assert_int_equal(td_engine_forward(h.e, &c, 1, got + (size_t)p * (size_t)h.V), TD_OK);
    }
    assert_memory_equal(got, ref, (size_t)n * (size_t)h.V * sizeof(float));
    td_kv_block_free(h.kv, junk, 2);
    td_kv_block_free(h.kv, blocks, nb);
    free(tok);
    free(ref);
    free(got);
    h_close(&h);
}

static void test_recompute_tiny(void **state) {
    (void)state;
    for_tiny_models(recompute_case);
}
static void test_recompute_default(void **state) {
    (void)state;
    for_default_model(recompute_case);
}

/* --------------------------------------------------------------- threads */

/* The same prefill (whole and chunked) and decode steps on a 1-thread and
 * a 2-thread engine. */
static void threads_case(const char *path, int n_threads, int len_scale) {
    (void)n_threads;
    harness h1, h2;
    h_open(&h1, path, 1);
    h_open(&h2, path, 2);
    int n = 9 * len_scale + 7;
    int32_t *tok = make_tokens(n, 31, h1.V);
    float *a = alloc_logits(&h1, n), *b = alloc_logits(&h2, n);
    const int chunks[] = {n, 5, 1};
    for (size_t i = 0; i < TD_ARRAY_SIZE(chunks); i++) {
        memset(a, 0, (size_t)n * (size_t)h1.V * sizeof(float));
        memset(b, 0xff, (size_t)n * (size_t)h2.V * sizeof(float));
        run_chunked(&h1, tok, n, chunks[i], a);
        run_chunked(&h2, tok, n, chunks[i], b);
        check_sane(&h1, a, n);
        assert_memory_equal(a, b, (size_t)n * (size_t)h1.V * sizeof(float));
    }
    free(a);
    free(b);
    free(tok);
    h_close(&h1);
    h_close(&h2);
}

static void test_threads_tiny(void **state) {
    (void)state;
    for_tiny_models(threads_case);
}
static void test_threads_default(void **state) {
    (void)state;
    for_default_model(threads_case);
}

/* ------------------------------------------------------- tensor parallel */

/* Tensor parallelism changes the summation order of the wo / w_down
 * products (two partial sums, then the all-reduce), so logits agree with
 * the single-rank run within a tolerance, not bit for bit; the ranks agree
 * with each other exactly (the all-reduce adds in rank order on every
 * rank). Ranks are threads over the in-process comm backend, each with its
 * own shard, KV pool (its KV heads) and engine. */
typedef struct {
    const char *path;
    td_comm_group *group;
    int rank, size;
    const int32_t *tok;
    int n;
    float *out; /* (n, V) */
    td_status st;
} tp_rank_job;

static void *tp_rank_main(void *arg) {
    tp_rank_job *j = arg;
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
    td_kv_params kp = td_kv_default_params();
    kp.n_layers = c->n_layer;
    kp.n_kv_heads = td_model_n_head_kv_local(m);
    kp.head_dim = c->head_dim;
    kp.dtype = kv_dtype();
    kp.n_blocks = 16;
    if ((j->st = td_kv_pool_create(&kp, &kv)) || (j->st = td_threadpool_create(1, &tp)) ||
        (j->st = td_comm_create_local(j->group, j->rank, &comm)))
        goto done;
    td_engine_params ep = td_engine_default_params();
    ep.max_ctx = MAX_CTX;
    if ((j->st = td_engine_create(m, kv, tp, comm, &ep, &e))) goto done;
    int32_t blocks[16];
    for (int i = 0; i < 16; i++) blocks[i] = 15 - i;
    /* a prefill chunk, then decode steps */
    int n_pre = j->n - 3;
    td_seq_chunk ch = {.tokens = j->tok,
                       .n_tokens = n_pre,
                       .block_table = blocks,
                       .n_blocks = 16,
                       .logits_all = true};
    if ((j->st = td_engine_forward(e, &ch, 1, j->out))) goto done;
    for (int p = n_pre; p < j->n; p++) {
        ch = (td_seq_chunk){
            .tokens = j->tok + p, .n_tokens = 1, .pos0 = p, .block_table = blocks, .n_blocks = 16};
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

static void tp_case(const char *rel, int size, double tol) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", test_models_dir(), rel);
    harness h;
    h_open(&h, path, 1);
    int n = 21;
    int32_t *tok = make_tokens(n, 61, h.V);
    float *ref = alloc_logits(&h, n);
    run_chunked(&h, tok, n, n, ref);
    check_sane(&h, ref, n);
    td_comm_group *g = NULL;
    assert_int_equal(td_comm_group_create(size, &g), TD_OK);
    tp_rank_job jobs[4];
    pthread_t th[4];
    assert_true(size <= 4);
    for (int r = 0; r < size; r++) {
        jobs[r] = (tp_rank_job){.path = path,
                                .group = g,
                                .rank = r,
                                .size = size,
                                .tok = tok,
                                .n = n,
                                .out = alloc_logits(&h, n)};
        assert_int_equal(pthread_create(&th[r], NULL, tp_rank_main, &jobs[r]), 0);
    }
    for (int r = 0; r < size; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < size; r++) {
        assert_int_equal(jobs[r].st, TD_OK);
        assert_memory_equal(jobs[0].out, jobs[r].out, (size_t)n * (size_t)h.V * sizeof(float));
    }
    double worst = 0;
    for (int t = 0; t < n; t++) {
        double m = 0, d = 0;
        for (int v = 0; v < h.V; v++) {
            size_t i = (size_t)t * (size_t)h.V + (size_t)v;
            m = fmax(m, fabs(ref[i]));
            d = fmax(d, fabs((double)jobs[0].out[i] - ref[i]));
        }
        worst = fmax(worst, d / m);
    }
    print_message("    %s: tp=%d vs tp=1 max relative logit difference %.2e\n", rel, size, worst);
    assert_true(worst <= tol);
    assert_true(worst > 0 || tol == 0); /* the summation order did change */
    for (int r = 0; r < size; r++) free(jobs[r].out);
    td_comm_group_destroy(g);
    free(tok);
    free(ref);
    h_close(&h);
}

static void test_tp_tiny(void **state) {
    (void)state;
    if (!test_models_dir()) skip();
    /* F32 weights: only the F32 rounding of the split sums differs, a few
     * ulps per layer (measured ~5e-7 relative on these models); 1e-5 is 20x
     * that and far below what a wrong slice would give (order 1). */
    tp_case("gguf/tinyllama-f32.gguf", 2, 1e-5);
    tp_case("gguf/tinyllama-f32.gguf", 4, 1e-5); /* 4 ranks, 2 KV heads: replicated */
    tp_case("gguf/qwen2-f32.gguf", 2, 1e-5);     /* Q/K/V biases sliced per rank */
    tp_case("hf/llama3-f32", 2, 1e-5);           /* HF, NeoX RoPE, llama3 scaling */
    /* Q4_0: each rank's column slice starts at a 32-block, so activations
     * quantise the same blocks as on one rank; the partial sums can still
     * flip an 8-bit rounding later on, which moves these random models'
     * logits by up to a few percent (see tests/integration/test_numerics.py,
     * whose q4 bound against the reference is 0.10). */
    tp_case("gguf/tinyllama-q4_0.gguf", 2, 0.10);
}

/* ------------------------------------------------------------ bad batches */

/* Batches that break the limits are refused with TD_ERR_INVALID, and the
 * engine and cache stay usable: a valid call afterwards gives the same logits. */
static void *no_mem(void *ctx, size_t bytes, void **handle) {
    (void)ctx, (void)bytes, (void)handle;
    return NULL;
}

/* The KV storage moves (td_engine_kv_place) only while the pool holds no
 * data, a failed move keeps the old storage, a released storage fails
 * every step cleanly until the next place, and the logits never change. */
static void test_kv_place(void **state) {
    (void)state;
    char path[4096];
    if (!tiny_path("smollm2-q4_1-gguf", path, sizeof path)) skip();
    harness h;
    h_open(&h, path, 2);
    int n = 37;
    int32_t *tok = make_tokens(n, 61, h.V);
    float *ref = alloc_logits(&h, n), *got = alloc_logits(&h, n);
    run_chunked(&h, tok, n, 16, ref);
    td_kv_storage s0, s1;
    assert_int_equal(td_engine_kv_storage(h.e, &s0), TD_OK);
    int32_t held;
    assert_int_equal(td_kv_block_alloc(h.kv, 1, &held), TD_OK);
    assert_int_equal(td_engine_kv_place(h.e, NULL), TD_ERR_INVALID); /* a block in use */
    td_kv_block_free(h.kv, &held, 1);
    assert_int_equal(td_engine_kv_place(h.e, NULL), TD_OK);
    assert_int_equal(td_engine_kv_storage(h.e, &s1), TD_OK);
    assert_ptr_not_equal(s1.base, s0.base); /* new memory, allocated before the old was freed */
    assert_int_equal(s1.layout.bytes, s0.layout.bytes);
    run_chunked(&h, tok, n, 16, got);
    assert_memory_equal(got, ref, (size_t)n * (size_t)h.V * sizeof(float));
    td_kv_mem_hook broken = {.alloc = no_mem};
    assert_int_equal(td_engine_kv_place(h.e, &broken), TD_ERR_NOMEM);
    assert_int_equal(td_engine_kv_storage(h.e, &s0), TD_OK);
    assert_ptr_equal(s0.base, s1.base);
    run_chunked(&h, tok, n, 16, got);
    assert_memory_equal(got, ref, (size_t)n * (size_t)h.V * sizeof(float));
    td_engine_kv_release(h.e);
    assert_int_equal(td_engine_kv_storage(h.e, &s0), TD_ERR_INVALID);
    int32_t blocks[3];
    assert_int_equal(td_kv_block_alloc(h.kv, 3, blocks), TD_OK);
    td_seq_chunk c = {.tokens = tok, .n_tokens = n, .block_table = blocks, .n_blocks = 3};
    assert_int_equal(td_engine_forward(h.e, &c, 1, got), TD_ERR_INVALID);
    td_kv_block_free(h.kv, blocks, 3);
    assert_int_equal(td_engine_kv_place(h.e, NULL), TD_OK);
    run_chunked(&h, tok, n, 16, got);
    assert_memory_equal(got, ref, (size_t)n * (size_t)h.V * sizeof(float));
    free(tok);
    free(ref);
    free(got);
    h_close(&h);
}

static void test_forward_rejects(void **state) {
    (void)state;
    char path[4096];
    if (!tiny_path("smollm2-q4_1-gguf", path, sizeof path)) skip();
    harness h;
    h_open(&h, path, 2);
    int n = 20;
    int32_t *tok = make_tokens(n, 51, h.V);
    float *ref = alloc_logits(&h, n), *got = alloc_logits(&h, n);
    run_chunked(&h, tok, n, n, ref);
    int32_t blocks[4];
    assert_int_equal(td_kv_block_alloc(h.kv, 2, blocks), TD_OK);
    const td_seq_chunk ok = {.tokens = tok,
                             .n_tokens = n,
                             .pos0 = 0,
                             .block_table = blocks,
                             .n_blocks = 2,
                             .logits_all = true};
    int32_t bad_tok[2] = {5, h.V};
    int32_t neg_tok[1] = {-3};
    int32_t bad_blocks[2] = {blocks[0], N_BLOCKS};
    td_seq_chunk c;
    td_seq_chunk many[17];
    for (int i = 0; i < 17; i++)
        many[i] =
            (td_seq_chunk){.tokens = tok, .n_tokens = 1, .block_table = blocks, .n_blocks = 1};
    int32_t *big = make_tokens(MAX_CTX + 1, 52, h.V);
    int32_t big_blocks[MAX_CTX / 16 + 2];
    assert_int_equal(td_kv_block_alloc(h.kv, MAX_CTX / 16 + 1, big_blocks), TD_OK);

    assert_int_equal(td_engine_forward(h.e, &ok, 0, got), TD_ERR_INVALID);
    assert_int_equal(td_engine_forward(h.e, many, 17, got), TD_ERR_INVALID); /* max_seqs 16 */
    c = ok;
    c.tokens = bad_tok;
    c.n_tokens = 2;
    assert_int_equal(td_engine_forward(h.e, &c, 1, got), TD_ERR_INVALID);
    c.tokens = neg_tok;
    c.n_tokens = 1;
    assert_int_equal(td_engine_forward(h.e, &c, 1, got), TD_ERR_INVALID);
    c = ok;
    c.n_tokens = 0;
    assert_int_equal(td_engine_forward(h.e, &c, 1, got), TD_ERR_INVALID);
    c = ok;
    c.pos0 = -1;
    assert_int_equal(td_engine_forward(h.e, &c, 1, got), TD_ERR_INVALID);
    c = ok;
    c.n_blocks = 1; /* 20 positions need 2 blocks */
    assert_int_equal(td_engine_forward(h.e, &c, 1, got), TD_ERR_INVALID);
    c = ok;
    c.block_table = bad_blocks;
    assert_int_equal(td_engine_forward(h.e, &c, 1, got), TD_ERR_INVALID);
    c = ok;
    c.block_table = NULL;
    assert_int_equal(td_engine_forward(h.e, &c, 1, got), TD_ERR_INVALID);
    c = ok;
    assert_int_equal(td_engine_forward(h.e, &c, 1, NULL), TD_ERR_INVALID);
    c = (td_seq_chunk){.tokens = big,
                       .n_tokens = MAX_CTX + 1,
                       .block_table = big_blocks,
                       .n_blocks = MAX_CTX / 16 + 1};
    assert_int_equal(td_engine_forward(h.e, &c, 1, got), TD_ERR_INVALID); /* past max_ctx */
    c = (td_seq_chunk){.tokens = big,
                       .n_tokens = 1,
                       .pos0 = MAX_CTX,
                       .block_table = big_blocks,
                       .n_blocks = MAX_CTX / 16 + 1};
    assert_int_equal(td_engine_forward(h.e, &c, 1, got), TD_ERR_INVALID);
    c.no_logits = true; /* no logits wanted: a NULL buffer is fine */
    c.pos0 = 0;
    assert_int_equal(td_engine_forward(h.e, &c, 1, NULL), TD_OK);

    assert_int_equal(td_engine_forward(h.e, &ok, 1, got), TD_OK);
    assert_memory_equal(got, ref, (size_t)n * (size_t)h.V * sizeof(float));
    td_kv_block_free(h.kv, blocks, 2);
    td_kv_block_free(h.kv, big_blocks, MAX_CTX / 16 + 1);
    free(big);
    free(tok);
    free(ref);
    free(got);
    h_close(&h);
}

/* -------------------------------------------------------------- pipeline */

/* Two pipeline stages (layers [0, split) and [split, n_layer), each its own
 * model shard, KV pool and engine) passing hidden states give the logits of
 * the whole model bit for bit: a stage boundary changes no summation. */
static void pipeline_case(const char *path, int n_threads, int len_scale) {
    harness whole;
    h_open(&whole, path, n_threads);
    const td_model_config *c = td_model_get_config(whole.m);
    int n = 6 * len_scale + 3;
    int32_t *tok = make_tokens(n, 41, whole.V);
    float *ref = alloc_logits(&whole, n), *got = alloc_logits(&whole, n);
    run_chunked(&whole, tok, n, n, ref);
    check_sane(&whole, ref, n);
    float *x = malloc((size_t)n * (size_t)c->n_embd * sizeof(float));
    assert_non_null(x);
    for (int split = 1; split < c->n_layer; split++) {
        td_model *m[2] = {NULL, NULL};
        td_kv_pool *kv[2] = {NULL, NULL};
        td_engine *e[2] = {NULL, NULL};
        for (int st = 0; st < 2; st++) {
            td_model_params mp = td_model_default_params();
            mp.path = path;
            mp.layer_begin = st == 0 ? 0 : split;
            mp.layer_end = st == 0 ? split : -1;
            assert_int_equal(td_model_load(&mp, &m[st]), TD_OK);
            td_kv_params kp = td_kv_default_params();
            kp.n_layers = td_model_layer_end(m[st]) - td_model_layer_begin(m[st]);
            kp.n_kv_heads = c->n_head_kv;
            kp.head_dim = c->head_dim;
            kp.dtype = kv_dtype();
            kp.n_blocks = 16;
            assert_int_equal(td_kv_pool_create(&kp, &kv[st]), TD_OK);
            td_engine_params ep = td_engine_default_params();
            ep.max_ctx = MAX_CTX;
            assert_int_equal(td_engine_create(m[st], kv[st], whole.tp, whole.comm, &ep, &e[st]),
                             TD_OK);
        }
        int32_t blocks[MAX_CTX], nb = n_blocks_for(&whole, n);
        for (int i = 0; i < nb; i++) blocks[i] = i; /* each stage's own pool */
        for (int p = 0; p < n; p += 5) {            /* chunks of 5: stages agree on the batch */
            td_seq_chunk ch = {.tokens = tok + p,
                               .n_tokens = TD_MIN(5, n - p),
                               .pos0 = p,
                               .block_table = blocks,
                               .n_blocks = nb,
                               .logits_all = true};
            assert_int_equal(td_engine_forward_stage(e[0], &ch, 1, NULL, x, NULL), TD_OK);
            assert_int_equal(
                td_engine_forward_stage(e[1], &ch, 1, x, NULL, got + (size_t)p * (size_t)whole.V),
                TD_OK);
        }
        assert_memory_equal(ref, got, (size_t)n * (size_t)whole.V * sizeof(float));
        /* A stage without its input / the whole-model entry on a stage is refused. */
        td_seq_chunk ch = {.tokens = tok, .n_tokens = 1, .block_table = blocks, .n_blocks = nb};
        assert_int_equal(td_engine_forward(e[1], &ch, 1, got), TD_ERR_INVALID);
        assert_int_equal(td_engine_forward(e[0], &ch, 1, got), TD_ERR_INVALID);
        for (int st = 0; st < 2; st++) {
            td_engine_destroy(e[st]);
            td_kv_pool_destroy(kv[st]);
            td_model_free(m[st]);
        }
    }
    free(x);
    free(tok);
    free(ref);
    free(got);
    h_close(&whole);
}

static void test_pipeline_tiny(void **state) {
    (void)state;
    for_tiny_models(pipeline_case);
}

int main(void) {
    /* TD_TEST_ISA=scalar|avx2|avx512 runs the contract on one kernel set. */
    const char *isa = getenv("TD_TEST_ISA");
    int want = isa ? td_backend_isa_parse(isa) : (int)td_backend_isa_best();
    if (want < 0 || !td_backend_isa_select((td_isa)want)) {
        fprintf(stderr, "TD_TEST_ISA=%s: not available on this CPU\n", isa);
        return 1;
    }
    /* TD_TEST_ACT_INT8=1: the quantized models' matmuls on int8 activations
     * (--act-int8); the contract holds for them too. */
    const char *act = getenv("TD_TEST_ACT_INT8");
    td_backend_set_act_int8(act && strcmp(act, "1") == 0);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chunks_tiny),       cmocka_unit_test(test_batch_tiny),
        cmocka_unit_test(test_prefix_tiny),       cmocka_unit_test(test_recompute_tiny),
        cmocka_unit_test(test_threads_tiny),      cmocka_unit_test(test_pipeline_tiny),
        cmocka_unit_test(test_forward_rejects),   cmocka_unit_test(test_tp_tiny),
        cmocka_unit_test(test_kv_place),          cmocka_unit_test(test_chunks_default),
        cmocka_unit_test(test_batch_default),     cmocka_unit_test(test_prefix_default),
        cmocka_unit_test(test_recompute_default), cmocka_unit_test(test_threads_default),
    };
    const struct CMUnitTest one_model_tests[] = {
        cmocka_unit_test(test_chunks_tiny),  cmocka_unit_test(test_batch_tiny),
        cmocka_unit_test(test_prefix_tiny),  cmocka_unit_test(test_recompute_tiny),
        cmocka_unit_test(test_threads_tiny), cmocka_unit_test(test_pipeline_tiny),
    };
    const char *only = getenv("TD_TEST_INVARIANCE_MODEL");
    if (only && only[0]) {
        g_only_model = only;
        return cmocka_run_group_tests(one_model_tests, NULL, NULL);
    }
    return cmocka_run_group_tests(tests, NULL, NULL);
}
