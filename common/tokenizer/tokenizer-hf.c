/* Tokenizer from a Hugging Face directory: tokenizer.json (BPE model,
 * added tokens, normalizer, pre-tokenizer, post-processor, decoder) and
 * tokenizer_config.json (chat template, bos/eos, add_bos/add_eos). */
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "tokenizer-impl.h"

#define MAX_VOCAB (1 << 24)

#define RE_BYTELEVEL                                                                               \
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"

static const char *jstr(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

static bool jbool(json_t *o, const char *key, bool dflt) {
    json_t *v = json_object_get(o, key);
    return json_is_boolean(v) ? json_is_true(v) : dflt;
}

/* Escapes a literal string for PCRE2. */
static char *regex_escape(const char *s) {
    size_t n = strlen(s);
    char *o = malloc(2 * n + 1);
    if (!o) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x80 &&
            !((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')))
            o[k++] = '\\';
        o[k++] = (char)c;
    }
    o[k] = 0;
    return o;
}

static td_status parse_split(td_tokenizer *tok, json_t *p, const char *path) {
    json_t *pat = json_object_get(p, "pattern");
    const char *re = json_is_object(pat) ? jstr(pat, "Regex") : NULL;
    const char *lit = json_is_object(pat) ? jstr(pat, "String") : NULL;
    const char *beh = jstr(p, "behavior");
    td_split_behavior b;
    if (!beh || strcmp(beh, "Isolated") == 0)
        b = TD_SPLIT_ISOLATED;
    else if (strcmp(beh, "Removed") == 0)
        b = TD_SPLIT_REMOVED;
    else if (strcmp(beh, "MergedWithPrevious") == 0)
        b = TD_SPLIT_MERGED_PREV;
    else if (strcmp(beh, "MergedWithNext") == 0)
        b = TD_SPLIT_MERGED_NEXT;
    else if (strcmp(beh, "Contiguous") == 0)
        b = TD_SPLIT_CONTIGUOUS;
    else {
        TD_LOG_ERROR("%s: unsupported Split behavior '%s'", path, beh);
        return TD_ERR_UNSUPPORTED;
    }
    if (!re && !lit) {
        TD_LOG_ERROR("%s: Split pre-tokenizer without a Regex or String pattern", path);
        return TD_ERR_FORMAT;
    }
    bool invert = jbool(p, "invert", false);
    if (re) return td_tok_add_pretok(tok, re, b, invert);
    char *esc = regex_escape(lit);
    if (!esc) return TD_ERR_NOMEM;
    td_status st = td_tok_add_pretok(tok, esc, b, invert);
    free(esc);
    return st;
}

static td_status parse_metaspace(td_tokenizer *tok, json_t *p, const char *path) {
    const char *rep = jstr(p, "replacement");
    if (rep && strcmp(rep, "\xE2\x96\x81") != 0) {
        TD_LOG_ERROR("%s: Metaspace replacement '%s' unsupported (only U+2581)", path, rep);
        return TD_ERR_UNSUPPORTED;
    }
    tok->escape_whitespace = true;
    const char *scheme = jstr(p, "prepend_scheme");
    bool prefix = jbool(p, "add_prefix_space", true);
    if (scheme) {
        if (strcmp(scheme, "always") == 0)
            tok->prefix = TD_PREFIX_ALWAYS;
        else if (strcmp(scheme, "first") == 0)
            tok->prefix = TD_PREFIX_FIRST;
        else if (strcmp(scheme, "never") == 0)
            tok->prefix = TD_PREFIX_NONE;
        else {
            TD_LOG_ERROR("%s: Metaspace prepend_scheme '%s' unsupported", path, scheme);
            return TD_ERR_UNSUPPORTED;
        }
    } else {
        tok->prefix = prefix ? TD_PREFIX_ALWAYS : TD_PREFIX_NONE;
    }
    tok->prefix_unless_space = true;
    if (jbool(p, "split", true))
        return td_tok_add_pretok(tok, "\xE2\x96\x81", TD_SPLIT_MERGED_NEXT, false);
    return TD_OK;
}

static td_status parse_pretok(td_tokenizer *tok, json_t *p, const char *path) {
    if (!p || json_is_null(p)) return TD_OK;
    const char *type = jstr(p, "type");
    if (!type) {
        TD_LOG_ERROR("%s: pre_tokenizer without a type", path);
        return TD_ERR_FORMAT;
    }
    if (strcmp(type, "Sequence") == 0) {
        json_t *arr = json_object_get(p, "pretokenizers");
        if (!json_is_array(arr)) {
            TD_LOG_ERROR("%s: Sequence pre_tokenizer without a pretokenizers array", path);
            return TD_ERR_FORMAT;
        }
        size_t i;
        json_t *e;
        json_array_foreach(arr, i, e) {
            td_status st = parse_pretok(tok, e, path);
            if (st) return st;
        }
        return TD_OK;
    }
    if (strcmp(type, "Split") == 0) return parse_split(tok, p, path);
    if (strcmp(type, "ByteLevel") == 0) {
        tok->byte_level = true;
        td_status st;
        /* a space before every piece that lacks one, then the GPT-2 regex */
        if (jbool(p, "add_prefix_space", false) && (st = td_tok_add_prefix_step(tok))) return st;
        if (jbool(p, "use_regex", true))
            return td_tok_add_pretok(tok, RE_BYTELEVEL, TD_SPLIT_ISOLATED, false);
        return TD_OK;
    }
    if (strcmp(type, "Digits") == 0)
        return td_tok_add_pretok(tok, jbool(p, "individual_digits", false) ? "\\p{N}" : "\\p{N}+",
                                 TD_SPLIT_ISOLATED, false);
    if (strcmp(type, "Metaspace") == 0) {
        /* applied to whole text fragments before any other step */
        if (tok->n_pretok > 0) {
            TD_LOG_ERROR("%s: Metaspace after another pre-tokenizer is unsupported", path);
            return TD_ERR_UNSUPPORTED;
        }
        return parse_metaspace(tok, p, path);
    }
    if (strcmp(type, "WhitespaceSplit") == 0)
        return td_tok_add_pretok(tok, "\\s+", TD_SPLIT_REMOVED, false);
    if (strcmp(type, "Whitespace") == 0) /* keep the matches, drop the rest */
        return td_tok_add_pretok(tok, "\\w+|[^\\w\\s]+", TD_SPLIT_REMOVED, true);
    TD_LOG_ERROR("%s: unsupported pre_tokenizer type '%s'", path, type);
    return TD_ERR_UNSUPPORTED;
}

static td_status parse_normalizer(td_tokenizer *tok, json_t *p, const char *path) {
    if (!p || json_is_null(p)) return TD_OK;
    const char *type = jstr(p, "type");
    if (!type) {
        TD_LOG_ERROR("%s: normalizer without a type", path);
        return TD_ERR_FORMAT;
    }
    if (strcmp(type, "Sequence") == 0) {
        json_t *arr = json_object_get(p, "normalizers");
        if (!json_is_array(arr)) {
            TD_LOG_ERROR("%s: Sequence normalizer without a normalizers array", path);
            return TD_ERR_FORMAT;
        }
        size_t i;
        json_t *e;
        json_array_foreach(arr, i, e) {
            td_status st = parse_normalizer(tok, e, path);
            if (st) return st;
        }
        return TD_OK;
    }
    if (strcmp(type, "Prepend") == 0) {
        const char *s = jstr(p, "prepend");
        if (!s || strcmp(s, "\xE2\x96\x81") != 0) {
            TD_LOG_ERROR("%s: Prepend normalizer supports only U+2581", path);
            return TD_ERR_UNSUPPORTED;
        }
        /* Prepend runs before Replace(' ' -> U+2581) in Llama-2-style files */
        tok->prefix = TD_PREFIX_ALWAYS;
        tok->prefix_unless_space = false;
        tok->escape_whitespace = true;
        return TD_OK;
    }
    if (strcmp(type, "Replace") == 0) {
        json_t *pat = json_object_get(p, "pattern");
        const char *from = json_is_object(pat) ? jstr(pat, "String") : NULL;
        const char *to = jstr(p, "content");
        if (from && to && strcmp(from, " ") == 0 && strcmp(to, "\xE2\x96\x81") == 0) {
            tok->escape_whitespace = true;
            return TD_OK;
        }
        TD_LOG_ERROR("%s: Replace normalizer supported only for ' ' -> U+2581", path);
        return TD_ERR_UNSUPPORTED;
    }
    if (strcmp(type, "NFC") == 0) {
        tok->nfc = true;
        return TD_OK;
    }
    TD_LOG_ERROR("%s: unsupported normalizer type '%s'", path, type);
    return TD_ERR_UNSUPPORTED;
}

static void parse_decoder(td_tokenizer *tok, json_t *p) {
    if (!p || json_is_null(p)) return;
    const char *type = jstr(p, "type");
    if (!type) return;
    if (strcmp(type, "Sequence") == 0) {
        size_t i;
        json_t *e;
        json_array_foreach(json_object_get(p, "decoders"), i, e) parse_decoder(tok, e);
    } else if (strcmp(type, "Strip") == 0) {
        const char *c = jstr(p, "content");
        json_t *start = json_object_get(p, "start");
        if (c && strcmp(c, " ") == 0 && json_is_integer(start) && json_integer_value(start) >= 1)
            tok->strip_leading_space_on_decode = true;
    } else if (strcmp(type, "Metaspace") == 0) {
        const char *scheme = jstr(p, "prepend_scheme");
        tok->strip_leading_space_on_decode =
            scheme ? strcmp(scheme, "never") != 0 : jbool(p, "add_prefix_space", true);
    }
}

static td_status load_json(const char *path, json_t **root_p, bool optional) {
    json_error_t err;
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (optional) return TD_ERR_NOT_FOUND;
        TD_LOG_ERROR("%s: cannot open", path);
        return TD_ERR_IO;
    }
    json_t *root = json_loadf(f, JSON_DECODE_ANY, &err);
    fclose(f);
    if (!root) {
        TD_LOG_ERROR("%s:%d: %s", path, err.line, err.text);
        return TD_ERR_FORMAT;
    }
    if (!json_is_object(root)) {
        TD_LOG_ERROR("%s: not a JSON object", path);
        json_decref(root);
        return TD_ERR_FORMAT;
    }
    *root_p = root;
    return TD_OK;
}

/* "<s>" or {"content": "<s>", ...} */
static const char *token_name(json_t *v) {
    if (json_is_string(v)) return json_string_value(v);
    if (json_is_object(v)) return jstr(v, "content");
    return NULL;
}

static td_status set_merges(td_tokenizer *tok, json_t *merges, const char *path) {
    if (!merges || json_is_null(merges)) return TD_OK;
    if (!json_is_array(merges)) {
        TD_LOG_ERROR("%s: model.merges is not an array", path);
        return TD_ERR_FORMAT;
    }
    td_status st = td_tok_reserve_merges(tok, json_array_size(merges));
    if (st) return st;
    size_t i, skipped = 0;
    json_t *m;
    json_array_foreach(merges, i, m) {
        const char *a, *b;
        size_t al, bl;
        if (json_is_string(m)) {
            const char *s = json_string_value(m);
            size_t n = json_string_length(m);
            const char *sp = n > 1 ? memchr(s + 1, ' ', n - 1) : NULL;
            if (!sp) {
                TD_LOG_ERROR("%s: merge %zu has no separating space", path, i);
                return TD_ERR_FORMAT;
            }
            a = s;
            al = (size_t)(sp - s);
            b = sp + 1;
            bl = n - al - 1;
        } else if (json_is_array(m) && json_array_size(m) == 2 &&
                   json_is_string(json_array_get(m, 0)) && json_is_string(json_array_get(m, 1))) {
            a = json_string_value(json_array_get(m, 0));
            al = json_string_length(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1));
            bl = json_string_length(json_array_get(m, 1));
        } else {
            TD_LOG_ERROR("%s: merge %zu is neither \"a b\" nor [a, b]", path, i);
            return TD_ERR_FORMAT;
        }
        bool sk;
        if ((st = td_tok_add_merge(tok, a, al, b, bl, &sk))) return st;
        skipped += sk;
    }
    if (skipped) TD_LOG_WARN("%s: %zu merges name tokens not in the vocabulary", path, skipped);
    return TD_OK;
}

