/* Transfer mapping (common/transfer/map.h): the named plan pairs
 * with their routes written out by hand, and an exhaustive check over many
 * plan pairs that every (decode rank, layer, KV head, block) the decode
 * plan holds is delivered exactly once, by a prefill rank that holds it —
 * where a rank's layers, heads and blocks are worked out here from the
 * layout rules, not with the module's helpers. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/transfer/map.h"

static td_xfer_plan plan(int tp, int pp, int cp, int32_t n_layer) {
    td_xfer_plan x;
    memset(&x, 0, sizeof x);
    x.tp = tp;
    x.pp = pp;
    x.cp = cp;
    for (int s = 0; s <= pp; s++) x.stage_begin[s] = (int32_t)((int64_t)s * n_layer / pp);
    return x;
}

static int map(const td_xfer_plan *p, const td_xfer_plan *d, int32_t L, int32_t H, td_xfer_route *r,
               int cap) {
    int n = -1;
    assert_int_equal(td_xfer_map(p, d, L, H, r, cap, &n), TD_OK);
    return n;
}

static void expect(const td_xfer_route *r, int p_rank, int d_rank, int l0, int l1, int h0, int h1,
                   int mod, int res) {
    assert_int_equal(r->p_rank, p_rank);
    assert_int_equal(r->d_rank, d_rank);
    assert_int_equal(r->layer_begin, l0);
    assert_int_equal(r->layer_end, l1);
    assert_int_equal(r->head_begin, h0);
    assert_int_equal(r->head_end, h1);
    assert_int_equal(r->block_mod, mod);
    assert_int_equal(r->block_res, res);
}

/* The pairs the issue names, 4 layers and 4 KV heads unless said. */
static void test_named_pairs(void **state) {
    (void)state;
    td_xfer_route r[64];
    td_xfer_plan p, d;

    /* P tp=1 -> D tp=2: the one P rank feeds each D rank its half of the heads. */
    p = plan(1, 1, 1, 4), d = plan(2, 1, 1, 4);
    assert_int_equal(map(&p, &d, 4, 4, r, 64), 2);
    expect(&r[0], 0, 0, 0, 4, 0, 2, 1, 0);
    expect(&r[1], 0, 1, 0, 4, 2, 4, 1, 0);

    /* P tp=2 -> D tp=1: each P rank sends its half to the one D rank. */
    p = plan(2, 1, 1, 4), d = plan(1, 1, 1, 4);
    assert_int_equal(map(&p, &d, 4, 4, r, 64), 2);
    expect(&r[0], 0, 0, 0, 4, 0, 2, 1, 0);
    expect(&r[1], 1, 0, 0, 4, 2, 4, 1, 0);

    /* P pp=2 -> D pp=1: each stage sends its layers. */
    p = plan(1, 2, 1, 4), d = plan(1, 1, 1, 4);
    assert_int_equal(map(&p, &d, 4, 4, r, 64), 2);
    expect(&r[0], 0, 0, 0, 2, 0, 4, 1, 0);
    expect(&r[1], 1, 0, 2, 4, 0, 4, 1, 0);

    /* P pp=2 -> D tp=2 (one of the named pairings): 4 routes. */
    p = plan(1, 2, 1, 4), d = plan(2, 1, 1, 4);
    assert_int_equal(map(&p, &d, 4, 4, r, 64), 4);
    expect(&r[0], 0, 0, 0, 2, 0, 2, 1, 0);
    expect(&r[1], 1, 0, 2, 4, 0, 2, 1, 0);
    expect(&r[2], 0, 1, 0, 2, 2, 4, 1, 0);
    expect(&r[3], 1, 1, 2, 4, 2, 4, 1, 0);

    /* P cp=2 -> D cp=1: even blocks from P's CP rank 0, odd from rank 1. */
    p = plan(1, 1, 2, 4), d = plan(1, 1, 1, 4);
    assert_int_equal(map(&p, &d, 4, 4, r, 64), 2);
    expect(&r[0], 0, 0, 0, 4, 0, 4, 2, 0);
    expect(&r[1], 1, 0, 0, 4, 0, 4, 2, 1);

    /* P cp=1 -> D cp=2: the one P rank splits the blocks by D's owner. */
    p = plan(1, 1, 1, 4), d = plan(1, 1, 2, 4);
    assert_int_equal(map(&p, &d, 4, 4, r, 64), 2);
    expect(&r[0], 0, 0, 0, 4, 0, 4, 2, 0);
    expect(&r[1], 0, 1, 0, 4, 0, 4, 2, 1);

    /* P cp=2 -> D cp=3: blocks b mod 6; D CP rank 0 takes b = 0 (mod 6)
     * from P rank 0 and b = 3 from P rank 1. */
    p = plan(1, 1, 2, 4), d = plan(1, 1, 3, 4);
    assert_int_equal(map(&p, &d, 4, 4, r, 64), 6);
    expect(&r[0], 0, 0, 0, 4, 0, 4, 6, 0);
    expect(&r[1], 1, 0, 0, 4, 0, 4, 6, 3);
    expect(&r[2], 0, 1, 0, 4, 0, 4, 6, 4);
    expect(&r[3], 1, 1, 0, 4, 0, 4, 6, 1);

    /* KV-head replication on the decode side: 2 KV heads, D tp=4 holds
     * each head twice; every replica gets its own copy from P tp=1. */
    p = plan(1, 1, 1, 2), d = plan(4, 1, 1, 2);
    assert_int_equal(map(&p, &d, 2, 2, r, 64), 4);
    expect(&r[0], 0, 0, 0, 2, 0, 1, 1, 0);
    expect(&r[1], 0, 1, 0, 2, 0, 1, 1, 0);
    expect(&r[2], 0, 2, 0, 2, 1, 2, 1, 0);
    expect(&r[3], 0, 3, 0, 2, 1, 2, 1, 0);

    /* ... and on the prefill side: P tp=4 holds each of 2 heads twice; D
     * tp=2's ranks read from different replicas (D rank 0: head 0 from P
     * rank 0; D rank 1: head 1 from P rank 3), D tp=1 reads both heads from
     * the first replicas. */
    p = plan(4, 1, 1, 2), d = plan(2, 1, 1, 2);
    assert_int_equal(map(&p, &d, 2, 2, r, 64), 2);
    expect(&r[0], 0, 0, 0, 2, 0, 1, 1, 0);
    expect(&r[1], 3, 1, 0, 2, 1, 2, 1, 0);
    d = plan(1, 1, 1, 2);
    assert_int_equal(map(&p, &d, 2, 2, r, 64), 2);
    expect(&r[0], 0, 0, 0, 2, 0, 1, 1, 0);
    expect(&r[1], 2, 0, 0, 2, 1, 2, 1, 0);
}

