/* x24: Q4_K, Q5_K and Q6_K matmuls with 24-bit fixed-point activations, on CPUs
 * with AMX-INT8 (prefill) and AVX512-VNNI (decode); the arithmetic is
 * x24.h's.
 *
 * Activations, per token row and 256-element block: the exponent s, the
 * limbs L, M, H of v in AMX A-tile order (for each 16-token tile and
 * 64-element step, the three limbs as 16 rows of 64 bytes, the elements
 * in x24_limb's order), and the sub-block sums of v.
 *
 * Weights, per row and super-block (unpack_block): the four steps of q in
 * the same element order, the scale of each 16-element group, d, dmin and
 * the mins. AMX takes W = sc * (q - off) as two bytes, W & 255 unsigned
 * and W >> 8 signed, in B-tile (VNNI) order, built per 16-row strip: the
 * six products of the limbs and the bytes fall into four C tiles by their
 * weight (2^0, 2^8, 2^16, 2^24), so the three A tiles of a step are loaded
 * once. The decode kernel takes q as bytes against the limbs (vpdpbusd),
 * each lane staying in one group, and multiplies the lane sums by their
 * group's sc. Both then carry the limb sums of each (row, token) pair
 * into its exact total, round it once (exact_t) and run post_v's f32
 * roundings on vectors over 16 weight rows. */
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "avx512-impl.h"
#include "cpu-impl.h"
#include "x24.h"

/* Small loops over vectors are unrolled whole (#pragma GCC unroll), so that
 * their arrays stay in registers: GCC's -O2 keeps them as loops over the
 * stack. */
#define AI       static inline __attribute__((always_inline))

#define SB_CHUNK 2   /* super-blocks per weight-tile build (K block of 512) */
#define RB       256 /* weight rows per block of the AMX kernel */

/* ---- process set-up ---- */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA  18

static bool g_x24_ok;
static bool g_x24_on = true;

static bool cpu_has_amx_int8(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    return (d & (1u << 24)) && (d & (1u << 25)); /* AMX-TILE, AMX-INT8 */
}

void td_x24_init(td_isa isa) {
    g_x24_ok = false;
    if (isa != TD_ISA_AVX512 || !cpu_has_amx_int8()) return;
    /* Linux hands out the 8 KiB tile state only on request (5.16+). */
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return;
    g_x24_ok = true;
}

bool td_x24_available(void) { return g_x24_ok; }
void td_x24_set_enabled(bool on) { g_x24_on = on; }
bool td_x24_type(td_dtype t) {
    return g_x24_ok && g_x24_on && (t == TD_TYPE_Q4_K || t == TD_TYPE_Q5_K || t == TD_TYPE_Q6_K);
}

/* ---- activation rows ---- */

size_t td_x24_bytes(int n, int64_t k) {
    const size_t np = (size_t)td_x24_pad(n);
    return np * (size_t)k * 3 + np * (size_t)(k / TD_QK_K) * sizeof(float) * 9;
}

static float *x24_s(const void *xa, int n, int64_t k) {
    return (float *)((char *)xa + (size_t)td_x24_pad(n) * (size_t)k * 3);
}
static float *x24_sx(const void *xa, int n, int64_t k) {
    return x24_s(xa, n, k) + (size_t)td_x24_pad(n) * (size_t)(k / TD_QK_K);
}
/* Limb l of token t, 64-element step ks. Step u of a super-block holds at
 * byte 4L + i (L < 16, i < 4) element 16L + 4u + i: int32 lane L of a VNNI
 * product (4 bytes) stays within the 16-element group L over all four
 * steps (within sub-block L / 2 of a q4_K or q5_K block, on one scale of a
 * q6_K block), and a step of quants is one dword permute. */
AI const int8_t *x24_limb(const void *xa, int64_t k, int t, int64_t ks, int l) {
    return (const int8_t *)xa +
           ((((size_t)(t / 16) * (size_t)(k / 64) + (size_t)ks) * 3 + l) * 16 + (size_t)(t % 16)) *
               64;
}

/* The 128-bit lane u of each of g[0..3], in one vector. */
AI __m512i lane_u(const __m512i *g, int u) {
#define X24_LANE(U)                                                                                \
    _mm512_shuffle_i32x4(_mm512_shuffle_i32x4(g[0], g[1], (U)*0x55),                               \
                         _mm512_shuffle_i32x4(g[2], g[3], (U)*0x55), 0x88)
    switch (u) {
    case 0: return X24_LANE(0);
    case 1: return X24_LANE(1);
    case 2: return X24_LANE(2);
    default: return X24_LANE(3);
    }
#undef X24_LANE
}

