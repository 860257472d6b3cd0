/* The instance: a model behind the scheduler, its HTTP and gRPC front ends
 * and metrics, in one of three roles (tandem serve, tandem-prefill,
 * tandem-decode), with the transfer service of its role. */
#ifndef TD_SERVE_SERVE_H
#define TD_SERVE_SERVE_H

#include "common/transfer/xfer.h"

/* The server behind tandem serve, tandem-prefill and tandem-decode. side:
 * the transfer side of the role (prefill/xfer-prefill.h,
 * decode/xfer-decode.h); NULL for tandem serve. */
typedef enum { TD_ROLE_SERVE, TD_ROLE_PREFILL, TD_ROLE_DECODE } td_serve_role;
int td_serve_main(int argc, char **argv, td_serve_role role, const td_xfer_side *side);

#endif
