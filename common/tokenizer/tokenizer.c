/* Tokenizer core: vocabulary tables, special-token partitioning,
 * normalisation and pre-tokenization, decoding and the incremental
 * detokenizer. The models themselves live in tokenizer-bpe.c and
 * tokenizer-spm.c; the loaders in tokenizer-gguf.c and tokenizer-hf.c. */
#define _GNU_SOURCE /* memmem, qsort_r */
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "tokenizer-impl.h"
#include "unicode-nfc.h"

/* ---------------------------------------------------------------- UTF-8 */

size_t td_utf8_len(const unsigned char *s, size_t n) {
    uint32_t cp;
    if (n == 0) return 0;
    size_t l = td_utf8_decode(s, n, &cp);
    return l ? l : 1; /* an invalid byte stands alone, so it survives as a byte token */
}

int td_utf8_put(uint32_t cp, char *out) {
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xC0 | (cp >> 6));
        o[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | (cp >> 18));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

size_t td_utf8_decode(const unsigned char *s, size_t n, uint32_t *cp_p) {
    if (n == 0) return 0;
    unsigned char c = s[0];
    uint32_t cp;
    size_t l;
    if (c < 0x80) {
        *cp_p = c;
        return 1;
    } else if (c >= 0xC2 && c <= 0xDF) {
        l = 2;
        cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        l = 3;
        cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        l = 4;
        cp = c & 0x07;
    } else {
        return 0;
    }
    if (n < l) return 0;
    for (size_t i = 1; i < l; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    /* overlongs, surrogates, beyond U+10FFFF */
    if ((l == 3 && cp < 0x800) || (l == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    *cp_p = cp;
    return l;
}

/* GPT-2's reversible byte -> printable codepoint table: printable Latin-1
 * bytes map to themselves, the others to U+0100 upwards in byte order. */
static bool byte_is_printable(unsigned b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

uint32_t td_byte_to_cp(uint8_t b) {
    if (byte_is_printable(b)) return b;
    uint32_t n = 0;
    for (unsigned i = 0; i < b; i++)
        if (!byte_is_printable(i)) n++;
    return 256 + n;
}

int td_cp_to_byte(uint32_t cp) {
    if (cp < 256) return byte_is_printable(cp) ? (int)cp : -1;
    if (cp >= 256 + 68) return -1; /* 68 bytes are not printable */
    uint32_t n = cp - 256;
    for (unsigned i = 0; i < 256; i++) {
        if (!byte_is_printable(i)) {
            if (n == 0) return (int)i;
            n--;
        }
    }
    return -1;
}

td_status td_ivec_push(td_ivec *iv, int32_t x) {
    if (iv->n == iv->cap) {
        size_t cap = iv->cap ? iv->cap * 2 : 64;
        int32_t *v = realloc(iv->v, cap * sizeof(*v));
        if (!v) return TD_ERR_NOMEM;
        iv->v = v;
        iv->cap = cap;
    }
    iv->v[iv->n++] = x;
    return TD_OK;
}

/* ------------------------------------------------------------ hash maps */

static size_t pow2_at_least(size_t n) {
    size_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

static td_status str_map_build(td_tokenizer *tok) {
    size_t cap = pow2_at_least((size_t)tok->n_vocab * 2 + 1);
    int32_t *slots = malloc(cap * sizeof(*slots));
    if (!slots) return TD_ERR_NOMEM;
    for (size_t i = 0; i < cap; i++) slots[i] = -1;
    free(tok->vocab.slots);
    tok->vocab.slots = slots;
    tok->vocab.mask = cap - 1;
    for (int32_t id = 0; id < tok->n_vocab; id++) {
        if (tok->type[id] == TD_TOKT_UNDEFINED) continue; /* hole in a sparse vocabulary */
        size_t h = (size_t)XXH3_64bits(tok->text[id], tok->len[id]) & tok->vocab.mask;
        for (;;) {
            int32_t o = slots[h];
            if (o < 0) {
                slots[h] = id;
                break;
            }
            /* duplicate text: the first id wins (as in llama.cpp's token_to_id) */
            if (tok->len[o] == tok->len[id] &&
                memcmp(tok->text[o], tok->text[id], tok->len[id]) == 0)
                break;
            h = (h + 1) & tok->vocab.mask;
        }
    }
    return TD_OK;
}

int32_t td_tok_find(const td_tokenizer *tok, const char *s, size_t len) {
    if (!tok->vocab.slots) return -1;
    size_t h = (size_t)XXH3_64bits(s, len) & tok->vocab.mask;
    for (;;) {
        int32_t o = tok->vocab.slots[h];
        if (o < 0) return -1;
        if (tok->len[o] == len && memcmp(tok->text[o], s, len) == 0) return o;
        h = (h + 1) & tok->vocab.mask;
    }
}

static size_t pair_hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return (size_t)k;
}

td_status td_tok_reserve_merges(td_tokenizer *tok, size_t n) {
    td_pair_map *m = &tok->merges;
    size_t cap;
    if (td_mul_overflow(n + 1, 2, &cap) || cap > ((size_t)1 << 31)) return TD_ERR_NOMEM;
    cap = pow2_at_least(cap);
    if (m->keys && m->mask + 1 >= cap) return TD_OK;
    uint64_t *keys = calloc(cap, sizeof(*keys));
    int32_t *rank = malloc(cap * sizeof(*rank));
    int32_t *merged = malloc(cap * sizeof(*merged));
    if (!keys || !rank || !merged) {
        free(keys);
        free(rank);
        free(merged);
        return TD_ERR_NOMEM;
    }
    if (m->keys) {
        for (size_t i = 0; i <= m->mask; i++) {
            if (!m->keys[i]) continue;
            size_t h = pair_hash(m->keys[i]) & (cap - 1);
            while (keys[h]) h = (h + 1) & (cap - 1);
            keys[h] = m->keys[i];
            rank[h] = m->rank[i];
            merged[h] = m->merged[i];
        }
    }
    free(m->keys);
    free(m->rank);
    free(m->merged);
    m->keys = keys;
    m->rank = rank;
    m->merged = merged;
    m->mask = cap - 1;
    return TD_OK;
}

td_status td_tok_add_merge(td_tokenizer *tok, const char *a, size_t alen, const char *b,
                           size_t blen, bool *skipped_p) {
    int32_t ia = td_tok_find(tok, a, alen), ib = td_tok_find(tok, b, blen);
    int32_t rank = tok->n_merges++;
    *skipped_p = true;
    if (ia < 0 || ib < 0) return TD_OK;
    size_t n = alen + blen;
    char stackbuf[256];
    char *buf = n <= sizeof(stackbuf) ? stackbuf : malloc(n);
    if (!buf) return TD_ERR_NOMEM;
    memcpy(buf, a, alen);
    memcpy(buf + alen, b, blen);
    int32_t im = td_tok_find(tok, buf, n);
    if (buf != stackbuf) free(buf);
    if (im < 0) return TD_OK;
    td_pair_map *m = &tok->merges;
    size_t used = (size_t)tok->n_merges;
    if (!m->keys || used * 2 > m->mask + 1) {
        td_status st = td_tok_reserve_merges(tok, used * 2);
        if (st) return st;
    }
    uint64_t key = (((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib) + 1;
    size_t h = pair_hash(key) & m->mask;
    while (m->keys[h]) {
        if (m->keys[h] == key) return TD_OK; /* duplicate merge: the first (lowest rank) wins */
        h = (h + 1) & m->mask;
    }
    m->keys[h] = key;
    m->rank[h] = rank;
    m->merged[h] = im;
    *skipped_p = false;
    return TD_OK;
}

/* Exposed to tokenizer-bpe.c through a static-inline-free function. */
bool td_tok_merge_lookup(const td_tokenizer *tok, int32_t a, int32_t b, int32_t *rank_p,
                         int32_t *merged_p);
bool td_tok_merge_lookup(const td_tokenizer *tok, int32_t a, int32_t b, int32_t *rank_p,
                         int32_t *merged_p) {
    const td_pair_map *m = &tok->merges;
    if (!m->keys || a < 0 || b < 0) return false;
    uint64_t key = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
    size_t h = pair_hash(key) & m->mask;
    while (m->keys[h]) {
        if (m->keys[h] == key) {
            *rank_p = m->rank[h];
            *merged_p = m->merged[h];
            return true;
        }
        h = (h + 1) & m->mask;
    }
    return false;
}

/* -------------------------------------------------------------- builder */

td_tokenizer *td_tok_alloc(void) {
    td_tokenizer *tok = calloc(1, sizeof(*tok));
    if (!tok) return NULL;
    tok->bos = tok->eos = tok->eot = tok->eom = tok->unk = tok->pad = -1;
    for (int i = 0; i < 256; i++) tok->byte_char_token[i] = tok->byte_token[i] = -1;
    return tok;
}

td_status td_tok_set_n_vocab(td_tokenizer *tok, int32_t n) {
    if (n <= 0) return TD_ERR_FORMAT;
    tok->n_vocab = n;
    tok->text = calloc((size_t)n, sizeof(*tok->text));
    tok->len = calloc((size_t)n, sizeof(*tok->len));
    tok->score = calloc((size_t)n, sizeof(*tok->score));
    tok->type = calloc((size_t)n, sizeof(*tok->type));
    tok->lstrip = calloc((size_t)n, 1);
    tok->rstrip = calloc((size_t)n, 1);
    if (!tok->text || !tok->len || !tok->score || !tok->type || !tok->lstrip || !tok->rstrip)
        return TD_ERR_NOMEM;
    return TD_OK;
}

td_status td_tok_set_token(td_tokenizer *tok, int32_t id, const char *s, size_t len, float score,
                           int type) {
    if (id < 0 || id >= tok->n_vocab || len > UINT32_MAX - 1) return TD_ERR_FORMAT;
    char *t = malloc(len + 1);
    if (!t) return TD_ERR_NOMEM;
    memcpy(t, s, len);
    t[len] = 0;
    free(tok->text[id]);
    tok->text[id] = t;
    tok->len[id] = (uint32_t)len;
    tok->score[id] = score;
    if (type < TD_TOKT_NORMAL || type > TD_TOKT_BYTE) type = TD_TOKT_NORMAL;
    tok->type[id] = (uint8_t)type;
    return TD_OK;
}

td_status td_tok_add_pretok(td_tokenizer *tok, const char *pattern, td_split_behavior behavior,
                            bool invert) {
    int err;
    PCRE2_SIZE erroff;
    pcre2_code *re =
        pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED,
                      PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &erroff, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof(msg));
        TD_LOG_ERROR("pre-tokenizer regex /%.80s/ at offset %zu: %s", pattern, (size_t)erroff,
                     (const char *)msg);
        return TD_ERR_UNSUPPORTED;
    }
    /* JIT is an optimisation only; the interpreter gives the same matches. */
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    td_pretok_step *p = realloc(tok->pretok, (tok->n_pretok + 1) * sizeof(*p));
    if (!p) {
        pcre2_code_free(re);
        return TD_ERR_NOMEM;
    }
    tok->pretok = p;
    p[tok->n_pretok].re = re;
    p[tok->n_pretok].behavior = behavior;
    p[tok->n_pretok].invert = invert;
    tok->n_pretok++;
    return TD_OK;
}

td_status td_tok_add_prefix_step(td_tokenizer *tok) {
    td_pretok_step *p = realloc(tok->pretok, (tok->n_pretok + 1) * sizeof(*p));
    if (!p) return TD_ERR_NOMEM;
    tok->pretok = p;
    p[tok->n_pretok++] = (td_pretok_step){NULL, TD_SPLIT_ISOLATED, false};
    return TD_OK;
}

td_status td_tok_build_vocab(td_tokenizer *tok) { return str_map_build(tok); }

static int special_cmp(const void *a, const void *b, void *arg) {
    const td_tokenizer *tok = arg;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (tok->len[x] != tok->len[y]) return tok->len[x] > tok->len[y] ? -1 : 1;
    return x < y ? -1 : (x > y);
}

static bool parse_byte_token(const char *s, size_t len, int *byte_p) {
    /* "<0xXX>" */
    if (len != 6 || s[0] != '<' || s[1] != '0' || s[2] != 'x' || s[5] != '>') return false;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = (c >= '0' && c <= '9')   ? c - '0'
                : (c >= 'A' && c <= 'F') ? c - 'A' + 10
                : (c >= 'a' && c <= 'f') ? c - 'a' + 10
                                         : -1;
        if (d < 0) return false;
        v = v * 16 + d;
    }
    *byte_p = v;
    return true;
}

static bool eog_has(const td_tokenizer *tok, int32_t id) {
    for (size_t i = 0; i < tok->n_eog; i++)
        if (tok->eog[i] == id) return true;
    return false;
}

static td_status eog_add(td_tokenizer *tok, int32_t id) {
    if (id < 0 || id >= tok->n_vocab || eog_has(tok, id)) return TD_OK;
    int32_t *e = realloc(tok->eog, (tok->n_eog + 1) * sizeof(*e));
    if (!e) return TD_ERR_NOMEM;
    tok->eog = e;
    e[tok->n_eog++] = id;
    return TD_OK;
}

td_status td_tok_finish(td_tokenizer *tok, const char *src) {
    td_status st;
    if (!tok->vocab.slots && (st = str_map_build(tok))) return st;

    int32_t *ids[] = {&tok->bos, &tok->eos, &tok->eot, &tok->eom, &tok->unk, &tok->pad};
    static const char *names[] = {"bos", "eos", "eot", "eom", "unknown", "padding"};
    for (size_t i = 0; i < TD_ARRAY_SIZE(ids); i++) {
        if (*ids[i] >= tok->n_vocab || *ids[i] < -1) {
            TD_LOG_WARN("%s: %s token id %d out of range (n_vocab %d), ignored", src, names[i],
                        (int)*ids[i], (int)tok->n_vocab);
            *ids[i] = -1;
        }
    }
    if (tok->add_bos && tok->bos < 0) {
        TD_LOG_WARN("%s: add_bos set but no BOS token; not adding one", src);
        tok->add_bos = false;
    }
    if (tok->add_eos && tok->eos < 0) {
        TD_LOG_WARN("%s: add_eos set but no EOS token; not adding one", src);
        tok->add_eos = false;
    }

    /* byte tables */
    for (int32_t id = 0; id < tok->n_vocab; id++) {
        int b;
        if (tok->type[id] == TD_TOKT_UNDEFINED) continue;
        if ((tok->type[id] == TD_TOKT_BYTE || tok->byte_fallback) &&
            parse_byte_token(tok->text[id], tok->len[id], &b)) {
            if (tok->byte_token[b] < 0) tok->byte_token[b] = id;
            if (tok->type[id] == TD_TOKT_NORMAL) tok->type[id] = TD_TOKT_BYTE;
        }
    }
    if (tok->byte_level) {
        for (int b = 0; b < 256; b++) {
            char buf[4];
            int n = td_utf8_put(td_byte_to_cp((uint8_t)b), buf);
            tok->byte_char_token[b] = td_tok_find(tok, buf, (size_t)n);
        }
    }

    /* special tokens matched in the input */
    size_t ns = 0;
    for (int32_t id = 0; id < tok->n_vocab; id++) {
        uint8_t t = tok->type[id];
        if ((t == TD_TOKT_CONTROL || t == TD_TOKT_USER_DEFINED || t == TD_TOKT_UNKNOWN) &&
            tok->len[id] > 0)
            ns++;
    }
    free(tok->special);
    tok->special = malloc((ns ? ns : 1) * sizeof(int32_t));
    if (!tok->special) return TD_ERR_NOMEM;
    tok->n_special = 0;
    for (int32_t id = 0; id < tok->n_vocab; id++) {
        uint8_t t = tok->type[id];
        if ((t == TD_TOKT_CONTROL || t == TD_TOKT_USER_DEFINED || t == TD_TOKT_UNKNOWN) &&
            tok->len[id] > 0)
            tok->special[tok->n_special++] = id;
    }
    qsort_r(tok->special, tok->n_special, sizeof(int32_t), special_cmp, tok);

    /* end-of-generation set */
    static const char *eog_texts[] = {"<|eot_id|>",    "<|im_end|>",     "<|end|>",
                                      "<end_of_turn>", "<|endoftext|>",  "</s>",
                                      "<|eom_id|>",    "<|end_of_text|>"};
    if ((st = eog_add(tok, tok->eos)) || (st = eog_add(tok, tok->eot)) ||
        (st = eog_add(tok, tok->eom)))
        return st;
    for (size_t i = 0; i < TD_ARRAY_SIZE(eog_texts); i++) {
        int32_t id = td_tok_find(tok, eog_texts[i], strlen(eog_texts[i]));
        if (id < 0) continue;
        if (tok->type[id] != TD_TOKT_CONTROL && tok->type[id] != TD_TOKT_USER_DEFINED) continue;
        if ((st = eog_add(tok, id))) return st;
    }
    return TD_OK;
}

/* -------------------------------------------------------------- public */

void td_tokenizer_free(td_tokenizer *tok) {
    if (!tok) return;
    if (tok->text)
        for (int32_t i = 0; i < tok->n_vocab; i++) free(tok->text[i]);
    free(tok->text);
    free(tok->len);
    free(tok->score);
    free(tok->type);
    free(tok->lstrip);
    free(tok->rstrip);
    free(tok->vocab.slots);
    free(tok->merges.keys);
    free(tok->merges.rank);
    free(tok->merges.merged);
    free(tok->special);
    for (size_t i = 0; i < tok->n_pretok; i++) pcre2_code_free(tok->pretok[i].re);
    free(tok->pretok);
    free(tok->eog);
    free(tok->chat_template);
    for (size_t i = 0; i < tok->n_named; i++) {
        free(tok->named_name[i]);
        free(tok->named_text[i]);
    }
    free(tok->named_name);
    free(tok->named_text);
    free(tok);
}

td_status td_tok_read_text(const char *path, size_t limit, char **text_p) {
    FILE *f = fopen(path, "rb");
    if (!f) return TD_ERR_NOT_FOUND;
    char *text = NULL, buf[8192];
    size_t cap = 0, n = 0, r;
    td_status st = TD_OK;
    while ((r = fread(buf, 1, sizeof buf, f)) > 0) {
        if (n + r > limit) {
            st = TD_ERR_FORMAT;
            break;
        }
        if (n + r + 1 > cap) {
            cap = 2 * (n + r + 1);
            char *nt = realloc(text, cap);
            if (!nt) {
                st = TD_ERR_NOMEM;
                break;
            }
            text = nt;
        }
        memcpy(text + n, buf, r);
        n += r;
    }
    if (!st && ferror(f)) st = TD_ERR_IO;
    fclose(f);
    if (!st && !text && !(text = malloc(1))) st = TD_ERR_NOMEM;
    if (st) {
        free(text);
        return st;
    }
    text[n] = 0;
    *text_p = text;
    return TD_OK;
}

td_status td_tok_add_named_template(td_tokenizer *tok, const char *name, const char *text) {
    char **nn = realloc(tok->named_name, (tok->n_named + 1) * sizeof *nn);
    if (!nn) return TD_ERR_NOMEM;
    tok->named_name = nn;
    char **nt = realloc(tok->named_text, (tok->n_named + 1) * sizeof *nt);
    if (!nt) return TD_ERR_NOMEM;
    tok->named_text = nt;
    char *a = strdup(name), *b = strdup(text);
    if (!a || !b) {
        free(a);
        free(b);
        return TD_ERR_NOMEM;
    }
    tok->named_name[tok->n_named] = a;
    tok->named_text[tok->n_named++] = b;
    return TD_OK;
}

const char *td_tokenizer_chat_template_named(const td_tokenizer *tok, const char *name) {
    for (size_t i = 0; name && i < tok->n_named; i++)
        if (strcmp(tok->named_name[i], name) == 0) return tok->named_text[i];
    return NULL;
}

int32_t td_tokenizer_n_vocab(const td_tokenizer *tok) { return tok->n_vocab; }
int32_t td_tokenizer_bos(const td_tokenizer *tok) { return tok->bos; }
int32_t td_tokenizer_eos(const td_tokenizer *tok) { return tok->eos; }
bool td_tokenizer_adds_bos(const td_tokenizer *tok) { return tok->add_bos; }
bool td_tokenizer_is_eog(const td_tokenizer *tok, int32_t id) {
    return id >= 0 && eog_has(tok, id);
}
const int32_t *td_tokenizer_eog_ids(const td_tokenizer *tok, size_t *n_p) {
    *n_p = tok->n_eog;
    return tok->eog;
}
bool td_tokenizer_is_special(const td_tokenizer *tok, int32_t id) {
    if (id < 0 || id >= tok->n_vocab) return false;
    uint8_t t = tok->type[id];
    return t == TD_TOKT_CONTROL || t == TD_TOKT_UNKNOWN;
}
const char *td_tokenizer_token_text(const td_tokenizer *tok, int32_t id) {
    if (id < 0 || id >= tok->n_vocab) return NULL;
    return tok->text[id] ? tok->text[id] : "";
}
const char *td_tokenizer_chat_template(const td_tokenizer *tok) { return tok->chat_template; }
const char *td_tokenizer_kind(const td_tokenizer *tok) { return tok->kind; }

/* ------------------------------------------------------------- encoding */

typedef struct {
    size_t off, len; /* raw text range when id < 0 */
    int32_t id;      /* special token, or -1 for raw text */
} frag;

typedef struct {
    frag *v;
    size_t n, cap;
} frag_vec;

static td_status frag_push(frag_vec *f, size_t off, size_t len, int32_t id) {
    if (f->n == f->cap) {
        size_t cap = f->cap ? f->cap * 2 : 16;
        frag *v = realloc(f->v, cap * sizeof(*v));
        if (!v) return TD_ERR_NOMEM;
        f->v = v;
        f->cap = cap;
    }
    f->v[f->n++] = (frag){off, len, id};
    return TD_OK;
}

static bool is_c_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

/* Splits the raw fragments at every occurrence of each special token in
 * turn, longest first, leftmost occurrence first (llama.cpp's and HF's
 * partition order). */
static td_status partition_special(const td_tokenizer *tok, const char *text, bool parse_special,
                                   frag_vec *fv) {
    td_status st = TD_OK;
    frag_vec tmp = {0};
    for (size_t si = 0; si < tok->n_special; si++) {
        int32_t id = tok->special[si];
        uint8_t t = tok->type[id];
        if (!parse_special && (t == TD_TOKT_CONTROL || t == TD_TOKT_UNKNOWN)) continue;
        const char *needle = tok->text[id];
        size_t nl = tok->len[id];
        tmp.n = 0;
        for (size_t fi = 0; fi < fv->n; fi++) {
            frag f = fv->v[fi];
            if (f.id >= 0 || f.len < nl) {
                if ((st = frag_push(&tmp, f.off, f.len, f.id))) goto out;
                continue;
            }
            size_t off = f.off, len = f.len;
            while (len > 0) {
                const char *m = memmem(text + off, len, needle, nl);
                if (!m) {
                    if ((st = frag_push(&tmp, off, len, -1))) goto out;
                    break;
                }
                size_t mo = (size_t)(m - text);
                size_t left = mo - off;
                if (tok->lstrip[id])
                    while (left > 0 && is_c_space(text[off + left - 1])) left--;
                if (left > 0 && (st = frag_push(&tmp, off, left, -1))) goto out;
                if ((st = frag_push(&tmp, 0, 0, id))) goto out;
                size_t roff = mo + nl, rlen = off + len - roff;
                if (tok->rstrip[id])
                    while (rlen > 0 && is_c_space(text[roff])) {
                        roff++;
                        rlen--;
                    }
                off = roff;
                len = rlen;
            }
        }
        frag_vec sw = *fv;
        *fv = tmp;
        tmp = sw;
    }
out:
    free(tmp.v);
    return st;
}

typedef struct {
    size_t *v; /* pairs (off, len) */
    size_t n, cap;
} range_vec;

static td_status range_push(range_vec *r, size_t off, size_t len) {
    if (len == 0) return TD_OK;
    if (r->n == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 32;
        size_t *v = realloc(r->v, cap * 2 * sizeof(*v));
        if (!v) return TD_ERR_NOMEM;
        r->v = v;
        r->cap = cap;
    }
    r->v[2 * r->n] = off;
    r->v[2 * r->n + 1] = len;
    r->n++;
    return TD_OK;
}

/* Applies one split step to piece [off, off+len) of buf, appending the
 * resulting pieces to out. */
static td_status split_piece(const td_pretok_step *step, const char *buf, size_t off, size_t len,
                             pcre2_match_data *md, range_vec *out) {
    /* Collect segments (start, end, is_match). */
    size_t seg_cap = 16, nseg = 0;
    size_t *seg = malloc(seg_cap * 3 * sizeof(*seg));
    if (!seg) return TD_ERR_NOMEM;
    td_status st = TD_OK;
    size_t pos = 0, last = 0;
    const unsigned char *p = (const unsigned char *)buf + off;
    while (pos <= len) {
        int rc = pcre2_match(step->re, p, len, pos, 0, md, NULL);
        /* the JIT's fixed stack can run out on very long runs; the
         * interpreter keeps its backtracking state on the heap */
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
            rc = pcre2_match(step->re, p, len, pos, PCRE2_NO_JIT, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(rc, msg, sizeof(msg));
            TD_LOG_ERROR("pre-tokenizer match failed: %s", (const char *)msg);
            st = TD_ERR_INVALID;
            goto out;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t ms = ov[0], me = ov[1];
        if (me <= ms) {
            /* empty match: step over one character */
            if (ms >= len) break;
            pos = ms + td_utf8_len(p + ms, len - ms);
            continue;
        }
        if (nseg + 2 > seg_cap) {
            seg_cap *= 2;
            size_t *s2 = realloc(seg, seg_cap * 3 * sizeof(*seg));
            if (!s2) {
                st = TD_ERR_NOMEM;
                goto out;
            }
            seg = s2;
        }
        if (ms > last) {
            seg[3 * nseg] = last;
            seg[3 * nseg + 1] = ms;
            seg[3 * nseg + 2] = step->invert;
            nseg++;
        }
        seg[3 * nseg] = ms;
        seg[3 * nseg + 1] = me;
        seg[3 * nseg + 2] = !step->invert;
        nseg++;
        last = me;
        pos = me;
    }
    if (last < len) {
        if (nseg + 1 > seg_cap) {
            seg_cap *= 2;
            size_t *s2 = realloc(seg, seg_cap * 3 * sizeof(*seg));
            if (!s2) {
                st = TD_ERR_NOMEM;
                goto out;
            }
            seg = s2;
        }
        seg[3 * nseg] = last;
        seg[3 * nseg + 1] = len;
        seg[3 * nseg + 2] = step->invert;
        nseg++;
    }

    switch (step->behavior) {
    case TD_SPLIT_ISOLATED:
        for (size_t i = 0; i < nseg && !st; i++)
            st = range_push(out, off + seg[3 * i], seg[3 * i + 1] - seg[3 * i]);
        break;
    case TD_SPLIT_REMOVED:
        for (size_t i = 0; i < nseg && !st; i++)
            if (!seg[3 * i + 2])
                st = range_push(out, off + seg[3 * i], seg[3 * i + 1] - seg[3 * i]);
        break;
    case TD_SPLIT_MERGED_PREV: {
        /* a match closes the current piece */
        size_t start = 0;
        bool open = false;
        for (size_t i = 0; i < nseg && !st; i++) {
            if (!open) start = seg[3 * i];
            open = true;
            if (seg[3 * i + 2]) {
                st = range_push(out, off + start, seg[3 * i + 1] - start);
                open = false;
            }
        }
        if (open && !st) st = range_push(out, off + start, len - start);
        break;
    }
    case TD_SPLIT_MERGED_NEXT: {
        /* a match opens a new piece */
        size_t start = 0;
        for (size_t i = 0; i < nseg && !st; i++) {
            if (seg[3 * i + 2] && seg[3 * i] > start) {
                st = range_push(out, off + start, seg[3 * i] - start);
                start = seg[3 * i];
            }
        }
        if (!st) st = range_push(out, off + start, len - start);
        break;
    }
    case TD_SPLIT_CONTIGUOUS: {
        size_t i = 0;
        while (i < nseg && !st) {
            size_t j = i + 1;
            if (seg[3 * i + 2])
                while (j < nseg && seg[3 * j + 2]) j++;
            st = range_push(out, off + seg[3 * i], seg[3 * (j - 1) + 1] - seg[3 * i]);
            i = j;
        }
        break;
    }
    }
out:
    free(seg);
    return st;
}

/* Normalises one raw fragment into buf (space prefix, ' ' -> U+2581). */
static td_status normalize_fragment(const td_tokenizer *tok, const char *s, size_t n,
                                    bool add_prefix, char **buf_p, size_t *len_p) {
    /* Metaspace checks for the replacement after replacing spaces, so a
     * literal U+2581 at the start also counts */
    bool starts_space = (n > 0 && s[0] == ' ') ||
                        (tok->escape_whitespace && n >= 3 && memcmp(s, "\xE2\x96\x81", 3) == 0);
    bool prefix = add_prefix && !(tok->prefix_unless_space && starts_space);
    size_t spaces = 0;
    if (tok->escape_whitespace)
        for (size_t i = 0; i < n; i++) spaces += s[i] == ' ';
    size_t cap;
    /* each space grows by 2 bytes, the prefix takes 3, plus the NUL */
    if (td_add_overflow(n, spaces * 2 + 4, &cap)) return TD_ERR_NOMEM;
    char *b = malloc(cap);
    if (!b) return TD_ERR_NOMEM;
    size_t o = 0;
    if (prefix) {
        if (tok->escape_whitespace) {
            memcpy(b + o, "\xE2\x96\x81", 3);
            o += 3;
        } else {
            b[o++] = ' ';
        }
    }
    for (size_t i = 0; i < n; i++) {
        if (tok->escape_whitespace && s[i] == ' ') {
            memcpy(b + o, "\xE2\x96\x81", 3);
            o += 3;
        } else {
            b[o++] = s[i];
        }
    }
    b[o] = 0;
    *buf_p = b;
    *len_p = o;
    return TD_OK;
}

/* Rebuilds buf so that every piece in r starts with ' '. */
static td_status prefix_pieces(char **buf_p, size_t *blen_p, range_vec *r) {
    size_t cap;
    if (td_add_overflow(*blen_p, r->n + 1, &cap)) return TD_ERR_NOMEM;
    char *nb = malloc(cap), *b = *buf_p;
    if (!nb) return TD_ERR_NOMEM;
    size_t o = 0;
    for (size_t i = 0; i < r->n; i++) {
        size_t off = r->v[2 * i], len = r->v[2 * i + 1], start = o;
        if (b[off] != ' ') nb[o++] = ' ';
        memcpy(nb + o, b + off, len);
        o += len;
        r->v[2 * i] = start;
        r->v[2 * i + 1] = o - start;
    }
    nb[o] = 0;
    free(b);
    *buf_p = nb;
    *blen_p = o;
    return TD_OK;
}

static td_status encode_fragment(const td_tokenizer *tok, const char *s, size_t n, bool add_prefix,
                                 td_ivec *out) {
    char *buf = NULL, *nfc = NULL;
    size_t blen = 0;
    range_vec a = {0}, b = {0};
    pcre2_match_data *md = NULL;
    td_status st;
    if (tok->nfc) {
        size_t nl;
        if ((st = td_nfc(s, n, &nfc, &nl))) return st;
        s = nfc;
        n = nl;
    }
    st = normalize_fragment(tok, s, n, add_prefix, &buf, &blen);
    free(nfc);
    if (st) return st;
    if ((st = range_push(&a, 0, blen))) goto out;
    for (size_t k = 0; k < tok->n_pretok; k++) {
        if (!tok->pretok[k].re) {
            if ((st = prefix_pieces(&buf, &blen, &a))) goto out;
            continue;
        }
        if (!md) {
            md = pcre2_match_data_create(1, NULL);
            if (!md) {
                st = TD_ERR_NOMEM;
                goto out;
            }
        }
        b.n = 0;
        for (size_t i = 0; i < a.n && !st; i++)
            st = split_piece(&tok->pretok[k], buf, a.v[2 * i], a.v[2 * i + 1], md, &b);
        if (st) goto out;
        range_vec sw = a;
        a = b;
        b = sw;
    }
    for (size_t i = 0; i < a.n && !st; i++) {
        const char *p = buf + a.v[2 * i];
        size_t pl = a.v[2 * i + 1];
        st = tok->model == TD_TOK_MODEL_SPM ? td_tok_spm_piece(tok, p, pl, out)
                                            : td_tok_bpe_piece(tok, p, pl, out);
    }
out:
    pcre2_match_data_free(md);
    free(a.v);
    free(b.v);
    free(buf);
    return st;
}

td_status td_tokenizer_encode(const td_tokenizer *tok, const char *text, size_t len,
                              bool add_special, bool parse_special, int32_t **tokens_p,
                              size_t *n_p) {
    if (!tok || (!text && len > 0) || !tokens_p || !n_p) return TD_ERR_INVALID;
    td_ivec out = {0};
    frag_vec fv = {0};
    td_status st = TD_OK;
    if (add_special && tok->add_bos && (st = td_ivec_push(&out, tok->bos))) goto out;
    if (len > 0) {
        if ((st = frag_push(&fv, 0, len, -1))) goto out;
        if ((st = partition_special(tok, text, parse_special, &fv))) goto out;
    }
    bool prev_special = true;
    for (size_t i = 0; i < fv.n; i++) {
        frag f = fv.v[i];
        if (f.id >= 0) {
            if ((st = td_ivec_push(&out, f.id))) goto out;
            prev_special = true;
            continue;
        }
        bool prefix = false;
        switch (tok->prefix) {
        case TD_PREFIX_NONE: break;
        case TD_PREFIX_FIRST_OR_AFTER_SPECIAL: prefix = prev_special; break;
        case TD_PREFIX_FIRST: prefix = i == 0; break;
        case TD_PREFIX_ALWAYS: prefix = true; break;
        }
        if ((st = encode_fragment(tok, text + f.off, f.len, prefix, &out))) goto out;
        prev_special = false;
    }
    if (add_special && tok->add_eos && (st = td_ivec_push(&out, tok->eos))) goto out;
    if (!out.v && !(out.v = malloc(sizeof(int32_t)))) { /* empty: still a freeable pointer */
        st = TD_ERR_NOMEM;
        goto out;
    }
    free(fv.v);
    *n_p = out.n;
    *tokens_p = out.v;
    return TD_OK;
out:
    free(fv.v);
    free(out.v);
    return st;
}

/* ------------------------------------------------------------- decoding */

typedef struct {
    char *v;
    size_t n, cap;
} byte_vec;

static td_status bv_put(byte_vec *b, const void *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1) cap *= 2;
        char *v = realloc(b->v, cap);
        if (!v) return TD_ERR_NOMEM;
        b->v = v;
        b->cap = cap;
    }
    memcpy(b->v + b->n, s, n);
    b->n += n;
    b->v[b->n] = 0;
    return TD_OK;
}

/* Writes the bytes of token id into out (cap bytes); returns the full
 * length (may exceed cap: the rest is cut). *normal_p: the piece comes from
 * a normal vocabulary entry (subject to SentencePiece's leading-space strip). */
static size_t token_piece(const td_tokenizer *tok, int32_t id, bool skip_special, char *out,
                          size_t cap, bool *normal_p) {
    *normal_p = false;
    if (id < 0 || id >= tok->n_vocab) return 0;
    uint8_t t = tok->type[id];
    const char *s = tok->text[id] ? tok->text[id] : "";
    size_t n = tok->len[id], o = 0;
#define PUT(c)                                                                                     \
    do {                                                                                           \
        if (o < cap) out[o] = (char)(c);                                                           \
        o++;                                                                                       \
    } while (0)
    switch (t) {
    case TD_TOKT_CONTROL:
    case TD_TOKT_UNKNOWN:
        if (skip_special) return 0;
        for (size_t i = 0; i < n; i++) PUT(s[i]);
        return o;
    case TD_TOKT_USER_DEFINED:
        for (size_t i = 0; i < n; i++) PUT(s[i]);
        return o;
    case TD_TOKT_BYTE:
        for (int b = 0; b < 256; b++) {
            if (tok->byte_token[b] == id) {
                PUT(b);
                return o;
            }
        }
        break;
    default: break;
    }
    *normal_p = true;
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t l = td_utf8_decode(u + i, n - i, &cp);
        if (l == 0) {
            PUT(u[i]);
            i++;
            continue;
        }
        if (tok->byte_level) {
            int b = td_cp_to_byte(cp);
            if (b >= 0) {
                PUT(b);
            } else {
                for (size_t k = 0; k < l; k++) PUT(u[i + k]);
            }
        } else if (tok->escape_whitespace && cp == 0x2581) {
            PUT(' ');
        } else {
            for (size_t k = 0; k < l; k++) PUT(u[i + k]);
        }
        i += l;
    }
#undef PUT
    return o;
}

size_t td_tokenizer_token_to_piece(const td_tokenizer *tok, int32_t id, bool skip_special,
                                   char *buf, size_t cap) {
    bool normal;
    if (!tok || (!buf && cap > 0)) return 0;
    return token_piece(tok, id, skip_special, buf, cap, &normal);
}

td_status td_tokenizer_decode(const td_tokenizer *tok, const int32_t *tokens, size_t n,
                              bool skip_special, char **text_p, size_t *len_p) {
    if (!tok || (!tokens && n > 0) || !text_p || !len_p) return TD_ERR_INVALID;
    byte_vec b = {0};
    td_status st = bv_put(&b, "", 0);
    bool first = true;
    char small[256];
    for (size_t i = 0; i < n && !st; i++) {
        if (tokens[i] < 0 || tokens[i] >= tok->n_vocab) {
            TD_LOG_ERROR("token id %d out of range (n_vocab %d)", (int)tokens[i],
                         (int)tok->n_vocab);
            st = TD_ERR_INVALID;
            break;
        }
        bool normal;
        size_t need = token_piece(tok, tokens[i], skip_special, small, sizeof(small), &normal);
        char *piece = small;
        if (need > sizeof(small)) {
            piece = malloc(need);
            if (!piece) {
                st = TD_ERR_NOMEM;
                break;
            }
            token_piece(tok, tokens[i], skip_special, piece, need, &normal);
        }
        size_t skip = 0;
        if (need > 0 && first) {
            if (tok->strip_leading_space_on_decode && normal && piece[0] == ' ') skip = 1;
            first = false;
        }
        st = bv_put(&b, piece + skip, need - skip);
        if (piece != small) free(piece);
    }
    if (st) {
        free(b.v);
        return st;
    }
    *text_p = b.v;
    *len_p = b.n;
    return TD_OK;
}

/* ------------------------------------------------------- detokenization */

void td_detok_init(td_detok *d, bool skip_special) {
    memset(d, 0, sizeof(*d));
    d->first = true;
    d->skip_special = skip_special;
}

/* Length of the valid-or-incomplete UTF-8 prefix state at s[0..n):
 * returns 0 if s[0..n) is an incomplete but possibly valid sequence,
 * -1 if s[0] can never start a valid sequence, else the complete length. */
static int utf8_status(const unsigned char *s, size_t n) {
    unsigned char c = s[0];
    size_t need;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF)
        need = 2;
    else if (c >= 0xE0 && c <= 0xEF)
        need = 3;
    else if (c >= 0xF0 && c <= 0xF4)
        need = 4;
    else
        return -1;
    for (size_t i = 1; i < need; i++) {
        if (i >= n) return 0;
        if ((s[i] & 0xC0) != 0x80) return -1;
        /* second-byte ranges that rule out overlongs and surrogates */
        if (i == 1) {
            if (c == 0xE0 && s[1] < 0xA0) return -1;
            if (c == 0xED && s[1] > 0x9F) return -1;
            if (c == 0xF0 && s[1] < 0x90) return -1;
            if (c == 0xF4 && s[1] > 0x8F) return -1;
        }
    }
    return (int)need;
}

