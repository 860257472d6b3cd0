/* The HTTP front end on libmicrohttpd; see http.h.
 *
 * One thread per connection: the access handler parses, validates and
 * submits, then either blocks until the generation ends (non-streaming) or
 * returns a callback response whose reader blocks for the next SSE event.
 * Both wait in poll() on the streams' eventfds together with the client's
 * socket, so a client that goes away is noticed at once (libmicrohttpd
 * itself would only notice on the next write). */
#define _GNU_SOURCE /* POLLRDHUP */
#include "http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>

#include "common/base/strbuf.h"
#include "request-impl.h"

struct td_http_server {
    td_http_params p; /* strings point at the copies below */
    struct MHD_Daemon *d;
    int port;
    char *host, *instance_id, *model_name;
    char *cluster_token; /* NULL: internal paths use the API keys */
    char **keys;
    size_t *key_len;
    int n_keys;
    int32_t n_vocab;
    atomic_int grpc_port; /* reported by /internal/v1/state */
};

td_http_params td_http_default_params(void) {
    return (td_http_params){
        .host = "127.0.0.1",
        .port = 8000,
        .model = {.chat = NULL},
        .limits = td_api_default_limits(),
        .max_connections = 1024,
        .max_header_bytes = 16 << 10,
        .ping_interval_s = 5.0,
        .retry_after_s = 1,
        .kv_block_size = 16,
    };
}

int td_http_server_port(const td_http_server *srv) { return srv ? srv->port : 0; }

void td_http_server_set_grpc_port(td_http_server *srv, int port) {
    if (srv) atomic_store(&srv->grpc_port, port);
}

/* ------------------------------------------------------------------ routes */

typedef enum {
    R_NONE = 0,
    R_COMPLETIONS,
    R_CHAT,
    R_MODELS,
    R_TOKENIZE,
    R_APPLY_TEMPLATE,
    R_DETOKENIZE,
    R_HEALTH,
    R_READY,
    R_METRICS,
    R_STATE,
    R_EXCHANGE,
    R_CLUSTER,
} route;

static const struct {
    const char *path;
    route r;
    bool post; /* POST, else GET (and HEAD) */
} routes[] = {
    {"/v1/completions", R_COMPLETIONS, true},
    {"/v1/chat/completions", R_CHAT, true},
    {"/v1/models", R_MODELS, false},
    {"/tokenize", R_TOKENIZE, true},
    {"/apply-template", R_APPLY_TEMPLATE, true},
    {"/detokenize", R_DETOKENIZE, true},
    {"/health", R_HEALTH, false},
    {"/ready", R_READY, false},
    {"/metrics", R_METRICS, false},
    {"/internal/v1/state", R_STATE, false},
    {"/internal/v1/kv/exchange", R_EXCHANGE, false},
    {"/internal/v1/cluster", R_CLUSTER, false},
};

/* Per-request state kept by libmicrohttpd between handler calls. */
typedef struct {
    route r;
    bool post;
    char *body; /* accumulated upload */
    size_t len, cap;
    bool too_large; /* more than max_body_bytes arrived (the rest is discarded) */
    bool oom;
    bool answered;     /* a response was queued at the first call */
    bool unauthorized; /* no valid key: the body is discarded, not stored, then 401 */
    size_t discarded;  /* bytes of a too-large body read and dropped */
} conn_state;

/* The most body bytes read (and dropped) to answer 413 politely. */
static size_t drain_limit(const struct td_http_server *srv) {
    size_t lim = srv->p.limits.max_body_bytes;
    return lim > SIZE_MAX / 4 ? SIZE_MAX : TD_MAX(lim * 4, (size_t)16 << 20);
}

/* ------------------------------------------------------------- responses */

static enum MHD_Result queue_buf(struct MHD_Connection *c, unsigned status, char *buf, size_t len,
                                 const char *ctype) {
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, buf, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(buf);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    enum MHD_Result ret = MHD_queue_response(c, status, resp);
    MHD_destroy_response(resp);
    return ret;
}

static enum MHD_Result queue_json(struct MHD_Connection *c, unsigned status, json_t *root) {
    if (!root) return MHD_NO;
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (!s) return MHD_NO;
    return queue_buf(c, status, s, strlen(s), "application/json");
}

static void record_error(const td_http_server *srv, int status, const char *type) {
    if (srv->p.metrics) td_metrics_request_error(srv->p.metrics, status, type);
}

/* The one place an error response is logged, counted and sent. */
static enum MHD_Result send_error(const td_http_server *srv, struct MHD_Connection *c,
                                  const char *method, const char *url, const td_api_error *e,
                                  const char *allow) {
    TD_LOG_INFO("%s %s: %d %s%s%s: %s", method, url, e->http_status, e->type,
                e->param[0] ? " param=" : "", e->param, e->message);
    record_error(srv, e->http_status, e->type);
    char *js = td_api_error_json(e);
    if (!js) return MHD_NO;
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(strlen(js), js, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(js);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    if (e->http_status == 429) {
        char ra[16];
        snprintf(ra, sizeof(ra), "%d", TD_MAX(srv->p.retry_after_s, 0));
        MHD_add_response_header(resp, MHD_HTTP_HEADER_RETRY_AFTER, ra);
    }
    if (e->http_status == 401) MHD_add_response_header(resp, "WWW-Authenticate", "Bearer");
    if (allow) MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, allow);
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)e->http_status, resp);
    MHD_destroy_response(resp);
    return ret;
}

static enum MHD_Result send_status(const td_http_server *srv, struct MHD_Connection *c,
                                   const char *method, const char *url, td_status st,
                                   const char *what) {
    td_api_error e;
    td_api_error_from_status(&e, st, what);
    return send_error(srv, c, method, url, &e, NULL);
}

/* A JSON string from bytes that may not be valid UTF-8. */
static json_t *jstr(const char *s, size_t n) {
    size_t len = 0;
    char *fixed = td_api_utf8_fix(s, n, &len);
    if (!fixed) return NULL;
    json_t *v = json_stringn(fixed, len);
    free(fixed);
    return v;
}

/* Logprobs that JSON can carry (vLLM writes -9999 for -inf). */
static double safe_lp(float x) { return isfinite(x) ? (double)x : -9999.0; }

/* ----------------------------------------------------------------- buffers */

/* "data: JSON\n\n" (consumes root). */
static void sb_event(td_strbuf *b, json_t *root) {
    if (!root) {
        b->oom = true;
        return;
    }
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (!s) {
        b->oom = true;
        return;
    }
    td_strbuf_puts(b, "data: ");
    td_strbuf_puts(b, s);
    td_strbuf_puts(b, "\n\n");
    free(s);
}

/* -------------------------------------------------------------------- ids */

static void make_id(char *out, size_t cap, const char *prefix) {
    static atomic_uint_fast64_t counter;
    unsigned char r[16];
    if (getrandom(r, sizeof(r), GRND_NONBLOCK) != (ssize_t)sizeof(r)) {
        /* No entropy yet (early boot): unique within the process is enough. */
        uint64_t a = td_time_ns(), b = atomic_fetch_add(&counter, 1) + 1;
        memcpy(r, &a, 8);
        memcpy(r + 8, &b, 8);
    }
    size_t o = (size_t)snprintf(out, cap, "%s", prefix);
    for (size_t i = 0; i < sizeof(r) && o + 2 < cap; i++, o += 2)
        snprintf(out + o, cap - o, "%02x", r[i]);
}

/* ------------------------------------------------------------- generation */

