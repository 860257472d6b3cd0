/* The prefill service's role (service.h): its options, its --help and its
 * side of the KV transfer (xfer-prefill.c), for td_serve_main. */
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "service.h"
#include "xfer-prefill.h"

enum { P_KV_LISTEN, P_NO_LAYERWISE, P_N };
static const td_opt k_opts[P_N] = {
    [P_KV_LISTEN] = {"kv-listen", 0, "HOST[:PORT]",
                     "the network interface UCX uses for KV (the one that\n"
                     "holds HOST; sets UCX_NET_DEVICES unless set; the\n"
                     "port is not used: peers connect by worker address)"},
    [P_NO_LAYERWISE] = {"no-layerwise", 0, NULL,
                        "push the KV after the last layer, not layer by layer\n"
                        "(for measurements)"},
};

static const char *g_kv_listen; /* --kv-listen (argv's), or NULL: --host */

static bool set(td_xfer_params *xp, int i, const char *val) {
    switch (i) {
    case P_KV_LISTEN: g_kv_listen = val; return true;
    case P_NO_LAYERWISE: xp->layerwise = false; return true;
    }
    return false;
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

static bool prepare(const char *host) { return kv_listen_device(g_kv_listen ? g_kv_listen : host); }

const td_serve_role_def td_prefill_service = {
    .prog = "tandem-prefill",
    .kind = "prefill",
    .usage = "usage: tandem-prefill --cluster-token[-file] T [--model PATH] [--kv-listen "
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
             "\n",
    .opts = k_opts,
    .n_opts = P_N,
    .set = set,
    .prepare = prepare,
    .public_api = false,
    .side = &td_xfer_prefill_side};
