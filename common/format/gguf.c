/* GGUF v2/v3 reader. Layout (little-endian):
 *   magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
 *   n_kv x (string key | u32 type | value)
 *   n_tensors x (string name | u32 n_dims | u64 ne[n_dims] | u32 type | u64 offset)
 *   padding to `alignment` | data section (tensor offsets relative to its start)
 * where string = u64 length | bytes (no NUL) and an array value is
 * u32 elem_type | u64 n | elements.
 *
 * Every read goes through a cursor that checks the remaining bytes first, and
 * every count is bounded by what the remaining bytes could possibly hold
 * before anything is allocated for it. */
#include "gguf.h"

#include <float.h>
#include <math.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/dtype.h"

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
               "GGUF reader assumes a little-endian host");

#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_DEPTH         4 /* nesting of arrays of arrays we walk through */

typedef struct {
    const char *key; /* NUL-terminated copy */
    td_gguf_type type;
    /* scalars: raw bytes in the mapping; string: copy; array: see below */
    const uint8_t *raw;
    char *str;
    size_t str_len;
    td_gguf_type arr_type;
    uint64_t arr_n;
    const uint8_t *arr_data; /* numeric arrays: raw elements in the mapping */
    char *arr_strs;          /* string arrays: all strings, each NUL-terminated */
    uint64_t *arr_offs;      /* string arrays: n + 1 offsets into arr_strs */
} gguf_kv;

struct td_gguf {
    char *name;
    void *map; /* NULL for td_gguf_open_buffer */
    size_t map_size;
    const uint8_t *base;
    size_t size;
    uint32_t version;
    size_t alignment;
    size_t data_start;

    int64_t n_kv;
    gguf_kv *kvs;
    int64_t n_tensors;
    td_gguf_tensor *tensors;

    /* open-addressing hash tables of indices + 1 (0 = empty), power-of-two sized */
    uint32_t *kv_index;
    size_t kv_index_cap;
    uint32_t *tensor_index;
    size_t tensor_index_cap;
};

typedef struct {
    const uint8_t *base;
    size_t size;
    size_t off;
    const char *fn;   /* public function name for log lines */
    const char *name; /* file name for log lines */
} cursor;

/* ---- type tables ---- */

typedef struct {
    int block_elems;
    int block_bytes;
} type_size;

/* GGUF tensor types that still exist in ggml (removed ids stay zero and are
 * rejected as unknown). Sizes are those of ggml's block structs. */
static const type_size g_type_sizes[] = {
    [0] = {1, 4},      /* f32 */
    [1] = {1, 2},      /* f16 */
    [2] = {32, 18},    /* q4_0 */
    [3] = {32, 20},    /* q4_1 */
    [6] = {32, 22},    /* q5_0 */
    [7] = {32, 24},    /* q5_1 */
    [8] = {32, 34},    /* q8_0 */
    [9] = {32, 36},    /* q8_1: two halves + 32 int8 */
    [10] = {256, 84},  /* q2_K */
    [11] = {256, 110}, /* q3_K */
    [12] = {256, 144}, /* q4_K */
    [13] = {256, 176}, /* q5_K */
    [14] = {256, 210}, /* q6_K */
    [15] = {256, 292}, /* q8_K */
    [16] = {256, 66},  /* iq2_xxs */
    [17] = {256, 74},  /* iq2_xs */
    [18] = {256, 98},  /* iq3_xxs */
    [19] = {256, 50},  /* iq1_s */
    [20] = {32, 18},   /* iq4_nl */
    [21] = {256, 110}, /* iq3_s */
    [22] = {256, 82},  /* iq2_s */
    [23] = {256, 136}, /* iq4_xs */
    [24] = {1, 1},     /* i8 */
    [25] = {1, 2},     /* i16 */
    [26] = {1, 4},     /* i32 */
    [27] = {1, 8},     /* i64 */
    [28] = {1, 8},     /* f64 */
    [29] = {256, 56},  /* iq1_m */
    [30] = {1, 2},     /* bf16 */
    [34] = {256, 54},  /* tq1_0 */
    [35] = {256, 66},  /* tq2_0 */
    [39] = {32, 17},   /* mxfp4 */
    [40] = {64, 36},   /* nvfp4 */
    [41] = {128, 18},  /* q1_0 */
};

bool td_gguf_type_info(int type, int *block_elems_p, size_t *block_bytes_p) {
    if (type < 0 || type >= (int)TD_ARRAY_SIZE(g_type_sizes) || g_type_sizes[type].block_elems == 0)
        return false;
    if (block_elems_p) *block_elems_p = g_type_sizes[type].block_elems;
    if (block_bytes_p) *block_bytes_p = (size_t)g_type_sizes[type].block_bytes;
    return true;
}

