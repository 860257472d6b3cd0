/* y = x W^T for F32, F16 and BF16 weights: one warp per (row, output), the
 * k products summed lane-strided in order and then by one shuffle tree, so
 * every output has the same reduction whatever the number of rows (no
 * split-K, no shape-dependent algorithm). At one row it streams each
 * weight row once, which is what decode needs; prefill shapes get a tiled
 * tensor-core kernel later, under the same rule. */
#include "common.cuh"

#define MM_WARPS 8

template <typename T>
static __global__ void matmul_kernel(const char *w, size_t stride, int64_t rows, int64_t k,
                                     const float *x, size_t ldx, float *y, size_t ldy) {
    int lane = threadIdx.x & 31;
    int64_t o = (int64_t)blockIdx.x * MM_WARPS + (threadIdx.x >> 5);
    int32_t r = blockIdx.y;
    if (o >= rows) return;
    const T *wr = (const T *)(w + (size_t)o * stride);
    const float *xr = x + (size_t)r * ldx;
    float acc = 0.0f;
    for (int64_t i = lane; i < k; i += 32) acc = fmaf(td_ld<T>(wr, i), xr[i], acc);
    acc = td_warp_sum(acc);
    if (lane == 0) y[(size_t)r * ldy + (size_t)o] = acc;
}

extern "C" td_cuda_err td_cuda_matmul(td_cuda_stream s, const void *w, td_dtype t, size_t stride,
                                      int64_t rows, int64_t k, const float *x, size_t ldx, float *y,
                                      size_t ldy, int32_t n_rows) {
    if (n_rows <= 0 || rows <= 0) return 0;
    if (n_rows > 65535) return (td_cuda_err)cudaErrorInvalidValue;
    dim3 grid((unsigned)((rows + MM_WARPS - 1) / MM_WARPS), (unsigned)n_rows);
    cudaStream_t st = (cudaStream_t)s;
    const char *wc = (const char *)w;
    switch (t) {
    case TD_TYPE_F32:
        matmul_kernel<float><<<grid, MM_WARPS * 32, 0, st>>>(wc, stride, rows, k, x, ldx, y, ldy);
        break;
    case TD_TYPE_F16:
        matmul_kernel<__half><<<grid, MM_WARPS * 32, 0, st>>>(wc, stride, rows, k, x, ldx, y, ldy);
        break;
    case TD_TYPE_BF16:
        matmul_kernel<__nv_bfloat16>
            <<<grid, MM_WARPS * 32, 0, st>>>(wc, stride, rows, k, x, ldx, y, ldy);
        break;
    default: return (td_cuda_err)cudaErrorInvalidValue;
    }
    return td_cuda_launched();
}
