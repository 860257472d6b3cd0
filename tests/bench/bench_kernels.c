/* Kernel micro-benchmark: matmul GFLOP/s and weight GB/s for the
 * SmolLM2-135M shapes, per ISA, at n = 1 (generation) and n = 512 (prompt).
 * Built with the tree (build/td-bench-kernels); run as
 *
 *   build/td-bench-kernels [-t THREADS] [-i avx512|avx2|scalar] [-n TOKENS] [-w GGUF_TYPE_ID]
 *                          [-c ROWS_PER_CALL] [-a] [-K] [-S ROWSxK]
 *
 * -a measures td_cpu_matmul_f32act (f32 activations) instead of td_cpu_matmul
 * (activations quantized per row); -x (Q4_K, Q5_K or Q6_K, AMX-INT8) the x24
 * kernels the engine runs for f32 activations there (kernels/cpu/x24.h),
 * called per 256 rows as the engine does, with the activation quantization
 * timed apart. -w with a type of the K-quant mix (q5_0,
 * q5_1, q4_K, q5_K, q6_K), or -K with any -w type, measures
 * Qwen2.5-Coder-1.5B's shapes instead of SmolLM2's; -S one shape of
 * the caller's (with -w). Without -i every ISA the CPU supports is
 * measured (scalar only at n = 1); without -n both n = 1 and n = 512. With
 * -t 1 times are the thread's CPU time, so other load on the machine does not
 * count. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/base/threadpool.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/qmatmul.h"
#include "kernels/cpu/x24.h"

typedef struct {
    td_dtype t;
    const void *w;
    size_t ws;
    const void *xq;
    size_t xs;
    const float *xf; /* f32 activations, (n, k) */
    const void *xa;  /* -x: the x24 activation buffer */
    int n, k, rows;
    float *y;
} mm_job;

static int g_f32act;  /* -a */
static int g_x24;     /* -x */
static int g_kshapes; /* -K: the 1.5B shapes for any -w type */

static int g_shape[2]; /* -S ROWSxK */

static int g_row_chunk; /* -c N: call the kernel per N rows, as a forward pass may */

static void mm_task(void *ctx, int ith, int nth) {
    mm_job *j = ctx;
    int64_t b, e;
    /* rows split in multiples of 4 so every thread keeps full tiles */
    td_split_range((j->rows + 3) / 4, ith, nth, &b, &e);
    int r0 = (int)(b * 4), r1 = (int)(e * 4 < j->rows ? e * 4 : j->rows);
    if (g_x24) { /* whole 16-row strips */
        td_split_range((j->rows + 15) / 16, ith, nth, &b, &e);
        r0 = (int)(b * 16);
        r1 = (int)(e * 16 < j->rows ? e * 16 : j->rows);
    }
    int step = g_x24 ? 256 : g_row_chunk > 0 ? g_row_chunk : r1 - r0;
    for (int r = r0; r < r1; r += step) {
        int re = r + step < r1 ? r + step : r1;
        if (g_x24)
            td_x24_matmul(j->t, j->w, j->ws, j->xa, j->n, j->k, j->y + r, (size_t)j->rows, r, re);
        else if (g_f32act)
            td_cpu_matmul_f32act(j->t, j->w, j->ws, j->xf, (size_t)j->k, j->n, j->k, j->y,
                                 (size_t)j->rows, r, re);
        else
            td_cpu_matmul(j->t, j->w, j->ws, j->xq, j->xs, j->n, j->k, j->y, j->rows, r, re);
    }
}

