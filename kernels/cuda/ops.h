/* The CUDA kernels' C entries (the .cu files of kernels/cuda): pure compute on device
 * memory, each launched on the caller's stream and checked at launch. Every
 * reduction runs in one fixed order whatever the number of rows, so a row's
 * result does not depend on the batch it is in (the invariance contract of
 * the CPU kernels). Only common/backend/backend-cuda.c calls these. */
#ifndef TD_KERNELS_CUDA_OPS_H
#define TD_KERNELS_CUDA_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/dtype.h"
#include "kernels/types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st *td_cuda_stream;

/* Status of the last launch on this thread: 0, or the cudaError_t. */
typedef int td_cuda_err;

/* x[r] = row tok[r] - v0 of the (v1 - v0, n) embedding w of type t (stride
 * bytes per row), zeros for tokens outside [v0, v1). */
td_cuda_err td_cuda_embed(td_cuda_stream s, const void *w, td_dtype t, size_t stride, int32_t v0,
                          int32_t v1, const int32_t *tok, int32_t n_rows, int n, float *x);

/* For each of n_rows rows (row r, or rows[r] when rows is not NULL): when
 * add is not NULL x += add first; xn = x / rms(x) * w. */
td_cuda_err td_cuda_rmsnorm(td_cuda_stream s, float *x, const float *add, float *xn,
                            const int32_t *rows, int32_t n_rows, const float *w, int n, float eps);

/* x += y over n_rows x n */
td_cuda_err td_cuda_add(td_cuda_stream s, float *x, const float *y, int32_t n_rows, int n);

/* g = silu(g) * u over n_rows x n */
td_cuda_err td_cuda_swiglu(td_cuda_stream s, float *g, const float *u, int32_t n_rows, int n);

/* y[r][o] = dot(w row o, x[r]) over k, for o < rows: w of type t (F32, F16
 * or BF16, stride bytes per row), one warp per output with a fixed lane
 * order and a fixed shuffle tree. */
td_cuda_err td_cuda_matmul(td_cuda_stream s, const void *w, td_dtype t, size_t stride, int64_t rows,
                           int64_t k, const float *x, size_t ldx, float *y, size_t ldy,
                           int32_t n_rows);

/* The paged KV of one layer: (n_blocks, block_size, n_kv_heads, head_dim) f32. */
typedef struct {
    float *k, *v;
    int block_size, n_kv_heads, head_dim;
} td_cuda_kv;

/* The batch's rows (device arrays of n_rows): sequence and position; the
 * sequences' block tables, tab[seq_off[s] .. ) for sequence s. */
typedef struct {
    const int32_t *row_seq, *row_pos;
    const int32_t *tab, *seq_off;
    int32_t n_rows;
} td_cuda_rows;

/* Adds the biases into q, k and v (NULL: none), rotates q and k
 * (inv_freq: n_rot / 2 on the device) and stores each row's k and v at its
 * position. */
td_cuda_err td_cuda_rope_store(td_cuda_stream s, float *q, float *k, float *v, const float *bq,
                               const float *bk, const float *bv, const float *inv_freq, int n_heads,
                               int n_kv_heads, int head_dim, int n_rot, td_rope_mode mode,
                               const td_cuda_rows *rows, const td_cuda_kv *kv);

/* Causal attention of every row over positions 0 .. its own, one block
 * per (row, head), positions in order in fixed chunks (one reduction order
 * for prefill chunks and decode rows alike). */
td_cuda_err td_cuda_attn(td_cuda_stream s, const float *q, float *att, int nh,
                         const td_cuda_rows *rows, const td_cuda_kv *kv, float scale);

/* dst row i = src row rows[i] (row_bytes each) */
td_cuda_err td_cuda_copy_rows(td_cuda_stream s, void *dst, const void *src, const int32_t *rows,
                              int32_t n, size_t row_bytes);

/* logits (n_rows, n_vocab) from vocab_tp blocks (n_rows, width) of buf */
td_cuda_err td_cuda_head_place(td_cuda_stream s, float *logits, const float *buf, int32_t n_rows,
                               int32_t width, int32_t n_vocab, int vocab_tp);

/* The name of an error the entries returned. */
const char *td_cuda_err_name(td_cuda_err e);

#ifdef __cplusplus
}
#endif

#endif