typedef struct {
    td_gen_stream *st;
    int32_t prompt; /* which prompt (completions batch) */
    bool done;
    td_finish_reason finish;
    int stop_index;
    int32_t stop_token;
    td_status error;
    char error_message[256]; /* the producer's words for the error, or "" */
    int32_t n_prompt, n_cached, n_output;
    td_strbuf text; /* non-streaming: the whole text */
    json_t *lp;     /* non-streaming: accumulated logprobs */
    char carry[8];  /* streaming: an incomplete UTF-8 tail held for the next delta */
    size_t n_carry;
    int64_t text_offset; /* completions logprobs: byte offset of the next token */
} choice;

typedef struct {
    td_http_server *srv;
    td_api_request req;
    int32_t **toks; /* (n_prompts) */
    int32_t *n_toks;
    int32_t n_prompts;
    char id[48];
    long long created;
    choice *ch; /* (n_ch): prompt-major, then choice */
    int32_t n_ch, n_done;
    bool failed; /* a choice ended in an error or an abort we did not ask for */
    td_api_error fail;
    int sock;           /* the client's socket, -1 if unknown */
    short sock_events;  /* POLLIN|POLLRDHUP until pipelined bytes arrive, then POLLRDHUP */
    struct pollfd *pfd; /* (n_ch + 1) */
    int32_t *pfd_ch;    /* (n_ch + 1) */
    /* Streaming. */
    td_strbuf out;
    size_t out_off;
    double last_send;
    bool finished; /* the last event is in out */
} job;

static void job_cancel_all(job *j) {
    for (int32_t i = 0; i < j->n_ch; i++)
        if (j->ch[i].st && !j->ch[i].done) td_gen_stream_cancel(j->ch[i].st);
}

static void job_free(job *j) {
    if (!j) return;
    for (int32_t i = 0; i < j->n_ch; i++) {
        td_gen_stream_release(j->ch[i].st);
        free(j->ch[i].text.v);
        json_decref(j->ch[i].lp);
    }
    free(j->ch);
    if (j->toks)
        for (int32_t i = 0; i < j->n_prompts; i++) free(j->toks[i]);
    free(j->toks);
    free(j->n_toks);
    free(j->pfd);
    free(j->pfd_ch);
    free(j->out.v);
    td_api_request_free(&j->req);
    free(j);
}

typedef enum { W_NEWS, W_TIMEOUT, W_GONE } wait_result;

/* Waits up to timeout_ms for news on an unfinished stream or for the
 * client to go away. */
static wait_result job_wait(job *j, int timeout_ms) {
    int np = 0;
    if (j->sock >= 0) {
        j->pfd[np] = (struct pollfd){.fd = j->sock, .events = j->sock_events};
        j->pfd_ch[np++] = -1;
    }
    for (int32_t i = 0; i < j->n_ch; i++) {
        if (j->ch[i].done) continue;
        j->pfd[np] = (struct pollfd){.fd = td_gen_stream_fd(j->ch[i].st), .events = POLLIN};
        j->pfd_ch[np++] = i;
    }
    int r = poll(j->pfd, (nfds_t)np, timeout_ms);
    if (r < 0) {
        if (errno == EINTR) return W_TIMEOUT;
        TD_LOG_ERROR("poll: %s", strerror(errno));
        return W_GONE;
    }
    if (r == 0) return W_TIMEOUT;
    wait_result res = W_TIMEOUT;
    for (int k = 0; k < np; k++) {
        short re = j->pfd[k].revents;
        if (!re) continue;
        if (j->pfd_ch[k] >= 0) {
            res = W_NEWS;
            continue;
        }
        if (re & (POLLHUP | POLLERR | POLLRDHUP | POLLNVAL)) return W_GONE;
        if (re & POLLIN) {
            char b;
            ssize_t n = recv(j->sock, &b, 1, MSG_PEEK | MSG_DONTWAIT);
            if (n == 0) return W_GONE;
            if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return W_GONE;
            /* Pipelined bytes of a next request: only a hang-up matters now. */
            if (n > 0) j->sock_events = POLLRDHUP;
        }
    }
    return res;
}

static const char *finish_str(td_finish_reason f) {
    return f == TD_FINISH_LENGTH ? "length" : "stop";
}

static json_t *stop_reason(const job *j, const choice *c) {
    if (c->stop_index >= 0 && c->stop_index < j->req.n_stop)
        return json_string(j->req.stop[c->stop_index]);
    for (int32_t i = 0; c->stop_token >= 0 && i < j->req.n_stop_ids; i++)
        if (j->req.stop_ids[i] == c->stop_token) return json_integer(c->stop_token);
    return json_null();
}

static json_t *usage_json(const job *j) {
    long long prompt = 0, completion = 0, cached = 0;
    for (int32_t p = 0; p < j->n_prompts; p++) prompt += j->n_toks[p];
    for (int32_t i = 0; i < j->n_ch; i++) {
        completion += j->ch[i].n_output;
        if (i % j->req.n == 0) cached += j->ch[i].n_cached; /* once per prompt */
    }
    return json_pack("{s:I,s:I,s:I,s:{s:I}}", "prompt_tokens", (json_int_t)prompt,
                     "completion_tokens", (json_int_t)completion, "total_tokens",
                     (json_int_t)(prompt + completion), "prompt_tokens_details", "cached_tokens",
                     (json_int_t)cached);
}

/* An empty logprobs object of the request's kind. */
static json_t *lp_new(const job *j) {
    if (j->req.kind == TD_API_CHAT) return json_pack("{s:[]}", "content");
    return json_pack("{s:[],s:[],s:[],s:[]}", "tokens", "token_logprobs", "top_logprobs",
                     "text_offset");
}

static json_t *bytes_json(const char *s, size_t n) {
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++) json_array_append_new(a, json_integer((unsigned char)s[i]));
    return a;
}

/* Appends the delta's tokens to lp in OpenAI's format for the kind. */
/* The bytes of one token as logprobs report it (specials included), cut
 * to cap. */
static size_t piece_of(const td_tokenizer *tok, int32_t id, char *buf, size_t cap) {
    return TD_MIN(td_tokenizer_token_to_piece(tok, id, false, buf, cap), cap);
}

static void lp_add(const job *j, choice *c, json_t *lp, const td_gen_delta *d) {
    if (!lp || !d->logprobs) return;
    const td_tokenizer *tok = j->srv->p.model.tok;
    for (int32_t k = 0; k < d->n_tokens; k++) {
        const td_sample_result *r = &d->logprobs[k];
        char piece[256];
        size_t n = piece_of(tok, d->tokens[k], piece, sizeof(piece));
        if (j->req.kind == TD_API_CHAT) {
            json_t *top = json_array();
            for (int32_t t = 0; top && t < r->n_top && t < j->req.top_logprobs; t++) {
                char tp[256];
                size_t tn = piece_of(tok, r->top[t].token, tp, sizeof(tp));
                json_array_append_new(top, json_pack("{s:o,s:f,s:o}", "token", jstr(tp, tn),
                                                     "logprob", safe_lp(r->top[t].logprob), "bytes",
                                                     bytes_json(tp, tn)));
            }
            json_array_append_new(json_object_get(lp, "content"),
                                  json_pack("{s:o,s:f,s:o,s:o}", "token", jstr(piece, n), "logprob",
                                            safe_lp(r->logprob), "bytes", bytes_json(piece, n),
                                            "top_logprobs", top ? top : json_array()));
        } else {
            json_array_append_new(json_object_get(lp, "tokens"), jstr(piece, n));
            json_array_append_new(json_object_get(lp, "token_logprobs"),
                                  json_real(safe_lp(r->logprob)));
            json_t *top = json_object();
            for (int32_t t = 0; top && t < r->n_top && t < j->req.top_logprobs; t++) {
                char tp[256];
                size_t tn = piece_of(tok, r->top[t].token, tp, sizeof(tp));
                size_t fl = 0;
                char *key = td_api_utf8_fix(tp, tn, &fl);
                /* Two tokens with one text: the more likely one (first) stays. */
                if (key && !json_object_get(top, key))
                    json_object_set_new(top, key, json_real(safe_lp(r->top[t].logprob)));
                free(key);
            }
            json_array_append_new(json_object_get(lp, "top_logprobs"), top ? top : json_null());
            json_array_append_new(json_object_get(lp, "text_offset"),
                                  json_integer((json_int_t)c->text_offset));
            c->text_offset += (int64_t)n;
        }
    }
}

