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
    TD_TYPE_Q8_0 = 8,
    TD_TYPE_BF16 = 30,
    TD_TYPE_COUNT = 40, /* upper bound of GGUF type ids we recognise by name */
} td_dtype;

typedef uint16_t td_fp16; /* IEEE half, raw bits */
typedef uint16_t td_bf16; /* bfloat16, raw bits */

#define TD_QK4_0 32
#define TD_QK4_1 32
#define TD_QK8_0 32

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

#ifdef __cplusplus /* the CUDA kernels include this header */
#define TD_DTYPE_STATIC_ASSERT static_assert
#else
#define TD_DTYPE_STATIC_ASSERT _Static_assert
#endif
TD_DTYPE_STATIC_ASSERT(sizeof(td_block_q4_0) == 18, "q4_0 block");
TD_DTYPE_STATIC_ASSERT(sizeof(td_block_q4_1) == 20, "q4_1 block");
TD_DTYPE_STATIC_ASSERT(sizeof(td_block_q8_0) == 34, "q8_0 block");

/* A block-quantized weight type (Q4_0, Q4_1, Q8_0). */
static inline int td_dtype_is_quant(td_dtype t) {
    return t == TD_TYPE_Q4_0 || t == TD_TYPE_Q4_1 || t == TD_TYPE_Q8_0;
}

/* Elements per block (1 for unquantized types), 0 for unsupported ids. */
static inline int td_dtype_block_elems(td_dtype t) {
    switch (t) {
    case TD_TYPE_F32:
    case TD_TYPE_F16:
    case TD_TYPE_BF16: return 1;
    case TD_TYPE_Q4_0:
    case TD_TYPE_Q4_1:
    case TD_TYPE_Q8_0: return 32;
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
    case TD_TYPE_Q8_0: return sizeof(td_block_q8_0);
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
