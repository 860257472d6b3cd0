/* Context-free grammars over lexemes and their matcher (grammar.h). */
#include "common/grammar/grammar.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/grammar/util.h"

#define NONE     UINT32_MAX
#define UNKNOWN  (UINT32_MAX - 1)
#define LEX_DEAD 0u /* the lexer state with no live lexeme */
#define BAD_SYM  UINT32_MAX

typedef struct {
    char *name;
    bool is_lex, nullable;
    uint32_t lex;    /* lexeme: its index among the lexemes */
    td_rx_id re;     /* lexeme: its expression */
    uint32_t r0, nr; /* nonterminal: its rules in by_lhs (after finish) */
} sym;

typedef struct {
    uint32_t lhs, off, len;
} rule;

typedef struct {
    uint32_t lex;
    td_rx_id node;
} lpair;

typedef struct {
    uint32_t off, n;        /* pairs, sorted by lexeme */
    uint32_t acc_off, nacc; /* the lexemes that end here (nullable nodes) */
    uint32_t *trans;        /* 256 next states, UNKNOWN until computed */
} lstate;

struct td_gram {
    td_gram_limits lim;
    td_rx *rx;
    sym *syms;
    size_t nsyms, csyms;
    uint32_t nlex;
    rule *rules;
    size_t nrules, crules;
    uint32_t *rhs;
    size_t nrhs, crhs;
    uint32_t *by_lhs;   /* rule ids grouped by left side */
    td_gram_sym ignore; /* td_gram_ignore's lexeme (BAD_SYM: none) */
    bool finished;
    uint32_t start_rule;
    /* the lexer's DFA */
    lstate *ls;
    size_t nls, cls;
    lpair *pairs;
    size_t npairs, cpairs;
    uint32_t *accs;
    size_t naccs, caccs;
    uint32_t *lslots; /* hash-consing of states: id + 1 */
    size_t nlslots;
    /* bytes no lexeme tells apart (after finish): a transition computed
     * for one byte is every byte's of its class */
    uint8_t bclass[256];
    uint8_t cls_next[256];  /* the next byte of the same class, in a ring */
    uint8_t cls_rep[256];   /* the first byte of each class */
    uint16_t cls_size[256]; /* per class (bclass), its bytes */
    uint32_t ncls;
    /* per state of the UTF-8 decoder (utf8_next), one byte of each class
     * that the decoder does not tell apart either, among the bytes a
     * string body may hold there, with the decoder's next state */
    struct body_rep_s {
        uint8_t byte, done;
        int8_t next;
    } body_reps[8][256];
    uint16_t nbody_reps[8];
    /* td_gm_walk's cache, per lexer state, for one trie */
    const void *lcache_trie;
    struct lcache_s *lcache;
    size_t nlcache, lcache_used;
    const char *error;
    char errbuf[200];
};

td_gram_limits td_gram_default_limits(void) {
    return (td_gram_limits){.max_lexemes = 10000,
                            .max_rules = 100000,
                            .max_lexer_states = 50000,
                            .max_items_set = 100000,
                            .max_items = 50000000,
                            .rx = td_rx_default_limits()};
}

static void gfail(td_gram *g, const char *fmt, ...) {
    if (g->error) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g->errbuf, sizeof g->errbuf, fmt, ap);
    va_end(ap);
    g->error = g->errbuf;
}

static uint32_t intern_lstate(td_gram *g, const lpair *p, uint32_t n);
static int utf8_next(int u, uint8_t b, bool *done);

td_gram *td_gram_new(const td_gram_limits *lim) {
    td_gram *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    g->lim = lim ? *lim : td_gram_default_limits();
    g->ignore = BAD_SYM;
    g->rx = td_rx_new(&g->lim.rx);
    if (!g->rx || intern_lstate(g, NULL, 0) != LEX_DEAD) {
        td_gram_free(g);
        return NULL;
    }
    return g;
}

static void lcache_clear(td_gram *g);

void td_gram_free(td_gram *g) {
    if (!g) return;
    lcache_clear(g);
    for (size_t i = 0; i < g->nsyms; i++) free(g->syms[i].name);
    for (size_t i = 0; i < g->nls; i++) free(g->ls[i].trans);
    free(g->syms);
    free(g->rules);
    free(g->rhs);
    free(g->by_lhs);
    free(g->ls);
    free(g->pairs);
    free(g->accs);
    free(g->lslots);
    td_rx_free(g->rx);
    free(g);
}

td_rx *td_gram_rx(td_gram *g) { return g->rx; }
const char *td_gram_error(const td_gram *g) { return g->error; }
size_t td_gram_lexeme_count(const td_gram *g) { return g->nlex; }
size_t td_gram_rule_count(const td_gram *g) { return g->nrules; }
const char *td_gram_sym_name(const td_gram *g, td_gram_sym s) {
    return s < g->nsyms ? g->syms[s].name : "?";
}

static td_gram_sym add_sym(td_gram *g, const char *name, bool is_lex) {
    if (g->error) return BAD_SYM;
    if (g->finished) {
        gfail(g, "grammar: symbol %s added after the grammar was finished", name);
        return BAD_SYM;
    }
    char *nm = strdup(name ? name : "");
    if (!nm || !td_gr_reserve((void **)&g->syms, &g->csyms, g->nsyms, sizeof *g->syms)) {
        free(nm);
        gfail(g, "grammar: out of memory");
        return BAD_SYM;
    }
    g->syms[g->nsyms] = (sym){.name = nm, .is_lex = is_lex};
    return (td_gram_sym)g->nsyms++;
}

td_gram_sym td_gram_lexeme(td_gram *g, td_rx_id re, const char *name) {
    if (re == TD_RX_FAIL) {
        gfail(g, "grammar: lexeme %s: %s", name, td_rx_error(g->rx) ? td_rx_error(g->rx) : "limit");
        return BAD_SYM;
    }
    if (re == TD_RX_NOTHING || td_rx_nullable(g->rx, re)) {
        gfail(g, "grammar: lexeme %s matches %s", name,
              re == TD_RX_NOTHING ? "nothing" : "the empty string");
        return BAD_SYM;
    }
    if (g->nlex >= g->lim.max_lexemes) {
        gfail(g, "grammar: more than %u lexemes", g->lim.max_lexemes);
        return BAD_SYM;
    }
    td_gram_sym s = add_sym(g, name, true);
    if (s == BAD_SYM) return s;
    g->syms[s].lex = g->nlex++;
    g->syms[s].re = re;
    return s;
}

td_gram_sym td_gram_nonterm(td_gram *g, const char *name) { return add_sym(g, name, false); }

int td_gram_ignore(td_gram *g, td_rx_id re) {
    if (g->error) return -1;
    if (g->ignore != BAD_SYM) {
        gfail(g, "grammar: the ignored text is set twice");
        return -1;
    }
    g->ignore = td_gram_lexeme(g, re, "%ignore");
    return g->ignore == BAD_SYM ? -1 : 0;
}

