/* NFC per UAX #15: full canonical decomposition (tables + Hangul
 * arithmetic), canonical ordering of combining marks, then canonical
 * composition of unblocked pairs. */
#include "unicode-nfc.h"

#include <stdlib.h>
#include <string.h>

#include "tokenizer-impl.h"

enum {
    H_SBASE = 0xAC00,
    H_LBASE = 0x1100,
    H_VBASE = 0x1161,
    H_TBASE = 0x11A7,
    H_LCOUNT = 19,
    H_VCOUNT = 21,
    H_TCOUNT = 28,
    H_NCOUNT = H_VCOUNT * H_TCOUNT,
    H_SCOUNT = H_LCOUNT * H_NCOUNT,
};

static int ccc_of(uint32_t cp) {
    size_t lo = 0, hi = td_nfc_ccc_n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        uint32_t c = td_nfc_ccc[mid] >> 8;
        if (c == cp) return (int)(td_nfc_ccc[mid] & 0xFF);
        if (c < cp)
            lo = mid + 1;
        else
            hi = mid;
    }
    return 0;
}

static const uint32_t *decomp_of(uint32_t cp) {
    size_t lo = 0, hi = td_nfc_decomp_n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        uint32_t c = td_nfc_decomp[mid][0];
        if (c == cp) return td_nfc_decomp[mid];
        if (c < cp)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

static uint32_t compose(uint32_t a, uint32_t b) {
    if (a >= H_LBASE && a < H_LBASE + H_LCOUNT && b >= H_VBASE && b < H_VBASE + H_VCOUNT)
        return H_SBASE + ((a - H_LBASE) * H_VCOUNT + (b - H_VBASE)) * H_TCOUNT;
    if (a >= H_SBASE && a < H_SBASE + H_SCOUNT && (a - H_SBASE) % H_TCOUNT == 0 && b > H_TBASE &&
        b < H_TBASE + H_TCOUNT)
        return a + (b - H_TBASE);
    uint64_t key = ((uint64_t)a << 21) | b;
    size_t lo = 0, hi = td_nfc_comp_n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (td_nfc_comp[mid][0] == key) return (uint32_t)td_nfc_comp[mid][1];
        if (td_nfc_comp[mid][0] < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    return 0;
}

typedef struct {
    uint32_t *v;
    size_t n, cap;
} cpvec;

static td_status cp_push(cpvec *c, uint32_t cp) {
    if (c->n == c->cap) {
        size_t cap = c->cap ? c->cap * 2 : 64;
        uint32_t *v = realloc(c->v, cap * sizeof(*v));
        if (!v) return TD_ERR_NOMEM;
        c->v = v;
        c->cap = cap;
    }
    c->v[c->n++] = cp;
    return TD_OK;
}

static td_status decompose(cpvec *c, uint32_t cp, int depth) {
    if (cp >= H_SBASE && cp < H_SBASE + H_SCOUNT) {
        uint32_t s = cp - H_SBASE;
        td_status st = cp_push(c, H_LBASE + s / H_NCOUNT);
        if (!st) st = cp_push(c, H_VBASE + (s % H_NCOUNT) / H_TCOUNT);
        if (!st && s % H_TCOUNT) st = cp_push(c, H_TBASE + s % H_TCOUNT);
        return st;
    }
    const uint32_t *d = depth < 8 ? decomp_of(cp) : NULL;
    if (!d) return cp_push(c, cp);
    td_status st = decompose(c, d[1], depth + 1);
    if (!st && d[2]) st = decompose(c, d[2], depth + 1);
    return st;
}

/* Orders, composes and appends the run c to out. */
static td_status flush_run(cpvec *c, char **out, size_t *o) {
    uint32_t *v = c->v;
    size_t n = c->n;
    /* canonical ordering: stable insertion sort of each run of marks */
    for (size_t i = 1; i < n; i++) {
        int k = ccc_of(v[i]);
        if (k == 0) continue;
        size_t j = i;
        uint32_t x = v[i];
        while (j > 0 && ccc_of(v[j - 1]) > k) {
            v[j] = v[j - 1];
            j--;
        }
        v[j] = x;
    }
    /* composition */
    size_t r = 0;
    long starter = -1;
    int last_cc = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t cp = v[i];
        int cc = ccc_of(cp);
        if (starter >= 0) {
            bool adjacent = (long)r - 1 == starter;
            if (adjacent || (last_cc != 0 && last_cc < cc)) {
                uint32_t m = compose(v[starter], cp);
                if (m) {
                    v[starter] = m;
                    continue;
                }
            }
        }
        if (cc == 0) {
            starter = (long)r;
            last_cc = 0;
        } else {
            last_cc = cc;
        }
        v[r++] = cp;
    }
    for (size_t i = 0; i < r; i++) *o += (size_t)td_utf8_put(v[i], *out + *o);
    c->n = 0;
    return TD_OK;
}

td_status td_nfc(const char *s, size_t n, char **out_p, size_t *len_p) {
    /* a character decomposes into at most 4 code points of at most 4 bytes
     * each, and composition only shrinks: 4 * 4 bytes per input byte bounds it */
    size_t cap;
    if (td_mul_overflow(n, 16, &cap) || td_add_overflow(cap, 1, &cap)) return TD_ERR_NOMEM;
    char *out = malloc(cap);
    if (!out) return TD_ERR_NOMEM;
    cpvec c = {0};
    size_t o = 0;
    td_status st = TD_OK;
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n && !st;) {
        uint32_t cp;
        size_t l = td_utf8_decode(u + i, n - i, &cp);
        if (l == 0) {
            if ((st = flush_run(&c, &out, &o))) break;
            out[o++] = s[i++];
            continue;
        }
        /* a starter that cannot combine backwards starts a new run, which
         * keeps runs short */
        if (ccc_of(cp) == 0 && c.n > 0 && cp < 0x300) st = flush_run(&c, &out, &o);
        if (!st) st = decompose(&c, cp, 0);
        i += l;
    }
    if (!st) st = flush_run(&c, &out, &o);
    free(c.v);
    if (st) {
        free(out);
        return st;
    }
    out[o] = 0;
    *out_p = out;
    *len_p = o;
    return TD_OK;
}
