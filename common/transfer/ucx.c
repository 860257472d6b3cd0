/* The UCX channel (ucx.h): one context, one worker and one progress thread
 * per td_ucx, plus the link workers (td_ucx_link) the same thread drives.
 *
 * Progress thread: progresses the worker until it has no more work, then
 * arms it (ucp_worker_arm) and sleeps in poll() on the worker's event fd and
 * on a stop eventfd. It keeps spinning (yielding the core) for a short
 * while after the last progress, because a transfer is a burst of events
 * on both sides (over TCP, and over shared memory where UCX emulates puts
 * with active messages, a put is not one-sided: the target's worker copies
 * the data) and a sleep per event would cost a wakeup each. While requests
 * of this process are in flight it sleeps with a short timeout, so an event
 * the transport does not signal (UCX's keepalive runs only in progress)
 * cannot stall a transfer. Threads that post while it sleeps wake it with
 * ucp_worker_signal (only then: posting is otherwise syscall-free).
 *
 * Link workers: the thread keeps its own array of the workers it drives
 * and rebuilds it from u->links when links_gen changes (a link created or
 * dying; the creator or destroyer writes the wake eventfd). A dying link
 * is marked detached once the thread has dropped it; only then does its
 * destroyer touch the worker, on its own thread.
 *
 * Locking: UCX serializes the worker itself (UCS_THREAD_MODE_MULTI, a
 * recursive lock, so callbacks may post). u->lock guards only the lists
 * of endpoints and regions; no UCX call is made while holding it, because
 * UCX callbacks (which run under the worker's lock) take it.
 *
 * Blobs: worker addresses and packed rkeys travel framed as
 * magic | payload length | XXH3-64 of the payload | payload (little-endian),
 * so that a truncated or corrupted copy is rejected here instead of being
 * parsed by UCX, whose unpacking trusts its input. */
#include "ucx.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <ucp/api/ucp.h>
#include <xxhash.h>

#define TD_UCX_AM_ID          11
#define TD_UCX_MAX_MSG        ((size_t)16 << 20)
#define TD_UCX_BLOB_HDR       16
#define TD_UCX_MAGIC_ADDR     0x41554454u /* "TDUA" */
#define TD_UCX_MAGIC_RKEY     0x52554454u /* "TDUR" */
#define TD_UCX_SPIN_NS        2000000ull  /* keep spinning this long after progress */
#define TD_UCX_BUSY_POLL_MS   1           /* sleep bound while requests are in flight */
#define TD_UCX_DESTROY_WAIT_S 5.0
#define TD_UCX_MAX_LINKS      128
#define TD_UCX_EAGER_MAX      ((size_t)64 << 10) /* messages sent eagerly, always */

struct td_ucx_mem {
    td_ucx *u;
    ucp_mem_h memh;
    void *base;
    size_t bytes;
    td_ucx_mem *prev, *next;
};

struct td_ucx_ep {
    td_ucx *u;
    ucp_ep_h ep;
    void *user;
    atomic_bool failed;
    atomic_bool closing; /* td_ucx_ep_close was called: the handle is the channel's */
    /* td_ucx_ep_close_flushed: closed by the progress thread once flushed
     * (or failed), or at close_at_ns; deferred and close_at_ns under u->lock */
    bool deferred;
    struct flush_token *flush; /* its flush's outcome (NULL: no flushed close) */
    uint64_t close_at_ns;
    void (*closed)(void *ctx);
    void *closed_ctx;
    td_ucx_ep *prev, *next;
};

/* The flush of a flushed close: shared by the endpoint and the flush's
 * callback, which may come after a forced close freed the endpoint. */
typedef struct flush_token {
    td_ucx *u;
    atomic_bool done; /* completed, failed, or the endpoint failed */
    atomic_int refs;
} flush_token;

static void flush_token_put(flush_token *t) {
    if (t && atomic_fetch_sub(&t->refs, 1) == 1) free(t);
}

struct td_ucx_rkey {
    td_ucx_ep *ep;
    ucp_rkey_h rkey;
    uint64_t base, bytes;
};

/* The channel's doubly linked lists (eps, mems, links); caller holds
 * u->lock. */
#define LIST_PUSH(head, e)                                                                         \
    do {                                                                                           \
        (e)->prev = NULL;                                                                          \
        (e)->next = (head);                                                                        \
        if (head) (head)->prev = (e);                                                              \
        (head) = (e);                                                                              \
    } while (0)
#define LIST_UNLINK(head, e)                                                                       \
    do {                                                                                           \
        if ((e)->prev)                                                                             \
            (e)->prev->next = (e)->next;                                                           \
        else                                                                                       \
            (head) = (e)->next;                                                                    \
        if ((e)->next) (e)->next->prev = (e)->prev;                                                \
    } while (0)

/* One worker of the context: the channel's own or a link's. */
typedef struct {
    td_ucx *u;
    ucp_worker_h worker;
    int fd;       /* ucp_worker_get_efd */
    bool is_link; /* a link worker: eager messages only (see am_recv_cb) */
} td_ucx_wk;

struct td_ucx_link {
    td_ucx_wk wk;
    bool dying;    /* u->lock: its destroyer waits for the progress thread */
    bool detached; /* u->lock: the progress thread no longer drives it */
    td_ucx_link *prev, *next;
};

struct td_ucx {
    char name[64];
    void (*on_msg)(void *ctx, const uint8_t *data, size_t len);
    void (*on_error)(void *ctx, td_ucx_ep *ep, td_status why);
    void *ctx;
    size_t max_msg;

    ucp_context_h context;
    td_ucx_wk main; /* the worker of the endpoints */
    int stop_fd;    /* eventfd: wakes the progress thread (to stop, or for links) */
    pthread_t thread;
    atomic_bool stop;
    atomic_bool sleeping;        /* the progress thread is in (or about to enter) poll */
    atomic_uint_fast64_t posted; /* bumped after every post, see progress_main */
    atomic_int inflight;         /* requests of ours UCX has not completed yet */
    atomic_int n_deferred;       /* endpoints waiting for their flushed close */

    pthread_mutex_t lock;    /* the three lists below */
    pthread_cond_t links_cv; /* a dying link was detached */
    td_ucx_ep *eps;          /* open and closing endpoints */
    td_ucx_mem *mems;
    td_ucx_link *links;
    int n_links;
    atomic_uint_fast64_t links_gen; /* bumped when links change */

    atomic_uint_fast64_t put_bytes, puts, msgs_sent, msgs_received, msgs_dropped, ep_errors;
};

/* A receive of a rendezvous active message in flight. */
typedef struct {
    td_ucx_wk *wk;
    size_t len;
    uint8_t data[];
} td_ucx_rndv;

