/* Byte-level regular expressions by derivatives (regex.h). */
#include "common/grammar/regex.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/grammar/util.h"

enum { K_NOTHING, K_EMPTY, K_BYTES, K_CONCAT, K_OR, K_STAR, K_REPEAT, K_AND, K_NOT, K_MOD };

#define NOPOINT UINT32_MAX /* K_MOD: no decimal point read yet */

#define INF     UINT32_MAX

typedef struct {
    uint8_t kind, nullable;
    uint8_t complex;   /* holds an AND, NOT or MOD: its language may be empty unseen */
    uint8_t empty;     /* td_rx_is_empty's memo: 0 unknown, 1 empty, 2 not */
    uint32_t a, b;     /* CONCAT: head, tail; OR: first alternative, the rest; STAR, REPEAT: a;
                          MOD: the divisor p, the remainder so far */
    uint32_t min, max; /* REPEAT; MOD: the scale k, fraction digits read (NOPOINT: none) */
    uint64_t set[4];   /* BYTES */
} node;

struct td_rx {
    td_rx_limits lim;
    node *nodes;
    size_t n, cap;
    uint32_t *slots; /* hash-consing: node id + 1, 0 free */
    size_t nslots;
    uint64_t *dkeys; /* derivative memo: (id << 8 | byte) + 1, 0 free */
    uint32_t *dvals;
    size_t ndslots, ndused;
    uint64_t steps;
    const char *error;
    char errbuf[96];
    td_rx_id any_char; /* cached td_rx_any_char, 0 until made */
    /* td_rx_is_empty's byte classes: one representative byte per class,
     * remade when a byte set or a multiple has been added since */
    size_t nsets, sets_at_classes;
    uint8_t reps[256];
    int nreps;
};

td_rx_limits td_rx_default_limits(void) {
    return (td_rx_limits){
        .max_nodes = 1000000, .max_steps = 50000000, .max_repeat = 10000, .max_depth = 200};
}

static void fail(td_rx *rx, const char *fmt, ...) {
    if (rx->error) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(rx->errbuf, sizeof rx->errbuf, fmt, ap);
    va_end(ap);
    rx->error = rx->errbuf;
}

static bool step(td_rx *rx) {
    if (rx->error) return false;
    if (++rx->steps > rx->lim.max_steps) {
        fail(rx, "regex: more than %llu derivative steps", (unsigned long long)rx->lim.max_steps);
        return false;
    }
    return true;
}

static uint64_t mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h * 0xff51afd7ed558ccdull;
}

static uint64_t node_hash(const node *x) {
    uint64_t h = mix(x->kind, x->a);
    h = mix(h, x->b);
    h = mix(h, ((uint64_t)x->min << 32) | x->max);
    for (int i = 0; i < 4; i++) h = mix(h, x->set[i]);
    return h ^ (h >> 31);
}

static bool node_eq(const node *x, const node *y) {
    return x->kind == y->kind && x->a == y->a && x->b == y->b && x->min == y->min &&
           x->max == y->max && !memcmp(x->set, y->set, sizeof x->set);
}

static bool grow_slots(td_rx *rx) {
    size_t ns = rx->nslots ? rx->nslots * 2 : 1024;
    uint32_t *s = calloc(ns, sizeof *s);
    if (!s) return false;
    for (size_t i = 0; i < rx->nslots; i++) {
        uint32_t v = rx->slots[i];
        if (!v) continue;
        size_t j = node_hash(&rx->nodes[v - 1]) & (ns - 1);
        while (s[j]) j = (j + 1) & (ns - 1);
        s[j] = v;
    }
    free(rx->slots);
    rx->slots = s;
    rx->nslots = ns;
    return true;
}

/* The id of the node equal to x, made if new. */
static td_rx_id intern(td_rx *rx, node x) {
    if (!step(rx)) return TD_RX_FAIL;
    switch (x.kind) {
    case K_NOTHING:
    case K_BYTES: x.nullable = 0; break;
    case K_EMPTY:
    case K_STAR: x.nullable = 1; break;
    case K_CONCAT: x.nullable = rx->nodes[x.a].nullable && rx->nodes[x.b].nullable; break;
    case K_OR: x.nullable = rx->nodes[x.a].nullable || rx->nodes[x.b].nullable; break;
    case K_AND: x.nullable = rx->nodes[x.a].nullable && rx->nodes[x.b].nullable; break;
    case K_NOT: x.nullable = !rx->nodes[x.a].nullable; break;
    case K_REPEAT: x.nullable = x.min == 0 || rx->nodes[x.a].nullable; break;
    case K_MOD: {
        /* the digits so far times 10^(k - fraction digits) divide by p */
        uint64_t r = x.b;
        uint32_t f = x.max == NOPOINT ? 0 : x.max;
        for (uint32_t i = f; i < x.min; i++) r = r * 10 % x.a;
        x.nullable = r == 0 && x.max != 0;
        break;
    }
    }
    x.empty = 0;
    switch (x.kind) {
    case K_AND:
    case K_NOT:
    case K_MOD: x.complex = 1; break;
    case K_CONCAT:
    case K_OR: x.complex = rx->nodes[x.a].complex || rx->nodes[x.b].complex; break;
    case K_STAR:
    case K_REPEAT: x.complex = rx->nodes[x.a].complex; break;
    default: x.complex = 0;
    }
    if ((rx->n + 1) * 2 > rx->nslots && !grow_slots(rx)) {
        fail(rx, "regex: out of memory");
        return TD_RX_FAIL;
    }
    uint64_t h = node_hash(&x);
    size_t j = h & (rx->nslots - 1);
    while (rx->slots[j]) {
        if (node_eq(&rx->nodes[rx->slots[j] - 1], &x)) return rx->slots[j] - 1;
        j = (j + 1) & (rx->nslots - 1);
    }
    if (rx->n >= rx->lim.max_nodes) {
        fail(rx, "regex: more than %u nodes", rx->lim.max_nodes);
        return TD_RX_FAIL;
    }
    if (rx->n == rx->cap) {
        size_t nc = rx->cap ? rx->cap * 2 : 256;
        node *nn = realloc(rx->nodes, nc * sizeof *nn);
        if (!nn) {
            fail(rx, "regex: out of memory");
            return TD_RX_FAIL;
        }
        rx->nodes = nn;
        rx->cap = nc;
    }
    rx->nodes[rx->n] = x;
    rx->slots[j] = (uint32_t)rx->n + 1;
    if (x.kind == K_BYTES || x.kind == K_MOD) rx->nsets++;
    return (td_rx_id)rx->n++;
}

td_rx *td_rx_new(const td_rx_limits *lim) {
    td_rx *rx = calloc(1, sizeof *rx);
    if (!rx) return NULL;
    rx->lim = lim ? *lim : td_rx_default_limits();
    rx->lim.max_steps += 2;
    if (rx->lim.max_nodes < 2) rx->lim.max_nodes = 2;
    if (intern(rx, (node){.kind = K_NOTHING}) != TD_RX_NOTHING ||
        intern(rx, (node){.kind = K_EMPTY}) != TD_RX_EMPTY) {
        td_rx_free(rx);
        return NULL;
    }
    return rx;
}

