/* tandem-router's core (router.h, router-impl.h): the instances' slots,
 * create and destroy, drain. */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "router-impl.h"

td_router_params td_router_default_params(void) {
    return (td_router_params){.dns_interval_s = 5.0,
                              .poll_interval_s = 0.1,
                              .poll_timeout_s = 1.0,
                              .score = td_rt_score_default_params(),
                              .max_retries = 2,
                              .max_queued = 256,
                              .queue_timeout_s = 30.0,
                              .predict_ttl_s = 10.0,
                              .call_timeout_s = 0.0,
                              .block_size = 16};
}

/* ------------------------------------------------------------ instances */

/* Copies a peer's string as printable ASCII ('?' for anything else), so
 * that it can be cut anywhere and always stays valid JSON text. */
void td_rt_ascii_copy(char *dst, size_t n, const char *src) {
    size_t k = 0;
    for (; src && src[k] && k + 1 < n; k++) dst[k] = src[k] >= 0x20 && src[k] < 0x7f ? src[k] : '?';
    if (n) dst[k] = 0;
}

/* HOST:PORT or [V6]:PORT with a port in 1..65535 and printable host. */
static bool addr_ok(const char *a) {
    size_t n = strlen(a);
    if (n == 0 || n >= sizeof(((inst *)0)->addr) - 8) return false;
    const char *c = strrchr(a, ':');
    if (!c || c == a || !c[1]) return false;
    char *end = NULL;
    long port = strtol(c + 1, &end, 10);
    if (*end || port < 1 || port > 65535) return false;
    for (const char *s = a; s < c; s++)
        if (*s <= 0x20 || *s >= 0x7f || *s == '/' || *s == '@' || *s == '?' || *s == '#')
            return false;
    return true;
}

int32_t td_rt_slot_add(td_router *r, const char *addr, bool prefill, bool dns) {
    for (int32_t i = 0; i < MAXI; i++) {
        inst *x = &r->in[i];
        if (x->used) continue;
        memset(x, 0, sizeof *x);
        x->used = true;
        x->prefill = prefill;
        x->dns = dns;
        x->group = -1;
        snprintf(x->addr, sizeof x->addr, "%s", addr);
        snprintf(x->err, sizeof x->err, "not polled yet");
        if (i + 1 > r->n_slots) r->n_slots = i + 1;
        for (int32_t k = 0; k < MAXI; k++) {
            r->xfer[(size_t)i * MAXI + (size_t)k] = -1.0f;
            r->xfer[(size_t)k * MAXI + (size_t)i] = -1.0f;
        }
        return i;
    }
    TD_LOG_ERROR("more than %d instances: %s left out", MAXI, addr);
    return -1;
}

/* Poller thread, under mu: frees a removed slot that nothing uses. */
void td_rt_slot_free_locked(td_router *r, int32_t i) {
    inst *x = &r->in[i];
    if (x->easy) curl_easy_cleanup(x->easy);
    curl_slist_free_all(x->hdr);
    td_strbuf_free(&x->body);
    td_rt_index_clear(r->ix, i);
    if (!x->prefill && x->target[0]) td_rt_dclient_forget(r->dc, x->target);
    memset(x, 0, sizeof *x);
    while (r->n_slots > 0 && !r->in[r->n_slots - 1].used) r->n_slots--;
}

bool td_rt_usable(const td_router *r, int32_t i, const td_rt_mask *excluded) {
    const inst *x = &r->in[i];
    return x->used && !x->removed && x->healthy && x->have_state && !x->draining && x->group >= 0 &&
           (x->prefill || x->grpc_port > 0) && !(excluded && td_rt_mask_has(excluded, i));
}

void td_router_drain(td_router *r) {
    pthread_mutex_lock(&r->mu);
    r->draining = true;
    pthread_mutex_unlock(&r->mu);
}

bool td_router_wait_idle(td_router *r, double timeout_s) {
    double until = td_time_s() + timeout_s;
    pthread_mutex_lock(&r->mu);
    while (r->n_active > 0 && td_time_s() < until) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&r->cv, &r->mu, &ts);
    }
    bool idle = r->n_active == 0;
    pthread_mutex_unlock(&r->mu);
    /* Let the front ends write the last bytes of every finished stream. */
    double t_end = td_time_s() + 2.0;
    while (idle && atomic_load(&r->n_streams) > 0 && td_time_s() < t_end) {
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
    return idle;
}

/* ------------------------------------------------------ create/destroy */

