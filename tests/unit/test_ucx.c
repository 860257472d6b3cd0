/* The UCX channel (common/transfer/ucx.h) between two workers in this
 * process (they talk over UCX's shared-memory or TCP transports exactly as
 * two processes would), and against a real second process that is killed.
 *
 * Puts are checked byte for byte against the source pattern; messages
 * against their copies; counters against the number of events caused.
 * The peer process is this binary started again with the role "peer"
 * (UCX is not fork-safe, so the child execs before touching UCX): it maps
 * a region, writes its worker address, rkey and region over a pipe, then
 * waits to be killed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/transfer/ucx.h"

extern char **environ;

#define REGION ((size_t)16 << 20)

/* ---- a side: one td_ucx with a mapped region and what it received ---- */

typedef struct {
    td_ucx *u;
    uint8_t *buf; /* (REGION,) bytes */
    td_ucx_mem *mem;
    uint8_t *addr, *rkey;
    size_t addr_len, rkey_len;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    int msgs;          /* messages received */
    uint8_t *last_msg; /* copy of the last one */
    size_t last_len;
    int errors; /* on_error calls */
    td_ucx_ep *error_ep;
    bool alloc;
} side;

static void on_msg(void *ctx, const uint8_t *data, size_t len) {
    side *s = ctx;
    pthread_mutex_lock(&s->mu);
    free(s->last_msg);
    s->last_msg = malloc(len ? len : 1);
    assert_non_null(s->last_msg);
    memcpy(s->last_msg, data, len);
    s->last_len = len;
    s->msgs++;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void on_error(void *ctx, td_ucx_ep *ep, td_status why) {
    side *s = ctx;
    pthread_mutex_lock(&s->mu);
    assert_int_equal(why, TD_ERR_IO);
    s->errors++;
    s->error_ep = ep;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* alloc: the region comes from td_ucx_mem_alloc (a UCX shared-memory
 * segment: peers put into it directly), else from calloc + td_ucx_mem_map
 * (peers' puts are emulated by UCX with active messages). */
static void side_init(side *s, const char *name, size_t max_msg, bool alloc) {
    memset(s, 0, sizeof *s);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    td_ucx_params p = {
        .name = name, .on_msg = on_msg, .on_error = on_error, .ctx = s, .max_msg_bytes = max_msg};
    assert_int_equal(td_ucx_create(&p, &s->u), TD_OK);
    if (alloc) {
        assert_int_equal(td_ucx_mem_alloc(s->u, REGION, &s->mem), TD_OK);
        s->buf = td_ucx_mem_base(s->mem);
        assert_non_null(s->buf);
        assert_int_equal((uintptr_t)s->buf % 64, 0);
        memset(s->buf, 0, REGION);
    } else {
        s->buf = calloc(1, REGION);
        assert_non_null(s->buf);
        assert_int_equal(td_ucx_mem_map(s->u, s->buf, REGION, &s->mem), TD_OK);
    }
    s->alloc = alloc;
    assert_int_equal(td_ucx_address(s->u, &s->addr, &s->addr_len), TD_OK);
    assert_int_equal(td_ucx_mem_rkey(s->mem, &s->rkey, &s->rkey_len), TD_OK);
}

static void side_free(side *s) {
    td_ucx_mem_unmap(s->mem);
    td_ucx_destroy(s->u);
    if (!s->alloc) free(s->buf);
    free(s->addr);
    free(s->rkey);
    free(s->last_msg);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
}

/* Waits until *counter (under s->mu) reaches want; false after timeout_s. */
static bool side_wait(side *s, const int *counter, int want, double timeout_s) {
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += (time_t)timeout_s;
    dl.tv_nsec += (long)((timeout_s - (double)(time_t)timeout_s) * 1e9);
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&s->mu);
    while (*counter < want)
        if (pthread_cond_timedwait(&s->cv, &s->mu, &dl) != 0) break;
    bool ok = *counter >= want;
    pthread_mutex_unlock(&s->mu);
    return ok;
}

/* ---- a completion group the test can wait on ---- */

typedef struct {
    td_ucx_ops ops;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int calls;
    td_status status;
} group;

static void group_done(td_ucx_ops *ops, td_status st) {
    group *g = ops->ctx;
    pthread_mutex_lock(&g->mu);
    g->calls++;
    g->status = st;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static void group_init(group *g) {
    memset(g, 0, sizeof *g);
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->status = 12345;
    td_ucx_ops_init(&g->ops, group_done, g);
}

/* Waits for done; returns its status, or 999 on timeout. */
static td_status group_wait(group *g, double timeout_s) {
    double t0 = td_time_s();
    for (;;) {
        pthread_mutex_lock(&g->mu);
        int calls = g->calls;
        td_status st = g->status;
        pthread_mutex_unlock(&g->mu);
        if (calls) return st;
        if (td_time_s() - t0 > timeout_s) return 999;
        usleep(1000);
    }
}

static void group_free(group *g) {
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
}

static void fill(uint8_t *p, size_t n, uint32_t seed) {
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        p[i] = (uint8_t)x;
    }
}

/* ---- a pair: a -> b endpoint and b's region ---- */

typedef struct {
    side a, b;
    td_ucx_ep *ab;
    td_ucx_rkey *rk; /* b's region through ab */
} pair;

static void pair_init(pair *p, size_t b_max_msg, bool b_alloc) {
    side_init(&p->a, "test a", 0, false);
    side_init(&p->b, "test b", b_max_msg, b_alloc);
    assert_int_equal(td_ucx_ep_create(p->a.u, p->b.addr, p->b.addr_len, &p->b, &p->ab), TD_OK);
    assert_ptr_equal(td_ucx_ep_user(p->ab), &p->b);
    assert_false(td_ucx_ep_failed(p->ab));
    assert_int_equal(td_ucx_rkey_create(p->ab, p->b.rkey, p->b.rkey_len,
                                        (uint64_t)(uintptr_t)p->b.buf, REGION, &p->rk),
                     TD_OK);
}

static void pair_free(pair *p) {
    td_ucx_rkey_destroy(p->rk);
    if (p->ab) assert_int_equal(td_ucx_ep_close_wait(p->ab, 5000), TD_OK);
    side_free(&p->a);
    side_free(&p->b);
}

/* a's new endpoint to b's own worker: one put lands. */
static void pair_check_main(side *a, side *b) {
    td_ucx_ep *ep;
    assert_int_equal(td_ucx_ep_create(a->u, b->addr, b->addr_len, NULL, &ep), TD_OK);
    td_ucx_rkey *rk;
    assert_int_equal(
        td_ucx_rkey_create(ep, b->rkey, b->rkey_len, (uint64_t)(uintptr_t)b->buf, REGION, &rk),
        TD_OK);
    group g;
    group_init(&g);
    fill(a->buf, 4096, 77);
    assert_int_equal(td_ucx_put(ep, rk, a->buf, 4096, 0, &g.ops), TD_OK);
    assert_int_equal(td_ucx_flush(ep, &g.ops), TD_OK);
    td_ucx_ops_seal(&g.ops);
    assert_int_equal(group_wait(&g, 20), TD_OK);
    assert_memory_equal(b->buf, a->buf, 4096);
    group_free(&g);
    td_ucx_rkey_destroy(rk);
    assert_int_equal(td_ucx_ep_close_wait(ep, 5000), TD_OK);
}

static const size_t k_sizes[] = {1, 7, 4096, 65536 + 3, (size_t)1 << 20, (size_t)4 << 20};

/* Puts of every size at distinct offsets, flushed; b's bytes must equal a's. */
static void check_puts(pair *p) {
    td_ucx_stats st0;
    td_ucx_stats_get(p->a.u, &st0);
    group g;
    group_init(&g);
    size_t off = 0, total = 0;
    for (size_t i = 0; i < TD_ARRAY_SIZE(k_sizes); i++) {
        off += 4093; /* unaligned, and a gap that must stay untouched */
        fill(p->a.buf + off, k_sizes[i], (uint32_t)i + 1);
        assert_int_equal(td_ucx_put(p->ab, p->rk, p->a.buf + off, k_sizes[i], off, &g.ops), TD_OK);
        off += k_sizes[i];
        total += k_sizes[i];
    }
    assert_true(off <= REGION);
    assert_int_equal(td_ucx_flush(p->ab, &g.ops), TD_OK);
    td_ucx_ops_seal(&g.ops);
    assert_int_equal(group_wait(&g, 20), TD_OK);
    /* b's region: the puts landed, the gaps are still zero */
    assert_memory_equal(p->b.buf, p->a.buf, off);
    off = 0;
    for (size_t i = 0; i < TD_ARRAY_SIZE(k_sizes); i++) {
        for (size_t j = 0; j < 4093; j++) assert_int_equal(p->b.buf[off + j], 0);
        off += 4093 + k_sizes[i];
    }
    td_ucx_stats st;
    td_ucx_stats_get(p->a.u, &st);
    assert_int_equal(st.puts - st0.puts, TD_ARRAY_SIZE(k_sizes));
    assert_int_equal(st.put_bytes - st0.put_bytes, total);
    usleep(20000);
    assert_int_equal(g.calls, 1);
    group_free(&g);
}

static void test_puts(void **state) {
    TD_UNUSED(state);
    for (int alloc = 0; alloc < 2; alloc++) {
        pair p;
        pair_init(&p, 0, alloc);
        char tl[256];
        td_ucx_ep_transports(p.ab, tl, sizeof tl);
        fprintf(stderr, "transports: %s\n", tl);
        assert_true(strlen(tl) > 0);
        check_puts(&p);
        pair_free(&p);
    }
}

static void test_put_range(void **state) {
    TD_UNUSED(state);
    pair p;
    pair_init(&p, 0, true);
    group g;
    group_init(&g);
    td_ucx_stats st0, st;
    td_ucx_stats_get(p.a.u, &st0);
    memset(p.a.buf, 0xab, 64);
    struct {
        uint64_t off;
        size_t len;
    } bad[] = {{REGION, 1},         {REGION - 1, 2}, {REGION + 4096, 0}, {UINT64_MAX, 1},
               {UINT64_MAX - 2, 8}, {1, REGION},     {0, REGION + 1}};
    for (size_t i = 0; i < TD_ARRAY_SIZE(bad); i++)
        assert_int_equal(td_ucx_put(p.ab, p.rk, p.a.buf, bad[i].len, bad[i].off, &g.ops),
                         TD_ERR_RANGE);
    assert_int_equal(atomic_load(&g.ops.pending), 1); /* nothing added to the group */
    td_ucx_stats_get(p.a.u, &st);
    assert_int_equal(st.puts, st0.puts);
    /* the last byte and the whole region are in range */
    assert_int_equal(td_ucx_put(p.ab, p.rk, p.a.buf, 1, REGION - 1, &g.ops), TD_OK);
    assert_int_equal(td_ucx_flush(p.ab, &g.ops), TD_OK);
    td_ucx_ops_seal(&g.ops);
    assert_int_equal(group_wait(&g, 10), TD_OK);
    assert_int_equal(p.b.buf[REGION - 1], 0xab);
    for (size_t i = 0; i < REGION - 1; i++)
        if (p.b.buf[i] != 0) fail_msg("byte %zu written", i);
    group_free(&g);
    pair_free(&p);
}

static void test_messages(void **state) {
    TD_UNUSED(state);
    pair p;
    pair_init(&p, (size_t)2 << 20, false);
    size_t sizes[] = {1, 100, 8192, (size_t)1 << 20};
    uint8_t *msg = malloc((size_t)3 << 20);
    assert_non_null(msg);
    for (size_t i = 0; i < TD_ARRAY_SIZE(sizes); i++) {
        fill(msg, sizes[i], 100 + (uint32_t)i);
        assert_int_equal(td_ucx_send(p.ab, msg, sizes[i]), TD_OK);
        memset(msg, 0, sizes[i]); /* the channel sent its own copy */
        assert_true(side_wait(&p.b, &p.b.msgs, (int)i + 1, 10));
        fill(msg, sizes[i], 100 + (uint32_t)i);
        pthread_mutex_lock(&p.b.mu);
        assert_int_equal(p.b.last_len, sizes[i]);
        assert_memory_equal(p.b.last_msg, msg, sizes[i]);
        pthread_mutex_unlock(&p.b.mu);
    }
    /* over b's 2 MiB limit: dropped and counted, and the channel goes on */
    assert_int_equal(td_ucx_send(p.ab, msg, (size_t)3 << 20), TD_OK);
    td_ucx_stats st;
    double t0 = td_time_s();
    do {
        usleep(1000);
        td_ucx_stats_get(p.b.u, &st);
    } while (st.msgs_dropped == 0 && td_time_s() - t0 < 10);
    assert_int_equal(st.msgs_dropped, 1);
    assert_int_equal(st.msgs_received, TD_ARRAY_SIZE(sizes));
    fill(msg, 33, 7);
    assert_int_equal(td_ucx_send(p.ab, msg, 33), TD_OK);
    assert_true(side_wait(&p.b, &p.b.msgs, (int)TD_ARRAY_SIZE(sizes) + 1, 10));
    assert_int_equal(p.b.last_len, 33);
    assert_memory_equal(p.b.last_msg, msg, 33);
    td_ucx_stats_get(p.a.u, &st);
    assert_int_equal(st.msgs_sent, TD_ARRAY_SIZE(sizes) + 2);
    free(msg);
    pair_free(&p);
}

static void test_malformed(void **state) {
    TD_UNUSED(state);
    pair p;
    pair_init(&p, 0, false);
    uint8_t junk[512];
    td_ucx_ep *ep = (td_ucx_ep *)&junk; /* must stay untouched on failure */
    td_ucx_rkey *rk = (td_ucx_rkey *)&junk;
    for (uint32_t seed = 1; seed <= 20; seed++) {
        size_t n = 1 + seed * 7 % sizeof junk;
        fill(junk, sizeof junk, seed);
        assert_int_equal(td_ucx_ep_create(p.a.u, junk, n, NULL, &ep), TD_ERR_INVALID);
        assert_int_equal(td_ucx_rkey_create(p.ab, junk, n, 0, 4096, &rk), TD_ERR_INVALID);
    }
    assert_ptr_equal(ep, (td_ucx_ep *)&junk);
    assert_ptr_equal(rk, (td_ucx_rkey *)&junk);
    /* truncated, extended and one-bit-flipped copies of real ones */
    uint8_t *copy = malloc(p.b.addr_len + p.b.rkey_len + 1);
    assert_non_null(copy);
    for (size_t cut = 0; cut < p.b.addr_len; cut += 1 + cut / 3)
        assert_int_equal(td_ucx_ep_create(p.a.u, p.b.addr, cut, NULL, &ep), TD_ERR_INVALID);
    for (size_t cut = 0; cut < p.b.rkey_len; cut++)
        assert_int_equal(td_ucx_rkey_create(p.ab, p.b.rkey, cut, 0, 4096, &rk), TD_ERR_INVALID);
    memcpy(copy, p.b.addr, p.b.addr_len);
    copy[p.b.addr_len] = 0;
    assert_int_equal(td_ucx_ep_create(p.a.u, copy, p.b.addr_len + 1, NULL, &ep), TD_ERR_INVALID);
    for (size_t i = 0; i < p.b.addr_len; i += 5) {
        memcpy(copy, p.b.addr, p.b.addr_len);
        copy[i] ^= 0x10;
        assert_int_equal(td_ucx_ep_create(p.a.u, copy, p.b.addr_len, NULL, &ep), TD_ERR_INVALID);
    }
    for (size_t i = 0; i < p.b.rkey_len; i++) {
        memcpy(copy, p.b.rkey, p.b.rkey_len);
        copy[i] ^= 0x01;
        assert_int_equal(td_ucx_rkey_create(p.ab, copy, p.b.rkey_len, 0, 4096, &rk),
                         TD_ERR_INVALID);
    }
    assert_int_equal(td_ucx_ep_create(p.a.u, NULL, 0, NULL, &ep), TD_ERR_INVALID);
    assert_int_equal(td_ucx_rkey_create(p.ab, NULL, 0, 0, 4096, &rk), TD_ERR_INVALID);
    /* a good rkey with an empty or wrapping region */
    assert_int_equal(td_ucx_rkey_create(p.ab, p.b.rkey, p.b.rkey_len, 4096, 0, &rk),
                     TD_ERR_INVALID);
    assert_int_equal(td_ucx_rkey_create(p.ab, p.b.rkey, p.b.rkey_len, UINT64_MAX - 10, 100, &rk),
                     TD_ERR_INVALID);
    assert_ptr_equal(ep, (td_ucx_ep *)&junk);
    assert_ptr_equal(rk, (td_ucx_rkey *)&junk);
    free(copy);
    /* the channel still works */
    check_puts(&p);
    pair_free(&p);
}

/* Many large puts, then a forced close before they can all have finished:
 * the group completes exactly once and the close completes. */
static void close_with_puts(void) {
    pair p;
    pair_init(&p, 0, false);
    group g;
    group_init(&g);
    fill(p.a.buf, REGION, 9);
    const size_t chunk = (size_t)1 << 20;
    for (int rep = 0; rep < 4; rep++)
        for (size_t off = 0; off + chunk <= REGION; off += chunk)
            assert_int_equal(td_ucx_put(p.ab, p.rk, p.a.buf + off, chunk, off, &g.ops), TD_OK);
    assert_int_equal(td_ucx_flush(p.ab, &g.ops), TD_OK);
    fprintf(stderr, "operations in flight at the close: %d\n", atomic_load(&g.ops.pending) - 1);
    td_ucx_rkey_destroy(p.rk);
    p.rk = NULL;
    assert_int_equal(td_ucx_ep_close_wait(p.ab, 5000), TD_OK);
    p.ab = NULL;
    td_ucx_ops_seal(&g.ops);
    td_status st = group_wait(&g, 10);
    assert_true(st == TD_OK || st == TD_ERR_IO);
    usleep(50000);
    assert_int_equal(g.calls, 1);
    group_free(&g);
    pair_free(&p);
}

static void test_close_in_flight(void **state) {
    TD_UNUSED(state);
    close_with_puts();
}

/* closed() runs once, and NULL is closed at once */
static void count_closed(void *ctx) { atomic_fetch_add((atomic_int *)ctx, 1); }

static void test_close_callback(void **state) {
    TD_UNUSED(state);
    pair p;
    pair_init(&p, 0, false);
    atomic_int n = 0;
    td_ucx_ep_close(NULL, count_closed, &n);
    assert_int_equal(atomic_load(&n), 1);
    td_ucx_ep *e2;
    assert_int_equal(td_ucx_ep_create(p.a.u, p.b.addr, p.b.addr_len, NULL, &e2), TD_OK);
    td_ucx_ep_close(e2, count_closed, &n);
    double t0 = td_time_s();
    while (atomic_load(&n) < 2 && td_time_s() - t0 < 5) usleep(1000);
    usleep(20000);
    assert_int_equal(atomic_load(&n), 2);
    /* an endpoint the owner leaves open is closed by destroy */
    td_ucx_ep *e3;
    assert_int_equal(td_ucx_ep_create(p.a.u, p.b.addr, p.b.addr_len, NULL, &e3), TD_OK);
    pair_free(&p);
}

/* Process CPU time over half a second while two connected channels idle:
 * busy-polling progress threads would use ~1 s (2 threads); sleeping ones
 * a few ms. */
static void test_idle_sleeps(void **state) {
    TD_UNUSED(state);
    pair p;
    pair_init(&p, 0, false);
    check_puts(&p); /* connected and used */
    usleep(100000);
    struct rusage r0, r1;
    getrusage(RUSAGE_SELF, &r0);
    usleep(500000);
    getrusage(RUSAGE_SELF, &r1);
    double cpu = (double)(r1.ru_utime.tv_sec - r0.ru_utime.tv_sec) +
                 (double)(r1.ru_utime.tv_usec - r0.ru_utime.tv_usec) * 1e-6 +
                 (double)(r1.ru_stime.tv_sec - r0.ru_stime.tv_sec) +
                 (double)(r1.ru_stime.tv_usec - r0.ru_stime.tv_usec) * 1e-6;
    fprintf(stderr, "idle CPU over 0.5 s: %.4f s\n", cpu);
    assert_true(cpu < 0.05);
    pair_free(&p);
}

/* The same puts and a forced close over TCP only. */
static void test_tcp(void **state) {
    TD_UNUSED(state);
    setenv("UCX_TLS", "tcp", 1);
    pair p;
    pair_init(&p, 0, false);
    unsetenv("UCX_TLS");
    char tl[256];
    td_ucx_ep_transports(p.ab, tl, sizeof tl);
    fprintf(stderr, "transports (UCX_TLS=tcp): %s\n", tl);
    assert_non_null(strstr(tl, "tcp"));
    assert_null(strstr(tl, "posix"));
    check_puts(&p);
    pair_free(&p);
    setenv("UCX_TLS", "tcp", 1);
    close_with_puts();
    unsetenv("UCX_TLS");
}

/* ---- link workers: the receiver's fence ---- */

/* A sender thread streaming puts into b's region through a link: rounds
 * of 8 x 1 MiB, each round a new byte pattern, flushed, until told to stop
 * or an operation fails. */
typedef struct {
    side *a;
    td_ucx_ep *ep;
    td_ucx_rkey *rk;
    atomic_bool stop;
    atomic_int rounds;
    td_status last;
} streamer;

static void *stream_main(void *arg) {
    streamer *sm = arg;
    const size_t chunk = (size_t)1 << 20;
    for (uint32_t round = 1; !atomic_load(&sm->stop); round++) {
        group g;
        group_init(&g);
        td_status st = TD_OK;
        for (size_t c = 0; c < 8 && !st; c++) {
            size_t off = ((round * 8 + c) % (REGION / chunk)) * chunk;
            fill(sm->a->buf + off, chunk, round * 8 + (uint32_t)c);
            st = td_ucx_put(sm->ep, sm->rk, sm->a->buf + off, chunk, off, &g.ops);
        }
        if (!st) st = td_ucx_flush(sm->ep, &g.ops);
        td_ucx_ops_seal(&g.ops);
        td_status done = group_wait(&g, 10);
        group_free(&g);
        sm->last = st ? st : done;
        if (sm->last != TD_OK) break; /* the link went: puts fail (or never finish) */
        atomic_fetch_add(&sm->rounds, 1);
    }
    return NULL;
}

/* a streams puts into b's region through b's link worker; b destroys the
 * link in the middle of the stream. fenced: the puts are carried out by
 * b's worker (over TCP), so from the moment td_ucx_link_destroy returns
 * b's region does not change any more, although puts were still being
 * posted and sent. Otherwise (shared memory into a UCX-allocated region: a
 * writes the segment itself) the destroy is only checked to be clean.
 * Either way a control message arrives on the link while it lives, one of
 * more than 64 KiB is dropped there (links take eager messages only), and
 * b's own worker and a new link still work afterwards. (Not tested: shared
 * memory into ordinary registered memory, where UCX emulates the puts with
 * active messages; UCX 1.13 can crash in ucp_worker_destroy purging the
 * replies still queued to the sender. The KV pool is always
 * UCX-allocated.) */
static void link_fence(const char *tls, bool b_alloc, bool fenced) {
    if (tls) setenv("UCX_TLS", tls, 1);
    side a, b;
    side_init(&a, "link a", 0, false);
    side_init(&b, "link b", 0, b_alloc);
    td_ucx_link *l;
    assert_int_equal(td_ucx_link_create(b.u, &l), TD_OK);
    uint8_t *laddr;
    size_t llen;
    assert_int_equal(td_ucx_link_address(l, &laddr, &llen), TD_OK);
    assert_false(llen == b.addr_len && memcmp(laddr, b.addr, llen) == 0);
    td_ucx_ep *ep;
    assert_int_equal(td_ucx_ep_create(a.u, laddr, llen, NULL, &ep), TD_OK);
    td_ucx_rkey *rk;
    assert_int_equal(
        td_ucx_rkey_create(ep, b.rkey, b.rkey_len, (uint64_t)(uintptr_t)b.buf, REGION, &rk), TD_OK);
    /* messages: a small one arrives, a large one is dropped */
    assert_int_equal(td_ucx_send(ep, (const uint8_t *)"hello", 5), TD_OK);
    assert_true(side_wait(&b, &b.msgs, 1, 10));
    uint8_t *big = calloc(1, (size_t)1 << 20);
    assert_non_null(big);
    assert_int_equal(td_ucx_send(ep, big, (size_t)1 << 20), TD_OK);
    free(big);
    td_ucx_stats bs;
    double t0 = td_time_s();
    do {
        usleep(1000);
        td_ucx_stats_get(b.u, &bs);
    } while (bs.msgs_dropped == 0 && td_time_s() - t0 < 10);
    assert_int_equal(bs.msgs_dropped, 1);
    assert_int_equal(b.msgs, 1);
    /* the stream, and the fence in its middle */
    streamer sm = {.a = &a, .ep = ep, .rk = rk};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, stream_main, &sm), 0);
    t0 = td_time_s();
    while (atomic_load(&sm.rounds) < 3 && td_time_s() - t0 < 30) usleep(1000);
    assert_true(atomic_load(&sm.rounds) >= 3);
    td_ucx_link_destroy(l);
    uint8_t *snap = malloc(REGION);
    assert_non_null(snap);
    memcpy(snap, b.buf, REGION);
    int rounds = atomic_load(&sm.rounds);
    usleep(500000);
    int later = atomic_load(&sm.rounds);
    fprintf(stderr, "%s%s: the link went after %d rounds of puts; %d completed afterwards\n",
            tls ? tls : "any", b_alloc ? " (UCX memory)" : "", rounds, later - rounds);
    if (fenced) {
        assert_memory_equal(b.buf, snap, REGION);
        assert_true(later - rounds <= 1); /* the one in flight may report done */
    }
    free(snap);
    atomic_store(&sm.stop, true);
    pthread_join(th, NULL); /* a round that never completes ends at its 10 s wait */
    if (fenced) {
        /* the stream cannot go on through a fenced link: its puts fail, or
         * a round never completes */
        fprintf(stderr, "the stream ended with %s\n",
                sm.last == 999 ? "a round that never completed" : td_status_str(sm.last));
        assert_true(sm.last == TD_ERR_IO || sm.last == 999);
    } else {
        /* shared memory writes b's segment directly: the stream may go on,
         * or fail as a transport error, never otherwise */
        assert_true(sm.last == TD_OK || sm.last == TD_ERR_IO || sm.last == 999);
    }
    td_ucx_rkey_destroy(rk);
    assert_int_equal(td_ucx_ep_close_wait(ep, 5000), TD_OK);
    /* b's own worker is unaffected, and a second link works */
    pair_check_main(&a, &b);
    assert_int_equal(td_ucx_link_create(b.u, &l), TD_OK);
    free(laddr);
    assert_int_equal(td_ucx_link_address(l, &laddr, &llen), TD_OK);
    assert_int_equal(td_ucx_ep_create(a.u, laddr, llen, NULL, &ep), TD_OK);
    int before = b.msgs;
    assert_int_equal(td_ucx_send(ep, (const uint8_t *)"again", 5), TD_OK);
    assert_true(side_wait(&b, &b.msgs, before + 1, 10));
    assert_int_equal(td_ucx_ep_close_wait(ep, 5000), TD_OK);
    free(laddr);
    side_free(&a); /* b's link is left to td_ucx_destroy */
    side_free(&b);
    if (tls) unsetenv("UCX_TLS");
}

