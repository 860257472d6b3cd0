/* What the router's files share (router.h is the contract): the instance
 * slots, the proxied requests and the router itself, and the functions
 * one file calls in another. One mutex (r->mu) guards the instances'
 * figures, the queue and every request's state; the prefix index has its
 * own lock. Only the poller thread creates, updates the address of, and
 * frees instance slots (after td_router_create).
 *   router.c  the instances' slots, create / destroy, drain
 *   route.c   the routing decision: compatibility groups, the pair, the
 *             predicted prefix entries
 *   proxy.c   the proxied requests: submit, the queue for KV headroom,
 *             the calls to decode instances, retries, abort
 *   poller.c  the poller thread: state pulls, health, DNS
 *   report.c  the metrics text, the cluster view, the gauges */
#ifndef TD_ROUTER_IMPL_H
#define TD_ROUTER_IMPL_H

#include <curl/curl.h>
#include <pthread.h>
#include <stdatomic.h>

#include "common/base/net.h"
#include "common/base/strbuf.h"
#include "dclient.h"
#include "index.h"
#include "proto/internal.pb-c.h"
#include "router.h"

#define MAXI        TD_RT_MAX_INSTANCES
#define MAX_GROUPS  8
#define STATE_LIMIT (64u << 20)        /* largest /internal/v1/state reply read */
#define FIG_MAX     ((int64_t)1 << 40) /* peer-reported figures are clamped to 0..FIG_MAX */
/* A decode instance whose state pulls fail this many times in a row has its
 * calls cancelled (they would otherwise wait on a peer that is gone). */
#define VANISHED_POLLS 3

typedef struct {
    bool used, removed, prefill, dns;
    char addr[136]; /* HOST:PORT or [V6]:PORT of its HTTP port */
    /* From its last state (under r->mu). */
    bool healthy, have_state, draining;
    uint64_t epoch;
    char id[64];
    td_kv_hash compat;
    int32_t group; /* -1: none yet, or too many groups */
    uint64_t since;
    int32_t block_size, max_ctx, grpc_port;
    int32_t running, waiting;
    int64_t queued_prefill_tokens, kv_total, kv_free, kv_used, kv_cached;
    double prefill_tokens_per_s; /* its measured prefill speed (0: unknown) */
    td_rt_extra ttft_extra;      /* first tokens on it past its queue's prediction (router side) */
    char target[160];            /* HOST:GRPC_PORT (decode instances) */
    /* Router side (under r->mu). */
    int64_t pending_blocks, pending_prefill;
    double snap_s;      /* when the last applied state pull was sent: requests routed
                         * since are in pending_prefill, earlier ones in its figures */
    double pull_sent_s; /* when the latest pull was sent (> snap_s: it is out) */
    /* taken back (first token, end) while a pull sent after their routing
     * was out: its reply may still count them, and is corrected by these */
    int64_t rel_tokens, rel_blocks;
    uint64_t pulls; /* state pulls applied */
    int32_t in_flight;
    int32_t down_polls; /* state pulls failed in a row */
    uint64_t routed, failures;
    char err[160];
    /* The poller's own (no lock). */
    CURL *easy;
    td_strbuf body;
    struct curl_slist *hdr;
} inst;

typedef enum { Q_NEW = 0, Q_QUEUED, Q_RUNNING, Q_DONE } req_state;

typedef struct rt_req {
    td_router *r;
    td_gen_stream *st;
    Tandem__V1__GenerateRequest *greq; /* owned: what every attempt sends */
    int32_t *prompt;                   /* (n_prompt) */
    int32_t n_prompt, max_tokens;
    char **stop; /* (n_stop) */
    int32_t n_stop;
    bool logprobs;
    char id[64];
    /* Under r->mu. */
    req_state state;
    struct rt_req *next;                /* in the queue */
    struct rt_req *all_prev, *all_next; /* in r->all from submit to release */
    td_rt_dcall *call;
    int attempts;
    td_rt_mask excluded;
    bool got_first, cancelled, finished, retry_hint, producer_done;
    bool admitting; /* its first routing (the unmeetable check applies) */
    bool counted;   /* in r->n_streams */
    int32_t d, p;
    double t_arrival, t_queued, t_dispatch, t_first, t_last;
    char last_error[400];     /* for the logs: names the instance */
    const char *client_error; /* for the client (static or d_message), or NULL */
    int d_status;             /* the last attempt's in-stream Error: its HTTP status, 0 none */
    char d_message[256];      /* and its message (printable ASCII) */
    bool vanished;            /* its decode instance stopped answering: cancelled by us */
    double expect_ms;         /* its first routing: the queue's prediction of the first token */
    int32_t expect_at;        /* on that instance (-1: no prediction, speed unknown) */
    td_kv_hash *hashes;       /* (n_hashes) the prompt's blocks in the chosen group */
    int32_t n_hashes;
    /* the prompt tokens its routing gave an instance to compute (pp_tokens
     * 0: none outstanding) and when: counted in that instance's
     * pending_prefill until a state pull sent after pp_t, in the pulled
     * queue figure after it; taken back from there at the first token or
     * the end */
    int32_t pp_at;
    int64_t pp_tokens;
    double pp_t;
    /* the same for the blocks its decode instance reserves for it
     * (pending_blocks, then the pulled kv figures): taken back at the end */
    int32_t pb_at;
    int64_t pb_blocks;
} rt_req;

