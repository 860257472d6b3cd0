/* libFuzzer target for the chat-template engine (common/template): each
 * input is a template, optionally followed by a NUL and a JSON context;
 * without one (or when it does not parse) a fixed conversation with tools
 * is the context. The template is compiled and, when it compiles, rendered
 * under small limits, so that a runaway template ends at a limit quickly.
 * Seeds: tests/fuzz/corpus/fuzz_template, and llama.cpp's real templates
 * when scripts/fetch-test-models.sh has put them in the cache
 * (tests/CMakeLists.txt adds that directory). */
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/template/template.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char k_ctx[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"sys\"}, {\"role\": \"user\", "
    "\"content\": "
    "\"caf\\u00e9 'q' \\\"x\\\"\"}, {\"role\": \"assistant\", \"content\": null, \"tool_calls\": "
    "[{\"id\": \"a\", \"type\": \"function\", \"function\": {\"name\": \"f\", \"arguments\": "
    "{\"x\": "
    "[1, 2.5, true, null]}}}], \"reasoning_content\": \"hm\"}, {\"role\": \"tool\", \"content\": "
    "\"ok\"}], \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", "
    "\"parameters\": "
    "{\"type\": \"object\", \"properties\": {\"x\": {\"type\": \"array\"}}}}}], \"documents\": "
    "null, \"add_generation_prompt\": true, \"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *nul = memchr(data, 0, size);
    const size_t tn = nul ? (size_t)(nul - data) : size;
    char *src = malloc(tn + 1);
    if (!src) return 0;
    memcpy(src, data, tn);
    src[tn] = 0;
    json_t *ctx = NULL;
    if (nul) ctx = json_loadb((const char *)nul + 1, size - tn - 1, 0, NULL);
    if (!ctx || !json_is_object(ctx)) {
        json_decref(ctx);
        ctx = json_loads(k_ctx, 0, NULL);
    }
    char err[256];
    td_tmpl *t = td_tmpl_compile(src, err, sizeof err);
    if (t) {
        td_tmpl_limits lim = td_tmpl_default_limits();
        lim.max_output = 1 << 20;
        lim.max_memory = 32 << 20;
        lim.max_steps = 200000;
        lim.max_iters = 100000;
        lim.max_depth = 32;
        lim.now = 1767225600;
        char *out = NULL;
        size_t n = 0;
        if (td_tmpl_render(t, ctx, &lim, &out, &n, err, sizeof err) == TD_OK) {
            if (strlen(out) > n) abort(); /* the length covers the text */
            free(out);
        }
        td_tmpl_free(t);
    }
    json_decref(ctx);
    free(src);
    return 0;
}
