/* The Jinja interpreter of template.h: a lexer and a recursive-descent
 * parser to an AST (compile), and a tree-walking evaluator over values in
 * a per-render arena (render). jinja2 (3.1) is the reference for every
 * behaviour; Python's for the values' str(), repr() and arithmetic.
 *
 * Errors inside the parser and the evaluator jump (longjmp) back to
 * td_tmpl_compile / td_tmpl_render, which own every allocation through
 * one arena each and free it whatever the outcome: nothing else is
 * allocated on the way, so a jump leaks nothing. */
#include "common/template/template.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- arena ---- */

typedef struct chunk {
    struct chunk *next;
    size_t used, cap;
    _Alignas(16) char data[];
} chunk;

typedef struct {
    chunk *head;
    size_t total, limit; /* limit 0: none */
} arena;

typedef struct {
    jmp_buf jb;
    char *err;
    size_t errlen;
    int line; /* the line being compiled or evaluated, for messages */
} failer;

static _Noreturn void failf(failer *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static _Noreturn void failf(failer *f, const char *fmt, ...) {
    if (f->err && f->errlen) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(f->err, f->errlen, fmt, ap);
        va_end(ap);
        if (f->line > 0 && n >= 0 && (size_t)n < f->errlen)
            snprintf(f->err + n, f->errlen - (size_t)n, " (line %d)", f->line);
    }
    longjmp(f->jb, 1);
}

static void *arena_alloc(arena *a, failer *f, size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (!a->head || a->head->cap - a->head->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        if (a->limit && a->total + cap > a->limit)
            failf(f, "template evaluation exceeds its memory limit of %zu bytes", a->limit);
        chunk *c = malloc(sizeof(chunk) + cap);
        if (!c) failf(f, "out of memory");
        c->next = a->head;
        c->used = 0;
        c->cap = cap;
        a->head = c;
        a->total += cap;
    }
    void *p = a->head->data + a->head->used;
    a->head->used += n;
    return p;
}

static void arena_free(arena *a) {
    for (chunk *c = a->head; c;) {
        chunk *n = c->next;
        free(c);
        c = n;
    }
    a->head = NULL;
    a->total = 0;
}

/* ---- values ---- */

typedef enum {
    V_UNDEF, /* jinja2's Undefined: prints "", is false, iterates empty */
    V_NONE,
    V_BOOL,
    V_INT,
    V_FLOAT,
    V_STR,
    V_LIST, /* a list, or a tuple */
    V_DICT, /* insertion-ordered */
    V_NS,   /* namespace(): a dict whose attributes can be assigned */
    V_FUNC, /* a macro, a global function or a bound method */
    V_LOOP, /* a for loop's `loop` */
} vtype;

typedef struct str_ str_;
typedef struct list_ list_;
typedef struct dict_ dict_;
typedef struct func_ func_;
typedef struct loop_ loop_;

typedef struct {
    uint8_t t;
    union {
        bool b;
        int64_t i;
        double f;
        const str_ *s;
        list_ *l;
        dict_ *d;
        const func_ *fn;
        loop_ *lp;
        const char *uname; /* V_UNDEF: the missing name, or NULL */
    };
} val;

struct str_ {
    size_t len;
    const char *s; /* UTF-8, not NUL-terminated */
    bool markup;   /* markupsafe's Markup (the safe filter): `+` escapes the other side */
};

struct list_ {
    size_t n, cap;
    val *v;
    bool tuple;
    /* not NULL: an iterator jinja2 hands on unmaterialised (select, map,
     * reverse ...: "generator", "list_reverseiterator"; dict methods:
     * "dict_items", "dict_keys", "dict_values"), which iterates like a
     * list but is always true and is no JSON value */
    const char *iter;
};

struct dict_ {
    size_t n, cap;
    val *k, *v;
};

typedef struct node node;
typedef struct frame frame;

typedef enum {
    F_MACRO,
    F_GLOBAL, /* raise_exception, strftime_now, namespace, range, dict, ... */
    F_METHOD, /* a method of self (str, dict or list) */
    F_CYCLER, /* loop.cycle */
} fkind;

struct func_ {
    fkind kind;
    const char *name;
    const node *macro; /* F_MACRO: its definition, run in a frame under env */
    frame *env;
    val self;
};

struct loop_ {
    const list_ *items;
    size_t index0;
    int depth0;
};

static const val V_UNDEFINED = {.t = V_UNDEF};
static const val V_NULL = {.t = V_NONE};

static val mk_bool(bool b) { return (val){.t = V_BOOL, .b = b}; }
static val mk_int(int64_t i) { return (val){.t = V_INT, .i = i}; }
static val mk_float(double f) { return (val){.t = V_FLOAT, .f = f}; }
static val mk_undef(const char *name) { return (val){.t = V_UNDEF, .uname = name}; }

/* ---- the evaluator's state (the parser uses its arena and failer too) ---- */

typedef struct {
    char *p;
    size_t n, cap;
} sbuf;

typedef struct {
    failer f;
    arena a;
    const td_tmpl_limits *lim;
    uint64_t steps, iters;
    int depth;
    sbuf *out; /* where output goes now (macros and block sets redirect it) */
    frame *globals;
    /* the lists and dicts whose repr is being written (Python's
     * Py_ReprEnter: a cycle is written "[...]", "(...)" or "{...}") */
    const void *repr_in[256];
    int nrepr;
} ev;

static val mk_str(ev *e, const char *s, size_t n) {
    str_ *x = arena_alloc(&e->a, &e->f, sizeof *x);
    char *d = arena_alloc(&e->a, &e->f, n + 1);
    memcpy(d, s, n);
    d[n] = 0;
    x->s = d;
    x->len = n;
    x->markup = false;
    return (val){.t = V_STR, .s = x};
}
static val mk_cstr(ev *e, const char *s) { return mk_str(e, s, strlen(s)); }

static list_ *new_list(ev *e, size_t cap) {
    list_ *l = arena_alloc(&e->a, &e->f, sizeof *l);
    l->n = 0;
    l->cap = cap ? cap : 4;
    l->v = arena_alloc(&e->a, &e->f, l->cap * sizeof(val));
    l->tuple = false;
    l->iter = NULL;
    return l;
}
static void list_push(ev *e, list_ *l, val v) {
    if (l->n == l->cap) {
        val *nv = arena_alloc(&e->a, &e->f, 2 * l->cap * sizeof(val));
        memcpy(nv, l->v, l->n * sizeof(val));
        l->v = nv;
        l->cap *= 2;
    }
    l->v[l->n++] = v;
}
static val mk_list(list_ *l) { return (val){.t = V_LIST, .l = l}; }
static val mk_iter(list_ *l, const char *kind) {
    l->iter = kind;
    return mk_list(l);
}
static bool is_view(const list_ *l) { return l->iter && !strncmp(l->iter, "dict_", 5); }

static dict_ *new_dict(ev *e, size_t cap) {
    dict_ *d = arena_alloc(&e->a, &e->f, sizeof *d);
    d->n = 0;
    d->cap = cap ? cap : 4;
    d->k = arena_alloc(&e->a, &e->f, d->cap * sizeof(val));
    d->v = arena_alloc(&e->a, &e->f, d->cap * sizeof(val));
    return d;
}

/* ---- output buffers ---- */

