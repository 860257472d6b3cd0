/* The proxied requests (router-impl.h): submit, the queue that waits for
 * KV headroom, the calls to decode instances (dclient.h) with their
 * retries before the first token, the stream to the front end, abort. */
#include <stdio.h>
#include <string.h>

#include "common/api/sampling.h"
#include "router-impl.h"

static void req_free(rt_req *q) {
    if (!q) return;
    if (q->greq) tandem__v1__generate_request__free_unpacked(q->greq, NULL);
    for (int32_t i = 0; i < q->n_stop; i++) free(q->stop[i]);
    free(q->stop);
    free(q->prompt);
    free(q->hashes);
    free(q);
}

static void on_stream_freed(void *ctx) {
    rt_req *q = ctx;
    if (q->counted) atomic_fetch_sub(&q->r->n_streams, 1);
    req_free(q);
}

static td_status status_of_http(int http) {
    switch (http) {
    case 400: return TD_ERR_INVALID;
    case 404: return TD_ERR_NOT_FOUND;
    case 413: return TD_ERR_RANGE;
    case 429: return TD_AGAIN;
    case 503: return TD_ERR_UNAVAILABLE;
    default: return TD_ERR_IO;
    }
}

/* Ends the request's stream (once). */
static void req_end_locked(td_router *r, rt_req *q, td_finish_reason why, td_status err,
                           int stop_index, int32_t stop_token) {
    if (q->finished) return;
    q->finished = true;
    if (why == TD_FINISH_ERROR) r->failed[q->got_first]++;
    if (why == TD_FINISH_ERROR && q->client_error)
        td_gen_stream_fail(q->st, err, q->client_error);
    else
        td_gen_stream_finish(q->st, why, err, stop_index, stop_token);
    if (r->p.metrics) {
        td_request_record rec = {.id = q->id,
                                 .n_prompt_tokens = q->n_prompt,
                                 .n_output_tokens = td_gen_stream_n_tokens(q->st),
                                 .finish = why,
                                 .t_arrival = q->t_arrival,
                                 .t_scheduled = q->t_dispatch > 0 ? q->t_dispatch : q->t_arrival,
                                 .t_first_token = q->t_first,
                                 .t_finished = td_time_s()};
        td_metrics_request_finished(r->p.metrics, &rec);
    }
}

/* Lets go of the router's side once the stream ended and no call or queue
 * holds the request. q may be freed by this call: touch it no more. */
static void req_release_locked(td_router *r, rt_req *q) {
    if (!q->finished || q->call || q->state == Q_QUEUED || q->producer_done) return;
    q->producer_done = true;
    q->state = Q_DONE;
    r->n_active--;
    if (q->all_prev)
        q->all_prev->all_next = q->all_next;
    else
        r->all = q->all_next;
    if (q->all_next) q->all_next->all_prev = q->all_prev;
    pthread_cond_broadcast(&r->cv);
    td_gen_stream_unref(q->st);
}

static void queue_unlink_locked(td_router *r, rt_req *q) {
    rt_req **pp = &r->q_head, *prev = NULL;
    while (*pp && *pp != q) {
        prev = *pp;
        pp = &(*pp)->next;
    }
    if (!*pp) return;
    *pp = q->next;
    if (r->q_tail == q) r->q_tail = prev;
    q->next = NULL;
    r->n_queued--;
    q->state = Q_NEW;
}

static bool on_response(void *ctx, const Tandem__V1__GenerateResponse *resp);
static void on_end(void *ctx, int grpc_status, const char *details);

