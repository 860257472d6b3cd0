/* AVX-512 (F/BW/VL/DQ + VNNI) kernels. */
#include <immintrin.h>

#include "cpu-impl.h"

const td_cpu_ops td_cpu_ops_avx512 = {
    .matmul = td_cpu_matmul_avx2,
    .act_quant = td_cpu_act_quant_scalar,
    .rmsnorm = td_cpu_rmsnorm_avx2,
    .swiglu = td_cpu_swiglu_avx2,
    .add = td_cpu_add_avx2,
    .scale = td_cpu_scale_avx2,
    .softmax = td_cpu_softmax_avx2,
    .attn_paged = td_cpu_attn_paged_avx2,
};
