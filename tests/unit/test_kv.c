/* KV block pool: allocation order (lowest run of n free ids, else the n
 * lowest free ids), refcounts, all-or-nothing, exhaustion, storage layout.
 * The randomised test checks every allocation against a brute-force
 * reference written here from the rule in kv.h. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/kv/kv.h"

static td_kv_pool *make_pool(int32_t n_blocks) {
    td_kv_params p = td_kv_default_params();
    p.n_layers = 2;
    p.n_kv_heads = 3;
    p.head_dim = 8;
    p.n_blocks = n_blocks;
    td_kv_pool *pool = NULL;
    assert_int_equal(td_kv_pool_create(&p, &pool), TD_OK);
    assert_non_null(pool);
    return pool;
}

static void expect_ids(const int32_t *got, const int32_t *want, int n) {
    for (int i = 0; i < n; i++) assert_int_equal(got[i], want[i]);
}

static void test_params(void **state) {
    (void)state;
    td_kv_params p = td_kv_default_params();
    assert_int_equal(p.block_size, 16);
    p.n_layers = 3;
    p.n_kv_heads = 2;
    p.head_dim = 64;
    p.n_blocks = 10;
    assert_int_equal(td_kv_block_bytes(&p), (size_t)2 * 3 * 16 * 2 * 64 * 4);
    td_kv_pool *pool = NULL;
    td_kv_params bad = p;
    bad.n_blocks = 0;
    assert_int_equal(td_kv_pool_create(&bad, &pool), TD_ERR_INVALID);
    bad = p;
    bad.head_dim = -1;
    assert_int_equal(td_kv_pool_create(&bad, &pool), TD_ERR_INVALID);
    assert_null(pool);
    bad = p;
    bad.n_blocks = INT32_MAX;
    bad.n_kv_heads = 1 << 20;
    bad.head_dim = 1 << 20;
    assert_int_equal(td_kv_pool_create(&bad, &pool), TD_ERR_RANGE);
    assert_null(pool);
    td_kv_pool_destroy(NULL);
}

/* The dense layout's figures, dtypes it holds and refuses, overflow. */
static void test_layout(void **state) {
    (void)state;
    td_kv_params p = td_kv_default_params();
    assert_int_equal(p.dtype, TD_TYPE_F32);
    p.n_layers = 3;
    p.n_kv_heads = 2;
    p.head_dim = 64;
    p.n_blocks = 5;
    td_kv_layout l;
    assert_int_equal(td_kv_layout_dense(&p, &l), TD_OK);
    assert_int_equal(l.dtype, TD_TYPE_F32);
    assert_int_equal(l.elem_bytes, 4);
    assert_int_equal(l.row_bytes, 2 * 64 * 4);
    assert_int_equal(l.block_bytes, 16 * 2 * 64 * 4);
    assert_int_equal(l.layer_bytes, 5 * 16 * 2 * 64 * 4);
    assert_int_equal(l.bytes, 3 * 2 * l.layer_bytes);
    assert_int_equal(td_kv_block_bytes(&p), 3 * 2 * l.block_bytes);
    p.dtype = TD_TYPE_F16;
    assert_int_equal(td_kv_layout_dense(&p, &l), TD_OK);
    assert_int_equal(l.elem_bytes, 2);
    assert_int_equal(l.bytes, 3 * 2 * 5 * 16 * 2 * 64 * 2);
    p.dtype = TD_TYPE_Q8_0; /* not a KV element type */
    assert_int_equal(td_kv_layout_dense(&p, &l), TD_ERR_UNSUPPORTED);
    assert_int_equal(td_kv_block_bytes(&p), 0);
    td_kv_pool *pool = NULL;
    assert_int_equal(td_kv_pool_create(&p, &pool), TD_ERR_UNSUPPORTED);
    assert_null(pool);
    p.dtype = (td_dtype)77; /* a lying id */
    assert_int_equal(td_kv_layout_dense(&p, &l), TD_ERR_UNSUPPORTED);
    p.dtype = TD_TYPE_F32;
    p.n_blocks = INT32_MAX;
    p.n_kv_heads = 1 << 20;
    p.head_dim = 1 << 20;
    assert_int_equal(td_kv_layout_dense(&p, &l), TD_ERR_RANGE);
    p.n_blocks = 0;
    assert_int_equal(td_kv_layout_dense(&p, &l), TD_ERR_INVALID);
}

