/* td_cpu_matmul_f32act (F32 activations, weights dequantized on the fly)
 * against an independent double-precision reference, for every ISA this
 * CPU runs, and its invariance contract: within one ISA a (row, token)
 * value is bit-identical whatever n, r0, r1, the token's place in the batch
 * and the thread split.
 *
 * The reference decodes blocks from the GGUF definitions written here
 * (q4_0: d*(q-8), q4_1: d*q+m, q8_0: d*q; fp16 by its formula; bf16 as the
 * top half of an f32) and sums in
 * double. Tolerance: the kernel rounds each dequantized weight once (q4_1
 * only: d*q is exact in f32) and sums k products in f32 with lane
 * accumulators (k/8 terms per lane at most, then a tree of at most 4 levels),
 * so |error| <= (k/8 + 6) * u * sum|w*x| with u = 2^-24; the test uses that
 * bound. The exact cases use power-of-two scales and small integer
 * activations, where every operation of the kernel is exact, so any
 * misplaced element shows up as an inequality. */
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
#include "kernels/cpu/qmatmul.h"
#include "ref-dtype.h"
#define TD_TEST_RNG_SEED 0x243f6a8885a308d3ull
#include "test-rand.h"

static const td_isa k_isas[] = {TD_ISA_SCALAR, TD_ISA_AVX2, TD_ISA_AVX512};
static const td_dtype k_types[] = {TD_TYPE_Q4_0, TD_TYPE_Q4_1, TD_TYPE_Q8_0, TD_TYPE_Q5_0,
                                   TD_TYPE_Q5_1, TD_TYPE_Q4_K, TD_TYPE_Q5_K, TD_TYPE_Q6_K,
                                   TD_TYPE_F16,  TD_TYPE_BF16, TD_TYPE_F32};

static int is_5k(td_dtype t) {
    return t == TD_TYPE_Q5_0 || t == TD_TYPE_Q5_1 || t == TD_TYPE_Q4_K || t == TD_TYPE_Q5_K ||
           t == TD_TYPE_Q6_K;
}

