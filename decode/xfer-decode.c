/* The decode side of the KV transfer (xfer-decode.h; the protocol is
 * common/transfer/xfer.h's): remote-prefill admission (a KV import on every
 * request; at admission the prompt goes to a linked prefill instance, the
 * router's choice or round-robin, unless it is short or none is linked),
 * the links to prefill instances (their exchange over HTTP, our ranks'
 * link workers), probes, deadlines and leases, fencing with quarantine of
 * the blocks a fenced instance may still write, and the fallback to a
 * local prefill. The service thread runs the messages and passes under
 * x->mu; the link thread (link_main) what waits on a peer's HTTP endpoint
 * or on the ranks' step. */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "common/api/sampling.h"
#include "common/base/httpc.h"
#include "common/transfer/jobstate.h"
#include "common/transfer/xfer-impl.h"
#include "xfer-decode.h"

/* D's view of one P instance (named by its HTTP address; a slot whose
 * addr is "" is free). */
typedef struct ppeer {
    char addr[256];
    char instance[TD_XFER_ID_LEN];
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
    double busy_until; /* P said it could not start a job in time before then (its
                        * rejections: would miss the deadline, busy): new jobs go elsewhere */
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

/* A request on D with a KV import. */
typedef struct djob {
    struct djob *next; /* x->dc->djobs while in flight */
    atomic_int refs;   /* the scheduler's + the table's */
    struct td_xfer *x;
    char id[TD_XFER_ID_LEN];
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
    int32_t *blocks; /* its destination blocks (a copy: a rejected job is offered to another P) */
    uint64_t tried;  /* bit k: P slot k was offered the job */
    bool sent;       /* in the table: fsm is its state there */
    td_dj fsm;       /* jobstate.h: waiting, running, aborting, fencing, ended */
    int32_t n_blocks, n_cached;
    double t_sent;
    uint64_t deadline_unix_ns; /* P's start deadline as sent (for the Abort) */
    bool abort_pending;        /* the client went: the service thread sends the Abort */
    char want_peer[256];       /* the router's choice of prefill instance, or "" */
} djob;

/* The decode side's state (x->dc). */
struct td_xfer_decode {
    ppeer *ppeers;     /* (TD_XRANK_MAX_PEERS) */
    int n_ppeers;      /* slots in use or freed (x->mu) */
    td_net_watch *dns; /* the --prefill names, resolved on its own thread */
    int n_names;
    char (*dns_addrs)[TD_NET_ADDR_LEN]; /* a round taken from it (link thread) */
    int *dns_n;
    bool full_logged; /* "no free slot" said once */
    unsigned rr;
    djob *djobs;
    double next_lease;
    double last_pass;  /* the service thread's last pass */
    double hold_until; /* no job is given up before then (this process did not run) */
    /* the link thread (links to P, probes, the fences' link-worker
     * destruction: the calls that wait on HTTP or on the ranks' step) */
    int link_fd;
    pthread_t link_thread;
    bool link_started;
};

static void wake_link(td_xfer *x) {
    if (x->dc->link_fd < 0) return;
    uint64_t one = 1;
    ssize_t r = write(x->dc->link_fd, &one, sizeof one);
    TD_UNUSED(r);
}

static void on_peer_closed(void *ctx) {
    ppeer *pp = ctx;
    atomic_store(&pp->close_done, true);
}

static void djob_unref(djob *j) {
    if (atomic_fetch_sub(&j->refs, 1) != 1) return;
    free(j->tokens);
    free(j->bias);
    free(j->stop_ids);
    free(j->blocks);
    free(j);
}

static void d_release(void *ctx) { djob_unref(ctx); }

/* D's protocol times (jobstate.h) from the parameters: a started job is
 * given up after a lease of silence, and a job given up waits for P's
 * word a lease more after P's last lease ended. */
static td_dj_timing d_timing(const td_xfer *x) {
    td_dj_timing t = {.start_s = x->p.deadline_ms / 1000.0,
                      .lease_s = x->p.lease_ms / 1000.0,
                      .silence_s = x->p.lease_ms / 1000.0,
                      .grace_s = x->p.lease_ms / 1000.0,
                      .margin_s = 1.0};
    return t;
}

static void table_remove(td_xfer *x, djob *j) {
    for (djob **pp = &x->dc->djobs; *pp; pp = &(*pp)->next)
        if (*pp == j) {
            *pp = j->next;
            djob_unref(j);
            return;
        }
}

/* P's start deadline: ours less a margin, so that P has given the job up
 * by the time we do. */
static uint32_t p_deadline_ms(const td_xfer *x) {
    int margin = TD_MAX(50, x->p.deadline_ms / 10);
    return (uint32_t)TD_MAX(1, x->p.deadline_ms - margin);
}

/* Builds and sends j's PrefillRequest (its blocks, n_blocks, n_cached) to
 * peer pp. Caller holds x->mu. */
static td_status send_request(td_xfer *x, ppeer *pp, djob *j) {
    td_xfer_cmsg m = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__INIT;
    Tandem__Internal__V1__PrefillRequest r = TANDEM__INTERNAL__V1__PREFILL_REQUEST__INIT;
    Tandem__Internal__V1__RankBlocks rb[TD_COMM_MAX_RANKS], *rbp[TD_COMM_MAX_RANKS];
    td_xfer_own_exchange oe;
    r.request_id = j->id;
    r.n_tokens = (size_t)j->n_tokens;
    r.tokens = j->tokens;
    r.cached_tokens = (uint32_t)j->n_cached;
    /* every rank of this instance uses the same block ids */
    for (int k = 0; k < x->world; k++) {
        tandem__internal__v1__rank_blocks__init(&rb[k]);
        rb[k].rank = (uint32_t)k;
        rb[k].n_block_ids = (size_t)j->n_blocks;
        rb[k].block_ids = j->blocks;
        rbp[k] = &rb[k];
    }
    r.n_dest = (size_t)x->world;
    r.dest = rbp;
    if (pp->need_exchange) {
        td_status est = td_xfer_build_exchange(x, &oe, pp->exchange_id, (int)(pp - x->dc->ppeers));
        if (est) return est;
        r.peer_case = TANDEM__INTERNAL__V1__PREFILL_REQUEST__PEER_EXCHANGE;
        r.exchange = &oe.ex;
    } else {
        r.peer_case = TANDEM__INTERNAL__V1__PREFILL_REQUEST__PEER_EXCHANGE_ID;
        r.exchange_id = pp->exchange_id;
    }
    r.deadline_ms = p_deadline_ms(x);
    r.deadline_unix_ns = td_xfer_unix_ns() + (uint64_t)r.deadline_ms * 1000000ull;
    j->deadline_unix_ns = r.deadline_unix_ns;
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
    td_status st = td_xfer_send(x, pp->ep, &m);
    td_sampling_proto_free(&sp);
    return st;
}

/* Whether a --prefill name resolves to P instance c, under its own
 * address or one that is an alias of it. Caller holds x->mu. */
static bool peer_resolved(td_xfer *x, const ppeer *c) {
    if (c->dns_names) return true;
    int k = (int)(c - x->dc->ppeers) + 1;
    for (int i = 0; i < x->dc->n_ppeers; i++)
        if (x->dc->ppeers[i].alias_of == k && x->dc->ppeers[i].dns_names) return true;
    return false;
}

/* Whether P instance c can take a job now. Caller holds x->mu. */
static bool peer_usable(ppeer *c) {
    return c->ready && c->ep && !c->fence && !c->closing && !atomic_load(&c->err);
}

/* The P instance for job j: the router's choice, else D's own
 * round-robin over the linked P, leaving out one that has left every
 * --prefill name (a pod draining away) unless the router still names it,
 * and never one already offered the job or one that said it is saturated
 * (*saturated: a usable P was left out for that). Caller holds x->mu. */
static ppeer *choose_peer(td_xfer *x, djob *j, double now, bool *saturated) {
    *saturated = false;
    for (int k = 0; k < x->dc->n_ppeers && j->want_peer[0]; k++) {
        ppeer *c = &x->dc->ppeers[k];
        if (strcmp(c->addr, j->want_peer) != 0) continue;
        if (!c->ready && c->alias_of > 0) c = &x->dc->ppeers[c->alias_of - 1];
        if (!peer_usable(c) || (j->tried >> (c - x->dc->ppeers)) & 1) continue;
        if (now < c->busy_until)
            *saturated = true;
        else
            return c;
    }
    for (int k = 0; k < x->dc->n_ppeers; k++) {
        ppeer *c = &x->dc->ppeers[(x->dc->rr + (unsigned)k) % (unsigned)x->dc->n_ppeers];
        if (x->dc->n_names > 0 && !peer_resolved(x, c) &&
            !(c->last_named > 0 && now - c->last_named < x->p.forget_ms / 1000.0))
            continue;
        if (!peer_usable(c) || (j->tried >> (c - x->dc->ppeers)) & 1) continue;
        if (now < c->busy_until) {
            *saturated = true;
            continue;
        }
        x->dc->rr++;
        return c;
    }
    return NULL;
}

/* Sends job j to P pp and starts its state there (a first offer, or
 * another P after a refusal). Caller holds x->mu, so no answer is taken
 * before the state is set. */
static td_status offer(td_xfer *x, djob *j, ppeer *pp, double now) {
    td_status st = send_request(x, pp, j);
    if (st != TD_OK) return st;
    pp->need_exchange = false;
    j->peer = pp;
    j->tried |= 1ull << (pp - x->dc->ppeers);
    j->t_sent = now;
    td_dj_timing tm = d_timing(x);
    td_dj_sent(&j->fsm, &tm, now);
    return TD_OK;
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
    int32_t *copy = malloc((size_t)n_blocks * sizeof *copy);
    if (!copy) {
        td_metrics_prefill_route(x->p.metrics, false, TD_LOCAL_PREFILL_NO_PEER);
        return false;
    }
    memcpy(copy, blocks, (size_t)n_blocks * sizeof *copy);
    free(j->blocks);
    j->blocks = copy;
    pthread_mutex_lock(&x->mu);
    bool saturated = false;
    ppeer *pp = choose_peer(x, j, td_time_s(), &saturated);
    if (!pp) {
        pthread_mutex_unlock(&x->mu);
        td_metrics_prefill_route(x->p.metrics, false,
                                 saturated ? TD_LOCAL_PREFILL_SATURATED : TD_LOCAL_PREFILL_NO_PEER);
        return false;
    }
    /* In the table before the request leaves, so its answer finds it. */
    j->sent = true;
    j->n_blocks = n_blocks;
    j->n_cached = n_cached;
    atomic_fetch_add(&j->refs, 1);
    j->next = x->dc->djobs;
    x->dc->djobs = j;
    td_status st = offer(x, j, pp, td_time_s());
    if (st != TD_OK) {
        table_remove(x, j);
        j->sent = false;
        pthread_mutex_unlock(&x->mu);
        TD_LOG_WARN("request %s: sending the prefill request to %s failed (%s): prefilling here",
                    j->id, pp->addr, td_status_str(st));
        td_metrics_prefill_route(x->p.metrics, false, TD_LOCAL_PREFILL_NO_PEER);
        return false;
    }
    pthread_mutex_unlock(&x->mu);
    td_metrics_prefill_route(x->p.metrics, true, TD_LOCAL_PREFILL_COUNT);
    return true;
}

static void d_cancelled(void *ctx, td_sched_ticket t) {
    djob *j = ctx;
    td_xfer *x = j->x;
    pthread_mutex_lock(&x->mu);
    if (j->sent && td_dj_live(&j->fsm)) {
        /* Abort; the blocks are held until P's word (or the fence) */
        td_dj_timing tm = d_timing(x);
        j->abort_pending = td_dj_cancel(&j->fsm, &tm, td_time_s()) & TD_DJ_ABORT;
        td_metrics_kv_transfer_failure(x->p.metrics, TD_XFER_FAIL_ABORTED);
    } else if (j->sent && j->fsm.state == TD_DJ_ENDED) {
        /* P's answer came first (its event was still queued): nothing
         * writes into the blocks any more */
        td_sched_release(x->p.sched, t);
    }
    pthread_mutex_unlock(&x->mu);
    td_xfer_wake(x);
}

/* The slot of P instance addr, added (in a free slot) when new; NULL when
 * every slot is taken. *added: it was new. Caller holds x->mu. */
static ppeer *peer_get(td_xfer *x, const char *addr, const char *why, bool *added) {
    *added = false;
    int free_k = -1;
    for (int k = 0; k < x->dc->n_ppeers; k++) {
        if (!strcmp(x->dc->ppeers[k].addr, addr)) return &x->dc->ppeers[k];
        if (!x->dc->ppeers[k].addr[0] && free_k < 0) free_k = k;
    }
    if (free_k < 0 && x->dc->n_ppeers < TD_XRANK_MAX_PEERS) free_k = x->dc->n_ppeers++;
    if (free_k < 0) {
        if (!x->dc->full_logged)
            TD_LOG_WARN("prefill instance %s (%s) left out: %d prefill instances known already",
                        addr, why, TD_XRANK_MAX_PEERS);
        x->dc->full_logged = true;
        return NULL;
    }
    /* a free slot's link workers are closed and no job refers to it */
    ppeer *pp = &x->dc->ppeers[free_k];
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

/* The front ends' hook: every request gets a KV import (d_start decides
 * at admission whether it prefills remotely). */
static void d_submit(td_xfer *x, td_gen_request *g) {
    if (g->n_prompt < 1) return;
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
    for (djob *j = x->dc->djobs; j; j = j->next)
        if (strcmp(j->id, id) == 0 && j->peer && j->peer->epoch == from->epoch &&
            strcmp(j->peer->instance, from->instance_id) == 0)
            return j;
    return NULL;
}

/* Sends a body-only message (TransferConsumed, Abort) about j. */
static void d_notify(td_xfer *x, djob *j, bool abort) {
    td_xfer_cmsg m = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__INIT;
    Tandem__Internal__V1__TransferConsumed tc = TANDEM__INTERNAL__V1__TRANSFER_CONSUMED__INIT;
    Tandem__Internal__V1__Abort ab = TANDEM__INTERNAL__V1__ABORT__INIT;
    if (abort) {
        ab.request_id = j->id;
        ab.message = j->fsm.gone ? "cancelled" : "given up";
        ab.deadline_unix_ns = j->deadline_unix_ns;
        m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_ABORT;
        m.abort = &ab;
    } else {
        tc.request_id = j->id;
        m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_TRANSFER_CONSUMED;
        m.transfer_consumed = &tc;
    }
    td_xfer_send(x, j->peer->ep, &m);
}

/* Carries out what D's job machine decided (jobstate.h), and takes an
 * ended job out of the table. Caller holds x->mu. */
static void d_apply(td_xfer *x, djob *j, int a) {
    if (a & (TD_DJ_LOCAL | TD_DJ_LOCAL_FRESH))
        td_metrics_prefill_route(x->p.metrics, false, TD_LOCAL_PREFILL_FALLBACK);
    /* LOCAL: nothing writes into the blocks (P rejected it, or flushed and
     * stopped); LOCAL_FRESH: P may still, so they stay held */
    if (a & TD_DJ_LOCAL)
        td_sched_remote_failed(x->p.sched, j->ticket, false, true, TD_ERR_UNAVAILABLE);
    if (a & TD_DJ_LOCAL_FRESH)
        td_sched_remote_failed(x->p.sched, j->ticket, true, true, TD_ERR_UNAVAILABLE);
    if (a & TD_DJ_RELEASE) td_sched_release(x->p.sched, j->ticket);
    if (a & TD_DJ_ABORT) d_notify(x, j, true);
    if (a & TD_DJ_FENCE) {
        TD_LOG_WARN("request %s: prefill instance %s did not answer its abort within the grace: "
                    "fencing it",
                    j->id, j->peer->addr);
        td_metrics_kv_transfer_failure(x->p.metrics, TD_XFER_FAIL_PEER_ERROR);
        j->peer->fence = true;
    }
    if (j->fsm.state == TD_DJ_ENDED) table_remove(x, j);
}

/* P's first token: the sequence decodes on. Caller holds x->mu. */
static void d_take_answer(td_xfer *x, djob *j, const Tandem__Internal__V1__PrefillDone *pd,
                          const td_xfer_inbox_msg *im) {
    double now = im->arrival_s;
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
    td_sched_remote_done(x->p.sched, j->ticket, &r, pd->sampler_state.data, pd->sampler_state.len,
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

/* P refused job j (nothing written): what the refusal says of P's queue,
 * and the job offered to another P that has not refused it and does not
 * say it is saturated. Returns true when it went there (the table keeps
 * it); false: the caller prefills it here. Caller holds x->mu. */
static bool d_rejected(td_xfer *x, djob *j, const Tandem__Internal__V1__PrefillRejected *r, int a,
                       double now) {
    ppeer *from = j->peer;
    switch (r->reason) {
    case TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_UNKNOWN_EXCHANGE:
        from->need_exchange = true;
        break;
    case TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_WOULD_MISS_DEADLINE: {
        /* its queue starts a job in expected_start_ms, past the deadline D
         * gives: saturated until that much of it has drained */
        double over = ((double)r->expected_start_ms - p_deadline_ms(x)) / 1e3;
        from->busy_until = TD_MAX(from->busy_until, now + TD_MAX(over, 0.1));
        break;
    }
    case TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_BUSY:
        from->busy_until = TD_MAX(from->busy_until, now + r->retry_after_ms / 1e3);
        break;
    default: break;
    }
    if (!(a & TD_DJ_LOCAL)) return false;
    bool saturated;
    ppeer *to = choose_peer(x, j, now, &saturated);
    if (!to) return false;
    /* the same job (id, blocks) to another P: a new deadline from now */
    if (offer(x, j, to, now) != TD_OK) return false;
    TD_LOG_INFO("request %s: offered to prefill instance %s instead", j->id, to->addr);
    td_metrics_kv_transfer_failure(x->p.metrics, TD_XFER_FAIL_REJECTED);
    return true;
}

static void d_on_msg(td_xfer *x, const td_xfer_inbox_msg *im) {
    td_xfer_msg *m = im->m;
    const char *id = NULL, *text = NULL, *what = NULL;
    td_dj_msg k;
    int32_t tokens = 0;
    switch (m->body_case) {
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_DONE:
        id = m->prefill_done->request_id;
        k = TD_DJ_MSG_DONE;
        break;
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_REJECTED:
        id = m->prefill_rejected->request_id;
        text = m->prefill_rejected->message;
        what = "rejected it";
        k = TD_DJ_MSG_REJECTED;
        break;
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_TRANSFER_FAILED:
        id = m->transfer_failed->request_id;
        text = m->transfer_failed->message;
        what = "failed it";
        k = TD_DJ_MSG_FAILED;
        break;
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_JOB_PROGRESS:
        id = m->job_progress->request_id;
        tokens = (int32_t)m->job_progress->tokens;
        k = TD_DJ_MSG_PROGRESS;
        break;
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_JOB_ABORTED:
        id = m->job_aborted->request_id;
        text = m->job_aborted->message;
        what = "stopped it";
        k = TD_DJ_MSG_ABORTED;
        break;
    default:
        TD_LOG_INFO("decode: ignoring control message %d from %s", (int)m->body_case,
                    m->from->instance_id);
        td_xfer_msg_free(m);
        return;
    }
    djob *j = djob_find(x, id, m->from);
    td_dj_state was = j ? j->fsm.state : TD_DJ_ENDED;
    if (!j || was == TD_DJ_FENCING) {
        /* late (fenced, or after P's word) or unknown: nothing to do */
        if (k != TD_DJ_MSG_PROGRESS)
            TD_LOG_INFO("decode: answer for %s from %s ignored (not in flight)", id,
                        m->from->instance_id);
        td_xfer_msg_free(m);
        return;
    }
    td_dj_timing tm = d_timing(x);
    int a = td_dj_on_msg(&j->fsm, &tm, k, tokens, im->arrival_s);
    if (what)
        TD_LOG_INFO("request %s: prefill instance %s %s: %s", j->id, j->peer->addr, what, text);
    if (k == TD_DJ_MSG_REJECTED && d_rejected(x, j, m->prefill_rejected, a, im->arrival_s)) {
        td_xfer_msg_free(m); /* offered to another P */
        return;
    }
    if (was == TD_DJ_ABORTING && k == TD_DJ_MSG_DONE)
        TD_LOG_INFO("request %s: prefill instance %s answered after it was given up: blocks freed",
                    j->id, j->peer->addr);
    if (a & TD_DJ_LOCAL)
        td_metrics_kv_transfer_failure(x->p.metrics, k == TD_DJ_MSG_REJECTED ? TD_XFER_FAIL_REJECTED
                                                                             : TD_XFER_FAIL_FAILED);
    if (a & TD_DJ_DECODE) d_take_answer(x, j, m->prefill_done, im);
    if (k == TD_DJ_MSG_DONE && (a & (TD_DJ_DECODE | TD_DJ_RELEASE)))
        d_notify(x, j, false); /* TransferConsumed: P may release its side */
    d_apply(x, j, a);
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
                       .max_body = TD_XFER_EXCHANGE_LIMIT};
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
    if (fenced) td_xfer_wake(x);
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
        for (int k = 0; k < x->dc->n_ppeers && !same; k++) {
            ppeer *c = &x->dc->ppeers[k];
            if (c != pp && c->ready && !c->fence && c->epoch == m->from->epoch &&
                strcmp(c->instance, m->from->instance_id) == 0)
                same = k + 1;
        }
        if (same && pp->alias_of != same)
            TD_LOG_INFO("prefill instance %s is %s (%s): one link for both", pp->addr,
                        x->dc->ppeers[same - 1].addr, m->from->instance_id);
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
    if (st == TD_OK && (st = td_xext_link(x->xext, (int)(pp - x->dc->ppeers), true))) {
        snprintf(err, sizeof err, "%s: our KV link workers could not be opened", pp->addr);
        td_xext_link(x->xext, (int)(pp - x->dc->ppeers), false); /* the ranks that did */
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
    td_dj_timing tm = d_timing(x);
    /* Passes come every few ms. A long gap means this process did not run
     * (stopped, starved): the silence it measured is its own, and P's
     * messages of that time are still arriving, so no job is given up on
     * for a moment. */
    if (x->dc->last_pass > 0 && now - x->dc->last_pass > 0.5) {
        TD_LOG_WARN("decode: no service pass for %.1f s (this process was stopped or starved): "
                    "no job is given up on for 250 ms",
                    now - x->dc->last_pass);
        x->dc->hold_until = now + 0.25;
    }
    x->dc->last_pass = now;
    bool hold = now < x->dc->hold_until;
    for (djob *j = x->dc->djobs, *next; j; j = next) {
        next = j->next; /* d_apply may take j out */
        if (j->abort_pending) {
            j->abort_pending = false;
            d_notify(x, j, true);
        }
        td_dj_state was = j->fsm.state;
        int a = hold ? 0 : td_dj_tick(&j->fsm, &tm, now);
        if (a & TD_DJ_ABORT) {
            td_metrics_kv_transfer_failure(x->p.metrics, TD_XFER_FAIL_DEADLINE);
            if (was == TD_DJ_WAITING)
                TD_LOG_WARN("request %s: prefill instance %s did not start it within %d ms: "
                            "aborting it there, prefilling here",
                            j->id, j->peer->addr, x->p.deadline_ms);
            else
                TD_LOG_WARN("request %s: no word from prefill instance %s for %d ms (%d prompt "
                            "tokens started): aborting it there, prefilling here",
                            j->id, j->peer->addr, x->p.lease_ms, j->fsm.tokens);
        }
        d_apply(x, j, a);
    }
    for (int k = 0; k < x->dc->n_ppeers; k++) {
        ppeer *pp = &x->dc->ppeers[k];
        if (atomic_load(&pp->err) && pp->ep && !pp->fence) {
            TD_LOG_WARN("prefill instance %s: endpoint error: fencing it", pp->addr);
            td_metrics_kv_transfer_failure(x->p.metrics, TD_XFER_FAIL_PEER_ERROR);
            pp->fence = true;
        }
        if (pp->fence && !pp->closing) {
            /* Every job still on this P is fenced: a waiting one falls back
             * to a local prefill in fresh blocks; the blocks are freed once
             * our endpoint to it is closed and its last lease has passed. */
            for (djob *j = x->dc->djobs, *next; j; j = next) {
                next = j->next;
                if (j->peer == pp) d_apply(x, j, td_dj_fenced(&j->fsm));
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
             * before). The blocks stay until P's last lease has surely
             * passed too (P's own puts into shared memory are bounded by it). */
            pp->closing = false;
            pp->fence = false;
            pp->next_link = now;
            pp->unlinked_since = now;
            TD_LOG_INFO("prefill instance %s fenced", pp->addr);
        }
    }
    for (djob *j = x->dc->djobs, *next; j; j = next) {
        next = j->next;
        if (j->fsm.state == TD_DJ_FENCING && !j->peer->closing && !j->peer->fence)
            d_apply(x, j, td_dj_fence_done(&j->fsm, &tm, now));
    }
    if (now >= x->dc->next_lease) {
        x->dc->next_lease = now + x->p.lease_ms / 3000.0;
        for (int k = 0; k < x->dc->n_ppeers; k++) {
            ppeer *pp = &x->dc->ppeers[k];
            if (!pp->ready || !pp->ep) continue;
            char *ids[256];
            size_t n = 0;
            for (djob *j = x->dc->djobs;; j = j->next) {
                /* the jobs D still waits for: their leases run on */
                if (j && j->peer == pp && td_dj_renew(&j->fsm, &tm, now)) ids[n++] = j->id;
                if ((!j && n > 0) || n == 256) { /* a message per 256 ids */
                    td_xfer_cmsg m = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__INIT;
                    Tandem__Internal__V1__LeaseRenewal lr =
                        TANDEM__INTERNAL__V1__LEASE_RENEWAL__INIT;
                    lr.n_request_ids = n;
                    lr.request_ids = ids;
                    lr.lease_ms = (uint32_t)x->p.lease_ms;
                    lr.until_unix_ns = td_xfer_unix_ns() + (uint64_t)x->p.lease_ms * 1000000ull;
                    m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_LEASE_RENEWAL;
                    m.lease_renewal = &lr;
                    td_xfer_send(x, pp->ep, &m);
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
    int n_peers = x->dc->n_ppeers;
    pthread_mutex_unlock(&x->mu);
    for (int k = 0; k < n_peers; k++) {
        ppeer *pp = &x->dc->ppeers[k];
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
        if (!st) td_xfer_wake(x);
    }
}

/* Takes the latest round of the --prefill names (resolved on the watch's
 * thread: the link thread never waits on DNS): every address is a P
 * instance. A name that did not resolve this round keeps what it had; an
 * address that left every name is forgotten later (d_forget), once
 * unlinked. Link thread. */
static void d_take_dns(td_xfer *x) {
    if (!x->dc->dns || !td_net_watch_take(x->dc->dns, x->dc->dns_addrs, x->dc->dns_n)) return;
    bool added_any = false;
    pthread_mutex_lock(&x->mu);
    for (int i = 0; i < x->dc->n_names; i++) {
        if (x->dc->dns_n[i] < 0) continue;
        uint64_t bit = 1ull << i;
        for (int k = 0; k < x->dc->n_ppeers; k++) x->dc->ppeers[k].dns_names &= ~bit;
        for (int a = 0; a < x->dc->dns_n[i]; a++) {
            bool added = false;
            ppeer *pp =
                peer_get(x, x->dc->dns_addrs[i * TD_XRANK_MAX_PEERS + a], "resolved", &added);
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
    for (int k = 0; k < x->dc->n_ppeers; k++) {
        ppeer *pp = &x->dc->ppeers[k];
        if (!pp->addr[0] || pp->dns_names || pp->ready || pp->fence || pp->closing ||
            pp->link_open || pp->link_close_owed || pp->ep ||
            (pp->last_named > 0 && now - pp->last_named < after) ||
            now - pp->unlinked_since < after)
            continue;
        bool held = false;
        for (djob *j = x->dc->djobs; j && !held; j = j->next) held = j->peer == pp;
        if (held) continue;
        TD_LOG_INFO("prefill instance %s forgotten (unlinked for %.0f s, no longer resolved or "
                    "named)",
                    pp->addr, now - pp->unlinked_since);
        pp->addr[0] = 0;
        pp->alias_of = 0;
        for (int i = 0; i < x->dc->n_ppeers; i++)
            if (x->dc->ppeers[i].alias_of == k + 1) x->dc->ppeers[i].alias_of = 0;
        x->dc->full_logged = false;
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
            struct pollfd pfd = {.fd = x->dc->link_fd, .events = POLLIN};
            poll(&pfd, 1, 50);
            uint64_t v;
            ssize_t r = read(x->dc->link_fd, &v, sizeof v);
            TD_UNUSED(r);
        }
        d_fence_links(x);
        d_take_dns(x);
        d_forget(x);
        double now = td_time_s();
        pthread_mutex_lock(&x->mu);
        int n_peers = x->dc->n_ppeers; /* grows with the router's choices */
        pthread_mutex_unlock(&x->mu);
        for (int k = 0; k < n_peers && !atomic_load(&x->stop); k++) {
            ppeer *pp = &x->dc->ppeers[k];
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

/* ================================================================= side */

static td_status d_init(td_xfer *x, const td_xfer_params *p) {
    if (p->n_prefill < 0 || p->n_prefill > TD_XRANK_MAX_PEERS || p->dns_interval_ms < 1 ||
        p->forget_ms < 1) {
        TD_LOG_ERROR("at most %d prefill names, intervals of at least 1 ms", TD_XRANK_MAX_PEERS);
        return TD_ERR_INVALID;
    }
    x->dc = calloc(1, sizeof *x->dc);
    if (!x->dc) return TD_ERR_NOMEM;
    x->dc->link_fd = -1;
    x->dc->ppeers = calloc(TD_XRANK_MAX_PEERS, sizeof *x->dc->ppeers);
    if (!x->dc->ppeers) return TD_ERR_NOMEM;
    x->dc->n_names = p->n_prefill;
    /* IP addresses are instances from the start (no DNS to wait for);
     * names follow from the watch */
    for (int i = 0; i < p->n_prefill; i++) {
        char host[256], port[16], ip[16], addr[1][TD_NET_ADDR_LEN], err[400];
        if (!p->prefill[i] || !td_net_split(p->prefill[i], host, sizeof host, port, sizeof port)) {
            TD_LOG_ERROR("prefill instance '%s' is not HOST:PORT",
                         p->prefill[i] ? p->prefill[i] : "(null)");
            return TD_ERR_INVALID;
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
    td_xfer_decode *dc = x->dc;
    dc->link_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (dc->link_fd < 0) {
        TD_LOG_ERROR("eventfd: %s", strerror(errno));
        return TD_ERR_IO;
    }
    if (dc->n_names > 0) {
        /* before the link thread, which reads these: the first
         * resolutions start now, each result wakes the link thread */
        dc->dns_addrs = calloc((size_t)dc->n_names * TD_XRANK_MAX_PEERS, sizeof *dc->dns_addrs);
        dc->dns_n = calloc((size_t)dc->n_names, sizeof *dc->dns_n);
        td_net_watch_params wp = {.names = p->prefill,
                                  .n_names = p->n_prefill,
                                  .max_addrs = TD_XRANK_MAX_PEERS,
                                  .interval_ms = p->dns_interval_ms,
                                  .wake_fd = dc->link_fd,
                                  .what = "prefill instances"};
        td_status st =
            !dc->dns_addrs || !dc->dns_n ? TD_ERR_NOMEM : td_net_watch_create(&wp, &dc->dns);
        if (st != TD_OK) {
            TD_LOG_ERROR("the prefill names cannot be watched: %s", td_status_str(st));
            return st;
        }
    }
    return TD_OK;
}

/* The link thread. */
static td_status d_start_threads(td_xfer *x) {
    if (pthread_create(&x->dc->link_thread, NULL, link_main, x) != 0) return TD_ERR_IO;
    x->dc->link_started = true;
    return TD_OK;
}

static void d_on_inbox(td_xfer *x, const td_xfer_inbox_msg *im) { d_on_msg(x, im); }

static bool d_pass(td_xfer *x, bool *answer_waits) {
    *answer_waits = false;
    d_service(x);
    return false;
}

static void d_ep_failed(void *user) { atomic_store(&((ppeer *)user)->err, true); }

static void d_stop(td_xfer *x) {
    if (!x->dc) return;
    if (x->dc->link_started) {
        wake_link(x);
        pthread_join(x->dc->link_thread, NULL);
    }
    td_net_watch_destroy(x->dc->dns); /* does not wait on a resolution under way */
    x->dc->dns = NULL;
}

static int d_take_endpoints(td_xfer *x, td_ucx_ep **eps, int max) {
    int n = 0;
    for (int k = 0; x->dc && k < x->dc->n_ppeers; k++) {
        ppeer *pp = &x->dc->ppeers[k];
        if (pp->ep && n < max) eps[n++] = pp->ep;
        pp->ep = NULL;
        pp->ready = false;
    }
    return n;
}

static void d_free(td_xfer *x) {
    td_xfer_decode *dc = x->dc;
    if (!dc) return;
    for (djob *j = dc->djobs; j;) {
        djob *next = j->next;
        djob_unref(j);
        j = next;
    }
    if (dc->link_fd >= 0) close(dc->link_fd);
    free(dc->ppeers);
    free(dc->dns_addrs);
    free(dc->dns_n);
    free(dc);
    x->dc = NULL;
}

static void d_stats(td_xfer *x, const td_sched_stats *ss, td_xfer_stats *st) {
    TD_UNUSED(ss);
    for (djob *j = x->dc->djobs; j; j = j->next)
        if (td_dj_live(&j->fsm)) {
            st->in_flight++;
            st->leased_blocks += j->n_blocks;
        }
    for (int k = 0; k < x->dc->n_ppeers; k++) st->linked_peers += x->dc->ppeers[k].ready;
}

static void d_peers_json(td_xfer *x, json_t *peers) {
    for (int k = 0; k < x->dc->n_ppeers; k++) {
        const ppeer *pp = &x->dc->ppeers[k];
        if (!pp->addr[0]) continue;
        /* another name of a linked P: that link's figures, under this name
         * too (the router looks its pairs up by its own names) */
        const ppeer *lk = !pp->ready && pp->alias_of > 0 ? &x->dc->ppeers[pp->alias_of - 1] : pp;
        char ep[24];
        snprintf(ep, sizeof ep, "%016" PRIx64, lk->epoch);
        json_t *o = json_pack("{s:s,s:s,s:s,s:b,s:f,s:f}", "address", pp->addr, "instance_id",
                              lk->instance, "epoch", ep, "ready", (int)lk->ready, "transfer_ms_avg",
                              lk->avg_ms, "transfer_tail_ms_avg", lk->tail_ms);
        if (o && lk != pp) json_object_set_new(o, "alias_of", json_string(lk->addr));
        json_array_append_new(peers, o);
    }
}

const td_xfer_side td_xfer_decode_side = {.name = "decode",
                                          .init = d_init,
                                          .start = d_start_threads,
                                          .on_msg = d_on_inbox,
                                          .service = d_pass,
                                          .ep_failed = d_ep_failed,
                                          .stop = d_stop,
                                          .take_endpoints = d_take_endpoints,
                                          .free = d_free,
                                          .stats = d_stats,
                                          .peers_json = d_peers_json,
                                          .submit = d_submit};