static void test_alloc_refcount(void **state) {
    (void)state;
    td_kv_pool *pool = make_pool(8);
    assert_int_equal(td_kv_pool_n_free(pool), 8);
    int32_t ids[8];
    assert_int_equal(td_kv_block_alloc(pool, 3, ids), TD_OK);
    expect_ids(ids, (int32_t[]){0, 1, 2}, 3);
    assert_int_equal(td_kv_pool_n_free(pool), 5);
    for (int i = 0; i < 3; i++) assert_int_equal(td_kv_block_refcount(pool, ids[i]), 1);
    assert_int_equal(td_kv_block_refcount(pool, 5), 0);

    td_kv_block_ref(pool, 1);
    assert_int_equal(td_kv_block_refcount(pool, 1), 2);
    td_kv_block_free(pool, ids, 3); /* 0 and 2 return, 1 stays referenced */
    assert_int_equal(td_kv_pool_n_free(pool), 7);
    assert_int_equal(td_kv_block_refcount(pool, 1), 1);
    assert_int_equal(td_kv_block_refcount(pool, 0), 0);

    /* 1 is still in use: a run of 2 starts at 2, not 0. */
    int32_t two[2];
    assert_int_equal(td_kv_block_alloc(pool, 2, two), TD_OK);
    expect_ids(two, (int32_t[]){2, 3}, 2);
    int32_t one = 1;
    td_kv_block_free(pool, &one, 1);
    td_kv_block_free(pool, two, 2);
    assert_int_equal(td_kv_pool_n_free(pool), 8);
    assert_int_equal(td_kv_block_alloc(pool, 0, NULL), TD_OK);
    assert_int_equal(td_kv_block_alloc(pool, -1, ids), TD_ERR_INVALID);
    td_kv_pool_destroy(pool);
}

static void test_all_or_nothing(void **state) {
    (void)state;
    td_kv_pool *pool = make_pool(8);
    int32_t a[5], b[4] = {-7, -7, -7, -7};
    assert_int_equal(td_kv_block_alloc(pool, 5, a), TD_OK);
    assert_int_equal(td_kv_block_alloc(pool, 4, b), TD_NO_KV_BLOCK);
    assert_int_equal(td_kv_pool_n_free(pool), 3);
    for (int i = 0; i < 4; i++) assert_int_equal(b[i], -7);
    for (int i = 5; i < 8; i++) assert_int_equal(td_kv_block_refcount(pool, i), 0);
    assert_int_equal(td_kv_block_alloc(pool, 3, b), TD_OK);
    expect_ids(b, (int32_t[]){5, 6, 7}, 3);
    td_kv_block_free(pool, a, 5);
    td_kv_block_free(pool, b, 3);
    td_kv_pool_destroy(pool);
}

static void test_exhaustion(void **state) {
    (void)state;
    td_kv_pool *pool = make_pool(70); /* spans two bitmap words */
    int32_t ids[70], x;
    assert_int_equal(td_kv_block_alloc(pool, 70, ids), TD_OK);
    for (int i = 0; i < 70; i++) assert_int_equal(ids[i], i);
    assert_int_equal(td_kv_pool_n_free(pool), 0);
    assert_int_equal(td_kv_block_alloc(pool, 1, &x), TD_NO_KV_BLOCK);
    int32_t back = 66;
    td_kv_block_free(pool, &back, 1);
    assert_int_equal(td_kv_block_alloc(pool, 1, &x), TD_OK);
    assert_int_equal(x, 66);
    td_kv_block_free(pool, ids, 70);
    assert_int_equal(td_kv_pool_n_free(pool), 70);
    td_kv_pool_destroy(pool);
}

