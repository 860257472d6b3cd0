/* Serving metrics: counters and fixed-bucket histograms behind one mutex,
 * rendered as Prometheus text exposition 0.0.4. */
#include "metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* 1 ms .. 320 s: GPU decode steps (a few ms) and CPU prefills of long prompts
 * (minutes) both land in distinct buckets. The strings are the rendered "le"
 * values, kept next to the numbers so the text is exact. */
static const double k_lat_le[] = {0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                                  0.075, 0.1,   0.15,  0.2,  0.3,   0.4,  0.5,   0.75, 1,    1.5,
                                  2,     2.5,   5,     7.5,  10,    20,   40,    80,   160,  320};
static const char *const k_lat_le_str[] = {
    "0.001", "0.002", "0.005", "0.01", "0.015", "0.02", "0.025", "0.03", "0.04", "0.05",
    "0.075", "0.1",   "0.15",  "0.2",  "0.3",   "0.4",  "0.5",   "0.75", "1",    "1.5",
    "2",     "2.5",   "5",     "7.5",  "10",    "20",   "40",    "80",   "160",  "320"};

/* Powers of two, 1 .. 131072 tokens (the longest contexts in use). */
static const double k_tok_le[] = {1,   2,    4,    8,    16,   32,    64,    128,   256,
                                  512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072};
static const char *const k_tok_le_str[] = {"1",    "2",    "4",     "8",     "16",    "32",
                                           "64",   "128",  "256",   "512",   "1024",  "2048",
                                           "4096", "8192", "16384", "32768", "65536", "131072"};

_Static_assert(TD_ARRAY_SIZE(k_lat_le) == TD_ARRAY_SIZE(k_lat_le_str), "latency buckets");
_Static_assert(TD_ARRAY_SIZE(k_tok_le) == TD_ARRAY_SIZE(k_tok_le_str), "token buckets");

#define TD_HIST_MAX_BUCKETS 32

typedef struct {
    const char *name, *help;
    const double *le;
    const char *const *le_str;
    int n_le;
    uint64_t counts[TD_HIST_MAX_BUCKETS + 1]; /* per bucket, not cumulative; last is +Inf */
    uint64_t count;
    double sum;
} td_hist;

enum {
    H_TTFT,
    H_ITL,
    H_E2E,
    H_QUEUE,
    H_PREFILL,
    H_DECODE,
    H_INFERENCE,
    H_PROMPT_TOKENS,
    H_GEN_TOKENS,
    H_ITER_TOKENS,
    H_KV_XFER,
    H_KV_TAIL,
    H_COUNT
};

/* Distinct (status, type) pairs kept for tandem:request_errors; the types
 * come from the server's own error mapping, so a handful exist. Pairs past
 * the cap are folded into type="other" so memory stays bounded. */
#define TD_ERR_KINDS_MAX 64
#define TD_ERR_TYPE_MAX  64

typedef struct {
    int status;
    char type[TD_ERR_TYPE_MAX];
    uint64_t n;
} td_err_kind;

struct td_metrics {
    pthread_mutex_t mu;
    char *label; /* model_name value, already escaped */
    uint64_t prompt_tokens, generation_tokens;
    uint64_t success[TD_FINISH_COUNT];
    uint64_t prefix_queries, prefix_hits;
    uint64_t preemptions;
    td_hist hist[H_COUNT];
    td_err_kind errs[TD_ERR_KINDS_MAX];
    int n_errs;
    /* parallel plan */
    int n_ranks;
    uint64_t plan_steps;
    double rank_compute[TD_METRICS_MAX_RANKS], rank_comm[TD_METRICS_MAX_RANKS];
    double rank_last_compute[TD_METRICS_MAX_RANKS], rank_last_comm[TD_METRICS_MAX_RANKS];
    int n_experts;
    uint64_t expert_tokens[TD_METRICS_MAX_EXPERTS];
    double expert_imbalance;
    /* disaggregation */
    uint64_t xfer_bytes, remote_prefills;
    uint64_t xfer_failures[TD_XFER_FAIL_COUNT];
    uint64_t local_prefills[TD_LOCAL_PREFILL_COUNT];
};

