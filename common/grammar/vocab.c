/* A vocabulary trie and the allowed-token mask (vocab.h). */
#include "common/grammar/vocab.h"

#include "common/grammar/util.h"

#include <stdlib.h>
#include <string.h>

typedef td_trie_node tnode;

/* One trie's arrays (td_trie). */
typedef struct {
    tnode *nodes;
    uint64_t *packed;
    int32_t *ids; /* token ids in trie order */
    uint32_t nnodes, max_depth;
} store;

struct td_vocab {
    int32_t n;
    store all, rest;     /* every token's trie; the trie of td_trie.rest */
    uint32_t *body_bits; /* td_trie.body_bits */
    uint8_t *body_max;   /* td_trie.body_max */
    td_trie trie, rest_trie;
    char **bytes; /* each token's bytes (NULL: not in the trie) */
    uint32_t *lens;
    uint8_t *eog;
    int32_t *eog_ids; /* the end-of-generation tokens */
    size_t neog;
};

typedef struct {
    const char *b;
    uint32_t len;
    int32_t id;
} entry;

static int cmp_entry(const void *x, const void *y) {
    const entry *a = x, *b = y;
    const uint32_t n = a->len < b->len ? a->len : b->len;
    int c = n ? memcmp(a->b, b->b, n) : 0;
    if (c) return c;
    if (a->len != b->len) return a->len < b->len ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

void td_vocab_free(td_vocab *v) {
    if (!v) return;
    if (v->bytes)
        for (int32_t i = 0; i < v->n; i++) free(v->bytes[i]);
    free(v->bytes);
    free(v->lens);
    store *st[2] = {&v->all, &v->rest};
    for (int k = 0; k < 2; k++) {
        free(st[k]->nodes);
        free(st[k]->packed);
        free(st[k]->ids);
    }
    free(v->body_bits);
    free(v->body_max);
    free(v->eog);
    free(v->eog_ids);
    free(v);
}

/* The characters of a JSON string body that b holds (whole UTF-8
 * characters, none of '"', '\\', U+0000-001F, U+007F), or -1. */
static long body_chars(const uint8_t *b, size_t n) {
    long c = 0;
    for (size_t i = 0; i < n; c++) {
        const uint8_t x = b[i];
        size_t len;
        uint8_t lo = 0x80, hi = 0xBF;
        if (x < 0x80) {
            if (x < 0x20 || x == '"' || x == '\\' || x == 0x7f) return -1;
            i++;
            continue;
        } else if (x >= 0xC2 && x <= 0xDF) {
            len = 2;
        } else if (x >= 0xE0 && x <= 0xEF) {
            len = 3;
            if (x == 0xE0) lo = 0xA0;
            if (x == 0xED) hi = 0x9F;
        } else if (x >= 0xF0 && x <= 0xF4) {
            len = 4;
            if (x == 0xF0) lo = 0x90;
            if (x == 0xF4) hi = 0x8F;
        } else {
            return -1;
        }
        if (i + len > n || b[i + 1] < lo || b[i + 1] > hi) return -1;
        for (size_t k = 2; k < len; k++)
            if (b[i + k] < 0x80 || b[i + k] > 0xBF) return -1;
        i += len;
    }
    return c;
}

/* The trie of the n entries e (sorted by cmp_entry) into st. */
static bool build_store(store *st, const entry *e, size_t n) {
    size_t total = 0;
    for (size_t i = 0; i < n; i++) total += e[i].len;
    /* at most one node per byte of every token */
    st->nodes = malloc((total ? total : 1) * sizeof *st->nodes);
    st->ids = malloc((n ? n : 1) * sizeof *st->ids);
    uint32_t *open = malloc((UINT16_MAX + 1) * sizeof *open); /* node index per depth */
    if (!st->nodes || !st->ids || !open) {
        free(open);
        return false;
    }
    uint32_t depth = 0, nid = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t cp = 0;
        if (i) {
            const uint32_t m = e[i - 1].len < e[i].len ? e[i - 1].len : e[i].len;
            while (cp < m && cp < depth && e[i - 1].b[cp] == e[i].b[cp]) cp++;
        }
        while (depth > cp) st->nodes[open[--depth]].end = st->nnodes; /* close */
        while (depth < e[i].len) {
            open[depth] = st->nnodes;
            if (depth + 1 > st->max_depth) st->max_depth = depth + 1;
            st->nodes[st->nnodes++] = (tnode){.byte = (uint8_t)e[i].b[depth],
                                              .depth = (uint16_t)(depth + 1),
                                              .tok = nid,
                                              .parent = depth ? open[depth - 1] : UINT32_MAX};
            depth++;
        }
        tnode *last = &st->nodes[open[depth - 1]];
        if (!last->ntok) last->tok = nid;
        last->ntok++;
        st->ids[nid++] = e[i].id;
    }
    while (depth > 0) st->nodes[open[--depth]].end = st->nnodes;
    free(open);
    if (!(st->packed = malloc((st->nnodes ? st->nnodes : 1) * sizeof *st->packed))) return false;
    for (uint32_t i = 0; i < st->nnodes; i++) {
        const tnode *t = &st->nodes[i];
        st->packed[i] = (uint64_t)t->byte | (uint64_t)t->depth << 8 |
                        (uint64_t)(t->ntok > 0) << 24 | (uint64_t)t->end << 32;
    }
    return true;
}

