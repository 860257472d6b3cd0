/* Tokenizer from GGUF tokenizer.ggml.* metadata. */
#include <string.h>

#include "tokenizer-impl.h"

/* Pre-tokenizer regexes by tokenizer.ggml.pre. Several regexes are applied
 * in sequence, each splitting the pieces of the previous one, keeping both
 * the matches and the text between them (HF's "Isolated" Split). */
#define RE_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
#define RE_LLAMA3                                                                                  \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"     \
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define RE_QWEN2                                                                                   \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"     \
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

typedef struct {
    const char *names[6];
    const char *regex[4];
    bool ignore_merges;
    bool add_bos;
} pre_type;

static const pre_type pre_types[] = {
    {{"gpt2", "gpt-2", "phi-2", "mpt", "olmo"}, {RE_GPT2}, false, false},
    {{"llama3", "llama-v3", "llama-bpe"}, {RE_LLAMA3}, true, true},
    {{"dbrx", "smaug-bpe"}, {RE_LLAMA3}, false, false},
    {{"qwen2", "stablelm2"}, {RE_QWEN2}, false, false},
    /* digits are split one by one before the GPT-2 regex runs */
    {{"smollm", "starcoder", "refact", "command-r", "codeshell"},
     {"\\p{N}", RE_GPT2},
     false,
     false},
    {{"default"},
     {"[\\p{P}\\$\\+<=>\\^~\\|]+", RE_GPT2, "\\p{N}+", "[0-9][0-9][0-9]"},
     false,
     false},
};

static const pre_type *find_pre(const char *name) {
    for (size_t i = 0; i < TD_ARRAY_SIZE(pre_types); i++)
        for (size_t k = 0; k < TD_ARRAY_SIZE(pre_types[i].names) && pre_types[i].names[k]; k++)
            if (strcmp(pre_types[i].names[k], name) == 0) return &pre_types[i];
    return NULL;
}

/* A special token's id: -1 (or its u32 form) means "none"; any other id
 * outside the vocabulary is an error naming the key (a BOS out of range
 * would otherwise leave the model generating without its BOS). */
static td_status get_id(const td_gguf *g, const char *key, int32_t n_vocab, int32_t *id_p) {
    int64_t v;
    td_status st = td_gguf_get_i64(g, key, &v);
    if (st == TD_ERR_NOT_FOUND) return TD_OK;
    if (st) {
        TD_LOG_ERROR("%s: %s has a non-integer type", td_gguf_path(g), key);
        return st;
    }
    if (v == -1 || v == 0xFFFFFFFFll) {
        *id_p = -1;
        return TD_OK;
    }
    if (v < 0 || v >= n_vocab) {
        TD_LOG_ERROR("%s: %s = %lld is outside the vocabulary (%d tokens)", td_gguf_path(g), key,
                     (long long)v, (int)n_vocab);
        return TD_ERR_FORMAT;
    }
    *id_p = (int32_t)v;
    return TD_OK;
}

static td_status get_flag(const td_gguf *g, const char *key, bool *v_p) {
    td_status st = td_gguf_get_bool(g, key, v_p);
    if (st == TD_ERR_NOT_FOUND) return TD_OK;
    if (st) TD_LOG_ERROR("%s: %s is not a bool", td_gguf_path(g), key);
    return st;
}

static int64_t read_int(const void *data, td_gguf_type t, uint64_t i) {
    const unsigned char *p = data;
    switch (t) {
    case TD_GGUF_INT8: return (int8_t)p[i];
    case TD_GGUF_UINT8: return p[i];
    case TD_GGUF_INT16: {
        int16_t v;
        memcpy(&v, p + 2 * i, 2);
        return v;
    }
    case TD_GGUF_UINT16: {
        uint16_t v;
        memcpy(&v, p + 2 * i, 2);
        return v;
    }
    case TD_GGUF_INT32: {
        int32_t v;
        memcpy(&v, p + 4 * i, 4);
        return v;
    }
    case TD_GGUF_UINT32: {
        uint32_t v;
        memcpy(&v, p + 4 * i, 4);
        return v;
    }
    case TD_GGUF_INT64:
    case TD_GGUF_UINT64: {
        int64_t v;
        memcpy(&v, p + 8 * i, 8);
        return v;
    }
    default: return 0;
    }
}

static bool is_int_type(td_gguf_type t) {
    return t == TD_GGUF_INT8 || t == TD_GGUF_UINT8 || t == TD_GGUF_INT16 || t == TD_GGUF_UINT16 ||
           t == TD_GGUF_INT32 || t == TD_GGUF_UINT32 || t == TD_GGUF_INT64 || t == TD_GGUF_UINT64;
}