/* Emits complete sequences of buf[0..n) into out; invalid bytes become
 * U+FFFD; an incomplete tail is kept in d->pending. */
static size_t detok_emit(td_detok *d, const unsigned char *buf, size_t n, char *out, size_t cap,
                         bool final) {
    size_t o = 0, i = 0;
    d->n_pending = 0;
    while (i < n) {
        int st = utf8_status(buf + i, n - i);
        if (st == 0 && !final) {
            memcpy(d->pending, buf + i, n - i);
            d->n_pending = (int)(n - i);
            break;
        }
        if (st <= 0) {
            if (o + 3 <= cap) {
                memcpy(out + o, "\xEF\xBF\xBD", 3);
                o += 3;
            }
            /* an incomplete sequence at the end counts as one replacement */
            if (st == 0) break;
            i++;
            continue;
        }
        if (o + (size_t)st <= cap) {
            memcpy(out + o, buf + i, (size_t)st);
            o += (size_t)st;
        }
        i += (size_t)st;
    }
    return o;
}

size_t td_detok_push(const td_tokenizer *tok, td_detok *d, int32_t id, char *out, size_t cap) {
    if (!tok || !d || !out) return 0;
    if (d->n_pending < 0 || d->n_pending > 3) d->n_pending = 0;
    unsigned char small[128];
    bool normal;
    size_t need = token_piece(tok, id, d->skip_special, NULL, 0, &normal);
    size_t total = (size_t)d->n_pending + need;
    unsigned char *buf = total <= sizeof(small) ? small : malloc(total);
    if (!buf) return 0;
    memcpy(buf, d->pending, (size_t)d->n_pending);
    token_piece(tok, id, d->skip_special, (char *)buf + d->n_pending, need, &normal);
    size_t start = 0;
    if (need > 0 && d->first) {
        if (tok->strip_leading_space_on_decode && normal && buf[d->n_pending] == ' ') {
            memmove(buf + d->n_pending, buf + d->n_pending + 1, need - 1);
            total--;
        }
        d->first = false;
    }
    size_t o = detok_emit(d, buf + start, total - start, out, cap, false);
    if (buf != small) free(buf);
    return o;
}

size_t td_detok_flush(td_detok *d, char *out, size_t cap) {
    if (!d || !out || d->n_pending <= 0 || d->n_pending > 3) {
        if (d) d->n_pending = 0;
        return 0;
    }
    unsigned char buf[8];
    size_t n = (size_t)d->n_pending;
    memcpy(buf, d->pending, n);
    return detok_emit(d, buf, n, out, cap, true);
}