static void test_link_fence(void **state) {
    TD_UNUSED(state);
    link_fence("tcp", false, true);
    link_fence("tcp", true, true);
    link_fence(NULL, true, false);
}

/* ---- a real peer process that dies ---- */

static bool write_all(int fd, const void *p, size_t n) {
    const uint8_t *b = p;
    while (n) {
        ssize_t w = write(fd, b, n);
        if (w <= 0) return false;
        b += w;
        n -= (size_t)w;
    }
    return true;
}

static bool read_all(int fd, void *p, size_t n) {
    uint8_t *b = p;
    while (n) {
        ssize_t r = read(fd, b, n);
        if (r <= 0) return false;
        b += r;
        n -= (size_t)r;
    }
    return true;
}

/* The child: argv = [exe, "peer", write fd]. */
static int peer_main(int fd) {
    td_ucx_params prm = {.name = "peer"};
    td_ucx *u;
    if (td_ucx_create(&prm, &u) != TD_OK) return 1;
    td_ucx_mem *m;
    uint8_t *addr, *rkey;
    size_t alen, rlen;
    if (td_ucx_mem_alloc(u, REGION, &m) != TD_OK || td_ucx_address(u, &addr, &alen) != TD_OK ||
        td_ucx_mem_rkey(m, &rkey, &rlen) != TD_OK)
        return 1;
    uint64_t hdr[3] = {alen, rlen, (uint64_t)(uintptr_t)td_ucx_mem_base(m)};
    if (!write_all(fd, hdr, sizeof hdr) || !write_all(fd, addr, alen) || !write_all(fd, rkey, rlen))
        return 1;
    close(fd);
    for (;;) pause(); /* until killed */
}

