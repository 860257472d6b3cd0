/* The OpenAI request parser and validator (common/api/request.h) on
 * hand-written JSON bodies: every accepted shape, every rejected class
 * (malformed JSON, wrong types, out-of-range values, limits), the error
 * object, the status mapping, and tokenization / context checks against a
 * tiny test model's tokenizer. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "common/api/request-impl.h"
#include "common/api/request.h"
#include "common/format/gguf.h"
#include "common/tokenizer/tokenizer.h"

#define VOCAB 512

static td_status parse(td_api_kind kind, const char *body, td_api_request *req, td_api_error *err) {
    td_api_limits lim = td_api_default_limits();
    memset(err, 0, sizeof(*err));
    return td_api_request_parse(kind, body, strlen(body), &lim, VOCAB, req, err);
}

static void ok_parse(td_api_kind kind, const char *body, td_api_request *req) {
    td_api_error err;
    td_status st = parse(kind, body, req, &err);
    if (st != TD_OK) fail_msg("rejected %s: %d %s", body, err.http_status, err.message);
}

/* The body must be a 400 naming `param` ("" for none). */
static void expect_400(td_api_kind kind, const char *body, const char *param) {
    td_api_request req;
    td_api_error err;
    td_status st = parse(kind, body, &req, &err);
    if (st == TD_OK) fail_msg("accepted %s", body);
    assert_int_equal(err.http_status, 400);
    assert_string_equal(err.type, "invalid_request_error");
    if (strcmp(err.param, param) != 0)
        fail_msg("%s: param '%s', expected '%s' (%s)", body, err.param, param, err.message);
    assert_true(strlen(err.message) > 0);
    /* Rejected requests own nothing. */
    assert_null(req.prompts);
    assert_null(req.chat.messages);
    assert_null(req.chat.tools);
    assert_null(req.stop);
    td_api_request_free(&req);
}

static void test_completion_defaults(void **state) {
    (void)state;
    td_api_request r;
    ok_parse(TD_API_COMPLETIONS, "{\"prompt\": \"Hello\"}", &r);
    assert_int_equal(r.kind, TD_API_COMPLETIONS);
    assert_null(r.model);
    assert_int_equal(r.n_prompts, 1);
    assert_string_equal(r.prompts[0], "Hello");
    assert_null(r.prompt_ids);
    assert_int_equal(r.max_tokens, 0);
    assert_int_equal(r.min_tokens, 0);
    assert_int_equal(r.n, 1);
    assert_false(r.stream);
    assert_false(r.include_usage);
    assert_true(r.sampling.temperature == 1.0f);
    assert_true(r.sampling.top_p == 1.0f);
    assert_int_equal(r.sampling.top_k, 0);
    assert_false(r.has_seed);
    assert_int_equal(r.n_stop, 0);
    assert_false(r.logprobs);
    assert_false(r.echo);
    assert_true(r.skip_special_tokens);
    assert_false(r.include_stop_str_in_output);
    td_api_request_free(&r);
    td_api_request_free(&r); /* a freed request can be freed again */
}

static void test_completion_all_fields(void **state) {
    (void)state;
    td_api_request r;
    ok_parse(TD_API_COMPLETIONS,
             "{\"model\": \"m\", \"prompt\": \"x\", \"max_tokens\": 7, \"min_tokens\": 3, \"n\": 2,"
             " \"stream\": true, \"stream_options\": {\"include_usage\": true},"
             " \"temperature\": 0.5, \"top_p\": 0.9, \"top_k\": 40, \"min_p\": 0.05,"
             " \"presence_penalty\": -1.5, \"frequency_penalty\": 2, \"repetition_penalty\": 1.1,"
             " \"seed\": 1234, \"stop\": [\"\\n\", \"END\"], \"stop_token_ids\": [5, 6],"
             " \"logit_bias\": {\"10\": -100, \"11\": 2.5}, \"logprobs\": 3, \"echo\": false,"
             " \"ignore_eos\": true, \"skip_special_tokens\": false,"
             " \"include_stop_str_in_output\": true, \"user\": \"u1\", \"best_of\": 2,"
             " \"suffix\": null}",
             &r);
    assert_string_equal(r.model, "m");
    assert_int_equal(r.max_tokens, 7);
    assert_int_equal(r.min_tokens, 3);
    assert_int_equal(r.n, 2);
    assert_true(r.stream);
    assert_true(r.include_usage);
    assert_true(r.sampling.temperature == 0.5f);
    assert_true(r.sampling.top_p == 0.9f);
    assert_int_equal(r.sampling.top_k, 40);
    assert_true(r.sampling.min_p == 0.05f);
    assert_true(r.sampling.presence_penalty == -1.5f);
    assert_true(r.sampling.frequency_penalty == 2.0f);
    assert_true(r.sampling.repetition_penalty == 1.1f);
    assert_true(r.has_seed);
    assert_int_equal(r.sampling.seed, 1234);
    assert_int_equal(r.n_stop, 2);
    assert_string_equal(r.stop[0], "\n");
    assert_string_equal(r.stop[1], "END");
    assert_int_equal(r.n_stop_ids, 2);
    assert_int_equal(r.stop_ids[0], 5);
    assert_int_equal(r.stop_ids[1], 6);
    assert_int_equal(r.n_logit_bias, 2);
    assert_ptr_equal(r.sampling.logit_bias, r.logit_bias);
    assert_int_equal(r.sampling.n_logit_bias, 2);
    bool seen10 = false, seen11 = false;
    for (int i = 0; i < 2; i++) {
        if (r.logit_bias[i].token == 10) seen10 = r.logit_bias[i].bias == -100.0f;
        if (r.logit_bias[i].token == 11) seen11 = r.logit_bias[i].bias == 2.5f;
    }
    assert_true(seen10 && seen11);
    assert_true(r.logprobs);
    assert_int_equal(r.top_logprobs, 3);
    assert_true(r.ignore_eos);
    assert_false(r.skip_special_tokens);
    assert_true(r.include_stop_str_in_output);
    assert_string_equal(r.user, "u1");
    td_api_request_free(&r);

    /* A single stop string, logprobs 0 (only the sampled token's). */
    ok_parse(TD_API_COMPLETIONS, "{\"prompt\": \"x\", \"stop\": \"##\", \"logprobs\": 0}", &r);
    assert_int_equal(r.n_stop, 1);
    assert_string_equal(r.stop[0], "##");
    assert_true(r.logprobs);
    assert_int_equal(r.top_logprobs, 0);
    td_api_request_free(&r);
}

