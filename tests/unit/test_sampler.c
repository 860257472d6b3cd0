/* Sampler and stop-string matcher tests. Every expected value is computed
 * here from the definitions (softmax in double, hand-worked penalties, a
 * non-streaming strstr reference for stop strings), never taken from the
 * sampler's own output. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/sched/sampler.h"
#include "common/sched/stop.h"

/* Probabilities come from float logits through exp in double; 1e-6 absolute
 * covers float rounding of the logits and of the stored probabilities. */
#define PROB_TOL 1e-6

static td_sampler *make(td_sampler_params p, int32_t n_vocab) {
    td_sampler *s = NULL;
    assert_int_equal(td_sampler_create(&p, n_vocab, &s), TD_OK);
    assert_non_null(s);
    return s;
}

/* Reference softmax of l[i] / t over the tokens with keep[i], in double. */
static void ref_softmax(const double *l, const int *keep, int n, double t, double *out) {
    double m = -INFINITY, z = 0;
    for (int i = 0; i < n; i++)
        if (keep[i] && l[i] / t > m) m = l[i] / t;
    for (int i = 0; i < n; i++) z += keep[i] ? exp(l[i] / t - m) : 0;
    for (int i = 0; i < n; i++) out[i] = keep[i] ? exp(l[i] / t - m) / z : 0;
}

static void expect_probs(td_sampler *s, const float *logits, const double *want, int n) {
    float got[64];
    assert_true(n <= 64);
    assert_int_equal(td_sampler_probs(s, logits, got), TD_OK);
    for (int i = 0; i < n; i++) {
        if (fabs(got[i] - want[i]) > PROB_TOL)
            fail_msg("token %d: probability %.9f, expected %.9f", i, got[i], want[i]);
    }
}

static void test_greedy_argmax_and_ties(void **state) {
    (void)state;
    td_sampler *s = make(td_sampler_default_params(), 6);
    float l1[6] = {0.1f, 2.0f, -1.0f, 2.5f, 2.4f, 0.0f};
    td_sample_result r;
    assert_int_equal(td_sampler_sample(s, l1, &r), TD_OK);
    assert_int_equal(r.token, 3);
    /* Ties break toward the lowest id. */
    float l2[6] = {1.0f, 3.0f, 3.0f, -2.0f, 3.0f, 0.0f};
    assert_int_equal(td_sampler_sample(s, l2, &r), TD_OK);
    assert_int_equal(r.token, 1);
    /* NaN counts as -inf, never as the maximum. */
    float l3[6] = {NAN, 1.0f, NAN, 0.5f, 1.5f, NAN};
    assert_int_equal(td_sampler_sample(s, l3, &r), TD_OK);
    assert_int_equal(r.token, 4);
    /* No finite logit at all is an error, not a crash. */
    float l4[6] = {NAN, NAN, -INFINITY, NAN, -INFINITY, NAN};
    assert_int_equal(td_sampler_sample(s, l4, &r), TD_ERR_RANGE);
    td_sampler_destroy(s);
}

static void test_temperature_exact(void **state) {
    (void)state;
    const double l[5] = {1.0, 2.0, 3.0, 0.0, -1.5};
    float lf[5];
    for (int i = 0; i < 5; i++) lf[i] = (float)l[i];
    const int all[5] = {1, 1, 1, 1, 1};
    const double temps[3] = {0.5, 1.0, 1.7};
    for (int t = 0; t < 3; t++) {
        td_sampler_params p = td_sampler_default_params();
        p.temperature = (float)temps[t];
        td_sampler *s = make(p, 5);
        double want[5];
        ref_softmax(l, all, 5, temps[t], want);
        expect_probs(s, lf, want, 5);
        td_sampler_destroy(s);
    }
}

/* Logits log(p) give exactly (up to float rounding) the probabilities p. */
static const double k_p4[4] = {0.15, 0.5, 0.05, 0.3};

static void logits_from_probs(const double *p, int n, float *l, double *ld) {
    for (int i = 0; i < n; i++) {
        ld[i] = log(p[i]);
        l[i] = (float)ld[i];
    }
}

