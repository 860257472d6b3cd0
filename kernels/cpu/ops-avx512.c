/* AVX-512 (F/BW/VL/DQ + VNNI) kernels.
 *
 * Quantized matmul on int8 activations (--act-int8, every quantized type):
 * a step covers four 32-element blocks, weights unpacked to unsigned bytes
 * and multiplied with vpdpbusd, offsets folded in the accumulator seed (the
 * section below says how each type goes).
 *
 * As in the AVX2 file, each (row, token) pair owns one accumulator that is
 * updated once per step in k order and reduced by one fixed horizontal sum,
 * so tiling never changes a pair's arithmetic. */
#include <immintrin.h>
#include <math.h>

#include "avx512-impl.h"
#include "cpu-impl.h"

#define AI static inline __attribute__((always_inline))

/* Reduce acc[r][t] for an R x T tile into y (row r, token t at y[t*ldy + r]). */
#define TILE_STORE(ACC, R, T, y, ldy)                                                              \
    do {                                                                                           \
        if ((R) == 4) {                                                                            \
            _Pragma("GCC unroll 8") for (int t_ = 0; t_ < (T); t_++) {                             \
                hsum512x4(ACC[0][t_], ACC[1][t_], ACC[2][t_], ACC[3][t_],                          \
                          (y) + (size_t)t_ * (ldy));                                               \
            }                                                                                      \
        } else {                                                                                   \
            _Pragma("GCC unroll 8") for (int t_ = 0; t_ < (T); t_++) {                             \
                _Pragma("GCC unroll 8") for (int r_ = 0; r_ < (R); r_++)(                          \
                    y)[(size_t)t_ * (ldy) + r_] = hsum512(ACC[r_][t_]);                            \
            }                                                                                      \
        }                                                                                          \
    } while (0)

AI __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)),
                      _mm512_set1_ps(-87.3365447504f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    __m512 r2 = _mm512_mul_ps(r, r);
    p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    /* p * 2^n, exact scaling with gradual underflow */
    return _mm512_scalef_ps(p, n);
}

/* ---------------- quantized matmul ----------------
 *
 * A "step" covers four 32-element blocks b..b+3 of a (row, token) pair. The
 * activation row stores elements 0-15 of the four blocks in one 64-byte
 * vector (xa) and elements 16-31 in the next (xb), the same split as Q4
 * nibbles, so with wa/wb the matching unsigned weight bytes
 *   p   = vpdpbusd(vpdpbusd(seed, wa, xa), wb, xb)   lanes 4i..4i+3: block b+i
 *   acc = fma(cvt(p), dw * dx, acc)                  dw, dx laid out alike
 * Q4_0 (q - 8), Q5_0 (q - 16) and Q8_0 (w + 128, to make it unsigned) fold
 * their offset in the integer seed (-8, -16 or -128 times sum(q_x), in lane
 * 4i). The types with a min (Q4_1, Q5_1, Q4_K, Q5_K: d*q + m, a K block's
 * d*sc and -dmin*m per 32-element sub-block) then add, per 16 blocks of a
 * 1024-block chunk, acc = fma(m_w, d_x * sum(q_x), acc). Q6_K has a scale
 * per 16 elements, so wa and wb get one each (dw, dw2) and a seed each
 * (-32 times each lane's four q_x):
 *   acc = fma(fma(cvt(pa), dw, cvt(pb) * dw2), dx, acc)
 * y = hsum(acc).
 * Blocks past nb have zero weights and zero scales. */

#define TR_MAX 4 /* max rows per tile */
#define TT_MAX 4 /* max tokens per tile */
#define QR     TR_MAX
#define QT     TT_MAX
#ifndef QTILE_R /* tile used for full tiles; -D to experiment */
#define QTILE_R 4
#define QTILE_T 3
#endif

/* lane j of a step -> block offset j / 4 */
#define IDX_STEP _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)

/* One step of one weight row: blocks b..b+3 (n valid, 1..4): wa = elements
 * 0-15 of each block, wb = elements 16-31, unsigned. Q4_1 mins go to
 * m4[0..4). */
AI void load_w_step_full(const td_dtype WT, const char *wrow, int64_t b, __m512i *wa, __m512i *wb,
                         __m512 *dw, float *m4) {
    if (WT == TD_TYPE_Q8_0) {
        const td_block_q8_0 *bl = (const td_block_q8_0 *)wrow + b;
        __m512i lo = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)bl[0].qs));
        __m512i hi = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(bl[0].qs + 16)));
        lo = _mm512_inserti32x4(lo, _mm_loadu_si128((const __m128i *)bl[1].qs), 1);
        hi = _mm512_inserti32x4(hi, _mm_loadu_si128((const __m128i *)(bl[1].qs + 16)), 1);
        lo = _mm512_inserti32x4(lo, _mm_loadu_si128((const __m128i *)bl[2].qs), 2);
        hi = _mm512_inserti32x4(hi, _mm_loadu_si128((const __m128i *)(bl[2].qs + 16)), 2);
        lo = _mm512_inserti32x4(lo, _mm_loadu_si128((const __m128i *)bl[3].qs), 3);
        hi = _mm512_inserti32x4(hi, _mm_loadu_si128((const __m128i *)(bl[3].qs + 16)), 3);
        const __m512i sign = _mm512_set1_epi8(-128);
        *wa = _mm512_xor_si512(lo, sign);
        *wb = _mm512_xor_si512(hi, sign);
        __m128i h = _mm_setr_epi16((short)bl[0].d, (short)bl[1].d, (short)bl[2].d, (short)bl[3].d,
                                   0, 0, 0, 0);
        *dw = _mm512_permutexvar_ps(IDX_STEP, _mm512_castps128_ps512(_mm_cvtph_ps(h)));
        return;
    }
    const size_t bs = WT == TD_TYPE_Q4_0 ? sizeof(td_block_q4_0) : sizeof(td_block_q4_1);
    const size_t qo =
        WT == TD_TYPE_Q4_0 ? offsetof(td_block_q4_0, qs) : offsetof(td_block_q4_1, qs);
    const char *p0 = wrow + (size_t)b * bs;
    __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p0 + qo)));
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(p0 + bs + qo)), 1);
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(p0 + 2 * bs + qo)), 2);
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(p0 + 3 * bs + qo)), 3);
    const __m512i nib = _mm512_set1_epi8(0x0f);
    *wa = _mm512_and_si512(z, nib);
    *wb = _mm512_and_si512(_mm512_srli_epi16(z, 4), nib);
    if (WT == TD_TYPE_Q4_1) {
        uint32_t dm0, dm1, dm2, dm3; /* d, m adjacent */
        memcpy(&dm0, p0, 4);
        memcpy(&dm1, p0 + bs, 4);
        memcpy(&dm2, p0 + 2 * bs, 4);
        memcpy(&dm3, p0 + 3 * bs, 4);
        __m256 v = _mm256_cvtph_ps(_mm_setr_epi32((int)dm0, (int)dm1, (int)dm2, (int)dm3));
        *dw = _mm512_permutexvar_ps(_mm512_slli_epi32(IDX_STEP, 1), _mm512_castps256_ps512(v));
        _mm_storeu_ps(m4, _mm256_castps256_ps128(_mm256_permutevar8x32_ps(
                              v, _mm256_set_epi32(7, 5, 3, 1, 7, 5, 3, 1))));
        return;
    }
    uint16_t d0, d1, d2, d3;
    memcpy(&d0, p0, 2);
    memcpy(&d1, p0 + bs, 2);
    memcpy(&d2, p0 + 2 * bs, 2);
    memcpy(&d3, p0 + 3 * bs, 2);
    __m128i h = _mm_setr_epi16((short)d0, (short)d1, (short)d2, (short)d3, 0, 0, 0, 0);
    *dw = _mm512_permutexvar_ps(IDX_STEP, _mm512_castps128_ps512(_mm_cvtph_ps(h)));
}

