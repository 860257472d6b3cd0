/* Prefix cache, block hashes and the KV event log (common/kv/kv.h, hash.h,
 * events.h), checked against references written here from the contracts:
 *  - block hashes recomputed with libxxhash's XXH3_128bits on the byte
 *    layout hash.h specifies (parent as 16 bytes: lo then hi, each a
 *    little-endian u64; token ids as little-endian u32; extra bytes);
 *  - the pool's behaviour (allocation order, LRU eviction, refcounts,
 *    reservations, counts, events) against a small brute-force model of
 *    the rules in kv.h, driven by random operation sequences. */
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <xxhash.h>

#include "common/kv/events.h"
#include "common/kv/hash.h"
#include "common/kv/kv.h"

/* ---------------------------------------------------------------------------
 * Reference hashing */

static void put_le64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void put_le32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static td_kv_hash ref_hash_block(td_kv_hash parent, const int32_t *tokens, int32_t n,
                                 const void *extra, size_t extra_len) {
    size_t len = 16 + 4 * (size_t)n + extra_len;
    uint8_t *buf = malloc(len);
    assert_non_null(buf);
    put_le64(buf, parent.lo);
    put_le64(buf + 8, parent.hi);
    for (int32_t i = 0; i < n; i++) put_le32(buf + 16 + 4 * (size_t)i, (uint32_t)tokens[i]);
    if (extra_len) memcpy(buf + 16 + 4 * (size_t)n, extra, extra_len);
    XXH128_hash_t h = XXH3_128bits(buf, len);
    free(buf);
    td_kv_hash r = {.lo = h.low64, .hi = h.high64};
    return r;
}

static uint64_t rng_state;
static uint64_t rnd(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static int32_t rnd_below(int32_t n) { return (int32_t)(rnd() % (uint64_t)n); }

static td_kv_hash rnd_hash(void) {
    td_kv_hash h;
    h.lo = rnd();
    h.hi = rnd();
    return h;
}

static void assert_hash_equal(td_kv_hash a, td_kv_hash b) {
    if (!td_kv_hash_eq(a, b))
        fail_msg("hash %016" PRIx64 "%016" PRIx64 " != %016" PRIx64 "%016" PRIx64, a.hi, a.lo, b.hi,
                 b.lo);
}

static void test_hash_block_reference(void **state) {
    (void)state;
    rng_state = 1;
    int32_t tokens[64];
    for (int i = 0; i < 64; i++) tokens[i] = (int32_t)(rnd() % 200000);
    tokens[3] = 0;
    tokens[4] = INT32_MAX;
    const uint8_t extra[5] = {1, 2, 3, 0xff, 0};
    for (int trial = 0; trial < 50; trial++) {
        td_kv_hash parent = rnd_hash();
        int32_t n = 1 + rnd_below(64);
        size_t xl = (size_t)rnd_below(6);
        assert_hash_equal(td_kv_hash_block(parent, tokens, n, xl ? extra : NULL, xl),
                          ref_hash_block(parent, tokens, n, extra, xl));
    }
    /* A zero parent is an ordinary value, not a special case. */
    td_kv_hash zero = {0, 0};
    assert_hash_equal(td_kv_hash_block(zero, tokens, 16, NULL, 0),
                      ref_hash_block(zero, tokens, 16, NULL, 0));
    /* Every input part changes the hash: parent lo, parent hi, a token, extra. */
    td_kv_hash p = rnd_hash(), base = td_kv_hash_block(p, tokens, 16, NULL, 0);
    td_kv_hash p2 = p;
    p2.lo ^= 1;
    assert_false(td_kv_hash_eq(base, td_kv_hash_block(p2, tokens, 16, NULL, 0)));
    p2 = p;
    p2.hi ^= 1ull << 63;
    assert_false(td_kv_hash_eq(base, td_kv_hash_block(p2, tokens, 16, NULL, 0)));
    int32_t t2[16];
    memcpy(t2, tokens, sizeof t2);
    t2[15] += 1;
    assert_false(td_kv_hash_eq(base, td_kv_hash_block(p, t2, 16, NULL, 0)));
    assert_false(td_kv_hash_eq(base, td_kv_hash_block(p, tokens, 16, extra, 1)));
}

static void test_hash_chain_reference(void **state) {
    (void)state;
    rng_state = 2;
    int32_t tokens[100];
    for (int i = 0; i < 100; i++) tokens[i] = (int32_t)(rnd() % 50000);
    td_kv_hash root = rnd_hash();
    const int32_t sizes[] = {1, 4, 16, 33};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        int32_t bs = sizes[s];
        for (int32_t n = 0; n <= 100; n += 7) {
            td_kv_hash out[101];
            memset(out, 0xab, sizeof out);
            td_kv_hash sentinel = out[100];
            int32_t nb = td_kv_hash_chain(root, tokens, n, bs, out);
            assert_int_equal(nb, n / bs);
            td_kv_hash parent = root;
            for (int32_t b = 0; b < nb; b++) {
                td_kv_hash want = ref_hash_block(parent, tokens + (size_t)b * bs, bs, NULL, 0);
                assert_hash_equal(out[b], want);
                parent = want;
            }
            /* Nothing written past the full blocks. */
            assert_hash_equal(out[nb], sentinel);
        }
    }
    /* The root is the first block's parent: two roots never share a block. */
    td_kv_hash a[4], b[4];
    td_kv_hash root2 = root;
    root2.hi ^= 2;
    assert_int_equal(td_kv_hash_chain(root, tokens, 64, 16, a), 4);
    assert_int_equal(td_kv_hash_chain(root2, tokens, 64, 16, b), 4);
    for (int i = 0; i < 4; i++) assert_false(td_kv_hash_eq(a[i], b[i]));
    /* A shared prefix gives shared leading hashes, then they diverge. */
    int32_t other[64];
    memcpy(other, tokens, sizeof other);
    other[40] ^= 1;
    assert_int_equal(td_kv_hash_chain(root, other, 64, 16, b), 4);
    assert_true(td_kv_hash_eq(a[0], b[0]) && td_kv_hash_eq(a[1], b[1]));
    assert_false(td_kv_hash_eq(a[2], b[2]));
    assert_false(td_kv_hash_eq(a[3], b[3]));
}

