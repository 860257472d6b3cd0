/* The UCX channel of DESIGN.md §4: one UCP context and worker per process
 * (per rank), a progress thread that sleeps on the worker's event fd when
 * idle (the wakeup feature) instead of busy-polling, memory regions mapped
 * once (ucp_mem_map) with their packed rkeys, endpoints created from a
 * peer's worker address with peer error handling, one-sided puts
 * (ucp_put_nbx) range-checked against the peer's registered region, flushes,
 * and control messages as active messages.
 *
 * Shared-memory transports with error handling: UCX 1.13 leaves out its
 * posix and sysv transports on endpoints with peer error handling unless
 * UCX_POSIX_ERROR_HANDLING=y and UCX_SYSV_ERROR_HANDLING=y; td_ucx_env_init
 * (once, in main, before any thread starts) sets both in the process
 * environment unless they are already set (an operator may still turn them
 * off) or UCX_TLS names neither transport. td_ucx_create never touches the
 * environment.
 * Everything else is UCX's own configuration (UCX_TLS, UCX_NET_DEVICES,
 * ...). Over shared memory a dead peer is noticed by UCX's keepalive
 * (UCX_KEEPALIVE_INTERVAL, 20 s by default) or by the next operation that
 * needs it; application deadlines bound every wait.
 *
 * Blobs: td_ucx_address and td_ucx_mem_rkey return UCX's bytes framed with
 * a magic, a length and a 64-bit hash; td_ucx_ep_create and
 * td_ucx_rkey_create reject (TD_ERR_INVALID) anything truncated or
 * corrupted before UCX parses it. They are opaque bytes to the caller.
 *
 * Threads: the worker runs in UCS_THREAD_MODE_MULTI; every function here
 * may be called from any thread except where noted. Callbacks (on_msg,
 * on_error, a completion group's done, a close's closed) run on the progress
 * thread or, for done, on whichever thread completes the group; they must
 * not block; they may call td_ucx_send, td_ucx_put, td_ucx_flush and
 * td_ucx_ops_seal, and nothing that waits.
 *
 * Per-transfer path: td_ucx_put and td_ucx_flush allocate nothing (UCX's
 * own request pool aside); a transfer's completion state lives in a
 * td_ucx_ops the caller embeds in its job. Control messages (td_ucx_send)
 * are copied into a buffer the channel frees on completion. */
#ifndef TD_TRANSFER_UCX_H
#define TD_TRANSFER_UCX_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/base/base.h"

typedef struct td_ucx td_ucx;
typedef struct td_ucx_ep td_ucx_ep;
typedef struct td_ucx_mem td_ucx_mem;
typedef struct td_ucx_rkey td_ucx_rkey;
typedef struct td_ucx_link td_ucx_link;

typedef struct {
    const char *name; /* for log lines, e.g. "prefill rank 0" (copied) */
    /* A control message arrived (active message). data is valid only during
     * the call; the bytes are untrusted (the caller decodes and validates
     * them). NULL: incoming messages are dropped. */
    void (*on_msg)(void *ctx, const uint8_t *data, size_t len);
    /* An endpoint's error callback fired (peer gone, link cut): the
     * endpoint is failed from now on (every put / send on it returns
     * TD_ERR_IO) and must be closed by its owner with td_ucx_ep_close. */
    void (*on_error)(void *ctx, td_ucx_ep *ep, td_status why);
    void *ctx;
    size_t max_msg_bytes; /* larger incoming messages are dropped (logged); 0: 16 MiB */
} td_ucx_params;

/* The process environment UCX needs (above). Not thread-safe (setenv):
 * call it from main before any thread starts. */
void td_ucx_env_init(void);

/* Creates the context, the worker (with wakeup) and the progress thread. */
td_status td_ucx_create(const td_ucx_params *p, td_ucx **u_p);
/* Force-closes every endpoint still open, unmaps every region, stops the
 * progress thread. Not from a callback. Accepts NULL. */
void td_ucx_destroy(td_ucx *u);

