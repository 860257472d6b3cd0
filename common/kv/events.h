/* KV event log: a sequence-numbered record of the block hashes an instance
 * stored in and removed from its prefix cache, for the router
 * (GET /internal/v1/state?since=N, DESIGN.md §4, §6).
 *
 * The pool appends (from the scheduler thread); HTTP threads read. Every
 * function is thread-safe. The log keeps the last `capacity` events and
 * the set of hashes currently stored, so a reader that is too far behind
 * (or that saw another epoch: a restarted instance) gets a full snapshot
 * instead of a diff. */
#ifndef TD_KV_EVENTS_H
#define TD_KV_EVENTS_H

#include <stdbool.h>
#include <stdint.h>

#include "common/base/base.h"
#include "hash.h"

typedef enum {
    TD_KV_EVENT_STORED = 0,
    TD_KV_EVENT_REMOVED = 1,
    TD_KV_EVENT_CLEARED = 2, /* every hash removed (hash unused) */
} td_kv_event_type;

typedef struct {
    uint64_t seq; /* 1, 2, 3, ... */
    td_kv_event_type type;
    td_kv_hash hash;
} td_kv_event;

typedef struct td_kv_events td_kv_events;

/* capacity: events kept (>= 1). epoch: identifies this run of the instance
 * (random at start; a restarted instance has a new one). Free with
 * td_kv_events_destroy(). */
td_status td_kv_events_create(uint32_t capacity, uint64_t epoch, td_kv_events **ev_p);
void td_kv_events_destroy(td_kv_events *ev); /* accepts NULL */

void td_kv_events_append(td_kv_events *ev, td_kv_event_type type, td_kv_hash h);

uint64_t td_kv_events_epoch(const td_kv_events *ev);
/* Sequence number of the newest event (0 when none yet). */
uint64_t td_kv_events_last_seq(td_kv_events *ev);

/* What a reader that has seen every event up to `since` needs:
 *  - since <= last_seq and every event after since is still kept: a diff,
 *    *full_p = false, events[0..*n_p) in order;
 *  - otherwise (since too old, or since > last_seq: another epoch):
 *    *full_p = true, hashes[0..*n_p) = every hash currently stored.
 * *last_seq_p: the sequence number the reader has seen afterwards.
 * The arrays are malloc'd (caller frees the one returned; the other is
 * NULL). TD_ERR_NOMEM on allocation failure. */
td_status td_kv_events_read(td_kv_events *ev, uint64_t since, bool *full_p, td_kv_event **events_p,
                            td_kv_hash **hashes_p, size_t *n_p, uint64_t *last_seq_p);

#endif
