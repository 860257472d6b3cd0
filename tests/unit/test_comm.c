/* Conformance suite for the comm interface: one set of checks (conform())
 * runs on every backend, through its table of operations — single; local
 * with 1-4 thread ranks; shm with 1-4 rank processes forked here — for
 * every collective, every reduction in every element type (float32,
 * float16, bfloat16), send/recv and sub-group splits, with sizes from one element to a few MiB
 * (larger than the 64 KiB staging buffers used here, so chunking is exercised). Expected values are
 * computed serially in the test from the same deterministic per-rank inputs every rank can
 * regenerate. Data movement is compared exactly; reductions too: the interface combines in rank
 * order 0..n-1, so the result must equal the serial float32 fold
 * ((x0 + x1) + x2) + x3 bit for bit (the inputs span 16 binary exponents,
 * so any other order would differ in many elements). Dead-rank tests check
 * that a missing rank yields TD_ERR_IO within the deadline, not a hang.
 *
 * conform() runs in rank threads and forked processes, so it reports
 * failures by returning non-zero (with a line on stderr) rather than
 * through cmocka, which is only used in the main thread. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/comm/comm.h"

#define CHUNK      (64 * 1024) /* staging bytes per rank in these tests */
#define BIG_BYTES  ((size_t)3 * 1024 * 1024 + 13)
#define BIG_FLOATS ((size_t)300007)

#define CHECK(c, cond)                                                                             \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: rank %d of %d: check failed: %s\n", __FILE__, __LINE__,        \
                    td_comm_rank(c), td_comm_size(c), #cond);                                      \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

#define OK(c, expr) CHECK(c, (expr) == TD_OK)

static uint32_t mix(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

static uint32_t hash3(uint32_t seed, uint32_t rank, size_t i) {
    return mix(seed * 0x9e3779b9u ^ mix(rank + 0x51ed27u) ^ mix((uint32_t)i ^ (uint32_t)(i >> 32)));
}

static uint8_t byte_of(uint32_t seed, int rank, size_t i) {
    return (uint8_t)hash3(seed, (uint32_t)rank, i);
}

/* Signed values over 16 binary exponents: sums depend on their order. */
static float val_of(uint32_t seed, int rank, size_t i) {
    uint32_t h = hash3(seed, (uint32_t)rank, i);
    return ((float)(int32_t)(h % 2000001u) - 1000000.0f) * ldexpf(1.0f, (int)(h >> 27) - 24);
}

static float serial(uint32_t seed, int n, size_t i, td_comm_op op) {
    float s = val_of(seed, 0, i);
    for (int r = 1; r < n; r++) {
        float x = val_of(seed, r, i);
        s = op == TD_COMM_SUM ? s + x : fmaxf(s, x);
    }
    return s;
}

static void fill_bytes(uint8_t *p, size_t n, uint32_t seed, int rank, size_t i0) {
    for (size_t i = 0; i < n; i++) p[i] = byte_of(seed, rank, i0 + i);
}

static int bytes_are(const uint8_t *p, size_t n, uint32_t seed, int rank, size_t i0) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != byte_of(seed, rank, i0 + i)) return 0;
    return 1;
}

static int all_equal(const uint8_t *p, size_t n, uint8_t v) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != v) return 0;
    return 1;
}

/* ---- the conformance checks ---- */

static int check_bytes_ops(td_comm *c, uint32_t seed, size_t B, bool all_roots) {
    int me = td_comm_rank(c), n = td_comm_size(c);
    size_t nB = (size_t)n * B;
    uint8_t *a = malloc(nB + 1), *b = malloc(nB + 1);
    CHECK(c, a && b);
    int rc = 0;
    for (int root = all_roots ? 0 : n - 1; root < n && !rc; root++) {
        /* broadcast */
        fill_bytes(a, B, seed + 1, me, 0);
        OK(c, td_comm_broadcast(c, a, B, root, NULL));
        CHECK(c, bytes_are(a, B, seed + 1, root, 0));
        /* scatter: root's block r goes to rank r */
        fill_bytes(a, nB, seed + 2, me, 0);
        memset(b, 0xab, B);
        OK(c, td_comm_scatter(c, a, b, B, root, NULL));
        CHECK(c, bytes_are(b, B, seed + 2, root, (size_t)me * B));
        /* gather: recv written on root only */
        fill_bytes(a, B, seed + 3, me, 0);
        memset(b, 0xcd, nB);
        OK(c, td_comm_gather(c, a, b, B, root, NULL));
        for (int k = 0; k < n; k++)
            CHECK(c, me == root ? bytes_are(b + (size_t)k * B, B, seed + 3, k, 0)
                                : all_equal(b + (size_t)k * B, B, 0xcd));
    }
    /* all-gather, then in place (send inside recv) */
    fill_bytes(a, B, seed + 4, me, 0);
    OK(c, td_comm_all_gather(c, a, b, B, NULL));
    for (int k = 0; k < n; k++) CHECK(c, bytes_are(b + (size_t)k * B, B, seed + 4, k, 0));
    memset(b, 0, nB);
    fill_bytes(b + (size_t)me * B, B, seed + 5, me, 0);
    OK(c, td_comm_all_gather(c, b + (size_t)me * B, b, B, NULL));
    for (int k = 0; k < n; k++) CHECK(c, bytes_are(b + (size_t)k * B, B, seed + 5, k, 0));
    /* all-to-all: block j of rank k's send lands at block k of rank j */
    fill_bytes(a, nB, seed + 6, me, 0);
    OK(c, td_comm_all_to_all(c, a, b, B, NULL));
    for (int k = 0; k < n; k++)
        CHECK(c, bytes_are(b + (size_t)k * B, B, seed + 6, k, (size_t)me * B));
    free(a);
    free(b);
    return rc;
}

