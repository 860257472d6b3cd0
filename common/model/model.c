/* Model loading: config from GGUF metadata or config.json, weights as the
 * shard for (tp_rank, tp_size) and a layer range, validated against the
 * config before anything reads them.
 *
 * Sharding without copies: a column-parallel slice (rows of Q/K/V/gate/up)
 * is a contiguous range of rows; a row-parallel slice (columns of wo and
 * w_down) keeps the full row stride and starts at the column's block
 * offset, so both point into the mapping. Only small vectors (norms,
 * biases) become owned F32 copies, and matrices whose data is not aligned
 * to their element size (possible in safetensors) are copied once. */
#include "model.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "common/format/gguf.h"
#include "common/format/safetensors.h"

#define TD_MAX_DIM     (1 << 20) /* sanity bound on embedding / ff widths */
#define TD_MAX_LAYERS  4096
#define TD_MAX_HEADS   4096
#define TD_MAX_VOCAB   (1 << 24)
#define TD_MAX_EXPERTS 4096

struct td_model {
    td_model_config cfg;
    char *path;
    td_gguf *gguf;
    td_st *st;
    td_tokenizer *tok;
    int tp_rank, tp_size;
    int ep_rank, ep_size; /* expert parallelism: this shard's slice of the experts */
    int layer_begin, layer_end;
    int n_head_local, n_head_kv_local;
    td_layer_weights *layers; /* (layer_end - layer_begin) */
    bool has_embd, has_output;
    td_weight tok_embd; /* (n_vocab, n_embd) */
    td_weight output;   /* (n_vocab, n_embd) */
    float *output_norm; /* (n_embd) */
    float *inv_freq;    /* (n_rot / 2) */
    size_t weight_bytes;
    /* vocab-parallel embedding and head: this shard's rows of token_embd / output */
    int32_t vocab_begin, vocab_end;
    void **owned; /* buffers freed with the model */
    size_t n_owned, cap_owned;
};

/* A tensor as the file describes it, in GGUF's dimension order
 * (ne[0] innermost), whatever the format. */
typedef struct {
    const char *name;
    int type;              /* td_dtype, or an unsupported id / -1 */
    const char *type_name; /* for messages */
    int n_dims;
    int64_t ne[4];
    const void *data;
    size_t nbytes;
} src_tensor;

typedef struct {
    td_model *m;
    const char *path;
    bool hf;
} loader;

td_model_params td_model_default_params(void) {
    td_model_params p = {.path = NULL,
                         .tp_rank = 0,
                         .tp_size = 1,
                         .layer_begin = 0,
                         .layer_end = -1,
                         .ep_rank = 0,
                         .ep_size = 1};
    return p;
}

static void *owned_alloc(td_model *m, size_t bytes) {
    if (m->n_owned == m->cap_owned) {
        size_t cap = m->cap_owned ? m->cap_owned * 2 : 64;
        void **o = realloc(m->owned, cap * sizeof *o);
        if (!o) return NULL;
        m->owned = o;
        m->cap_owned = cap;
    }
    size_t rounded = (bytes + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, rounded ? rounded : 64);
    if (!p) return NULL;
    m->owned[m->n_owned++] = p;
    return p;
}

static bool find_tensor(const loader *ld, const char *name, src_tensor *t) {
    memset(t, 0, sizeof *t);
    if (!ld->hf) {
        const td_gguf_tensor *g = td_gguf_find_tensor(ld->m->gguf, name);
        if (!g) return false;
        t->name = g->name;
        t->type = g->type;
        t->type_name = td_dtype_name(g->type);
        t->n_dims = g->n_dims;
        for (int i = 0; i < 4; i++) t->ne[i] = g->ne[i];
        t->data = g->data;
        t->nbytes = g->nbytes;
        return true;
    }
    const td_st_tensor *s = td_st_find(ld->m->st, name);
    if (!s) return false;
    t->name = s->name;
    t->type = s->type;
    t->type_name = s->dtype ? s->dtype : "unknown";
    t->n_dims = s->n_dims;
    for (int i = 0; i < 4; i++) t->ne[i] = 1;
    for (int i = 0; i < s->n_dims && i < 4; i++) t->ne[i] = s->shape[s->n_dims - 1 - i];
    t->data = s->data;
    t->nbytes = s->nbytes;
    return true;
}

static td_status tensor_lookup(const loader *ld, const char *name, src_tensor *t) {
    if (!find_tensor(ld, name, t)) {
        TD_LOG_ERROR("%s: tensor '%s' is missing", ld->path, name);
        return TD_ERR_NOT_FOUND;
    }
    if (t->type < 0 || !td_dtype_supported(t->type)) {
        TD_LOG_ERROR("%s: tensor '%s': type %s is not supported (f32, f16, bf16, q8_0, q4_0, q4_1, "
                     "q5_0, q5_1, q4_K, q5_K, q6_K are)",
                     ld->path, name, t->type_name);
        return TD_ERR_UNSUPPORTED;
    }
    return TD_OK;
}

static void shape_str(const src_tensor *t, char *buf, size_t cap) {
    int n = snprintf(buf, cap, "[");
    for (int i = 0; i < t->n_dims && i < 4 && n > 0 && (size_t)n < cap; i++)
        n += snprintf(buf + n, cap - (size_t)n, "%s%lld", i ? ", " : "", (long long)t->ne[i]);
    if (n > 0 && (size_t)n < cap) snprintf(buf + n, cap - (size_t)n, "]");
}

/* Every fp16 scale (and min) of a quantized tensor is finite: a NaN or
 * infinite scale would turn whole rows of logits into NaN, far from the
 * file. One pass over the blocks' scale bytes, which the weight copy reads
 * anyway (docs/MODELS.md gives its cost). */
static td_status check_scales(const loader *ld, const src_tensor *t) {
    int off[2];
    int nf = td_dtype_fp16_fields((td_dtype)t->type, off);
    if (nf == 0) return TD_OK;
    const size_t bb = td_dtype_block_bytes((td_dtype)t->type), nb = t->nbytes / bb;
    const uint8_t *p = t->data;
    for (size_t b = 0; b < nb; b++, p += bb)
        for (int f = 0; f < nf; f++) {
            uint16_t h = (uint16_t)(p[off[f]] | p[off[f] + 1] << 8);
            if ((h & 0x7c00) == 0x7c00) {
                TD_LOG_ERROR("%s: tensor '%s': block %zu has a non-finite %s (fp16 0x%04x)",
                             ld->path, t->name, b, f == 0 ? "scale" : "min", h);
                return TD_ERR_FORMAT;
            }
        }
    return TD_OK;
}

/* Checks that t is (rows, cols) (ne = [cols, rows], trailing dims 1). */
/* The data of t is exactly n_rows rows of cols elements of its type, and
 * its scales are finite. */
static td_status check_bytes(const loader *ld, const src_tensor *t, int64_t n_rows, int64_t cols) {
    size_t row_bytes = td_dtype_row_bytes((td_dtype)t->type, cols), total;
    if (row_bytes == 0) {
        TD_LOG_ERROR("%s: tensor '%s': row of %lld elements is not a whole number of %s blocks",
                     ld->path, t->name, (long long)cols, t->type_name);
        return TD_ERR_FORMAT;
    }
    if (td_mul_overflow(row_bytes, (size_t)n_rows, &total) || total != t->nbytes) {
        TD_LOG_ERROR("%s: tensor '%s': %zu bytes of data, expected %lld rows of %zu", ld->path,
                     t->name, t->nbytes, (long long)n_rows, row_bytes);
        return TD_ERR_FORMAT;
    }
    return check_scales(ld, t);
}