static void sb_put(ev *e, sbuf *b, const char *s, size_t n) {
    if (!n) return;
    if (b->n + n + 1 > b->cap) {
        if (b->n + n > e->lim->max_output)
            failf(&e->f, "the rendered template exceeds its output limit of %zu bytes",
                  e->lim->max_output);
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = arena_alloc(&e->a, &e->f, cap);
        if (b->n) memcpy(p, b->p, b->n);
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}
static void sb_puts(ev *e, sbuf *b, const char *s) { sb_put(e, b, s, strlen(s)); }
static void sb_printf(ev *e, sbuf *b, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void sb_printf(ev *e, sbuf *b, const char *fmt, ...) {
    char tmp[64];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    TD_ASSERT(n >= 0 && (size_t)n < sizeof tmp);
    sb_put(e, b, tmp, (size_t)n);
}
static val sb_val(ev *e, const sbuf *b) { return mk_str(e, b->n ? b->p : "", b->n); }

/* ---- UTF-8 ---- */

static size_t u8_len(const char *s, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++) c += ((unsigned char)s[i] & 0xC0) != 0x80;
    return c;
}
/* byte offset of code point cp (cp <= length) */
static size_t u8_off(const char *s, size_t n, size_t cp) {
    size_t i = 0;
    while (cp && i < n) {
        i++;
        while (i < n && ((unsigned char)s[i] & 0xC0) == 0x80) i++;
        cp--;
    }
    return i;
}
/* the code point at s[*i], advancing *i; a byte that starts no complete
 * sequence as itself */
static uint32_t u8_next(const char *s, size_t n, size_t *i) {
    const unsigned char *u = (const unsigned char *)s;
    uint32_t c = u[*i];
    const size_t extra = c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : c >= 0xC0 ? 1 : 0;
    if (extra && *i + extra < n) {
        c &= 0x3Fu >> extra;
        for (size_t k = 1; k <= extra; k++) c = (c << 6) | (u[*i + k] & 0x3Fu);
        *i += extra + 1;
        return c;
    }
    *i += 1;
    return c;
}
static void u8_put(ev *e, sbuf *b, uint32_t c) {
    char t[4];
    size_t n;
    if (c < 0x80) {
        t[0] = (char)c;
        n = 1;
    } else if (c < 0x800) {
        t[0] = (char)(0xC0 | (c >> 6));
        t[1] = (char)(0x80 | (c & 0x3F));
        n = 2;
    } else if (c < 0x10000) {
        t[0] = (char)(0xE0 | (c >> 12));
        t[1] = (char)(0x80 | ((c >> 6) & 0x3F));
        t[2] = (char)(0x80 | (c & 0x3F));
        n = 3;
    } else {
        t[0] = (char)(0xF0 | (c >> 18));
        t[1] = (char)(0x80 | ((c >> 12) & 0x3F));
        t[2] = (char)(0x80 | ((c >> 6) & 0x3F));
        t[3] = (char)(0x80 | (c & 0x3F));
        n = 4;
    }
    sb_put(e, b, t, n);
}

/* ---- Python's str(), repr() and json.dumps() ---- */

/* float.__repr__: the shortest digits that read back as x, fixed notation
 * for exponents in [-4, 16), else d.ddde+XX. json: inf and nan as
 * json.dumps writes them. */
static void put_float(ev *e, sbuf *b, double x, bool json) {
    if (isnan(x)) return sb_puts(e, b, json ? "NaN" : "nan");
    if (isinf(x))
        return sb_puts(e, b, x < 0 ? (json ? "-Infinity" : "-inf") : (json ? "Infinity" : "inf"));
    char t[40];
    int prec = 1;
    for (; prec <= 17; prec++) {
        snprintf(t, sizeof t, "%.*e", prec - 1, x);
        if (strtod(t, NULL) == x) break;
    }
    /* t: [-]d[.ddd]e[+-]XX */
    char digits[24];
    size_t nd = 0;
    const char *p = t;
    bool neg = false;
    if (*p == '-') neg = true, p++;
    for (; *p && *p != 'e'; p++)
        if (*p != '.') digits[nd++] = *p;
    const int ex = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    if (neg) sb_put(e, b, "-", 1);
    if (ex >= -4 && ex < 16) {
        const int decpt = ex + 1;
        if (decpt <= 0) {
            sb_put(e, b, "0.", 2);
            for (int i = 0; i < -decpt; i++) sb_put(e, b, "0", 1);
            sb_put(e, b, digits, nd);
        } else if ((size_t)decpt >= nd) {
            sb_put(e, b, digits, nd);
            for (size_t i = nd; i < (size_t)decpt; i++) sb_put(e, b, "0", 1);
            sb_put(e, b, ".0", 2);
        } else {
            sb_put(e, b, digits, (size_t)decpt);
            sb_put(e, b, ".", 1);
            sb_put(e, b, digits + decpt, nd - (size_t)decpt);
        }
        return;
    }
    sb_put(e, b, digits, 1);
    if (nd > 1) {
        sb_put(e, b, ".", 1);
        sb_put(e, b, digits + 1, nd - 1);
    }
    sb_printf(e, b, "e%c%02d", ex < 0 ? '-' : '+', ex < 0 ? -ex : ex);
}

/* str.isprintable() for the code points chat text holds: controls, the
 * C1 range, and the separators and format characters Python escapes */
static bool py_printable(uint32_t c) {
    if (c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD) return false;
    if ((c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F) ||
        (c >= 0x205F && c <= 0x206F) || c == 0x3000 || c == 0xFEFF || c == 0x1680)
        return false;
    if ((c >= 0xD800 && c <= 0xDFFF) || (c >= 0xE000 && c <= 0xF8FF) || c == 0xFFFE || c == 0xFFFF)
        return false;
    return true;
}

static void put_repr_str(ev *e, sbuf *b, const str_ *s) {
    const bool has1 = memchr(s->s, '\'', s->len) != NULL, has2 = memchr(s->s, '"', s->len) != NULL;
    const char q = has1 && !has2 ? '"' : '\'';
    sb_put(e, b, &q, 1);
    for (size_t i = 0; i < s->len;) {
        const size_t i0 = i;
        const uint32_t c = u8_next(s->s, s->len, &i);
        if (c == (uint32_t)q || c == '\\') {
            sb_put(e, b, "\\", 1);
            sb_put(e, b, s->s + i0, 1);
        } else if (c == '\n') {
            sb_puts(e, b, "\\n");
        } else if (c == '\r') {
            sb_puts(e, b, "\\r");
        } else if (c == '\t') {
            sb_puts(e, b, "\\t");
        } else if (!py_printable(c)) {
            if (c < 0x100)
                sb_printf(e, b, "\\x%02x", c);
            else if (c < 0x10000)
                sb_printf(e, b, "\\u%04x", c);
            else
                sb_printf(e, b, "\\U%08x", c);
        } else {
            sb_put(e, b, s->s + i0, i - i0);
        }
    }
    sb_put(e, b, &q, 1);
}

static void put_repr(ev *e, sbuf *b, val v);

/* str(v) */
static void put_str(ev *e, sbuf *b, val v) {
    switch (v.t) {
    case V_UNDEF: return;
    case V_STR: return sb_put(e, b, v.s->s, v.s->len);
    default: return put_repr(e, b, v);
    }
}

/* Enters container p's repr: true when it is already being written (a
 * cycle). Fails past the nesting limit, as put_json does. */
static bool repr_enter(ev *e, const void *p) {
    for (int i = 0; i < e->nrepr; i++)
        if (e->repr_in[i] == p) return true;
    const int cap = (int)(sizeof e->repr_in / sizeof *e->repr_in);
    if (e->nrepr >= cap || e->nrepr >= e->lim->max_depth)
        failf(&e->f, "repr: nesting deeper than %d", e->nrepr);
    e->repr_in[e->nrepr++] = p;
    return false;
}

static void put_repr(ev *e, sbuf *b, val v) {
    switch (v.t) {
    case V_UNDEF: return;
    case V_NONE: return sb_puts(e, b, "None");
    case V_BOOL: return sb_puts(e, b, v.b ? "True" : "False");
    case V_INT: return sb_printf(e, b, "%" PRId64, v.i);
    case V_FLOAT: return put_float(e, b, v.f, false);
    case V_STR: return put_repr_str(e, b, v.s);
    case V_LIST:
        if (v.l->iter && !is_view(v.l)) return sb_printf(e, b, "<%s object>", v.l->iter);
        if (v.l->iter) sb_printf(e, b, "%s(", v.l->iter);
        if (repr_enter(e, v.l)) {
            sb_puts(e, b, v.l->tuple ? "(...)" : "[...]");
        } else {
            sb_puts(e, b, v.l->tuple ? "(" : "[");
            for (size_t i = 0; i < v.l->n; i++) {
                if (i) sb_puts(e, b, ", ");
                put_repr(e, b, v.l->v[i]);
            }
            if (v.l->tuple && v.l->n == 1) sb_puts(e, b, ",");
            sb_puts(e, b, v.l->tuple ? ")" : "]");
            e->nrepr--;
        }
        if (v.l->iter) sb_puts(e, b, ")");
        return;
    case V_NS:
        sb_puts(e, b, "<Namespace ");
        /* fall through */
    case V_DICT:
        if (repr_enter(e, v.d)) {
            sb_puts(e, b, "{...}");
        } else {
            sb_puts(e, b, "{");
            for (size_t i = 0; i < v.d->n; i++) {
                if (i) sb_puts(e, b, ", ");
                put_repr(e, b, v.d->k[i]);
                sb_puts(e, b, ": ");
                put_repr(e, b, v.d->v[i]);
            }
            sb_puts(e, b, "}");
            e->nrepr--;
        }
        if (v.t == V_NS) sb_puts(e, b, ">");
        return;
    case V_FUNC: return sb_printf(e, b, "<function %.40s>", v.fn->name);
    case V_LOOP: return sb_puts(e, b, "<LoopContext>");
    }
}

typedef struct {
    bool ensure_ascii, sort_keys;
    const char *indent; /* NULL: none */
    const char *item_sep, *key_sep;
} json_opts;

static void put_json_str(ev *e, sbuf *b, const char *s, size_t n, bool ascii) {
    sb_put(e, b, "\"", 1);
    for (size_t i = 0; i < n;) {
        const size_t i0 = i;
        const uint32_t c = u8_next(s, n, &i);
        switch (c) {
        case '"': sb_puts(e, b, "\\\""); break;
        case '\\': sb_puts(e, b, "\\\\"); break;
        case '\n': sb_puts(e, b, "\\n"); break;
        case '\r': sb_puts(e, b, "\\r"); break;
        case '\t': sb_puts(e, b, "\\t"); break;
        case '\b': sb_puts(e, b, "\\b"); break;
        case '\f': sb_puts(e, b, "\\f"); break;
        default:
            if (c < 0x20)
                sb_printf(e, b, "\\u%04x", c);
            else if (ascii && c >= 0x80) {
                if (c >= 0x10000)
                    sb_printf(e, b, "\\u%04x\\u%04x", 0xD800 + ((c - 0x10000) >> 10),
                              0xDC00 + ((c - 0x10000) & 0x3FF));
                else
                    sb_printf(e, b, "\\u%04x", c);
            } else
                sb_put(e, b, s + i0, i - i0);
        }
    }
    sb_put(e, b, "\"", 1);
}

static int cmp_vals(ev *e, val a, val b);

static void put_json(ev *e, sbuf *b, val v, const json_opts *o, int level) {
    if (++e->depth > e->lim->max_depth)
        failf(&e->f, "tojson: nesting deeper than %d", e->lim->max_depth);
    switch (v.t) {
    case V_NONE: sb_puts(e, b, "null"); break;
    case V_BOOL: sb_puts(e, b, v.b ? "true" : "false"); break;
    case V_INT: sb_printf(e, b, "%" PRId64, v.i); break;
    case V_FLOAT: put_float(e, b, v.f, true); break;
    case V_STR: put_json_str(e, b, v.s->s, v.s->len, o->ensure_ascii); break;
    case V_LIST:
        if (v.l->iter)
            failf(&e->f, "tojson: Object of type %s is not JSON serializable", v.l->iter);
        /* fall through */
    case V_DICT: {
        const bool dict = v.t == V_DICT;
        const size_t n = dict ? v.d->n : v.l->n;
        if (!n) {
            sb_puts(e, b, dict ? "{}" : "[]");
            break;
        }
        size_t *ord = arena_alloc(&e->a, &e->f, n * sizeof *ord);
        for (size_t i = 0; i < n; i++) ord[i] = i;
        if (dict && o->sort_keys) /* insertion sort: stable, small n */
            for (size_t i = 1; i < n; i++)
                for (size_t j = i; j > 0 && cmp_vals(e, v.d->k[ord[j - 1]], v.d->k[ord[j]]) > 0;
                     j--) {
                    const size_t t = ord[j];
                    ord[j] = ord[j - 1];
                    ord[j - 1] = t;
                }
        sb_puts(e, b, dict ? "{" : "[");
        for (size_t i = 0; i < n; i++) {
            if (i) sb_puts(e, b, o->item_sep);
            if (o->indent) {
                sb_puts(e, b, "\n");
                for (int l = 0; l <= level; l++) sb_puts(e, b, o->indent);
            }
            if (dict) {
                const val k = v.d->k[ord[i]];
                if (k.t == V_STR) {
                    put_json_str(e, b, k.s->s, k.s->len, o->ensure_ascii);
                } else if (k.t == V_INT || k.t == V_FLOAT || k.t == V_BOOL || k.t == V_NONE) {
                    sbuf kb = {0};
                    put_json(e, &kb, k, o, level + 1);
                    put_json_str(e, b, kb.p, kb.n, false);
                } else {
                    failf(&e->f, "tojson: keys must be str, int, float, bool or None");
                }
                sb_puts(e, b, o->key_sep);
                put_json(e, b, v.d->v[ord[i]], o, level + 1);
            } else {
                put_json(e, b, v.l->v[ord[i]], o, level + 1);
            }
        }
        if (o->indent) {
            sb_puts(e, b, "\n");
            for (int l = 0; l < level; l++) sb_puts(e, b, o->indent);
        }
        sb_puts(e, b, dict ? "}" : "]");
        break;
    }
    case V_UNDEF: failf(&e->f, "tojson: Object of type Undefined is not JSON serializable");
    case V_NS: failf(&e->f, "tojson: Object of type Namespace is not JSON serializable");
    default: failf(&e->f, "tojson: Object of type function is not JSON serializable");
    }
    e->depth--;
}

/* ---- lexer ---- */

typedef enum {
    K_TEXT,
    K_VBEGIN,
    K_VEND,
    K_BBEGIN,
    K_BEND,
    K_NAME,
    K_STR,
    K_INT,
    K_FLOAT,
    K_OP,
    K_EOF
} tkind;

typedef struct {
    tkind k;
    int line;
    const char *s; /* K_TEXT, K_NAME, K_STR (decoded), K_OP */
    size_t n;
    int64_t i;
    double f;
} token;

typedef struct {
    ev *e;
    const char *src;
    size_t len, pos;
    int line;
    token *t;
    size_t n, cap, at;
} lexer;

static token *tok_push(lexer *L, tkind k, const char *s, size_t n) {
    if (L->n == L->cap) {
        const size_t cap = L->cap ? 2 * L->cap : 256;
        token *nt = arena_alloc(&L->e->a, &L->e->f, cap * sizeof *nt);
        if (L->n) memcpy(nt, L->t, L->n * sizeof *nt);
        L->t = nt;
        L->cap = cap;
    }
    token *t = &L->t[L->n++];
    *t = (token){.k = k, .line = L->line, .s = s, .n = n};
    return t;
}

static bool is_ws(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

static void lex_advance(lexer *L, size_t to) {
    for (size_t i = L->pos; i < to; i++) L->line += L->src[i] == '\n';
    L->pos = to;
}

/* a string literal at L->pos: Python's escapes, as jinja2 decodes them */
static void lex_string(lexer *L) {
    ev *e = L->e;
    const char q = L->src[L->pos];
    sbuf b = {0};
    size_t i = L->pos + 1;
    for (;; i++) {
        if (i >= L->len) {
            e->f.line = L->line;
            failf(&e->f, "unterminated string literal");
        }
        const char c = L->src[i];
        if (c == q) break;
        if (c != '\\' || i + 1 >= L->len) {
            sb_put(e, &b, &L->src[i], 1);
            continue;
        }
        const char d = L->src[++i];
        uint32_t cp = 0;
        int hex = 0;
        switch (d) {
        case 'n': sb_put(e, &b, "\n", 1); break;
        case 't': sb_put(e, &b, "\t", 1); break;
        case 'r': sb_put(e, &b, "\r", 1); break;
        case 'b': sb_put(e, &b, "\b", 1); break;
        case 'f': sb_put(e, &b, "\f", 1); break;
        case 'v': sb_put(e, &b, "\v", 1); break;
        case 'a': sb_put(e, &b, "\a", 1); break;
        case '0': sb_put(e, &b, "", 1); break;
        case '\\': sb_put(e, &b, "\\", 1); break;
        case '\'': sb_put(e, &b, "'", 1); break;
        case '"': sb_put(e, &b, "\"", 1); break;
        case '\n': break;
        case 'x': hex = 2; break;
        case 'u': hex = 4; break;
        case 'U': hex = 8; break;
        default: sb_put(e, &b, &L->src[i - 1], 2); break;
        }
        if (hex) {
            for (int k = 0; k < hex; k++) {
                const char h = i + 1 < L->len ? L->src[i + 1] : 0;
                if (!isxdigit((unsigned char)h)) {
                    e->f.line = L->line;
                    failf(&e->f, "truncated \\%c escape in a string literal", d);
                }
                cp = cp * 16 +
                     (uint32_t)(isdigit((unsigned char)h) ? h - '0' : (tolower(h) - 'a' + 10));
                i++;
            }
            u8_put(e, &b, cp);
        }
    }
    tok_push(L, K_STR, b.n ? b.p : "", b.n);
    lex_advance(L, i + 1);
}

static const char *const k_ops[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*",
                                    "/",  "%",  "~",  "<",  ">",  "=",  "(", ")", "[",
                                    "]",  "{",  "}",  ",",  ".",  ":",  "|"};

/* tokens of one tag, up to its end ("}}" or "%}", with an optional '-'
 * before it), which counts only outside brackets as jinja2's does */
static void lex_tag(lexer *L, bool block) {
    ev *e = L->e;
    const char end = block ? '%' : '}';
    int depth = 0;
    for (;;) {
        while (L->pos < L->len && is_ws(L->src[L->pos])) lex_advance(L, L->pos + 1);
        if (L->pos >= L->len) {
            e->f.line = L->line;
            failf(&e->f, "unexpected end of template inside a %s tag", block ? "{% %}" : "{{ }}");
        }
        const char *p = L->src + L->pos;
        const size_t left = L->len - L->pos;
        if (depth == 0) {
            const bool minus = left >= 3 && p[0] == '-' && p[1] == end && p[2] == '}';
            if (minus || (left >= 2 && p[0] == end && p[1] == '}')) {
                tok_push(L, block ? K_BEND : K_VEND, NULL, 0);
                lex_advance(L, L->pos + (minus ? 3 : 2));
                if (minus) {
                    size_t q = L->pos;
                    while (q < L->len && is_ws(L->src[q])) q++;
                    lex_advance(L, q);
                } else if (block && L->pos < L->len && L->src[L->pos] == '\n') {
                    lex_advance(L, L->pos + 1); /* trim_blocks */
                }
                return;
            }
        }
        const char c = *p;
        if (isalpha((unsigned char)c) || c == '_') {
            size_t n = 1;
            while (n < left && (isalnum((unsigned char)p[n]) || p[n] == '_')) n++;
            tok_push(L, K_NAME, p, n);
            lex_advance(L, L->pos + n);
        } else if (isdigit((unsigned char)c)) {
            size_t n = 0;
            bool fl = false;
            while (n < left && (isdigit((unsigned char)p[n]) || p[n] == '_')) n++;
            if (n + 1 < left && p[n] == '.' && isdigit((unsigned char)p[n + 1])) {
                fl = true;
                n++;
                while (n < left && (isdigit((unsigned char)p[n]) || p[n] == '_')) n++;
            }
            if (n < left && (p[n] == 'e' || p[n] == 'E')) {
                size_t m = n + 1;
                if (m < left && (p[m] == '+' || p[m] == '-')) m++;
                if (m < left && isdigit((unsigned char)p[m])) {
                    fl = true;
                    n = m;
                    while (n < left && isdigit((unsigned char)p[n])) n++;
                }
            }
            char num[64];
            size_t k = 0;
            for (size_t j = 0; j < n && k + 1 < sizeof num; j++)
                if (p[j] != '_') num[k++] = p[j];
            num[k] = 0;
            token *t = tok_push(L, fl ? K_FLOAT : K_INT, p, n);
            if (fl) {
                t->f = strtod(num, NULL);
            } else {
                errno = 0;
                t->i = strtoll(num, NULL, 10);
                if (errno) {
                    e->f.line = L->line;
                    failf(&e->f, "integer literal %s out of range", num);
                }
            }
            lex_advance(L, L->pos + n);
        } else if (c == '\'' || c == '"') {
            lex_string(L);
        } else {
            size_t j = 0;
            for (; j < TD_ARRAY_SIZE(k_ops); j++) {
                const size_t n = strlen(k_ops[j]);
                if (left >= n && !memcmp(p, k_ops[j], n)) break;
            }
            if (j == TD_ARRAY_SIZE(k_ops)) {
                e->f.line = L->line;
                failf(&e->f, "unexpected character '%c' in a tag", c);
            }
            const size_t n = strlen(k_ops[j]);
            if (strchr("([{", c) && n == 1) depth++;
            if (strchr(")]}", c) && n == 1 && depth > 0) depth--;
            tok_push(L, K_OP, k_ops[j], n);
            lex_advance(L, L->pos + n);
        }
    }
}

/* {% raw %} at L->pos (after the tag): its text up to {% endraw %} */
static bool lex_raw(lexer *L, const char *tag_end) {
    ev *e = L->e;
    const char *p = tag_end;
    const char *end = L->src + L->len;
    for (const char *q = p; q + 1 < end; q++) {
        if (q[0] != '{' || q[1] != '%') continue;
        const char *r = q + 2;
        const bool lminus = r < end && *r == '-';
        if (r < end && (*r == '-' || *r == '+')) r++;
        while (r < end && is_ws(*r)) r++;
        if (end - r < 6 || memcmp(r, "endraw", 6)) continue;
        r += 6;
        while (r < end && is_ws(*r)) r++;
        const bool rminus = r < end && *r == '-';
        if (rminus) r++;
        if (end - r < 2 || r[0] != '%' || r[1] != '}') continue;
        size_t n = (size_t)(q - p);
        if (lminus)
            while (n && is_ws(p[n - 1])) n--;
        tok_push(L, K_TEXT, p, n);
        lex_advance(L, (size_t)(r + 2 - L->src));
        if (rminus) {
            size_t s = L->pos;
            while (s < L->len && is_ws(L->src[s])) s++;
            lex_advance(L, s);
        } else if (L->pos < L->len && L->src[L->pos] == '\n') {
            lex_advance(L, L->pos + 1);
        }
        return true;
    }
    e->f.line = L->line;
    failf(&e->f, "missing {%% endraw %%}");
}

static void lex_all(lexer *L) {
    ev *e = L->e;
    bool line_starting = true;
    while (L->pos < L->len) {
        const char *p = L->src + L->pos;
        const char *ts = NULL;
        for (const char *q = p; (q = memchr(q, '{', (size_t)(L->src + L->len - q))) != NULL; q++)
            if (q + 1 < L->src + L->len && (q[1] == '{' || q[1] == '%' || q[1] == '#')) {
                ts = q;
                break;
            }
        size_t tn = ts ? (size_t)(ts - p) : L->len - L->pos;
        if (!ts) {
            if (tn) tok_push(L, K_TEXT, p, tn);
            lex_advance(L, L->len);
            break;
        }
        const char kind = ts[1];
        const char mod = ts + 2 < L->src + L->len ? ts[2] : 0;
        if (mod == '-') {
            while (tn && is_ws(p[tn - 1])) tn--;
        } else if (mod != '+' && kind != '{') { /* lstrip_blocks */
            size_t l = tn;
            while (l && p[l - 1] != '\n') l--;
            if ((l > 0 || line_starting) && l < tn) {
                bool ws = true;
                for (size_t i = l; i < tn; i++) ws = ws && is_ws(p[i]);
                if (ws) tn = l;
            }
        }
        if (tn) tok_push(L, K_TEXT, p, tn);
        lex_advance(L, (size_t)(ts - L->src) + 2 + (mod == '-' || mod == '+'));
        if (kind == '#') {
            const char *c = NULL;
            for (const char *q = L->src + L->pos; q + 1 < L->src + L->len; q++)
                if (q[0] == '#' && q[1] == '}') {
                    c = q;
                    break;
                }
            if (!c) {
                e->f.line = L->line;
                failf(&e->f, "unterminated comment");
            }
            const bool minus = c > L->src + L->pos && c[-1] == '-';
            lex_advance(L, (size_t)(c - L->src) + 2);
            if (minus) {
                size_t s = L->pos;
                while (s < L->len && is_ws(L->src[s])) s++;
                lex_advance(L, s);
            } else if (L->pos < L->len && L->src[L->pos] == '\n') {
                lex_advance(L, L->pos + 1);
            }
        } else {
            const size_t first = L->n;
            tok_push(L, kind == '%' ? K_BBEGIN : K_VBEGIN, NULL, 0);
            lex_tag(L, kind == '%');
            if (kind == '%' && L->n == first + 3 && L->t[first + 1].k == K_NAME &&
                L->t[first + 1].n == 3 && !memcmp(L->t[first + 1].s, "raw", 3)) {
                L->n = first; /* the raw tag itself leaves no tokens */
                lex_raw(L, L->src + L->pos);
            }
        }
        line_starting = L->pos > 0 && L->src[L->pos - 1] == '\n';
    }
    tok_push(L, K_EOF, NULL, 0);
}

/* ---- AST ---- */

typedef enum {
    /* expressions */
    N_CONST,
    N_NAME,
    N_LIST,
    N_TUPLE,
    N_DICT, /* v: key, value, key, value ... */
    N_ATTR,
    N_ITEM,
    N_SLICE, /* v[0..2]: start, stop, step (NULL: absent) */
    N_CALL,
    N_FILTER, /* a NULL: a filter block's or block set's input */
    N_TEST,
    N_NOT,
    N_NEG,
    N_POS,
    N_BIN,
    N_AND,
    N_OR,
    N_CMP, /* a, then v[i] with ops[i] */
    N_COND,
    N_NSREF, /* name.attr as a set target */
    /* statements */
    N_TEXT,
    N_OUT,
    N_IF,  /* a: test, v: body, c: else (N_BODY or N_IF) */
    N_FOR, /* a: target, b: iterable, c: filter, v: body, d: else */
    N_SET, /* a: target, b: value */
    N_SETBLOCK,
    N_MACRO, /* name, kw/kv: parameters and defaults, v: body */
    N_BREAK,
    N_CONTINUE,
    N_FILTERBLOCK, /* c: filters, v: body */
    N_BODY,
} nkind;

enum { OP_ADD = 1, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_CONCAT };
enum { CMP_EQ = 1, CMP_NE, CMP_LT, CMP_LE, CMP_GT, CMP_GE, CMP_IN, CMP_NOTIN };

struct node {
    nkind k;
    int line;
    int op;
    const char *name;
    val cv;
    node *a, *b, *c, *d;
    node **v;
    int nv;
    int *ops;
    const char **kw;
    node **kv;
    int nkw;
};

typedef struct {
    lexer *L;
    ev *e;
} parser;

static token *cur(parser *P) { return &P->L->t[P->L->at]; }
static token *peek_at(parser *P, size_t k) {
    const size_t i = P->L->at + k < P->L->n ? P->L->at + k : P->L->n - 1;
    return &P->L->t[i];
}
static token *advance(parser *P) {
    token *t = cur(P);
    if (t->k != K_EOF) P->L->at++;
    return t;
}
static bool is_op(const token *t, const char *op) {
    return t->k == K_OP && t->n == strlen(op) && !memcmp(t->s, op, t->n);
}
static bool is_name(const token *t, const char *nm) {
    return t->k == K_NAME && t->n == strlen(nm) && !memcmp(t->s, nm, t->n);
}

static const char *describe(parser *P, const token *t) {
    static const char *const names[] = {"text",  "'{{'",     "'}}'",           "'{%'",
                                        "'%}'",  "name",     "string",         "integer",
                                        "float", "operator", "end of template"};
    if (t->k == K_NAME || t->k == K_OP) {
        char *s = arena_alloc(&P->e->a, &P->e->f, t->n + 3);
        snprintf(s, t->n + 3, "'%.*s'", (int)t->n, t->s);
        return s;
    }
    return names[t->k];
}

static _Noreturn void pfail(parser *P, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static _Noreturn void pfail(parser *P, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    P->e->f.line = cur(P)->line;
    failf(&P->e->f, "%s", msg);
}

static void expect_op(parser *P, const char *op) {
    if (!is_op(cur(P), op)) pfail(P, "expected '%s', got %s", op, describe(P, cur(P)));
    advance(P);
}
static const char *tok_str(parser *P, const token *t) {
    char *s = arena_alloc(&P->e->a, &P->e->f, t->n + 1);
    memcpy(s, t->s, t->n);
    s[t->n] = 0;
    return s;
}
static const char *expect_name(parser *P) {
    if (cur(P)->k != K_NAME) pfail(P, "expected a name, got %s", describe(P, cur(P)));
    return tok_str(P, advance(P));
}
static void expect_end(parser *P) {
    if (cur(P)->k != K_BEND) pfail(P, "expected '%%}', got %s", describe(P, cur(P)));
    advance(P);
}

static node *mk_node(parser *P, nkind k, int line) {
    node *n = arena_alloc(&P->e->a, &P->e->f, sizeof *n);
    memset(n, 0, sizeof *n);
    n->k = k;
    n->line = line;
    return n;
}

typedef struct {
    node **v;
    int n, cap;
} nvec;
static void nv_push(parser *P, nvec *a, node *x) {
    if (a->n == a->cap) {
        const int cap = a->cap ? 2 * a->cap : 4;
        node **nv = arena_alloc(&P->e->a, &P->e->f, (size_t)cap * sizeof *nv);
        if (a->n) memcpy(nv, a->v, (size_t)a->n * sizeof *nv);
        a->v = nv;
        a->cap = cap;
    }
    a->v[a->n++] = x;
}

static node *parse_expression(parser *P, bool with_condexpr);
static bool known_filter(const char *n);
static bool known_test(const char *n);
static node *parse_unary(parser *P, bool with_filter);
static node *parse_primary(parser *P);
static node *parse_postfix(parser *P, node *n);

static bool tuple_end(parser *P, const char *extra) {
    const token *t = cur(P);
    return t->k == K_VEND || t->k == K_BEND || is_op(t, ")") || (extra && is_name(t, extra));
}

static node *parse_tuple(parser *P, bool simplified, bool with_condexpr, const char *extra_end,
                         bool explicit_parens) {
    const int line = cur(P)->line;
    nvec args = {0};
    bool is_tuple = false;
    for (;;) {
        if (args.n) expect_op(P, ",");
        if (tuple_end(P, extra_end)) break;
        nv_push(P, &args, simplified ? parse_primary(P) : parse_expression(P, with_condexpr));
        if (is_op(cur(P), ","))
            is_tuple = true;
        else
            break;
    }
    if (!is_tuple) {
        if (args.n) return args.v[0];
        if (!explicit_parens) pfail(P, "expected an expression, got %s", describe(P, cur(P)));
    }
    node *n = mk_node(P, N_TUPLE, line);
    n->v = args.v;
    n->nv = args.n;
    return n;
}

static void parse_call_args(parser *P, node *n) {
    expect_op(P, "(");
    nvec args = {0}, kv = {0};
    const char **kw = NULL;
    int nkw = 0, kwcap = 0;
    bool need_comma = false;
    while (!is_op(cur(P), ")")) {
        if (need_comma) {
            expect_op(P, ",");
            if (is_op(cur(P), ")")) break;
        }
        if (is_op(cur(P), "*") || is_op(cur(P), "**"))
            pfail(P, "*args and **kwargs in calls are not supported");
        if (cur(P)->k == K_NAME && is_op(peek_at(P, 1), "=")) {
            if (nkw == kwcap) {
                kwcap = kwcap ? 2 * kwcap : 4;
                const char **nk = arena_alloc(&P->e->a, &P->e->f, (size_t)kwcap * sizeof *nk);
                if (nkw) memcpy(nk, kw, (size_t)nkw * sizeof *nk);
                kw = nk;
            }
            kw[nkw++] = tok_str(P, advance(P));
            advance(P);
            nv_push(P, &kv, parse_expression(P, true));
        } else {
            if (nkw) pfail(P, "a positional argument follows a keyword argument");
            nv_push(P, &args, parse_expression(P, true));
        }
        need_comma = true;
    }
    expect_op(P, ")");
    n->v = args.v;
    n->nv = args.n;
    n->kw = kw;
    n->kv = kv.v;
    n->nkw = nkw;
}

static const char *dotted_name(parser *P) {
    const char *nm = expect_name(P);
    while (is_op(cur(P), ".")) {
        advance(P);
        const char *more = expect_name(P);
        char *j = arena_alloc(&P->e->a, &P->e->f, strlen(nm) + strlen(more) + 2);
        sprintf(j, "%s.%s", nm, more);
        nm = j;
    }
    return nm;
}

static node *parse_filter(parser *P, node *n, bool start_inline) {
    while (is_op(cur(P), "|") || start_inline) {
        if (!start_inline) advance(P);
        const int line = cur(P)->line;
        node *f = mk_node(P, N_FILTER, line);
        f->name = dotted_name(P);
        if (is_op(cur(P), "(")) parse_call_args(P, f);
        f->a = n;
        n = f;
        start_inline = false;
    }
    return n;
}

static node *parse_test(parser *P, node *n) {
    const int line = cur(P)->line;
    advance(P); /* is */
    bool negated = false;
    if (is_name(cur(P), "not")) {
        advance(P);
        negated = true;
    }
    node *t = mk_node(P, N_TEST, line);
    t->name = dotted_name(P);
    t->a = n;
    const token *c = cur(P);
    if (is_op(c, "(")) {
        parse_call_args(P, t);
    } else if ((c->k == K_NAME || c->k == K_STR || c->k == K_INT || c->k == K_FLOAT ||
                is_op(c, "[") || is_op(c, "{")) &&
               !is_name(c, "else") && !is_name(c, "or") && !is_name(c, "and")) {
        if (is_name(c, "is")) pfail(P, "You cannot chain multiple tests with is");
        node *arg = parse_postfix(P, parse_primary(P));
        t->v = arena_alloc(&P->e->a, &P->e->f, sizeof(node *));
        t->v[0] = arg;
        t->nv = 1;
    }
    if (!negated) return t;
    node *nn = mk_node(P, N_NOT, line);
    nn->a = t;
    return nn;
}

static node *parse_subscribed(parser *P) {
    const int line = cur(P)->line;
    node *args[3] = {NULL, NULL, NULL};
    if (is_op(cur(P), ":")) {
        advance(P);
    } else {
        node *x = parse_expression(P, true);
        if (!is_op(cur(P), ":")) return x;
        advance(P);
        args[0] = x;
    }
    if (!is_op(cur(P), ":") && !is_op(cur(P), "]") && !is_op(cur(P), ","))
        args[1] = parse_expression(P, true);
    if (is_op(cur(P), ":")) {
        advance(P);
        if (!is_op(cur(P), "]") && !is_op(cur(P), ",")) args[2] = parse_expression(P, true);
    }
    node *s = mk_node(P, N_SLICE, line);
    s->v = arena_alloc(&P->e->a, &P->e->f, 3 * sizeof(node *));
    memcpy(s->v, args, sizeof args);
    s->nv = 3;
    return s;
}

static node *parse_postfix(parser *P, node *n) {
    for (;;) {
        const token *t = cur(P);
        const int line = t->line;
        if (is_op(t, ".")) {
            advance(P);
            const token *a = cur(P);
            if (a->k == K_NAME) {
                node *g = mk_node(P, N_ATTR, line);
                g->a = n;
                g->name = tok_str(P, advance(P));
                n = g;
            } else if (a->k == K_INT) {
                node *g = mk_node(P, N_ITEM, line);
                g->a = n;
                g->b = mk_node(P, N_CONST, line);
                g->b->cv = mk_int(advance(P)->i);
                n = g;
            } else {
                pfail(P, "expected a name or a number after '.'");
            }
        } else if (is_op(t, "[")) {
            advance(P);
            nvec args = {0};
            while (!is_op(cur(P), "]")) {
                if (args.n) expect_op(P, ",");
                nv_push(P, &args, parse_subscribed(P));
            }
            expect_op(P, "]");
            /* a slice inside a tuple subscript indexes nothing a template
             * holds: jinja2 answers Undefined (its getitem swallows the
             * TypeError), so the slice stands for a value no key equals */
            for (int i = 0; args.n > 1 && i < args.n; i++)
                if (args.v[i]->k == N_SLICE) {
                    node *u = mk_node(P, N_CONST, args.v[i]->line);
                    u->cv = mk_undef(NULL);
                    args.v[i] = u;
                }
            node *g = mk_node(P, N_ITEM, line);
            g->a = n;
            if (args.n == 1) {
                g->b = args.v[0];
            } else {
                g->b = mk_node(P, N_TUPLE, line);
                g->b->v = args.v;
                g->b->nv = args.n;
            }
            if (g->b && g->b->k == N_SLICE) {
                g->b->a = n;
                n = g->b;
            } else {
                n = g;
            }
        } else if (is_op(t, "(")) {
            node *c = mk_node(P, N_CALL, line);
            c->a = n;
            parse_call_args(P, c);
            n = c;
        } else {
            return n;
        }
    }
}

static node *parse_filter_expr(parser *P, node *n) {
    for (;;) {
        if (is_op(cur(P), "|")) {
            n = parse_filter(P, n, false);
        } else if (is_name(cur(P), "is")) {
            n = parse_test(P, n);
        } else if (is_op(cur(P), "(")) {
            node *c = mk_node(P, N_CALL, cur(P)->line);
            c->a = n;
            parse_call_args(P, c);
            n = c;
        } else {
            return n;
        }
    }
}

static node *parse_primary(parser *P) {
    token *t = cur(P);
    const int line = t->line;
    node *n;
    if (t->k == K_NAME) {
        n = mk_node(P, N_CONST, line);
        if (is_name(t, "true") || is_name(t, "True"))
            n->cv = mk_bool(true);
        else if (is_name(t, "false") || is_name(t, "False"))
            n->cv = mk_bool(false);
        else if (is_name(t, "none") || is_name(t, "None"))
            n->cv = V_NULL;
        else {
            n->k = N_NAME;
            n->name = tok_str(P, t);
        }
        advance(P);
    } else if (t->k == K_STR) {
        sbuf b = {0};
        while (cur(P)->k == K_STR) {
            const token *s = advance(P);
            sb_put(P->e, &b, s->s, s->n);
        }
        n = mk_node(P, N_CONST, line);
        n->cv = sb_val(P->e, &b);
    } else if (t->k == K_INT || t->k == K_FLOAT) {
        n = mk_node(P, N_CONST, line);
        n->cv = t->k == K_INT ? mk_int(t->i) : mk_float(t->f);
        advance(P);
    } else if (is_op(t, "(")) {
        advance(P);
        n = parse_tuple(P, false, true, NULL, true);
        expect_op(P, ")");
    } else if (is_op(t, "[")) {
        advance(P);
        nvec items = {0};
        while (!is_op(cur(P), "]")) {
            if (items.n) expect_op(P, ",");
            if (is_op(cur(P), "]")) break;
            nv_push(P, &items, parse_expression(P, true));
        }
        expect_op(P, "]");
        n = mk_node(P, N_LIST, line);
        n->v = items.v;
        n->nv = items.n;
    } else if (is_op(t, "{")) {
        advance(P);
        nvec items = {0};
        while (!is_op(cur(P), "}")) {
            if (items.n) expect_op(P, ",");
            if (is_op(cur(P), "}")) break;
            nv_push(P, &items, parse_expression(P, true));
            expect_op(P, ":");
            nv_push(P, &items, parse_expression(P, true));
        }
        expect_op(P, "}");
        n = mk_node(P, N_DICT, line);
        n->v = items.v;
        n->nv = items.n;
    } else {
        pfail(P, "unexpected %s", describe(P, t));
    }
    return n;
}

static node *parse_unary(parser *P, bool with_filter) {
    const int line = cur(P)->line;
    node *n;
    if (is_op(cur(P), "-") || is_op(cur(P), "+")) {
        const bool neg = is_op(advance(P), "-");
        n = mk_node(P, neg ? N_NEG : N_POS, line);
        n->a = parse_unary(P, false);
    } else {
        n = parse_primary(P);
    }
    n = parse_postfix(P, n);
    if (with_filter) n = parse_filter_expr(P, n);
    return n;
}

static node *mk_bin(parser *P, int op, node *a, node *b, int line) {
    node *n = mk_node(P, N_BIN, line);
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

static node *parse_pow(parser *P) {
    node *n = parse_unary(P, true);
    while (is_op(cur(P), "**")) {
        const int line = advance(P)->line;
        n = mk_bin(P, OP_POW, n, parse_unary(P, true), line);
    }
    return n;
}

static node *parse_math2(parser *P) {
    node *n = parse_pow(P);
    for (;;) {
        const token *t = cur(P);
        const int op = is_op(t, "*")    ? OP_MUL
                       : is_op(t, "/")  ? OP_DIV
                       : is_op(t, "//") ? OP_FLOORDIV
                       : is_op(t, "%")  ? OP_MOD
                                        : 0;
        if (!op) return n;
        const int line = advance(P)->line;
        n = mk_bin(P, op, n, parse_pow(P), line);
    }
}

static node *parse_concat(parser *P) {
    node *n = parse_math2(P);
    while (is_op(cur(P), "~")) {
        const int line = advance(P)->line;
        n = mk_bin(P, OP_CONCAT, n, parse_math2(P), line);
    }
    return n;
}

static node *parse_math1(parser *P) {
    node *n = parse_concat(P);
    for (;;) {
        const token *t = cur(P);
        const int op = is_op(t, "+") ? OP_ADD : is_op(t, "-") ? OP_SUB : 0;
        if (!op) return n;
        const int line = advance(P)->line;
        n = mk_bin(P, op, n, parse_concat(P), line);
    }
}

static node *parse_compare(parser *P) {
    const int line = cur(P)->line;
    node *first = parse_math1(P);
    nvec ops_n = {0};
    int *ops = NULL;
    int cap = 0;
    for (;;) {
        const token *t = cur(P);
        int op = is_op(t, "==")   ? CMP_EQ
                 : is_op(t, "!=") ? CMP_NE
                 : is_op(t, "<")  ? CMP_LT
                 : is_op(t, "<=") ? CMP_LE
                 : is_op(t, ">")  ? CMP_GT
                 : is_op(t, ">=") ? CMP_GE
                                  : 0;
        if (op) {
            advance(P);
        } else if (is_name(t, "in")) {
            advance(P);
            op = CMP_IN;
        } else if (is_name(t, "not") && is_name(peek_at(P, 1), "in")) {
            advance(P);
            advance(P);
            op = CMP_NOTIN;
        } else {
            break;
        }
        if (ops_n.n == cap) {
            cap = cap ? 2 * cap : 2;
            int *no = arena_alloc(&P->e->a, &P->e->f, (size_t)cap * sizeof *no);
            if (ops_n.n) memcpy(no, ops, (size_t)ops_n.n * sizeof *no);
            ops = no;
        }
        ops[ops_n.n] = op;
        nv_push(P, &ops_n, parse_math1(P));
    }
    if (!ops_n.n) return first;
    node *n = mk_node(P, N_CMP, line);
    n->a = first;
    n->v = ops_n.v;
    n->nv = ops_n.n;
    n->ops = ops;
    return n;
}

static node *parse_not(parser *P) {
    if (is_name(cur(P), "not")) {
        node *n = mk_node(P, N_NOT, advance(P)->line);
        n->a = parse_not(P);
        return n;
    }
    return parse_compare(P);
}

static node *parse_and(parser *P) {
    node *n = parse_not(P);
    while (is_name(cur(P), "and")) {
        node *x = mk_node(P, N_AND, advance(P)->line);
        x->a = n;
        x->b = parse_not(P);
        n = x;
    }
    return n;
}

static node *parse_or(parser *P) {
    node *n = parse_and(P);
    while (is_name(cur(P), "or")) {
        node *x = mk_node(P, N_OR, advance(P)->line);
        x->a = n;
        x->b = parse_and(P);
        n = x;
    }
    return n;
}

static node *parse_condexpr(parser *P) {
    node *n = parse_or(P);
    while (is_name(cur(P), "if")) {
        node *c = mk_node(P, N_COND, advance(P)->line);
        c->a = parse_or(P);
        c->b = n;
        if (is_name(cur(P), "else")) {
            advance(P);
            c->c = parse_condexpr(P);
        }
        n = c;
    }
    return n;
}

static node *parse_expression(parser *P, bool with_condexpr) {
    if (++P->e->depth > 200) pfail(P, "expression nested too deeply");
    node *n = with_condexpr ? parse_condexpr(P) : parse_or(P);
    P->e->depth--;
    return n;
}

/* ---- statements ---- */

static node *parse_body(parser *P, const char *const *ends, int nends);

static bool at_block(parser *P, const char *const *names, int n) {
    if (cur(P)->k != K_BBEGIN) return false;
    for (int i = 0; i < n; i++)
        if (is_name(peek_at(P, 1), names[i])) return true;
    return false;
}

/* {% set %} and {% for %} targets: a name, names in a tuple, or (set)
 * namespace.attr */
static node *parse_target(parser *P, bool with_namespace, const char *extra_end) {
    const int line = cur(P)->line;
    if (with_namespace && cur(P)->k == K_NAME && is_op(peek_at(P, 1), ".")) {
        node *n = mk_node(P, N_NSREF, line);
        n->name = expect_name(P);
        advance(P);
        n->cv = mk_undef(expect_name(P));
        return n;
    }
    node *t = parse_tuple(P, true, false, extra_end, false);
    if (t->k == N_NAME) return t;
    if (t->k == N_TUPLE) {
        for (int i = 0; i < t->nv; i++)
            if (t->v[i]->k != N_NAME) pfail(P, "can only assign to names");
        return t;
    }
    pfail(P, "can't assign to this expression");
}

/* Consumes the tag {% name %} parse_body stopped at. */
static void end_tag(parser *P) {
    advance(P); /* {% */
    advance(P); /* its name */
    expect_end(P);
}

/* The statements up to {% end %} into n's body; that tag consumed. */
static void parse_block(parser *P, node *n, const char *end) {
    const char *const ends[] = {end};
    const node *body = parse_body(P, ends, 1);
    n->v = body->v;
    n->nv = body->nv;
    end_tag(P);
}

static node *parse_stmt(parser *P) {
    const int line = cur(P)->line;
    advance(P); /* {% */
    const token *t = cur(P);
    if (t->k != K_NAME) pfail(P, "expected a statement name, got %s", describe(P, t));
    if (is_name(t, "for")) {
        advance(P);
        node *n = mk_node(P, N_FOR, line);
        n->a = parse_target(P, false, "in");
        if (!is_name(cur(P), "in")) pfail(P, "expected 'in' in a for loop");
        advance(P);
        n->b = parse_tuple(P, false, false, "recursive", false);
        if (is_name(cur(P), "if")) {
            advance(P);
            n->c = parse_expression(P, true);
        }
        if (is_name(cur(P), "recursive")) pfail(P, "recursive for loops are not supported");
        expect_end(P);
        static const char *const ends[] = {"endfor", "else"};
        node *body = parse_body(P, ends, 2);
        n->v = body->v;
        n->nv = body->nv;
        const bool has_else = is_name(peek_at(P, 1), "else");
        end_tag(P);
        if (has_else) {
            n->d = mk_node(P, N_BODY, cur(P)->line);
            parse_block(P, n->d, "endfor");
        }
        return n;
    }
    if (is_name(t, "if")) {
        advance(P);
        node *n = mk_node(P, N_IF, line), *top = n;
        for (;;) {
            n->a = parse_tuple(P, false, false, NULL, false);
            expect_end(P);
            static const char *const ends[] = {"elif", "else", "endif"};
            node *body = parse_body(P, ends, 3);
            n->v = body->v;
            n->nv = body->nv;
            const int l2 = cur(P)->line;
            advance(P); /* {% */
            if (is_name(cur(P), "elif")) {
                advance(P);
                n->c = mk_node(P, N_IF, l2);
                n = n->c;
                continue;
            }
            if (is_name(cur(P), "else")) {
                advance(P);
                expect_end(P);
                n->c = mk_node(P, N_BODY, cur(P)->line);
                parse_block(P, n->c, "endif");
                return top;
            }
            advance(P); /* endif */
            expect_end(P);
            return top;
        }
    }
    if (is_name(t, "set")) {
        advance(P);
        node *target = parse_target(P, true, NULL);
        if (is_op(cur(P), "=")) {
            advance(P);
            node *n = mk_node(P, N_SET, line);
            n->a = target;
            n->b = parse_tuple(P, false, true, NULL, false);
            expect_end(P);
            return n;
        }
        node *n = mk_node(P, N_SETBLOCK, line);
        n->a = target;
        if (is_op(cur(P), "|")) n->c = parse_filter(P, NULL, false);
        expect_end(P);
        parse_block(P, n, "endset");
        return n;
    }
    if (is_name(t, "macro")) {
        advance(P);
        node *n = mk_node(P, N_MACRO, line);
        n->name = expect_name(P);
        expect_op(P, "(");
        nvec defs = {0};
        const char **kw = NULL;
        int cap = 0;
        while (!is_op(cur(P), ")")) {
            if (n->nkw) expect_op(P, ",");
            if (is_op(cur(P), ")")) break;
            if (n->nkw == cap) {
                cap = cap ? 2 * cap : 4;
                const char **nk = arena_alloc(&P->e->a, &P->e->f, (size_t)cap * sizeof *nk);
                if (n->nkw) memcpy(nk, kw, (size_t)n->nkw * sizeof *nk);
                kw = nk;
            }
            kw[n->nkw++] = expect_name(P);
            node *def = NULL;
            if (is_op(cur(P), "=")) {
                advance(P);
                def = parse_expression(P, true);
            } else if (defs.n && defs.v[defs.n - 1]) {
                pfail(P, "a macro parameter without a default follows one with a default");
            }
            nv_push(P, &defs, def);
        }
        expect_op(P, ")");
        n->kw = kw;
        n->kv = defs.v;
        expect_end(P);
        parse_block(P, n, "endmacro");
        return n;
    }
    if (is_name(t, "break") || is_name(t, "continue")) {
        node *n = mk_node(P, is_name(t, "break") ? N_BREAK : N_CONTINUE, line);
        advance(P);
        expect_end(P);
        return n;
    }
    if (is_name(t, "filter")) {
        advance(P);
        node *n = mk_node(P, N_FILTERBLOCK, line);
        n->c = parse_filter(P, NULL, true);
        expect_end(P);
        parse_block(P, n, "endfilter");
        return n;
    }
    if (is_name(t, "generation")) { /* transformers' AssistantTracker: renders its body */
        advance(P);
        expect_end(P);
        node *body = mk_node(P, N_BODY, line);
        parse_block(P, body, "endgeneration");
        return body;
    }
    pfail(P, "the {%% %.*s %%} statement is not supported", (int)t->n, t->s);
}

static node *parse_body(parser *P, const char *const *ends, int nends) {
    const int line = cur(P)->line;
    nvec v = {0};
    for (;;) {
        token *t = cur(P);
        if (t->k == K_EOF) {
            if (nends) {
                char want[128] = "";
                for (int i = 0; i < nends; i++)
                    snprintf(want + strlen(want), sizeof want - strlen(want), "%s{%% %s %%}",
                             i ? " or " : "", ends[i]);
                pfail(P, "unexpected end of template: expected %s", want);
            }
            break;
        }
        if (t->k == K_TEXT) {
            node *n = mk_node(P, N_TEXT, t->line);
            n->cv = mk_str(P->e, t->s, t->n);
            nv_push(P, &v, n);
            advance(P);
        } else if (t->k == K_VBEGIN) {
            node *n = mk_node(P, N_OUT, t->line);
            advance(P);
            n->a = parse_tuple(P, false, true, NULL, false);
            if (cur(P)->k != K_VEND) pfail(P, "expected '}}', got %s", describe(P, cur(P)));
            advance(P);
            nv_push(P, &v, n);
        } else if (t->k == K_BBEGIN) {
            if (at_block(P, ends, nends)) break;
            const token *nm = peek_at(P, 1);
            if (nm->k == K_NAME && nm->n > 3 && !memcmp(nm->s, "end", 3))
                pfail(P, "unexpected {%% %.*s %%}", (int)nm->n, nm->s);
            if (is_name(nm, "else") || is_name(nm, "elif"))
                pfail(P, "unexpected {%% %.*s %%}", (int)nm->n, nm->s);
            nv_push(P, &v, parse_stmt(P));
        } else {
            pfail(P, "unexpected %s", describe(P, t));
        }
    }
    node *b = mk_node(P, N_BODY, line);
    b->v = v.v;
    b->nv = v.n;
    return b;
}

/* ---- evaluation: frames, truth, equality, order ---- */

struct frame {
    frame *parent;
    dict_ *vars;
};

static const char *type_name(val v) {
    switch (v.t) {
    case V_UNDEF: return "Undefined";
    case V_NONE: return "NoneType";
    case V_BOOL: return "bool";
    case V_INT: return "int";
    case V_FLOAT: return "float";
    case V_STR: return "str";
    case V_LIST: return v.l->iter ? v.l->iter : v.l->tuple ? "tuple" : "list";
    case V_DICT: return "dict";
    case V_NS: return "Namespace";
    case V_FUNC: return "function";
    case V_LOOP: return "LoopContext";
    }
    return "?";
}

static bool str_eq(const str_ *a, const char *b) {
    return a->len == strlen(b) && !memcmp(a->s, b, a->len);
}

static _Noreturn void undefined_fail(ev *e, val v) {
    if (v.uname) failf(&e->f, "'%s' is undefined", v.uname);
    failf(&e->f, "an undefined value was used");
}

static bool truthy(val v) {
    switch (v.t) {
    case V_UNDEF:
    case V_NONE: return false;
    case V_BOOL: return v.b;
    case V_INT: return v.i != 0;
    case V_FLOAT: return v.f != 0;
    case V_STR: return v.s->len > 0;
    case V_LIST: return v.l->iter && !is_view(v.l) ? true : v.l->n > 0;
    case V_DICT: return v.d->n > 0;
    default: return true;
    }
}

static bool is_num(val v) { return v.t == V_BOOL || v.t == V_INT || v.t == V_FLOAT; }
static double num_f(val v) {
    return v.t == V_FLOAT ? v.f : v.t == V_INT ? (double)v.i : (double)v.b;
}
static int64_t num_i(val v) { return v.t == V_INT ? v.i : (int64_t)v.b; }

static bool vals_eq(val a, val b) {
    if (is_num(a) && is_num(b)) {
        if (a.t != V_FLOAT && b.t != V_FLOAT) return num_i(a) == num_i(b);
        return num_f(a) == num_f(b);
    }
    if (a.t != b.t) return false;
    switch (a.t) {
    case V_UNDEF:
    case V_NONE: return true;
    case V_STR: return a.s->len == b.s->len && !memcmp(a.s->s, b.s->s, a.s->len);
    case V_LIST:
        if (a.l->iter || b.l->iter) return a.l == b.l;
        if (a.l->tuple != b.l->tuple || a.l->n != b.l->n) return false;
        for (size_t i = 0; i < a.l->n; i++)
            if (!vals_eq(a.l->v[i], b.l->v[i])) return false;
        return true;
    case V_DICT:
    case V_NS:
        if (a.d->n != b.d->n) return false;
        for (size_t i = 0; i < a.d->n; i++) {
            size_t j = 0;
            while (j < b.d->n && !vals_eq(a.d->k[i], b.d->k[j])) j++;
            if (j == b.d->n || !vals_eq(a.d->v[i], b.d->v[j])) return false;
        }
        return true;
    case V_FUNC: return a.fn == b.fn;
    case V_LOOP: return a.lp == b.lp;
    default: return false;
    }
}

/* Python's ordering: numbers, strings (code points: UTF-8 bytes order the
 * same), sequences of the same kind element by element */
static int cmp_vals(ev *e, val a, val b) {
    if (is_num(a) && is_num(b)) {
        if (a.t != V_FLOAT && b.t != V_FLOAT) return (num_i(a) > num_i(b)) - (num_i(a) < num_i(b));
        const double x = num_f(a), y = num_f(b);
        return (x > y) - (x < y);
    }
    if (a.t == V_STR && b.t == V_STR) {
        const size_t n = a.s->len < b.s->len ? a.s->len : b.s->len;
        const int c = memcmp(a.s->s, b.s->s, n);
        if (c) return c < 0 ? -1 : 1;
        return (a.s->len > b.s->len) - (a.s->len < b.s->len);
    }
    if (a.t == V_LIST && b.t == V_LIST && a.l->tuple == b.l->tuple) {
        for (size_t i = 0; i < a.l->n && i < b.l->n; i++)
            if (!vals_eq(a.l->v[i], b.l->v[i])) return cmp_vals(e, a.l->v[i], b.l->v[i]);
        return (a.l->n > b.l->n) - (a.l->n < b.l->n);
    }
    failf(&e->f, "'<' not supported between instances of '%s' and '%s'", type_name(a),
          type_name(b));
}

static val *dict_find(dict_ *d, val k) {
    for (size_t i = 0; i < d->n; i++)
        if (vals_eq(d->k[i], k)) return &d->v[i];
    return NULL;
}
static val *dict_find_c(dict_ *d, const char *k) {
    for (size_t i = 0; i < d->n; i++)
        if (d->k[i].t == V_STR && str_eq(d->k[i].s, k)) return &d->v[i];
    return NULL;
}
static void dict_set(ev *e, dict_ *d, val k, val v) {
    val *p = dict_find(d, k);
    if (p) {
        *p = v;
        return;
    }
    if (d->n == d->cap) {
        const size_t cap = 2 * d->cap;
        val *nk = arena_alloc(&e->a, &e->f, cap * sizeof(val));
        val *nv = arena_alloc(&e->a, &e->f, cap * sizeof(val));
        memcpy(nk, d->k, d->n * sizeof(val));
        memcpy(nv, d->v, d->n * sizeof(val));
        d->k = nk;
        d->v = nv;
        d->cap = cap;
    }
    d->k[d->n] = k;
    d->v[d->n++] = v;
}

static val lookup(frame *f, const char *name) {
    for (; f; f = f->parent) {
        val *p = dict_find_c(f->vars, name);
        if (p) return *p;
    }
    return mk_undef(name);
}
static void frame_set(ev *e, frame *f, const char *name, val v) {
    val *p = dict_find_c(f->vars, name);
    if (p)
        *p = v;
    else
        dict_set(e, f->vars, mk_cstr(e, name), v);
}
static frame *new_frame(ev *e, frame *parent) {
    frame *f = arena_alloc(&e->a, &e->f, sizeof *f);
    f->parent = parent;
    f->vars = new_dict(e, 8);
    return f;
}

/* the items a for loop or a filter iterates: a list's, a dict's keys, a
 * string's characters; Undefined: none */
static list_ *iter_items(ev *e, val v) {
    switch (v.t) {
    case V_UNDEF: return new_list(e, 1);
    case V_LIST: return v.l;
    case V_DICT:
    case V_NS: {
        list_ *l = new_list(e, v.d->n);
        for (size_t i = 0; i < v.d->n; i++) list_push(e, l, v.d->k[i]);
        return l;
    }
    case V_STR: {
        list_ *l = new_list(e, v.s->len);
        for (size_t i = 0; i < v.s->len;) {
            const size_t i0 = i;
            (void)u8_next(v.s->s, v.s->len, &i);
            list_push(e, l, mk_str(e, v.s->s + i0, i - i0));
        }
        return l;
    }
    default: failf(&e->f, "'%s' object is not iterable", type_name(v));
    }
}

static val to_str(ev *e, val v) {
    if (v.t == V_STR) return v;
    sbuf b = {0};
    put_str(e, &b, v);
    return sb_val(e, &b);
}

static val eval(ev *e, const node *n, frame *f);

/* ---- attributes, items, slices ---- */

static val mk_method(ev *e, val self, const char *name) {
    func_ *fn = arena_alloc(&e->a, &e->f, sizeof *fn);
    *fn = (func_){.kind = F_METHOD, .name = name, .self = self};
    return (val){.t = V_FUNC, .fn = fn};
}

static const char *const k_str_methods[] = {
    "strip",   "lstrip",  "rstrip",     "split",        "rsplit",       "startswith", "endswith",
    "replace", "upper",   "lower",      "title",        "capitalize",   "find",       "rfind",
    "count",   "join",    "splitlines", "isdigit",      "isalpha",      "isalnum",    "isspace",
    "isupper", "islower", "format",     "index",        "swapcase",     "casefold",   "zfill",
    "center",  "ljust",   "rjust",      "removeprefix", "removesuffix", "partition",  "rpartition"};
static const char *const k_dict_methods[] = {"items",  "keys", "values",     "get",   "copy",
                                             "update", "pop",  "setdefault", "clear", "popitem"};
static const char *const k_list_methods[] = {"index", "count",  "copy",   "append",
                                             "pop",   "insert", "extend", "remove",
                                             "clear", "sort",   "reverse"};

static bool in_names(const char *name, const char *const *names, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!strcmp(name, names[i])) return true;
    return false;
}

static val loop_attr(ev *e, loop_ *lp, const char *name) {
    const size_t n = lp->items->n, i = lp->index0;
    if (!strcmp(name, "index")) return mk_int((int64_t)i + 1);
    if (!strcmp(name, "index0")) return mk_int((int64_t)i);
    if (!strcmp(name, "revindex")) return mk_int((int64_t)(n - i));
    if (!strcmp(name, "revindex0")) return mk_int((int64_t)(n - i - 1));
    if (!strcmp(name, "first")) return mk_bool(i == 0);
    if (!strcmp(name, "last")) return mk_bool(i + 1 == n);
    if (!strcmp(name, "length")) return mk_int((int64_t)n);
    if (!strcmp(name, "depth")) return mk_int(lp->depth0 + 1);
    if (!strcmp(name, "depth0")) return mk_int(lp->depth0);
    if (!strcmp(name, "previtem")) return i > 0 ? lp->items->v[i - 1] : mk_undef("previtem");
    if (!strcmp(name, "nextitem")) return i + 1 < n ? lp->items->v[i + 1] : mk_undef("nextitem");
    if (!strcmp(name, "cycle")) {
        func_ *fn = arena_alloc(&e->a, &e->f, sizeof *fn);
        *fn = (func_){.kind = F_CYCLER, .name = "cycle", .self = {.t = V_LOOP, .lp = lp}};
        return (val){.t = V_FUNC, .fn = fn};
    }
    return mk_undef(name);
}

/* obj.name: jinja2's getattr, then item */
static val get_attr(ev *e, val obj, const char *name) {
    switch (obj.t) {
    case V_UNDEF: undefined_fail(e, obj);
    case V_DICT:
        if (in_names(name, k_dict_methods, TD_ARRAY_SIZE(k_dict_methods)))
            return mk_method(e, obj, name);
        /* fall through */
    case V_NS: {
        val *p = dict_find_c(obj.d, name);
        return p ? *p : mk_undef(name);
    }
    case V_STR:
        if (in_names(name, k_str_methods, TD_ARRAY_SIZE(k_str_methods)))
            return mk_method(e, obj, name);
        return mk_undef(name);
    case V_LIST:
        if (in_names(name, k_list_methods, TD_ARRAY_SIZE(k_list_methods)))
            return mk_method(e, obj, name);
        return mk_undef(name);
    case V_LOOP: return loop_attr(e, obj.lp, name);
    default: return mk_undef(name);
    }
}

static int64_t norm_index(int64_t i, size_t n) { return i < 0 ? i + (int64_t)n : i; }

/* obj[key]: item, then attribute for a string key */
static val get_item(ev *e, val obj, val key) {
    switch (obj.t) {
    case V_UNDEF: undefined_fail(e, obj);
    case V_DICT:
    case V_NS: {
        val *p = dict_find(obj.d, key);
        if (p) return *p;
        break;
    }
    case V_LIST:
    case V_STR:
        if (obj.t == V_LIST && obj.l->iter)
            failf(&e->f, "'%s' object is not subscriptable", obj.l->iter);
        if (key.t == V_INT || key.t == V_BOOL) {
            const size_t n = obj.t == V_LIST ? obj.l->n : u8_len(obj.s->s, obj.s->len);
            const int64_t i = norm_index(num_i(key), n);
            if (i < 0 || i >= (int64_t)n) return mk_undef(NULL);
            if (obj.t == V_LIST) return obj.l->v[i];
            const size_t a = u8_off(obj.s->s, obj.s->len, (size_t)i);
            const size_t b = u8_off(obj.s->s, obj.s->len, (size_t)i + 1);
            return mk_str(e, obj.s->s + a, b - a);
        }
        break;
    case V_LOOP: break;
    default: break;
    }
    if (key.t == V_STR) {
        char *nm = arena_alloc(&e->a, &e->f, key.s->len + 1);
        memcpy(nm, key.s->s, key.s->len);
        nm[key.s->len] = 0;
        if (obj.t == V_DICT || obj.t == V_NS) return mk_undef(nm);
        return get_attr(e, obj, nm);
    }
    return mk_undef(NULL);
}

/* Python's slice.indices */
static void slice_bounds(ev *e, val vs, val ve, val vst, int64_t n, int64_t *start, int64_t *stop,
                         int64_t *step) {
    *step = vst.t == V_NONE || vst.t == V_UNDEF ? 1 : num_i(vst);
    if (vst.t != V_NONE && vst.t != V_UNDEF && vst.t != V_INT && vst.t != V_BOOL)
        failf(&e->f, "slice indices must be integers or None");
    if (*step == 0) failf(&e->f, "slice step cannot be zero");
    const int64_t lo = *step < 0 ? -1 : 0, hi = *step < 0 ? n - 1 : n;
    val ends[2] = {vs, ve};
    int64_t *out[2] = {start, stop};
    for (int k = 0; k < 2; k++) {
        const val x = ends[k];
        if (x.t == V_NONE || x.t == V_UNDEF) {
            *out[k] = (k == 0) == (*step > 0) ? lo : hi;
            continue;
        }
        if (x.t != V_INT && x.t != V_BOOL) failf(&e->f, "slice indices must be integers or None");
        int64_t i = num_i(x);
        if (i < 0) {
            i += n;
            if (i < lo) i = lo;
        } else if (i > hi) {
            i = hi;
        }
        *out[k] = i;
    }
}

static val do_slice(ev *e, val obj, val vs, val ve, val vst) {
    if (obj.t == V_UNDEF) undefined_fail(e, obj);
    if (obj.t != V_LIST && obj.t != V_STR)
        failf(&e->f, "'%s' object is not subscriptable", type_name(obj));
    const bool s = obj.t == V_STR;
    const int64_t n = (int64_t)(s ? u8_len(obj.s->s, obj.s->len) : obj.l->n);
    int64_t start, stop, step;
    slice_bounds(e, vs, ve, vst, n, &start, &stop, &step);
    list_ *l = new_list(e, 8);
    l->tuple = !s && obj.l->tuple;
    sbuf b = {0};
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (s) {
            const size_t a = u8_off(obj.s->s, obj.s->len, (size_t)i);
            const size_t c = u8_off(obj.s->s, obj.s->len, (size_t)i + 1);
            sb_put(e, &b, obj.s->s + a, c - a);
        } else {
            list_push(e, l, obj.l->v[i]);
        }
    }
    return s ? sb_val(e, &b) : mk_list(l);
}

/* ---- arithmetic ---- */

/* markupsafe's escape */
static void html_escape(ev *e, sbuf *b, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        switch (s[i]) {
        case '&': sb_puts(e, b, "&amp;"); break;
        case '<': sb_puts(e, b, "&lt;"); break;
        case '>': sb_puts(e, b, "&gt;"); break;
        case '"': sb_puts(e, b, "&#34;"); break;
        case '\'': sb_puts(e, b, "&#39;"); break;
        default: sb_put(e, b, &s[i], 1);
        }
    }
}

static _Noreturn void op_fail(ev *e, const char *op, val a, val b) {
    if (a.t == V_UNDEF) undefined_fail(e, a);
    if (b.t == V_UNDEF) undefined_fail(e, b);
    failf(&e->f, "unsupported operand type(s) for %s: '%s' and '%s'", op, type_name(a),
          type_name(b));
}

static val repeat(ev *e, val seq, int64_t k) {
    if (k < 0 || (seq.t == V_STR ? seq.s->len == 0 : seq.l->n == 0)) k = 0;
    if (seq.t == V_STR) {
        if (seq.s->len && (uint64_t)k > e->lim->max_output / seq.s->len)
            failf(&e->f, "a repeated string exceeds the output limit");
        sbuf b = {0};
        for (int64_t i = 0; i < k; i++) sb_put(e, &b, seq.s->s, seq.s->len);
        return sb_val(e, &b);
    }
    if (seq.l->n && (uint64_t)k > e->lim->max_iters / seq.l->n)
        failf(&e->f, "a repeated list exceeds the iteration limit");
    list_ *l = new_list(e, seq.l->n * (size_t)k + 1);
    l->tuple = seq.l->tuple;
    for (int64_t i = 0; i < k; i++)
        for (size_t j = 0; j < seq.l->n; j++) list_push(e, l, seq.l->v[j]);
    return mk_list(l);
}

static val binop(ev *e, int op, val a, val b) {
    static const char *const names[] = {"", "+", "-", "*", "/", "//", "%", "**", "~"};
    if (op == OP_CONCAT) {
        sbuf s = {0};
        put_str(e, &s, a);
        put_str(e, &s, b);
        return sb_val(e, &s);
    }
    if (is_num(a) && is_num(b)) {
        const bool fl = a.t == V_FLOAT || b.t == V_FLOAT;
        if (!fl && op != OP_DIV) {
            const int64_t x = num_i(a), y = num_i(b);
            int64_t r;
            switch (op) {
            case OP_ADD:
                if (__builtin_add_overflow(x, y, &r)) break;
                return mk_int(r);
            case OP_SUB:
                if (__builtin_sub_overflow(x, y, &r)) break;
                return mk_int(r);
            case OP_MUL:
                if (__builtin_mul_overflow(x, y, &r)) break;
                return mk_int(r);
            case OP_FLOORDIV:
            case OP_MOD:
                if (y == 0) failf(&e->f, "integer division or modulo by zero");
                if (x == INT64_MIN && y == -1) break;
                {
                    int64_t q = x / y, m = x % y;
                    if (m != 0 && ((m < 0) != (y < 0))) {
                        q -= 1;
                        m += y;
                    }
                    return mk_int(op == OP_MOD ? m : q);
                }
            case OP_POW:
                if (y < 0) return mk_float(pow((double)x, (double)y));
                r = 1;
                for (int64_t i = 0; i < y; i++)
                    if (__builtin_mul_overflow(r, x, &r)) failf(&e->f, "integer power overflows");
                return mk_int(r);
            default: break;
            }
            failf(&e->f, "integer arithmetic overflows");
        }
        const double x = num_f(a), y = num_f(b);
        switch (op) {
        case OP_ADD: return mk_float(x + y);
        case OP_SUB: return mk_float(x - y);
        case OP_MUL: return mk_float(x * y);
        case OP_DIV:
            if (y == 0) failf(&e->f, "division by zero");
            return mk_float(x / y);
        case OP_FLOORDIV:
            if (y == 0) failf(&e->f, "float floor division by zero");
            return mk_float(floor(x / y));
        case OP_MOD: {
            if (y == 0) failf(&e->f, "float modulo");
            double m = fmod(x, y);
            if (m != 0 && ((m < 0) != (y < 0))) m += y;
            return mk_float(m);
        }
        case OP_POW: return mk_float(pow(x, y));
        default: break;
        }
    }
    if (op == OP_ADD && a.t == V_STR && b.t == V_STR) {
        sbuf s = {0};
        const bool markup = a.s->markup || b.s->markup;
        for (int k = 0; k < 2; k++) {
            const str_ *x = k ? b.s : a.s;
            if (markup && !x->markup)
                html_escape(e, &s, x->s, x->len);
            else
                sb_put(e, &s, x->s, x->len);
        }
        const val r = sb_val(e, &s);
        ((str_ *)r.s)->markup = markup;
        return r;
    }
    if (op == OP_ADD && a.t == V_LIST && b.t == V_LIST && a.l->tuple == b.l->tuple && !a.l->iter &&
        !b.l->iter) {
        list_ *l = new_list(e, a.l->n + b.l->n + 1);
        l->tuple = a.l->tuple;
        for (size_t i = 0; i < a.l->n; i++) list_push(e, l, a.l->v[i]);
        for (size_t i = 0; i < b.l->n; i++) list_push(e, l, b.l->v[i]);
        return mk_list(l);
    }
    if (op == OP_MUL && (a.t == V_STR || a.t == V_LIST) && (b.t == V_INT || b.t == V_BOOL))
        return repeat(e, a, num_i(b));
    if (op == OP_MUL && (b.t == V_STR || b.t == V_LIST) && (a.t == V_INT || a.t == V_BOOL))
        return repeat(e, b, num_i(a));
    if (op == OP_MOD && a.t == V_STR)
        failf(&e->f, "printf-style string formatting ('%%') is not supported");
    op_fail(e, names[op], a, b);
}

static bool contains(ev *e, val hay, val needle) {
    switch (hay.t) {
    case V_UNDEF: return false;
    case V_STR:
        if (needle.t != V_STR)
            failf(&e->f, "'in <string>' requires string as left operand, not %s",
                  type_name(needle));
        if (!needle.s->len) return true;
        for (size_t i = 0; i + needle.s->len <= hay.s->len; i++)
            if (!memcmp(hay.s->s + i, needle.s->s, needle.s->len)) return true;
        return false;
    case V_LIST:
        for (size_t i = 0; i < hay.l->n; i++)
            if (vals_eq(hay.l->v[i], needle)) return true;
        return false;
    case V_DICT:
    case V_NS: return dict_find(hay.d, needle) != NULL;
    default: failf(&e->f, "argument of type '%s' is not iterable", type_name(hay));
    }
}

/* ---- calls: arguments, methods ---- */

typedef struct {
    val *pos;
    int npos;
    const char **kw;
    val *kwv;
    int nkw;
} args_t;

/* argument i by position, else by keyword name, else def */
static val arg(const args_t *a, int i, const char *name, val def) {
    if (i >= 0 && i < a->npos) return a->pos[i];
    for (int k = 0; name && k < a->nkw; k++)
        if (!strcmp(a->kw[k], name)) return a->kwv[k];
    return def;
}

static const str_ *arg_str(ev *e, const args_t *a, int i, const char *name, const char *what) {
    const val v = arg(a, i, name, V_UNDEFINED);
    if (v.t != V_STR) failf(&e->f, "%s expects a string, not %s", what, type_name(v));
    return v.s;
}

static bool py_space(uint32_t c) {
    return c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F) || c == 0x85 ||
           c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
           c == 0x202F || c == 0x205F || c == 0x3000;
}

