/* AVX2 + FMA + F16C kernels.
 *
 * Matmul tiles: a tile computes R weight rows x T tokens. Every (row, token)
 * pair owns one vector accumulator that is updated once per block (quantized)
 * or per 8 elements (float) in k order, then reduced by the same horizontal
 * sum; tile shape only changes which pairs run side by side, never the
 * instruction sequence of a pair, so results do not depend on n, r0, r1. */
#include <immintrin.h>
#include <math.h>

#include "cpu-impl.h"

#define AI static inline __attribute__((always_inline))

AI float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for x in float range: range reduction by ln2, degree-6 polynomial
 * (max rel. error about 2e-7), exponent assembled with integer shifts. */
AI __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)),
                      _mm256_set1_ps(-87.3365447504f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    __m256 r2 = _mm256_mul_ps(r, r);
    p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n in two steps so that n = 128 (x near 88.7) does not overflow the exponent */
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i h = _mm256_srai_epi32(ni, 1);
    __m256 s1 =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, _mm256_set1_epi32(127)), 23));
    __m256 s2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

/* ---------------- quantized matmul ---------------- */

#define QR 2 /* rows per tile */
#define QT 4 /* tokens per tile */

AI __m256i unpack_q4(const uint8_t *qs) {
    __m128i x = _mm_loadu_si128((const __m128i *)qs);
    __m256i w = _mm256_set_m128i(_mm_srli_epi16(x, 4), x);
    return _mm256_and_si256(w, _mm256_set1_epi8(0x0f));
}

AI void tile_quant(const td_dtype WT, const int R, const int T, const char *w, size_t w_stride,
                   const char *xq, size_t xq_stride, int64_t nb, float *y, size_t ldy) {
    __m256 acc[QR][QT];
    const float *xd[QT], *xs[QT];
    const int32_t *xsum[QT];
    const int8_t *xqs[QT];
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) {
        const char *row = xq + (size_t)t * xq_stride;
        xd[t] = td_q8x_d(row);
        xs[t] = td_q8x_s(row, nb);
        xsum[t] = td_q8x_sum(row, nb);
        xqs[t] = td_q8x_qs(row, nb);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[r][t] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        __m256i wv[QR], aw[QR];
        __m256 dw[QR], mw[QR];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const char *wrow = w + (size_t)r * w_stride;
            if (WT == TD_TYPE_Q8_0) {
                const td_block_q8_0 *blk = (const td_block_q8_0 *)wrow + b;
                wv[r] = _mm256_loadu_si256((const __m256i *)blk->qs);
                aw[r] = _mm256_sign_epi8(wv[r], wv[r]);
                dw[r] = _mm256_set1_ps(_cvtsh_ss(blk->d));
            } else if (WT == TD_TYPE_Q4_0) {
                const td_block_q4_0 *blk = (const td_block_q4_0 *)wrow + b;
                wv[r] = unpack_q4(blk->qs);
                dw[r] = _mm256_set1_ps(_cvtsh_ss(blk->d));
            } else {
                const td_block_q4_1 *blk = (const td_block_q4_1 *)wrow + b;
                wv[r] = unpack_q4(blk->qs);
                dw[r] = _mm256_set1_ps(_cvtsh_ss(blk->d));
                mw[r] = _mm256_zextps128_ps256(_mm_set_ss(_cvtsh_ss(blk->m)));
            }
        }
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            __m256i xv = _mm256_loadu2_m128i((const __m128i *)(xqs[t] + td_q8x_pos(b, 16)),
                                             (const __m128i *)(xqs[t] + td_q8x_pos(b, 0)));
            __m256 dx = _mm256_set1_ps(xd[t][b]);
            __m256i init = _mm256_setzero_si256();
            __m256 sx = _mm256_setzero_ps();
            if (WT == TD_TYPE_Q4_0)
                init = _mm256_zextsi128_si256(_mm_cvtsi32_si128(-8 * xsum[t][b]));
            if (WT == TD_TYPE_Q4_1) sx = _mm256_set1_ps(xs[t][b]);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                __m256i p16;
                if (WT == TD_TYPE_Q8_0)
                    p16 = _mm256_maddubs_epi16(aw[r], _mm256_sign_epi8(xv, wv[r]));
                else
                    p16 = _mm256_maddubs_epi16(wv[r], xv);
                __m256i p32 = _mm256_madd_epi16(p16, ones);
                if (WT == TD_TYPE_Q4_0) p32 = _mm256_add_epi32(p32, init);
                __m256 f = _mm256_cvtepi32_ps(p32);
                acc[r][t] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw[r], dx), acc[r][t]);
                if (WT == TD_TYPE_Q4_1) acc[r][t] = _mm256_fmadd_ps(mw[r], sx, acc[r][t]);
            }
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; t++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) y[(size_t)t * ldy + r] = hsum256(acc[r][t]);
}

