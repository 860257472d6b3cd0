/* The routing decision (router-impl.h): which compatibility group an
 * instance is in, which pair serves a request (score.h over the instances'
 * figures and the prefix index), and the prefix entries predicted for it. */
#include <stdio.h>
#include <string.h>

#include "common/kv/hash.h"
#include "router-impl.h"

/* The compatibility group of compat for slot `self` (whose own current
 * group does not count as in use): a group no other instance is in any
 * more is reused, so compat values that come and go (upgrades, restarts)
 * never exhaust the MAX_GROUPS live ones. -1 with MAX_GROUPS in use. */
int32_t td_rt_group_of_locked(td_router *r, td_kv_hash compat, int32_t bs, int32_t self) {
    for (int32_t g = 0; g < r->n_groups; g++)
        if (td_kv_hash_eq(r->groups[g], compat)) return g;
    int32_t g = r->n_groups;
    for (int32_t k = 0; k < r->n_groups && g == r->n_groups; k++) {
        bool in_use = false;
        for (int32_t i = 0; i < r->n_slots && !in_use; i++)
            in_use = i != self && r->in[i].used && r->in[i].group == k;
        if (!in_use) g = k;
    }
    if (g == MAX_GROUPS) return -1;
    r->groups[g] = compat;
    r->group_bs[g] = bs;
    if (g == r->n_groups) r->n_groups++;
    return g;
}

/* The pair will hold q's prompt blocks: predicted entries, so that its
 * siblings follow before the KV events arrive. Made at the decision and
 * renewed at the first token (a prefill may wait longer than the TTL). */
void td_rt_predict_locked(td_router *r, const rt_req *q, int32_t d, int32_t p, double now) {
    if (q->n_hashes <= 0) return;
    td_rt_index_predict(r->ix, d, q->hashes, (size_t)q->n_hashes, now, r->p.predict_ttl_s);
    if (p >= 0)
        td_rt_index_predict(r->ix, p, q->hashes, (size_t)q->n_hashes, now, r->p.predict_ttl_s);
}

/* n out of *v, and not below 0 */
static void take(int64_t *v, int64_t n) { *v = *v > n ? *v - n : 0; }

/* n routed to x at time t taken back: out of *pending (routed after the
 * last applied pull was sent) or out of *pulled (that pull's figures hold
 * it, while x still had it: they are one pull old at most); and noted in
 * *rel when a pull sent after the routing is out (its reply may hold it
 * too). true when it came out of *pulled. */
static bool give_back(inst *x, double t, int64_t n, int64_t *pending, int64_t *pulled,
                      int64_t *rel) {
    const bool from_pulled = t < x->snap_s;
    take(from_pulled ? pulled : pending, n);
    if (x->pull_sent_s > x->snap_s && t < x->pull_sent_s) *rel += n;
    return from_pulled;
}

void td_rt_release_pending_locked(td_router *r, rt_req *q, bool ended) {
    if (q->pp_tokens > 0) {
        inst *P = &r->in[q->pp_at];
        give_back(P, q->pp_t, q->pp_tokens, &P->pending_prefill, &P->queued_prefill_tokens,
                  &P->rel_tokens);
        q->pp_tokens = 0;
    }
    if (ended && q->pb_blocks > 0) {
        inst *D = &r->in[q->pb_at];
        if (give_back(D, q->pp_t, q->pb_blocks, &D->pending_blocks, &D->kv_used, &D->rel_blocks))
            D->kv_free = TD_MIN(D->kv_free + q->pb_blocks, D->kv_total);
        q->pb_blocks = 0;
    }
}

