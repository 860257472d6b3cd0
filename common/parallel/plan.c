/* Parallel plan: validation, rank coordinates, traffic figures, and the
 * --plan-dry-run report. */
#include "plan.h"

#include <errno.h>
#include <string.h>
#include <unistd.h>

#define TD_PLAN_MAX_WORLD 4096

struct td_plan {
    td_plan_params p;
    td_model_config cfg;
    int32_t n_expert, n_expert_used;
    int32_t stage_begin[TD_PLAN_MAX_PP + 1]; /* stage s: [stage_begin[s], stage_begin[s+1]) */
};

td_plan_params td_plan_default_params(void) {
    td_plan_params p;
    memset(&p, 0, sizeof p);
    p.tp = p.pp = p.cp = 1;
    p.ep = 0;
    p.cp_mode = TD_CP_ALLGATHER;
    p.cp_min_tokens = 256;
    return p;
}

static bool parse_int(const char *s, long lo, long hi, int *out) {
    if (!s) return false;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = (int)v;
    return true;
}

/* "A,B,C": layers per stage. */
static bool parse_layers(const char *s, td_plan_params *p) {
    if (!s || !*s) return false;
    int32_t v[TD_PLAN_MAX_PP];
    int n = 0;
    const char *q = s;
    for (;;) {
        if (n == TD_PLAN_MAX_PP) return false;
        char *end;
        errno = 0;
        long x = strtol(q, &end, 10);
        if (errno || end == q || x < 1 || x > 1000000) return false;
        v[n++] = (int32_t)x;
        if (*end == '\0') break;
        if (*end != ',') return false;
        q = end + 1;
    }
    memset(p->pp_layers, 0, sizeof p->pp_layers);
    memcpy(p->pp_layers, v, (size_t)n * sizeof v[0]);
    return true;
}

bool td_plan_set_flag(td_plan_params *p, td_plan_flag f, const char *val) {
    switch (f) {
    case TD_PLAN_FLAG_TP: return parse_int(val, 1, TD_PLAN_MAX_WORLD, &p->tp);
    case TD_PLAN_FLAG_PP: return parse_int(val, 1, TD_PLAN_MAX_PP, &p->pp);
    case TD_PLAN_FLAG_CP: return parse_int(val, 1, TD_PLAN_MAX_WORLD, &p->cp);
    case TD_PLAN_FLAG_EP: return parse_int(val, 1, TD_PLAN_MAX_WORLD, &p->ep);
    case TD_PLAN_FLAG_PP_LAYERS: return parse_layers(val, p);
    case TD_PLAN_FLAG_CP_MODE:
        if (!val || (strcmp(val, "allgather") != 0 && strcmp(val, "ring") != 0)) return false;
        p->cp_mode = !strcmp(val, "ring") ? TD_CP_RING : TD_CP_ALLGATHER;
        return true;
    case TD_PLAN_FLAG_CP_MIN_TOKENS: {
        int v;
        if (!parse_int(val, 0, 1 << 30, &v)) return false;
        p->cp_min_tokens = v;
        return true;
    }
    case TD_PLAN_FLAG_ATTN_DP: p->attn_dp = true; return true;
    case TD_PLAN_N_FLAGS: break;
    }
    return false;
}

static int kv_heads_local(const td_model_config *c, int tp) {
    return c->n_head_kv >= tp ? c->n_head_kv / tp : 1; /* replicated when tp > KV heads */
}

