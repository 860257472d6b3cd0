/* tandem serve: one colocated instance (prefill and decode in one process)
 * behind the OpenAI HTTP API and the gRPC service. SIGTERM drains.
 *
 * The same server runs the services in their roles (serve.h): tandem-prefill
 * (prefill/service.c: KV exported to decode instances over UCX, internal
 * HTTP endpoints only) and tandem-decode (decode/service.c: the public API,
 * with the prompt's KV imported from prefill instances); the role brings
 * its options and its side of the transfer (common/transfer/xfer.h). */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/api/grpc.h"
#include "common/api/http.h"
#include "common/api/request.h"
#include "common/base/stop.h"
#include "common/kv/hash.h"
#include "common/obs/metrics.h"
#include "common/runtime/cli.h"
#include "common/runtime/runtime.h"
#include "common/sched/sched.h"
#include "common/tokenizer/chat.h"
#include "common/transfer/xfer.h"
#include "serve.h"

#define SERVE_MAX_KEYS 16

static const char *role_name(const td_serve_role_def *role) {
    return role ? role->prog : "tandem serve";
}

/* The options every service has (a role adds its own: serve.h). */
enum { C_TOKEN, C_TOKEN_FILE, C_INSTANCE_ID, C_N };
static const td_opt k_cluster_opts[C_N] = {
    [C_TOKEN] = {"cluster-token", 0, "T",
                 "the cluster's shared secret (internal endpoints\n"
                 "and every control message)"},
    [C_TOKEN_FILE] = {"cluster-token-file", 0, "PATH", "the same, read from a file (first line)"},
    [C_INSTANCE_ID] = {"instance-id", 0, "NAME", "name given to peers (default HOST:PORT)"},
};

