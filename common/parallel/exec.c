/* Executor: rank processes, shards and the step protocol (exec.h). */
#define _GNU_SOURCE
#include "exec.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/base/threadpool.h"

extern char **environ;

#define CFG_MAGIC 0x31474643584554ull /* "TEXCFG1" */
#define MAX_PATH  4096

enum { OP_STEP = 1, OP_NOOP = 2, OP_STOP = 3, OP_EXT_SETUP = 4, OP_EXT = 5, OP_EXT_CONTROL = 6 };

/* What the driver broadcasts once after attaching. Plain data only. */
typedef struct {
    uint64_t magic;
    char model_path[MAX_PATH];
    td_plan_params plan; /* ep resolved by td_plan_create */
    int32_t stage_begin[TD_PLAN_MAX_PP + 1];
    int32_t max_batch_tokens, max_seqs, max_ctx;
    int32_t block_size, n_blocks;
    int32_t n_threads;
    int32_t isa;
    uint64_t weight_bytes; /* of the whole model */
} exec_config;

/* Step header; the payload follows in a second broadcast: per sequence
 * {n_tokens, pos0, n_blocks, flags}, then every token, then every block id,
 * then (has_tags) every sequence's rank-extension tag, then n_ext_words
 * of rank-extension words (exec.h). OP_EXT carries those words only.
 * OP_EXT_SETUP (argument n_seqs) and OP_EXT_CONTROL (operation n_seqs,
 * argument n_tokens) have no payload. */
typedef struct {
    int32_t op;
    int32_t n_seqs;
    int32_t n_tokens;
    int32_t n_block_ids;
    int32_t has_tags;
    int32_t n_ext_words;
} step_hdr;

enum { SEQ_LOGITS_ALL = 1, SEQ_NO_LOGITS = 2 };

/* Per-rank figures gathered on the driver after each step. */
typedef struct {
    double compute_s, comm_s;
    int32_t status;
    int32_t pad;
    uint8_t ext[TD_EXEC_EXT_REPORT_MAX]; /* the rank extension's report */
} rank_report;

struct td_exec {
    /* this rank */
    int world, rank;
    int tp, cp, pp;
    int tp_rank, cp_rank, pp_rank;
    exec_config cfg;
    td_threadpool *pool;
    td_model *model;
    td_kv_pool *kv;
    td_engine *engine;
    bool wrapped; /* td_exec_wrap: engine, kv and model are borrowed */
    /* The control channel: the driver's world (start-up, the step and its
     * directives, the reports, keep-alives); always a CPU backend. */
    td_comm *ctl;
    /* The data world and the groups split from it: what the forward pass
     * reduces and exchanges activations on (TP, CP, EP; PP neighbours over
     * data itself). Split from ctl today; a device backend would make it
     * its own. */
    td_comm *data;
    td_comm *tp_comm, *cp_comm, *ep_comm;
    int32_t n_vocab, n_embd;
    int32_t n_expert;      /* MoE: routed experts; 0 for dense models */
    int64_t *expert_step;  /* (n_expert) this rank's counts of the step, all micro-batches */
    int64_t *expert_tmp;   /* (n_expert) one micro-batch's */
    int64_t *expert_pub;   /* (n_expert) driver: the model's counts of the last step (times_mu) */
    float *expert_sum;     /* (n_expert) reduction buffer */
    bool have_expert_load; /* driver: expert_counts hold a step's totals */
    /* step scratch */
    int32_t *payload;
    size_t payload_cap; /* int32 elements */
    td_seq_chunk *chunks;
    float *x_in, *x_out;
    float *logits; /* last stage, not the driver: (rows, n_vocab) */
    size_t logits_cap;
    double comm_s; /* of the step in progress (p2p and the step's collectives) */
    /* driver only */
    pid_t *pids; /* (world) 0 for rank 0 */
    int *pidfds; /* (world) -1 for rank 0 */
    int stop_fd[2];
    pthread_t monitor, keepalive;
    bool monitor_started, keepalive_started;
    pthread_mutex_t mu; /* one user of the world at a time: steps, keep-alives */
    pthread_cond_t cv;
    atomic_bool stopping; /* written under mu, read by the monitor without it */
    double last_use;
    atomic_bool failed;
    _Atomic int cancel;     /* set by the monitor: rank 0's waits fail (td_comm_params.cancel) */
    atomic_bool comm_ready; /* x->ctl exists: the monitor may abort it (and data with it) */
    td_comm_params comm_params;
    pthread_mutex_t times_mu;
    td_rank_time *times; /* (world) */
    rank_report *reports;
    /* the rank extension (exec.h) */
    const td_exec_ext_ops *ext; /* this process's table; NULL: none */
    void *ext_state;            /* this rank's; NULL until td_exec_ext_setup */
    void *ext_ctx;              /* driver: td_exec_ext_setup's */
    const int32_t *tags;        /* the step's sequence tags (payload), or NULL */
    pthread_mutex_t ext_mu;     /* driver: the queued words */
    int32_t *pending;           /* driver: words for the next step */
    size_t n_pending, pending_cap;
};

td_exec_params td_exec_default_params(void) {
    td_exec_params p;
    memset(&p, 0, sizeof p);
    p.plan = td_plan_default_params();
    p.engine = td_engine_default_params();
    p.block_size = 16;
    p.isa = td_backend_isa_best();
    p.comm = td_comm_default_params();
    return p;
}

/* ------------------------------------------------------------ the shard */

static void rank_coords(td_exec *x) {
    const td_plan_params *p = &x->cfg.plan;
    x->tp = p->tp;
    x->cp = p->cp;
    x->pp = p->pp;
    x->tp_rank = x->rank % p->tp;
    x->cp_rank = (x->rank / p->tp) % p->cp;
    x->pp_rank = x->rank / (p->tp * p->cp);
}

static int world_rank_of(const td_exec *x, int tp_rank, int cp_rank, int pp_rank) {
    return (pp_rank * x->cp + cp_rank) * x->tp + tp_rank;
}

/* The data world and its groups (collective over the control world: every
 * rank, same order). */
static td_status split_groups(td_exec *x) {
    const td_plan_params *p = &x->cfg.plan;
    td_status st;
    if ((st = td_comm_split(x->ctl, 0, x->rank, &x->data))) return st;
    /* --attn-dp: attention is whole on every rank, so no TP group (the
     * ranks only meet in the EP group). */
    bool tp_group = p->tp > 1 && !p->attn_dp;
    if (tp_group &&
        (st = td_comm_split(x->data, x->pp_rank * x->cp + x->cp_rank, x->tp_rank, &x->tp_comm)))
        return st;
    if (!tp_group && (st = td_comm_create_single(&x->tp_comm))) return st;
    if (p->cp > 1 &&
        (st = td_comm_split(x->data, x->pp_rank * x->tp + x->tp_rank, x->cp_rank, &x->cp_comm)))
        return st;
    if (p->ep > 1) {
        int in_stage = x->cp_rank * x->tp + x->tp_rank;
        int groups = p->tp * p->cp / p->ep;
        if ((st = td_comm_split(x->data, x->pp_rank * groups + in_stage / p->ep, in_stage % p->ep,
                                &x->ep_comm)))
            return st;
    }
    return TD_OK;
}