static td_status status_from_ucs(ucs_status_t s) {
    switch (s) {
    case UCS_OK: return TD_OK;
    case UCS_ERR_NO_MEMORY: return TD_ERR_NOMEM;
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR: return TD_ERR_INVALID;
    case UCS_ERR_CANCELED: return TD_ERR_IO;
    default: return TD_ERR_IO;
    }
}

/* ---- blobs ---- */

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get_u32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static uint64_t get_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static td_status blob_wrap(uint32_t magic, const void *payload, size_t n, uint8_t **blob_p,
                           size_t *len_p) {
    if (n > UINT32_MAX - TD_UCX_BLOB_HDR) return TD_ERR_RANGE;
    uint8_t *b = malloc(TD_UCX_BLOB_HDR + n);
    if (!b) return TD_ERR_NOMEM;
    put_u32(b, magic);
    put_u32(b + 4, (uint32_t)n);
    put_u64(b + 8, XXH3_64bits(payload, n));
    memcpy(b + TD_UCX_BLOB_HDR, payload, n);
    *blob_p = b;
    *len_p = TD_UCX_BLOB_HDR + n;
    return TD_OK;
}

/* The payload of a blob, or NULL (the reason in *why) when it is not one. */
static const uint8_t *blob_unwrap(uint32_t magic, const uint8_t *b, size_t len, size_t *n_p,
                                  const char **why) {
    if (!b || len < TD_UCX_BLOB_HDR) {
        *why = "shorter than its header";
        return NULL;
    }
    if (get_u32(b) != magic) {
        *why = "bad magic";
        return NULL;
    }
    size_t n = get_u32(b + 4);
    if (n == 0 || n != len - TD_UCX_BLOB_HDR) {
        *why = "length does not match";
        return NULL;
    }
    if (XXH3_64bits(b + TD_UCX_BLOB_HDR, n) != get_u64(b + 8)) {
        *why = "checksum mismatch";
        return NULL;
    }
    *n_p = n;
    return b + TD_UCX_BLOB_HDR;
}

/* ---- progress thread ---- */

/* After posting from any thread: wake the progress thread if it sleeps.
 * The progress thread sets sleeping, then re-reads posted before arming;
 * so either it sees this post, or this thread sees sleeping and signals
 * (a signal before ucp_worker_arm makes the arm return busy). */
static void after_post(td_ucx *u) {
    atomic_fetch_add(&u->posted, 1);
    if (atomic_load(&u->sleeping)) ucp_worker_signal(u->main.worker);
}

static void wake_progress(td_ucx *u) {
    uint64_t one = 1;
    if (write(u->stop_fd, &one, sizeof one) != (ssize_t)sizeof one && errno != EAGAIN)
        TD_LOG_ERROR("%s: eventfd write: %s", u->name, strerror(errno));
}

/* The workers the progress thread drives: the main one, then every live
 * link; dying links are detached (their destroyers wake). */
static int links_snapshot(td_ucx *u, td_ucx_wk **wks) {
    int n = 0;
    wks[n++] = &u->main;
    pthread_mutex_lock(&u->lock);
    bool detached = false;
    for (td_ucx_link *l = u->links; l; l = l->next) {
        if (l->dying) {
            detached |= !l->detached;
            l->detached = true;
        } else if (n < 1 + TD_UCX_MAX_LINKS) {
            wks[n++] = &l->wk;
        }
    }
    if (detached) pthread_cond_broadcast(&u->links_cv);
    pthread_mutex_unlock(&u->lock);
    return n;
}

static void close_deferred(td_ucx *u);

static void *progress_main(void *arg) {
    td_ucx *u = arg;
    uint64_t last_work = td_time_ns();
    bool arm_failed = false;
    td_ucx_wk *wks[1 + TD_UCX_MAX_LINKS];
    struct pollfd pf[2 + TD_UCX_MAX_LINKS];
    uint_fast64_t gen = atomic_load(&u->links_gen);
    int n_wk = links_snapshot(u, wks);
    while (!atomic_load(&u->stop)) {
        if (atomic_load(&u->links_gen) != gen) {
            gen = atomic_load(&u->links_gen);
            n_wk = links_snapshot(u, wks);
        }
        uint_fast64_t seen = atomic_load(&u->posted);
        /* one progress call per worker per pass, so that a busy link (a
         * stream of TCP puts) does not starve the others */
        unsigned n = 0, k;
        do {
            k = 0;
            for (int w = 0; w < n_wk; w++) k += ucp_worker_progress(wks[w]->worker);
            n += k;
        } while (k != 0 && !atomic_load(&u->stop) && atomic_load(&u->links_gen) == gen);
        if (atomic_load(&u->n_deferred) > 0) close_deferred(u);
        uint64_t now = td_time_ns();
        if (n) last_work = now;
        int inflight = atomic_load(&u->inflight);
        if (now - last_work < TD_UCX_SPIN_NS) {
            sched_yield();
            continue;
        }
        atomic_store(&u->sleeping, true);
        if (atomic_load(&u->posted) != seen || atomic_load(&u->stop) ||
            atomic_load(&u->links_gen) != gen) {
            atomic_store(&u->sleeping, false);
            continue;
        }
        ucs_status_t s = UCS_OK;
        for (int w = 0; w < n_wk && s == UCS_OK; w++) s = ucp_worker_arm(wks[w]->worker);
        if (s == UCS_ERR_BUSY) {
            atomic_store(&u->sleeping, false);
            continue;
        }
        /* An arm that fails (never seen) degrades to polling every
         * millisecond rather than stopping the channel. */
        if (s != UCS_OK && !arm_failed) {
            TD_LOG_ERROR("%s: ucp_worker_arm: %s; polling instead", u->name, ucs_status_string(s));
            arm_failed = true;
        }
        pf[0] = (struct pollfd){.fd = u->stop_fd, .events = POLLIN};
        for (int w = 0; w < n_wk; w++)
            pf[1 + w] = (struct pollfd){.fd = wks[w]->fd, .events = POLLIN};
        int timeout = s != UCS_OK || inflight > 0 || atomic_load(&u->n_deferred) > 0
                          ? TD_UCX_BUSY_POLL_MS
                          : -1;
        if (poll(pf, (nfds_t)(1 + n_wk), timeout) < 0 && errno != EINTR) {
            TD_LOG_ERROR("%s: poll: %s", u->name, strerror(errno));
            usleep(1000);
        }
        if (pf[0].revents & POLLIN) {
            uint64_t v;
            if (read(u->stop_fd, &v, sizeof v) < 0 && errno != EAGAIN)
                TD_LOG_ERROR("%s: eventfd read: %s", u->name, strerror(errno));
        }
        atomic_store(&u->sleeping, false);
    }
    return NULL;
}

/* ---- active messages ---- */