int td_gram_rule(td_gram *g, td_gram_sym lhs, const td_gram_sym *rhs, size_t n) {
    if (g->error) return -1;
    if (g->finished || lhs >= g->nsyms || g->syms[lhs].is_lex) {
        gfail(g, "grammar: a rule for %s", g->finished ? "a finished grammar" : "a lexeme");
        return -1;
    }
    if (g->nrules >= g->lim.max_rules) {
        gfail(g, "grammar: more than %u rules", g->lim.max_rules);
        return -1;
    }
    for (size_t i = 0; i < n; i++)
        if (rhs[i] >= g->nsyms) {
            gfail(g, "grammar: rule for %s names an unknown symbol", g->syms[lhs].name);
            return -1;
        }
    if (!td_gr_reserve((void **)&g->rules, &g->crules, g->nrules, sizeof *g->rules)) goto oom;
    while (g->nrhs + n >= g->crhs)
        if (!td_gr_reserve((void **)&g->rhs, &g->crhs, g->crhs, sizeof *g->rhs)) goto oom;
    if (n) memcpy(g->rhs + g->nrhs, rhs, n * sizeof *rhs);
    g->rules[g->nrules++] = (rule){.lhs = lhs, .off = (uint32_t)g->nrhs, .len = (uint32_t)n};
    g->nrhs += n;
    return 0;
oom:
    gfail(g, "grammar: out of memory");
    return -1;
}

int td_gram_finish(td_gram *g, td_gram_sym start) {
    if (g->error) return -1;
    if (start >= g->nsyms || g->syms[start].is_lex) {
        gfail(g, "grammar: the start symbol is not a nonterminal");
        return -1;
    }
    /* the augmented start S' -> start */
    td_gram_sym top = td_gram_nonterm(g, "start'");
    if (top == BAD_SYM || td_gram_rule(g, top, &start, 1)) return -1;
    g->start_rule = (uint32_t)g->nrules - 1;
    g->finished = true;
    /* the byte classes, as rings */
    td_rx_byte_classes(g->rx, g->bclass);
    {
        int last[256];
        for (int c = 0; c < 256; c++) last[c] = -1;
        int first[256];
        for (int b = 0; b < 256; b++) {
            const int c = g->bclass[b];
            if (last[c] < 0)
                first[c] = b;
            else
                g->cls_next[last[c]] = (uint8_t)b;
            last[c] = b;
        }
        for (int c = 0; c < 256; c++)
            if (last[c] >= 0) g->cls_next[last[c]] = (uint8_t)first[c];
        for (int b = 0; b < 256; b++) {
            if (!g->cls_size[g->bclass[b]]++) g->cls_rep[g->ncls++] = (uint8_t)b;
        }
        for (int u = 0; u < 8; u++) {
            uint16_t sig[256];
            for (int b = 0; b < 256; b++) {
                bool done;
                const int n = utf8_next(u, (uint8_t)b, &done);
                sig[b] = (uint16_t)(g->bclass[b] << 8 | (n + 1) << 1 | done);
                int j = 0;
                while (j < b && sig[j] != sig[b]) j++;
                if (n >= 0 && j == b)
                    g->body_reps[u][g->nbody_reps[u]++] =
                        (struct body_rep_s){(uint8_t)b, done, (int8_t)n};
            }
        }
    }
    /* rules grouped by left side (counting sort) */
    for (size_t i = 0; i < g->nrules; i++) g->syms[g->rules[i].lhs].nr++;
    uint32_t off = 0;
    for (size_t s = 0; s < g->nsyms; s++) {
        if (!g->syms[s].is_lex && !g->syms[s].nr) {
            gfail(g, "grammar: nonterminal %s has no rules", g->syms[s].name);
            return -1;
        }
        g->syms[s].r0 = off;
        off += g->syms[s].nr;
        g->syms[s].nr = 0;
    }
    g->by_lhs = malloc((g->nrules ? g->nrules : 1) * sizeof *g->by_lhs);
    if (!g->by_lhs) {
        gfail(g, "grammar: out of memory");
        return -1;
    }
    for (size_t i = 0; i < g->nrules; i++) {
        sym *l = &g->syms[g->rules[i].lhs];
        g->by_lhs[l->r0 + l->nr++] = (uint32_t)i;
    }
    /* nullable nonterminals: to a fixed point */
    for (bool changed = true; changed;) {
        changed = false;
        for (size_t i = 0; i < g->nrules; i++) {
            const rule *r = &g->rules[i];
            if (g->syms[r->lhs].nullable) continue;
            bool all = true;
            for (uint32_t k = 0; k < r->len && all; k++) all = g->syms[g->rhs[r->off + k]].nullable;
            if (all) g->syms[r->lhs].nullable = changed = true;
        }
    }
    /* the start must derive a sentence (a rule set that only loops, such
     * as a $ref to itself, derives none): productive nonterminals, to a
     * fixed point */
    bool *prod = calloc(g->nsyms, sizeof *prod);
    if (!prod) {
        gfail(g, "grammar: out of memory");
        return -1;
    }
    for (bool changed = true; changed;) {
        changed = false;
        for (size_t i = 0; i < g->nrules; i++) {
            const rule *r = &g->rules[i];
            if (prod[r->lhs]) continue;
            bool all = true;
            for (uint32_t k = 0; k < r->len && all; k++) {
                const td_gram_sym x = g->rhs[r->off + k];
                all = g->syms[x].is_lex || prod[x];
            }
            if (all) prod[r->lhs] = changed = true;
        }
    }
    const bool ok = prod[start];
    free(prod);
    if (!ok) {
        gfail(g, "grammar: %s derives no sentence (each of its rules loops back to it)",
              g->syms[start].name);
        return -1;
    }
    return 0;
}

td_gram *td_gram_from_regex(const char *pattern, size_t n, const td_gram_limits *lim, char *err,
                            size_t errlen) {
    td_gram *g = td_gram_new(lim);
    if (!g) {
        if (err && errlen) snprintf(err, errlen, "grammar: out of memory");
        return NULL;
    }
    td_rx *rx = g->rx;
    td_rx_id re;
    if (td_rx_parse(rx, pattern, n, 0, &re, err, errlen)) {
        td_gram_free(g);
        return NULL;
    }
    /* a lexeme never matches the empty string: the pattern less "" (each
     * first byte followed by its derivative), and an empty rule if "" */
    td_rx_id parts[256];
    size_t np = 0;
    for (int b = 0; b < 256 && !td_rx_error(rx); b++) {
        td_rx_id d = td_rx_deriv(rx, re, (uint8_t)b);
        if (d != TD_RX_NOTHING && d != TD_RX_FAIL)
            parts[np++] = td_rx_concat(rx, td_rx_byte_range(rx, (uint8_t)b, (uint8_t)b), d);
    }
    const td_gram_sym start = td_gram_nonterm(g, "start");
    if (np) {
        const td_gram_sym lx = td_gram_lexeme(g, td_rx_or_list(rx, parts, np), "regex");
        td_gram_rule(g, start, &lx, 1);
    }
    if (td_rx_nullable(rx, re)) td_gram_rule(g, start, NULL, 0);
    if (!np && !td_rx_nullable(rx, re)) gfail(g, "grammar: the pattern matches no text");
    if (td_rx_error(rx) || td_gram_finish(g, start)) {
        if (err && errlen) snprintf(err, errlen, "%s", g->error ? g->error : td_rx_error(rx));
        td_gram_free(g);
        return NULL;
    }
    return g;
}