static void hist_observe(td_hist *h, double v);

static const char *const k_xfer_fail[TD_XFER_FAIL_COUNT] = {"deadline", "peer_error", "rejected",
                                                            "failed",   "aborted",    "invalid"};
static const char *const k_local_prefill[TD_LOCAL_PREFILL_COUNT] = {
    "threshold", "no_peer", "fallback", "router", "saturated"};

void td_metrics_kv_transfer(td_metrics *m, uint64_t bytes, double seconds) {
    if (!m) return;
    pthread_mutex_lock(&m->mu);
    m->xfer_bytes += bytes;
    if (seconds >= 0) hist_observe(&m->hist[H_KV_XFER], seconds);
    pthread_mutex_unlock(&m->mu);
}

void td_metrics_kv_transfer_tail(td_metrics *m, double seconds) {
    if (!m) return;
    pthread_mutex_lock(&m->mu);
    hist_observe(&m->hist[H_KV_TAIL], seconds);
    pthread_mutex_unlock(&m->mu);
}

void td_metrics_kv_transfer_failure(td_metrics *m, td_xfer_fail why) {
    if (!m || (int)why < 0 || why >= TD_XFER_FAIL_COUNT) return;
    pthread_mutex_lock(&m->mu);
    m->xfer_failures[why]++;
    pthread_mutex_unlock(&m->mu);
}

void td_metrics_prefill_route(td_metrics *m, bool remote, td_local_prefill why) {
    if (!m) return;
    pthread_mutex_lock(&m->mu);
    if (remote)
        m->remote_prefills++;
    else if ((int)why >= 0 && why < TD_LOCAL_PREFILL_COUNT)
        m->local_prefills[why]++;
    pthread_mutex_unlock(&m->mu);
}

const char *td_finish_reason_str(td_finish_reason r) {
    switch (r) {
    case TD_FINISH_STOP: return "stop";
    case TD_FINISH_LENGTH: return "length";
    case TD_FINISH_ABORT: return "abort";
    case TD_FINISH_ERROR: return "error";
    default: return NULL;
    }
}

/* Label values escape backslash, double quote and newline (text format 0.0.4). */
static char *escape_label(const char *s) {
    size_t n = 1;
    for (const char *p = s; *p; p++) n += (*p == '\\' || *p == '"' || *p == '\n') ? 2 : 1;
    char *out = malloc(n);
    if (!out) return NULL;
    char *o = out;
    for (const char *p = s; *p; p++) {
        if (*p == '\\') {
            *o++ = '\\';
            *o++ = '\\';
        } else if (*p == '"') {
            *o++ = '\\';
            *o++ = '"';
        } else if (*p == '\n') {
            *o++ = '\\';
            *o++ = 'n';
        } else {
            *o++ = *p;
        }
    }
    *o = '\0';
    return out;
}

static void hist_init(td_hist *h, const char *name, const char *help, bool tokens) {
    h->name = name;
    h->help = help;
    h->le = tokens ? k_tok_le : k_lat_le;
    h->le_str = tokens ? k_tok_le_str : k_lat_le_str;
    h->n_le = tokens ? (int)TD_ARRAY_SIZE(k_tok_le) : (int)TD_ARRAY_SIZE(k_lat_le);
    TD_ASSERT(h->n_le <= TD_HIST_MAX_BUCKETS);
}

/* Caller holds the lock. Non-finite values are dropped (they would poison
 * _sum); a negative latency from clock skew counts as 0. */
static void hist_observe(td_hist *h, double v) {
    if (!isfinite(v)) return;
    if (v < 0) v = 0;
    int i = 0;
    while (i < h->n_le && v > h->le[i]) i++;
    h->counts[i]++;
    h->count++;
    h->sum += v;
}