static int check_float_ops(td_comm *c, uint32_t seed, size_t N, bool all_roots) {
    int me = td_comm_rank(c), n = td_comm_size(c);
    size_t nN = (size_t)n * N;
    float *a = malloc((nN + 1) * sizeof(float)), *b = malloc((nN + 1) * sizeof(float));
    float *want = malloc((N + 1) * sizeof(float));
    CHECK(c, a && b && want);
    for (int o = 0; o < 2; o++) {
        td_comm_op op = o ? TD_COMM_MAX : TD_COMM_SUM;
        uint32_t s = seed + 10 * (uint32_t)o;
        for (size_t i = 0; i < N; i++) want[i] = serial(s, n, i, op);
        /* all-reduce, in place: identical bits on every rank */
        for (size_t i = 0; i < N; i++) a[i] = val_of(s, me, i);
        OK(c, td_comm_all_reduce(c, a, N, TD_COMM_F32, op, NULL));
        CHECK(c, memcmp(a, want, N * sizeof(float)) == 0);
        if (op == TD_COMM_SUM) {
            for (size_t i = 0; i < N; i++) a[i] = val_of(s, me, i);
            OK(c, td_comm_all_reduce(c, a, N, TD_COMM_F32, TD_COMM_SUM, NULL));
            CHECK(c, memcmp(a, want, N * sizeof(float)) == 0);
        }
        /* reduce to a root: recv written on root only */
        for (int root = all_roots ? 0 : n - 1; root < n; root++) {
            for (size_t i = 0; i < N; i++) a[i] = val_of(s, me, i);
            for (size_t i = 0; i < N; i++) b[i] = -7.0f;
            OK(c, td_comm_reduce(c, a, b, N, TD_COMM_F32, op, root, NULL));
            if (me == root)
                CHECK(c, memcmp(b, want, N * sizeof(float)) == 0);
            else
                for (size_t i = 0; i < N; i++) CHECK(c, b[i] == -7.0f);
        }
        /* reduce-scatter: block r of the fold goes to rank r */
        for (size_t i = 0; i < nN; i++) a[i] = val_of(s + 1, me, i);
        OK(c, td_comm_reduce_scatter(c, a, b, N, TD_COMM_F32, op, NULL));
        for (size_t i = 0; i < N; i++)
            CHECK(c, memcmp(&b[i], &(float){serial(s + 1, n, (size_t)me * N + i, op)},
                            sizeof(float)) == 0);
    }
    free(a);
    free(b);
    free(want);
    return 0;
}

/* ---- float16 and bfloat16 ----
 * The reference conversions are written here from the formats'
 * definitions, not the kernels' helpers the backends use: a float16 is
 * read as its value (ldexpf of its significand), and a float32 is rounded
 * to the nearest float16 by a search over the finite float16 values (which
 * grow with their bit patterns), ties to the even one; a bfloat16 is the
 * upper 16 bits of a float32, rounded to nearest, ties to even. */

static float f16_value(uint16_t h) {
    int e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0    ? ldexpf((float)m, -24)
              : e == 31 ? (m ? NAN : INFINITY)
                        : ldexpf((float)(1024 + m), e - 25);
    return (h & 0x8000) ? -v : v;
}

