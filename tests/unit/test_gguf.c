/* GGUF reader: a valid file laid out byte by byte from the GGUF spec by a
 * writer in this test (independent of the parser), read back in full; then
 * hand-made corrupt variants (every truncation, lying lengths, huge counts,
 * bad alignment, bad offsets, bad dims, bad types, bad magic/version), each
 * with its expected status; and the real default model when installed. */
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>
#include <strings.h>

#include "common/format/gguf.h"
#include "kernels/dtype.h"

/* ---- a tiny GGUF writer ---- */

typedef struct {
    uint8_t *p;
    size_t n, cap;
} wbuf;

static void w_bytes(wbuf *b, const void *d, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        assert_non_null(b->p);
    }
    memcpy(b->p + b->n, d, n);
    b->n += n;
}
static void w_u8(wbuf *b, uint8_t v) { w_bytes(b, &v, 1); }
static void w_u16(wbuf *b, uint16_t v) {
    uint8_t x[2] = {(uint8_t)v, (uint8_t)(v >> 8)};
    w_bytes(b, x, 2);
}
static void w_u32(wbuf *b, uint32_t v) {
    uint8_t x[4];
    for (int i = 0; i < 4; i++) x[i] = (uint8_t)(v >> (8 * i));
    w_bytes(b, x, 4);
}
static void w_u64(wbuf *b, uint64_t v) {
    uint8_t x[8];
    for (int i = 0; i < 8; i++) x[i] = (uint8_t)(v >> (8 * i));
    w_bytes(b, x, 8);
}
static void w_str(wbuf *b, const char *s, size_t len) {
    w_u64(b, len);
    w_bytes(b, s, len);
}
static void w_key(wbuf *b, const char *k, uint32_t type) {
    w_str(b, k, strlen(k));
    w_u32(b, type);
}
static void patch_u32(wbuf *b, size_t at, uint32_t v) {
    for (int i = 0; i < 4; i++) b->p[at + i] = (uint8_t)(v >> (8 * i));
}
static void patch_u64(wbuf *b, size_t at, uint64_t v) {
    for (int i = 0; i < 8; i++) b->p[at + i] = (uint8_t)(v >> (8 * i));
}
static uint64_t read_u64(const wbuf *b, size_t at) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)b->p[at + i] << (8 * i);
    return v;
}

#define NT 4
#define NK 21

typedef struct {
    const char *name;
    uint32_t type;
    uint32_t n_dims;
    uint64_t ne[4];
    size_t nbytes; /* from the GGUF spec's block sizes, by hand */
} tspec;

/* q8_0: 32 elements in 34 bytes; q4_K: 256 elements in 144 bytes. */
static const tspec g_tensors[NT] = {
    {"tok.f32", 0, 2, {4, 2, 1, 1}, 4 * 2 * 4},
    {"blk.q8", 8, 2, {64, 2, 1, 1}, 2 * 2 * 34},
    {"blk.q4k", 12, 1, {256, 1, 1, 1}, 144},
    {"out.f16", 1, 3, {3, 1, 2, 1}, 3 * 2 * 2},
};

/* Positions of fields in the written file, for patching. */
typedef struct {
    size_t version, n_tensors, n_kv;
    size_t arch_key_len, arch_val_len, align_type, align_val;
    size_t u32arr_n, strarr_n, nested_inner_type, dup_b_last, f32_type;
    size_t t_name_last[NT], t_ndims[NT], t_ne[NT], t_type[NT], t_off[NT];
    size_t data_start, t_data[NT];
    size_t alignment;
} layout;

static uint8_t pattern(int t, size_t i) { return (uint8_t)(i * 7 + (size_t)t * 31 + 1); }

/* Writes a valid GGUF file: version `version`, general.alignment = `align`
 * (or no key and the default 32 when align == 0). */
