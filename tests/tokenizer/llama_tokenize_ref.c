/* Reference tokenizer driver over llama.cpp's libllama (goldens only).
 * stdin: records [u32 len][u8 flags: 1 add_special, 2 parse_special][text]
 * stdout: one line per record: the token ids separated by spaces. */
#include "llama.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
static void quiet(enum ggml_log_level l, const char *t, void *u) {
    (void)l;
    (void)t;
    (void)u;
}
int main(int argc, char **argv) {
    if (argc < 2) return 2;
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    struct llama_model *m = llama_model_load_from_file(argv[1], mp);
    if (!m) {
        fprintf(stderr, "load failed\n");
        return 1;
    }
    const struct llama_vocab *v = llama_model_get_vocab(m);
    for (;;) {
        uint32_t len;
        uint8_t flags;
        if (fread(&len, 4, 1, stdin) != 1) break;
        if (fread(&flags, 1, 1, stdin) != 1) return 3;
        char *t = malloc(len + 1);
        if (len && fread(t, 1, len, stdin) != len) return 3;
        int cap = (int)len * 2 + 16;
        llama_token *ids = malloc(sizeof(*ids) * cap);
        int n = llama_tokenize(v, t, (int)len, ids, cap, flags & 1, (flags & 2) != 0);
        if (n < 0) {
            fprintf(stderr, "tokenize failed\n");
            return 4;
        }
        for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        printf("\n");
        free(t);
        free(ids);
    }
    llama_model_free(m);
    return 0;
}
