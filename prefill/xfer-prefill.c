/* The prefill side of the KV transfer (xfer-prefill.h; the protocol is
 * common/transfer/xfer.h's): decode instances link by sending their
 * exchange inline, each PrefillRequest becomes a job in this instance's
 * scheduler whose KV every rank puts into the decode instance's blocks as
 * it is computed (xrank.h), PrefillDone goes once every rank has flushed,
 * and the source blocks are released once D sent TransferConsumed (or the
 * lease ran out). Failures answer with PrefillRejected (nothing written)
 * or TransferFailed (flushed, stopped). Runs on the service thread under
 * x->mu, as xfer-impl.h says. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/api/sampling.h"
#include "common/transfer/jobstate.h"
#include "common/transfer/xfer-impl.h"
#include "xfer-prefill.h"

/* P's view of one D incarnation. */
typedef struct dpeer {
    struct dpeer *next;
    char instance[TD_XFER_ID_LEN];
    uint64_t epoch;
    uint64_t exchange_id;
    td_xfer_msg *ex_msg; /* the message that carried the exchange (owned) */
    const td_xfer_exchange_msg *ex;
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
    char id[TD_XFER_ID_LEN];
    td_gen_stream *st;
    td_sched_ticket ticket;
    int32_t slot; /* job slot on the ranks */
    int32_t n_prompt, d_cached;
    td_pj pj;          /* its start deadline and lease (jobstate.h) */
    double t_recv;     /* when it arrived */
    double hold_until; /* answered: its sources are held for D's TransferConsumed until then */
    int32_t progress;  /* a chunk through this position is starting: JobProgress owed */
    const char *why;   /* why P stopped it (TransferFailed's message) */
    bool late;         /* ... for its start deadline or its lease (the deadline failure) */
    bool ended, have_first, cancelled, replied, dropped, ok, consumed;
    td_sample_result first;
    uint8_t sstate[TD_SAMPLER_STATE_BYTES];
} pjob;

/* The prefill side's state (x->pf). */
struct td_xfer_prefill {
    dpeer *dpeers;
    pjob *pjobs;
    td_xfer_seen
        *seen; /* every request id taken or refused, and aborted ones, until their deadline */
    bool job_slot_used[TD_XRANK_MAX_JOBS];
    bool peer_slot_used[TD_XRANK_MAX_PEERS];
};

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
    if (d->ep) td_ucx_ep_close_flushed(d->ep, TD_UCX_CLOSE_FORCE_MS);
    d->ep = NULL;
    d->closed = true;
    if (d->slot >= 0) {
        td_xdir_buf b = {0};
        td_xdir_unpeer(&b, d->slot);
        td_xext_post(x->xext, &b);
        td_xdir_free(&b);
        x->pf->peer_slot_used[d->slot] = false;
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
    td_xfer_wake(x);
}

/* The scheduler starts a chunk of the job: D hears of it (JobProgress). */
static void p_progress(void *ctx, td_sched_ticket t, int32_t through) {
    pjob *j = ctx;
    td_xfer *x = j->x;
    TD_UNUSED(t);
    pthread_mutex_lock(&x->mu);
    j->pj.started = true;
    j->progress = TD_MIN(through, j->n_prompt);
    pthread_mutex_unlock(&x->mu);
    td_xfer_wake(x);
}

/* PrefillRejected to D; start_ms: when our queue would let the job start
 * (REJECT_WOULD_MISS_DEADLINE; also the retry hint), else 0. */
static void p_reject_at(td_xfer *x, dpeer *d, const char *id,
                        Tandem__Internal__V1__RejectReason why, const char *msg,
                        uint32_t start_ms) {
    TD_LOG_INFO("prefill %s rejected: %s", id, msg);
    if (!d || !d->ep) return; /* no way back: D's deadline covers it */
    td_xfer_cmsg m = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__INIT;
    Tandem__Internal__V1__PrefillRejected r = TANDEM__INTERNAL__V1__PREFILL_REJECTED__INIT;
    r.request_id = (char *)id;
    r.reason = why;
    r.message = (char *)msg;
    r.retry_after_ms = why == TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_BUSY ? 100 : start_ms;
    r.expected_start_ms = start_ms;
    m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_REJECTED;
    m.prefill_rejected = &r;
    td_xfer_send(x, d->ep, &m);
}