static wbuf make_gguf(uint32_t version, uint32_t align, layout *L) {
    wbuf b = {0};
    memset(L, 0, sizeof *L);
    L->alignment = align ? align : 32;
    w_bytes(&b, "GGUF", 4);
    L->version = b.n;
    w_u32(&b, version);
    L->n_tensors = b.n;
    w_u64(&b, NT);
    L->n_kv = b.n;
    w_u64(&b, align ? NK : NK - 1);

    L->arch_key_len = b.n;
    w_key(&b, "general.architecture", 8);
    L->arch_val_len = b.n;
    w_str(&b, "llama", 5);
    if (align) {
        w_str(&b, "general.alignment", 17);
        L->align_type = b.n;
        w_u32(&b, 4);
        L->align_val = b.n;
        w_u32(&b, align);
    }
    w_key(&b, "llama.block_count", 4), w_u32(&b, 30);
    w_key(&b, "k.u8", 0), w_u8(&b, 200);
    w_key(&b, "k.i8", 1), w_u8(&b, (uint8_t)-5);
    w_key(&b, "k.u16", 2), w_u16(&b, 60000);
    w_key(&b, "k.i16", 3), w_u16(&b, (uint16_t)-300);
    w_key(&b, "k.i32", 5), w_u32(&b, (uint32_t)-7);
    w_key(&b, "k.u64", 10), w_u64(&b, 5000000000ull);
    w_key(&b, "k.i64", 11), w_u64(&b, (uint64_t)-9);
    w_str(&b, "k.f32", 5);
    L->f32_type = b.n;
    w_u32(&b, 6), w_u32(&b, 0x3fc00000u);                     /* 1.5f */
    w_key(&b, "k.f64", 12), w_u64(&b, 0x4002000000000000ull); /* 2.25 */
    w_key(&b, "k.bool", 7), w_u8(&b, 1);
    w_key(&b, "k.str_nul", 8), w_str(&b, "a\0b", 3);
    w_key(&b, "arr.u32", 9), w_u32(&b, 4);
    L->u32arr_n = b.n;
    w_u64(&b, 4), w_u32(&b, 1), w_u32(&b, 2), w_u32(&b, 3), w_u32(&b, 0xffffffffu);
    w_key(&b, "arr.str", 9), w_u32(&b, 8);
    L->strarr_n = b.n;
    w_u64(&b, 4);
    w_str(&b, "hello", 5), w_str(&b, "", 0), w_str(&b, "x\0y", 3), w_str(&b, "\xc3\xbc", 2);
    w_key(&b, "arr.empty", 9), w_u32(&b, 0), w_u64(&b, 0);
    /* an array of two arrays: [u8 [1, 2]], [string ["q"]] */
    w_key(&b, "arr.nested", 9), w_u32(&b, 9), w_u64(&b, 2);
    L->nested_inner_type = b.n;
    w_u32(&b, 0), w_u64(&b, 2), w_u8(&b, 1), w_u8(&b, 2);
    w_u32(&b, 8), w_u64(&b, 1), w_str(&b, "q", 1);
    w_key(&b, "dup.a", 0), w_u8(&b, 1);
    w_str(&b, "dup.b", 5);
    L->dup_b_last = b.n - 1;
    w_u32(&b, 0), w_u8(&b, 2);
    w_key(&b, "arr.f32", 9), w_u32(&b, 6), w_u64(&b, 2), w_u32(&b, 0x3f000000u),
        w_u32(&b, 0xbf800000u); /* 0.5, -1 */

    /* tensor infos; offsets laid out back to back, each rounded up to the alignment */
    uint64_t off = 0, offs[NT];
    for (int t = 0; t < NT; t++) {
        offs[t] = off;
        off += g_tensors[t].nbytes;
        off = (off + L->alignment - 1) / L->alignment * L->alignment;
    }
    for (int t = 0; t < NT; t++) {
        const tspec *ts = &g_tensors[t];
        w_str(&b, ts->name, strlen(ts->name));
        L->t_name_last[t] = b.n - 1;
        L->t_ndims[t] = b.n;
        w_u32(&b, ts->n_dims);
        L->t_ne[t] = b.n;
        for (uint32_t d = 0; d < ts->n_dims; d++) w_u64(&b, ts->ne[d]);
        L->t_type[t] = b.n;
        w_u32(&b, ts->type);
        L->t_off[t] = b.n;
        w_u64(&b, offs[t]);
    }
    while (b.n % L->alignment) w_u8(&b, 0);
    L->data_start = b.n;
    for (int t = 0; t < NT; t++) {
        while (b.n < L->data_start + offs[t]) w_u8(&b, 0);
        L->t_data[t] = b.n;
        for (size_t i = 0; i < g_tensors[t].nbytes; i++) w_u8(&b, pattern(t, i));
    }
    return b;
}

/* Opens a copy in an exact-size heap block, so that any read past the end
 * is caught by ASan, and touches every tensor's first and last byte. */
static td_status open_copy(const uint8_t *p, size_t n) {
    uint8_t *copy = malloc(n ? n : 1);
    assert_non_null(copy);
    if (n) memcpy(copy, p, n);
    td_gguf *g = NULL;
    td_status st = td_gguf_open_buffer(copy, n, "test.gguf", &g);
    if (st == TD_OK) {
        for (int64_t i = 0; i < td_gguf_n_tensors(g); i++) {
            const td_gguf_tensor *t = td_gguf_tensor_at(g, i);
            volatile uint8_t x = ((const uint8_t *)t->data)[0];
            x = ((const uint8_t *)t->data)[t->nbytes - 1];
            (void)x;
        }
    }
    td_gguf_close(g);
    free(copy);
    return st;
}

static td_status open_quiet(const wbuf *b) {
    td_log_level lv = td_log_get_level();
    td_log_set_level(TD_LOG_NONE);
    td_status st = open_copy(b->p, b->n);
    td_log_set_level(lv);
    return st;
}

/* ---- the valid file, read back ---- */