static td_status check_shape2(const loader *ld, const src_tensor *t, int64_t rows, int64_t cols) {
    bool ok = t->n_dims >= 1 && t->ne[0] == cols && (t->n_dims >= 2 ? t->ne[1] : 1) == rows;
    for (int i = 2; i < t->n_dims && i < 4; i++) ok = ok && t->ne[i] == 1;
    if (!ok) {
        char got[96];
        shape_str(t, got, sizeof got);
        TD_LOG_ERROR("%s: tensor '%s': shape %s, expected [%lld, %lld]", ld->path, t->name, got,
                     (long long)cols, (long long)rows);
        return TD_ERR_FORMAT;
    }
    return check_bytes(ld, t, rows, cols);
}

static size_t elem_align(td_dtype t) {
    switch (t) {
    case TD_TYPE_F32: return 4;
    default: return 2; /* F16/BF16 elements, and the fp16 scales of quant blocks */
    }
}

/* The shard rows [r0, r0 + nr), columns [c0, c0 + nc) of the (rows, cols)
 * matrix of t's type at mat (t itself, or one expert of a 3-D tensor).
 * Columns must split at block boundaries. */
static td_status slice_matrix(loader *ld, const src_tensor *t, const uint8_t *mat, int64_t cols,
                              int64_t r0, int64_t nr, int64_t c0, int64_t nc, td_weight *w) {
    const char *name = t->name;
    td_dtype type = (td_dtype)t->type;
    int be = td_dtype_block_elems(type);
    if (c0 % be != 0 || nc % be != 0) {
        TD_LOG_ERROR("%s: tensor '%s': the shard's columns [%lld, %lld) of %lld (--tp %d) do not "
                     "split at %s block boundaries (%d elements): choose a --tp that divides "
                     "its rows into whole blocks",
                     ld->path, name, (long long)c0, (long long)(c0 + nc), (long long)cols,
                     ld->m->tp_size, t->type_name, be);
        return TD_ERR_UNSUPPORTED;
    }
    size_t row_bytes = td_dtype_row_bytes(type, cols);
    const uint8_t *base =
        mat + (size_t)r0 * row_bytes + (size_t)(c0 / be) * td_dtype_block_bytes(type);
    w->type = type;
    w->rows = nr;
    w->cols = nc;
    w->stride = row_bytes;
    w->data = base;
    if ((uintptr_t)base % elem_align(type) != 0) {
        /* Misaligned in the file (safetensors allows it): one aligned copy. */
        size_t slice_row = td_dtype_row_bytes(type, nc), bytes;
        if (td_mul_overflow(slice_row, (size_t)nr, &bytes)) return TD_ERR_NOMEM;
        uint8_t *copy = owned_alloc(ld->m, bytes);
        if (!copy) {
            TD_LOG_ERROR("out of memory copying tensor '%s'", name);
            return TD_ERR_NOMEM;
        }
        for (int64_t r = 0; r < nr; r++)
            memcpy(copy + (size_t)r * slice_row, base + (size_t)r * row_bytes, slice_row);
        w->data = copy;
        w->stride = slice_row;
    }
    ld->m->weight_bytes += td_dtype_row_bytes(type, nc) * (size_t)nr;
    return TD_OK;
}

/* Weight (rows, cols) from the file; the shard is rows [r0, r0 + nr) and
 * columns [c0, c0 + nc). */
static td_status load_matrix(loader *ld, const char *name, int64_t rows, int64_t cols, int64_t r0,
                             int64_t nr, int64_t c0, int64_t nc, td_weight *w) {
    src_tensor t;
    td_status st = tensor_lookup(ld, name, &t);
    if (st) return st;
    if ((st = check_shape2(ld, &t, rows, cols))) return st;
    return slice_matrix(ld, &t, t.data, cols, r0, nr, c0, nc, w);
}

/* Checks that t is n_exp experts of (rows, cols): ne = [cols, rows, n_exp]. */
static td_status check_shape3(const loader *ld, const src_tensor *t, int64_t n_exp, int64_t rows,
                              int64_t cols) {
    bool ok = t->n_dims == 3 && t->ne[0] == cols && t->ne[1] == rows && t->ne[2] == n_exp;
    if (!ok) {
        char got[96];
        shape_str(t, got, sizeof got);
        TD_LOG_ERROR("%s: tensor '%s': shape %s, expected [%lld, %lld, %lld]", ld->path, t->name,
                     got, (long long)cols, (long long)rows, (long long)n_exp);
        return TD_ERR_FORMAT;
    }
    return check_bytes(ld, t, rows * n_exp, cols);
}

/* Owned F32 copy of elements [off, off + count) of a vector of n elements. */
static td_status load_vector(loader *ld, const char *name, int64_t n, int64_t off, int64_t count,
                             float **out) {
    src_tensor t;
    td_status st = tensor_lookup(ld, name, &t);
    if (st) return st;
    bool ok = t.n_dims >= 1 && t.ne[0] == n;
    for (int i = 1; i < t.n_dims && i < 4; i++) ok = ok && t.ne[i] == 1;
    if (!ok) {
        char got[96];
        shape_str(&t, got, sizeof got);
        TD_LOG_ERROR("%s: tensor '%s': shape %s, expected [%lld]", ld->path, name, got,
                     (long long)n);
        return TD_ERR_FORMAT;
    }
    td_dtype type = (td_dtype)t.type;
    if (type != TD_TYPE_F32 && type != TD_TYPE_F16 && type != TD_TYPE_BF16) {
        TD_LOG_ERROR("%s: tensor '%s': type %s is not supported for a vector", ld->path, name,
                     t.type_name);
        return TD_ERR_UNSUPPORTED;
    }
    size_t esz = td_dtype_block_bytes(type);
    if (t.nbytes != (size_t)n * esz) {
        TD_LOG_ERROR("%s: tensor '%s': %zu bytes of data, expected %lld", ld->path, name, t.nbytes,
                     (long long)((size_t)n * esz));
        return TD_ERR_FORMAT;
    }
    float *v = owned_alloc(ld->m, (size_t)count * sizeof(float));
    if (!v) {
        TD_LOG_ERROR("out of memory loading tensor '%s'", name);
        return TD_ERR_NOMEM;
    }
    const uint8_t *src = (const uint8_t *)t.data + (size_t)off * esz;
    for (int64_t i = 0; i < count; i++) {
        if (type == TD_TYPE_F32) {
            memcpy(&v[i], src + (size_t)i * 4, 4);
        } else {
            uint16_t h;
            memcpy(&h, src + (size_t)i * 2, 2);
            v[i] = type == TD_TYPE_F16 ? td_fp16_to_f32(h) : td_bf16_to_f32(h);
        }
        if (!isfinite(v[i])) {
            TD_LOG_ERROR("%s: tensor '%s': element %lld is not finite", ld->path, name,
                         (long long)(off + i));
            return TD_ERR_FORMAT;
        }
    }
    *out = v;
    return TD_OK;
}

/* ---------------------------------------------------------------- config */

static td_status gguf_req_i64(const loader *ld, const char *key, int64_t lo, int64_t hi,
                              int64_t *v) {
    td_status st = td_gguf_get_i64(ld->m->gguf, key, v);
    if (st == TD_ERR_NOT_FOUND) {
        TD_LOG_ERROR("%s: metadata key '%s' is missing", ld->path, key);
        return TD_ERR_FORMAT;
    }
    if (st || *v < lo || *v > hi) {
        TD_LOG_ERROR("%s: metadata key '%s' is not an integer in [%lld, %lld]", ld->path, key,
                     (long long)lo, (long long)hi);
        return TD_ERR_FORMAT;
    }
    return TD_OK;
}

/* Optional integer: absent leaves *v unchanged. */
static td_status gguf_opt_i64(const loader *ld, const char *key, int64_t lo, int64_t hi,
                              int64_t *v) {
    int64_t x;
    td_status st = td_gguf_get_i64(ld->m->gguf, key, &x);
    if (st == TD_ERR_NOT_FOUND) return TD_OK;
    if (st || x < lo || x > hi) {
        TD_LOG_ERROR("%s: metadata key '%s' is not an integer in [%lld, %lld]", ld->path, key,
                     (long long)lo, (long long)hi);
        return TD_ERR_FORMAT;
    }
    *v = x;
    return TD_OK;
}

