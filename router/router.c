/* tandem-router's core (router.h): the instances, the poller thread, the
 * routing decision and the proxied requests. One mutex (r->mu) guards the
 * instances' figures, the queue and every request's state; the prefix
 * index has its own lock. Only the poller thread creates, updates the
 * address of, and frees instance slots. */
#include "router.h"

#include <curl/curl.h>
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "common/api/sampling.h"
#include "common/base/net.h"
#include "common/base/strbuf.h"
#include "common/kv/hash.h"
#include "dclient.h"
#include "index.h"
#include "proto/internal.pb-c.h"

#define MAXI        TD_RT_MAX_INSTANCES
#define MAX_GROUPS  8
#define STATE_LIMIT (64u << 20)        /* largest /internal/v1/state reply read */
#define FIG_MAX     ((int64_t)1 << 40) /* peer-reported figures are clamped to 0..FIG_MAX */
/* A decode instance whose state pulls fail this many times in a row has its
 * calls cancelled (they would otherwise wait on a peer that is gone). */
#define VANISHED_POLLS 3

typedef struct {
    bool used, removed, prefill, dns;
    char addr[136]; /* HOST:PORT or [V6]:PORT of its HTTP port */
    /* From its last state (under r->mu). */
    bool healthy, have_state, draining;
    uint64_t epoch;
    char id[64];
    td_kv_hash compat;
    int32_t group; /* -1: none yet, or too many groups */
    uint64_t since;
    int32_t block_size, max_ctx, grpc_port;
    int32_t running, waiting;
    int64_t queued_prefill_tokens, kv_total, kv_free, kv_used, kv_cached;
    char target[160]; /* HOST:GRPC_PORT (decode instances) */
    /* Router side (under r->mu). */
    int64_t pending_blocks, pending_prefill;
    int32_t in_flight;
    int32_t down_polls; /* state pulls failed in a row */
    uint64_t routed, failures;
    char err[160];
    /* The poller's own (no lock). */
    CURL *easy;
    td_strbuf body;
    struct curl_slist *hdr;
} inst;

typedef enum { Q_NEW = 0, Q_QUEUED, Q_RUNNING, Q_DONE } req_state;

typedef struct rt_req {
    td_router *r;
    td_gen_stream *st;
    Tandem__V1__GenerateRequest *greq; /* owned: what every attempt sends */
    int32_t *prompt;                   /* (n_prompt) */
    int32_t n_prompt, max_tokens;
    char **stop; /* (n_stop) */
    int32_t n_stop;
    bool logprobs;
    char id[64];
    /* Under r->mu. */
    req_state state;
    struct rt_req *next;                /* in the queue */
    struct rt_req *all_prev, *all_next; /* in r->all from submit to release */
    td_rt_dcall *call;
    int attempts;
    td_rt_mask excluded;
    bool got_first, cancelled, finished, retry_hint, producer_done;
    bool counted; /* in r->n_streams */
    int32_t d, p;
    double t_arrival, t_queued, t_dispatch, t_first, t_last;
    char last_error[400];     /* for the logs: names the instance */
    const char *client_error; /* for the client (static or d_message), or NULL */
    int d_status;             /* the last attempt's in-stream Error: its HTTP status, 0 none */
    char d_message[256];      /* and its message (printable ASCII) */
    bool vanished;            /* its decode instance stopped answering: cancelled by us */
    td_kv_hash *hashes;       /* (n_hashes) the prompt's blocks in the chosen group */
    int32_t n_hashes;
} rt_req;

struct td_router {
    td_router_params p;
    char *token;
    char *prefill_dns, *decode_dns;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* the poller's wake-up; idle waiters */
    inst *in;          /* (MAXI) */
    int32_t n_slots;   /* highest used slot + 1 */
    td_kv_hash groups[MAX_GROUPS];
    int32_t group_bs[MAX_GROUPS];
    int32_t n_groups;
    float *xfer; /* (MAXI x MAXI) [p * MAXI + d] ms, < 0 unknown */
    td_rt_index *ix;
    td_rt_dclient *dc;
    rt_req *q_head, *q_tail;
    int32_t n_queued;
    int32_t n_active; /* requests submitted, not yet let go by the router */
    rt_req *all;      /* those requests */
    int32_t n_running;
    atomic_int n_streams; /* handed to a front end, not yet freed */
    uint64_t counter, rng;
    bool draining, stop;
    pthread_t poller;
    bool poller_started;
    td_net_watch *dns; /* --prefill-dns / --decode-dns, resolved on its own thread */
    const char *dns_names[2];
    int n_dns;
    char (*dns_addrs)[TD_NET_ADDR_LEN]; /* (n_dns x MAXI) the round taken (poller) */
    int dns_n[2];
    CURLM *multi;
    /* Counters (under mu). */
    uint64_t decisions[TD_RT_N_POLICIES][TD_RT_N_REASONS];
    uint64_t hit_prefill_tokens, hit_decode_tokens, prompt_tokens, retries, rejected, timeouts;
    uint64_t failed[2]; /* requests that ended in an error, before / after their first token */
    double decide_s;
    uint64_t n_decide;
};

td_router_params td_router_default_params(void) {
    return (td_router_params){.dns_interval_s = 5.0,
                              .poll_interval_s = 0.1,
                              .poll_timeout_s = 1.0,
                              .score = td_rt_score_default_params(),
                              .max_retries = 2,
                              .max_queued = 256,
                              .queue_timeout_s = 30.0,
                              .predict_ttl_s = 10.0,
                              .call_timeout_s = 0.0,
                              .block_size = 16};
}

/* ------------------------------------------------------------ instances */

/* Copies a peer's string as printable ASCII ('?' for anything else), so
 * that it can be cut anywhere and always stays valid JSON text. */
static void ascii_copy(char *dst, size_t n, const char *src) {
    size_t k = 0;
    for (; src && src[k] && k + 1 < n; k++) dst[k] = src[k] >= 0x20 && src[k] < 0x7f ? src[k] : '?';
    if (n) dst[k] = 0;
}

