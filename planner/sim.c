/* The cluster simulator (sim.h). */
#include "sim.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/kv/hash.h"
#include "common/sched/core.h"

const int32_t TD_STEP_HINGES[TD_STEP_N_HINGES] = {2, 4, 8, 16};

/* sum of j and of j^2 for j = 1 .. n */
static double sum1(double n) { return n * (n + 1) / 2; }
static double sum2(double n) { return n * (n + 1) * (2 * n + 1) / 6; }

void td_step_attn(int64_t pos0, int64_t chunk, double *a, double *a2) {
    double lo = (double)pos0, hi = (double)(pos0 + chunk);
    *a = sum1(hi) - sum1(lo);
    *a2 = sum2(hi) - sum2(lo);
}

double td_step_model_eval(const td_step_model *m, int64_t n_tok, double attn, double attn2,
                          double ctx, int32_t n_seq) {
    double n = (double)n_tok;
    double t = m->c0 + m->c_tok * n + m->c_tok2 * n * n + m->c_attn * attn + m->c_attn2 * attn2 +
               m->c_ctx * ctx + m->c_seq * n_seq;
    for (int k = 0; k < TD_STEP_N_HINGES; k++)
        if (n_tok > TD_STEP_HINGES[k]) t += m->c_n[k] * (double)(n_tok - TD_STEP_HINGES[k]);
    return t > 0 ? t : 0;
}

/* ---- state ---- */

typedef struct sim sim;

typedef struct sseq {
    td_sched_seq c;
    int32_t req;
    bool prefill_side; /* the prefill instance's one-token sequence of a remote prefill */
} sseq;

typedef struct {
    td_sim_instance cfg;
    sim *s;
    int32_t index;
    td_kv_pool *kv;
    td_sched_core core;
    bool busy, kick_pending;
    int32_t n_batch;
    /* the step in progress: the share of it done as of t_mark, its duration
     * alone and beside a stepping neighbour, whether a neighbour steps now
     * (and did at any time of this step), its start, and the generation of
     * its end event (a neighbour starting or ending moves the end) */
    double done, t_mark, d_alone, d_beside, t_start;
    bool beside_now, beside_any;
    uint32_t gen;
    /* the router's view of it (poll_interval_s > 0) */
    td_rt_inst polled;                       /* its figures at the last poll */
    int64_t pending_blocks, pending_prefill; /* routed to it since that poll */
    int32_t in_flight;                       /* requests it decodes, routed and not ended */
} sinst;

typedef struct {
    int32_t *tokens; /* the prompt, until its sequence is made */
    int32_t n_prompt;
    td_kv_hash *hashes; /* the prompt's full blocks (routing overlap), until routed */
    sseq *dq;           /* its sequence on the decode / colocated instance */
    int32_t d, p;
    int32_t *held; /* the prefill instance's blocks, held until the transfer's end */
    int32_t n_held;
    int32_t n_out;
    double t_first, t_last;
    bool done;
} sreq;

typedef enum { EV_ARRIVAL, EV_STEP_END, EV_XFER_DONE, EV_KICK, EV_POLL } ev_kind;

typedef struct {
    double t;
    uint64_t order; /* ties: first scheduled, first run */
    ev_kind kind;
    int32_t idx;
    uint32_t gen; /* EV_STEP_END: the step's end as of this generation (older: moved) */
} event;

struct sim {
    const td_sim_cluster *c;
    const td_sim_request *reqs;
    int32_t n_req;
    td_sim_outcome *out;
    td_sim_stats *st;
    bool collect_itl;
    int64_t itl_cap;
    sinst inst[TD_SIM_MAX_INSTANCES];
    sreq *r;
    event *heap;
    int64_t n_heap, cap_heap;
    uint64_t order;
    int32_t *queue; /* the router's FIFO of requests waiting for headroom */
    int32_t q_head, q_len;
    double now;
    uint64_t rng, counter;
    td_rt_inst *rt; /* (n_inst) */
    int32_t *overlap;
    int32_t block_size;
    td_kv_hash compat;
    bool changed; /* an instance stepped or took a transfer since the last poll */
    bool oom;
};

static uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

/* A token of segment id at position i (or of request req's own tokens). */
static int32_t seg_token(int64_t id, int32_t req, int32_t i) {
    uint64_t h = id >= 0 ? mix64((uint64_t)id * 0x9e3779b97f4a7c15ull + (uint64_t)i)
                         : mix64(((uint64_t)req << 32 | (uint32_t)i) ^ 0x5bd1e995ull);
    return 3 + (int32_t)(h % 32000);
}

