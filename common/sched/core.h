/* The scheduling policy of one instance, apart from the thread, the engine,
 * the sampler and the streams: the waiting queue, admission with KV
 * reservation, the step's batch (decodes first, then prefill chunks under
 * the token budget), preemption by recompute, and the prefix cache's
 * bookkeeping, all over a real td_kv_pool (which holds no KV bytes, only
 * the block accounting). The threaded scheduler (sched.c) runs it with the
 * engine; the cluster simulator (planner/) runs it on a virtual clock with
 * each step's duration from a profile. Both take the same decisions from
 * the same inputs, so a change here changes both.
 *
 * One step, as the caller runs it:
 *   td_sched_core_enqueue (new requests, at the tail) and
 *   td_sched_core_end (cancelled ones) as they come;
 *   td_sched_core_admit;
 *   n = td_sched_core_build_batch: c->batch[0..n) with their chunk set;
 *   run the step; td_sched_core_observe with its forward-pass time; then
 *   for each batch entry in order td_sched_core_computed, and where it
 *   produced a token td_sched_core_append, and where the sequence ended
 *   td_sched_core_end.
 * Not thread-safe: one thread owns a core. */
#ifndef TD_SCHED_CORE_H
#define TD_SCHED_CORE_H

#include <stdbool.h>
#include <stdint.h>

#include "common/kv/hmap.h"
#include "common/kv/kv.h"
#include "sched.h"

/* One sequence as the policy sees it. An owner embeds it (first member, or
 * anywhere with its own container arithmetic). */
typedef struct td_sched_seq {
    struct td_sched_seq *next; /* in the waiting list (the owner's inbox too) */
    int32_t *tokens;           /* (tok_cap) prompt then output */
    int32_t tok_cap;
    int32_t n_prompt, n_tokens;
    int32_t n_computed; /* tokens whose KV is in the cache */
    int32_t max_tokens; /* output tokens at most */
    int32_t *blocks;    /* (blk_cap) block table */
    int32_t blk_cap, n_blocks;
    int32_t n_reserved;      /* blocks still promised to this sequence */
    td_kv_hash *hashes;      /* (blk_cap) chain hashes of its full blocks */
    int32_t n_published;     /* leading blocks published to (or matched in) the prefix cache */
    int32_t n_hash_valid;    /* leading entries of hashes[] computed (tokens never change) */
    int32_t n_pend_end;      /* blocks [n_published, n_pend_end) are in the pending map */
    int32_t n_cached_tokens; /* prompt tokens served by the prefix cache at first admission */
    int32_t n_preemptions;
    uint64_t admit_order;
    int32_t chunk;    /* tokens fed in the current step (0: not in the batch) */
    bool running;     /* admitted (on the running list), else waiting */
    bool remote_wait; /* admitted, waiting for a remote prefill: computes nothing */
    bool local_only;  /* never handed to a remote prefill (threshold or fallback) */
    bool pinned;      /* a peer reads its blocks (export): never preempted */
} td_sched_seq;

typedef struct {
    void *ctx;
    /* q was admitted (its blocks cover the prompt, n_computed the cached
     * prefix). Return true when a remote prefill was started for it: it
     * then waits (remote_wait). NULL: never. */
    bool (*admitted)(void *ctx, td_sched_seq *q);
    /* q was preempted and is back at the head of the queue. NULL: nothing. */
    void (*preempted)(void *ctx, td_sched_seq *q);
} td_sched_core_hooks;

/* What the step times measured so far say, for the TPOT target
 * (td_sched_params.tpot_target_s): a step's forward pass takes
 *   t = a + b n_decode + c n_prompt,  a, b >= 0, c > 0
 * fitted by least squares over the steps run, with exponential forgetting
 * (a step's weight decays by TD_SCHED_EST_DECAY with each later one), so
 * the fit follows the regime the instance runs in now (the context grows,
 * a neighbour takes a core, the budget's own chunk size). The sums of the
 * normal equations, weighted: */
typedef struct {
    double w, sd, sp, st, sdd, spp, sdp, sdt, spt, stt;
} td_sched_step_est;

#define TD_SCHED_EST_DECAY 0.95

typedef struct {
    td_sched_params p;
    td_kv_pool *kv; /* borrowed */
    int32_t block_size;
    td_sched_core_hooks hooks;
    td_sched_seq *waiting;  /* FCFS; preempted sequences go back to the head */
    td_sched_seq **running; /* (p.max_running) in admission order */
    int32_t n_running;
    td_sched_seq **batch; /* (p.max_running) the step's sequences, in running order */
    uint64_t admit_counter, preemptions;
    td_sched_step_est est;
    int32_t step_decodes, step_prompt; /* the last batch's decodes and prompt tokens */
    int32_t max_mixed;                 /* most prompt tokens a step that also decoded has taken */
    /* Hashes of prompt blocks a running sequence is computing now: a
     * request whose next uncached block is among them waits for it to be
     * published instead of computing the same prefix again. */
    td_kv_hmap pending;
} td_sched_core;

