/* Context-free grammars over lexemes, and the matcher that runs one over
 * bytes: the parser layer of the grammar engine (structured outputs).
 *
 * A grammar's terminals are lexemes, each a regular expression of the
 * grammar's td_rx store (regex.h); its nonterminals have rules whose right
 * sides are sequences of terminals and nonterminals. The matcher reads
 * bytes: a lexer runs the regular expressions of the lexemes the parser
 * allows next, together, as one lazily built DFA, and an Earley parser
 * advances only when a lexeme ends, so most bytes cost one table lookup.
 * Lexemes are greedy (maximal munch, as llguidance's and most lexers'): a
 * lexeme ends when the next byte cannot extend it; a lexeme never matches
 * the empty string. When several lexemes end at once the parser scans them
 * all (Earley handles the ambiguity).
 *
 * The matcher keeps a stack of its states, one per byte, so that any
 * number of bytes can be taken back (td_gm_pop): the token mask walks a
 * vocabulary trie by pushing and popping bytes.
 *
 * Work is bounded by counts (td_gram_limits), the same on every machine:
 * lexer states, Earley items per set and in total. Crossing one fails the
 * push with TD_GM_LIMIT and td_gm_error names the limit.
 *
 * A grammar and its matchers share the regex store and the lexer's state
 * table, which matching extends: a grammar and all its matchers belong to
 * one thread at a time. */
#ifndef TD_GRAMMAR_GRAMMAR_H
#define TD_GRAMMAR_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/grammar/regex.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    uint32_t max_lexemes;      /* default 10,000 */
    uint32_t max_rules;        /* default 100,000 */
    uint32_t max_lexer_states; /* default 50,000 */
    uint32_t max_items_set;    /* Earley items in one set (default 100,000) */
    uint64_t max_items;        /* Earley items made over a matcher's life (default 50,000,000) */
    td_rx_limits rx;
} td_gram_limits;

td_gram_limits td_gram_default_limits(void);

typedef struct td_gram td_gram;
typedef uint32_t td_gram_sym; /* a lexeme (terminal) or a nonterminal */

/* lim NULL: the defaults. NULL on allocation failure. */
td_gram *td_gram_new(const td_gram_limits *lim);
void td_gram_free(td_gram *g);

/* The grammar's regex store: lexemes are built in it. */
td_rx *td_gram_rx(td_gram *g);

/* A terminal matching the regular expression re (not nullable: a lexeme
 * of the empty string is refused). name is for messages (copied).
 * UINT32_MAX on error (td_gram_error). */
td_gram_sym td_gram_lexeme(td_gram *g, td_rx_id re, const char *name);
/* A new nonterminal. */
td_gram_sym td_gram_nonterm(td_gram *g, const char *name);
/* Text that may come between lexemes and is otherwise ignored (Lark's
 * %ignore): re's strings may stand before any lexeme but the first, where
 * a lexeme can follow, as in llguidance. At most once; before finish. 0,
 * or -1 (td_gram_error). */
int td_gram_ignore(td_gram *g, td_rx_id re);
/* The rule lhs -> rhs[0] .. rhs[n - 1] (n 0: the empty string). */
int td_gram_rule(td_gram *g, td_gram_sym lhs, const td_gram_sym *rhs, size_t n);
/* Completes the grammar with start as its start symbol: 0, or -1 with
 * td_gram_error (a nonterminal without rules, a limit). No rule may be
 * added afterwards. */
int td_gram_finish(td_gram *g, td_gram_sym start);
const char *td_gram_error(const td_gram *g);
size_t td_gram_lexeme_count(const td_gram *g);
size_t td_gram_rule_count(const td_gram *g);
const char *td_gram_sym_name(const td_gram *g, td_gram_sym s);

/* A finished grammar of one regular expression (an ECMAScript pattern
 * matched whole, regex.h): the constraint of a `regex` request. NULL with a
 * message in err when the pattern is refused or over a limit. */
td_gram *td_gram_from_regex(const char *pattern, size_t n, const td_gram_limits *lim, char *err,
                            size_t errlen);

/* A finished grammar of a choice: exactly one of the n strings (bytes,
 * each non-empty). NULL with a message in err. */
td_gram *td_gram_from_choices(const char *const *choices, const size_t *lens, size_t n,
                              const td_gram_limits *lim, char *err, size_t errlen);

/* ---- the matcher ---- */

