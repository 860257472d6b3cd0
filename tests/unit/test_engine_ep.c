/* Expert parallelism (forward.h ep_comm, model.h ep_rank / ep_size) on the
 * tiny Mixtral (4 experts, top-2) and Qwen2-MoE (8 experts, top-2, shared
 * expert) models of tests/models/make_models.py, ranks as threads over the
 * local comm backend, against the single-rank engine:
 * - EP without TP (every rank the whole attention, the same batch): logits
 *   bit-identical to the single-rank run, since each row's experts are
 *   whole, run on the same row values and added in its selection order,
 *   and the other ranks contribute exact zeros;
 * - EP inside TP (tp = ep, and tp 4 with two EP groups of 2): attention and
 *   the shared expert are TP-split, so logits agree within a relative 1e-5
 *   (as the TP-only MoE runs of test_moe_load.c) and, under teacher forcing
 *   over 32 decode steps of two sequences, the argmax agrees wherever the
 *   single-rank top-1/top-2 margin exceeds DELTA;
 * - attention data-parallel (a sequence on EP rank block_table[0] % ep, logits on rank 0
 *   only, td_engine_stage_rows = the own sequences' tokens): bit-identical
 *   to the single-rank run, as no row depends on another rank's sums;
 * - per-expert token counts (td_engine_expert_load) equal on every rank and
 *   equal to the single-rank engine's, whose counts for a batch of
 *   single-token sequences are checked against routing recomputed here in
 *   double precision from the F32 weights;
 * - shards whose expert range does not divide, and engines whose EP group
 *   disagrees with the shard, fail with an error. */
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

#define N_VOCAB  512 /* make_models.py */
#define MAX_NE   8
#define N_LAYER  2
#define N_SEQ    2
#define N_DEC    32 /* teacher-forced decode steps */
#define SEQ_BLK  4  /* blocks of 16 per sequence: 13 + 32 positions */
#define N_ONE    48 /* single-token sequences of the routing check */
#define N_BLOCKS (N_SEQ * SEQ_BLK + N_ONE)
#define N_CALLS  (1 + N_DEC + 1)
#define MAX_RANK 4
#define N_EMBD   128 /* both models */
/* Relative logit tolerance across TP summation orders: a few f32 ulps per
 * layer (~1e-6 measured); a routing or dispatch mistake moves logits by
 * order 1. DELTA: argmax must agree where the single-rank margin exceeds
 * it, far above the 1e-5 * |logit| (< 1e-3 here) the orders can move. */
#define TOL   1e-5
#define DELTA 0.01

static const int PRE[N_SEQ] = {13, 8};

static const char *models_dir(void) { return getenv("TANDEM_TEST_MODELS"); }

static void model_path(char *buf, size_t cap, const char *rel) {
    const char *dir = models_dir();
    if (!dir) {
        print_message("TANDEM_TEST_MODELS not set\n");
        skip();
    }
    snprintf(buf, cap, "%s/%s", dir, rel);
}

static int32_t logit_rows(void) { return PRE[0] + PRE[1] + N_DEC * N_SEQ + N_ONE; }

typedef struct {
    const char *path;
    int tp_size, tp_rank, ep_size, ep_rank;
    td_comm_group *tpg, *epg;     /* NULL: a single comm / no EP group */
    bool attn_dp;                 /* logits on EP rank 0 only (NULL elsewhere) */
    int stage;                    /* -1: the whole model, else pipeline stage 0 (layer 0) or 1 */
    float *xio;                   /* stages: hidden states stage 0 writes, stage 1 reads */
    bool greedy;                  /* write the decode tokens (argmax), else read them */
    int32_t (*tok)[SEQ_BLK * 16]; /* (N_SEQ, positions) */
    const int32_t *one;           /* (N_ONE) tokens of the single-token sequences */
    float *logits;                /* (logit_rows, N_VOCAB) */
    int64_t *load;                /* (N_CALLS, N_LAYER, MAX_NE) per call and layer */
    int n_expert, n_used;
    td_status st;
} job;

static int32_t argmax(const float *v) {
    int32_t b = 0;
    for (int32_t i = 1; i < N_VOCAB; i++)
        if (v[i] > v[b]) b = i;
    return b;
}

static td_status record_load(const job *j, td_engine *e, int64_t *out) {
    int64_t sum[MAX_NE] = {0};
    int lb = j->stage < 0 ? 0 : j->stage, le = j->stage < 0 ? N_LAYER : j->stage + 1;
    td_status st;
    for (int l = lb; l < le; l++)
        if ((st = td_engine_expert_load(e, l, out + (size_t)l * MAX_NE))) return st;
    /* The stage total is the sum of its layers. */
    if ((st = td_engine_expert_load(e, -1, sum))) return st;
    for (int x = 0; x < MAX_NE; x++) {
        int64_t want = 0;
        for (int l = lb; l < le; l++) want += out[l * MAX_NE + x];
        if (sum[x] != want) return TD_ERR_INTERNAL;
    }
    return TD_OK;
}

/* Rows this rank computes: every token, or under attention-DP the tokens of
 * the sequences whose first block id mod ep is the EP rank. */
static td_status check_rows(const job *j, const td_engine *e, const td_seq_chunk *ch, int n) {
    int32_t want = 0;
    for (int i = 0; i < n; i++)
        if (!j->attn_dp || ch[i].block_table[0] % j->ep_size == j->ep_rank) want += ch[i].n_tokens;
    return td_engine_stage_rows(e, ch, n) == want ? TD_OK : TD_ERR_INTERNAL;
}