void td_rx_free(td_rx *rx) {
    if (!rx) return;
    free(rx->nodes);
    free(rx->slots);
    free(rx->dkeys);
    free(rx->dvals);
    free(rx);
}

const char *td_rx_error(const td_rx *rx) { return rx->error; }
size_t td_rx_node_count(const td_rx *rx) { return rx->n; }
uint64_t td_rx_steps(const td_rx *rx) { return rx->steps; }

bool td_rx_nullable(const td_rx *rx, td_rx_id a) {
    return a != TD_RX_FAIL && a < rx->n && rx->nodes[a].nullable;
}

/* ---- constructors ---- */

td_rx_id td_rx_byteset(td_rx *rx, const uint64_t set[4]) {
    if (!(set[0] | set[1] | set[2] | set[3])) return TD_RX_NOTHING;
    node x = {.kind = K_BYTES};
    memcpy(x.set, set, sizeof x.set);
    return intern(rx, x);
}

td_rx_id td_rx_byte_range(td_rx *rx, uint8_t lo, uint8_t hi) {
    uint64_t s[4] = {0};
    for (unsigned c = lo; c <= hi; c++) s[c >> 6] |= 1ull << (c & 63);
    return td_rx_byteset(rx, s);
}

/* A growable array of ids (the constructors' scratch). */
typedef struct {
    td_rx_id *v;
    size_t n, cap;
} idvec;

static bool push(idvec *a, td_rx_id x) {
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 16;
        td_rx_id *nv = realloc(a->v, nc * sizeof *nv);
        if (!nv) return false;
        a->v = nv;
        a->cap = nc;
    }
    a->v[a->n++] = x;
    return true;
}

td_rx_id td_rx_concat(td_rx *rx, td_rx_id a, td_rx_id b) {
    if (a == TD_RX_FAIL || b == TD_RX_FAIL || rx->error) return TD_RX_FAIL;
    if (a == TD_RX_NOTHING || b == TD_RX_NOTHING) return TD_RX_NOTHING;
    if (a == TD_RX_EMPTY) return b;
    if (b == TD_RX_EMPTY) return a;
    if (rx->nodes[a].kind != K_CONCAT) return intern(rx, (node){.kind = K_CONCAT, .a = a, .b = b});
    /* right-nest a's chain onto b, without recursion */
    idvec h = {0};
    for (td_rx_id c = a;; c = rx->nodes[c].b) {
        if (rx->nodes[c].kind != K_CONCAT) {
            if (!push(&h, c)) goto oom;
            break;
        }
        if (!push(&h, rx->nodes[c].a)) goto oom;
    }
    td_rx_id r = b;
    for (size_t i = h.n; i-- > 0 && r != TD_RX_FAIL;)
        r = intern(rx, (node){.kind = K_CONCAT, .a = h.v[i], .b = r});
    free(h.v);
    return r;
oom:
    free(h.v);
    fail(rx, "regex: out of memory");
    return TD_RX_FAIL;
}

static int cmp_id(const void *x, const void *y) {
    td_rx_id a = *(const td_rx_id *)x, b = *(const td_rx_id *)y;
    return a < b ? -1 : a > b;
}

/* Appends the members of a's chain of kind k (flattened) to v. */
static bool flatten(const td_rx *rx, int k, td_rx_id a, idvec *v) {
    for (;;) {
        if (rx->nodes[a].kind != k) return push(v, a);
        if (!push(v, rx->nodes[a].a)) return false;
        a = rx->nodes[a].b;
    }
}

/* The alternation (k K_OR) or intersection (K_AND) of v's ids: flattened,
 * sorted, without duplicates; the empty language is dropped from an
 * alternation and empties an intersection. */
static td_rx_id chain_vec(td_rx *rx, int k, idvec *v) {
    idvec f = {0};
    for (size_t i = 0; i < v->n; i++) {
        if (v->v[i] == TD_RX_FAIL) {
            free(f.v);
            return TD_RX_FAIL;
        }
        if (v->v[i] == TD_RX_NOTHING) {
            if (k == K_AND) {
                free(f.v);
                return TD_RX_NOTHING;
            }
            continue;
        }
        if (!flatten(rx, k, v->v[i], &f)) {
            free(f.v);
            fail(rx, "regex: out of memory");
            return TD_RX_FAIL;
        }
    }
    if (f.n) qsort(f.v, f.n, sizeof *f.v, cmp_id);
    size_t m = 0;
    for (size_t i = 0; i < f.n; i++)
        if (!m || f.v[m - 1] != f.v[i]) f.v[m++] = f.v[i];
    td_rx_id r = m ? f.v[m - 1] : TD_RX_NOTHING;
    for (size_t i = m - (m > 0); i-- > 0 && r != TD_RX_FAIL;)
        r = intern(rx, (node){.kind = (uint8_t)k, .a = f.v[i], .b = r});
    free(f.v);
    return rx->error ? TD_RX_FAIL : r;
}

static td_rx_id or_vec(td_rx *rx, idvec *v) { return chain_vec(rx, K_OR, v); }

td_rx_id td_rx_or_list(td_rx *rx, const td_rx_id *ids, size_t n) {
    if (rx->error) return TD_RX_FAIL;
    idvec v = {0};
    for (size_t i = 0; i < n; i++)
        if (!push(&v, ids[i])) {
            free(v.v);
            fail(rx, "regex: out of memory");
            return TD_RX_FAIL;
        }
    td_rx_id r = or_vec(rx, &v);
    free(v.v);
    return r;
}

td_rx_id td_rx_or(td_rx *rx, td_rx_id a, td_rx_id b) {
    td_rx_id ids[2] = {a, b};
    return td_rx_or_list(rx, ids, 2);
}

td_rx_id td_rx_and(td_rx *rx, td_rx_id a, td_rx_id b) {
    if (rx->error) return TD_RX_FAIL;
    td_rx_id ids[2] = {a, b};
    idvec v = {ids, 2, 2};
    return chain_vec(rx, K_AND, &v);
}

td_rx_id td_rx_not(td_rx *rx, td_rx_id a) {
    if (a == TD_RX_FAIL || rx->error) return TD_RX_FAIL;
    if (rx->nodes[a].kind == K_NOT) return rx->nodes[a].a;
    return intern(rx, (node){.kind = K_NOT, .a = a});
}

td_rx_id td_rx_star(td_rx *rx, td_rx_id a) {
    if (a == TD_RX_FAIL || rx->error) return TD_RX_FAIL;
    if (a == TD_RX_NOTHING || a == TD_RX_EMPTY) return TD_RX_EMPTY;
    if (rx->nodes[a].kind == K_STAR) return a;
    return intern(rx, (node){.kind = K_STAR, .a = a});
}

td_rx_id td_rx_repeat(td_rx *rx, td_rx_id a, uint32_t min, uint32_t max) {
    if (a == TD_RX_FAIL || rx->error) return TD_RX_FAIL;
    if (max < min) return TD_RX_NOTHING;
    if (max == 0 || a == TD_RX_EMPTY) return TD_RX_EMPTY;
    if (a == TD_RX_NOTHING) return min ? TD_RX_NOTHING : TD_RX_EMPTY;
    if (rx->nodes[a].nullable) min = 0;
    if (min == 0 && max == INF) return td_rx_star(rx, a);
    if (min == 1 && max == 1) return a;
    return intern(rx, (node){.kind = K_REPEAT, .a = a, .min = min, .max = max});
}

