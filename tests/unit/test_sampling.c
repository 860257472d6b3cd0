/* The sampling parameters' one conversion (common/api/sampling.h): random
 * valid parameter sets and every boundary value go C request -> internal
 * proto (packed and unpacked, as on the wire) -> C request, and C request
 * -> proto -> public JSON -> the API's parser (request.h) -> C request,
 * and come back equal field by field; what a peer could get wrong in a
 * proto is refused with a 400 naming the parameter. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>

#include "common/api/request.h"
#include "common/api/sampling.h"

#define VOCAB 512

/* A request as the API hands it to the scheduler, with its own storage. */
typedef struct {
    td_gen_request g;
    td_logit_bias bias[VOCAB];
    int32_t stop_ids[256];
    char stop_buf[16][12];
    const char *stop[16];
} req_t;

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) { /* xorshift64* */
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return g_rng * 0x2545f4914f6cdd1dull;
}
static int32_t rnd_in(int32_t lo, int32_t hi) { /* [lo, hi] */
    return lo + (int32_t)(rnd() % (uint64_t)(hi - lo + 1));
}
static float rnd_f(float lo, float hi) {
    return lo + (hi - lo) * (float)(rnd() >> 40) / 16777215.0f;
}

static void req_init(req_t *r) {
    memset(r, 0, sizeof *r);
    td_gen_request_init(&r->g);
    for (int i = 0; i < 16; i++) r->stop[i] = r->stop_buf[i];
    r->g.stop = r->stop;
    r->g.stop_ids = r->stop_ids;
    r->g.sampling.logit_bias = r->bias;
}

/* A random request the API accepts: every value in its range, the ranges'
 * ends more often than chance would give them. */
static void req_random(req_t *r, td_api_kind kind, const td_api_limits *lim) {
    req_init(r);
    td_gen_request *g = &r->g;
    td_sampler_params *s = &g->sampling;
    bool edge = rnd() % 4 == 0;
    s->temperature = edge ? (rnd() % 2 ? 0.0f : 2.0f) : rnd_f(0, 2);
    s->top_p = edge ? (rnd() % 2 ? 1e-6f : 1.0f) : rnd_f(1e-6f, 1);
    s->top_k = edge ? (rnd() % 2 ? 0 : INT32_MAX) : rnd_in(0, 200);
    s->min_p = edge ? (rnd() % 2 ? 0.0f : 1.0f) : rnd_f(0, 1);
    s->presence_penalty = edge ? (rnd() % 2 ? -2.0f : 2.0f) : rnd_f(-2, 2);
    s->frequency_penalty = edge ? (rnd() % 2 ? -2.0f : 2.0f) : rnd_f(-2, 2);
    s->repetition_penalty = edge ? (rnd() % 2 ? 1e-6f : 2.0f) : rnd_f(1e-6f, 2);
    switch (rnd() % 4) {
    case 0: s->seed = TD_SAMPLER_SEED_RANDOM; break;
    case 1: s->seed = edge ? 0 : UINT64_MAX - 1; break;
    default: s->seed = rnd() % (UINT64_MAX - 1);
    }
    s->logprobs = rnd() % 2;
    s->n_logprobs = s->logprobs ? rnd_in(0, 20) : 0;
    s->n_logit_bias = rnd() % 3 == 0 ? rnd_in(1, edge ? VOCAB : 8) : 0;
    int32_t start = rnd_in(0, VOCAB - 1);
    for (int32_t i = 0; i < s->n_logit_bias; i++) { /* distinct ids */
        r->bias[i].token = (start + i) % VOCAB;
        r->bias[i].bias = edge ? (rnd() % 2 ? -100.0f : 100.0f) : rnd_f(-100, 100);
    }
    g->max_tokens = edge ? (rnd() % 2 ? 1 : INT32_MAX) : rnd_in(1, 4096);
    g->min_tokens = rnd() % 2 ? 0 : rnd_in(0, TD_MIN(g->max_tokens, 1000));
    if (edge && rnd() % 2) g->min_tokens = g->max_tokens;
    g->n_stop = rnd() % 2 ? rnd_in(0, lim->max_stop) : 0;
    for (int32_t i = 0; i < g->n_stop; i++) {
        int len = rnd_in(1, 10);
        for (int k = 0; k < len; k++) r->stop_buf[i][k] = (char)rnd_in(0x20, 0x7e);
        r->stop_buf[i][len] = 0;
    }
    g->n_stop_ids = rnd() % 2 ? rnd_in(0, edge ? lim->max_stop_ids : 8) : 0;
    for (int32_t i = 0; i < g->n_stop_ids; i++)
        r->stop_ids[i] = edge ? (rnd() % 2 ? 0 : VOCAB - 1) : rnd_in(0, VOCAB - 1);
    g->ignore_eos = rnd() % 2;
    g->skip_special = rnd() % 2;
    g->include_stop_str = rnd() % 2;
    (void)kind;
}

