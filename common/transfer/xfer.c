/* KV migration between a prefill and a decode instance (see xfer.h).
 *
 * Locking: one mutex (x->mu) guards the peer and job tables and every
 * endpoint's lifetime; it is never taken inside a UCX callback (callbacks
 * only set atomics and wake the service thread, or queue a message under
 * x->in_mu), so holding it across td_ucx_* calls cannot deadlock with the
 * progress thread. The scheduler's hooks take x->mu; the scheduler never
 * holds its own lock while calling them. */
#include "xfer.h"

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "common/api/sampling.h"
#include "common/base/httpc.h"
#include "common/base/net.h"
#include "common/kv/kv.h"
#include "common/model/model.h"
#include "msg.h"
#include "ucx.h"
#include "xext.h"

#define XF_MAX_MSG        (16u << 20)
#define XF_EXCHANGE_LIMIT (1u << 20) /* bytes read from a peer's exchange endpoint */
#define XF_ID_LEN         64

typedef Tandem__Internal__V1__ControlMessage cmsg;
typedef Tandem__Internal__V1__Exchange exchange_t;

/* ------------------------------------------------------------ peers, jobs */

/* P's view of one D incarnation. */
typedef struct dpeer {
    struct dpeer *next;
    char instance[XF_ID_LEN];
    uint64_t epoch;
    uint64_t exchange_id;
    td_xfer_msg *ex_msg; /* the message that carried the exchange (owned) */
    const exchange_t *ex;
    td_ucx_ep *ep;      /* control messages to D's rank 0 (x->mu) */
    int32_t slot;       /* the ranks know its endpoints by this slot */
    atomic_bool failed; /* an endpoint (here or on a rank) reported an error */
    bool superseded;    /* the same incarnation sent a new exchange (it fenced us) */
    bool closed;
} dpeer;

/* A prefill job on P: its KV goes out from every rank (xrank.h), the
 * driver answers. */
typedef struct pjob {
    struct pjob *next;
    struct td_xfer *x;
    dpeer *peer;
    char id[XF_ID_LEN];
    td_gen_stream *st;
    td_sched_ticket ticket;
    int32_t slot; /* job slot on the ranks */
    int32_t n_prompt, d_cached;
    double t_recv, deadline, lease_until;
    bool ended, have_first, cancelled, replied, dropped, ok, consumed;
    td_sample_result first;
    uint8_t sstate[TD_SAMPLER_STATE_BYTES];
} pjob;

/* D's view of one P instance (named by its HTTP address; a slot whose
 * addr is "" is free). */
typedef struct ppeer {
    char addr[256];
    char instance[XF_ID_LEN];
    uint64_t epoch;
    td_ucx_ep *ep; /* to P's rank 0 (x->mu) */
    bool ready, need_exchange, fence, closing;
    bool link_open;         /* our ranks' link workers for this P (its slot: its index) */
    bool link_close_owed;   /* fencing: the service thread destroys them */
    double next_link_close; /* when a failed destroy is tried again */
    atomic_bool err;        /* the endpoint reported an error */
    atomic_bool close_done; /* the fencing close of our endpoint completed */
    uint64_t exchange_id;   /* ours, as this P knows it: a new one after each fence, so that P
                             * drops whatever it still had from before */
    double next_link;
    double next_probe; /* when the linked P's exchange is read again */
    double avg_ms;     /* moving average of request sent -> PrefillDone */
    double tail_ms;    /* moving average of the exposed transfer tail (P's last layer ->
                        * PrefillDone here): what the pair adds beyond P's compute */
    char last_err[700];
    uint64_t dns_names;    /* bit i: --prefill name i resolved to it in its last round */
    double last_named;     /* when the router last named it (0: never) */
    double unlinked_since; /* when it was added or last fenced */
    /* 1 + the index of the linked peer this address reaches too (the same
     * instance and epoch under another name: a Service name and a pod IP,
     * localhost and 127.0.0.1); 0: none. Two links to one P would have P
     * answer over the newer one only. */
    int alias_of;
} ppeer;

/* NEW: not sent; SENT: waiting for P; CANCELLED: the client went while
 * it waited (blocks quarantined until P answers or is fenced); QUARANTINED:
 * D gave up (deadline, endpoint error), fencing; ANSWERED: P answered (no
 * more writes), out of the table. */
typedef enum { DJ_NEW, DJ_SENT, DJ_CANCELLED, DJ_QUARANTINED, DJ_ANSWERED } dj_state;

/* A request on D with a KV import. */
typedef struct djob {
    struct djob *next; /* x->djobs while in flight */
    atomic_int refs;   /* the scheduler's + the table's */
    struct td_xfer *x;
    char id[XF_ID_LEN];
    int32_t *tokens;
    int32_t n_tokens;
    td_sampler_params sp;
    td_logit_bias *bias;
    int32_t min_tokens;
    bool ignore_eos;
    int32_t *stop_ids;
    int32_t n_stop_ids;
    td_sched_ticket ticket;
    ppeer *peer;
    dj_state state;
    int32_t n_blocks, n_cached;
    double t_sent, deadline;
    double q_until; /* quarantined blocks stay at least until then (P's deadline has passed) */
    bool abort_pending;
    char want_peer[256]; /* the router's choice of prefill instance, or "" */
} djob;

/* A decoded control message and when it arrived (the exposed transfer
 * tail and the transfer time are measured at arrival, not after the hop to
 * the service thread). */
typedef struct {
    td_xfer_msg *m;
    uint64_t arrival_unix_ns;
    double arrival_s;
} inbox_msg;

struct td_xfer {
    td_xfer_params p;
    char *instance_id;
    char *token;
    size_t token_len;
    uint64_t epoch;
    td_ucx *ucx;
    td_xext *xext;     /* the ranks' transfer state (NULL until td_xext_setup) */
    td_xfer_plan plan; /* this instance's */
    int world;
    int32_t n_layer, n_head_kv, head_dim, block_size, n_blocks, n_vocab;
    size_t row_bytes; /* one token's K (or V) in one layer */
    td_xfer_limits lim;
    uint64_t exchange_id;
    pthread_mutex_t mu;
    pthread_mutex_t in_mu; /* the inbox of decoded messages */
    inbox_msg *inbox;
    int n_inbox, cap_inbox;
    int wake_fd;
    pthread_t thread;
    bool thread_started, stopped;
    /* decode: the link thread (links to P, probes, the fences' link-worker
     * destruction: the calls that wait on HTTP or on the ranks' step) */
    int link_fd;
    pthread_t link_thread;
    bool link_started;
    atomic_bool stop;
    /* prefill */
    dpeer *dpeers;
    pjob *pjobs;
    atomic_uint_fast64_t bytes_put;
    bool job_slot_used[TD_XRANK_MAX_JOBS];
    bool peer_slot_used[TD_XRANK_MAX_PEERS];
    /* decode */
    ppeer *ppeers;
    int n_ppeers;      /* slots in use or freed (x->mu) */
    td_net_watch *dns; /* the --prefill names, resolved on its own thread */
    int n_names;
    char (*dns_addrs)[TD_NET_ADDR_LEN]; /* a round taken from it (link thread) */
    int *dns_n;
    bool full_logged; /* "no free slot" said once */
    unsigned rr;
    djob *djobs;
    double next_lease;
};

td_xfer_params td_xfer_default_params(void) {
    td_xfer_params p = {.role = TD_XFER_DECODE,
                        .deadline_ms = 30000,
                        .lease_ms = 3000,
                        .local_prefill_threshold = 0,
                        .link_interval_ms = 500,
                        .dns_interval_ms = 5000,
                        .forget_ms = 60000,
                        .layerwise = true};
    return p;
}

static void wake(td_xfer *x) {
    uint64_t one = 1;
    ssize_t r = write(x->wake_fd, &one, sizeof one);
    TD_UNUSED(r); /* EAGAIN only when the counter is saturated: still readable */
}

static void wake_link(td_xfer *x) {
    if (x->link_fd < 0) return;
    uint64_t one = 1;
    ssize_t r = write(x->link_fd, &one, sizeof one);
    TD_UNUSED(r);
}

static uint64_t unix_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* --------------------------------------------------------------- messages */

/* Packs m (token and sender filled in here) and sends it on ep. */
static td_status send_msg(td_xfer *x, td_ucx_ep *ep, cmsg *m) {
    if (!ep) return TD_ERR_IO;
    Tandem__Internal__V1__Peer from = TANDEM__INTERNAL__V1__PEER__INIT;
    from.instance_id = x->instance_id;
    from.epoch = x->epoch;
    m->from = &from;
    m->cluster_token.data = (uint8_t *)x->token;
    m->cluster_token.len = x->token_len;
    size_t n = protobuf_c_message_get_packed_size(&m->base);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf) return TD_ERR_NOMEM;
    protobuf_c_message_pack(&m->base, buf);
    td_status st = td_ucx_send(ep, buf, n);
    free(buf);
    return st;
}

/* This instance's exchange: its plan, the KV geometry, every rank's
 * endpoint (gathered by td_xext_setup). */
typedef struct {
    exchange_t ex;
    Tandem__Internal__V1__Plan plan;
    Tandem__Internal__V1__KvGeometry kv;
    Tandem__Internal__V1__RankEndpoint rank[TD_COMM_MAX_RANKS];
    Tandem__Internal__V1__RankEndpoint *ranks[TD_COMM_MAX_RANKS];
    uint32_t stage[TD_PLAN_MAX_PP + 1];
    uint8_t compat[16];
} own_exchange;

/* link: the slot whose link workers' addresses go in (the decode side's
 * exchange for one prefill instance), -1: the ranks' own workers. */
static td_status build_exchange(td_xfer *x, own_exchange *o, uint64_t exchange_id, int link) {
    tandem__internal__v1__exchange__init(&o->ex);
    tandem__internal__v1__plan__init(&o->plan);
    tandem__internal__v1__kv_geometry__init(&o->kv);
    o->plan.tp = (uint32_t)x->plan.tp;
    o->plan.pp = (uint32_t)x->plan.pp;
    o->plan.cp = (uint32_t)x->plan.cp;
    for (int s = 0; s <= x->plan.pp; s++) o->stage[s] = (uint32_t)x->plan.stage_begin[s];
    o->plan.n_stage_begin = (size_t)x->plan.pp + 1;
    o->plan.stage_begin = o->stage;
    o->kv.n_layer = (uint32_t)x->n_layer;
    o->kv.n_head_kv = (uint32_t)x->n_head_kv;
    o->kv.head_dim = (uint32_t)x->head_dim;
    o->kv.block_size = (uint32_t)x->block_size;
    o->kv.n_blocks = (uint32_t)x->n_blocks;
    o->kv.dtype = (uint32_t)x->lim.kv_dtype;
    for (int r = 0; r < x->world; r++) {
        Tandem__Internal__V1__RankEndpoint *e = &o->rank[r];
        tandem__internal__v1__rank_endpoint__init(e);
        const uint8_t *blob, *addr, *rkey;
        size_t len, al, rl;
        uint64_t base, bytes;
        td_status st = link >= 0 ? td_xext_link_endpoint(x->xext, link, r, &blob, &len)
                                 : td_xext_endpoint(x->xext, r, &blob, &len);
        if (!st) st = td_xrank_blob_parse(blob, len, &addr, &al, &rkey, &rl, &base, &bytes);
        if (st) return st;
        e->rank = (uint32_t)r;
        e->worker_address.data = (uint8_t *)addr;
        e->worker_address.len = al;
        e->kv_rkey.data = (uint8_t *)rkey;
        e->kv_rkey.len = rl;
        e->kv_base = base;
        e->kv_bytes = bytes;
        o->ranks[r] = e;
    }
    o->ex.exchange_id = exchange_id;
    o->ex.plan = &o->plan;
    o->ex.kv = &o->kv;
    o->ex.n_ranks = (size_t)x->world;
    o->ex.ranks = o->ranks;
    td_kv_hash_bytes(x->p.compat, o->compat);
    o->ex.compat.data = o->compat;
    o->ex.compat.len = 16;
    return TD_OK;
}

static td_xfer_plan plan_of(const exchange_t *ex) {
    td_xfer_plan p = {.tp = (int)ex->plan->tp, .pp = (int)ex->plan->pp, .cp = (int)ex->plan->cp};
    for (uint32_t s = 0; s <= ex->plan->pp && s <= TD_PLAN_MAX_PP; s++)
        p.stage_begin[s] = (int32_t)ex->plan->stage_begin[s];
    return p;
}

/* --------------------------------------------------------- UCX callbacks */

static void on_msg(void *ctx, const uint8_t *data, size_t len) {
    td_xfer *x = ctx;
    inbox_msg im = {.arrival_unix_ns = unix_ns(), .arrival_s = td_time_s()};
    char err[256];
    td_xfer_msg *m = NULL;
    if (td_xfer_msg_decode(&x->lim, data, len, &m, err, sizeof err) != TD_OK) {
        TD_LOG_WARN("control message rejected (%zu bytes): %s", len, err);
        td_metrics_kv_transfer_failure(x->p.metrics, TD_XFER_FAIL_INVALID);
        return;
    }
    pthread_mutex_lock(&x->in_mu);
    if (x->n_inbox == x->cap_inbox) {
        int cap = x->cap_inbox ? 2 * x->cap_inbox : 64;
        inbox_msg *v = realloc(x->inbox, (size_t)cap * sizeof *v);
        if (!v) {
            pthread_mutex_unlock(&x->in_mu);
            TD_LOG_ERROR("out of memory queueing a control message: dropped");
            td_xfer_msg_free(m);
            return;
        }
        x->inbox = v;
        x->cap_inbox = cap;
    }
    im.m = m;
    x->inbox[x->n_inbox++] = im;
    pthread_mutex_unlock(&x->in_mu);
    wake(x);
}

static void on_error(void *ctx, td_ucx_ep *ep, td_status why) {
    td_xfer *x = ctx;
    void *u = td_ucx_ep_user(ep);
    TD_LOG_WARN("transfer endpoint error (%s)", td_status_str(why));
    if (!u) return;
    if (x->p.role == TD_XFER_PREFILL)
        atomic_store(&((dpeer *)u)->failed, true);
    else
        atomic_store(&((ppeer *)u)->err, true);
    wake(x);
}

static void on_peer_closed(void *ctx) {
    ppeer *pp = ctx;
    atomic_store(&pp->close_done, true);
}

/* ================================================================ prefill */

static int32_t slot_take(bool *used, int n) {
    for (int i = 0; i < n; i++)
        if (!used[i]) {
            used[i] = true;
            return i;
        }
    return -1;
}

/* Closes the control endpoint and tells the ranks to close theirs. Caller
 * holds x->mu. */
static void dpeer_close(td_xfer *x, dpeer *d) {
    if (d->ep) td_ucx_ep_close(d->ep, NULL, NULL);
    d->ep = NULL;
    d->closed = true;
    if (d->slot >= 0) {
        td_xdir_buf b = {0};
        td_xdir_unpeer(&b, d->slot);
        td_xext_post(x->xext, &b);
        td_xdir_free(&b);
        x->peer_slot_used[d->slot] = false;
        d->slot = -1;
    }
}

static void p_ended(void *ctx, td_sched_ticket t, const td_sample_result *first,
                    const uint8_t *state) {
    pjob *j = ctx;
    td_xfer *x = j->x;
    TD_UNUSED(t);
    pthread_mutex_lock(&x->mu);
    if (first) {
        j->first = *first;
        j->have_first = true;
        memcpy(j->sstate, state, sizeof j->sstate);
    }
    j->ended = true;
    pthread_mutex_unlock(&x->mu);
    wake(x);
}

static void p_reject(td_xfer *x, dpeer *d, const char *id, Tandem__Internal__V1__RejectReason why,
                     const char *msg) {
    TD_LOG_INFO("prefill %s rejected: %s", id, msg);
    if (!d || !d->ep) return; /* no way back: D's deadline covers it */
    cmsg m = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__INIT;
    Tandem__Internal__V1__PrefillRejected r = TANDEM__INTERNAL__V1__PREFILL_REJECTED__INIT;
    r.request_id = (char *)id;
    r.reason = why;
    r.message = (char *)msg;
    r.retry_after_ms = why == TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_BUSY ? 100 : 0;
    m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_REJECTED;
    m.prefill_rejected = &r;
    send_msg(x, d->ep, &m);
}

static dpeer *dpeer_find(td_xfer *x, const char *inst, uint64_t epoch) {
    for (dpeer *d = x->dpeers; d; d = d->next)
        if (d->epoch == epoch && !d->closed && !d->superseded && !atomic_load(&d->failed) &&
            strcmp(d->instance, inst) == 0)
            return d;
    return NULL;
}

/* A new D incarnation (or a new exchange of a known one) from an inline
 * exchange: the control endpoint to its rank 0, and a PEER directive that
 * gives every rank its endpoints. Takes ownership of m on success. Caller
 * holds x->mu. */
static dpeer *dpeer_new(td_xfer *x, td_xfer_msg *m, const exchange_t *ex) {
    int32_t slot = slot_take(x->peer_slot_used, TD_XRANK_MAX_PEERS);
    if (slot < 0) {
        /* the oldest closed-or-idle record gives its slot back */
        for (dpeer *o = x->dpeers; o && slot < 0; o = o->next) {
            bool busy = false;
            for (pjob *j = x->pjobs; j; j = j->next) busy |= j->peer == o;
            if (!busy && o->slot >= 0) {
                dpeer_close(x, o);
                slot = slot_take(x->peer_slot_used, TD_XRANK_MAX_PEERS);
            }
        }
        if (slot < 0) return NULL;
    }
    dpeer *d = calloc(1, sizeof *d);
    size_t n = protobuf_c_message_get_packed_size(&ex->base);
    uint8_t *packed = malloc(n ? n : 1);
    if (!d || !packed) {
        free(d);
        free(packed);
        x->peer_slot_used[slot] = false;
        return NULL;
    }
    d->slot = slot;
    snprintf(d->instance, sizeof d->instance, "%s", m->from->instance_id);
    d->epoch = m->from->epoch;
    d->exchange_id = ex->exchange_id;
    const Tandem__Internal__V1__RankEndpoint *r0 = NULL;
    for (size_t i = 0; i < ex->n_ranks; i++)
        if (ex->ranks[i]->rank == 0) r0 = ex->ranks[i];
    if (!r0 || td_ucx_ep_create(x->ucx, r0->worker_address.data, r0->worker_address.len, d,
                                &d->ep) != TD_OK) {
        free(d);
        free(packed);
        x->peer_slot_used[slot] = false;
        return NULL;
    }
    protobuf_c_message_pack(&ex->base, packed);
    td_xdir_buf b = {0};
    td_xdir_peer(&b, slot, packed, n);
    td_xext_post(x->xext, &b);
    td_xdir_free(&b);
    free(packed);
    d->ex_msg = m;
    d->ex = ex;
    /* An older record of the same incarnation is superseded: D sends a new
     * exchange after it fenced us, so the jobs of the old one are stale
     * (D gave up on them and may have reused their blocks): they stop, and
     * the record closes once they are gone (p_service). */
    for (dpeer *o = x->dpeers; o; o = o->next)
        if (!o->closed && o->epoch == d->epoch && strcmp(o->instance, d->instance) == 0)
            o->superseded = true;
    d->next = x->dpeers;
    x->dpeers = d;
    char tl[160];
    td_ucx_ep_transports(d->ep, tl, sizeof tl);
    TD_LOG_INFO("linked decode instance %s (epoch %016" PRIx64 ", %zu ranks, tp %u pp %u cp %u): "
                "%s",
                d->instance, d->epoch, ex->n_ranks, ex->plan->tp, ex->plan->pp, ex->plan->cp, tl);
    return d;
}

static void pjob_free(td_xfer *x, pjob *j) {
    if (!j) return;
    if (j->st) td_gen_stream_release(j->st);
    if (j->slot >= 0) x->job_slot_used[j->slot] = false;
    free(j);
}

/* The request's destination, every decode rank the same block ids (the
 * ranks of an instance share one block numbering). */
static bool dest_uniform(const Tandem__Internal__V1__PrefillRequest *req) {
    for (size_t r = 1; r < req->n_dest; r++)
        if (req->dest[r]->n_block_ids != req->dest[0]->n_block_ids ||
            memcmp(req->dest[r]->block_ids, req->dest[0]->block_ids,
                   req->dest[0]->n_block_ids * sizeof(int32_t)) != 0)
            return false;
    return req->n_dest > 0;
}

/* PrefillRequest from D. Takes ownership of m. Caller holds x->mu. */
static void p_on_request(td_xfer *x, td_xfer_msg *m) {
    const Tandem__Internal__V1__PrefillRequest *req = m->prefill_request;
    const char *id = req->request_id;
    dpeer *d = dpeer_find(x, m->from->instance_id, m->from->epoch);
    bool kept = false;
    const char *why = NULL;
    Tandem__Internal__V1__RejectReason reason = TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_INVALID;
    char err[256];
    if (req->peer_case == TANDEM__INTERNAL__V1__PREFILL_REQUEST__PEER_EXCHANGE) {
        const exchange_t *ex = req->exchange;
        td_xfer_plan dp = plan_of(ex);
        int n_routes = 0;
        td_status mst = td_xfer_map(&x->plan, &dp, x->n_layer, x->n_head_kv, NULL, 0, &n_routes);
        if (mst != TD_OK && mst != TD_ERR_RANGE) {
            p_reject(x, d, id, TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_INCOMPATIBLE,
                     "no transfer mapping between the two plans");
            td_xfer_msg_free(m);
            return;
        }
        if (!d || d->exchange_id != ex->exchange_id) {
            dpeer *n = dpeer_new(x, m, ex);
            if (!n) {
                TD_LOG_WARN("prefill %s: cannot reach decode instance %s", id,
                            m->from->instance_id);
                td_xfer_msg_free(m);
                return;
            }
            d = n;
            kept = true;
        }
    } else if (!d || d->exchange_id != req->exchange_id) {
        p_reject(x, d, id, TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_UNKNOWN_EXCHANGE,
                 "unknown exchange: send it inline");
        td_xfer_msg_free(m);
        return;
    }
    pjob *j = NULL;
    td_logit_bias *bias = NULL;
    /* The earlier of the relative deadline and D's point in time (a request
     * that waited in our queue gets what is left of it, not a fresh one). */
    double deadline_s = req->deadline_ms / 1000.0;
    if (req->deadline_unix_ns) {
        double left = ((double)req->deadline_unix_ns - (double)unix_ns()) * 1e-9;
        deadline_s = TD_MIN(deadline_s, left);
    }
    if (deadline_s <= 0) {
        why = "past its deadline on arrival";
        reason = TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_BUSY;
    } else if (td_xfer_check_dest(req, d->ex, err, sizeof err) != TD_OK) {
        why = err;
    } else if (!dest_uniform(req)) {
        why = "destination blocks differ between decode ranks";
    } else if (td_sched_draining(x->p.sched)) {
        why = "draining";
        reason = TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_DRAINING;
    } else {
        for (pjob *o = x->pjobs; o && !why; o = o->next)
            if (o->peer == d && strcmp(o->id, id) == 0) why = "request id already in flight";
    }
    int32_t slot = why ? -1 : slot_take(x->job_slot_used, TD_XRANK_MAX_JOBS);
    if (!why && slot < 0) {
        why = "every job slot is busy";
        reason = TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_BUSY;
    }
    if (!why && !(j = calloc(1, sizeof *j))) {
        x->job_slot_used[slot] = false;
        why = "out of memory";
        reason = TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_BUSY;
    }
    td_gen_request g;
    td_gen_request_init(&g);
    td_api_limits lim = td_api_default_limits();
    td_api_error aerr;
    if (!why && td_sampling_from_proto(req->sampling, &lim, x->n_vocab, &g, &bias, &aerr)) {
        why = aerr.message;
        pjob_free(x, j);
        j = NULL;
        x->job_slot_used[slot] = false;
    }
    if (why) {
        p_reject(x, d, id, reason, why);
        if (!kept) td_xfer_msg_free(m);
        return;
    }
    j->x = x;
    j->peer = d;
    j->slot = slot;
    snprintf(j->id, sizeof j->id, "%s", id);
    j->n_prompt = (int32_t)req->n_tokens;
    j->d_cached = (int32_t)req->cached_tokens;
    j->t_recv = td_time_s();
    j->deadline = j->t_recv + deadline_s;
    j->lease_until = j->t_recv + (req->lease_ms ? req->lease_ms : (uint32_t)x->p.lease_ms) / 1000.0;
    /* The ranks learn the job before its first chunk runs. */
    td_xdir_buf b = {0};
    td_xdir_job(&b, slot, d->slot, j->n_prompt, j->d_cached,
                td_time_ns() + (uint64_t)(deadline_s * 1e9), req->dest[0]->block_ids,
                (int32_t)req->dest[0]->n_block_ids);
    td_xext_post(x->xext, &b);
    td_xdir_free(&b);

    g.id = id;
    g.prompt = req->tokens;
    g.n_prompt = j->n_prompt;
    g.max_tokens = 1;
    g.min_tokens = g.min_tokens > 0 ? 1 : 0; /* only the first token is drawn here */
    g.stop = NULL;                           /* no text here */
    g.n_stop = 0;
    g.kv_export.ctx = j;
    g.kv_export.slot = slot;
    g.kv_export.ended = p_ended;
    td_status st = td_sched_submit(x->p.sched, &g, &j->st);
    free(bias); /* copied by the sampler */
    if (st != TD_OK) {
        j->st = NULL;
        td_xdir_buf db = {0};
        td_xdir_drop(&db, slot);
        td_xext_post(x->xext, &db);
        td_xdir_free(&db);
        pjob_free(x, j);
        p_reject(x, d, id,
                 st == TD_AGAIN             ? TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_BUSY
                 : st == TD_ERR_UNAVAILABLE ? TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_DRAINING
                                            : TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_INVALID,
                 td_status_str(st));
        if (!kept) td_xfer_msg_free(m);
        return;
    }
    j->ticket = td_gen_stream_ticket(j->st);
    j->next = x->pjobs;
    x->pjobs = j;
    if (!kept) td_xfer_msg_free(m);
}

static void p_on_msg(td_xfer *x, td_xfer_msg *m) {
    switch (m->body_case) {
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_REQUEST:
        p_on_request(x, m); /* takes m */
        return;
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_ABORT:
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_TRANSFER_CONSUMED: {
        bool abort = m->body_case == TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_ABORT;
        const char *id = abort ? m->abort->request_id : m->transfer_consumed->request_id;
        for (pjob *j = x->pjobs; j; j = j->next) {
            if (strcmp(j->id, id) != 0 || j->peer->epoch != m->from->epoch ||
                strcmp(j->peer->instance, m->from->instance_id) != 0)
                continue;
            if (abort) {
                j->cancelled = true;
                if (!j->ended && j->st) td_gen_stream_cancel(j->st);
            } else {
                j->consumed = true;
            }
        }
        break;
    }
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_LEASE_RENEWAL: {
        const Tandem__Internal__V1__LeaseRenewal *lr = m->lease_renewal;
        double until = td_time_s() + lr->lease_ms / 1000.0;
        for (size_t i = 0; i < lr->n_request_ids; i++)
            for (pjob *j = x->pjobs; j; j = j->next)
                if (strcmp(j->id, lr->request_ids[i]) == 0 && j->peer->epoch == m->from->epoch &&
                    strcmp(j->peer->instance, m->from->instance_id) == 0)
                    j->lease_until = until;
        break;
    }
    default:
        TD_LOG_INFO("prefill: ignoring control message %d from %s", (int)m->body_case,
                    m->from->instance_id);
        break;
    }
    td_xfer_msg_free(m);
}

/* PrefillDone, once every rank has flushed the job's puts (no rank reports
 * it busy). Caller holds x->mu. */
static bool send_done(td_xfer *x, pjob *j) {
    cmsg m = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__INIT;
    Tandem__Internal__V1__PrefillDone pd = TANDEM__INTERNAL__V1__PREFILL_DONE__INIT;
    Tandem__V1__TopLogprob tl[TD_SAMPLER_MAX_LOGPROBS], *tlp[TD_SAMPLER_MAX_LOGPROBS];
    pd.request_id = j->id;
    pd.first_token = j->first.token;
    pd.logprob = j->first.logprob;
    int32_t n_top = TD_MAX(0, TD_MIN(j->first.n_top, TD_SAMPLER_MAX_LOGPROBS));
    for (int32_t i = 0; i < n_top; i++) {
        tandem__v1__top_logprob__init(&tl[i]);
        tl[i].token_id = j->first.top[i].token;
        tl[i].logprob = j->first.top[i].logprob;
        tlp[i] = &tl[i];
    }
    pd.n_top_logprobs = (size_t)n_top;
    pd.top_logprobs = tlp;
    /* the prompt tokens P's own prefix cache served (pushed, not recomputed) */
    td_gen_delta dl;
    int32_t p_cached = j->st && td_gen_stream_read(j->st, 0, &dl) == TD_OK ? dl.n_cached_tokens : 0;
    pd.prefix_tokens_reused = (uint32_t)TD_MAX(0, p_cached - j->d_cached);
    pd.sampler_state.data = j->sstate;
    pd.sampler_state.len = sizeof j->sstate;
    uint64_t last_layer = td_xext_last_layer_ns(x->xext, j->slot);
    pd.last_layer_unix_ns = last_layer ? last_layer : unix_ns();
    m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_DONE;
    m.prefill_done = &pd;
    return send_msg(x, j->peer->ep, &m) == TD_OK;
}

/* One pass over P's jobs and peers. Caller holds x->mu; returns true when
 * jobs wait for a transfer step (td_xext_sync, without the lock):
 * dropped ones before their blocks may go, finished ones whose flush is
 * still in flight on some rank before D is answered (*answer_waits: the
 * service thread then looks again sooner). */
static bool p_service(td_xfer *x, bool *answer_waits) {
    double now = td_time_s();
    bool need_sync = false;
    *answer_waits = false;
    for (dpeer *d = x->dpeers; d; d = d->next) {
        if (d->closed) continue;
        if (!atomic_load(&d->failed) && td_xext_peer_failed(x->xext, d->slot)) {
            TD_LOG_WARN("decode instance %s (epoch %016" PRIx64 "): a rank closed its endpoints",
                        d->instance, d->epoch);
            atomic_store(&d->failed, true);
        }
        if (atomic_load(&d->failed) || d->superseded) {
            bool busy = false;
            for (pjob *j = x->pjobs; j; j = j->next) busy |= j->peer == d && j->slot >= 0;
            if (atomic_load(&d->failed) && !busy)
                TD_LOG_WARN("decode instance %s (epoch %016" PRIx64 ") unreachable: closing",
                            d->instance, d->epoch);
            if (!busy) dpeer_close(x, d); /* the ranks close theirs too */
        }
    }
    /* closed records nobody refers to any more */
    for (dpeer **dp = &x->dpeers; *dp;) {
        dpeer *d = *dp;
        bool used = false;
        for (pjob *j = x->pjobs; j; j = j->next) used |= j->peer == d;
        if (d->closed && !used) {
            *dp = d->next;
            td_xfer_msg_free(d->ex_msg);
            free(d);
            continue;
        }
        dp = &d->next;
    }
    for (pjob *j = x->pjobs; j; j = j->next) {
        bool peer_gone = atomic_load(&j->peer->failed) || j->peer->closed || j->peer->superseded;
        if (!j->ended && !j->cancelled &&
            (peer_gone || now > j->deadline || now > j->lease_until)) {
            j->cancelled = true; /* the scheduler ends it: p_ended */
            td_gen_stream_cancel(j->st);
        }
        if (j->ended && !j->replied && !j->cancelled && now <= j->deadline &&
            td_xext_busy(x->xext, j->slot)) {
            need_sync = true; /* a rank is still flushing it: ask again */
            *answer_waits = true;
            continue;
        }
        if (j->ended && !j->replied) {
            j->replied = true;
            j->ok = j->have_first && !j->cancelled && !peer_gone && now <= j->deadline &&
                    !td_xext_failed(x->xext, j->slot);
            /* Every rank has flushed the job: PrefillDone may go. */
            if (j->ok && !(j->ok = send_done(x, j)))
                TD_LOG_WARN("prefill %s: PrefillDone could not be sent", j->id);
            if (j->ok) {
                uint64_t bytes = (uint64_t)(j->n_prompt - j->d_cached) * 2u * (uint64_t)x->n_layer *
                                 (uint64_t)x->row_bytes;
                td_metrics_kv_transfer(x->p.metrics, bytes, now - j->t_recv);
                atomic_fetch_add(&x->bytes_put, bytes);
                j->lease_until = now + x->p.lease_ms / 1000.0;
            }
            td_xdir_buf b = {0};
            td_xdir_drop(&b, j->slot);
            td_xext_post(x->xext, &b);
            td_xdir_free(&b);
            need_sync = true;
        }
        /* a dropped job some rank still has puts in flight for */
        if (j->replied && !j->dropped) need_sync = true;
    }
    return need_sync;
}

