/* Row-wise kernels: embedding gather, RMSNorm, residual add, SwiGLU, row
 * copies, the vocab-parallel head placement. One block per row where a row
 * is reduced, so a row's result never depends on the other rows. */
#include "common.cuh"

#define ROW_THREADS 256

template <typename T>
static __global__ void embed_kernel(const char *w, size_t stride, int32_t v0, int32_t v1,
                                    const int32_t *tok, int n, float *x) {
    int32_t r = blockIdx.x, t = tok[r];
    float *xr = x + (size_t)r * (size_t)n;
    bool mine = t >= v0 && t < v1;
    const T *wr = mine ? (const T *)(w + (size_t)(t - v0) * stride) : NULL;
    for (int i = threadIdx.x; i < n; i += blockDim.x) xr[i] = mine ? td_ld<T>(wr, i) : 0.0f;
}

static td_cuda_err launch_embed(cudaStream_t s, const void *w, td_dtype t, size_t stride,
                                int32_t v0, int32_t v1, const int32_t *tok, int32_t n_rows, int n,
                                float *x) {
    if (n_rows <= 0) return 0;
    const char *wc = (const char *)w;
    switch (t) {
    case TD_TYPE_F32:
        embed_kernel<float><<<n_rows, ROW_THREADS, 0, s>>>(wc, stride, v0, v1, tok, n, x);
        break;
    case TD_TYPE_F16:
        embed_kernel<__half><<<n_rows, ROW_THREADS, 0, s>>>(wc, stride, v0, v1, tok, n, x);
        break;
    case TD_TYPE_BF16:
        embed_kernel<__nv_bfloat16><<<n_rows, ROW_THREADS, 0, s>>>(wc, stride, v0, v1, tok, n, x);
        break;
    default: return (td_cuda_err)cudaErrorInvalidValue;
    }
    return td_cuda_launched();
}

extern "C" td_cuda_err td_cuda_embed(td_cuda_stream s, const void *w, td_dtype t, size_t stride,
                                     int32_t v0, int32_t v1, const int32_t *tok, int32_t n_rows,
                                     int n, float *x) {
    return launch_embed((cudaStream_t)s, w, t, stride, v0, v1, tok, n_rows, n, x);
}

static __global__ void rmsnorm_kernel(float *x, const float *add, float *xn, const int32_t *rows,
                                      int n, float eps, const float *w) {
    __shared__ float red[32];
    int32_t r = blockIdx.x, src = rows ? rows[r] : r;
    float *xr = x + (size_t)src * (size_t)n;
    const float *ar = add ? add + (size_t)r * (size_t)n : NULL; /* as the CPU backend */
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xr[i];
        if (ar) xr[i] = v = v + ar[i];
        ss += v * v;
    }
    ss = td_block_sum(ss, red);
    float inv = rsqrtf(ss / (float)n + eps);
    float *o = xn + (size_t)r * (size_t)n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = xr[i] * inv * (w ? w[i] : 1.0f);
}

extern "C" td_cuda_err td_cuda_rmsnorm(td_cuda_stream s, float *x, const float *add, float *xn,
                                       const int32_t *rows, int32_t n_rows, const float *w, int n,
                                       float eps) {
    if (n_rows <= 0) return 0;
    rmsnorm_kernel<<<n_rows, ROW_THREADS, 0, (cudaStream_t)s>>>(x, add, xn, rows, n, eps, w);
    return td_cuda_launched();
}

static __global__ void add_kernel(float *x, const float *y, size_t total) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] += y[i];
}

static __global__ void swiglu_kernel(float *g, const float *u, size_t total) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        float a = g[i];
        g[i] = a / (1.0f + expf(-a)) * u[i];
    }
}

static unsigned grid_for(size_t total) {
    size_t b = (total + ROW_THREADS - 1) / ROW_THREADS;
    return (unsigned)(b < 65535 ? (b ? b : 1) : 65535);
}

extern "C" td_cuda_err td_cuda_add(td_cuda_stream s, float *x, const float *y, int32_t n_rows,
                                   int n) {
    size_t total = (size_t)(n_rows > 0 ? n_rows : 0) * (size_t)n;
    if (total == 0) return 0;
    add_kernel<<<grid_for(total), ROW_THREADS, 0, (cudaStream_t)s>>>(x, y, total);
    return td_cuda_launched();
}

extern "C" td_cuda_err td_cuda_swiglu(td_cuda_stream s, float *g, const float *u, int32_t n_rows,
                                      int n) {
    size_t total = (size_t)(n_rows > 0 ? n_rows : 0) * (size_t)n;
    if (total == 0) return 0;
    swiglu_kernel<<<grid_for(total), ROW_THREADS, 0, (cudaStream_t)s>>>(g, u, total);
    return td_cuda_launched();
}

static __global__ void copy_rows_kernel(char *dst, const char *src, const int32_t *rows,
                                        size_t row_bytes) {
    int32_t i = blockIdx.x;
    const char *sr = src + (size_t)rows[i] * row_bytes;
    char *dr = dst + (size_t)i * row_bytes;
    for (size_t b = threadIdx.x; b < row_bytes; b += blockDim.x) dr[b] = sr[b];
}

extern "C" td_cuda_err td_cuda_copy_rows(td_cuda_stream s, void *dst, const void *src,
                                         const int32_t *rows, int32_t n, size_t row_bytes) {
    if (n <= 0) return 0;
    copy_rows_kernel<<<n, ROW_THREADS, 0, (cudaStream_t)s>>>((char *)dst, (const char *)src, rows,
                                                             row_bytes);
    return td_cuda_launched();
}

static __global__ void head_place_kernel(float *logits, const float *buf, int32_t n_rows,
                                         int32_t width, int32_t n_vocab) {
    int32_t r = blockIdx.x;
    for (int32_t v = threadIdx.x; v < n_vocab; v += blockDim.x) {
        int32_t b = v / width;
        logits[(size_t)r * n_vocab + v] =
            buf[((size_t)b * n_rows + r) * (size_t)width + (size_t)(v % width)];
    }
}

extern "C" td_cuda_err td_cuda_head_place(td_cuda_stream s, float *logits, const float *buf,
                                          int32_t n_rows, int32_t width, int32_t n_vocab,
                                          int vocab_tp) {
    (void)vocab_tp; /* the blocks are width wide, the last ones short of n_vocab */
    if (n_rows <= 0) return 0;
    head_place_kernel<<<n_rows, ROW_THREADS, 0, (cudaStream_t)s>>>(logits, buf, n_rows, width,
                                                                   n_vocab);
    return td_cuda_launched();
}

extern "C" const char *td_cuda_err_name(td_cuda_err e) {
    return cudaGetErrorString((cudaError_t)e);
}
