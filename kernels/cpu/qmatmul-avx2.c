/* AVX2 + FMA + F16C F32-activation quantized matmul.
 *
 * Same structure as the AVX-512 file with 8-lane accumulators: lane j of a
 * (row, token) pair takes the elements j, j + 8, ... in k order, then one
 * fixed horizontal sum. The register path (few tokens) dequantizes each
 * 8-element step in registers; the tiled path dequantizes a tile of rows
 * into a thread-local f32 scratch once per token chunk. Both paths make the
 * same roundings, so the path chosen from n never changes a value. */
#include <immintrin.h>

#include "cpu-impl.h"
#include "qmatmul-impl.h"

#define AI     static inline __attribute__((always_inline))

#define RR     4 /* weight rows per tile */
#define TREG   3 /* tokens per tile, register path (one weight row per tile) */
#define TBUF   2 /* tokens per tile, tiled path */
#define MIN_TB 4 /* tokens from which the tiled path is used */
#define XCHUNK (192 * 1024)

static _Thread_local _Alignas(64) float g_wf[RR * TD_QMM_KMAX]; /* (RR, k) dequantized rows */

AI float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Scale (and Q4_1 min) of block b. */
AI void block_dm(const td_dtype WT, const char *row, int64_t b, __m256 *d, __m256 *m) {
    if (WT == TD_TYPE_Q8_0) {
        *d = _mm256_set1_ps(_cvtsh_ss(((const td_block_q8_0 *)row + b)->d));
    } else if (WT == TD_TYPE_Q4_0) {
        *d = _mm256_set1_ps(_cvtsh_ss(((const td_block_q4_0 *)row + b)->d));
    } else {
        const td_block_q4_1 *bl = (const td_block_q4_1 *)row + b;
        *d = _mm256_set1_ps(_cvtsh_ss(bl->d));
        *m = _mm256_set1_ps(_cvtsh_ss(bl->m));
    }
}

/* Elements 8s..8s+7 (s = 0..3) of block b. */
AI __m256 deq_step(const td_dtype WT, const char *row, int64_t b, const int s, __m256 d, __m256 m) {
    if (WT == TD_TYPE_Q8_0) {
        const td_block_q8_0 *bl = (const td_block_q8_0 *)row + b;
        __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(bl->qs + 8 * s)));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
    }
    const uint8_t *qs = WT == TD_TYPE_Q4_0 ? ((const td_block_q4_0 *)row + b)->qs
                                           : ((const td_block_q4_1 *)row + b)->qs;
    __m128i v = _mm_loadl_epi64((const __m128i *)(qs + 8 * (s & 1)));
    if (s >= 2) v = _mm_srli_epi16(v, 4);
    __m256i q = _mm256_cvtepu8_epi32(_mm_and_si128(v, _mm_set1_epi8(0x0f)));
    if (WT == TD_TYPE_Q4_0)
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(8))), d);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
}

AI void tile_store(const int R, const int T, __m256 acc[RR][TREG], float *y, size_t ldy) {
#pragma GCC unroll 8
    for (int t = 0; t < T; t++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) y[(size_t)t * ldy + (size_t)r] = hsum(acc[r][t]);
}

AI void kern_reg(const td_dtype WT, const int R, const int T, const char *w, size_t ws,
                 const float *x, size_t ldx, int64_t nb, float *y, size_t ldy) {
    __m256 acc[RR][TREG];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256 d[RR], m[RR];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            m[r] = _mm256_setzero_ps();
            block_dm(WT, w + (size_t)r * ws, b, &d[r], &m[r]);
        }
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++) {
            __m256 wv[RR];
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) wv[r] = deq_step(WT, w + (size_t)r * ws, b, s, d[r], m[r]);
#pragma GCC unroll 8
            for (int t = 0; t < T; t++) {
                __m256 xv = _mm256_loadu_ps(x + (size_t)t * ldx + (size_t)b * 32 + 8 * s);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
            }
        }
    }
    tile_store(R, T, acc, y, ldy);
}

AI void kern_buf(const int R, const int T, const float *wf, const float *x, size_t ldx, int64_t k,
                 float *y, size_t ldy) {
    __m256 acc[RR][TREG];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
        __m256 wv[RR];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) wv[r] = _mm256_load_ps(wf + (size_t)r * (size_t)k + i);
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            __m256 xv = _mm256_loadu_ps(x + (size_t)t * ldx + i);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
    tile_store(R, T, acc, y, ldy);
}

#define REG_CASE(WT, R, T)                                                                         \
    case (R)*8 + (T):                                                                              \
        kern_reg(WT, R, T, w, ws, x, ldx, nb, y, ldy);                                             \
        return;