static void check_valid(const td_gguf *g, const wbuf *b, const layout *L, uint32_t version) {
    assert_int_equal(td_gguf_version(g), version);
    assert_int_equal(td_gguf_alignment(g), L->alignment);
    assert_int_equal(td_gguf_n_kv(g), L->align_val ? NK : NK - 1);
    assert_int_equal(td_gguf_n_tensors(g), NT);

    const char *s;
    size_t len;
    uint32_t u32;
    int64_t i64;
    float f;
    bool bl;
    assert_int_equal(td_gguf_get_str(g, "general.architecture", &s), TD_OK);
    assert_string_equal(s, "llama");
    assert_int_equal(td_gguf_find_key(g, "general.architecture"), 0);
    assert_string_equal(td_gguf_key_name(g, 0), "general.architecture");
    assert_int_equal(td_gguf_kv_type(g, 0), TD_GGUF_STRING);
    assert_null(td_gguf_key_name(g, td_gguf_n_kv(g)));
    assert_int_equal((int)td_gguf_kv_type(g, -1), -1);
    assert_int_equal(td_gguf_find_key(g, "no.such.key"), -1);
    assert_int_equal(td_gguf_get_u32(g, "llama.block_count", &u32), TD_OK);
    assert_int_equal(u32, 30);
    assert_int_equal(td_gguf_get_u32(g, "k.u8", &u32), TD_OK);
    assert_int_equal(u32, 200);
    assert_int_equal(td_gguf_get_u32(g, "k.u16", &u32), TD_OK);
    assert_int_equal(u32, 60000);
    assert_int_equal(td_gguf_get_i64(g, "k.i8", &i64), TD_OK);
    assert_int_equal(i64, -5);
    assert_int_equal(td_gguf_get_i64(g, "k.i16", &i64), TD_OK);
    assert_int_equal(i64, -300);
    assert_int_equal(td_gguf_get_i64(g, "k.i32", &i64), TD_OK);
    assert_int_equal(i64, -7);
    assert_int_equal(td_gguf_get_i64(g, "k.i64", &i64), TD_OK);
    assert_int_equal(i64, -9);
    assert_int_equal(td_gguf_get_i64(g, "k.u64", &i64), TD_OK);
    assert_true(i64 == 5000000000ll);
    /* values that do not fit, or the wrong type: FORMAT, output untouched */
    u32 = 12345;
    assert_int_equal(td_gguf_get_u32(g, "k.u64", &u32), TD_ERR_FORMAT);
    assert_int_equal(td_gguf_get_u32(g, "k.i32", &u32), TD_ERR_FORMAT);
    assert_int_equal(td_gguf_get_u32(g, "k.f32", &u32), TD_ERR_FORMAT);
    assert_int_equal(td_gguf_get_u32(g, "general.architecture", &u32), TD_ERR_FORMAT);
    assert_int_equal(u32, 12345);
    assert_int_equal(td_gguf_get_u32(g, "missing", &u32), TD_ERR_NOT_FOUND);
    assert_int_equal(td_gguf_get_f32(g, "k.f32", &f), TD_OK);
    assert_true(f == 1.5f);
    assert_int_equal(td_gguf_get_f32(g, "k.f64", &f), TD_OK);
    assert_true(f == 2.25f);
    assert_int_equal(td_gguf_get_f32(g, "k.u8", &f), TD_ERR_FORMAT);
    assert_int_equal(td_gguf_get_bool(g, "k.bool", &bl), TD_OK);
    assert_true(bl);
    assert_int_equal(td_gguf_get_bool(g, "k.u8", &bl), TD_ERR_FORMAT);
    assert_int_equal(td_gguf_get_str(g, "k.u8", &s), TD_ERR_FORMAT);
    assert_int_equal(td_gguf_get_str_len(g, "k.str_nul", &s, &len), TD_OK);
    assert_int_equal(len, 3);
    assert_memory_equal(s, "a\0b", 4);
    assert_int_equal(td_gguf_get_u32(g, "dup.a", &u32), TD_OK);
    assert_int_equal(u32, 1);
    assert_int_equal(td_gguf_get_u32(g, "dup.b", &u32), TD_OK);
    assert_int_equal(u32, 2);

    td_gguf_type et;
    uint64_t n;
    const void *data;
    assert_int_equal(td_gguf_get_arr(g, "arr.u32", &et, &n, &data), TD_OK);
    assert_int_equal(et, TD_GGUF_UINT32);
    assert_int_equal(n, 4);
    uint32_t v[4];
    memcpy(v, data, sizeof v);
    assert_int_equal(v[0], 1);
    assert_int_equal(v[2], 3);
    assert_int_equal(v[3], 0xffffffffu);
    assert_ptr_equal(data, b->p + L->u32arr_n + 8);
    assert_int_equal(td_gguf_get_arr(g, "arr.f32", &et, &n, &data), TD_OK);
    assert_int_equal(et, TD_GGUF_FLOAT32);
    float fv[2];
    memcpy(fv, data, sizeof fv);
    assert_true(fv[0] == 0.5f && fv[1] == -1.0f);
    assert_int_equal(td_gguf_get_arr(g, "arr.empty", &et, &n, &data), TD_OK);
    assert_int_equal(n, 0);
    assert_int_equal(td_gguf_get_arr(g, "arr.str", &et, &n, NULL), TD_OK);
    assert_int_equal(et, TD_GGUF_STRING);
    assert_int_equal(n, 4);
    static const char *want[] = {"hello", "", "x\0y", "\xc3\xbc"};
    static const size_t want_len[] = {5, 0, 3, 2};
    for (uint64_t i = 0; i < 4; i++) {
        assert_int_equal(td_gguf_get_arr_str(g, "arr.str", i, &s, &len), TD_OK);
        assert_int_equal(len, want_len[i]);
        assert_memory_equal(s, want[i], len + 1);
    }
    assert_int_equal(td_gguf_get_arr_str(g, "arr.str", 4, &s, &len), TD_ERR_RANGE);
    assert_int_equal(td_gguf_get_arr_str(g, "arr.u32", 0, &s, &len), TD_ERR_FORMAT);
    assert_int_equal(td_gguf_get_arr_str(g, "nope", 0, &s, &len), TD_ERR_NOT_FOUND);
    assert_int_equal(td_gguf_get_arr(g, "arr.nested", &et, &n, &data), TD_ERR_UNSUPPORTED);
    assert_int_equal(td_gguf_get_arr(g, "k.u8", &et, &n, &data), TD_ERR_FORMAT);

    for (int t = 0; t < NT; t++) {
        const td_gguf_tensor *ti = td_gguf_tensor_at(g, t);
        assert_non_null(ti);
        assert_ptr_equal(td_gguf_find_tensor(g, g_tensors[t].name), ti);
        assert_string_equal(ti->name, g_tensors[t].name);
        assert_int_equal(ti->type, g_tensors[t].type);
        assert_int_equal(ti->n_dims, g_tensors[t].n_dims);
        for (int d = 0; d < 4; d++)
            assert_int_equal(ti->ne[d], d < (int)g_tensors[t].n_dims ? g_tensors[t].ne[d] : 1);
        assert_int_equal(ti->nbytes, g_tensors[t].nbytes);
        assert_ptr_equal(ti->data, b->p + L->t_data[t]);
        assert_int_equal(((uintptr_t)ti->data - (uintptr_t)b->p) % L->alignment, 0);
        for (size_t i = 0; i < ti->nbytes; i++)
            assert_int_equal(((const uint8_t *)ti->data)[i], pattern(t, i));
    }
    assert_null(td_gguf_tensor_at(g, NT));
    assert_null(td_gguf_find_tensor(g, "missing.weight"));
    assert_string_equal(td_dtype_name(td_gguf_tensor_at(g, 2)->type), "q4_K");
}

static void test_valid_v3_aligned(void **state) {
    (void)state;
    layout L;
    wbuf b = make_gguf(3, 64, &L);
    td_gguf *g = NULL;
    assert_int_equal(td_gguf_open_buffer(b.p, b.n, "valid.gguf", &g), TD_OK);
    check_valid(g, &b, &L, 3);
    assert_string_equal(td_gguf_path(g), "valid.gguf");
    td_gguf_close(g);
    free(b.p);
}

static void test_valid_v2_default_alignment(void **state) {
    (void)state;
    layout L;
    wbuf b = make_gguf(2, 0, &L);
    td_gguf *g = NULL;
    assert_int_equal(td_gguf_open_buffer(b.p, b.n, "v2.gguf", &g), TD_OK);
    check_valid(g, &b, &L, 2);
    td_gguf_close(g);
    free(b.p);
}