static int g_cpu_clock; /* -t 1: time with the thread's CPU clock (ignores preemption) */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(g_cpu_clock ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The types td_cpu_quant_row does not write (the K-quant mix's) */
static int no_quantizer(td_dtype t) {
    return td_dtype_is_quant(t) && t != TD_TYPE_Q4_0 && t != TD_TYPE_Q4_1 && t != TD_TYPE_Q8_0;
}

static void bench_one(td_threadpool *tp, td_dtype t, int rows, int k, int n) {
    size_t ws = td_dtype_row_bytes(t, k), xs = td_cpu_act_row_bytes(t, k);
    char *w = malloc(ws * rows), *xq = malloc(xs * n);
    float *x = malloc(sizeof(float) * (size_t)n * k), *y = malloc(sizeof(float) * (size_t)n * rows);
    float *wr = malloc(sizeof(float) * k);
    srand(7);
    int off[2], nf = td_dtype_fp16_fields(t, off);
    for (int r = 0; r < rows; r++) {
        for (int i = 0; i < k; i++) wr[i] = (float)((double)rand() / RAND_MAX) - 0.5f;
        if (no_quantizer(t) && nf) {
            /* no quantizer in C for these: random quants, scales of a real model's size */
            char *row = w + (size_t)r * ws;
            for (size_t i = 0; i < ws; i++) row[i] = (char)rand();
            for (char *b = row; b < row + ws; b += td_dtype_block_bytes(t))
                for (int f = 0; f < nf; f++) {
                    td_fp16 h = td_f32_to_fp16(0.001f + 0.01f * (float)rand() / (float)RAND_MAX);
                    memcpy(b + off[f], &h, 2);
                }
            continue;
        }
        td_cpu_quant_row(t, wr, w + (size_t)r * ws, k);
    }
    for (int tt = 0; tt < n; tt++) {
        float *xt = x + (size_t)tt * k;
        for (int i = 0; i < k; i++) xt[i] = (float)((double)rand() / RAND_MAX) - 0.5f;
        if (xs) td_cpu_act_quant(t, xt, xq + (size_t)tt * xs, k); /* 0: f32 activations only */
    }
    void *xa = NULL;
    double tq = 0;
    if (g_x24) {
        xa = malloc(td_x24_bytes(n, k));
        double t0 = now_s();
        td_x24_quant(x, (size_t)k, 0, n, n, k, xa);
        tq = now_s() - t0;
    }
    mm_job j = {t, w, ws, xq, xs, x, xa, n, k, rows, y};
    td_threadpool_run(tp, mm_task, &j); /* warm up */
    double best = 1e30;
    double budget = td_time_s() + 0.3;
    int reps = 0;
    do {
        double t0 = now_s();
        td_threadpool_run(tp, mm_task, &j);
        double dt = now_s() - t0;
        if (dt < best) best = dt;
        reps++;
    } while (td_time_s() < budget || reps < 3);
    double flop = 2.0 * rows * (double)k * n;
    printf("%-7s%s %-5s %6d x %-5d n=%-4d %9.1f us %8.1f GFLOP/s %7.1f GB/s",
           td_cpu_isa_name(td_cpu_selected()),
           g_x24      ? "/x24"
           : g_f32act ? "/f32act"
                      : "",
           td_dtype_name(t), rows, k, n, best * 1e6, flop / best * 1e-9,
           (double)ws * rows / best * 1e-9);
    if (g_x24) printf("  (+ %.1f us to quantize the activations, one thread)", tq * 1e6);
    printf("\n");
    free(w), free(xq), free(x), free(y), free(wr), free(xa);
}

int main(int argc, char **argv) {
    int threads = 2, only_n = 0, only_isa = -1, only_type = -1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-a")) g_f32act = 1;
        if (!strcmp(argv[i], "-x")) g_x24 = g_f32act = 1;
        if (!strcmp(argv[i], "-K")) g_kshapes = 1;
    }
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-a") || !strcmp(argv[i], "-K") || !strcmp(argv[i], "-x")) {
            i--;
            continue;
        }
        if (!strcmp(argv[i], "-t"))
            threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-n"))
            only_n = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-i"))
            only_isa = td_cpu_isa_parse(argv[i + 1]);
        else if (!strcmp(argv[i], "-c"))
            g_row_chunk = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-w"))
            only_type = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-S") &&
                 sscanf(argv[i + 1], "%dx%d", &g_shape[0], &g_shape[1]) != 2) {
            fprintf(stderr, "td-bench-kernels: -S takes ROWSxK\n");
            return 2;
        }
    }
    if (g_shape[0] > 0 && only_type < 0) {
        fprintf(stderr, "td-bench-kernels: -S needs -w\n");
        return 2;
    }
    g_cpu_clock = threads == 1;
    if (only_type >= 0 && !g_f32act && td_cpu_act_row_bytes((td_dtype)only_type, 1536) == 0) {
        fprintf(stderr, "td-bench-kernels: %s has f32-activation kernels only: add -a\n",
                td_dtype_name(only_type));
        return 2;
    }
    td_threadpool *tp;
    if (td_threadpool_create(threads, &tp) != TD_OK) return 1;
    static const int shapes[][2] = {{576, 576}, {192, 576}, {1536, 576}, {576, 1536}};
    /* -w with a type of the K-quant mix: Qwen2.5-Coder-1.5B's shapes (rows of
     * 1536 and 8960, whole super-blocks) */
    static const int kshapes[][2] = {{1536, 1536}, {256, 1536}, {8960, 1536}, {1536, 8960}};
    static const td_dtype types[] = {TD_TYPE_Q4_1, TD_TYPE_Q8_0, TD_TYPE_F16};
    const int kmix = only_type >= 0 && td_dtype_supported(only_type) &&
                     (g_kshapes || no_quantizer((td_dtype)only_type));
    static const int ns[] = {1, 512};
    printf("threads=%d\n", threads);
    for (int isa = TD_ISA_AVX512; isa >= TD_ISA_SCALAR; isa--) {
        if (only_isa >= 0 && isa != only_isa) continue;
        if (!td_cpu_select((td_isa)isa)) continue;
        td_x24_set_enabled(g_x24);
        if (g_x24 && !td_x24_type((td_dtype)only_type)) {
            if (isa == TD_ISA_AVX512)
                fprintf(
                    stderr,
                    "td-bench-kernels: -x needs -w 12, 13 or 14 (q4_K, q5_K, q6_K) and AMX-INT8\n");
            continue;
        }
        for (int ni = 0; ni < 2; ni++) {
            int n = ns[ni];
            if (only_n && n != only_n) continue;
            if (isa == TD_ISA_SCALAR && n > 1 && only_isa < 0) continue;
            if (g_shape[0] > 0) {
                bench_one(tp, (td_dtype)only_type, g_shape[0], g_shape[1], n);
                continue;
            }
            if (kmix) {
                for (size_t si = 0; si < 4; si++)
                    bench_one(tp, (td_dtype)only_type, kshapes[si][0], kshapes[si][1], n);
                continue;
            }
            for (size_t ti = 0; ti < 3; ti++)
                for (size_t si = 0; si < 4; si++)
                    if (only_type < 0 || only_type == (int)types[ti])
                        bench_one(tp, types[ti], shapes[si][0], shapes[si][1], n);
            if (only_type < 0 || only_type == TD_TYPE_Q8_0)
                bench_one(tp, TD_TYPE_Q8_0, 49152, 576, n);
        }
    }
    td_threadpool_destroy(tp);
    return 0;
}
