/* Tokenizers: SentencePiece-style BPE with byte fallback (GGUF
 * tokenizer.ggml.model = "llama"), byte-level BPE with the pre-tokenizer
 * regex of the model's pre-type through PCRE2 ("gpt2"), and Hugging Face
 * tokenizer.json (BPE). Special/added tokens, BOS/EOS/EOG as the model's
 * metadata says, and incremental detokenization that never emits a partial
 * UTF-8 sequence.
 *
 * Vocabulary files are untrusted: bad metadata is a logged one-line error
 * and a td_status, never a crash. A td_tokenizer is immutable after
 * creation and may be used from several threads at once. */
#ifndef TD_TOKENIZER_H
#define TD_TOKENIZER_H

#include <stdbool.h>

#include "common/base/base.h"
#include "common/format/gguf.h"

typedef struct td_tokenizer td_tokenizer;

/* From a GGUF file's tokenizer.ggml.* metadata (and tokenizer.chat_template).
 * Copies what it needs: g may be closed afterwards. Free with td_tokenizer_free(). */
td_status td_tokenizer_from_gguf(const td_gguf *g, td_tokenizer **tok_p);
/* From a Hugging Face directory: tokenizer.json, plus tokenizer_config.json
 * (chat template, bos/eos, add_bos) when present. Supported: model BPE
 * (merges as "a b" or [a, b], byte_fallback, ignore_merges, fuse_unk),
 * normalizers Sequence/Prepend/Replace(' ' -> U+2581)/NFC, pre-tokenizers
 * Sequence/Split/ByteLevel/Digits/Metaspace/Whitespace/WhitespaceSplit,
 * TemplateProcessing for BOS/EOS; anything else is TD_ERR_UNSUPPORTED with
 * a logged line naming it. */
td_status td_tokenizer_from_hf_dir(const char *dir, td_tokenizer **tok_p);
void td_tokenizer_free(td_tokenizer *tok); /* accepts NULL */

int32_t td_tokenizer_n_vocab(const td_tokenizer *tok);
int32_t td_tokenizer_bos(const td_tokenizer *tok); /* -1 if none */
int32_t td_tokenizer_eos(const td_tokenizer *tok); /* -1 if none */
bool td_tokenizer_adds_bos(const td_tokenizer *tok);
/* True for every end-of-generation token: EOS, EOT and EOM from the
 * metadata, and the control or user-defined tokens whose text is one of
 * <|eot_id|>, <|im_end|>, <|end|>, <end_of_turn>, <|endoftext|>, </s>,
 * <|eom_id|>, <|end_of_text|>. */
bool td_tokenizer_is_eog(const td_tokenizer *tok, int32_t id);
/* All end-of-generation ids; *n_p their count. Owned by tok. */
const int32_t *td_tokenizer_eog_ids(const td_tokenizer *tok, size_t *n_p);
bool td_tokenizer_is_special(const td_tokenizer *tok, int32_t id);
/* The vocabulary string of a token (as stored, e.g. "Ġthe"); NULL if out of range. */
const char *td_tokenizer_token_text(const td_tokenizer *tok, int32_t id);
/* Chat template text from the model, or NULL. Owned by tok. */
const char *td_tokenizer_chat_template(const td_tokenizer *tok);
/* A named chat template of the model ("tool_use", ...: GGUF
 * tokenizer.chat_template.NAME, or the list form of tokenizer_config.json),
 * or NULL. Owned by tok. */
const char *td_tokenizer_chat_template_named(const td_tokenizer *tok, const char *name);
/* Display name of the model family's tokenizer ("gpt2/smollm", "llama/spm", ...). */
const char *td_tokenizer_kind(const td_tokenizer *tok);

/* Encode len bytes of text (need not be valid UTF-8: invalid bytes are
 * encoded through byte tokens / byte fallback, never a crash; a byte whose
 * byte-level character the vocabulary lacks, e.g. 0xC0 in SmolLM2's, is
 * dropped, as llama.cpp does).
 * add_special: add BOS/EOS as the model's metadata says.
 * parse_special: recognise control token texts (<|im_start|>, <s>, ...)
 * inside `text`. User-defined (non-special added) tokens are recognised
 * either way, as llama.cpp and Hugging Face tokenizers do; candidates are
 * tried longest first.
 * *tokens_p is malloc'd (caller frees with free()); *n_p its length. */
td_status td_tokenizer_encode(const td_tokenizer *tok, const char *text, size_t len,
                              bool add_special, bool parse_special, int32_t **tokens_p,
                              size_t *n_p);

/* Decode tokens to bytes; special tokens are rendered unless skip_special.
 * *text_p is malloc'd and NUL-terminated (caller frees); *len_p excludes the NUL. */
td_status td_tokenizer_decode(const td_tokenizer *tok, const int32_t *tokens, size_t n,
                              bool skip_special, char **text_p, size_t *len_p);

/* The bytes token id stands for: a byte token (<0xXX>) its byte, byte-level
 * and SentencePiece text their bytes with spaces restored, a control token
 * its text (nothing when skip_special). Written to buf, at most cap bytes,
 * no NUL; returns the full length, which may exceed cap (buf then holds
 * the first cap bytes). 0 for an id out of range. The piece may be part of
 * a UTF-8 sequence; no leading-space stripping (see td_detok for that). */
size_t td_tokenizer_token_to_piece(const td_tokenizer *tok, int32_t id, bool skip_special,
                                   char *buf, size_t cap);

/* Incremental detokenizer for streaming: push one token at a time and get
 * back only complete UTF-8 sequences; incomplete tails are held until the
 * next token completes them (or td_detok_flush emits them as U+FFFD).
 * Also handles SentencePiece's leading-space removal at the start. */
typedef struct {
    char pending[8];
    int n_pending;
    bool first;
    bool skip_special;
} td_detok;

void td_detok_init(td_detok *d, bool skip_special);
/* Appends the newly complete bytes to out (cap bytes available) and returns
 * how many were written; a piece longer than cap is truncated (cap >= 64
 * always suffices for one token of the supported vocabularies). */
size_t td_detok_push(const td_tokenizer *tok, td_detok *d, int32_t id, char *out, size_t cap);
size_t td_detok_flush(td_detok *d, char *out, size_t cap);

#endif
