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
#include <math.h>
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
#include "common/sched/core.h"
#include "common/sched/sched.h"

#define MAX_CTX 192
#define N_REQ   12

/* Applied by the next h_open (then reset): the scheduler's prefill share,
 * TPOT target and step trace. */
static double g_prefill_share, g_tpot_target;
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
    sp.tpot_target_s = g_tpot_target;
    sp.step_trace = g_trace;
    g_prefill_share = g_tpot_target = 0;
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

/* One busy run with a step trace: a first request alone (a 100-token
 * prompt in a step with no decode), then N_REQ more while it decodes (100
 * tokens), so their prompts share steps with its decodes whatever the
 * timing. Checks the outputs equal each request alone, the header names
 * `needle`, every step that decodes takes at most `cap` prompt tokens
 * (prompts read from "in", chunks from "b") and some do, and some step
 * without a decode takes more (the cap is only beside decodes). */
static void busy_run_capped(const char *needle, int64_t cap) {
    compute_solo();
    harness h;
    FILE *tr = tmpfile();
    assert_non_null(tr);
    g_trace = tr;
    h_open(&h, 512, 16, 512, 256, true);
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
    assert_non_null(strstr(line, needle));
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
                assert_true(prompt <= cap);
                mixed += prompt > 0;
            } else if (prompt > cap) {
                big_alone++;
            }
        }
        json_decref(o);
    }
    fclose(tr);
    assert_true(mixed > 0);     /* prompts joined decoding steps, capped */
    assert_true(big_alone > 0); /* and took the whole budget without decodes */
}

/* prefill_share 0.1 of 512: a step that also decodes takes at most 51
 * prompt tokens, one that does not takes up to 512 (a first request runs
 * alone). */
static void test_prefill_share(void **state) {
    (void)state;
    g_prefill_share = 0.1;
    busy_run_capped("\"prefill_share\":0.10000000000000001", 51);
}

/* A TPOT target below any step's time (1 us): a step that also decodes
 * takes one prompt token (the least that keeps prompts moving), whatever
 * the step times measured; one without decodes takes up to 512. */
static void test_tpot_target_floor(void **state) {
    (void)state;
    g_tpot_target = 1e-6;
    busy_run_capped("\"tpot_target_s\":9.9999999999999995e-07", 1);
}

/* ---- the scheduling core's step-time estimate and TPOT budget ----
 * Driven directly (core.h) on a KV pool's bookkeeping, with step times from
 * a known line t = 5 ms + 1 ms per decode + 0.1 ms per prompt token. */

static double line_t(int32_t n_decode, int32_t n_prompt) {
    return 0.005 + 0.001 * n_decode + 0.0001 * n_prompt;
}

typedef struct {
    td_kv_pool *kv;
    td_sched_core c;
    td_sched_seq q[5];
} core_rig;

static void rig_open(core_rig *r, double tpot_target, double share, double factor) {
    memset(r, 0, sizeof *r);
    td_kv_params kp = td_kv_default_params();
    kp.n_layers = 1;
    kp.n_kv_heads = 1;
    kp.head_dim = 4;
    kp.n_blocks = 256;
    assert_int_equal(td_kv_pool_create(&kp, &r->kv), TD_OK);
    td_sched_params sp = td_sched_default_params();
    sp.max_running = 8;
    sp.max_ctx = 2048;
    sp.prefix_cache = false;
    sp.tpot_target_s = tpot_target;
    sp.tpot_decode_factor = factor;
    sp.prefill_share = share;
    assert_int_equal(td_sched_core_init(&r->c, &sp, r->kv, NULL), TD_OK);
}

static void rig_close(core_rig *r) {
    for (size_t i = 0; i < TD_ARRAY_SIZE(r->q); i++) {
        if (!r->q[i].tokens) continue;
        td_sched_core_unlink(&r->c, &r->q[i]);
        td_sched_core_release(&r->c, &r->q[i]);
        td_sched_seq_free(&r->q[i]);
    }
    td_sched_core_free(&r->c);
    td_kv_counts kc;
    td_kv_pool_counts(r->kv, &kc);
    assert_int_equal(kc.used, 0);
    assert_int_equal(kc.reserved, 0);
    td_kv_pool_destroy(r->kv);
}

