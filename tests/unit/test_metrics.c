/* Metrics tests: record known observations and compare the rendered
 * Prometheus text line by line with values worked out by hand here (bucket
 * boundaries typed independently of metrics.c, cumulative counts and sums
 * computed in the comments next to each expectation). */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/obs/metrics.h"

/* The bucket boundaries the contract promises: 1 ms .. 320 s, and powers of
 * two from 1 to 131072 tokens. */
static const char *const LAT_LE[] = {
    "0.001", "0.002", "0.005", "0.01", "0.015", "0.02", "0.025", "0.03", "0.04", "0.05",
    "0.075", "0.1",   "0.15",  "0.2",  "0.3",   "0.4",  "0.5",   "0.75", "1",    "1.5",
    "2",     "2.5",   "5",     "7.5",  "10",    "20",   "40",    "80",   "160",  "320"};
#define N_LAT 30
static const char *const TOK_LE[] = {"1",    "2",    "4",     "8",     "16",    "32",
                                     "64",   "128",  "256",   "512",   "1024",  "2048",
                                     "4096", "8192", "16384", "32768", "65536", "131072"};
#define N_TOK 18

/* model name with every character the text format must escape:
 * m"o\d<newline>el  ->  m\"o\\d\nel */
#define RAW_NAME "m\"o\\d\nel"
#define LBL      "model_name=\"m\\\"o\\\\d\\nel\""

typedef struct {
    char **lines;
    int n;
    char *text;
} lines_t;

static lines_t split(char *text, size_t len) {
    lines_t l = {NULL, 0, text};
    assert_true(len > 0);
    assert_int_equal(text[len - 1], '\n'); /* the format ends every line with \n */
    assert_int_equal(strlen(text), len);
    l.lines = calloc(len + 1, sizeof *l.lines);
    assert_non_null(l.lines);
    char *p = text;
    while (*p) {
        char *nl = strchr(p, '\n');
        assert_non_null(nl);
        *nl = '\0';
        l.lines[l.n++] = p;
        p = nl + 1;
    }
    return l;
}

static int find_line(const lines_t *l, const char *want) {
    for (int i = 0; i < l->n; i++)
        if (strcmp(l->lines[i], want) == 0) return i;
    return -1;
}

