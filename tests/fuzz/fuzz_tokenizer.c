/* libFuzzer target for the tokenizers and chat templates.
 *
 * Built once: the default model's GGUF tokenizer (TANDEM_FUZZ_MODEL, TANDEM_MODEL or the
 * default model path) when present, the committed SentencePiece test
 * vocabulary (tests/tokenizer/vocabs/spm-tiny.gguf) when found, and always a
 * small byte-level BPE vocabulary constructed here. Each input picks a
 * tokenizer and flags with its first byte and is then encoded, decoded and
 * streamed through the detokenizer; the same bytes are also read as token
 * ids (mostly out of range) and as chat messages. Inputs whose first byte
 * is 0xF0..0xFF are tokenizer.json (+ NUL + tokenizer_config.json) text
 * instead. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/format/gguf.h"
#include "common/tokenizer/chat.h"
#include "common/tokenizer/tokenizer-impl.h"
#include "common/tokenizer/tokenizer.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static td_tokenizer *g_tok[3];
static int g_ntok;

static td_tokenizer *from_gguf_path(const char *path) {
    td_gguf *g = NULL;
    td_tokenizer *tok = NULL;
    if (td_gguf_open(path, &g) != TD_OK) return NULL;
    if (td_tokenizer_from_gguf(g, &tok) != TD_OK) tok = NULL;
    td_gguf_close(g);
    return tok;
}

/* A small GPT-2-style vocabulary: the 256 byte characters, a few merges,
 * two control tokens, smollm-style digit splitting. */
static td_tokenizer *build_small(void) {
    static const char *merges[][2] = {
        {"\xC4\xA0", "t"}, {"h", "e"},       {"\xC4\xA0t", "he"},      {"i", "n"},
        {"\xC4\xA0", "a"}, {"e", "r"},       {"\xC4\xA0", "\xC4\xA0"}, {"o", "n"},
        {"in", "g"},       {"\xC3", "\xA9"},
    };
    static const char *specials[] = {"<|im_start|>", "<|im_end|>", "<|endoftext|>"};
    td_tokenizer *tok = td_tok_alloc();
    if (!tok) return NULL;
    int32_t n = 256 + (int32_t)TD_ARRAY_SIZE(merges) + (int32_t)TD_ARRAY_SIZE(specials);
    if (td_tok_set_n_vocab(tok, n)) goto fail;
    int32_t id = 0;
    for (int32_t k = 0; k < (int32_t)TD_ARRAY_SIZE(specials); k++, id++)
        if (td_tok_set_token(tok, id, specials[k], strlen(specials[k]), 0, TD_TOKT_CONTROL))
            goto fail;
    for (int b = 0; b < 256; b++, id++) {
        char u[4];
        int l = td_utf8_put(td_byte_to_cp((uint8_t)b), u);
        if (td_tok_set_token(tok, id, u, (size_t)l, 0, TD_TOKT_NORMAL)) goto fail;
    }
    for (size_t k = 0; k < TD_ARRAY_SIZE(merges); k++, id++) {
        char m[16];
        size_t la = strlen(merges[k][0]), lb = strlen(merges[k][1]);
        memcpy(m, merges[k][0], la);
        memcpy(m + la, merges[k][1], lb);
        if (td_tok_set_token(tok, id, m, la + lb, 0, TD_TOKT_NORMAL)) goto fail;
    }
    if (td_tok_build_vocab(tok)) goto fail;
    for (size_t k = 0; k < TD_ARRAY_SIZE(merges); k++) {
        bool skipped;
        if (td_tok_add_merge(tok, merges[k][0], strlen(merges[k][0]), merges[k][1],
                             strlen(merges[k][1]), &skipped))
            goto fail;
    }
    tok->model = TD_TOK_MODEL_BPE;
    tok->byte_level = true;
    if (td_tok_add_pretok(tok, "\\p{N}", TD_SPLIT_ISOLATED, false) ||
        td_tok_add_pretok(tok,
                          "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|"
                          "\\s+(?!\\S)|\\s+",
                          TD_SPLIT_ISOLATED, false))
        goto fail;
    tok->eos = 1;
    snprintf(tok->kind, sizeof(tok->kind), "fuzz/bytelevel");
    if (td_tok_finish(tok, "fuzz")) goto fail;
    return tok;
fail:
    td_tokenizer_free(tok);
    return NULL;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    td_log_set_level(TD_LOG_NONE);
    const char *model = getenv("TANDEM_FUZZ_MODEL");
    if (!model || !model[0]) model = getenv("TANDEM_MODEL");
    char path[4096];
    if (!model || !model[0]) {
        const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
        if (xdg && xdg[0])
            snprintf(path, sizeof(path), "%s/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf", xdg);
        else
            snprintf(path, sizeof(path), "%s/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf",
                     home ? home : ".");
        model = path;
    }
    td_tokenizer *t = from_gguf_path(model);
    if (t) g_tok[g_ntok++] = t;
    /* the committed SentencePiece vocabulary, under TANDEM_SOURCE_DIR or
     * next to this file (__FILE__ is absolute in CMake builds) */
    char spm[4096];
    const char *src = getenv("TANDEM_SOURCE_DIR");
    if (src) {
        snprintf(spm, sizeof(spm), "%s/tests/tokenizer/vocabs/spm-tiny.gguf", src);
    } else {
        snprintf(spm, sizeof(spm), "%s", __FILE__);
        char *p = strstr(spm, "tests/fuzz/");
        if (p) strcpy(p, "tests/tokenizer/vocabs/spm-tiny.gguf");
    }
    if ((t = from_gguf_path(spm))) g_tok[g_ntok++] = t;
    if ((t = build_small())) g_tok[g_ntok++] = t;
    if (g_ntok == 0) abort();
    return 0;
}