static void deliver(td_ucx *u, const uint8_t *data, size_t len) {
    atomic_fetch_add(&u->msgs_received, 1);
    if (u->on_msg) u->on_msg(u->ctx, data, len);
}

static void rndv_recv_cb(void *request, ucs_status_t status, size_t length, void *user_data) {
    td_ucx_rndv *r = user_data;
    td_ucx_wk *wk = r->wk;
    td_ucx *u = wk->u;
    if (status == UCS_OK && length == r->len) {
        deliver(u, r->data, r->len);
    } else {
        TD_LOG_WARN("%s: receiving a %zu-byte message failed: %s", u->name, r->len,
                    ucs_status_string(status));
        atomic_fetch_add(&u->msgs_dropped, 1);
    }
    free(r);
    ucp_request_free(request);
    atomic_fetch_sub(&u->inflight, 1);
}

static ucs_status_t am_recv_cb(void *arg, const void *header, size_t header_length, void *data,
                               size_t length, const ucp_am_recv_param_t *param) {
    td_ucx_wk *wk = arg;
    td_ucx *u = wk->u;
    TD_UNUSED(header);
    TD_UNUSED(header_length);
    if (length > u->max_msg) {
        /* UCS_OK drops the data (eager) or the rendezvous descriptor; the
         * sender's request completes. */
        TD_LOG_WARN("%s: dropped a %zu-byte message (limit %zu)", u->name, length, u->max_msg);
        atomic_fetch_add(&u->msgs_dropped, 1);
        return UCS_OK;
    }
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        deliver(u, data, length);
        return UCS_OK;
    }
    if (wk->is_link) {
        /* A link worker may be destroyed at any time (a fence), and UCX
         * 1.13 cannot destroy a worker with a rendezvous receive in flight
         * (it asserts, or leaks it): links take eager messages only. The
         * protocol's messages to a link are a few hundred bytes. */
        TD_LOG_WARN("%s: dropped a %zu-byte rendezvous message on a link worker", u->name, length);
        atomic_fetch_add(&u->msgs_dropped, 1);
        return UCS_OK;
    }
    td_ucx_rndv *r = malloc(sizeof *r + (length ? length : 1));
    if (!r) {
        TD_LOG_ERROR("%s: no memory for a %zu-byte message", u->name, length);
        atomic_fetch_add(&u->msgs_dropped, 1);
        return UCS_OK;
    }
    r->wk = wk;
    r->len = length;
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                               UCP_OP_ATTR_FIELD_USER_DATA |
                                               UCP_OP_ATTR_FIELD_DATATYPE,
                               .cb.recv_am = rndv_recv_cb,
                               .user_data = r,
                               .datatype = ucp_dt_make_contig(1)};
    atomic_fetch_add(&u->inflight, 1);
    ucs_status_ptr_t req = ucp_am_recv_data_nbx(wk->worker, data, r->data, length, &prm);
    if (req == NULL) {
        atomic_fetch_sub(&u->inflight, 1);
        deliver(u, r->data, length);
        free(r);
        return UCS_OK;
    }
    if (UCS_PTR_IS_ERR(req)) {
        atomic_fetch_sub(&u->inflight, 1);
        TD_LOG_WARN("%s: ucp_am_recv_data_nbx: %s", u->name,
                    ucs_status_string(UCS_PTR_STATUS(req)));
        atomic_fetch_add(&u->msgs_dropped, 1);
        free(r);
        return UCS_OK; /* UCP owns the descriptor once the receive was tried */
    }
    return UCS_INPROGRESS; /* rndv_recv_cb finishes it */
}

static void am_send_cb(void *request, ucs_status_t status, void *user_data) {
    void **slot = user_data; /* [0] = td_ucx, then the bytes */
    td_ucx *u = slot[0];
    if (status != UCS_OK)
        TD_LOG_DEBUG("%s: a control message was not sent: %s", u->name, ucs_status_string(status));
    free(slot);
    ucp_request_free(request);
    atomic_fetch_sub(&u->inflight, 1);
}

/* ---- create / destroy ---- */

/* Whether UCX_TLS lets the posix and sysv transports load (UCX warns about
 * variables of transports it did not load, e.g. under UCX_TLS=tcp). */
static bool shm_may_load(void) {
    const char *tls = getenv("UCX_TLS");
    if (!tls || !*tls || tls[0] == '^') return true;
    static const char *const k_words[] = {"all", "sm", "shm", "posix", "sysv", "mm"};
    char buf[256];
    snprintf(buf, sizeof buf, "%s", tls);
    char *save = NULL;
    for (char *w = strtok_r(buf, ",", &save); w; w = strtok_r(NULL, ",", &save))
        for (size_t i = 0; i < TD_ARRAY_SIZE(k_words); i++)
            if (!strcmp(w, k_words[i])) return true;
    return false;
}

/* A worker of u's context for wk (multi-threaded, with wakeup and the
 * control-message handler). */
static td_status wk_init(td_ucx *u, td_ucx_wk *wk, bool is_link) {
    wk->u = u;
    wk->fd = -1;
    wk->is_link = is_link;
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_MULTI};
    ucs_status_t s = ucp_worker_create(u->context, &wp, &wk->worker);
    if (s != UCS_OK) {
        TD_LOG_ERROR("%s: ucp_worker_create: %s", u->name, ucs_status_string(s));
        return status_from_ucs(s);
    }
    td_status st = TD_ERR_IO;
    ucp_worker_attr_t wa = {.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE};
    s = ucp_worker_query(wk->worker, &wa);
    if (s != UCS_OK || wa.thread_mode != UCS_THREAD_MODE_MULTI) {
        TD_LOG_ERROR("%s: UCX gave no multi-threaded worker (a UCX built without threads?)",
                     u->name);
        st = TD_ERR_UNSUPPORTED;
        goto fail;
    }
    s = ucp_worker_get_efd(wk->worker, &wk->fd);
    if (s != UCS_OK) {
        TD_LOG_ERROR("%s: ucp_worker_get_efd: %s", u->name, ucs_status_string(s));
        goto fail;
    }
    ucp_am_handler_param_t ap = {.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                                               UCP_AM_HANDLER_PARAM_FIELD_CB |
                                               UCP_AM_HANDLER_PARAM_FIELD_ARG,
                                 .id = TD_UCX_AM_ID,
                                 .cb = am_recv_cb,
                                 .arg = wk};
    s = ucp_worker_set_am_recv_handler(wk->worker, &ap);
    if (s != UCS_OK) {
        TD_LOG_ERROR("%s: ucp_worker_set_am_recv_handler: %s", u->name, ucs_status_string(s));
        goto fail;
    }
    return TD_OK;
fail:
    ucp_worker_destroy(wk->worker);
    wk->worker = NULL;
    return st;
}