enum {
    S_MODEL,
    S_HOST,
    S_PORT,
    S_GRPC_PORT,
    S_API_KEY,
    S_API_KEY_FILE,
    S_METRICS_NEED_KEY,
    S_SERVED_NAME,
    S_CHAT_TEMPLATE,
    S_TRUST_REQUEST_TEMPLATE,
    S_THREADS,
    S_CTX,
    S_KV_MEMORY,
    S_KV_BLOCKS,
    S_BLOCK_SIZE,
    S_KV_DTYPE,
    S_ACT_INT8,
    S_MMAP,
    S_MAX_RUNNING,
    S_MAX_BATCH_TOKENS,
    S_PREFILL_SHARE,
    S_TPOT_TARGET,
    S_MAX_WAITING,
    S_RESERVE_OUTPUT,
    S_NO_PREFIX_CACHE,
    S_STEP_TRACE,
    S_DRAIN_TIMEOUT,
    S_PING_INTERVAL,
    S_ISA,
    S_DEVICE,
    S_N
};
static td_opt k_serve_opts[S_N] = {
    /* the --model help names the default: set in parse_args */
    [S_MODEL] = {"model", 'm', "PATH", "GGUF file or Hugging Face directory"},
    [S_HOST] = {"host", 0, "ADDR", "address to bind (default 127.0.0.1)"},
    [S_PORT] = {"port", 0, "N", "HTTP port (default 8000; 0 = ephemeral)"},
    [S_GRPC_PORT] = {"grpc-port", 0, "N", "gRPC port (default 50051; 0 = ephemeral; -1 = off)"},
    [S_API_KEY] = {"api-key", 0, "KEY",
                   "require 'Authorization: Bearer KEY' (repeatable, up to " TD_STR(
                       SERVE_MAX_KEYS) ")"},
    [S_API_KEY_FILE] = {"api-key-file", 0, "PATH",
                        "the same, a key per line of the file (a mounted Secret:\n"
                        "keeps the keys off the command line)"},
    [S_METRICS_NEED_KEY] = {"metrics-need-key", 0, NULL, "put /metrics behind the API key too"},
    [S_SERVED_NAME] = {"served-model-name", 0, "NAME", TD_CLI_HELP_SERVED_NAME},
    [S_TRUST_REQUEST_TEMPLATE] = {"trust-request-chat-template", 0, NULL,
                                  TD_CLI_HELP_TRUST_TEMPLATE},
    [S_CHAT_TEMPLATE] = {"chat-template", 0, "NAME|FILE", TD_CLI_HELP_CHAT_TEMPLATE},
    [S_THREADS] = {"threads", 't', "N", "compute threads (default: every core)"},
    [S_CTX] = {"ctx", 0, "N", "context length per sequence (default: min(trained, 4096))"},
    [S_KV_MEMORY] = {"kv-memory", 0, "BYTES", "KV pool size, e.g. 512M, 2G (default 1G)"},
    [S_KV_BLOCKS] = {"kv-blocks", 0, "N", "KV pool size in blocks (overrides --kv-memory)"},
    [S_BLOCK_SIZE] = {"block-size", 0, "N", "tokens per KV block (default 16)"},
    [S_KV_DTYPE] = {"kv-dtype", 0, "T",
                    TD_KV_DTYPE_HELP ";\na prefill and a decode instance pair only with the same"},
    [S_ACT_INT8] = {"act-int8", 0, NULL, TD_ACT_INT8_HELP},
    [S_MMAP] = {"mmap", 0, NULL, TD_MMAP_HELP},
    [S_MAX_RUNNING] = {"max-running", 0, "N", "sequences decoding at once (default 16)"},
    [S_MAX_BATCH_TOKENS] = {"max-batch-tokens", 0, "N",
                            "tokens per step, decode + prefill chunks (default 512)"},
    [S_PREFILL_SHARE] = {"prefill-share", 0, "F",
                         "share of --max-batch-tokens prompt chunks may take in a\n"
                         "step that also decodes, 0 < F <= 1 (default 1)"},
    [S_TPOT_TARGET] = {"tpot-target-ms", 0, "MS|auto",
                       "forward-pass time a step that also decodes may reach:\n"
                       "its prompt chunks are sized to it from the step times\n"
                       "measured (at least one token); auto: 3x the time the\n"
                       "step's decodes take alone; 0: no target (default)"},
    [S_MAX_WAITING] = {"max-waiting", 0, "N", "queued requests before 429 (default 256)"},
    [S_RESERVE_OUTPUT] = {"reserve-output-tokens", 0, "N",
                          "output tokens reserved at admission (default 256)"},
    [S_NO_PREFIX_CACHE] = {"no-prefix-cache", 0, NULL, "do not reuse cached KV blocks"},
    [S_STEP_TRACE] = {"step-trace", 0, "PATH",
                      "write the scheduler's step trace (JSON Lines) to PATH:\n"
                      "what each step admitted, batched and produced, and its time"},
    [S_DRAIN_TIMEOUT] = {"drain-timeout", 0, "S",
                         "seconds running requests get after SIGTERM (default 30)"},
    [S_PING_INTERVAL] = {"ping-interval", 0, "S", "SSE ': ping' comment interval (default 5)"},
    [S_ISA] = {"isa", 0, "NAME", "kernel set: scalar, avx2, avx512 (default: best)"},
    [S_DEVICE] = {"device", 0, "D",
                  "device: cpu, cuda, cuda:N (default: a GPU when built and visible, else cpu)"},
};

static void serve_usage(FILE *f, void *ctx) {
    const td_serve_role_def *role = ctx;
    if (role) {
        fputs(role->usage, f);
        td_opts_print(f, role->opts, role->n_opts);
        td_opts_print(f, k_cluster_opts, C_N);
        fprintf(f, "UCX: UCX_POSIX_ERROR_HANDLING=y and UCX_SYSV_ERROR_HANDLING=y are set unless\n"
                   "given (shared-memory transports with peer error handling); UCX_TLS and the\n"
                   "other UCX variables apply.\n\n");
    }
    fprintf(f,
            "%s"
            "Serves the model over the OpenAI HTTP API and gRPC, prefill and decode in one\n"
            "process. Prints 'tandem serve: listening http=HOST:PORT grpc=HOST:PORT' when ready.\n"
            "SIGTERM drains: /ready answers 503, new requests get 503, running ones finish\n"
            "within the drain timeout, then the process exits 0.\n"
            "\n",
            !role ? "usage: tandem serve [--model PATH] [options]\n\n"
                  : "Common options (as tandem serve):\n");
    td_opts_print(f, k_serve_opts, S_N);
    if (!role) {
        fprintf(f, "\nbehind tandem-router as a colocated instance (in the router's decode list),\n"
                   "with the cluster's token: its /internal/v1/state and the internal Generate\n");
        td_opts_print(f, k_cluster_opts, C_N);
    }
    fprintf(f, "\nparallel plan (validated against the model; --plan-dry-run shows it):\n");
    td_cli_plan_usage(f);
}

