/* The forward pass: one call runs a batch of sequences of different lengths
 * that mixes prefill chunks and single decode tokens, over the paged KV cache.
 *
 * For each sequence the chunk's K/V are written into its blocks first, then
 * attention reads K/V for positions [0, pos0 + n_tokens) back from the cache
 * (never from the chunk's in-flight values), so a sequence's logits are
 * bit-identical whatever the batch composition, the chunk boundaries, a
 * prefix-cache hit, a recompute, or the thread count.
 *
 * Not thread-safe: one caller (the instance's scheduler thread) at a time. */
#ifndef TD_FORWARD_H
#define TD_FORWARD_H

#include <stdbool.h>

#include "common/backend/backend.h"
#include "common/base/threadpool.h"
#include "common/comm/comm.h"
#include "common/kv/kv.h"
#include "common/model/model.h"

/* How CP ranks share a prompt's K/V (the plan's --cp-mode). */
typedef enum {
    TD_CP_ALLGATHER = 0, /* every CP rank all-gathers the prompt's K/V per layer */
    TD_CP_RING = 1,      /* K/V chunks pass around the ring, online-softmax accumulation */
} td_cp_mode;

typedef struct {
    const int32_t *tokens;      /* (n_tokens) ids of this chunk */
    int32_t n_tokens;           /* >= 1 */
    int32_t pos0;               /* position of tokens[0]; KV of [0, pos0) is already cached */
    const int32_t *block_table; /* block ids covering positions [0, pos0 + n_tokens) */
    int32_t n_blocks;
    bool logits_all; /* logits for every token of the chunk, else the last only */
    bool no_logits;  /* no logits at all (a non-final prefill chunk) */
} td_seq_chunk;

typedef struct td_engine td_engine;

typedef struct {
    int32_t max_batch_tokens; /* most tokens one forward call may carry (default 2048) */
    int32_t max_seqs;         /* most sequences per call (default 256) */
    int32_t max_ctx;          /* longest sequence; 0 (default): min(n_ctx_train, 8192) */
    /* Context parallelism (borrowed; NULL: none). Every rank of the CP group
     * gets the same batch; KV block j of a sequence lives on CP rank
     * j % cp (the others never write or read it); prefill chunks of at least
     * cp_min_tokens tokens are split by block owner (PCP, K/V exchanged per
     * cp_mode), other rows are computed by every CP rank with attention
     * partials over each rank's positions merged (DCP). */
    td_comm *cp_comm;
    int cp_mode;           /* td_cp_mode */
    int32_t cp_min_tokens; /* default 256 */
    /* Expert parallelism for MoE models (borrowed; NULL: every expert of
     * the model shard is local). The group's ranks hold disjoint experts
     * (td_model_params.ep_rank / ep_size); tokens go to their experts'
     * ranks and back with all-to-all. Its size and rank must equal the
     * shard's ep_size / ep_rank (TD_ERR_INVALID otherwise). With a TP comm
     * of size > 1 the EP group is a run of consecutive TP ranks (tp a
     * multiple of ep, TP rank % ep == EP rank); with a TP comm of size 1
     * every EP rank loads the whole attention and gets the same batch.
     * Either way the ranks holding the same rows (the TP group, else the
     * EP group) split them, each row routed and dispatched once, and
     * every rank ends with the full FFN output. Numerics: with TP 1 the
     * logits are bit-identical to the single-rank engine (each row's experts
     * are whole and added in its selection order; the other ranks add
     * zeros); with TP they match the TP-only run's tolerance (the shared
     * expert and attention are TP-split). */
    td_comm *ep_comm;
    /* Attention data-parallel over the EP group (needs ep_comm of size >= 2,
     * a TP comm of size 1, a shard loaded with tp_size 1 and no CP): every
     * rank gets the whole batch and computes each sequence on EP rank
     * block_table[0] % ep — the same rank for the sequence's whole life,
     * whatever its place in the batch, and the same for sequences sharing
     * cached prefix blocks — (embedding, whole attention, KV writes for its
     * own sequences only;
     * td_engine_stage_rows counts their tokens); the MoE all-to-all mixes the
     * rows of all ranks; the logit rows' hidden states go to EP rank 0,
     * which alone writes the logits. Bit-identical to the single-rank engine
     * (no row's value depends on another rank's sums). */
    bool attn_dp;
    /* Layer-wise KV streaming (disaggregation): called on the
     * forward thread after layer `layer` (the pool's local index) has
     * written its K/V for every sequence of the batch and before the next
     * layer starts (NULL: none). */
    void (*layer_done)(void *ctx, int32_t layer);
    void *layer_done_ctx;
    /* Compute backend (borrowed; NULL: the engine creates one of
     * backend_kind over its thread pool and destroys it with itself). */
    td_backend *backend;
    int backend_kind;   /* td_backend_kind; default: td_backend_kind_from_env() */
    int backend_device; /* its GPU (CUDA); default: td_backend_device_from_env() */
} td_engine_params;