/* Chooses the pair for q (under mu) and records the decision. */
td_status td_rt_route_locked(td_router *r, rt_req *q, td_rt_choice *c) {
    double t0 = td_time_s();
    /* (n_groups, n_prompt + 1) block hashes: every group's chain */
    td_kv_hash *hashes = malloc((size_t)(r->n_groups > 0 ? r->n_groups : 1) *
                                (size_t)(q->n_prompt + 1) * sizeof *hashes);
    if (!hashes) {
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    int32_t n = r->n_slots;
    td_rt_inst vi[MAXI];
    int32_t overlap[MAXI], pred[MAXI];
    memset(overlap, 0, sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    for (int32_t i = 0; i < n; i++) {
        const inst *x = &r->in[i];
        vi[i] = (td_rt_inst){.prefill = x->prefill,
                             .usable = td_rt_usable(r, i, &q->excluded),
                             .group = x->group,
                             .block_size = x->block_size,
                             .queued_prefill_tokens = x->queued_prefill_tokens + x->pending_prefill,
                             .prefill_tokens_per_s = x->prefill_tokens_per_s,
                             .kv_free = x->kv_free,
                             .kv_used = x->kv_used,
                             .kv_total = x->kv_total,
                             .pending_blocks = x->pending_blocks,
                             .running = x->running + x->in_flight,
                             .waiting = x->waiting};
    }
    /* One walk of the prompt's hashes per compatibility group in use. */
    int32_t n_hash[MAX_GROUPS] = {0};
    bool kv = r->p.score.policy == TD_RT_KV_AWARE;
    for (int32_t g = 0; g < r->n_groups; g++) {
        td_rt_mask among = {{0}};
        bool any = false;
        for (int32_t i = 0; i < n; i++)
            if (vi[i].usable && vi[i].group == g) {
                td_rt_mask_set(&among, i);
                any = true;
            }
        if (!any) continue;
        n_hash[g] = td_kv_hash_chain(r->groups[g], q->prompt, q->n_prompt, r->group_bs[g],
                                     hashes + (size_t)g * (size_t)(q->n_prompt + 1));
        if (kv)
            td_rt_index_match(r->ix, hashes + (size_t)g * (size_t)(q->n_prompt + 1),
                              (size_t)n_hash[g], &among, t0, overlap, pred);
    }
    td_rt_trace *trace = NULL;
    if (r->p.log_decisions && (trace = calloc(1, sizeof *trace)))
        trace->pcost =
            malloc((size_t)TD_RT_MAX_CANDIDATES * (size_t)(n > 0 ? n : 1) * sizeof *trace->pcost);
    td_status st = td_rt_choose_traced(&r->p.score, vi, n, kv ? overlap : NULL, r->xfer, MAXI,
                                       q->n_prompt, q->max_tokens, r->counter, &r->rng, c, trace);
    if (r->p.log_decisions)
        td_rt_log_decision_locked(r, q, vi, n, kv ? overlap : NULL, trace, c, st, t0);
    if (trace) free(trace->pcost);
    free(trace);
    if (st != TD_OK) {
        free(hashes);
        return st;
    }
    if (q->admitting) {
        /* the chosen pair's queue at its measured speed (unknown: taken),
         * with what such predictions missed by on it so far */
        int32_t at = c->p >= 0 ? c->p : c->d;
        int32_t at_bs = vi[at].block_size > 0 ? vi[at].block_size : 16;
        double ms = td_rt_expected_ms(&vi[at], (int64_t)q->n_prompt - (int64_t)overlap[at] * at_bs);
        q->expect_at = ms >= 0 ? at : -1;
        q->expect_ms = ms;
        double with = ms + td_rt_extra_at(&r->in[at].ttft_extra, t0);
        if (ms >= 0 && r->p.reject_unmeetable && r->p.ttft_slo_ms > 0 && with > r->p.ttft_slo_ms) {
            TD_LOG_INFO("request %s: its first token expected in %.0f ms on %s (queue %.0f ms), "
                        "past the %.0f ms SLO: 429",
                        q->id, with, r->in[at].addr, ms, r->p.ttft_slo_ms);
            free(hashes);
            return TD_ERR_TIMEOUT;
        }
    }
    r->counter++;
    td_rt_release_pending_locked(r, q, true); /* a retry's earlier routing */
    inst *D = &r->in[c->d];
    int32_t bs = D->block_size > 0 ? D->block_size : 16;
    D->pending_blocks += c->need_blocks;
    D->in_flight++;
    D->routed++;
    inst *P = c->p >= 0 ? &r->in[c->p] : D;
    int64_t uncached = (int64_t)q->n_prompt - (int64_t)overlap[c->p >= 0 ? c->p : c->d] * bs;
    P->pending_prefill += uncached > 0 ? uncached : 0; /* what it will compute */
    q->pp_at = c->p >= 0 ? c->p : c->d;
    q->pp_tokens = uncached > 0 ? uncached : 0;
    q->pp_t = t0;
    q->pb_at = c->d;
    q->pb_blocks = c->need_blocks;
    if (c->p >= 0) P->routed++;
    r->decisions[r->p.score.policy][c->reason]++;
    r->prompt_tokens += (uint64_t)q->n_prompt;
    r->hit_decode_tokens += (uint64_t)overlap[c->d] * (uint64_t)bs;
    r->hit_prefill_tokens += (uint64_t)overlap[c->p >= 0 ? c->p : c->d] * (uint64_t)bs;
    int32_t g = D->group;
    q->n_hashes = 0;
    if (g >= 0 && n_hash[g] > 0) {
        /* Kept for the prediction's renewal at the first token. */
        td_kv_hash *keep = realloc(q->hashes, (size_t)n_hash[g] * sizeof *keep);
        if (keep) {
            memcpy(keep, hashes + (size_t)g * (size_t)(q->n_prompt + 1),
                   (size_t)n_hash[g] * sizeof *keep);
            q->hashes = keep;
            q->n_hashes = n_hash[g];
        }
        td_rt_predict_locked(r, q, c->d, c->p, t0);
    }
    free(hashes);
    r->decide_s += td_time_s() - t0;
    r->n_decide++;
    return TD_OK;
}
