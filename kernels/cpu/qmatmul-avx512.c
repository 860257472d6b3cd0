/* AVX-512 F32-activation quantized matmul.
 *
 * Each (row, token) pair owns one 16-lane f32 accumulator: lane j takes the
 * elements j, j + 16, ... in k order (one FMA of the dequantized weights
 * with the activations per 16 elements), then one fixed horizontal sum.
 * Two paths produce those same roundings:
 *   - register path (few tokens, decode): each weight block is dequantized
 *     in registers and used at once, so the weights stream from memory once;
 *     quantized rows four at a time (kern_reg_q: one row alone waits on its
 *     accumulator's FMA latency; with the per-block scale conversion moved
 *     out of the loop, four rows decode 1.4x faster than one on the Intel
 *     host; the q5 and K types: kern_reg_q5, kern_reg_k), float rows one
 *     at a time;
 *   - tiled path (prefill): a tile of weight rows is dequantized once per
 *     token chunk into a thread-local f32 scratch (the q5 and K types with
 *     the register kernels' own group code, deq_row_5k), and a rows x
 *     tokens FMA micro-kernel runs over it.
 * Dequantization is exact up to the single rounding of d*q + m (or d*sc*q
 * - dmin*m), the same in both paths, so the choice of path (made from n)
 * never changes a value. */
#include <immintrin.h>

#include "avx512-impl.h"
#include "cpu-impl.h"
#include "qmatmul-impl.h"

#define AI     static inline __attribute__((always_inline))

#define RR     4            /* weight rows per tile */
#define TREG   3            /* tokens per tile, register path (one weight row per tile) */
#define TBUF   6            /* tokens per tile, tiled path */
#define MIN_TB 4            /* tokens from which the tiled path is used */
#define XCHUNK (512 * 1024) /* activation bytes of one token chunk (L2) */
/* Register path: prefetch this far ahead of each weight row (into the next
 * row tiles). Measured on 2 threads, SmolLM2-135M decode: none 65 / 1024
 * 94 / 2048-4096 ~105 tokens/s for Q8_0, 1024 125 / 3072 133 for Q4_1. On
 * weights streamed from DRAM (td-bench-kernels -a -w 8 -n 1 -S 600000x896,
 * 571 MB, the Intel host with AMX, 4 alternated runs) 3072 reads 15-18.6
 * GB/s, 8192 17-23, 12288 16-25 (td-membw: 22.3); the Qwen2.5 0.5B's Q8_0
 * head is such a read, 145 MB a token. */
#define PF_DIST 12288

/* fp16 -> f32 in all 16 lanes: a broadcast load and one conversion (exact,
 * like _cvtsh_ss, with half the instructions). */
AI __m512 bcast_h(const td_fp16 *p) { return _mm512_cvtph_ps(_mm256_set1_epi16((short)*p)); }

static _Thread_local _Alignas(64) float g_wf[RR * TD_QMM_KMAX]; /* (RR, k) dequantized rows */

/* One quantized block at blk, its scale d (and Q4_1's min m) already in
 * every lane: lo = elements 0-15, hi = elements 16-31. Q4: the 16 values a
 * nibble can stand for, then one permute per 16 elements (vpermps reads
 * only the low 4 bits of each index lane: the low nibble needs no mask, the
 * high one comes down by a 4-bit shift of the same widened bytes). The
 * table entries are the same roundings as dequantizing each element. */
AI void deq_quant(const td_dtype WT, const char *blk, __m512 d, __m512 m, __m512 *lo, __m512 *hi) {
    if (WT == TD_TYPE_Q8_0) {
        const int8_t *qs = ((const td_block_q8_0 *)blk)->qs;
        *lo = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs))), d);
        *hi = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)))),
            d);
        return;
    }
    const uint8_t *qs =
        WT == TD_TYPE_Q4_0 ? ((const td_block_q4_0 *)blk)->qs : ((const td_block_q4_1 *)blk)->qs;
    const __m512i i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    const __m512 tab =
        WT == TD_TYPE_Q4_0
            ? _mm512_mul_ps(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7),
                            d)
            : _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              d, m);
    *lo = _mm512_permutexvar_ps(i0, tab);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(i0, 4), tab);
}

