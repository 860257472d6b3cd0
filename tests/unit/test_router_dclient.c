/* The router's decode client (router/dclient.h) against real servers in
 * this process:
 *   - the decode side's own gRPC server (common/api/grpc.h with a cluster
 *     token) over a real scheduler on a tiny random model: a greedy stream
 *     arrives whole, and its tokens equal the same request submitted to the
 *     scheduler directly (an independent path); a wrong cluster token is
 *     UNAUTHENTICATED; a port nobody listens on is UNAVAILABLE at once;
 *   - a minimal gRPC C-core server written here on the same method, which
 *     either sends one valid chunk and then stalls until the call is
 *     cancelled, or sends bytes that are no GenerateResponse: cancellation,
 *     deadlines, the end of a call with its caller's reference given back
 *     before or after, destroy with calls in flight, a malformed response.
 * Every recorder checks that no callback follows on_end and that on_end
 * runs exactly once. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/api/grpc.h"
#include "common/base/threadpool.h"
#include "common/comm/comm.h"
#include "common/engine/forward.h"
#include "common/kv/kv.h"
#include "common/model/model.h"
#include "common/sched/sched.h"
#include "proto/internal.pb-c.h"
#include "proto/tandem.pb-c.h"
#include "router/dclient.h"

#define MAX_CTX     192
#define TOKEN       "dclient-test-token"
#define MAX_REC_TOK 256

/* ---- the decode side: a real scheduler and its gRPC server ---- */

typedef struct {
    td_model *m;
    td_kv_pool *kv;
    td_threadpool *tp;
    td_comm *comm;
    td_engine *e;
    td_exec *x;
    td_sched *s;
    td_grpc_server *srv;
    int32_t V;
    char target[64];
} decode_side;

static decode_side g_d;

static int decode_open(void **state) {
    (void)state;
    decode_side *d = &g_d;
    const char *dir = getenv("TANDEM_TEST_MODELS");
    if (!dir) return -1;
    char path[1024];
    snprintf(path, sizeof path, "%s/gguf/llama2-q8_0.gguf", dir);
    td_model_params mp = td_model_default_params();
    mp.path = path;
    if (td_model_load(&mp, &d->m) != TD_OK) return -1;
    const td_model_config *c = td_model_get_config(d->m);
    td_kv_params kp = td_kv_default_params();
    kp.n_layers = c->n_layer;
    kp.n_kv_heads = c->n_head_kv;
    kp.head_dim = c->head_dim;
    kp.n_blocks = 256;
    if (td_kv_pool_create(&kp, &d->kv) != TD_OK) return -1;
    if (td_threadpool_create(2, &d->tp) != TD_OK) return -1;
    if (td_comm_create_single(&d->comm) != TD_OK) return -1;
    td_engine_params ep = td_engine_default_params();
    ep.max_batch_tokens = 512;
    ep.max_seqs = 16;
    ep.max_ctx = MAX_CTX;
    if (td_engine_create(d->m, d->kv, d->tp, d->comm, &ep, &d->e) != TD_OK) return -1;
    d->V = c->n_vocab;
    td_sched_params sp = td_sched_default_params();
    sp.max_running = 8;
    sp.max_batch_tokens = 512;
    sp.max_ctx = MAX_CTX;
    sp.compat.lo = 42;
    if (td_exec_wrap(d->e, d->kv, d->m, &d->x) != TD_OK) return -1;
    if (td_sched_create(&sp, d->x, d->kv, td_model_tokenizer(d->m), NULL, &d->s) != TD_OK)
        return -1;
    td_grpc_params gp = td_grpc_default_params();
    gp.port = 0;
    gp.sched = d->s;
    gp.model.tok = td_model_tokenizer(d->m);
    gp.model.max_ctx = MAX_CTX;
    gp.cluster_token = TOKEN;
    if (td_grpc_server_start(&gp, &d->srv) != TD_OK) return -1;
    snprintf(d->target, sizeof d->target, "127.0.0.1:%d", td_grpc_server_port(d->srv));
    return 0;
}

static int decode_close(void **state) {
    (void)state;
    decode_side *d = &g_d;
    td_grpc_server_stop(d->srv);
    td_sched_destroy(d->s);
    td_exec_destroy(d->x);
    td_engine_destroy(d->e);
    td_comm_destroy(d->comm);
    td_threadpool_destroy(d->tp);
    td_kv_pool_destroy(d->kv);
    td_model_free(d->m);
    return 0;
}

