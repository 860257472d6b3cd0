/* The scheduler of one instance: one thread that owns the engine, the KV
 * pool and every sequence, running continuous batching with chunked
 * prefill (DESIGN.md §5). API threads (HTTP, gRPC) submit requests and read
 * their output through a td_gen_stream (stream.h); that stream is the only
 * hand-off.
 *
 * Each step the scheduler
 *   1. takes new submissions and cancellations;
 *   2. admits waiting requests first-come first-served while fewer than
 *      max_running run: a request is admitted only if the pool can give it
 *      the blocks of its uncached prompt now plus a reservation for
 *      min(max_tokens, reserve_output_tokens) output tokens, so an admitted
 *      sequence does not starve mid-decode; the head of the queue that
 *      does not fit blocks the ones behind it (no overtaking);
 *   3. builds one batch: one decode token for every running sequence past
 *      its prompt, then prefill chunks of admitted prompts in admission
 *      order, within max_batch_tokens;
 *   4. runs the forward pass, samples, detokenizes, applies the stop
 *      conditions (EOG / stop ids unless ignore_eos, stop strings,
 *      max_tokens, the context; none before min_tokens) and publishes to
 *      the streams;
 *   5. publishes every newly full block to the prefix cache, and frees the
 *      blocks of finished sequences (hashed ones stay cached, LRU).
 * When a running sequence needs a block past its reservation and none is
 * free, the most recently admitted sequence is preempted (its blocks freed,
 * it goes back to the head of the queue and later recomputes prompt +
 * output so far); counted in metrics. Output is bit-identical whatever the
 * batching (the engine's guarantee) and preemption changes nothing a
 * client sees.
 *
 * Thread-safety: td_sched_submit, td_sched_stats, td_sched_drain and every
 * td_gen_stream_* function may be called from any thread. */
#ifndef TD_SCHED_H
#define TD_SCHED_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "common/engine/forward.h"
#include "common/grammar/vocab.h"
#include "common/kv/kv.h"
#include "common/obs/metrics.h"
#include "common/parallel/exec.h"
#include "common/tokenizer/tokenizer.h"
#include "sampler.h"
#include "stream.h"

typedef struct {
    int32_t max_running;      /* sequences decoding at once (default 16) */
    int32_t max_batch_tokens; /* tokens per step, decode + prefill chunks (default 512);
                               * must not exceed the engine's max_batch_tokens */
    /* In a step that also decodes, prompt chunks take at most this share
     * of max_batch_tokens (at least one token), so that a prompt arriving
     * at a busy instance stretches its decodes' step by a bounded amount;
     * 0 or 1: no limit beyond max_batch_tokens (default). */
    double prefill_share;
    /* In a step that also decodes, prompt chunks take at most the tokens
     * that fit in this forward-pass time beside the decodes, from the step
     * times measured so far (core.h, td_sched_core_observe; growing by
     * doubling as the steps confirm the fit), and at least one token, so
     * that prompts still progress every step; the tighter of this and
     * prefill_share holds. 0: no target (default). */
    double tpot_target_s;
    /* With no tpot_target_s: > 1 derives the target from the step times
     * measured, as this many times the time the fit gives the step's
     * decodes alone (so the target follows the batch and the machine:
     * prompts get (factor - 1) decode steps' worth of time beside them);
     * 0: none (default). */
    double tpot_decode_factor;
#define TD_SCHED_TPOT_AUTO_FACTOR 3.0 /* --tpot-target-ms auto */
    int32_t max_waiting; /* queued requests beyond which submit says TD_AGAIN (default 256) */
    int32_t
        reserve_output_tokens; /* cap on the output tokens reserved at admission (default 256) */
    int32_t max_ctx;           /* longest sequence (prompt + output) (required) */
    bool prefix_cache;         /* reuse cached full blocks (default true) */
    td_kv_hash compat;         /* root of the block hash chain (compatibility hash) */
    /* Where the scheduler writes its step trace, JSON Lines: a header
     * {"tandem_step_trace": 1, these parameters, "n_blocks", "block_size",
     * "t0": td_time_s() at the start}, then for every step that did
     * anything {"step": N, "ev": [...]}, its events in the order they
     * happened (times in seconds since t0):
     *   ["in", ticket, max_tokens, [prompt ids], t_arrival]  taken from the inbox
     *   ["end", ticket]                   ended (stop, length, cancel, error)
     *   ["rdone", ticket, t] / ["rfail", ticket, quarantined, local]  remote prefill
     *   ["adm", ticket, remote]           admitted (remote: 1 when a peer prefills it)
     *   ["pre", ticket]                   preempted
     *   ["b", t, dt, [[ticket, pos0, n_tokens], ...]]  the batch, its start and forward time
     *   ["tok", ticket, token]            a token taken
     * Borrowed (the caller opens and closes it); NULL: none. */
    FILE *step_trace;
    /* The vocabulary for constrained requests' masks (td_gen_request.grammar),
     * built from the same tokenizer; borrowed. NULL: such requests are
     * refused (TD_ERR_INVALID). */
    const td_vocab *vocab;
} td_sched_params;

