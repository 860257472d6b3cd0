/* The CPU backend: the ops of backend.h on host memory, with the kernels of
 * kernels/cpu, shared out over the rank's thread pool.
 *
 * Each op is per token row (norm, bias, RoPE, KV write, SwiGLU), per (row,
 * output row) dot product (matmul, shared out in tiles of output rows), or
 * per (token, head) (attention, reading K/V back from the paged cache).
 * None of them splits a reduction across threads or depends on which other
 * rows are present, so a row's values are the same whatever the batch,
 * chunking or thread count (forward.h). Rows are handed to threads only to
 * share work; small row counts run on the calling thread, which computes
 * exactly the same values. MoE keeps the contract: routing is per row,
 * grouping tokens by expert only decides which rows share an expert's
 * matmul call (never a row's value), and each row adds its experts'
 * outputs in its own selection order.
 *
 * Activations stay f32 for every matmul by default: quantized weights are
 * dequantized on the fly (td_cpu_matmul_f32act), so the only error against
 * a float64 forward pass on the dequantized weights is f32 rounding. On a
 * CPU with AMX-INT8, Q4_K, Q5_K and Q6_K weights take the activations as x24
 * rows instead (24-bit fixed point per 256 elements, each super-block's
 * product an exact integer: kernels/cpu/x24.h), made once per matmul call
 * (task_x24q, per row) for every such weight of the call.
 * Quantizing the activations to 8 bits as well (llama.cpp's scheme) flipped
 * the greedy answer of the default Q4_1 model on a 0.08-logit margin; it is
 * there behind td_backend_set_act_int8 (--act-int8): each matmul call
 * quantizes its rows once (task_actq, per row, so the contract holds) and
 * the tiles run the int8 kernels (td_cpu_matmul). */
#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend-impl.h"
#include "kernels/cpu/attn-cp.h"
#include "kernels/cpu/qmatmul.h"
#include "kernels/cpu/x24.h"

#define ROW_TILE     16  /* matmul output rows are split between threads in tiles */
#define ROW_TILE_FEW 256 /* at most, for fewer than MIN_PAR_ROWS token rows (decode) */
#define ROW_TILE_MIN 64  /* at least, for them */
#define MIN_PAR_ROWS 4   /* fewer token rows than this: elementwise steps run inline */
#define ROW_CHUNK    4   /* token rows claimed at a time by elementwise steps */

/* Source bytes [src, end) of the model's weights, copied to dst. */
typedef struct {
    uintptr_t src, end;
    char *dst;
} wrange;

typedef struct {
    td_threadpool *tp;
    int nth;
    _Atomic int64_t work_next; /* next unclaimed work item of the running op */
    td_items mm_items;         /* tiles of detached (decode) matmuls */
    int32_t max_ctx;
    int head_dim;
    float *attn_scratch; /* (nth, ATTN_GROUP, max_ctx) */
    float *cp_tmp;       /* (nth, head_dim) one partial's output per thread */
    void *xq;            /* int8 activation rows (td_backend_set_act_int8) */
    size_t xq_cap;
    void *xa; /* x24 activation rows (kernels/cpu/x24.h) */
    size_t xa_cap;
    wrange *wr; /* (n_wr) the weight ranges copied to the arena, by source address */
    int n_wr;
    char *arena; /* arena_bytes: the matmuls' weights in transparent huge pages */
    size_t arena_bytes;
    td_backend_batch b;
} cpu_ctx;

#define F32(v) ((float *)td_bview_host(v))
#define I32(v) ((int32_t *)td_bview_host(v))

static cpu_ctx *ctx_of(td_backend *be) { return be->ctx; }

/* ------------------------------------------------------------- the ISA */

td_isa td_backend_isa_best(void) { return td_cpu_isa_best(); }
int td_backend_isa_parse(const char *name) { return td_cpu_isa_parse(name); }
const char *td_backend_isa_name(td_isa isa) { return td_cpu_isa_name(isa); }
/* On a CPU with AMX-INT8, Q4_K, Q5_K and Q6_K matmuls take their activations as
 * x24 rows (kernels/cpu/x24.h); TANDEM_X24=0 keeps them on the f32 kernels
 * (to compare the two). */
bool td_backend_isa_select(td_isa isa) {
    if (!td_cpu_select(isa)) return false;
    const char *e = getenv("TANDEM_X24");
    td_x24_set_enabled(!(e && strcmp(e, "0") == 0));
    return true;
}
td_isa td_backend_isa_selected(void) { return td_cpu_selected(); }

static bool g_act_int8;
void td_backend_set_act_int8(bool on) { g_act_int8 = on; }

/* ------------------------------------------------------------ dispatch */

/* Threads claim work items (rows, row tiles, heads) from a shared counter
 * instead of fixed shares, so a thread the OS deschedules delays nobody:
 * which thread computes an item never changes its value. */
static bool claim(cpu_ctx *c, int64_t n, int64_t chunk, int64_t *b, int64_t *end) {
    int64_t s = atomic_fetch_add_explicit(&c->work_next, chunk, memory_order_relaxed);
    if (s >= n) return false;
    *b = s;
    *end = TD_MIN(s + chunk, n);
    return true;
}

static void dispatch(cpu_ctx *c, td_task_fn fn, void *ctx, bool parallel) {
    atomic_store_explicit(&c->work_next, 0, memory_order_relaxed);
    if (parallel) /* every task claims its items: a worker that comes late skips the run */
        td_threadpool_run_shared(c->tp, fn, ctx); /* publishes the reset to the workers */
    else
        fn(ctx, 0, 1);
}

static bool threaded(const cpu_ctx *c) { return c->tp && c->nth > 1; }

static void run(cpu_ctx *c, td_task_fn fn, void *ctx, int64_t n_rows) {
    dispatch(c, fn, ctx, threaded(c) && n_rows >= MIN_PAR_ROWS);
}

/* ------------------------------------------------------- memory, batch */

/* Zero-filled, cache-line aligned host memory (NULL when out of memory). */
static void *host_alloc(size_t bytes) {
    size_t n = bytes ? (bytes + 63) & ~(size_t)63 : 64;
    void *p = n >= bytes ? aligned_alloc(64, n) : NULL;
    if (p) memset(p, 0, n);
    return p;
}

static td_bbuf *cpu_alloc(td_backend *be, size_t bytes) {
    (void)be;
    td_bbuf *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->p = host_alloc(bytes);
    if (!b->p) {
        free(b);
        return NULL;
    }
    b->bytes = bytes;
    return b;
}

/* Host KV storage: the hook's memory, or an anonymous mapping (zero-filled,
 * its pages taken as they are first written, as large pools need). */
td_status td_host_kv_alloc(td_bbuf *b, const td_kv_layout *l, const td_kv_mem_hook *hook) {
    *b = (td_bbuf){.bytes = l->bytes, .kv = true};
    if (hook) b->hook = *hook;
    if (hook && hook->alloc) {
        b->p = hook->alloc(hook->ctx, l->bytes, &b->handle);
        if (!b->p) {
            TD_LOG_ERROR("KV storage: the transfer layer could not allocate %zu bytes", l->bytes);
            return TD_ERR_NOMEM;
        }
        return TD_OK;
    }
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    b->map_bytes = ((l->bytes ? l->bytes : 1) + pg - 1) / pg * pg;
    void *p = mmap(NULL, b->map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        TD_LOG_ERROR("KV storage: mmap of %zu bytes failed: %s", b->map_bytes, strerror(errno));
        return TD_ERR_NOMEM;
    }
    b->p = p;
    td_status st = hook && hook->reg ? hook->reg(hook->ctx, p, l->bytes, &b->handle) : TD_OK;
    if (st) {
        TD_LOG_ERROR("KV storage: the transfer layer could not register %zu bytes", l->bytes);
        munmap(p, b->map_bytes);
        b->p = NULL;
    }
    return st;
}

void td_host_kv_free(td_bbuf *b) {
    if (b->hook.release && (b->hook.alloc || b->hook.reg)) b->hook.release(b->hook.ctx, b->handle);
    if (b->map_bytes) munmap(b->p, b->map_bytes);
    b->p = NULL;
}

/* The attention kernels read K and V of any KV dtype (F32, F16, BF16). */
static td_status cpu_kv_layout(td_backend *be, const td_kv_params *p, td_kv_layout *l) {
    (void)be;
    return td_kv_layout_dense(p, l);
}

