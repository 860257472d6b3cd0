/* The step-trace replay (replay.h). */
#include "replay.h"

#include <errno.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/sched/core.h"

/* Tickets are numbered from 1 in submission order by one scheduler. */
#define MAX_TICKET (1 << 24)

typedef struct {
    td_sched_seq c;
    uint64_t ticket;
} rseq;

typedef struct {
    td_replay_result *r;
    const char *path;
    int64_t line;
    td_kv_pool *kv;
    td_sched_core core;
    rseq **by_ticket; /* (cap) */
    int64_t cap;
    /* this step's decisions, as the core took them */
    uint64_t *adm, *pre;
    int32_t n_adm, n_pre, cap_dec;
    bool dec_oom;
} replay;

static td_status fail(replay *rp, td_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(rp->r->why, sizeof rp->r->why, "%s:%lld: ", rp->path, (long long)rp->line);
    if (n > 0 && (size_t)n < sizeof rp->r->why)
        vsnprintf(rp->r->why + n, sizeof rp->r->why - (size_t)n, fmt, ap);
    va_end(ap);
    return st;
}

static void dec_push(replay *rp, uint64_t **v, int32_t *n, uint64_t t) {
    if (*n == rp->cap_dec) {
        rp->dec_oom = true; /* more than max_running admissions or preemptions in one step */
        return;
    }
    (*v)[(*n)++] = t;
}

static bool on_admitted(void *ctx, td_sched_seq *q) {
    replay *rp = ctx;
    dec_push(rp, &rp->adm, &rp->n_adm, ((rseq *)q)->ticket);
    return false; /* colocated: every prefill is computed here */
}

static void on_preempted(void *ctx, td_sched_seq *q) {
    replay *rp = ctx;
    dec_push(rp, &rp->pre, &rp->n_pre, ((rseq *)q)->ticket);
}

static bool get_int(json_t *o, const char *k, int64_t lo, int64_t hi, int64_t *v) {
    json_t *x = json_object_get(o, k);
    if (!json_is_integer(x)) return false;
    *v = json_integer_value(x);
    return *v >= lo && *v <= hi;
}

static td_status open_header(replay *rp, json_t *h) {
    int64_t version, max_running, mbt, mw, rot, max_ctx, n_blocks, bs;
    json_t *pc = json_object_get(h, "prefix_cache");
    const char *compat = json_string_value(json_object_get(h, "compat"));
    td_kv_hash ch;
    if (!json_is_object(h) || !get_int(h, "tandem_step_trace", 1, 1, &version) ||
        !get_int(h, "max_running", 1, 1024, &max_running) ||
        !get_int(h, "max_batch_tokens", max_running, 1 << 20, &mbt) ||
        !get_int(h, "max_waiting", 0, 1 << 20, &mw) ||
        !get_int(h, "reserve_output_tokens", 0, 1 << 24, &rot) ||
        !get_int(h, "max_ctx", 2, 1 << 24, &max_ctx) ||
        !get_int(h, "n_blocks", 1, 1 << 24, &n_blocks) || !get_int(h, "block_size", 1, 1024, &bs) ||
        !json_is_boolean(pc) || !compat || !td_kv_hash_parse(compat, &ch) ||
        n_blocks * bs < max_ctx)
        return fail(rp, TD_ERR_FORMAT,
                    "not a step-trace header (tandem_step_trace 1 with the scheduler's "
                    "parameters and the pool's size)");
    td_kv_params kp = td_kv_default_params();
    kp.n_layers = kp.n_kv_heads = kp.head_dim = 1; /* accounting only: no KV bytes */
    kp.block_size = (int)bs;
    kp.n_blocks = (int32_t)n_blocks;
    kp.event_capacity = 16;
    td_sched_params sp = td_sched_default_params();
    sp.max_running = (int32_t)max_running;
    sp.max_batch_tokens = (int32_t)mbt;
    sp.max_waiting = (int32_t)mw;
    sp.reserve_output_tokens = (int32_t)rot;
    sp.max_ctx = (int32_t)max_ctx;
    sp.prefix_cache = json_is_true(pc);
    sp.compat = ch;
    /* absent in traces from before it existed: no limit */
    json_t *share = json_object_get(h, "prefill_share");
    if (share &&
        (!json_is_number(share) || json_number_value(share) <= 0 || json_number_value(share) > 1))
        return fail(rp, TD_ERR_FORMAT, "step-trace header: prefill_share must be in (0, 1]");
    sp.prefill_share = share ? json_number_value(share) : 1;
    json_t *tpot = json_object_get(h, "tpot_target_s");
    if (tpot && (!json_is_number(tpot) || !(json_number_value(tpot) >= 0) ||
                 json_number_value(tpot) >= 3600))
        return fail(rp, TD_ERR_FORMAT, "step-trace header: tpot_target_s must be in [0, 3600)");
    sp.tpot_target_s = tpot ? json_number_value(tpot) : 0;
    json_t *tf = json_object_get(h, "tpot_decode_factor");
    if (tf &&
        (!json_is_number(tf) || !(json_number_value(tf) >= 0) || json_number_value(tf) >= 1e6))
        return fail(rp, TD_ERR_FORMAT, "step-trace header: tpot_decode_factor must be in [0, 1e6)");
    sp.tpot_decode_factor = tf ? json_number_value(tf) : 0;
    td_sched_core_hooks hooks = {.ctx = rp, .admitted = on_admitted, .preempted = on_preempted};
    rp->cap_dec = (int32_t)max_running;
    rp->adm = calloc((size_t)rp->cap_dec, sizeof *rp->adm);
    rp->pre = calloc((size_t)rp->cap_dec, sizeof *rp->pre);
    if (!rp->adm || !rp->pre || td_kv_pool_create(&kp, &rp->kv) != TD_OK ||
        td_sched_core_init(&rp->core, &sp, rp->kv, &hooks) != TD_OK)
        return fail(rp, TD_ERR_NOMEM, "out of memory");
    return TD_OK;
}