static void test_prompt_shapes(void **state) {
    (void)state;
    td_api_request r;
    ok_parse(TD_API_COMPLETIONS, "{\"prompt\": [\"a\", \"bc\", \"\"]}", &r);
    assert_int_equal(r.n_prompts, 3);
    assert_string_equal(r.prompts[0], "a");
    assert_string_equal(r.prompts[1], "bc");
    assert_string_equal(r.prompts[2], "");
    td_api_request_free(&r);

    ok_parse(TD_API_COMPLETIONS, "{\"prompt\": [1, 2, 511]}", &r);
    assert_int_equal(r.n_prompts, 1);
    assert_null(r.prompts);
    assert_int_equal(r.prompt_ids_len[0], 3);
    assert_int_equal(r.prompt_ids[0][0], 1);
    assert_int_equal(r.prompt_ids[0][2], 511);
    td_api_request_free(&r);

    ok_parse(TD_API_COMPLETIONS, "{\"prompt\": [[3], [4, 5]]}", &r);
    assert_int_equal(r.n_prompts, 2);
    assert_int_equal(r.prompt_ids_len[0], 1);
    assert_int_equal(r.prompt_ids_len[1], 2);
    assert_int_equal(r.prompt_ids[1][1], 5);
    td_api_request_free(&r);

    expect_400(TD_API_COMPLETIONS, "{}", "prompt");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": null}", "prompt");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": []}", "prompt");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": 5}", "prompt");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": {\"a\": 1}}", "prompt");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": [\"a\", 1]}", "prompt");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": [1, \"a\"]}", "prompt");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": [[1], []]}", "prompt");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": [[1], 2]}", "prompt");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": [1, 512]}", "prompt");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": [-1]}", "prompt");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": [1.5]}", "prompt");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": [true]}", "prompt");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": [null]}", "prompt");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": [[1, 2], [600]]}", "prompt");
    /* Over max_prompt_items (16). */
    char body[512] = "{\"prompt\": [";
    for (int i = 0; i < 17; i++) strcat(body, i ? ",\"p\"" : "\"p\"");
    strcat(body, "]}");
    expect_400(TD_API_COMPLETIONS, body, "prompt");
    body[12] = 0;
    for (int i = 0; i < 16; i++) strcat(body, i ? ",\"p\"" : "\"p\"");
    strcat(body, "]}");
    ok_parse(TD_API_COMPLETIONS, body, &r);
    assert_int_equal(r.n_prompts, 16);
    td_api_request_free(&r);
}