static void p_reject(td_xfer *x, dpeer *d, const char *id, Tandem__Internal__V1__RejectReason why,
                     const char *msg) {
    p_reject_at(x, d, id, why, msg, 0);
}

/* Whether the queue of our scheduler (its prompt tokens not yet computed,
 * at the prefill speed its steps measured) would not let this job start
 * before its deadline: then D is told at once, with when it could start,
 * instead of waiting for a job that cannot start in time. No speed
 * measured yet: the job is taken. */
static bool would_miss(td_xfer *x, double deadline_s, uint32_t *start_ms, char *why,
                       size_t why_len) {
    td_sched_stats ss;
    td_sched_stats_get(x->p.sched, &ss);
    double start;
    if (!td_xfer_would_miss(ss.queued_prefill_tokens, ss.prefill_tokens_per_s, deadline_s, &start))
        return false;
    *start_ms = (uint32_t)TD_MIN(start * 1e3, 600000.0);
    snprintf(why, why_len,
             "would miss its deadline (%.0f ms): %lld queued prompt tokens at %.0f tokens/s start "
             "it in %u ms",
             deadline_s * 1e3, (long long)ss.queued_prefill_tokens, ss.prefill_tokens_per_s,
             *start_ms);
    return true;
}

/* What is left at now of a time D gave both as a relative span (from
 * receipt) and as a point on its clock (Unix ns; 0: none): the earlier. */
static double left_s(uint32_t rel_ms, uint64_t unix_ns) {
    double left = rel_ms / 1000.0;
    if (unix_ns) left = TD_MIN(left, ((double)unix_ns - (double)td_xfer_unix_ns()) * 1e-9);
    return left;
}

static dpeer *dpeer_find(td_xfer *x, const char *inst, uint64_t epoch) {
    for (dpeer *d = x->pf->dpeers; d; d = d->next)
        if (d->epoch == epoch && !d->closed && !d->superseded && !atomic_load(&d->failed) &&
            strcmp(d->instance, inst) == 0)
            return d;
    return NULL;
}

/* A new D incarnation (or a new exchange of a known one) from an inline
 * exchange: the control endpoint to its rank 0, and a PEER directive that
 * gives every rank its endpoints. Takes ownership of m on success. Caller
 * holds x->mu. */