/* Block b of a row: lo = elements 0-15, hi = elements 16-31. */
AI void deq_block(const td_dtype WT, const char *row, int64_t b, __m512 *lo, __m512 *hi) {
    /* float types: 32-element groups, converted exactly */
    if (WT == TD_TYPE_F32) {
        *lo = _mm512_loadu_ps((const float *)row + b * 32);
        *hi = _mm512_loadu_ps((const float *)row + b * 32 + 16);
        return;
    }
    if (WT == TD_TYPE_F16 || WT == TD_TYPE_BF16) {
        const __m256i *p = (const __m256i *)((const td_fp16 *)row + b * 32);
        __m256i h0 = _mm256_loadu_si256(p), h1 = _mm256_loadu_si256(p + 1);
        if (WT == TD_TYPE_F16) {
            *lo = _mm512_cvtph_ps(h0);
            *hi = _mm512_cvtph_ps(h1);
        } else {
            *lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h0), 16));
            *hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h1), 16));
        }
        return;
    }
    /* quantized: d (and Q4_1's m, adjacent) lead every block */
    const char *blk = row + (size_t)b * td_dtype_block_bytes(WT);
    deq_quant(WT, blk, bcast_h((const td_fp16 *)blk),
              WT == TD_TYPE_Q4_1 ? bcast_h(&((const td_block_q4_1 *)blk)->m) : _mm512_setzero_ps(),
              lo, hi);
}

/* Full-height tiles reduce four rows at once (the same tree per sum). */
AI void tile_store(const int R, const int T, __m512 acc[RR][TBUF], float *y, size_t ldy) {
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) {
        if (R == 4) {
            hsum512x4(acc[0][t], acc[1][t], acc[2][t], acc[3][t], y + (size_t)t * ldy);
            continue;
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) y[(size_t)t * ldy + (size_t)r] = hsum512(acc[r][t]);
    }
}

/* Register path: R rows x T tokens straight from the weight blocks. */
AI void kern_reg(const td_dtype WT, const int R, const int T, const char *w, size_t ws,
                 const float *x, size_t ldx, int64_t nb, float *y, size_t ldy) {
    /* bytes of 32 elements (of a super-block's share for the K-quants) */
    const size_t BS = td_dtype_block_bytes(WT) * 32 / (size_t)td_dtype_block_elems(WT);
    __m512 acc[RR][TBUF];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 wl[RR], wh[RR];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            _mm_prefetch(w + (size_t)r * ws + (size_t)b * BS + PF_DIST, _MM_HINT_T0);
            deq_block(WT, w + (size_t)r * ws, b, &wl[r], &wh[r]);
        }
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            const float *xt = x + (size_t)t * ldx + (size_t)b * 32;
            __m512 xl = _mm512_loadu_ps(xt), xh = _mm512_loadu_ps(xt + 16);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                acc[r][t] = _mm512_fmadd_ps(wl[r], xl, acc[r][t]);
                acc[r][t] = _mm512_fmadd_ps(wh[r], xh, acc[r][t]);
            }
        }
    }
    tile_store(R, T, acc, y, ldy);
}

/* Register path for the quantized types: R weight rows side by side (the
 * FMA chain of one (row, token) accumulator is sequential, so one row alone
 * waits on its latency), each row's blocks in k order. The scales (and
 * Q4_1's mins) of 16 blocks of a row are widened to f32 by one gather and
 * conversion, and each block takes its own by broadcast loads, where
 * deq_block converts them per block with shuffles; both then dequantize
 * with deq_quant. Every element's value and the order of each
 * accumulator's FMAs are deq_block's and kern_reg's, so the bits are the
 * same. */
