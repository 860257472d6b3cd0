/* Paged KV block pool.
 *
 * Free blocks are a bitmap (bit set = free). Allocation takes the lowest
 * run of n consecutive free ids if there is one, else the n lowest free
 * ids, so the pool stays compact and KV transfers can move whole runs.
 * Storage is one anonymous mapping (page-aligned, committed lazily):
 * layer l's K region, then its V region, each (n_blocks, block_size,
 * n_kv_heads, head_dim) floats. */
#include "kv.h"

#include <errno.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>

struct td_kv_pool {
    td_kv_params p;
    uint64_t *free_bits; /* (ceil(n_blocks / 64)) */
    int32_t *refs;       /* (n_blocks) */
    int32_t n_free;
    size_t layer_floats; /* floats of one K (or V) region */
    float *storage;      /* (n_layers, 2, n_blocks, block_size, n_kv_heads, head_dim) */
    size_t storage_bytes;
};

td_kv_params td_kv_default_params(void) {
    td_kv_params p = {
        .n_layers = 0, .n_kv_heads = 0, .head_dim = 0, .block_size = 16, .n_blocks = 0};
    return p;
}

/* Floats of one K region of one layer; 0 on overflow or bad params. */
static size_t layer_floats(const td_kv_params *p) {
    size_t n;
    if (td_mul_overflow((size_t)p->n_blocks, (size_t)p->block_size, &n) ||
        td_mul_overflow(n, (size_t)p->n_kv_heads, &n) ||
        td_mul_overflow(n, (size_t)p->head_dim, &n))
        return 0;
    return n;
}

static bool params_ok(const td_kv_params *p) {
    return p && p->n_layers > 0 && p->n_kv_heads > 0 && p->head_dim > 0 && p->block_size > 0 &&
           p->n_blocks > 0;
}

size_t td_kv_block_bytes(const td_kv_params *p) {
    if (!p || p->n_layers <= 0 || p->n_kv_heads <= 0 || p->head_dim <= 0 || p->block_size <= 0)
        return 0;
    size_t n;
    if (td_mul_overflow((size_t)p->block_size, (size_t)p->n_kv_heads, &n) ||
        td_mul_overflow(n, (size_t)p->head_dim, &n) ||
        td_mul_overflow(n, (size_t)p->n_layers * 2u, &n) || td_mul_overflow(n, sizeof(float), &n))
        return 0;
    return n;
}

td_status td_kv_pool_create(const td_kv_params *p, td_kv_pool **pool_p) {
    if (!params_ok(p) || !pool_p) {
        TD_LOG_ERROR("invalid KV pool parameters");
        return TD_ERR_INVALID;
    }
    size_t lf = layer_floats(p), total;
    if (lf == 0 || td_mul_overflow(lf, (size_t)p->n_layers * 2u, &total) ||
        td_mul_overflow(total, sizeof(float), &total)) {
        TD_LOG_ERROR("KV pool size overflows (%d layers, %d blocks)", p->n_layers, p->n_blocks);
        return TD_ERR_RANGE;
    }
    td_kv_pool *pool = calloc(1, sizeof *pool);
    if (!pool) {
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    pool->p = *p;
    pool->layer_floats = lf;
    size_t n_words = ((size_t)p->n_blocks + 63) / 64;
    pool->free_bits = calloc(n_words, sizeof(uint64_t));
    pool->refs = calloc((size_t)p->n_blocks, sizeof(int32_t));
    if (!pool->free_bits || !pool->refs) {
        TD_LOG_ERROR("out of memory");
        goto free_pool;
    }
    for (int32_t i = 0; i < p->n_blocks; i++) pool->free_bits[i / 64] |= 1ull << (i % 64);
    pool->n_free = p->n_blocks;
    void *mem = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
        TD_LOG_ERROR("mmap of %zu bytes of KV storage failed: %s", total, strerror(errno));
        goto free_pool;
    }
    pool->storage = mem;
    pool->storage_bytes = total;
    *pool_p = pool;
    return TD_OK;

free_pool:
    free(pool->refs);
    free(pool->free_bits);
    free(pool);
    return TD_ERR_NOMEM;
}

void td_kv_pool_destroy(td_kv_pool *pool) {
    if (!pool) return;
    if (pool->storage) munmap(pool->storage, pool->storage_bytes);
    free(pool->refs);
    free(pool->free_bits);
    free(pool);
}

const td_kv_params *td_kv_pool_params(const td_kv_pool *pool) { return &pool->p; }
int32_t td_kv_pool_n_free(const td_kv_pool *pool) { return pool->n_free; }

static inline bool is_free(const td_kv_pool *pool, int32_t i) {
    return (pool->free_bits[i / 64] >> (i % 64)) & 1u;
}

/* Lowest free id >= from, or -1. */
static int32_t next_free(const td_kv_pool *pool, int32_t from) {
    int32_t nb = pool->p.n_blocks;
    if (from >= nb) return -1;
    size_t w = (size_t)from / 64;
    uint64_t bits = pool->free_bits[w] & (~0ull << (from % 64));
    size_t n_words = ((size_t)nb + 63) / 64;
    for (;;) {
        if (bits) {
            int32_t id = (int32_t)(w * 64 + (size_t)__builtin_ctzll(bits));
            return id < nb ? id : -1;
        }
        if (++w >= n_words) return -1;
        bits = pool->free_bits[w];
    }
}

/* Lowest used id >= from, or n_blocks. */
static int32_t next_used(const td_kv_pool *pool, int32_t from) {
    int32_t nb = pool->p.n_blocks;
    if (from >= nb) return nb;
    size_t w = (size_t)from / 64;
    uint64_t bits = ~pool->free_bits[w] & (~0ull << (from % 64));
    size_t n_words = ((size_t)nb + 63) / 64;
    for (;;) {
        if (bits) {
            int32_t id = (int32_t)(w * 64 + (size_t)__builtin_ctzll(bits));
            return id < nb ? id : nb;
        }
        if (++w >= n_words) return nb;
        bits = ~pool->free_bits[w];
    }
}

static void take(td_kv_pool *pool, int32_t id) {
    pool->free_bits[id / 64] &= ~(1ull << (id % 64));
    pool->refs[id] = 1;
    pool->n_free--;
}

td_status td_kv_block_alloc(td_kv_pool *pool, int32_t n, int32_t *ids) {
    if (n < 0 || (n > 0 && !ids)) return TD_ERR_INVALID;
    if (n == 0) return TD_OK;
    if (n > pool->n_free) return TD_NO_KV_BLOCK;
    /* First fit: the lowest run of n consecutive free ids. */
    int32_t start = next_free(pool, 0);
    while (start >= 0) {
        int32_t end = next_used(pool, start);
        if (end - start >= n) {
            for (int32_t i = 0; i < n; i++) {
                take(pool, start + i);
                ids[i] = start + i;
            }
            return TD_OK;
        }
        start = next_free(pool, end);
    }
    /* No run is long enough: the n lowest free ids (runs stay in order). */
    int32_t id = -1;
    for (int32_t i = 0; i < n; i++) {
        id = next_free(pool, id + 1);
        TD_ASSERT(id >= 0);
        take(pool, id);
        ids[i] = id;
    }
    return TD_OK;
}

void td_kv_block_ref(td_kv_pool *pool, int32_t id) {
    TD_ASSERT(id >= 0 && id < pool->p.n_blocks);
    TD_ASSERT(pool->refs[id] > 0);
    TD_ASSERT(pool->refs[id] < INT32_MAX);
    pool->refs[id]++;
}

void td_kv_block_free(td_kv_pool *pool, const int32_t *ids, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        TD_ASSERT(id >= 0 && id < pool->p.n_blocks);
        TD_ASSERT(pool->refs[id] > 0 && !is_free(pool, id));
        if (--pool->refs[id] == 0) {
            pool->free_bits[id / 64] |= 1ull << (id % 64);
            pool->n_free++;
        }
    }
}

int32_t td_kv_block_refcount(const td_kv_pool *pool, int32_t id) {
    if (id < 0 || id >= pool->p.n_blocks) return 0;
    return pool->refs[id];
}

float *td_kv_layer_k(td_kv_pool *pool, int l) {
    TD_ASSERT(l >= 0 && l < pool->p.n_layers);
    return pool->storage + (size_t)l * 2u * pool->layer_floats;
}

float *td_kv_layer_v(td_kv_pool *pool, int l) {
    TD_ASSERT(l >= 0 && l < pool->p.n_layers);
    return pool->storage + ((size_t)l * 2u + 1u) * pool->layer_floats;
}
