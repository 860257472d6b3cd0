/* The scheduling policy (core.h): lists, admission, batch, preemption and
 * prefix-cache bookkeeping over a td_kv_pool. */
#include "core.h"

#include <math.h>
#include <string.h>

td_status td_sched_core_init(td_sched_core *c, const td_sched_params *p, td_kv_pool *kv,
                             const td_sched_core_hooks *hooks) {
    memset(c, 0, sizeof *c);
    c->p = *p;
    c->kv = kv;
    c->block_size = td_kv_pool_params(kv)->block_size;
    if (hooks) c->hooks = *hooks;
    c->running = calloc((size_t)p->max_running, sizeof *c->running);
    c->batch = calloc((size_t)p->max_running, sizeof *c->batch);
    if (!c->running || !c->batch || td_kv_hmap_init(&c->pending, 1024) != TD_OK) {
        td_sched_core_free(c);
        return TD_ERR_NOMEM;
    }
    return TD_OK;
}

void td_sched_core_free(td_sched_core *c) {
    td_kv_hmap_free(&c->pending);
    free(c->running);
    free(c->batch);
    c->running = c->batch = NULL;
}

int32_t td_sched_core_blocks_for(const td_sched_core *c, int64_t n_tokens) {
    return (int32_t)((n_tokens + c->block_size - 1) / c->block_size);
}

td_status td_sched_seq_init(td_sched_seq *q, const td_sched_core *c, const int32_t *prompt,
                            int32_t n_prompt, int32_t max_tokens) {
    int64_t out_cap = TD_MIN((int64_t)max_tokens, (int64_t)c->p.max_ctx - n_prompt);
    q->max_tokens = (int32_t)out_cap;
    q->tok_cap = n_prompt + q->max_tokens;
    q->tokens = malloc((size_t)q->tok_cap * sizeof *q->tokens);
    q->blk_cap = td_sched_core_blocks_for(c, q->tok_cap);
    q->blocks = malloc((size_t)q->blk_cap * sizeof *q->blocks);
    q->hashes = malloc((size_t)q->blk_cap * sizeof *q->hashes);
    if (!q->tokens || !q->blocks || !q->hashes) return TD_ERR_NOMEM;
    memcpy(q->tokens, prompt, (size_t)n_prompt * sizeof *q->tokens);
    q->n_prompt = q->n_tokens = n_prompt;
    return TD_OK;
}

void td_sched_seq_free(td_sched_seq *q) {
    free(q->tokens);
    free(q->blocks);
    free(q->hashes);
    q->tokens = q->blocks = NULL;
    q->hashes = NULL;
}

void td_sched_core_enqueue(td_sched_core *c, td_sched_seq *q) {
    td_sched_seq **tail = &c->waiting;
    while (*tail) tail = &(*tail)->next;
    *tail = q;
}

void td_sched_core_requeue_head(td_sched_core *c, td_sched_seq *q) {
    q->running = false;
    q->next = c->waiting;
    c->waiting = q;
}

int32_t td_sched_core_running_index(const td_sched_core *c, const td_sched_seq *q) {
    for (int32_t i = 0; i < c->n_running; i++)
        if (c->running[i] == q) return i;
    return -1;
}

static void running_remove(td_sched_core *c, int32_t i) {
    memmove(&c->running[i], &c->running[i + 1], (size_t)(c->n_running - i - 1) * sizeof(void *));
    c->n_running--;
}

void td_sched_core_unlink(td_sched_core *c, td_sched_seq *q) {
    if (q->running) {
        int32_t i = td_sched_core_running_index(c, q);
        if (i >= 0) running_remove(c, i);
        return;
    }
    for (td_sched_seq **pp = &c->waiting; *pp; pp = &(*pp)->next)
        if (*pp == q) {
            *pp = q->next;
            q->next = NULL;
            return;
        }
}

/* Forgets the pending prefix blocks q registered and did not publish. */
static void pending_drop(td_sched_core *c, td_sched_seq *q) {
    for (int32_t b = q->n_published; b < q->n_pend_end; b++)
        td_kv_hmap_del(&c->pending, q->hashes[b]);
    q->n_pend_end = 0;
}