static void test_top_k(void **state) {
    (void)state;
    float l[4];
    double ld[4];
    logits_from_probs(k_p4, 4, l, ld);
    td_sampler_params p = td_sampler_default_params();
    p.temperature = 1.0f;
    p.top_k = 2;
    td_sampler *s = make(p, 4);
    /* Keeps 0.5 and 0.3, renormalised to 0.625 and 0.375. */
    const double want[4] = {0, 0.625, 0, 0.375};
    expect_probs(s, l, want, 4);
    td_sampler_destroy(s);

    p.top_k = 10; /* larger than the vocabulary: no-op */
    s = make(p, 4);
    expect_probs(s, l, k_p4, 4);
    td_sampler_destroy(s);
}

static void test_top_p(void **state) {
    (void)state;
    float l[4];
    double ld[4];
    logits_from_probs(k_p4, 4, l, ld);
    td_sampler_params p = td_sampler_default_params();
    p.temperature = 1.0f;

    /* Sorted: 0.5, 0.3, 0.15, 0.05. p = 0.7 needs the first two (0.8). */
    p.top_p = 0.7f;
    td_sampler *s = make(p, 4);
    const double want2[4] = {0, 0.625, 0, 0.375};
    expect_probs(s, l, want2, 4);
    td_sampler_destroy(s);

    /* p = 0.4: the top token alone reaches it. */
    p.top_p = 0.4f;
    s = make(p, 4);
    const double want1[4] = {0, 1, 0, 0};
    expect_probs(s, l, want1, 4);
    td_sampler_destroy(s);

    /* p = 0.9 needs three: 0.5 + 0.3 + 0.15 = 0.95. */
    p.top_p = 0.9f;
    s = make(p, 4);
    const double want3[4] = {0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95};
    expect_probs(s, l, want3, 4);
    td_sampler_destroy(s);
}

static void test_min_p(void **state) {
    (void)state;
    float l[4];
    double ld[4];
    logits_from_probs(k_p4, 4, l, ld);
    td_sampler_params p = td_sampler_default_params();
    p.temperature = 1.0f;
    p.min_p = 0.2f; /* threshold 0.2 * 0.5 = 0.1: drops only 0.05 */
    td_sampler *s = make(p, 4);
    const double want[4] = {0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95};
    expect_probs(s, l, want, 4);
    td_sampler_destroy(s);

    p.min_p = 0.5f; /* threshold 0.25: keeps 0.5 and 0.3 */
    s = make(p, 4);
    const double want2[4] = {0, 0.625, 0, 0.375};
    expect_probs(s, l, want2, 4);
    td_sampler_destroy(s);
}

/* Order: temperature before top-k/top-p/min-p. With T = 2 the probabilities
 * flatten to sqrt(p) normalised, which changes what top-p keeps. */
static void test_order_temperature_then_truncation(void **state) {
    (void)state;
    float l[4];
    double ld[4];
    logits_from_probs(k_p4, 4, l, ld);
    td_sampler_params p = td_sampler_default_params();
    p.temperature = 2.0f;
    p.top_p = 0.7f;
    td_sampler *s = make(p, 4);
    /* sqrt probabilities, sorted: 0.707, 0.548, 0.387, 0.224; total 1.866;
     * normalised 0.379, 0.293, 0.208, 0.120: 0.379 + 0.293 = 0.672 < 0.7,
     * + 0.208 = 0.880 >= 0.7: three kept. */
    const int keep[4] = {1, 1, 0, 1};
    double want[4];
    ref_softmax(ld, keep, 4, 2.0, want);
    expect_probs(s, l, want, 4);
    td_sampler_destroy(s);

    /* top-k then top-p on the renormalised top-k mass: top_k = 3 keeps
     * 0.5, 0.3, 0.15 (renormalised 0.526, 0.316, 0.158); top_p = 0.8 then
     * needs 0.526 + 0.316 = 0.842: two kept. */
    p.temperature = 1.0f;
    p.top_k = 3;
    p.top_p = 0.8f;
    s = make(p, 4);
    const double want2[4] = {0, 0.625, 0, 0.375};
    expect_probs(s, l, want2, 4);
    td_sampler_destroy(s);
}

/* A large vocabulary, where the sampler finds the top-p cut by partitioning
 * rather than sorting; the reference sorts everything with qsort. */
static const double *g_sort_keys;
static int cmp_desc(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    if (g_sort_keys[x] != g_sort_keys[y]) return g_sort_keys[x] > g_sort_keys[y] ? -1 : 1;
    return x - y;
}

