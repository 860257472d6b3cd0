#include "hmap.h"

#include <string.h>

static inline uint32_t slot_of(const td_kv_hmap *m, td_kv_hash h) {
    /* The hash is already uniform; mix the halves anyway so a caller-made
     * key with a constant lo still spreads. */
    return (uint32_t)((h.lo ^ (h.hi * 0x9E3779B97F4A7C15ull)) & (m->cap - 1u));
}

static td_status alloc_table(td_kv_hmap *m, uint32_t cap) {
    m->keys = calloc(cap, sizeof *m->keys);
    m->vals = malloc((size_t)cap * sizeof *m->vals);
    if (!m->keys || !m->vals) {
        free(m->keys);
        free(m->vals);
        m->keys = NULL;
        m->vals = NULL;
        return TD_ERR_NOMEM;
    }
    memset(m->vals, 0xff, (size_t)cap * sizeof *m->vals);
    m->cap = cap;
    m->n = 0;
    return TD_OK;
}

td_status td_kv_hmap_init(td_kv_hmap *m, uint32_t cap_hint) {
    uint32_t cap = 16;
    while (cap < 2u * cap_hint && cap < (1u << 30)) cap <<= 1;
    return alloc_table(m, cap);
}

void td_kv_hmap_free(td_kv_hmap *m) {
    if (!m) return;
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof *m);
}

int32_t td_kv_hmap_get(const td_kv_hmap *m, td_kv_hash h) {
    uint32_t i = slot_of(m, h);
    while (m->vals[i] >= 0) {
        if (td_kv_hash_eq(m->keys[i], h)) return m->vals[i];
        i = (i + 1u) & (m->cap - 1u);
    }
    return -1;
}

static void put_new(td_kv_hmap *m, td_kv_hash h, int32_t v) {
    uint32_t i = slot_of(m, h);
    while (m->vals[i] >= 0) i = (i + 1u) & (m->cap - 1u);
    m->keys[i] = h;
    m->vals[i] = v;
    m->n++;
}

static td_status grow(td_kv_hmap *m) {
    td_kv_hmap old = *m;
    if (alloc_table(m, old.cap * 2u) != TD_OK) {
        *m = old;
        return TD_ERR_NOMEM;
    }
    for (uint32_t i = 0; i < old.cap; i++)
        if (old.vals[i] >= 0) put_new(m, old.keys[i], old.vals[i]);
    free(old.keys);
    free(old.vals);
    return TD_OK;
}

bool td_kv_hmap_put(td_kv_hmap *m, td_kv_hash h, int32_t v, td_status *st_p) {
    if (st_p) *st_p = TD_OK;
    if (td_kv_hmap_get(m, h) >= 0) return false;
    if ((m->n + 1u) * 2u > m->cap) {
        td_status st = grow(m);
        if (st != TD_OK) {
            if (st_p) *st_p = st;
            return false;
        }
    }
    put_new(m, h, v);
    return true;
}

bool td_kv_hmap_del(td_kv_hmap *m, td_kv_hash h) {
    uint32_t mask = m->cap - 1u, i = slot_of(m, h);
    while (m->vals[i] >= 0 && !td_kv_hash_eq(m->keys[i], h)) i = (i + 1u) & mask;
    if (m->vals[i] < 0) return false;
    /* Backward-shift: pull later entries of the probe run into the hole
     * when their home slot does not lie cyclically in (hole, j]. */
    uint32_t hole = i, j = i;
    for (;;) {
        j = (j + 1u) & mask;
        if (m->vals[j] < 0) break;
        uint32_t home = slot_of(m, m->keys[j]);
        bool stays = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (stays) continue;
        m->keys[hole] = m->keys[j];
        m->vals[hole] = m->vals[j];
        hole = j;
    }
    m->vals[hole] = -1;
    m->n--;
    return true;
}
