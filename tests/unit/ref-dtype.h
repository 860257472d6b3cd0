/* Scalar definitions shared by the unit tests' references: fp16 by its
 * formula and dequantization by the block layouts of kernels/dtype.h, in
 * double precision, independent of the kernels under test. */
#ifndef TD_TEST_REF_DTYPE_H
#define TD_TEST_REF_DTYPE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/dtype.h"

static inline double ref_h2f(uint16_t h) { /* IEEE binary16 by its formula */
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 0)
        v = ldexp(m, -24);
    else if (e == 31)
        v = m ? NAN : INFINITY;
    else
        v = ldexp(1024 + m, e - 25);
    return s ? -v : v;
}

/* Dequantize by the block definition (dtype.h), in double. */
static inline void ref_dequant(td_dtype t, const void *src, double *dst, int k) {
    const uint8_t *p = src;
    for (int b = 0; b < k / 32 || (b == 0 && td_dtype_block_elems(t) == 1); b++) {
        if (t == TD_TYPE_F32) {
            for (int i = 0; i < k; i++) {
                float f;
                memcpy(&f, p + 4 * i, 4);
                dst[i] = f;
            }
            return;
        }
        if (t == TD_TYPE_F16 || t == TD_TYPE_BF16) {
            for (int i = 0; i < k; i++) {
                uint16_t h;
                memcpy(&h, p + 2 * i, 2);
                if (t == TD_TYPE_F16)
                    dst[i] = ref_h2f(h);
                else {
                    uint32_t u = (uint32_t)h << 16;
                    float f;
                    memcpy(&f, &u, 4);
                    dst[i] = f;
                }
            }
            return;
        }
        uint16_t dh, mh;
        memcpy(&dh, p, 2);
        double d = ref_h2f(dh);
        if (t == TD_TYPE_Q8_0) {
            for (int j = 0; j < 32; j++) dst[b * 32 + j] = d * (int8_t)p[2 + j];
            p += 34;
        } else if (t == TD_TYPE_Q4_0) {
            for (int j = 0; j < 16; j++) {
                dst[b * 32 + j] = d * ((p[2 + j] & 15) - 8);
                dst[b * 32 + j + 16] = d * ((p[2 + j] >> 4) - 8);
            }
            p += 18;
        } else {
            memcpy(&mh, p + 2, 2);
            double m = ref_h2f(mh);
            for (int j = 0; j < 16; j++) {
                dst[b * 32 + j] = d * (p[4 + j] & 15) + m;
                dst[b * 32 + j + 16] = d * (p[4 + j] >> 4) + m;
            }
            p += 20;
        }
    }
}

#endif