static void quant_row(const float *x, int t, int n, int64_t k, void *xa) {
    const int64_t nsb = k / TD_QK_K;
    float *s = x24_s(xa, n, k) + (size_t)t * (size_t)nsb;
    float *sx = x24_sx(xa, n, k) + (size_t)t * (size_t)nsb * 8;
    for (int64_t sb = 0; sb < nsb; sb++) {
        const float *xs = x + sb * TD_QK_K;
        __m512 mx = _mm512_setzero_ps();
        __mmask16 nan = 0; /* max_ps need not carry a NaN through: flag it */
        for (int i = 0; i < TD_QK_K; i += 16) {
            const __m512 v = _mm512_loadu_ps(xs + i);
            mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        }
        const float m = _mm512_reduce_max_ps(mx);
        int e = 0;
        const bool finite = !nan && m <= 3.4028235e38f;
        if (finite && m > 0) (void)frexpf(m, &e); /* m < 2^e */
        s[sb] = finite ? ldexpf(1.0f, e - 23) : __builtin_nanf("");
        const __m512 sh = _mm512_set1_ps((float)(23 - e));
        const __m512i hi = _mm512_set1_epi32((1 << 23) - 1);
        _Alignas(64) int32_t v[TD_QK_K];
        for (int i = 0; i < TD_QK_K; i += 16) {
            __m512i vi = _mm512_setzero_si512();
            if (finite)
                vi = _mm512_min_epi32(
                    _mm512_cvtps_epi32(_mm512_scalef_ps(_mm512_loadu_ps(xs + i), sh)), hi);
            _mm512_store_si512(v + i, vi);
        }
#pragma GCC unroll 16
        for (int j = 0; j < 8; j++)
            sx[sb * 8 + j] = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(
                _mm512_load_si512(v + 32 * j), _mm512_load_si512(v + 32 * j + 16)));
        /* step u, byte 4L + i: element 16L + 4u + i (x24_limb): the 128-bit
         * lane u of the 16-element groups, four groups to a vector */
        __m512i g[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) g[j] = _mm512_load_si512(v + 16 * j);
#pragma GCC unroll 16
        for (int u = 0; u < 4; u++) {
            int8_t *dst[3];
#pragma GCC unroll 16
            for (int l = 0; l < 3; l++) dst[l] = (int8_t *)x24_limb(xa, k, t, sb * 4 + u, l);
#pragma GCC unroll 16
            for (int q = 0; q < 4; q++) {
                const __m512i c = lane_u(g + 4 * q, u);
                _mm_storeu_si128((__m128i *)(dst[0] + 16 * q), _mm512_cvtepi32_epi8(c));
                _mm_storeu_si128((__m128i *)(dst[1] + 16 * q),
                                 _mm512_cvtepi32_epi8(_mm512_srai_epi32(c, 8)));
                _mm_storeu_si128((__m128i *)(dst[2] + 16 * q),
                                 _mm512_cvtepi32_epi8(_mm512_srai_epi32(c, 16)));
            }
        }
    }
}

void td_x24_quant(const float *x, size_t ldx, int t0, int t1, int n, int64_t k, void *xa) {
    for (int t = t0; t < t1; t++) quant_row(x + (size_t)t * ldx, t, n, k, xa);
    if (t1 != n || n < TD_X24_AMX_MIN) return;
    /* padding tokens of the last tile: zero limbs and scales */
    const int64_t nsb = k / TD_QK_K;
    for (int t = n; t < td_x24_pad(n); t++) {
        for (int64_t ks = 0; ks < k / 64; ks++)
            for (int l = 0; l < 3; l++) memset((void *)x24_limb(xa, k, t, ks, l), 0, 64);
        memset(x24_s(xa, n, k) + (size_t)t * (size_t)nsb, 0, (size_t)nsb * sizeof(float));
        memset(x24_sx(xa, n, k) + (size_t)t * (size_t)nsb * 8, 0, (size_t)nsb * 8 * sizeof(float));
    }
}

/* ---- the f32 roundings after the integer sums (x24.h), lanes = weight rows ---- */

/* T = c0 + 2^8 c1 + 2^16 c2 + 2^24 c3 of int32 lanes (|c0| < 2^30, |T| <=
 * 2^43), rounded once to f32: T is carried into lo + 2^24 hi with lo in
 * [0, 2^24) and |hi| < 2^20, both exact as floats, so one FMA rounds T
 * (c1 = 2^16 (c1 >> 16) + (c1 & 0xFFFF), c2 = 2^8 (c2 >> 8) + (c2 & 0xFF),
 * arithmetic shifts). */
AI __m512 exact_t(__m512i c0, __m512i c1, __m512i c2, __m512i c3) {
    __m512i lo = _mm512_add_epi32(c0, _mm512_srli_epi32(_mm512_slli_epi32(c1, 16), 8));
    lo = _mm512_add_epi32(lo, _mm512_srli_epi32(_mm512_slli_epi32(c2, 24), 8));
    __m512i hi = _mm512_add_epi32(_mm512_srai_epi32(c1, 16), _mm512_srai_epi32(c2, 8));
    hi = _mm512_add_epi32(_mm512_add_epi32(hi, c3), _mm512_srai_epi32(lo, 24));
    lo = _mm512_and_si512(lo, _mm512_set1_epi32(0xFFFFFF));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(16777216.0f),
                           _mm512_cvtepi32_ps(lo));
}

