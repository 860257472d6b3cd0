/* The transfer service both roles run (xfer.h, xfer-impl.h): the control
 * channel's callbacks, the service thread that hands every message and
 * pass to the instance's side (prefill/xfer-prefill.c or
 * decode/xfer-decode.c), the exchange, the lifetime, the state. */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "common/kv/kv.h"
#include "common/model/model.h"
#include "xfer-impl.h"

td_xfer_params td_xfer_default_params(void) {
    td_xfer_params p = {.deadline_ms = 30000,
                        .lease_ms = 3000,
                        .local_prefill_threshold = 0,
                        .link_interval_ms = 500,
                        .dns_interval_ms = 5000,
                        .forget_ms = 60000,
                        .layerwise = true};
    return p;
}

void td_xfer_wake(td_xfer *x) {
    uint64_t one = 1;
    ssize_t r = write(x->wake_fd, &one, sizeof one);
    TD_UNUSED(r); /* EAGAIN only when the counter is saturated: still readable */
}

uint64_t td_xfer_unix_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* --------------------------------------------------------------- messages */

/* m with this instance as sender and the cluster token, packed into a
 * malloc'd buffer of *n bytes; NULL when out of memory. */
static uint8_t *pack_msg(td_xfer *x, td_xfer_cmsg *m, size_t *n) {
    Tandem__Internal__V1__Peer from = TANDEM__INTERNAL__V1__PEER__INIT;
    from.instance_id = x->instance_id;
    from.epoch = x->epoch;
    m->from = &from;
    m->cluster_token.data = (uint8_t *)x->token;
    m->cluster_token.len = x->token_len;
    *n = protobuf_c_message_get_packed_size(&m->base);
    uint8_t *buf = malloc(*n ? *n : 1);
    if (buf) protobuf_c_message_pack(&m->base, buf);
    m->from = NULL; /* (it pointed at this frame) */
    return buf;
}

td_status td_xfer_send(td_xfer *x, td_ucx_ep *ep, td_xfer_cmsg *m) {
    if (!ep) return TD_ERR_IO;
    size_t n;
    uint8_t *buf = pack_msg(x, m, &n);
    if (!buf) return TD_ERR_NOMEM;
    td_status st = td_ucx_send(ep, buf, n);
    free(buf);
    return st;
}

td_status td_xfer_build_exchange(td_xfer *x, td_xfer_own_exchange *o, uint64_t exchange_id,
                                 int link) {
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

td_xfer_plan td_xfer_plan_of(const td_xfer_exchange_msg *ex) {
    td_xfer_plan p = {.tp = (int)ex->plan->tp, .pp = (int)ex->plan->pp, .cp = (int)ex->plan->cp};
    for (uint32_t s = 0; s <= ex->plan->pp && s <= TD_PLAN_MAX_PP; s++)
        p.stage_begin[s] = (int32_t)ex->plan->stage_begin[s];
    return p;
}

/* --------------------------------------------------------- UCX callbacks */

static void on_msg(void *ctx, const uint8_t *data, size_t len) {
    td_xfer *x = ctx;
    td_xfer_inbox_msg im = {.arrival_unix_ns = td_xfer_unix_ns(), .arrival_s = td_time_s()};
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
        td_xfer_inbox_msg *v = realloc(x->inbox, (size_t)cap * sizeof *v);
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
    td_xfer_wake(x);
}

static void on_error(void *ctx, td_ucx_ep *ep, td_status why) {
    td_xfer *x = ctx;
    void *u = td_ucx_ep_user(ep);
    TD_LOG_WARN("transfer endpoint error (%s)", td_status_str(why));
    if (!u) return;
    x->side->ep_failed(u);
    td_xfer_wake(x);
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
        td_xfer_inbox_msg *in = x->inbox;
        int n = x->n_inbox;
        x->inbox = NULL;
        x->n_inbox = x->cap_inbox = 0;
        pthread_mutex_unlock(&x->in_mu);
        pthread_mutex_lock(&x->mu);
        for (int i = 0; i < n; i++) x->side->on_msg(x, &in[i]);
        bool sync = x->side->service(x, &answer_waits);
        pthread_mutex_unlock(&x->mu);
        free(in);
        if (x->side->after_sync) {
            /* the dropped jobs' puts are flushed on every rank after this;
             * a failed executor's busy bits are stale: nothing is released
             * on them (the instance is failing, D's deadline and fence
             * cover its jobs) */
            td_status sst = sync ? td_xext_sync(x->xext) : TD_OK;
            if (sst == TD_OK && !td_exec_failed(x->p.exec)) {
                pthread_mutex_lock(&x->mu);
                x->side->after_sync(x);
                pthread_mutex_unlock(&x->mu);
            }
        }
    }
    return NULL;
}

/* ================================================================ lifetime */