typedef void (*tile_fn)(const char *w, size_t w_stride, const char *xq, size_t xq_stride,
                        int64_t nb, float *y, size_t ldy);

#define DEF_TILE(NAME, WT, R, T)                                                                   \
    static void NAME##_##R##_##T(const char *w, size_t ws, const char *xq, size_t xs, int64_t nb,  \
                                 float *y, size_t ldy) {                                           \
        tile_quant(WT, R, T, w, ws, xq, xs, nb, y, ldy);                                           \
    }
#define DEF_TILES(NAME, WT)                                                                        \
    DEF_TILE(NAME, WT, 1, 1)                                                                       \
    DEF_TILE(NAME, WT, 1, 2)                                                                       \
    DEF_TILE(NAME, WT, 1, 3)                                                                       \
    DEF_TILE(NAME, WT, 1, 4)                                                                       \
    DEF_TILE(NAME, WT, 2, 1)                                                                       \
    DEF_TILE(NAME, WT, 2, 2)                                                                       \
    DEF_TILE(NAME, WT, 2, 3)                                                                       \
    DEF_TILE(NAME, WT, 2, 4)                                                                       \
    static const tile_fn NAME##_tiles[QR][QT] = {                                                  \
        {NAME##_1_1, NAME##_1_2, NAME##_1_3, NAME##_1_4},                                          \
        {NAME##_2_1, NAME##_2_2, NAME##_2_3, NAME##_2_4}};

DEF_TILES(q80, TD_TYPE_Q8_0)
DEF_TILES(q40, TD_TYPE_Q4_0)
DEF_TILES(q41, TD_TYPE_Q4_1)

/* ---------------- float-weight matmul ---------------- */

#define FR 4
#define FT 2

AI __m256 load_w8(const td_dtype WT, const void *p) {
    if (WT == TD_TYPE_F32) return _mm256_loadu_ps((const float *)p);
    if (WT == TD_TYPE_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

AI void tile_float(const td_dtype WT, const int R, const int T, const char *w, size_t w_stride,
                   const char *xq, size_t xq_stride, int64_t k, float *y, size_t ldy) {
    const size_t es = WT == TD_TYPE_F32 ? 4 : 2;
    __m256 acc[FR][FT];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        __m256 wv[FR];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) wv[r] = load_w8(WT, w + (size_t)r * w_stride + (size_t)i * es);
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            __m256 xv = _mm256_loadu_ps((const float *)(xq + (size_t)t * xq_stride) + i);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
    if (i < k) { /* tail: zero-padded copies, same update as a full step */
        int m = (int)(k - i);
        __m256 wv[FR];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            uint16_t tmp[16] = {0};
            memcpy(tmp, w + (size_t)r * w_stride + (size_t)i * es, (size_t)m * es);
            wv[r] = load_w8(WT, tmp);
        }
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            float tmp[8] = {0};
            memcpy(tmp, (const float *)(xq + (size_t)t * xq_stride) + i, (size_t)m * 4);
            __m256 xv = _mm256_loadu_ps(tmp);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; t++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) y[(size_t)t * ldy + r] = hsum256(acc[r][t]);
}

#define DEF_FTILE(NAME, WT, R, T)                                                                  \
    static void NAME##_##R##_##T(const char *w, size_t ws, const char *xq, size_t xs, int64_t k,   \
                                 float *y, size_t ldy) {                                           \
        tile_float(WT, R, T, w, ws, xq, xs, k, y, ldy);                                            \
    }
#define DEF_FTILES(NAME, WT)                                                                       \
    DEF_FTILE(NAME, WT, 1, 1)                                                                      \
    DEF_FTILE(NAME, WT, 1, 2)                                                                      \
    DEF_FTILE(NAME, WT, 2, 1)                                                                      \
    DEF_FTILE(NAME, WT, 2, 2)                                                                      \
    DEF_FTILE(NAME, WT, 3, 1)                                                                      \
    DEF_FTILE(NAME, WT, 3, 2)                                                                      \
    DEF_FTILE(NAME, WT, 4, 1)                                                                      \
    DEF_FTILE(NAME, WT, 4, 2)                                                                      \
    static const tile_fn NAME##_tiles[FR][FT] = {{NAME##_1_1, NAME##_1_2},                         \
                                                 {NAME##_2_1, NAME##_2_2},                         \
                                                 {NAME##_3_1, NAME##_3_2},                         \
                                                 {NAME##_4_1, NAME##_4_2}};

DEF_FTILES(f32, TD_TYPE_F32)
DEF_FTILES(f16, TD_TYPE_F16)
DEF_FTILES(bf16, TD_TYPE_BF16)

/* ---------------- Q4 weights, four blocks per step ----------------
 *
 * For k <= 32768 Q4_0 / Q4_1 use the activation row's groups of four blocks
 * (elements 0-15 of blocks b..b+3, then 16-31): with L/H the low / high
 * nibbles of two blocks [b | b+1] and X0..X3 the four 32-byte pieces,
 *   u  = madd(maddubs(L01, X0) + maddubs(H01, X2), 1)    blocks b, b+1
 *   v  = madd(maddubs(L23, X1) + maddubs(H23, X3), 1)    blocks b+2, b+3
 *   p  = hadd(u, v) (+ seed: -8 * sum(q_x) for Q4_0)     lanes [b b b+2 b+2 | b+1 b+1 b+3 b+3]
 *   acc = fma(cvt(p), dw * dx, acc)
 * and Q4_1 adds, per 8 blocks, acc = fma(m_w, d_x * sum(q_x), acc) (lane
 * order of the blocks, then the usual horizontal sum). Rows are unpacked and
 * token scales laid out once per token chunk, whatever n is, so there is
 * one code path. maddubs cannot saturate: 2 * 15 * 127 * 2 < 32767. */

#define S4_MAX_STEPS 256  /* k <= 32768 */
#define S4_XVECS     2048 /* token-step vectors per chunk (64 KiB) */
#define S4_T         4

typedef struct {
    __m256i w[S4_MAX_STEPS][4]; /* L01 H01 L23 H23 */
    __m256 d[S4_MAX_STEPS];
    float m[4 * S4_MAX_STEPS + 4];
} s4_row;

static const int32_t k_s4_lane_block[8] = {0, 0, 2, 2, 1, 1, 3, 3};

/* Unsigned nibbles and lane scales of blocks b..b+3 (n valid) of a row;
 * Q4_1 mins to m4[0..4) (0 for missing blocks). */
static inline __attribute__((always_inline)) void s4_w_step(const td_dtype WT, const char *wrow,
                                                            int64_t b, int n, __m256i *wv,
                                                            __m256 *dw, float *m4) {
    const size_t bs = WT == TD_TYPE_Q4_0 ? sizeof(td_block_q4_0) : sizeof(td_block_q4_1);
    const size_t qo =
        WT == TD_TYPE_Q4_0 ? offsetof(td_block_q4_0, qs) : offsetof(td_block_q4_1, qs);
    const __m256i nib = _mm256_set1_epi8(0x0f);
    const __m256i idx = _mm256_loadu_si256((const __m256i *)k_s4_lane_block);
    const char *p0 = wrow + (size_t)b * bs;
    if (n == 4) {
        __m256i w01 =
            _mm256_loadu2_m128i((const __m128i *)(p0 + bs + qo), (const __m128i *)(p0 + qo));
        __m256i w23 = _mm256_loadu2_m128i((const __m128i *)(p0 + 3 * bs + qo),
                                          (const __m128i *)(p0 + 2 * bs + qo));
        wv[0] = _mm256_and_si256(w01, nib);
        wv[1] = _mm256_and_si256(_mm256_srli_epi16(w01, 4), nib);
        wv[2] = _mm256_and_si256(w23, nib);
        wv[3] = _mm256_and_si256(_mm256_srli_epi16(w23, 4), nib);
        if (WT == TD_TYPE_Q4_1) {
            uint32_t x0, x1, x2, x3; /* (d, m) pairs */
            memcpy(&x0, p0, 4);
            memcpy(&x1, p0 + bs, 4);
            memcpy(&x2, p0 + 2 * bs, 4);
            memcpy(&x3, p0 + 3 * bs, 4);
            __m256 v = _mm256_cvtph_ps(_mm_setr_epi32((int)x0, (int)x1, (int)x2, (int)x3));
            *dw = _mm256_permutevar8x32_ps(v, _mm256_slli_epi32(idx, 1));
            _mm_storeu_ps(m4, _mm256_castps256_ps128(_mm256_permutevar8x32_ps(
                                  v, _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7))));
        } else {
            uint16_t d0, d1, d2, d3;
            memcpy(&d0, p0, 2);
            memcpy(&d1, p0 + bs, 2);
            memcpy(&d2, p0 + 2 * bs, 2);
            memcpy(&d3, p0 + 3 * bs, 2);
            __m128 v = _mm_cvtph_ps(
                _mm_setr_epi16((short)d0, (short)d1, (short)d2, (short)d3, 0, 0, 0, 0));
            *dw = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), idx);
        }
        return;
    }
    __m128i q[4];
    float d[4], m[4];
    for (int i = 0; i < 4; i++) {
        const char *blk = p0 + (size_t)i * bs;
        if (i < n) {
            td_fp16 h;
            q[i] = _mm_loadu_si128((const __m128i *)(blk + qo));
            memcpy(&h, blk, 2);
            d[i] = _cvtsh_ss(h);
            m[i] = 0.0f;
            if (WT == TD_TYPE_Q4_1) {
                memcpy(&h, blk + 2, 2);
                m[i] = _cvtsh_ss(h);
            }
        } else {
            q[i] = _mm_setzero_si128();
            d[i] = m[i] = 0.0f;
        }
    }
    __m256i w01 = _mm256_set_m128i(q[1], q[0]), w23 = _mm256_set_m128i(q[3], q[2]);
    wv[0] = _mm256_and_si256(w01, nib);
    wv[1] = _mm256_and_si256(_mm256_srli_epi16(w01, 4), nib);
    wv[2] = _mm256_and_si256(w23, nib);
    wv[3] = _mm256_and_si256(_mm256_srli_epi16(w23, 4), nib);
    *dw = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(d)), idx);
    if (WT == TD_TYPE_Q4_1) memcpy(m4, m, sizeof(m));
}