td_gram *td_gram_from_choices(const char *const *choices, const size_t *lens, size_t n,
                              const td_gram_limits *lim, char *err, size_t errlen) {
    td_gram *g = td_gram_new(lim);
    td_rx_id *alts = malloc((n ? n : 1) * sizeof *alts);
    if (!g || !alts) {
        if (err && errlen) snprintf(err, errlen, "grammar: out of memory");
        td_gram_free(g);
        free(alts);
        return NULL;
    }
    if (!n) gfail(g, "grammar: a choice needs at least one string");
    for (size_t i = 0; i < n && !g->error; i++) {
        if (!lens[i]) gfail(g, "grammar: choice %zu is the empty string", i + 1);
        alts[i] = td_rx_literal(g->rx, choices[i], lens[i]);
    }
    /* one lexeme: the alternation of the strings (no lexing ambiguity) */
    const td_gram_sym start = td_gram_nonterm(g, "start");
    if (!g->error) {
        const td_gram_sym lx = td_gram_lexeme(g, td_rx_or_list(g->rx, alts, n), "choice");
        td_gram_rule(g, start, &lx, 1);
    }
    free(alts);
    if (g->error || td_gram_finish(g, start)) {
        if (err && errlen) snprintf(err, errlen, "%s", g->error);
        td_gram_free(g);
        return NULL;
    }
    return g;
}

/* ---- the lexer's DFA ---- */

static uint64_t lhash(const lpair *p, uint32_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ull ^ n;
    for (uint32_t i = 0; i < n; i++) {
        h ^= ((uint64_t)p[i].lex << 32 | p[i].node) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
        h *= 0xff51afd7ed558ccdull;
    }
    return h ^ (h >> 29);
}

static bool lslots_grow(td_gram *g) {
    size_t ns = g->nlslots ? g->nlslots * 2 : 256;
    uint32_t *s = calloc(ns, sizeof *s);
    if (!s) return false;
    for (size_t i = 0; i < g->nlslots; i++) {
        uint32_t v = g->lslots[i];
        if (!v) continue;
        const lstate *st = &g->ls[v - 1];
        size_t j = lhash(g->pairs + st->off, st->n) & (ns - 1);
        while (s[j]) j = (j + 1) & (ns - 1);
        s[j] = v;
    }
    free(g->lslots);
    g->lslots = s;
    g->nlslots = ns;
    return true;
}

/* The state of the n pairs (sorted by lexeme), made if new; NONE on a limit. */
static uint32_t intern_lstate(td_gram *g, const lpair *p, uint32_t n) {
    if ((g->nls + 1) * 2 > g->nlslots && !lslots_grow(g)) goto oom;
    const uint64_t h = lhash(p, n);
    size_t j = h & (g->nlslots - 1);
    while (g->lslots[j]) {
        const lstate *st = &g->ls[g->lslots[j] - 1];
        if (st->n == n && (!n || !memcmp(g->pairs + st->off, p, n * sizeof *p)))
            return g->lslots[j] - 1;
        j = (j + 1) & (g->nlslots - 1);
    }
    if (g->nls >= g->lim.max_lexer_states) {
        gfail(g, "grammar: more than %u lexer states", g->lim.max_lexer_states);
        return NONE;
    }
    if (!td_gr_reserve((void **)&g->ls, &g->cls, g->nls, sizeof *g->ls)) goto oom;
    while (g->npairs + n >= g->cpairs)
        if (!td_gr_reserve((void **)&g->pairs, &g->cpairs, g->cpairs, sizeof *g->pairs)) goto oom;
    while (g->naccs + n >= g->caccs)
        if (!td_gr_reserve((void **)&g->accs, &g->caccs, g->caccs, sizeof *g->accs)) goto oom;
    lstate st = {.off = (uint32_t)g->npairs, .n = n, .acc_off = (uint32_t)g->naccs};
    if (n) memcpy(g->pairs + g->npairs, p, n * sizeof *p);
    g->npairs += n;
    for (uint32_t i = 0; i < n; i++)
        if (td_rx_nullable(g->rx, p[i].node)) g->accs[g->naccs + st.nacc++] = p[i].lex;
    g->naccs += st.nacc;
    g->ls[g->nls] = st;
    g->lslots[j] = (uint32_t)g->nls + 1;
    return (uint32_t)g->nls++;
oom:
    gfail(g, "grammar: out of memory");
    return NONE;
}

/* State s's transitions, made (all UNKNOWN) when missing; NULL when out
 * of memory. */
static inline const uint32_t *trans_of(td_gram *g, uint32_t s) {
    if (!g->ls[s].trans) {
        uint32_t *t = malloc(256 * sizeof *t);
        if (!t) {
            gfail(g, "grammar: out of memory");
            return NULL;
        }
        for (int i = 0; i < 256; i++) t[i] = UNKNOWN;
        g->ls[s].trans = t;
    }
    return g->ls[s].trans;
}

/* The lexer state after byte b from state s; NONE on a limit. */
static uint32_t lex_step(td_gram *g, uint32_t s, uint8_t b) {
    if (!trans_of(g, s)) return NONE;
    if (g->ls[s].trans[b] != UNKNOWN) return g->ls[s].trans[b];
    const uint32_t n = g->ls[s].n, off = g->ls[s].off;
    lpair stack_buf[32], *q = n <= 32 ? stack_buf : malloc(n * sizeof *q);
    if (!q) {
        gfail(g, "grammar: out of memory");
        return NONE;
    }
    uint32_t m = 0;
    /* the bytes that take every lexeme of s where b does */
    uint64_t same[4] = {~0ull, ~0ull, ~0ull, ~0ull};
    for (uint32_t i = 0; i < n; i++) {
        const lpair pi = g->pairs[off + i];
        td_rx_same_deriv(g->rx, pi.node, b, same);
        td_rx_id d = td_rx_deriv(g->rx, pi.node, b);
        if (d == TD_RX_FAIL) {
            gfail(g, "grammar: %s", td_rx_error(g->rx));
            if (q != stack_buf) free(q);
            return NONE;
        }
        /* a lexeme that can no longer match (an intersection or a
         * complement emptied: a number past its exclusive bound, a name
         * that only a listed one continues) leaves the state, so that no
         * byte is taken that has no way on */
        if (d != TD_RX_NOTHING && !td_rx_is_empty(g->rx, d)) q[m++] = (lpair){pi.lex, d};
        if (td_rx_error(g->rx)) {
            gfail(g, "grammar: %s", td_rx_error(g->rx));
            if (q != stack_buf) free(q);
            return NONE;
        }
    }
    uint32_t r = intern_lstate(g, q, m);
    if (q != stack_buf) free(q);
    if (r != NONE) {
        uint32_t *t = g->ls[s].trans;
        uint8_t c = b;
        do {
            t[c] = r;
            c = g->finished ? g->cls_next[c] : b;
        } while (c != b);
        for (int w = 0; w < 4; w++)
            for (uint64_t x = same[w]; x; x &= x - 1) t[w * 64 + __builtin_ctzll(x)] = r;
    }
    return r;
}

/* ---- the matcher: Earley sets over lexemes ---- */

typedef struct {
    uint32_t rule, dot, origin;
} item;

typedef struct {
    uint32_t off;   /* first item */
    uint32_t lex0;  /* the lexer's start state here (NONE until made) */
    bool accepting; /* holds start' -> start . */
    uint32_t from;  /* the lexer state whose lexemes were scanned into it */
    uint64_t stamp; /* unique per set made */
} eset;

typedef struct {
    uint32_t lex;   /* lexer state after this byte */
    uint32_t nsets; /* Earley sets then */
} frame;