/* This worker's address (ucp_worker_get_address), copied into a malloc'd
 * buffer the caller frees. */
td_status td_ucx_address(td_ucx *u, uint8_t **addr_p, size_t *len_p);

/* A link worker: another worker of this channel's context, driven by the
 * same progress thread, whose address a receiver gives to one peer only
 * (a decode instance gives one to each prefill instance it links to).
 * Control messages arriving on it go to on_msg; regions mapped here accept
 * puts arriving on it. td_ucx_link_destroy destroys the worker, which
 * closes every connection peers made to it: once it returns nothing
 * arriving over those connections (TCP puts still in a socket, emulated
 * puts, messages) is applied any more. This is what fences a peer over
 * transports where a put is carried out by the target's worker; puts a
 * peer makes itself into a mapped shared-memory segment are not stopped by
 * it (the sender's own deadline checks bound those). A link takes control
 * messages of up to 64 KiB only (td_ucx_send sends those eagerly; UCX
 * cannot destroy a worker while a rendezvous receive is in flight on it):
 * larger ones are dropped. At most 128 per channel; destroy is
 * synchronous, not from a callback. */
td_status td_ucx_link_create(td_ucx *u, td_ucx_link **l_p);
/* The link worker's address (framed like td_ucx_address). */
td_status td_ucx_link_address(td_ucx_link *l, uint8_t **addr_p, size_t *len_p);
void td_ucx_link_destroy(td_ucx_link *l); /* accepts NULL */

/* Registers [base, base + bytes) for remote access (puts into it) and as a
 * source of puts. Unmap before freeing the memory. */
td_status td_ucx_mem_map(td_ucx *u, void *base, size_t bytes, td_ucx_mem **m_p);
/* Allocates bytes through UCX (ucp_mem_map with UCP_MEM_MAP_ALLOCATE: a
 * System V or POSIX shared-memory segment when UCX can make one, else
 * ordinary pages) and registers them like td_ucx_mem_map. Use it for
 * regions that peers put into: with peer error handling UCX 1.13 does not
 * use CMA, so puts into registered ordinary memory of another process on
 * this host are emulated with active messages (the target's worker copies
 * every byte, ~3 GB/s here), while puts into a UCX-allocated segment are
 * one memcpy into the mapped segment (~25 GB/s, what ucx_perftest
 * measures, since it allocates this way). td_ucx_mem_base gives the
 * address (page-aligned, zero-filled is not promised); td_ucx_mem_unmap
 * frees it. */
td_status td_ucx_mem_alloc(td_ucx *u, size_t bytes, td_ucx_mem **m_p);
void *td_ucx_mem_base(const td_ucx_mem *m); /* NULL for NULL */
/* The packed rkey of the region (ucp_rkey_pack), malloc'd copy. */
td_status td_ucx_mem_rkey(td_ucx_mem *m, uint8_t **rkey_p, size_t *len_p);
void td_ucx_mem_unmap(td_ucx_mem *m); /* accepts NULL */

/* An endpoint to the worker whose address is addr (bytes from a peer,
 * untrusted: a malformed address is TD_ERR_INVALID, logged). user is the
 * caller's pointer, returned by td_ucx_ep_user. */
td_status td_ucx_ep_create(td_ucx *u, const uint8_t *addr, size_t len, void *user,
                           td_ucx_ep **ep_p);
void *td_ucx_ep_user(const td_ucx_ep *ep);
bool td_ucx_ep_failed(const td_ucx_ep *ep);
/* The transports UCX selected for this endpoint (its lanes), one line,
 * for logs and benchmarks. */
void td_ucx_ep_transports(td_ucx_ep *ep, char *buf, size_t len);

/* Force-closes the endpoint (UCP_EP_CLOSE_FLAG_FORCE): outstanding
 * operations complete with an error, and once the close has completed no
 * operation posted on it can touch local or remote memory any more (the
 * fencing step of DESIGN.md §2). closed(ctx) runs once, when the close has
 * completed (NULL: no notification). The handle is invalid after the call.
 * Accepts NULL (closed is then called at once). */