td_rx_id td_rx_literal(td_rx *rx, const void *bytes, size_t n) {
    const uint8_t *p = bytes;
    td_rx_id r = TD_RX_EMPTY;
    for (size_t i = n; i-- > 0 && r != TD_RX_FAIL;)
        r = td_rx_concat(rx, td_rx_byte_range(rx, p[i], p[i]), r);
    return r;
}

int td_rx_byte_classes(const td_rx *rx, uint8_t cls[256]) {
    memset(cls, 0, 256);
    int n = 1;
    bool mod = false;
    for (size_t i = 0; i < rx->n; i++) {
        const node *x = &rx->nodes[i];
        if (x->kind == K_MOD) mod = true;
        if (x->kind != K_BYTES) continue;
        /* split every class by membership in the set */
        int16_t split[256][2];
        memset(split, 0xff, sizeof split);
        int m = 0;
        for (int b = 0; b < 256; b++) {
            const int in = (int)(x->set[b >> 6] >> (b & 63) & 1);
            int16_t *t = &split[cls[b]][in];
            if (*t < 0) *t = (int16_t)m++;
            cls[b] = (uint8_t)*t;
        }
        n = m;
    }
    if (mod) /* a multiple's remainder tells every digit and '.' apart */
        for (int d = 0; d <= 10; d++) {
            const int b = d < 10 ? '0' + d : '.';
            int16_t split[256][2];
            memset(split, 0xff, sizeof split);
            int m = 0;
            for (int c = 0; c < 256; c++) {
                int16_t *t = &split[cls[c]][c == b];
                if (*t < 0) *t = (int16_t)m++;
                cls[c] = (uint8_t)*t;
            }
            n = m;
        }
    return n;
}

td_rx_id td_rx_multiple_of(td_rx *rx, uint32_t p, uint32_t k) {
    if (rx->error) return TD_RX_FAIL;
    if (!p || k > 30) {
        fail(rx, "regex: a multiple of %u at scale %u", p, k);
        return TD_RX_FAIL;
    }
    return intern(rx, (node){.kind = K_MOD, .a = p, .b = 0, .min = k, .max = NOPOINT});
}

/* ---- JSON string quoting ---- */

static bool in_set(const uint64_t s[4], unsigned b) { return s[b >> 6] >> (b & 63) & 1; }
static void set_bit(uint64_t s[4], unsigned b) { s[b >> 6] |= 1ull << (b & 63); }

/* The encodings inside a JSON string of the bytes of set: the bytes that
 * need no escape as themselves, the others as their escapes. */
static td_rx_id quote_bytes(td_rx *rx, const uint64_t set[4]) {
    static const char shorts[][2] = {{8, 'b'},  {9, 't'},   {10, 'n'},   {12, 'f'},
                                     {13, 'r'}, {'"', '"'}, {'\\', '\\'}};
    uint64_t raw[4], sh[4] = {0}, hex[2][4] = {{0}};
    memcpy(raw, set, sizeof raw);
    bool any = false, del = in_set(set, 0x7f);
    for (unsigned b = 0; b < 0x80; b++) {
        if (!in_set(set, b) || (b >= 0x20 && b != '"' && b != '\\' && b != 0x7f)) continue;
        raw[b >> 6] &= ~(1ull << (b & 63));
        any = true;
        for (size_t i = 0; i < sizeof shorts / sizeof *shorts; i++)
            if ((unsigned char)shorts[i][0] == b) set_bit(sh, (unsigned char)shorts[i][1]);
        if (b < 0x20) {
            unsigned d = b & 15;
            set_bit(hex[b >> 4], d < 10 ? '0' + d : 'a' + d - 10);
            if (d >= 10) set_bit(hex[b >> 4], 'A' + d - 10);
        }
    }
    td_rx_id r = td_rx_byteset(rx, raw);
    if (!any) return r;
    idvec alts = {0};
    bool ok = push(&alts, td_rx_byteset(rx, sh));
    for (int h = 0; h < 2 && ok; h++)
        ok = push(&alts, td_rx_concat(rx, td_rx_literal(rx, h ? "u001" : "u000", 4),
                                      td_rx_byteset(rx, hex[h])));
    if (del && ok) {
        uint64_t f[4] = {0};
        set_bit(f, 'f');
        set_bit(f, 'F');
        ok = push(&alts, td_rx_concat(rx, td_rx_literal(rx, "u007", 4), td_rx_byteset(rx, f)));
    }
    if (!ok) {
        free(alts.v);
        fail(rx, "regex: out of memory");
        return TD_RX_FAIL;
    }
    td_rx_id esc = td_rx_concat(rx, td_rx_byte_range(rx, '\\', '\\'), or_vec(rx, &alts));
    free(alts.v);
    return td_rx_or(rx, r, esc);
}

/* The quoting memo: node id -> its quoted form, open addressing. */
typedef struct {
    td_rx_id *keys, *vals; /* key + 1, 0 free */
    size_t cap, n;
} qmemo;

static td_rx_id qget(const qmemo *m, td_rx_id a) {
    for (size_t j = (a * 0x9e3779b1u) & (m->cap - 1);; j = (j + 1) & (m->cap - 1)) {
        if (!m->keys[j]) return TD_RX_FAIL;
        if (m->keys[j] == a + 1) return m->vals[j];
    }
}

static bool qput(qmemo *m, td_rx_id a, td_rx_id v) {
    if ((m->n + 1) * 2 > m->cap) {
        qmemo g = {calloc(m->cap * 2, sizeof *g.keys), malloc(m->cap * 2 * sizeof *g.vals),
                   m->cap * 2, 0};
        if (!g.keys || !g.vals) {
            free(g.keys);
            free(g.vals);
            return false;
        }
        for (size_t i = 0; i < m->cap; i++)
            if (m->keys[i]) qput(&g, m->keys[i] - 1, m->vals[i]);
        free(m->keys);
        free(m->vals);
        *m = g;
    }
    size_t j = (a * 0x9e3779b1u) & (m->cap - 1);
    while (m->keys[j]) j = (j + 1) & (m->cap - 1);
    m->keys[j] = a + 1;
    m->vals[j] = v;
    m->n++;
    return true;
}

