/* The scheduler: one thread owns the engine, the KV pool and every
 * sequence; API threads only touch their td_gen_stream (stream.c, the
 * hand-off) and the inbox (under the scheduler's mutex). */
#include "sched.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "core.h"
#include "stop.h"

/* ---- sequences ---- */

typedef struct seq {
    td_sched_seq c; /* first: the core's lists hold &q->c */
    char id[64];
    td_gen_stream *st;
    int32_t min_tokens;
    td_sampler *sampler;
    td_stop *stop;
    td_detok detok;
    int32_t *ban; /* (n_ban) ids banned before min_tokens */
    int32_t n_ban;
    bool ignore_eos;
    bool logprobs;
    bool stop_strings;
    /* The output's constraint: its grammar (owned), matcher and a mask
     * buffer (the vocabulary's words); NULL: none. */
    td_gram *gram;
    td_gm *gm;
    uint32_t *mask;
    double t_arrival, t_scheduled, t_first, t_last;
    double prefill_compute; /* forward time of the steps that carried it before its first token */
    /* Disaggregation. */
    td_sched_ticket ticket;
    td_kv_export ex;
    td_kv_import im;
    bool have_first;         /* export: first holds the sampled first token */
    td_sample_result first;  /* export */
    struct parked *park_rec; /* export / import: the record its blocks are parked in */
} seq;

static seq *SEQ(td_sched_seq *c) { return (seq *)c; }

/* Blocks kept past their sequence: an export's sources until the puts are
 * flushed, an import's destinations until the peer is fenced. */
typedef struct parked {
    struct parked *next;
    td_sched_ticket ticket;
    int32_t *blocks;
    int32_t n_blocks;
    bool quarantine;
} parked;

/* What other threads tell the scheduler about remote prefills. */
typedef enum { EV_DONE, EV_FAILED, EV_RELEASE } rev_kind;
typedef struct rev {
    struct rev *next;
    rev_kind kind;
    td_sched_ticket ticket;
    td_sample_result first;
    uint8_t state[TD_SAMPLER_STATE_BYTES];
    bool has_state, quarantine, local;
    td_status err;
    int32_t remote_cached; /* EV_DONE: prompt tokens the peer served from its cache */
} rev;

struct td_sched {
    td_sched_params p;
    td_exec *exec;
    td_kv_pool *kv;
    const td_tokenizer *tok;
    td_metrics *metrics;
    int32_t n_vocab;
    pthread_t thread;
    /* Inbox and wake-up (under mu). */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    seq *inbox_head, *inbox_tail;
    int32_t n_inbox;
    bool stop;
    atomic_bool draining;
    atomic_bool abort_all;
    atomic_int n_waiting_total; /* inbox + waiting, for max_waiting */
    atomic_int n_live_streams;  /* submitted, not yet released by their reader */
    atomic_int n_active;        /* submitted, not yet finished */
    atomic_int n_running_pub;   /* running count as of the last step */
    /* Owned by the scheduler thread. */
    td_sched_core core; /* the policy: queue, running list, batch, prefix bookkeeping */
    float *logits;      /* (max_running, n_vocab) */
    td_seq_chunk *chunks;
    uint64_t steps;
    double prefill_rate; /* prompt tokens per second (scheduler thread; published) */
    /* Published figures (under stats_mu). */
    pthread_mutex_t stats_mu;
    pthread_cond_t stats_cv;
    td_sched_stats stats;
    int32_t stats_active; /* n_active when stats were taken */
    /* Disaggregation. */
    atomic_uint_fast64_t next_ticket;
    rev *ev_head, *ev_tail; /* under mu */
    parked *parked;         /* scheduler thread */
    int32_t *slots;         /* (max_running) the step's transfer job slots */
    /* The step trace (params.step_trace): this step's events, written out
     * when the step did anything. */
    FILE *tr_step;
    char *tr_buf;
    size_t tr_len;
    int tr_n; /* events in this step's line */
    double tr_t0;
};

td_sched_params td_sched_default_params(void) {
    td_sched_params p = {.max_running = 16,
                         .max_batch_tokens = 512,
                         .max_waiting = 256,
                         .reserve_output_tokens = 256,
                         .max_ctx = 0,
                         .prefix_cache = true,
                         .compat = {0, 0}};
    return p;
}

void td_gen_request_init(td_gen_request *r) {
    memset(r, 0, sizeof *r);
    r->max_tokens = 16;
    r->sampling = td_sampler_default_params();
    r->skip_special = true;
}

static void seq_free(seq *s) {
    if (!s) return;
    if (s->im.release) s->im.release(s->im.ctx);
    if (s->park_rec) {
        free(s->park_rec->blocks);
        free(s->park_rec);
    }
    td_sampler_destroy(s->sampler);
    td_stop_destroy(s->stop);
    td_sched_seq_free(&s->c);
    free(s->ban);
    td_gm_free(s->gm);
    td_gram_free(s->gram);
    free(s->mask);
    free(s);
}

static int32_t blocks_for(const td_sched *s, int64_t n_tokens) {
    return td_sched_core_blocks_for(&s->core, n_tokens);
}

/* ---- the step trace ---- */

/* Starts an event of this step's line ('[' then the kind); false: no trace. */
static bool tr_event(td_sched *s, const char *kind) {
    if (!s->tr_step) return false;
    fprintf(s->tr_step, "%s[\"%s\"", s->tr_n++ ? "," : "", kind);
    return true;
}

static void tr_ticket_event(td_sched *s, const char *kind, td_sched_ticket t) {
    if (tr_event(s, kind)) fprintf(s->tr_step, ",%llu]", (unsigned long long)t);
}