/* The q5 and K types' steps. q5_0/q5_1 as Q4_0/Q4_1 with the fifth bit
 * added under a byte mask (n valid blocks). q4_K/q5_K: a step is half a
 * super-block, sub-blocks 4s..4s+3, whose 64 bytes of qs hold sub-blocks
 * 4s, 4s+2 in the low nibbles and 4s+1, 4s+3 in the high ones: a qword
 * permute puts each sub-block's halves in place; dw = d*sc, m4 = -dmin*m.
 * q6_K: a step is a half (128 elements): block i takes the low (i < 2) or
 * high nibble of ql[32 (i & 1) ..] and bits 2i, 2i+1 of qh; elements 0-15
 * of block i have scale 2i (dw), 16-31 scale 2i + 1 (dw2). Always full
 * steps: a K row holds whole super-blocks. */
#define K_PF_DIST 3072 /* bytes ahead in a weight row, as the f32-activation kernels */
AI void load_w_step_q5(const td_dtype WT, const char *wrow, int64_t b, int n, __m512i *wa,
                       __m512i *wb, __m512 *dw, float *m4) {
    const int q51 = WT == TD_TYPE_Q5_1;
    const size_t bs = q51 ? sizeof(td_block_q5_1) : sizeof(td_block_q5_0);
    const char *p0 = wrow + (size_t)b * bs;
    _mm_prefetch(p0 + K_PF_DIST, _MM_HINT_T0); /* a step is 88 or 96 bytes */
    _mm_prefetch(p0 + K_PF_DIST + 64, _MM_HINT_T0);
    __m512i z = _mm512_setzero_si512();
    uint64_t ka = 0, kb = 0;
    float dv[4] = {0, 0, 0, 0};
    for (int i = 0; i < 4; i++) {
        if (i >= n) break;
        const char *p = p0 + (size_t)i * bs;
        z = _mm512_mask_broadcast_i32x4(z, (__mmask16)(0xf << (4 * i)),
                                        _mm_loadu_si128((const __m128i *)(p + 6 + 2 * q51)));
        uint32_t qh;
        uint16_t h;
        memcpy(&qh, p + 2 + 2 * q51, 4);
        ka |= (uint64_t)(qh & 0xffff) << (16 * i);
        kb |= (uint64_t)(qh >> 16) << (16 * i);
        memcpy(&h, p, 2);
        dv[i] = _cvtsh_ss(h);
        if (q51) {
            memcpy(&h, p + 2, 2);
            m4[i] = _cvtsh_ss(h);
        }
    }
    if (q51)
        for (int i = n; i < 4; i++) m4[i] = 0.0f;
    const __m512i nib = _mm512_set1_epi8(0x0f), b4 = _mm512_set1_epi8(0x10);
    __m512i lo = _mm512_and_si512(z, nib), hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), nib);
    *wa = _mm512_mask_add_epi8(lo, (__mmask64)ka, lo, b4);
    *wb = _mm512_mask_add_epi8(hi, (__mmask64)kb, hi, b4);
    *dw = _mm512_permutexvar_ps(IDX_STEP, _mm512_castps128_ps512(_mm_loadu_ps(dv)));
}

AI void load_w_step_k(const td_dtype WT, const char *wrow, int64_t b, __m512i *wa, __m512i *wb,
                      __m512 *dw, __m512 *dw2, float *m4) {
    const int s = (int)(b % 8) / 4;
    const size_t BB = td_dtype_block_bytes(WT);
    const char *bl = wrow + (size_t)(b / 8) * BB;
    if (s == 0) /* the hardware prefetcher alone leaves decode far from the bandwidth */
        for (size_t o = 0; o < BB; o += 64) _mm_prefetch(bl + K_PF_DIST + o, _MM_HINT_T0);
    if (WT == TD_TYPE_Q6_K) {
        const __m512i L = _mm512_loadu_si512(bl + 64 * s);
        const __m512i La = _mm512_shuffle_i64x2(L, L, _MM_SHUFFLE(2, 0, 2, 0));
        const __m512i Lb = _mm512_shuffle_i64x2(L, L, _MM_SHUFFLE(3, 1, 3, 1));
        const __m512i nsh = _mm512_set_epi32(0x40004, 0x40004, 0x40004, 0x40004, 0x40004, 0x40004,
                                             0x40004, 0x40004, 0, 0, 0, 0, 0, 0, 0, 0);
        const __m512i hsh =
            _mm512_set_epi32(0x60006, 0x60006, 0x60006, 0x60006, 0x40004, 0x40004, 0x40004, 0x40004,
                             0x20002, 0x20002, 0x20002, 0x20002, 0, 0, 0, 0);
        const __m512i nib = _mm512_set1_epi8(0x0f), three = _mm512_set1_epi8(3);
        const char *qh = bl + 128 + 32 * s;
        const __m512i Ha = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)qh));
        const __m512i Hb = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(qh + 16)));
        __m512i ha = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(Ha, hsh), three), 4);
        __m512i hb = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(Hb, hsh), three), 4);
        *wa = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi16(La, nsh), nib), ha);
        *wb = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi16(Lb, nsh), nib), hb);
        const __m512 sc = td_avx512_k_scales_v(WT, bl); /* d*scales[i] */
        const __m512i i2 =
            _mm512_add_epi32(_mm512_slli_epi32(IDX_STEP, 1), _mm512_set1_epi32(8 * s));
        *dw = _mm512_permutexvar_ps(i2, sc);
        *dw2 = _mm512_permutexvar_ps(_mm512_add_epi32(i2, _mm512_set1_epi32(1)), sc);
        return;
    }
    const int q5 = WT == TD_TYPE_Q5_K;
    const __m512i v = _mm512_loadu_si512(bl + 16 + 32 * q5 + 64 * s);
    const __m512i nib = _mm512_set1_epi8(0x0f);
    const __m512i lo = _mm512_and_si512(v, nib),
                  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    *wa = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), hi);
    *wb = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15), hi);
    if (q5) { /* bit 4s + i of qh[l] is the fifth bit of element l of block i */
        const uint32_t c = 0x01010101u << (4 * s);
        const int c0 = (int)c, c1 = (int)(c << 1), c2 = (int)(c << 2), c3 = (int)(c << 3);
        const __m512i sel =
            _mm512_set_epi32(c3, c3, c3, c3, c2, c2, c2, c2, c1, c1, c1, c1, c0, c0, c0, c0);
        const __m512i b4 = _mm512_set1_epi8(0x10);
        const __m512i Ha = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(bl + 16)));
        const __m512i Hb = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(bl + 32)));
        *wa = _mm512_mask_add_epi8(*wa, _mm512_test_epi8_mask(Ha, sel), *wa, b4);
        *wb = _mm512_mask_add_epi8(*wb, _mm512_test_epi8_mask(Hb, sel), *wb, b4);
    }
    /* d*sc_j, then -(dmin*m_j): kept in a register (a vector stored and
     * read back narrower would stall on the store forwarding) */
    const __m512 sc = td_avx512_k_scales_v(WT, bl);
    const __m512i i4 = _mm512_add_epi32(IDX_STEP, _mm512_set1_epi32(4 * s));
    _mm_storeu_ps(
        m4,
        _mm512_castps512_ps128(_mm512_permutexvar_ps(
            _mm512_add_epi32(_mm512_setr_epi32(8, 9, 10, 11, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                             _mm512_set1_epi32(4 * s)),
            sc)));
    *dw = _mm512_permutexvar_ps(i4, sc);
}

