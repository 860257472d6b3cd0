#define _GNU_SOURCE /* pthread_rwlockattr_setkind_np */
#include "index.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

#include "common/kv/hmap.h"

/* Entries live in parallel arrays indexed by the hmap's value: the two
 * masks of an entry fill exactly one cache line, which is all a lookup
 * touches unless a prediction is present. An entry is live exactly when
 * one of its masks is non-zero: an entry whose masks both become zero is
 * deleted at once. */
typedef struct {
    td_rt_mask stored;
    td_rt_mask pred;
} entry_masks;

_Static_assert(sizeof(entry_masks) == 64, "an entry's masks are one cache line");

struct td_rt_index {
    pthread_rwlock_t lock;
    td_kv_hmap map;      /* hash -> entry */
    entry_masks *masks;  /* (cap), 64-byte aligned */
    double *exp;         /* (cap) expiry of the entry's predictions */
    td_kv_hash *keys;    /* (cap) the entry's hash, to delete it from map */
    int32_t *free_stack; /* (cap) free entry indices; the top is the last */
    int32_t n_free;
    int32_t cap;
    int32_t hwm;     /* entries [hwm, cap) were never used */
    size_t n_pred;   /* live entries with a non-zero pred mask */
    double last_now; /* latest `now` seen by predict / expire */
    size_t count[TD_RT_MAX_INSTANCES];
};

#define MAX_ENTRIES (INT32_C(1) << 30)

static inline bool mask_empty(const td_rt_mask *m) {
    uint64_t x = 0;
    for (int w = 0; w < TD_RT_MASK_WORDS; w++) x |= m->w[w];
    return x == 0;
}

static inline void mask_clear_bit(td_rt_mask *m, int slot) {
    m->w[slot >> 6] &= ~(UINT64_C(1) << (slot & 63));
}

static bool slot_ok(int slot) { return slot >= 0 && slot < TD_RT_MAX_INSTANCES; }

static td_status grow_entries(td_rt_index *ix, int32_t want) {
    if (want <= ix->cap) return TD_OK;
    if (want > MAX_ENTRIES) return TD_ERR_NOMEM;
    int32_t cap = ix->cap ? ix->cap : 1024;
    while (cap < want) cap = cap > MAX_ENTRIES / 2 ? MAX_ENTRIES : cap * 2;
    entry_masks *masks = aligned_alloc(64, (size_t)cap * sizeof *masks);
    double *exp = realloc(ix->exp, (size_t)cap * sizeof *exp);
    if (exp) ix->exp = exp;
    td_kv_hash *keys = exp ? realloc(ix->keys, (size_t)cap * sizeof *keys) : NULL;
    if (keys) ix->keys = keys;
    int32_t *fs = keys ? realloc(ix->free_stack, (size_t)cap * sizeof *fs) : NULL;
    if (fs) ix->free_stack = fs;
    if (!masks || !fs) {
        free(masks);
        return TD_ERR_NOMEM;
    }
    if (ix->hwm) memcpy(masks, ix->masks, (size_t)ix->hwm * sizeof *masks);
    free(ix->masks);
    ix->masks = masks;
    ix->cap = cap;
    return TD_OK;
}

/* A fresh entry for h (absent from the map), masks zero; -1 on NOMEM. */
static int32_t entry_new(td_rt_index *ix, td_kv_hash h) {
    int32_t e;
    if (ix->n_free) {
        e = ix->free_stack[--ix->n_free];
    } else {
        if (ix->hwm == ix->cap && grow_entries(ix, ix->cap + 1) != TD_OK) return -1;
        e = ix->hwm++;
    }
    memset(&ix->masks[e], 0, sizeof ix->masks[e]);
    td_status st;
    if (!td_kv_hmap_put(&ix->map, h, e, &st)) {
        TD_ASSERT(st != TD_OK); /* callers only add absent hashes */
        ix->free_stack[ix->n_free++] = e;
        return -1;
    }
    ix->exp[e] = -INFINITY;
    ix->keys[e] = h;
    return e;
}

static void entry_del(td_rt_index *ix, int32_t e) {
    bool found = td_kv_hmap_del(&ix->map, ix->keys[e]);
    TD_ASSERT(found);
    memset(&ix->masks[e], 0, sizeof ix->masks[e]);
    ix->free_stack[ix->n_free++] = e;
}

/* Deletes e when nothing visible is left in it: no stored bit, and no
 * prediction that is unexpired at the latest time the index was told. */
static void entry_reap(td_rt_index *ix, int32_t e) {
    entry_masks *m = &ix->masks[e];
    if (!mask_empty(&m->stored)) return;
    bool pred = !mask_empty(&m->pred);
    if (pred && ix->exp[e] >= ix->last_now) return;
    if (pred) ix->n_pred--;
    entry_del(ix, e);
}

