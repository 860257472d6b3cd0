/* The token level of the grammar engine: a tokenizer's vocabulary as a
 * byte trie, and a matcher's allowed-token mask over it.
 *
 * Every token stands for its bytes (td_tokenizer_token_to_piece). Control
 * and unknown tokens (td_tokenizer_is_special) and tokens of no bytes are
 * left out of the trie: a grammar never admits them through their text.
 * Added tokens that are not special (Qwen's <tool_call>, user-defined GGUF
 * tokens) are ordinary text: a grammar admits them where it admits their
 * bytes. The end-of-generation tokens (td_tokenizer_eog_ids) are allowed
 * exactly when the matcher accepts.
 *
 * The mask walks the trie depth first, pushing each node's byte into the
 * matcher and taking it back, and skips the subtree of a rejected byte.
 * A td_vocab is immutable once built and may be shared by any number of
 * matchers and threads. */
#ifndef TD_GRAMMAR_VOCAB_H
#define TD_GRAMMAR_VOCAB_H

#include <stddef.h>
#include <stdint.h>

#include "common/grammar/grammar.h"
#include "common/tokenizer/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_vocab td_vocab;

/* NULL on allocation failure. */
td_vocab *td_vocab_new(const td_tokenizer *tok);
/* From n tokens' bytes directly (tests, fuzzers): pieces[id] (lens[id]
 * bytes; NULL or empty: not in the trie), and the end-of-generation ids. */
td_vocab *td_vocab_from_pieces(int32_t n, const char *const *pieces, const size_t *lens,
                               const int32_t *eog, size_t neog);
void td_vocab_free(td_vocab *v);
int32_t td_vocab_size(const td_vocab *v);
/* 32-bit words of a mask: (size + 31) / 32. */
size_t td_vocab_mask_words(const td_vocab *v);
bool td_vocab_is_eog(const td_vocab *v, int32_t id);

/* The tokens allowed after the bytes so far: bit (id % 32) of mask[id / 32]
 * (td_vocab_mask_words words, all written). Returns how many, or -1 when a
 * limit was crossed (td_gm_error). The matcher's state is unchanged. A
 * stopped matcher (td_gm_consume_token of an end-of-generation token)
 * allows nothing. */
int64_t td_gm_mask(td_gm *m, const td_vocab *v, uint32_t *mask);

/* Advances by one token: its bytes, or for an end-of-generation token the
 * end (allowed when accepting; the matcher is then stopped). On
 * TD_GM_REJECT the state is unchanged. *bytes_taken (if not NULL) is how
 * many of the token's bytes were taken before a rejection. */
td_gm_result td_gm_consume_token(td_gm *m, const td_vocab *v, int32_t id, size_t *bytes_taken);

/* Tokens the constraint forces next, for the scheduler to append without
 * sampling: the forced bytes (td_gm_forced_bytes, at most 256) tokenized
 * with tok, less the last token (the bytes after the forced ones may
 * merge with it), each checked to be allowed in turn. Writes at most max
 * ids to out; returns how many, or -1 on a limit. The state is
 * unchanged. */
int64_t td_gm_forced_tokens(td_gm *m, const td_vocab *v, const td_tokenizer *tok, int32_t *out,
                            size_t max);

#ifdef __cplusplus
}
#endif
#endif