td_status td_plan_create(const td_plan_params *p, const td_model_config *cfg, int32_t n_expert,
                         int32_t n_expert_used, td_plan **plan_p) {
    if (!p || !cfg || !plan_p) return TD_ERR_INVALID;
    int bad = 0;
#define PLAN_ERR(...)                                                                              \
    do {                                                                                           \
        TD_LOG_ERROR(__VA_ARGS__);                                                                 \
        bad++;                                                                                     \
    } while (0)
    if (p->tp < 1 || p->pp < 1 || p->cp < 1 || p->ep < 0 || p->pp > TD_PLAN_MAX_PP)
        PLAN_ERR("plan: tp, pp and cp must be >= 1 (pp <= %d), ep >= 1", TD_PLAN_MAX_PP);
    long world = (long)p->tp * p->cp * p->pp;
    if (world > TD_PLAN_MAX_WORLD)
        PLAN_ERR("plan: tp x cp x pp = %ld ranks, more than %d", world, TD_PLAN_MAX_WORLD);
    if (bad) return TD_ERR_INVALID;

    /* Attention data-parallel: every rank holds the attention (and the
     * shared expert) whole, so nothing below is split over TP. */
    bool dp = p->attn_dp && n_expert > 0;
    int tp = dp ? 1 : p->tp;
    if (cfg->n_head % tp)
        PLAN_ERR("plan: --tp %d does not divide the %d attention heads", tp, cfg->n_head);
    if (cfg->n_head_kv % tp && tp % cfg->n_head_kv)
        PLAN_ERR("plan: --tp %d and the %d KV heads: one must divide the other (KV heads are "
                 "replicated when TP exceeds them)",
                 tp, cfg->n_head_kv);
    /* MoE models split every expert (and the shared one) like a dense FFN;
     * under EP (ep > 1, by default the TP group) the routed experts are
     * whole and only the shared expert is split. */
    int ep = n_expert > 0 ? (p->ep == 0 ? p->tp : p->ep) : 1;
    int32_t ffw = n_expert > 0 ? (ep > 1 ? cfg->n_ff_shexp : cfg->n_ff_exp) : cfg->n_ff;
    if (n_expert > 0 && ep == 1 && cfg->n_ff_exp % tp)
        PLAN_ERR("plan: --tp %d does not divide the FFN width %d", tp, cfg->n_ff_exp);
    else if (n_expert == 0 && ffw % tp)
        PLAN_ERR("plan: --tp %d does not divide the FFN width %d", tp, ffw);
    if (n_expert > 0 && cfg->n_ff_shexp % tp)
        PLAN_ERR("plan: --tp %d does not divide the shared expert's width %d", tp, cfg->n_ff_shexp);
    int be = td_dtype_block_elems(cfg->wtype);
    if (tp > 1 && be > 1 && cfg->n_head % tp == 0 && ffw % tp == 0) {
        int64_t attn_cols = (int64_t)cfg->n_head / tp * cfg->head_dim;
        int64_t ff_cols = ffw / tp;
        if (attn_cols % be || ff_cols % be)
            PLAN_ERR("plan: with --tp %d the row-parallel slices (%lld attention and %lld FFN "
                     "columns) do not fall on %s's %d-element blocks",
                     tp, (long long)attn_cols, (long long)ff_cols, td_dtype_name(cfg->wtype), be);
    }

    td_plan *plan = calloc(1, sizeof *plan);
    if (!plan) return TD_ERR_NOMEM;
    plan->p = *p;
    plan->cfg = *cfg;
    plan->n_expert = n_expert;
    plan->n_expert_used = n_expert_used;

    /* Layer split. */
    int32_t n_layer = cfg->n_layer;
    if (p->pp > n_layer) PLAN_ERR("plan: --pp %d exceeds the %d layers", p->pp, n_layer);
    int n_explicit = 0;
    int64_t sum = 0;
    for (int s = 0; s < TD_PLAN_MAX_PP && p->pp_layers[s] > 0; s++) {
        n_explicit++;
        sum += p->pp_layers[s];
    }
    if (n_explicit && n_explicit != p->pp)
        PLAN_ERR("plan: --pp-layers gives %d stages, --pp says %d", n_explicit, p->pp);
    else if (n_explicit && sum != n_layer)
        PLAN_ERR("plan: --pp-layers adds up to %lld layers, the model has %d", (long long)sum,
                 n_layer);
    if (!bad) {
        plan->stage_begin[0] = 0;
        for (int s = 0; s < p->pp; s++) {
            int32_t len =
                n_explicit ? p->pp_layers[s] : n_layer / p->pp + (s < n_layer % p->pp ? 1 : 0);
            plan->stage_begin[s + 1] = plan->stage_begin[s] + len;
        }
    }

    /* Experts: the EP group is a run of consecutive ranks of a TP group,
     * whose ranks hold the same token rows (after the attention all-reduce)
     * and split them for the dispatch; the CP ranks of a stage hold
     * different rows, so EP does not reach across them. */
    if (n_expert > 0) {
        if (n_expert_used < 1 || n_expert_used > n_expert)
            PLAN_ERR("plan: %d experts used per token out of %d", n_expert_used, n_expert);
        plan->p.ep = ep;
        if (n_expert % ep) PLAN_ERR("plan: --ep %d does not divide the %d experts", ep, n_expert);
        if (p->tp % ep)
            PLAN_ERR("plan: --ep %d does not divide --tp %d: the EP group is a run of consecutive "
                     "ranks of a TP group (EP across CP or PP ranks is not supported)",
                     ep, p->tp);
    } else {
        if (plan->p.ep > 1)
            PLAN_ERR("plan: --ep %d needs a mixture-of-experts model; this one is dense",
                     plan->p.ep);
        if (p->attn_dp) PLAN_ERR("plan: --attn-dp applies to mixture-of-experts models only");
        plan->p.ep = 1;
    }
    if (p->attn_dp && plan->p.ep < 2)
        PLAN_ERR("plan: --attn-dp needs an EP group of 2 or more ranks");
    if (dp && plan->p.ep != p->tp)
        PLAN_ERR("plan: --attn-dp runs attention data-parallel over the whole TP group: --ep %d "
                 "must equal --tp %d",
                 plan->p.ep, p->tp);
    if (dp && p->cp > 1) PLAN_ERR("plan: --attn-dp does not combine with --cp %d", p->cp);
#undef PLAN_ERR
    if (bad) {
        free(plan);
        return TD_ERR_INVALID;
    }
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (cores > 0 && world > cores)
        TD_LOG_WARN("plan: %ld ranks on %ld cores: ranks will share cores (allowed on CPU, "
                    "slower)",
                    world, cores);
    *plan_p = plan;
    return TD_OK;
}