struct td_gm {
    td_gram *g;
    item *items;
    size_t nitems, citems;
    eset *sets;
    size_t nsets, csets;
    frame *frames;
    size_t nframes, cframes;
    /* de-duplication of the set being built: item index + 1 by hash, valid
     * where gen matches */
    uint32_t *dslots, *dgen, gen;
    size_t ndslots;
    uint64_t made;              /* items made over the matcher's life */
    uint64_t stamps;            /* sets made */
    struct verdict_s *verdicts; /* td_gm_walk's memo (VERDICTS slots) */
    size_t nverdicts;
    /* the last set taken back (truncate_sets), kept while its items are
     * not overwritten: scanning the same lexemes after the same set again
     * (the trie walk does, once per token that ends a lexeme) restores it
     * instead of making it anew. Valid while sets[k] still has stamp
     * prev_stamp and nothing was built after it. */
    struct {
        bool valid;
        uint32_t k; /* the set before it */
        uint64_t prev_stamp;
        eset set;
        size_t end; /* its items: [set.off, end) */
    } ghost;
    uint8_t *lexmark; /* per lexeme: scratch */
    bool stopped;
    const char *error;
    char errbuf[200];
};

static void mfail(td_gm *m, const char *fmt, ...) {
    if (m->error) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m->errbuf, sizeof m->errbuf, fmt, ap);
    va_end(ap);
    m->error = m->errbuf;
}

const char *td_gm_error(const td_gm *m) { return m->error; }

static uint64_t ihash(item it) {
    uint64_t h = ((uint64_t)it.rule << 40) ^ ((uint64_t)it.dot << 20) ^ it.origin;
    h *= 0x9e3779b97f4a7c15ull;
    return h ^ (h >> 32);
}

/* Starts the de-duplication of a new set. */
static bool dedup_reset(td_gm *m) {
    if (++m->gen == 0) { /* wrapped: clear */
        memset(m->dgen, 0, m->ndslots * sizeof *m->dgen);
        m->gen = 1;
    }
    return true;
}

static bool dedup_grow(td_gm *m, size_t set_off) {
    size_t ns = m->ndslots ? m->ndslots * 2 : 1024;
    uint32_t *s = malloc(ns * sizeof *s), *gn = calloc(ns, sizeof *gn);
    if (!s || !gn) {
        free(s);
        free(gn);
        return false;
    }
    free(m->dslots);
    free(m->dgen);
    m->dslots = s;
    m->dgen = gn;
    m->ndslots = ns;
    m->gen = 1;
    for (size_t i = set_off; i < m->nitems; i++) {
        size_t j = ihash(m->items[i]) & (ns - 1);
        while (gn[j] == 1) j = (j + 1) & (ns - 1);
        gn[j] = 1;
        s[j] = (uint32_t)i;
    }
    return true;
}

/* Adds it to the set being built (which starts at set_off) unless there.
 * false on a limit or allocation failure (m->error). */
static bool add_item(td_gm *m, size_t set_off, item it) {
    const td_gram *g = m->g;
    if ((m->nitems - set_off + 1) * 2 > m->ndslots && !dedup_grow(m, set_off)) goto oom;
    size_t j = ihash(it) & (m->ndslots - 1);
    while (m->dgen[j] == m->gen) {
        const item *x = &m->items[m->dslots[j]];
        if (x->rule == it.rule && x->dot == it.dot && x->origin == it.origin) return true;
        j = (j + 1) & (m->ndslots - 1);
    }
    if (m->nitems - set_off >= g->lim.max_items_set) {
        mfail(m, "grammar: more than %u parser items at one position", g->lim.max_items_set);
        return false;
    }
    if (++m->made > g->lim.max_items) {
        mfail(m, "grammar: more than %llu parser items", (unsigned long long)g->lim.max_items);
        return false;
    }
    if (!td_gr_reserve((void **)&m->items, &m->citems, m->nitems, sizeof *m->items)) goto oom;
    m->dgen[j] = m->gen;
    m->dslots[j] = (uint32_t)m->nitems;
    m->items[m->nitems++] = it;
    return true;
oom:
    mfail(m, "grammar: out of memory");
    return false;
}

static inline uint32_t next_sym(const td_gram *g, item it) {
    const rule *r = &g->rules[it.rule];
    return it.dot < r->len ? g->rhs[r->off + it.dot] : NONE;
}

/* Predicts and completes the set k (its scanned items in place) to closure. */
static bool closure(td_gm *m, uint32_t k) {
    const td_gram *g = m->g;
    const size_t off = m->sets[k].off;
    for (size_t i = off; i < m->nitems; i++) {
        const item it = m->items[i];
        const uint32_t s = next_sym(g, it);
        if (s == NONE) { /* complete: advance the items of its origin waiting for lhs */
            const uint32_t lhs = g->rules[it.rule].lhs;
            const size_t o0 = m->sets[it.origin].off;
            const size_t o1 = it.origin == k ? m->nitems : m->sets[it.origin + 1].off;
            for (size_t x = o0; x < o1; x++) {
                const item w = m->items[x];
                if (next_sym(g, w) == lhs && !add_item(m, off, (item){w.rule, w.dot + 1, w.origin}))
                    return false;
            }
            if (it.rule == g->start_rule && it.origin == 0) m->sets[k].accepting = true;
            continue;
        }
        const sym *ss = &g->syms[s];
        if (ss->is_lex) continue;
        for (uint32_t q = 0; q < ss->nr; q++)
            if (!add_item(m, off, (item){g->by_lhs[ss->r0 + q], 0, k})) return false;
        if (ss->nullable && !add_item(m, off, (item){it.rule, it.dot + 1, it.origin})) return false;
    }
    return true;
}

static bool new_set(td_gm *m) {
    if (!td_gr_reserve((void **)&m->sets, &m->csets, m->nsets + 1, sizeof *m->sets)) {
        mfail(m, "grammar: out of memory");
        return false;
    }
    /* the items go where a retained set's were */
    if (m->ghost.valid && m->nsets <= m->ghost.k + 1) m->ghost.valid = false;
    m->sets[m->nsets] = (eset){.off = (uint32_t)m->nitems, .lex0 = NONE, .stamp = ++m->stamps};
    m->sets[m->nsets + 1].off = (uint32_t)m->nitems; /* sentinel for closure */
    m->nsets++;
    return dedup_reset(m);
}

static void truncate_sets(td_gm *m, size_t nsets) {
    if (nsets >= m->nsets) return;
    if (nsets >= 1) { /* keep set nsets's items for a rescan (the ghost) */
        m->ghost.valid = true;
        m->ghost.k = (uint32_t)nsets - 1;
        m->ghost.prev_stamp = m->sets[nsets - 1].stamp;
        m->ghost.set = m->sets[nsets];
        m->ghost.end = nsets + 1 < m->nsets ? m->sets[nsets + 1].off : m->nitems;
    }
    m->nitems = m->sets[nsets].off;
    m->nsets = nsets;
}

/* Set k + 1 as the lexemes ending in lexer state from make it after set
 * k, restored from the ghost when it holds exactly that. */
