/* tandem serve: one colocated instance (prefill and decode in one process)
 * behind the OpenAI HTTP API and the gRPC service. SIGTERM drains.
 *
 * The same server runs tandem-prefill (prefill only: KV exported to decode
 * instances over UCX, internal HTTP endpoints only) and tandem-decode (the
 * public API, with the prompt's KV imported from prefill instances); see
 * common/transfer/xfer.h. */
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <math.h>
#include <net/if.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
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

#define SERVE_MAX_KEYS    16
#define SERVE_MAX_PREFILL 16

static const char *role_name(td_serve_role role) {
    return role == TD_ROLE_PREFILL  ? "tandem-prefill"
           : role == TD_ROLE_DECODE ? "tandem-decode"
                                    : "tandem serve";
}

/* The options of each role (the tables print --help too). */
enum { P_KV_LISTEN, P_NO_LAYERWISE, P_N };
static const td_opt k_prefill_opts[P_N] = {
    [P_KV_LISTEN] = {"kv-listen", 0, "HOST[:PORT]",
                     "the network interface UCX uses for KV (the one that\n"
                     "holds HOST; sets UCX_NET_DEVICES unless set; the\n"
                     "port is not used: peers connect by worker address)"},
    [P_NO_LAYERWISE] = {"no-layerwise", 0, NULL,
                        "push the KV after the last layer, not layer by layer\n"
                        "(for measurements)"},
};

enum { D_PREFILL, D_DNS_INTERVAL, D_FORGET, D_LOCAL_THRESHOLD, D_DEADLINE, D_LEASE, D_N };
static const td_opt k_decode_opts[D_N] = {
    [D_PREFILL] = {"prefill", 0, "HOST:PORT[,...]",
                   "prefill instances' HTTP ports (repeatable): every\n"
                   "address a name resolves to is an instance (a\n"
                   "headless Service: every ready pod)"},
    [D_DNS_INTERVAL] = {"dns-interval", 0, "S",
                        "the --prefill names are resolved again every S\n"
                        "seconds (default 5)"},
    [D_FORGET] = {"forget-prefill-after", 0, "S",
                  "a prefill instance unlinked, no longer resolved\n"
                  "and not named by the router for S seconds is\n"
                  "forgotten (default 60)"},
    [D_LOCAL_THRESHOLD] = {"local-prefill-threshold", 0, "N",
                           "prefill here when fewer than N prompt tokens are\n"
                           "uncached (default 0: always remote)"},
    [D_DEADLINE] = {"transfer-deadline-ms", 0, "N",
                    "deadline of one remote prefill (default 30000)"},
    [D_LEASE] = {"lease-ms", 0, "N",
                 "lease renewed with the prefill instance while it\n"
                 "works (default 3000)"},
};

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
    S_THREADS,
    S_CTX,
    S_KV_MEMORY,
    S_KV_BLOCKS,
    S_BLOCK_SIZE,
    S_MAX_RUNNING,
    S_MAX_BATCH_TOKENS,
    S_MAX_WAITING,
    S_RESERVE_OUTPUT,
    S_NO_PREFIX_CACHE,
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
    [S_SERVED_NAME] = {"served-model-name", 0, "NAME",
                       "model name in the API (default: the model's own name)"},
    [S_CHAT_TEMPLATE] = {"chat-template", 0, "NAME",
                         "force a chat template: chatml, smollm2, llama3, llama2,\n"
                         "mistral, zephyr (default: detected from the model)"},
    [S_THREADS] = {"threads", 't', "N", "compute threads (default: every core)"},
    [S_CTX] = {"ctx", 0, "N", "context length per sequence (default: min(trained, 4096))"},
    [S_KV_MEMORY] = {"kv-memory", 0, "BYTES", "KV pool size, e.g. 512M, 2G (default 1G)"},
    [S_KV_BLOCKS] = {"kv-blocks", 0, "N", "KV pool size in blocks (overrides --kv-memory)"},
    [S_BLOCK_SIZE] = {"block-size", 0, "N", "tokens per KV block (default 16)"},
    [S_MAX_RUNNING] = {"max-running", 0, "N", "sequences decoding at once (default 16)"},
    [S_MAX_BATCH_TOKENS] = {"max-batch-tokens", 0, "N",
                            "tokens per step, decode + prefill chunks (default 512)"},
    [S_MAX_WAITING] = {"max-waiting", 0, "N", "queued requests before 429 (default 256)"},
    [S_RESERVE_OUTPUT] = {"reserve-output-tokens", 0, "N",
                          "output tokens reserved at admission (default 256)"},
    [S_NO_PREFIX_CACHE] = {"no-prefix-cache", 0, NULL, "do not reuse cached KV blocks"},
    [S_DRAIN_TIMEOUT] = {"drain-timeout", 0, "S",
                         "seconds running requests get after SIGTERM (default 30)"},
    [S_PING_INTERVAL] = {"ping-interval", 0, "S", "SSE ': ping' comment interval (default 5)"},
    [S_ISA] = {"isa", 0, "NAME", "kernel set: scalar, avx2, avx512 (default: best)"},
    [S_DEVICE] = {"device", 0, "D",
                  "device: cpu, cuda, cuda:N (default: a GPU when built and visible, else cpu)"},
};

