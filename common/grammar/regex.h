/* Byte-level regular expressions by derivatives: the lexer layer of the
 * grammar engine (structured outputs).
 *
 * Expressions are hash-consed nodes of one store (td_rx): the empty
 * language, the empty string, a set of bytes, concatenation, alternation,
 * intersection, complement, Kleene star and bounded repetition. The smart constructors keep every
 * node in a normal form (alternation and intersection flattened, sorted
 * and without duplicates, the empty language dropped from an alternation
 * and emptying an intersection; a double complement undone; concatenation right-nested, with the
 * empty string and the empty language folded; nullable repetition counted
 * from 0), so equal languages built the same way are the same node and a
 * node has finitely many distinct derivatives (Brzozowski, with the
 * similarity rules of Owens, Reppy and Turon). The derivative of a node by
 * a byte is memoized: walking an expression byte by byte is a lazily built
 * DFA whose states are node ids.
 *
 * Text is matched as UTF-8 bytes. Code-point classes are compiled to
 * alternations of byte-range sequences that accept exactly the UTF-8
 * encodings of the class's code points (surrogates never), so a match
 * never ends inside a character and never admits malformed UTF-8.
 *
 * td_rx_parse reads an ECMAScript (ECMA-262, u-mode) pattern, the dialect
 * of JSON Schema's `pattern`; what it does not support (lookaround,
 * backreferences, word-boundary assertions, \p{...}, anchors other than a
 * leading ^ and a trailing $) is an error naming the construct and its
 * offset, never a silently different language.
 *
 * Work is bounded by counts, the same on every machine (td_rx_limits):
 * nodes in the store and derivative steps. Crossing one makes the store
 * failed: every later call returns TD_RX_FAIL and td_rx_error says which
 * limit. Not thread-safe: one store per compiling or matching thread. */
#ifndef TD_GRAMMAR_REGEX_H
#define TD_GRAMMAR_REGEX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef uint32_t td_rx_id;
#define TD_RX_NOTHING ((td_rx_id)0) /* matches no string */
#define TD_RX_EMPTY   ((td_rx_id)1) /* matches the empty string only */
#define TD_RX_FAIL    UINT32_MAX    /* a limit was crossed (td_rx_error) */

typedef struct {
    uint32_t max_nodes;  /* distinct nodes in the store (default 1,000,000) */
    uint64_t max_steps;  /* derivative and constructor steps (default 50,000,000) */
    uint32_t max_repeat; /* largest {n,m} count a pattern may write (default 10,000) */
    int max_depth;       /* pattern nesting (default 200) */
} td_rx_limits;

td_rx_limits td_rx_default_limits(void);

typedef struct td_rx td_rx;

/* lim NULL: the defaults. NULL on allocation failure. */
td_rx *td_rx_new(const td_rx_limits *lim);
void td_rx_free(td_rx *rx);

/* The limit crossed (a message), or NULL while the store is usable. */
const char *td_rx_error(const td_rx *rx);
/* Nodes made so far and steps taken (for bounds and benchmarks). */
size_t td_rx_node_count(const td_rx *rx);
uint64_t td_rx_steps(const td_rx *rx);

/* Constructors. Any TD_RX_FAIL operand gives TD_RX_FAIL. */
td_rx_id td_rx_byteset(td_rx *rx, const uint64_t set[4]); /* bit b of set: byte b */
td_rx_id td_rx_byte_range(td_rx *rx, uint8_t lo, uint8_t hi);
td_rx_id td_rx_literal(td_rx *rx, const void *bytes, size_t n);
td_rx_id td_rx_concat(td_rx *rx, td_rx_id a, td_rx_id b);
td_rx_id td_rx_or(td_rx *rx, td_rx_id a, td_rx_id b);
td_rx_id td_rx_or_list(td_rx *rx, const td_rx_id *ids, size_t n);
/* Both a and b. */
td_rx_id td_rx_and(td_rx *rx, td_rx_id a, td_rx_id b);
/* Every byte string a does not match (the complement over all byte
 * strings, malformed UTF-8 included: intersect it with a set of texts). */