static bool cp_in(uint32_t c, const str_ *chars) {
    for (size_t i = 0; i < chars->len;)
        if (u8_next(chars->s, chars->len, &i) == c) return true;
    return false;
}

/* str.strip/lstrip/rstrip: whitespace, or the code points of chars */
static val str_strip(ev *e, const str_ *s, const str_ *chars, bool left, bool right) {
    size_t a = 0, b = s->len;
    while (left && a < b) {
        size_t i = a;
        const uint32_t c = u8_next(s->s, s->len, &i);
        if (chars ? !cp_in(c, chars) : !py_space(c)) break;
        a = i;
    }
    while (right && b > a) {
        size_t j = b - 1;
        while (j > a && ((unsigned char)s->s[j] & 0xC0) == 0x80) j--;
        size_t i = j;
        const uint32_t c = u8_next(s->s, s->len, &i);
        if (chars ? !cp_in(c, chars) : !py_space(c)) break;
        b = j;
    }
    return mk_str(e, s->s + a, b - a);
}

static val str_split(ev *e, const str_ *s, val sepv, int64_t maxsplit, bool from_right) {
    list_ *l = new_list(e, 8);
    if (sepv.t == V_NONE || sepv.t == V_UNDEF) { /* runs of whitespace */
        /* the words' byte ranges, then maxsplit from the left or the right */
        size_t cap = 16, nw = 0;
        size_t *st = arena_alloc(&e->a, &e->f, 2 * cap * sizeof *st);
        for (size_t i = 0; i < s->len;) {
            size_t j = i;
            if (py_space(u8_next(s->s, s->len, &j))) {
                i = j;
                continue;
            }
            const size_t w0 = i;
            while (i < s->len) {
                j = i;
                if (py_space(u8_next(s->s, s->len, &j))) break;
                i = j;
            }
            if (nw == cap) {
                size_t *n2 = arena_alloc(&e->a, &e->f, 4 * cap * sizeof *n2);
                memcpy(n2, st, 2 * cap * sizeof *n2);
                st = n2;
                cap *= 2;
            }
            st[2 * nw] = w0;
            st[2 * nw + 1] = i;
            nw++;
        }
        if (maxsplit < 0 || (size_t)maxsplit >= nw) {
            for (size_t w = 0; w < nw; w++)
                list_push(e, l, mk_str(e, s->s + st[2 * w], st[2 * w + 1] - st[2 * w]));
            return mk_list(l);
        }
        if (!from_right) {
            for (size_t w = 0; w < (size_t)maxsplit; w++)
                list_push(e, l, mk_str(e, s->s + st[2 * w], st[2 * w + 1] - st[2 * w]));
            /* the rest from the next word on, as it is (Python keeps its
             * trailing whitespace) */
            const size_t b = st[2 * maxsplit];
            list_push(e, l, mk_str(e, s->s + b, s->len - b));
        } else {
            /* the head up to its last word, leading whitespace kept */
            const size_t first = nw - (size_t)maxsplit;
            list_push(e, l, mk_str(e, s->s, st[2 * (first - 1) + 1]));
            for (size_t w = first; w < nw; w++)
                list_push(e, l, mk_str(e, s->s + st[2 * w], st[2 * w + 1] - st[2 * w]));
        }
        return mk_list(l);
    }
    if (sepv.t != V_STR) failf(&e->f, "split: the separator must be a string");
    const str_ *sep = sepv.s;
    if (!sep->len) failf(&e->f, "empty separator");
    /* positions of all separators, left to right, non-overlapping */
    size_t cnt = 0;
    for (size_t i = 0; i + sep->len <= s->len;)
        if (!memcmp(s->s + i, sep->s, sep->len))
            cnt++, i += sep->len;
        else
            i++;
    size_t *pos = arena_alloc(&e->a, &e->f, (cnt + 1) * sizeof *pos);
    size_t np = 0;
    for (size_t i = 0; i + sep->len <= s->len;)
        if (!memcmp(s->s + i, sep->s, sep->len))
            pos[np++] = i, i += sep->len;
        else
            i++;
    size_t use_from = 0, use_n = np;
    if (maxsplit >= 0 && (size_t)maxsplit < np) {
        use_n = (size_t)maxsplit;
        if (from_right) use_from = np - use_n;
    }
    size_t prev = 0;
    for (size_t k = use_from; k < use_from + use_n; k++) {
        list_push(e, l, mk_str(e, s->s + prev, pos[k] - prev));
        prev = pos[k] + sep->len;
    }
    if (from_right && use_from > 0) {
        /* the unsplit head */
        list_ *r = new_list(e, l->n + 1);
        const size_t head_end = pos[use_from];
        list_push(e, r, mk_str(e, s->s, head_end));
        prev = head_end + sep->len;
        for (size_t k = use_from + 1; k < use_from + use_n; k++) {
            list_push(e, r, mk_str(e, s->s + prev, pos[k] - prev));
            prev = pos[k] + sep->len;
        }
        list_push(e, r, mk_str(e, s->s + prev, s->len - prev));
        return mk_list(r);
    }
    list_push(e, l, mk_str(e, s->s + prev, s->len - prev));
    return mk_list(l);
}

