/* tandem serve: one colocated instance (prefill and decode in one process)
 * behind the OpenAI HTTP API and the gRPC service. SIGTERM drains. */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "../common/api/grpc.h"
#include "../common/api/http.h"
#include "../common/api/request.h"
#include "../common/kv/hash.h"
#include "../common/obs/metrics.h"
#include "../common/sched/sched.h"
#include "../common/tokenizer/chat.h"
#include "runtime.h"
#include "tools.h"

#define SERVE_MAX_KEYS 16

static void serve_usage(FILE *f) {
    fprintf(
        f,
        "usage: tandem serve [--model PATH] [options]\n"
        "\n"
        "Serves the model over the OpenAI HTTP API and gRPC, prefill and decode in one\n"
        "process. Prints 'tandem serve: listening http=HOST:PORT grpc=HOST:PORT' when ready.\n"
        "SIGTERM drains: /ready answers 503, new requests get 503, running ones finish\n"
        "within the drain timeout, then the process exits 0.\n"
        "\n"
        "  --model PATH               GGUF file or Hugging Face directory (default: %s)\n"
        "  --host ADDR                address to bind (default 127.0.0.1)\n"
        "  --port N                   HTTP port (default 8000; 0 = ephemeral)\n"
        "  --grpc-port N              gRPC port (default 50051; 0 = ephemeral; -1 = off)\n"
        "  --api-key KEY              require 'Authorization: Bearer KEY' (repeatable, up to %d)\n"
        "  --metrics-need-key         put /metrics behind the API key too\n"
        "  --served-model-name NAME   model name in the API (default: the model's own name)\n"
        "  --chat-template NAME       force a chat template: chatml, smollm2, llama3, llama2,\n"
        "                             mistral, zephyr (default: detected from the model)\n"
        "  --threads N                compute threads (default: every core)\n"
        "  --ctx N                    context length per sequence (default: min(trained, 4096))\n"
        "  --kv-memory BYTES          KV pool size, e.g. 512M, 2G (default 1G)\n"
        "  --kv-blocks N              KV pool size in blocks (overrides --kv-memory)\n"
        "  --block-size N             tokens per KV block (default 16)\n"
        "  --max-running N            sequences decoding at once (default 16)\n"
        "  --max-batch-tokens N       tokens per step, decode + prefill chunks (default 512)\n"
        "  --max-waiting N            queued requests before 429 (default 256)\n"
        "  --reserve-output-tokens N  output tokens reserved at admission (default 256)\n"
        "  --no-prefix-cache          do not reuse cached KV blocks\n"
        "  --drain-timeout S          seconds running requests get after SIGTERM (default 30)\n"
        "  --ping-interval S          SSE ': ping' comment interval (default 5)\n"
        "  --isa NAME                 kernel set: scalar, avx2, avx512 (default: best)\n",
        td_default_model_path(), SERVE_MAX_KEYS);
    fprintf(f, "\nparallel plan (validated against the model; --plan-dry-run shows it):\n%s",
            td_plan_flags_help());
}

static bool parse_seconds(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v) || v < 0 || v > 86400) return false;
    *out = v;
    return true;
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
    bool metrics_need_key;
    const char *served_name;
    const char *chat_template;
    const char *isa;
    long threads, ctx, kv_blocks, block_size, max_running, max_batch_tokens, max_waiting,
        reserve_output;
    size_t kv_memory;
    bool no_prefix_cache;
    double drain_timeout, ping_interval;
    td_cli_plan plan;
} serve_args;