AI __m512 post_v(const td_dtype WT, __m512 t, __m512 d, __m512 dmin, const __m512 *mins,
                 const float *sx, float s, __m512 acc) {
    /* q6_K: no mins, u = t * d (fnmadd of q = 0 gives the same bits) */
    if (WT == TD_TYPE_Q6_K) return _mm512_fmadd_ps(_mm512_set1_ps(s), _mm512_mul_ps(t, d), acc);
    __m512 q = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int j = 0; j < 8; j++) q = _mm512_fmadd_ps(_mm512_set1_ps(sx[j]), mins[j], q);
    const __m512 u = _mm512_fnmadd_ps(q, dmin, _mm512_mul_ps(t, d));
    return _mm512_fmadd_ps(_mm512_set1_ps(s), u, acc);
}

/* ---- prefill: AMX, one strip of up to 16 weight rows at a time ---- */

typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tilecfg;

static _Thread_local bool g_tile_cfg;

/* Palette 1, tiles 0-7 of 16 rows by 64 bytes; a constant, so that no
 * stores to it can be dropped (GCC 12 does not see _tile_loadconfig read
 * all 64 bytes of a local). */
static const _Alignas(64) tilecfg g_cfg = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

static void tile_config(void) {
    if (g_tile_cfg) return;
    _tile_loadconfig(&g_cfg);
    g_tile_cfg = true;
}

/* 16 rows of 16 dwords -> their transpose, in place. */
AI void transpose16(__m512i r[16]) {
    __m512i a[16], x[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i += 2) {
        a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
/* x[4g + e]: lane L holds element 4L + e of rows 4g .. 4g + 3 */
#pragma GCC unroll 16
    for (int g = 0; g < 4; g++) {
        x[4 * g + 0] = _mm512_unpacklo_epi64(a[4 * g], a[4 * g + 2]);
        x[4 * g + 1] = _mm512_unpackhi_epi64(a[4 * g], a[4 * g + 2]);
        x[4 * g + 2] = _mm512_unpacklo_epi64(a[4 * g + 1], a[4 * g + 3]);
        x[4 * g + 3] = _mm512_unpackhi_epi64(a[4 * g + 1], a[4 * g + 3]);
    }
#pragma GCC unroll 16
    for (int e = 0; e < 4; e++) {
        const __m512i p = _mm512_shuffle_i32x4(x[e], x[4 + e], 0x44);
        const __m512i q = _mm512_shuffle_i32x4(x[e], x[4 + e], 0xEE);
        const __m512i u = _mm512_shuffle_i32x4(x[8 + e], x[12 + e], 0x44);
        const __m512i v = _mm512_shuffle_i32x4(x[8 + e], x[12 + e], 0xEE);
        r[0 + e] = _mm512_shuffle_i32x4(p, u, 0x88);
        r[4 + e] = _mm512_shuffle_i32x4(p, u, 0xDD);
        r[8 + e] = _mm512_shuffle_i32x4(q, v, 0x88);
        r[12 + e] = _mm512_shuffle_i32x4(q, v, 0xDD);
    }
}

/* ---- decode: AVX512-VNNI, 16 weight rows at a time ---- */

/* Per row of a strip and super-block: the limbs' lane sums for each token
 * (ls[t][limb][row]), reduced across lanes by one transpose per limb, so
 * the post runs on vectors over the strip's rows as the AMX kernel's does. */
typedef struct {
    _Alignas(64) int32_t ls[TD_X24_AMX_MIN][3][16][16];
    __m512i xv[TD_X24_AMX_MIN][12]; /* each token's limbs of a super-block */
} dscratch;

/* Lane r = the sum of v[r]'s 16 lanes: a tree of 128-bit-lane and dword
 * shuffles (half a transpose's), then one permute back to row order. */
AI __m512i hsum16(const __m512i v[16]) {
    __m512i a[8], b[4];
#pragma GCC unroll 16
    for (int i = 0; i < 8; i++) /* 128-bit lanes 0, 1: row 2i; 2, 3: row 2i + 1 */
        a[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0x44),
                                _mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0xEE));
#pragma GCC unroll 16
    for (int i = 0; i < 4; i++) /* 128-bit lane k: row 4i + k */
        b[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(a[2 * i], a[2 * i + 1], 0x88),
                                _mm512_shuffle_i32x4(a[2 * i], a[2 * i + 1], 0xDD));
    const __m512i c0 =
        _mm512_add_epi32(_mm512_unpacklo_epi32(b[0], b[1]), _mm512_unpackhi_epi32(b[0], b[1]));
    const __m512i c1 =
        _mm512_add_epi32(_mm512_unpacklo_epi32(b[2], b[3]), _mm512_unpackhi_epi32(b[2], b[3]));
    /* lane 4k + i: row 4i + k */
    const __m512i d =
        _mm512_add_epi32(_mm512_unpacklo_epi64(c0, c1), _mm512_unpackhi_epi64(c0, c1));
    return _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), d);
}

/* The q of step u (x24_limb's order) of a q4_K block whose 128 quant bytes
 * are qs0, qs1: element 16L + 4u + i (64c + 32h + l, l < 32) is nibble h of
 * byte 32c + l, so lane L is dword 8 (L / 4) + 4 (L % 2) + u of the quants,
 * its high nibbles for L % 4 >= 2. */
