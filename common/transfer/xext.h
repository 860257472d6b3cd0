/* The KV transfer as the executor's rank extension (parallel/exec.h): the
 * ops every rank runs (a td_xrank beside its engine, xrank.h) and the
 * driver's side of them — the directives queued for the next step, the
 * ranks' reports merged into per-job state, the tables of every rank's
 * endpoints. The executor carries all of it without knowing the protocol.
 *
 * Thread-safety: td_xext_post and the queries may run on any thread; setup,
 * link, sync and destroy on the thread that owns the instance's transfer
 * service. */
#ifndef TD_TRANSFER_XEXT_H
#define TD_TRANSFER_XEXT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/parallel/exec.h"
#include "map.h"
#include "ucx.h"
#include "xrank.h"

/* The table every binary that spawns ranks hands to td_exec_rank_main. */
extern const td_exec_ext_ops td_xext_ops;

typedef struct td_xext td_xext;

/* Gives every rank its transfer state (a UCP worker, the KV storage moved
 * into UCX memory, the engine's layer hook; layerwise: puts as each layer is
 * computed, else after the last); rank 0 uses ucx0 (the instance's control
 * channel). Not with td_exec_wrap. */
td_status td_xext_setup(td_exec *x, td_ucx *ucx0, bool layerwise, td_xext **xe_p);
/* Before ucx0 is destroyed (the pool is unusable afterwards). Accepts
 * NULL. */
void td_xext_destroy(td_xext *xe);

/* This instance's plan as the transfer mapping sees it. */
td_xfer_plan td_xext_plan(const td_exec *x);
/* Rank r's endpoint blob for the Exchange (td_xrank_blob). */
td_status td_xext_endpoint(const td_xext *xe, int rank, const uint8_t **blob, size_t *len);
/* Decode side: opens (open) or closes the link workers of slot (one per
 * prefill instance, 0 <= slot < TD_XRANK_MAX_PEERS) on every rank
 * (td_xrank_link). Synchronous: it waits for a running step to end, and
 * when a close returns every rank has destroyed its link worker.
 * td_xext_link_endpoint: rank r's endpoint on an open link, for the
 * Exchange (TD_ERR_INVALID once closed); valid until the next td_xext_link
 * of that slot, which the caller must not run meanwhile. */
td_status td_xext_link(td_xext *xe, int slot, bool open);
td_status td_xext_link_endpoint(const td_xext *xe, int slot, int rank, const uint8_t **blob,
                                size_t *len);

/* Queues directives for the next step (any thread). td_xext_sync runs them
 * now in a step of their own (the dropped jobs' puts are flushed on every
 * rank when it returns). */
void td_xext_post(td_xext *xe, const td_xdir_buf *dirs);
td_status td_xext_sync(td_xext *xe);

/* A rank could not deliver the job in slot (cleared when a JOB directive
 * reuses the slot). */
bool td_xext_failed(td_xext *xe, int32_t slot);
/* A finished or dropped job whose puts some rank has still in flight (as
 * of the last step): its source blocks and slot stay; D is not answered
 * yet. */
bool td_xext_busy(td_xext *xe, int32_t slot);
/* When the model's last layer of the job's last chunk finished (the latest
 * over the ranks that computed it; CLOCK_REALTIME ns), 0 if unknown. */
uint64_t td_xext_last_layer_ns(td_xext *xe, int32_t slot);
/* A rank closed its endpoints to the decode instance in peer slot (cleared
 * when a PEER directive reuses the slot). */
bool td_xext_peer_failed(td_xext *xe, int32_t peer);

#endif
