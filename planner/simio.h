/* The simulator's inputs and results as files (tandem simulate).
 *
 * A cluster, JSON (an object, or an array of them: one run each):
 *   {"name": "1P+1D",                     optional label
 *    "router": true,                      false: one instance, no router
 *    "score": {"policy": "kv-aware", "overlap_weight", "decode_weight",
 *              "transfer_weight", "temperature", "local_prefill_tokens",
 *              "local_prefill_fraction", "local_prefill_max_tokens",
 *              "prefill_saturated_tokens", "reserve_output_tokens"},
 *                                         the router's (common/route/score.h),
 *                                         each optional, defaults as there
 *    "xfer_s_per_token": 0, "xfer_fixed_s": 0, "request_overhead_s": 0,
 *    "poll_interval_s": 0,                the router's state polls (0: exact view)
 *    "instances": [{"role": "colocated" | "prefill" | "decode", "count": 1,
 *                   "n_blocks": N, "block_size": 16,
 *                   "sched": {"max_running", "max_batch_tokens", "max_waiting",
 *                             "reserve_output_tokens", "max_ctx", "prefix_cache",
 *                             "prefill_share", "tpot_target_s", "tpot_decode_factor"},
 *                   "step": {"c0", "c_tok", "c_tok2", "c_attn", "c_attn2",
 *                            "c_ctx", "c_seq", "c_n2", "c_n4", "c_n8", "c_n16"},
 *                   "step_overhead_s": 0}, ...]}
 * A workload, JSON Lines, one request per line in arrival order:
 *   {"t": seconds, "seg": [[id, tokens], ...], "out": tokens}
 * (segment id >= 0 shared by every request naming it, -1 its own tokens).
 * Errors name the file and line. */
#ifndef TD_PLANNER_SIMIO_H
#define TD_PLANNER_SIMIO_H

#include <jansson.h>
#include <stddef.h>

#include "sim.h"

typedef struct {
    td_sim_cluster c;
    char name[64];
} td_sim_named_cluster;

/* The clusters of a file: *out (n) to free(); *is_array when the file
 * held an array (even of one). */
td_status td_sim_read_clusters(const char *path, td_sim_named_cluster **out, int32_t *n,
                               bool *is_array, char *why, size_t why_len);

typedef struct {
    td_sim_request *reqs;
    td_sim_segment *segs;
    int32_t n;
    int64_t n_segs;
} td_sim_workload;

td_status td_sim_read_workload(const char *path, td_sim_workload *w, char *why, size_t why_len);
void td_sim_workload_free(td_sim_workload *w);

/* Goodput's bounds in ms (0: none), tandem bench's --slo. */
typedef struct {
    double ttft_ms, tpot_ms, e2e_ms;
} td_sim_slo;

/* A run's result with tandem bench's report keys: completed, failed,
 * duration_s, request_throughput, good_requests, goodput, ttft_ms / tpot_ms
 * / e2e_ms / itl_ms {count, mean, min, p50, p90, p95, p99, max}, and the
 * simulator's own: steps, preemptions, remote_prefills, max_router_queue, polls,
 * busy (each instance's share of the run spent stepping), cdf {ttft_ms,
 * tpot_ms: the 101 percentiles 0..100}, wall_s, sim_requests_per_s. */
json_t *td_sim_result_json(const td_sim_named_cluster *nc, const td_sim_workload *w,
                           const td_sim_outcome *o, const td_sim_stats *st, const td_sim_slo *slo,
                           double wall_s);

#endif
