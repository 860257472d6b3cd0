/* Transfer mapping (DESIGN.md §4): which rank of a prefill instance puts
 * which part of a sequence's KV into which rank of a decode instance, for
 * any pair of parallel plans (tp, pp, cp) on the two sides. A pure
 * function of the two plans and the model's layer and KV-head counts,
 * computed once per plan pair.
 *
 * Where KV lives on an instance (parallel/plan.h, engine/forward.h):
 * - rank r = (pp_rank * cp + cp_rank) * tp + tp_rank;
 * - layers: its stage's contiguous range [stage_begin[pp_rank],
 *   stage_begin[pp_rank + 1]);
 * - KV heads: with tp <= n_head_kv, [tp_rank * n / tp, (tp_rank + 1) * n / tp);
 *   with tp > n_head_kv (replicated KV heads), the one head tp_rank / (tp / n);
 * - blocks: block b of a sequence (positions [b * bs, (b + 1) * bs)) on CP
 *   rank b % cp.
 *
 * Each route moves, for the sequence blocks b with b % block_mod ==
 * block_res, the K and V of layers [layer_begin, layer_end) and KV heads
 * [head_begin, head_end) from prefill rank p_rank to decode rank d_rank.
 * Every (decode rank, layer, KV head, block) that the decode plan holds is
 * delivered by exactly one route, always from a prefill rank that holds it.
 * When the prefill side replicates a head, the decode ranks' reads are
 * spread over its replicas; when the decode side replicates one, each
 * replica gets its own route. Different TP, PP or CP on the two sides is a
 * supported configuration, not an error. Attention-DP plans are not
 * endpoints of a transfer (their KV is split by sequence, not by head). */
#ifndef TD_TRANSFER_MAP_H
#define TD_TRANSFER_MAP_H

#include <stdint.h>

#include "common/base/base.h"
#include "common/parallel/plan.h"

/* The part of a plan the mapping needs. */
typedef struct {
    int tp, pp, cp;                          /* >= 1 */
    int32_t stage_begin[TD_PLAN_MAX_PP + 1]; /* stage s: [stage_begin[s], stage_begin[s + 1]) */
} td_xfer_plan;

/* From a validated plan (its layer split included). TD_ERR_UNSUPPORTED for
 * an attention-DP plan. */
td_status td_xfer_plan_from(const td_plan *plan, td_xfer_plan *out);

typedef struct {
    int p_rank, d_rank;
    int32_t layer_begin, layer_end; /* global layer indices */
    int32_t head_begin, head_end;   /* global KV-head indices */
    int32_t block_mod, block_res;   /* sequence blocks b with b % block_mod == block_res */
} td_xfer_route;

/* KV heads [*h0, *h1) of TP rank tp_rank under tp (n_head_kv KV heads). */
void td_xfer_rank_heads(int tp, int tp_rank, int32_t n_head_kv, int32_t *h0, int32_t *h1);

/* The routes from plan p (prefill) to plan d (decode) for a model of
 * n_layer layers and n_head_kv KV heads, in order of decode rank, then
 * layer, then head, then prefill rank. Writes at most cap routes and sets
 * *n_routes to how many there are (call with cap 0 to size the array):
 * TD_ERR_RANGE when cap is too small. TD_ERR_INVALID (logged) when a plan
 * does not fit the model (a TP that neither divides nor is divided by the
 * KV heads, a layer split that does not cover n_layer) or the CP sizes'
 * least common multiple exceeds TD_PLAN_MAX_WORLD. */
td_status td_xfer_map(const td_xfer_plan *p, const td_xfer_plan *d, int32_t n_layer,
                      int32_t n_head_kv, td_xfer_route *routes, int cap, int *n_routes);

#endif
