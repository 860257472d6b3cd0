/* The simulator's files (simio.h). */
#include "simio.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- clusters ---- */

/* An optional number field: absent keeps *v; present must be a number in [lo, hi]. */
static bool opt_num(json_t *o, const char *k, double lo, double hi, double *v) {
    json_t *x = json_object_get(o, k);
    if (!x) return true;
    if (!json_is_number(x)) return false;
    double d = json_number_value(x);
    if (!(d >= lo && d <= hi)) return false;
    *v = d;
    return true;
}

static bool opt_int(json_t *o, const char *k, int64_t lo, int64_t hi, int32_t *v) {
    json_t *x = json_object_get(o, k);
    if (!x) return true;
    if (!json_is_integer(x) || json_integer_value(x) < lo || json_integer_value(x) > hi)
        return false;
    *v = (int32_t)json_integer_value(x);
    return true;
}

static bool opt_bool(json_t *o, const char *k, bool *v) {
    json_t *x = json_object_get(o, k);
    if (!x) return true;
    if (!json_is_boolean(x)) return false;
    *v = json_is_true(x);
    return true;
}

static td_status parse_score(json_t *o, td_rt_score_params *sp, const char *where, char *why,
                             size_t n) {
    *sp = td_rt_score_default_params();
    if (!o) return TD_OK;
    if (!json_is_object(o)) return td_sim_invalid(why, n, "%s: score must be an object", where);
    json_t *pol = json_object_get(o, "policy");
    if (pol) {
        int p = json_is_string(pol) ? td_rt_policy_parse(json_string_value(pol)) : -1;
        if (p < 0)
            return td_sim_invalid(
                why, n, "%s: score.policy is kv-aware, round-robin, random or least-loaded", where);
        sp->policy = (td_rt_policy)p;
    }
    int32_t sat = sp->prefill_saturated_tokens > INT32_MAX ? INT32_MAX
                                                           : (int32_t)sp->prefill_saturated_tokens;
    if (!opt_num(o, "overlap_weight", 0, 1e6, &sp->overlap_weight) ||
        !opt_num(o, "decode_weight", 0, 1e6, &sp->decode_weight) ||
        !opt_num(o, "transfer_weight", 0, 1e6, &sp->transfer_weight) ||
        !opt_num(o, "temperature", 0, 1e6, &sp->temperature) ||
        !opt_int(o, "local_prefill_tokens", 0, 1 << 24, &sp->local_prefill_tokens) ||
        !opt_num(o, "local_prefill_fraction", 0, 1, &sp->local_prefill_fraction) ||
        !opt_int(o, "local_prefill_max_tokens", 0, 1 << 24, &sp->local_prefill_max_tokens) ||
        !opt_int(o, "prefill_saturated_tokens", 1, INT32_MAX, &sat) ||
        !opt_int(o, "reserve_output_tokens", 0, 1 << 24, &sp->reserve_output_tokens))
        return td_sim_invalid(why, n, "%s: a score field out of range or not a number", where);
    sp->prefill_saturated_tokens = sat;
    return TD_OK;
}

/* A step model's coefficients (absent ones 0). */
static bool parse_step(json_t *step, td_step_model *m) {
    return opt_num(step, "c0", -10, 100, &m->c0) && opt_num(step, "c_tok", -1, 1, &m->c_tok) &&
           opt_num(step, "c_tok2", -1, 1, &m->c_tok2) &&
           opt_num(step, "c_attn", -1, 1, &m->c_attn) &&
           opt_num(step, "c_attn2", -1, 1, &m->c_attn2) &&
           opt_num(step, "c_ctx", -1, 1, &m->c_ctx) && opt_num(step, "c_seq", -1, 1, &m->c_seq) &&
           opt_num(step, "c_n2", -1, 1, &m->c_n[0]) && opt_num(step, "c_n4", -1, 1, &m->c_n[1]) &&
           opt_num(step, "c_n8", -1, 1, &m->c_n[2]) && opt_num(step, "c_n16", -1, 1, &m->c_n[3]);
}

