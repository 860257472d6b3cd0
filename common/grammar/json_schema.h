/* JSON Schema to grammar: the constraint of a `json_schema` request
 * (structured outputs).
 *
 * The schema is first read into a normal form (one node per type, with
 * allOf, $ref siblings, const and enum intersected into it, anyOf and type
 * unions as alternatives), then written out as a grammar over lexemes:
 * every scalar (null, a boolean, a number, a string) is one lexeme, so
 * strings and numbers are matched by the lexer's DFA; objects and arrays
 * are rules. Objects are written with their properties in the order the
 * schema lists them. JSON is written compactly: no whitespace, and the
 * separators are "," and ":" unless the options say otherwise. The
 * language is that of llguidance's JSON compiler with the same options,
 * where both accept a schema.
 *
 * What the schema says is enforced or refused: a keyword that would change
 * which documents are valid and is not supported is an error naming the
 * keyword's JSON Pointer (docs/GRAMMAR.md has the table); annotations are
 * ignored. Every document the grammar accepts validates against the
 * schema; some valid documents are not generated (numbers with a bound are
 * written without an exponent, a named property only at its place in
 * schema order). */
#ifndef TD_GRAMMAR_JSON_SCHEMA_H
#define TD_GRAMMAR_JSON_SCHEMA_H

#include <stddef.h>
#include <stdint.h>

#include "common/grammar/grammar.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const char *item_separator; /* between array items and properties (NULL: ",") */
    const char *key_separator;  /* between a key and its value (NULL: ":") */
    uint32_t max_schema_nodes;  /* schema nodes read and intersected (0: 50,000) */
    uint32_t max_depth;         /* schema nesting (0: 128) */
} td_json_opts;

/* A finished grammar of the JSON documents valid under the schema (n bytes
 * of JSON text), or NULL with the reason in err: a refusal ("at /items/not:
 * ..."), a schema that is not JSON, an unsatisfiable schema or a limit. */
td_gram *td_gram_from_json_schema(const char *schema, size_t n, const td_json_opts *opts,
                                  const td_gram_limits *lim, char *err, size_t errlen);

/* The same language as rules of g (not finished), for a grammar that
 * holds a schema inside (Lark's %json): *start is its nonterminal. 0, or
 * -1 with the reason in err. The root's "x-guidance" options (llguidance's)
 * may set the separators (item_separator, key_separator) and
 * whitespace_flexible false; any other is refused. */
int td_json_schema_into(td_gram *g, const char *schema, size_t n, const td_json_opts *opts,
                        td_gram_sym *start, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif
