/* Thread pool: every ith runs exactly once per run, the caller is thread 0,
 * many back-to-back runs (spinning and sleeping workers), and data written
 * by workers is visible to the caller when run() returns. Shared runs:
 * every item claimed from the counter is done exactly once whichever
 * threads join, no thread calls fn after its run has returned, and on one
 * core (where the workers are mostly descheduled) runs end without them.
 * Detached runs: every item lands exactly once, by the caller or by the
 * worker that won its commit; a worker stalled inside an item (as one
 * pushed off its core) has the item taken back, the run returns without
 * it, and its late result never lands; quiesce waits the late worker out. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/base/threadpool.h"

enum { MAXT = 8 };

typedef struct {
    _Atomic int calls[MAXT];
    _Atomic int bad_nth;
    int nth_expected;
    pthread_t caller;
    _Atomic int caller_not_thread0;
} count_ctx;

static void count_task(void *p, int ith, int nth) {
    count_ctx *c = p;
    if (nth != c->nth_expected || ith < 0 || ith >= nth) {
        atomic_fetch_add(&c->bad_nth, 1);
        return;
    }
    atomic_fetch_add(&c->calls[ith], 1);
    if ((ith == 0) != (pthread_equal(pthread_self(), c->caller) != 0))
        atomic_fetch_add(&c->caller_not_thread0, 1);
}

static void test_each_ith_once(void **state) {
    (void)state;
    for (int n = 1; n <= 4; n++) {
        td_threadpool *tp = NULL;
        assert_int_equal(td_threadpool_create(n, &tp), TD_OK);
        assert_int_equal(td_threadpool_size(tp), n);
        count_ctx c;
        memset(&c, 0, sizeof(c));
        c.nth_expected = n;
        c.caller = pthread_self();
        for (int run = 0; run < 500; run++) {
            td_threadpool_run(tp, count_task, &c);
            /* after each run, each ith has been called run + 1 times */
            for (int i = 0; i < n; i++) assert_int_equal(atomic_load(&c.calls[i]), run + 1);
        }
        assert_int_equal(atomic_load(&c.bad_nth), 0);
        assert_int_equal(atomic_load(&c.caller_not_thread0), 0);
        td_threadpool_destroy(tp);
    }
}

/* Runs separated by pauses long enough for the workers to go to sleep on
 * the futex: they must wake up for every run. */
static void test_wake_after_sleep(void **state) {
    (void)state;
    td_threadpool *tp = NULL;
    assert_int_equal(td_threadpool_create(3, &tp), TD_OK);
    count_ctx c;
    memset(&c, 0, sizeof(c));
    c.nth_expected = 3;
    c.caller = pthread_self();
    for (int run = 0; run < 20; run++) {
        struct timespec ts = {0, 3 * 1000 * 1000};
        nanosleep(&ts, NULL);
        td_threadpool_run(tp, count_task, &c);
        for (int i = 0; i < 3; i++) assert_int_equal(atomic_load(&c.calls[i]), run + 1);
    }
    td_threadpool_destroy(tp);
}

/* Data-parallel work: each thread fills its share of an array from the
 * previous run's output (plain, non-atomic memory), so a missing barrier
 * or a lost run shows up as wrong values. */
typedef struct {
    int64_t *a, *b;
    int64_t n;
} vec_ctx;

static void vec_task(void *p, int ith, int nth) {
    vec_ctx *v = p;
    int64_t lo, hi;
    td_split_range(v->n, ith, nth, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) {
        /* reads elements written by other threads in the previous run */
        int64_t j = (i * 7 + 3) % v->n;
        v->b[i] = v->a[j] + i;
    }
}

static void test_data_visibility(void **state) {
    (void)state;
    enum { N = 10007, RUNS = 300 };
    td_threadpool *tp = NULL;
    assert_int_equal(td_threadpool_create(4, &tp), TD_OK);
    static int64_t a[N], b[N], ra[N], rb[N];
    for (int i = 0; i < N; i++) a[i] = ra[i] = i * 31;
    vec_ctx v = {a, b, N};
    for (int run = 0; run < RUNS; run++) {
        td_threadpool_run(tp, vec_task, &v);
        for (int64_t i = 0; i < N; i++) rb[i] = ra[(i * 7 + 3) % N] + i; /* serial reference */
        assert_memory_equal(v.b, rb, sizeof(rb));
        memcpy(ra, rb, sizeof(ra));
        int64_t *t = v.a;
        v.a = v.b;
        v.b = t;
    }
    td_threadpool_destroy(tp);
}

