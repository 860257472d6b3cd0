/* The checking backend (tests only): the CPU backend's ops on buffers that
 * are mprotect(PROT_NONE) except while one of its own ops (or a comm call
 * between comm_begin and comm_end) runs. Any read or write of backend
 * memory that bypasses the ops table faults at the offending instruction
 * (SIGSEGV, with the stack under a debugger or a sanitizer).
 *
 * Each buffer is its own page-aligned mapping; the buffers are opened and
 * closed together (two mprotect calls per buffer per op: slow, for tests).
 * KV storage (which the transfer layer reads and a peer's puts write) is
 * not protected. A late worker of a detached matmul (backend-cpu.c) may
 * read an op's inputs after the op has returned, its result discarded: the
 * buffers close once the pool has no such worker (td_threadpool_quiesce). */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend-impl.h"

typedef struct ck_buf {
    td_bbuf b; /* first: the view's buffer the CPU ops read */
    size_t map_bytes;
    struct ck_buf *prev, *next;
} ck_buf;

typedef struct {
    td_backend *cpu;
    td_threadpool *tp;
    ck_buf *bufs; /* every buffer; all but KV storage protected when closed */
    int open;     /* nesting depth of open() */
} ck_ctx;

static ck_ctx *ck(td_backend *be) { return be->ctx; }
static td_backend *inner(td_backend *be) { return ck(be)->cpu; }

static void set_prot(ck_ctx *c, int prot) {
    for (ck_buf *b = c->bufs; b; b = b->next)
        if (!b->b.kv && mprotect(b->b.p, b->map_bytes, prot) != 0) {
            TD_LOG_ERROR("checking backend: mprotect failed");
            abort();
        }
}

static void open_bufs(td_backend *be) {
    ck_ctx *c = ck(be);
    if (c->open++ == 0) set_prot(c, PROT_READ | PROT_WRITE);
}

static void close_bufs(td_backend *be) {
    ck_ctx *c = ck(be);
    TD_ASSERT(c->open > 0);
    if (--c->open == 0) {
        td_threadpool_quiesce(c->tp);
        set_prot(c, PROT_NONE);
    }
}

static td_bbuf *ck_link(ck_ctx *c, ck_buf *b) {
    b->next = c->bufs;
    if (c->bufs) c->bufs->prev = b;
    c->bufs = b;
    return &b->b;
}

static td_bbuf *ck_alloc(td_backend *be, size_t bytes) {
    size_t pg = (size_t)sysconf(_SC_PAGESIZE), n = ((bytes ? bytes : 1) + pg - 1) / pg * pg;
    ck_buf *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    /* a fresh anonymous mapping is zero-filled, as alloc promises */
    void *p = mmap(NULL, n, ck(be)->open ? PROT_READ | PROT_WRITE : PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        free(b);
        return NULL;
    }
    b->b = (td_bbuf){.p = p, .bytes = bytes};
    b->map_bytes = n;
    return ck_link(ck(be), b);
}

static td_status ck_kv_layout(td_backend *be, const td_kv_params *p, td_kv_layout *l) {
    return inner(be)->i->kv_layout(inner(be), p, l);
}

static td_bbuf *ck_kv_alloc(td_backend *be, const td_kv_layout *l, const td_kv_mem_hook *hook) {
    ck_buf *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    if (td_host_kv_alloc(&b->b, l, hook)) {
        free(b);
        return NULL;
    }
    return ck_link(ck(be), b);
}

static void ck_free(td_backend *be, td_bbuf *bb) {
    ck_ctx *c = ck(be);
    ck_buf *b = (ck_buf *)bb;
    if (b->prev)
        b->prev->next = b->next;
    else
        c->bufs = b->next;
    if (b->next) b->next->prev = b->prev;
    if (b->b.kv)
        td_host_kv_free(&b->b);
    else
        munmap(b->b.p, b->map_bytes);
    free(b);
}

