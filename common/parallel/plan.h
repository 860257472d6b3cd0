/* Parallel plan of one pool instance (DESIGN.md §3): world = tp × cp × pp
 * ranks, TP innermost, then CP, then PP (DP means separate instances behind
 * the router); EP places MoE experts over consecutive ranks of a TP group.
 *
 * td_plan_create validates a plan against a model's configuration at
 * start-up with one clear line per problem: query heads divisible by TP,
 * KV heads divisible by TP or TP divisible by them (then KV heads are
 * replicated), the FFN width divisible by TP, row-parallel slices on
 * quantisation-block boundaries, at least one layer per stage (and an
 * explicit split that adds up), experts divisible by EP and EP dividing TP
 * (the EP group is a run of consecutive ranks of a TP group; the routed
 * experts are then whole, only the shared expert is TP-split), EP only for
 * MoE models; --attn-dp (MoE, ep == tp, no CP) loads attention and the
 * shared expert whole on every rank, so the head and FFN checks against
 * TP are skipped. More CPU ranks than cores is a warning, not an error.
 *
 * td_plan_report is --plan-dry-run: per rank its coordinates, layers,
 * weight bytes (the shard really loaded), KV bytes per token, and the bytes
 * it sends per token and per step; then for the plan as a whole the five
 * questions — what state is split, what is replicated, what crosses the
 * interconnect, how often, and what the plan improves. */
#ifndef TD_PLAN_H
#define TD_PLAN_H

#include <stdbool.h>
#include <stdio.h>

#include "common/base/base.h"
#include "common/engine/forward.h" /* td_cp_mode */
#include "common/model/model.h"

#define TD_PLAN_MAX_PP 64

typedef struct {
    int tp, pp, cp;                    /* >= 1 */
    int ep;                            /* >= 1; 0: the TP group for MoE models, 1 otherwise */
    bool attn_dp;                      /* MoE: attention data-parallel over the EP ranks */
    int32_t pp_layers[TD_PLAN_MAX_PP]; /* layers per stage; all 0: even split */
    td_cp_mode cp_mode;
    int32_t cp_min_tokens; /* prompts shorter than this are not split over CP (default 256) */
} td_plan_params;

td_plan_params td_plan_default_params(void);

/* The plan's command-line flags, shared by every command that takes a
 * plan (their option table: runtime/plan-flags.c): --tp N, --pp N,
 * --pp-layers A,B,..., --cp N, --cp-mode allgather|ring, --cp-min-tokens N,
 * --ep N, --attn-dp (no value). */
typedef enum {
    TD_PLAN_FLAG_TP,
    TD_PLAN_FLAG_PP,
    TD_PLAN_FLAG_PP_LAYERS,
    TD_PLAN_FLAG_CP,
    TD_PLAN_FLAG_CP_MODE,
    TD_PLAN_FLAG_CP_MIN_TOKENS,
    TD_PLAN_FLAG_EP,
    TD_PLAN_FLAG_ATTN_DP,
    TD_PLAN_N_FLAGS
} td_plan_flag;
/* Sets flag f from val (NULL for --attn-dp); false for a bad or missing
 * value or an unknown flag (the caller says so), p then unchanged. */
bool td_plan_set_flag(td_plan_params *p, td_plan_flag f, const char *val);

/* Coordinates of one rank. */
typedef struct {
    int rank;
    int tp_rank, cp_rank, pp_rank;
    int ep_rank;                    /* rank within its stage's EP group, -1 without EP */
    int32_t layer_begin, layer_end; /* its stage's layers */
} td_rank_coord;

typedef struct td_plan td_plan;

/* Validates p against cfg (n_expert, n_expert_used: 0 for dense models) and
 * fixes the layer split. Every problem is logged on its own line;
 * TD_ERR_INVALID if there is any. Free with td_plan_destroy(). */
td_status td_plan_create(const td_plan_params *p, const td_model_config *cfg, int32_t n_expert,
                         int32_t n_expert_used, td_plan **plan_p);
void td_plan_destroy(td_plan *plan); /* accepts NULL */

int td_plan_world(const td_plan *plan);
const td_plan_params *td_plan_params_get(const td_plan *plan);
/* Coordinates of rank r (0 <= r < world): TP innermost, then CP, then PP. */
td_rank_coord td_plan_rank(const td_plan *plan, int r);

/* KV heads each rank's shard holds: n_head_kv / tp, or 1 when TP exceeds
 * the KV heads (then replicated), or all of them under attention-DP. */
int td_plan_kv_heads_local(const td_plan *plan);

/* Bytes one rank sends per token (TP all-reduces, the PP hand-off, the PCP
 * K/V exchange, the DCP partial-attention merge, the EP dispatch and
 * combine), ring algorithms assumed: an all-reduce of S bytes over n ranks
 * sends 2 S (n-1)/n, an all-gather S (n-1)/n. */
typedef struct {
    double tp_per_token;       /* 2 all-reduces of n_embd floats per layer */
    double pp_per_token;       /* hidden state to the next stage (0 on the last) */
    double pcp_per_token;      /* prefill: this rank's K/V to the other CP ranks, per layer */
    double dcp_per_token;      /* decode: partial attention (out, max, sum) per layer */
    double ep_per_token;       /* MoE: hidden states of the 1/tp of the rows this rank routes
                                  to the experts' ranks, and the outputs back */
    double embd_per_token;     /* TP, first stage: the vocab-parallel embedding all-reduce */
    double head_per_row;       /* TP, last stage: this rank's logits all-gathered, per logit
                                  row (every decode token; once per prompt in prefill) */
    double kv_bytes_per_token; /* KV this rank holds per token of context (f32) */
} td_rank_traffic;
td_rank_traffic td_plan_traffic(const td_plan *plan, int r);

/* The --plan-dry-run report. Loads each distinct (tp_rank, stage) weight
 * shard of model_path to report its real size (and so also proves the
 * shards load); errors from the loader are returned. */
td_status td_plan_report(const td_plan *plan, const char *model_path, FILE *out);

#endif