static void test_chat_messages(void **state) {
    (void)state;
    td_api_request r;
    ok_parse(TD_API_CHAT,
             "{\"model\": \"m\", \"messages\": ["
             "{\"role\": \"developer\", \"content\": \"be brief\"},"
             "{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"a\"},"
             " {\"type\": \"text\", \"text\": \"b\"}], \"name\": \"bob\"},"
             "{\"role\": \"assistant\", \"content\": null},"
             "{\"role\": \"user\", \"content\": \"\"}],"
             " \"logprobs\": true, \"top_logprobs\": 5, \"max_completion_tokens\": 9,"
             " \"max_tokens\": 3, \"add_generation_prompt\": false}",
             &r);
    assert_int_equal(r.kind, TD_API_CHAT);
    assert_int_equal(json_array_size(r.chat.messages), 4);
#define MSG(i, k) json_string_value(json_object_get(json_array_get(r.chat.messages, i), k))
    assert_string_equal(MSG(0, "role"), "system");
    assert_string_equal(MSG(0, "content"), "be brief");
    assert_string_equal(MSG(1, "role"), "user");
    assert_string_equal(MSG(1, "content"), "a\nb");
    assert_string_equal(MSG(1, "name"), "bob"); /* other fields reach the template */
    assert_string_equal(MSG(2, "role"), "assistant");
    assert_string_equal(MSG(2, "content"), "");
    assert_string_equal(MSG(3, "content"), "");
    assert_true(r.logprobs);
    assert_int_equal(r.top_logprobs, 5);
    assert_int_equal(r.max_tokens, 9); /* max_completion_tokens wins */
    assert_false(r.chat.add_generation_prompt);
    td_api_request_free(&r);

    ok_parse(TD_API_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", &r);
    assert_true(r.chat.add_generation_prompt);
    assert_null(r.chat.tools);
    assert_false(r.logprobs);
    assert_null(r.prompts);
    td_api_request_free(&r);

    expect_400(TD_API_CHAT, "{}", "messages");
    expect_400(TD_API_CHAT, "{\"messages\": []}", "messages");
    expect_400(TD_API_CHAT, "{\"messages\": \"hi\"}", "messages");
    expect_400(TD_API_CHAT, "{\"messages\": [\"hi\"]}", "messages");
    expect_400(TD_API_CHAT, "{\"messages\": [{\"content\": \"hi\"}]}", "messages");
    expect_400(TD_API_CHAT, "{\"messages\": [{\"role\": 1, \"content\": \"hi\"}]}", "messages");
    expect_400(TD_API_CHAT, "{\"messages\": [{\"role\": \"user\"}]}", "messages");
    expect_400(TD_API_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": null}]}",
               "messages");
    expect_400(TD_API_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": 3}]}", "messages");
    expect_400(TD_API_CHAT,
               "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\","
               " \"image_url\": {\"url\": \"x\"}}]}]}",
               "messages");
    expect_400(TD_API_CHAT,
               "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\"}]}]}",
               "messages");
    expect_400(TD_API_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": [\"x\"]}]}",
               "messages");
    /* top_logprobs needs logprobs = true (vLLM). */
    expect_400(TD_API_CHAT,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"top_logprobs\": 2}",
               "top_logprobs");
    expect_400(TD_API_CHAT,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"logprobs\": 2}",
               "logprobs");
    /* A chat request's "prompt" is just an unknown field; messages are still required. */
    expect_400(TD_API_CHAT, "{\"prompt\": \"x\"}", "messages");
}

static void test_malformed_json(void **state) {
    (void)state;
    const char *bodies[] = {
        "",
        "   ",
        "{",
        "{\"prompt\": \"x\"",
        "{\"prompt\": }",
        "{prompt: 1}",
        "{\"prompt\": \"x\"} trailing",
        "[1, 2]",
        "\"just a string\"",
        "42",
        "null",
        "{\"prompt\": \"\\u0000\"}",
        "{\"prompt\": \"\xff\xfe\"}",
        "{\"prompt\": \"x\",}",
        "{\"prompt\": 1e999999}",
        "{\"seed\": 123456789012345678901234}",
    };
    for (size_t i = 0; i < TD_ARRAY_SIZE(bodies); i++) {
        expect_400(TD_API_COMPLETIONS, bodies[i], "");
        expect_400(TD_API_CHAT, bodies[i], "");
    }
    /* NULL body with length 0. */
    td_api_request r;
    td_api_error err;
    assert_int_not_equal(td_api_request_parse(TD_API_CHAT, NULL, 0, NULL, VOCAB, &r, &err), TD_OK);
    assert_int_equal(err.http_status, 400);
    /* Deep nesting is a parse error, not a stack overflow. */
    size_t depth = 100000;
    char *deep = malloc(2 * depth + 32);
    assert_non_null(deep);
    strcpy(deep, "{\"prompt\": ");
    size_t o = strlen(deep);
    for (size_t i = 0; i < depth; i++) deep[o++] = '[';
    for (size_t i = 0; i < depth; i++) deep[o++] = ']';
    deep[o++] = '}';
    deep[o] = 0;
    expect_400(TD_API_COMPLETIONS, deep, "");
    free(deep);
}

typedef struct {
    const char *field; /* "name": value */
    const char *param;
} case_t;

static void run_cases(const case_t *cases, size_t n) {
    for (size_t i = 0; i < n; i++) {
        char body[1024];
        snprintf(body, sizeof(body), "{\"prompt\": \"x\", %s}", cases[i].field);
        expect_400(TD_API_COMPLETIONS, body, cases[i].param);
        snprintf(body, sizeof(body),
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], %s}", cases[i].field);
        expect_400(TD_API_CHAT, body, cases[i].param);
    }
}

static void test_wrong_types(void **state) {
    (void)state;
    static const case_t cases[] = {
        {"\"model\": 3", "model"},
        {"\"max_tokens\": \"10\"", "max_tokens"},
        {"\"max_tokens\": 1.5", "max_tokens"},
        {"\"max_tokens\": true", "max_tokens"},
        {"\"max_completion_tokens\": [1]", "max_completion_tokens"},
        {"\"min_tokens\": \"1\"", "min_tokens"},
        {"\"n\": \"2\"", "n"},
        {"\"stream\": \"yes\"", "stream"},
        {"\"stream\": 1", "stream"},
        {"\"stream\": true, \"stream_options\": true", "stream_options"},
        {"\"stream\": true, \"stream_options\": {\"include_usage\": \"yes\"}", "include_usage"},
        {"\"temperature\": \"0.5\"", "temperature"},
        {"\"temperature\": false", "temperature"},
        {"\"top_p\": [0.5]", "top_p"},
        {"\"top_k\": 1.5", "top_k"},
        {"\"min_p\": {}", "min_p"},
        {"\"presence_penalty\": \"1\"", "presence_penalty"},
        {"\"frequency_penalty\": true", "frequency_penalty"},
        {"\"repetition_penalty\": \"1\"", "repetition_penalty"},
        {"\"seed\": \"42\"", "seed"},
        {"\"seed\": 4.2", "seed"},
        {"\"stop\": 5", "stop"},
        {"\"stop\": [\"a\", 5]", "stop"},
        {"\"stop\": {\"a\": 1}", "stop"},
        {"\"stop_token_ids\": 5", "stop_token_ids"},
        {"\"stop_token_ids\": [\"5\"]", "stop_token_ids"},
        {"\"logit_bias\": [1, 2]", "logit_bias"},
        {"\"logit_bias\": {\"5\": \"1\"}", "logit_bias"},
        {"\"ignore_eos\": \"true\"", "ignore_eos"},
        {"\"skip_special_tokens\": 0", "skip_special_tokens"},
        {"\"include_stop_str_in_output\": 1", "include_stop_str_in_output"},
        {"\"user\": 5", "user"},
    };
    run_cases(cases, TD_ARRAY_SIZE(cases));
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": \"x\", \"logprobs\": true}", "logprobs");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": \"x\", \"echo\": 1}", "echo");
    expect_400(TD_API_CHAT,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
               "\"add_generation_prompt\": \"no\"}",
               "add_generation_prompt");
    expect_400(TD_API_CHAT,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"logprobs\": true, "
               "\"top_logprobs\": \"3\"}",
               "top_logprobs");
}

