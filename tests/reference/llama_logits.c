/* llama.cpp's logits for every position of one token sequence, as a
 * test-time peer (tests/integration/test_kquant_llama_nightly.py): built by
 * that test against the libllama of a llama.cpp build (never part of
 * Tandem's build), run on the same GGUF file and token ids as `tandem eval`.
 *
 *   llama_logits MODEL.gguf TOKENS.i32 OUT.f32 [THREADS]
 *
 * TOKENS.i32: little-endian int32 token ids; OUT.f32: (n_tokens, n_vocab)
 * little-endian f32, the logits after each token (one batch, no BOS added:
 * the ids are used as given). */
#include <stdio.h>
#include <stdlib.h>

#include "llama.h"

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf TOKENS.i32 OUT.f32 [THREADS]\n", argv[0]);
        return 2;
    }
    int threads = argc > 4 ? atoi(argv[4]) : 2;
    FILE *f = fopen(argv[2], "rb");
    if (!f) {
        perror(argv[2]);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    long bytes = ftell(f);
    fseek(f, 0, SEEK_SET);
    int n = (int)(bytes / 4);
    llama_token *tok = malloc((size_t)n * sizeof *tok);
    if (!tok || n < 1 || fread(tok, 4, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "%s: cannot read %d token ids\n", argv[2], n);
        return 1;
    }
    fclose(f);

    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "%s: llama.cpp cannot load it\n", argv[1]);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)n;
    cp.n_batch = (uint32_t)n;
    cp.n_ubatch = (uint32_t)n;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "llama.cpp: no context of %d tokens\n", n);
        return 1;
    }
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    struct llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i] = tok[i];
        b.pos[i] = i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = 1;
    }
    b.n_tokens = n;
    if (llama_decode(ctx, b) != 0) {
        fprintf(stderr, "llama_decode failed\n");
        return 1;
    }
    FILE *o = fopen(argv[3], "wb");
    if (!o) {
        perror(argv[3]);
        return 1;
    }
    for (int i = 0; i < n; i++)
        if (fwrite(llama_get_logits_ith(ctx, i), sizeof(float), (size_t)n_vocab, o) !=
            (size_t)n_vocab) {
            perror(argv[3]);
            return 1;
        }
    if (fclose(o) != 0) {
        perror(argv[3]);
        return 1;
    }
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    free(tok);
    return 0;
}