static const char *g_exe;

/* A peer process (peer_main), started with the environment as it is, and
 * side a (made the same way) connected to it: an endpoint and the peer's
 * region, with one 1 MiB put flushed through them. */
typedef struct {
    pid_t pid;
    side a;
    td_ucx_ep *ep;
    td_ucx_rkey *rk;
} peer_proc;

static void peer_connect(peer_proc *pp) {
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    char fdarg[16];
    snprintf(fdarg, sizeof fdarg, "%d", fds[1]);
    char *argv[] = {(char *)g_exe, "peer", fdarg, NULL};
    assert_int_equal(posix_spawn(&pp->pid, "/proc/self/exe", NULL, NULL, argv, environ), 0);
    close(fds[1]);
    uint64_t hdr[3];
    assert_true(read_all(fds[0], hdr, sizeof hdr));
    assert_true(hdr[0] < 65536 && hdr[1] < 65536);
    uint8_t *addr = malloc(hdr[0]), *rkey = malloc(hdr[1]);
    assert_true(read_all(fds[0], addr, hdr[0]) && read_all(fds[0], rkey, hdr[1]));
    close(fds[0]);
    side_init(&pp->a, "test a", 0, false);
    assert_int_equal(td_ucx_ep_create(pp->a.u, addr, hdr[0], NULL, &pp->ep), TD_OK);
    assert_int_equal(td_ucx_rkey_create(pp->ep, rkey, hdr[1], hdr[2], REGION, &pp->rk), TD_OK);
    free(addr);
    free(rkey);
    char tl[256];
    td_ucx_ep_transports(pp->ep, tl, sizeof tl);
    fprintf(stderr, "transports to the peer process: %s\n", tl);
    group g;
    group_init(&g);
    fill(pp->a.buf, REGION, 3);
    assert_int_equal(td_ucx_put(pp->ep, pp->rk, pp->a.buf, (size_t)1 << 20, 0, &g.ops), TD_OK);
    assert_int_equal(td_ucx_flush(pp->ep, &g.ops), TD_OK);
    td_ucx_ops_seal(&g.ops);
    assert_int_equal(group_wait(&g, 10), TD_OK);
    group_free(&g);
}