AI void load_w_step(const td_dtype WT, const char *wrow, int64_t b, int n, __m512i *wa, __m512i *wb,
                    __m512 *dw, __m512 *dw2, float *m4) {
    if (WT == TD_TYPE_Q5_0 || WT == TD_TYPE_Q5_1) {
        load_w_step_q5(WT, wrow, b, n, wa, wb, dw, m4);
        return;
    }
    if (WT == TD_TYPE_Q4_K || WT == TD_TYPE_Q5_K || WT == TD_TYPE_Q6_K) {
        load_w_step_k(WT, wrow, b, wa, wb, dw, dw2, m4);
        return;
    }
    (void)dw2;
    if (n == 4) {
        /* 72 (q4_0), 80 (q4_1) or 136 (q8_0) bytes a step */
        const char *pf = wrow + (size_t)b * td_dtype_block_bytes(WT) + K_PF_DIST;
        _mm_prefetch(pf, _MM_HINT_T0);
        _mm_prefetch(pf + 64, _MM_HINT_T0);
        if (WT == TD_TYPE_Q8_0) _mm_prefetch(pf + 128, _MM_HINT_T0);
        load_w_step_full(WT, wrow, b, wa, wb, dw, m4);
        return;
    }
    const __mmask16 keep = (__mmask16)((1u << (4 * n)) - 1); /* 32-bit lanes of valid blocks */
    if (WT == TD_TYPE_Q8_0) {
        const td_block_q8_0 *bl = (const td_block_q8_0 *)wrow + b;
        __m512i lo = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)bl[0].qs));
        __m512i hi = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(bl[0].qs + 16)));
        for (int i = 1; i < 4; i++) {
            if (i >= n) break;
            lo = _mm512_mask_broadcast_i32x4(lo, (__mmask16)(0xf << (4 * i)),
                                             _mm_loadu_si128((const __m128i *)bl[i].qs));
            hi = _mm512_mask_broadcast_i32x4(hi, (__mmask16)(0xf << (4 * i)),
                                             _mm_loadu_si128((const __m128i *)(bl[i].qs + 16)));
        }
        const __m512i sign = _mm512_set1_epi8(-128);
        *wa = _mm512_maskz_mov_epi32(keep, _mm512_xor_si512(lo, sign));
        *wb = _mm512_maskz_mov_epi32(keep, _mm512_xor_si512(hi, sign));
    } else {
        const size_t bs = WT == TD_TYPE_Q4_0 ? sizeof(td_block_q4_0) : sizeof(td_block_q4_1);
        const size_t qo =
            WT == TD_TYPE_Q4_0 ? offsetof(td_block_q4_0, qs) : offsetof(td_block_q4_1, qs);
        const char *p0 = wrow + (size_t)b * bs + qo;
        __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p0));
        for (int i = 1; i < 4; i++) {
            if (i >= n) break;
            z = _mm512_mask_broadcast_i32x4(z, (__mmask16)(0xf << (4 * i)),
                                            _mm_loadu_si128((const __m128i *)(p0 + i * bs)));
        }
        const __m512i nib = _mm512_set1_epi8(0x0f);
        *wa = _mm512_maskz_and_epi32(keep, z, nib);
        *wb = _mm512_maskz_and_epi32(keep, _mm512_srli_epi16(z, 4), nib);
    }
    if (WT == TD_TYPE_Q4_1) {
        const td_block_q4_1 *bl = (const td_block_q4_1 *)wrow + b;
        uint32_t dm[4] = {0, 0, 0, 0};
        for (int i = 0; i < 4; i++)
            if (i < n) memcpy(&dm[i], &bl[i].d, 4);                       /* d, m adjacent */
        __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dm)); /* D0 M0 .. D3 M3 */
        *dw = _mm512_permutexvar_ps(_mm512_slli_epi32(IDX_STEP, 1), _mm512_castps256_ps512(v));
        _mm_storeu_ps(m4, _mm256_castps256_ps128(_mm256_permutevar8x32_ps(
                              v, _mm256_set_epi32(7, 5, 3, 1, 7, 5, 3, 1))));
        return;
    }
    uint16_t d[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < 4; i++)
        if (i < n)
            d[i] = WT == TD_TYPE_Q8_0 ? ((const td_block_q8_0 *)wrow)[b + i].d
                                      : ((const td_block_q4_0 *)wrow)[b + i].d;
    *dw = _mm512_permutexvar_ps(
        IDX_STEP, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadu_si128((const __m128i *)d))));
}

/* Types whose value has a min (d * q + m): their m_w * (d_x * sum(q_x))
 * term goes in a pass of its own. */
#define HAS_MIN(WT) td_dtype_has_min(WT)
/* Per-token step vectors: dx, then the seed(s) of the types with an offset
 * (q6_K: one per half of the blocks, its scales cover 16 elements). */
#define NV_OF(WT) (HAS_MIN(WT) ? 1 : (WT) == TD_TYPE_Q6_K ? 3 : 2)

/* One step of one token: dx laid out like dw, and the vpdpbusd seed
 * (Q4_0: -8 * sum(q_x), Q5_0: -16 *, Q8_0: -128 *, block i in lane 4i;
 * q6_K: -32 times the sum of each lane's four q_x, for xa in seed and xb
 * in seed2). xs points at the step's activation bytes. */
AI void load_x_step(const td_dtype WT, const float *xd, const int32_t *xsum, const int8_t *xs,
                    int64_t b, int n, __m512 *dx, __m512i *seed, __m512i *seed2) {
    const __mmask8 m = (__mmask8)((1u << n) - 1);
    *dx = _mm512_permutexvar_ps(
        IDX_STEP,
        _mm512_castps128_ps512(n == 4 ? _mm_loadu_ps(xd + b) : _mm_maskz_loadu_ps(m, xd + b)));
    if (HAS_MIN(WT)) {
        *seed = _mm512_setzero_si512();
        return;
    }
    if (WT == TD_TYPE_Q6_K) {
        const __m512i z = _mm512_setzero_si512(), one = _mm512_set1_epi8(1);
        __m512i sa = _mm512_dpbusd_epi32(z, one, _mm512_loadu_si512(xs));
        __m512i sb = _mm512_dpbusd_epi32(z, one, _mm512_loadu_si512(xs + 64));
        *seed = _mm512_sub_epi32(z, _mm512_slli_epi32(sa, 5));
        *seed2 = _mm512_sub_epi32(z, _mm512_slli_epi32(sb, 5));
        return;
    }
    const int32_t c = WT == TD_TYPE_Q4_0 ? -8 : WT == TD_TYPE_Q5_0 ? -16 : -128;
    __m512i s4 = _mm512_castsi128_si512(_mm_mullo_epi32(
        n == 4 ? _mm_loadu_si128((const __m128i *)(xsum + b)) : _mm_maskz_loadu_epi32(m, xsum + b),
        _mm_set1_epi32(c)));
    *seed = _mm512_maskz_permutexvar_epi32(0x1111, IDX_STEP, s4);
}