/* One forward call of this rank (the whole model, or a pipeline stage
 * handing its hidden states over through j->xio), then its counts. */
static td_status call(job *j, td_engine *e, const td_seq_chunk *ch, int n, float *logits,
                      int64_t *load, size_t *xoff) {
    td_status st = check_rows(j, e, ch, n);
    if (st) return st;
    float *x = j->xio ? j->xio + *xoff : NULL;
    *xoff += (size_t)td_engine_stage_rows(e, ch, n) * N_EMBD;
    if (j->stage < 0)
        st = td_engine_forward(e, ch, n, logits);
    else if (j->stage == 0)
        st = td_engine_forward_stage(e, ch, n, NULL, x, NULL);
    else
        st = td_engine_forward_stage(e, ch, n, x, NULL, logits);
    return st ? st : record_load(j, e, load);
}

/* A pool for shard m's layers and KV heads. */
static td_kv_params kv_params_for(const td_model *m, int32_t n_blocks) {
    td_kv_params kp = td_kv_default_params();
    kp.n_layers = td_model_layer_end(m) - td_model_layer_begin(m);
    kp.n_kv_heads = td_model_n_head_kv_local(m);
    kp.head_dim = td_model_get_config(m)->head_dim;
    kp.n_blocks = n_blocks;
    return kp;
}

static void *rank_main(void *arg) {
    job *j = arg;
    td_model *m = NULL;
    td_kv_pool *kv = NULL;
    td_threadpool *tp = NULL;
    td_comm *comm = NULL, *epc = NULL;
    td_engine *e = NULL;
    td_model_params mp = td_model_default_params();
    mp.path = j->path;
    mp.tp_rank = j->tp_rank;
    mp.tp_size = j->tp_size;
    mp.ep_rank = j->ep_rank;
    mp.ep_size = j->ep_size;
    if (j->stage >= 0) {
        mp.layer_begin = j->stage;
        mp.layer_end = j->stage + 1;
    }
    if ((j->st = td_model_load(&mp, &m))) goto done;
    const td_model_config *c = td_model_get_config(m);
    if (c->n_embd != N_EMBD || c->n_layer != N_LAYER) {
        j->st = TD_ERR_INTERNAL;
        goto done;
    }
    j->n_expert = c->n_expert;
    j->n_used = c->n_expert_used;
    td_kv_params kp = kv_params_for(m, N_BLOCKS);
    if ((j->st = td_kv_pool_create(&kp, &kv)) || (j->st = td_threadpool_create(1, &tp)) ||
        (j->st = j->tpg ? td_comm_create_local(j->tpg, j->tp_rank, &comm)
                        : td_comm_create_single(&comm)) ||
        (j->epg && (j->st = td_comm_create_local(j->epg, j->ep_rank, &epc))))
        goto done;
    td_engine_params ep = td_engine_default_params();
    ep.max_ctx = SEQ_BLK * kp.block_size;
    ep.ep_comm = epc;
    ep.attn_dp = j->attn_dp;
    if ((j->st = td_engine_create(m, kv, tp, comm, &ep, &e))) goto done;
    bool no_logits = j->attn_dp && j->ep_rank != 0;

    int32_t blocks[N_SEQ][SEQ_BLK], one_blk[N_ONE];
    for (int s = 0; s < N_SEQ; s++)
        for (int b = 0; b < SEQ_BLK; b++) blocks[s][b] = N_SEQ * SEQ_BLK - 1 - (s * SEQ_BLK + b);
    td_seq_chunk ch[N_ONE];
    float *out = j->logits;
    int64_t *load = j->load;
    size_t xoff = 0;
    /* Prefill of both sequences in one call (rows split across the
     * sequence boundary), every row's logits. */
    for (int s = 0; s < N_SEQ; s++)
        ch[s] = (td_seq_chunk){.tokens = j->tok[s],
                               .n_tokens = PRE[s],
                               .block_table = blocks[s],
                               .n_blocks = SEQ_BLK,
                               .logits_all = true};
    if ((j->st = call(j, e, ch, N_SEQ, no_logits ? NULL : out, load, &xoff))) goto done;
    const float *last[N_SEQ] = {out + (size_t)(PRE[0] - 1) * N_VOCAB,
                                out + (size_t)(PRE[0] + PRE[1] - 1) * N_VOCAB};
    out += (size_t)(PRE[0] + PRE[1]) * N_VOCAB;
    load += N_LAYER * MAX_NE;
    /* Decode: one row per sequence (fewer rows than ranks for tp 4). */
    for (int step = 0; step < N_DEC; step++) {
        for (int s = 0; s < N_SEQ; s++) {
            int32_t pos = PRE[s] + step;
            if (j->greedy) j->tok[s][pos] = argmax(last[s]);
            ch[s] = (td_seq_chunk){.tokens = &j->tok[s][pos],
                                   .n_tokens = 1,
                                   .pos0 = pos,
                                   .block_table = blocks[s],
                                   .n_blocks = SEQ_BLK};
        }
        if ((j->st = call(j, e, ch, N_SEQ, no_logits ? NULL : out, load, &xoff))) goto done;
        for (int s = 0; s < N_SEQ; s++) last[s] = out + (size_t)s * N_VOCAB;
        out += (size_t)N_SEQ * N_VOCAB;
        load += N_LAYER * MAX_NE;
    }
    /* Single-token sequences at position 0 (the routing check). */
    for (int i = 0; i < N_ONE; i++) {
        one_blk[i] = N_SEQ * SEQ_BLK + i;
        ch[i] = (td_seq_chunk){
            .tokens = &j->one[i], .n_tokens = 1, .block_table = &one_blk[i], .n_blocks = 1};
    }
    if ((j->st = call(j, e, ch, N_ONE, no_logits ? NULL : out, load, &xoff))) goto done;
done:
    td_engine_destroy(e);
    td_comm_destroy(epc);
    td_comm_destroy(comm);
    td_threadpool_destroy(tp);
    td_kv_pool_destroy(kv);
    td_model_free(m);
    return NULL;
}

