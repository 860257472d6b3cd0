/* Internals shared by the CPU kernel files: the per-ISA function table and
 * the activation row format used by the quantized matmuls. */
#ifndef TD_KERNELS_CPU_IMPL_H
#define TD_KERNELS_CPU_IMPL_H

#include <stdlib.h>
#include <string.h>

#include "cpu.h"

/* Activation row for quantized weights ("q8x"), nb = k / 32 blocks:
 *   float   d[nb]     block scale, d = amax / 127
 *   float   s[nb]     d * sum(qs of the block)   (the Q4_1 min term)
 *   int32_t sum[nb]   sum(qs of the block)        (the Q4_0 offset term)
 *   pad to 64 bytes
 *   int8_t  qs[]      q = round_half_even(x / d), in groups of four blocks:
 *                     group g (blocks 4g..4g+3) is 128 bytes, elements 0-15
 *                     of its four blocks then elements 16-31 of the four
 *                     (td_q8x_pos); a partial last group is zero-padded.
 * The group layout matches the nibble layout of Q4 weights (low nibbles =
 * elements 0-15, high = 16-31), so one vpdpbusd pair covers four blocks
 * with no shuffles. */
static inline size_t td_q8x_head_bytes(int64_t nb) { return ((size_t)nb * 12 + 63) & ~(size_t)63; }
static inline size_t td_q8x_row_bytes(int64_t nb) {
    return td_q8x_head_bytes(nb) + (((size_t)nb * 32 + 127) & ~(size_t)127);
}
/* Byte offset of element j (0..31) of block b in the qs region. */
static inline size_t td_q8x_pos(int64_t b, int j) {
    return (size_t)(b / 4) * 128 + (size_t)(j / 16) * 64 + (size_t)(b % 4) * 16 + (size_t)(j % 16);
}
static inline const float *td_q8x_d(const void *row) { return (const float *)row; }
static inline const float *td_q8x_s(const void *row, int64_t nb) { return (const float *)row + nb; }
static inline const int32_t *td_q8x_sum(const void *row, int64_t nb) {
    return (const int32_t *)row + 2 * nb;
}
static inline const int8_t *td_q8x_qs(const void *row, int64_t nb) {
    return (const int8_t *)row + td_q8x_head_bytes(nb);
}

/* A weight type the kernels do not handle is a caller bug (types are checked
 * when a model is loaded), so it is an invariant failure, not a status. */
#define TD_KERNEL_UNREACHABLE_TYPE(t) ((void)(t), abort())

