/* The scheduler's contract (sched.h), driven directly on a tiny random model:
 *   - outputs under continuous batching (many requests at once, small
 *     chunked-prefill budgets) equal each request run alone;
 *   - KV exhaustion preempts by recompute, changes no output, and every
 *     block and reservation comes back;
 *   - a repeated prompt hits the prefix cache and gives the same output;
 *   - cancellation frees everything; draining rejects new work.
 * The reference for "alone" is the same scheduler with one request in
 * flight: the contract is invariance, so the comparison is with itself by
 * design. Each test also checks the outputs differ between requests, so a
 * scheduler that returned one constant sequence could not pass. Greedy with
 * ignore_eos, so lengths are exactly max_tokens. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>

#include "common/base/threadpool.h"
#include "common/comm/comm.h"
#include "common/engine/forward.h"
#include "common/kv/kv.h"
#include "common/model/model.h"
#include "common/sched/sched.h"

#define MAX_CTX 192
#define N_REQ   12

/* Applied by the next h_open (then reset): the scheduler's prefill share
 * and step trace. */
static double g_prefill_share;
static FILE *g_trace;

typedef struct {
    td_model *m;
    td_kv_pool *kv;
    td_threadpool *tp;
    td_comm *comm;
    td_engine *e;
    td_exec *x;
    td_sched *s;
    int32_t V;
} harness;

static void h_open(harness *h, int32_t n_blocks, int32_t max_running, int32_t batch_tokens,
                   int32_t reserve_out, bool prefix_cache) {
    memset(h, 0, sizeof *h);
    const char *dir = getenv("TANDEM_TEST_MODELS");
    assert_non_null(dir);
    char path[1024];
    snprintf(path, sizeof path, "%s/gguf/llama2-q8_0.gguf", dir);
    td_model_params mp = td_model_default_params();
    mp.path = path;
    assert_int_equal(td_model_load(&mp, &h->m), TD_OK);
    const td_model_config *c = td_model_get_config(h->m);
    td_kv_params kp = td_kv_default_params();
    kp.n_layers = c->n_layer;
    kp.n_kv_heads = c->n_head_kv;
    kp.head_dim = c->head_dim;
    kp.n_blocks = n_blocks;
    assert_int_equal(td_kv_pool_create(&kp, &h->kv), TD_OK);
    assert_int_equal(td_threadpool_create(2, &h->tp), TD_OK);
    assert_int_equal(td_comm_create_single(&h->comm), TD_OK);
    td_engine_params ep = td_engine_default_params();
    ep.max_batch_tokens = 512;
    ep.max_seqs = 32;
    ep.max_ctx = MAX_CTX;
    assert_int_equal(td_engine_create(h->m, h->kv, h->tp, h->comm, &ep, &h->e), TD_OK);
    h->V = c->n_vocab;
    td_sched_params sp = td_sched_default_params();
    sp.max_running = max_running;
    sp.max_batch_tokens = batch_tokens;
    sp.reserve_output_tokens = reserve_out;
    sp.max_ctx = MAX_CTX;
    sp.prefix_cache = prefix_cache;
    sp.compat.lo = 42;
    sp.prefill_share = g_prefill_share;
    sp.step_trace = g_trace;
    g_prefill_share = 0;
    g_trace = NULL;
    assert_int_equal(td_exec_wrap(h->e, h->kv, h->m, &h->x), TD_OK);
    assert_int_equal(td_sched_create(&sp, h->x, h->kv, td_model_tokenizer(h->m), NULL, &h->s),
                     TD_OK);
}

/* Waits until the scheduler is idle and checks the pool is back to idle. */
static void assert_idle(harness *h) {
    assert_true(td_sched_wait_idle(h->s, 30.0));
    td_sched_stats st;
    /* The stats are published after the step that finished the last
     * sequence; wait_idle saw them. */
    td_sched_stats_get(h->s, &st);
    assert_int_equal(st.running, 0);
    assert_int_equal(st.waiting, 0);
    assert_int_equal(st.kv.used, 0);
    assert_int_equal(st.kv.reserved, 0);
    assert_int_equal(st.kv.empty + st.kv.cached, st.kv.total);
}