static td_bbuf *cpu_kv_alloc(td_backend *be, const td_kv_layout *l, const td_kv_mem_hook *hook) {
    (void)be;
    td_bbuf *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    if (td_host_kv_alloc(b, l, hook)) {
        free(b);
        return NULL;
    }
    return b;
}

static void cpu_free(td_backend *be, td_bbuf *b) {
    /* a late worker of a detached matmul may still read its inputs */
    td_threadpool_quiesce(ctx_of(be)->tp);
    if (b->kv)
        td_host_kv_free(b);
    else
        free(b->p);
    free(b);
}

static void *cpu_comm_ptr(td_backend *be, td_bview v) {
    (void)be;
    return td_bview_host(v);
}

static void cpu_nop(td_backend *be) { (void)be; }

static td_status cpu_status(td_backend *be) {
    (void)be;
    return TD_OK;
}

static void cpu_set_batch(td_backend *be, const td_backend_batch *b) { ctx_of(be)->b = *b; }

static void cpu_copy(td_backend *be, td_bview dst, td_bview src, size_t bytes) {
    (void)be;
    if (bytes) memcpy(td_bview_host(dst), td_bview_host(src), bytes);
}

static void cpu_copy_rows(td_backend *be, td_bview dst, td_bview src, const int32_t *src_rows,
                          int32_t n, size_t row_bytes) {
    (void)be;
    char *d = td_bview_host(dst);
    const char *s = td_bview_host(src);
    for (int32_t i = 0; i < n; i++)
        memcpy(d + (size_t)i * row_bytes, s + (size_t)src_rows[i] * row_bytes, row_bytes);
}

static void cpu_copy_to_host(td_backend *be, void *dst, td_bview src, size_t bytes) {
    (void)be;
    if (bytes) memcpy(dst, td_bview_host(src), bytes);
}

static void cpu_copy_from_host(td_backend *be, td_bview dst, const void *src, size_t bytes) {
    (void)be;
    if (bytes) memcpy(td_bview_host(dst), src, bytes);
}

static bool cpu_supports(td_backend *be, td_op op, td_dtype type) {
    (void)be;
    (void)op;
    return td_dtype_supported((int)type);
}

/* ------------------------------------------------------------- weights */

/* The matmuls read a private copy of the weights in transparent huge pages
 * (2 MB) by default: generation streams every matrix once per token, and
 * from the file mapping's 4 KB pages the TLB misses cost about 3% of decode
 * speed on the Intel host (docs/PERFORMANCE.md). The copy is made
 * once per model (upload_model); a weight's data pointer finds its copy by
 * binary search over the copied ranges (a handful: the loader's tensors
 * lie together in the file). --mmap (td_backend_set_weight_copy(false))
 * keeps them in place: the page cache, shared with other processes. */
static bool g_weight_copy = true;
void td_backend_set_weight_copy(bool on) { g_weight_copy = on; }

/* Ranges closer than a page are copied as one (the tensors of a file lie
 * a few alignment bytes apart): every byte between them then shares a page
 * with one of them, so it is mapped, where a larger gap could be a hole. */
#define WR_GAP ((uintptr_t)4095)
#define HUGE   ((size_t)2 << 20)

static const void *wdata(const cpu_ctx *c, const td_weight *w) {
    uintptr_t p = (uintptr_t)w->data;
    int lo = 0, hi = c->n_wr - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (p < c->wr[mid].src)
            hi = mid - 1;
        else if (p >= c->wr[mid].end)
            lo = mid + 1;
        else
            return c->wr[mid].dst + (p - c->wr[mid].src);
    }
    return w->data;
}

static void weights_release(cpu_ctx *c) {
    if (c->arena) {
        td_threadpool_quiesce(c->tp); /* a late worker may still read them */
        munmap(c->arena, c->arena_bytes);
    }
    free(c->wr);
    c->wr = NULL;
    c->n_wr = 0;
    c->arena = NULL;
    c->arena_bytes = 0;
}

/* Weight w's bytes as range *n (r NULL: only counted). */
static void wr_add(wrange *r, int *n, const td_weight *w) {
    if (!w || !w->data || w->rows <= 0) return;
    uintptr_t p = (uintptr_t)w->data;
    if (r) r[*n] = (wrange){.src = p, .end = p + (size_t)w->rows * w->stride};
    (*n)++;
}

static int wr_cmp(const void *a, const void *b) {
    uintptr_t x = ((const wrange *)a)->src, y = ((const wrange *)b)->src;
    return x < y ? -1 : x > y;
}

/* True if [src, end) lies in one read-only mapping of a file (the loader's
 * GGUF or safetensors mapping), from /proc/self/maps. */
static bool file_mapped(uintptr_t src, uintptr_t end) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return false;
    char line[512];
    bool yes = false;
    while (fgets(line, sizeof line, f)) {
        unsigned long long lo, hi, ino;
        char perms[8];
        if (sscanf(line, "%llx-%llx %7s %*s %*s %llu", &lo, &hi, perms, &ino) != 4) continue;
        if (src >= lo && src < hi) {
            yes = end <= hi && ino != 0 && perms[1] != 'w';
            break;
        }
    }
    fclose(f);
    return yes;
}

/* Copies [src, end) to dst 2 MB at a time; from a read-only file mapping,
 * each copied part's pages are then dropped from this process (they come
 * back from the page cache if read again: the loader's own reads of the
 * file, token embedding rows), so the resident set holds the weights once,
 * not twice, even while the copy is made. */
static void copy_release(char *dst, uintptr_t src, uintptr_t end, bool file) {
    const uintptr_t pg = 4096;
    for (uintptr_t p = src; p < end; p += HUGE) {
        uintptr_t e = TD_MIN(p + HUGE, end);
        memcpy(dst + (p - src), (const void *)p, e - p);
        if (file) {
            uintptr_t lo = p & ~(pg - 1), hi = (e + pg - 1) & ~(pg - 1);
            madvise((void *)lo, hi - lo, MADV_DONTNEED);
        }
    }
}

/* The matrices the matmuls read: output head, every layer's projections,
 * router and experts (r NULL: only counted). */
static int model_weights(const td_model *m, wrange *r) {
    int n = 0;
    wr_add(r, &n, td_model_output(m));
    for (int l = td_model_layer_begin(m); l < td_model_layer_end(m); l++) {
        const td_layer_weights *lw = td_model_layer(m, l);
        const td_weight *ws[] = {&lw->wq,         &lw->wk,       &lw->wv,        &lw->wo,
                                 &lw->w_gate,     &lw->w_up,     &lw->w_down,    &lw->router,
                                 &lw->shexp_gate, &lw->shexp_up, &lw->shexp_down};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) wr_add(r, &n, ws[i]);
        for (int x = 0; x < lw->n_experts_local; x++) {
            wr_add(r, &n, &lw->experts[x].gate);
            wr_add(r, &n, &lw->experts[x].up);
            wr_add(r, &n, &lw->experts[x].down);
        }
    }
    return n;
}

static td_status cpu_upload_model(td_backend *be, const td_model *m) {
    cpu_ctx *c = ctx_of(be);
    weights_release(c); /* another model's */
    if (!g_weight_copy) return TD_OK;
    int cap = model_weights(m, NULL);
    wrange *r = malloc((size_t)(cap ? cap : 1) * sizeof *r);
    if (!r) return TD_ERR_NOMEM;
    int n = model_weights(m, r);
    qsort(r, (size_t)n, sizeof *r, wr_cmp);
    int k = 0; /* merged */
    for (int i = 0; i < n; i++) {
        if (k > 0 && r[i].src <= r[k - 1].end + WR_GAP) {
            if (r[i].end > r[k - 1].end) r[k - 1].end = r[i].end;
            continue;
        }
        r[k++] = r[i];
    }
    size_t bytes = 0; /* each range at its source's offset in a page */
    for (int i = 0; i < k; i++) {
        bytes = (bytes + 4095) / 4096 * 4096 + (r[i].src & 4095);
        r[i].dst = (char *)(uintptr_t)bytes; /* offset for now */
        bytes += r[i].end - r[i].src;
    }
    bytes = (bytes + HUGE - 1) / HUGE * HUGE;
    size_t avail = (size_t)td_mem_available();
    if (k == 0 || (avail && bytes > avail / 2)) {
        if (k)
            TD_LOG_INFO("weights read in place: a %zu-byte copy would take over half of the "
                        "%zu bytes available",
                        bytes, avail);
        free(r);
        return TD_OK;
    }
    /* a 2 MB-aligned start, so the copy can be all huge pages */
    char *map =
        mmap(NULL, bytes + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) {
        TD_LOG_INFO("weights read in place: mmap of %zu bytes: %s", bytes, strerror(errno));
        free(r);
        return TD_OK;
    }
    char *a = (char *)(((uintptr_t)map + HUGE - 1) & ~(uintptr_t)(HUGE - 1));
    if (a > map) munmap(map, (size_t)(a - map));
    munmap(a + bytes, (size_t)(map + HUGE - a));
    madvise(a, bytes, MADV_HUGEPAGE); /* advice: without THP the copy still works */
    for (int i = 0; i < k; i++) {
        r[i].dst = a + (uintptr_t)r[i].dst;
        copy_release(r[i].dst, r[i].src, r[i].end, file_mapped(r[i].src, r[i].end));
    }
    c->wr = r;
    c->n_wr = k;
    c->arena = a;
    c->arena_bytes = bytes;
    TD_LOG_DEBUG("weights: %zu bytes in %d ranges copied to huge pages", bytes, k);
    return TD_OK;
}

