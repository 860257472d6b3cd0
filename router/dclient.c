/* The router's client of tandem.internal.v1.Decode/Generate on the gRPC C
 * core.
 *
 * One completion queue and one thread. A call runs three kinds of batch:
 * {SEND_INITIAL_METADATA, SEND_MESSAGE, SEND_CLOSE_FROM_CLIENT,
 * RECV_INITIAL_METADATA}, {RECV_STATUS_ON_CLIENT}, and one RECV_MESSAGE
 * at a time, re-armed after each message. The call ends once its status
 * has arrived and no batch is outstanding: only then is on_end called, so
 * no callback can follow it.
 *
 * A call is shared by the caller (until td_rt_dcall_release) and the
 * client (until it ended); the last of the two frees it. Its mutex guards
 * its state and serialises grpc_call_start_batch on it, as the core asks;
 * callbacks run without it, so they may cancel their own call. The client
 * mutex guards the channel cache and the list of live calls (which
 * td_rt_dclient_destroy cancels). Lock order: client, then call.
 *
 * Channels are ref-counted by the cache and by the calls on them, so a
 * channel dropped from the cache (td_rt_dclient_forget) lives until its
 * last call ended. */
#include "dclient.h"

#include <arpa/inet.h>
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "proto/internal.pb-c.h"
#include "proto/tandem.pb-c.h"

#define METHOD "/tandem.internal.v1.Decode/Generate"
/* Reconnect back-offs: a restarted decode instance is reached again within
 * about a second, and a dead one costs a connection attempt per second. */
#define RECONNECT_MIN_MS  100
#define RECONNECT_MAX_MS  1000
#define MAX_RECV_BYTES    (4 << 20)
#define MAX_TARGET_LEN    255
#define ARENA_BYTES       8192
#define MAX_DETAILS_BYTES 1024

/* How long one connection attempt (TCP and the HTTP/2 handshake, up to the
 * server's SETTINGS frame) may take; the core takes it from
 * GRPC_ARG_MIN_RECONNECT_BACKOFF_MS. Set to the 100 ms back-off, it failed
 * every request sent to a live decode instance that did not run for 100 ms
 * while the router connected (a loaded machine, a CPU-throttled pod), and
 * marked that instance down. A dead instance refuses at once, and calls to
 * one gone silent are cancelled by the state poller after 3 failed pulls,
 * so this bound is only the last resort. */
#define CONNECT_TIMEOUT_MS 5000

/* protobuf-c's allocations while a response is unpacked: a chunk of a few
 * tokens fits, so the data path does not malloc per message. Used by the
 * completion-queue thread only, reset after each message. */
typedef struct {
    _Alignas(16) uint8_t buf[ARENA_BYTES];
    size_t used;
} msg_arena;

typedef struct chan chan;
struct chan {
    chan *next;
    grpc_channel *ch;
    void *method; /* grpc_channel_register_call of METHOD */
    int refs;     /* the cache's (while listed) + one per call (client mutex) */
    char target[];
};

typedef enum { TAG_START, TAG_RECV, TAG_STATUS } tag_kind;

typedef struct {
    td_rt_dcall *c;
    tag_kind kind;
} dtag;

struct td_rt_dcall {
    td_rt_dclient *cl;
    chan *ch;
    atomic_int refs; /* the caller's + the client's until on_end */
    td_rt_dcall_cb cb;
    pthread_mutex_t mu;
    grpc_call *call; /* NULL until created, and again once ended */
    dtag tag_start, tag_recv, tag_status;
    grpc_byte_buffer *send_buf; /* owned until the start batch completes */
    grpc_byte_buffer *recv_buf;
    grpc_metadata_array md_initial, md_trailing;
    grpc_status_code status;
    grpc_slice details;
    int n_pending;         /* batches started and not completed */
    bool status_done;      /* RECV_STATUS_ON_CLIENT completed */
    bool cancel_requested; /* by the caller, by on_response, or by the client's destroy */
    bool malformed;        /* a response could not be unpacked */
    bool ended;
    td_rt_dcall *prev, *next; /* the client's live list */
};