td_rx_id td_rx_not(td_rx *rx, td_rx_id a);
td_rx_id td_rx_star(td_rx *rx, td_rx_id a);
/* a repeated min..max times; max UINT32_MAX: unbounded. */
td_rx_id td_rx_repeat(td_rx *rx, td_rx_id a, uint32_t min, uint32_t max);
/* The UTF-8 encodings of the code points in the n closed ranges (any
 * order, overlaps allowed; surrogates D800-DFFF dropped). */
td_rx_id td_rx_codepoints(td_rx *rx, const uint32_t (*ranges)[2], size_t n);
/* Any one code point (UTF-8). */
td_rx_id td_rx_any_char(td_rx *rx);

/* The JSON string literals (with their quotes) whose decoded text a
 * matches: '"', '\\' and the control characters 00-1F and 7F appear only
 * escaped (\" \\ \b \t \n \f \r, or \u00XX with hex digits of either
 * case), every other character only as itself (the escapes llguidance
 * admits by default). */
td_rx_id td_rx_json_quote(td_rx *rx, td_rx_id a);

/* The decimal numerals (digits, at most one '.', no sign: intersect with
 * a numeral syntax) whose value is a multiple of p / 10^k: the digits
 * read as an integer, scaled by 10^k, divide by p (past k fraction digits
 * only zeros). Its derivatives are at most p remainders per digit
 * position up to k. k <= 30. */
td_rx_id td_rx_multiple_of(td_rx *rx, uint32_t p, uint32_t k);

/* The classes of bytes that no expression of the store tells apart: cls[b]
 * is byte b's class, and the derivative of any node by two bytes of one
 * class is the same node (for the nodes in the store now, and for every
 * derivative of them). Returns the number of classes. */
int td_rx_byte_classes(const td_rx *rx, uint8_t cls[256]);

bool td_rx_nullable(const td_rx *rx, td_rx_id a);
/* a matches no string at all, even where it is not TD_RX_NOTHING (an
 * intersection, a complement or a multiple may be empty without looking
 * it): a search of its derivatives, at most 256 of them (beyond that it is
 * taken as not empty), remembered per node. */
bool td_rx_is_empty(td_rx *rx, td_rx_id a);
/* The derivative of a by byte b (memoized). */
td_rx_id td_rx_deriv(td_rx *rx, td_rx_id a, uint8_t b);
/* Clears in same (a byte set: bit b % 64 of word b / 64) the bytes whose
 * derivative of a may differ from byte b's: those that some byte set
 * deriv(a, b) reads tells apart from b. The bytes left have the same
 * derivative as b (b itself is left when it was set). Bounded: past 1024
 * nodes read, only b is left. */
void td_rx_same_deriv(const td_rx *rx, td_rx_id a, uint8_t b, uint64_t same[4]);
/* a matches all of s. false on TD_RX_FAIL too (check td_rx_error). */
bool td_rx_match(td_rx *rx, td_rx_id a, const void *s, size_t n);

/* Pattern flags. */
#define TD_RX_SEARCH                                                                               \
    1u /* JSON Schema semantics: the pattern may match anywhere                                    \
          (unanchored, as ECMAScript's RegExp.test) unless it                                      \
          starts with ^ / ends with $; without it the pattern                                      \
          must match the whole text */

/* Flag i: ASCII letters match either case (the pattern must be ASCII,
 * written code points and ranges alike). */
#define TD_RX_ICASE 2u
/* Flag s: '.' matches any code point, line terminators too. */
#define TD_RX_DOTALL 4u

/* Parses pattern (n bytes of UTF-8) into *out. 0 on success; -1 with a
 * message naming the construct and its byte offset in err. */
int td_rx_parse(td_rx *rx, const char *pattern, size_t n, unsigned flags, td_rx_id *out, char *err,
                size_t errlen);

#ifdef __cplusplus
}
#endif
#endif