/* Loads this rank's shard, KV pool and engine (after the groups exist). */
static td_status load_shard(td_exec *x) {
    const exec_config *c = &x->cfg;
    td_status st;
    if (!td_backend_isa_select((td_isa)c->isa)) {
        TD_LOG_ERROR("rank %d: this CPU cannot run the %s kernels", x->rank,
                     td_backend_isa_name((td_isa)c->isa));
        return TD_ERR_UNSUPPORTED;
    }
    if ((st = td_threadpool_create(c->n_threads, &x->pool))) return st;
    td_model_params mp = td_model_default_params();
    mp.path = c->model_path;
    mp.tp_rank = c->plan.attn_dp ? 0 : x->tp_rank;
    mp.tp_size = c->plan.attn_dp ? 1 : x->tp;
    if (c->plan.ep > 1) { /* the EP group: consecutive ranks of a stage (td_plan_rank) */
        mp.ep_rank = (x->cp_rank * x->tp + x->tp_rank) % c->plan.ep;
        mp.ep_size = c->plan.ep;
    }
    mp.layer_begin = c->stage_begin[x->pp_rank];
    mp.layer_end = c->stage_begin[x->pp_rank + 1];
    /* a world of one keeps the whole model make_config loaded */
    if (!x->model && (st = td_model_load(&mp, &x->model))) return st;
    const td_model_config *mc = td_model_get_config(x->model);
    x->n_vocab = mc->n_vocab;
    x->n_expert = mc->n_expert;
    x->n_embd = mc->n_embd;
    td_kv_params kp = td_kv_default_params();
    kp.n_layers = mp.layer_end - mp.layer_begin;
    kp.n_kv_heads = td_model_n_head_kv_local(x->model);
    kp.head_dim = mc->head_dim;
    kp.block_size = c->block_size;
    kp.n_blocks = c->n_blocks;
    if ((st = td_kv_pool_create(&kp, &x->kv))) return st;
    td_engine_params ep = td_engine_default_params();
    ep.max_batch_tokens = c->max_batch_tokens;
    ep.max_seqs = c->max_seqs;
    ep.max_ctx = c->max_ctx;
    ep.cp_comm = x->cp_comm;
    ep.cp_mode = c->plan.cp_mode;
    ep.cp_min_tokens = c->plan.cp_min_tokens;
    ep.ep_comm = x->ep_comm;
    ep.attn_dp = c->plan.attn_dp;
    if ((st = td_engine_create(x->model, x->kv, x->pool, x->tp_comm, &ep, &x->engine))) return st;
    size_t xe = (size_t)c->max_batch_tokens * (size_t)x->n_embd;
    x->x_in = malloc(xe * sizeof(float));
    x->x_out = malloc(xe * sizeof(float));
    x->chunks = malloc((size_t)c->max_seqs * sizeof *x->chunks);
    if (x->n_expert > 0) {
        x->expert_step = calloc((size_t)x->n_expert, sizeof *x->expert_step);
        x->expert_tmp = calloc((size_t)x->n_expert, sizeof *x->expert_tmp);
        x->expert_pub = calloc((size_t)x->n_expert, sizeof *x->expert_pub);
        x->expert_sum = calloc((size_t)x->n_expert, sizeof *x->expert_sum);
    }
    if (!x->x_in || !x->x_out || !x->chunks ||
        (x->n_expert > 0 &&
         (!x->expert_step || !x->expert_tmp || !x->expert_pub || !x->expert_sum))) {
        TD_LOG_ERROR("rank %d: out of memory for step buffers", x->rank);
        return TD_ERR_NOMEM;
    }
    return TD_OK;
}

/* Every rank learns whether every rank is up (collective). */
static td_status agree(td_exec *x, td_status mine) {
    float v = mine != TD_OK ? 1.0f : 0.0f; /* statuses are negative: agree on failed or not */
    td_status st = td_comm_all_reduce(x->ctl, &v, 1, TD_COMM_F32, TD_COMM_MAX, NULL);
    if (st) return st;
    return v > 0 ? TD_ERR_IO : TD_OK;
}

static void release_shard(td_exec *x) {
    td_engine_destroy(x->engine);
    /* after the engine, which gave its KV memory back */
    if (x->ext_state) x->ext->destroy(x->ext_state);
    x->ext_state = NULL;
    td_kv_pool_destroy(x->kv);
    td_model_free(x->model);
    td_threadpool_destroy(x->pool);
    td_comm_destroy(x->ep_comm);
    td_comm_destroy(x->cp_comm);
    td_comm_destroy(x->tp_comm);
    td_comm_destroy(x->data);
    td_comm_destroy(x->ctl);
    free(x->payload);
    free(x->chunks);
    free(x->x_in);
    free(x->x_out);
    free(x->logits);
    free(x->expert_step);
    free(x->expert_tmp);
    free(x->expert_pub);
    free(x->expert_sum);
}

/* ------------------------------------------------------------- the step */

static td_status timed_send(td_exec *x, const void *buf, size_t bytes, int peer) {
    double t0 = td_time_s();
    td_status st = td_comm_send(x->data, buf, bytes, peer, NULL);
    x->comm_s += td_time_s() - t0;
    return st;
}

static td_status timed_recv(td_exec *x, void *buf, size_t bytes, int peer) {
    double t0 = td_time_s();
    td_status st = td_comm_recv(x->data, buf, bytes, peer, NULL);
    x->comm_s += td_time_s() - t0;
    return st;
}

static td_status grow_logits(td_exec *x, size_t floats) {
    if (floats <= x->logits_cap) return TD_OK;
    float *p = realloc(x->logits, floats * sizeof(float));
    if (!p) {
        TD_LOG_ERROR("rank %d: out of memory for %zu logits", x->rank, floats);
        return TD_ERR_NOMEM;
    }
    x->logits = p;
    x->logits_cap = floats;
    return TD_OK;
}

/* Micro-batches: up to pp runs of whole sequences with about equal tokens.
 * Fills bounds[0..n] and returns n. */
static int micro_batches(const td_exec *x, const td_seq_chunk *seqs, int32_t n_seqs,
                         int32_t *bounds) {
    int m = TD_MIN(x->pp, n_seqs);
    int64_t total = 0;
    for (int32_t i = 0; i < n_seqs; i++) total += seqs[i].n_tokens;
    bounds[0] = 0;
    int k = 1;
    int64_t acc = 0;
    for (int32_t i = 0; i < n_seqs && k < m; i++) {
        acc += seqs[i].n_tokens;
        /* close micro-batch k-1 once it holds its share, leaving a sequence
         * for each of the ones still to come */
        if (acc * m >= total * k && n_seqs - (i + 1) >= m - k) bounds[k++] = i + 1;
    }
    bounds[k] = n_seqs;
    return k;
}

/* The shard's part of one step, on every rank. logits: the driver's
 * output (rank 0 only). */
static td_status run_step(td_exec *x, const td_seq_chunk *seqs, int32_t n_seqs, float *logits) {
    bool first = x->pp_rank == 0, last = x->pp_rank == x->pp - 1;
    int prev = first ? -1 : world_rank_of(x, x->tp_rank, x->cp_rank, x->pp_rank - 1);
    int next = last ? -1 : world_rank_of(x, x->tp_rank, x->cp_rank, x->pp_rank + 1);
    int owner = world_rank_of(x, 0, 0, x->pp - 1); /* holds the complete logits */
    size_t V = (size_t)x->n_vocab, E = (size_t)x->n_embd;
    int32_t n_rows = td_engine_n_logit_rows(seqs, n_seqs);
    float *out = NULL;
    td_status st;
    /* Who writes logits on the last stage: every TP rank (the vocab-parallel
     * head all-gathers), only CP rank 0, only EP rank 0 under attention-DP. */
    bool writes = last && x->cp_rank == 0 && !(x->cfg.plan.attn_dp && x->tp_rank != 0);
    if (writes) {
        if (x->rank == 0) {
            out = logits;
        } else {
            if ((st = grow_logits(x, (size_t)n_rows * V))) return st;
            out = x->logits;
        }
    }
    int32_t bounds[TD_PLAN_MAX_PP + 1];
    int n_mb = micro_batches(x, seqs, n_seqs, bounds);
    if (x->n_expert > 0) memset(x->expert_step, 0, (size_t)x->n_expert * sizeof *x->expert_step);
    int32_t row = 0;
    for (int mb = 0; mb < n_mb; mb++) {
        const td_seq_chunk *ms = seqs + bounds[mb];
        int32_t mn = bounds[mb + 1] - bounds[mb];
        size_t rows = (size_t)td_engine_stage_rows(x->engine, ms, mn);
        if (x->ext_state)
            x->ext->batch(x->ext_state, ms, x->tags ? x->tags + bounds[mb] : NULL, mn);
        if (!first && (st = timed_recv(x, x->x_in, rows * E * sizeof(float), prev))) return st;
        st = td_engine_forward_stage(x->engine, ms, mn, first ? NULL : x->x_in,
                                     last ? NULL : x->x_out, out ? out + (size_t)row * V : NULL);
        x->comm_s += td_engine_last_timing(x->engine).comm_s; /* TP / CP / EP collectives */
        if (st) return st;
        if (x->n_expert > 0 && td_engine_expert_load(x->engine, -1, x->expert_tmp) == TD_OK)
            for (int32_t i = 0; i < x->n_expert; i++) x->expert_step[i] += x->expert_tmp[i];
        if (!last && (st = timed_send(x, x->x_out, rows * E * sizeof(float), next))) return st;
        row += td_engine_n_logit_rows(ms, mn);
    }
    if (owner != 0 && n_rows > 0) {
        size_t bytes = (size_t)n_rows * V * sizeof(float);
        if (x->rank == owner && (st = timed_send(x, x->logits, bytes, 0))) return st;
        if (x->rank == 0 && (st = timed_recv(x, logits, bytes, owner))) return st;
    }
    return TD_OK;
}

