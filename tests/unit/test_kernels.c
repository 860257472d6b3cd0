/* CPU kernels against independent references, for every ISA this CPU runs.
 *
 * References are written here from the definitions (block layouts of
 * kernels/dtype.h, the math of each op) and computed in double precision;
 * quantization is checked against goldens made by the PyPI gguf package
 * (tests/unit/make_kernels_golden.py). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/base/threadpool.h"
#include "kernels/cpu/cpu.h"
#include "kernels_golden.h"
#include "ref-dtype.h"

static const td_isa k_isas[] = {TD_ISA_SCALAR, TD_ISA_AVX2, TD_ISA_AVX512};

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static double urand(void) { /* xorshift64*, uniform in [0, 1) */
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return (double)((g_rng * 0x2545f4914f6cdd1dull) >> 11) / 9007199254740992.0;
}
static float frand(float lo, float hi) { return lo + (hi - lo) * (float)urand(); }

/* ---- independent scalar definitions ---- */

/* The activation quantization the matmul contract promises: per 32-block
 * d = amax / 127, q = round-half-even(x * (1/d)). Returns x-hat in double. */
static void ref_act_q8(const float *x, double *xh, double *dx, int k) {
    for (int b = 0; b < k / 32; b++) {
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[b * 32 + j]));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        dx[b] = d;
        for (int j = 0; j < 32; j++) {
            float v = x[b * 32 + j] * id;
            xh[b * 32 + j] = (double)d * rint(v);
        }
    }
}

static int n_isas_run;
static bool select_isa(td_isa isa) {
    if (!td_cpu_select(isa)) return false;
    n_isas_run++;
    return true;
}

/* ---- ISA selection ---- */

static void test_isa_names(void **state) {
    (void)state;
    assert_int_equal(td_cpu_isa_parse("scalar"), TD_ISA_SCALAR);
    assert_int_equal(td_cpu_isa_parse("avx2"), TD_ISA_AVX2);
    assert_int_equal(td_cpu_isa_parse("avx512"), TD_ISA_AVX512);
    assert_int_equal(td_cpu_isa_parse("sse9"), -1);
    assert_int_equal(td_cpu_isa_parse(NULL), -1);
    assert_string_equal(td_cpu_isa_name(TD_ISA_AVX2), "avx2");
    assert_true(td_cpu_select(TD_ISA_SCALAR));
    assert_int_equal(td_cpu_selected(), TD_ISA_SCALAR);
    td_isa best = td_cpu_isa_best();
    assert_true(td_cpu_select(best));
    assert_int_equal(td_cpu_selected(), best);
    /* every ISA up to the best one is accepted */
    for (int i = 0; i <= (int)best; i++) assert_true(td_cpu_select((td_isa)i));
}

/* ---- conversions ---- */

static void test_fp16_all(void **state) {
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        double want = ref_h2f((uint16_t)h);
        float got = td_fp16_to_f32((td_fp16)h);
        if (isnan(want)) {
            assert_true(isnan(got));
            continue;
        }
        assert_true((double)got == want);
        assert_true((signbit(got) != 0) == ((h >> 15) != 0));
        assert_int_equal(td_f32_to_fp16(got), h); /* exact values round-trip */
    }
    /* midpoints between neighbouring finite halves round to the even one */
    for (uint32_t h = 0; h < 0x7bff; h++) {
        double a = ref_h2f((uint16_t)h), b = ref_h2f((uint16_t)(h + 1));
        float mid = (float)((a + b) / 2); /* exact in float */
        uint16_t want = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
        assert_int_equal(td_f32_to_fp16(mid), want);
        assert_int_equal(td_f32_to_fp16(-mid), want | 0x8000);
        /* just above the midpoint rounds up */
        assert_int_equal(td_f32_to_fp16(nextafterf(mid, INFINITY)), h + 1);
    }
    assert_int_equal(td_f32_to_fp16(65520.0f), 0x7c00); /* overflow to inf */
    assert_int_equal(td_f32_to_fp16(65519.0f), 0x7bff);
    assert_int_equal(td_f32_to_fp16(INFINITY), 0x7c00);
    assert_true((td_f32_to_fp16(NAN) & 0x7c00) == 0x7c00 && (td_f32_to_fp16(NAN) & 0x3ff));
    assert_int_equal(td_f32_to_fp16(1e-10f), 0);
}

