/* The decode service's role (service.h): its options, its --help and its
 * side of the KV transfer (xfer-decode.c), for td_serve_main. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/runtime/cli.h"
#include "service.h"
#include "xfer-decode.h"

#define MAX_PREFILL 16

enum { D_PREFILL, D_DNS_INTERVAL, D_FORGET, D_LOCAL_THRESHOLD, D_DEADLINE, D_LEASE, D_N };
static const td_opt k_opts[D_N] = {
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
                    "by when the prefill instance must start one remote\n"
                    "prefill (default 30000)"},
    [D_LEASE] = {"lease-ms", 0, "N",
                 "lease renewed with the prefill instance while it\n"
                 "works; longer silence gives the job up (default 3000)"},
};

/* The --prefill names, split at commas (the process's, for its one instance). */
static char g_names[MAX_PREFILL][256];
static const char *g_list[MAX_PREFILL];
static int g_n;

/* "a:1,b:2" appended to the list. */
static bool add_prefill(td_xfer_params *xp, const char *val) {
    const char *p = val;
    while (*p) {
        const char *e = strchr(p, ',');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        if (n == 0 || n > 255 || g_n == MAX_PREFILL || !memchr(p, ':', n)) return false;
        memcpy(g_names[g_n], p, n);
        g_names[g_n][n] = 0;
        g_list[g_n] = g_names[g_n];
        g_n++;
        p = e ? e + 1 : p + n;
    }
    xp->prefill = g_list;
    xp->n_prefill = g_n;
    return true;
}

/* S seconds in [lo, hi] as milliseconds. */
static bool seconds_ms(const char *val, double lo, double hi, int *ms) {
    double v;
    if (!td_cli_parse_seconds(val, &v) || v < lo || v > hi) return false;
    *ms = (int)(v * 1000);
    return true;
}

static bool set(td_xfer_params *xp, int i, const char *val) {
    long l;
    switch (i) {
    case D_PREFILL: return add_prefill(xp, val);
    case D_DNS_INTERVAL: return seconds_ms(val, 0.05, 3600, &xp->dns_interval_ms);
    case D_FORGET: return seconds_ms(val, 0.05, 86400, &xp->forget_ms);
    case D_LOCAL_THRESHOLD:
        if (!td_cli_parse_long(val, 0, 1 << 24, &l)) return false;
        xp->local_prefill_threshold = (int32_t)l;
        return true;
    case D_DEADLINE:
        if (!td_cli_parse_long(val, 1, 600000, &l)) return false;
        xp->deadline_ms = (int)l;
        return true;
    case D_LEASE:
        if (!td_cli_parse_long(val, 3, 600000, &l)) return false;
        xp->lease_ms = (int)l;
        return true;
    }
    return false;
}

static bool check(const td_xfer_params *xp) {
    if (xp->n_prefill > 0) return true;
    fprintf(stderr, "tandem-decode: --prefill HOST:PORT is required\n");
    return false;
}

const td_serve_role_def td_decode_service = {
    .prog = "tandem-decode",
    .kind = "decode",
    .usage = "usage: tandem-decode --prefill HOST:PORT[,...] --cluster-token[-file] T "
             "[--model PATH] [options]\n"
             "\n"
             "A decode instance: the public OpenAI HTTP API and gRPC, like tandem serve, with\n"
             "each prompt prefilled on a prefill instance (round-robin) that writes the KV\n"
             "into this instance's blocks over UCX; local prefill below\n"
             "--local-prefill-threshold uncached tokens, when no prefill instance is\n"
             "reachable, and as the fallback when one fails or misses its deadline.\n"
             "\n",
    .opts = k_opts,
    .n_opts = D_N,
    .set = set,
    .check = check,
    .public_api = true,
    .side = &td_xfer_decode_side};