static job new_job(const char *path, int32_t (*tok)[SEQ_BLK * 16], const int32_t *one) {
    size_t n_out = (size_t)logit_rows() * N_VOCAB;
    job j = {.path = path,
             .stage = -1,
             .tp_size = 1,
             .ep_size = 1,
             .tok = tok,
             .one = one,
             .logits = calloc(n_out, sizeof(float)),
             .load = calloc((size_t)N_CALLS * N_LAYER * MAX_NE, sizeof(int64_t))};
    assert_non_null(j.logits);
    assert_non_null(j.load);
    return j;
}

/* ------------------------------------------- independent routing (double) */

static const float *wrow(const td_weight *w, int64_t r) {
    assert_int_equal(w->type, TD_TYPE_F32);
    return (const float *)((const char *)w->data + (size_t)r * w->stride);
}

static void matvec(const td_weight *w, const double *x, double *y) {
    for (int64_t r = 0; r < w->rows; r++) {
        const float *a = wrow(w, r);
        double s = 0;
        for (int64_t i = 0; i < w->cols; i++) s += (double)a[i] * x[i];
        y[r] = s;
    }
}

static void rmsnorm(const double *x, const float *w, double *out, int n, double eps) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    double k = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * k * w[i];
}

/* out += scale * down(silu(gate xn) * up xn) */
static void swiglu_ffn(const td_weight *gate, const td_weight *up, const td_weight *down,
                       const double *xn, double scale, double *out) {
    int64_t F = gate->rows;
    double *g = malloc((size_t)F * sizeof *g), *u = malloc((size_t)F * sizeof *u);
    double *y = malloc((size_t)down->rows * sizeof *y);
    matvec(gate, xn, g);
    matvec(up, xn, u);
    for (int64_t i = 0; i < F; i++) g[i] = g[i] / (1.0 + exp(-g[i])) * u[i];
    matvec(down, g, y);
    for (int64_t i = 0; i < down->rows; i++) out[i] += scale * y[i];
    free(g);
    free(u);
    free(y);
}

/* Routes a one-token sequence at position 0 through every layer (attention
 * over one position is its own V). sel: (N_LAYER, K) chosen experts;
 * returns the smallest gap between the K-th and (K+1)-th probabilities. */
static double route_one(const td_model *m, int32_t token, int32_t *sel) {
    const td_model_config *c = td_model_get_config(m);
    const int E = c->n_embd, NE = c->n_expert, K = c->n_expert_used, hd = c->head_dim;
    const int group = c->n_head / c->n_head_kv;
    double x[256], xn[256], v[256], att[256], o[256], p[MAX_NE];
    assert_true(E <= 256 && c->n_head * hd <= 256 && NE <= MAX_NE);
    const float *emb = wrow(td_model_tok_embd(m), token);
    for (int i = 0; i < E; i++) x[i] = emb[i];
    double gap = INFINITY;
    for (int l = 0; l < c->n_layer; l++) {
        const td_layer_weights *lw = td_model_layer(m, l);
        rmsnorm(x, lw->attn_norm, xn, E, c->rms_eps);
        matvec(&lw->wv, xn, v);
        if (lw->bv)
            for (int i = 0; i < c->n_head_kv * hd; i++) v[i] += lw->bv[i];
        for (int h = 0; h < c->n_head; h++)
            for (int d = 0; d < hd; d++) att[h * hd + d] = v[(h / group) * hd + d];
        matvec(&lw->wo, att, o);
        for (int i = 0; i < E; i++) x[i] += o[i];
        rmsnorm(x, lw->ffn_norm, xn, E, c->rms_eps);
        matvec(&lw->router, xn, p);
        double mx = p[0], sum = 0;
        for (int e = 1; e < NE; e++) mx = fmax(mx, p[e]);
        for (int e = 0; e < NE; e++) sum += (p[e] = exp(p[e] - mx));
        for (int e = 0; e < NE; e++) p[e] /= sum;
        bool used[MAX_NE] = {false};
        double w[MAX_NE], wsum = 0;
        for (int k = 0; k <= K && k < NE; k++) {
            int b = -1;
            for (int e = 0; e < NE; e++)
                if (!used[e] && (b < 0 || p[e] > p[b])) b = e;
            if (k == K) {
                gap = fmin(gap, w[K - 1] - p[b]);
                break;
            }
            used[b] = true;
            sel[l * K + k] = b;
            wsum += (w[k] = p[b]);
        }
        double moe[256] = {0};
        for (int k = 0; k < K; k++) {
            const td_expert_weights *ex = &lw->experts[sel[l * K + k]];
            assert_int_equal(ex->id, sel[l * K + k]);
            swiglu_ffn(&ex->gate, &ex->up, &ex->down, xn, c->norm_topk_prob ? w[k] / wsum : w[k],
                       moe);
        }
        if (c->n_ff_shexp > 0) {
            double d = 0;
            for (int i = 0; i < E; i++) d += (double)lw->shexp_inp[i] * xn[i];
            swiglu_ffn(&lw->shexp_gate, &lw->shexp_up, &lw->shexp_down, xn, 1.0 / (1.0 + exp(-d)),
                       moe);
        }
        for (int i = 0; i < E; i++) x[i] += moe[i];
    }
    return gap;
}