static td_status gguf_opt_f32(const loader *ld, const char *key, float *v) {
    float x;
    td_status st = td_gguf_get_f32(ld->m->gguf, key, &x);
    if (st == TD_ERR_NOT_FOUND) return TD_OK;
    if (st || !isfinite(x) || x <= 0.0f) {
        TD_LOG_ERROR("%s: metadata key '%s' is not a positive finite number", ld->path, key);
        return TD_ERR_FORMAT;
    }
    *v = x;
    return TD_OK;
}

static td_status config_from_gguf(loader *ld) {
    td_model *m = ld->m;
    td_model_config *c = &m->cfg;
    const char *arch;
    td_status st;
    if (td_gguf_get_str(m->gguf, "general.architecture", &arch)) {
        TD_LOG_ERROR("%s: metadata key 'general.architecture' is missing", ld->path);
        return TD_ERR_FORMAT;
    }
    if (strcmp(arch, "llama") == 0) {
        c->arch = TD_ARCH_LLAMA;
        c->rope_mode = TD_ROPE_NORM; /* the converter permutes Q/K for interleaved pairs */
        c->qkv_bias = false;
    } else if (strcmp(arch, "qwen2") == 0) {
        c->arch = TD_ARCH_QWEN2;
        c->rope_mode = TD_ROPE_NEOX;
        c->qkv_bias = true;
    } else if (strcmp(arch, "qwen2moe") == 0) {
        c->arch = TD_ARCH_QWEN2MOE;
        c->rope_mode = TD_ROPE_NEOX;
        c->qkv_bias = true;
    } else {
        TD_LOG_ERROR("%s: architecture '%.64s' is not supported (llama, qwen2, qwen2moe)", ld->path,
                     arch);
        return TD_ERR_UNSUPPORTED;
    }
    char key[160];
#define KEY(suffix) (snprintf(key, sizeof key, "%s." suffix, arch), key)
    int64_t n_embd, n_layer, n_ff, n_head, n_head_kv, n_ctx, head_dim, n_rot, v_dim;
    if ((st = gguf_req_i64(ld, KEY("embedding_length"), 1, TD_MAX_DIM, &n_embd)) ||
        (st = gguf_req_i64(ld, KEY("block_count"), 1, TD_MAX_LAYERS, &n_layer)) ||
        (st = gguf_req_i64(ld, KEY("feed_forward_length"), 1, TD_MAX_DIM, &n_ff)) ||
        (st = gguf_req_i64(ld, KEY("attention.head_count"), 1, TD_MAX_HEADS, &n_head)) ||
        (st = gguf_req_i64(ld, KEY("context_length"), 1, INT32_MAX, &n_ctx)))
        return st;
    n_head_kv = n_head;
    if ((st = gguf_opt_i64(ld, KEY("attention.head_count_kv"), 1, TD_MAX_HEADS, &n_head_kv)))
        return st;
    head_dim = n_embd / n_head;
    bool explicit_hd = td_gguf_find_key(m->gguf, KEY("attention.key_length")) >= 0;
    if ((st = gguf_opt_i64(ld, KEY("attention.key_length"), 1, 4096, &head_dim))) return st;
    v_dim = head_dim;
    if ((st = gguf_opt_i64(ld, KEY("attention.value_length"), 1, 4096, &v_dim))) return st;
    if (v_dim != head_dim) {
        TD_LOG_ERROR("%s: attention.value_length %lld differs from key_length %lld", ld->path,
                     (long long)v_dim, (long long)head_dim);
        return TD_ERR_UNSUPPORTED;
    }
    if (!explicit_hd && n_embd % n_head != 0) {
        TD_LOG_ERROR("%s: embedding_length %lld is not divisible by head_count %lld", ld->path,
                     (long long)n_embd, (long long)n_head);
        return TD_ERR_FORMAT;
    }
    n_rot = head_dim;
    if ((st = gguf_opt_i64(ld, KEY("rope.dimension_count"), 1, 4096, &n_rot))) return st;
    float eps = 0.0f, theta = 10000.0f;
    if ((st = gguf_opt_f32(ld, KEY("attention.layer_norm_rms_epsilon"), &eps))) return st;
    if (eps == 0.0f) {
        TD_LOG_ERROR("%s: metadata key '%s' is missing", ld->path,
                     KEY("attention.layer_norm_rms_epsilon"));
        return TD_ERR_FORMAT;
    }
    if ((st = gguf_opt_f32(ld, KEY("rope.freq_base"), &theta))) return st;
    /* RoPE scaling: linear here; Llama 3 scaling arrives as rope_freqs.weight. */
    const char *stype = NULL;
    float factor = 0.0f;
    if (td_gguf_get_str(m->gguf, KEY("rope.scaling.type"), &stype) == TD_OK &&
        strcmp(stype, "none") != 0) {
        if (strcmp(stype, "linear") != 0) {
            TD_LOG_ERROR("%s: rope scaling type '%.32s' is not supported (linear)", ld->path,
                         stype);
            return TD_ERR_UNSUPPORTED;
        }
        if ((st = gguf_opt_f32(ld, KEY("rope.scaling.factor"), &factor))) return st;
    }
    if (factor == 0.0f && (st = gguf_opt_f32(ld, KEY("rope.scale_linear"), &factor))) return st;
    if (factor != 0.0f && factor != 1.0f) {
        c->rope_scaling = TD_ROPE_SCALING_LINEAR;
        c->rope_factor = factor;
    }
    /* Experts as llama.cpp reads them: llama-arch experts are feed_forward_length
     * wide; qwen2moe's are expert_feed_forward_length (else n_ff / top-k) and its
     * shared expert expert_shared_feed_forward_length (else n_ff). */
    int64_t n_expert = 0, n_used = 0, ff_exp = 0, ff_sh = 0;
    bool moe = c->arch == TD_ARCH_QWEN2MOE;
    if (moe) {
        if ((st = gguf_req_i64(ld, KEY("expert_count"), 1, TD_MAX_EXPERTS, &n_expert))) return st;
    } else if ((st = gguf_opt_i64(ld, KEY("expert_count"), 0, TD_MAX_EXPERTS, &n_expert))) {
        return st;
    }
    if (n_expert > 0) {
        if (td_gguf_find_key(m->gguf, KEY("expert_used_count")) < 0) {
            TD_LOG_ERROR("%s: %s.expert_count %lld but metadata key '%s' is missing", ld->path,
                         arch, (long long)n_expert, key);
            return TD_ERR_FORMAT;
        }
        if ((st = gguf_req_i64(ld, key, 1, TD_MAX_EXPERTS, &n_used))) return st;
        if (n_used > n_expert) {
            TD_LOG_ERROR("%s: %s.expert_used_count %lld exceeds expert_count %lld", ld->path, arch,
                         (long long)n_used, (long long)n_expert);
            return TD_ERR_FORMAT;
        }
        ff_exp = n_ff;
        if (moe) {
            ff_exp = n_ff / n_used;
            ff_sh = n_ff;
            bool norm = false;
            if ((st =
                     gguf_opt_i64(ld, KEY("expert_feed_forward_length"), 1, TD_MAX_DIM, &ff_exp)) ||
                (st = gguf_opt_i64(ld, KEY("expert_shared_feed_forward_length"), 1, TD_MAX_DIM,
                                   &ff_sh)))
                return st;
            st = td_gguf_get_bool(m->gguf, KEY("expert_weights_norm"), &norm);
            if (st && st != TD_ERR_NOT_FOUND) {
                TD_LOG_ERROR("%s: metadata key '%s' is not a boolean", ld->path, key);
                return TD_ERR_FORMAT;
            }
            c->norm_topk_prob = norm;
        } else {
            c->norm_topk_prob = true; /* Mixtral */
        }
        if (ff_exp < 1) {
            TD_LOG_ERROR("%s: expert width is 0 (%s.expert_feed_forward_length missing)", ld->path,
                         arch);
            return TD_ERR_FORMAT;
        }
    }
    c->n_expert = (int32_t)n_expert;
    c->n_expert_used = (int32_t)n_used;
    c->n_ff_exp = (int32_t)ff_exp;
    c->n_ff_shexp = (int32_t)ff_sh;
    int64_t n_vocab = -1;
    if ((st = gguf_opt_i64(ld, KEY("vocab_size"), 1, TD_MAX_VOCAB, &n_vocab))) return st;
#undef KEY
    if (n_vocab < 0) {
        td_gguf_type et;
        uint64_t n;
        const void *d;
        if (td_gguf_get_arr(m->gguf, "tokenizer.ggml.tokens", &et, &n, &d) ||
            et != TD_GGUF_STRING || n == 0 || n > TD_MAX_VOCAB) {
            TD_LOG_ERROR("%s: neither vocab_size nor a tokenizer.ggml.tokens list", ld->path);
            return TD_ERR_FORMAT;
        }
        n_vocab = (int64_t)n;
    }
    c->n_vocab = (int32_t)n_vocab;
    c->n_embd = (int32_t)n_embd;
    c->n_layer = (int32_t)n_layer;
    c->n_ff = (int32_t)n_ff;
    c->n_head = (int32_t)n_head;
    c->n_head_kv = (int32_t)n_head_kv;
    c->head_dim = (int32_t)head_dim;
    c->n_rot = (int32_t)n_rot;
    c->n_ctx_train = (int32_t)n_ctx;
    c->rms_eps = eps;
    c->rope_theta = theta;
    const char *name = NULL;
    if (td_gguf_get_str(m->gguf, "general.name", &name) == TD_OK && name[0])
        snprintf(c->name, sizeof c->name, "%s", name);
    return TD_OK;
}

