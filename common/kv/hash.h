/* Block hashes of the prefix cache (DESIGN.md §4), the same function on
 * every worker and in the router so hashes agree across the cluster:
 *
 *   hash(block i) = XXH3_128(parent ‖ token ids as little-endian u32 ‖ extra)
 *
 * where parent is the previous block's hash, and the first block's parent
 * is the instance's compatibility hash, so two models never share a prefix.
 * The 128-bit value is serialised as 16 bytes little-endian: lo then hi. */
#ifndef TD_KV_HASH_H
#define TD_KV_HASH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t lo, hi;
} td_kv_hash;

static inline bool td_kv_hash_eq(td_kv_hash a, td_kv_hash b) {
    return a.lo == b.lo && a.hi == b.hi;
}

/* Hash of one full block given its parent's hash. extra (may be NULL) holds
 * extra keys (e.g. a LoRA or multimodal id); extra_len bytes of it. */
td_kv_hash td_kv_hash_block(td_kv_hash parent, const int32_t *tokens, int32_t n_tokens,
                            const void *extra, size_t extra_len);

/* Hashes of the n_tokens / block_size full blocks of tokens, chained from
 * root, into out[0..n_tokens / block_size). Returns that count. */
int32_t td_kv_hash_chain(td_kv_hash root, const int32_t *tokens, int32_t n_tokens,
                         int32_t block_size, td_kv_hash *out);

/* The compatibility hash: XXH3_128 over "tandem-kv", model_id,
 * weight_type, kv_dtype (strings; NULL is ""), block_size, layout_version,
 * protocol_version (each int32 as 4 little-endian bytes), every field
 * written as its byte length (u64 little-endian) followed by its bytes, so
 * instances agree on it only when everything that changes the meaning of
 * a block agrees. */
typedef struct {
    const char *model_id;    /* model name + a digest of the weights file's identity */
    const char *weight_type; /* e.g. "q4_1" */
    const char *kv_dtype;    /* e.g. "f32" */
    int32_t block_size;
    int32_t layout_version; /* TD_KV_LAYOUT_VERSION */
    int32_t protocol_version;
} td_kv_compat;

#define TD_KV_LAYOUT_VERSION   1
#define TD_KV_PROTOCOL_VERSION 1

td_kv_hash td_kv_compat_hash(const td_kv_compat *c);

/* 32 lowercase hex digits (hi then lo, big-endian reading) + NUL into buf[33]. */
void td_kv_hash_hex(td_kv_hash h, char buf[33]);
/* The 16 bytes that carry a hash on the wire (lo then hi, each in host
 * order: the protocol's compatibility field), and back. */
void td_kv_hash_bytes(td_kv_hash h, uint8_t out[16]);
td_kv_hash td_kv_hash_from_bytes(const uint8_t in[16]);
/* Parses 32 hex digits; false on anything else. */
bool td_kv_hash_parse(const char *s, td_kv_hash *h_p);

#endif
