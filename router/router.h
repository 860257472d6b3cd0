/* tandem-router's core (docs/ARCHITECTURE.md): the cluster view (static
 * and DNS-discovered prefill and decode instances, polled over
 * GET /internal/v1/state with the cluster token: health, draining, load,
 * KV events into the prefix index, per-pair transfer times), the routing
 * decision (score.h) and the proxying of every request to its decode
 * instance over tandem.internal.v1.Decode/Generate (dclient.h), with
 * retries before the first token and a bounded queue while no decode
 * instance has headroom. The public HTTP and gRPC front ends (common/api)
 * sit on top through td_router_submit_hook().
 *
 * Soft state only: several routers may run side by side.
 * Thread-safety: every function may be called from any thread. */
#ifndef TD_ROUTER_ROUTER_H
#define TD_ROUTER_ROUTER_H

#include <stdbool.h>
#include <stdint.h>

#include "common/api/request.h"
#include "common/obs/metrics.h"
#include "common/route/score.h"

typedef struct {
    const char *cluster_token; /* required (copied) */
    /* Static instances: "HOST:PORT" of their HTTP port (copied). */
    const char *const *prefill;
    int n_prefill;
    const char *const *decode;
    int n_decode;
    /* "NAME:PORT": re-resolved every dns_interval_s (a Kubernetes headless
     * Service); NULL: none. */
    const char *prefill_dns;
    const char *decode_dns;
    double dns_interval_s;  /* default 5 */
    double poll_interval_s; /* state pull (and health check) period, default 0.1 */
    double poll_timeout_s;  /* one state pull, default 1 */
    td_rt_score_params score;
    int max_retries;        /* further attempts before the first token, default 2 */
    int max_queued;         /* requests waiting for headroom, default 256 (then 429) */
    double queue_timeout_s; /* longest wait in that queue (then 503), default 30 */
    /* Admission: a new request whose first token the chosen pair's queue
     * and measured prefill speed put past ttft_slo_ms is answered 429 at
     * once (reject_unmeetable; off by default). */
    bool reject_unmeetable;
    double ttft_slo_ms;
    double predict_ttl_s;  /* predicted index entries, from the decision and again from
                            * the first token, default 10 */
    double call_timeout_s; /* whole proxied call, 0: none (default) */
    int32_t block_size;    /* the prompt hashes' block size, default 16 */
    td_metrics *metrics;   /* vllm:* request metrics as the router sees them; may be NULL */
    uint64_t seed;         /* random policy and temperature; 0: from the OS */
    /* each decision logged (INFO, "decision {JSON}"): the instances as the
     * router saw them, every candidate's cost, the choice */
    bool log_decisions;
} td_router_params;

td_router_params td_router_default_params(void);

typedef struct td_router td_router;

/* Starts the poller and the decode client. TD_ERR_INVALID (logged) for bad
 * parameters (an address that is not HOST:PORT, more than
 * TD_RT_MAX_INSTANCES instances). Free with td_router_destroy(), after the
 * front ends stopped. */
td_status td_router_create(const td_router_params *p, td_router **r_p);
/* Ends every request still queued or running (abort) and frees. */
void td_router_destroy(td_router *r); /* accepts NULL */

/* The back end for the front ends: submit, readiness, metrics text and the
 * cluster view (td_http_params.metrics_extra / cluster_json with
 * internal_ctx = r). */
td_api_submit_hook td_router_submit_hook(td_router *r);
char *td_router_metrics_text(void *r);
char *td_router_cluster_json(void *r);
/* Gauges for vllm:num_requests_running / waiting (proxied / queued). */
void td_router_gauges(void *r, td_metrics_gauges *g);

/* Draining: /ready turns 503, new requests get 503, running ones go on.
 * td_router_wait_idle waits up to timeout_s for none to run or wait;
 * true when idle. */
void td_router_drain(td_router *r);
bool td_router_wait_idle(td_router *r, double timeout_s);
/* Ends every request still queued or running as aborted by the server
 * (the front ends send the client 503 / an error event, not a truncated
 * success); td_router_wait_idle then lets them write it. */
void td_router_abort_all(td_router *r);

#endif