void td_ucx_env_init(void) {
    /* DESIGN.md §4: without these, endpoints with peer error handling do not
     * use the shared-memory transports. An operator's setting wins. */
    if (shm_may_load()) {
        setenv("UCX_POSIX_ERROR_HANDLING", "y", 0);
        setenv("UCX_SYSV_ERROR_HANDLING", "y", 0);
    }
}

td_status td_ucx_create(const td_ucx_params *p, td_ucx **u_p) {
    if (!p || !u_p) return TD_ERR_INVALID;

    td_ucx *u = calloc(1, sizeof *u);
    if (!u) return TD_ERR_NOMEM;
    snprintf(u->name, sizeof u->name, "%s", p->name ? p->name : "ucx");
    u->on_msg = p->on_msg;
    u->on_error = p->on_error;
    u->ctx = p->ctx;
    u->max_msg = p->max_msg_bytes ? p->max_msg_bytes : TD_UCX_MAX_MSG;
    u->stop_fd = -1;
    pthread_mutex_init(&u->lock, NULL);
    pthread_cond_init(&u->links_cv, NULL);
    td_status st = TD_ERR_IO;
    ucs_status_t s;

    ucp_config_t *cfg;
    s = ucp_config_read(NULL, NULL, &cfg);
    if (s != UCS_OK) {
        TD_LOG_ERROR("%s: ucp_config_read: %s", u->name, ucs_status_string(s));
        goto fail_free;
    }
    ucp_params_t cp = {.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                                     UCP_PARAM_FIELD_NAME,
                       .features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
                       .mt_workers_shared = 1, /* link workers: td_ucx_link_create */
                       .name = u->name};
    s = ucp_init(&cp, cfg, &u->context);
    ucp_config_release(cfg);
    if (s != UCS_OK) {
        TD_LOG_ERROR("%s: ucp_init: %s", u->name, ucs_status_string(s));
        goto fail_free;
    }
    if ((st = wk_init(u, &u->main, false))) goto fail_context;
    st = TD_ERR_IO;
    u->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (u->stop_fd < 0) {
        TD_LOG_ERROR("%s: eventfd: %s", u->name, strerror(errno));
        goto fail_worker;
    }
    int e = pthread_create(&u->thread, NULL, progress_main, u);
    if (e != 0) {
        TD_LOG_ERROR("%s: pthread_create: %s", u->name, strerror(e));
        goto fail_stopfd;
    }
    *u_p = u;
    return TD_OK;

fail_stopfd:
    close(u->stop_fd);
fail_worker:
    ucp_worker_destroy(u->main.worker);
fail_context:
    ucp_cleanup(u->context);
fail_free:
    pthread_cond_destroy(&u->links_cv);
    pthread_mutex_destroy(&u->lock);
    free(u);
    return st;
}

static bool eps_empty(td_ucx *u) {
    pthread_mutex_lock(&u->lock);
    bool e = u->eps == NULL;
    pthread_mutex_unlock(&u->lock);
    return e;
}

static void ep_unlink(td_ucx_ep *ep) {
    td_ucx *u = ep->u;
    pthread_mutex_lock(&u->lock);
    LIST_UNLINK(u->eps, ep);
    pthread_mutex_unlock(&u->lock);
}

void td_ucx_destroy(td_ucx *u) {
    if (!u) return;
    for (;;) {
        pthread_mutex_lock(&u->lock);
        td_ucx_link *l = u->links;
        while (l && l->dying) l = l->next;
        pthread_mutex_unlock(&u->lock);
        if (!l) break;
        td_ucx_link_destroy(l);
    }
    /* Close the endpoints the owner left open, one at a time (the list
     * lock cannot be held across the close). */
    for (;;) {
        td_ucx_ep *victim = NULL;
        pthread_mutex_lock(&u->lock);
        for (td_ucx_ep *e = u->eps; e; e = e->next)
            if (!atomic_load(&e->closing)) {
                victim = e;
                break;
            }
        pthread_mutex_unlock(&u->lock);
        if (!victim) break;
        td_ucx_ep_close(victim, NULL, NULL);
    }
    /* flushed closes still waiting: now */
    pthread_mutex_lock(&u->lock);
    for (td_ucx_ep *e = u->eps; e; e = e->next) e->close_at_ns = 0;
    pthread_mutex_unlock(&u->lock);
    wake_progress(u);
    double t0 = td_time_s();
    while ((!eps_empty(u) || atomic_load(&u->inflight) > 0) &&
           td_time_s() - t0 < TD_UCX_DESTROY_WAIT_S) {
        ucp_worker_signal(u->main.worker);
        usleep(1000);
    }
    atomic_store(&u->stop, true);
    wake_progress(u);
    pthread_join(u->thread, NULL);

    if (!eps_empty(u) || atomic_load(&u->inflight) > 0)
        TD_LOG_WARN("%s: %d requests and some endpoint closes still pending after %.0f s", u->name,
                    atomic_load(&u->inflight), TD_UCX_DESTROY_WAIT_S);
    /* Endpoints whose close never completed: the worker goes, and them with it. */
    while (u->eps) {
        td_ucx_ep *e = u->eps;
        u->eps = e->next;
        if (e->closed) e->closed(e->closed_ctx);
        flush_token_put(e->flush);
        free(e);
    }
    while (u->mems) {
        td_ucx_mem *m = u->mems;
        u->mems = m->next;
        ucp_mem_unmap(u->context, m->memh);
        free(m);
    }
    ucp_worker_destroy(u->main.worker);
    ucp_cleanup(u->context);
    close(u->stop_fd);
    pthread_cond_destroy(&u->links_cv);
    pthread_mutex_destroy(&u->lock);
    free(u);
}

static td_status wk_address(td_ucx_wk *wk, uint8_t **addr_p, size_t *len_p) {
    if (!addr_p || !len_p) return TD_ERR_INVALID;
    ucp_address_t *a;
    size_t n;
    ucs_status_t s = ucp_worker_get_address(wk->worker, &a, &n);
    if (s != UCS_OK) {
        TD_LOG_ERROR("%s: ucp_worker_get_address: %s", wk->u->name, ucs_status_string(s));
        return status_from_ucs(s);
    }
    td_status st = blob_wrap(TD_UCX_MAGIC_ADDR, a, n, addr_p, len_p);
    ucp_worker_release_address(wk->worker, a);
    return st;
}

td_status td_ucx_address(td_ucx *u, uint8_t **addr_p, size_t *len_p) {
    if (!u) return TD_ERR_INVALID;
    return wk_address(&u->main, addr_p, len_p);
}

/* ---- link workers ---- */

