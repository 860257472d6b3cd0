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
#define MAX_KEYS 64

typedef struct {
    const char *host, *model, *chat_template;
    td_served_names served;
    bool trust_request_template;
    const char *token, *token_file;
    long port, grpc_port, max_ctx;
    char *prefill[MAX_LIST], *decode[MAX_LIST];
    int n_prefill, n_decode;
    const char *keys[MAX_KEYS];
    int n_keys;
    const char *key_file;
    char *key_file_buf; /* the keys of key_file point into it */
    bool metrics_need_key;
    double drain_timeout, ping_interval;
    long retry_after;
    td_router_params rp;
} args;

/* The options, in the three groups --help prints. */
enum {
    /* instances */
    O_PREFILL,
    O_DECODE,
    O_PREFILL_DNS,
    O_DECODE_DNS,
    O_DNS_INTERVAL,
    O_POLL_INTERVAL,
    O_POLL_TIMEOUT,
    O_TOKEN_FILE,
    O_TOKEN,
    /* routing */
    O_POLICY,
    O_OVERLAP_WEIGHT,
    O_DECODE_WEIGHT,
    O_TRANSFER_WEIGHT,
    O_TEMPERATURE,
    O_LOCAL_THRESHOLD,
    O_LOCAL_FRACTION,
    O_LOCAL_MAX_TOKENS,
    O_PREFILL_SATURATED,
    O_PREFILL_SATURATED_MS,
    O_RESERVE_OUTPUT,
    O_PREDICT_TTL,
    O_MAX_RETRIES,
    O_MAX_QUEUED,
    O_QUEUE_TIMEOUT,
    O_REJECT_UNMEETABLE,
    O_TTFT_SLO,
    O_SEED,
    O_LOG_DECISIONS,
    /* front end */
    O_HOST,
    O_PORT,
    O_GRPC_PORT,
    O_MODEL,
    O_SERVED_NAME,
    O_CHAT_TEMPLATE,
    O_TRUST_REQUEST_TEMPLATE,
    O_MAX_CTX,
    O_API_KEY,
    O_API_KEY_FILE,
    O_METRICS_NEED_KEY,
    O_RETRY_AFTER,
    O_PING_INTERVAL,
    O_DRAIN_TIMEOUT,
    O_N
};
/* Help texts that name a default of td_router_default_params are written
 * into g_help by fill_help; the table points there. */