td_status td_tokenizer_from_gguf(const td_gguf *g, td_tokenizer **tok_p) {
    if (!g || !tok_p) return TD_ERR_INVALID;
    const char *path = td_gguf_path(g);
    if (!path) path = "(gguf)";
    td_status st;
    const char *model = NULL, *pre = NULL;
    td_gguf_type et;
    uint64_t n = 0;
    const void *data;

    td_tokenizer *tok = td_tok_alloc();
    if (!tok) return TD_ERR_NOMEM;

    st = td_gguf_get_str(g, "tokenizer.ggml.model", &model);
    if (st) {
        TD_LOG_ERROR("%s: tokenizer.ggml.model %s", path,
                     st == TD_ERR_NOT_FOUND ? "missing" : "is not a string");
        goto fail;
    }
    if (strcmp(model, "gpt2") == 0) {
        tok->model = TD_TOK_MODEL_BPE;
        tok->byte_level = true;
    } else if (strcmp(model, "llama") == 0) {
        tok->model = TD_TOK_MODEL_SPM;
        tok->escape_whitespace = true;
        tok->add_bos = true;
        tok->bos = 1;
        tok->eos = 2;
        tok->unk = 0;
    } else {
        TD_LOG_ERROR("%s: unsupported tokenizer.ggml.model '%s' (supported: gpt2, llama)", path,
                     model);
        st = TD_ERR_UNSUPPORTED;
        goto fail;
    }

    st = td_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n, &data);
    if (st || et != TD_GGUF_STRING || n == 0 || n > INT32_MAX) {
        TD_LOG_ERROR("%s: tokenizer.ggml.tokens missing, empty, too long or not a string array",
                     path);
        st = st ? st : TD_ERR_FORMAT;
        goto fail;
    }
    if ((st = td_tok_set_n_vocab(tok, (int32_t)n))) goto fail;

    const void *scores = NULL, *types = NULL;
    td_gguf_type types_t = TD_GGUF_INT32;
    uint64_t ns = 0;
    st = td_gguf_get_arr(g, "tokenizer.ggml.scores", &et, &ns, &scores);
    if (st == TD_OK && (et != TD_GGUF_FLOAT32 || ns != n)) {
        TD_LOG_ERROR("%s: tokenizer.ggml.scores is not a float32 array of %llu elements", path,
                     (unsigned long long)n);
        st = TD_ERR_FORMAT;
        goto fail;
    }
    if (st && st != TD_ERR_NOT_FOUND) goto fail;
    st = td_gguf_get_arr(g, "tokenizer.ggml.token_type", &types_t, &ns, &types);
    if (st == TD_OK && (!is_int_type(types_t) || ns != n)) {
        TD_LOG_ERROR("%s: tokenizer.ggml.token_type is not an integer array of %llu elements", path,
                     (unsigned long long)n);
        st = TD_ERR_FORMAT;
        goto fail;
    }
    if (st && st != TD_ERR_NOT_FOUND) goto fail;

    for (uint64_t i = 0; i < n; i++) {
        const char *s;
        size_t len;
        if ((st = td_gguf_get_arr_str(g, "tokenizer.ggml.tokens", i, &s, &len))) {
            TD_LOG_ERROR("%s: tokenizer.ggml.tokens[%llu] unreadable", path, (unsigned long long)i);
            goto fail;
        }
        float score = 0;
        if (scores) memcpy(&score, (const char *)scores + 4 * i, 4);
        int type = types ? (int)read_int(types, types_t, i) : TD_TOKT_NORMAL;
        if ((st = td_tok_set_token(tok, (int32_t)i, s, len, score, type))) goto fail;
    }
    if ((st = td_tok_build_vocab(tok))) goto fail;

    if (tok->model == TD_TOK_MODEL_BPE) {
        st = td_gguf_get_str(g, "tokenizer.ggml.pre", &pre);
        if (st == TD_ERR_NOT_FOUND) {
            TD_LOG_WARN("%s: tokenizer.ggml.pre missing, using 'default'", path);
            pre = "default";
        } else if (st) {
            TD_LOG_ERROR("%s: tokenizer.ggml.pre is not a string", path);
            goto fail;
        }
        const pre_type *pt = find_pre(pre);
        if (!pt) {
            TD_LOG_WARN("%s: unknown pre-tokenizer type '%s', using the GPT-2 regex", path, pre);
            pt = find_pre("gpt2");
        }
        for (size_t k = 0; k < TD_ARRAY_SIZE(pt->regex) && pt->regex[k]; k++)
            if ((st = td_tok_add_pretok(tok, pt->regex[k], TD_SPLIT_ISOLATED, false))) goto fail;
        tok->ignore_merges = pt->ignore_merges;
        tok->add_bos = pt->add_bos;

        uint64_t nm = 0;
        st = td_gguf_get_arr(g, "tokenizer.ggml.merges", &et, &nm, &data);
        if (st || et != TD_GGUF_STRING) {
            TD_LOG_ERROR("%s: tokenizer.ggml.merges missing or not a string array", path);
            st = st ? st : TD_ERR_FORMAT;
            goto fail;
        }
        if ((st = td_tok_reserve_merges(tok, nm < ((uint64_t)1 << 28) ? (size_t)nm : 0))) goto fail;
        uint64_t skipped = 0;
        for (uint64_t i = 0; i < nm; i++) {
            const char *s;
            size_t len;
            if ((st = td_gguf_get_arr_str(g, "tokenizer.ggml.merges", i, &s, &len))) {
                TD_LOG_ERROR("%s: tokenizer.ggml.merges[%llu] unreadable", path,
                             (unsigned long long)i);
                goto fail;
            }
            /* "left right": the separator is the first space after the first byte */
            const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
            if (!sp) {
                TD_LOG_ERROR("%s: tokenizer.ggml.merges[%llu] has no separating space", path,
                             (unsigned long long)i);
                st = TD_ERR_FORMAT;
                goto fail;
            }
            bool sk;
            size_t al = (size_t)(sp - s);
            if ((st = td_tok_add_merge(tok, s, al, sp + 1, len - al - 1, &sk))) goto fail;
            skipped += sk;
        }
        if (skipped)
            TD_LOG_WARN("%s: %llu merges name tokens that are not in the vocabulary", path,
                        (unsigned long long)skipped);
        snprintf(tok->kind, sizeof(tok->kind), "gpt2/%s", pre);
    } else {
        tok->byte_fallback = true;
        snprintf(tok->kind, sizeof(tok->kind), "llama/spm");
    }

    bool asp = tok->model == TD_TOK_MODEL_SPM;
    if ((st = get_id(g, "tokenizer.ggml.bos_token_id", tok->n_vocab, &tok->bos)) ||
        (st = get_id(g, "tokenizer.ggml.eos_token_id", tok->n_vocab, &tok->eos)) ||
        (st = get_id(g, "tokenizer.ggml.unknown_token_id", tok->n_vocab, &tok->unk)) ||
        (st = get_id(g, "tokenizer.ggml.padding_token_id", tok->n_vocab, &tok->pad)) ||
        (st = get_id(g, "tokenizer.ggml.eot_token_id", tok->n_vocab, &tok->eot)) ||
        (st = get_id(g, "tokenizer.ggml.eom_token_id", tok->n_vocab, &tok->eom)) ||
        (st = get_flag(g, "tokenizer.ggml.add_bos_token", &tok->add_bos)) ||
        (st = get_flag(g, "tokenizer.ggml.add_eos_token", &tok->add_eos)) ||
        (st = get_flag(g, "tokenizer.ggml.add_space_prefix", &asp)))
        goto fail;
    if (tok->model == TD_TOK_MODEL_SPM) {
        tok->prefix = asp ? TD_PREFIX_FIRST_OR_AFTER_SPECIAL : TD_PREFIX_NONE;
        tok->strip_leading_space_on_decode = asp;
    }

    const char *tmpl = NULL;
    st = td_gguf_get_str(g, "tokenizer.chat_template", &tmpl);
    if (st == TD_OK) {
        tok->chat_template = strdup(tmpl);
        if (!tok->chat_template) {
            st = TD_ERR_NOMEM;
            goto fail;
        }
    } else if (st != TD_ERR_NOT_FOUND) {
        TD_LOG_WARN("%s: tokenizer.chat_template is not a string, ignored", path);
    }
    /* named templates: tokenizer.chat_template.NAME (llama.cpp's converter
     * writes tool_use, rag ... this way) */
    static const char prefix[] = "tokenizer.chat_template.";
    for (int64_t i = 0; i < td_gguf_n_kv(g); i++) {
        const char *key = td_gguf_key_name(g, i);
        if (!key || strncmp(key, prefix, sizeof prefix - 1) != 0 || !key[sizeof prefix - 1])
            continue;
        const char *text = NULL;
        if (td_gguf_get_str(g, key, &text) != TD_OK) {
            TD_LOG_WARN("%s: %s is not a string, ignored", path, key);
            continue;
        }
        if ((st = td_tok_add_named_template(tok, key + sizeof prefix - 1, text))) goto fail;
    }

    if ((st = td_tok_finish(tok, path))) goto fail;
    *tok_p = tok;
    return TD_OK;
fail:
    if (st == TD_ERR_NOMEM) TD_LOG_ERROR("%s: out of memory building the tokenizer", path);
    td_tokenizer_free(tok);
    return st;
}
