/* Context parallelism inside the engine (PCP and DCP): a group of
 * CP ranks (threads over the in-process comm backend, each with its own
 * model shard, KV pool and engine) runs the same script of batches as the
 * single-rank engine, and CP rank 0's logits are compared with the
 * single-rank ones.
 *
 * The script (block size 4, so every context spans many blocks, and
 * cp_min_tokens 8): a long prompt A prefilled in two chunks split over CP
 * (PCP; the second at pos0 20), a short prompt B in two chunks computed by
 * every rank (DCP; the first without logits), a prompt C whose first two
 * blocks are A's (a prefix hit: pos0 8, K/V written by another call) as
 * one PCP chunk, then 32 decode steps of A, B and C (DCP), with a short
 * prompt D joining in the middle. Decode tokens are the single-rank greedy
 * choices (teacher forcing), fed to both runs.
 *
 * Checks, per plan:
 *   - every logit row within a relative tolerance of the single-rank row
 *     (CP changes the summation order of attention: the DCP merge and the
 *     ring's online softmax rescale per-rank partials);
 *   - allgather mode: the PCP rows whose whole context was itself computed
 *     by PCP (A's chunks, C's chunk) are bit-identical to single-rank (the
 *     gathered context is attended in position order by the same kernel);
 *   - teacher forcing: at every decode step where the single-rank top-1 /
 *     top-2 margin exceeds DELTA, the argmax agrees;
 *   - the decode rows are not bit-identical to single-rank (the DCP path
 *     ran).
 * With cp_min_tokens 1 (every chunk split, decode tokens included) the
 * allgather run is bit-identical to single-rank in every row.
 * Plus: cp_comm of size 1 is bit-identical to no CP; TP 2 x CP 2 and
 * PP 2 x CP 2 plans; 2 threads per rank give the bits of 1; only a block's
 * owner ever writes it (the pools start as NaN, so a read of a block a rank
 * never wrote would also show in the logits); td_engine_stage_rows and the
 * bytes sent over the CP group, exactly, for a PCP + DCP batch in both
 * modes; ranks given different batches (a token, a block id, the number of
 * sequences), a batch only one rank refuses, and a missing logits buffer
 * on rank 0 all fail on every rank with TD_ERR_INVALID, after which the
 * group still works and computes what it did before; bad CP
 * parameters are refused at creation. */
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

#include "common/base/threadpool.h"
#include "common/comm/comm.h"
#include "common/engine/forward.h"
#include "common/kv/kv.h"
#include "common/model/model.h"
#include "common/parallel/plan.h"

#define BS        4
#define N_BLOCKS  160
#define MAX_CTX   96
#define MAX_TOK   64
#define CP_MIN    8
#define N_SEQ     4
#define N_DEC     32
#define N_STEPS   (2 + N_DEC)
#define MAX_RANKS 8
#define MAX_LEN   80

/* Tolerances, F32 weights. CP only reorders float32 sums inside attention
 * (a few ulps per layer; measured up to 7e-7 relative to the largest
 * logit on these models); 1e-4 is far above that and far below what a
 * wrong merge or a missing block does (order 0.1 and more). DELTA: a
 * top-1/top-2 margin that such a difference cannot flip (logits are O(10),
 * so 1e-4 relative is at most ~1e-3 absolute). */
#define TOL   1e-4
#define DELTA 1e-2

/* ------------------------------------------------------------ the script */

typedef struct {
    int seq, n;
    bool all, none;
    bool exact; /* context computed by PCP only: allgather reproduces the bits */
} op;

typedef struct {
    op ops[N_SEQ];
    int n_ops;
} step;

static const int k_prompt[N_SEQ] = {37, 6, 22, 3};
#define C_SHARED 8 /* C's first two blocks are A's */
#define D_JOIN   10

static int build_script(step *st) {
    int n = 0;
    st[n++] = (step){.ops = {{0, 20, true, false, true}, {1, 3, false, true, false}}, .n_ops = 2};
    st[n++] = (step){.ops = {{0, 17, false, false, true},
                             {1, 3, true, false, false},
                             {2, k_prompt[2] - C_SHARED, true, false, true}},
                     .n_ops = 3};
    for (int d = 0; d < N_DEC; d++) {
        step s = {.n_ops = 0};
        for (int q = 0; q < 3; q++) s.ops[s.n_ops++] = (op){q, 1, false, false, false};
        if (d == D_JOIN) s.ops[s.n_ops++] = (op){3, k_prompt[3], true, false, false};
        if (d > D_JOIN) s.ops[s.n_ops++] = (op){3, 1, false, false, false};
        st[n++] = s;
    }
    return n;
}

/* Tokens and block tables of the sequences (the same ids on every rank). */
typedef struct {
    int32_t tok[N_SEQ][MAX_LEN];
    int32_t blocks[N_SEQ][MAX_LEN / BS + 1];
    int done[N_SEQ];
} seqs_state;