static void test_contiguity(void **state) {
    (void)state;
    td_kv_pool *pool = make_pool(16);
    int32_t a[4], b[4], c[4], d[3], e[5], f[4];
    assert_int_equal(td_kv_block_alloc(pool, 4, a), TD_OK);
    assert_int_equal(td_kv_block_alloc(pool, 4, b), TD_OK);
    assert_int_equal(td_kv_block_alloc(pool, 4, c), TD_OK);
    expect_ids(c, (int32_t[]){8, 9, 10, 11}, 4);
    td_kv_block_free(pool, b, 4); /* free: 4..7, 12..15 */
    assert_int_equal(td_kv_block_alloc(pool, 3, d), TD_OK);
    expect_ids(d, (int32_t[]){4, 5, 6}, 3);
    td_kv_block_free(pool, a, 4); /* free: 0..3, 7, 12..15 */
    /* No run of 5: the five lowest free ids. */
    assert_int_equal(td_kv_block_alloc(pool, 5, e), TD_OK);
    expect_ids(e, (int32_t[]){0, 1, 2, 3, 7}, 5);
    /* The remaining run of 4. */
    assert_int_equal(td_kv_block_alloc(pool, 4, f), TD_OK);
    expect_ids(f, (int32_t[]){12, 13, 14, 15}, 4);
    td_kv_block_free(pool, c, 4);
    /* A later, longer run is preferred over an earlier short one. */
    int32_t g[2];
    int32_t nine = 9;
    td_kv_block_free(pool, d, 3);                               /* free: 4, 5, 6, 8..11 */
    assert_int_equal(td_kv_block_alloc(pool, 1, &nine), TD_OK); /* takes 4 */
    assert_int_equal(nine, 4);
    int32_t run4[4];
    assert_int_equal(td_kv_block_alloc(pool, 4, run4), TD_OK); /* 5,6 too short: 8..11 */
    expect_ids(run4, (int32_t[]){8, 9, 10, 11}, 4);
    assert_int_equal(td_kv_block_alloc(pool, 2, g), TD_OK);
    expect_ids(g, (int32_t[]){5, 6}, 2);
    td_kv_block_free(pool, &nine, 1);
    td_kv_block_free(pool, run4, 4);
    td_kv_block_free(pool, g, 2);
    td_kv_block_free(pool, e, 5);
    td_kv_block_free(pool, f, 4);
    assert_int_equal(td_kv_pool_n_free(pool), 16);
    td_kv_pool_destroy(pool);
}

/* Reference allocator: a refcount array and the rule of kv.h, by brute force. */
static void ref_alloc(const int32_t *refs, int32_t nb, int32_t n, int32_t *out) {
    for (int32_t s = 0; s + n <= nb; s++) {
        bool ok = true;
        for (int32_t i = 0; i < n && ok; i++) ok = refs[s + i] == 0;
        if (ok) {
            for (int32_t i = 0; i < n; i++) out[i] = s + i;
            return;
        }
    }
    int32_t k = 0;
    for (int32_t i = 0; i < nb && k < n; i++)
        if (refs[i] == 0) out[k++] = i;
}

static void test_random_vs_reference(void **state) {
    (void)state;
    enum { NB = 200, MAXH = 64 };
    td_kv_pool *pool = make_pool(NB);
    int32_t refs[NB] = {0};
    int32_t held[MAXH][16], held_n[MAXH];
    int n_held = 0;
    uint32_t s = 12345;
    for (int it = 0; it < 4000; it++) {
        s = s * 1664525u + 1013904223u;
        int op = (int)((s >> 16) % 3);
        if (op < 2 && n_held < MAXH) {
            int32_t n = 1 + (int32_t)((s >> 8) % 16), got[16], want[16];
            int32_t n_free = 0;
            for (int i = 0; i < NB; i++) n_free += refs[i] == 0;
            td_status st = td_kv_block_alloc(pool, n, got);
            if (n > n_free) {
                assert_int_equal(st, TD_NO_KV_BLOCK);
                continue;
            }
            assert_int_equal(st, TD_OK);
            ref_alloc(refs, NB, n, want);
            expect_ids(got, want, n);
            for (int i = 0; i < n; i++) refs[got[i]] = 1;
            memcpy(held[n_held], got, sizeof got);
            held_n[n_held++] = n;
        } else if (n_held > 0) {
            int h = (int)((s >> 4) % (uint32_t)n_held);
            if (((s >> 20) & 1) && n_held < MAXH) { /* share a block, as a prefix hit does */
                td_kv_block_ref(pool, held[h][0]);
                refs[held[h][0]]++;
                held[n_held][0] = held[h][0];
                held_n[n_held++] = 1;
            }
            td_kv_block_free(pool, held[h], held_n[h]);
            for (int i = 0; i < held_n[h]; i++) refs[held[h][i]]--;
            memmove(held[h], held[n_held - 1], sizeof held[0]);
            held_n[h] = held_n[n_held - 1];
            n_held--;
        }
        int32_t n_free = 0;
        for (int i = 0; i < NB; i++) {
            n_free += refs[i] == 0;
            assert_int_equal(td_kv_block_refcount(pool, i), refs[i]);
        }
        assert_int_equal(td_kv_pool_n_free(pool), n_free);
    }
    td_kv_pool_destroy(pool);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_params),
        cmocka_unit_test(test_layout),
        cmocka_unit_test(test_alloc_refcount),
        cmocka_unit_test(test_all_or_nothing),
        cmocka_unit_test(test_exhaustion),
        cmocka_unit_test(test_contiguity),
        cmocka_unit_test(test_random_vs_reference),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
