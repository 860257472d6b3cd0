/* Paged KV block pool with a prefix cache.
 *
 * Allocatable blocks are a bitmap (bit set = empty); cached blocks
 * (unreferenced, hashed) sit on an LRU list and are evicted only when empty
 * blocks run out. Allocation takes the lowest run of n consecutive empty
 * ids if there is one, else the lowest empty ids, so the pool stays compact
 * and KV transfers can move whole runs. Storage is one anonymous mapping
 * (page-aligned, committed lazily): layer l's K region, then its V region,
 * each (n_blocks, block_size, n_kv_heads, head_dim) floats. */
#include "kv.h"

#include <stdbool.h>
#include <string.h>
#include <time.h>

#include "hmap.h"

struct td_kv_pool {
    td_kv_params p;
    uint64_t *empty_bits; /* (ceil(n_blocks / 64)) set = empty */
    uint64_t *free_bits;  /* (ceil(n_blocks / 64)) set = allocatable: empty or cached */
    int32_t *refs;        /* (n_blocks) */
    td_kv_hash *hashes;   /* (n_blocks) valid where has_hash */
    bool *has_hash;       /* (n_blocks) */
    int32_t *lru_prev;    /* (n_blocks) LRU list of cached blocks; -1 ends */
    int32_t *lru_next;    /* (n_blocks) */
    int32_t lru_head;     /* least recently used cached block, or -1 */
    int32_t lru_tail;     /* most recently used */
    int32_t n_empty;
    int32_t n_cached;
    int32_t n_hashed;
    int32_t reserved;
    uint64_t evictions;
    td_kv_hmap map; /* hash -> block id */
    td_kv_events *events;
};

td_kv_params td_kv_default_params(void) {
    td_kv_params p = {.n_layers = 0,
                      .n_kv_heads = 0,
                      .head_dim = 0,
                      .block_size = 16,
                      .n_blocks = 0,
                      .event_capacity = 65536,
                      .epoch = 0,
                      .dtype = TD_TYPE_F32};
    return p;
}

static bool params_ok(const td_kv_params *p) {
    return p && p->n_layers > 0 && p->n_kv_heads > 0 && p->head_dim > 0 && p->block_size > 0 &&
           p->n_blocks > 0;
}

size_t td_kv_elem_bytes(uint32_t t) {
    return t == TD_TYPE_F32 || t == TD_TYPE_F16 || t == TD_TYPE_BF16
               ? td_dtype_block_bytes((td_dtype)t)
               : 0;
}

bool td_kv_dtype_parse(const char *name, td_dtype *t) {
    static const struct {
        const char *name;
        td_dtype t;
    } names[] = {{"f32", TD_TYPE_F32}, {"f16", TD_TYPE_F16}, {"bf16", TD_TYPE_BF16}};
    for (size_t i = 0; name && i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(name, names[i].name)) {
            *t = names[i].t;
            return true;
        }
    return false;
}

/* The dense layout's sizes for n_blocks blocks (0 allowed: the per-block
 * figures only). */
static td_status layout_of(const td_kv_params *p, size_t n_blocks, td_kv_layout *l) {
    size_t e = td_kv_elem_bytes((uint32_t)p->dtype);
    if (e == 0) return TD_ERR_UNSUPPORTED;
    *l = (td_kv_layout){.dtype = p->dtype, .elem_bytes = e};
    if (td_mul_overflow((size_t)p->n_kv_heads, (size_t)p->head_dim, &l->row_bytes) ||
        td_mul_overflow(l->row_bytes, e, &l->row_bytes) ||
        td_mul_overflow(l->row_bytes, (size_t)p->block_size, &l->block_bytes) ||
        td_mul_overflow(l->block_bytes, n_blocks, &l->layer_bytes) ||
        td_mul_overflow(l->layer_bytes, (size_t)p->n_layers * 2u, &l->bytes))
        return TD_ERR_RANGE;
    return TD_OK;
}

td_status td_kv_layout_dense(const td_kv_params *p, td_kv_layout *l) {
    if (!params_ok(p) || !l) return TD_ERR_INVALID;
    return layout_of(p, (size_t)p->n_blocks, l);
}

size_t td_kv_block_bytes(const td_kv_params *p) {
    if (!p || p->n_layers <= 0 || p->n_kv_heads <= 0 || p->head_dim <= 0 || p->block_size <= 0)
        return 0;
    td_kv_layout l;
    size_t n;
    if (layout_of(p, 0, &l) || td_mul_overflow(l.block_bytes, (size_t)p->n_layers * 2u, &n))
        return 0;
    return n;
}

