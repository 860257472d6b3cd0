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

/* Helper: the [begin, end) share of n items for thread ith of nth. */
static inline void td_split_range(int64_t n, int ith, int nth, int64_t *begin, int64_t *end) {
    int64_t per = n / nth, rem = n % nth;
    *begin = ith * per + (ith < rem ? ith : rem);
    *end = *begin + per + (ith < rem ? 1 : 0);
}

#endif