td_status td_ucx_link_create(td_ucx *u, td_ucx_link **l_p) {
    if (!u || !l_p) return TD_ERR_INVALID;
    td_ucx_link *l = calloc(1, sizeof *l);
    if (!l) return TD_ERR_NOMEM;
    pthread_mutex_lock(&u->lock);
    bool full = u->n_links >= TD_UCX_MAX_LINKS;
    if (!full) u->n_links++; /* reserved */
    pthread_mutex_unlock(&u->lock);
    if (full) {
        TD_LOG_ERROR("%s: more than %d link workers", u->name, TD_UCX_MAX_LINKS);
        free(l);
        return TD_ERR_RANGE;
    }
    td_status st = wk_init(u, &l->wk, true);
    pthread_mutex_lock(&u->lock);
    if (st) {
        u->n_links--;
    } else {
        LIST_PUSH(u->links, l);
        atomic_fetch_add(&u->links_gen, 1);
    }
    pthread_mutex_unlock(&u->lock);
    if (st) {
        free(l);
        return st;
    }
    wake_progress(u);
    *l_p = l;
    return TD_OK;
}

td_status td_ucx_link_address(td_ucx_link *l, uint8_t **addr_p, size_t *len_p) {
    if (!l) return TD_ERR_INVALID;
    return wk_address(&l->wk, addr_p, len_p);
}

void td_ucx_link_destroy(td_ucx_link *l) {
    if (!l) return;
    td_ucx *u = l->wk.u;
    pthread_mutex_lock(&u->lock);
    TD_ASSERT(!l->dying);
    l->dying = true;
    atomic_fetch_add(&u->links_gen, 1);
    pthread_mutex_unlock(&u->lock);
    wake_progress(u);
    pthread_mutex_lock(&u->lock);
    while (!l->detached) pthread_cond_wait(&u->links_cv, &u->lock);
    LIST_UNLINK(u->links, l);
    u->n_links--;
    pthread_mutex_unlock(&u->lock);
    /* Ours alone now (and no receive of ours is in flight on it: links take
     * eager messages only): destroying it closes every connection a peer
     * made to it. */
    ucp_worker_destroy(l->wk.worker);
    free(l);
}

/* ---- memory ---- */

td_status td_ucx_mem_map(td_ucx *u, void *base, size_t bytes, td_ucx_mem **m_p) {
    if (!u || !base || bytes == 0 || !m_p) return TD_ERR_INVALID;
    td_ucx_mem *m = calloc(1, sizeof *m);
    if (!m) return TD_ERR_NOMEM;
    ucp_mem_map_params_t mp = {.field_mask =
                                   UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                               .address = base,
                               .length = bytes};
    ucs_status_t s = ucp_mem_map(u->context, &mp, &m->memh);
    if (s != UCS_OK) {
        TD_LOG_ERROR("%s: ucp_mem_map of %zu bytes: %s", u->name, bytes, ucs_status_string(s));
        free(m);
        return status_from_ucs(s);
    }
    m->u = u;
    m->base = base;
    m->bytes = bytes;
    pthread_mutex_lock(&u->lock);
    LIST_PUSH(u->mems, m);
    pthread_mutex_unlock(&u->lock);
    *m_p = m;
    return TD_OK;
}

td_status td_ucx_mem_alloc(td_ucx *u, size_t bytes, td_ucx_mem **m_p) {
    if (!u || bytes == 0 || !m_p) return TD_ERR_INVALID;
    td_ucx_mem *m = calloc(1, sizeof *m);
    if (!m) return TD_ERR_NOMEM;
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                                             UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                                             UCP_MEM_MAP_PARAM_FIELD_FLAGS,
                               .address = NULL,
                               .length = bytes,
                               .flags = UCP_MEM_MAP_ALLOCATE};
    ucs_status_t s = ucp_mem_map(u->context, &mp, &m->memh);
    if (s != UCS_OK) {
        TD_LOG_ERROR("%s: ucp_mem_map allocating %zu bytes: %s", u->name, bytes,
                     ucs_status_string(s));
        free(m);
        return status_from_ucs(s);
    }
    ucp_mem_attr_t ma = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH};
    s = ucp_mem_query(m->memh, &ma);
    if (s != UCS_OK || ma.length < bytes) {
        TD_LOG_ERROR("%s: ucp_mem_query: %s", u->name, ucs_status_string(s));
        ucp_mem_unmap(u->context, m->memh);
        free(m);
        return TD_ERR_INTERNAL;
    }
    m->u = u;
    m->base = ma.address;
    m->bytes = bytes;
    pthread_mutex_lock(&u->lock);
    LIST_PUSH(u->mems, m);
    pthread_mutex_unlock(&u->lock);
    *m_p = m;
    return TD_OK;
}

void *td_ucx_mem_base(const td_ucx_mem *m) { return m ? m->base : NULL; }

td_status td_ucx_mem_rkey(td_ucx_mem *m, uint8_t **rkey_p, size_t *len_p) {
    if (!m || !rkey_p || !len_p) return TD_ERR_INVALID;
    void *buf;
    size_t n;
    ucs_status_t s = ucp_rkey_pack(m->u->context, m->memh, &buf, &n);
    if (s != UCS_OK) {
        TD_LOG_ERROR("%s: ucp_rkey_pack: %s", m->u->name, ucs_status_string(s));
        return status_from_ucs(s);
    }
    td_status st = blob_wrap(TD_UCX_MAGIC_RKEY, buf, n, rkey_p, len_p);
    ucp_rkey_buffer_release(buf);
    return st;
}

void td_ucx_mem_unmap(td_ucx_mem *m) {
    if (!m) return;
    td_ucx *u = m->u;
    pthread_mutex_lock(&u->lock);
    LIST_UNLINK(u->mems, m);
    pthread_mutex_unlock(&u->lock);
    ucs_status_t s = ucp_mem_unmap(u->context, m->memh);
    if (s != UCS_OK) TD_LOG_ERROR("%s: ucp_mem_unmap: %s", u->name, ucs_status_string(s));
    free(m);
}

/* ---- endpoints ---- */

static void ep_err_cb(void *arg, ucp_ep_h uep, ucs_status_t status) {
    td_ucx_ep *ep = arg;
    td_ucx *u = ep->u;
    TD_UNUSED(uep);
    if (atomic_exchange(&ep->failed, true)) return;
    atomic_fetch_add(&u->ep_errors, 1);
    if (atomic_load(&ep->closing)) {
        if (ep->flush) atomic_store(&ep->flush->done, true); /* a flushed close waits no more */
        return; /* the owner already let go of the handle */
    }
    TD_LOG_WARN("%s: endpoint error: %s", u->name, ucs_status_string(status));
    if (u->on_error) u->on_error(u->ctx, ep, TD_ERR_IO);
}