/* Weight rows of a tile unpacked once for all token tiles of a chunk, and
 * the chunk's per-token step vectors made once for all row tiles. */
#define WBUF_STEPS 72   /* buffered path for k up to 9216 (8960: the 1.5B's ffn_down) */
#define XBUF_VECS  6144 /* per-token step vectors of one token chunk (384 KiB) */
#define MCHUNK     1024 /* blocks per chunk of the min term */
typedef struct {
    __m512i w[TR_MAX][WBUF_STEPS][2];
    __m512 d[TR_MAX][WBUF_STEPS];
    __m512 d2[TR_MAX][WBUF_STEPS]; /* q6_K: the scales of elements 16-31 */
    float m[TR_MAX][4 * WBUF_STEPS];
} wbuf;

AI void tile_quant(const td_dtype WT, const int R, const int T, const int BUF, const char *w,
                   size_t w_stride, const wbuf *wb, const __m512 *xb, const char *xq,
                   size_t xq_stride, int64_t nb, float *y, size_t ldy) {
    const int NV = NV_OF(WT); /* xb vectors per token-step */
    const int64_t nsteps = (nb + 3) / 4;
    __m512 acc[QR][QT];
    const float *xd[QT], *xs[QT];
    const int32_t *xsum[QT];
    const int8_t *xqs[QT];
    float mloc[BUF ? 1 : QR][BUF ? 1 : MCHUNK];
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) {
        const char *row = xq + (size_t)t * xq_stride;
        xd[t] = td_q8x_d(row);
        xs[t] = td_q8x_s(row, nb);
        xsum[t] = td_q8x_sum(row, nb);
        xqs[t] = td_q8x_qs(row, nb);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[r][t] = _mm512_setzero_ps();
    }
    for (int64_t c0 = 0; c0 < nb; c0 += MCHUNK) {
        const int64_t c1 = nb - c0 < MCHUNK ? nb : c0 + MCHUNK;
        for (int64_t b = c0; b < c1; b += 4) {
            const int64_t s = b / 4;
            const int nv = nb - b < 4 ? (int)(nb - b) : 4;
            __m512i wa[QR], wbv[QR];
            __m512 dw[QR], dw2[QR];
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                if (BUF) {
                    wa[r] = _mm512_load_si512(&wb->w[r][s][0]);
                    wbv[r] = _mm512_load_si512(&wb->w[r][s][1]);
                    dw[r] = _mm512_load_ps(&wb->d[r][s]);
                    if (WT == TD_TYPE_Q6_K) dw2[r] = _mm512_load_ps(&wb->d2[r][s]);
                } else {
                    load_w_step(WT, w + (size_t)r * w_stride, b, nv, &wa[r], &wbv[r], &dw[r],
                                &dw2[r], &mloc[BUF ? 0 : r][BUF ? 0 : b - c0]);
                }
            }
#pragma GCC unroll 8
            for (int t = 0; t < T; t++) {
                /* a partial last group of the qs region is zero-padded */
                __m512i xa = _mm512_loadu_si512(xqs[t] + b * 32);
                __m512i xbq = _mm512_loadu_si512(xqs[t] + b * 32 + 64);
                __m512 dx;
                __m512i seed, seed2;
                if (BUF) {
                    const __m512 *v = xb + ((size_t)t * nsteps + s) * NV;
                    dx = v[0];
                    seed = HAS_MIN(WT) ? _mm512_setzero_si512() : _mm512_castps_si512(v[1]);
                    if (WT == TD_TYPE_Q6_K) seed2 = _mm512_castps_si512(v[2]);
                } else {
                    load_x_step(WT, xd[t], xsum[t], xqs[t] + b * 32, b, nv, &dx, &seed, &seed2);
                }
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    if (WT == TD_TYPE_Q6_K) {
                        __m512i pa = _mm512_dpbusd_epi32(seed, wa[r], xa);
                        __m512i pb = _mm512_dpbusd_epi32(seed2, wbv[r], xbq);
                        __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(pb), dw2[r]);
                        f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pa), dw[r], f);
                        acc[r][t] = _mm512_fmadd_ps(f, dx, acc[r][t]);
                        continue;
                    }
                    __m512i p = _mm512_dpbusd_epi32(seed, wa[r], xa);
                    p = _mm512_dpbusd_epi32(p, wbv[r], xbq);
                    acc[r][t] =
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw[r], dx), acc[r][t]);
                }
            }
        }
        if (HAS_MIN(WT)) { /* sum over blocks of m_w * (d_x * sum(q_x)) */
            for (int64_t b = c0; b < c1; b += 16) {
                __mmask16 m = c1 - b >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (c1 - b)) - 1);
                __m512 mw[QR];
#pragma GCC unroll 8
                for (int r = 0; r < R; r++)
                    mw[r] = _mm512_maskz_loadu_ps(m, BUF ? &wb->m[r][b]
                                                         : &mloc[BUF ? 0 : r][BUF ? 0 : b - c0]);
#pragma GCC unroll 8
                for (int t = 0; t < T; t++) {
                    __m512 sv = _mm512_maskz_loadu_ps(m, xs[t] + b);
#pragma GCC unroll 8
                    for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(mw[r], sv, acc[r][t]);
                }
            }
        }
    }
    TILE_STORE(acc, R, T, y, ldy);
}

AI void wbuf_fill_t(const td_dtype WT, const char *w, size_t w_stride, int rows, int64_t nb,
                    wbuf *wb) {
    for (int r = 0; r < rows; r++) {
        const char *wr = w + (size_t)r * w_stride;
        for (int64_t b = 0; b < nb; b += 4) {
            const int64_t s = b / 4;
            const int n = nb - b < 4 ? (int)(nb - b) : 4;
            __m512i wa, wbv;
            __m512 dw, dw2;
            load_w_step(WT, wr, b, n, &wa, &wbv, &dw, &dw2, &wb->m[r][b]);
            _mm512_store_si512(&wb->w[r][s][0], wa);
            _mm512_store_si512(&wb->w[r][s][1], wbv);
            _mm512_store_ps(&wb->d[r][s], dw);
            if (WT == TD_TYPE_Q6_K) _mm512_store_ps(&wb->d2[r][s], dw2);
        }
    }
}

AI void xbuf_fill_t(const td_dtype WT, const char *xq, size_t xq_stride, int n, int64_t nb,
                    __m512 *xb) {
    for (int t = 0; t < n; t++) {
        const char *row = xq + (size_t)t * xq_stride;
        const float *xd = td_q8x_d(row);
        const int32_t *xsum = td_q8x_sum(row, nb);
        const int8_t *xqs = td_q8x_qs(row, nb);
        for (int64_t b = 0; b < nb; b += 4) {
            const int nv = nb - b < 4 ? (int)(nb - b) : 4;
            __m512 dx;
            __m512i seed, seed2;
            load_x_step(WT, xd, xsum, xqs + b * 32, b, nv, &dx, &seed, &seed2);
            *xb++ = dx;
            if (HAS_MIN(WT)) continue;
            *xb++ = _mm512_castsi512_ps(seed);
            if (WT == TD_TYPE_Q6_K) *xb++ = _mm512_castsi512_ps(seed2);
        }
    }
}

typedef void (*tile_fn)(const char *w, size_t w_stride, const char *xq, size_t xq_stride,
                        int64_t nb, float *y, size_t ldy);
typedef void (*qtile_fn)(const char *w, size_t w_stride, const wbuf *wb, const __m512 *xb,
                         const char *xq, size_t xq_stride, int64_t nb, float *y, size_t ldy);
typedef void (*wbuf_fn)(const char *w, size_t w_stride, int rows, int64_t nb, wbuf *wb);
typedef void (*xbuf_fn)(const char *xq, size_t xq_stride, int n, int64_t nb, __m512 *xb);

/* One weight type's kernels: the tiles (buffered or not, R x T) and the
 * buffer fills. */
typedef struct {
    qtile_fn tiles[2][TR_MAX][QT];
    wbuf_fn wfill;
    xbuf_fn xfill;
} qkern;

#define DEF_QTILE(NAME, WT, BUF, R, T)                                                             \
    static void NAME##_##BUF##_##R##_##T(const char *w, size_t ws, const wbuf *wb,                 \
                                         const __m512 *xb, const char *xq, size_t xs, int64_t nb,  \
                                         float *y, size_t ldy) {                                   \
        tile_quant(WT, R, T, BUF, w, ws, wb, xb, xq, xs, nb, y, ldy);                              \
    }
#define DEF_QTILES_R(NAME, WT, BUF, R)                                                             \
    DEF_QTILE(NAME, WT, BUF, R, 1)                                                                 \
    DEF_QTILE(NAME, WT, BUF, R, 2)                                                                 \
    DEF_QTILE(NAME, WT, BUF, R, 3)                                                                 \
    DEF_QTILE(NAME, WT, BUF, R, 4)
#define QROW(NAME, BUF, R)                                                                         \
    {                                                                                              \
        NAME##_##BUF##_##R##_1, NAME##_##BUF##_##R##_2, NAME##_##BUF##_##R##_3,                    \
            NAME##_##BUF##_##R##_4                                                                 \
    }
#define DEF_QTILES(NAME, WT)                                                                       \
    DEF_QTILES_R(NAME, WT, 0, 1)                                                                   \
    DEF_QTILES_R(NAME, WT, 0, 2)                                                                   \
    DEF_QTILES_R(NAME, WT, 0, 3)                                                                   \
    DEF_QTILES_R(NAME, WT, 0, 4)                                                                   \
    DEF_QTILES_R(NAME, WT, 1, 1)                                                                   \
    DEF_QTILES_R(NAME, WT, 1, 2)                                                                   \
    DEF_QTILES_R(NAME, WT, 1, 3)                                                                   \
    DEF_QTILES_R(NAME, WT, 1, 4)                                                                   \
    static void NAME##_wfill(const char *w, size_t ws, int rows, int64_t nb, wbuf *wb) {           \
        wbuf_fill_t(WT, w, ws, rows, nb, wb);                                                      \
    }                                                                                              \
    static void NAME##_xfill(const char *xq, size_t xs, int n, int64_t nb, __m512 *xb) {           \
        xbuf_fill_t(WT, xq, xs, n, nb, xb);                                                        \
    }                                                                                              \
    static const qkern NAME##_kern = {                                                             \
        {{QROW(NAME, 0, 1), QROW(NAME, 0, 2), QROW(NAME, 0, 3), QROW(NAME, 0, 4)},                 \
         {QROW(NAME, 1, 1), QROW(NAME, 1, 2), QROW(NAME, 1, 3), QROW(NAME, 1, 4)}},                \
        NAME##_wfill,                                                                              \
        NAME##_xfill};

DEF_QTILES(q80, TD_TYPE_Q8_0)
DEF_QTILES(q40, TD_TYPE_Q4_0)
DEF_QTILES(q41, TD_TYPE_Q4_1)
DEF_QTILES(q50, TD_TYPE_Q5_0)
DEF_QTILES(q51, TD_TYPE_Q5_1)
DEF_QTILES(q4k, TD_TYPE_Q4_K)
DEF_QTILES(q5k, TD_TYPE_Q5_K)
DEF_QTILES(q6k, TD_TYPE_Q6_K)

static const qkern *qkern_of(td_dtype wt) {
    switch (wt) {
    case TD_TYPE_Q8_0: return &q80_kern;
    case TD_TYPE_Q4_0: return &q40_kern;
    case TD_TYPE_Q4_1: return &q41_kern;
    case TD_TYPE_Q5_0: return &q50_kern;
    case TD_TYPE_Q5_1: return &q51_kern;
    case TD_TYPE_Q4_K: return &q4k_kern;
    case TD_TYPE_Q5_K: return &q5k_kern;
    case TD_TYPE_Q6_K: return &q6k_kern;
    default: TD_KERNEL_UNREACHABLE_TYPE(wt);
    }
}

/* Tokens go in chunks that the row tiles of [r0, r1) sweep in turn: the
 * chunk's activations stay in L2 and its per-step scale/seed vectors (xb)
 * are made once. When a chunk has several token tiles, each row tile is
 * unpacked once (wb) for all of them. */
static void matmul_quant_avx512(td_dtype wt, const void *w, size_t w_stride, const void *xq,
                                size_t xq_stride, int n, int64_t k, float *y, size_t ldy, int r0,
                                int r1) {
    const qkern *kern = qkern_of(wt);
    const int R = QTILE_R, T = QTILE_T;
    const int64_t nb = k / 32, nsteps = (nb + 3) / 4;
    const int nv = NV_OF(wt);
    const int can_buf = nsteps <= WBUF_STEPS && nsteps * nv * T <= XBUF_VECS;
    size_t act_bytes = xq_stride ? xq_stride : 1;
    int tchunk = (int)((512 * 1024) / act_bytes);
    if (can_buf && tchunk > XBUF_VECS / (nsteps * nv)) tchunk = (int)(XBUF_VECS / (nsteps * nv));
    if (tchunk < T) tchunk = T;
    tchunk -= tchunk % T;
    _Alignas(64) wbuf wb;
    _Alignas(64) __m512 xb[XBUF_VECS];
    for (int tc = 0; tc < n; tc += tchunk) {
        int te = tc + tchunk < n ? tc + tchunk : n;
        int buf = can_buf && te - tc > T;
        if (buf) kern->xfill((const char *)xq + (size_t)tc * xq_stride, xq_stride, te - tc, nb, xb);
        for (int r = r0; r < r1; r += R) {
            int rr = r1 - r < R ? r1 - r : R;
            const char *wr = (const char *)w + (size_t)r * w_stride;
            if (buf) kern->wfill(wr, w_stride, rr, nb, &wb);
            for (int t = tc; t < te; t += T) {
                int tt = te - t < T ? te - t : T;
                kern->tiles[buf][rr - 1][tt - 1](wr, w_stride, &wb,
                                                 xb + (size_t)(t - tc) * nsteps * nv,
                                                 (const char *)xq + (size_t)t * xq_stride,
                                                 xq_stride, nb, y + (size_t)t * ldy + r, ldy);
            }
        }
    }
}

/* ---------------- float-weight matmul ---------------- */

#define FR TR_MAX
#define FT TT_MAX

AI __m512 load_w16(const td_dtype WT, const void *p, __mmask16 m) {
    if (WT == TD_TYPE_F32) return m == 0xffff ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
    __m256i h =
        m == 0xffff ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(m, p);
    if (WT == TD_TYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

AI void tile_float(const td_dtype WT, const int R, const int T, const char *w, size_t w_stride,
                   const char *xq, size_t xq_stride, int64_t k, float *y, size_t ldy) {
    const size_t es = WT == TD_TYPE_F32 ? 4 : 2;
    __m512 acc[FR][FT];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        __m512 wv[FR];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            wv[r] = load_w16(WT, w + (size_t)r * w_stride + (size_t)i * es, (__mmask16)0xffff);
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            __m512 xv = _mm512_loadu_ps((const float *)(xq + (size_t)t * xq_stride) + i);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
    if (i < k) { /* masked tail: the same update with zeros past k */
        __mmask16 m = (__mmask16)((1u << (k - i)) - 1);
        __m512 wv[FR];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            wv[r] = load_w16(WT, w + (size_t)r * w_stride + (size_t)i * es, m);
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            __m512 xv = _mm512_maskz_loadu_ps(m, (const float *)(xq + (size_t)t * xq_stride) + i);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
    TILE_STORE(acc, R, T, y, ldy);
}

#define DEF_FTILE(NAME, WT, R, T)                                                                  \
    static void NAME##_##R##_##T(const char *w, size_t ws, const char *xq, size_t xs, int64_t k,   \
                                 float *y, size_t ldy) {                                           \
        tile_float(WT, R, T, w, ws, xq, xs, k, y, ldy);                                            \
    }
#define DEF_FTILES_R(NAME, WT, R)                                                                  \
    DEF_FTILE(NAME, WT, R, 1)                                                                      \
    DEF_FTILE(NAME, WT, R, 2)                                                                      \
    DEF_FTILE(NAME, WT, R, 3)                                                                      \
    DEF_FTILE(NAME, WT, R, 4)
#define FROW(NAME, R)                                                                              \
    { NAME##_##R##_1, NAME##_##R##_2, NAME##_##R##_3, NAME##_##R##_4 }
#define DEF_FTILES(NAME, WT)                                                                       \
    DEF_FTILES_R(NAME, WT, 1)                                                                      \
    DEF_FTILES_R(NAME, WT, 2)                                                                      \
    DEF_FTILES_R(NAME, WT, 3)                                                                      \
    DEF_FTILES_R(NAME, WT, 4)                                                                      \
    static const tile_fn NAME##_tiles[FR][FT] = {FROW(NAME, 1), FROW(NAME, 2), FROW(NAME, 3),      \
                                                 FROW(NAME, 4)};

DEF_FTILES(f32, TD_TYPE_F32)
DEF_FTILES(f16, TD_TYPE_F16)
DEF_FTILES(bf16, TD_TYPE_BF16)

static void matmul_avx512(td_dtype wt, const void *w, size_t w_stride, const void *xq,
                          size_t xq_stride, int n, int64_t k, float *y, size_t ldy, int r0,
                          int r1) {
    if (td_dtype_has_int8_kernels(wt)) { /* every quantized type (qkern_of) */
        matmul_quant_avx512(wt, w, w_stride, xq, xq_stride, n, k, y, ldy, r0, r1);
        return;
    }
    const tile_fn(*tiles)[FT];
    switch (wt) {
    case TD_TYPE_F32: tiles = f32_tiles; break;
    case TD_TYPE_F16: tiles = f16_tiles; break;
    case TD_TYPE_BF16: tiles = bf16_tiles; break;
    default: TD_KERNEL_UNREACHABLE_TYPE(wt);
    }
    const int R = FR, T = FT;
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
                tiles[rr - 1][tt - 1](wr, w_stride, (const char *)xq + (size_t)t * xq_stride,
                                      xq_stride, k, y + (size_t)t * ldy + r, ldy);
            }
        }
    }
}

/* Bytes identical to td_cpu_act_quant_scalar: same amax, same d and 1/d,
 * x * id rounded half-to-even by vcvtps2dq. */
static void act_quant_avx512(td_dtype wt, const float *x, void *xq, int64_t k) {
    if (!td_dtype_has_int8_kernels(wt)) {
        memcpy(xq, x, (size_t)k * sizeof(float));
        return;
    }
    int64_t nb = k / 32;
    float *d = (float *)xq;
    float *s = d + nb;
    int32_t *sum = (int32_t *)xq + 2 * nb;
    int8_t *qs = (int8_t *)xq + td_q8x_head_bytes(nb);
    memset((char *)xq + nb * 12, 0, td_q8x_head_bytes(nb) - (size_t)nb * 12);
    memset(qs + (nb / 4) * 128, 0,
           td_q8x_row_bytes(nb) - td_q8x_head_bytes(nb) - (size_t)(nb / 4) * 128);
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < nb; b++) {
        __m512 v0 = _mm512_loadu_ps(x + b * 32), v1 = _mm512_loadu_ps(x + b * 32 + 16);
        __m512 a = _mm512_max_ps(_mm512_and_ps(v0, absmask), _mm512_and_ps(v1, absmask));
        float amax = _mm512_reduce_max_ps(a);
        float db = amax / 127.0f;
        float id = db != 0.0f ? 1.0f / db : 0.0f;
        __m512 iv = _mm512_set1_ps(id);
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, iv));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, iv));
        _mm_storeu_si128((__m128i *)(qs + td_q8x_pos(b, 0)), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(qs + td_q8x_pos(b, 16)), _mm512_cvtepi32_epi8(q1));
        int32_t acc = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        d[b] = db;
        sum[b] = acc;
        s[b] = db * (float)acc;
    }
}

/* ---------------- elementwise ---------------- */

static void rmsnorm_avx512(const float *x, const float *w, float *out, int64_t n, float eps) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(m, x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    float ss = hsum512(acc);
    float r = (float)(1.0 / sqrt((double)ss / (double)n + (double)eps));
    __m512 rv = _mm512_set1_ps(r);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), rv);
        if (w) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i));
        _mm512_mask_storeu_ps(out + i, m, v);
    }
}

static void swiglu_avx512(const float *gate, const float *up, float *out, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
        __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 sg = _mm512_div_ps(g, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(sg, _mm512_maskz_loadu_ps(m, up + i)));
    }
}

static void add_avx512(const float *a, const float *b, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(
            out + i, m,
            _mm512_add_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i)));
    }
}

static void scale_avx512(float *x, float s, int64_t n) {
    __m512 sv = _mm512_set1_ps(s);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), sv));
    }
}

static void softmax_avx512(float *x, int64_t n) {
    if (n <= 0) return;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        mv = _mm512_mask_max_ps(mv, m, mv, _mm512_maskz_loadu_ps(m, x + i));
    }
    mv = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sv = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), mv));
        _mm512_mask_storeu_ps(x + i, m, e);
        sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(m, e));
    }
    scale_avx512(x, 1.0f / hsum512(sv), n);
}

/* 16 KV elements from element i of row (of dtype dt), widened exactly;
 * lanes off in m read nothing and are 0. */
AI __m512 ld16_kv(const char *row, int i, const td_dtype dt, __mmask16 m) {
    switch (dt) {
    case TD_TYPE_F16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, row + 2 * i));
    case TD_TYPE_BF16:
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, row + 2 * i)), 16));
    default: return _mm512_maskz_loadu_ps(m, (const float *)row + i);
    }
}

AI __m512 ld16_kv_all(const char *row, int i, const td_dtype dt) {
    switch (dt) {
    case TD_TYPE_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * i)));
    case TD_TYPE_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 2 * i))), 16));
    default: return _mm512_loadu_ps((const float *)row + i);
    }
}