/* After the transfer step that dropped them: the failure messages (P has
 * stopped writing now), the source blocks, the records. Caller holds
 * x->mu. */
static void p_after_sync(td_xfer *x) {
    double now = td_time_s();
    for (pjob **pp = &x->pjobs; *pp;) {
        pjob *j = *pp;
        if (j->replied && !j->dropped && td_xext_busy(x->xext, j->slot)) {
            /* a rank could not complete its puts even after closing its
             * endpoints: the sources (and the slot) stay until it can */
            pp = &j->next;
            continue;
        }
        if (j->replied && !j->dropped) {
            j->dropped = true;
            if (!j->ok) {
                cmsg m = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__INIT;
                Tandem__Internal__V1__TransferFailed tf =
                    TANDEM__INTERNAL__V1__TRANSFER_FAILED__INIT;
                tf.request_id = j->id;
                tf.message = j->cancelled        ? "aborted"
                             : now > j->deadline ? "deadline"
                             : !j->have_first    ? "prefill failed"
                                                 : "transfer error";
                m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_TRANSFER_FAILED;
                m.transfer_failed = &tf;
                TD_LOG_INFO("prefill %s for %s failed: %s", j->id, j->peer->instance, tf.message);
                if (!atomic_load(&j->peer->failed) && !j->peer->closed)
                    send_msg(x, j->peer->ep, &m);
                td_metrics_kv_transfer_failure(x->p.metrics, j->cancelled ? TD_XFER_FAIL_ABORTED
                                                             : now > j->deadline
                                                                 ? TD_XFER_FAIL_DEADLINE
                                                                 : TD_XFER_FAIL_FAILED);
                j->consumed = true; /* nothing for D to consume */
            }
            td_sched_release(x->p.sched, j->ticket);
            x->job_slot_used[j->slot] = false;
            j->slot = -1;
        }
        if (j->dropped && (j->consumed || now > j->lease_until)) {
            *pp = j->next;
            pjob_free(x, j);
            continue;
        }
        pp = &j->next;
    }
}

/* ================================================================= decode */

static void djob_unref(djob *j) {
    if (atomic_fetch_sub(&j->refs, 1) != 1) return;
    free(j->tokens);
    free(j->bias);
    free(j->stop_ids);
    free(j);
}

static void d_release(void *ctx) { djob_unref(ctx); }

static void table_remove(td_xfer *x, djob *j) {
    for (djob **pp = &x->djobs; *pp; pp = &(*pp)->next)
        if (*pp == j) {
            *pp = j->next;
            djob_unref(j);
            return;
        }
}

/* Builds and sends j's PrefillRequest to peer pp. Caller holds x->mu. */
static td_status send_request(td_xfer *x, ppeer *pp, djob *j, const int32_t *blocks,
                              int32_t n_blocks, int32_t n_cached) {
    cmsg m = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__INIT;
    Tandem__Internal__V1__PrefillRequest r = TANDEM__INTERNAL__V1__PREFILL_REQUEST__INIT;
    Tandem__Internal__V1__RankBlocks rb[TD_COMM_MAX_RANKS], *rbp[TD_COMM_MAX_RANKS];
    own_exchange oe;
    r.request_id = j->id;
    r.n_tokens = (size_t)j->n_tokens;
    r.tokens = j->tokens;
    r.cached_tokens = (uint32_t)n_cached;
    /* every rank of this instance uses the same block ids */
    for (int k = 0; k < x->world; k++) {
        tandem__internal__v1__rank_blocks__init(&rb[k]);
        rb[k].rank = (uint32_t)k;
        rb[k].n_block_ids = (size_t)n_blocks;
        rb[k].block_ids = (int32_t *)blocks;
        rbp[k] = &rb[k];
    }
    r.n_dest = (size_t)x->world;
    r.dest = rbp;
    if (pp->need_exchange) {
        td_status est = build_exchange(x, &oe, pp->exchange_id, (int)(pp - x->ppeers));
        if (est) return est;
        r.peer_case = TANDEM__INTERNAL__V1__PREFILL_REQUEST__PEER_EXCHANGE;
        r.exchange = &oe.ex;
    } else {
        r.peer_case = TANDEM__INTERNAL__V1__PREFILL_REQUEST__PEER_EXCHANGE_ID;
        r.exchange_id = pp->exchange_id;
    }
    /* P's deadline ends a little before ours, so that it has stopped
     * writing by the time we give up. */
    int margin = TD_MAX(50, x->p.deadline_ms / 10);
    r.deadline_ms = (uint32_t)TD_MAX(1, x->p.deadline_ms - margin);
    r.deadline_unix_ns = unix_ns() + (uint64_t)r.deadline_ms * 1000000ull;
    r.lease_ms = (uint32_t)x->p.lease_ms;
    uint8_t compat[16];
    td_kv_hash_bytes(x->p.compat, compat);
    r.compat.data = compat;
    r.compat.len = 16;
    /* what P needs to draw the first token */
    td_gen_request g;
    td_gen_request_init(&g);
    g.max_tokens = 0; /* P draws one */
    g.sampling = j->sp;
    g.sampling.logit_bias = j->bias;
    g.min_tokens = j->min_tokens;
    g.ignore_eos = j->ignore_eos;
    g.stop_ids = j->stop_ids;
    g.n_stop_ids = j->n_stop_ids;
    td_sampling_proto sp;
    if (td_sampling_to_proto(&g, &sp) != TD_OK) return TD_ERR_NOMEM;
    r.sampling = &sp.sp;
    m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_REQUEST;
    m.prefill_request = &r;
    td_status st = send_msg(x, pp->ep, &m);
    td_sampling_proto_free(&sp);
    return st;
}

/* Whether a --prefill name resolves to P instance c, under its own
 * address or one that is an alias of it. Caller holds x->mu. */
static bool peer_resolved(td_xfer *x, const ppeer *c) {
    if (c->dns_names) return true;
    int k = (int)(c - x->ppeers) + 1;
    for (int i = 0; i < x->n_ppeers; i++)
        if (x->ppeers[i].alias_of == k && x->ppeers[i].dns_names) return true;
    return false;
}

static bool d_start(void *ctx, td_sched_ticket t, const int32_t *blocks, int32_t n_blocks,
                    int32_t n_cached) {
    djob *j = ctx;
    td_xfer *x = j->x;
    j->ticket = t;
    /* unique per D epoch whatever ids clients choose: the ticket is */
    char cid[41];
    memcpy(cid, j->id, sizeof cid - 1);
    cid[sizeof cid - 1] = 0; /* at most 40 characters of the client's id */
    snprintf(j->id, sizeof j->id, "%s.%" PRIx64, cid, (uint64_t)t);
    /* the router's choice overrides the threshold */
    if (!j->want_peer[0] && j->n_tokens - n_cached < x->p.local_prefill_threshold) {
        td_metrics_prefill_route(x->p.metrics, false, TD_LOCAL_PREFILL_THRESHOLD);
        return false;
    }
    pthread_mutex_lock(&x->mu);
    ppeer *pp = NULL;
    for (int k = 0; k < x->n_ppeers && j->want_peer[0]; k++) {
        ppeer *c = &x->ppeers[k];
        if (strcmp(c->addr, j->want_peer) != 0) continue;
        if (!c->ready && c->alias_of > 0) c = &x->ppeers[c->alias_of - 1];
        if (c->ready && c->ep && !c->fence && !c->closing && !atomic_load(&c->err)) pp = c;
    }
    /* D's own choice: round-robin over the linked P, leaving out one that
     * has left every --prefill name (a pod draining away) unless the
     * router still names it */
    double now = td_time_s();
    for (int k = 0; k < x->n_ppeers && !pp; k++) {
        ppeer *c = &x->ppeers[(x->rr + (unsigned)k) % (unsigned)x->n_ppeers];
        if (x->n_names > 0 && !peer_resolved(x, c) &&
            !(c->last_named > 0 && now - c->last_named < x->p.forget_ms / 1000.0))
            continue;
        if (c->ready && c->ep && !c->fence && !c->closing && !atomic_load(&c->err)) pp = c;
    }
    if (!pp) {
        pthread_mutex_unlock(&x->mu);
        td_metrics_prefill_route(x->p.metrics, false, TD_LOCAL_PREFILL_NO_PEER);
        return false;
    }
    x->rr++;
    /* In the table before the request leaves, so its answer finds it. */
    j->peer = pp;
    j->state = DJ_SENT;
    j->n_blocks = n_blocks;
    j->n_cached = n_cached;
    j->t_sent = td_time_s();
    j->deadline = j->t_sent + x->p.deadline_ms / 1000.0;
    /* P stops writing at its own deadline, which ends before ours; the
     * second beyond it covers the check-to-put window and clock steps */
    j->q_until = j->deadline + 1.0;
    atomic_fetch_add(&j->refs, 1);
    j->next = x->djobs;
    x->djobs = j;
    td_status st = send_request(x, pp, j, blocks, n_blocks, n_cached);
    if (st != TD_OK) {
        table_remove(x, j);
        j->state = DJ_NEW;
        pthread_mutex_unlock(&x->mu);
        TD_LOG_WARN("request %s: sending the prefill request to %s failed (%s): prefilling here",
                    j->id, pp->addr, td_status_str(st));
        td_metrics_prefill_route(x->p.metrics, false, TD_LOCAL_PREFILL_NO_PEER);
        return false;
    }
    pp->need_exchange = false;
    pthread_mutex_unlock(&x->mu);
    td_metrics_prefill_route(x->p.metrics, true, TD_LOCAL_PREFILL_COUNT);
    return true;
}

