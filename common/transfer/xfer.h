/* KV migration between a prefill instance (P) and a decode instance (D):
 * the ownership protocol of DESIGN.md §2 on the UCX channel of §4.
 *
 * D (role decode) attaches a KV import to every request its front ends
 * submit (td_xfer_submit_hook). At admission the scheduler hands it the
 * prompt's destination blocks; unless the uncached prompt is below the
 * local-prefill threshold or no P is linked, D sends a PrefillRequest (the
 * tokens, its block ids, its endpoints and rkey the first time, a
 * deadline) to the next linked P, round-robin, and the sequence waits.
 * P queues the job in its own scheduler (batched with other D's jobs,
 * reusing its prefix cache) with a KV export: as each layer of each chunk
 * is computed, P puts that layer's new K/V rows into D's blocks
 * (ucp_put_nbx of contiguous block runs, range-checked against D's
 * region); after the first token it flushes, then sends PrefillDone (first
 * token, logprobs, sampler state). D then decodes.
 *
 * Every wait is bounded and every failure explicit; the per-job states of
 * both ends are jobstate.h's. The request's deadline bounds when P must
 * *start* the job (or refuse it: PrefillRejected, nothing written, the
 * blocks reused at once; among its reasons WOULD_MISS_DEADLINE: P's queue,
 * at the prefill speed its steps measured, would not let it start in time,
 * so it says so on arrival with when it could start, and D prefills
 * locally at once). Once started, P sends JobProgress as each chunk starts
 * and D waits on while it hears from P at least once a lease: a long
 * prompt on a busy but live P is never given up on for being long. P puts
 * nothing past its lease, which D renews (LeaseRenewal, with its end as a
 * point in time) only while it still wants the job; P fails a job it
 * could not start in time or whose lease ran out (TransferFailed: flushed
 * and stopped, the blocks reused). When D gives up on one job (no start
 * by the deadline, a lease of silence) or the client goes, it sends Abort
 * and stops renewing; P stops the job, flushes and answers JobAborted
 * (also for a job it never had, whose id it then refuses), and D frees
 * the blocks on it; the request prefills locally at once in fresh blocks.
 * Only silence fences: no word from P within a grace after its last lease
 * ended, an endpoint error, or a new epoch of P's. Fencing quarantines
 * the destination blocks until D has force-closed its endpoint to P,
 * destroyed the link workers P puts into (below) and P's last lease (plus
 * a second) has passed, and only then frees them. P takes a request id at
 * most once (it remembers every id until its deadline), so a duplicated
 * or late copy never writes into blocks D has reused. P never frees source
 * blocks while its puts are in flight: it waits for the flush, and at the
 * end of its lease closes its endpoints to that D once they are flushed
 * (delivered, or failed when the transport learns D is gone; forced after
 * 30 s), keeping the sources until then.
 *
 * Parallel plans: every rank of both instances has its own UCP worker and
 * its KV pool in UCX memory; the exchange lists every rank's endpoint.
 * On P every rank puts its own layers, KV heads and CP blocks into the
 * decode ranks that hold them (the transfer mapping, map.h), steered by
 * directives that travel with the step plan (xrank.h): a new decode
 * instance (PEER), a job (JOB), its end (DROP). Any two plans the mapping
 * accepts pair (attention-DP plans do not).
 *
 * Link workers (the fence's teeth): D gives each P its own UCP worker on
 * every D rank (td_ucx_link_create; the exchange D sends that P carries
 * their addresses), so everything a P sends D (puts, control messages)
 * arrives on workers of that P's link alone. Fencing destroys them, which
 * closes every connection the P made: over TCP, puts still queued in P's
 * socket or in the network when a link was cut are dropped when they
 * arrive, instead of being applied by D's worker into blocks that now
 * belong to another sequence (closing D's own endpoint does not close the
 * connection P opened). A relink opens new ones. Over shared memory P
 * writes D's segment itself; there P's lease, checked before every put,
 * bounds it, and D's quarantine outlasts that lease by a second.
 *
 * Threads: UCX callbacks only record what happened and wake this module's
 * service thread, which does the follow-up (messages, fencing, releases,
 * links to P: its exchange is fetched from P's internal HTTP endpoint). */
#ifndef TD_TRANSFER_XFER_H
#define TD_TRANSFER_XFER_H

