/* The regex oracle test's driver (tests/integration/test_grammar_regex.py):
 * matches byte strings against patterns with the grammar engine's
 * derivative matcher (common/grammar/regex.h). Reads lines from stdin,
 * hex-encoded so that any byte travels:
 *
 *   P FLAGS HEX   a pattern (FLAGS: 0 whole-text match, 1 TD_RX_SEARCH);
 *                 answers "ok NODES" or "err MESSAGE"
 *   S HEX         a text against the last pattern; answers 1 or 0
 *
 * and writes one answer line each. Exit 0 at end of input; 2 on a
 * malformed line. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/grammar/regex.h"

static int unhex(const char *h, size_t n, char *out) {
    for (size_t i = 0; i < n / 2; i++) {
        unsigned v;
        if (sscanf(h + 2 * i, "%2x", &v) != 1) return -1;
        out[i] = (char)v;
    }
    return (int)(n / 2);
}

int main(void) {
    size_t cap = 1 << 16;
    char *line = malloc(cap), *buf = malloc(cap);
    td_rx *rx = NULL;
    td_rx_id cur = TD_RX_NOTHING;
    bool have = false;
    ssize_t len;
    size_t lcap = cap;
    while ((len = getline(&line, &lcap, stdin)) > 0) {
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
        if (lcap > cap) {
            cap = lcap;
            buf = realloc(buf, cap);
        }
        if (line[0] == 'P') {
            unsigned flags;
            int off;
            if (sscanf(line, "P %u %n", &flags, &off) != 1) return 2;
            int n = unhex(line + off, strlen(line + off), buf);
            if (n < 0) return 2;
            td_rx_free(rx);
            rx = td_rx_new(NULL);
            char err[256];
            have = td_rx_parse(rx, buf, (size_t)n, flags, &cur, err, sizeof err) == 0;
            if (have)
                printf("ok %zu\n", td_rx_node_count(rx));
            else
                printf("err %s\n", err);
        } else if (line[0] == 'S') {
            int n = unhex(line + 2, strlen(line + 2), buf);
            if (n < 0 || !rx) return 2;
            bool m = have && td_rx_match(rx, cur, buf, (size_t)n);
            if (have && td_rx_error(rx)) {
                printf("err %s\n", td_rx_error(rx));
                have = false;
            } else {
                printf("%d\n", m);
            }
        } else {
            return 2;
        }
        fflush(stdout);
    }
    td_rx_free(rx);
    free(line);
    free(buf);
    return 0;
}
