/* Internal control messages (common/transfer/msg.h): valid messages built
 * with the protobuf-c structures are accepted; each field taken out of
 * range, a wrong cluster token, bytes that do not unpack and oversized
 * input are each rejected with their own error line. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/transfer/msg.h"

static const uint8_t TOKEN[] = "cluster-secret-0123456789";

/* The receiver: a 4-layer model with 4 KV heads of 8, blocks of 4 tokens. */
static td_xfer_limits limits(void) {
    td_xfer_limits l = {.cluster_token = TOKEN,
                        .cluster_token_len = sizeof TOKEN - 1,
                        .max_bytes = 1 << 20,
                        .n_vocab = 512,
                        .max_ctx = 256,
                        .n_layer = 4,
                        .n_head_kv = 4,
                        .head_dim = 8,
                        .block_size = 4,
                        .compat = {.lo = 0x1122334455667788ull, .hi = 0x99aabbccddeeff00ull}};
    return l;
}

/* A valid prefill request with an inline exchange from a decode plan of
 * tp 2 x pp 2 (4 ranks), 10 prompt tokens (3 blocks per rank). */
typedef struct {
    Tandem__Internal__V1__ControlMessage m;
    Tandem__Internal__V1__Peer from;
    Tandem__Internal__V1__PrefillRequest q;
    Tandem__Internal__V1__Exchange x;
    Tandem__Internal__V1__Plan plan;
    uint32_t stages[3];
    Tandem__Internal__V1__KvGeometry kv;
    Tandem__Internal__V1__RankEndpoint ep[4], *eps[4];
    uint8_t addr[4][16], rkey[4][8];
    Tandem__Internal__V1__RankBlocks dest[4], *dests[4];
    int32_t blocks[4][3];
    int32_t tokens[10];
    uint8_t compat[16];
} req_msg;

static void make_request(req_msg *r) {
    memset(r, 0, sizeof *r);
    td_xfer_limits l = limits();
    tandem__internal__v1__control_message__init(&r->m);
    tandem__internal__v1__peer__init(&r->from);
    tandem__internal__v1__prefill_request__init(&r->q);
    tandem__internal__v1__exchange__init(&r->x);
    tandem__internal__v1__plan__init(&r->plan);
    tandem__internal__v1__kv_geometry__init(&r->kv);
    r->m.cluster_token = (ProtobufCBinaryData){sizeof TOKEN - 1, (uint8_t *)TOKEN};
    r->from.instance_id = "decode-a";
    r->from.epoch = 77;
    r->m.from = &r->from;
    r->m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_REQUEST;
    r->m.prefill_request = &r->q;
    memcpy(r->compat, &l.compat.lo, 8);
    memcpy(r->compat + 8, &l.compat.hi, 8);
    for (int i = 0; i < 10; i++) r->tokens[i] = 3 + 50 * i;
    r->q.request_id = "cmpl-1";
    r->q.n_tokens = 10;
    r->q.tokens = r->tokens;
    r->q.cached_tokens = 4;
    r->q.deadline_ms = 5000;
    r->q.compat = (ProtobufCBinaryData){16, r->compat};
    r->q.peer_case = TANDEM__INTERNAL__V1__PREFILL_REQUEST__PEER_EXCHANGE;
    r->q.exchange = &r->x;
    r->plan.tp = 2;
    r->plan.pp = 2;
    r->plan.cp = 1;
    r->stages[0] = 0, r->stages[1] = 1, r->stages[2] = 4; /* 1 and 3 layers */
    r->plan.n_stage_begin = 3;
    r->plan.stage_begin = r->stages;
    r->kv.n_layer = 4, r->kv.n_head_kv = 4, r->kv.head_dim = 8, r->kv.block_size = 4;
    r->kv.n_blocks = 100;
    r->x.exchange_id = 9;
    r->x.plan = &r->plan;
    r->x.kv = &r->kv;
    r->x.compat = (ProtobufCBinaryData){16, r->compat};
    for (int i = 0; i < 4; i++) {
        tandem__internal__v1__rank_endpoint__init(&r->ep[i]);
        r->ep[i].rank = (uint32_t)(3 - i); /* any order */
        r->ep[i].worker_address = (ProtobufCBinaryData){16, r->addr[i]};
        r->ep[i].kv_rkey = (ProtobufCBinaryData){8, r->rkey[i]};
        r->ep[i].kv_base = 0x100000ull * (uint64_t)(i + 1);
        /* stage layers x 2 heads x 8 x 4 tokens x 100 blocks x K,V x 4 bytes */
        uint32_t layers = r->ep[i].rank < 2 ? 1 : 3;
        r->ep[i].kv_bytes = (uint64_t)layers * 2 * 8 * 4 * 100 * 2 * 4;
        r->eps[i] = &r->ep[i];
        tandem__internal__v1__rank_blocks__init(&r->dest[i]);
        r->dest[i].rank = (uint32_t)i;
        for (int b = 0; b < 3; b++) r->blocks[i][b] = 10 * i + b;
        r->dest[i].n_block_ids = 3;
        r->dest[i].block_ids = r->blocks[i];
        r->dests[i] = &r->dest[i];
    }
    r->x.n_ranks = 4;
    r->x.ranks = r->eps;
    r->q.n_dest = 4;
    r->q.dest = r->dests;
}

