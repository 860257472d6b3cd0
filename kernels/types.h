/* Types every backend shares (CPU and, later, CUDA): element types, the RoPE
 * pairing, the CPU instruction sets a kernel set is built for, and the
 * scalar fp16 / bf16 conversions. Pure: no dependencies on common/. */
#ifndef TD_KERNELS_TYPES_H
#define TD_KERNELS_TYPES_H

#include "dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* RoPE pairing of the first n_rot dims of a head.
 * NORM (GPT-J / GGUF llama): pairs (2i, 2i+1).
 * NEOX (HF llama, qwen2): pairs (i, i + n_rot/2). */
typedef enum { TD_ROPE_NORM = 0, TD_ROPE_NEOX = 2 } td_rope_mode;

/* CPU kernel sets (the CPU backend selects one per process). */
typedef enum {
    TD_ISA_SCALAR = 0,
    TD_ISA_AVX2 = 1,   /* AVX2 + FMA + F16C */
    TD_ISA_AVX512 = 2, /* AVX-512 F/BW/VL (+VNNI where present) */
} td_isa;

/* Scalar conversions (defined with the CPU kernels; exact, round to nearest even). */
float td_fp16_to_f32(td_fp16 h);
td_fp16 td_f32_to_fp16(float f);
float td_bf16_to_f32(td_bf16 h);
td_bf16 td_f32_to_bf16(float f);

#ifdef __cplusplus
}
#endif
#endif
