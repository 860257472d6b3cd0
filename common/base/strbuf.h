/* A growable byte string for building responses and rendered text.
 * Appends never fail loudly: an allocation failure sets oom, later appends
 * are ignored, and the caller checks oom once at the end. v is
 * NUL-terminated after any append (n excludes the NUL). Not thread-safe. */
#ifndef TD_STRBUF_H
#define TD_STRBUF_H

#include <stdbool.h>
#include <stddef.h>

typedef struct {
    char *v; /* (cap) malloc'd; NULL until the first append */
    size_t n, cap;
    bool oom;
} td_strbuf;

/* Appends n bytes of s (s may be NULL when n is 0). */
void td_strbuf_put(td_strbuf *b, const void *s, size_t n);
/* Appends a NUL-terminated string. */
void td_strbuf_puts(td_strbuf *b, const char *s);
/* Frees v and resets b to empty. */
void td_strbuf_free(td_strbuf *b);

#endif
