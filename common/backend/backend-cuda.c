/* The CUDA backend: the ops of the forward pass on one NVIDIA GPU, one
 * stream per rank, through the kernels of kernels/cuda (ops.h).
 *
 * Memory. Buffers are device memory (cudaMalloc, zero-filled as alloc
 * promises). The model's F32/F16/BF16 matrices and its norm, bias and RoPE
 * vectors are copied to the device once (upload_model), each matrix packed
 * to its own rows (a TP shard's columns only); ops name them by the
 * model's host pointers, which resolve through a sorted table. KV storage
 * is device memory; its hook registers it (the network reaches device
 * memory only through a UCX with CUDA transports).
 *
 * Comm: the shm communicator works on host memory, so comm_ptr stages a
 * buffer through a pinned host mirror (device to host at comm_ptr, every
 * staged buffer back at comm_end). Slow, for tests that run several ranks
 * on one GPU; NCCL replaces it.
 *
 * Refused at start-up through supports(): quantized weights, context
 * parallelism, MoE. Not in a build without CUDA: td_backend_cuda_create
 * says so. */
#include "backend-impl.h"

#ifdef TD_HAVE_CUDA

#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/ops.h"

/* A device copy of one host array of the model. */
typedef struct {
    const void *host;
    void *dev;
    size_t stride; /* packed row bytes (matrices), else 0 */
} dev_map;

/* An int32 array that grows (device or host memory, as its user says). */
typedef struct {
    int32_t *p;
    int32_t cap;
} i32_array;

typedef struct cuda_buf {
    td_bbuf b;    /* first: b.p is the device pointer */
    void *mirror; /* pinned host copy for the comm (allocated on first use) */
    bool staged;  /* copied into the mirror by this comm call */
    struct cuda_buf *prev, *next;
} cuda_buf;

typedef struct {
    int device;
    cudaStream_t stream;
    cudaError_t failed; /* the first error since the last status() */
    dev_map *maps;
    size_t n_maps, cap_maps;
    cuda_buf *bufs;
    /* the step's batch, on the device */
    i32_array seq, pos, tok, logit, tab, off; /* device: the batch's rows and tables */
    i32_array rows_idx;                       /* device: copy_rows' row list */
    i32_array h_off, h_tab;                   /* host: the tables, gathered */
    td_cuda_rows rows;
} cuda_ctx;

static cuda_ctx *ctx_of(td_backend *be) { return be->ctx; }

static bool ck(cuda_ctx *c, cudaError_t e, const char *what) {
    if (e == cudaSuccess) return true;
    TD_LOG_ERROR("cuda:%d: %s: %s", c->device, what, cudaGetErrorString(e));
    if (!c->failed) c->failed = e;
    return false;
}

static void launched(cuda_ctx *c, td_cuda_err e, const char *op) {
    if (e) ck(c, (cudaError_t)e, op);
}

static void *dptr(td_bview v) { return (char *)v.b->p + v.off; }

/* ---------------------------------------------------------------- weights */

static bool float_type(td_dtype t) {
    return t == TD_TYPE_F32 || t == TD_TYPE_F16 || t == TD_TYPE_BF16;
}

static int map_cmp(const void *a, const void *b) {
    uintptr_t x = (uintptr_t)((const dev_map *)a)->host, y = (uintptr_t)((const dev_map *)b)->host;
    return x < y ? -1 : x > y;
}

static const dev_map *find(const cuda_ctx *c, const void *host) {
    dev_map key = {.host = host};
    return host ? bsearch(&key, c->maps, c->n_maps, sizeof key, map_cmp) : NULL;
}

static void *dev_of(const cuda_ctx *c, const void *host) {
    const dev_map *m = find(c, host);
    TD_ASSERT(!host || m); /* every array an op names was uploaded */
    return m ? m->dev : NULL;
}

