/* safetensors reader: files laid out by hand from the format description
 * (u64 header length | JSON | data), read back; hand-made corrupt headers,
 * each with its expected status; every truncation; Hugging Face directories
 * (single file, sharded index, broken indexes); and a file written by the
 * PyPI safetensors package when python3 has it. */
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "common/format/safetensors.h"
#include "kernels/dtype.h"

typedef struct {
    uint8_t *p;
    size_t n;
} file_buf;

static uint8_t pattern(size_t i) { return (uint8_t)(i * 13 + 5); }

/* u64 header length `hlen` (which may lie), the JSON text, then data_len
 * bytes of pattern. */
static file_buf st_build_len(const char *json, size_t data_len, uint64_t hlen) {
    size_t jl = strlen(json);
    file_buf f;
    f.n = 8 + jl + data_len;
    f.p = malloc(f.n);
    assert_non_null(f.p);
    for (int i = 0; i < 8; i++) f.p[i] = (uint8_t)(hlen >> (8 * i));
    memcpy(f.p + 8, json, jl);
    for (size_t i = 0; i < data_len; i++) f.p[8 + jl + i] = pattern(i);
    return f;
}

static file_buf st_build(const char *json, size_t data_len) {
    return st_build_len(json, data_len, strlen(json));
}

/* Opens an exact-size heap copy (ASan catches any read past it) and touches
 * the first and last byte of every tensor. */
static td_status open_copy(const file_buf *f) {
    uint8_t *copy = malloc(f->n ? f->n : 1);
    assert_non_null(copy);
    memcpy(copy, f->p, f->n);
    td_st *st = NULL;
    td_log_level lv = td_log_get_level();
    td_log_set_level(TD_LOG_NONE);
    td_status s = td_st_open_buffer(copy, f->n, "test.safetensors", &st);
    td_log_set_level(lv);
    if (s == TD_OK) {
        for (int64_t i = 0; i < td_st_n_tensors(st); i++) {
            const td_st_tensor *t = td_st_tensor_at(st, i);
            if (!t->nbytes) continue;
            volatile uint8_t x = ((const uint8_t *)t->data)[0];
            x = ((const uint8_t *)t->data)[t->nbytes - 1];
            (void)x;
        }
    }
    td_st_close(st);
    free(copy);
    return s;
}

static void expect_json(const char *json, size_t data_len, td_status want) {
    file_buf f = st_build(json, data_len);
    td_status s = open_copy(&f);
    if (s != want)
        fail_msg("header %s: got status %d (%s), want %d", json, s, td_status_str(s), want);
    free(f.p);
}

/* 47 data bytes: F32 [2,3] 0..24, BF16 [4] 24..32, F16 [1,1,1,2] 32..36,
 * I64 scalar 36..44, F32 [0,5] empty at 44, U8 [3] 44..47. */
static const char *g_valid_json =
    "{\"__metadata__\":{\"format\":\"pt\"},"
    "\"w.f32\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
    "\"w.bf16\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[24,32]},"
    "\"w.f16\":{\"dtype\":\"F16\",\"shape\":[1,1,1,2],\"data_offsets\":[32,36]},"
    "\"i.i64\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[36,44]},"
    "\"e.empty\":{\"dtype\":\"F32\",\"shape\":[0,5],\"data_offsets\":[44,44]},"
    "\"u.u8\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[44,47]}}      ";

static void check_tensor(const td_st *st, const uint8_t *data_base, const char *name, int type,
                         const char *dtype, int n_dims, const int64_t *shape, size_t begin,
                         size_t nbytes) {
    const td_st_tensor *t = td_st_find(st, name);
    if (!t) fail_msg("tensor %s missing", name);
    assert_string_equal(t->name, name);
    assert_int_equal(t->type, type);
    assert_string_equal(t->dtype, dtype);
    assert_int_equal(t->n_dims, n_dims);
    for (int d = 0; d < n_dims; d++) assert_int_equal(t->shape[d], shape[d]);
    assert_int_equal(t->nbytes, nbytes);
    assert_ptr_equal(t->data, data_base + begin);
    for (size_t i = 0; i < nbytes; i++)
        assert_int_equal(((const uint8_t *)t->data)[i], pattern(begin + i));
}