/* ---- the event heap ---- */

static bool ev_before(const event *a, const event *b) {
    return a->t < b->t || (a->t == b->t && a->order < b->order);
}

static void push_gen(sim *s, double t, ev_kind kind, int32_t idx, uint32_t gen) {
    if (s->n_heap == s->cap_heap) {
        int64_t cap = s->cap_heap ? s->cap_heap * 2 : 1024;
        event *h = realloc(s->heap, (size_t)cap * sizeof *h);
        if (!h) {
            s->oom = true;
            return;
        }
        s->heap = h;
        s->cap_heap = cap;
    }
    event e = {.t = t, .order = s->order++, .kind = kind, .idx = idx, .gen = gen};
    int64_t i = s->n_heap++;
    while (i > 0) {
        int64_t up = (i - 1) / 2;
        if (!ev_before(&e, &s->heap[up])) break;
        s->heap[i] = s->heap[up];
        i = up;
    }
    s->heap[i] = e;
}

static void push(sim *s, double t, ev_kind kind, int32_t idx) { push_gen(s, t, kind, idx, 0); }

static event pop(sim *s) {
    event top = s->heap[0], last = s->heap[--s->n_heap];
    int64_t i = 0;
    for (;;) {
        int64_t l = 2 * i + 1;
        if (l >= s->n_heap) break;
        if (l + 1 < s->n_heap && ev_before(&s->heap[l + 1], &s->heap[l])) l++;
        if (!ev_before(&s->heap[l], &last)) break;
        s->heap[i] = s->heap[l];
        i = l;
    }
    if (s->n_heap) s->heap[i] = last;
    return top;
}

/* ---- requests ---- */

static void itl_add(sim *s, double gap) {
    if (!s->collect_itl) return;
    if (s->st->n_itl == s->itl_cap) {
        int64_t cap = s->itl_cap ? s->itl_cap * 2 : 4096;
        float *v = realloc(s->st->itl, (size_t)cap * sizeof *v);
        if (!v) {
            s->oom = true;
            return;
        }
        s->st->itl = v;
        s->itl_cap = cap;
    }
    s->st->itl[s->st->n_itl++] = (float)gap;
}

static void seq_end(sinst *in, sseq *q) {
    td_sched_core_unlink(&in->core, &q->c);
    td_sched_core_release(&in->core, &q->c);
    td_sched_seq_free(&q->c);
    free(q);
}

static void req_finish(sim *s, int32_t ri) {
    sreq *r = &s->r[ri];
    td_sim_outcome *o = &s->out[ri];
    double ov = s->c->request_overhead_s;
    o->ttft = r->t_first - s->reqs[ri].t_arrival + ov;
    o->e2e = r->t_last - s->reqs[ri].t_arrival + ov;
    o->tpot = r->n_out > 1 ? (r->t_last - r->t_first) / (r->n_out - 1) : 0;
    r->done = true;
    if (s->c->router) s->inst[r->d].in_flight--;
}

static void req_fail(sim *s, int32_t ri) {
    s->out[ri].failed = true;
    s->st->n_failed++;
    s->r[ri].done = true;
    free(s->r[ri].tokens);
    free(s->r[ri].hashes);
    s->r[ri].tokens = NULL;
    s->r[ri].hashes = NULL;
}

/* The request's next token arrived at the client side of its instance. */
static void take_token(sim *s, sinst *in, sseq *q, bool *ended) {
    sreq *r = &s->r[q->req];
    td_sched_core_append(&in->core, &q->c, seg_token(-1, q->req, q->c.n_tokens + 1000000));
    if (r->n_out == 0) {
        r->t_first = s->now;
    } else {
        double gap = s->now - r->t_last;
        if (gap > s->out[q->req].itl_max) s->out[q->req].itl_max = gap;
        itl_add(s, gap);
    }
    r->t_last = s->now;
    r->n_out++;
    *ended = r->n_out >= s->reqs[q->req].n_output || q->c.n_tokens >= in->cfg.sched.max_ctx;
    if (*ended) {
        int32_t ri = q->req;
        s->out[ri].n_preemptions = q->c.n_preemptions;
        seq_end(in, q);
        r->dq = NULL;
        req_finish(s, ri);
    }
}

static void step_start(sinst *in);