td_status td_rt_index_create(size_t expected_blocks, td_rt_index **ix_p) {
    if (!ix_p) return TD_ERR_INVALID;
    td_rt_index *ix = calloc(1, sizeof *ix);
    if (!ix) goto fail;
    pthread_rwlockattr_t attr;
    if (pthread_rwlockattr_init(&attr) != 0) goto free_ix;
#ifdef __GLIBC__
    /* Lookups come continuously from every request thread; glibc's default
     * (readers first) could then hold the KV-event updates off for good. */
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
#endif
    int rc = pthread_rwlock_init(&ix->lock, &attr);
    pthread_rwlockattr_destroy(&attr);
    if (rc != 0) goto free_ix;
    size_t hint = TD_MIN(expected_blocks, (size_t)MAX_ENTRIES / 2);
    if (td_kv_hmap_init(&ix->map, (uint32_t)hint) != TD_OK) goto free_lock;
    if (grow_entries(ix, (int32_t)TD_MAX(hint, (size_t)1024)) != TD_OK) goto free_entries;
    ix->last_now = -INFINITY;
    *ix_p = ix;
    return TD_OK;
free_entries:
    free(ix->masks);
    free(ix->exp);
    free(ix->keys);
    free(ix->free_stack);
    td_kv_hmap_free(&ix->map);
free_lock:
    pthread_rwlock_destroy(&ix->lock);
free_ix:
    free(ix);
fail:
    TD_LOG_ERROR("cannot allocate a prefix index for %zu blocks", expected_blocks);
    return TD_ERR_NOMEM;
}

void td_rt_index_destroy(td_rt_index *ix) {
    if (!ix) return;
    td_kv_hmap_free(&ix->map);
    free(ix->masks);
    free(ix->exp);
    free(ix->keys);
    free(ix->free_stack);
    pthread_rwlock_destroy(&ix->lock);
    free(ix);
}

static td_status check_args(const td_rt_index *ix, int slot, const td_kv_hash *h, size_t n,
                            const char *func) {
    if (!ix || !slot_ok(slot) || (!h && n)) {
        td_log(TD_LOG_ERROR, func, "invalid arguments (index %p, slot %d, %zu hashes at %p)",
               (const void *)ix, slot, n, (const void *)h);
        return TD_ERR_INVALID;
    }
    return TD_OK;
}

td_status td_rt_index_store(td_rt_index *ix, int slot, const td_kv_hash *h, size_t n) {
    td_status st = check_args(ix, slot, h, n, __func__);
    if (st != TD_OK || !n) return st;
    pthread_rwlock_wrlock(&ix->lock);
    for (size_t i = 0; i < n; i++) {
        int32_t e = td_kv_hmap_get(&ix->map, h[i]);
        if (e < 0 && (e = entry_new(ix, h[i])) < 0) {
            TD_LOG_ERROR("out of memory after %zu of %zu hashes (index of %u)", i, n, ix->map.n);
            st = TD_ERR_NOMEM;
            break;
        }
        td_rt_mask *m = &ix->masks[e].stored;
        if (!td_rt_mask_has(m, slot)) {
            td_rt_mask_set(m, slot);
            ix->count[slot]++;
        }
    }
    pthread_rwlock_unlock(&ix->lock);
    return st;
}

void td_rt_index_remove(td_rt_index *ix, int slot, const td_kv_hash *h, size_t n) {
    if (check_args(ix, slot, h, n, __func__) != TD_OK || !n) return;
    pthread_rwlock_wrlock(&ix->lock);
    for (size_t i = 0; i < n; i++) {
        int32_t e = td_kv_hmap_get(&ix->map, h[i]);
        if (e < 0) continue;
        td_rt_mask *m = &ix->masks[e].stored;
        if (!td_rt_mask_has(m, slot)) continue;
        mask_clear_bit(m, slot);
        ix->count[slot]--;
        entry_reap(ix, e);
    }
    pthread_rwlock_unlock(&ix->lock);
}

void td_rt_index_clear(td_rt_index *ix, int slot) {
    if (check_args(ix, slot, NULL, 0, __func__) != TD_OK) return;
    pthread_rwlock_wrlock(&ix->lock);
    int w = slot >> 6;
    uint64_t bit = UINT64_C(1) << (slot & 63);
    if (ix->count[slot] || ix->n_pred) {
        for (int32_t e = 0; e < ix->hwm; e++) {
            entry_masks *m = &ix->masks[e];
            if (!((m->stored.w[w] | m->pred.w[w]) & bit)) continue;
            m->stored.w[w] &= ~bit;
            if (m->pred.w[w] & bit) {
                m->pred.w[w] &= ~bit;
                if (mask_empty(&m->pred)) {
                    ix->n_pred--;
                    ix->exp[e] = -INFINITY;
                }
            }
            entry_reap(ix, e);
        }
    }
    ix->count[slot] = 0;
    pthread_rwlock_unlock(&ix->lock);
}