td_status td_xfer_create(const td_xfer_params *p, td_xfer **x_p) {
    if (!p || !x_p || !p->side || !p->sched || !p->exec || !p->cluster_token ||
        !*p->cluster_token || !p->instance_id || p->deadline_ms < 1 || p->deadline_ms > 600000 ||
        p->lease_ms < 3 || p->lease_ms > 600000) {
        TD_LOG_ERROR("invalid transfer parameters");
        return TD_ERR_INVALID;
    }
    td_xfer *x = calloc(1, sizeof *x);
    if (!x) return TD_ERR_NOMEM;
    x->p = *p;
    x->side = p->side;
    x->wake_fd = -1;
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
                              .max_bytes = TD_XFER_MAX_MSG,
                              .n_vocab = x->n_vocab,
                              .max_ctx = p->max_ctx,
                              .n_layer = x->n_layer,
                              .n_head_kv = x->n_head_kv,
                              .head_dim = x->head_dim,
                              .block_size = x->block_size,
                              .kv_dtype = kp->dtype,
                              .compat = p->compat};
    if ((st = x->side->init(x, p)) != TD_OK) goto fail;
    x->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (x->wake_fd < 0) {
        TD_LOG_ERROR("eventfd: %s", strerror(errno));
        st = TD_ERR_IO;
        goto fail;
    }
    td_ucx_params up = {.name = x->side->name,
                        .on_msg = on_msg,
                        .on_error = on_error,
                        .ctx = x,
                        .max_msg_bytes = TD_XFER_MAX_MSG};
    if ((st = td_ucx_create(&up, &x->ucx)) != TD_OK) goto fail;
    /* Every rank gets a worker and moves its pool into UCX memory (xrank.h);
     * rank 0's shares this channel. */
    if ((st = td_xext_setup(p->exec, x->ucx, p->layerwise, &x->xext)) != TD_OK) goto fail;
    if (pthread_create(&x->thread, NULL, service_main, x) != 0) {
        st = TD_ERR_IO;
        goto fail;
    }
    x->thread_started = true;
    if (x->side->start && (st = x->side->start(x)) != TD_OK) goto fail;
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
        td_xfer_wake(x);
        pthread_join(x->thread, NULL);
    }
    if (x->side->stop) x->side->stop(x);
    /* Close every endpoint: puts in flight complete (with an error), so
     * nothing touches the KV memory any more. */
    td_ucx_ep *eps[64];
    pthread_mutex_lock(&x->mu);
    int n = x->side->take_endpoints(x, eps, 64);
    pthread_mutex_unlock(&x->mu);
    for (int i = 0; i < n; i++) td_ucx_ep_close_wait(eps[i], 2000);
}

void td_xfer_destroy(td_xfer *x) {
    if (!x) return;
    td_xfer_stop(x);
    /* The scheduler is gone: it freed every held and quarantined block. */
    x->side->free(x);
    /* rank 0's transfer state borrows the channel: it goes first (the KV
     * memory with it) */
    td_xext_destroy(x->xext);
    td_ucx_destroy(x->ucx);
    for (int i = 0; i < x->n_inbox; i++) td_xfer_msg_free(x->inbox[i].m);
    free(x->inbox);
    if (x->wake_fd >= 0) close(x->wake_fd);
    pthread_mutex_destroy(&x->mu);
    pthread_mutex_destroy(&x->in_mu);
    free(x->instance_id);
    free(x->token);
    free(x);
}

/* ================================================================= state */

void td_xfer_submit_hook(void *ctx, td_gen_request *g) {
    td_xfer *x = ctx;
    if (x->side->submit) x->side->submit(x, g);
}

bool td_xfer_drained(td_xfer *x) { return !x->side->drained || x->side->drained(x); }

td_status td_xfer_exchange(void *ctx, uint8_t **buf, size_t *len) {
    td_xfer *x = ctx;
    td_xfer_own_exchange oe;
    td_status st = td_xfer_build_exchange(x, &oe, x->exchange_id, -1);
    if (st) return st;
    td_xfer_cmsg m = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__INIT;
    m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_EXCHANGE;
    m.exchange = &oe.ex;
    if (!(*buf = pack_msg(x, &m, len))) return TD_ERR_NOMEM;
    return TD_OK;
}

void td_xfer_stats_get(td_xfer *x, td_xfer_stats *st) {
    memset(st, 0, sizeof *st);
    td_sched_stats ss;
    td_sched_stats_get(x->p.sched, &ss);
    st->quarantined_blocks = ss.quarantined_blocks;
    pthread_mutex_lock(&x->mu);
    x->side->stats(x, &ss, st);
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
    if (peers && x->side->peers_json) {
        pthread_mutex_lock(&x->mu);
        x->side->peers_json(x, peers);
        pthread_mutex_unlock(&x->mu);
    }
    json_t *o = json_pack("{s:s,s:i,s:i,s:i,s:i,s:i,s:I,s:o}", "role", x->side->name, "in_flight",
                          st.in_flight, "leased_blocks", st.leased_blocks, "quarantined_blocks",
                          st.quarantined_blocks, "held_blocks", ss.held_blocks, "awaiting_consume",
                          st.awaiting_consume, "bytes_put", (json_int_t)st.bytes_put, "peers",
                          peers ? peers : json_array());
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return s;
}
