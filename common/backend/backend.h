/* Compute backend: the one seam between the forward pass and the hardware.
 *
 * A td_backend is a handle with an ops table (td_backend_i) and a context,
 * created once per rank (the model: ggml's ggml_backend_i with its buffer
 * types, not one function per forward pass, which would fork the TP/PP/CP/EP
 * logic per backend). The forward pass (common/engine/forward.c) keeps the
 * layer loop, the parallel plan and the comm calls, and computes only
 * through the table (be->i->op(be, ...)); it never dereferences backend
 * memory.
 *
 * Memory. Buffers are opaque (td_bbuf), allocated through the backend, and
 * addressed as views (buffer + byte offset). Whether a buffer is host
 * visible is the backend's business: what crosses to the host goes through
 * the copy_to_host / copy_from_host ops. Weights stay where the model loader
 * put them and are handed to the backend once (upload_model); ops then name
 * them by their td_weight / const float * of the model, which the backend
 * resolves (the CPU backend reads the mmap in place: zero copy). The KV
 * storage is the backend's too, in a layout it describes (kv_layout), its
 * memory given or registered through the transfer layer's hook
 * (kv_alloc).
 *
 * Batch metadata. Per-row positions, sequences, token ids, block tables and
 * the context-parallel tables are built on the host before a step and handed
 * over once with set_batch; a device backend uploads them there. The few
 * host index arrays an op takes besides (noted at the op) are valid for the
 * call only.
 *
 * Comm. A collective reads and writes backend memory through comm_ptr,
 * between comm_begin and comm_end (the checking backend opens its buffers
 * there; a device backend hands device pointers to a device-aware
 * communicator).
 *
 * Numerics. Every op of the CPU backend computes each output element by a
 * sequence of roundings that does not depend on the rows, batch or thread
 * count (kernels/cpu/cpu.h): the invariance contract of forward.h holds per
 * backend.
 *
 * Thread-safety: one caller (the rank's forward thread) per backend. */
#ifndef TD_BACKEND_H
#define TD_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/base/base.h"
#include "common/base/threadpool.h"
#include "common/kv/kv.h"
#include "common/model/model.h"
#include "kernels/types.h"

typedef struct td_backend td_backend;
typedef struct td_bbuf td_bbuf;

/* A place in a buffer: b at byte offset off. {NULL, 0} is "none". */
typedef struct {
    td_bbuf *b;
    size_t off;
} td_bview;

static inline td_bview td_bview_of(td_bbuf *b) { return (td_bview){b, 0}; }
/* v advanced by n floats. */
static inline td_bview td_bview_f32(td_bview v, size_t n) {
    return (td_bview){v.b, v.off + n * sizeof(float)};
}
static inline td_bview td_bview_bytes(td_bview v, size_t n) { return (td_bview){v.b, v.off + n}; }

typedef enum {
    TD_BACKEND_CPU = 0,
    /* Test only: the CPU backend with its buffers mprotect(PROT_NONE) outside
     * its own op calls, so any access to backend memory that does not go
     * through the ops table faults. */
    TD_BACKEND_CPU_CHECK = 1,
    TD_BACKEND_CUDA = 2, /* an NVIDIA GPU (backend-cuda.c; built where nvcc is) */
} td_backend_kind;

/* The forward pass's ops, for supports(). */
typedef enum {
    TD_OP_EMBED,      /* embedding gather (vocab-parallel slice) */
    TD_OP_RMSNORM,    /* [residual add +] RMSNorm */
    TD_OP_MATMUL,     /* up to TD_BACKEND_MAX_MM weights over one input */
    TD_OP_ROPE_STORE, /* bias, RoPE, store into the paged KV */
    TD_OP_ATTN,       /* paged attention */
    TD_OP_ATTN_CP,    /* partial attention + merge (context parallelism) */
    TD_OP_SWIGLU,     /* silu(g) * u */
    TD_OP_MOE,        /* route, group, gather, experts, combine, the EP blocks */
    TD_OP_HEAD_PLACE, /* vocab-parallel head: gathered slices to logits */
    TD_OP_COPY,       /* device copies, to and from host */
    TD_OP_COUNT,
} td_op;

#define TD_BACKEND_MAX_MM 3
/* Context parallelism merges attention partials of at most this head size. */
#define TD_BACKEND_CP_MAX_HEAD_DIM 1024
/* Most context-parallel ranks whose partials one merge takes. */
#define TD_BACKEND_MAX_CP_RANKS 64

