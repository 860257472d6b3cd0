/* The rank side of KV migration (DESIGN.md §3, §4): every rank of a
 * prefill or decode instance owns a UCP worker and its KV pool in memory
 * UCX allocated (so that peers put into it directly); on a prefill
 * instance each rank also puts its own part of every job's KV — its
 * layers, its KV heads, its CP blocks — into the decode ranks that hold
 * it, as the transfer mapping (map.h) routes it, layer by layer as the
 * engine computes them.
 *
 * The driver (world rank 0) steers every rank with directives that travel
 * with the step plan (parallel/exec.h), applied in order on every rank:
 *   PEER  slot, a decode instance's Exchange (packed protobuf, validated by
 *         the driver): its plan, geometry and every rank's endpoint;
 *   JOB   slot, peer slot, prompt length, tokens the decode side already
 *         holds, deadline (the end of the job's lease: no put after it),
 *         the destination block ids (the same on every decode rank);
 *   EXTEND slot, deadline: the decode side renewed the lease (never
 *         earlier than before);
 *   DROP  slot: the job is over; its puts are flushed (or, past the
 *         deadline, have ended after its endpoints were closed); once no
 *         rank reports it busy the driver may free the source blocks;
 *   UNPEER slot: close the endpoints to that decode instance.
 * A job's sequence carries its slot in the step (td_exec_forward_slots);
 * once a rank has put every position of the prompt for all of its layers it
 * flushes the job's endpoints and waits for the flush a little (20 ms at
 * most) before the step ends. A flush still in flight then is reported
 * busy, at that step and every later one until it completes, and the job's
 * deadline closes its endpoints (once flushed: td_ucx_ep_close_flushed,
 * the job busy until its puts end): a slow or unreachable decode
 * instance holds up no other job. So once a step returns on the driver
 * without a job reported busy, every rank has flushed it. A rank that
 * could not deliver (an endpoint error, the deadline) reports the job
 * failed.
 *
 * Not thread-safe: one rank's step thread drives it (the engine's layer
 * hook runs on that thread). */
#ifndef TD_TRANSFER_XRANK_H
#define TD_TRANSFER_XRANK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/base/base.h"
#include "common/engine/forward.h"
#include "common/kv/kv.h"
#include "map.h"
#include "ucx.h"

#define TD_XRANK_MAX_JOBS  256 /* job slots per instance */
#define TD_XRANK_MAX_PEERS 64  /* decode instances known at once */
#define TD_XRANK_BLOB_MAX  8192
#define TD_XRANK_MAX_ENDED 16 /* last-layer stamps reported per step */

enum {
    TD_XDIR_PEER = 1,
    TD_XDIR_JOB = 2,
    TD_XDIR_DROP = 3,
    TD_XDIR_UNPEER = 4,
    TD_XDIR_EXTEND = 5
};

typedef struct {
    td_xfer_plan plan;                    /* this instance's plan */
    int rank;                             /* world rank: (pp_rank * cp + cp_rank) * tp + tp_rank */
    int32_t n_layer, n_head_kv, head_dim; /* of the whole model */
    td_kv_pool *kv;                       /* this rank's pool */
    td_engine *engine;                    /* this rank's: its KV storage is placed in UCX memory */
    td_ucx *ucx;    /* the rank's channel; NULL: td_xrank_create makes its own */
    bool layerwise; /* put each layer as it is computed (default), else every layer
                     * after the prompt's last one (for measurements) */
} td_xrank_params;

typedef struct td_xrank td_xrank;

td_status td_xrank_create(const td_xrank_params *p, td_xrank **xr_p);
/* Closes every endpoint (waiting for the closes) and releases the
 * engine's KV storage if the engine still holds it (td_engine_kv_release:
 * its steps fail from then on; destroy the engine first to avoid that).
 * Accepts NULL. */
void td_xrank_destroy(td_xrank *xr);

/* Decode side: opens (closing any earlier one) or closes the link worker of
 * slot (0 <= slot < TD_XRANK_MAX_PEERS), the worker one prefill instance
 * puts into (td_ucx_link_create). Closing destroys it: nothing that
 * prefill instance still sends over it is applied afterwards. */
td_status td_xrank_link(td_xrank *xr, int slot, bool open);
/* This rank's endpoint for the Exchange: the address of its worker (link
 * < 0) or of an open link worker, and the rkey, base and size of its KV
 * region, framed as u32 addr_len, u32 rkey_len, u64 base, u64 bytes, addr,
 * rkey. */
td_status td_xrank_blob(td_xrank *xr, int link, uint8_t *buf, size_t cap, size_t *len);
/* Parses a blob (from another process: checked). */
td_status td_xrank_blob_parse(const uint8_t *buf, size_t len, const uint8_t **addr,
                              size_t *addr_len, const uint8_t **rkey, size_t *rkey_len,
                              uint64_t *base, uint64_t *bytes);

/* Applies a directive stream (records {u32 type, u32 words, words...},
 * int32 words). TD_ERR_INVALID (logged) for a malformed stream. */
td_status td_xrank_apply(td_xrank *xr, const int32_t *words, size_t n_words);
/* The sequences of the micro-batch the engine runs next and their job
 * slots (-1: none); borrowed until the next call. */
void td_xrank_batch(td_xrank *xr, const td_seq_chunk *seqs, const int32_t *slots, int32_t n);
/* The engine's layer hook (ctx = xr): puts this layer's new rows. */
void td_xrank_layer(void *xr, int32_t layer);
/* What a rank tells the driver after each step (bits per slot). */
typedef struct {
    uint64_t failed[TD_XRANK_MAX_JOBS / 64]; /* jobs it could not deliver */
    uint64_t busy[TD_XRANK_MAX_JOBS / 64];   /* finished or dropped jobs whose puts are
                                              * still in flight: their sources must stay */
    uint64_t peer_failed;                    /* peer slots whose endpoints it closed */
    /* Jobs whose model's last layer this rank computed for the prompt's
     * last chunk in this step, and when it finished (CLOCK_REALTIME, for
     * the exposed transfer tail D measures); at most TD_XRANK_MAX_ENDED a
     * step (the rest go unstamped). */
    int32_t n_ended;
    struct {
        int32_t slot;
        uint64_t unix_ns;
    } ended[TD_XRANK_MAX_ENDED];
} td_xrank_report;
/* After the step's forward pass: flushes the jobs this rank finished and
 * the dropped ones, waits for them a little, checks the ones still in
 * flight from earlier steps (past its deadline a job's peer endpoints are
 * closed once flushed), and ORs its findings into *rep. */
void td_xrank_finish(td_xrank *xr, td_xrank_report *rep);

/* Directive builders (the driver): append to a growing int32 buffer. */
typedef struct {
    int32_t *w;
    size_t n, cap;
    bool oom;
} td_xdir_buf;
void td_xdir_peer(td_xdir_buf *b, int32_t slot, const uint8_t *exchange, size_t len);
void td_xdir_job(td_xdir_buf *b, int32_t slot, int32_t peer, int32_t n_prompt, int32_t d_cached,
                 uint64_t deadline_ns, const int32_t *dest, int32_t n_dest);
void td_xdir_extend(td_xdir_buf *b, int32_t slot, uint64_t deadline_ns);
void td_xdir_drop(td_xdir_buf *b, int32_t slot);
void td_xdir_unpeer(td_xdir_buf *b, int32_t slot);
void td_xdir_free(td_xdir_buf *b);

#endif