/* Frees q's blocks and reservation; it computed nothing any more. */
static void drop_kv(td_sched_core *c, td_sched_seq *q) {
    pending_drop(c, q);
    if (q->n_blocks) td_kv_block_free(c->kv, q->blocks, q->n_blocks);
    if (q->n_reserved) td_kv_unreserve(c->kv, q->n_reserved);
    q->n_blocks = q->n_reserved = 0;
}

void td_sched_core_release(td_sched_core *c, td_sched_seq *q) {
    drop_kv(c, q);
    q->running = false;
    q->remote_wait = false;
}

void td_sched_core_restart(td_sched_core *c, td_sched_seq *q) {
    td_sched_core_unlink(c, q);
    drop_kv(c, q);
    q->remote_wait = false;
    q->n_computed = 0;
    q->n_published = 0;
    q->chunk = 0;
    td_sched_core_requeue_head(c, q);
}

/* Blocks the sequence keeps beyond its tokens: the output it may still
 * produce, capped by reserve_output_tokens, not past max_tokens. */
static int32_t reserve_target(const td_sched_core *c, const td_sched_seq *q) {
    int32_t produced = q->n_tokens - q->n_prompt;
    int64_t left = (int64_t)q->max_tokens - produced;
    int64_t want = TD_MIN(left, (int64_t)c->p.reserve_output_tokens);
    int64_t final_tokens = (int64_t)q->n_tokens + want;
    int32_t have_for_tokens = td_sched_core_blocks_for(c, q->n_tokens);
    return TD_MAX(0, td_sched_core_blocks_for(c, final_tokens) - have_for_tokens);
}

/* Extends q's chain of block hashes to its first n full blocks (a token
 * never changes, so each block is hashed once). */
static void hash_blocks(const td_sched_core *c, td_sched_seq *q, int32_t n) {
    int32_t bs = c->block_size;
    for (; q->n_hash_valid < n; q->n_hash_valid++) {
        int32_t b = q->n_hash_valid;
        td_kv_hash parent = b == 0 ? c->p.compat : q->hashes[b - 1];
        q->hashes[b] = td_kv_hash_block(parent, q->tokens + (size_t)b * (size_t)bs, bs, NULL, 0);
    }
}

/* Tries to admit the head of the waiting queue. */
static bool admit_one(td_sched_core *c, td_sched_seq *q) {
    int32_t bs = c->block_size;
    int32_t matched = 0;
    if (c->p.prefix_cache) {
        /* Hash the full blocks of what must be computed, keeping at least the
         * last token to run (its logits give the next token). */
        int32_t n_full = (q->n_tokens - 1) / bs;
        hash_blocks(c, q, n_full);
        matched = td_kv_cache_acquire(c->kv, q->hashes, n_full, q->blocks);
        if (matched < n_full && c->n_running > 0 &&
            td_kv_hmap_get(&c->pending, q->hashes[matched]) >= 0) {
            /* Another sequence is computing this very block: wait one or
             * two steps for it rather than compute the prefix twice. */
            td_kv_block_free(c->kv, q->blocks, matched);
            return false;
        }
    }
    int32_t need_now = td_sched_core_blocks_for(c, q->n_tokens) - matched;
    int32_t reserve = reserve_target(c, q);
    int32_t n_free = td_kv_pool_n_free(c->kv);
    if (need_now + reserve > n_free) {
        if (c->n_running == 0 && need_now <= n_free) {
            reserve = n_free - need_now; /* alone: take what there is */
        } else {
            td_kv_block_free(c->kv, q->blocks, matched);
            return false;
        }
    }
    td_status st = td_kv_block_alloc(c->kv, need_now, q->blocks + matched);
    TD_ASSERT(st == TD_OK);
    st = td_kv_reserve(c->kv, reserve);
    TD_ASSERT(st == TD_OK);
    q->n_blocks = matched + need_now;
    q->n_reserved = reserve;
    q->n_published = matched;
    q->n_pend_end = matched;
    if (c->p.prefix_cache) {
        int32_t n_full = (q->n_tokens - 1) / bs;
        td_status pst = TD_OK;
        while (q->n_pend_end < n_full && pst == TD_OK) {
            if (!td_kv_hmap_put(&c->pending, q->hashes[q->n_pend_end], 1, &pst)) break;
            q->n_pend_end++;
        }
    }
    q->n_computed = matched * bs;
    if (q->n_preemptions == 0) q->n_cached_tokens = matched * bs;
    q->running = true;
    q->admit_order = ++c->admit_counter;
    return true;
}

