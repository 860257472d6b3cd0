/* Tensor element types. The numeric values are GGUF's (ggml_type) so that a
 * type read from a GGUF file maps directly; safetensors dtypes map onto the
 * same enum. Block layouts are GGUF's, bit for bit. Pure: no dependencies. */
#ifndef TD_DTYPE_H
#define TD_DTYPE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    TD_TYPE_F32 = 0,
    TD_TYPE_F16 = 1,
    TD_TYPE_Q4_0 = 2,
    TD_TYPE_Q4_1 = 3,
    TD_TYPE_Q5_0 = 6,
    TD_TYPE_Q5_1 = 7,
    TD_TYPE_Q8_0 = 8,
    TD_TYPE_Q4_K = 12,
    TD_TYPE_Q5_K = 13,
    TD_TYPE_Q6_K = 14,
    TD_TYPE_BF16 = 30,
    TD_TYPE_COUNT = 40, /* upper bound of GGUF type ids we recognise by name */
} td_dtype;

typedef uint16_t td_fp16; /* IEEE half, raw bits */
typedef uint16_t td_bf16; /* bfloat16, raw bits */

#define TD_QK4_0        32
#define TD_QK4_1        32
#define TD_QK5_0        32
#define TD_QK5_1        32
#define TD_QK8_0        32
#define TD_QK_K         256 /* elements of a K-quant super-block */
#define TD_K_SCALE_SIZE 12

typedef struct {
    td_fp16 d;                /* scale */
    uint8_t qs[TD_QK4_0 / 2]; /* nibbles: low nibble = element j, high = element j+16 */
} td_block_q4_0;

typedef struct {
    td_fp16 d; /* scale */
    td_fp16 m; /* min */
    uint8_t qs[TD_QK4_1 / 2];
} td_block_q4_1;

typedef struct {
    td_fp16 d;
    int8_t qs[TD_QK8_0];
} td_block_q8_0;

/* q = (nibble | bit << 4): element j < 16 is the low nibble of qs[j] with
 * bit j of the little-endian qh, element j + 16 the high nibble with bit
 * j + 16. q5_0: d*(q-16); q5_1: d*q+m. */
typedef struct {
    td_fp16 d;
    uint8_t qh[4];
    uint8_t qs[TD_QK5_0 / 2];
} td_block_q5_0;

typedef struct {
    td_fp16 d;
    td_fp16 m;
    uint8_t qh[4];
    uint8_t qs[TD_QK5_1 / 2];
} td_block_q5_1;

/* K-quants: a super-block of 256 elements in sub-blocks. q4_K and q5_K: 8
 * sub-blocks of 32 with 6-bit scales sc and mins m packed in scales[12]
 * (sub-block j < 4: sc = scales[j] & 63, m = scales[j + 4] & 63; j >= 4:
 * sc = scales[j + 4] & 15 | (scales[j - 4] >> 6) << 4, m = scales[j + 4] >> 4
 * | (scales[j] >> 6) << 4); element value d*sc*q - dmin*m. qs holds four
 * 64-element chunks of 32 bytes: sub-block 2c in the low nibbles of chunk
 * c, 2c + 1 in the high ones; q5_K's fifth bit of element l of sub-block j
 * is bit j of qh[l]. */
typedef struct {
    td_fp16 d;
    td_fp16 dmin;
    uint8_t scales[TD_K_SCALE_SIZE];
    uint8_t qs[TD_QK_K / 2];
} td_block_q4_K;

typedef struct {
    td_fp16 d;
    td_fp16 dmin;
    uint8_t scales[TD_K_SCALE_SIZE];
    uint8_t qh[TD_QK_K / 8];
    uint8_t qs[TD_QK_K / 2];
} td_block_q5_K;

/* q6_K: 16 sub-blocks of 16 with int8 scales, value d*scales[s]*(q - 32).
 * Two halves of 128 elements (ql 64 bytes, qh 32 bytes, scales 8 each):
 * element 32g + l (g < 4, l < 32) of a half takes the low (g < 2) or high
 * nibble of ql[l + 32 (g & 1)], bits 2g, 2g + 1 of qh[l] above it, and
 * scale 2g + l / 16 of its half. d comes last. Rows of 210-byte (q6_K) or
 * 22-byte (q5_0) blocks leave blocks without 4-byte alignment: kernels
 * read the fields wider than a byte with memcpy. */
typedef struct {
    uint8_t ql[TD_QK_K / 2];
    uint8_t qh[TD_QK_K / 4];
    int8_t scales[TD_QK_K / 16];
    td_fp16 d;
} td_block_q6_K;

