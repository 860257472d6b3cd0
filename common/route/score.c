/* The router's scoring (score.h): one pass over the decode candidates, and
 * for each one its best compatible prefill instance. */
#include "score.h"

#include <math.h>
#include <string.h>

static const char *const policy_names[TD_RT_N_POLICIES] = {"kv-aware", "round-robin", "random",
                                                           "least-loaded"};
static const char *const reason_names[TD_RT_N_REASONS] = {"remote", "local_short", "local_cached",
                                                          "local_no_prefill", "local_saturated"};

int td_rt_policy_parse(const char *s) {
    for (int i = 0; s && i < TD_RT_N_POLICIES; i++)
        if (!strcmp(s, policy_names[i])) return i;
    return -1;
}

const char *td_rt_policy_str(td_rt_policy p) {
    return (unsigned)p < TD_RT_N_POLICIES ? policy_names[p] : "unknown";
}

const char *td_rt_reason_str(td_rt_reason r) {
    return (unsigned)r < TD_RT_N_REASONS ? reason_names[r] : "unknown";
}

td_rt_score_params td_rt_score_default_params(void) {
    return (td_rt_score_params){.policy = TD_RT_KV_AWARE,
                                .overlap_weight = 1.0,
                                .decode_weight = 1.0,
                                .transfer_weight = 0.1,
                                .temperature = 0.0,
                                .local_prefill_tokens = 512,
                                .local_prefill_fraction = 0.7,
                                .local_prefill_max_tokens = 2048,
                                .prefill_saturated_tokens = 65536,
                                .prefill_saturated_ms = 27000,
                                .reserve_output_tokens = 256};
}

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double unit(uint64_t *s) { return (double)(splitmix(s) >> 11) * 0x1.0p-53; }

static int64_t blocks_of(int64_t tokens, int32_t bs) { return (tokens + bs - 1) / bs; }

/* The prefill cost of the prompt on instance i (a prefill instance, or a
 * decode instance prefilling locally). */
static double prefill_cost(const td_rt_score_params *sp, const td_rt_inst *in, int32_t n_prompt,
                           int32_t overlap) {
    int32_t bs = in->block_size > 0 ? in->block_size : 16;
    int64_t uncached = blocks_of(n_prompt, bs) - overlap;
    if (uncached < 0) uncached = 0;
    return sp->overlap_weight * (double)uncached +
           (double)blocks_of(in->queued_prefill_tokens > 0 ? in->queued_prefill_tokens : 0, bs);
}

bool td_rt_saturated(const td_rt_score_params *sp, const td_rt_inst *P) {
    if (P->queued_prefill_tokens >= sp->prefill_saturated_tokens) return true;
    double start = td_rt_expected_ms(P, 0);
    return sp->prefill_saturated_ms > 0 && start >= sp->prefill_saturated_ms;
}

double td_rt_expected_ms(const td_rt_inst *in, int64_t tokens) {
    if (!(in->prefill_tokens_per_s > 0)) return -1;
    int64_t q = in->queued_prefill_tokens > 0 ? in->queued_prefill_tokens : 0;
    return (double)(q + (tokens > 0 ? tokens : 0)) / in->prefill_tokens_per_s * 1e3;
}

double td_rt_extra_at(const td_rt_extra *e, double now) {
    if (e->n == 0) return 0;
    double age = now > e->t ? now - e->t : 0;
    return e->ms * exp2(-age / TD_RT_EXTRA_HALF_LIFE_S);
}

void td_rt_extra_learn(td_rt_extra *e, double miss_ms, double now) {
    e->ms = e->n++ > 0 ? 0.8 * td_rt_extra_at(e, now) + 0.2 * miss_ms : miss_ms;
    e->t = now;
}

/* A decode candidate with its best prefill instance. */
typedef struct {
    int32_t d, p;
    td_rt_reason reason;
    double cost;
    int32_t need;
} cand;

td_status td_rt_choose(const td_rt_score_params *sp, const td_rt_inst *inst, int32_t n,
                       const int32_t *overlap, const float *xfer_ms, int32_t xfer_stride,
                       int32_t n_prompt, int32_t max_tokens, uint64_t counter, uint64_t *rng,
                       td_rt_choice *out) {
    return td_rt_choose_traced(sp, inst, n, overlap, xfer_ms, xfer_stride, n_prompt, max_tokens,
                               counter, rng, out, NULL);
}