static void d_cancelled(void *ctx, td_sched_ticket t) {
    djob *j = ctx;
    td_xfer *x = j->x;
    pthread_mutex_lock(&x->mu);
    if (j->state == DJ_SENT) {
        j->state = DJ_CANCELLED; /* blocks quarantined until P answers or is fenced */
        j->abort_pending = true;
        td_metrics_kv_transfer_failure(x->p.metrics, TD_XFER_FAIL_ABORTED);
    } else if (j->state == DJ_ANSWERED) {
        /* P's answer came first (its event was still queued): nothing
         * writes into the blocks any more */
        td_sched_release(x->p.sched, t);
    }
    pthread_mutex_unlock(&x->mu);
    wake(x);
}

/* The slot of P instance addr, added (in a free slot) when new; NULL when
 * every slot is taken. *added: it was new. Caller holds x->mu. */
static ppeer *peer_get(td_xfer *x, const char *addr, const char *why, bool *added) {
    *added = false;
    int free_k = -1;
    for (int k = 0; k < x->n_ppeers; k++) {
        if (!strcmp(x->ppeers[k].addr, addr)) return &x->ppeers[k];
        if (!x->ppeers[k].addr[0] && free_k < 0) free_k = k;
    }
    if (free_k < 0 && x->n_ppeers < TD_XRANK_MAX_PEERS) free_k = x->n_ppeers++;
    if (free_k < 0) {
        if (!x->full_logged)
            TD_LOG_WARN("prefill instance %s (%s) left out: %d prefill instances known already",
                        addr, why, TD_XRANK_MAX_PEERS);
        x->full_logged = true;
        return NULL;
    }
    /* a free slot's link workers are closed and no job refers to it */
    ppeer *pp = &x->ppeers[free_k];
    memset(pp, 0, sizeof *pp);
    atomic_init(&pp->err, false);
    atomic_init(&pp->close_done, false);
    snprintf(pp->addr, sizeof pp->addr, "%s", addr);
    pp->unlinked_since = td_time_s();
    *added = true;
    TD_LOG_INFO("prefill instance %s (%s) added", addr, why);
    return pp;
}

/* A prefill instance the router named: linked from now on. */
static void want_peer(td_xfer *x, const char *addr) {
    pthread_mutex_lock(&x->mu);
    bool added = false;
    ppeer *pp = peer_get(x, addr, "named by the router", &added);
    if (pp) pp->last_named = td_time_s();
    pthread_mutex_unlock(&x->mu);
    if (added) wake_link(x);
}

void td_xfer_submit_hook(void *ctx, td_gen_request *g) {
    td_xfer *x = ctx;
    if (x->p.role != TD_XFER_DECODE || g->n_prompt < 1) return;
    if (g->route_local) { /* the router chose a local prefill */
        td_metrics_prefill_route(x->p.metrics, false, TD_LOCAL_PREFILL_ROUTER);
        return;
    }
    if (g->route_prefill) want_peer(x, g->route_prefill);
    djob *j = calloc(1, sizeof *j);
    if (!j) return; /* a local prefill, then */
    j->tokens = malloc((size_t)g->n_prompt * sizeof *j->tokens);
    if (g->sampling.n_logit_bias > 0)
        j->bias = malloc((size_t)g->sampling.n_logit_bias * sizeof *j->bias);
    if (g->n_stop_ids > 0) j->stop_ids = malloc((size_t)g->n_stop_ids * sizeof *j->stop_ids);
    if (!j->tokens || (g->sampling.n_logit_bias > 0 && !j->bias) ||
        (g->n_stop_ids > 0 && !j->stop_ids)) {
        free(j->tokens);
        free(j->bias);
        free(j->stop_ids);
        free(j);
        return;
    }
    atomic_init(&j->refs, 1);
    j->x = x;
    snprintf(j->id, sizeof j->id, "%s", g->id ? g->id : "-");
    /* printable ASCII only: the id travels in the control messages */
    for (char *c = j->id; *c; c++)
        if (*c < 0x21 || *c > 0x7e) *c = '_';
    memcpy(j->tokens, g->prompt, (size_t)g->n_prompt * sizeof *j->tokens);
    j->n_tokens = g->n_prompt;
    j->sp = g->sampling;
    if (j->bias)
        memcpy(j->bias, g->sampling.logit_bias, (size_t)g->sampling.n_logit_bias * sizeof *j->bias);
    j->sp.logit_bias = NULL;
    j->min_tokens = g->min_tokens;
    j->ignore_eos = g->ignore_eos;
    if (j->stop_ids) memcpy(j->stop_ids, g->stop_ids, (size_t)g->n_stop_ids * sizeof *j->stop_ids);
    j->n_stop_ids = g->n_stop_ids;
    if (g->route_prefill) snprintf(j->want_peer, sizeof j->want_peer, "%s", g->route_prefill);
    g->kv_import.ctx = j;
    g->kv_import.start = d_start;
    g->kv_import.cancelled = d_cancelled;
    g->kv_import.release = d_release;
}

static djob *djob_find(td_xfer *x, const char *id, const Tandem__Internal__V1__Peer *from) {
    for (djob *j = x->djobs; j; j = j->next)
        if (strcmp(j->id, id) == 0 && j->peer && j->peer->epoch == from->epoch &&
            strcmp(j->peer->instance, from->instance_id) == 0)
            return j;
    return NULL;
}

/* Sends a body-only message (TransferConsumed, Abort) about j. */
static void d_notify(td_xfer *x, djob *j, bool abort) {
    cmsg m = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__INIT;
    Tandem__Internal__V1__TransferConsumed tc = TANDEM__INTERNAL__V1__TRANSFER_CONSUMED__INIT;
    Tandem__Internal__V1__Abort ab = TANDEM__INTERNAL__V1__ABORT__INIT;
    if (abort) {
        ab.request_id = j->id;
        ab.message = "cancelled";
        m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_ABORT;
        m.abort = &ab;
    } else {
        tc.request_id = j->id;
        m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_TRANSFER_CONSUMED;
        m.transfer_consumed = &tc;
    }
    send_msg(x, j->peer->ep, &m);
}

static void d_on_msg(td_xfer *x, const inbox_msg *im) {
    td_xfer_msg *m = im->m;
    const char *id = NULL;
    switch (m->body_case) {
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_DONE:
        id = m->prefill_done->request_id;
        break;
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_REJECTED:
        id = m->prefill_rejected->request_id;
        break;
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_TRANSFER_FAILED:
        id = m->transfer_failed->request_id;
        break;
    default:
        TD_LOG_INFO("decode: ignoring control message %d from %s", (int)m->body_case,
                    m->from->instance_id);
        td_xfer_msg_free(m);
        return;
    }
    djob *j = djob_find(x, id, m->from);
    if (!j || (j->state != DJ_SENT && j->state != DJ_CANCELLED)) {
        /* late (after our deadline, fenced) or unknown: nothing to do */
        TD_LOG_INFO("decode: answer for %s from %s ignored (not in flight)", id,
                    m->from->instance_id);
        td_xfer_msg_free(m);
        return;
    }
    double now = im->arrival_s;
    bool cancelled = j->state == DJ_CANCELLED;
    if (m->body_case == TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_DONE) {
        const Tandem__Internal__V1__PrefillDone *pd = m->prefill_done;
        if (cancelled) {
            td_sched_release(x->p.sched, j->ticket); /* P flushed: the blocks are safe */
        } else {
            td_sample_result r;
            memset(&r, 0, sizeof r);
            r.token = pd->first_token;
            r.logprob = pd->logprob;
            r.n_top = (int32_t)TD_MIN(pd->n_top_logprobs, (size_t)TD_SAMPLER_MAX_LOGPROBS);
            for (int32_t i = 0; i < r.n_top; i++) {
                r.top[i].token = pd->top_logprobs[i]->token_id;
                r.top[i].logprob = pd->top_logprobs[i]->logprob;
            }
            /* the first token goes to the scheduler before anything else */
            td_sched_remote_done(x->p.sched, j->ticket, &r, pd->sampler_state.data,
                                 pd->sampler_state.len,
                                 (int32_t)TD_MIN(pd->prefix_tokens_reused, (uint32_t)j->n_tokens));
            uint64_t bytes =
                (uint64_t)(j->n_tokens - j->n_cached) * x->row_bytes * 2u * (uint64_t)x->n_layer;
            td_metrics_kv_transfer(x->p.metrics, bytes, now - j->t_sent);
            uint64_t arrival = im->arrival_unix_ns;
            if (pd->last_layer_unix_ns > 0 && pd->last_layer_unix_ns <= arrival) {
                double tail = (double)(arrival - pd->last_layer_unix_ns) * 1e-9;
                td_metrics_kv_transfer_tail(x->p.metrics, tail);
                j->peer->tail_ms =
                    j->peer->tail_ms > 0 ? 0.8 * j->peer->tail_ms + 0.2 * tail * 1e3 : tail * 1e3;
            }
            double ms = (now - j->t_sent) * 1e3;
            j->peer->avg_ms = j->peer->avg_ms > 0 ? 0.8 * j->peer->avg_ms + 0.2 * ms : ms;
        }
        d_notify(x, j, false); /* TransferConsumed: P may release its side */
    } else {
        bool rej = m->body_case == TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_REJECTED;
        if (rej && m->prefill_rejected->reason ==
                       TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_UNKNOWN_EXCHANGE)
            j->peer->need_exchange = true;
        TD_LOG_INFO("request %s: prefill instance %s %s: %s", j->id, j->peer->addr,
                    rej ? "rejected it" : "failed it",
                    rej ? m->prefill_rejected->message : m->transfer_failed->message);
        /* Rejected: nothing was written. TransferFailed: P flushed and
         * stopped. Either way the blocks are safe to reuse. */
        if (cancelled) {
            td_sched_release(x->p.sched, j->ticket);
        } else {
            td_metrics_kv_transfer_failure(x->p.metrics,
                                           rej ? TD_XFER_FAIL_REJECTED : TD_XFER_FAIL_FAILED);
            td_metrics_prefill_route(x->p.metrics, false, TD_LOCAL_PREFILL_FALLBACK);
            td_sched_remote_failed(x->p.sched, j->ticket, false, true, TD_ERR_UNAVAILABLE);
        }
    }
    j->state = DJ_ANSWERED;
    table_remove(x, j);
    td_xfer_msg_free(m);
}