static void test_large_vocab_top_k_top_p_min_p(void **state) {
    (void)state;
    enum { V = 20000 };
    float *l = malloc(V * sizeof *l);
    double *ld = malloc(V * sizeof *ld), *want = malloc(V * sizeof *want);
    float *got = malloc(V * sizeof *got);
    int *idx = malloc(V * sizeof *idx), *keep = malloc(V * sizeof *keep);
    assert_true(l && ld && want && got && idx && keep);
    uint32_t x = 12345;
    for (int i = 0; i < V; i++) {
        x = x * 1664525u + 1013904223u;
        l[i] = (float)((x >> 8) % 10000) / 2500.0f; /* flat-ish: 0..4 */
        ld[i] = l[i];
    }
    const struct {
        float t, p, minp;
        int k;
    } cases[] = {{0.9f, 0.9f, 0.0f, 0},
                 {1.3f, 0.5f, 0.0f, 500},
                 {1.0f, 1.0f, 0.05f, 0},
                 {0.7f, 0.95f, 0.3f, 2000}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        double t = cases[c].t;
        for (int i = 0; i < V; i++) {
            idx[i] = i;
            ld[i] = (double)(l[i] / cases[c].t); /* the same float division */
        }
        g_sort_keys = ld;
        qsort(idx, V, sizeof *idx, cmp_desc);
        int n = cases[c].k > 0 ? cases[c].k : V;
        double m = ld[idx[0]], z = 0, cum = 0;
        for (int i = 0; i < n; i++) z += exp(ld[idx[i]] - m);
        if (cases[c].p < 1.0f) {
            for (int i = 0; i < n; i++) {
                cum += exp(ld[idx[i]] - m) / z;
                if (cum >= cases[c].p) {
                    n = i + 1;
                    break;
                }
            }
        }
        memset(keep, 0, V * sizeof *keep);
        for (int i = 0; i < n; i++) keep[idx[i]] = exp(ld[idx[i]] - m) >= cases[c].minp ? 1 : 0;
        ref_softmax(ld, keep, V, 1.0, want);
        (void)t;

        td_sampler_params p = td_sampler_default_params();
        p.temperature = cases[c].t;
        p.top_p = cases[c].p;
        p.top_k = cases[c].k;
        p.min_p = cases[c].minp;
        td_sampler *s = make(p, V);
        assert_int_equal(td_sampler_probs(s, l, got), TD_OK);
        int n_kept = 0, n_want = 0;
        for (int i = 0; i < V; i++) {
            n_kept += got[i] > 0;
            n_want += keep[i];
            if (fabs(got[i] - want[i]) > PROB_TOL)
                fail_msg("case %zu token %d: %.9g vs %.9g", c, i, got[i], want[i]);
        }
        assert_int_equal(n_kept, n_want);
        assert_true(n_kept >
                    64); /* the cut went through the partitioning, not only the small-range sort */
        td_sampler_destroy(s);
    }
    free(l);
    free(ld);
    free(want);
    free(got);
    free(idx);
    free(keep);
}

static void test_penalties_hand_computed(void **state) {
    (void)state;
    const float l[5] = {2.0f, -1.0f, 0.5f, 3.0f, 1.0f};
    td_sampler_params p = td_sampler_default_params();
    p.temperature = 1.0f;
    p.repetition_penalty = 2.0f;
    p.frequency_penalty = 0.5f;
    p.presence_penalty = 0.25f;
    td_sampler *s = make(p, 5);
    const int32_t prompt[2] = {0, 1};
    assert_int_equal(td_sampler_accept_prompt(s, prompt, 2), TD_OK);
    assert_int_equal(td_sampler_accept(s, 1), TD_OK);
    assert_int_equal(td_sampler_accept(s, 1), TD_OK);
    assert_int_equal(td_sampler_accept(s, 2), TD_OK);
    /* token 0: prompt only        2.0 / 2                      = 1.0
     * token 1: prompt + 2x gen   -1.0 * 2 - 0.5 * 2 - 0.25     = -3.25
     * token 2: 1x gen             0.5 / 2 - 0.5 * 1 - 0.25     = -0.5
     * token 3: unseen                                            3.0
     * token 4: unseen                                            1.0 */
    const double pen[5] = {1.0, -3.25, -0.5, 3.0, 1.0};
    const int all[5] = {1, 1, 1, 1, 1};
    double want[5];
    ref_softmax(pen, all, 5, 1.0, want);
    expect_probs(s, l, want, 5);
    td_sampler_destroy(s);

    /* Greedy sees the penalties: 3.0 / 4 = 0.75 loses to 2.0. */
    p = td_sampler_default_params();
    p.repetition_penalty = 4.0f;
    p.logprobs = true;
    s = make(p, 5);
    td_sample_result r;
    assert_int_equal(td_sampler_sample(s, l, &r), TD_OK);
    assert_int_equal(r.token, 3);
    assert_int_equal(td_sampler_accept(s, 3), TD_OK);
    assert_int_equal(td_sampler_sample(s, l, &r), TD_OK);
    assert_int_equal(r.token, 0);
    /* The chosen token's logprob is the raw one, untouched by the penalty. */
    double lse = 0;
    for (int i = 0; i < 5; i++) lse += exp((double)l[i]);
    lse = log(lse);
    assert_float_equal(r.logprob, 2.0 - lse, 1e-5);
    td_sampler_destroy(s);
}

