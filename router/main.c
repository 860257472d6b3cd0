/* tandem-router: the cluster's front door (DESIGN.md §6, §7). The public
 * HTTP and gRPC API of `tandem serve` (the same common/api code) over the
 * router core (router/router.h): every request is routed to a decode
 * instance, and a prefill instance or local prefill, by prefix-cache hits
 * and KV headroom, then streamed through. SIGTERM drains. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/api/grpc.h"
#include "common/api/http.h"
#include "common/base/httpc.h"
#include "common/base/stop.h"
#include "common/model/model.h"
#include "common/runtime/cli.h"
#include "router.h"

#define MAX_LIST 256

typedef struct {
    const char *host, *model, *served_name, *chat_template;
    const char *token, *token_file;
    long port, grpc_port, max_ctx;
    char *prefill[MAX_LIST], *decode[MAX_LIST];
    int n_prefill, n_decode;
    const char *keys[64];
    int n_keys;
    const char *key_file;
    char *key_file_buf; /* the keys of key_file point into it */
    bool metrics_need_key;
    double drain_timeout, ping_interval;
    long retry_after;
    td_router_params rp;
} args;

static void usage(FILE *f) {
    td_rt_score_params d = td_rt_score_default_params();
    td_router_params rd = td_router_default_params();
    fprintf(
        f,
        "usage: tandem-router --cluster-token-file F (--decode HOST:PORT... | --decode-dns "
        "NAME:PORT)\n"
        "                     [--prefill HOST:PORT...] [--prefill-dns NAME:PORT] [options]\n"
        "\n"
        "The cluster's front door: the OpenAI HTTP API and the gRPC service of `tandem serve`,\n"
        "with every request routed to a decode instance (and a prefill instance, or local\n"
        "prefill on the decode instance) by prefix-cache hits and KV headroom, and streamed\n"
        "through. Prints 'tandem-router: listening http=HOST:PORT grpc=HOST:PORT' when bound.\n"
        "/ready answers 200 once a decode instance is ready. SIGTERM drains: /ready 503, new\n"
        "requests 503, running ones finish (--drain-timeout), then exit 0.\n"
        "\n"
        "instances (HOST:PORT of their HTTP port; repeat a flag or give a comma list):\n"
        "  --prefill LIST             prefill instances\n"
        "  --decode LIST              decode instances\n"
        "  --prefill-dns NAME:PORT    prefill instances: every address NAME resolves to\n"
        "  --decode-dns NAME:PORT     (a Kubernetes headless Service), re-resolved\n"
        "  --dns-interval S           every S seconds (default %.0f)\n"
        "  --poll-interval-ms N       state pull and health check period (default %.0f)\n"
        "  --poll-timeout-ms N        one state pull's limit (default %.0f)\n"
        "  --cluster-token-file F     the cluster's shared secret (first line of F), or\n"
        "  --cluster-token T\n"
        "\n"
        "routing:\n"
        "  --policy P                 kv-aware | round-robin | random | least-loaded "
        "(default %s)\n"
        "  --overlap-weight W         weight of the uncached prompt blocks (default %.2f)\n"
        "  --decode-weight W          weight of the decode instance's active blocks (default "
        "%.2f)\n"
        "  --transfer-weight W        blocks per ms of the pair's measured KV transfer tail\n"
        "                             (default %.2f)\n"
        "  --temperature T            > 0: sample among near-best candidates (default %.2f)\n"
        "  --local-prefill-threshold N prefill on the decode instance when its uncached\n"
        "                             suffix is under N tokens (default %d), or\n"
        "  --local-prefill-fraction F under F of the prompt (default %.2f) and\n"
        "  --local-prefill-max-tokens N under N tokens (default %d)\n"
        "  --prefill-saturated-tokens N a prefill instance with N queued prefill tokens is\n"
        "                             saturated; all saturated: local prefill (default %lld)\n"
        "  --reserve-output-tokens N  output tokens a decode instance reserves (default %d)\n"
        "  --predict-ttl S            the prefix entries predicted for a routed request live S\n"
        "                             seconds from the decision and again from its first\n"
        "                             token (default %.1f)\n"
        "  --max-retries N            further attempts before the first token (default %d)\n"
        "  --max-queued N             requests waiting for KV headroom, then 429 (default %d)\n"
        "  --queue-timeout S          longest wait for headroom, then 503 (default %.0f)\n"
        "  --seed N                   random policy and temperature draws (default: random)\n"
        "\n"
        "front end:\n"
        "  --host H                   address to bind (default 127.0.0.1)\n"
        "  --port N                   HTTP port (default 8000; 0: ephemeral)\n"
        "  --grpc-port N              gRPC port (default 50051; 0: ephemeral; -1: none)\n"
        "  --model PATH               the model's tokenizer and chat template (default model)\n"
        "  --served-model-name NAME   model name in the API (default: the model's own name)\n"
        "  --chat-template NAME       override the detected chat template\n"
        "  --max-ctx N                longest prompt + output accepted (default: the model's\n"
        "                             training context, at most 4096)\n"
        "  --api-key K                require 'Authorization: Bearer K' (repeatable)\n"
        "  --api-key-file PATH        the same, a key per line of the file (a mounted Secret:\n"
        "                             keeps the keys off the command line)\n"
        "  --metrics-need-key         /metrics needs a key too\n"
        "  --retry-after S            Retry-After of a 429 (default 1)\n"
        "  --ping-interval S          SSE ': ping' comment interval (default 5)\n"
        "  --drain-timeout S          seconds running requests get after SIGTERM (default 30)\n",
        rd.dns_interval_s, rd.poll_interval_s * 1000, rd.poll_timeout_s * 1000,
        td_rt_policy_str(d.policy), d.overlap_weight, d.decode_weight, d.transfer_weight,
        d.temperature, d.local_prefill_tokens, d.local_prefill_fraction, d.local_prefill_max_tokens,
        (long long)d.prefill_saturated_tokens, d.reserve_output_tokens, rd.predict_ttl_s,
        rd.max_retries, rd.max_queued, rd.queue_timeout_s);
}