td_sched_params td_sched_default_params(void);

/* One generation request. Everything is copied by td_sched_submit. */
/* ---- Disaggregation hooks (prefill and decode pools) ----
 * A ticket (stream.h) names one submitted sequence in the calls below. */

/* Prefill side: the sequence's KV goes to a peer as it is computed: its
 * steps carry `slot` to the ranks (td_exec_forward_tagged, the slot its tag), whose transfer
 * state (transfer/xrank.h) puts each layer's rows. The callback runs on
 * the scheduler thread; keep it short. */
typedef struct {
    void *ctx;    /* NULL with ended NULL: no export */
    int32_t slot; /* the transfer job slot the ranks know the job by */
    /* The sequence ended: after its first token (published in its stream;
     * first points to it, sampler_state to the PRNG state after its draw,
     * TD_SAMPLER_STATE_BYTES) or with an error / cancel (both NULL). Its
     * blocks are held, never freed or reused, until td_sched_release(t):
     * puts from them may still be in flight. */
    void (*ended)(void *ctx, td_sched_ticket t, const td_sample_result *first,
                  const uint8_t *sampler_state);
    /* A chunk of the prompt is about to be computed, through position
     * `through` (exclusive): the first call says the job started. NULL:
     * not told. */
    void (*progress)(void *ctx, td_sched_ticket t, int32_t through);
} td_kv_export;

/* Decode side: the prompt's KV comes from a prefill instance. */
typedef struct {
    void *ctx; /* NULL with start NULL: no import */
    /* At admission, once blocks[0..n_blocks) cover the prompt and the KV of
     * the first n_cached tokens is there (the local prefix cache). Return
     * true when a remote prefill was started: the sequence then waits,
     * computing nothing and never preempted, until td_sched_remote_done or
     * td_sched_remote_failed; false: prefill locally. */
    bool (*start)(void *ctx, td_sched_ticket t, const int32_t *blocks, int32_t n_blocks,
                  int32_t n_cached);
    /* The sequence was cancelled (client gone, abort, shutdown) while it
     * waited: its blocks are quarantined until td_sched_release(t), which
     * the caller calls once nothing can write into them any more. */
    void (*cancelled)(void *ctx, td_sched_ticket t);
    /* The scheduler lets go of ctx: once td_sched_submit returned TD_OK,
     * called exactly once, last (when submit fails the caller keeps ctx).
     * NULL: nothing. */
    void (*release)(void *ctx);
} td_kv_import;

typedef struct {
    const char *id;        /* request id for logs and metrics (copied; may be NULL) */
    const int32_t *prompt; /* (n_prompt) token ids, every one in the vocabulary */
    int32_t n_prompt;      /* >= 1 */
    int32_t max_tokens;    /* >= 1; generation also ends at max_ctx */
    int32_t min_tokens;    /* no stop (EOG, stop id, stop string) before this many (default 0) */
    td_sampler_params sampling;
    const int32_t *stop_ids; /* user stop token ids */
    int32_t n_stop_ids;
    const char *const *stop; /* stop strings, non-empty */
    int32_t n_stop;
    bool include_stop_str;  /* keep a matched stop string in the text */
    bool ignore_eos;        /* do not stop on EOG tokens */
    bool skip_special;      /* leave special tokens out of the text (default true) */
    double t_arrival;       /* td_time_s() when the request arrived; 0: now */
    td_kv_export kv_export; /* prefill instance (copied) */
    td_kv_import kv_import; /* decode instance (copied) */
    /* The router's choice of prefill (internal Generate), read by a decode
     * instance's submit hook (api/request.h): local, or the prefill
     * instance at HOST:PORT; neither: the instance decides. */
    bool route_local;
    const char *route_prefill;
    /* The output's constraint (structured outputs), compiled
     * (common/grammar/constraint.h); NULL: none. td_sched_submit takes it
     * when it returns TD_OK (it then runs on the scheduler thread only);
     * otherwise the caller keeps it. Each token is sampled under the
     * grammar's mask (logprobs are those of the masked logits, as vLLM's
     * default); the end of generation is allowed exactly when the grammar
     * accepts, and when only the end is allowed it ends the output despite
     * min_tokens and ignore_eos. */
    td_gram *grammar;
} td_gen_request;

