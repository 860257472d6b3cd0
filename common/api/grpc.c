/* The gRPC front end on the gRPC C core.
 *
 * Three threads. The completion-queue thread owns every call's life: it
 * accepts calls, answers Abort and health calls and handles every batch
 * completion. The prepare thread parses, validates and tokenizes Generate
 * requests and submits them to the scheduler, so a large prompt does not
 * hold up other calls' completions. The pump thread waits (epoll)
 * on the eventfds of the generation streams, turns their news into
 * GenerateResponse messages and starts the send batches, and also re-sends
 * health Watch statuses when draining begins. A call's mutable state is
 * guarded by its mutex (which also serialises grpc_call_start_batch on the
 * call, as the core asks); the server mutex guards the list of live calls
 * (the request-id table Abort searches) and the list of finished calls.
 * Lock order: server, then call.
 *
 * A call ends when its RECV_CLOSE_ON_SERVER batch has completed (status sent,
 * or the call was cancelled: client cancel, deadline, shutdown) and no other
 * batch, nor its preparation, is in flight. Whichever thread sees that hands
 * the call to the pump thread, which alone removes it from epoll and frees
 * it, so an epoll event never points at freed memory. */
#include "grpc.h"

#include <errno.h>
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "proto/health.pb-c.h"
#include "proto/internal.pb-c.h"
#include "proto/tandem.pb-c.h"
#include "request-impl.h"
#include "sampling.h"

/* Calls asked of the core ahead of their arrival, so a burst is accepted
 * without waiting for the thread to ask again. */
#define N_REQUESTED_CALLS 8
#define WATCH_POLL_MS     200
/* How long td_grpc_server_stop waits for ended generations to reach their
 * clients before cancelling what is left. */
#define STOP_GRACE_S 2

typedef enum {
    CALL_UNKNOWN = 0,
    CALL_GENERATE,
    CALL_ABORT,
    CALL_HEALTH_CHECK,
    CALL_HEALTH_WATCH,
} call_kind;

typedef enum { TAG_NEW, TAG_RECV, TAG_SEND, TAG_CLOSE } tag_kind;

typedef struct gcall gcall;

typedef struct {
    gcall *c;
    tag_kind kind;
} gtag;

/* Encoded messages waiting for the previous send to complete (one SEND_MESSAGE
 * per batch); at most a chunk, a final message, and slack. */
#define SEND_QUEUE_CAP 4

struct gcall {
    td_grpc_server *srv;
    pthread_mutex_t mu;
    grpc_call *call;
    grpc_call_details details;
    grpc_metadata_array md;
    gtag tag_new, tag_recv, tag_send, tag_close;
    call_kind kind;
    grpc_byte_buffer *recv_buf;
    grpc_byte_buffer *send_buf; /* owned until its batch completes */
    int cancelled;              /* out-argument of RECV_CLOSE_ON_SERVER */
    int n_pending;              /* batches started and not completed, + a queued preparation */
    bool closed;                /* RECV_CLOSE_ON_SERVER completed */
    bool stop_sending;          /* cancelled, or a send failed */
    bool initial_md_sent;
    bool status_started; /* the batch with the final status is out: nothing more to send */
    bool send_in_flight;
    bool in_epoll; /* stream fd registered (EPOLLONESHOT) */
    bool dead;     /* handed to the pump thread to be freed */
    /* Final status, sent with (or after) the last queued message. */
    bool final_ready;
    grpc_status_code final_code;
    char final_details[512];
    grpc_byte_buffer *queue[SEND_QUEUE_CAP];
    int n_queue;
    /* Generate. */
    td_api_request req; /* kept for the stop strings the Complete message names */
    td_gen_stream *stream;
    char request_id[128];
    bool internal;           /* tandem.internal.v1.Decode/Generate (the router's) */
    char route_prefill[256]; /* its choice of prefill instance, or "" */
    bool route_local;
    bool registered;    /* request_id is in the table (the live list) */
    bool stream_done;   /* the stream reported finished */
    char utf8_carry[8]; /* an incomplete UTF-8 character held for the next chunk */
    int n_utf8_carry;
    /* Health Watch. */
    char *watch_service;
    int watch_sent; /* last status sent, -1: none */
    /* Lists (server mutex). */
    gcall *prev, *next; /* live list */
    gcall *zombie_next;
    /* Preparation queue (its own mutex). */
    grpc_slice prep_msg; /* the GenerateRequest bytes */
    gcall *prep_next;
};

struct td_grpc_server {
    td_sched *sched;
    td_api_submit_hook submit_hook;
    td_metrics *metrics;
    td_api_model model;
    char *model_name;
    td_api_limits limits;
    char **api_keys;
    size_t *api_key_lens;
    int n_api_keys;
    char *cluster_token; /* NULL: no internal Generate */
    int32_t n_vocab;

    grpc_server *server;
    grpc_completion_queue *cq;
    int port;
    int shutdown_tag; /* its address is the tag */
    atomic_bool stopping;

    pthread_mutex_t mu;
    pthread_cond_t retired; /* signalled whenever a call leaves the live list */
    gcall live;             /* sentinel of the live list */
    gcall *zombies;
    atomic_uint_fast64_t next_id;
    uint64_t id_salt;

    int epfd;
    int wakefd;
    atomic_bool pump_stop;

    pthread_mutex_t prep_mu;
    pthread_cond_t prep_cv;
    gcall *prep_head, *prep_tail;
    bool prep_stop;

    pthread_t cq_thread, pump_thread, prep_thread;
    bool grpc_inited, cq_thread_started, pump_thread_started, prep_thread_started;
};

/* ---- small helpers ---- */

static grpc_status_code status_from_http(int http_status) {
    switch (http_status) {
    case 400: return GRPC_STATUS_INVALID_ARGUMENT;
    case 401: return GRPC_STATUS_UNAUTHENTICATED;
    case 403: return GRPC_STATUS_PERMISSION_DENIED;
    case 404: return GRPC_STATUS_NOT_FOUND;
    case 409: return GRPC_STATUS_ALREADY_EXISTS;
    case 413:
    case 429: return GRPC_STATUS_RESOURCE_EXHAUSTED;
    case 503: return GRPC_STATUS_UNAVAILABLE;
    case 500: return GRPC_STATUS_INTERNAL;
    default: return GRPC_STATUS_UNKNOWN;
    }
}

static bool slice_eq(grpc_slice s, const char *str) {
    size_t n = strlen(str);
    return GRPC_SLICE_LENGTH(s) == n && memcmp(GRPC_SLICE_START_PTR(s), str, n) == 0;
}

/* Encodes a protobuf-c message into a new byte buffer (caller destroys);
 * NULL when out of memory. */
static grpc_byte_buffer *pack_message(const ProtobufCMessage *m) {
    size_t n = protobuf_c_message_get_packed_size(m);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf) return NULL;
    protobuf_c_message_pack(m, buf);
    grpc_slice s = grpc_slice_new(buf, n, free);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