/* Per-step batch metadata (host memory, valid until the next set_batch). */
typedef struct {
    int32_t n_rows;           /* token rows this rank computes */
    const int32_t *row_seq;   /* (n_rows) sequence of each row */
    const int32_t *row_pos;   /* (n_rows) position of each row */
    const int32_t *row_tok;   /* (n_rows) token id of each row */
    const int32_t *logit_src; /* (n_logit) row feeding each logit row */
    int32_t n_seqs;
    const int32_t *const *seq_table; /* (n_seqs) block table of each sequence */
    const int32_t *seq_n_blocks;     /* (n_seqs) entries of each block table */
    /* context parallelism (cp_n > 1), else unused */
    int cp_n, cp_r;
    int32_t cp_maxb;           /* columns of cp_ltab */
    const int32_t *cp_ltab;    /* (n_seqs, cp_maxb) blocks this rank holds, in order */
    const int32_t *cp_dcp_row; /* (n_dcp) rows computed by every CP rank */
    int32_t n_dcp;
} td_backend_batch;

/* One layer of the paged KV: K and V regions of (n_blocks, block_size,
 * n_kv_heads, head_dim) elements of dtype (F32, F16 or BF16) each. */
typedef struct {
    td_bview k, v;
    td_dtype dtype;
    int block_size;
    int n_kv_heads;
    int head_dim;
} td_backend_kv;

typedef struct {
    int n_heads, n_kv_heads, head_dim, n_rot;
    td_rope_mode mode;
    const float *inv_freq; /* the model's (n_rot / 2) */
} td_backend_rope;

typedef enum {
    TD_CP_ATTN_DCP_PART,  /* DCP row: partial over this rank's blocks into its slot of part */
    TD_CP_ATTN_DCP_MERGE, /* DCP row: merge the cp_n partials in rank order into att */
    TD_CP_ATTN_PCP_FULL,  /* PCP row, allgather: attention over the gathered context */
    TD_CP_ATTN_PCP_OWN,   /* PCP row, ring: partial over this rank's blocks into att, ms */
    TD_CP_ATTN_PCP_MERGE, /* PCP row, ring: partial over a received chunk, merged into att, ms */
} td_cp_attn_kind;

typedef struct {
    td_cp_attn_kind kind;
    td_backend_kv kv;      /* this rank's layer, or the gathered / received K/V */
    const int32_t *table;  /* PCP: block table of kv (host, valid for the call) */
    int offset;            /* PCP_MERGE: CP rank whose blocks kv holds */
    int32_t row0, n_items; /* PCP: first row, rows; DCP: items are cp_dcp_row entries */
    int64_t cost;          /* positions attended (decides threading only) */
    td_bview q, att;       /* (rows, nh * head_dim) */
    td_bview part;         /* DCP: (cp_n, n_dcp, nh, head_dim + 2) out, max, exp-sum */
    td_bview ms;           /* ring: (rows, nh, 2) running max and exp-sum */
    int nh, nkv, head_dim;
    float scale;
} td_backend_cp_attn;

/* One MoE layer's routed experts (this shard's), run over grouped slots. */
typedef struct {
    const td_expert_weights *experts; /* (n) ascending id */
    int32_t n;
    int32_t id_base; /* expert e's first slot is off[e.id - id_base] */
    td_bview off;    /* int32 (n + 1 or n_expert + 1) first slot of each expert */
    td_bview xg;     /* (slots, n_embd) input rows */
    td_bview gg, ug; /* (slots, n_ff_exp) */
    td_bview yg;     /* (slots, n_embd) outputs */
    int32_t n_slots; /* rows of xg, gg, ug and yg at most; off says how many are used */
    int n_embd, n_ff;
} td_backend_experts;

/* Expert parallelism moves fixed blocks, so the host never reads a count:
 * sender j's rows for this rank's experts arrive in a block of cap[j] rows
 * (its rows x min(k, local experts), a bound no routing exceeds), at the
 * sum of the caps before it. The counts say how many of a block's rows are
 * real, local expert by local expert. */
typedef struct {
    td_bview blocks;    /* (sum of cap, n_embd) the received rows, sender-major */
    td_bview slots;     /* (.., n_embd) the same rows expert-major */
    td_bview counts;    /* int32 (n_senders, n_expert) each sender's choices per expert */
    td_bview off;       /* int32 (n_local + 1) first slot of each local expert, written */
    td_bview err;       /* int32, set to 1 when a sender's counts overflow its block */
    const int32_t *cap; /* host (n_senders) rows of each sender's block */
    int n_senders, n_local, exp0, n_expert, n_embd;
} td_backend_ep;