static bool ghost_restore(td_gm *m, uint32_t k, uint32_t from) {
    if (!m->ghost.valid || m->ghost.k != k || m->nsets != (size_t)k + 1 ||
        m->sets[k].stamp != m->ghost.prev_stamp || m->ghost.set.from != from)
        return false;
    if (!td_gr_reserve((void **)&m->sets, &m->csets, m->nsets + 1, sizeof *m->sets)) return false;
    m->sets[k + 1] = m->ghost.set;
    m->sets[k + 2].off = (uint32_t)m->ghost.end; /* sentinel */
    m->nsets = (size_t)k + 2;
    m->nitems = m->ghost.end;
    m->ghost.valid = false;
    return true;
}

/* The lexer's start state at set k: the lexemes its items expect. */
static uint32_t lex_start(td_gm *m, uint32_t k) {
    if (m->sets[k].lex0 != NONE) return m->sets[k].lex0;
    td_gram *g = m->g;
    const size_t o0 = m->sets[k].off, o1 = k + 1 < m->nsets ? m->sets[k + 1].off : m->nitems;
    lpair *p = NULL;
    uint32_t n = 0;
    memset(m->lexmark, 0, g->nlex);
    for (size_t i = o0; i < o1; i++) {
        const uint32_t s = next_sym(g, m->items[i]);
        if (s == NONE || !g->syms[s].is_lex || m->lexmark[g->syms[s].lex]) continue;
        m->lexmark[g->syms[s].lex] = 1;
        n++;
    }
    /* the ignored text may come before a lexeme that is not the first */
    if (n && k > 0 && g->ignore != BAD_SYM && !m->lexmark[g->syms[g->ignore].lex]) {
        m->lexmark[g->syms[g->ignore].lex] = 1;
        n++;
    }
    if (n && !(p = malloc(n * sizeof *p))) {
        mfail(m, "grammar: out of memory");
        return NONE;
    }
    uint32_t j = 0;
    for (size_t s = 0; s < g->nsyms && j < n; s++)
        if (g->syms[s].is_lex && m->lexmark[g->syms[s].lex])
            p[j++] = (lpair){g->syms[s].lex, g->syms[s].re};
    /* syms are in lexeme order, so p is sorted by lexeme */
    uint32_t r = intern_lstate(g, p, n);
    free(p);
    if (r == NONE) mfail(m, "%s", g->error);
    m->sets[k].lex0 = r;
    return r;
}

/* Marks the lexemes that end in lexer state s; false if none. */
static bool mark_accepting(td_gm *m, uint32_t s) {
    const td_gram *g = m->g;
    const lstate *st = &g->ls[s];
    if (!st->nacc) return false;
    memset(m->lexmark, 0, g->nlex);
    for (uint32_t i = 0; i < st->nacc; i++) m->lexmark[g->accs[st->acc_off + i]] = 1;
    return true;
}

/* Scans, after set k, the lexemes that end in lexer state from: set k + 1,
 * closed. false when it is empty (m->error set on a limit). */
static bool scan(td_gm *m, uint32_t k, uint32_t from) {
    const td_gram *g = m->g;
    if (ghost_restore(m, k, from)) return true;
    if (!mark_accepting(m, from)) return false;
    if (!new_set(m)) return false;
    m->sets[k + 1].from = from;
    const size_t o0 = m->sets[k].off, o1 = m->sets[k + 1].off, off = m->nitems;
    /* ignored text read: set k again (its items, in the new set) */
    const bool ign = g->ignore != BAD_SYM && m->lexmark[g->syms[g->ignore].lex];
    for (size_t i = o0; i < o1; i++) {
        const item it = m->items[i];
        const uint32_t s = next_sym(g, it);
        if ((ign && !add_item(m, off, it)) ||
            (s != NONE && g->syms[s].is_lex && m->lexmark[g->syms[s].lex] &&
             !add_item(m, off, (item){it.rule, it.dot + 1, it.origin}))) {
            truncate_sets(m, k + 1);
            m->ghost.valid = false; /* not a whole set */
            return false;
        }
    }
    if (m->nitems == off || !closure(m, k + 1)) {
        truncate_sets(m, k + 1);
        m->ghost.valid = false;
        return false;
    }
    return true;
}

td_gm *td_gm_new(td_gram *g) {
    if (!g->finished || g->error) return NULL;
    td_gm *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    m->g = g;
    m->lexmark = calloc(g->nlex ? g->nlex : 1, 1);
    if (!m->lexmark || !new_set(m) || !add_item(m, 0, (item){g->start_rule, 0, 0}) ||
        !closure(m, 0) || lex_start(m, 0) == NONE ||
        !td_gr_reserve((void **)&m->frames, &m->cframes, 0, sizeof *m->frames)) {
        td_gm_free(m);
        return NULL;
    }
    m->frames[0] = (frame){.lex = m->sets[0].lex0, .nsets = 1};
    m->nframes = 1;
    return m;
}

void td_gm_free(td_gm *m) {
    if (!m) return;
    free(m->items);
    free(m->sets);
    free(m->frames);
    free(m->dslots);
    free(m->dgen);
    free(m->lexmark);
    free(m->verdicts);
    free(m);
}

size_t td_gm_depth(const td_gm *m) { return m->nframes - 1; }

bool td_gm_stopped(const td_gm *m) { return m->stopped; }
void td_gm_stop(td_gm *m) { m->stopped = true; }
void td_gm_resume(td_gm *m) { m->stopped = false; }

td_gm_result td_gm_push(td_gm *m, uint8_t b) {
    td_gram *g = m->g;
    if (m->error) return TD_GM_LIMIT;
    if (m->stopped) return TD_GM_REJECT;
    const frame top = m->frames[m->nframes - 1];
    const uint32_t k = top.nsets - 1;
    if (!td_gr_reserve((void **)&m->frames, &m->cframes, m->nframes, sizeof *m->frames)) {
        mfail(m, "grammar: out of memory");
        return TD_GM_LIMIT;
    }
    uint32_t t = lex_step(g, top.lex, b);
    if (t == NONE) goto limit;
    if (t != LEX_DEAD) {
        m->frames[m->nframes++] = (frame){t, top.nsets};
        return TD_GM_OK;
    }
    /* the byte ends the lexeme(s) that end here, and starts the next */
    /* (only the first frame is at a lexeme's start: every later one has
     * taken a byte of its lexeme, even where its lexer state equals the
     * start state, as in x*y after an x) */
    if (m->nframes == 1) return TD_GM_REJECT;
    if (!scan(m, k, top.lex)) return m->error ? TD_GM_LIMIT : TD_GM_REJECT;
    const uint32_t s0 = lex_start(m, k + 1);
    if (s0 == NONE) goto limit_scan;
    t = lex_step(g, s0, b);
    if (t == NONE) goto limit_scan;
    if (t == LEX_DEAD) {
        truncate_sets(m, k + 1);
        return TD_GM_REJECT;
    }
    m->frames[m->nframes++] = (frame){t, top.nsets + 1};
    return TD_GM_OK;
limit_scan:
    truncate_sets(m, k + 1);
limit:
    mfail(m, "%s", g->error ? g->error : "grammar: limit");
    return TD_GM_LIMIT;
}

td_gm_result td_gm_push_bytes(td_gm *m, const void *bytes, size_t n, size_t *done) {
    const uint8_t *p = bytes;
    size_t i = 0;
    td_gm_result r = TD_GM_OK;
    for (; i < n; i++)
        if ((r = td_gm_push(m, p[i])) != TD_GM_OK) break;
    if (done) *done = i;
    return r;
}