static td_kv_compat compat_base(void) {
    td_kv_compat c = {.model_id = "smollm2-135m:abcdef",
                      .weight_type = "q4_1",
                      .kv_dtype = "f32",
                      .block_size = 16,
                      .layout_version = TD_KV_LAYOUT_VERSION,
                      .protocol_version = TD_KV_PROTOCOL_VERSION};
    return c;
}

static void test_compat_hash(void **state) {
    (void)state;
    td_kv_compat c = compat_base();
    td_kv_hash h = td_kv_compat_hash(&c);
    td_kv_compat same = compat_base();
    char model_copy[] = "smollm2-135m:abcdef";
    same.model_id = model_copy; /* by value, not by pointer */
    assert_hash_equal(td_kv_compat_hash(&same), h);

    td_kv_hash seen[16];
    int n = 0;
    seen[n++] = h;
    td_kv_compat v;
    v = compat_base(), v.model_id = "smollm2-135m:abcdeg", seen[n++] = td_kv_compat_hash(&v);
    v = compat_base(), v.weight_type = "q8_0", seen[n++] = td_kv_compat_hash(&v);
    v = compat_base(), v.kv_dtype = "f16", seen[n++] = td_kv_compat_hash(&v);
    v = compat_base(), v.block_size = 32, seen[n++] = td_kv_compat_hash(&v);
    v = compat_base(), v.layout_version = TD_KV_LAYOUT_VERSION + 1,
    seen[n++] = td_kv_compat_hash(&v);
    v = compat_base(), v.protocol_version = TD_KV_PROTOCOL_VERSION + 1,
    seen[n++] = td_kv_compat_hash(&v);
    /* Length prefixes: moving bytes across a field boundary changes the hash. */
    v = compat_base(), v.model_id = "smollm2-135m:abcdefq", v.weight_type = "4_1",
    seen[n++] = td_kv_compat_hash(&v);
    v = compat_base(), v.weight_type = "q4_1f", v.kv_dtype = "32",
    seen[n++] = td_kv_compat_hash(&v);
    v = compat_base(), v.model_id = "", seen[n++] = td_kv_compat_hash(&v);
    /* Integer fields are not interchangeable either. */
    v = compat_base(), v.block_size = TD_KV_LAYOUT_VERSION, v.layout_version = 16,
    seen[n++] = td_kv_compat_hash(&v);
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++)
            if (td_kv_hash_eq(seen[i], seen[j]))
                fail_msg("compat variants %d and %d collide", i, j);
}

static void test_hash_hex(void **state) {
    (void)state;
    rng_state = 3;
    for (int i = 0; i < 200; i++) {
        td_kv_hash h = rnd_hash();
        if (i == 0) h.lo = h.hi = 0;
        if (i == 1) h.lo = h.hi = UINT64_MAX;
        if (i == 2) h.hi = 0;
        char buf[33], want[40];
        memset(buf, 'x', sizeof buf);
        td_kv_hash_hex(h, buf);
        snprintf(want, sizeof want, "%016" PRIx64 "%016" PRIx64, h.hi, h.lo);
        assert_string_equal(buf, want);
        td_kv_hash back = {0x1234, 0x5678};
        assert_true(td_kv_hash_parse(buf, &back));
        assert_hash_equal(back, h);
    }
    td_kv_hash h;
    assert_true(td_kv_hash_parse("000102030405060708090a0b0c0d0e0f", &h));
    assert_true(h.hi == 0x0001020304050607ull && h.lo == 0x08090a0b0c0d0e0full);

    const char *bad[] = {
        "",
        "0",
        "000102030405060708090a0b0c0d0e0",   /* 31 digits */
        "000102030405060708090a0b0c0d0e0f0", /* 33 digits */
        "000102030405060708090a0b0c0d0e0g",  /* not hex */
        "0x0102030405060708090a0b0c0d0e0f",  /* prefix */
        " 00102030405060708090a0b0c0d0e0f",  /* leading space (strtoull would accept it) */
        "+00102030405060708090a0b0c0d0e0f",  /* sign */
        "-00102030405060708090a0b0c0d0e0f",
        "0001020304050607 8090a0b0c0d0e0f", /* space inside */
        "00010203040506070809-a0b0c0d0e0f",
        "000102030405060708090a0b0c0d0e0f ", /* trailing space */
        "000102030405060708090a0b0c0d0e0f\n",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        td_kv_hash out = {0xdead, 0xbeef};
        if (td_kv_hash_parse(bad[i], &out)) fail_msg("accepted bad hex \"%s\"", bad[i]);
        /* Output written only on success. */
        assert_true(out.lo == 0xdead && out.hi == 0xbeef);
    }
}

/* ---------------------------------------------------------------------------
 * The event log on its own */

static bool set_has(const td_kv_hash *hs, size_t n, td_kv_hash h) {
    for (size_t i = 0; i < n; i++)
        if (td_kv_hash_eq(hs[i], h)) return true;
    return false;
}

/* Same multiset, no duplicates on either side. */
static void assert_same_set(const td_kv_hash *got, size_t n_got, const td_kv_hash *want,
                            size_t n_want) {
    if (n_got != n_want) fail_msg("snapshot has %zu hashes, expected %zu", n_got, n_want);
    for (size_t i = 0; i < n_want; i++) {
        if (!set_has(got, n_got, want[i])) fail_msg("snapshot lacks expected hash %zu", i);
        for (size_t j = i + 1; j < n_got; j++)
            if (td_kv_hash_eq(got[i], got[j])) fail_msg("snapshot repeats a hash");
    }
}

typedef struct {
    bool full;
    td_kv_event *events;
    td_kv_hash *hashes;
    size_t n;
    uint64_t last;
} read_result;

static read_result read_events(td_kv_events *ev, uint64_t since) {
    read_result r;
    memset(&r, 0, sizeof r);
    r.last = 0xfeedull;
    assert_int_equal(td_kv_events_read(ev, since, &r.full, &r.events, &r.hashes, &r.n, &r.last),
                     TD_OK);
    if (r.full) {
        assert_null(r.events);
        if (r.n) assert_non_null(r.hashes);
    } else {
        assert_null(r.hashes);
        if (r.n) assert_non_null(r.events);
    }
    return r;
}

static void read_free(read_result *r) {
    free(r->events);
    free(r->hashes);
}