static td_trie trie_of(const store *st, int32_t n_tokens) {
    return (td_trie){.nodes = st->nodes,
                     .n = st->nnodes,
                     .max_depth = st->max_depth,
                     .ids = st->ids,
                     .n_tokens = n_tokens,
                     .packed = st->packed};
}

/* The tries of v's pieces (v->bytes, v->lens; NULL: not in the trie):
 * every token's, with the body slices (td_trie.body_bits, body_max), and
 * the rest's. */
static bool build_trie(td_vocab *v) {
    const size_t n = v->n > 0 ? (size_t)v->n : 1, words = (n + 31) / 32;
    entry *e = malloc(n * sizeof *e);
    uint8_t *chars = malloc(n); /* 1..TD_TRIE_BODY_MAX: a body of that many; else 0 */
    v->body_bits = calloc(words * TD_TRIE_BODY_MAX, sizeof *v->body_bits);
    size_t ne = 0;
    bool ok = false;
    if (!e || !chars || !v->body_bits) goto done;
    for (int32_t id = 0; id < v->n; id++) {
        chars[id] = 0;
        if (!v->bytes[id]) continue;
        e[ne++] = (entry){v->bytes[id], v->lens[id], id};
        const long c = body_chars((const uint8_t *)v->bytes[id], v->lens[id]);
        if (c > 0 && c <= TD_TRIE_BODY_MAX) chars[id] = (uint8_t)c;
    }
    if (ne) qsort(e, ne, sizeof *e, cmp_entry);
    if (!build_store(&v->all, e, ne)) goto done;
    /* row k - 1: the bodies of at most k characters */
    for (int32_t id = 0; id < v->n; id++)
        for (uint32_t k = chars[id]; k && k <= TD_TRIE_BODY_MAX; k++)
            v->body_bits[(k - 1) * words + (uint32_t)id / 32] |= 1u << (id % 32);
    /* per node, the most characters of a body below it (255: not only
     * bodies); children come after their parents */
    const uint32_t nn = v->all.nnodes;
    if (!(v->body_max = malloc(nn ? nn : 1))) goto done;
    for (uint32_t i = 0; i < nn; i++) {
        const tnode *t = &v->all.nodes[i];
        uint8_t mx = 0;
        for (uint32_t q = 0; q < t->ntok; q++) {
            const uint8_t c = chars[v->all.ids[t->tok + q]];
            const uint8_t x = c ? c : 255;
            if (x > mx) mx = x;
        }
        v->body_max[i] = mx;
    }
    for (uint32_t i = nn; i-- > 0;) {
        const uint32_t p = v->all.nodes[i].parent;
        if (p != UINT32_MAX && v->body_max[i] > v->body_max[p]) v->body_max[p] = v->body_max[i];
    }
    /* the rest: the entries that are no such body, still sorted */
    size_t nr = 0;
    for (size_t i = 0; i < ne; i++)
        if (!chars[e[i].id]) e[nr++] = e[i];
    if (!build_store(&v->rest, e, nr)) goto done;
    v->rest_trie = trie_of(&v->rest, v->n);
    v->trie = trie_of(&v->all, v->n);
    v->trie.body_bits = v->body_bits;
    v->trie.body_max = v->body_max;
    v->trie.rest = &v->rest_trie;
    ok = true;
done:
    free(e);
    free(chars);
    return ok;
}

