/* A request's output constraint and its compile (constraint.h). */
#include "common/grammar/constraint.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "common/grammar/json_schema.h"
#include "common/grammar/lark.h"

void td_constraint_clear(td_constraint *c) {
    free(c->text);
    memset(c, 0, sizeof *c);
}

bool td_constraint_copy(td_constraint *dst, const td_constraint *src) {
    *dst = *src;
    dst->text = NULL;
    if (!src->text) return true;
    if (!(dst->text = malloc(src->len + 1))) return false;
    memcpy(dst->text, src->text, src->len);
    dst->text[src->len] = 0;
    return true;
}

int32_t td_constraint_resolve_token(void *ctx, const char *spec, size_t n, char *why,
                                    size_t whylen) {
    const td_tokenizer *tok = ctx;
    const int32_t nv = td_tokenizer_n_vocab(tok);
    int32_t id = -1;
    if (spec[1] == '[') {
        long v = 0;
        size_t k = 2;
        for (; k + 2 < n && spec[k] >= '0' && spec[k] <= '9' && v <= nv; k++)
            v = v * 10 + (spec[k] - '0');
        if (k != n - 2 || k == 2) {
            snprintf(why, whylen, "a token id is digits");
            return -1;
        }
        id = v < nv ? (int32_t)v : -1;
    } else {
        for (int32_t i = 0; i < nv && id < 0; i++) {
            const char *t = td_tokenizer_token_text(tok, i);
            if (t && strlen(t) == n && !memcmp(t, spec, n)) id = i;
        }
    }
    if (id < 0) {
        snprintf(why, whylen, "the model's vocabulary has no such token");
        return -1;
    }
    if (td_tokenizer_is_eog(tok, id)) {
        snprintf(why, whylen, "token %d ends generation: the grammar's end is where it goes", id);
        return -1;
    }
    if (!td_tokenizer_is_special(tok, id)) {
        snprintf(why, whylen, "token %d is text: write its text as a string", id);
        return -1;
    }
    return id;
}

/* A JSON array of strings as a choice grammar. */
static td_gram *choice_grammar(const td_constraint *c, char *err, size_t errlen) {
    json_error_t je;
    json_t *a = json_loadb(c->text, c->len, 0, &je);
    td_gram *g = NULL;
    const size_t n = json_is_array(a) ? json_array_size(a) : 0;
    const char **items = calloc(n + 1, sizeof *items);
    size_t *lens = calloc(n + 1, sizeof *lens);
    if (!n) {
        snprintf(err, errlen, "%s: expected a non-empty array of strings", c->field);
        goto out;
    }
    if (!items || !lens) {
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *s = json_array_get(a, i);
        if (!json_is_string(s)) {
            snprintf(err, errlen, "%s: choice %zu is not a string", c->field, i);
            goto out;
        }
        items[i] = json_string_value(s);
        lens[i] = json_string_length(s);
    }
    g = td_gram_from_choices(items, lens, n, NULL, err, errlen);
out:
    free(items);
    free(lens);
    json_decref(a);
    return g;
}

/* A line that starts "name ::=": llama.cpp's GBNF, not Lark. */
static bool looks_gbnf(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        size_t j = i;
        while (j < n && (s[j] == ' ' || s[j] == '\t')) j++;
        const size_t a = j;
        while (j < n && (s[j] == '-' || s[j] == '_' || (s[j] >= 'a' && s[j] <= 'z') ||
                         (s[j] >= 'A' && s[j] <= 'Z') || (s[j] >= '0' && s[j] <= '9')))
            j++;
        const size_t b = j;
        while (j < n && (s[j] == ' ' || s[j] == '\t')) j++;
        if (b > a && n - j >= 3 && !memcmp(s + j, "::=", 3)) return true;
        while (j < n && s[j] != '\n') j++;
        i = j + 1;
    }
    return false;
}

td_gram *td_constraint_compile(const td_constraint *c, const td_tokenizer *tok, char *err,
                               size_t errlen) {
    char e[400] = "";
    td_gram *g = NULL;
    switch (c->kind) {
    case TD_CONSTRAINT_JSON:
        g = td_gram_from_json_schema(c->text, c->len, NULL, NULL, e, sizeof e);
        break;
    case TD_CONSTRAINT_REGEX: g = td_gram_from_regex(c->text, c->len, NULL, e, sizeof e); break;
    case TD_CONSTRAINT_CHOICE: g = choice_grammar(c, e, sizeof e); break;
    case TD_CONSTRAINT_GRAMMAR:
        if (looks_gbnf(c->text, c->len)) {
            snprintf(e, sizeof e,
                     "the grammar looks like GBNF (::=): write it in the Lark syntax "
                     "(rule: ...), see docs/GRAMMAR.md");
            break;
        }
        g = td_lark_compile_tokens(c->text, c->len, NULL, td_constraint_resolve_token, (void *)tok,
                                   e, sizeof e);
        break;
    case TD_CONSTRAINT_NONE: snprintf(e, sizeof e, "no constraint"); break;
    }
    if (!g) snprintf(err, errlen, "%s: %s", c->field ? c->field : "constraint", e);
    return g;
}