/* "1073741824", "512M", "2G", "64k" (binary units). */
static bool parse_bytes(const char *s, size_t *out) {
    char *end;
    errno = 0;
    if (*s == '-') return false;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s) return false;
    unsigned shift = 0;
    if (*end) {
        switch (*end) {
        case 'k':
        case 'K': shift = 10; break;
        case 'm':
        case 'M': shift = 20; break;
        case 'g':
        case 'G': shift = 30; break;
        case 't':
        case 'T': shift = 40; break;
        default: return false;
        }
        end++;
        if (*end == 'i' || *end == 'I') end++;
        if (*end == 'b' || *end == 'B') end++;
        if (*end) return false;
    }
    if (shift && v > (SIZE_MAX >> shift)) return false;
    *out = (size_t)(v << shift);
    return *out > 0;
}

typedef struct {
    const char *model;
    const char *host;
    long port, grpc_port;
    const char *keys[SERVE_MAX_KEYS];
    int n_keys;
    const char *key_file;
    char *key_file_buf; /* the keys of key_file point into it */
    bool metrics_need_key;
    td_served_names served;
    const char *chat_template;
    bool trust_request_template;
    const char *isa;
    const char *device;
    long threads, ctx, kv_blocks, block_size, max_running, max_batch_tokens, max_waiting,
        reserve_output;
    double prefill_share;
    const char *kv_dtype;
    bool act_int8;
    bool mmap;
    long tpot_target_ms;
    bool tpot_auto;
    size_t kv_memory;
    bool no_prefix_cache;
    const char *step_trace;
    double drain_timeout, ping_interval;
    td_cli_plan plan;
    /* prefill / decode */
    const td_serve_role_def *role; /* NULL: tandem serve */
    const char *cluster_token, *cluster_token_file, *instance_id;
    td_xfer_params xp; /* the role's options land here */
} serve_args;

/* A role's option: into the transfer parameters. */
static bool set_role_opt(void *ctx, int i, const char *val, bool *printed) {
    serve_args *a = ctx;
    TD_UNUSED(printed);
    return a->role->set(&a->xp, i, val);
}

static bool set_cluster_opt(void *ctx, int i, const char *val, bool *printed) {
    serve_args *a = ctx;
    TD_UNUSED(printed);
    switch (i) {
    case C_TOKEN: a->cluster_token = val; return true;
    case C_TOKEN_FILE: a->cluster_token_file = val; return true;
    case C_INSTANCE_ID: a->instance_id = val; return true;
    }
    return false;
}