static void seqs_init(seqs_state *s, int32_t V) {
    memset(s, 0, sizeof *s);
    uint32_t r = 12345u;
    for (int q = 0; q < N_SEQ; q++)
        for (int i = 0; i < MAX_LEN; i++) {
            r = r * 1664525u + 1013904223u;
            s->tok[q][i] = 3 + (int32_t)((r >> 8) % (uint32_t)(V - 3));
        }
    memcpy(s->tok[2], s->tok[0], C_SHARED * sizeof(int32_t));
    int next = 0;
    for (int q = 0; q < N_SEQ; q++)
        for (int b = 0; b < MAX_LEN / BS + 1; b++) s->blocks[q][b] = (next++ * 37 + 5) % N_BLOCKS;
    s->blocks[2][0] = s->blocks[0][0];
    s->blocks[2][1] = s->blocks[0][1];
    s->done[2] = C_SHARED; /* A's first call writes C's prefix */
}

static int make_batch(const seqs_state *s, const step *st, td_seq_chunk *c) {
    for (int i = 0; i < st->n_ops; i++) {
        const op *o = &st->ops[i];
        int p = s->done[o->seq];
        c[i] = (td_seq_chunk){.tokens = s->tok[o->seq] + p,
                              .n_tokens = o->n,
                              .pos0 = p,
                              .block_table = s->blocks[o->seq],
                              .n_blocks = MAX_LEN / BS + 1,
                              .logits_all = o->all,
                              .no_logits = o->none};
    }
    return st->n_ops;
}

/* ------------------------------------------------------------- a cluster */

typedef struct {
    td_model *m;
    td_kv_pool *kv;
    td_threadpool *th;
    td_comm *world, *tpc, *cpc;
    td_engine *e;
    int tp_r, cp_r, pp_r;
    float *xout;   /* (MAX_TOK, n_embd) hidden states to the next stage */
    float *logits; /* (MAX_TOK, V) */
    td_status st;
} rank_t;

typedef struct {
    const char *path;
    int tp, cp, pp, mode, n_threads;
    int32_t cp_min; /* cp_min_tokens */
    bool cp_null;   /* cp 1 without a CP comm at all */
    td_comm_group *g;
    rank_t r[MAX_RANKS];
    int32_t V, E;
    /* the call each rank makes (per-rank batches for the bad-input cases) */
    const td_seq_chunk *batch[MAX_RANKS];
    int n_batch[MAX_RANKS];
    bool no_logits_buf[MAX_RANKS];
} cluster;

static int world(const cluster *c) { return c->tp * c->cp * c->pp; }

typedef struct {
    cluster *c;
    int rank;
} rank_arg;

/* Layer l's K (v false) or V region of a rank's KV storage (the CPU
 * backends keep it in host memory, in the layout it describes). */
static float *kv_region(td_engine *e, int l, bool v) {
    td_kv_storage st;
    assert_int_equal(td_engine_kv_storage(e, &st), TD_OK);
    assert_int_equal(st.layout.dtype, TD_TYPE_F32);
    return (float *)((char *)st.base + ((size_t)l * 2u + v) * st.layout.layer_bytes);
}

static void *rank_setup(void *arg) {
    rank_arg *a = arg;
    cluster *c = a->c;
    rank_t *r = &c->r[a->rank];
    r->tp_r = a->rank % c->tp;
    r->cp_r = a->rank / c->tp % c->cp;
    r->pp_r = a->rank / (c->tp * c->cp);
    if ((r->st = td_comm_create_local(c->g, a->rank, &r->world)) ||
        (r->st = td_comm_split(r->world, r->pp_r * c->cp + r->cp_r, r->tp_r, &r->tpc)) ||
        (r->st = td_comm_split(r->world, r->pp_r * c->tp + r->tp_r, r->cp_r, &r->cpc)))
        return NULL;
    td_model_params mp = td_model_default_params();
    mp.path = c->path;
    mp.tp_rank = r->tp_r;
    mp.tp_size = c->tp;
    if (c->pp == 2) {
        mp.layer_begin = r->pp_r == 0 ? 0 : 1;
        mp.layer_end = r->pp_r == 0 ? 1 : -1;
    }
    if ((r->st = td_model_load(&mp, &r->m))) return NULL;
    const td_model_config *cfg = td_model_get_config(r->m);
    td_kv_params kp = td_kv_default_params();
    kp.n_layers = td_model_layer_end(r->m) - td_model_layer_begin(r->m);
    kp.n_kv_heads = td_model_n_head_kv_local(r->m);
    kp.head_dim = cfg->head_dim;
    kp.n_blocks = N_BLOCKS;
    kp.block_size = BS;
    if ((r->st = td_kv_pool_create(&kp, &r->kv)) ||
        (r->st = td_threadpool_create(c->n_threads, &r->th)))
        return NULL;
    td_engine_params ep = td_engine_default_params();
    ep.max_batch_tokens = MAX_TOK;
    ep.max_seqs = 8;
    ep.max_ctx = MAX_CTX;
    ep.cp_comm = c->cp_null ? NULL : r->cpc;
    ep.cp_mode = c->mode;
    ep.cp_min_tokens = c->cp_min;
    if ((r->st = td_engine_create(r->m, r->kv, r->th, r->tpc, &ep, &r->e))) return NULL;
    /* NaN everywhere: a block this rank reads without having written it
     * makes the logits non-finite */
    size_t cells = (size_t)N_BLOCKS * BS * (size_t)kp.n_kv_heads * (size_t)kp.head_dim;
    for (int l = 0; l < kp.n_layers; l++)
        for (size_t i = 0; i < cells; i++)
            kv_region(r->e, l, false)[i] = kv_region(r->e, l, true)[i] = NAN;
    r->xout = malloc((size_t)MAX_TOK * (size_t)cfg->n_embd * sizeof(float));
    r->logits = malloc((size_t)MAX_TOK * (size_t)cfg->n_vocab * sizeof(float));
    r->st = r->xout && r->logits ? TD_OK : TD_ERR_NOMEM;
    return NULL;
}