/* The CPU ops read host memory in place. */
static td_status cpu_upload_weight(td_backend *be, const td_weight *w) {
    (void)be, (void)w;
    return TD_OK;
}

static td_status cpu_upload_floats(td_backend *be, const float *p, size_t n) {
    (void)be, (void)p, (void)n;
    return TD_OK;
}

/* Queries attended in one call of the multi-query kernel, which loads each
 * K/V row once for all of them: query heads of one KV head, of up to
 * ATTN_ROWS consecutive rows of one sequence (a prefill chunk). */
#define ATTN_GROUP 24
#define ATTN_ROWS  8

static td_status cpu_reserve(td_backend *be, int32_t max_ctx, int head_dim) {
    cpu_ctx *c = ctx_of(be);
    if (max_ctx <= c->max_ctx && head_dim <= c->head_dim) return TD_OK;
    max_ctx = TD_MAX(max_ctx, c->max_ctx);
    head_dim = TD_MAX(head_dim, c->head_dim);
    float *a = host_alloc((size_t)c->nth * ATTN_GROUP * (size_t)max_ctx * sizeof(float));
    float *t = host_alloc((size_t)c->nth * (size_t)head_dim * sizeof(float));
    if (!a || !t) {
        free(a);
        free(t);
        TD_LOG_ERROR("out of memory for attention scratch (%d positions)", max_ctx);
        return TD_ERR_NOMEM;
    }
    free(c->attn_scratch);
    free(c->cp_tmp);
    c->attn_scratch = a;
    c->cp_tmp = t;
    c->max_ctx = max_ctx;
    c->head_dim = head_dim;
    return TD_OK;
}

/* ----------------------------------------------------------- row ops */

/* Embedding rows: dequantised straight from the (possibly quantised) table. */
typedef struct {
    cpu_ctx *c;
    const td_weight *w;
    int32_t v0, v1;
    float *x;
} embd_task;

static void task_embd(void *ctx, int ith, int nth) {
    const embd_task *t = ctx;
    cpu_ctx *c = t->c;
    const td_weight *w = t->w;
    (void)ith;
    (void)nth;
    int64_t r0, r1;
    while (claim(c, c->b.n_rows, ROW_CHUNK, &r0, &r1))
        for (int64_t r = r0; r < r1; r++) {
            int32_t id = c->b.row_tok[r];
            float *x = t->x + (size_t)r * (size_t)w->cols;
            if (id < t->v0 || id >= t->v1) {
                memset(x, 0, (size_t)w->cols * sizeof(float)); /* another rank's row */
                continue;
            }
            td_cpu_dequant_row(w->type, (const uint8_t *)w->data + (size_t)(id - t->v0) * w->stride,
                               x, w->cols);
        }
}

static void cpu_embed(td_backend *be, const td_weight *w, int32_t v0, int32_t v1, td_bview x) {
    cpu_ctx *c = ctx_of(be);
    embd_task t = {.c = c, .w = w, .v0 = v0, .v1 = v1, .x = F32(x)};
    run(c, task_embd, &t, c->b.n_rows);
}

/* Row step: [x += add] ; xn = rmsnorm(x[src], w). */
typedef struct {
    cpu_ctx *c;
    float *x, *xn;
    const float *add; /* NULL: none */
    int32_t n_rows;
    const int32_t *src_row; /* NULL: identity */
    const float *norm_w;
    int n;
    float eps;
} norm_task;

static void task_norm(void *ctx, int ith, int nth) {
    const norm_task *t = ctx;
    (void)ith;
    (void)nth;
    int64_t r0, r1;
    size_t E = (size_t)t->n;
    while (claim(t->c, t->n_rows, ROW_CHUNK, &r0, &r1))
        for (int64_t r = r0; r < r1; r++) {
            float *x = t->x + (size_t)(t->src_row ? t->src_row[r] : r) * E;
            if (t->add) td_cpu_add(x, t->add + (size_t)r * E, x, (int64_t)E);
            float *xn = t->xn + (size_t)r * E;
            td_cpu_rmsnorm(x, t->norm_w, xn, (int64_t)E, t->eps);
        }
}

static void cpu_rmsnorm(td_backend *be, td_bview x, td_bview add, td_bview xn, int32_t n_rows,
                        bool logit_rows, const float *w, int n, float eps) {
    cpu_ctx *c = ctx_of(be);
    norm_task t = {.c = c,
                   .x = F32(x),
                   .xn = F32(xn),
                   .add = add.b ? F32(add) : NULL,
                   .n_rows = n_rows,
                   .src_row = logit_rows ? c->b.logit_src : NULL,
                   .norm_w = w,
                   .n = n,
                   .eps = eps};
    run(c, task_norm, &t, n_rows);
}

static void cpu_add(td_backend *be, td_bview x, td_bview y, int32_t n_rows, int n) {
    (void)be;
    float *a = F32(x);
    const float *b = F32(y);
    for (int32_t r = 0; r < n_rows; r++)
        td_cpu_add(a + (size_t)r * (size_t)n, b + (size_t)r * (size_t)n, a + (size_t)r * (size_t)n,
                   (int64_t)n);
}

/* y_i = W_i x for up to TD_BACKEND_MAX_MM weights reading the same f32 rows
 * x (n_rows, ldx); each thread takes tiles of output rows. */
typedef struct {
    cpu_ctx *c;
    int32_t n_rows;
    int n_w;
    const td_weight *w[TD_BACKEND_MAX_MM];
    const void *wd[TD_BACKEND_MAX_MM]; /* their data: the copy's (wdata) */
    const float *x;
    size_t ldx;
    const uint8_t *xq; /* NULL: f32 activations; else int8 rows of xq_stride bytes */
    size_t xq_stride;
    const void *xa; /* non-NULL: x24 rows of x for the weights td_x24_type takes */
    float *y[TD_BACKEND_MAX_MM];
    size_t ldy[TD_BACKEND_MAX_MM];
    int64_t tile, n_tiles; /* output rows per tile; tiles over all the weights */
    uint64_t epoch;        /* detached runs: the run's td_items epoch */
} matmul_task;

/* Tile b of the weights in turn: weight *i, its output rows [*r0, *r1). */
static void mm_locate(const matmul_task *t, int64_t b, int *i, int64_t *r0, int64_t *r1) {
    int w = 0;
    for (;;) {
        int64_t n = (t->w[w]->rows + t->tile - 1) / t->tile;
        if (b < n) break;
        b -= n;
        w++;
    }
    *i = w;
    *r0 = b * t->tile;
    *r1 = TD_MIN(*r0 + t->tile, t->w[w]->rows);
}

/* Output rows [r0, r1) of weight i for every token row, row r0 going to
 * column 0 of y (ldy). */
static void mm_rows(const matmul_task *t, int i, int64_t r0, int64_t r1, float *y, size_t ldy) {
    const td_weight *w = t->w[i];
    const char *wr = (const char *)t->wd[i] + (size_t)r0 * w->stride;
    if (t->xa && td_x24_type(w->type))
        td_x24_matmul(w->type, wr, w->stride, t->xa, t->n_rows, w->cols, y, ldy, 0, (int)(r1 - r0));
    else if (t->xq)
        td_cpu_matmul(w->type, wr, w->stride, t->xq, t->xq_stride, t->n_rows, w->cols, y, ldy, 0,
                      (int)(r1 - r0));
    else
        td_cpu_matmul_f32act(w->type, wr, w->stride, t->x, t->ldx, t->n_rows, w->cols, y, ldy, 0,
                             (int)(r1 - r0));
}