/* Size of a scalar metadata value, 0 for STRING/ARRAY/unknown. */
static size_t kv_scalar_size(uint32_t t) {
    switch (t) {
    case TD_GGUF_UINT8:
    case TD_GGUF_INT8:
    case TD_GGUF_BOOL: return 1;
    case TD_GGUF_UINT16:
    case TD_GGUF_INT16: return 2;
    case TD_GGUF_UINT32:
    case TD_GGUF_INT32:
    case TD_GGUF_FLOAT32: return 4;
    case TD_GGUF_UINT64:
    case TD_GGUF_INT64:
    case TD_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

static const char *kv_type_name(uint32_t t) {
    static const char *const names[] = {"uint8",  "int8",    "uint16", "int16",  "uint32",
                                        "int32",  "float32", "bool",   "string", "array",
                                        "uint64", "int64",   "float64"};
    return t < TD_ARRAY_SIZE(names) ? names[t] : "unknown";
}

/* ---- helpers ---- */

/* Printable, bounded rendering of an untrusted name for a log line. */
static const char *printable(const char *s, size_t len, char *buf, size_t cap) {
    static const char hex[] = "0123456789abcdef";
    size_t o = 0, i;
    for (i = 0; i < len && o + 8 <= cap; i++) { /* room for an escape, "..." and NUL */
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') {
            buf[o++] = (char)c;
        } else {
            buf[o++] = '\\';
            buf[o++] = 'x';
            buf[o++] = hex[c >> 4];
            buf[o++] = hex[c & 15];
        }
    }
    if (i < len) {
        memcpy(buf + o, "...", 3);
        o += 3;
    }
    buf[o] = '\0';
    return buf;
}

#define PERR(c, ...) td_log(TD_LOG_ERROR, (c)->fn, __VA_ARGS__)

static size_t cur_left(const cursor *c) { return c->size - c->off; }

static td_status rd_bytes(cursor *c, size_t n, const uint8_t **p_p, const char *what) {
    if (n > cur_left(c)) {
        PERR(c, "%s: truncated: %s needs %zu bytes at offset %zu, file size %zu", c->name, what, n,
             c->off, c->size);
        return TD_ERR_FORMAT;
    }
    *p_p = c->base + c->off;
    c->off += n;
    return TD_OK;
}

static td_status rd_u32(cursor *c, uint32_t *v_p, const char *what) {
    const uint8_t *p;
    td_status st = rd_bytes(c, 4, &p, what);
    if (st != TD_OK) return st;
    memcpy(v_p, p, 4);
    return TD_OK;
}

static td_status rd_u64(cursor *c, uint64_t *v_p, const char *what) {
    const uint8_t *p;
    td_status st = rd_bytes(c, 8, &p, what);
    if (st != TD_OK) return st;
    memcpy(v_p, p, 8);
    return TD_OK;
}

/* A GGUF string: the bytes stay in the mapping; *len_p is checked against
 * the remaining bytes before anything else happens. */
static td_status rd_str(cursor *c, const char **s_p, size_t *len_p, const char *what) {
    uint64_t len;
    td_status st = rd_u64(c, &len, what);
    if (st != TD_OK) return st;
    if (len > cur_left(c)) {
        PERR(c, "%s: %s: string length %llu at offset %zu exceeds the %zu bytes left in the file",
             c->name, what, (unsigned long long)len, c->off - 8, cur_left(c));
        return TD_ERR_FORMAT;
    }
    *s_p = (const char *)(c->base + c->off);
    *len_p = (size_t)len;
    c->off += (size_t)len;
    return TD_OK;
}

static char *dup_mem(const char *s, size_t len) {
    char *d = malloc(len + 1);
    if (!d) return NULL;
    memcpy(d, s, len);
    d[len] = '\0';
    return d;
}

static uint64_t hash_name(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ull;
    }
    return h;
}

static size_t index_cap_for(int64_t n) {
    size_t cap = 16;
    while (cap < (size_t)n * 2) cap <<= 1;
    return cap;
}

/* Inserts item `idx` (named `name`) unless the name is already present;
 * returns the existing index or -1 when inserted. */
static int64_t index_insert(uint32_t *tab, size_t cap, const char *name, int64_t idx,
                            const char *(*name_of)(const td_gguf *, int64_t), const td_gguf *g) {
    size_t m = cap - 1;
    for (size_t i = (size_t)hash_name(name) & m;; i = (i + 1) & m) {
        if (tab[i] == 0) {
            tab[i] = (uint32_t)(idx + 1);
            return -1;
        }
        if (strcmp(name_of(g, (int64_t)tab[i] - 1), name) == 0) return (int64_t)tab[i] - 1;
    }
}

static int64_t index_find(const uint32_t *tab, size_t cap, const char *name,
                          const char *(*name_of)(const td_gguf *, int64_t), const td_gguf *g) {
    if (!tab) return -1;
    size_t m = cap - 1;
    for (size_t i = (size_t)hash_name(name) & m;; i = (i + 1) & m) {
        if (tab[i] == 0) return -1;
        if (strcmp(name_of(g, (int64_t)tab[i] - 1), name) == 0) return (int64_t)tab[i] - 1;
    }
}

static const char *kv_name_of(const td_gguf *g, int64_t i) { return g->kvs[i].key; }
static const char *tensor_name_of(const td_gguf *g, int64_t i) { return g->tensors[i].name; }

