/* The per-job states of the KV-transfer protocol (jobstate.h). */
#include "jobstate.h"

#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "common/base/base.h"

void td_dj_sent(td_dj *j, const td_dj_timing *t, double now) {
    memset(j, 0, sizeof *j);
    j->state = TD_DJ_WAITING;
    j->start_by = now + t->start_s;
    j->heard = now;
    j->lease_end = now + t->lease_s;
}

bool td_dj_live(const td_dj *j) { return j->state == TD_DJ_WAITING || j->state == TD_DJ_RUNNING; }

/* D gives up on a live job: Abort, its blocks held until P's word. */
static int give_up(td_dj *j, const td_dj_timing *t, double now) {
    j->state = TD_DJ_ABORTING;
    j->ack_by = TD_MAX(now, j->lease_end) + t->grace_s;
    return TD_DJ_ABORT | (j->gone ? 0 : TD_DJ_LOCAL_FRESH);
}

int td_dj_on_msg(td_dj *j, const td_dj_timing *t, td_dj_msg m, int32_t tokens, double now) {
    switch (j->state) {
    case TD_DJ_WAITING:
    case TD_DJ_RUNNING:
        switch (m) {
        case TD_DJ_MSG_PROGRESS:
            j->state = TD_DJ_RUNNING;
            j->heard = now;
            j->tokens = TD_MAX(j->tokens, tokens);
            return 0;
        case TD_DJ_MSG_DONE: j->state = TD_DJ_ENDED; return TD_DJ_DECODE;
        case TD_DJ_MSG_REJECTED:
            /* P said it started: a rejection now is not P's word that
             * nothing writes (P never rejects what it took) */
            if (j->state == TD_DJ_RUNNING) return give_up(j, t, now);
            j->state = TD_DJ_ENDED;
            return TD_DJ_LOCAL;
        case TD_DJ_MSG_FAILED:
        case TD_DJ_MSG_ABORTED: j->state = TD_DJ_ENDED; return TD_DJ_LOCAL;
        }
        return 0;
    case TD_DJ_ABORTING:
        /* any word of P's but progress: flushed and stopped (or never taken) */
        if (m == TD_DJ_MSG_PROGRESS) return 0;
        j->state = TD_DJ_ENDED;
        return TD_DJ_RELEASE;
    case TD_DJ_FENCING: /* the fence frees the blocks, whatever P says now */
    case TD_DJ_ENDED: return 0;
    }
    return 0;
}

int td_dj_tick(td_dj *j, const td_dj_timing *t, double now) {
    switch (j->state) {
    case TD_DJ_WAITING: return now > j->start_by ? give_up(j, t, now) : 0;
    case TD_DJ_RUNNING: return now > j->heard + t->silence_s ? give_up(j, t, now) : 0;
    case TD_DJ_ABORTING:
        if (now <= j->ack_by) return 0;
        j->state = TD_DJ_FENCING;
        return TD_DJ_FENCE;
    case TD_DJ_FENCING:
    case TD_DJ_ENDED: return 0;
    }
    return 0;
}

int td_dj_cancel(td_dj *j, const td_dj_timing *t, double now) {
    j->gone = true;
    return td_dj_live(j) ? give_up(j, t, now) : 0;
}

bool td_dj_renew(td_dj *j, const td_dj_timing *t, double now) {
    if (!td_dj_live(j)) return false;
    j->lease_end = TD_MAX(j->lease_end, now + t->lease_s);
    return true;
}

int td_dj_fenced(td_dj *j) {
    bool live = td_dj_live(j);
    if (live || j->state == TD_DJ_ABORTING) j->state = TD_DJ_FENCING;
    return live && !j->gone ? TD_DJ_LOCAL_FRESH : 0;
}

int td_dj_fence_done(td_dj *j, const td_dj_timing *t, double now) {
    if (j->state != TD_DJ_FENCING || now < j->lease_end + t->margin_s) return 0;
    j->state = TD_DJ_ENDED;
    return TD_DJ_RELEASE;
}

const char *td_dj_state_name(td_dj_state s) {
    static const char *const names[] = {"waiting", "running", "aborting", "fencing", "ended"};
    return (unsigned)s < TD_ARRAY_SIZE(names) ? names[s] : "?";
}

/* ------------------------------------------------------------------ P */