static void serve_usage(FILE *f, void *ctx) {
    td_serve_role role = *(const td_serve_role *)ctx;
    if (role == TD_ROLE_PREFILL) {
        fprintf(f, "usage: tandem-prefill --cluster-token[-file] T [--model PATH] [--kv-listen "
                   "HOST[:PORT]] [options]\n"
                   "\n"
                   "A prefill instance: takes prefill jobs from decode instances (UCX active\n"
                   "messages), batches them with chunked prefill and its own prefix cache, and\n"
                   "puts each layer's KV into the decode instance's blocks as soon as it is\n"
                   "computed. Its HTTP port serves /health, /ready, /metrics,\n"
                   "/internal/v1/state and /internal/v1/kv/exchange (the cluster token is\n"
                   "required on /internal/). Prints 'tandem-prefill: listening http=HOST:PORT'.\n"
                   "SIGTERM drains: new jobs are rejected, the process exits once the KV it\n"
                   "produced has been consumed (or the drain timeout).\n"
                   "\n");
        td_opts_print(f, k_prefill_opts, P_N);
    } else if (role == TD_ROLE_DECODE) {
        fprintf(f,
                "usage: tandem-decode --prefill HOST:PORT[,...] --cluster-token[-file] T "
                "[--model PATH] [options]\n"
                "\n"
                "A decode instance: the public OpenAI HTTP API and gRPC, like tandem serve, with\n"
                "each prompt prefilled on a prefill instance (round-robin) that writes the KV\n"
                "into this instance's blocks over UCX; local prefill below\n"
                "--local-prefill-threshold uncached tokens, when no prefill instance is\n"
                "reachable, and as the fallback when one fails or misses its deadline.\n"
                "\n");
        td_opts_print(f, k_decode_opts, D_N);
    }
    if (role != TD_ROLE_SERVE) {
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
            role == TD_ROLE_SERVE ? "usage: tandem serve [--model PATH] [options]\n\n"
                                  : "Common options (as tandem serve):\n");
    td_opts_print(f, k_serve_opts, S_N);
    fprintf(f, "\nparallel plan (validated against the model; --plan-dry-run shows it):\n");
    td_cli_plan_usage(f);
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
    const char *key_file;
    char *key_file_buf; /* the keys of key_file point into it */
    bool metrics_need_key;
    const char *served_name;
    const char *chat_template;
    const char *isa;
    const char *device;
    long threads, ctx, kv_blocks, block_size, max_running, max_batch_tokens, max_waiting,
        reserve_output;
    size_t kv_memory;
    bool no_prefix_cache;
    double drain_timeout, ping_interval;
    td_cli_plan plan;
    /* prefill / decode */
    td_serve_role role;
    const char *cluster_token, *cluster_token_file, *instance_id, *kv_listen;
    char *prefill[SERVE_MAX_PREFILL];
    int n_prefill;
    long local_threshold, deadline_ms, lease_ms;
    double dns_interval, forget_after;
    bool no_layerwise;
} serve_args;