static void peer_killed(const char *tls) {
    if (tls) setenv("UCX_TLS", tls, 1);
    /* Over shared memory a dead peer is found by UCX's keepalive (default
     * every 20 s, run while requests are in flight); 1 s keeps this short. */
    setenv("UCX_KEEPALIVE_INTERVAL", "1s", 1);
    peer_proc pp;
    peer_connect(&pp); /* a working transfer first */
    if (tls) unsetenv("UCX_TLS");
    unsetenv("UCX_KEEPALIVE_INTERVAL");
    td_ucx_ep *ep = pp.ep;
    td_ucx_rkey *rk = pp.rk;
    pid_t pid = pp.pid;
    group g;

    assert_int_equal(kill(pid, SIGKILL), 0);
    int wst;
    assert_int_equal(waitpid(pid, &wst, 0), pid);
    /* puts into the dead peer: a group fails, or the error callback fires */
    double t0 = td_time_s();
    bool noticed = false;
    while (!noticed && td_time_s() - t0 < 15) {
        group_init(&g);
        td_status pst = td_ucx_put(ep, rk, pp.a.buf, (size_t)1 << 20, 0, &g.ops);
        td_status fst = td_ucx_flush(ep, &g.ops);
        td_ucx_ops_seal(&g.ops);
        td_status gst = group_wait(&g, 15);
        assert_true(gst != 999); /* the group completes even when the peer is gone */
        noticed = pst == TD_ERR_IO || fst == TD_ERR_IO || gst == TD_ERR_IO;
        group_free(&g);
        if (!noticed) usleep(20000);
    }
    fprintf(stderr, "peer death noticed after %.2f s (on_error calls: %d)\n", td_time_s() - t0,
            pp.a.errors);
    assert_true(noticed);
    /* the error callback has fired (or fires soon) and the endpoint is failed */
    assert_true(side_wait(&pp.a, &pp.a.errors, 1, 15));
    assert_ptr_equal(pp.a.error_ep, ep);
    assert_true(td_ucx_ep_failed(ep));
    group_init(&g);
    assert_int_equal(td_ucx_put(ep, rk, pp.a.buf, 16, 0, &g.ops), TD_ERR_IO);
    assert_int_equal(td_ucx_send(ep, pp.a.buf, 16), TD_ERR_IO);
    td_ucx_ops_seal(&g.ops);
    assert_int_equal(group_wait(&g, 1), TD_OK); /* nothing was added */
    group_free(&g);
    td_ucx_rkey_destroy(rk);
    assert_int_equal(td_ucx_ep_close_wait(ep, 5000), TD_OK);
    td_ucx_stats st;
    td_ucx_stats_get(pp.a.u, &st);
    assert_int_equal(st.ep_errors, 1);
    side_free(&pp.a);
}