/* HOST:PORT or [V6]:PORT with a port in 1..65535 and printable host. */
static bool addr_ok(const char *a) {
    size_t n = strlen(a);
    if (n == 0 || n >= sizeof(((inst *)0)->addr) - 8) return false;
    const char *c = strrchr(a, ':');
    if (!c || c == a || !c[1]) return false;
    char *end = NULL;
    long port = strtol(c + 1, &end, 10);
    if (*end || port < 1 || port > 65535) return false;
    for (const char *s = a; s < c; s++)
        if (*s <= 0x20 || *s >= 0x7f || *s == '/' || *s == '@' || *s == '?' || *s == '#')
            return false;
    return true;
}

static int32_t slot_add(td_router *r, const char *addr, bool prefill, bool dns) {
    for (int32_t i = 0; i < MAXI; i++) {
        inst *x = &r->in[i];
        if (x->used) continue;
        memset(x, 0, sizeof *x);
        x->used = true;
        x->prefill = prefill;
        x->dns = dns;
        x->group = -1;
        snprintf(x->addr, sizeof x->addr, "%s", addr);
        snprintf(x->err, sizeof x->err, "not polled yet");
        if (i + 1 > r->n_slots) r->n_slots = i + 1;
        for (int32_t k = 0; k < MAXI; k++) {
            r->xfer[(size_t)i * MAXI + (size_t)k] = -1.0f;
            r->xfer[(size_t)k * MAXI + (size_t)i] = -1.0f;
        }
        return i;
    }
    TD_LOG_ERROR("more than %d instances: %s left out", MAXI, addr);
    return -1;
}

/* Poller thread, under mu: frees a removed slot that nothing uses. */
static void slot_free_locked(td_router *r, int32_t i) {
    inst *x = &r->in[i];
    if (x->easy) curl_easy_cleanup(x->easy);
    curl_slist_free_all(x->hdr);
    td_strbuf_free(&x->body);
    td_rt_index_clear(r->ix, i);
    if (!x->prefill && x->target[0]) td_rt_dclient_forget(r->dc, x->target);
    memset(x, 0, sizeof *x);
    while (r->n_slots > 0 && !r->in[r->n_slots - 1].used) r->n_slots--;
}

static bool usable(const td_router *r, int32_t i, const td_rt_mask *excluded) {
    const inst *x = &r->in[i];
    return x->used && !x->removed && x->healthy && x->have_state && !x->draining && x->group >= 0 &&
           (x->prefill || x->grpc_port > 0) && !(excluded && td_rt_mask_has(excluded, i));
}

/* ------------------------------------------------------------- requests */

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

/* ------------------------------------------------------------- routing */

/* The compatibility group of compat for slot `self` (whose own current
 * group does not count as in use): a group no other instance is in any
 * more is reused, so compat values that come and go (upgrades, restarts)
 * never exhaust the MAX_GROUPS live ones. -1 with MAX_GROUPS in use. */
static int32_t group_of_locked(td_router *r, td_kv_hash compat, int32_t bs, int32_t self) {
    for (int32_t g = 0; g < r->n_groups; g++)
        if (td_kv_hash_eq(r->groups[g], compat)) return g;
    int32_t g = r->n_groups;
    for (int32_t k = 0; k < r->n_groups && g == r->n_groups; k++) {
        bool in_use = false;
        for (int32_t i = 0; i < r->n_slots && !in_use; i++)
            in_use = i != self && r->in[i].used && r->in[i].group == k;
        if (!in_use) g = k;
    }
    if (g == MAX_GROUPS) return -1;
    r->groups[g] = compat;
    r->group_bs[g] = bs;
    if (g == r->n_groups) r->n_groups++;
    return g;
}

/* The pair will hold q's prompt blocks: predicted entries, so that its
 * siblings follow before the KV events arrive. Made at the decision and
 * renewed at the first token (a prefill may wait longer than the TTL). */
static void predict_locked(td_router *r, const rt_req *q, int32_t d, int32_t p, double now) {
    if (q->n_hashes <= 0) return;
    td_rt_index_predict(r->ix, d, q->hashes, (size_t)q->n_hashes, now, r->p.predict_ttl_s);
    if (p >= 0)
        td_rt_index_predict(r->ix, p, q->hashes, (size_t)q->n_hashes, now, r->p.predict_ttl_s);
}