/* Wakes an idle instance: its step starts once every event of this instant
 * has run (requests arriving together are admitted together, as the
 * scheduler thread, woken by the first, finds them all queued). */
static void kick(sinst *in) {
    if (in->busy || in->kick_pending) return;
    in->kick_pending = true;
    push(in->s, in->s->now, EV_KICK, in->index);
}

/* The core admitted q: a decode instance's request routed to a prefill
 * instance joins that instance's queue (as the decode side's im.start
 * does when the prompt is not all but its last token cached). */
static bool on_admitted(void *ctx, td_sched_seq *cq) {
    sinst *in = ctx;
    sim *s = in->s;
    sseq *q = (sseq *)cq;
    if (q->prefill_side) return false;
    sreq *r = &s->r[q->req];
    if (cq->n_preemptions == 0) s->out[q->req].n_cached = cq->n_cached_tokens;
    if (r->p < 0 || cq->local_only || cq->n_computed >= cq->n_tokens - 1) return false;
    sinst *p = &s->inst[r->p];
    sseq *pq = calloc(1, sizeof *pq);
    if (!pq || td_sched_seq_init(&pq->c, &p->core, cq->tokens, cq->n_prompt, 1) != TD_OK) {
        if (pq) td_sched_seq_free(&pq->c);
        free(pq);
        s->oom = true;
        return false;
    }
    pq->req = q->req;
    pq->prefill_side = true;
    pq->c.pinned = true; /* its blocks are read by the transfer */
    td_sched_core_enqueue(&p->core, &pq->c);
    s->st->remote_prefills++;
    kick(p);
    return true;
}

static void on_preempted(void *ctx, td_sched_seq *cq) {
    sinst *in = ctx;
    TD_UNUSED(cq);
    in->s->st->preemptions++;
}

/* The figures an instance publishes (sched.c publish_stats, the state the
 * router polls). */
static void inst_figures(const sinst *in, td_rt_inst *x) {
    td_kv_counts kc;
    td_kv_pool_counts(in->kv, &kc);
    memset(x, 0, sizeof *x);
    x->prefill = in->cfg.role == TD_SIM_PREFILL;
    x->block_size = in->cfg.block_size;
    x->queued_prefill_tokens = td_sched_core_queued_prefill_tokens(&in->core);
    x->kv_free = td_kv_pool_n_free(in->kv);
    x->kv_used = kc.used;
    x->kv_total = kc.total;
    x->running = in->core.n_running;
    x->waiting = td_sched_core_n_waiting(&in->core);
}

/* Instance i can take request ri into its queue now (the submit checks of
 * td_sched_submit: the queue's bound). */
static bool queue_has_room(const sinst *in) {
    int32_t free_slots = in->cfg.sched.max_running - in->core.n_running;
    return td_sched_core_n_waiting(&in->core) < in->cfg.sched.max_waiting + TD_MAX(free_slots, 0);
}

static void submit_to(sim *s, int32_t ri, int32_t d, int32_t p) {
    sreq *r = &s->r[ri];
    sinst *in = &s->inst[d];
    sseq *q = calloc(1, sizeof *q);
    if (!q || td_sched_seq_init(&q->c, &in->core, r->tokens, r->n_prompt, s->reqs[ri].n_output) !=
                  TD_OK) {
        if (q) td_sched_seq_free(&q->c);
        free(q);
        s->oom = true;
        return;
    }
    q->req = ri;
    r->dq = q;
    r->d = d;
    r->p = p;
    s->out[ri].d = d;
    s->out[ri].p = p;
    free(r->tokens);
    free(r->hashes);
    r->tokens = NULL;
    r->hashes = NULL;
    td_sched_core_enqueue(&in->core, &q->c);
    kick(in);
}

