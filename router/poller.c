/* The poller thread (router-impl.h): pulls every instance's
 * /internal/v1/state, marks the ones that stop answering, applies what the
 * DNS names resolve to, and runs the queue. */
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/kv/hash.h"
#include "router-impl.h"

static size_t on_body(char *p, size_t sz, size_t n, void *ud) {
    inst *x = ud;
    size_t len = sz * n;
    if (x->body.n + len > STATE_LIMIT) return 0;
    td_strbuf_put(&x->body, p, len);
    return x->body.oom ? 0 : len;
}

static void mark_down(td_router *r, int32_t i, const char *fmt, const char *what) {
    pthread_mutex_lock(&r->mu);
    inst *x = &r->in[i];
    if (x->healthy || !x->have_state) x->failures++;
    x->healthy = false;
    snprintf(x->err, sizeof x->err, fmt, what);
    if (++x->down_polls == VANISHED_POLLS && !x->prefill) {
        TD_LOG_WARN("decode instance %s: %d state pulls failed in a row (%s): ending its calls",
                    x->addr, VANISHED_POLLS, x->err);
        td_rt_cancel_calls_of_locked(r, i);
    }
    pthread_mutex_unlock(&r->mu);
}

/* A peer's figure, clamped to 0..FIG_MAX (sums of them cannot overflow). */
static int64_t fig(json_t *v) {
    json_int_t n = json_integer_value(v);
    return n < 0 ? 0 : n > FIG_MAX ? FIG_MAX : (int64_t)n;
}

static bool json_hash(json_t *v, td_kv_hash *h) {
    return json_is_string(v) && td_kv_hash_parse(json_string_value(v), h);
}