/* Rebuilds the chunks from a payload, checking it against the header and,
 * on a rank that received it, against the engine's limits (the driver
 * built it, but a rank trusts nothing it did not check; the driver
 * validated the batch before packing it). */
static td_status unpack(td_exec *x, const step_hdr *h, bool validate) {
    const int32_t *d = x->payload;
    const int32_t *tok = d + (size_t)h->n_seqs * 4;
    const int32_t *blk = tok + h->n_tokens;
    int64_t nt = 0, nb = 0;
    for (int32_t i = 0; i < h->n_seqs; i++) {
        const int32_t *q = d + (size_t)i * 4;
        if (q[0] < 1 || q[2] < 0 || nt + q[0] > h->n_tokens || nb + q[2] > h->n_block_ids) {
            TD_LOG_ERROR("rank %d: step payload does not match its header", x->rank);
            return TD_ERR_INVALID;
        }
        x->chunks[i] = (td_seq_chunk){.tokens = tok + nt,
                                      .n_tokens = q[0],
                                      .pos0 = q[1],
                                      .block_table = blk + nb,
                                      .n_blocks = q[2],
                                      .logits_all = (q[3] & SEQ_LOGITS_ALL) != 0,
                                      .no_logits = (q[3] & SEQ_NO_LOGITS) != 0};
        nt += q[0];
        nb += q[2];
    }
    x->tags = h->has_tags ? blk + h->n_block_ids : NULL;
    return validate ? td_engine_validate(x->engine, x->chunks, h->n_seqs) : TD_OK;
}

static td_status grow_payload(td_exec *x, size_t n) {
    if (n <= x->payload_cap) return TD_OK;
    int32_t *p = realloc(x->payload, n * sizeof(int32_t));
    if (!p) {
        TD_LOG_ERROR("rank %d: out of memory for a step of %zu words", x->rank, n);
        return TD_ERR_NOMEM;
    }
    x->payload = p;
    x->payload_cap = n;
    return TD_OK;
}

static size_t payload_words(const step_hdr *h) {
    return (size_t)h->n_seqs * 4 + (size_t)h->n_tokens + (size_t)h->n_block_ids +
           (h->has_tags ? (size_t)h->n_seqs : 0) + (size_t)h->n_ext_words;
}

static const int32_t *payload_ext(const td_exec *x, const step_hdr *h) {
    return x->payload + payload_words(h) - (size_t)h->n_ext_words;
}

/* The step's extension words, before its forward pass (every rank, driver
 * too). */
static td_status ext_before(td_exec *x, const step_hdr *h) {
    if (h->n_ext_words == 0) return TD_OK;
    if (!x->ext_state) {
        TD_LOG_ERROR("rank %d: rank-extension words without an extension set up", x->rank);
        return TD_ERR_INVALID;
    }
    return x->ext->apply(x->ext_state, payload_ext(x, h), (size_t)h->n_ext_words);
}

/* After the step: every rank's figures to the driver (collective). */
static td_status report(td_exec *x, double t0, td_status step_st) {
    rank_report r = {.compute_s = 0, .comm_s = x->comm_s, .status = (int32_t)step_st};
    /* the extension's work of the step (the transfer: its finished jobs
     * flushed) ends before the step does */
    if (x->ext_state) x->ext->finish(x->ext_state, r.ext);
    x->tags = NULL;
    r.compute_s = td_time_s() - t0 - x->comm_s;
    if (r.compute_s < 0) r.compute_s = 0;
    td_status st = td_comm_gather(x->ctl, &r, x->reports, sizeof r, 0, NULL);
    if (st || x->n_expert == 0) return st;
    /* MoE: tokens per expert over the whole model. Every rank of a stage's
     * TP / EP group counts the same tokens (td_engine_expert_load), so one
     * rank per stage (TP 0, CP 0: under CP, CP rank 0's rows) adds its
     * stage's layers, summed over the micro-batches in run_step; counts
     * are exact in float up to 2^24 per step. */
    bool mine = x->tp_rank == 0 && x->cp_rank == 0;
    for (int32_t i = 0; i < x->n_expert; i++)
        x->expert_sum[i] = mine ? (float)x->expert_step[i] : 0.0f;
    if ((st = td_comm_reduce(x->ctl, x->expert_sum, x->expert_sum, (size_t)x->n_expert, TD_COMM_F32,
                             TD_COMM_SUM, 0, NULL)))
        return st;
    if (x->rank == 0) {
        pthread_mutex_lock(&x->times_mu);
        for (int32_t i = 0; i < x->n_expert; i++) x->expert_pub[i] = (int64_t)x->expert_sum[i];
        x->have_expert_load = true;
        pthread_mutex_unlock(&x->times_mu);
    }
    return TD_OK;
}

/* ------------------------------------------------------------- workers */

static td_status broadcast_hdr(td_exec *x, step_hdr *h) {
    return td_comm_broadcast(x->ctl, h, sizeof *h, 0, NULL);
}

static td_status ext_setup_rank(td_exec *x, void *ctx, int32_t arg, uint8_t **table);
static td_status ext_control_rank(td_exec *x, int32_t op, int32_t arg, uint8_t **table,
                                  bool *comm_failed);

static int worker_loop(td_exec *x) {
    for (;;) {
        step_hdr h;
        td_status st = broadcast_hdr(x, &h);
        if (st) return 1;
        if (h.op == OP_STOP) return 0;
        if (h.op == OP_NOOP) continue;
        if (h.op == OP_EXT_SETUP) {
            if (ext_setup_rank(x, NULL, h.n_seqs, NULL)) return 1;
            continue;
        }
        if (h.op == OP_EXT_CONTROL) {
            bool comm_failed = false;
            ext_control_rank(x, h.n_seqs, h.n_tokens, NULL, &comm_failed);
            if (comm_failed) return 1;
            continue;
        }
        if (h.op == OP_EXT) {
            if (h.n_ext_words < 0 || h.n_ext_words > (1 << 24)) return 1;
            step_hdr d = {.n_ext_words = h.n_ext_words};
            if ((st = grow_payload(x, payload_words(&d)))) return 1;
            if ((st = td_comm_broadcast(x->ctl, x->payload, payload_words(&d) * sizeof(int32_t), 0,
                                        NULL)))
                return 1;
            double t0 = td_time_s();
            x->comm_s = 0;
            if (ext_before(x, &d) || report(x, t0, TD_OK)) return 1;
            continue;
        }
        int64_t max_ids =
            (int64_t)x->cfg.max_seqs * ((int64_t)x->cfg.max_ctx / x->cfg.block_size + 1);
        if (h.op != OP_STEP || h.n_seqs < 1 || h.n_seqs > x->cfg.max_seqs || h.n_tokens < 1 ||
            h.n_tokens > x->cfg.max_batch_tokens || h.n_block_ids < 0 || h.n_block_ids > max_ids ||
            h.n_ext_words < 0 || h.n_ext_words > (1 << 24)) {
            TD_LOG_ERROR("rank %d: bad step header (op %d, %d sequences)", x->rank, h.op, h.n_seqs);
            return 1;
        }
        if ((st = grow_payload(x, payload_words(&h)))) return 1;
        if ((st = td_comm_broadcast(x->ctl, x->payload, payload_words(&h) * sizeof(int32_t), 0,
                                    NULL)))
            return 1;
        double t0 = td_time_s();
        x->comm_s = 0;
        td_status step_st = unpack(x, &h, true);
        if (!step_st) step_st = ext_before(x, &h);
        if (!step_st) step_st = run_step(x, x->chunks, h.n_seqs, NULL);
        if (step_st) {
            /* the caller aborts the world: peers may be waiting for a send */
            TD_LOG_ERROR("rank %d: step failed: %s", x->rank, td_status_str(step_st));
            return 1;
        }
        if (report(x, t0, TD_OK)) return 1;
    }
}