static void run_ranks(cluster *c, void *(*fn)(void *), int pp_r) {
    pthread_t th[MAX_RANKS];
    rank_arg args[MAX_RANKS];
    int n = 0;
    for (int i = 0; i < world(c); i++) {
        if (pp_r >= 0 && i / (c->tp * c->cp) != pp_r) continue;
        args[n] = (rank_arg){c, i};
        assert_int_equal(pthread_create(&th[n], NULL, fn, &args[n]), 0);
        n++;
    }
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
}

static void cluster_open_full(cluster *c, const char *path, int tp, int cp, int pp, int mode,
                              bool cp_null, int n_threads, int32_t cp_min) {
    memset(c, 0, sizeof *c);
    c->path = path;
    c->cp_null = cp_null;
    c->tp = tp;
    c->cp = cp;
    c->pp = pp;
    c->mode = mode;
    c->n_threads = n_threads;
    c->cp_min = cp_min;
    assert_true(world(c) <= MAX_RANKS);
    assert_int_equal(td_comm_group_create(world(c), &c->g), TD_OK);
    run_ranks(c, rank_setup, -1);
    for (int i = 0; i < world(c); i++) assert_int_equal(c->r[i].st, TD_OK);
    const td_model_config *cfg = td_model_get_config(c->r[0].m);
    c->V = cfg->n_vocab;
    c->E = cfg->n_embd;
}

static void cluster_open(cluster *c, const char *path, int tp, int cp, int pp, int mode,
                         bool cp_null) {
    cluster_open_full(c, path, tp, cp, pp, mode, cp_null, 1, CP_MIN);
}

static void cluster_close(cluster *c) {
    for (int i = 0; i < world(c); i++) {
        rank_t *r = &c->r[i];
        td_engine_destroy(r->e);
        td_kv_pool_destroy(r->kv);
        td_threadpool_destroy(r->th);
        td_model_free(r->m);
        td_comm_destroy(r->cpc);
        td_comm_destroy(r->tpc);
        td_comm_destroy(r->world);
        free(r->xout);
        free(r->logits);
    }
    td_comm_group_destroy(c->g);
}

static rank_t *rank_at(cluster *c, int tp_r, int cp_r, int pp_r) {
    return &c->r[tp_r + c->tp * (cp_r + c->cp * pp_r)];
}

static void *rank_step(void *arg) {
    rank_arg *a = arg;
    cluster *c = a->c;
    rank_t *r = &c->r[a->rank];
    bool first = r->pp_r == 0, last = r->pp_r == c->pp - 1;
    const float *x_in = first ? NULL : rank_at(c, r->tp_r, r->cp_r, r->pp_r - 1)->xout;
    float *logits = last && r->cp_r == 0 && !c->no_logits_buf[a->rank] ? r->logits : NULL;
    r->st = td_engine_forward_stage(r->e, c->batch[a->rank], c->n_batch[a->rank], x_in,
                                    last ? NULL : r->xout, logits);
    return NULL;
}

/* Every rank runs its batch, stage after stage (a failed stage stops the
 * pipeline). Returns the status of each rank in st. */
static void cluster_step(cluster *c, td_status *st) {
    for (int s = 0; s < c->pp; s++) {
        run_ranks(c, rank_step, s);
        bool ok = true;
        for (int i = 0; i < world(c); i++)
            if (c->r[i].pp_r == s && c->r[i].st) ok = false;
        if (!ok) {
            for (int i = 0; i < world(c); i++) st[i] = c->r[i].pp_r <= s ? c->r[i].st : TD_OK;
            return;
        }
    }
    for (int i = 0; i < world(c); i++) st[i] = c->r[i].st;
}