static void make_prompt(int32_t *p, int n, uint32_t seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        p[i] = (int32_t)((seed >> 8) % (uint32_t)g_d.V);
    }
}

/* The scheduler's own greedy output for the prompt (no gRPC, no client). */
static int sched_direct(const int32_t *prompt, int n, int max_tokens, int32_t *out) {
    td_gen_request r;
    td_gen_request_init(&r);
    r.prompt = prompt;
    r.n_prompt = n;
    r.max_tokens = max_tokens;
    r.ignore_eos = true;
    r.sampling.temperature = 0;
    td_gen_stream *st = NULL;
    assert_int_equal(td_sched_submit(g_d.s, &r, &st), TD_OK);
    int n_out = 0;
    for (;;) {
        td_gen_delta d;
        assert_int_equal(td_gen_stream_read(st, 10000, &d), TD_OK);
        assert_true(n_out + d.n_tokens <= MAX_REC_TOK);
        memcpy(out + n_out, d.tokens, (size_t)d.n_tokens * sizeof(int32_t));
        n_out += d.n_tokens;
        if (d.finished) {
            assert_int_equal(d.finish, TD_FINISH_LENGTH);
            break;
        }
    }
    td_gen_stream_release(st);
    return n_out;
}

/* A packed InternalGenerate (malloc'd) asking for a greedy local prefill. */
static uint8_t *pack_request(const char *token, const int32_t *prompt, int n, int max_tokens,
                             size_t *len_p) {
    Tandem__V1__TokenIds ids = TANDEM__V1__TOKEN_IDS__INIT;
    ids.n_ids = (size_t)n;
    ids.ids = (int32_t *)prompt;
    Tandem__V1__SamplingParams sp = TANDEM__V1__SAMPLING_PARAMS__INIT;
    sp._temperature_case = TANDEM__V1__SAMPLING_PARAMS___TEMPERATURE_TEMPERATURE;
    sp.temperature = 0;
    sp._max_tokens_case = TANDEM__V1__SAMPLING_PARAMS___MAX_TOKENS_MAX_TOKENS;
    sp.max_tokens = max_tokens;
    sp.ignore_eos = true;
    Tandem__V1__GenerateRequest rq = TANDEM__V1__GENERATE_REQUEST__INIT;
    rq.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS;
    rq.token_ids = &ids;
    rq.sampling = &sp;
    Tandem__Internal__V1__InternalGenerate ig = TANDEM__INTERNAL__V1__INTERNAL_GENERATE__INIT;
    ig.cluster_token.data = (uint8_t *)token;
    ig.cluster_token.len = strlen(token);
    ig.request = &rq;
    ig.prefill_case = TANDEM__INTERNAL__V1__INTERNAL_GENERATE__PREFILL_LOCAL_PREFILL;
    ig.local_prefill = true;
    size_t len = tandem__internal__v1__internal_generate__get_packed_size(&ig);
    uint8_t *buf = malloc(len);
    assert_non_null(buf);
    tandem__internal__v1__internal_generate__pack(&ig, buf);
    *len_p = len;
    return buf;
}

/* ---- a recorder of one call's callbacks ---- */

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_resp, n_end, n_after_end, n_after_complete;
    int n_chunks;
    int32_t tokens[MAX_REC_TOK];
    int n_tokens;
    bool complete;
    char finish[32];
    uint32_t prompt_tokens, completion_tokens;
    int status;
    char details[256];
    bool stop_after_first; /* on_response returns false */
    /* on_end tries to start a call on this client (destroy in progress) */
    td_rt_dclient *start_in_end;
    td_status start_in_end_st;
} rec;

static void rec_init(rec *r) {
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->cv, &ca);
    pthread_condattr_destroy(&ca);
    r->status = -1;
    r->start_in_end_st = 1234;
}

static void rec_free(rec *r) {
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
}