AI __m512i q4k_step(__m512i qs0, __m512i qs1, int u) {
    const __m512i v =
        _mm512_permutex2var_epi32(qs0,
                                  _mm512_add_epi32(_mm512_setr_epi32(0, 4, 0, 4, 8, 12, 8, 12, 16,
                                                                     20, 16, 20, 24, 28, 24, 28),
                                                   _mm512_set1_epi32(u)),
                                  qs1);
    return _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xF0F0F0F0u, v, 4), _mm512_set1_epi8(15));
}

/* The q of step u of a q5_K block: q4k_step's nibbles and, for element
 * 16L + 4u + i (sub-block L / 2, element 16 (L % 2) + 4u + i of it), bit
 * L / 2 of qh byte 16 (L % 2) + 4u + i (dword 4 (L % 2) + u) as bit 4. */
AI __m512i q5k_step(__m512i qs0, __m512i qs1, __m512i qh, int u) {
    const __m512i h = _mm512_permutexvar_epi32(
        _mm512_add_epi32(_mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4),
                         _mm512_set1_epi32(u)),
        qh);
    const __m512i hb = _mm512_and_si512(
        _mm512_srlv_epi32(h, _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)),
        _mm512_set1_epi8(1));
    return _mm512_or_si512(q4k_step(qs0, qs1, u), _mm512_slli_epi32(hb, 4));
}

/* The q of step u of a q6_K block (ql: 128 bytes in qlo0, qlo1; qh: 64
 * bytes): element 16L + 4u + i is ql byte 64 (L / 8) + 32 ((L / 2) % 2) +
 * 16 (L % 2) + 4u + i, its high nibble for L % 8 >= 4, with bits 2g, 2g + 1
 * (g = (L % 8) / 2) of qh byte 32 (L / 8) + 16 (L % 2) + 4u + i on top. */
AI __m512i q6k_step(__m512i qlo0, __m512i qlo1, __m512i qh, int u) {
    const __m512i uu = _mm512_set1_epi32(u);
    const __m512i lo = _mm512_permutex2var_epi32(
        qlo0,
        _mm512_add_epi32(
            _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 16, 20, 24, 28, 16, 20, 24, 28), uu),
        qlo1);
    const __m512i h = _mm512_permutexvar_epi32(
        _mm512_add_epi32(_mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 8, 12, 8, 12, 8, 12, 8, 12), uu),
        qh);
    const __m512i hb = _mm512_and_si512(
        _mm512_srlv_epi32(h, _mm512_setr_epi32(0, 0, 2, 2, 4, 4, 6, 6, 0, 0, 2, 2, 4, 4, 6, 6)),
        _mm512_set1_epi8(3));
    return _mm512_or_si512(
        _mm512_and_si512(_mm512_mask_srli_epi16(lo, 0xFF00FF00u, lo, 4), _mm512_set1_epi8(15)),
        _mm512_slli_epi32(hb, 4));
}

/* A super-block of a row as both kernels take it: the four steps of q (as
 * unsigned bytes), the per-lane scale (lane L: group L), d, and for q4_K
 * and q5_K dmin and the 8 mins; W = sc * (q - off), off 32 for q6_K, else
 * 0. */
typedef struct {
    __m512i q[4];
    __m512i scv; /* int32 lanes */
    __m512i scw; /* q4_K: row_sums' int16 scale pairs */
    float d, dmin;
    __m512 dm; /* [d, dmin, -, .., m0 .. m7] */
} kblock;

AI void unpack_block(const td_dtype WT, const char *bl, kblock *kb) {
    if (WT == TD_TYPE_Q6_K) {
        const td_block_q6_K *b = (const td_block_q6_K *)(const void *)bl;
        const __m512i l0 = _mm512_loadu_si512(b->ql), l1 = _mm512_loadu_si512(b->ql + 64);
        const __m512i h = _mm512_loadu_si512(b->qh);
#pragma GCC unroll 16
        for (int u = 0; u < 4; u++) kb->q[u] = q6k_step(l0, l1, h, u);
        kb->scv = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b->scales));
        kb->d = td_avx512_h2f((const char *)&b->d);
        kb->dmin = 0.0f;
        kb->dm = _mm512_mask_mov_ps(_mm512_setzero_ps(), 1, _mm512_set1_ps(kb->d));
        return;
    }
    /* q4_K and q5_K: the same head (d, dmin, scales) */
    const __m512i scm = td_avx512_k_scm(bl);
    if (WT == TD_TYPE_Q5_K) {
        const td_block_q5_K *b = (const td_block_q5_K *)(const void *)bl;
        const __m512i qs0 = _mm512_loadu_si512(b->qs), qs1 = _mm512_loadu_si512(b->qs + 64);
        const __m512i qh = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)b->qh));