void td_gm_pop(td_gm *m, size_t n) {
    if (n > m->nframes - 1) n = m->nframes - 1;
    if (n) m->stopped = false;
    m->nframes -= n;
    truncate_sets(m, m->frames[m->nframes - 1].nsets);
}

bool td_gm_accepting(td_gm *m) {
    if (m->error) return false;
    const frame top = m->frames[m->nframes - 1];
    const uint32_t k = top.nsets - 1;
    if (m->nframes == 1) return m->sets[k].accepting; /* at a lexeme's start */
    if (!scan(m, k, top.lex)) return false;
    const bool acc = m->sets[k + 1].accepting;
    truncate_sets(m, k + 1);
    return acc;
}

int64_t td_gm_forced_bytes(td_gm *m, uint8_t *out, size_t max) {
    if (m->error) return -1;
    if (m->stopped) return 0;
    const td_gram *g = m->g;
    size_t n = 0;
    while (n < max && !td_gm_accepting(m)) {
        if (m->error) break;
        /* a byte per class: the bytes of a class are taken alike */
        int only = -1, count = 0;
        for (uint32_t c = 0; c < g->ncls && count < 2; c++) {
            const uint8_t b = g->cls_rep[c];
            const td_gm_result r = td_gm_push(m, b);
            if (r == TD_GM_LIMIT) break;
            if (r == TD_GM_OK) {
                td_gm_pop(m, 1);
                only = b;
                count += g->cls_size[g->bclass[b]];
            }
        }
        if (m->error || count != 1) break;
        if (td_gm_push(m, (uint8_t)only) != TD_GM_OK) break;
        out[n++] = (uint8_t)only;
    }
    td_gm_pop(m, n);
    return m->error ? -1 : (int64_t)n;
}

bool td_gm_finished(td_gm *m) {
    for (uint32_t c = 0; c < m->g->ncls; c++) {
        td_gm_result r = td_gm_push(m, m->g->cls_rep[c]);
        if (r == TD_GM_OK) {
            td_gm_pop(m, 1);
            return false;
        }
        if (r == TD_GM_LIMIT) return false;
    }
    return true;
}

/* Walks nodes [i0, i1) of the trie with the parser: a node at depth d
 * is pushed onto base + (d - depth0) frames. */
static int64_t walk_range(td_gm *m, const td_trie *tr, uint32_t i0, uint32_t i1, size_t base,
                          uint32_t depth0, uint32_t *mask) {
    td_gram *g = m->g;
    const td_trie_node *nodes = tr->nodes;
    for (uint32_t i = i0; i < i1;) {
        const td_trie_node *t = &nodes[i];
        /* back to this node's parent */
        const size_t want = base + (t->depth - depth0);
        if (m->nframes > want) {
            m->nframes = want;
            const uint32_t ns = m->frames[want - 1].nsets;
            if (ns < m->nsets) truncate_sets(m, ns);
        }
        const frame top = m->frames[m->nframes - 1];
        const uint32_t *trans = g->ls[top.lex].trans;
        uint32_t nx = trans ? trans[t->byte] : UNKNOWN;
        if (nx == UNKNOWN) nx = lex_step(g, top.lex, t->byte);
        if (nx == NONE) {
            mfail(m, "%s", g->error ? g->error : "grammar: limit");
            return -1;
        }
        if (nx != LEX_DEAD) { /* inside the lexeme: the lexer alone */
            m->frames[m->nframes++] = (frame){nx, top.nsets};
        } else if (!g->ls[top.lex].nacc) { /* no lexeme ends here: rejected (scan) */
            i = t->end;
            continue;
        } else { /* a lexeme ends here: the whole push */
            const td_gm_result r = td_gm_push(m, t->byte);
            if (r == TD_GM_LIMIT) return -1;
            if (r != TD_GM_OK) {
                i = t->end;
                continue;
            }
        }
        for (uint32_t k = 0; k < t->ntok; k++) {
            const int32_t id = tr->ids[t->tok + k];
            mask[id / 32] |= 1u << (id % 32);
        }
        i++;
    }
    return 0;
}

/* The lexer-state cache of a trie (td_gm_walk): per lexer state, the
 * tokens read inside the lexeme, and the trie nodes where it would end.
 * Those whose token ends with that byte (leaves) are grouped by the lexer
 * state before the byte and the byte: one parser step decides a whole
 * group. The others (the token goes on into the next lexeme) are walked. */
#define AT_BASE UINT32_MAX /* the boundary is the token's first byte */

typedef struct lcache_s {
    uint32_t *bits; /* NULL: not made */
    uint32_t ngroups;
    uint32_t *gfrom; /* per group: the lexer state before the byte, or AT_BASE */
    uint8_t *gbyte;
    uint32_t *gstart; /* group i's tokens: gids[gstart[i] .. gstart[i + 1]) */
    int32_t *gids;
    bool rest; /* the nodes are the rest trie's (td_trie.rest) */
    uint32_t ninner;
    struct inner_s {
        uint32_t node, from; /* trie node, lexer state before it (or AT_BASE) */
    } * inner;
} lcache;

#define LCACHE_MAX_STATES 4096

static void lcache_free(lcache *e) {
    free(e->bits);
    free(e->gfrom);
    free(e->gbyte);
    free(e->gstart);
    free(e->gids);
    free(e->inner);
    memset(e, 0, sizeof *e);
}

static void lcache_clear(td_gram *g) {
    for (size_t i = 0; i < g->nlcache; i++) lcache_free(&g->lcache[i]);
    free(g->lcache);
    g->lcache = NULL;
    g->nlcache = 0;
    g->lcache_used = 0;
}

typedef struct {
    uint32_t from, node;
    uint8_t byte;
} leaf;

/* The UTF-8 decoder after byte b in state u (0 at a character's start;
 * 1, 2, 3 continuation bytes to come, 4-7 the second byte's narrower
 * ranges after E0, ED, F0, F4): the next state, or -1. *done is set when
 * b completes a character. */
static int utf8_next(int u, uint8_t b, bool *done) {
    *done = false;
    switch (u) {
    case 0:
        if (b < 0x80) {
            *done = !(b < 0x20 || b == '"' || b == '\\' || b == 0x7f);
            return *done ? 0 : -1;
        }
        if (b >= 0xC2 && b <= 0xDF) return 1;
        if (b == 0xE0) return 4;
        if (b == 0xED) return 5;
        if (b >= 0xE1 && b <= 0xEF) return 2;
        if (b == 0xF0) return 6;
        if (b >= 0xF1 && b <= 0xF3) return 3;
        if (b == 0xF4) return 7;
        return -1;
    case 1: *done = b >= 0x80 && b <= 0xBF; return *done ? 0 : -1;
    case 2: return b >= 0x80 && b <= 0xBF ? 1 : -1;
    case 3: return b >= 0x80 && b <= 0xBF ? 2 : -1;
    case 4: return b >= 0xA0 && b <= 0xBF ? 1 : -1;
    case 5: return b >= 0x80 && b <= 0x9F ? 1 : -1;
    case 6: return b >= 0x90 && b <= 0xBF ? 2 : -1;
    default: return b >= 0x80 && b <= 0x8F ? 2 : -1;
    }
}

#define REACH_STATES 64 /* lexer states per level of body_reach */

enum { R_DIED = 1, R_DIED_OPEN = 2, R_ALIVE = 4, R_FULL = 8, R_LIMIT = 16 };

