/* What the router reports (router.h): the gauges and the metrics text of
 * /metrics, the cluster view of /internal/v1/cluster. */
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/kv/hash.h"
#include "router-impl.h"

void td_router_gauges(void *ctx, td_metrics_gauges *g) {
    td_router *r = ctx;
    pthread_mutex_lock(&r->mu);
    g->running = r->n_running;
    g->waiting = r->n_queued;
    g->draining = r->draining;
    pthread_mutex_unlock(&r->mu);
}

char *td_router_metrics_text(void *ctx) {
    td_router *r = ctx;
    td_strbuf b = {0};
    char line[512];
    pthread_mutex_lock(&r->mu);
    td_strbuf_puts(&b, "# HELP tandem:router_decisions_total Routing decisions by policy and "
                       "reason (remote prefill, or local prefill and why).\n"
                       "# TYPE tandem:router_decisions_total counter\n");
    for (int p = 0; p < TD_RT_N_POLICIES; p++)
        for (int k = 0; k < TD_RT_N_REASONS; k++) {
            if (p != (int)r->p.score.policy && !r->decisions[p][k]) continue;
            snprintf(line, sizeof line,
                     "tandem:router_decisions_total{policy=\"%s\",reason=\"%s\"} %" PRIu64 "\n",
                     td_rt_policy_str((td_rt_policy)p), td_rt_reason_str((td_rt_reason)k),
                     r->decisions[p][k]);
            td_strbuf_puts(&b, line);
        }
    snprintf(line, sizeof line,
             "# HELP tandem:router_prefix_hit_tokens_total Prompt tokens the chosen instance "
             "held in its prefix cache (as the router's index saw it), by role.\n"
             "# TYPE tandem:router_prefix_hit_tokens_total counter\n"
             "tandem:router_prefix_hit_tokens_total{role=\"prefill\"} %" PRIu64 "\n"
             "tandem:router_prefix_hit_tokens_total{role=\"decode\"} %" PRIu64 "\n"
             "# HELP tandem:router_prompt_tokens_total Prompt tokens routed.\n"
             "# TYPE tandem:router_prompt_tokens_total counter\n"
             "tandem:router_prompt_tokens_total %" PRIu64 "\n",
             r->hit_prefill_tokens, r->hit_decode_tokens, r->prompt_tokens);
    td_strbuf_puts(&b, line);
    snprintf(line, sizeof line,
             "# HELP tandem:router_queue_length Requests waiting for KV headroom.\n"
             "# TYPE tandem:router_queue_length gauge\ntandem:router_queue_length %d\n"
             "# HELP tandem:router_queue_rejected_total Requests answered 429 (queue full).\n"
             "# TYPE tandem:router_queue_rejected_total counter\n"
             "tandem:router_queue_rejected_total %" PRIu64 "\n"
             "# HELP tandem:router_queue_timeouts_total Requests that waited past "
             "--queue-timeout.\n"
             "# TYPE tandem:router_queue_timeouts_total counter\n"
             "tandem:router_queue_timeouts_total %" PRIu64 "\n",
             r->n_queued, r->rejected, r->timeouts);
    td_strbuf_puts(&b, line);
    snprintf(line, sizeof line,
             "# HELP tandem:router_unmeetable_total Requests answered 429 at once: their first "
             "token could not come within --ttft-slo-ms (--reject-unmeetable).\n"
             "# TYPE tandem:router_unmeetable_total counter\n"
             "tandem:router_unmeetable_total %" PRIu64 "\n",
             r->unmeetable);
    td_strbuf_puts(&b, line);
    snprintf(line, sizeof line,
             "# HELP tandem:router_retries_total Requests sent again to another instance "
             "before their first token.\n"
             "# TYPE tandem:router_retries_total counter\ntandem:router_retries_total %" PRIu64 "\n"
             "# HELP tandem:router_decision_seconds Time spent choosing (hashing, index "
             "lookup, scoring).\n"
             "# TYPE tandem:router_decision_seconds summary\n"
             "tandem:router_decision_seconds_sum %.9f\n"
             "tandem:router_decision_seconds_count %" PRIu64 "\n",
             r->retries, r->decide_s, r->n_decide);
    td_strbuf_puts(&b, line);
    snprintf(line, sizeof line,
             "# HELP tandem:router_failed_total Requests that ended in an error, by whether a "
             "token had been sent (after: the decode instance failed mid-stream).\n"
             "# TYPE tandem:router_failed_total counter\n"
             "tandem:router_failed_total{stage=\"before_first_token\"} %" PRIu64 "\n"
             "tandem:router_failed_total{stage=\"after_first_token\"} %" PRIu64 "\n",
             r->failed[0], r->failed[1]);
    td_strbuf_puts(&b, line);
    td_strbuf_puts(&b, "# HELP tandem:router_instance_ready Instance in rotation (1) or not.\n"
                       "# TYPE tandem:router_instance_ready gauge\n");
    for (int32_t i = 0; i < r->n_slots; i++) {
        if (!r->in[i].used) continue;
        snprintf(line, sizeof line, "tandem:router_instance_ready{role=\"%s\",address=\"%s\"} %d\n",
                 r->in[i].prefill ? "prefill" : "decode", r->in[i].addr, td_rt_usable(r, i, NULL));
        td_strbuf_puts(&b, line);
    }
    td_strbuf_puts(&b, "# HELP tandem:router_pair_transfer_ms Moving average of the exposed KV "
                       "transfer tail per (prefill, decode) pair (PrefillDone's arrival after "
                       "the prefill instance's last layer), as the decode instance measured "
                       "it.\n"
                       "# TYPE tandem:router_pair_transfer_ms gauge\n");
    for (int32_t p = 0; p < r->n_slots; p++)
        for (int32_t d = 0; d < r->n_slots; d++) {
            float ms = r->xfer[(size_t)p * MAXI + (size_t)d];
            if (!r->in[p].used || !r->in[d].used || ms <= 0) continue;
            snprintf(line, sizeof line,
                     "tandem:router_pair_transfer_ms{prefill=\"%s\",decode=\"%s\"} %.3f\n",
                     r->in[p].addr, r->in[d].addr, ms);
            td_strbuf_puts(&b, line);
        }
    pthread_mutex_unlock(&r->mu);
    if (b.oom) {
        td_strbuf_free(&b);
        return NULL;
    }
    return b.v;
}

