/* td-comm-bench: bus bandwidth of the shm comm backend's all-reduce and
 * all-gather against message size, with N rank processes on this host
 * (docs/PERFORMANCE.md). nccl-tests convention: for all-reduce, size is
 * the buffer each rank reduces; for all-gather, the gathered buffer
 * (N x the per-rank part). algbw = size / time; busbw = algbw x 2(N-1)/N
 * for all-reduce and algbw x (N-1)/N for all-gather. time is the slowest
 * rank's mean over the iterations.
 *
 *   td-comm-bench [--ranks N] [--min-bytes B] [--max-bytes B]
 *                 [--chunk-kib K] [--iters I]
 *
 * Ranks are forked before anything else is initialised. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/base/base.h"
#include "common/comm/comm.h"

typedef struct {
    int ranks;
    size_t min_bytes, max_bytes, chunk;
    int iters; /* 0: from the size */
} opts;

static int iters_for(const opts *o, size_t bytes) {
    if (o->iters > 0) return o->iters;
    size_t it = ((size_t)256 << 20) / (bytes ? bytes : 1);
    return (int)TD_MAX((size_t)5, TD_MIN(it, (size_t)1000));
}

static int rank_main(const char *name, const opts *o, int rank) {
    td_comm_params p = td_comm_default_params();
    p.chunk_bytes = o->chunk;
    td_comm *c = NULL;
    if (td_comm_shm_create(name, o->ranks, rank, &p, &c)) return 1;
    float *buf = calloc(o->max_bytes / sizeof(float) + 1, sizeof(float));
    float *gathered = calloc(o->max_bytes / sizeof(float) + 1, sizeof(float));
    int rc = buf && gathered ? 0 : 1;
    if (rank == 0 && !rc) {
        printf("# shm backend, %d ranks, %zu KiB staging per rank\n", o->ranks, o->chunk >> 10);
        printf("%12s %6s | %10s %9s %9s | %10s %9s %9s\n", "bytes", "iters", "ar_us", "ar_algbw",
               "ar_busbw", "ag_us", "ag_algbw", "ag_busbw");
    }
    double nr = o->ranks;
    for (size_t bytes = o->min_bytes; bytes <= o->max_bytes && !rc; bytes *= 2) {
        size_t n = bytes / sizeof(float), per = n / (size_t)o->ranks;
        int iters = iters_for(o, bytes);
        float t[2];
        for (int which = 0; which < 2 && !rc; which++) {
            td_status st = TD_OK;
            for (int w = 0; w < 2 && !st; w++) /* warm-up */
                st = which ? td_comm_all_gather(c, buf, gathered, per * sizeof(float), NULL)
                           : td_comm_all_reduce(c, buf, n, TD_COMM_F32, TD_COMM_SUM, NULL);
            if (!st) st = td_comm_barrier(c);
            double t0 = td_time_s();
            for (int i = 0; i < iters && !st; i++)
                st = which ? td_comm_all_gather(c, buf, gathered, per * sizeof(float), NULL)
                           : td_comm_all_reduce(c, buf, n, TD_COMM_F32, TD_COMM_SUM, NULL);
            t[which] = (float)((td_time_s() - t0) / iters);
            if (st || td_comm_all_reduce(c, &t[which], 1, TD_COMM_F32, TD_COMM_MAX, NULL)) rc = 1;
        }
        if (rank == 0 && !rc) {
            double ag_bytes = (double)(per * sizeof(float)) * nr;
            double ar_alg = (double)(n * sizeof(float)) / t[0] / 1e9,
                   ag_alg = ag_bytes / t[1] / 1e9;
            printf("%12zu %6d | %10.1f %9.3f %9.3f | %10.1f %9.3f %9.3f\n", n * sizeof(float),
                   iters, t[0] * 1e6, ar_alg, ar_alg * 2 * (nr - 1) / nr, t[1] * 1e6, ag_alg,
                   ag_alg * (nr - 1) / nr);
            fflush(stdout);
        }
    }
    free(buf);
    free(gathered);
    td_comm_destroy(c);
    return rc;
}

static size_t parse_size(const char *s) {
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    return *end ? 0 : (size_t)v;
}

int main(int argc, char **argv) {
    opts o = {
        .ranks = 4, .min_bytes = 1024, .max_bytes = (size_t)64 << 20, .chunk = (size_t)1 << 20};
    for (int i = 1; i < argc; i += 2) { /* every option takes a value */
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--ranks") && v)
            o.ranks = atoi(v);
        else if (!strcmp(argv[i], "--min-bytes") && v)
            o.min_bytes = parse_size(v);
        else if (!strcmp(argv[i], "--max-bytes") && v)
            o.max_bytes = parse_size(v);
        else if (!strcmp(argv[i], "--chunk-kib") && v)
            o.chunk = parse_size(v) << 10;
        else if (!strcmp(argv[i], "--iters") && v)
            o.iters = atoi(v);
        else {
            fprintf(stderr, "usage: td-comm-bench [--ranks N] [--min-bytes B] [--max-bytes B] "
                            "[--chunk-kib K] [--iters I]\n");
            return 2;
        }
    }
    if (o.ranks < 1 || o.ranks > TD_COMM_MAX_RANKS ||
        o.min_bytes < sizeof(float) * (size_t)o.ranks || o.max_bytes < o.min_bytes ||
        o.max_bytes > ((size_t)1 << 34) || o.iters < 0) {
        fprintf(stderr,
                "td-comm-bench: --ranks 1..%d, --min-bytes >= 4 x ranks, --max-bytes >= "
                "--min-bytes (at most 16 GiB)\n",
                TD_COMM_MAX_RANKS);
        return 2;
    }
    char name[64];
    snprintf(name, sizeof name, "/td-comm-bench-%d", (int)getpid());
    fflush(stdout);
    pid_t pid[TD_COMM_MAX_RANKS];
    int started = 0, rc = 0;
    for (; started < o.ranks; started++) {
        pid[started] = fork();
        if (pid[started] < 0) {
            perror("fork");
            rc = 1;
            break;
        }
        if (pid[started] == 0) _exit(rank_main(name, &o, started));
    }
    for (int r = 0; r < started; r++) {
        int st = 0;
        if (rc) kill(pid[r], SIGTERM);
        if (waitpid(pid[r], &st, 0) != pid[r] || !WIFEXITED(st) || WEXITSTATUS(st)) rc = 1;
    }
    return rc;
}