static void tr_header(td_sched *s) {
    const td_kv_params *kp = td_kv_pool_params(s->kv);
    const td_sched_params *p = &s->p;
    char compat[33];
    td_kv_hash_hex(p->compat, compat);
    s->tr_t0 = td_time_s();
    fprintf(p->step_trace,
            "{\"tandem_step_trace\":1,\"max_running\":%d,\"max_batch_tokens\":%d,"
            "\"max_waiting\":%d,\"reserve_output_tokens\":%d,\"max_ctx\":%d,"
            "\"prefix_cache\":%s,\"compat\":\"%s\",\"n_blocks\":%d,\"block_size\":%d,"
            "\"prefill_share\":%.17g,\"tpot_target_s\":%.17g,\"tpot_decode_factor\":%.17g,"
            "\"t0\":%.6f}\n",
            p->max_running, p->max_batch_tokens, p->max_waiting, p->reserve_output_tokens,
            p->max_ctx, p->prefix_cache ? "true" : "false", compat, kp->n_blocks, kp->block_size,
            p->prefill_share > 0 && p->prefill_share < 1 ? p->prefill_share : 1.0,
            p->tpot_target_s > 0 ? p->tpot_target_s : 0.0,
            p->tpot_decode_factor > 1 ? p->tpot_decode_factor : 0.0, s->tr_t0);
    fflush(p->step_trace);
}

static void tr_step_begin(td_sched *s) {
    if (!s->p.step_trace) return;
    s->tr_step = open_memstream(&s->tr_buf, &s->tr_len);
    s->tr_n = 0;
    if (s->tr_step) fprintf(s->tr_step, "{\"step\":%llu,\"ev\":[", (unsigned long long)s->steps);
}

static void tr_step_end(td_sched *s) {
    if (!s->tr_step) return;
    fputs("]}\n", s->tr_step);
    fclose(s->tr_step);
    s->tr_step = NULL;
    if (s->tr_n) {
        fwrite(s->tr_buf, 1, s->tr_len, s->p.step_trace);
        fflush(s->p.step_trace);
    }
    free(s->tr_buf);
    s->tr_buf = NULL;
}

/* ---- submit ---- */

/* More than max_waiting requests would wait: the ones the free running
 * slots will take at the next step do not count as waiting. */
static bool queue_full(td_sched *s) {
    int free_slots = s->p.max_running - atomic_load(&s->n_running_pub);
    return atomic_load(&s->n_waiting_total) >= s->p.max_waiting + TD_MAX(free_slots, 0);
}

/* The owner of the scheduler's streams (stream.h): a reader's cancel wakes
 * the scheduler thread, which ends the sequence at its next step; its
 * release ends the stream's count among the live ones. */