static td_status add_map(cuda_ctx *c, const void *host, void *dev, size_t stride) {
    if (c->n_maps == c->cap_maps) {
        size_t n = c->cap_maps ? 2 * c->cap_maps : 64;
        dev_map *m = realloc(c->maps, n * sizeof *m);
        if (!m) return TD_ERR_NOMEM;
        c->maps = m;
        c->cap_maps = n;
    }
    c->maps[c->n_maps++] = (dev_map){host, dev, stride};
    return TD_OK;
}

/* Forgets the device copy of host (uploaded again by the op tests). */
static void drop(cuda_ctx *c, const void *host) {
    dev_map *m = (dev_map *)find(c, host);
    if (!m) return;
    cudaFree(m->dev);
    size_t i = (size_t)(m - c->maps);
    memmove(m, m + 1, (c->n_maps - i - 1) * sizeof *m);
    c->n_maps--;
}

static td_status up_vec(cuda_ctx *c, const float *h, size_t n) {
    if (!h || find(c, h)) return TD_OK;
    void *d = NULL;
    if (!ck(c, cudaMalloc(&d, n * sizeof(float)), "cudaMalloc") ||
        !ck(c, cudaMemcpy(d, h, n * sizeof(float), cudaMemcpyHostToDevice), "upload")) {
        cudaFree(d);
        return TD_ERR_NOMEM;
    }
    td_status st = add_map(c, h, d, 0);
    if (st) cudaFree(d);
    qsort(c->maps, c->n_maps, sizeof *c->maps, map_cmp);
    return st;
}

static td_status up_weight(cuda_ctx *c, const td_weight *w) {
    if (!w || w->rows == 0 || !w->data || find(c, w->data)) return TD_OK;
    size_t row =
        (size_t)w->cols * td_dtype_block_bytes(w->type) / (size_t)td_dtype_block_elems(w->type);
    void *d = NULL;
    if (!ck(c, cudaMalloc(&d, row * (size_t)w->rows), "cudaMalloc") ||
        !ck(c,
            cudaMemcpy2D(d, row, w->data, w->stride, row, (size_t)w->rows, cudaMemcpyHostToDevice),
            "upload")) {
        cudaFree(d);
        return TD_ERR_NOMEM;
    }
    td_status st = add_map(c, w->data, d, row);
    if (st) cudaFree(d);
    qsort(c->maps, c->n_maps, sizeof *c->maps, map_cmp);
    return st;
}

static td_status cuda_upload_weight(td_backend *be, const td_weight *w) {
    cuda_ctx *c = ctx_of(be);
    if (!float_type(w->type)) return TD_ERR_UNSUPPORTED;
    drop(c, w->data);
    return up_weight(c, w);
}

static td_status cuda_upload_floats(td_backend *be, const float *p, size_t n) {
    cuda_ctx *c = ctx_of(be);
    drop(c, p);
    return up_vec(c, p, n);
}

static td_status cuda_upload_model(td_backend *be, const td_model *m) {
    cuda_ctx *c = ctx_of(be);
    const td_model_config *cfg = td_model_get_config(m);
    td_status st = TD_OK;
    if (!ck(c, cudaSetDevice(c->device), "cudaSetDevice")) return TD_ERR_IO;
    for (size_t i = 0; i < c->n_maps; i++) cudaFree(c->maps[i].dev); /* another model's */
    c->n_maps = 0;
    st = up_weight(c, td_model_tok_embd(m));
    if (!st) st = up_weight(c, td_model_output(m));
    if (!st) st = up_vec(c, td_model_output_norm(m), (size_t)cfg->n_embd);
    if (!st) st = up_vec(c, td_model_rope_inv_freq(m), (size_t)cfg->n_rot / 2);
    for (int l = td_model_layer_begin(m); l < td_model_layer_end(m) && !st; l++) {
        const td_layer_weights *lw = td_model_layer(m, l);
        const td_weight *ws[] = {&lw->wq,     &lw->wk,   &lw->wv,    &lw->wo,
                                 &lw->w_gate, &lw->w_up, &lw->w_down};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0] && !st; i++) st = up_weight(c, ws[i]);
        if (!st) st = up_vec(c, lw->attn_norm, (size_t)cfg->n_embd);
        if (!st) st = up_vec(c, lw->ffn_norm, (size_t)cfg->n_embd);
        if (!st) st = up_vec(c, lw->bq, (size_t)lw->wq.rows);
        if (!st) st = up_vec(c, lw->bk, (size_t)lw->wk.rows);
        if (!st) st = up_vec(c, lw->bv, (size_t)lw->wv.rows);
    }
    if (st) TD_LOG_ERROR("cuda:%d: out of device memory for the weights", c->device);
    return st;
}

