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

/* The fp16 at p (any alignment), by F16C: exact, as td_cpu_h2f. */
AI float h2f(const char *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

AI int is_hibit(const td_dtype WT) {
    return WT == TD_TYPE_Q5_0 || WT == TD_TYPE_Q5_1 || WT == TD_TYPE_Q4_K || WT == TD_TYPE_Q5_K ||
           WT == TD_TYPE_Q6_K;
}

/* Start of group b (32 elements) of a row: the block holding it. */
AI const char *group_block(const td_dtype WT, const char *row, int64_t b) {
    const int64_t per = td_dtype_block_elems(WT) / 32;
    return row + (size_t)(b / per) * td_dtype_block_bytes(WT);
}

/* The per-group constants of group b: Q8_0/Q4_0/Q5_0 d; Q4_1/Q5_1 d and
 * m; Q4_K/Q5_K d*sc and -(dmin*m) of its sub-block (exact products, as
 * td_cpu_deq_group); Q6_K d*scale of its elements 0-15 in d, 16-31 in m. */
AI void block_dm(const td_dtype WT, const char *row, int64_t b, __m256 *d, __m256 *m) {
    if (WT == TD_TYPE_Q8_0) {
        *d = _mm256_set1_ps(_cvtsh_ss(((const td_block_q8_0 *)row + b)->d));
    } else if (WT == TD_TYPE_Q4_0) {
        *d = _mm256_set1_ps(_cvtsh_ss(((const td_block_q4_0 *)row + b)->d));
    } else if (WT == TD_TYPE_Q4_1) {
        const td_block_q4_1 *bl = (const td_block_q4_1 *)row + b;
        *d = _mm256_set1_ps(_cvtsh_ss(bl->d));
        *m = _mm256_set1_ps(_cvtsh_ss(bl->m));
    } else if (WT == TD_TYPE_Q5_0 || WT == TD_TYPE_Q5_1) {
        const char *bl = group_block(WT, row, b);
        *d = _mm256_set1_ps(h2f(bl));
        if (WT == TD_TYPE_Q5_1) *m = _mm256_set1_ps(h2f(bl + 2));
    } else if (WT == TD_TYPE_Q4_K || WT == TD_TYPE_Q5_K) {
        const char *bl = group_block(WT, row, b);
        int sc, mn;
        td_k_scale_min((const uint8_t *)bl + 4, (int)(b % 8), &sc, &mn);
        *d = _mm256_set1_ps(h2f(bl) * (float)sc);
        *m = _mm256_set1_ps(-(h2f(bl + 2) * (float)mn));
    } else { /* Q6_K */
        const char *bl = group_block(WT, row, b);
        const int8_t *sc = (const int8_t *)bl + 192 + 8 * ((int)(b % 8) / 4) + 2 * (int)(b % 4);
        const float d0 = h2f(bl + 208);
        *d = _mm256_set1_ps(d0 * (float)sc[0]);
        *m = _mm256_set1_ps(d0 * (float)sc[1]);
    }
}

/* The 8 bits of byte, each widened to a 32-bit lane as 16 (set) or 0. */
AI __m256i bits16(uint32_t byte) {
    const __m256i v =
        _mm256_srlv_epi32(_mm256_set1_epi32((int)byte), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(1)), 4);
}

/* Elements 8s..8s+7 of group b of the q5/K types (block_dm's d and m). */
AI __m256 deq_step_hibit(const td_dtype WT, const char *row, int64_t b, const int s, __m256 d,
                         __m256 m) {
    const char *bl = group_block(WT, row, b);
    const __m128i nib = _mm_set1_epi8(0x0f);
    if (WT == TD_TYPE_Q5_0 || WT == TD_TYPE_Q5_1) {
        const int q51 = WT == TD_TYPE_Q5_1;
        uint32_t qh;
        memcpy(&qh, bl + 2 + 2 * q51, 4);
        __m128i v = _mm_loadl_epi64((const __m128i *)(bl + 6 + 2 * q51 + 8 * (s & 1)));
        if (s >= 2) v = _mm_srli_epi16(v, 4);
        __m256i q = _mm256_add_epi32(_mm256_cvtepu8_epi32(_mm_and_si128(v, nib)),
                                     bits16((qh >> (8 * s)) & 0xff));
        if (q51) return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(16))), d);
    }
    if (WT == TD_TYPE_Q4_K || WT == TD_TYPE_Q5_K) {
        const int sub = (int)(b % 8);
        const char *qs = bl + 16 + (WT == TD_TYPE_Q5_K ? 32 : 0) + (sub / 2) * 32 + 8 * s;
        __m128i v = _mm_loadl_epi64((const __m128i *)qs);
        if (sub & 1) v = _mm_srli_epi16(v, 4);
        __m256i q = _mm256_cvtepu8_epi32(_mm_and_si128(v, nib));
        if (WT == TD_TYPE_Q5_K) {
            __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bl + 16 + 8 * s)));
            h = _mm256_and_si256(_mm256_srl_epi32(h, _mm_cvtsi32_si128(sub)), _mm256_set1_epi32(1));
            q = _mm256_add_epi32(q, _mm256_slli_epi32(h, 4));
        }
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
    }
    /* Q6_K */
    const int half = (int)(b % 8) / 4, g = (int)(b % 4);
    __m128i v = _mm_loadl_epi64((const __m128i *)(bl + 64 * half + 32 * (g & 1) + 8 * s));
    if (g >= 2) v = _mm_srli_epi16(v, 4);
    __m256i h =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bl + 128 + 32 * half + 8 * s)));
    h = _mm256_and_si256(_mm256_srl_epi32(h, _mm_cvtsi32_si128(2 * g)), _mm256_set1_epi32(3));
    __m256i q =
        _mm256_add_epi32(_mm256_cvtepu8_epi32(_mm_and_si128(v, nib)), _mm256_slli_epi32(h, 4));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(32))),
                         s < 2 ? d : m);
}

