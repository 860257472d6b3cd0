#include "strbuf.h"

#include <stdlib.h>
#include <string.h>

void td_strbuf_put(td_strbuf *b, const void *s, size_t n) {
    if (b->oom) return;
    if (n > (size_t)-1 / 2 - b->n) {
        b->oom = true;
        return;
    }
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *v = realloc(b->v, cap);
        if (!v) {
            b->oom = true;
            return;
        }
        b->v = v;
        b->cap = cap;
    }
    if (n) memcpy(b->v + b->n, s, n);
    b->n += n;
    b->v[b->n] = 0;
}

void td_strbuf_puts(td_strbuf *b, const char *s) { td_strbuf_put(b, s, strlen(s)); }

void td_strbuf_free(td_strbuf *b) {
    free(b->v);
    b->v = NULL;
    b->n = b->cap = 0;
    b->oom = false;
}