/* "a:1,b:2" appended to a->prefill (copies). */
static bool add_prefill(serve_args *a, const char *val) {
    const char *p = val;
    while (*p) {
        const char *e = strchr(p, ',');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        if (n == 0 || n > 255 || a->n_prefill == SERVE_MAX_PREFILL || !memchr(p, ':', n))
            return false;
        a->prefill[a->n_prefill] = strndup(p, n);
        if (!a->prefill[a->n_prefill]) return false;
        a->n_prefill++;
        p = e ? e + 1 : p + n;
    }
    return true;
}

static bool set_prefill_opt(void *ctx, int i, const char *val, bool *printed) {
    serve_args *a = ctx;
    TD_UNUSED(printed);
    switch (i) {
    case P_KV_LISTEN: a->kv_listen = val; return true;
    case P_NO_LAYERWISE: a->no_layerwise = true; return true;
    }
    return false;
}

static bool set_decode_opt(void *ctx, int i, const char *val, bool *printed) {
    serve_args *a = ctx;
    TD_UNUSED(printed);
    switch (i) {
    case D_PREFILL: return add_prefill(a, val);
    case D_DNS_INTERVAL:
        return parse_seconds(val, &a->dns_interval) && a->dns_interval >= 0.05 &&
               a->dns_interval <= 3600;
    case D_FORGET:
        return parse_seconds(val, &a->forget_after) && a->forget_after >= 0.05 &&
               a->forget_after <= 86400;
    case D_LOCAL_THRESHOLD: return td_cli_parse_long(val, 0, 1 << 24, &a->local_threshold);
    case D_DEADLINE: return td_cli_parse_long(val, 1, 600000, &a->deadline_ms);
    case D_LEASE: return td_cli_parse_long(val, 3, 600000, &a->lease_ms);
    }
    return false;
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
    case S_SERVED_NAME: a->served_name = val; return *val != '\0';
    case S_CHAT_TEMPLATE:
        a->chat_template = val;
        return td_chat_template_from_name(val) != TD_CHAT_UNKNOWN;
    case S_THREADS: return td_cli_parse_long(val, 1, 4096, &a->threads);
    case S_CTX: return td_cli_parse_long(val, 2, 1 << 24, &a->ctx);
    case S_KV_MEMORY: return parse_bytes(val, &a->kv_memory);
    case S_KV_BLOCKS: return td_cli_parse_long(val, 1, 1 << 24, &a->kv_blocks);
    case S_BLOCK_SIZE: return td_cli_parse_long(val, 1, 1024, &a->block_size);
    case S_MAX_RUNNING: return td_cli_parse_long(val, 1, 1024, &a->max_running);
    case S_MAX_BATCH_TOKENS: return td_cli_parse_long(val, 1, 1 << 20, &a->max_batch_tokens);
    case S_MAX_WAITING: return td_cli_parse_long(val, 0, 1 << 20, &a->max_waiting);
    case S_RESERVE_OUTPUT: return td_cli_parse_long(val, 0, 1 << 24, &a->reserve_output);
    case S_NO_PREFIX_CACHE: a->no_prefix_cache = true; return true;
    case S_DRAIN_TIMEOUT: return parse_seconds(val, &a->drain_timeout);
    case S_PING_INTERVAL: return parse_seconds(val, &a->ping_interval) && a->ping_interval >= 0.05;
    case S_ISA: a->isa = val; return true;
    case S_DEVICE: a->device = val; return true;
    }
    return false;
}