int32_t td_sched_core_admit(td_sched_core *c) {
    int32_t n = 0;
    while (c->waiting && c->n_running < c->p.max_running) {
        td_sched_seq *q = c->waiting;
        if (!admit_one(c, q)) break;
        c->waiting = q->next;
        q->next = NULL;
        c->running[c->n_running++] = q;
        n++;
        if (c->hooks.admitted && c->hooks.admitted(c->hooks.ctx, q)) q->remote_wait = true;
    }
    return n;
}

/* Puts a running sequence back at the head of the queue, freeing its KV;
 * it recomputes prompt + output so far when admitted again. */
static void preempt(td_sched_core *c, int32_t i) {
    td_sched_seq *q = c->running[i];
    running_remove(c, i);
    drop_kv(c, q);
    q->n_computed = 0;
    q->n_published = 0;
    q->chunk = 0;
    q->n_preemptions++;
    td_sched_core_requeue_head(c, q);
    c->preemptions++;
    if (c->hooks.preempted) c->hooks.preempted(c->hooks.ctx, q);
}

/* Gives q the blocks to hold `upto` tokens; preempts the latest admitted
 * other sequences when the pool is dry. False if q itself had to go. */
static bool grow_blocks(td_sched_core *c, td_sched_seq *q, int32_t upto) {
    int32_t need = td_sched_core_blocks_for(c, upto) - q->n_blocks;
    while (need > 0) {
        if (q->n_reserved > 0) {
            int32_t k = TD_MIN(need, q->n_reserved);
            td_kv_block_alloc_reserved(c->kv, k, q->blocks + q->n_blocks);
            q->n_reserved -= k;
            q->n_blocks += k;
            need -= k;
            continue;
        }
        if (td_kv_block_alloc(c->kv, need, q->blocks + q->n_blocks) == TD_OK) {
            q->n_blocks += need;
            return true;
        }
        /* Last resort: recompute the most recently admitted sequence (the
         * running list is in admission order, so it is the last one). */
        int32_t victim = c->n_running - 1;
        /* Never one whose blocks a peer writes or reads (remote prefill,
         * export): q itself always qualifies (it is computing). */
        while (victim >= 0 && (c->running[victim]->remote_wait || c->running[victim]->pinned))
            victim--;
        TD_ASSERT(victim >= 0);
        bool self = c->running[victim] == q;
        preempt(c, victim);
        if (self) return false;
    }
    return true;
}

/* Publishes the hashes of q's newly full, computed blocks. */
static void publish_blocks(td_sched_core *c, td_sched_seq *q) {
    if (!c->p.prefix_cache) return;
    int32_t full = q->n_computed / c->block_size;
    hash_blocks(c, q, full);
    while (q->n_published < full) {
        int32_t b = q->n_published;
        td_kv_cache_insert(c->kv, q->blocks[b], q->hashes[b]);
        if (b < q->n_pend_end) td_kv_hmap_del(&c->pending, q->hashes[b]);
        q->n_published++;
    }
}

/* Solves the fit's normal equations restricted to the coefficients in
 * use (use[i]: a, b, c), the others 0. A tiny ridge, relative to each
 * diagonal, keeps a direction the steps have not varied along (every one
 * with the same batch) from blowing up: the solution then predicts the
 * steps seen and leans on the others. False when singular. */