/* Element j of group b (32 elements) of a row, by the GGUF definitions. */
static double ref_w(td_dtype t, const uint8_t *row, int64_t b, int j) {
    if (is_5k(t)) { /* ref-dtype.h, over the whole block */
        double v[256];
        int per = td_dtype_block_elems(t) / 32;
        ref_dequant_block5k(t, row + (size_t)(b / per) * td_dtype_block_bytes(t), v);
        return v[(b % per) * 32 + j];
    }
    switch (t) {
    case TD_TYPE_Q4_0: {
        const uint8_t *p = row + b * 18;
        double d = ref_h2f((uint16_t)(p[0] | p[1] << 8));
        int q = j < 16 ? p[2 + j] & 15 : p[2 + j - 16] >> 4;
        return d * (q - 8);
    }
    case TD_TYPE_Q4_1: {
        const uint8_t *p = row + b * 20;
        double d = ref_h2f((uint16_t)(p[0] | p[1] << 8));
        double m = ref_h2f((uint16_t)(p[2] | p[3] << 8));
        int q = j < 16 ? p[4 + j] & 15 : p[4 + j - 16] >> 4;
        return d * q + m;
    }
    case TD_TYPE_Q8_0: {
        const uint8_t *p = row + b * 34;
        double d = ref_h2f((uint16_t)(p[0] | p[1] << 8));
        return d * (int8_t)p[2 + j];
    }
    case TD_TYPE_F16:
        return ref_h2f((uint16_t)(row[2 * (32 * b + j)] | row[2 * (32 * b + j) + 1] << 8));
    case TD_TYPE_BF16: { /* the top half of an IEEE single */
        uint32_t u = (uint32_t)(row[2 * (32 * b + j)] | row[2 * (32 * b + j) + 1] << 8) << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    case TD_TYPE_F32: {
        float f;
        memcpy(&f, row + 4 * (32 * b + j), 4);
        return f;
    }
    default: fail_msg("type %d", t); return 0;
    }
}

static size_t row_bytes(td_dtype t, int64_t k) {
    if (is_5k(t)) return td_dtype_row_bytes(t, k);
    switch (t) {
    case TD_TYPE_Q4_0: return (size_t)k / 32 * 18;
    case TD_TYPE_Q4_1: return (size_t)k / 32 * 20;
    case TD_TYPE_Q8_0: return (size_t)k / 32 * 34;
    case TD_TYPE_F16:
    case TD_TYPE_BF16: return (size_t)k * 2;
    case TD_TYPE_F32: return (size_t)k * 4;
    default: fail_msg("type %d", t); return 0;
    }
}

/* Random weights: random quant bytes, scales 2^e * (1 + man/1024) with e in
 * [-10, -4] (as in real models); exact: e fixed at -2, no mantissa bits, so
 * that every product and sum with small integer activations is exact. */
static void fill_weights(td_dtype t, uint8_t *w, int rows, int64_t k, size_t stride, bool exact) {
    for (int r = 0; r < rows; r++) {
        uint8_t *row = w + (size_t)r * stride;
        if (t == TD_TYPE_F32 || t == TD_TYPE_BF16) {
            for (int64_t i = 0; i < k; i++) {
                float f =
                    exact ? (float)((int)(rnd64() % 9) - 4) * 0.25f : (float)(urand() * 0.2 - 0.1);
                uint32_t u;
                memcpy(&u, &f, 4);
                if (t == TD_TYPE_BF16) {
                    uint16_t h = (uint16_t)(u >> 16); /* truncation: still a bf16 value */
                    memcpy(row + 2 * i, &h, 2);
                } else {
                    memcpy(row + 4 * i, &u, 4);
                }
            }
            continue;
        }
        if (t == TD_TYPE_F16) {
            for (int64_t i = 0; i < k; i++) {
                uint16_t h = exact ? h_bits((int)(rnd64() & 1), (int)(rnd64() % 4) - 2, 0)
                                   : h_bits((int)(rnd64() & 1), -(int)(rnd64() % 6) - 1,
                                            (int)(rnd64() % 1024));
                row[2 * i] = (uint8_t)h;
                row[2 * i + 1] = (uint8_t)(h >> 8);
            }
            continue;
        }
        size_t bs = td_dtype_block_bytes(t);
        for (int64_t b = 0; b < k / td_dtype_block_elems(t); b++) {
            uint8_t *p = row + b * bs;
            for (size_t i = 0; i < bs; i++) p[i] = (uint8_t)rnd64();
            uint16_t d =
                exact ? h_bits(0, -2, 0)
                      : h_bits((int)(rnd64() & 1), -4 - (int)(rnd64() % 7), (int)(rnd64() % 1024));
            if (t == TD_TYPE_Q6_K) {
                p[208] = (uint8_t)d;
                p[209] = (uint8_t)(d >> 8);
                /* exact: int8 scales in [-2, 2) keep every sum of k <= 16640 products
                 * below 2^22 (an exact multiple of 1/4 in f32) */
                if (exact)
                    for (int i = 0; i < 16; i++) p[192 + i] = (uint8_t)((int)(rnd64() % 4) - 2);
                continue;
            }
            if (exact && (t == TD_TYPE_Q4_K || t == TD_TYPE_Q5_K)) /* sc, m in [0, 3], as above */
                for (int i = 0; i < 12; i++) p[4 + i] = (uint8_t)(rnd64() & 3);
            p[0] = (uint8_t)d;
            p[1] = (uint8_t)(d >> 8);
            if (t == TD_TYPE_Q4_1 || t == TD_TYPE_Q5_1 || t == TD_TYPE_Q4_K ||
                t == TD_TYPE_Q5_K) { /* the min (q4_1, q5_1) or dmin (K) */
                uint16_t m = exact ? h_bits(1, 1, 0)
                                   : h_bits((int)(rnd64() & 1), -2 - (int)(rnd64() % 4),
                                            (int)(rnd64() % 1024));
                p[2] = (uint8_t)m;
                p[3] = (uint8_t)(m >> 8);
            }
        }
    }
}

static void fill_x(float *x, int n, int64_t k, size_t ldx, bool exact) {
    for (int t = 0; t < n; t++)
        for (size_t i = 0; i < ldx; i++)
            x[(size_t)t * ldx + i] = i >= (size_t)k ? NAN /* padding must never be read */
                                     : exact        ? (float)((int)(rnd64() % 15) - 7)
                                                    : (float)(urand() * 4.0 - 2.0);
}

typedef struct {
    td_dtype t;
    int rows, n;
    int64_t k;
} mcase;

/* Runs y = W x on the selected ISA and checks every entry against the
 * reference; exact: the entry must be equal. */
static void check_case(const mcase *c, bool exact) {
    size_t stride = row_bytes(c->t, c->k) + 8; /* rows need not be packed */
    size_t ldx = (size_t)c->k + 3, ldy = (size_t)c->rows + 2;
    uint8_t *w = malloc(stride * (size_t)c->rows);
    float *x = malloc(sizeof(float) * ldx * (size_t)c->n);
    float *y = malloc(sizeof(float) * ldy * (size_t)c->n);
    assert_non_null(w);
    assert_non_null(x);
    assert_non_null(y);
    fill_weights(c->t, w, c->rows, c->k, stride, exact);
    fill_x(x, c->n, c->k, ldx, exact);
    for (size_t i = 0; i < ldy * (size_t)c->n; i++) y[i] = -12345.0f;
    td_cpu_matmul_f32act(c->t, w, stride, x, ldx, c->n, c->k, y, ldy, 0, c->rows);
    for (int t = 0; t < c->n; t++) {
        for (int r = 0; r < c->rows; r++) {
            double s = 0, sa = 0;
            for (int64_t i = 0; i < c->k; i++) {
                double p = ref_w(c->t, w + (size_t)r * stride, i / 32, (int)(i % 32)) *
                           x[(size_t)t * ldx + (size_t)i];
                s += p;
                sa += fabs(p);
            }
            double got = y[(size_t)t * ldy + (size_t)r];
            double tol = exact ? 0 : ((double)c->k / 8 + 6) * ldexp(1, -24) * sa;
            if (!(fabs(got - s) <= tol))
                fail_msg("%s type %d k %lld n %d: y[%d][%d] = %.9g, reference %.9g (tol %.3g)",
                         td_cpu_isa_name(td_cpu_selected()), c->t, (long long)c->k, c->n, t, r, got,
                         s, tol);
        }
        for (size_t r = (size_t)c->rows; r < ldy; r++)
            assert_true(y[(size_t)t * ldy + r] == -12345.0f); /* outside [r0, r1) untouched */
    }
    free(w);
    free(x);
    free(y);
}

static const mcase k_cases[] = {
    {TD_TYPE_Q4_0, 5, 1, 32},     {TD_TYPE_Q4_1, 9, 3, 64},     {TD_TYPE_Q8_0, 13, 5, 96},
    {TD_TYPE_Q4_0, 37, 8, 576},   {TD_TYPE_Q4_1, 37, 1, 576},   {TD_TYPE_Q8_0, 37, 13, 576},
    {TD_TYPE_Q4_1, 19, 37, 1536}, {TD_TYPE_Q4_0, 6, 2, 4096},   {TD_TYPE_Q8_0, 7, 9, 1536},
    {TD_TYPE_Q4_1, 5, 6, 16416}, /* longer than the tiled paths' scratch */
    {TD_TYPE_F16, 9, 7, 96},      {TD_TYPE_F16, 9, 1, 576},     {TD_TYPE_BF16, 11, 5, 576},
    {TD_TYPE_BF16, 3, 2, 64},     {TD_TYPE_F32, 10, 9, 128},    {TD_TYPE_F32, 4, 1, 1536},
    {TD_TYPE_F32, 5, 6, 40}, /* float rows of any length (not a multiple of 32) */
    {TD_TYPE_F16, 3, 5, 16416},   {TD_TYPE_Q5_0, 5, 1, 32},     {TD_TYPE_Q5_1, 9, 3, 64},
    {TD_TYPE_Q5_0, 37, 8, 576},   {TD_TYPE_Q5_1, 19, 37, 1536}, {TD_TYPE_Q4_K, 5, 1, 256},
    {TD_TYPE_Q5_K, 9, 3, 512},    {TD_TYPE_Q6_K, 13, 5, 768},   {TD_TYPE_Q4_K, 37, 8, 768},
    {TD_TYPE_Q5_K, 37, 13, 1536}, {TD_TYPE_Q6_K, 19, 37, 1536}, {TD_TYPE_Q4_K, 6, 2, 4096},
    {TD_TYPE_Q6_K, 5, 6, 16640},  {TD_TYPE_Q5_0, 5, 6, 16416},  {TD_TYPE_Q5_K, 7, 9, 4864},
};

static void test_reference(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof k_isas / sizeof k_isas[0]; i++) {
        if (!td_cpu_select(k_isas[i])) continue;
        for (size_t c = 0; c < sizeof k_cases / sizeof k_cases[0]; c++) {
            check_case(&k_cases[c], false);
            check_case(&k_cases[c], true);
        }
    }
    assert_true(td_cpu_select(td_cpu_isa_best()));
}