static void test_events_log(void **state) {
    (void)state;
    td_kv_events *ev = NULL;
    assert_int_not_equal(td_kv_events_create(0, 1, &ev), TD_OK);
    assert_null(ev);
    assert_int_equal(td_kv_events_create(4, 77, &ev), TD_OK);
    assert_non_null(ev);
    assert_true(td_kv_events_epoch(ev) == 77);
    assert_true(td_kv_events_last_seq(ev) == 0);

    /* Empty log: a diff of nothing from 0; the future is a (empty) snapshot. */
    read_result r = read_events(ev, 0);
    assert_false(r.full);
    assert_int_equal(r.n, 0);
    assert_true(r.last == 0);
    read_free(&r);
    r = read_events(ev, 5);
    assert_true(r.full);
    assert_int_equal(r.n, 0);
    assert_true(r.last == 0);
    read_free(&r);

    rng_state = 4;
    td_kv_hash h[8];
    for (int i = 0; i < 8; i++) h[i] = rnd_hash();
    td_kv_events_append(ev, TD_KV_EVENT_STORED, h[0]); /* 1 */
    td_kv_events_append(ev, TD_KV_EVENT_STORED, h[1]); /* 2 */
    td_kv_events_append(ev, TD_KV_EVENT_STORED, h[2]); /* 3 */
    assert_true(td_kv_events_last_seq(ev) == 3);
    r = read_events(ev, 1);
    assert_false(r.full);
    assert_int_equal(r.n, 2);
    assert_true(r.last == 3);
    assert_true(r.events[0].seq == 2 && r.events[0].type == TD_KV_EVENT_STORED);
    assert_hash_equal(r.events[0].hash, h[1]);
    assert_true(r.events[1].seq == 3 && r.events[1].type == TD_KV_EVENT_STORED);
    assert_hash_equal(r.events[1].hash, h[2]);
    read_free(&r);
    r = read_events(ev, 3); /* up to date */
    assert_false(r.full);
    assert_int_equal(r.n, 0);
    assert_true(r.last == 3);
    read_free(&r);

    td_kv_events_append(ev, TD_KV_EVENT_REMOVED, h[1]); /* 4 */
    td_kv_events_append(ev, TD_KV_EVENT_STORED, h[3]);  /* 5 */
    td_kv_events_append(ev, TD_KV_EVENT_STORED, h[4]);  /* 6: event 2 is gone (capacity 4) */
    r = read_events(ev, 2);                             /* needs 3..6, all kept */
    assert_false(r.full);
    assert_int_equal(r.n, 4);
    assert_true(r.last == 6);
    for (size_t i = 0; i < 4; i++) assert_true(r.events[i].seq == 3 + i);
    assert_true(r.events[1].type == TD_KV_EVENT_REMOVED);
    assert_hash_equal(r.events[1].hash, h[1]);
    read_free(&r);
    for (uint64_t since = 0; since <= 1; since++) { /* needs event 2: too old */
        r = read_events(ev, since);
        assert_true(r.full);
        assert_true(r.last == 6);
        td_kv_hash want[] = {h[0], h[2], h[3], h[4]};
        assert_same_set(r.hashes, r.n, want, 4);
        read_free(&r);
    }
    r = read_events(ev, 7); /* from the future: another epoch */
    assert_true(r.full);
    assert_true(r.last == 6);
    td_kv_hash want6[] = {h[0], h[2], h[3], h[4]};
    assert_same_set(r.hashes, r.n, want6, 4);
    read_free(&r);

    td_kv_events_append(ev, TD_KV_EVENT_CLEARED, h[7]); /* 7: hash unused */
    td_kv_events_append(ev, TD_KV_EVENT_STORED, h[5]);  /* 8 */
    r = read_events(ev, 0);
    assert_true(r.full);
    assert_true(r.last == 8);
    assert_same_set(r.hashes, r.n, &h[5], 1);
    read_free(&r);
    r = read_events(ev, 6);
    assert_false(r.full);
    assert_int_equal(r.n, 2);
    assert_true(r.events[0].seq == 7 && r.events[0].type == TD_KV_EVENT_CLEARED);
    assert_true(r.events[1].seq == 8 && r.events[1].type == TD_KV_EVENT_STORED);
    read_free(&r);
    td_kv_events_destroy(ev);
    td_kv_events_destroy(NULL);
}

/* ---------------------------------------------------------------------------
 * The pool against a model */

#define MAXB 200 /* pools past three 64-bit words of the free bitmap */

typedef struct {
    int32_t n;
    int32_t refc[MAXB];
    bool hashed[MAXB];
    td_kv_hash hash[MAXB];
    uint64_t lru_stamp[MAXB]; /* cached blocks: when they became cached */
    uint64_t clock;
    int32_t reserved;
    uint64_t evictions;
    /* Expected events since the start. */
    td_kv_event *events;
    size_t n_events, cap_events;
} model;

static void model_init(model *m, int32_t n) {
    memset(m, 0, sizeof *m);
    m->n = n;
}

static void model_event(model *m, td_kv_event_type t, td_kv_hash h) {
    if (m->n_events == m->cap_events) {
        m->cap_events = m->cap_events ? 2 * m->cap_events : 64;
        m->events = realloc(m->events, m->cap_events * sizeof *m->events);
        assert_non_null(m->events);
    }
    td_kv_event e = {.seq = m->n_events + 1, .type = t, .hash = h};
    m->events[m->n_events++] = e;
}

static bool m_cached(const model *m, int32_t i) { return m->refc[i] == 0 && m->hashed[i]; }
static bool m_empty(const model *m, int32_t i) { return m->refc[i] == 0 && !m->hashed[i]; }

static int32_t model_n_empty(const model *m) {
    int32_t c = 0;
    for (int32_t i = 0; i < m->n; i++) c += m_empty(m, i);
    return c;
}
static int32_t model_n_cached(const model *m) {
    int32_t c = 0;
    for (int32_t i = 0; i < m->n; i++) c += m_cached(m, i);
    return c;
}
static int32_t model_n_free(const model *m) {
    return model_n_empty(m) + model_n_cached(m) - m->reserved;
}

static int32_t model_find(const model *m, td_kv_hash h) {
    for (int32_t i = 0; i < m->n; i++)
        if (m->hashed[i] && td_kv_hash_eq(m->hash[i], h)) return i;
    return -1;
}