static void check_valid(const td_st *st, const uint8_t *file) {
    const uint8_t *data = file + 8 + strlen(g_valid_json);
    assert_int_equal(td_st_n_tensors(st), 6);
    check_tensor(st, data, "w.f32", TD_TYPE_F32, "F32", 2, (int64_t[]){2, 3}, 0, 24);
    check_tensor(st, data, "w.bf16", TD_TYPE_BF16, "BF16", 1, (int64_t[]){4}, 24, 8);
    check_tensor(st, data, "w.f16", TD_TYPE_F16, "F16", 4, (int64_t[]){1, 1, 1, 2}, 32, 4);
    check_tensor(st, data, "i.i64", -1, "I64", 0, NULL, 36, 8);
    check_tensor(st, data, "e.empty", TD_TYPE_F32, "F32", 2, (int64_t[]){0, 5}, 44, 0);
    check_tensor(st, data, "u.u8", -1, "U8", 1, (int64_t[]){3}, 44, 3);
    assert_null(td_st_find(st, "__metadata__"));
    assert_null(td_st_find(st, "missing"));
    assert_null(td_st_tensor_at(st, 6));
    assert_null(td_st_tensor_at(st, -1));
    for (int64_t i = 0; i < 6; i++) assert_non_null(td_st_tensor_at(st, i));
}

static void test_valid_buffer(void **state) {
    (void)state;
    file_buf f = st_build(g_valid_json, 47);
    td_st *st = NULL;
    assert_int_equal(td_st_open_buffer(f.p, f.n, "valid.safetensors", &st), TD_OK);
    check_valid(st, f.p);
    td_st_close(st);
    assert_int_equal(open_copy(&f), TD_OK);
    free(f.p);
}

static void test_every_truncation(void **state) {
    (void)state;
    file_buf f = st_build(g_valid_json, 47);
    for (size_t n = 0; n < f.n; n++) {
        file_buf p = {f.p, n};
        td_status s = open_copy(&p);
        if (s != TD_ERR_FORMAT) fail_msg("prefix of %zu bytes: status %d", n, s);
    }
    free(f.p);
}

static void test_header_length(void **state) {
    (void)state;
    file_buf f = st_build_len(g_valid_json, 47, strlen(g_valid_json) + 48); /* past the end */
    assert_int_equal(open_copy(&f), TD_ERR_FORMAT);
    free(f.p);
    f = st_build_len(g_valid_json, 47, UINT64_MAX);
    assert_int_equal(open_copy(&f), TD_ERR_FORMAT);
    free(f.p);
    f = st_build_len(g_valid_json, 47, 100000001); /* over the 100 MB limit */
    assert_int_equal(open_copy(&f), TD_ERR_FORMAT);
    free(f.p);
    f = st_build_len("{}", 0, 0);
    assert_int_equal(open_copy(&f), TD_ERR_FORMAT);
    free(f.p);
    f = st_build_len(g_valid_json, 47, strlen(g_valid_json) - 10); /* JSON cut short */
    assert_int_equal(open_copy(&f), TD_ERR_FORMAT);
    free(f.p);
    /* a header that takes the whole file and no tensors is fine */
    expect_json("{}", 0, TD_OK);
    expect_json("{\"__metadata__\":{}}", 0, TD_OK);
}