static char g_help[O_N][192];
static td_opt k_opts[O_N] = {
    [O_PREFILL] = {"prefill", 0, "LIST", "prefill instances"},
    [O_DECODE] = {"decode", 0, "LIST", "decode instances"},
    [O_PREFILL_DNS] = {"prefill-dns", 0, "NAME:PORT",
                       "prefill instances: every address NAME resolves to"},
    [O_DECODE_DNS] = {"decode-dns", 0, "NAME:PORT", "(a Kubernetes headless Service), re-resolved"},
    [O_DNS_INTERVAL] = {"dns-interval", 0, "S", g_help[O_DNS_INTERVAL]},
    [O_POLL_INTERVAL] = {"poll-interval-ms", 0, "N", g_help[O_POLL_INTERVAL]},
    [O_POLL_TIMEOUT] = {"poll-timeout-ms", 0, "N", g_help[O_POLL_TIMEOUT]},
    [O_TOKEN_FILE] = {"cluster-token-file", 0, "F",
                      "the cluster's shared secret (first line of F), or"},
    [O_TOKEN] = {"cluster-token", 0, "T", "the same, on the command line"},
    [O_POLICY] = {"policy", 0, "P", g_help[O_POLICY]},
    [O_OVERLAP_WEIGHT] = {"overlap-weight", 0, "W", g_help[O_OVERLAP_WEIGHT]},
    [O_DECODE_WEIGHT] = {"decode-weight", 0, "W", g_help[O_DECODE_WEIGHT]},
    [O_TRANSFER_WEIGHT] = {"transfer-weight", 0, "W", g_help[O_TRANSFER_WEIGHT]},
    [O_TEMPERATURE] = {"temperature", 0, "T", g_help[O_TEMPERATURE]},
    [O_LOCAL_THRESHOLD] = {"local-prefill-threshold", 0, "N", g_help[O_LOCAL_THRESHOLD]},
    [O_LOCAL_FRACTION] = {"local-prefill-fraction", 0, "F", g_help[O_LOCAL_FRACTION]},
    [O_LOCAL_MAX_TOKENS] = {"local-prefill-max-tokens", 0, "N", g_help[O_LOCAL_MAX_TOKENS]},
    [O_PREFILL_SATURATED] = {"prefill-saturated-tokens", 0, "N", g_help[O_PREFILL_SATURATED]},
    [O_PREFILL_SATURATED_MS] = {"prefill-saturated-ms", 0, "N", g_help[O_PREFILL_SATURATED_MS]},
    [O_RESERVE_OUTPUT] = {"reserve-output-tokens", 0, "N", g_help[O_RESERVE_OUTPUT]},
    [O_PREDICT_TTL] = {"predict-ttl", 0, "S", g_help[O_PREDICT_TTL]},
    [O_MAX_RETRIES] = {"max-retries", 0, "N", g_help[O_MAX_RETRIES]},
    [O_MAX_QUEUED] = {"max-queued", 0, "N", g_help[O_MAX_QUEUED]},
    [O_QUEUE_TIMEOUT] = {"queue-timeout", 0, "S", g_help[O_QUEUE_TIMEOUT]},
    [O_REJECT_UNMEETABLE] = {"reject-unmeetable", 0, NULL,
                             "answer 429 at once when a new request's first token\n"
                             "cannot come within --ttft-slo-ms (the chosen instance's\n"
                             "queued prompt tokens at its measured prefill speed, plus\n"
                             "what its first tokens lately took beyond that)"},
    [O_TTFT_SLO] = {"ttft-slo-ms", 0, "N", "the time-to-first-token SLO --reject-unmeetable keeps"},
    [O_SEED] = {"seed", 0, "N", "random policy and temperature draws (default: random)"},
    [O_LOG_DECISIONS] = {"log-decisions", 0, NULL,
                         "log every routing decision as a JSON line: the view of\n"
                         "each instance it was made on and every candidate's cost"},
    [O_HOST] = {"host", 0, "H", "address to bind (default 127.0.0.1)"},
    [O_PORT] = {"port", 0, "N", "HTTP port (default 8000; 0: ephemeral)"},
    [O_GRPC_PORT] = {"grpc-port", 0, "N", "gRPC port (default 50051; 0: ephemeral; -1: none)"},
    [O_MODEL] = {"model", 0, "PATH", "the model's tokenizer and chat template (default model)"},
    [O_SERVED_NAME] = {"served-model-name", 0, "NAME", TD_CLI_HELP_SERVED_NAME},
    [O_TRUST_REQUEST_TEMPLATE] = {"trust-request-chat-template", 0, NULL,
                                  TD_CLI_HELP_TRUST_TEMPLATE},
    [O_CHAT_TEMPLATE] = {"chat-template", 0, "NAME|FILE", TD_CLI_HELP_CHAT_TEMPLATE},
    [O_MAX_CTX] = {"max-ctx", 0, "N",
                   "longest prompt + output accepted (default: the model's\n"
                   "training context, at most 4096)"},
    [O_API_KEY] = {"api-key", 0, "K",
                   "require 'Authorization: Bearer K' (repeatable, up to " TD_STR(MAX_KEYS) ")"},
    [O_API_KEY_FILE] = {"api-key-file", 0, "PATH",
                        "the same, a key per line of the file (a mounted Secret:\n"
                        "keeps the keys off the command line)"},
    [O_METRICS_NEED_KEY] = {"metrics-need-key", 0, NULL, "/metrics needs a key too"},
    [O_RETRY_AFTER] = {"retry-after", 0, "S", "Retry-After of a 429 (default 1)"},
    [O_PING_INTERVAL] = {"ping-interval", 0, "S", "SSE ': ping' comment interval (default 5)"},
    [O_DRAIN_TIMEOUT] = {"drain-timeout", 0, "S",
                         "seconds running requests get after SIGTERM (default 30)"},
};

