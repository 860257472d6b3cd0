/* JSON Schema to grammar (json_schema.h). */
#include "common/grammar/json_schema.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/strbuf.h"
#include "common/grammar/util.h"

/* ---- the normal form ---- */

enum { J_ANY, J_UNSAT, J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ, J_ANYOF, J_ONEOF, J_REF };

#define NONE UINT32_MAX /* no bound */

typedef struct {
    bool has, excl;
    double v;
} bound;

typedef struct {
    const char *s;
    size_t n;
} name;

typedef struct js js;
struct js {
    int kind;
    const char *why; /* J_UNSAT */
    int bval;        /* J_BOOL: -1 either, else the value */
    /* J_NUM */
    bool integer;
    bound lo, hi;
    uint32_t mult_p, mult_k; /* multipleOf p / 10^k (p 0: none) */
    /* J_STR: rx is the text's language (TD_RX_FAIL: any text); lit the
     * text of a const (lit.s NULL otherwise) */
    uint32_t minlen, maxlen;
    td_rx_id rx;
    name lit;
    /* J_ARR: items NULL means any */
    uint32_t minitems, maxitems;
    js **prefix;
    size_t nprefix;
    js *items;
    /* J_OBJ: props in schema order; additional NULL means any */
    name *names;
    js **props;
    size_t nprops;
    name *required;
    size_t nrequired;
    js *additional;
    uint32_t minprops, maxprops;
    /* J_ANYOF, J_ONEOF */
    js **opts;
    size_t nopts;
    size_t ref; /* J_REF: index into the ref table */
    bool made;  /* sym is this node's symbol (GEN_UNSAT: none fits) */
    td_gram_sym sym;
};

typedef struct {
    char *uri; /* the $ref text */
    json_t *target;
    int state; /* 0 not read, 1 being read, 2 read */
    js *schema;
    td_gram_sym sym; /* UINT32_MAX until made */
} ref;

enum { DRAFT_7, DRAFT_2019, DRAFT_2020 };

typedef struct {
    td_json_opts o;
    json_t *root;
    int draft;
    /* URIs: the schema resources ($id) and anchors, each with its node;
     * base is the base URI of the schema being read */
    struct {
        const char *uri;
        json_t *node;
    } * res, *anchors;
    size_t nres, capres, nanchors, capanchors;
    const char *base, *base_root;
    void **allocs;
    size_t nallocs, capallocs;
    uint32_t work;
    char err[512];
    bool failed;
    td_strbuf ptr; /* the JSON Pointer being read */
    char wherebuf[200];
    ref *refs;
    size_t nrefs, caprefs;
    js any, unsat_false;
    /* output */
    td_gram *g;
    td_rx *rx;
    td_rx_id *lexrx;
    td_gram_sym *lexsym;
    size_t nlex, caplex;
    td_gram_sym empty, any_sym, item_sep, key_sep, string_sym;
    size_t *pending;
    size_t npending, cappending;
} C;

static void fail(C *c, const char *fmt, ...) {
    if (c->failed) return;
    c->failed = true;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
}

/* The pointer being read, for a message: its last 160 bytes after "..."
 * when longer. */
static const char *where(C *c) {
    if (!c->ptr.n) return "the root";
    if (c->ptr.n <= 160) return c->ptr.v;
    snprintf(c->wherebuf, sizeof c->wherebuf, "...%s", c->ptr.v + c->ptr.n - 160);
    return c->wherebuf;
}

/* A refusal at the pointer being read, one segment below it (key, or
 * none). */
static void refuse(C *c, const char *key, const char *fmt, ...) {
    if (c->failed) return;
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (key)
        fail(c, "at %s/%s: %s", c->ptr.n ? where(c) : "", key, msg);
    else
        fail(c, "at %s: %s", where(c), msg);
}

static void *al(C *c, size_t n) {
    if (c->failed) return NULL;
    void *p = calloc(1, n ? n : 1);
    if (!p || !td_gr_reserve((void **)&c->allocs, &c->capallocs, c->nallocs, sizeof *c->allocs)) {
        free(p);
        fail(c, "out of memory");
        return NULL;
    }
    c->allocs[c->nallocs++] = p;
    return p;
}

static bool count(C *c) {
    if (c->failed) return false;
    if (++c->work > c->o.max_schema_nodes) {
        fail(c, "the schema is too large: more than %u nodes read and intersected",
             c->o.max_schema_nodes);
        return false;
    }
    return true;
}

static js *mk(C *c, int kind) {
    if (!count(c)) return NULL;
    js *s = al(c, sizeof *s);
    if (!s) return NULL;
    s->kind = kind;
    s->bval = -1;
    s->maxlen = s->maxitems = s->maxprops = NONE;
    s->rx = TD_RX_FAIL;
    return s;
}

static js *unsat(C *c, const char *why) {
    js *s = mk(c, J_UNSAT);
    if (s) s->why = why;
    return s;
}

static js *copy(C *c, const js *a) {
    js *s = mk(c, a->kind);
    if (s) *s = *a;
    return s;
}

/* Appends the pointer segment key (escaped ~0 ~1); returns the length to
 * restore. */
static size_t ptr_push(C *c, const char *key, size_t n) {
    size_t at = c->ptr.n;
    td_strbuf_put(&c->ptr, "/", 1);
    for (size_t i = 0; i < n; i++) {
        if (key[i] == '~')
            td_strbuf_put(&c->ptr, "~0", 2);
        else if (key[i] == '/')
            td_strbuf_put(&c->ptr, "~1", 2);
        else
            td_strbuf_put(&c->ptr, key + i, 1);
    }
    return at;
}

static size_t ptr_push_index(C *c, size_t i) {
    char b[32];
    int n = snprintf(b, sizeof b, "%zu", i);
    return ptr_push(c, b, (size_t)n);
}

static void ptr_pop(C *c, size_t at) {
    c->ptr.n = at;
    if (c->ptr.v) c->ptr.v[at] = 0;
}

static bool name_eq(name a, const char *s, size_t n) { return a.n == n && !memcmp(a.s, s, n); }

/* ---- reading a schema ---- */

static js *read_schema(C *c, json_t *v, int depth);
static js *read_object(C *c, json_t *v, int depth);

static js *read_at(C *c, json_t *v, const char *key, int depth) {
    size_t at = ptr_push(c, key, strlen(key));
    js *s = read_schema(c, v, depth + 1);
    ptr_pop(c, at);
    return s;
}

static bool get_count(C *c, json_t *v, const char *key, uint32_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) {
        refuse(c, key, "must be a non-negative integer");
        return false;
    }
    json_int_t x = json_integer_value(v);
    *out = x >= (json_int_t)NONE ? NONE - 1 : (uint32_t)x;
    return true;
}

static bool get_number(C *c, json_t *v, const char *key, double *out) {
    if (!json_is_number(v)) {
        refuse(c, key, "must be a number");
        return false;
    }
    *out = json_number_value(v);
    if (!isfinite(*out)) {
        refuse(c, key, "must be finite");
        return false;
    }
    return true;
}

/* The lower of two bounds on the same side: lower when lo is false. */
static bound tighter(bound a, bound b, bool lo) {
    if (!a.has) return b;
    if (!b.has) return a;
    if (a.v == b.v) return (bound){true, a.excl || b.excl, a.v};
    return (lo ? a.v > b.v : a.v < b.v) ? a : b;
}

typedef struct {
    const char *k;
    json_t *v;
} kv;

static bool decimal(double v, char *ip, size_t ipn, char *fp, size_t fpn);

#define MAX_DIVISOR 1000000u

/* multipleOf m as p / 10^k. */
static bool read_multiple(C *c, js *s, double m) {
    char I[400], F[400];
    if (!(m > 0) || !decimal(m, I, sizeof I, F, sizeof F)) {
        refuse(c, "multipleOf", "must be a number above 0");
        return false;
    }
    uint64_t p = 0;
    size_t k = strlen(F);
    char digits[800];
    snprintf(digits, sizeof digits, "%s%s", I, F);
    for (const char *d = digits; *d && p <= MAX_DIVISOR; d++) p = p * 10 + (uint64_t)(*d - '0');
    if (p > MAX_DIVISOR || k > 30) {
        refuse(c, "multipleOf",
               "%g: a multiple of more than %u units of its last digit is not "
               "supported",
               m, MAX_DIVISOR);
        return false;
    }
    s->mult_p = (uint32_t)p;
    s->mult_k = (uint32_t)k;
    return true;
}