static void ck_destroy(td_backend *be) {
    ck_ctx *c = ck(be);
    while (c->bufs) ck_free(be, &c->bufs->b);
    td_backend_destroy(c->cpu);
    free(c);
    free(be);
}

static bool ck_supports(td_backend *be, td_op op, td_dtype type) {
    return inner(be)->i->supports(inner(be), op, type);
}
static td_status ck_upload_model(td_backend *be, const td_model *m) {
    return inner(be)->i->upload_model(inner(be), m);
}
static td_status ck_upload_weight(td_backend *be, const td_weight *w) {
    return inner(be)->i->upload_weight(inner(be), w);
}
static td_status ck_upload_floats(td_backend *be, const float *p, size_t n) {
    return inner(be)->i->upload_floats(inner(be), p, n);
}
static td_status ck_reserve(td_backend *be, int32_t max_ctx, int head_dim) {
    return inner(be)->i->reserve(inner(be), max_ctx, head_dim);
}
static void *ck_comm_ptr(td_backend *be, td_bview v) {
    (void)be;
    return td_bview_host(v);
}
static td_status ck_status(td_backend *be) { return inner(be)->i->status(inner(be)); }
static void ck_set_batch(td_backend *be, const td_backend_batch *b) {
    inner(be)->i->set_batch(inner(be), b);
}

/* Every op: open the buffers, run the CPU op, close them. */
#define CK_OP(name, params, args)                                                                  \
    static void ck_##name params {                                                                 \
        open_bufs(be);                                                                             \
        td_backend *in = inner(be);                                                                \
        in->i->name args;                                                                          \
        close_bufs(be);                                                                            \
    }

CK_OP(copy, (td_backend * be, td_bview dst, td_bview src, size_t bytes), (in, dst, src, bytes))
CK_OP(copy_rows,
      (td_backend * be, td_bview dst, td_bview src, const int32_t *rows, int32_t n, size_t rb),
      (in, dst, src, rows, n, rb))
CK_OP(copy_to_host, (td_backend * be, void *dst, td_bview src, size_t bytes), (in, dst, src, bytes))
CK_OP(copy_from_host, (td_backend * be, td_bview dst, const void *src, size_t bytes),
      (in, dst, src, bytes))
CK_OP(sync, (td_backend * be), (in))
CK_OP(embed, (td_backend * be, const td_weight *w, int32_t v0, int32_t v1, td_bview x),
      (in, w, v0, v1, x))
CK_OP(rmsnorm,
      (td_backend * be, td_bview x, td_bview add, td_bview xn, int32_t n_rows, bool logit_rows,
       const float *w, int n, float eps),
      (in, x, add, xn, n_rows, logit_rows, w, n, eps))
CK_OP(add, (td_backend * be, td_bview x, td_bview y, int32_t n_rows, int n), (in, x, y, n_rows, n))
CK_OP(matmul,
      (td_backend * be, int n_w, const td_weight *const *w, td_bview x, size_t ldx,
       const td_bview *y, const size_t *ldy, int32_t n_rows),
      (in, n_w, w, x, ldx, y, ldy, n_rows))
CK_OP(rope_store,
      (td_backend * be, td_bview q, td_bview k, td_bview v, const float *bq, const float *bk,
       const float *bv, const td_backend_rope *rope, const td_backend_kv *kv),
      (in, q, k, v, bq, bk, bv, rope, kv))
CK_OP(attn,
      (td_backend * be, td_bview q, td_bview att, const td_backend_kv *kv, int nh, float scale,
       int64_t cost),
      (in, q, att, kv, nh, scale, cost))
CK_OP(attn_cp, (td_backend * be, const td_backend_cp_attn *a), (in, a))
CK_OP(kv_pack,
      (td_backend * be, const td_backend_kv *kv, int32_t seq, int32_t end, td_bview dst,
       int32_t stride),
      (in, kv, seq, end, dst, stride))
CK_OP(swiglu, (td_backend * be, td_bview g, td_bview u, int32_t n_rows, int n),
      (in, g, u, n_rows, n))