/* Packs m, decodes it; expects ok, or an error line containing want. */
static void check(const Tandem__Internal__V1__ControlMessage *m, const char *want) {
    td_xfer_limits l = limits();
    size_t n = tandem__internal__v1__control_message__get_packed_size(m);
    uint8_t *buf = malloc(n ? n : 1);
    assert_non_null(buf);
    tandem__internal__v1__control_message__pack(m, buf);
    td_xfer_msg *out = (td_xfer_msg *)1;
    char err[256];
    td_status st = td_xfer_msg_decode(&l, buf, n, &out, err, sizeof err);
    if (!want) {
        if (st != TD_OK) fail_msg("unexpected rejection: %s", err);
        assert_non_null(out);
        assert_int_equal(out->body_case, m->body_case);
        td_xfer_msg_free(out);
    } else {
        assert_int_equal(st, TD_ERR_INVALID);
        assert_null(out);
        if (!strstr(err, want)) fail_msg("error '%s' does not say '%s'", err, want);
    }
    free(buf);
}

static void test_prefill_request(void **state) {
    (void)state;
    req_msg r;
    make_request(&r);
    check(&r.m, NULL);

    char long_id[65];
    memset(long_id, 'a', 64); /* one over the 63-character limit */
    long_id[64] = '\0';
    const char *bad_ids[] = {"", "has space", long_id};
    for (int i = 0; i < 3; i++) {
        make_request(&r);
        r.q.request_id = (char *)bad_ids[i];
        check(&r.m, "bad request id");
    }
    make_request(&r);
    r.q.n_tokens = 0;
    check(&r.m, "0 tokens");
    make_request(&r);
    r.tokens[7] = 512;
    check(&r.m, "token 512 out of the vocabulary");
    make_request(&r);
    r.tokens[0] = -1;
    check(&r.m, "token -1");
    make_request(&r);
    r.q.cached_tokens = 3;
    check(&r.m, "cached tokens");
    make_request(&r);
    r.q.cached_tokens = 12;
    check(&r.m, "cached tokens");
    make_request(&r);
    r.q.deadline_ms = 0;
    check(&r.m, "deadline 0 ms");
    make_request(&r);
    r.q.deadline_ms = 600001;
    check(&r.m, "deadline");
    make_request(&r);
    r.compat[3] ^= 1;
    check(&r.m, "compatibility hash differs");
    make_request(&r);
    r.q.compat.len = 15;
    check(&r.m, "compatibility hash differs");

    /* the destination against the inline exchange */
    make_request(&r);
    r.q.n_dest = 3;
    check(&r.m, "destination for 3 ranks");
    make_request(&r);
    r.dest[2].rank = 1;
    check(&r.m, "destination rank 1 out of range or repeated");
    make_request(&r);
    r.dest[1].n_block_ids = 2;
    check(&r.m, "2 destination blocks for 10 prompt tokens");
    make_request(&r);
    r.blocks[3][2] = 100;
    check(&r.m, "destination block 100 out of the pool");
    make_request(&r);
    r.blocks[0][0] = -5;
    check(&r.m, "destination block -5");

    /* a reference to an earlier exchange: the destination is the caller's
     * to check; id 0 is no reference */
    make_request(&r);
    r.q.peer_case = TANDEM__INTERNAL__V1__PREFILL_REQUEST__PEER_EXCHANGE_ID;
    r.q.exchange_id = 9;
    check(&r.m, NULL);
    r.q.exchange_id = 0;
    check(&r.m, "neither an exchange nor its id");
    r.q.peer_case = TANDEM__INTERNAL__V1__PREFILL_REQUEST__PEER__NOT_SET;
    check(&r.m, "neither an exchange nor its id");

    /* the envelope */
    make_request(&r);
    r.m.cluster_token.len -= 1;
    check(&r.m, "wrong cluster token");
    make_request(&r);
    uint8_t other[sizeof TOKEN - 1];
    memcpy(other, TOKEN, sizeof other);
    other[5] ^= 0x20;
    r.m.cluster_token.data = other;
    check(&r.m, "wrong cluster token");
    make_request(&r);
    r.from.epoch = 0;
    check(&r.m, "without a valid peer");
    make_request(&r);
    r.m.from = NULL;
    check(&r.m, "without a valid peer");
    make_request(&r);
    r.m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY__NOT_SET;
    check(&r.m, "without a body");
}