/* Streaming text: whole UTF-8 characters only; a split tail waits for the
 * next delta (and is flushed, repaired, at the end). Returns a malloc'd
 * valid UTF-8 string (*n_p its length) or NULL when out of memory. */
static char *take_text(choice *c, const char *t, size_t n, bool final, size_t *n_p) {
    td_strbuf b = {0};
    td_strbuf_put(&b, c->carry, c->n_carry);
    td_strbuf_put(&b, t, n);
    if (b.oom) {
        free(b.v);
        return NULL;
    }
    size_t keep = final ? b.n : td_api_utf8_complete_len(b.v ? b.v : "", b.n);
    c->n_carry = b.n - keep;
    if (c->n_carry > sizeof(c->carry)) c->n_carry = 0; /* cannot happen: tails are < 4 bytes */
    if (c->n_carry) memcpy(c->carry, b.v + keep, c->n_carry);
    char *out = td_api_utf8_fix(b.v ? b.v : "", keep, n_p);
    free(b.v);
    return out;
}

static json_t *chunk_new(const job *j) {
    const char *object = j->req.kind == TD_API_CHAT ? "chat.completion.chunk" : "text_completion";
    json_t *o = json_pack("{s:s,s:s,s:I,s:s,s:[]}", "id", j->id, "object", object, "created",
                          (json_int_t)j->created, "model", j->srv->model_name, "choices");
    if (o && j->req.include_usage) json_object_set_new(o, "usage", json_null());
    return o;
}

/* One choice of a chunk: text (may be ""), logprobs (consumed, may be
 * NULL), role for the first chat chunk, finish when the choice ended. */
static json_t *chunk_choice(const job *j, int32_t idx, const char *text, size_t n, json_t *lp,
                            bool role, const choice *fin) {
    json_t *ch = json_pack("{s:i}", "index", (int)idx);
    if (!ch) return NULL;
    if (j->req.kind == TD_API_CHAT) {
        json_t *delta = json_object();
        if (role) json_object_set_new(delta, "role", json_string("assistant"));
        if (n || role) json_object_set_new(delta, "content", json_stringn(text, n));
        json_object_set_new(ch, "delta", delta);
    } else {
        json_object_set_new(ch, "text", json_stringn(text, n));
    }
    json_object_set_new(ch, "logprobs", lp ? lp : json_null());
    json_object_set_new(ch, "finish_reason",
                        fin ? json_string(finish_str(fin->finish)) : json_null());
    json_object_set_new(ch, "stop_reason", fin ? stop_reason(j, fin) : json_null());
    return ch;
}

static void sb_chunk(td_strbuf *b, const job *j, json_t *choice_obj) {
    json_t *o = chunk_new(j);
    if (!o || !choice_obj) {
        json_decref(o);
        json_decref(choice_obj);
        b->oom = true;
        return;
    }
    json_array_append_new(json_object_get(o, "choices"), choice_obj);
    sb_event(b, o);
}

/* The text a choice starts with when echo is on: the prompt as written. */
static char *echo_text(const job *j, int32_t p, size_t *n_p) {
    if (j->req.prompts) {
        const char *s = j->req.prompts[p];
        return td_api_utf8_fix(s, strlen(s), n_p);
    }
    char *text = NULL;
    size_t len = 0;
    if (td_tokenizer_decode(j->srv->p.model.tok, j->toks[p], (size_t)j->n_toks[p], false, &text,
                            &len) != TD_OK)
        return NULL;
    char *fixed = td_api_utf8_fix(text, len, n_p);
    free(text);
    return fixed;
}

static void job_fail(job *j, choice *c) {
    if (j->failed) return;
    j->failed = true;
    if (c->finish == TD_FINISH_ABORT)
        td_api_error_set(&j->fail, 503, "service_unavailable", "", "",
                         "the request was aborted by the server (shutting down)");
    else
        td_api_error_from_status(&j->fail, c->error, "generation");
    if (c->finish != TD_FINISH_ABORT && c->error_message[0])
        snprintf(j->fail.message, sizeof j->fail.message, "%s", c->error_message);
}

/* Reads every stream with news; streaming appends events to j->out. */
static void job_collect(job *j, bool streaming) {
    for (int32_t i = 0; i < j->n_ch; i++) {
        choice *c = &j->ch[i];
        if (c->done) continue;
        td_gen_delta d;
        td_status st = td_gen_stream_read(c->st, 0, &d);
        if (st == TD_AGAIN) continue;
        if (st != TD_OK) {
            c->done = true;
            j->n_done++;
            c->finish = TD_FINISH_ERROR;
            c->error = st;
            job_fail(j, c);
            continue;
        }
        c->n_prompt = d.n_prompt_tokens;
        c->n_cached = d.n_cached_tokens;
        c->n_output = d.n_output_tokens;
        bool ok_end = false;
        if (d.finished) {
            c->done = true;
            j->n_done++;
            c->finish = d.finish;
            c->stop_index = d.stop_index;
            c->stop_token = d.stop_token;
            c->error = d.error;
            if (d.error_message)
                snprintf(c->error_message, sizeof c->error_message, "%s", d.error_message);
            if (d.finish == TD_FINISH_STOP || d.finish == TD_FINISH_LENGTH)
                ok_end = true;
            else
                job_fail(j, c);
        }
        if (!streaming) {
            td_strbuf_put(&c->text, d.text, d.text_len);
            if (j->req.logprobs && d.n_tokens) {
                if (!c->lp) c->lp = lp_new(j);
                lp_add(j, c, c->lp, &d);
            }
            continue;
        }
        if (j->failed) continue; /* the error event replaces whatever comes now */
        size_t n = 0;
        char *text = take_text(c, d.text, d.text_len, d.finished, &n);
        if (!text) {
            j->out.oom = true;
            continue;
        }
        json_t *lp = NULL;
        if (j->req.logprobs && d.n_tokens && d.logprobs) {
            lp = lp_new(j);
            lp_add(j, c, lp, &d);
        }
        if (n || lp || ok_end)
            sb_chunk(&j->out, j, chunk_choice(j, i, text, n, lp, false, ok_end ? c : NULL));
        else
            json_decref(lp);
        free(text);
    }
}

/* The events a stream starts with: the role of every chat choice (vLLM
 * sends it before any token), the prompt of every echoing completion. */
static void stream_start(job *j) {
    for (int32_t i = 0; i < j->n_ch; i++) {
        if (j->req.kind == TD_API_CHAT) {
            sb_chunk(&j->out, j, chunk_choice(j, i, "", 0, NULL, true, NULL));
        } else if (j->req.echo) {
            size_t n = 0;
            char *t = echo_text(j, j->ch[i].prompt, &n);
            if (!t) {
                j->out.oom = true;
                return;
            }
            sb_chunk(&j->out, j, chunk_choice(j, i, t, n, NULL, false, NULL));
            free(t);
        }
    }
}

/* After the last choice ended (or one failed): usage, [DONE]. */
static void stream_finish(job *j) {
    if (j->failed) {
        job_cancel_all(j);
        TD_LOG_INFO("%s: %d %s after the headers: %s", j->id, j->fail.http_status, j->fail.type,
                    j->fail.message);
        record_error(j->srv, j->fail.http_status, j->fail.type);
        char *js = td_api_error_json(&j->fail);
        if (js) {
            td_strbuf_puts(&j->out, "data: ");
            td_strbuf_puts(&j->out, js);
            td_strbuf_puts(&j->out, "\n\n");
            free(js);
        } else {
            j->out.oom = true;
        }
    } else if (j->req.include_usage) {
        json_t *o = chunk_new(j);
        if (o) json_object_set_new(o, "usage", usage_json(j));
        sb_event(&j->out, o);
    }
    td_strbuf_puts(&j->out, "data: [DONE]\n\n");
    j->finished = true;
}

static ssize_t sse_read(void *cls, uint64_t pos, char *buf, size_t max) {
    TD_UNUSED(pos);
    job *j = cls;
    for (;;) {
        if (j->out.oom) {
            TD_LOG_ERROR("%s: out of memory while streaming", j->id);
            job_cancel_all(j);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (j->out_off < j->out.n) {
            size_t n = TD_MIN(max, j->out.n - j->out_off);
            memcpy(buf, j->out.v + j->out_off, n);
            j->out_off += n;
            j->last_send = td_time_s();
            return (ssize_t)n;
        }
        j->out.n = j->out_off = 0;
        if (j->finished) return MHD_CONTENT_READER_END_OF_STREAM;
        double ping = j->srv->p.ping_interval_s > 0 ? j->srv->p.ping_interval_s : 5.0;
        double left = j->last_send + ping - td_time_s();
        int timeout_ms = left <= 0 ? 0 : (int)ceil(left * 1000.0);
        wait_result w = job_wait(j, timeout_ms);
        if (w == W_GONE) {
            TD_LOG_INFO("%s: client went away mid-stream; cancelling", j->id);
            job_cancel_all(j);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (w == W_TIMEOUT) {
            if (td_time_s() >= j->last_send + ping) td_strbuf_puts(&j->out, ": ping\n\n");
            continue;
        }
        job_collect(j, true);
        if (j->failed || j->n_done == j->n_ch) stream_finish(j);
    }
}

static void sse_free(void *cls) { job_free(cls); }

static json_t *response_json(job *j) {
    bool chat = j->req.kind == TD_API_CHAT;
    json_t *choices = json_array();
    if (!choices) return NULL;
    for (int32_t i = 0; i < j->n_ch; i++) {
        choice *c = &j->ch[i];
        td_strbuf text = {0};
        if (!chat && j->req.echo) {
            size_t n = 0;
            char *t = echo_text(j, c->prompt, &n);
            if (!t) text.oom = true;
            td_strbuf_put(&text, t ? t : "", n);
            free(t);
        }
        td_strbuf_put(&text, c->text.v ? c->text.v : "", c->text.n);
        if (text.oom || c->text.oom) {
            free(text.v);
            json_decref(choices);
            return NULL;
        }
        json_t *s = jstr(text.v ? text.v : "", text.n);
        free(text.v);
        json_t *lp = json_null();
        if (j->req.logprobs) {
            lp = c->lp ? json_incref(c->lp) : lp_new(j);
        }
        json_t *o;
        if (chat)
            o = json_pack("{s:i,s:{s:s,s:o},s:o,s:s,s:o}", "index", (int)i, "message", "role",
                          "assistant", "content", s, "logprobs", lp, "finish_reason",
                          finish_str(c->finish), "stop_reason", stop_reason(j, c));
        else
            o = json_pack("{s:i,s:o,s:o,s:s,s:o}", "index", (int)i, "text", s, "logprobs", lp,
                          "finish_reason", finish_str(c->finish), "stop_reason", stop_reason(j, c));
        if (!o || json_array_append_new(choices, o)) {
            json_decref(choices);
            return NULL;
        }
    }
    return json_pack("{s:s,s:s,s:I,s:s,s:o,s:o}", "id", j->id, "object",
                     chat ? "chat.completion" : "text_completion", "created",
                     (json_int_t)j->created, "model", j->srv->model_name, "choices", choices,
                     "usage", usage_json(j));
}

static enum MHD_Result handle_generate(td_http_server *srv, struct MHD_Connection *c,
                                       const char *method, const char *url, td_api_kind kind,
                                       const conn_state *cs) {
    double t_arrival = td_time_s();
    td_api_error err;
    memset(&err, 0, sizeof(err));
    job *j = calloc(1, sizeof(*j));
    if (!j) return MHD_NO;
    j->srv = srv;
    j->sock = -1;
    j->sock_events = POLLIN | POLLRDHUP;
    j->created = (long long)time(NULL);
    make_id(j->id, sizeof(j->id), kind == TD_API_CHAT ? "chatcmpl-" : "cmpl-");

    enum MHD_Result ret;
    td_status st =
        td_api_request_parse(kind, cs->body, cs->len, &srv->p.limits, srv->n_vocab, &j->req, &err);
    if (st != TD_OK) goto reply_error;

    j->n_prompts = kind == TD_API_CHAT ? 1 : j->req.n_prompts;
    j->toks = calloc((size_t)j->n_prompts, sizeof(int32_t *));
    j->n_toks = calloc((size_t)j->n_prompts, sizeof(int32_t));
    int32_t *max_tokens = calloc((size_t)j->n_prompts, sizeof(int32_t));
    j->n_ch = j->n_prompts * j->req.n;
    j->ch = calloc((size_t)j->n_ch, sizeof(choice));
    j->pfd = calloc((size_t)j->n_ch + 1, sizeof(struct pollfd));
    j->pfd_ch = calloc((size_t)j->n_ch + 1, sizeof(int32_t));
    if (!j->toks || !j->n_toks || !max_tokens || !j->ch || !j->pfd || !j->pfd_ch) {
        free(max_tokens);
        td_api_error_set(&err, 500, "server_error", "", "", "out of memory");
        goto reply_error;
    }
    for (int32_t p = 0; p < j->n_prompts; p++) {
        st = td_api_request_tokens(&srv->p.model, &j->req, p, &j->toks[p], &j->n_toks[p],
                                   &max_tokens[p], &err);
        if (st != TD_OK) {
            free(max_tokens);
            goto reply_error;
        }
    }
    if (j->req.constraint.kind != TD_CONSTRAINT_NONE &&
        (srv->p.submit_hook.fn || srv->p.submit_hook.submit)) {
        free(max_tokens);
        td_api_error_set(&err, 400, "invalid_request_error", j->req.constraint.field, "",
                         "structured outputs ('%s') are served by `tandem serve` only: the "
                         "router and prefill/decode pools do not carry them yet",
                         j->req.constraint.field);
        goto reply_error;
    }
    for (int32_t i = 0; i < j->n_ch; i++) {
        choice *ch = &j->ch[i];
        ch->prompt = i / j->req.n;
        ch->stop_index = -1;
        ch->stop_token = -1;
        td_gen_request g;
        td_api_request_to_gen(&j->req, j->toks[ch->prompt], j->n_toks[ch->prompt],
                              max_tokens[ch->prompt], i % j->req.n, &g);
        char sid[64];
        snprintf(sid, sizeof(sid), "%s-%d", j->id, (int)i);
        g.id = sid;
        g.t_arrival = t_arrival;
        /* each choice its own grammar (it runs on the scheduler thread) */
        if ((st = td_api_request_grammar(&j->req, srv->p.model.tok, &g.grammar, &err))) {
            free(max_tokens);
            goto reply_error;
        }
        st = td_api_submit(srv->p.sched, &srv->p.submit_hook, &g, &ch->st);
        if (st != TD_OK) {
            td_gram_free(g.grammar);
            free(max_tokens);
            td_api_error_from_status(&err, st, "submit");
            goto reply_error;
        }
    }
    free(max_tokens);

    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci) j->sock = ci->connect_fd;

    if (j->req.stream) {
        j->last_send = td_time_s();
        stream_start(j);
        struct MHD_Response *resp =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 << 10, sse_read, j, sse_free);
        if (!resp) {
            job_free(j);
            return MHD_NO;
        }
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        MHD_add_response_header(resp, "X-Accel-Buffering", "no");
        ret = MHD_queue_response(c, MHD_HTTP_OK, resp);
        MHD_destroy_response(resp); /* the job now belongs to the response */
        return ret;
    }

    while (j->n_done < j->n_ch && !j->failed) {
        wait_result w = job_wait(j, 1000);
        if (w == W_GONE) {
            TD_LOG_INFO("%s: client went away; cancelling", j->id);
            job_cancel_all(j);
            job_free(j);
            return MHD_NO;
        }
        if (w == W_NEWS) job_collect(j, false);
    }
    if (j->failed) {
        job_cancel_all(j);
        err = j->fail;
        goto reply_error;
    }
    ret = queue_json(c, MHD_HTTP_OK, response_json(j));
    job_free(j);
    return ret;

reply_error:
    job_free(j);
    return send_error(srv, c, method, url, &err, NULL);
}

/* ------------------------------------------------------- other endpoints */

static json_t *load_body(const td_http_server *srv, const conn_state *cs, td_api_error *err) {
    json_error_t je;
    json_t *root = json_loadb(cs->body ? cs->body : "", cs->len, 0, &je);
    if (!root) {
        size_t fl = 0;
        char *fixed = td_api_utf8_fix(je.text, strnlen(je.text, sizeof(je.text)), &fl);
        td_api_error_set(err, 400, "invalid_request_error", "", "", "malformed JSON body: %s",
                         fixed ? fixed : "parse error");
        free(fixed);
        return NULL;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        td_api_error_set(err, 400, "invalid_request_error", "", "",
                         "the request body must be a JSON object");
        return NULL;
    }
    TD_UNUSED(srv);
    return root;
}

static bool opt_bool(const json_t *root, const char *key, bool def, bool *out, td_api_error *err) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) {
        *out = def;
        return true;
    }
    if (!json_is_boolean(v)) {
        td_api_error_set(err, 400, "invalid_request_error", "", key, "'%s' must be a boolean", key);
        return false;
    }
    *out = json_is_true(v);
    return true;
}

static bool check_model_field(const td_http_server *srv, const json_t *root, td_api_error *err) {
    json_t *m = json_object_get(root, "model");
    if (!m || json_is_null(m)) return true;
    if (!json_is_string(m)) {
        td_api_error_set(err, 400, "invalid_request_error", "", "model",
                         "'model' must be a string");
        return false;
    }
    return td_api_check_model(&srv->p.model, json_string_value(m), err) == TD_OK;
}

/* vLLM's /tokenize: {"prompt": str, "add_special_tokens": true} or
 * {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false}. */
static enum MHD_Result handle_tokenize(td_http_server *srv, struct MHD_Connection *c,
                                       const char *method, const char *url, const conn_state *cs) {
    td_api_error err;
    memset(&err, 0, sizeof(err));
    json_t *root = load_body(srv, cs, &err);
    int32_t *toks = NULL;
    size_t n = 0;
    char *text = NULL;
    if (!root || !check_model_field(srv, root, &err)) goto error;
    json_t *prompt = json_object_get(root, "prompt");
    json_t *msgs = json_object_get(root, "messages");
    bool add_special;
    td_status st;
    if (msgs && !json_is_null(msgs)) {
        if (!opt_bool(root, "add_special_tokens", false, &add_special, &err) ||
            td_api_render_chat_body(&srv->p.model, root, &text, &err) != TD_OK)
            goto error;
    } else if (prompt && json_is_string(prompt)) {
        if (!opt_bool(root, "add_special_tokens", true, &add_special, &err)) goto error;
        text = strndup(json_string_value(prompt), json_string_length(prompt));
        if (!text) {
            td_api_error_set(&err, 500, "server_error", "", "", "out of memory");
            goto error;
        }
    } else {
        td_api_error_set(&err, 400, "invalid_request_error", "", prompt ? "prompt" : "",
                         "give 'prompt' (a string) or 'messages'");
        goto error;
    }
    st = td_tokenizer_encode(srv->p.model.tok, text, strlen(text), add_special, true, &toks, &n);
    if (st != TD_OK) {
        td_api_error_from_status(&err, st, "tokenize");
        goto error;
    }
    json_t *arr = json_array();
    for (size_t i = 0; arr && i < n; i++) json_array_append_new(arr, json_integer(toks[i]));
    free(toks);
    free(text);
    json_decref(root);
    return queue_json(c, MHD_HTTP_OK,
                      json_pack("{s:I,s:i,s:o}", "count", (json_int_t)n, "max_model_len",
                                (int)srv->p.model.max_ctx, "tokens", arr));
error:
    free(text);
    json_decref(root);
    return send_error(srv, c, method, url, &err, NULL);
}

/* llama.cpp's /apply-template: {messages, tools?, add_generation_prompt?,
 * continue_final_message?, chat_template_kwargs?} -> {"prompt": the
 * rendered text}, as a chat completion would render it. */
static enum MHD_Result handle_apply_template(td_http_server *srv, struct MHD_Connection *c,
                                             const char *method, const char *url,
                                             const conn_state *cs) {
    td_api_error err;
    memset(&err, 0, sizeof(err));
    json_t *root = load_body(srv, cs, &err);
    char *text = NULL;
    if (!root || !check_model_field(srv, root, &err) ||
        td_api_render_chat_body(&srv->p.model, root, &text, &err) != TD_OK)
        goto error;
    json_decref(root);
    json_t *out = json_object();
    if (!out || json_object_set_new(out, "prompt", json_string_nocheck(text)) != 0) {
        json_decref(out);
        free(text);
        td_api_error_set(&err, 500, "server_error", "", "", "out of memory");
        return send_error(srv, c, method, url, &err, NULL);
    }
    free(text);
    return queue_json(c, MHD_HTTP_OK, out);
error:
    free(text);
    json_decref(root);
    return send_error(srv, c, method, url, &err, NULL);
}

