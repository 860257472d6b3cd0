/* Stop tokens and the streaming stop-string matcher; contract in stop.h. */
#include "stop.h"

#include <string.h>

struct td_stop {
    int32_t *ids; /* (n_ids) sorted stop token ids, EOG included */
    size_t n_ids;
    char **strs;  /* (n_strs) own copies */
    size_t *lens; /* (n_strs) */
    size_t n_strs;
    size_t max_len; /* longest stop string */
    bool include_stop_str;

    char *buf; /* (cap) text not yet released: buf[0..n) */
    size_t n;
    size_t cap;
    size_t released; /* bytes of buf handed out by the previous call, dropped next call */
    bool stopped;
    int matched;
};

td_stop_params td_stop_default_params(void) { return (td_stop_params){0}; }

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

td_status td_stop_create(const td_stop_params *p, const td_tokenizer *tok, td_stop **s_p) {
    for (size_t i = 0; i < p->n_stop_ids; i++) {
        if (p->stop_ids[i] < 0) {
            TD_LOG_ERROR("stop token id %d is negative", p->stop_ids[i]);
            return TD_ERR_INVALID;
        }
    }
    for (size_t i = 0; i < p->n_stop_strings; i++) {
        if (!p->stop_strings[i] || !p->stop_strings[i][0]) {
            TD_LOG_ERROR("stop string %zu is empty", i);
            return TD_ERR_INVALID;
        }
    }
    size_t n_eog = 0;
    const int32_t *eog = NULL;
    if (tok && !p->ignore_eog) eog = td_tokenizer_eog_ids(tok, &n_eog);
    if (!eog) n_eog = 0;

    td_stop *s = calloc(1, sizeof *s);
    if (!s) goto err_nomem;
    s->include_stop_str = p->include_stop_str;
    s->matched = -1;
    if (n_eog + p->n_stop_ids > 0) {
        s->ids = malloc((n_eog + p->n_stop_ids) * sizeof *s->ids);
        if (!s->ids) goto err_free;
        if (n_eog) memcpy(s->ids, eog, n_eog * sizeof *s->ids);
        if (p->n_stop_ids) memcpy(s->ids + n_eog, p->stop_ids, p->n_stop_ids * sizeof *s->ids);
        s->n_ids = n_eog + p->n_stop_ids;
        qsort(s->ids, s->n_ids, sizeof *s->ids, cmp_i32);
    }
    if (p->n_stop_strings) {
        s->strs = calloc(p->n_stop_strings, sizeof *s->strs);
        s->lens = calloc(p->n_stop_strings, sizeof *s->lens);
        if (!s->strs || !s->lens) goto err_free;
        s->n_strs = p->n_stop_strings;
        for (size_t i = 0; i < s->n_strs; i++) {
            s->strs[i] = strdup(p->stop_strings[i]);
            if (!s->strs[i]) goto err_free;
            s->lens[i] = strlen(s->strs[i]);
            s->max_len = TD_MAX(s->max_len, s->lens[i]);
        }
    }
    /* Room for what may be held (max_len - 1) plus a few tokens' text;
     * td_stop_feed grows it only for an unusually long piece. */
    s->cap = s->max_len + 256;
    s->buf = malloc(s->cap);
    if (!s->buf) goto err_free;
    *s_p = s;
    return TD_OK;

err_free:
    td_stop_destroy(s);
err_nomem:
    TD_LOG_ERROR("out of memory for the stop conditions");
    return TD_ERR_NOMEM;
}

void td_stop_destroy(td_stop *s) {
    if (!s) return;
    for (size_t i = 0; i < s->n_strs; i++) free(s->strs[i]);
    free(s->strs);
    free(s->lens);
    free(s->ids);
    free(s->buf);
    free(s);
}

void td_stop_reset(td_stop *s) {
    s->n = 0;
    s->released = 0;
    s->stopped = false;
    s->matched = -1;
}

bool td_stop_is_stop_token(const td_stop *s, int32_t id) {
    return s->n_ids && bsearch(&id, s->ids, s->n_ids, sizeof *s->ids, cmp_i32) != NULL;
}

int td_stop_matched(const td_stop *s) { return s->matched; }

/* Drops the bytes the previous call handed out. */
static void drop_released(td_stop *s) {
    if (s->released) {
        memmove(s->buf, s->buf + s->released, s->n - s->released);
        s->n -= s->released;
        s->released = 0;
    }
}

td_status td_stop_feed(td_stop *s, const char *text, size_t len, const char **out_p,
                       size_t *out_len_p, bool *stopped_p) {
    drop_released(s);
    if (s->stopped) {
        *out_p = s->buf;
        *out_len_p = 0;
        *stopped_p = true;
        return TD_OK;
    }
    size_t need;
    if (td_add_overflow(s->n, len, &need)) return TD_ERR_NOMEM;
    if (need > s->cap) {
        size_t cap = TD_MAX(need, s->cap * 2);
        char *nb = realloc(s->buf, cap);
        if (!nb) {
            TD_LOG_ERROR("out of memory for %zu bytes of streamed text", cap);
            return TD_ERR_NOMEM;
        }
        s->buf = nb;
        s->cap = cap;
    }
    memcpy(s->buf + s->n, text, len);
    size_t old_n = s->n;
    s->n = need;

    /* The match that completes first wins, as if the text had arrived one
     * byte at a time (so the result does not depend on how the text was cut
     * into pieces); at the same end, the longer one. The held text alone
     * completed nothing, so only ends inside the new text are candidates. */
    size_t best_pos = 0;
    int best = -1;
    for (size_t e = old_n + 1; e <= s->n && best < 0; e++) {
        for (size_t k = 0; k < s->n_strs; k++) {
            size_t L = s->lens[k];
            if (L > e || (best >= 0 && L <= s->lens[best])) continue;
            if (memcmp(s->buf + e - L, s->strs[k], L) == 0) {
                best = (int)k;
                best_pos = e - L;
            }
        }
    }
    if (best >= 0) {
        s->stopped = true;
        s->matched = best;
        size_t out = best_pos + (s->include_stop_str ? s->lens[best] : 0);
        s->released = out;
        s->n = out; /* the rest after a stop is discarded */
        *out_p = s->buf;
        *out_len_p = out;
        *stopped_p = true;
        return TD_OK;
    }

    /* Hold back the longest suffix that is a proper prefix of a stop string. */
    size_t hold = 0;
    size_t lim = s->max_len ? TD_MIN(s->n, s->max_len - 1) : 0;
    for (size_t h = lim; h > 0 && hold == 0; h--) {
        const char *tail = s->buf + s->n - h;
        for (size_t k = 0; k < s->n_strs; k++) {
            if (s->lens[k] > h && memcmp(tail, s->strs[k], h) == 0) {
                hold = h;
                break;
            }
        }
    }
    s->released = s->n - hold;
    *out_p = s->buf;
    *out_len_p = s->released;
    *stopped_p = false;
    return TD_OK;
}

void td_stop_flush(td_stop *s, const char **out_p, size_t *out_len_p) {
    drop_released(s);
    *out_p = s->buf;
    *out_len_p = s->stopped ? 0 : s->n;
    s->released = *out_len_p;
}
