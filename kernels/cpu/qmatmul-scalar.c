/* Scalar reference of the F32-activation quantized matmul.
 *
 * Each (row, token) pair has eight lane accumulators, lane l taking the
 * elements l, l + 8, l + 16, ... in k order, summed at the end in one fixed
 * tree; the pair's arithmetic does not depend on n, r0 or r1. */
#include "cpu-impl.h"
#include "qmatmul-impl.h"

#define SL 8  /* lanes per pair */
#define ST 16 /* tokens sharing one dequantized block */

/* The products d*q are exact in f32 (an 11-bit scale times an integer of at
 * most 8 bits), so d*q + m rounds once, like an FMA. */
static void deq_block(td_dtype t, const char *row, int64_t b, float *out) {
    switch (t) {
    case TD_TYPE_Q4_0: {
        const td_block_q4_0 *bl = (const td_block_q4_0 *)row + b;
        float d = td_cpu_h2f(bl->d);
        for (int j = 0; j < 16; j++) {
            out[j] = (float)((bl->qs[j] & 15) - 8) * d;
            out[j + 16] = (float)((bl->qs[j] >> 4) - 8) * d;
        }
        return;
    }
    case TD_TYPE_Q4_1: {
        const td_block_q4_1 *bl = (const td_block_q4_1 *)row + b;
        float d = td_cpu_h2f(bl->d), m = td_cpu_h2f(bl->m);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)(bl->qs[j] & 15) + m;
            out[j + 16] = d * (float)(bl->qs[j] >> 4) + m;
        }
        return;
    }
    case TD_TYPE_Q8_0: {
        const td_block_q8_0 *bl = (const td_block_q8_0 *)row + b;
        float d = td_cpu_h2f(bl->d);
        for (int j = 0; j < 32; j++) out[j] = d * (float)bl->qs[j];
        return;
    }
    default: TD_KERNEL_UNREACHABLE_TYPE(t);
    }
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
                deq_block(wtype, wr, b, wf);
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