/* Builds from parsed tokenizer.json (root) and tokenizer_config.json (cfg,
 * may be NULL); takes ownership of both. `path` names them in errors. */
static td_status from_json(json_t *root, json_t *cfg, const char *path, td_tokenizer **tok_p) {
    td_tokenizer *tok = NULL;
    td_status st;
    if (!json_is_object(root) || (cfg && !json_is_object(cfg))) {
        TD_LOG_ERROR("%s: not a JSON object", path);
        st = TD_ERR_FORMAT;
        goto fail;
    }
    tok = td_tok_alloc();
    if (!tok) {
        st = TD_ERR_NOMEM;
        goto fail;
    }
    json_t *model = json_object_get(root, "model");
    const char *mtype = json_is_object(model) ? jstr(model, "type") : NULL;
    json_t *vocab = json_is_object(model) ? json_object_get(model, "vocab") : NULL;
    if (!json_is_object(vocab) || (mtype && strcmp(mtype, "BPE") != 0)) {
        TD_LOG_ERROR("%s: unsupported model type '%s' (only BPE with a vocab object)", path,
                     mtype ? mtype : "?");
        st = TD_ERR_UNSUPPORTED;
        goto fail;
    }
    const char *cwp = jstr(model, "continuing_subword_prefix");
    const char *eow = jstr(model, "end_of_word_suffix");
    if ((cwp && *cwp) || (eow && *eow)) {
        TD_LOG_ERROR("%s: BPE continuing_subword_prefix / end_of_word_suffix unsupported", path);
        st = TD_ERR_UNSUPPORTED;
        goto fail;
    }
    json_t *added = json_object_get(root, "added_tokens");
    if (added && !json_is_array(added)) {
        TD_LOG_ERROR("%s: added_tokens is not an array", path);
        st = TD_ERR_FORMAT;
        goto fail;
    }

    /* vocabulary size: largest id + 1 over vocab and added tokens */
    json_int_t max_id = -1;
    const char *key;
    json_t *val;
    json_object_foreach(vocab, key, val) {
        if (!json_is_integer(val) || json_integer_value(val) < 0 ||
            json_integer_value(val) >= MAX_VOCAB) {
            TD_LOG_ERROR("%s: vocab entry '%.40s' has a bad id", path, key);
            st = TD_ERR_FORMAT;
            goto fail;
        }
        if (json_integer_value(val) > max_id) max_id = json_integer_value(val);
    }
    size_t i;
    json_t *a;
    json_array_foreach(added, i, a) {
        json_t *id = json_object_get(a, "id");
        if (!json_is_integer(id) || json_integer_value(id) < 0 ||
            json_integer_value(id) >= MAX_VOCAB || !jstr(a, "content")) {
            TD_LOG_ERROR("%s: added_tokens[%zu] has a bad id or no content", path, i);
            st = TD_ERR_FORMAT;
            goto fail;
        }
        if (json_integer_value(id) > max_id) max_id = json_integer_value(id);
    }
    if (max_id < 0) {
        TD_LOG_ERROR("%s: empty vocabulary", path);
        st = TD_ERR_FORMAT;
        goto fail;
    }
    /* ids are dense in real files; a few holes are tolerated, a huge
     * mostly-empty id space (a lying file) is not */
    size_t entries = json_object_size(vocab) + json_array_size(added);
    if ((size_t)max_id >= entries + 4096) {
        TD_LOG_ERROR("%s: token id %lld with only %zu tokens: ids are not dense", path,
                     (long long)max_id, entries);
        st = TD_ERR_FORMAT;
        goto fail;
    }
    if ((st = td_tok_set_n_vocab(tok, (int32_t)max_id + 1))) goto fail;
    tok->model = TD_TOK_MODEL_BPE;
    tok->byte_fallback = jbool(model, "byte_fallback", false);
    tok->ignore_merges = jbool(model, "ignore_merges", false);
    tok->fuse_unk = jbool(model, "fuse_unk", false);
    json_object_foreach(vocab, key, val) {
        /* keys are NUL-free here: jansson rejects \u0000 in keys by default */
        if ((st = td_tok_set_token(tok, (int32_t)json_integer_value(val), key, strlen(key), 0,
                                   TD_TOKT_NORMAL)))
            goto fail;
    }
    json_array_foreach(added, i, a) {
        json_t *c = json_object_get(a, "content");
        int32_t id = (int32_t)json_integer_value(json_object_get(a, "id"));
        int type = jbool(a, "special", false) ? TD_TOKT_CONTROL : TD_TOKT_USER_DEFINED;
        if ((st = td_tok_set_token(tok, id, json_string_value(c), json_string_length(c), 0, type)))
            goto fail;
        tok->lstrip[id] = jbool(a, "lstrip", false);
        tok->rstrip[id] = jbool(a, "rstrip", false);
    }
    if ((st = td_tok_build_vocab(tok))) goto fail;
    if ((st = set_merges(tok, json_object_get(model, "merges"), path))) goto fail;
    const char *unk = jstr(model, "unk_token");
    if (unk) tok->unk = td_tok_find(tok, unk, strlen(unk));

    if ((st = parse_normalizer(tok, json_object_get(root, "normalizer"), path))) goto fail;
    if ((st = parse_pretok(tok, json_object_get(root, "pre_tokenizer"), path))) goto fail;
    parse_decoder(tok, json_object_get(root, "decoder"));

    /* BOS/EOS added by a TemplateProcessing post-processor */
    json_t *post = json_object_get(root, "post_processor");
    json_t *single = json_is_object(post) ? json_object_get(post, "single") : NULL;
    if (json_is_array(single) && json_array_size(single) > 0) {
        json_t *first = json_object_get(json_array_get(single, 0), "SpecialToken");
        json_t *last =
            json_object_get(json_array_get(single, json_array_size(single) - 1), "SpecialToken");
        const char *fn = first ? jstr(first, "id") : NULL;
        const char *ln = last && json_array_size(single) > 1 ? jstr(last, "id") : NULL;
        if (fn && (tok->bos = td_tok_find(tok, fn, strlen(fn))) >= 0) tok->add_bos = true;
        if (ln && (tok->eos = td_tok_find(tok, ln, strlen(ln))) >= 0) tok->add_eos = true;
    }

    if (cfg) {
        const char *bos = token_name(json_object_get(cfg, "bos_token"));
        const char *eos = token_name(json_object_get(cfg, "eos_token"));
        const char *pad = token_name(json_object_get(cfg, "pad_token"));
        const char *cunk = token_name(json_object_get(cfg, "unk_token"));
        if (bos) tok->bos = td_tok_find(tok, bos, strlen(bos));
        if (eos) tok->eos = td_tok_find(tok, eos, strlen(eos));
        if (pad) tok->pad = td_tok_find(tok, pad, strlen(pad));
        if (cunk && tok->unk < 0) tok->unk = td_tok_find(tok, cunk, strlen(cunk));
        tok->add_bos = jbool(cfg, "add_bos_token", tok->add_bos);
        tok->add_eos = jbool(cfg, "add_eos_token", tok->add_eos);
        json_t *ct = json_object_get(cfg, "chat_template");
        const char *tmpl = NULL;
        if (json_is_string(ct)) {
            tmpl = json_string_value(ct);
        } else if (json_is_array(ct)) {
            /* named templates: "default" is the template, the others by name */
            json_t *e;
            json_array_foreach(ct, i, e) {
                const char *name = jstr(e, "name"), *text = jstr(e, "template");
                if (!name || !text) continue;
                if (strcmp(name, "default") == 0)
                    tmpl = text;
                else if ((st = td_tok_add_named_template(tok, name, text)))
                    goto fail;
            }
        }
        if (tmpl && !(tok->chat_template = strdup(tmpl))) {
            st = TD_ERR_NOMEM;
            goto fail;
        }
    }
    snprintf(tok->kind, sizeof(tok->kind), "hf/bpe%s%s", tok->byte_level ? "-bytelevel" : "",
             tok->byte_fallback ? "-bytefallback" : "");
    if ((st = td_tok_finish(tok, path))) goto fail;
    json_decref(root);
    json_decref(cfg);
    *tok_p = tok;
    return TD_OK;
fail:
    if (st == TD_ERR_NOMEM) TD_LOG_ERROR("%s: out of memory building the tokenizer", path);
    td_tokenizer_free(tok);
    json_decref(root);
    json_decref(cfg);
    return st;
}

