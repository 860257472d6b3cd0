/* Shared by the backends in this directory (not a public header). */
#ifndef TD_BACKEND_IMPL_H
#define TD_BACKEND_IMPL_H

#include "backend.h"

/* A CPU-addressable buffer: the CPU backend's, and the checking backend's
 * (which hands the same kind to the CPU ops it wraps). */
struct td_bbuf {
    void *p;
    size_t bytes;
    /* KV storage (kv_alloc), else scratch the backend allocated: mapped
     * here (map_bytes) unless the hook gave the memory; the hook's release
     * runs with handle when freed */
    bool kv;
    size_t map_bytes;
    td_kv_mem_hook hook;
    void *handle;
};

/* KV storage in host memory (both backends): b's fields set, or an error
 * with nothing held; td_host_kv_free releases it (not b itself). */
td_status td_host_kv_alloc(td_bbuf *b, const td_kv_layout *l, const td_kv_mem_hook *hook);
void td_host_kv_free(td_bbuf *b);

static inline void *td_bview_host(td_bview v) { return (char *)v.b->p + v.off; }

/* The CPU backend's table, for the checking backend to delegate to. */
extern const td_backend_i td_backend_cpu_i;

#endif
