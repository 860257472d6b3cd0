/* Executor of one pool instance's parallel plan (DESIGN.md §3): the rank
 * processes, their shards and the step protocol.
 *
 * td_exec_create on the driver (world rank 0, the process that runs the
 * scheduler and the front ends) spawns world - 1 rank processes with
 * posix_spawn of this binary ("tandem rank NAME WORLD RANK PPID") — call it
 * before any UCX or gRPC initialisation, neither is fork-safe. Every rank
 * attaches to one shared-memory world (parallel/comm.h, shm backend), gets
 * the configuration broadcast by the driver, loads its shard (TP slice,
 * its stage's layers, its experts), creates its KV pool (the same block
 * geometry on every rank: the driver's scheduler allocates block ids in
 * rank 0's pool and every rank uses the same ids for its own heads and
 * layers) and its engine, and splits the TP, CP and EP groups. Start-up
 * fails on every rank if any rank fails.
 *
 * Each step: the driver validates the batch, broadcasts it (sequence
 * descriptors, tokens, block tables), and every rank runs its shard.
 * Pipeline stages split the batch into micro-batches of whole sequences so
 * that stage s works on micro-batch i while stage s+1 works on i-1; the
 * hidden states of a micro-batch go from each rank to the rank with the
 * same TP and CP coordinates on the next stage (td_comm_send / recv), and
 * the last stage's (TP 0, CP 0) rank sends the step's logits to the
 * driver. Batch invariance of the engine makes micro-batching exact: a
 * plan of pipeline stages alone gives the single-rank logits bit for bit.
 *
 * Failures: a rank process that exits is seen by the driver's monitor
 * thread at once (pidfd); the world is aborted (every rank's wait returns
 * TD_ERR_IO), the executor is failed for good (td_exec_failed) and every
 * forward returns TD_ERR_IO. A driver that dies takes its ranks with it
 * (PR_SET_PDEATHSIG, which fires when the thread that created the executor
 * exits: create it on a thread that lives as long as the executor). While no step runs the driver
 * sends a keep-alive every timeout / 4 so idle ranks never hit the comm deadline.
 *
 * A world of one runs the engine in-process with no extra thread. */
#ifndef TD_EXEC_H
#define TD_EXEC_H

#include <stdbool.h>

#include "../../kernels/types.h"
#include "../kv/kv.h"
#include "../model/forward.h"
#include "../model/model.h"
#include "comm.h"
#include "plan.h"

typedef struct {
    const char *model_path; /* required */
    td_plan_params plan;    /* validated against the model by td_exec_create */
    /* Limits (the comm fields are set by the executor); engine.max_ctx <= 0:
     * min(n_ctx_train, 4096). */
    td_engine_params engine;
    int32_t block_size; /* KV block size in tokens (> 0) */
    /* KV pool size, the same number of blocks on every rank: kv_blocks if
     * > 0, else as many as kv_memory bytes hold on the rank with the
     * largest blocks, else enough for kv_seqs sequences of max_ctx tokens. */
    int32_t kv_blocks;
    size_t kv_memory;
    int32_t kv_seqs;
    int n_threads; /* per rank; <= 0: online cores / world, at least 1 */
    td_isa isa;    /* the kernel set every rank selects (already selected here) */
    /* The world's communicator (chunk_bytes, timeout_s: every wait's
     * deadline, a step's included; ranks get them on their command line).
     * Default td_comm_default_params(); cancel is the executor's. */
    td_comm_params comm;
    const char *exe; /* binary that has the "rank" command; NULL: /proc/self/exe */
} td_exec_params;

td_exec_params td_exec_default_params(void);

typedef struct td_exec td_exec;

/* Brings the plan up (see above). Logs one line per problem; on failure
 * every spawned rank has exited and nothing is left allocated. Free with
 * td_exec_destroy(), which stops the ranks and waits for them. */
td_status td_exec_create(const td_exec_params *p, td_exec **x_p);
void td_exec_destroy(td_exec *x); /* accepts NULL */

/* A world of one around an engine the caller made (borrowed). */
td_status td_exec_wrap(td_engine *e, td_kv_pool *kv, const td_model *m, td_exec **x_p);

int td_exec_world(const td_exec *x);
/* Rank 0's shard: the configuration (of the whole model) and tokenizer. */
const td_model *td_exec_model(const td_exec *x);
/* Rank 0's KV pool: the allocator of block ids for every rank. */
td_kv_pool *td_exec_kv(td_exec *x);
/* Rank 0's engine. */
td_engine *td_exec_engine(td_exec *x);
int td_exec_threads_per_rank(const td_exec *x);
/* The engine's context limit (tokens per sequence). */
int32_t td_exec_max_ctx(const td_exec *x);
/* td_model_weight_bytes of the whole model, whatever the plan (the same on
 * every instance of a model: part of its KV compatibility hash). */
