/* The per-job states of the KV-transfer protocol (common/transfer/
 * jobstate.h), both ends run against each other: D's job machine (td_dj)
 * and P's job (td_pj, the seen ids, the answers) exchange messages over a
 * simulated channel, in 10 ms ticks, through scenarios of a live P (fast,
 * busy with a long prompt, too busy to start in time, rejecting at
 * admission, a client that goes), a P stopped mid-job and a dead one. Each
 * scenario runs as is, then with every message it sent in that run lost,
 * duplicated, or delayed past the ones after it (reordered, arriving after
 * its job ended), one at a time. Every run checks:
 *   - safety: no put of P's lands in D's blocks at or after the moment D
 *     decodes from them, reuses them or frees them;
 *   - the job ends on D within the run, with exactly one outcome for the
 *     request (decode, or a local prefill) unless the client went;
 *   - a fence only where a message was lost or P stopped: duplicates,
 *     reorders and slow starts never fence a live P;
 *   - the figures each scenario is about (the long prompt decoded, the
 *     abort acknowledged, the lost acknowledgement fenced after the
 *     grace). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/transfer/jobstate.h"

#define DT     0.01
#define T_END  60.0
#define MAX_MS 64

/* D's times: start deadline 3 s (P gets 2.7 s), lease 3 s renewed every
 * second, silence 3 s, grace 3 s, margin 1 s: the defaults of xfer.c. */
static const td_dj_timing TIMING = {
    .start_s = 3.0, .lease_s = 3.0, .silence_s = 3.0, .grace_s = 3.0, .margin_s = 1.0};
#define P_START_S 2.7 /* D's deadline less its margin */

typedef enum {
    M_REQUEST,
    M_RENEWAL,
    M_ABORT,
    M_PROGRESS,
    M_DONE,
    M_REJECTED,
    M_FAILED,
    M_ABORTED,
} mkind;

typedef struct {
    mkind kind;
    bool to_p;
    double at;    /* delivery time */
    double sent;  /* D's send time (request, renewal, abort) */
    double until; /* renewal: the absolute end of the lease; abort: the deadline */
    int32_t tokens;
    int seq; /* send order, for the fault's choice */
} msg;

typedef enum { F_NONE, F_LOSE, F_DUP, F_DELAY } fault;

/* What P does with the job: queued for `queue` s, then `chunks` chunks of
 * `chunk` s each (a put at each chunk's start and end), a flush of 50 ms;
 * stopped (SIGSTOP) over [stop_from, stop_to); dead: never answers. */
typedef struct {
    const char *name;
    double queue, chunk;
    int chunks;
    bool reject;      /* P rejects it at admission (its queue) */
    double cancel_at; /* the client goes (0: never) */
    double stop_from, stop_to;
    bool dead;
    /* expected with no fault */
    bool want_decode, want_fence;
} scenario;

typedef struct {
    const scenario *sc;
    fault f;
    int f_seq; /* the message the fault hits */
    msg q[MAX_MS];
    int n_q, n_sent;
    bool lost_any;
    /* D */
    td_dj dj;
    double next_renew, fence_done_at;
    bool fencing;
    double reuse_at; /* when D decoded from, reused or freed the blocks (INFINITY: not yet) */
    int outcomes, aborts_sent, fences;
    bool decoded, released;
    /* P */
    td_xfer_seen *seen;
    bool have_job, answered, computing, flushing, job_end;
    td_pj pj;
    double recv, next_at, flush_at;
    int chunk_i;
    bool computed;
    double last_put;
    int bad_puts;
} sim;

static void chan_send(sim *s, mkind k, bool to_p, double now, double until, int32_t tokens) {
    int seq = s->n_sent++;
    if (s->f == F_LOSE && seq == s->f_seq) {
        s->lost_any = true;
        return;
    }
    int copies = s->f == F_DUP && seq == s->f_seq ? 2 : 1;
    for (int c = 0; c < copies; c++) {
        assert_true(s->n_q < MAX_MS);
        msg *m = &s->q[s->n_q++];
        m->kind = k;
        m->to_p = to_p;
        m->sent = now;
        m->until = until;
        m->tokens = tokens;
        m->seq = seq;
        m->at = now + 0.001 + (c ? 0.7 : 0.0) + (s->f == F_DELAY && seq == s->f_seq ? 1.5 : 0.0);
    }
}

