/* Persistent worker pool. The caller publishes (fn, ctx) and bumps a
 * generation word; workers spin on it for a short while and then sleep on
 * it with futex(2). Completion is a countdown the caller spins on, with a
 * futex fallback, so an idle pool costs nothing and a busy one dispatches in
 * microseconds. The generation's low bits say which kind of run it is
 * (plain, shared or detached), so a worker reads the kind of run from the
 * word that announced it. A shared run admits workers through one more
 * word, its generation with a closed bit and the count of workers joined:
 * a worker joins with a compare-and-swap while it is open for the
 * generation it saw, the caller closes it when its own call returns and
 * then waits for exactly the workers that joined. A worker reads fn and
 * ctx of a shared run only once it has joined (a late one may find the
 * next run's there). A detached run is a shared run the caller does not
 * wait out: a worker copies the run's context before it joins (the join
 * succeeding says the copy was taken while the run was open), counts
 * itself busy meanwhile for td_threadpool_quiesce, and publishes results
 * only through the td_items commit, which the caller's fn waits for. */
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

/* the generation's low two bits: the kind of run it announced */
#define RUN_PLAIN    0u
#define RUN_SHARED   1u
#define RUN_DETACHED 2u
#define RUN_KIND     3u

struct td_threadpool {
    int n;
    pthread_t *threads; /* n - 1 workers */
    td_task_fn fn;
    void *ctx;
    _Atomic uint32_t gen;     /* changed once per run (low bits: RUN_*) and at shutdown */
    _Atomic uint32_t pending; /* workers still running the current generation */
    _Atomic int sleepers;     /* workers blocked (or about to block) in futex on gen */
    _Atomic int caller_sleeping;
    _Atomic int stop;
    int started;
    /* shared runs */
    _Atomic uint64_t admit;       /* generation << 32 | closed << 31 | workers joined */
    _Atomic uint32_t joined_done; /* joined workers that have returned */
    /* detached runs */
    _Atomic int busy; /* workers between copying a detached run's context and returning */
    size_t ctx_bytes;
    _Alignas(64) unsigned char ctx_buf[TD_THREADPOOL_CTX_MAX];
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
        if ((g & RUN_KIND) == RUN_DETACHED) {
            /* Copied before joining: a join that succeeds says the run was
             * still open, so neither the context nor fn was being replaced
             * by the next run's while they were read. */
            _Alignas(64) unsigned char local[TD_THREADPOOL_CTX_MAX];
            atomic_fetch_add(&tp->busy, 1);
            td_task_fn fn = tp->fn;
            size_t nb = tp->ctx_bytes;
            memcpy(local, tp->ctx_buf, nb < sizeof local ? nb : sizeof local);
            if (admit_join(tp, g)) fn(local, ith, tp->n);
            atomic_fetch_sub_explicit(&tp->busy, 1, memory_order_release);
            continue;
        }
        if (g & RUN_SHARED) {
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

/* Publishes (fn, ctx) as the next generation (its low bits: the kind of
 * run) and wakes sleeping workers. */
static void publish(td_threadpool *tp, td_task_fn fn, void *ctx, uint32_t kind) {
    tp->fn = fn;
    tp->ctx = ctx;
    uint32_t g = ((atomic_load_explicit(&tp->gen, memory_order_relaxed) | RUN_KIND) + 1) | kind;
    if (kind != RUN_PLAIN) {
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
    publish(tp, fn, ctx, RUN_PLAIN);
    fn(ctx, 0, tp->n);
    caller_wait(tp, &tp->pending, 0);
}

void td_threadpool_run_shared(td_threadpool *tp, td_task_fn fn, void *ctx) {
    if (tp->n == 1) {
        fn(ctx, 0, 1);
        return;
    }
    publish(tp, fn, ctx, RUN_SHARED);
    fn(ctx, 0, tp->n);
    uint64_t s = atomic_fetch_or(&tp->admit, ADMIT_CLOSED);
    caller_wait(tp, &tp->joined_done, (uint32_t)(s & ADMIT_COUNT));
}

void td_threadpool_run_detached(td_threadpool *tp, td_task_fn fn, const void *ctx,
                                size_t ctx_bytes) {
    TD_ASSERT(ctx_bytes <= TD_THREADPOOL_CTX_MAX);
    if (tp->n == 1) {
        fn((void *)ctx, 0, 1);
        return;
    }
    memcpy(tp->ctx_buf, ctx, ctx_bytes);
    tp->ctx_bytes = ctx_bytes;
    publish(tp, fn, tp->ctx_buf, RUN_DETACHED);
    fn((void *)ctx, 0, tp->n);
    atomic_fetch_or(&tp->admit, ADMIT_CLOSED);
}

/* A worker stays busy for at most one item and its commit; when its core
 * was taken away that can be a scheduler slice, so yield meanwhile. */
void td_threadpool_quiesce(td_threadpool *tp) {
    if (!tp) return;
    int spins = 0;
    while (atomic_load_explicit(&tp->busy, memory_order_acquire) != 0)
        if (spins++ < TD_SPIN_ITERS)
            _mm_pause();
        else
            sched_yield();
}

/* ------------------------------------------------------------------ items */

#define ITEM_DONE      1u /* in place */
#define ITEM_COMMIT    2u /* a worker is copying its result in */
#define ITEM_TAKEN     3u /* the caller took it back and computes it */
#define ITEM_TAG(e, s) ((e) << 2 | (s))

void td_items_free(td_items *it) {
    free(it->state);
    free(it->mine);
    *it = (td_items){0};
}

td_status td_items_begin(td_items *it, td_threadpool *tp, int64_t n, uint64_t *epoch) {
    TD_ASSERT(n >= 0 && n < ((int64_t)1 << 32));
    if (n > it->cap) {
        /* a late worker of an earlier run may still read the old states */
        td_threadpool_quiesce(tp);
        int64_t cap = n > 2 * it->cap ? n : 2 * it->cap;
        td_item_state *st = aligned_alloc(64, (size_t)cap * sizeof *st);
        uint64_t *mine = calloc((size_t)cap, sizeof *mine);
        if (!st || !mine) {
            free(st);
            free(mine);
            return TD_ERR_NOMEM;
        }
        for (int64_t i = 0; i < cap; i++) /* epoch 0: no run's */
            atomic_init(&st[i].v, i < it->cap
                                      ? atomic_load_explicit(&it->state[i].v, memory_order_relaxed)
                                      : 0);
        if (it->cap) memcpy(mine, it->mine, (size_t)it->cap * sizeof *mine);
        free(it->state);
        free(it->mine);
        it->state = st;
        it->mine = mine;
        it->cap = cap;
    }
    it->epoch++;
    it->n_mine = 0;
    atomic_store_explicit(&it->committed, 0, memory_order_relaxed);
    atomic_store_explicit(&it->next, (it->epoch & 0xffffffffu) << 32, memory_order_relaxed);
    *epoch = it->epoch;
    return TD_OK;
}

bool td_items_claim(td_items *it, uint64_t epoch, int64_t n, int64_t *i) {
    uint64_t v = atomic_load_explicit(&it->next, memory_order_relaxed);
    for (;;) {
        if ((v >> 32) != (epoch & 0xffffffffu) || (int64_t)(v & 0xffffffffu) >= n) return false;
        if (atomic_compare_exchange_weak_explicit(&it->next, &v, v + 1, memory_order_relaxed,
                                                  memory_order_relaxed)) {
            *i = (int64_t)(v & 0xffffffffu);
            return true;
        }
    }
}

/* The caller's own items stay out of the shared states (no cache line
 * goes back and forth while the threads work): no worker claims them in
 * this run, and one of an earlier run finds them settled in its own. */
void td_items_done(td_items *it, uint64_t epoch, int64_t i) {
    it->mine[i] = epoch;
    it->n_mine++;
}

/* An item's state carries the epoch of the last run that settled it; a
 * worker wins only a state older than its own run, so a worker of an
 * earlier run (whose items were all settled before the caller went on)
 * never does. */
bool td_items_commit_begin(td_items *it, uint64_t epoch, int64_t i) {
    uint64_t v = atomic_load_explicit(&it->state[i].v, memory_order_relaxed);
    while ((v >> 2) < epoch)
        if (atomic_compare_exchange_weak_explicit(&it->state[i].v, &v, ITEM_TAG(epoch, ITEM_COMMIT),
                                                  memory_order_acquire, memory_order_relaxed))
            return true;
    return false;
}

void td_items_commit_end(td_items *it, uint64_t epoch, int64_t i) {
    atomic_store_explicit(&it->state[i].v, ITEM_TAG(epoch, ITEM_DONE), memory_order_release);
    atomic_fetch_add_explicit(&it->committed, 1, memory_order_release);
}

void td_items_finish(td_items *it, uint64_t epoch, int64_t n, int64_t wait_ns,
                     void (*redo)(void *ctx, int64_t i), void *ctx) {
    /* the common case: the workers commit the rest within the deadline
     * (one counter to watch, not every item's state) */
    const int64_t t0 = (int64_t)td_time_ns();
    for (int spins = 1;; spins++) {
        if (atomic_load_explicit(&it->committed, memory_order_acquire) + it->n_mine >= n) return;
        if ((spins & 63) == 0 && (int64_t)td_time_ns() - t0 > wait_ns) break;
        _mm_pause();
    }
    /* past it: take back every item a worker still holds */
    for (int64_t i = 0; i < n; i++) {
        if (it->mine[i] == epoch) continue;
        int spins = 0;
        for (;;) {
            uint64_t v = atomic_load_explicit(&it->state[i].v, memory_order_acquire);
            if (v == ITEM_TAG(epoch, ITEM_DONE)) break;
            if ((v >> 2) < epoch && atomic_compare_exchange_strong_explicit(
                                        &it->state[i].v, &v, ITEM_TAG(epoch, ITEM_TAKEN),
                                        memory_order_relaxed, memory_order_relaxed)) {
                redo(ctx, i);
                break;
            }
            /* a worker is copying its result in */
            if (spins++ < TD_SPIN_ITERS)
                _mm_pause();
            else
                sched_yield();
        }
    }
}