static void test_exchange(void **state) {
    (void)state;
    req_msg r;
    make_request(&r);
    r.m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_EXCHANGE;
    r.m.exchange = &r.x;
    check(&r.m, NULL);
    r.x.exchange_id = 0;
    check(&r.m, "exchange id 0");
    make_request(&r);
    r.m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_EXCHANGE;
    r.m.exchange = &r.x;
    r.ep[1].kv_bytes += 4;
    check(&r.m, "KV region of");
    r.ep[1].kv_bytes -= 4;
    r.ep[0].kv_base = UINT64_MAX - 10;
    check(&r.m, "KV region of");
    r.ep[0].kv_base = 0x100000;
    r.ep[2].rank = r.ep[0].rank;
    check(&r.m, "out of range or repeated");
    r.ep[2].rank = 1;
    r.ep[3].kv_rkey.len = 0;
    check(&r.m, "rkey of");
    r.ep[3].kv_rkey.len = 8;
    static uint8_t big_address[5000];
    r.ep[3].worker_address = (ProtobufCBinaryData){sizeof big_address, big_address};
    check(&r.m, "worker address or rkey");
    r.ep[3].worker_address = (ProtobufCBinaryData){16, r.addr[3]};
    check(&r.m, NULL);
    r.x.n_ranks = 3;
    check(&r.m, "exchange lists 3 ranks, the plan has 4");
    r.x.n_ranks = 4;
    r.stages[1] = 4; /* an empty second stage */
    check(&r.m, "stage 1 is empty or out of order");
    r.stages[1] = 0;
    check(&r.m, "stage 0 is empty or out of order");
    r.stages[1] = 1;
    r.stages[2] = 5;
    check(&r.m, "do not cover the 4 layers");
    r.stages[2] = 4;
    r.plan.tp = 3;
    check(&r.m, "plan tp 3 and 4 KV heads");
    r.plan.tp = 64;
    check(&r.m, "1 .. 64 ranks");
    r.plan.tp = 2;
    r.kv.head_dim = 16;
    check(&r.m, "differs from ours");
    r.kv.head_dim = 8;
    r.kv.dtype = TD_TYPE_F16; /* a peer holding half-size K and V: its puts would not fit */
    check(&r.m, "its KV cache holds f16, ours f32 (--kv-dtype must be the same on both)");
    r.kv.dtype = 77;
    check(&r.m, "its KV cache holds unknown, ours f32");
    r.kv.dtype = TD_TYPE_F32;
    r.kv.n_blocks = 0;
    check(&r.m, "KV pool of 0 blocks");
    r.kv.n_blocks = 100;
    r.x.kv = NULL;
    check(&r.m, "without a KV geometry");
    r.x.kv = &r.kv;
    r.x.plan = NULL;
    check(&r.m, "without a plan");
}

