/* The grammar tests' driver (tests/integration/test_grammar_*.py): matches
 * byte strings against regular expressions (common/grammar/regex.h) and
 * Lark grammars (common/grammar/lark.h). Reads lines from stdin,
 * hex-encoded so that any byte travels:
 *
 *   P FLAGS HEX   a pattern (FLAGS: 0 whole-text match, 1 TD_RX_SEARCH);
 *                 answers "ok NODES" or "err MESSAGE"
 *   B FLAGS HEX HEX  the intersection of two patterns (td_rx_and)
 *   N FLAGS HEX   the complement of a pattern (td_rx_not)
 *   G HEX         a Lark grammar; answers "ok LEXEMES RULES" or "err MESSAGE"
 *   J HEX         a JSON Schema (common/grammar/json_schema.h), answered as G
 *   S HEX         a text against the last pattern or grammar: "1" when it
 *                 matches (the grammar: every byte pushed and accepting),
 *                 else "0 N" with N the bytes a grammar took before
 *                 rejecting one (the text's length when all were taken but
 *                 the text is not a whole sentence), "err MESSAGE" on a
 *                 limit
 *
 * and writes one answer line each. Exit 0 at end of input; 2 on a
 * malformed line. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/grammar/grammar.h"
#include "common/grammar/json_schema.h"
#include "common/grammar/lark.h"
#include "common/grammar/regex.h"

static int hexval(char c) {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

static int unhex(const char *h, size_t n, char *out) {
    for (size_t i = 0; i < n / 2; i++) {
        int hi = hexval(h[2 * i]), lo = hexval(h[2 * i + 1]);
        if (hi < 0 || lo < 0) return -1;
        out[i] = (char)(hi * 16 + lo);
    }
    return (int)(n / 2);
}

int main(void) {
    size_t cap = 1 << 16;
    char *line = malloc(cap), *buf = malloc(cap);
    td_rx *rx = NULL;
    td_gram *g = NULL;
    td_rx_id cur = TD_RX_NOTHING;
    bool have = false;
    ssize_t len;
    size_t lcap = cap;
    char err[512];
    while ((len = getline(&line, &lcap, stdin)) > 0) {
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
        if (lcap > cap) {
            cap = lcap;
            buf = realloc(buf, cap);
        }
        const bool gram = line[0] == 'G' || line[0] == 'J';
        if (line[0] == 'P' || gram || line[0] == 'B' || line[0] == 'N') {
            unsigned flags = 0;
            int off = 2;
            if (!gram && sscanf(line + 1, " %u %n", &flags, &off) != 1) return 2;
            if (!gram) off += 1;
            const char *sp = line[0] == 'B' ? strchr(line + off, ' ') : NULL;
            const size_t hl = sp ? (size_t)(sp - (line + off)) : strlen(line + off);
            int n = unhex(line + off, hl, buf);
            if (n < 0 || (line[0] == 'B' && !sp)) return 2;
            td_rx_free(rx);
            td_gram_free(g);
            rx = NULL, g = NULL;
            if (!gram) {
                rx = td_rx_new(NULL);
                have = td_rx_parse(rx, buf, (size_t)n, flags, &cur, err, sizeof err) == 0;
                if (have && line[0] == 'B') {
                    int n2 = unhex(sp + 1, strlen(sp + 1), buf);
                    td_rx_id second;
                    if (n2 < 0) return 2;
                    have = td_rx_parse(rx, buf, (size_t)n2, flags, &second, err, sizeof err) == 0;
                    if (have) cur = td_rx_and(rx, cur, second);
                }
                if (have && line[0] == 'N') cur = td_rx_not(rx, cur);
                if (have) printf("ok %zu\n", td_rx_node_count(rx));
            } else {
                g = line[0] == 'G'
                        ? td_lark_compile(buf, (size_t)n, NULL, err, sizeof err)
                        : td_gram_from_json_schema(buf, (size_t)n, NULL, NULL, err, sizeof err);
                have = g != NULL;
                if (have) printf("ok %zu %zu\n", td_gram_lexeme_count(g), td_gram_rule_count(g));
            }
            if (!have) printf("err %s\n", err);
        } else if (line[0] == 'S') {
            int n = unhex(line + 2, strlen(line + 2), buf);
            if (n < 0 || !have) return 2;
            if (rx) {
                bool m = td_rx_match(rx, cur, buf, (size_t)n);
                if (td_rx_error(rx))
                    printf("err %s\n", td_rx_error(rx));
                else
                    printf("%d\n", m);
            } else {
                td_gm *m = td_gm_new(g);
                if (!m) return 2;
                size_t done;
                td_gm_result r = td_gm_push_bytes(m, buf, (size_t)n, &done);
                if (r == TD_GM_LIMIT)
                    printf("err %s\n", td_gm_error(m));
                else if (r == TD_GM_OK && td_gm_accepting(m))
                    printf("1\n");
                else
                    printf("0 %zu\n", done);
                td_gm_free(m);
            }
        } else {
            return 2;
        }
        fflush(stdout);
    }
    td_rx_free(rx);
    td_gram_free(g);
    free(line);
    free(buf);
    return 0;
}
