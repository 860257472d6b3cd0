/* Internal control messages: decode and validate (msg.h). */
#include "msg.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/comm/comm.h"
#include "map.h"

#define DEFAULT_MAX_BYTES ((size_t)16 << 20)
#define MAX_ID            63
#define MAX_TEXT          1024
#define MAX_BLOB          4096
#define MAX_MS            600000u
#define MAX_TOP           20
#define MAX_STATE         256
#define MAX_LEASE_IDS     1024

typedef struct {
    char *buf;
    size_t len;
} errbuf;

static bool fail(errbuf *e, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->buf, e->len, fmt, ap);
    va_end(ap);
    return false;
}

static bool id_ok(const char *s) {
    size_t n = s ? strlen(s) : 0;
    if (n < 1 || n > MAX_ID) return false;
    for (size_t i = 0; i < n; i++)
        if (s[i] < 0x21 || s[i] > 0x7e) return false;
    return true;
}

/* At most MAX_TEXT bytes of well-formed UTF-8 (protobuf-c does not check
 * that strings are). */
static bool text_ok(const char *s) {
    if (!s) return true;
    size_t n = strlen(s);
    if (n > MAX_TEXT) return false;
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        unsigned c = p[i];
        size_t k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (k == 0 || (k > 1 && c < 0xc2) || i + k > n) return false;
        for (size_t j = 1; j < k; j++)
            if ((p[i + j] & 0xc0) != 0x80) return false;
        i += k;
    }
    return true;
}

static bool compat_ok(const ProtobufCBinaryData *b, td_kv_hash want) {
    if (b->len != 16) return false;
    td_kv_hash got = td_kv_hash_from_bytes(b->data);
    return got.lo == want.lo && got.hi == want.hi;
}

uint64_t td_xfer_rank_kv_bytes(const Tandem__Internal__V1__Plan *plan,
                               const Tandem__Internal__V1__KvGeometry *kv, uint32_t rank) {
    if (!plan || !kv || plan->tp < 1 || plan->cp < 1 || plan->pp < 1 || plan->tp > 4096 ||
        plan->cp > 4096 || plan->pp > 4096 || plan->n_stage_begin != (size_t)plan->pp + 1 ||
        kv->n_head_kv < 1)
        return 0;
    uint64_t world = (uint64_t)plan->tp * plan->cp * plan->pp;
    if (rank >= world) return 0;
    uint32_t stage = (uint32_t)(rank / ((uint64_t)plan->tp * plan->cp));
    if (plan->stage_begin[stage + 1] <= plan->stage_begin[stage]) return 0;
    if (kv->n_head_kv > INT32_MAX) return 0;
    int32_t h0, h1;
    td_xfer_rank_heads((int)plan->tp, 0, (int32_t)kv->n_head_kv, &h0, &h1);
    uint64_t v = plan->stage_begin[stage + 1] - plan->stage_begin[stage], r;
    size_t elem = td_kv_elem_bytes(kv->dtype);
    if (elem == 0) return 0;
    uint64_t f[] = {(uint64_t)(h1 - h0), kv->head_dim, kv->block_size, kv->n_blocks, 2u * elem};
    for (size_t i = 0; i < TD_ARRAY_SIZE(f); i++) {
        if (__builtin_mul_overflow(v, f[i], &r)) return 0;
        v = r;
    }
    return v;
}

static bool plan_ok(const Tandem__Internal__V1__Plan *p, const td_xfer_limits *lim, errbuf *e) {
    if (!p) return fail(e, "exchange without a plan");
    if (p->tp < 1 || p->pp < 1 || p->cp < 1 || (uint64_t)p->tp * p->pp * p->cp > TD_COMM_MAX_RANKS)
        return fail(e, "plan tp %u x pp %u x cp %u: 1 .. %d ranks", p->tp, p->pp, p->cp,
                    TD_COMM_MAX_RANKS);
    if (p->n_stage_begin != (size_t)p->pp + 1 || p->stage_begin[0] != 0 ||
        p->stage_begin[p->pp] != (uint32_t)lim->n_layer)
        return fail(e, "plan stages do not cover the %d layers", lim->n_layer);
    for (uint32_t s = 0; s < p->pp; s++)
        if (p->stage_begin[s] >= p->stage_begin[s + 1])
            return fail(e, "plan stage %u is empty or out of order", s);
    uint32_t kv = (uint32_t)lim->n_head_kv;
    if (kv % p->tp && p->tp % kv)
        return fail(e, "plan tp %u and %u KV heads: one must divide the other", p->tp, kv);
    return true;
}