size_t td_exec_weight_bytes(const td_exec *x);

/* One step over every rank, td_engine_forward's contract (logits of the
 * whole batch on the driver). TD_ERR_INVALID for a batch that breaks the
 * engine's limits (checked here, before any rank sees it); TD_ERR_IO once
 * the ranks have failed. Not thread-safe: one caller at a time. */
td_status td_exec_forward(td_exec *x, const td_seq_chunk *seqs, int32_t n_seqs, float *logits);

/* True once a rank has died or a step failed on the comm. Thread-safe. */
bool td_exec_failed(const td_exec *x);

/* Per-rank time of the last step: communication (inside comm calls,
 * waiting for peers included) and the rest of the step (compute). */
typedef struct {
    double compute_s;
    double comm_s;
} td_rank_time;
/* Copies min(world, cap) entries; returns world. Thread-safe. */
int td_exec_last_times(const td_exec *x, td_rank_time *out, int cap);

/* MoE: tokens routed to each expert in the last step, summed over every
 * layer of every stage (with CP: CP rank 0's rows). Returns the number of
 * counts copied: min(n_expert, cap) — 0 for a dense model, before the
 * first step, and in a world of one when cap < n_expert. Thread-safe with
 * more than one rank; with one, call it from the stepping thread. */
int td_exec_expert_load(const td_exec *x, int64_t *counts, int cap);

/* ---- KV transfer (transfer/xrank.h, transfer/xfer.h) ----
 * td_exec_xfer_setup gives every rank its transfer state (a UCP worker, the
 * KV pool moved into UCX memory, the engine's layer hook; layerwise: puts
 * as each layer is computed, else after the last); rank 0 uses ucx0 (the
 * instance's control channel). td_exec_xfer_endpoint: rank r's
 * endpoint blob for the Exchange. td_exec_forward_slots: a step whose
 * sequences carry their transfer job slots (-1: none). td_exec_xfer_post
 * queues directives for the next step (any thread); td_exec_xfer_sync runs
 * them now in a step of their own (the dropped jobs' puts are flushed on
 * every rank when it returns). td_exec_xfer_failed: a rank could not
 * deliver the job in slot (cleared when a JOB directive reuses the slot).
 * td_exec_xfer_teardown: before ucx0 is destroyed (the pool is unusable
 * afterwards). Not with td_exec_wrap. */
#include "../transfer/xrank.h"
td_status td_exec_xfer_setup(td_exec *x, td_ucx *ucx0, bool layerwise);
td_status td_exec_xfer_endpoint(const td_exec *x, int rank, const uint8_t **blob, size_t *len);
td_xfer_plan td_exec_xfer_plan(const td_exec *x);
td_status td_exec_forward_slots(td_exec *x, const td_seq_chunk *seqs, int32_t n_seqs,
                                const int32_t *slots, float *logits);
void td_exec_xfer_post(td_exec *x, const td_xdir_buf *dirs);
td_status td_exec_xfer_sync(td_exec *x);
bool td_exec_xfer_failed(td_exec *x, int32_t slot);
/* A finished or dropped job whose puts some rank has still in flight (as
 * of the last step): its source blocks and slot stay; D is not answered
 * yet. */
bool td_exec_xfer_busy(td_exec *x, int32_t slot);
/* When the model's last layer of the job's last chunk finished (the latest
 * over the ranks that computed it; CLOCK_REALTIME ns), 0 if unknown. */
uint64_t td_exec_xfer_last_layer_ns(td_exec *x, int32_t slot);
/* A rank closed its endpoints to the decode instance in peer slot (cleared
 * when a PEER directive reuses the slot). */
bool td_exec_xfer_peer_failed(td_exec *x, int32_t peer);
/* Decode side: opens (open) or closes the link workers of slot (one per
 * prefill instance, 0 <= slot < TD_XRANK_MAX_PEERS) on every rank
 * (td_xrank_link). Synchronous: it takes the executor's lock, so it waits
 * for a running step to end, and when a close returns every rank has
 * destroyed its link worker. td_exec_xfer_link_endpoint: rank r's endpoint
 * on an open link, for the Exchange (TD_ERR_INVALID once closed); valid
 * until the next td_exec_xfer_link of that slot, which the caller must not
 * run meanwhile. */
td_status td_exec_xfer_link(td_exec *x, int slot, bool open);
td_status td_exec_xfer_link_endpoint(const td_exec *x, int slot, int rank, const uint8_t **blob,
                                     size_t *len);
void td_exec_xfer_teardown(td_exec *x);

/* Entry point of a spawned rank process: argv = {"rank", NAME, WORLD,
 * RANK, PPID}. Returns the process exit code. */
int td_exec_rank_main(int argc, char **argv);

#endif