/* N_ONE tokens whose routing has a clear top-K at every layer (a gap of at
 * least 1e-3 in probability, far above f32 rounding), and the per-layer
 * expert counts of a batch of them. */
static void pick_tokens(const char *path, int32_t *one, int64_t *counts /* (N_LAYER, MAX_NE) */) {
    td_model_params mp = td_model_default_params();
    mp.path = path;
    td_model *m = NULL;
    assert_int_equal(td_model_load(&mp, &m), TD_OK);
    const td_model_config *c = td_model_get_config(m);
    assert_int_equal(c->n_layer, N_LAYER);
    memset(counts, 0, N_LAYER * MAX_NE * sizeof *counts);
    int n = 0;
    for (int32_t t = 3; t < N_VOCAB && n < N_ONE; t += 5) {
        int32_t sel[N_LAYER * MAX_NE];
        if (route_one(m, t, sel) < 1e-3) continue;
        one[n++] = t;
        for (int l = 0; l < N_LAYER; l++)
            for (int k = 0; k < c->n_expert_used; k++)
                counts[l * MAX_NE + sel[l * c->n_expert_used + k]]++;
    }
    assert_int_equal(n, N_ONE);
    td_model_free(m);
}

/* ------------------------------------------------------------ the cases */

typedef struct {
    char path[1024];
    int32_t tok[N_SEQ][SEQ_BLK * 16];
    int32_t one[N_ONE];
    job ref;
} reference;

/* The single-rank run: greedy decode tokens (the teacher-forced inputs of
 * every other run), and its counts against the recomputed routing. */
static void make_reference(reference *r, const char *rel, bool check_routing) {
    model_path(r->path, sizeof r->path, rel);
    for (int s = 0; s < N_SEQ; s++)
        for (int i = 0; i < PRE[s]; i++)
            r->tok[s][i] = (int32_t)((i * 193 + 71 + s * 37) % N_VOCAB);
    int64_t counts[N_LAYER * MAX_NE];
    if (check_routing) { /* F32 files only: the recomputation reads the weights */
        pick_tokens(r->path, r->one, counts);
    } else {
        for (int i = 0; i < N_ONE; i++) r->one[i] = (int32_t)(3 + 5 * i);
    }
    r->ref = new_job(r->path, r->tok, r->one);
    r->ref.greedy = true;
    rank_main(&r->ref);
    assert_int_equal(r->ref.st, TD_OK);
    const int64_t *last = r->ref.load + (size_t)(N_CALLS - 1) * N_LAYER * MAX_NE;
    if (check_routing) {
        for (int l = 0; l < N_LAYER; l++)
            for (int x = 0; x < MAX_NE; x++)
                if (last[l * MAX_NE + x] != counts[l * MAX_NE + x])
                    fail_msg("%s: layer %d expert %d: engine counts %lld tokens, the recomputed "
                             "routing %lld",
                             rel, l, x, (long long)last[l * MAX_NE + x],
                             (long long)counts[l * MAX_NE + x]);
    }
}

static void free_reference(reference *r) {
    free(r->ref.logits);
    free(r->ref.load);
}