static void test_open_file(void **state) {
    (void)state;
    layout L;
    wbuf b = make_gguf(3, 64, &L);
    char path[] = "/tmp/td_test_gguf_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, b.p, b.n), (ssize_t)b.n);
    close(fd);
    td_gguf *g = NULL;
    assert_int_equal(td_gguf_open(path, &g), TD_OK);
    assert_string_equal(td_gguf_path(g), path);
    assert_int_equal(td_gguf_n_tensors(g), NT);
    const td_gguf_tensor *t = td_gguf_find_tensor(g, "blk.q8");
    assert_non_null(t);
    assert_memory_equal(t->data, b.p + L.t_data[1], t->nbytes);
    td_gguf_close(g);

    /* a file shorter than its own header */
    fd = open(path, O_WRONLY | O_TRUNC);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, b.p, 10), 10);
    close(fd);
    td_log_set_level(TD_LOG_NONE);
    g = NULL;
    assert_int_equal(td_gguf_open(path, &g), TD_ERR_FORMAT);
    assert_null(g);
    unlink(path);
    assert_int_equal(td_gguf_open(path, &g), TD_ERR_NOT_FOUND);
    assert_int_equal(td_gguf_open("/tmp", &g), TD_ERR_IO);
    /* a FIFO is refused without blocking on open() */
    assert_int_equal(mkfifo(path, 0600), 0);
    assert_int_equal(td_gguf_open(path, &g), TD_ERR_IO);
    unlink(path);
    td_log_set_level(TD_LOG_INFO);
    assert_null(g);
    free(b.p);
}

/* ---- corrupt variants ---- */

static void test_every_truncation_fails_cleanly(void **state) {
    (void)state;
    layout L;
    wbuf b = make_gguf(3, 64, &L);
    td_log_set_level(TD_LOG_NONE);
    /* the last tensor's data ends at the end of the file, so every proper prefix is corrupt */
    for (size_t n = 0; n < b.n; n++) {
        td_gguf *g = (td_gguf *)0x1;
        uint8_t *copy = malloc(n ? n : 1);
        memcpy(copy, b.p, n);
        td_status st = td_gguf_open_buffer(copy, n, "trunc.gguf", &g);
        if (st != TD_ERR_FORMAT) fail_msg("prefix of %zu bytes: status %d", n, st);
        assert_ptr_equal(g, (td_gguf *)0x1); /* output untouched on failure */
        free(copy);
    }
    td_log_set_level(TD_LOG_INFO);
    assert_int_equal(open_copy(b.p, b.n), TD_OK);
    free(b.p);
}

typedef void (*mutate_fn)(wbuf *b, const layout *L);

static void expect(mutate_fn m, td_status want, const char *what) {
    layout L;
    wbuf b = make_gguf(3, 64, &L);
    assert_int_equal(open_quiet(&b), TD_OK); /* the unmodified file is fine */
    m(&b, &L);
    td_status st = open_quiet(&b);
    if (st != want) fail_msg("%s: got status %d (%s), want %d", what, st, td_status_str(st), want);
    free(b.p);
}

static void m_bad_magic(wbuf *b, const layout *L) {
    (void)L;
    memcpy(b->p, "GGML", 4);
}
static void m_version1(wbuf *b, const layout *L) { patch_u32(b, L->version, 1); }
static void m_version4(wbuf *b, const layout *L) { patch_u32(b, L->version, 4); }
static void m_version_be(wbuf *b, const layout *L) { patch_u32(b, L->version, 3u << 24); }
static void m_huge_n_tensors(wbuf *b, const layout *L) { patch_u64(b, L->n_tensors, 1ull << 62); }
static void m_max_n_tensors(wbuf *b, const layout *L) { patch_u64(b, L->n_tensors, UINT64_MAX); }
static void m_huge_n_kv(wbuf *b, const layout *L) { patch_u64(b, L->n_kv, UINT64_MAX / 3); }
static void m_n_kv_plus1(wbuf *b, const layout *L) {
    patch_u64(b, L->n_kv, read_u64(b, L->n_kv) + 1);
}
static void m_n_tensors_plus1(wbuf *b, const layout *L) { patch_u64(b, L->n_tensors, NT + 1); }
static void m_key_len_huge(wbuf *b, const layout *L) { patch_u64(b, L->arch_key_len, 1ull << 62); }
static void m_key_len_past_end(wbuf *b, const layout *L) {
    patch_u64(b, L->arch_key_len, b->n - L->arch_key_len - 8 + 1);
}
static void m_key_len_zero(wbuf *b, const layout *L) { patch_u64(b, L->arch_key_len, 0); }
static void m_key_nul(wbuf *b, const layout *L) { b->p[L->arch_key_len + 8 + 3] = 0; }
static void m_val_len_lie(wbuf *b, const layout *L) { patch_u64(b, L->arch_val_len, UINT64_MAX); }
static void m_val_len_short(wbuf *b, const layout *L) {
    /* one byte shorter: the rest of the file is misparsed from there on */
    patch_u64(b, L->arch_val_len, 4);
}
static void m_str_arr_huge(wbuf *b, const layout *L) { patch_u64(b, L->strarr_n, 1ull << 60); }
static void m_str_arr_max(wbuf *b, const layout *L) { patch_u64(b, L->strarr_n, UINT64_MAX); }
static void m_u32_arr_huge(wbuf *b, const layout *L) { patch_u64(b, L->u32arr_n, 1ull << 62); }
static void m_u32_arr_wrap(wbuf *b, const layout *L) {
    patch_u64(b, L->u32arr_n, (UINT64_MAX / 4) + 2); /* n * 4 wraps to a small number */
}
static void m_nested_bad_type(wbuf *b, const layout *L) { patch_u32(b, L->nested_inner_type, 77); }
static void m_kv_type_unknown(wbuf *b, const layout *L) { patch_u32(b, L->f32_type, 13); }
static void m_align0(wbuf *b, const layout *L) { patch_u32(b, L->align_val, 0); }
static void m_align3(wbuf *b, const layout *L) { patch_u32(b, L->align_val, 3); }
static void m_align_type(wbuf *b, const layout *L) { patch_u32(b, L->align_type, 5); /* int32 */ }
static void m_dup_key(wbuf *b, const layout *L) { b->p[L->dup_b_last] = 'a'; }
static void m_dup_tensor(wbuf *b, const layout *L) {
    /* "out.f16" becomes "tok.f32" (same length) */
    memcpy(b->p + L->t_name_last[3] - 6, "tok.f32", 7);
}
static void m_ndims0(wbuf *b, const layout *L) { patch_u32(b, L->t_ndims[0], 0); }
static void m_ndims5(wbuf *b, const layout *L) { patch_u32(b, L->t_ndims[0], 5); }
static void m_ndims_huge(wbuf *b, const layout *L) { patch_u32(b, L->t_ndims[1], 0x80000000u); }
static void m_ne_zero(wbuf *b, const layout *L) { patch_u64(b, L->t_ne[0] + 8, 0); }
static void m_ne_negative(wbuf *b, const layout *L) { patch_u64(b, L->t_ne[0], UINT64_MAX); }
static void m_ne_overflow(wbuf *b, const layout *L) {
    patch_u64(b, L->t_ne[0], 1ull << 32);
    patch_u64(b, L->t_ne[0] + 8, 1ull << 32);
}
static void m_ne_bytes_overflow(wbuf *b, const layout *L) {
    /* element count fits int64 but the f32 byte size does not fit size_t */
    patch_u64(b, L->t_ne[0], 1ull << 31);
    patch_u64(b, L->t_ne[0] + 8, 1ull << 31);
}
static void m_ne_not_block(wbuf *b, const layout *L) { patch_u64(b, L->t_ne[1], 48); }
static void m_type_removed(wbuf *b, const layout *L) { patch_u32(b, L->t_type[0], 4); }
static void m_type_unknown(wbuf *b, const layout *L) { patch_u32(b, L->t_type[0], 99); }
static void m_type_max(wbuf *b, const layout *L) { patch_u32(b, L->t_type[0], UINT32_MAX); }
static void m_type_bigger(wbuf *b, const layout *L) {
    patch_u32(b, L->t_type[3], 0); /* out.f16 as f32: needs 24 bytes, the file has 12 at the end */
}
static void m_off_misaligned(wbuf *b, const layout *L) {
    patch_u64(b, L->t_off[1], read_u64(b, L->t_off[1]) + 1);
}
static void m_off_past_end(wbuf *b, const layout *L) {
    patch_u64(b, L->t_off[3], read_u64(b, L->t_off[3]) + L->alignment);
}
static void m_off_wrap(wbuf *b, const layout *L) {
    patch_u64(b, L->t_off[3], UINT64_MAX - 63); /* aligned, and begin + size wraps */
}
static void m_off_overlap(wbuf *b, const layout *L) {
    patch_u64(b, L->t_off[3], read_u64(b, L->t_off[0]));
}