/* Routes request ri; false when it must wait in the router's queue. */
static bool route(sim *s, int32_t ri) {
    sreq *r = &s->r[ri];
    const td_sim_cluster *c = s->c;
    if (!c->router) {
        if (!queue_has_room(&s->inst[0])) {
            req_fail(s, ri); /* the instance answers 429 */
            return true;
        }
        submit_to(s, ri, 0, -1);
        return true;
    }
    int32_t n_full = (r->n_prompt - 1) / s->block_size;
    for (int32_t i = 0; i < c->n_inst; i++) {
        sinst *in = &s->inst[i];
        td_rt_inst *x = &s->rt[i];
        if (c->poll_interval_s > 0) {
            /* as router/route.c adds them up */
            *x = in->polled;
            x->queued_prefill_tokens += in->pending_prefill;
            x->pending_blocks = in->pending_blocks;
            x->running += in->in_flight;
        } else {
            inst_figures(in, x);
        }
        x->usable = x->prefill || queue_has_room(in);
        s->overlap[i] = td_kv_cache_probe(in->kv, r->hashes, n_full);
    }
    td_rt_choice ch;
    td_status st = td_rt_choose(&c->score, s->rt, c->n_inst, s->overlap, NULL, 0, r->n_prompt,
                                s->reqs[ri].n_output, s->counter++, &s->rng, &ch);
    if (st == TD_AGAIN) return false;
    if (st != TD_OK) {
        bool any_full = false; /* a decode instance whose queue is full: the router holds it */
        for (int32_t i = 0; i < c->n_inst; i++) any_full |= !s->rt[i].prefill && !s->rt[i].usable;
        if (any_full) return false;
        req_fail(s, ri);
        return true;
    }
    /* what the router adds to its view until its next poll */
    sinst *pi = &s->inst[ch.p >= 0 ? ch.p : ch.d];
    int64_t uncached = (int64_t)r->n_prompt - (int64_t)s->overlap[pi->index] * s->block_size;
    pi->pending_prefill += TD_MAX(uncached, 0);
    s->inst[ch.d].pending_blocks += ch.need_blocks;
    s->inst[ch.d].in_flight++;
    submit_to(s, ri, ch.d, ch.p);
    return true;
}

static void drain_router_queue(sim *s) {
    while (s->q_len > 0) {
        int32_t ri = s->queue[s->q_head];
        if (!route(s, ri)) return;
        s->q_head++;
        s->q_len--;
    }
}

/* The router's poll round: every instance's figures afresh, what it routed
 * since forgotten, its queue tried again (router/poller.c). The next round
 * is due while anything can still change. */
static void poll_round(sim *s) {
    for (int32_t i = 0; i < s->c->n_inst; i++) {
        sinst *in = &s->inst[i];
        inst_figures(in, &in->polled);
        in->pending_blocks = in->pending_prefill = 0;
    }
    s->st->polls++;
    s->changed = false;
    drain_router_queue(s);
    if (s->n_heap > 0 || (s->q_len > 0 && s->changed))
        push(s, s->now + s->c->poll_interval_s, EV_POLL, 0);
}

static void arrive(sim *s, int32_t ri) {
    const td_sim_request *rq = &s->reqs[ri];
    sreq *r = &s->r[ri];
    int32_t n = 0;
    for (int32_t k = 0; k < rq->n_seg; k++) n += rq->seg[k].n_tokens;
    r->n_prompt = n;
    s->out[ri].n_prompt = n;
    s->out[ri].d = s->out[ri].p = -1;
    /* can never fit: td_sched_submit's range checks, on every instance it could go to */
    const td_sim_instance *d0 = &s->c->inst[0];
    for (int32_t i = 0; i < s->c->n_inst; i++)
        if (s->c->inst[i].role != TD_SIM_PREFILL) d0 = &s->c->inst[i];
    if ((int64_t)n + 1 > d0->sched.max_ctx ||
        (n + d0->block_size) / d0->block_size > d0->n_blocks) {
        req_fail(s, ri);
        return;
    }
    r->tokens = malloc((size_t)n * sizeof *r->tokens);
    int32_t n_full = (n - 1) / s->block_size;
    r->hashes = malloc((size_t)(n_full + 1) * sizeof *r->hashes);
    if (!r->tokens || !r->hashes) {
        s->oom = true;
        return;
    }
    int32_t at = 0;
    for (int32_t k = 0; k < rq->n_seg; k++)
        for (int32_t i = 0; i < rq->seg[k].n_tokens; i++)
            r->tokens[at++] = seg_token(rq->seg[k].id, ri, i);
    for (int32_t b = 0; b < n_full; b++)
        r->hashes[b] =
            td_kv_hash_block(b ? r->hashes[b - 1] : s->compat,
                             r->tokens + (size_t)b * (size_t)s->block_size, s->block_size, NULL, 0);
    if (s->q_len > 0 || !route(s, ri)) {
        s->queue[s->q_head + s->q_len++] = ri;
        if (s->q_len > s->st->max_router_queue) s->st->max_router_queue = s->q_len;
    }
}

/* ---- instance steps ---- */