td_status td_metrics_create(const char *model_name, td_metrics **m_p) {
    if (!model_name || !m_p) return TD_ERR_INVALID;
    td_metrics *m = calloc(1, sizeof *m);
    if (!m) return TD_ERR_NOMEM;
    m->label = escape_label(model_name);
    if (!m->label) goto fail_label;
    if (pthread_mutex_init(&m->mu, NULL) != 0) goto fail_mutex;
    hist_init(&m->hist[H_TTFT], "vllm:time_to_first_token_seconds",
              "Histogram of time to first token in seconds.", false);
    hist_init(&m->hist[H_ITL], "vllm:inter_token_latency_seconds",
              "Histogram of inter-token latency in seconds.", false);
    hist_init(&m->hist[H_E2E], "vllm:e2e_request_latency_seconds",
              "Histogram of end to end request latency in seconds.", false);
    hist_init(&m->hist[H_QUEUE], "vllm:request_queue_time_seconds",
              "Histogram of time spent waiting in the queue in seconds.", false);
    hist_init(&m->hist[H_PREFILL], "vllm:request_prefill_time_seconds",
              "Histogram of time spent in the prefill phase in seconds.", false);
    hist_init(&m->hist[H_DECODE], "vllm:request_decode_time_seconds",
              "Histogram of time spent in the decode phase in seconds.", false);
    hist_init(&m->hist[H_INFERENCE], "vllm:request_inference_time_seconds",
              "Histogram of time spent running (prefill and decode) in seconds.", false);
    hist_init(&m->hist[H_PROMPT_TOKENS], "vllm:request_prompt_tokens",
              "Number of prefill tokens processed.", true);
    hist_init(&m->hist[H_GEN_TOKENS], "vllm:request_generation_tokens",
              "Number of generation tokens processed.", true);
    hist_init(&m->hist[H_ITER_TOKENS], "vllm:iteration_tokens_total",
              "Histogram of number of tokens per engine step.", true);
    hist_init(&m->hist[H_KV_XFER], "tandem:kv_transfer_seconds",
              "Per remote prefill: first KV push to PrefillDone (prefill side: job received to "
              "PrefillDone sent), in seconds.",
              false);
    hist_init(&m->hist[H_KV_TAIL], "tandem:kv_transfer_tail_seconds",
              "Exposed transfer tail: PrefillDone's arrival at the decode instance minus the end "
              "of the prefill's last layer, in seconds (clocks of two hosts: meaningful when "
              "synchronised).",
              false);
    *m_p = m;
    return TD_OK;

fail_mutex:
    free(m->label);
fail_label:
    free(m);
    TD_LOG_ERROR("out of memory or mutex init failed");
    return TD_ERR_NOMEM;
}

void td_metrics_destroy(td_metrics *m) {
    if (!m) return;
    pthread_mutex_destroy(&m->mu);
    free(m->label);
    free(m);
}

void td_metrics_first_token(td_metrics *m, double ttft_s, double queue_s) {
    if (!m) return;
    pthread_mutex_lock(&m->mu);
    hist_observe(&m->hist[H_TTFT], ttft_s);
    hist_observe(&m->hist[H_QUEUE], queue_s);
    pthread_mutex_unlock(&m->mu);
}

void td_metrics_inter_token(td_metrics *m, double itl_s) {
    if (!m) return;
    pthread_mutex_lock(&m->mu);
    hist_observe(&m->hist[H_ITL], itl_s);
    pthread_mutex_unlock(&m->mu);
}

void td_metrics_prefix_cache(td_metrics *m, int64_t queried_tokens, int64_t hit_tokens) {
    if (!m || queried_tokens < 0 || hit_tokens < 0) return;
    pthread_mutex_lock(&m->mu);
    m->prefix_queries += (uint64_t)queried_tokens;
    m->prefix_hits += (uint64_t)hit_tokens;
    pthread_mutex_unlock(&m->mu);
}

void td_metrics_preemption(td_metrics *m) {
    if (!m) return;
    pthread_mutex_lock(&m->mu);
    m->preemptions++;
    pthread_mutex_unlock(&m->mu);
}

void td_metrics_iteration(td_metrics *m, int32_t n_tokens) {
    if (!m || n_tokens < 0) return;
    pthread_mutex_lock(&m->mu);
    hist_observe(&m->hist[H_ITER_TOKENS], (double)n_tokens);
    pthread_mutex_unlock(&m->mu);
}