static val str_replace(ev *e, const str_ *s, const str_ *old, const str_ *nw, int64_t count) {
    sbuf b = {0};
    int64_t done = 0;
    if (!old->len) {
        for (size_t i = 0; i <= s->len;) {
            if (count < 0 || done < count) {
                sb_put(e, &b, nw->s, nw->len);
                done++;
            }
            if (i == s->len) break;
            const size_t i0 = i;
            (void)u8_next(s->s, s->len, &i);
            sb_put(e, &b, s->s + i0, i - i0);
        }
        return sb_val(e, &b);
    }
    size_t i = 0;
    while (i < s->len) {
        if ((count < 0 || done < count) && i + old->len <= s->len &&
            !memcmp(s->s + i, old->s, old->len)) {
            sb_put(e, &b, nw->s, nw->len);
            i += old->len;
            done++;
        } else {
            sb_put(e, &b, s->s + i, 1);
            i++;
        }
    }
    return sb_val(e, &b);
}

static bool str_affix(const str_ *s, const str_ *x, bool end) {
    if (x->len > s->len) return false;
    return !memcmp(s->s + (end ? s->len - x->len : 0), x->s, x->len);
}

/* ASCII case mapping (what chat templates apply it to: roles, booleans) */
static val str_case(ev *e, const str_ *s,
                    int mode /* 0 upper 1 lower 2 capitalize 3 title 4 swap */) {
    char *d = arena_alloc(&e->a, &e->f, s->len + 1);
    bool start = true;
    for (size_t i = 0; i < s->len; i++) {
        const char c = s->s[i];
        char o = c;
        switch (mode) {
        case 0: o = (char)toupper((unsigned char)c); break;
        case 1: o = (char)tolower((unsigned char)c); break;
        case 2: o = (char)(i == 0 ? toupper((unsigned char)c) : tolower((unsigned char)c)); break;
        case 3: o = (char)(start ? toupper((unsigned char)c) : tolower((unsigned char)c)); break;
        default:
            o = (char)(isupper((unsigned char)c) ? tolower((unsigned char)c)
                                                 : toupper((unsigned char)c));
        }
        if (c & 0x80) o = c;
        d[i] = o;
        start = !isalpha((unsigned char)c) && !(c & 0x80);
    }
    return mk_str(e, d, s->len);
}