/* Reads P's exchange from its HTTP endpoint and links to its rank 0. Runs
 * without x->mu (the fetch blocks up to its timeout). */
static td_status fetch_exchange(td_xfer *x, const char *addr, td_xfer_msg **m_p, char *err,
                                size_t err_len, bool *refused) {
    char url[400];
    snprintf(url, sizeof url, "http://%s/internal/v1/kv/exchange", addr);
    td_httpc_req rq = {.url = url,
                       .cluster_token = x->token,
                       .timeout_ms = 1000,
                       .connect_timeout_ms = 500,
                       .max_body = XF_EXCHANGE_LIMIT};
    td_httpc_reply rp;
    td_status st = td_httpc_do(&rq, &rp);
    if (refused) *refused = rp.refused;
    if (st) {
        snprintf(err, err_len, "GET %s: %s", url, rp.err);
        st = TD_ERR_IO;
    } else if (rp.code != 200) {
        snprintf(err, err_len, "GET %s: HTTP %ld", url, rp.code);
        st = TD_ERR_IO;
    } else if ((st = td_xfer_msg_decode(&x->lim, (const uint8_t *)rp.body, rp.len, m_p, err,
                                        err_len)) == TD_OK &&
               (*m_p)->body_case != TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_EXCHANGE) {
        snprintf(err, err_len, "GET %s: not an exchange", url);
        td_xfer_msg_free(*m_p);
        *m_p = NULL;
        st = TD_ERR_INVALID;
    }
    td_httpc_reply_free(&rp);
    return st;
}

/* A linked P is read again now and then: UCX may take tens of seconds to
 * notice a dead peer over shared memory, a refused connection or another
 * epoch is immediate. A probe that merely times out changes nothing (the
 * deadlines cover a slow P). Runs without x->mu. */
static void d_probe(td_xfer *x, ppeer *pp) {
    char err[700] = "";
    td_xfer_msg *m = NULL;
    bool refused = false;
    td_status st = fetch_exchange(x, pp->addr, &m, err, sizeof err, &refused);
    pthread_mutex_lock(&x->mu);
    pp->next_probe = td_time_s() + 4 * x->p.link_interval_ms / 1000.0;
    bool fenced = false;
    if (pp->ready && !pp->fence) {
        if (st == TD_OK &&
            (m->from->epoch != pp->epoch || strcmp(m->from->instance_id, pp->instance) != 0)) {
            TD_LOG_WARN("prefill instance %s restarted (epoch %016" PRIx64 " -> %016" PRIx64
                        "): fencing the old one",
                        pp->addr, pp->epoch, m->from->epoch);
            pp->fence = fenced = true;
        } else if (st != TD_OK && refused) {
            TD_LOG_WARN("prefill instance %s is gone (%s): fencing it", pp->addr, err);
            pp->fence = fenced = true;
        }
        if (fenced) td_metrics_kv_transfer_failure(x->p.metrics, TD_XFER_FAIL_PEER_ERROR);
    }
    pthread_mutex_unlock(&x->mu);
    td_xfer_msg_free(m);
    if (fenced) wake(x);
}

static void d_link(td_xfer *x, ppeer *pp) {
    char err[700] = "";
    td_xfer_msg *m = NULL;
    td_ucx_ep *ep = NULL;
    td_status st = fetch_exchange(x, pp->addr, &m, err, sizeof err, NULL);
    if (st == TD_OK) {
        /* Another name of a P already linked: requests for this name go to
         * that link (a second one would take P's answers away from it). */
        pthread_mutex_lock(&x->mu);
        int same = 0;
        for (int k = 0; k < x->n_ppeers && !same; k++) {
            ppeer *c = &x->ppeers[k];
            if (c != pp && c->ready && !c->fence && c->epoch == m->from->epoch &&
                strcmp(c->instance, m->from->instance_id) == 0)
                same = k + 1;
        }
        if (same && pp->alias_of != same)
            TD_LOG_INFO("prefill instance %s is %s (%s): one link for both", pp->addr,
                        x->ppeers[same - 1].addr, m->from->instance_id);
        pp->alias_of = same;
        if (same) pp->next_link = td_time_s() + x->p.link_interval_ms / 1000.0;
        pthread_mutex_unlock(&x->mu);
        if (same) {
            td_xfer_msg_free(m);
            return;
        }
    }
    const Tandem__Internal__V1__RankEndpoint *r0 = NULL;
    for (size_t i = 0; st == TD_OK && i < m->exchange->n_ranks; i++)
        if (m->exchange->ranks[i]->rank == 0) r0 = m->exchange->ranks[i];
    if (st == TD_OK) {
        /* an error of the new endpoint from now on counts (the old one's
         * close has completed) */
        atomic_store(&pp->err, false);
        st = td_ucx_ep_create(x->ucx, r0->worker_address.data, r0->worker_address.len, pp, &ep);
        if (st != TD_OK) snprintf(err, sizeof err, "%s: bad worker address", pp->addr);
    }
    /* Our ranks' link workers for this P: everything it sends us arrives on
     * them, and destroying them is the fence (d_fence_links). */
    if (st == TD_OK && (st = td_xext_link(x->xext, (int)(pp - x->ppeers), true))) {
        snprintf(err, sizeof err, "%s: our KV link workers could not be opened", pp->addr);
        td_xext_link(x->xext, (int)(pp - x->ppeers), false); /* the ranks that did */
        td_ucx_ep_close(ep, NULL, NULL);
        ep = NULL;
    }
    pthread_mutex_lock(&x->mu);
    if (st == TD_OK) {
        snprintf(pp->instance, sizeof pp->instance, "%s", m->from->instance_id);
        pp->epoch = m->from->epoch;
        pp->ep = ep;
        pp->link_open = true;
        pp->ready = true;
        pp->need_exchange = true;
        pp->exchange_id = td_random_u64();
        pp->next_probe = td_time_s() + 4 * x->p.link_interval_ms / 1000.0;
        pp->last_err[0] = 0;
        char tl[160];
        td_ucx_ep_transports(ep, tl, sizeof tl);
        TD_LOG_INFO("linked prefill instance %s (%s, epoch %016" PRIx64 "): %s", pp->addr,
                    pp->instance, pp->epoch, tl);
    } else {
        if (strcmp(pp->last_err, err) != 0) TD_LOG_WARN("prefill instance unavailable: %s", err);
        snprintf(pp->last_err, sizeof pp->last_err, "%s", err);
        pp->next_link = td_time_s() + x->p.link_interval_ms / 1000.0;
    }
    pthread_mutex_unlock(&x->mu);
    td_xfer_msg_free(m);
}

/* One pass over D's jobs and peers. Caller holds x->mu. */
static void d_service(td_xfer *x) {
    double now = td_time_s();
    for (djob *j = x->djobs; j; j = j->next) {
        if (j->abort_pending) {
            j->abort_pending = false;
            d_notify(x, j, true);
        }
        if ((j->state == DJ_SENT || j->state == DJ_CANCELLED) && now > j->deadline) {
            TD_LOG_WARN("request %s: prefill instance %s missed the deadline (%d ms): fencing it",
                        j->id, j->peer->addr, x->p.deadline_ms);
            td_metrics_kv_transfer_failure(x->p.metrics, TD_XFER_FAIL_DEADLINE);
            j->peer->fence = true;
        }
    }
    for (int k = 0; k < x->n_ppeers; k++) {
        ppeer *pp = &x->ppeers[k];
        if (atomic_load(&pp->err) && pp->ep && !pp->fence) {
            TD_LOG_WARN("prefill instance %s: endpoint error: fencing it", pp->addr);
            td_metrics_kv_transfer_failure(x->p.metrics, TD_XFER_FAIL_PEER_ERROR);
            pp->fence = true;
        }
        if (pp->fence && !pp->closing) {
            /* Every job still waiting on this P is quarantined; the blocks
             * are freed once our endpoint to it is closed. */
            for (djob *j = x->djobs; j; j = j->next) {
                if (j->peer != pp) continue;
                if (j->state == DJ_SENT) {
                    td_metrics_prefill_route(x->p.metrics, false, TD_LOCAL_PREFILL_FALLBACK);
                    td_sched_remote_failed(x->p.sched, j->ticket, true, true, TD_ERR_UNAVAILABLE);
                }
                j->state = DJ_QUARANTINED;
            }
            pp->ready = false;
            pp->closing = true;
            pp->link_close_owed = pp->link_open;
            pp->next_link_close = now;
            if (pp->link_close_owed) wake_link(x);
            atomic_store(&pp->close_done, false);
            td_ucx_ep *ep = pp->ep;
            pp->ep = NULL;
            if (ep)
                td_ucx_ep_close(ep, on_peer_closed, pp);
            else
                atomic_store(&pp->close_done, true);
        }
        if (pp->closing && atomic_load(&pp->close_done) && !pp->link_close_owed) {
            /* Our endpoint is closed and the link workers P put into are
             * destroyed: relink (new link workers, a new endpoint, a new
             * exchange id inline, so P drops whatever it still has from
             * before). The blocks stay until P's deadline has surely passed
             * too (P's own puts into shared memory are bounded by it). */
            pp->closing = false;
            pp->fence = false;
            pp->next_link = now;
            pp->unlinked_since = now;
            TD_LOG_INFO("prefill instance %s fenced", pp->addr);
        }
    }
    for (djob *j = x->djobs; j;) {
        djob *next = j->next;
        if (j->state == DJ_QUARANTINED && !j->peer->closing && !j->peer->fence &&
            now >= j->q_until) {
            td_sched_release(x->p.sched, j->ticket);
            table_remove(x, j);
        }
        j = next;
    }
    if (now >= x->next_lease) {
        x->next_lease = now + x->p.lease_ms / 3000.0;
        for (int k = 0; k < x->n_ppeers; k++) {
            ppeer *pp = &x->ppeers[k];
            if (!pp->ready || !pp->ep) continue;
            char *ids[256];
            size_t n = 0;
            for (djob *j = x->djobs;; j = j->next) {
                if (j && j->peer == pp && j->state == DJ_SENT) ids[n++] = j->id;
                if ((!j && n > 0) || n == 256) { /* a message per 256 ids */
                    cmsg m = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__INIT;
                    Tandem__Internal__V1__LeaseRenewal lr =
                        TANDEM__INTERNAL__V1__LEASE_RENEWAL__INIT;
                    lr.n_request_ids = n;
                    lr.request_ids = ids;
                    lr.lease_ms = (uint32_t)x->p.lease_ms;
                    m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_LEASE_RENEWAL;
                    m.lease_renewal = &lr;
                    send_msg(x, pp->ep, &m);
                    n = 0;
                }
                if (!j) break;
            }
        }
    }
}