/* Packs the InternalGenerate of this attempt and starts the call. */
static td_status start_locked(td_router *r, rt_req *q, const td_rt_choice *c) {
    Tandem__Internal__V1__InternalGenerate ig = TANDEM__INTERNAL__V1__INTERNAL_GENERATE__INIT;
    ig.cluster_token.data = (uint8_t *)r->token;
    ig.cluster_token.len = strlen(r->token);
    ig.request = q->greq;
    if (c->p >= 0) {
        ig.prefill_case = TANDEM__INTERNAL__V1__INTERNAL_GENERATE__PREFILL_PREFILL_INSTANCE;
        ig.prefill_instance = r->in[c->p].addr;
    } else {
        ig.prefill_case = TANDEM__INTERNAL__V1__INTERNAL_GENERATE__PREFILL_LOCAL_PREFILL;
        ig.local_prefill = true;
    }
    size_t len = tandem__internal__v1__internal_generate__get_packed_size(&ig);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf) {
        TD_LOG_ERROR("out of memory");
        r->in[c->d].in_flight--; /* td_rt_route_locked counted it */
        return TD_ERR_NOMEM;
    }
    tandem__internal__v1__internal_generate__pack(&ig, buf);
    q->d = c->d;
    q->p = c->p;
    q->attempts++;
    q->retry_hint = false;
    q->d_status = 0;
    q->state = Q_RUNNING;
    if (q->t_dispatch == 0) q->t_dispatch = td_time_s();
    td_rt_dcall_cb cb = {.on_response = on_response, .on_end = on_end, .ctx = q};
    td_status st =
        td_rt_dcall_start(r->dc, r->in[c->d].target, buf, len, r->p.call_timeout_s, &cb, &q->call);
    free(buf);
    if (st != TD_OK) {
        q->call = NULL;
        r->in[c->d].in_flight--;
    } else {
        r->n_running++;
    }
    return st;
}

/* Routes q and starts it, retrying other instances while starts fail.
 * TD_OK: running or queued; TD_AGAIN: no headroom and the queue is full;
 * TD_ERR_UNAVAILABLE: no td_rt_usable decode instance. */
static td_status dispatch_locked(td_router *r, rt_req *q) {
    for (;;) {
        td_rt_choice c;
        td_status st = td_rt_route_locked(r, q, &c);
        if (st == TD_ERR_TIMEOUT) { /* unmeetable (--reject-unmeetable) */
            r->unmeetable++;
            return TD_AGAIN;
        }
        if (st == TD_AGAIN) {
            if (r->n_queued >= r->p.max_queued) {
                r->rejected++;
                return TD_AGAIN;
            }
            q->state = Q_QUEUED;
            q->t_queued = td_time_s();
            q->next = NULL;
            if (r->q_tail)
                r->q_tail->next = q;
            else
                r->q_head = q;
            r->q_tail = q;
            r->n_queued++;
            return TD_OK;
        }
        if (st != TD_OK) return st;
        if (start_locked(r, q, &c) == TD_OK) return TD_OK;
        td_rt_mask_set(&q->excluded, c.d);
        if (q->attempts > r->p.max_retries) return TD_ERR_UNAVAILABLE;
        r->retries++;
    }
}

/* A chunk's logprobs into the stream's results (NULL when not asked for or
 * when the count does not match). */
static bool chunk_logprobs(const Tandem__V1__Chunk *ch, td_sample_result *lp) {
    if (ch->n_logprobs != ch->n_token_ids) return false;
    for (size_t i = 0; i < ch->n_logprobs; i++) {
        const Tandem__V1__TokenLogprob *t = ch->logprobs[i];
        lp[i] = (td_sample_result){.token = t->token_id, .logprob = t->logprob};
        size_t k = t->n_top_logprobs < TD_SAMPLER_MAX_LOGPROBS ? t->n_top_logprobs
                                                               : TD_SAMPLER_MAX_LOGPROBS;
        for (size_t j = 0; j < k; j++)
            lp[i].top[j] =
                (td_token_logprob){t->top_logprobs[j]->token_id, t->top_logprobs[j]->logprob};
        lp[i].n_top = (int32_t)k;
    }
    return true;
}

static bool retryable_grpc(int code) {
    /* UNAVAILABLE, RESOURCE_EXHAUSTED, INTERNAL, UNKNOWN, ABORTED,
     * DEADLINE_EXCEEDED, CANCELLED (by the instance: it stopped) */
    return code == 14 || code == 8 || code == 13 || code == 2 || code == 10 || code == 4 ||
           code == 1;
}

/* At q's first token: what the queue's prediction at its routing missed
 * by, into the instance's moving average (a request that waited in the
 * router's queue or was retried measures something else: left out; at its
 * first attempt it runs on the instance the prediction was for). */