typedef struct td_gm td_gm;

typedef enum {
    TD_GM_OK = 0,
    TD_GM_REJECT = 1, /* the byte cannot follow: the state is unchanged */
    TD_GM_LIMIT = 2,  /* a bound was crossed (td_gm_error): unchanged */
} td_gm_result;

/* A matcher at the start of g (finished). NULL on allocation failure. */
td_gm *td_gm_new(td_gram *g);
void td_gm_free(td_gm *m);

td_gm_result td_gm_push(td_gm *m, uint8_t byte);
/* Pushes bytes one by one; on a rejection the bytes before it stay pushed
 * and *done (if not NULL) says how many. */
td_gm_result td_gm_push_bytes(td_gm *m, const void *bytes, size_t n, size_t *done);
/* Takes back the last n pushed bytes (at most td_gm_depth). */
void td_gm_pop(td_gm *m, size_t n);
/* Bytes pushed so far. */
size_t td_gm_depth(const td_gm *m);
/* The bytes so far are a whole sentence of the grammar. */
bool td_gm_accepting(td_gm *m);
/* No byte can follow (accepting or not). */
bool td_gm_finished(td_gm *m);
const char *td_gm_error(const td_gm *m);
/* A byte trie flattened in depth-first order (vocab.c builds one): node i
 * holds a byte at depth `depth` (1 for the root's children) under node
 * `parent` (UINT32_MAX at depth 1), `end` is the index after its subtree,
 * and ids[tok .. tok + ntok) are the tokens whose bytes end there. */
typedef struct {
    uint8_t byte;
    uint16_t depth;
    uint32_t end, tok, ntok, parent;
} td_trie_node;

/* The bodies of a JSON string: non-empty strings of whole UTF-8
 * characters other than '"', '\\', U+0000-001F and U+007F. A lexer state
 * that stays alive through every body of at most k characters allows
 * every token that is one; the tokens that are no body of at most
 * TD_TRIE_BODY_MAX characters have a trie of their own (rest), walked
 * alone when the others are decided without a walk. */
#define TD_TRIE_BODY_MAX 32

typedef struct td_trie {
    const td_trie_node *nodes;
    uint32_t n, max_depth; /* nodes; the largest depth */
    const int32_t *ids;
    int32_t n_tokens; /* token ids are below it */
    /* the same nodes packed for the lexer's walk: bits 0-7 the byte, 8-23
     * the depth, 24 set when tokens end there, 32-63 end */
    const uint64_t *packed;
    /* row k - 1 (k = 1..TD_TRIE_BODY_MAX, (n_tokens + 31) / 32 words
     * each): the tokens that are bodies of at most k characters; NULL in
     * a trie without body slices (then body_max and rest are NULL too) */
    const uint32_t *body_bits;
    /* per node: the most characters of a body among the tokens of its
     * subtree, 255 when one of them is no body of at most
     * TD_TRIE_BODY_MAX characters */
    const uint8_t *body_max;
    const struct td_trie *rest; /* the trie of those other tokens */
} td_trie;

/* Walks the trie from the matcher's state: sets bit (id % 32) of
 * mask[id / 32] for every token whose bytes the matcher takes (the mask is
 * not cleared first). Returns 0, or -1 on a limit (td_gm_error). The state
 * is unchanged afterwards.
 *
 * The tokens that stay inside the lexeme being read depend on the lexer's
 * state alone: the grammar keeps them per lexer state (up to a bound),
 * with the trie nodes where that lexeme would have to end, so a later mask
 * from the same lexer state copies the set and walks only from those
 * nodes, with the parser. A grammar keeps this for one trie at a time. */
int64_t td_gm_walk(td_gm *m, const td_trie *t, uint32_t *mask);

/* The bytes every continuation starts with (at most max, into out): one
 * byte after another while exactly one byte can follow and the bytes so
 * far are not a whole sentence. Returns how many, or -1 on a limit
 * (td_gm_error). The state is unchanged afterwards. */
int64_t td_gm_forced_bytes(td_gm *m, uint8_t *out, size_t max);

/* The end of generation was taken (td_gm_consume_token): no byte follows
 * until td_gm_pop takes any byte back or td_gm_resume. */
bool td_gm_stopped(const td_gm *m);
void td_gm_stop(td_gm *m);
void td_gm_resume(td_gm *m);

#ifdef __cplusplus
}
#endif
#endif