static bool p_stopped(const sim *s, double now) {
    return s->sc->dead || (now >= s->sc->stop_from && now < s->sc->stop_to);
}

/* A put of P's into D's blocks at now, only within the lease (the ranks'
 * check): one at or after D's reuse is the failure this test exists for. */
static void p_put(sim *s, double now) {
    if (now > s->pj.put_until) {
        s->computed = false; /* the rank refuses it: the job fails */
        return;
    }
    s->last_put = now;
    if (now >= s->reuse_at) s->bad_puts++;
}

static void d_apply(sim *s, int a, double now) {
    if (a & (TD_DJ_DECODE | TD_DJ_LOCAL | TD_DJ_LOCAL_FRESH)) s->outcomes++;
    if (a & TD_DJ_DECODE) s->decoded = true;
    if (a & (TD_DJ_DECODE | TD_DJ_LOCAL | TD_DJ_RELEASE)) {
        if (now < s->reuse_at) s->reuse_at = now;
        if (a & TD_DJ_RELEASE) s->released = true;
    }
    if (a & TD_DJ_ABORT) {
        s->aborts_sent++;
        chan_send(s, M_ABORT, true, now, P_START_S, 0); /* the request's deadline */
    }
    if (a & TD_DJ_FENCE) s->fences++;
    if (s->dj.state == TD_DJ_FENCING && !s->fencing) {
        /* the link workers close and D's endpoint is gone: from now on,
         * nothing P sends over that link reaches D (its puts still land:
         * over shared memory they are not D's worker's to drop) */
        s->fencing = true;
        s->fence_done_at = now + 0.2;
    }
}

static void d_on(sim *s, const msg *m, double now) {
    if (s->fencing) return; /* the link is closed */
    td_dj_msg k = m->kind == M_PROGRESS   ? TD_DJ_MSG_PROGRESS
                  : m->kind == M_DONE     ? TD_DJ_MSG_DONE
                  : m->kind == M_REJECTED ? TD_DJ_MSG_REJECTED
                  : m->kind == M_FAILED   ? TD_DJ_MSG_FAILED
                                          : TD_DJ_MSG_ABORTED;
    d_apply(s, td_dj_on_msg(&s->dj, &TIMING, k, m->tokens, now), now);
}

static void p_answer(sim *s, double now) {
    td_pj_answer a = td_pj_answer_of(&s->pj, s->computed, now);
    chan_send(s,
              a == TD_PJ_DONE      ? M_DONE
              : a == TD_PJ_ABORTED ? M_ABORTED
                                   : M_FAILED,
              false, now, 0, 0);
    s->answered = true;
}

static void p_on(sim *s, const msg *m, double now) {
    switch (m->kind) {
    case M_REQUEST: {
        /* the deadline and first lease: the earlier of relative and absolute */
        double start_left = fmin(P_START_S, m->sent + P_START_S - now);
        double lease_left = fmin(TIMING.lease_s, m->sent + TIMING.lease_s - now);
        int r = td_xfer_seen_add(s->seen, "d0", 7, "req-1", m->sent + P_START_S, now);
        if (r != 1) return; /* a copy, or no room: silence */
        if (start_left <= 0) {
            chan_send(s, M_REJECTED, false, now, 0, 0); /* late on arrival */
            return;
        }
        if (s->sc->reject) {
            chan_send(s, M_REJECTED, false, now, 0, 0);
            return;
        }
        s->have_job = true;
        s->recv = now;
        td_pj_init(&s->pj, now, start_left, lease_left);
        s->next_at = now + s->sc->queue;
        s->computed = true;
        break;
    }
    case M_RENEWAL:
        if (s->have_job) td_pj_renew(&s->pj, now, fmin(TIMING.lease_s, m->until - now));
        break;
    case M_ABORT:
        if (s->have_job && !s->answered) {
            s->pj.aborted = true; /* stops at the end of its chunk, then answers */
        } else if (s->have_job || td_xfer_seen_add(s->seen, "d0", 7, "req-1", m->until, now) >= 0) {
            /* finished (flushed) or never had it (its id refused from now
             * on): nothing writes */
            chan_send(s, M_ABORTED, false, now, 0, 0);
        }
        break;
    default: fail_msg("P got a message for D");
    }
}