td_status td_ucx_ep_create(td_ucx *u, const uint8_t *addr, size_t len, void *user,
                           td_ucx_ep **ep_p) {
    if (!u || !ep_p) return TD_ERR_INVALID;
    const char *why = NULL;
    size_t n = 0;
    const uint8_t *payload = blob_unwrap(TD_UCX_MAGIC_ADDR, addr, len, &n, &why);
    if (!payload) {
        TD_LOG_WARN("%s: rejected a %zu-byte worker address: %s", u->name, len, why);
        return TD_ERR_INVALID;
    }
    td_ucx_ep *ep = calloc(1, sizeof *ep);
    if (!ep) return TD_ERR_NOMEM;
    ep->u = u;
    ep->user = user;
    ucp_ep_params_t ep_params = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                               UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                               UCP_EP_PARAM_FIELD_ERR_HANDLER,
                                 .address = (const ucp_address_t *)payload,
                                 .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                                 .err_handler = {.cb = ep_err_cb, .arg = ep}};
    ucs_status_t s = ucp_ep_create(u->main.worker, &ep_params, &ep->ep);
    if (s != UCS_OK) {
        TD_LOG_WARN("%s: ucp_ep_create: %s", u->name, ucs_status_string(s));
        free(ep);
        return s == UCS_ERR_UNREACHABLE ? TD_ERR_IO : TD_ERR_INVALID;
    }
    pthread_mutex_lock(&u->lock);
    LIST_PUSH(u->eps, ep);
    pthread_mutex_unlock(&u->lock);
    after_post(u); /* wireup messages to progress */
    *ep_p = ep;
    return TD_OK;
}

void *td_ucx_ep_user(const td_ucx_ep *ep) { return ep ? ep->user : NULL; }

bool td_ucx_ep_failed(const td_ucx_ep *ep) { return !ep || atomic_load(&ep->failed); }

/* "lane[0]:  0:posix/memory.0 md[0] ..." -> "posix/memory" */
void td_ucx_ep_transports(td_ucx_ep *ep, char *buf, size_t len) {
    if (!buf || len == 0) return;
    buf[0] = '\0';
    if (!ep) return;
    char *text = NULL;
    size_t text_len = 0;
    FILE *f = open_memstream(&text, &text_len);
    if (!f) {
        snprintf(buf, len, "?");
        return;
    }
    ucp_ep_print_info(ep->ep, f);
    fclose(f);
    size_t used = 0;
    for (char *line = text; line && *line;) {
        char *eol = strchr(line, '\n');
        if (eol) *eol = '\0';
        char *lane = strstr(line, "lane[");
        char *colon = lane ? strchr(lane, ':') : NULL;
        if (colon) {
            char *t = colon + 1;
            while (*t == ' ') t++;
            char *c2 = strchr(t, ':'); /* "0:posix/memory.0" */
            char *sp = strchr(t, ' ');
            if (c2 && (!sp || c2 < sp)) t = c2 + 1;
            size_t tl = strcspn(t, " \t");
            char *dot = memchr(t, '.', tl);
            if (dot) tl = (size_t)(dot - t);
            char name[96];
            snprintf(name, sizeof name, "%.*s", (int)TD_MIN(tl, sizeof name - 1), t);
            /* once each, in lane order */
            bool seen = false;
            for (char *q = buf; (q = strstr(q, name)) != NULL; q += strlen(name)) {
                bool start = q == buf || q[-1] == ' ';
                bool end = q[strlen(name)] == '\0' || q[strlen(name)] == ' ';
                if (start && end) {
                    seen = true;
                    break;
                }
            }
            if (!seen && tl > 0) {
                int w = snprintf(buf + used, len - used, "%s%s", used ? " " : "", name);
                if (w < 0 || (size_t)w >= len - used) break;
                used += (size_t)w;
            }
        }
        line = eol ? eol + 1 : NULL;
    }
    free(text);
}

static void ep_close_finish(td_ucx_ep *ep) {
    ep_unlink(ep);
    if (ep->closed) ep->closed(ep->closed_ctx);
    flush_token_put(ep->flush);
    free(ep);
}

static void ep_close_cb(void *request, ucs_status_t status, void *user_data) {
    td_ucx_ep *ep = user_data;
    td_ucx *u = ep->u;
    TD_UNUSED(status); /* a forced close reports the error that ended the endpoint */
    ucp_request_free(request);
    ep_close_finish(ep);
    atomic_fetch_sub(&u->inflight, 1);
}

static void ep_force_close(td_ucx_ep *ep, void (*closed)(void *ctx), void *ctx) {
    td_ucx *u = ep->u;
    ep->closed = closed;
    ep->closed_ctx = ctx;
    atomic_store(&ep->closing, true);
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                               UCP_OP_ATTR_FIELD_USER_DATA |
                                               UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = UCP_EP_CLOSE_FLAG_FORCE,
                               .cb.send = ep_close_cb,
                               .user_data = ep};
    atomic_fetch_add(&u->inflight, 1);
    ucs_status_ptr_t req = ucp_ep_close_nbx(ep->ep, &prm);
    if (req == NULL || UCS_PTR_IS_ERR(req)) {
        /* A forced close releases the endpoint even when it reports an error. */
        if (UCS_PTR_IS_ERR(req))
            TD_LOG_DEBUG("%s: ucp_ep_close_nbx: %s", u->name,
                         ucs_status_string(UCS_PTR_STATUS(req)));
        ep_close_finish(ep);
        atomic_fetch_sub(&u->inflight, 1);
        return;
    }
    after_post(u);
}

void td_ucx_ep_close(td_ucx_ep *ep, void (*closed)(void *ctx), void *ctx) {
    if (!ep) {
        if (closed) closed(ctx);
        return;
    }
    TD_ASSERT(!atomic_load(&ep->closing));
    ep_force_close(ep, closed, ctx);
}

static void flush_before_close_cb(void *request, ucs_status_t status, void *user_data) {
    flush_token *t = user_data;
    td_ucx *u = t->u;
    TD_UNUSED(status); /* failed or not, nothing of ours is left in the socket */
    ucp_request_free(request);
    atomic_store(&t->done, true);
    flush_token_put(t);
    atomic_fetch_sub(&u->inflight, 1);
}