/* The byte paths of one body character from lexer state y (UTF-8 decoder
 * state u): adds the states after the character to next (*nn of them, at
 * most REACH_STATES) and says how the paths went (R_ flags: a path died
 * where no lexeme ends, or where one does, or finished the character). */
static int body_char(td_gram *g, uint32_t y, int u, uint32_t *next, uint32_t *nn) {
    int r = 0;
    for (uint32_t i = 0; i < g->nbody_reps[u]; i++) {
        const uint8_t b = g->body_reps[u][i].byte;
        const bool done = g->body_reps[u][i].done;
        const int u2 = g->body_reps[u][i].next;
        const uint32_t t = lex_step(g, y, b);
        if (t == NONE) return R_LIMIT;
        if (t == LEX_DEAD) {
            r |= g->ls[y].nacc ? R_DIED_OPEN : R_DIED;
        } else if (!done) {
            r |= body_char(g, t, u2, next, nn);
            if (r & (R_LIMIT | R_FULL)) return r;
        } else {
            r |= R_ALIVE;
            uint32_t j = 0;
            while (j < *nn && next[j] != t) j++;
            if (j == *nn) {
                if (*nn == REACH_STATES) return r | R_FULL;
                next[(*nn)++] = t;
            }
        }
    }
    return r;
}

/* How far JSON string bodies keep lexer state s alive (td_trie.body_bits):
 * *k is the most characters, up to TD_TRIE_BODY_MAX, such that s stays
 * alive through every body of at most *k characters; *kill says that every
 * body of *k + 1 characters is rejected: each byte path of its last
 * character reaches LEX_DEAD from a state where no lexeme ends, so that the
 * parser's scan fails. The search goes a character at a time over the set
 * of lexer states the bodies so far reach; a set of more than REACH_STATES
 * ends it (*k is then the characters done, *kill false). false on a
 * limit. */
static bool body_reach(td_gram *g, uint32_t s, uint32_t *k, bool *kill) {
    uint32_t a[REACH_STATES], b[REACH_STATES], *cur = a, *nxt = b, nc = 1;
    cur[0] = s;
    *kill = false;
    for (uint32_t n = 0; n < TD_TRIE_BODY_MAX; n++) {
        int r = 0;
        uint32_t nn = 0;
        for (uint32_t i = 0; i < nc && !(r & (R_LIMIT | R_FULL)); i++)
            r |= body_char(g, cur[i], 0, nxt, &nn);
        if (r & R_LIMIT) return false;
        *k = n;
        if (r & R_FULL) return true;
        if (r & (R_DIED | R_DIED_OPEN)) {
            *kill = !(r & (R_DIED_OPEN | R_ALIVE));
            return true;
        }
        /* the same set again: so it goes on for ever */
        bool same = nn == nc;
        for (uint32_t i = 0; i < nn && same; i++) {
            uint32_t j = 0;
            while (j < nc && cur[j] != nxt[i]) j++;
            same = j < nc;
        }
        if (same) break;
        uint32_t *t = cur;
        cur = nxt;
        nxt = t;
        nc = nn;
    }
    *k = TD_TRIE_BODY_MAX;
    return true;
}

/* Makes state s's entry: the body slice the state takes whole, and a walk
 * with the lexer alone of the other tokens. false on a limit or allocation
 * failure (then no entry). */
static bool lcache_make(td_gram *g, const td_trie *all, uint32_t s, lcache *e) {
    const size_t words = ((size_t)all->n_tokens + 31) / 32;
    /* every body of at most k characters is taken. When longer bodies are
     * (up to TD_TRIE_BODY_MAX), or none of k + 1 characters is, only the
     * rest trie's tokens are left to walk; else the whole trie is walked,
     * less the subtrees of bodies of at most k characters. */
    uint32_t k = 0;
    bool kill = false;
    if (all->body_bits && !body_reach(g, s, &k, &kill)) return false;
    lcache c = {.rest = all->rest && (k == TD_TRIE_BODY_MAX || kill)};
    const td_trie *tr = c.rest ? all->rest : all;
    const uint8_t *skip = !c.rest && k ? all->body_max : NULL;
    c.bits = calloc(words ? words : 1, sizeof *c.bits);
    uint32_t *st = malloc(((size_t)tr->max_depth + 1) * sizeof *st);
    /* per depth: the lexer state and its transitions (made when missing) */
    const uint32_t **tp = malloc(((size_t)tr->max_depth + 1) * sizeof *tp);
    leaf *lv = NULL;
    size_t nl = 0, cl = 0, ci = 0, ntok = 0;
    if (!c.bits || !st || !tp || !trans_of(g, s)) goto fail;
    st[0] = s;
    tp[0] = g->ls[s].trans;
    uint32_t last_nx = s;
    const uint32_t *last_tp = tp[0];
    if (k)
        for (size_t w = 0; w < words; w++) c.bits[w] = all->body_bits[(k - 1) * words + w];
    for (uint32_t i = 0; i < tr->n;) {
        const uint64_t pk = tr->packed[i];
        const uint8_t byte = (uint8_t)pk;
        const uint32_t depth = (uint32_t)(pk >> 8) & 0xffff, end = (uint32_t)(pk >> 32);
        if (skip && skip[i] <= k) {
            i = end;
            continue;
        }
        uint32_t nx = tp[depth - 1][byte];
        if (nx == UNKNOWN) nx = lex_step(g, st[depth - 1], byte); /* fills tp[depth - 1] */
        if (nx == NONE) goto fail;
        if (nx == LEX_DEAD && !g->ls[st[depth - 1]].nacc) {
            /* no lexeme ends in the state before the byte: the parser's
             * push rejects it (scan), and the whole subtree with it */
            i = end;
            continue;
        }
        if (nx == LEX_DEAD) { /* the lexeme would end here: the parser decides */
            const uint32_t from = st[depth - 1];
            const uint32_t key = depth == 1 ? AT_BASE : from;
            const td_trie_node *t = &tr->nodes[i];
            if (end == i + 1) {
                if (!td_gr_reserve((void **)&lv, &cl, nl, sizeof *lv)) goto fail;
                lv[nl++] = (leaf){key, i, byte};
                ntok += t->ntok;
            } else {
                if (!td_gr_reserve((void **)&c.inner, &ci, c.ninner, sizeof *c.inner)) goto fail;
                c.inner[c.ninner++] = (struct inner_s){i, key};
            }
            i = end;
            continue;
        }
        st[depth] = nx;
        if (nx != last_nx) { /* (runs of nodes stay in one state) */
            if (!(last_tp = trans_of(g, nx))) goto fail;
            last_nx = nx;
        }
        tp[depth] = last_tp;
        if (pk >> 24 & 1) {
            const td_trie_node *t = &tr->nodes[i];
            for (uint32_t q = 0; q < t->ntok; q++) {
                const int32_t id = tr->ids[t->tok + q];
                c.bits[id / 32] |= 1u << (id % 32);
            }
        }
        i++;
    }
    free(tp);
    /* group the leaves by (state, byte), in order of first appearance:
     * a hash of the keys to group numbers, then a counting pass */
    size_t hcap = 64;
    while (hcap < 2 * nl + 2) hcap *= 2;
    uint64_t *hkey = calloc(hcap, sizeof *hkey);
    uint32_t *hval = malloc(hcap * sizeof *hval), *lg = malloc((nl + 1) * sizeof *lg);
    c.gfrom = malloc((nl + 1) * sizeof *c.gfrom);
    c.gbyte = malloc(nl + 1);
    c.gstart = calloc(nl + 2, sizeof *c.gstart);
    c.gids = malloc((ntok + 1) * sizeof *c.gids);
    if (!hkey || !hval || !lg || !c.gfrom || !c.gbyte || !c.gstart || !c.gids) {
        free(hkey);
        free(hval);
        free(lg);
        goto fail;
    }
    for (size_t i = 0; i < nl; i++) {
        const uint64_t key = ((uint64_t)lv[i].from << 8 | lv[i].byte) + 1;
        size_t j = (key * 0x9e3779b97f4a7c15ull >> 20) & (hcap - 1);
        while (hkey[j] && hkey[j] != key) j = (j + 1) & (hcap - 1);
        if (!hkey[j]) {
            hkey[j] = key;
            hval[j] = c.ngroups;
            c.gfrom[c.ngroups] = lv[i].from;
            c.gbyte[c.ngroups++] = lv[i].byte;
        }
        lg[i] = hval[j];
        c.gstart[hval[j] + 1] += tr->nodes[lv[i].node].ntok;
    }
    for (uint32_t q = 0; q < c.ngroups; q++) c.gstart[q + 1] += c.gstart[q];
    uint32_t *fill = hval; /* (reused: per group, the next free slot) */
    for (uint32_t q = 0; q < c.ngroups; q++) fill[q] = c.gstart[q];
    for (size_t i = 0; i < nl; i++) {
        const td_trie_node *t = &tr->nodes[lv[i].node];
        for (uint32_t q = 0; q < t->ntok; q++) c.gids[fill[lg[i]]++] = tr->ids[t->tok + q];
    }
    free(hkey);
    free(hval);
    free(lg);

    free(st);
    free(lv);
    *e = c;
    return true;
fail:
    free(tp);
    free(st);
    free(lv);
    lcache_free(&c);
    return false;
}