static void cluster_run(cluster *c, const td_seq_chunk *b, int n) {
    for (int i = 0; i < world(c); i++) {
        c->batch[i] = b;
        c->n_batch[i] = n;
    }
    td_status st[MAX_RANKS];
    cluster_step(c, st);
    for (int i = 0; i < world(c); i++) assert_int_equal(st[i], TD_OK);
}

/* The logits of a run: rank (tp 0, cp 0, last stage). */
static float *cluster_logits(cluster *c) { return rank_at(c, 0, 0, c->pp - 1)->logits; }

/* ----------------------------------------------------------- the runs */

typedef struct {
    float *rows[N_STEPS]; /* (rows of the step, V) */
    int n_rows[N_STEPS];
} run_logits;

static void run_logits_free(run_logits *l) {
    for (int i = 0; i < N_STEPS; i++) free(l->rows[i]);
}

static int argmax(const float *l, int V, float *margin) {
    int a = 0, b = -1;
    for (int v = 1; v < V; v++) {
        if (l[v] > l[a]) {
            b = a;
            a = v;
        } else if (b < 0 || l[v] > l[b]) {
            b = v;
        }
    }
    if (margin) *margin = l[a] - l[b];
    return a;
}

/* Runs the script with the tokens of s (teacher forcing: the decode tokens
 * are the reference's). Also checks that every TP rank of CP rank 0 got
 * the same logits bit for bit. */
static void run_script(cluster *c, seqs_state *s, run_logits *out) {
    step st[N_STEPS];
    int n_steps = build_script(st);
    assert_int_equal(n_steps, N_STEPS);
    for (int k = 0; k < n_steps; k++) {
        td_seq_chunk b[N_SEQ];
        int n = make_batch(s, &st[k], b);
        cluster_run(c, b, n);
        int rows = td_engine_n_logit_rows(b, n);
        size_t bytes = (size_t)rows * (size_t)c->V * sizeof(float);
        out->rows[k] = malloc(bytes ? bytes : 1);
        assert_non_null(out->rows[k]);
        memcpy(out->rows[k], cluster_logits(c), bytes);
        out->n_rows[k] = rows;
        for (int t = 1; t < c->tp; t++)
            assert_memory_equal(rank_at(c, t, 0, c->pp - 1)->logits, out->rows[k], bytes);
        for (int i = 0; i < n; i++) s->done[st[k].ops[i].seq] += b[i].n_tokens;
    }
}

/* The reference run chooses the decode tokens; s->tok is updated so that a
 * later run feeds the same ones. */
static void run_reference(cluster *c, seqs_state *s, run_logits *out) {
    step st[N_STEPS];
    build_script(st);
    for (int k = 0; k < N_STEPS; k++) {
        td_seq_chunk b[N_SEQ];
        int n = make_batch(s, &st[k], b);
        cluster_run(c, b, n);
        int rows = td_engine_n_logit_rows(b, n);
        size_t bytes = (size_t)rows * (size_t)c->V * sizeof(float);
        out->rows[k] = malloc(bytes ? bytes : 1);
        assert_non_null(out->rows[k]);
        memcpy(out->rows[k], cluster_logits(c), bytes);
        out->n_rows[k] = rows;
        int row = 0;
        for (int i = 0; i < n; i++) {
            const op *o = &st[k].ops[i];
            s->done[o->seq] += o->n;
            if (o->none) continue;
            row += o->all ? o->n : 1;
            int p = s->done[o->seq];
            if (p >= k_prompt[o->seq]) /* past the prompt: greedy */
                s->tok[o->seq][p] =
                    argmax(out->rows[k] + (size_t)(row - 1) * (size_t)c->V, c->V, NULL);
        }
    }
}

/* Reference tokens and logits of a model (single rank, no CP comm),
 * kept for the model last asked for. */
typedef struct {
    char path[4096];
    seqs_state tokens; /* prompts + greedy decode tokens */
    run_logits logits;
} reference;

static reference g_ref;

static const reference *get_reference(const char *path) {
    if (strcmp(g_ref.path, path) == 0) return &g_ref;
    run_logits_free(&g_ref.logits);
    memset(&g_ref, 0, sizeof g_ref);
    cluster c;
    cluster_open(&c, path, 1, 1, 1, TD_CP_ALLGATHER, true);
    seqs_init(&g_ref.tokens, c.V);
    seqs_state s = g_ref.tokens;
    run_reference(&c, &s, &g_ref.logits);
    for (int q = 0; q < N_SEQ; q++) memcpy(g_ref.tokens.tok[q], s.tok[q], sizeof s.tok[q]);
    cluster_close(&c);
    snprintf(g_ref.path, sizeof g_ref.path, "%s", path);
    return &g_ref;
}

static const char *models_dir(void) { return getenv("TANDEM_TEST_MODELS"); }

