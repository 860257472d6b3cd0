/* Shared by the backends in this directory (not a public header). */
#ifndef TD_BACKEND_IMPL_H
#define TD_BACKEND_IMPL_H

#include "backend.h"

/* A CPU-addressable buffer: the CPU backend's, and the checking backend's
 * (which hands the same kind to the CPU ops it wraps). */
struct td_bbuf {
    void *p;
    size_t bytes;
    bool owned; /* false: td_backend_wrap of the caller's memory */
};

static inline void *td_bview_host(td_bview v) { return (char *)v.b->p + v.off; }

/* The CPU backend's table, for the checking backend to delegate to. */
extern const td_backend_i td_backend_cpu_i;

#endif
