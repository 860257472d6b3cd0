/* Helpers shared by the AVX-512 kernel files (ops-avx512.c,
 * qmatmul-avx512.c), which are built with the AVX-512 target flags: the
 * horizontal sums (one fixed tree, so a sum's bits do not depend on which
 * file or path made it) and the K super-blocks' scale unpacking. */
#ifndef TD_KERNELS_CPU_AVX512_IMPL_H
#define TD_KERNELS_CPU_AVX512_IMPL_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels/dtype.h"

/* lanes i + i+8, then i + i+4, then i + i+2, then i + i+1 */
static inline __attribute__((always_inline)) float hsum512(__m512 v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Four horizontal sums at once, each lane combined exactly as hsum512 does
 * (i + i+8, then i + i+4, then i + i+2, then i + i+1), so a pair's result
 * does not depend on which other pairs share the reduction. */
static inline __attribute__((always_inline)) void hsum512x4(__m512 a, __m512 b, __m512 c, __m512 d,
                                                            float *out) {
    __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
    v = _mm512_add_ps(v, _mm512_movehdup_ps(v));
    _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(
                           _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), v)));
}

/* The fp16 at p (any alignment), by F16C: exact, as td_cpu_h2f. */
static inline __attribute__((always_inline)) float td_avx512_h2f(const char *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* A q4_K/q5_K super-block's 6-bit scales and mins as int32 lanes:
 * [sc0 .. sc7, m0 .. m7]. The 32-bit lanes of the block's first 16 bytes are
 * [d | dmin, a, b, c], a, b, c the scale words; out of [a, c, b, c] and
 * [a, a, b, b] come the bytes sc0-3 = a & 63, sc4-7 = c & 15 | (a >> 2) & 48
 * (the top bits of a), m0-3 = b & 63, m4-7 = c >> 4 & 15 | (b >> 2) & 48. */
static inline __attribute__((always_inline)) __m512i td_avx512_k_scm(const char *bl) {
    const __m128i v = _mm_loadu_si128((const __m128i *)bl);
    const __m128i acbc = _mm_shuffle_epi32(v, _MM_SHUFFLE(3, 2, 3, 1));
    const __m128i aabb = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 2, 1, 1));
    const __m128i lo6 =
        _mm_and_si128(_mm_srlv_epi32(acbc, _mm_setr_epi32(0, 0, 0, 4)),
                      _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i hi2 =
        _mm_and_si128(_mm_srli_epi32(aabb, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm512_cvtepu8_epi32(_mm_or_si128(lo6, hi2));
}

/* A K super-block's scales as f32 (in a vector): q4_K/q5_K out[j] = d*sc_j and
 * out[8 + j] = -(dmin*m_j), j < 8; q6_K out[i] = d*scales[i], i < 16
 * (exact products). The 6-bit scales and mins are
 * unpacked four at a time from 32-bit words (kernels/dtype.h). */
static inline __attribute__((always_inline)) __m512 td_avx512_k_scales_v(const td_dtype WT,
                                                                         const char *bl) {
    if (WT == TD_TYPE_Q6_K) {
        const __m512 s =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(bl + 192))));
        return _mm512_mul_ps(_mm512_set1_ps(td_avx512_h2f(bl + 208)), s);
    }
    const __m128i v = _mm_loadu_si128((const __m128i *)bl);
    const __m512 f = _mm512_cvtepi32_ps(td_avx512_k_scm(bl));
    /* [d x 8, dmin x 8] (lanes 2, 3 of the conversion are not used) */
    const __m512 dm =
        _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                              _mm512_castps128_ps512(_mm_cvtph_ps(v)));
    /* the mins negated: exact */
    const __m512 neg = _mm512_castsi512_ps(
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN,
                          INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN));
    return _mm512_xor_ps(_mm512_mul_ps(f, dm), neg);
}

/* The same, stored to out (16 floats, 64-byte aligned). */
static inline __attribute__((always_inline)) void td_avx512_k_scales(const td_dtype WT,
                                                                     const char *bl, float *out) {
    _mm512_store_ps(out, td_avx512_k_scales_v(WT, bl));
}

#endif