/* ---- metadata parsing ---- */

/* Walks (and validates) a value nested inside an array of arrays; nothing is
 * kept, the getters report such keys as unsupported. */
static td_status skip_value(cursor *c, uint32_t type, int depth, const char *key) {
    size_t sz = kv_scalar_size(type);
    const uint8_t *p;
    if (sz) return rd_bytes(c, sz, &p, key);
    if (type == TD_GGUF_STRING) {
        const char *s;
        size_t len;
        return rd_str(c, &s, &len, key);
    }
    if (type != TD_GGUF_ARRAY) {
        PERR(c, "%s: %s: unknown value type %u", c->name, key, type);
        return TD_ERR_FORMAT;
    }
    if (depth >= GGUF_MAX_DEPTH) {
        PERR(c, "%s: %s: arrays nested deeper than %d", c->name, key, GGUF_MAX_DEPTH);
        return TD_ERR_FORMAT;
    }
    uint32_t et;
    uint64_t n;
    td_status st = rd_u32(c, &et, key);
    if (st == TD_OK) st = rd_u64(c, &n, key);
    if (st != TD_OK) return st;
    size_t esz = kv_scalar_size(et);
    if (esz) {
        size_t bytes;
        if (n > SIZE_MAX || td_mul_overflow((size_t)n, esz, &bytes) || bytes > cur_left(c)) {
            PERR(c, "%s: %s: nested array of %llu %s exceeds the file", c->name, key,
                 (unsigned long long)n, kv_type_name(et));
            return TD_ERR_FORMAT;
        }
        c->off += bytes;
        return TD_OK;
    }
    /* every string or array element takes at least 8 bytes */
    if (et != TD_GGUF_STRING && et != TD_GGUF_ARRAY) {
        PERR(c, "%s: %s: unknown array element type %u", c->name, key, et);
        return TD_ERR_FORMAT;
    }
    if (n > cur_left(c) / 8) {
        PERR(c, "%s: %s: nested array count %llu exceeds the file", c->name, key,
             (unsigned long long)n);
        return TD_ERR_FORMAT;
    }
    for (uint64_t i = 0; i < n; i++) {
        st = skip_value(c, et, depth + 1, key);
        if (st != TD_OK) return st;
    }
    return TD_OK;
}

static td_status parse_array(cursor *c, gguf_kv *kv, const char *key) {
    uint32_t et;
    uint64_t n;
    td_status st = rd_u32(c, &et, key);
    if (st == TD_OK) st = rd_u64(c, &n, key);
    if (st != TD_OK) return st;
    kv->arr_type = (td_gguf_type)et;
    size_t esz = kv_scalar_size(et);
    if (esz) {
        size_t bytes;
        if (n > SIZE_MAX || td_mul_overflow((size_t)n, esz, &bytes) || bytes > cur_left(c)) {
            PERR(c,
                 "%s: %s: array of %llu %s at offset %zu exceeds the %zu bytes left in the "
                 "file",
                 c->name, key, (unsigned long long)n, kv_type_name(et), c->off, cur_left(c));
            return TD_ERR_FORMAT;
        }
        kv->arr_n = n;
        kv->arr_data = c->base + c->off;
        c->off += bytes;
        return TD_OK;
    }
    if (et == TD_GGUF_ARRAY) {
        if (n > cur_left(c) / 12) {
            PERR(c, "%s: %s: array of %llu arrays exceeds the file", c->name, key,
                 (unsigned long long)n);
            return TD_ERR_FORMAT;
        }
        for (uint64_t i = 0; i < n; i++) {
            st = skip_value(c, et, 1, key);
            if (st != TD_OK) return st;
        }
        kv->arr_n = n;
        return TD_OK;
    }
    if (et != TD_GGUF_STRING) {
        PERR(c, "%s: %s: unknown array element type %u", c->name, key, et);
        return TD_ERR_FORMAT;
    }
    /* Strings: each needs at least its 8-byte length, which bounds n before
     * the offsets table is allocated. First pass validates and sizes, second
     * copies. The copies are never larger than the bytes they came from. */
    if (n > cur_left(c) / 8) {
        PERR(c,
             "%s: %s: array of %llu strings at offset %zu exceeds the %zu bytes left in the "
             "file",
             c->name, key, (unsigned long long)n, c->off, cur_left(c));
        return TD_ERR_FORMAT;
    }
    size_t start = c->off, total = 0;
    for (uint64_t i = 0; i < n; i++) {
        const char *s;
        size_t len;
        st = rd_str(c, &s, &len, key);
        if (st != TD_OK) return st;
        total += len + 1; /* bounded by the file size: len + 8 bytes were consumed */
    }
    kv->arr_offs = malloc(((size_t)n + 1) * sizeof *kv->arr_offs);
    kv->arr_strs = malloc(total ? total : 1);
    if (!kv->arr_offs || !kv->arr_strs) {
        PERR(c, "%s: %s: out of memory for %llu strings", c->name, key, (unsigned long long)n);
        return TD_ERR_NOMEM;
    }
    cursor c2 = *c;
    c2.off = start;
    size_t o = 0;
    for (uint64_t i = 0; i < n; i++) {
        const char *s;
        size_t len;
        st = rd_str(&c2, &s, &len, key);
        TD_ASSERT(st == TD_OK); /* validated by the first pass */
        kv->arr_offs[i] = o;
        memcpy(kv->arr_strs + o, s, len);
        kv->arr_strs[o + len] = '\0';
        o += len + 1;
    }
    kv->arr_offs[n] = o;
    kv->arr_n = n;
    return TD_OK;
}

