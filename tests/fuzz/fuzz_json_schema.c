/* libFuzzer target for the JSON Schema compiler (common/grammar/
 * json_schema.h): the input up to a NUL is a schema, the rest a document.
 * The schema is compiled under small bounds; a refusal must carry a
 * message. When it compiles, the document is pushed byte by byte into a
 * matcher: a document the matcher accepts must be JSON (jansson reads it
 * whole, or stops only at a number beyond its range), and taking every byte back must leave the
 * matcher at its start. Seeds: tests/fuzz/corpus/fuzz_json_schema. */
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/grammar/grammar.h"
#include "common/grammar/json_schema.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *nul = memchr(data, 0, size);
    const size_t sn = nul ? (size_t)(nul - data) : size;
    const uint8_t *doc = nul ? nul + 1 : data + size;
    const size_t dn = nul ? size - sn - 1 : 0;
    td_gram_limits lim = td_gram_default_limits();
    lim.max_lexemes = 300;
    lim.max_rules = 3000;
    lim.max_lexer_states = 3000;
    lim.max_items_set = 5000;
    lim.max_items = 200000;
    lim.rx.max_nodes = 30000;
    lim.rx.max_steps = 600000;
    lim.rx.max_repeat = 100;
    lim.rx.max_depth = 40;
    td_json_opts o = {.max_schema_nodes = 2000, .max_depth = 40};
    char err[512];
    err[0] = 0;
    td_gram *g = td_gram_from_json_schema((const char *)data, sn, &o, &lim, err, sizeof err);
    if (!g) {
        if (!err[0]) abort();
        return 0;
    }
    td_gm *m = td_gm_new(g);
    if (m) {
        size_t done;
        const td_gm_result r = td_gm_push_bytes(m, doc, dn, &done);
        if (r == TD_GM_OK && td_gm_accepting(m)) {
            json_error_t je;
            json_t *v = json_loadb((const char *)doc, dn, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
            /* accepted, yet not JSON (jansson's own range limits aside) */
            if (!v && !strstr(je.text, "overflow") && !strstr(je.text, "too big")) abort();
            json_decref(v);
        }
        if (r == TD_GM_LIMIT && !td_gm_error(m)) abort();
        td_gm_pop(m, td_gm_depth(m));
        if (td_gm_depth(m) != 0) abort();
        td_gm_free(m);
    }
    td_gram_free(g);
    return 0;
}