static void s4_row_fill(td_dtype wt, const char *wrow, int64_t nb, s4_row *rb) {
    for (int64_t b = 0; b < nb; b += 4) {
        const int n = nb - b < 4 ? (int)(nb - b) : 4;
        if (wt == TD_TYPE_Q4_0)
            s4_w_step(TD_TYPE_Q4_0, wrow, b, n, rb->w[b / 4], &rb->d[b / 4], rb->m + b);
        else
            s4_w_step(TD_TYPE_Q4_1, wrow, b, n, rb->w[b / 4], &rb->d[b / 4], rb->m + b);
    }
    /* mins past nb are read 8 at a time */
    for (int64_t b = (nb + 3) / 4 * 4; b < (nb + 7) / 8 * 8; b++) rb->m[b] = 0.0f;
}

/* Per token and step: dx laid out like the lanes of p, then (Q4_0) the seed. */
static void s4_x_fill(td_dtype wt, const char *xq, size_t xq_stride, int n, int64_t nb,
                      __m256 *xb) {
    const __m256i idx = _mm256_loadu_si256((const __m256i *)k_s4_lane_block);
    for (int t = 0; t < n; t++) {
        const char *row = xq + (size_t)t * xq_stride;
        const float *xd = td_q8x_d(row);
        const int32_t *xsum = td_q8x_sum(row, nb);
        for (int64_t b = 0; b < nb; b += 4) {
            const int nv = nb - b < 4 ? (int)(nb - b) : 4;
            float d[4] = {0, 0, 0, 0};
            int32_t sm[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int i = 0; i < nv; i++) d[i] = xd[b + i];
            *xb++ = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(d)), idx);
            if (wt == TD_TYPE_Q4_0) {
                /* one seed per block, in its first lane */
                static const int lane[4] = {0, 4, 2, 6};
                for (int i = 0; i < nv; i++) sm[lane[i]] = -8 * xsum[b + i];
                *xb++ = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)sm));
            }
        }
    }
}

