/* Internal to common/ (kv and sched): a map from block hash to an int32 value (open
 * addressing, linear probing, backward-shift deletion, power-of-two
 * capacity that doubles at 50% load). Not thread-safe. */
#ifndef TD_KV_HMAP_H
#define TD_KV_HMAP_H

#include <stdbool.h>
#include <stdint.h>

#include "common/base/base.h"
#include "hash.h"

typedef struct {
    td_kv_hash *keys; /* (cap) */
    int32_t *vals;    /* (cap); -1 marks an empty slot */
    uint32_t cap;
    uint32_t n;
} td_kv_hmap;

/* cap_hint: expected entries. Free with td_kv_hmap_free(). */
td_status td_kv_hmap_init(td_kv_hmap *m, uint32_t cap_hint);
void td_kv_hmap_free(td_kv_hmap *m);
/* Value for h, or -1. */
int32_t td_kv_hmap_get(const td_kv_hmap *m, td_kv_hash h);
/* Inserts h -> v (v >= 0) if h is absent; returns false if present (map
 * unchanged). TD_ERR_NOMEM is reported through *st_p when growing fails. */
bool td_kv_hmap_put(td_kv_hmap *m, td_kv_hash h, int32_t v, td_status *st_p);
/* Removes h; returns false if absent. */
bool td_kv_hmap_del(td_kv_hmap *m, td_kv_hash h);

#endif
