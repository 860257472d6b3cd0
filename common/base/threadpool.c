/* Persistent worker pool. The caller publishes (fn, ctx) and bumps a
 * generation word; workers spin on it for a short while and then sleep on
 * it with futex(2). Completion is a countdown the caller spins on, with a
 * futex fallback, so an idle pool costs nothing and a busy one dispatches in
 * microseconds. */
#include "threadpool.h"

#include <errno.h>
#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Waiting: spin with pause for a few microseconds (the common case: the
 * other threads are running and finish together), then yield the core for
 * up to about a millisecond (when cores are oversubscribed, the thread we
 * wait for may be the one needing this core), then sleep on the futex. */
#define TD_SPIN_ITERS  2000
#define TD_YIELD_ITERS 200

struct td_threadpool {
    int n;
    pthread_t *threads; /* n - 1 workers */
    td_task_fn fn;
    void *ctx;
    _Atomic uint32_t gen;     /* bumped once per run and at shutdown */
    _Atomic uint32_t pending; /* workers still running the current generation */
    _Atomic int sleepers;     /* workers blocked (or about to block) in futex on gen */
    _Atomic int caller_sleeping;
    _Atomic int stop;
    int started;
};

typedef struct {
    td_threadpool *tp;
    int ith;
} worker_arg;

static void futex_wait(_Atomic uint32_t *addr, uint32_t expected) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *addr, int n) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}

static void *worker_main(void *p) {
    worker_arg *wa = p;
    td_threadpool *tp = wa->tp;
    int ith = wa->ith;
    free(wa);
    uint32_t seen = 0;
    for (;;) {
        uint32_t g;
        int spins = 0;
        while ((g = atomic_load_explicit(&tp->gen, memory_order_acquire)) == seen) {
            if (spins < TD_SPIN_ITERS + TD_YIELD_ITERS) {
                if (spins++ < TD_SPIN_ITERS)
                    _mm_pause();
                else
                    sched_yield();
                continue;
            }
            atomic_fetch_add(&tp->sleepers, 1);
            futex_wait(&tp->gen, seen); /* returns at once if gen already moved */
            atomic_fetch_sub(&tp->sleepers, 1);
        }
        seen = g;
        if (atomic_load_explicit(&tp->stop, memory_order_acquire)) break;
        tp->fn(tp->ctx, ith, tp->n);
        if (atomic_fetch_sub(&tp->pending, 1) == 1 && atomic_load(&tp->caller_sleeping))
            futex_wake(&tp->pending, 1);
    }
    return NULL;
}

td_status td_threadpool_create(int n_threads, td_threadpool **tp_p) {
    if (n_threads <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = c > 0 ? (int)(c < 1024 ? c : 1024) : 1;
    }
    td_threadpool *tp = calloc(1, sizeof(*tp));
    if (!tp) return TD_ERR_NOMEM;
    tp->n = n_threads;
    if (n_threads > 1) {
        tp->threads = calloc((size_t)n_threads - 1, sizeof(pthread_t));
        if (!tp->threads) goto fail_threads;
    }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = malloc(sizeof(*wa));
        if (!wa) goto fail_start;
        wa->tp = tp;
        wa->ith = i;
        int rc = pthread_create(&tp->threads[i - 1], NULL, worker_main, wa);
        if (rc != 0) {
            free(wa);
            TD_LOG_ERROR("pthread_create: %s", strerror(rc));
            goto fail_start;
        }
        tp->started++;
    }
    *tp_p = tp;
    return TD_OK;

fail_start:
    atomic_store(&tp->stop, 1);
    atomic_fetch_add(&tp->gen, 1);
    futex_wake(&tp->gen, INT_MAX);
    for (int i = 0; i < tp->started; i++) pthread_join(tp->threads[i], NULL);
    free(tp->threads);
fail_threads:
    free(tp);
    return TD_ERR_NOMEM;
}

void td_threadpool_destroy(td_threadpool *tp) {
    if (!tp) return;
    atomic_store(&tp->stop, 1);
    atomic_fetch_add(&tp->gen, 1);
    futex_wake(&tp->gen, INT_MAX);
    for (int i = 0; i < tp->started; i++) pthread_join(tp->threads[i], NULL);
    free(tp->threads);
    free(tp);
}

int td_threadpool_size(const td_threadpool *tp) { return tp->n; }

void td_threadpool_run(td_threadpool *tp, td_task_fn fn, void *ctx) {
    if (tp->n == 1) {
        fn(ctx, 0, 1);
        return;
    }
    tp->fn = fn;
    tp->ctx = ctx;
    atomic_store(&tp->pending, (uint32_t)(tp->n - 1));
    atomic_fetch_add(&tp->gen, 1); /* seq_cst: pairs with the sleepers count */
    if (atomic_load(&tp->sleepers) > 0) futex_wake(&tp->gen, INT_MAX);
    fn(ctx, 0, tp->n);
    int spins = 0;
    uint32_t left;
    while ((left = atomic_load_explicit(&tp->pending, memory_order_acquire)) != 0) {
        if (spins < TD_SPIN_ITERS + TD_YIELD_ITERS) {
            if (spins++ < TD_SPIN_ITERS)
                _mm_pause();
            else
                sched_yield();
            continue;
        }
        atomic_store(&tp->caller_sleeping, 1);
        if (atomic_load(&tp->pending) != 0) futex_wait(&tp->pending, left);
        atomic_store(&tp->caller_sleeping, 0);
    }
}