AI void kern_reg_q(const td_dtype WT, const int R, const int T, const char *w, size_t ws,
                   const float *x, size_t ldx, int64_t nb, float *y, size_t ldy) {
    const size_t BS = td_dtype_row_bytes(WT, 32);
    const int NS = WT == TD_TYPE_Q4_1 ? 2 : 1; /* halves widened per block: d (, m) */
    __m512 acc[RR][TBUF];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    _Alignas(64) float sc[RR][32];
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int n = nb - b0 < 16 ? (int)(nb - b0) : 16;
        const __mmask16 gm = (__mmask16)((1u << n) - 1);
        const __m512i gi = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32((int)BS));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const char *wr = w + (size_t)r * ws + (size_t)b0 * BS;
            const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), gm, gi, wr, 1);
            if (NS == 2) {
                _mm512_store_ps(sc[r], _mm512_cvtph_ps(_mm512_castsi512_si256(g)));
                _mm512_store_ps(sc[r] + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(g, 1)));
            } else {
                _mm512_store_ps(sc[r], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)));
            }
        }
        for (int i = 0; i < n; i++) {
            __m512 lo[RR], hi[RR];
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const char *blk = w + (size_t)r * ws + (size_t)(b0 + i) * BS;
                _mm_prefetch(blk + PF_DIST, _MM_HINT_T0);
                const __m512 d = _mm512_set1_ps(sc[r][NS * i]);
                deq_quant(WT, blk, d, NS == 2 ? _mm512_set1_ps(sc[r][2 * i + 1]) : d, &lo[r],
                          &hi[r]);
            }
#pragma GCC unroll 8
            for (int t = 0; t < T; t++) {
                const float *xt = x + (size_t)t * ldx + (size_t)(b0 + i) * 32;
                const __m512 xl = _mm512_loadu_ps(xt), xh = _mm512_loadu_ps(xt + 16);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    acc[r][t] = _mm512_fmadd_ps(lo[r], xl, acc[r][t]);
                    acc[r][t] = _mm512_fmadd_ps(hi[r], xh, acc[r][t]);
                }
            }
        }
    }
    tile_store(R, T, acc, y, ldy);
}

/* The q5 and K types: R rows side by side, each value exactly the GGUF
 * definition's (td_cpu_deq_group: every product is exact, so each element
 * rounds once; test_dequant_gguf holds the tiled path's rows to gguf-py,
 * test_qmatmul the register path to the tiled one), and each
 * accumulator's FMAs in k order as kern_reg's.
 * Where a group's values are one table lookup (a 4-bit index, or 4 bits
 * plus a fifth under a mask), a 16-entry table of d*q (+ m) per sub-block
 * is made with one multiply or FMA (the same single rounding as per
 * element) and each 16 elements are one or two permutes of it, as
 * deq_quant does for q4_0/q4_1. */

/* The FMAs of group b for R rows x T tokens. */
AI void fma_group(const int R, const int T, const __m512 *lo, const __m512 *hi, const float *x,
                  size_t ldx, int64_t b, __m512 acc[RR][TBUF]) {
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * ldx + (size_t)b * 32;
        const __m512 xl = _mm512_loadu_ps(xt), xh = _mm512_loadu_ps(xt + 16);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            acc[r][t] = _mm512_fmadd_ps(lo[r], xl, acc[r][t]);
            acc[r][t] = _mm512_fmadd_ps(hi[r], xh, acc[r][t]);
        }
    }
}

/* Groups 2c (lo[0], hi[0]) and 2c + 1 (lo[1], hi[1]) of the q4_K/q5_K
 * super-block bl, whose k_scales are sc: per 64-element chunk c, its 32
 * quant bytes widened once serve both groups (low nibbles, high nibbles). */
AI void k45_chunk(const td_dtype WT, const char *bl, const float *sc, const int c, __m512 lo[2],
                  __m512 hi[2]) {
    const int Q5 = WT == TD_TYPE_Q5_K;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const char *qs = bl + 16 + 32 * Q5 + 32 * c;
    const __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    const __m512i q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)));
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const int j = 2 * c + h;
        /* high nibbles shifted down; a permute reads the low 4 bits only */
        const __m512i i0 = h ? _mm512_srli_epi32(q0, 4) : q0;
        const __m512i i1 = h ? _mm512_srli_epi32(q1, 4) : q1;
        const __m512 ds = _mm512_set1_ps(sc[j]), ndm = _mm512_set1_ps(sc[8 + j]);
        const __m512 tab = _mm512_fmadd_ps(iota, ds, ndm);
        lo[h] = _mm512_permutexvar_ps(i0, tab);
        hi[h] = _mm512_permutexvar_ps(i1, tab);
        if (Q5) { /* the fifth bit: bit j of qh[l] takes the upper table */
            const __m128i bit = _mm_set1_epi8((char)(1 << j));
            const __m512 tabh =
                _mm512_fmadd_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.0f)), ds, ndm);
            lo[h] = _mm512_mask_permutexvar_ps(
                lo[h], _mm_test_epi8_mask(_mm_loadu_si128((const __m128i *)(bl + 16)), bit), i0,
                tabh);
            hi[h] = _mm512_mask_permutexvar_ps(
                hi[h], _mm_test_epi8_mask(_mm_loadu_si128((const __m128i *)(bl + 32)), bit), i1,
                tabh);
        }
    }
}

