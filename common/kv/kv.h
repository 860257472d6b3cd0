/* Paged KV block pool: fixed blocks of block_size tokens, ref-counted, one
 * allocator for the whole instance (the serving issue adds the prefix cache
 * on top of this same pool).
 *
 * Storage: per layer one K region and one V region, each laid out as
 * (n_blocks, block_size, n_kv_heads, head_dim) floats, so a run of
 * consecutive block ids of one layer is one contiguous range of memory.
 * The allocator prefers contiguous runs (a KV transfer later moves a run
 * in one operation). Not thread-safe: owned by the instance's scheduler thread. */
#ifndef TD_KV_H
#define TD_KV_H

#include "../base/base.h"

typedef struct {
    int n_layers;   /* layers held by this rank (its pipeline stage) */
    int n_kv_heads; /* KV heads held by this rank */
    int head_dim;
    int block_size;   /* tokens per block, default 16 */
    int32_t n_blocks; /* blocks in the pool */
} td_kv_params;

typedef struct td_kv_pool td_kv_pool;

td_kv_params td_kv_default_params(void);
/* Bytes of KV storage one block takes (all layers, K and V). */
size_t td_kv_block_bytes(const td_kv_params *p);

/* Allocates the pool. Free with td_kv_pool_destroy(). */
td_status td_kv_pool_create(const td_kv_params *p, td_kv_pool **pool_p);
void td_kv_pool_destroy(td_kv_pool *pool); /* accepts NULL */

const td_kv_params *td_kv_pool_params(const td_kv_pool *pool);
int32_t td_kv_pool_n_free(const td_kv_pool *pool);

/* Allocates n blocks with refcount 1, all or nothing, into ids[0..n).
 * Returns TD_NO_KV_BLOCK (pool unchanged) if fewer than n are free. */
td_status td_kv_block_alloc(td_kv_pool *pool, int32_t n, int32_t *ids);
/* Adds a reference to a block. */
void td_kv_block_ref(td_kv_pool *pool, int32_t id);
/* Drops one reference to each of ids[0..n); a block whose count reaches
 * zero returns to the free list. */
void td_kv_block_free(td_kv_pool *pool, const int32_t *ids, int32_t n);
int32_t td_kv_block_refcount(const td_kv_pool *pool, int32_t id);

/* Layer l's K / V region: (n_blocks, block_size, n_kv_heads, head_dim). */
float *td_kv_layer_k(td_kv_pool *pool, int l);
float *td_kv_layer_v(td_kv_pool *pool, int l);

#endif