/* Another instance on in's host is in a step now. */
static bool neighbour_stepping(const sinst *in) {
    if (in->cfg.host < 0) return false;
    const sim *s = in->s;
    for (int32_t i = 0; i < s->c->n_inst; i++)
        if (i != in->index && s->inst[i].cfg.host == in->cfg.host && s->inst[i].busy) return true;
    return false;
}

/* Brings in's step up to now at the pace it had, and (re)schedules its
 * end at the pace it has from now: beside a stepping neighbour, d_beside
 * for the whole step; alone, d_alone. */
static void step_pace(sinst *in, bool force) {
    sim *s = in->s;
    bool beside = in->cfg.has_beside && neighbour_stepping(in);
    if (beside == in->beside_now && !force) return;
    if (s->now > in->t_mark) {
        double d = in->beside_now ? in->d_beside : in->d_alone;
        in->done += d > 0 ? (s->now - in->t_mark) / d : 1;
    }
    in->t_mark = s->now;
    in->beside_now = beside;
    in->beside_any |= beside;
    double left = in->done < 1 ? 1 - in->done : 0;
    push_gen(s, s->now + left * (beside ? in->d_beside : in->d_alone), EV_STEP_END, in->index,
             ++in->gen);
}

/* An instance of this host started or ended a step: the others' pace. */
static void host_changed(sinst *in) {
    sim *s = in->s;
    if (in->cfg.host < 0) return;
    for (int32_t i = 0; i < s->c->n_inst; i++) {
        sinst *x = &s->inst[i];
        if (x != in && x->busy && x->cfg.host == in->cfg.host) step_pace(x, false);
    }
}

static void step_start(sinst *in) {
    sim *s = in->s;
    td_sched_core_admit(&in->core);
    int32_t n = td_sched_core_build_batch(&in->core);
    in->n_batch = n;
    if (n == 0) {
        in->busy = false;
        return;
    }
    int64_t n_tok = 0;
    double attn = 0, attn2 = 0, ctx = 0;
    for (int32_t j = 0; j < n; j++) {
        const td_sched_seq *q = in->core.batch[j];
        double a, a2;
        td_step_attn(q->n_computed, q->chunk, &a, &a2);
        n_tok += q->chunk;
        attn += a;
        attn2 += a2;
        ctx += (double)(q->n_computed + q->chunk);
    }
    in->d_alone =
        td_step_model_eval(&in->cfg.step, n_tok, attn, attn2, ctx, n) + in->cfg.step_overhead_s;
    in->d_beside = in->cfg.has_beside
                       ? td_step_model_eval(&in->cfg.step_beside, n_tok, attn, attn2, ctx, n) +
                             in->cfg.beside_overhead_s
                       : in->d_alone;
    /* a step of no time (a model of zeros) still ends */
    if (!(in->d_alone > 0)) in->d_alone = 0;
    if (!(in->d_beside > 0)) in->d_beside = in->d_alone > 0 ? in->d_alone : 0;
    in->busy = true;
    in->done = 0;
    in->t_mark = in->t_start = s->now;
    in->beside_now = in->beside_any = false;
    s->st->steps++;
    step_pace(in, true);
}

static void step_end(sinst *in) {
    sim *s = in->s;
    s->changed = true;
    /* what the real scheduler's estimate learns from: the step's forward
     * time, its own overhead apart */
    td_sched_core_observe(&in->core, s->now - in->t_start - in->cfg.step_overhead_s);
    for (int32_t j = 0; j < in->n_batch; j++) {
        sseq *q = (sseq *)in->core.batch[j];
        bool logits = td_sched_core_has_logits(&q->c);
        td_sched_core_computed(&in->core, &q->c);
        if (!logits) continue;
        if (q->prefill_side) {
            /* The first token is sampled; the blocks stay held while the
             * transfer's tail passes, then are freed. */
            sreq *r = &s->r[q->req];
            r->held = malloc((size_t)TD_MAX(q->c.n_blocks, 1) * sizeof *r->held);
            if (!r->held) {
                s->oom = true;
                return;
            }
            memcpy(r->held, q->c.blocks, (size_t)q->c.n_blocks * sizeof *r->held);
            r->n_held = q->c.n_blocks;
            q->c.n_blocks = 0;
            int32_t moved = r->n_prompt - (r->dq ? r->dq->c.n_computed : 0);
            seq_end(in, q);
            push(s, s->now + s->c->xfer_fixed_s + s->c->xfer_s_per_token * moved, EV_XFER_DONE,
                 (int32_t)(r - s->r));
            continue;
        }
        bool ended;
        take_token(s, in, q, &ended);
    }
    in->n_batch = 0;
    in->busy = false;
    s->st->busy_s[in->index] += s->now - in->t_start;
    s->st->steps_beside += in->beside_any;
}

static void xfer_done(sim *s, int32_t ri) {
    sreq *r = &s->r[ri];
    s->changed = true;
    sinst *p = &s->inst[r->p], *d = &s->inst[r->d];
    td_kv_block_free(p->kv, r->held, r->n_held);
    free(r->held);
    r->held = NULL;
    r->n_held = 0;
    sseq *q = r->dq;
    td_sched_core_remote_computed(&d->core, &q->c);
    bool ended;
    take_token(s, d, q, &ended);
    kick(p);
    kick(d);
}

/* ---- the run ---- */

td_status td_sim_invalid(char *why, size_t n, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (why && n) vsnprintf(why, n, fmt, ap);
    va_end(ap);
    return TD_ERR_INVALID;
}

static td_status check_cluster(const td_sim_cluster *c, char *why, size_t n) {
    if (c->n_inst < 1 || c->n_inst > TD_SIM_MAX_INSTANCES)
        return td_sim_invalid(why, n, "a cluster has 1 to %d instances", TD_SIM_MAX_INSTANCES);
    int32_t n_d = 0, n_p = 0;
    for (int32_t i = 0; i < c->n_inst; i++) {
        const td_sim_instance *x = &c->inst[i];
        const td_sched_params *p = &x->sched;
        if (p->max_running < 1 || p->max_batch_tokens < p->max_running || p->max_waiting < 0 ||
            p->reserve_output_tokens < 0 || p->max_ctx < 2 || x->block_size < 1 ||
            x->n_blocks < 1 || (int64_t)x->n_blocks * x->block_size < p->max_ctx)
            return td_sim_invalid(
                why, n,
                "instance %d: its scheduler parameters or pool cannot run (a pool of at "
                "least max_ctx tokens, max_batch_tokens >= max_running)",
                i);
        if (x->block_size != c->inst[0].block_size ||
            memcmp(&p->compat, &c->inst[0].sched.compat, sizeof p->compat) != 0)
            return td_sim_invalid(why, n, "instance %d: another block size or compatibility hash",
                                  i);
        if (x->host < -1 || x->host >= TD_SIM_MAX_INSTANCES || !(x->beside_overhead_s >= 0))
            return td_sim_invalid(why, n, "instance %d: host is -1 to %d, beside overhead >= 0", i,
                                  TD_SIM_MAX_INSTANCES - 1);
        n_p += x->role == TD_SIM_PREFILL;
        n_d += x->role != TD_SIM_PREFILL;
        if (x->role == TD_SIM_DECODE && !c->router)
            return td_sim_invalid(why, n, "decode instances need the router");
    }
    if (n_d == 0) return td_sim_invalid(why, n, "no decode or colocated instance");
    if (!(c->poll_interval_s == 0 || (c->poll_interval_s >= 1e-3 && c->poll_interval_s <= 60)))
        return td_sim_invalid(why, n, "poll_interval_s (the router's polls) is 0 or 0.001 to 60 s");
    if (!c->router && c->n_inst != 1)
        return td_sim_invalid(why, n, "without the router a cluster is one instance");
    if (n_p && !c->router) return td_sim_invalid(why, n, "prefill instances need the router");
    return TD_OK;
}

td_status td_sim_run(const td_sim_cluster *c, const td_sim_request *reqs, int32_t n,
                     bool collect_itl, td_sim_outcome *out, td_sim_stats *stats, char *why,
                     size_t why_len) {
    memset(stats, 0, sizeof *stats);
    td_status st = check_cluster(c, why, why_len);
    if (st != TD_OK) return st;
    for (int32_t i = 0; i < n; i++) {
        int64_t len = 0;
        for (int32_t k = 0; k < reqs[i].n_seg; k++) {
            if (reqs[i].seg[k].n_tokens < 0)
                return td_sim_invalid(why, why_len, "request %d: bad segment", i);
            len += reqs[i].seg[k].n_tokens;
        }
        if (len < 1 || len > (1 << 24) || reqs[i].n_output < 1 || !(reqs[i].t_arrival >= 0) ||
            (i > 0 && reqs[i].t_arrival < reqs[i - 1].t_arrival))
            return td_sim_invalid(
                why, why_len,
                "request %d: a prompt of 1 to 2^24 tokens, an output of >= 1, arrivals "
                "in order",
                i);
    }
    memset(out, 0, (size_t)n * sizeof *out);
    sim *s = calloc(1, sizeof *s);
    if (!s) return TD_ERR_NOMEM;
    s->c = c;
    s->reqs = reqs;
    s->n_req = n;
    s->out = out;
    s->st = stats;
    s->collect_itl = collect_itl;
    s->rng = 0x7a6e64656d73696dull;
    s->block_size = c->inst[0].block_size;
    s->compat = c->inst[0].sched.compat;
    s->r = calloc((size_t)TD_MAX(n, 1), sizeof *s->r);
    s->queue = malloc((size_t)TD_MAX(n, 1) * sizeof *s->queue);
    s->rt = calloc((size_t)c->n_inst, sizeof *s->rt);
    s->overlap = calloc((size_t)c->n_inst, sizeof *s->overlap);
    st = s->r && s->queue && s->rt && s->overlap ? TD_OK : TD_ERR_NOMEM;
    int32_t n_open = 0;
    for (int32_t i = 0; st == TD_OK && i < c->n_inst; i++) {
        sinst *in = &s->inst[i];
        in->cfg = c->inst[i];
        in->s = s;
        in->index = i;
        td_kv_params kp = td_kv_default_params();
        kp.n_layers = kp.n_kv_heads = kp.head_dim = 1; /* accounting only */
        kp.block_size = in->cfg.block_size;
        kp.n_blocks = in->cfg.n_blocks;
        kp.event_capacity = 16;
        td_sched_core_hooks hooks = {.ctx = in, .admitted = on_admitted, .preempted = on_preempted};
        if (td_kv_pool_create(&kp, &in->kv) != TD_OK ||
            td_sched_core_init(&in->core, &in->cfg.sched, in->kv, &hooks) != TD_OK)
            st = TD_ERR_NOMEM;
        else
            n_open++;
    }
    if (st == TD_OK && c->router && c->poll_interval_s > 0) push(s, 0, EV_POLL, 0);
    for (int32_t i = 0; st == TD_OK && i < n; i++) push(s, reqs[i].t_arrival, EV_ARRIVAL, i);
    while (st == TD_OK && s->n_heap > 0 && !s->oom) {
        event e = pop(s);
        s->now = e.t;
        stats->events++;
        switch (e.kind) {
        case EV_ARRIVAL: arrive(s, e.idx); break;
        case EV_STEP_END:
            if (!s->inst[e.idx].busy || e.gen != s->inst[e.idx].gen) break; /* moved since */
            step_end(&s->inst[e.idx]);
            drain_router_queue(s);
            step_start(&s->inst[e.idx]);
            host_changed(&s->inst[e.idx]);
            break;
        case EV_XFER_DONE:
            xfer_done(s, e.idx);
            drain_router_queue(s);
            break;
        case EV_KICK:
            s->inst[e.idx].kick_pending = false;
            if (!s->inst[e.idx].busy) {
                step_start(&s->inst[e.idx]);
                host_changed(&s->inst[e.idx]);
            }
            break;
        case EV_POLL: poll_round(s); break;
        }
    }
    if (s->oom) st = TD_ERR_NOMEM;
    stats->t_end = s->now;
    /* What never got anywhere (more than the cluster can ever hold) failed. */
    for (int32_t i = 0; st == TD_OK && i < n; i++)
        if (!s->r[i].done) req_fail(s, i);
    for (int32_t i = 0; i < n_open; i++) {
        sinst *in = &s->inst[i];
        while (in->core.n_running) seq_end(in, (sseq *)in->core.running[0]);
        while (in->core.waiting) seq_end(in, (sseq *)in->core.waiting);
        td_sched_core_free(&in->core);
        td_kv_pool_destroy(in->kv);
    }
    for (int32_t i = 0; s->r && i < n; i++) {
        free(s->r[i].tokens);
        free(s->r[i].hashes);
        free(s->r[i].held);
    }
    free(s->r);
    free(s->queue);
    free(s->rt);
    free(s->overlap);
    free(s->heap);
    free(s);
    if (st != TD_OK) {
        free(stats->itl);
        stats->itl = NULL;
        stats->n_itl = 0;
    }
    return st;
}