static void test_out_of_range(void **state) {
    (void)state;
    static const case_t cases[] = {
        {"\"temperature\": 2.01", "temperature"},
        {"\"temperature\": -0.1", "temperature"},
        {"\"top_p\": 0", "top_p"},
        {"\"top_p\": 1.01", "top_p"},
        {"\"top_p\": -1", "top_p"},
        {"\"top_k\": -2", "top_k"},
        {"\"min_p\": 1.5", "min_p"},
        {"\"min_p\": -0.01", "min_p"},
        {"\"presence_penalty\": 2.5", "presence_penalty"},
        {"\"presence_penalty\": -2.01", "presence_penalty"},
        {"\"frequency_penalty\": -3", "frequency_penalty"},
        {"\"repetition_penalty\": 0", "repetition_penalty"},
        {"\"repetition_penalty\": 2.5", "repetition_penalty"},
        {"\"max_tokens\": 0", "max_tokens"},
        {"\"max_tokens\": -5", "max_tokens"},
        {"\"max_completion_tokens\": 0", "max_completion_tokens"},
        {"\"min_tokens\": -1", "min_tokens"},
        {"\"max_tokens\": 4, \"min_tokens\": 5", "min_tokens"},
        {"\"n\": 0", "n"},
        {"\"n\": 9", "n"},
        {"\"n\": -1", "n"},
        {"\"stop\": \"\"", "stop"},
        {"\"stop\": [\"a\", \"\"]", "stop"},
        {"\"stop\": [\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\",\"10\",\"11\",\"12\","
         "\"13\",\"14\",\"15\",\"16\",\"17\"]",
         "stop"},
        {"\"stop_token_ids\": [512]", "stop_token_ids"},
        {"\"stop_token_ids\": [-1]", "stop_token_ids"},
        {"\"logit_bias\": {\"abc\": 1}", "logit_bias"},
        {"\"logit_bias\": {\"\": 1}", "logit_bias"},
        {"\"logit_bias\": {\"12x\": 1}", "logit_bias"},
        {"\"logit_bias\": {\"512\": 1}", "logit_bias"},
        {"\"logit_bias\": {\"-1\": 1}", "logit_bias"},
        {"\"logit_bias\": {\"5\": 100.5}", "logit_bias"},
        {"\"logit_bias\": {\"5\": -101}", "logit_bias"},
        {"\"stream_options\": {\"include_usage\": true}", "stream_options"},
        {"\"stream\": false, \"stream_options\": {\"include_usage\": true}", "stream_options"},
    };
    run_cases(cases, TD_ARRAY_SIZE(cases));
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": \"x\", \"logprobs\": 21}", "logprobs");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": \"x\", \"logprobs\": -1}", "logprobs");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": \"x\", \"suffix\": \"s\"}", "suffix");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": \"x\", \"best_of\": 3}", "best_of");
    expect_400(TD_API_COMPLETIONS, "{\"prompt\": \"x\", \"echo\": true, \"logprobs\": 1}", "echo");
    expect_400(TD_API_CHAT,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"logprobs\": true, "
               "\"top_logprobs\": 21}",
               "top_logprobs");
    /* 300 stop ids are over max_stop_ids (256). */
    char body[4096] = "{\"prompt\": \"x\", \"stop_token_ids\": [";
    for (int i = 0; i < 300; i++) strcat(body, i ? ",7" : "7");
    strcat(body, "]}");
    expect_400(TD_API_COMPLETIONS, body, "stop_token_ids");
}

static void test_boundaries_accepted(void **state) {
    (void)state;
    td_api_request r;
    ok_parse(TD_API_COMPLETIONS,
             "{\"prompt\": \"x\", \"temperature\": 0, \"top_p\": 1, \"top_k\": -1, \"min_p\": 1,"
             " \"presence_penalty\": -2, \"frequency_penalty\": 2, \"repetition_penalty\": 2,"
             " \"n\": 8, \"logprobs\": 20, \"max_tokens\": 5, \"min_tokens\": 5,"
             " \"logit_bias\": {\"0\": -100, \"511\": 100}, \"stop_token_ids\": [0, 511],"
             " \"seed\": -1, \"max_tokens\": 10.0}",
             &r);
    assert_true(r.sampling.temperature == 0.0f);
    assert_int_equal(r.sampling.top_k, 0); /* -1 means off */
    assert_int_equal(r.n, 8);
    assert_int_equal(r.top_logprobs, 20);
    assert_int_equal(r.max_tokens, 10); /* integral number accepted; the last key wins */
    assert_true(r.has_seed);
    assert_true(r.sampling.seed != TD_SAMPLER_SEED_RANDOM); /* -1 is a seed, not "random" */
    td_api_request_free(&r);

    /* Explicit nulls mean the defaults. */
    ok_parse(TD_API_COMPLETIONS,
             "{\"prompt\": \"x\", \"model\": null, \"max_tokens\": null, \"temperature\": null,"
             " \"stop\": null, \"seed\": null, \"logprobs\": null, \"stream_options\": null,"
             " \"n\": null, \"logit_bias\": null, \"user\": null}",
             &r);
    assert_int_equal(r.max_tokens, 0);
    assert_true(r.sampling.temperature == 1.0f);
    assert_false(r.has_seed);
    assert_false(r.logprobs);
    assert_int_equal(r.n, 1);
    td_api_request_free(&r);

    /* Huge max_tokens parses (the context check rejects it later). */
    ok_parse(TD_API_COMPLETIONS, "{\"prompt\": \"x\", \"max_tokens\": 99999999999}", &r);
    assert_int_equal(r.max_tokens, INT32_MAX);
    td_api_request_free(&r);
}

static void test_unknown_fields_accepted(void **state) {
    (void)state;
    td_api_request r;
    ok_parse(TD_API_COMPLETIONS,
             "{\"prompt\": \"x\", \"foo\": 1, \"bar\": {\"nested\": [1, 2]}, \"presence\": null,"
             " \"top_logprobs\": \"ignored on completions\"}",
             &r);
    assert_int_equal(r.n_prompts, 1);
    td_api_request_free(&r);
    ok_parse(TD_API_CHAT,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [],"
             " \"response_format\": {\"type\": \"text\"}, \"echo\": \"anything\","
             " \"parallel_tool_calls\": false, \"metadata\": {\"k\": \"v\"}}",
             &r);
    assert_int_equal(json_array_size(r.chat.messages), 1);
    assert_int_equal(json_array_size(r.chat.tools), 0);
    td_api_request_free(&r);
}