td_status td_kv_pool_create(const td_kv_params *p, td_kv_pool **pool_p) {
    if (!params_ok(p) || !pool_p) {
        TD_LOG_ERROR("invalid KV pool parameters");
        return TD_ERR_INVALID;
    }
    td_kv_layout lay;
    td_status lst = td_kv_layout_dense(p, &lay);
    if (lst == TD_ERR_UNSUPPORTED) {
        TD_LOG_ERROR("KV pool: K and V cannot be held as dtype %d (F32, F16 or BF16)", p->dtype);
        return lst;
    }
    if (lst) {
        TD_LOG_ERROR("KV pool size overflows (%d layers, %d blocks)", p->n_layers, p->n_blocks);
        return TD_ERR_RANGE;
    }
    td_kv_pool *pool = calloc(1, sizeof *pool);
    if (!pool) {
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    pool->p = *p;
    if (pool->p.event_capacity == 0) pool->p.event_capacity = 65536;
    if (pool->p.epoch == 0) pool->p.epoch = td_random_u64();
    size_t nb = (size_t)p->n_blocks, n_words = (nb + 63) / 64;
    pool->empty_bits = calloc(n_words, sizeof(uint64_t));
    pool->free_bits = calloc(n_words, sizeof(uint64_t));
    pool->refs = calloc(nb, sizeof(int32_t));
    pool->hashes = calloc(nb, sizeof(td_kv_hash));
    pool->has_hash = calloc(nb, sizeof(bool));
    pool->lru_prev = malloc(nb * sizeof(int32_t));
    pool->lru_next = malloc(nb * sizeof(int32_t));
    if (!pool->empty_bits || !pool->free_bits || !pool->refs || !pool->hashes || !pool->has_hash ||
        !pool->lru_prev || !pool->lru_next) {
        TD_LOG_ERROR("out of memory");
        goto free_arrays;
    }
    if (td_kv_hmap_init(&pool->map, (uint32_t)TD_MIN(nb, 1u << 20)) != TD_OK) {
        TD_LOG_ERROR("out of memory");
        goto free_arrays;
    }
    if (td_kv_events_create(pool->p.event_capacity, pool->p.epoch, &pool->events) != TD_OK)
        goto free_map;
    for (size_t i = 0; i < nb; i++) {
        pool->empty_bits[i / 64] |= 1ull << (i % 64);
        pool->free_bits[i / 64] |= 1ull << (i % 64);
        pool->lru_prev[i] = pool->lru_next[i] = -1;
    }
    pool->lru_head = pool->lru_tail = -1;
    pool->n_empty = p->n_blocks;
    *pool_p = pool;
    return TD_OK;

free_map:
    td_kv_hmap_free(&pool->map);
free_arrays:
    free(pool->lru_next);
    free(pool->lru_prev);
    free(pool->has_hash);
    free(pool->hashes);
    free(pool->refs);
    free(pool->free_bits);
    free(pool->empty_bits);
    free(pool);
    return TD_ERR_NOMEM;
}

void td_kv_pool_destroy(td_kv_pool *pool) {
    if (!pool) return;
    td_kv_events_destroy(pool->events);
    td_kv_hmap_free(&pool->map);
    free(pool->lru_next);
    free(pool->lru_prev);
    free(pool->has_hash);
    free(pool->hashes);
    free(pool->refs);
    free(pool->free_bits);
    free(pool->empty_bits);
    free(pool);
}

const td_kv_params *td_kv_pool_params(const td_kv_pool *pool) { return &pool->p; }

int32_t td_kv_pool_n_free(const td_kv_pool *pool) {
    return pool->n_empty + pool->n_cached - pool->reserved;
}

td_kv_events *td_kv_pool_events(td_kv_pool *pool) { return pool->events; }

static inline bool is_empty(const td_kv_pool *pool, int32_t i) {
    return (pool->empty_bits[i / 64] >> (i % 64)) & 1u;
}

/* Lowest empty id >= from, or -1. */
static int32_t next_empty(const td_kv_pool *pool, int32_t from) {
    int32_t nb = pool->p.n_blocks;
    if (from >= nb) return -1;
    size_t w = (size_t)from / 64;
    uint64_t bits = pool->empty_bits[w] & (~0ull << (from % 64));
    size_t n_words = ((size_t)nb + 63) / 64;
    for (;;) {
        if (bits) {
            int32_t id = (int32_t)(w * 64 + (size_t)__builtin_ctzll(bits));
            return id < nb ? id : -1;
        }
        if (++w >= n_words) return -1;
        bits = pool->empty_bits[w];
    }
}

/* Lowest non-empty id >= from, or n_blocks. */
static int32_t next_taken(const td_kv_pool *pool, int32_t from) {
    int32_t nb = pool->p.n_blocks;
    if (from >= nb) return nb;
    size_t w = (size_t)from / 64;
    uint64_t bits = ~pool->empty_bits[w] & (~0ull << (from % 64));
    size_t n_words = ((size_t)nb + 63) / 64;
    for (;;) {
        if (bits) {
            int32_t id = (int32_t)(w * 64 + (size_t)__builtin_ctzll(bits));
            return id < nb ? id : nb;
        }
        if (++w >= n_words) return nb;
        bits = ~pool->empty_bits[w];
    }
}

static void lru_unlink(td_kv_pool *pool, int32_t id) {
    int32_t pr = pool->lru_prev[id], nx = pool->lru_next[id];
    if (pr >= 0)
        pool->lru_next[pr] = nx;
    else
        pool->lru_head = nx;
    if (nx >= 0)
        pool->lru_prev[nx] = pr;
    else
        pool->lru_tail = pr;
    pool->lru_prev[id] = pool->lru_next[id] = -1;
}

static void lru_push_tail(td_kv_pool *pool, int32_t id) {
    pool->lru_prev[id] = pool->lru_tail;
    pool->lru_next[id] = -1;
    if (pool->lru_tail >= 0)
        pool->lru_next[pool->lru_tail] = id;
    else
        pool->lru_head = id;
    pool->lru_tail = id;
}

static void drop_hash(td_kv_pool *pool, int32_t id) {
    TD_ASSERT(pool->has_hash[id]);
    td_kv_hmap_del(&pool->map, pool->hashes[id]);
    pool->has_hash[id] = false;
    pool->n_hashed--;
    td_kv_events_append(pool->events, TD_KV_EVENT_REMOVED, pool->hashes[id]);
}

static inline void set_free(td_kv_pool *pool, int32_t id, bool f) {
    if (f)
        pool->free_bits[id / 64] |= 1ull << (id % 64);
    else
        pool->free_bits[id / 64] &= ~(1ull << (id % 64));
}

static void take_empty(td_kv_pool *pool, int32_t id) {
    pool->empty_bits[id / 64] &= ~(1ull << (id % 64));
    set_free(pool, id, false);
    pool->refs[id] = 1;
    pool->n_empty--;
}

/* Evicts the least recently used cached block and takes it (refcount 1). */
static int32_t take_evicted(td_kv_pool *pool) {
    int32_t id = pool->lru_head;
    TD_ASSERT(id >= 0);
    lru_unlink(pool, id);
    pool->n_cached--;
    drop_hash(pool, id);
    pool->evictions++;
    pool->refs[id] = 1;
    set_free(pool, id, false);
    return id;
}

static void alloc_n(td_kv_pool *pool, int32_t n, int32_t *ids) {
    if (n <= pool->n_empty) {
        /* First fit: the lowest run of n consecutive empty ids. */
        int32_t start = next_empty(pool, 0);
        while (start >= 0) {
            int32_t end = next_taken(pool, start);
            if (end - start >= n) {
                for (int32_t i = 0; i < n; i++) {
                    take_empty(pool, start + i);
                    ids[i] = start + i;
                }
                return;
            }
            start = next_empty(pool, end);
        }
    }
    /* No run is long enough: the lowest empty ids, then LRU evictions. */
    int32_t i = 0, id = -1;
    for (; i < n && pool->n_empty > 0; i++) {
        id = next_empty(pool, id + 1);
        TD_ASSERT(id >= 0);
        take_empty(pool, id);
        ids[i] = id;
    }
    for (; i < n; i++) ids[i] = take_evicted(pool);
}

td_status td_kv_block_alloc(td_kv_pool *pool, int32_t n, int32_t *ids) {
    if (n < 0 || (n > 0 && !ids)) return TD_ERR_INVALID;
    if (n == 0) return TD_OK;
    if (n > td_kv_pool_n_free(pool)) return TD_NO_KV_BLOCK;
    alloc_n(pool, n, ids);
    return TD_OK;
}

td_status td_kv_block_alloc_reserved(td_kv_pool *pool, int32_t n, int32_t *ids) {
    if (n < 0 || (n > 0 && !ids)) return TD_ERR_INVALID;
    if (n == 0) return TD_OK;
    TD_ASSERT(n <= pool->reserved);
    pool->reserved -= n;
    alloc_n(pool, n, ids);
    return TD_OK;
}

td_status td_kv_reserve(td_kv_pool *pool, int32_t n) {
    if (n < 0) return TD_ERR_INVALID;
    if (n > td_kv_pool_n_free(pool)) return TD_NO_KV_BLOCK;
    pool->reserved += n;
    return TD_OK;
}

void td_kv_unreserve(td_kv_pool *pool, int32_t n) {
    TD_ASSERT(n >= 0 && n <= pool->reserved);
    pool->reserved -= n;
}

void td_kv_block_ref(td_kv_pool *pool, int32_t id) {
    TD_ASSERT(id >= 0 && id < pool->p.n_blocks);
    TD_ASSERT(pool->refs[id] > 0);
    TD_ASSERT(pool->refs[id] < INT32_MAX);
    pool->refs[id]++;
}

void td_kv_block_free(td_kv_pool *pool, const int32_t *ids, int32_t n) {
    for (int32_t i = n - 1; i >= 0; i--) {
        int32_t id = ids[i];
        TD_ASSERT(id >= 0 && id < pool->p.n_blocks);
        TD_ASSERT(pool->refs[id] > 0 && !is_empty(pool, id));
        if (--pool->refs[id] > 0) continue;
        set_free(pool, id, true);
        if (pool->has_hash[id]) {
            lru_push_tail(pool, id);
            pool->n_cached++;
        } else {
            pool->empty_bits[id / 64] |= 1ull << (id % 64);
            pool->n_empty++;
        }
    }
}

int32_t td_kv_block_refcount(const td_kv_pool *pool, int32_t id) {
    if (id < 0 || id >= pool->p.n_blocks) return 0;
    return pool->refs[id];
}

bool td_kv_cache_insert(td_kv_pool *pool, int32_t id, td_kv_hash h) {
    TD_ASSERT(id >= 0 && id < pool->p.n_blocks);
    TD_ASSERT(pool->refs[id] > 0);
    if (pool->has_hash[id]) return false; /* published once; a block never changes hash */
    td_status st;
    if (!td_kv_hmap_put(&pool->map, h, id, &st)) {
        if (st != TD_OK) TD_LOG_WARN("out of memory: block not added to the prefix cache");
        return false;
    }
    pool->hashes[id] = h;
    pool->has_hash[id] = true;
    pool->n_hashed++;
    td_kv_events_append(pool->events, TD_KV_EVENT_STORED, h);
    return true;
}

int32_t td_kv_cache_probe(const td_kv_pool *pool, const td_kv_hash *hashes, int32_t n) {
    int32_t k = 0;
    while (k < n && td_kv_hmap_get(&pool->map, hashes[k]) >= 0) k++;
    return k;
}

int32_t td_kv_cache_acquire(td_kv_pool *pool, const td_kv_hash *hashes, int32_t n, int32_t *ids) {
    int32_t k = 0;
    for (; k < n; k++) {
        int32_t id = td_kv_hmap_get(&pool->map, hashes[k]);
        if (id < 0) break;
        if (pool->refs[id] == 0) {
            lru_unlink(pool, id);
            pool->n_cached--;
            set_free(pool, id, false);
            /* Taking a cached block spends free capacity that a reservation
             * may count on; callers check td_kv_pool_n_free first. */
        }
        pool->refs[id]++;
        ids[k] = id;
    }
    return k;
}

void td_kv_cache_clear(td_kv_pool *pool) {
    while (pool->lru_head >= 0) {
        int32_t id = pool->lru_head;
        lru_unlink(pool, id);
        pool->n_cached--;
        drop_hash(pool, id);
        pool->empty_bits[id / 64] |= 1ull << (id % 64);
        pool->n_empty++;
    }
}

void td_kv_pool_counts(const td_kv_pool *pool, td_kv_counts *c) {
    /* Longest run of allocatable ids, a word at a time (called every step). */
    int32_t nb = pool->p.n_blocks, best = 0, run = 0;
    size_t n_words = ((size_t)nb + 63) / 64;
    for (size_t w = 0; w < n_words; w++) {
        uint64_t bits = pool->free_bits[w];
        int width = w + 1 < n_words || nb % 64 == 0 ? 64 : nb % 64;
        if (width == 64 && bits == ~0ull) {
            run += 64;
        } else if (bits == 0) {
            run = 0;
        } else {
            for (int i = 0; i < width; i++) {
                run = (bits >> i) & 1u ? run + 1 : 0;
                if (run > best) best = run;
            }
            continue;
        }
        if (run > best) best = run;
    }
    int32_t n_free = pool->n_empty + pool->n_cached;
    c->total = nb;
    c->empty = pool->n_empty;
    c->cached = pool->n_cached;
    c->used = nb - pool->n_empty - pool->n_cached;
    c->hashed = pool->n_hashed;
    c->reserved = pool->reserved;
    c->largest_free_run = best;
    c->fragmentation = n_free > 0 ? 1.0 - (double)best / (double)n_free : 0.0;
    c->evictions = pool->evictions;
}