static void test_replies(void **state) {
    (void)state;
    td_xfer_limits l = limits();
    (void)l;
    req_msg r;
    make_request(&r);
    Tandem__Internal__V1__PrefillDone d;
    tandem__internal__v1__prefill_done__init(&d);
    Tandem__V1__TopLogprob tl[21], *tlp[21];
    for (int i = 0; i < 21; i++) {
        tandem__v1__top_logprob__init(&tl[i]);
        tl[i].token_id = i;
        tl[i].logprob = -0.5f * (float)i;
        tlp[i] = &tl[i];
    }
    d.request_id = "cmpl-1";
    d.first_token = 42;
    d.logprob = -0.25f;
    d.n_top_logprobs = 20;
    d.top_logprobs = tlp;
    r.m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_DONE;
    r.m.prefill_done = &d;
    check(&r.m, NULL);
    d.n_top_logprobs = 21;
    check(&r.m, "21 top logprobs");
    d.n_top_logprobs = 2;
    tl[1].logprob = 0.5f;
    check(&r.m, "top logprob 1 out of range");
    tl[1].logprob = -0.5f;
    d.first_token = 512;
    check(&r.m, "first token 512");
    d.first_token = 42;
    d.logprob = NAN;
    check(&r.m, "first token 42");
    d.logprob = -1.0f;
    uint8_t state_bytes[300] = {0};
    d.sampler_state = (ProtobufCBinaryData){257, state_bytes};
    check(&r.m, "bytes of sampler state");
    d.sampler_state.len = 256;
    check(&r.m, NULL);

    Tandem__Internal__V1__PrefillRejected j;
    tandem__internal__v1__prefill_rejected__init(&j);
    j.request_id = "cmpl-1";
    j.reason = TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_BUSY;
    j.message = "queue full";
    j.retry_after_ms = 200;
    r.m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_REJECTED;
    r.m.prefill_rejected = &j;
    check(&r.m, NULL);
    j.reason = TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_WOULD_MISS_DEADLINE;
    j.expected_start_ms = 4200; /* when P's queue would let it start */
    check(&r.m, NULL);
    j.expected_start_ms = 600001;
    check(&r.m, "start in 600001 ms");
    j.expected_start_ms = 0;
    j.reason = TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_UNSPECIFIED;
    check(&r.m, "reason 0");
    j.reason = (Tandem__Internal__V1__RejectReason)99;
    check(&r.m, "reason 99");
    j.reason = TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_DRAINING;
    j.message = "\xc3\x28 not utf-8";
    check(&r.m, "bad request id or message");
    j.message = "caf\xc3\xa9 ok";
    check(&r.m, NULL);

    Tandem__Internal__V1__LeaseRenewal lr;
    tandem__internal__v1__lease_renewal__init(&lr);
    char *ids[] = {"a", "b c"};
    lr.n_request_ids = 1;
    lr.request_ids = ids;
    lr.lease_ms = 1000;
    r.m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_LEASE_RENEWAL;
    r.m.lease_renewal = &lr;
    check(&r.m, NULL);
    lr.n_request_ids = 2;
    check(&r.m, "bad request id 1");
    lr.n_request_ids = 0;
    check(&r.m, "0 ids");
    lr.n_request_ids = 1;
    lr.lease_ms = 0;
    check(&r.m, "0 ms");

    Tandem__Internal__V1__Abort a;
    tandem__internal__v1__abort__init(&a);
    a.request_id = "cmpl-1";
    r.m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_ABORT;
    r.m.abort = &a;
    check(&r.m, NULL);
    a.request_id = "";
    check(&r.m, "abort: bad request id");

    Tandem__Internal__V1__JobProgress jp;
    tandem__internal__v1__job_progress__init(&jp);
    jp.request_id = "cmpl-1";
    jp.tokens = 256; /* the whole context */
    r.m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_JOB_PROGRESS;
    r.m.job_progress = &jp;
    check(&r.m, NULL);
    jp.tokens = 257;
    check(&r.m, "257 tokens (1 .. 256)");
    jp.tokens = 0;
    check(&r.m, "0 tokens");
    jp.tokens = 1;
    jp.request_id = "a\x01";
    check(&r.m, "job progress: bad request id");

    Tandem__Internal__V1__JobAborted ja;
    tandem__internal__v1__job_aborted__init(&ja);
    ja.request_id = "cmpl-1";
    ja.message = "aborted";
    r.m.body_case = TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_JOB_ABORTED;
    r.m.job_aborted = &ja;
    check(&r.m, NULL);
    ja.message = "\xff";
    check(&r.m, "job aborted: bad request id or message");
}

