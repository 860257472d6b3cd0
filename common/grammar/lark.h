/* The grammar language for users: a Lark-style EBNF, the syntax llguidance
 * and SGLang accept, compiled to a td_gram (grammar.h).
 *
 *   start: "{" pair ("," pair)* "}"      rules: lowercase names; `start` starts
 *   pair: KEY ":" value                   a literal string in a rule is a lexeme
 *   ?value: NUMBER | "true" | "false"     ? and ! before a rule name are accepted
 *        | "[" [value ("," value)*] "]"   (they shape Lark's trees, not languages)
 *   KEY: /"[a-z]+"/                       terminals: UPPERCASE names, each one
 *   NUMBER: "-"? DIGIT+                   lexeme, built from strings, /regex/,
 *   DIGIT: /[0-9]/                        other terminals and the operators
 *   // a comment
 *
 * Operators, in rules and terminals: x? [x] x* x+ (a | b) and x ~ n or
 * x ~ n..m (n to m copies). Strings are Python literals ("..." or '...',
 * with \n \t \r \\ \" \' \xHH \uXXXX \UXXXXXXXX); /regex/ is an ECMAScript
 * pattern matched whole (regex.h's subset, no flags). A rule may continue
 * on the next line when that line starts with `|`.
 *
 * Refused with a message naming the construct and its line: %ignore,
 * %import and other directives, case-insensitive literals and regex
 * flags, rule priorities and templates, terminals that refer to rules or
 * to themselves.
 *
 * Token terminals name one special (control) token: <[ID]> by its id,
 * <|name|> by its text (the whole <|...|>, looked up by the resolver).
 * They match that token only (its bytes in the engine are
 * td_gr_token_bytes: no text reaches them). A resolver checks them against
 * the model's vocabulary; without one, <[ID]> is taken as written and
 * <|name|> is refused. */
#ifndef TD_GRAMMAR_LARK_H
#define TD_GRAMMAR_LARK_H

#include <stddef.h>

#include "common/grammar/grammar.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Compiles n bytes of src into a finished grammar. NULL with a message in
 * err (naming the line) when src is malformed, refused or over a limit.
 * lim NULL: the defaults. */
td_gram *td_lark_compile(const char *src, size_t n, const td_gram_limits *lim, char *err,
                         size_t errlen);

/* The id of the special token a token terminal names (spec: its n bytes,
 * "<[12]>" or "<|im_start|>"), or -1 with the reason in why (no such
 * token, not a special token, an end-of-generation token). */
typedef int32_t (*td_lark_token_fn)(void *ctx, const char *spec, size_t n, char *why,
                                    size_t whylen);

/* td_lark_compile with a resolver for token terminals (fn NULL: none). */
td_gram *td_lark_compile_tokens(const char *src, size_t n, const td_gram_limits *lim,
                                td_lark_token_fn fn, void *ctx, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif
