/* Paged KV block pool: fixed blocks of block_size tokens, ref-counted, one
 * allocator for the whole instance, with a prefix cache on the same blocks.
 *
 * The pool is the accounting only. The K/V bytes are the compute
 * backend's storage (the engine allocates it, td_engine_kv_storage
 * describes it), laid out as td_kv_layout says: per layer one K region and
 * one V region of n_blocks blocks, so a run of consecutive block ids of one
 * layer is one contiguous range of memory. The allocator prefers
 * contiguous runs (a KV transfer later moves a run in one operation). Not
 * thread-safe: owned by the instance's scheduler thread. */
#ifndef TD_KV_H
#define TD_KV_H

#include <stdbool.h>

#include "common/base/base.h"
#include "events.h"
#include "hash.h"
#include "kernels/dtype.h"

typedef struct {
    int n_layers;   /* layers held by this rank (its pipeline stage) */
    int n_kv_heads; /* KV heads held by this rank */
    int head_dim;
    int block_size;          /* tokens per block, default 16 */
    int32_t n_blocks;        /* blocks in the pool */
    uint32_t event_capacity; /* KV events kept for the router (default 65536) */
    uint64_t epoch;          /* this run's id in the event log; 0 (default): random */
    td_dtype dtype;          /* of the K and V elements (default TD_TYPE_F32) */
} td_kv_params;

/* Where the K and V bytes of a rank's pool lie in its storage: layer l's K
 * region at 2 l x layer_bytes, its V region right after; block b of a
 * region at b x block_bytes; token t of a block at t x row_bytes; a row is
 * the rank's KV heads in order, head_dim elements each. Sizes are what the
 * transfer code computes with (never the size of a C type). */
typedef struct {
    td_dtype dtype;
    size_t elem_bytes;  /* one element of K or V */
    size_t row_bytes;   /* one token of one layer's K (or V) */
    size_t block_bytes; /* one block of one layer's K (or V): block_size rows */
    size_t layer_bytes; /* one layer's K (or V) region: n_blocks blocks */
    size_t bytes;       /* the whole storage: n_layers x 2 regions */
} td_kv_layout;

/* The dense layout above with rows packed (the CPU backend's, and the one
 * the transfer protocol assumes of a peer). TD_ERR_UNSUPPORTED for a dtype
 * that is not F32, F16 or BF16; TD_ERR_RANGE when a size overflows. */
td_status td_kv_layout_dense(const td_kv_params *p, td_kv_layout *l);
/* Bytes of one K or V element of type t (a GGUF type id, checked): 4, 2,
 * or 0 for an id KV storage does not hold. */
size_t td_kv_elem_bytes(uint32_t t);
/* The KV dtype named "f32", "f16" or "bf16" (--kv-dtype); false for any
 * other name, *t unchanged. */
bool td_kv_dtype_parse(const char *name, td_dtype *t);
/* --kv-dtype's help, naming the default (td_runtime_params.kv_dtype). */
#define TD_KV_DTYPE_HELP                                                                           \
    "KV cache element type: f16, bf16, f32 (default: f16 on the\nCPU, f32 on a GPU)"

/* How KV storage gets memory the network can reach (filled by the
 * transfer layer, called by the backend's KV allocator). Either alloc
 * gives the backend its memory, or the backend allocates and reg
 * registers it; release undoes either, with the handle they returned,
 * when the storage is freed. A NULL hook: the backend's own memory. */
typedef struct {
    void *(*alloc)(void *ctx, size_t bytes, void **handle); /* NULL on failure */
    td_status (*reg)(void *ctx, void *mem, size_t bytes, void **handle);
    void (*release)(void *ctx, void *handle);
    void *ctx;
} td_kv_mem_hook;

/* A rank's KV storage as the network sees it: its layout and the address
 * (host or device) a peer's puts target. */
typedef struct {
    td_kv_layout layout;
    void *base;
} td_kv_storage;

typedef struct td_kv_pool td_kv_pool;

td_kv_params td_kv_default_params(void);
/* Bytes of KV storage one block takes (all layers, K and V, the dense
 * layout); 0 for bad params. */
size_t td_kv_block_bytes(const td_kv_params *p);

/* Allocates the pool. Free with td_kv_pool_destroy(). */
td_status td_kv_pool_create(const td_kv_params *p, td_kv_pool **pool_p);
void td_kv_pool_destroy(td_kv_pool *pool); /* accepts NULL */

const td_kv_params *td_kv_pool_params(const td_kv_pool *pool);
/* Blocks an allocation can take now: empty blocks plus cached blocks nobody
 * references (evictable), minus the reservations. */
int32_t td_kv_pool_n_free(const td_kv_pool *pool);

/* Block accounting. Every block is exactly one of: empty (no data, no
 * hash), cached (refcount 0, holds a hashed full block, evictable, on the
 * LRU list) or used (refcount > 0, hashed or not). Reservations are a
 * count of blocks promised to admitted sequences but not yet allocated.
 * Idle means used == 0 and reserved == 0. */
typedef struct {
    int32_t total;
    int32_t empty;
    int32_t cached;           /* unreferenced, evictable */
    int32_t used;             /* refcount > 0 */
    int32_t hashed;           /* blocks with a hash in the prefix cache (used or cached) */
    int32_t reserved;         /* promised, not yet allocated */
    int32_t largest_free_run; /* longest run of consecutive allocatable (empty or cached) ids */
    double fragmentation;     /* 1 - largest_free_run / (empty + cached); 0 when none free */
    uint64_t evictions;       /* cached blocks evicted since create */
} td_kv_counts;
void td_kv_pool_counts(const td_kv_pool *pool, td_kv_counts *c);

/* The event log the pool appends to (stored / removed hashes); owned by
 * the pool, thread-safe to read (see events.h). */
td_kv_events *td_kv_pool_events(td_kv_pool *pool);

/* Reservations: td_kv_reserve promises n blocks to a caller (TD_NO_KV_BLOCK
 * and nothing changes if fewer than n are free, reservations counted);
 * td_kv_unreserve returns a promise that will not be used. A reserved
 * allocation (td_kv_block_alloc_reserved) consumes the promise. */
td_status td_kv_reserve(td_kv_pool *pool, int32_t n);
void td_kv_unreserve(td_kv_pool *pool, int32_t n);

/* Allocates n blocks with refcount 1, all or nothing, into ids[0..n).
 * Prefers empty blocks (lowest run of n consecutive ids, else the lowest
 * ids); when empty blocks run out it evicts cached blocks, least recently
 * used first (each eviction logs a "removed" event). Returns TD_NO_KV_BLOCK
 * (pool unchanged) if fewer than n are free (reservations counted). */
td_status td_kv_block_alloc(td_kv_pool *pool, int32_t n, int32_t *ids);
/* The same, taking n blocks from the caller's reservation (the caller must
 * hold n reserved); never fails for lack of blocks. */
td_status td_kv_block_alloc_reserved(td_kv_pool *pool, int32_t n, int32_t *ids);
/* Adds a reference to a used block. */
void td_kv_block_ref(td_kv_pool *pool, int32_t id);
/* Drops one reference to each of ids[0..n). A block whose count reaches
 * zero becomes cached (MRU end of the LRU list) if it has a hash, else
 * empty. Ids are released in reverse order so a sequence's tail blocks are
 * evicted before its head (the head is the more shared prefix). */
void td_kv_block_free(td_kv_pool *pool, const int32_t *ids, int32_t n);
int32_t td_kv_block_refcount(const td_kv_pool *pool, int32_t id);

/* Prefix cache. A block may be published once it is full (its block_size
 * tokens written): td_kv_cache_insert gives used block `id` the hash h and
 * logs a "stored" event. If another block already holds h, nothing changes
 * and false is returned (the caller's block stays unhashed and becomes
 * empty when freed). A block keeps its hash until evicted. */
bool td_kv_cache_insert(td_kv_pool *pool, int32_t id, td_kv_hash h);
/* Longest cached prefix: walks hashes[0..n) in order and stops at the first
 * miss; for each hit takes a reference (a cached block becomes used and
 * leaves the LRU list) and writes its id to ids[]. Returns the number of
 * leading hits. Taking a cached block uses up free capacity that
 * reservations count on: callers holding reservations check that
 * td_kv_pool_n_free stays >= 0 (as the scheduler does at admission). */
int32_t td_kv_cache_acquire(td_kv_pool *pool, const td_kv_hash *hashes, int32_t n, int32_t *ids);
/* Leading hits without taking anything (for routing and admission checks). */
int32_t td_kv_cache_probe(const td_kv_pool *pool, const td_kv_hash *hashes, int32_t n);
/* Drops every cached (unreferenced) block: they become empty, with
 * "removed" events. Used blocks keep their hashes. */
void td_kv_cache_clear(td_kv_pool *pool);

#endif