/* Sequences 0..2 with 8-token prompts, prefilled and given a token each
 * (decoding from here on); then sequence 3 arrives with a 1000-token
 * prompt and is admitted. */
static void rig_three_decoding_one_long(core_rig *r) {
    int32_t prompt[1000];
    for (int32_t k = 0; k < 1000; k++) prompt[k] = k % 97;
    for (int i = 0; i < 3; i++) {
        assert_int_equal(td_sched_seq_init(&r->q[i], &r->c, prompt, 8, 64), TD_OK);
        td_sched_core_enqueue(&r->c, &r->q[i]);
    }
    assert_int_equal(td_sched_core_admit(&r->c), 3);
    assert_int_equal(td_sched_core_build_batch(&r->c), 3); /* the prompts alone */
    for (int i = 0; i < 3; i++) {
        td_sched_core_computed(&r->c, &r->q[i]);
        td_sched_core_append(&r->c, &r->q[i], 1);
    }
    assert_int_equal(td_sched_seq_init(&r->q[3], &r->c, prompt, 1000, 8), TD_OK);
    td_sched_core_enqueue(&r->c, &r->q[3]);
    assert_int_equal(td_sched_core_admit(&r->c), 1);
}

/* Steps of many shapes, timed by the line: the fit finds it (to the
 * ridge's rounding), and forgets: after the machine slows to twice the
 * line, 100 steps later the estimate is within 1% of the new line. Before
 * any step with prompt tokens, nothing is estimated. Times no line with
 * nonnegative coefficients fits still give a monotone estimate. */
static void test_step_estimate(void **state) {
    (void)state;
    core_rig r;
    rig_open(&r, 0, 1, 0);
    assert_true(td_sched_core_estimate(&r.c, 1, 100) < 0);
    for (int k = 0; k < 10; k++) { /* decode-only steps say nothing per prompt token */
        r.c.step_decodes = 1 + k % 4;
        r.c.step_prompt = 0;
        td_sched_core_observe(&r.c, line_t(r.c.step_decodes, 0));
    }
    assert_true(td_sched_core_estimate(&r.c, 1, 100) < 0);
    for (int k = 0; k < 40; k++) {
        r.c.step_decodes = k % 5;
        r.c.step_prompt = (k * 37) % 200;
        td_sched_core_observe(&r.c, line_t(r.c.step_decodes, r.c.step_prompt));
    }
    for (int32_t d = 0; d < 8; d += 3)
        for (int32_t p = 0; p <= 512; p += 128)
            assert_true(fabs(td_sched_core_estimate(&r.c, d, p) - line_t(d, p)) < 1e-6);
    /* nonsense times are not learned from */
    td_sched_core_observe(&r.c, -1);
    td_sched_core_observe(&r.c, NAN);
    td_sched_core_observe(&r.c, 0);
    assert_true(fabs(td_sched_core_estimate(&r.c, 2, 64) - line_t(2, 64)) < 1e-6);
    for (int k = 0; k < 100; k++) {
        r.c.step_decodes = k % 5;
        r.c.step_prompt = (k * 37) % 200;
        td_sched_core_observe(&r.c, 2 * line_t(r.c.step_decodes, r.c.step_prompt));
    }
    assert_true(fabs(td_sched_core_estimate(&r.c, 3, 100) / (2 * line_t(3, 100)) - 1) < 0.01);
    rig_close(&r);
    /* Times no line fits with every coefficient >= 0: prompts alone cost
     * 10 ms for 16 tokens and 12 ms for 512 (a large fixed cost), a step of
     * one decode 1 ms. Unconstrained, a decode would cost -9 ms; the fit
     * holds every coefficient >= 0, so a step never gets cheaper with more
     * work in it. */
    rig_open(&r, 0, 1, 0);
    const struct {
        int32_t d, p;
        double t;
    } odd[] = {{0, 16, 0.010}, {0, 512, 0.012}, {1, 0, 0.001}};
    for (int k = 0; k < 30; k++) {
        r.c.step_decodes = odd[k % 3].d;
        r.c.step_prompt = odd[k % 3].p;
        td_sched_core_observe(&r.c, odd[k % 3].t);
    }
    for (int32_t d = 0; d < 4; d++)
        for (int32_t p = 0; p <= 512; p += 64) {
            double t = td_sched_core_estimate(&r.c, d, p);
            assert_true(t >= 0);
            assert_true(td_sched_core_estimate(&r.c, d + 1, p) >= t);
            assert_true(td_sched_core_estimate(&r.c, d, p + 1) > t);
        }
    rig_close(&r);
}