/* Prefetches one head's rows of logical block blk (< n_blk) into L1: the
 * blocks of a sequence lie anywhere in the pool, so the hardware
 * prefetcher loses the stream at every block boundary. */
AI void prefetch_block(const char *base, const int32_t *block_table, int blk, int n_blk, int bs,
                       size_t tok_bytes, size_t row_bytes) {
    if (blk >= n_blk) return;
    const char *b = base + (size_t)block_table[blk] * bs * tok_bytes;
    for (int s = 0; s < bs; s++)
        for (size_t o = 0; o < row_bytes; o += 64) _mm_prefetch(b + s * tok_bytes + o, _MM_HINT_T0);
}

/* Scores four positions at a time (independent accumulators, one packed
 * horizontal sum), then the weighted V sum in position order. Positions are
 * walked block by block (no division per position). Any head_dim works;
 * lanes past it are masked off. */
AI void attn_paged_dt(const float *q, const td_cpu_kv_layer *kv, int kv_head,
                      const int32_t *block_table, int n_ctx, float scale, float *out,
                      float *scratch, const td_dtype dt) {
    const int hd = kv->head_dim, bs = kv->block_size;
    const size_t es = td_cpu_kv_es(dt), tok_bytes = (size_t)kv->n_kv_heads * hd * es;
    const char *kbase = (const char *)kv->k + (size_t)kv_head * hd * es;
    const char *vbase = (const char *)kv->v + (size_t)kv_head * hd * es;
    const int nv = (hd + 15) / 16;
    const __mmask16 mlast = (__mmask16)(hd % 16 ? (1u << (hd % 16)) - 1 : 0xffff);
    /* position p's row: block_table[p / bs] * bs + p % bs, advanced incrementally */
    int blk = 0, slot = 0;
#define NEXT_ROW(base)                                                                             \
    ((base) + ((size_t)block_table[blk] * bs + slot) * tok_bytes);                                 \
    if (++slot == bs) slot = 0, blk++
    int p = 0;
    for (; p + 4 <= n_ctx; p += 4) {
        const char *k0 = NEXT_ROW(kbase);
        const char *k1 = NEXT_ROW(kbase);
        const char *k2 = NEXT_ROW(kbase);
        const char *k3 = NEXT_ROW(kbase);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int j = 0; j < nv; j++) {
            const int i = 16 * j;
            const __mmask16 m = j == nv - 1 ? mlast : (__mmask16)0xffff;
            __m512 qv = _mm512_maskz_loadu_ps(m, q + i);
            a0 = _mm512_fmadd_ps(qv, ld16_kv(k0, i, dt, m), a0);
            a1 = _mm512_fmadd_ps(qv, ld16_kv(k1, i, dt, m), a1);
            a2 = _mm512_fmadd_ps(qv, ld16_kv(k2, i, dt, m), a2);
            a3 = _mm512_fmadd_ps(qv, ld16_kv(k3, i, dt, m), a3);
        }
        float d4[4];
        hsum512x4(a0, a1, a2, a3, d4);
        _mm_storeu_ps(scratch + p, _mm_mul_ps(_mm_loadu_ps(d4), _mm_set1_ps(scale)));
    }
    for (; p < n_ctx; p++) {
        const char *k0 = NEXT_ROW(kbase);
        __m512 a0 = _mm512_setzero_ps();
        for (int j = 0; j < nv; j++) {
            const int i = 16 * j;
            const __mmask16 m = j == nv - 1 ? mlast : (__mmask16)0xffff;
            a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + i), ld16_kv(k0, i, dt, m), a0);
        }
        scratch[p] = hsum512(a0) * scale;
    }
    softmax_avx512(scratch, n_ctx);
    for (int i0 = 0; i0 < nv; i0 += 4) { /* up to 4 vectors of the head per pass */
        __m512 o[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                       _mm512_setzero_ps()};
        const int cnt = nv - i0 < 4 ? nv - i0 : 4;
        blk = 0, slot = 0;
        if (cnt == 4 && (i0 + 4 < nv || mlast == 0xffff)) {
            for (int pp = 0; pp < n_ctx; pp++) {
                const char *v = NEXT_ROW(vbase);
                __m512 a = _mm512_set1_ps(scratch[pp]);
                o[0] = _mm512_fmadd_ps(a, ld16_kv_all(v, 16 * i0, dt), o[0]);
                o[1] = _mm512_fmadd_ps(a, ld16_kv_all(v, 16 * i0 + 16, dt), o[1]);
                o[2] = _mm512_fmadd_ps(a, ld16_kv_all(v, 16 * i0 + 32, dt), o[2]);
                o[3] = _mm512_fmadd_ps(a, ld16_kv_all(v, 16 * i0 + 48, dt), o[3]);
            }
        } else {
            for (int pp = 0; pp < n_ctx; pp++) {
                const char *v = NEXT_ROW(vbase);
                __m512 a = _mm512_set1_ps(scratch[pp]);
                for (int j = 0; j < cnt; j++) {
                    const int jj = i0 + j;
                    const __mmask16 m = jj == nv - 1 ? mlast : (__mmask16)0xffff;
                    o[j] = _mm512_fmadd_ps(a, ld16_kv(v, 16 * jj, dt, m), o[j]);
                }
            }
        }
        for (int j = 0; j < cnt; j++) {
            const int jj = i0 + j;
            const __mmask16 m = jj == nv - 1 ? mlast : (__mmask16)0xffff;
            _mm512_mask_storeu_ps(out + 16 * jj, m, o[j]);
        }
    }
#undef NEXT_ROW
}

static void attn_paged_avx512(const float *q, const td_cpu_kv_layer *kv, int kv_head,
                              const int32_t *block_table, int n_ctx, float scale, float *out,
                              float *scratch) {
#define CALL(dt) attn_paged_dt(q, kv, kv_head, block_table, n_ctx, scale, out, scratch, dt)
    TD_KV_DTYPE_SWITCH(kv->dtype, CALL);
#undef CALL
}

/* Weighted V sums of G queries (head_dim 64) sharing each loaded V row;
 * per query the same fma sequence, in position order, as attn_paged_avx512. */