/* The ids td_kv_block_alloc must return per kv.h, in order where kv.h fixes
 * it: empty blocks first (the lowest run of n consecutive empty ids, else
 * the lowest empty ids), then cached ones evicted least recently used
 * first. Returns false when fewer than n are free. */
static bool model_alloc(model *m, int32_t n, bool from_reservation, int32_t *ids) {
    if (from_reservation) {
        assert_true(m->reserved >= n);
        m->reserved -= n;
    } else if (model_n_free(m) < n) {
        return false;
    }
    int32_t k = 0, ne = model_n_empty(m);
    if (ne >= n) {
        int32_t run_start = -1;
        for (int32_t i = 0, len = 0; i < m->n; i++) {
            len = m_empty(m, i) ? len + 1 : 0;
            if (len == n) {
                run_start = i - n + 1;
                break;
            }
        }
        if (run_start >= 0) {
            for (int32_t i = 0; i < n; i++) ids[k++] = run_start + i;
        } else {
            for (int32_t i = 0; i < m->n && k < n; i++)
                if (m_empty(m, i)) ids[k++] = i;
        }
    } else {
        for (int32_t i = 0; i < m->n; i++)
            if (m_empty(m, i)) ids[k++] = i;
        while (k < n) {
            int32_t best = -1;
            for (int32_t i = 0; i < m->n; i++)
                if (m_cached(m, i) && (best < 0 || m->lru_stamp[i] < m->lru_stamp[best])) best = i;
            assert_true(best >= 0);
            model_event(m, TD_KV_EVENT_REMOVED, m->hash[best]);
            m->hashed[best] = false;
            m->evictions++;
            ids[k++] = best;
        }
    }
    for (int32_t i = 0; i < n; i++) m->refc[ids[i]] = 1;
    return true;
}

static void model_free(model *m, const int32_t *ids, int32_t n) {
    for (int32_t i = n - 1; i >= 0; i--) {
        int32_t id = ids[i];
        assert_true(m->refc[id] > 0);
        if (--m->refc[id] == 0 && m->hashed[id]) m->lru_stamp[id] = ++m->clock;
    }
}

static int32_t model_acquire(model *m, const td_kv_hash *hs, int32_t n, int32_t *ids) {
    int32_t k = 0;
    for (; k < n; k++) {
        int32_t id = model_find(m, hs[k]);
        if (id < 0) break;
        m->refc[id]++;
        ids[k] = id;
    }
    return k;
}

static int32_t model_probe(const model *m, const td_kv_hash *hs, int32_t n) {
    int32_t k = 0;
    while (k < n && model_find(m, hs[k]) >= 0) k++;
    return k;
}

static void check_counts(const td_kv_pool *pool, const model *m) {
    td_kv_counts c;
    memset(&c, 0xff, sizeof c);
    td_kv_pool_counts(pool, &c);
    int32_t empty = 0, cached = 0, used = 0, hashed = 0, run = 0, best_run = 0;
    for (int32_t i = 0; i < m->n; i++) {
        empty += m_empty(m, i);
        cached += m_cached(m, i);
        used += m->refc[i] > 0;
        hashed += m->hashed[i];
        run = m->refc[i] == 0 ? run + 1 : 0;
        if (run > best_run) best_run = run;
        assert_int_equal(td_kv_block_refcount(pool, i), m->refc[i]);
    }
    assert_int_equal(c.total, m->n);
    assert_int_equal(c.empty + c.cached + c.used, c.total);
    assert_int_equal(c.empty, empty);
    assert_int_equal(c.cached, cached);
    assert_int_equal(c.used, used);
    assert_int_equal(c.hashed, hashed);
    assert_int_equal(c.reserved, m->reserved);
    assert_int_equal(c.largest_free_run, best_run);
    double frag = empty + cached > 0 ? 1.0 - (double)best_run / (double)(empty + cached) : 0.0;
    if (c.fragmentation < frag - 1e-9 || c.fragmentation > frag + 1e-9)
        fail_msg("fragmentation %g, expected %g", c.fragmentation, frag);
    assert_true(c.evictions == m->evictions);
    assert_int_equal(td_kv_pool_n_free(pool), empty + cached - m->reserved);
}

/* The pool's log from `since` must be exactly the model's events after it. */
static void check_events(td_kv_pool *pool, const model *m, uint64_t since) {
    read_result r = read_events(td_kv_pool_events(pool), since);
    assert_false(r.full);
    assert_true(r.last == m->n_events);
    assert_int_equal(r.n, m->n_events - since);
    for (size_t i = 0; i < r.n; i++) {
        const td_kv_event *w = &m->events[since + i];
        if (r.events[i].seq != w->seq || r.events[i].type != w->type ||
            !td_kv_hash_eq(r.events[i].hash, w->hash))
            fail_msg("event %zu: got seq %" PRIu64 " type %d, expected seq %" PRIu64 " type %d%s",
                     (size_t)since + i, r.events[i].seq, (int)r.events[i].type, w->seq,
                     (int)w->type,
                     td_kv_hash_eq(r.events[i].hash, w->hash) ? "" : " (hash differs)");
    }
    read_free(&r);
}

static td_kv_pool *make_pool(int32_t n_blocks, uint32_t event_capacity, uint64_t epoch) {
    td_kv_params p = td_kv_default_params();
    p.n_layers = 1;
    p.n_kv_heads = 1;
    p.head_dim = 4;
    p.block_size = 4;
    p.n_blocks = n_blocks;
    if (event_capacity) p.event_capacity = event_capacity;
    p.epoch = epoch;
    td_kv_pool *pool = NULL;
    assert_int_equal(td_kv_pool_create(&p, &pool), TD_OK);
    assert_non_null(pool);
    return pool;
}

/* kv.h fixes the order of an allocation from empty blocks only (a run, or
 * the lowest ids); with evictions it fixes which blocks, and the "removed"
 * events fix the eviction order, so those are compared as sets. */
static void compare_alloc(const int32_t *got, const int32_t *want, int32_t n, bool exact) {
    for (int32_t i = 0; i < n; i++) {
        if (exact) {
            if (got[i] != want[i])
                fail_msg("alloc %d: id[%d] = %d, expected %d", n, i, got[i], want[i]);
            continue;
        }
        bool found = false;
        for (int32_t j = 0; j < n; j++) found |= got[i] == want[j];
        if (!found) fail_msg("alloc %d: got id %d, not among the expected ones", n, got[i]);
        for (int32_t j = i + 1; j < n; j++)
            if (got[i] == got[j]) fail_msg("alloc %d: id %d returned twice", n, got[i]);
    }
}