static bool add_list(char **dst, int *n, const char *val) {
    char *copy = strdup(val), *save = NULL;
    if (!copy) return false;
    bool ok = true;
    for (char *t = strtok_r(copy, ",", &save); t && ok; t = strtok_r(NULL, ",", &save)) {
        if (!*t) continue;
        if (*n >= MAX_LIST || !(dst[*n] = strdup(t)))
            ok = false;
        else
            (*n)++;
    }
    free(copy);
    return ok;
}

static bool parse_double(const char *s, double lo, double hi, double *out) {
    float f;
    if (!td_cli_parse_float(s, &f) || f < lo || f > hi) return false;
    *out = f;
    return true;
}

static int parse_args(int argc, char **argv, args *a) {
    a->host = "127.0.0.1";
    a->port = 8000;
    a->grpc_port = 50051;
    a->drain_timeout = 30;
    a->retry_after = 1;
    a->ping_interval = 5;
    a->rp = td_router_default_params();
    td_rt_score_params *sp = &a->rp.score;
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i];
        if (!strcmp(opt, "--help") || !strcmp(opt, "-h")) {
            usage(stdout);
            return 1;
        }
        if (!strcmp(opt, "--metrics-need-key")) {
            a->metrics_need_key = true;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "tandem-router: %s needs a value (or is unknown)\n", opt);
            return 2;
        }
        const char *val = argv[++i];
        long l = 0;
        double d = 0;
        uint64_t u = 0;
        bool ok = true;
        if (!strcmp(opt, "--prefill"))
            ok = add_list(a->prefill, &a->n_prefill, val);
        else if (!strcmp(opt, "--decode"))
            ok = add_list(a->decode, &a->n_decode, val);
        else if (!strcmp(opt, "--prefill-dns"))
            a->rp.prefill_dns = val;
        else if (!strcmp(opt, "--decode-dns"))
            a->rp.decode_dns = val;
        else if (!strcmp(opt, "--dns-interval"))
            ok = parse_double(val, 0.1, 3600, &a->rp.dns_interval_s);
        else if (!strcmp(opt, "--poll-interval-ms") && (ok = td_cli_parse_long(val, 1, 60000, &l)))
            a->rp.poll_interval_s = l / 1000.0;
        else if (!strcmp(opt, "--poll-timeout-ms") && (ok = td_cli_parse_long(val, 1, 60000, &l)))
            a->rp.poll_timeout_s = l / 1000.0;
        else if (!strcmp(opt, "--cluster-token"))
            a->token = val;
        else if (!strcmp(opt, "--cluster-token-file"))
            a->token_file = val;
        else if (!strcmp(opt, "--policy")) {
            int p = td_rt_policy_parse(val);
            ok = p >= 0;
            if (ok) sp->policy = (td_rt_policy)p;
        } else if (!strcmp(opt, "--overlap-weight"))
            ok = parse_double(val, 0, 1e6, &sp->overlap_weight);
        else if (!strcmp(opt, "--decode-weight"))
            ok = parse_double(val, 0, 1e6, &sp->decode_weight);
        else if (!strcmp(opt, "--transfer-weight"))
            ok = parse_double(val, 0, 1e6, &sp->transfer_weight);
        else if (!strcmp(opt, "--temperature"))
            ok = parse_double(val, 0, 100, &sp->temperature);
        else if (!strcmp(opt, "--local-prefill-threshold") &&
                 (ok = td_cli_parse_long(val, 0, 1 << 30, &l)))
            sp->local_prefill_tokens = (int32_t)l;
        else if (!strcmp(opt, "--local-prefill-fraction"))
            ok = parse_double(val, 0, 1, &sp->local_prefill_fraction);
        else if (!strcmp(opt, "--local-prefill-max-tokens") &&
                 (ok = td_cli_parse_long(val, 0, 1 << 30, &l)))
            sp->local_prefill_max_tokens = (int32_t)l;
        else if (!strcmp(opt, "--prefill-saturated-tokens") &&
                 (ok = td_cli_parse_long(val, 1, 1L << 40, &l)))
            sp->prefill_saturated_tokens = l;
        else if (!strcmp(opt, "--reserve-output-tokens") &&
                 (ok = td_cli_parse_long(val, 0, 1 << 20, &l)))
            sp->reserve_output_tokens = (int32_t)l;
        else if (!strcmp(opt, "--predict-ttl"))
            ok = parse_double(val, 0, 3600, &a->rp.predict_ttl_s);
        else if (!strcmp(opt, "--max-retries") && (ok = td_cli_parse_long(val, 0, 16, &l)))
            a->rp.max_retries = (int)l;
        else if (!strcmp(opt, "--max-queued") && (ok = td_cli_parse_long(val, 0, 1 << 20, &l)))
            a->rp.max_queued = (int)l;
        else if (!strcmp(opt, "--queue-timeout"))
            ok = parse_double(val, 0.001, 86400, &a->rp.queue_timeout_s);
        else if (!strcmp(opt, "--seed") && (ok = td_cli_parse_u64(val, &u)))
            a->rp.seed = u;
        else if (!strcmp(opt, "--host"))
            a->host = val;
        else if (!strcmp(opt, "--port"))
            ok = td_cli_parse_long(val, 0, 65535, &a->port);
        else if (!strcmp(opt, "--grpc-port"))
            ok = td_cli_parse_long(val, -1, 65535, &a->grpc_port);
        else if (!strcmp(opt, "--model"))
            a->model = val;
        else if (!strcmp(opt, "--served-model-name"))
            a->served_name = val;
        else if (!strcmp(opt, "--chat-template")) {
            ok = td_chat_template_from_name(val) != TD_CHAT_UNKNOWN;
            a->chat_template = val;
        } else if (!strcmp(opt, "--max-ctx"))
            ok = td_cli_parse_long(val, 2, 1 << 24, &a->max_ctx);
        else if (!strcmp(opt, "--api-key")) {
            ok = a->n_keys < 64 && *val;
            if (ok) a->keys[a->n_keys++] = val;
        } else if (!strcmp(opt, "--api-key-file")) {
            ok = !a->key_file; /* read once the flags are parsed (--help reads nothing) */
            a->key_file = val;
        } else if (!strcmp(opt, "--retry-after"))
            ok = td_cli_parse_long(val, 0, 3600, &a->retry_after);
        else if (!strcmp(opt, "--drain-timeout"))
            ok = parse_double(val, 0, 86400, &a->drain_timeout);
        else if (!strcmp(opt, "--ping-interval"))
            ok = parse_double(val, 0.05, 3600, &a->ping_interval);
        else {
            fprintf(stderr, "tandem-router: unknown option '%s' (see --help)\n", opt);
            return 2;
        }
        if (!ok) {
            fprintf(stderr, "tandem-router: bad value '%s' for %s\n", val, opt);
            return 2;
        }
        TD_UNUSED(d);
    }
    if (!a->token == !a->token_file) {
        fprintf(stderr, "tandem-router: give the cluster token: --cluster-token or "
                        "--cluster-token-file\n");
        return 2;
    }
    if (a->n_decode == 0 && !a->rp.decode_dns) {
        fprintf(stderr, "tandem-router: give the decode instances: --decode or --decode-dns\n");
        return 2;
    }
    if (a->key_file &&
        !(a->key_file_buf = td_cli_read_keys(a->key_file, a->keys, &a->n_keys, 64))) {
        fprintf(stderr, "tandem-router: bad value '%s' for --api-key-file\n", a->key_file);
        return 2;
    }
    return 0;
}

