/* A vocabulary trie and the allowed-token mask (vocab.h). */
#include "common/grammar/vocab.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    uint8_t byte;
    uint16_t depth;     /* 1 for the root's children */
    uint32_t end;       /* the node after this one's subtree */
    uint32_t tok, ntok; /* tokens ending here: ids[tok .. tok + ntok) */
} tnode;

struct td_vocab {
    int32_t n;
    tnode *nodes;
    uint32_t nnodes;
    int32_t *ids; /* token ids in trie order */
    char **bytes; /* each token's bytes (NULL: not in the trie) */
    uint32_t *lens;
    uint8_t *eog;
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
    free(v->nodes);
    free(v->ids);
    free(v->eog);
    free(v);
}

td_vocab *td_vocab_new(const td_tokenizer *tok) {
    td_vocab *v = calloc(1, sizeof *v);
    if (!v) return NULL;
    v->n = td_tokenizer_n_vocab(tok);
    const size_t n = v->n > 0 ? (size_t)v->n : 1;
    v->bytes = calloc(n, sizeof *v->bytes);
    v->lens = calloc(n, sizeof *v->lens);
    v->eog = calloc(n, 1);
    v->ids = malloc(n * sizeof *v->ids);
    entry *e = malloc(n * sizeof *e);
    size_t total = 0, ne = 0;
    if (!v->bytes || !v->lens || !v->eog || !v->ids || !e) goto fail;
    size_t neog = 0;
    const int32_t *eog = td_tokenizer_eog_ids(tok, &neog);
    for (size_t i = 0; i < neog; i++)
        if (eog[i] >= 0 && eog[i] < v->n) v->eog[eog[i]] = 1;
    for (int32_t id = 0; id < v->n; id++) {
        if (td_tokenizer_is_special(tok, id) || v->eog[id]) continue;
        char small[64];
        size_t len = td_tokenizer_token_to_piece(tok, id, false, small, sizeof small);
        if (!len || len > UINT16_MAX) continue;
        char *b = malloc(len);
        if (!b) goto fail;
        if (len <= sizeof small)
            memcpy(b, small, len);
        else
            td_tokenizer_token_to_piece(tok, id, false, b, len);
        v->bytes[id] = b;
        v->lens[id] = (uint32_t)len;
        e[ne++] = (entry){b, (uint32_t)len, id};
        total += len;
    }
    if (ne) qsort(e, ne, sizeof *e, cmp_entry);
    /* at most one node per byte of every token */
    v->nodes = malloc((total ? total : 1) * sizeof *v->nodes);
    uint32_t *open = malloc((UINT16_MAX + 1) * sizeof *open); /* node index per depth */
    if (!v->nodes || !open) {
        free(open);
        goto fail;
    }
    uint32_t depth = 0, nid = 0;
    for (size_t i = 0; i < ne; i++) {
        uint32_t cp = 0;
        if (i) {
            const uint32_t m = e[i - 1].len < e[i].len ? e[i - 1].len : e[i].len;
            while (cp < m && cp < depth && e[i - 1].b[cp] == e[i].b[cp]) cp++;
        }
        while (depth > cp) v->nodes[open[--depth]].end = v->nnodes; /* close */
        while (depth < e[i].len) {
            open[depth] = v->nnodes;
            v->nodes[v->nnodes++] =
                (tnode){.byte = (uint8_t)e[i].b[depth], .depth = (uint16_t)(depth + 1), .tok = nid};
            depth++;
        }
        tnode *last = &v->nodes[open[depth - 1]];
        if (!last->ntok) last->tok = nid;
        last->ntok++;
        v->ids[nid++] = e[i].id;
    }
    while (depth > 0) v->nodes[open[--depth]].end = v->nnodes;
    free(open);
    free(e);
    return v;
fail:
    free(e);
    td_vocab_free(v);
    return NULL;
}

int32_t td_vocab_size(const td_vocab *v) { return v->n; }
size_t td_vocab_mask_words(const td_vocab *v) { return ((size_t)v->n + 31) / 32; }
bool td_vocab_is_eog(const td_vocab *v, int32_t id) { return id >= 0 && id < v->n && v->eog[id]; }

int64_t td_gm_mask(td_gm *m, const td_vocab *v, uint32_t *mask) {
    memset(mask, 0, td_vocab_mask_words(v) * sizeof *mask);
    if (td_gm_stopped(m)) return 0;
    int64_t count = 0;
    size_t cd = 0; /* bytes this walk has pushed */
    for (uint32_t i = 0; i < v->nnodes;) {
        const tnode *t = &v->nodes[i];
        const size_t d = t->depth;
        if (cd > d - 1) td_gm_pop(m, cd - (d - 1));
        cd = d - 1;
        const td_gm_result r = td_gm_push(m, t->byte);
        if (r == TD_GM_LIMIT) {
            td_gm_pop(m, cd);
            return -1;
        }
        if (r != TD_GM_OK) {
            i = t->end;
            continue;
        }
        cd = d;
        for (uint32_t k = 0; k < t->ntok; k++) {
            const int32_t id = v->ids[t->tok + k];
            mask[id / 32] |= 1u << (id % 32);
        }
        count += t->ntok;
        i++;
    }
    td_gm_pop(m, cd);
    if (td_gm_accepting(m))
        for (int32_t id = 0; id < v->n; id++)
            if (v->eog[id]) {
                mask[id / 32] |= 1u << (id % 32);
                count++;
            }
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