static void learn_ttft_locked(td_router *r, const rt_req *q, double now) {
    if (q->expect_at < 0 || q->attempts != 1 || q->t_queued > 0) return;
    double miss = (now - q->t_arrival) * 1e3 - q->expect_ms;
    td_rt_extra_learn(&r->in[q->expect_at].ttft_extra, miss, now);
}

static bool on_response(void *ctx, const Tandem__V1__GenerateResponse *resp) {
    rt_req *q = ctx;
    td_router *r = q->r;
    bool more = true;
    pthread_mutex_lock(&r->mu);
    if (q->finished) {
        more = false;
    } else if (resp->response_case == TANDEM__V1__GENERATE_RESPONSE__RESPONSE_CHUNK) {
        const Tandem__V1__Chunk *ch = resp->chunk;
        td_sample_result *lp = NULL;
        td_status st = TD_OK;
        int32_t n = (int32_t)ch->n_token_ids;
        if (ch->n_token_ids > (size_t)q->max_tokens) {
            st = TD_ERR_RANGE;
        } else if (q->logprobs && n > 0) {
            lp = malloc((size_t)n * sizeof *lp);
            if (!lp)
                st = TD_ERR_NOMEM;
            else if (!chunk_logprobs(ch, lp))
                st = TD_ERR_FORMAT;
        }
        if (st == TD_OK)
            st = td_gen_stream_push(q->st, ch->token_ids, lp, n, ch->text ? ch->text : "",
                                    ch->text ? strlen(ch->text) : 0);
        free(lp);
        double now = td_time_s();
        if (st != TD_OK) {
            TD_LOG_WARN("request %s: decode instance %s sent a bad chunk (%s)", q->id,
                        r->in[q->d].addr, td_status_str(st));
            snprintf(q->last_error, sizeof q->last_error, "bad chunk from %s", r->in[q->d].addr);
            q->client_error = "the decode instance sent a malformed response";
            req_end_locked(r, q, TD_FINISH_ERROR, TD_ERR_FORMAT, -1, -1);
            more = false;
        } else if (n > 0) {
            if (!q->got_first) {
                q->got_first = true;
                td_rt_release_pending_locked(r, q, false); /* its prefill is done */
                q->t_first = now;
                td_rt_predict_locked(r, q, q->d, q->p, now);
                learn_ttft_locked(r, q, now);
                if (r->p.metrics)
                    td_metrics_first_token(r->p.metrics, now - q->t_arrival,
                                           q->t_dispatch - q->t_arrival);
            } else if (r->p.metrics) {
                for (int32_t i = 0; i < n; i++)
                    td_metrics_inter_token(r->p.metrics, (now - q->t_last) / n);
            }
            q->t_last = now;
        }
    } else if (resp->response_case == TANDEM__V1__GENERATE_RESPONSE__RESPONSE_COMPLETE) {
        const Tandem__V1__Complete *cp = resp->complete;
        const char *fr = cp->finish_reason ? cp->finish_reason : "";
        if (!strcmp(fr, "abort") && !q->got_first && !q->cancelled) {
            q->retry_hint = true; /* the instance stopped before any token */
        } else {
            td_finish_reason why = !strcmp(fr, "stop")     ? TD_FINISH_STOP
                                   : !strcmp(fr, "length") ? TD_FINISH_LENGTH
                                                           : TD_FINISH_ABORT;
            int stop_index = -1;
            int32_t stop_token = -1;
            if (cp->stop_reason_case == TANDEM__V1__COMPLETE__STOP_REASON_STOP_STR) {
                for (int32_t i = 0; i < q->n_stop; i++)
                    if (cp->stop_str && !strcmp(q->stop[i], cp->stop_str)) {
                        stop_index = i;
                        break;
                    }
            } else if (cp->stop_reason_case == TANDEM__V1__COMPLETE__STOP_REASON_STOP_TOKEN_ID) {
                stop_token = cp->stop_token_id;
            }
            td_gen_stream_set_prompt(q->st, (int32_t)cp->prompt_tokens, (int32_t)cp->cached_tokens);
            req_end_locked(r, q, why, why == TD_FINISH_ABORT ? TD_ERR_CANCELLED : TD_OK, stop_index,
                           stop_token);
        }
    } else if (resp->response_case == TANDEM__V1__GENERATE_RESPONSE__RESPONSE_ERROR) {
        const Tandem__V1__Error *e = resp->error;
        td_rt_ascii_copy(q->d_message, sizeof q->d_message, e->message ? e->message : "error");
        snprintf(q->last_error, sizeof q->last_error, "%s: %.200s", r->in[q->d].addr, q->d_message);
        int hs = e->http_status;
        q->d_status = hs > 0 ? hs : 500;
        if (!q->got_first && !q->cancelled && (hs == 429 || hs == 503 || hs >= 500)) {
            q->retry_hint = true; /* on_end tries another instance, or ends with this */
        } else {
            q->client_error =
                hs >= 400 && hs < 500 ? q->d_message : "the decode instance failed the request";
            req_end_locked(r, q, TD_FINISH_ERROR, status_of_http(hs), -1, -1);
        }
    }
    pthread_mutex_unlock(&r->mu);
    return more;
}