#include <stdbool.h>
#include <stdint.h>

#include "common/api/request.h"
#include "common/base/base.h"
#include "common/kv/hash.h"
#include "common/obs/metrics.h"
#include "common/parallel/exec.h"
#include "common/sched/sched.h"

typedef struct td_xfer td_xfer;
/* One side of the protocol: td_xfer_prefill_side (prefill/xfer-prefill.h)
 * or td_xfer_decode_side (decode/xfer-decode.h), handed down by the
 * service's main. */
typedef struct td_xfer_side td_xfer_side;

typedef struct {
    const td_xfer_side *side;  /* required */
    const char *instance_id;   /* this instance's name for peers (copied; 1..63 printable) */
    const char *cluster_token; /* shared secret of the cluster (copied; required) */
    td_sched *sched;           /* borrowed: the instance's scheduler */
    td_exec *exec;             /* borrowed: its ranks (a world of one) */
    td_metrics *metrics;       /* borrowed; may be NULL */
    td_kv_hash compat;         /* the instance's compatibility hash */
    int32_t max_ctx;           /* longest sequence */
    int deadline_ms;           /* D: by when P must start a remote prefill (default 30000) */
    int lease_ms;              /* lease D asks for and renews every lease/3; a started job with
                                * no word from P for this long is given up, and P's word on an
                                * aborted one is awaited this long after P's last lease
                                * (default 3000) */
    /* decode */
    /* NAME:PORT of P's HTTP endpoints (copied): each name is resolved every
     * dns_interval_ms and every address it has is a P instance (a headless
     * Service answers with every ready pod). The router names P instances
     * too (td_gen_request.route_prefill), by address. */
    const char *const *prefill;
    int n_prefill;
    int dns_interval_ms; /* default 5000 */
    int forget_ms;       /* a P neither resolved nor named by the router, and not linked,
                          * for this long is forgotten (default 60000) */
    int32_t local_prefill_threshold; /* uncached prompt tokens below which D prefills
                                      * itself (default 0: always remote) */
    int link_interval_ms;            /* retry period for unlinked P (default 500) */
    /* prefill */
    bool layerwise; /* push each layer as it is computed (default true); false: all
                     * layers after the last chunk, for the benchmark */
} td_xfer_params;

td_xfer_params td_xfer_default_params(void);

/* Creates the UCX worker, maps the KV pool, starts the service thread. */
td_status td_xfer_create(const td_xfer_params *p, td_xfer **x_p);
/* Shutdown, in this order: td_xfer_stop (stops the service thread, closes
 * every endpoint and waits for the closes, so no put touches the KV any
 * more), then td_sched_destroy (which ends every sequence and frees every
 * held or quarantined block; the hooks it calls stay valid), then
 * td_xfer_destroy (frees the KV memory UCX allocated: the pool is unused
 * from then on and must only be destroyed). Both accept NULL. */
void td_xfer_stop(td_xfer *x);
void td_xfer_destroy(td_xfer *x);

/* D: the front ends' hook (td_api_submit_hook with ctx = x); nothing on P. */
void td_xfer_submit_hook(void *x, td_gen_request *g);
/* Whether the instance may stop now that its scheduler is idle: P stays
 * until the KV it produced has been consumed (or its lease ran out); D
 * may always. */
bool td_xfer_drained(td_xfer *x);
/* P: GET /internal/v1/kv/exchange (http.h's kv_exchange, ctx = x). */
td_status td_xfer_exchange(void *x, uint8_t **buf, size_t *len);
/* The "transfer" object of /internal/v1/state (http.h's state_transfer). */
char *td_xfer_state_json(void *x);

typedef struct {
    int32_t in_flight;     /* remote prefills / export jobs not yet finished */
    int32_t leased_blocks; /* D: destinations of in-flight jobs; P: sources held */
    int32_t quarantined_blocks;
    int32_t awaiting_consume; /* P: PrefillDone sent, TransferConsumed not yet seen */
    int32_t linked_peers;     /* D: P instances ready */
    uint64_t bytes_put;       /* P */
} td_xfer_stats;
void td_xfer_stats_get(td_xfer *x, td_xfer_stats *st);
/* Adds the transfer gauges to g (g->disagg set). */
void td_xfer_gauges(td_xfer *x, td_metrics_gauges *g);

#endif
