/* Run-time ISA selection, conversions, row quantization and the public entry
 * points that forward to the selected kernel table. */
#include <cpuid.h>
#include <math.h>

#include "cpu-impl.h"
#include "x24.h"

static const td_cpu_ops *g_ops = &td_cpu_ops_scalar;
static td_isa g_isa = TD_ISA_SCALAR;

/* F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does
 * not know the "f16c" feature name. */
static bool cpu_has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}

static bool isa_supported(td_isa isa) {
    switch (isa) {
    case TD_ISA_SCALAR: return true;
    case TD_ISA_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
    case TD_ISA_AVX512:
        __builtin_cpu_init();
        return isa_supported(TD_ISA_AVX2) && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
    }
    return false;
}

td_isa td_cpu_isa_best(void) {
    if (isa_supported(TD_ISA_AVX512)) return TD_ISA_AVX512;
    if (isa_supported(TD_ISA_AVX2)) return TD_ISA_AVX2;
    return TD_ISA_SCALAR;
}

int td_cpu_isa_parse(const char *name) {
    if (!name) return -1;
    if (strcmp(name, "scalar") == 0) return TD_ISA_SCALAR;
    if (strcmp(name, "avx2") == 0) return TD_ISA_AVX2;
    if (strcmp(name, "avx512") == 0) return TD_ISA_AVX512;
    return -1;
}

const char *td_cpu_isa_name(td_isa isa) {
    switch (isa) {
    case TD_ISA_SCALAR: return "scalar";
    case TD_ISA_AVX2: return "avx2";
    case TD_ISA_AVX512: return "avx512";
    }
    return "unknown";
}

bool td_cpu_select(td_isa isa) {
    if (!isa_supported(isa)) return false;
    switch (isa) {
    case TD_ISA_SCALAR: g_ops = &td_cpu_ops_scalar; break;
    case TD_ISA_AVX2: g_ops = &td_cpu_ops_avx2; break;
    case TD_ISA_AVX512: g_ops = &td_cpu_ops_avx512; break;
    }
    g_isa = isa;
    td_x24_init(isa);
    return true;
}

td_isa td_cpu_selected(void) { return g_isa; }

/* ---- conversions ---- */

float td_fp16_to_f32(td_fp16 h) { return td_cpu_h2f(h); }

td_fp16 td_f32_to_fp16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t absx = x & 0x7fffffffu;
    if (absx > 0x7f800000u) return (td_fp16)(sign | 0x7e00 | ((absx >> 13) & 0x3ff)); /* NaN */
    if (absx >= 0x477ff000u) return (td_fp16)(sign | 0x7c00); /* rounds to >= 65536: inf */
    if (absx >= 0x38800000u) {                                /* normal half */
        uint32_t mant = absx & 0x7fffff;
        uint32_t exp = (absx >> 23) - 112;
        uint32_t h = (exp << 10) | (mant >> 13);
        uint32_t rest = mant & 0x1fff;
        if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++; /* carries into exp correctly */
        return (td_fp16)(sign | h);
    }
    if (absx < 0x33000000u) return (td_fp16)sign; /* < 2^-25: rounds to zero */
    /* subnormal half: value = m * 2^-24 */
    uint32_t e = absx >> 23;
    uint32_t mant = (absx & 0x7fffff) | 0x800000;
    uint32_t shift = 126 - e; /* in [14, 24] */
    uint32_t h = mant >> shift;
    uint32_t rest = mant & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rest > half || (rest == half && (h & 1))) h++;
    return (td_fp16)(sign | h);
}

float td_bf16_to_f32(td_bf16 h) { return td_cpu_bf2f(h); }

td_bf16 td_f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (td_bf16)((x >> 16) | 0x40); /* quiet NaN */
    x += 0x7fff + ((x >> 16) & 1);
    return (td_bf16)(x >> 16);
}

/* ---- rows ---- */