static bool set_serve_opt(void *ctx, int i, const char *val, bool *printed) {
    serve_args *a = ctx;
    TD_UNUSED(printed);
    switch (i) {
    case S_MODEL: a->model = val; return true;
    case S_HOST: a->host = val; return true;
    case S_PORT: return td_cli_parse_long(val, 0, 65535, &a->port);
    case S_GRPC_PORT: return td_cli_parse_long(val, -1, 65535, &a->grpc_port);
    case S_API_KEY:
        if (a->n_keys == SERVE_MAX_KEYS || !*val) return false;
        a->keys[a->n_keys++] = val;
        return true;
    case S_API_KEY_FILE: /* read once the flags are parsed (--help reads nothing) */
        if (a->key_file) return false;
        a->key_file = val;
        return true;
    case S_METRICS_NEED_KEY: a->metrics_need_key = true; return true;
    case S_SERVED_NAME: return td_served_names_add(&a->served, val);
    case S_TRUST_REQUEST_TEMPLATE: a->trust_request_template = true; return true;
    case S_CHAT_TEMPLATE: /* a name, or a file: loaded with the model */
        a->chat_template = val;
        return *val != '\0';
    case S_THREADS: return td_cli_parse_long(val, 1, 4096, &a->threads);
    case S_CTX: return td_cli_parse_long(val, 2, 1 << 24, &a->ctx);
    case S_KV_MEMORY: return parse_bytes(val, &a->kv_memory);
    case S_KV_BLOCKS: return td_cli_parse_long(val, 1, 1 << 24, &a->kv_blocks);
    case S_BLOCK_SIZE: return td_cli_parse_long(val, 1, 1024, &a->block_size);
    case S_KV_DTYPE: return td_cli_parse_kv_dtype(val, &a->kv_dtype);
    case S_ACT_INT8: a->act_int8 = true; return true;
    case S_MMAP: a->mmap = true; return true;
    case S_MAX_RUNNING: return td_cli_parse_long(val, 1, 1024, &a->max_running);
    case S_MAX_BATCH_TOKENS: return td_cli_parse_long(val, 1, 1 << 20, &a->max_batch_tokens);
    case S_PREFILL_SHARE: {
        char *end;
        errno = 0;
        a->prefill_share = strtod(val, &end);
        return !errno && end != val && !*end && a->prefill_share > 0 && a->prefill_share <= 1;
    }
    case S_TPOT_TARGET:
        a->tpot_auto = strcmp(val, "auto") == 0;
        a->tpot_target_ms = 0;
        return a->tpot_auto || td_cli_parse_long(val, 0, 600000, &a->tpot_target_ms);
    case S_MAX_WAITING: return td_cli_parse_long(val, 0, 1 << 20, &a->max_waiting);
    case S_RESERVE_OUTPUT: return td_cli_parse_long(val, 0, 1 << 24, &a->reserve_output);
    case S_NO_PREFIX_CACHE: a->no_prefix_cache = true; return true;
    case S_STEP_TRACE: a->step_trace = val; return *val != '\0';
    case S_DRAIN_TIMEOUT: return td_cli_parse_seconds(val, &a->drain_timeout);
    case S_PING_INTERVAL:
        return td_cli_parse_seconds(val, &a->ping_interval) && a->ping_interval >= 0.05;
    case S_ISA: a->isa = val; return true;
    case S_DEVICE: a->device = val; return true;
    }
    return false;
}

/* 0 to go on, -1 after --help, else the exit status. */
static int parse_args(int argc, char **argv, serve_args *a) {
    k_serve_opts[S_MODEL].help = td_cli_model_help();
    td_optset sets[4];
    int n = 0;
    if (a->role) sets[n++] = (td_optset){a->role->opts, a->role->n_opts, set_role_opt, a};
    /* tandem serve takes a token too: then it also answers the router (its
     * state and the internal Generate) as a colocated instance */
    sets[n++] = (td_optset){k_cluster_opts, C_N, set_cluster_opt, a};
    sets[n++] = (td_optset){k_serve_opts, S_N, set_serve_opt, a};
    sets[n++] = td_cli_plan_optset(&a->plan);
    int rc = td_opts_parse(role_name(a->role), argc, argv, sets, n, serve_usage, (void *)a->role);
    if (rc == 1) return -1;
    if (rc) return rc;
    if (a->max_batch_tokens < a->max_running) {
        fprintf(stderr, "%s: --max-batch-tokens (%ld) must be at least --max-running (%ld)\n",
                role_name(a->role), a->max_batch_tokens, a->max_running);
        return 2;
    }
    if ((a->role && !a->cluster_token == !a->cluster_token_file) ||
        (a->cluster_token && a->cluster_token_file)) {
        fprintf(stderr, "%s: give the cluster token: --cluster-token or --cluster-token-file\n",
                role_name(a->role));
        return 2;
    }
    if (a->role && a->role->check && !a->role->check(&a->xp)) return 2;
    if (a->key_file &&
        !(a->key_file_buf = td_cli_read_keys(a->key_file, a->keys, &a->n_keys, SERVE_MAX_KEYS))) {
        fprintf(stderr, "%s: bad value '%s' for --api-key-file\n", role_name(a->role), a->key_file);
        return 2;
    }
    return 0;
}

/* The cluster token from --cluster-token or the first line of the file. */
static char *read_token(const serve_args *a) {
    if (a->cluster_token) return strdup(a->cluster_token);
    return td_cli_read_secret(a->cluster_token_file);
}