static void test_corrupt_headers(void **state) {
    (void)state;
    /* not JSON, not an object */
    expect_json("{\"a\":", 0, TD_ERR_FORMAT);
    expect_json("not json at all", 0, TD_ERR_FORMAT);
    expect_json("[1,2,3]", 0, TD_ERR_FORMAT);
    expect_json("\"str\"", 0, TD_ERR_FORMAT);
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}} trailing", 4,
                TD_ERR_FORMAT);
    expect_json("{\"__metadata__\":[1]}", 0, TD_ERR_FORMAT);
    /* entries */
    expect_json("{\"a\":5}", 0, TD_ERR_FORMAT);
    expect_json("{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, TD_ERR_FORMAT);
    expect_json("{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, TD_ERR_FORMAT);
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, TD_ERR_FORMAT);
    expect_json("{\"a\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, TD_ERR_FORMAT);
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":1,\"data_offsets\":[0,4]}}", 4, TD_ERR_FORMAT);
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":{}}}", 4, TD_ERR_FORMAT);
    /* dtypes */
    expect_json("{\"a\":{\"dtype\":\"Q4\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
                TD_ERR_UNSUPPORTED);
    expect_json("{\"a\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
                TD_ERR_UNSUPPORTED);
    /* shapes */
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4,
                TD_ERR_FORMAT);
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,4]}}", 4,
                TD_ERR_FORMAT);
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[\"1\"],\"data_offsets\":[0,4]}}", 4,
                TD_ERR_FORMAT);
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1],\"data_offsets\":[0,4]}}", 4,
                TD_ERR_UNSUPPORTED);
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],"
                "\"data_offsets\":[0,4]}}",
                4, TD_ERR_FORMAT);
    expect_json(
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904],\"data_offsets\":[0,4]}}", 4,
        TD_ERR_FORMAT); /* 2^62 elements x 4 bytes overflows */
    /* offsets */
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,8]}}", 4,
                TD_ERR_FORMAT); /* past the end, and size mismatch */
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 4,
                TD_ERR_FORMAT); /* past the end */
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 4,
                TD_ERR_FORMAT); /* begin > end */
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 4,
                TD_ERR_FORMAT);
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, TD_ERR_FORMAT);
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 8,
                TD_ERR_FORMAT);
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,\"4\"]}}", 4,
                TD_ERR_FORMAT);
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],"
                "\"data_offsets\":[9223372036854775800,9223372036854775804]}}",
                4, TD_ERR_FORMAT);
    /* nbytes != prod(shape) x element size */
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 8,
                TD_ERR_FORMAT);
    expect_json("{\"a\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,4]}}", 8,
                TD_ERR_FORMAT);
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,0]}}", 4,
                TD_ERR_FORMAT); /* a scalar has one element */
    /* overlapping and duplicate tensors */
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                8, TD_ERR_FORMAT);
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                8, TD_ERR_FORMAT);
    /* adjacent tensors and holes are fine */
    expect_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                "\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[6,8]},"
                "\"c\":{\"dtype\":\"I8\",\"shape\":[1],\"data_offsets\":[4,5]}}",
                8, TD_OK);
    /* every other dtype's element size */
    expect_json("{\"a\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]},"
                "\"b\":{\"dtype\":\"U64\",\"shape\":[1],\"data_offsets\":[8,16]},"
                "\"c\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[16,20]},"
                "\"d\":{\"dtype\":\"U32\",\"shape\":[1],\"data_offsets\":[20,24]},"
                "\"e\":{\"dtype\":\"I16\",\"shape\":[1],\"data_offsets\":[24,26]},"
                "\"f\":{\"dtype\":\"U16\",\"shape\":[1],\"data_offsets\":[26,28]},"
                "\"g\":{\"dtype\":\"BOOL\",\"shape\":[1],\"data_offsets\":[28,29]},"
                "\"h\":{\"dtype\":\"F8_E4M3\",\"shape\":[1],\"data_offsets\":[29,30]},"
                "\"i\":{\"dtype\":\"F8_E5M2\",\"shape\":[2],\"data_offsets\":[30,32]}}",
                32, TD_OK);
}

/* ---- files and directories ---- */

static char g_dir[64];

static void write_file(const char *dir, const char *name, const void *p, size_t n) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(p, 1, n, fp), n);
    fclose(fp);
}

static void write_text(const char *dir, const char *name, const char *text) {
    write_file(dir, name, text, strlen(text));
}