static void test_corrupt_variants(void **state) {
    (void)state;
    expect(m_bad_magic, TD_ERR_FORMAT, "bad magic");
    expect(m_version1, TD_ERR_UNSUPPORTED, "version 1");
    expect(m_version4, TD_ERR_UNSUPPORTED, "version 4");
    expect(m_version_be, TD_ERR_UNSUPPORTED, "big-endian");
    expect(m_huge_n_tensors, TD_ERR_FORMAT, "n_tensors 2^62");
    expect(m_max_n_tensors, TD_ERR_FORMAT, "n_tensors max");
    expect(m_huge_n_kv, TD_ERR_FORMAT, "n_kv huge");
    expect(m_n_kv_plus1, TD_ERR_FORMAT, "n_kv + 1");
    expect(m_n_tensors_plus1, TD_ERR_FORMAT, "n_tensors + 1");
    expect(m_key_len_huge, TD_ERR_FORMAT, "key length 2^62");
    expect(m_key_len_past_end, TD_ERR_FORMAT, "key length one past the end");
    expect(m_key_len_zero, TD_ERR_FORMAT, "empty key");
    expect(m_key_nul, TD_ERR_FORMAT, "NUL in key");
    expect(m_val_len_lie, TD_ERR_FORMAT, "string value length max");
    expect(m_val_len_short, TD_ERR_FORMAT, "string value length short by one");
    expect(m_str_arr_huge, TD_ERR_FORMAT, "string array 2^60");
    expect(m_str_arr_max, TD_ERR_FORMAT, "string array max");
    expect(m_u32_arr_huge, TD_ERR_FORMAT, "u32 array 2^62");
    expect(m_u32_arr_wrap, TD_ERR_FORMAT, "u32 array size wraps");
    expect(m_nested_bad_type, TD_ERR_FORMAT, "nested array with unknown type");
    expect(m_kv_type_unknown, TD_ERR_FORMAT, "unknown value type");
    expect(m_align0, TD_ERR_FORMAT, "alignment 0");
    expect(m_align3, TD_ERR_FORMAT, "alignment 3");
    expect(m_align_type, TD_ERR_FORMAT, "alignment as int32");
    expect(m_dup_key, TD_ERR_FORMAT, "duplicate key");
    expect(m_dup_tensor, TD_ERR_FORMAT, "duplicate tensor");
    expect(m_ndims0, TD_ERR_FORMAT, "n_dims 0");
    expect(m_ndims5, TD_ERR_FORMAT, "n_dims 5");
    expect(m_ndims_huge, TD_ERR_FORMAT, "n_dims 2^31");
    expect(m_ne_zero, TD_ERR_FORMAT, "ne 0");
    expect(m_ne_negative, TD_ERR_FORMAT, "ne -1");
    expect(m_ne_overflow, TD_ERR_FORMAT, "ne product 2^64");
    expect(m_ne_bytes_overflow, TD_ERR_FORMAT, "byte size 2^64");
    expect(m_ne_not_block, TD_ERR_FORMAT, "q8_0 row not a multiple of 32");
    expect(m_type_removed, TD_ERR_FORMAT, "removed type id 4");
    expect(m_type_unknown, TD_ERR_FORMAT, "type id 99");
    expect(m_type_max, TD_ERR_FORMAT, "type id 2^32-1");
    expect(m_type_bigger, TD_ERR_FORMAT, "type change makes data exceed the file");
    expect(m_off_misaligned, TD_ERR_FORMAT, "misaligned offset");
    expect(m_off_past_end, TD_ERR_FORMAT, "data past the end");
    expect(m_off_wrap, TD_ERR_FORMAT, "offset wraps");
    expect(m_off_overlap, TD_ERR_FORMAT, "overlapping tensors");
}