static bool model_path(const char *rel, char *buf, size_t cap) {
    const char *dir = models_dir();
    if (!dir) return false;
    snprintf(buf, cap, "%s/%s", dir, rel);
    struct stat sb;
    return stat(buf, &sb) == 0;
}

/* Compares a CP run with the reference; see the file comment. exact: 0,
 * or 1 (the PCP rows marked exact are bit-identical), or 2 (every row is:
 * allgather with every chunk split). */
static void compare(const cluster *c, const reference *ref, const run_logits *got, int exact,
                    const char *what) {
    step st[N_STEPS];
    build_script(st);
    const int V = c->V;
    double worst = 0, worst_dec = 0;
    int compared = 0, agreed = 0, exact_rows = 0;
    for (int k = 0; k < N_STEPS; k++) {
        assert_int_equal(got->n_rows[k], ref->logits.n_rows[k]);
        int row = 0;
        for (int i = 0; i < st[k].n_ops; i++) {
            const op *o = &st[k].ops[i];
            if (o->none) continue;
            int n_rows = o->all ? o->n : 1;
            for (int j = 0; j < n_rows; j++, row++) {
                const float *a = ref->logits.rows[k] + (size_t)row * (size_t)V;
                const float *b = got->rows[k] + (size_t)row * (size_t)V;
                double mx = 0, d = 0;
                for (int v = 0; v < V; v++) {
                    assert_true(isfinite(b[v]));
                    mx = fmax(mx, fabs(a[v]));
                    d = fmax(d, fabs((double)a[v] - b[v]));
                }
                worst = fmax(worst, d / mx);
                if (k >= 2 && o->n == 1) worst_dec = fmax(worst_dec, d);
                if ((exact == 1 && o->exact) || exact == 2) {
                    assert_memory_equal(a, b, (size_t)V * sizeof(float));
                    exact_rows++;
                }
                if (k >= 2 && o->n == 1) { /* teacher-forced decode step */
                    float margin;
                    int ta = argmax(a, V, &margin);
                    if (margin > DELTA) {
                        compared++;
                        agreed += argmax(b, V, NULL) == ta;
                        assert_int_equal(argmax(b, V, NULL), ta);
                    }
                }
            }
        }
    }
    print_message("    %s: max relative logit difference %.2e, decode steps compared %d/%d%s\n",
                  what, worst, agreed, compared,
                  exact == 2   ? ", every row bit-identical"
                  : exact == 1 ? ", PCP rows bit-identical"
                               : "");
    assert_true(worst <= TOL);
    if (exact < 2) assert_true(worst_dec > 0); /* the merges did change the summation order */
    assert_true(compared >= 3 * N_DEC * 3 / 4);
    if (exact == 1) assert_int_equal(exact_rows, 20 + 1 + (k_prompt[2] - C_SHARED));
}

/* KV block j of a sequence is written only on CP rank j % cp: every other
 * rank still has the NaN it started with there. */
static void check_block_owners(cluster *c, const seqs_state *s) {
    for (int i = 0; i < world(c); i++) {
        rank_t *r = &c->r[i];
        const td_kv_params *kp = td_kv_pool_params(r->kv);
        size_t blk = (size_t)BS * (size_t)kp->n_kv_heads * (size_t)kp->head_dim;
        int owned = 0, foreign = 0;
        for (int q = 0; q < N_SEQ; q++)
            for (int j = 0; j * BS < s->done[q]; j++) {
                size_t b = (size_t)s->blocks[q][j];
                bool mine = j % c->cp == r->cp_r;
                for (int l = 0; l < kp->n_layers; l++) {
                    /* slot 0 of the block holds a position < done */
                    const float *k = kv_region(r->e, l, false) + b * blk;
                    const float *v = kv_region(r->e, l, true) + b * blk;
                    for (size_t x = 0; x < blk / BS; x++) {
                        assert_true(mine ? !isnan(k[x]) : isnan(k[x]));
                        assert_true(mine ? !isnan(v[x]) : isnan(v[x]));
                    }
                }
                if (mine)
                    owned++;
                else
                    foreign++;
            }
        assert_true(owned > 0);
        assert_true(c->cp == 1 || foreign > 0);
    }
}

