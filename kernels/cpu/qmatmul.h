/* Matmul with F32 activations for every weight type.
 *
 * Quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) are
 * dequantized on the fly exactly as GGUF defines them (q4_0: d*(q-8); q4_1:
 * d*q+m; q8_0: d*q; the others: kernels/dtype.h), to f32, bit for bit what
 * td_cpu_dequant_row gives, and multiplied with the f32 activations by f32 FMAs: the result is
 * an f32 GEMM of the dequantized weights, with no activation quantization
 * error. Float weights (F32, F16, BF16) are converted exactly the same way
 * by the AVX-512 kernels when k is a multiple of 32, and otherwise go to
 * td_cpu_matmul, whose activation format for them is plain f32 rows.
 *
 * Invariance (as cpu.h): for one selected ISA, the value of a (row, token)
 * pair is computed by the same sequence of roundings whatever n, r0, r1 and
 * the caller's thread split are; k is never split. Different ISAs may
 * differ in the last bits.
 * Thread-safety: reentrant after td_cpu_select(); each thread uses its own
 * thread-local dequantization scratch (no allocation). */
#ifndef TD_KERNELS_CPU_QMATMUL_H
#define TD_KERNELS_CPU_QMATMUL_H

#include <stddef.h>
#include <stdint.h>

#include "cpu.h"

#ifdef __cplusplus
extern "C" {
#endif

/* y[t * ldy + r] = sum_i dequant(W[r, i]) * x[t * ldx + i]
 * for t in [0, n), r in [r0, r1), i in [0, k).
 * w: weight rows of k elements of type wtype, row r at w + r * w_stride bytes
 * (k a multiple of the block size). x: (n, ldx) floats. y: (n, ldy) floats.
 * wtype in {F32, F16, BF16} or td_dtype_is_quant(); any other type aborts
 * (types are checked when a model is loaded). */
void td_cpu_matmul_f32act(td_dtype wtype, const void *w, size_t w_stride, const float *x,
                          size_t ldx, int n, int64_t k, float *y, size_t ldy, int r0, int r1);

/* dst[0..k) = the row src of quantized type t (td_dtype_is_quant) as the
 * matmul kernels of `isa` dequantize it, with that ISA's own block
 * dequantizer: for the tests that hold every ISA to the GGUF definition.
 * isa must have been checked with td_cpu_select (a CPU that lacks it would
 * fault). Reentrant. */
void td_cpu_dequant_row_isa(td_isa isa, td_dtype t, const void *src, float *dst, int64_t k);

#ifdef __cplusplus
}
#endif
#endif