static void test_penalty_window(void **state) {
    (void)state;
    const float l[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    td_sampler_params p = td_sampler_default_params();
    p.temperature = 1.0f;
    p.presence_penalty = 1.0f;
    p.penalty_last_n = 2;
    td_sampler *s = make(p, 4);
    assert_int_equal(td_sampler_accept(s, 0), TD_OK);
    assert_int_equal(td_sampler_accept(s, 1), TD_OK);
    assert_int_equal(td_sampler_accept(s, 2), TD_OK); /* token 0 leaves the window */
    const double pen[4] = {1.0, 0.0, 0.0, 1.0};
    const int all[4] = {1, 1, 1, 1};
    double want[4];
    ref_softmax(pen, all, 4, 1.0, want);
    expect_probs(s, l, want, 4);

    /* Out-of-vocabulary history is rejected. */
    const int32_t bad[2] = {1, 4};
    assert_int_equal(td_sampler_accept_prompt(s, bad, 2), TD_ERR_INVALID);
    assert_int_equal(td_sampler_accept(s, -1), TD_ERR_INVALID);
    /* ... and left the history as it was. */
    expect_probs(s, l, want, 4);

    /* reset forgets the history. */
    td_sampler_reset(s);
    const double flat[4] = {0.25, 0.25, 0.25, 0.25};
    expect_probs(s, l, flat, 4);
    td_sampler_destroy(s);
}

static void test_logit_bias_and_logprobs(void **state) {
    (void)state;
    const float l[6] = {0.3f, 2.0f, -0.7f, 1.9f, 0.0f, 2.0f};
    const td_logit_bias bias[2] = {{1, -INFINITY}, {4, 5.0f}};
    td_sampler_params p = td_sampler_default_params();
    p.logit_bias = bias;
    p.n_logit_bias = 2;
    p.n_logprobs = 4;
    td_sampler *s = make(p, 6);
    td_sample_result r;
    assert_int_equal(td_sampler_sample(s, l, &r), TD_OK);
    assert_int_equal(r.token, 4); /* 0 + 5 beats everything */

    double z = 0;
    for (int i = 0; i < 6; i++) z += exp((double)l[i]);
    double lse = log(z);
    assert_float_equal(r.logprob, 0.0 - lse, 1e-5);
    /* Raw top-4: 1 (2.0), 5 (2.0, tie: higher id second), 3 (1.9), 0 (0.3). */
    assert_int_equal(r.n_top, 4);
    const int32_t order[4] = {1, 5, 3, 0};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(r.top[i].token, order[i]);
        assert_float_equal(r.top[i].logprob, (double)l[order[i]] - lse, 1e-5);
    }
    /* Logprobs off: none reported. */
    td_sampler_destroy(s);
    p.n_logprobs = 0;
    s = make(p, 6);
    assert_int_equal(td_sampler_sample(s, l, &r), TD_OK);
    assert_int_equal(r.token, 4);
    assert_int_equal(r.n_top, 0);
    /* A banned token never comes out, even with temperature. */
    td_sampler_destroy(s);
    p.temperature = 1.5f;
    p.seed = 7;
    s = make(p, 6);
    for (int i = 0; i < 2000; i++) {
        assert_int_equal(td_sampler_sample(s, l, &r), TD_OK);
        assert_int_not_equal(r.token, 1);
    }
    td_sampler_destroy(s);
}

