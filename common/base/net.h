/* Names of instances: HOST:PORT, and a name resolved into the addresses of
 * every instance behind it (a Kubernetes headless Service answers with one
 * address per ready pod). The router and the decode instances name peers
 * the same way, so the strings match: "10.0.0.7:8100", "[fd00::7]:8100". */
#ifndef TD_NET_H
#define TD_NET_H

#include <stdbool.h>
#include <stddef.h>

#include "base.h"

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

/* A watch of names: each is resolved every interval on a thread of its
 * own, so that no caller, and no other name, waits on DNS (getaddrinfo
 * blocks for the resolver's timeouts: tens of seconds per name while the
 * cluster DNS is down). The caller takes the latest results when it likes. */
typedef struct td_net_watch td_net_watch;

typedef struct {
    const char *const *names; /* HOST:PORT each (copied; checked by td_net_split) */
    int n_names;              /* 1..64 */
    int max_addrs;            /* addresses kept per name (1..4096) */
    int interval_ms;          /* between rounds (>= 1) */
    int wake_fd;              /* -1, or an eventfd written after each name's successful resolution
                               * (dup'ed: the watch may outlive its creator's fd) */
    const char *what;         /* for the log lines: "prefill instances" (copied) */
} td_net_watch_params;

/* Starts the threads; the first resolutions begin at once. A name that does not
 * resolve is said once (and again when its error changes, and when it
 * resolves again). */
td_status td_net_watch_create(const td_net_watch_params *p, td_net_watch **w_p);

/* The results since the last take, if any (false otherwise). out holds
 * n_names x max_addrs addresses (name i's at out[i * max_addrs]); n[i] is
 * how many name i has, or -1 when it has no new result (not resolved yet,
 * or it failed: keep what it had, a DNS outage must not empty a pool). */
bool td_net_watch_take(td_net_watch *w, char (*out)[TD_NET_ADDR_LEN], int *n);

/* Stops the watch without waiting for a resolution under way: the thread
 * ends on its own afterwards and frees what is left. Accepts NULL. */
void td_net_watch_destroy(td_net_watch *w);

#endif