/* Compatibility hash of this instance's blocks (DESIGN.md §4). */
static td_kv_hash compat_hash(const td_runtime *rt, const char *model_path) {
    char id[512];
    snprintf(id, sizeof id, "%s|%s|layers=%d|embd=%d|vocab=%d|weights=%zu", rt->cfg->name,
             strrchr(model_path, '/') ? strrchr(model_path, '/') + 1 : model_path, rt->cfg->n_layer,
             rt->cfg->n_embd, rt->cfg->n_vocab, td_exec_weight_bytes(rt->exec));
    td_kv_compat c = {.model_id = id,
                      .weight_type = td_dtype_name(rt->cfg->wtype),
                      .kv_dtype = td_dtype_name(td_kv_pool_params(rt->kv)->dtype),
                      .block_size = rt->block_size,
                      .layout_version = TD_KV_LAYOUT_VERSION,
                      .protocol_version = TD_KV_PROTOCOL_VERSION};
    return td_kv_compat_hash(&c);
}

static void free_args(serve_args *a) {
    free(a->key_file_buf);
    a->key_file_buf = NULL;
    a->n_keys = 0;
}

static bool exec_failed(void *exec) { return td_exec_failed(exec); }

/* /metrics' gauge hook (its ctx is the transfer service): called through
 * its own type, never through a cast of td_xfer_gauges'. */
static void xfer_gauges(void *ctx, td_metrics_gauges *g) { td_xfer_gauges(ctx, g); }

