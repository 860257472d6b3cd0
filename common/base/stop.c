/* The services' signal handling (see stop.h). */
#include "stop.h"

#include <pthread.h>
#include <signal.h>
#include <time.h>

static void stop_set(sigset_t *s) {
    sigemptyset(s);
    sigaddset(s, SIGTERM);
    sigaddset(s, SIGINT);
}

void td_stop_block_signals(void) {
    sigset_t s;
    stop_set(&s);
    pthread_sigmask(SIG_BLOCK, &s, NULL);
    signal(SIGPIPE, SIG_IGN);
}

int td_stop_wait(bool (*failed)(void *ctx), void *ctx) {
    sigset_t s;
    stop_set(&s);
    for (;;) {
        struct timespec tick = {0, 100 * 1000000L};
        int sig = sigtimedwait(&s, NULL, &tick); /* -1: the tick, or EINTR */
        if (sig > 0) return sig;
        if (failed && failed(ctx)) return 0;
    }
}

const char *td_stop_signal_name(int sig) { return sig == SIGTERM ? "SIGTERM" : "SIGINT"; }