static void cp_case_full(const char *rel, int tp, int cp, int pp, int mode, int n_threads,
                         int32_t cp_min) {
    char path[4096];
    if (!model_path(rel, path, sizeof path)) {
        print_message("TANDEM_TEST_MODELS not set or %s missing\n", rel);
        skip();
    }
    const reference *ref = get_reference(path);
    cluster c;
    cluster_open_full(&c, path, tp, cp, pp, mode, false, n_threads, cp_min);
    seqs_state s = ref->tokens;
    run_logits got;
    run_script(&c, &s, &got);
    check_block_owners(&c, &s);
    char what[256];
    snprintf(what, sizeof what, "%s tp %d cp %d pp %d %s, %d thread(s) per rank, min %d", rel, tp,
             cp, pp, mode == TD_CP_RING ? "ring" : "allgather", n_threads, cp_min);
    int exact = mode == TD_CP_ALLGATHER && tp == 1 ? (cp_min == 1 ? 2 : 1) : 0;
    compare(&c, ref, &got, exact, what);
    cluster_close(&c);
    if (n_threads > 1) { /* the same plan on one thread per rank: the same bits */
        cluster_open_full(&c, path, tp, cp, pp, mode, false, 1, cp_min);
        seqs_state s1 = ref->tokens;
        run_logits one;
        run_script(&c, &s1, &one);
        for (int k = 0; k < N_STEPS; k++)
            assert_memory_equal(one.rows[k], got.rows[k],
                                (size_t)got.n_rows[k] * (size_t)c.V * sizeof(float));
        run_logits_free(&one);
        cluster_close(&c);
    }
    run_logits_free(&got);
}

static void cp_case(const char *rel, int tp, int cp, int pp, int mode) {
    cp_case_full(rel, tp, cp, pp, mode, 1, CP_MIN);
}

static void test_cp2_allgather(void **state) {
    (void)state;
    cp_case("gguf/tinyllama-f32.gguf", 1, 2, 1, TD_CP_ALLGATHER);
    cp_case("gguf/qwen2-f32.gguf", 1, 2, 1, TD_CP_ALLGATHER); /* Q/K/V biases */
    /* attention items shared by 2 threads per rank */
    cp_case_full("gguf/qwen2-f32.gguf", 1, 2, 1, TD_CP_ALLGATHER, 2, CP_MIN);
}

static void test_cp2_ring(void **state) {
    (void)state;
    cp_case("gguf/tinyllama-f32.gguf", 1, 2, 1, TD_CP_RING);
    cp_case("gguf/qwen2-f32.gguf", 1, 2, 1, TD_CP_RING);
    cp_case_full("gguf/qwen2-f32.gguf", 1, 2, 1, TD_CP_RING, 2, CP_MIN);
    /* Q8_0 weights (activations stay f32), 6 heads over 2 KV heads, 3 layers */
    cp_case("gguf/smollm2-q8_0.gguf", 1, 2, 1, TD_CP_RING);
}

static void test_cp3_cp4(void **state) {
    (void)state;
    /* 3 ranks: an odd ring (two even ranks send first in a row) */
    cp_case("gguf/tinyllama-f32.gguf", 1, 3, 1, TD_CP_RING);
    cp_case("gguf/tinyllama-f32.gguf", 1, 3, 1, TD_CP_ALLGATHER);
    cp_case("hf/llama3-f32", 1, 4, 1, TD_CP_RING); /* HF, NeoX RoPE */
    cp_case("hf/llama3-f32", 1, 4, 1, TD_CP_ALLGATHER);
}

/* cp_min_tokens 1: every chunk is split over CP, decode tokens included
 * (each computed by its block's owner alone); in allgather mode every
 * logit row is then bit-identical to single-rank. */
static void test_all_split(void **state) {
    (void)state;
    cp_case_full("gguf/tinyllama-f32.gguf", 1, 2, 1, TD_CP_ALLGATHER, 1, 1);
    cp_case_full("gguf/tinyllama-f32.gguf", 1, 3, 1, TD_CP_RING, 1, 1);
}

static void test_tp2_cp2(void **state) {
    (void)state;
    cp_case("gguf/tinyllama-f32.gguf", 2, 2, 1, TD_CP_ALLGATHER);
    cp_case("gguf/tinyllama-f32.gguf", 2, 2, 1, TD_CP_RING);
}

static void test_pp2_cp2(void **state) {
    (void)state;
    /* stages exchange td_engine_stage_rows rows; PP itself is bit-exact */
    cp_case("gguf/qwen2-f32.gguf", 1, 2, 2, TD_CP_ALLGATHER);
    cp_case("gguf/qwen2-f32.gguf", 1, 2, 2, TD_CP_RING);
}

/* A CP comm of one rank is exactly the engine without CP. */
static void test_cp1_is_no_cp(void **state) {
    (void)state;
    char path[4096];
    if (!model_path("gguf/qwen2-f32.gguf", path, sizeof path)) skip();
    const reference *ref = get_reference(path);
    cluster c;
    cluster_open(&c, path, 1, 1, 1, TD_CP_RING, false);
    seqs_state s = ref->tokens;
    run_logits got;
    run_script(&c, &s, &got);
    for (int k = 0; k < N_STEPS; k++) {
        assert_int_equal(got.n_rows[k], ref->logits.n_rows[k]);
        assert_memory_equal(got.rows[k], ref->logits.rows[k],
                            (size_t)got.n_rows[k] * (size_t)c.V * sizeof(float));
    }
    assert_int_equal(td_engine_last_timing(c.r[0].e).cp_bytes, 0);
    run_logits_free(&got);
    cluster_close(&c);
}

