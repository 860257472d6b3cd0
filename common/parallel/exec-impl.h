/* What the executor's files share (exec.h is the contract):
 *   exec.c       the executor's lifetime on the driver and in a rank
 *                process: the configuration, each rank's shard (model
 *                slice, KV pool, engine, communicators), sizing
 *   exec-proc.c  supervision of the rank processes: spawning them, the
 *                monitor that fails the instance when one dies, the
 *                keep-alives, stale segments, reaping
 *   exec-step.c  the step protocol: the driver packs and broadcasts a step,
 *                every rank runs its micro-batches and reports; the rank
 *                extension's setup, control and directives ride on it */
#ifndef TD_PARALLEL_EXEC_IMPL_H
#define TD_PARALLEL_EXEC_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <sys/types.h>

#include "common/base/threadpool.h"
#include "exec.h"

#define CFG_MAGIC 0x31474643584554ull /* "TEXCFG1" */
#define MAX_PATH  4096

enum { OP_STEP = 1, OP_NOOP = 2, OP_STOP = 3, OP_EXT_SETUP = 4, OP_EXT = 5, OP_EXT_CONTROL = 6 };

/* What the driver broadcasts once after attaching. Plain data only. */
typedef struct {
    uint64_t magic;
    char model_path[MAX_PATH];
    td_plan_params plan; /* ep resolved by td_plan_create */
    int32_t stage_begin[TD_PLAN_MAX_PP + 1];
    int32_t max_batch_tokens, max_seqs, max_ctx;
    int32_t block_size, n_blocks;
    int32_t kv_dtype; /* td_dtype */
    int32_t n_threads;
    int32_t isa;
    int32_t act_int8, weight_copy; /* the CPU backend's process-wide choices */
    uint64_t weight_bytes;         /* of the whole model */
} exec_config;

/* Step header; the payload follows in a second broadcast: per sequence
 * {n_tokens, pos0, n_blocks, flags}, then every token, then every block id,
 * then (has_tags) every sequence's rank-extension tag, then n_ext_words
 * of rank-extension words (exec.h). OP_EXT carries those words only.
 * OP_EXT_SETUP (argument n_seqs) and OP_EXT_CONTROL (operation n_seqs,
 * argument n_tokens) have no payload. */
typedef struct {
    int32_t op;
    int32_t n_seqs;
    int32_t n_tokens;
    int32_t n_block_ids;
    int32_t has_tags;
    int32_t n_ext_words;
} step_hdr;

enum { SEQ_LOGITS_ALL = 1, SEQ_NO_LOGITS = 2 };

/* Per-rank figures gathered on the driver after each step. */
typedef struct {
    double compute_s, comm_s;
    int32_t status;
    int32_t pad;
    uint8_t ext[TD_EXEC_EXT_REPORT_MAX]; /* the rank extension's report */
} rank_report;

struct td_exec {
    /* this rank */
    int world, rank;
    int tp, cp, pp;
    int tp_rank, cp_rank, pp_rank;
    exec_config cfg;
    td_threadpool *pool;
    td_model *model;
    td_kv_pool *kv;
    td_engine *engine;
    bool wrapped; /* td_exec_wrap: engine, kv and model are borrowed */
    /* The control channel: the driver's world (start-up, the step and its
     * directives, the reports, keep-alives); always a CPU backend. */
    td_comm *ctl;
    /* The data world and the groups split from it: what the forward pass
     * reduces and exchanges activations on (TP, CP, EP; PP neighbours over
     * data itself). Split from ctl today; a device backend would make it
     * its own. */
    td_comm *data;
    td_comm *tp_comm, *cp_comm, *ep_comm;
    int32_t n_vocab, n_embd;
    int32_t n_expert;      /* MoE: routed experts; 0 for dense models */
    int64_t *expert_step;  /* (n_expert) this rank's counts of the step, all micro-batches */
    int64_t *expert_tmp;   /* (n_expert) one micro-batch's */
    int64_t *expert_pub;   /* (n_expert) driver: the model's counts of the last step (times_mu) */
    float *expert_sum;     /* (n_expert) reduction buffer */
    bool have_expert_load; /* driver: expert_counts hold a step's totals */
    /* step scratch */
    int32_t *payload;
    size_t payload_cap; /* int32 elements */
    td_seq_chunk *chunks;
    float *x_in, *x_out;
    float *logits; /* last stage, not the driver: (rows, n_vocab) */
    size_t logits_cap;
    double comm_s; /* of the step in progress (p2p and the step's collectives) */
    /* driver only */
    pid_t *pids; /* (world) 0 for rank 0 */
    int *pidfds; /* (world) -1 for rank 0 */
    int stop_fd[2];
    pthread_t monitor, keepalive;
    bool monitor_started, keepalive_started;
    pthread_mutex_t mu; /* one user of the world at a time: steps, keep-alives */
    pthread_cond_t cv;
    atomic_bool stopping; /* written under mu, read by the monitor without it */
    double last_use;
    atomic_bool failed;
    _Atomic int cancel;     /* set by the monitor: rank 0's waits fail (td_comm_params.cancel) */
    atomic_bool comm_ready; /* x->ctl exists: the monitor may abort it (and data with it) */
    td_comm_params comm_params;
    pthread_mutex_t times_mu;
    td_rank_time *times; /* (world) */
    rank_report *reports;
    /* the rank extension (exec.h) */
    const td_exec_ext_ops *ext; /* this process's table; NULL: none */
    void *ext_state;            /* this rank's; NULL until td_exec_ext_setup */
    void *ext_ctx;              /* driver: td_exec_ext_setup's */
    const int32_t *tags;        /* the step's sequence tags (payload), or NULL */
    pthread_mutex_t ext_mu;     /* driver: the queued words */
    int32_t *pending;           /* driver: words for the next step */
    size_t n_pending, pending_cap;
};

/* ---- exec.c */

/* The world rank of plan coordinates. */
int td_exec_world_rank_of(const td_exec *x, int tp_rank, int cp_rank, int pp_rank);

/* ---- exec-proc.c: the driver's supervision of its rank processes */

/* Starts ranks 1.. (exe: the binary; NULL: this one) on the segment name;
 * their pids and pidfds in x. The failure is logged. */
td_status td_exec_proc_spawn(td_exec *x, const char *exe, const char *name);
/* The monitor thread (arg: x): a rank that exits fails the instance. */
void *td_exec_proc_monitor(void *arg);
/* The keep-alive thread (arg: x): a no-op step when the world was idle for
 * a quarter of the comm timeout. */
void *td_exec_proc_keepalive(void *arg);
/* Stops the monitor thread (idempotent): after this only the caller
 * waits for the rank processes. */
void td_exec_proc_stop_monitor(td_exec *x);
/* Stops (or kills, after a grace period) and reaps every spawned rank. */
void td_exec_proc_reap(td_exec *x, bool graceful);
/* A driver killed before every rank attached leaves its segment in
 * /dev/shm (it is unlinked only once all have attached): remove those whose
 * driver is gone. Names are /tandem-exec-PID-N. */
void td_exec_proc_remove_stale(double max_wait_s);

/* ---- exec-step.c: the step protocol */

/* Broadcasts a step header on the control channel (under x->mu). */
td_status td_exec_step_broadcast_hdr(td_exec *x, step_hdr *h);
/* A rank process's loop: steps until OP_STOP or a failure; its exit code. */
int td_exec_step_worker_loop(td_exec *x);

#endif