/* The text of a delta as the client may see it, exactly as the HTTP API
 * streams it (request-impl.h): whole UTF-8 characters only, a split tail
 * carried to the next delta (and repaired at the end), ill-formed bytes as
 * U+FFFD. NUL becomes U+FFFD too, since protobuf-c packs a string up to its
 * first NUL. Returns a malloc'd NUL-terminated string, NULL when out of
 * memory. */
static char *take_text(gcall *c, const char *t, size_t n, bool final) {
    size_t total = (size_t)c->n_utf8_carry + n;
    char *buf = malloc(total + 1);
    if (!buf) return NULL;
    memcpy(buf, c->utf8_carry, (size_t)c->n_utf8_carry);
    if (n) memcpy(buf + c->n_utf8_carry, t, n);
    size_t keep = final ? total : td_api_utf8_complete_len(buf, total);
    size_t tail = total - keep;
    TD_ASSERT(tail < sizeof(c->utf8_carry));
    memcpy(c->utf8_carry, buf + keep, tail);
    c->n_utf8_carry = (int)tail;
    size_t len = 0;
    char *fixed = td_api_utf8_fix(buf, keep, &len);
    free(buf);
    if (!fixed || !memchr(fixed, '\0', len)) return fixed;
    size_t n_nul = 0;
    for (size_t i = 0; i < len; i++) n_nul += fixed[i] == '\0';
    char *out = malloc(len + 2 * n_nul + 1);
    if (out) {
        size_t o = 0;
        for (size_t i = 0; i < len; i++) {
            if (fixed[i] == '\0') {
                memcpy(out + o, "\xEF\xBF\xBD", 3);
                o += 3;
            } else {
                out[o++] = fixed[i];
            }
        }
        out[o] = '\0';
    }
    free(fixed);
    return out;
}

/* ---- batches (call mutex held) ---- */

static void start_batch_locked(gcall *c, const grpc_op *ops, size_t n, gtag *tag) {
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, tag, NULL);
    /* The batches here are well formed by construction; the core refusing one
     * is a bug, not input. */
    TD_ASSERT(e == GRPC_CALL_OK);
    c->n_pending++;
}

/* Sends the next queued message, with the final status when it is the last
 * one (or the status alone when nothing is queued). */
static void send_next_locked(gcall *c) {
    if (c->send_in_flight || c->status_started || c->stop_sending) return;
    grpc_op ops[3];
    size_t n = 0;
    memset(ops, 0, sizeof(ops));
    grpc_byte_buffer *bb = NULL;
    bool with_status = c->final_ready && c->n_queue <= 1;
    if (c->n_queue == 0 && !with_status) return;
    /* The core sends nothing, not even a status, on a call whose initial
     * metadata was never sent. */
    if (!c->initial_md_sent) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        n++;
        c->initial_md_sent = true;
    }
    if (c->n_queue > 0) {
        bb = c->queue[0];
        memmove(c->queue, c->queue + 1, (size_t)(c->n_queue - 1) * sizeof(c->queue[0]));
        c->n_queue--;
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = bb;
        n++;
    }
    grpc_slice details = grpc_empty_slice();
    if (with_status) {
        details = grpc_slice_from_copied_string(c->final_details);
        ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[n].data.send_status_from_server.status = c->final_code;
        ops[n].data.send_status_from_server.status_details = c->final_details[0] ? &details : NULL;
        n++;
        c->status_started = true;
    }
    c->send_buf = bb;
    c->send_in_flight = true;
    start_batch_locked(c, ops, n, &c->tag_send);
    grpc_slice_unref(details); /* not retained past start_batch */
}

static void queue_message_locked(gcall *c, const ProtobufCMessage *m) {
    TD_ASSERT(c->n_queue < SEND_QUEUE_CAP);
    grpc_byte_buffer *bb = pack_message(m);
    if (!bb) {
        /* Out of memory: end the call rather than stream a hole. */
        if (!c->final_ready) {
            c->final_ready = true;
            c->final_code = GRPC_STATUS_RESOURCE_EXHAUSTED;
            snprintf(c->final_details, sizeof(c->final_details), "out of memory");
        }
        return;
    }
    c->queue[c->n_queue++] = bb;
}

static void finish_locked(gcall *c, grpc_status_code code, const char *details) {
    if (c->final_ready) return;
    c->final_ready = true;
    c->final_code = code;
    snprintf(c->final_details, sizeof(c->final_details), "%s", details ? details : "");
}

/* Ends a call before any stream started: one error status (and a metrics
 * count for Generate and Abort). */
static void reply_error_locked(gcall *c, const td_api_error *err) {
    td_grpc_server *srv = c->srv;
    if (srv->metrics) td_metrics_request_error(srv->metrics, err->http_status, err->type);
    TD_LOG_INFO("gRPC %s rejected (%d %s): %s",
                c->kind == CALL_GENERATE ? "Generate"
                : c->kind == CALL_ABORT  ? "Abort"
                                         : "call",
                err->http_status, err->type, err->message);
    finish_locked(c, status_from_http(err->http_status), err->message);
    send_next_locked(c);
}

static void reply_status_locked(gcall *c, grpc_status_code code, const char *details) {
    finish_locked(c, code, details);
    send_next_locked(c);
}

/* ---- epoll (call mutex held) ---- */

static void arm_locked(gcall *c) {
    struct epoll_event ev = {.events = EPOLLIN | EPOLLONESHOT, .data.ptr = c};
    int fd = td_gen_stream_fd(c->stream);
    int r = epoll_ctl(c->srv->epfd, c->in_epoll ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, fd, &ev);
    if (r != 0) {
        /* Only ENOMEM-like failures are possible for a valid eventfd. */
        TD_LOG_ERROR("epoll_ctl(stream fd): %s", strerror(errno));
        td_gen_stream_cancel(c->stream);
        finish_locked(c, GRPC_STATUS_INTERNAL, "server error: cannot wait on the stream");
        send_next_locked(c);
        return;
    }
    c->in_epoll = true;
}

/* ---- Generate: stream news -> messages ---- */