/* P's job, per tick: queued, chunks, flush, answer. */
static void p_tick(sim *s, double now) {
    if (!s->have_job || s->answered) return;
    if (s->flushing) {
        if (now >= s->flush_at) p_answer(s, now);
        return;
    }
    if (!s->job_end && (td_pj_expired(&s->pj, now) || s->pj.aborted) && !s->computing) {
        s->job_end = true; /* cancelled between chunks */
        s->computed = false;
    }
    if (!s->job_end && now >= s->next_at) {
        if (s->computing) { /* a chunk ends: its last puts */
            p_put(s, now);
            s->computing = false;
            if (++s->chunk_i == s->sc->chunks) s->job_end = true;
            if (td_pj_expired(&s->pj, now) || s->pj.aborted) {
                s->job_end = true;
                s->computed = s->computed && s->chunk_i == s->sc->chunks;
            }
        }
        if (!s->job_end) { /* the next chunk starts */
            s->pj.started = true;
            chan_send(s, M_PROGRESS, false, now, 0, (s->chunk_i + 1) * 100);
            p_put(s, now);
            s->computing = true;
            s->next_at = now + s->sc->chunk;
        }
    }
    if (s->job_end && !s->flushing) {
        s->flushing = true;
        s->flush_at = now + 0.05;
    }
}

static void run(const scenario *sc, fault f, int f_seq, sim *s) {
    memset(s, 0, sizeof *s);
    s->sc = sc;
    s->f = f;
    s->f_seq = f_seq;
    s->reuse_at = INFINITY;
    s->seen = td_xfer_seen_create(64);
    assert_non_null(s->seen);
    td_dj_sent(&s->dj, &TIMING, 0.0);
    chan_send(s, M_REQUEST, true, 0.0, 0, 0);
    s->next_renew = TIMING.lease_s / 3;
    for (int tick = 1; tick * DT <= T_END; tick++) {
        double now = tick * DT;
        /* deliveries due now, in delivery order (a stopped P takes its
         * messages when it resumes; a dead one never) */
        for (int i = 0; i < s->n_q; i++) {
            msg *m = &s->q[i];
            if (m->at > now || m->at < 0) continue;
            if (m->to_p && p_stopped(s, now)) continue;
            m->at = -1;
            if (m->to_p)
                p_on(s, m, now);
            else
                d_on(s, m, now);
        }
        if (!p_stopped(s, now)) p_tick(s, now);
        if (sc->cancel_at > 0 && now >= sc->cancel_at && !s->dj.gone)
            d_apply(s, td_dj_cancel(&s->dj, &TIMING, now), now);
        d_apply(s, td_dj_tick(&s->dj, &TIMING, now), now);
        if (now >= s->next_renew) {
            s->next_renew += TIMING.lease_s / 3;
            if (td_dj_renew(&s->dj, &TIMING, now))
                chan_send(s, M_RENEWAL, true, now, now + TIMING.lease_s, 0);
        }
        if (s->fencing && now >= s->fence_done_at)
            d_apply(s, td_dj_fence_done(&s->dj, &TIMING, now), now);
    }
    td_xfer_seen_destroy(s->seen);
}

static void check_run(const scenario *sc, fault f, int f_seq, sim *s) {
    char what[160];
    snprintf(what, sizeof what, "%s, fault %d on message %d", sc->name, (int)f, f_seq);
    if (s->bad_puts)
        fail_msg("%s: %d put(s) of P landed after D reused the blocks (at %.2f s, last put %.2f s)",
                 what, s->bad_puts, s->reuse_at, s->last_put);
    if (s->dj.state != TD_DJ_ENDED)
        fail_msg("%s: the job is still %s on D at %.0f s", what, td_dj_state_name(s->dj.state),
                 T_END);
    if (sc->cancel_at > 0 ? s->outcomes > 1 : s->outcomes != 1)
        fail_msg("%s: %d outcomes for the request", what, s->outcomes);
    if (s->fences && !s->lost_any && !sc->dead && sc->stop_to <= sc->stop_from)
        fail_msg("%s: a live P fenced with no message lost", what);
}