static td_status parse_instance(json_t *o, td_sim_instance *x, int32_t *count, const char *where,
                                char *why, size_t n) {
    if (!json_is_object(o))
        return td_sim_invalid(why, n, "%s: an instance must be an object", where);
    memset(x, 0, sizeof *x);
    const char *role = json_string_value(json_object_get(o, "role"));
    if (!role) return td_sim_invalid(why, n, "%s: role is colocated, prefill or decode", where);
    if (strcmp(role, "colocated") == 0)
        x->role = TD_SIM_COLOCATED;
    else if (strcmp(role, "prefill") == 0)
        x->role = TD_SIM_PREFILL;
    else if (strcmp(role, "decode") == 0)
        x->role = TD_SIM_DECODE;
    else
        return td_sim_invalid(why, n, "%s: role '%s' is not colocated, prefill or decode", where,
                              role);
    *count = 1;
    x->block_size = 16;
    x->n_blocks = 0;
    x->sched = td_sched_default_params();
    json_t *sc = json_object_get(o, "sched"), *step = json_object_get(o, "step");
    if (!opt_int(o, "count", 1, TD_SIM_MAX_INSTANCES, count) ||
        !opt_int(o, "block_size", 1, 4096, &x->block_size) ||
        !opt_int(o, "n_blocks", 1, 1 << 24, &x->n_blocks) || x->n_blocks < 1)
        return td_sim_invalid(why, n,
                              "%s: count (1-%d), n_blocks (required, >= 1) or block_size bad",
                              where, TD_SIM_MAX_INSTANCES);
    if (!json_is_object(sc) || !json_is_object(step))
        return td_sim_invalid(why, n, "%s: sched and step must be objects", where);
    td_sched_params *p = &x->sched;
    p->max_ctx = 0;
    if (!opt_int(sc, "max_running", 1, 1 << 16, &p->max_running) ||
        !opt_int(sc, "max_batch_tokens", 1, 1 << 24, &p->max_batch_tokens) ||
        !opt_int(sc, "max_waiting", 0, 1 << 24, &p->max_waiting) ||
        !opt_int(sc, "reserve_output_tokens", 0, 1 << 24, &p->reserve_output_tokens) ||
        !opt_int(sc, "max_ctx", 2, 1 << 24, &p->max_ctx) || p->max_ctx < 2 ||
        !opt_bool(sc, "prefix_cache", &p->prefix_cache) ||
        !opt_num(sc, "prefill_share", 0, 1, &p->prefill_share) ||
        !opt_num(sc, "tpot_target_s", 0, 3599, &p->tpot_target_s) ||
        !opt_num(sc, "tpot_decode_factor", 0, 1e5, &p->tpot_decode_factor))
        return td_sim_invalid(why, n, "%s: a sched field out of range (max_ctx required)", where);
    if (!parse_step(step, &x->step) || !opt_num(o, "step_overhead_s", 0, 100, &x->step_overhead_s))
        return td_sim_invalid(why, n, "%s: a step coefficient is not a number or out of range",
                              where);
    x->host = -1;
    json_t *beside = json_object_get(o, "beside");
    if (!opt_int(o, "host", -1, TD_SIM_MAX_INSTANCES - 1, &x->host))
        return td_sim_invalid(why, n, "%s: host is -1 to %d", where, TD_SIM_MAX_INSTANCES - 1);
    if (beside) {
        json_t *bstep = json_object_get(beside, "step");
        if (!json_is_object(beside) || !json_is_object(bstep) ||
            !parse_step(bstep, &x->step_beside) ||
            !opt_num(beside, "step_overhead_s", 0, 100, &x->beside_overhead_s))
            return td_sim_invalid(
                why, n,
                "%s: beside is {\"step\": {coefficients}, \"step_overhead_s\": s}, "
                "its numbers in range",
                where);
        x->has_beside = true;
    }
    return TD_OK;
}

