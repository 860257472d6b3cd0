/* The KV transfer as the executor's rank extension (see xext.h). */
#include "xext.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(sizeof(td_xrank_report) <= TD_EXEC_EXT_REPORT_MAX,
               "a rank's transfer report fits the executor's report area");
_Static_assert(TD_XRANK_BLOB_MAX <= TD_EXEC_EXT_REPLY_MAX,
               "a rank's endpoint blob fits the executor's reply");

enum { OP_LINK_CLOSE = 0, OP_LINK_OPEN = 1 };

struct td_xext {
    td_exec *x;
    td_ucx *ucx0;                            /* the channel rank 0's xrank borrows */
    pthread_mutex_t mu;                      /* the per-job state below */
    uint8_t *blobs;                          /* every rank's endpoint (td_exec_ext_reply table) */
    uint8_t *link_blobs[TD_XRANK_MAX_PEERS]; /* the same, per open link */
    uint64_t failed[TD_XRANK_MAX_JOBS / 64]; /* OR of the ranks' reports */
    uint64_t busy[TD_XRANK_MAX_JOBS / 64];   /* as of the last report */
    uint64_t last_layer[TD_XRANK_MAX_JOBS];  /* latest last-layer stamp per job */
    uint64_t peer_failed;                    /* OR of the ranks' reports */
};

/* ---- every rank ---- */

/* Creates the rank's td_xrank, hooks it into its engine, and replies with
 * its worker's endpoint. ctx: the td_xext on the driver; arg: layerwise. */
static td_status ext_create(const td_exec_rank_info *ri, void *ctx, int64_t arg, void **state,
                            uint8_t *reply, size_t cap, size_t *len) {
    if (ri->attn_dp) {
        TD_LOG_ERROR("KV transfer does not support attention-DP plans");
        return TD_ERR_UNSUPPORTED;
    }
    const td_model_config *mc = td_model_get_config(ri->model);
    td_xrank_params xp = {.plan = {.tp = ri->tp, .pp = ri->pp, .cp = ri->cp},
                          .rank = ri->rank,
                          .n_layer = mc->n_layer,
                          .n_head_kv = mc->n_head_kv,
                          .head_dim = mc->head_dim,
                          .kv = ri->kv,
                          .engine = ri->engine,
                          .ucx = ctx ? ((td_xext *)ctx)->ucx0 : NULL,
                          .layerwise = arg != 0};
    for (int s = 0; s <= ri->pp; s++) xp.plan.stage_begin[s] = ri->stage_begin[s];
    td_xrank *xr;
    td_status st = td_xrank_create(&xp, &xr);
    if (st) return st;
    td_engine_set_layer_hook(ri->engine, td_xrank_layer, xr);
    *state = xr;
    return td_xrank_blob(xr, -1, reply, cap, len) == TD_OK ? TD_OK : TD_ERR_RANGE;
}

static void ext_destroy(void *state) { td_xrank_destroy(state); }

/* A link worker of slot arg opened (replying with its endpoint) or closed
 * (replying with the rank's own: it only says the close is done). */
static td_status ext_control(void *state, int32_t op, int32_t arg, uint8_t *reply, size_t cap,
                             size_t *len) {
    bool open = op == OP_LINK_OPEN;
    td_status st =
        (op == OP_LINK_OPEN || op == OP_LINK_CLOSE) && arg >= 0 && arg < TD_XRANK_MAX_PEERS
            ? td_xrank_link(state, arg, open)
            : TD_ERR_INVALID;
    if (st) {
        TD_LOG_ERROR("KV link %d could not be %s", arg, open ? "opened" : "closed");
        return st;
    }
    return td_xrank_blob(state, open ? arg : -1, reply, cap, len) == TD_OK ? TD_OK : TD_ERR_RANGE;
}

static td_status ext_apply(void *state, const int32_t *words, size_t n) {
    return td_xrank_apply(state, words, n);
}

static void ext_batch(void *state, const td_seq_chunk *seqs, const int32_t *tags, int32_t n) {
    td_xrank_batch(state, seqs, tags, n);
}

static void ext_finish(void *state, void *report) { td_xrank_finish(state, report); }

/* ---- the driver ---- */

static void ext_merge(void *ctx, const void *const *reports, int n) {
    td_xext *xe = ctx;
    pthread_mutex_lock(&xe->mu);
    memset(xe->busy, 0, sizeof xe->busy);
    for (int r = 0; r < n; r++) {
        const td_xrank_report *rep = reports[r];
        for (int i = 0; i < TD_XRANK_MAX_JOBS / 64; i++) {
            xe->failed[i] |= rep->failed[i];
            xe->busy[i] |= rep->busy[i];
        }
        xe->peer_failed |= rep->peer_failed;
        for (int32_t k = 0; k < rep->n_ended && k < TD_XRANK_MAX_ENDED; k++) {
            int32_t s = rep->ended[k].slot;
            if (s >= 0 && s < TD_XRANK_MAX_JOBS)
                xe->last_layer[s] = TD_MAX(xe->last_layer[s], rep->ended[k].unix_ns);
        }
    }
    pthread_mutex_unlock(&xe->mu);
}

const td_exec_ext_ops td_xext_ops = {
    .create = ext_create,
    .destroy = ext_destroy,
    .control = ext_control,
    .apply = ext_apply,
    .batch = ext_batch,
    .finish = ext_finish,
    .report_size = sizeof(td_xrank_report),
    .merge = ext_merge,
};