/* Tile b in place. */
static void mm_tile(const matmul_task *t, int64_t b) {
    int i;
    int64_t r0, r1;
    mm_locate(t, b, &i, &r0, &r1);
    mm_rows(t, i, r0, r1, t->y[i] + r0, t->ldy[i]);
}

static void task_matmul(void *ctx, int ith, int nth) {
    (void)ith;
    (void)nth;
    const matmul_task *t = ctx;
    int64_t b, end;
    while (claim(t->c, t->n_tiles, 1, &b, &end)) mm_tile(t, b);
}

static void mm_redo(void *ctx, int64_t b) { mm_tile(ctx, b); }

_Static_assert(sizeof(matmul_task) <= TD_THREADPOOL_CTX_MAX, "a detached run copies its task");

/* Detached (decode) matmul: the caller computes its tiles in place; a
 * worker computes each tile into a buffer of its own and copies it in
 * only if it wins the tile's commit. The caller, out of tiles, waits for
 * the workers' tiles up to a deadline (a few of its own tiles' time) and
 * then computes what they still hold itself: a worker that another
 * process has pushed off its core delays the step by that deadline, not
 * by its time off the core. */
#define MM_WAIT_MIN_NS 20000
static void task_matmul_detached(void *ctx, int ith, int nth) {
    (void)nth;
    const matmul_task *t = ctx;
    td_items *it = &t->c->mm_items;
    int64_t b;
    if (ith == 0) {
        const uint64_t t0 = td_time_ns();
        int64_t mine = 0;
        for (; td_items_claim(it, t->epoch, t->n_tiles, &b); mine++) {
            mm_tile(t, b);
            td_items_done(it, t->epoch, b);
        }
        int64_t wait = mine ? 4 * (int64_t)(td_time_ns() - t0) / mine : 0;
        td_items_finish(it, t->epoch, t->n_tiles, TD_MAX(wait, MM_WAIT_MIN_NS), mm_redo, (void *)t);
        return;
    }
    static _Thread_local float buf[ROW_TILE_FEW * (MIN_PAR_ROWS - 1)];
    while (td_items_claim(it, t->epoch, t->n_tiles, &b)) {
        int i;
        int64_t r0, r1;
        mm_locate(t, b, &i, &r0, &r1);
        mm_rows(t, i, r0, r1, buf, ROW_TILE_FEW);
        if (!td_items_commit_begin(it, t->epoch, b)) continue; /* taken back: discard */
        for (int32_t r = 0; r < t->n_rows; r++)
            memcpy(t->y[i] + (size_t)r * t->ldy[i] + r0, buf + (size_t)r * ROW_TILE_FEW,
                   (size_t)(r1 - r0) * sizeof(float));
        td_items_commit_end(it, t->epoch, b);
    }
}

/* *buf (cap bytes) grown to hold need bytes of converted activation rows;
 * false when out of memory (the caller's f32 path needs none). */
static bool act_buf_reserve(cpu_ctx *c, void **buf, size_t *cap, size_t need) {
    if (need <= *cap) return true;
    void *p = host_alloc(need);
    if (!p) return false;
    td_threadpool_quiesce(c->tp); /* a late worker may still read the old rows */
    free(*buf);
    *buf = p;
    *cap = need;
    return true;
}

/* The activation rows in the int8 format of weight type wt, once per
 * matmul call, for every weight tile to read. */
typedef struct {
    cpu_ctx *c;
    td_dtype wt;
    const float *x;
    size_t ldx;
    uint8_t *xq;
    size_t xs;
    int32_t n_rows;
    int64_t k;
} actq_task;

static void task_actq(void *ctx, int ith, int nth) {
    (void)ith;
    (void)nth;
    const actq_task *t = ctx;
    int64_t r0, r1;
    while (claim(t->c, t->n_rows, ROW_CHUNK, &r0, &r1))
        for (int64_t r = r0; r < r1; r++)
            td_cpu_act_quant(t->wt, t->x + (size_t)r * t->ldx, t->xq + (size_t)r * t->xs, t->k);
}

/* With --act-int8: x quantized into c->xq (grown as needed) for weights
 * that are all quantized (the int8 row format is the same for every
 * quantized type, so a fused call may mix them: a Q4_K_M file's Q4_K
 * attn_q/attn_k and Q6_K attn_v); false leaves the f32 path. */
static bool act_int8_rows(cpu_ctx *c, int n_w, const td_weight *const *w, const float *x,
                          size_t ldx, int32_t n_rows, size_t *xs) {
    if (!g_act_int8) return false;
    for (int i = 0; i < n_w; i++)
        if (!td_dtype_has_int8_kernels(w[i]->type) || w[i]->cols != w[0]->cols) return false;
    *xs = td_cpu_act_row_bytes(w[0]->type, w[0]->cols);
    if (!act_buf_reserve(c, &c->xq, &c->xq_cap, *xs * (size_t)n_rows)) return false;
    actq_task q = {.c = c,
                   .wt = w[0]->type,
                   .x = x,
                   .ldx = ldx,
                   .xq = c->xq,
                   .xs = *xs,
                   .n_rows = n_rows,
                   .k = w[0]->cols};
    run(c, task_actq, &q, n_rows);
    return true;
}

/* The x24 rows of x, once per matmul call (task_x24q, per token range). */
typedef struct {
    cpu_ctx *c;
    const float *x;
    size_t ldx;
    void *xa;
    int32_t n_rows;
    int64_t k;
} x24q_task;

static void task_x24q(void *ctx, int ith, int nth) {
    (void)ith;
    (void)nth;
    const x24q_task *t = ctx;
    int64_t r0, r1;
    while (claim(t->c, t->n_rows, ROW_CHUNK, &r0, &r1))
        td_x24_quant(t->x, t->ldx, (int)r0, (int)r1, t->n_rows, t->k, t->xa);
}

/* Without --act-int8, weights that x24 takes (a CPU with AMX-INT8:
 * kernels/cpu/x24.h) read x as x24 rows, made here into c->xa; false
 * leaves every weight on the f32 path. */
static bool act_x24_rows(cpu_ctx *c, int n_w, const td_weight *const *w, const float *x, size_t ldx,
                         int32_t n_rows) {
    int64_t k = -1;
    for (int i = 0; i < n_w; i++)
        if (td_x24_type(w[i]->type)) k = w[i]->cols;
    if (g_act_int8 || k < 0) return false;
    for (int i = 0; i < n_w; i++)
        if (td_x24_type(w[i]->type) && w[i]->cols != k) return false;
    if (!act_buf_reserve(c, &c->xa, &c->xa_cap, td_x24_bytes(n_rows, k))) return false;
    x24q_task q = {.c = c, .x = x, .ldx = ldx, .xa = c->xa, .n_rows = n_rows, .k = k};
    run(c, task_x24q, &q, n_rows);
    return true;
}

static void matmul_host(cpu_ctx *c, int n_w, const td_weight *const *w, const float *x, size_t ldx,
                        float *const *y, const size_t *ldy, int32_t n_rows) {
    TD_ASSERT(n_w >= 1 && n_w <= TD_BACKEND_MAX_MM);
    matmul_task t = {.c = c, .n_rows = n_rows, .n_w = n_w, .x = x, .ldx = ldx, .tile = ROW_TILE};
    const bool x24 = act_x24_rows(c, n_w, w, x, ldx, n_rows);
    if (x24) t.xa = c->xa;
    if (n_rows < MIN_PAR_ROWS) { /* decode: about two tiles per thread, in multiples of 4 rows */
        int64_t rows = 0;
        for (int i = 0; i < n_w; i++) rows += w[i]->rows;
        t.tile = TD_MAX(ROW_TILE_MIN, TD_MIN(ROW_TILE_FEW, rows / (2 * c->nth)) & ~(int64_t)3);
        if (x24) t.tile &= ~(int64_t)15; /* whole 16-row strips */
    } else if (x24) {
        /* the AMX kernel streams the activations once per call: tiles of up
         * to ROW_TILE_FEW rows, about two per thread, in whole strips */
        int64_t rows = 0;
        for (int i = 0; i < n_w; i++) rows += w[i]->rows;
        t.tile = TD_MAX(ROW_TILE, TD_MIN(ROW_TILE_FEW, rows / (2 * c->nth)) & ~(int64_t)15);
    }
    for (int i = 0; i < n_w; i++) {
        t.w[i] = w[i];
        t.wd[i] = wdata(c, w[i]);
        t.y[i] = y[i];
        t.ldy[i] = ldy[i];
        t.n_tiles += (w[i]->rows + t.tile - 1) / t.tile;
    }
    if (act_int8_rows(c, n_w, w, x, ldx, n_rows, &t.xq_stride)) t.xq = c->xq;
    if (threaded(c) && n_rows < MIN_PAR_ROWS &&
        td_items_begin(&c->mm_items, c->tp, t.n_tiles, &t.epoch) == TD_OK)
        td_threadpool_run_detached(c->tp, task_matmul_detached, &t, sizeof t);
    else
        dispatch(c, task_matmul, &t, threaded(c));
}

