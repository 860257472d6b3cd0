/* Transfer mapping between two parallel plans (map.h). */
#include "map.h"

#include <string.h>

#define MAX_LCM 4096 /* CP sizes' least common multiple, at most */

td_status td_xfer_plan_from(const td_plan *plan, td_xfer_plan *out) {
    const td_plan_params *pp = td_plan_params_get(plan);
    if (pp->attn_dp) {
        TD_LOG_ERROR("transfer: an attention-DP plan splits KV by sequence; it cannot be a "
                     "transfer endpoint");
        return TD_ERR_UNSUPPORTED;
    }
    memset(out, 0, sizeof *out);
    out->tp = pp->tp;
    out->pp = pp->pp;
    out->cp = pp->cp;
    for (int s = 0; s < pp->pp; s++) {
        td_rank_coord c = td_plan_rank(plan, s * pp->tp * pp->cp);
        out->stage_begin[s] = c.layer_begin;
        out->stage_begin[s + 1] = c.layer_end;
    }
    return TD_OK;
}

void td_xfer_rank_heads(int tp, int tp_rank, int32_t n_head_kv, int32_t *h0, int32_t *h1) {
    if (tp <= n_head_kv) {
        *h0 = (int32_t)((int64_t)tp_rank * n_head_kv / tp);
        *h1 = (int32_t)((int64_t)(tp_rank + 1) * n_head_kv / tp);
    } else {
        *h0 = tp_rank / (tp / n_head_kv);
        *h1 = *h0 + 1;
    }
}

static bool plan_ok(const char *side, const td_xfer_plan *x, int32_t n_layer, int32_t n_kv) {
    if (x->tp < 1 || x->pp < 1 || x->pp > TD_PLAN_MAX_PP || x->cp < 1 || x->cp > MAX_LCM) {
        TD_LOG_ERROR("transfer: %s plan tp %d, pp %d, cp %d out of range", side, x->tp, x->pp,
                     x->cp);
        return false;
    }
    if (n_kv % x->tp && x->tp % n_kv) {
        TD_LOG_ERROR("transfer: %s plan tp %d and %d KV heads: one must divide the other", side,
                     x->tp, n_kv);
        return false;
    }
    if (x->stage_begin[0] != 0 || x->stage_begin[x->pp] != n_layer) {
        TD_LOG_ERROR("transfer: %s plan's stages do not cover the %d layers", side, n_layer);
        return false;
    }
    for (int s = 0; s < x->pp; s++) {
        if (x->stage_begin[s] >= x->stage_begin[s + 1]) {
            TD_LOG_ERROR("transfer: %s plan's stage %d is empty or out of order", side, s);
            return false;
        }
    }
    return true;
}

static int gcd(int a, int b) {
    while (b) {
        int t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* The prefill TP rank that serves heads [h0, h1) of a decode rank when the
 * prefill side replicates heads (each head on `rep` ranks): replica
 * d_tp_rank % rep, so decode ranks spread their reads over the replicas. */
static int replica(int p_tp, int32_t n_kv, int32_t head, int d_tp_rank) {
    int rep = p_tp / n_kv;
    return head * rep + d_tp_rank % rep;
}

td_status td_xfer_map(const td_xfer_plan *p, const td_xfer_plan *d, int32_t n_layer,
                      int32_t n_head_kv, td_xfer_route *routes, int cap, int *n_routes) {
    if (!p || !d || !n_routes || cap < 0 || (cap > 0 && !routes) || n_layer < 1 || n_head_kv < 1)
        return TD_ERR_INVALID;
    if (!plan_ok("prefill", p, n_layer, n_head_kv) || !plan_ok("decode", d, n_layer, n_head_kv))
        return TD_ERR_INVALID;
    int64_t lcm = (int64_t)p->cp / gcd(p->cp, d->cp) * d->cp;
    if (lcm > MAX_LCM) {
        TD_LOG_ERROR("transfer: CP sizes %d and %d: block pattern of %lld is too long", p->cp,
                     d->cp, (long long)lcm);
        return TD_ERR_INVALID;
    }
    int n = 0;
    int d_world = d->tp * d->cp * d->pp;
    for (int dr = 0; dr < d_world; dr++) {
        int d_tp = dr % d->tp, d_cp = (dr / d->tp) % d->cp, d_pp = dr / (d->tp * d->cp);
        int32_t dl0 = d->stage_begin[d_pp], dl1 = d->stage_begin[d_pp + 1];
        int32_t dh0, dh1;
        td_xfer_rank_heads(d->tp, d_tp, n_head_kv, &dh0, &dh1);
        for (int p_pp = 0; p_pp < p->pp; p_pp++) {
            int32_t l0 = TD_MAX(dl0, p->stage_begin[p_pp]);
            int32_t l1 = TD_MIN(dl1, p->stage_begin[p_pp + 1]);
            if (l0 >= l1) continue;
            /* Prefill TP ranks in head order, each with the part of
             * [dh0, dh1) it serves. */
            for (int p_tp = 0; p_tp < p->tp; p_tp++) {
                int32_t ph0, ph1;
                td_xfer_rank_heads(p->tp, p_tp, n_head_kv, &ph0, &ph1);
                int32_t h0 = TD_MAX(dh0, ph0), h1 = TD_MIN(dh1, ph1);
                if (h0 >= h1) continue;
                if (p->tp > n_head_kv && p_tp != replica(p->tp, n_head_kv, h0, d_tp)) continue;
                for (int p_cp = 0; p_cp < p->cp; p_cp++) {
                    /* blocks b with b % p->cp == p_cp and b % d->cp == d_cp:
                     * one residue mod lcm, or none */
                    int res = -1;
                    for (int r = p_cp; r < lcm; r += p->cp)
                        if (r % d->cp == d_cp) {
                            res = r;
                            break;
                        }
                    if (res < 0) continue;
                    if (n < cap)
                        routes[n] = (td_xfer_route){
                            .p_rank = (p_pp * p->cp + p_cp) * p->tp + p_tp,
                            .d_rank = dr,
                            .layer_begin = l0,
                            .layer_end = l1,
                            .head_begin = h0,
                            .head_end = h1,
                            .block_mod = (int32_t)lcm,
                            .block_res = res,
                        };
                    n++;
                }
            }
        }
    }
    *n_routes = n;
    return n > cap ? TD_ERR_RANGE : TD_OK;
}