/* b is special token id's engine bytes. */
static bool special_bytes(const char *b, int32_t id) {
    uint8_t want[TD_GR_TOKEN_BYTES];
    td_gr_token_bytes(id, want);
    return !memcmp(b, want, TD_GR_TOKEN_BYTES);
}

td_vocab *td_vocab_from_pieces(int32_t n, const char *const *pieces, const size_t *lens,
                               const int32_t *eog, size_t neog) {
    td_vocab *v = calloc(1, sizeof *v);
    if (!v) return NULL;
    v->n = n > 0 ? n : 0;
    const size_t sz = v->n ? (size_t)v->n : 1;
    v->bytes = calloc(sz, sizeof *v->bytes);
    v->lens = calloc(sz, sizeof *v->lens);
    v->eog = calloc(sz, 1);
    v->eog_ids = malloc((neog ? neog : 1) * sizeof *v->eog_ids);
    if (!v->bytes || !v->lens || !v->eog || !v->eog_ids) goto fail;
    for (size_t i = 0; i < neog; i++)
        if (eog[i] >= 0 && eog[i] < v->n && !v->eog[eog[i]]) {
            v->eog[eog[i]] = 1;
            v->eog_ids[v->neog++] = eog[i];
        }
    for (int32_t id = 0; id < v->n; id++) {
        if (!pieces[id] || !lens[id] || lens[id] > UINT16_MAX || v->eog[id]) continue;
        /* byte 0xFF is never in UTF-8 text: a token holding it is admitted
         * by no text constraint, and it must not spell a special token's
         * engine bytes (td_gr_token_bytes) */
        if (memchr(pieces[id], 0xFF, lens[id]) &&
            !(lens[id] == TD_GR_TOKEN_BYTES && (uint8_t)pieces[id][0] == 0xFF &&
              special_bytes(pieces[id], id)))
            continue;
        if (!(v->bytes[id] = malloc(lens[id]))) goto fail;
        memcpy(v->bytes[id], pieces[id], lens[id]);
        v->lens[id] = (uint32_t)lens[id];
    }
    if (build_trie(v)) return v;
fail:
    td_vocab_free(v);
    return NULL;
}

td_vocab *td_vocab_new(const td_tokenizer *tok) {
    const int32_t n = td_tokenizer_n_vocab(tok);
    const size_t sz = n > 0 ? (size_t)n : 1;
    char **pieces = calloc(sz, sizeof *pieces);
    size_t *lens = calloc(sz, sizeof *lens);
    td_vocab *v = NULL;
    if (!pieces || !lens) goto done;
    for (int32_t id = 0; id < n; id++) {
        if (td_tokenizer_is_special(tok, id)) {
            /* reachable only through a grammar's token terminal */
            if (td_tokenizer_is_eog(tok, id) || !(pieces[id] = malloc(TD_GR_TOKEN_BYTES))) continue;
            td_gr_token_bytes(id, (uint8_t *)pieces[id]);
            lens[id] = TD_GR_TOKEN_BYTES;
            continue;
        }
        char small[64];
        size_t len = td_tokenizer_token_to_piece(tok, id, false, small, sizeof small);
        if (!len) continue;
        if (!(pieces[id] = malloc(len))) goto done;
        if (len <= sizeof small)
            memcpy(pieces[id], small, len);
        else
            td_tokenizer_token_to_piece(tok, id, false, pieces[id], len);
        lens[id] = len;
    }
    size_t neog = 0;
    const int32_t *eog = td_tokenizer_eog_ids(tok, &neog);
    v = td_vocab_from_pieces(n, (const char *const *)pieces, lens, eog, neog);
done:
    if (pieces)
        for (int32_t id = 0; id < n; id++) free(pieces[id]);
    free(pieces);
    free(lens);
    return v;
}