/* td_ucx_ep_close_flushed. Live peer: puts in flight when it is called
 * complete without error and all land. Stopped peer process
 * over TCP (as behind a cut link: its socket buffers fill up and the flush
 * cannot end): the close waits for the flush, then forces, and the group
 * completes with an error. */
static void close_flushed_live(const char *tls) {
    if (tls) setenv("UCX_TLS", tls, 1);
    pair p;
    pair_init(&p, 0, true);
    if (tls) unsetenv("UCX_TLS");
    group g;
    group_init(&g);
    fill(p.a.buf, REGION, 21);
    const size_t chunk = (size_t)1 << 20;
    for (size_t off = 0; off + chunk <= REGION; off += chunk)
        assert_int_equal(td_ucx_put(p.ab, p.rk, p.a.buf + off, chunk, off, &g.ops), TD_OK);
    td_ucx_ops_seal(&g.ops);
    td_ucx_rkey_destroy(p.rk);
    p.rk = NULL;
    td_ucx_ep_close_flushed(p.ab, 20000);
    p.ab = NULL;
    assert_int_equal(group_wait(&g, 20), TD_OK);
    /* a put completes once its bytes are handed on (over TCP: to the
     * socket); the close's flush is what carries them all to b, before it
     * closes */
    double t0 = td_time_s();
    while (memcmp(p.b.buf, p.a.buf, REGION) != 0 && td_time_s() - t0 < 20) usleep(1000);
    assert_memory_equal(p.b.buf, p.a.buf, REGION);
    group_free(&g);
    td_ucx_ep_close_flushed(NULL, 0);
    pair_free(&p);
}

