#include "attn-cp.h"

#include <math.h>
#include <string.h>

#include "cpu-impl.h"
#include "qmatmul.h"

/* The rank's positions, in order, form a virtual sequence over local_table
 * (every owned block is full except perhaps the last), so the vectorised
 * kernels of this ISA do the work: the matmul kernel scores each owned
 * block's rows against q (for the max and the exp-sum), and the paged
 * attention kernel gives the normalised weighted V over the same
 * positions. */
void td_cpu_attn_partial(const float *q, const td_cpu_kv_layer *kv, int kv_head,
                         const int32_t *local_table, int n_ctx, int stride, int offset, float scale,
                         td_cpu_attn_part *part, float *scratch) {
    const int bs = kv->block_size, hd = kv->head_dim;
    const size_t es = td_cpu_kv_es(kv->dtype), row = (size_t)kv->n_kv_heads * (size_t)hd;
    int n = 0, nb = 0;
    for (int j = offset; (int64_t)j * bs < n_ctx; j += stride, nb++) {
        int end = (j + 1) * bs < n_ctx ? bs : n_ctx - j * bs;
        const char *k = (const char *)kv->k +
                        ((size_t)local_table[nb] * (size_t)bs * row + (size_t)kv_head * hd) * es;
        td_cpu_matmul_f32act(kv->dtype, k, row * es, q, (size_t)hd, 1, hd, scratch + n, 1, 0, end);
        n += end;
    }
    memset(part->out, 0, (size_t)hd * sizeof(float));
    part->m = -INFINITY;
    part->s = 0.0f;
    if (n == 0) return;
    float m = -INFINITY, s = 0.0f;
    for (int i = 0; i < n; i++) m = fmaxf(m, scratch[i] * scale);
    for (int i = 0; i < n; i++) s += expf(scratch[i] * scale - m);
    td_cpu_attn_paged(q, kv, kv_head, local_table, n, scale, part->out, scratch);
    part->m = m;
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
