/* The Lark-style grammar language (lark.h). */
#include "common/grammar/lark.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "common/grammar/json_schema.h"
#include "common/grammar/util.h"

enum {
    T_EOF,
    T_NL,
    T_RULE,   /* a lowercase name */
    T_TERM,   /* an UPPERCASE name */
    T_STRING, /* decoded into the token's text */
    T_REGEX,  /* the pattern between the slashes */
    T_INT,
    T_PUNCT,  /* one of : | ( ) [ ] ? * + ~ { } , and .. (text) */
    T_IGNORE, /* %ignore, at a line's start */
    T_TOKENS, /* a token terminal of several ids (ids, nids) */
    T_JSON,   /* %json {schema}: the schema's text */
};

typedef struct {
    int kind, line;
    char *text; /* T_RULE, T_TERM, T_STRING (bytes), T_REGEX, T_PUNCT */
    size_t len;
    long ival;
    bool fold;      /* T_STRING: case-insensitive ("..."i) */
    unsigned flags; /* T_REGEX: TD_RX_ICASE, TD_RX_DOTALL (/.../is) */
    int32_t *ids;   /* T_TOKENS */
    size_t nids;
} tok;

typedef struct {
    char *name;
    bool is_term;
    int line;
    size_t b, e;     /* body tokens [b, e) */
    td_gram_sym sym; /* rule: its nonterminal; terminal: its lexeme (BAD until used) */
    td_rx_id re;     /* terminal: its expression (TD_RX_FAIL until made) */
    int state;       /* terminal: 0 not made, 1 being made, 2 made */
    /* a rule with lexeme options (name[lazy]: ..., [suffix=X]): one lexeme,
     * ending at its first match; suffix: the option's token, or 0 */
    bool lazy;
    size_t suffix;
} def;

typedef struct {
    int kind; /* T_STRING or T_REGEX */
    bool fold;
    unsigned flags;
    char *text;
    size_t len;
    td_gram_sym sym;
} anon;

typedef struct {
    td_gram *g;
    td_rx *rx;
    tok *t;
    size_t nt, ct, i, end;
    def *d;
    size_t nd, cd;
    anon *an;
    size_t nan, can;
    int nfresh;
    char *err;
    size_t errlen;
    bool failed;
    td_lark_token_fn token_fn;
    void *token_ctx;
    size_t *ign; /* the %ignore lines' first tokens */
    size_t nign, cign;
} lk;

#define BAD UINT32_MAX

static void lerr(lk *p, int line, const char *fmt, ...) {
    if (p->failed) return;
    p->failed = true;
    char msg[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (p->err && p->errlen) snprintf(p->err, p->errlen, "grammar: line %d: %s", line, msg);
}

static bool add_tok(lk *p, tok t) {
    if (!td_gr_reserve((void **)&p->t, &p->ct, p->nt, sizeof *p->t)) {
        free(t.text);
        lerr(p, t.line, "out of memory");
        return false;
    }
    p->t[p->nt++] = t;
    return true;
}

/* A Python string literal at s[*i] (on the quote): its bytes in *out. */
static bool read_string(lk *p, const char *s, size_t n, size_t *i, int line, char **out,
                        size_t *olen, bool *fold) {
    const char q = s[(*i)++];
    char *o = malloc(n - *i + 1);
    size_t k = 0;
    if (!o) {
        lerr(p, line, "out of memory");
        return false;
    }
    while (*i < n && s[*i] != q) {
        char c = s[(*i)++];
        if (c == '\n') break;
        if (c != '\\') {
            o[k++] = c;
            continue;
        }
        if (*i >= n) break;
        c = s[(*i)++];
        int nh = 0;
        switch (c) {
        case 'n': o[k++] = '\n'; break;
        case 't': o[k++] = '\t'; break;
        case 'r': o[k++] = '\r'; break;
        case '0': o[k++] = 0; break;
        case '\\':
        case '"':
        case '\'': o[k++] = c; break;
        case 'x': nh = 2; break;
        case 'u': nh = 4; break;
        case 'U': nh = 8; break;
        default:
            free(o);
            lerr(p, line, "unsupported escape \\%c in a string", c);
            return false;
        }
        if (nh) {
            uint32_t v = 0;
            for (int j = 0; j < nh; j++) {
                int h = *i < n ? td_gr_hexval(s[*i]) : -1;
                if (h < 0) {
                    free(o);
                    lerr(p, line, "expected %d hex digits after \\%c", nh, c);
                    return false;
                }
                v = v * 16 + (uint32_t)h;
                (*i)++;
            }
            if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
                free(o);
                lerr(p, line, "escape \\%c is not a Unicode scalar value", c);
                return false;
            }
            k += (size_t)td_gr_utf8_put(v, (uint8_t *)o + k);
        }
    }
    if (*i >= n || s[*i] != q) {
        free(o);
        lerr(p, line, "unterminated string");
        return false;
    }
    (*i)++;
    *fold = *i < n && s[*i] == 'i';
    if (*fold) {
        (*i)++;
        for (size_t j = 0; j < k; j++)
            if ((unsigned char)o[j] >= 0x80) {
                free(o);
                lerr(p, line, "a case-insensitive literal (\"...\"i) must be ASCII");
                return false;
            }
    }
    o[k] = 0; /* for messages; the length counts */
    *out = o;
    *olen = k;
    return true;
}