static uint16_t f16_nearest(float f) {
    uint16_t sign = signbit(f) ? 0x8000 : 0;
    float a = fabsf(f);
    if (a >= 65520.0f) return sign | 0x7c00; /* beyond half-way past the largest: inf */
    uint16_t lo = 0, hi = 0x7bff;            /* f16_value(lo) <= a < f16_value(hi), or a at hi */
    if (a >= f16_value(hi)) return sign | hi;
    while (hi - lo > 1) {
        uint16_t mid = (uint16_t)((lo + hi) / 2);
        if (f16_value(mid) <= a)
            lo = mid;
        else
            hi = mid;
    }
    float dl = a - f16_value(lo), dh = f16_value(hi) - a;
    return sign | (dl < dh || (dl == dh && !(lo & 1)) ? lo : hi);
}

static float h_to_f32(td_comm_dtype dt, uint16_t h) {
    if (dt == TD_COMM_F16) return f16_value(h);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t f32_to_h(td_comm_dtype dt, float f) {
    if (dt == TD_COMM_F16) return f16_nearest(f);
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t low = u & 0xffffu, up = u >> 16;
    if (low > 0x8000u || (low == 0x8000u && (up & 1u))) up++;
    return (uint16_t)up;
}

/* Values of the type, signed, over 16 binary exponents (in float16's range). */
static uint16_t hval_of(td_comm_dtype dt, uint32_t seed, int rank, size_t i) {
    uint32_t h = hash3(seed, (uint32_t)rank, i);
    float f = ((float)(int32_t)(h % 2001u) - 1000.0f) * ldexpf(1.0f, (int)(h >> 28) - 10);
    return f32_to_h(dt, f);
}

/* The fold in float32 in rank order, rounded once. */
static uint16_t hserial(td_comm_dtype dt, uint32_t seed, int n, size_t i, td_comm_op op) {
    float s = h_to_f32(dt, hval_of(dt, seed, 0, i));
    for (int r = 1; r < n; r++) {
        float x = h_to_f32(dt, hval_of(dt, seed, r, i));
        s = op == TD_COMM_SUM ? s + x : fmaxf(s, x);
    }
    return f32_to_h(dt, s);
}

static int check_half_ops(td_comm *c, td_comm_dtype dt, uint32_t seed, size_t N) {
    int me = td_comm_rank(c), n = td_comm_size(c);
    size_t nN = (size_t)n * N;
    uint16_t *a = malloc((nN + 1) * 2), *b = malloc((nN + 1) * 2), *want = malloc((N + 1) * 2);
    CHECK(c, a && b && want);
    for (int o = 0; o < 2; o++) {
        td_comm_op op = o ? TD_COMM_MAX : TD_COMM_SUM;
        uint32_t s = seed + 10 * (uint32_t)o;
        for (size_t i = 0; i < N; i++) want[i] = hserial(dt, s, n, i, op);
        for (size_t i = 0; i < N; i++) a[i] = hval_of(dt, s, me, i);
        OK(c, td_comm_all_reduce(c, a, N, dt, op, NULL));
        CHECK(c, memcmp(a, want, N * 2) == 0);
        for (int root = 0; root < n; root++) {
            for (size_t i = 0; i < N; i++) a[i] = hval_of(dt, s, me, i);
            for (size_t i = 0; i < N; i++) b[i] = 0x7777;
            OK(c, td_comm_reduce(c, a, b, N, dt, op, root, NULL));
            if (me == root)
                CHECK(c, memcmp(b, want, N * 2) == 0);
            else
                for (size_t i = 0; i < N; i++) CHECK(c, b[i] == 0x7777);
        }
        for (size_t i = 0; i < nN; i++) a[i] = hval_of(dt, s + 1, me, i);
        OK(c, td_comm_reduce_scatter(c, a, b, N, dt, op, NULL));
        for (size_t i = 0; i < N; i++)
            CHECK(c, b[i] == hserial(dt, s + 1, n, (size_t)me * N + i, op));
    }
    free(a);
    free(b);
    free(want);
    return 0;
}

/* Every reduction in every element type; ranks that disagree on the type
 * are all told; a stream or an unknown type is refused on the CPU
 * backends. */
static int check_dtypes(td_comm *c, uint32_t seed, bool big) {
    int me = td_comm_rank(c), n = td_comm_size(c);
    CHECK(c, td_comm_dtype_size(TD_COMM_F32) == 4 && td_comm_dtype_size(TD_COMM_F16) == 2 &&
                 td_comm_dtype_size(TD_COMM_BF16) == 2 &&
                 td_comm_dtype_size((td_comm_dtype)TD_COMM_N_DTYPES) == 0);
    static const size_t sizes[] = {0, 1, 7, 1001};
    for (int d = TD_COMM_F16; d <= TD_COMM_BF16; d++)
        for (size_t i = 0; i < TD_ARRAY_SIZE(sizes); i++)
            if (check_half_ops(c, (td_comm_dtype)d, seed + (uint32_t)(d * 100 + i), sizes[i]))
                return 1;
    /* several rounds of the staging buffers */
    if (big && check_half_ops(c, TD_COMM_BF16, seed + 7, (size_t)3 * CHUNK + 5)) return 1;
    uint16_t x[4] = {0};
    td_comm_dtype mine = me == n - 1 && n > 1 ? TD_COMM_F16 : TD_COMM_BF16;
    CHECK(c,
          td_comm_all_reduce(c, x, 4, mine, TD_COMM_SUM, NULL) == (n > 1 ? TD_ERR_INVALID : TD_OK));
    CHECK(c, td_comm_all_reduce(c, x, 4, (td_comm_dtype)9, TD_COMM_SUM, NULL) == TD_ERR_INVALID);
    int stream;
    CHECK(c, td_comm_all_reduce(c, x, 2, TD_COMM_F32, TD_COMM_SUM, &stream) == TD_ERR_INVALID);
    CHECK(c, td_comm_broadcast(c, x, 2, 0, &stream) == TD_ERR_INVALID);
    CHECK(c, td_comm_all_gather(c, x, x, 0, &stream) == TD_ERR_INVALID);
    return 0;
}

/* Bytes rank s sends to rank d (some pairs send nothing). */
static size_t a2av_count(int s, int d, size_t unit) {
    return (s + d) % 3 == 1 ? 0 : unit * (size_t)(1 + s) + (size_t)(3 * d);
}

static int check_all_to_all_v(td_comm *c, uint32_t seed, size_t unit) {
    int me = td_comm_rank(c), n = td_comm_size(c);
    size_t sb[TD_COMM_MAX_RANKS], sd[TD_COMM_MAX_RANKS], rb[TD_COMM_MAX_RANKS],
        rd[TD_COMM_MAX_RANKS], st = 0, rt = 0;
    for (int j = 0; j < n; j++) { /* send packed in order with 5-byte gaps */
        sb[j] = a2av_count(me, j, unit);
        sd[j] = st;
        st += sb[j] + 5;
    }
    for (int k = n - 1; k >= 0; k--) { /* receive packed in reverse order */
        rb[k] = a2av_count(k, me, unit);
        rd[k] = rt;
        rt += rb[k];
    }
    uint8_t *s = malloc(st + 1), *r = malloc(rt + 1);
    CHECK(c, s && r);
    for (int j = 0; j < n; j++) fill_bytes(s + sd[j], sb[j], seed, me, (size_t)j << 32);
    OK(c, td_comm_all_to_all_v(c, s, sb, sd, r, rb, rd, NULL));
    for (int k = 0; k < n; k++) CHECK(c, bytes_are(r + rd[k], rb[k], seed, k, (size_t)me << 32));
    /* a receiver that expects a different count: every rank is told */
    if (n > 1) {
        if (me == 1) rb[0]++;
        CHECK(c, td_comm_all_to_all_v(c, s, sb, sd, r, rb, rd, NULL) == TD_ERR_INVALID);
    }
    free(s);
    free(r);
    return 0;
}

static int check_p2p(td_comm *c, uint32_t seed, size_t B) {
    int me = td_comm_rank(c), n = td_comm_size(c);
    if (n == 1) {
        uint8_t x = 0;
        CHECK(c, td_comm_send(c, &x, 1, 0, NULL) == TD_ERR_INVALID);
        return 0;
    }
    uint8_t *buf = malloc(B + 16); /* room for the 10/12-byte mismatch below */
    CHECK(c, buf);
    /* a pipeline: rank 0 sends, every stage receives from the previous and
     * forwards to the next (the PP stage boundary) */
    if (me == 0) {
        fill_bytes(buf, B, seed, 0, 0);
        OK(c, td_comm_send(c, buf, B, 1, NULL));
    } else {
        memset(buf, 0, B);
        OK(c, td_comm_recv(c, buf, B, me - 1, NULL));
        CHECK(c, bytes_are(buf, B, seed, 0, 0));
        if (me + 1 < n) OK(c, td_comm_send(c, buf, B, me + 1, NULL));
    }
    /* a ring, even ranks sending first */
    int next = (me + 1) % n, prev = (me + n - 1) % n;
    uint8_t *in = malloc(B + 16);
    CHECK(c, in);
    fill_bytes(buf, B, seed + 1, me, 0);
    if (me % 2 == 0) OK(c, td_comm_send(c, buf, B, next, NULL));
    OK(c, td_comm_recv(c, in, B, prev, NULL));
    if (me % 2 == 1) OK(c, td_comm_send(c, buf, B, next, NULL));
    CHECK(c, bytes_are(in, B, seed + 1, prev, 0));
    /* a size mismatch fails on both sides and leaves the channel usable */
    if (me == 0) CHECK(c, td_comm_send(c, buf, 10, 1, NULL) == TD_ERR_INVALID);
    if (me == 1) CHECK(c, td_comm_recv(c, in, 12, 0, NULL) == TD_ERR_INVALID);
    if (me == 0) OK(c, td_comm_send(c, buf, 3, 1, NULL));
    if (me == 1) {
        OK(c, td_comm_recv(c, in, 3, 0, NULL));
        CHECK(c, bytes_are(in, 3, seed + 1, 0, 0));
    }
    free(in);
    free(buf);
    return 0;
}

/* The two-rank examples of the collective table, literally. */
static int check_literal(td_comm *c) {
    int me = td_comm_rank(c);
    float mine[2] = {me ? 3.0f : 1.0f, me ? 4.0f : 2.0f}, out[4] = {0};
    OK(c, td_comm_all_gather(c, mine, out, sizeof mine, NULL));
    CHECK(c, out[0] == 1 && out[1] == 2 && out[2] == 3 && out[3] == 4);
    float ar[2] = {mine[0], mine[1]};
    OK(c, td_comm_all_reduce(c, ar, 2, TD_COMM_F32, TD_COMM_SUM, NULL));
    CHECK(c, ar[0] == 4 && ar[1] == 6);
    float rs = 0;
    OK(c, td_comm_reduce_scatter(c, mine, &rs, 1, TD_COMM_F32, TD_COMM_SUM, NULL));
    CHECK(c, rs == (me ? 6.0f : 4.0f));
    float a2a[2] = {0};
    OK(c, td_comm_all_to_all(c, mine, a2a, sizeof(float), NULL));
    CHECK(c, me ? (a2a[0] == 2 && a2a[1] == 4) : (a2a[0] == 1 && a2a[1] == 3));
    return 0;
}

static int conform(td_comm *c, uint32_t seed, int depth);

/* 4 ranks -> 2 (TP, innermost) x 2 (PP); other sizes: even/odd halves;
 * reversed keys; a negative color. */
static int check_split(td_comm *c, uint32_t seed) {
    int me = td_comm_rank(c), n = td_comm_size(c);
    td_comm *tp = NULL, *pp = NULL, *rev = NULL, *none = (td_comm *)&none;
    int tp_size = n == 4 ? 2 : 1;
    OK(c, td_comm_split(c, me / tp_size, me, &tp));
    OK(c, td_comm_split(c, me % tp_size, me, &pp));
    CHECK(c, tp && pp);
    CHECK(c, td_comm_size(tp) == tp_size && td_comm_rank(tp) == me % tp_size);
    CHECK(c, td_comm_size(pp) == n / tp_size && td_comm_rank(pp) == me / tp_size);
    /* both TP groups (or all singletons) run the whole suite at once */
    if (conform(tp, seed + 100, 1)) return 1;
    if (conform(pp, seed + 200, 1)) return 1;
    /* even/odd halves: uneven sizes when n is odd */
    td_comm *half = NULL;
    OK(c, td_comm_split(c, me % 2, 0, &half));
    CHECK(c, td_comm_size(half) == (n - me % 2 + 1) / 2 && td_comm_rank(half) == me / 2);
    float v = (float)(me + 1);
    OK(c, td_comm_all_reduce(half, &v, 1, TD_COMM_F32, TD_COMM_SUM, NULL));
    float w = 0;
    for (int k = me % 2; k < n; k += 2) w += (float)(k + 1);
    CHECK(c, v == w);
    /* keys reverse the order */
    OK(c, td_comm_split(c, 7, -me, &rev));
    CHECK(c, td_comm_rank(rev) == n - 1 - me);
    int got[TD_COMM_MAX_RANKS];
    OK(c, td_comm_all_gather(rev, &me, got, sizeof me, NULL));
    for (int k = 0; k < n; k++) CHECK(c, got[k] == n - 1 - k);
    /* a negative color: no communicator, the others still split */
    OK(c, td_comm_split(c, me == 0 ? -1 : 3, 0, &none));
    CHECK(c, me == 0 ? none == NULL : none != NULL && td_comm_size(none) == n - 1);
    if (none) OK(c, td_comm_barrier(none));
    td_comm_destroy(none);
    td_comm_destroy(rev);
    td_comm_destroy(half);
    /* the parent outlives nothing: destroy the parent's children in any order */
    td_comm_destroy(pp);
    td_comm_destroy(tp);
    return 0;
}

static int conform(td_comm *c, uint32_t seed, int depth) {
    int n = td_comm_size(c);
    OK(c, td_comm_barrier(c));
    static const size_t byte_sizes[] = {0, 1, 3, 4099};
    static const size_t float_sizes[] = {0, 1, 2, 7, 1001};
    for (size_t i = 0; i < TD_ARRAY_SIZE(byte_sizes); i++)
        if (check_bytes_ops(c, seed + (uint32_t)i * 1000, byte_sizes[i], true)) return 1;
    for (size_t i = 0; i < TD_ARRAY_SIZE(float_sizes); i++)
        if (check_float_ops(c, seed + 50 + (uint32_t)i * 1000, float_sizes[i], true)) return 1;
    if (check_all_to_all_v(c, seed + 60, 1)) return 1;
    if (check_all_to_all_v(c, seed + 61, 40000)) return 1;
    if (check_p2p(c, seed + 70, 5)) return 1;
    if (check_dtypes(c, seed + 75, depth == 0)) return 1;
    if (depth == 0) { /* several MiB: many chunks of the 64 KiB staging buffers */
        if (check_bytes_ops(c, seed + 80, BIG_BYTES, false)) return 1;
        if (check_float_ops(c, seed + 90, BIG_FLOATS, false)) return 1;
        if (check_p2p(c, seed + 95, BIG_BYTES)) return 1;
    }
    if (n == 2 && check_literal(c)) return 1;
    /* ranks that disagree on a collective are all told, and may go on */
    float x[3] = {1, 2, 3};
    CHECK(c, td_comm_all_reduce(c, x, td_comm_rank(c) == n - 1 && n > 1 ? 2 : 3, TD_COMM_F32,
                                TD_COMM_SUM, NULL) == (n > 1 ? TD_ERR_INVALID : TD_OK));
    CHECK(c, td_comm_broadcast(c, x, 4, n, NULL) == TD_ERR_INVALID); /* root out of range: local */
    if (depth == 0 && check_split(c, seed + 300)) return 1;
    OK(c, td_comm_barrier(c));
    return 0;
}

static td_comm_params test_params(double timeout_s) {
    td_comm_params p = td_comm_default_params();
    p.chunk_bytes = CHUNK;
    p.timeout_s = timeout_s;
    return p;
}

/* ---- backends ---- */

static void test_single(void **state) {
    (void)state;
    td_comm *c = NULL;
    assert_int_equal(td_comm_create_single(&c), TD_OK);
    assert_int_equal(td_comm_size(c), 1);
    assert_int_equal(conform(c, 1, 0), 0);
    td_comm_destroy(c);
}

typedef struct {
    td_comm_group *g;
    int rank;
    int skip; /* the dead-rank test: this rank never calls */
    int result;
    double elapsed;
} local_job;

static void *local_main(void *arg) {
    local_job *j = arg;
    td_comm *c = NULL;
    if (td_comm_create_local(j->g, j->rank, &c) != TD_OK) {
        j->result = 1;
        return NULL;
    }
    j->result = conform(c, 7, 0);
    td_comm_destroy(c);
    return NULL;
}

static void run_local(int n) {
    td_comm_params p = test_params(20);
    td_comm_group *g = NULL;
    assert_int_equal(td_comm_group_create_params(n, &p, &g), TD_OK);
    local_job jobs[4];
    pthread_t th[4];
    for (int r = 0; r < n; r++) {
        jobs[r] = (local_job){.g = g, .rank = r};
        assert_int_equal(pthread_create(&th[r], NULL, local_main, &jobs[r]), 0);
    }
    for (int r = 0; r < n; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < n; r++) assert_int_equal(jobs[r].result, 0);
    td_comm_group_destroy(g);
}

static void test_local_1(void **state) {
    (void)state;
    run_local(1);
}
static void test_local_2(void **state) {
    (void)state;
    run_local(2);
}
static void test_local_3(void **state) {
    (void)state;
    run_local(3);
}
static void test_local_4(void **state) {
    (void)state;
    run_local(4);
}

static void shm_name(char *out, size_t cap, const char *what, int n) {
    static int counter;
    snprintf(out, cap, "/td-test-comm-%d-%s-%d-%d", (int)getpid(), what, n, counter++);
}

/* Forks n rank processes running body(rank); returns their exit codes in
 * codes[] (-1: killed after the overall limit). */
typedef int (*rank_body)(const char *name, int n, int rank);

static void fork_ranks(const char *name, int n, rank_body body, double limit_s, int *codes) {
    pid_t pid[4];
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < n; r++) {
        pid[r] = fork();
        assert_true(pid[r] >= 0);
        if (pid[r] == 0) _exit(body(name, n, r));
    }
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int left = n;
    for (int r = 0; r < n; r++) codes[r] = -1;
    while (left > 0) {
        for (int r = 0; r < n; r++) {
            int wst;
            if (pid[r] > 0 && waitpid(pid[r], &wst, WNOHANG) == pid[r]) {
                codes[r] = WIFEXITED(wst) ? WEXITSTATUS(wst) : 128 + WTERMSIG(wst);
                pid[r] = 0;
                left--;
            }
        }
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        if ((double)(t.tv_sec - t0.tv_sec) + 1e-9 * (double)(t.tv_nsec - t0.tv_nsec) > limit_s) {
            for (int r = 0; r < n; r++)
                if (pid[r] > 0) {
                    kill(pid[r], SIGKILL);
                    waitpid(pid[r], NULL, 0);
                }
            break;
        }
        usleep(2000);
    }
    /* the name is gone once the ranks have attached (or given up) */
    errno = 0;
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd >= 0) close(fd);
    assert_int_equal(errno, ENOENT);
}