static void on_end(void *ctx, int grpc_status, const char *details) {
    rt_req *q = ctx;
    td_router *r = q->r;
    pthread_mutex_lock(&r->mu);
    td_rt_dcall_release(q->call);
    q->call = NULL;
    r->n_running--;
    inst *D = &r->in[q->d];
    D->in_flight--;
    td_rt_release_pending_locked(r, q, true);
    if (!q->finished) {
        bool from_error = q->retry_hint && q->d_status > 0; /* an in-stream Error */
        if (grpc_status != 0 && !from_error) {
            char det[160];
            td_rt_ascii_copy(det, sizeof det, details);
            snprintf(q->last_error, sizeof q->last_error, "%s: gRPC status %d: %s", D->addr,
                     grpc_status, det);
        }
        bool retry = !q->cancelled && !q->got_first && !r->stop &&
                     (q->retry_hint || (grpc_status != 0 && retryable_grpc(grpc_status)));
        if (retry && grpc_status == 14 && !q->retry_hint) {
            /* unreachable: out of rotation until its state answers again */
            D->healthy = false;
            D->failures++;
            td_rt_ascii_copy(D->err, sizeof D->err, q->last_error);
        }
        td_status st = TD_ERR_UNAVAILABLE;
        if (retry && q->attempts <= r->p.max_retries) {
            td_rt_mask_set(&q->excluded, q->d);
            r->retries++;
            TD_LOG_INFO("request %s: retrying after %s", q->id, q->last_error);
            st = dispatch_locked(r, q);
            /* No other instance to try after a busy one: busy (429), not down. */
            if (st == TD_ERR_UNAVAILABLE && grpc_status == 8) st = TD_AGAIN;
            if (st != TD_OK && from_error) st = status_of_http(q->d_status);
        } else if (!retry && grpc_status == 0) {
            st = TD_ERR_FORMAT; /* the stream ended without Complete */
            snprintf(q->last_error, sizeof q->last_error,
                     "%.160s ended the stream without Complete", D->addr);
        } else if (!q->cancelled && from_error) {
            st = status_of_http(q->d_status);
        } else if (!q->cancelled) {
            st = grpc_status == 3   ? TD_ERR_INVALID
                 : grpc_status == 8 ? TD_AGAIN
                                    : TD_ERR_UNAVAILABLE;
        }
        if (from_error && !q->client_error) q->client_error = q->d_message;
        if (q->cancelled)
            req_end_locked(r, q, TD_FINISH_ABORT, TD_ERR_CANCELLED, -1, -1);
        else if (st != TD_OK) {
            TD_LOG_WARN("request %s failed: %s", q->id, q->last_error);
            if (!q->client_error)
                q->client_error = q->got_first     ? "the decode instance failed mid-stream"
                                  : st == TD_AGAIN ? "every decode instance is busy; retry later"
                                                   : "no decode instance could serve the request";
            req_end_locked(r, q, TD_FINISH_ERROR, st, -1, -1);
        }
    }
    pthread_cond_broadcast(&r->cv); /* capacity may have come back: the queue */
    req_release_locked(r, q);
    pthread_mutex_unlock(&r->mu);
}