static bool est_solve_subset(const td_sched_step_est *e, const bool use[3], double x[3]) {
    const double full[3][4] = {{e->w, e->sd, e->sp, e->st},
                               {e->sd, e->sdd, e->sdp, e->sdt},
                               {e->sp, e->sdp, e->spp, e->spt}};
    int idx[3], k = 0;
    for (int i = 0; i < 3; i++)
        if (use[i]) idx[k++] = i;
    double m[3][4];
    for (int i = 0; i < k; i++) {
        for (int j = 0; j < k; j++) m[i][j] = full[idx[i]][idx[j]];
        m[i][k] = full[idx[i]][3];
        m[i][i] = m[i][i] * (1 + 1e-6) + 1e-12;
    }
    for (int p = 0; p < k; p++) { /* Gaussian elimination, partial pivoting */
        int piv = p;
        for (int i = p + 1; i < k; i++)
            if (fabs(m[i][p]) > fabs(m[piv][p])) piv = i;
        if (!(fabs(m[piv][p]) > 0)) return false;
        for (int j = 0; j <= k; j++) {
            double t = m[p][j];
            m[p][j] = m[piv][j];
            m[piv][j] = t;
        }
        for (int i = p + 1; i < k; i++) {
            double f = m[i][p] / m[p][p];
            for (int j = p; j <= k; j++) m[i][j] -= f * m[p][j];
        }
    }
    double y[3];
    for (int i = k - 1; i >= 0; i--) {
        double v = m[i][k];
        for (int j = i + 1; j < k; j++) v -= m[i][j] * y[j];
        y[i] = v / m[i][i];
    }
    x[0] = x[1] = x[2] = 0;
    for (int i = 0; i < k; i++) {
        if (!isfinite(y[i])) return false;
        x[idx[i]] = y[i];
    }
    return true;
}

/* The fit (a, b, c) with no coefficient negative (a step's time does not
 * shrink with its work): of the least-squares solutions with a, b or both
 * held at 0, the feasible one that fits the steps best. False while no
 * prompt token has been seen (nothing says what one costs) or no feasible
 * solution gives prompt tokens a cost. */
static bool est_solve(const td_sched_step_est *e, double x[3]) {
    if (e->w <= 0 || e->spp <= 0) return false;
    double best = INFINITY;
    for (int s = 0; s < 4; s++) {
        bool use[3] = {(s & 1) == 0, (s & 2) == 0, true};
        double y[3];
        if (!est_solve_subset(e, use, y) || y[0] < 0 || y[1] < 0 || !(y[2] > 0)) continue;
        /* the weighted residual sum of squares, from the sums */
        double rss = e->stt - 2 * (y[0] * e->st + y[1] * e->sdt + y[2] * e->spt) +
                     y[0] * y[0] * e->w + y[1] * y[1] * e->sdd + y[2] * y[2] * e->spp +
                     2 * (y[0] * y[1] * e->sd + y[0] * y[2] * e->sp + y[1] * y[2] * e->sdp);
        if (rss < best) {
            best = rss;
            memcpy(x, y, sizeof y);
        }
    }
    return best < INFINITY;
}

double td_sched_core_estimate(const td_sched_core *c, int32_t n_decode, int32_t n_prompt) {
    double x[3];
    if (!est_solve(&c->est, x)) return -1;
    return TD_MAX(0.0, x[0] + x[1] * n_decode + x[2] * n_prompt);
}

void td_sched_core_observe(td_sched_core *c, double dt) {
    if (!(dt > 0) || !isfinite(dt)) return;
    td_sched_step_est *e = &c->est;
    double d = c->step_decodes, p = c->step_prompt, l = TD_SCHED_EST_DECAY;
    e->w = l * e->w + 1;
    e->sd = l * e->sd + d;
    e->sp = l * e->sp + p;
    e->st = l * e->st + dt;
    e->stt = l * e->stt + dt * dt;
    e->sdd = l * e->sdd + d * d;
    e->spp = l * e->spp + p * p;
    e->sdp = l * e->sdp + d * p;
    e->sdt = l * e->sdt + d * dt;
    e->spt = l * e->spt + p * dt;
    if (c->step_decodes > 0) c->max_mixed = TD_MAX(c->max_mixed, c->step_prompt);
}

/* The prompt tokens a step with n_decode decodes may take under the TPOT
 * target: those the fit says fit in the time the decodes leave, at least
 * one (prompts progress every step, if only by a token: on a CPU a prompt
 * token can cost as much as a decode, and a block of them would break any
 * target near the decode step), and at most twice the most a step beside
 * decodes has taken so far: the fit extrapolates only a little past what
 * it has seen (a fit from prompts alone and decodes alone cannot tell what
 * they cost together), so the budget grows by doubling as its steps
 * confirm it. */