static bool on_response(void *ctx, const Tandem__V1__GenerateResponse *m) {
    rec *r = ctx;
    pthread_mutex_lock(&r->mu);
    if (r->n_end) r->n_after_end++;
    if (r->complete) r->n_after_complete++;
    r->n_resp++;
    if (m->response_case == TANDEM__V1__GENERATE_RESPONSE__RESPONSE_CHUNK) {
        r->n_chunks++;
        for (size_t i = 0; i < m->chunk->n_token_ids && r->n_tokens < MAX_REC_TOK; i++)
            r->tokens[r->n_tokens++] = m->chunk->token_ids[i];
    } else if (m->response_case == TANDEM__V1__GENERATE_RESPONSE__RESPONSE_COMPLETE) {
        r->complete = true;
        snprintf(r->finish, sizeof r->finish, "%s", m->complete->finish_reason);
        r->prompt_tokens = m->complete->prompt_tokens;
        r->completion_tokens = m->complete->completion_tokens;
    }
    bool go_on = !r->stop_after_first;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return go_on;
}

static void on_end(void *ctx, int status, const char *details) {
    rec *r = ctx;
    td_rt_dclient *cl = NULL;
    pthread_mutex_lock(&r->mu);
    r->n_end++;
    r->status = status;
    assert_non_null(details);
    snprintf(r->details, sizeof r->details, "%s", details);
    cl = r->start_in_end;
    pthread_mutex_unlock(&r->mu);
    if (cl) {
        static const td_rt_dcall_cb cb = {on_response, on_end, NULL};
        td_rt_dcall *call = NULL;
        td_status st = td_rt_dcall_start(cl, g_d.target, (const uint8_t *)"", 0, 0, &cb, &call);
        pthread_mutex_lock(&r->mu);
        r->start_in_end_st = st;
        pthread_mutex_unlock(&r->mu);
    }
    pthread_mutex_lock(&r->mu);
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

static td_rt_dcall_cb rec_cb(rec *r) { return (td_rt_dcall_cb){on_response, on_end, r}; }

static bool rec_wait(rec *r, int n_resp, bool want_end, double timeout_s) {
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    long ns = dl.tv_nsec + (long)((timeout_s - (long)timeout_s) * 1e9);
    dl.tv_sec += (time_t)timeout_s + ns / 1000000000L;
    dl.tv_nsec = ns % 1000000000L;
    pthread_mutex_lock(&r->mu);
    bool ok = true;
    while (r->n_resp < n_resp || (want_end && r->n_end == 0)) {
        if (pthread_cond_timedwait(&r->cv, &r->mu, &dl) == ETIMEDOUT) {
            ok = false;
            break;
        }
    }
    pthread_mutex_unlock(&r->mu);
    return ok;
}

static void rec_check_end(rec *r, int status) {
    pthread_mutex_lock(&r->mu);
    assert_int_equal(r->n_end, 1);
    assert_int_equal(r->n_after_end, 0);
    assert_int_equal(r->status, status);
    pthread_mutex_unlock(&r->mu);
}

/* ---- a minimal C-core server on the same method ---- */

typedef enum { FAKE_STALL, FAKE_GARBAGE } fake_mode;
enum { TAG_NEW = 1, TAG_SEND, TAG_CLOSE };

/* Field 2 (chunk, length-delimited) claiming 127 bytes of which 14 follow:
 * no protobuf parser accepts it. */
static const char GARBAGE[] = "\x12\x7fnot a protobuf";

typedef struct fake_server fake_server;

typedef struct {
    fake_server *fs;
    grpc_call *call;
    grpc_call_details details;
    grpc_metadata_array md;
    grpc_byte_buffer *send_buf;
    int cancelled;
    int n_pending;
    int tag_new, tag_send, tag_close; /* their addresses are the tags, their values the kinds */
} fake_call;

struct fake_server {
    fake_mode mode;
    grpc_server *server;
    grpc_completion_queue *cq;
    pthread_t thread;
    int port;
    int shutdown_tag;
    atomic_int n_calls;
    char target[64];
};

static void fake_request(fake_server *fs) {
    fake_call *c = calloc(1, sizeof *c);
    assert_non_null(c);
    c->fs = fs;
    c->tag_new = TAG_NEW;
    c->tag_send = TAG_SEND;
    c->tag_close = TAG_CLOSE;
    grpc_call_details_init(&c->details);
    grpc_metadata_array_init(&c->md);
    assert_int_equal(grpc_server_request_call(fs->server, &c->call, &c->details, &c->md, fs->cq,
                                              fs->cq, &c->tag_new),
                     GRPC_CALL_OK);
}

static void fake_call_free(fake_call *c) {
    if (c->call) grpc_call_unref(c->call);
    if (c->send_buf) grpc_byte_buffer_destroy(c->send_buf);
    grpc_call_details_destroy(&c->details);
    grpc_metadata_array_destroy(&c->md);
    free(c);
}

static void fake_on_new(fake_call *c) {
    fake_server *fs = c->fs;
    fake_request(fs);
    atomic_fetch_add(&fs->n_calls, 1);
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->cancelled;
    assert_int_equal(grpc_call_start_batch(c->call, &op, 1, &c->tag_close, NULL), GRPC_CALL_OK);
    c->n_pending++;

    grpc_slice s;
    if (fs->mode == FAKE_GARBAGE) {
        s = grpc_slice_from_static_buffer(GARBAGE, sizeof GARBAGE - 1);
    } else {
        int32_t tok = 7;
        Tandem__V1__Chunk ch = TANDEM__V1__CHUNK__INIT;
        ch.n_token_ids = 1;
        ch.token_ids = &tok;
        Tandem__V1__GenerateResponse m = TANDEM__V1__GENERATE_RESPONSE__INIT;
        m.response_case = TANDEM__V1__GENERATE_RESPONSE__RESPONSE_CHUNK;
        m.chunk = &ch;
        uint8_t buf[64];
        size_t n = tandem__v1__generate_response__pack(&m, buf);
        s = grpc_slice_from_copied_buffer((const char *)buf, n);
    }
    c->send_buf = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = c->send_buf;
    size_t n_ops = 2;
    if (fs->mode == FAKE_GARBAGE) {
        /* and an OK status: the client must not believe it */
        ops[2].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[2].data.send_status_from_server.status = GRPC_STATUS_OK;
        n_ops = 3;
    }
    assert_int_equal(grpc_call_start_batch(c->call, ops, n_ops, &c->tag_send, NULL), GRPC_CALL_OK);
    c->n_pending++;
}

static void *fake_main(void *arg) {
    fake_server *fs = arg;
    for (;;) {
        grpc_event ev =
            grpc_completion_queue_next(fs->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        if (ev.type != GRPC_OP_COMPLETE) continue;
        if (ev.tag == &fs->shutdown_tag) {
            grpc_completion_queue_shutdown(fs->cq);
            continue;
        }
        /* the tag is one of a call's three ints, each holding its kind */
        int *tag = ev.tag;
        int kind = *tag;
        fake_call *c = (fake_call *)(void *)((char *)tag -
                                             (kind == TAG_NEW    ? offsetof(fake_call, tag_new)
                                              : kind == TAG_SEND ? offsetof(fake_call, tag_send)
                                                                 : offsetof(fake_call, tag_close)));
        if (kind == TAG_NEW) {
            if (!ev.success) {
                fake_call_free(c); /* shutting down */
                continue;
            }
            fake_on_new(c);
            continue;
        }
        if (--c->n_pending == 0) fake_call_free(c);
    }
    return NULL;
}

/* On addr ("127.0.0.1:0", "[::1]:0"); false when it cannot be bound. */
static bool fake_start_on(fake_server *fs, fake_mode mode, const char *addr) {
    memset(fs, 0, sizeof *fs);
    fs->mode = mode;
    grpc_init();
    fs->cq = grpc_completion_queue_create_for_next(NULL);
    fs->server = grpc_server_create(NULL, NULL);
    grpc_server_register_completion_queue(fs->server, fs->cq, NULL);
    grpc_server_credentials *cr = grpc_insecure_server_credentials_create();
    fs->port = grpc_server_add_http2_port(fs->server, addr, cr);
    grpc_server_credentials_release(cr);
    if (fs->port <= 0) {
        grpc_server_destroy(fs->server);
        grpc_completion_queue_shutdown(fs->cq);
        grpc_completion_queue_destroy(fs->cq);
        grpc_shutdown();
        return false;
    }
    grpc_server_start(fs->server);
    snprintf(fs->target, sizeof fs->target, "%.*s%d", (int)(strrchr(addr, ':') - addr + 1), addr,
             fs->port);
    for (int i = 0; i < 4; i++) fake_request(fs);
    assert_int_equal(pthread_create(&fs->thread, NULL, fake_main, fs), 0);
    return true;
}

static void fake_start(fake_server *fs, fake_mode mode) {
    assert_true(fake_start_on(fs, mode, "127.0.0.1:0"));
}

static void fake_stop(fake_server *fs) {
    grpc_server_shutdown_and_notify(fs->server, fs->cq, &fs->shutdown_tag);
    grpc_server_cancel_all_calls(fs->server);
    pthread_join(fs->thread, NULL);
    grpc_server_destroy(fs->server);
    grpc_completion_queue_destroy(fs->cq);
    grpc_shutdown();
}

/* c-ares 1.18.1 (Debian 12), gRPC's resolver for names, leaks 10 bytes
 * when it resolves "localhost"; only its own allocations are excused. */
const char *__lsan_default_suppressions(void);
const char *__lsan_default_suppressions(void) { return "leak:libcares.so\n"; }

/* ---- tests ---- */

static void test_stream_equals_sched(void **state) {
    (void)state;
    enum { N_CALLS = 2, N_PROMPT = 9, N_TOK = 20 };
    int32_t prompt[N_CALLS][N_PROMPT];
    rec r[N_CALLS];
    td_rt_dcall *call[N_CALLS];
    td_rt_dclient *cl = NULL;
    assert_int_equal(td_rt_dclient_create(&cl), TD_OK);
    for (int i = 0; i < N_CALLS; i++) {
        make_prompt(prompt[i], N_PROMPT, 11u + 977u * (uint32_t)i);
        rec_init(&r[i]);
        size_t len;
        uint8_t *msg = pack_request(TOKEN, prompt[i], N_PROMPT, N_TOK, &len);
        td_rt_dcall_cb cb = rec_cb(&r[i]);
        assert_int_equal(td_rt_dcall_start(cl, g_d.target, msg, len, 30, &cb, &call[i]), TD_OK);
        free(msg); /* copied */
    }
    for (int i = 0; i < N_CALLS; i++) {
        assert_true(rec_wait(&r[i], 0, true, 20));
        rec_check_end(&r[i], 0);
        assert_string_equal(r[i].details, "");
        assert_true(r[i].complete);
        assert_int_equal(r[i].n_after_complete, 0);
        assert_string_equal(r[i].finish, "length");
        assert_int_equal(r[i].n_tokens, N_TOK);
        assert_true(r[i].n_chunks >= 1);
        assert_int_equal(r[i].completion_tokens, N_TOK);
        assert_int_equal(r[i].prompt_tokens, N_PROMPT);
        td_rt_dcall_release(call[i]); /* after the end */
    }
    td_rt_dclient_destroy(cl);
    for (int i = 0; i < N_CALLS; i++) {
        int32_t want[MAX_REC_TOK];
        int n = sched_direct(prompt[i], N_PROMPT, N_TOK, want);
        assert_int_equal(n, N_TOK);
        assert_memory_equal(r[i].tokens, want, sizeof(int32_t) * N_TOK);
    }
    /* two prompts, two outputs: a constant stream could not pass */
    assert_memory_not_equal(r[0].tokens, r[1].tokens, sizeof(int32_t) * N_TOK);
    for (int i = 0; i < N_CALLS; i++) rec_free(&r[i]);
}

static void test_wrong_token(void **state) {
    (void)state;
    td_rt_dclient *cl = NULL;
    assert_int_equal(td_rt_dclient_create(&cl), TD_OK);
    int32_t prompt[5];
    make_prompt(prompt, 5, 3);
    size_t len;
    uint8_t *msg = pack_request("not-the-token", prompt, 5, 4, &len);
    rec r;
    rec_init(&r);
    td_rt_dcall_cb cb = rec_cb(&r);
    td_rt_dcall *call = NULL;
    assert_int_equal(td_rt_dcall_start(cl, g_d.target, msg, len, 10, &cb, &call), TD_OK);
    free(msg);
    assert_true(rec_wait(&r, 0, true, 10));
    rec_check_end(&r, GRPC_STATUS_UNAUTHENTICATED);
    assert_int_equal(r.n_resp, 0);
    assert_non_null(strstr(r.details, "cluster token"));
    td_rt_dcall_release(call);
    td_rt_dclient_destroy(cl);
    rec_free(&r);
}

/* A loopback port that was just free: bound, then closed. */
static int dead_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t n = sizeof a;
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &n), 0);
    close(fd);
    return ntohs(a.sin_port);
}