td_status td_tokenizer_from_hf_dir(const char *dir, td_tokenizer **tok_p) {
    if (!dir || !tok_p) return TD_ERR_INVALID;
    char path[4096], cpath[4096];
    if ((size_t)snprintf(path, sizeof(path), "%s/tokenizer.json", dir) >= sizeof(path) ||
        (size_t)snprintf(cpath, sizeof(cpath), "%s/tokenizer_config.json", dir) >= sizeof(cpath))
        return TD_ERR_INVALID;
    json_t *root = NULL, *cfg = NULL;
    td_status st = load_json(path, &root, false);
    if (st) return st;
    st = load_json(cpath, &cfg, true);
    if (st == TD_ERR_NOT_FOUND) {
        cfg = NULL;
    } else if (st) {
        json_decref(root);
        return st;
    }
    td_tokenizer *tok = NULL;
    st = from_json(root, cfg, path, &tok);
    if (st) return st;
    /* chat_template.jinja, where transformers saves the template since
     * 4.43: it takes precedence over tokenizer_config.json's */
    char jpath[4096];
    if ((size_t)snprintf(jpath, sizeof(jpath), "%s/chat_template.jinja", dir) < sizeof(jpath)) {
        char *text = NULL;
        st = td_tok_read_text(jpath, 16u << 20, &text);
        if (st == TD_OK) {
            free(tok->chat_template);
            tok->chat_template = text;
        } else if (st != TD_ERR_NOT_FOUND) {
            TD_LOG_ERROR("%s: cannot read the chat template (%s)", jpath, td_status_str(st));
            td_tokenizer_free(tok);
            return st;
        }
    }
    *tok_p = tok;
    return TD_OK;
}

td_status td_tok_from_hf_json(const char *tok_json, size_t len, const char *cfg_json,
                              size_t cfg_len, const char *name, td_tokenizer **tok_p) {
    if (!tok_json || !tok_p || !name) return TD_ERR_INVALID;
    json_error_t err;
    json_t *root = json_loadb(tok_json, len, JSON_DECODE_ANY, &err), *cfg = NULL;
    if (!root) {
        TD_LOG_ERROR("%s:%d: %s", name, err.line, err.text);
        return TD_ERR_FORMAT;
    }
    if (cfg_json && !(cfg = json_loadb(cfg_json, cfg_len, JSON_DECODE_ANY, &err))) {
        TD_LOG_ERROR("%s (config):%d: %s", name, err.line, err.text);
        json_decref(root);
        return TD_ERR_FORMAT;
    }
    return from_json(root, cfg, name, tok_p);
}