/* The fence's second half, on the link thread (without x->mu: it waits for
 * the ranks' step): destroys our ranks' link workers of every P being
 * fenced. Over TCP (and wherever our worker carries out a put) the
 * P's puts still in flight, queued in its socket or in the network, are
 * dropped with the connections from then on. */
static void d_fence_links(td_xfer *x) {
    pthread_mutex_lock(&x->mu);
    int n_peers = x->n_ppeers;
    pthread_mutex_unlock(&x->mu);
    for (int k = 0; k < n_peers; k++) {
        ppeer *pp = &x->ppeers[k];
        pthread_mutex_lock(&x->mu);
        bool owed = pp->link_close_owed && td_time_s() >= pp->next_link_close;
        pthread_mutex_unlock(&x->mu);
        if (!owed) continue;
        td_status st = td_xext_link(x->xext, k, false);
        pthread_mutex_lock(&x->mu);
        if (st && td_exec_failed(x->p.exec)) {
            /* the instance is failing: its ranks are gone, and the blocks
             * stay quarantined until it stops */
            TD_LOG_ERROR("prefill instance %s: our KV link workers could not be destroyed (the "
                         "parallel plan failed)",
                         pp->addr);
            pp->next_link_close = INFINITY;
        } else if (st) {
            TD_LOG_ERROR("prefill instance %s: our KV link workers could not be destroyed (%s); "
                         "its blocks stay quarantined, trying again",
                         pp->addr, td_status_str(st));
            pp->next_link_close = td_time_s() + 1.0;
        } else {
            pp->link_close_owed = false;
            pp->link_open = false;
        }
        pthread_mutex_unlock(&x->mu);
        if (!st) wake(x);
    }
}

/* ========================================================= service thread */

static void *service_main(void *arg) {
    td_xfer *x = arg;
    bool answer_waits = false; /* D waits on a rank's flush: look again sooner */
    while (!atomic_load(&x->stop)) {
        struct pollfd pfd = {.fd = x->wake_fd, .events = POLLIN};
        poll(&pfd, 1, answer_waits ? 5 : 20);
        uint64_t v;
        ssize_t r = read(x->wake_fd, &v, sizeof v);
        TD_UNUSED(r);
        pthread_mutex_lock(&x->in_mu);
        inbox_msg *in = x->inbox;
        int n = x->n_inbox;
        x->inbox = NULL;
        x->n_inbox = x->cap_inbox = 0;
        pthread_mutex_unlock(&x->in_mu);
        pthread_mutex_lock(&x->mu);
        for (int i = 0; i < n; i++) {
            if (x->p.role == TD_XFER_PREFILL)
                p_on_msg(x, in[i].m);
            else
                d_on_msg(x, &in[i]);
        }
        bool sync = false;
        if (x->p.role == TD_XFER_PREFILL)
            sync = p_service(x, &answer_waits);
        else
            d_service(x);
        pthread_mutex_unlock(&x->mu);
        free(in);
        if (x->p.role == TD_XFER_PREFILL) {
            /* the dropped jobs' puts are flushed on every rank after this;
             * a failed executor's busy bits are stale: nothing is released
             * on them (the instance is failing, D's deadline and fence
             * cover its jobs) */
            td_status sst = sync ? td_xext_sync(x->xext) : TD_OK;
            if (sst == TD_OK && !td_exec_failed(x->p.exec)) {
                pthread_mutex_lock(&x->mu);
                p_after_sync(x);
                pthread_mutex_unlock(&x->mu);
            }
        }
    }
    return NULL;
}

/* Takes the latest round of the --prefill names (resolved on the watch's
 * thread: the link thread never waits on DNS): every address is a P
 * instance. A name that did not resolve this round keeps what it had; an
 * address that left every name is forgotten later (d_forget), once
 * unlinked. Link thread. */
static void d_take_dns(td_xfer *x) {
    if (!x->dns || !td_net_watch_take(x->dns, x->dns_addrs, x->dns_n)) return;
    bool added_any = false;
    pthread_mutex_lock(&x->mu);
    for (int i = 0; i < x->n_names; i++) {
        if (x->dns_n[i] < 0) continue;
        uint64_t bit = 1ull << i;
        for (int k = 0; k < x->n_ppeers; k++) x->ppeers[k].dns_names &= ~bit;
        for (int a = 0; a < x->dns_n[i]; a++) {
            bool added = false;
            ppeer *pp = peer_get(x, x->dns_addrs[i * TD_XRANK_MAX_PEERS + a], "resolved", &added);
            if (pp) pp->dns_names |= bit;
            added_any |= added;
        }
    }
    pthread_mutex_unlock(&x->mu);
    if (added_any) wake_link(x);
}

/* Frees the slots of P instances that are neither resolved nor named by
 * the router any more and have stayed unlinked for forget_ms (a pod gone
 * for good): the slots are bounded (TD_XRANK_MAX_PEERS) and an autoscaled
 * pool keeps bringing new addresses. A slot goes only when nothing refers
 * to it: no job, no link workers, no fence under way. Link thread: the
 * only one that reads a slot's addr without x->mu. */
static void d_forget(td_xfer *x) {
    pthread_mutex_lock(&x->mu);
    double now = td_time_s(), after = x->p.forget_ms / 1000.0;
    for (int k = 0; k < x->n_ppeers; k++) {
        ppeer *pp = &x->ppeers[k];
        if (!pp->addr[0] || pp->dns_names || pp->ready || pp->fence || pp->closing ||
            pp->link_open || pp->link_close_owed || pp->ep ||
            (pp->last_named > 0 && now - pp->last_named < after) ||
            now - pp->unlinked_since < after)
            continue;
        bool held = false;
        for (djob *j = x->djobs; j && !held; j = j->next) held = j->peer == pp;
        if (held) continue;
        TD_LOG_INFO("prefill instance %s forgotten (unlinked for %.0f s, no longer resolved or "
                    "named)",
                    pp->addr, now - pp->unlinked_since);
        pp->addr[0] = 0;
        pp->alias_of = 0;
        for (int i = 0; i < x->n_ppeers; i++)
            if (x->ppeers[i].alias_of == k + 1) x->ppeers[i].alias_of = 0;
        x->full_logged = false;
    }
    pthread_mutex_unlock(&x->mu);
}

/* Decode: the link thread. Links to P (HTTP, then opening our ranks'
 * link workers), probes of linked P, and the fences' destruction of link
 * workers all wait (on a peer's HTTP endpoint, on the ranks' step), so
 * they run here and the service thread keeps answering messages, checking
 * deadlines and renewing leases meanwhile. */
static void *link_main(void *arg) {
    td_xfer *x = arg;
    for (bool first = true; !atomic_load(&x->stop); first = false) {
        if (!first) {
            struct pollfd pfd = {.fd = x->link_fd, .events = POLLIN};
            poll(&pfd, 1, 50);
            uint64_t v;
            ssize_t r = read(x->link_fd, &v, sizeof v);
            TD_UNUSED(r);
        }
        d_fence_links(x);
        d_take_dns(x);
        d_forget(x);
        double now = td_time_s();
        pthread_mutex_lock(&x->mu);
        int n_peers = x->n_ppeers; /* grows with the router's choices */
        pthread_mutex_unlock(&x->mu);
        for (int k = 0; k < n_peers && !atomic_load(&x->stop); k++) {
            ppeer *pp = &x->ppeers[k];
            pthread_mutex_lock(&x->mu);
            bool used = pp->addr[0] != 0;
            bool due = used && !pp->ready && !pp->closing && !pp->fence && now >= pp->next_link;
            bool probe = used && pp->ready && !pp->fence && now >= pp->next_probe;
            pthread_mutex_unlock(&x->mu);
            if (due) d_link(x, pp);
            if (probe) d_probe(x, pp);
            if (due || probe) d_fence_links(x); /* a fence does not wait behind the others */
        }
    }
    return NULL;
}

/* ================================================================ lifetime */