static bool parse_int_arg(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

int td_exec_rank_main(int argc, char **argv, const td_exec_ext_ops *ext) {
    long world, rank, ppid, chunk, timeout_ms;
    if (argc != 7 || !parse_int_arg(argv[2], 2, TD_COMM_MAX_RANKS, &world) ||
        !parse_int_arg(argv[3], 1, world - 1, &rank) ||
        !parse_int_arg(argv[4], 1, INT32_MAX, &ppid) ||
        !parse_int_arg(argv[5], 4096, 1L << 30, &chunk) ||
        !parse_int_arg(argv[6], 1, 1L << 40, &timeout_ms)) {
        fprintf(stderr, "tandem rank: internal command, started by the rank launcher\n");
        return 2;
    }
    /* Die with the driver; it may already be gone. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != (pid_t)ppid) return 1;
    /* The driver stops the ranks (OP_STOP) and they die with it
     * (PDEATHSIG): a signal to the whole process group (Ctrl-C, a service
     * manager's SIGTERM) is the driver's to handle, drain included. */
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    td_exec *x = calloc(1, sizeof *x);
    if (!x) return 1;
    x->world = (int)world;
    x->rank = (int)rank;
    x->ext = ext;
    td_comm_params cp = td_comm_default_params(); /* the driver's, from argv */
    cp.chunk_bytes = (size_t)chunk;
    cp.timeout_s = (double)timeout_ms / 1e3;
    int rc = 1;
    if (td_comm_shm_create(argv[1], x->world, x->rank, &cp, &x->ctl)) goto done;
    if (td_comm_broadcast(x->ctl, &x->cfg, sizeof x->cfg, 0, NULL)) goto done;
    const td_plan_params *pl = &x->cfg.plan;
    bool ok = x->cfg.magic == CFG_MAGIC && pl->tp >= 1 && pl->cp >= 1 && pl->pp >= 1 &&
              pl->pp <= TD_PLAN_MAX_PP && (long)pl->tp * pl->cp * pl->pp == world && pl->ep >= 1 &&
              (pl->tp * pl->cp) % pl->ep == 0 && x->cfg.max_seqs >= 1 &&
              x->cfg.max_batch_tokens >= 1 && x->cfg.block_size >= 1 && x->cfg.n_blocks >= 1;
    for (int s = 0; ok && s < pl->pp; s++)
        ok = x->cfg.stage_begin[s] >= 0 && x->cfg.stage_begin[s] < x->cfg.stage_begin[s + 1];
    if (!ok) {
        TD_LOG_ERROR("rank %d: bad configuration from the driver", x->rank);
        goto done;
    }
    x->cfg.model_path[MAX_PATH - 1] = '\0';
    rank_coords(x);
    td_status st = split_groups(x);
    if (!st) st = load_shard(x);
    x->reports = NULL;
    if (agree(x, st) || st) goto done;
    rc = worker_loop(x);
done:
    if (rc && x->ctl) td_comm_abort(x->ctl);
    release_shard(x);
    free(x);
    return rc;
}

/* -------------------------------------------------------------- driver */

static void *monitor_main(void *arg) {
    td_exec *x = arg;
    int n = x->world;
    struct pollfd *fds = calloc((size_t)n, sizeof *fds);
    if (!fds) return NULL;
    fds[0] = (struct pollfd){.fd = x->stop_fd[0], .events = POLLIN};
    for (int r = 1; r < n; r++) fds[r] = (struct pollfd){.fd = x->pidfds[r], .events = POLLIN};
    for (;;) {
        if (poll(fds, (nfds_t)n, -1) < 0) {
            if (errno == EINTR) continue;
            break;
        }
        if (fds[0].revents) break;
        for (int r = 1; r < n; r++) {
            if (!fds[r].revents) continue;
            int status = 0;
            pid_t w = waitpid(x->pids[r], &status, WNOHANG);
            fds[r].fd = -1; /* poll ignores it from now on */
            if (w == x->pids[r]) x->pids[r] = 0;
            /* never x->mu: a step holds it while it waits for this rank */
            if (atomic_load(&x->stopping)) continue;
            if (WIFSIGNALED(status))
                TD_LOG_ERROR("rank %d (pid %d) was killed by signal %d: the instance fails", r,
                             (int)w, WTERMSIG(status));
            else
                TD_LOG_ERROR("rank %d (pid %d) exited with status %d: the instance fails", r,
                             (int)w, WEXITSTATUS(status));
            atomic_store(&x->failed, true);
            atomic_store(&x->cancel, 1); /* rank 0 may still wait for the others to attach */
            if (atomic_load(&x->comm_ready)) td_comm_abort(x->ctl);
        }
    }
    free(fds);
    return NULL;
}

static void *keepalive_main(void *arg) {
    td_exec *x = arg;
    const double interval = x->comm_params.timeout_s / 4;
    pthread_mutex_lock(&x->mu);
    while (!atomic_load(&x->stopping)) {
        double now = td_time_s();
        if (now - x->last_use >= interval && !atomic_load(&x->failed)) {
            step_hdr h = {.op = OP_NOOP};
            if (broadcast_hdr(x, &h)) {
                atomic_store(&x->failed, true);
                td_comm_abort(x->ctl);
            }
            x->last_use = td_time_s();
            continue;
        }
        double wait = x->last_use + interval - now;
        struct timespec ts = td_deadline_after(wait > 0 ? wait : 0.01);
        pthread_cond_timedwait(&x->cv, &x->mu, &ts);
    }
    pthread_mutex_unlock(&x->mu);
    return NULL;
}

/* A driver killed before every rank attached leaves its segment in
 * /dev/shm (it is unlinked only once all have attached): remove those whose
 * driver is gone. Names are /tandem-exec-PID-N. */
static void remove_stale_segments(double max_wait_s) {
    DIR *d = opendir("/dev/shm");
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        int pid = 0, n = 0, end = 0;
        if (sscanf(de->d_name, "tandem-exec-%d-%d%n", &pid, &n, &end) != 2 ||
            de->d_name[end] != '\0' || pid <= 0)
            continue;
        if (kill(pid, 0) == 0 || errno != ESRCH) continue; /* alive, or not ours to judge */
        /* A live driver's segment exists only while its ranks attach (within
         * the attach deadline); an older one is stale even if its pid is in
         * another pid namespace that shares /dev/shm. */
        char name[300], path[320];
        snprintf(name, sizeof name, "/%s", de->d_name);
        snprintf(path, sizeof path, "/dev/shm/%s", de->d_name);
        struct stat sb;
        if (stat(path, &sb) != 0 || time(NULL) - sb.st_mtime < (time_t)(2 * max_wait_s) + 1)
            continue;
        if (shm_unlink(name) == 0) TD_LOG_INFO("removed %s, left by a driver that died", name);
    }
    closedir(d);
}

static td_status spawn_ranks(td_exec *x, const char *exe, const char *name) {
    char self[MAX_PATH];
    if (!exe) {
        ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
        if (n <= 0) {
            TD_LOG_ERROR("cannot find this binary to start the ranks: %s", strerror(errno));
            return TD_ERR_IO;
        }
        self[n] = '\0';
        exe = self;
    }
    char world[16], ppid[16], rank[16], chunk[32], tmo[32];
    snprintf(world, sizeof world, "%d", x->world);
    snprintf(ppid, sizeof ppid, "%d", (int)getpid());
    snprintf(chunk, sizeof chunk, "%zu", x->comm_params.chunk_bytes);
    snprintf(tmo, sizeof tmo, "%.0f", x->comm_params.timeout_s * 1e3);
    /* The ranks start with no blocked signal (the driver may block the ones
     * it takes with sigwait). */
    posix_spawnattr_t attr;
    sigset_t none;
    sigemptyset(&none);
    if (posix_spawnattr_init(&attr) || posix_spawnattr_setsigmask(&attr, &none) ||
        posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK)) {
        TD_LOG_ERROR("posix_spawnattr: out of memory");
        return TD_ERR_NOMEM;
    }
    td_status st = TD_OK;
    for (int r = 1; r < x->world && !st; r++) {
        snprintf(rank, sizeof rank, "%d", r);
        char *argv[] = {(char *)exe, "rank", (char *)name, world, rank, ppid, chunk, tmo, NULL};
        int e = posix_spawn(&x->pids[r], exe, NULL, &attr, argv, environ);
        if (e) {
            x->pids[r] = 0;
            TD_LOG_ERROR("cannot start rank %d (%s): %s", r, exe, strerror(e));
            st = TD_ERR_IO;
            break;
        }
        x->pidfds[r] = (int)syscall(SYS_pidfd_open, x->pids[r], 0);
        if (x->pidfds[r] < 0) {
            TD_LOG_ERROR("pidfd_open for rank %d: %s", r, strerror(errno));
            st = TD_ERR_IO;
        }
    }
    posix_spawnattr_destroy(&attr);
    return st;
}