static td_status parse_cluster(json_t *o, td_sim_named_cluster *nc, const char *where, char *why,
                               size_t n) {
    memset(nc, 0, sizeof *nc);
    if (!json_is_object(o)) return td_sim_invalid(why, n, "%s: a cluster must be an object", where);
    td_sim_cluster *c = &nc->c;
    const char *name = json_string_value(json_object_get(o, "name"));
    snprintf(nc->name, sizeof nc->name, "%s", name ? name : "");
    c->router = false;
    if (!opt_bool(o, "router", &c->router) ||
        !opt_num(o, "xfer_s_per_token", 0, 1, &c->xfer_s_per_token) ||
        !opt_num(o, "xfer_fixed_s", 0, 100, &c->xfer_fixed_s) ||
        !opt_num(o, "request_overhead_s", 0, 100, &c->request_overhead_s) ||
        !opt_num(o, "poll_interval_s", 0, 60, &c->poll_interval_s))
        return td_sim_invalid(
            why, n,
            "%s: router, xfer_s_per_token, xfer_fixed_s, request_overhead_s or poll_interval_s bad",
            where);
    td_status st = parse_score(json_object_get(o, "score"), &c->score, where, why, n);
    if (st != TD_OK) return st;
    json_t *arr = json_object_get(o, "instances");
    if (!json_is_array(arr) || json_array_size(arr) == 0)
        return td_sim_invalid(why, n, "%s: instances must be a non-empty array", where);
    size_t i;
    json_t *v;
    json_array_foreach(arr, i, v) {
        char w[320];
        snprintf(w, sizeof w, "%s: instances[%zu]", where, i);
        td_sim_instance x;
        int32_t count;
        st = parse_instance(v, &x, &count, w, why, n);
        if (st != TD_OK) return st;
        if (c->n_inst + count > TD_SIM_MAX_INSTANCES)
            return td_sim_invalid(why, n, "%s: more than %d instances", where,
                                  TD_SIM_MAX_INSTANCES);
        for (int32_t k = 0; k < count; k++) c->inst[c->n_inst++] = x;
    }
    return TD_OK;
}

td_status td_sim_read_clusters(const char *path, td_sim_named_cluster **out, int32_t *n,
                               bool *is_array, char *why, size_t why_len) {
    *out = NULL;
    *n = 0;
    *is_array = false;
    json_error_t err;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &err);
    if (!root) return td_sim_invalid(why, why_len, "%s:%d: %s", path, err.line, err.text);
    size_t count = json_is_array(root) ? json_array_size(root) : 1;
    td_status st = TD_OK;
    if (count == 0 || count > 100000) st = td_sim_invalid(why, why_len, "%s: no cluster", path);
    td_sim_named_cluster *v = st == TD_OK ? calloc(count, sizeof *v) : NULL;
    if (st == TD_OK && !v) st = TD_ERR_NOMEM;
    for (size_t i = 0; st == TD_OK && i < count; i++) {
        char where[256];
        snprintf(where, sizeof where, "%s: cluster %zu", path, i);
        st = parse_cluster(json_is_array(root) ? json_array_get(root, i) : root, &v[i], where, why,
                           why_len);
    }
    bool arr = json_is_array(root);
    json_decref(root);
    if (st != TD_OK) {
        free(v);
        return st;
    }
    *out = v;
    *n = (int32_t)count;
    *is_array = arr;
    return TD_OK;
}

/* ---- workloads ---- */

void td_sim_workload_free(td_sim_workload *w) {
    free(w->reqs);
    free(w->segs);
    memset(w, 0, sizeof *w);
}

static bool grow(void **p, int64_t *cap, int64_t need, size_t elem) {
    if (need <= *cap) return true;
    int64_t c = *cap ? *cap * 2 : 1024;
    while (c < need) c *= 2;
    void *q = realloc(*p, (size_t)c * elem);
    if (!q) return false;
    *p = q;
    *cap = c;
    return true;
}

/* One line's request; its segments appended at w->segs[w->n_segs..]. */
static bool parse_request(json_t *o, td_sim_workload *w, int64_t *seg_cap, td_sim_request *r,
                          int64_t *seg_at, bool *oom) {
    json_t *t = json_object_get(o, "t"), *seg = json_object_get(o, "seg"),
           *out = json_object_get(o, "out");
    if (!json_is_object(o) || !json_is_number(t) || !json_is_array(seg) || !json_is_integer(out) ||
        json_array_size(seg) == 0 || json_array_size(seg) > 1 << 20)
        return false;
    r->t_arrival = json_number_value(t);
    if (!(r->t_arrival >= 0 && r->t_arrival < 1e9) || json_integer_value(out) < 1 ||
        json_integer_value(out) > 1 << 24)
        return false;
    r->n_output = (int32_t)json_integer_value(out);
    *seg_at = w->n_segs;
    r->n_seg = (int32_t)json_array_size(seg);
    if (!grow((void **)&w->segs, seg_cap, w->n_segs + r->n_seg, sizeof *w->segs)) {
        *oom = true;
        return false;
    }
    int64_t total = 0;
    size_t i;
    json_t *s;
    json_array_foreach(seg, i, s) {
        json_t *id = json_array_get(s, 0), *len = json_array_get(s, 1);
        if (!json_is_array(s) || json_array_size(s) != 2 || !json_is_integer(id) ||
            !json_is_integer(len) || json_integer_value(id) < -1 || json_integer_value(len) < 1 ||
            json_integer_value(len) > 1 << 24)
            return false;
        total += json_integer_value(len);
        w->segs[w->n_segs + (int64_t)i] =
            (td_sim_segment){json_integer_value(id), (int32_t)json_integer_value(len)};
    }
    if (total > 1 << 24) return false;
    w->n_segs += r->n_seg;
    return true;
}