int main(int argc, char **argv) {
    /* before any thread starts */
    if (!td_httpc_global_init()) {
        fprintf(stderr, "tandem-router: cannot initialise libcurl\n");
        return 1;
    }
    args a;
    memset(&a, 0, sizeof a);
    int rc = parse_args(argc, argv, &a), exit_code = 1;
    char *token = NULL;
    td_tokenizer *tok = NULL;
    td_metrics *metrics = NULL;
    td_router *router = NULL;
    td_http_server *http = NULL;
    td_grpc_server *grpc = NULL;
    if (rc) {
        exit_code = rc == 1 ? 0 : 2;
        goto done;
    }
    token = a.token ? strdup(a.token) : td_cli_read_secret(a.token_file);
    if (!token) goto done;

    td_stop_block_signals(); /* before the first thread starts */

    const char *path = a.model ? a.model : td_default_model_path();
    td_model_config mc;
    if (td_model_describe(path, &mc, &tok) != TD_OK) {
        fprintf(stderr, "tandem-router: cannot load the model's tokenizer from %s\n", path);
        goto done;
    }
    const td_model_config *cfg = &mc;
    const char *served = a.served_name ? a.served_name : cfg->name;
    int32_t max_ctx = (int32_t)a.max_ctx;
    if (max_ctx <= 0)
        max_ctx = cfg->n_ctx_train > 0 && cfg->n_ctx_train < 4096 ? cfg->n_ctx_train : 4096;
    td_chat_template tmpl = TD_CHAT_UNKNOWN;
    if (a.chat_template) {
        tmpl = td_chat_template_from_name(a.chat_template);
    } else {
        const char *t = td_tokenizer_chat_template(tok);
        tmpl = t ? td_chat_template_detect(t) : TD_CHAT_UNKNOWN;
        if (tmpl == TD_CHAT_UNKNOWN)
            TD_LOG_WARN("the model's chat template is %s: /v1/chat/completions will answer 400 "
                        "(give --chat-template NAME)",
                        t ? "not one Tandem recognises" : "missing");
    }
    if (td_metrics_create(served, &metrics) != TD_OK) goto done;

    a.rp.cluster_token = token;
    a.rp.prefill = (const char *const *)a.prefill;
    a.rp.n_prefill = a.n_prefill;
    a.rp.decode = (const char *const *)a.decode;
    a.rp.n_decode = a.n_decode;
    a.rp.metrics = metrics;
    if (td_router_create(&a.rp, &router) != TD_OK) {
        exit_code = 2;
        goto done;
    }
    td_api_model mdl = {
        .tok = tok, .chat_template = tmpl, .model_name = served, .max_ctx = max_ctx};
    td_http_params hp = td_http_default_params();
    hp.host = a.host;
    hp.port = (int)a.port;
    hp.submit_hook = td_router_submit_hook(router);
    hp.metrics = metrics;
    hp.model = mdl;
    hp.api_keys = a.keys;
    hp.n_api_keys = a.n_keys;
    hp.metrics_need_key = a.metrics_need_key;
    hp.retry_after_s = (int)a.retry_after;
    hp.ping_interval_s = a.ping_interval;
    hp.cluster_token = token;
    hp.role = "router";
    hp.internal_ctx = router;
    hp.gauges = td_router_gauges;
    hp.metrics_extra = td_router_metrics_text;
    hp.cluster_json = td_router_cluster_json;
    if (td_http_server_start(&hp, &http) != TD_OK) goto done;
    char grpc_addr[300] = "none";
    const char *br = strchr(a.host, ':') ? "[" : "", *bl = strchr(a.host, ':') ? "]" : "";
    if (a.grpc_port >= 0) {
        td_grpc_params gp = td_grpc_default_params();
        gp.host = a.host;
        gp.port = (int)a.grpc_port;
        gp.submit_hook = td_router_submit_hook(router);
        gp.metrics = metrics;
        gp.model = mdl;
        gp.api_keys = a.keys;
        gp.n_api_keys = a.n_keys;
        if (td_grpc_server_start(&gp, &grpc) != TD_OK) goto done;
        snprintf(grpc_addr, sizeof grpc_addr, "%s%s%s:%d", br, a.host, bl,
                 td_grpc_server_port(grpc));
    }
    fprintf(stderr,
            "tandem-router: model '%s', policy %s, %d prefill and %d decode instances%s%s\n",
            served, td_rt_policy_str(a.rp.score.policy), a.n_prefill, a.n_decode,
            a.rp.prefill_dns || a.rp.decode_dns ? " plus DNS discovery" : "", "");
    printf("tandem-router: listening http=%s%s%s:%d grpc=%s\n", br, a.host, bl,
           td_http_server_port(http), grpc_addr);
    fflush(stdout);

    int sig = td_stop_wait(NULL, NULL);
    TD_STOP_LOG_DRAIN(sig, a.drain_timeout);
    td_router_drain(router);
    if (!td_router_wait_idle(router, a.drain_timeout)) {
        TD_LOG_WARN("drain timeout: ending the requests still running");
        td_router_abort_all(router);
        td_router_wait_idle(router, 5.0);
    }
    exit_code = 0;
done:
    td_grpc_server_stop(grpc);
    td_http_server_stop(http);
    td_router_destroy(router);
    td_metrics_destroy(metrics);
    td_tokenizer_free(tok);
    free(token);
    for (int i = 0; i < a.n_prefill; i++) free(a.prefill[i]);
    for (int i = 0; i < a.n_decode; i++) free(a.decode[i]);
    free(a.key_file_buf);
    if (exit_code == 0 && rc == 0) TD_LOG_INFO("stopped");
    return exit_code;
}