static void cpu_matmul(td_backend *be, int n_w, const td_weight *const *w, td_bview x, size_t ldx,
                       const td_bview *y, const size_t *ldy, int32_t n_rows) {
    float *yp[TD_BACKEND_MAX_MM];
    TD_ASSERT(n_w >= 1 && n_w <= TD_BACKEND_MAX_MM);
    for (int i = 0; i < n_w; i++) yp[i] = F32(y[i]);
    matmul_host(ctx_of(be), n_w, w, F32(x), ldx, yp, ldy, n_rows);
}

/* Bias, RoPE and the KV write of each row. */
typedef struct {
    cpu_ctx *c;
    float *q, *k, *v;
    const float *bq, *bk, *bv;
    const td_backend_rope *rope;
    char *kc, *vc; /* this layer's cache regions */
    td_dtype kv_dtype;
    int bs;
} qkv_task;

static void task_qkv(void *ctx, int ith, int nth) {
    const qkv_task *t = ctx;
    cpu_ctx *c = t->c;
    const td_backend_rope *rp = t->rope;
    const int bs = t->bs, q_dim = rp->n_heads * rp->head_dim,
              kv_dim = rp->n_kv_heads * rp->head_dim;
    (void)ith;
    (void)nth;
    int64_t r0, r1;
    while (claim(c, c->b.n_rows, ROW_CHUNK, &r0, &r1))
        for (int64_t r = r0; r < r1; r++) {
            float *q = t->q + (size_t)r * (size_t)q_dim;
            float *k = t->k + (size_t)r * (size_t)kv_dim;
            float *v = t->v + (size_t)r * (size_t)kv_dim;
            if (t->bq) td_cpu_add(q, t->bq, q, q_dim);
            if (t->bk) td_cpu_add(k, t->bk, k, kv_dim);
            if (t->bv) td_cpu_add(v, t->bv, v, kv_dim);
            int32_t pos = c->b.row_pos[r];
            td_cpu_rope(q, rp->n_heads, rp->head_dim, rp->n_rot, pos, rp->inv_freq, rp->mode);
            td_cpu_rope(k, rp->n_kv_heads, rp->head_dim, rp->n_rot, pos, rp->inv_freq, rp->mode);
            if (c->b.cp_n > 1 && (pos / bs) % c->b.cp_n != c->b.cp_r) continue; /* CP: not ours */
            const int32_t *table = c->b.seq_table[c->b.row_seq[r]];
            size_t cell = (size_t)table[pos / bs] * (size_t)bs + (size_t)(pos % bs);
            const size_t at = cell * (size_t)kv_dim * td_kv_elem_bytes((uint32_t)t->kv_dtype);
            td_cpu_kv_store(t->kv_dtype, k, t->kc + at, kv_dim);
            td_cpu_kv_store(t->kv_dtype, v, t->vc + at, kv_dim);
        }
}

static void cpu_rope_store(td_backend *be, td_bview q, td_bview k, td_bview v, const float *bq,
                           const float *bk, const float *bv, const td_backend_rope *rope,
                           const td_backend_kv *kv) {
    cpu_ctx *c = ctx_of(be);
    qkv_task t = {.c = c,
                  .q = F32(q),
                  .k = F32(k),
                  .v = F32(v),
                  .bq = bq,
                  .bk = bk,
                  .bv = bv,
                  .rope = rope,
                  .kc = td_bview_host(kv->k),
                  .vc = td_bview_host(kv->v),
                  .kv_dtype = kv->dtype,
                  .bs = kv->block_size};
    run(c, task_qkv, &t, c->b.n_rows);
}

static td_cpu_kv_layer kv_layer(const td_backend_kv *kv) {
    return (td_cpu_kv_layer){.k = td_bview_host(kv->k),
                             .v = td_bview_host(kv->v),
                             .dtype = kv->dtype,
                             .block_size = kv->block_size,
                             .n_kv_heads = kv->n_kv_heads,
                             .head_dim = kv->head_dim};
}

/* Attention per (run of rows, KV head, up to ATTN_GROUP of its query heads)
 * item, claimed one at a time (items differ in cost with the context
 * length). An item's rows are the rows_per_item rows from its first; the
 * rows of one sequence among them go to the multi-query kernel together,
 * which reads each K/V row once for all their heads and gives each query
 * the bits of a call of its own: no value depends on the grouping. */
typedef struct {
    cpu_ctx *c;
    td_cpu_kv_layer kvl;
    const float *q;
    float *att;
    int nh;
    int rows_per_item;
    float scale;
} attn_task;

static void task_attn(void *ctx, int ith, int nth) {
    (void)nth;
    const attn_task *t = ctx;
    cpu_ctx *c = t->c;
    float *scratch = c->attn_scratch + (size_t)ith * ATTN_GROUP * (size_t)c->max_ctx;
    const int nh = t->nh, hd = t->kvl.head_dim, group = nh / t->kvl.n_kv_heads;
    const int sub = TD_MIN(group, ATTN_GROUP), n_sub = (group + sub - 1) / sub;
    const int per_run = t->kvl.n_kv_heads * n_sub, rpi = t->rows_per_item;
    const int64_t n_runs = ((int64_t)c->b.n_rows + rpi - 1) / rpi;
    const size_t q_dim = (size_t)nh * (size_t)hd;
    td_cpu_attn_query qs[ATTN_GROUP];
    int64_t i0, i1;
    while (claim(c, n_runs * per_run, 1, &i0, &i1)) {
        int32_t r = (int32_t)(i0 / per_run) * rpi, r_end = TD_MIN(c->b.n_rows, r + rpi);
        int kvh = (int)(i0 % per_run) / n_sub, h0 = kvh * group + (int)(i0 % n_sub) * sub;
        int nq = TD_MIN(sub, (kvh + 1) * group - h0);
        while (r < r_end) {
            const int32_t seq = c->b.row_seq[r];
            int n = 0;
            for (; r < r_end && c->b.row_seq[r] == seq; r++) {
                int n_ctx = c->b.row_pos[r] + 1; /* causal: positions [0, pos] */
                for (int i = 0; i < nq; i++) {
                    size_t off = (size_t)r * q_dim + (size_t)(h0 + i) * (size_t)hd;
                    qs[n++] =
                        (td_cpu_attn_query){.q = t->q + off, .out = t->att + off, .n_ctx = n_ctx};
                }
            }
            td_cpu_attn_paged_multi(qs, n, &t->kvl, kvh, c->b.seq_table[seq], t->scale, scratch);
        }
    }
}

static void cpu_attn(td_backend *be, td_bview q, td_bview att, const td_backend_kv *kv, int nh,
                     float scale, int64_t cost) {
    cpu_ctx *c = ctx_of(be);
    const int group = nh / kv->n_kv_heads;
    /* rows grouped when there are enough of them to keep every thread busy */
    int rpi = TD_MAX(1, TD_MIN(c->b.n_rows / 16, ATTN_GROUP / TD_MIN(group, ATTN_GROUP)));
    attn_task t = {.c = c,
                   .kvl = kv_layer(kv),
                   .q = F32(q),
                   .att = F32(att),
                   .nh = nh,
                   .rows_per_item = TD_MIN(rpi, ATTN_ROWS),
                   .scale = scale};
    /* attention cost grows with context: worth threads even for one row */
    dispatch(c, task_attn, &t, threaded(c) && cost * nh >= 1024);
}

