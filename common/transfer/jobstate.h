/* The per-job states of the KV-transfer protocol (xfer.h), apart from
 * any I/O or clock: what D does with one remote prefill as P's messages
 * arrive and time passes, how long P may start and write one job, and the
 * request ids P has seen. xfer-decode.c and xfer-prefill.c drive them;
 * tests/unit/test_jobstate.c runs both ends against each other over a
 * channel that loses, duplicates, reorders and delays messages.
 *
 * D's job (td_dj):
 *   WAITING   sent; P has not said it started. Its lease is renewed.
 *   RUNNING   P reported a chunk starting (JobProgress). Its lease is
 *             renewed; a lease of silence gives it up.
 *   ABORTING  D gave up (P did not start it by the deadline, or fell
 *             silent) or the client went: Abort sent, the lease no longer
 *             renewed, the blocks held (the request prefills locally in
 *             fresh ones) until P's word: JobAborted, or any answer P
 *             sends after flushing (PrefillDone, TransferFailed) or
 *             instead of taking it (PrefillRejected).
 *   FENCING   no word within the grace (after P's last lease ended), or
 *             the peer is fenced for another reason: the blocks stay until
 *             the fence completed and P's last lease plus a margin passed.
 *   ENDED     out of the table.
 * Only silence fences: one slow job never fails the others on its link.
 *
 * The safety rule both sides keep: D frees or reuses a job's blocks only
 * on a message P sends once its puts are flushed and none will follow, or
 * once P's last lease (and a margin) has passed and the link is fenced.
 * P puts nothing after its lease (renewed only while D still wants the
 * job), answers an Abort only once flushed, and takes a request id at
 * most once (td_xfer_seen): a duplicated or late request never writes into
 * blocks D has reused. */
#ifndef TD_TRANSFER_JOBSTATE_H
#define TD_TRANSFER_JOBSTATE_H

#include <stdbool.h>
#include <stdint.h>

/* D's times, in seconds. */
typedef struct {
    double start_s;   /* P must start the job this long after D sent it */
    double lease_s;   /* a lease granted now lets P write until now + lease_s */
    double silence_s; /* a started job with no word from P for this long is given up */
    double grace_s;   /* a job given up: P's word is awaited until its last lease ended
                       * plus this, then the link is fenced */
    double margin_s;  /* fenced blocks outlast P's last lease by this (the check-to-put
                       * window on P, clock steps) */
} td_dj_timing;

typedef enum {
    TD_DJ_WAITING,
    TD_DJ_RUNNING,
    TD_DJ_ABORTING,
    TD_DJ_FENCING,
    TD_DJ_ENDED
} td_dj_state;

typedef struct {
    td_dj_state state;
    bool gone;        /* the client went: nothing to fall back to */
    double start_by;  /* WAITING: P must have started by then */
    double heard;     /* RUNNING: P's last progress */
    double lease_end; /* the end of the last lease granted to P */
    double ack_by;    /* ABORTING: P's word awaited until then */
    int32_t tokens;   /* prompt positions P reported */
} td_dj;

/* What the caller does after an event (bits). */
enum {
    TD_DJ_DECODE = 1 << 0,      /* P's answer: decode on from its first token */
    TD_DJ_LOCAL = 1 << 1,       /* prefill locally in the same blocks: nothing writes there */
    TD_DJ_LOCAL_FRESH = 1 << 2, /* prefill locally in fresh blocks; the old ones stay held */
    TD_DJ_RELEASE = 1 << 3,     /* the held blocks are free */
    TD_DJ_ABORT = 1 << 4,       /* send Abort */
    TD_DJ_FENCE = 1 << 5,       /* fence P: no word within the grace */
};

/* P's messages about a job. */
typedef enum {
    TD_DJ_MSG_PROGRESS,
    TD_DJ_MSG_DONE,
    TD_DJ_MSG_REJECTED,
    TD_DJ_MSG_FAILED,
    TD_DJ_MSG_ABORTED,
} td_dj_msg;

/* The request left at now (with its first lease). */
void td_dj_sent(td_dj *j, const td_dj_timing *t, double now);
/* A message from P (tokens: JobProgress's). */
int td_dj_on_msg(td_dj *j, const td_dj_timing *t, td_dj_msg m, int32_t tokens, double now);
/* Time passed: the start deadline, silence, the grace. */
int td_dj_tick(td_dj *j, const td_dj_timing *t, double now);
/* The client went (the scheduler's cancel of a waiting sequence). */
int td_dj_cancel(td_dj *j, const td_dj_timing *t, double now);
/* Whether the job's lease is renewed in a renewal D sends at now (then its
 * lease ends at now + lease_s). */
bool td_dj_renew(td_dj *j, const td_dj_timing *t, double now);
/* The link to P is being fenced (for this job's silence or another reason). */
int td_dj_fenced(td_dj *j);
/* The fence completed (links closed): the blocks go once P's last lease
 * and the margin have passed. */
int td_dj_fence_done(td_dj *j, const td_dj_timing *t, double now);
/* Whether D waits for P on the job (not given up, not ended). */
bool td_dj_live(const td_dj *j);
const char *td_dj_state_name(td_dj_state s);

/* P's job: it must start by its deadline and puts nothing past its lease.
 * Times on P's clock, in seconds. */
typedef struct {
    double start_by;  /* not started by then: it fails (nothing was written) */
    double put_until; /* the lease: nothing is put after it */
    bool started;     /* its first chunk ran */
    bool aborted;     /* D's Abort arrived */
} td_pj;

/* P's answer once the job ended and its puts are flushed. */
typedef enum { TD_PJ_DONE, TD_PJ_FAILED, TD_PJ_ABORTED } td_pj_answer;

/* A request received at now: start_s and lease_s are what is left of its
 * deadline and first lease (the earlier of the relative and the absolute
 * forms). */
void td_pj_init(td_pj *j, double now, double start_s, double lease_s);
/* A renewal received at now granting lease_s (the earlier form): the
 * lease never moves back (an old renewal arriving late changes nothing).
 * Returns whether it moved. */
bool td_pj_renew(td_pj *j, double now, double lease_s);
/* Why the job must stop at now, or NULL. */
const char *td_pj_expired(const td_pj *j, double now);
/* computed: the prefill produced its first token and every put was
 * delivered. JobAborted when D asked, PrefillDone when computed within the
 * lease, else TransferFailed. */
td_pj_answer td_pj_answer_of(const td_pj *j, bool computed, double now);

/* The request ids P has seen, per D incarnation, each until a time (its
 * deadline: a copy arriving later is refused as late anyway). Bounded:
 * when full, an id is not taken (the caller refuses or stays silent, both
 * safe). Keys are 64-bit hashes of (instance, epoch, id). */
typedef struct td_xfer_seen td_xfer_seen;
td_xfer_seen *td_xfer_seen_create(int32_t capacity);
void td_xfer_seen_destroy(td_xfer_seen *s);
/* 1: new, recorded until `until`; 0: seen before (its time extended to
 * the later of the two); -1: full. Entries past their time are forgotten. */
int td_xfer_seen_add(td_xfer_seen *s, const char *instance, uint64_t epoch, const char *id,
                     double until, double now);
int32_t td_xfer_seen_count(const td_xfer_seen *s, double now);

#endif
