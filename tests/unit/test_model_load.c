/* Model loading: configs against the manifest of the tiny test models
 * (written by tests/models/make_models.py, read here with jansson), shard
 * pointers against the tensors as td_gguf reports them, RoPE frequencies
 * against the formulas, and model files that are valid GGUF / HF but lie
 * about the model (missing tensor, wrong shape, iq4_xs tensor, head counts
 * that do not divide, vocabulary mismatch, a special token id outside the
 * vocabulary, unknown architecture, bad config.json): each must fail with a
 * negative status and exactly one error line naming the file and the tensor
 * or key, without crashing.
 *
 * The corrupt GGUF files are made by re-writing a valid test model through
 * td_gguf's reader with one change, so every other byte stays valid. */
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/backend/backend.h"
#include "common/format/gguf.h"
#include "common/model/model.h"

#define TD_TYPE_IQ4_XS_ID 23 /* GGUF id of iq4_xs: 256-element blocks of 136 bytes */

static char g_tmp[256];

static const char *models_dir(void) { return getenv("TANDEM_TEST_MODELS"); }

static void need_models(void) {
    if (!models_dir()) {
        print_message("TANDEM_TEST_MODELS not set\n");
        skip();
    }
}

static void model_path(const char *rel, char *buf, size_t cap) {
    snprintf(buf, cap, "%s/%s", models_dir(), rel);
}

/* ------------------------------------------------------ stderr capture */

static int g_saved_fd = -1;
static char g_cap_path[300];

static void capture_begin(void) {
    fflush(stderr);
    snprintf(g_cap_path, sizeof g_cap_path, "%s/stderr.txt", g_tmp);
    int fd = open(g_cap_path, O_CREAT | O_TRUNC | O_WRONLY, 0600);
    assert_true(fd >= 0);
    g_saved_fd = dup(2);
    dup2(fd, 2);
    close(fd);
}