static void run_plan_dp(reference *r, int tp, int ep, bool attn_dp) {
    int world = tp > ep ? tp : ep;
    assert_true(world <= MAX_RANK);
    td_comm_group *tpg = NULL, *epg[MAX_RANK] = {NULL};
    if (tp > 1) assert_int_equal(td_comm_group_create(tp, &tpg), TD_OK);
    for (int g = 0; g < world / ep; g++) assert_int_equal(td_comm_group_create(ep, &epg[g]), TD_OK);
    job jobs[MAX_RANK];
    pthread_t th[MAX_RANK];
    for (int k = 0; k < world; k++) {
        jobs[k] = new_job(r->path, r->tok, r->one);
        jobs[k].tp_size = tp;
        jobs[k].tp_rank = tp > 1 ? k : 0;
        jobs[k].tpg = tpg;
        jobs[k].ep_size = ep;
        jobs[k].ep_rank = k % ep; /* EP groups: consecutive ranks */
        jobs[k].epg = epg[k / ep];
        jobs[k].attn_dp = attn_dp;
        assert_int_equal(pthread_create(&th[k], NULL, rank_main, &jobs[k]), 0);
    }
    for (int k = 0; k < world; k++) pthread_join(th[k], NULL);
    size_t n_out = (size_t)logit_rows() * N_VOCAB;
    size_t n_load = (size_t)N_CALLS * N_LAYER * MAX_NE;
    int K = r->ref.n_used;
    for (int k = 0; k < world; k++) {
        if (jobs[k].st) print_message("rank %d st %d\n", k, jobs[k].st);
        assert_int_equal(jobs[k].st, TD_OK);
        /* Every rank ends with the same logits (rank 0 alone has them under
         * attention-DP) and the same counts. */
        if (!attn_dp) assert_memory_equal(jobs[0].logits, jobs[k].logits, n_out * sizeof(float));
        assert_memory_equal(jobs[0].load, jobs[k].load, n_load * sizeof(int64_t));
    }
    /* Counts: the single-rank engine's, and tokens x K per layer. */
    const int n_tok[N_CALLS] = {[0] = PRE[0] + PRE[1], [N_CALLS - 1] = N_ONE};
    for (int call = 0; call < N_CALLS; call++)
        for (int l = 0; l < N_LAYER; l++) {
            const int64_t *a = jobs[0].load + ((size_t)call * N_LAYER + (size_t)l) * MAX_NE;
            const int64_t *b = r->ref.load + ((size_t)call * N_LAYER + (size_t)l) * MAX_NE;
            int64_t sum = 0;
            for (int x = 0; x < MAX_NE; x++) {
                sum += a[x];
                if (a[x] != b[x])
                    fail_msg("tp %d ep %d call %d layer %d expert %d: %lld tokens, single rank "
                             "%lld",
                             tp, ep, call, l, x, (long long)a[x], (long long)b[x]);
            }
            assert_int_equal(sum, (int64_t)(n_tok[call] ? n_tok[call] : N_SEQ) * K);
        }
    if (tp == 1) {
        if (memcmp(jobs[0].logits, r->ref.logits, n_out * sizeof(float)) != 0)
            fail_msg("tp 1 ep %d%s: logits are not bit-identical to the single-rank run", ep,
                     attn_dp ? " attn-dp" : "");
        print_message("    tp 1 ep %d%s: bit-identical to the single rank\n", ep,
                      attn_dp ? " attn-dp" : "");
    } else {
        double worst = 0;
        int checked = 0;
        for (int32_t row = 0; row < logit_rows(); row++) {
            const float *a = jobs[0].logits + (size_t)row * N_VOCAB;
            const float *b = r->ref.logits + (size_t)row * N_VOCAB;
            double mx = 0, d = 0;
            for (int v = 0; v < N_VOCAB; v++) {
                assert_true(isfinite(a[v]));
                mx = fmax(mx, fabs(b[v]));
                d = fmax(d, fabs((double)a[v] - b[v]));
            }
            assert_true(mx > 0);
            worst = fmax(worst, d / mx);
            int32_t top = argmax(b);
            float second = -INFINITY;
            for (int v = 0; v < N_VOCAB; v++)
                if (v != top && b[v] > second) second = b[v];
            if (b[top] - second > DELTA) {
                checked++;
                if (argmax(a) != top)
                    fail_msg("tp %d ep %d row %d: argmax %d, single rank %d (margin %.3g)", tp, ep,
                             row, argmax(a), top, (double)(b[top] - second));
            }
        }
        print_message("    tp %d ep %d: max relative logit difference %.2e, argmax agrees on %d "
                      "rows with margin > %g\n",
                      tp, ep, worst, checked, DELTA);
        assert_true(worst <= TOL);
        assert_true(checked > logit_rows() / 2);
    }
    for (int k = 0; k < world; k++) {
        free(jobs[k].logits);
        free(jobs[k].load);
    }
    td_comm_group_destroy(tpg);
    for (int g = 0; g < MAX_RANK; g++) td_comm_group_destroy(epg[g]);
}

static void run_plan(reference *r, int tp, int ep) { run_plan_dp(r, tp, ep, false); }

/* Two pipeline stages of ep ranks each (TP 1): stage 0 runs every call
 * first, handing each EP rank's hidden states (td_engine_stage_rows of
 * them) to the same EP rank of stage 1. PP adds no arithmetic, so the
 * logits stay bit-identical and each stage counts its own layer. */
static void run_pp(reference *r, int ep, bool attn_dp) {
    size_t n_out = (size_t)logit_rows() * N_VOCAB;
    size_t n_load = (size_t)N_CALLS * N_LAYER * MAX_NE;
    job jobs[2][MAX_RANK];
    float *xio[MAX_RANK];
    for (int k = 0; k < ep; k++) {
        /* Every token here has a logit row: logit_rows() bounds the rows. */
        xio[k] = calloc((size_t)logit_rows() * N_EMBD, sizeof(float));
        assert_non_null(xio[k]);
    }
    for (int stage = 0; stage < 2; stage++) {
        td_comm_group *g = NULL;
        assert_int_equal(td_comm_group_create(ep, &g), TD_OK);
        pthread_t th[MAX_RANK];
        for (int k = 0; k < ep; k++) {
            job *j = &jobs[stage][k];
            *j = new_job(r->path, r->tok, r->one);
            j->stage = stage;
            j->xio = xio[k];
            j->ep_size = ep;
            j->ep_rank = k;
            j->epg = g;
            j->attn_dp = attn_dp;
            assert_int_equal(pthread_create(&th[k], NULL, rank_main, j), 0);
        }
        for (int k = 0; k < ep; k++) pthread_join(th[k], NULL);
        td_comm_group_destroy(g);
        for (int k = 0; k < ep; k++) {
            assert_int_equal(jobs[stage][k].st, TD_OK);
            assert_memory_equal(jobs[stage][0].load, jobs[stage][k].load, n_load * sizeof(int64_t));
        }
    }
    if (memcmp(jobs[1][0].logits, r->ref.logits, n_out * sizeof(float)) != 0)
        fail_msg("pp 2 ep %d%s: logits are not bit-identical to the single-rank run", ep,
                 attn_dp ? " attn-dp" : "");
    for (int call = 0; call < N_CALLS; call++)
        for (int l = 0; l < N_LAYER; l++) {
            size_t o = ((size_t)call * N_LAYER + (size_t)l) * MAX_NE;
            assert_memory_equal(jobs[l][0].load + o, r->ref.load + o, MAX_NE * sizeof(int64_t));
        }
    print_message("    pp 2 ep %d%s: bit-identical to the single rank\n", ep,
                  attn_dp ? " attn-dp" : "");
    for (int stage = 0; stage < 2; stage++)
        for (int k = 0; k < ep; k++) {
            free(jobs[stage][k].logits);
            free(jobs[stage][k].load);
        }
    for (int k = 0; k < ep; k++) free(xio[k]);
}

