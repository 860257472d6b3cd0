/* The gRPC front end (gRPC C core + protobuf-c; messages in
 * proto/tandem.proto): tandem.v1.Generate/Generate (server streaming;
 * text or token-id input, the sampling parameters of HTTP; responses a
 * oneof of chunk / complete / error), tandem.v1.Generate/Abort, and the
 * standard grpc.health.v1.Health service (SERVING, NOT_SERVING while
 * draining). Cancelling a call cancels its request. Validation is the
 * HTTP one (request.h), errors map to gRPC status codes (INVALID_ARGUMENT,
 * UNAUTHENTICATED, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE) or to an
 * error message once the stream has started. API keys, when configured,
 * come as "authorization: Bearer KEY" metadata (health needs none).
 * Health knows the services "" (the server) and "tandem.v1.Generate";
 * Check of another name is NOT_FOUND, Watch of it says SERVICE_UNKNOWN.
 * Abort(request_id) cancels the running Generate with that id (a client
 * id may not be reused while its request runs: ALREADY_EXISTS). */
#ifndef TD_API_GRPC_H
#define TD_API_GRPC_H

#include <stdbool.h>

#include "common/base/base.h"
#include "common/obs/metrics.h"
#include "common/sched/sched.h"
#include "request.h"

typedef struct {
    const char *host;               /* default "127.0.0.1" */
    int port;                       /* 0: ephemeral */
    td_sched *sched;                /* NULL when submit_hook.submit is the back end */
    td_api_submit_hook submit_hook; /* decode instance: attaches remote prefill */
    td_metrics *metrics;            /* may be NULL */
    td_api_model model;
    td_api_limits limits;
    const char *const *api_keys; /* (n_api_keys) copied */
    int n_api_keys;
    /* A decode instance: also serves tandem.internal.v1.Decode/Generate
     * (the router's requests), which carries this token in the message
     * (compared in constant time) instead of an API key. NULL: not served. */
    const char *cluster_token; /* copied */
} td_grpc_params;

td_grpc_params td_grpc_default_params(void);

typedef struct td_grpc_server td_grpc_server;

/* Binds and starts the server threads. TD_ERR_IO (logged) if the port
 * cannot be bound. Stop with td_grpc_server_stop(). */
td_status td_grpc_server_start(const td_grpc_params *p, td_grpc_server **srv_p);
int td_grpc_server_port(const td_grpc_server *srv);
/* Cancels every call in flight, shuts the server down and frees it.
 * Running Generate calls end with Complete{finish_reason: "abort"}, and
 * calls whose stream already ended get up to 2 s to deliver their last
 * messages before the rest are cancelled (UNAVAILABLE). Accepts NULL. */
void td_grpc_server_stop(td_grpc_server *srv);

#endif