/* Rows per rank and bytes sent, computed here from the layout rules. */
static void test_rows_and_bytes(void **state) {
    (void)state;
    char path[4096];
    if (!model_path("gguf/tinyllama-f32.gguf", path, sizeof path)) skip();
    cluster c;
    cluster_open(&c, path, 1, 2, 1, TD_CP_ALLGATHER, false);
    const td_model_config *cfg = td_model_get_config(c.r[0].m);
    const uint64_t L = (uint64_t)cfg->n_layer, nh = (uint64_t)cfg->n_head;
    const uint64_t hd = (uint64_t)cfg->head_dim, kvd = (uint64_t)cfg->n_head_kv * hd;
    seqs_state s;
    seqs_init(&s, c.V);
    /* A: 20 tokens from 0 (blocks 0..4: rank 0 holds 0, 2, 4 = 12 tokens,
     * rank 1 holds 1, 3 = 8), every logit row; B: 3 tokens (DCP). */
    td_seq_chunk b[2] = {
        {.tokens = s.tok[0],
         .n_tokens = 20,
         .block_table = s.blocks[0],
         .n_blocks = 10,
         .logits_all = true},
        {.tokens = s.tok[1], .n_tokens = 3, .block_table = s.blocks[1], .n_blocks = 10}};
    assert_int_equal(td_engine_stage_rows(c.r[0].e, b, 2), 12 + 3);
    assert_int_equal(td_engine_stage_rows(c.r[1].e, b, 2), 8 + 3);
    td_seq_chunk mid = b[0]; /* 13 tokens at 7: positions 7 (block 1), 8..11, 12..15, 16..19 */
    mid.tokens = s.tok[0] + 7;
    mid.pos0 = 7;
    mid.n_tokens = 13;
    assert_int_equal(td_engine_stage_rows(c.r[0].e, &mid, 1), 8);
    assert_int_equal(td_engine_stage_rows(c.r[1].e, &mid, 1), 5);
    cluster_run(&c, b, 2);
    /* batch check 16 bytes; per layer the gathered K/V of A (3 blocks of K
     * and V each, padded) and B's partials (3 rows x heads x (hd + 2));
     * rank 1 also sends its 8 logit rows of A to rank 0. */
    uint64_t common = 16 + L * (2 * 3 * BS * kvd + 3 * nh * (hd + 2)) * sizeof(float);
    assert_int_equal(td_engine_last_timing(c.r[0].e).cp_bytes, common);
    assert_int_equal(td_engine_last_timing(c.r[1].e).cp_bytes,
                     common + 8 * (uint64_t)c.E * sizeof(float));
    /* every comm call of a TP-1 rank is a CP one: the batch check, per layer
     * the DCP partials and A's K/V, then the logit rows for rank 0 */
    for (int i = 0; i < 2; i++)
        assert_int_equal(td_engine_last_timing(c.r[i].e).comm_calls, 1 + 2 * L + 1);
    cluster_close(&c);

    cluster_open(&c, path, 1, 2, 1, TD_CP_RING, false);
    cluster_run(&c, b, 2);
    /* ring: each rank sends its own chunk once (rank 0: 3 blocks, rank 1: 2) */
    uint64_t dcp = 16 + L * 3 * nh * (hd + 2) * sizeof(float);
    assert_int_equal(td_engine_last_timing(c.r[0].e).cp_bytes,
                     dcp + L * 2 * 3 * BS * kvd * sizeof(float));
    assert_int_equal(td_engine_last_timing(c.r[1].e).cp_bytes,
                     dcp + L * 2 * 2 * BS * kvd * sizeof(float) +
                         8 * (uint64_t)c.E * sizeof(float));
    cluster_close(&c);
}

/* Every rank's call fails with TD_ERR_INVALID. */
static void expect_all_invalid(cluster *c) {
    td_status st[MAX_RANKS];
    cluster_step(c, st);
    for (int i = 0; i < world(c); i++) assert_int_equal(st[i], TD_ERR_INVALID);
    memset(c->no_logits_buf, 0, sizeof c->no_logits_buf);
}