static dpeer *dpeer_new(td_xfer *x, td_xfer_msg *m, const td_xfer_exchange_msg *ex) {
    int32_t slot = slot_take(x->pf->peer_slot_used, TD_XRANK_MAX_PEERS);
    if (slot < 0) {
        /* the oldest closed-or-idle record gives its slot back */
        for (dpeer *o = x->pf->dpeers; o && slot < 0; o = o->next) {
            bool busy = false;
            for (pjob *j = x->pf->pjobs; j; j = j->next) busy |= j->peer == o;
            if (!busy && o->slot >= 0) {
                dpeer_close(x, o);
                slot = slot_take(x->pf->peer_slot_used, TD_XRANK_MAX_PEERS);
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
        x->pf->peer_slot_used[slot] = false;
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
        x->pf->peer_slot_used[slot] = false;
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
    for (dpeer *o = x->pf->dpeers; o; o = o->next)
        if (!o->closed && o->epoch == d->epoch && strcmp(o->instance, d->instance) == 0)
            o->superseded = true;
    d->next = x->pf->dpeers;
    x->pf->dpeers = d;
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
    if (j->slot >= 0) x->pf->job_slot_used[j->slot] = false;
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

static pjob *pjob_find(td_xfer *x, const char *id, const td_xfer_msg *m) {
    for (pjob *j = x->pf->pjobs; j; j = j->next)
        if (strcmp(j->id, id) == 0 && j->peer->epoch == m->from->epoch &&
            strcmp(j->peer->instance, m->from->instance_id) == 0)
            return j;
    return NULL;
}

/* PrefillRequest from D. Takes ownership of m. Caller holds x->mu. */
static void p_on_request(td_xfer *x, td_xfer_msg *m) {
    const Tandem__Internal__V1__PrefillRequest *req = m->prefill_request;
    const char *id = req->request_id;
    /* The earlier of the relative deadline and D's point in time (a request
     * that waited in our queue gets what is left of it, not a fresh one);
     * it bounds the job's start. */
    double deadline_s = left_s(req->deadline_ms, req->deadline_unix_ns);
    /* An id is taken (or refused) once: a copy (a duplicated message, one
     * overtaken by D's Abort) is dropped without a word, since D's job may
     * be under way or over and its blocks reused. Until the deadline: a
     * copy arriving after it is refused as late anyway. */
    double now = td_time_s();
    int seen = td_xfer_seen_add(x->pf->seen, m->from->instance_id, m->from->epoch, id,
                                now + TD_MAX(deadline_s, 0.0), now);
    if (seen == 1 && pjob_find(x, id, m)) seen = 0; /* its job outlived the deadline */
    if (seen <= 0) {
        if (seen == 0)
            TD_LOG_WARN("prefill %s from %s: seen before (a copy, or aborted): dropped", id,
                        m->from->instance_id);
        else
            TD_LOG_WARN("prefill %s from %s: too many request ids in flight to remember: dropped",
                        id, m->from->instance_id);
        td_xfer_msg_free(m);
        return;
    }
    dpeer *d = dpeer_find(x, m->from->instance_id, m->from->epoch);
    bool kept = false;
    const char *why = NULL;
    Tandem__Internal__V1__RejectReason reason = TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_INVALID;
    char err[256];
    if (req->peer_case == TANDEM__INTERNAL__V1__PREFILL_REQUEST__PEER_EXCHANGE) {
        const td_xfer_exchange_msg *ex = req->exchange;
        td_xfer_plan dp = td_xfer_plan_of(ex);
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
    uint32_t start_ms = 0;
    char miss[256];
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
    }
    if (!why && would_miss(x, deadline_s, &start_ms, miss, sizeof miss)) {
        why = miss;
        reason = TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_WOULD_MISS_DEADLINE;
    }
    int32_t slot = why ? -1 : slot_take(x->pf->job_slot_used, TD_XRANK_MAX_JOBS);
    if (!why && slot < 0) {
        why = "every job slot is busy";
        reason = TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_BUSY;
    }
    if (!why && !(j = calloc(1, sizeof *j))) {
        x->pf->job_slot_used[slot] = false;
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
        x->pf->job_slot_used[slot] = false;
    }
    if (why) {
        p_reject_at(x, d, id, reason, why, start_ms);
        if (!kept) td_xfer_msg_free(m);
        return;
    }
    j->x = x;
    j->peer = d;
    j->slot = slot;
    snprintf(j->id, sizeof j->id, "%s", id);
    j->n_prompt = (int32_t)req->n_tokens;
    j->d_cached = (int32_t)req->cached_tokens;
    j->t_recv = now;
    /* The first lease runs from when D sent the request (its deadline's
     * point in time less its span), or from receipt. */
    uint32_t lease_ms = req->lease_ms ? req->lease_ms : (uint32_t)x->p.lease_ms;
    uint64_t sent_ns = req->deadline_unix_ns > (uint64_t)req->deadline_ms * 1000000ull
                           ? req->deadline_unix_ns - (uint64_t)req->deadline_ms * 1000000ull
                           : 0;
    double lease_s = left_s(lease_ms, sent_ns ? sent_ns + (uint64_t)lease_ms * 1000000ull : 0);
    td_pj_init(&j->pj, j->t_recv, deadline_s, TD_MAX(lease_s, 0.0));
    /* The ranks learn the job before its first chunk runs; they put
     * nothing past its lease. */
    td_xdir_buf b = {0};
    td_xdir_job(&b, slot, d->slot, j->n_prompt, j->d_cached, (uint64_t)(j->pj.put_until * 1e9),
                req->dest[0]->block_ids, (int32_t)req->dest[0]->n_block_ids);
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
    g.kv_export.progress = p_progress;
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
    j->next = x->pf->pjobs;
    x->pf->pjobs = j;
    if (!kept) td_xfer_msg_free(m);
}

/* JobAborted to D: every put of the job is flushed and none will follow. */
static void send_aborted(td_xfer *x, dpeer *d, const char *id, const char *msg) {
    if (!d || !d->ep || atomic_load(&d->failed) || d->closed) return; /* D's grace covers it */
    td_xfer_cmsg m = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__INIT;
    Tandem__Internal__V1__JobAborted ja = TANDEM__INTERNAL__V1__JOB_ABORTED__INIT;
    ja.request_id = (char *)id;
    ja.message = (char *)msg;
    m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_JOB_ABORTED;
    m.job_aborted = &ja;
    td_xfer_send(x, d->ep, &m);
}

/* Abort from D: the job stops, and D hears JobAborted once its puts are
 * flushed (at once when they are, or when we never had the job: its id is
 * then refused until the Abort's deadline). Caller holds x->mu. */
static void p_on_abort(td_xfer *x, const td_xfer_msg *m) {
    const Tandem__Internal__V1__Abort *ab = m->abort;
    pjob *j = pjob_find(x, ab->request_id, m);
    if (j) {
        j->pj.aborted = true;
        if (!j->ended && !j->cancelled && j->st) {
            j->cancelled = true; /* the scheduler ends it; p_after_sync answers */
            td_gen_stream_cancel(j->st);
        } else if (j->dropped) {
            j->consumed = true; /* answered and flushed: nothing for D to consume */
            send_aborted(x, j->peer, j->id, "already answered");
        }
        return;
    }
    double now = td_time_s();
    double until = now + (ab->deadline_unix_ns ? left_s(600000, ab->deadline_unix_ns) : 600.0);
    int r = td_xfer_seen_add(x->pf->seen, m->from->instance_id, m->from->epoch, ab->request_id,
                             TD_MAX(until, now), now);
    if (r < 0) {
        TD_LOG_WARN("abort of %s from %s: too many request ids to remember: not acknowledged",
                    ab->request_id, m->from->instance_id);
        return;
    }
    send_aborted(x, dpeer_find(x, m->from->instance_id, m->from->epoch), ab->request_id,
                 r ? "never had it" : "over");
}

static void p_on_msg(td_xfer *x, td_xfer_msg *m) {
    switch (m->body_case) {
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_REQUEST:
        p_on_request(x, m); /* takes m */
        return;
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_ABORT: p_on_abort(x, m); break;
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_TRANSFER_CONSUMED: {
        pjob *j = pjob_find(x, m->transfer_consumed->request_id, m);
        if (j) j->consumed = true;
        break;
    }
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_LEASE_RENEWAL: {
        /* the earlier of the span and D's point in time: a renewal arriving
         * late never lets us write past what D granted */
        const Tandem__Internal__V1__LeaseRenewal *lr = m->lease_renewal;
        double now = td_time_s(), lease_s = left_s(lr->lease_ms, lr->until_unix_ns);
        for (size_t i = 0; i < lr->n_request_ids; i++) {
            pjob *j = pjob_find(x, lr->request_ids[i], m);
            if (!j || j->replied || !td_pj_renew(&j->pj, now, lease_s)) continue;
            /* the ranks' bound on its puts moves with it */
            td_xdir_buf b = {0};
            td_xdir_extend(&b, j->slot, (uint64_t)(j->pj.put_until * 1e9));
            td_xext_post(x->xext, &b);
            td_xdir_free(&b);
        }
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
    td_xfer_cmsg m = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__INIT;
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
    pd.last_layer_unix_ns = last_layer ? last_layer : td_xfer_unix_ns();
    m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_DONE;
    m.prefill_done = &pd;
    return td_xfer_send(x, j->peer->ep, &m) == TD_OK;
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
    for (dpeer *d = x->pf->dpeers; d; d = d->next) {
        if (d->closed) continue;
        if (!atomic_load(&d->failed) && td_xext_peer_failed(x->xext, d->slot)) {
            TD_LOG_WARN("decode instance %s (epoch %016" PRIx64 "): a rank closed its endpoints",
                        d->instance, d->epoch);
            atomic_store(&d->failed, true);
        }
        if (atomic_load(&d->failed) || d->superseded) {
            bool busy = false;
            for (pjob *j = x->pf->pjobs; j; j = j->next) busy |= j->peer == d && j->slot >= 0;
            if (atomic_load(&d->failed) && !busy)
                TD_LOG_WARN("decode instance %s (epoch %016" PRIx64 ") unreachable: closing",
                            d->instance, d->epoch);
            if (!busy) dpeer_close(x, d); /* the ranks close theirs too */
        }
    }
    /* closed records nobody refers to any more */
    for (dpeer **dp = &x->pf->dpeers; *dp;) {
        dpeer *d = *dp;
        bool used = false;
        for (pjob *j = x->pf->pjobs; j; j = j->next) used |= j->peer == d;
        if (d->closed && !used) {
            *dp = d->next;
            td_xfer_msg_free(d->ex_msg);
            free(d);
            continue;
        }
        dp = &d->next;
    }
    for (pjob *j = x->pf->pjobs; j; j = j->next) {
        bool peer_gone = atomic_load(&j->peer->failed) || j->peer->closed || j->peer->superseded;
        const char *expired = j->replied ? NULL : td_pj_expired(&j->pj, now);
        if (!j->ended && !j->cancelled && (peer_gone || expired)) {
            j->cancelled = true; /* the scheduler ends it: p_ended */
            j->why = peer_gone ? "decode instance gone" : expired;
            j->late = !peer_gone;
            td_gen_stream_cancel(j->st);
        }
        if (!j->replied && j->progress > 0 && !j->cancelled && !peer_gone) {
            /* a chunk is starting: D waits on (its lease covers the rest) */
            td_xfer_cmsg m = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__INIT;
            Tandem__Internal__V1__JobProgress jp = TANDEM__INTERNAL__V1__JOB_PROGRESS__INIT;
            jp.request_id = j->id;
            jp.tokens = (uint32_t)j->progress;
            m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_JOB_PROGRESS;
            m.job_progress = &jp;
            td_xfer_send(x, j->peer->ep, &m);
            j->progress = 0;
        }
        if (j->ended && !j->replied && !j->cancelled && now <= j->pj.put_until &&
            td_xext_busy(x->xext, j->slot)) {
            need_sync = true; /* a rank is still flushing it: ask again */
            *answer_waits = true;
            continue;
        }
        if (j->ended && !j->replied) {
            j->replied = true;
            bool computed =
                j->have_first && !j->cancelled && !peer_gone && !td_xext_failed(x->xext, j->slot);
            j->ok = td_pj_answer_of(&j->pj, computed, now) == TD_PJ_DONE;
            if (!j->ok && !j->why) {
                j->late = j->have_first && now > j->pj.put_until;
                j->why = !j->have_first ? "prefill failed"
                         : j->late      ? "its lease ran out"
                                        : "transfer error";
            }
            /* Every rank has flushed the job: PrefillDone may go. */
            if (j->ok && !(j->ok = send_done(x, j)))
                TD_LOG_WARN("prefill %s: PrefillDone could not be sent", j->id);
            if (j->ok) {
                uint64_t bytes = (uint64_t)(j->n_prompt - j->d_cached) * 2u * (uint64_t)x->n_layer *
                                 (uint64_t)x->row_bytes;
                td_metrics_kv_transfer(x->p.metrics, bytes, now - j->t_recv);
                atomic_fetch_add(&x->bytes_put, bytes);
                j->hold_until = now + x->p.lease_ms / 1000.0;
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
    for (pjob **pp = &x->pf->pjobs; *pp;) {
        pjob *j = *pp;
        if (j->replied && !j->dropped && td_xext_busy(x->xext, j->slot)) {
            /* a rank could not complete its puts even after closing its
             * endpoints: the sources (and the slot) stay until it can */
            pp = &j->next;
            continue;
        }
        if (j->replied && !j->dropped) {
            j->dropped = true;
            if (j->pj.aborted) {
                /* D's Abort: flushed, stopped (or answered already) */
                TD_LOG_INFO("prefill %s for %s aborted", j->id, j->peer->instance);
                send_aborted(x, j->peer, j->id, j->ok ? "already answered" : "aborted");
                if (!j->ok) td_metrics_kv_transfer_failure(x->p.metrics, TD_XFER_FAIL_ABORTED);
                j->consumed = true;
            } else if (!j->ok) {
                td_xfer_cmsg m = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__INIT;
                Tandem__Internal__V1__TransferFailed tf =
                    TANDEM__INTERNAL__V1__TRANSFER_FAILED__INIT;
                tf.request_id = j->id;
                tf.message = (char *)(j->why ? j->why : "transfer error");
                m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_TRANSFER_FAILED;
                m.transfer_failed = &tf;
                TD_LOG_INFO("prefill %s for %s failed: %s", j->id, j->peer->instance, tf.message);
                if (!atomic_load(&j->peer->failed) && !j->peer->closed)
                    td_xfer_send(x, j->peer->ep, &m);
                td_metrics_kv_transfer_failure(x->p.metrics, j->late ? TD_XFER_FAIL_DEADLINE
                                                                     : TD_XFER_FAIL_FAILED);
                j->consumed = true; /* nothing for D to consume */
            }
            td_sched_release(x->p.sched, j->ticket);
            x->pf->job_slot_used[j->slot] = false;
            j->slot = -1;
        }
        if (j->dropped && (j->consumed || now > j->hold_until)) {
            *pp = j->next;
            pjob_free(x, j);
            continue;
        }
        pp = &j->next;
    }
}

/* ================================================================= side */

static void p_on_inbox(td_xfer *x, const td_xfer_inbox_msg *im) { p_on_msg(x, im->m); }

static td_status p_init(td_xfer *x, const td_xfer_params *p) {
    TD_UNUSED(p);
    x->pf = calloc(1, sizeof *x->pf);
    if (!x->pf) return TD_ERR_NOMEM;
    x->pf->seen = td_xfer_seen_create(1 << 16);
    return x->pf->seen ? TD_OK : TD_ERR_NOMEM;
}

static void p_ep_failed(void *user) { atomic_store(&((dpeer *)user)->failed, true); }

static int p_take_endpoints(td_xfer *x, td_ucx_ep **eps, int max) {
    int n = 0;
    for (dpeer *d = x->pf ? x->pf->dpeers : NULL; d; d = d->next) {
        if (d->ep && n < max)
            eps[n++] = d->ep;
        else if (d->ep)
            td_ucx_ep_close(d->ep, NULL, NULL);
        d->ep = NULL;
        d->closed = true;
    }
    return n;
}

static void p_free(td_xfer *x) {
    if (!x->pf) return;
    for (pjob *j = x->pf->pjobs; j;) {
        pjob *next = j->next;
        pjob_free(x, j);
        j = next;
    }
    for (dpeer *d = x->pf->dpeers; d;) {
        dpeer *next = d->next;
        td_xfer_msg_free(d->ex_msg);
        free(d);
        d = next;
    }
    td_xfer_seen_destroy(x->pf->seen);
    free(x->pf);
    x->pf = NULL;
}

static void p_stats(td_xfer *x, const td_sched_stats *ss, td_xfer_stats *st) {
    for (pjob *j = x->pf->pjobs; j; j = j->next) {
        if (!j->replied) st->in_flight++;
        if (j->replied && !j->consumed) st->awaiting_consume++;
    }
    st->leased_blocks = ss->held_blocks;
}

/* The drain rule: stay until the KV produced here has been consumed. */
static bool p_drained(td_xfer *x) {
    td_xfer_stats st;
    td_xfer_stats_get(x, &st);
    return st.in_flight == 0 && st.awaiting_consume == 0;
}

const td_xfer_side td_xfer_prefill_side = {.name = "prefill",
                                           .init = p_init,
                                           .on_msg = p_on_inbox,
                                           .service = p_service,
                                           .after_sync = p_after_sync,
                                           .ep_failed = p_ep_failed,
                                           .take_endpoints = p_take_endpoints,
                                           .free = p_free,
                                           .stats = p_stats,
                                           .drained = p_drained};