static void test_bf16(void **state) {
    (void)state;
    for (uint32_t h = 0; h < 65536; h += 7) {
        uint32_t u = h << 16;
        float want;
        memcpy(&want, &u, 4);
        float got = td_bf16_to_f32((td_bf16)h);
        if (isnan(want))
            assert_true(isnan(got));
        else
            assert_memory_equal(&got, &want, 4);
    }
    /* round to nearest even on the 16 dropped bits */
    uint32_t cases[][2] = {{0x3f808000u, 0x3f80},
                           {0x3f818000u, 0x3f82},
                           {0x3f808001u, 0x3f81},
                           {0x3f807fffu, 0x3f80},
                           {0xbf808001u, 0xbf81}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        float f;
        memcpy(&f, &cases[i][0], 4);
        assert_int_equal(td_f32_to_bf16(f), cases[i][1]);
    }
    assert_true((td_f32_to_bf16(NAN) & 0x7f80) == 0x7f80 && (td_f32_to_bf16(NAN) & 0x7f));
}

/* ---- row quantization / dequantization ---- */

static void test_quant_golden(void **state) {
    (void)state;
    float x[GOLDEN_K];
    memcpy(x, golden_x_bits, sizeof(x));
    static uint8_t out[GOLDEN_K * 2];
    struct {
        td_dtype t;
        const uint8_t *g;
        size_t n;
    } c[] = {{TD_TYPE_Q8_0, golden_q8_0, sizeof(golden_q8_0)},
             {TD_TYPE_Q4_0, golden_q4_0, sizeof(golden_q4_0)},
             {TD_TYPE_Q4_1, golden_q4_1, sizeof(golden_q4_1)}};
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(td_dtype_row_bytes(c[i].t, GOLDEN_K), c[i].n);
        memset(out, 0xa5, sizeof(out));
        td_cpu_quant_row(c[i].t, x, out, GOLDEN_K);
        assert_memory_equal(out, c[i].g, c[i].n);
    }
}

static void test_dequant_blocks(void **state) {
    (void)state;
    const td_dtype types[] = {TD_TYPE_Q8_0, TD_TYPE_Q4_0, TD_TYPE_Q4_1,
                              TD_TYPE_F16,  TD_TYPE_BF16, TD_TYPE_F32};
    enum { K = 32 * 9 };
    uint8_t raw[K * 4];
    for (size_t ti = 0; ti < 6; ti++) {
        td_dtype t = types[ti];
        size_t bytes = td_dtype_row_bytes(t, K);
        for (size_t i = 0; i < bytes; i++) raw[i] = (uint8_t)(urand() * 256);
        /* keep the scales finite: random halves in [2^-10, 2) with random sign */
        if (td_dtype_block_elems(t) == 32) {
            size_t bb = td_dtype_block_bytes(t);
            for (int b = 0; b < K / 32; b++) {
                for (int s = 0; s < (t == TD_TYPE_Q4_1 ? 2 : 1); s++) {
                    uint16_t h = (uint16_t)(((5 + (int)(urand() * 10)) << 10) |
                                            (int)(urand() * 1024) | (urand() < 0.5 ? 0x8000 : 0));
                    memcpy(raw + b * bb + 2 * s, &h, 2);
                }
            }
        } else if (t == TD_TYPE_F32) {
            for (int i = 0; i < K; i++) {
                float f = frand(-5, 5);
                memcpy(raw + 4 * i, &f, 4);
            }
        } else {
            for (int i = 0; i < K; i++) raw[2 * i + 1] &= 0xbf; /* no inf/nan exponents */
        }
        double want[K];
        float got[K];
        ref_dequant(t, raw, want, K);
        td_cpu_dequant_row(t, raw, got, K);
        for (int i = 0; i < K; i++) {
            /* exact except Q4_1, whose d*q + m is one float rounding */
            double tol = t == TD_TYPE_Q4_1 ? fabs(want[i]) * 1.2e-7 + 1e-30 : 0.0;
            if (fabs((double)got[i] - want[i]) > tol)
                fail_msg("type %d elem %d: got %.9g want %.9g", t, i, got[i], want[i]);
        }
    }
}

/* ---- matmul ---- */

typedef struct {
    td_dtype t;
    int k;
} mm_case;