/* Layout rules, independently of map.c. */
static void heads_of(int tp, int tp_rank, int n_kv, int *h0, int *h1) {
    if (tp <= n_kv) {
        int per = n_kv / tp;
        *h0 = tp_rank * per;
        *h1 = *h0 + per;
    } else {
        *h0 = tp_rank * n_kv / tp;
        *h1 = *h0 + 1;
    }
}

static bool holds(const td_xfer_plan *x, int rank, int layer, int head, int block, int n_kv) {
    int tp_rank = rank % x->tp, cp_rank = (rank / x->tp) % x->cp, pp_rank = rank / (x->tp * x->cp);
    int h0, h1;
    heads_of(x->tp, tp_rank, n_kv, &h0, &h1);
    return layer >= x->stage_begin[pp_rank] && layer < x->stage_begin[pp_rank + 1] && head >= h0 &&
           head < h1 && block % x->cp == cp_rank;
}

/* Every (decode rank, layer, head, block) held by the decode plan comes
 * from exactly one route, from a prefill rank that holds it; no route
 * carries anything the decode rank does not hold; routes are never empty. */
static void check_pair(const td_xfer_plan *p, const td_xfer_plan *d, int L, int H) {
    int n = -1;
    /* sizing call: nothing written, the count reported */
    assert_int_equal(td_xfer_map(p, d, L, H, NULL, 0, &n), TD_ERR_RANGE);
    assert_true(n > 0);
    td_xfer_route *r = malloc((size_t)n * sizeof *r);
    assert_non_null(r);
    int n2 = -1;
    assert_int_equal(td_xfer_map(p, d, L, H, r, n, &n2), TD_OK);
    assert_int_equal(n2, n);
    int d_world = d->tp * d->cp * d->pp, p_world = p->tp * p->cp * p->pp;
    int blocks = 2 * p->cp * d->cp;
    for (int i = 0; i < n; i++) {
        assert_true(r[i].p_rank >= 0 && r[i].p_rank < p_world);
        assert_true(r[i].d_rank >= 0 && r[i].d_rank < d_world);
        assert_true(r[i].layer_begin < r[i].layer_end && r[i].head_begin < r[i].head_end);
        assert_true(r[i].block_res >= 0 && r[i].block_res < r[i].block_mod);
        for (int l = r[i].layer_begin; l < r[i].layer_end; l++)
            for (int h = r[i].head_begin; h < r[i].head_end; h++)
                for (int b = r[i].block_res; b < blocks; b += r[i].block_mod) {
                    assert_true(holds(p, r[i].p_rank, l, h, b, H));
                    assert_true(holds(d, r[i].d_rank, l, h, b, H));
                }
    }
    for (int dr = 0; dr < d_world; dr++)
        for (int l = 0; l < L; l++)
            for (int h = 0; h < H; h++)
                for (int b = 0; b < blocks; b++) {
                    if (!holds(d, dr, l, h, b, H)) continue;
                    int cover = 0;
                    for (int i = 0; i < n; i++)
                        cover += r[i].d_rank == dr && l >= r[i].layer_begin && l < r[i].layer_end &&
                                 h >= r[i].head_begin && h < r[i].head_end &&
                                 b % r[i].block_mod == r[i].block_res;
                    assert_int_equal(cover, 1);
                }
    free(r);
}