int td_serve_main(int argc, char **argv, const td_serve_role_def *role) {
    serve_args a = {.host = "127.0.0.1",
                    .role = role,
                    .port = 8000,
                    .grpc_port = role && !role->public_api ? -1 : 50051,
                    .xp = td_xfer_default_params(),
                    .block_size = 16,
                    .max_running = 16,
                    .max_batch_tokens = 512,
                    .prefill_share = 1,
                    .max_waiting = 256,
                    .reserve_output = 256,
                    .kv_memory = (size_t)1 << 30,
                    .drain_timeout = 30,
                    .ping_interval = 5,
                    .plan = {.p = td_plan_default_params()}};
    int rc = parse_args(argc, argv, &a);
    if (rc) {
        free_args(&a);
        return rc < 0 ? 0 : rc;
    }
    rc = td_cli_plan_check("serve", &a.plan, a.model ? a.model : td_default_model_path());
    if (rc >= 0) {
        free_args(&a);
        return rc;
    }
    char *token = NULL;
    td_chat *chat = NULL, *chat_tools = NULL;
    char chat_why[512] = "";
    if ((role || a.cluster_token || a.cluster_token_file) && !(token = read_token(&a))) {
        free_args(&a);
        return 2;
    }
    if (role && role->prepare && !role->prepare(a.host)) {
        free(token);
        free_args(&a);
        return 2;
    }

    td_stop_block_signals(); /* before the first thread starts */

    td_runtime_params rp = td_runtime_default_params();
    rp.model_path = a.model;
    rp.plan = &a.plan.p;
    rp.n_threads = (int)a.threads;
    rp.isa_name = a.isa;
    rp.device = a.device;
    rp.ctx_len = (int32_t)a.ctx;
    rp.block_size = (int32_t)a.block_size;
    rp.kv_dtype = a.kv_dtype;
    rp.act_int8 = a.act_int8;
    rp.mmap_weights = a.mmap;
    rp.kv_blocks = (int32_t)a.kv_blocks;
    rp.kv_memory = a.kv_blocks ? 0 : a.kv_memory;
    rp.max_batch_tokens = (int32_t)a.max_batch_tokens;
    rp.max_seqs = (int32_t)a.max_running;
    td_runtime *rt = NULL;
    if (td_runtime_open(&rp, &rt) != TD_OK) {
        free(token);
        free_args(&a);
        return 1;
    }

    int exit_code = 1;
    td_metrics *metrics = NULL;
    td_sched *sched = NULL;
    td_vocab *vocab = NULL; /* the tokens as a trie, for constrained requests' masks */
    FILE *step_trace = NULL;
    td_http_server *http = NULL;
    td_grpc_server *grpc = NULL;
    td_xfer *xfer = NULL;
    const char *model_path = a.model ? a.model : td_default_model_path();
    const char *served = td_served_names_resolve(&a.served, model_path, rt->cfg->name);

    const td_kv_params *kp = td_kv_pool_params(rt->kv);
    int64_t pool_tokens = (int64_t)kp->n_blocks * kp->block_size;
    int32_t max_ctx = rt->ctx_len;
    if (pool_tokens < max_ctx) {
        TD_LOG_WARN("the KV pool holds %lld tokens: context length lowered from %d to %lld",
                    (long long)pool_tokens, max_ctx, (long long)pool_tokens);
        max_ctx = (int32_t)pool_tokens;
    }
    if (max_ctx < 2) {
        TD_LOG_ERROR("the KV pool (%d blocks of %d tokens) is too small to serve", kp->n_blocks,
                     kp->block_size);
        goto close_rt;
    }
    if (td_metrics_create(served, &metrics) != TD_OK) goto close_rt;

    td_sched_params sp = td_sched_default_params();
    sp.max_running = (int32_t)a.max_running;
    sp.max_batch_tokens = (int32_t)a.max_batch_tokens;
    sp.prefill_share = a.prefill_share;
    sp.tpot_target_s = (double)a.tpot_target_ms / 1e3;
    sp.tpot_decode_factor = a.tpot_auto ? TD_SCHED_TPOT_AUTO_FACTOR : 0;
    sp.max_waiting = (int32_t)a.max_waiting;
    sp.reserve_output_tokens = (int32_t)a.reserve_output;
    sp.max_ctx = max_ctx;
    sp.prefix_cache = !a.no_prefix_cache;
    sp.compat = compat_hash(rt, model_path);
    if (a.step_trace && !(sp.step_trace = step_trace = fopen(a.step_trace, "w"))) {
        TD_LOG_ERROR("--step-trace %s: %s", a.step_trace, strerror(errno));
        goto free_metrics;
    }
    if (!(vocab = td_vocab_new(rt->tok))) {
        TD_LOG_ERROR("out of memory");
        goto free_metrics;
    }
    sp.vocab = vocab;
    if (td_sched_create(&sp, rt->exec, rt->kv, rt->tok, metrics, &sched) != TD_OK)
        goto free_metrics;
    char inst[300];
    const char *br0 = strchr(a.host, ':') ? "[" : "", *bl0 = strchr(a.host, ':') ? "]" : "";
    if (a.instance_id)
        snprintf(inst, sizeof inst, "%s", a.instance_id);
    else if (a.port != 0)
        snprintf(inst, sizeof inst, "%s-%s%s%s:%ld", role ? role->kind : "serve", br0, a.host, bl0,
                 a.port);
    else /* an ephemeral port is not known yet: the process id tells instances apart */
        snprintf(inst, sizeof inst, "%s-%s%s%s-pid%ld", role ? role->kind : "serve", br0, a.host,
                 bl0, (long)getpid());
    if (role) {
        td_xfer_params xp = a.xp; /* with the role's options */
        xp.side = role->side;
        xp.instance_id = inst;
        xp.cluster_token = token;
        xp.sched = sched;
        xp.exec = rt->exec;
        xp.metrics = metrics;
        xp.compat = sp.compat;
        xp.max_ctx = max_ctx;
        if (td_xfer_create(&xp, &xfer) != TD_OK) goto free_sched;
    }

    if (td_chat_pick_serving(a.chat_template, rt->tok, &chat, &chat_tools, chat_why,
                             sizeof chat_why) != TD_OK) {
        TD_LOG_ERROR("%s", chat_why);
        goto free_sched;
    }
    td_api_model mdl = {.tok = rt->tok,
                        .chat = chat,
                        .chat_tools = chat_tools,
                        .trust_request_template = a.trust_request_template,
                        .chat_error = chat ? NULL : chat_why,
                        .model_name = served,
                        .aliases = a.served.aliases,
                        .n_aliases = a.served.n_aliases,
                        .max_ctx = max_ctx};
    td_http_params hp = td_http_default_params();
    hp.host = a.host;
    hp.port = (int)a.port;
    hp.sched = sched;
    hp.metrics = metrics;
    hp.model = mdl;
    hp.api_keys = a.keys;
    hp.n_api_keys = a.n_keys;
    hp.metrics_need_key = a.metrics_need_key;
    hp.ping_interval_s = a.ping_interval;
    hp.kv_block_size = kp->block_size;
    hp.role = role ? role->kind : "colocated";
    if (token) {
        hp.cluster_token = token;
        hp.instance_id = inst;
    }
    if (xfer) {
        hp.internal_ctx = xfer;
        hp.state_transfer = td_xfer_state_json;
        hp.gauges = xfer_gauges;
        if (!role->public_api) {
            hp.kv_exchange = td_xfer_exchange;
            hp.internal_only = true;
        } else {
            hp.submit_hook = (td_api_submit_hook){.fn = td_xfer_submit_hook, .ctx = xfer};
        }
    }
    if (td_http_server_start(&hp, &http) != TD_OK) goto free_sched;
    if (a.grpc_port >= 0) {
        td_grpc_params gp = td_grpc_default_params();
        gp.host = a.host;
        gp.port = (int)a.grpc_port;
        gp.sched = sched;
        gp.metrics = metrics;
        gp.model = mdl;
        gp.api_keys = a.keys;
        gp.n_api_keys = a.n_keys;
        if (xfer && role->public_api)
            gp.submit_hook = (td_api_submit_hook){.fn = td_xfer_submit_hook, .ctx = xfer};
        if (!role || (xfer && role->public_api))
            gp.cluster_token = token; /* the router's internal Generate (NULL: none) */
        if (td_grpc_server_start(&gp, &grpc) != TD_OK) goto stop_http;
        td_http_server_set_grpc_port(http, td_grpc_server_port(grpc));
    }
    const char *br = strchr(a.host, ':') ? "[" : "", *bl = strchr(a.host, ':') ? "]" : "";
    char grpc_addr[300] = "off";
    if (grpc)
        snprintf(grpc_addr, sizeof grpc_addr, "%s%s%s:%d", br, a.host, bl,
                 td_grpc_server_port(grpc));
    fprintf(stderr,
            "serve: model '%s', context %d, KV pool %d blocks x %d tokens, max running %ld, "
            "batch %ld tokens, prefix cache %s\n",
            served, max_ctx, kp->n_blocks, kp->block_size, a.max_running, a.max_batch_tokens,
            a.no_prefix_cache ? "off" : "on");
    printf("%s: listening http=%s%s%s:%d grpc=%s\n", role_name(role), br, a.host, bl,
           td_http_server_port(http), grpc_addr);
    fflush(stdout);

    /* Wait for a signal, or for the plan's ranks to fail: then the
     * instance stops at once (not ready, every request an error) and exits
     * non-zero, so its supervisor restarts it. */
    int sig = td_stop_wait(exec_failed, rt->exec);
    bool failed = sig == 0;
    if (failed) {
        TD_LOG_ERROR("a rank of the parallel plan failed: refusing requests and exiting");
        td_sched_drain(sched);
        td_sched_abort_all(sched);
        td_sched_wait_idle(sched, 5.0);
    } else {
        TD_STOP_LOG_DRAIN(sig, a.drain_timeout);
        td_sched_drain(sched);
    }
    double drain_end = td_time_s() + a.drain_timeout;
    if (!failed && !td_sched_wait_idle(sched, a.drain_timeout)) {
        TD_LOG_WARN("drain timeout: aborting the requests still running");
        td_sched_abort_all(sched);
        td_sched_wait_idle(sched, 5.0);
    }
    /* The transfer side's drain rule (a prefill instance stays until the
     * KV it produced has been consumed). */
    while (!failed && xfer && !td_xfer_drained(xfer) && td_time_s() < drain_end) {
        struct timespec ts = {0, 20 * 1000000L};
        nanosleep(&ts, NULL);
    }
    /* Let the front ends write the last bytes of every finished stream. */
    double t_end = td_time_s() + 2.0;
    while (td_sched_live_streams(sched) > 0 && td_time_s() < t_end) {
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
    /* a rank that died during the drain failed requests too */
    if (!failed && td_exec_failed(rt->exec)) {
        TD_LOG_ERROR("a rank of the parallel plan failed during the drain");
        failed = true;
    }
    exit_code = failed ? 1 : 0;

    td_grpc_server_stop(grpc);
stop_http:
    td_http_server_stop(http);
free_sched:
    td_xfer_stop(xfer); /* no put touches the KV from here on */
    td_sched_destroy(sched);
    td_xfer_destroy(xfer);
free_metrics:
    td_vocab_free(vocab);
    if (step_trace) fclose(step_trace);
    td_metrics_destroy(metrics);
close_rt:
    td_chat_free(chat);
    td_chat_free(chat_tools);
    td_runtime_close(rt);
    free(token);
    free_args(&a);
    if (exit_code == 0) TD_LOG_INFO("stopped");
    return exit_code;
}
