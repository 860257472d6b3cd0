/* The router's choice of a (prefill, decode) pair for one request
 * (DESIGN.md §6). A pure function of the cluster's figures and the
 * request's prefix overlaps: no locks, no allocation, no I/O.
 *
 * Costs are in KV blocks (Dynamo's form), lowest wins:
 *   prefill on P   overlap_weight x uncached_prompt_blocks(P)
 *                  + queued_prefill_blocks(P)
 *   decode on D    decode_weight x (used_blocks(D) + pending(D) + need - overlap(D))
 *   transfer P->D  transfer_weight x the measured moving average of the
 *                  pair's exposed KV transfer tail in ms (PrefillDone's arrival
 *                  after P's last layer; 0 while unmeasured)
 * where need = blocks of prompt + min(max_tokens, reserve_output_tokens),
 * the KV a decode instance reserves at admission. A decode instance whose
 * headroom free(D) - pending(D) - need is negative is filtered out.
 * Conditional disaggregation, per decode candidate: it prefills locally
 * (cost: the prefill cost on D itself) when the prompt's uncached suffix on
 * D is short (< local_prefill_tokens, or < local_prefill_fraction of the
 * prompt and < local_prefill_max_tokens), when no compatible prefill
 * instance is usable, or when every one is saturated (queued prefill
 * tokens >= prefill_saturated_tokens, or, its prefill speed known, a new
 * prompt could not start within prefill_saturated_ms: the rule a
 * prefill instance refuses jobs by, against a decode instance's
 * deadline); otherwise its best prefill instance is the one of lowest
 * prefill + transfer cost.
 * temperature 0: the lowest total cost wins (ties rotate with the
 * request counter); > 0: a draw among the candidates with weights
 * exp(-normalised cost / temperature), the costs normalised to [0, 1].
 * round-robin / random / least-loaded ignore the prefix cache (the
 * thresholds see the whole prompt as uncached) but keep the headroom
 * filter and the compatibility pairing. */
#ifndef TD_ROUTER_SCORE_H
#define TD_ROUTER_SCORE_H

#include <stdbool.h>
#include <stdint.h>

#include "common/base/base.h"

typedef enum {
    TD_RT_KV_AWARE = 0,
    TD_RT_ROUND_ROBIN = 1,
    TD_RT_RANDOM = 2,
    TD_RT_LEAST_LOADED = 3,
} td_rt_policy;
#define TD_RT_N_POLICIES 4

/* "kv-aware", "round-robin", "random", "least-loaded"; -1 for another. */
int td_rt_policy_parse(const char *s);
const char *td_rt_policy_str(td_rt_policy p);

typedef enum {
    TD_RT_REMOTE = 0,           /* prefill on P, decode on D */
    TD_RT_LOCAL_SHORT = 1,      /* uncached suffix under the threshold */
    TD_RT_LOCAL_CACHED = 2,     /* D holds most of the prompt */
    TD_RT_LOCAL_NO_PREFILL = 3, /* no usable compatible prefill instance */
    TD_RT_LOCAL_SATURATED = 4,  /* every prefill instance is saturated */
} td_rt_reason;
#define TD_RT_N_REASONS 5
const char *td_rt_reason_str(td_rt_reason r);

typedef struct {
    td_rt_policy policy;              /* default kv-aware */
    double overlap_weight;            /* default 1.0 */
    double decode_weight;             /* default 1.0 */
    double transfer_weight;           /* blocks per ms, default 0.1 */
    double temperature;               /* default 0 */
    int32_t local_prefill_tokens;     /* default 512 */
    double local_prefill_fraction;    /* default 0.7 */
    int32_t local_prefill_max_tokens; /* default 2048 */
    int64_t prefill_saturated_tokens; /* default 65536 */
    double prefill_saturated_ms;      /* 0: off; default 27000 (tandem-decode's default
                                       * start deadline as P sees it: 30000 less 10%) */
    int32_t reserve_output_tokens;    /* default 256 (tandem-decode's default) */
} td_rt_score_params;

td_rt_score_params td_rt_score_default_params(void);

/* Instances beyond this many are not looked at. */
#define TD_RT_MAX_CANDIDATES 256