static td_status json_int(const loader *ld, json_t *root, const char *key, bool required,
                          int64_t lo, int64_t hi, int64_t *v) {
    json_t *j = json_object_get(root, key);
    if (!j || json_is_null(j)) {
        if (!required) return TD_OK;
        TD_LOG_ERROR("%s/config.json: '%s' is missing", ld->path, key);
        return TD_ERR_FORMAT;
    }
    if (!json_is_integer(j) || json_integer_value(j) < lo || json_integer_value(j) > hi) {
        TD_LOG_ERROR("%s/config.json: '%s' is not an integer in [%lld, %lld]", ld->path, key,
                     (long long)lo, (long long)hi);
        return TD_ERR_FORMAT;
    }
    *v = json_integer_value(j);
    return TD_OK;
}

static td_status json_num(const loader *ld, json_t *root, const char *key, float *v) {
    json_t *j = json_object_get(root, key);
    if (!j || json_is_null(j)) return TD_OK;
    double x = json_number_value(j);
    if (!json_is_number(j) || !isfinite(x) || x <= 0.0 || x > 3.0e38) {
        TD_LOG_ERROR("%s/config.json: '%s' is not a positive number", ld->path, key);
        return TD_ERR_FORMAT;
    }
    *v = (float)x;
    return TD_OK;
}

/* Mixtral: num_local_experts experts of intermediate_size, always
 * renormalised. Qwen2-MoE: num_experts of moe_intermediate_size, a shared
 * expert of shared_expert_intermediate_size, norm_topk_prob (default
 * false), every layer sparse (decoder_sparse_step 1, no mlp_only_layers). */
static td_status moe_config_from_hf(loader *ld, json_t *root, const char *cpath, int64_t n_ff) {
    td_model_config *c = &ld->m->cfg;
    bool qwen = c->arch == TD_ARCH_QWEN2MOE;
    int64_t n_expert, n_used, ff_exp = n_ff, ff_sh = 0, step = 1;
    td_status st;
    if ((st = json_int(ld, root, qwen ? "num_experts" : "num_local_experts", true, 1,
                       TD_MAX_EXPERTS, &n_expert)) ||
        (st = json_int(ld, root, "num_experts_per_tok", true, 1, TD_MAX_EXPERTS, &n_used)))
        return st;
    if (n_used > n_expert) {
        TD_LOG_ERROR("%s: num_experts_per_tok %lld exceeds the %lld experts", cpath,
                     (long long)n_used, (long long)n_expert);
        return TD_ERR_FORMAT;
    }
    c->norm_topk_prob = true;
    if (qwen) {
        if ((st = json_int(ld, root, "moe_intermediate_size", true, 1, TD_MAX_DIM, &ff_exp)) ||
            (st = json_int(ld, root, "shared_expert_intermediate_size", true, 0, TD_MAX_DIM,
                           &ff_sh)) ||
            (st = json_int(ld, root, "decoder_sparse_step", false, 1, TD_MAX_LAYERS, &step)))
            return st;
        json_t *only = json_object_get(root, "mlp_only_layers");
        if (step != 1 || (only && !json_is_null(only) && json_array_size(only) > 0) ||
            (only && !json_is_null(only) && !json_is_array(only))) {
            TD_LOG_ERROR("%s: dense layers in a MoE model (decoder_sparse_step %lld, "
                         "mlp_only_layers) are not supported",
                         cpath, (long long)step);
            return TD_ERR_UNSUPPORTED;
        }
        json_t *norm = json_object_get(root, "norm_topk_prob");
        if (norm && !json_is_null(norm) && !json_is_boolean(norm)) {
            TD_LOG_ERROR("%s: 'norm_topk_prob' is not a boolean", cpath);
            return TD_ERR_FORMAT;
        }
        c->norm_topk_prob = json_is_true(norm);
    }
    c->n_expert = (int32_t)n_expert;
    c->n_expert_used = (int32_t)n_used;
    c->n_ff_exp = (int32_t)ff_exp;
    c->n_ff_shexp = (int32_t)ff_sh;
    return TD_OK;
}

