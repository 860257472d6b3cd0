/* A request's output constraint, as the API layer reads it (a JSON
 * Schema, a regular expression, a list of choices or a Lark grammar), and
 * its compile into a grammar for the model's tokenizer. The compile is
 * bounded (td_gram_default_limits), so every instance decides alike; a
 * refusal names the reason, for a 400. */
#ifndef TD_GRAMMAR_CONSTRAINT_H
#define TD_GRAMMAR_CONSTRAINT_H

#include <stddef.h>
#include <stdint.h>

#include "common/grammar/grammar.h"
#include "common/tokenizer/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    TD_CONSTRAINT_NONE,
    TD_CONSTRAINT_JSON,    /* text: a JSON Schema (json_object: {"type":"object"}) */
    TD_CONSTRAINT_REGEX,   /* text: an ECMAScript pattern, matched whole */
    TD_CONSTRAINT_CHOICE,  /* text: a JSON array of strings */
    TD_CONSTRAINT_GRAMMAR, /* text: a Lark grammar (docs/GRAMMAR.md) */
} td_constraint_kind;

typedef struct {
    td_constraint_kind kind;
    char *text; /* owned (td_constraint_clear) */
    size_t len;
    const char *field; /* the request field it came from (static), for messages */
} td_constraint;

void td_constraint_clear(td_constraint *c);
/* A copy of src into dst (dst's text allocated). false on allocation
 * failure. */
bool td_constraint_copy(td_constraint *dst, const td_constraint *src);

/* The grammar of c for tok's vocabulary (token terminals resolved in it),
 * or NULL with the reason in err ("field: ..."). */
td_gram *td_constraint_compile(const td_constraint *c, const td_tokenizer *tok, char *err,
                               size_t errlen);

/* A grammar's token terminal (<[id]>, <|name|>) in tok's vocabulary: a
 * special token that does not end generation (td_lark_token_fn; ctx is
 * the tokenizer). */
int32_t td_constraint_resolve_token(void *ctx, const char *spec, size_t n, char *why,
                                    size_t whylen);

#ifdef __cplusplus
}
#endif
#endif
