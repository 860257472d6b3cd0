/* CPU kernels: pure compute, no I/O, no allocation, no threads.
 *
 * Every op has a scalar reference; SIMD variants (AVX2+FMA+F16C, AVX-512)
 * are selected once at start-up with td_cpu_select() and used for the life
 * of the process. Callers parallelise by giving each thread a disjoint range
 * of output rows (matmul) or heads (attention); no kernel ever splits a
 * reduction dimension, so results are bit-identical for any thread count
 * and any batch composition (the invariance contract):
 *   - a dot product of a given (row, token) pair is computed by the same
 *     instruction sequence whatever n, r0, r1 are;
 *   - the code path never depends on the batch size n.
 * Thread-safety: all functions are reentrant after td_cpu_select(). */
#ifndef TD_KERNELS_CPU_H
#define TD_KERNELS_CPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Best ISA this CPU supports. */
td_isa td_cpu_isa_best(void);
/* Parse "scalar" | "avx2" | "avx512"; returns -1 if unknown. */
int td_cpu_isa_parse(const char *name);
const char *td_cpu_isa_name(td_isa isa);
/* Select the kernel set for the process. Returns false (and changes nothing)
 * if this CPU cannot run `isa`. Call once before any other kernel. */
bool td_cpu_select(td_isa isa);
td_isa td_cpu_selected(void);

/* ---- conversions (td_fp16_to_f32 and the others: ../types.h) ---- */
/* dst[0..k) = dequantized row of type t (k a multiple of the block size). */
void td_cpu_dequant_row(td_dtype t, const void *src, float *dst, int64_t k);
/* Quantize a float row with ggml's reference rounding (for tests/tools).
 * t in {F32, F16, BF16, Q8_0, Q4_0, Q4_1}. */
void td_cpu_quant_row(td_dtype t, const float *src, void *dst, int64_t k);

/* ---- matmul ----
 * Activations are converted once per token row into the format that pairs
 * with the weight type: for every quantized type one int8 format (per
 * 32-element block a scale, its sum and the bytes: cpu-impl.h "q8x"), so
 * rows made for one quantized type serve every other; F32 for float
 * weights. td_cpu_act_row_bytes tells the row size. */
size_t td_cpu_act_row_bytes(td_dtype wtype, int64_t k);
void td_cpu_act_quant(td_dtype wtype, const float *x, void *xq, int64_t k);

/* y[t * ldy + r] = dot(W row r, x row t) for t in [0, n), r in [r0, r1).
 * w: weight rows of k elements of type wtype, row r at w + r * w_stride bytes.
 * xq: n activation rows made by td_cpu_act_quant, row t at xq + t * xq_stride.
 * y: (n, ldy) floats. The SIMD kernels keep unpacked weight tiles and
 * per-token scale vectors on the stack: up to about 160 KiB per call. */
void td_cpu_matmul(td_dtype wtype, const void *w, size_t w_stride, const void *xq, size_t xq_stride,
                   int n, int64_t k, float *y, size_t ldy, int r0, int r1);

/* ---- elementwise / normalisation ---- */
/* out = x / sqrt(mean(x^2) + eps) * w   (w may be NULL: no scale) */
void td_cpu_rmsnorm(const float *x, const float *w, float *out, int64_t n, float eps);
/* out = silu(gate) * up */
void td_cpu_swiglu(const float *gate, const float *up, float *out, int64_t n);
/* out = a + b (out may alias a) */
void td_cpu_add(const float *a, const float *b, float *out, int64_t n);
/* x[i] *= s */
void td_cpu_scale(float *x, float s, int64_t n);
/* In-place softmax over n values. */
void td_cpu_softmax(float *x, int64_t n);

/* ---- RoPE ----
 * x: (n_heads, head_dim) for one token at position pos. Rotates the first
 * n_rot dims of each head. inv_freq[i], i < n_rot/2, is the angular
 * frequency of pair i (already including any RoPE scaling); mode: ../types.h. */
void td_cpu_rope(float *x, int n_heads, int head_dim, int n_rot, int32_t pos, const float *inv_freq,
                 td_rope_mode mode);

/* ---- attention over a paged KV cache ----
 * One layer's K and V each live in one region laid out as
 * (n_blocks, block_size, n_kv_heads, head_dim) elements of the cache's
 * dtype (F32, F16 or BF16), so that a run of consecutive blocks is
 * contiguous. The kernels widen each element to f32 exactly and compute in
 * f32, so a dtype changes only the values stored, never the arithmetic. */
typedef struct {
    const void *k;  /* (n_blocks, block_size, n_kv_heads, head_dim) */
    const void *v;  /* (n_blocks, block_size, n_kv_heads, head_dim) */
    td_dtype dtype; /* of the K and V elements: F32, F16 or BF16 */
    int block_size;
    int n_kv_heads;
    int head_dim;
} td_cpu_kv_layer;

/* Stores n f32 values as the KV dtype t (F32, F16 or BF16), rounding to
 * nearest even: the same bits on every ISA as td_cpu_quant_row. */
void td_cpu_kv_store(td_dtype t, const float *src, void *dst, int64_t n);

/* out = softmax(q . K[0..n_ctx)^T * scale) . V[0..n_ctx) for one query head
 * reading kv head `kv_head`. Position p lives in block block_table[p /
 * block_size], slot p % block_size. scratch: at least n_ctx floats. */
void td_cpu_attn_paged(const float *q, const td_cpu_kv_layer *kv, int kv_head,
                       const int32_t *block_table, int n_ctx, float scale, float *out,
                       float *scratch);

/* Several queries over the same KV head of one sequence (e.g. the query
 * heads of a GQA group, for the tokens of a prefill chunk): query i reads
 * q[i], writes out[i] and attends to positions [0, n_ctx[i]). Results are
 * bit-identical to td_cpu_attn_paged called once per query; K/V rows are
 * loaded once for all of them. scratch: at least n_q * max(n_ctx) floats. */
typedef struct {
    const float *q; /* (head_dim) */
    float *out;     /* (head_dim) */
    int n_ctx;
} td_cpu_attn_query;
void td_cpu_attn_paged_multi(const td_cpu_attn_query *qs, int n_q, const td_cpu_kv_layer *kv,
                             int kv_head, const int32_t *block_table, float scale, float *scratch);

#ifdef __cplusplus
}
#endif
#endif