/* A decode instance stopped answering its state pulls: its calls are
 * cancelled (retried elsewhere when no token was sent yet), so no client
 * waits on an instance that is gone. */
void td_rt_cancel_calls_of_locked(td_router *r, int32_t d) {
    for (rt_req *q = r->all; q; q = q->all_next)
        if (q->call && q->d == d && !q->finished) {
            q->vanished = true;
            td_rt_dcall_cancel(q->call);
        }
}

static void on_cancel(void *ctx) {
    rt_req *q = ctx;
    td_router *r = q->r;
    pthread_mutex_lock(&r->mu);
    q->cancelled = true;
    if (q->state == Q_QUEUED) {
        queue_unlink_locked(r, q);
        req_end_locked(r, q, TD_FINISH_ABORT, TD_ERR_CANCELLED, -1, -1);
        req_release_locked(r, q);
    } else if (q->call) {
        td_rt_dcall_cancel(q->call);
    }
    pthread_mutex_unlock(&r->mu);
}

/* The tandem.v1.GenerateRequest every attempt sends: the prompt as token
 * ids and every sampling parameter of g. */
static Tandem__V1__GenerateRequest *greq_of(const td_gen_request *g) {
    Tandem__V1__GenerateRequest gr = TANDEM__V1__GENERATE_REQUEST__INIT;
    Tandem__V1__TokenIds ids = TANDEM__V1__TOKEN_IDS__INIT;
    td_sampling_proto sp;
    if (td_sampling_to_proto(g, &sp) != TD_OK) return NULL;
    gr.request_id = (char *)(g->id ? g->id : "");
    gr.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS;
    gr.token_ids = &ids;
    ids.ids = (int32_t *)g->prompt;
    ids.n_ids = (size_t)g->n_prompt;
    gr.sampling = &sp.sp;
    /* Packed and unpacked again: the copy owns all of its memory. */
    size_t len = tandem__v1__generate_request__get_packed_size(&gr);
    uint8_t *buf = malloc(len ? len : 1);
    Tandem__V1__GenerateRequest *out = NULL;
    if (buf) {
        tandem__v1__generate_request__pack(&gr, buf);
        out = tandem__v1__generate_request__unpack(NULL, len, buf);
    }
    free(buf);
    td_sampling_proto_free(&sp);
    return out;
}

static td_status router_submit(void *ctx, const td_gen_request *g, td_gen_stream **st_p) {
    td_router *r = ctx;
    if (!g || !g->prompt || g->n_prompt < 1 || g->max_tokens < 1) return TD_ERR_INVALID;
    rt_req *q = calloc(1, sizeof *q);
    if (!q) return TD_ERR_NOMEM;
    q->r = r;
    q->d = q->p = -1;
    q->expect_at = -1;
    q->n_prompt = g->n_prompt;
    q->max_tokens = g->max_tokens;
    q->logprobs = g->sampling.logprobs || g->sampling.n_logprobs > 0;
    q->t_arrival = g->t_arrival > 0 ? g->t_arrival : td_time_s();
    snprintf(q->id, sizeof q->id, "%s", g->id ? g->id : "-");
    q->prompt = malloc((size_t)g->n_prompt * sizeof *q->prompt);
    q->greq = greq_of(g);
    q->stop = g->n_stop > 0 ? calloc((size_t)g->n_stop, sizeof *q->stop) : NULL;
    bool ok = q->prompt && q->greq && (g->n_stop == 0 || q->stop);
    if (ok) memcpy(q->prompt, g->prompt, (size_t)g->n_prompt * sizeof *q->prompt);
    for (int32_t i = 0; ok && i < g->n_stop; i++) {
        q->stop[i] = strdup(g->stop[i]);
        q->n_stop = i + 1;
        ok = q->stop[i] != NULL;
    }
    if (!ok) {
        TD_LOG_ERROR("out of memory");
        req_free(q);
        return TD_ERR_NOMEM;
    }
    td_gen_stream_owner own = {.cancel = on_cancel, .freed = on_stream_freed, .ctx = q};
    td_gen_stream *st = NULL;
    td_status rc = td_gen_stream_create(q->max_tokens, q->logprobs, q->n_prompt, &own, &st);
    if (rc != TD_OK) {
        req_free(q);
        return rc;
    }
    q->st = st;
    pthread_mutex_lock(&r->mu);
    q->admitting = true;
    rc = r->draining || r->stop ? TD_ERR_UNAVAILABLE : dispatch_locked(r, q);
    q->admitting = false;
    if (rc == TD_OK) {
        r->n_active++;
        q->all_next = r->all;
        if (r->all) r->all->all_prev = q;
        r->all = q;
        q->counted = true;
        atomic_fetch_add(&r->n_streams, 1);
    }
    pthread_mutex_unlock(&r->mu);
    if (rc != TD_OK) {
        /* Nobody else holds it: both references go, and freed frees q. */
        td_gen_stream_finish(st, TD_FINISH_ERROR, rc, -1, -1);
        td_gen_stream_unref(st);
        td_gen_stream_release(st);
        return rc;
    }
    *st_p = st;
    return TD_OK;
}

