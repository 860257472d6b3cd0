/* libFuzzer target for the OpenAI request parser: the input is a request
 * body, parsed and validated as both /v1/completions and
 * /v1/chat/completions (td_api_request_parse), then freed; a success must
 * hold a request whose shape the header promises. The error object of a
 * failure is rendered as JSON, which must be valid. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "common/api/request-impl.h"
#include "common/api/request.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    td_log_set_level(TD_LOG_WARN); /* "ignoring unknown fields" on most inputs */
    return 0;
}

#define VOCAB 512

static void check_ok(const td_api_request *r, const td_api_limits *lim) {
    if (r->n < 1 || r->n > lim->max_n) abort();
    if (r->n_stop < 0 || r->n_stop > lim->max_stop) abort();
    for (int32_t i = 0; i < r->n_stop; i++)
        if (!r->stop[i] || !r->stop[i][0]) abort();
    for (int32_t i = 0; i < r->n_stop_ids; i++)
        if (r->stop_ids[i] < 0 || r->stop_ids[i] >= VOCAB) abort();
    for (int32_t i = 0; i < r->n_logit_bias; i++)
        if (r->logit_bias[i].token < 0 || r->logit_bias[i].token >= VOCAB) abort();
    if (r->max_tokens < 0 || (r->max_tokens > 0 && r->min_tokens > r->max_tokens)) abort();
    if (r->top_logprobs < 0 || r->top_logprobs > 20) abort();
    if (!(r->sampling.temperature >= 0 && r->sampling.temperature <= 2)) abort();
    if (!(r->sampling.top_p > 0 && r->sampling.top_p <= 1)) abort();
    if (r->kind == TD_API_COMPLETIONS) {
        if (r->n_prompts < 1 || (!r->prompts == !r->prompt_ids)) abort();
        for (int32_t i = 0; r->prompt_ids && i < r->n_prompts; i++) {
            if (r->prompt_ids_len[i] < 1) abort();
            for (int32_t k = 0; k < r->prompt_ids_len[i]; k++)
                if (r->prompt_ids[i][k] < 0 || r->prompt_ids[i][k] >= VOCAB) abort();
        }
    } else {
        /* the normalised messages: objects with a string role and content;
         * each tool call's arguments an object */
        if (!json_is_array(r->chat.messages) || json_array_size(r->chat.messages) < 1) abort();
        size_t i;
        json_t *m;
        json_array_foreach(r->chat.messages, i, m) {
            if (!json_is_string(json_object_get(m, "role")) ||
                !json_is_string(json_object_get(m, "content")))
                abort();
            json_t *calls = json_object_get(m, "tool_calls"), *c;
            size_t k;
            if (calls && !json_is_null(calls)) json_array_foreach(calls, k, c) {
                    if (!json_is_object(
                            json_object_get(json_object_get(c, "function"), "arguments")))
                        abort();
                }
        }
        if (r->chat.tools && !json_is_array(r->chat.tools)) abort();
        if (r->chat.kwargs && !json_is_object(r->chat.kwargs)) abort();
    }
}

/* The UTF-8 repair the responses rely on: always valid, never longer than
 * 3 bytes per input byte, a no-op on valid text. */
static void check_utf8(const uint8_t *data, size_t size) {
    size_t n = 0;
    char *fixed = td_api_utf8_fix((const char *)data, size, &n);
    if (!fixed) return;
    if (n > 3 * size || fixed[n] != 0) abort();
    json_t *s = json_stringn(fixed, n);
    if (!s) abort(); /* jansson accepts only valid UTF-8 */
    json_decref(s);
    size_t keep = td_api_utf8_complete_len((const char *)data, size);
    if (keep > size || size - keep > 3) abort();
    json_t *orig = json_stringn((const char *)data, size);
    if (orig && (n != size || memcmp(fixed, data, size) != 0)) abort();
    json_decref(orig);
    free(fixed);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    check_utf8(data, size);
    td_api_limits lim = td_api_default_limits();
    lim.max_body_bytes = 1 << 16;
    for (int k = 0; k < 2; k++) {
        td_api_kind kind = k ? TD_API_CHAT : TD_API_COMPLETIONS;
        td_api_request req;
        td_api_error err;
        memset(&err, 0, sizeof(err));
        td_status st =
            td_api_request_parse(kind, (const char *)data, size, &lim, VOCAB, &req, &err);
        if (st == TD_OK) {
            check_ok(&req, &lim);
        } else {
            if (err.http_status != 400 && err.http_status != 413 && err.http_status != 500) abort();
            char *js = td_api_error_json(&err);
            if (js) {
                json_error_t je;
                json_t *j = json_loads(js, 0, &je);
                if (!j) abort();
                json_decref(j);
                free(js);
            }
        }
        td_api_request_free(&req);
    }
    return 0;
}