static void test_raw_bytes(void **state) {
    (void)state;
    td_xfer_limits l = limits();
    td_xfer_msg *m = NULL;
    char err[256];
    const uint8_t junk[] = {0xff, 0xff, 0xff, 0xff, 0x0f, 0x01, 0x02};
    assert_int_equal(td_xfer_msg_decode(&l, junk, sizeof junk, &m, err, sizeof err),
                     TD_ERR_INVALID);
    assert_null(m);
    assert_non_null(strstr(err, "do not unpack"));
    /* nothing at all: an empty message has no token */
    assert_int_equal(td_xfer_msg_decode(&l, NULL, 0, &m, err, sizeof err), TD_ERR_INVALID);
    assert_non_null(strstr(err, "wrong cluster token"));
    /* over the size limit: refused before unpacking */
    size_t big = l.max_bytes + 1;
    uint8_t *buf = calloc(1, big);
    assert_non_null(buf);
    assert_int_equal(td_xfer_msg_decode(&l, buf, big, &m, err, sizeof err), TD_ERR_INVALID);
    assert_non_null(strstr(err, "at most 1048576"));
    free(buf);
}

static void test_rank_kv_bytes(void **state) {
    (void)state;
    Tandem__Internal__V1__Plan p;
    tandem__internal__v1__plan__init(&p);
    uint32_t st[] = {0, 3, 5};
    p.tp = 8; /* more than the 2 KV heads: each rank holds one */
    p.pp = 2;
    p.cp = 2;
    p.n_stage_begin = 3;
    p.stage_begin = st;
    Tandem__Internal__V1__KvGeometry g;
    tandem__internal__v1__kv_geometry__init(&g);
    g.n_layer = 5, g.n_head_kv = 2, g.head_dim = 64, g.block_size = 16, g.n_blocks = 10;
    /* rank 15 is stage 0 (ranks 0..15), rank 16 stage 1 */
    assert_int_equal(td_xfer_rank_kv_bytes(&p, &g, 15), 3ull * 1 * 64 * 16 * 10 * 8);
    assert_int_equal(td_xfer_rank_kv_bytes(&p, &g, 16), 2ull * 1 * 64 * 16 * 10 * 8);
    assert_int_equal(td_xfer_rank_kv_bytes(&p, &g, 32), 0);
    g.dtype = TD_TYPE_BF16; /* 2-byte elements */
    assert_int_equal(td_xfer_rank_kv_bytes(&p, &g, 16), 2ull * 1 * 64 * 16 * 10 * 4);
    g.dtype = TD_TYPE_Q8_0; /* not an element type KV is held in */
    assert_int_equal(td_xfer_rank_kv_bytes(&p, &g, 16), 0);
    g.dtype = TD_TYPE_F32;
    g.n_blocks = UINT32_MAX;
    g.head_dim = UINT32_MAX;
    assert_int_equal(td_xfer_rank_kv_bytes(&p, &g, 0), 0); /* overflows */
    assert_true(td_secret_eq("abc", 3, "abc", 3));
    assert_false(td_secret_eq("abc", 3, "abd", 3));
    assert_false(td_secret_eq("abc", 3, "abcd", 4));
    assert_false(td_secret_eq("abc", 3, "", 0));
}

/* P's admission estimate, worked by hand: 2,000 queued prompt tokens at
 * 1,000 tokens/s start the job at 2.0 s; the deadline bounds the start. */
static void test_would_miss(void **state) {
    (void)state;
    double start = -1;
    assert_false(td_xfer_would_miss(2000, 1000.0, 3.0, &start));
    assert_true(start == -1);                                    /* untouched when it fits */
    assert_false(td_xfer_would_miss(2000, 1000.0, 2.0, &start)); /* starts at the deadline */
    assert_true(td_xfer_would_miss(2000, 1000.0, 1.9, &start));
    assert_true(fabs(start - 2.0) < 1e-12);
    /* an empty queue starts now, however long the job */
    assert_false(td_xfer_would_miss(0, 1000.0, 0.001, &start));
    /* no speed measured yet, or none that means anything: taken */
    assert_false(td_xfer_would_miss(1 << 30, 0.0, 0.001, &start));
    assert_false(td_xfer_would_miss(1 << 30, -5.0, 0.001, &start));
    assert_false(td_xfer_would_miss(1 << 30, NAN, 0.001, &start));
    assert_false(td_xfer_would_miss(1 << 30, INFINITY, 0.001, &start));
    /* negative counts are none */
    assert_false(td_xfer_would_miss(-100, 1000.0, 0.001, NULL));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_would_miss), cmocka_unit_test(test_prefill_request),
        cmocka_unit_test(test_exchange),   cmocka_unit_test(test_replies),
        cmocka_unit_test(test_raw_bytes),  cmocka_unit_test(test_rank_kv_bytes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