static enum MHD_Result handle_detokenize(td_http_server *srv, struct MHD_Connection *c,
                                         const char *method, const char *url,
                                         const conn_state *cs) {
    td_api_error err;
    memset(&err, 0, sizeof(err));
    json_t *root = load_body(srv, cs, &err);
    int32_t *ids = NULL;
    if (!root || !check_model_field(srv, root, &err)) goto error;
    json_t *arr = json_object_get(root, "tokens");
    if (!json_is_array(arr)) {
        td_api_error_set(&err, 400, "invalid_request_error", "", "tokens",
                         "'tokens' must be a list of token ids");
        goto error;
    }
    size_t n = json_array_size(arr);
    ids = malloc((n ? n : 1) * sizeof(int32_t));
    if (!ids) {
        td_api_error_set(&err, 500, "server_error", "", "", "out of memory");
        goto error;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(arr, i);
        json_int_t x = json_is_integer(v) ? json_integer_value(v) : -1;
        if (!json_is_integer(v) || x < 0 || x >= srv->n_vocab) {
            td_api_error_set(&err, 400, "invalid_request_error", "", "tokens",
                             "tokens[%zu] is not a token id in the vocabulary (size %d)", i,
                             (int)srv->n_vocab);
            goto error;
        }
        ids[i] = (int32_t)x;
    }
    char *text = NULL;
    size_t len = 0;
    td_status st = td_tokenizer_decode(srv->p.model.tok, ids, n, false, &text, &len);
    if (st != TD_OK) {
        td_api_error_from_status(&err, st, "detokenize");
        goto error;
    }
    json_t *s = jstr(text, len);
    free(text);
    free(ids);
    json_decref(root);
    return queue_json(c, MHD_HTTP_OK, json_pack("{s:o}", "prompt", s));
error:
    free(ids);
    json_decref(root);
    return send_error(srv, c, method, url, &err, NULL);
}

static enum MHD_Result handle_models(td_http_server *srv, struct MHD_Connection *c) {
    json_int_t created = (json_int_t)time(NULL);
    return queue_json(c, MHD_HTTP_OK,
                      json_pack("{s:s,s:[{s:s,s:s,s:I,s:s,s:s,s:n,s:i}]}", "object", "list", "data",
                                "id", srv->model_name, "object", "model", "created", created,
                                "owned_by", "tandem", "root", srv->model_name, "parent",
                                "max_model_len", (int)srv->p.model.max_ctx));
}

static enum MHD_Result handle_metrics(td_http_server *srv, struct MHD_Connection *c,
                                      const char *method, const char *url) {
    if (!srv->p.metrics) {
        td_api_error e;
        td_api_error_set(&e, 404, "not_found_error", "", "", "metrics are not enabled");
        return send_error(srv, c, method, url, &e, NULL);
    }
    td_metrics_gauges g;
    memset(&g, 0, sizeof(g));
    if (srv->p.sched) td_sched_metrics_gauges(srv->p.sched, &g);
    if (srv->p.gauges) srv->p.gauges(srv->p.internal_ctx, &g);
    char *text = NULL;
    size_t len = 0;
    td_status st = td_metrics_render(srv->p.metrics, &g, &text, &len);
    if (st != TD_OK) return send_status(srv, c, method, url, st, "metrics");
    char *extra = srv->p.metrics_extra ? srv->p.metrics_extra(srv->p.internal_ctx) : NULL;
    if (extra) {
        size_t n = strlen(extra);
        char *both = realloc(text, len + n + 1);
        if (!both) {
            free(text);
            free(extra);
            return send_status(srv, c, method, url, TD_ERR_NOMEM, "metrics");
        }
        memcpy(both + len, extra, n + 1);
        text = both;
        len += n;
        free(extra);
    }
    return queue_buf(c, MHD_HTTP_OK, text, len, "text/plain; version=0.0.4; charset=utf-8");
}

static const char *event_type(td_kv_event_type t) {
    switch (t) {
    case TD_KV_EVENT_STORED: return "stored";
    case TD_KV_EVENT_REMOVED: return "removed";
    case TD_KV_EVENT_CLEARED: return "cleared";
    }
    return "unknown";
}

static enum MHD_Result handle_state(td_http_server *srv, struct MHD_Connection *c,
                                    const char *method, const char *url) {
    uint64_t since = 0;
    const char *s = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "since");
    if (s) {
        char *end = NULL;
        errno = 0;
        unsigned long long v = strtoull(s, &end, 10);
        if (!*s || *end || errno || *s == '-' || *s == '+' || *s == ' ') {
            td_api_error e;
            td_api_error_set(&e, 400, "invalid_request_error", "", "since",
                             "'since' must be a non-negative decimal integer");
            return send_error(srv, c, method, url, &e, NULL);
        }
        since = v;
    }
    if (!srv->p.sched) {
        td_api_error e;
        td_api_error_set(&e, 404, "not_found_error", "", "",
                         "this server holds no KV cache (not a worker instance)");
        return send_error(srv, c, method, url, &e, NULL);
    }
    td_kv_events *ev = td_sched_kv_events(srv->p.sched);
    bool full = false;
    td_kv_event *events = NULL;
    td_kv_hash *hashes = NULL;
    size_t n = 0;
    uint64_t last = 0;
    td_status st = td_kv_events_read(ev, since, &full, &events, &hashes, &n, &last);
    if (st != TD_OK) return send_status(srv, c, method, url, st, "kv events");
    td_sched_stats stats;
    td_sched_stats_get(srv->p.sched, &stats);
    char epoch[24], hex[33], compat[33];
    snprintf(epoch, sizeof(epoch), "%016" PRIx64, td_kv_events_epoch(ev));
    td_kv_hash_hex(td_sched_compat(srv->p.sched), compat);
    json_t *list = json_array();
    for (size_t i = 0; list && i < n; i++) {
        if (full) {
            td_kv_hash_hex(hashes[i], hex);
            json_array_append_new(list, json_string(hex));
        } else {
            td_kv_hash_hex(events[i].hash, hex);
            json_array_append_new(list, json_pack("{s:I,s:s,s:s}", "seq", (json_int_t)events[i].seq,
                                                  "type", event_type(events[i].type), "hash", hex));
        }
    }
    free(events);
    free(hashes);
    const td_kv_counts *k = &stats.kv;
    json_t *root = json_pack(
        "{s:s,s:s,s:s,s:I,s:b,s:o,s:{s:i,s:i,s:I,s:{s:i,s:i,s:i,s:i,s:i,s:i,s:i}}}", "instance_id",
        srv->instance_id, "epoch", epoch, "compat", compat, "last_seq", (json_int_t)last, "full",
        (int)full, full ? "hashes" : "events", list, "load", "running", (int)stats.running,
        "waiting", (int)stats.waiting, "queued_prefill_tokens",
        (json_int_t)stats.queued_prefill_tokens, "kv", "total", (int)k->total, "empty",
        (int)k->empty, "cached", (int)k->cached, "used", (int)k->used, "reserved", (int)k->reserved,
        "free", (int)(k->empty + k->cached - k->reserved), "block_size", (int)srv->p.kv_block_size);
    if (root) {
        json_object_set_new(root, "role", json_string(srv->p.role ? srv->p.role : "colocated"));
        json_object_set_new(root, "draining", json_boolean(stats.draining));
        json_object_set_new(root, "max_ctx", json_integer(srv->p.model.max_ctx));
        json_object_set_new(root, "grpc_port", json_integer(atomic_load(&srv->grpc_port)));
        /* the prefill speed its steps measured (0: none yet): with the
         * queued prompt tokens, when a new prompt could start */
        json_object_set_new(json_object_get(root, "load"), "prefill_tokens_per_s",
                            json_real(stats.prefill_tokens_per_s));
    }
    char *extra = srv->p.state_transfer ? srv->p.state_transfer(srv->p.internal_ctx) : NULL;
    if (root && extra) {
        json_t *x = json_loads(extra, 0, NULL);
        if (x) json_object_set_new(root, "transfer", x);
    }
    free(extra);
    return queue_json(c, MHD_HTTP_OK, root);
}

static enum MHD_Result handle_exchange(td_http_server *srv, struct MHD_Connection *c,
                                       const char *method, const char *url) {
    if (!srv->p.kv_exchange) {
        td_api_error e;
        td_api_error_set(&e, 404, "not_found_error", "", "",
                         "this instance does not export KV (not a prefill instance)");
        return send_error(srv, c, method, url, &e, NULL);
    }
    uint8_t *buf = NULL;
    size_t len = 0;
    td_status st = srv->p.kv_exchange(srv->p.internal_ctx, &buf, &len);
    if (st != TD_OK) return send_status(srv, c, method, url, st, "kv exchange");
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, buf, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(buf);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/x-protobuf");
    enum MHD_Result r = MHD_queue_response(c, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return r;
}

/* ------------------------------------------------------------- dispatch */

static bool authorized(const td_http_server *srv, struct MHD_Connection *c, route r) {
    if ((r == R_STATE || r == R_EXCHANGE || r == R_CLUSTER) && srv->cluster_token) {
        const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Tandem-Cluster-Token");
        return h && td_secret_eq(srv->cluster_token, strlen(srv->cluster_token), h, strlen(h));
    }
    if (srv->n_keys == 0) return true;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!h || strncasecmp(h, "Bearer ", 7) != 0) return false;
    const char *k = h + 7;
    while (*k == ' ') k++;
    size_t n = strlen(k);
    while (n && k[n - 1] == ' ') n--;
    unsigned ok = 0;
    for (int i = 0; i < srv->n_keys; i++) ok |= td_secret_eq(srv->keys[i], srv->key_len[i], k, n);
    return ok != 0;
}

static bool is_public(route r) {
    return r == R_COMPLETIONS || r == R_CHAT || r == R_MODELS || r == R_TOKENIZE ||
           r == R_DETOKENIZE || r == R_APPLY_TEMPLATE;
}

static enum MHD_Result dispatch(td_http_server *srv, struct MHD_Connection *c, const char *method,
                                const char *url, conn_state *cs) {
    td_api_error e;
    memset(&e, 0, sizeof(e));
    bool open =
        cs->r == R_HEALTH || cs->r == R_READY || (cs->r == R_METRICS && !srv->p.metrics_need_key);
    if (!open && !authorized(srv, c, cs->r)) {
        td_api_error_set(&e, 401, "authentication_error", "invalid_api_key", "",
                         "missing or invalid API key (send \"Authorization: Bearer KEY\")");
        return send_error(srv, c, method, url, &e, NULL);
    }
    if (cs->too_large) {
        td_api_error_set(&e, 413, "invalid_request_error", "", "",
                         "request body exceeds the limit of %zu bytes",
                         srv->p.limits.max_body_bytes);
        return send_error(srv, c, method, url, &e, NULL);
    }
    if (cs->oom) {
        td_api_error_set(&e, 500, "server_error", "", "", "out of memory");
        return send_error(srv, c, method, url, &e, NULL);
    }
    if (cs->r == R_NONE || (srv->p.internal_only && is_public(cs->r))) {
        td_api_error_set(&e, 404, "not_found_error", "", "", "no such endpoint: %s %.200s", method,
                         url);
        return send_error(srv, c, method, url, &e, NULL);
    }
    bool is_post = strcmp(method, MHD_HTTP_METHOD_POST) == 0;
    bool is_get =
        strcmp(method, MHD_HTTP_METHOD_GET) == 0 || strcmp(method, MHD_HTTP_METHOD_HEAD) == 0;
    if (cs->post ? !is_post : !is_get) {
        td_api_error_set(&e, 405, "invalid_request_error", "", "", "method %s is not allowed on %s",
                         method, url);
        return send_error(srv, c, method, url, &e, cs->post ? "POST" : "GET, HEAD");
    }
    switch (cs->r) {
    case R_COMPLETIONS: return handle_generate(srv, c, method, url, TD_API_COMPLETIONS, cs);
    case R_CHAT: return handle_generate(srv, c, method, url, TD_API_CHAT, cs);
    case R_MODELS: return handle_models(srv, c);
    case R_TOKENIZE: return handle_tokenize(srv, c, method, url, cs);
    case R_APPLY_TEMPLATE: return handle_apply_template(srv, c, method, url, cs);
    case R_DETOKENIZE: return handle_detokenize(srv, c, method, url, cs);
    case R_HEALTH: return queue_json(c, MHD_HTTP_OK, json_pack("{s:s}", "status", "ok"));
    case R_READY: {
        const char *why = td_api_not_ready(srv->p.sched, &srv->p.submit_hook);
        if (why) {
            td_api_error_set(&e, 503, "service_unavailable", "", "", "%s", why);
            return send_error(srv, c, method, url, &e, NULL);
        }
    }
        return queue_json(c, MHD_HTTP_OK, json_pack("{s:s}", "status", "ready"));
    case R_METRICS: return handle_metrics(srv, c, method, url);
    case R_STATE: return handle_state(srv, c, method, url);
    case R_EXCHANGE: return handle_exchange(srv, c, method, url);
    case R_CLUSTER: {
        char *js = srv->p.cluster_json ? srv->p.cluster_json(srv->p.internal_ctx) : NULL;
        if (!js) {
            td_api_error_set(&e, 404, "not_found_error", "", "",
                             "no cluster view here (not a router)");
            return send_error(srv, c, method, url, &e, NULL);
        }
        return queue_buf(c, MHD_HTTP_OK, js, strlen(js), "application/json");
    }
    case R_NONE: break;
    }
    return MHD_NO;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls) {
    TD_UNUSED(version);
    td_http_server *srv = cls;
    conn_state *cs = *con_cls;
    if (!cs) {
        cs = calloc(1, sizeof(*cs));
        if (!cs) return MHD_NO;
        *con_cls = cs;
        for (size_t i = 0; i < TD_ARRAY_SIZE(routes); i++)
            if (strcmp(url, routes[i].path) == 0) {
                cs->r = routes[i].r;
                cs->post = routes[i].post;
            }
        /* A client without a valid key gets its 401 after its body, which
         * is read and dropped (bounded) rather than stored. */
        bool open = cs->r == R_HEALTH || cs->r == R_READY ||
                    (cs->r == R_METRICS && !srv->p.metrics_need_key);
        cs->unauthorized = !open && !authorized(srv, c, cs->r);
        /* A body announced larger than the limit is refused before it is
         * read when the client waits for "100 Continue" (nothing is in
         * flight) or when reading it would be absurd; otherwise it is read
         * and dropped first, so the client is not reset mid-send and sees
         * the 413. */
        const char *cl =
            MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl) {
            char *end = NULL;
            errno = 0;
            unsigned long long v = strtoull(cl, &end, 10);
            if (!errno && end != cl && v > srv->p.limits.max_body_bytes) {
                const char *expect =
                    MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_EXPECT);
                cs->too_large = true;
                if ((expect && strcasecmp(expect, "100-continue") == 0) || v > drain_limit(srv)) {
                    cs->answered = true;
                    return dispatch(srv, c, method, url, cs);
                }
            }
        }
        return MHD_YES;
    }
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        if (cs->answered) return MHD_YES;
        if (cs->too_large || cs->oom || cs->unauthorized) {
            /* Discard the rest, up to a bound; past it, drop the connection. */
            cs->discarded += n;
            return cs->discarded > drain_limit(srv) ? MHD_NO : MHD_YES;
        }
        if (cs->len + n > srv->p.limits.max_body_bytes) {
            cs->too_large = true;
            cs->discarded = cs->len + n;
            free(cs->body);
            cs->body = NULL;
            cs->len = cs->cap = 0;
            return MHD_YES;
        }
        if (cs->len + n + 1 > cs->cap) {
            size_t cap = cs->cap ? cs->cap : 4096;
            while (cap < cs->len + n + 1) cap *= 2;
            char *b = realloc(cs->body, cap);
            if (!b) {
                cs->oom = true;
                return MHD_YES;
            }
            cs->body = b;
            cs->cap = cap;
        }
        memcpy(cs->body + cs->len, upload, n);
        cs->len += n;
        cs->body[cs->len] = 0;
        return MHD_YES;
    }
    if (cs->answered) return MHD_YES;
    return dispatch(srv, c, method, url, cs);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    TD_UNUSED(cls);
    TD_UNUSED(c);
    TD_UNUSED(toe);
    conn_state *cs = *con_cls;
    if (!cs) return;
    free(cs->body);
    free(cs);
    *con_cls = NULL;
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
    TD_UNUSED(cls);
    char msg[512];
    vsnprintf(msg, sizeof(msg), fmt, ap);
    size_t n = strlen(msg);
    while (n && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = 0;
    TD_LOG_INFO("libmicrohttpd: %s", msg);
}

