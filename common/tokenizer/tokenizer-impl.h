/* Internals shared by the tokenizer sources (not a public contract).
 *
 * One representation serves every vocabulary format: the loaders
 * (tokenizer-gguf.c, tokenizer-hf.c) fill a td_tokenizer through the
 * td_tok_* builder functions, then call td_tok_finish() which builds the
 * lookup tables. Encoding is: split out special/added tokens, normalise
 * (SentencePiece space handling), pre-tokenize with PCRE2 regexes, then
 * run BPE (merge ranks) or SentencePiece BPE (scores) on every piece. */
#ifndef TD_TOKENIZER_IMPL_H
#define TD_TOKENIZER_IMPL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdbool.h>
#include <stdint.h>

#include "tokenizer.h"

/* GGUF token types (llama.cpp's numbering, also used for tokenizer.json). */
enum {
    TD_TOKT_UNDEFINED = 0,
    TD_TOKT_NORMAL = 1,
    TD_TOKT_UNKNOWN = 2,
    TD_TOKT_CONTROL = 3,
    TD_TOKT_USER_DEFINED = 4,
    TD_TOKT_UNUSED = 5,
    TD_TOKT_BYTE = 6,
};

typedef enum {
    TD_TOK_MODEL_BPE = 0, /* merge ranks (GPT-2 byte-level, or HF BPE) */
    TD_TOK_MODEL_SPM = 1, /* SentencePiece BPE driven by token scores */
} td_tok_model;

/* Where a space prefix is added to the text fragments between special tokens. */
typedef enum {
    TD_PREFIX_NONE = 0,
    TD_PREFIX_FIRST_OR_AFTER_SPECIAL, /* llama.cpp SentencePiece: start, and after a special token
                                       */
    TD_PREFIX_FIRST,                  /* HF Metaspace "first": only a fragment at offset 0 */
    TD_PREFIX_ALWAYS,                 /* HF Prepend normalizer / Metaspace "always" */
} td_prefix_mode;

/* How the text between regex matches is kept (HF Split behaviours). */
typedef enum {
    TD_SPLIT_ISOLATED = 0, /* matches and gaps become separate pieces */
    TD_SPLIT_REMOVED,      /* matches dropped, gaps kept */
    TD_SPLIT_MERGED_PREV,  /* match appended to the piece before it */
    TD_SPLIT_MERGED_NEXT,  /* match prepended to the piece after it */
    TD_SPLIT_CONTIGUOUS,   /* runs of consecutive matches merged */
} td_split_behavior;

typedef struct {
    pcre2_code *re; /* NULL: the step prepends ' ' to every piece not starting
                     * with one (HF ByteLevel add_prefix_space) */
    td_split_behavior behavior;
    bool invert; /* pieces are the matches' complement (HF Split invert) */
} td_pretok_step;

/* Open-addressing hash table from byte strings to token ids. */
typedef struct {
    int32_t *slots; /* token id or -1 */
    size_t mask;
} td_str_map;

/* Open-addressing hash table from (left id, right id) to (rank, merged id). */
typedef struct {
    uint64_t *keys; /* (left << 32 | right) + 1; 0 = empty */
    int32_t *rank;
    int32_t *merged;
    size_t mask;
} td_pair_map;

struct td_tokenizer {
    td_tok_model model;
    char kind[48];

    int32_t n_vocab;
    char **text;              /* stored token text, NUL-terminated (may contain NULs: see len) */
    uint32_t *len;            /* byte length of text[i] */
    float *score;             /* SPM scores (0 for BPE) */
    uint8_t *type;            /* TD_TOKT_* */
    uint8_t *lstrip, *rstrip; /* added-token whitespace stripping */

    td_str_map vocab;
    td_pair_map merges;
    int32_t n_merges;

    /* special/added tokens matched in the input, longest text first */
    int32_t *special;
    size_t n_special;

    /* Byte-level (GPT-2) mapping: piece bytes are mapped to printable
     * codepoints before BPE, and back when decoding. */
    bool byte_level;
    int32_t byte_char_token[256]; /* token of the mapped char of each byte, -1 if none */
    /* Byte fallback tokens <0xXX> (SPM and HF byte_fallback). */
    bool byte_fallback;
    int32_t byte_token[256];