void td_plan_destroy(td_plan *plan) { free(plan); }

int td_plan_world(const td_plan *plan) { return plan->p.tp * plan->p.cp * plan->p.pp; }

const td_plan_params *td_plan_params_get(const td_plan *plan) { return &plan->p; }

td_rank_coord td_plan_rank(const td_plan *plan, int r) {
    TD_ASSERT(r >= 0 && r < td_plan_world(plan));
    const td_plan_params *p = &plan->p;
    td_rank_coord c;
    c.rank = r;
    c.tp_rank = r % p->tp;
    c.cp_rank = (r / p->tp) % p->cp;
    c.pp_rank = r / (p->tp * p->cp);
    c.ep_rank = p->ep > 1 ? (c.cp_rank * p->tp + c.tp_rank) % p->ep : -1;
    c.layer_begin = plan->stage_begin[c.pp_rank];
    c.layer_end = plan->stage_begin[c.pp_rank + 1];
    return c;
}

/* Ranks attention (and the shared expert) is split over: 1 under --attn-dp. */

static int attn_tp(const td_plan *plan) {
    return plan->p.attn_dp && plan->n_expert > 0 ? 1 : plan->p.tp;
}

int td_plan_kv_heads_local(const td_plan *plan) {
    return kv_heads_local(&plan->cfg, attn_tp(plan));
}

