/* libFuzzer target for the safetensors header parser: parse, then touch the
 * name, dtype and first/last data byte of every tensor, so that ASan sees any
 * pointer or length that escapes the input. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/format/safetensors.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static volatile uint8_t g_sink;

static void touch(const void *p, size_t n) {
    if (n == 0) return;
    g_sink ^= ((const uint8_t *)p)[0];
    g_sink ^= ((const uint8_t *)p)[n - 1];
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    td_log_set_level(TD_LOG_NONE);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    td_st *st = NULL;
    if (td_st_open_buffer(data, size, "fuzz.safetensors", &st) != TD_OK) return 0;
    for (int64_t i = 0; i < td_st_n_tensors(st); i++) {
        const td_st_tensor *t = td_st_tensor_at(st, i);
        touch(t->name, strlen(t->name) + 1);
        touch(t->dtype, strlen(t->dtype) + 1);
        if (td_st_find(st, t->name) != t) __builtin_trap();
        if (t->n_dims < 0 || t->n_dims > 4) __builtin_trap();
        if ((const uint8_t *)t->data < data || (const uint8_t *)t->data + t->nbytes > data + size)
            __builtin_trap();
        touch(t->data, t->nbytes);
    }
    td_st_close(st);
    return 0;
}