void td_cpu_q8w_group(td_dtype t, const void *row, int64_t b, td_q8w_group *g) {
    g->m = 0.0f;
    switch (t) {
    case TD_TYPE_Q4_0:
    case TD_TYPE_Q4_1: {
        const uint8_t *bl = (const uint8_t *)row + (size_t)b * td_dtype_block_bytes(t);
        const int q41 = t == TD_TYPE_Q4_1;
        const uint8_t *qs = bl + 2 + 2 * q41;
        g->d[0] = g->d[1] = td_cpu_h2f_at(bl);
        if (q41) g->m = td_cpu_h2f_at(bl + 2);
        g->off = q41 ? 0 : 8;
        for (int j = 0; j < 16; j++) {
            g->q[j] = qs[j] & 15;
            g->q[j + 16] = qs[j] >> 4;
        }
        return;
    }
    case TD_TYPE_Q5_0:
    case TD_TYPE_Q5_1: {
        const uint8_t *bl = (const uint8_t *)row + (size_t)b * td_dtype_block_bytes(t);
        const int q51 = t == TD_TYPE_Q5_1;
        g->d[0] = g->d[1] = td_cpu_h2f_at(bl);
        if (q51) g->m = td_cpu_h2f_at(bl + 2);
        g->off = q51 ? 0 : 16;
        uint32_t qh;
        memcpy(&qh, bl + 2 + 2 * q51, 4);
        const uint8_t *qs = bl + 6 + 2 * q51;
        for (int j = 0; j < 16; j++) {
            g->q[j] = (uint8_t)((qs[j] & 15) | ((qh >> j) & 1) << 4);
            g->q[j + 16] = (uint8_t)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
        }
        return;
    }
    case TD_TYPE_Q8_0: {
        const td_block_q8_0 *bl = (const td_block_q8_0 *)row + b;
        g->d[0] = g->d[1] = td_cpu_h2f_at(&bl->d);
        g->off = 128;
        for (int j = 0; j < 32; j++) g->q[j] = (uint8_t)(bl->qs[j] + 128);
        return;
    }
    case TD_TYPE_Q4_K:
    case TD_TYPE_Q5_K: {
        const int sub = (int)(b % 8);
        const uint8_t *bl = (const uint8_t *)row + (size_t)(b / 8) * td_dtype_block_bytes(t);
        int sc, mn;
        td_k_scale_min(bl + 4, sub, &sc, &mn);
        g->d[0] = g->d[1] = td_cpu_h2f_at(bl) * (float)sc;
        g->m = -(td_cpu_h2f_at(bl + 2) * (float)mn);
        g->off = 0;
        const int q5 = t == TD_TYPE_Q5_K;
        const uint8_t *qh = bl + 16;
        const uint8_t *qs = bl + 16 + (q5 ? 32 : 0) + (sub / 2) * 32;
        for (int l = 0; l < 32; l++)
            g->q[l] = (uint8_t)((sub & 1 ? qs[l] >> 4 : qs[l] & 15) |
                                (q5 ? ((qh[l] >> sub) & 1) << 4 : 0));
        return;
    }
    case TD_TYPE_Q6_K: {
        const int half = (int)(b % 8) / 4, gi = (int)(b % 4);
        const td_block_q6_K *bl =
            (const td_block_q6_K *)((const uint8_t *)row + (size_t)(b / 8) * sizeof *bl);
        const float d = td_cpu_h2f_at(&bl->d);
        const uint8_t *ql = bl->ql + 64 * half + 32 * (gi & 1), *qh = bl->qh + 32 * half;
        const int8_t *sc = bl->scales + 8 * half + 2 * gi;
        g->d[0] = d * (float)sc[0];
        g->d[1] = d * (float)sc[1];
        g->off = 32;
        for (int l = 0; l < 32; l++)
            g->q[l] =
                (uint8_t)((gi < 2 ? ql[l] & 15 : ql[l] >> 4) | ((qh[l] >> (2 * gi)) & 3) << 4);
        return;
    }
    default: TD_KERNEL_UNREACHABLE_TYPE(t);
    }
}

/* The definition's value of each element: d * (q - off), plus m for the
 * types with a min (adding a zero m would turn a -0 into +0). d, m are
 * exact, so each element is the one rounding of d * (q - off) [+ m]. */
void td_cpu_deq_group(td_dtype t, const void *row, int64_t b, float out[32]) {
    td_q8w_group g;
    td_cpu_q8w_group(t, row, b, &g);
    const int has_min = td_dtype_has_min(t);
    for (int j = 0; j < 32; j++) {
        float v = g.d[j / 16] * (float)(g.q[j] - g.off);
        out[j] = has_min ? v + g.m : v;
    }
}

void td_cpu_dequant_row(td_dtype t, const void *src, float *dst, int64_t k) {
    switch (t) {
    case TD_TYPE_F32: memcpy(dst, src, (size_t)k * sizeof(float)); return;
    case TD_TYPE_F16: {
        const td_fp16 *s = src;
        for (int64_t i = 0; i < k; i++) dst[i] = td_cpu_h2f(s[i]);
        return;
    }
    case TD_TYPE_BF16: {
        const td_bf16 *s = src;
        for (int64_t i = 0; i < k; i++) dst[i] = td_cpu_bf2f(s[i]);
        return;
    }
    default: break;
    }
    if (!td_dtype_is_quant(t)) TD_KERNEL_UNREACHABLE_TYPE(t);
    for (int64_t b = 0; b < k / 32; b++) td_cpu_deq_group(t, src, b, dst + b * 32);
}