static const mm_case k_mm_cases[] = {
    {TD_TYPE_Q4_1, 576},
    {TD_TYPE_Q4_1, 544},
    {TD_TYPE_Q4_0, 576},
    {TD_TYPE_Q4_0, 544},
    {TD_TYPE_Q8_0, 576},
    {TD_TYPE_Q8_0, 544},
    {TD_TYPE_F32, 83},
    {TD_TYPE_F32, 576},
    {TD_TYPE_F16, 83},
    {TD_TYPE_F16, 576},
    {TD_TYPE_BF16, 83},
    {TD_TYPE_BF16, 576},
    /* long rows take other paths: k > 8192 and > 32768, more than 1024 blocks */
    {TD_TYPE_Q8_0, 9248},
    {TD_TYPE_Q4_1, 35232},
    {TD_TYPE_Q4_0, 35232},
    /* the q5 and K types: a partial last step (544 = 17 blocks), rows of
     * whole super-blocks, the 1.5B model's 8960 and a row of > 9216 (the
     * unbuffered path) and of > 1024 blocks (the min term in chunks) */
    {TD_TYPE_Q5_0, 576},
    {TD_TYPE_Q5_0, 544},
    {TD_TYPE_Q5_1, 544},
    {TD_TYPE_Q5_1, 35232},
    {TD_TYPE_Q4_K, 512},
    {TD_TYPE_Q4_K, 8960},
    {TD_TYPE_Q5_K, 1536},
    {TD_TYPE_Q5_K, 35072},
    {TD_TYPE_Q6_K, 768},
    {TD_TYPE_Q6_K, 8960},
    {TD_TYPE_Q6_K, 9472},
};

enum { MM_ROWS = 13, MM_N = 7 };

typedef struct {
    td_dtype t;
    int k;
    size_t ws, xs;
    uint8_t *w, *xq;
    float *x;   /* (MM_N, k) */
    double *wd; /* (MM_ROWS, k) dequantized weights */
} mm_data;

/* A row of the types td_cpu_quant_row does not write (the q5 and K types):
 * random quants and sub-block scales, fp16 scales of random sign and
 * magnitude about scale / 16 (scale 0: an all-zero row). */
static void rand_blocks(td_dtype t, uint8_t *w, int k, float scale) {
    size_t bb = td_dtype_block_bytes(t), n = (size_t)k / (size_t)td_dtype_block_elems(t);
    int off[2];
    int nf = td_dtype_fp16_fields(t, off);
    for (size_t i = 0; i < n * bb; i++) w[i] = scale == 0 ? 0 : (uint8_t)(urand() * 256);
    if (scale == 0) return;
    for (size_t b = 0; b < n; b++)
        for (int f = 0; f < nf; f++) {
            float v = scale / 16 * frand(0.25f, 1.0f) * (urand() < 0.5 ? -1.0f : 1.0f);
            td_fp16 h = td_f32_to_fp16(v);
            memcpy(w + b * bb + off[f], &h, 2);
        }
}

static void mm_make(mm_data *m, td_dtype t, int k) {
    m->t = t;
    m->k = k;
    m->ws = td_dtype_row_bytes(t, k);
    m->xs = td_cpu_act_row_bytes(t, k);
    assert_true(m->ws > 0 && m->xs > 0);
    m->w = malloc(m->ws * MM_ROWS);
    m->xq = malloc(m->xs * MM_N);
    m->x = malloc(sizeof(float) * MM_N * k);
    m->wd = malloc(sizeof(double) * MM_ROWS * k);
    float *tmp = malloc(sizeof(float) * k);
    for (int r = 0; r < MM_ROWS; r++) {
        float scale = r == 3 ? 1e-4f : 1.0f; /* one row of tiny weights */
        for (int i = 0; i < k; i++) tmp[i] = frand(-1, 1) * scale;
        if (r == 5) memset(tmp, 0, sizeof(float) * k); /* all-zero row: d = 0 blocks */
        if (td_dtype_is_quant(t) && t != TD_TYPE_Q4_0 && t != TD_TYPE_Q4_1 && t != TD_TYPE_Q8_0)
            rand_blocks(t, m->w + r * m->ws, k, r == 5 ? 0 : scale);
        else
            td_cpu_quant_row(t, tmp, m->w + r * m->ws, k);
        ref_dequant(t, m->w + r * m->ws, m->wd + (size_t)r * k, k);
    }
    for (int i = 0; i < MM_N * k; i++) m->x[i] = frand(-2, 2);
    for (int i = 0; i < 32 && i < k; i++) m->x[4 * k + i] = 0.0f; /* a zero block in token 4 */
    free(tmp);
}