static val seq_join(ev *e, val seq, const str_ *sep, const char *attr);

static _Noreturn void unsafe(ev *e, const char *name, val self) {
    failf(&e->f, "access to attribute '%s' of '%s' object is unsafe.", name, type_name(self));
}

static int64_t find_sub(const str_ *s, const str_ *sub, bool last) {
    if (sub->len > s->len) return -1;
    int64_t hit = -1;
    for (size_t i = 0; i + sub->len <= s->len; i++)
        if (!memcmp(s->s + i, sub->s, sub->len)) {
            hit = (int64_t)u8_len(s->s, i);
            if (!last) return hit;
        }
    return hit;
}

static val call_method(ev *e, const func_ *fn, const args_t *a) {
    const val self = fn->self;
    const char *m = fn->name;
    if (self.t == V_STR) {
        const str_ *s = self.s;
        if (!strcmp(m, "strip") || !strcmp(m, "lstrip") || !strcmp(m, "rstrip")) {
            const val c = arg(a, 0, "chars", V_NULL);
            if (c.t != V_NONE && c.t != V_STR) failf(&e->f, "%s arg must be None or str", m);
            return str_strip(e, s, c.t == V_STR ? c.s : NULL, m[0] != 'r', m[0] != 'l');
        }
        if (!strcmp(m, "split") || !strcmp(m, "rsplit")) {
            const val ms = arg(a, 1, "maxsplit", mk_int(-1));
            return str_split(e, s, arg(a, 0, "sep", V_NULL), num_i(ms), m[0] == 'r');
        }
        if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
            const val x = arg(a, 0, NULL, V_UNDEFINED);
            const bool end = m[0] == 'e';
            if (x.t == V_STR) return mk_bool(str_affix(s, x.s, end));
            if (x.t == V_LIST && x.l->tuple) {
                for (size_t i = 0; i < x.l->n; i++) {
                    if (x.l->v[i].t != V_STR) failf(&e->f, "%s: a tuple of strings expected", m);
                    if (str_affix(s, x.l->v[i].s, end)) return mk_bool(true);
                }
                return mk_bool(false);
            }
            failf(&e->f, "%s first arg must be str or a tuple of str, not %s", m, type_name(x));
        }
        if (!strcmp(m, "replace")) {
            const val c = arg(a, 2, "count", mk_int(-1));
            return str_replace(e, s, arg_str(e, a, 0, "old", "replace"),
                               arg_str(e, a, 1, "new", "replace"), num_i(c));
        }
        if (!strcmp(m, "upper")) return str_case(e, s, 0);
        if (!strcmp(m, "lower") || !strcmp(m, "casefold")) return str_case(e, s, 1);
        if (!strcmp(m, "capitalize")) return str_case(e, s, 2);
        if (!strcmp(m, "title")) return str_case(e, s, 3);
        if (!strcmp(m, "swapcase")) return str_case(e, s, 4);
        if (!strcmp(m, "find") || !strcmp(m, "rfind") || !strcmp(m, "index"))
            return mk_int(find_sub(s, arg_str(e, a, 0, NULL, m), m[0] == 'r'));
        if (!strcmp(m, "count")) {
            const str_ *sub = arg_str(e, a, 0, NULL, m);
            int64_t c = 0;
            if (!sub->len) return mk_int((int64_t)u8_len(s->s, s->len) + 1);
            for (size_t i = 0; i + sub->len <= s->len;)
                if (!memcmp(s->s + i, sub->s, sub->len))
                    c++, i += sub->len;
                else
                    i++;
            return mk_int(c);
        }
        if (!strcmp(m, "join")) return seq_join(e, arg(a, 0, NULL, V_UNDEFINED), s, NULL);
        if (!strcmp(m, "splitlines")) {
            list_ *l = new_list(e, 8);
            size_t st = 0;
            for (size_t i = 0; i < s->len; i++) {
                if (s->s[i] == '\n' || s->s[i] == '\r') {
                    list_push(e, l, mk_str(e, s->s + st, i - st));
                    if (s->s[i] == '\r' && i + 1 < s->len && s->s[i + 1] == '\n') i++;
                    st = i + 1;
                }
            }
            if (st < s->len) list_push(e, l, mk_str(e, s->s + st, s->len - st));
            return mk_list(l);
        }
        if (!strncmp(m, "is", 2)) {
            if (!s->len) return mk_bool(false); /* every is...() of "" is False */
            bool any_cased = false, ok = true;
            for (size_t i = 0; i < s->len; i++) {
                const unsigned char c = (unsigned char)s->s[i];
                if (!strcmp(m, "isdigit"))
                    ok = ok && isdigit(c);
                else if (!strcmp(m, "isalpha"))
                    ok = ok && isalpha(c);
                else if (!strcmp(m, "isalnum"))
                    ok = ok && isalnum(c);
                else if (!strcmp(m, "isspace"))
                    ok = ok && isspace(c);
                else if (!strcmp(m, "isupper"))
                    ok = ok && !islower(c), any_cased = any_cased || isupper(c);
                else
                    ok = ok && !isupper(c), any_cased = any_cased || islower(c);
            }
            if (!strcmp(m, "isupper") || !strcmp(m, "islower")) ok = ok && any_cased;
            return mk_bool(ok);
        }
        if (!strcmp(m, "format")) {
            /* {} {0} {name} and {{ }}; no conversions or format specs */
            sbuf b = {0};
            int auto_i = 0;
            for (size_t i = 0; i < s->len; i++) {
                const char c = s->s[i];
                if ((c == '{' || c == '}') && i + 1 < s->len && s->s[i + 1] == c) {
                    sb_put(e, &b, &c, 1);
                    i++;
                    continue;
                }
                if (c == '}') failf(&e->f, "Single '}' encountered in format string");
                if (c != '{') {
                    sb_put(e, &b, &c, 1);
                    continue;
                }
                const char *close = memchr(s->s + i, '}', s->len - i);
                if (!close) failf(&e->f, "Single '{' encountered in format string");
                const char *f0 = s->s + i + 1;
                const size_t fl = (size_t)(close - f0);
                if (memchr(f0, ':', fl) || memchr(f0, '!', fl) || memchr(f0, '.', fl) ||
                    memchr(f0, '[', fl))
                    failf(&e->f,
                          "str.format: conversions, specs and field access are not supported");
                val x;
                if (!fl) {
                    x = arg(a, auto_i++, NULL, V_UNDEFINED);
                    if (auto_i > a->npos)
                        failf(&e->f, "Replacement index %d out of range for positional args tuple",
                              auto_i - 1);
                } else if (isdigit((unsigned char)f0[0])) {
                    const int k = atoi(f0);
                    if (k >= a->npos)
                        failf(&e->f, "Replacement index %d out of range for positional args tuple",
                              k);
                    x = a->pos[k];
                } else {
                    char nm[64];
                    snprintf(nm, sizeof nm, "%.*s", (int)fl, f0);
                    x = arg(a, -1, nm, V_UNDEFINED);
                    bool found = false;
                    for (int k = 0; k < a->nkw; k++) found = found || !strcmp(a->kw[k], nm);
                    if (!found) failf(&e->f, "KeyError: '%s'", nm);
                }
                put_str(e, &b, x);
                i = (size_t)(close - s->s);
            }
            return sb_val(e, &b);
        }
        if (!strcmp(m, "removeprefix") || !strcmp(m, "removesuffix")) {
            const str_ *x = arg_str(e, a, 0, NULL, m);
            const bool end = m[6] == 's';
            if (!str_affix(s, x, end)) return self;
            return mk_str(e, s->s + (end ? 0 : x->len), s->len - x->len);
        }
        failf(&e->f, "the str method '%s' is not supported", m);
    }
    if (self.t == V_DICT) {
        dict_ *d = self.d;
        if (!strcmp(m, "items") || !strcmp(m, "keys") || !strcmp(m, "values")) {
            list_ *l = new_list(e, d->n);
            for (size_t i = 0; i < d->n; i++) {
                if (m[0] == 'k') {
                    list_push(e, l, d->k[i]);
                } else if (m[0] == 'v') {
                    list_push(e, l, d->v[i]);
                } else {
                    list_ *p = new_list(e, 2);
                    p->tuple = true;
                    list_push(e, p, d->k[i]);
                    list_push(e, p, d->v[i]);
                    list_push(e, l, mk_list(p));
                }
            }
            return mk_iter(l, m[0] == 'k'   ? "dict_keys"
                              : m[0] == 'v' ? "dict_values"
                                            : "dict_items");
        }
        if (!strcmp(m, "get")) {
            const val *p = dict_find(d, arg(a, 0, NULL, V_UNDEFINED));
            return p ? *p : arg(a, 1, NULL, V_NULL);
        }
        if (!strcmp(m, "copy")) {
            dict_ *c = new_dict(e, d->n);
            for (size_t i = 0; i < d->n; i++) dict_set(e, c, d->k[i], d->v[i]);
            return (val){.t = V_DICT, .d = c};
        }
        unsafe(e, m, self);
    }
    if (self.t == V_LIST) {
        if (!strcmp(m, "index") || !strcmp(m, "count")) {
            const val x = arg(a, 0, NULL, V_UNDEFINED);
            int64_t c = 0;
            for (size_t i = 0; i < self.l->n; i++)
                if (vals_eq(self.l->v[i], x)) {
                    if (m[0] == 'i') return mk_int((int64_t)i);
                    c++;
                }
            if (m[0] == 'i') failf(&e->f, "list.index(x): x not in list");
            return mk_int(c);
        }
        if (!strcmp(m, "copy")) {
            list_ *l = new_list(e, self.l->n);
            for (size_t i = 0; i < self.l->n; i++) list_push(e, l, self.l->v[i]);
            return mk_list(l);
        }
        unsafe(e, m, self);
    }
    failf(&e->f, "'%s' object has no method '%s'", type_name(self), m);
}