int32_t td_vocab_size(const td_vocab *v) { return v->n; }
size_t td_vocab_mask_words(const td_vocab *v) { return ((size_t)v->n + 31) / 32; }
bool td_vocab_is_eog(const td_vocab *v, int32_t id) { return id >= 0 && id < v->n && v->eog[id]; }

/* The bits set in mask's n words: the POPCNT instruction where the CPU
 * has it (every x86-64 of the last 15 years), picked at load time. */
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
__attribute__((target_clones("popcnt", "default")))
#endif
static int64_t
count_bits(const uint32_t *mask, size_t n) {
    int64_t c = 0;
    for (size_t w = 0; w < n; w++) c += __builtin_popcount(mask[w]);
    return c;
}

int64_t td_gm_mask(td_gm *m, const td_vocab *v, uint32_t *mask) {
    memset(mask, 0, td_vocab_mask_words(v) * sizeof *mask);
    if (td_gm_stopped(m)) return 0;
    if (td_gm_walk(m, &v->trie, mask) < 0) return -1;
    int64_t count = 0;
    if (td_gm_accepting(m))
        for (size_t i = 0; i < v->neog; i++) {
            const int32_t id = v->eog_ids[i];
            mask[id / 32] |= 1u << (id % 32);
        }
    count = count_bits(mask, td_vocab_mask_words(v));
    return td_gm_error(m) ? -1 : count;
}

td_gm_result td_gm_consume_token(td_gm *m, const td_vocab *v, int32_t id, size_t *bytes_taken) {
    if (bytes_taken) *bytes_taken = 0;
    if (id < 0 || id >= v->n || td_gm_stopped(m)) return TD_GM_REJECT;
    if (v->eog[id]) {
        if (!td_gm_accepting(m)) return td_gm_error(m) ? TD_GM_LIMIT : TD_GM_REJECT;
        td_gm_stop(m);
        return TD_GM_OK;
    }
    if (!v->bytes[id]) return TD_GM_REJECT;
    size_t done = 0;
    td_gm_result r = td_gm_push_bytes(m, v->bytes[id], v->lens[id], &done);
    if (bytes_taken) *bytes_taken = done;
    if (r != TD_GM_OK) td_gm_pop(m, done);
    return r;
}

int64_t td_gm_forced_tokens(td_gm *m, const td_vocab *v, const td_tokenizer *tok, int32_t *out,
                            size_t max) {
    uint8_t bytes[256];
    const int64_t nb = td_gm_forced_bytes(m, bytes, sizeof bytes);
    if (nb <= 0) return nb;
    /* special tokens (their engine bytes) as themselves, text between them
     * tokenized; the last text token dropped */
    int32_t cand[256];
    size_t nc = 0;
    for (int64_t i = 0; i < nb && nc < sizeof cand / sizeof *cand;) {
        if (bytes[i] == 0xFF) {
            if (i + TD_GR_TOKEN_BYTES > nb) break;
            int32_t id = 0;
            for (int k = 1; k < TD_GR_TOKEN_BYTES; k++)
                id = (int32_t)((uint32_t)id << 8 | bytes[i + k]);
            cand[nc++] = id;
            i += TD_GR_TOKEN_BYTES;
            continue;
        }
        int64_t j = i;
        while (j < nb && bytes[j] != 0xFF) j++;
        int32_t *ids = NULL;
        size_t nt = 0;
        if (td_tokenizer_encode(tok, (const char *)bytes + i, (size_t)(j - i), false, false, &ids,
                                &nt))
            break;
        const bool last = j == nb; /* what follows may merge with its last token */
        for (size_t k = 0; k + (last ? 1 : 0) < nt && nc < sizeof cand / sizeof *cand; k++)
            cand[nc++] = ids[k];
        free(ids);
        if (last) break;
        i = j;
    }
    size_t k = 0, depth0 = td_gm_depth(m);
    for (; k < nc && k < max; k++) {
        if (td_gm_consume_token(m, v, cand[k], NULL) != TD_GM_OK) break;
        out[k] = cand[k];
    }
    td_gm_pop(m, td_gm_depth(m) - depth0);
    return td_gm_error(m) ? -1 : (int64_t)k;
}