static void test_mixtral(void **state) {
    (void)state;
    reference r;
    make_reference(&r, "gguf/mixtral-f32.gguf", true);
    run_plan(&r, 1, 2);
    run_plan(&r, 1, 4);
    run_plan(&r, 2, 2);
    run_plan(&r, 4, 4);
    run_plan(&r, 4, 2); /* two EP groups of 2 in the TP group */
    run_plan_dp(&r, 1, 2, true);
    run_plan_dp(&r, 1, 4, true); /* ranks 2, 3 hold no sequence while decoding */
    run_pp(&r, 2, true);
    run_pp(&r, 4, false);
    free_reference(&r);
}

static void test_qwen2moe(void **state) {
    (void)state;
    reference r;
    make_reference(&r, "hf/qwen2moe-f32", true);
    run_plan(&r, 1, 2);
    run_plan(&r, 1, 4);
    run_plan(&r, 2, 2);
    run_plan(&r, 4, 4);
    run_plan(&r, 4, 2);
    run_plan_dp(&r, 1, 2, true);
    run_plan_dp(&r, 1, 4, true);
    run_pp(&r, 2, false);
    run_pp(&r, 4, true);
    free_reference(&r);
}

/* Q8_0 files: per-expert tensors (Mixtral) and merged ones (Qwen2-MoE). */
static void test_q8(void **state) {
    (void)state;
    reference r;
    make_reference(&r, "gguf/mixtral-q8_0.gguf", false);
    run_plan(&r, 1, 4);
    run_plan(&r, 2, 2);
    free_reference(&r);
    make_reference(&r, "gguf/qwen2moe-q8_0.gguf", false);
    run_plan(&r, 1, 2);
    run_plan(&r, 4, 4);
    run_plan_dp(&r, 1, 4, true);
    free_reference(&r);
}

/* ------------------------------------------------------------ bad input */

static td_status try_load(const char *rel, int tp_rank, int tp_size, int ep_rank, int ep_size,
                          td_model **m_p) {
    char path[1024];
    model_path(path, sizeof path, rel);
    td_model_params mp = td_model_default_params();
    mp.path = path;
    mp.tp_rank = tp_rank;
    mp.tp_size = tp_size;
    mp.ep_rank = ep_rank;
    mp.ep_size = ep_size;
    *m_p = NULL;
    return td_model_load(&mp, m_p);
}

/* Expert ranges: rank 1 of 2 holds experts 2 and 3, whole even with tp 2
 * (the same bytes as the full model's), and ranges that do not divide fail. */
static void test_shard(void **state) {
    (void)state;
    td_model *full, *m;
    assert_int_equal(try_load("gguf/mixtral-q8_0.gguf", 0, 1, 0, 1, &full), TD_OK);
    assert_int_equal(try_load("gguf/mixtral-q8_0.gguf", 1, 2, 1, 2, &m), TD_OK);
    assert_int_equal(td_model_ep_rank(m), 1);
    assert_int_equal(td_model_ep_size(m), 2);
    /* Two mappings of one file: offsets from each one's embedding (the TP
     * shard's starts at its vocabulary slice). */
    int32_t v0, v1;
    td_model_vocab_range(m, &v0, &v1);
    const char *bf = td_model_tok_embd(full)->data;
    const char *bm =
        (const char *)td_model_tok_embd(m)->data - (size_t)v0 * td_model_tok_embd(m)->stride;
    for (int l = 0; l < N_LAYER; l++) {
        const td_layer_weights *a = td_model_layer(full, l), *b = td_model_layer(m, l);
        assert_int_equal(b->n_experts_local, 2);
        for (int i = 0; i < 2; i++) {
            const td_expert_weights *x = &a->experts[2 + i], *y = &b->experts[i];
            assert_int_equal(y->id, 2 + i);
            assert_int_equal(y->gate.rows, 128);
            assert_int_equal(y->down.cols, 128);
            assert_int_equal((const char *)y->gate.data - bm, (const char *)x->gate.data - bf);
            assert_int_equal((const char *)y->up.data - bm, (const char *)x->up.data - bf);
            assert_int_equal((const char *)y->down.data - bm, (const char *)x->down.data - bf);
        }
        assert_int_equal(b->wq.rows, a->wq.rows / 2); /* attention still TP-split */
    }
    /* Per token a rank reads K / ep experts' bytes on average. */
    assert_true(td_model_weight_bytes(m) < td_model_weight_bytes(full));
    td_model_free(m);
    td_model_free(full);
    assert_int_equal(try_load("gguf/mixtral-f32.gguf", 0, 1, 0, 3, &m), TD_ERR_INVALID);
    assert_null(m);
    assert_int_equal(try_load("hf/qwen2moe-f32", 0, 1, 0, 16, &m), TD_ERR_INVALID);
    assert_int_equal(try_load("gguf/mixtral-f32.gguf", 0, 1, 2, 2, &m), TD_ERR_INVALID);
    assert_int_equal(try_load("gguf/mixtral-f32.gguf", 0, 1, -1, 2, &m), TD_ERR_INVALID);
    assert_int_equal(try_load("gguf/mixtral-f32.gguf", 0, 1, 0, 0, &m), TD_ERR_INVALID);
    assert_int_equal(try_load("gguf/llama2-f32.gguf", 0, 1, 0, 2, &m), TD_ERR_INVALID);
}

