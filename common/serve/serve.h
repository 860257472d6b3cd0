/* The instance: a model behind the scheduler, its HTTP and gRPC front ends
 * and metrics, signals and the drain, as tandem serve runs it, or in the
 * role of a service (tandem-prefill, tandem-decode) that hands in what is
 * its own: its options, its --help, its side of the KV transfer. */
#ifndef TD_SERVE_SERVE_H
#define TD_SERVE_SERVE_H

#include <stdbool.h>

#include "common/base/opts.h"
#include "common/transfer/xfer.h"

/* A service's role (prefill/service.c, decode/service.c). */
typedef struct {
    const char *prog;   /* "tandem-prefill": messages, the listening line */
    const char *kind;   /* "prefill": instance ids, the state's role */
    const char *usage;  /* --help's lines before the options */
    const td_opt *opts; /* the role's own options, printed in --help */
    int n_opts;
    /* opts[i] was given with val (argv's: it outlives the instance) into
     * the transfer parameters; false for a bad value. */
    bool (*set)(td_xfer_params *xp, int i, const char *val);
    /* After the options: the role's checks of them. Prints why and returns
     * false for a usage error. NULL: none. */
    bool (*check)(const td_xfer_params *xp);
    /* Before the model loads and any thread starts: the role's process-wide
     * set-up (host: --host). Prints why and returns false. NULL: none. */
    bool (*prepare)(const char *host);
    /* The public OpenAI API and gRPC (their submit hook the transfer's), or
     * the internal endpoints only (the exchange) and no gRPC by default. */
    bool public_api;
    const td_xfer_side *side;
} td_serve_role_def;

/* The server: tandem serve with role NULL, else the service of role. */
int td_serve_main(int argc, char **argv, const td_serve_role_def *role);

#endif
