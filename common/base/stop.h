/* How a service stops: SIGTERM and SIGINT are taken by one thread with
 * sigwait, never by a handler, and a peer that hangs up (SIGPIPE) does not
 * kill the process. Shared by tandem serve, tandem-prefill, tandem-decode
 * and tandem-router. */
#ifndef TD_BASE_STOP_H
#define TD_BASE_STOP_H

#include <stdbool.h>

#include "base.h"

/* Blocks SIGTERM and SIGINT in the calling thread, so that every thread it
 * starts afterwards inherits the mask and only td_stop_wait takes them,
 * and ignores SIGPIPE. Call in main before any thread starts. */
void td_stop_block_signals(void);

/* Waits for SIGTERM or SIGINT and returns it, or returns 0 once
 * failed(ctx) is true (polled every 100 ms; failed NULL: never). A stop
 * and continue of the process (SIGSTOP, SIGCONT) is no request to stop. */
int td_stop_wait(bool (*failed)(void *ctx), void *ctx);

/* "SIGTERM" or "SIGINT". */
const char *td_stop_signal_name(int sig);

/* Logs, as the calling function, that the process drains:
 * "SIGTERM: draining (timeout 30.0 s)". */
#define TD_STOP_LOG_DRAIN(sig, timeout_s)                                                          \
    TD_LOG_INFO("%s: draining (timeout %.1f s)", td_stop_signal_name(sig), (double)(timeout_s))

#endif
