/* The one HTTP client of the tree's blocking requests (libcurl easy): the
 * decode instance's KV exchange with a prefill instance, and `tandem up`'s
 * readiness checks and chat request. Plain http only, never through a
 * proxy, no signals. Thread-safe once td_httpc_global_init has run. */
#ifndef TD_BASE_HTTPC_H
#define TD_BASE_HTTPC_H

#include <stdbool.h>
#include <stddef.h>

#include "base.h"

typedef struct {
    const char *url;
    const char *cluster_token; /* sent as X-Tandem-Cluster-Token; NULL: none */
    const char *json_body;     /* POST of this body as application/json; NULL: GET */
    long timeout_ms;           /* the whole request; 0: none */
    long connect_timeout_ms;   /* 0: libcurl's */
    size_t max_body;           /* longest reply kept; a longer one fails (too_large) */
} td_httpc_req;

typedef struct {
    long code;  /* HTTP status; 0 when no answer came */
    char *body; /* the reply, NUL-terminated (len bytes before it); NULL when empty */
    size_t len;
    bool refused;   /* the connection was refused */
    bool too_large; /* the reply was longer than max_body */
    char err[160];  /* why no answer came ("" when one did) */
} td_httpc_reply;

/* libcurl's global state: once, in main, before any thread starts (never
 * cleaned up: the process's exit takes it). Logs and returns false when
 * it fails. */
bool td_httpc_global_init(void);

/* TD_OK when an HTTP answer came (whatever its status), TD_ERR_IO when
 * none did (err says why), TD_ERR_NOMEM. Free the reply with
 * td_httpc_reply_free either way. */
td_status td_httpc_do(const td_httpc_req *r, td_httpc_reply *out);
void td_httpc_reply_free(td_httpc_reply *r);

#endif