/* 0 to go on, -1 after --help, else the exit status. */
static int parse_args(int argc, char **argv, serve_args *a) {
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i];
        if (!strcmp(opt, "--help") || !strcmp(opt, "-h")) {
            serve_usage(stdout);
            return -1;
        }
        if (!strcmp(opt, "--metrics-need-key")) {
            a->metrics_need_key = true;
            continue;
        }
        if (!strcmp(opt, "--no-prefix-cache")) {
            a->no_prefix_cache = true;
            continue;
        }
        int pf = td_cli_plan_flag(&a->plan, argc, argv, &i);
        if (pf < 0) return 2;
        if (pf > 0) continue;
        if (i + 1 >= argc) {
            fprintf(stderr, "tandem serve: %s needs a value (or is unknown)\n", opt);
            return 2;
        }
        const char *val = argv[++i];
        bool ok = true;
        if (!strcmp(opt, "--model") || !strcmp(opt, "-m"))
            a->model = val;
        else if (!strcmp(opt, "--host"))
            a->host = val;
        else if (!strcmp(opt, "--port"))
            ok = td_cli_parse_long(val, 0, 65535, &a->port);
        else if (!strcmp(opt, "--grpc-port"))
            ok = td_cli_parse_long(val, -1, 65535, &a->grpc_port);
        else if (!strcmp(opt, "--api-key")) {
            if (a->n_keys == SERVE_MAX_KEYS || !*val)
                ok = false;
            else
                a->keys[a->n_keys++] = val;
        } else if (!strcmp(opt, "--served-model-name")) {
            ok = *val != '\0';
            a->served_name = val;
        } else if (!strcmp(opt, "--chat-template")) {
            ok = td_chat_template_from_name(val) != TD_CHAT_UNKNOWN;
            a->chat_template = val;
        } else if (!strcmp(opt, "--isa"))
            a->isa = val;
        else if (!strcmp(opt, "--threads") || !strcmp(opt, "-t"))
            ok = td_cli_parse_long(val, 1, 4096, &a->threads);
        else if (!strcmp(opt, "--ctx"))
            ok = td_cli_parse_long(val, 2, 1 << 24, &a->ctx);
        else if (!strcmp(opt, "--kv-memory"))
            ok = parse_bytes(val, &a->kv_memory);
        else if (!strcmp(opt, "--kv-blocks"))
            ok = td_cli_parse_long(val, 1, 1 << 24, &a->kv_blocks);
        else if (!strcmp(opt, "--block-size"))
            ok = td_cli_parse_long(val, 1, 1024, &a->block_size);
        else if (!strcmp(opt, "--max-running"))
            ok = td_cli_parse_long(val, 1, 1024, &a->max_running);
        else if (!strcmp(opt, "--max-batch-tokens"))
            ok = td_cli_parse_long(val, 1, 1 << 20, &a->max_batch_tokens);
        else if (!strcmp(opt, "--max-waiting"))
            ok = td_cli_parse_long(val, 0, 1 << 20, &a->max_waiting);
        else if (!strcmp(opt, "--reserve-output-tokens"))
            ok = td_cli_parse_long(val, 0, 1 << 24, &a->reserve_output);
        else if (!strcmp(opt, "--drain-timeout"))
            ok = parse_seconds(val, &a->drain_timeout);
        else if (!strcmp(opt, "--ping-interval"))
            ok = parse_seconds(val, &a->ping_interval) && a->ping_interval >= 0.05;
        else {
            fprintf(stderr, "tandem serve: unknown option '%s' (see --help)\n", opt);
            return 2;
        }
        if (!ok) {
            fprintf(stderr, "tandem serve: bad value '%s' for %s\n", val, opt);
            return 2;
        }
    }
    if (a->max_batch_tokens < a->max_running) {
        fprintf(stderr,
                "tandem serve: --max-batch-tokens (%ld) must be at least --max-running (%ld)\n",
                a->max_batch_tokens, a->max_running);
        return 2;
    }
    return 0;
}

/* Compatibility hash of this instance's blocks (DESIGN.md §4). */
static td_kv_hash compat_hash(const td_runtime *rt, const char *model_path) {
    char id[512];
    snprintf(id, sizeof id, "%s|%s|layers=%d|embd=%d|vocab=%d|weights=%zu", rt->cfg->name,
             strrchr(model_path, '/') ? strrchr(model_path, '/') + 1 : model_path, rt->cfg->n_layer,
             rt->cfg->n_embd, rt->cfg->n_vocab, td_exec_weight_bytes(rt->exec));
    td_kv_compat c = {.model_id = id,
                      .weight_type = td_dtype_name(rt->cfg->wtype),
                      .kv_dtype = "f32",
                      .block_size = rt->block_size,
                      .layout_version = TD_KV_LAYOUT_VERSION,
                      .protocol_version = TD_KV_PROTOCOL_VERSION};
    return td_kv_compat_hash(&c);
}

static td_chat_template pick_template(const serve_args *a, const td_tokenizer *tok) {
    if (a->chat_template) return td_chat_template_from_name(a->chat_template);
    const char *tmpl = td_tokenizer_chat_template(tok);
    td_chat_template t = tmpl ? td_chat_template_detect(tmpl) : TD_CHAT_UNKNOWN;
    if (t == TD_CHAT_UNKNOWN)
        TD_LOG_WARN("the model's chat template is %s: /v1/chat/completions will answer 400 "
                    "(give --chat-template NAME)",
                    tmpl ? "not one Tandem recognises" : "missing");
    return t;
}