/* Stops (or kills, after a grace period) and reaps every spawned rank. */
static void reap_ranks(td_exec *x, bool graceful) {
    double t_end = td_time_s() + (graceful ? 10.0 : 0.0);
    for (int r = 1; r < x->world; r++) {
        if (x->pids[r] <= 0) continue;
        for (;;) {
            int status;
            pid_t w = waitpid(x->pids[r], &status, WNOHANG);
            if (w == x->pids[r] || (w < 0 && errno != EINTR)) break;
            if (td_time_s() >= t_end) {
                kill(x->pids[r], SIGKILL);
                waitpid(x->pids[r], &status, 0);
                break;
            }
            struct timespec ts = {0, 5 * 1000000L};
            nanosleep(&ts, NULL);
        }
        x->pids[r] = 0;
    }
}

/* Blocks for the pool: kv_blocks, or kv_memory on the rank with the largest
 * blocks, or kv_seqs sequences of the context limit. */
/* Bytes of one KV block on rank r of plan: its stage's layers, its KV heads. */
static size_t rank_block_bytes(const td_plan *plan, const td_model_config *mc, int r,
                               int32_t block_size) {
    td_rank_coord rc = td_plan_rank(plan, r);
    td_kv_params kp = td_kv_default_params();
    kp.n_layers = rc.layer_end - rc.layer_begin;
    kp.n_kv_heads = td_plan_kv_heads_local(plan);
    kp.head_dim = mc->head_dim;
    kp.block_size = block_size;
    return td_kv_block_bytes(&kp);
}

static td_status size_pool(const td_exec_params *p, const td_plan *plan, const td_model_config *mc,
                           int32_t *n_blocks) {
    int64_t blocks;
    if (p->kv_blocks > 0) {
        blocks = p->kv_blocks;
    } else if (p->kv_memory > 0) {
        size_t per = 0;
        for (int r = 0; r < td_plan_world(plan); r++)
            per = TD_MAX(per, rank_block_bytes(plan, mc, r, p->block_size));
        blocks = per ? (int64_t)(p->kv_memory / per) : 0;
        if (blocks < 1) {
            TD_LOG_ERROR("--kv-memory %zu bytes holds no KV block (%zu bytes each)", p->kv_memory,
                         per);
            return TD_ERR_INVALID;
        }
    } else {
        int32_t ctx = p->engine.max_ctx > 0 ? p->engine.max_ctx : TD_MIN(mc->n_ctx_train, 4096);
        blocks = ((int64_t)ctx + p->block_size - 1) / p->block_size * TD_MAX(p->kv_seqs, 1);
    }
    if (blocks < 1 || blocks > INT32_MAX) {
        TD_LOG_ERROR("KV pool of %lld blocks is out of range", (long long)blocks);
        return TD_ERR_RANGE;
    }
    *n_blocks = (int32_t)blocks;
    return TD_OK;
}

/* Bytes of MemAvailable in /proc/meminfo; 0 when unknown. */
static uint64_t mem_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kib = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kib) == 1) break;
    fclose(f);
    return (uint64_t)kib * 1024u;
}

/* Start-up check of the plan's memory against the host's: the weights once
 * (every rank maps the same file; its shard is a part of it), and per rank
 * its KV pool and its engine scratch (activations of max_batch_tokens rows,
 * attention scratch, step buffers). */
static td_status check_memory(const exec_config *c, const td_plan *plan, const td_model_config *mc,
                              size_t weight_bytes) {
    double total = (double)weight_bytes;
    double rows = c->max_batch_tokens;
    double per_row = 4.0 * (8.0 * mc->n_embd + 2.0 * mc->n_ff + 3.0 * mc->n_head * mc->head_dim);
    for (int r = 0; r < td_plan_world(plan); r++)
        total +=
            (double)rank_block_bytes(plan, mc, r, c->block_size) * c->n_blocks + rows * per_row;
    uint64_t avail = mem_available();
    if (avail > 0 && total > (double)avail) {
        TD_LOG_ERROR("plan: %d ranks need about %.2f GiB (weights %.2f GiB once, KV pool of %d "
                     "blocks and scratch per rank), the host has %.2f GiB available: lower "
                     "--kv-memory / --kv-blocks or the batch, or use fewer ranks",
                     td_plan_world(plan), total / 1073741824.0, weight_bytes / 1073741824.0,
                     c->n_blocks, (double)avail / 1073741824.0);
        return TD_ERR_NOMEM;
    }
    return TD_OK;
}

/* Loads the whole model for its configuration, validates the plan and
 * fills x->cfg and x->world; a world of one keeps the model in x->model. */
static td_status make_config(const td_exec_params *p, td_exec *x) {
    exec_config *c = &x->cfg;
    if (p->comm.chunk_bytes < 4096 || p->comm.chunk_bytes > ((size_t)1 << 30) ||
        !(p->comm.timeout_s >= 0.001) || p->comm.timeout_s > 1e9) {
        TD_LOG_ERROR("executor: comm chunk %zu bytes (4 KiB .. 1 GiB) or timeout %g s out of range",
                     p->comm.chunk_bytes, p->comm.timeout_s);
        return TD_ERR_INVALID;
    }
    if (!p->model_path || strlen(p->model_path) >= MAX_PATH || p->block_size < 1) {
        TD_LOG_ERROR("executor: model path (at most %d bytes) and block size are required",
                     MAX_PATH - 1);
        return TD_ERR_INVALID;
    }
    td_model_params mp = td_model_default_params();
    mp.path = p->model_path;
    td_model *whole = NULL;
    td_status st = td_model_load(&mp, &whole);
    if (st) return st;
    const td_model_config *mc = td_model_get_config(whole);
    td_plan *plan = NULL;
    st = td_plan_create(&p->plan, mc, mc->n_expert, mc->n_expert_used, &plan);
    if (!st) {
        memset(c, 0, sizeof *c);
        c->magic = CFG_MAGIC;
        snprintf(c->model_path, sizeof c->model_path, "%s", p->model_path);
        c->plan = *td_plan_params_get(plan);
        for (int s = 0; s < c->plan.pp; s++) {
            /* the first rank of each stage carries its layer range */
            td_rank_coord rc = td_plan_rank(plan, s * c->plan.tp * c->plan.cp);
            c->stage_begin[s] = rc.layer_begin;
            c->stage_begin[s + 1] = rc.layer_end;
        }
        c->max_batch_tokens = p->engine.max_batch_tokens;
        c->max_seqs = p->engine.max_seqs;
        c->max_ctx = p->engine.max_ctx > 0 ? p->engine.max_ctx : TD_MIN(mc->n_ctx_train, 4096);
        c->block_size = p->block_size;
        st = size_pool(p, plan, mc, &c->n_blocks);
        if (!st) st = check_memory(c, plan, mc, td_model_weight_bytes(whole));
        int world = td_plan_world(plan);
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        c->n_threads =
            p->n_threads > 0 ? p->n_threads : (int)TD_MAX(1, (cores > 0 ? cores : 1) / world);
        c->isa = (int32_t)p->isa;
        c->weight_bytes = td_model_weight_bytes(whole);
        x->world = world;
    }
    td_plan_destroy(plan);
    if (!st && x->world == 1)
        x->model = whole;
    else
        td_model_free(whole);
    return st;
}

/* Stops the monitor thread (idempotent): after this only the caller
 * waits for the rank processes. */
static void stop_monitor(td_exec *x) {
    if (!x->monitor_started) return;
    ssize_t w = write(x->stop_fd[1], "x", 1);
    (void)w;
    pthread_join(x->monitor, NULL);
    x->monitor_started = false;
}

static void exec_free(td_exec *x) {
    stop_monitor(x);
    for (int r = 1; x->pidfds && r < x->world; r++)
        if (x->pidfds[r] >= 0) close(x->pidfds[r]);
    if (x->stop_fd[0] >= 0) close(x->stop_fd[0]);
    if (x->stop_fd[1] >= 0) close(x->stop_fd[1]);
    if (!x->wrapped) release_shard(x);
    pthread_mutex_destroy(&x->mu);
    pthread_cond_destroy(&x->cv);
    pthread_mutex_destroy(&x->times_mu);
    pthread_mutex_destroy(&x->ext_mu);
    free(x->pending);
    free(x->pids);
    free(x->pidfds);
    free(x->times);
    free(x->reports);
    free(x);
}