static void draw(td_sampler *s, const float *l, int n, int32_t *out) {
    td_sample_result r;
    for (int i = 0; i < n; i++) {
        assert_int_equal(td_sampler_sample(s, l, &r), TD_OK);
        out[i] = r.token;
    }
}

static void test_frequencies_chi_square(void **state) {
    (void)state;
    float l[4];
    double ld[4];
    logits_from_probs(k_p4, 4, l, ld);
    td_sampler_params p = td_sampler_default_params();
    p.temperature = 1.0f;
    p.seed = 42;
    td_sampler *s = make(p, 4);
    enum { N = 40000 };
    static int32_t out[N];
    draw(s, l, N, out);
    int cnt[4] = {0};
    for (int i = 0; i < N; i++) cnt[out[i]]++;
    double chi2 = 0;
    for (int i = 0; i < 4; i++) {
        double e = N * k_p4[i];
        chi2 += (cnt[i] - e) * (cnt[i] - e) / e;
    }
    /* 3 degrees of freedom: P(chi2 > 25) ~ 1.6e-5 for a correct sampler; a
     * sampler off by 2 points on any token scores in the hundreds. */
    if (chi2 > 25.0)
        fail_msg("chi2 %.2f: counts %d %d %d %d", chi2, cnt[0], cnt[1], cnt[2], cnt[3]);
    td_sampler_destroy(s);

    /* With top_k = 2 and T = 0.5 only tokens 1 and 3 appear, in the ratio
     * 0.5^2 : 0.3^2 = 25 : 9. */
    p.top_k = 2;
    p.temperature = 0.5f;
    s = make(p, 4);
    draw(s, l, N, out);
    memset(cnt, 0, sizeof cnt);
    for (int i = 0; i < N; i++) cnt[out[i]]++;
    assert_int_equal(cnt[0] + cnt[2], 0);
    double e1 = N * 25.0 / 34.0, e3 = N * 9.0 / 34.0;
    chi2 = (cnt[1] - e1) * (cnt[1] - e1) / e1 + (cnt[3] - e3) * (cnt[3] - e3) / e3;
    if (chi2 > 20.0) fail_msg("chi2 %.2f: counts %d %d", chi2, cnt[1], cnt[3]);
    td_sampler_destroy(s);
}

static void test_seed_reproducible(void **state) {
    (void)state;
    float l[4];
    double ld[4];
    logits_from_probs(k_p4, 4, l, ld);
    td_sampler_params p = td_sampler_default_params();
    p.temperature = 1.0f;
    p.seed = 1234;
    enum { N = 256 };
    int32_t a[N], b[N], c[N], d[N];
    td_sampler *s = make(p, 4);
    draw(s, l, N, a);
    td_sampler_destroy(s);
    s = make(p, 4);
    draw(s, l, N, b);
    /* reset reseeds: the same sequence again */
    td_sampler_reset(s);
    draw(s, l, N, d);
    td_sampler_destroy(s);
    assert_memory_equal(a, b, sizeof a);
    assert_memory_equal(a, d, sizeof a);
    p.seed = 1235;
    s = make(p, 4);
    draw(s, l, N, c);
    td_sampler_destroy(s);
    /* Two independent 256-draw sequences agree everywhere with probability
     * (sum p^2 = 0.365)^256 ~ 1e-112. */
    assert_memory_not_equal(a, c, sizeof a);
}

static void test_invalid_params(void **state) {
    (void)state;
    td_sampler *s = NULL;
    td_sampler_params p = td_sampler_default_params();
    p.temperature = -0.1f;
    assert_int_equal(td_sampler_create(&p, 10, &s), TD_ERR_INVALID);
    p = td_sampler_default_params();
    p.top_p = 0.0f;
    assert_int_equal(td_sampler_create(&p, 10, &s), TD_ERR_INVALID);
    p = td_sampler_default_params();
    p.top_p = 1.5f;
    assert_int_equal(td_sampler_create(&p, 10, &s), TD_ERR_INVALID);
    p = td_sampler_default_params();
    p.min_p = -0.5f;
    assert_int_equal(td_sampler_create(&p, 10, &s), TD_ERR_INVALID);
    p = td_sampler_default_params();
    p.repetition_penalty = 0.0f;
    assert_int_equal(td_sampler_create(&p, 10, &s), TD_ERR_INVALID);
    p = td_sampler_default_params();
    p.n_logprobs = 21;
    assert_int_equal(td_sampler_create(&p, 10, &s), TD_ERR_INVALID);
    p = td_sampler_default_params();
    p.temperature = NAN;
    assert_int_equal(td_sampler_create(&p, 10, &s), TD_ERR_INVALID);
    const td_logit_bias bad = {10, 1.0f};
    p = td_sampler_default_params();
    p.logit_bias = &bad;
    p.n_logit_bias = 1;
    assert_int_equal(td_sampler_create(&p, 10, &s), TD_ERR_INVALID);
    assert_null(s);
    td_sampler_destroy(NULL);
}

