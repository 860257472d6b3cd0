/* libFuzzer target for the GGUF reader: parse, then touch everything the
 * parser hands out (every key and value, every string of every array, the
 * first and last byte of every tensor) so that ASan sees any pointer or
 * length that escapes the input. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/format/gguf.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static volatile uint8_t g_sink;

static void touch(const void *p, size_t n) {
    if (n == 0) return;
    g_sink ^= ((const uint8_t *)p)[0];
    g_sink ^= ((const uint8_t *)p)[n - 1];
}

static size_t elem_size(td_gguf_type t) {
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

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    td_log_set_level(TD_LOG_NONE);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    td_gguf *g = NULL;
    if (td_gguf_open_buffer(data, size, "fuzz.gguf", &g) != TD_OK) return 0;
    (void)td_gguf_version(g);
    (void)td_gguf_alignment(g);
    for (int64_t i = 0; i < td_gguf_n_kv(g); i++) {
        const char *key = td_gguf_key_name(g, i);
        touch(key, strlen(key) + 1);
        if (td_gguf_find_key(g, key) != i) __builtin_trap();
        uint32_t u;
        int64_t v;
        float f;
        bool b;
        const char *s;
        size_t len;
        (void)td_gguf_get_u32(g, key, &u);
        (void)td_gguf_get_i64(g, key, &v);
        (void)td_gguf_get_f32(g, key, &f);
        (void)td_gguf_get_bool(g, key, &b);
        if (td_gguf_get_str_len(g, key, &s, &len) == TD_OK) touch(s, len + 1);
        td_gguf_type et;
        uint64_t n;
        const void *arr;
        if (td_gguf_kv_type(g, i) == TD_GGUF_ARRAY &&
            td_gguf_get_arr(g, key, &et, &n, &arr) == TD_OK) {
            if (et == TD_GGUF_STRING) {
                for (uint64_t k = 0; k < n; k++) {
                    if (td_gguf_get_arr_str(g, key, k, &s, &len) != TD_OK) __builtin_trap();
                    touch(s, len + 1);
                }
            } else if (n) {
                touch(arr, (size_t)n * elem_size(et));
            }
        }
    }
    for (int64_t i = 0; i < td_gguf_n_tensors(g); i++) {
        const td_gguf_tensor *t = td_gguf_tensor_at(g, i);
        touch(t->name, strlen(t->name) + 1);
        if (td_gguf_find_tensor(g, t->name) != t) __builtin_trap();
        if (t->n_dims < 1 || t->n_dims > 4 || t->nbytes == 0) __builtin_trap();
        if ((const uint8_t *)t->data < data || (const uint8_t *)t->data + t->nbytes > data + size)
            __builtin_trap();
        touch(t->data, t->nbytes);
    }
    td_gguf_close(g);
    return 0;
}