/* Applies one /internal/v1/state reply of instance i (poller thread). */
static void apply_state(td_router *r, int32_t i, const char *body, size_t len) {
    json_error_t jerr;
    json_t *root = json_loadb(body, len, 0, &jerr);
    json_t *load = json_object_get(root, "load");
    json_t *kv = json_object_get(load, "kv");
    json_t *ep = json_object_get(root, "epoch"), *cp = json_object_get(root, "compat");
    json_t *role = json_object_get(root, "role");
    td_kv_hash compat;
    const char *bad = NULL;
    if (!root)
        bad = "not JSON";
    else if (!json_is_object(load) || !json_is_object(kv) || !json_is_string(ep) ||
             !json_hash(cp, &compat) || !json_is_string(role) ||
             !json_is_integer(json_object_get(root, "last_seq")) ||
             !json_is_integer(json_object_get(kv, "block_size")))
        bad = "missing or mistyped fields";
    char *end = NULL;
    uint64_t epoch = bad ? 0 : strtoull(json_string_value(ep), &end, 16);
    if (!bad && (*end || epoch == 0)) bad = "bad epoch";
    pthread_mutex_lock(&r->mu);
    inst *x = &r->in[i];
    bool prefill = x->prefill;
    /* a colocated instance (tandem serve) serves as a decode instance that
     * prefills everything itself */
    const char *rs = bad ? "" : json_string_value(role);
    if (!bad && (prefill ? strcmp(rs, "prefill") != 0
                         : strcmp(rs, "decode") != 0 && strcmp(rs, "colocated") != 0))
        bad = prefill ? "not a prefill instance" : "not a decode or colocated instance";
    int64_t bs = bad ? 0 : json_integer_value(json_object_get(kv, "block_size"));
    if (!bad && (bs < 1 || bs > 4096)) bad = "bad block size";
    bool restarted = !bad && x->have_state && x->epoch != epoch;
    if (bad) {
        x->healthy = false;
        x->failures++;
        snprintf(x->err, sizeof x->err, "malformed state: %s", bad);
        pthread_mutex_unlock(&r->mu);
        TD_LOG_WARN("instance %s: malformed /internal/v1/state (%s)", x->addr, bad);
        json_decref(root);
        return;
    }
    uint64_t since_sent = x->since;
    pthread_mutex_unlock(&r->mu);

    /* The prefix index (its own lock). An instance holds at most its pool's
     * blocks: one that announces more is lying or out of step, and is
     * forgotten until a full snapshot (since=0) says again what it holds. */
    bool full = json_is_true(json_object_get(root, "full"));
    json_int_t last_v = json_integer_value(json_object_get(root, "last_seq"));
    uint64_t last = last_v > 0 ? (uint64_t)last_v : 0;
    size_t cap = (size_t)fig(json_object_get(kv, "total")) * 4 + 4096;
    bool over = false;
    if (restarted || full) td_rt_index_clear(r->ix, i);
    if (restarted) x->ttft_extra = (td_rt_extra){0}; /* a new process: learnt again */
    if (full) {
        json_t *hs = json_object_get(root, "hashes");
        over = json_array_size(hs) > cap;
        size_t k;
        json_t *v;
        json_array_foreach(hs, k, v) {
            td_kv_hash h;
            if (k >= cap) break;
            if (json_hash(v, &h)) td_rt_index_store(r->ix, i, &h, 1);
        }
    } else if (!restarted) {
        json_t *evs = json_object_get(root, "events");
        /* Only what follows the last "cleared" matters: one clear at most. */
        size_t from = 0, k;
        json_t *v;
        json_array_foreach(evs, k, v) {
            const char *t = json_string_value(json_object_get(v, "type"));
            if (t && !strcmp(t, "cleared")) from = k + 1;
        }
        if (from > 0) td_rt_index_clear(r->ix, i);
        json_array_foreach(evs, k, v) {
            const char *t = json_string_value(json_object_get(v, "type"));
            td_kv_hash h;
            if (k < from || !t || !json_hash(json_object_get(v, "hash"), &h)) continue;
            if (!strcmp(t, "stored"))
                td_rt_index_store(r->ix, i, &h, 1);
            else if (!strcmp(t, "removed"))
                td_rt_index_remove(r->ix, i, &h, 1);
        }
        if (td_rt_index_count(r->ix, i) > cap) {
            over = true;
            td_rt_index_clear(r->ix, i);
        }
    }
    if (over)
        TD_LOG_WARN("instance %s announced more blocks than its pool holds: index entries "
                    "dropped, asking for a full snapshot",
                    x->addr);
    TD_UNUSED(since_sent);

    pthread_mutex_lock(&r->mu);
    x->epoch = epoch;
    td_rt_ascii_copy(x->id, sizeof x->id, json_string_value(json_object_get(root, "instance_id")));
    x->since = (restarted && !full) || over ? 0 : last;
    x->compat = compat;
    x->block_size = (int32_t)bs;
    x->group = td_rt_group_of_locked(r, compat, (int32_t)bs, i);
    x->draining = json_is_true(json_object_get(root, "draining"));
    x->max_ctx = (int32_t)TD_MIN(fig(json_object_get(root, "max_ctx")), INT32_MAX);
    x->running = (int32_t)TD_MIN(fig(json_object_get(load, "running")), 1 << 30);
    x->waiting = (int32_t)TD_MIN(fig(json_object_get(load, "waiting")), 1 << 30);
    /* less what ended while this pull was out (it may still count that) */
    x->queued_prefill_tokens =
        TD_MAX(fig(json_object_get(load, "queued_prefill_tokens")) - x->rel_tokens, 0);
    double rate = json_number_value(json_object_get(load, "prefill_tokens_per_s"));
    x->prefill_tokens_per_s = isfinite(rate) && rate > 0 && rate < 1e12 ? rate : 0;
    x->kv_total = fig(json_object_get(kv, "total"));
    x->kv_free = TD_MIN(fig(json_object_get(kv, "free")) + x->rel_blocks, x->kv_total);
    x->kv_used = TD_MAX(fig(json_object_get(kv, "used")) - x->rel_blocks, 0);
    x->rel_tokens = x->rel_blocks = 0;
    x->pulls++;
    x->kv_cached = fig(json_object_get(kv, "cached"));
    x->down_polls = 0;
    /* what was routed to it after this pull was sent is not in its figures */
    x->snap_s = x->pull_sent_s;
    x->pending_blocks = 0;
    x->pending_prefill = 0;
    for (const rt_req *q = r->all; q; q = q->all_next) {
        if (q->pp_t < x->snap_s) continue;
        if (q->pp_tokens > 0 && q->pp_at == i) x->pending_prefill += q->pp_tokens;
        if (q->pb_blocks > 0 && q->pb_at == i) x->pending_blocks += q->pb_blocks;
    }
    int64_t gp = json_integer_value(json_object_get(root, "grpc_port"));
    if (!prefill) {
        x->grpc_port = gp > 0 && gp < 65536 ? (int32_t)gp : 0;
        const char *colon = strrchr(x->addr, ':');
        if (x->grpc_port > 0 && colon)
            snprintf(x->target, sizeof x->target, "%.*s:%d", (int)(colon - x->addr), x->addr,
                     x->grpc_port);
        /* The pairs' exposed transfer tails, as this decode instance measured them. */
        json_t *peers = json_object_get(json_object_get(root, "transfer"), "peers");
        size_t k;
        json_t *v;
        json_array_foreach(peers, k, v) {
            const char *a = json_string_value(json_object_get(v, "address"));
            json_t *ms = json_object_get(v, "transfer_tail_ms_avg");
            if (!a || !json_is_number(ms) || json_number_value(ms) <= 0) continue; /* unmeasured */
            for (int32_t p = 0; p < r->n_slots; p++)
                if (r->in[p].used && r->in[p].prefill && !strcmp(r->in[p].addr, a))
                    r->xfer[(size_t)p * MAXI + (size_t)i] = (float)json_number_value(ms);
        }
    }
    if (!x->healthy && x->have_state)
        TD_LOG_INFO("instance %s (%s) is back", x->addr, prefill ? "prefill" : "decode");
    x->healthy = true;
    x->have_state = true;
    x->err[0] = 0;
    pthread_mutex_unlock(&r->mu);
    json_decref(root);
}