/* ----------------------------------------------------------------- memory */

static td_bbuf *link_buf(cuda_ctx *c, cuda_buf *b) {
    b->next = c->bufs;
    if (c->bufs) c->bufs->prev = b;
    c->bufs = b;
    return &b->b;
}

static td_bbuf *cuda_alloc(td_backend *be, size_t bytes) {
    cuda_ctx *c = ctx_of(be);
    cuda_buf *b = calloc(1, sizeof *b);
    void *d = NULL;
    /* zero-filled before any op of the stream can write it */
    if (!b || !ck(c, cudaSetDevice(c->device), "cudaSetDevice") ||
        !ck(c, cudaMalloc(&d, bytes ? bytes : 1), "cudaMalloc") ||
        !ck(c, cudaMemsetAsync(d, 0, bytes ? bytes : 1, c->stream), "cudaMemset") ||
        !ck(c, cudaStreamSynchronize(c->stream), "cudaMemset")) {
        cudaFree(d);
        free(b);
        return NULL;
    }
    b->b = (td_bbuf){.p = d, .bytes = bytes};
    return link_buf(c, b);
}

/* The attention reads f32 K and V (f16 and bf16 pools come with their
 * kernels). */
static td_status cuda_kv_layout(td_backend *be, const td_kv_params *p, td_kv_layout *l) {
    (void)be;
    return p->dtype == TD_TYPE_F32 ? td_kv_layout_dense(p, l) : TD_ERR_UNSUPPORTED;
}

static td_bbuf *cuda_kv_alloc(td_backend *be, const td_kv_layout *l, const td_kv_mem_hook *hook) {
    cuda_ctx *c = ctx_of(be);
    if (hook && hook->alloc && !hook->reg) {
        TD_LOG_ERROR("cuda:%d: KV storage must be device memory: the transfer layer has to "
                     "register it (a UCX with CUDA transports), not allocate host memory",
                     c->device);
        return NULL;
    }
    td_bbuf *bb = cuda_alloc(be, l->bytes);
    if (!bb) return NULL;
    cuda_buf *b = (cuda_buf *)bb;
    b->b.kv = true;
    if (hook) b->b.hook = *hook;
    if (hook && hook->reg && hook->reg(hook->ctx, b->b.p, l->bytes, &b->b.handle)) {
        TD_LOG_ERROR("cuda:%d: the transfer layer could not register %zu bytes of KV", c->device,
                     l->bytes);
        b->b.hook = (td_kv_mem_hook){0};
        be->i->free(be, bb);
        return NULL;
    }
    return bb;
}

static void cuda_free(td_backend *be, td_bbuf *bb) {
    cuda_ctx *c = ctx_of(be);
    cuda_buf *b = (cuda_buf *)bb;
    if (b->b.kv && b->b.hook.release && b->b.hook.reg)
        b->b.hook.release(b->b.hook.ctx, b->b.handle);
    if (b->prev)
        b->prev->next = b->next;
    else
        c->bufs = b->next;
    if (b->next) b->next->prev = b->prev;
    cudaFree(b->b.p);
    cudaFreeHost(b->mirror);
    free(b);
}