char *td_router_cluster_json(void *ctx) {
    td_router *r = ctx;
    json_t *list = json_array(), *pairs = json_array();
    pthread_mutex_lock(&r->mu);
    for (int32_t i = 0; list && i < r->n_slots; i++) {
        const inst *x = &r->in[i];
        if (!x->used) continue;
        char ep[24], compat[33];
        snprintf(ep, sizeof ep, "%016" PRIx64, x->epoch);
        td_kv_hash_hex(x->compat, compat);
        json_t *o = json_pack(
            "{s:s,s:s,s:s,s:s,s:b,s:b,s:b,s:b,s:s,s:i,s:{s:i,s:i,s:I,s:{s:I,s:I,s:I,s:I,s:i}},"
            "s:I,s:i,s:I,s:I,s:I,s:s}",
            "role", x->prefill ? "prefill" : "decode", "address", x->addr, "instance_id", x->id,
            "epoch", ep, "ready", td_rt_usable(r, i, NULL), "healthy", x->healthy, "draining",
            x->draining, "discovered", x->dns, "compat", compat, "group", x->group, "load",
            "running", x->running, "waiting", x->waiting, "queued_prefill_tokens",
            (json_int_t)x->queued_prefill_tokens, "kv", "total", (json_int_t)x->kv_total, "free",
            (json_int_t)x->kv_free, "used", (json_int_t)x->kv_used, "cached",
            (json_int_t)x->kv_cached, "block_size", x->block_size, "cached_blocks_indexed",
            (json_int_t)td_rt_index_count(r->ix, i), "in_flight", x->in_flight, "pending_blocks",
            (json_int_t)x->pending_blocks, "routed", (json_int_t)x->routed, "failures",
            (json_int_t)x->failures, "error", x->err);
        /* the prompt tokens routed to it after its last applied pull was sent, not
         * yet known done: the router's addition to its prefill queue */
        if (o) json_object_set_new(o, "pending_prefill", json_integer(x->pending_prefill));
        /* state pulls applied (one sent after time t is in once this grows by 2) */
        if (o) json_object_set_new(o, "pulls", json_integer((json_int_t)x->pulls));
        if (o && !x->prefill) json_object_set_new(o, "grpc_target", json_string(x->target));
        if (o)
            json_object_set_new(json_object_get(o, "load"), "prefill_tokens_per_s",
                                json_real(x->prefill_tokens_per_s));
        if (o)
            json_object_set_new(json_object_get(o, "load"), "ttft_extra_ms",
                                json_real(td_rt_extra_at(&x->ttft_extra, td_time_s())));
        json_array_append_new(list, o);
    }
    for (int32_t p = 0; pairs && p < r->n_slots; p++)
        for (int32_t d = 0; d < r->n_slots; d++) {
            float ms = r->xfer[(size_t)p * MAXI + (size_t)d];
            if (!r->in[p].used || !r->in[d].used || ms <= 0) continue;
            json_array_append_new(pairs, json_pack("{s:s,s:s,s:f}", "prefill", r->in[p].addr,
                                                   "decode", r->in[d].addr, "transfer_ms", ms));
        }
    json_t *root = json_pack(
        "{s:s,s:o,s:o,s:i,s:i,s:I,s:b,s:{s:f,s:f,s:f,s:f,s:i,s:f,s:i,s:I}}", "policy",
        td_rt_policy_str(r->p.score.policy), "instances", list ? list : json_array(), "pairs",
        pairs ? pairs : json_array(), "queued", r->n_queued, "running", r->n_running,
        "index_blocks", (json_int_t)td_rt_index_size(r->ix), "draining", r->draining, "score",
        "overlap_weight", r->p.score.overlap_weight, "decode_weight", r->p.score.decode_weight,
        "transfer_weight", r->p.score.transfer_weight, "temperature", r->p.score.temperature,
        "local_prefill_tokens", r->p.score.local_prefill_tokens, "local_prefill_fraction",
        r->p.score.local_prefill_fraction, "local_prefill_max_tokens",
        r->p.score.local_prefill_max_tokens, "prefill_saturated_tokens",
        (json_int_t)r->p.score.prefill_saturated_tokens);
    pthread_mutex_unlock(&r->mu);
    char *s = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    return s;
}