static td_status parse_kv(cursor *c, td_gguf *g, int64_t i) {
    gguf_kv *kv = &g->kvs[i];
    char what[48];
    snprintf(what, sizeof what, "key #%lld", (long long)i);
    const char *k;
    size_t klen;
    td_status st = rd_str(c, &k, &klen, what);
    if (st != TD_OK) return st;
    char pbuf[96];
    if (klen == 0 || memchr(k, '\0', klen)) {
        PERR(c, "%s: %s: name '%s' is empty or contains a NUL byte", c->name, what,
             printable(k, klen, pbuf, sizeof pbuf));
        return TD_ERR_FORMAT;
    }
    char *key = dup_mem(k, klen);
    if (!key) return TD_ERR_NOMEM;
    kv->key = key;
    char kbuf[112];
    snprintf(kbuf, sizeof kbuf, "key '%s'", printable(k, klen, pbuf, sizeof pbuf));
    const char *pk = kbuf;

    uint32_t type;
    st = rd_u32(c, &type, pk);
    if (st != TD_OK) return st;
    kv->type = (td_gguf_type)type;
    size_t sz = kv_scalar_size(type);
    if (sz) return rd_bytes(c, sz, &kv->raw, pk);
    if (type == TD_GGUF_STRING) {
        const char *s;
        size_t len;
        st = rd_str(c, &s, &len, pk);
        if (st != TD_OK) return st;
        kv->str = dup_mem(s, len);
        if (!kv->str) return TD_ERR_NOMEM;
        kv->str_len = len;
        return TD_OK;
    }
    if (type == TD_GGUF_ARRAY) return parse_array(c, kv, pk);
    PERR(c, "%s: %s: unknown value type %u", c->name, pk, type);
    return TD_ERR_FORMAT;
}

/* ---- tensor infos ---- */

static td_status parse_tensor_info(cursor *c, td_gguf *g, int64_t i, uint64_t *offset_p) {
    td_gguf_tensor *t = &g->tensors[i];
    char what[48];
    snprintf(what, sizeof what, "tensor #%lld", (long long)i);
    const char *s;
    size_t len;
    td_status st = rd_str(c, &s, &len, what);
    if (st != TD_OK) return st;
    char pbuf[96];
    if (len == 0 || memchr(s, '\0', len)) {
        PERR(c, "%s: %s: name '%s' is empty or contains a NUL byte", c->name, what,
             printable(s, len, pbuf, sizeof pbuf));
        return TD_ERR_FORMAT;
    }
    char *name = dup_mem(s, len);
    if (!name) return TD_ERR_NOMEM;
    t->name = name;
    const char *pn = printable(s, len, pbuf, sizeof pbuf);
    char tw[112];
    snprintf(tw, sizeof tw, "tensor '%s'", pn);

    uint32_t n_dims, type;
    st = rd_u32(c, &n_dims, tw);
    if (st != TD_OK) return st;
    if (n_dims < 1 || n_dims > 4) {
        PERR(c, "%s: tensor '%s': n_dims %u outside 1..4", c->name, pn, n_dims);
        return TD_ERR_FORMAT;
    }
    t->n_dims = (int)n_dims;
    uint64_t n_el = 1;
    for (int d = 0; d < 4; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        uint64_t ne;
        st = rd_u64(c, &ne, tw);
        if (st != TD_OK) return st;
        if (ne == 0 || ne > (uint64_t)INT64_MAX) {
            PERR(c, "%s: tensor '%s': ne[%u] = %llu is not a positive int64", c->name, pn, d,
                 (unsigned long long)ne);
            return TD_ERR_FORMAT;
        }
        if (__builtin_mul_overflow(n_el, ne, &n_el) || n_el > (uint64_t)INT64_MAX) {
            PERR(c, "%s: tensor '%s': element count overflows int64", c->name, pn);
            return TD_ERR_FORMAT;
        }
        t->ne[d] = (int64_t)ne;
    }
    st = rd_u32(c, &type, tw);
    if (st == TD_OK) st = rd_u64(c, offset_p, tw);
    if (st != TD_OK) return st;
    int be;
    size_t bb;
    if (!td_gguf_type_info((int)type, &be, &bb) || type > INT32_MAX) {
        PERR(c, "%s: tensor '%s': unknown tensor type id %u", c->name, pn, type);
        return TD_ERR_FORMAT;
    }
    t->type = (int)type;
    if (t->ne[0] % be != 0) {
        PERR(c, "%s: tensor '%s': ne[0] = %lld is not a multiple of the %s block size %d", c->name,
             pn, (long long)t->ne[0], td_dtype_name((int)type), be);
        return TD_ERR_FORMAT;
    }
    uint64_t nb = (uint64_t)(n_el / (uint64_t)be);
    size_t nbytes;
    if (nb > SIZE_MAX || td_mul_overflow((size_t)nb, bb, &nbytes)) {
        PERR(c, "%s: tensor '%s': byte size overflows", c->name, pn);
        return TD_ERR_FORMAT;
    }
    t->nbytes = nbytes;
    return TD_OK;
}