/* p is checked by the caller (td_sched_create's rules); kv is borrowed. */
td_status td_sched_core_init(td_sched_core *c, const td_sched_params *p, td_kv_pool *kv,
                             const td_sched_core_hooks *hooks);
void td_sched_core_free(td_sched_core *c); /* the sequences are the owner's */

/* Allocates q's arrays for a prompt of n_prompt tokens (copied) and up to
 * max_tokens outputs, capped by the context (q zeroed first by the caller).
 * TD_ERR_NOMEM. Free with td_sched_seq_free. */
td_status td_sched_seq_init(td_sched_seq *q, const td_sched_core *c, const int32_t *prompt,
                            int32_t n_prompt, int32_t max_tokens);
void td_sched_seq_free(td_sched_seq *q);

int32_t td_sched_core_blocks_for(const td_sched_core *c, int64_t n_tokens);

/* Appends q (or a list through next) to the waiting queue. */
void td_sched_core_enqueue(td_sched_core *c, td_sched_seq *q);
/* Puts q at the head of the waiting queue (a remote fallback's restart). */
void td_sched_core_requeue_head(td_sched_core *c, td_sched_seq *q);
/* Admits waiting sequences first-come first-served while the pool and
 * max_running allow; the head that does not fit blocks the rest. Returns
 * the number admitted. */
int32_t td_sched_core_admit(td_sched_core *c);
/* Builds the step's batch into c->batch (each entry's chunk set, and
 * blocks grown to hold it, preempting the latest admitted when the pool is
 * dry). Returns the number of sequences. */
int32_t td_sched_core_build_batch(td_sched_core *c);
/* After the step the last td_sched_core_build_batch built: its forward
 * pass took dt seconds (the step-time estimate learns from it). */
void td_sched_core_observe(td_sched_core *c, double dt);
/* The estimated forward-pass time of a step with n_decode decodes and
 * n_prompt prompt tokens; < 0 while nothing is known to estimate it. */
double td_sched_core_estimate(const td_sched_core *c, int32_t n_decode, int32_t n_prompt);
/* After the step: q's chunk is computed; its newly full blocks go to the
 * prefix cache. */
void td_sched_core_computed(td_sched_core *c, td_sched_seq *q);
/* True when q's chunk of this step ends at its last token (the step gives
 * it logits: a token follows). */
bool td_sched_core_has_logits(const td_sched_seq *q);
/* Appends an output token to q. */
void td_sched_core_append(td_sched_core *c, td_sched_seq *q, int32_t token);
/* The remote prefill of q (admitted, remote_wait) finished: its prompt is
 * computed and published. */
void td_sched_core_remote_computed(td_sched_core *c, td_sched_seq *q);

/* The remote prefill of q failed: it forgets the prefix blocks it was to
 * publish and is never handed to a peer again (the caller then restarts it
 * or lets it prefill here in the blocks it has, or ends it). */
void td_sched_core_remote_failed(td_sched_core *c, td_sched_seq *q);

/* Index of q on the running list, or -1. */
int32_t td_sched_core_running_index(const td_sched_core *c, const td_sched_seq *q);
/* Takes q off the running or waiting list, where it is (nothing when it
 * is on neither); q->running stays as it was. */
void td_sched_core_unlink(td_sched_core *c, td_sched_seq *q);
/* Lets go of q's KV: its pending prefix entries, its reservation and the
 * blocks still in q->blocks[0..n_blocks) (an owner that keeps them for a
 * peer moves them out first and sets n_blocks to 0). q must be unlinked;
 * it is the caller's to free. */
void td_sched_core_release(td_sched_core *c, td_sched_seq *q);
/* Takes q (running) off the running list for a restart from scratch in
 * fresh blocks (the old ones as td_sched_core_release lets go of them) and
 * puts it at the head of the queue. Not a preemption: nothing counted. */
void td_sched_core_restart(td_sched_core *c, td_sched_seq *q);

/* Prompt tokens admitted or waiting, not yet computed (remote waits not
 * counted: their prefill runs elsewhere). */
int64_t td_sched_core_queued_prefill_tokens(const td_sched_core *c);
int32_t td_sched_core_n_waiting(const td_sched_core *c);

#endif