static bool exchange_ok(const Tandem__Internal__V1__Exchange *x, const td_xfer_limits *lim,
                        errbuf *e) {
    if (x->exchange_id == 0) return fail(e, "exchange id 0");
    if (!plan_ok(x->plan, lim, e)) return false;
    const Tandem__Internal__V1__KvGeometry *g = x->kv;
    if (!g) return fail(e, "exchange without a KV geometry");
    if (g->n_layer != (uint32_t)lim->n_layer || g->n_head_kv != (uint32_t)lim->n_head_kv ||
        g->head_dim != (uint32_t)lim->head_dim || g->block_size != (uint32_t)lim->block_size)
        return fail(e,
                    "KV geometry (%u layers, %u KV heads of %u, blocks of %u) differs from "
                    "ours (%d, %d of %d, %d)",
                    g->n_layer, g->n_head_kv, g->head_dim, g->block_size, lim->n_layer,
                    lim->n_head_kv, lim->head_dim, lim->block_size);
    if (g->dtype != (uint32_t)lim->kv_dtype)
        return fail(e, "its KV cache holds %s, ours %s (--kv-dtype must be the same on both)",
                    g->dtype <= INT32_MAX ? td_dtype_name((int)g->dtype) : "unknown",
                    td_dtype_name((int)lim->kv_dtype));
    if (g->n_blocks < 1 || g->n_blocks > INT32_MAX)
        return fail(e, "KV pool of %u blocks", g->n_blocks);
    if (!compat_ok(&x->compat, lim->compat)) return fail(e, "exchange compatibility hash differs");
    uint32_t world = x->plan->tp * x->plan->pp * x->plan->cp;
    if (x->n_ranks != world)
        return fail(e, "exchange lists %zu ranks, the plan has %u", x->n_ranks, world);
    uint64_t seen = 0; /* world <= 64 */
    for (size_t i = 0; i < x->n_ranks; i++) {
        const Tandem__Internal__V1__RankEndpoint *r = x->ranks[i];
        if (r->rank >= world || (seen >> r->rank) & 1)
            return fail(e, "exchange rank %u out of range or repeated", r->rank);
        seen |= (uint64_t)1 << r->rank;
        if (r->worker_address.len < 1 || r->worker_address.len > MAX_BLOB || r->kv_rkey.len < 1 ||
            r->kv_rkey.len > MAX_BLOB)
            return fail(e, "rank %u: worker address or rkey of %zu / %zu bytes (1 .. %d)", r->rank,
                        r->worker_address.len, r->kv_rkey.len, MAX_BLOB);
        uint64_t want = td_xfer_rank_kv_bytes(x->plan, g, r->rank), end;
        if (want == 0 || r->kv_bytes != want || __builtin_add_overflow(r->kv_base, want, &end))
            return fail(e, "rank %u: KV region of %llu bytes at %#llx (the geometry gives %llu)",
                        r->rank, (unsigned long long)r->kv_bytes, (unsigned long long)r->kv_base,
                        (unsigned long long)want);
    }
    return true;
}

td_status td_xfer_check_dest(const Tandem__Internal__V1__PrefillRequest *req,
                             const Tandem__Internal__V1__Exchange *ex, char *err, size_t err_len) {
    errbuf e = {err, err_len};
    if (!req || !ex || !ex->plan || !ex->kv || ex->kv->block_size < 1) {
        fail(&e, "no exchange to check the destination against");
        return TD_ERR_INVALID;
    }
    uint32_t world = ex->plan->tp * ex->plan->pp * ex->plan->cp;
    size_t want = (req->n_tokens + ex->kv->block_size - 1) / ex->kv->block_size;
    if (req->n_dest != world || world > 64) {
        fail(&e, "destination for %zu ranks, the decode plan has %u", req->n_dest, world);
        return TD_ERR_INVALID;
    }
    uint64_t seen = 0;
    for (size_t i = 0; i < req->n_dest; i++) {
        const Tandem__Internal__V1__RankBlocks *d = req->dest[i];
        if (d->rank >= world || (seen >> d->rank) & 1) {
            fail(&e, "destination rank %u out of range or repeated", d->rank);
            return TD_ERR_INVALID;
        }
        seen |= (uint64_t)1 << d->rank;
        if (d->n_block_ids != want) {
            fail(&e, "rank %u: %zu destination blocks for %zu prompt tokens (%zu needed)", d->rank,
                 d->n_block_ids, req->n_tokens, want);
            return TD_ERR_INVALID;
        }
        for (size_t b = 0; b < d->n_block_ids; b++)
            if (d->block_ids[b] < 0 || (uint32_t)d->block_ids[b] >= ex->kv->n_blocks) {
                fail(&e, "rank %u: destination block %d out of the pool of %u", d->rank,
                     d->block_ids[b], ex->kv->n_blocks);
                return TD_ERR_INVALID;
            }
    }
    return TD_OK;
}