static td_exec *exec_alloc(int world) {
    td_exec *x = calloc(1, sizeof *x);
    if (!x) return NULL;
    x->world = world;
    x->stop_fd[0] = x->stop_fd[1] = -1;
    pthread_mutex_init(&x->mu, NULL);
    td_cond_init_monotonic(&x->cv);
    pthread_mutex_init(&x->times_mu, NULL);
    pthread_mutex_init(&x->ext_mu, NULL);
    x->pids = calloc((size_t)world, sizeof *x->pids);
    x->pidfds = malloc((size_t)world * sizeof *x->pidfds);
    x->times = calloc((size_t)world, sizeof *x->times);
    x->reports = calloc((size_t)world, sizeof *x->reports);
    if (!x->pids || !x->pidfds || !x->times || !x->reports) {
        exec_free(x);
        return NULL;
    }
    for (int r = 0; r < world; r++) x->pidfds[r] = -1;
    return x;
}

td_status td_exec_create(const td_exec_params *p, td_exec **x_p) {
    if (!p || !x_p) return TD_ERR_INVALID;
    td_exec probe;
    memset(&probe, 0, sizeof probe);
    td_status st = make_config(p, &probe);
    if (st) return st;
    td_exec *x = exec_alloc(probe.world);
    if (!x) {
        td_model_free(probe.model);
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    x->cfg = probe.cfg;
    x->comm_params = p->comm;
    x->model = probe.model;
    x->rank = 0;
    rank_coords(x);
    if (x->world == 1) {
        if ((st = td_comm_create_single(&x->ctl)) || (st = split_groups(x)) || (st = load_shard(x)))
            goto fail;
        *x_p = x;
        return TD_OK;
    }
    if (x->world > TD_COMM_MAX_RANKS) {
        TD_LOG_ERROR("a plan of %d ranks: the shared-memory world holds at most %d", x->world,
                     TD_COMM_MAX_RANKS);
        st = TD_ERR_UNSUPPORTED;
        goto fail;
    }
    if (pipe2(x->stop_fd, O_CLOEXEC)) {
        TD_LOG_ERROR("pipe: %s", strerror(errno));
        st = TD_ERR_IO;
        goto fail;
    }
    remove_stale_segments(x->comm_params.timeout_s);
    char name[64];
    static atomic_int n_created;
    snprintf(name, sizeof name, "/tandem-exec-%d-%d", (int)getpid(),
             atomic_fetch_add(&n_created, 1));
    if ((st = spawn_ranks(x, p->exe, name))) goto fail;
    if (pthread_create(&x->monitor, NULL, monitor_main, x)) {
        TD_LOG_ERROR("cannot start the rank monitor");
        st = TD_ERR_NOMEM;
        goto fail;
    }
    x->monitor_started = true;
    td_comm_params cp = x->comm_params; /* the ranks get it through argv */
    cp.cancel = &x->cancel;
    if ((st = td_comm_shm_create(name, x->world, 0, &cp, &x->ctl))) goto fail;
    atomic_store(&x->comm_ready, true);
    if ((st = td_comm_broadcast(x->ctl, &x->cfg, sizeof x->cfg, 0, NULL))) goto fail;
    td_status mine = split_groups(x);
    if (!mine) mine = load_shard(x);
    if ((st = agree(x, mine))) {
        if (!mine) TD_LOG_ERROR("a rank failed to start (see its lines above)");
        goto fail;
    }
    x->last_use = td_time_s();
    if (pthread_create(&x->keepalive, NULL, keepalive_main, x)) {
        TD_LOG_ERROR("cannot start the keep-alive thread");
        st = TD_ERR_NOMEM;
        goto fail;
    }
    x->keepalive_started = true;
    TD_LOG_INFO("plan: %d ranks (tp %d, cp %d, pp %d), %d threads each", x->world, x->tp, x->cp,
                x->pp, x->cfg.n_threads);
    *x_p = x;
    return TD_OK;
fail:
    pthread_mutex_lock(&x->mu);
    atomic_store(&x->stopping, true);
    pthread_mutex_unlock(&x->mu);
    if (x->ctl) td_comm_abort(x->ctl);
    stop_monitor(x);
    reap_ranks(x, false);
    exec_free(x);
    return st;
}

td_status td_exec_wrap(td_engine *e, td_kv_pool *kv, const td_model *m, td_exec **x_p) {
    if (!e || !kv || !m || !x_p) return TD_ERR_INVALID;
    td_exec *x = exec_alloc(1);
    if (!x) return TD_ERR_NOMEM;
    x->wrapped = true;
    x->engine = e;
    x->kv = kv;
    x->model = (td_model *)m;
    x->tp = x->cp = x->pp = 1;
    x->cfg.weight_bytes = td_model_weight_bytes(m);
    *x_p = x;
    return TD_OK;
}

void td_exec_destroy(td_exec *x) {
    if (!x) return;
    if (x->world > 1) {
        pthread_mutex_lock(&x->mu);
        atomic_store(&x->stopping, true);
        bool ok = !atomic_load(&x->failed);
        if (ok) {
            step_hdr h = {.op = OP_STOP};
            ok = broadcast_hdr(x, &h) == TD_OK;
        }
        pthread_cond_broadcast(&x->cv);
        pthread_mutex_unlock(&x->mu);
        if (x->keepalive_started) pthread_join(x->keepalive, NULL);
        if (!ok) td_comm_abort(x->ctl);
        stop_monitor(x);
        reap_ranks(x, ok);
    }
    exec_free(x);
}

int td_exec_world(const td_exec *x) { return x->world; }
const td_model *td_exec_model(const td_exec *x) { return x->model; }
td_kv_pool *td_exec_kv(td_exec *x) { return x->kv; }
td_engine *td_exec_engine(td_exec *x) { return x->engine; }
int td_exec_threads_per_rank(const td_exec *x) { return x->pool ? td_threadpool_size(x->pool) : 1; }
int32_t td_exec_max_ctx(const td_exec *x) { return x->cfg.max_ctx; }
size_t td_exec_weight_bytes(const td_exec *x) { return (size_t)x->cfg.weight_bytes; }
bool td_exec_failed(const td_exec *x) { return atomic_load(&x->failed); }

int td_exec_expert_load(const td_exec *x, int64_t *counts, int cap) {
    if (x->world == 1) {
        const td_model_config *mc = td_model_get_config(x->model);
        if (mc->n_expert == 0 || cap < mc->n_expert) return 0;
        return td_engine_expert_load(x->engine, -1, counts) == TD_OK ? mc->n_expert : 0;
    }
    pthread_mutex_lock((pthread_mutex_t *)&x->times_mu);
    int n = x->have_expert_load ? TD_MIN(x->n_expert, cap) : 0;
    for (int i = 0; i < n; i++) counts[i] = x->expert_pub[i];
    pthread_mutex_unlock((pthread_mutex_t *)&x->times_mu);
    return n;
}

int td_exec_last_times(const td_exec *x, td_rank_time *out, int cap) {
    pthread_mutex_lock((pthread_mutex_t *)&x->times_mu);
    for (int r = 0; r < TD_MIN(cap, x->world); r++) out[r] = x->times[r];
    pthread_mutex_unlock((pthread_mutex_t *)&x->times_mu);
    return x->world;
}

/* Appends the step's tags and the queued words (taken) to a payload whose
 * header counts them. Driver, under x->mu. */
static void pack_ext(td_exec *x, const int32_t *tags, int32_t n_seqs, step_hdr *h,
                     const int32_t *words) {
    int32_t *end = x->payload + payload_words(h) - (size_t)h->n_ext_words;
    if (h->has_tags) memcpy(end - n_seqs, tags, (size_t)n_seqs * sizeof(int32_t));
    if (h->n_ext_words) memcpy(end, words, (size_t)h->n_ext_words * sizeof(int32_t));
}

/* Takes the queued words (driver; *words freed by the caller). */
static size_t take_pending(td_exec *x, int32_t **words) {
    pthread_mutex_lock(&x->ext_mu);
    size_t n = x->n_pending;
    *words = x->pending;
    x->pending = NULL;
    x->n_pending = x->pending_cap = 0;
    pthread_mutex_unlock(&x->ext_mu);
    return n;
}

/* The ranks' extension reports of the last step, to the extension. */
static void merge_rank_reports(td_exec *x) {
    if (!x->ext_state || !x->ext->merge) return;
    const void *reps[TD_COMM_MAX_RANKS] = {0};
    for (int r = 0; r < x->world; r++) reps[r] = x->reports[r].ext;
    x->ext->merge(x->ext_ctx, reps, x->world);
}

static td_status pack(td_exec *x, const td_seq_chunk *seqs, int32_t n_seqs, step_hdr *h,
                      const int32_t *tags, const int32_t *words, size_t n_words) {
    int64_t nt = 0, nb = 0;
    int32_t bs = x->cfg.block_size;
    for (int32_t i = 0; i < n_seqs; i++) {
        nt += seqs[i].n_tokens;
        nb += ((int64_t)seqs[i].pos0 + seqs[i].n_tokens + bs - 1) / bs;
    }
    *h = (step_hdr){.op = OP_STEP,
                    .n_seqs = n_seqs,
                    .n_tokens = (int32_t)nt,
                    .n_block_ids = (int32_t)nb,
                    .has_tags = tags != NULL,
                    .n_ext_words = (int32_t)n_words};
    td_status st = grow_payload(x, payload_words(h));
    if (st) return st;
    pack_ext(x, tags, n_seqs, h, words);
    int32_t *d = x->payload, *tok = d + (size_t)n_seqs * 4, *blk = tok + nt;
    for (int32_t i = 0; i < n_seqs; i++) {
        const td_seq_chunk *s = &seqs[i];
        int32_t used = (int32_t)(((int64_t)s->pos0 + s->n_tokens + bs - 1) / bs);
        d[i * 4 + 0] = s->n_tokens;
        d[i * 4 + 1] = s->pos0;
        d[i * 4 + 2] = used;
        d[i * 4 + 3] = (s->logits_all ? SEQ_LOGITS_ALL : 0) | (s->no_logits ? SEQ_NO_LOGITS : 0);
        memcpy(tok, s->tokens, (size_t)s->n_tokens * sizeof(int32_t));
        memcpy(blk, s->block_table, (size_t)used * sizeof(int32_t));
        tok += s->n_tokens;
        blk += used;
    }
    return TD_OK;
}

td_status td_exec_forward(td_exec *x, const td_seq_chunk *seqs, int32_t n_seqs, float *logits) {
    return td_exec_forward_tagged(x, seqs, n_seqs, NULL, logits);
}

/* A world of one: the extension's words and hooks run in-process. */
static td_status forward_single(td_exec *x, const td_seq_chunk *seqs, int32_t n_seqs,
                                const int32_t *tags, float *logits) {
    pthread_mutex_lock(&x->mu);
    int32_t *words;
    size_t n_words = take_pending(x, &words);
    td_status st = TD_OK;
    if (n_words && x->ext_state) st = x->ext->apply(x->ext_state, words, n_words);
    free(words);
    double t0 = td_time_s();
    if (!st && n_seqs > 0) {
        if (x->ext_state) x->ext->batch(x->ext_state, seqs, tags, n_seqs);
        st = td_engine_forward(x->engine, seqs, n_seqs, logits);
    }
    if (x->ext_state) {
        memset(x->reports[0].ext, 0, sizeof x->reports[0].ext);
        x->ext->finish(x->ext_state, x->reports[0].ext);
        merge_rank_reports(x);
    }
    if (n_seqs > 0) {
        pthread_mutex_lock(&x->times_mu);
        x->times[0] = (td_rank_time){.compute_s = td_time_s() - t0, .comm_s = 0};
        pthread_mutex_unlock(&x->times_mu);
    }
    pthread_mutex_unlock(&x->mu);
    return st;
}

td_status td_exec_forward_tagged(td_exec *x, const td_seq_chunk *seqs, int32_t n_seqs,
                                 const int32_t *tags, float *logits) {
    if (x->world == 1) return forward_single(x, seqs, n_seqs, tags, logits);
    if (atomic_load(&x->failed)) return TD_ERR_IO;
    td_status st = td_engine_validate(x->engine, seqs, n_seqs);
    if (st) return st;
    pthread_mutex_lock(&x->mu);
    step_hdr h;
    int32_t *words;
    size_t n_words = take_pending(x, &words);
    st = pack(x, seqs, n_seqs, &h, tags, words, n_words);
    free(words);
    if (st) {
        pthread_mutex_unlock(&x->mu);
        return st;
    }
    double t0 = td_time_s();
    x->comm_s = 0;
    if (!(st = broadcast_hdr(x, &h)))
        st = td_comm_broadcast(x->ctl, x->payload, payload_words(&h) * sizeof(int32_t), 0, NULL);
    x->comm_s += td_time_s() - t0;
    /* Run the step on the driver from the same payload the ranks got. */
    if (!st && !(st = unpack(x, &h, false)) && !(st = ext_before(x, &h)))
        st = run_step(x, x->chunks, n_seqs, logits);
    /* After a failure some ranks may still wait for a send: abort, never
     * meet them in the report. */
    td_status rst = st ? st : report(x, t0, TD_OK);
    if (!rst) {
        pthread_mutex_lock(&x->times_mu);
        for (int r = 0; r < x->world; r++) {
            x->times[r] = (td_rank_time){.compute_s = x->reports[r].compute_s,
                                         .comm_s = x->reports[r].comm_s};
            if (x->reports[r].status && !st) st = (td_status)x->reports[r].status;
        }
        pthread_mutex_unlock(&x->times_mu);
        merge_rank_reports(x);
    }
    if (rst && !st) st = rst;
    x->last_use = td_time_s();
    if (st) {
        if (!atomic_exchange(&x->failed, true))
            TD_LOG_ERROR("step failed on the ranks (%s): the instance fails", td_status_str(st));
        td_comm_abort(x->ctl);
        st = TD_ERR_IO;
    }
    pthread_mutex_unlock(&x->mu);
    return st;
}

/* ------------------------------------------------------ rank extension */

#define REPLY_SLOT (TD_EXEC_EXT_REPLY_MAX + 8) /* u64 length, then the reply */

static td_exec_rank_info rank_info(const td_exec *x) {
    td_exec_rank_info ri = {.rank = x->rank,
                            .world = x->world,
                            .tp = x->tp,
                            .cp = x->cp,
                            .pp = x->pp,
                            .attn_dp = x->cfg.plan.attn_dp,
                            .model = x->model,
                            .kv = x->kv,
                            .engine = x->engine};
    for (int s = 0; s <= x->pp && s <= TD_PLAN_MAX_PP; s++)
        ri.stage_begin[s] = x->cfg.stage_begin[s];
    if (x->wrapped) ri.stage_begin[1] = td_model_get_config(x->model)->n_layer;
    return ri;
}

td_exec_rank_info td_exec_info(const td_exec *x) { return rank_info(x); }

/* This rank's reply (at mine + 8, len bytes; empty when st says it failed)
 * to the driver, into a new table there (*table; NULL elsewhere, or when
 * table is NULL). Frees mine. Returns the gather's status. */
static td_status gather_replies(td_exec *x, td_status st, uint8_t *mine, size_t len,
                                uint8_t **table) {
    uint8_t *all = x->rank == 0 ? calloc((size_t)x->world, REPLY_SLOT) : NULL;
    if (x->rank == 0 && !all) {
        free(mine);
        return TD_ERR_NOMEM;
    }
    uint64_t n64 = st ? 0 : (uint64_t)len;
    memcpy(mine, &n64, 8);
    td_status gst = x->world == 1 ? TD_OK : td_comm_gather(x->ctl, mine, all, REPLY_SLOT, 0, NULL);
    if (x->world == 1) memcpy(all, mine, REPLY_SLOT);
    free(mine);
    if (table && x->rank == 0 && !gst)
        *table = all;
    else
        free(all);
    return gst;
}

/* Creates this rank's extension state (ops->create). */
static td_status ext_setup_rank(td_exec *x, void *ctx, int32_t arg, uint8_t **table) {
    uint8_t *mine = calloc(1, REPLY_SLOT);
    if (!mine) return TD_ERR_NOMEM;
    size_t len = 0;
    td_status st = TD_OK;
    if (!x->ext) {
        TD_LOG_ERROR("rank %d: no rank extension in this binary", x->rank);
        st = TD_ERR_UNSUPPORTED;
    } else if (x->ext_state) {
        TD_LOG_ERROR("rank %d: the rank extension is set up already", x->rank);
        st = TD_ERR_INVALID;
    } else {
        td_exec_rank_info ri = rank_info(x);
        st = x->ext->create(&ri, ctx, arg, &x->ext_state, mine + 8, TD_EXEC_EXT_REPLY_MAX, &len);
        if (!st && len > TD_EXEC_EXT_REPLY_MAX) st = TD_ERR_RANGE;
    }
    td_status gst = gather_replies(x, st, mine, len, table);
    return gst ? gst : st;
}

/* This rank's part of a control operation. *comm_failed: the world's
 * communication failed. */
static td_status ext_control_rank(td_exec *x, int32_t op, int32_t arg, uint8_t **table,
                                  bool *comm_failed) {
    uint8_t *mine = calloc(1, REPLY_SLOT);
    if (!mine) {
        *comm_failed = true; /* the others wait in the gather */
        return TD_ERR_NOMEM;
    }
    size_t len = 0;
    td_status st =
        x->ext_state ? x->ext->control(x->ext_state, op, arg, mine + 8, TD_EXEC_EXT_REPLY_MAX, &len)
                     : TD_ERR_INVALID;
    if (!st && len > TD_EXEC_EXT_REPLY_MAX) st = TD_ERR_RANGE;
    td_status gst = gather_replies(x, st, mine, len, table);
    *comm_failed = gst != TD_OK;
    return st ? st : gst;
}

/* An operation's header to the other ranks (a world of one has none); a
 * failed broadcast fails the world. Caller holds x->mu. */
static td_status broadcast_op(td_exec *x, step_hdr *h) {
    if (x->world == 1) return TD_OK;
    if (broadcast_hdr(x, h)) {
        atomic_store(&x->failed, true);
        td_comm_abort(x->ctl);
        return TD_ERR_IO;
    }
    return TD_OK;
}

/* TD_ERR_IO (each logged) when a rank's reply in table is empty: it could
 * not do what (its failure is in its own log). */
static td_status replies_present(const td_exec *x, const uint8_t *table, const char *what) {
    if (!table) return TD_ERR_INVALID;
    td_status st = TD_OK;
    for (int r = 0; r < x->world; r++) {
        if (!td_exec_ext_reply(x, table, r, &(size_t){0})) {
            TD_LOG_ERROR("rank %d could not %s", r, what);
            st = TD_ERR_IO;
        }
    }
    return st;
}

td_status td_exec_ext_setup(td_exec *x, const td_exec_ext_ops *ops, void *ctx, int64_t arg,
                            const char *what, uint8_t **replies) {
    *replies = NULL;
    if (x->wrapped || !ops || ops->report_size > TD_EXEC_EXT_REPORT_MAX || arg < INT32_MIN ||
        arg > INT32_MAX)
        return x->wrapped ? TD_ERR_UNSUPPORTED : TD_ERR_INVALID;
    pthread_mutex_lock(&x->mu);
    if ((x->world > 1 && atomic_load(&x->failed)) || x->ext_state) {
        pthread_mutex_unlock(&x->mu);
        return x->ext_state ? TD_ERR_INVALID : TD_ERR_IO;
    }
    step_hdr h = {.op = OP_EXT_SETUP, .n_seqs = (int32_t)arg};
    td_status st = broadcast_op(x, &h);
    if (st) {
        pthread_mutex_unlock(&x->mu);
        return st;
    }
    x->ext = ops;
    x->ext_ctx = ctx;
    st = ext_setup_rank(x, ctx, (int32_t)arg, replies);
    if (!st) st = replies_present(x, *replies, what);
    if (st) {
        /* the driver's state goes now (it may borrow what ctx holds); the
         * other ranks' go with their shards */
        if (x->engine) td_engine_set_layer_hook(x->engine, NULL, NULL);
        if (x->ext_state) ops->destroy(x->ext_state);
        x->ext_state = NULL;
        x->ext_ctx = NULL;
    }
    x->last_use = td_time_s();
    pthread_mutex_unlock(&x->mu);
    return st;
}

const uint8_t *td_exec_ext_reply(const td_exec *x, const uint8_t *table, int rank, size_t *len) {
    if (!table || rank < 0 || rank >= x->world) return NULL;
    uint64_t n;
    const uint8_t *b = table + (size_t)rank * REPLY_SLOT;
    memcpy(&n, b, 8);
    *len = (size_t)n;
    return n ? b + 8 : NULL;
}

td_status td_exec_ext_control(td_exec *x, int32_t op, int32_t arg, const char *what,
                              uint8_t **replies) {
    *replies = NULL;
    if (x->wrapped) return TD_ERR_INVALID;
    pthread_mutex_lock(&x->mu);
    if (!x->ext_state || atomic_load(&x->failed)) {
        pthread_mutex_unlock(&x->mu);
        return x->ext_state ? TD_ERR_IO : TD_ERR_INVALID;
    }
    step_hdr h = {.op = OP_EXT_CONTROL, .n_seqs = op, .n_tokens = arg};
    td_status st = broadcast_op(x, &h);
    if (st) {
        pthread_mutex_unlock(&x->mu);
        return st;
    }
    bool comm_failed = false;
    st = ext_control_rank(x, op, arg, replies, &comm_failed);
    if (!st) st = replies_present(x, *replies, what);
    if (comm_failed) {
        if (!atomic_exchange(&x->failed, true))
            TD_LOG_ERROR("a rank-extension operation (%s) failed on the ranks: the instance fails",
                         what);
        td_comm_abort(x->ctl); /* no rank waits on a collective that will not come */
    }
    x->last_use = td_time_s();
    pthread_mutex_unlock(&x->mu);
    return st;
}

void td_exec_ext_post(td_exec *x, const int32_t *words, size_t n_words) {
    if (!n_words) return;
    pthread_mutex_lock(&x->ext_mu);
    size_t need = x->n_pending + n_words;
    if (need > x->pending_cap) {
        size_t cap = x->pending_cap ? x->pending_cap : 256;
        while (cap < need) cap *= 2;
        int32_t *w = realloc(x->pending, cap * sizeof *w);
        if (!w) {
            TD_LOG_ERROR("out of memory queueing rank-extension words");
            pthread_mutex_unlock(&x->ext_mu);
            return;
        }
        x->pending = w;
        x->pending_cap = cap;
    }
    memcpy(x->pending + x->n_pending, words, n_words * sizeof(int32_t));
    x->n_pending = need;
    pthread_mutex_unlock(&x->ext_mu);
}

td_status td_exec_ext_sync(td_exec *x) {
    if (x->world == 1) return forward_single(x, NULL, 0, NULL, NULL);
    if (atomic_load(&x->failed)) return TD_ERR_IO;
    pthread_mutex_lock(&x->mu);
    int32_t *words;
    size_t n_words = take_pending(x, &words);
    step_hdr h = {.op = OP_EXT, .n_ext_words = (int32_t)n_words};
    td_status st = grow_payload(x, payload_words(&h));
    if (!st) {
        if (n_words) memcpy(x->payload, words, n_words * sizeof(int32_t));
        double t0 = td_time_s();
        x->comm_s = 0;
        if (!(st = broadcast_hdr(x, &h)))
            st =
                td_comm_broadcast(x->ctl, x->payload, payload_words(&h) * sizeof(int32_t), 0, NULL);
        if (!st) st = ext_before(x, &h);
        if (!st) st = report(x, t0, TD_OK);
        if (!st) merge_rank_reports(x);
    }
    free(words);
    x->last_use = td_time_s();
    if (st) {
        if (!atomic_exchange(&x->failed, true))
            TD_LOG_ERROR("rank-extension step failed on the ranks (%s): the instance fails",
                         td_status_str(st));
        td_comm_abort(x->ctl);
        st = TD_ERR_IO;
    }
    pthread_mutex_unlock(&x->mu);
    return st;
}

void td_exec_ext_teardown(td_exec *x) {
    pthread_mutex_lock(&x->mu);
    if (x->engine) td_engine_set_layer_hook(x->engine, NULL, NULL);
    if (x->ext_state) x->ext->destroy(x->ext_state);
    x->ext_state = NULL;
    pthread_mutex_unlock(&x->mu);
}
