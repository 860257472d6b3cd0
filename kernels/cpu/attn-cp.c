#include "attn-cp.h"

#include <math.h>
#include <string.h>

void td_cpu_attn_partial(const float *q, const td_cpu_kv_layer *kv, int kv_head,
                         const int32_t *local_table, int n_ctx, int stride, int offset, float scale,
                         td_cpu_attn_part *part, float *scratch) {
    const int bs = kv->block_size, hd = kv->head_dim;
    const size_t row = (size_t)kv->n_kv_heads * (size_t)hd;
    float m = -INFINITY;
    int n = 0;
    /* Logits of the visited positions, in position order. */
    for (int j = offset; (int64_t)j * bs < n_ctx; j += stride) {
        int32_t blk = local_table[j / stride];
        int end = (j + 1) * bs < n_ctx ? bs : n_ctx - j * bs;
        for (int t = 0; t < end; t++) {
            const float *k =
                kv->k + ((size_t)blk * (size_t)bs + (size_t)t) * row + (size_t)kv_head * (size_t)hd;
            float dot = 0.0f;
            for (int d = 0; d < hd; d++) dot += q[d] * k[d];
            float l = dot * scale;
            scratch[n++] = l;
            if (l > m) m = l;
        }
    }
    memset(part->out, 0, (size_t)hd * sizeof(float));
    part->m = m;
    part->s = 0.0f;
    if (n == 0) return;
    float s = 0.0f;
    for (int i = 0; i < n; i++) {
        scratch[i] = expf(scratch[i] - m);
        s += scratch[i];
    }
    int i = 0;
    for (int j = offset; (int64_t)j * bs < n_ctx; j += stride) {
        int32_t blk = local_table[j / stride];
        int end = (j + 1) * bs < n_ctx ? bs : n_ctx - j * bs;
        for (int t = 0; t < end; t++, i++) {
            const float *v =
                kv->v + ((size_t)blk * (size_t)bs + (size_t)t) * row + (size_t)kv_head * (size_t)hd;
            float w = scratch[i] / s;
            for (int d = 0; d < hd; d++) part->out[d] += w * v[d];
        }
    }
    part->s = s;
}

void td_cpu_attn_merge(const td_cpu_attn_part *parts, int n, int head_dim, float *out,
                       td_cpu_attn_part *merged_p) {
    float M = -INFINITY;
    for (int i = 0; i < n; i++)
        if (parts[i].s > 0.0f && parts[i].m > M) M = parts[i].m;
    /* Accumulate apart from out, which may alias a part. */
    float acc[TD_CPU_ATTN_MERGE_MAX_HEAD_DIM];
    memset(acc, 0, (size_t)head_dim * sizeof(float));
    float S = 0.0f;
    for (int i = 0; i < n; i++) {
        if (!(parts[i].s > 0.0f)) continue;
        float w = parts[i].s * expf(parts[i].m - M);
        S += w;
        for (int d = 0; d < head_dim; d++) acc[d] += w * parts[i].out[d];
    }
    for (int d = 0; d < head_dim; d++) out[d] = S > 0.0f ? acc[d] / S : 0.0f;
    if (merged_p) {
        merged_p->m = S > 0.0f ? M : -INFINITY;
        merged_p->s = S;
        merged_p->out = out;
    }
}