/* Arrays nested deeper than the reader walks are rejected, not recursed into. */
static void test_deep_nesting(void **state) {
    (void)state;
    wbuf b = {0};
    w_bytes(&b, "GGUF", 4), w_u32(&b, 3), w_u64(&b, 0), w_u64(&b, 1);
    w_key(&b, "deep", 9);
    for (int i = 0; i < 64; i++) w_u32(&b, 9), w_u64(&b, 1);
    w_u32(&b, 0), w_u64(&b, 0);
    assert_int_equal(open_quiet(&b), TD_ERR_FORMAT);
    /* two levels are fine */
    b.n = 0;
    w_bytes(&b, "GGUF", 4), w_u32(&b, 3), w_u64(&b, 0), w_u64(&b, 1);
    w_key(&b, "two", 9);
    w_u32(&b, 9), w_u64(&b, 1), w_u32(&b, 9), w_u64(&b, 1), w_u32(&b, 4), w_u64(&b, 1),
        w_u32(&b, 7);
    assert_int_equal(open_quiet(&b), TD_OK);
    free(b.p);
}

/* No tensors at all: the file may end right after the metadata. */
static void test_no_tensors(void **state) {
    (void)state;
    wbuf b = {0};
    w_bytes(&b, "GGUF", 4), w_u32(&b, 3), w_u64(&b, 0), w_u64(&b, 1);
    w_key(&b, "a", 4), w_u32(&b, 7);
    assert_int_equal(open_copy(b.p, b.n), TD_OK); /* exact-size copy */
    td_gguf *g = NULL;
    assert_int_equal(td_gguf_open_buffer(b.p, b.n, "kv-only.gguf", &g), TD_OK);
    assert_int_equal(td_gguf_n_tensors(g), 0);
    uint32_t v;
    assert_int_equal(td_gguf_get_u32(g, "a", &v), TD_OK);
    assert_int_equal(v, 7);
    td_gguf_close(g);
    free(b.p);
}

/* The error names the file and the tensor. */
/* A FLOAT64 value outside float's range is a format error, not an
 * (undefined) conversion; an in-range one converts. */
static void test_f64_out_of_float_range(void **state) {
    (void)state;
    layout L;
    wbuf b = make_gguf(3, 64, &L);
    const uint64_t want = 0x4002000000000000ull; /* 2.25, the k.f64 value */
    size_t at = SIZE_MAX;
    for (size_t i = 0; i + 8 <= b.n; i++) {
        uint64_t v;
        memcpy(&v, b.p + i, 8);
        if (v == want) {
            at = i;
            break;
        }
    }
    assert_true(at != SIZE_MAX);
    td_gguf *g = NULL;
    float f = 0;
    assert_int_equal(td_gguf_open_buffer(b.p, b.n, "f64.gguf", &g), TD_OK);
    assert_int_equal(td_gguf_get_f32(g, "k.f64", &f), TD_OK);
    assert_true(f == 2.25f);
    td_gguf_close(g);
    patch_u64(&b, at, 0x7e37e43c8800759cull); /* 1e300 */
    assert_int_equal(td_gguf_open_buffer(b.p, b.n, "f64.gguf", &g), TD_OK);
    f = 7.0f;
    assert_int_equal(td_gguf_get_f32(g, "k.f64", &f), TD_ERR_FORMAT);
    assert_true(f == 7.0f); /* untouched on failure */
    td_gguf_close(g);
    free(b.p);
}

static void test_error_message(void **state) {
    (void)state;
    layout L;
    wbuf b = make_gguf(3, 64, &L);
    m_off_past_end(&b, &L);
    char path[] = "/tmp/td_test_gguf_log_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    fflush(stderr);
    int saved = dup(2);
    dup2(fd, 2);
    td_gguf *g = NULL;
    td_status st = td_gguf_open_buffer(b.p, b.n, "broken.gguf", &g);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    assert_int_equal(st, TD_ERR_FORMAT);
    char buf[1024] = {0};
    assert_true(pread(fd, buf, sizeof buf - 1, 0) > 0);
    close(fd);
    unlink(path);
    assert_non_null(
        strstr(buf, "E td_gguf_open_buffer: broken.gguf: tensor 'out.f16': data range"));
    assert_non_null(strstr(buf, "exceeds file size"));
    assert_ptr_equal(strchr(buf, '\n'), buf + strlen(buf) - 1); /* exactly one line */
    free(b.p);
}