void td_metrics_rank_step(td_metrics *m, int n, const double *compute_s, const double *comm_s) {
    if (!m || n < 1 || !compute_s || !comm_s) return;
    n = TD_MIN(n, TD_METRICS_MAX_RANKS);
    pthread_mutex_lock(&m->mu);
    m->n_ranks = TD_MAX(m->n_ranks, n);
    m->plan_steps++;
    for (int r = 0; r < n; r++) {
        double c = isfinite(compute_s[r]) && compute_s[r] > 0 ? compute_s[r] : 0;
        double x = isfinite(comm_s[r]) && comm_s[r] > 0 ? comm_s[r] : 0;
        m->rank_compute[r] += c;
        m->rank_comm[r] += x;
        m->rank_last_compute[r] = c;
        m->rank_last_comm[r] = x;
    }
    pthread_mutex_unlock(&m->mu);
}

void td_metrics_expert_load(td_metrics *m, int n, const int64_t *tokens) {
    if (!m || n < 1 || !tokens) return;
    n = TD_MIN(n, TD_METRICS_MAX_EXPERTS);
    int64_t total = 0, mx = 0;
    for (int i = 0; i < n; i++) {
        int64_t t = tokens[i] > 0 ? tokens[i] : 0;
        total += t;
        mx = TD_MAX(mx, t);
    }
    pthread_mutex_lock(&m->mu);
    m->n_experts = TD_MAX(m->n_experts, n);
    for (int i = 0; i < n; i++) m->expert_tokens[i] += (uint64_t)(tokens[i] > 0 ? tokens[i] : 0);
    if (total > 0) m->expert_imbalance = (double)mx * n / (double)total;
    pthread_mutex_unlock(&m->mu);
}

void td_metrics_request_finished(td_metrics *m, const td_request_record *r) {
    if (!m || !r) return;
    pthread_mutex_lock(&m->mu);
    int32_t np = TD_MAX(r->n_prompt_tokens, 0), no = TD_MAX(r->n_output_tokens, 0);
    m->prompt_tokens += (uint64_t)np;
    m->generation_tokens += (uint64_t)no;
    if (r->finish > TD_FINISH_NONE && r->finish < TD_FINISH_COUNT) m->success[r->finish]++;
    hist_observe(&m->hist[H_E2E], r->t_finished - r->t_arrival);
    hist_observe(&m->hist[H_PROMPT_TOKENS], (double)np);
    hist_observe(&m->hist[H_GEN_TOKENS], (double)no);
    if (r->t_scheduled > 0) {
        hist_observe(&m->hist[H_INFERENCE], r->t_finished - r->t_scheduled);
        if (r->t_first_token > 0) {
            hist_observe(&m->hist[H_PREFILL], r->t_first_token - r->t_scheduled);
            hist_observe(&m->hist[H_DECODE], r->t_finished - r->t_first_token);
        }
    }
    pthread_mutex_unlock(&m->mu);
    td_obs_log_request(r);
}

void td_metrics_request_error(td_metrics *m, int http_status, const char *type) {
    if (!m) return;
    char t[TD_ERR_TYPE_MAX];
    snprintf(t, sizeof t, "%s", type && *type ? type : "unknown");
    pthread_mutex_lock(&m->mu);
    td_err_kind *k = NULL;
    for (int i = 0; i < m->n_errs && !k; i++)
        if (m->errs[i].status == http_status && strcmp(m->errs[i].type, t) == 0) k = &m->errs[i];
    if (!k && m->n_errs < TD_ERR_KINDS_MAX - 1) {
        k = &m->errs[m->n_errs++];
        k->status = http_status;
        memcpy(k->type, t, sizeof t);
    }
    if (!k) {
        /* The last slot is reserved for the overflow bucket. */
        k = &m->errs[TD_ERR_KINDS_MAX - 1];
        if (m->n_errs < TD_ERR_KINDS_MAX) {
            m->n_errs = TD_ERR_KINDS_MAX;
            k->status = 0;
            snprintf(k->type, sizeof k->type, "other");
        }
    }
    k->n++;
    pthread_mutex_unlock(&m->mu);
}

