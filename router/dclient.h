/* The router's asynchronous client of the decode instances'
 * tandem.internal.v1.Decode/Generate (proto/internal.proto; gRPC C core +
 * protobuf-c): one completion-queue thread drives every call; one channel
 * per target is created on first use and kept (gRPC reconnects it), with
 * short reconnect back-offs so that a restarted decode instance is reached
 * again within about a second.
 *
 * Calls fail fast: a target that refuses connections ends the call with
 * UNAVAILABLE without waiting for it to come up (no wait-for-ready).
 *
 * Thread-safety: td_rt_dcall_start, td_rt_dcall_cancel and
 * td_rt_dcall_release may be called from any thread; the callbacks run on
 * the client's thread, one at a time per call, and must not block. */
#ifndef TD_ROUTER_DCLIENT_H
#define TD_ROUTER_DCLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/base.h"
#include "proto/tandem.pb-c.h"

typedef struct td_rt_dclient td_rt_dclient;
typedef struct td_rt_dcall td_rt_dcall;

typedef struct {
    /* One response message of the stream, unpacked (valid only during the
     * callback). Return false to cancel the call (the caller found the
     * message malformed or does not want more); on_end follows. */
    bool (*on_response)(void *ctx, const Tandem__V1__GenerateResponse *r);
    /* Exactly once, last, after every on_response: the call's gRPC status
     * (grpc_status_code: 0 OK, 14 UNAVAILABLE, ...) and its details (never
     * NULL; "" when none). A message that cannot be unpacked ends the call
     * with status 13 INTERNAL and details saying so. */
    void (*on_end)(void *ctx, int grpc_status, const char *details);
    void *ctx;
} td_rt_dcall_cb;

/* Starts the completion-queue thread. Free with td_rt_dclient_destroy(),
 * which cancels every call still running, waits for their on_end and
 * joins the thread (so it must not be called from a callback); calls not
 * yet released stay valid for td_rt_dcall_release after it. TD_ERR_NOMEM /
 * TD_ERR_INTERNAL (logged). */
td_status td_rt_dclient_create(td_rt_dclient **c_p);
void td_rt_dclient_destroy(td_rt_dclient *c); /* accepts NULL */

/* Starts one call of Decode/Generate on target ("HOST:PORT" or
 * "[V6]:PORT" of the decode instance's gRPC port) with the packed
 * tandem.internal.v1.InternalGenerate message msg[0..len) (copied).
 * timeout_s > 0 bounds the whole call (DEADLINE_EXCEEDED), 0: none. On
 * TD_OK on_end is guaranteed to be called exactly once, from the client's
 * thread (never from inside this function), and *call_p is the caller's
 * reference, to be given back with td_rt_dcall_release. On failure
 * (TD_ERR_NOMEM, TD_ERR_INVALID for a bad target, TD_ERR_UNAVAILABLE when
 * the client is being destroyed) no callback runs. */
td_status td_rt_dcall_start(td_rt_dclient *c, const char *target, const uint8_t *msg, size_t len,
                            double timeout_s, const td_rt_dcall_cb *cb, td_rt_dcall **call_p);
/* Cancels the call (idempotent; nothing once it ended): on_end follows
 * with CANCELLED unless the call already completed. */
void td_rt_dcall_cancel(td_rt_dcall *call);
/* Gives back the caller's reference (the call is freed once it has ended
 * too). Does not cancel. Accepts NULL. */
void td_rt_dcall_release(td_rt_dcall *call);

/* Drops the cached channel of target (an instance left the cluster or
 * changed address); calls in flight on it go on. */
void td_rt_dclient_forget(td_rt_dclient *c, const char *target);

#endif
