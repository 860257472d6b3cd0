#include "net.h"

#include <netdb.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

bool td_net_split(const char *spec, char *host, size_t host_len, char *port, size_t port_len) {
    const char *c = spec ? strrchr(spec, ':') : NULL;
    if (!c || c == spec || !c[1]) return false;
    const char *h = spec;
    size_t n = (size_t)(c - spec);
    if (h[0] == '[') { /* [v6]:PORT */
        if (n < 3 || h[n - 1] != ']') return false;
        h++;
        n -= 2;
    }
    if (n >= host_len || strlen(c + 1) >= port_len) return false;
    snprintf(host, host_len, "%.*s", (int)n, h);
    snprintf(port, port_len, "%s", c + 1);
    return true;
}

int td_net_resolve(const char *spec, char (*out)[TD_NET_ADDR_LEN], int max, char *err,
                   size_t err_len) {
    char host[256], port[16];
    if (!td_net_split(spec, host, sizeof host, port, sizeof port)) {
        snprintf(err, err_len, "%s: not HOST:PORT", spec ? spec : "(null)");
        return -1;
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int rc = getaddrinfo(host, port, &hints, &res);
    if (rc != 0) {
        snprintf(err, err_len, "resolving %s: %s", spec, gai_strerror(rc));
        return -1;
    }
    int n = 0;
    for (struct addrinfo *a = res; a && n < max; a = a->ai_next) {
        char num[64], sport[8];
        if (getnameinfo(a->ai_addr, a->ai_addrlen, num, sizeof num, sport, sizeof sport,
                        NI_NUMERICHOST | NI_NUMERICSERV))
            continue;
        if (a->ai_family == AF_INET6)
            snprintf(out[n], TD_NET_ADDR_LEN, "[%s]:%s", num, sport);
        else
            snprintf(out[n], TD_NET_ADDR_LEN, "%s:%s", num, sport);
        bool dup = false;
        for (int k = 0; k < n && !dup; k++) dup = !strcmp(out[k], out[n]);
        if (!dup) n++;
    }
    freeaddrinfo(res);
    return n;
}