/* ---- filters and tests ---- */

static val apply_filter(ev *e, const char *name, val v, const args_t *a);
static bool apply_test(ev *e, const char *name, val v, const args_t *a);

/* value.attr where attr may be dotted ("a.b") or an index ("0") */
static val attr_path(ev *e, val v, const str_ *path) {
    size_t st = 0;
    for (size_t i = 0; i <= path->len; i++) {
        if (i < path->len && path->s[i] != '.') continue;
        const char *p = path->s + st;
        const size_t n = i - st;
        bool digits = n > 0;
        for (size_t k = 0; k < n; k++) digits = digits && isdigit((unsigned char)p[k]);
        if (digits) {
            v = get_item(e, v, mk_int(strtoll(p, NULL, 10)));
        } else {
            const val key = mk_str(e, p, n);
            v = get_item(e, v, key);
        }
        st = i + 1;
    }
    return v;
}

static val seq_join(ev *e, val seq, const str_ *sep, const char *attr) {
    const list_ *l = iter_items(e, seq);
    sbuf b = {0};
    for (size_t i = 0; i < l->n; i++) {
        if (i && sep) sb_put(e, &b, sep->s, sep->len);
        val x = l->v[i];
        if (attr) x = attr_path(e, x, mk_cstr(e, attr).s);
        if (!attr && !sep) {
            if (x.t != V_STR)
                failf(&e->f, "sequence item %zu: expected str instance, %s found", i, type_name(x));
        }
        put_str(e, &b, x);
    }
    return sb_val(e, &b);
}

static const char *const k_filters[] = {
    "tojson",    "trim",        "length",   "count",      "items",      "join",
    "default",   "d",           "map",      "selectattr", "rejectattr", "select",
    "reject",    "first",       "last",     "list",       "string",     "int",
    "float",     "replace",     "upper",    "lower",      "capitalize", "title",
    "indent",    "safe",        "escape",   "e",          "unique",     "sort",
    "reverse",   "abs",         "round",    "sum",        "min",        "max",
    "wordcount", "center",      "dictsort", "batch",      "striptags",  "truncate",
    "format",    "forceescape", "attr",     "pprint",     "urlencode",  "filesizeformat",
    "tuple",     "bool"};
static const char *const k_tests[] = {
    "defined", "undefined",   "none",   "boolean",  "false",    "true",     "integer",
    "float",   "number",      "string", "mapping",  "iterable", "sequence", "callable",
    "sameas",  "escaped",     "lower",  "upper",    "eq",       "equalto",  "==",
    "ne",      "!=",          "lt",     "lessthan", "<",        "le",       "<=",
    "gt",      "greaterthan", ">",      "ge",       ">=",       "in",       "odd",
    "even",    "divisibleby", "filter", "test"};

/* jinja2's select_or_reject: a generator over value when it is true */
static val select_common(ev *e, val seq, const args_t *a, bool attr_mode, bool keep) {
    const list_ *l = truthy(seq) ? iter_items(e, seq) : new_list(e, 1);
    list_ *out = new_list(e, l->n + 1);
    const int base = attr_mode ? 1 : 0;
    const str_ *attr = attr_mode ? arg_str(e, a, 0, NULL, "selectattr") : NULL;
    const val tv = arg(a, base, NULL, V_UNDEFINED);
    if (tv.t != V_UNDEF && tv.t != V_STR) failf(&e->f, "the test name must be a string");
    char tname[64] = "";
    if (tv.t == V_STR) snprintf(tname, sizeof tname, "%.*s", (int)tv.s->len, tv.s->s);
    /* the test's own arguments: those after the name (none: no pointer
     * arithmetic on an empty list) */
    args_t ta = {.pos = a->npos > base + 1 ? a->pos + base + 1 : NULL,
                 .npos = a->npos > base + 1 ? a->npos - base - 1 : 0};
    for (size_t i = 0; i < l->n; i++) {
        const val x = attr ? attr_path(e, l->v[i], attr) : l->v[i];
        const bool t = tname[0] ? apply_test(e, tname, x, &ta) : truthy(x);
        if (t == keep) list_push(e, out, l->v[i]);
    }
    return mk_iter(out, "generator");
}

static val do_tojson(ev *e, val v, const args_t *a) {
    json_opts o = {.ensure_ascii = truthy(arg(a, 0, "ensure_ascii", mk_bool(false))),
                   .sort_keys = truthy(arg(a, 3, "sort_keys", mk_bool(false)))};
    const val ind = arg(a, 1, "indent", V_NULL);
    if (ind.t == V_INT) {
        char *sp = arena_alloc(&e->a, &e->f, (size_t)(ind.i > 0 ? ind.i : 0) + 1);
        memset(sp, ' ', (size_t)(ind.i > 0 ? ind.i : 0));
        sp[ind.i > 0 ? ind.i : 0] = 0;
        o.indent = sp;
    } else if (ind.t == V_STR) {
        o.indent = mk_str(e, ind.s->s, ind.s->len).s->s;
    } else if (ind.t != V_NONE) {
        failf(&e->f, "tojson: indent must be an int, a string or None");
    }
    o.item_sep = o.indent ? "," : ", ";
    o.key_sep = ": ";
    const val sep = arg(a, 2, "separators", V_NULL);
    if (sep.t == V_LIST && sep.l->n == 2 && sep.l->v[0].t == V_STR && sep.l->v[1].t == V_STR) {
        o.item_sep = mk_str(e, sep.l->v[0].s->s, sep.l->v[0].s->len).s->s;
        o.key_sep = mk_str(e, sep.l->v[1].s->s, sep.l->v[1].s->len).s->s;
    } else if (sep.t != V_NONE) {
        failf(&e->f, "tojson: separators must be a pair of strings");
    }
    sbuf b = {0};
    const int d0 = e->depth;
    put_json(e, &b, v, &o, 0);
    e->depth = d0;
    return sb_val(e, &b);
}

static val do_indent(ev *e, val v, const args_t *a) {
    const val s = to_str(e, v);
    const val w = arg(a, 0, "width", mk_int(4));
    const bool first = truthy(arg(a, 1, "first", mk_bool(false)));
    const bool blank = truthy(arg(a, 2, "blank", mk_bool(false)));
    sbuf ind = {0};
    if (w.t == V_STR)
        sb_put(e, &ind, w.s->s, w.s->len);
    else
        for (int64_t i = 0; i < num_i(w); i++) sb_put(e, &ind, " ", 1);
    /* s + "\n", split into lines as str.splitlines does for \n, \r\n, \r */
    sbuf src = {0};
    sb_put(e, &src, s.s->s, s.s->len);
    sb_put(e, &src, "\n", 1);
    list_ *lines = new_list(e, 8);
    size_t st = 0;
    for (size_t i = 0; i < src.n; i++)
        if (src.p[i] == '\n' || src.p[i] == '\r') {
            list_push(e, lines, mk_str(e, src.p + st, i - st));
            if (src.p[i] == '\r' && i + 1 < src.n && src.p[i + 1] == '\n') i++;
            st = i + 1;
        }
    sbuf out = {0};
    if (first) sb_put(e, &out, ind.p, ind.n);
    for (size_t i = 0; i < lines->n; i++) {
        const str_ *ln = lines->v[i].s;
        if (i) {
            sb_put(e, &out, "\n", 1);
            if (blank || ln->len) sb_put(e, &out, ind.p, ind.n);
        }
        sb_put(e, &out, ln->s, ln->len);
    }
    return sb_val(e, &out);
}

static val to_int(ev *e, val v, val def) {
    switch (v.t) {
    case V_INT: return v;
    case V_BOOL: return mk_int(v.b);
    case V_FLOAT:
        if (!isfinite(v.f)) return def;
        if (fabs(v.f) >= 9.2e18) failf(&e->f, "int(): %g does not fit 64 bits", v.f);
        return mk_int((int64_t)v.f);
    case V_STR: {
        char *t = arena_alloc(&e->a, &e->f, v.s->len + 1);
        memcpy(t, v.s->s, v.s->len);
        t[v.s->len] = 0;
        char *end;
        errno = 0;
        const long long i = strtoll(t, &end, 10);
        while (*end && isspace((unsigned char)*end)) end++;
        if (!errno && end != t && !*end) return mk_int(i);
        const double d = strtod(t, &end);
        while (*end && isspace((unsigned char)*end)) end++;
        if (end != t && !*end && isfinite(d)) {
            if (fabs(d) >= 9.2e18) failf(&e->f, "int(): %g does not fit 64 bits", d);
            return mk_int((int64_t)d);
        }
        return def;
    }
    default: return def;
    }
}

static val sorted(ev *e, const list_ *l, bool reverse, const str_ *attr, bool ci) {
    list_ *o = new_list(e, l->n + 1);
    for (size_t i = 0; i < l->n; i++) list_push(e, o, l->v[i]);
    val *keys = arena_alloc(&e->a, &e->f, (l->n + 1) * sizeof(val));
    for (size_t i = 0; i < l->n; i++) {
        keys[i] = attr ? attr_path(e, l->v[i], attr) : l->v[i];
        if (ci && keys[i].t == V_STR) keys[i] = str_case(e, keys[i].s, 1);
    }
    for (size_t i = 1; i < o->n; i++) /* stable insertion sort */
        for (size_t j = i; j > 0; j--) {
            const int c = cmp_vals(e, keys[j - 1], keys[j]);
            if (reverse ? c >= 0 : c <= 0) break;
            const val t = o->v[j], tk = keys[j];
            o->v[j] = o->v[j - 1];
            keys[j] = keys[j - 1];
            o->v[j - 1] = t;
            keys[j - 1] = tk;
        }
    return mk_list(o);
}