static td_status config_from_hf(loader *ld) {
    td_model_config *c = &ld->m->cfg;
    char cpath[4096];
    if ((size_t)snprintf(cpath, sizeof cpath, "%s/config.json", ld->path) >= sizeof cpath) {
        TD_LOG_ERROR("%s: path too long", ld->path);
        return TD_ERR_INVALID;
    }
    json_error_t jerr;
    json_t *root = json_load_file(cpath, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        TD_LOG_ERROR("%s: %s (line %d)", cpath, jerr.text, jerr.line);
        return TD_ERR_FORMAT;
    }
    td_status st = TD_ERR_FORMAT;
    if (!json_is_object(root)) {
        TD_LOG_ERROR("%s: not a JSON object", cpath);
        goto done;
    }
    json_t *archs = json_object_get(root, "architectures");
    const char *a = json_is_array(archs) ? json_string_value(json_array_get(archs, 0)) : NULL;
    if (!a) {
        TD_LOG_ERROR("%s: 'architectures' is missing", cpath);
        goto done;
    }
    if (strcmp(a, "LlamaForCausalLM") == 0 || strcmp(a, "MistralForCausalLM") == 0) {
        c->arch = TD_ARCH_LLAMA;
        c->qkv_bias = false;
        json_t *ab = json_object_get(root, "attention_bias");
        if (json_is_true(ab)) {
            TD_LOG_ERROR("%s: attention_bias is not supported for %s", cpath, a);
            st = TD_ERR_UNSUPPORTED;
            goto done;
        }
    } else if (strcmp(a, "MixtralForCausalLM") == 0) {
        c->arch = TD_ARCH_LLAMA;
        c->qkv_bias = false;
        c->n_expert = -1; /* read below */
    } else if (strcmp(a, "Qwen2ForCausalLM") == 0 || strcmp(a, "Qwen2MoeForCausalLM") == 0) {
        bool moe = strcmp(a, "Qwen2MoeForCausalLM") == 0;
        c->arch = moe ? TD_ARCH_QWEN2MOE : TD_ARCH_QWEN2;
        c->qkv_bias = true;
        if (moe) c->n_expert = -1;
        if (json_is_true(json_object_get(root, "use_sliding_window"))) {
            TD_LOG_ERROR("%s: use_sliding_window is not supported", cpath);
            st = TD_ERR_UNSUPPORTED;
            goto done;
        }
    } else {
        TD_LOG_ERROR("%s: architecture '%.64s' is not supported (LlamaForCausalLM, "
                     "MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, "
                     "Qwen2MoeForCausalLM)",
                     cpath, a);
        st = TD_ERR_UNSUPPORTED;
        goto done;
    }
    if (json_is_true(json_object_get(root, "mlp_bias"))) {
        TD_LOG_ERROR("%s: mlp_bias is not supported", cpath);
        st = TD_ERR_UNSUPPORTED;
        goto done;
    }
    const char *act = json_string_value(json_object_get(root, "hidden_act"));
    if (act && strcmp(act, "silu") != 0) {
        TD_LOG_ERROR("%s: hidden_act '%.32s' is not supported (silu)", cpath, act);
        st = TD_ERR_UNSUPPORTED;
        goto done;
    }
    c->rope_mode = TD_ROPE_NEOX; /* HF checkpoints rotate halves */
    int64_t n_embd, n_layer, n_ff, n_head, n_head_kv = -1, n_vocab, n_ctx = 2048, head_dim = -1;
    if ((st = json_int(ld, root, "hidden_size", true, 1, TD_MAX_DIM, &n_embd)) ||
        (st = json_int(ld, root, "num_hidden_layers", true, 1, TD_MAX_LAYERS, &n_layer)) ||
        (st = json_int(ld, root, "intermediate_size", true, 1, TD_MAX_DIM, &n_ff)) ||
        (st = json_int(ld, root, "num_attention_heads", true, 1, TD_MAX_HEADS, &n_head)) ||
        (st = json_int(ld, root, "num_key_value_heads", false, 1, TD_MAX_HEADS, &n_head_kv)) ||
        (st = json_int(ld, root, "vocab_size", true, 1, TD_MAX_VOCAB, &n_vocab)) ||
        (st = json_int(ld, root, "max_position_embeddings", false, 1, INT32_MAX, &n_ctx)) ||
        (st = json_int(ld, root, "head_dim", false, 1, 4096, &head_dim)))
        goto done;
    if (n_head_kv < 0) n_head_kv = n_head;
    if (c->n_expert < 0 && (st = moe_config_from_hf(ld, root, cpath, n_ff))) goto done;
    if (head_dim < 0) {
        if (n_embd % n_head != 0) {
            TD_LOG_ERROR("%s: hidden_size %lld is not divisible by num_attention_heads %lld", cpath,
                         (long long)n_embd, (long long)n_head);
            st = TD_ERR_FORMAT;
            goto done;
        }
        head_dim = n_embd / n_head;
    }
    float eps = 1e-6f, theta = 10000.0f;
    if ((st = json_num(ld, root, "rms_norm_eps", &eps)) ||
        (st = json_num(ld, root, "rope_theta", &theta)))
        goto done;
    json_t *tie = json_object_get(root, "tie_word_embeddings");
    c->tied_output = json_is_true(tie);
    json_t *rs = json_object_get(root, "rope_scaling");
    if (rs && !json_is_null(rs)) {
        const char *rt = json_string_value(json_object_get(rs, "rope_type"));
        if (!rt) rt = json_string_value(json_object_get(rs, "type"));
        if (!json_is_object(rs) || !rt) {
            TD_LOG_ERROR("%s: rope_scaling has no rope_type", cpath);
            st = TD_ERR_FORMAT;
            goto done;
        }
        float factor = 1.0f, lo = 1.0f, hi = 4.0f;
        int64_t orig = 8192;
        if ((st = json_num(ld, rs, "factor", &factor))) goto done;
        if (strcmp(rt, "default") == 0) {
        } else if (strcmp(rt, "linear") == 0) {
            c->rope_scaling = TD_ROPE_SCALING_LINEAR;
            c->rope_factor = factor;
        } else if (strcmp(rt, "llama3") == 0) {
            if ((st = json_num(ld, rs, "low_freq_factor", &lo)) ||
                (st = json_num(ld, rs, "high_freq_factor", &hi)) ||
                (st = json_int(ld, rs, "original_max_position_embeddings", true, 1, INT32_MAX,
                               &orig)))
                goto done;
            if (!(hi > lo)) {
                TD_LOG_ERROR("%s: rope_scaling high_freq_factor must exceed low_freq_factor",
                             cpath);
                st = TD_ERR_FORMAT;
                goto done;
            }
            c->rope_scaling = TD_ROPE_SCALING_LLAMA3;
            c->rope_factor = factor;
            c->rope_low_freq_factor = lo;
            c->rope_high_freq_factor = hi;
            c->rope_orig_ctx = (int32_t)orig;
        } else {
            TD_LOG_ERROR("%s: rope_scaling type '%.32s' is not supported (linear, llama3)", cpath,
                         rt);
            st = TD_ERR_UNSUPPORTED;
            goto done;
        }
    }
    c->n_vocab = (int32_t)n_vocab;
    c->n_embd = (int32_t)n_embd;
    c->n_layer = (int32_t)n_layer;
    c->n_ff = (int32_t)n_ff;
    c->n_head = (int32_t)n_head;
    c->n_head_kv = (int32_t)n_head_kv;
    c->head_dim = (int32_t)head_dim;
    c->n_rot = (int32_t)head_dim;
    c->n_ctx_train = (int32_t)n_ctx;
    c->rms_eps = eps;
    c->rope_theta = theta;
    st = TD_OK;
done:
    json_decref(root);
    return st;
}

static td_status config_check(const loader *ld, const td_model_params *p) {
    const td_model_config *c = &ld->m->cfg;
    if (c->n_head % c->n_head_kv != 0) {
        TD_LOG_ERROR("%s: head_count %d is not divisible by head_count_kv %d", ld->path, c->n_head,
                     c->n_head_kv);
        return TD_ERR_FORMAT;
    }
    if (c->head_dim % 2 != 0 || c->n_rot % 2 != 0 || c->n_rot > c->head_dim) {
        TD_LOG_ERROR("%s: head_dim %d / rope dimension %d must be even with rope <= head_dim",
                     ld->path, c->head_dim, c->n_rot);
        return TD_ERR_FORMAT;
    }
    if ((int64_t)c->n_head * c->head_dim > TD_MAX_DIM) {
        TD_LOG_ERROR("%s: %d heads of %d dims is too wide", ld->path, c->n_head, c->head_dim);
        return TD_ERR_FORMAT;
    }
    if (c->rope_scaling != TD_ROPE_SCALING_NONE && !(c->rope_factor > 0.0f)) {
        TD_LOG_ERROR("%s: rope scaling factor must be positive", ld->path);
        return TD_ERR_FORMAT;
    }
    if (p->tp_size < 1 || p->tp_rank < 0 || p->tp_rank >= p->tp_size) {
        TD_LOG_ERROR("%s: bad tensor-parallel rank %d of %d", ld->path, p->tp_rank, p->tp_size);
        return TD_ERR_INVALID;
    }
    if (c->n_head % p->tp_size != 0) {
        TD_LOG_ERROR("%s: head_count %d is not divisible by tp size %d", ld->path, c->n_head,
                     p->tp_size);
        return TD_ERR_INVALID;
    }
    /* More ranks than KV heads: each KV head is replicated on tp / n_head_kv
     * ranks (each rank's query heads then share one KV head). */
    if (p->tp_size > c->n_head_kv ? p->tp_size % c->n_head_kv != 0
                                  : c->n_head_kv % p->tp_size != 0) {
        TD_LOG_ERROR("%s: head_count_kv %d and tp size %d: one must divide the other", ld->path,
                     c->n_head_kv, p->tp_size);
        return TD_ERR_INVALID;
    }
    if (c->n_expert == 0 && c->n_ff % p->tp_size != 0) {
        TD_LOG_ERROR("%s: feed_forward_length %d is not divisible by tp size %d", ld->path, c->n_ff,
                     p->tp_size);
        return TD_ERR_INVALID;
    }
    if (p->ep_size < 1 || p->ep_rank < 0 || p->ep_rank >= p->ep_size) {
        TD_LOG_ERROR("%s: bad expert-parallel rank %d of %d", ld->path, p->ep_rank, p->ep_size);
        return TD_ERR_INVALID;
    }
    if (p->ep_size > 1 && c->n_expert == 0) {
        TD_LOG_ERROR("%s: expert parallelism (ep size %d) needs a mixture-of-experts model; this "
                     "one is dense",
                     ld->path, p->ep_size);
        return TD_ERR_INVALID;
    }
    if (p->ep_size > 1 && c->n_expert % p->ep_size != 0) {
        TD_LOG_ERROR("%s: the %d experts do not divide into %d expert-parallel shards", ld->path,
                     c->n_expert, p->ep_size);
        return TD_ERR_INVALID;
    }
    /* Under EP the routed experts are whole: only the shared expert is split. */
    if (c->n_expert > 0 &&
        ((p->ep_size == 1 && c->n_ff_exp % p->tp_size != 0) || c->n_ff_shexp % p->tp_size != 0)) {
        TD_LOG_ERROR("%s: expert widths %d and %d (shared) are not divisible by tp size %d",
                     ld->path, c->n_ff_exp, c->n_ff_shexp, p->tp_size);
        return TD_ERR_INVALID;
    }
    int end = p->layer_end < 0 ? c->n_layer : p->layer_end;
    if (p->layer_begin < 0 || p->layer_begin >= end || end > c->n_layer) {
        TD_LOG_ERROR("%s: layer range [%d, %d) is not inside the model's %d layers", ld->path,
                     p->layer_begin, end, c->n_layer);
        return TD_ERR_INVALID;
    }
    return TD_OK;
}