static void test_split_range(void **state) {
    (void)state;
    for (int64_t n = 0; n < 50; n++) {
        for (int nth = 1; nth <= 7; nth++) {
            int64_t next = 0;
            for (int i = 0; i < nth; i++) {
                int64_t b, e;
                td_split_range(n, i, nth, &b, &e);
                assert_int_equal(b, next);
                assert_true(e >= b && e - b <= n / nth + 1 && e - b >= n / nth);
                next = e;
            }
            assert_int_equal(next, n);
        }
    }
}

static void test_default_size(void **state) {
    (void)state;
    td_threadpool *tp = NULL;
    assert_int_equal(td_threadpool_create(0, &tp), TD_OK);
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    assert_int_equal(td_threadpool_size(tp), cores > 0 ? cores : 1);
    count_ctx c;
    memset(&c, 0, sizeof(c));
    c.nth_expected = td_threadpool_size(tp);
    c.caller = pthread_self();
    td_threadpool_run(tp, count_task, &c);
    for (int i = 0; i < c.nth_expected && i < MAXT; i++)
        assert_int_equal(atomic_load(&c.calls[i]), 1);
    td_threadpool_destroy(tp);
    td_threadpool_destroy(NULL);
}

/* A shared run's work: n items claimed one at a time from a counter. */
typedef struct {
    _Atomic int64_t next;
    int64_t n;
    _Atomic int *done;       /* (n) times each item was done */
    _Atomic int closed;      /* set by the test once the run has returned */
    _Atomic int after_close; /* fn calls that saw closed */
    _Atomic int joined[MAXT];
    int nth;
} shared_ctx;

static void shared_task(void *p, int ith, int nth) {
    shared_ctx *s = p;
    if (atomic_load(&s->closed)) {
        atomic_fetch_add(&s->after_close, 1);
        return;
    }
    if (nth != s->nth || ith < 0 || ith >= MAXT) return;
    atomic_fetch_add(&s->joined[ith], 1);
    int64_t i;
    while ((i = atomic_fetch_add(&s->next, 1)) < s->n) atomic_fetch_add(&s->done[i], 1);
}

/* Many shared runs with 4 threads, on every core and then pinned to one
 * core, each with a context of its own that is closed as soon as its run
 * returns (and kept): every item done exactly once each run, the caller
 * joins every run, no late worker ever calls into a run that has returned
 * (every 8 runs the caller pauses 200 us, time for a late worker to try),
 * and on one core some runs end with workers that never joined. */
static void test_shared_runs(void **state) {
    (void)state;
    enum { N = 64, RUNS = 2000 };
    cpu_set_t all, one;
    assert_int_equal(sched_getaffinity(0, sizeof all, &all), 0);
    static shared_ctx ctxs[RUNS];
    static _Atomic int done[RUNS][N];
    for (int pinned = 0; pinned < 2; pinned++) {
        if (pinned) {
            CPU_ZERO(&one);
            for (int c = 0; c < CPU_SETSIZE; c++)
                if (CPU_ISSET(c, &all)) {
                    CPU_SET(c, &one);
                    break;
                }
            assert_int_equal(sched_setaffinity(0, sizeof one, &one), 0);
        }
        /* created after pinning: the workers inherit the caller's mask */
        td_threadpool *tp = NULL;
        assert_int_equal(td_threadpool_create(4, &tp), TD_OK);
        memset(ctxs, 0, sizeof ctxs);
        memset(done, 0, sizeof done);
        int partial = 0;
        for (int run = 0; run < RUNS; run++) {
            shared_ctx *s = &ctxs[run];
            s->n = N;
            s->done = done[run];
            s->nth = 4;
            td_threadpool_run_shared(tp, shared_task, s);
            atomic_store(&s->closed, 1);
            for (int i = 0; i < N; i++) assert_int_equal(atomic_load(&done[run][i]), 1);
            assert_int_equal(atomic_load(&s->joined[0]), 1);
            int joined = 0;
            for (int t = 1; t < 4; t++) joined += atomic_load(&s->joined[t]);
            assert_true(joined <= 3);
            partial += joined < 3;
            if (run % 8 == 7) {
                struct timespec ts = {0, 200 * 1000};
                nanosleep(&ts, NULL);
            }
        }
        /* plain runs after shared ones still call every ith */
        count_ctx c;
        memset(&c, 0, sizeof(c));
        c.nth_expected = 4;
        c.caller = pthread_self();
        td_threadpool_run(tp, count_task, &c);
        for (int i = 0; i < 4; i++) assert_int_equal(atomic_load(&c.calls[i]), 1);
        td_threadpool_destroy(tp);
        for (int run = 0; run < RUNS; run++) {
            assert_int_equal(atomic_load(&ctxs[run].after_close), 0);
            for (int i = 0; i < N; i++) assert_int_equal(atomic_load(&done[run][i]), 1);
        }
        if (pinned) assert_true(partial > 0);
    }
    assert_int_equal(sched_setaffinity(0, sizeof all, &all), 0);
}