#pragma GCC unroll 16
        for (int u = 0; u < 4; u++) kb->q[u] = q5k_step(qs0, qs1, qh, u);
    } else {
        const td_block_q4_K *b = (const td_block_q4_K *)(const void *)bl;
        const __m512i qs0 = _mm512_loadu_si512(b->qs), qs1 = _mm512_loadu_si512(b->qs + 64);
#pragma GCC unroll 16
        for (int u = 0; u < 4; u++) kb->q[u] = q4k_step(qs0, qs1, u);
    }
    /* lanes 2j, 2j + 1: sub-block j */
    kb->scv = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), scm);
    /* dword 4c + j: sc_(2c + j % 2) in both words (row_sums) */
    kb->scw = _mm512_permutexvar_epi16(_mm512_set_epi16(28, 28, 24, 24, 28, 28, 24, 24, 20, 20, 16,
                                                        16, 20, 20, 16, 16, 12, 12, 8, 8, 12, 12, 8,
                                                        8, 4, 4, 0, 0, 4, 4, 0, 0),
                                       kb->scv);
    int32_t dd; /* d, dmin: any alignment, no type punning */
    memcpy(&dd, bl, sizeof dd);
    const __m128 hd = _mm_cvtph_ps(_mm_cvtsi32_si128(dd));
    kb->d = _mm_cvtss_f32(hd);
    kb->dmin = _mm_cvtss_f32(_mm_movehdup_ps(hd));
    kb->dm = _mm512_mask_blend_ps(0x3, _mm512_cvtepi32_ps(scm), _mm512_castps128_ps512(hd));
}

/* Row rr's lane sums of one token against a super-block's four steps of
 * q, times sc (scv), into ls[limb][rr]. q6_K: L and M against q - 32
 * (signed), H against q less 32 times hs, the lanes' sums of H. Raw sums:
 * at most 16 * 255 * 32 in magnitude. q4_K's fit int16 over two steps
 * (8 * 255 * 15; H over all four, 16 * 128 * 15): L and M in two halves
 * packed to words, each word pair one sub-block's, and H as it is, are
 * multiplied by sc and summed in pairs (vpmaddwd, one uop against
 * vpmulld's two); only the lanes' total matters (hsum16). */
AI void row_sums(const td_dtype WT, const kblock *kb, const __m512i x[12], __m512i hs,
                 int32_t (*ls)[16][16], int rr) {
    __m512i al = _mm512_setzero_si512(), am = al, ah = al;
    if (WT == TD_TYPE_Q4_K) {
        __m512i a2[2] = {al, al}, m2[2] = {al, al};
#pragma GCC unroll 16
        for (int u = 0; u < 4; u++) {
            a2[u / 2] = _mm512_dpbusd_epi32(a2[u / 2], x[3 * u], kb->q[u]);
            m2[u / 2] = _mm512_dpbusd_epi32(m2[u / 2], x[3 * u + 1], kb->q[u]);
            ah = _mm512_dpbusd_epi32(ah, kb->q[u], x[3 * u + 2]);
        }
        _mm512_store_si512(ls[0][rr], _mm512_madd_epi16(_mm512_packs_epi32(a2[0], a2[1]), kb->scw));
        _mm512_store_si512(ls[1][rr], _mm512_madd_epi16(_mm512_packs_epi32(m2[0], m2[1]), kb->scw));
        _mm512_store_si512(ls[2][rr], _mm512_madd_epi16(ah, kb->scv));
        return;
    }
#pragma GCC unroll 16
    for (int u = 0; u < 4; u++) {
        const __m512i qs =
            WT == TD_TYPE_Q6_K ? _mm512_sub_epi8(kb->q[u], _mm512_set1_epi8(32)) : kb->q[u];
        al = _mm512_dpbusd_epi32(al, x[3 * u], qs);
        am = _mm512_dpbusd_epi32(am, x[3 * u + 1], qs);
        ah = _mm512_dpbusd_epi32(ah, kb->q[u], x[3 * u + 2]);
    }
    if (WT == TD_TYPE_Q6_K) ah = _mm512_sub_epi32(ah, _mm512_slli_epi32(hs, 5));
    _mm512_store_si512(ls[0][rr], _mm512_mullo_epi32(al, kb->scv));
    _mm512_store_si512(ls[1][rr], _mm512_mullo_epi32(am, kb->scv));
    _mm512_store_si512(ls[2][rr], _mm512_mullo_epi32(ah, kb->scv));
}