static void test_dtype_names(void **state) {
    (void)state;
    /* from the GGUF spec's ggml_type list */
    static const struct {
        int id;
        const char *name;
    } want[] = {{0, "f32"},     {1, "f16"},    {2, "q4_0"},  {3, "q4_1"},   {6, "q5_0"},
                {7, "q5_1"},    {8, "q8_0"},   {9, "q8_1"},  {10, "q2_K"},  {11, "q3_K"},
                {12, "q4_K"},   {13, "q5_K"},  {14, "q6_K"}, {15, "q8_K"},  {16, "iq2_xxs"},
                {23, "iq4_xs"}, {24, "i8"},    {28, "f64"},  {29, "iq1_m"}, {30, "bf16"},
                {34, "tq1_0"},  {35, "tq2_0"}, {39, "mxfp4"}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        assert_string_equal(td_dtype_name(want[i].id), want[i].name);
    assert_string_equal(td_dtype_name(-1), "unknown");
    assert_string_equal(td_dtype_name(1000), "unknown");
    int be;
    size_t bb;
    assert_true(td_gguf_type_info(12, &be, &bb));
    assert_int_equal(be, 256);
    assert_int_equal(bb, 144);
    assert_true(td_gguf_type_info(14, &be, &bb));
    assert_int_equal(bb, 210); /* q6_K: ql[128] + qh[64] + scales[16] + d */
    assert_false(td_gguf_type_info(4, &be, &bb));
    assert_false(td_gguf_type_info(-3, &be, &bb));
}

/* The default model, when installed: figures from the gguf package's dump. */
static void test_default_model(void **state) {
    (void)state;
    const char *home = getenv("HOME");
    char path[1024];
    snprintf(path, sizeof path, "%s/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf",
             home ? home : "");
    struct stat sb;
    if (stat(path, &sb) != 0) skip();
    td_gguf *g = NULL;
    assert_int_equal(td_gguf_open(path, &g), TD_OK);
    assert_int_equal(td_gguf_version(g), 3);
    assert_int_equal(td_gguf_n_tensors(g), 272);
    const td_gguf_tensor *t = td_gguf_find_tensor(g, "token_embd.weight");
    assert_non_null(t);
    assert_int_equal(t->type, TD_TYPE_Q8_0);
    assert_int_equal(t->n_dims, 2);
    assert_int_equal(t->ne[0], 576);
    assert_int_equal(t->ne[1], 49152);
    assert_int_equal(t->nbytes, (size_t)49152 * (576 / 32) * 34);
    t = td_gguf_find_tensor(g, "blk.29.ffn_down.weight");
    assert_non_null(t);
    assert_int_equal(t->type, TD_TYPE_Q4_1);
    assert_int_equal(t->ne[0], 1536);
    assert_int_equal(t->ne[1], 576);
    uint32_t u;
    assert_int_equal(td_gguf_get_u32(g, "llama.block_count", &u), TD_OK);
    assert_int_equal(u, 30);
    const char *s;
    assert_int_equal(td_gguf_get_str(g, "general.architecture", &s), TD_OK);
    assert_string_equal(s, "llama");
    assert_int_equal(td_gguf_get_str(g, "tokenizer.ggml.model", &s), TD_OK);
    assert_string_equal(s, "gpt2");
    td_gguf_type et;
    uint64_t n;
    assert_int_equal(td_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n, NULL), TD_OK);
    assert_int_equal(et, TD_GGUF_STRING);
    assert_int_equal(n, 49152);
    size_t len;
    assert_int_equal(td_gguf_get_arr_str(g, "tokenizer.ggml.tokens", 1, &s, &len), TD_OK);
    assert_string_equal(s, "<|im_start|>");
    assert_int_equal(td_gguf_get_arr(g, "tokenizer.ggml.merges", &et, &n, NULL), TD_OK);
    assert_int_equal(et, TD_GGUF_STRING);
    assert_int_equal(n, 48900);
    assert_int_equal(td_gguf_get_arr(g, "tokenizer.ggml.token_type", &et, &n, NULL), TD_OK);
    assert_int_equal(et, TD_GGUF_INT32);
    assert_int_equal(n, 49152);
    td_gguf_close(g);
}

/* A file written by the PyPI gguf package's GGUFWriter (an independent
 * writer); the Q8_0 bytes it quantized are written to a side file. */
static void test_python_writer(void **state) {
    (void)state;
    char dir[] = "/tmp/td_test_gguf_py_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char script[128], out[128], qbin[128], cmd[512];
    snprintf(script, sizeof script, "%s/w.py", dir);
    snprintf(out, sizeof out, "%s/py.gguf", dir);
    snprintf(qbin, sizeof qbin, "%s/q.bin", dir);
    FILE *fp = fopen(script, "w");
    assert_non_null(fp);
    fputs("import sys\n"
          "try:\n"
          "    import numpy as np\n"
          "    import gguf\n"
          "except ImportError:\n"
          "    sys.exit(77)\n"
          "w = gguf.GGUFWriter(sys.argv[1], 'llama')\n"
          "w.add_block_count(3)\n"
          "w.add_uint32('t.u32', 7)\n"
          "w.add_int32('t.i32', -3)\n"
          "w.add_float32('t.f32', 0.25)\n"
          "w.add_bool('t.bool', True)\n"
          "w.add_string('t.str', 'h\\u00e9llo')\n"
          "w.add_array('t.arr_i', [1, 2, 3])\n"
          "w.add_array('t.arr_s', ['a', 'bb', ''])\n"
          "w.add_custom_alignment(64)\n"
          "w.add_tensor('tok_embd.weight', np.arange(12, dtype=np.float32).reshape(3, 4))\n"
          "w.add_tensor('norm.weight', np.arange(8, dtype=np.float16))\n"
          "q = gguf.quants.quantize(np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64),\n"
          "                         gguf.GGMLQuantizationType.Q8_0)\n"
          "w.add_tensor('q.weight', q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)\n"
          "open(sys.argv[2], 'wb').write(q.tobytes())\n"
          "w.write_header_to_file()\n"
          "w.write_kv_data_to_file()\n"
          "w.write_tensors_to_file()\n"
          "w.close()\n",
          fp);
    fclose(fp);
    snprintf(cmd, sizeof cmd, "python3 '%s' '%s' '%s' 2>/dev/null", script, out, qbin);
    int rc = system(cmd);
    bool skipped = rc == -1 || !WIFEXITED(rc) || WEXITSTATUS(rc) == 77 || WEXITSTATUS(rc) == 127;
    if (!skipped) {
        assert_int_equal(WEXITSTATUS(rc), 0);
        td_gguf *g = NULL;
        assert_int_equal(td_gguf_open(out, &g), TD_OK);
        assert_int_equal(td_gguf_alignment(g), 64);
        const char *s;
        uint32_t u;
        int64_t i;
        float f;
        bool b;
        assert_int_equal(td_gguf_get_str(g, "general.architecture", &s), TD_OK);
        assert_string_equal(s, "llama");
        assert_int_equal(td_gguf_get_u32(g, "llama.block_count", &u), TD_OK);
        assert_int_equal(u, 3);
        assert_int_equal(td_gguf_get_u32(g, "t.u32", &u), TD_OK);
        assert_int_equal(u, 7);
        assert_int_equal(td_gguf_get_i64(g, "t.i32", &i), TD_OK);
        assert_int_equal(i, -3);
        assert_int_equal(td_gguf_get_f32(g, "t.f32", &f), TD_OK);
        assert_true(f == 0.25f);
        assert_int_equal(td_gguf_get_bool(g, "t.bool", &b), TD_OK);
        assert_true(b);
        assert_int_equal(td_gguf_get_str(g, "t.str", &s), TD_OK);
        assert_string_equal(s, "h\xc3\xa9llo");
        td_gguf_type et;
        uint64_t n;
        const void *d;
        assert_int_equal(td_gguf_get_arr(g, "t.arr_i", &et, &n, &d), TD_OK);
        assert_int_equal(et, TD_GGUF_INT32);
        assert_int_equal(n, 3);
        int32_t iv[3];
        memcpy(iv, d, sizeof iv);
        assert_true(iv[0] == 1 && iv[1] == 2 && iv[2] == 3);
        size_t len;
        assert_int_equal(td_gguf_get_arr_str(g, "t.arr_s", 1, &s, &len), TD_OK);
        assert_string_equal(s, "bb");
        assert_int_equal(td_gguf_get_arr_str(g, "t.arr_s", 2, &s, &len), TD_OK);
        assert_int_equal(len, 0);

        const td_gguf_tensor *t = td_gguf_find_tensor(g, "tok_embd.weight");
        assert_non_null(t);
        assert_int_equal(t->type, TD_TYPE_F32);
        assert_int_equal(t->n_dims, 2);
        assert_int_equal(t->ne[0], 4); /* numpy (3, 4): innermost dimension first */
        assert_int_equal(t->ne[1], 3);
        for (int k = 0; k < 12; k++) {
            float v;
            memcpy(&v, (const uint8_t *)t->data + 4 * k, 4);
            assert_true(v == (float)k);
        }
        t = td_gguf_find_tensor(g, "norm.weight");
        assert_non_null(t);
        assert_int_equal(t->type, TD_TYPE_F16);
        uint16_t h;
        memcpy(&h, (const uint8_t *)t->data + 2 * 5, 2);
        assert_int_equal(h, 0x4500); /* 5.0 in IEEE half */
        t = td_gguf_find_tensor(g, "q.weight");
        assert_non_null(t);
        assert_int_equal(t->type, TD_TYPE_Q8_0);
        assert_int_equal(t->ne[0], 64);
        assert_int_equal(t->ne[1], 2);
        assert_int_equal(t->nbytes, 2 * 2 * 34);
        uint8_t qb[136];
        fp = fopen(qbin, "rb");
        assert_non_null(fp);
        assert_int_equal(fread(qb, 1, sizeof qb, fp), sizeof qb);
        fclose(fp);
        assert_memory_equal(t->data, qb, sizeof qb);
        td_gguf_close(g);
    }
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
    if (skipped) skip();
}