/* ------------------------------------------------------------------- comm */

static void *cuda_comm_ptr(td_backend *be, td_bview v) {
    cuda_ctx *c = ctx_of(be);
    cuda_buf *b = (cuda_buf *)v.b;
    if (!b->mirror &&
        !ck(c, cudaMallocHost(&b->mirror, b->b.bytes ? b->b.bytes : 1), "cudaMallocHost")) {
        TD_LOG_ERROR("cuda:%d: no pinned memory to stage a collective", c->device);
        abort(); /* the communicator would write through NULL */
    }
    if (!b->staged) {
        ck(c, cudaMemcpyAsync(b->mirror, b->b.p, b->b.bytes, cudaMemcpyDeviceToHost, c->stream),
           "stage to host");
        ck(c, cudaStreamSynchronize(c->stream), "stage to host");
        b->staged = true;
    }
    return (char *)b->mirror + v.off;
}

static void *cuda_addr(td_backend *be, td_bview v) {
    (void)be;
    return dptr(v);
}

static void cuda_comm_begin(td_backend *be) {
    cuda_ctx *c = ctx_of(be);
    for (cuda_buf *b = c->bufs; b; b = b->next) b->staged = false; /* fresh copies only */
    ck(c, cudaStreamSynchronize(c->stream), "comm begin");
}

static td_status cuda_status(td_backend *be) {
    cuda_ctx *c = ctx_of(be);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) ck(c, e, "last error");
    td_status st = c->failed ? TD_ERR_IO : TD_OK;
    c->failed = cudaSuccess;
    return st;
}

static void cuda_comm_end(td_backend *be) {
    cuda_ctx *c = ctx_of(be);
    for (cuda_buf *b = c->bufs; b; b = b->next) {
        if (!b->staged) continue;
        ck(c, cudaMemcpyAsync(b->b.p, b->mirror, b->b.bytes, cudaMemcpyHostToDevice, c->stream),
           "stage to device");
        b->staged = false;
    }
    ck(c, cudaStreamSynchronize(c->stream), "comm end");
}

/* ------------------------------------------------------------------ batch */

/* Room for n entries of a device array (its old contents are not kept). */
static bool grow_dev(cuda_ctx *c, i32_array *a, int32_t n) {
    if (n <= a->cap) return true;
    int32_t cap = TD_MAX(n, 2 * a->cap);
    cudaFree(a->p);
    a->p = NULL;
    a->cap = 0;
    if (!ck(c, cudaMalloc((void **)&a->p, (size_t)cap * sizeof(int32_t)), "cudaMalloc"))
        return false;
    a->cap = cap;
    return true;
}

static bool grow_host(cuda_ctx *c, i32_array *a, int32_t n) {
    if (n <= a->cap) return true;
    int32_t cap = TD_MAX(n, 2 * a->cap);
    int32_t *p = realloc(a->p, (size_t)cap * sizeof(int32_t));
    if (!p) {
        TD_LOG_ERROR("out of memory");
        if (!c->failed) c->failed = cudaErrorMemoryAllocation;
        return false;
    }
    a->p = p;
    a->cap = cap;
    return true;
}

/* The host array h (n entries) into device array a, grown as needed. */
static bool upload(cuda_ctx *c, i32_array *a, const int32_t *h, int32_t n) {
    return n <= 0 || (grow_dev(c, a, n) && ck(c,
                                              cudaMemcpyAsync(a->p, h, (size_t)n * sizeof(int32_t),
                                                              cudaMemcpyHostToDevice, c->stream),
                                              "batch upload"));
}