static void test_unavailable(void **state) {
    (void)state;
    td_rt_dclient *cl = NULL;
    assert_int_equal(td_rt_dclient_create(&cl), TD_OK);
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", dead_port());
    int32_t prompt[5];
    make_prompt(prompt, 5, 3);
    size_t len;
    uint8_t *msg = pack_request(TOKEN, prompt, 5, 4, &len);
    char target6[64];
    snprintf(target6, sizeof target6, "[::1]:%d", dead_port());
    /* twice: the first connects, the second meets the backed-off channel;
     * then an IPv6 literal (refused, or unreachable without IPv6) */
    for (int k = 0; k < 3; k++) {
        rec r;
        rec_init(&r);
        td_rt_dcall_cb cb = rec_cb(&r);
        td_rt_dcall *call = NULL;
        double t0 = td_time_s();
        assert_int_equal(td_rt_dcall_start(cl, k < 2 ? target : target6, msg, len, 0, &cb, &call),
                         TD_OK);
        assert_true(rec_wait(&r, 0, true, 5));
        double dt = td_time_s() - t0;
        rec_check_end(&r, GRPC_STATUS_UNAVAILABLE);
        assert_int_equal(r.n_resp, 0);
        assert_true(dt < 2.0);
        td_rt_dcall_release(call);
        rec_free(&r);
    }
    free(msg);
    td_rt_dclient_destroy(cl);
}