/* ---- stop conditions ---- */

typedef struct {
    char text[4096];
    size_t len;
    bool stopped;
} sink;

static void feed(td_stop *st, sink *k, const char *piece) {
    const char *out;
    size_t n;
    bool stopped;
    assert_int_equal(td_stop_feed(st, piece, strlen(piece), &out, &n, &stopped), TD_OK);
    assert_true(k->len + n < sizeof k->text);
    memcpy(k->text + k->len, out, n);
    k->len += n;
    k->text[k->len] = 0;
    k->stopped = k->stopped || stopped;
}

static void finish(td_stop *st, sink *k) {
    const char *out;
    size_t n;
    td_stop_flush(st, &out, &n);
    memcpy(k->text + k->len, out, n);
    k->len += n;
    k->text[k->len] = 0;
}

static td_stop *make_stop(const char *const *strs, size_t n, bool include) {
    td_stop_params p = td_stop_default_params();
    p.stop_strings = strs;
    p.n_stop_strings = n;
    p.include_stop_str = include;
    td_stop *st = NULL;
    assert_int_equal(td_stop_create(&p, NULL, &st), TD_OK);
    return st;
}

static void test_stop_across_pieces(void **state) {
    (void)state;
    const char *strs[2] = {"</s>", "STOP"};
    td_stop *st = make_stop(strs, 2, false);
    sink k = {0};
    feed(st, &k, "Hello <");
    assert_string_equal(k.text, "Hello "); /* "<" is held back */
    feed(st, &k, "/");
    assert_string_equal(k.text, "Hello ");
    feed(st, &k, "s> tail");
    assert_true(k.stopped);
    assert_string_equal(k.text, "Hello ");
    assert_int_equal(td_stop_matched(st), 0);
    feed(st, &k, "more"); /* nothing after a stop */
    assert_string_equal(k.text, "Hello ");

    /* A false start is released once it cannot match any more. */
    td_stop_reset(st);
    memset(&k, 0, sizeof k);
    feed(st, &k, "a</");
    assert_string_equal(k.text, "a");
    feed(st, &k, "x ST");
    assert_string_equal(k.text, "a</x ");
    feed(st, &k, "ONE");
    assert_string_equal(k.text, "a</x STONE");
    assert_false(k.stopped);
    feed(st, &k, "ST");
    finish(st, &k); /* end for another reason: the held "ST" comes out */
    assert_string_equal(k.text, "a</x STONEST");
    assert_int_equal(td_stop_matched(st), -1);
    td_stop_destroy(st);

    /* include_stop_str keeps the stop string; the match completed first
     * ("cd" at byte 4, before "bcde" at byte 5) wins. */
    const char *strs2[2] = {"cd", "bcde"};
    st = make_stop(strs2, 2, true);
    memset(&k, 0, sizeof k);
    feed(st, &k, "ab");
    feed(st, &k, "cdef");
    assert_true(k.stopped);
    assert_string_equal(k.text, "abcd");
    assert_int_equal(td_stop_matched(st), 0);
    td_stop_destroy(st);
}

/* Random texts over a small alphabet, cut into random pieces, against a
 * non-streaming reference: the first end position at which any stop string
 * is complete (the longest one there), the text cut before it. */