/* Angular frequency of every rotated pair, with the model's scaling. */
static td_status rope_init(loader *ld) {
    td_model *m = ld->m;
    const td_model_config *c = &m->cfg;
    int n = c->n_rot / 2;
    m->inv_freq = owned_alloc(m, (size_t)n * sizeof(float));
    if (!m->inv_freq) {
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    float *ff = NULL;
    if (!ld->hf) {
        src_tensor t;
        if (find_tensor(ld, "rope_freqs.weight", &t)) {
            td_status st = load_vector(ld, "rope_freqs.weight", n, 0, n, &ff);
            if (st) return st;
            for (int i = 0; i < n; i++) {
                if (!(ff[i] > 0.0f)) {
                    TD_LOG_ERROR("%s: tensor 'rope_freqs.weight': element %d is not positive",
                                 ld->path, i);
                    return TD_ERR_FORMAT;
                }
            }
        }
    }
    for (int i = 0; i < n; i++) {
        double f = pow((double)c->rope_theta, -2.0 * i / (double)c->n_rot);
        if (c->rope_scaling == TD_ROPE_SCALING_LINEAR) {
            f /= c->rope_factor;
        } else if (c->rope_scaling == TD_ROPE_SCALING_LLAMA3) {
            double lo_wl = c->rope_orig_ctx / (double)c->rope_low_freq_factor;
            double hi_wl = c->rope_orig_ctx / (double)c->rope_high_freq_factor;
            double wl = 2.0 * M_PI / f;
            if (wl > lo_wl) {
                f /= c->rope_factor;
            } else if (wl >= hi_wl) {
                double smooth = (c->rope_orig_ctx / wl - c->rope_low_freq_factor) /
                                (c->rope_high_freq_factor - c->rope_low_freq_factor);
                f = (1.0 - smooth) * f / c->rope_factor + smooth * f;
            }
        }
        if (ff) f /= ff[i];
        m->inv_freq[i] = (float)f;
    }
    return TD_OK;
}

/* ---------------------------------------------------------------- weights */

static const char *tname(char *buf, size_t cap, const loader *ld, int l, const char *gguf_part,
                         const char *hf_part) {
    if (ld->hf)
        snprintf(buf, cap, "model.layers.%d.%s", l, hf_part);
    else
        snprintf(buf, cap, "blk.%d.%s", l, gguf_part);
    return buf;
}

/* Name of expert x's matrix `which` (0 gate, 1 up, 2 down) as its own tensor. */
static const char *expert_name(char *buf, size_t cap, const loader *ld, int l, int x, int which) {
    static const char *const gguf[] = {"ffn_gate", "ffn_up", "ffn_down"};
    static const char *const mixtral[] = {"w1", "w3", "w2"};
    static const char *const qwen[] = {"gate_proj", "up_proj", "down_proj"};
    if (!ld->hf)
        snprintf(buf, cap, "blk.%d.%s.%d.weight", l, gguf[which], x);
    else if (ld->m->cfg.arch == TD_ARCH_QWEN2MOE)
        snprintf(buf, cap, "model.layers.%d.mlp.experts.%d.%s.weight", l, x, qwen[which]);
    else
        snprintf(buf, cap, "model.layers.%d.block_sparse_moe.experts.%d.%s.weight", l, x,
                 mixtral[which]);
    return buf;
}

/* Matrix `which` of every expert: GGUF's merged blk.N.ffn_*_exps.weight
 * (ne = [cols, rows, n_expert]) when the file has it, else one tensor per
 * expert. Each expert's shard is sliced as its dense counterpart. */
static td_status load_expert_family(loader *ld, int l, int which, td_layer_weights *lw) {
    static const char *const merged[] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
    const td_model *m = ld->m;
    const td_model_config *c = &m->cfg;
    int64_t E = c->n_embd, ff = c->n_ff_exp, ff_loc = ff / m->tp_size, r = m->tp_rank;
    if (m->ep_size > 1) { /* whole experts */
        ff_loc = ff;
        r = 0;
    }
    int64_t rows = which == 2 ? E : ff, cols = which == 2 ? ff : E;
    int64_t r0 = which == 2 ? 0 : r * ff_loc, nr = which == 2 ? E : ff_loc;
    int64_t c0 = which == 2 ? r * ff_loc : 0, nc = which == 2 ? ff_loc : E;
    char b[192];
    src_tensor t;
    td_status st;
    bool have_merged = false;
    if (!ld->hf) {
        snprintf(b, sizeof b, "blk.%d.%s.weight", l, merged[which]);
        have_merged = find_tensor(ld, b, &t);
    }
    if (have_merged) {
        if ((st = tensor_lookup(ld, b, &t)) || (st = check_shape3(ld, &t, c->n_expert, rows, cols)))
            return st;
    } else if (!ld->hf) {
        char first[192];
        if (!find_tensor(ld, expert_name(first, sizeof first, ld, l, 0, which), &t)) {
            TD_LOG_ERROR("%s: tensor '%s' is missing (nor per-expert tensors such as '%s')",
                         ld->path, b, first);
            return TD_ERR_NOT_FOUND;
        }
    }
    for (int x = 0; x < lw->n_experts_local; x++) {
        td_expert_weights *ex = &lw->experts[x];
        td_weight *w = which == 0 ? &ex->gate : which == 1 ? &ex->up : &ex->down;
        if (have_merged) {
            size_t mat_bytes = td_dtype_row_bytes((td_dtype)t.type, cols) * (size_t)rows;
            const uint8_t *mat = (const uint8_t *)t.data + (size_t)ex->id * mat_bytes;
            st = slice_matrix(ld, &t, mat, cols, r0, nr, c0, nc, w);
        } else {
            st = load_matrix(ld, expert_name(b, sizeof b, ld, l, ex->id, which), rows, cols, r0, nr,
                             c0, nc, w);
        }
        if (st) return st;
    }
    return TD_OK;
}

/* Router, routed experts and the shared expert of layer l. */
static td_status load_moe(loader *ld, int l, td_layer_weights *lw) {
    td_model *m = ld->m;
    const td_model_config *c = &m->cfg;
    int64_t E = c->n_embd, sh = c->n_ff_shexp, sh_loc = sh / m->tp_size, r = m->tp_rank;
    bool qwen = c->arch == TD_ARCH_QWEN2MOE;
    char b[192];
    td_status st;
    const char *router = tname(b, sizeof b, ld, l, "ffn_gate_inp.weight",
                               qwen ? "mlp.gate.weight" : "block_sparse_moe.gate.weight");
    if ((st = load_matrix(ld, router, c->n_expert, E, 0, c->n_expert, 0, E, &lw->router)))
        return st;
    int32_t n_loc = c->n_expert / m->ep_size, x0 = m->ep_rank * n_loc;
    lw->experts = owned_alloc(m, (size_t)n_loc * sizeof *lw->experts);
    if (!lw->experts) {
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    memset(lw->experts, 0, (size_t)n_loc * sizeof *lw->experts);
    lw->n_experts_local = n_loc;
    for (int x = 0; x < n_loc; x++) lw->experts[x].id = x0 + x;
    size_t before = m->weight_bytes;
    for (int which = 0; which < 3; which++)
        if ((st = load_expert_family(ld, l, which, lw))) return st;
    /* Per token only n_expert_used of the experts are read, spread (on
     * average) evenly over the ep_size shards. */
    size_t exp_bytes = m->weight_bytes - before;
    m->weight_bytes =
        before + exp_bytes / (size_t)n_loc * (size_t)c->n_expert_used / (size_t)m->ep_size;
    if (sh == 0) return TD_OK;
    if ((st = load_matrix(ld,
                          tname(b, sizeof b, ld, l, "ffn_gate_shexp.weight",
                                "mlp.shared_expert.gate_proj.weight"),
                          sh, E, r * sh_loc, sh_loc, 0, E, &lw->shexp_gate)) ||
        (st = load_matrix(
             ld,
             tname(b, sizeof b, ld, l, "ffn_up_shexp.weight", "mlp.shared_expert.up_proj.weight"),
             sh, E, r * sh_loc, sh_loc, 0, E, &lw->shexp_up)) ||
        (st = load_matrix(ld,
                          tname(b, sizeof b, ld, l, "ffn_down_shexp.weight",
                                "mlp.shared_expert.down_proj.weight"),
                          E, sh, 0, E, r * sh_loc, sh_loc, &lw->shexp_down)) ||
        (st = load_vector(ld,
                          tname(b, sizeof b, ld, l, "ffn_gate_inp_shexp.weight",
                                "mlp.shared_expert_gate.weight"),
                          E, 0, E, (float **)&lw->shexp_inp)))
        return st;
    return TD_OK;
}

static td_status load_layer(loader *ld, int l, td_layer_weights *lw) {
    td_model *m = ld->m;
    const td_model_config *c = &m->cfg;
    int64_t E = c->n_embd, hd = c->head_dim, ff = c->n_ff;
    int64_t q_rows = (int64_t)c->n_head * hd, kv_rows = (int64_t)c->n_head_kv * hd;
    int64_t q_loc = (int64_t)m->n_head_local * hd, kv_loc = (int64_t)m->n_head_kv_local * hd;
    int64_t ff_loc = ff / m->tp_size, r = m->tp_rank;
    /* First KV row of this rank: its own heads, or the one head its query
     * heads share when KV heads are replicated. */
    int64_t kv_r0 = m->tp_size > c->n_head_kv ? r / (m->tp_size / c->n_head_kv) * hd : r * kv_loc;
    char b[160];
    td_status st;
    if ((st = load_vector(ld,
                          tname(b, sizeof b, ld, l, "attn_norm.weight", "input_layernorm.weight"),
                          E, 0, E, (float **)&lw->attn_norm)) ||
        (st = load_matrix(ld, tname(b, sizeof b, ld, l, "attn_q.weight", "self_attn.q_proj.weight"),
                          q_rows, E, r * q_loc, q_loc, 0, E, &lw->wq)) ||
        (st = load_matrix(ld, tname(b, sizeof b, ld, l, "attn_k.weight", "self_attn.k_proj.weight"),
                          kv_rows, E, kv_r0, kv_loc, 0, E, &lw->wk)) ||
        (st = load_matrix(ld, tname(b, sizeof b, ld, l, "attn_v.weight", "self_attn.v_proj.weight"),
                          kv_rows, E, kv_r0, kv_loc, 0, E, &lw->wv)) ||
        (st = load_matrix(
             ld, tname(b, sizeof b, ld, l, "attn_output.weight", "self_attn.o_proj.weight"), E,
             q_rows, 0, E, r * q_loc, q_loc, &lw->wo)) ||
        (st = load_vector(
             ld, tname(b, sizeof b, ld, l, "ffn_norm.weight", "post_attention_layernorm.weight"), E,
             0, E, (float **)&lw->ffn_norm)))
        return st;
    if (c->n_expert > 0) {
        if ((st = load_moe(ld, l, lw))) return st;
    } else if ((st = load_matrix(
                    ld, tname(b, sizeof b, ld, l, "ffn_gate.weight", "mlp.gate_proj.weight"), ff, E,
                    r * ff_loc, ff_loc, 0, E, &lw->w_gate)) ||
               (st = load_matrix(ld,
                                 tname(b, sizeof b, ld, l, "ffn_up.weight", "mlp.up_proj.weight"),
                                 ff, E, r * ff_loc, ff_loc, 0, E, &lw->w_up)) ||
               (st = load_matrix(
                    ld, tname(b, sizeof b, ld, l, "ffn_down.weight", "mlp.down_proj.weight"), E, ff,
                    0, E, r * ff_loc, ff_loc, &lw->w_down))) {
        return st;
    }
    if (c->qkv_bias) {
        if ((st = load_vector(ld, tname(b, sizeof b, ld, l, "attn_q.bias", "self_attn.q_proj.bias"),
                              q_rows, r * q_loc, q_loc, (float **)&lw->bq)) ||
            (st = load_vector(ld, tname(b, sizeof b, ld, l, "attn_k.bias", "self_attn.k_proj.bias"),
                              kv_rows, kv_r0, kv_loc, (float **)&lw->bk)) ||
            (st = load_vector(ld, tname(b, sizeof b, ld, l, "attn_v.bias", "self_attn.v_proj.bias"),
                              kv_rows, kv_r0, kv_loc, (float **)&lw->bv)))
            return st;
    }
    return TD_OK;
}

static td_status load_weights(loader *ld) {
    td_model *m = ld->m;
    const td_model_config *c = &m->cfg;
    td_status st;
    const char *embd_name = ld->hf ? "model.embed_tokens.weight" : "token_embd.weight";
    const char *out_name = ld->hf ? "lm_head.weight" : "output.weight";
    const char *norm_name = ld->hf ? "model.norm.weight" : "output_norm.weight";
    src_tensor t;
    if (!ld->hf) {
        m->cfg.tied_output = !find_tensor(ld, out_name, &t);
        /* Some llama-arch files carry Q/K/V biases: load them like qwen2's. */
        if (find_tensor(ld, "blk.0.attn_q.bias", &t)) m->cfg.qkv_bias = true;
        /* Biases this forward pass has no place for must not be dropped silently. */
        static const char *const unsupported[] = {"attn_output.bias", "ffn_gate.bias",
                                                  "ffn_up.bias", "ffn_down.bias"};
        char name[64];
        for (size_t i = 0; i < TD_ARRAY_SIZE(unsupported); i++) {
            snprintf(name, sizeof name, "blk.%d.%s", m->layer_begin, unsupported[i]);
            if (find_tensor(ld, name, &t)) {
                TD_LOG_ERROR("%s: tensor '%s': this bias is not supported", ld->path, name);
                return TD_ERR_UNSUPPORTED;
            }
        }
    }
    bool first = m->layer_begin == 0, last = m->layer_end == c->n_layer;
    /* Vocab-parallel: ceil(n_vocab / tp) rows per rank, the last slices
     * shorter or empty; rows are independent, so any type slices on them. */
    int64_t per = ((int64_t)c->n_vocab + m->tp_size - 1) / m->tp_size;
    m->vocab_begin = (int32_t)TD_MIN(per * m->tp_rank, (int64_t)c->n_vocab);
    m->vocab_end = (int32_t)TD_MIN((int64_t)m->vocab_begin + per, (int64_t)c->n_vocab);
    int64_t v0 = m->vocab_begin, nv = m->vocab_end - m->vocab_begin;
    if (first || (last && m->cfg.tied_output)) {
        td_weight w;
        size_t before = m->weight_bytes;
        if ((st = load_matrix(ld, embd_name, c->n_vocab, c->n_embd, v0, nv, 0, c->n_embd, &w)))
            return st;
        m->weight_bytes = before; /* one row per token: not a per-token stream of weights */
        if (first) {
            m->tok_embd = w;
            m->has_embd = true;
        }
        if (last && m->cfg.tied_output) {
            m->output = w;
            m->has_output = true;
            m->weight_bytes += td_dtype_row_bytes(w.type, w.cols) * (size_t)w.rows;
        }
    }
    if (last) {
        if (!m->cfg.tied_output) {
            if ((st = load_matrix(ld, out_name, c->n_vocab, c->n_embd, v0, nv, 0, c->n_embd,
                                  &m->output)))
                return st;
            m->has_output = true;
        }
        if ((st = load_vector(ld, norm_name, c->n_embd, 0, c->n_embd, &m->output_norm))) return st;
    }
    int n_local = m->layer_end - m->layer_begin;
    m->layers = calloc((size_t)n_local, sizeof *m->layers);
    if (!m->layers) {
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    for (int l = m->layer_begin; l < m->layer_end; l++)
        if ((st = load_layer(ld, l, &m->layers[l - m->layer_begin]))) return st;
    m->cfg.wtype = m->layers[0].wq.type;
    return TD_OK;
}

static td_status check_vocab(const loader *ld) {
    const td_model *m = ld->m;
    int32_t tv = td_tokenizer_n_vocab(m->tok);
    /* HF configs may pad vocab_size past the tokenizer; GGUF files must agree exactly. */
    bool ok = ld->hf ? (tv > 0 && tv <= m->cfg.n_vocab) : tv == m->cfg.n_vocab;
    if (!ok) {
        TD_LOG_ERROR("%s: the tokenizer has %d tokens but the model's vocabulary is %d", ld->path,
                     tv, m->cfg.n_vocab);
        return TD_ERR_FORMAT;
    }
    return TD_OK;
}

/* A model of no weights yet: its path, file and configuration (the name
 * defaulting to the last part of the path). On failure *m_p is NULL. */
static td_status model_open(const char *path, td_model **m_p, bool *hf) {
    *m_p = NULL;
    struct stat sb;
    if (stat(path, &sb) != 0) {
        TD_LOG_ERROR("%s: %s", path, strerror(errno));
        return TD_ERR_IO;
    }
    td_model *m = calloc(1, sizeof *m);
    if (!m || !(m->path = strdup(path))) {
        free(m);
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    loader ld = {.m = m, .path = m->path, .hf = S_ISDIR(sb.st_mode)};
    td_status st;
    if (ld.hf) {
        if ((st = config_from_hf(&ld)) || (st = td_st_open(m->path, &m->st))) goto fail;
    } else {
        if ((st = td_gguf_open(m->path, &m->gguf)) || (st = config_from_gguf(&ld))) goto fail;
    }
    if (!m->cfg.name[0]) {
        size_t len = strlen(m->path);
        while (len > 1 && m->path[len - 1] == '/') len--;
        const char *base = m->path;
        for (size_t i = 0; i + 1 < len; i++)
            if (m->path[i] == '/') base = m->path + i + 1;
        snprintf(m->cfg.name, sizeof m->cfg.name, "%.*s", (int)(len - (size_t)(base - m->path)),
                 base);
    }
    *hf = ld.hf;
    *m_p = m;
    return TD_OK;
fail:
    td_model_free(m);
    return st;
}

static td_status open_tokenizer(td_model *m, bool hf) {
    return hf ? td_tokenizer_from_hf_dir(m->path, &m->tok)
              : td_tokenizer_from_gguf(m->gguf, &m->tok);
}

td_status td_model_describe(const char *path, td_model_config *cfg, td_tokenizer **tok_p) {
    if (!path || !cfg || !tok_p) return TD_ERR_INVALID;
    *tok_p = NULL;
    td_model *m;
    bool hf;
    td_status st = model_open(path, &m, &hf);
    if (st == TD_OK && (st = open_tokenizer(m, hf)) == TD_OK) {
        *cfg = m->cfg;
        *tok_p = m->tok;
        m->tok = NULL;
    }
    td_model_free(m);
    return st;
}

td_status td_model_load(const td_model_params *p, td_model **m_p) {
    if (!p || !p->path || !m_p) return TD_ERR_INVALID;
    td_model *m;
    bool hf;
    td_status st = model_open(p->path, &m, &hf);
    if (st) return st;
    loader ld = {.m = m, .path = m->path, .hf = hf};
    if ((st = config_check(&ld, p))) goto fail;
    m->tp_rank = p->tp_rank;
    m->tp_size = p->tp_size;
    m->ep_rank = p->ep_rank;
    m->ep_size = p->ep_size;
    m->layer_begin = p->layer_begin;
    m->layer_end = p->layer_end < 0 ? m->cfg.n_layer : p->layer_end;
    m->n_head_local = m->cfg.n_head / p->tp_size;
    m->n_head_kv_local = p->tp_size > m->cfg.n_head_kv ? 1 : m->cfg.n_head_kv / p->tp_size;
    if ((st = load_weights(&ld))) goto fail;
    if ((st = rope_init(&ld))) goto fail;
    if ((st = open_tokenizer(m, hf))) goto fail;
    if ((st = check_vocab(&ld))) goto fail;
    *m_p = m;
    return TD_OK;
fail:
    td_model_free(m);
    return st;
}

void td_model_free(td_model *m) {
    if (!m) return;
    td_tokenizer_free(m->tok);
    for (size_t i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    free(m->layers);
    td_st_close(m->st);
    td_gguf_close(m->gguf);
    free(m->path);
    free(m);
}

const td_model_config *td_model_get_config(const td_model *m) { return &m->cfg; }
const td_tokenizer *td_model_tokenizer(const td_model *m) { return m->tok; }
int td_model_tp_rank(const td_model *m) { return m->tp_rank; }
int td_model_tp_size(const td_model *m) { return m->tp_size; }
int td_model_ep_rank(const td_model *m) { return m->ep_rank; }
int td_model_ep_size(const td_model *m) { return m->ep_size; }
int td_model_layer_begin(const td_model *m) { return m->layer_begin; }
int td_model_layer_end(const td_model *m) { return m->layer_end; }
int td_model_n_head_local(const td_model *m) { return m->n_head_local; }
int td_model_n_head_kv_local(const td_model *m) { return m->n_head_kv_local; }

const td_layer_weights *td_model_layer(const td_model *m, int l) {
    TD_ASSERT(l >= m->layer_begin && l < m->layer_end);
    return &m->layers[l - m->layer_begin];
}

const td_weight *td_model_tok_embd(const td_model *m) { return m->has_embd ? &m->tok_embd : NULL; }
const float *td_model_output_norm(const td_model *m) { return m->output_norm; }
const td_weight *td_model_output(const td_model *m) { return m->has_output ? &m->output : NULL; }
const float *td_model_rope_inv_freq(const td_model *m) { return m->inv_freq; }
size_t td_model_weight_bytes(const td_model *m) { return m->weight_bytes; }

void td_model_vocab_range(const td_model *m, int32_t *v0_p, int32_t *v1_p) {
    *v0_p = m->vocab_begin;
    *v1_p = m->vocab_end;
}