void td_pj_init(td_pj *j, double now, double start_s, double lease_s) {
    memset(j, 0, sizeof *j);
    j->start_by = now + start_s;
    j->put_until = now + lease_s;
}

bool td_pj_renew(td_pj *j, double now, double lease_s) {
    if (now + lease_s <= j->put_until) return false;
    j->put_until = now + lease_s;
    return true;
}

const char *td_pj_expired(const td_pj *j, double now) {
    if (!j->started && now > j->start_by) return "not started before its deadline";
    if (now > j->put_until) return "its lease ran out";
    return NULL;
}

td_pj_answer td_pj_answer_of(const td_pj *j, bool computed, double now) {
    if (j->aborted) return TD_PJ_ABORTED;
    return computed && now <= j->put_until ? TD_PJ_DONE : TD_PJ_FAILED;
}

/* ------------------------------------------------------------- seen ids */

/* Open addressing, linear probing, at most half full; a slot is empty
 * (key 0) or holds a key until its time. Expired keys are skipped by
 * lookups, their slots reused by inserts and dropped by a rebuild when
 * the table would pass its capacity. */
typedef struct {
    uint64_t key;
    double until;
} seen_slot;

struct td_xfer_seen {
    seen_slot *slots;
    int32_t cap, max_live, used;
};

td_xfer_seen *td_xfer_seen_create(int32_t capacity) {
    if (capacity < 1 || capacity > (1 << 24)) return NULL;
    td_xfer_seen *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->max_live = capacity;
    s->cap = 16;
    while (s->cap < 2 * capacity) s->cap *= 2;
    s->slots = calloc((size_t)s->cap, sizeof *s->slots);
    if (!s->slots) {
        free(s);
        return NULL;
    }
    return s;
}

void td_xfer_seen_destroy(td_xfer_seen *s) {
    if (!s) return;
    free(s->slots);
    free(s);
}

static uint64_t seen_key(const char *instance, uint64_t epoch, const char *id) {
    char buf[320];
    size_t ni = strnlen(instance, 127) + 1, nd = strnlen(id, 127) + 1;
    memcpy(buf, instance, ni - 1);
    buf[ni - 1] = 0;
    memcpy(buf + ni, &epoch, sizeof epoch);
    memcpy(buf + ni + sizeof epoch, id, nd - 1);
    buf[ni + sizeof epoch + nd - 1] = 0;
    uint64_t k = XXH3_64bits(buf, ni + sizeof epoch + nd);
    return k ? k : 1; /* 0 marks an empty slot */
}

/* Drops the expired keys: every live one placed again. */
static void seen_rebuild(td_xfer_seen *s, double now) {
    seen_slot *old = s->slots;
    seen_slot *fresh = calloc((size_t)s->cap, sizeof *fresh);
    if (!fresh) return; /* keeps the old table: lookups stay right */
    s->slots = fresh;
    s->used = 0;
    uint64_t mask = (uint64_t)s->cap - 1;
    for (int32_t i = 0; i < s->cap; i++) {
        if (!old[i].key || old[i].until < now) continue;
        uint64_t h = old[i].key & mask;
        while (s->slots[h].key) h = (h + 1) & mask;
        s->slots[h] = old[i];
        s->used++;
    }
    free(old);
}

int td_xfer_seen_add(td_xfer_seen *s, const char *instance, uint64_t epoch, const char *id,
                     double until, double now) {
    uint64_t key = seen_key(instance, epoch, id), mask = (uint64_t)s->cap - 1;
    for (uint64_t h = key & mask;; h = (h + 1) & mask) {
        seen_slot *e = &s->slots[h];
        if (!e->key) break;
        if (e->key == key && e->until >= now) {
            e->until = TD_MAX(e->until, until);
            return 0;
        }
    }
    /* at most max_live slots in use (live or expired), half the table */
    if (s->used >= s->max_live) seen_rebuild(s, now);
    if (s->used >= s->max_live) return -1;
    uint64_t h = key & mask;
    while (s->slots[h].key && s->slots[h].until >= now) h = (h + 1) & mask;
    if (!s->slots[h].key) s->used++;
    s->slots[h].key = key;
    s->slots[h].until = until;
    return 1;
}

int32_t td_xfer_seen_count(const td_xfer_seen *s, double now) {
    int32_t n = 0;
    for (int32_t i = 0; i < s->cap; i++) n += s->slots[i].key && s->slots[i].until >= now;
    return n;
}