static void alloc_both(td_kv_pool *pool, model *m, int32_t n, int32_t *ids) {
    int32_t want[MAXB] = {0}; /* filled by model_alloc (zeroed: release builds cannot see it) */
    uint64_t ev = m->evictions;
    assert_true(model_alloc(m, n, false, want));
    assert_int_equal(td_kv_block_alloc(pool, n, ids), TD_OK);
    compare_alloc(ids, want, n, m->evictions == ev);
}

static void insert_both(td_kv_pool *pool, model *m, int32_t id, td_kv_hash h) {
    assert_int_equal(model_find(m, h), -1);
    assert_true(td_kv_cache_insert(pool, id, h));
    m->hashed[id] = true;
    m->hash[id] = h;
    model_event(m, TD_KV_EVENT_STORED, h);
}

static void free_both(td_kv_pool *pool, model *m, const int32_t *ids, int32_t n) {
    td_kv_block_free(pool, ids, n);
    model_free(m, ids, n);
}

static void test_defaults_and_epoch(void **state) {
    (void)state;
    td_kv_params p = td_kv_default_params();
    assert_int_equal(p.block_size, 16);
    assert_true(p.event_capacity == 65536);
    td_kv_pool *a = make_pool(4, 0, 123);
    assert_true(td_kv_events_epoch(td_kv_pool_events(a)) == 123);
    td_kv_pool *b = make_pool(4, 0, 0), *c = make_pool(4, 0, 0);
    uint64_t eb = td_kv_events_epoch(td_kv_pool_events(b));
    uint64_t ec = td_kv_events_epoch(td_kv_pool_events(c));
    /* "0: random": two pools made one after the other get different epochs. */
    assert_true(eb != ec);
    assert_true(eb != 0 && ec != 0);
    td_kv_counts k;
    td_kv_pool_counts(a, &k);
    assert_int_equal(k.total, 4);
    assert_int_equal(k.empty, 4);
    assert_int_equal(k.largest_free_run, 4);
    assert_true(k.fragmentation == 0.0);
    td_kv_pool_destroy(a);
    td_kv_pool_destroy(b);
    td_kv_pool_destroy(c);
}

static void test_insert_acquire_probe(void **state) {
    (void)state;
    rng_state = 10;
    td_kv_pool *pool = make_pool(8, 0, 1);
    model m;
    model_init(&m, 8);
    td_kv_hash h[6];
    for (int i = 0; i < 6; i++) h[i] = rnd_hash();

    int32_t a[4];
    alloc_both(pool, &m, 4, a);                                    /* 0..3 */
    for (int i = 0; i < 3; i++) insert_both(pool, &m, a[i], h[i]); /* a[3] stays unhashed */
    check_counts(pool, &m);

    /* Duplicate hash: refused, the block stays unhashed, no event. */
    int32_t b[1];
    alloc_both(pool, &m, 1, b);
    assert_false(td_kv_cache_insert(pool, b[0], h[1]));
    check_counts(pool, &m);
    check_events(pool, &m, 0);

    /* Probe / acquire: leading hits only, stop at the first miss. */
    td_kv_hash q[4] = {h[0], h[1], h[4], h[2]};
    assert_int_equal(td_kv_cache_probe(pool, q, 4), 2);
    assert_int_equal(td_kv_cache_probe(pool, &h[4], 1), 0);
    assert_int_equal(td_kv_cache_probe(pool, h, 3), 3);
    check_counts(pool, &m); /* probe takes nothing */
    int32_t got[4] = {-1, -1, -1, -1}, want[4];
    assert_int_equal(td_kv_cache_acquire(pool, q, 4, got), 2);
    assert_int_equal(model_acquire(&m, q, 4, want), 2);
    assert_int_equal(got[0], a[0]);
    assert_int_equal(got[1], a[1]);
    assert_int_equal(td_kv_block_refcount(pool, a[0]), 2);
    check_counts(pool, &m);

    /* The writer finishes: its hashed blocks stay used (the reader holds
     * them) except the unshared one, which becomes cached; the unhashed
     * one becomes empty. */
    free_both(pool, &m, a, 4);
    free_both(pool, &m, b, 1); /* the refused duplicate: empty again */
    check_counts(pool, &m);
    td_kv_counts c;
    td_kv_pool_counts(pool, &c);
    assert_int_equal(c.cached, 1); /* a[2] */
    assert_int_equal(c.used, 2);   /* a[0], a[1] held by the reader */
    assert_int_equal(c.hashed, 3);

    /* A cached block is found again, taken off the LRU (used again). */
    int32_t g3[3];
    assert_int_equal(td_kv_cache_acquire(pool, h, 3, g3), 3);
    assert_int_equal(model_acquire(&m, h, 3, want), 3);
    for (int i = 0; i < 3; i++) assert_int_equal(g3[i], a[i]);
    check_counts(pool, &m);
    td_kv_pool_counts(pool, &c);
    assert_int_equal(c.cached, 0);
    free_both(pool, &m, got, 2);
    free_both(pool, &m, g3, 3);
    check_counts(pool, &m);
    td_kv_pool_counts(pool, &c);
    assert_int_equal(c.cached, 3);
    assert_int_equal(c.used, 0);
    /* Cached blocks count as free. */
    assert_int_equal(td_kv_pool_n_free(pool), 8);

    /* td_kv_block_ref adds a reference. */
    int32_t d[1];
    alloc_both(pool, &m, 1, d);
    td_kv_block_ref(pool, d[0]);
    m.refc[d[0]]++;
    assert_int_equal(td_kv_block_refcount(pool, d[0]), 2);
    free_both(pool, &m, d, 1);
    assert_int_equal(td_kv_block_refcount(pool, d[0]), 1);
    free_both(pool, &m, d, 1);
    check_counts(pool, &m);
    check_events(pool, &m, 0);
    free(m.events);
    td_kv_pool_destroy(pool);
}