/* -------------------------------------------------------------- queue */

void td_rt_process_queue_locked(td_router *r) {
    double now = td_time_s();
    for (rt_req *q = r->q_head, *nx; q; q = nx) {
        nx = q->next;
        if (now - q->t_queued <= r->p.queue_timeout_s) continue;
        queue_unlink_locked(r, q);
        r->timeouts++;
        snprintf(q->last_error, sizeof q->last_error,
                 "no decode instance had the KV headroom within %.0f s", r->p.queue_timeout_s);
        TD_LOG_WARN("request %s: %s", q->id, q->last_error);
        q->client_error = "no decode instance had the KV headroom for the request in time";
        req_end_locked(r, q, TD_FINISH_ERROR, TD_ERR_UNAVAILABLE, -1, -1);
        req_release_locked(r, q);
    }
    while (r->q_head && !r->stop) {
        rt_req *q = r->q_head;
        td_rt_choice c;
        if (td_rt_route_locked(r, q, &c) != TD_OK) break; /* still no headroom: FIFO */
        queue_unlink_locked(r, q);
        if (start_locked(r, q, &c) == TD_OK) continue;
        td_rt_mask_set(&q->excluded, c.d);
        td_status st = q->attempts > r->p.max_retries ? TD_ERR_UNAVAILABLE : dispatch_locked(r, q);
        if (st != TD_OK) {
            q->client_error = "no decode instance could serve the request";
            req_end_locked(r, q, TD_FINISH_ERROR, st, -1, -1);
            req_release_locked(r, q);
        }
    }
}

static const char *router_not_ready(void *ctx) {
    td_router *r = ctx;
    pthread_mutex_lock(&r->mu);
    const char *why = r->draining ? "draining" : "no decode instance is ready";
    for (int32_t i = 0; !r->draining && i < r->n_slots; i++)
        if (!r->in[i].prefill && td_rt_usable(r, i, NULL)) why = NULL;
    pthread_mutex_unlock(&r->mu);
    return why;
}

td_api_submit_hook td_router_submit_hook(td_router *r) {
    return (td_api_submit_hook){.submit = router_submit, .not_ready = router_not_ready, .ctx = r};
}

void td_router_abort_all(td_router *r) {
    pthread_mutex_lock(&r->mu);
    for (rt_req *q = r->all, *nx; q; q = nx) {
        nx = q->all_next;
        if (q->finished) continue;
        q->cancelled = true; /* ended as aborted, never retried */
        if (q->state == Q_QUEUED) {
            queue_unlink_locked(r, q);
            req_end_locked(r, q, TD_FINISH_ABORT, TD_ERR_UNAVAILABLE, -1, -1);
            req_release_locked(r, q);
        } else if (q->call) {
            td_rt_dcall_cancel(q->call); /* on_end ends it */
        }
    }
    pthread_mutex_unlock(&r->mu);
}

void td_rt_abort_queued_locked(td_router *r) {
    while (r->q_head) {
        rt_req *q = r->q_head;
        queue_unlink_locked(r, q);
        req_end_locked(r, q, TD_FINISH_ABORT, TD_ERR_UNAVAILABLE, -1, -1);
        req_release_locked(r, q);
    }
}