#define HELP(i, ...) snprintf(g_help[i], sizeof g_help[i], __VA_ARGS__)
static void fill_help(void) {
    td_rt_score_params d = td_rt_score_default_params();
    td_router_params rd = td_router_default_params();
    HELP(O_DNS_INTERVAL, "every S seconds (default %.0f)", rd.dns_interval_s);
    HELP(O_POLL_INTERVAL, "state pull and health check period (default %.0f)",
         rd.poll_interval_s * 1000);
    HELP(O_POLL_TIMEOUT, "one state pull's limit (default %.0f)", rd.poll_timeout_s * 1000);
    HELP(O_POLICY, "kv-aware | round-robin | random | least-loaded (default %s)",
         td_rt_policy_str(d.policy));
    HELP(O_OVERLAP_WEIGHT, "weight of the uncached prompt blocks (default %.2f)", d.overlap_weight);
    HELP(O_DECODE_WEIGHT, "weight of the decode instance's active blocks (default %.2f)",
         d.decode_weight);
    HELP(O_TRANSFER_WEIGHT,
         "blocks per ms of the pair's measured KV transfer tail\n"
         "(default %.2f)",
         d.transfer_weight);
    HELP(O_TEMPERATURE, "> 0: sample among near-best candidates (default %.2f)", d.temperature);
    HELP(O_LOCAL_THRESHOLD,
         "prefill on the decode instance when its uncached\n"
         "suffix is under N tokens (default %d), or",
         d.local_prefill_tokens);
    HELP(O_LOCAL_FRACTION, "under F of the prompt (default %.2f) and", d.local_prefill_fraction);
    HELP(O_LOCAL_MAX_TOKENS, "under N tokens (default %d)", d.local_prefill_max_tokens);
    HELP(O_PREFILL_SATURATED,
         "a prefill instance with N queued prefill tokens is\n"
         "saturated; all saturated: local prefill (default %lld)",
         (long long)d.prefill_saturated_tokens);
    HELP(O_PREFILL_SATURATED_MS,
         "or one that, at its measured speed, starts a new prompt\n"
         "N ms later or more (0: off; default %.0f: P's start\n"
         "deadline from tandem-decode's default)",
         d.prefill_saturated_ms);
    HELP(O_RESERVE_OUTPUT, "output tokens a decode instance reserves (default %d)",
         d.reserve_output_tokens);
    HELP(O_PREDICT_TTL,
         "the prefix entries predicted for a routed request live S\n"
         "seconds from the decision and again from its first\n"
         "token (default %.1f)",
         rd.predict_ttl_s);
    HELP(O_MAX_RETRIES, "further attempts before the first token (default %d)", rd.max_retries);
    HELP(O_MAX_QUEUED, "requests waiting for KV headroom, then 429 (default %d)", rd.max_queued);
    HELP(O_QUEUE_TIMEOUT, "longest wait for headroom, then 503 (default %.0f)", rd.queue_timeout_s);
}
#undef HELP