static void mm_free(mm_data *m) {
    free(m->w);
    free(m->xq);
    free(m->x);
    free(m->wd);
}

static void mm_quant_acts(mm_data *m) {
    for (int t = 0; t < MM_N; t++)
        td_cpu_act_quant(m->t, m->x + (size_t)t * m->k, m->xq + t * m->xs, m->k);
}

static void test_matmul_accuracy(void **state) {
    (void)state;
    for (size_t ii = 0; ii < 3; ii++) {
        if (!select_isa(k_isas[ii])) continue;
        for (size_t ci = 0; ci < sizeof(k_mm_cases) / sizeof(k_mm_cases[0]); ci++) {
            mm_data m;
            mm_make(&m, k_mm_cases[ci].t, k_mm_cases[ci].k);
            mm_quant_acts(&m);
            float y[MM_N * MM_ROWS];
            td_cpu_matmul(m.t, m.w, m.ws, m.xq, m.xs, MM_N, m.k, y, MM_ROWS, 0, MM_ROWS);
            bool quant = td_dtype_is_quant(m.t);
            double *xh = malloc(sizeof(double) * m.k),
                   *dx = malloc(sizeof(double) * (m.k / 32 + 1));
            for (int t = 0; t < MM_N; t++) {
                const float *x = m.x + (size_t)t * m.k;
                if (quant) ref_act_q8(x, xh, dx, m.k);
                for (int r = 0; r < MM_ROWS; r++) {
                    const double *w = m.wd + (size_t)r * m.k;
                    double exact = 0, exact_q = 0, absq = 0, bound = 0;
                    for (int i = 0; i < m.k; i++) {
                        exact += w[i] * x[i];
                        double xi = quant ? xh[i] : x[i];
                        exact_q += w[i] * xi;
                        absq += fabs(w[i] * xi);
                        if (quant) bound += fabs(w[i]) * dx[i / 32] / 2;
                    }
                    double got = y[t * MM_ROWS + r];
                    /* 1) against the same products with the activation
                     * quantized by its definition: only float summation
                     * error remains, a few ulp per term, bounded by
                     * k * 2^-23 * sum|w x|. */
                    double tol_sum = m.k * 1.2e-7 * absq + 1e-30;
                    if (fabs(got - exact_q) > tol_sum)
                        fail_msg("%s type %d k %d r %d t %d: got %.9g want %.9g (tol %.3g)",
                                 td_cpu_isa_name(td_cpu_selected()), m.t, m.k, r, t, got, exact_q,
                                 tol_sum);
                    /* 2) against unquantized activations: the rounding of
                     * x to q*d moves each x by at most d/2, so the result
                     * moves by at most sum |w| * d/2. */
                    if (fabs(got - exact) > bound + tol_sum)
                        fail_msg("type %d: |%.9g - %.9g| above the act-quantization bound %.3g",
                                 m.t, got, exact, bound);
                }
            }
            free(xh);
            free(dx);
            mm_free(&m);
        }
    }
}

/* Bit-identity across n, r0/r1 splits and thread counts. */
typedef struct {
    mm_data *m;
    float *y;
    int n;
} mm_job;

static void mm_task(void *ctx, int ith, int nth) {
    mm_job *j = ctx;
    int64_t b, e;
    td_split_range(MM_ROWS, ith, nth, &b, &e);
    if (b < e)
        td_cpu_matmul(j->m->t, j->m->w, j->m->ws, j->m->xq, j->m->xs, j->n, j->m->k, j->y, MM_ROWS,
                      (int)b, (int)e);
}