static int shm_conform_body(const char *name, int n, int rank) {
    td_comm_params p = test_params(20);
    td_comm *c = NULL;
    if (td_comm_shm_create(name, n, rank, &p, &c) != TD_OK) return 2;
    if (td_comm_rank(c) != rank || td_comm_size(c) != n) return 3;
    int rc = conform(c, 7, 0);
    td_comm_destroy(c);
    return rc;
}

static void run_shm(int n) {
    char name[128];
    shm_name(name, sizeof name, "conform", n);
    int codes[4];
    fork_ranks(name, n, shm_conform_body, 120, codes);
    for (int r = 0; r < n; r++) assert_int_equal(codes[r], 0);
}

static void test_shm_1(void **state) {
    (void)state;
    run_shm(1);
}
static void test_shm_2(void **state) {
    (void)state;
    run_shm(2);
}
static void test_shm_3(void **state) {
    (void)state;
    run_shm(3);
}
static void test_shm_4(void **state) {
    (void)state;
    run_shm(4);
}

/* ---- dead ranks ---- */

#define DEAD_TIMEOUT_S 0.5
#define DEAD_MARGIN_S  2.0 /* scheduling slack on a loaded 2-core CI machine, ASan included */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* All attach; then rank 2 exits. Rank 0 waits in an all-reduce, rank 1 in
 * a receive from rank 2: each gets TD_ERR_IO within the deadline, and a
 * later call fails at once. */