static int expect_line(const lines_t *l, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static int expect_line(const lines_t *l, const char *fmt, ...) {
    char want[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(want, sizeof want, fmt, ap);
    va_end(ap);
    int i = find_line(l, want);
    if (i < 0) fail_msg("missing line: %s", want);
    return i;
}

static int count_prefix(const lines_t *l, const char *prefix) {
    int n = 0;
    for (int i = 0; i < l->n; i++) n += strncmp(l->lines[i], prefix, strlen(prefix)) == 0;
    return n;
}

/* # HELP then # TYPE for `name`, exactly once, the TYPE right after the HELP. */
static int expect_family(const lines_t *l, const char *name, const char *type) {
    char help[256], want_type[256];
    snprintf(help, sizeof help, "# HELP %s ", name);
    snprintf(want_type, sizeof want_type, "# TYPE %s %s", name, type);
    assert_int_equal(count_prefix(l, help), 1);
    int t = expect_line(l, "%s", want_type);
    assert_true(t > 0);
    assert_int_equal(strncmp(l->lines[t - 1], help, strlen(help)), 0);
    return t;
}

/* The full histogram block: bucket lines in order right after the TYPE line,
 * then +Inf, _sum, _count. cum[] is the expected cumulative count per le. */
static void expect_hist(const lines_t *l, const char *name, bool tokens, const uint64_t *cum,
                        uint64_t count, double sum) {
    int t = expect_family(l, name, "histogram");
    int n = tokens ? N_TOK : N_LAT;
    const char *const *le = tokens ? TOK_LE : LAT_LE;
    char want[512];
    for (int i = 0; i < n; i++) {
        snprintf(want, sizeof want, "%s_bucket{" LBL ",le=\"%s\"} %llu", name, le[i],
                 (unsigned long long)cum[i]);
        assert_true(t + 1 + i < l->n);
        if (strcmp(l->lines[t + 1 + i], want) != 0)
            fail_msg("%s bucket %d: got '%s', want '%s'", name, i, l->lines[t + 1 + i], want);
    }
    snprintf(want, sizeof want, "%s_bucket{" LBL ",le=\"+Inf\"} %llu", name,
             (unsigned long long)count);
    assert_string_equal(l->lines[t + 1 + n], want);
    char prefix[256];
    snprintf(prefix, sizeof prefix, "%s_sum{" LBL "} ", name);
    const char *s = l->lines[t + 2 + n];
    if (strncmp(s, prefix, strlen(prefix)) != 0) fail_msg("%s: want _sum, got '%s'", name, s);
    char *end;
    double got = strtod(s + strlen(prefix), &end);
    assert_int_equal(*end, '\0');
    /* Sums of a few doubles: the order of additions may differ from ours by
     * a few ulps of the largest term. */
    if (fabs(got - sum) > 1e-12 * fmax(1.0, fabs(sum)))
        fail_msg("%s_sum = %.17g, want %.17g", name, got, sum);
    snprintf(want, sizeof want, "%s_count{" LBL "} %llu", name, (unsigned long long)count);
    assert_string_equal(l->lines[t + 3 + n], want);
}

/* cum[i] = number of values v with v <= le[i] (le inclusive), from a list. */
static void cum_from(const double *v, int nv, bool tokens, uint64_t *cum) {
    static const double lat[N_LAT] = {0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03,
                                      0.04,  0.05,  0.075, 0.1,  0.15,  0.2,  0.3,   0.4,
                                      0.5,   0.75,  1,     1.5,  2,     2.5,  5,     7.5,
                                      10,    20,    40,    80,   160,   320};
    int n = tokens ? N_TOK : N_LAT;
    for (int i = 0; i < n; i++) {
        double le = tokens ? (double)(1 << i) : lat[i];
        cum[i] = 0;
        for (int j = 0; j < nv; j++) cum[i] += v[j] <= le;
    }
}

static char *render(td_metrics *m, const td_metrics_gauges *g, size_t *len) {
    char *text = NULL;
    assert_int_equal(td_metrics_render(m, g, &text, len), TD_OK);
    assert_non_null(text);
    return text;
}

static void test_finish_reason_str(void **state) {
    (void)state;
    assert_null(td_finish_reason_str(TD_FINISH_NONE));
    assert_string_equal(td_finish_reason_str(TD_FINISH_STOP), "stop");
    assert_string_equal(td_finish_reason_str(TD_FINISH_LENGTH), "length");
    assert_string_equal(td_finish_reason_str(TD_FINISH_ABORT), "abort");
    assert_string_equal(td_finish_reason_str(TD_FINISH_ERROR), "error");
}

static void test_empty_render(void **state) {
    (void)state;
    td_metrics *m = NULL;
    assert_int_equal(td_metrics_create(RAW_NAME, &m), TD_OK);
    size_t len;
    char *text = render(m, NULL, &len);
    lines_t l = split(text, len);
    /* No gauges without a snapshot. */
    assert_int_equal(count_prefix(&l, "# TYPE vllm:num_requests_running"), 0);
    assert_int_equal(count_prefix(&l, "tandem:kv_blocks"), 0);
    expect_family(&l, "vllm:prompt_tokens_total", "counter");
    expect_line(&l, "vllm:prompt_tokens_total{" LBL "} 0");
    expect_line(&l, "vllm:generation_tokens_total{" LBL "} 0");
    expect_line(&l, "vllm:request_success_total{" LBL ",finished_reason=\"stop\"} 0");
    expect_family(&l, "tandem:request_errors_total", "counter");
    assert_int_equal(count_prefix(&l, "tandem:request_errors_total{"), 0);
    uint64_t zero[N_LAT] = {0};
    expect_hist(&l, "vllm:time_to_first_token_seconds", false, zero, 0, 0);
    expect_hist(&l, "vllm:iteration_tokens_total", true, zero, 0, 0);
    free(l.lines);
    free(text);
    td_metrics_destroy(m);
    td_metrics_destroy(NULL);
}

static void test_full_render(void **state) {
    (void)state;
    td_metrics *m = NULL;
    assert_int_equal(td_metrics_create(RAW_NAME, &m), TD_OK);

    /* TTFT: 0.0005, 0.001 (on a boundary: le is inclusive), 0.003, 0.5, 400
     * (above 320: only +Inf), NaN (dropped), -1 (clock skew: counts as 0). */
    const double ttft_in[] = {0.0005, 0.001, 0.003, 0.5, 400, NAN, -1};
    for (size_t i = 0; i < 7; i++) td_metrics_first_token(m, ttft_in[i], 0.25);
    const double ttft_v[] = {0.0005, 0.001, 0.003, 0.5, 400, 0};
    /* ITL: dyadic values so the sum is exact: 0.25 + 0.5 + 2 = 2.75. */
    td_metrics_inter_token(m, 0.25);
    td_metrics_inter_token(m, 0.5);
    td_metrics_inter_token(m, 2);
    td_metrics_prefix_cache(m, 100, 48);
    td_metrics_prefix_cache(m, 28, 0);
    td_metrics_prefix_cache(m, -5, 3); /* nonsense: ignored */
    td_metrics_preemption(m);
    td_metrics_preemption(m);
    /* Iteration sizes 1, 16, 17, 200000 (above 131072: only +Inf). */
    td_metrics_iteration(m, 1);
    td_metrics_iteration(m, 16);
    td_metrics_iteration(m, 17);
    td_metrics_iteration(m, 200000);
    td_metrics_iteration(m, -3); /* ignored */

    /* A: stop; queue .5, prefill .5, decode 2, inference 2.5, e2e 3.
     * B: aborted while waiting: e2e .25 only.
     * C: error after one token; inference .25, prefill .25, decode 0, e2e .5. */
    td_request_record a = {.id = "cmpl-a",
                           .n_prompt_tokens = 10,
                           .n_cached_tokens = 0,
                           .n_output_tokens = 5,
                           .finish = TD_FINISH_STOP,
                           .t_arrival = 100,
                           .t_scheduled = 100.5,
                           .t_first_token = 101,
                           .t_finished = 103};
    td_request_record b = {.id = "cmpl-b",
                           .n_prompt_tokens = 300,
                           .n_output_tokens = 0,
                           .finish = TD_FINISH_ABORT,
                           .t_arrival = 200,
                           .t_finished = 200.25};
    td_request_record c = {.id = "cmpl-c",
                           .n_prompt_tokens = 1,
                           .n_output_tokens = 1,
                           .finish = TD_FINISH_ERROR,
                           .t_arrival = 50,
                           .t_scheduled = 50.25,
                           .t_first_token = 50.5,
                           .t_finished = 50.5};
    td_metrics_request_finished(m, &a);
    td_metrics_request_finished(m, &b);
    td_metrics_request_finished(m, &c);

    td_metrics_request_error(m, 400, "invalid_request_error");
    td_metrics_request_error(m, 400, "invalid_request_error");
    td_metrics_request_error(m, 429, "rate_limit_exceeded");
    td_metrics_request_error(m, 401, NULL);
    td_metrics_request_error(m, 500, "a\"b");
    char longtype[101];
    memset(longtype, 'y', 100);
    longtype[100] = '\0';
    td_metrics_request_error(m, 418, longtype); /* cut to 63 bytes */

    td_metrics_gauges g = {.running = 3,
                           .waiting = 2,
                           .queued_prefill_tokens = 64,
                           .kv_total = 100,
                           .kv_empty = 50,
                           .kv_cached = 10,
                           .kv_used = 25,
                           .kv_reserved = 15,
                           .kv_fragmentation = 0.125,
                           .kv_evictions = 7,
                           .draining = true};
    size_t len;
    char *text = render(m, &g, &len);
    lines_t l = split(text, len);

    /* Every line is a comment or a sample carrying the escaped model name. */
    for (int i = 0; i < l.n; i++) {
        if (l.lines[i][0] == '#') {
            assert_true(strncmp(l.lines[i], "# HELP ", 7) == 0 ||
                        strncmp(l.lines[i], "# TYPE ", 7) == 0);
            continue;
        }
        if (!strstr(l.lines[i], "{" LBL)) fail_msg("sample without the label: %s", l.lines[i]);
    }

    expect_family(&l, "vllm:num_requests_running", "gauge");
    expect_line(&l, "vllm:num_requests_running{" LBL "} 3");
    expect_line(&l, "vllm:num_requests_waiting{" LBL "} 2");
    expect_family(&l, "vllm:kv_cache_usage_perc", "gauge");
    expect_line(&l, "vllm:kv_cache_usage_perc{" LBL "} 0.25"); /* 25 used / 100 */
    expect_family(&l, "tandem:kv_blocks", "gauge");
    expect_line(&l, "tandem:kv_blocks{" LBL ",state=\"empty\"} 50");
    expect_line(&l, "tandem:kv_blocks{" LBL ",state=\"cached\"} 10");
    expect_line(&l, "tandem:kv_blocks{" LBL ",state=\"used\"} 25");
    expect_line(&l, "tandem:kv_blocks{" LBL ",state=\"reserved\"} 15");
    expect_line(&l, "tandem:kv_blocks{" LBL ",state=\"total\"} 100");
    expect_line(&l, "tandem:kv_fragmentation{" LBL "} 0.125");
    expect_line(&l, "tandem:queued_prefill_tokens{" LBL "} 64");
    expect_family(&l, "tandem:draining", "gauge");
    expect_line(&l, "tandem:draining{" LBL "} 1");

    expect_family(&l, "vllm:prompt_tokens_total", "counter");
    expect_line(&l, "vllm:prompt_tokens_total{" LBL "} 311"); /* 10 + 300 + 1 */
    expect_family(&l, "vllm:generation_tokens_total", "counter");
    expect_line(&l, "vllm:generation_tokens_total{" LBL "} 6"); /* 5 + 0 + 1 */
    expect_family(&l, "vllm:request_success_total", "counter");
    expect_line(&l, "vllm:request_success_total{" LBL ",finished_reason=\"stop\"} 1");
    expect_line(&l, "vllm:request_success_total{" LBL ",finished_reason=\"length\"} 0");
    expect_line(&l, "vllm:request_success_total{" LBL ",finished_reason=\"abort\"} 1");
    expect_line(&l, "vllm:request_success_total{" LBL ",finished_reason=\"error\"} 1");
    expect_line(&l, "vllm:prefix_cache_queries_total{" LBL "} 128");
    expect_line(&l, "vllm:prefix_cache_hits_total{" LBL "} 48");
    expect_family(&l, "vllm:num_preemptions_total", "counter");
    expect_line(&l, "vllm:num_preemptions_total{" LBL "} 2");
    expect_family(&l, "tandem:kv_evictions_total", "counter");
    expect_line(&l, "tandem:kv_evictions_total{" LBL "} 7");
    expect_family(&l, "tandem:request_errors_total", "counter");
    expect_line(&l, "tandem:request_errors_total{" LBL
                    ",code=\"400\",type=\"invalid_request_error\"} 2");
    expect_line(&l,
                "tandem:request_errors_total{" LBL ",code=\"429\",type=\"rate_limit_exceeded\"} 1");
    expect_line(&l, "tandem:request_errors_total{" LBL ",code=\"401\",type=\"unknown\"} 1");
    expect_line(&l, "tandem:request_errors_total{" LBL ",code=\"500\",type=\"a\\\"b\"} 1");
    char want63[128];
    snprintf(want63, sizeof want63, "%.63s\"} 1", longtype);
    expect_line(&l, "tandem:request_errors_total{" LBL ",code=\"418\",type=\"%s", want63);
    assert_int_equal(count_prefix(&l, "tandem:request_errors_total{"), 5);

    uint64_t cum[N_LAT];
    cum_from(ttft_v, 6, false, cum);
    /* By hand: le=0.001 holds 0.0005, 0.001, 0 -> 3; 0.005 adds 0.003 -> 4;
     * 0.5 adds 0.5 -> 5; nothing else below 320. */
    assert_int_equal(cum[0], 3);
    assert_int_equal(cum[2], 4);
    assert_int_equal(cum[15], 4);
    assert_int_equal(cum[16], 5);
    assert_int_equal(cum[N_LAT - 1], 5);
    expect_hist(&l, "vllm:time_to_first_token_seconds", false, cum, 6,
                0.0005 + 0.001 + 0.003 + 0.5 + 400);
    /* Queue time was given with every first token that had a finite TTFT... and
     * with the dropped NaN one too: 7 observations of 0.25. */
    const double q7[] = {0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25};
    cum_from(q7, 7, false, cum);
    expect_hist(&l, "vllm:request_queue_time_seconds", false, cum, 7, 1.75);

    const double itl[] = {0.25, 0.5, 2};
    cum_from(itl, 3, false, cum);
    expect_hist(&l, "vllm:inter_token_latency_seconds", false, cum, 3, 2.75);
    expect_line(&l, "vllm:inter_token_latency_seconds_sum{" LBL "} 2.75");

    const double e2e[] = {3, 0.25, 0.5};
    cum_from(e2e, 3, false, cum);
    expect_hist(&l, "vllm:e2e_request_latency_seconds", false, cum, 3, 3.75);
    const double inf[] = {2.5, 0.25};
    cum_from(inf, 2, false, cum);
    expect_hist(&l, "vllm:request_inference_time_seconds", false, cum, 2, 2.75);
    const double pre[] = {0.5, 0.25};
    cum_from(pre, 2, false, cum);
    expect_hist(&l, "vllm:request_prefill_time_seconds", false, cum, 2, 0.75);
    const double dec[] = {2, 0};
    cum_from(dec, 2, false, cum);
    expect_hist(&l, "vllm:request_decode_time_seconds", false, cum, 2, 2);

    uint64_t tcum[N_TOK];
    const double pt[] = {10, 300, 1};
    cum_from(pt, 3, true, tcum);
    /* le=1: {1}; le=16: {1,10}; le=512: all three. */
    assert_int_equal(tcum[0], 1);
    assert_int_equal(tcum[4], 2);
    assert_int_equal(tcum[8], 2);
    assert_int_equal(tcum[9], 3);
    expect_hist(&l, "vllm:request_prompt_tokens", true, tcum, 3, 311);
    const double gt[] = {5, 0, 1};
    cum_from(gt, 3, true, tcum);
    expect_hist(&l, "vllm:request_generation_tokens", true, tcum, 3, 6);
    const double it[] = {1, 16, 17, 200000};
    cum_from(it, 4, true, tcum);
    assert_int_equal(tcum[N_TOK - 1], 3);
    expect_hist(&l, "vllm:iteration_tokens_total", true, tcum, 4, 200034);
    expect_line(&l, "vllm:iteration_tokens_total_sum{" LBL "} 200034");
    expect_line(&l, "vllm:iteration_tokens_total_bucket{" LBL ",le=\"16\"} 2");
    expect_line(&l, "vllm:iteration_tokens_total_bucket{" LBL ",le=\"32\"} 3");

    free(l.lines);
    free(text);
    td_metrics_destroy(m);
}

static void test_error_kinds_bounded(void **state) {
    (void)state;
    td_metrics *m = NULL;
    assert_int_equal(td_metrics_create("x", &m), TD_OK);
    /* 70 distinct types, twice each: the first 63 keep their own line, the
     * other 7 (14 events) fold into code="0",type="other". */
    for (int rep = 0; rep < 2; rep++)
        for (int i = 0; i < 70; i++) {
            char t[32];
            snprintf(t, sizeof t, "t%d", i);
            td_metrics_request_error(m, 400, t);
        }
    size_t len;
    char *text = render(m, NULL, &len);
    lines_t l = split(text, len);
    assert_int_equal(count_prefix(&l, "tandem:request_errors_total{"), 64);
    expect_line(&l, "tandem:request_errors_total{model_name=\"x\",code=\"400\",type=\"t0\"} 2");
    expect_line(&l, "tandem:request_errors_total{model_name=\"x\",code=\"400\",type=\"t62\"} 2");
    assert_int_equal(
        find_line(&l, "tandem:request_errors_total{model_name=\"x\",code=\"400\",type=\"t63\"} 2"),
        -1);
    expect_line(&l, "tandem:request_errors_total{model_name=\"x\",code=\"0\",type=\"other\"} 14");
    free(l.lines);
    free(text);
    td_metrics_destroy(m);
}

#define N_THREADS 4
#define N_PER     20000

static void *hammer(void *arg) {
    td_metrics *m = arg;
    for (int i = 0; i < N_PER; i++) {
        td_metrics_inter_token(m, 0.5);
        td_metrics_iteration(m, 3);
        td_metrics_request_error(m, 503, "unavailable");
        if (i % 1000 == 0) {
            char *t = NULL;
            if (td_metrics_render(m, NULL, &t, NULL) == TD_OK) free(t);
        }
    }
    return NULL;
}

static void test_concurrent_updates(void **state) {
    (void)state;
    td_metrics *m = NULL;
    assert_int_equal(td_metrics_create("x", &m), TD_OK);
    pthread_t th[N_THREADS];
    for (int i = 0; i < N_THREADS; i++)
        assert_int_equal(pthread_create(&th[i], NULL, hammer, m), 0);
    for (int i = 0; i < N_THREADS; i++) pthread_join(th[i], NULL);
    size_t len;
    char *text = render(m, NULL, &len);
    lines_t l = split(text, len);
    /* 80000 observations of 0.5 s: all at le=0.5 and above, sum 40000 exactly
     * (0.5 multiples are exact in double). */
    expect_line(&l, "vllm:inter_token_latency_seconds_bucket{model_name=\"x\",le=\"0.4\"} 0");
    expect_line(&l, "vllm:inter_token_latency_seconds_bucket{model_name=\"x\",le=\"0.5\"} 80000");
    expect_line(&l, "vllm:inter_token_latency_seconds_sum{model_name=\"x\"} 40000");
    expect_line(&l, "vllm:inter_token_latency_seconds_count{model_name=\"x\"} 80000");
    expect_line(&l, "vllm:iteration_tokens_total_bucket{model_name=\"x\",le=\"2\"} 0");
    expect_line(&l, "vllm:iteration_tokens_total_bucket{model_name=\"x\",le=\"4\"} 80000");
    expect_line(&l, "vllm:iteration_tokens_total_sum{model_name=\"x\"} 240000");
    expect_line(
        &l,
        "tandem:request_errors_total{model_name=\"x\",code=\"503\",type=\"unavailable\"} 80000");
    free(l.lines);
    free(text);
    td_metrics_destroy(m);
}

static void test_bad_args(void **state) {
    (void)state;
    td_metrics *m = NULL;
    assert_int_equal(td_metrics_create(NULL, &m), TD_ERR_INVALID);
    assert_null(m);
    assert_int_equal(td_metrics_create("x", NULL), TD_ERR_INVALID);
    char *t = NULL;
    assert_int_equal(td_metrics_render(NULL, NULL, &t, NULL), TD_ERR_INVALID);
    assert_null(t);
    /* NULL handles are no-ops, not crashes. */
    td_metrics_first_token(NULL, 1, 1);
    td_metrics_inter_token(NULL, 1);
    td_metrics_prefix_cache(NULL, 1, 1);
    td_metrics_preemption(NULL);
    td_metrics_iteration(NULL, 1);
    td_metrics_request_finished(NULL, NULL);
    td_metrics_request_error(NULL, 400, "x");
    td_obs_log_request(NULL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_finish_reason_str),  cmocka_unit_test(test_empty_render),
        cmocka_unit_test(test_full_render),        cmocka_unit_test(test_error_kinds_bounded),
        cmocka_unit_test(test_concurrent_updates), cmocka_unit_test(test_bad_args),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