static void test_matmul_invariance(void **state) {
    (void)state;
    td_threadpool *tp1, *tp2;
    assert_int_equal(td_threadpool_create(1, &tp1), TD_OK);
    assert_int_equal(td_threadpool_create(2, &tp2), TD_OK);
    for (size_t ii = 0; ii < 3; ii++) {
        if (!select_isa(k_isas[ii])) continue;
        for (size_t ci = 0; ci < sizeof(k_mm_cases) / sizeof(k_mm_cases[0]); ci++) {
            mm_data m;
            mm_make(&m, k_mm_cases[ci].t, k_mm_cases[ci].k);
            mm_quant_acts(&m);
            float full[MM_N * MM_ROWS], part[MM_N * MM_ROWS];
            td_cpu_matmul(m.t, m.w, m.ws, m.xq, m.xs, MM_N, m.k, full, MM_ROWS, 0, MM_ROWS);
            /* one token at a time, rows in uneven pieces */
            static const int cuts[][4] = {
                {0, 1, 2, 13}, {0, 5, 6, 13}, {0, 3, 10, 13}, {0, 7, 8, 13}};
            for (int t = 0; t < MM_N; t++) {
                const int *c = cuts[t % 4];
                memset(part, 0xff, sizeof(part));
                for (int s = 0; s < 3; s++)
                    td_cpu_matmul(m.t, m.w, m.ws, m.xq + t * m.xs, m.xs, 1, m.k, part, MM_ROWS,
                                  c[s], c[s + 1]);
                assert_memory_equal(part, full + t * MM_ROWS, sizeof(float) * MM_ROWS);
            }
            /* tokens 2..6 as a batch of 5, rows 1..12 */
            memset(part, 0xff, sizeof(part));
            td_cpu_matmul(m.t, m.w, m.ws, m.xq + 2 * m.xs, m.xs, 5, m.k, part, MM_ROWS, 1, 12);
            for (int t = 0; t < 5; t++)
                assert_memory_equal(part + t * MM_ROWS + 1, full + (t + 2) * MM_ROWS + 1,
                                    sizeof(float) * 11);
            /* thread pools of 1 and 2 threads */
            mm_job j = {&m, part, MM_N};
            memset(part, 0xff, sizeof(part));
            td_threadpool_run(tp1, mm_task, &j);
            assert_memory_equal(part, full, sizeof(full));
            memset(part, 0xff, sizeof(part));
            td_threadpool_run(tp2, mm_task, &j);
            assert_memory_equal(part, full, sizeof(full));
            mm_free(&m);
        }
    }
    td_threadpool_destroy(tp1);
    td_threadpool_destroy(tp2);
}

/* The activation rows are a function of x alone, identical for every ISA. */
static void test_act_quant_same_bytes(void **state) {
    (void)state;
    enum { K = 576 };
    float x[K];
    for (int i = 0; i < K; i++) x[i] = frand(-3, 3);
    for (int i = 0; i < 32; i++) x[64 + i] = 0.0f;
    x[200] = 127.0f / 2; /* ties */
    x[201] = 0.5f;
    size_t bytes = td_cpu_act_row_bytes(TD_TYPE_Q4_1, K);
    uint8_t *ref = malloc(bytes), *got = malloc(bytes);
    assert_true(td_cpu_select(TD_ISA_SCALAR));
    td_cpu_act_quant(TD_TYPE_Q4_1, x, ref, K);
    for (size_t ii = 1; ii < 3; ii++) {
        if (!select_isa(k_isas[ii])) continue;
        memset(got, 0x5a, bytes);
        td_cpu_act_quant(TD_TYPE_Q4_1, x, got, K);
        assert_memory_equal(got, ref, bytes);
    }
    free(ref);
    free(got);
}

/* ---- elementwise ---- */

static void assert_close(double got, double want, double rel, double abs_tol, const char *what) {
    if (!(fabs(got - want) <= rel * fabs(want) + abs_tol))
        fail_msg("%s (%s): got %.9g want %.9g", what, td_cpu_isa_name(td_cpu_selected()), got,
                 want);
}

static void test_elementwise(void **state) {
    (void)state;
    static const int sizes[] = {1, 7, 16, 37, 576, 1536};
    for (size_t ii = 0; ii < 3; ii++) {
        if (!select_isa(k_isas[ii])) continue;
        for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
            int n = sizes[si];
            float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n),
                  *o = malloc(sizeof(float) * n), *w = malloc(sizeof(float) * n);
            for (int i = 0; i < n; i++) {
                a[i] = frand(-4, 4);
                b[i] = frand(-4, 4);
                w[i] = frand(0.5f, 1.5f);
            }
            if (n > 3) a[2] = -30.0f, a[3] = 30.0f; /* swiglu saturation */
            /* rmsnorm: float sum of squares, one rounding per element */
            double ss = 0;
            for (int i = 0; i < n; i++) ss += (double)a[i] * a[i];
            double r = 1.0 / sqrt(ss / n + 1e-5);
            td_cpu_rmsnorm(a, w, o, n, 1e-5f);
            for (int i = 0; i < n; i++) assert_close(o[i], a[i] * r * w[i], 2e-6, 1e-30, "rmsnorm");
            td_cpu_rmsnorm(a, NULL, o, n, 1e-5f);
            for (int i = 0; i < n; i++) assert_close(o[i], a[i] * r, 2e-6, 1e-30, "rmsnorm nw");
            /* swiglu: the SIMD exp is a polynomial good to a few ulp */
            td_cpu_swiglu(a, b, o, n);
            for (int i = 0; i < n; i++)
                assert_close(o[i], a[i] / (1.0 + exp(-(double)a[i])) * b[i], 2e-6, 1e-30, "swiglu");
            /* add and scale are single IEEE operations: exact */
            td_cpu_add(a, b, o, n);
            for (int i = 0; i < n; i++) assert_true(o[i] == a[i] + b[i]);
            memcpy(o, a, sizeof(float) * n);
            td_cpu_add(o, b, o, n); /* aliasing */
            for (int i = 0; i < n; i++) assert_true(o[i] == a[i] + b[i]);
            memcpy(o, a, sizeof(float) * n);
            td_cpu_scale(o, 0.37f, n);
            for (int i = 0; i < n; i++) assert_true(o[i] == a[i] * 0.37f);
            /* softmax */
            memcpy(o, a, sizeof(float) * n);
            if (n > 5) o[5] = -INFINITY; /* masked entry */
            double mx = -INFINITY, sum = 0;
            for (int i = 0; i < n; i++) mx = fmax(mx, o[i]);
            for (int i = 0; i < n; i++) sum += exp((double)o[i] - mx);
            float *in = malloc(sizeof(float) * n);
            memcpy(in, o, sizeof(float) * n);
            td_cpu_softmax(o, n);
            double tot = 0;
            for (int i = 0; i < n; i++) {
                assert_close(o[i], exp((double)in[i] - mx) / sum, 3e-6, 1e-30, "softmax");
                tot += o[i];
            }
            assert_close(tot, 1.0, 1e-5, 0, "softmax sum");
            free(in);
            free(a), free(b), free(o), free(w);
        }
    }
}

static void test_rope(void **state) {
    (void)state;
    enum { H = 3, D = 64 };
    float inv[D / 2];
    for (int i = 0; i < D / 2; i++) inv[i] = (float)pow(10000.0, -2.0 * i / D);
    for (size_t ii = 0; ii < 3; ii++) {
        if (!select_isa(k_isas[ii])) continue;
        for (int mode = 0; mode < 2; mode++) {
            for (int nrot = D; nrot >= 32; nrot -= 32) {
                int32_t pos = nrot == D ? 4093 : 17;
                float x[H * D], orig[H * D];
                for (int i = 0; i < H * D; i++) orig[i] = x[i] = frand(-1, 1);
                td_rope_mode md = mode ? TD_ROPE_NEOX : TD_ROPE_NORM;
                td_cpu_rope(x, H, D, nrot, pos, inv, md);
                for (int h = 0; h < H; h++) {
                    const float *xo = orig + h * D;
                    double want[D];
                    for (int i = 0; i < D; i++) want[i] = xo[i];
                    for (int i = 0; i < nrot / 2; i++) {
                        int a = md == TD_ROPE_NEOX ? i : 2 * i;
                        int b = md == TD_ROPE_NEOX ? i + nrot / 2 : 2 * i + 1;
                        double th = (double)pos * inv[i];
                        want[a] = xo[a] * cos(th) - xo[b] * sin(th);
                        want[b] = xo[a] * sin(th) + xo[b] * cos(th);
                    }
                    for (int i = 0; i < D; i++)
                        assert_close(x[h * D + i], want[i], 0, 4e-7, "rope");
                }
            }
        }
    }
}

/* ---- paged attention ---- */

/* The KV cache of one dtype: K and V stored in it (rounded to nearest
 * even), and the reference computed in double from the stored values. */
static void check_attention(td_dtype dt, int HD) {
    enum { BS = 16, HKV = 3, NBLK = 9, CTX = 131, NQ = 11 };
    const size_t tok = (size_t)HKV * HD, n_el = (size_t)NBLK * BS * tok;
    const size_t es = dt == TD_TYPE_F32 ? 4 : 2;
    float *kf = malloc(sizeof(float) * n_el), *vf = malloc(sizeof(float) * n_el);
    char *kc = malloc(es * n_el), *vc = malloc(es * n_el);
    char *ks = malloc(es * n_el), *vs = malloc(es * n_el);
    for (size_t i = 0; i < n_el; i++) kf[i] = frand(-1, 1), vf[i] = frand(-1, 1);
    td_cpu_quant_row(dt, kf, kc, (int64_t)n_el);
    td_cpu_quant_row(dt, vf, vc, (int64_t)n_el);
    td_cpu_dequant_row(dt, kc, kf, (int64_t)n_el); /* the values the kernels see */
    td_cpu_dequant_row(dt, vc, vf, (int64_t)n_el);
    /* scrambled copy: logical block j lives in physical block perm[j] */
    int32_t perm[NBLK] = {4, 8, 0, 6, 2, 7, 1, 5, 3}, ident[NBLK];
    const size_t blk = BS * tok * es;
    for (int j = 0; j < NBLK; j++) {
        ident[j] = j;
        memcpy(ks + perm[j] * blk, kc + j * blk, blk);
        memcpy(vs + perm[j] * blk, vc + j * blk, blk);
    }
    td_cpu_kv_layer lc = {
        .k = kc, .v = vc, .dtype = dt, .block_size = BS, .n_kv_heads = HKV, .head_dim = HD};
    td_cpu_kv_layer ls = lc;
    ls.k = ks, ls.v = vs;
    float *q = malloc(sizeof(float) * HD), *o1 = malloc(sizeof(float) * HD),
          *o2 = malloc(sizeof(float) * HD), scratch[CTX];
    for (int i = 0; i < HD; i++) q[i] = frand(-2, 2);
    float scale = 1.0f / 8.0f;
    static const int ctxs[] = {1, 3, 16, 17, CTX};
    for (size_t ii = 0; ii < 3; ii++) {
        if (!select_isa(k_isas[ii])) continue;
        for (size_t ci = 0; ci < 5; ci++) {
            int n = ctxs[ci];
            for (int h = 0; h < HKV; h++) {
                td_cpu_attn_paged(q, &lc, h, ident, n, scale, o1, scratch);
                td_cpu_attn_paged(q, &ls, h, perm, n, scale, o2, scratch);
                assert_memory_equal(o1, o2, sizeof(float) * HD); /* same values, same order */
                double s[CTX], mx = -INFINITY, sum = 0;
                for (int p = 0; p < n; p++) {
                    const float *k = kf + p * tok + h * HD;
                    double d = 0;
                    for (int i = 0; i < HD; i++) d += (double)q[i] * k[i];
                    s[p] = d * scale;
                    mx = fmax(mx, s[p]);
                }
                for (int p = 0; p < n; p++) sum += (s[p] = exp(s[p] - mx));
                for (int i = 0; i < HD; i++) {
                    double want = 0;
                    for (int p = 0; p < n; p++) want += s[p] / sum * vf[p * tok + h * HD + i];
                    /* |out| <= 1; float dot, exp and sums: a few 1e-7 */
                    assert_close(o1[i], want, 0, 5e-6, "attention");
                }
            }
        }
    }
    /* the multi-query entry point: bit-identical to one call per query, for
     * queries of several heads and positions (ragged n_ctx, tails) */
    float *qm = malloc(sizeof(float) * NQ * HD), *om = malloc(sizeof(float) * NQ * HD);
    float *scr = malloc(sizeof(float) * NQ * CTX);
    td_cpu_attn_query qs[NQ];
    for (size_t ii = 0; ii < 3; ii++) {
        if (!select_isa(k_isas[ii])) continue;
        for (int h = 0; h < HKV; h++) {
            for (int i = 0; i < NQ; i++) {
                for (int d = 0; d < HD; d++) qm[i * HD + d] = frand(-2, 2);
                qs[i].q = qm + i * HD;
                qs[i].out = om + i * HD;
                qs[i].n_ctx = i == 0 ? 1 : CTX - (i * 13) % 40; /* 131, 118, 105, ... */
            }
            for (int nq = 1; nq <= NQ; nq += 5) {
                memset(om, 0xff, sizeof(float) * NQ * HD);
                td_cpu_attn_paged_multi(qs, nq, &ls, h, perm, scale, scr);
                for (int i = 0; i < nq; i++) {
                    td_cpu_attn_paged(qs[i].q, &ls, h, perm, qs[i].n_ctx, scale, o1, scratch);
                    assert_memory_equal(qs[i].out, o1, sizeof(float) * HD);
                }
            }
        }
    }
    free(scr), free(qm), free(om), free(q), free(o1), free(o2);
    free(kf), free(vf), free(kc), free(vc), free(ks), free(vs);
}