static void test_lru_eviction(void **state) {
    (void)state;
    rng_state = 11;
    td_kv_pool *pool = make_pool(6, 0, 1);
    model m;
    model_init(&m, 6);
    td_kv_hash h[6];
    for (int i = 0; i < 6; i++) h[i] = rnd_hash();

    /* Two sequences of three hashed blocks. */
    int32_t s1[3], s2[3];
    alloc_both(pool, &m, 3, s1); /* 0,1,2 */
    alloc_both(pool, &m, 3, s2); /* 3,4,5 */
    for (int i = 0; i < 3; i++) insert_both(pool, &m, s1[i], h[i]);
    for (int i = 0; i < 3; i++) insert_both(pool, &m, s2[i], h[3 + i]);
    /* Freed s1 first, then s2; within one free, the tail goes first:
     * LRU order is s1[2], s1[1], s1[0], s2[2], s2[1], s2[0]. */
    free_both(pool, &m, s1, 3);
    free_both(pool, &m, s2, 3);
    check_counts(pool, &m);
    uint64_t seen = m.n_events;

    /* Re-acquiring s1's head leaves the LRU; it is never evicted while used. */
    int32_t head[1];
    assert_int_equal(td_kv_cache_acquire(pool, &h[0], 1, head), 1);
    model_acquire(&m, &h[0], 1, head);
    assert_int_equal(head[0], s1[0]);
    check_counts(pool, &m);

    /* No empty block left: allocations evict, least recently freed first. */
    int32_t x[2];
    alloc_both(pool, &m, 2, x); /* s1[2] and s1[1]; events say in that order */
    check_counts(pool, &m);
    check_events(pool, &m, seen);
    assert_int_equal(td_kv_cache_probe(pool, h, 3), 1); /* h[1] gone: the chain stops */
    td_kv_hash tail[2] = {h[2], h[1]};
    assert_int_equal(td_kv_cache_probe(pool, tail, 1), 0);

    /* Free the head again: it becomes the most recently used cached block,
     * so s2's blocks (freed earlier) go before it. */
    free_both(pool, &m, head, 1);
    int32_t y[3];
    alloc_both(pool, &m, 3, y); /* s2[2], s2[1], s2[0] */
    check_counts(pool, &m);
    check_events(pool, &m, 0);
    int32_t z[1];
    alloc_both(pool, &m, 1, z);
    assert_int_equal(z[0], s1[0]);
    /* Pool exhausted: all or nothing, nothing changes. */
    int32_t w[1] = {-7};
    assert_int_equal(td_kv_block_alloc(pool, 1, w), TD_NO_KV_BLOCK);
    assert_int_equal(w[0], -7);
    check_counts(pool, &m);
    check_events(pool, &m, 0);
    td_kv_counts c;
    td_kv_pool_counts(pool, &c);
    assert_true(c.evictions == 6);

    /* Mixed: an empty block is taken before any cached one is evicted. */
    td_kv_hash g = rnd_hash();
    insert_both(pool, &m, x[0], g);
    free_both(pool, &m, x, 2); /* x[1] empty, x[0] cached */
    free_both(pool, &m, z, 1); /* z unhashed now: empty */
    int32_t v[2];
    alloc_both(pool, &m, 2, v); /* both empty blocks, no eviction */
    check_counts(pool, &m);
    assert_int_equal(td_kv_cache_probe(pool, &g, 1), 1);
    int32_t u[1];
    alloc_both(pool, &m, 1, u); /* now the cached one */
    assert_int_equal(u[0], x[0]);
    assert_int_equal(td_kv_cache_probe(pool, &g, 1), 0);
    check_counts(pool, &m);
    check_events(pool, &m, 0);
    free(m.events);
    td_kv_pool_destroy(pool);
}

static void test_reservations(void **state) {
    (void)state;
    rng_state = 12;
    td_kv_pool *pool = make_pool(8, 0, 1);
    model m;
    model_init(&m, 8);
    assert_int_equal(td_kv_reserve(pool, 5), TD_OK);
    m.reserved = 5;
    check_counts(pool, &m);
    assert_int_equal(td_kv_pool_n_free(pool), 3);
    /* Not enough: refused, nothing changes. */
    assert_int_equal(td_kv_reserve(pool, 4), TD_NO_KV_BLOCK);
    check_counts(pool, &m);
    int32_t ids[8];
    assert_int_equal(td_kv_block_alloc(pool, 4, ids), TD_NO_KV_BLOCK);
    check_counts(pool, &m);
    int32_t a[3];
    alloc_both(pool, &m, 3, a);
    assert_int_equal(td_kv_pool_n_free(pool), 0);
    assert_int_equal(td_kv_block_alloc(pool, 1, ids), TD_NO_KV_BLOCK);
    assert_int_equal(td_kv_reserve(pool, 1), TD_NO_KV_BLOCK);
    /* Reserved allocations consume the promise. */
    int32_t r[2], want[2];
    assert_int_equal(td_kv_block_alloc_reserved(pool, 2, r), TD_OK);
    assert_true(model_alloc(&m, 2, true, want));
    compare_alloc(r, want, 2, true);
    check_counts(pool, &m);
    td_kv_unreserve(pool, 1);
    m.reserved -= 1;
    check_counts(pool, &m);
    assert_int_equal(td_kv_pool_n_free(pool), 1);
    /* Cached blocks count toward a reservation. */
    td_kv_hash h = rnd_hash();
    insert_both(pool, &m, a[0], h);
    free_both(pool, &m, a, 3);
    check_counts(pool, &m);
    assert_int_equal(td_kv_pool_n_free(pool), 4);
    assert_int_equal(td_kv_reserve(pool, 4), TD_OK);
    m.reserved += 4;
    check_counts(pool, &m);
    int32_t big[6];
    assert_int_equal(td_kv_block_alloc_reserved(pool, 6, big), TD_OK);
    assert_true(model_alloc(&m, 6, true, ids));
    compare_alloc(big, ids, 6, false);
    check_counts(pool, &m); /* evicted the cached block */
    assert_int_equal(td_kv_cache_probe(pool, &h, 1), 0);
    assert_int_equal(m.reserved, 0);
    check_events(pool, &m, 0);
    free_both(pool, &m, big, 6);
    free_both(pool, &m, r, 2);
    check_counts(pool, &m);
    td_kv_counts c;
    td_kv_pool_counts(pool, &c);
    assert_int_equal(c.used, 0);
    assert_int_equal(c.reserved, 0);
    free(m.events);
    td_kv_pool_destroy(pool);
}