#ifdef __cplusplus /* the CUDA kernels include this header */
#define TD_DTYPE_STATIC_ASSERT static_assert
#else
#define TD_DTYPE_STATIC_ASSERT _Static_assert
#endif
TD_DTYPE_STATIC_ASSERT(sizeof(td_block_q4_0) == 18, "q4_0 block");
TD_DTYPE_STATIC_ASSERT(sizeof(td_block_q4_1) == 20, "q4_1 block");
TD_DTYPE_STATIC_ASSERT(sizeof(td_block_q8_0) == 34, "q8_0 block");
TD_DTYPE_STATIC_ASSERT(sizeof(td_block_q5_0) == 22, "q5_0 block");
TD_DTYPE_STATIC_ASSERT(sizeof(td_block_q5_1) == 24, "q5_1 block");
TD_DTYPE_STATIC_ASSERT(sizeof(td_block_q4_K) == 144, "q4_K block");
TD_DTYPE_STATIC_ASSERT(sizeof(td_block_q5_K) == 176, "q5_K block");
TD_DTYPE_STATIC_ASSERT(sizeof(td_block_q6_K) == 210, "q6_K block");

/* A block-quantized weight type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
 * Q5_K, Q6_K). */
static inline int td_dtype_is_quant(td_dtype t) {
    return t == TD_TYPE_Q4_0 || t == TD_TYPE_Q4_1 || t == TD_TYPE_Q5_0 || t == TD_TYPE_Q5_1 ||
           t == TD_TYPE_Q8_0 || t == TD_TYPE_Q4_K || t == TD_TYPE_Q5_K || t == TD_TYPE_Q6_K;
}

/* The quantized types whose value has a min: d * q + m (q4_1, q5_1), or a
 * K block's d*sc*q - dmin*m per sub-block (q4_K, q5_K). */
static inline int td_dtype_has_min(td_dtype t) {
    return t == TD_TYPE_Q4_1 || t == TD_TYPE_Q5_1 || t == TD_TYPE_Q4_K || t == TD_TYPE_Q5_K;
}

/* The quantized types the int8-activation kernels (--act-int8) take: all
 * of them (activations in 32-element blocks, td_cpu_act_quant). The
 * unquantized types run on f32 activations. */
static inline int td_dtype_has_int8_kernels(td_dtype t) { return td_dtype_is_quant(t); }

/* Elements per block (1 for unquantized types), 0 for unsupported ids. */
static inline int td_dtype_block_elems(td_dtype t) {
    switch (t) {
    case TD_TYPE_F32:
    case TD_TYPE_F16:
    case TD_TYPE_BF16: return 1;
    case TD_TYPE_Q4_0:
    case TD_TYPE_Q4_1:
    case TD_TYPE_Q5_0:
    case TD_TYPE_Q5_1:
    case TD_TYPE_Q8_0: return 32;
    case TD_TYPE_Q4_K:
    case TD_TYPE_Q5_K:
    case TD_TYPE_Q6_K: return TD_QK_K;
    default: return 0;
    }
}

/* Bytes per block, 0 for unsupported ids. */
static inline size_t td_dtype_block_bytes(td_dtype t) {
    switch (t) {
    case TD_TYPE_F32: return 4;
    case TD_TYPE_F16:
    case TD_TYPE_BF16: return 2;
    case TD_TYPE_Q4_0: return sizeof(td_block_q4_0);
    case TD_TYPE_Q4_1: return sizeof(td_block_q4_1);
    case TD_TYPE_Q5_0: return sizeof(td_block_q5_0);
    case TD_TYPE_Q5_1: return sizeof(td_block_q5_1);
    case TD_TYPE_Q8_0: return sizeof(td_block_q8_0);
    case TD_TYPE_Q4_K: return sizeof(td_block_q4_K);
    case TD_TYPE_Q5_K: return sizeof(td_block_q5_K);
    case TD_TYPE_Q6_K: return sizeof(td_block_q6_K);
    default: return 0;
    }
}

/* Byte offsets, within a block of quantized type t, of its fp16 fields
 * (the scale d, and the min m or dmin where the type has one): returns
 * their count (0 for a type that is not quantized). */
static inline int td_dtype_fp16_fields(td_dtype t, int off[2]) {
    switch (t) {
    case TD_TYPE_Q4_0:
    case TD_TYPE_Q5_0:
    case TD_TYPE_Q8_0: off[0] = 0; return 1;
    case TD_TYPE_Q6_K: off[0] = 208; return 1;
    case TD_TYPE_Q4_1:
    case TD_TYPE_Q5_1:
    case TD_TYPE_Q4_K:
    case TD_TYPE_Q5_K:
        off[0] = 0;
        off[1] = 2;
        return 2;
    default: return 0;
    }
}

static inline int td_dtype_supported(int t) {
    return t >= 0 && td_dtype_block_elems((td_dtype)t) != 0;
}

/* Name of a GGUF type id (also for ids we do not support, e.g. "q4_K"),
 * "unknown" otherwise. Defined in kernels/cpu/dtype-names.c. */
const char *td_dtype_name(int t);

/* Bytes of a row of n elements; 0 if n is not a multiple of the block size
 * or the type is unsupported. */
static inline size_t td_dtype_row_bytes(td_dtype t, int64_t n) {
    int be = td_dtype_block_elems(t);
    if (be == 0 || n < 0 || n % be != 0) return 0;
    return (size_t)(n / be) * td_dtype_block_bytes(t);
}

#ifdef __cplusplus
}
#endif
#endif