static void test_invalid_target(void **state) {
    (void)state;
    td_rt_dclient *cl = NULL;
    assert_int_equal(td_rt_dclient_create(&cl), TD_OK);
    const char *bad[] = {"",           "nohost",  "host:",    ":80",    "host:0",
                         "host:65536", "host:8x", "a b:80",   "[::1",   "[::1]80",
                         "[]:80",      "[zz]:80", "h:123456", "x\n:80", "dns:///h:1"};
    rec r;
    rec_init(&r);
    td_rt_dcall_cb cb = rec_cb(&r);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        td_rt_dcall *call = NULL;
        assert_int_equal(td_rt_dcall_start(cl, bad[i], (const uint8_t *)"", 0, 0, &cb, &call),
                         TD_ERR_INVALID);
        assert_null(call);
    }
    td_rt_dcall *call = NULL;
    assert_int_equal(td_rt_dcall_start(cl, g_d.target, (const uint8_t *)"", 0, -1, &cb, &call),
                     TD_ERR_INVALID);
    td_rt_dclient_destroy(cl);
    assert_int_equal(r.n_end, 0);
    assert_int_equal(r.n_resp, 0);
    rec_free(&r);
}

static void test_cancel_mid_stream(void **state) {
    (void)state;
    fake_server fs;
    fake_start(&fs, FAKE_STALL);
    td_rt_dclient *cl = NULL;
    assert_int_equal(td_rt_dclient_create(&cl), TD_OK);

    /* cancelled by the caller's thread, released after the end */
    rec r;
    rec_init(&r);
    td_rt_dcall_cb cb = rec_cb(&r);
    td_rt_dcall *call = NULL;
    assert_int_equal(td_rt_dcall_start(cl, fs.target, (const uint8_t *)"x", 1, 0, &cb, &call),
                     TD_OK);
    assert_true(rec_wait(&r, 1, false, 5));
    assert_int_equal(r.tokens[0], 7);
    pthread_mutex_lock(&r.mu);
    assert_int_equal(r.n_end, 0); /* the server is stalling, not ending */
    pthread_mutex_unlock(&r.mu);
    td_rt_dcall_cancel(call);
    td_rt_dcall_cancel(call); /* idempotent */
    assert_true(rec_wait(&r, 1, true, 5));
    rec_check_end(&r, GRPC_STATUS_CANCELLED);
    assert_int_equal(r.n_resp, 1);
    td_rt_dcall_cancel(call); /* after the end: nothing */
    td_rt_dcall_release(call);

    /* cancelled by on_response returning false */
    rec r2;
    rec_init(&r2);
    r2.stop_after_first = true;
    cb = rec_cb(&r2);
    assert_int_equal(td_rt_dcall_start(cl, fs.target, (const uint8_t *)"x", 1, 0, &cb, &call),
                     TD_OK);
    assert_true(rec_wait(&r2, 1, true, 5));
    rec_check_end(&r2, GRPC_STATUS_CANCELLED);
    assert_int_equal(r2.n_resp, 1);
    td_rt_dcall_release(call);

    /* a deadline, with the caller's reference given back before the end */
    rec r3;
    rec_init(&r3);
    cb = rec_cb(&r3);
    double t0 = td_time_s();
    assert_int_equal(td_rt_dcall_start(cl, fs.target, (const uint8_t *)"x", 1, 0.3, &cb, &call),
                     TD_OK);
    td_rt_dcall_release(call);
    assert_true(rec_wait(&r3, 1, true, 5));
    double dt = td_time_s() - t0;
    rec_check_end(&r3, GRPC_STATUS_DEADLINE_EXCEEDED);
    assert_true(dt >= 0.25 && dt < 3.0);

    td_rt_dclient_destroy(cl);
    fake_stop(&fs);
    /* every call reached the server */
    assert_int_equal(atomic_load(&fs.n_calls), 3);
    rec_free(&r);
    rec_free(&r2);
    rec_free(&r3);
}