static td_status check_tensor_data(cursor *c, td_gguf *g, const uint64_t *offsets) {
    char pbuf[96];
    for (int64_t i = 0; i < g->n_tensors; i++) {
        td_gguf_tensor *t = &g->tensors[i];
        const char *pn = printable(t->name, strlen(t->name), pbuf, sizeof pbuf);
        uint64_t off = offsets[i];
        if (off % g->alignment != 0) {
            PERR(c, "%s: tensor '%s': data offset %llu is not a multiple of the alignment %zu",
                 c->name, pn, (unsigned long long)off, g->alignment);
            return TD_ERR_FORMAT;
        }
        size_t begin, end;
        if (off > SIZE_MAX || td_add_overflow(g->data_start, (size_t)off, &begin) ||
            td_add_overflow(begin, t->nbytes, &end) || end > g->size) {
            PERR(c,
                 "%s: tensor '%s': data range [%llu, %llu+%zu) exceeds file size %zu "
                 "(data section starts at %zu)",
                 c->name, pn, (unsigned long long)off, (unsigned long long)off, t->nbytes, g->size,
                 g->data_start);
            return TD_ERR_FORMAT;
        }
        t->data = g->base + begin;
    }
    return TD_OK;
}

static int cmp_by_data(const void *a, const void *b) {
    const td_gguf_tensor *x = *(const td_gguf_tensor *const *)a;
    const td_gguf_tensor *y = *(const td_gguf_tensor *const *)b;
    uintptr_t px = (uintptr_t)x->data, py = (uintptr_t)y->data;
    return px < py ? -1 : px > py;
}

static td_status check_overlaps(cursor *c, td_gguf *g) {
    if (g->n_tensors < 2) return TD_OK;
    const td_gguf_tensor **v = malloc((size_t)g->n_tensors * sizeof *v);
    if (!v) return TD_ERR_NOMEM;
    for (int64_t i = 0; i < g->n_tensors; i++) v[i] = &g->tensors[i];
    qsort(v, (size_t)g->n_tensors, sizeof *v, cmp_by_data);
    td_status st = TD_OK;
    for (int64_t i = 1; i < g->n_tensors; i++) {
        const td_gguf_tensor *a = v[i - 1], *b = v[i];
        if ((const uint8_t *)a->data + a->nbytes > (const uint8_t *)b->data) {
            char p1[96], p2[96];
            PERR(c, "%s: tensor '%s': data overlaps tensor '%s'", c->name,
                 printable(b->name, strlen(b->name), p1, sizeof p1),
                 printable(a->name, strlen(a->name), p2, sizeof p2));
            st = TD_ERR_FORMAT;
            break;
        }
    }
    free(v);
    return st;
}

/* ---- open / close ---- */