/* 0 to go on, -1 after --help, else the exit status. */
static int parse_args(int argc, char **argv, serve_args *a) {
    k_serve_opts[S_MODEL].help = td_cli_model_help();
    td_optset sets[5];
    int n = 0;
    if (a->role == TD_ROLE_PREFILL)
        sets[n++] = (td_optset){k_prefill_opts, P_N, set_prefill_opt, a};
    if (a->role == TD_ROLE_DECODE) sets[n++] = (td_optset){k_decode_opts, D_N, set_decode_opt, a};
    if (a->role != TD_ROLE_SERVE) sets[n++] = (td_optset){k_cluster_opts, C_N, set_cluster_opt, a};
    sets[n++] = (td_optset){k_serve_opts, S_N, set_serve_opt, a};
    sets[n++] = td_cli_plan_optset(&a->plan);
    int rc = td_opts_parse(role_name(a->role), argc, argv, sets, n, serve_usage, &a->role);
    if (rc == 1) return -1;
    if (rc) return rc;
    if (a->max_batch_tokens < a->max_running) {
        fprintf(stderr, "%s: --max-batch-tokens (%ld) must be at least --max-running (%ld)\n",
                role_name(a->role), a->max_batch_tokens, a->max_running);
        return 2;
    }
    if (a->role != TD_ROLE_SERVE && !a->cluster_token == !a->cluster_token_file) {
        fprintf(stderr, "%s: give the cluster token: --cluster-token or --cluster-token-file\n",
                role_name(a->role));
        return 2;
    }
    if (a->role == TD_ROLE_DECODE && a->n_prefill == 0) {
        fprintf(stderr, "tandem-decode: --prefill HOST:PORT is required\n");
        return 2;
    }
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

/* --kv-listen HOST: UCX's network device is the interface holding HOST. */
static bool kv_listen_device(const char *spec) {
    char host[256];
    snprintf(host, sizeof host, "%s", spec);
    if (host[0] == '[') { /* [v6]:port */
        char *e = strchr(host, ']');
        if (!e) return false;
        *e = 0;
        memmove(host, host + 1, strlen(host));
    } else {
        char *c = strchr(host, ':');
        if (c && !strchr(c + 1, ':')) *c = 0; /* v4:port */
    }
    unsigned char want[16];
    int fam = inet_pton(AF_INET, host, want) == 1    ? AF_INET
              : inet_pton(AF_INET6, host, want) == 1 ? AF_INET6
                                                     : 0;
    if (!fam) {
        TD_LOG_ERROR("--kv-listen: '%s' is not an IP address", host);
        return false;
    }
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) != 0) return false;
    /* the interface with that address, else the loopback interface when
     * its subnet holds it (127.0.0.2 is on lo, whose address is
     * 127.0.0.1/8); any other address must be an interface's own */
    char dev[IF_NAMESIZE + 1] = "", net_dev[IF_NAMESIZE + 1] = "";
    size_t len = fam == AF_INET ? 4 : 16;
    for (struct ifaddrs *i = ifs; i; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != fam) continue;
        const unsigned char *a =
            fam == AF_INET
                ? (const unsigned char *)&((struct sockaddr_in *)i->ifa_addr)->sin_addr
                : (const unsigned char *)&((struct sockaddr_in6 *)i->ifa_addr)->sin6_addr;
        if (memcmp(a, want, len) == 0) {
            snprintf(dev, sizeof dev, "%s", i->ifa_name);
            break;
        }
        if (!i->ifa_netmask || net_dev[0] || !(i->ifa_flags & IFF_LOOPBACK)) continue;
        const unsigned char *m =
            fam == AF_INET
                ? (const unsigned char *)&((struct sockaddr_in *)i->ifa_netmask)->sin_addr
                : (const unsigned char *)&((struct sockaddr_in6 *)i->ifa_netmask)->sin6_addr;
        bool in = m[0] != 0; /* not a /0 */
        for (size_t k = 0; k < len && in; k++) in = (a[k] & m[k]) == (want[k] & m[k]);
        if (in) snprintf(net_dev, sizeof net_dev, "%s", i->ifa_name);
    }
    if (!dev[0]) snprintf(dev, sizeof dev, "%s", net_dev);
    freeifaddrs(ifs);
    if (!dev[0]) {
        TD_LOG_ERROR("--kv-listen: no interface holds %s", host);
        return false;
    }
    if (!getenv("UCX_NET_DEVICES")) setenv("UCX_NET_DEVICES", dev, 1);
    TD_LOG_INFO("KV transfers on interface %s (UCX_NET_DEVICES=%s)", dev,
                getenv("UCX_NET_DEVICES"));
    return true;
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