static inline __attribute__((always_inline)) void
s4_tile(const td_dtype WT, const int T, const int BUF, const char *wrow, const s4_row *rb,
        const __m256 *xb, int64_t nsteps, const char *xq, size_t xq_stride, int64_t nb, float *y,
        size_t ldy) {
    const int NV = WT == TD_TYPE_Q4_0 ? 2 : 1;
    float mloc[BUF ? 8 : 4 * S4_MAX_STEPS + 8]; /* Q4_1 mins of the direct path */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[S4_T];
    const int8_t *xqs[S4_T];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
        acc[t] = _mm256_setzero_ps();
        xqs[t] = td_q8x_qs(xq + (size_t)t * xq_stride, nb);
    }
    for (int64_t s = 0; s < nsteps; s++) {
        __m256i wv[4];
        __m256 dw;
        if (BUF) {
            wv[0] = rb->w[s][0], wv[1] = rb->w[s][1], wv[2] = rb->w[s][2], wv[3] = rb->w[s][3];
            dw = rb->d[s];
        } else {
            s4_w_step(WT, wrow, 4 * s, nb - 4 * s < 4 ? (int)(nb - 4 * s) : 4, wv, &dw,
                      mloc + (BUF ? 0 : 4 * s));
        }
        const __m256i l01 = wv[0], h01 = wv[1], l23 = wv[2], h23 = wv[3];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const __m256i *x = (const __m256i *)(xqs[t] + s * 128);
            const __m256 *v = xb + ((size_t)t * nsteps + s) * NV;
            __m256i u = _mm256_add_epi16(_mm256_maddubs_epi16(l01, _mm256_loadu_si256(x)),
                                         _mm256_maddubs_epi16(h01, _mm256_loadu_si256(x + 2)));
            __m256i w = _mm256_add_epi16(_mm256_maddubs_epi16(l23, _mm256_loadu_si256(x + 1)),
                                         _mm256_maddubs_epi16(h23, _mm256_loadu_si256(x + 3)));
            __m256i p = _mm256_hadd_epi32(_mm256_madd_epi16(u, ones), _mm256_madd_epi16(w, ones));
            if (WT == TD_TYPE_Q4_0) p = _mm256_add_epi32(p, _mm256_castps_si256(v[1]));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, v[0]), acc[t]);
        }
    }
    if (WT == TD_TYPE_Q4_1) {
        for (int64_t b = 0; b < nb; b += 8) {
            const int c = nb - b < 8 ? (int)(nb - b) : 8;
            __m256 mv;
            if (BUF) {
                mv = _mm256_loadu_ps(rb->m + b); /* zero past nb */
            } else {
                for (int i = c; i < 8; i++) mloc[b + i] = 0.0f;
                mv = _mm256_loadu_ps(mloc + b);
            }
            const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(c), lanes);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                const float *sp = td_q8x_s(xq + (size_t)t * xq_stride, nb) + b;
                __m256 sv = c == 8 ? _mm256_loadu_ps(sp) : _mm256_maskload_ps(sp, mask);
                acc[t] = _mm256_fmadd_ps(mv, sv, acc[t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) y[(size_t)t * ldy] = hsum256(acc[t]);
}

typedef void (*s4_fn)(const char *wrow, const s4_row *rb, const __m256 *xb, int64_t nsteps,
                      const char *xq, size_t xq_stride, int64_t nb, float *y, size_t ldy);
#define DEF_S4(NAME, WT, T)                                                                        \
    static void NAME##_##T(const char *wrow, const s4_row *rb, const __m256 *xb, int64_t nsteps,   \
                           const char *xq, size_t xs, int64_t nb, float *y, size_t ldy) {          \
        s4_tile(WT, T, 1, wrow, rb, xb, nsteps, xq, xs, nb, y, ldy);                               \
    }                                                                                              \
    static void NAME##_d##T(const char *wrow, const s4_row *rb, const __m256 *xb, int64_t nsteps,  \
                            const char *xq, size_t xs, int64_t nb, float *y, size_t ldy) {         \
        s4_tile(WT, T, 0, wrow, rb, xb, nsteps, xq, xs, nb, y, ldy);                               \
    }