static int bias_cmp(const void *a, const void *b) {
    return ((const td_logit_bias *)a)->token - ((const td_logit_bias *)b)->token;
}

/* Every field the conversion carries, equal bit for bit (logit biases as
 * a set: a JSON object has no order to keep). */
static void expect_same(const td_gen_request *a, const td_gen_request *b, int iter) {
    const td_sampler_params *x = &a->sampling, *y = &b->sampling;
#define SAME(f)                                                                                    \
    if (memcmp(&(x->f), &(y->f), sizeof x->f) != 0) fail_msg("case %d: " #f " differs", iter)
    SAME(temperature);
    SAME(top_p);
    SAME(top_k);
    SAME(min_p);
    SAME(seed);
    SAME(repetition_penalty);
    SAME(frequency_penalty);
    SAME(presence_penalty);
    SAME(logprobs);
    SAME(n_logprobs);
    SAME(n_logit_bias);
#undef SAME
    if (x->n_logit_bias > 0) {
        td_logit_bias *p = malloc((size_t)x->n_logit_bias * 2 * sizeof *p);
        assert_non_null(p);
        memcpy(p, x->logit_bias, (size_t)x->n_logit_bias * sizeof *p);
        memcpy(p + x->n_logit_bias, y->logit_bias, (size_t)x->n_logit_bias * sizeof *p);
        qsort(p, (size_t)x->n_logit_bias, sizeof *p, bias_cmp);
        qsort(p + x->n_logit_bias, (size_t)x->n_logit_bias, sizeof *p, bias_cmp);
        for (int32_t i = 0; i < x->n_logit_bias; i++)
            if (p[i].token != p[x->n_logit_bias + i].token ||
                memcmp(&p[i].bias, &p[x->n_logit_bias + i].bias, sizeof p[i].bias) != 0)
                fail_msg("case %d: logit_bias[%d] differs", iter, i);
        free(p);
    }
    assert_int_equal(a->max_tokens, b->max_tokens);
    assert_int_equal(a->min_tokens, b->min_tokens);
    assert_int_equal(a->n_stop, b->n_stop);
    for (int32_t i = 0; i < a->n_stop; i++) assert_string_equal(a->stop[i], b->stop[i]);
    assert_int_equal(a->n_stop_ids, b->n_stop_ids);
    for (int32_t i = 0; i < a->n_stop_ids; i++) assert_int_equal(a->stop_ids[i], b->stop_ids[i]);
    assert_int_equal(a->ignore_eos, b->ignore_eos);
    assert_int_equal(a->skip_special, b->skip_special);
    assert_int_equal(a->include_stop_str, b->include_stop_str);
}

/* C -> proto -> wire bytes -> proto -> C. */
static void through_proto(const td_gen_request *in, const td_api_limits *lim, int iter) {
    td_sampling_proto sp;
    assert_int_equal(td_sampling_to_proto(in, &sp), TD_OK);
    size_t len = tandem__v1__sampling_params__get_packed_size(&sp.sp);
    uint8_t *buf = malloc(len ? len : 1);
    assert_non_null(buf);
    tandem__v1__sampling_params__pack(&sp.sp, buf);
    td_sampling_proto_free(&sp);
    Tandem__V1__SamplingParams *wire = tandem__v1__sampling_params__unpack(NULL, len, buf);
    free(buf);
    assert_non_null(wire);
    td_gen_request out;
    td_gen_request_init(&out);
    td_logit_bias *bias = NULL;
    td_api_error err;
    td_status st = td_sampling_from_proto(wire, lim, VOCAB, &out, &bias, &err);
    if (st != TD_OK) fail_msg("case %d: refused: %s", iter, err.message);
    expect_same(in, &out, iter);
    free(bias);
    tandem__v1__sampling_params__free_unpacked(wire, NULL);
}

/* C -> proto -> the JSON body (with a prompt) -> the API's parser -> C. */
static void through_json(const td_gen_request *in, td_api_kind kind, const td_api_limits *lim,
                         int iter) {
    td_sampling_proto sp;
    assert_int_equal(td_sampling_to_proto(in, &sp), TD_OK);
    json_t *o = json_object();
    assert_non_null(o);
    td_api_error err;
    if (!td_sampling_to_json(&sp.sp, kind, o, &err)) fail_msg("case %d: %s", iter, err.message);
    td_sampling_proto_free(&sp);
    if (kind == TD_API_COMPLETIONS) {
        json_object_set_new(o, "prompt", json_pack("[i,i]", 1, 2));
    } else {
        json_object_set_new(o, "messages",
                            json_pack("[{s:s,s:s}]", "role", "user", "content", "hi"));
    }
    char *body = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    assert_non_null(body);
    td_api_request req;
    if (td_api_request_parse(kind, body, strlen(body), lim, VOCAB, &req, &err) != TD_OK)
        fail_msg("case %d: the API refused %s: %s", iter, body, err.message);
    int32_t tokens[2] = {1, 2};
    td_gen_request out;
    td_api_request_to_gen(&req, tokens, 2, req.max_tokens, 0, &out);
    expect_same(in, &out, iter);
    td_api_request_free(&req);
    free(body);
}

static void test_random_sets_round_trip(void **state) {
    (void)state;
    td_api_limits lim = td_api_default_limits();
    static req_t r;
    for (int i = 0; i < 3000; i++) {
        td_api_kind kind = i % 2 ? TD_API_CHAT : TD_API_COMPLETIONS;
        req_random(&r, kind, &lim);
        through_proto(&r.g, &lim, i);
        through_json(&r.g, kind, &lim, i);
    }
}

/* Each boundary alone, on an otherwise default request. */
static void test_every_boundary_round_trips(void **state) {
    (void)state;
    td_api_limits lim = td_api_default_limits();
    static req_t r;
    for (int c = 0; c < 40; c++) {
        req_init(&r);
        td_gen_request *g = &r.g;
        td_sampler_params *s = &g->sampling;
        g->max_tokens = 100;
        switch (c) {
        case 0: s->temperature = 0; break;
        case 1: s->temperature = 2; break;
        case 2: s->top_p = 1; break;
        case 3: s->top_p = 1e-7f; break;
        case 4: s->top_k = 1; break;
        case 5: s->top_k = INT32_MAX; break;
        case 6: s->min_p = 1; break;
        case 7: s->presence_penalty = -2; break;
        case 8: s->presence_penalty = 2; break;
        case 9: s->frequency_penalty = -2; break;
        case 10: s->frequency_penalty = 2; break;
        case 11: s->repetition_penalty = 2; break;
        case 12: s->repetition_penalty = 1e-7f; break;
        case 13: s->seed = 0; break;
        case 14: s->seed = UINT64_MAX - 1; break;
        case 15: s->seed = (uint64_t)INT64_MAX + 1; break;
        case 16: s->logprobs = true; break;
        case 17:
            s->logprobs = true;
            s->n_logprobs = 20;
            break;
        case 18:
            s->n_logit_bias = 1;
            r.bias[0] = (td_logit_bias){0, -100};
            break;
        case 19:
            s->n_logit_bias = 1;
            r.bias[0] = (td_logit_bias){VOCAB - 1, 100};
            break;
        case 20:
            s->n_logit_bias = VOCAB;
            for (int i = 0; i < VOCAB; i++) r.bias[i] = (td_logit_bias){i, (float)(i % 201 - 100)};
            break;
        case 21: g->max_tokens = 1; break;
        case 22: g->max_tokens = INT32_MAX; break;
        case 23: g->min_tokens = g->max_tokens; break;
        case 24:
            g->n_stop = lim.max_stop;
            for (int i = 0; i < g->n_stop; i++) snprintf(r.stop_buf[i], 12, "s%d", i);
            break;
        case 25:
            g->n_stop = 1;
            snprintf(r.stop_buf[0], 12, "%s", "x");
            break;
        case 26:
            g->n_stop_ids = lim.max_stop_ids;
            for (int i = 0; i < g->n_stop_ids; i++) r.stop_ids[i] = i % 2 ? VOCAB - 1 : 0;
            break;
        case 27: g->ignore_eos = true; break;
        case 28: g->skip_special = false; break;
        case 29: g->include_stop_str = true; break;
        default: break; /* the defaults */
        }
        through_proto(g, &lim, c);
        through_json(g, TD_API_COMPLETIONS, &lim, c);
        through_json(g, TD_API_CHAT, &lim, c);
    }
}

/* A proto one past a boundary: a 400 naming the parameter, g untouched. */
static void expect_refused(Tandem__V1__SamplingParams *s, const char *param) {
    td_api_limits lim = td_api_default_limits();
    td_gen_request g, before;
    td_gen_request_init(&g);
    memcpy(&before, &g, sizeof g);
    td_logit_bias *bias = (td_logit_bias *)&g; /* overwritten with NULL */
    td_api_error err;
    memset(&err, 0, sizeof err);
    assert_int_equal(td_sampling_from_proto(s, &lim, VOCAB, &g, &bias, &err), TD_ERR_INVALID);
    assert_null(bias);
    assert_int_equal(err.http_status, 400);
    assert_string_equal(err.param, param);
    assert_memory_equal(&g, &before, sizeof g);
}

static void test_a_bad_proto_is_refused(void **state) {
    (void)state;
    td_api_limits lim = td_api_default_limits();
    Tandem__V1__SamplingParams s;
    static int32_t ids[257];
    char *stops[17];
    for (int i = 0; i < 17; i++) stops[i] = "s";
    Tandem__V1__SamplingParams__LogitBiasEntry lb, *lbp = &lb;

    tandem__v1__sampling_params__init(&s);
    s.n_stop_token_ids = (size_t)lim.max_stop_ids + 1;
    s.stop_token_ids = ids;
    expect_refused(&s, "stop_token_ids");
    s.n_stop_token_ids = 1;
    ids[0] = VOCAB;
    expect_refused(&s, "stop_token_ids");
    ids[0] = -1;
    expect_refused(&s, "stop_token_ids");

    tandem__v1__sampling_params__init(&s);
    s.n_stop = (size_t)lim.max_stop + 1;
    s.stop = stops;
    expect_refused(&s, "stop");
    s.n_stop = 1;
    stops[0] = "";
    expect_refused(&s, "stop");

    tandem__v1__sampling_params__init(&s);
    tandem__v1__sampling_params__logit_bias_entry__init(&lb);
    s.n_logit_bias = 1;
    s.logit_bias = &lbp;
    lb.key = VOCAB;
    expect_refused(&s, "logit_bias");
    lb.key = 0;
    lb.value = NAN;
    expect_refused(&s, "logit_bias");

    tandem__v1__sampling_params__init(&s);
    s._temperature_case = TANDEM__V1__SAMPLING_PARAMS___TEMPERATURE_TEMPERATURE;
    s.temperature = INFINITY;
    expect_refused(&s, "sampling");

    tandem__v1__sampling_params__init(&s);
    s._max_tokens_case = TANDEM__V1__SAMPLING_PARAMS___MAX_TOKENS_MAX_TOKENS;
    s.max_tokens = 0;
    expect_refused(&s, "max_tokens");

    tandem__v1__sampling_params__init(&s);
    s.min_tokens = -1;
    expect_refused(&s, "min_tokens");

    tandem__v1__sampling_params__init(&s);
    s.top_logprobs = 21;
    expect_refused(&s, "top_logprobs");
}

/* No proto at all: the defaults of a new request. */
static void test_no_proto_is_the_defaults(void **state) {
    (void)state;
    td_api_limits lim = td_api_default_limits();
    td_gen_request g, want;
    td_gen_request_init(&g);
    td_gen_request_init(&want);
    td_logit_bias *bias = NULL;
    td_api_error err;
    assert_int_equal(td_sampling_from_proto(NULL, &lim, VOCAB, &g, &bias, &err), TD_OK);
    assert_null(bias);
    expect_same(&want, &g, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_sets_round_trip),
        cmocka_unit_test(test_every_boundary_round_trips),
        cmocka_unit_test(test_a_bad_proto_is_refused),
        cmocka_unit_test(test_no_proto_is_the_defaults),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