typedef struct td_backend_i {
    const char *name;
    void (*destroy)(td_backend *be);
    bool (*supports)(td_backend *be, td_op op, td_dtype type);
    td_status (*upload_model)(td_backend *be, const td_model *m);
    /* One matrix or float vector the ops will name by its host pointer,
     * outside a model (the op tests); uploaded again if already known. */
    td_status (*upload_weight)(td_backend *be, const td_weight *w);
    td_status (*upload_floats)(td_backend *be, const float *p, size_t n);
    /* scratch the ops need for contexts of up to max_ctx positions */
    td_status (*reserve)(td_backend *be, int32_t max_ctx, int head_dim);
    td_bbuf *(*alloc)(td_backend *be, size_t bytes); /* zero-filled; NULL when out of memory */
    /* The layout this backend keeps a pool of these params in
     * (TD_ERR_UNSUPPORTED for a dtype it cannot store). */
    td_status (*kv_layout)(td_backend *be, const td_kv_params *p, td_kv_layout *l);
    /* KV storage of that layout, its memory through hook (may be NULL):
     * what the network reaches, so it is never hidden from a peer's puts
     * (the checking backend leaves it open). NULL on failure; free
     * releases it through the hook. */
    td_bbuf *(*kv_alloc)(td_backend *be, const td_kv_layout *l, const td_kv_mem_hook *hook);
    void (*free)(td_backend *be, td_bbuf *b);
    void *(*comm_ptr)(td_backend *be, td_bview v);
    /* The address of a view as the network sees it (host or device), for
     * registering KV storage: no access, valid as long as the buffer. */
    void *(*addr)(td_backend *be, td_bview v);
    /* The first error an op met since the last call (then cleared): an
     * asynchronous backend's ops cannot return one. TD_OK on the CPU. */
    td_status (*status)(td_backend *be);
    void (*comm_begin)(td_backend *be);
    void (*comm_end)(td_backend *be);
    void (*set_batch)(td_backend *be, const td_backend_batch *b);
    void (*copy)(td_backend *be, td_bview dst, td_bview src, size_t bytes);
    void (*copy_rows)(td_backend *be, td_bview dst, td_bview src, const int32_t *src_rows,
                      int32_t n, size_t row_bytes);
    void (*copy_to_host)(td_backend *be, void *dst, td_bview src, size_t bytes);
    void (*copy_from_host)(td_backend *be, td_bview dst, const void *src, size_t bytes);
    void (*sync)(td_backend *be);
    void (*embed)(td_backend *be, const td_weight *w, int32_t v0, int32_t v1, td_bview x);
    void (*rmsnorm)(td_backend *be, td_bview x, td_bview add, td_bview xn, int32_t n_rows,
                    bool logit_rows, const float *w, int n, float eps);
    void (*add)(td_backend *be, td_bview x, td_bview y, int32_t n_rows, int n);
    void (*matmul)(td_backend *be, int n_w, const td_weight *const *w, td_bview x, size_t ldx,
                   const td_bview *y, const size_t *ldy, int32_t n_rows);
    void (*rope_store)(td_backend *be, td_bview q, td_bview k, td_bview v, const float *bq,
                       const float *bk, const float *bv, const td_backend_rope *rope,
                       const td_backend_kv *kv);
    void (*attn)(td_backend *be, td_bview q, td_bview att, const td_backend_kv *kv, int nh,
                 float scale, int64_t cost);
    void (*attn_cp)(td_backend *be, const td_backend_cp_attn *a);
    void (*kv_pack)(td_backend *be, const td_backend_kv *kv, int32_t seq, int32_t end, td_bview dst,
                    int32_t stride_blocks);
    void (*swiglu)(td_backend *be, td_bview g, td_bview u, int32_t n_rows, int n);
    void (*moe_route)(td_backend *be, td_bview rl, td_bview sel_id, td_bview sel_w, int32_t r0,
                      int32_t n_rows, int n_expert, int k, bool norm_topk);
    void (*moe_group)(td_backend *be, td_bview sel_id, td_bview sel_slot, td_bview slot_row,
                      td_bview off, td_bview counts, int32_t r0, int32_t r1, int n_expert, int k);
    void (*moe_gather)(td_backend *be, td_bview xg, td_bview xn, td_bview slot_row, int32_t n_slots,
                       int n_embd);
    void (*moe_experts)(td_backend *be, const td_backend_experts *x);
    void (*moe_combine)(td_backend *be, td_bview o, td_bview xn, td_bview sel_w, td_bview sel_slot,
                        td_bview yg, const float *shexp_inp, bool shared, int32_t r0, int32_t r1,
                        bool shared_outside, int32_t n_rows, int n_embd, int k);
    /* This rank's grouped slots (off: int32 (n_groups * group + 1) first
     * slot of each expert) to blocks of cap rows, group g at row g * cap
     * (to_blocks), or back. */
    void (*moe_ep_pack)(td_backend *be, td_bview blocks, td_bview slots, td_bview off, int n_groups,
                        int group, int32_t cap, int n_embd, bool to_blocks);
    /* The received blocks to expert-major slots, writing off and err
     * (to_slots), or the experts' outputs back into the blocks. A sender
     * whose counts overflow its block sets err and counts as sending none. */
    void (*moe_ep_permute)(td_backend *be, const td_backend_ep *p, bool to_slots);
    /* dst[x] = sum over k < n_src of src[k * n + x] (int32) */
    void (*count_sum)(td_backend *be, td_bview dst, td_bview src, int n_src, int n);
    /* logits (n_rows, n_vocab) from the vocab_tp blocks (n_rows, width) of head_buf */
    void (*head_place)(td_backend *be, td_bview logits, td_bview head_buf, int32_t n_rows,
                       int32_t width, int32_t n_vocab, int vocab_tp);
} td_backend_i;