static int dead_mid_body(const char *name, int n, int rank) {
    td_comm_params p = test_params(DEAD_TIMEOUT_S);
    td_comm *c = NULL;
    if (td_comm_shm_create(name, n, rank, &p, &c) != TD_OK) return 2;
    if (td_comm_barrier(c) != TD_OK) return 3;
    if (rank == 2) _exit(0);
    double t0 = now_s();
    float x[4] = {0};
    td_status st = rank == 0 ? td_comm_all_reduce(c, x, 4, TD_COMM_F32, TD_COMM_SUM, NULL)
                             : td_comm_recv(c, x, 16, 2, NULL);
    double el = now_s() - t0;
    if (st != TD_ERR_IO) return 4;
    if (el > DEAD_TIMEOUT_S + DEAD_MARGIN_S) return 5;
    t0 = now_s();
    if (td_comm_barrier(c) != TD_ERR_IO || now_s() - t0 > 1.0) return 6; /* at once */
    td_comm_destroy(c);
    return 0;
}

static void test_shm_dead_rank(void **state) {
    (void)state;
    char name[128];
    shm_name(name, sizeof name, "dead", 3);
    int codes[3];
    double t0 = now_s();
    fork_ranks(name, 3, dead_mid_body, 30, codes);
    for (int r = 0; r < 3; r++) assert_int_equal(codes[r], 0);
    assert_true(now_s() - t0 < DEAD_TIMEOUT_S + DEAD_MARGIN_S + 2.0);
}