static void queue_chunk_locked(gcall *c, const td_gen_delta *d, bool final) {
    Tandem__V1__TokenLogprob *lps = NULL, **lpp = NULL;
    Tandem__V1__TopLogprob *tops = NULL, **topp = NULL;
    char *text = take_text(c, d->text ? d->text : "", d->text_len, final);
    if (!text) goto nomem;
    if (d->n_tokens == 0 && text[0] == '\0') goto cleanup;

    Tandem__V1__Chunk chunk = TANDEM__V1__CHUNK__INIT;
    chunk.n_token_ids = (size_t)d->n_tokens;
    chunk.token_ids = (int32_t *)d->tokens;
    chunk.text = text;
    if (d->logprobs && d->n_tokens > 0) {
        size_t nt = (size_t)d->n_tokens;
        size_t n_top = 0;
        for (size_t i = 0; i < nt; i++) n_top += (size_t)TD_MAX(d->logprobs[i].n_top, 0);
        lps = calloc(nt, sizeof(*lps));
        lpp = calloc(nt, sizeof(*lpp));
        tops = calloc(n_top ? n_top : 1, sizeof(*tops));
        topp = calloc(n_top ? n_top : 1, sizeof(*topp));
        if (!lps || !lpp || !tops || !topp) goto nomem;
        size_t t = 0;
        for (size_t i = 0; i < nt; i++) {
            const td_sample_result *r = &d->logprobs[i];
            tandem__v1__token_logprob__init(&lps[i]);
            lps[i].token_id = r->token;
            lps[i].logprob = r->logprob;
            lps[i].top_logprobs = topp + t;
            for (int32_t k = 0; k < r->n_top && k < TD_SAMPLER_MAX_LOGPROBS; k++, t++) {
                tandem__v1__top_logprob__init(&tops[t]);
                tops[t].token_id = r->top[k].token;
                tops[t].logprob = r->top[k].logprob;
                topp[t] = &tops[t];
                lps[i].n_top_logprobs++;
            }
            lpp[i] = &lps[i];
        }
        chunk.n_logprobs = nt;
        chunk.logprobs = lpp;
    }
    Tandem__V1__GenerateResponse resp = TANDEM__V1__GENERATE_RESPONSE__INIT;
    resp.request_id = c->request_id;
    resp.response_case = TANDEM__V1__GENERATE_RESPONSE__RESPONSE_CHUNK;
    resp.chunk = &chunk;
    queue_message_locked(c, &resp.base);
    goto cleanup;
nomem:
    finish_locked(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
cleanup:
    free(topp);
    free(tops);
    free(lpp);
    free(lps);
    free(text);
}

static void queue_end_locked(gcall *c, const td_gen_delta *d) {
    Tandem__V1__GenerateResponse resp = TANDEM__V1__GENERATE_RESPONSE__INIT;
    resp.request_id = c->request_id;
    if (d->finish == TD_FINISH_ERROR) {
        td_api_error e;
        td_api_error_from_status(&e, d->error != TD_OK ? d->error : TD_ERR_INTERNAL, "generation");
        if (d->error_message) snprintf(e.message, sizeof e.message, "%s", d->error_message);
        Tandem__V1__Error err = TANDEM__V1__ERROR__INIT;
        err.message = e.message;
        err.type = e.type;
        err.code = e.code;
        err.http_status = e.http_status;
        resp.response_case = TANDEM__V1__GENERATE_RESPONSE__RESPONSE_ERROR;
        resp.error = &err;
        if (c->srv->metrics) td_metrics_request_error(c->srv->metrics, e.http_status, e.type);
        queue_message_locked(c, &resp.base);
        finish_locked(c, status_from_http(e.http_status), e.message);
        return;
    }
    Tandem__V1__Complete done = TANDEM__V1__COMPLETE__INIT;
    const char *reason = td_finish_reason_str(d->finish);
    done.finish_reason = (char *)(reason ? reason : "abort");
    done.prompt_tokens = (uint32_t)TD_MAX(d->n_prompt_tokens, 0);
    done.completion_tokens = (uint32_t)TD_MAX(d->n_output_tokens, 0);
    done.cached_tokens = (uint32_t)TD_MAX(d->n_cached_tokens, 0);
    if (d->finish == TD_FINISH_STOP) {
        if (d->stop_index >= 0 && d->stop_index < c->req.n_stop) {
            done.stop_reason_case = TANDEM__V1__COMPLETE__STOP_REASON_STOP_STR;
            done.stop_str = c->req.stop[d->stop_index];
        } else if (d->stop_token >= 0) {
            done.stop_reason_case = TANDEM__V1__COMPLETE__STOP_REASON_STOP_TOKEN_ID;
            done.stop_token_id = d->stop_token;
        }
    }
    resp.response_case = TANDEM__V1__GENERATE_RESPONSE__RESPONSE_COMPLETE;
    resp.complete = &done;
    queue_message_locked(c, &resp.base);
    finish_locked(c, GRPC_STATUS_OK, NULL);
}

/* Moves the stream's news into messages and keeps one send in flight; arms
 * the stream's fd when there is nothing to read. */
static void generate_pump_locked(gcall *c) {
    while (!c->dead && !c->stop_sending && !c->status_started) {
        if (c->send_in_flight) return;
        if (c->n_queue > 0 || c->final_ready) {
            send_next_locked(c);
            return;
        }
        if (c->stream_done) return;
        td_gen_delta d;
        td_status st = td_gen_stream_read(c->stream, 0, &d);
        if (st == TD_AGAIN) {
            arm_locked(c);
            return;
        }
        if (st != TD_OK) {
            TD_LOG_ERROR("stream read for %s: %s", c->request_id, td_status_str(st));
            finish_locked(c, GRPC_STATUS_INTERNAL, "server error: stream read failed");
            continue;
        }
        queue_chunk_locked(c, &d, d.finished);
        if (d.finished) {
            c->stream_done = true;
            queue_end_locked(c, &d);
        }
    }
}

/* ---- request handling (Generate: prepare thread; others: completion-queue thread) ---- */

static bool auth_ok(const td_grpc_server *srv, const grpc_metadata_array *md) {
    if (srv->n_api_keys == 0) return true;
    for (size_t i = 0; i < md->count; i++) {
        if (!slice_eq(md->metadata[i].key, "authorization")) continue;
        const char *v = (const char *)GRPC_SLICE_START_PTR(md->metadata[i].value);
        size_t n = GRPC_SLICE_LENGTH(md->metadata[i].value);
        if (n < 7 || strncasecmp(v, "Bearer ", 7) != 0) return false;
        v += 7, n -= 7;
        bool ok = false;
        for (int k = 0; k < srv->n_api_keys; k++)
            ok |= td_secret_eq(srv->api_keys[k], srv->api_key_lens[k], v, n);
        return ok;
    }
    return false;
}

/* GenerateRequest -> the OpenAI JSON body it stands for, so that one parser
 * (request.h) applies the same rules to HTTP and gRPC. *body_p malloc'd. */
static bool request_to_json(const Tandem__V1__GenerateRequest *r, td_api_kind *kind_p,
                            char **body_p, td_api_error *err) {
    json_t *o = json_object();
    bool ok = false;
    td_api_kind kind = TD_API_COMPLETIONS;
    if (!o) goto nomem;
    if (r->model && r->model[0] && !td_json_put_string(o, "model", r->model, err)) goto done;
    switch (r->input_case) {
    case TANDEM__V1__GENERATE_REQUEST__INPUT_TEXT:
        if (!td_json_put_string(o, "prompt", r->text ? r->text : "", err)) goto done;
        break;
    case TANDEM__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS:
        if (!td_json_put_int_array(o, "prompt", r->token_ids ? r->token_ids->ids : NULL,
                                   r->token_ids ? r->token_ids->n_ids : 0, err))
            goto done;
        break;
    case TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT: {
        kind = TD_API_CHAT;
        json_t *msgs = json_array();
        if (!msgs || json_object_set_new(o, "messages", msgs) != 0) goto nomem;
        for (size_t i = 0; r->chat && i < r->chat->n_messages; i++) {
            json_t *m = json_object();
            if (!m || json_array_append_new(msgs, m) != 0) goto nomem;
            const Tandem__V1__ChatMessage *cm = r->chat->messages[i];
            if (!td_json_put_string(m, "role", cm->role ? cm->role : "", err) ||
                !td_json_put_string(m, "content", cm->content ? cm->content : "", err)) {
                snprintf(err->param, sizeof(err->param), "messages");
                goto done;
            }
        }
        if (r->chat &&
            r->chat->_add_generation_prompt_case ==
                TANDEM__V1__CHAT___ADD_GENERATION_PROMPT_ADD_GENERATION_PROMPT &&
            !td_json_put_bool(o, "add_generation_prompt", r->chat->add_generation_prompt, err))
            goto done;
        break;
    }
    default:
        td_api_error_set(err, 400, "invalid_request_error", NULL, "input",
                         "one of text, token_ids or chat is required");
        goto done;
    }
    if (!td_sampling_to_json(r->sampling, kind, o, err)) goto done;
    char *body = json_dumps(o, JSON_COMPACT);
    if (!body) goto nomem;
    *body_p = body;
    *kind_p = kind;
    ok = true;
    goto done;
nomem:
    td_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
done:
    json_decref(o);
    return ok;
}

/* Under the server mutex: is another live Generate running with this id? */
static bool id_in_use(td_grpc_server *srv, const char *id) {
    for (gcall *o = srv->live.next; o != &srv->live; o = o->next) {
        if (o->kind != CALL_GENERATE || !o->registered || strcmp(o->request_id, id) != 0) continue;
        pthread_mutex_lock(&o->mu);
        bool running = !o->stream_done && !o->closed;
        pthread_mutex_unlock(&o->mu);
        if (running) return true;
    }
    return false;
}

static void handle_generate(gcall *c, const uint8_t *data, size_t len) {
    td_grpc_server *srv = c->srv;
    td_api_error err;
    memset(&err, 0, sizeof(err));
    Tandem__V1__GenerateRequest *r = NULL;
    Tandem__Internal__V1__InternalGenerate *ig = NULL;
    char *body = NULL;
    int32_t *tokens = NULL;
    td_gen_stream *stream = NULL;
    double t_arrival = td_time_s();

    if (c->internal) {
        /* the router's request: the cluster token travels in the message */
        ig = tandem__internal__v1__internal_generate__unpack(NULL, len, data);
        if (!ig || !ig->request) {
            td_api_error_set(&err, 400, "invalid_request_error", NULL, NULL,
                             "malformed InternalGenerate message");
            goto fail;
        }
        if (!td_secret_eq(srv->cluster_token, strlen(srv->cluster_token),
                          (const char *)ig->cluster_token.data, ig->cluster_token.len)) {
            td_api_error_set(&err, 401, "authentication_error", "invalid_cluster_token", NULL,
                             "missing or invalid cluster token");
            goto fail;
        }
        if (ig->prefill_case == TANDEM__INTERNAL__V1__INTERNAL_GENERATE__PREFILL_LOCAL_PREFILL)
            c->route_local = ig->local_prefill;
        if (ig->prefill_case == TANDEM__INTERNAL__V1__INTERNAL_GENERATE__PREFILL_PREFILL_INSTANCE) {
            const char *pi = ig->prefill_instance;
            size_t n_pi = strlen(pi);
            bool ok = n_pi > 0 && n_pi < sizeof c->route_prefill && strchr(pi, ':');
            for (size_t i = 0; ok && i < n_pi; i++) ok = pi[i] > 0x20 && pi[i] < 0x7f;
            if (!ok) {
                td_api_error_set(&err, 400, "invalid_request_error", NULL, "prefill_instance",
                                 "prefill_instance must be HOST:PORT");
                goto fail;
            }
            snprintf(c->route_prefill, sizeof c->route_prefill, "%s", pi);
        }
    } else if (!auth_ok(srv, &c->md)) {
        td_api_error_set(&err, 401, "authentication_error", "invalid_api_key", NULL,
                         "missing or invalid API key");
        goto fail;
    }
    if (ig) {
        /* the inner request, re-read as a message of its own */
        size_t n = protobuf_c_message_get_packed_size(&ig->request->base);
        uint8_t *buf = malloc(n ? n : 1);
        if (buf) {
            protobuf_c_message_pack(&ig->request->base, buf);
            r = tandem__v1__generate_request__unpack(NULL, n, buf);
        }
        free(buf);
        tandem__internal__v1__internal_generate__free_unpacked(ig, NULL);
        ig = NULL;
    } else {
        r = tandem__v1__generate_request__unpack(NULL, len, data);
    }
    if (!r) {
        td_api_error_set(&err, 400, "invalid_request_error", NULL, NULL,
                         "malformed GenerateRequest message");
        goto fail;
    }
    if (r->request_id && r->request_id[0]) {
        /* It goes into logs, metrics ids and responses: short printable
         * ASCII only (no newline can forge a log line, no invalid UTF-8
         * can break a client's decoding). */
        size_t n_id = strlen(r->request_id);
        bool printable = true;
        for (size_t i = 0; i < n_id; i++)
            if (r->request_id[i] < 0x21 || r->request_id[i] > 0x7e) printable = false;
        if (n_id > 63 || !printable) {
            td_api_error_set(&err, 400, "invalid_request_error", NULL, "request_id",
                             "request_id must be 1 to 63 printable ASCII characters, no spaces");
            goto fail;
        }
        snprintf(c->request_id, sizeof(c->request_id), "%s", r->request_id);
    } else {
        uint64_t n = atomic_fetch_add(&srv->next_id, 1);
        snprintf(c->request_id, sizeof(c->request_id), "grpc-%016llx",
                 (unsigned long long)(srv->id_salt ^ (n * 0x9E3779B97F4A7C15ull)));
    }
    td_api_kind kind;
    if (!request_to_json(r, &kind, &body, &err)) goto fail;
    /* The gRPC core already bounds the message size; the JSON spelling of a
     * message is larger than the message, so the body limit does not apply. */
    td_api_limits lim = srv->limits;
    lim.max_body_bytes = SIZE_MAX;
    if (td_api_request_parse(kind, body, strlen(body), &lim, srv->n_vocab, &c->req, &err) != TD_OK)
        goto fail;
    int32_t n_tokens = 0, max_tokens = 0;
    if (td_api_request_tokens(&srv->model, &c->req, 0, &tokens, &n_tokens, &max_tokens, &err) !=
        TD_OK)
        goto fail;
    td_gen_request g;
    td_api_request_to_gen(&c->req, tokens, n_tokens, max_tokens, 0, &g);
    g.id = c->request_id;
    g.t_arrival = t_arrival;
    g.route_local = c->route_local;
    g.route_prefill = c->route_prefill[0] ? c->route_prefill : NULL;

    /* Check the id and register the call in one step under the server
     * mutex, so two calls cannot both take an id. */
    pthread_mutex_lock(&srv->mu);
    if (atomic_load(&srv->stopping)) {
        pthread_mutex_unlock(&srv->mu);
        td_api_error_set(&err, 503, "service_unavailable", NULL, NULL,
                         "the server is shutting down");
        goto fail;
    }
    if (id_in_use(srv, c->request_id)) {
        pthread_mutex_unlock(&srv->mu);
        td_api_error_set(&err, 409, "invalid_request_error", NULL, "request_id",
                         "a request with id '%s' is running", c->request_id);
        goto fail;
    }
    td_status st = td_api_submit(srv->sched, &srv->submit_hook, &g, &stream);
    if (st == TD_OK) {
        /* Listed with its stream at once, so Abort and a stop find it. */
        pthread_mutex_lock(&c->mu);
        c->stream = stream;
        c->registered = true;
        pthread_mutex_unlock(&c->mu);
    }
    pthread_mutex_unlock(&srv->mu);
    if (st != TD_OK) {
        td_api_error_from_status(&err, st, "submit");
        goto fail;
    }
    free(tokens);
    free(body);
    tandem__v1__generate_request__free_unpacked(r, NULL);

    pthread_mutex_lock(&c->mu);
    if (c->stop_sending) td_gen_stream_cancel(stream); /* cancelled while we prepared */
    generate_pump_locked(c);
    pthread_mutex_unlock(&c->mu);
    return;

fail:
    free(tokens);
    free(body);
    if (ig) tandem__internal__v1__internal_generate__free_unpacked(ig, NULL);
    if (r) tandem__v1__generate_request__free_unpacked(r, NULL);
    pthread_mutex_lock(&c->mu);
    reply_error_locked(c, &err);
    pthread_mutex_unlock(&c->mu);
}

static void handle_abort(gcall *c, const uint8_t *data, size_t len) {
    td_grpc_server *srv = c->srv;
    td_api_error err;
    memset(&err, 0, sizeof(err));
    if (!auth_ok(srv, &c->md)) {
        td_api_error_set(&err, 401, "authentication_error", "invalid_api_key", NULL,
                         "missing or invalid API key");
        goto fail;
    }
    Tandem__V1__AbortRequest *r = tandem__v1__abort_request__unpack(NULL, len, data);
    if (!r) {
        td_api_error_set(&err, 400, "invalid_request_error", NULL, NULL,
                         "malformed AbortRequest message");
        goto fail;
    }
    bool found = false;
    if (r->request_id && r->request_id[0]) {
        pthread_mutex_lock(&srv->mu);
        for (gcall *o = srv->live.next; o != &srv->live; o = o->next) {
            if (o->kind != CALL_GENERATE || !o->registered ||
                strcmp(o->request_id, r->request_id) != 0)
                continue;
            pthread_mutex_lock(&o->mu);
            if (o->stream && !o->stream_done && !o->closed) {
                td_gen_stream_cancel(o->stream);
                found = true;
            }
            pthread_mutex_unlock(&o->mu);
        }
        pthread_mutex_unlock(&srv->mu);
    }
    if (found) TD_LOG_INFO("gRPC Abort: cancelled %s", r->request_id);
    tandem__v1__abort_request__free_unpacked(r, NULL);

    Tandem__V1__AbortResponse resp = TANDEM__V1__ABORT_RESPONSE__INIT;
    resp.found = found;
    pthread_mutex_lock(&c->mu);
    queue_message_locked(c, &resp.base);
    reply_status_locked(c, GRPC_STATUS_OK, NULL);
    pthread_mutex_unlock(&c->mu);
    return;
fail:
    pthread_mutex_lock(&c->mu);
    reply_error_locked(c, &err);
    pthread_mutex_unlock(&c->mu);
}

/* SERVING, NOT_SERVING while draining, or SERVICE_UNKNOWN for a name this
 * server does not serve ("" is the server as a whole). */
static Grpc__Health__V1__HealthCheckResponse__ServingStatus health_status(td_grpc_server *srv,
                                                                          const char *service) {
    if (service[0] && strcmp(service, "tandem.v1.Generate") != 0)
        return GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN;
    if (atomic_load(&srv->stopping) || td_api_not_ready(srv->sched, &srv->submit_hook))
        return GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
    return GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
}

static void queue_health_locked(gcall *c, int status) {
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = (Grpc__Health__V1__HealthCheckResponse__ServingStatus)status;
    queue_message_locked(c, &resp.base);
    c->watch_sent = status;
}

static void handle_health(gcall *c, const uint8_t *data, size_t len) {
    td_grpc_server *srv = c->srv;
    Grpc__Health__V1__HealthCheckRequest *r =
        grpc__health__v1__health_check_request__unpack(NULL, len, data);
    pthread_mutex_lock(&c->mu);
    if (!r) {
        reply_status_locked(c, GRPC_STATUS_INVALID_ARGUMENT, "malformed HealthCheckRequest");
        goto done;
    }
    int status = health_status(srv, r->service ? r->service : "");
    if (c->kind == CALL_HEALTH_CHECK) {
        if (status == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN) {
            reply_status_locked(c, GRPC_STATUS_NOT_FOUND, "unknown service");
        } else {
            queue_health_locked(c, status);
            reply_status_locked(c, GRPC_STATUS_OK, NULL);
        }
    } else {
        c->watch_service = strdup(r->service ? r->service : "");
        if (!c->watch_service) {
            reply_status_locked(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
            goto done;
        }
        queue_health_locked(c, status);
        send_next_locked(c);
    }
done:
    pthread_mutex_unlock(&c->mu);
    if (r) grpc__health__v1__health_check_request__free_unpacked(r, NULL);
}

static bool finished_locked(gcall *c);
static void retire(gcall *c);

/* Hands a Generate request to the prepare thread. The preparation counts as
 * a pending operation, so the call outlives it whatever the client does. */
static void prep_enqueue(gcall *c, grpc_slice msg) {
    td_grpc_server *srv = c->srv;
    pthread_mutex_lock(&c->mu);
    c->n_pending++;
    pthread_mutex_unlock(&c->mu);
    c->prep_msg = msg;
    c->prep_next = NULL;
    pthread_mutex_lock(&srv->prep_mu);
    if (srv->prep_tail)
        srv->prep_tail->prep_next = c;
    else
        srv->prep_head = c;
    srv->prep_tail = c;
    pthread_cond_signal(&srv->prep_cv);
    pthread_mutex_unlock(&srv->prep_mu);
}

static void *prep_main(void *arg) {
    td_grpc_server *srv = arg;
    for (;;) {
        pthread_mutex_lock(&srv->prep_mu);
        while (!srv->prep_head && !srv->prep_stop) pthread_cond_wait(&srv->prep_cv, &srv->prep_mu);
        gcall *c = srv->prep_head;
        if (c) {
            srv->prep_head = c->prep_next;
            if (!srv->prep_head) srv->prep_tail = NULL;
        }
        pthread_mutex_unlock(&srv->prep_mu);
        if (!c) break; /* stopping, queue empty */
        handle_generate(c, GRPC_SLICE_START_PTR(c->prep_msg), GRPC_SLICE_LENGTH(c->prep_msg));
        grpc_slice_unref(c->prep_msg);
        pthread_mutex_lock(&c->mu);
        c->n_pending--;
        bool done = finished_locked(c);
        pthread_mutex_unlock(&c->mu);
        if (done) retire(c);
    }
    return NULL;
}

static void on_recv(gcall *c, bool ok) {
    pthread_mutex_lock(&c->mu);
    c->n_pending--;
    grpc_byte_buffer *bb = c->recv_buf;
    c->recv_buf = NULL;
    bool give_up = !ok || c->stop_sending;
    if (!give_up && !bb) {
        reply_status_locked(c, GRPC_STATUS_INVALID_ARGUMENT, "missing request message");
        give_up = true;
    }
    /* The close may have completed first: then this was the last pending
     * operation and the call must be retired here. */
    bool done = give_up && finished_locked(c);
    pthread_mutex_unlock(&c->mu);
    if (give_up) {
        if (bb) grpc_byte_buffer_destroy(bb);
        if (done) retire(c);
        return;
    }
    grpc_byte_buffer_reader rd;
    if (!grpc_byte_buffer_reader_init(&rd, bb)) {
        grpc_byte_buffer_destroy(bb);
        pthread_mutex_lock(&c->mu);
        reply_status_locked(c, GRPC_STATUS_INVALID_ARGUMENT, "undecodable message");
        pthread_mutex_unlock(&c->mu);
        return;
    }
    grpc_slice s = grpc_byte_buffer_reader_readall(&rd);
    grpc_byte_buffer_reader_destroy(&rd);
    grpc_byte_buffer_destroy(bb);
    const uint8_t *data = GRPC_SLICE_START_PTR(s);
    size_t len = GRPC_SLICE_LENGTH(s);
    switch (c->kind) {
    case CALL_GENERATE: prep_enqueue(c, s); return; /* the prepare thread owns s now */
    case CALL_ABORT: handle_abort(c, data, len); break;
    case CALL_HEALTH_CHECK:
    case CALL_HEALTH_WATCH: handle_health(c, data, len); break;
    case CALL_UNKNOWN: TD_ASSERT(c->kind != CALL_UNKNOWN); break;
    }
    grpc_slice_unref(s);
}

/* ---- call life ---- */

static void request_call(td_grpc_server *srv);

/* Moves a finished call from the live list to the pump thread's free list.
 * Call mutex not held. */
static void retire(gcall *c) {
    td_grpc_server *srv = c->srv;
    pthread_mutex_lock(&srv->mu);
    c->prev->next = c->next;
    c->next->prev = c->prev;
    c->prev = c->next = NULL;
    c->zombie_next = srv->zombies;
    srv->zombies = c;
    pthread_cond_broadcast(&srv->retired);
    pthread_mutex_unlock(&srv->mu);
    uint64_t one = 1;
    ssize_t w = write(srv->wakefd, &one, sizeof(one));
    TD_UNUSED(w); /* an eventfd write fails only when the counter is saturated: still readable */
}

/* Under the call mutex: true once nothing more will happen on the call. */
static bool finished_locked(gcall *c) {
    if (c->dead || !c->closed || c->n_pending > 0) return false;
    c->dead = true;
    return true;
}

static void call_free(gcall *c) {
    if (!c) return;
    for (int i = 0; i < c->n_queue; i++) grpc_byte_buffer_destroy(c->queue[i]);
    if (c->send_buf) grpc_byte_buffer_destroy(c->send_buf);
    if (c->recv_buf) grpc_byte_buffer_destroy(c->recv_buf);
    if (c->stream) td_gen_stream_release(c->stream);
    td_api_request_free(&c->req);
    free(c->watch_service);
    if (c->call) grpc_call_unref(c->call);
    grpc_call_details_destroy(&c->details);
    grpc_metadata_array_destroy(&c->md);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static call_kind method_kind(const td_grpc_server *srv, grpc_slice method) {
    if (slice_eq(method, "/tandem.v1.Generate/Generate")) return CALL_GENERATE;
    if (srv->cluster_token && slice_eq(method, "/tandem.internal.v1.Decode/Generate"))
        return CALL_GENERATE;
    if (slice_eq(method, "/tandem.v1.Generate/Abort")) return CALL_ABORT;
    if (slice_eq(method, "/grpc.health.v1.Health/Check")) return CALL_HEALTH_CHECK;
    if (slice_eq(method, "/grpc.health.v1.Health/Watch")) return CALL_HEALTH_WATCH;
    return CALL_UNKNOWN;
}

static void on_new(gcall *c, bool ok) {
    td_grpc_server *srv = c->srv;
    if (!ok) {
        /* Server shutting down: the call never existed. */
        call_free(c);
        return;
    }
    if (!atomic_load(&srv->stopping)) request_call(srv);

    /* Set before the call is listed: other threads read it under the server
     * mutex only. */
    c->kind = method_kind(srv, c->details.method);
    c->internal = slice_eq(c->details.method, "/tandem.internal.v1.Decode/Generate");
    pthread_mutex_lock(&srv->mu);
    c->next = srv->live.next;
    c->prev = &srv->live;
    srv->live.next->prev = c;
    srv->live.next = c;
    pthread_mutex_unlock(&srv->mu);

    pthread_mutex_lock(&c->mu);
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->cancelled;
    start_batch_locked(c, &op, 1, &c->tag_close);
    if (atomic_load(&srv->stopping)) {
        reply_status_locked(c, GRPC_STATUS_UNAVAILABLE, "server shutting down");
    } else if (c->kind == CALL_UNKNOWN) {
        size_t n = GRPC_SLICE_LENGTH(c->details.method);
        TD_LOG_INFO("gRPC: unknown method %.*s", (int)TD_MIN(n, 200),
                    (const char *)GRPC_SLICE_START_PTR(c->details.method));
        reply_status_locked(c, GRPC_STATUS_UNIMPLEMENTED, "unknown method");
    } else {
        memset(&op, 0, sizeof(op));
        op.op = GRPC_OP_RECV_MESSAGE;
        op.data.recv_message.recv_message = &c->recv_buf;
        start_batch_locked(c, &op, 1, &c->tag_recv);
    }
    pthread_mutex_unlock(&c->mu);
}

static void on_send(gcall *c, bool ok) {
    pthread_mutex_lock(&c->mu);
    c->n_pending--;
    c->send_in_flight = false;
    if (c->send_buf) grpc_byte_buffer_destroy(c->send_buf);
    c->send_buf = NULL;
    if (!ok) {
        c->stop_sending = true;
        if (c->stream) td_gen_stream_cancel(c->stream);
    } else if (c->kind == CALL_GENERATE && c->stream) {
        generate_pump_locked(c);
    } else {
        send_next_locked(c);
    }
    bool done = finished_locked(c);
    pthread_mutex_unlock(&c->mu);
    if (done) retire(c);
}

static void on_close(gcall *c) {
    pthread_mutex_lock(&c->mu);
    c->n_pending--;
    c->closed = true;
    if (c->cancelled) {
        c->stop_sending = true;
        if (c->stream) {
            td_gen_stream_cancel(c->stream);
            if (!c->stream_done)
                TD_LOG_INFO("gRPC Generate %s cancelled (client cancel, deadline or shutdown)",
                            c->request_id);
        }
    }
    bool done = finished_locked(c);
    pthread_mutex_unlock(&c->mu);
    if (done) retire(c);
}

static void request_call(td_grpc_server *srv) {
    gcall *c = calloc(1, sizeof(*c));
    if (!c) {
        /* Without a pending request the server accepts nothing more until
         * the next call completes; nothing better to do out of memory. */
        TD_LOG_ERROR("out of memory accepting a gRPC call");
        return;
    }
    c->srv = srv;
    pthread_mutex_init(&c->mu, NULL);
    grpc_call_details_init(&c->details);
    grpc_metadata_array_init(&c->md);
    c->tag_new = (gtag){c, TAG_NEW};
    c->tag_recv = (gtag){c, TAG_RECV};
    c->tag_send = (gtag){c, TAG_SEND};
    c->tag_close = (gtag){c, TAG_CLOSE};
    c->watch_sent = -1;
    grpc_call_error e = grpc_server_request_call(srv->server, &c->call, &c->details, &c->md,
                                                 srv->cq, srv->cq, &c->tag_new);
    if (e != GRPC_CALL_OK) {
        TD_LOG_ERROR("grpc_server_request_call: error %d", (int)e);
        call_free(c);
    }
}

static void *cq_main(void *arg) {
    td_grpc_server *srv = arg;
    for (;;) {
        grpc_event ev =
            grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        if (ev.type != GRPC_OP_COMPLETE) continue;
        if (ev.tag == &srv->shutdown_tag) {
            grpc_completion_queue_shutdown(srv->cq);
            continue;
        }
        gtag *t = ev.tag;
        switch (t->kind) {
        case TAG_NEW: on_new(t->c, ev.success != 0); break;
        case TAG_RECV: on_recv(t->c, ev.success != 0); break;
        case TAG_SEND: on_send(t->c, ev.success != 0); break;
        case TAG_CLOSE: on_close(t->c); break;
        }
    }
    return NULL;
}

/* ---- pump thread ---- */

static void free_zombies(td_grpc_server *srv) {
    pthread_mutex_lock(&srv->mu);
    gcall *z = srv->zombies;
    srv->zombies = NULL;
    pthread_mutex_unlock(&srv->mu);
    while (z) {
        gcall *next = z->zombie_next;
        if (z->in_epoll) epoll_ctl(srv->epfd, EPOLL_CTL_DEL, td_gen_stream_fd(z->stream), NULL);
        call_free(z);
        z = next;
    }
}

static void watch_scan(td_grpc_server *srv) {
    pthread_mutex_lock(&srv->mu);
    for (gcall *c = srv->live.next; c != &srv->live; c = c->next) {
        if (c->kind != CALL_HEALTH_WATCH) continue;
        pthread_mutex_lock(&c->mu);
        if (c->watch_service && !c->dead && !c->stop_sending && !c->status_started &&
            !c->send_in_flight && c->n_queue == 0) {
            int status = health_status(srv, c->watch_service);
            if (status != c->watch_sent) {
                queue_health_locked(c, status);
                send_next_locked(c);
            }
        }
        pthread_mutex_unlock(&c->mu);
    }
    pthread_mutex_unlock(&srv->mu);
}

static void *pump_main(void *arg) {
    td_grpc_server *srv = arg;
    struct epoll_event evs[64];
    double last_watch = 0;
    while (!atomic_load(&srv->pump_stop)) {
        int n = epoll_wait(srv->epfd, evs, (int)TD_ARRAY_SIZE(evs), WATCH_POLL_MS);
        if (n < 0 && errno != EINTR) {
            TD_LOG_ERROR("epoll_wait: %s", strerror(errno));
            n = 0;
        }
        for (int i = 0; i < n; i++) {
            gcall *c = evs[i].data.ptr;
            if (!c) {
                uint64_t v;
                ssize_t r = read(srv->wakefd, &v, sizeof(v));
                TD_UNUSED(r);
                continue;
            }
            pthread_mutex_lock(&c->mu);
            if (!c->dead) generate_pump_locked(c);
            pthread_mutex_unlock(&c->mu);
        }
        free_zombies(srv);
        double now = td_time_s();
        if (now - last_watch >= WATCH_POLL_MS / 1000.0) {
            watch_scan(srv);
            last_watch = now;
        }
    }
    free_zombies(srv);
    return NULL;
}

/* ---- public ---- */

td_grpc_params td_grpc_default_params(void) {
    td_grpc_params p;
    memset(&p, 0, sizeof(p));
    p.host = "127.0.0.1";
    p.port = 50051;
    p.limits = td_api_default_limits();
    p.model.chat = NULL;
    return p;
}

int td_grpc_server_port(const td_grpc_server *srv) { return srv ? srv->port : -1; }

static void server_free(td_grpc_server *srv) {
    if (srv->server) grpc_server_destroy(srv->server);
    if (srv->cq) grpc_completion_queue_destroy(srv->cq);
    if (srv->grpc_inited) grpc_shutdown();
    if (srv->epfd >= 0) close(srv->epfd);
    if (srv->wakefd >= 0) close(srv->wakefd);
    for (int i = 0; i < srv->n_api_keys; i++) free(srv->api_keys[i]);
    free(srv->api_keys);
    free(srv->api_key_lens);
    free(srv->cluster_token);
    free(srv->model_name);
    pthread_cond_destroy(&srv->prep_cv);
    pthread_mutex_destroy(&srv->prep_mu);
    pthread_cond_destroy(&srv->retired);
    pthread_mutex_destroy(&srv->mu);
    free(srv);
}

td_status td_grpc_server_start(const td_grpc_params *p, td_grpc_server **srv_p) {
    if (!p || (!p->sched && !p->submit_hook.submit) || !p->model.tok || p->n_api_keys < 0 ||
        (p->n_api_keys > 0 && !p->api_keys) || p->port < 0 || p->port > 65535) {
        TD_LOG_ERROR("invalid gRPC server parameters");
        return TD_ERR_INVALID;
    }
    td_status st = TD_ERR_NOMEM;
    td_grpc_server *srv = calloc(1, sizeof(*srv));
    if (!srv) return TD_ERR_NOMEM;
    pthread_mutex_init(&srv->mu, NULL);
    td_cond_init_monotonic(&srv->retired);
    pthread_mutex_init(&srv->prep_mu, NULL);
    pthread_cond_init(&srv->prep_cv, NULL);
    srv->live.next = srv->live.prev = &srv->live;
    srv->epfd = srv->wakefd = -1;
    srv->sched = p->sched;
    srv->submit_hook = p->submit_hook;
    srv->metrics = p->metrics;
    srv->model = p->model;
    srv->limits = p->limits;
    srv->n_vocab = td_tokenizer_n_vocab(p->model.tok);
    srv->id_salt = td_time_ns() * 0x9E3779B97F4A7C15ull;
    if (p->model.model_name) {
        srv->model_name = strdup(p->model.model_name);
        if (!srv->model_name) goto fail;
        srv->model.model_name = srv->model_name;
    }
    if (p->cluster_token && !(srv->cluster_token = strdup(p->cluster_token))) goto fail;
    if (p->n_api_keys > 0) {
        srv->api_keys = calloc((size_t)p->n_api_keys, sizeof(char *));
        srv->api_key_lens = calloc((size_t)p->n_api_keys, sizeof(size_t));
        if (!srv->api_keys || !srv->api_key_lens) goto fail;
        for (int i = 0; i < p->n_api_keys; i++) {
            srv->api_keys[i] = strdup(p->api_keys[i] ? p->api_keys[i] : "");
            if (!srv->api_keys[i]) goto fail;
            srv->api_key_lens[i] = strlen(srv->api_keys[i]);
            srv->n_api_keys = i + 1;
        }
    }
    srv->epfd = epoll_create1(EPOLL_CLOEXEC);
    srv->wakefd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (srv->epfd < 0 || srv->wakefd < 0) {
        TD_LOG_ERROR("epoll/eventfd: %s", strerror(errno));
        st = TD_ERR_IO;
        goto fail;
    }
    struct epoll_event wev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(srv->epfd, EPOLL_CTL_ADD, srv->wakefd, &wev) != 0) {
        TD_LOG_ERROR("epoll_ctl: %s", strerror(errno));
        st = TD_ERR_IO;
        goto fail;
    }

    grpc_init();
    srv->grpc_inited = true;
    srv->cq = grpc_completion_queue_create_for_next(NULL);
    /* No SO_REUSEPORT: a port already taken must be an error, not a second
     * listener sharing it. */
    size_t max_msg = p->limits.max_body_bytes;
    grpc_arg args[2];
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = (char *)GRPC_ARG_ALLOW_REUSEPORT;
    args[0].value.integer = 0;
    args[1].type = GRPC_ARG_INTEGER;
    args[1].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[1].value.integer = max_msg > 0 && max_msg < INT32_MAX ? (int)max_msg : INT32_MAX;
    grpc_channel_args cargs = {.num_args = 2, .args = args};
    srv->server = grpc_server_create(&cargs, NULL);
    grpc_server_register_completion_queue(srv->server, srv->cq, NULL);
    const char *host = p->host ? p->host : "127.0.0.1";
    char addr[300];
    if (strchr(host, ':'))
        snprintf(addr, sizeof(addr), "[%s]:%d", host, p->port);
    else
        snprintf(addr, sizeof(addr), "%s:%d", host, p->port);
    grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
    srv->port = grpc_server_add_http2_port(srv->server, addr, creds);
    grpc_server_credentials_release(creds);
    if (srv->port <= 0) {
        TD_LOG_ERROR("gRPC: cannot bind %s", addr);
        st = TD_ERR_IO;
        goto fail;
    }
    grpc_server_start(srv->server);
    for (int i = 0; i < N_REQUESTED_CALLS; i++) request_call(srv);
    if (pthread_create(&srv->pump_thread, NULL, pump_main, srv) != 0) {
        TD_LOG_ERROR("gRPC: cannot start the pump thread");
        st = TD_ERR_NOMEM;
        goto fail_started;
    }
    srv->pump_thread_started = true;
    if (pthread_create(&srv->prep_thread, NULL, prep_main, srv) != 0) {
        TD_LOG_ERROR("gRPC: cannot start the prepare thread");
        st = TD_ERR_NOMEM;
        goto fail_started;
    }
    srv->prep_thread_started = true;
    if (pthread_create(&srv->cq_thread, NULL, cq_main, srv) != 0) {
        TD_LOG_ERROR("gRPC: cannot start the completion-queue thread");
        st = TD_ERR_NOMEM;
        goto fail_started;
    }
    srv->cq_thread_started = true;
    *srv_p = srv;
    return TD_OK;

fail_started:
    td_grpc_server_stop(srv);
    return st;
fail:
    if (srv->server) {
        /* Never started: shutting down completes at once. */
        grpc_server_shutdown_and_notify(srv->server, srv->cq, &srv->shutdown_tag);
        grpc_completion_queue_shutdown(srv->cq);
        for (;;) {
            grpc_event ev =
                grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
            if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        }
    }
    server_free(srv);
    return st;
}

/* Cancels every running generation and waits, a bounded time, for the
 * calls to deliver their last messages (Complete with finish_reason
 * "abort", or the end that was already on its way), so a stop after a
 * drain ends streams cleanly instead of with UNAVAILABLE. */
static void end_generations(td_grpc_server *srv) {
    struct timespec deadline = td_deadline_after(STOP_GRACE_S);
    pthread_mutex_lock(&srv->mu);
    for (gcall *c = srv->live.next; c != &srv->live; c = c->next) {
        pthread_mutex_lock(&c->mu);
        if (c->stream) td_gen_stream_cancel(c->stream);
        pthread_mutex_unlock(&c->mu);
    }
    for (;;) {
        bool any = false;
        for (gcall *c = srv->live.next; c != &srv->live && !any; c = c->next)
            any = c->kind == CALL_GENERATE;
        if (!any) break;
        if (pthread_cond_timedwait(&srv->retired, &srv->mu, &deadline) == ETIMEDOUT) break;
    }
    pthread_mutex_unlock(&srv->mu);
}

void td_grpc_server_stop(td_grpc_server *srv) {
    if (!srv) return;
    atomic_store(&srv->stopping, true);
    grpc_server_shutdown_and_notify(srv->server, srv->cq, &srv->shutdown_tag);
    if (srv->cq_thread_started) end_generations(srv);
    grpc_server_cancel_all_calls(srv->server);
    if (srv->cq_thread_started) {
        pthread_join(srv->cq_thread, NULL);
    } else {
        /* The completion-queue thread never ran: drain here. */
        for (;;) {
            grpc_event ev =
                grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
            if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
            if (ev.type != GRPC_OP_COMPLETE) continue;
            if (ev.tag == &srv->shutdown_tag) {
                grpc_completion_queue_shutdown(srv->cq);
                continue;
            }
            gtag *t = ev.tag;
            if (t->kind == TAG_NEW) on_new(t->c, false);
        }
    }
    /* Every call has ended, so every preparation has too. */
    if (srv->prep_thread_started) {
        pthread_mutex_lock(&srv->prep_mu);
        srv->prep_stop = true;
        pthread_cond_signal(&srv->prep_cv);
        pthread_mutex_unlock(&srv->prep_mu);
        pthread_join(srv->prep_thread, NULL);
    }
    if (srv->pump_thread_started) {
        atomic_store(&srv->pump_stop, true);
        uint64_t one = 1;
        ssize_t w = write(srv->wakefd, &one, sizeof(one));
        TD_UNUSED(w);
        pthread_join(srv->pump_thread, NULL);
    }
    free_zombies(srv);
    server_free(srv);
}