static json_t *num_or_null(double v) { return isfinite(v) ? json_real(v) : json_null(); }

void td_rt_log_decision_locked(const td_router *r, const rt_req *q, const td_rt_inst *vi, int32_t n,
                               const int32_t *overlap, const td_rt_trace *t, const td_rt_choice *c,
                               td_status st, double now) {
    json_t *insts = json_array(), *cands = json_array();
    for (int32_t i = 0; insts && i < n; i++) {
        const inst *x = &r->in[i];
        if (!x->used) continue;
        json_array_append_new(
            insts,
            json_pack("{s:s,s:s,s:b,s:i,s:I,s:I,s:I,s:i,s:i,s:i,s:I,s:I,s:I,s:o}", "address",
                      x->addr, "role", x->prefill ? "prefill" : "decode", "usable", vi[i].usable,
                      "overlap_blocks", overlap ? overlap[i] : 0, "queued_prefill_tokens",
                      (json_int_t)x->queued_prefill_tokens, "pending_prefill",
                      (json_int_t)x->pending_prefill, "pending_blocks",
                      (json_int_t)x->pending_blocks, "running", x->running, "waiting", x->waiting,
                      "in_flight", x->in_flight, "kv_used", (json_int_t)x->kv_used, "kv_free",
                      (json_int_t)x->kv_free, "cached_blocks_indexed",
                      (json_int_t)td_rt_index_count(r->ix, i), "state_age_ms",
                      num_or_null(x->have_state ? (now - x->snap_s) * 1e3 : NAN)));
    }
    for (int32_t k = 0; cands && t && k < t->n_cand; k++) {
        const td_rt_cand *cd = &t->cand[k];
        json_t *pc = json_object(), *xf = json_object();
        for (int32_t p = 0; t->pcost && pc && xf && p < n; p++) {
            double v = t->pcost[(size_t)k * (size_t)n + (size_t)p];
            if (isnan(v)) continue;
            json_object_set_new(pc, r->in[p].addr, json_real(v));
            float ms = r->xfer[(size_t)p * MAXI + (size_t)cd->d];
            json_object_set_new(xf, r->in[p].addr, ms > 0 ? json_real(ms) : json_null());
        }
        json_array_append_new(
            cands, json_pack("{s:s,s:o,s:s,s:f,s:f,s:o,s:o}", "decode", r->in[cd->d].addr,
                             "prefill", cd->p >= 0 ? json_string(r->in[cd->p].addr) : json_null(),
                             "reason", td_rt_reason_str(cd->reason), "decode_cost", cd->dcost,
                             "cost", cd->cost, "prefill_costs", pc ? pc : json_object(),
                             "transfer_ms", xf ? xf : json_object()));
    }
    json_t *choice = json_null();
    if (st == TD_OK)
        choice = json_pack("{s:s,s:o,s:s,s:f}", "decode", r->in[c->d].addr, "prefill",
                           c->p >= 0 ? json_string(r->in[c->p].addr) : json_null(), "reason",
                           td_rt_reason_str(c->reason), "cost", c->cost);
    json_t *root =
        json_pack("{s:s,s:i,s:s,s:i,s:i,s:o,s:o,s:o,s:s}", "request", q->id, "attempt", q->attempts,
                  "policy", td_rt_policy_str(r->p.score.policy), "prompt_tokens", q->n_prompt,
                  "max_tokens", q->max_tokens, "instances", insts ? insts : json_array(),
                  "candidates", cands ? cands : json_array(), "choice",
                  choice ? choice : json_null(), "status", td_status_str(st));
    char *s = root ? json_dumps(root, JSON_COMPACT) : NULL;
    if (s)
        TD_LOG_INFO("decision %s", s);
    else
        TD_LOG_ERROR("request %s: out of memory logging its routing decision", q->id);
    free(s);
    json_decref(root);
}