/* A detached run's items: item i of run r is the value r * 1000 + i,
 * written by the caller in place or by a worker through the commit. In
 * every stall-th run the caller waits (up to 1 s) for a worker to claim an
 * item before it claims any, and workers stall 3 ms inside their first. */
enum { DN = 48, DRUNS = 600 };
typedef struct {
    td_items *it;
    uint64_t epoch;
    int run, stall;
    int64_t *val;         /* (DN) the run's results */
    _Atomic int *writes;  /* (DN) results landed per item */
    _Atomic int *inside;  /* threads inside fn */
    _Atomic int *redone;  /* items the caller took back, all runs */
    _Atomic int *claimed; /* items workers claimed, this run */
} det_ctx;

static bool stall_run(const det_ctx *d) { return d->stall && d->run % d->stall == 0; }

static void det_write(const det_ctx *d, int64_t i, int64_t v) {
    d->val[i] = v;
    atomic_fetch_add(&d->writes[i], 1);
}

static void det_redo(void *p, int64_t i) {
    det_ctx *d = p;
    det_write(d, i, d->run * 1000 + i);
    atomic_fetch_add(d->redone, 1);
}

static void det_task(void *p, int ith, int nth) {
    (void)nth;
    const det_ctx *d = p;
    atomic_fetch_add(d->inside, 1);
    int64_t i;
    bool first = true;
    if (ith == 0 && stall_run(d))
        for (int w = 0; w < 100000 && !atomic_load(d->claimed); w++) {
            struct timespec ts = {0, 10 * 1000};
            nanosleep(&ts, NULL);
        }
    while (td_items_claim(d->it, d->epoch, DN, &i)) {
        int64_t v = d->run * 1000 + i;
        if (ith == 0) {
            det_write(d, i, v);
            td_items_done(d->it, d->epoch, i);
            continue;
        }
        atomic_fetch_add(d->claimed, 1);
        if (first && stall_run(d)) {
            struct timespec ts = {0, 3 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        first = false;
        if (td_items_commit_begin(d->it, d->epoch, i)) {
            det_write(d, i, v);
            td_items_commit_end(d->it, d->epoch, i);
        }
    }
    if (ith == 0) td_items_finish(d->it, d->epoch, DN, 200 * 1000, det_redo, (void *)d);
    atomic_fetch_sub(d->inside, 1);
}

static void test_detached_runs(void **state) {
    (void)state;
    static int64_t val[DRUNS][DN];
    static _Atomic int writes[DRUNS][DN];
    _Atomic int inside = 0, redone = 0, claimed = 0;
    for (int stall = 0; stall <= 8; stall += 8) {
        td_threadpool *tp = NULL;
        assert_int_equal(td_threadpool_create(4, &tp), TD_OK);
        td_items it = {0};
        memset(val, 0, sizeof val);
        memset(writes, 0, sizeof writes);
        atomic_store(&redone, 0);
        for (int run = 0; run < DRUNS; run++) {
            det_ctx d = {.it = &it,
                         .run = run,
                         .stall = stall,
                         .val = val[run],
                         .writes = writes[run],
                         .inside = &inside,
                         .redone = &redone,
                         .claimed = &claimed};
            atomic_store(&claimed, 0);
            assert_int_equal(td_items_begin(&it, tp, DN, &d.epoch), TD_OK);
            td_threadpool_run_detached(tp, det_task, &d, sizeof d);
            memset(&d, 0xff, sizeof d); /* workers run on their own copies */
            for (int i = 0; i < DN; i++) {
                assert_int_equal(val[run][i], run * 1000 + i);
                assert_int_equal(atomic_load(&writes[run][i]), 1);
            }
        }
        td_threadpool_quiesce(tp);
        assert_int_equal(atomic_load(&inside), 0);
        /* late workers' results never landed, quiesced or not */
        for (int run = 0; run < DRUNS; run++)
            for (int i = 0; i < DN; i++) assert_int_equal(atomic_load(&writes[run][i]), 1);
        /* a stalled worker's item was taken back (without stalls a worker
         * the OS preempts inside an item may have one taken too) */
        if (stall) assert_true(atomic_load(&redone) > 0);
        td_threadpool_destroy(tp);
        td_items_free(&it);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_each_ith_once),   cmocka_unit_test(test_wake_after_sleep),
        cmocka_unit_test(test_data_visibility), cmocka_unit_test(test_split_range),
        cmocka_unit_test(test_default_size),    cmocka_unit_test(test_shared_runs),
        cmocka_unit_test(test_detached_runs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