static void test_every_pair_delivers_everything_once(void **state) {
    (void)state;
    const int kv[] = {1, 2, 3, 4, 6, 8};
    const int tps[] = {1, 2, 3, 4, 6, 8};
    int pairs = 0;
    for (size_t k = 0; k < sizeof kv / sizeof kv[0]; k++) {
        int H = kv[k];
        for (int L = 1; L <= 5; L += 2)
            for (size_t a = 0; a < 6; a++)
                for (size_t b = 0; b < 6; b++) {
                    int ptp = tps[a], dtp = tps[b];
                    if ((H % ptp && ptp % H) || (H % dtp && dtp % H)) continue;
                    for (int ppp = 1; ppp <= 3 && ppp <= L; ppp++)
                        for (int dpp = 1; dpp <= 3 && dpp <= L; dpp += 2)
                            for (int pcp = 1; pcp <= 3; pcp++)
                                for (int dcp = 1; dcp <= 4; dcp += (dcp == 1 ? 1 : 2)) {
                                    td_xfer_plan p = plan(ptp, ppp, pcp, L);
                                    td_xfer_plan d = plan(dtp, dpp, dcp, L);
                                    check_pair(&p, &d, L, H);
                                    pairs++;
                                }
                }
    }
    assert_true(pairs > 1000);
}

/* An uneven layer split (--pp-layers) on one side. */
static void test_uneven_stages(void **state) {
    (void)state;
    td_xfer_plan p = plan(2, 3, 1, 7), d = plan(1, 2, 2, 7);
    p.stage_begin[1] = 1; /* 1, 4, 2 layers */
    p.stage_begin[2] = 5;
    d.stage_begin[1] = 6; /* 6, 1 */
    check_pair(&p, &d, 7, 4);
}

static void test_bad_plans(void **state) {
    (void)state;
    td_xfer_route r[8];
    int n = 0;
    td_xfer_plan p = plan(3, 1, 1, 4), d = plan(1, 1, 1, 4);
    /* 3 neither divides nor is divided by 2 KV heads */
    assert_int_equal(td_xfer_map(&p, &d, 4, 2, r, 8, &n), TD_ERR_INVALID);
    assert_int_equal(td_xfer_map(&d, &p, 4, 2, r, 8, &n), TD_ERR_INVALID);
    /* stages that do not cover the layers */
    p = plan(1, 2, 1, 4);
    assert_int_equal(td_xfer_map(&p, &d, 5, 4, r, 8, &n), TD_ERR_INVALID);
    p.stage_begin[1] = 4; /* an empty second stage */
    assert_int_equal(td_xfer_map(&p, &d, 4, 4, r, 8, &n), TD_ERR_INVALID);
    p = plan(1, 1, 0, 4);
    assert_int_equal(td_xfer_map(&p, &d, 4, 4, r, 8, &n), TD_ERR_INVALID);
    /* too small an array: the count is still reported */
    p = plan(2, 2, 2, 4);
    d = plan(1, 1, 1, 4);
    assert_int_equal(td_xfer_map(&p, &d, 4, 4, r, 3, &n), TD_ERR_RANGE);
    assert_int_equal(n, 8);
    assert_int_equal(td_xfer_map(NULL, &d, 4, 4, r, 8, &n), TD_ERR_INVALID);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_named_pairs),
        cmocka_unit_test(test_every_pair_delivers_everything_once),
        cmocka_unit_test(test_uneven_stages),
        cmocka_unit_test(test_bad_plans),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