/* ggml's reference rounding (ggml-quants.c quantize_row_*_ref), which the
 * gguf Python package reproduces bit for bit. */
static float roundf_away(float x) { return roundf(x); }

void td_cpu_quant_row(td_dtype t, const float *src, void *dst, int64_t k) {
    switch (t) {
    case TD_TYPE_F32: memcpy(dst, src, (size_t)k * sizeof(float)); return;
    case TD_TYPE_F16: {
        td_fp16 *d = dst;
        for (int64_t i = 0; i < k; i++) d[i] = td_f32_to_fp16(src[i]);
        return;
    }
    case TD_TYPE_BF16: {
        td_bf16 *d = dst;
        for (int64_t i = 0; i < k; i++) d[i] = td_f32_to_bf16(src[i]);
        return;
    }
    case TD_TYPE_Q8_0: {
        td_block_q8_0 *b = dst;
        for (int64_t i = 0; i < k / 32; i++) {
            const float *x = src + i * 32;
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
            float d = amax / 127.0f;
            float id = d != 0.0f ? 1.0f / d : 0.0f;
            b[i].d = td_f32_to_fp16(d);
            for (int j = 0; j < 32; j++) b[i].qs[j] = (int8_t)roundf_away(x[j] * id);
        }
        return;
    }
    case TD_TYPE_Q4_0: {
        td_block_q4_0 *b = dst;
        for (int64_t i = 0; i < k / 32; i++) {
            const float *x = src + i * 32;
            float amax = 0.0f, max = 0.0f;
            for (int j = 0; j < 32; j++) {
                if (fabsf(x[j]) > amax) {
                    amax = fabsf(x[j]);
                    max = x[j];
                }
            }
            float d = max / -8.0f;
            float id = d != 0.0f ? 1.0f / d : 0.0f;
            b[i].d = td_f32_to_fp16(d);
            for (int j = 0; j < 16; j++) {
                int q0 = (int)truncf(x[j] * id + 8.5f);
                int q1 = (int)truncf(x[j + 16] * id + 8.5f);
                q0 = q0 < 0 ? 0 : q0 > 15 ? 15 : q0;
                q1 = q1 < 0 ? 0 : q1 > 15 ? 15 : q1;
                b[i].qs[j] = (uint8_t)(q0 | (q1 << 4));
            }
        }
        return;
    }
    case TD_TYPE_Q4_1: {
        td_block_q4_1 *b = dst;
        for (int64_t i = 0; i < k / 32; i++) {
            const float *x = src + i * 32;
            float min = x[0], max = x[0];
            for (int j = 1; j < 32; j++) {
                min = fminf(min, x[j]);
                max = fmaxf(max, x[j]);
            }
            float d = (max - min) / 15.0f;
            float id = d != 0.0f ? 1.0f / d : 0.0f;
            b[i].d = td_f32_to_fp16(d);
            b[i].m = td_f32_to_fp16(min);
            for (int j = 0; j < 16; j++) {
                int q0 = (int)truncf((x[j] - min) * id + 0.5f);
                int q1 = (int)truncf((x[j + 16] - min) * id + 0.5f);
                q0 = q0 < 0 ? 0 : q0 > 15 ? 15 : q0;
                q1 = q1 < 0 ? 0 : q1 > 15 ? 15 : q1;
                b[i].qs[j] = (uint8_t)(q0 | (q1 << 4));
            }
        }
        return;
    }
    default: break;
    }
    TD_KERNEL_UNREACHABLE_TYPE(t);
}

/* ---- activations ---- */

size_t td_cpu_act_row_bytes(td_dtype wtype, int64_t k) {
    if (td_dtype_has_int8_kernels(wtype)) return k % 32 ? 0 : td_q8x_row_bytes(k / 32);
    if (wtype == TD_TYPE_F32 || wtype == TD_TYPE_F16 || wtype == TD_TYPE_BF16)
        return (size_t)k * sizeof(float);
    return 0;
}