/* ---- invariance ---- */

#define INV_ROWS 37
#define INV_K    576 /* K-quants: 768 (whole super-blocks) */
#define INV_KMAX 768
#define INV_N    512

typedef struct {
    td_dtype t;
    const uint8_t *w;
    size_t stride;
    const float *x;
    float *y;
    int nth_rows; /* rows per thread item */
    int64_t k;
} mt_ctx;

static void task_rows(void *ctx, int ith, int nth) {
    const mt_ctx *c = ctx;
    /* thread ith takes row items ith, ith + nth, ... */
    for (int r0 = ith * c->nth_rows; r0 < INV_ROWS; r0 += nth * c->nth_rows) {
        int r1 = r0 + c->nth_rows < INV_ROWS ? r0 + c->nth_rows : INV_ROWS;
        td_cpu_matmul_f32act(c->t, c->w, c->stride, c->x, INV_KMAX, INV_N, c->k, c->y, INV_ROWS, r0,
                             r1);
    }
}

static void test_invariance(void **state) {
    (void)state;
    td_threadpool *tp = NULL;
    assert_int_equal(td_threadpool_create(3, &tp), 0);
    float *x = malloc(sizeof(float) * INV_KMAX * INV_N);
    float *full = malloc(sizeof(float) * INV_ROWS * INV_N);
    float *y = malloc(sizeof(float) * INV_ROWS * INV_N);
    assert_non_null(x);
    assert_non_null(full);
    assert_non_null(y);
    fill_x(x, INV_N, INV_KMAX, INV_KMAX, false);
    static const int ns[] = {1, 2, 3, 4, 5, 7, 8, 37, 512};
    static const int splits[][2] = {{0, 37}, {0, 1}, {1, 6}, {6, 7}, {7, 20}, {20, 37}, {3, 4}};
    for (size_t ti = 0; ti < sizeof k_types / sizeof k_types[0]; ti++) {
        td_dtype t = k_types[ti];
        const int64_t k = td_dtype_block_elems(t) > 32 ? INV_KMAX : INV_K;
        size_t stride = row_bytes(t, k);
        uint8_t *w = malloc(stride * INV_ROWS);
        assert_non_null(w);
        fill_weights(t, w, INV_ROWS, k, stride, false);
        for (size_t ii = 0; ii < sizeof k_isas / sizeof k_isas[0]; ii++) {
            if (!td_cpu_select(k_isas[ii])) continue;
            td_cpu_matmul_f32act(t, w, stride, x, INV_KMAX, INV_N, k, full, INV_ROWS, 0, INV_ROWS);
            for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++) {
                int n = ns[a];
                /* tokens [t0, t0 + n): the same token at a different place in the batch */
                for (int t0 = 0; t0 + n <= INV_N; t0 += n == INV_N ? 1 : 97) {
                    for (size_t s = 0; s < sizeof splits / sizeof splits[0]; s++) {
                        int r0 = splits[s][0], r1 = splits[s][1];
                        memset(y, 0, sizeof(float) * INV_ROWS * (size_t)n);
                        td_cpu_matmul_f32act(t, w, stride, x + (size_t)t0 * INV_KMAX, INV_KMAX, n,
                                             k, y, INV_ROWS, r0, r1);
                        for (int tt = 0; tt < n; tt++)
                            if (memcmp(y + (size_t)tt * INV_ROWS + r0,
                                       full + (size_t)(t0 + tt) * INV_ROWS + r0,
                                       sizeof(float) * (size_t)(r1 - r0)))
                                fail_msg("%s type %d: n %d t0 %d rows [%d, %d): token %d differs",
                                         td_cpu_isa_name(k_isas[ii]), t, n, t0, r0, r1, tt);
                    }
                }
            }
            /* three threads, rows shared out in items of 1, 5 and 16 rows */
            static const int items[] = {1, 5, 16};
            for (size_t m = 0; m < 3; m++) {
                memset(y, 0, sizeof(float) * INV_ROWS * INV_N);
                mt_ctx c = {
                    .t = t, .w = w, .stride = stride, .x = x, .y = y, .nth_rows = items[m], .k = k};
                td_threadpool_run(tp, task_rows, &c);
                assert_memory_equal(y, full, sizeof(float) * INV_ROWS * INV_N);
            }
        }
        free(w);
    }
    assert_true(td_cpu_select(td_cpu_isa_best()));
    free(x);
    free(full);
    free(y);
    td_threadpool_destroy(tp);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reference),
        cmocka_unit_test(test_invariance),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