td_status td_sim_read_workload(const char *path, td_sim_workload *w, char *why, size_t why_len) {
    memset(w, 0, sizeof *w);
    FILE *f = fopen(path, "r");
    if (!f) return td_sim_invalid(why, why_len, "%s: %s", path, strerror(errno));
    int64_t cap = 0, seg_cap = 0, *seg_at = NULL, at_cap = 0, line = 0;
    char *buf = NULL;
    size_t buf_len = 0;
    td_status st = TD_OK;
    bool oom = false;
    for (;;) {
        ssize_t len = getline(&buf, &buf_len, f);
        if (len < 0) break;
        line++;
        size_t k = 0;
        while (k < (size_t)len &&
               (buf[k] == ' ' || buf[k] == '\t' || buf[k] == '\n' || buf[k] == '\r'))
            k++;
        if (k == (size_t)len) continue; /* a blank line */
        if (w->n >= (1 << 24)) {
            st = td_sim_invalid(why, why_len, "%s:%lld: more than 2^24 requests", path,
                                (long long)line);
            break;
        }
        if (!grow((void **)&w->reqs, &cap, w->n + 1, sizeof *w->reqs) ||
            !grow((void **)&seg_at, &at_cap, w->n + 1, sizeof *seg_at)) {
            st = TD_ERR_NOMEM;
            break;
        }
        json_error_t err;
        json_t *o = json_loadb(buf, (size_t)len, JSON_REJECT_DUPLICATES, &err);
        td_sim_request *r = &w->reqs[w->n];
        bool ok = o && parse_request(o, w, &seg_cap, r, &seg_at[w->n], &oom);
        json_decref(o);
        if (oom) {
            st = TD_ERR_NOMEM;
            break;
        }
        if (!ok) {
            st = td_sim_invalid(
                why, why_len,
                o ? "%s:%lld: expected {\"t\": seconds >= 0, \"seg\": [[id >= -1, tokens "
                    ">= 1], ...], \"out\": tokens >= 1}"
                  : "%s:%lld: not JSON",
                path, (long long)line);
            break;
        }
        if (w->n > 0 && r->t_arrival < w->reqs[w->n - 1].t_arrival) {
            st = td_sim_invalid(why, why_len,
                                "%s:%lld: arrivals must be in order (t %.6g after %.6g)", path,
                                (long long)line, r->t_arrival, w->reqs[w->n - 1].t_arrival);
            break;
        }
        w->n++;
    }
    if (st == TD_OK && ferror(f)) st = td_sim_invalid(why, why_len, "%s: read error", path);
    if (st == TD_OK && w->n == 0) st = td_sim_invalid(why, why_len, "%s: no requests", path);
    fclose(f);
    free(buf);
    for (int32_t i = 0; st == TD_OK && i < w->n; i++) w->reqs[i].seg = w->segs + seg_at[i];
    free(seg_at);
    if (st != TD_OK) td_sim_workload_free(w);
    return st;
}