static td_rx_id quote(td_rx *rx, td_rx_id a, qmemo *memo, int depth) {
    if (a == TD_RX_FAIL || rx->error) return TD_RX_FAIL;
    td_rx_id known = qget(memo, a);
    if (known != TD_RX_FAIL) return known;
    if (depth > rx->lim.max_depth * 4) {
        fail(rx, "regex: expression nested more than %d deep", rx->lim.max_depth * 4);
        return TD_RX_FAIL;
    }
    node x = rx->nodes[a];
    td_rx_id r = TD_RX_FAIL;
    switch (x.kind) {
    case K_NOTHING:
    case K_EMPTY:
    case K_MOD: r = a; break; /* digits and '.': nothing to escape */
    case K_BYTES: r = quote_bytes(rx, x.set); break;
    case K_STAR: r = td_rx_star(rx, quote(rx, x.a, memo, depth + 1)); break;
    case K_REPEAT: r = td_rx_repeat(rx, quote(rx, x.a, memo, depth + 1), x.min, x.max); break;
    case K_NOT: {
        /* quoting commutes with union and intersection (an encoding
         * decodes one way), not with complement: the encodings of every
         * byte string, less those of a's strings */
        uint64_t all[4] = {~0ull, ~0ull, ~0ull, ~0ull};
        td_rx_id every = td_rx_star(rx, quote_bytes(rx, all));
        r = td_rx_and(rx, every, td_rx_not(rx, quote(rx, x.a, memo, depth + 1)));
        break;
    }
    case K_CONCAT:
    case K_OR:
    case K_AND: {
        idvec parts = {0};
        td_rx_id c = a;
        for (; rx->nodes[c].kind == x.kind; c = rx->nodes[c].b)
            if (!push(&parts, quote(rx, rx->nodes[c].a, memo, depth + 1))) goto oom;
        if (!push(&parts, quote(rx, c, memo, depth + 1))) goto oom;
        if (x.kind == K_CONCAT) {
            r = parts.v[parts.n - 1];
            for (size_t i = parts.n - 1; i-- > 0;) r = td_rx_concat(rx, parts.v[i], r);
        } else {
            r = chain_vec(rx, x.kind, &parts);
        }
        free(parts.v);
        break;
    oom:
        free(parts.v);
        fail(rx, "regex: out of memory");
        return TD_RX_FAIL;
    }
    }
    if (r != TD_RX_FAIL && !qput(memo, a, r)) {
        fail(rx, "regex: out of memory");
        return TD_RX_FAIL;
    }
    return r;
}

td_rx_id td_rx_json_quote(td_rx *rx, td_rx_id a) {
    if (a == TD_RX_FAIL || rx->error) return TD_RX_FAIL;
    qmemo memo = {calloc(64, sizeof *memo.keys), malloc(64 * sizeof *memo.vals), 64, 0};
    td_rx_id q = memo.keys && memo.vals ? quote(rx, a, &memo, 0) : TD_RX_FAIL;
    if (!memo.keys || !memo.vals) fail(rx, "regex: out of memory");
    free(memo.keys);
    free(memo.vals);
    if (q == TD_RX_FAIL) return q;
    td_rx_id dq = td_rx_byte_range(rx, '"', '"');
    return td_rx_concat(rx, dq, td_rx_concat(rx, q, dq));
}

/* ---- UTF-8 ---- */

/* The encodings of [lo, hi] (all of the same length n) into v: split until
 * every byte position ranges independently, then one sequence of byte
 * ranges per piece. */
static bool utf8_split(td_rx *rx, uint32_t lo, uint32_t hi, int n, idvec *v) {
    for (int i = 1; i < n; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if (lo & m)
                return utf8_split(rx, lo, lo | m, n, v) && utf8_split(rx, (lo | m) + 1, hi, n, v);
            if ((hi & m) != m)
                return utf8_split(rx, lo, (hi & ~m) - 1, n, v) && utf8_split(rx, hi & ~m, hi, n, v);
        }
    }
    uint8_t a[4], b[4];
    td_gr_utf8_put(lo, a);
    td_gr_utf8_put(hi, b);
    td_rx_id r = TD_RX_EMPTY;
    for (int i = n; i-- > 0;) r = td_rx_concat(rx, td_rx_byte_range(rx, a[i], b[i]), r);
    return r != TD_RX_FAIL && push(v, r);
}

td_rx_id td_rx_codepoints(td_rx *rx, const uint32_t (*ranges)[2], size_t n) {
    if (rx->error) return TD_RX_FAIL;
    static const uint32_t bounds[][2] = {
        {0, 0x7F}, {0x80, 0x7FF}, {0x800, 0xD7FF}, {0xE000, 0xFFFF}, {0x10000, 0x10FFFF}};
    idvec v = {0};
    for (size_t i = 0; i < n; i++) {
        for (size_t k = 0; k < sizeof bounds / sizeof *bounds; k++) {
            uint32_t lo = ranges[i][0] > bounds[k][0] ? ranges[i][0] : bounds[k][0];
            uint32_t hi = ranges[i][1] < bounds[k][1] ? ranges[i][1] : bounds[k][1];
            if (lo > hi) continue;
            if (!utf8_split(rx, lo, hi, td_gr_utf8_len(lo), &v)) {
                free(v.v);
                if (!rx->error) fail(rx, "regex: out of memory");
                return TD_RX_FAIL;
            }
        }
    }
    td_rx_id r = or_vec(rx, &v);
    free(v.v);
    return r;
}

td_rx_id td_rx_any_char(td_rx *rx) {
    if (!rx->any_char) {
        static const uint32_t all[1][2] = {{0, 0x10FFFF}};
        td_rx_id r = td_rx_codepoints(rx, all, 1);
        if (r == TD_RX_FAIL) return r;
        rx->any_char = r;
    }
    return rx->any_char;
}

/* ---- derivatives ---- */

static bool dmemo_grow(td_rx *rx) {
    size_t ns = rx->ndslots ? rx->ndslots * 2 : 4096;
    uint64_t *k = calloc(ns, sizeof *k);
    uint32_t *v = malloc(ns * sizeof *v);
    if (!k || !v) {
        free(k);
        free(v);
        return false;
    }
    for (size_t i = 0; i < rx->ndslots; i++) {
        if (!rx->dkeys[i]) continue;
        size_t j = mix(0, rx->dkeys[i]) & (ns - 1);
        while (k[j]) j = (j + 1) & (ns - 1);
        k[j] = rx->dkeys[i];
        v[j] = rx->dvals[i];
    }
    free(rx->dkeys);
    free(rx->dvals);
    rx->dkeys = k;
    rx->dvals = v;
    rx->ndslots = ns;
    return true;
}

static td_rx_id deriv(td_rx *rx, td_rx_id a, uint8_t c, int depth);

static td_rx_id deriv_uncached(td_rx *rx, td_rx_id a, uint8_t c, int depth) {
    const node x = rx->nodes[a];
    switch (x.kind) {
    case K_MOD: {
        node y = x;
        if (c == '.') {
            if (x.max != NOPOINT) return TD_RX_NOTHING;
            y.max = 0;
        } else if (c >= '0' && c <= '9') {
            if (x.max != NOPOINT && x.max >= x.min) {
                if (c != '0') return TD_RX_NOTHING; /* past the scale: zeros only */
                return a;
            }
            y.b = (uint32_t)(((uint64_t)x.b * 10 + (uint64_t)(c - '0')) % x.a);
            if (x.max != NOPOINT) y.max++;
        } else {
            return TD_RX_NOTHING;
        }
        return intern(rx, y);
    }
    case K_NOTHING:
    case K_EMPTY: return TD_RX_NOTHING;
    case K_BYTES: return (x.set[c >> 6] >> (c & 63)) & 1 ? TD_RX_EMPTY : TD_RX_NOTHING;
    case K_STAR: return td_rx_concat(rx, deriv(rx, x.a, c, depth + 1), a);
    case K_REPEAT:
        return td_rx_concat(
            rx, deriv(rx, x.a, c, depth + 1),
            td_rx_repeat(rx, x.a, x.min ? x.min - 1 : 0, x.max == INF ? INF : x.max - 1));
    case K_NOT: return td_rx_not(rx, deriv(rx, x.a, c, depth + 1));
    case K_OR:
    case K_AND:
    case K_CONCAT: break;
    }
    idvec v = {0};
    bool ok = true;
    if (x.kind == K_OR || x.kind == K_AND) {
        for (td_rx_id cur = a;; cur = rx->nodes[cur].b) {
            bool last = rx->nodes[cur].kind != x.kind;
            ok = push(&v, deriv(rx, last ? cur : rx->nodes[cur].a, c, depth + 1));
            if (last || !ok) break;
        }
    } else { /* the chain's heads while they are nullable */
        td_rx_id cur = a;
        for (;;) {
            if (rx->nodes[cur].kind != K_CONCAT) {
                ok = push(&v, deriv(rx, cur, c, depth + 1));
                break;
            }
            const td_rx_id h = rx->nodes[cur].a, t = rx->nodes[cur].b;
            ok = push(&v, td_rx_concat(rx, deriv(rx, h, c, depth + 1), t));
            if (!ok || !rx->nodes[h].nullable) break;
            cur = t;
        }
    }
    if (!ok) {
        free(v.v);
        fail(rx, "regex: out of memory");
        return TD_RX_FAIL;
    }
    td_rx_id r = chain_vec(rx, x.kind == K_AND ? K_AND : K_OR, &v);
    free(v.v);
    return r;
}