void td_ucx_ep_close_flushed(td_ucx_ep *ep, int force_after_ms) {
    if (!ep) return;
    td_ucx *u = ep->u;
    TD_ASSERT(!atomic_load(&ep->closing));
    flush_token *t = calloc(1, sizeof *t);
    if (!t) {
        ep_force_close(ep, NULL, NULL); /* no memory to wait with */
        return;
    }
    t->u = u;
    atomic_init(&t->refs, 2); /* the endpoint's and the flush's */
    ep->flush = t;
    atomic_store(&ep->closing, true);
    ucp_request_param_t prm = {.op_attr_mask =
                                   UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                               .cb.send = flush_before_close_cb,
                               .user_data = t};
    atomic_fetch_add(&u->inflight, 1);
    ucs_status_ptr_t req = ucp_ep_flush_nbx(ep->ep, &prm);
    if (req == NULL || UCS_PTR_IS_ERR(req)) {
        atomic_fetch_sub(&u->inflight, 1);
        atomic_store(&t->done, true);
        flush_token_put(t);
    }
    if (atomic_load(&ep->failed)) atomic_store(&t->done, true);
    pthread_mutex_lock(&u->lock);
    ep->close_at_ns = td_time_ns() + (uint64_t)TD_MAX(force_after_ms, 0) * 1000000ull;
    ep->deferred = true;
    pthread_mutex_unlock(&u->lock);
    atomic_fetch_add(&u->n_deferred, 1);
    wake_progress(u);
}

/* On the progress thread, between progress calls: the flushed closes whose
 * flush has ended (or whose time is up). */
static void close_deferred(td_ucx *u) {
    uint64_t now = td_time_ns();
    for (;;) {
        td_ucx_ep *ready = NULL;
        pthread_mutex_lock(&u->lock);
        for (td_ucx_ep *e = u->eps; e && !ready; e = e->next)
            if (e->deferred && (atomic_load(&e->flush->done) || now >= e->close_at_ns)) ready = e;
        if (ready) ready->deferred = false;
        pthread_mutex_unlock(&u->lock);
        if (!ready) return;
        atomic_fetch_sub(&u->n_deferred, 1);
        if (!atomic_load(&ready->flush->done))
            TD_LOG_WARN("%s: an endpoint closing after its flush: not flushed in time, forcing",
                        u->name);
        ep_force_close(ready, NULL, NULL);
    }
}

/* td_ucx_ep_close_wait's rendezvous with the close callback; freed by
 * whichever of the two lets go last (the waiter may time out first). */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    int refs;
} close_waiter;

static void waiter_put(close_waiter *w) {
    pthread_mutex_lock(&w->mu);
    bool last = --w->refs == 0;
    pthread_mutex_unlock(&w->mu);
    if (last) {
        pthread_mutex_destroy(&w->mu);
        pthread_cond_destroy(&w->cv);
        free(w);
    }
}

static void waiter_closed(void *ctx) {
    close_waiter *w = ctx;
    pthread_mutex_lock(&w->mu);
    w->done = true;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    waiter_put(w);
}

td_status td_ucx_ep_close_wait(td_ucx_ep *ep, int timeout_ms) {
    if (!ep) return TD_OK;
    close_waiter *w = calloc(1, sizeof *w);
    if (!w) {
        /* Still close; only the wait is lost. */
        td_ucx_ep_close(ep, NULL, NULL);
        return TD_ERR_NOMEM;
    }
    pthread_mutex_init(&w->mu, NULL);
    td_cond_init_monotonic(&w->cv);
    w->refs = 2;
    char name[64];
    snprintf(name, sizeof name, "%s", ep->u->name);
    td_ucx_ep_close(ep, waiter_closed, w);

    struct timespec dl = td_deadline_after(timeout_ms / 1000.0);
    pthread_mutex_lock(&w->mu);
    while (!w->done)
        if (pthread_cond_timedwait(&w->cv, &w->mu, &dl) == ETIMEDOUT) break;
    bool done = w->done;
    pthread_mutex_unlock(&w->mu);
    waiter_put(w);
    if (!done) {
        TD_LOG_WARN("%s: endpoint close did not complete in %d ms", name, timeout_ms);
        return TD_ERR_TIMEOUT;
    }
    return TD_OK;
}

/* ---- remote keys ---- */

/* True when [a, b] lies in one mapping of this process (/proc/self/maps). */
static bool one_mapping(uintptr_t a, uintptr_t b) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return false;
    char line[512];
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx", &lo, &hi) == 2) found = a >= lo && b < hi;
    }
    fclose(f);
    return found;
}

td_status td_ucx_rkey_create(td_ucx_ep *ep, const uint8_t *rkey, size_t len, uint64_t remote_base,
                             uint64_t remote_bytes, td_ucx_rkey **rk_p) {
    if (!ep || !rk_p) return TD_ERR_INVALID;
    td_ucx *u = ep->u;
    const char *why = NULL;
    size_t n = 0;
    const uint8_t *payload = blob_unwrap(TD_UCX_MAGIC_RKEY, rkey, len, &n, &why);
    if (!payload) {
        TD_LOG_WARN("%s: rejected a %zu-byte rkey: %s", u->name, len, why);
        return TD_ERR_INVALID;
    }
    uint64_t end;
    if (remote_bytes == 0 || __builtin_add_overflow(remote_base, remote_bytes, &end)) {
        TD_LOG_WARN("%s: rejected the remote region [%#" PRIx64 ", +%" PRIu64 ")", u->name,
                    remote_base, remote_bytes);
        return TD_ERR_INVALID;
    }
    td_ucx_rkey *rk = calloc(1, sizeof *rk);
    if (!rk) return TD_ERR_NOMEM;
    ucs_status_t s = ucp_ep_rkey_unpack(ep->ep, payload, &rk->rkey);
    if (s != UCS_OK) {
        TD_LOG_WARN("%s: ucp_ep_rkey_unpack: %s", u->name, ucs_status_string(s));
        free(rk);
        return TD_ERR_INVALID;
    }
    rk->ep = ep;
    rk->base = remote_base;
    rk->bytes = remote_bytes;
    /* Where the peer's memory is mapped into this process (shared-memory
     * transports), a put is a memcpy that UCX does not bound: the region
     * the peer claims must lie in one mapping of ours, or a lying peer could
     * make us write over our own memory. */
    void *p0 = NULL, *p1 = NULL;
    if (ucp_rkey_ptr(rk->rkey, remote_base, &p0) == UCS_OK) {
        bool ok = ucp_rkey_ptr(rk->rkey, end - 1, &p1) == UCS_OK &&
                  (uintptr_t)p1 - (uintptr_t)p0 == remote_bytes - 1 &&
                  one_mapping((uintptr_t)p0, (uintptr_t)p1);
        if (!ok) {
            TD_LOG_WARN("%s: rejected an rkey: the region it claims [%#" PRIx64 ", +%" PRIu64
                        ") is not one mapping here",
                        u->name, remote_base, remote_bytes);
            ucp_rkey_destroy(rk->rkey);
            free(rk);
            return TD_ERR_INVALID;
        }
    }
    *rk_p = rk;
    return TD_OK;
}

void td_ucx_rkey_destroy(td_ucx_rkey *rk) {
    if (!rk) return;
    ucp_rkey_destroy(rk->rkey);
    free(rk);
}

/* ---- completion groups, puts, flushes ---- */

