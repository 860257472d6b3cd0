/* The HTTP front end (libmicrohttpd, one thread per connection): the
 * OpenAI surface of DESIGN.md §7 — POST /v1/completions,
 * POST /v1/chat/completions (SSE when stream is true), GET /v1/models,
 * POST /tokenize, POST /detokenize, GET /health, GET /ready, GET /metrics —
 * and GET /internal/v1/state?since=N for the router.
 *
 * /internal/v1/state answers (the router's view of the instance):
 *   {"instance_id": str, "epoch": "16 hex digits" (a string: 64 bits do not
 *    fit JSON integers everywhere), "compat": "32 hex" (the compatibility
 *    hash: the parent of every sequence's first block, kv/hash.h),
 *    "last_seq": N, "full": bool,
 *    "events": [{"seq": N, "type": "stored"|"removed"|"cleared",
 *                "hash": "32 hex"}]          (full == false: the diff after since)
 *    "hashes": ["32 hex", ...]               (full == true: every stored hash)
 *    "load": {"running", "waiting", "queued_prefill_tokens",
 *             "prefill_tokens_per_s" (the prefill speed its steps measured; 0: none yet),
 *             "kv": {"total", "empty", "cached", "used", "reserved",
 *                    "free" (empty + cached - reserved), "block_size"}},
 *    "role": "prefill"|"decode"|"colocated", "draining": bool,
 *    "max_ctx": N (longest sequence), "grpc_port": N (0: none)}
 * since absent is 0; since that is not a decimal number is 400. A
 * disaggregated instance adds "transfer": {...} (state_transfer).
 *
 * Request threads parse into C structs and hand the work to the scheduler
 * through td_gen_stream (the only hand-off). A client that disconnects
 * (streaming or not) cancels its request within a second: the waiting
 * thread polls the connection's socket together with the stream's fd.
 * Streams send ": ping" comments while nothing else is sent for
 * ping_interval_s. Errors before the headers are the OpenAI error object
 * with its status; after the headers, a `data: {"error": ...}` event and
 * then `data: [DONE]`.
 *
 * API keys: "Authorization: Bearer KEY" compared in constant time against
 * every configured key; every path except /health, /ready and /metrics
 * needs one when keys are configured (metrics_need_key puts /metrics
 * behind the key too). */
#ifndef TD_API_HTTP_H
#define TD_API_HTTP_H

#include <stdbool.h>
#include <stdint.h>

#include "common/base/base.h"
#include "common/obs/metrics.h"
#include "common/sched/sched.h"
#include "request.h"

typedef struct {
    const char *host; /* address to bind (default "127.0.0.1"; "::1" and "0.0.0.0" work) */
    int port;         /* 0: an ephemeral port (see td_http_server_port) */
    td_sched *sched;  /* NULL when submit_hook.submit is the back end */
    td_api_submit_hook submit_hook; /* decode instance: attaches remote prefill */
    td_metrics *metrics;            /* may be NULL */
    td_api_model model;
    td_api_limits limits;
    const char *const *api_keys; /* (n_api_keys) copied; none: no auth */
    int n_api_keys;
    bool metrics_need_key;
    int max_connections;     /* default 1024 */
    size_t max_header_bytes; /* per-connection memory for the request line + headers
                              * (default 16 KiB); beyond it libmicrohttpd answers 431/413 */
    double ping_interval_s;  /* default 5 */
    int retry_after_s;       /* Retry-After on 429 (default 1) */
    const char *instance_id; /* reported by /internal/v1/state (copied; default the host:port) */
    const char *role;        /* reported by /internal/v1/state: "prefill", "decode" or
                              * "colocated" (NULL; a static string) */
    int32_t kv_block_size;   /* KV block size reported by /internal/v1/state (default 16) */
    /* Disaggregation. With a cluster token, every /internal/
     * path needs "X-Tandem-Cluster-Token: TOKEN" (constant-time compare)
     * instead of an API key. */
    const char *cluster_token; /* copied; NULL: internal paths use the API keys */
    /* GET /internal/v1/kv/exchange (a prefill instance's UCX endpoints, a
     * packed tandem.internal.v1.ControlMessage): fills a malloc'd buffer;
     * NULL: 404. */
    td_status (*kv_exchange)(void *ctx, uint8_t **buf, size_t *len);
    /* Extra members of /internal/v1/state's "transfer" object: a malloc'd
     * JSON object text, or NULL. */
    char *(*state_transfer)(void *ctx);
    /* Adds the transfer gauges to /metrics. */
    void (*gauges)(void *ctx, td_metrics_gauges *g);
    /* Prometheus text appended to /metrics: malloc'd, or NULL. */
    char *(*metrics_extra)(void *ctx);
    /* GET /internal/v1/cluster (the router's view; cluster token like
     * the other /internal/ paths): a malloc'd JSON text; NULL function: 404. */
    char *(*cluster_json)(void *ctx);
    void *internal_ctx;
    bool internal_only; /* a prefill instance: the public API paths answer 404 */
} td_http_params;

td_http_params td_http_default_params(void);

typedef struct td_http_server td_http_server;

/* Binds and starts serving. Everything in p is borrowed (sched, metrics,
 * tokenizer) or copied (strings). TD_ERR_IO (logged) if the address cannot
 * be bound. Stop with td_http_server_stop(). */
td_status td_http_server_start(const td_http_params *p, td_http_server **srv_p);
/* The port actually bound. */
int td_http_server_port(const td_http_server *srv);
/* The instance's gRPC port, reported by /internal/v1/state as "grpc_port"
 * (0 until set: none). */
void td_http_server_set_grpc_port(td_http_server *srv, int port);
/* Stops accepting, closes every connection (their requests are cancelled)
 * and frees the server. Accepts NULL. */
void td_http_server_stop(td_http_server *srv);

#endif