struct td_backend {
    const td_backend_i *i;
    void *ctx;
};

/* The CPU backend over tp (NULL: the calling thread only), borrowed. */
td_status td_backend_cpu_create(td_threadpool *tp, td_backend **be_p);
/* The checking backend (TD_BACKEND_CPU_CHECK) wrapping a CPU backend. */
td_status td_backend_check_create(td_threadpool *tp, td_backend **be_p);
td_status td_backend_create(td_backend_kind kind, td_threadpool *tp, td_backend **be_p);
/* The same on GPU `device` (CUDA only; the CPU backends ignore it). */
td_status td_backend_create_on(td_backend_kind kind, int device, td_threadpool *tp,
                               td_backend **be_p);
/* "cpu", "cpu-check", "cuda" or "cuda:N" (--device, TANDEM_BACKEND);
 * TD_ERR_INVALID for anything else. */
td_status td_backend_parse(const char *s, td_backend_kind *kind, int *device);
/* The CUDA backend on GPU `device`; TD_ERR_UNSUPPORTED in a build without
 * CUDA or on a machine without that GPU (the reason logged). */
td_status td_backend_cuda_create(int device, td_backend **be_p);
/* Whether this build has the CUDA backend, and the GPUs it sees (0 when
 * none or not built). */
bool td_backend_cuda_built(void);
int td_backend_cuda_devices(void);
/* TANDEM_BACKEND (td_backend_parse; unset: cpu; anything else is logged
 * and taken as cpu), and its GPU index (0 unless "cuda:N"). */
td_backend_kind td_backend_kind_from_env(void);
int td_backend_device_from_env(void);
const char *td_backend_kind_name(td_backend_kind kind);
void td_backend_destroy(td_backend *be); /* accepts NULL */

/* The CPU kernel set, chosen once per process (the ISA report). */
td_isa td_backend_isa_best(void);
int td_backend_isa_parse(const char *name); /* -1 if unknown */
const char *td_backend_isa_name(td_isa isa);
bool td_backend_isa_select(td_isa isa); /* false: this CPU cannot run it */
td_isa td_backend_isa_selected(void);
/* The CPU backend's matmuls with quantized weights take their activations
 * quantized to 8 bits per 32-element block (llama.cpp's way: faster
 * prompts, other rounding: the results change), instead of f32 against
 * weights dequantized exactly (the default). Chosen once per process, like
 * the ISA, before any forward pass. */
void td_backend_set_act_int8(bool on);
/* The CPU backend's matmuls read a private copy of the weights in
 * transparent huge pages, made when a model is uploaded (the default), or
 * (false: --mmap) the weights in place, where the loader mapped the file.
 * Chosen once per process, before any engine is created. */
void td_backend_set_weight_copy(bool on);

/* Allocation through the table. */
static inline td_bbuf *td_backend_alloc(td_backend *be, size_t bytes) {
    return be->i->alloc(be, bytes);
}
static inline void td_backend_free(td_backend *be, td_bbuf *b) {
    if (b) be->i->free(be, b);
}

#endif