td_status td_rt_choose_traced(const td_rt_score_params *sp, const td_rt_inst *inst, int32_t n,
                              const int32_t *overlap, const float *xfer_ms, int32_t xfer_stride,
                              int32_t n_prompt, int32_t max_tokens, uint64_t counter, uint64_t *rng,
                              td_rt_choice *out, td_rt_trace *trace) {
    bool kv = sp->policy == TD_RT_KV_AWARE && overlap;
    int32_t out_res =
        max_tokens < sp->reserve_output_tokens ? max_tokens : sp->reserve_output_tokens;
    if (out_res < 0) out_res = 0;
    int32_t n_usable_d = 0, n_cand = 0;
    cand cands[TD_RT_MAX_CANDIDATES];
    if (n > TD_RT_MAX_CANDIDATES) n = TD_RT_MAX_CANDIDATES;

    for (int32_t d = 0; d < n; d++) {
        const td_rt_inst *D = &inst[d];
        if (D->prefill || !D->usable) continue;
        n_usable_d++;
        int32_t bs = D->block_size > 0 ? D->block_size : 16;
        int64_t need = blocks_of((int64_t)n_prompt + out_res, bs);
        if (D->kv_free - D->pending_blocks - need < 0) continue;
        int32_t ov_d = kv ? overlap[d] : 0;
        int64_t uncached_tok = (int64_t)n_prompt - (int64_t)ov_d * bs;
        if (uncached_tok < 0) uncached_tok = 0;

        /* Compatible prefill instances: usable ones, and unsaturated ones. */
        int32_t n_p = 0, n_p_ok = 0;
        for (int32_t p = 0; p < n; p++) {
            const td_rt_inst *P = &inst[p];
            if (!P->prefill || !P->usable || P->group != D->group) continue;
            n_p++;
            if (!td_rt_saturated(sp, P)) n_p_ok++;
        }
        td_rt_reason why = TD_RT_REMOTE;
        if (uncached_tok < sp->local_prefill_tokens)
            why = TD_RT_LOCAL_SHORT;
        else if (uncached_tok < sp->local_prefill_max_tokens &&
                 (double)uncached_tok < sp->local_prefill_fraction * n_prompt)
            why = TD_RT_LOCAL_CACHED;
        else if (n_p == 0)
            why = TD_RT_LOCAL_NO_PREFILL;
        else if (n_p_ok == 0)
            why = TD_RT_LOCAL_SATURATED;

        double dcost = 0;
        if (sp->policy == TD_RT_KV_AWARE)
            dcost = sp->decode_weight * (double)(D->kv_used + D->pending_blocks + need - ov_d);
        else if (sp->policy == TD_RT_LEAST_LOADED)
            dcost = (double)(D->kv_used + D->pending_blocks) /
                        (double)(D->kv_total > 0 ? D->kv_total : 1) +
                    1e-3 * (D->running + D->waiting);
        cand c = {.d = d, .p = -1, .reason = why, .need = (int32_t)need};
        double *row = trace && trace->pcost ? trace->pcost + (size_t)n_cand * (size_t)n : NULL;
        for (int32_t p = 0; row && p < n; p++) row[p] = NAN;
        if (why != TD_RT_REMOTE) {
            c.cost =
                dcost + (sp->policy == TD_RT_KV_AWARE ? prefill_cost(sp, D, n_prompt, ov_d) : 0);
        } else {
            /* The best unsaturated prefill instance for this D. */
            int32_t best = -1, k = 0, pick = -1;
            double best_cost = 0;
            if (sp->policy == TD_RT_ROUND_ROBIN || sp->policy == TD_RT_RANDOM)
                pick = (int32_t)((sp->policy == TD_RT_ROUND_ROBIN ? counter : splitmix(rng)) %
                                 (uint64_t)n_p_ok);
            for (int32_t p = 0; p < n; p++) {
                const td_rt_inst *P = &inst[p];
                if (!P->prefill || !P->usable || P->group != D->group || td_rt_saturated(sp, P))
                    continue;
                double pc;
                if (pick >= 0) {
                    pc = k++ == pick ? 0 : 1;
                } else if (sp->policy == TD_RT_LEAST_LOADED) {
                    pc = (double)P->queued_prefill_tokens;
                } else {
                    pc = prefill_cost(sp, P, n_prompt, overlap[p]);
                    float x =
                        xfer_ms ? xfer_ms[(size_t)p * (size_t)xfer_stride + (size_t)d] : -1.0f;
                    if (x > 0) pc += sp->transfer_weight * x;
                }
                if (row) row[p] = pc;
                if (best < 0 || pc < best_cost) {
                    best = p;
                    best_cost = pc;
                }
            }
            c.p = best;
            c.cost = dcost + (sp->policy == TD_RT_KV_AWARE ? best_cost : 0);
        }
        if (trace)
            trace->cand[n_cand] =
                (td_rt_cand){.d = d, .p = c.p, .reason = why, .dcost = dcost, .cost = c.cost};
        cands[n_cand++] = c;
    }
    if (trace) trace->n_cand = n_cand;
    if (n_usable_d == 0) return TD_ERR_UNAVAILABLE;
    if (n_cand == 0) return TD_AGAIN;

    int32_t k = 0;
    if (sp->policy == TD_RT_ROUND_ROBIN) {
        k = (int32_t)(counter % (uint64_t)n_cand);
    } else if (sp->policy == TD_RT_RANDOM) {
        k = (int32_t)(splitmix(rng) % (uint64_t)n_cand);
    } else if (sp->temperature > 0 && n_cand > 1) {
        double lo = cands[0].cost, hi = cands[0].cost;
        for (int32_t i = 1; i < n_cand; i++) {
            lo = fmin(lo, cands[i].cost);
            hi = fmax(hi, cands[i].cost);
        }
        double span = hi > lo ? hi - lo : 1.0, sum = 0, w[TD_RT_MAX_CANDIDATES];
        for (int32_t i = 0; i < n_cand; i++)
            sum += w[i] = exp(-(cands[i].cost - lo) / span / sp->temperature);
        double r = unit(rng) * sum;
        for (k = 0; k < n_cand - 1 && (r -= w[k]) > 0; k++) {
        }
    } else {
        /* Lowest cost; among equal costs, rotate with the counter. */
        double lo = cands[0].cost;
        for (int32_t i = 1; i < n_cand; i++) lo = fmin(lo, cands[i].cost);
        int32_t n_lo = 0;
        for (int32_t i = 0; i < n_cand; i++) n_lo += cands[i].cost <= lo;
        int32_t want = (int32_t)(counter % (uint64_t)n_lo);
        for (k = 0; k < n_cand; k++)
            if (cands[k].cost <= lo && want-- == 0) break;
    }
    *out = (td_rt_choice){.d = cands[k].d,
                          .p = cands[k].p,
                          .reason = cands[k].reason,
                          .cost = cands[k].cost,
                          .need_blocks = cands[k].need};
    return TD_OK;
}