static td_status parse(td_gguf *g, const char *fn) {
    cursor c = {.base = g->base, .size = g->size, .off = 0, .fn = fn, .name = g->name};
    cursor *cp = &c;
    const uint8_t *magic;
    td_status st;
    if (g->size < 24) {
        PERR(cp, "%s: file too small for a GGUF header (%zu bytes)", g->name, g->size);
        return TD_ERR_FORMAT;
    }
    if ((st = rd_bytes(cp, 4, &magic, "magic")) != TD_OK) return st;
    if (memcmp(magic, "GGUF", 4) != 0) {
        char pbuf[32];
        PERR(cp, "%s: bad magic '%s' (not a GGUF file)", g->name,
             printable((const char *)magic, 4, pbuf, sizeof pbuf));
        return TD_ERR_FORMAT;
    }
    uint32_t version;
    uint64_t n_tensors, n_kv;
    if ((st = rd_u32(cp, &version, "version")) != TD_OK) return st;
    if (version == 1) {
        PERR(cp, "%s: GGUF version 1 is not supported (only 2 and 3)", g->name);
        return TD_ERR_UNSUPPORTED;
    }
    if (version != 2 && version != 3) {
        if ((version & 0xffff) == 0 && (version >> 24) >= 1 && (version >> 24) <= 3)
            PERR(cp, "%s: big-endian GGUF files are not supported", g->name);
        else
            PERR(cp, "%s: unsupported GGUF version %u (only 2 and 3)", g->name, version);
        return TD_ERR_UNSUPPORTED;
    }
    g->version = version;
    if ((st = rd_u64(cp, &n_tensors, "n_tensors")) != TD_OK) return st;
    if ((st = rd_u64(cp, &n_kv, "n_kv")) != TD_OK) return st;
    /* minimal encodings: a key-value is 8 (key length) + 1 (key) + 4 (type)
     * + 1 (value) bytes; a tensor info 8 + 1 + 4 + 8 + 4 + 8 */
    if (n_kv > cur_left(cp) / 14 || n_kv >= UINT32_MAX) {
        PERR(cp, "%s: n_kv = %llu cannot fit in the %zu bytes after the header", g->name,
             (unsigned long long)n_kv, cur_left(cp));
        return TD_ERR_FORMAT;
    }
    if (n_tensors > cur_left(cp) / 33 || n_tensors >= UINT32_MAX) {
        PERR(cp, "%s: n_tensors = %llu cannot fit in the %zu bytes after the header", g->name,
             (unsigned long long)n_tensors, cur_left(cp));
        return TD_ERR_FORMAT;
    }

    g->kvs = calloc(n_kv ? (size_t)n_kv : 1, sizeof *g->kvs);
    g->kv_index_cap = index_cap_for((int64_t)n_kv);
    g->kv_index = calloc(g->kv_index_cap, sizeof *g->kv_index);
    if (!g->kvs || !g->kv_index) return TD_ERR_NOMEM;
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    for (uint64_t i = 0; i < n_kv; i++) {
        g->n_kv = (int64_t)i + 1; /* so close() frees what this entry allocated */
        if ((st = parse_kv(cp, g, (int64_t)i)) != TD_OK) return st;
        gguf_kv *kv = &g->kvs[i];
        if (index_insert(g->kv_index, g->kv_index_cap, kv->key, (int64_t)i, kv_name_of, g) >= 0) {
            char pbuf[96];
            PERR(cp, "%s: duplicate key '%s'", g->name,
                 printable(kv->key, strlen(kv->key), pbuf, sizeof pbuf));
            return TD_ERR_FORMAT;
        }
        if (strcmp(kv->key, "general.alignment") == 0) {
            uint32_t a;
            if (kv->type != TD_GGUF_UINT32) {
                PERR(cp, "%s: key 'general.alignment' has type %s, expected uint32", g->name,
                     kv_type_name(kv->type));
                return TD_ERR_FORMAT;
            }
            memcpy(&a, kv->raw, 4);
            if (a == 0 || (a & (a - 1)) != 0) {
                PERR(cp, "%s: general.alignment = %u is not a power of two", g->name, a);
                return TD_ERR_FORMAT;
            }
            g->alignment = a;
        }
    }

    g->tensors = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof *g->tensors);
    uint64_t *offsets = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof *offsets);
    g->tensor_index_cap = index_cap_for((int64_t)n_tensors);
    g->tensor_index = calloc(g->tensor_index_cap, sizeof *g->tensor_index);
    if (!g->tensors || !offsets || !g->tensor_index) {
        free(offsets);
        return TD_ERR_NOMEM;
    }
    for (uint64_t i = 0; i < n_tensors; i++) {
        g->n_tensors = (int64_t)i + 1;
        if ((st = parse_tensor_info(cp, g, (int64_t)i, &offsets[i])) != TD_OK) goto free_offsets;
        const char *nm = g->tensors[i].name;
        if (index_insert(g->tensor_index, g->tensor_index_cap, nm, (int64_t)i, tensor_name_of, g) >=
            0) {
            char pbuf[96];
            PERR(cp, "%s: duplicate tensor name '%s'", g->name,
                 printable(nm, strlen(nm), pbuf, sizeof pbuf));
            st = TD_ERR_FORMAT;
            goto free_offsets;
        }
    }
    /* data section: the end of the tensor infos rounded up to the alignment;
     * with no tensors the file may end before the padding */
    size_t pad = (g->alignment - cp->off % g->alignment) % g->alignment;
    if (td_add_overflow(cp->off, pad, &g->data_start)) {
        st = TD_ERR_FORMAT;
        goto free_offsets;
    }
    if ((st = check_tensor_data(cp, g, offsets)) != TD_OK) goto free_offsets;
    st = check_overlaps(cp, g);
free_offsets:
    free(offsets);
    return st;
}

void td_gguf_close(td_gguf *g) {
    if (!g) return;
    for (int64_t i = 0; i < g->n_kv; i++) {
        free((char *)g->kvs[i].key);
        free(g->kvs[i].str);
        free(g->kvs[i].arr_strs);
        free(g->kvs[i].arr_offs);
    }
    free(g->kvs);
    free(g->kv_index);
    for (int64_t i = 0; i < g->n_tensors; i++) free((char *)g->tensors[i].name);
    free(g->tensors);
    free(g->tensor_index);
    if (g->map) munmap(g->map, g->map_size);
    free(g->name);
    free(g);
}

static td_status open_common(td_gguf *g, const char *fn, td_gguf **g_p) {
    td_status st = parse(g, fn);
    if (st != TD_OK) {
        td_gguf_close(g);
        return st;
    }
    *g_p = g;
    return TD_OK;
}