struct td_rt_dclient {
    grpc_completion_queue *cq;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t idle; /* signalled when a call leaves the live list */
    chan *chans;
    td_rt_dcall live; /* sentinel */
    int n_live;
    bool stopping;
    msg_arena arena;
    ProtobufCAllocator alloc;
};

/* ---- the unpack arena ---- */

static void *arena_alloc(void *data, size_t n) {
    msg_arena *a = data;
    size_t off = (a->used + 15) & ~(size_t)15;
    if (off <= sizeof(a->buf) && n <= sizeof(a->buf) - off) {
        a->used = off + n;
        return a->buf + off;
    }
    return malloc(n ? n : 1);
}

static void arena_free(void *data, void *p) {
    msg_arena *a = data;
    uintptr_t u = (uintptr_t)p, lo = (uintptr_t)a->buf;
    if (u >= lo && u < lo + sizeof(a->buf)) return;
    free(p);
}

/* ---- targets and channels ---- */

/* "HOST:PORT" (a name or an IPv4 address) or "[V6]:PORT", port 1..65535. */
static bool target_valid(const char *t) {
    size_t n = strnlen(t, MAX_TARGET_LEN + 1);
    if (n < 3 || n > MAX_TARGET_LEN) return false;
    const char *colon;
    if (t[0] == '[') {
        const char *close = strchr(t, ']');
        if (!close || close == t + 1 || close[1] != ':') return false;
        for (const char *p = t + 1; p < close; p++)
            if (!(strchr("0123456789abcdefABCDEF:.", *p) && *p)) return false;
        colon = close + 1;
    } else {
        colon = strrchr(t, ':');
        if (!colon || colon == t) return false;
        for (const char *p = t; p < colon; p++) {
            char ch = *p;
            bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                      (ch >= '0' && ch <= '9') || ch == '.' || ch == '-' || ch == '_';
            if (!ok) return false;
        }
    }
    const char *port = colon + 1;
    size_t np = strlen(port);
    if (np < 1 || np > 5) return false;
    long v = 0;
    for (size_t i = 0; i < np; i++) {
        if (port[i] < '0' || port[i] > '9') return false;
        v = v * 10 + (port[i] - '0');
    }
    return v >= 1 && v <= 65535;
}

static grpc_channel *channel_create(const char *target) {
    grpc_arg args[6];
    memset(args, 0, sizeof(args));
    const struct {
        const char *key;
        int value;
    } iargs[6] = {
        {GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, CONNECT_TIMEOUT_MS},
        {GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, RECONNECT_MIN_MS},
        {GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, RECONNECT_MAX_MS},
        {GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, MAX_RECV_BYTES},
        /* The router retries (on another instance) itself; the core's retry
         * layer would only buffer every request. */
        {GRPC_ARG_ENABLE_RETRIES, 0},
        /* A forgotten and re-created channel gets fresh connections rather
         * than the shared pool's (possibly backed-off) subchannel. */
        {GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1},
    };
    for (size_t i = 0; i < TD_ARRAY_SIZE(iargs); i++) {
        args[i].type = GRPC_ARG_INTEGER;
        args[i].key = (char *)iargs[i].key;
        args[i].value.integer = iargs[i].value;
    }
    grpc_channel_args cargs = {.num_args = TD_ARRAY_SIZE(args), .args = args};
    /* Address literals skip the resolver; names go to DNS. */
    char host[MAX_TARGET_LEN + 1];
    const char *colon = strrchr(target, ':');
    size_t n_host = (size_t)(colon - target);
    memcpy(host, target, n_host);
    host[n_host] = '\0';
    struct in_addr a4;
    const char *scheme = target[0] == '['                     ? "ipv6:"
                         : inet_pton(AF_INET, host, &a4) == 1 ? "ipv4:"
                                                              : "dns:///";
    char uri[MAX_TARGET_LEN + 16];
    snprintf(uri, sizeof(uri), "%s%s", scheme, target);
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    grpc_channel *ch = grpc_channel_create(uri, creds, &cargs);
    grpc_channel_credentials_release(creds);
    return ch;
}

