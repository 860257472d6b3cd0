/* The router's prefix index (DESIGN.md §6): one global map from a KV block
 * hash (common/kv/hash.h) to the set of instances holding that block, as a
 * bitmask over instance slots, so that one walk over a prompt's block
 * hashes gives every instance's prefix overlap at once. Fed by the
 * instances' KV events (stored / removed / cleared, or a full snapshot),
 * plus "predicted" entries with a short time to live for the requests the
 * router has just sent somewhere, so that a burst of siblings lands
 * together before the events arrive.
 *
 * Slots are small integers 0 .. TD_RT_MAX_INSTANCES-1 that the caller
 * assigns to instances (prefill and decode alike) and reuses after
 * td_rt_index_clear.
 *
 * Thread-safety: every function may be called from any thread; lookups
 * take a shared lock, updates an exclusive one. */
#ifndef TD_ROUTER_INDEX_H
#define TD_ROUTER_INDEX_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/base.h"
#include "common/kv/hash.h"

#define TD_RT_MAX_INSTANCES 256
#define TD_RT_MASK_WORDS    (TD_RT_MAX_INSTANCES / 64)

typedef struct {
    uint64_t w[TD_RT_MASK_WORDS];
} td_rt_mask;

static inline void td_rt_mask_set(td_rt_mask *m, int slot) {
    m->w[slot >> 6] |= UINT64_C(1) << (slot & 63);
}
static inline bool td_rt_mask_has(const td_rt_mask *m, int slot) {
    return (m->w[slot >> 6] >> (slot & 63)) & 1;
}

typedef struct td_rt_index td_rt_index;

/* expected_blocks: a sizing hint (distinct hashes expected in all). Free
 * with td_rt_index_destroy(). TD_ERR_NOMEM. */
td_status td_rt_index_create(size_t expected_blocks, td_rt_index **ix_p);
void td_rt_index_destroy(td_rt_index *ix); /* accepts NULL */

/* Instance `slot` now holds / no longer holds the blocks h[0..n). Storing a
 * hash the slot already holds, or removing one it does not hold, changes
 * nothing. TD_ERR_NOMEM (the index is unchanged for the hashes not yet
 * added); TD_ERR_INVALID for a slot out of range. */
td_status td_rt_index_store(td_rt_index *ix, int slot, const td_kv_hash *h, size_t n);
void td_rt_index_remove(td_rt_index *ix, int slot, const td_kv_hash *h, size_t n);
/* Forgets everything of `slot`, stored and predicted (a snapshot follows,
 * the instance restarted, or it left the cluster). */
void td_rt_index_clear(td_rt_index *ix, int slot);

/* Predicts that `slot` will hold h[0..n) from now (td_time_s() clock) until
 * now + ttl_s; a later prediction of the same hash extends it. One expiry
 * is kept per hash, not per slot: while several slots predict a hash, each
 * of them holds it until the latest of those expiries (a prediction made
 * after the hash's predictions expired, or after every slot's was
 * cleared, starts afresh). Callers pass a non-decreasing `now` across
 * predict, expire and match. TD_ERR_INVALID for a bad slot or a
 * non-finite or negative time; TD_ERR_NOMEM as for store. */
td_status td_rt_index_predict(td_rt_index *ix, int slot, const td_kv_hash *h, size_t n, double now,
                              double ttl_s);
/* Drops predictions that expired before `now` (memory only: lookups
 * already ignore them). */
void td_rt_index_expire(td_rt_index *ix, double now);

/* For every slot in `among`: overlap[slot] = how many leading blocks of
 * h[0..n) the slot holds (stored, or predicted and unexpired at `now`);
 * and, when predicted_p is not NULL, predicted_p[slot] = how many of those
 * leading blocks are held only as a prediction. Entries of slots not in
 * among are left untouched. One walk over h, stopping as soon as no slot
 * of among holds the next block. */
void td_rt_index_match(td_rt_index *ix, const td_kv_hash *h, size_t n, const td_rt_mask *among,
                       double now, int32_t *overlap, int32_t *predicted_p);

/* Blocks stored for `slot` (predictions not counted). */
size_t td_rt_index_count(td_rt_index *ix, int slot);
/* Distinct hashes in the index (stored or predicted). */
size_t td_rt_index_size(td_rt_index *ix);

#endif