/* Group g of half `half` of the q6_K super-block bl (k_scales sc): its 32
 * six-bit quants assembled as bytes (nibbles of ql, two bits of qh),
 * widened 16 at a time and scaled per 16-element sub-block. */
AI void q6k_group(const char *bl, const float *sc, const int half, const int g, __m512 *lo,
                  __m512 *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(bl + 64 * half + 32 * (g & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(bl + 128 + 32 * half));
    const __m256i nib =
        g < 2 ? _mm256_and_si256(ql, m4) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4);
    const __m256i hb = g == 0   ? _mm256_slli_epi16(qh, 4)
                       : g == 1 ? _mm256_slli_epi16(qh, 2)
                       : g == 2 ? qh
                                : _mm256_srli_epi16(qh, 2);
    const __m256i q =
        _mm256_sub_epi8(_mm256_or_si256(nib, _mm256_and_si256(hb, m30)), _mm256_set1_epi8(32));
    *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))),
                        _mm512_set1_ps(sc[8 * half + 2 * g]));
    *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))),
                        _mm512_set1_ps(sc[8 * half + 2 * g + 1]));
}

/* The q5_0/q5_1 block bl: q5_0 d*(q - 16), q5_1 d*q + m (one rounding),
 * as deq_quant does for q4: the 32 values a 5-bit q can stand for, in two
 * tables (q < 16, q >= 16) made with one product or FMA per entry, the
 * same rounding as per element (q5_0: (q - 16) * d, exact operands, so
 * q = 16 gives d's signed zero as the definition does); each 16 elements
 * are then one two-table permute, whose index is the nibble in bits 0-3
 * and the element's qh bit, rotated into bit 4 (vpermt2ps reads bits 0-4
 * only). */
AI void q5_block_dm(const td_dtype WT, const char *bl, __m512 dv, __m512 m, __m512 *lo,
                    __m512 *hi) {
    const int Q51 = WT == TD_TYPE_Q5_1;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 sixteen = _mm512_set1_ps(16.0f);
    const __m512 ta =
        Q51 ? _mm512_fmadd_ps(iota, dv, m) : _mm512_mul_ps(_mm512_sub_ps(iota, sixteen), dv);
    const __m512 tb =
        Q51 ? _mm512_fmadd_ps(_mm512_add_ps(iota, sixteen), dv, m) : _mm512_mul_ps(iota, dv);
    int32_t qh;
    memcpy(&qh, bl + 2 + 2 * Q51, 4);
    const __m512i qv = _mm512_set1_epi32(qh);
    const __m512i i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(bl + 6 + 2 * Q51)));
    /* lane j: bit j of qh (elements 0-15), bit 16 + j (16-31), to bit 4 */
    const __m512i hl = _mm512_rolv_epi32(
        qv, _mm512_setr_epi32(4, 3, 2, 1, 0, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21));
    const __m512i hh = _mm512_rolv_epi32(
        qv, _mm512_setr_epi32(20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5));
    const __m512i nib = _mm512_set1_epi32(15);
    /* 0xE4: bits of the first operand where the third has ones, else the second's */
    const __m512i x0 = _mm512_ternarylogic_epi32(i0, hl, nib, 0xE4);
    const __m512i x1 = _mm512_ternarylogic_epi32(_mm512_srli_epi32(i0, 4), hh, nib, 0xE4);
    *lo = _mm512_permutex2var_ps(ta, x0, tb);
    *hi = _mm512_permutex2var_ps(ta, x1, tb);
}