struct td_router {
    td_router_params p;
    char *token;
    char *prefill_dns, *decode_dns;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* the poller's wake-up; idle waiters */
    inst *in;          /* (MAXI) */
    int32_t n_slots;   /* highest used slot + 1 */
    td_kv_hash groups[MAX_GROUPS];
    int32_t group_bs[MAX_GROUPS];
    int32_t n_groups;
    float *xfer; /* (MAXI x MAXI) [p * MAXI + d] ms, < 0 unknown */
    td_rt_index *ix;
    td_rt_dclient *dc;
    rt_req *q_head, *q_tail;
    int32_t n_queued;
    int32_t n_active; /* requests submitted, not yet let go by the router */
    rt_req *all;      /* those requests */
    int32_t n_running;
    atomic_int n_streams; /* handed to a front end, not yet freed */
    uint64_t counter, rng;
    bool draining, stop;
    pthread_t poller;
    bool poller_started;
    td_net_watch *dns; /* --prefill-dns / --decode-dns, resolved on its own thread */
    const char *dns_names[2];
    int n_dns;
    char (*dns_addrs)[TD_NET_ADDR_LEN]; /* (n_dns x MAXI) the round taken (poller) */
    int dns_n[2];
    CURLM *multi;
    /* Counters (under mu). */
    uint64_t decisions[TD_RT_N_POLICIES][TD_RT_N_REASONS];
    uint64_t hit_prefill_tokens, hit_decode_tokens, prompt_tokens, retries, rejected, timeouts;
    uint64_t unmeetable; /* answered 429: their first token could not come within the SLO */
    uint64_t failed[2];  /* requests that ended in an error, before / after their first token */
    double decide_s;
    uint64_t n_decide;
};

/* ---- router.c: the instances' slots */

/* Copies a peer's string as printable ASCII ('?' for anything else), so
 * that it can be cut anywhere and always stays valid JSON text. */
void td_rt_ascii_copy(char *dst, size_t n, const char *src);
/* A fresh slot for the instance at addr (HOST:PORT of its HTTP port, not
 * polled yet): its index; -1 (logged) with every slot in use. */
int32_t td_rt_slot_add(td_router *r, const char *addr, bool prefill, bool dns);
/* Poller thread, under mu: frees a removed slot that nothing uses. */
void td_rt_slot_free_locked(td_router *r, int32_t i);
/* Whether slot i may be chosen now (under mu): in use and not removed,
 * healthy, with a state, not draining, in a compatibility group, with a
 * gRPC port (decode instances), and not in excluded (may be NULL). */
bool td_rt_usable(const td_router *r, int32_t i, const td_rt_mask *excluded);

/* ---- route.c */

/* The compatibility group of compat for slot `self` (whose own current
 * group does not count as in use): a group no other instance is in any
 * more is reused, so compat values that come and go (upgrades, restarts)
 * never exhaust the MAX_GROUPS live ones. -1 with MAX_GROUPS in use. */
int32_t td_rt_group_of_locked(td_router *r, td_kv_hash compat, int32_t bs, int32_t self);
/* The pair will hold q's prompt blocks: predicted entries, so that its
 * siblings follow before the KV events arrive. Made at the decision and
 * renewed at the first token (a prefill may wait longer than the TTL). */
void td_rt_predict_locked(td_router *r, const rt_req *q, int32_t d, int32_t p, double now);
/* Logs a decision (td_router_params.log_decisions): the figures vi of
 * the n instances it weighed, their overlaps (NULL: not kv-aware), what
 * td_rt_choose_traced weighed, its status and choice (report.c; under mu). */
void td_rt_log_decision_locked(const td_router *r, const rt_req *q, const td_rt_inst *vi, int32_t n,
                               const int32_t *overlap, const td_rt_trace *t, const td_rt_choice *c,
                               td_status st, double now);
/* Chooses the pair for q (under mu) and records the decision. */
td_status td_rt_route_locked(td_router *r, rt_req *q, td_rt_choice *c);
/* Takes q's routing's prefill tokens back out of what the router counts
 * queued on its instance (its prefill is done, or it ended) and, when
 * `ended`, its blocks out of what it counts in use on its decode instance:
 * out of pending_prefill and pending_blocks, or out of the pulled figures
 * when the last pull was sent after the routing (under mu). */
void td_rt_release_pending_locked(td_router *r, rt_req *q, bool ended);

/* ---- proxy.c */

/* A decode instance stopped answering its state pulls: its calls are
 * cancelled (retried elsewhere when no token was sent yet), so no client
 * waits on an instance that is gone. */
void td_rt_cancel_calls_of_locked(td_router *r, int32_t d);
/* Dispatches the queued requests that fit now, ends those that waited too
 * long (under mu). */
void td_rt_process_queue_locked(td_router *r);

/* Ends every queued request as aborted (under mu; td_router_destroy). */
void td_rt_abort_queued_locked(td_router *r);

/* ---- poller.c */

/* The poller thread (arg: the router), from td_router_create to stop. */
void *td_rt_poller_main(void *arg);

#endif