static void poll_round(td_router *r) {
    int32_t n = 0, slots[MAXI];
    pthread_mutex_lock(&r->mu);
    for (int32_t i = 0; i < r->n_slots; i++)
        if (r->in[i].used && !r->in[i].removed) slots[n++] = i;
    uint64_t since[MAXI];
    double now = td_time_s();
    for (int32_t k = 0; k < n; k++) {
        inst *x = &r->in[slots[k]];
        since[k] = x->since;
        x->pull_sent_s = now; /* a moment before: what ends from now on is noted */
        x->rel_tokens = x->rel_blocks = 0;
    }
    pthread_mutex_unlock(&r->mu);
    for (int32_t k = 0; k < n; k++) {
        inst *x = &r->in[slots[k]];
        if (!x->easy) {
            x->easy = curl_easy_init();
            char hdr[256];
            snprintf(hdr, sizeof hdr, "X-Tandem-Cluster-Token: %s", r->token);
            x->hdr = curl_slist_append(NULL, hdr);
            if (!x->easy || !x->hdr) {
                mark_down(r, slots[k], "%s", "out of memory");
                continue;
            }
        }
        char url[256];
        snprintf(url, sizeof url, "http://%s/internal/v1/state?since=%" PRIu64, x->addr, since[k]);
        td_strbuf_free(&x->body);
        curl_easy_setopt(x->easy, CURLOPT_URL, url);
        curl_easy_setopt(x->easy, CURLOPT_HTTPHEADER, x->hdr);
        curl_easy_setopt(x->easy, CURLOPT_WRITEFUNCTION, on_body);
        curl_easy_setopt(x->easy, CURLOPT_WRITEDATA, x);
        curl_easy_setopt(x->easy, CURLOPT_PRIVATE, x);
        curl_easy_setopt(x->easy, CURLOPT_TIMEOUT_MS, (long)(r->p.poll_timeout_s * 1000));
        curl_easy_setopt(x->easy, CURLOPT_CONNECTTIMEOUT_MS, (long)(r->p.poll_timeout_s * 1000));
        curl_easy_setopt(x->easy, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(x->easy, CURLOPT_PROTOCOLS_STR, "http");
        curl_multi_add_handle(r->multi, x->easy);
    }
    int running = 1;
    while (running) {
        if (curl_multi_perform(r->multi, &running) != CURLM_OK) break;
        if (running) curl_multi_poll(r->multi, NULL, 0, 100, NULL);
    }
    CURLMsg *m;
    int left;
    while ((m = curl_multi_info_read(r->multi, &left))) {
        if (m->msg != CURLMSG_DONE) continue;
        inst *x = NULL;
        curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&x);
        int32_t i = (int32_t)(x - r->in);
        long code = 0;
        curl_easy_getinfo(m->easy_handle, CURLINFO_RESPONSE_CODE, &code);
        if (m->data.result != CURLE_OK) {
            mark_down(r, i, "state pull failed: %s", curl_easy_strerror(m->data.result));
        } else if (code != 200) {
            char what[32];
            snprintf(what, sizeof what, "%ld", code);
            mark_down(r, i, "state pull answered HTTP %s", what);
        } else {
            apply_state(r, i, x->body.v ? x->body.v : "", x->body.n);
        }
    }
    for (int32_t k = 0; k < n; k++)
        if (r->in[slots[k]].easy) curl_multi_remove_handle(r->multi, r->in[slots[k]].easy);
}