td_engine_params td_engine_default_params(void);
/* Sets (or with fn NULL clears) the layer_done hook of a created engine. */
void td_engine_set_layer_hook(td_engine *e, void (*fn)(void *ctx, int32_t layer), void *ctx);

/* The KV storage. The engine allocates it through its backend at create,
 * in the layout the backend keeps the pool's params in (kv.h).
 * td_engine_kv_storage describes it: the layout and the address a peer's
 * puts target. td_engine_kv_place moves it into memory the hook provides
 * or registers (NULL hook: the backend's own), only while the pool holds
 * no data (nothing used or cached: TD_ERR_INVALID otherwise); on failure
 * the old storage stays. td_engine_kv_release frees it now (the hook's
 * owner is going away); every later step fails until the next place. */
td_status td_engine_kv_storage(td_engine *e, td_kv_storage *out);
td_status td_engine_kv_place(td_engine *e, const td_kv_mem_hook *hook);
void td_engine_kv_release(td_engine *e);

/* The engine borrows m, kv, tp and comm (they must outlive it) and allocates
 * its scratch once. tp may be NULL (everything runs on the calling thread);
 * p may be NULL (defaults). Free with td_engine_destroy(). */
td_status td_engine_create(const td_model *m, td_kv_pool *kv, td_threadpool *tp, td_comm *comm,
                           const td_engine_params *p, td_engine **e_p);
void td_engine_destroy(td_engine *e); /* accepts NULL */

/* Rows of hidden state this rank computes for the batch: x_in and x_out of
 * td_engine_forward_stage hold this many rows of n_embd floats, in the
 * order of seqs. Every token of the batch without CP or attention-DP; with
 * them, the tokens this rank computes (the same on every rank of a TP
 * group, and on the same-coordinate ranks of every pipeline stage). */
int32_t td_engine_stage_rows(const td_engine *e, const td_seq_chunk *seqs, int32_t n_seqs);

/* The checks td_engine_forward makes on a batch before it touches
 * anything: TD_ERR_INVALID (logged) when the batch breaks a limit. */
td_status td_engine_validate(const td_engine *e, const td_seq_chunk *seqs, int32_t n_seqs);

/* Per-expert load of the last successful forward call (MoE models):
 * counts (n_expert entries) = how many tokens of the batch selected each
 * expert in layer `layer` (a global layer index of this stage), or summed
 * over the stage's layers for layer = -1. Every token of the batch counts
 * once whichever rank routed it, so the counts are the same on every rank
 * of a TP / EP group and equal the single-rank engine's (under CP: the
 * rows this CP rank computes, td_engine_stage_rows); the sum over experts
 * is tokens x n_expert_used per layer. Max / mean over experts is
 * the load imbalance. Zeros before the first call. TD_ERR_INVALID for a
 * dense model or a layer outside the stage. Never communicates. */