static void test_release_before_end(void **state) {
    (void)state;
    td_rt_dclient *cl = NULL;
    assert_int_equal(td_rt_dclient_create(&cl), TD_OK);
    int32_t prompt[6];
    make_prompt(prompt, 6, 5);
    size_t len;
    uint8_t *msg = pack_request(TOKEN, prompt, 6, 8, &len);
    rec r;
    rec_init(&r);
    td_rt_dcall_cb cb = rec_cb(&r);
    td_rt_dcall *call = NULL;
    assert_int_equal(td_rt_dcall_start(cl, g_d.target, msg, len, 0, &cb, &call), TD_OK);
    td_rt_dcall_release(call); /* the stream goes on without the caller's reference */
    free(msg);
    assert_true(rec_wait(&r, 0, true, 20));
    rec_check_end(&r, 0);
    assert_int_equal(r.n_tokens, 8);
    assert_true(r.complete);
    td_rt_dclient_destroy(cl);
    rec_free(&r);
}

static void test_forget(void **state) {
    (void)state;
    td_rt_dclient *cl = NULL;
    assert_int_equal(td_rt_dclient_create(&cl), TD_OK);
    td_rt_dclient_forget(cl, "127.0.0.1:1"); /* unknown: nothing */
    int32_t prompt[6];
    make_prompt(prompt, 6, 9);
    size_t len;
    uint8_t *msg = pack_request(TOKEN, prompt, 6, 16, &len);
    rec r[2];
    for (int k = 0; k < 2; k++) {
        rec_init(&r[k]);
        td_rt_dcall_cb cb = rec_cb(&r[k]);
        td_rt_dcall *call = NULL;
        assert_int_equal(td_rt_dcall_start(cl, g_d.target, msg, len, 0, &cb, &call), TD_OK);
        /* dropped from the cache while the call runs: the call goes on, the
         * next one gets a new channel */
        td_rt_dclient_forget(cl, g_d.target);
        assert_true(rec_wait(&r[k], 0, true, 20));
        rec_check_end(&r[k], 0);
        assert_int_equal(r[k].n_tokens, 16);
        td_rt_dcall_release(call);
    }
    assert_memory_equal(r[0].tokens, r[1].tokens, 16 * sizeof(int32_t));
    free(msg);
    td_rt_dclient_destroy(cl);
    rec_free(&r[0]);
    rec_free(&r[1]);
}