static void remove_dir(const char *dir) {
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

static int setup_dir(void **state) {
    (void)state;
    strcpy(g_dir, "/tmp/td_test_st_XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown_dir(void **state) {
    (void)state;
    remove_dir(g_dir);
    return 0;
}

static td_status open_path_quiet(const char *path, td_st **st_p) {
    td_log_set_level(TD_LOG_NONE);
    td_status s = td_st_open(path, st_p);
    td_log_set_level(TD_LOG_INFO);
    return s;
}

static void test_file_and_single_dir(void **state) {
    (void)state;
    char sub[256], path[512];
    snprintf(sub, sizeof sub, "%s/single", g_dir);
    assert_int_equal(mkdir(sub, 0755), 0);
    file_buf f = st_build(g_valid_json, 47);
    write_file(sub, "model.safetensors", f.p, f.n);
    td_st *st = NULL;
    /* the directory */
    assert_int_equal(td_st_open(sub, &st), TD_OK);
    assert_int_equal(td_st_n_tensors(st), 6);
    const td_st_tensor *t = td_st_find(st, "w.bf16");
    assert_non_null(t);
    assert_memory_equal(t->data, f.p + 8 + strlen(g_valid_json) + 24, 8);
    td_st_close(st);
    /* the file itself */
    snprintf(path, sizeof path, "%s/model.safetensors", sub);
    st = NULL;
    assert_int_equal(td_st_open(path, &st), TD_OK);
    assert_int_equal(td_st_n_tensors(st), 6);
    td_st_close(st);
    /* missing things */
    st = NULL;
    snprintf(path, sizeof path, "%s/nope.safetensors", sub);
    assert_int_equal(open_path_quiet(path, &st), TD_ERR_NOT_FOUND);
    assert_int_equal(open_path_quiet(g_dir, &st), TD_ERR_NOT_FOUND); /* no model files */
    /* a tiny file */
    write_text(sub, "tiny.safetensors", "abc");
    snprintf(path, sizeof path, "%s/tiny.safetensors", sub);
    assert_int_equal(open_path_quiet(path, &st), TD_ERR_FORMAT);
    /* a FIFO is refused without blocking on open() */
    snprintf(path, sizeof path, "%s/fifo.safetensors", sub);
    assert_int_equal(mkfifo(path, 0600), 0);
    assert_int_equal(open_path_quiet(path, &st), TD_ERR_IO);
    assert_null(st);
    free(f.p);
}

static void test_sharded_dir(void **state) {
    (void)state;
    char sub[256];
    snprintf(sub, sizeof sub, "%s/sharded", g_dir);
    assert_int_equal(mkdir(sub, 0755), 0);
    file_buf s1 = st_build("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                           "\"b\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[8,12]}}",
                           12);
    file_buf s2 =
        st_build("{\"c\":{\"dtype\":\"BF16\",\"shape\":[3,1],\"data_offsets\":[0,6]}}", 6);
    write_file(sub, "model-00001-of-00002.safetensors", s1.p, s1.n);
    write_file(sub, "model-00002-of-00002.safetensors", s2.p, s2.n);
    write_text(sub, "model.safetensors.index.json",
               "{\"metadata\":{\"total_size\":18},\"weight_map\":{"
               "\"a\":\"model-00001-of-00002.safetensors\","
               "\"c\":\"model-00002-of-00002.safetensors\","
               "\"b\":\"model-00001-of-00002.safetensors\"}}");
    /* an index takes precedence over a stray model.safetensors */
    write_text(sub, "model.safetensors", "garbage");
    td_st *st = NULL;
    assert_int_equal(td_st_open(sub, &st), TD_OK);
    assert_int_equal(td_st_n_tensors(st), 3);
    const td_st_tensor *t = td_st_find(st, "c");
    assert_non_null(t);
    assert_int_equal(t->type, TD_TYPE_BF16);
    assert_int_equal(t->n_dims, 2);
    assert_int_equal(t->shape[0], 3);
    assert_int_equal(t->shape[1], 1);
    assert_int_equal(t->nbytes, 6);
    for (size_t i = 0; i < 6; i++) assert_int_equal(((const uint8_t *)t->data)[i], pattern(i));
    t = td_st_find(st, "b");
    assert_non_null(t);
    for (size_t i = 0; i < 4; i++) assert_int_equal(((const uint8_t *)t->data)[i], pattern(8 + i));
    td_st_close(st);

    /* index names a tensor its shard lacks */
    write_text(sub, "model.safetensors.index.json",
               "{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
               "\"z\":\"model-00002-of-00002.safetensors\"}}");
    st = NULL;
    assert_int_equal(open_path_quiet(sub, &st), TD_ERR_FORMAT);
    /* index puts a tensor in the wrong shard */
    write_text(sub, "model.safetensors.index.json",
               "{\"weight_map\":{\"a\":\"model-00002-of-00002.safetensors\","
               "\"c\":\"model-00002-of-00002.safetensors\"}}");
    assert_int_equal(open_path_quiet(sub, &st), TD_ERR_FORMAT);
    /* a missing shard */
    write_text(sub, "model.safetensors.index.json",
               "{\"weight_map\":{\"a\":\"model-00003-of-00002.safetensors\"}}");
    assert_int_equal(open_path_quiet(sub, &st), TD_ERR_NOT_FOUND);
    /* shard names may not leave the directory */
    write_text(sub, "model.safetensors.index.json",
               "{\"weight_map\":{\"a\":\"../single/model.safetensors\"}}");
    assert_int_equal(open_path_quiet(sub, &st), TD_ERR_FORMAT);
    write_text(sub, "model.safetensors.index.json", "{\"weight_map\":{\"a\":\"/etc/passwd\"}}");
    assert_int_equal(open_path_quiet(sub, &st), TD_ERR_FORMAT);
    write_text(sub, "model.safetensors.index.json", "{\"weight_map\":{\"a\":5}}");
    assert_int_equal(open_path_quiet(sub, &st), TD_ERR_FORMAT);
    /* no weight_map, empty weight_map, not JSON */
    write_text(sub, "model.safetensors.index.json", "{\"metadata\":{}}");
    assert_int_equal(open_path_quiet(sub, &st), TD_ERR_FORMAT);
    write_text(sub, "model.safetensors.index.json", "{\"weight_map\":{}}");
    assert_int_equal(open_path_quiet(sub, &st), TD_ERR_FORMAT);
    write_text(sub, "model.safetensors.index.json", "{\"weight_map\":");
    assert_int_equal(open_path_quiet(sub, &st), TD_ERR_FORMAT);
    /* the same tensor in two shards */
    file_buf s3 = st_build("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4);
    write_file(sub, "model-00002-of-00002.safetensors", s3.p, s3.n);
    write_text(sub, "model.safetensors.index.json",
               "{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
               "\"b\":\"model-00002-of-00002.safetensors\"}}");
    assert_int_equal(open_path_quiet(sub, &st), TD_ERR_FORMAT);
    /* a corrupt shard */
    write_file(sub, "model-00002-of-00002.safetensors", "\x02\0\0\0\0\0\0\0{x", 10);
    assert_int_equal(open_path_quiet(sub, &st), TD_ERR_FORMAT);
    assert_null(st);
    free(s1.p);
    free(s2.p);
    free(s3.p);
}

/* The error names the file and the tensor, on one line. */
static void test_error_message(void **state) {
    (void)state;
    file_buf f =
        st_build("{\"x.weight\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8);
    char path[] = "/tmp/td_test_st_log_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    fflush(stderr);
    int saved = dup(2);
    dup2(fd, 2);
    td_st *st = NULL;
    td_status s = td_st_open_buffer(f.p, f.n, "broken.safetensors", &st);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    assert_int_equal(s, TD_ERR_FORMAT);
    char buf[1024] = {0};
    assert_true(pread(fd, buf, sizeof buf - 1, 0) > 0);
    close(fd);
    unlink(path);
    assert_non_null(strstr(buf, "E td_st_open_buffer: broken.safetensors: tensor 'x.weight': "));
    assert_non_null(strstr(buf, "12"));
    assert_ptr_equal(strchr(buf, '\n'), buf + strlen(buf) - 1);
    free(f.p);
}

/* A file written by the PyPI safetensors package (an independent writer). */
static void test_python_writer(void **state) {
    (void)state;
    char script[512], out[512], cmd[1200];
    snprintf(script, sizeof script, "%s/w.py", g_dir);
    snprintf(out, sizeof out, "%s/py.safetensors", g_dir);
    FILE *fp = fopen(script, "w");
    assert_non_null(fp);
    fputs("import sys\n"
          "try:\n"
          "    import numpy as np\n"
          "    from safetensors.numpy import save_file\n"
          "except ImportError:\n"
          "    sys.exit(77)\n"
          "save_file({'model.embed.weight': np.arange(12, dtype=np.float32).reshape(3, 4),\n"
          "           'model.norm.weight': np.arange(5, dtype=np.float16),\n"
          "           'idx': np.array([7, -2], dtype=np.int64)}, sys.argv[1],\n"
          "          metadata={'format': 'np'})\n",
          fp);
    fclose(fp);
    snprintf(cmd, sizeof cmd, "python3 '%s' '%s' 2>/dev/null", script, out);
    int rc = system(cmd);
    if (rc == -1 || !WIFEXITED(rc) || WEXITSTATUS(rc) == 77 || WEXITSTATUS(rc) == 127) skip();
    assert_int_equal(WEXITSTATUS(rc), 0);
    td_st *st = NULL;
    assert_int_equal(td_st_open(out, &st), TD_OK);
    assert_int_equal(td_st_n_tensors(st), 3);
    const td_st_tensor *t = td_st_find(st, "model.embed.weight");
    assert_non_null(t);
    assert_int_equal(t->type, TD_TYPE_F32);
    assert_int_equal(t->n_dims, 2);
    assert_int_equal(t->shape[0], 3);
    assert_int_equal(t->shape[1], 4);
    assert_int_equal(t->nbytes, 48);
    for (int i = 0; i < 12; i++) {
        float v;
        memcpy(&v, (const uint8_t *)t->data + 4 * i, 4);
        assert_true(v == (float)i);
    }
    t = td_st_find(st, "model.norm.weight");
    assert_non_null(t);
    assert_int_equal(t->type, TD_TYPE_F16);
    assert_int_equal(t->nbytes, 10);
    uint16_t h;
    memcpy(&h, (const uint8_t *)t->data + 2 * 3, 2);
    assert_int_equal(h, 0x4200); /* 3.0 in IEEE half */
    t = td_st_find(st, "idx");
    assert_non_null(t);
    assert_int_equal(t->type, -1);
    assert_string_equal(t->dtype, "I64");
    int64_t iv[2];
    memcpy(iv, t->data, 16);
    assert_int_equal(iv[0], 7);
    assert_int_equal(iv[1], -2);
    td_st_close(st);
}

/* Every Hugging Face directory of tests/models (single and sharded): all
 * tensors of the manifest's dtype, embedding shaped [n_vocab, n_embd]. */
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
    int n_checked = 0, n_sharded = 0;
    json_array_foreach(json_object_get(man, "models"), i, m) {
        if (strcmp(json_string_value(json_object_get(m, "format")), "hf") != 0) continue;
        snprintf(path, sizeof path, "%s/%s", dir, json_string_value(json_object_get(m, "path")));
        json_t *cfg = json_object_get(m, "config");
        const char *want =
            json_string_value(json_object_get(json_object_get(m, "tensor_types"), "all"));
        td_st *st = NULL;
        if (td_st_open(path, &st) != TD_OK) fail_msg("%s does not open", path);
        json_int_t n_layer = json_integer_value(json_object_get(cfg, "n_layer"));
        assert_true(td_st_n_tensors(st) >= 2 + 9 * n_layer);
        for (int64_t k = 0; k < td_st_n_tensors(st); k++) {
            const td_st_tensor *t = td_st_tensor_at(st, k);
            if (want && strcmp(t->dtype, want) != 0)
                fail_msg("%s: %s is %s, want %s", path, t->name, t->dtype, want);
        }
        const td_st_tensor *t = td_st_find(st, "model.embed_tokens.weight");
        assert_non_null(t);
        assert_int_equal(t->n_dims, 2);
        assert_int_equal(t->shape[0], json_integer_value(json_object_get(cfg, "n_vocab")));
        assert_int_equal(t->shape[1], json_integer_value(json_object_get(cfg, "n_embd")));
        char name[128];
        snprintf(name, sizeof name, "model.layers.%lld.mlp.down_proj.weight",
                 (long long)(n_layer - 1));
        assert_non_null(td_st_find(st, name));
        n_sharded += json_is_true(json_object_get(m, "sharded"));
        td_st_close(st);
        n_checked++;
    }
    json_decref(man);
    assert_true(n_checked > 0);
    assert_true(n_sharded > 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid_buffer),        cmocka_unit_test(test_every_truncation),
        cmocka_unit_test(test_header_length),       cmocka_unit_test(test_corrupt_headers),
        cmocka_unit_test(test_file_and_single_dir), cmocka_unit_test(test_sharded_dir),
        cmocka_unit_test(test_error_message),       cmocka_unit_test(test_python_writer),
        cmocka_unit_test(test_test_models),
    };
    return cmocka_run_group_tests(tests, setup_dir, teardown_dir);
}