static void test_bad_input(void **state) {
    (void)state;
    char path[4096];
    if (!model_path("gguf/tinyllama-f32.gguf", path, sizeof path)) skip();
    cluster c;
    cluster_open(&c, path, 1, 2, 1, TD_CP_RING, false);
    seqs_state s;
    seqs_init(&s, c.V);
    td_seq_chunk ok[2] = {
        {.tokens = s.tok[0],
         .n_tokens = 20,
         .block_table = s.blocks[0],
         .n_blocks = 10,
         .logits_all = true},
        {.tokens = s.tok[1], .n_tokens = 3, .block_table = s.blocks[1], .n_blocks = 10}};
    const size_t bytes = 21 * (size_t)c.V * sizeof(float);
    float *first = malloc(bytes);
    assert_non_null(first);
    cluster_run(&c, ok, 2);
    memcpy(first, cluster_logits(&c), bytes);

    /* the same shapes, one token different on rank 1 */
    int32_t other_tok[20];
    memcpy(other_tok, s.tok[0], sizeof other_tok);
    other_tok[13] ^= 1;
    td_seq_chunk diff[2] = {ok[0], ok[1]};
    diff[0].tokens = other_tok;
    c.batch[0] = ok;
    c.batch[1] = diff;
    c.n_batch[0] = c.n_batch[1] = 2;
    expect_all_invalid(&c);
    /* other block ids on rank 0 */
    int32_t other_blocks[10];
    memcpy(other_blocks, s.blocks[0], sizeof other_blocks);
    other_blocks[3] = (other_blocks[3] + 1) % N_BLOCKS;
    diff[0] = ok[0];
    diff[0].block_table = other_blocks;
    c.batch[0] = diff;
    c.batch[1] = ok;
    expect_all_invalid(&c);
    /* a different number of sequences */
    c.batch[0] = ok;
    c.batch[1] = ok;
    c.n_batch[1] = 1;
    expect_all_invalid(&c);
    /* a batch only rank 1 refuses (a token out of the vocabulary) */
    int32_t bad_tok[3] = {1, 2, c.V};
    diff[0] = ok[0];
    diff[1] = ok[1];
    diff[1].tokens = bad_tok;
    c.batch[1] = diff;
    c.n_batch[1] = 2;
    expect_all_invalid(&c);
    /* rank 0 without a logits buffer (the others need none) */
    c.batch[1] = ok;
    c.no_logits_buf[0] = true;
    expect_all_invalid(&c);
    /* both refuse the same bad batch */
    c.batch[0] = diff;
    c.batch[1] = diff;
    expect_all_invalid(&c);

    /* the group still works and the cache was not touched */
    cluster_run(&c, ok, 2);
    assert_memory_equal(cluster_logits(&c), first, bytes);
    free(first);
    cluster_close(&c);
}

static void test_bad_params(void **state) {
    (void)state;
    char path[4096];
    if (!model_path("gguf/tinyllama-f32.gguf", path, sizeof path)) skip();
    td_model_params mp = td_model_default_params();
    mp.path = path;
    td_model *m = NULL;
    assert_int_equal(td_model_load(&mp, &m), TD_OK);
    const td_model_config *cfg = td_model_get_config(m);
    td_kv_params kp = td_kv_default_params();
    kp.n_layers = cfg->n_layer;
    kp.n_kv_heads = cfg->n_head_kv;
    kp.head_dim = cfg->head_dim;
    kp.n_blocks = 8;
    td_kv_pool *kv = NULL;
    assert_int_equal(td_kv_pool_create(&kp, &kv), TD_OK);
    td_comm_group *g = NULL;
    td_comm *tpc = NULL, *cpc = NULL;
    assert_int_equal(td_comm_create_single(&tpc), TD_OK);
    assert_int_equal(td_comm_group_create(2, &g), TD_OK);
    assert_int_equal(td_comm_create_local(g, 0, &cpc), TD_OK);
    td_engine_params ep = td_engine_default_params();
    ep.max_ctx = MAX_CTX;
    ep.cp_comm = cpc;
    td_engine *e = NULL;
    ep.cp_mode = 7;
    assert_int_equal(td_engine_create(m, kv, NULL, tpc, &ep, &e), TD_ERR_INVALID);
    ep.cp_mode = TD_CP_RING;
    ep.cp_min_tokens = 0;
    assert_int_equal(td_engine_create(m, kv, NULL, tpc, &ep, &e), TD_ERR_INVALID);
    assert_null(e);
    ep.cp_min_tokens = 1;
    assert_int_equal(td_engine_create(m, kv, NULL, tpc, &ep, &e), TD_OK);
    td_engine_destroy(e);
    td_comm_destroy(cpc);
    td_comm_destroy(tpc);
    td_comm_group_destroy(g);
    td_kv_pool_destroy(kv);
    td_model_free(m);
}

static int teardown(void **state) {
    (void)state;
    run_logits_free(&g_ref.logits);
    memset(&g_ref, 0, sizeof g_ref);
    return 0;
}

int main(void) {
    td_backend_isa_select(td_backend_isa_best());
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cp2_allgather), cmocka_unit_test(test_cp2_ring),
        cmocka_unit_test(test_cp3_cp4),       cmocka_unit_test(test_tp2_cp2),
        cmocka_unit_test(test_all_split),     cmocka_unit_test(test_pp2_cp2),
        cmocka_unit_test(test_cp1_is_no_cp),  cmocka_unit_test(test_rows_and_bytes),
        cmocka_unit_test(test_bad_input),     cmocka_unit_test(test_bad_params),
    };
    return cmocka_run_group_tests(tests, NULL, teardown);
}