DEF_S4(s4q40, TD_TYPE_Q4_0, 1)
DEF_S4(s4q40, TD_TYPE_Q4_0, 2)
DEF_S4(s4q40, TD_TYPE_Q4_0, 3)
DEF_S4(s4q40, TD_TYPE_Q4_0, 4)
DEF_S4(s4q41, TD_TYPE_Q4_1, 1)
DEF_S4(s4q41, TD_TYPE_Q4_1, 2)
DEF_S4(s4q41, TD_TYPE_Q4_1, 3)
DEF_S4(s4q41, TD_TYPE_Q4_1, 4)
/* [buffered][tokens - 1] */
static const s4_fn s4q40_tiles[2][S4_T] = {{s4q40_d1, s4q40_d2, s4q40_d3, s4q40_d4},
                                           {s4q40_1, s4q40_2, s4q40_3, s4q40_4}};
static const s4_fn s4q41_tiles[2][S4_T] = {{s4q41_d1, s4q41_d2, s4q41_d3, s4q41_d4},
                                           {s4q41_1, s4q41_2, s4q41_3, s4q41_4}};

static void matmul_s4_avx2(td_dtype wt, const void *w, size_t w_stride, const void *xq,
                           size_t xq_stride, int n, int64_t k, float *y, size_t ldy, int r0,
                           int r1) {
    const s4_fn(*tiles)[S4_T] = wt == TD_TYPE_Q4_0 ? s4q40_tiles : s4q41_tiles;
    const int64_t nb = k / 32, nsteps = (nb + 3) / 4;
    const int nv = wt == TD_TYPE_Q4_0 ? 2 : 1;
    int tchunk = (int)(S4_XVECS / (nsteps * nv));
    size_t act_bytes = xq_stride ? xq_stride : 1;
    if ((size_t)tchunk * act_bytes > 256 * 1024) tchunk = (int)((256 * 1024) / act_bytes);
    if (tchunk < 1) tchunk = 1;
    _Alignas(32) s4_row rb;
    _Alignas(32) __m256 xb[S4_XVECS];
    for (int tc = 0; tc < n; tc += tchunk) {
        int te = tc + tchunk < n ? tc + tchunk : n;
        s4_x_fill(wt, (const char *)xq + (size_t)tc * xq_stride, xq_stride, te - tc, nb, xb);
        /* unpack a row once when several token tiles reuse it */
        const int buf = te - tc > S4_T;
        for (int r = r0; r < r1; r++) {
            const char *wr = (const char *)w + (size_t)r * w_stride;
            if (buf) s4_row_fill(wt, wr, nb, &rb);
            for (int t = tc; t < te; t += S4_T) {
                int tt = te - t < S4_T ? te - t : S4_T;
                tiles[buf][tt - 1](wr, &rb, xb + (size_t)(t - tc) * nsteps * nv, nsteps,
                                   (const char *)xq + (size_t)t * xq_stride, xq_stride, nb,
                                   y + (size_t)t * ldy + r, ldy);
            }
        }
    }
}

