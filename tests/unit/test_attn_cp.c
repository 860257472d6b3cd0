/* Context-parallel attention pieces (kernels/cpu/attn-cp.h): partial
 * attention over the blocks one CP rank holds (block j on rank j mod cp)
 * merged over the ranks equals softmax attention over the whole context,
 * computed here independently in double precision from the same K/V.
 * Tolerance 2e-5 absolute on outputs of magnitude <= 1: float32 exp and
 * accumulation over at most a few hundred positions, then one rescaling
 * per rank, stay well below it; a wrong rescaling (e.g. adding outputs)
 * is off by O(0.1). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/cpu/attn-cp.h"

#define BS    4
#define HD    8
#define NKV   2
#define NBLK  96
#define MAXCP 4

static uint64_t g_rng = 0x1234567;
static float frand(void) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(g_rng >> 11) / 9007199254740992.0) * 2.0f - 1.0f;
}

typedef struct {
    float k[NBLK * BS * NKV * HD], v[NBLK * BS * NKV * HD];
    int32_t table[NBLK]; /* sequence block j -> pool block (scattered) */
    td_cpu_kv_layer kv;
} pool;

static void pool_init(pool *p) {
    for (size_t i = 0; i < sizeof p->k / sizeof p->k[0]; i++) {
        p->k[i] = 2.0f * frand();
        p->v[i] = frand();
    }
    for (int j = 0; j < NBLK; j++) p->table[j] = (j * 37 + 11) % NBLK; /* a permutation */
    p->kv = (td_cpu_kv_layer){
        .k = p->k, .v = p->v, .block_size = BS, .n_kv_heads = NKV, .head_dim = HD};
}

/* Double-precision softmax attention over positions [0, n_ctx). */
static void reference(const pool *p, const float *q, int kvh, int n_ctx, float scale, double *out) {
    double *l = malloc((size_t)n_ctx * sizeof *l), m = -INFINITY, s = 0;
    for (int t = 0; t < n_ctx; t++) {
        const float *k =
            p->k + ((size_t)p->table[t / BS] * BS + (size_t)(t % BS)) * NKV * HD + (size_t)kvh * HD;
        double dot = 0;
        for (int d = 0; d < HD; d++) dot += (double)q[d] * k[d];
        l[t] = dot * scale;
        if (l[t] > m) m = l[t];
    }
    for (int t = 0; t < n_ctx; t++) s += exp(l[t] - m);
    for (int d = 0; d < HD; d++) out[d] = 0;
    for (int t = 0; t < n_ctx; t++) {
        const float *v =
            p->v + ((size_t)p->table[t / BS] * BS + (size_t)(t % BS)) * NKV * HD + (size_t)kvh * HD;
        for (int d = 0; d < HD; d++) out[d] += exp(l[t] - m) / s * v[d];
    }
    free(l);
}

static void test_partials_merge_to_full(void **state) {
    (void)state;
    static pool p;
    pool_init(&p);
    float scale = 1.0f / sqrtf((float)HD);
    float scratch[NBLK * BS];
    const int ctxs[] = {1, 3, 4, 5, 17, 64, 131, NBLK * BS};
    for (int cp = 1; cp <= MAXCP; cp++) {
        for (size_t ci = 0; ci < sizeof ctxs / sizeof ctxs[0]; ci++) {
            int n_ctx = ctxs[ci];
            for (int kvh = 0; kvh < NKV; kvh++) {
                float q[HD];
                for (int d = 0; d < HD; d++) q[d] = frand();
                double ref[HD];
                reference(&p, q, kvh, n_ctx, scale, ref);
                /* Each rank's compact table: its blocks j = r, r + cp, ... */
                float outs[MAXCP][HD];
                td_cpu_attn_part parts[MAXCP];
                int32_t local[MAXCP][NBLK];
                for (int r = 0; r < cp; r++) {
                    int n = 0;
                    for (int j = r; j < NBLK; j += cp) local[r][n++] = p.table[j];
                    parts[r].out = outs[r];
                    td_cpu_attn_partial(q, &p.kv, kvh, local[r], n_ctx, cp, r, scale, &parts[r],
                                        scratch);
                    /* A rank with no position in range reports an empty part. */
                    if (r * BS >= n_ctx) {
                        assert_true(parts[r].s == 0.0f);
                        assert_true(isinf(parts[r].m) && parts[r].m < 0);
                    } else {
                        assert_true(parts[r].s >= 1.0f); /* its max term is exp(0) */
                    }
                }
                float out[HD];
                td_cpu_attn_part merged;
                td_cpu_attn_merge(parts, cp, HD, out, &merged);
                for (int d = 0; d < HD; d++) assert_true(fabs(out[d] - ref[d]) < 2e-5);
                /* The whole context in one part equals td_cpu_attn_paged. */
                if (cp == 1) {
                    float full[HD];
                    td_cpu_attn_paged(q, &p.kv, kvh, p.table, n_ctx, scale, full, scratch);
                    for (int d = 0; d < HD; d++) assert_true(fabsf(full[d] - out[d]) < 2e-5f);
                }
                /* Merging is associative: (r0 + r1) + rest equals all at once,
                 * the ring's step-by-step accumulation. */
                if (cp >= 3) {
                    float acc_out[HD];
                    td_cpu_attn_part acc;
                    td_cpu_attn_merge(parts, 2, HD, acc_out, &acc);
                    for (int r = 2; r < cp; r++) {
                        td_cpu_attn_part two[2] = {acc, parts[r]};
                        td_cpu_attn_merge(two, 2, HD, acc_out, &acc); /* out aliases two[0] */
                    }
                    for (int d = 0; d < HD; d++) assert_true(fabsf(acc_out[d] - out[d]) < 2e-5f);
                    assert_true(fabsf(acc.s - merged.s) <= 1e-4f * merged.s);
                }
            }
        }
    }
}

static void test_merge_is_not_a_sum(void **state) {
    (void)state;
    /* Two parts, one with a much larger max: the result follows it. Sum
     * or average of the outputs would give 0.5 / 1.0 here. */
    float a[HD], b[HD], out[HD];
    for (int d = 0; d < HD; d++) {
        a[d] = 1.0f;
        b[d] = 0.0f;
    }
    td_cpu_attn_part parts[2] = {{.out = a, .m = 10.0f, .s = 1.0f},
                                 {.out = b, .m = 0.0f, .s = 1.0f}};
    td_cpu_attn_merge(parts, 2, HD, out, NULL);
    double w = 1.0 / (1.0 + exp(-10.0));
    for (int d = 0; d < HD; d++) assert_true(fabs(out[d] - w) < 1e-6);
    /* Every part empty: zeros, and an empty merged part. */
    td_cpu_attn_part none[2] = {{.out = a, .m = -INFINITY, .s = 0},
                                {.out = b, .m = -INFINITY, .s = 0}};
    td_cpu_attn_part merged;
    td_cpu_attn_merge(none, 2, HD, out, &merged);
    for (int d = 0; d < HD; d++) assert_true(out[d] == 0.0f);
    assert_true(merged.s == 0.0f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_partials_merge_to_full),
        cmocka_unit_test(test_merge_is_not_a_sum),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