td_rank_traffic td_plan_traffic(const td_plan *plan, int r) {
    const td_plan_params *p = &plan->p;
    const td_model_config *c = &plan->cfg;
    td_rank_coord rc = td_plan_rank(plan, r);
    double layers = rc.layer_end - rc.layer_begin;
    double f = sizeof(float);
    double hidden = (double)c->n_embd * f;
    int kvh = td_plan_kv_heads_local(plan);
    td_rank_traffic t;
    memset(&t, 0, sizeof t);
    int atp = attn_tp(plan);
    if (atp > 1) t.tp_per_token = layers * 2.0 * hidden * 2.0 * (p->tp - 1) / p->tp;
    if (atp > 1 && rc.pp_rank == 0) t.embd_per_token = hidden * 2.0 * (p->tp - 1) / p->tp;
    if (atp > 1 && rc.pp_rank == p->pp - 1)
        t.head_per_row = (double)((c->n_vocab + p->tp - 1) / p->tp) * f * (p->tp - 1);
    if (rc.pp_rank < p->pp - 1) t.pp_per_token = hidden;
    double kv_tok = layers * kvh * (double)c->head_dim * 2.0 * f;
    if (p->cp > 1) {
        /* Prefill: a rank owns 1/cp of the prompt's tokens and sends their
         * K/V to the cp-1 others (all-gather or ring: the same volume). */
        t.pcp_per_token = kv_tok / p->cp * (p->cp - 1);
        /* Decode: per layer, every local query head's partial output plus
         * its running max and exp-sum, gathered over the CP group. */
        double partial = (double)(c->n_head / p->tp) * ((double)c->head_dim + 2.0) * f;
        t.dcp_per_token = layers * partial * (p->cp - 1) / p->cp;
    }
    /* A TP rank routes 1/tp of the batch's rows; (ep-1)/ep of their choices
     * go to other ranks and come back (dispatch, then combine of the rows
     * this rank received: the same volume on average). */
    if (plan->n_expert > 0 && p->ep > 1)
        t.ep_per_token = layers * plan->n_expert_used * hidden * 2.0 * (p->ep - 1) / p->ep / p->tp;
    /* --attn-dp, last stage: the other ranks send the hidden state of their
     * logit rows (every token in decode) to rank 0, which runs the head. */
    if (attn_tp(plan) == 1 && p->attn_dp && rc.pp_rank == p->pp - 1 && rc.ep_rank > 0)
        t.ep_per_token += hidden / p->tp;
    t.kv_bytes_per_token = kv_tok / p->cp;
    return t;
}

static void fmt_bytes(double b, char *out, size_t cap) {
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int i = 0;
    while (b >= 1024.0 && i < 4) {
        b /= 1024.0;
        i++;
    }
    snprintf(out, cap, i ? "%.2f %s" : "%.0f %s", b, u[i]);
}

