/* libFuzzer target for the internal control-message decoder
 * (common/transfer/msg.h): any input is decoded against a fixed receiver
 * (cluster token "cluster-secret-0123456789", a 4-layer model with 4 KV
 * heads of 8, 512 tokens, blocks of 4); a message that is accepted must
 * hold what the validation promises, checked here again field by field.
 * Seeds (tests/fuzz/corpus/fuzz_xfer_msg) are valid messages of every kind,
 * so mutations get past the token check. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/transfer/msg.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const uint8_t TOKEN[] = "cluster-secret-0123456789";

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    td_log_set_level(TD_LOG_ERROR);
    return 0;
}

static void check_request(const Tandem__Internal__V1__PrefillRequest *q) {
    if (q->n_tokens < 1 || q->n_tokens > 256) abort();
    for (size_t i = 0; i < q->n_tokens; i++)
        if (q->tokens[i] < 0 || q->tokens[i] >= 512) abort();
    if (q->cached_tokens % 4 || q->cached_tokens >= q->n_tokens) abort();
    if (q->deadline_ms < 1 || q->deadline_ms > 600000) abort();
    if (q->peer_case != TANDEM__INTERNAL__V1__PREFILL_REQUEST__PEER_EXCHANGE) return;
    const Tandem__Internal__V1__Exchange *x = q->exchange;
    uint32_t world = x->plan->tp * x->plan->pp * x->plan->cp;
    if (world < 1 || world > 64 || x->n_ranks != world || q->n_dest != world) abort();
    for (size_t i = 0; i < x->n_ranks; i++) {
        const Tandem__Internal__V1__RankEndpoint *r = x->ranks[i];
        if (r->rank >= world || r->kv_bytes != td_xfer_rank_kv_bytes(x->plan, x->kv, r->rank) ||
            r->kv_base + r->kv_bytes < r->kv_base)
            abort();
    }
    for (size_t i = 0; i < q->n_dest; i++) {
        const Tandem__Internal__V1__RankBlocks *d = q->dest[i];
        if (d->n_block_ids != (q->n_tokens + 3) / 4) abort();
        for (size_t b = 0; b < d->n_block_ids; b++)
            if (d->block_ids[b] < 0 || (uint32_t)d->block_ids[b] >= x->kv->n_blocks) abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    td_xfer_limits l = {.cluster_token = TOKEN,
                        .cluster_token_len = sizeof TOKEN - 1,
                        .max_bytes = 65536,
                        .n_vocab = 512,
                        .max_ctx = 256,
                        .n_layer = 4,
                        .n_head_kv = 4,
                        .head_dim = 8,
                        .block_size = 4,
                        .compat = {.lo = 0x1122334455667788ull, .hi = 0x99aabbccddeeff00ull}};
    td_xfer_msg *m = NULL;
    char err[256];
    td_status st = td_xfer_msg_decode(&l, data, size, &m, err, sizeof err);
    if (st != TD_OK) {
        if (m || !err[0] || strlen(err) >= sizeof err) abort();
        return 0;
    }
    if (!m || m->cluster_token.len != sizeof TOKEN - 1 ||
        memcmp(m->cluster_token.data, TOKEN, sizeof TOKEN - 1) || !m->from || m->from->epoch == 0)
        abort();
    switch (m->body_case) {
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_REQUEST:
        check_request(m->prefill_request);
        break;
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY_PREFILL_DONE: {
        const Tandem__Internal__V1__PrefillDone *d = m->prefill_done;
        if (d->first_token < 0 || d->first_token >= 512 || !isfinite(d->logprob) ||
            d->logprob > 0 || d->n_top_logprobs > 20)
            abort();
        break;
    }
    case TANDEM__INTERNAL__V1__CONTROL_MESSAGE__BODY__NOT_SET: abort();
    default: break;
    }
    td_xfer_msg_free(m);
    return 0;
}