static void test_body_limit(void **state) {
    (void)state;
    td_api_limits lim = td_api_default_limits();
    assert_int_equal(lim.max_body_bytes, 4u << 20);
    lim.max_body_bytes = 20;
    const char *body = "{\"prompt\": \"hello world\"}"; /* 26 bytes */
    td_api_request r;
    td_api_error err;
    assert_int_not_equal(
        td_api_request_parse(TD_API_COMPLETIONS, body, strlen(body), &lim, VOCAB, &r, &err), TD_OK);
    assert_int_equal(err.http_status, 413);
    lim.max_body_bytes = strlen(body);
    assert_int_equal(
        td_api_request_parse(TD_API_COMPLETIONS, body, strlen(body), &lim, VOCAB, &r, &err), TD_OK);
    td_api_request_free(&r);
}

static void test_error_object(void **state) {
    (void)state;
    td_api_error e;
    td_api_error_set(&e, 400, "invalid_request_error", "", "temperature", "bad %s %d", "value", 3);
    char *s = td_api_error_json(&e);
    assert_non_null(s);
    json_error_t je;
    json_t *j = json_loads(s, 0, &je);
    assert_non_null(j);
    json_t *o = json_object_get(j, "error");
    assert_true(json_is_object(o));
    assert_string_equal(json_string_value(json_object_get(o, "message")), "bad value 3");
    assert_string_equal(json_string_value(json_object_get(o, "type")), "invalid_request_error");
    assert_string_equal(json_string_value(json_object_get(o, "param")), "temperature");
    assert_true(json_is_null(json_object_get(o, "code")));
    json_decref(j);
    free(s);

    /* A message truncated to the buffer never splits a UTF-8 character. */
    char big[2000];
    size_t o2 = 0;
    while (o2 + 2 < sizeof(big) - 1) {
        big[o2++] = '\xC3';
        big[o2++] = '\xA9'; /* é */
    }
    big[o2] = 0;
    td_api_error_set(&e, 404, "not_found_error", "model_not_found", "", "%s%s", "x", big);
    assert_true(strlen(e.message) < sizeof(e.message));
    assert_int_equal(td_api_utf8_complete_len(e.message, strlen(e.message)), strlen(e.message));
    s = td_api_error_json(&e);
    assert_non_null(s);
    j = json_loads(s, 0, &je);
    assert_non_null(j);
    o = json_object_get(j, "error");
    assert_true(json_is_null(json_object_get(o, "param")));
    assert_string_equal(json_string_value(json_object_get(o, "code")), "model_not_found");
    json_decref(j);
    free(s);
}

static void test_status_mapping(void **state) {
    (void)state;
    struct {
        td_status st;
        int http;
        const char *code;
    } m[] = {
        {TD_AGAIN, 429, ""},
        {TD_ERR_UNAVAILABLE, 503, ""},
        {TD_ERR_RANGE, 400, "context_length_exceeded"},
        {TD_ERR_INVALID, 400, ""},
        {TD_ERR_NOMEM, 500, ""},
        {TD_ERR_INTERNAL, 500, ""},
    };
    for (size_t i = 0; i < TD_ARRAY_SIZE(m); i++) {
        td_api_error e;
        memset(&e, 0, sizeof(e));
        td_api_error_from_status(&e, m[i].st, "submit");
        assert_int_equal(e.http_status, m[i].http);
        assert_string_equal(e.code, m[i].code);
        assert_true(strlen(e.type) > 0);
        assert_non_null(strstr(e.message, "submit"));
    }
}

