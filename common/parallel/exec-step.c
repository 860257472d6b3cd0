/* The step protocol (exec-impl.h): the driver packs a step (sequences,
 * tokens, block ids, the rank extension's tags and directives) and
 * broadcasts it on the control channel, every rank unpacks it, runs its
 * micro-batches through its stage (PP activations over the data world) and
 * reports; the driver merges the reports. The rank extension's setup and
 * control operations ride on the same broadcast. */
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>

#include "exec-impl.h"

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
    int prev = first ? -1 : td_exec_world_rank_of(x, x->tp_rank, x->cp_rank, x->pp_rank - 1);
    int next = last ? -1 : td_exec_world_rank_of(x, x->tp_rank, x->cp_rank, x->pp_rank + 1);
    int owner = td_exec_world_rank_of(x, 0, 0, x->pp - 1); /* holds the complete logits */
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

td_status td_exec_step_broadcast_hdr(td_exec *x, step_hdr *h) {
    return td_comm_broadcast(x->ctl, h, sizeof *h, 0, NULL);
}

static td_status ext_setup_rank(td_exec *x, void *ctx, int32_t arg, uint8_t **table);
static td_status ext_control_rank(td_exec *x, int32_t op, int32_t arg, uint8_t **table,
                                  bool *comm_failed);

int td_exec_step_worker_loop(td_exec *x) {
    for (;;) {
        step_hdr h;
        td_status st = td_exec_step_broadcast_hdr(x, &h);
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
    if (!(st = td_exec_step_broadcast_hdr(x, &h)))
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
    if (td_exec_step_broadcast_hdr(x, h)) {
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
        if (!(st = td_exec_step_broadcast_hdr(x, &h)))
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