/* One instance as the scorer sees it. */
typedef struct {
    bool prefill;  /* a prefill instance, else a decode instance */
    bool usable;   /* healthy, ready, not draining, not excluded for this request */
    int32_t group; /* compatibility group: only equal groups pair */
    int32_t block_size;
    int64_t queued_prefill_tokens;      /* reported + routed since the report */
    double prefill_tokens_per_s;        /* measured (0: unknown) */
    int64_t kv_free, kv_used, kv_total; /* blocks (free: empty + cached - reserved) */
    int64_t pending_blocks;             /* routed here since its last report */
    int32_t running, waiting;
} td_rt_inst;

typedef struct {
    int32_t d, p; /* instance indexes; p = -1: local prefill on d */
    td_rt_reason reason;
    double cost;
    int32_t need_blocks; /* what d reserves for the request */
} td_rt_choice;

/* Chooses for a prompt of n_prompt tokens and max_tokens output among
 * inst[0..n). overlap[i]: leading prompt blocks instance i holds
 * (kv-aware; may be NULL for the other policies). xfer_ms: NULL, or
 * xfer_ms[p * xfer_stride + d] the pair's measured transfer tail (<= 0:
 * unknown). counter: the request's sequence number (round-robin, ties);
 * rng: a splitmix64 state (random, temperature). TD_OK with *out;
 * TD_AGAIN: decode instances are usable but none has the headroom (the
 * request may wait); TD_ERR_UNAVAILABLE: no usable decode instance. */
/* Whether prefill instance P is saturated (sp's two rules). */
bool td_rt_saturated(const td_rt_score_params *sp, const td_rt_inst *P);
/* When a prompt of `tokens` uncached tokens sent to instance i now would
 * have its first token, in ms, from its queue and measured speed; < 0:
 * unknown (no speed measured). */
double td_rt_expected_ms(const td_rt_inst *in, int64_t tokens);

/* What first tokens on an instance took beyond td_rt_expected_ms (the
 * transfer, the decode instance's steps, a slower machine than its speed
 * says): a moving average of the misses that fades by half every
 * TD_RT_EXTRA_HALF_LIFE_S after the last one, so that an instance whose
 * every new request was refused for it (no first token teaches it anything
 * more) takes requests again once that is long past. Zeroed: nothing learnt. */
#define TD_RT_EXTRA_HALF_LIFE_S 1.0
typedef struct {
    double ms, t; /* the average at time t (seconds) */
    uint32_t n;   /* misses learnt */
} td_rt_extra;
double td_rt_extra_at(const td_rt_extra *e, double now);
void td_rt_extra_learn(td_rt_extra *e, double miss_ms, double now);

td_status td_rt_choose(const td_rt_score_params *sp, const td_rt_inst *inst, int32_t n,
                       const int32_t *overlap, const float *xfer_ms, int32_t xfer_stride,
                       int32_t n_prompt, int32_t max_tokens, uint64_t counter, uint64_t *rng,
                       td_rt_choice *out);

/* What td_rt_choose_traced weighed: each decode candidate it kept (cand,
 * in instance order) with the prefill instance it pairs with (-1: local
 * prefill), the decode part of its cost and the whole; and, where pcost is
 * set, pcost[k * n + p] the cost of prefill instance p for candidate k (NAN
 * where p was not a choice for it). */
typedef struct {
    int32_t d, p;
    td_rt_reason reason;
    double dcost, cost;
} td_rt_cand;

typedef struct {
    int32_t n_cand;
    td_rt_cand cand[TD_RT_MAX_CANDIDATES];
    double *pcost; /* NULL, or (TD_RT_MAX_CANDIDATES x n) */
} td_rt_trace;

/* td_rt_choose, with what it weighed in *trace (NULL: as td_rt_choose). */
td_status td_rt_choose_traced(const td_rt_score_params *sp, const td_rt_inst *inst, int32_t n,
                              const int32_t *overlap, const float *xfer_ms, int32_t xfer_stride,
                              int32_t n_prompt, int32_t max_tokens, uint64_t counter, uint64_t *rng,
                              td_rt_choice *out, td_rt_trace *trace);

#endif