void td_ucx_ep_close(td_ucx_ep *ep, void (*closed)(void *ctx), void *ctx);
/* Closes the endpoint once what was posted on it has gone: flushes it, and
 * force-closes it (as td_ucx_ep_close, no notification) when the flush has
 * completed or failed, or after force_after_ms at the latest. Its
 * operations in flight complete when the transport is done with them:
 * delivered, or failed once it learns the peer is gone (a reset, UCX's
 * keepalive), not at the call. The handle is invalid after the call.
 * Accepts NULL. For endpoints whose peer may be unreachable with data of
 * ours still queued in the socket: UCX 1.13 can crash in its TCP progress
 * when a force-closed endpoint still has data to send and the connection
 * then resets (its read handler frees the connection, and the same event's
 * write half then runs on the freed memory), which a relink after a cut
 * does; PyPI's UCX 1.22 crashed in the same scenario too. */
void td_ucx_ep_close_flushed(td_ucx_ep *ep, int force_after_ms);
/* What the prefill side gives a flushed close: a cut link that comes back
 * within it resets the connection (the decode side fenced) or delivers. */
#define TD_UCX_CLOSE_FORCE_MS 30000
/* The same, waiting up to timeout_ms for the completion. TD_ERR_TIMEOUT
 * (logged) if it did not complete in time. Not from a callback. */
td_status td_ucx_ep_close_wait(td_ucx_ep *ep, int timeout_ms);

/* A peer region for puts through ep: the peer's packed rkey and the
 * region [remote_base, remote_base + remote_bytes) it covers, both from the
 * wire (a bad rkey is TD_ERR_INVALID, logged). Destroy before closing ep. */
td_status td_ucx_rkey_create(td_ucx_ep *ep, const uint8_t *rkey, size_t len, uint64_t remote_base,
                             uint64_t remote_bytes, td_ucx_rkey **rk_p);
void td_ucx_rkey_destroy(td_ucx_rkey *rk); /* accepts NULL */

/* A completion group: the operations of one transfer. Embed it in the
 * job; no allocation. done(ops, status) is called exactly once, after
 * td_ucx_ops_seal and every operation added before it has completed;
 * status is TD_OK or the first error (TD_ERR_IO: peer error, endpoint
 * closed). ops->ctx is the caller's. */
typedef struct td_ucx_ops {
    atomic_int pending; /* operations in flight, plus 1 until sealed */
    atomic_int status;  /* first error (td_status), TD_OK */
    void (*done)(struct td_ucx_ops *ops, td_status status);
    void *ctx;
    struct td_ucx *u; /* private: the channel of its operations (set by the first) */
} td_ucx_ops;
void td_ucx_ops_init(td_ucx_ops *ops, void (*done)(td_ucx_ops *, td_status), void *ctx);
/* No more operations will be added to the group. */
void td_ucx_ops_seal(td_ucx_ops *ops);

/* Puts len bytes from local (inside a region this process mapped) to
 * offset remote_off of rk's region. TD_ERR_RANGE (logged, nothing posted)
 * when [remote_off, remote_off + len) is not inside the region;
 * TD_ERR_IO when the endpoint failed. The local bytes must stay unchanged
 * until ops completes. */
td_status td_ucx_put(td_ucx_ep *ep, td_ucx_rkey *rk, const void *local, size_t len,
                     uint64_t remote_off, td_ucx_ops *ops);
/* Adds a flush of ep to the group: it completes once every put posted on
 * ep before it is complete at the peer. */
td_status td_ucx_flush(td_ucx_ep *ep, td_ucx_ops *ops);

/* Sends a control message (active message, copied; asynchronous).
 * TD_ERR_IO when the endpoint failed. */
td_status td_ucx_send(td_ucx_ep *ep, const void *data, size_t len);

typedef struct {
    uint64_t put_bytes, puts, msgs_sent, msgs_received, msgs_dropped, ep_errors;
} td_ucx_stats;
void td_ucx_stats_get(td_ucx *u, td_ucx_stats *st);

#endif
