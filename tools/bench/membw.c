/* td-membw: read bandwidth of main memory with N threads, the ceiling for
 * memory-bound generation (docs/PERFORMANCE.md: fraction of the bandwidth
 * limit = measured tg t/s / (bandwidth / weight bytes per token)).
 *
 *   td-membw [--threads N] [--mib M] [--reps R]
 *
 * Each thread sums its slice of a buffer much larger than the caches with
 * 256-bit loads; prints the median GB/s over R passes. */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/base.h"

typedef struct {
    const uint8_t *p;
    size_t n;
    uint64_t sink;
} slice;

__attribute__((target("avx2"))) static void *read_slice(void *arg) {
    slice *s = arg;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 128 <= s->n; i += 128) {
        a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i *)(s->p + i)));
        a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i *)(s->p + i + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_load_si256((const __m256i *)(s->p + i + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_load_si256((const __m256i *)(s->p + i + 96)));
    }
    a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    s->sink = (uint64_t)_mm256_extract_epi64(a0, 0);
    return NULL;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int threads = 2, reps = 7;
    size_t mib = 1024;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--mib") && i + 1 < argc)
            mib = (size_t)atol(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: td-membw [--threads N] [--mib M] [--reps R]\n");
            return 2;
        }
    }
    if (threads < 1 || threads > 256 || reps < 1 || reps > 100 || mib < 64) {
        fprintf(stderr, "td-membw: bad arguments\n");
        return 2;
    }
    size_t bytes = mib << 20;
    uint8_t *buf = aligned_alloc(4096, bytes);
    if (!buf) {
        fprintf(stderr, "td-membw: cannot allocate %zu MiB\n", mib);
        return 1;
    }
    memset(buf, 1, bytes);
    pthread_t tid[256];
    slice sl[256];
    double gbs[100];
    size_t per = (bytes / (size_t)threads) & ~(size_t)127;
    for (int r = 0; r < reps; r++) {
        double t0 = td_time_s();
        for (int t = 0; t < threads; t++) {
            sl[t] = (slice){buf + (size_t)t * per, per, 0};
            pthread_create(&tid[t], NULL, read_slice, &sl[t]);
        }
        for (int t = 0; t < threads; t++) pthread_join(tid[t], NULL);
        gbs[r] = (double)per * threads / (td_time_s() - t0) / 1e9;
    }
    qsort(gbs, (size_t)reps, sizeof gbs[0], cmp_double);
    printf("{\"threads\": %d, \"mib\": %zu, \"read_gb_s\": %.2f}\n", threads, mib, gbs[reps / 2]);
    free(buf);
    return 0;
}