/* An IPv6 literal target reaches its server (when the host has IPv6). */
static void test_ipv6_target(void **state) {
    (void)state;
    fake_server fs;
    if (!fake_start_on(&fs, FAKE_STALL, "[::1]:0")) skip();
    assert_int_equal(fs.target[0], '[');
    td_rt_dclient *cl = NULL;
    assert_int_equal(td_rt_dclient_create(&cl), TD_OK);
    rec r;
    rec_init(&r);
    td_rt_dcall_cb cb = rec_cb(&r);
    td_rt_dcall *call = NULL;
    assert_int_equal(td_rt_dcall_start(cl, fs.target, (const uint8_t *)"x", 1, 5, &cb, &call),
                     TD_OK);
    assert_true(rec_wait(&r, 1, false, 5));
    assert_int_equal(r.tokens[0], 7);
    td_rt_dcall_cancel(call);
    assert_true(rec_wait(&r, 1, true, 5));
    rec_check_end(&r, GRPC_STATUS_CANCELLED);
    td_rt_dcall_release(call);
    td_rt_dclient_destroy(cl);
    fake_stop(&fs);
    rec_free(&r);
}

static void test_destroy_in_flight(void **state) {
    (void)state;
    fake_server fs;
    fake_start(&fs, FAKE_STALL);
    td_rt_dclient *cl = NULL;
    assert_int_equal(td_rt_dclient_create(&cl), TD_OK);
    enum { N_STALL = 3, N_REAL = 2, N = N_STALL + N_REAL + 1 };
    rec r[N];
    td_rt_dcall *call[N];
    int32_t prompt[8];
    make_prompt(prompt, 8, 21);
    size_t len;
    uint8_t *msg = pack_request(TOKEN, prompt, 8, 150, &len);
    char dead[64];
    snprintf(dead, sizeof dead, "127.0.0.1:%d", dead_port());
    for (int i = 0; i < N; i++) {
        rec_init(&r[i]);
        td_rt_dcall_cb cb = rec_cb(&r[i]);
        const char *t = i < N_STALL ? fs.target : i < N_STALL + N_REAL ? g_d.target : dead;
        assert_int_equal(td_rt_dcall_start(cl, t, msg, len, 0, &cb, &call[i]), TD_OK);
    }
    free(msg);
    /* the stalled calls are mid-stream */
    for (int i = 0; i < N_STALL; i++) assert_true(rec_wait(&r[i], 1, false, 5));
    td_rt_dcall_release(call[0]); /* before the end */
    pthread_mutex_lock(&r[1].mu);
    r[1].start_in_end = cl; /* a start during destroy is refused */
    pthread_mutex_unlock(&r[1].mu);
    td_rt_dclient_destroy(cl);
    for (int i = 0; i < N; i++) {
        pthread_mutex_lock(&r[i].mu);
        assert_int_equal(r[i].n_end, 1);
        assert_int_equal(r[i].n_after_end, 0);
        pthread_mutex_unlock(&r[i].mu);
    }
    for (int i = 0; i < N_STALL; i++) assert_int_equal(r[i].status, GRPC_STATUS_CANCELLED);
    assert_int_equal(r[1].start_in_end_st, TD_ERR_UNAVAILABLE);
    for (int i = 1; i < N; i++) td_rt_dcall_release(call[i]); /* after the client is gone */
    fake_stop(&fs);
    for (int i = 0; i < N; i++) rec_free(&r[i]);
    /* the decode side let go of the cancelled generations */
    assert_true(td_sched_wait_idle(g_d.s, 10.0));
}