td_status td_router_create(const td_router_params *p, td_router **r_p) {
    if (!p || !p->cluster_token || !*p->cluster_token || p->n_prefill < 0 || p->n_decode < 0 ||
        p->poll_interval_s <= 0 || p->max_retries < 0 || p->max_queued < 0 ||
        p->score.temperature < 0 || p->score.local_prefill_fraction < 0 ||
        (unsigned)p->score.policy >= TD_RT_N_POLICIES) {
        TD_LOG_ERROR("invalid router parameters");
        return TD_ERR_INVALID;
    }
    if (p->n_prefill + p->n_decode > MAXI) {
        TD_LOG_ERROR("%d instances: at most %d", p->n_prefill + p->n_decode, MAXI);
        return TD_ERR_INVALID;
    }
    if ((p->prefill_dns || p->decode_dns) &&
        !(p->dns_interval_s >= 0.001 && p->dns_interval_s <= 86400)) {
        TD_LOG_ERROR("dns_interval_s %g: 0.001 to 86400", p->dns_interval_s);
        return TD_ERR_INVALID;
    }
    char name[256], port[16];
    const char *lists[2] = {p->prefill_dns, p->decode_dns};
    for (int k = 0; k < 2; k++)
        if (lists[k] && !td_net_split(lists[k], name, sizeof name, port, sizeof port)) {
            TD_LOG_ERROR("'%s' is not NAME:PORT", lists[k]);
            return TD_ERR_INVALID;
        }
    for (int k = 0; k < p->n_prefill + p->n_decode; k++) {
        const char *a = k < p->n_prefill ? p->prefill[k] : p->decode[k - p->n_prefill];
        if (!a || !addr_ok(a)) {
            TD_LOG_ERROR("'%s' is not HOST:PORT", a ? a : "(null)");
            return TD_ERR_INVALID;
        }
    }
    td_router *r = calloc(1, sizeof *r);
    if (!r) return TD_ERR_NOMEM;
    r->p = *p;
    if (r->p.block_size <= 0) r->p.block_size = 16;
    r->rng = p->seed ? p->seed : td_random_u64();
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->token = strdup(p->cluster_token);
    r->prefill_dns = p->prefill_dns ? strdup(p->prefill_dns) : NULL;
    r->decode_dns = p->decode_dns ? strdup(p->decode_dns) : NULL;
    r->in = calloc(MAXI, sizeof *r->in);
    r->xfer = malloc((size_t)MAXI * MAXI * sizeof *r->xfer);
    r->multi = curl_multi_init();
    td_status st = TD_ERR_NOMEM;
    if (!r->token || (p->prefill_dns && !r->prefill_dns) || (p->decode_dns && !r->decode_dns) ||
        !r->in || !r->xfer || !r->multi)
        goto fail;
    for (size_t k = 0; k < (size_t)MAXI * MAXI; k++) r->xfer[k] = -1.0f;
    if ((st = td_rt_index_create(1 << 16, &r->ix)) != TD_OK) goto fail;
    if ((st = td_rt_dclient_create(&r->dc)) != TD_OK) goto fail;
    for (int k = 0; k < p->n_prefill + p->n_decode; k++) {
        bool pre = k < p->n_prefill;
        const char *a = pre ? p->prefill[k] : p->decode[k - p->n_prefill];
        bool dup = false;
        for (int32_t i = 0; i < r->n_slots && !dup; i++)
            dup = r->in[i].used && r->in[i].prefill == pre && !strcmp(r->in[i].addr, a);
        if (!dup) td_rt_slot_add(r, a, pre, false);
    }
    if (r->prefill_dns) r->dns_names[r->n_dns++] = r->prefill_dns;
    if (r->decode_dns) r->dns_names[r->n_dns++] = r->decode_dns;
    if (r->n_dns > 0) {
        r->dns_addrs = calloc((size_t)r->n_dns * MAXI, sizeof *r->dns_addrs);
        td_net_watch_params wp = {.names = r->dns_names,
                                  .n_names = r->n_dns,
                                  .max_addrs = MAXI,
                                  .interval_ms = (int)(r->p.dns_interval_s * 1000.0),
                                  .wake_fd = -1,
                                  .what = "instances"};
        st = r->dns_addrs ? td_net_watch_create(&wp, &r->dns) : TD_ERR_NOMEM;
        if (st != TD_OK) goto fail;
    }
    if (pthread_create(&r->poller, NULL, td_rt_poller_main, r) != 0) {
        TD_LOG_ERROR("pthread_create failed");
        st = TD_ERR_INTERNAL;
        goto fail;
    }
    r->poller_started = true;
    *r_p = r;
    return TD_OK;
fail:
    td_router_destroy(r);
    return st;
}

void td_router_destroy(td_router *r) {
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    r->stop = true;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    if (r->poller_started) pthread_join(r->poller, NULL);
    td_net_watch_destroy(r->dns); /* does not wait on a resolution under way */
    /* Cancels every call; their on_end ends the requests (no retry: stop). */
    td_rt_dclient_destroy(r->dc);
    pthread_mutex_lock(&r->mu);
    td_rt_abort_queued_locked(r);
    pthread_mutex_unlock(&r->mu);
    for (int32_t i = 0; r->in && i < MAXI; i++) {
        if (r->in[i].easy) curl_easy_cleanup(r->in[i].easy);
        curl_slist_free_all(r->in[i].hdr);
        td_strbuf_free(&r->in[i].body);
    }
    if (r->multi) curl_multi_cleanup(r->multi);
    td_rt_index_destroy(r->ix);
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
    free(r->in);
    free(r->xfer);
    free(r->token);
    free(r->prefill_dns);
    free(r->decode_dns);
    free(r->dns_addrs);
    free(r);
}