static td_status try_engine(td_model *m, td_comm *comm, td_comm *epc, bool attn_dp) {
    const td_model_config *c = td_model_get_config(m);
    td_kv_params kp = kv_params_for(m, 4);
    td_kv_pool *kv = NULL;
    assert_int_equal(td_kv_pool_create(&kp, &kv), TD_OK);
    td_engine_params ep = td_engine_default_params();
    ep.max_ctx = 64;
    ep.ep_comm = epc;
    ep.attn_dp = attn_dp;
    td_engine *e = NULL;
    td_status st = td_engine_create(m, kv, NULL, comm, &ep, &e);
    if (st == TD_OK) {
        int64_t counts[MAX_NE];
        /* Zeros before the first call; layers outside the stage fail. */
        assert_int_equal(td_engine_expert_load(e, -1, counts), TD_OK);
        for (int x = 0; x < c->n_expert; x++) assert_int_equal(counts[x], 0);
        assert_int_equal(td_engine_expert_load(e, N_LAYER, counts), TD_ERR_INVALID);
        assert_int_equal(td_engine_expert_load(e, -2, counts), TD_ERR_INVALID);
    }
    td_engine_destroy(e);
    td_kv_pool_destroy(kv);
    return st;
}

/* Engines whose EP group disagrees with the shard (creating an engine is
 * not collective, so the other ranks' comms need no threads here). */
static void test_bad_group(void **state) {
    (void)state;
    td_model *m0, *m1, *whole, *dense, *tp1;
    assert_int_equal(try_load("gguf/mixtral-f32.gguf", 0, 1, 0, 2, &m0), TD_OK);
    assert_int_equal(try_load("gguf/mixtral-f32.gguf", 0, 1, 1, 2, &m1), TD_OK);
    assert_int_equal(try_load("gguf/mixtral-f32.gguf", 0, 1, 0, 1, &whole), TD_OK);
    assert_int_equal(try_load("gguf/llama2-f32.gguf", 0, 1, 0, 1, &dense), TD_OK);
    assert_int_equal(try_load("gguf/mixtral-f32.gguf", 1, 2, 0, 2, &tp1), TD_OK);
    td_comm *single = NULL, *g2c[2], *g4c0 = NULL, *t2c[2], *t3c1 = NULL;
    td_comm_group *g2 = NULL, *g4 = NULL, *t2 = NULL, *t3 = NULL;
    assert_int_equal(td_comm_create_single(&single), TD_OK);
    assert_int_equal(td_comm_group_create(2, &g2), TD_OK);
    assert_int_equal(td_comm_group_create(4, &g4), TD_OK);
    assert_int_equal(td_comm_group_create(2, &t2), TD_OK);
    assert_int_equal(td_comm_group_create(3, &t3), TD_OK);
    for (int r = 0; r < 2; r++) {
        assert_int_equal(td_comm_create_local(g2, r, &g2c[r]), TD_OK);
        assert_int_equal(td_comm_create_local(t2, r, &t2c[r]), TD_OK);
    }
    assert_int_equal(td_comm_create_local(g4, 0, &g4c0), TD_OK);
    assert_int_equal(td_comm_create_local(t3, 1, &t3c1), TD_OK);

    assert_int_equal(try_engine(m0, single, g2c[0], false), TD_OK);
    assert_int_equal(try_engine(m1, single, g2c[1], false), TD_OK);
    assert_int_equal(try_engine(whole, single, NULL, false), TD_OK);
    assert_int_equal(try_engine(m0, single, NULL, false), TD_ERR_INVALID);   /* no EP group */
    assert_int_equal(try_engine(m0, single, g2c[1], false), TD_ERR_INVALID); /* other rank */
    assert_int_equal(try_engine(m1, single, g2c[0], false), TD_ERR_INVALID);
    assert_int_equal(try_engine(m0, single, g4c0, false), TD_ERR_INVALID); /* other size */
    assert_int_equal(try_engine(whole, single, g2c[0], false), TD_ERR_INVALID);
    assert_int_equal(try_engine(dense, single, g2c[0], false), TD_ERR_INVALID);
    /* Inside TP: TP rank 1 must be EP rank 1 of its group, and EP must divide TP. */
    assert_int_equal(try_engine(tp1, t2c[1], g2c[0], false), TD_ERR_INVALID);
    assert_int_equal(try_engine(m1, t3c1, g2c[1], false), TD_ERR_INVALID);
    /* Attention-DP: whole attention (TP 1 shard and comm), an EP group. */
    assert_int_equal(try_engine(m0, single, g2c[0], true), TD_OK);
    assert_int_equal(try_engine(whole, single, NULL, true), TD_ERR_INVALID);
    assert_int_equal(try_engine(tp1, t2c[0], g2c[0], true), TD_ERR_INVALID);
    assert_int_equal(try_engine(dense, single, NULL, true), TD_ERR_INVALID);

    td_comm_destroy(single);
    td_comm_destroy(g4c0);
    td_comm_destroy(t3c1);
    for (int r = 0; r < 2; r++) {
        td_comm_destroy(g2c[r]);
        td_comm_destroy(t2c[r]);
    }
    td_comm_group_destroy(g2);
    td_comm_group_destroy(g4);
    td_comm_group_destroy(t2);
    td_comm_group_destroy(t3);
    td_model_free(m0);
    td_model_free(m1);
    td_model_free(whole);
    td_model_free(dense);
    td_model_free(tp1);
}

