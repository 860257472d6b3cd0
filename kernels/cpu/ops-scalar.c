/* Scalar reference kernels: plain C, one (row, token) dot at a time. */
#include <math.h>

#include "cpu-impl.h"

static float dot_q8x_scalar(td_dtype wt, const void *wrow, const void *xrow, int64_t nb) {
    const float *xd = td_q8x_d(xrow), *xs = td_q8x_s(xrow, nb);
    const int8_t *xq = td_q8x_qs(xrow, nb);
    const int has_min = td_dtype_has_min(wt);
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        td_q8w_group g;
        td_cpu_q8w_group(wt, wrow, b, &g);
        int32_t is[2] = {0, 0};
        for (int j = 0; j < 32; j++) is[j / 16] += (g.q[j] - g.off) * xq[td_q8x_pos(b, j)];
        if (wt == TD_TYPE_Q6_K) /* a scale per 16 elements */
            acc += g.d[0] * xd[b] * (float)is[0] + g.d[1] * xd[b] * (float)is[1];
        else if (has_min)
            acc += g.d[0] * xd[b] * (float)(is[0] + is[1]) + g.m * xs[b];
        else
            acc += g.d[0] * xd[b] * (float)(is[0] + is[1]);
    }
    return acc;
}

static float dot_float_scalar(td_dtype wt, const void *wrow, const float *x, int64_t k) {
    float acc = 0.0f;
    if (wt == TD_TYPE_F32) {
        const float *w = wrow;
        for (int64_t i = 0; i < k; i++) acc += w[i] * x[i];
    } else if (wt == TD_TYPE_F16) {
        const td_fp16 *w = wrow;
        for (int64_t i = 0; i < k; i++) acc += td_cpu_h2f(w[i]) * x[i];
    } else {
        const td_bf16 *w = wrow;
        for (int64_t i = 0; i < k; i++) acc += td_cpu_bf2f(w[i]) * x[i];
    }
    return acc;
}

static void matmul_scalar(td_dtype wt, const void *w, size_t w_stride, const void *xq,
                          size_t xq_stride, int n, int64_t k, float *y, size_t ldy, int r0,
                          int r1) {
    bool quant = td_dtype_has_int8_kernels(wt);
    if (!quant && wt != TD_TYPE_F32 && wt != TD_TYPE_F16 && wt != TD_TYPE_BF16)
        TD_KERNEL_UNREACHABLE_TYPE(wt);
    for (int r = r0; r < r1; r++) {
        const char *wrow = (const char *)w + (size_t)r * w_stride;
        for (int t = 0; t < n; t++) {
            const char *xrow = (const char *)xq + (size_t)t * xq_stride;
            y[(size_t)t * ldy + r] = quant ? dot_q8x_scalar(wt, wrow, xrow, k / 32)
                                           : dot_float_scalar(wt, wrow, (const float *)xrow, k);
        }
    }
}

static void rmsnorm_scalar(const float *x, const float *w, float *out, int64_t n, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float r = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
    for (int64_t i = 0; i < n; i++) out[i] = w ? x[i] * r * w[i] : x[i] * r;
}

static void swiglu_scalar(const float *gate, const float *up, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

static void add_scalar(const float *a, const float *b, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

static void scale_scalar(float *x, float s, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

static void softmax_scalar(float *x, int64_t n) {
    if (n <= 0) return;
    float mx = x[0];
    for (int64_t i = 1; i < n; i++) mx = fmaxf(mx, x[i]);
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    float inv = (float)(1.0 / sum);
    for (int64_t i = 0; i < n; i++) x[i] *= inv;
}

static void attn_paged_scalar(const float *q, const td_cpu_kv_layer *kv, int kv_head,
                              const int32_t *block_table, int n_ctx, float scale, float *out,
                              float *scratch) {
    const int hd = kv->head_dim, bs = kv->block_size;
    const td_dtype dt = kv->dtype;
    const size_t es = td_cpu_kv_es(dt), tok_stride = (size_t)kv->n_kv_heads * hd;
    for (int p = 0; p < n_ctx; p++) {
        size_t off =
            ((size_t)block_table[p / bs] * bs + p % bs) * tok_stride + (size_t)kv_head * hd;
        const char *k = (const char *)kv->k + off * es;
        float s = 0.0f;
        for (int i = 0; i < hd; i++) s += q[i] * td_cpu_kv_elem(k, (size_t)i, dt);
        scratch[p] = s * scale;
    }
    softmax_scalar(scratch, n_ctx);
    for (int i = 0; i < hd; i++) out[i] = 0.0f;
    for (int p = 0; p < n_ctx; p++) {
        size_t off =
            ((size_t)block_table[p / bs] * bs + p % bs) * tok_stride + (size_t)kv_head * hd;
        const char *v = (const char *)kv->v + off * es;
        float a = scratch[p];
        for (int i = 0; i < hd; i++) out[i] += a * td_cpu_kv_elem(v, (size_t)i, dt);
    }
}

const td_cpu_ops td_cpu_ops_scalar = {
    .matmul = matmul_scalar,
    .act_quant = td_cpu_act_quant_scalar,
    .rmsnorm = rmsnorm_scalar,
    .swiglu = swiglu_scalar,
    .add = add_scalar,
    .scale = scale_scalar,
    .softmax = softmax_scalar,
    .attn_paged = attn_paged_scalar,
};