static void stream_cancelled(void *ctx) {
    td_sched *s = ctx;
    pthread_mutex_lock(&s->mu);
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void stream_released(void *ctx) {
    td_sched *s = ctx;
    atomic_fetch_sub(&s->n_live_streams, 1);
}

td_status td_sched_submit(td_sched *s, const td_gen_request *r, td_gen_stream **st_p) {
    if (!s || !r || !st_p || !r->prompt || r->n_prompt < 1 || r->max_tokens < 1 ||
        r->min_tokens < 0 || r->n_stop < 0 || r->n_stop_ids < 0) {
        TD_LOG_ERROR("invalid generation request");
        return TD_ERR_INVALID;
    }
    if (atomic_load(&s->draining)) return TD_ERR_UNAVAILABLE;
    if ((int64_t)r->n_prompt + 1 > s->p.max_ctx) {
        TD_LOG_INFO("request %s: prompt of %d tokens leaves no room in the context of %d",
                    r->id ? r->id : "-", r->n_prompt, s->p.max_ctx);
        return TD_ERR_RANGE;
    }
    if (blocks_for(s, (int64_t)r->n_prompt + 1) > td_kv_pool_params(s->kv)->n_blocks) {
        TD_LOG_INFO("request %s: prompt of %d tokens can never fit the KV pool (%d blocks)",
                    r->id ? r->id : "-", r->n_prompt, td_kv_pool_params(s->kv)->n_blocks);
        return TD_ERR_RANGE;
    }
    for (int32_t i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= s->n_vocab) {
            TD_LOG_INFO("request %s: prompt token %d is outside the vocabulary (%d)",
                        r->id ? r->id : "-", r->prompt[i], s->n_vocab);
            return TD_ERR_INVALID;
        }
    if (queue_full(s)) return TD_AGAIN;

    td_status st = TD_ERR_NOMEM;
    seq *q = calloc(1, sizeof *q);
    td_gen_stream *gs = NULL;
    if (!q) goto fail;
    if (td_sched_seq_init(&q->c, &s->core, r->prompt, r->n_prompt, r->max_tokens) != TD_OK)
        goto fail;
    q->min_tokens = TD_MIN(r->min_tokens, q->c.max_tokens);
    q->c.pinned = r->kv_export.ended != NULL;
    q->ex = r->kv_export;
    q->im = r->kv_import;
    if (q->ex.ended || q->im.start) {
        /* Allocated now so that parking the blocks later cannot fail. */
        q->park_rec = calloc(1, sizeof *q->park_rec);
        if (!q->park_rec) goto fail;
        q->park_rec->blocks = malloc((size_t)q->c.blk_cap * sizeof(int32_t));
        if (!q->park_rec->blocks) goto fail;
    }
    q->ticket = atomic_fetch_add(&s->next_ticket, 1) + 1;
    snprintf(q->id, sizeof q->id, "%s", r->id ? r->id : "-");

    if ((st = td_sampler_create(&r->sampling, s->n_vocab, &q->sampler)) != TD_OK) goto fail;
    if ((st = td_sampler_accept_prompt(q->sampler, r->prompt, (size_t)r->n_prompt)) != TD_OK)
        goto fail;
    td_stop_params sp = td_stop_default_params();
    sp.stop_ids = r->stop_ids;
    sp.n_stop_ids = (size_t)r->n_stop_ids;
    sp.stop_strings = r->stop;
    sp.n_stop_strings = (size_t)r->n_stop;
    sp.include_stop_str = r->include_stop_str;
    sp.ignore_eog = r->ignore_eos;
    if ((st = td_stop_create(&sp, s->tok, &q->stop)) != TD_OK) goto fail;
    q->stop_strings = r->n_stop > 0;
    q->ignore_eos = r->ignore_eos;
    td_detok_init(&q->detok, r->skip_special);
    q->logprobs = r->sampling.logprobs || r->sampling.n_logprobs > 0;
    if (q->min_tokens > 0) {
        /* vLLM's min_tokens: stop tokens (EOG unless ignore_eos, and user
         * stop ids) cannot be sampled before min_tokens outputs. */
        size_t n_eog = 0;
        const int32_t *eog = r->ignore_eos ? NULL : td_tokenizer_eog_ids(s->tok, &n_eog);
        if (r->ignore_eos) n_eog = 0;
        q->ban = malloc((n_eog + (size_t)r->n_stop_ids + 1) * sizeof *q->ban);
        if (!q->ban) goto fail;
        for (size_t i = 0; i < n_eog; i++) q->ban[q->n_ban++] = eog[i];
        for (int32_t i = 0; i < r->n_stop_ids; i++)
            if (r->stop_ids[i] >= 0 && r->stop_ids[i] < s->n_vocab)
                q->ban[q->n_ban++] = r->stop_ids[i];
    }
    if (r->grammar) {
        if (!s->p.vocab) {
            TD_LOG_INFO("request %s: a constrained request, and no vocabulary for masks",
                        r->id ? r->id : "-");
            st = TD_ERR_INVALID;
            goto fail;
        }
        q->gm = td_gm_new(r->grammar);
        q->mask = malloc(td_vocab_mask_words(s->p.vocab) * sizeof *q->mask);
        if (!q->gm || !q->mask) goto fail;
    }
    double now = td_time_s();
    q->t_arrival = r->t_arrival > 0 ? r->t_arrival : now;

    td_gen_stream_owner owner = {.cancel = stream_cancelled, .released = stream_released, .ctx = s};
    if ((st = td_gen_stream_create(q->c.max_tokens, q->logprobs, r->n_prompt, &owner, &gs))) {
        q->im.release = NULL; /* the caller keeps its context (the cause is logged) */
        seq_free(q);
        return st;
    }
    td_gen_stream_set_ticket(gs, q->ticket);
    q->st = gs;

    pthread_mutex_lock(&s->mu);
    /* The checks above again, now that they cannot race with a drain. */
    td_status refused = atomic_load(&s->draining) || s->stop ? TD_ERR_UNAVAILABLE
                        : queue_full(s)                      ? TD_AGAIN
                                                             : TD_OK;
    if (refused != TD_OK) {
        pthread_mutex_unlock(&s->mu);
        td_gen_stream_unref(gs); /* the reader's reference, never handed out */
        td_gen_stream_unref(gs);
        q->st = NULL;
        q->im.release = NULL; /* the caller keeps its context */
        seq_free(q);
        return refused;
    }
    q->gram = r->grammar; /* taken: TD_OK follows */
    atomic_fetch_add(&s->n_waiting_total, 1);
    atomic_fetch_add(&s->n_live_streams, 1);
    atomic_fetch_add(&s->n_active, 1);
    if (s->inbox_tail)
        s->inbox_tail->c.next = &q->c;
    else
        s->inbox_head = q;
    s->inbox_tail = q;
    s->n_inbox++;
    /* The published figures count it at once (a prefill instance judges
     * the next job's start from them); the scheduler thread publishes them
     * afresh from its queues after its step. */
    pthread_mutex_lock(&s->stats_mu);
    s->stats.waiting++;
    s->stats.queued_prefill_tokens += q->c.n_tokens;
    pthread_mutex_unlock(&s->stats_mu);
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    *st_p = gs;
    return TD_OK;

fail:
    if (st == TD_ERR_NOMEM) TD_LOG_ERROR("out of memory");
    if (q) q->im.release = NULL; /* the caller keeps its context */
    seq_free(q);
    return st;
}

/* ---- scheduler thread ---- */

static void publish_stats(td_sched *s) {
    td_sched_stats x;
    memset(&x, 0, sizeof x);
    const td_sched_core *c = &s->core;
    x.running = c->n_running;
    int32_t n_wait = td_sched_core_n_waiting(c);
    int64_t queued = td_sched_core_queued_prefill_tokens(c);
    for (int32_t i = 0; i < c->n_running; i++) x.remote_waiting += c->running[i]->remote_wait;
    for (const parked *pk = s->parked; pk; pk = pk->next) {
        x.n_parked++;
        if (pk->quarantine)
            x.quarantined_blocks += pk->n_blocks;
        else
            x.held_blocks += pk->n_blocks;
    }
    pthread_mutex_lock(&s->mu);
    n_wait += s->n_inbox;
    for (const td_sched_seq *q = s->inbox_head ? &s->inbox_head->c : NULL; q; q = q->next)
        queued += q->n_tokens;
    pthread_mutex_unlock(&s->mu);
    x.waiting = n_wait;
    x.queued_prefill_tokens = queued;
    td_kv_pool_counts(s->kv, &x.kv);
    x.steps = s->steps;
    x.prefill_tokens_per_s = s->prefill_rate;
    x.preemptions = c->preemptions;
    x.draining = atomic_load(&s->draining);
    int32_t active = atomic_load(&s->n_active);
    atomic_store(&s->n_running_pub, c->n_running);
    pthread_mutex_lock(&s->stats_mu);
    s->stats = x;
    s->stats_active = active;
    pthread_cond_broadcast(&s->stats_cv);
    pthread_mutex_unlock(&s->stats_mu);
}

/* Moves q's blocks (and their references) to its parking record, kept
 * until td_sched_release names its ticket. */
static void park_blocks(td_sched *s, seq *q, bool quarantine) {
    parked *pk = q->park_rec;
    TD_ASSERT(pk && q->c.n_blocks <= q->c.blk_cap);
    memcpy(pk->blocks, q->c.blocks, (size_t)q->c.n_blocks * sizeof(int32_t));
    pk->n_blocks = q->c.n_blocks;
    pk->ticket = q->ticket;
    pk->quarantine = quarantine;
    pk->next = s->parked;
    s->parked = pk;
    q->park_rec = NULL;
    q->c.n_blocks = 0;
}

/* Ends a sequence: takes it off its list, publishes the end, records
 * metrics, frees its blocks and reservation, and lets go of the stream. */
static void seq_finish(td_sched *s, seq *q, td_finish_reason why, td_status err, int stop_index,
                       int32_t stop_token) {
    bool was_waiting = !q->c.running;
    td_sched_core_unlink(&s->core, &q->c);
    tr_ticket_event(s, "end", q->ticket);
    td_gen_stream *st = q->st;
    const char *tail = NULL;
    size_t tail_len = 0;
    if (why == TD_FINISH_LENGTH || why == TD_FINISH_STOP) {
        if (stop_index < 0) td_stop_flush(q->stop, &tail, &tail_len);
    }
    char flushed[16];
    size_t nf = (why == TD_FINISH_LENGTH || why == TD_FINISH_STOP) && stop_index < 0
                    ? td_detok_flush(&q->detok, flushed, sizeof flushed)
                    : 0;
    td_finish_reason finish;
    int32_t n_out = td_gen_stream_end(st, tail, tail_len, flushed, nf, why, err, stop_index,
                                      stop_token, &finish);

    if (s->metrics) {
        td_request_record rec = {.id = q->id,
                                 .n_prompt_tokens = q->c.n_prompt,
                                 .n_cached_tokens = q->c.n_cached_tokens,
                                 .n_output_tokens = n_out,
                                 .finish = finish,
                                 .t_arrival = q->t_arrival,
                                 .t_scheduled = q->t_scheduled,
                                 .t_first_token = q->t_first,
                                 .t_finished = td_time_s(),
                                 .n_preemptions = q->c.n_preemptions,
                                 .prefill_compute_s = q->prefill_compute};
        td_metrics_request_finished(s->metrics, &rec);
    }
    bool was_remote = q->c.remote_wait;
    if (q->c.n_blocks && (was_remote || q->ex.ended))
        park_blocks(s, q, was_remote); /* puts may be in flight into or out of them */
    td_sched_core_release(&s->core, &q->c);
    if (was_remote && q->im.cancelled) q->im.cancelled(q->im.ctx, q->ticket);
    if (q->ex.ended) {
        uint8_t state[TD_SAMPLER_STATE_BYTES];
        td_sampler_state_get(q->sampler, state);
        q->ex.ended(q->ex.ctx, q->ticket, q->have_first ? &q->first : NULL,
                    q->have_first ? state : NULL);
    }
    if (was_waiting) atomic_fetch_sub(&s->n_waiting_total, 1);
    atomic_fetch_sub(&s->n_active, 1);
    td_gen_stream_unref(st);
    q->st = NULL;
    seq_free(q);
}

/* Takes the inbox; handles cancellations of waiting and running sequences. */
static void take_inbox_and_cancels(td_sched *s) {
    td_sched_core *c = &s->core;
    pthread_mutex_lock(&s->mu);
    seq *in = s->inbox_head;
    s->inbox_head = s->inbox_tail = NULL;
    s->n_inbox = 0;
    pthread_mutex_unlock(&s->mu);
    if (in) td_sched_core_enqueue(c, &in->c);
    for (td_sched_seq *q = in ? &in->c : NULL; q && tr_event(s, "in"); q = q->next) {
        fprintf(s->tr_step, ",%llu,%d,[", (unsigned long long)SEQ(q)->ticket, q->max_tokens);
        for (int32_t i = 0; i < q->n_prompt; i++)
            fprintf(s->tr_step, i ? ",%d" : "%d", q->tokens[i]);
        fprintf(s->tr_step, "],%.6f]", SEQ(q)->t_arrival - s->tr_t0);
    }

    bool all = atomic_load(&s->abort_all);
    for (td_sched_seq **pp = &c->waiting; *pp;) {
        seq *q = SEQ(*pp);
        if (all || td_gen_stream_cancelled(q->st)) {
            *pp = q->c.next;
            q->c.next = NULL;
            seq_finish(s, q, TD_FINISH_ABORT, TD_ERR_CANCELLED, -1, -1);
        } else {
            pp = &q->c.next;
        }
    }
    for (int32_t i = 0; i < c->n_running;) {
        seq *q = SEQ(c->running[i]);
        if (all || td_gen_stream_cancelled(q->st)) {
            seq_finish(s, q, TD_FINISH_ABORT, TD_ERR_CANCELLED, -1, -1);
        } else {
            i++;
        }
    }
    if (all) atomic_store(&s->abort_all, false);
}

/* The core admitted q: its stream learns the prompt's cached share, and a
 * decode instance may hand its prefill to a peer. */
static bool core_admitted(void *ctx, td_sched_seq *cq) {
    td_sched *s = ctx;
    seq *q = SEQ(cq);
    atomic_fetch_sub(&s->n_waiting_total, 1);
    if (s->p.prefix_cache && s->metrics)
        td_metrics_prefix_cache(s->metrics, cq->n_tokens, cq->n_computed);
    if (q->t_scheduled == 0) q->t_scheduled = td_time_s();
    if (cq->n_preemptions == 0) td_gen_stream_set_prompt(q->st, cq->n_prompt, cq->n_cached_tokens);
    bool remote = q->im.start && !cq->local_only && cq->n_computed < cq->n_tokens - 1 &&
                  q->im.start(q->im.ctx, q->ticket, cq->blocks, cq->n_blocks, cq->n_computed);
    if (tr_event(s, "adm")) fprintf(s->tr_step, ",%llu,%d]", (unsigned long long)q->ticket, remote);
    return remote;
}

static void core_preempted(void *ctx, td_sched_seq *cq) {
    td_sched *s = ctx;
    atomic_fetch_add(&s->n_waiting_total, 1);
    if (s->metrics) td_metrics_preemption(s->metrics);
    tr_ticket_event(s, "pre", SEQ(cq)->ticket);
    TD_LOG_INFO("preempted %s (KV exhausted; it will recompute %d tokens)", SEQ(cq)->id,
                cq->n_tokens);
}

/* The core's batch as the engine's chunks. Returns the number of sequences. */
static int32_t build_batch(td_sched *s) {
    int32_t n = td_sched_core_build_batch(&s->core);
    for (int32_t i = 0; i < n; i++) {
        td_sched_seq *q = s->core.batch[i];
        td_seq_chunk *ch = &s->chunks[i];
        ch->tokens = q->tokens + q->n_computed;
        ch->n_tokens = q->chunk;
        ch->pos0 = q->n_computed;
        ch->block_table = q->blocks;
        ch->n_blocks = q->n_blocks;
        ch->logits_all = false;
        ch->no_logits = !td_sched_core_has_logits(q);
    }
    return n;
}

static bool take_token(td_sched *s, seq *q, const td_sample_result *rp, double now);

/* Samples q's next token from its logits row and applies the stop rules.
 * Returns true when q ended (and was freed). */
static bool sample_one(td_sched *s, seq *q, float *logits, double now) {
    int32_t n_out = q->c.n_tokens - q->c.n_prompt;
    bool ban = n_out < q->min_tokens;
    if (q->gm) { /* the grammar's mask */
        const int64_t allowed = td_gm_mask(q->gm, s->p.vocab, q->mask);
        if (allowed <= 0) {
            TD_LOG_ERROR("request %s: the grammar allows no token (%s)", q->id,
                         td_gm_error(q->gm) ? td_gm_error(q->gm) : "none");
            seq_finish(s, q, TD_FINISH_ERROR, TD_ERR_INVALID, -1, -1);
            return true;
        }
        const size_t words = td_vocab_mask_words(s->p.vocab);
        for (size_t w = 0; w < words; w++)
            if (q->mask[w] != UINT32_MAX)
                for (uint32_t b = 0; b < 32; b++)
                    if (!(q->mask[w] >> b & 1) && (int64_t)w * 32 + b < s->n_vocab)
                        logits[w * 32 + b] = -INFINITY;
        /* where the grammar allows only banned tokens (its end), it ends;
         * each banned token counted once (its bit cleared: the mask is
         * scratch from here on) */
        int64_t banned = 0;
        for (int32_t i = 0; ban && i < q->n_ban; i++) {
            uint32_t *w = &q->mask[q->ban[i] / 32];
            const uint32_t bit = 1u << (q->ban[i] % 32);
            banned += (*w & bit) != 0;
            *w &= ~bit;
        }
        if (banned == allowed) ban = false;
    }
    if (ban)
        for (int32_t i = 0; i < q->n_ban; i++) logits[q->ban[i]] = -INFINITY;
    td_sample_result r;
    td_status st = td_sampler_sample(q->sampler, logits, &r);
    if (st != TD_OK) {
        seq_finish(s, q, TD_FINISH_ERROR, st, -1, -1);
        return true;
    }
    return take_token(s, q, &r, now);
}

/* Appends token r (sampled here, or by a prefill instance) to q, streams it
 * and applies the stop rules. Returns true when q ended (and was freed). */
static bool take_token(td_sched *s, seq *q, const td_sample_result *rp, double now) {
    td_sample_result r = *rp;
    int32_t n_out = q->c.n_tokens - q->c.n_prompt;
    if (q->ex.ended && !q->have_first) {
        q->first = r;
        q->have_first = true;
    }
    bool gram_end = false;
    if (q->gm) { /* the matcher takes the token (the end: when it accepts) */
        const td_gm_result gr = td_gm_consume_token(q->gm, s->p.vocab, r.token, NULL);
        if (gr != TD_GM_OK) {
            TD_LOG_ERROR("request %s: token %d is outside the grammar (%s)", q->id, r.token,
                         td_gm_error(q->gm) ? td_gm_error(q->gm) : "rejected");
            seq_finish(s, q, TD_FINISH_ERROR, TD_ERR_INVALID, -1, -1);
            return true;
        }
        gram_end = td_gm_stopped(q->gm);
    }
    td_sampler_accept(q->sampler, r.token);
    td_sched_core_append(&s->core, &q->c, r.token);
    if (tr_event(s, "tok"))
        fprintf(s->tr_step, ",%llu,%d]", (unsigned long long)q->ticket, r.token);
    n_out++;
    if (q->t_first == 0) {
        q->t_first = now;
        if (s->metrics)
            td_metrics_first_token(s->metrics, now - q->t_arrival, q->t_scheduled - q->t_arrival);
    } else if (s->metrics) {
        td_metrics_inter_token(s->metrics, now - q->t_last);
    }
    q->t_last = now;

    td_gen_stream *gs = q->st;
    bool stop_tok =
        gram_end || (n_out > q->min_tokens - 1 && td_stop_is_stop_token(q->stop, r.token));
    const char *text = NULL;
    size_t text_len = 0;
    bool stop_str = false;
    char piece[256];
    if (!stop_tok) {
        size_t np = td_detok_push(s->tok, &q->detok, r.token, piece, sizeof piece);
        if (n_out <= q->min_tokens || !q->stop_strings) {
            /* Stop strings are not checked before min_tokens (vLLM). */
            text = piece;
            text_len = np;
        } else {
            td_stop_feed(q->stop, piece, np, &text, &text_len, &stop_str);
        }
    }
    if (td_gen_stream_push(gs, &r.token, &r, 1, text, text_len) != TD_OK) {
        TD_LOG_ERROR("out of memory");
        seq_finish(s, q, TD_FINISH_ERROR, TD_ERR_NOMEM, -1, -1);
    } else if (stop_tok) {
        seq_finish(s, q, TD_FINISH_STOP, TD_OK, -1, r.token);
    } else if (stop_str) {
        seq_finish(s, q, TD_FINISH_STOP, TD_OK, td_stop_matched(q->stop), -1);
    } else if (n_out >= q->c.max_tokens || q->c.n_tokens >= s->p.max_ctx) {
        seq_finish(s, q, TD_FINISH_LENGTH, TD_OK, -1, -1);
    } else {
        return false;
    }
    return true;
}

/* ---- remote prefill events ---- */

/* The running sequence of ticket t that waits for a remote prefill, or NULL. */
static seq *remote_waiter(const td_sched *s, td_sched_ticket t) {
    for (int32_t i = 0; i < s->core.n_running; i++) {
        seq *q = SEQ(s->core.running[i]);
        if (q->ticket == t) return q->c.remote_wait ? q : NULL;
    }
    return NULL;
}

static void remote_done(td_sched *s, rev *e) {
    seq *q = remote_waiter(s, e->ticket);
    if (!q) return; /* cancelled or failed meanwhile */
    if (e->first.token < 0 || e->first.token >= s->n_vocab) {
        TD_LOG_ERROR("request %s: remote first token %d outside the vocabulary", q->id,
                     e->first.token);
        e->kind = EV_FAILED;
        e->quarantine = true;
        e->local = true;
        return;
    }
    if (q->c.n_preemptions == 0 && e->remote_cached > 0) {
        /* the usage's cached tokens: none of these were computed, here or there */
        q->c.n_cached_tokens = TD_MIN(q->c.n_prompt, q->c.n_cached_tokens + e->remote_cached);
        td_gen_stream_set_prompt(q->st, q->c.n_prompt, q->c.n_cached_tokens);
    }
    if (tr_event(s, "rdone"))
        fprintf(s->tr_step, ",%llu,%.6f]", (unsigned long long)q->ticket, td_time_s() - s->tr_t0);
    td_sched_core_remote_computed(&s->core, &q->c);
    if (e->has_state && td_sampler_state_set(q->sampler, e->state, sizeof e->state) != TD_OK)
        TD_LOG_INFO("request %s: remote sampler state ignored", q->id);
    if (td_gen_stream_cancelled(q->st)) return; /* the cancel pass ends it */
    take_token(s, q, &e->first, td_time_s());
}

static void remote_failed(td_sched *s, const rev *e) {
    seq *q = remote_waiter(s, e->ticket);
    if (!q) return;
    if (tr_event(s, "rfail"))
        fprintf(s->tr_step, ",%llu,%d,%d]", (unsigned long long)q->ticket,
                e->quarantine && q->c.n_blocks > 0, e->local);
    td_sched_core_remote_failed(&s->core, &q->c);
    if (e->quarantine && q->c.n_blocks) {
        /* The blocks stay held until the peer is fenced; a local prefill
         * starts over in fresh ones, from the head of the queue. */
        park_blocks(s, q, true);
        td_sched_core_restart(&s->core, &q->c);
        atomic_fetch_add(&s->n_waiting_total, 1);
        if (!e->local) seq_finish(s, q, TD_FINISH_ERROR, e->err, -1, -1);
        return;
    }
    if (!e->local) seq_finish(s, q, TD_FINISH_ERROR, e->err, -1, -1);
    /* else: the blocks are safe; the next batch prefills it here. */
}

static void release_parked(td_sched *s, td_sched_ticket t) {
    for (parked **pp = &s->parked; *pp; pp = &(*pp)->next) {
        parked *pk = *pp;
        if (pk->ticket != t) continue;
        *pp = pk->next;
        td_kv_block_free(s->kv, pk->blocks, pk->n_blocks);
        free(pk->blocks);
        free(pk);
        return;
    }
}

static void take_events(td_sched *s) {
    pthread_mutex_lock(&s->mu);
    rev *e = s->ev_head;
    s->ev_head = s->ev_tail = NULL;
    pthread_mutex_unlock(&s->mu);
    while (e) {
        rev *next = e->next;
        if (e->kind == EV_DONE) remote_done(s, e); /* may turn into a failure */
        if (e->kind == EV_FAILED) remote_failed(s, e);
        if (e->kind == EV_RELEASE) release_parked(s, e->ticket);
        free(e);
        e = next;
    }
}

static void post_event(td_sched *s, rev *e) {
    pthread_mutex_lock(&s->mu);
    if (s->ev_tail)
        s->ev_tail->next = e;
    else
        s->ev_head = e;
    s->ev_tail = e;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static rev *event_new(rev_kind kind, td_sched_ticket t) {
    rev *e = calloc(1, sizeof *e);
    if (!e) {
        /* A lost event would strand a sequence or its blocks: there is no
         * way to go on correctly without memory for 200 bytes. */
        TD_LOG_ERROR("out of memory posting a scheduler event");
        abort();
    }
    e->kind = kind;
    e->ticket = t;
    return e;
}

void td_sched_remote_done(td_sched *s, td_sched_ticket t, const td_sample_result *first,
                          const uint8_t *state, size_t state_len, int32_t remote_cached) {
    rev *e = event_new(EV_DONE, t);
    e->first = *first;
    e->remote_cached = remote_cached > 0 ? remote_cached : 0;
    if (state && state_len == sizeof e->state) {
        memcpy(e->state, state, sizeof e->state);
        e->has_state = true;
    }
    post_event(s, e);
}

void td_sched_remote_failed(td_sched *s, td_sched_ticket t, bool quarantine, bool local,
                            td_status err) {
    rev *e = event_new(EV_FAILED, t);
    e->quarantine = quarantine;
    e->local = local;
    e->err = err;
    post_event(s, e);
}

void td_sched_release(td_sched *s, td_sched_ticket t) { post_event(s, event_new(EV_RELEASE, t)); }

/* One scheduling step. Returns false when there was nothing to run. */
static bool step_run(td_sched *s) {
    take_inbox_and_cancels(s);
    take_events(s);
    td_sched_core_admit(&s->core);
    int32_t n = build_batch(s);
    if (n == 0) return false;
    int32_t n_tok = 0;
    for (int32_t i = 0; i < n; i++) n_tok += s->chunks[i].n_tokens;
    double t0 = td_time_s();
    bool any_slot = false;
    for (int32_t i = 0; i < n; i++) {
        const seq *q = SEQ(s->core.batch[i]);
        s->slots[i] = q->ex.ended ? q->ex.slot : -1;
        any_slot |= s->slots[i] >= 0;
        if (q->ex.progress)
            q->ex.progress(q->ex.ctx, q->ticket, s->chunks[i].pos0 + s->chunks[i].n_tokens);
    }
    td_status st =
        td_exec_forward_tagged(s->exec, s->chunks, n, any_slot ? s->slots : NULL, s->logits);
    double dt = td_time_s() - t0;
    td_sched_core_observe(&s->core, dt);
    if (tr_event(s, "b")) { /* dt exact: a replay feeds the core the same */
        fprintf(s->tr_step, ",%.6f,%.17g,[", t0 - s->tr_t0, dt);
        for (int32_t i = 0; i < n; i++)
            fprintf(s->tr_step, "%s[%llu,%d,%d]", i ? "," : "",
                    (unsigned long long)SEQ(s->core.batch[i])->ticket, s->chunks[i].pos0,
                    s->chunks[i].n_tokens);
        fputs("]]", s->tr_step);
    }
    s->steps++;
    if (s->metrics) {
        td_metrics_iteration(s->metrics, n_tok);
        td_rank_time rt[TD_METRICS_MAX_RANKS];
        int nr =
            TD_MIN(td_exec_last_times(s->exec, rt, TD_METRICS_MAX_RANKS), TD_METRICS_MAX_RANKS);
        double cs[TD_METRICS_MAX_RANKS], ms[TD_METRICS_MAX_RANKS];
        for (int r = 0; r < nr; r++) {
            cs[r] = rt[r].compute_s;
            ms[r] = rt[r].comm_s;
        }
        if (st == TD_OK) td_metrics_rank_step(s->metrics, nr, cs, ms);
        int64_t load[TD_METRICS_MAX_EXPERTS];
        int ne = td_exec_expert_load(s->exec, load, TD_METRICS_MAX_EXPERTS);
        if (st == TD_OK && ne > 0) td_metrics_expert_load(s->metrics, ne, load);
    }
    double now = td_time_s();
    int32_t row = 0;
    int32_t n_prompt = 0; /* prompt tokens this step computed */
    for (int32_t i = 0; i < n; i++) {
        seq *q = SEQ(s->core.batch[i]);
        bool has_logits = !s->chunks[i].no_logits;
        float *lg = has_logits ? s->logits + (size_t)row++ * (size_t)s->n_vocab : NULL;
        if (st != TD_OK) {
            TD_LOG_ERROR("forward pass failed (%s): ending request %s", td_status_str(st), q->id);
            q->c.chunk = 0;
            seq_finish(s, q, TD_FINISH_ERROR, st, -1, -1);
            continue;
        }
        td_sched_core_computed(&s->core, &q->c);
        if (q->t_first == 0) {
            q->prefill_compute += dt;
            n_prompt += s->chunks[i].n_tokens;
        }
        if (!has_logits) continue;
        /* A cancel that arrived during the forward pass wins over the token. */
        if (td_gen_stream_cancelled(q->st)) continue;
        /* A finished sequence has been freed: drop it from running. */
        sample_one(s, q, lg, now); /* a sequence that ended is freed */
    }
    if (st == TD_OK && dt > 0 && n_prompt >= 16) {
        double r = n_prompt / dt;
        s->prefill_rate = s->prefill_rate > 0 ? 0.8 * s->prefill_rate + 0.2 * r : r;
    }
    return true;
}

static bool step(td_sched *s) {
    tr_step_begin(s);
    bool worked = step_run(s);
    tr_step_end(s);
    return worked;
}

static void *sched_main(void *arg) {
    td_sched *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        if (s->stop) {
            pthread_mutex_unlock(&s->mu);
            break;
        }
        pthread_mutex_unlock(&s->mu);
        bool worked = step(s);
        publish_stats(s);
        if (worked) continue;
        pthread_mutex_lock(&s->mu);
        /* Sleep until a submission, a cancel or stop; cancels of queued or
         * running work signal the same condition. The timeout bounds the
         * latency of a cancel racing with this check. */
        if (!s->stop && !s->inbox_head && !s->ev_head && !atomic_load(&s->abort_all)) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 100 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&s->cv, &s->mu, &ts);
        }
        pthread_mutex_unlock(&s->mu);
    }
    /* Shutting down: end everything still queued or running. */
    atomic_store(&s->abort_all, true);
    tr_step_begin(s);
    take_inbox_and_cancels(s);
    take_events(s);
    tr_step_end(s);
    publish_stats(s);
    return NULL;
}

