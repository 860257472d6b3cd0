/* td_cpu_matmul_f32act: dispatch on the weight type and the selected ISA. */
#include "qmatmul-impl.h"

#include "cpu-impl.h"

void td_cpu_matmul_f32act(td_dtype wtype, const void *w, size_t w_stride, const float *x,
                          size_t ldx, int n, int64_t k, float *y, size_t ldy, int r0, int r1) {
    if (n <= 0 || r1 <= r0) return;
    if (!td_dtype_is_quant(wtype)) {
        /* Float weights: the AVX-512 kernels here take rows of a multiple of
         * 32 elements (decode streams them ~1.4x faster than td_cpu_matmul,
         * with prefetch); otherwise td_cpu_matmul, which takes plain f32
         * rows for float weights. The choice depends on k and the ISA only. */
        if (td_cpu_selected() == TD_ISA_AVX512 && k % 32 == 0) {
            td_qmm_avx512(wtype, w, w_stride, x, ldx, n, k, y, ldy, r0, r1);
            return;
        }
        td_cpu_matmul(wtype, w, w_stride, x, ldx * sizeof(float), n, k, y, ldy, r0, r1);
        return;
    }
    switch (td_cpu_selected()) {
    case TD_ISA_AVX512: td_qmm_avx512(wtype, w, w_stride, x, ldx, n, k, y, ldy, r0, r1); return;
    case TD_ISA_AVX2: td_qmm_avx2(wtype, w, w_stride, x, ldx, n, k, y, ldy, r0, r1); return;
    case TD_ISA_SCALAR: break;
    }
    td_qmm_scalar(wtype, w, w_stride, x, ldx, n, k, y, ldy, r0, r1);
}

void td_cpu_dequant_row_isa(td_isa isa, td_dtype t, const void *src, float *dst, int64_t k) {
    if (!td_dtype_is_quant(t)) TD_KERNEL_UNREACHABLE_TYPE(t);
    switch (isa) {
    case TD_ISA_AVX512: td_qmm_avx512_dequant_row(t, src, dst, k); return;
    case TD_ISA_AVX2: td_qmm_avx2_dequant_row(t, src, dst, k); return;
    case TD_ISA_SCALAR: break;
    }
    td_qmm_scalar_dequant_row(t, src, dst, k);
}