static void test_stop_random_against_reference(void **state) {
    (void)state;
    const char *strs[3] = {"abab", "ba", "cab"};
    uint32_t x = 99;
    for (int trial = 0; trial < 500; trial++) {
        char text[64];
        x = x * 1664525u + 1013904223u;
        int len = 1 + (int)((x >> 10) % 40);
        for (int i = 0; i < len; i++) {
            x = x * 1664525u + 1013904223u;
            text[i] = "abcab"[(x >> 12) % 5];
        }
        text[len] = 0;
        /* Stop strings: use only the ones this trial picks. */
        x = x * 1664525u + 1013904223u;
        size_t nst = 1 + (x >> 12) % 3;
        const char *use[3];
        for (size_t i = 0; i < nst; i++) use[i] = strs[(i + trial) % 3];

        size_t cut = (size_t)len;
        for (size_t e = 1; e <= (size_t)len && cut == (size_t)len; e++) {
            size_t longest = 0;
            for (size_t i = 0; i < nst; i++) {
                size_t L = strlen(use[i]);
                if (L <= e && strncmp(text + e - L, use[i], L) == 0 && L > longest) longest = L;
            }
            if (longest) cut = e - longest;
        }
        td_stop *st = make_stop(use, nst, false);
        sink k = {0};
        for (int i = 0; i < len && !k.stopped;) {
            x = x * 1664525u + 1013904223u;
            int pl = 1 + (int)((x >> 12) % 4);
            if (i + pl > len) pl = len - i;
            char piece[8];
            memcpy(piece, text + i, (size_t)pl);
            piece[pl] = 0;
            feed(st, &k, piece);
            i += pl;
        }
        if (!k.stopped) finish(st, &k);
        if (k.len != cut || memcmp(k.text, text, cut) != 0)
            fail_msg("text '%s': got '%s', expected the first %zu bytes", text, k.text, cut);
        assert_int_equal(k.stopped, cut < (size_t)len);
        td_stop_destroy(st);
    }
}

static void test_stop_tokens_and_errors(void **state) {
    (void)state;
    const int32_t ids[3] = {17, 2, 90000};
    td_stop_params p = td_stop_default_params();
    p.stop_ids = ids;
    p.n_stop_ids = 3;
    td_stop *st = NULL;
    assert_int_equal(td_stop_create(&p, NULL, &st), TD_OK);
    assert_true(td_stop_is_stop_token(st, 2));
    assert_true(td_stop_is_stop_token(st, 17));
    assert_true(td_stop_is_stop_token(st, 90000));
    assert_false(td_stop_is_stop_token(st, 3));
    assert_false(td_stop_is_stop_token(st, 0));
    /* No stop strings: text passes straight through. */
    sink k = {0};
    feed(st, &k, "anything </s>");
    assert_string_equal(k.text, "anything </s>");
    td_stop_destroy(st);

    const char *empty[1] = {""};
    p = td_stop_default_params();
    p.stop_strings = empty;
    p.n_stop_strings = 1;
    st = NULL;
    assert_int_equal(td_stop_create(&p, NULL, &st), TD_ERR_INVALID);
    assert_null(st);
    const int32_t neg = -1;
    p = td_stop_default_params();
    p.stop_ids = &neg;
    p.n_stop_ids = 1;
    assert_int_equal(td_stop_create(&p, NULL, &st), TD_ERR_INVALID);

    /* A piece longer than the initial buffer. */
    const char *strs[1] = {"END"};
    st = make_stop(strs, 1, false);
    memset(&k, 0, sizeof k);
    char big[1500];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = 0;
    feed(st, &k, big);
    feed(st, &k, "EN");
    feed(st, &k, "Dz");
    assert_true(k.stopped);
    assert_int_equal(k.len, sizeof big - 1);
    td_stop_destroy(st);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_argmax_and_ties),
        cmocka_unit_test(test_temperature_exact),
        cmocka_unit_test(test_top_k),
        cmocka_unit_test(test_top_p),
        cmocka_unit_test(test_min_p),
        cmocka_unit_test(test_order_temperature_then_truncation),
        cmocka_unit_test(test_large_vocab_top_k_top_p_min_p),
        cmocka_unit_test(test_penalties_hand_computed),
        cmocka_unit_test(test_penalty_window),
        cmocka_unit_test(test_logit_bias_and_logprobs),
        cmocka_unit_test(test_frequencies_chi_square),
        cmocka_unit_test(test_seed_reproducible),
        cmocka_unit_test(test_invalid_params),
        cmocka_unit_test(test_stop_across_pieces),
        cmocka_unit_test(test_stop_random_against_reference),
        cmocka_unit_test(test_stop_tokens_and_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