/* ---- rendering ---- */

typedef struct {
    char *buf;
    size_t len, cap;
    bool oom;
} td_sbuf;

static void sb_printf(td_sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(td_sbuf *b, const char *fmt, ...) {
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->buf + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = true;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap * 2 + (size_t)n + 1;
        char *nb = realloc(b->buf, cap);
        if (!nb) {
            b->oom = true;
            return;
        }
        b->buf = nb;
        b->cap = cap;
    }
}

/* Integers as integers; otherwise the shortest decimal that reads back as the
 * same double. */
static void fmt_double(double v, char out[32]) {
    if (isnan(v)) {
        snprintf(out, 32, "NaN");
        return;
    }
    if (isinf(v)) {
        snprintf(out, 32, v > 0 ? "+Inf" : "-Inf");
        return;
    }
    if (v == floor(v) && fabs(v) < 1e15) {
        snprintf(out, 32, "%.0f", v);
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(out, 32, "%.*g", prec, v);
        if (strtod(out, NULL) == v) return;
    }
}

static void family(td_sbuf *b, const char *name, const char *type, const char *help) {
    sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void gauge(td_sbuf *b, const td_metrics *m, const char *name, const char *help, double v) {
    char s[32];
    fmt_double(v, s);
    family(b, name, "gauge", help);
    sb_printf(b, "%s{model_name=\"%s\"} %s\n", name, m->label, s);
}

/* name without the _total suffix, as in the metrics.h list. */
static void counter(td_sbuf *b, const td_metrics *m, const char *name, const char *help,
                    uint64_t v) {
    char full[128];
    snprintf(full, sizeof full, "%s_total", name);
    family(b, full, "counter", help);
    sb_printf(b, "%s{model_name=\"%s\"} %llu\n", full, m->label, (unsigned long long)v);
}

static void histogram(td_sbuf *b, const td_metrics *m, const td_hist *h) {
    family(b, h->name, "histogram", h->help);
    uint64_t cum = 0;
    for (int i = 0; i < h->n_le; i++) {
        cum += h->counts[i];
        sb_printf(b, "%s_bucket{model_name=\"%s\",le=\"%s\"} %llu\n", h->name, m->label,
                  h->le_str[i], (unsigned long long)cum);
    }
    cum += h->counts[h->n_le];
    char s[32];
    fmt_double(h->sum, s);
    sb_printf(b, "%s_bucket{model_name=\"%s\",le=\"+Inf\"} %llu\n", h->name, m->label,
              (unsigned long long)cum);
    sb_printf(b, "%s_sum{model_name=\"%s\"} %s\n", h->name, m->label, s);
    sb_printf(b, "%s_count{model_name=\"%s\"} %llu\n", h->name, m->label,
              (unsigned long long)h->count);
}

static void render_gauges(td_sbuf *b, const td_metrics *m, const td_metrics_gauges *g) {
    gauge(b, m, "vllm:num_requests_running", "Number of requests in model execution batches.",
          g->running);
    gauge(b, m, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
          g->waiting);
    gauge(b, m, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
          g->kv_total > 0 ? (double)g->kv_used / (double)g->kv_total : 0.0);
    family(b, "tandem:kv_blocks", "gauge", "KV cache blocks by state.");
    const struct {
        const char *state;
        int32_t v;
    } st[] = {{"empty", g->kv_empty},
              {"cached", g->kv_cached},
              {"used", g->kv_used},
              {"reserved", g->kv_reserved},
              {"total", g->kv_total}};
    for (size_t i = 0; i < TD_ARRAY_SIZE(st); i++)
        sb_printf(b, "tandem:kv_blocks{model_name=\"%s\",state=\"%s\"} %d\n", m->label, st[i].state,
                  (int)st[i].v);
    gauge(b, m, "tandem:kv_fragmentation",
          "Fraction of free KV blocks outside the largest contiguous free run (0..1).",
          g->kv_fragmentation);
    gauge(b, m, "tandem:queued_prefill_tokens",
          "Prompt tokens admitted or waiting that are not yet prefilled.",
          (double)g->queued_prefill_tokens);
    gauge(b, m, "tandem:draining", "1 while the instance drains after SIGTERM.",
          g->draining ? 1.0 : 0.0);
    if (!g->disagg) return;
    gauge(b, m, "tandem:prefill_queue_tokens",
          "Prompt tokens queued for prefill on this instance (what a prefill pool autoscales on).",
          (double)g->queued_prefill_tokens);
    gauge(b, m, "tandem:kv_leased_blocks",
          "KV blocks leased to remote prefills in flight (decode: destinations; prefill: sources "
          "held until their puts are flushed).",
          g->kv_leased);
    gauge(b, m, "tandem:kv_quarantined_blocks",
          "KV blocks fenced after a failed transfer, held until the peer's endpoints are closed.",
          g->kv_quarantined);
    gauge(b, m, "tandem:kv_transfers_in_flight", "Remote prefills in flight.", g->xfer_in_flight);
}

static void render_xfer(td_sbuf *b, const td_metrics *m) {
    counter(b, m, "tandem:kv_transfer_bytes", "KV bytes moved by remote prefills.", m->xfer_bytes);
    counter(b, m, "tandem:remote_prefill", "Prefills run on a prefill instance.",
            m->remote_prefills);
    family(b, "tandem:local_prefill_total", "counter",
           "Prefills run here on a decode instance, by reason.");
    for (int i = 0; i < TD_LOCAL_PREFILL_COUNT; i++)
        sb_printf(b, "tandem:local_prefill_total{model_name=\"%s\",reason=\"%s\"} %llu\n", m->label,
                  k_local_prefill[i], (unsigned long long)m->local_prefills[i]);
    family(b, "tandem:kv_transfer_failures_total", "counter", "Failed KV transfers, by reason.");
    for (int i = 0; i < TD_XFER_FAIL_COUNT; i++)
        sb_printf(b, "tandem:kv_transfer_failures_total{model_name=\"%s\",reason=\"%s\"} %llu\n",
                  m->label, k_xfer_fail[i], (unsigned long long)m->xfer_failures[i]);
}

/* One labelled sample per rank or expert. Caller holds the lock. */
static void per_index(td_sbuf *b, const td_metrics *m, const char *name, const char *label, int n,
                      const double *v) {
    for (int i = 0; i < n; i++) {
        char s[32];
        fmt_double(v[i], s);
        sb_printf(b, "%s{model_name=\"%s\",%s=\"%d\"} %s\n", name, m->label, label, i, s);
    }
}

/* The parallel plan's families, once a step or a routed step was recorded. */
static void render_plan(td_sbuf *b, const td_metrics *m) {
    if (m->n_ranks > 0) {
        counter(b, m, "tandem:plan_steps", "Steps run through the parallel plan.", m->plan_steps);
        family(b, "tandem:rank_compute_seconds_total", "counter",
               "Per rank: time of the steps outside communication, in seconds.");
        per_index(b, m, "tandem:rank_compute_seconds_total", "rank", m->n_ranks, m->rank_compute);
        family(b, "tandem:rank_comm_seconds_total", "counter",
               "Per rank: time inside communication calls (waiting included), in seconds.");
        per_index(b, m, "tandem:rank_comm_seconds_total", "rank", m->n_ranks, m->rank_comm);
        family(b, "tandem:rank_step_compute_seconds", "gauge",
               "Per rank: compute time of the last step, in seconds.");
        per_index(b, m, "tandem:rank_step_compute_seconds", "rank", m->n_ranks,
                  m->rank_last_compute);
        family(b, "tandem:rank_step_comm_seconds", "gauge",
               "Per rank: communication time of the last step, in seconds.");
        per_index(b, m, "tandem:rank_step_comm_seconds", "rank", m->n_ranks, m->rank_last_comm);
    }
    if (m->n_experts > 0) {
        family(b, "tandem:expert_tokens_total", "counter",
               "Per expert: tokens routed to it, summed over the layers.");
        for (int i = 0; i < m->n_experts; i++)
            sb_printf(b, "tandem:expert_tokens_total{model_name=\"%s\",expert=\"%d\"} %llu\n",
                      m->label, i, (unsigned long long)m->expert_tokens[i]);
        gauge(b, m, "tandem:expert_load_imbalance",
              "Max over mean of the tokens per expert in the last routed step (1 is even).",
              m->expert_imbalance);
    }
}

td_status td_metrics_render(td_metrics *m, const td_metrics_gauges *g, char **text_p,
                            size_t *len_p) {
    if (!m || !text_p) return TD_ERR_INVALID;
    td_sbuf b = {.buf = malloc(16384), .cap = 16384};
    if (!b.buf) return TD_ERR_NOMEM;
    b.buf[0] = '\0';

    if (g) render_gauges(&b, m, g);

    pthread_mutex_lock(&m->mu);
    counter(&b, m, "vllm:prompt_tokens", "Number of prefill tokens processed.", m->prompt_tokens);
    counter(&b, m, "vllm:generation_tokens", "Number of generation tokens processed.",
            m->generation_tokens);
    family(&b, "vllm:request_success_total", "counter",
           "Count of successfully processed requests.");
    for (int r = TD_FINISH_STOP; r < TD_FINISH_COUNT; r++)
        sb_printf(&b, "vllm:request_success_total{model_name=\"%s\",finished_reason=\"%s\"} %llu\n",
                  m->label, td_finish_reason_str((td_finish_reason)r),
                  (unsigned long long)m->success[r]);
    counter(&b, m, "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.", m->prefix_queries);
    counter(&b, m, "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.", m->prefix_hits);
    counter(&b, m, "vllm:num_preemptions", "Cumulative number of preemptions from the engine.",
            m->preemptions);
    if (g)
        counter(&b, m, "tandem:kv_evictions", "Cached KV blocks evicted to make room.",
                g->kv_evictions);
    family(&b, "tandem:request_errors_total", "counter",
           "Requests rejected or failed, by HTTP status and OpenAI error type.");
    for (int i = 0; i < m->n_errs; i++) {
        char *t = escape_label(m->errs[i].type);
        if (!t) {
            b.oom = true;
            break;
        }
        sb_printf(&b,
                  "tandem:request_errors_total{model_name=\"%s\",code=\"%d\",type=\"%s\"} %llu\n",
                  m->label, m->errs[i].status, t, (unsigned long long)m->errs[i].n);
        free(t);
    }
    for (int i = 0; i < H_COUNT; i++) histogram(&b, m, &m->hist[i]);
    render_plan(&b, m);
    if (g && g->disagg) render_xfer(&b, m);
    pthread_mutex_unlock(&m->mu);

    if (b.oom) {
        free(b.buf);
        TD_LOG_ERROR("out of memory rendering metrics");
        return TD_ERR_NOMEM;
    }
    *text_p = b.buf;
    if (len_p) *len_p = b.len;
    return TD_OK;
}

void td_obs_log_request(const td_request_record *r) {
    if (!r) return;
    double queue_ms = r->t_scheduled > 0 ? (r->t_scheduled - r->t_arrival) * 1e3 : -1;
    double ttft_ms = r->t_first_token > 0 ? (r->t_first_token - r->t_arrival) * 1e3 : -1;
    const char *fin = td_finish_reason_str(r->finish);
    td_log(TD_LOG_INFO, "request",
           "id=%s prompt_tokens=%d cached_tokens=%d output_tokens=%d queue_ms=%.3f ttft_ms=%.3f "
           "e2e_ms=%.3f finish=%s preemptions=%d prefill_compute_ms=%.3f",
           r->id ? r->id : "-", (int)r->n_prompt_tokens, (int)r->n_cached_tokens,
           (int)r->n_output_tokens, queue_ms, ttft_ms, (r->t_finished - r->t_arrival) * 1e3,
           fin ? fin : "none", (int)r->n_preemptions, r->prefill_compute_s * 1e3);
}