/* The same with the block's own d (and m). */
AI void q5_block(const td_dtype WT, const char *bl, __m512 *lo, __m512 *hi) {
    const __m512 dv = _mm512_set1_ps(td_avx512_h2f(bl));
    q5_block_dm(WT, bl, dv, WT == TD_TYPE_Q5_1 ? _mm512_set1_ps(td_avx512_h2f(bl + 2)) : dv, lo,
                hi);
}

/* The register kernel of the K types: R rows side by side, a super-block
 * at a time. The scales of super-block sb + 1 are made while sb is
 * multiplied, so that a table's scale is never loaded right after the
 * store of its vector (a store forwarded to a narrower load stalls). */
AI void kern_reg_k(const td_dtype WT, const int R, const int T, const char *w, size_t ws,
                   const float *x, size_t ldx, int64_t nb, float *y, size_t ldy) {
    const size_t BB = td_dtype_block_bytes(WT);
    __m512 acc[RR][TBUF];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    _Alignas(64) float scb[2][RR][16];
    const int64_t nsb = nb / 8;
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) td_avx512_k_scales(WT, w + (size_t)r * ws, scb[0][r]);
    for (int64_t sb = 0; sb < nsb; sb++) {
        float(*sc)[16] = scb[sb & 1];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const char *bl = w + (size_t)r * ws + (size_t)sb * BB;
            for (size_t o = 0; o < BB; o += 64) _mm_prefetch(bl + PF_DIST + o, _MM_HINT_T0);
            if (sb + 1 < nsb) td_avx512_k_scales(WT, bl + BB, scb[(sb + 1) & 1][r]);
        }
        if (WT == TD_TYPE_Q6_K) {
#pragma GCC unroll 8
            for (int gg = 0; gg < 8; gg++) {
                __m512 lo[RR], hi[RR];
#pragma GCC unroll 8
                for (int r = 0; r < R; r++)
                    q6k_group(w + (size_t)r * ws + (size_t)sb * BB, sc[r], gg / 4, gg % 4, &lo[r],
                              &hi[r]);
                fma_group(R, T, lo, hi, x, ldx, sb * 8 + gg, acc);
            }
            continue;
        }
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            __m512 lo[RR][2], hi[RR][2];
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                k45_chunk(WT, w + (size_t)r * ws + (size_t)sb * BB, sc[r], c, lo[r], hi[r]);
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m512 l[RR], u[RR];
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    l[r] = lo[r][h];
                    u[r] = hi[r][h];
                }
                fma_group(R, T, l, u, x, ldx, sb * 8 + 2 * c + h, acc);
            }
        }
    }
    tile_store(R, T, acc, y, ldy);
}

/* The scales (and q5_1's mins) of blocks b0 .. b0 + 15 of a q5 row,
 * widened by one gather (d and m are adjacent: one 32-bit lane a block)
 * and one conversion, as kern_reg_q does for q4_0/q4_1. */
AI void q5_scales(const td_dtype WT, const char *row, int64_t b0, int64_t nb, float *d, float *m) {
    const size_t BB = td_dtype_block_bytes(WT);
    const int n = nb - b0 < 16 ? (int)(nb - b0) : 16;
    const __m512i gi =
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32((int)BB));
    const __m512i g = _mm512_mask_i32gather_epi32(
        _mm512_setzero_si512(), (__mmask16)((1u << n) - 1), gi, row + (size_t)b0 * BB, 1);
    _mm512_store_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)));
    if (WT == TD_TYPE_Q5_1)
        _mm512_store_ps(m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16))));
}

/* The register kernel of q5_0 and q5_1: 16 blocks' scales at a time, made
 * 16 blocks ahead (as kern_reg_k's), each block's taken by broadcast. */