static void test_utf8(void **state) {
    (void)state;
    /* é = C3 A9; € = E2 82 AC; 😀 = F0 9F 98 80 */
    assert_int_equal(td_api_utf8_complete_len("ab\xC3", 3), 2);
    assert_int_equal(td_api_utf8_complete_len("ab\xC3\xA9", 4), 4);
    assert_int_equal(td_api_utf8_complete_len("\xE2\x82", 2), 0);
    assert_int_equal(td_api_utf8_complete_len("\xF0\x9F\x98", 3), 0);
    assert_int_equal(td_api_utf8_complete_len("\xF0\x9F\x98\x80", 4), 4);
    assert_int_equal(td_api_utf8_complete_len("a\xFF", 2), 2);     /* invalid: not held */
    assert_int_equal(td_api_utf8_complete_len("a\xC3\x41", 3), 3); /* broken sequence */
    /* Each maximal ill-formed subpart becomes one U+FFFD (Unicode's
     * recommended practice; expected values from Python's
     * bytes.decode("utf-8", "replace")). */
    static const struct {
        const char *in;
        size_t n;
        const char *out;
    } fx[] = {
        {"a\xFF"
         "b\xC3",
         4,
         "a\xEF\xBF\xBD"
         "b\xEF\xBF\xBD"},
        {"\xE2\x82", 2, "\xEF\xBF\xBD"}, /* one, not two */
        {"\xE2\x82"
         "A",
         3,
         "\xEF\xBF\xBD"
         "A"},
        {"\xF0\x80\x80", 3, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"}, /* F0 80: overlong */
        {"\xED\xA0\x80", 3, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"}, /* surrogate */
        {"\xF0\x9F\x98", 3, "\xEF\xBF\xBD"},
        {"\xC0\xAF", 2, "\xEF\xBF\xBD\xEF\xBF\xBD"},
        {"\xE2\x82\xAC", 3, "\xE2\x82\xAC"},
        {"", 0, ""},
    };
    for (size_t i = 0; i < TD_ARRAY_SIZE(fx); i++) {
        size_t n = 99;
        char *s = td_api_utf8_fix(fx[i].in, fx[i].n, &n);
        assert_non_null(s);
        assert_int_equal(n, strlen(fx[i].out));
        assert_memory_equal(s, fx[i].out, n);
        assert_int_equal(s[n], 0);
        free(s);
    }
}

static td_tokenizer *g_tok;

static int setup_tok(void **state) {
    (void)state;
    char path[4096];
    const char *dir = getenv("TANDEM_TEST_MODELS");
    if (dir)
        snprintf(path, sizeof(path), "%s/gguf/smollm2-f32.gguf", dir);
    else
        snprintf(path, sizeof(path), "%s/tandem-test-models-%d/gguf/smollm2-f32.gguf",
                 getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (int)getuid());
    td_gguf *g = NULL;
    if (td_gguf_open(path, &g) != TD_OK) {
        fprintf(stderr, "cannot open %s (set TANDEM_TEST_MODELS)\n", path);
        return -1;
    }
    td_status st = td_tokenizer_from_gguf(g, &g_tok);
    td_gguf_close(g);
    return st == TD_OK ? 0 : -1;
}

static td_chat *g_chat;

static int teardown_tok(void **state) {
    (void)state;
    td_chat_free(g_chat);
    g_chat = NULL;
    td_tokenizer_free(g_tok);
    return 0;
}

static td_api_model model(int32_t ctx) {
    if (!g_chat) {
        char err[512];
        assert_int_equal(
            td_chat_pick(NULL, td_tokenizer_chat_template(g_tok), &g_chat, err, sizeof err), TD_OK);
    }
    return (td_api_model){.tok = g_tok, .chat = g_chat, .model_name = "tiny", .max_ctx = ctx};
}

static char *decode(const int32_t *t, int32_t n) {
    char *text = NULL;
    size_t len = 0;
    assert_int_equal(td_tokenizer_decode(g_tok, t, (size_t)n, false, &text, &len), TD_OK);
    return text;
}

static void test_tokens_chat(void **state) {
    (void)state;
    td_api_model m = model(256);
    assert_non_null(m.chat); /* the tiny model's own template (ChatML) */
    td_api_request r;
    ok_parse(TD_API_CHAT,
             "{\"model\": \"tiny\", \"messages\": [{\"role\": \"system\", \"content\": \"S\"},"
             " {\"role\": \"user\", \"content\": \"Hello\"}]}",
             &r);
    int32_t *toks = NULL, n = 0, mt = 0;
    td_api_error err;
    assert_int_equal(td_api_request_tokens(&m, &r, 0, &toks, &n, &mt, &err), TD_OK);
    /* The ChatML rendering, with the control tokens as single ids. */
    char *text = decode(toks, n);
    assert_string_equal(text, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
                              "<|im_start|>assistant\n");
    free(text);
    assert_int_equal(toks[0], 1); /* <|im_start|> */
    int im_end = 0;
    for (int32_t i = 0; i < n; i++) im_end += toks[i] == 2;
    assert_int_equal(im_end, 2);
    assert_int_equal(mt, 256 - n); /* no max_tokens: up to the context */
    free(toks);
    td_api_request_free(&r);

    /* add_generation_prompt false leaves the assistant header out. */
    ok_parse(TD_API_CHAT,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], "
             "\"add_generation_prompt\": false, \"max_tokens\": 4}",
             &r);
    assert_int_equal(td_api_request_tokens(&m, &r, 0, &toks, &n, &mt, &err), TD_OK);
    text = decode(toks, n);
    assert_string_equal(text, "<|im_start|>user\nHi<|im_end|>\n");
    free(text);
    assert_int_equal(mt, 4);
    free(toks);
    td_api_request_free(&r);

    /* ChatML writes any role verbatim; Mistral's template needs alternating
     * user/assistant turns. */
    ok_parse(TD_API_CHAT,
             "{\"messages\": [{\"role\": \"wizard\", \"content\": \"x\"},"
             " {\"role\": \"wizard\", \"content\": \"y\"}]}",
             &r);
    assert_int_equal(td_api_request_tokens(&m, &r, 0, &toks, &n, &mt, &err), TD_OK);
    text = decode(toks, n);
    assert_string_equal(text, "<|im_start|>wizard\nx<|im_end|>\n<|im_start|>wizard\ny<|im_end|>\n"
                              "<|im_start|>assistant\n");
    free(text);
    free(toks);
    td_chat *mc = NULL;
    char msg[512];
    assert_int_equal(td_chat_load("mistral", &mc, msg, sizeof msg), TD_OK);
    td_api_model mistral = m;
    mistral.chat = mc;
    assert_int_equal(td_api_request_tokens(&mistral, &r, 0, &toks, &n, &mt, &err), TD_ERR_INVALID);
    assert_int_equal(err.http_status, 400);
    assert_string_equal(err.param, "messages");
    /* the template's own exception is the message */
    assert_non_null(strstr(err.message, "conversation roles must alternate"));
    td_chat_free(mc);
    td_api_model none = m;
    none.chat = NULL;
    none.chat_error = "the model has no chat template: start with --chat-template NAME|FILE";
    assert_int_not_equal(td_api_request_tokens(&none, &r, 0, &toks, &n, &mt, &err), TD_OK);
    assert_int_equal(err.http_status, 400);
    assert_string_equal(err.param, "messages");
    assert_non_null(strstr(err.message, "--chat-template"));
    td_api_request_free(&r);
}

/* Tools, tool calls and the template's variables reach the template; a
 * tool call's arguments string is parsed (invalid JSON is a 400). */
static void test_chat_tools_and_variables(void **state) {
    (void)state;
    td_api_request r;
    ok_parse(TD_API_CHAT,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"w?\"},"
             " {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"c1\","
             " \"type\": \"function\", \"function\": {\"name\": \"f\","
             " \"arguments\": \"{\\\"city\\\": \\\"Paris\\\", \\\"n\\\": [1, 2]}\"}}]},"
             " {\"role\": \"tool\", \"tool_call_id\": \"c1\", \"content\": \"sunny\"}],"
             " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\"}}],"
             " \"chat_template_kwargs\": {\"enable_thinking\": false}}",
             &r);
    json_t *call =
        json_array_get(json_object_get(json_array_get(r.chat.messages, 1), "tool_calls"), 0);
    json_t *args = json_object_get(json_object_get(call, "function"), "arguments");
    assert_true(json_is_object(args));
    assert_string_equal(json_string_value(json_object_get(args, "city")), "Paris");
    assert_int_equal(json_array_size(r.chat.tools), 1);
    assert_true(json_is_false(json_object_get(r.chat.kwargs, "enable_thinking")));
    td_api_request_free(&r);

    expect_400(TD_API_CHAT,
               "{\"messages\": [{\"role\": \"assistant\", \"tool_calls\": [{\"type\": "
               "\"function\", \"function\": {\"name\": \"f\", \"arguments\": \"{bad\"}}]}]}",
               "messages");
    expect_400(TD_API_CHAT,
               "{\"messages\": [{\"role\": \"assistant\", \"tool_calls\": [{\"type\": "
               "\"function\"}]}]}",
               "messages");
    expect_400(TD_API_CHAT,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": {}}",
               "tools");
    expect_400(TD_API_CHAT,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{}]}",
               "tools");
    expect_400(TD_API_CHAT,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}],"
               " \"chat_template_kwargs\": {\"messages\": []}}",
               "chat_template_kwargs");
    expect_400(TD_API_CHAT,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}],"
               " \"chat_template_kwargs\": [1]}",
               "chat_template_kwargs");
    expect_400(TD_API_CHAT,
               "{\"messages\": [{\"role\": \"assistant\", \"content\": \"x\"}],"
               " \"continue_final_message\": true, \"add_generation_prompt\": true}",
               "continue_final_message");
}