static td_rx_id deriv(td_rx *rx, td_rx_id a, uint8_t c, int depth) {
    if (a == TD_RX_FAIL || !step(rx)) return TD_RX_FAIL;
    if (a <= TD_RX_EMPTY) return TD_RX_NOTHING;
    if (depth > 4 * rx->lim.max_depth + 64) {
        fail(rx, "regex: expression nested deeper than %d", 4 * rx->lim.max_depth + 64);
        return TD_RX_FAIL;
    }
    const uint64_t key = (((uint64_t)a << 8) | c) + 1;
    if (rx->ndslots) {
        size_t j = mix(0, key) & (rx->ndslots - 1);
        while (rx->dkeys[j]) {
            if (rx->dkeys[j] == key) return rx->dvals[j];
            j = (j + 1) & (rx->ndslots - 1);
        }
    }
    const td_rx_id r = deriv_uncached(rx, a, c, depth);
    if (r == TD_RX_FAIL) return r;
    if ((rx->ndused + 1) * 2 > rx->ndslots && !dmemo_grow(rx)) {
        fail(rx, "regex: out of memory");
        return TD_RX_FAIL;
    }
    size_t j = mix(0, key) & (rx->ndslots - 1);
    while (rx->dkeys[j]) j = (j + 1) & (rx->ndslots - 1);
    rx->dkeys[j] = key;
    rx->dvals[j] = r;
    rx->ndused++;
    return r;
}

td_rx_id td_rx_deriv(td_rx *rx, td_rx_id a, uint8_t b) { return deriv(rx, a, b, 0); }

/* td_rx_same_deriv's walk over the nodes deriv(a, c) reads, in deriv's
 * order. false past the budget. */
static bool same_walk(const td_rx *rx, td_rx_id a, uint8_t c, uint64_t same[4], int *budget) {
    if (a <= TD_RX_EMPTY || a >= rx->n) return true;
    if (--*budget < 0) return false;
    const node *x = &rx->nodes[a];
    switch (x->kind) {
    case K_NOTHING:
    case K_EMPTY: return true;
    case K_MOD: { /* each digit and '.' alone; the other bytes alike */
        uint64_t num[4] = {0x03ff400000000000ull, 0, 0, 0};
        if (num[c >> 6] >> (c & 63) & 1) {
            memset(num, 0, sizeof num);
            num[c >> 6] = 1ull << (c & 63);
            for (int w = 0; w < 4; w++) same[w] &= num[w];
        } else {
            for (int w = 0; w < 4; w++) same[w] &= ~num[w];
        }
        return true;
    }
    case K_BYTES: {
        const bool in = x->set[c >> 6] >> (c & 63) & 1;
        for (int w = 0; w < 4; w++) same[w] &= in ? x->set[w] : ~x->set[w];
        return true;
    }
    case K_STAR:
    case K_REPEAT:
    case K_NOT: return same_walk(rx, x->a, c, same, budget);
    case K_OR:
    case K_AND:
        for (td_rx_id cur = a;; cur = rx->nodes[cur].b) {
            const bool last = rx->nodes[cur].kind != x->kind;
            if (!same_walk(rx, last ? cur : rx->nodes[cur].a, c, same, budget)) return false;
            if (last) return true;
        }
    default: /* a concatenation: the chain's heads while they are nullable */
        for (td_rx_id cur = a;;) {
            if (rx->nodes[cur].kind != K_CONCAT) return same_walk(rx, cur, c, same, budget);
            const td_rx_id h = rx->nodes[cur].a;
            if (!same_walk(rx, h, c, same, budget)) return false;
            if (!rx->nodes[h].nullable) return true;
            cur = rx->nodes[cur].b;
        }
    }
}

void td_rx_same_deriv(const td_rx *rx, td_rx_id a, uint8_t b, uint64_t same[4]) {
    int budget = 1024;
    if (same_walk(rx, a, b, same, &budget)) return;
    const uint64_t keep = same[b >> 6] & 1ull << (b & 63);
    memset(same, 0, 4 * sizeof *same);
    same[b >> 6] = keep;
}

#define EMPTY_SEARCH 256 /* derivatives searched for a match at most */

bool td_rx_is_empty(td_rx *rx, td_rx_id a) {
    if (a == TD_RX_NOTHING) return true;
    if (a == TD_RX_FAIL || rx->error || a >= rx->n) return false;
    const node *x = &rx->nodes[a];
    if (x->nullable || !x->complex) return false; /* a simple expression matches something */
    if (x->empty) return x->empty == 1;
    /* search the derivatives for one that matches the empty string (or is
     * simple and so matches something) */
    if (!rx->nreps || rx->sets_at_classes != rx->nsets) {
        uint8_t cls[256];
        td_rx_byte_classes(rx, cls);
        bool seen[256] = {false};
        rx->nreps = 0;
        for (int b = 0; b < 256; b++)
            if (!seen[cls[b]]) {
                seen[cls[b]] = true;
                rx->reps[rx->nreps++] = (uint8_t)b;
            }
        rx->sets_at_classes = rx->nsets;
    }
    td_rx_id q[EMPTY_SEARCH];
    size_t nq = 0, head = 0;
    bool found = false, cut = false;
    q[nq++] = a;
    while (head < nq && !found && !cut) {
        const td_rx_id u = q[head++];
        for (int r = 0; r < rx->nreps && !found; r++) {
            const td_rx_id d = deriv(rx, u, rx->reps[r], 0);
            if (d == TD_RX_FAIL) return false;
            if (d == TD_RX_NOTHING) continue;
            const node *y = &rx->nodes[d];
            if (y->nullable || !y->complex || y->empty == 2) {
                found = true;
                break;
            }
            if (y->empty == 1) continue;
            bool seen = false;
            for (size_t i = 0; i < nq && !seen; i++) seen = q[i] == d;
            if (seen) continue;
            if (nq == EMPTY_SEARCH) {
                cut = true; /* undecided: taken as not empty */
                break;
            }
            q[nq++] = d;
        }
    }
    if (cut && !found) return false;
    /* every node searched shares the verdict: the searched ones reach a
     * match when a does not... only a's own verdict is sure either way */
    if (!found)
        for (size_t i = 0; i < nq; i++) rx->nodes[q[i]].empty = 1;
    else
        rx->nodes[a].empty = 2;
    return !found;
}