static const scenario SCENARIOS[] = {
    {.name = "fast", .queue = 0.2, .chunk = 0.5, .chunks = 3, .want_decode = true},
    /* starts at 2 s (within the 2.7 s), then 6 s of chunks: far past the
     * start deadline, decoded without a fence */
    {.name = "busy, long prompt", .queue = 2.0, .chunk = 1.0, .chunks = 6, .want_decode = true},
    {.name = "too busy to start", .queue = 4.0, .chunk = 0.5, .chunks = 2},
    {.name = "rejected at admission", .reject = true},
    {.name = "client goes", .queue = 0.1, .chunk = 0.8, .chunks = 5, .cancel_at = 1.0},
    {.name = "client goes before the start",
     .queue = 2.0,
     .chunk = 0.5,
     .chunks = 2,
     .cancel_at = 0.5},
    /* stopped mid-job for 20 s: D gives up, P acknowledges nothing, the
     * fence; P resumes past its lease and puts nothing */
    {.name = "stopped mid-job",
     .queue = 0.1,
     .chunk = 0.5,
     .chunks = 4,
     .stop_from = 0.9,
     .stop_to = 20.9,
     .want_fence = true},
    {.name = "dead", .queue = 0.1, .chunk = 0.5, .chunks = 4, .dead = true, .want_fence = true},
};

static void test_scenarios(void **state) {
    (void)state;
    int runs = 0;
    for (size_t k = 0; k < sizeof SCENARIOS / sizeof *SCENARIOS; k++) {
        const scenario *sc = &SCENARIOS[k];
        sim *base = calloc(1, sizeof *base);
        assert_non_null(base);
        run(sc, F_NONE, -1, base);
        check_run(sc, F_NONE, -1, base);
        runs++;
        if (base->decoded != sc->want_decode || (base->fences > 0) != sc->want_fence)
            fail_msg("%s: decoded %d (want %d), fences %d (want %s)", sc->name, base->decoded,
                     sc->want_decode, base->fences, sc->want_fence ? "some" : "none");
        if (sc->cancel_at > 0 && !(base->released && base->aborts_sent == 1 && !base->fences))
            fail_msg("%s: the abort was not acknowledged (released %d, aborts %d, fences %d)",
                     sc->name, base->released, base->aborts_sent, base->fences);
        for (int f = F_LOSE; f <= F_DELAY; f++)
            for (int i = 0; i < base->n_sent; i++) {
                sim *s = calloc(1, sizeof *s);
                assert_non_null(s);
                run(sc, (fault)f, i, s);
                check_run(sc, (fault)f, i, s);
                free(s);
                runs++;
            }
        free(base);
    }
    print_message("%d runs\n", runs);
    assert_true(runs > 100);
}

/* The acknowledgement of an Abort lost: D fences after the grace, counted
 * from the end of P's last lease, and frees the blocks only once the fence
 * completed and that lease plus the margin passed. */
static void test_ack_lost_fences_after_grace(void **state) {
    (void)state;
    td_dj j;
    td_dj_sent(&j, &TIMING, 0.0);
    assert_int_equal(td_dj_on_msg(&j, &TIMING, TD_DJ_MSG_PROGRESS, 100, 0.5), 0);
    assert_int_equal(j.state, TD_DJ_RUNNING);
    assert_true(td_dj_renew(&j, &TIMING, 1.0));        /* the lease now ends at 4.0 */
    assert_int_equal(td_dj_tick(&j, &TIMING, 3.5), 0); /* 3.0 s of silence: not yet */
    int a = td_dj_tick(&j, &TIMING, 3.51);
    assert_int_equal(a, TD_DJ_ABORT | TD_DJ_LOCAL_FRESH);
    assert_int_equal(j.state, TD_DJ_ABORTING);
    assert_false(td_dj_renew(&j, &TIMING, 4.0)); /* no more leases */
    assert_int_equal(td_dj_on_msg(&j, &TIMING, TD_DJ_MSG_PROGRESS, 200, 4.0),
                     0);                               /* not an answer */
    assert_int_equal(td_dj_tick(&j, &TIMING, 7.0), 0); /* lease 4.0 + grace 3.0 */
    assert_int_equal(td_dj_tick(&j, &TIMING, 7.01), TD_DJ_FENCE);
    assert_int_equal(j.state, TD_DJ_FENCING);
    assert_int_equal(td_dj_on_msg(&j, &TIMING, TD_DJ_MSG_ABORTED, 0, 7.1),
                     0); /* too late: the fence */
    assert_int_equal(td_dj_fenced(&j), 0);
    assert_int_equal(td_dj_fence_done(&j, &TIMING, 4.9), 0); /* lease 4.0 + margin 1.0 */
    assert_int_equal(td_dj_fence_done(&j, &TIMING, 7.2), TD_DJ_RELEASE);
    assert_int_equal(j.state, TD_DJ_ENDED);
    assert_int_equal(td_dj_tick(&j, &TIMING, 100.0), 0);
}