/* --------------------------------------------------------------- lifetime */

static void server_free(td_http_server *srv) {
    if (!srv) return;
    for (int i = 0; i < srv->n_keys; i++) free(srv->keys[i]);
    free(srv->keys);
    free(srv->key_len);
    free(srv->host);
    free(srv->instance_id);
    free(srv->cluster_token);
    free(srv->model_name);
    free(srv);
}

td_status td_http_server_start(const td_http_params *p, td_http_server **srv_p) {
    if (!p || (!p->sched && !p->submit_hook.submit) || !p->model.tok || p->model.max_ctx <= 0 ||
        p->n_api_keys < 0) {
        TD_LOG_ERROR("invalid parameters (sched or submit_hook.submit, model.tok and "
                     "model.max_ctx are required)");
        return TD_ERR_INVALID;
    }
    td_status st = TD_ERR_NOMEM;
    td_http_server *srv = calloc(1, sizeof(*srv));
    if (!srv) goto fail;
    srv->p = *p;
    if (srv->p.limits.max_body_bytes == 0) srv->p.limits = td_api_default_limits();
    if (srv->p.max_connections <= 0) srv->p.max_connections = 1024;
    if (srv->p.max_header_bytes == 0) srv->p.max_header_bytes = 16 << 10;
    if (srv->p.kv_block_size <= 0) srv->p.kv_block_size = 16;
    srv->host = strdup(p->host ? p->host : "127.0.0.1");
    srv->cluster_token = p->cluster_token ? strdup(p->cluster_token) : NULL;
    srv->p.cluster_token = srv->cluster_token;
    /* The name comes from the model file: JSON needs it valid UTF-8. */
    const char *mn = p->model.model_name ? p->model.model_name : "model";
    size_t mn_len = 0;
    srv->model_name = td_api_utf8_fix(mn, strlen(mn), &mn_len);
    if (!srv->host || !srv->model_name || (p->cluster_token && !srv->cluster_token)) goto fail;
    srv->p.host = srv->host;
    srv->p.model.model_name = srv->model_name;
    srv->n_vocab = td_tokenizer_n_vocab(p->model.tok);
    if (p->n_api_keys > 0) {
        srv->keys = calloc((size_t)p->n_api_keys, sizeof(char *));
        srv->key_len = calloc((size_t)p->n_api_keys, sizeof(size_t));
        if (!srv->keys || !srv->key_len) goto fail;
        for (int i = 0; i < p->n_api_keys; i++) {
            srv->keys[i] = strdup(p->api_keys[i] ? p->api_keys[i] : "");
            if (!srv->keys[i]) goto fail;
            srv->key_len[i] = strlen(srv->keys[i]);
            srv->n_keys = i + 1;
        }
    }
    srv->p.api_keys = NULL;

    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    char port_s[16];
    snprintf(port_s, sizeof(port_s), "%d", p->port);
    int gai = getaddrinfo(srv->host, port_s, &hints, &ai);
    if (gai != 0 || !ai) {
        TD_LOG_ERROR("cannot resolve host '%s': %s", srv->host, gai_strerror(gai));
        st = TD_ERR_IO;
        goto fail;
    }
    struct sockaddr_storage addr;
    memcpy(&addr, ai->ai_addr, TD_MIN((size_t)ai->ai_addrlen, sizeof(addr)));
    bool v6 = ai->ai_family == AF_INET6;
    freeaddrinfo(ai);

    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
                     MHD_USE_ERROR_LOG | (v6 ? MHD_USE_DUAL_STACK : 0);
    srv->d = MHD_start_daemon(flags, (uint16_t)p->port, NULL, NULL, on_request, srv,
                              MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, srv, MHD_OPTION_SOCK_ADDR,
                              (struct sockaddr *)&addr, MHD_OPTION_CONNECTION_LIMIT,
                              (unsigned)srv->p.max_connections, MHD_OPTION_CONNECTION_MEMORY_LIMIT,
                              srv->p.max_header_bytes, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)120,
                              MHD_OPTION_NOTIFY_COMPLETED, on_completed, srv, MHD_OPTION_END);
    if (!srv->d) {
        TD_LOG_ERROR("cannot listen on %s:%d: %s", srv->host, p->port, strerror(errno));
        st = TD_ERR_IO;
        goto fail;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(srv->d, MHD_DAEMON_INFO_LISTEN_FD);
    struct sockaddr_storage bound;
    socklen_t bl = sizeof(bound);
    if (info && getsockname(info->listen_fd, (struct sockaddr *)&bound, &bl) == 0)
        srv->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                      : ((struct sockaddr_in *)&bound)->sin_port);
    else
        srv->port = p->port;

    char id[300];
    if (p->instance_id)
        snprintf(id, sizeof(id), "%s", p->instance_id);
    else
        snprintf(id, sizeof(id), v6 ? "[%s]:%d" : "%s:%d", srv->host, srv->port);
    size_t id_len = 0;
    srv->instance_id = td_api_utf8_fix(id, td_api_utf8_complete_len(id, strlen(id)), &id_len);
    if (!srv->instance_id) {
        st = TD_ERR_NOMEM;
        goto fail;
    }
    srv->p.instance_id = srv->instance_id;
    *srv_p = srv;
    return TD_OK;

fail:
    if (st == TD_ERR_NOMEM) TD_LOG_ERROR("out of memory");
    if (srv && srv->d) MHD_stop_daemon(srv->d);
    server_free(srv);
    return st;
}

void td_http_server_stop(td_http_server *srv) {
    if (!srv) return;
    /* Closes every connection (shutting their sockets down, which wakes the
     * threads waiting in job_wait: their requests are cancelled) and joins
     * the connection threads, so no stream outlives this call. */
    MHD_stop_daemon(srv->d);
    server_free(srv);
}