/* The q5 and K types (--act-int8): each weight row is unpacked once per
 * call (td_cpu_q8w_group: q - off as int8, the per-16 scales) and dotted
 * with every token; one accumulator per (row, token) pair in k order and a
 * fixed reduction, so batching and row splits never change a result. Not
 * tuned: the unpack is scalar. */
typedef struct {
    int8_t q[32];
    __m256 d; /* d[0] in lanes 0-3 (elements 0-15), d[1] in 4-7 */
    float m;
} q8w_avx2;

static void matmul_q8w_avx2(td_dtype wt, const void *w, size_t w_stride, const void *xq,
                            size_t xq_stride, int n, int64_t k, float *y, size_t ldy, int r0,
                            int r1) {
    const int64_t nb = k / 32;
    if (nb == 0) return;
    q8w_avx2 *g = aligned_alloc(32, sizeof(q8w_avx2) * (size_t)nb);
    if (!g) abort(); /* a few KiB per row of k */
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = r0; r < r1; r++) {
        const char *wr = (const char *)w + (size_t)r * w_stride;
        for (int64_t b = 0; b < nb; b++) {
            td_q8w_group u;
            td_cpu_q8w_group(wt, wr, b, &u);
            for (int j = 0; j < 32; j++) g[b].q[j] = (int8_t)(u.q[j] - u.off);
            g[b].d = _mm256_setr_m128(_mm_set1_ps(u.d[0]), _mm_set1_ps(u.d[1]));
            g[b].m = u.m;
        }
        for (int t = 0; t < n; t++) {
            const char *row = (const char *)xq + (size_t)t * xq_stride;
            const float *xd = td_q8x_d(row), *xs = td_q8x_s(row, nb);
            const int8_t *xqs = td_q8x_qs(row, nb);
            __m256 acc = _mm256_setzero_ps();
            float accm = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                __m256i wv = _mm256_loadu_si256((const __m256i *)g[b].q);
                __m256i xv = _mm256_loadu2_m128i((const __m128i *)(xqs + td_q8x_pos(b, 16)),
                                                 (const __m128i *)(xqs + td_q8x_pos(b, 0)));
                __m256i p16 =
                    _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
                __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
                acc = _mm256_fmadd_ps(f, _mm256_mul_ps(g[b].d, _mm256_set1_ps(xd[b])), acc);
                accm += g[b].m * xs[b];
            }
            y[(size_t)t * ldy + r] = hsum256(acc) + accm;
        }
    }
    free(g);
}

/* Tokens are taken in chunks whose activations stay in L2 while every row
 * tile of the range sweeps them. */