/* Every message in every state: what D does. */
static void test_dj_table(void **state) {
    (void)state;
    static const struct {
        td_dj_state from;
        td_dj_msg m;
        int want;
        td_dj_state to;
    } rows[] = {
        {TD_DJ_WAITING, TD_DJ_MSG_PROGRESS, 0, TD_DJ_RUNNING},
        {TD_DJ_WAITING, TD_DJ_MSG_DONE, TD_DJ_DECODE, TD_DJ_ENDED},
        {TD_DJ_WAITING, TD_DJ_MSG_REJECTED, TD_DJ_LOCAL, TD_DJ_ENDED},
        {TD_DJ_WAITING, TD_DJ_MSG_FAILED, TD_DJ_LOCAL, TD_DJ_ENDED},
        {TD_DJ_WAITING, TD_DJ_MSG_ABORTED, TD_DJ_LOCAL, TD_DJ_ENDED},
        {TD_DJ_RUNNING, TD_DJ_MSG_PROGRESS, 0, TD_DJ_RUNNING},
        {TD_DJ_RUNNING, TD_DJ_MSG_DONE, TD_DJ_DECODE, TD_DJ_ENDED},
        /* P never rejects what it started: not its word that nothing writes */
        {TD_DJ_RUNNING, TD_DJ_MSG_REJECTED, TD_DJ_ABORT | TD_DJ_LOCAL_FRESH, TD_DJ_ABORTING},
        {TD_DJ_RUNNING, TD_DJ_MSG_FAILED, TD_DJ_LOCAL, TD_DJ_ENDED},
        {TD_DJ_ABORTING, TD_DJ_MSG_PROGRESS, 0, TD_DJ_ABORTING},
        {TD_DJ_ABORTING, TD_DJ_MSG_DONE, TD_DJ_RELEASE, TD_DJ_ENDED},
        {TD_DJ_ABORTING, TD_DJ_MSG_REJECTED, TD_DJ_RELEASE, TD_DJ_ENDED},
        {TD_DJ_ABORTING, TD_DJ_MSG_FAILED, TD_DJ_RELEASE, TD_DJ_ENDED},
        {TD_DJ_ABORTING, TD_DJ_MSG_ABORTED, TD_DJ_RELEASE, TD_DJ_ENDED},
        {TD_DJ_FENCING, TD_DJ_MSG_DONE, 0, TD_DJ_FENCING},
        {TD_DJ_FENCING, TD_DJ_MSG_ABORTED, 0, TD_DJ_FENCING},
        {TD_DJ_ENDED, TD_DJ_MSG_DONE, 0, TD_DJ_ENDED},
        {TD_DJ_ENDED, TD_DJ_MSG_ABORTED, 0, TD_DJ_ENDED},
    };
    for (size_t i = 0; i < sizeof rows / sizeof *rows; i++) {
        td_dj j;
        td_dj_sent(&j, &TIMING, 0.0);
        j.state = rows[i].from;
        int a = td_dj_on_msg(&j, &TIMING, rows[i].m, 1, 1.0);
        if (a != rows[i].want || j.state != rows[i].to)
            fail_msg("row %zu: %s + message %d: actions %d state %s (want %d, %s)", i,
                     td_dj_state_name(rows[i].from), (int)rows[i].m, a, td_dj_state_name(j.state),
                     rows[i].want, td_dj_state_name(rows[i].to));
    }
    /* the client going: an Abort, no fallback; twice: nothing more */
    td_dj j;
    td_dj_sent(&j, &TIMING, 0.0);
    assert_int_equal(td_dj_cancel(&j, &TIMING, 1.0), TD_DJ_ABORT);
    assert_int_equal(td_dj_cancel(&j, &TIMING, 1.1), 0);
    /* a fence of the link while waiting: the request goes local in fresh
     * blocks, once */
    td_dj_sent(&j, &TIMING, 0.0);
    assert_int_equal(td_dj_fenced(&j), TD_DJ_LOCAL_FRESH);
    assert_int_equal(td_dj_fenced(&j), 0);
    /* a rejection of a started job: P's word is awaited a grace after its
     * lease (3.0 from the sending at 0.0), as for any job given up */
    td_dj_sent(&j, &TIMING, 0.0);
    td_dj_on_msg(&j, &TIMING, TD_DJ_MSG_PROGRESS, 16, 0.5);
    assert_int_equal(td_dj_on_msg(&j, &TIMING, TD_DJ_MSG_REJECTED, 0, 1.0),
                     TD_DJ_ABORT | TD_DJ_LOCAL_FRESH);
    assert_int_equal(td_dj_tick(&j, &TIMING, 6.0), 0);
    assert_int_equal(td_dj_tick(&j, &TIMING, 6.01), TD_DJ_FENCE);
    /* the start deadline: 3.0 s after sending, not before */
    td_dj_sent(&j, &TIMING, 10.0);
    assert_int_equal(td_dj_tick(&j, &TIMING, 13.0), 0);
    assert_int_equal(td_dj_tick(&j, &TIMING, 13.01), TD_DJ_ABORT | TD_DJ_LOCAL_FRESH);
}