static uint64_t gcd64(uint64_t a, uint64_t b) {
    while (b) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

static js *read_format(C *c, js *s, json_t *v);

static js *read_type(C *c, const char *type, const kv *kw, size_t nkw, int depth) {
    js *s = NULL;
    if (!strcmp(type, "null")) return mk(c, J_NULL);
    if (!strcmp(type, "boolean")) return mk(c, J_BOOL);
    if (!strcmp(type, "number") || !strcmp(type, "integer")) {
        if (!(s = mk(c, J_NUM))) return NULL;
        s->integer = type[0] == 'i';
        bound mn = {0}, mx = {0}, xmn = {0}, xmx = {0};
        for (size_t i = 0; i < nkw; i++) {
            const char *k = kw[i].k;
            json_t *x = kw[i].v;
            if (!strcmp(k, "minimum") || !strcmp(k, "maximum")) {
                bound *b = k[1] == 'i' ? &mn : &mx;
                if (!get_number(c, x, k, &b->v)) return NULL;
                b->has = true;
            } else if (!strcmp(k, "exclusiveMinimum") || !strcmp(k, "exclusiveMaximum")) {
                bound *b = k[10] == 'i' ? &xmn : &xmx;
                if (json_is_boolean(x)) { /* draft 4: applies to minimum/maximum */
                    b->has = json_is_true(x);
                    b->excl = true;
                    b->v = NAN;
                    continue;
                }
                if (!get_number(c, x, k, &b->v)) return NULL;
                b->has = b->excl = true;
            } else if (!strcmp(k, "multipleOf")) {
                double m;
                if (!get_number(c, x, k, &m)) return NULL;
                if (!read_multiple(c, s, m)) return NULL;
            }
        }
        if (xmn.has && isnan(xmn.v)) xmn = mn.has ? (bound){true, true, mn.v} : (bound){0};
        if (xmx.has && isnan(xmx.v)) xmx = mx.has ? (bound){true, true, mx.v} : (bound){0};
        s->lo = tighter(mn, xmn, true);
        s->hi = tighter(mx, xmx, false);
        return s;
    }
    if (!strcmp(type, "string")) {
        if (!(s = mk(c, J_STR))) return NULL;
        for (size_t i = 0; i < nkw; i++) {
            const char *k = kw[i].k;
            json_t *x = kw[i].v;
            if (!strcmp(k, "minLength")) {
                if (!get_count(c, x, k, &s->minlen)) return NULL;
            } else if (!strcmp(k, "maxLength")) {
                if (!get_count(c, x, k, &s->maxlen)) return NULL;
            } else if (!strcmp(k, "pattern")) {
                if (!json_is_string(x)) {
                    refuse(c, k, "must be a string");
                    return NULL;
                }
                td_rx_id r;
                char e[200];
                if (td_rx_parse(c->rx, json_string_value(x), json_string_length(x), TD_RX_SEARCH,
                                &r, e, sizeof e)) {
                    refuse(c, k, "%s", e);
                    return NULL;
                }
                s->rx = s->rx == TD_RX_FAIL ? r : td_rx_and(c->rx, s->rx, r);
            } else if (!strcmp(k, "format")) {
                if (!read_format(c, s, x)) return NULL;
            }
        }
        return s;
    }
    if (!strcmp(type, "array")) {
        if (!(s = mk(c, J_ARR))) return NULL;
        json_t *items = NULL, *prefix = NULL, *addl = NULL;
        for (size_t i = 0; i < nkw; i++) {
            const char *k = kw[i].k;
            json_t *x = kw[i].v;
            if (!strcmp(k, "minItems")) {
                if (!get_count(c, x, k, &s->minitems)) return NULL;
            } else if (!strcmp(k, "maxItems")) {
                if (!get_count(c, x, k, &s->maxitems)) return NULL;
            } else if (!strcmp(k, "items"))
                items = x;
            else if (!strcmp(k, "prefixItems"))
                prefix = x;
            else if (!strcmp(k, "additionalItems"))
                addl = x;
        }
        const char *prefix_key = "prefixItems", *items_key = "items";
        if (c->draft <= DRAFT_2019 || addl || json_is_array(items)) {
            /* items as an array is the tuple; additionalItems the rest */
            if (json_is_array(items)) {
                prefix = items;
                prefix_key = "items";
                items = addl;
                items_key = "additionalItems";
            } else {
                prefix = NULL;
            }
        }
        if (prefix) {
            if (!json_is_array(prefix)) {
                refuse(c, prefix_key, "must be an array");
                return NULL;
            }
            s->nprefix = json_array_size(prefix);
            if (!(s->prefix = al(c, s->nprefix * sizeof *s->prefix))) return NULL;
            size_t at = ptr_push(c, prefix_key, strlen(prefix_key));
            for (size_t i = 0; i < s->nprefix; i++) {
                size_t at2 = ptr_push_index(c, i);
                s->prefix[i] = read_schema(c, json_array_get(prefix, i), depth + 1);
                ptr_pop(c, at2);
                if (!s->prefix[i]) return NULL;
            }
            ptr_pop(c, at);
        }
        if (items && !(s->items = read_at(c, items, items_key, depth))) return NULL;
        return s;
    }
    if (!strcmp(type, "object")) {
        if (!(s = mk(c, J_OBJ))) return NULL;
        json_t *props = NULL, *req = NULL, *addl = NULL;
        for (size_t i = 0; i < nkw; i++) {
            const char *k = kw[i].k;
            json_t *x = kw[i].v;
            if (!strcmp(k, "minProperties")) {
                if (!get_count(c, x, k, &s->minprops)) return NULL;
            } else if (!strcmp(k, "maxProperties")) {
                if (!get_count(c, x, k, &s->maxprops)) return NULL;
            } else if (!strcmp(k, "properties"))
                props = x;
            else if (!strcmp(k, "required"))
                req = x;
            else if (!strcmp(k, "additionalProperties"))
                addl = x;
        }
        if (props) {
            if (!json_is_object(props)) {
                refuse(c, "properties", "must be an object");
                return NULL;
            }
            size_t n = json_object_size(props);
            s->names = al(c, n * sizeof *s->names);
            s->props = al(c, n * sizeof *s->props);
            if (!s->names || !s->props) return NULL;
            size_t at = ptr_push(c, "properties", 10);
            for (void *it = json_object_iter(props); it; it = json_object_iter_next(props, it)) {
                const char *key = json_object_iter_key(it);
                size_t kn = json_object_iter_key_len(it);
                size_t at2 = ptr_push(c, key, kn);
                js *p = read_schema(c, json_object_iter_value(it), depth + 1);
                ptr_pop(c, at2);
                if (!p) return NULL;
                s->names[s->nprops] = (name){key, kn};
                s->props[s->nprops++] = p;
            }
            ptr_pop(c, at);
        }
        if (addl && !(s->additional = read_at(c, addl, "additionalProperties", depth))) return NULL;
        if (req) {
            if (!json_is_array(req)) {
                refuse(c, "required", "must be an array of strings");
                return NULL;
            }
            if (!(s->required = al(c, json_array_size(req) * sizeof *s->required))) return NULL;
            for (size_t i = 0; i < json_array_size(req); i++) {
                json_t *x = json_array_get(req, i);
                if (!json_is_string(x)) {
                    refuse(c, "required", "must be an array of strings");
                    return NULL;
                }
                name nm = {json_string_value(x), json_string_length(x)};
                bool dup = false;
                for (size_t j = 0; j < s->nrequired; j++)
                    dup |= name_eq(s->required[j], nm.s, nm.n);
                if (!dup) s->required[s->nrequired++] = nm;
            }
        }
        return s;
    }
    refuse(c, "type", "unknown type '%s'", type);
    return NULL;
}

static js *normalize(C *c, js *s);
static js *isect(C *c, js *a, js *b, int depth);

static js *read_simple(C *c, const kv *kw, size_t nkw, json_t *type, int depth) {
    static const char *const all[] = {"null", "boolean", "number", "string", "array", "object"};
    const char *types[8];
    size_t nt = 0;
    if (!type) {
        for (size_t i = 0; i < 6; i++) types[nt++] = all[i];
    } else if (json_is_string(type)) {
        types[nt++] = json_string_value(type);
    } else if (json_is_array(type) && json_array_size(type) <= 8) {
        for (size_t i = 0; i < json_array_size(type); i++) {
            if (!json_is_string(json_array_get(type, i))) {
                refuse(c, "type", "must be a string or an array of strings");
                return NULL;
            }
            types[nt++] = json_string_value(json_array_get(type, i));
        }
    } else {
        refuse(c, "type", "must be a string or an array of strings");
        return NULL;
    }
    if (nt == 1) return read_type(c, types[0], kw, nkw, depth);
    js *s = mk(c, J_ANYOF);
    if (!s || !(s->opts = al(c, nt * sizeof *s->opts))) return NULL;
    for (size_t i = 0; i < nt; i++)
        if (!(s->opts[s->nopts++] = read_type(c, types[i], kw, nkw, depth))) return NULL;
    return normalize(c, s);
}

static js *read_const(C *c, json_t *v) {
    js *s;
    switch (json_typeof(v)) {
    case JSON_NULL: return mk(c, J_NULL);
    case JSON_TRUE:
    case JSON_FALSE:
        if ((s = mk(c, J_BOOL))) s->bval = json_is_true(v);
        return s;
    case JSON_INTEGER:
    case JSON_REAL:
        if ((s = mk(c, J_NUM))) {
            s->integer = json_is_integer(v);
            s->lo = s->hi = (bound){true, false, json_number_value(v)};
        }
        return s;
    case JSON_STRING:
        if ((s = mk(c, J_STR))) {
            s->lit = (name){json_string_value(v), json_string_length(v)};
            s->rx = td_rx_literal(c->rx, s->lit.s, s->lit.n);
        }
        return s;
    case JSON_ARRAY:
        if (!(s = mk(c, J_ARR))) return NULL;
        s->nprefix = s->minitems = s->maxitems = (uint32_t)json_array_size(v);
        if (!(s->prefix = al(c, s->nprefix * sizeof *s->prefix))) return NULL;
        for (size_t i = 0; i < s->nprefix; i++)
            if (!(s->prefix[i] = read_const(c, json_array_get(v, i)))) return NULL;
        s->items = &c->unsat_false;
        return s;
    case JSON_OBJECT: {
        if (!(s = mk(c, J_OBJ))) return NULL;
        size_t n = json_object_size(v);
        s->names = al(c, n * sizeof *s->names);
        s->props = al(c, n * sizeof *s->props);
        s->required = al(c, n * sizeof *s->required);
        if (!s->names || !s->props || !s->required) return NULL;
        for (void *it = json_object_iter(v); it; it = json_object_iter_next(v, it)) {
            name nm = {json_object_iter_key(it), json_object_iter_key_len(it)};
            if (!(s->props[s->nprops] = read_const(c, json_object_iter_value(it)))) return NULL;
            s->names[s->nprops++] = nm;
            s->required[s->nrequired++] = nm;
        }
        s->additional = &c->unsat_false;
        return s;
    }
    }
    fail(c, "at %s: an unknown JSON value", where(c));
    return NULL;
}

static char *dupn(C *c, const char *s, size_t n) {
    char *d = al(c, n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

/* The length of uri's scheme ("http" of "http://a"), 0 when it has none. */
static size_t scheme_len(const char *u) {
    size_t i = 0;
    if (!((u[0] >= 'a' && u[0] <= 'z') || (u[0] >= 'A' && u[0] <= 'Z'))) return 0;
    while (u[i] && u[i] != ':' && u[i] != '/' && u[i] != '?' && u[i] != '#') i++;
    return u[i] == ':' ? i : 0;
}

/* r resolved against base (RFC 3986, without its query rules): an
 * absolute URI, fragment kept. */
static char *uri_join(C *c, const char *base, const char *r) {
    if (scheme_len(r) || !base || !*base) return dupn(c, r, strlen(r));
    size_t bl = strcspn(base, "#"); /* base without its fragment */
    if (!*r) return dupn(c, base, bl);
    td_strbuf b = {0};
    if (r[0] == '#') {
        td_strbuf_put(&b, base, bl);
    } else if (r[0] == '/') {
        const size_t sl = scheme_len(base);
        size_t cut = sl + 1; /* after "scheme:" */
        if (r[1] != '/' && !strncmp(base + cut, "//", 2)) {
            cut += 2 + strcspn(base + cut + 2, "/#"); /* keep the authority */
        }
        td_strbuf_put(&b, base, cut < bl ? cut : bl);
    } else {
        const char *slash = NULL;
        for (const char *q = base; q < base + bl; q++)
            if (*q == '/') slash = q;
        if (slash) td_strbuf_put(&b, base, (size_t)(slash + 1 - base));
    }
    td_strbuf_puts(&b, r);
    /* remove "./" and "x/../" segments */
    char *u = b.oom ? NULL : dupn(c, b.v, b.n);
    td_strbuf_free(&b);
    if (!u) return NULL;
    char *q;
    while ((q = strstr(u, "/./"))) memmove(q, q + 2, strlen(q + 2) + 1);
    while ((q = strstr(u, "/../"))) {
        char *prev = q;
        while (prev > u && prev[-1] != '/') prev--;
        if (prev == u || prev[-1] != '/') break;
        memmove(prev, q + 4, strlen(q + 4) + 1);
    }
    return u;
}

static bool add_uri(C *c, bool anchor, const char *uri, json_t *node) {
    if (anchor) {
        if (!td_gr_reserve((void **)&c->anchors, &c->capanchors, c->nanchors, sizeof *c->anchors))
            return false;
        c->anchors[c->nanchors].uri = uri;
        c->anchors[c->nanchors++].node = node;
    } else {
        if (!td_gr_reserve((void **)&c->res, &c->capres, c->nres, sizeof *c->res)) return false;
        c->res[c->nres].uri = uri;
        c->res[c->nres++].node = node;
    }
    return true;
}

/* Finds the resources ($id) and anchors ($anchor, and draft 7's "$id":
 * "#name") under v, whose base URI is base. Values that are data, not
 * schemas (const, enum, examples, default), are not searched. */
static bool prescan(C *c, json_t *v, const char *base, int depth) {
    if (depth > 1000 || c->failed) return false;
    if (json_is_array(v)) {
        for (size_t i = 0; i < json_array_size(v); i++)
            if (!prescan(c, json_array_get(v, i), base, depth + 1)) return false;
        return true;
    }
    if (!json_is_object(v)) return true;
    json_t *id = json_object_get(v, "$id");
    /* up to draft 7 a $ref's siblings are ignored, its $id too */
    if (c->draft == DRAFT_7 && json_object_get(v, "$ref")) id = NULL;
    if (json_is_string(id) && json_string_value(id)[0] == '#') {
        char *a = uri_join(c, base, json_string_value(id));
        if (!a || !add_uri(c, true, a, v)) return false;
    } else if (json_is_string(id)) {
        char *u = uri_join(c, base, json_string_value(id));
        if (!u) return false;
        u[strcspn(u, "#")] = 0;
        base = u;
        if (!add_uri(c, false, u, v)) return false;
    }
    json_t *anchor = json_object_get(v, "$anchor");
    if (json_is_string(anchor)) {
        td_strbuf b = {0};
        td_strbuf_puts(&b, base ? base : "");
        td_strbuf_puts(&b, "#");
        td_strbuf_puts(&b, json_string_value(anchor));
        char *a = b.oom ? NULL : dupn(c, b.v, b.n);
        td_strbuf_free(&b);
        if (!a || !add_uri(c, true, a, v)) return false;
    }
    for (void *it = json_object_iter(v); it; it = json_object_iter_next(v, it)) {
        const char *k = json_object_iter_key(it);
        if (!strcmp(k, "const") || !strcmp(k, "enum") || !strcmp(k, "examples") ||
            !strcmp(k, "default"))
            continue;
        if (!prescan(c, json_object_iter_value(it), base, depth + 1)) return false;
    }
    return true;
}

static ref *find_ref(C *c, const char *uri, size_t *idx) {
    for (size_t i = 0; i < c->nrefs; i++)
        if (!strcmp(c->refs[i].uri, uri)) {
            *idx = i;
            return &c->refs[i];
        }
    return NULL;
}

/* The value a JSON Pointer fragment (after the '#': "" or "/a/b",
 * percent-encoded) points at under v, or NULL. */
static json_t *pointer(json_t *v, const char *p) {
    if (!*p) return v;
    if (*p != '/') return NULL;
    char seg[1024];
    while (*p == '/' && v) {
        p++;
        size_t n = 0;
        while (*p && *p != '/') {
            char ch = *p++;
            if (ch == '%' && td_gr_hexval(p[0]) >= 0 && td_gr_hexval(p[1]) >= 0) {
                ch = (char)(td_gr_hexval(p[0]) * 16 + td_gr_hexval(p[1]));
                p += 2;
            }
            if (n + 1 >= sizeof seg) return NULL;
            seg[n++] = ch;
        }
        /* ~1 is '/', ~0 is '~' */
        size_t m = 0;
        for (size_t i = 0; i < n; i++) {
            if (seg[i] == '~' && i + 1 < n && (seg[i + 1] == '0' || seg[i + 1] == '1')) {
                seg[m++] = seg[i + 1] == '0' ? '~' : '/';
                i++;
            } else {
                seg[m++] = seg[i];
            }
        }
        if (json_is_object(v)) {
            v = json_object_getn(v, seg, m);
        } else if (json_is_array(v)) {
            char *end;
            seg[m] = 0;
            unsigned long i = strtoul(seg, &end, 10);
            v = m && *end == 0 ? json_array_get(v, i) : NULL;
        } else {
            v = NULL;
        }
    }
    return v;
}

/* The node a reference names: the resource (its part before '#', the
 * root when empty) and in it a JSON Pointer or an anchor. *res_uri is the
 * resource's URI (the base to read the node with). */
static json_t *resolve(C *c, const char *abs, const char **res_uri) {
    const size_t rl = strcspn(abs, "#");
    const char *frag = abs[rl] ? abs + rl + 1 : "";
    json_t *node = NULL;
    if (!rl || (c->base_root && strlen(c->base_root) == rl && !strncmp(abs, c->base_root, rl))) {
        node = c->root;
        *res_uri = c->base_root;
    }
    for (size_t i = 0; i < c->nres && !node; i++)
        if (strlen(c->res[i].uri) == rl && !strncmp(c->res[i].uri, abs, rl)) {
            node = c->res[i].node;
            *res_uri = c->res[i].uri;
        }
    if (!node) return NULL;
    if (!*frag || frag[0] == '/') return pointer(node, frag);
    for (size_t i = 0; i < c->nanchors; i++)
        if (!strcmp(c->anchors[i].uri, abs)) return c->anchors[i].node;
    return NULL;
}

/* The ref entry for the reference written as written (resolved against
 * the base being read), read if it was not (its schema stays NULL while
 * it is being read: a cycle). */
static ref *define_ref(C *c, const char *written, int depth, size_t *idx) {
    const char *uri = uri_join(c, c->base, written);
    if (!uri) return NULL;
    ref *r = find_ref(c, uri, idx);
    if (r) return r;
    const char *res_uri = NULL;
    json_t *t = resolve(c, uri, &res_uri);
    if (!t) {
        refuse(c, "$ref",
               "'%s' names nothing in this schema (only references into the schema itself "
               "are supported)",
               written);
        return NULL;
    }
    if (!td_gr_reserve((void **)&c->refs, &c->caprefs, c->nrefs, sizeof *c->refs)) {
        fail(c, "out of memory");
        return NULL;
    }
    char *u = al(c, strlen(uri) + 1);
    if (!u) return NULL;
    strcpy(u, uri);
    *idx = c->nrefs;
    c->refs[c->nrefs++] = (ref){.uri = u, .target = t, .state = 1, .sym = UINT32_MAX};
    /* read at the target's own pointer (or its URI), with its base */
    td_strbuf saved = c->ptr;
    const char *saved_base = c->base;
    c->ptr = (td_strbuf){0};
    const char *frag = strchr(uri, '#');
    td_strbuf_puts(&c->ptr, frag && frag[1] == '/' && t != c->root ? frag + 1 : uri);
    c->base = res_uri;
    js *s = read_schema(c, t, depth + 1);
    c->base = saved_base;
    td_strbuf_free(&c->ptr);
    c->ptr = saved;
    if (!s) return NULL;
    c->refs[*idx].schema = s;
    c->refs[*idx].state = 2;
    return &c->refs[*idx];
}

static js *isect_ref(C *c, size_t idx, js *other, bool ref_first, int depth) {
    js *t = c->refs[idx].schema;
    if (!t) {
        refuse(c, "$ref", "a cycle of $ref with sibling keywords ('%s') is not supported",
               c->refs[idx].uri);
        return NULL;
    }
    return ref_first ? isect(c, t, other, depth + 1) : isect(c, other, t, depth + 1);
}

static bool is_simple(const char *k) {
    static const char *const a[] = {"type",
                                    "items",
                                    "prefixItems",
                                    "additionalItems",
                                    "minItems",
                                    "maxItems",
                                    "properties",
                                    "additionalProperties",
                                    "required",
                                    "minProperties",
                                    "maxProperties",
                                    "minLength",
                                    "maxLength",
                                    "pattern",
                                    "format",
                                    "minimum",
                                    "maximum",
                                    "exclusiveMinimum",
                                    "exclusiveMaximum",
                                    "multipleOf"};
    for (size_t i = 0; i < sizeof a / sizeof *a; i++)
        if (!strcmp(k, a[i])) return true;
    return false;
}

static bool is_applicator(const char *k) {
    return !strcmp(k, "const") || !strcmp(k, "enum") || !strcmp(k, "allOf") ||
           !strcmp(k, "anyOf") || !strcmp(k, "oneOf") || !strcmp(k, "$ref");
}

/* A keyword that changes which documents are valid and is not supported:
 * refused. Everything else not read is an annotation or unknown. */
static bool is_refused(json_t *o, const char *k, json_t *v) {
    static const char *const a[] = {"not",
                                    "contains",
                                    "propertyNames",
                                    "dependencies",
                                    "dependentRequired",
                                    "dependentSchemas",
                                    "unevaluatedProperties",
                                    "unevaluatedItems",
                                    "$dynamicRef",
                                    "$recursiveRef"};
    for (size_t i = 0; i < sizeof a / sizeof *a; i++)
        if (!strcmp(k, a[i])) return true;
    if (!strcmp(k, "uniqueItems")) return !json_is_false(v);
    if (!strcmp(k, "patternProperties")) return !json_is_object(v) || json_object_size(v) > 0;
    if (!strcmp(k, "if"))
        return json_object_get(o, "then") != NULL || json_object_get(o, "else") != NULL;
    return false;
}

static js *read_list(C *c, json_t *v, const char *key, int kind, int depth) {
    if (!json_is_array(v) || !json_array_size(v)) {
        refuse(c, key, "must be a non-empty array");
        return NULL;
    }
    js *s = mk(c, kind);
    size_t n = json_array_size(v);
    if (!s || !(s->opts = al(c, n * sizeof *s->opts))) return NULL;
    size_t at = ptr_push(c, key, strlen(key));
    for (size_t i = 0; i < n; i++) {
        size_t at2 = ptr_push_index(c, i);
        s->opts[i] = read_schema(c, json_array_get(v, i), depth + 1);
        ptr_pop(c, at2);
        if (!s->opts[i]) return NULL;
        s->nopts++;
    }
    ptr_pop(c, at);
    return s;
}

static js *apply(C *c, js *cur, const char *k, json_t *v, int depth) {
    if (!strcmp(k, "const")) {
        js *x = read_const(c, v);
        return x ? isect(c, cur, x, 0) : NULL;
    }
    if (!strcmp(k, "enum")) {
        if (!json_is_array(v)) {
            refuse(c, k, "must be an array");
            return NULL;
        }
        js *s = mk(c, J_ANYOF);
        if (!s || !(s->opts = al(c, json_array_size(v) * sizeof *s->opts))) return NULL;
        for (size_t i = 0; i < json_array_size(v); i++)
            if (!(s->opts[s->nopts++] = read_const(c, json_array_get(v, i)))) return NULL;
        return isect(c, cur, s, 0);
    }
    if (!strcmp(k, "allOf")) {
        js *s = read_list(c, v, k, J_ANYOF, depth);
        for (size_t i = 0; s && cur && i < s->nopts; i++) cur = isect(c, cur, s->opts[i], 0);
        return s ? cur : NULL;
    }
    if (!strcmp(k, "anyOf") || !strcmp(k, "oneOf")) {
        js *s = read_list(c, v, k, k[0] == 'a' ? J_ANYOF : J_ONEOF, depth);
        return s ? isect(c, cur, s, 0) : NULL;
    }
    /* $ref */
    if (!json_is_string(v)) {
        refuse(c, k, "must be a string");
        return NULL;
    }
    size_t idx;
    if (!define_ref(c, json_string_value(v), depth, &idx)) return NULL;
    if (cur->kind == J_ANY) {
        js *s = mk(c, J_REF);
        if (s) s->ref = idx;
        return s;
    }
    return isect_ref(c, idx, cur, false, 0);
}

static js *read_schema(C *c, json_t *v, int depth) {
    if (c->failed) return NULL;
    if ((uint32_t)depth > c->o.max_depth) {
        fail(c, "at %s: the schema is nested more than %u deep", where(c), c->o.max_depth);
        return NULL;
    }
    if (json_is_true(v)) return &c->any;
    if (json_is_false(v)) return &c->unsat_false;
    if (!json_is_object(v)) {
        fail(c, "at %s: a schema must be an object or a boolean", where(c));
        return NULL;
    }
    if (!count(c)) return NULL;
    /* a resource of its own: its $id is the base of what it holds */
    const char *saved_base = c->base;
    json_t *id = json_object_get(v, "$id");
    if (c->draft == DRAFT_7 && json_object_get(v, "$ref")) id = NULL;
    if (json_is_string(id) && json_string_value(id)[0] != '#' && v != c->root) {
        char *u = uri_join(c, c->base, json_string_value(id));
        if (!u) return NULL;
        u[strcspn(u, "#")] = 0;
        c->base = u;
    }
    js *r = read_object(c, v, depth);
    c->base = saved_base;
    return r;
}

static js *read_object(C *c, json_t *v, int depth) {
    /* drafts 7 and before: $ref stands alone, its siblings are ignored */
    json_t *only = c->draft == DRAFT_7 ? json_object_get(v, "$ref") : NULL;
    if (only) {
        js *r = apply(c, &c->any, "$ref", only, depth);
        return r ? normalize(c, r) : NULL;
    }
    size_t n = json_object_size(v);
    kv *kw = al(c, 2 * n * sizeof *kw);
    if (!kw) return NULL;
    json_t *type = json_object_get(v, "type");
    js *cur = &c->any;
    size_t nkw = 0;
    for (void *it = json_object_iter(v); it && cur; it = json_object_iter_next(v, it)) {
        const char *k = json_object_iter_key(it);
        json_t *x = json_object_iter_value(it);
        if (is_refused(v, k, x)) {
            refuse(c, k, "'%s' is not supported", k);
            return NULL;
        }
        if (is_applicator(k)) {
            if (nkw) {
                js *s = read_simple(c, kw, nkw, type, depth);
                cur = s ? isect(c, cur, s, 0) : NULL;
                nkw = 0;
                if (!cur) break;
            }
            cur = apply(c, cur, k, x, depth);
        } else if (is_simple(k)) {
            kw[nkw++] = (kv){k, x};
            /* additionalProperties and items need the names and the
             * tuple they follow: those keywords join the group */
            if (!strcmp(k, "additionalProperties") || !strcmp(k, "items")) {
                const char *dep = k[0] == 'a' ? "properties" : "prefixItems";
                json_t *d = json_object_get(v, dep);
                bool have = false;
                for (size_t i = 0; i < nkw; i++) have |= !strcmp(kw[i].k, dep);
                if (d && !have) kw[nkw++] = (kv){dep, d};
            }
        }
        /* annotations ($schema, title, description, default, examples,
         * $defs ...) and unknown keywords are ignored */
    }
    if (cur && nkw) {
        js *s = read_simple(c, kw, nkw, type, depth);
        cur = s ? isect(c, cur, s, 0) : NULL;
    }
    return cur ? normalize(c, cur) : NULL;
}

/* ---- intersection ---- */

static js *prop_schema(C *c, const js *o, const char *s, size_t n) {
    for (size_t i = 0; i < o->nprops; i++)
        if (name_eq(o->names[i], s, n)) return o->props[i];
    return o->additional ? o->additional : &c->any;
}

static js *distribute(C *c, js *list, js *other, bool list_first, int depth) {
    js *s = mk(c, list->kind);
    if (!s || !(s->opts = al(c, list->nopts * sizeof *s->opts))) return NULL;
    for (size_t i = 0; i < list->nopts; i++) {
        js *x = list_first ? isect(c, list->opts[i], other, depth + 1)
                           : isect(c, other, list->opts[i], depth + 1);
        if (!x) return NULL;
        s->opts[s->nopts++] = x;
    }
    return s;
}

static js *isect_obj(C *c, const js *a, const js *b, int depth) {
    js *s = mk(c, J_OBJ);
    if (!s) return NULL;
    size_t n = a->nprops + b->nprops, nr = a->nrequired + b->nrequired;
    s->names = al(c, n * sizeof *s->names);
    s->props = al(c, n * sizeof *s->props);
    s->required = al(c, nr * sizeof *s->required);
    if (!s->names || !s->props || !s->required) return NULL;
    for (size_t i = 0; i < a->nprops; i++) {
        js *x = isect(c, a->props[i], prop_schema(c, b, a->names[i].s, a->names[i].n), depth + 1);
        if (!x) return NULL;
        s->names[s->nprops] = a->names[i];
        s->props[s->nprops++] = x;
    }
    for (size_t i = 0; i < b->nprops; i++) {
        bool seen = false;
        for (size_t j = 0; j < a->nprops; j++)
            seen |= name_eq(a->names[j], b->names[i].s, b->names[i].n);
        if (seen) continue;
        js *x = isect(c, prop_schema(c, a, b->names[i].s, b->names[i].n), b->props[i], depth + 1);
        if (!x) return NULL;
        s->names[s->nprops] = b->names[i];
        s->props[s->nprops++] = x;
    }
    for (size_t k = 0; k < 2; k++) {
        const js *o = k ? b : a;
        for (size_t i = 0; i < o->nrequired; i++) {
            bool dup = false;
            for (size_t j = 0; j < s->nrequired; j++)
                dup |= name_eq(s->required[j], o->required[i].s, o->required[i].n);
            if (!dup) s->required[s->nrequired++] = o->required[i];
        }
    }
    if (a->additional && b->additional) {
        if (!(s->additional = isect(c, a->additional, b->additional, depth + 1))) return NULL;
    } else {
        s->additional = a->additional ? a->additional : b->additional;
    }
    s->minprops = a->minprops > b->minprops ? a->minprops : b->minprops;
    s->maxprops = a->maxprops < b->maxprops ? a->maxprops : b->maxprops;
    return s;
}

static js *isect_arr(C *c, const js *a, const js *b, int depth) {
    js *s = mk(c, J_ARR);
    if (!s) return NULL;
    s->minitems = a->minitems > b->minitems ? a->minitems : b->minitems;
    s->maxitems = a->maxitems < b->maxitems ? a->maxitems : b->maxitems;
    s->nprefix = a->nprefix > b->nprefix ? a->nprefix : b->nprefix;
    if (!(s->prefix = al(c, s->nprefix * sizeof *s->prefix))) return NULL;
    for (size_t i = 0; i < s->nprefix; i++) {
        js *x = i < a->nprefix ? a->prefix[i] : a->items ? a->items : &c->any;
        js *y = i < b->nprefix ? b->prefix[i] : b->items ? b->items : &c->any;
        if (!(s->prefix[i] = isect(c, x, y, depth + 1))) return NULL;
    }
    if (a->items && b->items) {
        if (!(s->items = isect(c, a->items, b->items, depth + 1))) return NULL;
    } else {
        s->items = a->items ? a->items : b->items;
    }
    return s;
}

static js *isect(C *c, js *a, js *b, int depth) {
    if (!a || !b || !count(c)) return NULL;
    if ((uint32_t)depth > c->o.max_depth) {
        fail(c, "at %s: schema intersection nested more than %u deep", where(c), c->o.max_depth);
        return NULL;
    }
    js *r;
    if (a->kind == J_ANY) return b;
    if (b->kind == J_ANY) return a;
    if (a->kind == J_UNSAT) return a;
    if (b->kind == J_UNSAT) return b;
    if (a->kind == J_REF) return isect_ref(c, a->ref, b, true, depth);
    if (b->kind == J_REF) return isect_ref(c, b->ref, a, false, depth);
    if (a->kind == J_ONEOF || (a->kind == J_ANYOF && b->kind != J_ONEOF))
        r = distribute(c, a, b, true, depth);
    else if (b->kind == J_ONEOF || b->kind == J_ANYOF)
        r = distribute(c, b, a, false, depth);
    else if (a->kind != b->kind)
        return unsat(c, "incompatible types");
    else {
        switch (a->kind) {
        case J_NULL: return a;
        case J_BOOL:
            if (a->bval == b->bval || b->bval < 0) return a;
            if (a->bval < 0) return b;
            return unsat(c, "incompatible boolean values");
        case J_NUM:
            if (!(r = copy(c, a))) return NULL;
            r->integer = a->integer || b->integer;
            r->lo = tighter(a->lo, b->lo, true);
            r->hi = tighter(a->hi, b->hi, false);
            if (a->mult_p && b->mult_p) {
                /* the least common multiple at the finer scale */
                uint32_t k = a->mult_k > b->mult_k ? a->mult_k : b->mult_k;
                uint64_t p1 = a->mult_p, p2 = b->mult_p;
                for (uint32_t i = a->mult_k; i < k && p1 <= MAX_DIVISOR; i++) p1 *= 10;
                for (uint32_t i = b->mult_k; i < k && p2 <= MAX_DIVISOR; i++) p2 *= 10;
                uint64_t l = p1 <= MAX_DIVISOR && p2 <= MAX_DIVISOR ? p1 / gcd64(p1, p2) * p2 : 0;
                if (!l || l > MAX_DIVISOR) {
                    fail(c, "at %s: multipleOf: the least common multiple of two is too large",
                         where(c));
                    return NULL;
                }
                r->mult_p = (uint32_t)l;
                r->mult_k = k;
            } else if (b->mult_p) {
                r->mult_p = b->mult_p;
                r->mult_k = b->mult_k;
            }
            return r;
        case J_STR:
            if (!(r = copy(c, a))) return NULL;
            r->minlen = a->minlen > b->minlen ? a->minlen : b->minlen;
            r->maxlen = a->maxlen < b->maxlen ? a->maxlen : b->maxlen;
            r->rx = a->rx == TD_RX_FAIL   ? b->rx
                    : b->rx == TD_RX_FAIL ? a->rx
                                          : td_rx_and(c->rx, a->rx, b->rx);
            r->lit = a->lit.s ? a->lit : b->lit;
            if (a->lit.s && b->lit.s && !name_eq(a->lit, b->lit.s, b->lit.n))
                return unsat(c, "different constants");
            return r;
        case J_ARR: r = isect_arr(c, a, b, depth); break;
        default: r = isect_obj(c, a, b, depth); break;
        }
    }
    return r ? normalize(c, r) : NULL;
}

static bool disjoint(C *c, const js *a, const js *b) {
    if (a->kind == J_UNSAT || b->kind == J_UNSAT) return true;
    if (a->kind == J_ANY || b->kind == J_ANY || a->kind == J_REF || b->kind == J_REF) return false;
    if (a->kind == J_ANYOF || a->kind == J_ONEOF) {
        for (size_t i = 0; i < a->nopts; i++)
            if (!disjoint(c, a->opts[i], b)) return false;
        return true;
    }
    if (b->kind == J_ANYOF || b->kind == J_ONEOF) return disjoint(c, b, a);
    if (a->kind != b->kind) return true;
    if (a->kind == J_BOOL) return a->bval >= 0 && b->bval >= 0 && a->bval != b->bval;
    if (a->kind == J_STR) return a->lit.s && b->lit.s && !name_eq(a->lit, b->lit.s, b->lit.n);
    if (a->kind == J_OBJ) {
        for (size_t k = 0; k < 2; k++) {
            const js *o = k ? b : a;
            for (size_t i = 0; i < o->nrequired; i++) {
                name nm = o->required[i];
                if (disjoint(c, prop_schema(c, a, nm.s, nm.n), prop_schema(c, b, nm.s, nm.n)))
                    return true;
            }
        }
    }
    return false;
}

static js *normalize(C *c, js *s) {
    if (!s || (s->kind != J_ANYOF && s->kind != J_ONEOF)) return s;
    size_t n = 0;
    for (size_t i = 0; i < s->nopts; i++) n += s->opts[i]->kind == s->kind ? s->opts[i]->nopts : 1;
    js **v = al(c, n * sizeof *v);
    if (!v) return NULL;
    size_t m = 0;
    js *first_unsat = NULL;
    for (size_t i = 0; i < s->nopts; i++) {
        js *o = s->opts[i];
        if (o->kind == J_ANY && s->kind == J_ANYOF) return &c->any;
        if (o->kind == J_UNSAT) {
            if (!first_unsat) first_unsat = o;
            continue;
        }
        if (o->kind == s->kind) {
            for (size_t j = 0; j < o->nopts; j++) v[m++] = o->opts[j];
        } else {
            v[m++] = o;
        }
    }
    if (!m) return first_unsat ? first_unsat : unsat(c, "no alternative is satisfiable");
    if (m == 1) return v[0];
    js *r = copy(c, s);
    if (!r) return NULL;
    r->opts = v;
    r->nopts = m;
    if (r->kind == J_ONEOF) {
        bool dis = true;
        for (size_t i = 0; i < m && dis; i++)
            for (size_t j = i + 1; j < m && dis; j++) dis = disjoint(c, v[i], v[j]);
        if (dis) r->kind = J_ANYOF;
    }
    return r;
}

/* ---- numbers ---- */

/* The shortest decimal digits that read back as v (v >= 0, finite), as
 * an integer part without leading zeros ("0" for none) and a fraction
 * without trailing zeros. */
static bool decimal(double v, char *ip, size_t ipn, char *fp, size_t fpn) {
    char b[64];
    for (int p = 1; p <= 17; p++) {
        snprintf(b, sizeof b, "%.*e", p - 1, v);
        if (strtod(b, NULL) == v) break;
    }
    char dig[32];
    long nd = 0;
    const char *q = b;
    for (; *q && *q != 'e'; q++)
        if (*q >= '0' && *q <= '9') dig[nd++] = *q;
    long e = atol(q + 1); /* dig[i] is the digit of 10^(e - i) */
    size_t ni = 0, nf = 0;
    for (long i = 0; i <= e; i++) {
        if (ni + 2 > ipn) return false;
        ip[ni++] = i < nd ? dig[i] : '0';
    }
    for (long j = 1; e + j < nd; j++) {
        if (nf + 2 > fpn) return false;
        fp[nf++] = e + j < 0 ? '0' : dig[e + j];
    }
    ip[ni] = fp[nf] = 0;
    size_t z = 0;
    while (ip[z] == '0' && ip[z + 1]) z++;
    memmove(ip, ip + z, strlen(ip + z) + 1);
    if (!ip[0]) strcpy(ip, "0");
    while (nf && fp[nf - 1] == '0') fp[--nf] = 0;
    return true;
}

static void digit_class(td_strbuf *b, int lo, int hi) {
    char t[32];
    if (lo == hi)
        snprintf(t, sizeof t, "%d", lo);
    else
        snprintf(t, sizeof t, "[%d-%d]", lo, hi);
    td_strbuf_puts(b, t);
}

/* Canonical integers (0 or no leading zero) above I (gt) or below it,
 * followed by "|"; nothing when there are none. */
static void int_cmp(td_strbuf *b, const char *I, bool gt) {
    size_t L = strlen(I);
    if (!gt && !strcmp(I, "0")) return;
    td_strbuf_puts(b, "(?:");
    bool any = false;
    char t[64];
    if (gt) {
        snprintf(t, sizeof t, "[1-9][0-9]{%zu,}", L);
        td_strbuf_puts(b, t);
        any = true;
    } else if (strcmp(I, "0")) {
        if (L >= 2) {
            snprintf(t, sizeof t, "0|[1-9][0-9]{0,%zu}", L - 2);
            td_strbuf_puts(b, t);
            any = true;
        }
    }
    for (size_t k = 0; k < L; k++) {
        int d = I[k] - '0';
        int lo = gt ? d + 1 : (k == 0 && L > 1 ? 1 : 0), hi = gt ? 9 : d - 1;
        if (lo > hi) continue;
        if (any) td_strbuf_puts(b, "|");
        td_strbuf_put(b, I, k);
        digit_class(b, lo, hi);
        if (L - k - 1) {
            snprintf(t, sizeof t, "[0-9]{%zu}", L - k - 1);
            td_strbuf_puts(b, t);
        }
        any = true;
    }
    td_strbuf_puts(b, ")(?:\\.[0-9]+)?|");
}

/* Plain non-negative decimals (integer part, optional fraction) compared
 * with I.F: ge true for >=, false for <=. */
static void dec_cmp(td_strbuf *b, const char *I, const char *F, bool ge) {
    size_t nf = strlen(F);
    td_strbuf_puts(b, "(?:");
    int_cmp(b, I, ge);
    td_strbuf_puts(b, I);
    if (ge) {
        if (!nf) {
            td_strbuf_puts(b, "(?:\\.[0-9]+)?");
        } else {
            td_strbuf_puts(b, "\\.(?:");
            for (size_t k = 0; k < nf; k++) {
                int d = F[k] - '0';
                if (d == 9) continue;
                td_strbuf_put(b, F, k);
                digit_class(b, d + 1, 9);
                td_strbuf_puts(b, "[0-9]*|");
            }
            td_strbuf_puts(b, F);
            td_strbuf_puts(b, "[0-9]*)");
        }
    } else {
        if (!nf) {
            td_strbuf_puts(b, "(?:\\.0+)?");
        } else {
            td_strbuf_puts(b, "(?:\\.(?:");
            for (size_t k = 0; k < nf; k++) {
                int d = F[k] - '0';
                if (k) {
                    td_strbuf_put(b, F, k);
                    td_strbuf_puts(b, "|");
                }
                if (d == 0) continue;
                td_strbuf_put(b, F, k);
                digit_class(b, 0, d - 1);
                td_strbuf_puts(b, "[0-9]*|");
            }
            td_strbuf_puts(b, F);
            td_strbuf_puts(b, "0*))?");
        }
    }
    td_strbuf_puts(b, ")");
}

/* The forms equal to I.F. */
static void dec_eq(td_strbuf *b, const char *I, const char *F) {
    td_strbuf_puts(b, "(?:");
    td_strbuf_puts(b, I);
    if (*F) {
        td_strbuf_puts(b, "\\.");
        td_strbuf_puts(b, F);
        td_strbuf_puts(b, "0*)");
    } else {
        td_strbuf_puts(b, "(?:\\.0+)?)");
    }
}

static td_rx_id parse_rx(C *c, td_strbuf *b) {
    td_rx_id r;
    char e[200];
    if (b->oom) {
        td_strbuf_free(b);
        fail(c, "out of memory");
        return TD_RX_FAIL;
    }
    int rc = td_rx_parse(c->rx, b->v, b->n, 0, &r, e, sizeof e);
    td_strbuf_free(b);
    if (rc) {
        fail(c, "at %s: internal: number expression: %s", where(c), e);
        return TD_RX_FAIL;
    }
    return r;
}

/* Non-negative plain decimals x with x >= |v| (or > when excl; lo true)
 * or x <= |v| (< when excl). */
static td_rx_id dec_bound(C *c, double v, bool excl, bool lo) {
    char I[400], F[400];
    if (!decimal(fabs(v), I, sizeof I, F, sizeof F)) {
        fail(c, "at %s: a numeric bound of more than 400 digits", where(c));
        return TD_RX_FAIL;
    }
    td_strbuf b = {0};
    dec_cmp(&b, I, F, lo);
    td_rx_id r = parse_rx(c, &b);
    if (excl) {
        dec_eq(&b, I, F);
        r = td_rx_and(c->rx, r, td_rx_not(c->rx, parse_rx(c, &b)));
    }
    return r;
}

static td_rx_id lit_rx(C *c, const char *s) { return td_rx_literal(c->rx, s, strlen(s)); }

static td_rx_id number_rx_bounds(C *c, const js *s);

/* The number's language: TD_RX_NOTHING when no number fits. A multipleOf
 * keeps the numerals whose value is a multiple, written without an
 * exponent. */
static td_rx_id number_rx(C *c, const js *s) {
    td_rx_id r = number_rx_bounds(c, s);
    if (!s->mult_p || r == TD_RX_NOTHING) return r;
    td_rx_id m = td_rx_multiple_of(c->rx, s->mult_p, s->mult_k);
    td_rx_id sign = td_rx_or(c->rx, TD_RX_EMPTY, lit_rx(c, "-"));
    return td_rx_and(c->rx, r, td_rx_concat(c->rx, sign, m));
}

static td_rx_id number_rx_bounds(C *c, const js *s) {
    td_rx *rx = c->rx;
    bound lo = s->lo, hi = s->hi;
    if (lo.has && hi.has && (lo.v > hi.v || (lo.v == hi.v && (lo.excl || hi.excl))))
        return TD_RX_NOTHING;
    td_strbuf b = {0};
    if (!lo.has && !hi.has) {
        td_strbuf_puts(&b, s->integer ? "-?(?:0|[1-9][0-9]*)"
                                      : "-?(?:0|[1-9][0-9]*)(?:\\.[0-9]+)?(?:[eE][+-]?[0-9]+)?");
        return parse_rx(c, &b);
    }
    td_strbuf_puts(&b, s->integer ? "(?:0|[1-9][0-9]*)" : "(?:0|[1-9][0-9]*)(?:\\.[0-9]+)?");
    td_rx_id base = parse_rx(c, &b);
    if (lo.has && hi.has && lo.v == hi.v) {
        /* one value: written one way (the shortest decimal) */
        char I[400], F[400];
        if (!decimal(fabs(lo.v), I, sizeof I, F, sizeof F)) return TD_RX_FAIL;
        if (s->integer && *F) return TD_RX_NOTHING;
        td_strbuf_puts(&b, lo.v < 0 ? "-" : "");
        td_strbuf_puts(&b, I);
        if (*F) {
            td_strbuf_puts(&b, ".");
            td_strbuf_puts(&b, F);
        }
        td_rx_id r = td_rx_literal(rx, b.v, b.n);
        td_strbuf_free(&b);
        return r;
    }
    td_rx_id alts[2] = {TD_RX_NOTHING, TD_RX_NOTHING};
    /* negatives -y: y > 0, y <= -lo, y >= -hi */
    if (!lo.has || lo.v < 0) {
        td_rx_id y = td_rx_and(rx, base, td_rx_not(rx, dec_bound(c, 0, false, false)));
        if (lo.has) y = td_rx_and(rx, y, dec_bound(c, lo.v, lo.excl, false));
        if (hi.has && hi.v < 0) y = td_rx_and(rx, y, dec_bound(c, hi.v, hi.excl, true));
        alts[0] = td_rx_concat(rx, lit_rx(c, "-"), y);
    }
    /* non-negatives */
    if (!hi.has || hi.v > 0 || (hi.v == 0 && !hi.excl)) {
        td_rx_id y = base;
        if (hi.has && hi.v == 0)
            y = lit_rx(c, "0"); /* zero written one way, as llguidance */
        else {
            if (lo.has && lo.v >= 0) y = td_rx_and(rx, y, dec_bound(c, lo.v, lo.excl, true));
            if (hi.has) y = td_rx_and(rx, y, dec_bound(c, hi.v, hi.excl, false));
        }
        alts[1] = y;
    }
    td_rx_id r = td_rx_or_list(rx, alts, 2);
    if (s->integer && lo.has && hi.has) {
        /* llguidance writes an integer range across zero as "-" and the
         * range's negatives through 0 or its non-negatives: -0 too */
        double l = lo.excl ? (floor(lo.v) == lo.v ? lo.v + 1 : ceil(lo.v)) : ceil(lo.v);
        double h = hi.excl ? (floor(hi.v) == hi.v ? hi.v - 1 : floor(hi.v)) : floor(hi.v);
        if (l < 0 && h >= 0) r = td_rx_or(rx, r, lit_rx(c, "-0"));
    }
    return r;
}

/* ---- formats ---- */

#define D2    "[0-9]{2}"
#define Y_ANY "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
/* leap years 0001-9999: divisible by 4, not by 100 unless by 400 */
#define Y_LEAP "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
#define MD_COMMON                                                                                  \
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-"   \
    "(?:0[1-9]|1[0-9]|2[0-8]))"
#define DATE "(?:" Y_ANY "-" MD_COMMON "|" Y_LEAP "-02-29)"
#define TIME                                                                                       \
    "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]+)?(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-" \
    "5]"                                                                                           \
    "[0-9])"
#define OCTET     "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
#define HEX       "[0-9a-fA-F]"
#define LABEL     "[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
#define SUBDOMAIN "[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
#define PCHAR     "(?:[a-zA-Z0-9._~!$&'()*+,;=:@-]|%" HEX "{2})"

static const struct {
    const char *name, *rx;
} formats[] = {
    {"date", DATE},
    {"time", TIME},
    {"date-time", DATE "[tT]" TIME},
    {"uuid", HEX "{8}-" HEX "{4}-" HEX "{4}-" HEX "{4}-" HEX "{12}"},
    {"ipv4", OCTET "\\." OCTET "\\." OCTET "\\." OCTET},
    {"hostname", LABEL "(?:\\." LABEL ")*"},
    /* RFC 5321's Mailbox: a dot-string, then a domain or an IPv4 literal */
    {"email", "[a-zA-Z0-9!#$%&'*+/=?^_`{|}~-]+(?:\\.[a-zA-Z0-9!#$%&'*+/=?^_`{|}~-]+)*@(?:" SUBDOMAIN
              "(?:\\." SUBDOMAIN ")*|\\[" OCTET "\\." OCTET "\\." OCTET "\\." OCTET "\\])"},
    {"uri", "[a-zA-Z][a-zA-Z0-9+.-]*:(?://(?:(?:[a-zA-Z0-9._~!$&'()*+,;=:-]|%" HEX
            "{2})*@)?(?:[a-zA-Z0-9._~!$&'()*+,;=-]|%" HEX "{2})*(?::[0-9]*)?(?:/" PCHAR
            "*)*|/(?:" PCHAR "+(?:/" PCHAR "*)*)?|" PCHAR "+(?:/" PCHAR "*)*)?(?:\\?(?:" PCHAR
            "|[/?])*)?(?:#(?:" PCHAR "|[/?])*)?"},
};

static js *read_format(C *c, js *s, json_t *v) {
    if (!json_is_string(v)) {
        refuse(c, "format", "must be a string");
        return NULL;
    }
    for (size_t i = 0; i < sizeof formats / sizeof *formats; i++) {
        if (strcmp(json_string_value(v), formats[i].name)) continue;
        td_rx_id r;
        char e[200];
        if (td_rx_parse(c->rx, formats[i].rx, strlen(formats[i].rx), 0, &r, e, sizeof e)) {
            fail(c, "internal: format %s: %s", formats[i].name, e);
            return NULL;
        }
        s->rx = s->rx == TD_RX_FAIL ? r : td_rx_and(c->rx, s->rx, r);
        return s;
    }
    refuse(c, "format",
           "format '%s' is not supported (supported: date, time, date-time, uuid, "
           "ipv4, hostname, email, uri)",
           json_string_value(v));
    return NULL;
}

/* ---- writing the grammar ---- */

#define GEN_UNSAT (UINT32_MAX - 1)
#define GEN_ERR   UINT32_MAX

static bool gram_ok(C *c) {
    if (c->failed) return false;
    const char *e = td_gram_error(c->g);
    if (!e) e = td_rx_error(c->rx);
    if (e) {
        fail(c, "%s", e);
        return false;
    }
    return true;
}

static td_gram_sym lex(C *c, td_rx_id r) {
    if (r == TD_RX_FAIL || !gram_ok(c)) return GEN_ERR;
    for (size_t i = 0; i < c->nlex; i++)
        if (c->lexrx[i] == r) return c->lexsym[i];
    if (!td_gr_reserve((void **)&c->lexrx, &c->caplex, c->nlex, sizeof *c->lexrx)) {
        fail(c, "out of memory");
        return GEN_ERR;
    }
    size_t cap = c->caplex;
    td_gram_sym *ns = realloc(c->lexsym, cap * sizeof *ns);
    if (!ns) {
        fail(c, "out of memory");
        return GEN_ERR;
    }
    c->lexsym = ns;
    td_gram_sym s = td_gram_lexeme(c->g, r, "json");
    if (s == UINT32_MAX) {
        gram_ok(c);
        return GEN_ERR;
    }
    c->lexrx[c->nlex] = r;
    c->lexsym[c->nlex++] = s;
    return s;
}

static td_gram_sym lit(C *c, const char *s) { return lex(c, lit_rx(c, s)); }

static td_gram_sym seq(C *c, const td_gram_sym *v, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (v[i] == GEN_ERR || v[i] == GEN_UNSAT) return v[i];
    if (n == 1) return v[0];
    td_gram_sym s = td_gram_nonterm(c->g, "seq");
    if (s == UINT32_MAX || td_gram_rule(c->g, s, v, n)) {
        gram_ok(c);
        return GEN_ERR;
    }
    return s;
}

static td_gram_sym alt(C *c, const td_gram_sym *v, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (v[i] == GEN_ERR) return GEN_ERR;
    if (n == 1) return v[0];
    td_gram_sym s = td_gram_nonterm(c->g, "alt");
    if (s == UINT32_MAX) return gram_ok(c), GEN_ERR;
    for (size_t i = 0; i < n; i++)
        if (td_gram_rule(c->g, s, &v[i], v[i] == c->empty ? 0 : 1)) return gram_ok(c), GEN_ERR;
    return s;
}

static td_gram_sym opt(C *c, td_gram_sym x) {
    if (x == GEN_ERR) return x;
    td_gram_sym v[2] = {x, c->empty};
    return alt(c, v, 2);
}

static td_rx_id string_rx(C *c, const js *s) {
    td_rx *rx = c->rx;
    if (s->maxlen != NONE && s->minlen > s->maxlen) return TD_RX_NOTHING;
    td_rx_id t = s->rx;
    if (s->lit.s) {
        /* a constant: its length is known */
        size_t n = 0;
        for (size_t i = 0; i < s->lit.n; i++) n += ((uint8_t)s->lit.s[i] & 0xC0) != 0x80;
        if (n < s->minlen || n > s->maxlen) return TD_RX_NOTHING;
    } else if (s->minlen || s->maxlen != NONE) {
        td_rx_id len = td_rx_repeat(rx, td_rx_any_char(rx), s->minlen, s->maxlen);
        t = t == TD_RX_FAIL ? len : td_rx_and(rx, t, len);
    }
    if (t == TD_RX_FAIL) t = td_rx_star(rx, td_rx_any_char(rx));
    /* only the canonical encoding of a constant, as JSON writers give it */
    return td_rx_json_quote(rx, t);
}

static td_rx_id scalar_rx(C *c, const js *s) {
    switch (s->kind) {
    case J_NULL: return lit_rx(c, "null");
    case J_BOOL:
        return s->bval < 0 ? td_rx_or(c->rx, lit_rx(c, "true"), lit_rx(c, "false"))
                           : lit_rx(c, s->bval ? "true" : "false");
    case J_NUM: return number_rx(c, s);
    case J_STR: return string_rx(c, s);
    }
    return TD_RX_FAIL;
}

static bool is_scalar(const js *s) {
    return s->kind == J_NULL || s->kind == J_BOOL || s->kind == J_NUM || s->kind == J_STR;
}

/* (sep item){lo, hi}; hi NONE: unbounded. */
static td_gram_sym rep_sep(C *c, td_gram_sym item, uint32_t lo, uint32_t hi) {
    if (hi != NONE && hi - lo > 100000) {
        fail(c, "at %s: a bound of more than 100,000 items or properties above the least",
             where(c));
        return GEN_ERR;
    }
    td_gram_sym si[2] = {c->item_sep, item};
    td_gram_sym one = seq(c, si, 2), tail = c->empty;
    if (hi == NONE) {
        /* T -> T sep item | empty */
        tail = td_gram_nonterm(c->g, "more");
        td_gram_sym r[3] = {tail, c->item_sep, item};
        if (tail == UINT32_MAX || td_gram_rule(c->g, tail, r, 3) ||
            td_gram_rule(c->g, tail, NULL, 0))
            return gram_ok(c), GEN_ERR;
    } else {
        for (uint32_t i = lo; i < hi && gram_ok(c); i++) {
            td_gram_sym r[2] = {one, tail};
            tail = opt(c, tail == c->empty ? one : seq(c, r, 2));
        }
    }
    td_gram_sym s = tail;
    for (uint32_t i = 0; i < lo && gram_ok(c); i++) {
        td_gram_sym r[2] = {one, s};
        s = s == c->empty ? one : seq(c, r, 2);
    }
    return c->failed ? GEN_ERR : s;
}

/* item (sep item){min - 1, max - 1}: min >= 1 */
static td_gram_sym bounded(C *c, td_gram_sym item, uint32_t min, uint32_t max) {
    td_gram_sym rest = rep_sep(c, item, min - 1, max == NONE ? NONE : max - 1);
    td_gram_sym r[2] = {item, rest};
    return rest == c->empty ? item : seq(c, r, 2);
}

static td_gram_sym gen(C *c, js *s);

static td_gram_sym gen_array(C *c, const js *a) {
    uint32_t maxitems = a->maxitems, minitems = a->minitems;
    if (maxitems != NONE && minitems > maxitems) return GEN_UNSAT;
    td_gram_sym more = a->items ? gen(c, a->items) : gen(c, &c->any);
    if (more == GEN_ERR) return GEN_ERR;
    size_t k = a->nprefix < maxitems ? a->nprefix : maxitems;
    td_gram_sym *x = al(c, (k + 1) * sizeof *x);
    if (!x) return GEN_ERR;
    for (size_t i = 0; i < k; i++) {
        x[i] = gen(c, a->prefix[i]);
        if (x[i] == GEN_ERR) return GEN_ERR;
        if (x[i] == GEN_UNSAT) {
            if (i < minitems) return GEN_UNSAT;
            k = maxitems = (uint32_t)i; /* no item can be at i or after */
            break;
        }
    }
    /* the items after the tuple: lo..hi of them */
    uint32_t lo = minitems > k ? minitems - (uint32_t)k : 0;
    uint32_t hi = maxitems == NONE ? NONE : maxitems - (uint32_t)k;
    if (more == GEN_UNSAT) {
        if (lo) return GEN_UNSAT;
        hi = 0;
    }
    td_gram_sym acc;
    if (k) {
        acc = hi ? rep_sep(c, more, lo, hi) : c->empty;
        for (size_t i = k; i-- > 0 && acc != GEN_ERR;) {
            td_gram_sym r[3] = {c->item_sep, x[i], acc};
            td_gram_sym *v = i ? r : r + 1;
            size_t nv = (i ? 3 : 2) - (acc == c->empty);
            td_gram_sym item = seq(c, v, nv);
            acc = i >= minitems ? opt(c, item) : item;
        }
    } else if (!hi) {
        acc = c->empty;
    } else {
        acc = bounded(c, more, lo ? lo : 1, hi);
        if (!lo) acc = opt(c, acc);
    }
    td_gram_sym v[3] = {lit(c, "["), acc, lit(c, "]")};
    if (acc == c->empty) {
        v[1] = v[2];
        return seq(c, v, 2);
    }
    return seq(c, v, 3);
}

typedef struct {
    td_gram_sym sym;
    bool required;
} field;

/* The fields from i on, after a field (prefixed) or first. */
static td_gram_sym fields(C *c, const field *f, size_t n, size_t i, bool prefixed,
                          td_gram_sym *memo) {
    if (i == n) return c->empty;
    if (memo[2 * i + prefixed] != GEN_ERR) return memo[2 * i + prefixed];
    td_gram_sym rest = fields(c, f, n, i + 1, true, memo), r;
    if (rest == GEN_ERR) return rest;
    td_gram_sym item[2] = {c->item_sep, f[i].sym};
    if (prefixed) {
        td_gram_sym x = seq(c, item, 2);
        if (!f[i].required) x = opt(c, x);
        td_gram_sym v[2] = {x, rest};
        r = rest == c->empty ? x : seq(c, v, 2);
    } else {
        td_gram_sym v[2] = {f[i].sym, rest};
        r = rest == c->empty ? f[i].sym : seq(c, v, 2);
        if (!f[i].required) {
            td_gram_sym un = fields(c, f, n, i + 1, false, memo);
            td_gram_sym a[2] = {r, un};
            r = alt(c, a, 2);
        }
    }
    memo[2 * i + prefixed] = r;
    return r;
}

static td_gram_sym object_fields(C *c, const field *f, size_t n) {
    td_gram_sym *memo = al(c, (2 * n + 2) * sizeof *memo);
    if (!memo) return GEN_ERR;
    for (size_t i = 0; i < 2 * n + 2; i++) memo[i] = GEN_ERR;
    td_gram_sym body = fields(c, f, n, 0, false, memo);
    if (body == GEN_ERR) return body;
    td_gram_sym v[3] = {lit(c, "{"), body, lit(c, "}")};
    return body == c->empty ? seq(c, (td_gram_sym[]){v[0], v[2]}, 2) : seq(c, v, 3);
}

static td_gram_sym string_lexeme(C *c) {
    if (c->string_sym == GEN_ERR)
        c->string_sym = lex(c, td_rx_json_quote(c->rx, td_rx_star(c->rx, td_rx_any_char(c->rx))));
    return c->string_sym;
}

/* A hex digit in either case. */
static td_rx_id hex_ci(C *c, unsigned d) {
    uint64_t set[4] = {0};
    const char *lo = "0123456789abcdef", *up = "0123456789ABCDEF";
    set[(unsigned char)lo[d] >> 6] |= 1ull << ((unsigned char)lo[d] & 63);
    set[(unsigned char)up[d] >> 6] |= 1ull << ((unsigned char)up[d] & 63);
    return td_rx_byteset(c->rx, set);
}

static td_rx_id u_escape(C *c, uint32_t unit) {
    td_rx_id r = lit_rx(c, "\\u");
    for (int i = 3; i >= 0; i--) r = td_rx_concat(c->rx, r, hex_ci(c, (unit >> (4 * i)) & 15));
    return r;
}

/* Every spelling inside a JSON string of the name's text: each character
 * as itself (unless it must be escaped), as its short escape, or as
 * \uXXXX (a surrogate pair above U+FFFF), hex digits in either case. */
static td_rx_id all_spellings(C *c, name nm) {
    td_rx *rx = c->rx;
    td_rx_id r = TD_RX_EMPTY;
    static const char shorts[] = "\"\"\\\\\bb\ff\nn\rr\tt";
    for (size_t i = 0; i < nm.n && r != TD_RX_FAIL;) {
        const uint8_t *p = (const uint8_t *)nm.s + i;
        size_t len = 1;
        uint32_t cp = p[0];
        if (p[0] >= 0xF0)
            len = 4, cp = p[0] & 7;
        else if (p[0] >= 0xE0)
            len = 3, cp = p[0] & 15;
        else if (p[0] >= 0xC0)
            len = 2, cp = p[0] & 31;
        if (i + len > nm.n) len = 1, cp = p[0];
        for (size_t k = 1; k < len; k++) cp = cp << 6 | (p[k] & 63);
        td_rx_id alts[3] = {TD_RX_NOTHING, TD_RX_NOTHING, TD_RX_NOTHING};
        if (cp >= 0x20 && cp != '"' && cp != '\\' && cp != 0x7f)
            alts[0] = td_rx_literal(rx, p, len);
        for (size_t k = 0; k + 1 < sizeof shorts; k += 2)
            if ((uint32_t)(unsigned char)shorts[k] == cp) {
                char e[2] = {'\\', shorts[k + 1]};
                alts[1] = td_rx_literal(rx, e, 2);
            }
        if (cp >= 0x10000) {
            uint32_t v = cp - 0x10000;
            alts[2] = td_rx_concat(rx, u_escape(c, 0xD800 + (v >> 10)),
                                   u_escape(c, 0xDC00 + (v & 0x3ff)));
        } else {
            alts[2] = u_escape(c, cp);
        }
        r = td_rx_concat(rx, r, td_rx_or_list(rx, alts, 3));
        i += len;
    }
    td_rx_id dq = lit_rx(c, "\"");
    return td_rx_concat(rx, dq, td_rx_concat(rx, r, dq));
}

/* A JSON string whose characters may also be written as \uXXXX escapes
 * (paired surrogates above U+FFFF): the names of additional properties
 * beside listed ones, as llguidance admits them. */
static td_rx_id escaped_string(C *c) {
    static const char pat[] =
        "\"(?:[^\"\\\\\\x00-\\x1F\\x7F]|\\\\[\"\\\\bfnrt]|\\\\u(?:[0-9a-ce-fA-CE-F][0-9a-fA-F]{3}|"
        "[dD][0-7][0-9a-fA-F]{2}|[dD][89abAB][0-9a-fA-F]{2}\\\\u[dD][c-fC-F][0-9a-fA-F]{2}))*\"";
    td_rx_id r;
    char e[200];
    if (td_rx_parse(c->rx, pat, sizeof pat - 1, 0, &r, e, sizeof e)) {
        fail(c, "internal: the escaped string: %s", e);
        return TD_RX_FAIL;
    }
    return r;
}

static td_gram_sym gen_object(C *c, const js *o) {
    size_t nnames = o->nprops + o->nrequired;
    field *f = al(c, (nnames + 1) * sizeof *f);
    td_rx_id *taken = al(c, (nnames + 1) * sizeof *taken);
    if (!f || !taken) return GEN_ERR;
    size_t nf = 0, ntaken = 0, nreq = 0, nopt = 0;
    for (size_t k = 0; k < nnames; k++) {
        name nm;
        if (k < o->nprops) {
            nm = o->names[k];
        } else {
            nm = o->required[k - o->nprops];
            bool listed = false;
            for (size_t i = 0; i < o->nprops; i++) listed |= name_eq(o->names[i], nm.s, nm.n);
            if (listed) continue;
        }
        bool req = false;
        for (size_t i = 0; i < o->nrequired; i++) req |= name_eq(o->required[i], nm.s, nm.n);
        taken[ntaken++] = all_spellings(c, nm);
        td_gram_sym val = gen(c, prop_schema(c, o, nm.s, nm.n));
        if (val == GEN_ERR) return val;
        if (val == GEN_UNSAT) {
            if (req) return GEN_UNSAT;
            continue;
        }
        /* the key as JSON writers write it: escapes only where needed,
         * \uXXXX in lower case */
        td_strbuf kb = {0};
        td_strbuf_puts(&kb, "\"");
        for (size_t i = 0; i < nm.n; i++) {
            unsigned char ch = (unsigned char)nm.s[i];
            const char *e = ch == '"'    ? "\\\""
                            : ch == '\\' ? "\\\\"
                            : ch == '\n' ? "\\n"
                            : ch == '\r' ? "\\r"
                            : ch == '\t' ? "\\t"
                            : ch == 8    ? "\\b"
                            : ch == 12   ? "\\f"
                                         : NULL;
            char u[8];
            if (!e && (ch < 0x20 || ch == 0x7f)) {
                snprintf(u, sizeof u, "\\u%04x", ch);
                e = u;
            }
            if (e)
                td_strbuf_puts(&kb, e);
            else
                td_strbuf_put(&kb, &ch, 1);
        }
        td_strbuf_puts(&kb, "\"");
        if (kb.oom) {
            td_strbuf_free(&kb);
            fail(c, "out of memory");
            return GEN_ERR;
        }
        td_gram_sym key = lex(c, td_rx_literal(c->rx, kb.v, kb.n));
        td_strbuf_free(&kb);
        td_gram_sym v[3] = {key, c->key_sep, val};
        f[nf++] = (field){seq(c, v, 3), req};
        if (req)
            nreq++;
        else
            nopt++;
    }
    uint32_t minp = o->minprops > nreq ? o->minprops - (uint32_t)nreq : 0;
    uint32_t maxp = o->maxprops == NONE  ? NONE
                    : o->maxprops > nreq ? o->maxprops - (uint32_t)nreq
                                         : 0;
    if (o->maxprops != NONE && nreq > o->maxprops) return GEN_UNSAT;
    bool addl_unsat = o->additional && o->additional->kind == J_UNSAT;
    if (nopt && (minp > 0 || maxp != NONE)) {
        if (!(minp <= 1 && (maxp == NONE ? minp == 1 : maxp == 1) && addl_unsat)) {
            fail(c,
                 "at %s: minProperties/maxProperties are supported only when every listed "
                 "property is required, or to ask for at most or at least one property",
                 where(c));
            return GEN_ERR;
        }
        /* one choice per optional field: it alone (at most one), or it at
         * least; plus none when at most one */
        td_gram_sym *alts = al(c, (nf + 1) * sizeof *alts);
        field *g = al(c, (nf + 1) * sizeof *g);
        if (!alts || !g) return GEN_ERR;
        size_t na = 0;
        for (size_t i = 0; i < nf; i++) {
            if (f[i].required) continue;
            size_t ng = 0;
            for (size_t j = 0; j < nf; j++) {
                if (maxp == 1 && !(j == i || f[j].required)) continue;
                g[ng++] = (field){f[j].sym, f[j].required || j == i};
            }
            alts[na++] = object_fields(c, g, ng);
        }
        if (maxp == 1 && minp == 0) {
            size_t ng = 0;
            for (size_t j = 0; j < nf; j++)
                if (f[j].required) g[ng++] = f[j];
            alts[na++] = object_fields(c, g, ng);
        }
        return alt(c, alts, na);
    }
    td_gram_sym val = o->additional ? gen(c, o->additional) : gen(c, &c->any);
    if (val == GEN_ERR) return val;
    if (val != GEN_UNSAT && maxp != 0) {
        td_gram_sym key;
        if (!ntaken) {
            key = string_lexeme(c);
        } else {
            /* any spelling of a name but the listed ones' */
            td_rx_id any = escaped_string(c);
            td_rx_id not_taken = td_rx_not(c->rx, td_rx_or_list(c->rx, taken, ntaken));
            key = lex(c, td_rx_and(c->rx, any, not_taken));
        }
        td_gram_sym v[3] = {key, c->key_sep, val};
        td_gram_sym item = seq(c, v, 3);
        f[nf++] = (field){bounded(c, item, minp ? minp : 1, maxp), minp > 0};
    } else if (minp > 0) {
        return GEN_UNSAT;
    }
    return object_fields(c, f, nf);
}

static td_gram_sym gen_any(C *c) {
    if (c->any_sym != GEN_ERR) return c->any_sym;
    td_gram_sym s = td_gram_nonterm(c->g, "json_any");
    if (s == UINT32_MAX) return gram_ok(c), GEN_ERR;
    c->any_sym = s;
    js num = {.kind = J_NUM, .rx = TD_RX_FAIL};
    td_rx_id sc[3] = {lit_rx(c, "null"), td_rx_or(c->rx, lit_rx(c, "true"), lit_rx(c, "false")),
                      number_rx(c, &num)};
    js arr = {.kind = J_ARR, .maxitems = NONE, .rx = TD_RX_FAIL};
    js obj = {.kind = J_OBJ, .maxprops = NONE, .rx = TD_RX_FAIL};
    td_gram_sym v[6] = {lex(c, sc[0]),    lex(c, sc[1]),      lex(c, sc[2]),
                        string_lexeme(c), gen_array(c, &arr), gen_object(c, &obj)};
    for (size_t i = 0; i < 6; i++)
        if (v[i] >= GEN_UNSAT || td_gram_rule(c->g, s, &v[i], 1)) {
            gram_ok(c);
            if (!c->failed) fail(c, "internal: the any-value rule");
            return GEN_ERR;
        }
    return s;
}

static td_gram_sym gen_node(C *c, js *s);

/* Each node is written once: a schema used twice (a $ref target, the
 * items of an array) is one rule. */
static td_gram_sym gen(C *c, js *s) {
    if (c->failed) return GEN_ERR;
    if (s->made) return s->sym;
    td_gram_sym r = gen_node(c, s);
    if (r != GEN_ERR) {
        s->made = true;
        s->sym = r;
    }
    return r;
}

static td_gram_sym gen_node(C *c, js *s) {
    switch (s->kind) {
    case J_ANY: return gen_any(c);
    case J_UNSAT: return GEN_UNSAT;
    case J_NULL:
    case J_BOOL:
    case J_NUM:
    case J_STR: {
        td_rx_id r = scalar_rx(c, s);
        if (r == TD_RX_NOTHING) return GEN_UNSAT;
        return lex(c, r);
    }
    case J_ARR: return gen_array(c, s);
    case J_OBJ: return gen_object(c, s);
    case J_ONEOF:
        fail(c,
             "at %s: oneOf is supported only when its branches are provably disjoint (of "
             "different types, different constants, or objects with a required property "
             "whose schemas are disjoint)",
             where(c));
        return GEN_ERR;
    case J_ANYOF: {
        td_gram_sym *v = al(c, (s->nopts + 1) * sizeof *v);
        td_rx_id *sc = al(c, (s->nopts + 1) * sizeof *sc);
        if (!v || !sc) return GEN_ERR;
        size_t n = 0, ns = 0;
        for (size_t i = 0; i < s->nopts; i++) {
            if (is_scalar(s->opts[i])) {
                sc[ns++] = scalar_rx(c, s->opts[i]);
                continue;
            }
            td_gram_sym x = gen(c, s->opts[i]);
            if (x == GEN_ERR) return x;
            if (x != GEN_UNSAT) v[n++] = x;
        }
        if (ns) {
            td_rx_id r = td_rx_or_list(c->rx, sc, ns);
            if (r == TD_RX_FAIL) return gram_ok(c), GEN_ERR;
            if (r != TD_RX_NOTHING) v[n++] = lex(c, r);
        }
        if (!n) return GEN_UNSAT;
        return alt(c, v, n);
    }
    case J_REF: {
        ref *r = &c->refs[s->ref];
        if (r->sym == UINT32_MAX) {
            r->sym = td_gram_nonterm(c->g, r->uri);
            if (r->sym == UINT32_MAX || !td_gr_reserve((void **)&c->pending, &c->cappending,
                                                       c->npending, sizeof *c->pending)) {
                gram_ok(c);
                if (!c->failed) fail(c, "out of memory");
                return GEN_ERR;
            }
            c->pending[c->npending++] = s->ref;
        }
        return r->sym;
    }
    }
    return GEN_ERR;
}

static void free_all(C *c) {
    for (size_t i = 0; i < c->nallocs; i++) free(c->allocs[i]);
    free(c->allocs);
    free(c->refs);
    free(c->res);
    free(c->anchors);
    free(c->lexrx);
    free(c->lexsym);
    free(c->pending);
    td_strbuf_free(&c->ptr);
    if (c->root) json_decref(c->root);
}

/* llguidance's "x-guidance" options at the schema's root: its separators
 * are taken, compact whitespace too; anything else is refused. */
static void guidance_opts(C *c) {
    json_t *x = json_is_object(c->root) ? json_object_get(c->root, "x-guidance") : NULL;
    if (!x) return;
    if (!json_is_object(x)) {
        fail(c, "at /x-guidance: expected an object of options");
        return;
    }
    const char *key;
    json_t *v;
    json_object_foreach(x, key, v) {
        if (!strcmp(key, "item_separator") && json_is_string(v))
            c->o.item_separator = json_string_value(v);
        else if (!strcmp(key, "key_separator") && json_is_string(v))
            c->o.key_separator = json_string_value(v);
        else if (!(!strcmp(key, "whitespace_flexible") && json_is_false(v))) {
            fail(c,
                 "at /x-guidance/%s: not supported (Tandem's JSON is compact: set the "
                 "separators with item_separator and key_separator)",
                 key);
            return;
        }
    }
}

int td_json_schema_into(td_gram *g, const char *schema, size_t n, const td_json_opts *opts,
                        td_gram_sym *out, char *err, size_t errlen) {
    C c = {0};
    if (opts) c.o = *opts;
    if (!c.o.item_separator) c.o.item_separator = ",";
    if (!c.o.key_separator) c.o.key_separator = ":";
    if (!c.o.max_schema_nodes) c.o.max_schema_nodes = 50000;
    if (!c.o.max_depth) c.o.max_depth = 128;
    c.any = (js){.kind = J_ANY, .rx = TD_RX_FAIL};
    c.unsat_false = (js){.kind = J_UNSAT, .why = "the schema is false", .rx = TD_RX_FAIL};
    c.empty = c.any_sym = c.string_sym = GEN_ERR;
    c.g = g;
    c.rx = td_gram_rx(g);
    td_gram_sym start = GEN_ERR;
    json_error_t je;
    c.root = json_loadb(schema, n, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (!c.root) {
        fail(&c, "the schema is not JSON: %s (line %d, column %d)", je.text, je.line, je.column);
        goto out;
    }
    guidance_opts(&c);
    if (c.failed) goto out;
    json_t *sv = json_object_get(c.root, "$schema");
    c.draft = DRAFT_2020;
    if (json_is_string(sv)) {
        const char *d = json_string_value(sv);
        if (strstr(d, "draft-07") || strstr(d, "draft-06") || strstr(d, "draft-04"))
            c.draft = DRAFT_7;
        else if (strstr(d, "2019-09"))
            c.draft = DRAFT_2019;
    }
    /* the root's base: its $id, or none */
    json_t *rid = json_object_get(c.root, "$id");
    if (c.draft == DRAFT_7 && json_object_get(c.root, "$ref")) rid = NULL;
    if (json_is_string(rid)) {
        char *u = dupn(&c, json_string_value(rid), json_string_length(rid));
        if (u) u[strcspn(u, "#")] = 0;
        c.base_root = u;
    }
    c.base = c.base_root;
    if (!c.failed && json_is_object(c.root) && !prescan(&c, c.root, c.base_root, 0) && !c.failed)
        fail(&c, "the schema is nested too deep or memory ran out");
    if (c.failed) goto out;
    js *root = read_schema(&c, c.root, 0);
    if (!root) goto out;
    c.empty = td_gram_nonterm(g, "empty");
    if (c.empty == UINT32_MAX || td_gram_rule(g, c.empty, NULL, 0)) {
        gram_ok(&c);
        goto out;
    }
    c.item_sep = lit(&c, c.o.item_separator);
    c.key_sep = lit(&c, c.o.key_separator);
    start = gen(&c, root);
    if (start < GEN_UNSAT) { /* the start is a nonterminal (it may be a lexeme) */
        td_gram_sym one = td_gram_nonterm(g, "the schema");
        if (one == UINT32_MAX || td_gram_rule(g, one, &start, 1)) gram_ok(&c);
        start = one;
    }
    for (size_t i = 0; i < c.npending && !c.failed; i++) {
        ref *r = &c.refs[c.pending[i]];
        td_gram_sym body = gen(&c, r->schema);
        /* a target that admits nothing: a rule that never completes */
        if (body == GEN_UNSAT) body = r->sym;
        if (body != GEN_ERR && td_gram_rule(g, r->sym, &body, 1)) gram_ok(&c);
    }
    if (c.failed) goto out;
    if (start == GEN_UNSAT)
        fail(&c, "the schema is unsatisfiable: no document is valid (%s)",
             root->kind == J_UNSAT && root->why ? root->why : "no alternative fits");
out:
    if (c.failed) snprintf(err, errlen, "%s", c.err);
    free_all(&c);
    *out = start;
    return c.failed ? -1 : 0;
}

td_gram *td_gram_from_json_schema(const char *schema, size_t n, const td_json_opts *opts,
                                  const td_gram_limits *lim, char *err, size_t errlen) {
    td_gram *g = td_gram_new(lim);
    if (!g) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    td_gram_sym start;
    if (td_json_schema_into(g, schema, n, opts, &start, err, errlen)) {
        td_gram_free(g);
        return NULL;
    }
    if (td_gram_finish(g, start)) {
        snprintf(err, errlen, "%s", td_gram_error(g));
        td_gram_free(g);
        return NULL;
    }
    return g;
}