static void test_malformed_response(void **state) {
    (void)state;
    /* the bytes really are no GenerateResponse */
    assert_null(
        tandem__v1__generate_response__unpack(NULL, sizeof GARBAGE - 1, (const uint8_t *)GARBAGE));
    fake_server fs;
    fake_start(&fs, FAKE_GARBAGE);
    td_rt_dclient *cl = NULL;
    assert_int_equal(td_rt_dclient_create(&cl), TD_OK);
    char by_name[64];
    snprintf(by_name, sizeof by_name, "localhost:%d", fs.port);
    for (int k = 0; k < 2; k++) {
        rec r;
        rec_init(&r);
        td_rt_dcall_cb cb = rec_cb(&r);
        td_rt_dcall *call = NULL;
        /* the second by name (the resolver's path) */
        assert_int_equal(td_rt_dcall_start(cl, k == 0 ? fs.target : by_name, (const uint8_t *)"x",
                                           1, 5, &cb, &call),
                         TD_OK);
        if (k == 1) td_rt_dcall_release(call);
        assert_true(rec_wait(&r, 0, true, 5));
        rec_check_end(&r, GRPC_STATUS_INTERNAL);
        assert_int_equal(r.n_resp, 0);
        assert_non_null(strstr(r.details, "malformed"));
        if (k == 0) td_rt_dcall_release(call);
        rec_free(&r);
    }
    td_rt_dclient_destroy(cl);
    fake_stop(&fs);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stream_equals_sched),
        cmocka_unit_test(test_wrong_token),
        cmocka_unit_test(test_unavailable),
        cmocka_unit_test(test_invalid_target),
        cmocka_unit_test(test_cancel_mid_stream),
        cmocka_unit_test(test_release_before_end),
        cmocka_unit_test(test_forget),
        cmocka_unit_test(test_ipv6_target),
        cmocka_unit_test(test_destroy_in_flight),
        cmocka_unit_test(test_malformed_response),
    };
    return cmocka_run_group_tests(tests, decode_open, decode_close);
}