/* Exact half -> float (bit manipulation, independent of any ISA). */
static inline float td_cpu_h2f(td_fp16 h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
        /* subnormal: normalise */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 0x400));
        man &= 0x3ff;
        bits = sign | ((uint32_t)(112 - e) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The fp16 at p, which may lie at any byte (no type punning). */
static inline float td_cpu_h2f_at(const void *p) {
    td_fp16 h;
    memcpy(&h, p, sizeof h);
    return td_cpu_h2f(h);
}

/* 6-bit scale and min of sub-block j (0..7) of a q4_K/q5_K super-block. */
static inline void td_k_scale_min(const uint8_t *scales, int j, int *sc_p, int *m_p) {
    if (j < 4) {
        *sc_p = scales[j] & 63;
        *m_p = scales[j + 4] & 63;
    } else {
        *sc_p = (scales[j + 4] & 15) | ((scales[j - 4] >> 6) << 4);
        *m_p = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
    }
}

/* Group b (elements 32b .. 32b + 31) of a row of quantized type t, as the
 * scalar reference dequantizes it: out[j] = element 32b + j. Every product
 * of the GGUF definitions is exact in f32 (an fp16 scale times integers of
 * at most 14 bits together), so each element rounds at most once, whatever
 * the order or fusion of its operations: every ISA's dequantizer gives
 * these bits. Defined in cpu.c. */
void td_cpu_deq_group(td_dtype t, const void *row, int64_t b, float out[32]);

/* Group b (elements 32b .. 32b + 31) of a quantized row as the int8 kernels
 * (--act-int8) take it: unsigned q[32] in element order and
 *   w_j = d[j / 16] * (q_j - off) + m
 * (d[0] == d[1] except for q6_K, whose scales cover 16 elements; m is 0
 * except for the types with a min: q4_1, q5_1, q4_K, q5_K). d and m are one
 * f32 product of the block's fp16 scale and its integer sub-block scale,
 * exact. Defined in cpu.c; the scalar and AVX2 kernels use it, the AVX-512
 * ones unpack the same values with vectors. */
typedef struct {
    uint8_t q[32];
    float d[2];
    float m;
    int off;
} td_q8w_group;
void td_cpu_q8w_group(td_dtype t, const void *row, int64_t b, td_q8w_group *g);

static inline float td_cpu_bf2f(td_bf16 h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Element i of a KV row of dtype t (F32, F16 or BF16), widened exactly. */
static inline float td_cpu_kv_elem(const void *row, size_t i, td_dtype t) {
    switch (t) {
    case TD_TYPE_F16: return td_cpu_h2f(((const td_fp16 *)row)[i]);
    case TD_TYPE_BF16: return td_cpu_bf2f(((const td_bf16 *)row)[i]);
    default: return ((const float *)row)[i];
    }
}

/* Runs CALL(dt) with dt the constant for the KV dtype t (F32 for anything
 * but F16 and BF16), so that an always-inline kernel body taking dt is
 * compiled once per dtype. */
#define TD_KV_DTYPE_SWITCH(t, CALL)                                                                \
    do {                                                                                           \
        switch (t) {                                                                               \
        case TD_TYPE_F16: CALL(TD_TYPE_F16); break;                                                \
        case TD_TYPE_BF16: CALL(TD_TYPE_BF16); break;                                              \
        default: CALL(TD_TYPE_F32); break;                                                         \
        }                                                                                          \
    } while (0)

/* Bytes of one KV element of dtype t (F32, F16 or BF16). */
static inline size_t td_cpu_kv_es(td_dtype t) { return t == TD_TYPE_F32 ? 4 : 2; }

typedef void (*td_matmul_fn)(td_dtype wtype, const void *w, size_t w_stride, const void *xq,
                             size_t xq_stride, int n, int64_t k, float *y, size_t ldy, int r0,
                             int r1);

typedef struct {
    td_matmul_fn matmul;
    void (*act_quant)(td_dtype wtype, const float *x, void *xq, int64_t k);
    void (*rmsnorm)(const float *x, const float *w, float *out, int64_t n, float eps);
    void (*swiglu)(const float *gate, const float *up, float *out, int64_t n);
    void (*add)(const float *a, const float *b, float *out, int64_t n);
    void (*scale)(float *x, float s, int64_t n);
    void (*softmax)(float *x, int64_t n);
    void (*attn_paged)(const float *q, const td_cpu_kv_layer *kv, int kv_head,
                       const int32_t *block_table, int n_ctx, float scale, float *out,
                       float *scratch);
    /* NULL: td_cpu_quant_row */
    void (*kv_store)(td_dtype t, const float *src, void *dst, int64_t n);
    /* NULL: td_cpu_attn_paged_multi loops over attn_paged */
    void (*attn_paged_multi)(const td_cpu_attn_query *qs, int n_q, const td_cpu_kv_layer *kv,
                             int kv_head, const int32_t *block_table, float scale, float *scratch);
} td_cpu_ops;

extern const td_cpu_ops td_cpu_ops_scalar;
extern const td_cpu_ops td_cpu_ops_avx2;
extern const td_cpu_ops td_cpu_ops_avx512;

/* Scalar act quantizer, shared so that every ISA produces the same q8x rows
 * (SIMD files may use their own as long as the bytes are identical). */
void td_cpu_act_quant_scalar(td_dtype wtype, const float *x, void *xq, int64_t k);

/* AVX2 kernels, reused by the AVX-512 table where 512-bit code does not help. */
void td_cpu_matmul_avx2(td_dtype wt, const void *w, size_t w_stride, const void *xq,
                        size_t xq_stride, int n, int64_t k, float *y, size_t ldy, int r0, int r1);
void td_cpu_rmsnorm_avx2(const float *x, const float *w, float *out, int64_t n, float eps);
void td_cpu_swiglu_avx2(const float *gate, const float *up, float *out, int64_t n);
void td_cpu_add_avx2(const float *a, const float *b, float *out, int64_t n);
void td_cpu_scale_avx2(float *x, float s, int64_t n);
void td_cpu_softmax_avx2(float *x, int64_t n);
void td_cpu_kv_store_avx2(td_dtype t, const float *src, void *dst, int64_t n);
void td_cpu_attn_paged_avx2(const float *q, const td_cpu_kv_layer *kv, int kv_head,
                            const int32_t *block_table, int n_ctx, float scale, float *out,
                            float *scratch);

#endif
