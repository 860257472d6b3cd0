/* Decoding and validation of the internal control messages
 * (proto/internal.proto) a prefill or decode instance receives from a peer.
 * The bytes are untrusted: a message is accepted only when it unpacks
 * within the size limit, carries this cluster's token (compared in constant
 * time), names a peer (printable instance id, non-zero epoch) and every
 * field is in range for the receiver's own model and KV geometry; anything
 * else is one error line (returned in err, for the receiver to log and to
 * answer with PrefillRejected / TransferFailed) and nothing is kept.
 *
 * What is checked, per body:
 * - Exchange: id non-zero; plan (tp, pp, cp >= 1, world <= TD_COMM_MAX_RANKS,
 *   pp + 1 stage boundaries from 0 to n_layer, increasing; tp and the KV
 *   heads divide one another); geometry equal to the receiver's (layers, KV
 *   heads, head dim, block size) with 1 .. INT32_MAX blocks; every rank once
 *   with a worker address and an rkey of 1 .. 4096 bytes and a region
 *   (base, bytes) that does not wrap and whose size is exactly what the plan
 *   and geometry give that rank (td_xfer_rank_kv_bytes); compat equal to the
 *   receiver's.
 * - PrefillRequest: request id (1 .. 63 printable ASCII); 1 .. max_ctx
 *   tokens, each in the vocabulary; cached_tokens a whole number of blocks
 *   below the prompt length; deadline 1 .. 600000 ms; compat equal; with an
 *   inline exchange, that exchange as above and the destination blocks
 *   against it (td_xfer_check_dest); with a reference, the caller checks
 *   the destination against the exchange it holds under that id.
 *   The sampling parameters are left to the public request validation.
 * - PrefillDone: request id; first token in the vocabulary, its logprob and
 *   at most 20 top logprobs finite and <= 0 with tokens in the vocabulary;
 *   prefix_tokens_reused <= max_ctx; sampler state <= 256 bytes.
 * - PrefillRejected, TransferFailed, Abort, TransferConsumed: request id;
 *   a known reason; messages of at most 1024 bytes of valid UTF-8;
 *   retry_after and expected_start <= 600000 ms.
 * - LeaseRenewal: 1 .. 1024 request ids; lease 1 .. 600000 ms. */
#ifndef TD_TRANSFER_MSG_H
#define TD_TRANSFER_MSG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/base/base.h"
#include "common/kv/kv.h"
#include "proto/internal.pb-c.h"

typedef struct {
    const uint8_t *cluster_token; /* the cluster's shared secret */
    size_t cluster_token_len;     /* >= 1 */
    size_t max_bytes;             /* largest message accepted; 0: 16 MiB */
    int32_t n_vocab;
    int32_t max_ctx; /* longest prompt */
    int32_t n_layer, n_head_kv, head_dim, block_size;
    td_dtype kv_dtype; /* of our K and V: a peer's geometry must give the same */
    td_kv_hash compat; /* this instance's compatibility hash */
} td_xfer_limits;

typedef Tandem__Internal__V1__ControlMessage td_xfer_msg;

/* Unpacks and validates buf. On success *msg_p owns the message (free with
 * td_xfer_msg_free); on failure *msg_p is NULL, err (err_len >= 1) holds
 * one line, and TD_ERR_INVALID (or TD_ERR_NOMEM) is returned. */
td_status td_xfer_msg_decode(const td_xfer_limits *lim, const uint8_t *buf, size_t len,
                             td_xfer_msg **msg_p, char *err, size_t err_len);
void td_xfer_msg_free(td_xfer_msg *msg); /* accepts NULL */

/* Bytes of the KV region of rank `rank` under plan and geometry: its
 * stage's layers x its KV heads x head_dim x block_size x n_blocks x K and V
 * x the bytes of the geometry's dtype. 0 when the plan or rank is out of
 * range, the dtype is not one KV is held in, or the size overflows. */
uint64_t td_xfer_rank_kv_bytes(const Tandem__Internal__V1__Plan *plan,
                               const Tandem__Internal__V1__KvGeometry *kv, uint32_t rank);

/* The destination of a prefill request against the decode instance's
 * (validated) exchange: every rank of its plan once, each with exactly
 * ceil(n_tokens / block_size) block ids in [0, n_blocks). */
td_status td_xfer_check_dest(const Tandem__Internal__V1__PrefillRequest *req,
                             const Tandem__Internal__V1__Exchange *ex, char *err, size_t err_len);

/* P's admission of a prefill job (REJECT_WOULD_MISS_DEADLINE): with
 * queued_tokens prompt tokens ahead of it at tokens_per_s, the job starts
 * after queued / rate; true when that start is past deadline_s (the
 * request's deadline bounds its start, both from now), with *start_s set.
 * No speed measured yet (tokens_per_s <= 0, or not finite): false. */
bool td_xfer_would_miss(int64_t queued_tokens, double tokens_per_s, double deadline_s,
                        double *start_s);

#endif