void td_ucx_ops_init(td_ucx_ops *ops, void (*done)(td_ucx_ops *, td_status), void *ctx) {
    atomic_init(&ops->pending, 1);
    atomic_init(&ops->status, TD_OK);
    ops->done = done;
    ops->ctx = ctx;
    ops->u = NULL;
}

static void ops_complete(td_ucx_ops *ops, td_status st) {
    if (st != TD_OK) {
        int expected = TD_OK;
        atomic_compare_exchange_strong(&ops->status, &expected, st);
    }
    int before = atomic_fetch_sub(&ops->pending, 1);
    TD_ASSERT(before >= 1);
    if (before == 1 && ops->done) ops->done(ops, (td_status)atomic_load(&ops->status));
}

void td_ucx_ops_seal(td_ucx_ops *ops) { ops_complete(ops, TD_OK); }

static void op_cb(void *request, ucs_status_t status, void *user_data) {
    td_ucx_ops *ops = user_data;
    td_ucx *u = ops->u; /* ops may be gone once it completes */
    ucp_request_free(request);
    ops_complete(ops, status == UCS_OK ? TD_OK : TD_ERR_IO);
    atomic_fetch_sub(&u->inflight, 1);
}

/* Accounts for a request just posted: the three outcomes of an *_nbx call. */
static td_status op_posted(td_ucx *u, td_ucx_ops *ops, ucs_status_ptr_t req, const char *what) {
    if (req == NULL) {
        atomic_fetch_sub(&u->inflight, 1);
        ops_complete(ops, TD_OK);
        return TD_OK;
    }
    if (UCS_PTR_IS_ERR(req)) {
        atomic_fetch_sub(&u->inflight, 1);
        TD_LOG_WARN("%s: %s: %s", u->name, what, ucs_status_string(UCS_PTR_STATUS(req)));
        ops_complete(ops, TD_ERR_IO);
        return TD_ERR_IO;
    }
    after_post(u);
    return TD_OK;
}

static td_status op_begin(td_ucx_ep *ep, td_ucx_ops *ops) {
    td_ucx *u = ep->u;
    if (ops->u == NULL) ops->u = u;
    TD_ASSERT(ops->u == u);                     /* a group's operations go through one channel */
    TD_ASSERT(atomic_load(&ops->pending) >= 1); /* not completed yet */
    if (atomic_load(&ep->failed)) return TD_ERR_IO;
    atomic_fetch_add(&ops->pending, 1);
    atomic_fetch_add(&u->inflight, 1);
    return TD_OK;
}

td_status td_ucx_put(td_ucx_ep *ep, td_ucx_rkey *rk, const void *local, size_t len,
                     uint64_t remote_off, td_ucx_ops *ops) {
    if (!ep || !rk || !ops || (!local && len)) return TD_ERR_INVALID;
    td_ucx *u = ep->u;
    if (rk->ep != ep) {
        TD_LOG_ERROR("%s: an rkey used on another endpoint than its own", u->name);
        return TD_ERR_INVALID;
    }
    if (remote_off > rk->bytes || len > rk->bytes - remote_off) {
        TD_LOG_WARN("%s: put of %zu bytes at offset %" PRIu64 " outside the %" PRIu64
                    "-byte remote region",
                    u->name, len, remote_off, rk->bytes);
        return TD_ERR_RANGE;
    }
    if (len == 0) return atomic_load(&ep->failed) ? TD_ERR_IO : TD_OK;
    td_status st = op_begin(ep, ops);
    if (st != TD_OK) return st;
    ucp_request_param_t prm = {.op_attr_mask =
                                   UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                               .cb.send = op_cb,
                               .user_data = ops};
    ucs_status_ptr_t req = ucp_put_nbx(ep->ep, local, len, rk->base + remote_off, rk->rkey, &prm);
    atomic_fetch_add(&u->puts, 1);
    atomic_fetch_add(&u->put_bytes, len);
    return op_posted(u, ops, req, "ucp_put_nbx");
}

td_status td_ucx_flush(td_ucx_ep *ep, td_ucx_ops *ops) {
    if (!ep || !ops) return TD_ERR_INVALID;
    td_status st = op_begin(ep, ops);
    if (st != TD_OK) return st;
    ucp_request_param_t prm = {.op_attr_mask =
                                   UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                               .cb.send = op_cb,
                               .user_data = ops};
    return op_posted(ep->u, ops, ucp_ep_flush_nbx(ep->ep, &prm), "ucp_ep_flush_nbx");
}

/* ---- control messages ---- */

td_status td_ucx_send(td_ucx_ep *ep, const void *data, size_t len) {
    if (!ep || (!data && len)) return TD_ERR_INVALID;
    td_ucx *u = ep->u;
    if (atomic_load(&ep->failed)) return TD_ERR_IO;
    /* slot[0] is the channel, the message follows (freed by am_send_cb) */
    void **slot = malloc(sizeof(void *) + (len ? len : 1));
    if (!slot) return TD_ERR_NOMEM;
    slot[0] = u;
    uint8_t *copy = (uint8_t *)(slot + 1);
    if (len) memcpy(copy, data, len);
    /* eager up to TD_UCX_EAGER_MAX: a link worker takes nothing else */
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                               UCP_OP_ATTR_FIELD_USER_DATA |
                                               UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = len <= TD_UCX_EAGER_MAX ? UCP_AM_SEND_FLAG_EAGER : 0,
                               .cb.send = am_send_cb,
                               .user_data = slot,
                               .datatype = ucp_dt_make_contig(1)};
    atomic_fetch_add(&u->inflight, 1);
    ucs_status_ptr_t req = ucp_am_send_nbx(ep->ep, TD_UCX_AM_ID, NULL, 0, copy, len, &prm);
    if (req == NULL || UCS_PTR_IS_ERR(req)) {
        atomic_fetch_sub(&u->inflight, 1);
        free(slot);
        if (UCS_PTR_IS_ERR(req)) {
            TD_LOG_WARN("%s: ucp_am_send_nbx: %s", u->name, ucs_status_string(UCS_PTR_STATUS(req)));
            return TD_ERR_IO;
        }
        atomic_fetch_add(&u->msgs_sent, 1);
        return TD_OK;
    }
    atomic_fetch_add(&u->msgs_sent, 1);
    after_post(u);
    return TD_OK;
}

void td_ucx_stats_get(td_ucx *u, td_ucx_stats *st) {
    if (!st) return;
    memset(st, 0, sizeof *st);
    if (!u) return;
    st->put_bytes = atomic_load(&u->put_bytes);
    st->puts = atomic_load(&u->puts);
    st->msgs_sent = atomic_load(&u->msgs_sent);
    st->msgs_received = atomic_load(&u->msgs_received);
    st->msgs_dropped = atomic_load(&u->msgs_dropped);
    st->ep_errors = atomic_load(&u->ep_errors);
}
