/* The shared blocking HTTP client (see httpc.h). */
#include "httpc.h"

#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    td_httpc_reply *r;
    size_t max;
} sink;

static size_t on_body(char *p, size_t sz, size_t n, void *ud) {
    sink *s = ud;
    size_t k = sz * n;
    if (s->r->len + k > s->max) {
        s->r->too_large = true;
        return 0;
    }
    char *nb = realloc(s->r->body, s->r->len + k + 1);
    if (!nb) return 0;
    memcpy(nb + s->r->len, p, k);
    s->r->body = nb;
    s->r->len += k;
    nb[s->r->len] = 0;
    return k;
}

bool td_httpc_global_init(void) {
    CURLcode rc = curl_global_init(CURL_GLOBAL_NOTHING);
    if (rc != CURLE_OK) TD_LOG_ERROR("curl_global_init: %s", curl_easy_strerror(rc));
    return rc == CURLE_OK;
}

td_status td_httpc_do(const td_httpc_req *r, td_httpc_reply *out) {
    memset(out, 0, sizeof *out);
    CURL *c = curl_easy_init();
    struct curl_slist *h = NULL;
    char hdr[1200];
    bool ok = c != NULL;
    if (ok && r->cluster_token) {
        snprintf(hdr, sizeof hdr, "X-Tandem-Cluster-Token: %s", r->cluster_token);
        ok = (h = curl_slist_append(h, hdr)) != NULL;
    }
    if (ok && r->json_body) {
        struct curl_slist *h2 = curl_slist_append(h, "Content-Type: application/json");
        ok = h2 != NULL;
        if (ok) h = h2;
    }
    if (!ok) {
        snprintf(out->err, sizeof out->err, "out of memory");
        curl_slist_free_all(h);
        if (c) curl_easy_cleanup(c);
        return TD_ERR_NOMEM;
    }
    sink s = {.r = out, .max = r->max_body};
    curl_easy_setopt(c, CURLOPT_URL, r->url);
    if (h) curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    if (r->json_body) curl_easy_setopt(c, CURLOPT_POSTFIELDS, r->json_body);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &s);
    if (r->timeout_ms > 0) curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, r->timeout_ms);
    if (r->connect_timeout_ms > 0)
        curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, r->connect_timeout_ms);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http");
    CURLcode rc = curl_easy_perform(c);
    if (rc == CURLE_OK) curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &out->code);
    curl_slist_free_all(h);
    curl_easy_cleanup(c);
    if (rc == CURLE_OK) return TD_OK;
    out->refused = rc == CURLE_COULDNT_CONNECT;
    snprintf(out->err, sizeof out->err, "%s",
             out->too_large ? "reply too large" : curl_easy_strerror(rc));
    return TD_ERR_IO;
}

void td_httpc_reply_free(td_httpc_reply *r) {
    free(r->body);
    r->body = NULL;
    r->len = 0;
}
