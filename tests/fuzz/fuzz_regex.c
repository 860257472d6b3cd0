/* libFuzzer target for the grammar engine's regular expressions
 * (common/grammar/regex.h): the first byte's low bit picks whole-text or
 * search (JSON Schema) semantics (bit 1 then complements the pattern, bit
 * 2 intersects it with the UTF-8 texts, bits 3 and 4 set the flags i and
 * s), the rest up to a NUL is an ECMAScript
 * pattern and what follows the NUL a text. The pattern is parsed under
 * small limits; when it parses, the text is matched twice (the second walk
 * runs on memoized derivatives and must agree with the first) and every
 * prefix's derivative state must stay inside the node limit. Seeds:
 * tests/fuzz/corpus/fuzz_regex. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/grammar/regex.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const unsigned flags = (data[0] & 1 ? TD_RX_SEARCH : 0) | (data[0] & 8 ? TD_RX_ICASE : 0) |
                           (data[0] & 16 ? TD_RX_DOTALL : 0);
    data++, size--;
    const uint8_t *nul = memchr(data, 0, size);
    const size_t pn = nul ? (size_t)(nul - data) : size;
    const uint8_t *text = nul ? nul + 1 : data + size;
    const size_t tn = nul ? size - pn - 1 : 0;
    td_rx_limits lim = td_rx_default_limits();
    lim.max_nodes = 20000;
    lim.max_steps = 400000;
    lim.max_repeat = 200;
    lim.max_depth = 50;
    td_rx *rx = td_rx_new(&lim);
    if (!rx) return 0;
    td_rx_id r;
    char err[256];
    if (td_rx_parse(rx, (const char *)data, pn, flags, &r, err, sizeof err) == 0) {
        if (r == TD_RX_FAIL) abort(); /* a failed parse must say so */
        if (data[-1] & 2) r = td_rx_not(rx, r);
        if (data[-1] & 4) r = td_rx_and(rx, r, td_rx_star(rx, td_rx_any_char(rx)));
        if (r == TD_RX_FAIL && !td_rx_error(rx)) abort();
        const bool m1 = td_rx_match(rx, r, text, tn);
        const bool failed = td_rx_error(rx) != NULL;
        const bool m2 = td_rx_match(rx, r, text, tn);
        if (!failed && m1 != m2) abort();
        if (td_rx_node_count(rx) > lim.max_nodes) abort();
    } else if (!err[0] || strncmp(err, "regex: ", 7) != 0) {
        abort(); /* every refusal carries a message */
    }
    td_rx_free(rx);
    return 0;
}
