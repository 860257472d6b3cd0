/* Names of instances: HOST:PORT, and a name resolved into the addresses of
 * every instance behind it (a Kubernetes headless Service answers with one
 * address per ready pod). The router and the decode instances name peers
 * the same way, so the strings match: "10.0.0.7:8100", "[fd00::7]:8100". */
#ifndef TD_NET_H
#define TD_NET_H

#include <stdbool.h>
#include <stddef.h>

/* "[v6%scope]:65535" */
#define TD_NET_ADDR_LEN 80

/* Splits HOST:PORT at its last colon; "[v6]:PORT" loses its brackets.
 * False when either part is empty or too long. */
bool td_net_split(const char *spec, char *host, size_t host_len, char *port, size_t port_len);

/* Resolves HOST:PORT (blocking: getaddrinfo) into at most max numeric
 * addresses, without repeats, in the resolver's order. Returns how many,
 * or -1 with err set (the name is unknown or malformed). */
int td_net_resolve(const char *spec, char (*out)[TD_NET_ADDR_LEN], int max, char *err,
                   size_t err_len);

#endif