AI void attn_v_group(const int G, const td_cpu_attn_query *qs, float *const *scr, const char *vbase,
                     const int32_t *block_table, int bs, size_t tok_bytes, const td_dtype dt) {
    int min_ctx = qs[0].n_ctx;
    for (int i = 1; i < G; i++)
        if (qs[i].n_ctx < min_ctx) min_ctx = qs[i].n_ctx;
    __m512 o[6][4];
#pragma GCC unroll 8
    for (int i = 0; i < G; i++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) o[i][j] = _mm512_setzero_ps();
    int max_ctx = qs[0].n_ctx;
    for (int i = 1; i < G; i++)
        if (qs[i].n_ctx > max_ctx) max_ctx = qs[i].n_ctx;
    const int n_blk = (max_ctx + bs - 1) / bs;
    const size_t row_bytes = (size_t)64 * td_cpu_kv_es(dt);
    int blk = 0, slot = 0;
    prefetch_block(vbase, block_table, 0, n_blk, bs, tok_bytes, row_bytes);
    for (int p = 0; p < min_ctx; p++) {
        if (slot == 0) prefetch_block(vbase, block_table, blk + 1, n_blk, bs, tok_bytes, row_bytes);
        const char *v = vbase + ((size_t)block_table[blk] * bs + slot) * tok_bytes;
        if (++slot == bs) slot = 0, blk++;
        __m512 v0 = ld16_kv_all(v, 0, dt), v1 = ld16_kv_all(v, 16, dt), v2 = ld16_kv_all(v, 32, dt),
               v3 = ld16_kv_all(v, 48, dt);
#pragma GCC unroll 8
        for (int i = 0; i < G; i++) {
            __m512 a = _mm512_set1_ps(scr[i][p]);
            o[i][0] = _mm512_fmadd_ps(a, v0, o[i][0]);
            o[i][1] = _mm512_fmadd_ps(a, v1, o[i][1]);
            o[i][2] = _mm512_fmadd_ps(a, v2, o[i][2]);
            o[i][3] = _mm512_fmadd_ps(a, v3, o[i][3]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < G; i++) {
        __m512 o0 = o[i][0], o1 = o[i][1], o2 = o[i][2], o3 = o[i][3];
        int b2 = blk, s2 = slot;
        for (int p = min_ctx; p < qs[i].n_ctx; p++) {
            const char *v = vbase + ((size_t)block_table[b2] * bs + s2) * tok_bytes;
            if (++s2 == bs) s2 = 0, b2++;
            __m512 a = _mm512_set1_ps(scr[i][p]);
            o0 = _mm512_fmadd_ps(a, ld16_kv_all(v, 0, dt), o0);
            o1 = _mm512_fmadd_ps(a, ld16_kv_all(v, 16, dt), o1);
            o2 = _mm512_fmadd_ps(a, ld16_kv_all(v, 32, dt), o2);
            o3 = _mm512_fmadd_ps(a, ld16_kv_all(v, 48, dt), o3);
        }
        _mm512_storeu_ps(qs[i].out, o0);
        _mm512_storeu_ps(qs[i].out + 16, o1);
        _mm512_storeu_ps(qs[i].out + 32, o2);
        _mm512_storeu_ps(qs[i].out + 48, o3);
    }
}

/* head_dim 64 (every supported small model); other sizes loop over
 * attn_paged_avx512. Scores: each group of four K rows is loaded once into
 * registers and dotted with every query that covers it. */
AI void attn_paged_multi_dt(const td_cpu_attn_query *qs, int n_q, const td_cpu_kv_layer *kv,
                            int kv_head, const int32_t *block_table, float scale, float *scratch,
                            const td_dtype dt) {
    const int hd = kv->head_dim, bs = kv->block_size;
    const size_t es = td_cpu_kv_es(dt), tok_bytes = (size_t)kv->n_kv_heads * hd * es;
    const char *kbase = (const char *)kv->k + (size_t)kv_head * hd * es;
    const char *vbase = (const char *)kv->v + (size_t)kv_head * hd * es;
    int maxctx = 0;
    for (int i = 0; i < n_q; i++)
        if (qs[i].n_ctx > maxctx) maxctx = qs[i].n_ctx;
    const int n_blk = (maxctx + bs - 1) / bs;
    const size_t row_bytes = (size_t)hd * es;
    int blk = 0, slot = 0;
    prefetch_block(kbase, block_table, 0, n_blk, bs, tok_bytes, row_bytes);
    for (int p = 0; p + 4 <= maxctx; p += 4) {
        __m512 kk[4][4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            if (slot == 0)
                prefetch_block(kbase, block_table, blk + 1, n_blk, bs, tok_bytes, row_bytes);
            const char *k = kbase + ((size_t)block_table[blk] * bs + slot) * tok_bytes;
            if (++slot == bs) slot = 0, blk++;
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) kk[r][j] = ld16_kv_all(k, 16 * j, dt);
        }
        for (int i = 0; i < n_q; i++) {
            if (qs[i].n_ctx < p + 4) continue;
            const float *q = qs[i].q;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int j = 0; j < 4; j++) {
                __m512 qv = _mm512_loadu_ps(q + 16 * j);
                a0 = _mm512_fmadd_ps(qv, kk[0][j], a0);
                a1 = _mm512_fmadd_ps(qv, kk[1][j], a1);
                a2 = _mm512_fmadd_ps(qv, kk[2][j], a2);
                a3 = _mm512_fmadd_ps(qv, kk[3][j], a3);
            }
            float d4[4];
            hsum512x4(a0, a1, a2, a3, d4);
            _mm_storeu_ps(scratch + (size_t)i * maxctx + p,
                          _mm_mul_ps(_mm_loadu_ps(d4), _mm_set1_ps(scale)));
        }
    }
    float *scr[6];
    for (int i = 0; i < n_q; i++) {
        float *si = scratch + (size_t)i * maxctx;
        const float *q = qs[i].q;
        for (int p = qs[i].n_ctx & ~3; p < qs[i].n_ctx; p++) { /* the single-position tail */
            const char *k = kbase + ((size_t)block_table[p / bs] * bs + p % bs) * tok_bytes;
            __m512 a0 = _mm512_setzero_ps();
            for (int j = 0; j < 4; j++)
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * j), ld16_kv_all(k, 16 * j, dt), a0);
            si[p] = hsum512(a0) * scale;
        }
        softmax_avx512(si, qs[i].n_ctx);
    }
    for (int g0 = 0; g0 < n_q; g0 += 6) {
        const int g = n_q - g0 < 6 ? n_q - g0 : 6;
        for (int i = 0; i < g; i++) scr[i] = scratch + (size_t)(g0 + i) * maxctx;
        switch (g) {
        case 1: attn_v_group(1, qs + g0, scr, vbase, block_table, bs, tok_bytes, dt); break;
        case 2: attn_v_group(2, qs + g0, scr, vbase, block_table, bs, tok_bytes, dt); break;
        case 3: attn_v_group(3, qs + g0, scr, vbase, block_table, bs, tok_bytes, dt); break;
        case 4: attn_v_group(4, qs + g0, scr, vbase, block_table, bs, tok_bytes, dt); break;
        case 5: attn_v_group(5, qs + g0, scr, vbase, block_table, bs, tok_bytes, dt); break;
        default: attn_v_group(6, qs + g0, scr, vbase, block_table, bs, tok_bytes, dt); break;
        }
    }
}

static void attn_paged_multi_avx512(const td_cpu_attn_query *qs, int n_q, const td_cpu_kv_layer *kv,
                                    int kv_head, const int32_t *block_table, float scale,
                                    float *scratch) {
    if (kv->head_dim != 64 || n_q < 2) {
        for (int i = 0; i < n_q; i++)
            attn_paged_avx512(qs[i].q, kv, kv_head, block_table, qs[i].n_ctx, scale, qs[i].out,
                              scratch);
        return;
    }
#define CALL(dt) attn_paged_multi_dt(qs, n_q, kv, kv_head, block_table, scale, scratch, dt)
    TD_KV_DTYPE_SWITCH(kv->dtype, CALL);
#undef CALL
}

const td_cpu_ops td_cpu_ops_avx512 = {
    .matmul = matmul_avx512,
    .act_quant = act_quant_avx512,
    .rmsnorm = rmsnorm_avx512,
    .swiglu = swiglu_avx512,
    .add = add_avx512,
    .scale = scale_avx512,
    .softmax = softmax_avx512,
    .kv_store = td_cpu_kv_store_avx2,
    .attn_paged = attn_paged_avx512,
    .attn_paged_multi = attn_paged_multi_avx512,
};