/* Rank 2 exits before attaching: the others' create fails in time. */
static int dead_attach_body(const char *name, int n, int rank) {
    if (rank == 2) return 0;
    td_comm_params p = test_params(DEAD_TIMEOUT_S);
    td_comm *c = NULL;
    double t0 = now_s();
    td_status st = td_comm_shm_create(name, n, rank, &p, &c);
    if (st != TD_ERR_IO || c) return 4;
    return now_s() - t0 > DEAD_TIMEOUT_S + DEAD_MARGIN_S ? 5 : 0;
}

static void test_shm_dead_before_attach(void **state) {
    (void)state;
    char name[128];
    shm_name(name, sizeof name, "noattach", 3);
    int codes[3];
    fork_ranks(name, 3, dead_attach_body, 30, codes);
    for (int r = 0; r < 3; r++) assert_int_equal(codes[r], 0);
}

static void *local_dead_main(void *arg) {
    local_job *j = arg;
    td_comm *c = NULL;
    j->result = 1;
    if (td_comm_create_local(j->g, j->rank, &c) != TD_OK) return NULL;
    if (!j->skip) {
        double t0 = now_s();
        float x[2] = {1, 2};
        td_status st = td_comm_all_reduce(c, x, 2, TD_COMM_F32, TD_COMM_SUM, NULL);
        j->elapsed = now_s() - t0;
        j->result = st == TD_ERR_IO && td_comm_barrier(c) == TD_ERR_IO ? 0 : 1;
    } else {
        j->result = 0;
    }
    td_comm_destroy(c);
    return NULL;
}