void td_cpu_matmul_avx2(td_dtype wt, const void *w, size_t w_stride, const void *xq,
                        size_t xq_stride, int n, int64_t k, float *y, size_t ldy, int r0, int r1) {
    const tile_fn *tiles;
    int R, T;
    int64_t kk = k;
    if ((wt == TD_TYPE_Q4_0 || wt == TD_TYPE_Q4_1) && k / 32 <= 4 * S4_MAX_STEPS) {
        matmul_s4_avx2(wt, w, w_stride, xq, xq_stride, n, k, y, ldy, r0, r1);
        return;
    }
    switch (wt) {
    case TD_TYPE_Q8_0: tiles = &q80_tiles[0][0], R = QR, T = QT, kk = k / 32; break;
    case TD_TYPE_Q4_0: tiles = &q40_tiles[0][0], R = QR, T = QT, kk = k / 32; break;
    case TD_TYPE_Q4_1: tiles = &q41_tiles[0][0], R = QR, T = QT, kk = k / 32; break;
    case TD_TYPE_F32: tiles = &f32_tiles[0][0], R = FR, T = FT; break;
    case TD_TYPE_F16: tiles = &f16_tiles[0][0], R = FR, T = FT; break;
    case TD_TYPE_BF16: tiles = &bf16_tiles[0][0], R = FR, T = FT; break;
    case TD_TYPE_Q5_0:
    case TD_TYPE_Q5_1:
    case TD_TYPE_Q4_K:
    case TD_TYPE_Q5_K:
    case TD_TYPE_Q6_K:
        matmul_q8w_avx2(wt, w, w_stride, xq, xq_stride, n, k, y, ldy, r0, r1);
        return;
    default: TD_KERNEL_UNREACHABLE_TYPE(wt);
    }
    size_t act_bytes = xq_stride ? xq_stride : 1;
    int tchunk = (int)((256 * 1024) / act_bytes);
    if (tchunk < T) tchunk = T;
    tchunk -= tchunk % T;
    for (int tc = 0; tc < n; tc += tchunk) {
        int te = tc + tchunk < n ? tc + tchunk : n;
        for (int r = r0; r < r1; r += R) {
            int rr = r1 - r < R ? r1 - r : R;
            const char *wr = (const char *)w + (size_t)r * w_stride;
            for (int t = tc; t < te; t += T) {
                int tt = te - t < T ? te - t : T;
                tiles[(rr - 1) * T + (tt - 1)](wr, w_stride,
                                               (const char *)xq + (size_t)t * xq_stride, xq_stride,
                                               kk, y + (size_t)t * ldy + r, ldy);
            }
        }
    }
}

/* ---------------- elementwise ---------------- */

void td_cpu_rmsnorm_avx2(const float *x, const float *w, float *out, int64_t n, float eps) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum256(acc);
    for (; i < n; i++) ss += x[i] * x[i];
    float r = (float)(1.0 / sqrt((double)ss / (double)n + (double)eps));
    __m256 rv = _mm256_set1_ps(r);
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), rv);
        if (w) v = _mm256_mul_ps(v, _mm256_loadu_ps(w + i));
        _mm256_storeu_ps(out + i, v);
    }
    for (; i < n; i++) out[i] = w ? x[i] * r * w[i] : x[i] * r;
}

void td_cpu_swiglu_avx2(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
        __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

void td_cpu_add_avx2(const float *a, const float *b, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    for (; i < n; i++) out[i] = a[i] + b[i];
}

void td_cpu_scale_avx2(float *x, float s, int64_t n) {
    int64_t i = 0;
    __m256 sv = _mm256_set1_ps(s);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), sv));
    for (; i < n; i++) x[i] *= s;
}

void td_cpu_softmax_avx2(float *x, int64_t n) {
    if (n <= 0) return;
    float mx = x[0];
    for (int64_t i = 1; i < n; i++) mx = fmaxf(mx, x[i]);
    __m256 mv = _mm256_set1_ps(mx), sv = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
        _mm256_storeu_ps(x + i, e);
        sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum256(sv);
    for (; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    td_cpu_scale_avx2(x, 1.0f / sum, n);
}

/* 8 KV elements from element i of row (of dtype dt), widened exactly. */
AI __m256 ld8_kv(const char *row, int i, const td_dtype dt) {
    switch (dt) {
    case TD_TYPE_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * i)));
    case TD_TYPE_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * i))), 16));
    default: return _mm256_loadu_ps((const float *)row + i);
    }
}

/* F16 by F16C (round to nearest even: the bits of td_f32_to_fp16), BF16 by
 * the same integer rounding as td_f32_to_bf16, lane by lane. */
void td_cpu_kv_store_avx2(td_dtype t, const float *src, void *dst, int64_t n) {
    int64_t i = 0;
    if (t == TD_TYPE_F16) {
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)((td_fp16 *)dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    } else if (t == TD_TYPE_BF16) {
        const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff),
                      absm = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000),
                      qnan = _mm256_set1_epi32(0x400000);
        for (; i + 8 <= n; i += 8) {
            __m256i x = _mm256_castps_si256(_mm256_loadu_ps(src + i));
            __m256i r = _mm256_add_epi32(
                x, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(x, 16), one)));
            __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, absm), inf);
            r = _mm256_blendv_epi8(r, _mm256_or_si256(x, qnan), nan);
            r = _mm256_srli_epi32(r, 16); /* 8 x u16 in the low halves */
            __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
            _mm_storeu_si128((__m128i *)((td_bf16 *)dst + i), _mm_packus_epi32(lo, hi));
        }
    }
    if (i < n) td_cpu_quant_row(t, src + i, (char *)dst + (size_t)i * td_cpu_kv_es(t), n - i);
}