static void test_close_flushed(void **state) {
    TD_UNUSED(state);
    close_flushed_live(NULL);
    close_flushed_live("tcp");

    setenv("UCX_TLS", "tcp", 1);
    peer_proc pp;
    peer_connect(&pp);
    unsetenv("UCX_TLS");
    group g;
    assert_int_equal(kill(pp.pid, SIGSTOP), 0);
    group_init(&g);
    const size_t chunk = (size_t)1 << 20;
    for (int rep = 0; rep < 4; rep++)
        for (size_t off = 0; off + chunk <= REGION; off += chunk)
            assert_int_equal(td_ucx_put(pp.ep, pp.rk, pp.a.buf + off, chunk, off, &g.ops), TD_OK);
    td_ucx_ops_seal(&g.ops);
    td_ucx_rkey_destroy(pp.rk);
    double t0 = td_time_s();
    td_ucx_ep_close_flushed(pp.ep, 500);
    td_status st = group_wait(&g, 20);
    double waited = td_time_s() - t0;
    fprintf(stderr, "stopped peer: the puts ended (%s) %.2f s after the flushed close\n",
            td_status_str(st), waited);
    assert_int_equal(st, TD_ERR_IO);
    assert_true(waited >= 0.45); /* it waited for the flush before forcing */
    group_free(&g);
    assert_int_equal(kill(pp.pid, SIGKILL), 0);
    int wst;
    assert_int_equal(waitpid(pp.pid, &wst, 0), pp.pid);
    side_free(&pp.a);
}