/* The cached channel of target, created on first use, with a reference
 * for the caller; NULL when out of memory. Client mutex held. */
static chan *chan_get_locked(td_rt_dclient *cl, const char *target) {
    for (chan *h = cl->chans; h; h = h->next) {
        if (strcmp(h->target, target) == 0) {
            h->refs++;
            return h;
        }
    }
    size_t n = strlen(target);
    chan *h = calloc(1, sizeof(*h) + n + 1);
    if (!h) return NULL;
    memcpy(h->target, target, n + 1);
    h->ch = channel_create(target);
    h->method = grpc_channel_register_call(h->ch, METHOD, NULL, NULL);
    h->refs = 2;
    h->next = cl->chans;
    cl->chans = h;
    return h;
}

/* Drops a reference; returns h when it was the last (the caller destroys
 * it outside the mutex). Client mutex held. */
static chan *chan_unref_locked(chan *h) {
    TD_ASSERT(h->refs > 0);
    return --h->refs == 0 ? h : NULL;
}

static void chan_free(chan *h) {
    if (!h) return;
    grpc_channel_destroy(h->ch);
    free(h);
}

/* ---- calls ---- */

static void call_free(td_rt_dcall *c) {
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static void call_unref(td_rt_dcall *c) {
    if (atomic_fetch_sub(&c->refs, 1) == 1) call_free(c);
}

/* Call mutex held. */
static void cancel_locked(td_rt_dcall *c) {
    if (c->ended || c->cancel_requested) return;
    c->cancel_requested = true;
    if (c->call) grpc_call_cancel(c->call, NULL);
}

static void start_batch_locked(td_rt_dcall *c, const grpc_op *ops, size_t n, dtag *tag) {
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, tag, NULL);
    /* The batches are well formed by construction; the core refusing one
     * is a bug, not input. */
    TD_ASSERT(e == GRPC_CALL_OK);
    c->n_pending++;
}

static void arm_recv_locked(td_rt_dcall *c) {
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->recv_buf;
    start_batch_locked(c, &op, 1, &c->tag_recv);
}

/* Whether the call has just ended (the caller then runs end()). */
static bool end_due_locked(td_rt_dcall *c) {
    if (c->ended || !c->status_done || c->n_pending > 0) return false;
    c->ended = true;
    return true;
}

/* On the completion-queue thread, once per call. */
static void end(td_rt_dcall *c) {
    td_rt_dclient *cl = c->cl;
    int status = (int)c->status;
    char details[MAX_DETAILS_BYTES];
    if (c->malformed) {
        /* Whatever the server said after it, the stream was broken. */
        status = GRPC_STATUS_INTERNAL;
        snprintf(details, sizeof(details), "malformed GenerateResponse from the decode instance");
    } else {
        size_t n = TD_MIN(GRPC_SLICE_LENGTH(c->details), sizeof(details) - 1);
        memcpy(details, GRPC_SLICE_START_PTR(c->details), n);
        details[n] = '\0';
    }
    c->cb.on_end(c->cb.ctx, status, details);

    pthread_mutex_lock(&c->mu);
    grpc_call *call = c->call;
    c->call = NULL;
    pthread_mutex_unlock(&c->mu);
    grpc_call_unref(call);
    grpc_metadata_array_destroy(&c->md_initial);
    grpc_metadata_array_destroy(&c->md_trailing);
    grpc_slice_unref(c->details);

    pthread_mutex_lock(&cl->mu);
    c->prev->next = c->next;
    c->next->prev = c->prev;
    cl->n_live--;
    chan *dead = chan_unref_locked(c->ch);
    pthread_cond_broadcast(&cl->idle);
    pthread_mutex_unlock(&cl->mu);
    chan_free(dead);
    call_unref(c);
}

