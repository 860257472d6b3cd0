/* Persistent worker pool. The caller publishes (fn, ctx) and bumps a
 * generation word; workers spin on it for a short while and then sleep on
 * it with futex(2). Completion is a countdown the caller spins on, with a
 * futex fallback, so an idle pool costs nothing and a busy one dispatches in
 * microseconds. The generation's low bit says whether the run is shared
 * (td_threadpool_run_shared), so a worker reads the kind of run from the
 * word that announced it. A shared run admits workers through one more
 * word, its generation with a closed bit and the count of workers joined:
 * a worker joins with a compare-and-swap while it is open for the
 * generation it saw, the caller closes it when its own call returns and
 * then waits for exactly the workers that joined. A worker reads fn and
 * ctx of a shared run only once it has joined (a late one may find the
 * next run's there). */
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
    _Atomic uint32_t gen;     /* changed once per run (low bit: shared) and at shutdown */
    _Atomic uint32_t pending; /* workers still running the current generation */
    _Atomic int sleepers;     /* workers blocked (or about to block) in futex on gen */
    _Atomic int caller_sleeping;
    _Atomic int stop;
    int started;
    /* shared runs */
    _Atomic uint64_t admit;       /* generation << 32 | closed << 31 | workers joined */
    _Atomic uint32_t joined_done; /* joined workers that have returned */
};

#define ADMIT_CLOSED ((uint64_t)1 << 31)
#define ADMIT_COUNT  (ADMIT_CLOSED - 1)

/* A worker joins shared run g: true while it is open. */
static bool admit_join(td_threadpool *tp, uint32_t g) {
    uint64_t s = atomic_load_explicit(&tp->admit, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(s >> 32) != g || (s & ADMIT_CLOSED)) return false;
        if (atomic_compare_exchange_weak_explicit(&tp->admit, &s, s + 1, memory_order_acq_rel,
                                                  memory_order_acquire))
            return true;
    }
}

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
        if (g & 1) {
            /* late: the caller may have returned, fn and ctx gone */
            if (!admit_join(tp, g)) continue;
            tp->fn(tp->ctx, ith, tp->n);
            atomic_fetch_add(&tp->joined_done, 1);
            if (atomic_load(&tp->caller_sleeping)) futex_wake(&tp->joined_done, 1);
            continue;
        }
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

/* The caller waits until *word reaches want (spin, yield, then futex). */
static void caller_wait(td_threadpool *tp, _Atomic uint32_t *word, uint32_t want) {
    int spins = 0;
    uint32_t v;
    while ((v = atomic_load_explicit(word, memory_order_acquire)) != want) {
        if (spins < TD_SPIN_ITERS + TD_YIELD_ITERS) {
            if (spins++ < TD_SPIN_ITERS)
                _mm_pause();
            else
                sched_yield();
            continue;
        }
        atomic_store(&tp->caller_sleeping, 1);
        if (atomic_load(word) != want) futex_wait(word, v);
        atomic_store(&tp->caller_sleeping, 0);
    }
}

/* Publishes (fn, ctx) as the next generation (its low bit: shared) and
 * wakes sleeping workers. */
static void publish(td_threadpool *tp, td_task_fn fn, void *ctx, bool shared) {
    tp->fn = fn;
    tp->ctx = ctx;
    uint32_t g = ((atomic_load_explicit(&tp->gen, memory_order_relaxed) | 1) + 1) | shared;
    if (shared) {
        atomic_store_explicit(&tp->joined_done, 0, memory_order_relaxed);
        atomic_store_explicit(&tp->admit, (uint64_t)g << 32, memory_order_relaxed);
    } else {
        atomic_store(&tp->pending, (uint32_t)(tp->n - 1));
    }
    atomic_store(&tp->gen, g); /* seq_cst: pairs with the sleepers count */
    if (atomic_load(&tp->sleepers) > 0) futex_wake(&tp->gen, INT_MAX);
}

void td_threadpool_run(td_threadpool *tp, td_task_fn fn, void *ctx) {
    if (tp->n == 1) {
        fn(ctx, 0, 1);
        return;
    }
    publish(tp, fn, ctx, false);
    fn(ctx, 0, tp->n);
    caller_wait(tp, &tp->pending, 0);
}

void td_threadpool_run_shared(td_threadpool *tp, td_task_fn fn, void *ctx) {
    if (tp->n == 1) {
        fn(ctx, 0, 1);
        return;
    }
    publish(tp, fn, ctx, true);
    fn(ctx, 0, tp->n);
    uint64_t s = atomic_fetch_or(&tp->admit, ADMIT_CLOSED);
    caller_wait(tp, &tp->joined_done, (uint32_t)(s & ADMIT_COUNT));
}