static void usage(FILE *f, void *ctx) {
    TD_UNUSED(ctx);
    fprintf(f, "usage: tandem-router --cluster-token-file F (--decode HOST:PORT... | --decode-dns "
               "NAME:PORT)\n"
               "                     [--prefill HOST:PORT...] [--prefill-dns NAME:PORT] "
               "[options]\n"
               "\n"
               "The cluster's front door: the OpenAI HTTP API and the gRPC service of `tandem "
               "serve`,\n"
               "with every request routed to a decode instance (and a prefill instance, or local\n"
               "prefill on the decode instance) by prefix-cache hits and KV headroom, and "
               "streamed\n"
               "through. Prints 'tandem-router: listening http=HOST:PORT grpc=HOST:PORT' when "
               "bound.\n"
               "/ready answers 200 once a decode instance is ready. SIGTERM drains: /ready 503, "
               "new\n"
               "requests 503, running ones finish (--drain-timeout), then exit 0.\n"
               "\n"
               "instances (HOST:PORT of their HTTP port; repeat a flag or give a comma list):\n");
    td_opts_print(f, k_opts, O_POLICY);
    fprintf(f, "\nrouting:\n");
    td_opts_print(f, k_opts + O_POLICY, O_HOST - O_POLICY);
    fprintf(f, "\nfront end:\n");
    td_opts_print(f, k_opts + O_HOST, O_N - O_HOST);
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

static bool set_opt(void *ctx, int i, const char *val, bool *printed) {
    args *a = ctx;
    td_rt_score_params *sp = &a->rp.score;
    long l = 0;
    uint64_t u = 0;
    bool ok;
    TD_UNUSED(printed);
    switch (i) {
    case O_PREFILL: return add_list(a->prefill, &a->n_prefill, val);
    case O_DECODE: return add_list(a->decode, &a->n_decode, val);
    case O_PREFILL_DNS: a->rp.prefill_dns = val; return true;
    case O_DECODE_DNS: a->rp.decode_dns = val; return true;
    case O_DNS_INTERVAL: return parse_double(val, 0.1, 3600, &a->rp.dns_interval_s);
    case O_POLL_INTERVAL:
        ok = td_cli_parse_long(val, 1, 60000, &l);
        a->rp.poll_interval_s = l / 1000.0;
        return ok;
    case O_POLL_TIMEOUT:
        ok = td_cli_parse_long(val, 1, 60000, &l);
        a->rp.poll_timeout_s = l / 1000.0;
        return ok;
    case O_TOKEN: a->token = val; return true;
    case O_TOKEN_FILE: a->token_file = val; return true;
    case O_POLICY: {
        int p = td_rt_policy_parse(val);
        if (p >= 0) sp->policy = (td_rt_policy)p;
        return p >= 0;
    }
    case O_OVERLAP_WEIGHT: return parse_double(val, 0, 1e6, &sp->overlap_weight);
    case O_DECODE_WEIGHT: return parse_double(val, 0, 1e6, &sp->decode_weight);
    case O_TRANSFER_WEIGHT: return parse_double(val, 0, 1e6, &sp->transfer_weight);
    case O_TEMPERATURE: return parse_double(val, 0, 100, &sp->temperature);
    case O_LOCAL_THRESHOLD:
        ok = td_cli_parse_long(val, 0, 1 << 30, &l);
        sp->local_prefill_tokens = (int32_t)l;
        return ok;
    case O_LOCAL_FRACTION: return parse_double(val, 0, 1, &sp->local_prefill_fraction);
    case O_LOCAL_MAX_TOKENS:
        ok = td_cli_parse_long(val, 0, 1 << 30, &l);
        sp->local_prefill_max_tokens = (int32_t)l;
        return ok;
    case O_PREFILL_SATURATED:
        ok = td_cli_parse_long(val, 1, 1L << 40, &l);
        sp->prefill_saturated_tokens = l;
        return ok;
    case O_PREFILL_SATURATED_MS: return parse_double(val, 0, 3.6e6, &sp->prefill_saturated_ms);
    case O_RESERVE_OUTPUT:
        ok = td_cli_parse_long(val, 0, 1 << 20, &l);
        sp->reserve_output_tokens = (int32_t)l;
        return ok;
    case O_PREDICT_TTL: return parse_double(val, 0, 3600, &a->rp.predict_ttl_s);
    case O_MAX_RETRIES:
        ok = td_cli_parse_long(val, 0, 16, &l);
        a->rp.max_retries = (int)l;
        return ok;
    case O_MAX_QUEUED:
        ok = td_cli_parse_long(val, 0, 1 << 20, &l);
        a->rp.max_queued = (int)l;
        return ok;
    case O_QUEUE_TIMEOUT: return parse_double(val, 0.001, 86400, &a->rp.queue_timeout_s);
    case O_REJECT_UNMEETABLE: a->rp.reject_unmeetable = true; return true;
    case O_LOG_DECISIONS: a->rp.log_decisions = true; return true;
    case O_TTFT_SLO: return parse_double(val, 1, 3.6e6, &a->rp.ttft_slo_ms);
    case O_SEED:
        ok = td_cli_parse_u64(val, &u);
        a->rp.seed = u;
        return ok;
    case O_HOST: a->host = val; return true;
    case O_PORT: return td_cli_parse_long(val, 0, 65535, &a->port);
    case O_GRPC_PORT: return td_cli_parse_long(val, -1, 65535, &a->grpc_port);
    case O_MODEL: a->model = val; return true;
    case O_SERVED_NAME: return td_served_names_add(&a->served, val);
    case O_TRUST_REQUEST_TEMPLATE: a->trust_request_template = true; return true;
    case O_CHAT_TEMPLATE: /* a name, or a file: loaded with the tokenizer */
        a->chat_template = val;
        return *val != '\0';
    case O_MAX_CTX: return td_cli_parse_long(val, 2, 1 << 24, &a->max_ctx);
    case O_API_KEY:
        if (a->n_keys >= MAX_KEYS || !*val) return false;
        a->keys[a->n_keys++] = val;
        return true;
    case O_API_KEY_FILE: /* read once the flags are parsed (--help reads nothing) */
        if (a->key_file) return false;
        a->key_file = val;
        return true;
    case O_METRICS_NEED_KEY: a->metrics_need_key = true; return true;
    case O_RETRY_AFTER: return td_cli_parse_long(val, 0, 3600, &a->retry_after);
    case O_DRAIN_TIMEOUT: return parse_double(val, 0, 86400, &a->drain_timeout);
    case O_PING_INTERVAL: return parse_double(val, 0.05, 3600, &a->ping_interval);
    }
    return false;
}

static int parse_args(int argc, char **argv, args *a) {
    a->host = "127.0.0.1";
    a->port = 8000;
    a->grpc_port = 50051;
    a->drain_timeout = 30;
    a->retry_after = 1;
    a->ping_interval = 5;
    a->rp = td_router_default_params();
    fill_help();
    td_optset set = {k_opts, O_N, set_opt, a};
    int rc = td_opts_parse("tandem-router", argc, argv, &set, 1, usage, NULL);
    if (rc) return rc;
    if (!a->token == !a->token_file) {
        fprintf(stderr, "tandem-router: give the cluster token: --cluster-token or "
                        "--cluster-token-file\n");
        return 2;
    }
    if (a->rp.reject_unmeetable && !(a->rp.ttft_slo_ms > 0)) {
        fprintf(stderr, "tandem-router: --reject-unmeetable needs --ttft-slo-ms\n");
        return 2;
    }
    if (a->n_decode == 0 && !a->rp.decode_dns) {
        fprintf(stderr, "tandem-router: give the decode instances: --decode or --decode-dns\n");
        return 2;
    }
    if (a->key_file &&
        !(a->key_file_buf = td_cli_read_keys(a->key_file, a->keys, &a->n_keys, MAX_KEYS))) {
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
    td_chat *chat = NULL, *chat_tools = NULL;
    char chat_why[512] = "";
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
    const char *served = td_served_names_resolve(&a.served, path, cfg->name);
    int32_t max_ctx = (int32_t)a.max_ctx;
    if (max_ctx <= 0)
        max_ctx = cfg->n_ctx_train > 0 && cfg->n_ctx_train < 4096 ? cfg->n_ctx_train : 4096;
    /* the router renders routed chat requests: a --chat-template that does
     * not load is fatal, a model without a usable one makes chat 400 */
    if (td_chat_pick_serving(a.chat_template, tok, &chat, &chat_tools, chat_why, sizeof chat_why) !=
        TD_OK) {
        fprintf(stderr, "tandem-router: %s\n", chat_why);
        goto done;
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
    td_api_model mdl = {.tok = tok,
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
    td_chat_free(chat);
    td_chat_free(chat_tools);
    td_tokenizer_free(tok);
    free(token);
    for (int i = 0; i < a.n_prefill; i++) free(a.prefill[i]);
    for (int i = 0; i < a.n_decode; i++) free(a.decode[i]);
    free(a.key_file_buf);
    if (exit_code == 0 && rc == 0) TD_LOG_INFO("stopped");
    return exit_code;
}