/* g = silu(g) * u over n_rows rows of width n. */
typedef struct {
    cpu_ctx *c;
    float *g;
    const float *u;
    int32_t n_rows;
    int n;
} swiglu_task;

static void task_swiglu(void *ctx, int ith, int nth) {
    const swiglu_task *t = ctx;
    (void)ith;
    (void)nth;
    int64_t r0, r1;
    while (claim(t->c, t->n_rows, ROW_CHUNK, &r0, &r1))
        for (int64_t r = r0; r < r1; r++) {
            float *g = t->g + (size_t)r * (size_t)t->n;
            td_cpu_swiglu(g, t->u + (size_t)r * (size_t)t->n, g, t->n);
        }
}

static void swiglu_host(cpu_ctx *c, float *g, const float *u, int32_t n_rows, int n) {
    swiglu_task t = {.c = c, .g = g, .u = u, .n_rows = n_rows, .n = n};
    run(c, task_swiglu, &t, n_rows);
}

static void cpu_swiglu(td_backend *be, td_bview g, td_bview u, int32_t n_rows, int n) {
    swiglu_host(ctx_of(be), F32(g), F32(u), n_rows, n);
}

/* ------------------------------------------------------------------- MoE */

/* Routing of each row: softmax over the router logits, the K most probable
 * experts (a strict > comparison over ascending ids, so ties go to the lower
 * id), renormalised when norm_topk. Per row, so batch-invariant. */
typedef struct {
    cpu_ctx *c;
    float *rl;
    int32_t *sel_id;
    float *sel_w;
    int32_t r0, n_rows; /* rows [r0, r0 + n_rows) */
    int NE, K;
    bool norm_topk;
} route_task;

static void task_route(void *ctx, int ith, int nth) {
    const route_task *t = ctx;
    (void)ith;
    (void)nth;
    const int NE = t->NE, K = t->K;
    int64_t i0, i1;
    while (claim(t->c, t->n_rows, ROW_CHUNK, &i0, &i1))
        for (int64_t r = t->r0 + i0; r < t->r0 + i1; r++) {
            float *p = t->rl + (size_t)r * (size_t)NE; /* logits -> probabilities in place */
            float mx = p[0], sum = 0.0f;
            for (int x = 1; x < NE; x++) mx = p[x] > mx ? p[x] : mx;
            for (int x = 0; x < NE; x++) {
                p[x] = expf(p[x] - mx);
                sum += p[x];
            }
            for (int x = 0; x < NE; x++) p[x] /= sum;
            int32_t *id = t->sel_id + (size_t)r * (size_t)K;
            float *w = t->sel_w + (size_t)r * (size_t)K;
            int n = 0;
            for (int x = 0; x < NE; x++) {
                int j = n < K ? n++ : K;
                if (j == K && !(p[x] > w[K - 1])) continue;
                if (j == K) j = K - 1;
                while (j > 0 && p[x] > w[j - 1]) {
                    w[j] = w[j - 1];
                    id[j] = id[j - 1];
                    j--;
                }
                w[j] = p[x];
                id[j] = x;
            }
            if (t->norm_topk) {
                float s = 0.0f;
                for (int j = 0; j < K; j++) s += w[j];
                for (int j = 0; j < K; j++) w[j] /= s;
            }
        }
}

static void cpu_moe_route(td_backend *be, td_bview rl, td_bview sel_id, td_bview sel_w, int32_t r0,
                          int32_t n_rows, int n_expert, int k, bool norm_topk) {
    cpu_ctx *c = ctx_of(be);
    route_task t = {.c = c,
                    .rl = F32(rl),
                    .sel_id = I32(sel_id),
                    .sel_w = F32(sel_w),
                    .r0 = r0,
                    .n_rows = n_rows,
                    .NE = n_expert,
                    .K = k,
                    .norm_topk = norm_topk};
    run(c, task_route, &t, n_rows);
}

/* Groups the choices of rows [r0, r1) by expert (a counting sort over the
 * rows in order): off (n_expert + 1) first slot of each expert, sel_slot
 * the slot of each choice, slot_row the row of each slot, counts (n_expert
 * int32) the choices per expert. */
static void cpu_moe_group(td_backend *be, td_bview sel_idv, td_bview sel_slotv, td_bview slot_rowv,
                          td_bview offv, td_bview countsv, int32_t r0, int32_t r1, int n_expert,
                          int k) {
    (void)be;
    const int NE = n_expert, K = k;
    const int32_t *sel_id = I32(sel_idv);
    int32_t *sel_slot = I32(sel_slotv), *slot_row = I32(slot_rowv), *off = I32(offv);
    int32_t *counts = I32(countsv);
    memset(off, 0, ((size_t)NE + 1) * sizeof *off);
    for (size_t i = (size_t)r0 * (size_t)K; i < (size_t)r1 * (size_t)K; i++) off[sel_id[i] + 1]++;
    for (int x = 0; x < NE; x++) counts[x] = off[x + 1];
    for (int x = 0; x < NE; x++) off[x + 1] += off[x];
    for (int32_t r = r0; r < r1; r++)
        for (int j = 0; j < K; j++) {
            size_t i = (size_t)r * (size_t)K + (size_t)j;
            int32_t slot = off[sel_id[i]]++;
            sel_slot[i] = slot;
            slot_row[slot] = r;
        }
    for (int x = NE; x > 0; x--) off[x] = off[x - 1]; /* back to first slots */
    off[0] = 0;
}

/* xg[slot] = xn[slot_row[slot]] */
typedef struct {
    cpu_ctx *c;
    float *xg;
    const float *xn;
    const int32_t *slot_row;
    int32_t n_slots;
    size_t E;
} gather_task;

static void task_gather(void *ctx, int ith, int nth) {
    const gather_task *t = ctx;
    (void)ith;
    (void)nth;
    const size_t E = t->E;
    int64_t s0, s1;
    while (claim(t->c, t->n_slots, ROW_CHUNK, &s0, &s1))
        for (int64_t s = s0; s < s1; s++)
            memcpy(t->xg + (size_t)s * E, t->xn + (size_t)t->slot_row[s] * E, E * sizeof(float));
}

static void cpu_moe_gather(td_backend *be, td_bview xg, td_bview xn, td_bview slot_row,
                           int32_t n_slots, int n_embd) {
    cpu_ctx *c = ctx_of(be);
    gather_task t = {.c = c,
                     .xg = F32(xg),
                     .xn = F32(xn),
                     .slot_row = I32(slot_row),
                     .n_slots = n_slots,
                     .E = (size_t)n_embd};
    run(c, task_gather, &t, n_slots);
}

/* Each local expert's gate and up over its slots, SwiGLU over every slot,
 * then each expert's down: each expert's matrices are streamed once over
 * all of its tokens. */
static void cpu_moe_experts(td_backend *be, const td_backend_experts *x) {
    cpu_ctx *c = ctx_of(be);
    const size_t E = (size_t)x->n_embd, F = (size_t)x->n_ff;
    const int32_t *off = I32(x->off);
    float *xg = F32(x->xg), *gg = F32(x->gg), *ug = F32(x->ug), *yg = F32(x->yg);
    for (int32_t i = 0; i < x->n; i++) {
        const td_expert_weights *ex = &x->experts[i];
        int32_t s0 = off[ex->id - x->id_base], n = off[ex->id - x->id_base + 1] - s0;
        if (n == 0) continue;
        const td_weight *wgu[] = {&ex->gate, &ex->up};
        float *ygu[] = {gg + (size_t)s0 * F, ug + (size_t)s0 * F};
        size_t ldgu[] = {F, F};
        matmul_host(c, 2, wgu, xg + (size_t)s0 * E, E, ygu, ldgu, n);
    }
    if (x->n > 0) { /* the slots of the experts, first to last */
        int32_t s0 = off[x->experts[0].id - x->id_base];
        int32_t s1 = off[x->experts[x->n - 1].id - x->id_base + 1];
        TD_ASSERT(s0 >= 0 && s0 <= s1 && s1 <= x->n_slots);
        swiglu_host(c, gg + (size_t)s0 * F, ug + (size_t)s0 * F, s1 - s0, (int)F);
    }
    for (int32_t i = 0; i < x->n; i++) {
        const td_expert_weights *ex = &x->experts[i];
        int32_t s0 = off[ex->id - x->id_base], n = off[ex->id - x->id_base + 1] - s0;
        if (n == 0) continue;
        const td_weight *wd[] = {&ex->down};
        float *yd[] = {yg + (size_t)s0 * E};
        size_t ldd[] = {E};
        matmul_host(c, 1, wd, gg + (size_t)s0 * F, F, yd, ldd, n);
    }
}