td_status td_engine_expert_load(const td_engine *e, int layer, int64_t *counts);

/* Rows of logits the call will produce for this batch. */
int32_t td_engine_n_logit_rows(const td_seq_chunk *seqs, int32_t n_seqs);

/* Runs the batch. logits: (td_engine_n_logit_rows, n_vocab), rows in the
 * order of seqs (every token of a logits_all chunk, else its last token,
 * none for no_logits chunks). Under TP (a model shard of tp_size > 1; comm
 * must then be the TP group, rank i holding shard i, else create fails with
 * TD_ERR_INVALID) the embedding and head are vocab-parallel
 * (td_model_vocab_range): each rank embeds its own tokens, zeros for the
 * others, and one all-reduce over comm gives every rank every row exactly;
 * each rank computes its vocabulary slice of the logits and an all-gather
 * leaves the complete logits, in vocabulary order, on every TP rank, each
 * logit the same dot product as on one rank. TD_ERR_INVALID for a batch that breaks the
 * limits (too many tokens, a block table too short, a position past max_ctx,
 * a token id out of the vocabulary). With CP or attention-DP every rank of
 * those groups gets the whole batch and the complete logits are written on
 * their rank 0 only (logits may be NULL on the others).
 * With CP the ranks check first that they run the same batch: when any of
 * them refuses its call or their batches differ, every one returns an
 * error (TD_ERR_INVALID, or its own) and nothing is computed. CP changes
 * the summation order of attention for DCP rows (partials merged) and, in
 * ring mode, for PCP rows; allgather-mode PCP rows attend exactly as one
 * rank does. Whether a chunk is split (n_tokens >= cp_min_tokens) can
 * therefore change its bits: the invariance above holds under CP for a
 * given chunking, not across chunkings. */
td_status td_engine_forward(td_engine *e, const td_seq_chunk *seqs, int32_t n_seqs, float *logits);

/* The same for a pipeline stage (a model loaded with a layer range).
 * x_in: (n_tokens of the batch, n_embd) hidden states from the previous
 * stage (td_engine_stage_rows of them), in the order of seqs; NULL on the first stage (which embeds
 * the tokens). x_out: where this stage's hidden states go, same shape; NULL on the last stage
 * (which produces logits as td_engine_forward does; logits is ignored on other stages). Token ids
 * are validated on every stage. td_engine_forward(e, ...) is td_engine_forward_stage(e, ..., NULL,
 * NULL, logits) and needs a whole model. TD_ERR_INVALID when x_in / x_out do not match the stage.
 */
td_status td_engine_forward_stage(td_engine *e, const td_seq_chunk *seqs, int32_t n_seqs,
                                  const float *x_in, float *x_out, float *logits);

/* Where the last td_engine_forward / td_engine_forward_stage call of this
 * rank spent its wall time: comm_s inside communication calls on
 * communicators of more than one rank (the TP all-reduces, the
 * vocab-parallel embedding all-reduce and logit all-gather, and every other
 * comm call of the forward pass), waiting for slower peers included, and
 * compute_s the rest of the call (so compute_s + comm_s is the call's wall
 * time). comm_calls counts those calls and comm_bytes adds the payload this
 * rank handed to them (n floats for an all-reduce of n, its own block for
 * an all-gather; the backend's algorithm decides the bytes on the wire).
 * A world of one makes no timed calls: comm_s 0, comm_calls 0. Reset at the
 * start of every call, also when the call fails. */
typedef struct {
    double compute_s;
    double comm_s;
    uint64_t comm_calls;
    uint64_t comm_bytes;
    /* Bytes this rank sent to the other ranks of the CP group (cp_comm): an
     * all-gather block counts once per other rank; the ring's K/V chunks,
     * the DCP attention partials, the hidden states of logit rows for CP
     * rank 0 and the batch check. 0 without CP. */
    uint64_t cp_bytes;
} td_engine_timing;

td_engine_timing td_engine_last_timing(const td_engine *e);

#endif