bool td_rx_match(td_rx *rx, td_rx_id a, const void *s, size_t n) {
    const uint8_t *p = s;
    for (size_t i = 0; i < n && a != TD_RX_NOTHING; i++) a = td_rx_deriv(rx, a, p[i]);
    return td_rx_nullable(rx, a);
}

/* ---- the ECMAScript pattern parser ---- */

typedef struct {
    td_rx *rx;
    const char *s;
    size_t n, i;
    int depth;
    unsigned flags; /* TD_RX_ICASE, TD_RX_DOTALL */
    char *err;
    size_t errlen;
    bool failed;
} parser;

typedef struct {
    uint32_t (*r)[2];
    size_t n, cap;
} ranges;

static void perr(parser *p, size_t at, const char *fmt, ...) {
    if (p->failed) return;
    p->failed = true;
    char msg[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (p->err && p->errlen) snprintf(p->err, p->errlen, "regex: %s at offset %zu", msg, at);
}

static bool add_range(parser *p, ranges *r, uint32_t lo, uint32_t hi) {
    if (r->n == r->cap) {
        size_t nc = r->cap ? r->cap * 2 : 16;
        uint32_t(*nr)[2] = realloc(r->r, nc * sizeof *nr);
        if (!nr) {
            perr(p, p->i, "out of memory");
            return false;
        }
        r->r = nr;
        r->cap = nc;
    }
    r->r[r->n][0] = lo;
    r->r[r->n][1] = hi;
    r->n++;
    return true;
}

static int cmp_range(const void *x, const void *y) {
    const uint32_t *a = x, *b = y;
    return a[0] < b[0] ? -1 : a[0] > b[0];
}

/* r's complement within the code points (sorted and merged first). */
static bool negate(parser *p, ranges *r) {
    if (r->n) qsort(r->r, r->n, sizeof *r->r, cmp_range);
    ranges out = {0};
    uint32_t next = 0;
    bool ok = true;
    for (size_t i = 0; i < r->n && ok; i++) {
        if (r->r[i][0] > next) ok = add_range(p, &out, next, r->r[i][0] - 1);
        if (r->r[i][1] + 1 > next) next = r->r[i][1] + 1;
    }
    if (ok && next <= 0x10FFFF) ok = add_range(p, &out, next, 0x10FFFF);
    free(r->r);
    *r = out;
    return ok;
}

/* Under TD_RX_ICASE only ASCII code points may be written (cp at at). */
static bool icase_ok(parser *p, uint32_t cp, size_t at) {
    if (!(p->flags & TD_RX_ICASE) || cp < 0x80) return true;
    perr(p, at, "a case-insensitive pattern (flag i) must be ASCII");
    return false;
}

/* The next code point of the pattern (UTF-8); malformed bytes are an error. */
static bool next_cp(parser *p, uint32_t *cp) {
    const uint8_t *s = (const uint8_t *)p->s;
    size_t i = p->i;
    uint8_t c = s[i];
    int n = c < 0x80             ? 1
            : (c & 0xE0) == 0xC0 ? 2
            : (c & 0xF0) == 0xE0 ? 3
            : (c & 0xF8) == 0xF0 ? 4
                                 : 0;
    if (!n || i + (size_t)n > p->n) {
        perr(p, i, "malformed UTF-8 in the pattern");
        return false;
    }
    uint32_t v = n == 1 ? c : (uint32_t)(c & (0x7F >> n));
    for (int k = 1; k < n; k++) {
        if ((s[i + k] & 0xC0) != 0x80) {
            perr(p, i, "malformed UTF-8 in the pattern");
            return false;
        }
        v = (v << 6) | (s[i + k] & 0x3F);
    }
    if (td_gr_utf8_len(v) != n || (v >= 0xD800 && v <= 0xDFFF) || v > 0x10FFFF) {
        perr(p, i, "malformed UTF-8 in the pattern");
        return false;
    }
    if (!icase_ok(p, v, i)) return false;
    p->i += (size_t)n;
    *cp = v;
    return true;
}

/* Under TD_RX_ICASE: the ASCII letters of r in the other case too, and
 * the two code points Unicode's simple case folding maps to ASCII letters
 * (U+212A KELVIN SIGN to k, U+017F LONG S to s), as ECMAScript's /iu and
 * Rust's (?i) match them. */
static bool fold_ranges(parser *p, ranges *r) {
    if (!(p->flags & TD_RX_ICASE)) return true;
    const size_t n = r->n;
    bool k = false, s = false;
    for (size_t i = 0; i < n; i++) {
        uint32_t lo = r->r[i][0] > 'A' ? r->r[i][0] : 'A', hi = r->r[i][1] < 'Z' ? r->r[i][1] : 'Z';
        if (lo <= hi && !add_range(p, r, lo + 32, hi + 32)) return false;
        lo = r->r[i][0] > 'a' ? r->r[i][0] : 'a', hi = r->r[i][1] < 'z' ? r->r[i][1] : 'z';
        if (lo <= hi && !add_range(p, r, lo - 32, hi - 32)) return false;
    }
    for (size_t i = 0; i < r->n; i++) {
        k |= r->r[i][0] <= 'k' && 'k' <= r->r[i][1];
        s |= r->r[i][0] <= 's' && 's' <= r->r[i][1];
    }
    return (!k || add_range(p, r, 0x212A, 0x212A)) && (!s || add_range(p, r, 0x17F, 0x17F));
}

/* n hex digits at p->i. */
static bool hex_digits(parser *p, int n, uint32_t *v) {
    *v = 0;
    for (int k = 0; k < n; k++) {
        int h = p->i < p->n ? td_gr_hexval(p->s[p->i]) : -1;
        if (h < 0) {
            perr(p, p->i, "expected %d hex digits", n);
            return false;
        }
        *v = *v * 16 + (uint32_t)h;
        p->i++;
    }
    return true;
}

/* The class escapes \d \w \s (ECMAScript's sets; \s is Unicode white space
 * and line terminators) as ranges; negated for \D \W \S. */
static bool class_escape(parser *p, char e, ranges *r) {
    static const uint32_t dg[][2] = {{'0', '9'}};
    static const uint32_t wd[][2] = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
    static const uint32_t sp[][2] = {
        {0x09, 0x0D},     {0x20, 0x20},     {0xA0, 0xA0},     {0x1680, 0x1680}, {0x2000, 0x200A},
        {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000}, {0xFEFF, 0xFEFF}};
    const uint32_t(*set)[2];
    size_t n;
    switch (e | 0x20) {
    case 'd': set = dg, n = 1; break;
    case 'w': set = wd, n = 4; break;
    default: set = sp, n = sizeof sp / sizeof *sp; break;
    }
    ranges t = {0};
    for (size_t k = 0; k < n; k++)
        if (!add_range(p, &t, set[k][0], set[k][1])) {
            free(t.r);
            return false;
        }
    bool ok = (e >= 'a' || negate(p, &t));
    for (size_t k = 0; ok && k < t.n; k++) ok = add_range(p, r, t.r[k][0], t.r[k][1]);
    free(t.r);
    return ok;
}

/* An escape after '\' (p->i past the backslash): a code point in *cp
 * (return 1), or a class added to cls (return 2), or an error (0). In a
 * class [\b] is backspace and '-' may be escaped. */
static int escape(parser *p, bool in_class, uint32_t *cp, ranges *cls) {
    if (p->i >= p->n) {
        perr(p, p->i - 1, "trailing backslash");
        return 0;
    }
    const size_t at = p->i - 1;
    const char e = p->s[p->i++];
    switch (e) {
    case 'd':
    case 'D':
    case 'w':
    case 'W':
    case 's':
    case 'S': return class_escape(p, e, cls) ? 2 : 0;
    case 't': *cp = '\t'; return 1;
    case 'n': *cp = '\n'; return 1;
    case 'r': *cp = '\r'; return 1;
    case 'v': *cp = '\v'; return 1;
    case 'f': *cp = '\f'; return 1;
    case '0':
        if (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') break;
        *cp = 0;
        return 1;
    case 'c':
        if (p->i < p->n && ((p->s[p->i] | 0x20) >= 'a' && (p->s[p->i] | 0x20) <= 'z')) {
            *cp = (uint32_t)(p->s[p->i++] % 32);
            return 1;
        }
        break;
    case 'x': return hex_digits(p, 2, cp) ? 1 : 0;
    case 'u': {
        if (p->i < p->n && p->s[p->i] == '{') {
            p->i++;
            uint32_t v = 0;
            int nd = 0;
            while (p->i < p->n && td_gr_hexval(p->s[p->i]) >= 0 && nd < 8) {
                v = v * 16 + (uint32_t)td_gr_hexval(p->s[p->i++]);
                nd++;
            }
            if (!nd || p->i >= p->n || p->s[p->i] != '}' || v > 0x10FFFF) {
                perr(p, at, "malformed \\u{...} escape");
                return 0;
            }
            p->i++;
            *cp = v;
        } else {
            if (!hex_digits(p, 4, cp)) return 0;
            /* a surrogate pair written as two escapes */
            if (*cp >= 0xD800 && *cp <= 0xDBFF && p->i + 6 <= p->n && p->s[p->i] == '\\' &&
                p->s[p->i + 1] == 'u') {
                size_t save = p->i;
                uint32_t lo;
                p->i += 2;
                if (hex_digits(p, 4, &lo) && lo >= 0xDC00 && lo <= 0xDFFF) {
                    *cp = 0x10000 + ((*cp - 0xD800) << 10) + (lo - 0xDC00);
                    return 1;
                }
                p->failed = false;
                p->i = save;
            }
        }
        if (*cp >= 0xD800 && *cp <= 0xDFFF) {
            perr(p, at, "a lone surrogate \\u%04X matches no UTF-8 text", *cp);
            return 0;
        }
        return 1;
    }
    case 'b':
        if (in_class) {
            *cp = 8;
            return 1;
        }
        perr(p, at, "the word-boundary assertion \\b is not supported");
        return 0;
    case 'B': perr(p, at, "the assertion \\B is not supported"); return 0;
    case 'p':
    case 'P': perr(p, at, "Unicode property escapes \\%c{...} are not supported", e); return 0;
    case 'k': perr(p, at, "named backreferences are not supported"); return 0;
    default:
        if (e >= '1' && e <= '9') {
            perr(p, at, "backreferences are not supported");
            return 0;
        }
        if (strchr("^$\\.*+?()[]{}|/-", e)) {
            *cp = (uint32_t)(unsigned char)e;
            return 1;
        }
        /* other identity escapes of ECMAScript's Annex B: the character */
        p->i--;
        return next_cp(p, cp) ? 1 : 0;
    }
    perr(p, at, "unsupported escape \\%c", e);
    return 0;
}

static td_rx_id ranges_rx(parser *p, ranges *r) {
    td_rx_id x = td_rx_codepoints(p->rx, (const uint32_t(*)[2])r->r, r->n);
    free(r->r);
    r->r = NULL;
    return x;
}

/* A class [...] (p->i past '['). */
static td_rx_id parse_class(parser *p) {
    const size_t at = p->i - 1;
    bool neg = p->i < p->n && p->s[p->i] == '^';
    if (neg) p->i++;
    ranges r = {0};
    while (!p->failed) {
        if (p->i >= p->n) {
            perr(p, at, "unterminated character class");
            break;
        }
        if (p->s[p->i] == ']') {
            p->i++;
            break;
        }
        uint32_t lo;
        int k;
        if (p->s[p->i] == '\\') {
            p->i++;
            k = escape(p, true, &lo, &r);
        } else {
            k = next_cp(p, &lo) ? 1 : 0;
        }
        if (k == 1 && !icase_ok(p, lo, p->i)) break;
        if (k == 2 && p->i + 1 < p->n && p->s[p->i] == '-' && p->s[p->i + 1] != ']') {
            perr(p, p->i, "a class escape cannot start a range");
            break;
        }
        if (k != 1) continue; /* a class escape (added) or an error */
        uint32_t hi = lo;
        if (p->i + 1 < p->n && p->s[p->i] == '-' && p->s[p->i + 1] != ']') {
            const size_t dash = p->i++;
            int k2;
            ranges dummy = {0};
            if (p->s[p->i] == '\\') {
                p->i++;
                k2 = escape(p, true, &hi, &dummy);
            } else {
                k2 = next_cp(p, &hi) ? 1 : 0;
            }
            free(dummy.r);
            if (k2 == 2) {
                perr(p, dash, "a class escape cannot end a range");
                break;
            }
            if (!k2 || !icase_ok(p, hi, dash)) break;
            if (hi < lo) {
                perr(p, dash, "range out of order in character class");
                break;
            }
        }
        if (!add_range(p, &r, lo, hi)) break;
    }
    if (p->failed) {
        free(r.r);
        return TD_RX_FAIL;
    }
    if (!fold_ranges(p, &r) || (neg && !negate(p, &r))) {
        free(r.r);
        return TD_RX_FAIL;
    }
    return ranges_rx(p, &r);
}

static td_rx_id parse_alt(parser *p);

/* A decimal count of a {n,m} quantifier; false if there is none. */
static bool count(parser *p, uint32_t *v) {
    size_t st = p->i;
    uint64_t x = 0;
    while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') {
        if (x < 1000000000) x = x * 10 + (uint64_t)(p->s[p->i] - '0');
        p->i++;
    }
    *v = x > UINT32_MAX - 1 ? UINT32_MAX - 1 : (uint32_t)x;
    return p->i > st;
}

/* A {n}, {n,} or {n,m} at p->i (on '{'): true with the bounds, or false
 * with p->i unchanged when the brace is a literal (Annex B). */
static bool braces(parser *p, uint32_t *mn, uint32_t *mx) {
    size_t save = p->i;
    p->i++;
    if (!count(p, mn)) goto literal;
    *mx = *mn;
    if (p->i < p->n && p->s[p->i] == ',') {
        p->i++;
        if (!count(p, mx)) *mx = INF;
    }
    if (p->i >= p->n || p->s[p->i] != '}') goto literal;
    p->i++;
    return true;
literal:
    p->i = save;
    return false;
}

static td_rx_id parse_atom(parser *p) {
    const size_t at = p->i;
    const char c = p->s[p->i];
    if (c == '(') {
        p->i++;
        if (p->i < p->n && p->s[p->i] == '?') {
            const char k = p->i + 1 < p->n ? p->s[p->i + 1] : 0;
            if (k == ':') {
                p->i += 2;
            } else if (k == '<' && p->i + 2 < p->n && p->s[p->i + 2] != '=' &&
                       p->s[p->i + 2] != '!') { /* a named group: as any group */
                const char *end = memchr(p->s + p->i, '>', p->n - p->i);
                if (!end) {
                    perr(p, at, "unterminated group name");
                    return TD_RX_FAIL;
                }
                p->i = (size_t)(end - p->s) + 1;
            } else {
                perr(p, at, "lookaround and other (?...) groups are not supported");
                return TD_RX_FAIL;
            }
        }
        if (++p->depth > p->rx->lim.max_depth) {
            perr(p, at, "groups nested deeper than %d", p->rx->lim.max_depth);
            return TD_RX_FAIL;
        }
        td_rx_id r = parse_alt(p);
        p->depth--;
        if (p->failed) return TD_RX_FAIL;
        if (p->i >= p->n || p->s[p->i] != ')') {
            perr(p, at, "unbalanced parenthesis");
            return TD_RX_FAIL;
        }
        p->i++;
        return r;
    }
    if (c == '[') {
        p->i++;
        return parse_class(p);
    }
    if (c == '.') { /* any code point but the line terminators (flag s: any) */
        p->i++;
        static const uint32_t dot[][2] = {{0, 9}, {11, 12}, {14, 0x2027}, {0x202A, 0x10FFFF}};
        if (p->flags & TD_RX_DOTALL) return td_rx_any_char(p->rx);
        return td_rx_codepoints(p->rx, dot, 4);
    }
    if (c == '^' || c == '$') {
        perr(p, at, "the anchor %c is only supported at the start (^) or end ($) of the pattern",
             c);
        return TD_RX_FAIL;
    }
    if (c == '*' || c == '+' || c == '?') {
        perr(p, at, "nothing to repeat");
        return TD_RX_FAIL;
    }
    uint32_t cp;
    if (c == '\\') {
        p->i++;
        ranges r = {0};
        int k = escape(p, false, &cp, &r);
        if (k == 2 && !fold_ranges(p, &r)) {
            free(r.r);
            return TD_RX_FAIL;
        }
        if (k == 2) return ranges_rx(p, &r);
        free(r.r);
        if (!k || !icase_ok(p, cp, at)) return TD_RX_FAIL;
    } else if (!next_cp(p, &cp)) {
        return TD_RX_FAIL;
    }
    if ((p->flags & TD_RX_ICASE) && cp < 0x80 && ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z')) {
        ranges f = {0};
        if (!add_range(p, &f, cp, cp) || !fold_ranges(p, &f)) {
            free(f.r);
            return TD_RX_FAIL;
        }
        return ranges_rx(p, &f);
    }
    uint8_t b[4];
    const int n = td_gr_utf8_put(cp, b);
    return td_rx_literal(p->rx, b, (size_t)n);
}

static td_rx_id parse_concat(parser *p) {
    td_rx_id r = TD_RX_EMPTY;
    idvec items = {0};
    while (!p->failed && p->i < p->n && p->s[p->i] != '|' && p->s[p->i] != ')') {
        /* the anchors td_rx_parse stripped leave none here; '$' at the very
         * end was removed too */
        td_rx_id a = parse_atom(p);
        if (p->failed || a == TD_RX_FAIL) break;
        for (;;) { /* quantifiers (a second one is an error, as in ECMAScript) */
            if (p->i >= p->n) break;
            const size_t qat = p->i;
            const char q = p->s[p->i];
            uint32_t mn, mx;
            if (q == '*')
                mn = 0, mx = INF, p->i++;
            else if (q == '+')
                mn = 1, mx = INF, p->i++;
            else if (q == '?')
                mn = 0, mx = 1, p->i++;
            else if (q == '{' && braces(p, &mn, &mx)) {
                if (mx != INF && mx < mn) {
                    perr(p, qat, "numbers out of order in {} quantifier");
                    break;
                }
                if (mn > p->rx->lim.max_repeat || (mx != INF && mx > p->rx->lim.max_repeat)) {
                    perr(p, qat, "a repetition count above %u", p->rx->lim.max_repeat);
                    break;
                }
            } else
                break;
            if (p->i < p->n && p->s[p->i] == '?') p->i++; /* lazy: the same language */
            a = td_rx_repeat(p->rx, a, mn, mx);
            if (p->i < p->n && (p->s[p->i] == '*' || p->s[p->i] == '+' || p->s[p->i] == '?' ||
                                (p->s[p->i] == '{' && braces(p, &mn, &mx)))) {
                perr(p, p->i, "nothing to repeat");
                break;
            }
            break;
        }
        if (p->failed || !push(&items, a)) break;
    }
    if (p->failed) {
        free(items.v);
        return TD_RX_FAIL;
    }
    for (size_t k = items.n; k-- > 0 && r != TD_RX_FAIL;) r = td_rx_concat(p->rx, items.v[k], r);
    free(items.v);
    return r;
}

static td_rx_id parse_alt(parser *p) {
    idvec alts = {0};
    for (;;) {
        td_rx_id a = parse_concat(p);
        if (p->failed || a == TD_RX_FAIL || !push(&alts, a)) break;
        if (p->i < p->n && p->s[p->i] == '|') {
            p->i++;
            continue;
        }
        break;
    }
    td_rx_id r = p->failed ? TD_RX_FAIL : or_vec(p->rx, &alts);
    free(alts.v);
    return r;
}

int td_rx_parse(td_rx *rx, const char *pattern, size_t n, unsigned flags, td_rx_id *out, char *err,
                size_t errlen) {
    parser p = {.rx = rx, .s = pattern, .n = n, .flags = flags, .err = err, .errlen = errlen};
    if (err && errlen) err[0] = 0;
    if (rx->error) {
        if (err && errlen) snprintf(err, errlen, "%s", rx->error);
        return -1;
    }
    /* the anchors: a leading ^ and a trailing unescaped $ */
    bool start = n > 0 && pattern[0] == '^';
    bool end = false;
    if (n > (size_t)start && pattern[n - 1] == '$') {
        size_t bs = 0;
        while (bs + 1 < n && pattern[n - 2 - bs] == '\\') bs++;
        end = bs % 2 == 0;
    }
    p.i = start;
    p.n = n - end;
    td_rx_id r = parse_alt(&p);
    if (!p.failed && p.i < p.n) perr(&p, p.i, "unbalanced parenthesis");
    if (!p.failed && r == TD_RX_FAIL) perr(&p, p.i, "%s", rx->error ? rx->error : "limit");
    if (!p.failed && (flags & TD_RX_SEARCH)) {
        td_rx_id any = td_rx_star(rx, td_rx_any_char(rx));
        if (!start) r = td_rx_concat(rx, any, r);
        if (!end) r = td_rx_concat(rx, r, any);
        if (r == TD_RX_FAIL) perr(&p, 0, "%s", rx->error ? rx->error : "limit");
    }
    if (p.failed) return -1;
    *out = r;
    return 0;
}