td_status td_plan_report(const td_plan *plan, const char *model_path, FILE *out) {
    const td_plan_params *p = &plan->p;
    const td_model_config *c = &plan->cfg;
    int world = td_plan_world(plan);
    fprintf(out, "plan: tp %d x cp %d x pp %d = %d rank%s", p->tp, p->cp, p->pp, world,
            world == 1 ? "" : "s");
    if (plan->n_expert > 0)
        fprintf(out, ", ep %d (%d experts, %d per token)%s", p->ep, plan->n_expert,
                plan->n_expert_used, p->attn_dp ? ", attention data-parallel" : "");
    if (p->cp > 1)
        fprintf(out, ", cp-mode %s, cp-min-tokens %d",
                p->cp_mode == TD_CP_RING ? "ring" : "allgather", p->cp_min_tokens);
    fprintf(out,
            "\nmodel: %s (%d layers, %d heads, %d KV heads, head_dim %d, embd %d, ffn %d, "
            "vocab %d, %s)\n",
            c->name, c->n_layer, c->n_head, c->n_head_kv, c->head_dim, c->n_embd,
            plan->n_expert > 0 ? c->n_ff_exp : c->n_ff, c->n_vocab, td_dtype_name(c->wtype));
    fprintf(out, "\n%-5s %-4s %-4s %-4s %-9s %-12s %-12s %-12s %-14s %-14s\n", "rank", "tp", "cp",
            "pp", "layers", "weights", "KV/token", "TP/token", "prefill/token", "decode/token");
    /* Weight shards: one load per distinct (tp_rank, stage); CP ranks hold
     * the same shard. */
    size_t shard_bytes[TD_PLAN_MAX_PP * 64];
    bool have[TD_PLAN_MAX_PP * 64];
    memset(have, 0, sizeof have);
    double total_w = 0, total_send_prefill = 0, total_send_decode = 0;
    for (int r = 0; r < world; r++) {
        td_rank_coord rc = td_plan_rank(plan, r);
        size_t key = (size_t)rc.pp_rank * 64 + (size_t)(rc.tp_rank % 64);
        size_t wbytes;
        if (p->tp <= 64 && have[key]) {
            wbytes = shard_bytes[key];
        } else {
            td_model_params mp = td_model_default_params();
            mp.path = model_path;
            mp.tp_rank = attn_tp(plan) == 1 ? 0 : rc.tp_rank;
            mp.tp_size = attn_tp(plan);
            mp.ep_rank = rc.ep_rank < 0 ? 0 : rc.ep_rank;
            mp.ep_size = p->ep;
            mp.layer_begin = rc.layer_begin;
            mp.layer_end = rc.layer_end;
            td_model *m = NULL;
            td_status st = td_model_load(&mp, &m);
            if (st != TD_OK) return st;
            wbytes = td_model_weight_bytes(m);
            td_model_free(m);
            if (p->tp <= 64) {
                shard_bytes[key] = wbytes;
                have[key] = true;
            }
        }
        total_w += (double)wbytes;
        td_rank_traffic t = td_plan_traffic(plan, r);
        double prefill =
            t.tp_per_token + t.embd_per_token + t.pp_per_token + t.pcp_per_token + t.ep_per_token;
        double decode = t.tp_per_token + t.embd_per_token + t.head_per_row + t.pp_per_token +
                        t.dcp_per_token + t.ep_per_token;
        total_send_prefill += prefill;
        total_send_decode += decode;
        char wb[32], kb[32], tb[32], pb[32], db[32], ly[32];
        fmt_bytes((double)wbytes, wb, sizeof wb);
        fmt_bytes(t.kv_bytes_per_token, kb, sizeof kb);
        fmt_bytes(t.tp_per_token, tb, sizeof tb);
        fmt_bytes(prefill, pb, sizeof pb);
        fmt_bytes(decode, db, sizeof db);
        snprintf(ly, sizeof ly, "%d-%d", rc.layer_begin, rc.layer_end - 1);
        fprintf(out, "%-5d %-4d %-4d %-4d %-9s %-12s %-12s %-12s %-14s %-14s\n", r, rc.tp_rank,
                rc.cp_rank, rc.pp_rank, ly, wb, kb, tb, pb, db);
    }
    char tw[32], sp[32], sd[32];
    fmt_bytes(total_w, tw, sizeof tw);
    fmt_bytes(total_send_prefill, sp, sizeof sp);
    fmt_bytes(total_send_decode, sd, sizeof sd);
    fprintf(out,
            "\nweights read by all ranks together: %s; bytes sent per token, all ranks: %s in "
            "prefill, %s in decode\n(a step of B tokens sends B times these; ring algorithms: an "
            "all-reduce of S bytes over n ranks sends 2S(n-1)/n per rank)\n",
            tw, sp, sd);

    /* The five questions. */
    fprintf(out, "\nwhat state is split:\n");
    bool dp = attn_tp(plan) == 1 && p->tp > 1;
    if (dp)
        fprintf(out,
                "  attention DP %d: sequences (sequence i on TP rank i mod %d, with its whole "
                "KV); attention, the shared expert, the embedding and the head are whole on every "
                "rank\n",
                p->tp, p->tp);
    else if (p->tp > 1)
        fprintf(out,
                "  TP %d: attention heads (%d query, %d KV per rank), FFN columns "
                "(%d per rank%s) and the vocabulary rows of the embedding and output head "
                "(%d per rank%s); KV cache by head\n",
                p->tp, c->n_head / p->tp, kv_heads_local(c, p->tp),
                (plan->n_expert == 0 ? c->n_ff
                 : p->ep > 1         ? c->n_ff_shexp
                                     : c->n_ff_exp) /
                    p->tp,
                plan->n_expert == 0 ? ""
                : p->ep > 1         ? " of the shared expert"
                                    : " of every expert",
                (c->n_vocab + p->tp - 1) / p->tp, c->n_vocab % p->tp ? ", fewer on the last" : "");
    if (p->pp > 1) fprintf(out, "  PP %d: layers by stage; KV cache by layer\n", p->pp);
    if (p->cp > 1)
        fprintf(out,
                "  CP %d: prompt tokens in prefill and KV positions in decode (block b on "
                "CP rank b mod %d)\n",
                p->cp, p->cp);
    if (plan->n_expert > 0 && p->ep > 1)
        fprintf(out, "  EP %d: experts (%d per rank), each whole; %s\n", p->ep,
                plan->n_expert / p->ep,
                dp ? "each rank routes the tokens of its own sequences"
                   : "the token rows of a TP group (each rank routes an equal share)");
    if (world == 1) fprintf(out, "  nothing: one rank holds everything\n");
    fprintf(out, "what is replicated:\n");
    if (dp)
        fprintf(out,
                "  attention, shared-expert, embedding and head weights on every rank of the TP "
                "group\n");
    else if (p->tp > c->n_head_kv)
        fprintf(out, "  KV heads: %d ranks share each of the %d KV heads\n", p->tp / c->n_head_kv,
                c->n_head_kv);
    if (p->cp > 1) fprintf(out, "  all weights across the %d CP ranks of a stage\n", p->cp);
    fprintf(out, "  norms%s\n", p->tp > 1 ? " on every TP rank" : "");
    if (plan->n_expert > 0)
        fprintf(out, "  the MoE router on every rank%s\n",
                p->tp > p->ep && p->ep > 1 ? "; the experts on each of the tp/ep EP groups" : "");
    fprintf(out, "what crosses the interconnect, and how often:\n");
    if (dp)
        fprintf(out, "  attention DP: the hidden state of every logit row to rank 0 (which runs "
                     "the head), once per step\n");
    else if (p->tp > 1)
        fprintf(out,
                "  TP: all-reduce of the hidden state (%d floats a token), twice per layer, "
                "every step; on the first stage one more for the vocab-parallel embedding; on "
                "the last an all-gather of the logits (%d floats per logit row)\n",
                c->n_embd, c->n_vocab);
    if (p->pp > 1)
        fprintf(out,
                "  PP: the hidden state at each of %d stage boundaries, once per "
                "micro-batch\n",
                p->pp - 1);
    if (p->cp > 1) {
        fprintf(out, "  PCP: the prompt's K/V, once per layer per prefill chunk (%s)\n",
                p->cp_mode == TD_CP_RING ? "ring: cp-1 passes, overlapped with compute"
                                         : "one all-gather");
        fprintf(out, "  DCP: partial attention (output, max, exp-sum per head), once per layer "
                     "per decode step\n");
    }
    if (plan->n_expert > 0 && p->ep > 1)
        fprintf(out, "  EP: token hidden states to their experts and back (all-to-all), twice "
                     "per MoE layer\n");
    if (world == 1) fprintf(out, "  nothing\n");
    fprintf(out, "what the plan improves:\n");
    if (dp)
        fprintf(out, "  attention DP: no attention all-reduces and no replicated KV heads; "
                     "each sequence's latency is one rank's\n");
    else if (p->tp > 1)
        fprintf(out, "  TP: memory per rank and latency (every token's work is split), at the "
                     "cost of 2 all-reduces per layer\n");
    if (p->pp > 1)
        fprintf(out, "  PP: memory per rank and throughput (stages work on different "
                     "micro-batches); not latency\n");
    if (p->cp > 1)
        fprintf(out, "  CP: prefill latency of long prompts and KV capacity for long contexts\n");
    if (plan->n_expert > 0 && p->ep > 1)
        fprintf(out, "  EP: expert memory per rank and MoE throughput\n");
    if (world == 1) fprintf(out, "  the baseline: no communication\n");
    return TD_OK;
}