td_status td_gguf_open_buffer(const void *data, size_t size, const char *name, td_gguf **g_p) {
    if (!g_p || (!data && size)) return TD_ERR_INVALID;
    td_gguf *g = calloc(1, sizeof *g);
    if (!g) return TD_ERR_NOMEM;
    g->name = strdup(name ? name : "<buffer>");
    if (!g->name) {
        free(g);
        return TD_ERR_NOMEM;
    }
    g->base = data;
    g->size = size;
    return open_common(g, "td_gguf_open_buffer", g_p);
}

td_status td_gguf_open(const char *path, td_gguf **g_p) {
    if (!path || !g_p) return TD_ERR_INVALID;
    td_status st = TD_OK;
    td_gguf *g = calloc(1, sizeof *g);
    if (!g) return TD_ERR_NOMEM;
    g->name = strdup(path);
    if (!g->name) {
        free(g);
        return TD_ERR_NOMEM;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        TD_LOG_ERROR("%s: cannot open: %s", path, strerror(errno));
        st = errno == ENOENT ? TD_ERR_NOT_FOUND : TD_ERR_IO;
        goto free_g;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        TD_LOG_ERROR("%s: fstat: %s", path, strerror(errno));
        st = TD_ERR_IO;
        goto close_fd;
    }
    if (!S_ISREG(sb.st_mode)) {
        TD_LOG_ERROR("%s: not a regular file", path);
        st = TD_ERR_IO;
        goto close_fd;
    }
    if (sb.st_size < 24) {
        TD_LOG_ERROR("%s: file too small for a GGUF header (%lld bytes)", path,
                     (long long)sb.st_size);
        st = TD_ERR_FORMAT;
        goto close_fd;
    }
    void *map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
        TD_LOG_ERROR("%s: mmap of %lld bytes: %s", path, (long long)sb.st_size, strerror(errno));
        st = TD_ERR_IO;
        goto close_fd;
    }
    close(fd);
    g->map = map;
    g->map_size = (size_t)sb.st_size;
    g->base = map;
    g->size = (size_t)sb.st_size;
    return open_common(g, "td_gguf_open", g_p);

close_fd:
    close(fd);
free_g:
    free(g->name);
    free(g);
    return st;
}

/* ---- accessors ---- */

const char *td_gguf_path(const td_gguf *g) { return g->name; }
uint32_t td_gguf_version(const td_gguf *g) { return g->version; }
size_t td_gguf_alignment(const td_gguf *g) { return g->alignment; }
int64_t td_gguf_n_kv(const td_gguf *g) { return g->n_kv; }

int64_t td_gguf_find_key(const td_gguf *g, const char *key) {
    if (!key) return -1;
    return index_find(g->kv_index, g->kv_index_cap, key, kv_name_of, g);
}

const char *td_gguf_key_name(const td_gguf *g, int64_t i) {
    return i >= 0 && i < g->n_kv ? g->kvs[i].key : NULL;
}

td_gguf_type td_gguf_kv_type(const td_gguf *g, int64_t i) {
    return i >= 0 && i < g->n_kv ? g->kvs[i].type : (td_gguf_type)-1;
}

static const gguf_kv *find_kv(const td_gguf *g, const char *key) {
    int64_t i = td_gguf_find_key(g, key);
    return i < 0 ? NULL : &g->kvs[i];
}

/* Integer value of an integer-typed entry; false for other types. */
static bool kv_int(const gguf_kv *kv, int64_t *i_p, uint64_t *u_p, bool *is_unsigned_p) {
    const uint8_t *r = kv->raw;
    union {
        uint8_t u8;
        int8_t i8;
        uint16_t u16;
        int16_t i16;
        uint32_t u32;
        int32_t i32;
        uint64_t u64;
        int64_t i64;
    } v;
    switch (kv->type) {
    case TD_GGUF_UINT8:
        memcpy(&v.u8, r, 1);
        *u_p = v.u8;
        *is_unsigned_p = true;
        return true;
    case TD_GGUF_UINT16:
        memcpy(&v.u16, r, 2);
        *u_p = v.u16;
        *is_unsigned_p = true;
        return true;
    case TD_GGUF_UINT32:
        memcpy(&v.u32, r, 4);
        *u_p = v.u32;
        *is_unsigned_p = true;
        return true;
    case TD_GGUF_UINT64:
        memcpy(&v.u64, r, 8);
        *u_p = v.u64;
        *is_unsigned_p = true;
        return true;
    case TD_GGUF_INT8:
        memcpy(&v.i8, r, 1);
        *i_p = v.i8;
        *is_unsigned_p = false;
        return true;
    case TD_GGUF_INT16:
        memcpy(&v.i16, r, 2);
        *i_p = v.i16;
        *is_unsigned_p = false;
        return true;
    case TD_GGUF_INT32:
        memcpy(&v.i32, r, 4);
        *i_p = v.i32;
        *is_unsigned_p = false;
        return true;
    case TD_GGUF_INT64:
        memcpy(&v.i64, r, 8);
        *i_p = v.i64;
        *is_unsigned_p = false;
        return true;
    default: return false;
    }
}

