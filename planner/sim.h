/* A discrete-event simulation of a Tandem cluster on a virtual clock
 * (DESIGN.md §11). Every instance runs the real scheduling core
 * (common/sched/core.h: admission with KV reservation, chunked prefill
 * under the step budget, preemption, the prefix cache over a real KV
 * pool's bookkeeping) and requests are routed by the router's real scoring
 * (common/route/score.h: the same weights and thresholds, conditional
 * disaggregation); only the durations come from a profile: each step's
 * from its batch (td_step_model), each KV transfer's exposed tail from the
 * tokens moved. So a change to the scheduler or the router changes the
 * simulation with it.
 *
 * What is modelled, in the order a request meets it:
 *   arrival -> (router: td_rt_choose over the instances' figures, as of
 *   its last poll plus what it routed since, or exact; no headroom: the
 *   router's FIFO queue, retried whenever an instance frees something, or
 *   at its next poll) -> the decode (or colocated) instance's queue ->
 *   admission -> local prefill in its batches, or a remote one: the
 *   request joins the prefill instance's queue as a one-token sequence,
 *   whose blocks stay held until the transfer's tail has passed -> the
 *   first token -> one token per decode step -> the end at its output
 *   length (outputs have exact lengths, as with ignore_eos).
 * The router's view (poll_interval_s > 0) is the real router's
 * (router/poller.c, route.c): every instance's running, waiting, queued
 * prefill tokens and KV counts as they stood at the last poll, the polls
 * poll_interval_s apart; the blocks and prefill tokens it routed to an
 * instance since that poll added on (reset by the poll), and the requests
 * it has in flight on an instance counted live. Its prefix overlaps are
 * exact (the real one's index is fed by KV events at each poll and by the
 * entries it predicts at each decision, which cover the gap).
 * Instances that share a machine (the same host) slow each other: the
 * part of a step that overlaps another instance's step on its host runs at
 * the pace of the step model measured beside a busy neighbour
 * (td_sim_instance.step_beside).
 * Not modelled: failures and retries after them, stop strings, a router
 * queue limit. */
#ifndef TD_PLANNER_SIM_H
#define TD_PLANNER_SIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/route/score.h"
#include "common/sched/sched.h"

/* A step's duration in seconds from its batch:
 *   c0 + c_tok N + c_tok2 N^2 + c_attn A + c_attn2 A2 + c_ctx C + c_seq B
 *      + sum over k of c_n[k] max(0, N - TD_STEP_HINGES[k])
 * N: tokens in the batch (a decode counts 1), A: attention pairs (over
 * the new tokens, the keys each reads: sum of positions pos0 + 1 ..
 * pos0 + chunk), A2: the same sum of squared positions (attention whose
 * cost per key grows with the context, as when the keys outgrow the
 * caches), C: the context the entries read (sum of pos0 + chunk: each
 * entry's keys and values read once, as a decode step reads them), B:
 * sequences in the batch; the hinges make the cost per token piecewise
 * linear in N (a matmul's batch regimes: their coefficients may be
 * negative). DistServe's prefill form (a + b T + c T^2) and decode form
 * (a + b sum(context) + c batch) are both cases of it. */
#define TD_STEP_N_HINGES 4
extern const int32_t TD_STEP_HINGES[TD_STEP_N_HINGES]; /* 2, 4, 8, 16 */

typedef struct {
    double c0, c_tok, c_tok2, c_attn, c_attn2, c_ctx, c_seq;
    double c_n[TD_STEP_N_HINGES];
} td_step_model;

/* A and A2 of one batch entry: chunk new tokens after pos0. */
void td_step_attn(int64_t pos0, int64_t chunk, double *a, double *a2);
double td_step_model_eval(const td_step_model *m, int64_t n_tok, double attn, double attn2,
                          double ctx, int32_t n_seq);