static rseq *seq_of(replay *rp, json_t *t) {
    if (!json_is_integer(t)) return NULL;
    int64_t k = json_integer_value(t);
    return k > 0 && k < rp->cap ? rp->by_ticket[k] : NULL;
}

static void seq_drop(replay *rp, rseq *q) {
    td_sched_core_unlink(&rp->core, &q->c);
    td_sched_core_release(&rp->core, &q->c);
    rp->by_ticket[q->ticket] = NULL;
    td_sched_seq_free(&q->c);
    free(q);
}

/* ["in", ticket, max_tokens, [prompt]] */
static td_status arrive(replay *rp, json_t *e) {
    json_t *jt = json_array_get(e, 1), *jm = json_array_get(e, 2), *jp = json_array_get(e, 3);
    if (!json_is_integer(jt) || !json_is_integer(jm) || !json_is_array(jp))
        return fail(rp, TD_ERR_FORMAT, "an \"in\" event is [\"in\", ticket, max_tokens, [ids]]");
    int64_t t = json_integer_value(jt), max_tokens = json_integer_value(jm);
    size_t n = json_array_size(jp);
    if (t < 1 || t >= MAX_TICKET || max_tokens < 1 || max_tokens > (1 << 24) || n < 1 ||
        (int64_t)n + 1 > rp->core.p.max_ctx)
        return fail(rp, TD_ERR_FORMAT,
                    "arrival %lld: ticket, max_tokens or prompt length out "
                    "of range",
                    (long long)t);
    if (t >= rp->cap) {
        int64_t cap = TD_MAX(rp->cap * 2, t + 1024);
        rseq **v = realloc(rp->by_ticket, (size_t)cap * sizeof *v);
        if (!v) return fail(rp, TD_ERR_NOMEM, "out of memory");
        memset(v + rp->cap, 0, (size_t)(cap - rp->cap) * sizeof *v);
        rp->by_ticket = v;
        rp->cap = cap;
    }
    if (rp->by_ticket[t]) return fail(rp, TD_ERR_FORMAT, "ticket %lld arrives twice", (long long)t);
    int32_t *prompt = malloc(n * sizeof *prompt);
    rseq *q = calloc(1, sizeof *q);
    if (!prompt || !q) {
        free(prompt);
        free(q);
        return fail(rp, TD_ERR_NOMEM, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_array_get(jp, i);
        int64_t v = json_is_integer(x) ? json_integer_value(x) : -1;
        if (v < 0 || v > INT32_MAX) {
            free(prompt);
            free(q);
            return fail(rp, TD_ERR_FORMAT, "arrival %lld: prompt id %zu is not a token id",
                        (long long)t, i);
        }
        prompt[i] = (int32_t)v;
    }
    q->ticket = (uint64_t)t;
    td_status st = td_sched_seq_init(&q->c, &rp->core, prompt, (int32_t)n, (int32_t)max_tokens);
    free(prompt);
    if (st != TD_OK) {
        td_sched_seq_free(&q->c);
        free(q);
        return fail(rp, TD_ERR_NOMEM, "out of memory");
    }
    rp->by_ticket[t] = q;
    td_sched_core_enqueue(&rp->core, &q->c);
    rp->r->requests++;
    return TD_OK;
}

/* An event's kind, "" for anything else. */
static const char *kind_of(json_t *e) {
    const char *k = json_is_array(e) ? json_string_value(json_array_get(e, 0)) : NULL;
    return k ? k : "";
}

/* The recorded tickets of events of one kind in ev, in order, against the
 * core's; false with why set when they differ. */
static bool same_tickets(replay *rp, json_t *ev, const char *kind, const uint64_t *got,
                         int32_t n_got, int64_t step) {
    int32_t k = 0;
    for (size_t i = 0; i < json_array_size(ev); i++) {
        json_t *e = json_array_get(ev, i);
        if (strcmp(kind_of(e), kind) != 0) continue;
        json_t *t = json_array_get(e, 1);
        uint64_t want = json_is_integer(t) ? (uint64_t)json_integer_value(t) : 0;
        if (k >= n_got || got[k] != want) {
            fail(rp, TD_OK, "step %lld: the real scheduler's %s #%d was ticket %llu, the core's %s",
                 (long long)step, kind, k + 1, (unsigned long long)want,
                 k < n_got ? "another" : "none");
            return false;
        }
        k++;
    }
    if (k != n_got) {
        fail(rp, TD_OK, "step %lld: the core took %d %s decisions, the real scheduler %d",
             (long long)step, n_got, kind, k);
        return false;
    }
    return true;
}

/* One step line. TD_OK (rp->r->same false on a difference) or an error. */
static td_status replay_step(replay *rp, json_t *line) {
    json_t *ev = json_object_get(line, "ev");
    int64_t step;
    if (!json_is_object(line) || !json_is_array(ev) || !get_int(line, "step", 0, INT64_MAX, &step))
        return fail(rp, TD_ERR_FORMAT, "a step line is {\"step\": N, \"ev\": [...]}");
    size_t n_ev = json_array_size(ev), i = 0;
    rp->r->steps++;
    /* Before admission: arrivals and ends (cancels). */
    for (; i < n_ev; i++) {
        json_t *e = json_array_get(ev, i);
        const char *k = kind_of(e);
        if (!*k) return fail(rp, TD_ERR_FORMAT, "event %zu has no kind", i);
        if (!strcmp(k, "in")) {
            td_status st = arrive(rp, e);
            if (st != TD_OK) return st;
        } else if (!strcmp(k, "end")) {
            rseq *q = seq_of(rp, json_array_get(e, 1));
            if (!q) return fail(rp, TD_ERR_FORMAT, "event %zu ends an unknown ticket", i);
            seq_drop(rp, q);
        } else if (!strcmp(k, "rdone") || !strcmp(k, "rfail") ||
                   (!strcmp(k, "adm") && json_integer_value(json_array_get(e, 2)) != 0)) {
            return fail(rp, TD_ERR_UNSUPPORTED,
                        "the trace has remote prefills (a decode instance's): the replay covers "
                        "colocated instances");
        } else if (!strcmp(k, "adm") || !strcmp(k, "pre") || !strcmp(k, "b")) {
            break;
        } else {
            return fail(rp, TD_ERR_FORMAT, "event %zu: a \"%s\" before the admissions", i, k);
        }
    }
    rp->n_adm = rp->n_pre = 0;
    td_sched_core_admit(&rp->core);
    int32_t n = td_sched_core_build_batch(&rp->core);
    if (rp->dec_oom) return fail(rp, TD_ERR_FORMAT, "more decisions in a step than max_running");
    if (!same_tickets(rp, ev, "adm", rp->adm, rp->n_adm, step) ||
        !same_tickets(rp, ev, "pre", rp->pre, rp->n_pre, step)) {
        rp->r->same = false;
        return TD_OK;
    }
    rp->r->admissions += rp->n_adm;
    rp->r->preemptions += rp->n_pre;
    for (; i < n_ev && strcmp(kind_of(json_array_get(ev, i)), "b") != 0; i++) {
        const char *k = kind_of(json_array_get(ev, i));
        if (strcmp(k, "adm") && strcmp(k, "pre"))
            return fail(rp, TD_ERR_FORMAT, "event %zu: a \"%s\" among the admissions", i, k);
    }
    json_t *b = i < n_ev ? json_array_get(json_array_get(ev, i), 3) : NULL;
    if (i < n_ev && !json_is_array(b))
        return fail(rp, TD_ERR_FORMAT, "a \"b\" event is [\"b\", t, dt, [[ticket, pos, n]...]]");
    size_t n_b = b ? json_array_size(b) : 0;
    if ((size_t)n != n_b) {
        fail(rp, TD_OK, "step %lld: the core batched %d sequences, the real scheduler %zu",
             (long long)step, n, n_b);
        rp->r->same = false;
        return TD_OK;
    }
    for (int32_t j = 0; j < n; j++) {
        json_t *x = json_array_get(b, (size_t)j);
        const td_sched_seq *q = rp->core.batch[j];
        uint64_t t = ((const rseq *)q)->ticket;
        int64_t want_t = json_integer_value(json_array_get(x, 0)),
                want_pos = json_integer_value(json_array_get(x, 1)),
                want_n = json_integer_value(json_array_get(x, 2));
        if ((uint64_t)want_t != t || want_pos != q->n_computed || want_n != q->chunk) {
            fail(rp, TD_OK,
                 "step %lld: batch entry %d was ticket %lld at %lld for %lld tokens; the core's "
                 "is ticket %llu at %d for %d",
                 (long long)step, j, (long long)want_t, (long long)want_pos, (long long)want_n,
                 (unsigned long long)t, q->n_computed, q->chunk);
            rp->r->same = false;
            return TD_OK;
        }
    }
    if (n) {
        /* the step time the scheduler's estimate learned from */
        json_t *dt = json_array_get(json_array_get(ev, i), 2);
        if (!json_is_number(dt))
            return fail(rp, TD_ERR_FORMAT, "a \"b\" event's dt is a number of seconds");
        td_sched_core_observe(&rp->core, json_number_value(dt));
        rp->r->batches++;
    }
    rp->r->batch_seqs += n;
    if (i < n_ev) i++;
    /* After the step: each batch entry computed, then its token and end. */
    for (int32_t j = 0; j < n; j++) {
        rseq *q = (rseq *)rp->core.batch[j];
        bool logits = td_sched_core_has_logits(&q->c);
        td_sched_core_computed(&rp->core, &q->c);
        json_t *e = json_array_get(ev, i);
        if (logits && !strcmp(kind_of(e), "tok") && seq_of(rp, json_array_get(e, 1)) == q) {
            json_t *tk = json_array_get(e, 2);
            if (!json_is_integer(tk) || q->c.n_tokens >= q->c.tok_cap)
                return fail(rp, TD_ERR_FORMAT, "event %zu: a token past the sequence's end", i);
            td_sched_core_append(&rp->core, &q->c, (int32_t)json_integer_value(tk));
            rp->r->tokens++;
            e = json_array_get(ev, ++i);
        }
        if (!strcmp(kind_of(e), "end") && seq_of(rp, json_array_get(e, 1)) == q) {
            seq_drop(rp, q);
            i++;
        }
    }
    if (i != n_ev)
        return fail(rp, TD_ERR_FORMAT, "event %zu: a \"%s\" out of the step's order", i,
                    kind_of(json_array_get(ev, i)));
    return TD_OK;
}

td_status td_replay_step_trace(const char *path, td_replay_result *r) {
    memset(r, 0, sizeof *r);
    r->same = true;
    replay rp = {.r = r, .path = path};
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(r->why, sizeof r->why, "%s: %s", path, strerror(errno));
        return TD_ERR_IO;
    }
    td_status st = TD_OK;
    char *buf = NULL;
    size_t cap = 0;
    ssize_t len;
    bool have_header = false;
    while (st == TD_OK && r->same && (len = getline(&buf, &cap, f)) >= 0) {
        rp.line++;
        json_error_t err;
        json_t *j = json_loadb(buf, (size_t)len, 0, &err);
        if (!j) {
            st = fail(&rp, TD_ERR_FORMAT, "not JSON (%s)", err.text);
            break;
        }
        st = have_header ? replay_step(&rp, j) : open_header(&rp, j);
        have_header = true;
        json_decref(j);
    }
    if (st == TD_OK && !have_header) st = fail(&rp, TD_ERR_FORMAT, "empty trace");
    if (st == TD_OK && ferror(f)) {
        snprintf(r->why, sizeof r->why, "%s: read error", path);
        st = TD_ERR_IO;
    }
    free(buf);
    fclose(f);
    for (int64_t t = 0; t < rp.cap; t++)
        if (rp.by_ticket[t]) seq_drop(&rp, rp.by_ticket[t]);
    free(rp.by_ticket);
    if (rp.core.running) td_sched_core_free(&rp.core);
    td_kv_pool_destroy(rp.kv);
    free(rp.adm);
    free(rp.pre);
    return st;
}