/* The parser's verdict on byte b from lexer state from after the set with
 * stamp (TD_GM_OK, TD_GM_REJECT), remembered per matcher. */
typedef struct verdict_s {
    uint64_t stamp;
    uint32_t from;
    uint8_t byte, how, result, used; /* how: 0 a later frame, 1 the base, 2 the first frame */
} verdict;

#define VERDICTS 4096

static verdict *verdict_slot(td_gm *m, uint64_t stamp, uint32_t from, uint8_t b, uint8_t how,
                             bool *found) {
    if (!m->verdicts && !(m->verdicts = calloc(VERDICTS, sizeof *m->verdicts))) return NULL;
    uint64_t h = (stamp * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)from << 10 | (uint64_t)how << 8 | b);
    h ^= h >> 29;
    for (size_t j = h & (VERDICTS - 1), n = 0; n < VERDICTS; j = (j + 1) & (VERDICTS - 1), n++) {
        verdict *v = &m->verdicts[j];
        if (!v->used) {
            *found = false;
            if (++m->nverdicts > VERDICTS / 2) { /* full enough: start over */
                memset(m->verdicts, 0, VERDICTS * sizeof *m->verdicts);
                m->nverdicts = 1;
                return verdict_slot(m, stamp, from, b, how, found);
            }
            return v;
        }
        if (v->stamp == stamp && v->from == from && v->byte == b && v->how == how) {
            *found = true;
            return v;
        }
    }
    return NULL;
}

int64_t td_gm_walk(td_gm *m, const td_trie *tr, uint32_t *mask) {
    if (m->error) return -1;
    if (m->stopped) return 0;
    td_gram *g = m->g;
    const size_t base = m->nframes; /* frames at the start */
    /* room for the deepest token: no reserve in the walk */
    while (m->cframes < base + tr->max_depth + 1)
        if (!td_gr_reserve((void **)&m->frames, &m->cframes, m->cframes, sizeof *m->frames)) {
            mfail(m, "grammar: out of memory");
            return -1;
        }
    if (g->lcache_trie != tr) {
        lcache_clear(g);
        g->lcache_trie = tr;
    }
    const uint32_t s = m->frames[base - 1].lex;
    if (s >= g->nlcache) { /* grow the index to the lexer's states */
        size_t nn = g->nls > s ? g->nls : (size_t)s + 1;
        lcache *nc = realloc(g->lcache, nn * sizeof *nc);
        if (nc) {
            memset(nc + g->nlcache, 0, (nn - g->nlcache) * sizeof *nc);
            g->lcache = nc;
            g->nlcache = nn;
        }
    }
    lcache *e = s < g->nlcache ? &g->lcache[s] : NULL;
    if (e && !e->bits && g->lcache_used < LCACHE_MAX_STATES && lcache_make(g, tr, s, e))
        g->lcache_used++;
    if (g->error) {
        mfail(m, "%s", g->error);
        return -1;
    }
    if (!e || !e->bits) return walk_range(m, tr, 0, tr->n, base, 1, mask) < 0 ? -1 : 0;
    const size_t words = ((size_t)tr->n_tokens + 31) / 32;
    for (size_t w = 0; w < words; w++) mask[w] |= e->bits[w];
    const frame fb = m->frames[base - 1];
    const uint64_t stamp = m->sets[fb.nsets - 1].stamp;
    for (uint32_t gi = 0; gi < e->ngroups; gi++) {
        const uint32_t from = e->gfrom[gi];
        const uint8_t b = e->gbyte[gi];
        /* at the base, the verdict is that of the base's own state (and
         * whether the base is a lexeme's start: the matcher's first frame) */
        const uint32_t key = from != AT_BASE ? from : s;
        const uint8_t how = from != AT_BASE ? 0 : base == 1 ? 2 : 1;
        bool found = false;
        verdict *v = verdict_slot(m, stamp, key, b, how, &found);
        td_gm_result r;
        if (found) {
            r = (td_gm_result)v->result;
        } else {
            /* the state after the token's bytes before b: its lexer state
             * on the base's Earley sets (bytes inside one lexeme) */
            if (from != AT_BASE) m->frames[m->nframes++] = (frame){from, fb.nsets};
            r = td_gm_push(m, b);
            td_gm_pop(m, m->nframes - base);
            if (r == TD_GM_LIMIT) return -1;
            if (v) *v = (verdict){stamp, key, b, how, (uint8_t)r, 1};
        }
        if (r != TD_GM_OK) continue;
        for (uint32_t k = e->gstart[gi]; k < e->gstart[gi + 1]; k++) {
            const int32_t id = e->gids[k];
            mask[id / 32] |= 1u << (id % 32);
        }
    }
    const td_trie *wt = e->rest ? tr->rest : tr; /* the trie of the inner nodes */
    for (uint32_t j = 0; j < e->ninner; j++) {
        const uint32_t idx = e->inner[j].node, from = e->inner[j].from;
        int64_t rc;
        if (from == AT_BASE) {
            rc = walk_range(m, wt, idx, wt->nodes[idx].end, base, 1, mask);
        } else {
            m->frames[m->nframes++] = (frame){from, fb.nsets};
            rc = walk_range(m, wt, idx, wt->nodes[idx].end, base + 1, wt->nodes[idx].depth, mask);
        }
        td_gm_pop(m, m->nframes - base);
        if (rc < 0) return -1;
    }
    return 0;
}