int td_cmd_serve(int argc, char **argv) {
    serve_args a = {.host = "127.0.0.1",
                    .port = 8000,
                    .grpc_port = 50051,
                    .block_size = 16,
                    .max_running = 16,
                    .max_batch_tokens = 512,
                    .max_waiting = 256,
                    .reserve_output = 256,
                    .kv_memory = (size_t)1 << 30,
                    .drain_timeout = 30,
                    .ping_interval = 5,
                    .plan = {.p = td_plan_default_params()}};
    int rc = parse_args(argc, argv, &a);
    if (rc) return rc < 0 ? 0 : rc;
    rc = td_cli_plan_check("serve", &a.plan, a.model ? a.model : td_default_model_path());
    if (rc >= 0) return rc;

    /* Signals are taken by sigwait in this thread; every thread started
     * from here on inherits the mask. A peer that hangs up must not kill
     * the process. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    td_runtime_params rp = td_runtime_default_params();
    rp.model_path = a.model;
    rp.plan = &a.plan.p;
    rp.n_threads = (int)a.threads;
    rp.isa_name = a.isa;
    rp.ctx_len = (int32_t)a.ctx;
    rp.block_size = (int32_t)a.block_size;
    rp.kv_blocks = (int32_t)a.kv_blocks;
    rp.kv_memory = a.kv_blocks ? 0 : a.kv_memory;
    rp.max_batch_tokens = (int32_t)a.max_batch_tokens;
    rp.max_seqs = (int32_t)a.max_running;
    td_runtime *rt = NULL;
    if (td_runtime_open(&rp, &rt) != TD_OK) return 1;

    int exit_code = 1;
    td_metrics *metrics = NULL;
    td_sched *sched = NULL;
    td_http_server *http = NULL;
    td_grpc_server *grpc = NULL;
    const char *model_path = a.model ? a.model : td_default_model_path();
    const char *served = a.served_name ? a.served_name : rt->cfg->name;
    if (!served[0]) served = "model";

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
    sp.max_waiting = (int32_t)a.max_waiting;
    sp.reserve_output_tokens = (int32_t)a.reserve_output;
    sp.max_ctx = max_ctx;
    sp.prefix_cache = !a.no_prefix_cache;
    sp.compat = compat_hash(rt, model_path);
    if (td_sched_create(&sp, rt->exec, rt->kv, rt->tok, metrics, &sched) != TD_OK)
        goto free_metrics;

    td_api_model mdl = {.tok = rt->tok,
                        .chat_template = pick_template(&a, rt->tok),
                        .model_name = served,
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
        if (td_grpc_server_start(&gp, &grpc) != TD_OK) goto stop_http;
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
    printf("tandem serve: listening http=%s%s%s:%d grpc=%s\n", br, a.host, bl,
           td_http_server_port(http), grpc_addr);
    fflush(stdout);

    /* Wait for a signal, or for the plan's ranks to fail: then the
     * instance stops at once (not ready, every request an error) and exits
     * non-zero, so its supervisor restarts it. */
    int sig = 0;
    bool failed = false;
    for (;;) {
        struct timespec tick = {0, 100 * 1000000L};
        sig = sigtimedwait(&sigs, NULL, &tick);
        if (sig > 0) break;
        if (td_exec_failed(rt->exec)) {
            failed = true;
            break;
        }
    }
    if (failed) {
        TD_LOG_ERROR("a rank of the parallel plan failed: refusing requests and exiting");
        td_sched_drain(sched);
        td_sched_abort_all(sched);
        td_sched_wait_idle(sched, 5.0);
    } else {
        TD_LOG_INFO("%s: draining (timeout %.1f s)", sig == SIGTERM ? "SIGTERM" : "SIGINT",
                    a.drain_timeout);
        td_sched_drain(sched);
    }
    if (!failed && !td_sched_wait_idle(sched, a.drain_timeout)) {
        TD_LOG_WARN("drain timeout: aborting the requests still running");
        td_sched_abort_all(sched);
        td_sched_wait_idle(sched, 5.0);
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
    td_sched_destroy(sched);
free_metrics:
    td_metrics_destroy(metrics);
close_rt:
    td_runtime_close(rt);
    if (exit_code == 0) TD_LOG_INFO("stopped");
    return exit_code;
}
