/* The hand-off between a producer of tokens (the scheduler, or the
 * router proxying a decode instance) and the reader that serves them to a
 * client (the HTTP and gRPC front ends): a stream of tokens, logprobs and
 * final text with its end, readable by polling an eventfd. The producer
 * publishes under the stream's mutex and wakes the reader; the reader
 * takes everything new at once.
 *
 * Thread-safety: every td_gen_stream_* function may be called from any
 * thread; a stream has one reader and one producer. */
#ifndef TD_SCHED_STREAM_H
#define TD_SCHED_STREAM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/base/base.h"
#include "common/obs/metrics.h"
#include "sampler.h"

/* A ticket names one submitted sequence (unique per scheduler, never 0). */
typedef uint64_t td_sched_ticket;

typedef struct td_gen_stream td_gen_stream;

/* What a reader gets from td_gen_stream_read: everything published since
 * its previous read. Pointers stay valid until the next read or release. */
typedef struct {
    const int32_t *tokens; /* (n_tokens) newly generated ids */
    const td_sample_result
        *logprobs; /* (n_tokens) when the request asked for logprobs, else NULL */
    int32_t n_tokens;
    const char *text; /* text now final (stop-string hold-back applied), not NUL-terminated */
    size_t text_len;
    /* Totals so far. */
    int32_t n_prompt_tokens;
    int32_t n_cached_tokens;
    int32_t n_output_tokens;
    /* Set once, on the read that sees the end. */
    bool finished;
    td_finish_reason finish;
    int stop_index;            /* index of the matched stop string, or -1 */
    int32_t stop_token;        /* the stop / EOG token that ended it, or -1 */
    td_status error;           /* TD_OK, or why it failed (finish == TD_FINISH_ERROR / ABORT) */
    const char *error_message; /* a producer's words for it (td_gen_stream_fail), or NULL */
} td_gen_delta;

/* Waits up to timeout_ms (0: no wait, < 0: forever) for news on the stream
 * and fills *d with it. Returns TD_OK when *d holds news (tokens, text or
 * the end), TD_AGAIN on timeout with nothing new, TD_ERR_NOMEM / TD_ERR_IO
 * (logged) when the copy or the wait fails. After the read that
 * reported finished, every read returns TD_OK with n_tokens 0 and finished. */
td_status td_gen_stream_read(td_gen_stream *st, int timeout_ms, td_gen_delta *d);
/* File descriptor that is readable while the stream has unread news
 * (an eventfd), for callers that poll it with a socket. */
int td_gen_stream_fd(const td_gen_stream *st);
/* Asks the producer to cancel (idempotent; a finished stream is unchanged):
 * a scheduler frees the sequence's blocks at its next step and the stream
 * finishes with TD_FINISH_ABORT. */
void td_gen_stream_cancel(td_gen_stream *st);
/* The reader is done: cancels if unfinished, tells the owner (released),
 * and frees the stream once the producer has let go of it too. A
 * scheduler's streams are released before td_sched_destroy (the count of
 * live streams lives in the scheduler). */
void td_gen_stream_release(td_gen_stream *st);

/* ---- The producer's side ----
 * The scheduler creates a stream for every sequence it takes; a front end
 * without a scheduler of its own (the router, which proxies requests to
 * decode instances) creates the streams its readers (the HTTP and gRPC
 * front ends) read exactly as they read a scheduler's. The owner's
 * callbacks tell the producer what the reader did. */
typedef struct {
    /* The reader asked to cancel (td_gen_stream_cancel, or its release of
     * an unfinished stream); any thread, at most once; it may race with
     * the producer's finish. */
    void (*cancel)(void *ctx);
    /* The reader let go (td_gen_stream_release); any thread, once. */
    void (*released)(void *ctx);
    /* Both the reader and the producer let go: the stream is freed and ctx
     * is never used again. */
    void (*freed)(void *ctx);
    void *ctx;
} td_gen_stream_owner;

/* A stream for up to max_tokens tokens (with room for logprobs when
 * logprobs), of a prompt of n_prompt tokens. Two references: the reader's
 * (td_gen_stream_release) and the producer's (td_gen_stream_unref).
 * TD_ERR_NOMEM / TD_ERR_IO (logged). */
td_status td_gen_stream_create(int32_t max_tokens, bool logprobs, int32_t n_prompt,
                               const td_gen_stream_owner *owner, td_gen_stream **st_p);
/* Producer: publishes n new tokens (lp: n results, or NULL) and text bytes
 * (final text). TD_ERR_RANGE when the tokens would exceed max_tokens,
 * TD_ERR_NOMEM; nothing is published then. TD_ERR_INVALID once finished. */
td_status td_gen_stream_push(td_gen_stream *st, const int32_t *tokens, const td_sample_result *lp,
                             int32_t n, const char *text, size_t text_len);
/* Producer: the prompt's totals (tokens, of which served from a cache). */
void td_gen_stream_set_prompt(td_gen_stream *st, int32_t n_prompt, int32_t n_cached);
/* Producer: the end (once; later calls change nothing). */
void td_gen_stream_finish(td_gen_stream *st, td_finish_reason why, td_status err, int stop_index,
                          int32_t stop_token);
/* Producer: the end with the last final text (a then b, each may be empty),
 * published with it at once, so a reader sees them together. When the
 * text cannot be kept the end is TD_FINISH_ERROR with TD_ERR_NOMEM. Returns
 * the tokens published; *finish_p (may be NULL): the finish recorded. */
int32_t td_gen_stream_end(td_gen_stream *st, const char *a, size_t a_len, const char *b,
                          size_t b_len, td_finish_reason why, td_status err, int stop_index,
                          int32_t stop_token, td_finish_reason *finish_p);
/* Producer: the ticket td_gen_stream_ticket answers. */
void td_gen_stream_set_ticket(td_gen_stream *st, td_sched_ticket t);
/* Producer: the end with an error and the client-facing words for it
 * (copied; the reader's delta carries them). */
void td_gen_stream_fail(td_gen_stream *st, td_status err, const char *message);
/* Producer: whether the reader asked to cancel. */
bool td_gen_stream_cancelled(const td_gen_stream *st);
/* Producer: tokens published so far. */
int32_t td_gen_stream_n_tokens(td_gen_stream *st);
/* Producer: lets go of its reference. */
void td_gen_stream_unref(td_gen_stream *st);

/* The ticket of a submitted sequence. */
td_sched_ticket td_gen_stream_ticket(const td_gen_stream *st);

#endif
