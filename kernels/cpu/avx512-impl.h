/* Horizontal sums shared by the AVX-512 kernel files (ops-avx512.c,
 * qmatmul-avx512.c), which are built with the AVX-512 target flags: one
 * fixed tree, so a sum's bits do not depend on which file or path made it. */
#ifndef TD_KERNELS_CPU_AVX512_IMPL_H
#define TD_KERNELS_CPU_AVX512_IMPL_H

#include <immintrin.h>

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

#endif