#define REG_ROW(WT, R) REG_CASE(WT, R, 1) REG_CASE(WT, R, 2) REG_CASE(WT, R, 3)
#define DEF_REG(NAME, WT)                                                                          \
    static void NAME(int R, int T, const char *w, size_t ws, const float *x, size_t ldx,           \
                     int64_t nb, float *y, size_t ldy) {                                           \
        switch (R * 8 + T) { REG_ROW(WT, 1) default : abort(); }                                   \
    }
DEF_REG(reg_q40, TD_TYPE_Q4_0)
DEF_REG(reg_q41, TD_TYPE_Q4_1)
DEF_REG(reg_q80, TD_TYPE_Q8_0)

#define BUF_CASE(R, T)                                                                             \
    case (R)*8 + (T):                                                                              \
        kern_buf(R, T, wf, x, ldx, k, y, ldy);                                                     \
        return;
#define BUF_ROW(R) BUF_CASE(R, 1) BUF_CASE(R, 2)
static void run_buf(int R, int T, const float *wf, const float *x, size_t ldx, int64_t k, float *y,
                    size_t ldy) {
    switch (R * 8 + T) { BUF_ROW(1) BUF_ROW(2) BUF_ROW(3) BUF_ROW(4) default : abort(); }
}

AI void deq_rows(const td_dtype WT, const char *w, size_t ws, int R, int64_t k, float *wf) {
    for (int r = 0; r < R; r++) {
        const char *row = w + (size_t)r * ws;
        float *dst = wf + (size_t)r * (size_t)k;
        for (int64_t b = 0; b < k / 32; b++) {
            __m256 d, m = _mm256_setzero_ps();
            block_dm(WT, row, b, &d, &m);
            _mm256_store_ps(dst + b * 32, deq_step(WT, row, b, 0, d, m));
            _mm256_store_ps(dst + b * 32 + 8, deq_step(WT, row, b, 1, d, m));
            _mm256_store_ps(dst + b * 32 + 16, deq_step(WT, row, b, 2, d, m));
            _mm256_store_ps(dst + b * 32 + 24, deq_step(WT, row, b, 3, d, m));
        }
    }
}

static void deq_rows_any(td_dtype wt, const char *w, size_t ws, int R, int64_t k, float *wf) {
    switch (wt) {
    case TD_TYPE_Q4_0: deq_rows(TD_TYPE_Q4_0, w, ws, R, k, wf); return;
    case TD_TYPE_Q4_1: deq_rows(TD_TYPE_Q4_1, w, ws, R, k, wf); return;
    case TD_TYPE_Q8_0: deq_rows(TD_TYPE_Q8_0, w, ws, R, k, wf); return;
    default: TD_KERNEL_UNREACHABLE_TYPE(wt);
    }
}

void td_qmm_avx2(td_dtype wt, const void *w, size_t ws, const float *x, size_t ldx, int n,
                 int64_t k, float *y, size_t ldy, int r0, int r1) {
    const int64_t nb = k / 32;
    if (n < MIN_TB || k > TD_QMM_KMAX) {
        void (*reg)(int, int, const char *, size_t, const float *, size_t, int64_t, float *,
                    size_t) = wt == TD_TYPE_Q4_0   ? reg_q40
                              : wt == TD_TYPE_Q4_1 ? reg_q41
                              : wt == TD_TYPE_Q8_0 ? reg_q80
                                                   : NULL;
        if (!reg) TD_KERNEL_UNREACHABLE_TYPE(wt);
        for (int t = 0; t < n; t += TREG) {
            const int tt = n - t < TREG ? n - t : TREG;
            for (int r = r0; r < r1; r++) { /* one row: one sequential stream */
                reg(1, tt, (const char *)w + (size_t)r * ws, ws, x + (size_t)t * ldx, ldx, nb,
                    y + (size_t)t * ldy + (size_t)r, ldy);
            }
        }
        return;
    }
    int tchunk = (int)(XCHUNK / ((size_t)k * sizeof(float)));
    if (tchunk < TBUF) tchunk = TBUF;
    tchunk -= tchunk % TBUF;
    float *wf = g_wf;
    for (int tc = 0; tc < n; tc += tchunk) {
        const int te = n - tc < tchunk ? n : tc + tchunk;
        for (int r = r0; r < r1; r += RR) {
            const int rr = r1 - r < RR ? r1 - r : RR;
            deq_rows_any(wt, (const char *)w + (size_t)r * ws, ws, rr, k, wf);
            for (int t = tc; t < te; t += TBUF) {
                const int tt = te - t < TBUF ? te - t : TBUF;
                run_buf(rr, tt, wf, x + (size_t)t * ldx, ldx, k, y + (size_t)t * ldy + (size_t)r,
                        ldy);
            }
        }
    }
}