static bool prefill_request_ok(const Tandem__Internal__V1__PrefillRequest *q,
                               const td_xfer_limits *lim, errbuf *e) {
    if (!id_ok(q->request_id)) return fail(e, "prefill request: bad request id");
    if (q->n_tokens < 1 || q->n_tokens > (size_t)lim->max_ctx)
        return fail(e, "prefill request %s: %zu tokens (1 .. %d)", q->request_id, q->n_tokens,
                    lim->max_ctx);
    for (size_t i = 0; i < q->n_tokens; i++)
        if (q->tokens[i] < 0 || q->tokens[i] >= lim->n_vocab)
            return fail(e, "prefill request %s: token %d out of the vocabulary (%d)", q->request_id,
                        q->tokens[i], lim->n_vocab);
    if (q->cached_tokens % (uint32_t)lim->block_size || q->cached_tokens >= q->n_tokens)
        return fail(e, "prefill request %s: %u cached tokens (whole blocks, below %zu)",
                    q->request_id, q->cached_tokens, q->n_tokens);
    if (q->deadline_ms < 1 || q->deadline_ms > MAX_MS)
        return fail(e, "prefill request %s: deadline %u ms (1 .. %u)", q->request_id,
                    q->deadline_ms, MAX_MS);
    if (q->lease_ms > MAX_MS)
        return fail(e, "prefill request %s: lease of %u ms (at most %u)", q->request_id,
                    q->lease_ms, MAX_MS);
    if (!compat_ok(&q->compat, lim->compat))
        return fail(e, "prefill request %s: compatibility hash differs", q->request_id);
    if (q->peer_case == TANDEM__INTERNAL__V1__PREFILL_REQUEST__PEER_EXCHANGE) {
        if (!exchange_ok(q->exchange, lim, e)) return false;
        if (td_xfer_check_dest(q, q->exchange, e->buf, e->len)) return false;
    } else if (q->peer_case != TANDEM__INTERNAL__V1__PREFILL_REQUEST__PEER_EXCHANGE_ID ||
               q->exchange_id == 0) {
        return fail(e, "prefill request %s: neither an exchange nor its id", q->request_id);
    }
    return true;
}

static bool logprob_ok(int32_t tok, float lp, const td_xfer_limits *lim) {
    return tok >= 0 && tok < lim->n_vocab && isfinite(lp) && lp <= 0.0f;
}

static bool prefill_done_ok(const Tandem__Internal__V1__PrefillDone *d, const td_xfer_limits *lim,
                            errbuf *e) {
    if (!id_ok(d->request_id)) return fail(e, "prefill done: bad request id");
    if (!logprob_ok(d->first_token, d->logprob, lim))
        return fail(e, "prefill done %s: first token %d (logprob %g) out of range", d->request_id,
                    d->first_token, (double)d->logprob);
    if (d->n_top_logprobs > MAX_TOP)
        return fail(e, "prefill done %s: %zu top logprobs (at most %d)", d->request_id,
                    d->n_top_logprobs, MAX_TOP);
    for (size_t i = 0; i < d->n_top_logprobs; i++)
        if (!logprob_ok(d->top_logprobs[i]->token_id, d->top_logprobs[i]->logprob, lim))
            return fail(e, "prefill done %s: top logprob %zu out of range", d->request_id, i);
    if (d->prefix_tokens_reused > (uint32_t)lim->max_ctx || d->sampler_state.len > MAX_STATE)
        return fail(e, "prefill done %s: %u reused tokens or %zu bytes of sampler state",
                    d->request_id, d->prefix_tokens_reused, d->sampler_state.len);
    return true;
}