static val apply_filter(ev *e, const char *f, val v, const args_t *a) {
    if (!strcmp(f, "tojson")) return do_tojson(e, v, a);
    if (!strcmp(f, "safe")) {
        const val s = to_str(e, v);
        str_ *m = arena_alloc(&e->a, &e->f, sizeof *m);
        *m = *s.s;
        m->markup = true;
        return (val){.t = V_STR, .s = m};
    }
    if (!strcmp(f, "string")) return to_str(e, v);
    if (!strcmp(f, "trim")) {
        const val c = arg(a, 0, "chars", V_NULL);
        return str_strip(e, to_str(e, v).s, c.t == V_STR ? c.s : NULL, true, true);
    }
    if (!strcmp(f, "length") || !strcmp(f, "count")) {
        switch (v.t) {
        case V_UNDEF: return mk_int(0);
        case V_STR: return mk_int((int64_t)u8_len(v.s->s, v.s->len));
        case V_LIST:
            if (v.l->iter && !is_view(v.l))
                failf(&e->f, "object of type '%s' has no len()", v.l->iter);
            return mk_int((int64_t)v.l->n);
        case V_DICT:
        case V_NS: return mk_int((int64_t)v.d->n);
        default: failf(&e->f, "object of type '%s' has no len()", type_name(v));
        }
    }
    if (!strcmp(f, "items")) {
        if (v.t == V_UNDEF) return mk_list(new_list(e, 1));
        if (v.t != V_DICT) failf(&e->f, "Can only get item pairs from a mapping.");
        func_ fn = {.kind = F_METHOD, .name = "items", .self = v};
        args_t none = {0};
        return mk_iter(call_method(e, &fn, &none).l, "generator");
    }
    if (!strcmp(f, "join")) {
        const val sep = arg(a, 0, "d", V_UNDEFINED);
        const val at = arg(a, 1, "attribute", V_NULL);
        char *attr = NULL;
        if (at.t == V_STR) attr = (char *)mk_str(e, at.s->s, at.s->len).s->s;
        const str_ *s = sep.t == V_STR ? sep.s : mk_cstr(e, "").s;
        return seq_join(e, v, s, attr);
    }
    if (!strcmp(f, "default") || !strcmp(f, "d")) {
        const val def = arg(a, 0, "default_value", mk_cstr(e, ""));
        const bool boolean = truthy(arg(a, 1, "boolean", mk_bool(false)));
        if (v.t == V_UNDEF || (boolean && !truthy(v))) return def;
        return v;
    }
    if (!strcmp(f, "map")) {
        const list_ *l = truthy(v) ? iter_items(e, v) : new_list(e, 1);
        list_ *o = new_list(e, l->n + 1);
        const val at = arg(a, -1, "attribute", V_UNDEFINED);
        if (at.t == V_STR || at.t == V_INT) {
            const val def = arg(a, -1, "default", V_UNDEFINED);
            for (size_t i = 0; i < l->n; i++) {
                val x = at.t == V_STR ? attr_path(e, l->v[i], at.s) : get_item(e, l->v[i], at);
                if (x.t == V_UNDEF && def.t != V_UNDEF) x = def;
                list_push(e, o, x);
            }
            return mk_iter(o, "generator");
        }
        const str_ *fname = arg_str(e, a, 0, NULL, "map");
        char name[64];
        snprintf(name, sizeof name, "%.*s", (int)fname->len, fname->s);
        if (!in_names(name, k_filters, TD_ARRAY_SIZE(k_filters)))
            failf(&e->f, "No filter named '%s'", name);
        args_t fa = {
            .pos = a->pos + 1, .npos = a->npos - 1, .kw = a->kw, .kwv = a->kwv, .nkw = a->nkw};
        for (size_t i = 0; i < l->n; i++) list_push(e, o, apply_filter(e, name, l->v[i], &fa));
        return mk_iter(o, "generator");
    }
    if (!strcmp(f, "selectattr")) return select_common(e, v, a, true, true);
    if (!strcmp(f, "rejectattr")) return select_common(e, v, a, true, false);
    if (!strcmp(f, "select")) return select_common(e, v, a, false, true);
    if (!strcmp(f, "reject")) return select_common(e, v, a, false, false);
    if (!strcmp(f, "first") || !strcmp(f, "last")) {
        const list_ *l = iter_items(e, v);
        if (f[0] == 'l' && v.t == V_LIST && v.l->iter && !is_view(v.l))
            failf(&e->f, "'%s' object is not reversible", v.l->iter);
        if (!l->n) return mk_undef(NULL);
        return f[0] == 'f' ? l->v[0] : l->v[l->n - 1];
    }
    if (!strcmp(f, "list") || !strcmp(f, "tuple")) {
        const list_ *l = iter_items(e, v);
        list_ *o = new_list(e, l->n + 1);
        for (size_t i = 0; i < l->n; i++) list_push(e, o, l->v[i]);
        o->tuple = f[0] == 't';
        return mk_list(o);
    }
    if (!strcmp(f, "int")) return to_int(e, v, arg(a, 0, "default", mk_int(0)));
    if (!strcmp(f, "float")) {
        if (is_num(v)) return mk_float(num_f(v));
        if (v.t == V_STR) {
            const val s = mk_str(e, v.s->s, v.s->len);
            char *end;
            const double d = strtod(s.s->s, &end);
            if (end != s.s->s && !*end) return mk_float(d);
        }
        return arg(a, 0, "default", mk_float(0));
    }
    if (!strcmp(f, "bool")) return mk_bool(truthy(v));
    if (!strcmp(f, "replace")) {
        const val c = arg(a, 2, "count", V_NULL);
        return str_replace(e, to_str(e, v).s, to_str(e, arg(a, 0, "old", V_UNDEFINED)).s,
                           to_str(e, arg(a, 1, "new", V_UNDEFINED)).s, c.t == V_INT ? c.i : -1);
    }
    if (!strcmp(f, "upper")) return str_case(e, to_str(e, v).s, 0);
    if (!strcmp(f, "lower")) return str_case(e, to_str(e, v).s, 1);
    if (!strcmp(f, "capitalize")) return str_case(e, to_str(e, v).s, 2);
    if (!strcmp(f, "title")) return str_case(e, to_str(e, v).s, 3);
    if (!strcmp(f, "indent")) return do_indent(e, v, a);
    if (!strcmp(f, "escape") || !strcmp(f, "e") || !strcmp(f, "forceescape")) {
        const val s = to_str(e, v);
        if (s.s->markup && f[0] != 'f') return s;
        sbuf b = {0};
        html_escape(e, &b, s.s->s, s.s->len);
        const val r = sb_val(e, &b);
        ((str_ *)r.s)->markup = true;
        return r;
    }
    if (!strcmp(f, "unique")) {
        const list_ *l = iter_items(e, v);
        list_ *o = new_list(e, l->n + 1);
        for (size_t i = 0; i < l->n; i++) {
            bool seen = false;
            for (size_t j = 0; j < o->n && !seen; j++) seen = vals_eq(o->v[j], l->v[i]);
            if (!seen) list_push(e, o, l->v[i]);
        }
        return mk_iter(o, "generator");
    }
    if (!strcmp(f, "sort")) {
        const val at = arg(a, 2, "attribute", V_NULL);
        return sorted(e, iter_items(e, v), truthy(arg(a, 0, "reverse", mk_bool(false))),
                      at.t == V_STR ? at.s : NULL,
                      !truthy(arg(a, 1, "case_sensitive", mk_bool(false))));
    }
    if (!strcmp(f, "reverse")) {
        if (v.t == V_STR) {
            const list_ *l = iter_items(e, v);
            sbuf b = {0};
            for (size_t i = l->n; i-- > 0;) sb_put(e, &b, l->v[i].s->s, l->v[i].s->len);
            return sb_val(e, &b);
        }
        const list_ *l = iter_items(e, v);
        list_ *o = new_list(e, l->n + 1);
        for (size_t i = l->n; i-- > 0;) list_push(e, o, l->v[i]);
        /* reversed(); a generator is not reversible, so list(value) reversed */
        if (v.t == V_LIST && v.l->iter && !is_view(v.l)) return mk_list(o);
        return mk_iter(o, "list_reverseiterator");
    }
    if (!strcmp(f, "abs")) {
        if (v.t == V_INT) return mk_int(v.i < 0 ? -v.i : v.i);
        if (v.t == V_FLOAT) return mk_float(fabs(v.f));
        failf(&e->f, "bad operand type for abs(): '%s'", type_name(v));
    }
    if (!strcmp(f, "round")) {
        const int64_t prec = num_i(arg(a, 0, "precision", mk_int(0)));
        const val m = arg(a, 1, "method", V_UNDEFINED);
        const double p10 = pow(10.0, (double)prec), x = num_f(v) * p10;
        double r;
        if (m.t == V_STR && str_eq(m.s, "floor"))
            r = floor(x);
        else if (m.t == V_STR && str_eq(m.s, "ceil"))
            r = ceil(x);
        else
            r = nearbyint(x);
        return mk_float(r / p10);
    }
    if (!strcmp(f, "sum")) {
        const list_ *l = iter_items(e, v);
        const val at = arg(a, 0, "attribute", V_NULL);
        val acc = arg(a, 1, "start", mk_int(0));
        for (size_t i = 0; i < l->n; i++)
            acc = binop(e, OP_ADD, acc, at.t == V_STR ? attr_path(e, l->v[i], at.s) : l->v[i]);
        return acc;
    }
    if (!strcmp(f, "min") || !strcmp(f, "max")) {
        const list_ *l = iter_items(e, v);
        if (!l->n) return mk_undef(NULL);
        val best = l->v[0];
        for (size_t i = 1; i < l->n; i++) {
            const int c = cmp_vals(e, l->v[i], best);
            if (f[1] == 'i' ? c < 0 : c > 0) best = l->v[i];
        }
        return best;
    }
    if (!strcmp(f, "wordcount")) {
        const val w = str_split(e, to_str(e, v).s, V_NULL, -1, false);
        return mk_int((int64_t)w.l->n);
    }
    if (!strcmp(f, "center")) {
        const val s = to_str(e, v);
        const int64_t w = num_i(arg(a, 0, "width", mk_int(80)));
        const int64_t n = (int64_t)u8_len(s.s->s, s.s->len);
        if (w <= n) return s;
        const int64_t pad = w - n, left = pad / 2 + (pad & w & 1);
        sbuf b = {0};
        for (int64_t i = 0; i < left; i++) sb_put(e, &b, " ", 1);
        sb_put(e, &b, s.s->s, s.s->len);
        for (int64_t i = 0; i < pad - left; i++) sb_put(e, &b, " ", 1);
        return sb_val(e, &b);
    }
    if (!strcmp(f, "dictsort")) {
        if (v.t != V_DICT) failf(&e->f, "dictsort: a mapping expected");
        func_ fn = {.kind = F_METHOD, .name = "items", .self = v};
        args_t none = {0};
        const val items = call_method(e, &fn, &none);
        const bool by_value = arg(a, 1, "by", V_UNDEFINED).t == V_STR &&
                              str_eq(arg(a, 1, "by", V_UNDEFINED).s, "value");
        return sorted(e, items.l, truthy(arg(a, 2, "reverse", mk_bool(false))),
                      mk_cstr(e, by_value ? "1" : "0").s,
                      !truthy(arg(a, 0, "case_sensitive", mk_bool(false))));
    }
    if (!strcmp(f, "attr"))
        return get_attr(
            e, v,
            mk_str(e, arg_str(e, a, 0, NULL, "attr")->s, arg_str(e, a, 0, NULL, "attr")->len).s->s);
    failf(&e->f, "the filter '%s' is not supported", f);
}

static bool apply_test(ev *e, const char *t, val v, const args_t *a) {
    const val x = arg(a, 0, NULL, V_UNDEFINED);
    if (!strcmp(t, "defined")) return v.t != V_UNDEF;
    if (!strcmp(t, "undefined")) return v.t == V_UNDEF;
    if (!strcmp(t, "none")) return v.t == V_NONE;
    if (!strcmp(t, "boolean")) return v.t == V_BOOL;
    if (!strcmp(t, "false")) return v.t == V_BOOL && !v.b;
    if (!strcmp(t, "true")) return v.t == V_BOOL && v.b;
    if (!strcmp(t, "integer")) return v.t == V_INT;
    if (!strcmp(t, "float")) return v.t == V_FLOAT;
    if (!strcmp(t, "number")) return is_num(v);
    if (!strcmp(t, "string")) return v.t == V_STR;
    if (!strcmp(t, "mapping")) return v.t == V_DICT || v.t == V_NS;
    if (!strcmp(t, "iterable"))
        return v.t == V_STR || v.t == V_LIST || v.t == V_DICT || v.t == V_UNDEF;
    if (!strcmp(t, "sequence"))
        return v.t == V_STR || v.t == V_LIST || v.t == V_DICT || v.t == V_UNDEF;
    if (!strcmp(t, "callable")) return v.t == V_FUNC;
    if (!strcmp(t, "sameas"))
        return v.t == x.t &&
               (vals_eq(v, x) && (v.t != V_LIST || v.l == x.l) && (v.t != V_DICT || v.d == x.d));
    if (!strcmp(t, "escaped")) return false;
    if (!strcmp(t, "lower") || !strcmp(t, "upper")) {
        const val s = to_str(e, v);
        func_ fn = {.kind = F_METHOD, .name = t[0] == 'l' ? "islower" : "isupper", .self = s};
        args_t none = {0};
        return call_method(e, &fn, &none).b;
    }
    if (!strcmp(t, "eq") || !strcmp(t, "equalto") || !strcmp(t, "==")) return vals_eq(v, x);
    if (!strcmp(t, "ne") || !strcmp(t, "!=")) return !vals_eq(v, x);
    if (!strcmp(t, "lt") || !strcmp(t, "lessthan") || !strcmp(t, "<")) return cmp_vals(e, v, x) < 0;
    if (!strcmp(t, "le") || !strcmp(t, "<=")) return cmp_vals(e, v, x) <= 0;
    if (!strcmp(t, "gt") || !strcmp(t, "greaterthan") || !strcmp(t, ">"))
        return cmp_vals(e, v, x) > 0;
    if (!strcmp(t, "ge") || !strcmp(t, ">=")) return cmp_vals(e, v, x) >= 0;
    if (!strcmp(t, "in")) return contains(e, x, v);
    if (!strcmp(t, "odd") || !strcmp(t, "even")) {
        if (v.t != V_INT && v.t != V_BOOL) failf(&e->f, "the %s test needs an integer", t);
        return (num_i(v) % 2 != 0) == (t[0] == 'o');
    }
    if (!strcmp(t, "divisibleby")) {
        const int64_t d = num_i(x);
        if (!d) failf(&e->f, "integer division or modulo by zero");
        return num_i(v) % d == 0;
    }
    if (!strcmp(t, "filter") || !strcmp(t, "test")) {
        if (v.t != V_STR) return false;
        char nm[64];
        snprintf(nm, sizeof nm, "%.*s", (int)v.s->len, v.s->s);
        return t[0] == 'f' ? in_names(nm, k_filters, TD_ARRAY_SIZE(k_filters))
                           : in_names(nm, k_tests, TD_ARRAY_SIZE(k_tests));
    }
    failf(&e->f, "the test '%s' is not supported", t);
}

/* ---- globals, calls ---- */

static const char *const k_globals[] = {"range", "namespace", "dict", "raise_exception",
                                        "strftime_now"};

static bool known_filter(const char *n) { return in_names(n, k_filters, TD_ARRAY_SIZE(k_filters)); }
static bool known_test(const char *n) { return in_names(n, k_tests, TD_ARRAY_SIZE(k_tests)); }

static int exec_body(ev *e, node *const *v, int nv, frame *f);

static val call_macro(ev *e, const func_ *fn, const args_t *a) {
    const node *m = fn->macro;
    if (++e->depth > e->lim->max_depth)
        failf(&e->f, "macro calls nested deeper than %d", e->lim->max_depth);
    frame *f = new_frame(e, fn->env);
    if (a->npos > m->nkw)
        failf(&e->f, "macro '%s' takes not more than %d argument(s)", m->name, m->nkw);
    for (int k = 0; k < a->nkw; k++) {
        bool ok = false;
        for (int i = 0; i < m->nkw && !ok; i++) ok = !strcmp(a->kw[k], m->kw[i]);
        if (!ok) failf(&e->f, "macro '%s' takes no keyword argument '%s'", m->name, a->kw[k]);
    }
    for (int i = 0; i < m->nkw; i++) {
        val v = arg(a, i, m->kw[i], V_UNDEFINED);
        if (v.t == V_UNDEF && !(i < a->npos)) {
            bool given = false;
            for (int k = 0; k < a->nkw; k++) given = given || !strcmp(a->kw[k], m->kw[i]);
            if (!given) v = m->kv[i] ? eval(e, m->kv[i], f) : mk_undef(m->kw[i]);
        }
        frame_set(e, f, m->kw[i], v);
    }
    sbuf out = {0}, *saved = e->out;
    e->out = &out;
    exec_body(e, m->v, m->nv, f);
    e->out = saved;
    e->depth--;
    return sb_val(e, &out);
}