/* Every tiny GGUF model of tests/models (written with the gguf package):
 * tensor types and shapes as its manifest says. */
static void test_test_models(void **state) {
    (void)state;
    const char *dir = getenv("TANDEM_TEST_MODELS");
    char path[1024];
    snprintf(path, sizeof path, "%s/models.json", dir ? dir : "");
    json_error_t jerr;
    json_t *man = dir ? json_load_file(path, 0, &jerr) : NULL;
    if (!man) skip();
    size_t i;
    json_t *m;
    int n_checked = 0;
    json_array_foreach(json_object_get(man, "models"), i, m) {
        if (strcmp(json_string_value(json_object_get(m, "format")), "gguf") != 0) continue;
        snprintf(path, sizeof path, "%s/%s", dir, json_string_value(json_object_get(m, "path")));
        json_t *cfg = json_object_get(m, "config");
        td_gguf *g = NULL;
        if (td_gguf_open(path, &g) != TD_OK) fail_msg("%s does not open", path);
        char key[128];
        snprintf(key, sizeof key, "%s.block_count", json_string_value(json_object_get(m, "arch")));
        uint32_t n_layer;
        assert_int_equal(td_gguf_get_u32(g, key, &n_layer), TD_OK);
        assert_int_equal(n_layer, json_integer_value(json_object_get(cfg, "n_layer")));
        const td_gguf_tensor *t = td_gguf_find_tensor(g, "token_embd.weight");
        assert_non_null(t);
        assert_int_equal(t->ne[0], json_integer_value(json_object_get(cfg, "n_embd")));
        assert_int_equal(t->ne[1], json_integer_value(json_object_get(cfg, "n_vocab")));
        const char *tk;
        json_t *tv;
        json_object_foreach(json_object_get(m, "tensor_types"), tk, tv) {
            /* a role names a per-layer tensor (blk.0.ROLE.weight, or blk.0.ROLE for
             * biases) or a global one (token_embd, output_norm, output, rope_freqs) */
            static const char *const forms[] = {"blk.0.%s.weight", "blk.0.%s", "%s.weight"};
            char name[128];
            t = NULL;
            for (size_t f = 0; f < 3 && !t; f++) {
                snprintf(name, sizeof name, forms[f], tk);
                t = td_gguf_find_tensor(g, name);
            }
            if (!t && strcmp(tk, "output") == 0) continue; /* tied head */
            if (!t) fail_msg("%s: tensor %s missing", path, name);
            const char *want = json_string_value(tv);
            const char *got = td_dtype_name(t->type);
            if (strcasecmp(want, got) != 0)
                fail_msg("%s: %s is %s, want %s", path, name, got, want);
        }
        td_gguf_close(g);
        n_checked++;
    }
    json_decref(man);
    assert_true(n_checked > 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid_v3_aligned),
        cmocka_unit_test(test_valid_v2_default_alignment),
        cmocka_unit_test(test_open_file),
        cmocka_unit_test(test_every_truncation_fails_cleanly),
        cmocka_unit_test(test_corrupt_variants),
        cmocka_unit_test(test_deep_nesting),
        cmocka_unit_test(test_no_tensors),
        cmocka_unit_test(test_f64_out_of_float_range),
        cmocka_unit_test(test_error_message),
        cmocka_unit_test(test_dtype_names),
        cmocka_unit_test(test_default_model),
        cmocka_unit_test(test_python_writer),
        cmocka_unit_test(test_test_models),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