/* Elements 8s..8s+7 (s = 0..3) of block b. */
AI __m256 deq_step(const td_dtype WT, const char *row, int64_t b, const int s, __m256 d, __m256 m) {
    if (is_hibit(WT)) return deq_step_hibit(WT, row, b, s, d, m);
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
DEF_REG(reg_q50, TD_TYPE_Q5_0)
DEF_REG(reg_q51, TD_TYPE_Q5_1)
DEF_REG(reg_q4k, TD_TYPE_Q4_K)
DEF_REG(reg_q5k, TD_TYPE_Q5_K)
DEF_REG(reg_q6k, TD_TYPE_Q6_K)

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
            _mm256_storeu_ps(dst + b * 32, deq_step(WT, row, b, 0, d, m));
            _mm256_storeu_ps(dst + b * 32 + 8, deq_step(WT, row, b, 1, d, m));
            _mm256_storeu_ps(dst + b * 32 + 16, deq_step(WT, row, b, 2, d, m));
            _mm256_storeu_ps(dst + b * 32 + 24, deq_step(WT, row, b, 3, d, m));
        }
    }
}

static void deq_rows_any(td_dtype wt, const char *w, size_t ws, int R, int64_t k, float *wf) {
    switch (wt) {
    case TD_TYPE_Q4_0: deq_rows(TD_TYPE_Q4_0, w, ws, R, k, wf); return;
    case TD_TYPE_Q4_1: deq_rows(TD_TYPE_Q4_1, w, ws, R, k, wf); return;
    case TD_TYPE_Q8_0: deq_rows(TD_TYPE_Q8_0, w, ws, R, k, wf); return;
    case TD_TYPE_Q5_0: deq_rows(TD_TYPE_Q5_0, w, ws, R, k, wf); return;
    case TD_TYPE_Q5_1: deq_rows(TD_TYPE_Q5_1, w, ws, R, k, wf); return;
    case TD_TYPE_Q4_K: deq_rows(TD_TYPE_Q4_K, w, ws, R, k, wf); return;
    case TD_TYPE_Q5_K: deq_rows(TD_TYPE_Q5_K, w, ws, R, k, wf); return;
    case TD_TYPE_Q6_K: deq_rows(TD_TYPE_Q6_K, w, ws, R, k, wf); return;
    default: TD_KERNEL_UNREACHABLE_TYPE(wt);
    }
}

void td_qmm_avx2_dequant_row(td_dtype wt, const void *w, float *dst, int64_t k) {
    deq_rows_any(wt, w, 0, 1, k, dst);
}

void td_qmm_avx2(td_dtype wt, const void *w, size_t ws, const float *x, size_t ldx, int n,
                 int64_t k, float *y, size_t ldy, int r0, int r1) {
    const int64_t nb = k / 32;
    if (n < MIN_TB || k > TD_QMM_KMAX) {
        void (*reg)(int, int, const char *, size_t, const float *, size_t, int64_t, float *,
                    size_t) = wt == TD_TYPE_Q4_0   ? reg_q40
                              : wt == TD_TYPE_Q4_1 ? reg_q41
                              : wt == TD_TYPE_Q8_0 ? reg_q80
                              : wt == TD_TYPE_Q5_0 ? reg_q50
                              : wt == TD_TYPE_Q5_1 ? reg_q51
                              : wt == TD_TYPE_Q4_K ? reg_q4k
                              : wt == TD_TYPE_Q5_K ? reg_q5k
                              : wt == TD_TYPE_Q6_K ? reg_q6k
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
