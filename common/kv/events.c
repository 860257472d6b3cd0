/* KV event log: a ring of the last `capacity` events plus the set of
 * hashes stored now (for full snapshots), under one mutex. */
#include "events.h"

#include <pthread.h>
#include <string.h>

#include "hmap.h"

struct td_kv_events {
    pthread_mutex_t mu;
    uint64_t epoch;
    td_kv_event *ring; /* (capacity) */
    uint32_t capacity;
    uint64_t last_seq; /* event seq lives at ring[(seq - 1) % capacity] */
    td_kv_hmap stored; /* hash -> 1 */
    bool oom;          /* the stored set lost an entry (logged once) */
};

td_status td_kv_events_create(uint32_t capacity, uint64_t epoch, td_kv_events **ev_p) {
    if (capacity == 0 || !ev_p) return TD_ERR_INVALID;
    td_kv_events *ev = calloc(1, sizeof *ev);
    if (!ev) return TD_ERR_NOMEM;
    ev->ring = calloc(capacity, sizeof *ev->ring);
    if (!ev->ring) goto free_ev;
    if (td_kv_hmap_init(&ev->stored, 1024) != TD_OK) goto free_ring;
    pthread_mutex_init(&ev->mu, NULL);
    ev->capacity = capacity;
    ev->epoch = epoch;
    *ev_p = ev;
    return TD_OK;

free_ring:
    free(ev->ring);
free_ev:
    free(ev);
    TD_LOG_ERROR("out of memory");
    return TD_ERR_NOMEM;
}

void td_kv_events_destroy(td_kv_events *ev) {
    if (!ev) return;
    td_kv_hmap_free(&ev->stored);
    pthread_mutex_destroy(&ev->mu);
    free(ev->ring);
    free(ev);
}

void td_kv_events_append(td_kv_events *ev, td_kv_event_type type, td_kv_hash h) {
    pthread_mutex_lock(&ev->mu);
    uint64_t seq = ++ev->last_seq;
    td_kv_event *e = &ev->ring[(seq - 1) % ev->capacity];
    e->seq = seq;
    e->type = type;
    e->hash = h;
    if (type == TD_KV_EVENT_STORED) {
        td_status st;
        td_kv_hmap_put(&ev->stored, h, 1, &st);
        if (st != TD_OK) {
            if (!ev->oom) TD_LOG_ERROR("out of memory: KV event snapshot set is incomplete");
            ev->oom = true;
        }
    } else if (type == TD_KV_EVENT_REMOVED) {
        td_kv_hmap_del(&ev->stored, h);
    } else {
        uint32_t cap = ev->stored.cap;
        td_kv_hmap_free(&ev->stored);
        if (td_kv_hmap_init(&ev->stored, cap / 2u) != TD_OK && !ev->oom) {
            TD_LOG_ERROR("out of memory: KV event snapshot set lost");
            ev->oom = true;
        }
    }
    pthread_mutex_unlock(&ev->mu);
}

uint64_t td_kv_events_epoch(const td_kv_events *ev) { return ev->epoch; }

uint64_t td_kv_events_last_seq(td_kv_events *ev) {
    pthread_mutex_lock(&ev->mu);
    uint64_t s = ev->last_seq;
    pthread_mutex_unlock(&ev->mu);
    return s;
}

td_status td_kv_events_read(td_kv_events *ev, uint64_t since, bool *full_p, td_kv_event **events_p,
                            td_kv_hash **hashes_p, size_t *n_p, uint64_t *last_seq_p) {
    td_status st = TD_OK;
    pthread_mutex_lock(&ev->mu);
    uint64_t last = ev->last_seq;
    uint64_t oldest = last >= ev->capacity ? last - ev->capacity + 1 : 1;
    bool diff = since <= last && since + 1 >= oldest;
    if (diff) {
        size_t n = (size_t)(last - since);
        td_kv_event *out = n ? malloc(n * sizeof *out) : NULL;
        if (n && !out) {
            st = TD_ERR_NOMEM;
        } else {
            for (size_t i = 0; i < n; i++) out[i] = ev->ring[(since + i) % ev->capacity];
            *full_p = false;
            *events_p = out;
            *hashes_p = NULL;
            *n_p = n;
            *last_seq_p = last;
        }
    } else {
        size_t n = ev->stored.n;
        td_kv_hash *out = malloc((n ? n : 1) * sizeof *out);
        if (!out) {
            st = TD_ERR_NOMEM;
        } else {
            size_t k = 0;
            for (uint32_t i = 0; i < ev->stored.cap; i++)
                if (ev->stored.vals[i] >= 0) out[k++] = ev->stored.keys[i];
            *full_p = true;
            *events_p = NULL;
            *hashes_p = out;
            *n_p = k;
            *last_seq_p = last;
        }
    }
    pthread_mutex_unlock(&ev->mu);
    return st;
}