td_status td_sched_create(const td_sched_params *p, td_exec *exec, td_kv_pool *kv,
                          const td_tokenizer *tok, td_metrics *metrics, td_sched **s_p) {
    if (!p || !exec || !kv || !tok || !s_p || p->max_running < 1 || p->max_batch_tokens < 1 ||
        p->max_waiting < 0 || p->reserve_output_tokens < 0 || p->max_ctx < 2 ||
        !(p->tpot_target_s >= 0 && p->tpot_target_s < 3600) ||
        !(p->tpot_decode_factor >= 0 && p->tpot_decode_factor < 1e6)) {
        TD_LOG_ERROR("invalid scheduler parameters");
        return TD_ERR_INVALID;
    }
    const td_kv_params *kp = td_kv_pool_params(kv);
    if ((int64_t)kp->n_blocks * kp->block_size < p->max_ctx) {
        TD_LOG_ERROR("the KV pool (%d blocks of %d tokens) cannot hold one sequence of the "
                     "context length %d",
                     kp->n_blocks, kp->block_size, p->max_ctx);
        return TD_ERR_INVALID;
    }
    if (p->max_batch_tokens < p->max_running) {
        TD_LOG_ERROR("max_batch_tokens (%d) must be at least max_running (%d)", p->max_batch_tokens,
                     p->max_running);
        return TD_ERR_INVALID;
    }
    td_sched *s = calloc(1, sizeof *s);
    if (!s) return TD_ERR_NOMEM;
    s->p = *p;
    s->exec = exec;
    s->kv = kv;
    s->tok = tok;
    s->metrics = metrics;
    s->n_vocab = td_tokenizer_n_vocab(tok);
    td_sched_core_hooks hooks = {.ctx = s, .admitted = core_admitted, .preempted = core_preempted};
    if (td_sched_core_init(&s->core, p, kv, &hooks) != TD_OK) {
        TD_LOG_ERROR("out of memory");
        free(s);
        return TD_ERR_NOMEM;
    }
    s->chunks = calloc((size_t)p->max_running, sizeof *s->chunks);
    s->slots = calloc((size_t)p->max_running, sizeof *s->slots);
    s->logits = malloc((size_t)p->max_running * (size_t)s->n_vocab * sizeof(float));
    if (!s->chunks || !s->slots || !s->logits) {
        TD_LOG_ERROR("out of memory");
        goto free_s;
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_mutex_init(&s->stats_mu, NULL);
    pthread_cond_init(&s->stats_cv, NULL);
    if (p->step_trace) tr_header(s);
    publish_stats(s);
    int rc = pthread_create(&s->thread, NULL, sched_main, s);
    if (rc != 0) {
        TD_LOG_ERROR("pthread_create: %s", strerror(rc));
        pthread_cond_destroy(&s->stats_cv);
        pthread_mutex_destroy(&s->stats_mu);
        pthread_cond_destroy(&s->cv);
        pthread_mutex_destroy(&s->mu);
        goto free_s;
    }
    *s_p = s;
    return TD_OK;

free_s:
    td_sched_core_free(&s->core);
    free(s->logits);
    free(s->chunks);
    free(s->slots);
    free(s);
    return TD_ERR_NOMEM;
}

void td_sched_destroy(td_sched *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->stop = true;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    while (s->parked) { /* held past the end: the pool goes with the instance */
        parked *pk = s->parked;
        s->parked = pk->next;
        td_kv_block_free(s->kv, pk->blocks, pk->n_blocks);
        free(pk->blocks);
        free(pk);
    }
    for (rev *e = s->ev_head; e;) {
        rev *next = e->next;
        free(e);
        e = next;
    }
    pthread_cond_destroy(&s->stats_cv);
    pthread_mutex_destroy(&s->stats_mu);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    td_sched_core_free(&s->core);
    free(s->logits);
    free(s->chunks);
    free(s->slots);
    free(s);
}

void td_sched_stats_get(td_sched *s, td_sched_stats *st) {
    pthread_mutex_lock(&s->stats_mu);
    *st = s->stats;
    pthread_mutex_unlock(&s->stats_mu);
    st->draining = atomic_load(&s->draining);
}

void td_sched_metrics_gauges(td_sched *s, td_metrics_gauges *g) {
    td_sched_stats st;
    td_sched_stats_get(s, &st);
    memset(g, 0, sizeof *g);
    g->running = st.running;
    g->waiting = st.waiting;
    g->queued_prefill_tokens = st.queued_prefill_tokens;
    g->kv_total = st.kv.total;
    g->kv_empty = st.kv.empty;
    g->kv_cached = st.kv.cached;
    g->kv_used = st.kv.used;
    g->kv_reserved = st.kv.reserved;
    g->kv_fragmentation = st.kv.fragmentation;
    g->kv_evictions = st.kv.evictions;
    g->draining = st.draining;
}

td_kv_events *td_sched_kv_events(td_sched *s) { return td_kv_pool_events(s->kv); }

td_kv_hash td_sched_compat(const td_sched *s) { return s->p.compat; }

void td_sched_drain(td_sched *s) {
    atomic_store(&s->draining, true);
    pthread_mutex_lock(&s->mu);
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

bool td_sched_draining(td_sched *s) { return atomic_load(&s->draining); }

int32_t td_sched_live_streams(td_sched *s) { return atomic_load(&s->n_live_streams); }

bool td_sched_wait_idle(td_sched *s, double timeout_s) {
    /* Idle: nothing active now, and the published figures were taken when
     * nothing was active (so they show the final block counts). */
    double deadline = td_time_s() + timeout_s;
    pthread_mutex_lock(&s->stats_mu);
    for (;;) {
        if (s->stats_active == 0 && atomic_load(&s->n_active) == 0) {
            pthread_mutex_unlock(&s->stats_mu);
            return true;
        }
        double left = deadline - td_time_s();
        if (left <= 0) break;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double w = TD_MIN(left, 0.1);
        ts.tv_nsec += (long)(w * 1e9);
        while (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&s->stats_cv, &s->stats_mu, &ts);
    }
    pthread_mutex_unlock(&s->stats_mu);
    return false;
}

void td_sched_abort_all(td_sched *s) {
    atomic_store(&s->abort_all, true);
    pthread_mutex_lock(&s->mu);
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}