/* Returns the captured text (static buffer). */
static const char *capture_end(void) {
    static char buf[8192];
    fflush(stderr);
    dup2(g_saved_fd, 2);
    close(g_saved_fd);
    FILE *f = fopen(g_cap_path, "r");
    assert_non_null(f);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

/* Loads `path` and expects failure with one error line containing every
 * string of `needles` (NULL-terminated). */
static void expect_load_error(const char *path, td_model_params p, const char **needles) {
    p.path = path;
    td_model *m = (td_model *)0x1;
    capture_begin();
    td_status st = td_model_load(&p, &m);
    const char *err = capture_end();
    print_message("    -> %s", err);
    assert_true(st < 0);
    assert_ptr_equal(m, (td_model *)0x1); /* output untouched on failure */
    int lines = 0;
    const char *line = NULL;
    for (const char *s = err; *s;) {
        const char *nl = strchr(s, '\n');
        if (s[0] == 'E' && s[1] == ' ') {
            lines++;
            line = s;
        }
        if (!nl) break;
        s = nl + 1;
    }
    assert_int_equal(lines, 1);
    const char *eol = strchr(line, '\n');
    size_t len = eol ? (size_t)(eol - line) : strlen(line);
    for (int i = 0; needles[i]; i++) {
        char *l = strndup(line, len);
        if (!strstr(l, needles[i])) print_message("missing '%s' in: %s\n", needles[i], l);
        assert_non_null(strstr(l, needles[i]));
        free(l);
    }
}

/* ------------------------------------------------------- GGUF rewriter */

typedef struct {
    const char *drop_tensor;   /* tensor left out */
    const char *change_tensor; /* tensor given type/ne below (data truncated or zero-padded) */
    int new_type;
    int64_t new_ne0, new_ne1;
    const char *rows_tensor[2]; /* tensors whose row count becomes new_rows */
    int64_t new_rows;
    const char *set_u32_key; /* u32 key added or replaced */
    uint32_t set_u32;
    const char *set_str_key; /* string key added or replaced */
    const char *set_str;
    const char *set_f32_key; /* float key added or replaced */
    float set_f32;
    const char *rename_from, *rename_to; /* a tensor written under another name */
} mutation;

typedef struct {
    uint8_t *p;
    size_t n, cap;
} buf;

static void put(buf *b, const void *d, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 4096;
        b->p = realloc(b->p, b->cap);
        assert_non_null(b->p);
    }
    if (d)
        memcpy(b->p + b->n, d, n);
    else
        memset(b->p + b->n, 0, n);
    b->n += n;
}
static void put_u32(buf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(buf *b, uint64_t v) { put(b, &v, 8); }
static void put_str(buf *b, const char *s, size_t len) {
    put_u64(b, len);
    put(b, s, len);
}

static size_t scalar_size(td_gguf_type t) {
    switch (t) {
    case TD_GGUF_UINT8:
    case TD_GGUF_INT8:
    case TD_GGUF_BOOL: return 1;
    case TD_GGUF_UINT16:
    case TD_GGUF_INT16: return 2;
    case TD_GGUF_UINT32:
    case TD_GGUF_INT32:
    case TD_GGUF_FLOAT32: return 4;
    case TD_GGUF_UINT64:
    case TD_GGUF_INT64:
    case TD_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

static void put_value(buf *b, const td_gguf *g, const char *key, td_gguf_type t) {
    if (t == TD_GGUF_STRING) {
        const char *s;
        assert_int_equal(td_gguf_get_str(g, key, &s), TD_OK);
        put_str(b, s, strlen(s));
    } else if (t == TD_GGUF_ARRAY) {
        td_gguf_type et;
        uint64_t n;
        const void *d;
        assert_int_equal(td_gguf_get_arr(g, key, &et, &n, &d), TD_OK);
        put_u32(b, (uint32_t)et);
        put_u64(b, n);
        if (et == TD_GGUF_STRING) {
            for (uint64_t i = 0; i < n; i++) {
                const char *s;
                size_t len;
                assert_int_equal(td_gguf_get_arr_str(g, key, i, &s, &len), TD_OK);
                put_str(b, s, len);
            }
        } else {
            assert_true(scalar_size(et) > 0);
            put(b, d, (size_t)n * scalar_size(et));
        }
    } else if (t == TD_GGUF_FLOAT32 || t == TD_GGUF_FLOAT64) {
        float f;
        assert_int_equal(td_gguf_get_f32(g, key, &f), TD_OK);
        if (t == TD_GGUF_FLOAT32) {
            put(b, &f, 4);
        } else {
            double d = f;
            put(b, &d, 8);
        }
    } else if (t == TD_GGUF_BOOL) {
        bool v;
        assert_int_equal(td_gguf_get_bool(g, key, &v), TD_OK);
        uint8_t u = v;
        put(b, &u, 1);
    } else {
        int64_t v;
        assert_int_equal(td_gguf_get_i64(g, key, &v), TD_OK);
        put(b, &v, scalar_size(t)); /* little-endian: the low bytes */
    }
}

static size_t tensor_bytes(int type, int64_t ne0, int64_t rows) {
    if (type == TD_TYPE_IQ4_XS_ID) return (size_t)(ne0 / 256) * 136u * (size_t)rows;
    return td_dtype_row_bytes((td_dtype)type, ne0) * (size_t)rows;
}

static bool in_list(const char *const *list, size_t n, const char *s) {
    for (size_t i = 0; i < n; i++)
        if (list[i] && strcmp(list[i], s) == 0) return true;
    return false;
}

/* Writes src with mutation mu to dst. */
static void rewrite(const char *src, const char *dst, const mutation *mu) {
    td_gguf *g = NULL;
    assert_int_equal(td_gguf_open(src, &g), TD_OK);
    buf b = {0};
    put(&b, "GGUF", 4);
    put_u32(&b, 3);
    int64_t nt = td_gguf_n_tensors(g), nkv = td_gguf_n_kv(g);
    int64_t out_t = nt - (mu->drop_tensor ? 1 : 0);
    int64_t out_kv = nkv;
    if (mu->set_u32_key && td_gguf_find_key(g, mu->set_u32_key) < 0) out_kv++;
    if (mu->set_str_key && td_gguf_find_key(g, mu->set_str_key) < 0) out_kv++;
    if (mu->set_f32_key && td_gguf_find_key(g, mu->set_f32_key) < 0) out_kv++;
    put_u64(&b, (uint64_t)out_t);
    put_u64(&b, (uint64_t)out_kv);
    for (int64_t i = 0; i < nkv; i++) {
        const char *key = td_gguf_key_name(g, i);
        put_str(&b, key, strlen(key));
        if (mu->set_u32_key && strcmp(key, mu->set_u32_key) == 0) {
            put_u32(&b, TD_GGUF_UINT32);
            put_u32(&b, mu->set_u32);
        } else if (mu->set_f32_key && strcmp(key, mu->set_f32_key) == 0) {
            put_u32(&b, TD_GGUF_FLOAT32);
            put(&b, &mu->set_f32, 4);
        } else if (mu->set_str_key && strcmp(key, mu->set_str_key) == 0) {
            put_u32(&b, TD_GGUF_STRING);
            put_str(&b, mu->set_str, strlen(mu->set_str));
        } else {
            td_gguf_type t = td_gguf_kv_type(g, i);
            put_u32(&b, (uint32_t)t);
            put_value(&b, g, key, t);
        }
    }
    if (mu->set_u32_key && td_gguf_find_key(g, mu->set_u32_key) < 0) {
        put_str(&b, mu->set_u32_key, strlen(mu->set_u32_key));
        put_u32(&b, TD_GGUF_UINT32);
        put_u32(&b, mu->set_u32);
    }
    if (mu->set_str_key && td_gguf_find_key(g, mu->set_str_key) < 0) {
        put_str(&b, mu->set_str_key, strlen(mu->set_str_key));
        put_u32(&b, TD_GGUF_STRING);
        put_str(&b, mu->set_str, strlen(mu->set_str));
    }
    if (mu->set_f32_key && td_gguf_find_key(g, mu->set_f32_key) < 0) {
        put_str(&b, mu->set_f32_key, strlen(mu->set_f32_key));
        put_u32(&b, TD_GGUF_FLOAT32);
        put(&b, &mu->set_f32, 4);
    }
    size_t *sizes = calloc((size_t)nt, sizeof *sizes);
    assert_non_null(sizes);
    uint64_t off = 0;
    for (int64_t i = 0; i < nt; i++) {
        const td_gguf_tensor *t = td_gguf_tensor_at(g, i);
        if (mu->drop_tensor && strcmp(t->name, mu->drop_tensor) == 0) continue;
        int type = t->type, nd = t->n_dims;
        int64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
        if (mu->change_tensor && strcmp(t->name, mu->change_tensor) == 0) {
            type = mu->new_type;
            ne[0] = mu->new_ne0;
            ne[1] = mu->new_ne1;
            nd = 2;
        }
        if (in_list(mu->rows_tensor, 2, t->name)) ne[1] = mu->new_rows;
        const char *name = t->name;
        if (mu->rename_from && strcmp(name, mu->rename_from) == 0) name = mu->rename_to;
        put_str(&b, name, strlen(name));
        put_u32(&b, (uint32_t)nd);
        for (int d = 0; d < nd; d++) put_u64(&b, (uint64_t)ne[d]);
        put_u32(&b, (uint32_t)type);
        put_u64(&b, off);
        sizes[i] = tensor_bytes(type, ne[0], ne[1] * ne[2] * ne[3]);
        off += (sizes[i] + 31) & ~(size_t)31;
    }
    put(&b, NULL, (32 - b.n % 32) % 32);
    for (int64_t i = 0; i < nt; i++) {
        const td_gguf_tensor *t = td_gguf_tensor_at(g, i);
        if (mu->drop_tensor && strcmp(t->name, mu->drop_tensor) == 0) continue;
        size_t keep = TD_MIN(sizes[i], t->nbytes);
        put(&b, t->data, keep);
        put(&b, NULL, sizes[i] - keep);
        put(&b, NULL, ((sizes[i] + 31) & ~(size_t)31) - sizes[i]);
    }
    FILE *f = fopen(dst, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(b.p, 1, b.n, f), b.n);
    fclose(f);
    free(b.p);
    free(sizes);
    td_gguf_close(g);
}

/* ------------------------------------------------------------- configs */

static json_t *manifest_entry(const char *name) {
    char path[4096];
    model_path("models.json", path, sizeof path);
    json_t *root = json_load_file(path, 0, NULL);
    assert_non_null(root);
    json_t *models = json_object_get(root, "models"), *hit = NULL;
    for (size_t i = 0; i < json_array_size(models); i++) {
        json_t *e = json_array_get(models, i);
        if (strcmp(json_string_value(json_object_get(e, "name")), name) == 0) hit = e;
    }
    assert_non_null(hit);
    json_incref(hit);
    json_decref(root);
    return hit;
}

static int64_t jint(json_t *o, const char *k) {
    json_t *v = json_object_get(o, k);
    assert_true(json_is_integer(v));
    return json_integer_value(v);
}

static void check_config(const char *name) {
    json_t *e = manifest_entry(name);
    json_t *c = json_object_get(e, "config");
    char path[4096];
    model_path(json_string_value(json_object_get(e, "path")), path, sizeof path);
    td_model_params p = td_model_default_params();
    p.path = path;
    td_model *m = NULL;
    assert_int_equal(td_model_load(&p, &m), TD_OK);
    const td_model_config *mc = td_model_get_config(m);
    assert_int_equal(mc->n_vocab, jint(c, "n_vocab"));
    assert_int_equal(mc->n_embd, jint(c, "n_embd"));
    assert_int_equal(mc->n_layer, jint(c, "n_layer"));
    assert_int_equal(mc->n_head, jint(c, "n_head"));
    assert_int_equal(mc->n_head_kv, jint(c, "n_head_kv"));
    assert_int_equal(mc->head_dim, jint(c, "head_dim"));
    assert_int_equal(mc->n_ff, jint(c, "n_ff"));
    assert_int_equal(mc->n_ctx_train, jint(c, "n_ctx_train"));
    assert_float_equal(mc->rope_theta, json_number_value(json_object_get(c, "rope_theta")), 1e-3);
    assert_float_equal(mc->rms_eps, json_number_value(json_object_get(c, "rms_eps")), 1e-9);
    const char *rm = json_string_value(json_object_get(c, "rope_mode"));
    assert_int_equal(mc->rope_mode, strcmp(rm, "norm") == 0 ? TD_ROPE_NORM : TD_ROPE_NEOX);
    assert_int_equal(mc->qkv_bias, json_is_true(json_object_get(c, "qkv_bias")));
    assert_int_equal(mc->tied_output, json_is_true(json_object_get(e, "tied")));
    const char *arch = json_string_value(json_object_get(e, "arch"));
    assert_int_equal(mc->arch, strcmp(arch, "qwen2") == 0 ? TD_ARCH_QWEN2 : TD_ARCH_LLAMA);
    assert_int_equal(td_tokenizer_n_vocab(td_model_tokenizer(m)), mc->n_vocab);
    /* Every layer's weights are present with the manifest's shapes. */
    for (int l = 0; l < mc->n_layer; l++) {
        const td_layer_weights *lw = td_model_layer(m, l);
        assert_int_equal(lw->wq.rows, mc->n_head * mc->head_dim);
        assert_int_equal(lw->wk.rows, mc->n_head_kv * mc->head_dim);
        assert_int_equal(lw->w_down.cols, mc->n_ff);
        assert_int_equal(lw->bq != NULL, mc->qkv_bias);
    }
    assert_non_null(td_model_tok_embd(m));
    assert_non_null(td_model_output(m));
    if (mc->tied_output)
        assert_ptr_equal(td_model_output(m)->data, td_model_tok_embd(m)->data);
    else
        assert_ptr_not_equal(td_model_output(m)->data, td_model_tok_embd(m)->data);
    td_model_free(m);
    json_decref(e);
}

static void test_configs(void **state) {
    (void)state;
    need_models();
    const char *names[] = {
        "llama2-f32-gguf",    "llama3-q8_0-gguf",         "mistral-q4_0-gguf", "qwen2-bf16-gguf",
        "smollm2-mixed-gguf", "tinyllama-q4_1-gguf",      "llama3-f16-hf",     "qwen2-f32-hf",
        "mistral-bf16-hf",    "tinyllama-bf16-hf-sharded"};
    for (size_t i = 0; i < TD_ARRAY_SIZE(names); i++) check_config(names[i]);
}

/* Llama-3 RoPE: the HF loader applies the band formula (written out here
 * from the definition), the GGUF loader divides by rope_freqs.weight;
 * both must give the same frequencies. */
static void test_rope_llama3(void **state) {
    (void)state;
    need_models();
    json_t *e = manifest_entry("llama3-f32-hf");
    json_t *c = json_object_get(e, "config"), *rs = json_object_get(c, "rope_scaling");
    assert_true(json_is_object(rs));
    double factor = json_number_value(json_object_get(rs, "factor"));
    double lo = json_number_value(json_object_get(rs, "low_freq_factor"));
    double hi = json_number_value(json_object_get(rs, "high_freq_factor"));
    double orig = json_number_value(json_object_get(rs, "original_ctx"));
    double theta = json_number_value(json_object_get(c, "rope_theta"));
    int hd = (int)jint(c, "head_dim");
    char hf[4096], gg[4096];
    model_path("hf/llama3-f32", hf, sizeof hf);
    model_path("gguf/llama3-f32.gguf", gg, sizeof gg);
    td_model_params p = td_model_default_params();
    td_model *mh = NULL, *mg = NULL;
    p.path = hf;
    assert_int_equal(td_model_load(&p, &mh), TD_OK);
    p.path = gg;
    assert_int_equal(td_model_load(&p, &mg), TD_OK);
    assert_int_equal(td_model_get_config(mh)->rope_scaling, TD_ROPE_SCALING_LLAMA3);
    const float *fh = td_model_rope_inv_freq(mh), *fg = td_model_rope_inv_freq(mg);
    int kept = 0, divided = 0, smoothed = 0;
    for (int i = 0; i < hd / 2; i++) {
        double f = pow(theta, -2.0 * i / hd), wl = 2 * M_PI / f, want;
        if (wl < orig / hi) {
            want = f;
            kept++;
        } else if (wl > orig / lo) {
            want = f / factor;
            divided++;
        } else {
            double s = (orig / wl - lo) / (hi - lo);
            want = (1 - s) * f / factor + s * f;
            smoothed++;
        }
        /* float32 storage: 1e-6 relative covers rounding of the value and
         * of the F32 rope_freqs divisors the converter wrote. */
        assert_float_equal(fh[i], want, 1e-6 * want);
        assert_float_equal(fg[i], want, 1e-6 * want);
    }
    assert_true(kept > 0 && divided > 0 && smoothed > 0);
    /* Without scaling, GGUF llama2: plain theta^(-2i/d). */
    model_path("gguf/llama2-f32.gguf", gg, sizeof gg);
    td_model *m2 = NULL;
    p.path = gg;
    assert_int_equal(td_model_load(&p, &m2), TD_OK);
    const td_model_config *c2 = td_model_get_config(m2);
    for (int i = 0; i < c2->n_rot / 2; i++) {
        double want = pow(c2->rope_theta, -2.0 * i / c2->n_rot);
        assert_float_equal(td_model_rope_inv_freq(m2)[i], want, 1e-6 * want);
    }
    td_model_free(m2);
    td_model_free(mh);
    td_model_free(mg);
    json_decref(e);
}

/* TP shards point into the file: rows for Q/K/V/gate/up, a column block
 * offset with the full row stride for wo/down. Pipeline stages hold only
 * their layers and the embedding / head at the ends. */
static void test_shards(void **state) {
    (void)state;
    need_models();
    char path[4096];
    model_path("gguf/tinyllama-q4_0.gguf", path, sizeof path); /* 8 heads, 2 KV heads */
    td_gguf *g = NULL;
    assert_int_equal(td_gguf_open(path, &g), TD_OK);
    const td_gguf_tensor *q = td_gguf_find_tensor(g, "blk.1.attn_q.weight");
    const td_gguf_tensor *o = td_gguf_find_tensor(g, "blk.1.attn_output.weight");
    const td_gguf_tensor *d = td_gguf_find_tensor(g, "blk.1.ffn_down.weight");
    assert_non_null(q);
    size_t qrow = q->nbytes / (size_t)q->ne[1], orow = o->nbytes / (size_t)o->ne[1];
    size_t drow = d->nbytes / (size_t)d->ne[1];
    for (int r = 0; r < 2; r++) {
        td_model_params p = td_model_default_params();
        p.path = path;
        p.tp_rank = r;
        p.tp_size = 2;
        td_model *m = NULL;
        assert_int_equal(td_model_load(&p, &m), TD_OK);
        assert_int_equal(td_model_n_head_local(m), 4);
        assert_int_equal(td_model_n_head_kv_local(m), 1);
        const td_layer_weights *lw = td_model_layer(m, 1);
        int64_t q_loc = q->ne[1] / 2, o_loc = o->ne[0] / 2, d_loc = d->ne[0] / 2;
        assert_int_equal(lw->wq.rows, q_loc);
        /* Same bytes as the file's slice (the model maps the file itself). */
        assert_memory_equal(lw->wq.data, (const uint8_t *)q->data + (size_t)(r * q_loc) * qrow,
                            (size_t)q_loc * qrow);
        assert_int_equal(lw->wo.cols, o_loc);
        assert_int_equal(lw->wo.stride, orow);
        assert_int_equal(lw->w_down.cols, d_loc);
        assert_int_equal(lw->w_down.stride, drow);
        /* q4_0: 32 elements in 18 bytes; row i of the shard starts at the column block. */
        for (int64_t i = 0; i < o->ne[1]; i++) {
            assert_memory_equal((const uint8_t *)lw->wo.data + (size_t)i * orow,
                                (const uint8_t *)o->data + (size_t)i * orow +
                                    (size_t)(r * o_loc / 32) * 18,
                                (size_t)o_loc / 32 * 18);
        }
        for (int64_t i = 0; i < d->ne[1]; i++) {
            assert_memory_equal((const uint8_t *)lw->w_down.data + (size_t)i * drow,
                                (const uint8_t *)d->data + (size_t)i * drow +
                                    (size_t)(r * d_loc / 32) * 18,
                                (size_t)d_loc / 32 * 18);
        }
        td_model_free(m);
    }
    td_gguf_close(g);

    td_model_params p = td_model_default_params();
    p.path = path;
    p.layer_begin = 1;
    p.layer_end = 2;
    td_model *m = NULL;
    assert_int_equal(td_model_load(&p, &m), TD_OK);
    assert_null(td_model_tok_embd(m));
    assert_non_null(td_model_output(m));
    assert_non_null(td_model_output_norm(m));
    td_model_free(m);
    p.layer_begin = 0;
    p.layer_end = 1;
    assert_int_equal(td_model_load(&p, &m), TD_OK);
    assert_non_null(td_model_tok_embd(m));
    assert_null(td_model_output(m));
    td_model_free(m);

    /* tp 4 > 2 KV heads: ranks 2 and 3 share KV head 1 (rows 16..31 of attn_k). */
    assert_int_equal(td_gguf_open(path, &g), TD_OK);
    const td_gguf_tensor *k = td_gguf_find_tensor(g, "blk.0.attn_k.weight");
    size_t krow = k->nbytes / (size_t)k->ne[1];
    for (int r = 0; r < 4; r++) {
        p = td_model_default_params();
        p.path = path;
        p.tp_size = 4;
        p.tp_rank = r;
        assert_int_equal(td_model_load(&p, &m), TD_OK);
        assert_int_equal(td_model_n_head_local(m), 2);
        assert_int_equal(td_model_n_head_kv_local(m), 1);
        const td_weight *wk = &td_model_layer(m, 0)->wk;
        assert_int_equal(wk->rows, 16);
        assert_memory_equal(wk->data, (const uint8_t *)k->data + (size_t)(r / 2) * 16 * krow,
                            16 * krow);
        td_model_free(m);
    }
    td_gguf_close(g);
    /* 3 ranks do not divide 8 heads; with smollm2's 6 heads, 3 ranks and 2 KV heads
     * neither divides the other. */
    p = td_model_default_params();
    p.path = path;
    p.tp_size = 3;
    expect_load_error(path, p, (const char *[]){path, "tp size 3", NULL});
    char smol[4096];
    model_path("gguf/smollm2-f32.gguf", smol, sizeof smol);
    p.path = smol;
    expect_load_error(smol, p, (const char *[]){smol, "head_count_kv 2", NULL});
    p.path = path;
    p.tp_size = 1;
    p.layer_begin = 1;
    p.layer_end = 5;
    expect_load_error(path, p, (const char *[]){path, "layer range", NULL});
}

/* ------------------------------------------------------- corrupt files */

static void corrupt_case(const char *base, const mutation *mu, const char **needles) {
    char src[4096], dst[512];
    model_path(base, src, sizeof src);
    snprintf(dst, sizeof dst, "%s/corrupt.gguf", g_tmp);
    rewrite(src, dst, mu);
    const char *with_path[8] = {dst};
    for (int i = 0; needles[i] && i < 6; i++) with_path[i + 1] = needles[i];
    expect_load_error(dst, td_model_default_params(), with_path);
    unlink(dst);
}

/* A re-write of base with mu's change that must load. */
static void rewrite_loads(const char *base, const mutation *mu) {
    char src[4096], dst[512];
    model_path(base, src, sizeof src);
    snprintf(dst, sizeof dst, "%s/loads.gguf", g_tmp);
    rewrite(src, dst, mu);
    td_model_params p = td_model_default_params();
    p.path = dst;
    td_model *m = NULL;
    assert_int_equal(td_model_load(&p, &m), TD_OK);
    td_model_free(m);
    unlink(dst);
}

static void test_rewrite_control(void **state) {
    (void)state;
    need_models();
    /* The unmodified re-write loads: the corrupt cases below differ only by their change. */
    mutation mu = {0};
    rewrite_loads("gguf/smollm2-mixed.gguf", &mu);
}

/* Linear RoPE scaling from GGUF metadata divides every frequency by the
 * factor; an unsupported scaling type is refused by name. */
static void test_rope_linear_gguf(void **state) {
    (void)state;
    need_models();
    char src[4096], dst[512];
    model_path("gguf/llama2-f32.gguf", src, sizeof src);
    snprintf(dst, sizeof dst, "%s/linear.gguf", g_tmp);
    mutation mu = {.set_str_key = "llama.rope.scaling.type",
                   .set_str = "linear",
                   .set_f32_key = "llama.rope.scaling.factor",
                   .set_f32 = 4.0f};
    rewrite(src, dst, &mu);
    td_model_params p = td_model_default_params();
    p.path = dst;
    td_model *m = NULL;
    assert_int_equal(td_model_load(&p, &m), TD_OK);
    const td_model_config *c = td_model_get_config(m);
    assert_int_equal(c->rope_scaling, TD_ROPE_SCALING_LINEAR);
    for (int i = 0; i < c->n_rot / 2; i++) {
        double want = pow(c->rope_theta, -2.0 * i / c->n_rot) / 4.0;
        assert_float_equal(td_model_rope_inv_freq(m)[i], want, 1e-6 * want);
    }
    td_model_free(m);
    unlink(dst);
    mutation mu2 = {.set_str_key = "llama.rope.scaling.type", .set_str = "yarn"};
    corrupt_case("gguf/llama2-f32.gguf", &mu2, (const char *[]){"yarn", NULL});
}

static void test_missing_tensor(void **state) {
    (void)state;
    need_models();
    mutation mu = {.drop_tensor = "blk.1.ffn_up.weight"};
    corrupt_case("gguf/smollm2-mixed.gguf", &mu,
                 (const char *[]){"blk.1.ffn_up.weight", "missing", NULL});
    mutation mu2 = {.drop_tensor = "blk.0.attn_k.bias"};
    corrupt_case("gguf/qwen2-q8_0.gguf", &mu2, (const char *[]){"blk.0.attn_k.bias", NULL});
    mutation mu3 = {.drop_tensor = "output_norm.weight"};
    corrupt_case("gguf/llama2-q4_1.gguf", &mu3, (const char *[]){"output_norm.weight", NULL});
}

static void test_wrong_shape(void **state) {
    (void)state;
    need_models();
    /* smollm2: n_embd 96, 2 KV heads of 16 → attn_k is [96, 32]; make it [96, 64]. */
    mutation mu = {.change_tensor = "blk.0.attn_k.weight",
                   .new_type = TD_TYPE_Q4_1,
                   .new_ne0 = 96,
                   .new_ne1 = 64};
    corrupt_case("gguf/smollm2-mixed.gguf", &mu,
                 (const char *[]){"blk.0.attn_k.weight", "shape", NULL});
    /* A norm of the wrong length. */
    mutation mu2 = {.change_tensor = "blk.1.ffn_norm.weight",
                    .new_type = TD_TYPE_F32,
                    .new_ne0 = 95,
                    .new_ne1 = 1};
    corrupt_case("gguf/llama2-f32.gguf", &mu2, (const char *[]){"blk.1.ffn_norm.weight", NULL});
    /* Transposed down projection. */
    mutation mu3 = {.change_tensor = "blk.0.ffn_down.weight",
                    .new_type = TD_TYPE_F32,
                    .new_ne0 = 64,
                    .new_ne1 = 192};
    corrupt_case("gguf/llama2-f32.gguf", &mu3,
                 (const char *[]){"blk.0.ffn_down.weight", "expected", NULL});
}

static void test_unsupported_type(void **state) {
    (void)state;
    need_models();
    mutation mu = {.change_tensor = "blk.0.ffn_gate.weight",
                   .new_type = TD_TYPE_IQ4_XS_ID,
                   .new_ne0 = 256,
                   .new_ne1 = 96};
    corrupt_case("gguf/smollm2-mixed.gguf", &mu,
                 (const char *[]){"blk.0.ffn_gate.weight", "iq4_xs", NULL});
}

static void test_bad_heads(void **state) {
    (void)state;
    need_models();
    /* 6 heads, 4 KV heads: not a divisor. */
    mutation mu = {.set_u32_key = "llama.attention.head_count_kv", .set_u32 = 4};
    corrupt_case("gguf/smollm2-mixed.gguf", &mu, (const char *[]){"head_count_kv 4", NULL});
    /* 7 heads do not divide n_embd 96. */
    mutation mu2 = {.set_u32_key = "llama.attention.head_count", .set_u32 = 7};
    corrupt_case("gguf/smollm2-mixed.gguf", &mu2, (const char *[]){"head_count 7", NULL});
    /* Zero layers. */
    mutation mu3 = {.set_u32_key = "llama.block_count", .set_u32 = 0};
    corrupt_case("gguf/smollm2-mixed.gguf", &mu3, (const char *[]){"block_count", NULL});
}

static void test_vocab_mismatch(void **state) {
    (void)state;
    need_models();
    /* vocab_size says 511; the embedding has 512 rows. */
    mutation mu = {.set_u32_key = "llama.vocab_size", .set_u32 = 511};
    corrupt_case("gguf/llama2-f32.gguf", &mu, (const char *[]){"token_embd.weight", NULL});
    /* Embedding, head and vocab_size agree on 544, the tokenizer has 512. */
    mutation mu2 = {.set_u32_key = "llama.vocab_size",
                    .set_u32 = 544,
                    .rows_tensor = {"token_embd.weight", "output.weight"},
                    .new_rows = 544};
    corrupt_case("gguf/llama2-f32.gguf", &mu2, (const char *[]){"512", "544", NULL});
}

/* A special token id outside the vocabulary (512 tokens) is an error naming
 * the key and the id, one case per key; the last id (511) loads. */
static void test_special_token_out_of_vocab(void **state) {
    (void)state;
    need_models();
    static const char *keys[] = {
        "tokenizer.ggml.bos_token_id",     "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",     "tokenizer.ggml.eom_token_id",
        "tokenizer.ggml.padding_token_id", "tokenizer.ggml.unknown_token_id"};
    for (size_t i = 0; i < sizeof keys / sizeof *keys; i++) {
        mutation mu = {.set_u32_key = keys[i], .set_u32 = 512};
        corrupt_case("gguf/llama2-f32.gguf", &mu,
                     (const char *[]){keys[i], "= 512", "outside the vocabulary", NULL});
    }
    mutation ok = {.set_u32_key = "tokenizer.ggml.eot_token_id", .set_u32 = 511};
    rewrite_loads("gguf/llama2-f32.gguf", &ok);
}

/* A bias the forward pass has no place for is refused, not ignored. */
static void test_unsupported_bias(void **state) {
    (void)state;
    need_models();
    mutation mu = {.rename_from = "blk.0.ffn_norm.weight", .rename_to = "blk.0.attn_output.bias"};
    corrupt_case("gguf/llama2-f32.gguf", &mu,
                 (const char *[]){"blk.0.attn_output.bias", "not supported", NULL});
}

static void test_unknown_arch(void **state) {
    (void)state;
    need_models();
    mutation moe = {.set_u32_key = "llama.expert_count", .set_u32 = 8};
    corrupt_case("gguf/llama2-f32.gguf", &moe, (const char *[]){"expert_count 8", NULL});
    mutation mu = {.set_str_key = "general.architecture", .set_str = "gpt2"};
    corrupt_case("gguf/llama2-f32.gguf", &mu, (const char *[]){"gpt2", NULL});
}

/* HF directory whose config.json is replaced; weights and tokenizer linked. */
static void hf_case(const char *base, const char *key, const char *json_value,
                    const char **needles) {
    char src[2048], dir[512], path[1024], target[4096];
    model_path(base, src, sizeof src);
    snprintf(dir, sizeof dir, "%s/hf-corrupt", g_tmp);
    mkdir(dir, 0700);
    const char *files[] = {"model.safetensors", "tokenizer.json", "tokenizer_config.json"};
    for (size_t i = 0; i < TD_ARRAY_SIZE(files); i++) {
        snprintf(path, sizeof path, "%s/%s", dir, files[i]);
        snprintf(target, sizeof target, "%s/%s", src, files[i]);
        unlink(path);
        assert_int_equal(symlink(target, path), 0);
    }
    snprintf(target, sizeof target, "%s/config.json", src);
    json_t *cfg = json_load_file(target, 0, NULL);
    assert_non_null(cfg);
    json_t *v = json_loads(json_value, JSON_DECODE_ANY, NULL);
    assert_non_null(v);
    json_object_set_new(cfg, key, v);
    snprintf(path, sizeof path, "%s/config.json", dir);
    assert_int_equal(json_dump_file(cfg, path, 0), 0);
    json_decref(cfg);
    const char *with_path[8] = {dir};
    for (int i = 0; needles[i] && i < 6; i++) with_path[i + 1] = needles[i];
    expect_load_error(dir, td_model_default_params(), with_path);
}

static void test_hf_corrupt(void **state) {
    (void)state;
    need_models();
    hf_case("hf/smollm2-f32", "architectures", "[\"GPT2LMHeadModel\"]",
            (const char *[]){"GPT2LMHeadModel", NULL});
    hf_case("hf/smollm2-f32", "hidden_size", "100",
            (const char *[]){"model.embed_tokens.weight", "shape", NULL});
    hf_case("hf/smollm2-f32", "intermediate_size", "320",
            (const char *[]){"model.layers.0.mlp.gate_proj.weight", "shape", NULL});
    hf_case("hf/smollm2-f32", "num_key_value_heads", "4", (const char *[]){"head_count", NULL});
    hf_case("hf/smollm2-f32", "vocab_size", "100",
            (const char *[]){"model.embed_tokens.weight", NULL});
    hf_case("hf/smollm2-f32", "tie_word_embeddings", "false",
            (const char *[]){"lm_head.weight", "missing", NULL});
    hf_case("hf/smollm2-f32", "rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 4.0}",
            (const char *[]){"yarn", NULL});
    hf_case("hf/smollm2-f32", "hidden_act", "\"gelu\"", (const char *[]){"gelu", NULL});
    hf_case("hf/smollm2-f32", "num_hidden_layers", "\"three\"",
            (const char *[]){"num_hidden_layers", NULL});
}

static void test_missing_file(void **state) {
    (void)state;
    char path[512];
    snprintf(path, sizeof path, "%s/does-not-exist.gguf", g_tmp);
    expect_load_error(path, td_model_default_params(), (const char *[]){path, NULL});
}

/* What the router reads: the configuration (its metadata part) and the
 * tokenizer alone, the same as a whole load gives, for a GGUF file and an HF directory; a file
 * that is missing or cut short is an error with nothing left open. */
static void test_describe(void **state) {
    (void)state;
    need_models();
    const char *rels[] = {"gguf/smollm2-f32.gguf", "hf/smollm2-f32", "gguf/tinyllama-q4_0.gguf"};
    for (size_t i = 0; i < sizeof rels / sizeof rels[0]; i++) {
        char path[512];
        model_path(rels[i], path, sizeof path);
        td_model_params mp = td_model_default_params();
        mp.path = path;
        td_model *m = NULL;
        assert_int_equal(td_model_load(&mp, &m), TD_OK);
        td_model_config cfg;
        td_tokenizer *tok = NULL;
        assert_int_equal(td_model_describe(path, &cfg, &tok), TD_OK);
        assert_non_null(tok);
        const td_model_config *mc = td_model_get_config(m);
        assert_string_equal(cfg.name, mc->name);
        assert_int_equal(cfg.arch, mc->arch);
        assert_int_equal(cfg.n_ctx_train, mc->n_ctx_train);
        assert_int_equal(cfg.n_vocab, mc->n_vocab);
        assert_int_equal(cfg.n_layer, mc->n_layer);
        assert_int_equal(cfg.n_embd, mc->n_embd);
        assert_int_equal(cfg.n_head, mc->n_head);
        assert_int_equal(cfg.n_head_kv, mc->n_head_kv);
        const td_tokenizer *mt = td_model_tokenizer(m);
        assert_int_equal(td_tokenizer_n_vocab(tok), td_tokenizer_n_vocab(mt));
        const char *text = "Hello, world: the tokenizer alone.";
        int32_t *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        assert_int_equal(td_tokenizer_encode(tok, text, strlen(text), true, true, &a, &na), TD_OK);
        assert_int_equal(td_tokenizer_encode(mt, text, strlen(text), true, true, &b, &nb), TD_OK);
        assert_true(na > 0);
        assert_int_equal(na, nb);
        assert_memory_equal(a, b, na * sizeof a[0]);
        free(a);
        free(b);
        td_tokenizer_free(tok);
        td_model_free(m);
    }
    char path[512], cut[600];
    snprintf(path, sizeof path, "%s/does-not-exist.gguf", g_tmp);
    td_model_config cfg;
    td_tokenizer *tok = (td_tokenizer *)&cfg;
    capture_begin();
    assert_int_not_equal(td_model_describe(path, &cfg, &tok), TD_OK);
    capture_end();
    assert_null(tok);
    model_path("gguf/smollm2-f32.gguf", path, sizeof path);
    snprintf(cut, sizeof cut, "%s/cut.gguf", g_tmp);
    FILE *in = fopen(path, "rb"), *out = fopen(cut, "wb");
    assert_non_null(in);
    assert_non_null(out);
    char head[4096];
    size_t n = fread(head, 1, sizeof head, in); /* the header and part of the metadata */
    assert_int_equal(fwrite(head, 1, n, out), n);
    fclose(in);
    fclose(out);
    capture_begin();
    assert_int_not_equal(td_model_describe(cut, &cfg, &tok), TD_OK);
    capture_end();
    assert_null(tok);
}

static int setup(void **state) {
    (void)state;
    snprintf(g_tmp, sizeof g_tmp, "/tmp/td-model-load-XXXXXX");
    return mkdtemp(g_tmp) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void) {
    td_backend_isa_select(td_backend_isa_best());
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_configs),
        cmocka_unit_test(test_rope_llama3),
        cmocka_unit_test(test_shards),
        cmocka_unit_test(test_rewrite_control),
        cmocka_unit_test(test_missing_tensor),
        cmocka_unit_test(test_wrong_shape),
        cmocka_unit_test(test_unsupported_type),
        cmocka_unit_test(test_bad_heads),
        cmocka_unit_test(test_vocab_mismatch),
        cmocka_unit_test(test_unknown_arch),
        cmocka_unit_test(test_unsupported_bias),
        cmocka_unit_test(test_hf_corrupt),
        cmocka_unit_test(test_special_token_out_of_vocab),
        cmocka_unit_test(test_rope_linear_gguf),
        cmocka_unit_test(test_missing_file),
        cmocka_unit_test(test_describe),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