/* P's job: the start deadline holds until the first chunk, the lease
 * after; an old renewal arriving late never shortens or stretches it. */
static void test_pj(void **state) {
    (void)state;
    td_pj p;
    td_pj_init(&p, 0.0, 2.7, 3.0);
    assert_null(td_pj_expired(&p, 2.7));
    assert_string_equal(td_pj_expired(&p, 2.71), "not started before its deadline");
    p.started = true;
    assert_null(td_pj_expired(&p, 2.71));
    assert_string_equal(td_pj_expired(&p, 3.01), "its lease ran out");
    assert_true(td_pj_renew(&p, 1.0, 3.0));  /* until 4.0 */
    assert_false(td_pj_renew(&p, 1.5, 2.0)); /* a late copy of an older one: until 3.5 */
    assert_true(p.put_until == 4.0);
    assert_int_equal(td_pj_answer_of(&p, true, 4.0), TD_PJ_DONE);
    assert_int_equal(td_pj_answer_of(&p, true, 4.01), TD_PJ_FAILED);
    assert_int_equal(td_pj_answer_of(&p, false, 1.0), TD_PJ_FAILED);
    p.aborted = true;
    assert_int_equal(td_pj_answer_of(&p, true, 1.0), TD_PJ_ABORTED);
}

/* The seen ids: a copy is refused until its time, another incarnation's
 * id is another key, the table is bounded and forgets what expired. */
static void test_seen(void **state) {
    (void)state;
    assert_null(td_xfer_seen_create(0));
    td_xfer_seen *s = td_xfer_seen_create(100);
    assert_non_null(s);
    assert_int_equal(td_xfer_seen_add(s, "d0", 1, "a", 10.0, 0.0), 1);
    assert_int_equal(td_xfer_seen_add(s, "d0", 1, "a", 5.0, 1.0), 0);
    assert_int_equal(td_xfer_seen_add(s, "d0", 2, "a", 10.0, 1.0), 1); /* a new epoch */
    assert_int_equal(td_xfer_seen_add(s, "d1", 1, "a", 10.0, 1.0), 1);
    assert_int_equal(td_xfer_seen_add(s, "d0", 1, "a", 20.0, 10.0), 0); /* still there at 10 */
    assert_int_equal(td_xfer_seen_add(s, "d0", 1, "a", 30.0, 20.5), 1); /* forgotten after 20 */
    char id[16];
    int added = 0, full = 0;
    for (int i = 0; i < 200; i++) {
        snprintf(id, sizeof id, "r%d", i);
        int r = td_xfer_seen_add(s, "d0", 1, id, 50.0, 21.0);
        added += r == 1;
        full += r == -1;
    }
    assert_true(added + 1 <= 100 && added >= 95); /* bounded: one of the first is live */
    assert_true(full > 0);
    assert_true(td_xfer_seen_count(s, 21.0) <= 100);
    /* once they expire there is room again, and every one of them is new */
    for (int i = 0; i < 90; i++) {
        snprintf(id, sizeof id, "r%d", i);
        assert_int_equal(td_xfer_seen_add(s, "d0", 1, id, 100.0, 60.0), 1);
    }
    assert_int_equal(td_xfer_seen_count(s, 60.0), 90);
    td_xfer_seen_destroy(s);
    td_xfer_seen_destroy(NULL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dj_table),  cmocka_unit_test(test_ack_lost_fences_after_grace),
        cmocka_unit_test(test_pj),        cmocka_unit_test(test_seen),
        cmocka_unit_test(test_scenarios),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