/* o[r] = (shared ? sigmoid(shexp_inp . xn[r]) * o[r] : 0) + sum_j w_j yg[slot_j],
 * the sum in the row's selection order. */
typedef struct {
    cpu_ctx *c;
    float *o;
    const float *xn, *sel_w, *yg;
    const int32_t *sel_slot;
    const float *shexp_inp; /* NULL: no shared-expert gate */
    bool shared;            /* o holds the shared expert's output */
    int32_t r0, r1;         /* rows with routed outputs; the others get none */
    bool shared_outside;    /* rows outside [r0, r1) keep their shared part, else are zeroed */
    int32_t n_rows;
    size_t E;
    int K;
} combine_task;

static void task_combine(void *ctx, int ith, int nth) {
    const combine_task *t = ctx;
    (void)ith;
    (void)nth;
    const size_t E = t->E;
    const int K = t->K;
    int64_t r0, r1;
    while (claim(t->c, t->n_rows, ROW_CHUNK, &r0, &r1))
        for (int64_t r = r0; r < r1; r++) {
            float *o = t->o + (size_t)r * E;
            bool routed = r >= t->r0 && r < t->r1;
            if (t->shared && (routed || t->shared_outside)) {
                float gs = 1.0f;
                if (t->shexp_inp) {
                    const float *xn = t->xn + (size_t)r * E;
                    float d = 0.0f;
                    for (size_t i = 0; i < E; i++) d += t->shexp_inp[i] * xn[i];
                    gs = 1.0f / (1.0f + expf(-d));
                }
                for (size_t i = 0; i < E; i++) o[i] *= gs;
            } else {
                memset(o, 0, E * sizeof(float));
            }
            for (int j = 0; routed && j < K; j++) {
                float w = t->sel_w[(size_t)r * (size_t)K + (size_t)j];
                const float *y = t->yg + (size_t)t->sel_slot[(size_t)r * (size_t)K + (size_t)j] * E;
                for (size_t i = 0; i < E; i++) o[i] += w * y[i];
            }
        }
}

static void cpu_moe_combine(td_backend *be, td_bview o, td_bview xn, td_bview sel_w,
                            td_bview sel_slot, td_bview yg, const float *shexp_inp, bool shared,
                            int32_t r0, int32_t r1, bool shared_outside, int32_t n_rows, int n_embd,
                            int k) {
    cpu_ctx *c = ctx_of(be);
    combine_task t = {.c = c,
                      .o = F32(o),
                      .xn = F32(xn),
                      .sel_w = F32(sel_w),
                      .yg = F32(yg),
                      .sel_slot = I32(sel_slot),
                      .shexp_inp = shexp_inp,
                      .shared = shared,
                      .r0 = r0,
                      .r1 = r1,
                      .shared_outside = shared_outside,
                      .n_rows = n_rows,
                      .E = (size_t)n_embd,
                      .K = k};
    run(c, task_combine, &t, n_rows);
}

/* Expert parallelism: group g of this rank's slots (its experts' rows,
 * off[g * group] up to off[(g + 1) * group]) to or from the block of cap
 * rows at g * cap. */
static void cpu_moe_ep_pack(td_backend *be, td_bview blocks, td_bview slots, td_bview offv,
                            int n_groups, int group, int32_t cap, int n_embd, bool to_blocks) {
    (void)be;
    const size_t row = (size_t)n_embd * sizeof(float);
    const int32_t *off = I32(offv);
    char *b = td_bview_host(blocks), *s = td_bview_host(slots);
    for (int g = 0; g < n_groups; g++) {
        int32_t s0 = off[g * group], n = off[(g + 1) * group] - s0;
        TD_ASSERT(n >= 0 && n <= cap);
        char *bp = b + (size_t)g * (size_t)cap * row, *sp = s + (size_t)s0 * row;
        if (n == 0) continue;
        if (to_blocks)
            memcpy(bp, sp, (size_t)n * row);
        else
            memcpy(sp, bp, (size_t)n * row);
    }
}

/* Whether sender j's counts fit its block (they do unless the ranks were
 * given different batches). */
static bool ep_sender_fits(const td_backend_ep *p, const int32_t *cs, int j) {
    int64_t n = 0;
    for (int i = 0; i < p->n_local; i++) {
        if (cs[i] < 0) return false;
        n += cs[i];
    }
    return n <= p->cap[j];
}

/* Sender j's block holds its rows for local expert 0, then 1, ...; the
 * slots hold local expert 0's rows of sender 0, 1, ..., then expert 1's.
 * A sender whose counts do not fit sends nothing here, and err says so
 * (the step reports it at its end). */
static void cpu_moe_ep_permute(td_backend *be, const td_backend_ep *p, bool to_slots) {
    (void)be;
    const int P = p->n_senders, NL = p->n_local;
    const size_t row = (size_t)p->n_embd * sizeof(float);
    const int32_t *cnt = I32(p->counts);
    int32_t *off = I32(p->off), *err = I32(p->err);
    char *b = td_bview_host(p->blocks), *s = td_bview_host(p->slots);
    int32_t slot = 0;
    for (int i = 0; i < NL; i++) {
        if (to_slots) off[i] = slot;
        size_t blk = 0;
        for (int j = 0; j < P; j++) {
            const int32_t *cs = cnt + (size_t)j * (size_t)p->n_expert + p->exp0;
            if (ep_sender_fits(p, cs, j)) {
                size_t at = blk;
                for (int k = 0; k < i; k++) at += (size_t)cs[k];
                size_t n = (size_t)cs[i];
                char *bp = b + at * row, *sp = s + (size_t)slot * row;
                if (n && to_slots)
                    memcpy(sp, bp, n * row);
                else if (n)
                    memcpy(bp, sp, n * row);
                slot += (int32_t)n;
            } else if (to_slots) {
                *err = 1;
            }
            blk += (size_t)p->cap[j];
        }
    }
    if (to_slots) off[NL] = slot;
}

static void cpu_count_sum(td_backend *be, td_bview dstv, td_bview srcv, int n_src, int n) {
    (void)be;
    int32_t *dst = I32(dstv);
    const int32_t *src = I32(srcv);
    for (int x = 0; x < n; x++) {
        int32_t v = 0;
        for (int k = 0; k < n_src; k++) v += src[(size_t)k * (size_t)n + (size_t)x];
        dst[x] = v;
    }
}

/* ---------------------------------------------------- context parallelism */

typedef struct {
    cpu_ctx *c;
    const td_backend_cp_attn *a;
    td_cpu_kv_layer kvl;
} cp_attn_task;