td_status td_gguf_get_u32(const td_gguf *g, const char *key, uint32_t *v_p) {
    const gguf_kv *kv = find_kv(g, key);
    if (!kv) return TD_ERR_NOT_FOUND;
    int64_t i = 0;
    uint64_t u = 0;
    bool is_u;
    if (!kv_int(kv, &i, &u, &is_u)) return TD_ERR_FORMAT;
    if (is_u) {
        if (u > UINT32_MAX) return TD_ERR_FORMAT;
        *v_p = (uint32_t)u;
    } else {
        if (i < 0 || i > (int64_t)UINT32_MAX) return TD_ERR_FORMAT;
        *v_p = (uint32_t)i;
    }
    return TD_OK;
}

td_status td_gguf_get_i64(const td_gguf *g, const char *key, int64_t *v_p) {
    const gguf_kv *kv = find_kv(g, key);
    if (!kv) return TD_ERR_NOT_FOUND;
    int64_t i = 0;
    uint64_t u = 0;
    bool is_u;
    if (!kv_int(kv, &i, &u, &is_u)) return TD_ERR_FORMAT;
    if (is_u) {
        if (u > (uint64_t)INT64_MAX) return TD_ERR_FORMAT;
        *v_p = (int64_t)u;
    } else {
        *v_p = i;
    }
    return TD_OK;
}

td_status td_gguf_get_f32(const td_gguf *g, const char *key, float *v_p) {
    const gguf_kv *kv = find_kv(g, key);
    if (!kv) return TD_ERR_NOT_FOUND;
    if (kv->type == TD_GGUF_FLOAT32) {
        float f;
        memcpy(&f, kv->raw, 4);
        *v_p = f;
        return TD_OK;
    }
    if (kv->type == TD_GGUF_FLOAT64) {
        double d;
        memcpy(&d, kv->raw, 8);
        /* Converting a finite double outside float's range is undefined. */
        if (isfinite(d) && fabs(d) > FLT_MAX) return TD_ERR_FORMAT;
        *v_p = (float)d;
        return TD_OK;
    }
    return TD_ERR_FORMAT;
}

td_status td_gguf_get_bool(const td_gguf *g, const char *key, bool *v_p) {
    const gguf_kv *kv = find_kv(g, key);
    if (!kv) return TD_ERR_NOT_FOUND;
    if (kv->type != TD_GGUF_BOOL) return TD_ERR_FORMAT;
    *v_p = kv->raw[0] != 0;
    return TD_OK;
}

td_status td_gguf_get_str(const td_gguf *g, const char *key, const char **s_p) {
    const gguf_kv *kv = find_kv(g, key);
    if (!kv) return TD_ERR_NOT_FOUND;
    if (kv->type != TD_GGUF_STRING) return TD_ERR_FORMAT;
    *s_p = kv->str;
    return TD_OK;
}

td_status td_gguf_get_str_len(const td_gguf *g, const char *key, const char **s_p, size_t *len_p) {
    const gguf_kv *kv = find_kv(g, key);
    if (!kv) return TD_ERR_NOT_FOUND;
    if (kv->type != TD_GGUF_STRING) return TD_ERR_FORMAT;
    *s_p = kv->str;
    *len_p = kv->str_len;
    return TD_OK;
}

td_status td_gguf_get_arr(const td_gguf *g, const char *key, td_gguf_type *elem_type_p,
                          uint64_t *n_p, const void **data_p) {
    const gguf_kv *kv = find_kv(g, key);
    if (!kv) return TD_ERR_NOT_FOUND;
    if (kv->type != TD_GGUF_ARRAY) return TD_ERR_FORMAT;
    if (kv->arr_type == TD_GGUF_ARRAY) return TD_ERR_UNSUPPORTED;
    if (elem_type_p) *elem_type_p = kv->arr_type;
    if (n_p) *n_p = kv->arr_n;
    if (data_p) *data_p = kv->arr_data;
    return TD_OK;
}

td_status td_gguf_get_arr_str(const td_gguf *g, const char *key, uint64_t i, const char **s_p,
                              size_t *len_p) {
    const gguf_kv *kv = find_kv(g, key);
    if (!kv) return TD_ERR_NOT_FOUND;
    if (kv->type != TD_GGUF_ARRAY || kv->arr_type != TD_GGUF_STRING) return TD_ERR_FORMAT;
    if (i >= kv->arr_n) return TD_ERR_RANGE;
    if (s_p) *s_p = kv->arr_strs + kv->arr_offs[i];
    if (len_p) *len_p = (size_t)(kv->arr_offs[i + 1] - kv->arr_offs[i] - 1);
    return TD_OK;
}

int64_t td_gguf_n_tensors(const td_gguf *g) { return g->n_tensors; }

const td_gguf_tensor *td_gguf_tensor_at(const td_gguf *g, int64_t i) {
    return i >= 0 && i < g->n_tensors ? &g->tensors[i] : NULL;
}

const td_gguf_tensor *td_gguf_find_tensor(const td_gguf *g, const char *name) {
    if (!name) return NULL;
    int64_t i = index_find(g->tensor_index, g->tensor_index_cap, name, tensor_name_of, g);
    return i < 0 ? NULL : &g->tensors[i];
}