static bool is_ident(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

/* The end of the name at s[i] ('-' inside a name, as in llguidance, but
 * not the arrow of an alias). */
static size_t name_end(const char *s, size_t n, size_t i) {
    while (i < n && (is_ident(s[i]) || (s[i] == '-' && i + 1 < n && is_ident(s[i + 1])))) i++;
    return i;
}

static size_t skip_blanks(const char *s, size_t n, size_t i) {
    while (i < n && (s[i] == ' ' || s[i] == '\t')) i++;
    return i;
}

/* Lark's common terminals (%import common.NAME), as llguidance defines
 * them, as ECMAScript patterns. */
static const struct {
    const char *name, *re;
} k_common[] = {
    {"DIGIT", "[0-9]"},
    {"HEXDIGIT", "[a-fA-F0-9]"},
    {"INT", "[0-9]+"},
    {"SIGNED_INT", "[+-]?[0-9]+"},
    {"DECIMAL", "[0-9]+\\.[0-9]*|\\.[0-9]+"},
    {"_EXP", "[eE][+-]?[0-9]+"},
    {"FLOAT", "[0-9]+[eE][+-]?[0-9]+|([0-9]+\\.[0-9]*|\\.[0-9]+)([eE][+-]?[0-9]+)?"},
    {"SIGNED_FLOAT", "[+-]?([0-9]+[eE][+-]?[0-9]+|([0-9]+\\.[0-9]*|\\.[0-9]+)([eE][+-]?[0-9]+)?)"},
    {"NUMBER", "[0-9]+[eE][+-]?[0-9]+|([0-9]+\\.[0-9]*|\\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+"},
    {"SIGNED_NUMBER",
     "[+-]?([0-9]+[eE][+-]?[0-9]+|([0-9]+\\.[0-9]*|\\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+)"},
    {"ESCAPED_STRING", "\"(\\\\[^\\n]|[^\"\\\\])*\""},
    {"LCASE_LETTER", "[a-z]"},
    {"UCASE_LETTER", "[A-Z]"},
    {"LETTER", "[A-Za-z]"},
    {"WORD", "[A-Za-z]+"},
    {"CNAME", "[_A-Za-z][_A-Za-z0-9]*"},
    {"WS_INLINE", "[ \\t]+"},
    {"WS", "[ \\t\\f\\r\\n]+"},
    {"CR", "\\r"},
    {"LF", "\\n"},
    {"NEWLINE", "(\\r?\\n)+"},
    {"SH_COMMENT", "#[^\\n]*"},
    {"CPP_COMMENT", "//[^\\n]*"},
    {"C_COMMENT", "/\\*[^*]*\\*+([^/*][^*]*\\*+)*/"},
    {"SQL_COMMENT", "--[^\\n]*"},
};

/* Adds the definition NAME: /re/ of the common terminal what as name. */
static bool add_common(lk *p, const char *what, size_t wn, const char *name, size_t nn, int line) {
    const char *re = NULL;
    for (size_t k = 0; k < sizeof k_common / sizeof *k_common; k++)
        if (strlen(k_common[k].name) == wn && !memcmp(k_common[k].name, what, wn))
            re = k_common[k].re;
    if (!re) {
        lerr(p, line, "%%import: common has no terminal %.*s", (int)wn, what);
        return false;
    }
    for (size_t k = 0; k < nn; k++)
        if (name[k] >= 'a' && name[k] <= 'z') {
            lerr(p, line, "%%import: %.*s is no terminal name (UPPERCASE)", (int)nn, name);
            return false;
        }
    char *a = strndup(name, nn), *b = strdup(":"), *c = strdup(re);
    if (!a || !b || !c) {
        free(a), free(b), free(c);
        lerr(p, line, "out of memory");
        return false;
    }
    return add_tok(p, (tok){.kind = T_NL, .line = line}) &&
           add_tok(p, (tok){.kind = T_TERM, .line = line, .text = a, .len = nn}) &&
           add_tok(p, (tok){.kind = T_PUNCT, .line = line, .text = b, .len = 1}) &&
           add_tok(p, (tok){.kind = T_REGEX, .line = line, .text = c, .len = strlen(c)}) &&
           add_tok(p, (tok){.kind = T_NL, .line = line});
}

/* %import common.NAME [-> ALIAS] | %import common (NAME, ...), from
 * s[*i] (after the word) to the line's end. */
static bool import_line(lk *p, const char *s, size_t n, size_t *i, int line) {
    size_t j = skip_blanks(s, n, *i);
    if (n - j < 6 || memcmp(s + j, "common", 6)) {
        lerr(p, line, "%%import: only Lark's common terminals can be imported");
        return false;
    }
    j += 6;
    if (j < n && s[j] == '.') {
        const size_t a = j + 1, ae = name_end(s, n, a);
        size_t b = a, be = ae;
        j = skip_blanks(s, n, ae);
        if (j + 1 < n && s[j] == '-' && s[j + 1] == '>') { /* -> ALIAS */
            b = skip_blanks(s, n, j + 2);
            be = name_end(s, n, b);
            j = be;
        }
        if (ae == a || be == b || !add_common(p, s + a, ae - a, s + b, be - b, line)) {
            if (!p->failed) lerr(p, line, "%%import: expected common.NAME");
            return false;
        }
    } else {
        j = skip_blanks(s, n, j);
        if (j >= n || s[j] != '(') {
            lerr(p, line, "%%import: expected common.NAME or common (NAME, ...)");
            return false;
        }
        for (j++;;) {
            j = skip_blanks(s, n, j);
            const size_t a = j, ae = name_end(s, n, a);
            if (ae == a || !add_common(p, s + a, ae - a, s + a, ae - a, line)) {
                if (!p->failed) lerr(p, line, "%%import: expected a name");
                return false;
            }
            j = skip_blanks(s, n, ae);
            if (j < n && s[j] == ',') {
                j++;
                continue;
            }
            if (j < n && s[j] == ')') {
                j++;
                break;
            }
            lerr(p, line, "%%import: expected ',' or ')'");
            return false;
        }
    }
    *i = j;
    return true;
}

/* %llguidance {options}: a JSON object from s[*i] (after the word), which
 * may span lines (*line counts them). The options that change no output
 * Tandem makes are taken; the others are refused. */
/* The JSON object from s[*i] (blanks first), which may span lines (*line
 * counts them): its first byte in *a, *i past it. false when the braces do
 * not close. */
static bool json_span(const char *s, size_t n, size_t *i, int *line, size_t *a) {
    size_t j = *i;
    while (j < n && (s[j] == ' ' || s[j] == '\t' || s[j] == '\r' || s[j] == '\n'))
        *line += s[j++] == '\n';
    *a = j;
    int depth = 0;
    bool in_str = false;
    for (; j < n; j++) {
        const char c = s[j];
        if (c == '\n') ++*line;
        if (in_str) {
            if (c == '\\')
                j++;
            else if (c == '"')
                in_str = false;
        } else if (c == '"') {
            in_str = true;
        } else if (c == '{') {
            depth++;
        } else if (c == '}' && --depth == 0) {
            *i = j + 1;
            return true;
        } else if (depth == 0) {
            break;
        }
    }
    *i = j;
    return false;
}

static bool llguidance_line(lk *p, const char *s, size_t n, size_t *i, int *line) {
    size_t a;
    const bool closed = json_span(s, n, i, line, &a);
    json_error_t je;
    json_t *o = closed ? json_loadb(s + a, *i - a, 0, &je) : NULL;
    if (!json_is_object(o)) {
        json_decref(o);
        lerr(p, *line, "%%llguidance: expected a JSON object of options");
        return false;
    }
    const char *key;
    json_t *v;
    bool ok = true;
    json_object_foreach(o, key, v) {
        /* forcing: the scheduler's choice, the allowed tokens are the same */
        if (!strcmp(key, "no_forcing") && json_is_boolean(v)) continue;
        if (!strcmp(key, "allow_invalid_utf8") && json_is_false(v)) continue;
        lerr(p, *line, "%%llguidance: the option %s is not supported", key);
        ok = false;
        break;
    }
    json_decref(o);
    return ok;
}

/* A token terminal's ids: "<[a-b,c,...]>" (inclusive ranges). */
#define MAX_TOKEN_IDS 4096
static bool token_ids(lk *p, const char *s, size_t n, int line, int32_t **out, size_t *nout) {
    int32_t *ids = NULL;
    size_t ni = 0, ci = 0;
    for (size_t k = 0; k < n;) {
        long lo = 0, hi;
        size_t d = k;
        while (k < n && s[k] >= '0' && s[k] <= '9' && lo < INT32_MAX / 10)
            lo = lo * 10 + (s[k++] - '0');
        hi = lo;
        if (k == d) goto bad;
        if (k < n && s[k] == '-') {
            hi = 0;
            d = ++k;
            while (k < n && s[k] >= '0' && s[k] <= '9' && hi < INT32_MAX / 10)
                hi = hi * 10 + (s[k++] - '0');
            if (k == d || hi < lo) goto bad;
        }
        if (k < n && s[k] != ',') goto bad;
        if (k < n) k++;
        if (hi - lo + 1 > (long)(MAX_TOKEN_IDS - ni)) {
            free(ids);
            lerr(p, line, "a token terminal of more than %d ids", MAX_TOKEN_IDS);
            return false;
        }
        for (long v = lo; v <= hi; v++) {
            if (!td_gr_reserve((void **)&ids, &ci, ni, sizeof *ids)) {
                free(ids);
                lerr(p, line, "out of memory");
                return false;
            }
            ids[ni++] = (int32_t)v;
        }
    }
    *out = ids;
    *nout = ni;
    return true;
bad:
    free(ids);
    lerr(p, line, "token terminal <[%.*s]>: expected ids and ranges (<[1-5,9]>)", (int)n, s);
    return false;
}

static bool lex(lk *p, const char *s, size_t n) {
    int line = 1, depth = 0;
    size_t i = 0;
    while (i < n && !p->failed) {
        const char c = s[i];
        if (c == '\n') {
            line++, i++;
            if (depth == 0) {
                /* a line that starts with | continues the rule (blank and
                 * comment lines between are skipped) */
                size_t j = i;
                for (;;) {
                    while (j < n && (s[j] == ' ' || s[j] == '\t' || s[j] == '\r' || s[j] == '\n'))
                        j++;
                    if (j < n && (s[j] == '#' || (s[j] == '/' && j + 1 < n && s[j + 1] == '/')))
                        while (j < n && s[j] != '\n') j++;
                    else
                        break;
                }
                if (j < n && s[j] == '|') continue;
                if (p->nt && p->t[p->nt - 1].kind != T_NL &&
                    !add_tok(p, (tok){.kind = T_NL, .line = line - 1}))
                    return false;
            }
            continue;
        }
        if (c == ' ' || c == '\t' || c == '\r') {
            i++;
            continue;
        }
        if (c == '/' && i + 1 < n && s[i + 1] == '/') {
            while (i < n && s[i] != '\n') i++;
            continue;
        }
        if (c == '#') {
            while (i < n && s[i] != '\n') i++;
            continue;
        }
        if (c == '%') {
            size_t j = i + 1;
            while (j < n && is_ident(s[j])) j++;
            const size_t wl = j - i - 1;
            if (wl == 4 && !memcmp(s + i + 1, "json", 4)) { /* a schema, inline */
                const int l0 = line;
                size_t a;
                if (!json_span(s, n, &j, &line, &a)) {
                    lerr(p, l0, "%%json: expected a JSON object");
                    return false;
                }
                tok t = {.kind = T_JSON, .line = l0, .len = j - a};
                if (!(t.text = strndup(s + a, j - a))) return lerr(p, l0, "out of memory"), false;
                if (!add_tok(p, t)) return false;
                i = j;
                continue;
            }
            if (wl == 5 && !memcmp(s + i + 1, "regex", 5)) {
                lerr(p, line, "inline %.*s {...} is not supported", (int)(j - i), s + i);
                return false;
            }
            if (p->nt && p->t[p->nt - 1].kind != T_NL) {
                lerr(p, line, "%.*s must start a line", (int)(j - i), s + i);
                return false;
            }
            if (wl == 6 && !memcmp(s + i + 1, "ignore", 6)) {
                if (!add_tok(p, (tok){.kind = T_IGNORE, .line = line})) return false;
            } else if (wl == 6 && !memcmp(s + i + 1, "import", 6)) {
                if (!import_line(p, s, n, &j, line)) return false;
            } else if (wl == 10 && !memcmp(s + i + 1, "llguidance", 10)) {
                if (!llguidance_line(p, s, n, &j, &line)) return false;
            } else {
                lerr(p, line, "the directive %.*s is not supported", (int)(j - i), s + i);
                return false;
            }
            i = j;
            continue;
        }
        if (c == '<' && i + 1 < n && (s[i + 1] == '[' || s[i + 1] == '|')) {
            /* a token terminal: the bytes that stand for the token */
            const char close = s[i + 1] == '[' ? ']' : '|';
            size_t j = i + 2;
            while (j + 1 < n && s[j] != '\n' && !(s[j] == close && s[j + 1] == '>')) j++;
            if (j + 1 >= n || s[j] != close || s[j + 1] != '>') {
                lerr(p, line, "unterminated token terminal %.*s", (int)(j - i), s + i);
                return false;
            }
            const size_t tn = j + 2 - i;
            if (close == ']' &&
                (memchr(s + i + 2, ',', j - i - 2) || memchr(s + i + 2, '-', j - i - 2))) {
                tok t = {.kind = T_TOKENS, .line = line};
                if (!token_ids(p, s + i + 2, j - i - 2, line, &t.ids, &t.nids)) return false;
                for (size_t k = 0; p->token_fn && k < t.nids; k++) {
                    char spec[24], why[200] = "";
                    const int sn = snprintf(spec, sizeof spec, "<[%d]>", (int)t.ids[k]);
                    if (p->token_fn(p->token_ctx, spec, (size_t)sn, why, sizeof why) < 0) {
                        free(t.ids);
                        lerr(p, line, "token terminal %.*s: %s: %s", (int)tn, s + i, spec, why);
                        return false;
                    }
                }
                if (!add_tok(p, t)) return free(t.ids), false;
                i = j + 2;
                continue;
            }
            int32_t id = -1;
            char why[200] = "";
            if (p->token_fn) {
                id = p->token_fn(p->token_ctx, s + i, tn, why, sizeof why);
            } else if (close == ']') {
                long v = 0;
                size_t k = i + 2;
                for (; k < j && s[k] >= '0' && s[k] <= '9' && v < INT32_MAX / 10; k++)
                    v = v * 10 + (s[k] - '0');
                if (k == j && k > i + 2) id = (int32_t)v;
                snprintf(why, sizeof why, "a token id is digits");
            } else {
                snprintf(why, sizeof why,
                         "a token named by its text needs the model's "
                         "vocabulary (tandem grammar --model)");
            }
            if (id < 0) {
                lerr(p, line, "token terminal %.*s: %s", (int)tn, s + i, why);
                return false;
            }
            tok t = {.kind = T_STRING, .line = line, .len = TD_GR_TOKEN_BYTES};
            if (!(t.text = malloc(TD_GR_TOKEN_BYTES + 1)))
                return lerr(p, line, "out of memory"), false;
            td_gr_token_bytes(id, (uint8_t *)t.text);
            t.text[TD_GR_TOKEN_BYTES] = 0;
            if (!add_tok(p, t)) return false;
            i = j + 2;
            continue;
        }
        if (c == '"' || c == '\'') {
            tok t = {.kind = T_STRING, .line = line};
            if (!read_string(p, s, n, &i, line, &t.text, &t.len, &t.fold) || !add_tok(p, t))
                return false;
            continue;
        }
        if (c == '/') {
            size_t j = i + 1;
            bool in_class = false;
            while (j < n && s[j] != '\n' && (s[j] != '/' || in_class)) {
                if (s[j] == '\\' && j + 1 < n)
                    j++;
                else if (s[j] == '[')
                    in_class = true;
                else if (s[j] == ']')
                    in_class = false;
                j++;
            }
            if (j >= n || s[j] != '/') {
                lerr(p, line, "unterminated /regex/");
                return false;
            }
            tok t = {.kind = T_REGEX, .line = line, .len = j - i - 1};
            for (size_t f = j + 1; f < n && s[f] >= 'a' && s[f] <= 'z'; f++) {
                if (s[f] == 'i') {
                    t.flags |= TD_RX_ICASE;
                } else if (s[f] == 's') {
                    t.flags |= TD_RX_DOTALL;
                } else {
                    lerr(p, line, "the regex flag /.../%c is not supported (i and s are)", s[f]);
                    return false;
                }
            }
            t.text = malloc(t.len + 1);
            if (!t.text) return lerr(p, line, "out of memory"), false;
            memcpy(t.text, s + i + 1, t.len);
            t.text[t.len] = 0;
            if (!add_tok(p, t)) return false;
            i = j + 1;
            while (i < n && s[i] >= 'a' && s[i] <= 'z') i++; /* the flags */
            continue;
        }
        if (c >= '0' && c <= '9') {
            long v = 0;
            while (i < n && s[i] >= '0' && s[i] <= '9') {
                if (v < 100000000) v = v * 10 + (s[i] - '0');
                i++;
            }
            if (i + 1 < n && s[i] == '.' && s[i + 1] >= '0' && s[i + 1] <= '9') {
                /* a fraction (an option's value): its integer part */
                i++;
                while (i < n && s[i] >= '0' && s[i] <= '9') i++;
            }
            if (!add_tok(p, (tok){.kind = T_INT, .line = line, .ival = v})) return false;
            continue;
        }
        if (c == '-' && i + 1 < n && s[i + 1] == '>') { /* an alias: the tree's, ignored */
            i = name_end(s, n, skip_blanks(s, n, i + 2));
            continue;
        }
        if (is_ident(c)) {
            const size_t j = name_end(s, n, i);
            bool lower = false;
            for (size_t k = i; k < j; k++) lower |= s[k] >= 'a' && s[k] <= 'z';
            tok t = {.kind = lower ? T_RULE : T_TERM, .line = line, .len = j - i};
            t.text = malloc(t.len + 1);
            if (!t.text) return lerr(p, line, "out of memory"), false;
            memcpy(t.text, s + i, t.len);
            t.text[t.len] = 0;
            if (!add_tok(p, t)) return false;
            i = j;
            continue;
        }
        if (c == '.' && i + 1 < n && s[i + 1] == '.') {
            tok t = {.kind = T_PUNCT, .line = line, .len = 2, .text = strdup("..")};
            if (!t.text || !add_tok(p, t)) return false;
            i += 2;
            continue;
        }
        if (strchr(":|()[]?*+~!{},=", c)) {
            if (c == '(' || c == '[') depth++;
            if ((c == ')' || c == ']') && depth > 0) depth--;
            char b[2] = {c, 0};
            tok t = {.kind = T_PUNCT, .line = line, .len = 1, .text = strdup(b)};
            if (!t.text || !add_tok(p, t)) return false;
            i++;
            continue;
        }
        if (c == '.') {
            lerr(p, line, "rule priorities (name.N) are not supported");
            return false;
        }
        if (c == '@') {
            lerr(p, line, "references to other grammars (@name) are not supported");
            return false;
        }
        lerr(p, line, "unexpected character '%c'", c);
        return false;
    }
    if (p->failed) return false;
    return add_tok(p, (tok){.kind = T_NL, .line = line}) &&
           add_tok(p, (tok){.kind = T_EOF, .line = line});
}

static bool punct(const tok *t, char c) {
    return t->kind == T_PUNCT && t->len == 1 && t->text[0] == c;
}

static def *find_def(lk *p, const char *name) {
    for (size_t i = 0; i < p->nd; i++)
        if (!strcmp(p->d[i].name, name)) return &p->d[i];
    return NULL;
}

/* ---- terminals: regular expressions ---- */

/* A string token's expression: its bytes, each ASCII letter either case
 * when it is case-insensitive (with U+212A for k and U+017F for s, as
 * Unicode's simple case folding has them, and the regex flag i). */
static td_rx_id str_rx(lk *p, const tok *t) {
    if (!t->fold) return td_rx_literal(p->rx, t->text, t->len);
    td_rx_id r = TD_RX_EMPTY;
    for (size_t k = 0; k < t->len; k++) {
        const uint32_t c = (uint8_t)t->text[k], lo = c | 0x20;
        uint32_t set[3][2] = {{c, c}};
        size_t n = 1;
        if (lo >= 'a' && lo <= 'z') {
            set[0][0] = set[0][1] = lo - 32;
            set[1][0] = set[1][1] = lo;
            n = 2;
            if (lo == 'k' || lo == 's') set[2][0] = set[2][1] = lo == 'k' ? 0x212A : 0x17F, n = 3;
        }
        r = td_rx_concat(p->rx, r, td_rx_codepoints(p->rx, (const uint32_t(*)[2])set, n));
    }
    return r;
}

/* A token terminal of several ids: any one of their tokens. */
static td_rx_id tokens_rx(lk *p, const tok *t) {
    td_rx_id r = TD_RX_NOTHING;
    for (size_t k = 0; k < t->nids; k++) {
        uint8_t b[TD_GR_TOKEN_BYTES];
        td_gr_token_bytes(t->ids[k], b);
        r = td_rx_or(p->rx, r, td_rx_literal(p->rx, b, sizeof b));
    }
    return r;
}

static td_rx_id t_alts(lk *p);

static td_rx_id term_rx(lk *p, def *d, int line) {
    if (d->state == 2) return d->re;
    if (d->state == 1) {
        lerr(p, line, "terminal %s refers to itself", d->name);
        return TD_RX_FAIL;
    }
    d->state = 1;
    const size_t si = p->i, se = p->end;
    p->i = d->b, p->end = d->e;
    td_rx_id r = t_alts(p);
    if (!p->failed && p->i < p->end)
        lerr(p, p->t[p->i].line, "unexpected token in terminal %s", d->name);
    p->i = si, p->end = se;
    d->re = r;
    d->state = 2;
    return p->failed ? TD_RX_FAIL : r;
}

/* The bounds of a postfix operator at p->i: true with min, max (UINT32_MAX
 * unbounded) and p->i past it; false when there is none. */
static bool postfix(lk *p, uint32_t *mn, uint32_t *mx) {
    const tok *t = &p->t[p->i];
    if (p->i >= p->end) return false;
    if (punct(t, '?')) return p->i++, *mn = 0, *mx = 1, true;
    if (punct(t, '*')) return p->i++, *mn = 0, *mx = UINT32_MAX, true;
    if (punct(t, '+')) return p->i++, *mn = 1, *mx = UINT32_MAX, true;
    if (punct(t, '{')) { /* {n}, {m,n}, {m,}, {,n} */
        p->i++;
        bool lo = false, comma = false, hi = false;
        *mn = 0, *mx = UINT32_MAX;
        if (p->i < p->end && p->t[p->i].kind == T_INT) *mn = (uint32_t)p->t[p->i++].ival, lo = true;
        if (p->i < p->end && punct(&p->t[p->i], ',')) p->i++, comma = true;
        if (comma && p->i < p->end && p->t[p->i].kind == T_INT)
            *mx = (uint32_t)p->t[p->i++].ival, hi = true;
        if (!comma) *mx = *mn;
        if (!(lo || hi) || p->i >= p->end || !punct(&p->t[p->i], '}')) {
            lerr(p, t->line, "expected {n}, {m,n}, {m,} or {,n}");
            return false;
        }
        p->i++;
        if (*mx < *mn || *mn > 1000 || (*mx != UINT32_MAX && *mx > 1000)) {
            lerr(p, t->line, "repetition {%u,%u}: out of order or above 1000", *mn, *mx);
            return false;
        }
        return true;
    }
    if (!punct(t, '~')) return false;
    p->i++;
    if (p->i >= p->end || p->t[p->i].kind != T_INT) {
        lerr(p, t->line, "expected a count after ~");
        return false;
    }
    *mn = *mx = (uint32_t)p->t[p->i++].ival;
    if (p->i < p->end && p->t[p->i].kind == T_PUNCT && !strcmp(p->t[p->i].text, "..")) {
        p->i++;
        if (p->i >= p->end || p->t[p->i].kind != T_INT) {
            lerr(p, t->line, "expected a count after ..");
            return false;
        }
        *mx = (uint32_t)p->t[p->i++].ival;
    }
    if (*mx < *mn || *mx > 1000) {
        lerr(p, t->line, "repetition ~ %u..%u: out of order or above 1000", *mn, *mx);
        return false;
    }
    return true;
}

/* The one code point a string token holds (UTF-8). */
static bool one_char(const tok *t, uint32_t *cp) {
    const unsigned char *s = (const unsigned char *)t->text;
    const size_t n = t->len;
    if (n == 0) return false;
    const int k = s[0] < 0x80 ? 1 : s[0] >= 0xF0 ? 4 : s[0] >= 0xE0 ? 3 : s[0] >= 0xC0 ? 2 : 0;
    if (!k || (size_t)k != n) return false;
    uint32_t v = k == 1 ? s[0] : s[0] & (0x7Fu >> k);
    for (int i = 1; i < k; i++) v = v << 6 | (s[i] & 63);
    *cp = v;
    return true;
}

static td_rx_id t_atom(lk *p) {
    const tok *t = &p->t[p->i];
    if (p->i >= p->end) {
        lerr(p, t->line, "expected an expression");
        return TD_RX_FAIL;
    }
    if (t->kind == T_STRING && p->i + 2 < p->end && p->t[p->i + 1].kind == T_PUNCT &&
        !strcmp(p->t[p->i + 1].text, "..")) { /* "a".."z": a range of code points */
        const tok *u = &p->t[p->i + 2];
        uint32_t lo, hi;
        if (u->kind != T_STRING || !one_char(t, &lo) || !one_char(u, &hi) || hi < lo) {
            lerr(p, t->line, "a range \"a\"..\"z\" needs two single characters in order");
            return TD_RX_FAIL;
        }
        p->i += 3;
        const uint32_t r[1][2] = {{lo, hi}};
        return td_rx_codepoints(p->rx, r, 1);
    }
    if (t->kind == T_STRING) return p->i++, str_rx(p, t);
    if (t->kind == T_TOKENS) return p->i++, tokens_rx(p, t);
    if (t->kind == T_REGEX) {
        p->i++;
        td_rx_id r;
        char e[200];
        if (td_rx_parse(p->rx, t->text, t->len, t->flags, &r, e, sizeof e)) {
            lerr(p, t->line, "%s", e);
            return TD_RX_FAIL;
        }
        return r;
    }
    if (t->kind == T_TERM) {
        def *d = find_def(p, t->text);
        if (!d || !d->is_term) {
            lerr(p, t->line, "undefined terminal %s", t->text);
            return TD_RX_FAIL;
        }
        p->i++;
        return term_rx(p, d, t->line);
    }
    if (t->kind == T_JSON) {
        lerr(p, t->line, "%%json is a rule: a terminal cannot hold it");
        return TD_RX_FAIL;
    }
    if (t->kind == T_RULE) {
        lerr(p, t->line, "a terminal cannot refer to the rule %s", t->text);
        return TD_RX_FAIL;
    }
    if (punct(t, '(') || punct(t, '[')) {
        const char close = punct(t, '(') ? ')' : ']';
        p->i++;
        td_rx_id r = t_alts(p);
        if (p->failed) return TD_RX_FAIL;
        if (p->i >= p->end || !punct(&p->t[p->i], close)) {
            lerr(p, t->line, "expected '%c'", close);
            return TD_RX_FAIL;
        }
        p->i++;
        return close == ']' ? td_rx_repeat(p->rx, r, 0, 1) : r;
    }
    lerr(p, t->line, "unexpected '%s'", t->text ? t->text : "end of line");
    return TD_RX_FAIL;
}

static td_rx_id t_exp(lk *p) {
    td_rx_id r = TD_RX_EMPTY;
    while (!p->failed && p->i < p->end && !punct(&p->t[p->i], '|') && !punct(&p->t[p->i], ')') &&
           !punct(&p->t[p->i], ']')) {
        td_rx_id a = t_atom(p);
        uint32_t mn, mx;
        while (!p->failed && postfix(p, &mn, &mx)) a = td_rx_repeat(p->rx, a, mn, mx);
        r = td_rx_concat(p->rx, r, a);
    }
    return p->failed ? TD_RX_FAIL : r;
}

static td_rx_id t_alts(lk *p) {
    td_rx_id r = t_exp(p);
    while (!p->failed && p->i < p->end && punct(&p->t[p->i], '|')) {
        p->i++;
        r = td_rx_or(p->rx, r, t_exp(p));
    }
    if (!p->failed && r == TD_RX_FAIL) lerr(p, p->t[p->i].line, "%s", td_rx_error(p->rx));
    return p->failed ? TD_RX_FAIL : r;
}

/* ---- rules: grammar symbols ---- */

static td_gram_sym fresh(lk *p, const char *what) {
    char nm[48];
    snprintf(nm, sizeof nm, "%s#%d", what, ++p->nfresh);
    return td_gram_nonterm(p->g, nm);
}

/* The lexeme of an inline string or regex (one per distinct text). */
static td_gram_sym anon_lexeme(lk *p, const tok *t) {
    for (size_t i = 0; i < p->nan; i++)
        if (p->an[i].kind == t->kind && p->an[i].fold == t->fold && p->an[i].flags == t->flags &&
            p->an[i].len == t->len && !memcmp(p->an[i].text, t->text, t->len))
            return p->an[i].sym;
    td_rx_id r;
    if (t->kind == T_STRING) {
        r = str_rx(p, t);
    } else {
        char e[200];
        if (td_rx_parse(p->rx, t->text, t->len, t->flags, &r, e, sizeof e)) {
            lerr(p, t->line, "%s", e);
            return BAD;
        }
    }
    char nm[64];
    snprintf(nm, sizeof nm, t->kind == T_STRING ? "\"%.40s\"" : "/%.40s/", t->text);
    td_gram_sym s = td_gram_lexeme(p->g, r, nm);
    if (s == BAD || !td_gr_reserve((void **)&p->an, &p->can, p->nan, sizeof *p->an)) {
        lerr(p, t->line, "%s", td_gram_error(p->g) ? td_gram_error(p->g) : "out of memory");
        return BAD;
    }
    p->an[p->nan++] = (anon){t->kind, t->fold, t->flags, t->text, t->len, s};
    return s;
}

static bool r_alts_into(lk *p, td_gram_sym lhs);

/* x repeated mn..mx times, as a new nonterminal. */
static td_gram_sym r_repeat(lk *p, td_gram_sym x, uint32_t mn, uint32_t mx, int line) {
    td_gram *g = p->g;
    td_gram_sym n = fresh(p, "rep");
    if (n == BAD) goto bad;
    if (mx == UINT32_MAX) { /* n -> x^mn | n x */
        td_gram_sym seq[2] = {n, x};
        td_gram_sym *base = malloc((mn ? mn : 1) * sizeof *base);
        if (!base) goto bad;
        for (uint32_t k = 0; k < mn; k++) base[k] = x;
        int rc = td_gram_rule(g, n, base, mn) | td_gram_rule(g, n, seq, 2);
        free(base);
        if (rc) goto bad;
        return n;
    }
    /* tail_j: up to j more copies; n -> x^mn tail_(mx - mn) */
    td_gram_sym tail = BAD;
    for (uint32_t j = 1; j <= mx - mn; j++) {
        td_gram_sym t = fresh(p, "upto");
        td_gram_sym seq[2] = {x, tail};
        if (t == BAD || td_gram_rule(g, t, NULL, 0) || td_gram_rule(g, t, seq, tail == BAD ? 1 : 2))
            goto bad;
        tail = t;
    }
    td_gram_sym *seq = malloc((mn + 1) * sizeof *seq);
    if (!seq) goto bad;
    for (uint32_t k = 0; k < mn; k++) seq[k] = x;
    if (tail != BAD) seq[mn] = tail;
    int rc = td_gram_rule(g, n, seq, mn + (tail != BAD));
    free(seq);
    if (rc) goto bad;
    return n;
bad:
    lerr(p, line, "%s", td_gram_error(g) ? td_gram_error(g) : "out of memory");
    return BAD;
}

static td_gram_sym r_atom(lk *p) {
    const tok *t = &p->t[p->i];
    if (t->kind == T_JSON) {
        p->i++;
        char e[300];
        td_gram_sym x;
        if (td_json_schema_into(p->g, t->text, t->len, NULL, &x, e, sizeof e)) {
            lerr(p, t->line, "%%json: %s", e);
            return BAD;
        }
        return x;
    }
    if (t->kind == T_TOKENS) {
        p->i++;
        const td_gram_sym x = td_gram_lexeme(p->g, tokens_rx(p, t), "<[...]>");
        if (x == BAD) lerr(p, t->line, "%s", td_gram_error(p->g));
        return x;
    }
    if (t->kind == T_STRING || t->kind == T_REGEX) {
        p->i++;
        if (t->kind == T_STRING && t->len == 0) {
            lerr(p, t->line, "an empty string is not a lexeme");
            return BAD;
        }
        return anon_lexeme(p, t);
    }
    if (t->kind == T_RULE || t->kind == T_TERM) {
        def *d = find_def(p, t->text);
        if (!d) {
            lerr(p, t->line, "undefined %s %s", t->kind == T_RULE ? "rule" : "terminal", t->text);
            return BAD;
        }
        p->i++;
        if (!d->is_term) return d->sym;
        if (d->sym == BAD) {
            td_rx_id r = term_rx(p, d, t->line);
            if (p->failed) return BAD;
            d->sym = td_gram_lexeme(p->g, r, d->name);
            if (d->sym == BAD) lerr(p, t->line, "%s", td_gram_error(p->g));
        }
        return d->sym;
    }
    if (punct(t, '(') || punct(t, '[')) {
        const char close = punct(t, '(') ? ')' : ']';
        p->i++;
        td_gram_sym n = fresh(p, close == ')' ? "group" : "opt");
        if (n == BAD || !r_alts_into(p, n)) return BAD;
        if (p->i >= p->end || !punct(&p->t[p->i], close)) {
            lerr(p, t->line, "expected '%c'", close);
            return BAD;
        }
        p->i++;
        if (close == ']' && td_gram_rule(p->g, n, NULL, 0)) {
            lerr(p, t->line, "%s", td_gram_error(p->g));
            return BAD;
        }
        return n;
    }
    lerr(p, t->line, "unexpected '%s'", t->text ? t->text : "end of line");
    return BAD;
}

/* One alternative of lhs: its symbols, then the rule. */
static bool r_exp_into(lk *p, td_gram_sym lhs) {
    td_gram_sym *seq = NULL;
    size_t n = 0, cap = 0;
    const int line = p->t[p->i].line;
    while (!p->failed && p->i < p->end && !punct(&p->t[p->i], '|') && !punct(&p->t[p->i], ')') &&
           !punct(&p->t[p->i], ']')) {
        const int l = p->t[p->i].line;
        td_gram_sym a = r_atom(p);
        uint32_t mn, mx;
        while (!p->failed && postfix(p, &mn, &mx)) a = r_repeat(p, a, mn, mx, l);
        if (p->failed) break;
        if (!td_gr_reserve((void **)&seq, &cap, n, sizeof *seq)) {
            lerr(p, l, "out of memory");
            break;
        }
        seq[n++] = a;
    }
    bool ok = !p->failed && td_gram_rule(p->g, lhs, seq, n) == 0;
    if (!ok) lerr(p, line, "%s", td_gram_error(p->g) ? td_gram_error(p->g) : "invalid rule");
    free(seq);
    return ok;
}

static bool r_alts_into(lk *p, td_gram_sym lhs) {
    if (!r_exp_into(p, lhs)) return false;
    while (p->i < p->end && punct(&p->t[p->i], '|')) {
        p->i++;
        if (!r_exp_into(p, lhs)) return false;
    }
    return true;
}

/* A rule with lexeme options: its body (a terminal expression), then the
 * suffix, as one lexeme that ends at its first match: the strings of the
 * expression with no proper prefix in it. */
static td_gram_sym lazy_lexeme(lk *p, def *d) {
    p->i = d->b, p->end = d->e;
    td_rx_id r = t_alts(p);
    if (!p->failed && p->i < p->end)
        lerr(p, p->t[p->i].line, "%s: a rule with lexeme options holds a terminal expression",
             d->name);
    if (!p->failed && d->suffix) {
        p->i = d->suffix, p->end = d->suffix + 1;
        r = td_rx_concat(p->rx, r, t_atom(p));
    }
    if (p->failed) return BAD;
    const td_rx_id more = td_rx_repeat(p->rx, td_rx_byte_range(p->rx, 0, 255), 1, UINT32_MAX);
    r = td_rx_and(p->rx, r, td_rx_not(p->rx, td_rx_concat(p->rx, r, more)));
    const td_gram_sym s = td_gram_lexeme(p->g, r, d->name);
    if (s == BAD) lerr(p, d->line, "%s", td_gram_error(p->g));
    return s;
}

/* ---- the file ---- */

static bool definitions(lk *p) {
    size_t i = 0;
    while (p->t[i].kind != T_EOF) {
        if (p->t[i].kind == T_NL) {
            i++;
            continue;
        }
        const int line = p->t[i].line;
        if (p->t[i].kind == T_IGNORE) { /* compiled after the definitions */
            if (!td_gr_reserve((void **)&p->ign, &p->cign, p->nign, sizeof *p->ign)) {
                lerr(p, line, "out of memory");
                return false;
            }
            p->ign[p->nign++] = ++i;
            while (p->t[i].kind != T_NL && p->t[i].kind != T_EOF) i++;
            continue;
        }
        while (punct(&p->t[i], '?') || punct(&p->t[i], '!')) i++; /* Lark's tree shaping */
        const tok *name = &p->t[i];
        if (name->kind != T_RULE && name->kind != T_TERM) {
            lerr(p, line, "expected a rule or terminal name");
            return false;
        }
        if (punct(&p->t[i + 1], '{')) {
            lerr(p, line, "rule templates are not supported");
            return false;
        }
        bool lazy = false;
        size_t suffix = 0, at = i + 1;  /* at: the ':' */
        if (punct(&p->t[i + 1], '[')) { /* name[option, key=value, ...] */
            size_t k = i + 2;
            for (;;) {
                const tok *o = &p->t[k];
                if (o->kind != T_RULE) {
                    lerr(p, line, "%s[...]: expected an option name", name->text);
                    return false;
                }
                const bool val = punct(&p->t[k + 1], '=');
                const tok *v = val ? &p->t[k + 2] : NULL;
                if (!strcmp(o->text, "capture")) { /* a capture group: output, not language */
                    if (val && v->kind != T_STRING) {
                        lerr(p, line, "%s[capture=...]: expected a string", name->text);
                        return false;
                    }
                } else if (!strcmp(o->text, "lazy") && !val) {
                    lazy = true;
                } else if (!strcmp(o->text, "suffix") && val &&
                           (v->kind == T_STRING || v->kind == T_REGEX || v->kind == T_TERM)) {
                    lazy = true;
                    suffix = k + 2;
                } else if (!strcmp(o->text, "stop")) {
                    lerr(p, line,
                         "%s[stop=...]: hiding the stop text takes back tokens, which Tandem "
                         "does not do (suffix= keeps it)",
                         name->text);
                    return false;
                } else {
                    lerr(p, line, "%s[%s]: the option is not supported", name->text, o->text);
                    return false;
                }
                k += val ? 3 : 1;
                if (punct(&p->t[k], ',')) {
                    k++;
                    continue;
                }
                if (punct(&p->t[k], ']')) break;
                lerr(p, line, "%s[...]: expected ',' or ']'", name->text);
                return false;
            }
            at = k + 1;
        }
        if (!punct(&p->t[at], ':')) {
            lerr(p, line, "expected ':' after %s", name->text);
            return false;
        }
        if (find_def(p, name->text)) {
            lerr(p, line, "%s is defined twice", name->text);
            return false;
        }
        if (lazy && name->kind == T_TERM) {
            lerr(p, line, "%s: lexeme options are for rules (lowercase names)", name->text);
            return false;
        }
        size_t e = at + 1;
        while (p->t[e].kind != T_NL && p->t[e].kind != T_EOF) e++;
        if (!td_gr_reserve((void **)&p->d, &p->cd, p->nd, sizeof *p->d)) {
            lerr(p, line, "out of memory");
            return false;
        }
        p->d[p->nd++] = (def){.name = name->text,
                              .is_term = name->kind == T_TERM,
                              .line = line,
                              .b = at + 1,
                              .e = e,
                              .sym = BAD,
                              .re = TD_RX_FAIL,
                              .lazy = lazy,
                              .suffix = suffix};
        i = e;
    }
    return true;
}

td_gram *td_lark_compile(const char *src, size_t n, const td_gram_limits *lim, char *err,
                         size_t errlen) {
    return td_lark_compile_tokens(src, n, lim, NULL, NULL, err, errlen);
}

td_gram *td_lark_compile_tokens(const char *src, size_t n, const td_gram_limits *lim,
                                td_lark_token_fn fn, void *ctx, char *err, size_t errlen) {
    lk p = {.err = err, .errlen = errlen, .token_fn = fn, .token_ctx = ctx};
    if (err && errlen) err[0] = 0;
    p.g = td_gram_new(lim);
    if (!p.g) {
        if (err && errlen) snprintf(err, errlen, "grammar: out of memory");
        return NULL;
    }
    p.rx = td_gram_rx(p.g);
    if (lex(&p, src, n) && definitions(&p)) {
        for (size_t i = 0; i < p.nd && !p.failed; i++)
            if (!p.d[i].is_term && !p.d[i].lazy &&
                (p.d[i].sym = td_gram_nonterm(p.g, p.d[i].name)) == BAD)
                lerr(&p, p.d[i].line, "%s", td_gram_error(p.g));
        for (size_t i = 0; i < p.nd && !p.failed; i++)
            if (p.d[i].lazy) p.d[i].sym = lazy_lexeme(&p, &p.d[i]);
        for (size_t i = 0; i < p.nd && !p.failed; i++) {
            if (p.d[i].is_term || p.d[i].lazy) continue;
            p.i = p.d[i].b, p.end = p.d[i].e;
            if (r_alts_into(&p, p.d[i].sym) && p.i < p.end)
                lerr(&p, p.t[p.i].line, "unexpected '%s'", p.t[p.i].text ? p.t[p.i].text : "?");
        }
        /* %ignore: one expression of them all */
        td_rx_id ign = TD_RX_NOTHING;
        for (size_t k = 0; k < p.nign && !p.failed; k++) {
            p.i = p.ign[k];
            p.end = p.i;
            while (p.t[p.end].kind != T_NL && p.t[p.end].kind != T_EOF) p.end++;
            const td_rx_id r = t_alts(&p);
            if (!p.failed && p.i < p.end)
                lerr(&p, p.t[p.i].line, "unexpected '%s'", p.t[p.i].text ? p.t[p.i].text : "?");
            if (!p.failed) ign = td_rx_or(p.rx, ign, r);
        }
        if (!p.failed && p.nign && td_gram_ignore(p.g, ign))
            lerr(&p, p.t[p.ign[0]].line, "%%ignore: %s", td_gram_error(p.g));
        def *start = p.failed ? NULL : find_def(&p, "start");
        if (!p.failed && (!start || start->is_term)) lerr(&p, 1, "no rule named start");
        if (!p.failed && td_gram_finish(p.g, start->sym))
            lerr(&p, start->line, "%s", td_gram_error(p.g));
    }
    for (size_t i = 0; i < p.nt; i++) {
        free(p.t[i].text);
        free(p.t[i].ids);
    }
    free(p.t);
    free(p.ign);
    free(p.d);
    free(p.an);
    if (p.failed) {
        td_gram_free(p.g);
        return NULL;
    }
    return p.g;
}
