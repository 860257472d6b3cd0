/* Stop conditions of one sequence: stop tokens (every end-of-generation
 * token the tokenizer names, plus user stop ids) and stop strings, matched
 * on the streamed text.
 *
 * Stop strings are matched by a streaming matcher: text is fed piece by
 * piece as the detokenizer produces it, and the matcher releases only text
 * that cannot be the start of a stop string; a suffix that might still grow
 * into one is held back until the next piece decides it. When a stop string
 * appears (possibly spread over several pieces), the output is truncated
 * right before it (or right after it with include_stop_str, as vLLM's
 * include_stop_str_in_output) and the matcher reports the stop. The stop
 * string that is complete first in the text wins (at the same end, the
 * longer one; then the one listed first), so the result is the same however
 * the text is cut into pieces. When generation ends for another reason,
 * td_stop_flush() releases the held text.
 *
 * Not thread-safe: one sequence, one thread. */
#ifndef TD_STOP_H
#define TD_STOP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/base/base.h"
#include "common/tokenizer/tokenizer.h"

typedef struct {
    const int32_t *stop_ids; /* user stop token ids (copied); may be NULL */
    size_t n_stop_ids;
    const char *const *stop_strings; /* NUL-terminated, non-empty (copied); may be NULL */
    size_t n_stop_strings;
    bool include_stop_str; /* keep the matched stop string in the output */
    bool ignore_eog;       /* do not stop on the tokenizer's EOG tokens (vLLM ignore_eos) */
} td_stop_params;

typedef struct td_stop td_stop;

td_stop_params td_stop_default_params(void);

/* tok (may be NULL) supplies the end-of-generation ids; it is not kept.
 * TD_ERR_INVALID (logged) for an empty stop string or a negative stop id.
 * Free with td_stop_destroy(). */
td_status td_stop_create(const td_stop_params *p, const td_tokenizer *tok, td_stop **s_p);
void td_stop_destroy(td_stop *s); /* accepts NULL */
/* Forgets held text and a previous stop, for a new sequence. */
void td_stop_reset(td_stop *s);

/* True if generating id ends the sequence (EOG or a user stop id). */
bool td_stop_is_stop_token(const td_stop *s, int32_t id);

/* Feeds len bytes of newly decoded text. *out_p / *out_len_p: the text that
 * is now final (valid until the next call on s); *stopped_p: a stop string
 * was found (the output ends at it; later feeds return nothing). */
td_status td_stop_feed(td_stop *s, const char *text, size_t len, const char **out_p,
                       size_t *out_len_p, bool *stopped_p);
/* Releases the held-back text (end of generation without a stop string). */
void td_stop_flush(td_stop *s, const char **out_p, size_t *out_len_p);
/* Index of the stop string that matched, or -1. */
int td_stop_matched(const td_stop *s);

#endif