typedef enum { TD_SIM_COLOCATED = 0, TD_SIM_PREFILL = 1, TD_SIM_DECODE = 2 } td_sim_role;

typedef struct {
    td_sim_role role;
    td_sched_params sched; /* max_running, max_batch_tokens, max_waiting,
                            * reserve_output_tokens, max_ctx, prefix_cache, compat */
    int32_t n_blocks, block_size;
    td_step_model step;
    double step_overhead_s; /* the scheduler's own time per step, added to each */
    /* Instances with the same host >= 0 share a machine (its caches, memory
     * bandwidth, perhaps physical cores); -1: a machine of its own. With
     * has_beside, a step progresses at the pace of step_beside +
     * beside_overhead_s (the profile measured beside a neighbour running
     * the same loads) while another instance of its host is stepping, and
     * at the pace of step + step_overhead_s while none is: a step that a
     * neighbour's overlaps for half its time is stretched by half the
     * difference. */
    int32_t host;
    bool has_beside;
    td_step_model step_beside;
    double beside_overhead_s;
} td_sim_instance;

#define TD_SIM_MAX_INSTANCES 64

typedef struct {
    td_sim_instance inst[TD_SIM_MAX_INSTANCES];
    int32_t n_inst;
    bool router; /* behind a router; false: one instance, clients send to it */
    td_rt_score_params score;
    double xfer_s_per_token;   /* exposed transfer tail per prompt token moved P -> D */
    double xfer_fixed_s;       /* per transfer (PrefillDone, the control round trips) */
    double request_overhead_s; /* client-side time outside the scheduler (HTTP,
                                * tokenizing, the router's hop) added to TTFT and E2E */
    double poll_interval_s;    /* the router's state polls (--poll-interval-ms);
                                * 0: it sees every instance's exact figures */
} td_sim_cluster;

/* The prompt as segments of tokens: segment id >= 0 names a shared
 * segment whose tokens are the same in every request that has it (a
 * system prompt, a Mooncake block); -1 a segment unique to the request. */
typedef struct {
    int64_t id;
    int32_t n_tokens;
} td_sim_segment;

typedef struct {
    double t_arrival; /* seconds */
    const td_sim_segment *seg;
    int32_t n_seg;
    int32_t n_output; /* >= 1 */
} td_sim_request;

typedef struct {
    double ttft, e2e, tpot; /* seconds; tpot: (e2e - ttft) / (n_output - 1), 0 for one token */
    double itl_max;
    int32_t d, p;               /* instances (p -1: prefilled on d) */
    int32_t n_prompt, n_cached; /* prompt tokens; served by d's prefix cache at admission */
    int32_t n_preemptions;
    bool failed; /* refused: can never fit, or the instance's queue was full */
} td_sim_outcome;

typedef struct {
    double t_end; /* virtual time of the last event */
    int64_t steps, preemptions, remote_prefills, events;
    int64_t steps_beside; /* steps overlapped, for some of their time, by a neighbour's */
    int64_t max_router_queue;
    int64_t polls; /* the router's state polls (poll_interval_s > 0) */
    int32_t n_failed;
    double busy_s[TD_SIM_MAX_INSTANCES]; /* time each instance spent stepping */
    float *itl;                          /* every inter-token gap, seconds (n_itl); free() it */
    int64_t n_itl;
} td_sim_stats;

/* Runs the requests (sorted by arrival) through the cluster; out[i] for
 * reqs[i]. TD_ERR_INVALID (with a message in why) for a cluster or a
 * request that cannot be simulated; TD_ERR_NOMEM. stats->itl is allocated
 * when collect_itl. */
td_status td_sim_run(const td_sim_cluster *c, const td_sim_request *reqs, int32_t n,
                     bool collect_itl, td_sim_outcome *out, td_sim_stats *stats, char *why,
                     size_t why_len);

/* TD_ERR_INVALID, with the message written into why (why_len; NULL: none). */
td_status td_sim_invalid(char *why, size_t why_len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
