/* RoPE fused with the store into the paged KV, and paged causal attention.
 * Attention takes one block per (row, head) and walks the row's positions
 * in tiles of ATTN_TILE in order, with an online softmax: the order of
 * every sum depends on the row's position only, so a prefill chunk's row
 * and a decode row at the same position compute the same thing. */
#include "common.cuh"

#define ATTN_TILE               128 /* threads per block, positions per tile */
#define ATTN_MAX_DIM_PER_THREAD 4   /* head_dim up to 512 */

__device__ __forceinline__ size_t kv_cell(const td_cuda_kv &kv, const td_cuda_rows &rows,
                                          int32_t seq, int32_t pos, int h) {
    int32_t blk = rows.tab[rows.seq_off[seq] + pos / kv.block_size];
    return (((size_t)blk * kv.block_size + (size_t)(pos % kv.block_size)) * kv.n_kv_heads + h) *
           (size_t)kv.head_dim;
}

/* Rotates the first n_rot dims of head vector x (pairs by mode). */
__device__ void rope_head(float *x, int n_rot, int32_t pos, const float *inv_freq,
                          td_rope_mode mode) {
    int half = n_rot / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double th = (double)pos * (double)inv_freq[i];
        float c = (float)cos(th), s = (float)sin(th);
        int a = mode == TD_ROPE_NEOX ? i : 2 * i, b = mode == TD_ROPE_NEOX ? i + half : a + 1;
        float x0 = x[a], x1 = x[b];
        x[a] = x0 * c - x1 * s;
        x[b] = x0 * s + x1 * c;
    }
}

static __global__ void rope_store_kernel(float *q, float *k, float *v, const float *bq,
                                         const float *bk, const float *bv, const float *inv_freq,
                                         int nh, int nkv, int hd, int n_rot, td_rope_mode mode,
                                         td_cuda_rows rows, td_cuda_kv kv) {
    int32_t r = blockIdx.x, pos = rows.row_pos[r], seq = rows.row_seq[r];
    float *qr = q + (size_t)r * nh * hd, *kr = k + (size_t)r * nkv * hd;
    float *vr = v + (size_t)r * nkv * hd;
    /* the biases go into the rows themselves, as on the CPU */
    for (int i = threadIdx.x; i < nh * hd; i += blockDim.x)
        if (bq) qr[i] += bq[i];
    for (int i = threadIdx.x; i < nkv * hd; i += blockDim.x) {
        if (bk) kr[i] += bk[i];
        if (bv) vr[i] += bv[i];
    }
    __syncthreads();
    for (int h = 0; h < nh; h++) rope_head(qr + (size_t)h * hd, n_rot, pos, inv_freq, mode);
    for (int h = 0; h < nkv; h++) rope_head(kr + (size_t)h * hd, n_rot, pos, inv_freq, mode);
    __syncthreads();
    for (int h = 0; h < nkv; h++) {
        size_t c = kv_cell(kv, rows, seq, pos, h);
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            kv.k[c + d] = kr[(size_t)h * hd + d];
            kv.v[c + d] = vr[(size_t)h * hd + d];
        }
    }
}

extern "C" td_cuda_err td_cuda_rope_store(td_cuda_stream s, float *q, float *k, float *v,
                                          const float *bq, const float *bk, const float *bv,
                                          const float *inv_freq, int n_heads, int n_kv_heads,
                                          int head_dim, int n_rot, td_rope_mode mode,
                                          const td_cuda_rows *rows, const td_cuda_kv *kv) {
    if (rows->n_rows <= 0) return 0;
    rope_store_kernel<<<rows->n_rows, ATTN_TILE, 0, (cudaStream_t)s>>>(
        q, k, v, bq, bk, bv, inv_freq, n_heads, n_kv_heads, head_dim, n_rot, mode, *rows, *kv);
    return td_cuda_launched();
}

static __global__ void attn_kernel(const float *q, float *att, int nh, td_cuda_rows rows,
                                   td_cuda_kv kv, float scale) {
    __shared__ float qs[ATTN_TILE * ATTN_MAX_DIM_PER_THREAD];
    __shared__ float sc[ATTN_TILE];
    __shared__ float red[32];
    const int hd = kv.head_dim, tid = threadIdx.x;
    int32_t r = blockIdx.x, h = blockIdx.y, pos = rows.row_pos[r], seq = rows.row_seq[r];
    int kvh = h / (nh / kv.n_kv_heads);
    const float *qr = q + ((size_t)r * nh + h) * hd;
    for (int d = tid; d < hd; d += ATTN_TILE) qs[d] = qr[d];
    __syncthreads();
    float acc[ATTN_MAX_DIM_PER_THREAD] = {0.0f, 0.0f, 0.0f, 0.0f};
    float m = -INFINITY, l = 0.0f;
    for (int32_t p0 = 0; p0 <= pos; p0 += ATTN_TILE) {
        int32_t p = p0 + tid;
        float sv = -INFINITY;
        if (p <= pos) {
            const float *kp = kv.k + kv_cell(kv, rows, seq, p, kvh);
            float dot = 0.0f;
            for (int d = 0; d < hd; d++) dot = fmaf(qs[d], kp[d], dot);
            sv = dot * scale;
        }
        /* the tile's max: exact in any order */
        float tm = td_warp_max(sv);
        __syncthreads();
        if ((tid & 31) == 0) red[tid >> 5] = tm;
        __syncthreads();
        tm = red[0];
        for (int w = 1; w < ATTN_TILE / 32; w++) tm = fmaxf(tm, red[w]);
        float mn = fmaxf(m, tm), corr = expf(m - mn);
        float e = p <= pos ? expf(sv - mn) : 0.0f;
        sc[tid] = e;
        float ts = td_block_sum(e, red); /* also orders sc's writes before the reads */
        l = l * corr + ts;
        int32_t n = min(ATTN_TILE, pos - p0 + 1);
        for (int j = 0; j < ATTN_MAX_DIM_PER_THREAD; j++) {
            int d = tid + j * ATTN_TILE;
            if (d >= hd) break;
            float a = acc[j] * corr;
            for (int32_t t = 0; t < n; t++)
                a = fmaf(sc[t], kv.v[kv_cell(kv, rows, seq, p0 + t, kvh) + d], a);
            acc[j] = a;
        }
        m = mn;
        __syncthreads(); /* sc is rewritten by the next tile */
    }
    float *o = att + ((size_t)r * nh + h) * hd;
    for (int j = 0; j < ATTN_MAX_DIM_PER_THREAD; j++) {
        int d = tid + j * ATTN_TILE;
        if (d < hd) o[d] = acc[j] / l;
    }
}

extern "C" td_cuda_err td_cuda_attn(td_cuda_stream s, const float *q, float *att, int nh,
                                    const td_cuda_rows *rows, const td_cuda_kv *kv, float scale) {
    if (rows->n_rows <= 0) return 0;
    if (kv->head_dim > ATTN_TILE * ATTN_MAX_DIM_PER_THREAD || nh % kv->n_kv_heads)
        return (td_cuda_err)cudaErrorInvalidValue;
    dim3 grid((unsigned)rows->n_rows, (unsigned)nh);
    attn_kernel<<<grid, ATTN_TILE, 0, (cudaStream_t)s>>>(q, att, nh, *rows, *kv, scale);
    return td_cuda_launched();
}