static void test_contiguous_runs(void **state) {
    (void)state;
    td_kv_pool *pool = make_pool(16, 0, 1);
    model m;
    model_init(&m, 16);
    int32_t a[3], b[3], c1[1], d[2], e[1];
    alloc_both(pool, &m, 3, a); /* 0 1 2 */
    alloc_both(pool, &m, 3, b); /* 3 4 5 */
    assert_int_equal(a[0], 0);
    assert_int_equal(b[0], 3);
    int32_t one = 1;
    free_both(pool, &m, &one, 1); /* hole at 1 */
    check_counts(pool, &m);
    alloc_both(pool, &m, 2, d); /* the hole is too short: 6 7 */
    assert_int_equal(d[0], 6);
    assert_int_equal(d[1], 7);
    alloc_both(pool, &m, 1, c1); /* fills the hole */
    assert_int_equal(c1[0], 1);
    /* Only scattered empty blocks: the lowest ones. */
    int32_t rest[8];
    alloc_both(pool, &m, 8, rest); /* 8..15 */
    int32_t holes[3] = {9, 11, 13};
    free_both(pool, &m, holes, 3);
    check_counts(pool, &m); /* largest run 1, fragmentation 2/3 */
    td_kv_counts k;
    td_kv_pool_counts(pool, &k);
    assert_int_equal(k.largest_free_run, 1);
    int32_t f[2];
    alloc_both(pool, &m, 2, f);
    assert_int_equal(f[0], 9);
    assert_int_equal(f[1], 11);
    alloc_both(pool, &m, 1, e);
    assert_int_equal(e[0], 13);
    check_counts(pool, &m);
    td_kv_pool_counts(pool, &k);
    assert_true(k.fragmentation == 0.0); /* nothing free */
    free(m.events);
    td_kv_pool_destroy(pool);
}

static void test_events_from_pool(void **state) {
    (void)state;
    rng_state = 13;
    td_kv_pool *pool = make_pool(4, 3, 9); /* keeps the last 3 events */
    model m;
    model_init(&m, 4);
    td_kv_hash h[4];
    for (int i = 0; i < 4; i++) h[i] = rnd_hash();
    int32_t a[4];
    alloc_both(pool, &m, 4, a);
    for (int i = 0; i < 4; i++) insert_both(pool, &m, a[i], h[i]); /* events 1..4 */
    check_events(pool, &m, 1);                                     /* 2..4 kept */
    read_result r = read_events(td_kv_pool_events(pool), 0);       /* needs event 1: gone */
    assert_true(r.full);
    assert_true(r.last == 4);
    assert_same_set(r.hashes, r.n, h, 4);
    read_free(&r);
    r = read_events(td_kv_pool_events(pool), 99);
    assert_true(r.full);
    assert_same_set(r.hashes, r.n, h, 4);
    read_free(&r);

    /* Evictions are "removed" events with the evicted hash. */
    free_both(pool, &m, a, 4); /* LRU: a3 a2 a1 a0 */
    int32_t x[2];
    alloc_both(pool, &m, 2, x); /* evicts h3, h2: events 5, 6 */
    check_events(pool, &m, 3);
    r = read_events(td_kv_pool_events(pool), 0);
    assert_true(r.full);
    assert_true(r.last == 6);
    assert_same_set(r.hashes, r.n, h, 2); /* h0, h1 still stored */
    read_free(&r);

    /* td_kv_cache_clear: cached blocks become empty with removed events;
     * a used hashed block keeps its hash. */
    int32_t y[1];
    assert_int_equal(td_kv_cache_acquire(pool, h, 1, y), 1);
    model_acquire(&m, h, 1, y);
    uint64_t since = td_kv_events_last_seq(td_kv_pool_events(pool));
    td_kv_cache_clear(pool);
    read_result d = read_events(td_kv_pool_events(pool), since);
    assert_false(d.full);
    assert_int_equal(d.n, 1);
    assert_true(d.events[0].type == TD_KV_EVENT_REMOVED);
    assert_hash_equal(d.events[0].hash, h[1]);
    read_free(&d);
    td_kv_counts c;
    td_kv_pool_counts(pool, &c);
    assert_int_equal(c.cached, 0);
    assert_int_equal(c.hashed, 1);
    assert_int_equal(c.used, 3);
    assert_int_equal(c.empty, 1);
    assert_int_equal(td_kv_cache_probe(pool, h, 2), 1);
    r = read_events(td_kv_pool_events(pool), 0);
    assert_true(r.full);
    assert_same_set(r.hashes, r.n, h, 1);
    read_free(&r);
    /* Freed again, the kept hash is cached and can be found. */
    td_kv_block_free(pool, y, 1);
    td_kv_pool_counts(pool, &c);
    assert_int_equal(c.cached, 1);
    assert_int_equal(td_kv_cache_probe(pool, h, 1), 1);
    td_kv_block_free(pool, x, 2);
    td_kv_cache_clear(pool);
    td_kv_pool_counts(pool, &c);
    assert_int_equal(c.empty, 4);
    assert_int_equal(c.hashed, 0);
    assert_int_equal(td_kv_cache_probe(pool, h, 1), 0);
    r = read_events(td_kv_pool_events(pool), 0);
    assert_true(r.full);
    assert_int_equal(r.n, 0);
    read_free(&r);
    free(m.events);
    td_kv_pool_destroy(pool);
}

/* Random operation sequences against the model; every count, refcount,
 * allocation and event checked after every step. */
typedef struct {
    int32_t ids[MAXB];
    int32_t n;
} holding;
#define MAX_HOLD 512

