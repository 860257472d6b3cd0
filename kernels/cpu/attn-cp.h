/* Attention pieces for context parallelism (DESIGN.md §3): a rank that holds
 * only some blocks of a sequence computes a partial attention over its own
 * positions, and the partials of all CP ranks merge into the exact result
 * with the max / exp-sum rescaling (never by adding outputs). The same
 * merge is the online-softmax step of ring prefill, where the K/V chunks
 * of the other ranks arrive one at a time.
 *
 * Pure compute, no allocation; the partial uses this ISA's matmul and
 * paged-attention kernels (cpu.h), the merge is scalar (head_dim values). */
#ifndef TD_KERNELS_ATTN_CP_H
#define TD_KERNELS_ATTN_CP_H

#include <stdint.h>

#include "cpu.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One partial: out normalised by its own exp-sum. */
typedef struct {
    float *out; /* (head_dim) softmax-weighted V over the visited positions */
    float m;    /* max of the scaled logits visited; -INFINITY when none */
    float s;    /* sum of exp(logit - m) over them; 0 when none */
} td_cpu_attn_part;

/* Partial attention of query q (one head, reading kv head kv_head) over
 * the positions [0, n_ctx) whose block j (positions [j*bs, (j+1)*bs)) has
 * j % stride == offset, i.e. the blocks CP rank `offset` of `stride` holds.
 * The rank's own blocks are listed in order in local_table: sequence block
 * j is local_table[j / stride]. stride 1, offset 0 is the whole context.
 * scratch: at least n_ctx floats. */
void td_cpu_attn_partial(const float *q, const td_cpu_kv_layer *kv, int kv_head,
                         const int32_t *local_table, int n_ctx, int stride, int offset, float scale,
                         td_cpu_attn_part *part, float *scratch);

#define TD_CPU_ATTN_MERGE_MAX_HEAD_DIM 1024

/* Merges n partials into out (head_dim <= TD_CPU_ATTN_MERGE_MAX_HEAD_DIM floats): with M = max m_i
 * and w_i = s_i exp(m_i - M), out = sum w_i out_i / sum w_i. Parts with s = 0 contribute nothing;
 * if every part is empty, out is zeros. The merged (m, s) go to *merged_p when it is not NULL (for
 * a further merge). out may alias parts[0].out. */
void td_cpu_attn_merge(const td_cpu_attn_part *parts, int n, int head_dim, float *out,
                       td_cpu_attn_part *merged_p);

#ifdef __cplusplus
}
#endif
#endif