AI void mm_decode(const td_dtype WT, const char *w, size_t ws, const void *xa, int n, int64_t k,
                  float *y, size_t ldy, int r0, int r1) {
    const int64_t nsb = k / TD_QK_K;
    const size_t bb = td_dtype_block_bytes(WT);
    const float *s = x24_s(xa, n, k), *sx = x24_sx(xa, n, k);
    static _Thread_local dscratch ds;
    for (int rs = r0; rs < r1; rs += 16) {
        const int nr = r1 - rs < 16 ? r1 - rs : 16;
        const __mmask16 rmask = (__mmask16)((1u << nr) - 1);
        __m512 acc[TD_X24_AMX_MIN];
        for (int t = 0; t < n; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t sb = 0; sb < nsb; sb++) {
            /* the tokens' limbs of this super-block, for every row; one
             * token's (decode) in registers; q6_K: each lane's sum of H */
            __m512i x1[12], hs[TD_X24_AMX_MIN];
#pragma GCC unroll 16
            for (int i = 0; i < 12; i++)
                x1[i] = _mm512_loadu_si512(x24_limb(xa, k, 0, sb * 4 + i / 3, i % 3));
            if (n > 1)
                for (int t = 0; t < n; t++)
#pragma GCC unroll 16
                    for (int i = 0; i < 12; i++)
                        ds.xv[t][i] = _mm512_loadu_si512(x24_limb(xa, k, t, sb * 4 + i / 3, i % 3));
            const __m512i(*xv)[12] = ds.xv;
            for (int t = 0; t < n; t++) {
                hs[t] = _mm512_setzero_si512();
                if (WT == TD_TYPE_Q6_K)
#pragma GCC unroll 16
                    for (int u = 0; u < 4; u++)
                        hs[t] = _mm512_dpbusd_epi32(hs[t], _mm512_set1_epi8(1),
                                                    n == 1 ? x1[3 * u + 2] : xv[t][3 * u + 2]);
            }
            /* per row: [d, dmin, -, .., m0 .. m7], transposed below */
            __m512i dm[16];
            for (int rr = 0; rr < 16; rr++) {
                if (rr >= nr) {
                    dm[rr] = _mm512_setzero_si512();
                    for (int t = 0; t < n; t++)
#pragma GCC unroll 16
                        for (int l = 0; l < 3; l++)
                            _mm512_store_si512(ds.ls[t][l][rr], _mm512_setzero_si512());
                    continue;
                }
                const char *b = w + (size_t)(rs + rr) * ws + (size_t)sb * bb;
                /* the same block of the next strip: one strip ahead */
                if (rs + 16 + rr < r1) {
                    const char *pf = b + 16 * ws;
                    _mm_prefetch(pf, _MM_HINT_T0);
                    _mm_prefetch(pf + 64, _MM_HINT_T0);
                    _mm_prefetch(pf + 128, _MM_HINT_T0);
                    if (bb > 192) _mm_prefetch(pf + 192, _MM_HINT_T0);
                    if (bb > 128 && bb <= 192) _mm_prefetch(pf + bb - 1, _MM_HINT_T0);
                }
                kblock kb;
                unpack_block(WT, b, &kb);
                dm[rr] = _mm512_castps_si512(kb.dm);
                if (n == 1) { /* decode: the limbs stay in registers */
                    row_sums(WT, &kb, x1, hs[0], ds.ls[0], rr);
                } else {
                    for (int t = 0; t < n; t++) row_sums(WT, &kb, xv[t], hs[t], ds.ls[t], rr);
                }
            }
            transpose16(dm);
            __m512 mins[8];
#pragma GCC unroll 16
            for (int j = 0; j < 8; j++) mins[j] = _mm512_castsi512_ps(dm[8 + j]);
            const __m512 d = _mm512_castsi512_ps(dm[0]), dmin = _mm512_castsi512_ps(dm[1]);
            for (int t = 0; t < n; t++) {
                __m512i c[3];
#pragma GCC unroll 16
                for (int l = 0; l < 3; l++) {
                    __m512i v[16];
#pragma GCC unroll 16
                    for (int rr = 0; rr < 16; rr++) v[rr] = _mm512_load_si512(ds.ls[t][l][rr]);
                    c[l] = hsum16(v);
                }
                const size_t ts = (size_t)t * (size_t)nsb + (size_t)sb;
                acc[t] = post_v(WT, exact_t(c[0], c[1], c[2], _mm512_setzero_si512()), d, dmin,
                                mins, sx + ts * 8, s[ts], acc[t]);
            }
        }
        for (int t = 0; t < n; t++)
            _mm512_mask_storeu_ps(y + (size_t)t * ldy + (size_t)(rs - r0), rmask, acc[t]);
    }
}

/* One strip's weight tiles for super-blocks [sb0, sb0 + nsb_c): per
 * super-block and 64-element step, B tiles of W & 255 (unsigned) and W >> 8
 * (signed; W in [-127 * 32, 128 * 32] leaves it in [-16, 16]) (rows past nr zero),
 * and the rows' d, dmin and mins as lane vectors. */
typedef struct {
    _Alignas(64) int8_t b[SB_CHUNK][4][2][1024];
    _Alignas(64) float d[SB_CHUNK][16], dmin[SB_CHUNK][16], mins[SB_CHUNK][8][16];
} wtiles;