/* One name's addresses from the latest DNS round (the watch's thread
 * resolves: the poller never waits on DNS). Caller holds r->mu. */
static void apply_dns(td_router *r, const char *spec, char (*found)[TD_NET_ADDR_LEN], int n,
                      bool prefill) {
    for (int32_t k = 0; k < n; k++) {
        bool have = false;
        for (int32_t i = 0; i < r->n_slots && !have; i++) {
            inst *x = &r->in[i];
            if (x->used && x->dns && x->prefill == prefill && !strcmp(x->addr, found[k])) {
                have = true;
                x->removed = false;
            }
        }
        if (!have && td_rt_slot_add(r, found[k], prefill, true) >= 0)
            TD_LOG_INFO("discovered %s instance %s (%s)", prefill ? "prefill" : "decode", found[k],
                        spec);
    }
    for (int32_t i = 0; i < r->n_slots; i++) {
        inst *x = &r->in[i];
        if (!x->used || !x->dns || x->prefill != prefill || x->removed) continue;
        bool still = false;
        for (int32_t k = 0; k < n && !still; k++) still = !strcmp(x->addr, found[k]);
        if (!still) {
            x->removed = true;
            TD_LOG_INFO("%s instance %s left %s", prefill ? "prefill" : "decode", x->addr, spec);
        }
    }
}

void *td_rt_poller_main(void *arg) {
    td_router *r = arg;
    pthread_mutex_lock(&r->mu);
    while (!r->stop) {
        double now = td_time_s();
        if (r->dns && td_net_watch_take(r->dns, r->dns_addrs, r->dns_n)) {
            /* a name that did not resolve keeps the instances known */
            for (int k = 0; k < r->n_dns; k++)
                if (r->dns_n[k] >= 0)
                    apply_dns(r, r->dns_names[k], r->dns_addrs + (size_t)k * MAXI, r->dns_n[k],
                              r->dns_names[k] == r->prefill_dns);
        }
        pthread_mutex_unlock(&r->mu);
        poll_round(r);
        pthread_mutex_lock(&r->mu);
        td_rt_index_expire(r->ix, td_time_s()); /* under mu: lookups see times in order */
        for (int32_t i = 0; i < r->n_slots; i++)
            if (r->in[i].used && r->in[i].removed && r->in[i].in_flight == 0)
                td_rt_slot_free_locked(r, i);
        td_rt_process_queue_locked(r);
        /* Sleep until the next round; a request's end wakes the queue. */
        double until = now + r->p.poll_interval_s;
        while (!r->stop && td_time_s() < until) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            double left = until - td_time_s();
            if (left <= 0) break;
            long ns = ts.tv_nsec + (long)(left * 1e9);
            ts.tv_sec += ns / 1000000000L;
            ts.tv_nsec = ns % 1000000000L;
            pthread_cond_timedwait(&r->cv, &r->mu, &ts);
            if (r->q_head) td_rt_process_queue_locked(r);
        }
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}