/* head_dim is a multiple of 8 for every supported model; other sizes take a
 * scalar tail. Positions are walked block by block (no division). */
AI void attn_paged_avx2(const float *q, const td_cpu_kv_layer *kv, int kv_head,
                        const int32_t *block_table, int n_ctx, float scale, float *out,
                        float *scratch, const td_dtype dt) {
    const int hd = kv->head_dim, bs = kv->block_size;
    const int hv = hd & ~7;
    const size_t es = td_cpu_kv_es(dt), tok_bytes = (size_t)kv->n_kv_heads * hd * es;
    const char *kbase = (const char *)kv->k + (size_t)kv_head * hd * es;
    const char *vbase = (const char *)kv->v + (size_t)kv_head * hd * es;
    int blk = 0, slot = 0;
    for (int p = 0; p < n_ctx; p++) {
        const char *k = kbase + ((size_t)block_table[blk] * bs + slot) * tok_bytes;
        if (++slot == bs) slot = 0, blk++;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int i = 0;
        for (; i + 16 <= hv; i += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), ld8_kv(k, i, dt), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), ld8_kv(k, i + 8, dt), a1);
        }
        for (; i < hv; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), ld8_kv(k, i, dt), a0);
        float s = hsum256(_mm256_add_ps(a0, a1));
        for (; i < hd; i++) s += q[i] * td_cpu_kv_elem(k, (size_t)i, dt);
        scratch[p] = s * scale;
    }
    td_cpu_softmax_avx2(scratch, n_ctx);
    int i = 0;
    for (; i + 32 <= hv; i += 32) { /* 4 accumulators: positions in order for each lane */
        __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
        blk = 0, slot = 0;
        for (int p = 0; p < n_ctx; p++) {
            const char *v = vbase + ((size_t)block_table[blk] * bs + slot) * tok_bytes;
            if (++slot == bs) slot = 0, blk++;
            __m256 a = _mm256_set1_ps(scratch[p]);
            o0 = _mm256_fmadd_ps(a, ld8_kv(v, i, dt), o0);
            o1 = _mm256_fmadd_ps(a, ld8_kv(v, i + 8, dt), o1);
            o2 = _mm256_fmadd_ps(a, ld8_kv(v, i + 16, dt), o2);
            o3 = _mm256_fmadd_ps(a, ld8_kv(v, i + 24, dt), o3);
        }
        _mm256_storeu_ps(out + i, o0);
        _mm256_storeu_ps(out + i + 8, o1);
        _mm256_storeu_ps(out + i + 16, o2);
        _mm256_storeu_ps(out + i + 24, o3);
    }
    for (; i + 8 <= hv; i += 8) {
        __m256 o0 = _mm256_setzero_ps();
        blk = 0, slot = 0;
        for (int p = 0; p < n_ctx; p++) {
            const char *v = vbase + ((size_t)block_table[blk] * bs + slot) * tok_bytes;
            if (++slot == bs) slot = 0, blk++;
            o0 = _mm256_fmadd_ps(_mm256_set1_ps(scratch[p]), ld8_kv(v, i, dt), o0);
        }
        _mm256_storeu_ps(out + i, o0);
    }
    for (; i < hd; i++) {
        float o = 0.0f;
        blk = 0, slot = 0;
        for (int p = 0; p < n_ctx; p++) {
            const char *v = vbase + ((size_t)block_table[blk] * bs + slot) * tok_bytes;
            if (++slot == bs) slot = 0, blk++;
            o += scratch[p] * td_cpu_kv_elem(v, (size_t)i, dt);
        }
        out[i] = o;
    }
}

void td_cpu_attn_paged_avx2(const float *q, const td_cpu_kv_layer *kv, int kv_head,
                            const int32_t *block_table, int n_ctx, float scale, float *out,
                            float *scratch) {
#define CALL(dt) attn_paged_avx2(q, kv, kv_head, block_table, n_ctx, scale, out, scratch, dt)
    TD_KV_DTYPE_SWITCH(kv->dtype, CALL);
#undef CALL
}

const td_cpu_ops td_cpu_ops_avx2 = {
    .matmul = td_cpu_matmul_avx2,
    .act_quant = td_cpu_act_quant_scalar,
    .rmsnorm = td_cpu_rmsnorm_avx2,
    .swiglu = td_cpu_swiglu_avx2,
    .add = td_cpu_add_avx2,
    .scale = td_cpu_scale_avx2,
    .softmax = td_cpu_softmax_avx2,
    .kv_store = td_cpu_kv_store_avx2,
    .attn_paged = td_cpu_attn_paged_avx2,
};