static void cuda_set_batch(td_backend *be, const td_backend_batch *b) {
    cuda_ctx *c = ctx_of(be);
    c->rows.n_rows = 0; /* until the tables below are in place */
    if (!ck(c, cudaSetDevice(c->device), "cudaSetDevice")) return; /* the calling thread's */
    int32_t n_tab = 0;
    for (int32_t s = 0; s < b->n_seqs; s++) n_tab += b->seq_n_blocks[s];
    if (!grow_host(c, &c->h_off, b->n_seqs + 1) || !grow_host(c, &c->h_tab, n_tab)) return;
    int32_t at = 0;
    for (int32_t s = 0; s < b->n_seqs; s++) {
        c->h_off.p[s] = at;
        memcpy(c->h_tab.p + at, b->seq_table[s], (size_t)b->seq_n_blocks[s] * sizeof(int32_t));
        at += b->seq_n_blocks[s];
    }
    c->h_off.p[b->n_seqs] = at;
    /* logit_src: the engine's (n_rows) array, of which the logit rows use a prefix */
    if (!upload(c, &c->seq, b->row_seq, b->n_rows) || !upload(c, &c->pos, b->row_pos, b->n_rows) ||
        !upload(c, &c->tok, b->row_tok, b->n_rows) ||
        !upload(c, &c->off, c->h_off.p, b->n_seqs + 1) || !upload(c, &c->tab, c->h_tab.p, at) ||
        (b->logit_src && !upload(c, &c->logit, b->logit_src, b->n_rows)))
        return;
    /* the uploads read host arrays valid until the next set_batch only */
    ck(c, cudaStreamSynchronize(c->stream), "batch upload");
    c->rows = (td_cuda_rows){.row_seq = c->seq.p,
                             .row_pos = c->pos.p,
                             .tab = c->tab.p,
                             .seq_off = c->off.p,
                             .n_rows = b->n_rows};
}

/* ------------------------------------------------------------------ copies */

static void cuda_copy(td_backend *be, td_bview dst, td_bview src, size_t bytes) {
    cuda_ctx *c = ctx_of(be);
    ck(c, cudaMemcpyAsync(dptr(dst), dptr(src), bytes, cudaMemcpyDeviceToDevice, c->stream),
       "copy");
}

static void cuda_copy_rows(td_backend *be, td_bview dst, td_bview src, const int32_t *src_rows,
                           int32_t n, size_t row_bytes) {
    cuda_ctx *c = ctx_of(be);
    if (n <= 0 || !upload(c, &c->rows_idx, src_rows, n)) return;
    launched(c, td_cuda_copy_rows(c->stream, dptr(dst), dptr(src), c->rows_idx.p, n, row_bytes),
             "copy_rows");
    ck(c, cudaStreamSynchronize(c->stream), "copy_rows"); /* src_rows is the caller's */
}

static void cuda_copy_to_host(td_backend *be, void *dst, td_bview src, size_t bytes) {
    cuda_ctx *c = ctx_of(be);
    ck(c, cudaMemcpyAsync(dst, dptr(src), bytes, cudaMemcpyDeviceToHost, c->stream), "to host");
    ck(c, cudaStreamSynchronize(c->stream), "to host");
}

static void cuda_copy_from_host(td_backend *be, td_bview dst, const void *src, size_t bytes) {
    cuda_ctx *c = ctx_of(be);
    ck(c, cudaMemcpyAsync(dptr(dst), src, bytes, cudaMemcpyHostToDevice, c->stream), "from host");
    ck(c, cudaStreamSynchronize(c->stream), "from host"); /* src is the caller's */
}

static void cuda_sync(td_backend *be) {
    cuda_ctx *c = ctx_of(be);
    ck(c, cudaStreamSynchronize(c->stream), "sync");
}

/* -------------------------------------------------------------------- ops */

static bool cuda_supports(td_backend *be, td_op op, td_dtype type) {
    (void)be;
    switch (op) {
    case TD_OP_EMBED:
    case TD_OP_MATMUL: return float_type(type);
    case TD_OP_ATTN_CP:
    case TD_OP_MOE: return false; /* for now: refused at start-up */
    default: return type == TD_TYPE_F32;
    }
}