void td_cpu_act_quant_scalar(td_dtype wtype, const float *x, void *xq, int64_t k) {
    if (!td_dtype_has_int8_kernels(wtype)) {
        memcpy(xq, x, (size_t)k * sizeof(float));
        return;
    }
    int64_t nb = k / 32;
    float *d = (float *)xq;
    float *s = d + nb;
    int32_t *sum = (int32_t *)xq + 2 * nb;
    int8_t *qs = (int8_t *)xq + td_q8x_head_bytes(nb);
    /* header padding and row padding are zeroed so rows are fully defined */
    memset((char *)xq + nb * 12, 0, td_q8x_head_bytes(nb) - (size_t)nb * 12);
    memset(qs + (nb / 4) * 128, 0,
           td_q8x_row_bytes(nb) - td_q8x_head_bytes(nb) - (size_t)(nb / 4) * 128);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
        float db = amax / 127.0f;
        float id = db != 0.0f ? 1.0f / db : 0.0f;
        int32_t acc = 0;
        for (int j = 0; j < 32; j++) {
            int q = (int)nearbyintf(xb[j] * id); /* round half to even, like cvtps2dq */
            qs[td_q8x_pos(b, j)] = (int8_t)q;
            acc += q;
        }
        d[b] = db;
        sum[b] = acc;
        s[b] = db * (float)acc;
    }
}

void td_cpu_act_quant(td_dtype wtype, const float *x, void *xq, int64_t k) {
    g_ops->act_quant(wtype, x, xq, k);
}

void td_cpu_matmul(td_dtype wtype, const void *w, size_t w_stride, const void *xq, size_t xq_stride,
                   int n, int64_t k, float *y, size_t ldy, int r0, int r1) {
    if (n <= 0 || r1 <= r0) return;
    g_ops->matmul(wtype, w, w_stride, xq, xq_stride, n, k, y, ldy, r0, r1);
}

void td_cpu_rmsnorm(const float *x, const float *w, float *out, int64_t n, float eps) {
    g_ops->rmsnorm(x, w, out, n, eps);
}
void td_cpu_swiglu(const float *gate, const float *up, float *out, int64_t n) {
    g_ops->swiglu(gate, up, out, n);
}
void td_cpu_add(const float *a, const float *b, float *out, int64_t n) { g_ops->add(a, b, out, n); }
void td_cpu_scale(float *x, float s, int64_t n) { g_ops->scale(x, s, n); }
void td_cpu_softmax(float *x, int64_t n) { g_ops->softmax(x, n); }

void td_cpu_kv_store(td_dtype t, const float *src, void *dst, int64_t n) {
    if (g_ops->kv_store)
        g_ops->kv_store(t, src, dst, n);
    else
        td_cpu_quant_row(t, src, dst, n);
}

void td_cpu_attn_paged(const float *q, const td_cpu_kv_layer *kv, int kv_head,
                       const int32_t *block_table, int n_ctx, float scale, float *out,
                       float *scratch) {
    g_ops->attn_paged(q, kv, kv_head, block_table, n_ctx, scale, out, scratch);
}

void td_cpu_attn_paged_multi(const td_cpu_attn_query *qs, int n_q, const td_cpu_kv_layer *kv,
                             int kv_head, const int32_t *block_table, float scale, float *scratch) {
    if (g_ops->attn_paged_multi) {
        g_ops->attn_paged_multi(qs, n_q, kv, kv_head, block_table, scale, scratch);
        return;
    }
    for (int i = 0; i < n_q; i++)
        g_ops->attn_paged(qs[i].q, kv, kv_head, block_table, qs[i].n_ctx, scale, qs[i].out,
                          scratch);
}

/* RoPE is shared by every ISA: the angles come from double-precision
 * sin/cos, so positions rotate identically everywhere, and its cost (n_rot/2
 * sincos per token, amortised over all heads) is negligible. */
void td_cpu_rope(float *x, int n_heads, int head_dim, int n_rot, int32_t pos, const float *inv_freq,
                 td_rope_mode mode) {
    int half = n_rot / 2;
    float cs[512], sn[512];
    for (int i0 = 0; i0 < half; i0 += 512) {
        int m = half - i0 < 512 ? half - i0 : 512;
        for (int i = 0; i < m; i++) {
            double th = (double)pos * (double)inv_freq[i0 + i];
            cs[i] = (float)cos(th);
            sn[i] = (float)sin(th);
        }
        for (int h = 0; h < n_heads; h++) {
            float *xh = x + (size_t)h * head_dim;
            for (int i = 0; i < m; i++) {
                int a, b;
                if (mode == TD_ROPE_NEOX) {
                    a = i0 + i;
                    b = i0 + i + half;
                } else {
                    a = 2 * (i0 + i);
                    b = a + 1;
                }
                float x0 = xh[a], x1 = xh[b];
                xh[a] = x0 * cs[i] - x1 * sn[i];
                xh[b] = x0 * sn[i] + x1 * cs[i];
            }
        }
    }
}