AI void kern_reg_q5(const td_dtype WT, const int R, const int T, const char *w, size_t ws,
                    const float *x, size_t ldx, int64_t nb, float *y, size_t ldy) {
    const size_t BB = td_dtype_block_bytes(WT);
    const int Q51 = WT == TD_TYPE_Q5_1;
    __m512 acc[RR][TBUF];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    _Alignas(64) float dd[2][RR][16], mm[2][RR][16];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) q5_scales(WT, w + (size_t)r * ws, 0, nb, dd[0][r], mm[0][r]);
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int cur = (int)(b0 / 16) & 1;
        if (b0 + 16 < nb)
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                q5_scales(WT, w + (size_t)r * ws, b0 + 16, nb, dd[cur ^ 1][r], mm[cur ^ 1][r]);
        const int n = nb - b0 < 16 ? (int)(nb - b0) : 16;
        for (int i = 0; i < n; i++) {
            const int64_t b = b0 + i;
            __m512 lo[RR], hi[RR];
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const char *bl = w + (size_t)r * ws + (size_t)b * BB;
                _mm_prefetch(bl + PF_DIST, _MM_HINT_T0);
                const __m512 dv = _mm512_set1_ps(dd[cur][r][i]);
                q5_block_dm(WT, bl, dv, Q51 ? _mm512_set1_ps(mm[cur][r][i]) : dv, &lo[r], &hi[r]);
            }
            fma_group(R, T, lo, hi, x, ldx, b, acc);
        }
    }
    tile_store(R, T, acc, y, ldy);
}

/* A row of the q5 and K types dequantized for the tiled path by the
 * register kernels' own group code (so both paths give the same values):
 * a row's super-block scales first, then its groups. */
static void deq_row_5k(td_dtype wt, const char *row, int64_t k, float *dst) {
    if (wt == TD_TYPE_Q5_0 || wt == TD_TYPE_Q5_1) {
        const size_t BB = td_dtype_block_bytes(wt);
        for (int64_t b = 0; b < k / 32; b++) {
            __m512 lo, hi;
            if (wt == TD_TYPE_Q5_0)
                q5_block(TD_TYPE_Q5_0, row + (size_t)b * BB, &lo, &hi);
            else
                q5_block(TD_TYPE_Q5_1, row + (size_t)b * BB, &lo, &hi);
            _mm512_storeu_ps(dst + b * 32, lo);
            _mm512_storeu_ps(dst + b * 32 + 16, hi);
        }
        return;
    }
    const size_t BB = td_dtype_block_bytes(wt);
    for (int64_t sb = 0; sb < k / 256; sb++) {
        const char *bl = row + (size_t)sb * BB;
        float *d = dst + sb * 256;
        _Alignas(64) float sc[16];
        if (wt == TD_TYPE_Q6_K) {
            td_avx512_k_scales(TD_TYPE_Q6_K, bl, sc);
            for (int g = 0; g < 8; g++) {
                __m512 lo, hi;
                q6k_group(bl, sc, g / 4, g % 4, &lo, &hi);
                _mm512_storeu_ps(d + 32 * g, lo);
                _mm512_storeu_ps(d + 32 * g + 16, hi);
            }
            continue;
        }
        if (wt == TD_TYPE_Q4_K)
            td_avx512_k_scales(TD_TYPE_Q4_K, bl, sc);
        else
            td_avx512_k_scales(TD_TYPE_Q5_K, bl, sc);
        for (int c = 0; c < 4; c++) {
            __m512 lo[2], hi[2];
            if (wt == TD_TYPE_Q4_K)
                k45_chunk(TD_TYPE_Q4_K, bl, sc, c, lo, hi);
            else
                k45_chunk(TD_TYPE_Q5_K, bl, sc, c, lo, hi);
            for (int h = 0; h < 2; h++) {
                _mm512_storeu_ps(d + 64 * c + 32 * h, lo[h]);
                _mm512_storeu_ps(d + 64 * c + 32 * h + 16, hi[h]);
            }
        }
    }
}

/* Tiled path: R rows of dequantized weights wf (row stride k) x T tokens. */
AI void kern_buf(const int R, const int T, const float *wf, const float *x, size_t ldx, int64_t k,
                 float *y, size_t ldy) {
    __m512 acc[RR][TBUF];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
        __m512 wv[RR];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) wv[r] = _mm512_load_ps(wf + (size_t)r * (size_t)k + i);
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            __m512 xv = _mm512_loadu_ps(x + (size_t)t * ldx + i);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
    tile_store(R, T, acc, y, ldy);
}

