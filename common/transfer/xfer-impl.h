/* What the transfer service shares with its two sides (xfer.h is the
 * contract): the service itself, the messages both sides send, and the
 * table a side fills in. xfer.c holds what both roles run (the control
 * channel's callbacks, the service thread, the exchange, lifetime, the
 * state); prefill/xfer-prefill.c holds P's side of the protocol (jobs,
 * puts, PrefillDone, TransferConsumed, the sources' release) and
 * decode/xfer-decode.c D's (remote-prefill admission, links, probes,
 * deadlines, fencing, quarantine, fallback to local prefill). Neither
 * side sees the other's types: the service keeps a pointer to each side's
 * state and calls a side only through its td_xfer_side.
 *
 * Locking (the whole service): one mutex (x->mu) guards the peer and job
 * tables and every endpoint's lifetime; it is never taken inside a UCX
 * callback (callbacks only set atomics and wake the service thread, or
 * queue a message under x->in_mu), so holding it across td_ucx_* calls
 * cannot deadlock with the progress thread. The scheduler's hooks take
 * x->mu; the scheduler never holds its own lock while calling them. */
#ifndef TD_TRANSFER_XFER_IMPL_H
#define TD_TRANSFER_XFER_IMPL_H

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>

#include "common/base/net.h"
#include "msg.h"
#include "ucx.h"
#include "xext.h"
#include "xfer.h"

#define TD_XFER_MAX_MSG        (16u << 20)
#define TD_XFER_EXCHANGE_LIMIT (1u << 20) /* bytes read from a peer's exchange endpoint */
#define TD_XFER_ID_LEN         64

typedef Tandem__Internal__V1__ControlMessage td_xfer_cmsg;
typedef Tandem__Internal__V1__Exchange td_xfer_exchange_msg;
/* Each side's own state, defined in its file. */
typedef struct td_xfer_prefill td_xfer_prefill; /* prefill/xfer-prefill.c */
typedef struct td_xfer_decode td_xfer_decode;   /* decode/xfer-decode.c */

/* A decoded control message and when it arrived (the exposed transfer
 * tail and the transfer time are measured at arrival, not after the hop to
 * the service thread). */
typedef struct {
    td_xfer_msg *m;
    uint64_t arrival_unix_ns;
    double arrival_s;
} td_xfer_inbox_msg;

/* One side of the protocol. The service thread calls on_msg for every
 * message, then service, then (where the side has one) the ranks' step and
 * after_sync; everything marked "under x->mu" is called with it held. */
struct td_xfer_side {
    const char *name; /* "prefill", "decode": the UCX worker's name, the state's role */
    /* td_xfer_create, before any thread starts: the side's checks of p and
     * its own state. The failure is logged. */
    td_status (*init)(td_xfer *x, const td_xfer_params *p);
    /* After the service thread started: the side's own threads. NULL: none. */
    td_status (*start)(td_xfer *x);
    /* A message from a peer (under x->mu); takes im->m. */
    void (*on_msg)(td_xfer *x, const td_xfer_inbox_msg *im);
    /* One pass over the side's jobs and peers (under x->mu). Returns true
     * when the ranks must take a transfer step (td_xext_sync) before
     * after_sync; *answer_waits: look again sooner. */
    bool (*service)(td_xfer *x, bool *answer_waits);
    /* After the ranks' step (under x->mu), unless the plan failed. NULL:
     * the side never waits for one. */
    void (*after_sync)(td_xfer *x);
    /* The user pointer of an endpoint that reported an error (a UCX
     * callback: atomics only). */
    void (*ep_failed)(void *user);
    /* td_xfer_stop, after the service thread stopped: stops the side's
     * threads (NULL: none). */
    void (*stop)(td_xfer *x);
    /* Then (under x->mu): hands over every open endpoint (at most max, the
     * rest closed without waiting) and forgets them. Returns the count. */
    int (*take_endpoints)(td_xfer *x, td_ucx_ep **eps, int max);
    /* td_xfer_destroy: frees the side's state (also after a failed init). */
    void (*free)(td_xfer *x);
    /* The side's part of the stats (under x->mu); ss: the scheduler's. */
    void (*stats)(td_xfer *x, const td_sched_stats *ss, td_xfer_stats *st);
    /* The state's "peers" (under x->mu). NULL: none. */
    void (*peers_json)(td_xfer *x, json_t *peers);
    /* The front ends' hook (td_xfer_submit_hook). NULL: none. */
    void (*submit)(td_xfer *x, td_gen_request *g);
    /* td_xfer_drained: whether the side may stop once the scheduler is
     * idle. NULL: always. */
    bool (*drained)(td_xfer *x);
};

struct td_xfer {
    td_xfer_params p;
    const td_xfer_side *side;
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
    td_xfer_inbox_msg *inbox;
    int n_inbox, cap_inbox;
    int wake_fd;
    pthread_t thread;
    bool thread_started, stopped;
    atomic_bool stop;
    atomic_uint_fast64_t bytes_put; /* P: KV bytes put into decode instances */
    td_xfer_prefill *pf;            /* the prefill side's state, or NULL */
    td_xfer_decode *dc;             /* the decode side's state, or NULL */
};

/* Wakes the service thread. */
void td_xfer_wake(td_xfer *x);
/* The wall clock in ns (peers compare deadlines and layer times with it). */
uint64_t td_xfer_unix_ns(void);
/* Packs m (token and sender filled in here) and sends it on ep. */
td_status td_xfer_send(td_xfer *x, td_ucx_ep *ep, td_xfer_cmsg *m);

/* This instance's exchange: its plan, the KV geometry, every rank's
 * endpoint (gathered by td_xext_setup). */
typedef struct {
    td_xfer_exchange_msg ex;
    Tandem__Internal__V1__Plan plan;
    Tandem__Internal__V1__KvGeometry kv;
    Tandem__Internal__V1__RankEndpoint rank[TD_COMM_MAX_RANKS];
    Tandem__Internal__V1__RankEndpoint *ranks[TD_COMM_MAX_RANKS];
    uint32_t stage[TD_PLAN_MAX_PP + 1];
    uint8_t compat[16];
} td_xfer_own_exchange;
/* link: the slot whose link workers' addresses go in (the decode side's
 * exchange for one prefill instance), -1: the ranks' own workers. */
td_status td_xfer_build_exchange(td_xfer *x, td_xfer_own_exchange *o, uint64_t exchange_id,
                                 int link);
/* The plan an exchange describes. */
td_xfer_plan td_xfer_plan_of(const td_xfer_exchange_msg *ex);

#endif
