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

static inline double ref_h2f_at(const uint8_t *p) { return ref_h2f((uint16_t)(p[0] | p[1] << 8)); }

/* One block of a q5_0, q5_1, q4_K, q5_K or q6_K row by the GGUF layout
 * (dtype.h), in double: bl is the block, dst its elements. */
static inline void ref_dequant_block5k(td_dtype t, const uint8_t *bl, double *dst) {
    if (t == TD_TYPE_Q5_0 || t == TD_TYPE_Q5_1) {
        int q51 = t == TD_TYPE_Q5_1;
        double d = ref_h2f_at(bl), m = q51 ? ref_h2f_at(bl + 2) : 0.0;
        const uint8_t *qh = bl + 2 + 2 * q51, *qs = qh + 4;
        for (int i = 0; i < 32; i++) {
            int nib = i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
            int q = nib | ((qh[i / 8] >> (i % 8)) & 1) << 4;
            dst[i] = q51 ? d * q + m : d * (q - 16);
        }
        return;
    }
    if (t == TD_TYPE_Q4_K || t == TD_TYPE_Q5_K) {
        double d = ref_h2f_at(bl), dmin = ref_h2f_at(bl + 2);
        const uint8_t *sc = bl + 4, *qh = bl + 16;
        const uint8_t *qs = bl + (t == TD_TYPE_Q5_K ? 48 : 16);
        for (int i = 0; i < 256; i++) {
            int j = i / 32, l = i % 32; /* sub-block, element */
            int s6 = j < 4 ? sc[j] & 63 : (sc[j + 4] & 15) | (sc[j - 4] >> 6) << 4;
            int m6 = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | (sc[j] >> 6) << 4;
            int byte = qs[32 * (j / 2) + l];
            int q = j % 2 ? byte >> 4 : byte & 15;
            if (t == TD_TYPE_Q5_K) q |= ((qh[l] >> j) & 1) << 4;
            dst[i] = d * s6 * q - dmin * m6;
        }
        return;
    }
    /* q6_K */
    double d = ref_h2f_at(bl + 208);
    for (int i = 0; i < 256; i++) {
        int h = i / 128, g = (i % 128) / 32, l = i % 32;
        int byte = bl[64 * h + 32 * (g % 2) + l];
        int lo = g < 2 ? byte & 15 : byte >> 4;
        int hi = (bl[128 + 32 * h + l] >> (2 * g)) & 3;
        dst[i] = d * (int8_t)bl[192 + i / 16] * ((lo | hi << 4) - 32);
    }
}

/* Dequantize by the block definition (dtype.h), in double. */
static inline void ref_dequant(td_dtype t, const void *src, double *dst, int k) {
    const uint8_t *p = src;
    if (t == TD_TYPE_Q5_0 || t == TD_TYPE_Q5_1 || t == TD_TYPE_Q4_K || t == TD_TYPE_Q5_K ||
        t == TD_TYPE_Q6_K) {
        int be = td_dtype_block_elems(t);
        for (int b = 0; b < k / be; b++)
            ref_dequant_block5k(t, p + (size_t)b * td_dtype_block_bytes(t), dst + (size_t)b * be);
        return;
    }
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