/* float rows one at a time (kern_reg), quantized rows up to RR at a time
 * (kern_reg_q) */
#define REG_CASE(KERN, WT, R, T)                                                                   \
    case (R)*8 + (T):                                                                              \
        KERN(WT, R, T, w, ws, x, ldx, nb, y, ldy);                                                 \
        return;
#define REG_ROW(KERN, WT, R)                                                                       \
    REG_CASE(KERN, WT, R, 1) REG_CASE(KERN, WT, R, 2) REG_CASE(KERN, WT, R, 3)
#define DEF_REG(NAME, WT, CASES)                                                                   \
    static void NAME(int R, int T, const char *w, size_t ws, const float *x, size_t ldx,           \
                     int64_t nb, float *y, size_t ldy) {                                           \
        switch (R * 8 + T) { CASES(WT) default : abort(); }                                        \
    }
#define FLOAT_CASES(WT) REG_ROW(kern_reg, WT, 1)
#define ROWS4_CASES(KERN, WT)                                                                      \
    REG_ROW(KERN, WT, 1) REG_ROW(KERN, WT, 2) REG_ROW(KERN, WT, 3) REG_ROW(KERN, WT, 4)
#define Q5_CASES(WT) ROWS4_CASES(kern_reg_q5, WT)
#define K_CASES(WT)  ROWS4_CASES(kern_reg_k, WT)
#define QUANT_CASES(WT)                                                                            \
    REG_ROW(kern_reg_q, WT, 1)                                                                     \
    REG_ROW(kern_reg_q, WT, 2) REG_ROW(kern_reg_q, WT, 3) REG_ROW(kern_reg_q, WT, 4)
DEF_REG(reg_q40, TD_TYPE_Q4_0, QUANT_CASES)
DEF_REG(reg_q41, TD_TYPE_Q4_1, QUANT_CASES)
DEF_REG(reg_q80, TD_TYPE_Q8_0, QUANT_CASES)
DEF_REG(reg_q50, TD_TYPE_Q5_0, Q5_CASES)
DEF_REG(reg_q51, TD_TYPE_Q5_1, Q5_CASES)
DEF_REG(reg_q4k, TD_TYPE_Q4_K, K_CASES)
DEF_REG(reg_q5k, TD_TYPE_Q5_K, K_CASES)
DEF_REG(reg_q6k, TD_TYPE_Q6_K, K_CASES)
DEF_REG(reg_f32, TD_TYPE_F32, FLOAT_CASES)
DEF_REG(reg_f16, TD_TYPE_F16, FLOAT_CASES)
DEF_REG(reg_bf16, TD_TYPE_BF16, FLOAT_CASES)

#define BUF_CASE(R, T)                                                                             \
    case (R)*8 + (T):                                                                              \
        kern_buf(R, T, wf, x, ldx, k, y, ldy);                                                     \
        return;
#define BUF_ROW(R)                                                                                 \
    BUF_CASE(R, 1) BUF_CASE(R, 2) BUF_CASE(R, 3) BUF_CASE(R, 4) BUF_CASE(R, 5) BUF_CASE(R, 6)
static void run_buf(int R, int T, const float *wf, const float *x, size_t ldx, int64_t k, float *y,
                    size_t ldy) {
    switch (R * 8 + T) { BUF_ROW(1) BUF_ROW(2) BUF_ROW(3) BUF_ROW(4) default : abort(); }
}

AI void deq_rows(const td_dtype WT, const char *w, size_t ws, int R, int64_t k, float *wf) {
    for (int r = 0; r < R; r++) {
        const char *row = w + (size_t)r * ws;
        float *dst = wf + (size_t)r * (size_t)k;
        for (int64_t b = 0; b < k / 32; b++) {
            __m512 lo, hi;
            deq_block(WT, row, b, &lo, &hi);
            _mm512_storeu_ps(dst + b * 32, lo);
            _mm512_storeu_ps(dst + b * 32 + 16, hi);
        }
    }
}

static void deq_rows_any(td_dtype wt, const char *w, size_t ws, int R, int64_t k, float *wf) {
    switch (wt) {
    case TD_TYPE_Q4_0: deq_rows(TD_TYPE_Q4_0, w, ws, R, k, wf); return;
    case TD_TYPE_Q4_1: deq_rows(TD_TYPE_Q4_1, w, ws, R, k, wf); return;
    case TD_TYPE_Q8_0: deq_rows(TD_TYPE_Q8_0, w, ws, R, k, wf); return;
    case TD_TYPE_Q5_0:
    case TD_TYPE_Q5_1:
    case TD_TYPE_Q4_K:
    case TD_TYPE_Q5_K:
    case TD_TYPE_Q6_K:
        for (int r = 0; r < R; r++)
            deq_row_5k(wt, w + (size_t)r * ws, k, wf + (size_t)r * (size_t)k);
        return;
    case TD_TYPE_F32: deq_rows(TD_TYPE_F32, w, ws, R, k, wf); return;
    case TD_TYPE_F16: deq_rows(TD_TYPE_F16, w, ws, R, k, wf); return;
    case TD_TYPE_BF16: deq_rows(TD_TYPE_BF16, w, ws, R, k, wf); return;
    default: TD_KERNEL_UNREACHABLE_TYPE(wt);
    }
}

void td_qmm_avx512_dequant_row(td_dtype wt, const void *w, float *dst, int64_t k) {
    deq_rows_any(wt, w, 0, 1, k, dst);
}

void td_qmm_avx512(td_dtype wt, const void *w, size_t ws, const float *x, size_t ldx, int n,
                   int64_t k, float *y, size_t ldy, int r0, int r1) {
    const int64_t nb = k / 32;
    if (n < MIN_TB || k > TD_QMM_KMAX) {
        void (*reg)(int, int, const char *, size_t, const float *, size_t, int64_t, float *,
                    size_t) = wt == TD_TYPE_Q4_0   ? reg_q40
                              : wt == TD_TYPE_Q4_1 ? reg_q41
                              : wt == TD_TYPE_Q8_0 ? reg_q80
                              : wt == TD_TYPE_Q5_0 ? reg_q50
                              : wt == TD_TYPE_Q5_1 ? reg_q51
                              : wt == TD_TYPE_Q4_K ? reg_q4k
                              : wt == TD_TYPE_Q5_K ? reg_q5k
                              : wt == TD_TYPE_Q6_K ? reg_q6k
                              : wt == TD_TYPE_F32  ? reg_f32
                              : wt == TD_TYPE_F16  ? reg_f16
                              : wt == TD_TYPE_BF16 ? reg_bf16
                                                   : NULL;
        if (!reg) TD_KERNEL_UNREACHABLE_TYPE(wt);
        /* quantized rows go RR at a time (kern_reg_q), float rows one at a time */
        const int rstep = td_dtype_is_quant(wt) ? RR : 1;
        for (int t = 0; t < n; t += TREG) {
            const int tt = n - t < TREG ? n - t : TREG;
            for (int r = r0; r < r1; r += rstep) {
                const int rr = r1 - r < rstep ? r1 - r : rstep;
                reg(rr, tt, (const char *)w + (size_t)r * ws, ws, x + (size_t)t * ldx, ldx, nb,
                    y + (size_t)t * ldy + (size_t)r, ldy);
            }
        }
        return;
    }
    /* Token chunks whose activations stay in L2 while every row tile of
     * [r0, r1) is dequantized once for the chunk and swept over it. */
    int tchunk = (int)(XCHUNK / ((size_t)k * sizeof(float)));
    if (tchunk < TBUF) tchunk = TBUF;
    tchunk -= tchunk % TBUF;
    float *wf = g_wf;
    for (int tc = 0; tc < n; tc += tchunk) {
        const int te = n - tc < tchunk ? n : tc + tchunk;
        for (int r = r0; r < r1; r += RR) {
            const int rr = r1 - r < RR ? r1 - r : RR;
            deq_rows_any(wt, (const char *)w + (size_t)r * ws, ws, rr, k, wf);
            for (int t = tc; t < te; t += TBUF) {
                const int tt = te - t < TBUF ? te - t : TBUF;
                run_buf(rr, tt, wf, x + (size_t)t * ldx, ldx, k, y + (size_t)t * ldy + (size_t)r,
                        ldy);
            }
        }
    }
}
