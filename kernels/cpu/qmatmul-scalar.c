/* Scalar reference of the F32-activation quantized matmul.
 *
 * Each (row, token) pair has eight lane accumulators, lane l taking the
 * elements l, l + 8, l + 16, ... in k order, summed at the end in one fixed
 * tree; the pair's arithmetic does not depend on n, r0 or r1. */
#include "cpu-impl.h"
#include "qmatmul-impl.h"

#define SL 8  /* lanes per pair */
#define ST 16 /* tokens sharing one dequantized block */

void td_qmm_scalar_dequant_row(td_dtype wt, const void *w, float *dst, int64_t k) {
    for (int64_t b = 0; b < k / 32; b++) td_cpu_deq_group(wt, w, b, dst + b * 32);
}

void td_qmm_scalar(td_dtype wtype, const void *w, size_t w_stride, const float *x, size_t ldx,
                   int n, int64_t k, float *y, size_t ldy, int r0, int r1) {
    const int64_t nb = k / 32;
    for (int r = r0; r < r1; r++) {
        const char *wr = (const char *)w + (size_t)r * w_stride;
        for (int tc = 0; tc < n; tc += ST) {
            const int tt = n - tc < ST ? n - tc : ST;
            float acc[ST][SL];
            memset(acc, 0, sizeof acc);
            for (int64_t b = 0; b < nb; b++) {
                float wf[32];
                td_cpu_deq_group(wtype, wr, b, wf);
                for (int t = 0; t < tt; t++) {
                    const float *xt = x + (size_t)(tc + t) * ldx + (size_t)b * 32;
                    for (int j = 0; j < 32; j++) acc[t][j % SL] += wf[j] * xt[j];
                }
            }
            for (int t = 0; t < tt; t++) {
                const float *a = acc[t];
                y[(size_t)(tc + t) * ldy + (size_t)r] =
                    ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
            }
        }
    }
}