td_status td_rt_index_predict(td_rt_index *ix, int slot, const td_kv_hash *h, size_t n, double now,
                              double ttl_s) {
    td_status st = check_args(ix, slot, h, n, __func__);
    if (st != TD_OK) return st;
    if (!isfinite(now) || !isfinite(ttl_s) || ttl_s < 0) {
        TD_LOG_ERROR("invalid time (now %g, ttl %g s)", now, ttl_s);
        return TD_ERR_INVALID;
    }
    if (!n) return TD_OK;
    double until = now + ttl_s;
    pthread_rwlock_wrlock(&ix->lock);
    if (now > ix->last_now) ix->last_now = now;
    for (size_t i = 0; i < n; i++) {
        int32_t e = td_kv_hmap_get(&ix->map, h[i]);
        if (e < 0 && (e = entry_new(ix, h[i])) < 0) {
            TD_LOG_ERROR("out of memory after %zu of %zu hashes (index of %u)", i, n, ix->map.n);
            st = TD_ERR_NOMEM;
            break;
        }
        td_rt_mask *p = &ix->masks[e].pred;
        /* Expired bits must not come back to life with the new expiry. */
        if (ix->exp[e] < now && !mask_empty(p)) {
            memset(p, 0, sizeof *p);
            ix->exp[e] = -INFINITY;
            ix->n_pred--;
        }
        if (mask_empty(p)) ix->n_pred++;
        td_rt_mask_set(p, slot);
        if (until > ix->exp[e]) ix->exp[e] = until;
    }
    pthread_rwlock_unlock(&ix->lock);
    return st;
}

void td_rt_index_expire(td_rt_index *ix, double now) {
    if (!ix || isnan(now)) return;
    pthread_rwlock_wrlock(&ix->lock);
    if (now > ix->last_now) ix->last_now = now;
    for (int32_t e = 0; e < ix->hwm && ix->n_pred; e++) {
        entry_masks *m = &ix->masks[e];
        if (ix->exp[e] >= now || mask_empty(&m->pred)) continue;
        memset(&m->pred, 0, sizeof m->pred);
        ix->exp[e] = -INFINITY;
        ix->n_pred--;
        if (mask_empty(&m->stored)) entry_del(ix, e);
    }
    pthread_rwlock_unlock(&ix->lock);
}

/* overlap[s] = v for every s in m. */
static inline void assign(const td_rt_mask *m, int32_t *out, int32_t v) {
    for (int w = 0; w < TD_RT_MASK_WORDS; w++) {
        for (uint64_t x = m->w[w]; x; x &= x - 1) out[w * 64 + __builtin_ctzll(x)] = v;
    }
}

static inline void increment(const td_rt_mask *m, int32_t *out) {
    for (int w = 0; w < TD_RT_MASK_WORDS; w++) {
        for (uint64_t x = m->w[w]; x; x &= x - 1) out[w * 64 + __builtin_ctzll(x)]++;
    }
}

void td_rt_index_match(td_rt_index *ix, const td_kv_hash *h, size_t n, const td_rt_mask *among,
                       double now, int32_t *overlap, int32_t *predicted_p) {
    if (!ix || !among || !overlap || (!h && n)) {
        TD_LOG_ERROR("invalid arguments (index %p, %zu hashes at %p, among %p, overlap %p)",
                     (const void *)ix, n, (const void *)h, (const void *)among,
                     (const void *)overlap);
        return;
    }
    td_rt_mask alive = *among;
    if (predicted_p) assign(&alive, predicted_p, 0);
    size_t lim = TD_MIN(n, (size_t)INT32_MAX);
    size_t i = 0;
    pthread_rwlock_rdlock(&ix->lock);
    for (; i < lim; i++) {
        int32_t e = td_kv_hmap_get(&ix->map, h[i]);
        if (e < 0) break;
        const entry_masks *m = &ix->masks[e];
        bool pred = ix->n_pred && ix->exp[e] >= now;
        td_rt_mask drop, only_pred;
        uint64_t left = 0, any_pred = 0;
        for (int w = 0; w < TD_RT_MASK_WORDS; w++) {
            uint64_t vis = m->stored.w[w] | (pred ? m->pred.w[w] : 0);
            uint64_t a = alive.w[w] & vis;
            drop.w[w] = alive.w[w] & ~a;
            only_pred.w[w] = a & ~m->stored.w[w];
            any_pred |= only_pred.w[w];
            alive.w[w] = a;
            left |= a;
        }
        assign(&drop, overlap, (int32_t)i);
        if (predicted_p && any_pred) increment(&only_pred, predicted_p);
        if (!left) break;
    }
    pthread_rwlock_unlock(&ix->lock);
    assign(&alive, overlap, (int32_t)i);
}

size_t td_rt_index_count(td_rt_index *ix, int slot) {
    if (!ix || !slot_ok(slot)) return 0;
    pthread_rwlock_rdlock(&ix->lock);
    size_t c = ix->count[slot];
    pthread_rwlock_unlock(&ix->lock);
    return c;
}

size_t td_rt_index_size(td_rt_index *ix) {
    if (!ix) return 0;
    pthread_rwlock_rdlock(&ix->lock);
    size_t c = ix->map.n;
    pthread_rwlock_unlock(&ix->lock);
    return c;
}