static void h_close(harness *h) {
    assert_idle(h);
    td_sched_destroy(h->s);
    td_exec_destroy(h->x);
    td_engine_destroy(h->e);
    td_comm_destroy(h->comm);
    td_threadpool_destroy(h->tp);
    td_kv_pool_destroy(h->kv);
    td_model_free(h->m);
}

typedef struct {
    int32_t prompt[128];
    int32_t n_prompt;
    int32_t max_tokens;
    int32_t out[128];
    int32_t n_out;
    td_finish_reason finish;
    int32_t n_cached;
} job;

static void make_jobs(job *jobs, int n, int32_t V, uint32_t seed) {
    for (int i = 0; i < n; i++) {
        job *j = &jobs[i];
        memset(j, 0, sizeof *j);
        j->n_prompt = 3 + (int32_t)((i * 37 + seed) % 90);
        j->max_tokens = 4 + (int32_t)((i * 11 + seed) % 40);
        for (int32_t k = 0; k < j->n_prompt; k++) {
            seed = seed * 1664525u + 1013904223u;
            j->prompt[k] = (int32_t)((seed >> 8) % (uint32_t)V);
        }
    }
}

static td_gen_stream *submit(harness *h, const job *j) {
    td_gen_request r;
    td_gen_request_init(&r);
    r.prompt = j->prompt;
    r.n_prompt = j->n_prompt;
    r.max_tokens = j->max_tokens;
    r.ignore_eos = true;
    r.sampling.temperature = 0;
    td_gen_stream *st = NULL;
    assert_int_equal(td_sched_submit(h->s, &r, &st), TD_OK);
    return st;
}

static void drain_stream(td_gen_stream *st, job *j) {
    for (;;) {
        td_gen_delta d;
        td_status rc = td_gen_stream_read(st, 10000, &d);
        assert_int_equal(rc, TD_OK);
        assert_true(j->n_out + d.n_tokens <= 128);
        memcpy(j->out + j->n_out, d.tokens, (size_t)d.n_tokens * sizeof(int32_t));
        j->n_out += d.n_tokens;
        if (d.finished) {
            j->finish = d.finish;
            j->n_cached = d.n_cached_tokens;
            assert_int_equal(d.n_output_tokens, j->n_out);
            break;
        }
    }
    td_gen_stream_release(st);
}

static void run_alone(harness *h, job *jobs, int n) {
    for (int i = 0; i < n; i++) drain_stream(submit(h, &jobs[i]), &jobs[i]);
}

static void run_together(harness *h, job *jobs, int n) {
    td_gen_stream *st[N_REQ];
    for (int i = 0; i < n; i++) st[i] = submit(h, &jobs[i]);
    for (int i = 0; i < n; i++) drain_stream(st[i], &jobs[i]);
}

static void assert_same_outputs(const job *a, const job *b, int n) {
    int distinct = 0;
    for (int i = 0; i < n; i++) {
        assert_int_equal(a[i].finish, TD_FINISH_LENGTH);
        assert_int_equal(b[i].finish, TD_FINISH_LENGTH);
        assert_int_equal(a[i].n_out, a[i].max_tokens);
        assert_int_equal(b[i].n_out, a[i].n_out);
        assert_memory_equal(a[i].out, b[i].out, (size_t)a[i].n_out * sizeof(int32_t));
        if (i > 0 && memcmp(a[i].out, a[0].out, 4 * sizeof(int32_t)) != 0) distinct++;
    }
    assert_true(distinct > 0);
}

static job g_solo[N_REQ];

static void compute_solo(void) {
    static bool done;
    if (done) return;
    harness h;
    h_open(&h, 512, 1, 512, 256, false);
    make_jobs(g_solo, N_REQ, h.V, 7);
    run_alone(&h, g_solo, N_REQ);
    h_close(&h);
    done = true;
}

static void test_batching_equals_alone(void **state) {
    (void)state;
    compute_solo();
    /* Budgets: everything in one step, and small chunks that split every
     * prompt and mix decodes with prefill chunks. */
    const int32_t budgets[] = {512, 16};
    for (size_t b = 0; b < TD_ARRAY_SIZE(budgets); b++) {
        harness h;
        h_open(&h, 512, 16, budgets[b], 256, true);
        job jobs[N_REQ];
        make_jobs(jobs, N_REQ, h.V, 7);
        run_together(&h, jobs, N_REQ);
        assert_same_outputs(g_solo, jobs, N_REQ);
        h_close(&h);
    }
}