/* Two EP ranks given different batches (a scheduler bug, or a rank that
 * lost a step): the exchange's blocks, sized by each rank from its own
 * batch, disagree, and both ranks fail the step with TD_ERR_INVALID
 * instead of hanging or reading past a block; the next step, on one batch,
 * runs and gives both ranks the same logits. */
typedef struct {
    td_comm *epc;
    int rank;
    bool attn_dp;
    td_status bad, good;
    float logits[4 * N_VOCAB];
} mismatch_job;

static void *mismatch_main(void *arg) {
    mismatch_job *j = arg;
    td_model *m = NULL;
    td_kv_pool *kv = NULL;
    td_comm *single = NULL;
    td_engine *e = NULL;
    j->bad = j->good = TD_ERR_INTERNAL;
    if (try_load("gguf/mixtral-f32.gguf", 0, 1, j->rank, 2, &m) || td_comm_create_single(&single))
        goto done;
    td_kv_params kp = kv_params_for(m, 8);
    if (td_kv_pool_create(&kp, &kv)) goto done;
    td_engine_params ep = td_engine_default_params();
    ep.max_ctx = 64;
    ep.ep_comm = j->epc;
    ep.attn_dp = j->attn_dp;
    if (td_engine_create(m, kv, NULL, single, &ep, &e)) goto done;
    int32_t tok[8] = {5, 9, 77, 3, 41, 200, 8, 13}, blk0[1] = {0}, blk1[1] = {1};
    /* Row split: 6 tokens against 2. Attention-DP: the same 8 tokens, but
     * the ranks disagree on which sequence each rank owns. */
    td_seq_chunk ch[2] = {
        {.tokens = tok, .n_tokens = j->rank ? 2 : 6, .block_table = blk0, .n_blocks = 1},
        {.tokens = tok + 6, .n_tokens = 2, .block_table = blk1, .n_blocks = 1}};
    if (j->attn_dp) {
        ch[0] = (td_seq_chunk){
            .tokens = tok, .n_tokens = 3, .block_table = j->rank ? blk1 : blk0, .n_blocks = 1};
        ch[1] = (td_seq_chunk){
            .tokens = tok + 3, .n_tokens = 5, .block_table = j->rank ? blk0 : blk1, .n_blocks = 1};
    }
    j->bad = td_engine_forward(e, ch, j->attn_dp ? 2 : 1, j->logits);
    ch[0] = (td_seq_chunk){.tokens = tok, .n_tokens = 3, .block_table = blk0, .n_blocks = 1};
    ch[1] = (td_seq_chunk){.tokens = tok + 3, .n_tokens = 4, .block_table = blk1, .n_blocks = 1};
    j->good = td_engine_forward(e, ch, 2, j->attn_dp && j->rank ? NULL : j->logits);
done:
    td_engine_destroy(e);
    td_kv_pool_destroy(kv);
    td_comm_destroy(single);
    td_model_free(m);
    return NULL;
}

static void test_different_batches(void **state) {
    (void)state;
    for (int dp = 0; dp < 2; dp++) {
        td_comm_group *g = NULL;
        assert_int_equal(td_comm_group_create(2, &g), TD_OK);
        static mismatch_job jobs[2];
        pthread_t th[2];
        for (int r = 0; r < 2; r++) {
            jobs[r] = (mismatch_job){.rank = r, .attn_dp = dp};
            assert_int_equal(td_comm_create_local(g, r, &jobs[r].epc), TD_OK);
            assert_int_equal(pthread_create(&th[r], NULL, mismatch_main, &jobs[r]), 0);
        }
        for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
        for (int r = 0; r < 2; r++) {
            assert_int_equal(jobs[r].bad, TD_ERR_INVALID);
            assert_int_equal(jobs[r].good, TD_OK);
            td_comm_destroy(jobs[r].epc);
        }
        /* one logit row per sequence, on both ranks (on rank 0 only under
         * attention-DP) */
        if (!dp) assert_memory_equal(jobs[0].logits, jobs[1].logits, 2 * N_VOCAB * sizeof(float));
        td_comm_group_destroy(g);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shard),   cmocka_unit_test(test_bad_group),
        cmocka_unit_test(test_mixtral), cmocka_unit_test(test_qwen2moe),
        cmocka_unit_test(test_q8),      cmocka_unit_test(test_different_batches),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