static volatile uint8_t g_sink;

/* The input as tokenizer.json, optionally followed by a NUL and a
 * tokenizer_config.json; a tokenizer that loads then encodes and decodes. */
static void fuzz_hf_json(const char *s, size_t n) {
    const char *nul = memchr(s, 0, n);
    size_t tl = nul ? (size_t)(nul - s) : n;
    td_tokenizer *tok = NULL;
    if (td_tok_from_hf_json(s, tl, nul ? nul + 1 : NULL, nul ? n - tl - 1 : 0, "fuzz.json", &tok) !=
        TD_OK)
        return;
    static const char sample[] = "<s>Hello  w\xC3\xB6rld 123\t\xE4\xB8\xAD\xF0\x9F\x99\x82 "
                                 "\xFF\x80<|im_end|>e\xCC\x81";
    int32_t *ids = NULL;
    size_t nt = 0;
    if (td_tokenizer_encode(tok, sample, sizeof(sample) - 1, true, true, &ids, &nt) == TD_OK) {
        for (size_t i = 0; i < nt; i++)
            if (ids[i] < 0 || ids[i] >= td_tokenizer_n_vocab(tok)) abort();
        char *back = NULL;
        size_t bl = 0;
        if (td_tokenizer_decode(tok, ids, nt, false, &back, &bl) != TD_OK) abort();
        free(back);
        free(ids);
    }
    td_tokenizer_free(tok);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    uint8_t sel = data[0];
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    if ((sel & 0xF0) == 0xF0) {
        fuzz_hf_json(text, len);
        return 0;
    }
    const td_tokenizer *tok = g_tok[(sel & 3) % g_ntok];
    bool add_special = sel & 4, parse_special = sel & 8, skip_special = sel & 16;

    int32_t *ids = NULL;
    size_t n = 0;
    if (td_tokenizer_encode(tok, text, len, add_special, parse_special, &ids, &n) == TD_OK) {
        for (size_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= td_tokenizer_n_vocab(tok)) abort();
        char *back = NULL;
        size_t bl = 0;
        if (td_tokenizer_decode(tok, ids, n, skip_special, &back, &bl) != TD_OK) abort();
        if (bl > 0) g_sink ^= (uint8_t)back[bl - 1];
        free(back);
        td_detok d;
        td_detok_init(&d, skip_special);
        char out[64];
        for (size_t i = 0; i < n; i++)
            g_sink ^= (uint8_t)td_detok_push(tok, &d, ids[i], out, sizeof(out));
        g_sink ^= (uint8_t)td_detok_flush(&d, out, sizeof(out));
        free(ids);
    }

    /* the same bytes as token ids */
    size_t nid = len / 4;
    if (nid > 0) {
        int32_t *raw = malloc(nid * sizeof(int32_t));
        if (raw) {
            memcpy(raw, text, nid * sizeof(int32_t));
            char *s = NULL;
            size_t sl = 0;
            if (td_tokenizer_decode(tok, raw, nid, skip_special, &s, &sl) == TD_OK) free(s);
            td_detok d;
            td_detok_init(&d, skip_special);
            char out[8]; /* deliberately small: pieces are cut, never overflow */
            for (size_t i = 0; i < nid; i++)
                g_sink ^= (uint8_t)td_detok_push(tok, &d, raw[i], out, sizeof(out));
            g_sink ^= (uint8_t)td_detok_flush(&d, out, sizeof(out));
            free(raw);
        }
    }

    /* chat: the text, NUL-terminated, as template text and as messages */
    char *z = malloc(len + 1);
    if (z) {
        memcpy(z, text, len);
        z[len] = 0;
        /* as template text: compiled (fuzz_template renders templates) */
        td_chat *tc = NULL;
        char err[256];
        if (td_chat_compile(z, "fuzz", &tc, err, sizeof err) == TD_OK) td_chat_free(tc);
        static const char *roles[] = {"system", "user", "assistant", "tool"};
        td_chat_msg msgs[4];
        size_t nm = 0;
        char *c = z;
        for (; nm < 4; nm++) {
            msgs[nm].role = roles[(sel >> (2 * nm)) & 3];
            msgs[nm].content = c;
            char *nl = strchr(c, '\n');
            if (!nl) {
                nm++;
                break;
            }
            *nl = 0;
            c = nl + 1;
        }
        char *out = NULL;
        static const char *names[] = {"chatml", "smollm2", "llama3", "llama2", "mistral", "zephyr"};
        td_chat *t = NULL;
        if (td_chat_load(names[(sel >> 5) % 6], &t, err, sizeof err) == TD_OK) {
            if (td_chat_apply(t, msgs, nm, sel & 1, "<s>", "</s>", &out, err, sizeof err) == TD_OK)
                free(out);
            td_chat_free(t);
        }
        free(z);
    }
    return 0;
}