/* Chooses the pair for q (under mu) and records the decision. */
static td_status route_locked(td_router *r, rt_req *q, td_rt_choice *c) {
    double t0 = td_time_s();
    /* (n_groups, n_prompt + 1) block hashes: every group's chain */
    td_kv_hash *hashes = malloc((size_t)(r->n_groups > 0 ? r->n_groups : 1) *
                                (size_t)(q->n_prompt + 1) * sizeof *hashes);
    if (!hashes) {
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    int32_t n = r->n_slots;
    td_rt_inst vi[MAXI];
    int32_t overlap[MAXI], pred[MAXI];
    memset(overlap, 0, sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    for (int32_t i = 0; i < n; i++) {
        const inst *x = &r->in[i];
        vi[i] = (td_rt_inst){.prefill = x->prefill,
                             .usable = usable(r, i, &q->excluded),
                             .group = x->group,
                             .block_size = x->block_size,
                             .queued_prefill_tokens = x->queued_prefill_tokens + x->pending_prefill,
                             .kv_free = x->kv_free,
                             .kv_used = x->kv_used,
                             .kv_total = x->kv_total,
                             .pending_blocks = x->pending_blocks,
                             .running = x->running + x->in_flight,
                             .waiting = x->waiting};
    }
    /* One walk of the prompt's hashes per compatibility group in use. */
    int32_t n_hash[MAX_GROUPS] = {0};
    bool kv = r->p.score.policy == TD_RT_KV_AWARE;
    for (int32_t g = 0; g < r->n_groups; g++) {
        td_rt_mask among = {{0}};
        bool any = false;
        for (int32_t i = 0; i < n; i++)
            if (vi[i].usable && vi[i].group == g) {
                td_rt_mask_set(&among, i);
                any = true;
            }
        if (!any) continue;
        n_hash[g] = td_kv_hash_chain(r->groups[g], q->prompt, q->n_prompt, r->group_bs[g],
                                     hashes + (size_t)g * (size_t)(q->n_prompt + 1));
        if (kv)
            td_rt_index_match(r->ix, hashes + (size_t)g * (size_t)(q->n_prompt + 1),
                              (size_t)n_hash[g], &among, t0, overlap, pred);
    }
    td_status st = td_rt_choose(&r->p.score, vi, n, kv ? overlap : NULL, r->xfer, MAXI, q->n_prompt,
                                q->max_tokens, r->counter, &r->rng, c);
    if (st != TD_OK) {
        free(hashes);
        return st;
    }
    r->counter++;
    inst *D = &r->in[c->d];
    int32_t bs = D->block_size > 0 ? D->block_size : 16;
    D->pending_blocks += c->need_blocks;
    D->in_flight++;
    D->routed++;
    inst *P = c->p >= 0 ? &r->in[c->p] : D;
    int64_t uncached = (int64_t)q->n_prompt - (int64_t)overlap[c->p >= 0 ? c->p : c->d] * bs;
    P->pending_prefill += uncached > 0 ? uncached : 0; /* what it will compute */
    if (c->p >= 0) P->routed++;
    r->decisions[r->p.score.policy][c->reason]++;
    r->prompt_tokens += (uint64_t)q->n_prompt;
    r->hit_decode_tokens += (uint64_t)overlap[c->d] * (uint64_t)bs;
    r->hit_prefill_tokens += (uint64_t)overlap[c->p >= 0 ? c->p : c->d] * (uint64_t)bs;
    int32_t g = D->group;
    q->n_hashes = 0;
    if (g >= 0 && n_hash[g] > 0) {
        /* Kept for the prediction's renewal at the first token. */
        td_kv_hash *keep = realloc(q->hashes, (size_t)n_hash[g] * sizeof *keep);
        if (keep) {
            memcpy(keep, hashes + (size_t)g * (size_t)(q->n_prompt + 1),
                   (size_t)n_hash[g] * sizeof *keep);
            q->hashes = keep;
            q->n_hashes = n_hash[g];
        }
        predict_locked(r, q, c->d, c->p, t0);
    }
    free(hashes);
    r->decide_s += td_time_s() - t0;
    r->n_decide++;
    return TD_OK;
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
        r->in[c->d].in_flight--; /* route_locked counted it */
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
 * TD_ERR_UNAVAILABLE: no usable decode instance. */
static td_status dispatch_locked(td_router *r, rt_req *q) {
    for (;;) {
        td_rt_choice c;
        td_status st = route_locked(r, q, &c);
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
                q->t_first = now;
                predict_locked(r, q, q->d, q->p, now);
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
        ascii_copy(q->d_message, sizeof q->d_message, e->message ? e->message : "error");
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
    if (!q->finished) {
        bool from_error = q->retry_hint && q->d_status > 0; /* an in-stream Error */
        if (grpc_status != 0 && !from_error) {
            char det[160];
            ascii_copy(det, sizeof det, details);
            snprintf(q->last_error, sizeof q->last_error, "%s: gRPC status %d: %s", D->addr,
                     grpc_status, det);
        }
        bool retry = !q->cancelled && !q->got_first && !r->stop &&
                     (q->retry_hint || (grpc_status != 0 && retryable_grpc(grpc_status)));
        if (retry && grpc_status == 14 && !q->retry_hint) {
            /* unreachable: out of rotation until its state answers again */
            D->healthy = false;
            D->failures++;
            ascii_copy(D->err, sizeof D->err, q->last_error);
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
static void cancel_calls_of_locked(td_router *r, int32_t d) {
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
    rc = r->draining || r->stop ? TD_ERR_UNAVAILABLE : dispatch_locked(r, q);
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

static void process_queue_locked(td_router *r) {
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
        if (route_locked(r, q, &c) != TD_OK) break; /* still no headroom: FIFO */
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

/* ------------------------------------------------------------- poller */

static size_t on_body(char *p, size_t sz, size_t n, void *ud) {
    inst *x = ud;
    size_t len = sz * n;
    if (x->body.n + len > STATE_LIMIT) return 0;
    td_strbuf_put(&x->body, p, len);
    return x->body.oom ? 0 : len;
}

static void mark_down(td_router *r, int32_t i, const char *fmt, const char *what) {
    pthread_mutex_lock(&r->mu);
    inst *x = &r->in[i];
    if (x->healthy || !x->have_state) x->failures++;
    x->healthy = false;
    snprintf(x->err, sizeof x->err, fmt, what);
    if (++x->down_polls == VANISHED_POLLS && !x->prefill) {
        TD_LOG_WARN("decode instance %s: %d state pulls failed in a row (%s): ending its calls",
                    x->addr, VANISHED_POLLS, x->err);
        cancel_calls_of_locked(r, i);
    }
    pthread_mutex_unlock(&r->mu);
}

/* A peer's figure, clamped to 0..FIG_MAX (sums of them cannot overflow). */
static int64_t fig(json_t *v) {
    json_int_t n = json_integer_value(v);
    return n < 0 ? 0 : n > FIG_MAX ? FIG_MAX : (int64_t)n;
}

static bool json_hash(json_t *v, td_kv_hash *h) {
    return json_is_string(v) && td_kv_hash_parse(json_string_value(v), h);
}

/* Applies one /internal/v1/state reply of instance i (poller thread). */
static void apply_state(td_router *r, int32_t i, const char *body, size_t len) {
    json_error_t jerr;
    json_t *root = json_loadb(body, len, 0, &jerr);
    json_t *load = json_object_get(root, "load");
    json_t *kv = json_object_get(load, "kv");
    json_t *ep = json_object_get(root, "epoch"), *cp = json_object_get(root, "compat");
    json_t *role = json_object_get(root, "role");
    td_kv_hash compat;
    const char *bad = NULL;
    if (!root)
        bad = "not JSON";
    else if (!json_is_object(load) || !json_is_object(kv) || !json_is_string(ep) ||
             !json_hash(cp, &compat) || !json_is_string(role) ||
             !json_is_integer(json_object_get(root, "last_seq")) ||
             !json_is_integer(json_object_get(kv, "block_size")))
        bad = "missing or mistyped fields";
    char *end = NULL;
    uint64_t epoch = bad ? 0 : strtoull(json_string_value(ep), &end, 16);
    if (!bad && (*end || epoch == 0)) bad = "bad epoch";
    pthread_mutex_lock(&r->mu);
    inst *x = &r->in[i];
    bool prefill = x->prefill;
    if (!bad && strcmp(json_string_value(role), prefill ? "prefill" : "decode") != 0)
        bad = prefill ? "not a prefill instance" : "not a decode instance";
    int64_t bs = bad ? 0 : json_integer_value(json_object_get(kv, "block_size"));
    if (!bad && (bs < 1 || bs > 4096)) bad = "bad block size";
    bool restarted = !bad && x->have_state && x->epoch != epoch;
    if (bad) {
        x->healthy = false;
        x->failures++;
        snprintf(x->err, sizeof x->err, "malformed state: %s", bad);
        pthread_mutex_unlock(&r->mu);
        TD_LOG_WARN("instance %s: malformed /internal/v1/state (%s)", x->addr, bad);
        json_decref(root);
        return;
    }
    uint64_t since_sent = x->since;
    pthread_mutex_unlock(&r->mu);

    /* The prefix index (its own lock). An instance holds at most its pool's
     * blocks: one that announces more is lying or out of step, and is
     * forgotten until a full snapshot (since=0) says again what it holds. */
    bool full = json_is_true(json_object_get(root, "full"));
    json_int_t last_v = json_integer_value(json_object_get(root, "last_seq"));
    uint64_t last = last_v > 0 ? (uint64_t)last_v : 0;
    size_t cap = (size_t)fig(json_object_get(kv, "total")) * 4 + 4096;
    bool over = false;
    if (restarted || full) td_rt_index_clear(r->ix, i);
    if (full) {
        json_t *hs = json_object_get(root, "hashes");
        over = json_array_size(hs) > cap;
        size_t k;
        json_t *v;
        json_array_foreach(hs, k, v) {
            td_kv_hash h;
            if (k >= cap) break;
            if (json_hash(v, &h)) td_rt_index_store(r->ix, i, &h, 1);
        }
    } else if (!restarted) {
        json_t *evs = json_object_get(root, "events");
        /* Only what follows the last "cleared" matters: one clear at most. */
        size_t from = 0, k;
        json_t *v;
        json_array_foreach(evs, k, v) {
            const char *t = json_string_value(json_object_get(v, "type"));
            if (t && !strcmp(t, "cleared")) from = k + 1;
        }
        if (from > 0) td_rt_index_clear(r->ix, i);
        json_array_foreach(evs, k, v) {
            const char *t = json_string_value(json_object_get(v, "type"));
            td_kv_hash h;
            if (k < from || !t || !json_hash(json_object_get(v, "hash"), &h)) continue;
            if (!strcmp(t, "stored"))
                td_rt_index_store(r->ix, i, &h, 1);
            else if (!strcmp(t, "removed"))
                td_rt_index_remove(r->ix, i, &h, 1);
        }
        if (td_rt_index_count(r->ix, i) > cap) {
            over = true;
            td_rt_index_clear(r->ix, i);
        }
    }
    if (over)
        TD_LOG_WARN("instance %s announced more blocks than its pool holds: index entries "
                    "dropped, asking for a full snapshot",
                    x->addr);
    TD_UNUSED(since_sent);

    pthread_mutex_lock(&r->mu);
    x->epoch = epoch;
    ascii_copy(x->id, sizeof x->id, json_string_value(json_object_get(root, "instance_id")));
    x->since = (restarted && !full) || over ? 0 : last;
    x->compat = compat;
    x->block_size = (int32_t)bs;
    x->group = group_of_locked(r, compat, (int32_t)bs, i);
    x->draining = json_is_true(json_object_get(root, "draining"));
    x->max_ctx = (int32_t)TD_MIN(fig(json_object_get(root, "max_ctx")), INT32_MAX);
    x->running = (int32_t)TD_MIN(fig(json_object_get(load, "running")), 1 << 30);
    x->waiting = (int32_t)TD_MIN(fig(json_object_get(load, "waiting")), 1 << 30);
    x->queued_prefill_tokens = fig(json_object_get(load, "queued_prefill_tokens"));
    x->kv_total = fig(json_object_get(kv, "total"));
    x->kv_free = fig(json_object_get(kv, "free"));
    x->kv_used = fig(json_object_get(kv, "used"));
    x->kv_cached = fig(json_object_get(kv, "cached"));
    x->down_polls = 0;
    x->pending_blocks = 0;
    x->pending_prefill = 0;
    int64_t gp = json_integer_value(json_object_get(root, "grpc_port"));
    if (!prefill) {
        x->grpc_port = gp > 0 && gp < 65536 ? (int32_t)gp : 0;
        const char *colon = strrchr(x->addr, ':');
        if (x->grpc_port > 0 && colon)
            snprintf(x->target, sizeof x->target, "%.*s:%d", (int)(colon - x->addr), x->addr,
                     x->grpc_port);
        /* The pairs' exposed transfer tails, as this decode instance measured them. */
        json_t *peers = json_object_get(json_object_get(root, "transfer"), "peers");
        size_t k;
        json_t *v;
        json_array_foreach(peers, k, v) {
            const char *a = json_string_value(json_object_get(v, "address"));
            json_t *ms = json_object_get(v, "transfer_tail_ms_avg");
            if (!a || !json_is_number(ms) || json_number_value(ms) <= 0) continue; /* unmeasured */
            for (int32_t p = 0; p < r->n_slots; p++)
                if (r->in[p].used && r->in[p].prefill && !strcmp(r->in[p].addr, a))
                    r->xfer[(size_t)p * MAXI + (size_t)i] = (float)json_number_value(ms);
        }
    }
    if (!x->healthy && x->have_state)
        TD_LOG_INFO("instance %s (%s) is back", x->addr, prefill ? "prefill" : "decode");
    x->healthy = true;
    x->have_state = true;
    x->err[0] = 0;
    pthread_mutex_unlock(&r->mu);
    json_decref(root);
}

static void poll_round(td_router *r) {
    int32_t n = 0, slots[MAXI];
    pthread_mutex_lock(&r->mu);
    for (int32_t i = 0; i < r->n_slots; i++)
        if (r->in[i].used && !r->in[i].removed) slots[n++] = i;
    uint64_t since[MAXI];
    for (int32_t k = 0; k < n; k++) since[k] = r->in[slots[k]].since;
    pthread_mutex_unlock(&r->mu);
    for (int32_t k = 0; k < n; k++) {
        inst *x = &r->in[slots[k]];
        if (!x->easy) {
            x->easy = curl_easy_init();
            char hdr[256];
            snprintf(hdr, sizeof hdr, "X-Tandem-Cluster-Token: %s", r->token);
            x->hdr = curl_slist_append(NULL, hdr);
            if (!x->easy || !x->hdr) {
                mark_down(r, slots[k], "%s", "out of memory");
                continue;
            }
        }
        char url[256];
        snprintf(url, sizeof url, "http://%s/internal/v1/state?since=%" PRIu64, x->addr, since[k]);
        td_strbuf_free(&x->body);
        curl_easy_setopt(x->easy, CURLOPT_URL, url);
        curl_easy_setopt(x->easy, CURLOPT_HTTPHEADER, x->hdr);
        curl_easy_setopt(x->easy, CURLOPT_WRITEFUNCTION, on_body);
        curl_easy_setopt(x->easy, CURLOPT_WRITEDATA, x);
        curl_easy_setopt(x->easy, CURLOPT_PRIVATE, x);
        curl_easy_setopt(x->easy, CURLOPT_TIMEOUT_MS, (long)(r->p.poll_timeout_s * 1000));
        curl_easy_setopt(x->easy, CURLOPT_CONNECTTIMEOUT_MS, (long)(r->p.poll_timeout_s * 1000));
        curl_easy_setopt(x->easy, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(x->easy, CURLOPT_PROTOCOLS_STR, "http");
        curl_multi_add_handle(r->multi, x->easy);
    }
    int running = 1;
    while (running) {
        if (curl_multi_perform(r->multi, &running) != CURLM_OK) break;
        if (running) curl_multi_poll(r->multi, NULL, 0, 100, NULL);
    }
    CURLMsg *m;
    int left;
    while ((m = curl_multi_info_read(r->multi, &left))) {
        if (m->msg != CURLMSG_DONE) continue;
        inst *x = NULL;
        curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&x);
        int32_t i = (int32_t)(x - r->in);
        long code = 0;
        curl_easy_getinfo(m->easy_handle, CURLINFO_RESPONSE_CODE, &code);
        if (m->data.result != CURLE_OK) {
            mark_down(r, i, "state pull failed: %s", curl_easy_strerror(m->data.result));
        } else if (code != 200) {
            char what[32];
            snprintf(what, sizeof what, "%ld", code);
            mark_down(r, i, "state pull answered HTTP %s", what);
        } else {
            apply_state(r, i, x->body.v ? x->body.v : "", x->body.n);
        }
    }
    for (int32_t k = 0; k < n; k++)
        if (r->in[slots[k]].easy) curl_multi_remove_handle(r->multi, r->in[slots[k]].easy);
}

/* One name's addresses from the latest DNS round (the watch's thread
 * resolves: the poller never waits on DNS). Caller holds r->mu. */
static void apply_dns(td_router *r, const char *spec, char (*found)[TD_NET_ADDR_LEN], int n,
                      bool prefill) {
    for (int32_t k = 0; k < n; k++) {
        bool have = false;
        for (int32_t i = 0; i < r->n_slots && !have; i++) {
            inst *x = &r->in[i];
            if (x->used && x->dns && x->prefill == prefill && !strcmp(x->addr, found[k])) {
                have = true;
                x->removed = false;
            }
        }
        if (!have && slot_add(r, found[k], prefill, true) >= 0)
            TD_LOG_INFO("discovered %s instance %s (%s)", prefill ? "prefill" : "decode", found[k],
                        spec);
    }
    for (int32_t i = 0; i < r->n_slots; i++) {
        inst *x = &r->in[i];
        if (!x->used || !x->dns || x->prefill != prefill || x->removed) continue;
        bool still = false;
        for (int32_t k = 0; k < n && !still; k++) still = !strcmp(x->addr, found[k]);
        if (!still) {
            x->removed = true;
            TD_LOG_INFO("%s instance %s left %s", prefill ? "prefill" : "decode", x->addr, spec);
        }
    }
}

static void *poller_main(void *arg) {
    td_router *r = arg;
    pthread_mutex_lock(&r->mu);
    while (!r->stop) {
        double now = td_time_s();
        if (r->dns && td_net_watch_take(r->dns, r->dns_addrs, r->dns_n)) {
            /* a name that did not resolve keeps the instances known */
            for (int k = 0; k < r->n_dns; k++)
                if (r->dns_n[k] >= 0)
                    apply_dns(r, r->dns_names[k], r->dns_addrs + (size_t)k * MAXI, r->dns_n[k],
                              r->dns_names[k] == r->prefill_dns);
        }
        pthread_mutex_unlock(&r->mu);
        poll_round(r);
        pthread_mutex_lock(&r->mu);
        td_rt_index_expire(r->ix, td_time_s()); /* under mu: lookups see times in order */
        for (int32_t i = 0; i < r->n_slots; i++)
            if (r->in[i].used && r->in[i].removed && r->in[i].in_flight == 0)
                slot_free_locked(r, i);
        process_queue_locked(r);
        /* Sleep until the next round; a request's end wakes the queue. */
        double until = now + r->p.poll_interval_s;
        while (!r->stop && td_time_s() < until) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            double left = until - td_time_s();
            if (left <= 0) break;
            long ns = ts.tv_nsec + (long)(left * 1e9);
            ts.tv_sec += ns / 1000000000L;
            ts.tv_nsec = ns % 1000000000L;
            pthread_cond_timedwait(&r->cv, &r->mu, &ts);
            if (r->q_head) process_queue_locked(r);
        }
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* --------------------------------------------------------- front ends */

static const char *router_not_ready(void *ctx) {
    td_router *r = ctx;
    pthread_mutex_lock(&r->mu);
    const char *why = r->draining ? "draining" : "no decode instance is ready";
    for (int32_t i = 0; !r->draining && i < r->n_slots; i++)
        if (!r->in[i].prefill && usable(r, i, NULL)) why = NULL;
    pthread_mutex_unlock(&r->mu);
    return why;
}

td_api_submit_hook td_router_submit_hook(td_router *r) {
    return (td_api_submit_hook){.submit = router_submit, .not_ready = router_not_ready, .ctx = r};
}

void td_router_gauges(void *ctx, td_metrics_gauges *g) {
    td_router *r = ctx;
    pthread_mutex_lock(&r->mu);
    g->running = r->n_running;
    g->waiting = r->n_queued;
    g->draining = r->draining;
    pthread_mutex_unlock(&r->mu);
}

char *td_router_metrics_text(void *ctx) {
    td_router *r = ctx;
    td_strbuf b = {0};
    char line[512];
    pthread_mutex_lock(&r->mu);
    td_strbuf_puts(&b, "# HELP tandem:router_decisions_total Routing decisions by policy and "
                       "reason (remote prefill, or local prefill and why).\n"
                       "# TYPE tandem:router_decisions_total counter\n");
    for (int p = 0; p < TD_RT_N_POLICIES; p++)
        for (int k = 0; k < TD_RT_N_REASONS; k++) {
            if (p != (int)r->p.score.policy && !r->decisions[p][k]) continue;
            snprintf(line, sizeof line,
                     "tandem:router_decisions_total{policy=\"%s\",reason=\"%s\"} %" PRIu64 "\n",
                     td_rt_policy_str((td_rt_policy)p), td_rt_reason_str((td_rt_reason)k),
                     r->decisions[p][k]);
            td_strbuf_puts(&b, line);
        }
    snprintf(line, sizeof line,
             "# HELP tandem:router_prefix_hit_tokens_total Prompt tokens the chosen instance "
             "held in its prefix cache (as the router's index saw it), by role.\n"
             "# TYPE tandem:router_prefix_hit_tokens_total counter\n"
             "tandem:router_prefix_hit_tokens_total{role=\"prefill\"} %" PRIu64 "\n"
             "tandem:router_prefix_hit_tokens_total{role=\"decode\"} %" PRIu64 "\n"
             "# HELP tandem:router_prompt_tokens_total Prompt tokens routed.\n"
             "# TYPE tandem:router_prompt_tokens_total counter\n"
             "tandem:router_prompt_tokens_total %" PRIu64 "\n",
             r->hit_prefill_tokens, r->hit_decode_tokens, r->prompt_tokens);
    td_strbuf_puts(&b, line);
    snprintf(line, sizeof line,
             "# HELP tandem:router_queue_length Requests waiting for KV headroom.\n"
             "# TYPE tandem:router_queue_length gauge\ntandem:router_queue_length %d\n"
             "# HELP tandem:router_queue_rejected_total Requests answered 429 (queue full).\n"
             "# TYPE tandem:router_queue_rejected_total counter\n"
             "tandem:router_queue_rejected_total %" PRIu64 "\n"
             "# HELP tandem:router_queue_timeouts_total Requests that waited past "
             "--queue-timeout.\n"
             "# TYPE tandem:router_queue_timeouts_total counter\n"
             "tandem:router_queue_timeouts_total %" PRIu64 "\n",
             r->n_queued, r->rejected, r->timeouts);
    td_strbuf_puts(&b, line);
    snprintf(line, sizeof line,
             "# HELP tandem:router_retries_total Requests sent again to another instance "
             "before their first token.\n"
             "# TYPE tandem:router_retries_total counter\ntandem:router_retries_total %" PRIu64 "\n"
             "# HELP tandem:router_decision_seconds Time spent choosing (hashing, index "
             "lookup, scoring).\n"
             "# TYPE tandem:router_decision_seconds summary\n"
             "tandem:router_decision_seconds_sum %.9f\n"
             "tandem:router_decision_seconds_count %" PRIu64 "\n",
             r->retries, r->decide_s, r->n_decide);
    td_strbuf_puts(&b, line);
    snprintf(line, sizeof line,
             "# HELP tandem:router_failed_total Requests that ended in an error, by whether a "
             "token had been sent (after: the decode instance failed mid-stream).\n"
             "# TYPE tandem:router_failed_total counter\n"
             "tandem:router_failed_total{stage=\"before_first_token\"} %" PRIu64 "\n"
             "tandem:router_failed_total{stage=\"after_first_token\"} %" PRIu64 "\n",
             r->failed[0], r->failed[1]);
    td_strbuf_puts(&b, line);
    td_strbuf_puts(&b, "# HELP tandem:router_instance_ready Instance in rotation (1) or not.\n"
                       "# TYPE tandem:router_instance_ready gauge\n");
    for (int32_t i = 0; i < r->n_slots; i++) {
        if (!r->in[i].used) continue;
        snprintf(line, sizeof line, "tandem:router_instance_ready{role=\"%s\",address=\"%s\"} %d\n",
                 r->in[i].prefill ? "prefill" : "decode", r->in[i].addr, usable(r, i, NULL));
        td_strbuf_puts(&b, line);
    }
    td_strbuf_puts(&b, "# HELP tandem:router_pair_transfer_ms Moving average of the exposed KV "
                       "transfer tail per (prefill, decode) pair (PrefillDone's arrival after "
                       "the prefill instance's last layer), as the decode instance measured "
                       "it.\n"
                       "# TYPE tandem:router_pair_transfer_ms gauge\n");
    for (int32_t p = 0; p < r->n_slots; p++)
        for (int32_t d = 0; d < r->n_slots; d++) {
            float ms = r->xfer[(size_t)p * MAXI + (size_t)d];
            if (!r->in[p].used || !r->in[d].used || ms <= 0) continue;
            snprintf(line, sizeof line,
                     "tandem:router_pair_transfer_ms{prefill=\"%s\",decode=\"%s\"} %.3f\n",
                     r->in[p].addr, r->in[d].addr, ms);
            td_strbuf_puts(&b, line);
        }
    pthread_mutex_unlock(&r->mu);
    if (b.oom) {
        td_strbuf_free(&b);
        return NULL;
    }
    return b.v;
}

char *td_router_cluster_json(void *ctx) {
    td_router *r = ctx;
    json_t *list = json_array(), *pairs = json_array();
    pthread_mutex_lock(&r->mu);
    for (int32_t i = 0; list && i < r->n_slots; i++) {
        const inst *x = &r->in[i];
        if (!x->used) continue;
        char ep[24], compat[33];
        snprintf(ep, sizeof ep, "%016" PRIx64, x->epoch);
        td_kv_hash_hex(x->compat, compat);
        json_t *o = json_pack(
            "{s:s,s:s,s:s,s:s,s:b,s:b,s:b,s:b,s:s,s:i,s:{s:i,s:i,s:I,s:{s:I,s:I,s:I,s:I,s:i}},"
            "s:I,s:i,s:I,s:I,s:I,s:s}",
            "role", x->prefill ? "prefill" : "decode", "address", x->addr, "instance_id", x->id,
            "epoch", ep, "ready", usable(r, i, NULL), "healthy", x->healthy, "draining",
            x->draining, "discovered", x->dns, "compat", compat, "group", x->group, "load",
            "running", x->running, "waiting", x->waiting, "queued_prefill_tokens",
            (json_int_t)x->queued_prefill_tokens, "kv", "total", (json_int_t)x->kv_total, "free",
            (json_int_t)x->kv_free, "used", (json_int_t)x->kv_used, "cached",
            (json_int_t)x->kv_cached, "block_size", x->block_size, "cached_blocks_indexed",
            (json_int_t)td_rt_index_count(r->ix, i), "in_flight", x->in_flight, "pending_blocks",
            (json_int_t)x->pending_blocks, "routed", (json_int_t)x->routed, "failures",
            (json_int_t)x->failures, "error", x->err);
        if (o && !x->prefill) json_object_set_new(o, "grpc_target", json_string(x->target));
        json_array_append_new(list, o);
    }
    for (int32_t p = 0; pairs && p < r->n_slots; p++)
        for (int32_t d = 0; d < r->n_slots; d++) {
            float ms = r->xfer[(size_t)p * MAXI + (size_t)d];
            if (!r->in[p].used || !r->in[d].used || ms <= 0) continue;
            json_array_append_new(pairs, json_pack("{s:s,s:s,s:f}", "prefill", r->in[p].addr,
                                                   "decode", r->in[d].addr, "transfer_ms", ms));
        }
    json_t *root = json_pack(
        "{s:s,s:o,s:o,s:i,s:i,s:I,s:b,s:{s:f,s:f,s:f,s:f,s:i,s:f,s:i,s:I}}", "policy",
        td_rt_policy_str(r->p.score.policy), "instances", list ? list : json_array(), "pairs",
        pairs ? pairs : json_array(), "queued", r->n_queued, "running", r->n_running,
        "index_blocks", (json_int_t)td_rt_index_size(r->ix), "draining", r->draining, "score",
        "overlap_weight", r->p.score.overlap_weight, "decode_weight", r->p.score.decode_weight,
        "transfer_weight", r->p.score.transfer_weight, "temperature", r->p.score.temperature,
        "local_prefill_tokens", r->p.score.local_prefill_tokens, "local_prefill_fraction",
        r->p.score.local_prefill_fraction, "local_prefill_max_tokens",
        r->p.score.local_prefill_max_tokens, "prefill_saturated_tokens",
        (json_int_t)r->p.score.prefill_saturated_tokens);
    pthread_mutex_unlock(&r->mu);
    char *s = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    return s;
}

void td_router_drain(td_router *r) {
    pthread_mutex_lock(&r->mu);
    r->draining = true;
    pthread_mutex_unlock(&r->mu);
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

bool td_router_wait_idle(td_router *r, double timeout_s) {
    double until = td_time_s() + timeout_s;
    pthread_mutex_lock(&r->mu);
    while (r->n_active > 0 && td_time_s() < until) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&r->cv, &r->mu, &ts);
    }
    bool idle = r->n_active == 0;
    pthread_mutex_unlock(&r->mu);
    /* Let the front ends write the last bytes of every finished stream. */
    double t_end = td_time_s() + 2.0;
    while (idle && atomic_load(&r->n_streams) > 0 && td_time_s() < t_end) {
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
    return idle;
}

/* ------------------------------------------------------ create/destroy */

td_status td_router_create(const td_router_params *p, td_router **r_p) {
    if (!p || !p->cluster_token || !*p->cluster_token || p->n_prefill < 0 || p->n_decode < 0 ||
        p->poll_interval_s <= 0 || p->max_retries < 0 || p->max_queued < 0 ||
        p->score.temperature < 0 || p->score.local_prefill_fraction < 0 ||
        (unsigned)p->score.policy >= TD_RT_N_POLICIES) {
        TD_LOG_ERROR("invalid router parameters");
        return TD_ERR_INVALID;
    }
    if (p->n_prefill + p->n_decode > MAXI) {
        TD_LOG_ERROR("%d instances: at most %d", p->n_prefill + p->n_decode, MAXI);
        return TD_ERR_INVALID;
    }
    if ((p->prefill_dns || p->decode_dns) &&
        !(p->dns_interval_s >= 0.001 && p->dns_interval_s <= 86400)) {
        TD_LOG_ERROR("dns_interval_s %g: 0.001 to 86400", p->dns_interval_s);
        return TD_ERR_INVALID;
    }
    char name[256], port[16];
    const char *lists[2] = {p->prefill_dns, p->decode_dns};
    for (int k = 0; k < 2; k++)
        if (lists[k] && !td_net_split(lists[k], name, sizeof name, port, sizeof port)) {
            TD_LOG_ERROR("'%s' is not NAME:PORT", lists[k]);
            return TD_ERR_INVALID;
        }
    for (int k = 0; k < p->n_prefill + p->n_decode; k++) {
        const char *a = k < p->n_prefill ? p->prefill[k] : p->decode[k - p->n_prefill];
        if (!a || !addr_ok(a)) {
            TD_LOG_ERROR("'%s' is not HOST:PORT", a ? a : "(null)");
            return TD_ERR_INVALID;
        }
    }
    td_router *r = calloc(1, sizeof *r);
    if (!r) return TD_ERR_NOMEM;
    r->p = *p;
    if (r->p.block_size <= 0) r->p.block_size = 16;
    r->rng = p->seed ? p->seed : td_random_u64();
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->token = strdup(p->cluster_token);
    r->prefill_dns = p->prefill_dns ? strdup(p->prefill_dns) : NULL;
    r->decode_dns = p->decode_dns ? strdup(p->decode_dns) : NULL;
    r->in = calloc(MAXI, sizeof *r->in);
    r->xfer = malloc((size_t)MAXI * MAXI * sizeof *r->xfer);
    r->multi = curl_multi_init();
    td_status st = TD_ERR_NOMEM;
    if (!r->token || (p->prefill_dns && !r->prefill_dns) || (p->decode_dns && !r->decode_dns) ||
        !r->in || !r->xfer || !r->multi)
        goto fail;
    for (size_t k = 0; k < (size_t)MAXI * MAXI; k++) r->xfer[k] = -1.0f;
    if ((st = td_rt_index_create(1 << 16, &r->ix)) != TD_OK) goto fail;
    if ((st = td_rt_dclient_create(&r->dc)) != TD_OK) goto fail;
    for (int k = 0; k < p->n_prefill + p->n_decode; k++) {
        bool pre = k < p->n_prefill;
        const char *a = pre ? p->prefill[k] : p->decode[k - p->n_prefill];
        bool dup = false;
        for (int32_t i = 0; i < r->n_slots && !dup; i++)
            dup = r->in[i].used && r->in[i].prefill == pre && !strcmp(r->in[i].addr, a);
        if (!dup) slot_add(r, a, pre, false);
    }
    if (r->prefill_dns) r->dns_names[r->n_dns++] = r->prefill_dns;
    if (r->decode_dns) r->dns_names[r->n_dns++] = r->decode_dns;
    if (r->n_dns > 0) {
        r->dns_addrs = calloc((size_t)r->n_dns * MAXI, sizeof *r->dns_addrs);
        td_net_watch_params wp = {.names = r->dns_names,
                                  .n_names = r->n_dns,
                                  .max_addrs = MAXI,
                                  .interval_ms = (int)(r->p.dns_interval_s * 1000.0),
                                  .wake_fd = -1,
                                  .what = "instances"};
        st = r->dns_addrs ? td_net_watch_create(&wp, &r->dns) : TD_ERR_NOMEM;
        if (st != TD_OK) goto fail;
    }
    if (pthread_create(&r->poller, NULL, poller_main, r) != 0) {
        TD_LOG_ERROR("pthread_create failed");
        st = TD_ERR_INTERNAL;
        goto fail;
    }
    r->poller_started = true;
    *r_p = r;
    return TD_OK;
fail:
    td_router_destroy(r);
    return st;
}

void td_router_destroy(td_router *r) {
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    r->stop = true;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    if (r->poller_started) pthread_join(r->poller, NULL);
    td_net_watch_destroy(r->dns); /* does not wait on a resolution under way */
    /* Cancels every call; their on_end ends the requests (no retry: stop). */
    td_rt_dclient_destroy(r->dc);
    pthread_mutex_lock(&r->mu);
    while (r->q_head) {
        rt_req *q = r->q_head;
        queue_unlink_locked(r, q);
        req_end_locked(r, q, TD_FINISH_ABORT, TD_ERR_UNAVAILABLE, -1, -1);
        req_release_locked(r, q);
    }
    pthread_mutex_unlock(&r->mu);
    for (int32_t i = 0; r->in && i < MAXI; i++) {
        if (r->in[i].easy) curl_easy_cleanup(r->in[i].easy);
        curl_slist_free_all(r->in[i].hdr);
        td_strbuf_free(&r->in[i].body);
    }
    if (r->multi) curl_multi_cleanup(r->multi);
    td_rt_index_destroy(r->ix);
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
    free(r->in);
    free(r->xfer);
    free(r->token);
    free(r->prefill_dns);
    free(r->decode_dns);
    free(r->dns_addrs);
    free(r);
}
