/* Small helpers the grammar engine's files share (internal). */
#ifndef TD_GRAMMAR_UTIL_H
#define TD_GRAMMAR_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

/* Grows *p (elements of size sz, capacity *cap) so that index n fits,
 * doubling; false on allocation failure (*p unchanged). */
static inline bool td_gr_reserve(void **p, size_t *cap, size_t n, size_t sz) {
    if (n < *cap) return true;
    size_t nc = *cap ? *cap : 64;
    while (nc <= n) nc *= 2;
    void *q = realloc(*p, nc * sz);
    if (!q) return false;
    *p = q;
    *cap = nc;
    return true;
}

/* A hex digit's value, -1 for another character. */
static inline int td_gr_hexval(char c) {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

/* The bytes of code point c in UTF-8. */
static inline int td_gr_utf8_len(uint32_t c) {
    return c < 0x80 ? 1 : c < 0x800 ? 2 : c < 0x10000 ? 3 : 4;
}

/* c encoded into out (td_gr_utf8_len(c) bytes); returns that length. */
static inline int td_gr_utf8_put(uint32_t c, uint8_t *out) {
    static const uint8_t lead[5] = {0, 0, 0xC0, 0xE0, 0xF0};
    const int n = td_gr_utf8_len(c);
    for (int i = n - 1; i > 0; i--) {
        out[i] = (uint8_t)(0x80 | (c & 0x3F));
        c >>= 6;
    }
    out[0] = (uint8_t)(n == 1 ? c : lead[n] | c);
    return n;
}

/* The bytes that stand for special token id inside the engine: 0xFF (never
 * in UTF-8 text, so no text constraint admits them) and the id in 4 bytes,
 * big-endian. A token terminal of a grammar is a lexeme of these bytes;
 * the vocabulary gives the special tokens these bytes. */
#define TD_GR_TOKEN_BYTES 5
static inline void td_gr_token_bytes(int32_t id, uint8_t out[TD_GR_TOKEN_BYTES]) {
    out[0] = 0xFF;
    for (int i = 0; i < 4; i++) out[1 + i] = (uint8_t)((uint32_t)id >> (24 - 8 * i));
}

#endif