AI void build_tiles(const td_dtype WT, const char *w, size_t ws, int nr, int64_t sb0, int nsb_c,
                    wtiles *wt) {
    const size_t bb = td_dtype_block_bytes(WT);
    /* words of a step: word w of the first half is lane w / 4's, of the
     * second lane 8 + w / 4's; as int16 words, lane L's scale is word 2L
     * of kb.scv */
    const __m512i wlo = _mm512_set_epi16(14, 14, 14, 14, 12, 12, 12, 12, 10, 10, 10, 10, 8, 8, 8, 8,
                                         6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
    const __m512i whi = _mm512_add_epi16(wlo, _mm512_set1_epi16(16));
    const __m512i off = _mm512_set1_epi16(WT == TD_TYPE_Q6_K ? 32 : 0);
    for (int i = 0; i < nsb_c; i++) {
        __m512i lo[4][16], hi[4][16];
        for (int rr = 0; rr < 16; rr++) {
            if (rr >= nr) {
#pragma GCC unroll 16
                for (int u = 0; u < 4; u++) lo[u][rr] = hi[u][rr] = _mm512_setzero_si512();
                wt->d[i][rr] = wt->dmin[i][rr] = 0.0f;
#pragma GCC unroll 16
                for (int j = 0; j < 8; j++) wt->mins[i][j][rr] = 0.0f;
                continue;
            }
            kblock kb;
            unpack_block(WT, w + (size_t)rr * ws + (size_t)(sb0 + i) * bb, &kb);
            _Alignas(64) float dmv[16];
            _mm512_store_ps(dmv, kb.dm);
#pragma GCC unroll 16
            for (int j = 0; j < 8; j++) wt->mins[i][j][rr] = dmv[8 + j];
            wt->d[i][rr] = kb.d;
            wt->dmin[i][rr] = kb.dmin;
            const __m512i scw0 = _mm512_permutexvar_epi16(wlo, kb.scv);
            const __m512i scw1 = _mm512_permutexvar_epi16(whi, kb.scv);
#pragma GCC unroll 16
            for (int u = 0; u < 4; u++) {
                const __m512i q = kb.q[u];
                const __m512i w0 = _mm512_mullo_epi16(
                    _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(q)), off), scw0);
                const __m512i w1 = _mm512_mullo_epi16(
                    _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(q, 1)), off),
                    scw1);
                /* the words' low bytes (truncation), then their high bytes */
                lo[u][rr] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(w0)),
                                               _mm512_cvtepi16_epi8(w1), 1);
                hi[u][rr] = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srai_epi16(w0, 8))),
                    _mm512_cvtepi16_epi8(_mm512_srai_epi16(w1, 8)), 1);
            }
        }
#pragma GCC unroll 16
        for (int u = 0; u < 4; u++) {
            transpose16(lo[u]);
            transpose16(hi[u]);
#pragma GCC unroll 16
            for (int kk = 0; kk < 16; kk++) {
                _mm512_store_si512(wt->b[i][u][0] + kk * 64, lo[u][kk]);
                _mm512_store_si512(wt->b[i][u][1] + kk * 64, hi[u][kk]);
            }
        }
    }
}

typedef struct {
    _Alignas(64) int32_t c[4][16][16];
} ctiles;

/* Post one super-block's four C tiles (the products of weight 2^0, 2^8,
 * 2^16, 2^24) into the strip's accumulators. */
AI void post_tiles(const td_dtype WT, const ctiles *ct, const wtiles *wt, int i, const float *s,
                   const float *sx, int64_t nsb, int64_t sb, int t0, __m512 acc[16]) {
    const __m512 d = _mm512_load_ps(wt->d[i]), dmin = _mm512_load_ps(wt->dmin[i]);
    __m512 mins[8];
#pragma GCC unroll 16
    for (int j = 0; j < 8; j++) mins[j] = _mm512_load_ps(wt->mins[i][j]);
    for (int r = 0; r < 16; r++) {
        const __m512 t = exact_t(_mm512_load_si512(ct->c[0][r]), _mm512_load_si512(ct->c[1][r]),
                                 _mm512_load_si512(ct->c[2][r]), _mm512_load_si512(ct->c[3][r]));
        const size_t ts = (size_t)(t0 + r) * (size_t)nsb + (size_t)sb;
        acc[r] = post_v(WT, t, d, dmin, mins, sx + ts * 8, s[ts], acc[r]);
    }
}

/* Rows in blocks of up to RB; per 512-element K block, every strip's
 * weight tiles are built once (RB / 16 strips of 16 KiB: L2), then each
 * 16-token tile of activations (24 KiB) runs against all of them, so the
 * activations stream once per row block and y is swept along its rows. */
