/* x24: the K-quant matmul of CPUs with AMX-INT8, on f32 activations held
 * to 24 bits per 256-element block.
 *
 * Where it applies (td_x24_type: Q4_K, Q5_K and Q6_K weights, the AVX-512 ISA
 * selected, AMX usable by the process, td_x24_set_enabled), the matmul
 * takes each activation row as per-block fixed point: for each block of
 * 256 elements (a K-quant super-block),
 *   s = 2^(e - 23), e the exponent of the block's largest |x| (|x| < 2^e),
 *   v_i = rint(x_i / s), clamped to [-2^23, 2^23 - 1]
 * (the largest element keeps 23 of its 24 significant bits; every element
 * is within s of x_i; a block holding NaN or Inf gets s = NaN). A super-
 * block's dot product with a row is then an exact integer T = sum v_i W_i
 * over the integer weights W_i (Q4_K and Q5_K: sc_j * q_i, sub-block j of
 * 32; Q6_K: sc_j * (q_i - 32), j of 16), at most 2^43 in magnitude; the
 * kernels take it as int32 sums of the limbs L = v & 255, M = (v >> 8) &
 * 255, H = v >> 16 of v (and AMX of the bytes of W), each within int32,
 * and add them exactly. The row's value is the f32 accumulation over
 * super-blocks, in k order, of these roundings (fmaf: one rounding each):
 *   t = T rounded once to f32 (to nearest, ties to even)
 *   q = fmaf(sx_7, m_7, ... fmaf(sx_0, m_0, 0))   (Q4_K, Q5_K: sx_j the sum of v
 *       over sub-block j, as float, m_j the 6-bit mins; Q6_K: 0)
 *   u = fmaf(-q, dmin, t * d)                      (Q6_K: dmin 0)
 *   acc = fmaf(s, u, acc).
 * The integer sums do not depend on how they are computed, so AMX tiles
 * (n >= TD_X24_AMX_MIN tokens) and the AVX512-VNNI decode kernel (fewer)
 * give the same bits: the invariance contract of cpu.h holds by
 * construction.
 *
 * Activations live in one buffer per matmul call (td_x24_bytes), in AMX
 * tile order, quantized by td_x24_quant (disjoint token ranges may run on
 * different threads); one buffer serves every x24 type. Reentrant after
 * td_cpu_select (which calls td_x24_init); each thread configures its
 * tiles on first use. */
#ifndef TD_KERNELS_CPU_X24_H
#define TD_KERNELS_CPU_X24_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/types.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TD_X24_AMX_MIN 16 /* tokens from which the AMX kernel runs */

/* Called by td_cpu_select: asks Linux for the AMX tile state when the ISA
 * is AVX-512 and the CPU has AMX-INT8. */
void td_x24_init(td_isa isa);
/* The process can run x24 (AMX-INT8 present and granted). */
bool td_x24_available(void);
/* On by default (where available); off sends every matmul to the f32
 * kernels. Not thread-safe: set before use. */
void td_x24_set_enabled(bool on);
/* Weights of type t go through x24 in this process. */
bool td_x24_type(td_dtype t);

/* n token rows padded to whole 16-token tiles. */
static inline int td_x24_pad(int n) { return (n + 15) & ~15; }
/* Bytes of the activation buffer for n rows of k (a multiple of 256). */
size_t td_x24_bytes(int n, int64_t k);
/* Rows [t0, t1) of x (n rows of ldx floats) into xa; the call with
 * t1 == n also clears the padding rows. */
void td_x24_quant(const float *x, size_t ldx, int t0, int t1, int n, int64_t k, void *xa);
/* y[t * ldy + (r - r0)] = row r of W times token t, t < n, r in [r0, r1). */
void td_x24_matmul(td_dtype wt, const void *w, size_t ws, const void *xa, int n, int64_t k,
                   float *y, size_t ldy, int r0, int r1);

#ifdef __cplusplus
}
#endif
#endif