static val call_global(ev *e, const char *g, const args_t *a) {
    if (!strcmp(g, "raise_exception")) {
        const val m = to_str(e, arg(a, 0, NULL, mk_cstr(e, "")));
        failf(&e->f, "%.*s", (int)m.s->len, m.s->s);
    }
    if (!strcmp(g, "strftime_now")) {
        const val fmt = arg(a, 0, NULL, V_UNDEFINED);
        if (fmt.t != V_STR) failf(&e->f, "strftime_now expects a format string");
        const time_t now = e->lim->now ? (time_t)e->lim->now : time(NULL);
        struct tm tm;
        localtime_r(&now, &tm);
        char buf[256];
        const val fz = mk_str(e, fmt.s->s, fmt.s->len);
        const size_t n = strftime(buf, sizeof buf, fz.s->s, &tm);
        return mk_str(e, buf, n);
    }
    if (!strcmp(g, "namespace") || !strcmp(g, "dict")) {
        dict_ *d = new_dict(e, 8);
        const val init = arg(a, 0, NULL, V_UNDEFINED);
        if (init.t == V_DICT)
            for (size_t i = 0; i < init.d->n; i++) dict_set(e, d, init.d->k[i], init.d->v[i]);
        for (int k = 0; k < a->nkw; k++) dict_set(e, d, mk_cstr(e, a->kw[k]), a->kwv[k]);
        if (g[0] == 'n') /* transformers' TemplateNamespace */
            for (size_t i = 0; i < d->n; i++)
                if (d->k[i].t == V_STR && d->k[i].s->len && d->k[i].s->s[0] == '_')
                    failf(&e->f, "Chat templates cannot store underscore-prefixed attributes on a "
                                 "namespace");
        return (val){.t = g[0] == 'n' ? V_NS : V_DICT, .d = d};
    }
    if (!strcmp(g, "range")) {
        int64_t start = 0, stop, step = 1;
        for (int i = 0; i < a->npos; i++)
            if (a->pos[i].t != V_INT && a->pos[i].t != V_BOOL)
                failf(&e->f, "'%s' object cannot be interpreted as an integer",
                      type_name(a->pos[i]));
        if (a->npos == 1) {
            stop = num_i(a->pos[0]);
        } else if (a->npos >= 2) {
            start = num_i(a->pos[0]);
            stop = num_i(a->pos[1]);
            if (a->npos >= 3) step = num_i(a->pos[2]);
        } else {
            failf(&e->f, "range expected at least 1 argument, got 0");
        }
        if (!step) failf(&e->f, "range() arg 3 must not be zero");
        list_ *l = new_list(e, 8);
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
            if (l->n >= 100000)
                failf(&e->f,
                      "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
            list_push(e, l, mk_int(i));
        }
        return mk_list(l);
    }
    failf(&e->f, "'%s' is not callable", g);
}

static val call_value(ev *e, val fnv, const args_t *a) {
    if (fnv.t == V_UNDEF) undefined_fail(e, fnv);
    if (fnv.t != V_FUNC) failf(&e->f, "'%s' object is not callable", type_name(fnv));
    const func_ *fn = fnv.fn;
    switch (fn->kind) {
    case F_MACRO: return call_macro(e, fn, a);
    case F_GLOBAL: return call_global(e, fn->name, a);
    case F_METHOD: return call_method(e, fn, a);
    case F_CYCLER: {
        if (!a->npos) failf(&e->f, "no items for cycling given");
        return a->pos[fn->self.lp->index0 % (size_t)a->npos];
    }
    }
    failf(&e->f, "not callable");
}

static void eval_args(ev *e, const node *n, frame *f, args_t *a) {
    a->npos = n->nv;
    a->pos = n->nv ? arena_alloc(&e->a, &e->f, (size_t)n->nv * sizeof(val)) : NULL;
    for (int i = 0; i < n->nv; i++) a->pos[i] = eval(e, n->v[i], f);
    a->nkw = n->nkw;
    a->kw = n->kw;
    a->kwv = n->nkw ? arena_alloc(&e->a, &e->f, (size_t)n->nkw * sizeof(val)) : NULL;
    for (int i = 0; i < n->nkw; i++) a->kwv[i] = eval(e, n->kv[i], f);
}

/* ---- expressions ---- */

static void step(ev *e) {
    if (++e->steps > e->lim->max_steps)
        failf(&e->f, "template evaluation exceeds its limit of %" PRIu64 " steps",
              e->lim->max_steps);
}

static val eval(ev *e, const node *n, frame *f) {
    step(e);
    e->f.line = n->line;
    switch (n->k) {
    case N_CONST: return n->cv;
    case N_NAME: return lookup(f, n->name);
    case N_LIST:
    case N_TUPLE: {
        list_ *l = new_list(e, (size_t)n->nv + 1);
        l->tuple = n->k == N_TUPLE;
        for (int i = 0; i < n->nv; i++) list_push(e, l, eval(e, n->v[i], f));
        return mk_list(l);
    }
    case N_DICT: {
        dict_ *d = new_dict(e, (size_t)n->nv / 2 + 1);
        for (int i = 0; i + 1 < n->nv; i += 2) {
            const val k = eval(e, n->v[i], f);
            if (k.t == V_LIST && !k.l->tuple) failf(&e->f, "unhashable type: 'list'");
            if (k.t == V_DICT || k.t == V_NS) failf(&e->f, "unhashable type: 'dict'");
            dict_set(e, d, k, eval(e, n->v[i + 1], f));
        }
        return (val){.t = V_DICT, .d = d};
    }
    case N_ATTR: return get_attr(e, eval(e, n->a, f), n->name);
    case N_ITEM: {
        const val o = eval(e, n->a, f);
        return get_item(e, o, eval(e, n->b, f));
    }
    case N_SLICE: {
        const val o = eval(e, n->a, f);
        val b[3];
        for (int i = 0; i < 3; i++) b[i] = n->v[i] ? eval(e, n->v[i], f) : V_NULL;
        return do_slice(e, o, b[0], b[1], b[2]);
    }
    case N_CALL: {
        const val fnv = eval(e, n->a, f);
        args_t a;
        eval_args(e, n, f, &a);
        e->f.line = n->line;
        return call_value(e, fnv, &a);
    }
    case N_FILTER: {
        if (n->op == 1) failf(&e->f, "No filter named '%s' found.", n->name);
        const val v = eval(e, n->a, f);
        args_t a;
        eval_args(e, n, f, &a);
        e->f.line = n->line;
        return apply_filter(e, n->name, v, &a);
    }
    case N_TEST: {
        if (n->op == 1) failf(&e->f, "No test named '%s' found.", n->name);
        const val v = eval(e, n->a, f);
        args_t a;
        eval_args(e, n, f, &a);
        e->f.line = n->line;
        return mk_bool(apply_test(e, n->name, v, &a));
    }
    case N_NOT: return mk_bool(!truthy(eval(e, n->a, f)));
    case N_NEG:
    case N_POS: {
        const val v = eval(e, n->a, f);
        if (v.t == V_UNDEF) undefined_fail(e, v);
        if (!is_num(v))
            failf(&e->f, "bad operand type for unary %c: '%s'", n->k == N_NEG ? '-' : '+',
                  type_name(v));
        if (n->k == N_POS) return v.t == V_BOOL ? mk_int(v.b) : v;
        if (v.t == V_FLOAT) return mk_float(-v.f);
        if (num_i(v) == INT64_MIN) failf(&e->f, "integer arithmetic overflows");
        return mk_int(-num_i(v));
    }
    case N_BIN: {
        const val a = eval(e, n->a, f);
        const val b = eval(e, n->b, f);
        e->f.line = n->line;
        return binop(e, n->op, a, b);
    }
    case N_AND: {
        const val a = eval(e, n->a, f);
        return truthy(a) ? eval(e, n->b, f) : a;
    }
    case N_OR: {
        const val a = eval(e, n->a, f);
        return truthy(a) ? a : eval(e, n->b, f);
    }
    case N_CMP: {
        val l = eval(e, n->a, f);
        for (int i = 0; i < n->nv; i++) {
            const val r = eval(e, n->v[i], f);
            bool ok;
            switch (n->ops[i]) {
            case CMP_EQ: ok = vals_eq(l, r); break;
            case CMP_NE: ok = !vals_eq(l, r); break;
            case CMP_IN: ok = contains(e, r, l); break;
            case CMP_NOTIN: ok = !contains(e, r, l); break;
            default: {
                if (l.t == V_UNDEF) undefined_fail(e, l);
                if (r.t == V_UNDEF) undefined_fail(e, r);
                const int c = cmp_vals(e, l, r);
                ok = n->ops[i] == CMP_LT   ? c < 0
                     : n->ops[i] == CMP_LE ? c <= 0
                     : n->ops[i] == CMP_GT ? c > 0
                                           : c >= 0;
            }
            }
            if (!ok) return mk_bool(false);
            l = r;
        }
        return mk_bool(true);
    }
    case N_COND:
        if (truthy(eval(e, n->a, f))) return eval(e, n->b, f);
        return n->c ? eval(e, n->c, f) : mk_undef(NULL);
    default: failf(&e->f, "internal: statement node in an expression");
    }
}

/* ---- statements ---- */

enum { X_NEXT, X_BREAK, X_CONTINUE };

static void assign(ev *e, const node *t, val v, frame *f) {
    if (t->k == N_NAME) {
        frame_set(e, f, t->name, v);
        return;
    }
    if (t->k == N_NSREF) {
        const val ns = lookup(f, t->name);
        if (ns.t != V_NS) failf(&e->f, "cannot assign attribute on non-namespace object");
        if (t->cv.uname[0] == '_')
            failf(&e->f,
                  "Chat templates cannot store underscore-prefixed attributes on a namespace");
        dict_set(e, ns.d, mk_cstr(e, t->cv.uname), v);
        return;
    }
    const list_ *l = iter_items(e, v);
    if ((int)l->n != t->nv)
        failf(&e->f, "%s values to unpack (expected %d, got %zu)",
              (int)l->n > t->nv ? "too many" : "not enough", t->nv, l->n);
    for (int i = 0; i < t->nv; i++) frame_set(e, f, t->v[i]->name, l->v[i]);
}

static val capture(ev *e, node *const *v, int nv, frame *f) {
    sbuf out = {0}, *saved = e->out;
    e->out = &out;
    exec_body(e, v, nv, f);
    e->out = saved;
    return sb_val(e, &out);
}

static val filter_chain(ev *e, const node *fc, val v, frame *f) {
    if (!fc) return v;
    v = filter_chain(e, fc->a, v, f);
    args_t a;
    eval_args(e, fc, f, &a);
    e->f.line = fc->line;
    return apply_filter(e, fc->name, v, &a);
}

static int exec_node(ev *e, const node *n, frame *f) {
    step(e);
    e->f.line = n->line;
    switch (n->k) {
    case N_TEXT: sb_put(e, e->out, n->cv.s->s, n->cv.s->len); return X_NEXT;
    case N_OUT: put_str(e, e->out, eval(e, n->a, f)); return X_NEXT;
    case N_IF:
        if (truthy(eval(e, n->a, f))) return exec_body(e, n->v, n->nv, f);
        if (!n->c) return X_NEXT;
        if (n->c->k == N_IF) return exec_node(e, n->c, f);
        return exec_body(e, n->c->v, n->c->nv, f);
    case N_FOR: {
        const val it = eval(e, n->b, f);
        if (it.t == V_NONE) failf(&e->f, "'NoneType' object is not iterable");
        const list_ *items = iter_items(e, it);
        frame *lf = new_frame(e, f);
        if (n->c) {
            list_ *kept = new_list(e, items->n + 1);
            for (size_t i = 0; i < items->n; i++) {
                assign(e, n->a, items->v[i], lf);
                if (truthy(eval(e, n->c, lf))) list_push(e, kept, items->v[i]);
            }
            items = kept;
        }
        loop_ *lp = arena_alloc(&e->a, &e->f, sizeof *lp);
        *lp = (loop_){.items = items};
        frame_set(e, lf, "loop", (val){.t = V_LOOP, .lp = lp});
        for (size_t i = 0; i < items->n; i++) {
            if (++e->iters > e->lim->max_iters)
                failf(&e->f, "template loops exceed their limit of %" PRIu64 " iterations",
                      e->lim->max_iters);
            lp->index0 = i;
            assign(e, n->a, items->v[i], lf);
            if (exec_body(e, n->v, n->nv, lf) == X_BREAK) break;
        }
        if (!items->n && n->d) return exec_body(e, n->d->v, n->d->nv, f);
        return X_NEXT;
    }
    case N_SET: assign(e, n->a, eval(e, n->b, f), f); return X_NEXT;
    case N_SETBLOCK:
        assign(e, n->a, filter_chain(e, n->c, capture(e, n->v, n->nv, f), f), f);
        return X_NEXT;
    case N_MACRO: {
        func_ *fn = arena_alloc(&e->a, &e->f, sizeof *fn);
        *fn = (func_){.kind = F_MACRO, .name = n->name, .macro = n, .env = f};
        frame_set(e, f, n->name, (val){.t = V_FUNC, .fn = fn});
        return X_NEXT;
    }
    case N_BREAK: return X_BREAK;
    case N_CONTINUE: return X_CONTINUE;
    case N_FILTERBLOCK: {
        const val v = filter_chain(e, n->c, capture(e, n->v, n->nv, f), f);
        put_str(e, e->out, v);
        return X_NEXT;
    }
    case N_BODY: return exec_body(e, n->v, n->nv, f);
    default: failf(&e->f, "internal: expression node as a statement");
    }
}

static int exec_body(ev *e, node *const *v, int nv, frame *f) {
    for (int i = 0; i < nv; i++) {
        const int r = exec_node(e, v[i], f);
        if (r != X_NEXT) return r;
    }
    return X_NEXT;
}

/* Unknown filters and tests: a compile error, except where jinja2 defers
 * it to run time (inside an if statement's test and branches and in a
 * conditional expression, its "soft" frames): there the node fails when
 * it runs (op 1). */
static void check_names(ev *e, node *n, bool soft) {
    if (!n) return;
    if (n->k == N_FILTER || n->k == N_TEST) {
        if (!(n->k == N_FILTER ? known_filter(n->name) : known_test(n->name))) {
            if (!soft) {
                e->f.line = n->line;
                failf(&e->f, "No %s named '%s'.", n->k == N_FILTER ? "filter" : "test", n->name);
            }
            n->op = 1;
        }
    }
    const bool in_if = n->k == N_IF || n->k == N_COND;
    const bool inner =
        n->k == N_FOR || n->k == N_MACRO || n->k == N_SETBLOCK || n->k == N_FILTERBLOCK;
    check_names(e, n->a, soft || in_if);
    check_names(e, n->b, soft || in_if);
    check_names(e, n->c, soft || in_if);
    check_names(e, n->d, !inner && (soft || in_if));
    for (int i = 0; i < n->nv; i++) check_names(e, n->v[i], !inner && (soft || in_if));
    for (int i = 0; i < n->nkw; i++) check_names(e, n->kv[i], soft || in_if);
}

/* ---- the API ---- */

struct td_tmpl {
    ev c; /* the compile's arena holds the AST */
    node *root;
};

td_tmpl_limits td_tmpl_default_limits(void) {
    return (td_tmpl_limits){.max_output = 16u << 20,
                            .max_memory = 256u << 20,
                            .max_steps = 10000000,
                            .max_iters = 1000000,
                            .max_depth = 64,
                            .now = 0};
}

td_tmpl *td_tmpl_compile(const char *src, char *err, size_t errlen) {
    td_tmpl *volatile t = calloc(1, sizeof *t);
    if (!t) {
        if (err && errlen) snprintf(err, errlen, "out of memory");
        return NULL;
    }
    static const td_tmpl_limits unlimited = {.max_output = SIZE_MAX, .max_depth = 1 << 30};
    t->c.lim = &unlimited;
    t->c.f.err = err;
    t->c.f.errlen = errlen;
    if (setjmp(t->c.f.jb)) {
        arena_free(&t->c.a);
        free(t);
        return NULL;
    }
    lexer L = {.e = &t->c, .src = src, .len = strlen(src), .line = 1};
    lex_all(&L);
    parser P = {.L = &L, .e = &t->c};
    t->root = parse_body(&P, NULL, 0);
    check_names(&t->c, t->root, false);
    t->c.f.err = NULL;
    t->c.f.errlen = 0;
    return t;
}

void td_tmpl_free(td_tmpl *t) {
    if (!t) return;
    arena_free(&t->c.a);
    free(t);
}

static val from_json(ev *e, const json_t *j) {
    if (++e->depth > e->lim->max_depth)
        failf(&e->f, "the context nests deeper than %d", e->lim->max_depth);
    val v;
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        dict_ *d = new_dict(e, json_object_size(j) + 1);
        const char *k;
        json_t *x;
        json_object_foreach((json_t *)j, k, x) {
            if (d->n == d->cap)
                dict_set(e, d, mk_cstr(e, k), from_json(e, x));
            else {
                d->k[d->n] = mk_cstr(e, k);
                d->v[d->n++] = from_json(e, x);
            }
        }
        v = (val){.t = V_DICT, .d = d};
        break;
    }
    case JSON_ARRAY: {
        list_ *l = new_list(e, json_array_size(j) + 1);
        for (size_t i = 0; i < json_array_size(j); i++)
            list_push(e, l, from_json(e, json_array_get(j, i)));
        v = mk_list(l);
        break;
    }
    case JSON_STRING: v = mk_str(e, json_string_value(j), json_string_length(j)); break;
    case JSON_INTEGER: v = mk_int(json_integer_value(j)); break;
    case JSON_REAL: v = mk_float(json_real_value(j)); break;
    case JSON_TRUE: v = mk_bool(true); break;
    case JSON_FALSE: v = mk_bool(false); break;
    default: v = V_NULL; break;
    }
    e->depth--;
    return v;
}

td_status td_tmpl_render(const td_tmpl *t, const json_t *ctx, const td_tmpl_limits *lim, char **out,
                         size_t *out_len, char *err, size_t errlen) {
    const td_tmpl_limits def = td_tmpl_default_limits();
    ev e = {.lim = lim ? lim : &def};
    e.a.limit = e.lim->max_memory;
    e.f.err = err;
    e.f.errlen = errlen;
    sbuf o = {0};
    if (setjmp(e.f.jb)) {
        arena_free(&e.a);
        return TD_ERR_INVALID;
    }
    if (!ctx || !json_is_object(ctx)) failf(&e.f, "the context must be a JSON object");
    frame *g = new_frame(&e, NULL);
    for (size_t i = 0; i < TD_ARRAY_SIZE(k_globals); i++) {
        func_ *fn = arena_alloc(&e.a, &e.f, sizeof *fn);
        *fn = (func_){.kind = F_GLOBAL, .name = k_globals[i]};
        frame_set(&e, g, k_globals[i], (val){.t = V_FUNC, .fn = fn});
    }
    frame *top = new_frame(&e, g);
    const char *k;
    json_t *x;
    json_object_foreach((json_t *)ctx, k, x) frame_set(&e, top, k, from_json(&e, x));
    e.globals = g;
    e.out = &o;
    exec_body(&e, t->root->v, t->root->nv, top);
    char *r = malloc(o.n + 1);
    if (!r) {
        arena_free(&e.a);
        if (err && errlen) snprintf(err, errlen, "out of memory");
        return TD_ERR_NOMEM;
    }
    if (o.n) memcpy(r, o.p, o.n);
    r[o.n] = 0;
    *out = r;
    if (out_len) *out_len = o.n;
    arena_free(&e.a);
    return TD_OK;
}