static void test_local_dead_rank(void **state) {
    (void)state;
    td_comm_params p = test_params(DEAD_TIMEOUT_S);
    td_comm_group *g = NULL;
    assert_int_equal(td_comm_group_create_params(3, &p, &g), TD_OK);
    local_job jobs[3];
    pthread_t th[3];
    for (int r = 0; r < 3; r++) {
        jobs[r] = (local_job){.g = g, .rank = r, .skip = r == 1};
        assert_int_equal(pthread_create(&th[r], NULL, local_dead_main, &jobs[r]), 0);
    }
    for (int r = 0; r < 3; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < 3; r++) {
        assert_int_equal(jobs[r].result, 0);
        assert_true(jobs[r].elapsed <= DEAD_TIMEOUT_S + DEAD_MARGIN_S);
    }
    td_comm_group_destroy(g);
}

static void test_bad_args(void **state) {
    (void)state;
    td_comm *c = (td_comm *)&c;
    td_comm_params p = td_comm_default_params();
    assert_int_equal(td_comm_shm_create("/a/b", 2, 0, &p, &c), TD_ERR_INVALID);
    assert_int_equal(td_comm_shm_create("", 2, 0, &p, &c), TD_ERR_INVALID);
    assert_int_equal(td_comm_shm_create("x", 0, 0, &p, &c), TD_ERR_INVALID);
    assert_int_equal(td_comm_shm_create("x", 2, 2, &p, &c), TD_ERR_INVALID);
    assert_int_equal(td_comm_shm_create("x", TD_COMM_MAX_RANKS + 1, 0, &p, &c), TD_ERR_INVALID);
    p.timeout_s = 0;
    assert_int_equal(td_comm_shm_create("x", 1, 0, &p, &c), TD_ERR_INVALID);
    assert_ptr_equal(c, (td_comm *)&c); /* outputs untouched on failure */
    td_comm_group *g = NULL;
    assert_int_equal(td_comm_group_create(0, &g), TD_ERR_INVALID);
    assert_int_equal(td_comm_group_create(TD_COMM_MAX_RANKS + 1, &g), TD_ERR_INVALID);
    assert_null(g);
    assert_int_equal(td_comm_create_single(&c), TD_OK);
    float x = 1;
    assert_int_equal(td_comm_all_reduce(c, &x, 1, TD_COMM_F32, (td_comm_op)7, NULL),
                     TD_ERR_INVALID);
    assert_int_equal(td_comm_reduce(c, &x, &x, 1, TD_COMM_F32, TD_COMM_SUM, 1, NULL),
                     TD_ERR_INVALID);
    assert_int_equal(td_comm_recv(c, &x, 4, 0, NULL), TD_ERR_INVALID);
    td_comm_destroy(c);
    td_comm_destroy(NULL);
    td_comm_group_destroy(NULL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_args),
        cmocka_unit_test(test_single),
        cmocka_unit_test(test_local_1),
        cmocka_unit_test(test_local_2),
        cmocka_unit_test(test_local_3),
        cmocka_unit_test(test_local_4),
        cmocka_unit_test(test_shm_1),
        cmocka_unit_test(test_shm_2),
        cmocka_unit_test(test_shm_3),
        cmocka_unit_test(test_shm_4),
        cmocka_unit_test(test_local_dead_rank),
        cmocka_unit_test(test_shm_dead_rank),
        cmocka_unit_test(test_shm_dead_before_attach),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