static void on_start(td_rt_dcall *c) {
    pthread_mutex_lock(&c->mu);
    c->n_pending--;
    grpc_byte_buffer_destroy(c->send_buf);
    c->send_buf = NULL;
    bool done = end_due_locked(c);
    pthread_mutex_unlock(&c->mu);
    if (done) end(c);
}

static void on_status(td_rt_dcall *c) {
    pthread_mutex_lock(&c->mu);
    c->n_pending--;
    c->status_done = true;
    bool done = end_due_locked(c);
    pthread_mutex_unlock(&c->mu);
    if (done) end(c);
}

/* Unpacks one response (protobuf-c allocating from the client's arena);
 * NULL when it is not a GenerateResponse. */
static Tandem__V1__GenerateResponse *unpack(td_rt_dclient *cl, grpc_byte_buffer *bb) {
    grpc_byte_buffer_reader rd;
    if (!grpc_byte_buffer_reader_init(&rd, bb)) return NULL; /* bad compression */
    Tandem__V1__GenerateResponse *r = NULL;
    grpc_slice *first = NULL, *second = NULL;
    if (!grpc_byte_buffer_reader_peek(&rd, &first)) {
        r = tandem__v1__generate_response__unpack(&cl->alloc, 0, (const uint8_t *)"");
    } else if (!grpc_byte_buffer_reader_peek(&rd, &second)) {
        /* one slice, as a small message arrives: read in place */
        r = tandem__v1__generate_response__unpack(&cl->alloc, GRPC_SLICE_LENGTH(*first),
                                                  GRPC_SLICE_START_PTR(*first));
    } else {
        /* readall reads from the start of a fresh reader only */
        grpc_byte_buffer_reader_destroy(&rd);
        if (!grpc_byte_buffer_reader_init(&rd, bb)) return NULL;
        grpc_slice all = grpc_byte_buffer_reader_readall(&rd);
        r = tandem__v1__generate_response__unpack(&cl->alloc, GRPC_SLICE_LENGTH(all),
                                                  GRPC_SLICE_START_PTR(all));
        grpc_slice_unref(all);
    }
    grpc_byte_buffer_reader_destroy(&rd);
    return r;
}

static void on_recv(td_rt_dcall *c, bool ok) {
    td_rt_dclient *cl = c->cl;
    pthread_mutex_lock(&c->mu);
    c->n_pending--;
    grpc_byte_buffer *bb = c->recv_buf;
    c->recv_buf = NULL;
    bool deliver = ok && bb && !c->cancel_requested && !c->malformed;
    pthread_mutex_unlock(&c->mu);

    bool more = ok && bb != NULL;
    if (deliver) {
        Tandem__V1__GenerateResponse *r = unpack(cl, bb);
        if (!r) {
            TD_LOG_WARN("malformed GenerateResponse from %s (%zu bytes): call cancelled",
                        c->ch->target, grpc_byte_buffer_length(bb));
            pthread_mutex_lock(&c->mu);
            c->malformed = true;
            if (!c->ended && c->call)
                grpc_call_cancel_with_status(c->call, GRPC_STATUS_INTERNAL,
                                             "malformed GenerateResponse", NULL);
            pthread_mutex_unlock(&c->mu);
        } else {
            bool go_on = c->cb.on_response(c->cb.ctx, r);
            tandem__v1__generate_response__free_unpacked(r, &cl->alloc);
            if (!go_on) {
                pthread_mutex_lock(&c->mu);
                cancel_locked(c);
                pthread_mutex_unlock(&c->mu);
            }
        }
        cl->arena.used = 0;
    }
    if (bb) grpc_byte_buffer_destroy(bb);

    pthread_mutex_lock(&c->mu);
    /* After a cancel the status arrives without the rest being read. */
    if (more && !c->cancel_requested && !c->malformed) arm_recv_locked(c);
    bool done = end_due_locked(c);
    pthread_mutex_unlock(&c->mu);
    if (done) end(c);
}