static bool body_ok(const td_xfer_msg *m, const td_xfer_limits *lim, errbuf *e) {
    switch (m->body_case) {
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_REQUEST:
        return prefill_request_ok(m->prefill_request, lim, e);
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_DONE:
        return prefill_done_ok(m->prefill_done, lim, e);
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_REJECTED: {
        const Tandem__Internal__V1__PrefillRejected *r = m->prefill_rejected;
        if (!id_ok(r->request_id) || !text_ok(r->message))
            return fail(e, "prefill rejected: bad request id or message");
        if (r->reason < TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_BUSY ||
            r->reason > TANDEM__INTERNAL__V1__REJECT_REASON__REJECT_WOULD_MISS_DEADLINE ||
            r->retry_after_ms > MAX_MS || r->expected_start_ms > MAX_MS)
            return fail(e, "prefill rejected %s: reason %d, retry after %u ms, start in %u ms",
                        r->request_id, (int)r->reason, r->retry_after_ms, r->expected_start_ms);
        return true;
    }
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_TRANSFER_FAILED:
        if (!id_ok(m->transfer_failed->request_id) || !text_ok(m->transfer_failed->message))
            return fail(e, "transfer failed: bad request id or message");
        return true;
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_TRANSFER_CONSUMED:
        if (!id_ok(m->transfer_consumed->request_id))
            return fail(e, "transfer consumed: bad request id");
        return true;
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_ABORT:
        if (!id_ok(m->abort->request_id) || !text_ok(m->abort->message))
            return fail(e, "abort: bad request id or message");
        return true;
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_LEASE_RENEWAL: {
        const Tandem__Internal__V1__LeaseRenewal *l = m->lease_renewal;
        if (l->n_request_ids < 1 || l->n_request_ids > MAX_LEASE_IDS || l->lease_ms < 1 ||
            l->lease_ms > MAX_MS)
            return fail(e, "lease renewal: %zu ids (1 .. %d), %u ms (1 .. %u)", l->n_request_ids,
                        MAX_LEASE_IDS, l->lease_ms, MAX_MS);
        for (size_t i = 0; i < l->n_request_ids; i++)
            if (!id_ok(l->request_ids[i])) return fail(e, "lease renewal: bad request id %zu", i);
        return true;
    }
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_EXCHANGE:
        return exchange_ok(m->exchange, lim, e);
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_JOB_PROGRESS:
        if (!id_ok(m->job_progress->request_id)) return fail(e, "job progress: bad request id");
        if (m->job_progress->tokens < 1 || m->job_progress->tokens > (uint32_t)lim->max_ctx)
            return fail(e, "job progress %s: %u tokens (1 .. %d)", m->job_progress->request_id,
                        m->job_progress->tokens, lim->max_ctx);
        return true;
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_JOB_ABORTED:
        if (!id_ok(m->job_aborted->request_id) || !text_ok(m->job_aborted->message))
            return fail(e, "job aborted: bad request id or message");
        return true;
    default: return fail(e, "control message without a body");
    }
}

td_status td_xfer_msg_decode(const td_xfer_limits *lim, const uint8_t *buf, size_t len,
                             td_xfer_msg **msg_p, char *err, size_t err_len) {
    if (msg_p) *msg_p = NULL;
    if (!lim || !msg_p || !err || err_len < 1 || (!buf && len) || !lim->cluster_token ||
        lim->cluster_token_len < 1 || lim->block_size < 1 || lim->n_head_kv < 1)
        return TD_ERR_INVALID;
    errbuf e = {err, err_len};
    err[0] = '\0';
    size_t max = lim->max_bytes ? lim->max_bytes : DEFAULT_MAX_BYTES;
    if (len > max) {
        fail(&e, "control message of %zu bytes (at most %zu)", len, max);
        return TD_ERR_INVALID;
    }
    td_xfer_msg *m = tandem__internal__v1__control_message__unpack(NULL, len, buf);
    if (!m) {
        fail(&e, "not a control message (%zu bytes that do not unpack)", len);
        return TD_ERR_INVALID;
    }
    bool ok;
    if (!td_secret_eq(lim->cluster_token, lim->cluster_token_len, m->cluster_token.data,
                      m->cluster_token.len))
        ok = fail(&e, "control message with a wrong cluster token");
    else if (!m->from || !id_ok(m->from->instance_id) || m->from->epoch == 0)
        ok = fail(&e, "control message without a valid peer (instance id, epoch)");
    else
        ok = body_ok(m, lim, &e);
    if (!ok) {
        tandem__internal__v1__control_message__free_unpacked(m, NULL);
        return TD_ERR_INVALID;
    }
    *msg_p = m;
    return TD_OK;
}

void td_xfer_msg_free(td_xfer_msg *msg) {
    if (msg) tandem__internal__v1__control_message__free_unpacked(msg, NULL);
}

bool td_xfer_would_miss(int64_t queued_tokens, double tokens_per_s, double deadline_s,
                        double *start_s) {
    if (!(tokens_per_s > 0) || !isfinite(tokens_per_s)) return false;
    double start = (double)TD_MAX(queued_tokens, 0) / tokens_per_s;
    if (start <= deadline_s) return false;
    if (start_s) *start_s = start;
    return true;
}