static void free_args(serve_args *a) {
    for (int i = 0; i < a->n_prefill; i++) free(a->prefill[i]);
    a->n_prefill = 0;
    free(a->key_file_buf);
    a->key_file_buf = NULL;
    a->n_keys = 0;
}

static bool exec_failed(void *exec) { return td_exec_failed(exec); }

/* /metrics' gauge hook (its ctx is the transfer service): called through
 * its own type, never through a cast of td_xfer_gauges'. */
static void xfer_gauges(void *ctx, td_metrics_gauges *g) { td_xfer_gauges(ctx, g); }

int td_serve_main(int argc, char **argv, td_serve_role role, const td_xfer_side *side) {
    serve_args a = {.host = "127.0.0.1",
                    .role = role,
                    .port = 8000,
                    .grpc_port = role == TD_ROLE_PREFILL ? -1 : 50051,
                    .deadline_ms = 30000,
                    .lease_ms = 3000,
                    .dns_interval = 5,
                    .forget_after = 60,
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
    if (role != TD_ROLE_SERVE && !(token = read_token(&a))) {
        free_args(&a);
        return 2;
    }
    if (role == TD_ROLE_PREFILL && !kv_listen_device(a.kv_listen ? a.kv_listen : a.host)) {
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
    td_http_server *http = NULL;
    td_grpc_server *grpc = NULL;
    td_xfer *xfer = NULL;
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
    char inst[300];
    const char *br0 = strchr(a.host, ':') ? "[" : "", *bl0 = strchr(a.host, ':') ? "]" : "";
    if (a.instance_id)
        snprintf(inst, sizeof inst, "%s", a.instance_id);
    else if (a.port != 0)
        snprintf(inst, sizeof inst, "%s-%s%s%s:%ld", role == TD_ROLE_PREFILL ? "prefill" : "decode",
                 br0, a.host, bl0, a.port);
    else /* an ephemeral port is not known yet: the process id tells instances apart */
        snprintf(inst, sizeof inst, "%s-%s%s%s-pid%ld",
                 role == TD_ROLE_PREFILL ? "prefill" : "decode", br0, a.host, bl0, (long)getpid());
    if (role != TD_ROLE_SERVE) {
        td_xfer_params xp = td_xfer_default_params();
        xp.side = side;
        xp.instance_id = inst;
        xp.cluster_token = token;
        xp.sched = sched;
        xp.exec = rt->exec;
        xp.metrics = metrics;
        xp.compat = sp.compat;
        xp.max_ctx = max_ctx;
        xp.deadline_ms = (int)a.deadline_ms;
        xp.lease_ms = (int)a.lease_ms;
        xp.prefill = (const char *const *)a.prefill;
        xp.n_prefill = a.n_prefill;
        xp.dns_interval_ms = (int)(a.dns_interval * 1000);
        xp.forget_ms = (int)(a.forget_after * 1000);
        xp.local_prefill_threshold = (int32_t)a.local_threshold;
        xp.layerwise = !a.no_layerwise;
        if (td_xfer_create(&xp, &xfer) != TD_OK) goto free_sched;
    }

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
    hp.role = role == TD_ROLE_PREFILL ? "prefill" : role == TD_ROLE_DECODE ? "decode" : "colocated";
    if (xfer) {
        hp.cluster_token = token;
        hp.instance_id = inst;
        hp.internal_ctx = xfer;
        hp.state_transfer = td_xfer_state_json;
        hp.gauges = xfer_gauges;
        if (role == TD_ROLE_PREFILL) {
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
        if (xfer && role == TD_ROLE_DECODE) {
            gp.submit_hook = (td_api_submit_hook){.fn = td_xfer_submit_hook, .ctx = xfer};
            gp.cluster_token = token; /* the router's internal Generate */
        }
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
    td_metrics_destroy(metrics);
close_rt:
    td_runtime_close(rt);
    free(token);
    free_args(&a);
    if (exit_code == 0) TD_LOG_INFO("stopped");
    return exit_code;
}
