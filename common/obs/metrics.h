/* Serving metrics (Prometheus text exposition) and the per-request log line.
 *
 * Names follow vLLM exactly where vLLM has the metric (DESIGN.md §7), with
 * the label model_name="<served model name>"; Tandem's own use the
 * "tandem:" prefix. Every function is thread-safe (the scheduler thread
 * records token timings, HTTP/gRPC threads record errors and render).
 *
 * Rendered families (counters end in _total in the text):
 *   gauges     vllm:num_requests_running, vllm:num_requests_waiting,
 *              vllm:kv_cache_usage_perc (used / total, 0..1),
 *              tandem:kv_blocks{state="empty|cached|used|reserved|total"},
 *              tandem:kv_fragmentation, tandem:queued_prefill_tokens, tandem:draining
 *   counters   vllm:prompt_tokens, vllm:generation_tokens,
 *              vllm:request_success{finished_reason="stop|length|abort|error"},
 *              vllm:prefix_cache_queries, vllm:prefix_cache_hits (tokens),
 *              vllm:num_preemptions, tandem:kv_evictions,
 *              tandem:request_errors{code="<http status>",type="<error type>"}
 *   histograms vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
 *              vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds,
 *              vllm:request_prefill_time_seconds, vllm:request_decode_time_seconds,
 *              vllm:request_inference_time_seconds,
 *              vllm:request_prompt_tokens, vllm:request_generation_tokens,
 *              vllm:iteration_tokens_total
 * Latency buckets span 1 ms .. 320 s so both GPU and CPU latencies land in
 * distinct buckets; token-count buckets are powers of two, 1 .. 131072.
 * Gauges (and tandem:kv_evictions) come from the td_metrics_gauges passed
 * to td_metrics_render; the rest accumulate here. Non-finite observations
 * are dropped, negative latencies count as 0. */
#ifndef TD_METRICS_H
#define TD_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/base/base.h"

typedef enum {
    TD_FINISH_NONE = 0, /* still running */
    TD_FINISH_STOP,     /* EOS / stop token / stop string */
    TD_FINISH_LENGTH,   /* max_tokens or the context */
    TD_FINISH_ABORT,    /* cancelled by the client or by the server (drain timeout) */
    TD_FINISH_ERROR,    /* failed inside the engine */
    TD_FINISH_COUNT
} td_finish_reason;

/* "stop", "length", "abort", "error" (NULL for TD_FINISH_NONE). */
const char *td_finish_reason_str(td_finish_reason r);

/* What the scheduler knows about a finished request. Times are td_time_s(). */
typedef struct {
    const char *id; /* request id ("cmpl-...") */
    int32_t n_prompt_tokens;
    int32_t n_cached_tokens; /* prompt tokens served from the prefix cache */
    int32_t n_output_tokens;
    td_finish_reason finish;
    double t_arrival;     /* submitted to the scheduler */
    double t_scheduled;   /* first admitted (queue time = t_scheduled - t_arrival) */
    double t_first_token; /* 0 if none */
    double t_finished;
    int32_t n_preemptions;
    double prefill_compute_s; /* forward-pass time of the steps that carried this request
                               * until its first token (its share of the engine's work and
                               * its batch-mates'); TTFT minus this is serving overhead */
} td_request_record;

/* Disaggregation. */
typedef enum {
    TD_XFER_FAIL_DEADLINE,   /* the transfer's deadline fired */
    TD_XFER_FAIL_PEER_ERROR, /* the UCX endpoint reported an error */
    TD_XFER_FAIL_REJECTED,   /* PrefillRejected */
    TD_XFER_FAIL_FAILED,     /* TransferFailed */
    TD_XFER_FAIL_ABORTED,    /* client gone / Abort */
    TD_XFER_FAIL_INVALID,    /* a message failed validation */
    TD_XFER_FAIL_COUNT
} td_xfer_fail;
typedef enum {
    TD_LOCAL_PREFILL_THRESHOLD, /* uncached prompt below --local-prefill-threshold */
    TD_LOCAL_PREFILL_NO_PEER,   /* no prefill instance reachable */
    TD_LOCAL_PREFILL_FALLBACK,  /* the remote prefill failed */
    TD_LOCAL_PREFILL_ROUTER,    /* the router asked for it */
    TD_LOCAL_PREFILL_SATURATED, /* every reachable prefill instance said it is saturated */
    TD_LOCAL_PREFILL_COUNT
} td_local_prefill;
typedef struct td_metrics td_metrics;
/* Bytes moved and one transfer's time (seconds < 0: bytes only). */
void td_metrics_kv_transfer(td_metrics *m, uint64_t bytes, double seconds);
void td_metrics_kv_transfer_failure(td_metrics *m, td_xfer_fail why);
/* The exposed transfer tail of one remote prefill (decode side). */
void td_metrics_kv_transfer_tail(td_metrics *m, double seconds);
/* A prefill on a decode instance: remote, or local for reason why. */
void td_metrics_prefill_route(td_metrics *m, bool remote, td_local_prefill why);

/* Instantaneous figures the renderer asks for (from the scheduler). */
typedef struct {
    int32_t running, waiting;
    int64_t queued_prefill_tokens;
    int32_t kv_total, kv_empty, kv_cached, kv_used, kv_reserved;
    double kv_fragmentation;
    uint64_t kv_evictions;
    bool draining;
    /* a prefill or decode instance: the transfer families */
    bool disagg;
    int32_t kv_leased, kv_quarantined, xfer_in_flight;
} td_metrics_gauges;

typedef struct td_metrics td_metrics;

/* model_name is copied. Free with td_metrics_destroy(). */
td_status td_metrics_create(const char *model_name, td_metrics **m_p);
void td_metrics_destroy(td_metrics *m); /* accepts NULL */

/* Scheduler side. All accept m == NULL (no-op).
 * first_token records the TTFT and the queue-time histograms (queue time is
 * recorded only here, so a request aborted while waiting adds none). */
void td_metrics_first_token(td_metrics *m, double ttft_s, double queue_s);
void td_metrics_inter_token(td_metrics *m, double itl_s); /* one per output token after the first */
void td_metrics_prefix_cache(td_metrics *m, int64_t queried_tokens, int64_t hit_tokens);
void td_metrics_preemption(td_metrics *m);
void td_metrics_iteration(td_metrics *m, int32_t n_tokens); /* tokens in one forward step */
/* Per-rank time of one step of the instance's parallel plan (n ranks,
 * at most TD_METRICS_MAX_RANKS are kept): counters
 * tandem:rank_compute_seconds_total{rank} and tandem:rank_comm_seconds_total{rank}
 * (communication: inside comm calls, waiting for peers included), and the
 * last step's tandem:rank_step_compute_seconds{rank} /
 * tandem:rank_step_comm_seconds{rank} gauges; tandem:plan_steps_total. */
#define TD_METRICS_MAX_RANKS 64
void td_metrics_rank_step(td_metrics *m, int n, const double *compute_s, const double *comm_s);
/* Tokens routed to each expert in one step, summed over the layers (n
 * experts, at most TD_METRICS_MAX_EXPERTS are kept): counter
 * tandem:expert_tokens_total{expert} and the last routed step's
 * tandem:expert_load_imbalance (max / mean over the experts; 1 is even). */
#define TD_METRICS_MAX_EXPERTS 256
void td_metrics_expert_load(td_metrics *m, int n, const int64_t *tokens);
/* Records every per-request histogram and counter for r (prompt and
 * generation token counters, request_success by finish reason, e2e, prompt
 * and generation token counts; inference time when t_scheduled > 0; prefill
 * and decode time when t_first_token > 0 too), and writes the structured log
 * line (td_obs_log_request). */
void td_metrics_request_finished(td_metrics *m, const td_request_record *r);

/* API side: a request rejected or failed with an HTTP status (gRPC maps its
 * codes to the HTTP equivalents) and an OpenAI error type (NULL or "" is
 * counted as "unknown"; types are cut at 63 bytes; past 63 distinct pairs,
 * new pairs are counted as code="0",type="other"). */
void td_metrics_request_error(td_metrics *m, int http_status, const char *type);

/* Prometheus text format 0.0.4. *text_p is malloc'd (caller frees); len_p
 * may be NULL. g may be NULL: the gauge families are then left out. */
td_status td_metrics_render(td_metrics *m, const td_metrics_gauges *g, char **text_p,
                            size_t *len_p);

/* One line at INFO on stderr, key=value pairs:
 * "I request: id=... prompt_tokens=N cached_tokens=N output_tokens=N
 *  queue_ms=.. ttft_ms=.. e2e_ms=.. finish=stop preemptions=N"
 * (queue_ms / ttft_ms are -1 when the request was never scheduled / never
 * produced a token; ttft_ms counts from t_arrival). */
void td_obs_log_request(const td_request_record *r);

#endif