/* Every KV dtype, at head_dim 64 (the fast paths) and 76 (masked and
 * scalar tails on every ISA). */
static void test_attention(void **state) {
    (void)state;
    static const td_dtype dts[] = {TD_TYPE_F32, TD_TYPE_F16, TD_TYPE_BF16};
    for (size_t d = 0; d < 3; d++) {
        check_attention(dts[d], 64);
        check_attention(dts[d], 76);
    }
}

/* The KV store rounds to nearest even with the bits of td_cpu_quant_row on
 * every ISA: ties, subnormals, overflow, infinities and NaN included, and
 * lengths that leave a tail. */
static void test_kv_store_same_bits(void **state) {
    (void)state;
    enum { N = 1037 };
    float x[N];
    uint16_t want[N], got[N];
    for (int i = 0; i < N; i++) {
        float f = frand(-4, 4);
        switch (i % 8) {
        case 1: f *= 1e-6f; break;  /* f16 subnormal range */
        case 2: f *= 3e4f; break;   /* near and past the f16 maximum */
        case 3: f *= 1e-30f; break; /* bf16 subnormal range, f16 zero */
        case 4: {                   /* an exact tie for f16 (bit 12 set, bits below clear) */
            uint32_t u;
            memcpy(&u, &f, 4);
            u = (u & ~0x1fffu) | 0x1000u;
            memcpy(&f, &u, 4);
            break;
        }
        case 5: { /* an exact tie for bf16 */
            uint32_t u;
            memcpy(&u, &f, 4);
            u = (u & ~0xffffu) | 0x8000u;
            memcpy(&f, &u, 4);
            break;
        }
        default: break;
        }
        x[i] = f;
    }
    x[6] = INFINITY, x[14] = -INFINITY, x[22] = NAN, x[30] = -0.0f, x[38] = 65520.0f;
    static const td_dtype dts[] = {TD_TYPE_F16, TD_TYPE_BF16};
    for (size_t d = 0; d < 2; d++) {
        td_cpu_quant_row(dts[d], x, want, N);
        for (size_t ii = 0; ii < 3; ii++) {
            if (!select_isa(k_isas[ii])) continue;
            for (int n = N - 8; n <= N; n++) {
                memset(got, 0xab, sizeof got);
                td_cpu_kv_store(dts[d], x, got, n);
                assert_memory_equal(got, want, (size_t)n * 2);
                assert_int_equal(got[n < N ? n : 0], n < N ? 0xabab : want[0]); /* no overrun */
            }
        }
    }
    float f32[N];
    td_cpu_kv_store(TD_TYPE_F32, x, f32, N);
    assert_memory_equal(f32, x, sizeof x);
}

static void test_all_isas_ran(void **state) {
    (void)state;
    /* the tests above ran every ISA this CPU has */
    int expect = (int)td_cpu_isa_best() + 1;
    assert_true(n_isas_run >= expect);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_isa_names),
        cmocka_unit_test(test_fp16_all),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_quant_golden),
        cmocka_unit_test(test_dequant_blocks),
        cmocka_unit_test(test_matmul_accuracy),
        cmocka_unit_test(test_matmul_invariance),
        cmocka_unit_test(test_act_quant_same_bytes),
        cmocka_unit_test(test_elementwise),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_attention),
        cmocka_unit_test(test_kv_store_same_bits),
        cmocka_unit_test(test_all_isas_ran),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
