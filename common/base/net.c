#include "net.h"

#include <fcntl.h>
#include <netdb.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

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

/* Shared by the creator and the threads (one per name: a name whose DNS
 * hangs delays no other): whichever lets go last frees it. */
struct td_net_watch {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    bool stop;
    int n_names, max_addrs, interval_ms, wake_fd;
    char *what;
    char (*names)[256];
    /* the latest result of each name not taken yet (mu): n[i] -1 when none */
    bool fresh;
    char (*addrs)[TD_NET_ADDR_LEN]; /* n_names x max_addrs */
    int *n;
};

typedef struct {
    td_net_watch *w;
    int i;
} watch_arg;

static void watch_unref(td_net_watch *w) {
    pthread_mutex_lock(&w->mu);
    bool last = --w->refs == 0;
    pthread_mutex_unlock(&w->mu);
    if (!last) return;
    if (w->wake_fd >= 0) close(w->wake_fd);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w->what);
    free(w->names);
    free(w->addrs);
    free(w->n);
    free(w);
}

/* Name i's thread: resolves it, publishes what it found (a failure
 * publishes nothing: the taker keeps what it had), waits the interval. */
static void *watch_main(void *arg) {
    watch_arg a = *(watch_arg *)arg;
    free(arg);
    td_net_watch *w = a.w;
    size_t per = (size_t)w->max_addrs;
    char(*found)[TD_NET_ADDR_LEN] = calloc(per, sizeof *found);
    char last_err[400] = "";
    pthread_mutex_lock(&w->mu);
    while (!w->stop && found) {
        pthread_mutex_unlock(&w->mu);
        char err[400];
        int n = td_net_resolve(w->names[a.i], found, w->max_addrs, err, sizeof err);
        if (n < 0 && strcmp(err, last_err) != 0)
            TD_LOG_WARN("%s: %s (trying again every %g s)", w->what, err, w->interval_ms / 1000.0);
        else if (n >= 0 && last_err[0])
            TD_LOG_INFO("%s: %s resolves again", w->what, w->names[a.i]);
        snprintf(last_err, sizeof last_err, "%s", n < 0 ? err : "");
        pthread_mutex_lock(&w->mu);
        if (w->stop) break;
        if (n >= 0) {
            memcpy(w->addrs + (size_t)a.i * per, found, (size_t)n * sizeof *found);
            w->n[a.i] = n;
            w->fresh = true;
            if (w->wake_fd >= 0) {
                uint64_t one = 1;
                ssize_t r = write(w->wake_fd, &one, sizeof one);
                TD_UNUSED(r);
            }
        }
        struct timespec ts = td_deadline_after(w->interval_ms / 1000.0);
        while (!w->stop && pthread_cond_timedwait(&w->cv, &w->mu, &ts) == 0) {
        }
    }
    if (!found) TD_LOG_ERROR("%s: out of memory: %s is not resolved", w->what, w->names[a.i]);
    pthread_mutex_unlock(&w->mu);
    free(found);
    watch_unref(w);
    return NULL;
}

td_status td_net_watch_create(const td_net_watch_params *p, td_net_watch **w_p) {
    *w_p = NULL;
    if (!p || !p->names || p->n_names < 1 || p->n_names > 64 || p->max_addrs < 1 ||
        p->max_addrs > 4096 || p->interval_ms < 1)
        return TD_ERR_INVALID;
    for (int i = 0; i < p->n_names; i++) {
        char h[256], port[16];
        if (!p->names[i] || strlen(p->names[i]) >= 256 ||
            !td_net_split(p->names[i], h, sizeof h, port, sizeof port)) {
            TD_LOG_ERROR("'%s' is not HOST:PORT", p->names[i] ? p->names[i] : "(null)");
            return TD_ERR_INVALID;
        }
    }
    td_net_watch *w = calloc(1, sizeof *w);
    if (!w) return TD_ERR_NOMEM;
    w->n_names = p->n_names;
    w->max_addrs = p->max_addrs;
    w->interval_ms = p->interval_ms;
    w->wake_fd = p->wake_fd >= 0 ? fcntl(p->wake_fd, F_DUPFD_CLOEXEC, 0) : -1;
    w->what = strdup(p->what ? p->what : "names");
    w->names = calloc((size_t)p->n_names, sizeof *w->names);
    w->addrs = calloc((size_t)p->n_names * (size_t)p->max_addrs, sizeof *w->addrs);
    w->n = calloc((size_t)p->n_names, sizeof *w->n);
    pthread_mutex_init(&w->mu, NULL);
    td_cond_init_monotonic(&w->cv); /* a wall-clock step does not stall resolutions */
    w->refs = 1;
    if (!w->what || !w->names || !w->addrs || !w->n || (p->wake_fd >= 0 && w->wake_fd < 0)) {
        watch_unref(w);
        return TD_ERR_NOMEM;
    }
    for (int i = 0; i < p->n_names; i++) {
        snprintf(w->names[i], 256, "%s", p->names[i]);
        w->n[i] = -1;
    }
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    td_status st = TD_OK;
    for (int i = 0; i < p->n_names && st == TD_OK; i++) {
        watch_arg *a = malloc(sizeof *a);
        if (!a) {
            st = TD_ERR_NOMEM;
            break;
        }
        *a = (watch_arg){w, i};
        pthread_mutex_lock(&w->mu);
        w->refs++; /* the thread's */
        pthread_mutex_unlock(&w->mu);
        pthread_t t;
        if (pthread_create(&t, &at, watch_main, a) != 0) {
            TD_LOG_ERROR("%s: cannot start a thread to resolve %s", w->what, w->names[i]);
            free(a);
            watch_unref(w);
            st = TD_ERR_IO;
        }
    }
    pthread_attr_destroy(&at);
    if (st != TD_OK) {
        td_net_watch_destroy(w); /* the threads started end on their own */
        return st;
    }
    *w_p = w;
    return TD_OK;
}

bool td_net_watch_take(td_net_watch *w, char (*out)[TD_NET_ADDR_LEN], int *n) {
    pthread_mutex_lock(&w->mu);
    bool fresh = w->fresh;
    if (fresh) {
        for (int i = 0; i < w->n_names; i++) {
            n[i] = w->n[i];
            if (n[i] > 0)
                memcpy(out + (size_t)i * (size_t)w->max_addrs,
                       w->addrs + (size_t)i * (size_t)w->max_addrs, (size_t)n[i] * sizeof *out);
            w->n[i] = -1;
        }
        w->fresh = false;
    }
    pthread_mutex_unlock(&w->mu);
    return fresh;
}

void td_net_watch_destroy(td_net_watch *w) {
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->stop = true;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    watch_unref(w);
}
