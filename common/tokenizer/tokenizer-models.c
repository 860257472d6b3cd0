/* The two merge models, run on one pre-tokenized piece:
 *  - BPE by merge rank (GPT-2 byte-level, Hugging Face BPE with optional
 *    byte fallback): repeatedly merge the adjacent pair with the lowest
 *    rank, leftmost first;
 *  - SentencePiece BPE by score: repeatedly merge the adjacent pair whose
 *    concatenation is a vocabulary entry with the highest score, leftmost
 *    first; unknown characters fall back to <0xXX> byte tokens.
 * Both use a binary heap of candidate pairs with lazy invalidation, so a
 * piece of n symbols costs O(n log n) even for pathological inputs. */
#include <stdlib.h>
#include <string.h>

#include "tokenizer-impl.h"

bool td_tok_merge_lookup(const td_tokenizer *tok, int32_t a, int32_t b, int32_t *rank_p,
                         int32_t *merged_p);

typedef struct {
    double key;   /* smaller is better */
    int32_t left; /* symbol index; ties go to the leftmost pair */
    int32_t right;
    uint32_t size; /* combined byte length when pushed, to detect stale entries */
    int32_t merged;
} cand;

typedef struct {
    cand *v;
    size_t n, cap;
} heap;

static bool cand_less(const cand *a, const cand *b) {
    return a->key < b->key || (a->key == b->key && a->left < b->left);
}

static td_status heap_push(heap *h, cand c) {
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 64;
        cand *v = realloc(h->v, cap * sizeof(*v));
        if (!v) return TD_ERR_NOMEM;
        h->v = v;
        h->cap = cap;
    }
    size_t i = h->n++;
    h->v[i] = c;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(&h->v[i], &h->v[p])) break;
        cand t = h->v[i];
        h->v[i] = h->v[p];
        h->v[p] = t;
        i = p;
    }
    return TD_OK;
}

static cand heap_pop(heap *h) {
    cand top = h->v[0];
    h->v[0] = h->v[--h->n];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < h->n && cand_less(&h->v[l], &h->v[m])) m = l;
        if (r < h->n && cand_less(&h->v[r], &h->v[m])) m = r;
        if (m == i) break;
        cand t = h->v[i];
        h->v[i] = h->v[m];
        h->v[m] = t;
        i = m;
    }
    return top;
}

typedef struct {
    int32_t *id;
    uint32_t *start, *n;
    int32_t *prev, *next;
    size_t count, cap;
} syms;

static td_status syms_init(syms *s, size_t cap) {
    memset(s, 0, sizeof(*s));
    if (cap == 0) cap = 1;
    s->id = malloc(cap * sizeof(int32_t));
    s->start = malloc(cap * sizeof(uint32_t));
    s->n = malloc(cap * sizeof(uint32_t));
    s->prev = malloc(cap * sizeof(int32_t));
    s->next = malloc(cap * sizeof(int32_t));
    s->cap = cap;
    if (!s->id || !s->start || !s->n || !s->prev || !s->next) return TD_ERR_NOMEM;
    return TD_OK;
}

static void syms_free(syms *s) {
    free(s->id);
    free(s->start);
    free(s->n);
    free(s->prev);
    free(s->next);
}

static void syms_add(syms *s, int32_t id, size_t start, size_t n) {
    size_t i = s->count++;
    s->id[i] = id;
    s->start[i] = (uint32_t)start;
    s->n[i] = (uint32_t)n;
    s->prev[i] = (int32_t)i - 1;
    s->next[i] = (int32_t)i + 1;
}

/* ------------------------------------------------------------------ BPE */

static td_status bpe_try_pair(const td_tokenizer *tok, syms *s, heap *h, int32_t l, int32_t r) {
    if (l < 0 || r < 0 || (size_t)r >= s->count) return TD_OK;
    int32_t rank, merged;
    if (!td_tok_merge_lookup(tok, s->id[l], s->id[r], &rank, &merged)) return TD_OK;
    cand c = {(double)rank, l, r, s->n[l] + s->n[r], merged};
    return heap_push(h, c);
}