static void task_cp_attn(void *ctx, int ith, int nth) {
    (void)nth;
    const cp_attn_task *t = ctx;
    const td_backend_cp_attn *a = t->a;
    cpu_ctx *c = t->c;
    const td_backend_batch *bt = &c->b;
    float *scratch = c->attn_scratch + (size_t)ith * ATTN_GROUP * (size_t)c->max_ctx;
    const int nh = a->nh, hd = a->head_dim, group = a->nh / a->nkv, C = bt->cp_n;
    const size_t slot = (size_t)hd + 2, q_dim = (size_t)nh * (size_t)hd;
    float *qb = F32(a->q), *att = F32(a->att);
    float *cp_part = a->part.b ? F32(a->part) : NULL, *cp_ms = a->ms.b ? F32(a->ms) : NULL;
    int64_t i0, i1;
    while (claim(c, (int64_t)a->n_items * nh, 1, &i0, &i1)) {
        int32_t item = (int32_t)(i0 / nh);
        int h = (int)(i0 % nh);
        bool dcp = a->kind == TD_CP_ATTN_DCP_PART || a->kind == TD_CP_ATTN_DCP_MERGE;
        int32_t r = dcp ? bt->cp_dcp_row[item] : a->row0 + item;
        int32_t seq = bt->row_seq[r];
        int n_ctx = bt->row_pos[r] + 1; /* causal: positions [0, pos] */
        size_t off = (size_t)r * q_dim + (size_t)h * (size_t)hd;
        const float *q = qb + off;
        const int32_t *ltab = bt->cp_ltab + (size_t)seq * (size_t)bt->cp_maxb;
        float *ms = cp_ms ? cp_ms + ((size_t)r * (size_t)nh + (size_t)h) * 2 : NULL;
        td_cpu_attn_part part;
        switch (a->kind) {
        case TD_CP_ATTN_DCP_PART: {
            float *sl =
                cp_part +
                (((size_t)bt->cp_r * (size_t)bt->n_dcp + (size_t)item) * (size_t)nh + (size_t)h) *
                    slot;
            part.out = sl;
            td_cpu_attn_partial(q, &t->kvl, h / group, ltab, n_ctx, C, bt->cp_r, a->scale, &part,
                                scratch);
            sl[hd] = part.m;
            sl[hd + 1] = part.s;
            break;
        }
        case TD_CP_ATTN_DCP_MERGE: {
            td_cpu_attn_part parts[TD_BACKEND_MAX_CP_RANKS];
            for (int k = 0; k < C; k++) {
                float *sl = cp_part + (((size_t)k * (size_t)bt->n_dcp + (size_t)item) * (size_t)nh +
                                       (size_t)h) *
                                          slot;
                parts[k] = (td_cpu_attn_part){.out = sl, .m = sl[hd], .s = sl[hd + 1]};
            }
            td_cpu_attn_merge(parts, C, hd, att + off, NULL);
            break;
        }
        case TD_CP_ATTN_PCP_FULL:
            td_cpu_attn_paged(q, &t->kvl, h / group, a->table, n_ctx, a->scale, att + off, scratch);
            break;
        case TD_CP_ATTN_PCP_OWN:
            part.out = att + off;
            td_cpu_attn_partial(q, &t->kvl, h / group, ltab, n_ctx, C, bt->cp_r, a->scale, &part,
                                scratch);
            ms[0] = part.m;
            ms[1] = part.s;
            break;
        case TD_CP_ATTN_PCP_MERGE: {
            td_cpu_attn_part parts[2] = {{.out = att + off, .m = ms[0], .s = ms[1]},
                                         {.out = c->cp_tmp + (size_t)ith * (size_t)hd}};
            td_cpu_attn_partial(q, &t->kvl, h / group, a->table, n_ctx, C, a->offset, a->scale,
                                &parts[1], scratch);
            td_cpu_attn_part merged;
            td_cpu_attn_merge(parts, 2, hd, att + off, &merged);
            ms[0] = merged.m;
            ms[1] = merged.s;
            break;
        }
        }
    }
}

static void cpu_attn_cp(td_backend *be, const td_backend_cp_attn *a) {
    cpu_ctx *c = ctx_of(be);
    cp_attn_task t = {.c = c, .a = a, .kvl = kv_layer(&a->kv)};
    if (a->n_items > 0) dispatch(c, task_cp_attn, &t, threaded(c) && a->cost * a->nh >= 1024);
}

/* K and V of the blocks of [0, end) this rank holds, as n_held K blocks
 * then n_held V blocks from dst and dst + stride_blocks blocks. */
static void cpu_kv_pack(td_backend *be, const td_backend_kv *kv, int32_t seq, int32_t end,
                        td_bview dstv, int32_t stride_blocks) {
    const td_backend_batch *bt = &ctx_of(be)->b;
    const size_t blk = (size_t)kv->block_size * (size_t)kv->n_kv_heads * (size_t)kv->head_dim *
                       td_kv_elem_bytes((uint32_t)kv->dtype); /* bytes */
    const int32_t *lt = bt->cp_ltab + (size_t)seq * (size_t)bt->cp_maxb;
    const char *kc = td_bview_host(kv->k), *vc = td_bview_host(kv->v);
    char *dst = td_bview_host(dstv);
    for (int32_t j = bt->cp_r, x = 0; (int64_t)j * kv->block_size < end; j += bt->cp_n, x++) {
        memcpy(dst + (size_t)x * blk, kc + (size_t)lt[x] * blk, blk);
        memcpy(dst + ((size_t)stride_blocks + (size_t)x) * blk, vc + (size_t)lt[x] * blk, blk);
    }
}

/* ------------------------------------------------ vocab-parallel head */

typedef struct {
    cpu_ctx *c;
    float *logits;
    const float *head_buf;
    int32_t n_rows;
    size_t W, V;
    int vocab_tp;
} head_place_task;

static void task_head_place(void *ctx, int ith, int nth) {
    const head_place_task *t = ctx;
    (void)ith;
    (void)nth;
    const size_t W = t->W, V = t->V;
    const size_t blk = (size_t)t->n_rows * W;
    int64_t r0, r1;
    while (claim(t->c, t->n_rows, ROW_CHUNK, &r0, &r1))
        for (int64_t r = r0; r < r1; r++)
            for (int q = 0; q < t->vocab_tp; q++) {
                size_t v0 = (size_t)q * W;
                if (v0 >= V) break;
                memcpy(t->logits + (size_t)r * V + v0,
                       t->head_buf + (size_t)q * blk + (size_t)r * W,
                       TD_MIN(W, V - v0) * sizeof(float));
            }
}

static void cpu_head_place(td_backend *be, td_bview logits, td_bview head_buf, int32_t n_rows,
                           int32_t width, int32_t n_vocab, int vocab_tp) {
    cpu_ctx *c = ctx_of(be);
    head_place_task t = {.c = c,
                         .logits = F32(logits),
                         .head_buf = F32(head_buf),
                         .n_rows = n_rows,
                         .W = (size_t)width,
                         .V = (size_t)n_vocab,
                         .vocab_tp = vocab_tp};
    run(c, task_head_place, &t, n_rows);
}

/* -------------------------------------------------------------- table */

static void cpu_destroy(td_backend *be) {
    cpu_ctx *c = ctx_of(be);
    td_threadpool_quiesce(c->tp);
    td_items_free(&c->mm_items);
    weights_release(c);
    free(c->attn_scratch);
    free(c->cp_tmp);
    free(c->xq);
    free(c->xa);
    free(c);
    free(be);
}

const td_backend_i td_backend_cpu_i = {
    .name = "cpu",
    .destroy = cpu_destroy,
    .supports = cpu_supports,
    .upload_model = cpu_upload_model,
    .upload_weight = cpu_upload_weight,
    .upload_floats = cpu_upload_floats,
    .reserve = cpu_reserve,
    .alloc = cpu_alloc,
    .kv_layout = cpu_kv_layout,
    .kv_alloc = cpu_kv_alloc,
    .free = cpu_free,
    .comm_ptr = cpu_comm_ptr,
    .addr = cpu_comm_ptr,
    .status = cpu_status,
    .comm_begin = cpu_nop,
    .comm_end = cpu_nop,
    .set_batch = cpu_set_batch,
    .copy = cpu_copy,
    .copy_rows = cpu_copy_rows,
    .copy_to_host = cpu_copy_to_host,
    .copy_from_host = cpu_copy_from_host,
    .sync = cpu_nop,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .add = cpu_add,
    .matmul = cpu_matmul,
    .rope_store = cpu_rope_store,
    .attn = cpu_attn,
    .attn_cp = cpu_attn_cp,
    .kv_pack = cpu_kv_pack,
    .swiglu = cpu_swiglu,
    .moe_route = cpu_moe_route,
    .moe_group = cpu_moe_group,
    .moe_gather = cpu_moe_gather,
    .moe_experts = cpu_moe_experts,
    .moe_combine = cpu_moe_combine,
    .moe_ep_pack = cpu_moe_ep_pack,
    .moe_ep_permute = cpu_moe_ep_permute,
    .count_sum = cpu_count_sum,
    .head_place = cpu_head_place,
};

td_status td_backend_cpu_create(td_threadpool *tp, td_backend **be_p) {
    td_backend *be = calloc(1, sizeof *be);
    cpu_ctx *c = calloc(1, sizeof *c);
    if (!be || !c) {
        free(be);
        free(c);
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    c->tp = tp;
    c->nth = tp ? td_threadpool_size(tp) : 1;
    be->i = &td_backend_cpu_i;
    be->ctx = c;
    *be_p = be;
    return TD_OK;
}

_Static_assert(TD_BACKEND_CP_MAX_HEAD_DIM == TD_CPU_ATTN_MERGE_MAX_HEAD_DIM, "CP merge head size");
