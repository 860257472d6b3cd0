/* Executor of one pool instance's parallel plan (DESIGN.md §3): the rank
 * processes, their shards and the step protocol.
 *
 * td_exec_create on the driver (world rank 0, the process that runs the
 * scheduler and the front ends) spawns world - 1 rank processes with
 * posix_spawn of this binary ("tandem rank NAME WORLD RANK PPID") — call it
 * before any UCX or gRPC initialisation, neither is fork-safe. Every rank
 * attaches to one shared-memory world (common/comm/comm.h, shm backend), gets
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

#include "common/comm/comm.h"
#include "common/engine/forward.h"
#include "common/kv/kv.h"
#include "common/model/model.h"
#include "kernels/types.h"
#include "plan.h"

typedef struct {
    const char *model_path; /* required */
    td_plan_params plan;    /* validated against the model by td_exec_create */
    /* Limits (the comm fields are set by the executor); engine.max_ctx <= 0:
     * min(n_ctx_train, 4096). */
    td_engine_params engine;
    int32_t block_size; /* KV block size in tokens (> 0) */
    td_dtype kv_dtype;  /* of the K and V elements: F32 (default), F16 or BF16 */
    /* KV pool size, the same number of blocks on every rank: kv_blocks if
     * > 0, else as many as kv_memory bytes hold on the rank with the
     * largest blocks, else enough for kv_seqs sequences of max_ctx tokens. */
    int32_t kv_blocks;
    size_t kv_memory;
    int32_t kv_seqs;
    int n_threads;    /* per rank; <= 0: online cores / world, at least 1 */
    td_isa isa;       /* the kernel set every rank selects (already selected here) */
    bool act_int8;    /* every rank's td_backend_set_act_int8 (default false) */
    bool weight_copy; /* every rank's td_backend_set_weight_copy (default true) */
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

/* ---- Rank extensions ----
 * A layer above the executor runs per-rank state of its own beside each
 * rank's engine without the executor knowing its protocol: the KV
 * transfer registers one (transfer/xext.h), the way td_kv_import and
 * td_kv_export keep the scheduler ignorant of transfer. The executor
 * carries, without reading them:
 *  - a setup and control operations that every rank runs at once, each
 *    rank's reply (at most TD_EXEC_EXT_REPLY_MAX bytes; empty: that rank
 *    failed) gathered into a table on the driver;
 *  - words posted on the driver (td_exec_ext_post, any thread), which
 *    travel with the next step (or in a step of their own, td_exec_ext_sync)
 *    and which every rank applies before that step's forward pass;
 *  - one tag per sequence of a step (td_exec_forward_tagged), handed to
 *    each rank's state with every micro-batch before its engine runs it;
 *  - a report of report_size bytes that each rank fills after every step
 *    and that the driver merges.
 * A rank process gets the ops table from td_exec_rank_main, the driver
 * from td_exec_ext_setup: the same table, compiled into the same binary. */
#define TD_EXEC_EXT_REPLY_MAX  8192
#define TD_EXEC_EXT_REPORT_MAX 512

/* A rank's place in the plan and its shard (borrowed for the executor's
 * life). */
typedef struct {
    int rank, world;
    int tp, cp, pp;
    int32_t stage_begin[TD_PLAN_MAX_PP + 1]; /* first layer of each stage, then n_layer */
    bool attn_dp;
    const td_model *model;
    td_kv_pool *kv;
    td_engine *engine;
} td_exec_rank_info;

typedef struct {
    /* Every rank: creates its state and writes its reply (*len <= cap).
     * ctx: td_exec_ext_setup's on the driver, NULL on the other ranks. */
    td_status (*create)(const td_exec_rank_info *ri, void *ctx, int64_t arg, void **state,
                        uint8_t *reply, size_t cap, size_t *len);
    /* After the rank's engine is destroyed, or at td_exec_ext_teardown
     * (with the engine's layer hook cleared first). */
    void (*destroy)(void *state);
    /* td_exec_ext_control's operation on every rank. */
    td_status (*control)(void *state, int32_t op, int32_t arg, uint8_t *reply, size_t cap,
                         size_t *len);
    /* The posted words, before the step's forward pass (every rank). */
    td_status (*apply)(void *state, const int32_t *words, size_t n_words);
    /* The micro-batch the engine runs next and its sequences' tags (NULL:
     * the step has none). */
    void (*batch)(void *state, const td_seq_chunk *seqs, const int32_t *tags, int32_t n);
    /* After the step: this rank's report (zeroed, report_size bytes). */
    void (*finish)(void *state, void *report);
    size_t report_size; /* <= TD_EXEC_EXT_REPORT_MAX */
    /* Driver, under the executor's lock: the n ranks' reports of a step. */
    void (*merge)(void *ctx, const void *const *reports, int n);
} td_exec_ext_ops;

/* Rank 0's place and shard (a wrapped engine: one stage of every layer). */
td_exec_rank_info td_exec_info(const td_exec *x);
/* Creates every rank's state (ops->create with arg) and gathers their
 * replies into *replies (a new table, NULL when the gather failed; free()
 * it). Once per executor, not with td_exec_wrap. Returns the driver's own
 * failure, else TD_ERR_IO when a rank failed (logged: "rank R could not
 * WHAT"); on failure the driver's state is destroyed at once. */
td_status td_exec_ext_setup(td_exec *x, const td_exec_ext_ops *ops, void *ctx, int64_t arg,
                            const char *what, uint8_t **replies);
/* Runs ops->control(op, arg) on every rank, replies as td_exec_ext_setup.
 * Synchronous: it takes the executor's lock, so it waits for a running
 * step to end. A failed gather fails the executor. */
td_status td_exec_ext_control(td_exec *x, int32_t op, int32_t arg, const char *what,
                              uint8_t **replies);
/* Rank r's reply in a table; NULL when it is empty or r is out of range. */
const uint8_t *td_exec_ext_reply(const td_exec *x, const uint8_t *table, int rank, size_t *len);
/* Queues words for the next step (any thread; dropped, logged, when no
 * memory is left). */
void td_exec_ext_post(td_exec *x, const int32_t *words, size_t n_words);
/* Runs the queued words now in a step of their own. A failure fails the
 * executor (TD_ERR_IO). */
td_status td_exec_ext_sync(td_exec *x);
/* One step whose sequences carry tags (NULL: none); td_exec_forward's
 * contract otherwise. */
td_status td_exec_forward_tagged(td_exec *x, const td_seq_chunk *seqs, int32_t n_seqs,
                                 const int32_t *tags, float *logits);
/* Destroys the driver's state (its engine's layer hook cleared first);
 * the other ranks' go with their shards. */
void td_exec_ext_teardown(td_exec *x);

/* Entry point of a spawned rank process: argv = {"rank", NAME, WORLD,
 * RANK, PPID, CHUNK, TIMEOUT_MS}; ext: the rank extension the driver may
 * set up (NULL: none). Returns the process exit code. */
int td_exec_rank_main(int argc, char **argv, const td_exec_ext_ops *ext);

#endif