td_status td_xext_setup(td_exec *x, td_ucx *ucx0, bool layerwise, td_xext **xe_p) {
    td_xext *xe = calloc(1, sizeof *xe);
    if (!xe) return TD_ERR_NOMEM;
    xe->x = x;
    xe->ucx0 = ucx0;
    pthread_mutex_init(&xe->mu, NULL);
    td_status st = td_exec_ext_setup(x, &td_xext_ops, xe, layerwise,
                                     "set up its KV transfer endpoint", &xe->blobs);
    if (st) {
        free(xe->blobs);
        pthread_mutex_destroy(&xe->mu);
        free(xe);
        return st;
    }
    *xe_p = xe;
    return TD_OK;
}

void td_xext_destroy(td_xext *xe) {
    if (!xe) return;
    td_exec_ext_teardown(xe->x);
    free(xe->blobs);
    for (int i = 0; i < TD_XRANK_MAX_PEERS; i++) free(xe->link_blobs[i]);
    pthread_mutex_destroy(&xe->mu);
    free(xe);
}

td_xfer_plan td_xext_plan(const td_exec *x) {
    td_exec_rank_info ri = td_exec_info(x);
    td_xfer_plan p = {.tp = ri.tp, .pp = ri.pp, .cp = ri.cp};
    for (int s = 0; s <= ri.pp; s++) p.stage_begin[s] = ri.stage_begin[s];
    return p;
}

static td_status blob_of(const td_xext *xe, const uint8_t *table, int rank, const uint8_t **blob,
                         size_t *len) {
    if (!table || rank < 0 || rank >= td_exec_world(xe->x)) return TD_ERR_INVALID;
    *blob = td_exec_ext_reply(xe->x, table, rank, len);
    return *blob ? TD_OK : TD_ERR_IO;
}

td_status td_xext_endpoint(const td_xext *xe, int rank, const uint8_t **blob, size_t *len) {
    return blob_of(xe, xe->blobs, rank, blob, len);
}

td_status td_xext_link(td_xext *xe, int slot, bool open) {
    if (slot < 0 || slot >= TD_XRANK_MAX_PEERS) return TD_ERR_INVALID;
    char what[48];
    snprintf(what, sizeof what, "%s its KV link %d", open ? "open" : "close", slot);
    uint8_t *table = NULL;
    td_status st =
        td_exec_ext_control(xe->x, open ? OP_LINK_OPEN : OP_LINK_CLOSE, slot, what, &table);
    free(xe->link_blobs[slot]);
    /* a closed slot has no endpoints (its table only said the ranks closed it) */
    xe->link_blobs[slot] = open ? table : NULL;
    if (!open) free(table);
    return st;
}

td_status td_xext_link_endpoint(const td_xext *xe, int slot, int rank, const uint8_t **blob,
                                size_t *len) {
    if (slot < 0 || slot >= TD_XRANK_MAX_PEERS) return TD_ERR_INVALID;
    return blob_of(xe, xe->link_blobs[slot], rank, blob, len);
}

void td_xext_post(td_xext *xe, const td_xdir_buf *dirs) {
    if (!dirs->n) return;
    pthread_mutex_lock(&xe->mu);
    /* a job or peer slot reused from now on starts with no failure */
    for (size_t i = 0; i + 2 < dirs->n;) {
        int32_t type = dirs->w[i], words = dirs->w[i + 1];
        int32_t s = dirs->w[i + 2];
        if (type == TD_XDIR_JOB && words >= 1 && s >= 0 && s < TD_XRANK_MAX_JOBS) {
            xe->failed[s / 64] &= ~(1ull << (s % 64));
            xe->last_layer[s] = 0;
        }
        if (type == TD_XDIR_PEER && words >= 1 && s >= 0 && s < TD_XRANK_MAX_PEERS)
            xe->peer_failed &= ~(1ull << s);
        i += 2 + (size_t)(words > 0 ? words : 0);
    }
    td_exec_ext_post(xe->x, dirs->w, dirs->n);
    pthread_mutex_unlock(&xe->mu);
}

td_status td_xext_sync(td_xext *xe) { return td_exec_ext_sync(xe->x); }

static bool bit(td_xext *xe, const uint64_t *bits, int32_t i) {
    pthread_mutex_lock(&xe->mu);
    bool b = (bits[i / 64] >> (i % 64)) & 1u;
    pthread_mutex_unlock(&xe->mu);
    return b;
}

bool td_xext_failed(td_xext *xe, int32_t slot) {
    return slot < 0 || slot >= TD_XRANK_MAX_JOBS || bit(xe, xe->failed, slot);
}

bool td_xext_busy(td_xext *xe, int32_t slot) {
    return slot >= 0 && slot < TD_XRANK_MAX_JOBS && bit(xe, xe->busy, slot);
}

bool td_xext_peer_failed(td_xext *xe, int32_t peer) {
    return peer >= 0 && peer < TD_XRANK_MAX_PEERS && bit(xe, &xe->peer_failed, peer);
}

uint64_t td_xext_last_layer_ns(td_xext *xe, int32_t slot) {
    if (slot < 0 || slot >= TD_XRANK_MAX_JOBS) return 0;
    pthread_mutex_lock(&xe->mu);
    uint64_t t = xe->last_layer[slot];
    pthread_mutex_unlock(&xe->mu);
    return t;
}