static void test_random_vs_model(void **state) {
    (void)state;
    for (uint64_t seed = 100; seed < 140; seed++) {
        rng_state = seed;
        int32_t nb = 4 + rnd_below(MAXB - 4);
        td_kv_pool *pool = make_pool(nb, 0, 1);
        model m;
        model_init(&m, nb);
        holding *hold = calloc(MAX_HOLD, sizeof *hold);
        assert_non_null(hold);
        int n_hold = 0;
        td_kv_hash known[256];
        int n_known = 0;
        uint64_t last_checked = 0;
        for (int step = 0; step < 600; step++) {
            int op = rnd_below(100);
            if (n_hold >= MAX_HOLD - 1) op = 50; /* keep the bookkeeping bounded: free */
            if (op < 25) {                       /* allocate */
                int32_t n = 1 + rnd_below(5), want[MAXB], got[MAXB];
                uint64_t ev = m.evictions;
                bool ok = model_alloc(&m, n, false, want);
                td_status st = td_kv_block_alloc(pool, n, got);
                if (!ok) {
                    assert_int_equal(st, TD_NO_KV_BLOCK);
                } else {
                    assert_int_equal(st, TD_OK);
                    compare_alloc(got, want, n, m.evictions == ev);
                    memcpy(hold[n_hold].ids, got, sizeof(int32_t) * (size_t)n);
                    hold[n_hold++].n = n;
                }
            } else if (op < 33) { /* reserve */
                int32_t n = 1 + rnd_below(4);
                bool ok = model_n_free(&m) >= n;
                assert_int_equal(td_kv_reserve(pool, n), ok ? TD_OK : TD_NO_KV_BLOCK);
                if (ok) m.reserved += n;
            } else if (op < 38 && m.reserved > 0) { /* unreserve */
                int32_t n = 1 + rnd_below(m.reserved);
                td_kv_unreserve(pool, n);
                m.reserved -= n;
            } else if (op < 46 && m.reserved > 0) { /* reserved allocation */
                int32_t n = 1 + rnd_below(m.reserved < 4 ? m.reserved : 4), want[MAXB], got[MAXB];
                uint64_t ev = m.evictions;
                assert_true(model_alloc(&m, n, true, want));
                assert_int_equal(td_kv_block_alloc_reserved(pool, n, got), TD_OK);
                compare_alloc(got, want, n, m.evictions == ev);
                memcpy(hold[n_hold].ids, got, sizeof(int32_t) * (size_t)n);
                hold[n_hold++].n = n;
            } else if (op < 66 && n_hold > 0) { /* free a holding */
                int k = rnd_below(n_hold);
                free_both(pool, &m, hold[k].ids, hold[k].n);
                hold[k] = hold[--n_hold];
            } else if (op < 80) { /* publish a used, unhashed block (or a duplicate) */
                int32_t cand[MAXB], nc = 0;
                for (int32_t i = 0; i < nb; i++)
                    if (m.refc[i] > 0 && !m.hashed[i]) cand[nc++] = i;
                if (nc == 0) continue;
                int32_t id = cand[rnd_below(nc)];
                if (n_known > 0 && rnd_below(4) == 0) {
                    td_kv_hash h = known[rnd_below(n_known)];
                    bool dup = model_find(&m, h) >= 0;
                    bool got = td_kv_cache_insert(pool, id, h);
                    if (got == dup)
                        fail_msg("seed %" PRIu64 " step %d: insert of %s hash returned %d", seed,
                                 step, dup ? "a held" : "a free", got);
                    if (got) {
                        m.hashed[id] = true;
                        m.hash[id] = h;
                        model_event(&m, TD_KV_EVENT_STORED, h);
                    }
                } else {
                    td_kv_hash h = rnd_hash();
                    if (n_known < 256) known[n_known++] = h;
                    insert_both(pool, &m, id, h);
                }
            } else if (op < 92 && n_known > 0) { /* acquire or probe a chain */
                td_kv_hash q[6];
                int32_t nq = 1 + rnd_below(6);
                for (int32_t i = 0; i < nq; i++) q[i] = known[rnd_below(n_known)];
                /* Distinct hashes only, as a real chain is. */
                int32_t nd = 0;
                for (int32_t i = 0; i < nq; i++) {
                    bool dup = false;
                    for (int32_t j = 0; j < nd; j++) dup |= td_kv_hash_eq(q[i], q[j]);
                    if (!dup) q[nd++] = q[i];
                }
                int32_t hits = model_probe(&m, q, nd), cached_hits = 0;
                assert_int_equal(td_kv_cache_probe(pool, q, nd), hits);
                for (int32_t i = 0; i < hits; i++)
                    cached_hits += m_cached(&m, model_find(&m, q[i]));
                /* Taking cached blocks spends free capacity; like the
                 * scheduler, only do it when the reservations stay covered
                 * (kv.c: "callers check td_kv_pool_n_free first"). */
                if (rnd_below(2) && model_n_free(&m) >= cached_hits) {
                    int32_t got[6], want[6];
                    int32_t k = td_kv_cache_acquire(pool, q, nd, got);
                    assert_int_equal(k, model_acquire(&m, q, nd, want));
                    for (int32_t i = 0; i < k; i++) assert_int_equal(got[i], want[i]);
                    if (k > 0) {
                        memcpy(hold[n_hold].ids, got, sizeof(int32_t) * (size_t)k);
                        hold[n_hold++].n = k;
                    }
                }
            } else if (n_hold > 0) { /* extra reference */
                int k = rnd_below(n_hold);
                int32_t id = hold[k].ids[rnd_below(hold[k].n)];
                td_kv_block_ref(pool, id);
                m.refc[id]++;
                hold[n_hold].ids[0] = id;
                hold[n_hold++].n = 1;
            }
            check_counts(pool, &m);
            if (step % 50 == 0) {
                check_events(pool, &m, last_checked);
                last_checked = m.n_events;
            }
        }
        /* Release everything: the pool is idle, only cached blocks remain. */
        while (n_hold > 0) {
            free_both(pool, &m, hold[n_hold - 1].ids, hold[n_hold - 1].n);
            n_hold--;
        }
        td_kv_unreserve(pool, m.reserved);
        m.reserved = 0;
        check_counts(pool, &m);
        check_events(pool, &m, 0);
        td_kv_counts c;
        td_kv_pool_counts(pool, &c);
        assert_int_equal(c.used, 0);
        assert_int_equal(c.reserved, 0);
        assert_int_equal(c.cached, c.hashed);
        free(hold);
        free(m.events);
        td_kv_pool_destroy(pool);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hash_block_reference), cmocka_unit_test(test_hash_chain_reference),
        cmocka_unit_test(test_compat_hash),          cmocka_unit_test(test_hash_hex),
        cmocka_unit_test(test_events_log),           cmocka_unit_test(test_defaults_and_epoch),
        cmocka_unit_test(test_insert_acquire_probe), cmocka_unit_test(test_lru_eviction),
        cmocka_unit_test(test_reservations),         cmocka_unit_test(test_contiguous_runs),
        cmocka_unit_test(test_events_from_pool),     cmocka_unit_test(test_random_vs_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