/* ---- results ---- */

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Linear interpolation between closest ranks (numpy's default, as tandem bench). */
static double pct(const double *v, int64_t n, double p) {
    double k = (double)(n - 1) * p / 100.0;
    int64_t f = (int64_t)floor(k), c = f + 1 < n ? f + 1 : n - 1;
    return v[f] + (v[c] - v[f]) * (k - (double)f);
}

/* tandem bench's summary of v (sorted here), in ms from seconds. */
static json_t *summary(double *v, int64_t n) {
    if (n == 0)
        return json_pack("{s:i,s:n,s:n,s:n,s:n,s:n,s:n,s:n}", "count", 0, "mean", "min", "p50",
                         "p90", "p95", "p99", "max");
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += v[i];
    return json_pack("{s:I,s:f,s:f,s:f,s:f,s:f,s:f,s:f}", "count", (json_int_t)n, "mean",
                     1e3 * sum / (double)n, "min", 1e3 * v[0], "p50", 1e3 * pct(v, n, 50), "p90",
                     1e3 * pct(v, n, 90), "p95", 1e3 * pct(v, n, 95), "p99", 1e3 * pct(v, n, 99),
                     "max", 1e3 * v[n - 1]);
}

static json_t *cdf(const double *v, int64_t n) { /* v sorted */
    json_t *a = json_array();
    for (int p = 0; n > 0 && p <= 100; p++) json_array_append_new(a, json_real(1e3 * pct(v, n, p)));
    return a;
}

static bool good(const td_sim_outcome *o, const td_sim_request *r, const td_sim_slo *slo) {
    if (o->failed) return false;
    if (slo->ttft_ms > 0 && 1e3 * o->ttft > slo->ttft_ms) return false;
    if (slo->tpot_ms > 0 && r->n_output > 1 && 1e3 * o->tpot > slo->tpot_ms) return false;
    if (slo->e2e_ms > 0 && 1e3 * o->e2e > slo->e2e_ms) return false;
    return true;
}

json_t *td_sim_result_json(const td_sim_named_cluster *nc, const td_sim_workload *w,
                           const td_sim_outcome *o, const td_sim_stats *st, const td_sim_slo *slo,
                           double wall_s) {
    int32_t n = w->n;
    double *v = malloc((size_t)TD_MAX(n, 1) * sizeof *v);
    double *itl = malloc((size_t)TD_MAX(st->n_itl, 1) * sizeof *itl);
    if (!v || !itl) {
        free(v);
        free(itl);
        return NULL;
    }
    int64_t n_ok = 0, n_good = 0;
    for (int32_t i = 0; i < n; i++) {
        n_ok += !o[i].failed;
        n_good += good(&o[i], &w->reqs[i], slo);
    }
    double dur = st->t_end;
    bool has_slo = slo->ttft_ms > 0 || slo->tpot_ms > 0 || slo->e2e_ms > 0;
    json_t *busy = json_array();
    for (int32_t i = 0; i < nc->c.n_inst; i++)
        json_array_append_new(busy, json_real(dur > 0 ? st->busy_s[i] / dur : 0));
    json_t *r = json_pack(
        "{s:s,s:i,s:I,s:I,s:f,s:f,s:o,s:o,s:I,s:I,s:I,s:I,s:I,s:I,s:o,s:f,s:f}", "name", nc->name,
        "num_prompts", n, "completed", (json_int_t)n_ok, "failed", (json_int_t)(n - n_ok),
        "duration_s", dur, "request_throughput", dur > 0 ? (double)n_ok / dur : 0.0,
        "good_requests", has_slo ? json_integer(n_good) : json_null(), "goodput",
        has_slo ? json_real(dur > 0 ? (double)n_good / dur : 0.0) : json_null(), "steps",
        (json_int_t)st->steps, "preemptions", (json_int_t)st->preemptions, "remote_prefills",
        (json_int_t)st->remote_prefills, "max_router_queue", (json_int_t)st->max_router_queue,
        "polls", (json_int_t)st->polls, "steps_beside", (json_int_t)st->steps_beside, "busy", busy,
        "wall_s", wall_s, "sim_requests_per_s", wall_s > 0 ? n / wall_s : 0.0);
    json_t *c = json_object();
    int64_t k = 0;
    for (int32_t i = 0; i < n; i++)
        if (!o[i].failed) v[k++] = o[i].ttft;
    json_object_set_new(r, "ttft_ms", summary(v, k));
    json_object_set_new(c, "ttft_ms", cdf(v, k));
    k = 0;
    for (int32_t i = 0; i < n; i++)
        if (!o[i].failed && w->reqs[i].n_output > 1) v[k++] = o[i].tpot;
    json_object_set_new(r, "tpot_ms", summary(v, k));
    json_object_set_new(c, "tpot_ms", cdf(v, k));
    k = 0;
    for (int32_t i = 0; i < n; i++)
        if (!o[i].failed) v[k++] = o[i].e2e;
    json_object_set_new(r, "e2e_ms", summary(v, k));
    for (int64_t i = 0; i < st->n_itl; i++) itl[i] = st->itl[i];
    json_object_set_new(r, "itl_ms", summary(itl, st->n_itl));
    json_object_set_new(r, "cdf", c);
    free(v);
    free(itl);
    return r;
}
