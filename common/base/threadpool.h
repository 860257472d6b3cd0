/* A fixed pool of worker threads for data-parallel kernels.
 *
 * td_threadpool_run(tp, fn, ctx) calls fn(ctx, ith, nth) once for every
 * ith in [0, nth), nth = td_threadpool_size(tp), the calling thread taking
 * ith = 0, and returns when all calls have returned. Workers spin briefly
 * between runs and then sleep on a futex, so per-layer dispatch stays in
 * the microseconds. Only one thread may call run() at a time. */
#ifndef TD_THREADPOOL_H
#define TD_THREADPOOL_H

#include "base.h"

typedef struct td_threadpool td_threadpool;
typedef void (*td_task_fn)(void *ctx, int ith, int nth);

/* n_threads <= 0 means every online core. Free with td_threadpool_destroy(). */
td_status td_threadpool_create(int n_threads, td_threadpool **tp_p);
void td_threadpool_destroy(td_threadpool *tp); /* accepts NULL */
int td_threadpool_size(const td_threadpool *tp);
void td_threadpool_run(td_threadpool *tp, td_task_fn fn, void *ctx);

/* Like td_threadpool_run for work that the threads take from a shared
 * counter (any subset of them finishes all of it): fn(ctx, ith, nth) runs
 * on the caller (ith 0) and on each worker that joins before the caller's
 * own call has returned; a worker that comes later skips this run. Returns
 * once every thread that joined has returned. So a worker the OS has
 * descheduled (another process took its core) delays a run only if it
 * joined it, instead of every run waiting for it to be scheduled again. */
void td_threadpool_run_shared(td_threadpool *tp, td_task_fn fn, void *ctx);

/* Detached runs, for work whose items a late thread's result may be
 * replaced in: like td_threadpool_run_shared, except that the caller
 * returns as soon as its own fn(ctx, 0, nth) returns, without waiting for
 * the workers that joined. Each worker that joins runs fn on its own copy
 * of the ctx_bytes (at most TD_THREADPOOL_CTX_MAX) bytes at ctx, taken
 * while the run was open. So fn must see on the caller that every item is
 * finished (td_items_finish) and a worker must publish a result only
 * through td_items_commit_begin/_end, which the caller waits for; a worker
 * still inside fn after the caller has gone on finds its claims and
 * commits refused and only reads. Call td_threadpool_quiesce before
 * freeing memory such a worker may still read. */
#define TD_THREADPOOL_CTX_MAX 256
void td_threadpool_run_detached(td_threadpool *tp, td_task_fn fn, const void *ctx,
                                size_t ctx_bytes);
/* Returns once no worker is inside the fn of a detached run. */
void td_threadpool_quiesce(td_threadpool *tp);

/* Items of detached runs. Every item is claimed once per run (epoch); the
 * caller writes its own items' results in place and marks them done, a
 * worker computes into memory of its own and copies its result in only if
 * it wins the item's commit. The caller, out of items to claim, waits for
 * the items the workers hold and, once a wait passes a deadline (the worker
 * was descheduled: another process took its core), takes the item back and
 * computes it itself (redo): exactly one thread's result lands in each
 * item, and every thread computes the same values, so the result does not
 * depend on who wins. */
typedef struct {
    _Alignas(64) _Atomic uint64_t v; /* epoch << 2 | state: one cache line per item */
} td_item_state;
typedef struct {
    _Atomic uint64_t next; /* low 32 bits of the epoch << 32 | next item */
    td_item_state *state;  /* (cap) written by workers' commits and by take-backs */
    _Alignas(64) _Atomic int64_t committed; /* items the workers committed this run */
    _Alignas(64) uint64_t *mine; /* (cap) the caller's own: the epoch it last did each item in */
    int64_t n_mine;              /* the caller's own items this run */
    int64_t cap;
    uint64_t epoch;
} td_items;

void td_items_free(td_items *it);
/* Caller, before a run of n items: a new epoch (returned), the state grown
 * to n items (after td_threadpool_quiesce). TD_ERR_NOMEM leaves it as it
 * was. */
td_status td_items_begin(td_items *it, td_threadpool *tp, int64_t n, uint64_t *epoch);
/* Any thread: the next unclaimed item of run epoch (false: none left, or
 * the run is over). */
bool td_items_claim(td_items *it, uint64_t epoch, int64_t n, int64_t *i);
/* Caller: item i's result is in place. */
void td_items_done(td_items *it, uint64_t epoch, int64_t i);
/* Worker: true if it owns item i's result (copy it in, then commit_end);
 * false if the caller took it back or the run is over (discard it). */
bool td_items_commit_begin(td_items *it, uint64_t epoch, int64_t i);
void td_items_commit_end(td_items *it, uint64_t epoch, int64_t i);
/* Caller, out of items: returns once every item of the run is in place,
 * calling redo(ctx, i) for each item it took back from a worker that held
 * it more than wait_ns after this call began. */
void td_items_finish(td_items *it, uint64_t epoch, int64_t n, int64_t wait_ns,
                     void (*redo)(void *ctx, int64_t i), void *ctx);

/* Helper: the [begin, end) share of n items for thread ith of nth. */
static inline void td_split_range(int64_t n, int ith, int nth, int64_t *begin, int64_t *end) {
    int64_t per = n / nth, rem = n % nth;
    *begin = ith * per + (ith < rem ? ith : rem);
    *end = *begin + per + (ith < rem ? 1 : 0);
}

#endif