td_status td_tok_bpe_piece(const td_tokenizer *tok, const char *str, size_t n, td_ivec *out) {
    const unsigned char *u = (const unsigned char *)str;
    if (n == 0) return TD_OK;
    if (n > UINT32_MAX / 2) return TD_ERR_RANGE;
    td_status st;

    if (tok->ignore_merges) {
        int32_t whole = -1;
        if (tok->byte_level) {
            size_t cap;
            if (td_mul_overflow(n, 2, &cap)) return TD_ERR_RANGE;
            char *m = malloc(cap + 1);
            if (!m) return TD_ERR_NOMEM;
            size_t o = 0;
            for (size_t i = 0; i < n; i++) o += (size_t)td_utf8_put(td_byte_to_cp(u[i]), m + o);
            whole = td_tok_find(tok, m, o);
            free(m);
        } else {
            whole = td_tok_find(tok, str, n);
        }
        if (whole >= 0) return td_ivec_push(out, whole);
    }

    syms s;
    heap h = {0};
    /* byte fallback can make up to one symbol per byte */
    if ((st = syms_init(&s, n))) goto out;
    if (tok->byte_level) {
        for (size_t i = 0; i < n; i++) syms_add(&s, tok->byte_char_token[u[i]], i, 1);
    } else {
        for (size_t i = 0; i < n;) {
            size_t l = td_utf8_len(u + i, n - i);
            int32_t id = td_tok_find(tok, str + i, l);
            if (id >= 0) {
                syms_add(&s, id, i, l);
            } else {
                bool all = tok->byte_fallback;
                for (size_t k = 0; k < l && all; k++) all = tok->byte_token[u[i + k]] >= 0;
                if (all) {
                    for (size_t k = 0; k < l; k++)
                        syms_add(&s, tok->byte_token[u[i + k]], i + k, 1);
                } else if (tok->fuse_unk && s.count > 0 && s.id[s.count - 1] == tok->unk &&
                           tok->unk >= 0) {
                    s.n[s.count - 1] += (uint32_t)l;
                } else {
                    syms_add(&s, tok->unk, i, l);
                }
            }
            i += l;
        }
    }
    if (s.count > 0) s.next[s.count - 1] = -1;

    for (size_t i = 0; i + 1 < s.count; i++)
        if ((st = bpe_try_pair(tok, &s, &h, (int32_t)i, (int32_t)i + 1))) goto out;
    while (h.n > 0) {
        cand c = heap_pop(&h);
        int32_t l = c.left, r = c.right;
        if (s.n[l] == 0 || s.n[r] == 0 || s.next[l] != r || s.n[l] + s.n[r] != c.size) continue;
        s.id[l] = c.merged;
        s.n[l] += s.n[r];
        s.n[r] = 0;
        s.next[l] = s.next[r];
        if (s.next[r] >= 0) s.prev[s.next[r]] = l;
        if ((st = bpe_try_pair(tok, &s, &h, s.prev[l], l))) goto out;
        if ((st = bpe_try_pair(tok, &s, &h, l, s.next[l]))) goto out;
    }
    for (int32_t i = s.count ? 0 : -1; i >= 0; i = s.next[i]) {
        if (s.id[i] >= 0) {
            if ((st = td_ivec_push(out, s.id[i]))) goto out;
        } else if (tok->unk >= 0 && !tok->byte_level) {
            /* a byte-level vocabulary without this byte's character drops it
             * (llama.cpp does the same); elsewhere it is the unknown token */
            if ((st = td_ivec_push(out, tok->unk))) goto out;
        }
    }
    st = TD_OK;
out:
    free(h.v);
    syms_free(&s);
    return st;
}

/* ------------------------------------------------------------------ SPM */

static td_status spm_try_pair(const td_tokenizer *tok, const char *str, syms *s, heap *h, int32_t l,
                              int32_t r) {
    if (l < 0 || r < 0 || (size_t)r >= s->count) return TD_OK;
    size_t len = (size_t)s->n[l] + s->n[r];
    int32_t id = td_tok_find(tok, str + s->start[l], len);
    if (id < 0) return TD_OK;
    cand c = {-(double)tok->score[id], l, r, (uint32_t)len, id};
    return heap_push(h, c);
}

td_status td_tok_spm_piece(const td_tokenizer *tok, const char *str, size_t n, td_ivec *out) {
    const unsigned char *u = (const unsigned char *)str;
    if (n == 0) return TD_OK;
    if (n > UINT32_MAX / 2) return TD_ERR_RANGE;
    td_status st;
    syms s;
    heap h = {0};
    if ((st = syms_init(&s, n))) goto out;
    for (size_t i = 0; i < n;) {
        size_t l = td_utf8_len(u + i, n - i);
        syms_add(&s, -1, i, l);
        i += l;
    }
    s.next[s.count - 1] = -1;
    for (size_t i = 0; i + 1 < s.count; i++)
        if ((st = spm_try_pair(tok, str, &s, &h, (int32_t)i, (int32_t)i + 1))) goto out;
    while (h.n > 0) {
        cand c = heap_pop(&h);
        int32_t l = c.left, r = c.right;
        if (s.n[l] == 0 || s.n[r] == 0 || s.next[l] != r || s.n[l] + s.n[r] != c.size) continue;
        s.n[l] += s.n[r];
        s.n[r] = 0;
        s.next[l] = s.next[r];
        if (s.next[r] >= 0) s.prev[s.next[r]] = l;
        if ((st = spm_try_pair(tok, str, &s, &h, s.prev[l], l))) goto out;
        if ((st = spm_try_pair(tok, str, &s, &h, l, s.next[l]))) goto out;
    }
    for (int32_t i = 0; i >= 0; i = s.next[i]) {
        int32_t id = td_tok_find(tok, str + s.start[i], s.n[i]);
        if (id >= 0) {
            if ((st = td_ivec_push(out, id))) goto out;
            continue;
        }
        /* every merged symbol is a vocabulary entry, so only single
         * characters get here: spell them as byte tokens */
        for (uint32_t k = 0; k < s.n[i]; k++) {
            int32_t b = tok->byte_token[u[s.start[i] + k]];
            if (b < 0) b = tok->unk;
            if (b >= 0 && (st = td_ivec_push(out, b))) goto out;
        }
    }
    st = TD_OK;
out:
    free(h.v);
    syms_free(&s);
    return st;
}
