/* The router's prefix index (router/index.h): store / remove / clear,
 * predictions and their expiry, bad arguments, and td_rt_index_match
 * against a brute-force reference (per slot, a plain table of the hashes
 * it holds, the leading overlap counted block by block) over randomized
 * operation sequences on slots spread over all four mask words. */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "router/index.h"

static uint64_t rng_state;

static uint64_t rnd(void) {
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint32_t rnd_below(uint32_t n) { return (uint32_t)(rnd() % n); }

static td_kv_hash rnd_hash(void) {
    td_kv_hash h = {rnd(), rnd()};
    return h;
}

static void fill_hashes(td_kv_hash *h, size_t n) {
    for (size_t i = 0; i < n; i++) h[i] = rnd_hash();
}

static td_rt_mask mask_of(const int *slots, int n) {
    td_rt_mask m;
    memset(&m, 0, sizeof m);
    for (int i = 0; i < n; i++) td_rt_mask_set(&m, slots[i]);
    return m;
}

static void fill_i32(int32_t *a, int32_t v) {
    for (int i = 0; i < TD_RT_MAX_INSTANCES; i++) a[i] = v;
}

static void test_store_remove_clear(void **state) {
    (void)state;
    rng_state = 1;
    td_rt_index *ix = NULL;
    assert_int_equal(td_rt_index_create(16, &ix), TD_OK);
    td_kv_hash h[8];
    fill_hashes(h, 8);
    int slots[] = {3, 200};
    td_rt_mask among = mask_of(slots, 2);
    int32_t ov[TD_RT_MAX_INSTANCES];

    assert_int_equal(td_rt_index_store(ix, 3, h, 8), TD_OK);
    assert_int_equal(td_rt_index_store(ix, 3, h, 8), TD_OK); /* again: no change */
    assert_int_equal(td_rt_index_count(ix, 3), 8);
    assert_int_equal(td_rt_index_size(ix), 8);
    assert_int_equal(td_rt_index_store(ix, 200, h, 5), TD_OK);
    assert_int_equal(td_rt_index_count(ix, 200), 5);
    assert_int_equal(td_rt_index_size(ix), 8);

    fill_i32(ov, -7);
    td_rt_index_match(ix, h, 8, &among, 0.0, ov, NULL);
    assert_int_equal(ov[3], 8);
    assert_int_equal(ov[200], 5);
    assert_int_equal(ov[4], -7); /* not in among: untouched */
    assert_int_equal(ov[0], -7);

    /* A hole in the middle cuts the prefix there. */
    td_rt_index_remove(ix, 3, &h[2], 1);
    td_rt_index_remove(ix, 3, &h[2], 1); /* not held any more: no change */
    assert_int_equal(td_rt_index_count(ix, 3), 7);
    assert_int_equal(td_rt_index_size(ix), 8); /* slot 200 still holds h[2] */
    td_rt_index_match(ix, h, 8, &among, 0.0, ov, NULL);
    assert_int_equal(ov[3], 2);
    assert_int_equal(ov[200], 5);

    /* Removing a hash nobody holds, or one another slot holds, is a no-op. */
    td_kv_hash other = rnd_hash();
    td_rt_index_remove(ix, 3, &other, 1);
    td_rt_index_remove(ix, 7, h, 8);
    assert_int_equal(td_rt_index_count(ix, 3), 7);
    assert_int_equal(td_rt_index_count(ix, 7), 0);
    assert_int_equal(td_rt_index_size(ix), 8);

    /* Blocks only slot 3 held leave the index with it. */
    td_rt_index_clear(ix, 3);
    assert_int_equal(td_rt_index_count(ix, 3), 0);
    assert_int_equal(td_rt_index_count(ix, 200), 5);
    assert_int_equal(td_rt_index_size(ix), 5);
    td_rt_index_match(ix, h, 8, &among, 0.0, ov, NULL);
    assert_int_equal(ov[3], 0);
    assert_int_equal(ov[200], 5);

    td_rt_index_remove(ix, 200, h, 5);
    assert_int_equal(td_rt_index_size(ix), 0);
    assert_int_equal(td_rt_index_count(ix, 200), 0);
    td_rt_index_match(ix, h, 8, &among, 0.0, ov, NULL);
    assert_int_equal(ov[3], 0);
    assert_int_equal(ov[200], 0);

    /* A slot reused after clear starts empty and stores again. */
    assert_int_equal(td_rt_index_store(ix, 3, &h[4], 4), TD_OK);
    td_rt_index_match(ix, &h[4], 4, &among, 0.0, ov, NULL);
    assert_int_equal(ov[3], 4);
    assert_int_equal(ov[200], 0);
    td_rt_index_destroy(ix);
}

static void test_predictions(void **state) {
    (void)state;
    rng_state = 2;
    td_rt_index *ix = NULL;
    assert_int_equal(td_rt_index_create(0, &ix), TD_OK);
    td_kv_hash h[8];
    fill_hashes(h, 8);
    int slots[] = {0, 64, 255};
    td_rt_mask among = mask_of(slots, 3);
    int32_t ov[TD_RT_MAX_INSTANCES], pr[TD_RT_MAX_INSTANCES];

    /* Slot 64: blocks 0..3 stored, 0..7 predicted: 8 held, 4 of them
     * only as a prediction. Slot 255: all 8 only predicted, later. */
    assert_int_equal(td_rt_index_store(ix, 64, h, 4), TD_OK);
    assert_int_equal(td_rt_index_predict(ix, 64, h, 8, 100.0, 2.0), TD_OK);
    assert_int_equal(td_rt_index_count(ix, 64), 4); /* predictions not counted */
    assert_int_equal(td_rt_index_size(ix), 8);
    fill_i32(ov, -7);
    fill_i32(pr, -7);
    td_rt_index_match(ix, h, 8, &among, 101.0, ov, pr);
    assert_int_equal(ov[64], 8);
    assert_int_equal(pr[64], 4);
    assert_int_equal(ov[0], 0);
    assert_int_equal(pr[0], 0);
    assert_int_equal(ov[255], 0);
    assert_int_equal(pr[1], -7);
    /* Still visible at the expiry itself, gone just after it. */
    td_rt_index_match(ix, h, 8, &among, 102.0, ov, pr);
    assert_int_equal(ov[64], 8);
    td_rt_index_match(ix, h, 8, &among, 102.001, ov, pr);
    assert_int_equal(ov[64], 4);
    assert_int_equal(pr[64], 0);

    /* A later prediction extends: predicted at 103 for 2 s, again at 104. */
    assert_int_equal(td_rt_index_predict(ix, 255, h, 6, 103.0, 2.0), TD_OK);
    assert_int_equal(td_rt_index_predict(ix, 255, h, 6, 104.0, 2.0), TD_OK);
    td_rt_index_match(ix, h, 8, &among, 105.5, ov, pr);
    assert_int_equal(ov[255], 6);
    assert_int_equal(pr[255], 6);
    assert_int_equal(ov[64], 4); /* slot 64's old prediction did not come back */
    assert_int_equal(pr[64], 0);
    td_rt_index_match(ix, h, 8, &among, 106.5, ov, pr);
    assert_int_equal(ov[255], 0);
    assert_int_equal(pr[255], 0);

    /* A stored block that is also predicted does not count as predicted. */
    assert_int_equal(td_rt_index_predict(ix, 64, h, 2, 107.0, 1.0), TD_OK);
    assert_int_equal(td_rt_index_predict(ix, 64, &h[5], 1, 107.0, 1.0), TD_OK);
    td_rt_index_match(ix, h, 8, &among, 107.5, ov, pr);
    assert_int_equal(ov[64], 4);
    assert_int_equal(pr[64], 0);

    /* clear forgets predictions too. */
    assert_int_equal(td_rt_index_predict(ix, 0, h, 8, 108.0, 5.0), TD_OK);
    td_rt_index_match(ix, h, 8, &among, 108.0, ov, pr);
    assert_int_equal(ov[0], 8);
    assert_int_equal(pr[0], 8);
    td_rt_index_clear(ix, 0);
    td_rt_index_match(ix, h, 8, &among, 108.0, ov, pr);
    assert_int_equal(ov[0], 0);
    assert_int_equal(pr[0], 0);
    assert_int_equal(ov[64], 4);
    td_rt_index_destroy(ix);
}

static void test_expire_frees(void **state) {
    (void)state;
    rng_state = 3;
    enum { N = 5000 };
    td_rt_index *ix = NULL;
    assert_int_equal(td_rt_index_create(N, &ix), TD_OK);
    static td_kv_hash h[N];
    fill_hashes(h, N);
    assert_int_equal(td_rt_index_store(ix, 9, h, 100), TD_OK);
    assert_int_equal(td_rt_index_predict(ix, 130, h, N, 10.0, 1.0), TD_OK);
    assert_int_equal(td_rt_index_predict(ix, 131, &h[N - 10], 10, 10.5, 1.0), TD_OK);
    assert_int_equal(td_rt_index_size(ix), N);
    td_rt_index_expire(ix, 10.9); /* nothing expired yet */
    assert_int_equal(td_rt_index_size(ix), N);
    td_rt_index_expire(ix, 11.2); /* all but the last 10 (extended to 11.5) */
    assert_int_equal(td_rt_index_size(ix), 100 + 10);
    int slots[] = {9, 130, 131};
    td_rt_mask among = mask_of(slots, 3);
    int32_t ov[TD_RT_MAX_INSTANCES], pr[TD_RT_MAX_INSTANCES];
    td_rt_index_match(ix, h, N, &among, 11.2, ov, pr);
    assert_int_equal(ov[9], 100);
    assert_int_equal(ov[130], 0);
    assert_int_equal(ov[131], 0);
    td_rt_index_match(ix, &h[N - 10], 10, &among, 11.2, ov, pr);
    assert_int_equal(ov[130], 10); /* shares the hash's expiry (index.h) */
    assert_int_equal(ov[131], 10);
    assert_int_equal(pr[131], 10);
    td_rt_index_expire(ix, 12.0);
    assert_int_equal(td_rt_index_size(ix), 100);
    assert_int_equal(td_rt_index_count(ix, 9), 100);
    td_rt_index_match(ix, h, 100, &among, 12.0, ov, pr);
    assert_int_equal(ov[9], 100);

    /* Removing the stored bits of a block whose prediction has expired
     * deletes it without waiting for expire. */
    assert_int_equal(td_rt_index_predict(ix, 130, h, 50, 12.0, 1.0), TD_OK);
    assert_int_equal(td_rt_index_predict(ix, 131, &h[1000], 1, 20.0, 1.0), TD_OK);
    assert_int_equal(td_rt_index_size(ix), 101);
    td_rt_index_remove(ix, 9, h, 100);
    assert_int_equal(td_rt_index_size(ix), 1);
    td_rt_index_clear(ix, 131);
    assert_int_equal(td_rt_index_size(ix), 0);
    td_rt_index_destroy(ix);
}

static void test_bad_arguments(void **state) {
    (void)state;
    rng_state = 4;
    td_rt_index *ix = NULL;
    assert_int_equal(td_rt_index_create(4, NULL), TD_ERR_INVALID);
    assert_int_equal(td_rt_index_create(4, &ix), TD_OK);
    td_kv_hash h[4];
    fill_hashes(h, 4);
    assert_int_equal(td_rt_index_store(ix, -1, h, 4), TD_ERR_INVALID);
    assert_int_equal(td_rt_index_store(ix, TD_RT_MAX_INSTANCES, h, 4), TD_ERR_INVALID);
    assert_int_equal(td_rt_index_store(ix, 0, NULL, 4), TD_ERR_INVALID);
    assert_int_equal(td_rt_index_store(NULL, 0, h, 4), TD_ERR_INVALID);
    assert_int_equal(td_rt_index_predict(ix, 256, h, 4, 1.0, 1.0), TD_ERR_INVALID);
    assert_int_equal(td_rt_index_predict(ix, -5, h, 4, 1.0, 1.0), TD_ERR_INVALID);
    assert_int_equal(td_rt_index_predict(ix, 0, h, 4, 1.0, -1.0), TD_ERR_INVALID);
    assert_int_equal(td_rt_index_predict(ix, 0, h, 4, NAN, 1.0), TD_ERR_INVALID);
    assert_int_equal(td_rt_index_predict(ix, 0, h, 4, 1.0, INFINITY), TD_ERR_INVALID);
    assert_int_equal(td_rt_index_size(ix), 0);
    assert_int_equal(td_rt_index_count(ix, -1), 0);
    assert_int_equal(td_rt_index_count(ix, 256), 0);
    assert_int_equal(td_rt_index_count(NULL, 0), 0);
    assert_int_equal(td_rt_index_size(NULL), 0);
    /* Zero-length inputs are fine and change nothing. */
    assert_int_equal(td_rt_index_store(ix, 0, NULL, 0), TD_OK);
    assert_int_equal(td_rt_index_predict(ix, 0, NULL, 0, 1.0, 1.0), TD_OK);
    td_rt_index_remove(ix, 0, NULL, 0);
    assert_int_equal(td_rt_index_size(ix), 0);

    assert_int_equal(td_rt_index_store(ix, 1, h, 4), TD_OK);
    td_rt_index_remove(ix, -1, h, 4);
    td_rt_index_remove(ix, 256, h, 4);
    td_rt_index_remove(ix, 1, NULL, 4);
    td_rt_index_clear(ix, -1);
    td_rt_index_clear(ix, 1000);
    td_rt_index_clear(NULL, 1);
    td_rt_index_expire(NULL, 1.0);
    td_rt_index_expire(ix, NAN);
    assert_int_equal(td_rt_index_count(ix, 1), 4);

    int slots[] = {1, 2};
    td_rt_mask among = mask_of(slots, 2);
    int32_t ov[TD_RT_MAX_INSTANCES], pr[TD_RT_MAX_INSTANCES];
    fill_i32(ov, -7);
    fill_i32(pr, -7);
    td_rt_index_match(ix, NULL, 0, &among, 0.0, ov, pr); /* empty prompt: overlap 0 */
    assert_int_equal(ov[1], 0);
    assert_int_equal(ov[2], 0);
    assert_int_equal(pr[1], 0);
    assert_int_equal(ov[0], -7);
    fill_i32(ov, -7);
    td_rt_index_match(ix, NULL, 4, &among, 0.0, ov, pr); /* refused: nothing written */
    td_rt_index_match(NULL, h, 4, &among, 0.0, ov, pr);
    td_rt_index_match(ix, h, 4, NULL, 0.0, ov, pr);
    td_rt_index_match(ix, h, 4, &among, 0.0, NULL, pr);
    assert_int_equal(ov[1], -7);
    td_rt_mask none;
    memset(&none, 0, sizeof none);
    td_rt_index_match(ix, h, 4, &none, 0.0, ov, pr);
    assert_int_equal(ov[1], -7);
    td_rt_index_match(ix, h, 4, &among, 0.0, ov, NULL);
    assert_int_equal(ov[1], 4);
    assert_int_equal(ov[2], 0);
    td_rt_index_destroy(ix);
    td_rt_index_destroy(NULL);
}

/* Growth of both the map and the entry arrays from a tiny size hint. */
static void test_growth(void **state) {
    (void)state;
    rng_state = 5;
    enum { N = 60000 };
    td_rt_index *ix = NULL;
    assert_int_equal(td_rt_index_create(1, &ix), TD_OK);
    static td_kv_hash h[N];
    fill_hashes(h, N);
    assert_int_equal(td_rt_index_store(ix, 77, h, N), TD_OK);
    assert_int_equal(td_rt_index_store(ix, 177, h, N / 2), TD_OK);
    assert_int_equal(td_rt_index_size(ix), N);
    int slots[] = {77, 177};
    td_rt_mask among = mask_of(slots, 2);
    int32_t ov[TD_RT_MAX_INSTANCES];
    td_rt_index_match(ix, h, N, &among, 0.0, ov, NULL);
    assert_int_equal(ov[77], N);
    assert_int_equal(ov[177], N / 2);
    td_rt_index_remove(ix, 77, h, N);
    assert_int_equal(td_rt_index_size(ix), N / 2);
    /* Freed entries are reused. */
    assert_int_equal(td_rt_index_store(ix, 78, &h[N / 2], N / 2), TD_OK);
    assert_int_equal(td_rt_index_size(ix), N);
    td_rt_index_match(ix, &h[N / 2], N / 2, &among, 0.0, ov, NULL);
    assert_int_equal(ov[77], 0);
    td_rt_index_clear(ix, 78);
    td_rt_index_clear(ix, 177);
    assert_int_equal(td_rt_index_size(ix), 0);
    td_rt_index_destroy(ix);
}

/* ---- randomized comparison with a brute-force model ---- */

enum {
    U = 600,    /* distinct hashes */
    CHAINS = 8, /* prompt-like sequences over them */
    CHAIN_LEN = 48,
    NSLOTS = 16,
    OPS = 100000,
};

typedef struct {
    td_kv_hash hash[U];
    int chain[CHAINS][CHAIN_LEN]; /* hash ids */
    int slots[NSLOTS];
    /* The reference: per slot, which hash ids it stores / has predicted,
     * and per hash id the expiry of its predictions (index.h: one per hash). */
    bool stored[NSLOTS][U];
    bool pred[NSLOTS][U];
    double exp[U];
} model;

static int hash_id(const model *m, td_kv_hash h) {
    for (int u = 0; u < U; u++)
        if (td_kv_hash_eq(m->hash[u], h)) return u;
    return -1;
}

static bool ref_holds(const model *m, int s, int u, double now, bool *only_pred_p) {
    if (u < 0) return false;
    bool p = m->pred[s][u] && m->exp[u] >= now;
    *only_pred_p = !m->stored[s][u] && p;
    return m->stored[s][u] || p;
}

static void ref_predict(model *m, int s, int u, double now, double ttl) {
    if (m->exp[u] < now) {
        for (int t = 0; t < NSLOTS; t++) m->pred[t][u] = false;
        m->exp[u] = -INFINITY;
    }
    m->pred[s][u] = true;
    if (now + ttl > m->exp[u]) m->exp[u] = now + ttl;
}

static void ref_clear(model *m, int s) {
    for (int u = 0; u < U; u++) {
        m->stored[s][u] = false;
        if (!m->pred[s][u]) continue;
        m->pred[s][u] = false;
        bool any = false;
        for (int t = 0; t < NSLOTS; t++) any |= m->pred[t][u];
        if (!any) m->exp[u] = -INFINITY;
    }
}

/* A range [a, b) of a chain: mostly a prefix, sometimes anywhere. */
static void pick_range(int *a_p, int *b_p) {
    int b = 1 + (int)rnd_below(CHAIN_LEN);
    int a = rnd_below(4) == 0 ? (int)rnd_below((uint32_t)b) : 0;
    *a_p = a;
    *b_p = b;
}

static void test_random_vs_reference(void **state) {
    (void)state;
    rng_state = 6;
    static model m;
    memset(&m, 0, sizeof m);
    for (int u = 0; u < U; u++) {
        do m.hash[u] = rnd_hash();
        while (hash_id(&m, m.hash[u]) != u);
        m.exp[u] = -INFINITY;
    }
    /* Chains share prefixes of random length with earlier ones (a tree of
     * prompts), the rest drawn from the whole universe. */
    for (int c = 0; c < CHAINS; c++) {
        int shared = c ? (int)rnd_below(CHAIN_LEN / 2) : 0;
        int from = c ? (int)rnd_below((uint32_t)c) : 0;
        for (int i = 0; i < CHAIN_LEN; i++)
            m.chain[c][i] = i < shared ? m.chain[from][i] : (int)rnd_below(U);
    }
    /* Both ends of every mask word, and a few in between. */
    int fixed[NSLOTS] = {0, 1, 62, 63, 64, 65, 127, 128, 129, 191, 192, 200, 230, 253, 254, 255};
    memcpy(m.slots, fixed, sizeof fixed);

    td_rt_index *ix = NULL;
    assert_int_equal(td_rt_index_create(8, &ix), TD_OK);
    double now = 1000.0;
    td_kv_hash buf[CHAIN_LEN];
    int32_t ov[TD_RT_MAX_INSTANCES], pr[TD_RT_MAX_INSTANCES];
    int matched_nonzero = 0, matched_pred = 0;
    for (int op = 0; op < OPS; op++) {
        int si = (int)rnd_below(NSLOTS), slot = m.slots[si];
        int c = (int)rnd_below(CHAINS), a, b;
        pick_range(&a, &b);
        for (int i = a; i < b; i++) buf[i - a] = m.hash[m.chain[c][i]];
        uint32_t kind = rnd_below(100);
        if (kind < 30) {
            assert_int_equal(td_rt_index_store(ix, slot, buf, (size_t)(b - a)), TD_OK);
            for (int i = a; i < b; i++) m.stored[si][m.chain[c][i]] = true;
        } else if (kind < 48) {
            td_rt_index_remove(ix, slot, buf, (size_t)(b - a));
            for (int i = a; i < b; i++) m.stored[si][m.chain[c][i]] = false;
        } else if (kind < 49) {
            td_rt_index_clear(ix, slot);
            ref_clear(&m, si);
        } else if (kind < 57) {
            double ttl = 0.5 + 0.25 * rnd_below(8);
            assert_int_equal(td_rt_index_predict(ix, slot, buf, (size_t)(b - a), now, ttl), TD_OK);
            for (int i = a; i < b; i++) ref_predict(&m, si, m.chain[c][i], now, ttl);
        } else if (kind < 62) {
            now += 0.125 * rnd_below(8); /* exact in binary: expiries can be hit exactly */
        } else if (kind < 64) {
            td_rt_index_expire(ix, now);
            size_t live = 0;
            for (int u = 0; u < U; u++) {
                bool held = false, only;
                for (int s = 0; s < NSLOTS; s++) held |= ref_holds(&m, s, u, now, &only);
                live += held;
            }
            assert_int_equal(td_rt_index_size(ix), live);
        } else {
            /* A query: a chain's prefix, sometimes with a block swapped for
             * another known hash or for one the index has never seen. */
            int len = (int)rnd_below(CHAIN_LEN + 1);
            int ids[CHAIN_LEN];
            for (int i = 0; i < len; i++) {
                ids[i] = m.chain[c][i];
                buf[i] = m.hash[ids[i]];
            }
            if (len && rnd_below(3) == 0) {
                int at = (int)rnd_below((uint32_t)len);
                if (rnd_below(2)) {
                    ids[at] = (int)rnd_below(U);
                    buf[at] = m.hash[ids[at]];
                } else {
                    ids[at] = -1;
                    buf[at] = rnd_hash();
                }
            }
            td_rt_mask among;
            memset(&among, 0, sizeof among);
            bool in[NSLOTS];
            for (int s = 0; s < NSLOTS; s++) {
                in[s] = rnd_below(4) != 0;
                if (in[s]) td_rt_mask_set(&among, m.slots[s]);
            }
            bool want_pred = rnd_below(2);
            fill_i32(ov, -7);
            fill_i32(pr, -7);
            td_rt_index_match(ix, buf, (size_t)len, &among, now, ov, want_pred ? pr : NULL);
            for (int s = 0; s < NSLOTS; s++) {
                int sl = m.slots[s];
                if (!in[s]) {
                    assert_int_equal(ov[sl], -7);
                    assert_int_equal(pr[sl], -7);
                    continue;
                }
                int want = 0, want_p = 0;
                bool only;
                while (want < len && ref_holds(&m, s, ids[want], now, &only)) {
                    want_p += only;
                    want++;
                }
                assert_int_equal(ov[sl], want);
                assert_int_equal(pr[sl], want_pred ? want_p : -7);
                matched_nonzero += want > 0;
                matched_pred += want_p > 0;
            }
            for (int s = 0; s < TD_RT_MAX_INSTANCES; s++) {
                if (td_rt_mask_has(&among, s)) continue;
                assert_int_equal(ov[s], -7);
            }
        }
        if (op % 97 == 0) {
            for (int s = 0; s < NSLOTS; s++) {
                size_t cnt = 0;
                for (int u = 0; u < U; u++) cnt += m.stored[s][u];
                assert_int_equal(td_rt_index_count(ix, m.slots[s]), cnt);
            }
            size_t lo = 0, hi = 0;
            for (int u = 0; u < U; u++) {
                bool held = false, any = false, only;
                for (int s = 0; s < NSLOTS; s++) {
                    held |= ref_holds(&m, s, u, now, &only);
                    any |= m.stored[s][u] || m.pred[s][u];
                }
                lo += held;
                hi += any;
            }
            size_t sz = td_rt_index_size(ix);
            assert_true(sz >= lo && sz <= hi);
        }
    }
    /* The sequence exercised what it is meant to. */
    assert_true(matched_nonzero > 1000);
    assert_true(matched_pred > 100);
    td_rt_index_destroy(ix);
}

/* Lookups on two threads while a third stores, removes and clears other
 * blocks (growing and rehashing the map): a chain that slot 5 holds all
 * along is always seen whole, and one that nobody ever holds never. */
enum { CONC_CHAIN = 64, CONC_CHURN = 4000 };

typedef struct {
    td_rt_index *ix;
    const td_kv_hash *kept, *never;
    int bad, lookups;
} conc_reader;

static _Atomic int conc_stop;

static void *conc_read(void *arg) {
    conc_reader *r = arg;
    int slots[] = {5, 6, 250};
    td_rt_mask among = mask_of(slots, 3);
    int32_t ov[TD_RT_MAX_INSTANCES], pr[TD_RT_MAX_INSTANCES];
    while (!conc_stop || r->lookups < 100) {
        td_rt_index_match(r->ix, r->kept, CONC_CHAIN, &among, 0.0, ov, pr);
        if (ov[5] != CONC_CHAIN || pr[5] != 0) r->bad++;
        td_rt_index_match(r->ix, r->never, CONC_CHAIN, &among, 0.0, ov, pr);
        if (ov[5] != 0 || ov[6] != 0 || ov[250] != 0) r->bad++;
        r->lookups++;
    }
    return NULL;
}

static void test_concurrent(void **state) {
    (void)state;
    rng_state = 7;
    td_rt_index *ix = NULL;
    assert_int_equal(td_rt_index_create(1, &ix), TD_OK);
    static td_kv_hash kept[CONC_CHAIN], never[CONC_CHAIN], churn[CONC_CHURN];
    fill_hashes(kept, CONC_CHAIN);
    fill_hashes(never, CONC_CHAIN);
    fill_hashes(churn, CONC_CHURN);
    assert_int_equal(td_rt_index_store(ix, 5, kept, CONC_CHAIN), TD_OK);
    conc_stop = 0;
    conc_reader rd[2] = {{ix, kept, never, 0, 0}, {ix, kept, never, 0, 0}};
    pthread_t t[2];
    for (int i = 0; i < 2; i++) assert_int_equal(pthread_create(&t[i], NULL, conc_read, &rd[i]), 0);
    for (int round = 0; round < 20; round++) {
        int slot = round % 2 ? 6 : 250;
        assert_int_equal(td_rt_index_store(ix, slot, churn, CONC_CHURN), TD_OK);
        double now = 10.0 * round;
        assert_int_equal(td_rt_index_predict(ix, slot, kept, CONC_CHAIN / 2, now, 1.0), TD_OK);
        td_rt_index_remove(ix, slot, churn, CONC_CHURN / 2);
        td_rt_index_clear(ix, slot);
        td_rt_index_expire(ix, now + 5.0);
    }
    conc_stop = 1;
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    assert_int_equal(rd[0].bad + rd[1].bad, 0);
    assert_int_equal(td_rt_index_size(ix), CONC_CHAIN);
    td_rt_index_destroy(ix);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_store_remove_clear),
        cmocka_unit_test(test_predictions),
        cmocka_unit_test(test_expire_frees),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_growth),
        cmocka_unit_test(test_random_vs_reference),
        cmocka_unit_test(test_concurrent),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