static void *cq_main(void *arg) {
    td_rt_dclient *cl = arg;
    for (;;) {
        grpc_event ev =
            grpc_completion_queue_next(cl->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        if (ev.type != GRPC_OP_COMPLETE) continue;
        dtag *t = ev.tag;
        switch (t->kind) {
        case TAG_START: on_start(t->c); break;
        case TAG_RECV: on_recv(t->c, ev.success != 0); break;
        case TAG_STATUS: on_status(t->c); break;
        }
    }
    return NULL;
}

/* ---- public ---- */

td_status td_rt_dclient_create(td_rt_dclient **c_p) {
    if (!c_p) return TD_ERR_INVALID;
    td_rt_dclient *cl = calloc(1, sizeof(*cl));
    if (!cl) {
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    pthread_mutex_init(&cl->mu, NULL);
    pthread_cond_init(&cl->idle, NULL);
    cl->live.next = cl->live.prev = &cl->live;
    cl->alloc.alloc = arena_alloc;
    cl->alloc.free = arena_free;
    cl->alloc.allocator_data = &cl->arena;
    grpc_init();
    cl->cq = grpc_completion_queue_create_for_next(NULL);
    int e = pthread_create(&cl->thread, NULL, cq_main, cl);
    if (e != 0) {
        TD_LOG_ERROR("cannot start the completion-queue thread: %s", strerror(e));
        grpc_completion_queue_shutdown(cl->cq);
        grpc_completion_queue_destroy(cl->cq);
        grpc_shutdown();
        pthread_cond_destroy(&cl->idle);
        pthread_mutex_destroy(&cl->mu);
        free(cl);
        return TD_ERR_INTERNAL;
    }
    *c_p = cl;
    return TD_OK;
}

void td_rt_dclient_destroy(td_rt_dclient *cl) {
    if (!cl) return;
    pthread_mutex_lock(&cl->mu);
    cl->stopping = true;
    for (td_rt_dcall *c = cl->live.next; c != &cl->live; c = c->next) {
        pthread_mutex_lock(&c->mu);
        cancel_locked(c);
        pthread_mutex_unlock(&c->mu);
    }
    while (cl->n_live > 0) pthread_cond_wait(&cl->idle, &cl->mu);
    pthread_mutex_unlock(&cl->mu);
    /* Every call ended: nothing more can reach the queue. */
    grpc_completion_queue_shutdown(cl->cq);
    pthread_join(cl->thread, NULL);
    grpc_completion_queue_destroy(cl->cq);
    while (cl->chans) {
        chan *h = cl->chans;
        cl->chans = h->next;
        TD_ASSERT(h->refs == 1);
        chan_free(h);
    }
    grpc_shutdown();
    pthread_cond_destroy(&cl->idle);
    pthread_mutex_destroy(&cl->mu);
    free(cl);
}

td_status td_rt_dcall_start(td_rt_dclient *cl, const char *target, const uint8_t *msg, size_t len,
                            double timeout_s, const td_rt_dcall_cb *cb, td_rt_dcall **call_p) {
    if (!cl || !target || (!msg && len > 0) || !cb || !cb->on_response || !cb->on_end || !call_p ||
        !(timeout_s >= 0) || !isfinite(timeout_s)) {
        TD_LOG_ERROR("invalid arguments");
        return TD_ERR_INVALID;
    }
    if (!target_valid(target)) {
        /* printable characters only: the name came from outside */
        char shown[65];
        size_t n = strnlen(target, sizeof(shown) - 1);
        for (size_t i = 0; i < n; i++)
            shown[i] = target[i] > 0x20 && target[i] < 0x7f ? target[i] : '?';
        shown[n] = '\0';
        TD_LOG_ERROR("invalid decode target '%s': HOST:PORT or [V6]:PORT expected", shown);
        return TD_ERR_INVALID;
    }
    td_rt_dcall *c = calloc(1, sizeof(*c));
    if (!c) {
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    c->cl = cl;
    c->cb = *cb;
    atomic_init(&c->refs, 2);
    pthread_mutex_init(&c->mu, NULL);
    c->tag_start = (dtag){c, TAG_START};
    c->tag_recv = (dtag){c, TAG_RECV};
    c->tag_status = (dtag){c, TAG_STATUS};
    c->details = grpc_empty_slice();
    c->status = GRPC_STATUS_UNKNOWN;

    pthread_mutex_lock(&cl->mu);
    if (cl->stopping) {
        pthread_mutex_unlock(&cl->mu);
        call_free(c);
        return TD_ERR_UNAVAILABLE;
    }
    c->ch = chan_get_locked(cl, target);
    if (!c->ch) {
        pthread_mutex_unlock(&cl->mu);
        call_free(c);
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    /* Listed before its batches start, so a concurrent destroy waits for
     * it (and cancels it: see cancel_requested below). */
    c->next = cl->live.next;
    c->prev = &cl->live;
    cl->live.next->prev = c;
    cl->live.next = c;
    cl->n_live++;
    pthread_mutex_unlock(&cl->mu);

    grpc_slice s = grpc_slice_from_copied_buffer((const char *)msg, len);
    c->send_buf = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    grpc_metadata_array_init(&c->md_initial);
    grpc_metadata_array_init(&c->md_trailing);
    gpr_timespec deadline = gpr_inf_future(GPR_CLOCK_MONOTONIC);
    if (timeout_s > 0 && timeout_s < 1e9) { /* beyond 30 years: none */
        int64_t us = (int64_t)ceil(timeout_s * 1e6);
        deadline =
            gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_micros(us, GPR_TIMESPAN));
    }

    pthread_mutex_lock(&c->mu);
    c->call = grpc_channel_create_registered_call(c->ch->ch, NULL, GRPC_PROPAGATE_DEFAULTS, cl->cq,
                                                  c->ch->method, deadline, NULL);
    TD_ASSERT(c->call);
    /* Nothing fails from here on; written before a callback can run. */
    *call_p = c;
    grpc_op ops[4];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = c->send_buf;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &c->md_initial;
    start_batch_locked(c, ops, 4, &c->tag_start);
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[0].data.recv_status_on_client.trailing_metadata = &c->md_trailing;
    ops[0].data.recv_status_on_client.status = &c->status;
    ops[0].data.recv_status_on_client.status_details = &c->details;
    start_batch_locked(c, ops, 1, &c->tag_status);
    arm_recv_locked(c);
    /* Cancelled (by a destroy) before the core call existed. */
    if (c->cancel_requested) grpc_call_cancel(c->call, NULL);
    pthread_mutex_unlock(&c->mu);
    return TD_OK;
}

void td_rt_dcall_cancel(td_rt_dcall *c) {
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    cancel_locked(c);
    pthread_mutex_unlock(&c->mu);
}

void td_rt_dcall_release(td_rt_dcall *c) {
    if (c) call_unref(c);
}

void td_rt_dclient_forget(td_rt_dclient *cl, const char *target) {
    if (!cl || !target) return;
    chan *dead = NULL;
    pthread_mutex_lock(&cl->mu);
    for (chan **pp = &cl->chans; *pp; pp = &(*pp)->next) {
        chan *h = *pp;
        if (strcmp(h->target, target) != 0) continue;
        *pp = h->next;
        dead = chan_unref_locked(h);
        break;
    }
    pthread_mutex_unlock(&cl->mu);
    chan_free(dead);
}