/* continue_final_message: the rendering stops where the final message's
 * content ends (transformers' rule), with no generation prompt. */
static void test_tokens_continue_final_message(void **state) {
    (void)state;
    td_api_model m = model(256);
    td_api_request r;
    ok_parse(TD_API_CHAT,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"},"
             " {\"role\": \"assistant\", \"content\": \"The answer is\"}],"
             " \"continue_final_message\": true}",
             &r);
    assert_false(r.chat.add_generation_prompt);
    int32_t *toks = NULL, n = 0, mt = 0;
    td_api_error err;
    assert_int_equal(td_api_request_tokens(&m, &r, 0, &toks, &n, &mt, &err), TD_OK);
    char *text = decode(toks, n);
    assert_string_equal(text,
                        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe answer is");
    free(text);
    free(toks);
    td_api_request_free(&r);
}

static void test_tokens_completion(void **state) {
    (void)state;
    td_api_model m = model(32);
    td_api_request r;
    ok_parse(TD_API_COMPLETIONS, "{\"prompt\": [\"abc<|im_end|>\", \"\"], \"max_tokens\": 3}", &r);
    int32_t *toks = NULL, n = 0, mt = 0;
    td_api_error err;
    assert_int_equal(td_api_request_tokens(&m, &r, 0, &toks, &n, &mt, &err), TD_OK);
    /* Special tokens in the prompt text are parsed (vLLM). */
    bool has_end = false;
    for (int32_t i = 0; i < n; i++) has_end |= toks[i] == 2;
    assert_true(has_end);
    char *text = decode(toks, n);
    assert_non_null(strstr(text, "abc<|im_end|>"));
    free(text);
    assert_int_equal(mt, 3);
    free(toks);
    /* The empty prompt: empty after tokenization unless the model adds BOS. */
    td_status st = td_api_request_tokens(&m, &r, 1, &toks, &n, &mt, &err);
    if (td_tokenizer_adds_bos(g_tok)) {
        assert_int_equal(st, TD_OK);
        free(toks);
    } else {
        assert_int_not_equal(st, TD_OK);
        assert_int_equal(err.http_status, 400);
        assert_string_equal(err.param, "prompt");
    }
    assert_int_not_equal(td_api_request_tokens(&m, &r, 2, &toks, &n, &mt, &err), TD_OK);
    td_api_request_free(&r);

    /* Token ids are taken as they are. */
    ok_parse(TD_API_COMPLETIONS, "{\"prompt\": [[7, 8, 9]], \"model\": \"tiny\"}", &r);
    assert_int_equal(td_api_request_tokens(&m, &r, 0, &toks, &n, &mt, &err), TD_OK);
    assert_int_equal(n, 3);
    assert_int_equal(toks[0], 7);
    assert_int_equal(toks[2], 9);
    assert_int_equal(mt, 29);
    free(toks);
    td_api_request_free(&r);

    /* Unknown model: 404 model_not_found. */
    ok_parse(TD_API_COMPLETIONS, "{\"prompt\": [1], \"model\": \"other\"}", &r);
    toks = NULL;
    assert_int_not_equal(td_api_request_tokens(&m, &r, 0, &toks, &n, &mt, &err), TD_OK);
    assert_null(toks);
    assert_int_equal(err.http_status, 404);
    assert_string_equal(err.code, "model_not_found");
    td_api_request_free(&r);
}

static void test_context_length(void **state) {
    (void)state;
    td_api_model m = model(8);
    td_api_request r;
    int32_t *toks = NULL, n = 0, mt = 0;
    td_api_error err;
    /* 7 prompt tokens + 1 fits in 8; 8 does not. */
    ok_parse(TD_API_COMPLETIONS, "{\"prompt\": [1,2,3,4,5,6,7]}", &r);
    assert_int_equal(td_api_request_tokens(&m, &r, 0, &toks, &n, &mt, &err), TD_OK);
    assert_int_equal(mt, 1);
    free(toks);
    td_api_request_free(&r);
    ok_parse(TD_API_COMPLETIONS, "{\"prompt\": [1,2,3,4,5,6,7,8]}", &r);
    assert_int_equal(td_api_request_tokens(&m, &r, 0, &toks, &n, &mt, &err), TD_ERR_RANGE);
    assert_int_equal(err.http_status, 400);
    assert_string_equal(err.code, "context_length_exceeded");
    assert_string_equal(err.param, "prompt");
    td_api_request_free(&r);
    /* prompt + max_tokens over the context. */
    ok_parse(TD_API_COMPLETIONS, "{\"prompt\": [1,2,3,4], \"max_tokens\": 5}", &r);
    assert_int_equal(td_api_request_tokens(&m, &r, 0, &toks, &n, &mt, &err), TD_ERR_RANGE);
    assert_string_equal(err.code, "context_length_exceeded");
    assert_string_equal(err.param, "max_tokens");
    td_api_request_free(&r);
    ok_parse(TD_API_COMPLETIONS, "{\"prompt\": [1,2,3,4], \"max_tokens\": 4}", &r);
    assert_int_equal(td_api_request_tokens(&m, &r, 0, &toks, &n, &mt, &err), TD_OK);
    assert_int_equal(mt, 4);
    free(toks);
    td_api_request_free(&r);
    ok_parse(TD_API_COMPLETIONS, "{\"prompt\": [1], \"max_tokens\": 99999999999}", &r);
    assert_int_equal(td_api_request_tokens(&m, &r, 0, &toks, &n, &mt, &err), TD_ERR_RANGE);
    td_api_request_free(&r);
    /* A long chat overflows too. */
    char body[4096];
    snprintf(body, sizeof(body), "{\"messages\": [{\"role\": \"user\", \"content\": \"%s\"}]}",
             "a long message that is certainly more than eight tokens long");
    ok_parse(TD_API_CHAT, body, &r);
    assert_int_equal(td_api_request_tokens(&m, &r, 0, &toks, &n, &mt, &err), TD_ERR_RANGE);
    assert_string_equal(err.param, "messages");
    td_api_request_free(&r);
}

static void test_to_gen(void **state) {
    (void)state;
    td_api_request r;
    ok_parse(TD_API_COMPLETIONS,
             "{\"prompt\": \"x\", \"seed\": 100, \"n\": 3, \"min_tokens\": 2, \"stop\": [\"zz\"],"
             " \"stop_token_ids\": [4], \"logprobs\": 2, \"ignore_eos\": true,"
             " \"include_stop_str_in_output\": true, \"skip_special_tokens\": false,"
             " \"temperature\": 0.7, \"logit_bias\": {\"3\": 1}}",
             &r);
    int32_t toks[3] = {5, 6, 7};
    td_gen_request g;
    for (int32_t c = 0; c < 3; c++) {
        td_api_request_to_gen(&r, toks, 3, 10, c, &g);
        assert_ptr_equal(g.prompt, toks);
        assert_int_equal(g.n_prompt, 3);
        assert_int_equal(g.max_tokens, 10);
        assert_int_equal(g.min_tokens, 2);
        assert_int_equal(g.sampling.seed, 100 + (uint64_t)c);
        assert_true(g.sampling.temperature == 0.7f);
        assert_true(g.sampling.logprobs);
        assert_int_equal(g.sampling.n_logprobs, 2);
        assert_int_equal(g.sampling.n_logit_bias, 1);
        assert_int_equal(g.sampling.logit_bias[0].token, 3);
        assert_int_equal(g.n_stop, 1);
        assert_string_equal(g.stop[0], "zz");
        assert_int_equal(g.n_stop_ids, 1);
        assert_int_equal(g.stop_ids[0], 4);
        assert_true(g.ignore_eos);
        assert_true(g.include_stop_str);
        assert_false(g.skip_special);
    }
    td_api_request_free(&r);
    /* No seed: every choice draws its own from the OS; min_tokens capped. */
    ok_parse(TD_API_COMPLETIONS, "{\"prompt\": \"x\", \"min_tokens\": 50}", &r);
    td_api_request_to_gen(&r, toks, 3, 10, 1, &g);
    assert_int_equal(g.sampling.seed, TD_SAMPLER_SEED_RANDOM);
    assert_int_equal(g.min_tokens, 10);
    assert_false(g.sampling.logprobs);
    assert_int_equal(g.sampling.n_logprobs, 0);
    assert_true(g.skip_special);
    td_api_request_free(&r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_completion_defaults),
        cmocka_unit_test(test_completion_all_fields),
        cmocka_unit_test(test_prompt_shapes),
        cmocka_unit_test(test_chat_messages),
        cmocka_unit_test(test_chat_tools_and_variables),
        cmocka_unit_test(test_malformed_json),
        cmocka_unit_test(test_wrong_types),
        cmocka_unit_test(test_out_of_range),
        cmocka_unit_test(test_boundaries_accepted),
        cmocka_unit_test(test_unknown_fields_accepted),
        cmocka_unit_test(test_body_limit),
        cmocka_unit_test(test_error_object),
        cmocka_unit_test(test_status_mapping),
        cmocka_unit_test(test_utf8),
        cmocka_unit_test(test_to_gen),
    };
    const struct CMUnitTest tok_tests[] = {
        cmocka_unit_test(test_tokens_chat),
        cmocka_unit_test(test_tokens_continue_final_message),
        cmocka_unit_test(test_tokens_completion),
        cmocka_unit_test(test_context_length),
    };
    int failed = cmocka_run_group_tests_name("request", tests, NULL, NULL);
    failed += cmocka_run_group_tests_name("request_tokens", tok_tests, setup_tok, teardown_tok);
    return failed;
}