static td_status cuda_reserve(td_backend *be, int32_t max_ctx, int head_dim) {
    (void)be, (void)max_ctx;
    return head_dim <= 512 ? TD_OK : TD_ERR_UNSUPPORTED;
}

static void cuda_embed(td_backend *be, const td_weight *w, int32_t v0, int32_t v1, td_bview x) {
    cuda_ctx *c = ctx_of(be);
    const dev_map *m = find(c, w->data);
    TD_ASSERT(m);
    launched(c,
             td_cuda_embed(c->stream, m->dev, w->type, m->stride, v0, v1, c->tok.p, c->rows.n_rows,
                           (int)w->cols, dptr(x)),
             "embed");
}

static void cuda_rmsnorm(td_backend *be, td_bview x, td_bview add, td_bview xn, int32_t n_rows,
                         bool logit_rows, const float *w, int n, float eps) {
    cuda_ctx *c = ctx_of(be);
    launched(c,
             td_cuda_rmsnorm(c->stream, dptr(x), add.b ? dptr(add) : NULL, dptr(xn),
                             logit_rows ? c->logit.p : NULL, n_rows, dev_of(c, w), n, eps),
             "rmsnorm");
}

static void cuda_add(td_backend *be, td_bview x, td_bview y, int32_t n_rows, int n) {
    cuda_ctx *c = ctx_of(be);
    launched(c, td_cuda_add(c->stream, dptr(x), dptr(y), n_rows, n), "add");
}

static void cuda_swiglu(td_backend *be, td_bview g, td_bview u, int32_t n_rows, int n) {
    cuda_ctx *c = ctx_of(be);
    launched(c, td_cuda_swiglu(c->stream, dptr(g), dptr(u), n_rows, n), "swiglu");
}

static void cuda_matmul(td_backend *be, int n_w, const td_weight *const *w, td_bview x, size_t ldx,
                        const td_bview *y, const size_t *ldy, int32_t n_rows) {
    cuda_ctx *c = ctx_of(be);
    for (int i = 0; i < n_w; i++) {
        if (w[i]->rows == 0) continue; /* an empty slice: nothing to compute, as on the CPU */
        const dev_map *m = find(c, w[i]->data);
        TD_ASSERT(m);
        launched(c,
                 td_cuda_matmul(c->stream, m->dev, w[i]->type, m->stride, w[i]->rows, w[i]->cols,
                                dptr(x), ldx, dptr(y[i]), ldy[i], n_rows),
                 "matmul");
    }
}

static td_cuda_kv kv_of(const td_backend_kv *kv) {
    return (td_cuda_kv){.k = dptr(kv->k),
                        .v = dptr(kv->v),
                        .block_size = kv->block_size,
                        .n_kv_heads = kv->n_kv_heads,
                        .head_dim = kv->head_dim};
}

static void cuda_rope_store(td_backend *be, td_bview q, td_bview k, td_bview v, const float *bq,
                            const float *bk, const float *bv, const td_backend_rope *rope,
                            const td_backend_kv *kv) {
    cuda_ctx *c = ctx_of(be);
    td_cuda_kv dk = kv_of(kv);
    launched(c,
             td_cuda_rope_store(c->stream, dptr(q), dptr(k), dptr(v), dev_of(c, bq), dev_of(c, bk),
                                dev_of(c, bv), dev_of(c, rope->inv_freq), rope->n_heads,
                                rope->n_kv_heads, rope->head_dim, rope->n_rot, rope->mode, &c->rows,
                                &dk),
             "rope_store");
}

static void cuda_attn(td_backend *be, td_bview q, td_bview att, const td_backend_kv *kv, int nh,
                      float scale, int64_t cost) {
    (void)cost;
    cuda_ctx *c = ctx_of(be);
    td_cuda_kv dk = kv_of(kv);
    launched(c, td_cuda_attn(c->stream, dptr(q), dptr(att), nh, &c->rows, &dk, scale), "attn");
}