/* The prompt budget beside decodes, from the fit and a 20 ms target: three
 * decodes leave 12 ms, 120 prompt tokens at 0.1 ms; a target below the
 * decodes' own 8 ms still gives one token; before any measurement one
 * token; when the steps beside decodes seen so far took at most 30 prompt
 * tokens, twice that (the fit is trusted only a doubling past what it has
 * seen); prefill_share, when tighter, wins; with no target or a step
 * without decodes, no limit. A target derived as 3x the decodes' own time
 * (8 ms): 24 ms, 160 prompt tokens. */
static void test_tpot_budget(void **state) {
    (void)state;
    const struct {
        double target, share, factor;
        int32_t measured; /* steps seen take up to this many prompt tokens - 1 */
        int32_t want;     /* -1: twice the most a step beside decodes took */
    } cases[] = {
        {0.020, 1, 0, 300, 120}, {0.006, 1, 0, 300, 1},     {0.020, 1, 0, 0, 1},
        {0.020, 1, 0, 31, -1},   {0.020, 0.05, 0, 300, 25}, {0, 1, 0, 300, 512 - 3},
        {0, 1, 0, 0, 512 - 3},   {0, 1, 3, 300, 160},       {0.006, 1, 3, 300, 1},
    };
    for (size_t i = 0; i < TD_ARRAY_SIZE(cases); i++) {
        core_rig r;
        rig_open(&r, cases[i].target, cases[i].share, cases[i].factor);
        rig_three_decoding_one_long(&r);
        int32_t want = cases[i].want, most = 0;
        for (int k = 0; cases[i].measured && k < 30; k++) {
            r.c.step_decodes = k % 4;
            r.c.step_prompt = (k * 53) % cases[i].measured;
            if (r.c.step_decodes) most = TD_MAX(most, r.c.step_prompt);
            td_sched_core_observe(&r.c, line_t(r.c.step_decodes, r.c.step_prompt));
        }
        if (want < 0) want = 2 * most;
        assert_int_equal(td_sched_core_build_batch(&r.c), 4);
        int32_t chunk = r.q[3].chunk; /* the fit rounds within a token */
        assert_true(chunk >= TD_MAX(1, want - 1) && chunk <= want);
        assert_int_equal(r.c.step_decodes, 3);
        assert_int_equal(r.c.step_prompt, chunk);
        for (int k = 0; k < 3; k++) assert_int_equal(r.q[k].chunk, 1);
        rig_close(&r);
    }
    /* alone, the long prompt takes the whole step */
    core_rig r;
    rig_open(&r, 0.006, 1, 0);
    int32_t prompt[1000] = {0};
    assert_int_equal(td_sched_seq_init(&r.q[0], &r.c, prompt, 1000, 8), TD_OK);
    td_sched_core_enqueue(&r.c, &r.q[0]);
    assert_int_equal(td_sched_core_admit(&r.c), 1);
    assert_int_equal(td_sched_core_build_batch(&r.c), 1);
    assert_int_equal(r.q[0].chunk, 512);
    assert_int_equal(r.c.step_decodes, 0);
    rig_close(&r);
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
        cmocka_unit_test(test_tpot_target_floor),     cmocka_unit_test(test_step_estimate),
        cmocka_unit_test(test_tpot_budget),           cmocka_unit_test(test_preemption_recomputes),
        cmocka_unit_test(test_prefix_cache_hit),      cmocka_unit_test(test_cancel_frees),
        cmocka_unit_test(test_drain_and_limits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