td_status td_xfer_create(const td_xfer_params *p, td_xfer **x_p) {
    if (!p || !x_p || !p->sched || !p->exec || !p->cluster_token || !*p->cluster_token ||
        !p->instance_id || p->deadline_ms < 1 || p->deadline_ms > 600000 || p->lease_ms < 3 ||
        p->lease_ms > 600000 || (p->role == TD_XFER_DECODE && p->n_prefill < 0)) {
        TD_LOG_ERROR("invalid transfer parameters");
        return TD_ERR_INVALID;
    }
    td_xfer *x = calloc(1, sizeof *x);
    if (!x) return TD_ERR_NOMEM;
    x->p = *p;
    x->wake_fd = -1;
    x->link_fd = -1;
    td_status st = TD_ERR_NOMEM;
    x->instance_id = strdup(p->instance_id);
    x->token = strdup(p->cluster_token);
    if (!x->instance_id || !x->token) goto fail;
    x->token_len = strlen(x->token);
    x->p.instance_id = x->instance_id;
    x->p.cluster_token = x->token;
    x->p.prefill = NULL;
    pthread_mutex_init(&x->mu, NULL);
    pthread_mutex_init(&x->in_mu, NULL);
    td_kv_pool *kv = td_exec_kv(p->exec);
    x->epoch = td_kv_events_epoch(td_kv_pool_events(kv));

    x->exchange_id = td_random_u64();
    const td_model_config *cfg = td_model_get_config(td_exec_model(p->exec));
    const td_kv_params *kp = td_kv_pool_params(kv);
    x->n_layer = cfg->n_layer;
    x->n_head_kv = cfg->n_head_kv;
    x->head_dim = cfg->head_dim;
    x->n_vocab = cfg->n_vocab;
    x->block_size = kp->block_size;
    x->n_blocks = kp->n_blocks;
    x->plan = td_xext_plan(p->exec);
    x->world = td_exec_world(p->exec);
    /* one token of one layer over the model's KV heads, in the dense
     * layout every rank's storage has (xrank checks it); the pool's dtype
     * is one KV is held in (td_kv_pool_create checked it) */
    x->row_bytes =
        (size_t)x->n_head_kv * (size_t)x->head_dim * td_kv_elem_bytes((uint32_t)kp->dtype);
    x->lim = (td_xfer_limits){.cluster_token = (const uint8_t *)x->token,
                              .cluster_token_len = x->token_len,
                              .max_bytes = XF_MAX_MSG,
                              .n_vocab = x->n_vocab,
                              .max_ctx = p->max_ctx,
                              .n_layer = x->n_layer,
                              .n_head_kv = x->n_head_kv,
                              .head_dim = x->head_dim,
                              .block_size = x->block_size,
                              .kv_dtype = kp->dtype,
                              .compat = p->compat};
    if (p->role == TD_XFER_DECODE) {
        if (p->n_prefill > TD_XRANK_MAX_PEERS || p->dns_interval_ms < 1 || p->forget_ms < 1) {
            TD_LOG_ERROR("at most %d prefill names, intervals of at least 1 ms",
                         TD_XRANK_MAX_PEERS);
            st = TD_ERR_INVALID;
            goto fail;
        }
        x->ppeers = calloc(TD_XRANK_MAX_PEERS, sizeof *x->ppeers);
        if (!x->ppeers) goto fail;
        x->n_names = p->n_prefill;
        /* IP addresses are instances from the start (no DNS to wait for);
         * names follow from the watch */
        for (int i = 0; i < p->n_prefill; i++) {
            char host[256], port[16], ip[16], addr[1][TD_NET_ADDR_LEN], err[400];
            if (!p->prefill[i] ||
                !td_net_split(p->prefill[i], host, sizeof host, port, sizeof port)) {
                TD_LOG_ERROR("prefill instance '%s' is not HOST:PORT",
                             p->prefill[i] ? p->prefill[i] : "(null)");
                st = TD_ERR_INVALID;
                goto fail;
            }
            if (inet_pton(AF_INET, host, ip) != 1 && inet_pton(AF_INET6, host, ip) != 1) continue;
            if (td_net_resolve(p->prefill[i], addr, 1, err, sizeof err) == 1) {
                bool added;
                pthread_mutex_lock(&x->mu);
                ppeer *pp = peer_get(x, addr[0], "given", &added);
                if (pp) pp->dns_names |= 1ull << i;
                pthread_mutex_unlock(&x->mu);
            }
        }
    }
    x->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    x->link_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (x->wake_fd < 0 || x->link_fd < 0) {
        TD_LOG_ERROR("eventfd: %s", strerror(errno));
        st = TD_ERR_IO;
        goto fail;
    }
    td_ucx_params up = {.name = p->role == TD_XFER_PREFILL ? "prefill" : "decode",
                        .on_msg = on_msg,
                        .on_error = on_error,
                        .ctx = x,
                        .max_msg_bytes = XF_MAX_MSG};
    if ((st = td_ucx_create(&up, &x->ucx)) != TD_OK) goto fail;
    /* Every rank gets a worker and moves its pool into UCX memory (xrank.h);
     * rank 0's shares this channel. */
    if ((st = td_xext_setup(p->exec, x->ucx, p->layerwise, &x->xext)) != TD_OK) goto fail;
    if (pthread_create(&x->thread, NULL, service_main, x) != 0) {
        st = TD_ERR_IO;
        goto fail;
    }
    x->thread_started = true;
    if (p->role == TD_XFER_DECODE) {
        if (x->n_names > 0) {
            /* before the link thread, which reads these: the first
             * resolutions start now, each result wakes the link thread */
            x->dns_addrs = calloc((size_t)x->n_names * TD_XRANK_MAX_PEERS, sizeof *x->dns_addrs);
            x->dns_n = calloc((size_t)x->n_names, sizeof *x->dns_n);
            td_net_watch_params wp = {.names = p->prefill,
                                      .n_names = p->n_prefill,
                                      .max_addrs = TD_XRANK_MAX_PEERS,
                                      .interval_ms = p->dns_interval_ms,
                                      .wake_fd = x->link_fd,
                                      .what = "prefill instances"};
            st = !x->dns_addrs || !x->dns_n ? TD_ERR_NOMEM : td_net_watch_create(&wp, &x->dns);
            if (st != TD_OK) {
                TD_LOG_ERROR("the prefill names cannot be watched: %s", td_status_str(st));
                goto fail;
            }
        }
        if (pthread_create(&x->link_thread, NULL, link_main, x) != 0) {
            st = TD_ERR_IO;
            goto fail;
        }
        x->link_started = true;
    }
    *x_p = x;
    return TD_OK;
fail:
    td_xfer_destroy(x);
    return st;
}

void td_xfer_stop(td_xfer *x) {
    if (!x || x->stopped) return;
    x->stopped = true;
    atomic_store(&x->stop, true);
    if (x->thread_started) {
        wake(x);
        pthread_join(x->thread, NULL);
    }
    if (x->link_started) {
        wake_link(x);
        pthread_join(x->link_thread, NULL);
    }
    td_net_watch_destroy(x->dns); /* does not wait on a resolution under way */
    x->dns = NULL;
    /* Close every endpoint: puts in flight complete (with an error), so
     * nothing touches the KV memory any more. */
    pthread_mutex_lock(&x->mu);
    td_ucx_ep *eps[64];
    int n = 0;
    for (int k = 0; k < x->n_ppeers; k++) {
        if (x->ppeers[k].ep && n < 64) eps[n++] = x->ppeers[k].ep;
        x->ppeers[k].ep = NULL;
        x->ppeers[k].ready = false;
    }
    for (dpeer *d = x->dpeers; d; d = d->next) {
        if (d->ep && n < 64)
            eps[n++] = d->ep;
        else if (d->ep)
            td_ucx_ep_close(d->ep, NULL, NULL);
        d->ep = NULL;
        d->closed = true;
    }
    pthread_mutex_unlock(&x->mu);
    for (int i = 0; i < n; i++) td_ucx_ep_close_wait(eps[i], 2000);
}

void td_xfer_destroy(td_xfer *x) {
    if (!x) return;
    td_xfer_stop(x);
    /* The scheduler is gone: it freed every held and quarantined block. */
    for (djob *j = x->djobs; j;) {
        djob *next = j->next;
        djob_unref(j);
        j = next;
    }
    for (pjob *j = x->pjobs; j;) {
        pjob *next = j->next;
        pjob_free(x, j);
        j = next;
    }
    for (dpeer *d = x->dpeers; d;) {
        dpeer *next = d->next;
        td_xfer_msg_free(d->ex_msg);
        free(d);
        d = next;
    }
    /* rank 0's transfer state borrows the channel: it goes first (the KV
     * memory with it) */
    td_xext_destroy(x->xext);
    td_ucx_destroy(x->ucx);
    for (int i = 0; i < x->n_inbox; i++) td_xfer_msg_free(x->inbox[i].m);
    free(x->inbox);
    if (x->wake_fd >= 0) close(x->wake_fd);
    if (x->link_fd >= 0) close(x->link_fd);
    free(x->ppeers);
    free(x->dns_addrs);
    free(x->dns_n);
    pthread_mutex_destroy(&x->mu);
    pthread_mutex_destroy(&x->in_mu);
    free(x->instance_id);
    free(x->token);
    free(x);
}

/* ================================================================= state */

td_status td_xfer_exchange(void *ctx, uint8_t **buf, size_t *len) {
    td_xfer *x = ctx;
    own_exchange oe;
    td_status st = build_exchange(x, &oe, x->exchange_id, -1);
    if (st) return st;
    cmsg m = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__INIT;
    Tandem__Internal__V1__Peer from = TANDEM__INTERNAL__V1__PEER__INIT;
    from.instance_id = x->instance_id;
    from.epoch = x->epoch;
    m.from = &from;
    m.cluster_token.data = (uint8_t *)x->token;
    m.cluster_token.len = x->token_len;
    m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_EXCHANGE;
    m.exchange = &oe.ex;
    size_t n = protobuf_c_message_get_packed_size(&m.base);
    *buf = malloc(n ? n : 1);
    if (!*buf) return TD_ERR_NOMEM;
    protobuf_c_message_pack(&m.base, *buf);
    *len = n;
    return TD_OK;
}

void td_xfer_stats_get(td_xfer *x, td_xfer_stats *st) {
    memset(st, 0, sizeof *st);
    td_sched_stats ss;
    td_sched_stats_get(x->p.sched, &ss);
    st->quarantined_blocks = ss.quarantined_blocks;
    pthread_mutex_lock(&x->mu);
    if (x->p.role == TD_XFER_PREFILL) {
        for (pjob *j = x->pjobs; j; j = j->next) {
            if (!j->replied) st->in_flight++;
            if (j->replied && !j->consumed) st->awaiting_consume++;
        }
        st->leased_blocks = ss.held_blocks;
    } else {
        for (djob *j = x->djobs; j; j = j->next)
            if (j->state == DJ_SENT) {
                st->in_flight++;
                st->leased_blocks += j->n_blocks;
            }
        for (int k = 0; k < x->n_ppeers; k++) st->linked_peers += x->ppeers[k].ready;
    }
    pthread_mutex_unlock(&x->mu);
    st->bytes_put = atomic_load(&x->bytes_put);
}

void td_xfer_gauges(td_xfer *x, td_metrics_gauges *g) {
    td_xfer_stats st;
    td_xfer_stats_get(x, &st);
    g->disagg = true;
    g->kv_leased = st.leased_blocks;
    g->kv_quarantined = st.quarantined_blocks;
    g->xfer_in_flight = st.in_flight;
}

char *td_xfer_state_json(void *ctx) {
    td_xfer *x = ctx;
    td_xfer_stats st;
    td_xfer_stats_get(x, &st);
    td_sched_stats ss;
    td_sched_stats_get(x->p.sched, &ss);
    json_t *peers = json_array();
    pthread_mutex_lock(&x->mu);
    for (int k = 0; peers && k < x->n_ppeers; k++) {
        const ppeer *pp = &x->ppeers[k];
        if (!pp->addr[0]) continue;
        /* another name of a linked P: that link's figures, under this name
         * too (the router looks its pairs up by its own names) */
        const ppeer *lk = !pp->ready && pp->alias_of > 0 ? &x->ppeers[pp->alias_of - 1] : pp;
        char ep[24];
        snprintf(ep, sizeof ep, "%016" PRIx64, lk->epoch);
        json_t *o = json_pack("{s:s,s:s,s:s,s:b,s:f,s:f}", "address", pp->addr, "instance_id",
                              lk->instance, "epoch", ep, "ready", (int)lk->ready, "transfer_ms_avg",
                              lk->avg_ms, "transfer_tail_ms_avg", lk->tail_ms);
        if (o && lk != pp) json_object_set_new(o, "alias_of", json_string(lk->addr));
        json_array_append_new(peers, o);
    }
    pthread_mutex_unlock(&x->mu);
    json_t *o =
        json_pack("{s:s,s:i,s:i,s:i,s:i,s:i,s:I,s:o}", "role",
                  x->p.role == TD_XFER_PREFILL ? "prefill" : "decode", "in_flight", st.in_flight,
                  "leased_blocks", st.leased_blocks, "quarantined_blocks", st.quarantined_blocks,
                  "held_blocks", ss.held_blocks, "awaiting_consume", st.awaiting_consume,
                  "bytes_put", (json_int_t)st.bytes_put, "peers", peers ? peers : json_array());
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return s;
}