/* prefill_share 0.1 of 512: a step that also decodes takes at most 51
 * prompt tokens, one that does not takes up to 512 (a first request runs
 * alone), read from the step trace (the prompt lengths from "in", the
 * chunks from "b"); the outputs equal each request alone. */
static void test_prefill_share(void **state) {
    (void)state;
    compute_solo();
    harness h;
    FILE *tr = tmpfile();
    assert_non_null(tr);
    g_prefill_share = 0.1;
    g_trace = tr;
    h_open(&h, 512, 16, 512, 256, true);
    /* first, alone: a 100-token prompt in a step with no decode; the
     * others arrive while it decodes (100 tokens), so their prompts share
     * steps with its decodes whatever the timing */
    job first;
    make_jobs(&first, 1, h.V, 11);
    first.n_prompt = 100;
    first.max_tokens = 100;
    for (int32_t k = 0; k < first.n_prompt; k++) first.prompt[k] = (k * 7 + 3) % h.V;
    td_gen_stream *fst = submit(&h, &first);
    td_gen_delta d0;
    do {
        assert_int_equal(td_gen_stream_read(fst, 10000, &d0), TD_OK);
        assert_false(d0.finished);
    } while (d0.n_output_tokens < 1);
    job jobs[N_REQ];
    make_jobs(jobs, N_REQ, h.V, 7);
    run_together(&h, jobs, N_REQ);
    assert_same_outputs(g_solo, jobs, N_REQ);
    td_gen_stream_release(fst);
    h_close(&h);
    rewind(tr);
    char line[1 << 16];
    int64_t n_prompt[64] = {0};
    int mixed = 0, big_alone = 0;
    assert_non_null(fgets(line, sizeof line, tr)); /* the header */
    assert_non_null(strstr(line, "\"prefill_share\":0.10000000000000001"));
    while (fgets(line, sizeof line, tr)) {
        json_t *o = json_loads(line, 0, NULL);
        assert_non_null(o);
        json_t *ev, *e;
        size_t i;
        ev = json_object_get(o, "ev");
        json_array_foreach(ev, i, e) {
            const char *k = json_string_value(json_array_get(e, 0));
            json_int_t t = json_integer_value(json_array_get(e, 1));
            assert_true(t >= 0 && t < 64);
            if (!strcmp(k, "in")) n_prompt[t] = (int64_t)json_array_size(json_array_get(e, 3));
            if (strcmp(k, "b") != 0) continue;
            json_t *c;
            size_t ci;
            int64_t prompt = 0, decodes = 0;
            json_array_foreach(json_array_get(e, 3), ci, c) {
                json_int_t ct = json_integer_value(json_array_get(c, 0));
                json_int_t pos0 = json_integer_value(json_array_get(c, 1));
                json_int_t n = json_integer_value(json_array_get(c, 2));
                assert_true(ct >= 0 && ct < 64 && n_prompt[ct] > 0);
                /* one token left (a decode, or a prompt's last token) is in
                 * the scheduler's first pass, with the decodes */
                if (n == 1 && pos0 >= n_prompt[ct] - 1)
                    decodes++;
                else
                    prompt += n;
            }
            if (decodes > 0) {
                assert_true(prompt <= 51);
                mixed += prompt > 0;
            } else if (prompt > 51) {
                big_alone++;
            }
        }
        json_decref(o);
    }
    fclose(tr);
    assert_true(mixed > 0);     /* prompts joined decoding steps, capped */
    assert_true(big_alone > 0); /* and took the whole budget without decodes */
}

static void test_preemption_recomputes(void **state) {
    (void)state;
    compute_solo();
    /* 14 blocks of 16 tokens and no output reservation: the sequences
     * admitted together outgrow the pool while decoding. */
    harness h;
    h_open(&h, 14, 8, 64, 0, true);
    job jobs[N_REQ];
    make_jobs(jobs, N_REQ, h.V, 7);
    run_together(&h, jobs, N_REQ);
    assert_same_outputs(g_solo, jobs, N_REQ);
    td_sched_stats st;
    assert_true(td_sched_wait_idle(h.s, 30.0));
    td_sched_stats_get(h.s, &st);
    assert_true(st.preemptions > 0);
    h_close(&h);
}