static void cuda_head_place(td_backend *be, td_bview logits, td_bview head_buf, int32_t n_rows,
                            int32_t width, int32_t n_vocab, int vocab_tp) {
    cuda_ctx *c = ctx_of(be);
    launched(c,
             td_cuda_head_place(c->stream, dptr(logits), dptr(head_buf), n_rows, width, n_vocab,
                                vocab_tp),
             "head_place");
}

static void cuda_destroy(td_backend *be) {
    cuda_ctx *c = ctx_of(be);
    while (c->bufs) cuda_free(be, &c->bufs->b);
    for (size_t i = 0; i < c->n_maps; i++) cudaFree(c->maps[i].dev);
    free(c->maps);
    i32_array *dev[] = {&c->seq, &c->pos, &c->tok, &c->logit, &c->tab, &c->off, &c->rows_idx};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) cudaFree(dev[i]->p);
    free(c->h_off.p);
    free(c->h_tab.p);
    if (c->stream) cudaStreamDestroy(c->stream);
    free(c);
    free(be);
}

/* Ops the supports() answers keep from ever being called (CP, MoE) stay
 * NULL: the engine refuses such a shard at start-up. */
static const td_backend_i cuda_i = {
    .name = "cuda",
    .destroy = cuda_destroy,
    .supports = cuda_supports,
    .upload_model = cuda_upload_model,
    .upload_weight = cuda_upload_weight,
    .upload_floats = cuda_upload_floats,
    .reserve = cuda_reserve,
    .alloc = cuda_alloc,
    .kv_layout = cuda_kv_layout,
    .kv_alloc = cuda_kv_alloc,
    .free = cuda_free,
    .comm_ptr = cuda_comm_ptr,
    .addr = cuda_addr,
    .status = cuda_status,
    .comm_begin = cuda_comm_begin,
    .comm_end = cuda_comm_end,
    .set_batch = cuda_set_batch,
    .copy = cuda_copy,
    .copy_rows = cuda_copy_rows,
    .copy_to_host = cuda_copy_to_host,
    .copy_from_host = cuda_copy_from_host,
    .sync = cuda_sync,
    .embed = cuda_embed,
    .rmsnorm = cuda_rmsnorm,
    .add = cuda_add,
    .matmul = cuda_matmul,
    .rope_store = cuda_rope_store,
    .attn = cuda_attn,
    .swiglu = cuda_swiglu,
    .head_place = cuda_head_place,
};

bool td_backend_cuda_built(void) { return true; }

int td_backend_cuda_devices(void) {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

td_status td_backend_cuda_create(int device, td_backend **be_p) {
    int n = td_backend_cuda_devices();
    if (device < 0 || device >= n) {
        TD_LOG_ERROR("cuda:%d: no such GPU (%d visible)", device, n);
        return TD_ERR_UNSUPPORTED;
    }
    td_backend *be = calloc(1, sizeof *be);
    cuda_ctx *c = calloc(1, sizeof *c);
    if (!be || !c) {
        free(be);
        free(c);
        return TD_ERR_NOMEM;
    }
    c->device = device;
    be->i = &cuda_i;
    be->ctx = c;
    if (!ck(c, cudaSetDevice(device), "cudaSetDevice") ||
        !ck(c, cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), "stream")) {
        cuda_destroy(be);
        return TD_ERR_IO;
    }
    *be_p = be;
    return TD_OK;
}

#else /* no CUDA in this build */

bool td_backend_cuda_built(void) { return false; }

int td_backend_cuda_devices(void) { return 0; }

td_status td_backend_cuda_create(int device, td_backend **be_p) {
    (void)be_p;
    TD_LOG_ERROR("cuda:%d: this build has no CUDA backend (configure with -DTD_CUDA=ON on a "
                 "machine with the CUDA toolkit)",
                 device);
    return TD_ERR_UNSUPPORTED;
}

#endif
