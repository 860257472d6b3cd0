/* Shared by the CUDA kernels (kernels/cuda only). */
#ifndef TD_KERNELS_CUDA_COMMON_CUH
#define TD_KERNELS_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "ops.h"

/* A launcher's last line: the launch's own error (bad configuration), not
 * the kernel's completion. */
static inline td_cuda_err td_cuda_launched(void) { return (td_cuda_err)cudaGetLastError(); }

/* One element of a weight row of type T as f32. */
template <typename T> __device__ __forceinline__ float td_ld(const T *p, int64_t i);
template <> __device__ __forceinline__ float td_ld<float>(const float *p, int64_t i) {
    return p[i];
}
template <> __device__ __forceinline__ float td_ld<__half>(const __half *p, int64_t i) {
    return __half2float(p[i]);
}
template <>
__device__ __forceinline__ float td_ld<__nv_bfloat16>(const __nv_bfloat16 *p, int64_t i) {
    return __bfloat162float(p[i]);
}

/* Sum over a warp: the same shuffle tree for every call. */
__device__ __forceinline__ float td_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float td_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Sum over a block of blockDim.x (a multiple of 32, at most 1024)
 * threads, in one fixed order; every thread gets the result. red: 32
 * floats of shared memory. */
__device__ __forceinline__ float td_block_sum(float v, float *red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = td_warp_sum(v);
    __syncthreads(); /* red may still be read by an earlier call */
    if (lane == 0) red[w] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : 0.0f;
    return td_warp_sum(v);
}

#endif