void td_gen_request_init(td_gen_request *r); /* defaults; prompt NULL */

typedef struct td_sched td_sched;

/* Starts the scheduler thread. exec (the instance's ranks: each step runs
 * through td_exec_forward), kv (rank 0's pool), tok and metrics (may be NULL)
 * are borrowed and must outlive the scheduler. TD_ERR_INVALID (logged)
 * when the pool cannot hold one sequence of max_ctx tokens, or
 * max_batch_tokens < max_running. Free with td_sched_destroy(), which
 * finishes everything still queued or running with TD_FINISH_ABORT and
 * joins the thread. Release every stream first (the HTTP and gRPC servers
 * are stopped before the scheduler). */
td_status td_sched_create(const td_sched_params *p, td_exec *exec, td_kv_pool *kv,
                          const td_tokenizer *tok, td_metrics *metrics, td_sched **s_p);
void td_sched_destroy(td_sched *s); /* accepts NULL */

/* Queues a request. On success *st_p is a stream the caller reads
 * (td_gen_stream_read) and must release (td_gen_stream_release), before
 * td_sched_destroy. TD_AGAIN: more than max_waiting requests wait (HTTP 429);
 * TD_ERR_UNAVAILABLE: draining; TD_ERR_RANGE: n_prompt + 1 > max_ctx
 * (context_length_exceeded), or a prompt that can never fit in the pool;
 * TD_ERR_INVALID: bad parameters (logged). */
td_status td_sched_submit(td_sched *s, const td_gen_request *r, td_gen_stream **st_p);

/* A remote prefill finished: first is the first token as the prefill
 * instance sampled it (with its logprobs when asked), state that
 * sampler's PRNG state after the draw (TD_SAMPLER_STATE_BYTES; NULL:
 * keep ours), remote_cached the prompt tokens past ours the prefill
 * instance served from its own prefix cache (they count as cached in the
 * usage: nobody computed them). The sequence publishes its full blocks to the prefix cache,
 * takes the token as if sampled here and decodes on. A ticket that is not
 * waiting any more (cancelled, failed) is ignored. */
void td_sched_remote_done(td_sched *s, td_sched_ticket t, const td_sample_result *first,
                          const uint8_t *state, size_t state_len, int32_t remote_cached);
/* A remote prefill failed. quarantine: the peer may have written (or may
 * still write) into the blocks, so they are held until
 * td_sched_release(t); else they are safe to reuse. local: prefill locally
 * (in fresh blocks when quarantined); else the request ends with err. */
void td_sched_remote_failed(td_sched *s, td_sched_ticket t, bool quarantine, bool local,
                            td_status err);
/* Frees the blocks held for t (an export's held blocks, an import's
 * quarantined ones); unknown tickets are ignored. */
void td_sched_release(td_sched *s, td_sched_ticket t);

/* Instantaneous load and block figures (also the metrics gauges), as the
 * scheduler thread published them after its last step; a submission adds
 * to waiting and queued_prefill_tokens at once. */
typedef struct {
    int32_t running;
    int32_t remote_waiting;     /* admitted, waiting for a remote prefill */
    int32_t held_blocks;        /* export: held until released */
    int32_t quarantined_blocks; /* import: fenced, not yet released */
    int32_t n_parked;           /* tickets with held or quarantined blocks */
    int32_t waiting;
    int64_t queued_prefill_tokens; /* prompt tokens admitted or waiting, not yet computed */
    double prefill_tokens_per_s;   /* prompt tokens per second of the steps that computed at
                                    * least 16 of them (a moving average; 0: none yet) */
    td_kv_counts kv;
    uint64_t steps;
    uint64_t preemptions;
    bool draining;
} td_sched_stats;
void td_sched_stats_get(td_sched *s, td_sched_stats *st);
void td_sched_metrics_gauges(td_sched *s, td_metrics_gauges *g);

/* The compatibility hash the block hash chains start from (params.compat). */
td_kv_hash td_sched_compat(const td_sched *s);

/* The KV event log of the instance's pool (thread-safe reads). */
td_kv_events *td_sched_kv_events(td_sched *s);

/* Draining: from now on submit returns TD_ERR_UNAVAILABLE; running and
 * waiting requests go on. td_sched_wait_idle waits up to timeout_s for
 * nothing to run or wait; returns true if idle. td_sched_abort_all cancels
 * everything. */
void td_sched_drain(td_sched *s);
bool td_sched_draining(td_sched *s);
/* Streams submitted and not yet released by their readers (a draining
 * server waits for 0 before closing its connections). */
int32_t td_sched_live_streams(td_sched *s);
bool td_sched_wait_idle(td_sched *s, double timeout_s);
void td_sched_abort_all(td_sched *s);

#endif
