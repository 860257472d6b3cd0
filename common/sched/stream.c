/* The stream between a producer and its reader (stream.h). */
#include "stream.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

struct td_gen_stream {
    pthread_mutex_t mu;
    int efd; /* readable while there is unread news */
    atomic_int refs;
    atomic_bool cancel;
    /* Published by the producer (under mu). tokens/logprobs never move:
     * they are sized for the whole output at submit. */
    int32_t *tokens;      /* (cap) */
    td_sample_result *lp; /* (cap) or NULL */
    int32_t cap;
    int32_t n_pub;
    char *text; /* (text_cap) */
    size_t text_len, text_cap;
    int32_t n_prompt, n_cached;
    bool finished;
    td_finish_reason finish;
    int stop_index;
    int32_t stop_token;
    td_status error;
    char *error_message; /* td_gen_stream_fail's, or NULL */
    /* Reader side. */
    int32_t n_read;
    size_t text_read;
    bool end_reported;
    char *r_text; /* reader's copy of the new text */
    size_t r_text_cap;
    td_gen_stream_owner owner;
    td_sched_ticket ticket;
};

static void stream_unref(td_gen_stream *st) {
    if (atomic_fetch_sub(&st->refs, 1) != 1) return;
    if (st->owner.freed) st->owner.freed(st->owner.ctx);
    close(st->efd);
    pthread_mutex_destroy(&st->mu);
    free(st->tokens);
    free(st->lp);
    free(st->text);
    free(st->r_text);
    free(st->error_message);
    free(st);
}

static void stream_notify(td_gen_stream *st) {
    uint64_t one = 1;
    ssize_t r = write(st->efd, &one, sizeof one);
    TD_UNUSED(r); /* EAGAIN only when the counter is saturated: still readable */
}

/* Appends bytes to the stream's text (under its mutex). */
static bool stream_text_append(td_gen_stream *st, const char *p, size_t n) {
    if (n == 0) return true;
    if (st->text_len + n > st->text_cap) {
        size_t cap = TD_MAX(st->text_len + n, 2 * st->text_cap);
        char *t = realloc(st->text, cap);
        if (!t) return false;
        st->text = t;
        st->text_cap = cap;
    }
    memcpy(st->text + st->text_len, p, n);
    st->text_len += n;
    return true;
}

td_status td_gen_stream_read(td_gen_stream *st, int timeout_ms, td_gen_delta *d) {
    double deadline = timeout_ms > 0 ? td_time_s() + timeout_ms / 1000.0 : 0;
    for (;;) {
        pthread_mutex_lock(&st->mu);
        bool news = st->n_pub > st->n_read || st->text_len > st->text_read ||
                    (st->finished && !st->end_reported) || st->end_reported;
        if (news) {
            uint64_t v;
            ssize_t r = read(st->efd, &v, sizeof v);
            TD_UNUSED(r);
            memset(d, 0, sizeof *d);
            d->tokens = st->tokens + st->n_read;
            d->logprobs = st->lp ? st->lp + st->n_read : NULL;
            d->n_tokens = st->n_pub - st->n_read;
            size_t nt = st->text_len - st->text_read;
            if (nt > st->r_text_cap) {
                size_t cap = TD_MAX(nt, 2 * st->r_text_cap);
                char *p = realloc(st->r_text, cap);
                if (!p) {
                    pthread_mutex_unlock(&st->mu);
                    TD_LOG_ERROR("out of memory");
                    return TD_ERR_NOMEM;
                }
                st->r_text = p;
                st->r_text_cap = cap;
            }
            if (nt) memcpy(st->r_text, st->text + st->text_read, nt);
            d->text = st->r_text;
            d->text_len = nt;
            st->n_read = st->n_pub;
            st->text_read = st->text_len;
            d->n_prompt_tokens = st->n_prompt;
            d->n_cached_tokens = st->n_cached;
            d->n_output_tokens = st->n_pub;
            d->stop_index = st->stop_index;
            d->stop_token = st->stop_token;
            if (st->finished) {
                d->finished = true;
                d->finish = st->finish;
                d->error = st->error;
                d->error_message = st->error_message;
                st->end_reported = true;
                /* Keep the fd readable so pollers see the end every time. */
                stream_notify(st);
            }
            pthread_mutex_unlock(&st->mu);
            return TD_OK;
        }
        /* Nothing new: clear a wake-up that an earlier read already
         * consumed the news of, so pollers do not spin on a readable fd
         * (news is published under mu before its notify, so none is lost). */
        uint64_t stale;
        ssize_t rr = read(st->efd, &stale, sizeof stale);
        TD_UNUSED(rr);
        pthread_mutex_unlock(&st->mu);
        if (timeout_ms == 0) return TD_AGAIN;
        int wait_ms = -1;
        if (timeout_ms > 0) {
            double left = deadline - td_time_s();
            if (left <= 0) return TD_AGAIN;
            wait_ms = (int)ceil(left * 1000.0);
        }
        struct pollfd pfd = {.fd = st->efd, .events = POLLIN};
        int pr = poll(&pfd, 1, wait_ms);
        if (pr == 0) return TD_AGAIN;
        if (pr < 0 && errno != EINTR) {
            TD_LOG_ERROR("poll: %s", strerror(errno));
            return TD_ERR_IO;
        }
    }
}

int td_gen_stream_fd(const td_gen_stream *st) { return st->efd; }

td_sched_ticket td_gen_stream_ticket(const td_gen_stream *st) { return st->ticket; }

void td_gen_stream_cancel(td_gen_stream *st) {
    if (!st) return;
    /* A finished stream may outlive its producer: touch nothing else. */
    pthread_mutex_lock(&st->mu);
    bool done = st->finished;
    pthread_mutex_unlock(&st->mu);
    if (done || atomic_exchange(&st->cancel, true)) return;
    if (st->owner.cancel) st->owner.cancel(st->owner.ctx);
}