AI void mm_amx(const td_dtype WT, const char *w, size_t ws, const void *xa, int n, int64_t k,
               float *y, size_t ldy, int r0, int r1) {
    tile_config();
    const int64_t nsb = k / TD_QK_K;
    const float *s = x24_s(xa, n, k), *sx = x24_sx(xa, n, k);
    static _Thread_local wtiles wt[RB / 16];
    static _Thread_local ctiles ct[2];
    for (int rb = r0; rb < r1; rb += RB) {
        const int nrb = r1 - rb < RB ? r1 - rb : RB;
        const int nstrip = (nrb + 15) / 16;
        for (int64_t sb0 = 0; sb0 < nsb; sb0 += SB_CHUNK) {
            const int nsb_c = nsb - sb0 < SB_CHUNK ? (int)(nsb - sb0) : SB_CHUNK;
            for (int st = 0; st < nstrip; st++) {
                const int nr = nrb - 16 * st < 16 ? nrb - 16 * st : 16;
                build_tiles(WT, w + (size_t)(rb + 16 * st) * ws, ws, nr, sb0, nsb_c, &wt[st]);
            }
            for (int t0 = 0; t0 < n; t0 += 16) {
                const int nt = n - t0 < 16 ? n - t0 : 16;
                for (int st = 0; st < nstrip; st++) {
                    const int nr = nrb - 16 * st < 16 ? nrb - 16 * st : 16;
                    const __mmask16 rmask = (__mmask16)((1u << nr) - 1);
                    float *ys = y + (size_t)(rb - r0 + 16 * st);
                    const wtiles *ws_t = &wt[st];
                    __m512 acc[16];
                    for (int r = 0; r < 16; r++)
                        acc[r] = sb0 && r < nt
                                     ? _mm512_maskz_loadu_ps(rmask, ys + (size_t)(t0 + r) * ldy)
                                     : _mm512_setzero_ps();
                    for (int i = 0; i < nsb_c; i++) {
                        const int64_t sb = sb0 + i;
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                        /* tiles 4-6: the limbs L, M (unsigned), H (signed);
                         * 7: W & 255 (unsigned), then W >> 8 (signed); C
                         * tile j takes the products of weight 2^(8j) (tile
                         * intrinsics take register numbers: literals) */
                        for (int c = 0; c < 4; c++) {
                            const int8_t *a = x24_limb(xa, k, t0, sb * 4 + c, 0);
                            _tile_loadd(4, a, 64);
                            _tile_loadd(5, a + 1024, 64);
                            _tile_loadd(6, a + 2048, 64);
                            _tile_loadd(7, ws_t->b[i][c][0], 64);
                            _tile_dpbuud(0, 4, 7);
                            _tile_dpbuud(1, 5, 7);
                            _tile_dpbsud(2, 6, 7);
                            _tile_loadd(7, ws_t->b[i][c][1], 64);
                            _tile_dpbusd(1, 4, 7);
                            _tile_dpbusd(2, 5, 7);
                            _tile_dpbssd(3, 6, 7);
                        }
                        ctiles *cur = &ct[i & 1];
                        _tile_stored(0, cur->c[0], 64);
                        _tile_stored(1, cur->c[1], 64);
                        _tile_stored(2, cur->c[2], 64);
                        _tile_stored(3, cur->c[3], 64);
                        /* the previous super-block's post overlaps these stores */
                        if (i)
                            post_tiles(WT, &ct[(i - 1) & 1], ws_t, i - 1, s, sx, nsb, sb - 1, t0,
                                       acc);
                    }
                    post_tiles(WT, &ct[(nsb_c - 1) & 1], ws_t, nsb_c - 1, s, sx, nsb,
                               sb0 + nsb_c - 1, t0, acc);
                    for (int r = 0; r < nt; r++)
                        _mm512_mask_storeu_ps(ys + (size_t)(t0 + r) * ldy, rmask, acc[r]);
                }
            }
        }
    }
}

static void decode_q4k(const char *w, size_t ws, const void *xa, int n, int64_t k, float *y,
                       size_t ldy, int r1) {
    if (n == 1) /* a constant n: the one token's code alone */
        mm_decode(TD_TYPE_Q4_K, w, ws, xa, 1, k, y, ldy, 0, r1);
    else
        mm_decode(TD_TYPE_Q4_K, w, ws, xa, n, k, y, ldy, 0, r1);
}
static void decode_q5k(const char *w, size_t ws, const void *xa, int n, int64_t k, float *y,
                       size_t ldy, int r1) {
    if (n == 1) /* a constant n: the one token's code alone */
        mm_decode(TD_TYPE_Q5_K, w, ws, xa, 1, k, y, ldy, 0, r1);
    else
        mm_decode(TD_TYPE_Q5_K, w, ws, xa, n, k, y, ldy, 0, r1);
}
static void decode_q6k(const char *w, size_t ws, const void *xa, int n, int64_t k, float *y,
                       size_t ldy, int r1) {
    if (n == 1) /* a constant n: the one token's code alone */
        mm_decode(TD_TYPE_Q6_K, w, ws, xa, 1, k, y, ldy, 0, r1);
    else
        mm_decode(TD_TYPE_Q6_K, w, ws, xa, n, k, y, ldy, 0, r1);
}
static void amx_q4k(const char *w, size_t ws, const void *xa, int n, int64_t k, float *y,
                    size_t ldy, int r1) {
    mm_amx(TD_TYPE_Q4_K, w, ws, xa, n, k, y, ldy, 0, r1);
}
static void amx_q5k(const char *w, size_t ws, const void *xa, int n, int64_t k, float *y,
                    size_t ldy, int r1) {
    mm_amx(TD_TYPE_Q5_K, w, ws, xa, n, k, y, ldy, 0, r1);
}
static void amx_q6k(const char *w, size_t ws, const void *xa, int n, int64_t k, float *y,
                    size_t ldy, int r1) {
    mm_amx(TD_TYPE_Q6_K, w, ws, xa, n, k, y, ldy, 0, r1);
}

void td_x24_matmul(td_dtype wt, const void *w, size_t ws, const void *xa, int n, int64_t k,
                   float *y, size_t ldy, int r0, int r1) {
    typedef void (*kern)(const char *, size_t, const void *, int, int64_t, float *, size_t, int);
    kern dec, amx;
    switch (wt) {
    case TD_TYPE_Q4_K: dec = decode_q4k, amx = amx_q4k; break;
    case TD_TYPE_Q5_K: dec = decode_q5k, amx = amx_q5k; break;
    case TD_TYPE_Q6_K: dec = decode_q6k, amx = amx_q6k; break;
    default: TD_KERNEL_UNREACHABLE_TYPE(wt);
    }
    if (n <= 0 || r1 <= r0) return;
    const char *wr = (const char *)w + (size_t)r0 * ws;
    (n < TD_X24_AMX_MIN ? dec : amx)(wr, ws, xa, n, k, y, ldy, r1 - r0);
}