static void test_prefix_cache_hit(void **state) {
    (void)state;
    harness h;
    h_open(&h, 64, 4, 512, 256, true);
    job a[1], b[1];
    make_jobs(a, 1, h.V, 99);
    a[0].n_prompt = 70; /* four full blocks */
    make_jobs(b, 1, h.V, 99);
    b[0].n_prompt = 70;
    run_alone(&h, a, 1);
    assert_int_equal(a[0].n_cached, 0);
    run_alone(&h, b, 1);
    assert_int_equal(b[0].n_cached, 64);
    assert_int_equal(b[0].n_out, a[0].n_out);
    assert_memory_equal(a[0].out, b[0].out, (size_t)a[0].n_out * sizeof(int32_t));
    /* Two requests with one new prompt submitted together: the second
     * waits for the first to publish the shared blocks and reuses them. */
    job c[2];
    make_jobs(c, 1, h.V, 1234);
    c[0].n_prompt = 70;
    c[1] = c[0];
    run_together(&h, c, 2);
    assert_int_equal(c[0].n_cached, 0);
    assert_int_equal(c[1].n_cached, 64);
    assert_memory_equal(c[0].out, c[1].out, (size_t)c[0].n_out * sizeof(int32_t));
    td_sched_stats st;
    assert_true(td_sched_wait_idle(h.s, 30.0)); /* stats are published after each step */
    td_sched_stats_get(h.s, &st);
    assert_true(st.kv.cached >= 4);
    h_close(&h);
}

static void test_cancel_frees(void **state) {
    (void)state;
    harness h;
    h_open(&h, 64, 4, 512, 256, true);
    job j[1];
    make_jobs(j, 1, h.V, 5);
    j[0].max_tokens = 120;
    td_gen_stream *st = submit(&h, &j[0]);
    td_gen_delta d;
    do {
        assert_int_equal(td_gen_stream_read(st, 10000, &d), TD_OK);
    } while (d.n_output_tokens < 2 && !d.finished);
    td_gen_stream_cancel(st);
    while (!d.finished) assert_int_equal(td_gen_stream_read(st, 10000, &d), TD_OK);
    assert_int_equal(d.finish, TD_FINISH_ABORT);
    assert_true(d.n_output_tokens < 120);
    td_gen_stream_release(st);
    /* Release without reading: the scheduler still frees everything. */
    st = submit(&h, &j[0]);
    td_gen_stream_release(st);
    h_close(&h);
}

static void test_drain_and_limits(void **state) {
    (void)state;
    harness h;
    h_open(&h, 64, 4, 512, 256, true);
    job j[1];
    make_jobs(j, 1, h.V, 3);
    td_gen_request r;
    td_gen_request_init(&r);
    int32_t big[MAX_CTX];
    for (int i = 0; i < MAX_CTX; i++) big[i] = i % h.V;
    r.prompt = big;
    r.n_prompt = MAX_CTX; /* no room for one output token */
    td_gen_stream *st = NULL;
    assert_int_equal(td_sched_submit(h.s, &r, &st), TD_ERR_RANGE);
    big[3] = h.V; /* outside the vocabulary */
    r.n_prompt = 10;
    assert_int_equal(td_sched_submit(h.s, &r, &st), TD_ERR_INVALID);
    assert_null(st);
    td_gen_stream *live = submit(&h, &j[0]);
    td_sched_drain(h.s);
    assert_true(td_sched_draining(h.s));
    r.prompt = j[0].prompt;
    r.n_prompt = j[0].n_prompt;
    assert_int_equal(td_sched_submit(h.s, &r, &st), TD_ERR_UNAVAILABLE);
    drain_stream(live, &j[0]); /* work admitted before the drain finishes */
    assert_int_equal(j[0].finish, TD_FINISH_LENGTH);
    assert_int_equal(td_sched_live_streams(h.s), 0);
    h_close(&h);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batching_equals_alone), cmocka_unit_test(test_prefill_share),
        cmocka_unit_test(test_preemption_recomputes), cmocka_unit_test(test_prefix_cache_hit),
        cmocka_unit_test(test_cancel_frees),          cmocka_unit_test(test_drain_and_limits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
