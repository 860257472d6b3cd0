/* Per-ISA bodies of td_cpu_matmul_f32act (quantized weight types only). */
#ifndef TD_KERNELS_CPU_QMATMUL_IMPL_H
#define TD_KERNELS_CPU_QMATMUL_IMPL_H

#include "qmatmul.h"

/* Longest row the tiled paths dequantize into their thread-local scratch;
 * longer rows use the register path, which gives the same values. */
#define TD_QMM_KMAX 16384

typedef void (*td_qmm_fn)(td_dtype wtype, const void *w, size_t w_stride, const float *x,
                          size_t ldx, int n, int64_t k, float *y, size_t ldy, int r0, int r1);

void td_qmm_scalar(td_dtype wtype, const void *w, size_t w_stride, const float *x, size_t ldx,
                   int n, int64_t k, float *y, size_t ldy, int r0, int r1);
void td_qmm_avx2(td_dtype wtype, const void *w, size_t w_stride, const float *x, size_t ldx, int n,
                 int64_t k, float *y, size_t ldy, int r0, int r1);
/* dst[0..k) = row w of type wt dequantized by the ISA's own block
 * dequantizer, the one its matmul kernels use (for the exactness tests). */
void td_qmm_scalar_dequant_row(td_dtype wt, const void *w, float *dst, int64_t k);
void td_qmm_avx2_dequant_row(td_dtype wt, const void *w, float *dst, int64_t k);
void td_qmm_avx512_dequant_row(td_dtype wt, const void *w, float *dst, int64_t k);

void td_qmm_avx512(td_dtype wtype, const void *w, size_t w_stride, const float *x, size_t ldx,
                   int n, int64_t k, float *y, size_t ldy, int r0, int r1);

#endif