CK_OP(moe_route,
      (td_backend * be, td_bview rl, td_bview id, td_bview w, int32_t r0, int32_t n, int ne, int k,
       bool norm),
      (in, rl, id, w, r0, n, ne, k, norm))
CK_OP(moe_group,
      (td_backend * be, td_bview id, td_bview slot, td_bview row, td_bview off, td_bview counts,
       int32_t r0, int32_t r1, int ne, int k),
      (in, id, slot, row, off, counts, r0, r1, ne, k))
CK_OP(moe_gather, (td_backend * be, td_bview xg, td_bview xn, td_bview row, int32_t n, int e),
      (in, xg, xn, row, n, e))
CK_OP(moe_experts, (td_backend * be, const td_backend_experts *x), (in, x))
CK_OP(moe_combine,
      (td_backend * be, td_bview o, td_bview xn, td_bview w, td_bview slot, td_bview yg,
       const float *shexp_inp, bool shared, int32_t r0, int32_t r1, bool outside, int32_t n, int e,
       int k),
      (in, o, xn, w, slot, yg, shexp_inp, shared, r0, r1, outside, n, e, k))
CK_OP(moe_ep_pack,
      (td_backend * be, td_bview blocks, td_bview slots, td_bview off, int ng, int g, int32_t cap,
       int e, bool to_blocks),
      (in, blocks, slots, off, ng, g, cap, e, to_blocks))
CK_OP(moe_ep_permute, (td_backend * be, const td_backend_ep *p, bool to_slots), (in, p, to_slots))
CK_OP(count_sum, (td_backend * be, td_bview dst, td_bview src, int n_src, int n),
      (in, dst, src, n_src, n))
CK_OP(head_place,
      (td_backend * be, td_bview logits, td_bview buf, int32_t n, int32_t w, int32_t v, int tp),
      (in, logits, buf, n, w, v, tp))

static const td_backend_i ck_i = {
    .name = "cpu-check",
    .destroy = ck_destroy,
    .supports = ck_supports,
    .upload_model = ck_upload_model,
    .upload_weight = ck_upload_weight,
    .upload_floats = ck_upload_floats,
    .reserve = ck_reserve,
    .alloc = ck_alloc,
    .kv_layout = ck_kv_layout,
    .kv_alloc = ck_kv_alloc,
    .free = ck_free,
    .comm_ptr = ck_comm_ptr,
    .addr = ck_comm_ptr,
    .status = ck_status,
    .comm_begin = open_bufs,
    .comm_end = close_bufs,
    .set_batch = ck_set_batch,
    .copy = ck_copy,
    .copy_rows = ck_copy_rows,
    .copy_to_host = ck_copy_to_host,
    .copy_from_host = ck_copy_from_host,
    .sync = ck_sync,
    .embed = ck_embed,
    .rmsnorm = ck_rmsnorm,
    .add = ck_add,
    .matmul = ck_matmul,
    .rope_store = ck_rope_store,
    .attn = ck_attn,
    .attn_cp = ck_attn_cp,
    .kv_pack = ck_kv_pack,
    .swiglu = ck_swiglu,
    .moe_route = ck_moe_route,
    .moe_group = ck_moe_group,
    .moe_gather = ck_moe_gather,
    .moe_experts = ck_moe_experts,
    .moe_combine = ck_moe_combine,
    .moe_ep_pack = ck_moe_ep_pack,
    .moe_ep_permute = ck_moe_ep_permute,
    .count_sum = ck_count_sum,
    .head_place = ck_head_place,
};

td_status td_backend_check_create(td_threadpool *tp, td_backend **be_p) {
    td_backend *be = calloc(1, sizeof *be);
    ck_ctx *c = calloc(1, sizeof *c);
    td_status st = TD_ERR_NOMEM;
    if (!be || !c || (st = td_backend_cpu_create(tp, &c->cpu))) {
        free(be);
        free(c);
        return st;
    }
    c->tp = tp;
    be->i = &ck_i;
    be->ctx = c;
    *be_p = be;
    return TD_OK;
}