    /* SentencePiece-style whitespace handling. */
    bool escape_whitespace;   /* ' ' -> U+2581 before the model, back when decoding */
    td_prefix_mode prefix;    /* where a ' ' is prepended to a text fragment */
    bool prefix_unless_space; /* not when the fragment already starts with ' ' */
    bool strip_leading_space_on_decode;

    bool nfc;           /* NFC-normalise text fragments first (HF NFC normalizer) */
    bool ignore_merges; /* a pre-token that is a whole vocabulary entry is kept as is */
    bool fuse_unk;

    td_pretok_step *pretok;
    size_t n_pretok;

    int32_t bos, eos, eot, eom, unk, pad;
    bool add_bos, add_eos;

    int32_t *eog;
    size_t n_eog;

    char *chat_template; /* the default one */
    /* named templates (GGUF tokenizer.chat_template.NAME, a list in
     * tokenizer_config.json): (n_named) names and texts */
    char **named_name, **named_text;
    size_t n_named;
};

/* The whole of a text file (a chat template) into *text_p, malloc'd and
 * NUL-terminated. TD_ERR_NOT_FOUND when it cannot be opened, TD_ERR_FORMAT
 * over limit bytes, TD_ERR_IO on a read error, TD_ERR_NOMEM. */
td_status td_tok_read_text(const char *path, size_t limit, char **text_p);

/* Adds a named chat template (copies both strings). */
td_status td_tok_add_named_template(td_tokenizer *tok, const char *name, const char *text);

/* ---- builder (loaders) ---- */
td_tokenizer *td_tok_alloc(void);
/* Allocates the per-token arrays for n tokens (text empty, type UNDEFINED). */
td_status td_tok_set_n_vocab(td_tokenizer *tok, int32_t n);
/* Copies len bytes as the text of token id. */
td_status td_tok_set_token(td_tokenizer *tok, int32_t id, const char *s, size_t len, float score,
                           int type);
/* Compiles a pre-tokenizer regex (UTF + UCP, invalid UTF-8 tolerated). */
td_status td_tok_add_pretok(td_tokenizer *tok, const char *pattern, td_split_behavior behavior,
                            bool invert);
/* Adds a step that prepends ' ' to every piece that does not start with one. */
td_status td_tok_add_prefix_step(td_tokenizer *tok);
/* Builds the vocabulary map; must come before td_tok_add_merge. */
td_status td_tok_build_vocab(td_tokenizer *tok);
/* Adds merge (a, b) with the next rank; *skipped_p set if a part or the
 * result is not in the vocabulary. */
td_status td_tok_add_merge(td_tokenizer *tok, const char *a, size_t alen, const char *b,
                           size_t blen, bool *skipped_p);
td_status td_tok_reserve_merges(td_tokenizer *tok, size_t n);
/* Builds special-token list, byte tables, EOG set; validates ids. */
td_status td_tok_finish(td_tokenizer *tok, const char *src);

int32_t td_tok_find(const td_tokenizer *tok, const char *s, size_t len); /* -1 if absent */

/* tokenizer.json (and optionally tokenizer_config.json) from memory; `name`
 * is used in error messages (fuzzing, tests). */
td_status td_tok_from_hf_json(const char *tok_json, size_t len, const char *cfg_json,
                              size_t cfg_len, const char *name, td_tokenizer **tok_p);

/* ---- shared helpers ---- */
/* Length of the valid UTF-8 sequence starting at s, 1 for an invalid byte, 0 if n == 0. */
size_t td_utf8_len(const unsigned char *s, size_t n);
/* Encodes cp, returns bytes written (1..4). */
int td_utf8_put(uint32_t cp, char *out);
/* Decodes one valid UTF-8 sequence; returns its length or 0 if invalid. */
size_t td_utf8_decode(const unsigned char *s, size_t n, uint32_t *cp_p);
/* GPT-2 byte <-> unicode mapping. */
uint32_t td_byte_to_cp(uint8_t b);
int td_cp_to_byte(uint32_t cp); /* -1 if cp is not a mapped byte */

/* Growable int32 vector used while encoding. */
typedef struct {
    int32_t *v;
    size_t n, cap;
} td_ivec;
td_status td_ivec_push(td_ivec *iv, int32_t x);

/* Appends the tokens of one pre-tokenized piece. */
td_status td_tok_bpe_piece(const td_tokenizer *tok, const char *s, size_t n, td_ivec *out);
td_status td_tok_spm_piece(const td_tokenizer *tok, const char *s, size_t n, td_ivec *out);

#endif