static int32_t tpot_budget(const td_sched_core *c, int32_t n_decode) {
    const int32_t floor_tok = 1;
    double x[3];
    if (!est_solve(&c->est, x)) return floor_tok;
    double decodes = x[0] + x[1] * n_decode;
    double target = c->p.tpot_target_s > 0 ? c->p.tpot_target_s : c->p.tpot_decode_factor * decodes;
    double room = target - decodes;
    double fit = room > 0 ? floor(room / x[2]) : 0;
    fit = TD_MIN(fit, 2.0 * c->max_mixed);
    return fit >= c->p.max_batch_tokens ? c->p.max_batch_tokens : TD_MAX(floor_tok, (int32_t)fit);
}

int32_t td_sched_core_build_batch(td_sched_core *c) {
    int32_t budget = c->p.max_batch_tokens, n = 0, n_decode = 0;
    /* the prompt tokens a step that decodes may take (prefill_share) */
    int32_t share = c->p.prefill_share > 0 && c->p.prefill_share < 1
                        ? TD_MAX(1, (int32_t)(c->p.prefill_share * c->p.max_batch_tokens))
                        : c->p.max_batch_tokens;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && n_decode > 0) {
            budget = TD_MIN(budget, share);
            if (c->p.tpot_target_s > 0 || c->p.tpot_decode_factor > 1)
                budget = TD_MIN(budget, tpot_budget(c, n_decode));
        }
        for (int32_t i = 0; i < c->n_running && budget > 0;) {
            td_sched_seq *q = c->running[i];
            int32_t left = q->n_tokens - q->n_computed;
            bool decode = left == 1;
            if ((pass == 0) != decode || q->chunk > 0 || q->remote_wait) {
                i++;
                continue;
            }
            int32_t take = TD_MIN(left, budget);
            if (!grow_blocks(c, q, q->n_computed + take)) {
                /* q was preempted; the list shifted. Restart the pass so
                 * sequences already chosen keep their blocks. */
                budget = c->p.max_batch_tokens;
                n_decode = 0;
                for (int32_t k = 0; k < c->n_running; k++) c->running[k]->chunk = 0;
                pass = -1;
                break;
            }
            /* grow_blocks may have preempted later sequences, never an
             * earlier one, so index i still names q. */
            q->chunk = take;
            budget -= take;
            n_decode += decode;
            i++;
        }
    }
    /* Collect in running order (preemptions may have removed chosen ones). */
    c->step_decodes = c->step_prompt = 0;
    for (int32_t i = 0; i < c->n_running; i++) {
        td_sched_seq *q = c->running[i];
        if (q->chunk == 0) continue;
        c->batch[n++] = q;
        if (q->n_tokens - q->n_computed == 1)
            c->step_decodes++;
        else
            c->step_prompt += q->chunk;
    }
    return n;
}

bool td_sched_core_has_logits(const td_sched_seq *q) {
    return q->n_computed + q->chunk >= q->n_tokens;
}

void td_sched_core_computed(td_sched_core *c, td_sched_seq *q) {
    q->n_computed += q->chunk;
    q->chunk = 0;
    publish_blocks(c, q);
}

void td_sched_core_append(td_sched_core *c, td_sched_seq *q, int32_t token) {
    (void)c;
    TD_ASSERT(q->n_tokens < q->tok_cap);
    q->tokens[q->n_tokens++] = token;
}

void td_sched_core_remote_computed(td_sched_core *c, td_sched_seq *q) {
    q->remote_wait = false;
    q->n_computed = q->n_tokens;
    publish_blocks(c, q);
}

void td_sched_core_remote_failed(td_sched_core *c, td_sched_seq *q) {
    pending_drop(c, q);
    q->remote_wait = false;
    q->local_only = true;
}

int64_t td_sched_core_queued_prefill_tokens(const td_sched_core *c) {
    int64_t queued = 0;
    for (const td_sched_seq *q = c->waiting; q; q = q->next) queued += q->n_tokens - q->n_computed;
    for (int32_t i = 0; i < c->n_running; i++) {
        const td_sched_seq *q = c->running[i];
        if (q->remote_wait) continue; /* its prefill runs elsewhere */
        if (q->n_tokens - q->n_computed > 1) queued += q->n_tokens - q->n_computed;
    }
    return queued;
}

int32_t td_sched_core_n_waiting(const td_sched_core *c) {
    int32_t n = 0;
    for (const td_sched_seq *q = c->waiting; q; q = q->next) n++;
    return n;
}
