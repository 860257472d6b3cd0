/* Block hashes: XXH3-128 over a little-endian byte image, so every host
 * computes the same value. */
#include "hash.h"

#include <string.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

static void put_u64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static void put_u32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static td_kv_hash from_xxh(XXH128_hash_t h) {
    td_kv_hash r = {.lo = h.low64, .hi = h.high64};
    return r;
}

td_kv_hash td_kv_hash_block(td_kv_hash parent, const int32_t *tokens, int32_t n_tokens,
                            const void *extra, size_t extra_len) {
    XXH3_state_t st;
    XXH3_128bits_reset(&st);
    unsigned char head[16];
    put_u64(head, parent.lo);
    put_u64(head + 8, parent.hi);
    XXH3_128bits_update(&st, head, sizeof head);
    /* Tokens in small batches of little-endian u32 (no allocation). */
    unsigned char buf[256];
    int32_t i = 0;
    while (i < n_tokens) {
        size_t k = 0;
        for (; i < n_tokens && k + 4 <= sizeof buf; i++, k += 4)
            put_u32(buf + k, (uint32_t)tokens[i]);
        XXH3_128bits_update(&st, buf, k);
    }
    if (extra && extra_len) XXH3_128bits_update(&st, extra, extra_len);
    return from_xxh(XXH3_128bits_digest(&st));
}

int32_t td_kv_hash_chain(td_kv_hash root, const int32_t *tokens, int32_t n_tokens,
                         int32_t block_size, td_kv_hash *out) {
    if (block_size <= 0 || n_tokens <= 0) return 0;
    int32_t n = n_tokens / block_size;
    td_kv_hash parent = root;
    for (int32_t b = 0; b < n; b++) {
        parent =
            td_kv_hash_block(parent, tokens + (size_t)b * (size_t)block_size, block_size, NULL, 0);
        out[b] = parent;
    }
    return n;
}

static void update_field(XXH3_state_t *st, const void *p, size_t n) {
    unsigned char len[8];
    put_u64(len, (uint64_t)n);
    XXH3_128bits_update(st, len, sizeof len);
    if (n) XXH3_128bits_update(st, p, n);
}

static void update_str(XXH3_state_t *st, const char *s) {
    update_field(st, s ? s : "", s ? strlen(s) : 0);
}

static void update_i32(XXH3_state_t *st, int32_t v) {
    unsigned char b[4];
    put_u32(b, (uint32_t)v);
    update_field(st, b, sizeof b);
}

td_kv_hash td_kv_compat_hash(const td_kv_compat *c) {
    XXH3_state_t st;
    XXH3_128bits_reset(&st);
    update_str(&st, "tandem-kv");
    update_str(&st, c->model_id);
    update_str(&st, c->weight_type);
    update_str(&st, c->kv_dtype);
    update_i32(&st, c->block_size);
    update_i32(&st, c->layout_version);
    update_i32(&st, c->protocol_version);
    return from_xxh(XXH3_128bits_digest(&st));
}

void td_kv_hash_hex(td_kv_hash h, char buf[33]) {
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < 16; i++) {
        buf[i] = digits[(h.hi >> (60 - 4 * i)) & 15];
        buf[16 + i] = digits[(h.lo >> (60 - 4 * i)) & 15];
    }
    buf[32] = '\0';
}

void td_kv_hash_bytes(td_kv_hash h, uint8_t out[16]) {
    memcpy(out, &h.lo, 8);
    memcpy(out + 8, &h.hi, 8);
}

td_kv_hash td_kv_hash_from_bytes(const uint8_t in[16]) {
    td_kv_hash h;
    memcpy(&h.lo, in, 8);
    memcpy(&h.hi, in + 8, 8);
    return h;
}

static int hex_val(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

bool td_kv_hash_parse(const char *s, td_kv_hash *h_p) {
    if (!s) return false;
    uint64_t v[2] = {0, 0};
    for (int i = 0; i < 32; i++) {
        int d = hex_val(s[i]);
        if (d < 0) return false;
        v[i / 16] = (v[i / 16] << 4) | (uint64_t)d;
    }
    if (s[32] != '\0') return false;
    h_p->hi = v[0];
    h_p->lo = v[1];
    return true;
}