static void test_peer_killed(void **state) {
    TD_UNUSED(state);
    peer_killed(NULL);
}

static void test_peer_killed_tcp(void **state) {
    TD_UNUSED(state);
    peer_killed("tcp");
}

static void test_bad_args(void **state) {
    TD_UNUSED(state);
    td_ucx *u = NULL;
    assert_int_equal(td_ucx_create(NULL, &u), TD_ERR_INVALID);
    td_ucx_destroy(NULL);
    td_ucx_mem_unmap(NULL);
    td_ucx_rkey_destroy(NULL);
    assert_null(td_ucx_ep_user(NULL));
    assert_true(td_ucx_ep_failed(NULL));
    assert_int_equal(td_ucx_ep_close_wait(NULL, 10), TD_OK);
    char buf[8] = "x";
    td_ucx_ep_transports(NULL, buf, sizeof buf);
    assert_string_equal(buf, "");
    td_ucx_stats st;
    td_ucx_stats_get(NULL, &st);
    assert_int_equal(st.puts, 0);
    /* the environment of DESIGN.md §4, unless the operator set it; set in
     * main by td_ucx_env_init, never by td_ucx_create */
    setenv("UCX_SYSV_ERROR_HANDLING", "n", 1);
    unsetenv("UCX_POSIX_ERROR_HANDLING");
    td_ucx_params p = {.name = "env"};
    assert_int_equal(td_ucx_create(&p, &u), TD_OK);
    assert_null(getenv("UCX_POSIX_ERROR_HANDLING"));
    td_ucx_destroy(u);
    td_ucx_env_init();
    assert_string_equal(getenv("UCX_POSIX_ERROR_HANDLING"), "y");
    assert_string_equal(getenv("UCX_SYSV_ERROR_HANDLING"), "n");
    setenv("UCX_SYSV_ERROR_HANDLING", "y", 1);
    assert_int_equal(td_ucx_create(&p, &u), TD_OK);
    assert_int_equal(td_ucx_mem_map(u, NULL, 10, &(td_ucx_mem *){NULL}), TD_ERR_INVALID);
    td_ucx_destroy(u);
}

int main(int argc, char **argv) {
    td_ucx_env_init();
    if (argc == 3 && strcmp(argv[1], "peer") == 0) return peer_main(atoi(argv[2]));
    g_exe = argv[0];
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_args),
        cmocka_unit_test(test_puts),
        cmocka_unit_test(test_put_range),
        cmocka_unit_test(test_messages),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_close_in_flight),
        cmocka_unit_test(test_close_callback),
        cmocka_unit_test(test_idle_sleeps),
        cmocka_unit_test(test_tcp),
        cmocka_unit_test(test_link_fence),
        cmocka_unit_test(test_peer_killed),
        cmocka_unit_test(test_peer_killed_tcp),
        cmocka_unit_test(test_close_flushed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