void td_gen_stream_release(td_gen_stream *st) {
    if (!st) return;
    td_gen_stream_cancel(st);
    if (st->owner.released) st->owner.released(st->owner.ctx);
    stream_unref(st);
}

td_status td_gen_stream_create(int32_t max_tokens, bool logprobs, int32_t n_prompt,
                               const td_gen_stream_owner *owner, td_gen_stream **st_p) {
    if (max_tokens < 1 || n_prompt < 0 || !st_p) return TD_ERR_INVALID;
    td_gen_stream *gs = calloc(1, sizeof *gs);
    if (!gs) goto nomem;
    gs->cap = max_tokens;
    gs->tokens = malloc((size_t)gs->cap * sizeof *gs->tokens);
    gs->lp = logprobs ? malloc((size_t)gs->cap * sizeof *gs->lp) : NULL;
    gs->text_cap = 256;
    gs->text = malloc(gs->text_cap);
    if (!gs->tokens || (logprobs && !gs->lp) || !gs->text) goto nomem;
    if (pthread_mutex_init(&gs->mu, NULL) != 0) goto nomem;
    gs->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (gs->efd < 0) {
        TD_LOG_ERROR("eventfd: %s", strerror(errno));
        pthread_mutex_destroy(&gs->mu);
        free(gs->tokens);
        free(gs->lp);
        free(gs->text);
        free(gs);
        return TD_ERR_IO;
    }
    gs->n_prompt = n_prompt;
    gs->stop_index = -1;
    gs->stop_token = -1;
    if (owner) gs->owner = *owner;
    atomic_init(&gs->refs, 2); /* reader + producer */
    atomic_init(&gs->cancel, false);
    *st_p = gs;
    return TD_OK;
nomem:
    TD_LOG_ERROR("out of memory");
    if (gs) {
        free(gs->tokens);
        free(gs->lp);
        free(gs->text);
        free(gs);
    }
    return TD_ERR_NOMEM;
}

td_status td_gen_stream_push(td_gen_stream *st, const int32_t *tokens, const td_sample_result *lp,
                             int32_t n, const char *text, size_t text_len) {
    if (n < 0 || (n > 0 && !tokens)) return TD_ERR_INVALID;
    pthread_mutex_lock(&st->mu);
    td_status rc = TD_OK;
    if (st->finished)
        rc = TD_ERR_INVALID;
    else if (n > st->cap - st->n_pub)
        rc = TD_ERR_RANGE;
    else if (!stream_text_append(st, text, text_len))
        rc = TD_ERR_NOMEM;
    if (rc == TD_OK && n > 0) {
        memcpy(st->tokens + st->n_pub, tokens, (size_t)n * sizeof *tokens);
        if (st->lp) {
            if (lp)
                memcpy(st->lp + st->n_pub, lp, (size_t)n * sizeof *lp);
            else
                for (int32_t i = 0; i < n; i++)
                    st->lp[st->n_pub + i] = (td_sample_result){.token = tokens[i]};
        }
        st->n_pub += n;
    }
    pthread_mutex_unlock(&st->mu);
    if (rc == TD_OK) stream_notify(st);
    return rc;
}

void td_gen_stream_set_prompt(td_gen_stream *st, int32_t n_prompt, int32_t n_cached) {
    pthread_mutex_lock(&st->mu);
    st->n_prompt = n_prompt;
    st->n_cached = n_cached;
    pthread_mutex_unlock(&st->mu);
}

void td_gen_stream_finish(td_gen_stream *st, td_finish_reason why, td_status err, int stop_index,
                          int32_t stop_token) {
    pthread_mutex_lock(&st->mu);
    bool was = st->finished;
    if (!was) {
        st->finished = true;
        st->finish = why;
        st->error = err;
        st->stop_index = stop_index;
        st->stop_token = stop_token;
    }
    pthread_mutex_unlock(&st->mu);
    if (!was) stream_notify(st);
}

int32_t td_gen_stream_end(td_gen_stream *st, const char *a, size_t a_len, const char *b,
                          size_t b_len, td_finish_reason why, td_status err, int stop_index,
                          int32_t stop_token, td_finish_reason *finish_p) {
    pthread_mutex_lock(&st->mu);
    bool ok = stream_text_append(st, a, a_len) && stream_text_append(st, b, b_len);
    st->finished = true;
    st->finish = ok ? why : TD_FINISH_ERROR;
    st->error = ok ? err : TD_ERR_NOMEM;
    st->stop_index = stop_index;
    st->stop_token = stop_token;
    int32_t n_out = st->n_pub;
    if (finish_p) *finish_p = st->finish;
    pthread_mutex_unlock(&st->mu);
    stream_notify(st);
    return n_out;
}

void td_gen_stream_set_ticket(td_gen_stream *st, td_sched_ticket t) { st->ticket = t; }

void td_gen_stream_fail(td_gen_stream *st, td_status err, const char *message) {
    pthread_mutex_lock(&st->mu);
    if (!st->finished && message && !st->error_message) st->error_message = strdup(message);
    pthread_mutex_unlock(&st->mu);
    td_gen_stream_finish(st, TD_FINISH_ERROR, err, -1, -1);
}

bool td_gen_stream_cancelled(const td_gen_stream *st) { return atomic_load(&st->cancel); }

int32_t td_gen_stream_n_tokens(td_gen_stream *st) {
    pthread_mutex_lock(&st->mu);
    int32_t n = st->n_pub;
    pthread_mutex_unlock(&st->mu);
    return n;
}

void td_gen_stream_unref(td_gen_stream *st) {
    if (st) stream_unref(st);
}
