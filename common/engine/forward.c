/* The forward pass over a batch of sequence chunks.
 *
 * All tokens of all chunks are rows of one activation matrix, so every
 * weight matrix is streamed once per call. This file holds the layer loop,
 * the parallel plan (TP, PP, CP, EP, attention-DP) and the comm calls; it
 * computes only through the backend's ops table (common/backend/backend.h)
 * on backend buffers, and reads nothing back from them until the step's
 * results (logits, hidden states for the next stage, per-expert counts)
 * come back through explicit copies at its end. Whose rows are computed
 * where, and in which grouping, is decided here on the host from the batch
 * alone; the backend's ops keep every row's value independent of the other
 * rows (the invariance contract of forward.h). The one read of backend
 * memory inside a step left is expert parallelism's per-expert counts,
 * which size its all-to-all (copied once per MoE layer, explicitly). */
#include "forward.h"

#include <math.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#include "common/backend/backend.h"

/* Vocab-parallel head: most logits all-gathered at a time (bounds its scratch). */
#define HEAD_GATHER_FLOATS (1 << 21)
/* Head of one rank: most logits computed before they are copied out. */
#define HEAD_OUT_FLOATS (1 << 21)

struct td_engine {
    const td_model *m;
    td_kv_pool *kv;
    td_comm *comm;
    td_engine_params p;
    td_backend *be;
    bool own_be; /* created here (p.backend was NULL) */
    int n_embd, head_dim, n_rot, nh, nkv, q_dim, kv_dim, n_ff;
    int32_t n_vocab;
    float eps, attn_scale;
    td_backend_rope rope;

    /* backend scratch, T = max_batch_tokens */
    td_bbuf *x;     /* (T, n_embd) residual stream */
    td_bbuf *xn;    /* (T, n_embd) normed rows */
    td_bbuf *q;     /* (T, q_dim) */
    td_bbuf *k, *v; /* (T, kv_dim) */
    td_bbuf *att;   /* (T, q_dim) attention output */
    td_bbuf *o;     /* (T, n_embd) wo / w_down output */
    td_bbuf *g, *u; /* (T, n_ff) local MLP width (the shared expert's for MoE) */
    td_bbuf *lg;    /* (head_out_rows, n_vocab) logits before they are copied out */
    int32_t head_out_rows;
    /* the K/V bytes of the pool's blocks, allocated through the backend */
    td_bbuf *kvb;        /* the KV storage (NULL after td_engine_kv_release) */
    td_kv_layout kv_lay; /* its layout, as the backend keeps it */
    /* MoE scratch (n_expert > 0), K = n_expert_used */
    int n_expert, n_used, n_ff_exp;
    bool norm_topk;
    td_bbuf *rl;             /* (T, n_expert) router logits */
    td_bbuf *sel_id;         /* int32 (T, K) chosen experts, by descending probability */
    td_bbuf *sel_w;          /* (T, K) their weights */
    td_bbuf *sel_slot;       /* int32 (T, K) grouped slot holding each choice */
    td_bbuf *slot_row;       /* int32 (T * K) token row of each slot, slots grouped by expert */
    td_bbuf *exp_off;        /* int32 (n_expert + 1) first slot of each expert */
    td_bbuf *xg;             /* (T * K, n_embd) token rows gathered per expert */
    td_bbuf *gg, *ug;        /* (T * K, n_ff_exp) local expert width */
    td_bbuf *yg;             /* (T * K, n_embd) expert outputs */
    td_bbuf *load_cnt;       /* int32 (local layers, n_expert) choices per expert of the step, then
                              * the EP exchange's error flag */
    int32_t *load_h;         /* host: load_cnt copied at the step's end */
    size_t load_err;         /* index of the error flag in load_cnt */
    int32_t *tok_seq;        /* (T) sequence of each row */
    int32_t *tok_pos;        /* (T) position of each row */
    int32_t *tok_id;         /* (T) token id of each row */
    int32_t *logit_tok;      /* (T) row feeding each logit row */
    const int32_t **seq_tab; /* (S) block table of each sequence */
    int32_t *seq_nb;         /* (S) its entries */
    /* Expert parallelism (ep_comm of size > 1) and per-expert load. The rows
     * of the batch are split between the ranks of the row group (the TP
     * group, or the EP group itself when TP is 1), which all hold the same
     * rows; each rank routes its share and sends every (row, expert) choice
     * to the expert's rank in its EP group (consecutive row-group ranks). */
    int ep_size, ep_rank;          /* EP group; 1 / 0 without EP */
    int n_exp_loc, exp0;           /* local experts [exp0, exp0 + n_exp_loc) */
    td_comm *rg_comm;              /* row group: comm, or ep_comm when TP is 1 */
    int rg_rank, rg_size, ep_base; /* ep_base: row-group rank of EP rank 0 of this group */
    bool ep_sum;                   /* the FFN partials are summed over ep_comm (TP is 1) */
    bool ep_dp;                    /* attention-DP: own sequences, own rows, no row split */
    td_bbuf *ep_cnt;               /* int32 (rg_size, n_expert) choices of each rank's rows */
    size_t *a2a;                   /* (4, ep_size) send bytes, displs, recv bytes, displs */
    int32_t *ep_cap;               /* host (ep_size) rows of each EP rank's dispatch block */
    int32_t ep_kl;                 /* block rows per routed row: min(k, n_exp_loc) */
    td_bbuf *ep_eoff;              /* int32 (n_exp_loc + 1) first received slot of each expert */
    td_bbuf *ep_send;              /* (ep_size blocks of ep_cap[ep_rank] rows, n_embd) */
    td_bbuf *ep_recv;              /* (a block of ep_cap[j] rows per EP rank j, n_embd) */
    int64_t *load_last;            /* host (local layers, n_expert): counts of the last step */
    const td_seq_chunk *seqs;
    int32_t n_tok;
    /* vocab-parallel embedding and head (model tp_size > 1): rows of other
     * ranks' tokens are zeros, summed over comm; logits all-gathered */
    int vocab_tp;                   /* ranks sharing the vocabulary (the model's tp_size) */
    int32_t vocab_begin, vocab_end; /* this rank's tokens */
    int32_t vocab_per_rank;         /* ceil(n_vocab / vocab_tp): every rank's block width */
    int32_t head_rows;              /* logit rows per all-gather */
    td_bbuf *head_buf;              /* (vocab_tp, head_rows, vocab_per_rank) or NULL (tp 1) */
    /* per-rank compute / communication time of the last call (td_engine_last_timing) */
    td_engine_timing timing;
    uint64_t comm_ns; /* time inside comm calls during the running call */
    uint64_t comm_t0; /* start of the running comm call */
    bool comm_timed;  /* the running comm call is timed (communicator of > 1 rank) */

    /* Context parallelism (cp_comm of more than one rank; DESIGN.md §3).
     * T as above, S = max_seqs, B = cp_maxb blocks, blk = block_size * kv_dim. */
    td_comm *cp;                     /* NULL: no CP (cp_n 1) */
    int cp_n, cp_r;                  /* CP group size and this rank's place in it */
    int cp_bs;                       /* KV block size */
    int32_t cp_maxb;                 /* most blocks of one sequence a CP rank holds */
    int32_t cp_n_seqs;               /* sequences of the running call */
    uint8_t *cp_split;               /* (S) chunk split over CP by block owner (PCP), else DCP */
    int32_t *cp_row0;                /* (S) first local row of each sequence */
    int32_t *cp_nrow;                /* (S) local rows of each sequence */
    int32_t *cp_ltab;                /* (S, B) each sequence's blocks held by this rank, in order */
    int32_t *cp_gtab;                /* (cp_n * B) block table of gathered / received K/V */
    int32_t *cp_dcp_row;             /* (T) local rows computed by every CP rank */
    int32_t n_dcp;                   /* how many */
    int64_t cp_dcp_cost;             /* positions those rows attend */
    int32_t *cp_lsrc;                /* (T) CP rank computing each logit row (rank 0 only) */
    int32_t *cp_send_row;            /* (T) local rows of this rank's logit rows rank 0 needs */
    int32_t cp_k[TD_COMM_MAX_RANKS]; /* logit rows each rank sends to rank 0 */
    td_bbuf *cp_part; /* (cp_n, T, nh, head_dim + 2) DCP partials: out, max, exp-sum */
    td_bbuf *cp_kv;   /* allgather: (cp_n, 2, B, blk) K then V of each rank; ring: two
                       * (2, B, blk) chunk buffers */
    td_bbuf *cp_ms;   /* (T, nh, 2) ring: running max and exp-sum of each query */
};

#define BV(b)       td_bview_of(b)
#define BF(b, n)    td_bview_f32(td_bview_of(b), (size_t)(n))
#define BI(b, n)    td_bview_bytes(td_bview_of(b), (size_t)(n) * sizeof(int32_t))
#define OP(e, name) (e)->be->i->name

/* Every td_comm_* call of the forward pass goes through ENGINE_COMM, which
 * charges its wall time (waiting for peers included) to comm_s of
 * td_engine_timing, counts it and adds bytes (the payload this rank hands
 * over) to comm_bytes; calls on a communicator of one rank are not timed
 * (they are no-ops). It evaluates to the call's td_status:
 *   if ((st = ENGINE_COMM(e, e->comm, n * sizeof(float),
 *                         td_comm_all_reduce(e->comm, buf, n, TD_COMM_F32, TD_COMM_SUM,
 *                                            CSTREAM(e)))))
 *       return st;
 * The comma operator times exactly the call: the clock starts before it is
 * evaluated and stops after. The call reaches backend memory through
 * CPTR(e, view), between the backend's comm_begin and comm_end. */
#define ENGINE_COMM(e, comm, bytes, call)                                                          \
    (engine_comm_start((e), (comm)), engine_comm_stop((e), (bytes), (call)))
#define CPTR(e, view) OP(e, comm_ptr)((e)->be, (view))
/* The stream the data collectives are ordered on: none while the data
 * communicators are CPU ones (a device backend stages its views for them
 * between comm_begin and comm_end). */
#define CSTREAM(e) ((void)(e), (td_comm_stream)NULL)

static void engine_comm_start(td_engine *e, const td_comm *comm) {
    e->comm_timed = comm && td_comm_size(comm) > 1;
    if (e->comm_timed) e->comm_t0 = td_time_ns();
    OP(e, comm_begin)(e->be);
}

static td_status engine_comm_stop(td_engine *e, size_t bytes, td_status st) {
    OP(e, comm_end)(e->be);
    if (e->comm_timed) {
        e->comm_ns += td_time_ns() - e->comm_t0;
        e->timing.comm_calls++;
        e->timing.comm_bytes += bytes;
        e->comm_timed = false;
    }
    return st;
}

/* The sum of a view's n floats over comm. A communicator of one rank has
 * nothing to add: no call at all, so a device backend stages nothing. */
static td_status all_reduce(td_engine *e, td_comm *comm, td_bview v, size_t n) {
    if (td_comm_size(comm) == 1) return TD_OK;
    return ENGINE_COMM(
        e, comm, n * sizeof(float),
        td_comm_all_reduce(comm, CPTR(e, v), n, TD_COMM_F32, TD_COMM_SUM, CSTREAM(e)));
}

td_engine_params td_engine_default_params(void) {
    td_engine_params p = {.max_batch_tokens = 2048,
                          .max_seqs = 256,
                          .max_ctx = 0,
                          .cp_min_tokens = 256,
                          .backend_kind = (int)td_backend_kind_from_env(),
                          .backend_device = td_backend_device_from_env()};
    return p;
}

/* Backend scratch of n elements of elem bytes (zero-filled). */
static td_bbuf *balloc(td_engine *e, size_t n, size_t elem, bool *fail) {
    size_t bytes;
    if (td_mul_overflow(n, elem, &bytes)) {
        *fail = true;
        return NULL;
    }
    td_bbuf *b = td_backend_alloc(e->be, bytes);
    if (!b) *fail = true;
    return b;
}

static void *scratch_alloc(size_t n, size_t elem, bool *fail) {
    size_t bytes;
    if (td_mul_overflow(n, elem, &bytes)) {
        *fail = true;
        return NULL;
    }
    bytes = (bytes + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, bytes ? bytes : 64);
    if (!p) *fail = true;
    return p;
}

/* Context parallelism: parameters checked before anything is allocated. */
static td_status cp_check(const td_engine_params *ep, const td_model_config *c) {
    if (!ep->cp_comm || td_comm_size(ep->cp_comm) == 1) return TD_OK;
    if (ep->cp_mode != TD_CP_ALLGATHER && ep->cp_mode != TD_CP_RING) {
        TD_LOG_ERROR("unknown context-parallel mode %d", ep->cp_mode);
        return TD_ERR_INVALID;
    }
    if (ep->cp_min_tokens < 1) {
        TD_LOG_ERROR("context-parallel minimum chunk of %d tokens (at least 1)", ep->cp_min_tokens);
        return TD_ERR_INVALID;
    }
    if (c->head_dim > TD_BACKEND_CP_MAX_HEAD_DIM) {
        TD_LOG_ERROR("head size %d too large for context parallelism (at most %d)", c->head_dim,
                     TD_BACKEND_CP_MAX_HEAD_DIM);
        return TD_ERR_UNSUPPORTED;
    }
    return TD_OK;
}

/* Every CP rank keeps a KV pool of the whole block-id space and touches only
 * its own blocks, so KV memory per rank is not reduced yet: what CP splits
 * here is the attention work and (PCP) the token rows. */
static void cp_alloc(td_engine *e, const td_kv_params *kp, bool *fail) {
    e->cp_n = 1;
    if (!e->p.cp_comm || td_comm_size(e->p.cp_comm) == 1) return;
    e->cp = e->p.cp_comm;
    e->cp_n = td_comm_size(e->cp);
    e->cp_r = td_comm_rank(e->cp);
    e->cp_bs = kp->block_size;
    int64_t max_blocks = ((int64_t)e->p.max_ctx + kp->block_size - 1) / kp->block_size;
    e->cp_maxb = (int32_t)((max_blocks + e->cp_n - 1) / e->cp_n);
    size_t T = (size_t)e->p.max_batch_tokens, S = (size_t)e->p.max_seqs, C = (size_t)e->cp_n;
    size_t B = (size_t)e->cp_maxb, blk = (size_t)kp->block_size * (size_t)e->kv_dim;
    size_t nhd = (size_t)e->nh * ((size_t)e->head_dim + 2);
    e->cp_split = scratch_alloc(S, sizeof(uint8_t), fail);
    e->cp_row0 = scratch_alloc(S, sizeof(int32_t), fail);
    e->cp_nrow = scratch_alloc(S, sizeof(int32_t), fail);
    e->cp_ltab = scratch_alloc(S * B, sizeof(int32_t), fail);
    e->cp_gtab = scratch_alloc(C * B, sizeof(int32_t), fail);
    e->cp_dcp_row = scratch_alloc(T, sizeof(int32_t), fail);
    e->cp_lsrc = scratch_alloc(T, sizeof(int32_t), fail);
    e->cp_send_row = scratch_alloc(T, sizeof(int32_t), fail);
    e->cp_part = balloc(e, C * T, nhd * sizeof(float), fail);
    /* zero-filled: allgather pads each rank's blocks, no uninitialised bytes go to the comm */
    e->cp_kv =
        balloc(e, (e->p.cp_mode == TD_CP_RING ? 2 : C) * 2 * B, blk * e->kv_lay.elem_bytes, fail);
    e->cp_ms = balloc(e, T * (size_t)e->nh * 2, sizeof(float), fail);
}

static void cp_free(td_engine *e) {
    free(e->cp_split);
    free(e->cp_row0);
    free(e->cp_nrow);
    free(e->cp_ltab);
    free(e->cp_gtab);
    free(e->cp_dcp_row);
    free(e->cp_lsrc);
    free(e->cp_send_row);
    td_backend_free(e->be, e->cp_part);
    td_backend_free(e->be, e->cp_kv);
    td_backend_free(e->be, e->cp_ms);
}

static void engine_free_scratch(td_engine *e) {
    if (!e->be) return;
    cp_free(e);
    td_bbuf *bufs[] = {e->x,       e->xn,      e->q,        e->k,        e->v,       e->att,
                       e->o,       e->g,       e->u,        e->lg,       e->kvb,     e->rl,
                       e->sel_id,  e->sel_w,   e->sel_slot, e->slot_row, e->exp_off, e->xg,
                       e->gg,      e->ug,      e->yg,       e->load_cnt, e->ep_cnt,  e->ep_eoff,
                       e->ep_send, e->ep_recv, e->head_buf};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) td_backend_free(e->be, bufs[i]);
    free(e->tok_seq);
    free(e->tok_pos);
    free(e->tok_id);
    free(e->logit_tok);
    free(e->seq_tab);
    free(e->seq_nb);
    free(e->load_h);
    free(e->a2a);
    free(e->ep_cap);
    free(e->load_last);
    if (e->own_be) td_backend_destroy(e->be);
}

/* Expert parallelism: the EP group must be the one the model shard was
 * loaded for, and inside a TP group its consecutive ranks. */
static td_status ep_check(const td_model *m, td_comm *comm, const td_engine_params *p) {
    const td_model_config *c = td_model_get_config(m);
    int P = p->ep_comm ? td_comm_size(p->ep_comm) : 1;
    int R = p->ep_comm ? td_comm_rank(p->ep_comm) : 0;
    int ms = td_model_ep_size(m), mr = td_model_ep_rank(m);
    if (p->attn_dp && (c->n_expert == 0 || P < 2)) {
        TD_LOG_ERROR("attention data-parallel needs a mixture-of-experts model and an EP group of "
                     "2 or more ranks (%d experts, EP group of %d)",
                     c->n_expert, P);
        return TD_ERR_INVALID;
    }
    if (c->n_expert == 0) {
        if (P > 1) {
            TD_LOG_ERROR("an EP group of %d ranks needs a mixture-of-experts model; this one is "
                         "dense",
                         P);
            return TD_ERR_INVALID;
        }
        return TD_OK;
    }
    if (P != ms || R != mr) {
        TD_LOG_ERROR("the EP group (rank %d of %d) does not match the model shard, which holds "
                     "the experts of EP rank %d of %d",
                     R, P, mr, ms);
        return TD_ERR_INVALID;
    }
    int32_t n_loc = c->n_expert / ms;
    for (int l = td_model_layer_begin(m); l < td_model_layer_end(m); l++) {
        const td_layer_weights *lw = td_model_layer(m, l);
        if (lw->n_experts_local != n_loc || lw->experts[0].id != mr * n_loc) {
            TD_LOG_ERROR("layer %d holds %d experts from id %d, not the %d of EP rank %d of %d", l,
                         lw->n_experts_local, lw->experts[0].id, n_loc, mr, ms);
            return TD_ERR_INVALID;
        }
    }
    int tn = td_comm_size(comm), tr = td_comm_rank(comm);
    if (p->attn_dp &&
        (tn > 1 || td_model_tp_size(m) > 1 || (p->cp_comm && td_comm_size(p->cp_comm) > 1))) {
        TD_LOG_ERROR("attention data-parallel runs whole attention on every rank: TP group of %d, "
                     "shard of TP size %d, CP group of %d (all must be 1)",
                     tn, td_model_tp_size(m), p->cp_comm ? td_comm_size(p->cp_comm) : 1);
        return TD_ERR_INVALID;
    }
    if (P > 1 && tn > 1 && (tn % P != 0 || tr % P != R)) {
        TD_LOG_ERROR("the EP group (rank %d of %d) is not a run of consecutive ranks of the TP "
                     "group (rank %d of %d)",
                     R, P, tr, tn);
        return TD_ERR_INVALID;
    }
    return TD_OK;
}

static void ep_setup(td_engine *e) {
    e->ep_size = 1;
    td_comm *epc = e->p.ep_comm;
    if (e->n_expert == 0 || !epc || td_comm_size(epc) < 2) return;
    e->ep_size = td_comm_size(epc);
    e->ep_rank = td_comm_rank(epc);
    e->n_exp_loc = e->n_expert / e->ep_size;
    e->exp0 = e->ep_rank * e->n_exp_loc;
    e->n_ff_exp = td_model_get_config(e->m)->n_ff_exp; /* whole experts */
    e->ep_dp = e->p.attn_dp;
    /* TP 1: the EP group is the row group (the same rows, or under
     * attention-DP each rank its own, which need no sum). */
    e->rg_comm = td_comm_size(e->comm) == 1 ? epc : e->comm;
    e->ep_sum = td_comm_size(e->comm) == 1 && !e->ep_dp;
    e->rg_rank = td_comm_rank(e->rg_comm);
    e->rg_size = td_comm_size(e->rg_comm);
    e->ep_base = e->rg_rank - e->ep_rank;
}

/* Attention-DP: the EP rank that computes a sequence, fixed for its whole
 * life whatever its place in a batch: its first block's id mod ep (a
 * sequence's first block never changes, and sequences that share cached
 * prefix blocks share the first one, so they share the rank holding their
 * K/V). */
static int seq_owner(const td_engine *e, const td_seq_chunk *s) {
    if (s->n_blocks < 1 || !s->block_table) return 0;
    return (int)((uint32_t)s->block_table[0] % (uint32_t)e->ep_size);
}

static bool seq_mine(const td_engine *e, const td_seq_chunk *s) {
    return !e->ep_dp || seq_owner(e, s) == e->ep_rank;
}

/* The backend must run every op this shard needs, for its weight types:
 * refused here, at start-up, never in the middle of a step. */
static bool backend_has(const td_engine *e, td_op op, const td_weight *w, int *bad_type) {
    if (!w || w->rows == 0 || OP(e, supports)(e->be, op, w->type)) return true;
    *bad_type = (int)w->type;
    return false;
}

static td_status backend_check_model(const td_engine *e) {
    const td_model *m = e->m;
    int bad = -1; /* the first weight type refused */
    bool ok = backend_has(e, TD_OP_EMBED, td_model_tok_embd(m), &bad) &&
              backend_has(e, TD_OP_MATMUL, td_model_output(m), &bad) &&
              OP(e, supports)(e->be, TD_OP_ATTN, TD_TYPE_F32) &&
              (!e->p.cp_comm || td_comm_size(e->p.cp_comm) == 1 ||
               OP(e, supports)(e->be, TD_OP_ATTN_CP, TD_TYPE_F32)) &&
              (e->n_expert == 0 || OP(e, supports)(e->be, TD_OP_MOE, TD_TYPE_F32));
    for (int l = td_model_layer_begin(m); ok && l < td_model_layer_end(m); l++) {
        const td_layer_weights *lw = td_model_layer(m, l);
        const td_weight *ws[] = {&lw->wq,         &lw->wk,       &lw->wv,        &lw->wo,
                                 &lw->w_gate,     &lw->w_up,     &lw->w_down,    &lw->router,
                                 &lw->shexp_gate, &lw->shexp_up, &lw->shexp_down};
        for (size_t i = 0; ok && i < sizeof ws / sizeof ws[0]; i++)
            ok = backend_has(e, TD_OP_MATMUL, ws[i], &bad);
        for (int32_t x = 0; ok && x < lw->n_experts_local; x++)
            ok = backend_has(e, TD_OP_MATMUL, &lw->experts[x].gate, &bad) &&
                 backend_has(e, TD_OP_MATMUL, &lw->experts[x].up, &bad) &&
                 backend_has(e, TD_OP_MATMUL, &lw->experts[x].down, &bad);
    }
    if (!ok && bad >= 0)
        TD_LOG_ERROR("the %s backend cannot run this model shard: it has no kernels for %s weights",
                     e->be->i->name, td_dtype_name(bad));
    else if (!ok)
        TD_LOG_ERROR("the %s backend cannot run this model shard (an op of its plan is not "
                     "supported)",
                     e->be->i->name);
    return ok ? TD_OK : TD_ERR_UNSUPPORTED;
}

td_status td_engine_create(const td_model *m, td_kv_pool *kv, td_threadpool *tp, td_comm *comm,
                           const td_engine_params *p, td_engine **e_p) {
    if (!m || !kv || !comm || !e_p) return TD_ERR_INVALID;
    const td_model_config *c = td_model_get_config(m);
    td_engine_params ep = p ? *p : td_engine_default_params();
    if (ep.max_ctx <= 0) ep.max_ctx = TD_MIN(c->n_ctx_train, 8192);
    if (ep.max_batch_tokens <= 0 || ep.max_seqs <= 0 || ep.max_ctx <= 0) {
        TD_LOG_ERROR("bad engine limits (batch tokens %d, sequences %d, context %d)",
                     ep.max_batch_tokens, ep.max_seqs, ep.max_ctx);
        return TD_ERR_INVALID;
    }
    const td_kv_params *kp = td_kv_pool_params(kv);
    int n_local_layers = td_model_layer_end(m) - td_model_layer_begin(m);
    if (kp->n_layers != n_local_layers || kp->n_kv_heads != td_model_n_head_kv_local(m) ||
        kp->head_dim != c->head_dim) {
        TD_LOG_ERROR("KV pool (%d layers, %d heads of %d) does not match the model shard (%d, %d "
                     "of %d)",
                     kp->n_layers, kp->n_kv_heads, kp->head_dim, n_local_layers,
                     td_model_n_head_kv_local(m), c->head_dim);
        return TD_ERR_INVALID;
    }
    if (c->n_expert > 0 && (int64_t)ep.max_batch_tokens * c->n_expert_used > INT32_MAX) {
        TD_LOG_ERROR("batch of %d tokens times %d experts each is too large", ep.max_batch_tokens,
                     c->n_expert_used);
        return TD_ERR_INVALID;
    }
    td_status st = ep_check(m, comm, &ep);
    if (st) return st;
    if (td_model_tp_size(m) > 1 &&
        (td_comm_size(comm) != td_model_tp_size(m) || td_comm_rank(comm) != td_model_tp_rank(m))) {
        TD_LOG_ERROR("model shard is TP rank %d of %d but the communicator is rank %d of %d",
                     td_model_tp_rank(m), td_model_tp_size(m), td_comm_rank(comm),
                     td_comm_size(comm));
        return TD_ERR_INVALID;
    }
    td_status cst = cp_check(&ep, c);
    if (cst) return cst;
    td_engine *e = calloc(1, sizeof *e);
    if (!e) {
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    e->m = m;
    e->kv = kv;
    e->comm = comm;
    e->p = ep;
    if (ep.backend) {
        e->be = ep.backend;
    } else {
        if ((st = td_backend_create_on((td_backend_kind)ep.backend_kind, ep.backend_device, tp,
                                       &e->be))) {
            free(e);
            return st;
        }
        e->own_be = true;
    }
    e->n_embd = c->n_embd;
    e->head_dim = c->head_dim;
    e->n_rot = c->n_rot;
    e->nh = td_model_n_head_local(m);
    e->nkv = td_model_n_head_kv_local(m);
    e->q_dim = e->nh * c->head_dim;
    e->kv_dim = e->nkv * c->head_dim;
    e->n_ff = c->n_ff / td_model_tp_size(m);
    if (c->n_expert > 0) {
        /* The dense g/u buffers serve the shared expert. */
        e->n_ff = c->n_ff_shexp / td_model_tp_size(m);
        e->n_expert = c->n_expert;
        e->n_used = c->n_expert_used;
        e->n_ff_exp = c->n_ff_exp / td_model_tp_size(m);
        e->norm_topk = c->norm_topk_prob;
    }
    ep_setup(e);
    e->n_vocab = c->n_vocab;
    e->vocab_tp = td_model_tp_size(m);
    td_model_vocab_range(m, &e->vocab_begin, &e->vocab_end);
    e->vocab_per_rank = (int32_t)(((int64_t)c->n_vocab + e->vocab_tp - 1) / e->vocab_tp);
    e->eps = c->rms_eps;
    e->attn_scale = (float)(1.0 / sqrt((double)c->head_dim));
    e->rope = (td_backend_rope){.n_heads = e->nh,
                                .n_kv_heads = e->nkv,
                                .head_dim = e->head_dim,
                                .n_rot = e->n_rot,
                                .mode = c->rope_mode,
                                .inv_freq = td_model_rope_inv_freq(m)};
    if ((st = backend_check_model(e)) || (st = OP(e, upload_model)(e->be, m)) ||
        (st = OP(e, reserve)(e->be, ep.max_ctx, c->head_dim)) ||
        (st = OP(e, kv_layout)(e->be, kp, &e->kv_lay))) {
        if (st == TD_ERR_UNSUPPORTED)
            TD_LOG_ERROR("the %s backend cannot hold a KV cache of dtype %s (--kv-dtype)",
                         e->be->i->name, td_dtype_name(kp->dtype));
        engine_free_scratch(e);
        free(e);
        return st;
    }
    if (!(e->kvb = OP(e, kv_alloc)(e->be, &e->kv_lay, NULL))) {
        TD_LOG_ERROR("out of memory for %zu bytes of KV storage", e->kv_lay.bytes);
        engine_free_scratch(e);
        free(e);
        return TD_ERR_NOMEM;
    }

    size_t T = (size_t)ep.max_batch_tokens, S = (size_t)ep.max_seqs;
    bool fail = false;
    e->x = balloc(e, T * (size_t)e->n_embd, sizeof(float), &fail);
    e->xn = balloc(e, T * (size_t)e->n_embd, sizeof(float), &fail);
    e->o = balloc(e, T * (size_t)e->n_embd, sizeof(float), &fail);
    e->q = balloc(e, T * (size_t)e->q_dim, sizeof(float), &fail);
    e->att = balloc(e, T * (size_t)e->q_dim, sizeof(float), &fail);
    e->k = balloc(e, T * (size_t)e->kv_dim, sizeof(float), &fail);
    e->v = balloc(e, T * (size_t)e->kv_dim, sizeof(float), &fail);
    e->g = balloc(e, T * (size_t)e->n_ff, sizeof(float), &fail);
    e->u = balloc(e, T * (size_t)e->n_ff, sizeof(float), &fail);
    e->tok_seq = scratch_alloc(T, sizeof(int32_t), &fail);
    e->tok_pos = scratch_alloc(T, sizeof(int32_t), &fail);
    e->tok_id = scratch_alloc(T, sizeof(int32_t), &fail);
    e->logit_tok = scratch_alloc(T, sizeof(int32_t), &fail);
    e->seq_tab = scratch_alloc(S, sizeof(int32_t *), &fail);
    e->seq_nb = scratch_alloc(S, sizeof(int32_t), &fail);
    if (td_model_output(m)) {
        e->head_out_rows =
            (int32_t)TD_MAX((size_t)1, TD_MIN(T, HEAD_OUT_FLOATS / (size_t)e->n_vocab));
        e->lg = balloc(e, (size_t)e->head_out_rows * (size_t)e->n_vocab, sizeof(float), &fail);
    }
    if (e->n_expert > 0) {
        size_t TK = T * (size_t)e->n_used;
        e->rl = balloc(e, T * (size_t)e->n_expert, sizeof(float), &fail);
        e->sel_id = balloc(e, TK, sizeof(int32_t), &fail);
        e->sel_w = balloc(e, TK, sizeof(float), &fail);
        e->sel_slot = balloc(e, TK, sizeof(int32_t), &fail);
        e->slot_row = balloc(e, TK, sizeof(int32_t), &fail);
        e->exp_off = balloc(e, (size_t)e->n_expert + 1, sizeof(int32_t), &fail);
        e->xg = balloc(e, TK * (size_t)e->n_embd, sizeof(float), &fail);
        e->gg = balloc(e, TK * (size_t)e->n_ff_exp, sizeof(float), &fail);
        e->ug = balloc(e, TK * (size_t)e->n_ff_exp, sizeof(float), &fail);
        e->yg = balloc(e, TK * (size_t)e->n_embd, sizeof(float), &fail);
        size_t NL = (size_t)n_local_layers * (size_t)e->n_expert;
        e->load_err = NL;
        e->load_cnt = balloc(e, NL + 1, sizeof(int32_t), &fail);
        e->load_h = scratch_alloc(NL + 1, sizeof(int32_t), &fail);
        e->load_last = scratch_alloc(NL, sizeof(int64_t), &fail);
        if (e->load_last) memset(e->load_last, 0, NL * sizeof(int64_t));
        if (e->ep_size > 1) {
            size_t rc = (size_t)e->rg_size * (size_t)e->n_expert;
            e->ep_cnt = balloc(e, rc, sizeof(int32_t), &fail);
            e->a2a = scratch_alloc(4 * (size_t)e->ep_size, sizeof(size_t), &fail);
            e->ep_cap = scratch_alloc((size_t)e->ep_size, sizeof(int32_t), &fail);
            e->ep_eoff = balloc(e, (size_t)e->n_exp_loc + 1, sizeof(int32_t), &fail);
            /* A block bounds what one EP rank's rows send to one rank: each
             * row chooses k distinct experts, at most n_exp_loc of them on
             * one rank. The senders' rows add up to the batch at most; one
             * rank's are a row-group share, or (attention-DP) all of it. */
            e->ep_kl = TD_MIN(e->n_used, e->n_exp_loc);
            size_t kl = (size_t)e->ep_kl;
            size_t own = e->ep_dp ? T : (T + (size_t)e->rg_size - 1) / (size_t)e->rg_size;
            e->ep_send =
                balloc(e, (size_t)e->ep_size * own * kl * (size_t)e->n_embd, sizeof(float), &fail);
            e->ep_recv = balloc(e, T * kl * (size_t)e->n_embd, sizeof(float), &fail);
        }
    }
    if (e->vocab_tp > 1) {
        size_t per_row = (size_t)e->vocab_tp * (size_t)e->vocab_per_rank;
        e->head_rows = (int32_t)TD_MAX((size_t)1, TD_MIN(T, HEAD_GATHER_FLOATS / per_row));
        /* Columns past a short slice are never computed (and never read):
         * zero-filled once, so no uninitialised bytes go to the comm. */
        e->head_buf = balloc(e, (size_t)e->head_rows * per_row, sizeof(float), &fail);
        /* per_row >= n_vocab: on the last stage a gathered group fits in lg */
        TD_ASSERT(!e->lg || e->head_rows <= e->head_out_rows);
    }
    cp_alloc(e, kp, &fail);
    if (fail) {
        TD_LOG_ERROR("out of memory for engine scratch (%d tokens)", ep.max_batch_tokens);
        engine_free_scratch(e);
        free(e);
        return TD_ERR_NOMEM;
    }
    *e_p = e;
    return TD_OK;
}

void td_engine_destroy(td_engine *e) {
    if (!e) return;
    engine_free_scratch(e);
    free(e);
}

/* PCP: positions of [s->pos0, s->pos0 + s->n_tokens) in this CP rank's
 * blocks (block j on rank j % cp). */
static int32_t cp_owned(const td_engine *e, const td_seq_chunk *s) {
    const int64_t bs = e->cp_bs, C = e->cp_n, b = s->pos0, end = (int64_t)s->pos0 + s->n_tokens;
    int64_t j = b / bs, n = 0;
    j += ((e->cp_r - j % C) + C) % C; /* first block of this rank */
    for (; j * bs < end; j += C) n += TD_MIN(end, (j + 1) * bs) - TD_MAX(b, j * bs);
    return (int32_t)n;
}

static bool cp_is_split(const td_engine *e, const td_seq_chunk *s) {
    return s->n_tokens >= e->p.cp_min_tokens;
}

int32_t td_engine_stage_rows(const td_engine *e, const td_seq_chunk *seqs, int32_t n_seqs) {
    if (e && e->cp_n > 1) {
        int32_t n = 0;
        for (int32_t i = 0; i < n_seqs; i++)
            n += cp_is_split(e, &seqs[i]) ? cp_owned(e, &seqs[i]) : seqs[i].n_tokens;
        return n;
    }
    int32_t n = 0;
    for (int32_t i = 0; i < n_seqs; i++)
        if (seq_mine(e, &seqs[i])) n += seqs[i].n_tokens;
    return n;
}

td_status td_engine_expert_load(const td_engine *e, int layer, int64_t *counts) {
    if (!e || !counts || e->n_expert == 0) return TD_ERR_INVALID;
    int lb = td_model_layer_begin(e->m), le = td_model_layer_end(e->m);
    if (layer != -1 && (layer < lb || layer >= le)) return TD_ERR_INVALID;
    const size_t NE = (size_t)e->n_expert;
    memset(counts, 0, NE * sizeof *counts);
    for (int l = layer < 0 ? lb : layer; l < (layer < 0 ? le : layer + 1); l++)
        for (size_t x = 0; x < NE; x++) counts[x] += e->load_last[(size_t)(l - lb) * NE + x];
    return TD_OK;
}

int32_t td_engine_n_logit_rows(const td_seq_chunk *seqs, int32_t n_seqs) {
    int32_t n = 0;
    for (int32_t i = 0; i < n_seqs; i++)
        if (!seqs[i].no_logits) n += seqs[i].logits_all ? seqs[i].n_tokens : 1;
    return n;
}

/* ------------------------------------------------------------------ steps */

static void matmul(td_engine *e, const td_weight *const *w, int n_w, td_bview x, size_t ldx,
                   const td_bview *y, const size_t *ldy, int32_t n_rows) {
    OP(e, matmul)(e->be, n_w, w, x, ldx, y, ldy, n_rows);
}

/* ------------------------------------------------------------------- MoE */

/* The MoE FFN of one layer on xn (T, n_embd), result in o (this rank's
 * partial sum under TP, like the dense FFN). Tokens are grouped by expert
 * (a counting sort over the rows in order, on the backend), so each
 * expert's matrices are streamed once over all of its tokens. */
static void moe_ffn(td_engine *e, const td_layer_weights *lw, int li) {
    const int32_t T = e->n_tok;
    const int K = e->n_used, NE = e->n_expert;
    const size_t E = (size_t)e->n_embd;

    const td_weight *wr[] = {&lw->router};
    td_bview yr[] = {BV(e->rl)};
    size_t ldr[] = {(size_t)NE};
    matmul(e, wr, 1, BV(e->xn), E, yr, ldr, T);
    OP(e, moe_route)(e->be, BV(e->rl), BV(e->sel_id), BV(e->sel_w), 0, T, NE, K, e->norm_topk);
    OP(e, moe_group)
    (e->be, BV(e->sel_id), BV(e->sel_slot), BV(e->slot_row), BV(e->exp_off),
     BI(e->load_cnt, (size_t)li * (size_t)NE), 0, T, NE, K);
    int32_t n_slots = T * K;
    OP(e, moe_gather)(e->be, BV(e->xg), BV(e->xn), BV(e->slot_row), n_slots, e->n_embd);
    td_backend_experts x = {.experts = lw->experts,
                            .n = lw->n_experts_local,
                            .id_base = 0,
                            .off = BV(e->exp_off),
                            .xg = BV(e->xg),
                            .gg = BV(e->gg),
                            .ug = BV(e->ug),
                            .yg = BV(e->yg),
                            .n_slots = n_slots,
                            .n_embd = e->n_embd,
                            .n_ff = e->n_ff_exp};
    OP(e, moe_experts)(e->be, &x);

    bool shared = e->n_ff > 0;
    if (shared) {
        const td_weight *wgu[] = {&lw->shexp_gate, &lw->shexp_up};
        td_bview ygu[] = {BV(e->g), BV(e->u)};
        size_t ldgu[] = {(size_t)e->n_ff, (size_t)e->n_ff};
        matmul(e, wgu, 2, BV(e->xn), E, ygu, ldgu, T);
        OP(e, swiglu)(e->be, BV(e->g), BV(e->u), T, e->n_ff);
        const td_weight *wd[] = {&lw->shexp_down};
        td_bview yo[] = {BV(e->o)};
        size_t ldo[] = {E};
        matmul(e, wd, 1, BV(e->g), (size_t)e->n_ff, yo, ldo, T);
    }
    OP(e, moe_combine)
    (e->be, BV(e->o), BV(e->xn), BV(e->sel_w), BV(e->sel_slot), BV(e->yg), lw->shexp_inp, shared, 0,
     T, false, T, e->n_embd, K);
}

/* The rows EP rank j routes in this step: its row-group share of the
 * batch, or (attention-DP) the rows of the sequences it owns. Known on
 * every rank from the batch alone, so the blocks of the exchange are sized
 * on the host without reading a count. */
static void ep_plan(td_engine *e, const td_seq_chunk *seqs, int32_t n_seqs) {
    for (int j = 0; j < e->ep_size; j++) {
        int64_t rows = 0;
        if (e->ep_dp) {
            for (int32_t i = 0; i < n_seqs; i++)
                if (seq_owner(e, &seqs[i]) == j) rows += seqs[i].n_tokens;
        } else {
            int64_t T = e->n_tok, k = e->ep_base + j;
            rows = T * (k + 1) / e->rg_size - T * k / e->rg_size;
        }
        e->ep_cap[j] = (int32_t)rows * e->ep_kl;
    }
}

/* The MoE FFN of one layer under expert parallelism. This rank routes its
 * share [r0, r1) of the rows and groups the choices by expert as moe_ffn
 * does, so the slots of the experts of EP rank j are contiguous: they go
 * into block j of the dispatch. Every block has a size fixed by the batch
 * (ep_plan), so the all-to-all is sized on the host and no count is read
 * back inside the step: the per-expert counts of every row-group rank (one
 * all-gather) stay in backend memory, where they place the received rows
 * expert-major and give the load of the whole batch. Each local expert
 * runs once over the rows of all senders, the outputs go back into the
 * slots they came from (combine), and each row adds its experts in its
 * selection order, as on one rank. Rows outside [r0, r1) get no routed
 * part: the sum over the row group after the FFN (the TP all-reduce, or
 * ep_sum) completes them. */
static td_status moe_ffn_ep(td_engine *e, const td_layer_weights *lw, int li) {
    const int32_t T = e->n_tok;
    const int K = e->n_used, NE = e->n_expert, P = e->ep_size, NL = e->n_exp_loc;
    const size_t E = (size_t)e->n_embd, row = E * sizeof(float);
    const int32_t r0 = e->ep_dp ? 0 : (int32_t)((int64_t)T * e->rg_rank / e->rg_size);
    const int32_t r1 = e->ep_dp ? T : (int32_t)((int64_t)T * (e->rg_rank + 1) / e->rg_size);
    const int32_t nr = r1 - r0;
    td_status st;

    if (nr > 0) {
        const td_weight *wr[] = {&lw->router};
        td_bview yr[] = {BF(e->rl, (size_t)r0 * (size_t)NE)};
        size_t ldr[] = {(size_t)NE};
        matmul(e, wr, 1, BF(e->xn, (size_t)r0 * E), E, yr, ldr, nr);
        OP(e, moe_route)
        (e->be, BV(e->rl), BV(e->sel_id), BV(e->sel_w), r0, nr, NE, K, e->norm_topk);
    }
    td_bview mine = BI(e->ep_cnt, (size_t)e->rg_rank * (size_t)NE);
    OP(e, moe_group)
    (e->be, BV(e->sel_id), BV(e->sel_slot), BV(e->slot_row), BV(e->exp_off), mine, r0, r1, NE, K);
    int32_t n_slots = nr * K;
    OP(e, moe_gather)(e->be, BV(e->xg), BV(e->xn), BV(e->slot_row), n_slots, e->n_embd);
    const int32_t cap = e->ep_cap[e->ep_rank];
    OP(e, moe_ep_pack)
    (e->be, BV(e->ep_send), BV(e->xg), BV(e->exp_off), P, NL, cap, e->n_embd, true);

    if ((st = ENGINE_COMM(e, e->rg_comm, (size_t)NE * sizeof(int32_t),
                          td_comm_all_gather(e->rg_comm, CPTR(e, mine), CPTR(e, BV(e->ep_cnt)),
                                             (size_t)NE * sizeof(int32_t), CSTREAM(e)))))
        return st;
    OP(e, count_sum)
    (e->be, BI(e->load_cnt, (size_t)li * (size_t)NE), BV(e->ep_cnt), e->rg_size, NE);
    size_t *sb = e->a2a, *sd = sb + P, *rb = sd + P, *rd = rb + P;
    size_t n_recv = 0;
    for (int j = 0; j < P; j++) {
        sd[j] = (size_t)j * (size_t)cap * row;
        sb[j] = (size_t)cap * row;
        rd[j] = n_recv * row;
        rb[j] = (size_t)e->ep_cap[j] * row;
        n_recv += (size_t)e->ep_cap[j];
    }
    /* Dispatch: my blocks to the experts' ranks, theirs into ep_recv, then
     * expert-major into xg. */
    if ((st = ENGINE_COMM(e, e->p.ep_comm, (size_t)P * (size_t)cap * row,
                          td_comm_all_to_all_v(e->p.ep_comm, CPTR(e, BV(e->ep_send)), sb, sd,
                                               CPTR(e, BV(e->ep_recv)), rb, rd, CSTREAM(e)))))
        return st;
    td_backend_ep xp = {.blocks = BV(e->ep_recv),
                        .slots = BV(e->xg),
                        .counts = BI(e->ep_cnt, (size_t)e->ep_base * (size_t)NE),
                        .off = BV(e->ep_eoff),
                        .err = BI(e->load_cnt, e->load_err),
                        .cap = e->ep_cap,
                        .n_senders = P,
                        .n_local = NL,
                        .exp0 = e->exp0,
                        .n_expert = NE,
                        .n_embd = e->n_embd};
    OP(e, moe_ep_permute)(e->be, &xp, true);
    td_backend_experts x = {.experts = lw->experts,
                            .n = NL,
                            .id_base = e->exp0,
                            .off = BV(e->ep_eoff),
                            .xg = BV(e->xg),
                            .gg = BV(e->gg),
                            .ug = BV(e->ug),
                            .yg = BV(e->yg),
                            .n_slots = (int32_t)n_recv,
                            .n_embd = e->n_embd,
                            .n_ff = e->n_ff_exp};
    OP(e, moe_experts)(e->be, &x);
    /* Combine: the outputs back into the senders' blocks, to the ranks they
     * came from, and into the slots of this rank's choices. */
    xp.slots = BV(e->yg);
    OP(e, moe_ep_permute)(e->be, &xp, false);
    if ((st = ENGINE_COMM(e, e->p.ep_comm, n_recv * row,
                          td_comm_all_to_all_v(e->p.ep_comm, CPTR(e, BV(e->ep_recv)), rb, rd,
                                               CPTR(e, BV(e->ep_send)), sb, sd, CSTREAM(e)))))
        return st;
    OP(e, moe_ep_pack)
    (e->be, BV(e->ep_send), BV(e->yg), BV(e->exp_off), P, NL, cap, e->n_embd, false);

    /* The shared expert is split like a dense FFN over TP (every rank, every
     * row, a partial sum); with TP 1 each rank computes its own rows whole. */
    bool shared = e->n_ff > 0, tp = !e->ep_sum && !e->ep_dp;
    int32_t h0 = tp ? 0 : r0, hn = tp ? T : nr;
    if (shared && hn > 0) {
        size_t FS = (size_t)e->n_ff;
        const td_weight *wgu[] = {&lw->shexp_gate, &lw->shexp_up};
        td_bview ygu[] = {BF(e->g, (size_t)h0 * FS), BF(e->u, (size_t)h0 * FS)};
        size_t ldgu[] = {FS, FS};
        matmul(e, wgu, 2, BF(e->xn, (size_t)h0 * E), E, ygu, ldgu, hn);
        OP(e, swiglu)(e->be, ygu[0], ygu[1], hn, e->n_ff);
        const td_weight *wd[] = {&lw->shexp_down};
        td_bview yo[] = {BF(e->o, (size_t)h0 * E)};
        size_t ldo[] = {E};
        matmul(e, wd, 1, ygu[0], FS, yo, ldo, hn);
    }
    OP(e, moe_combine)
    (e->be, BV(e->o), BV(e->xn), BV(e->sel_w), BV(e->sel_slot), BV(e->yg), lw->shexp_inp, shared,
     r0, r1, tp, T, e->n_embd, K);
    return TD_OK;
}

/* ---------------------------------------------------- context parallelism */

/* Collectives over the CP group, counting the bytes this rank sends (an
 * all-gather sends its block to each of the other ranks). */
static td_status cp_all_gather(td_engine *e, const void *send, void *recv, size_t bytes) {
    e->timing.cp_bytes += bytes * (size_t)(e->cp_n - 1);
    return ENGINE_COMM(e, e->cp, bytes, td_comm_all_gather(e->cp, send, recv, bytes, CSTREAM(e)));
}

/* Every CP rank must run the same batch, or their collectives would pair
 * unrelated data. The ranks exchange a hash of the batch and the outcome of
 * their own checks; every rank then fails together (TD_ERR_INVALID) when
 * any rank refused the call or the batches differ. */
static td_status cp_agree(td_engine *e, const td_seq_chunk *seqs, int32_t n_seqs, td_status local) {
    uint64_t mine[2] = {0, (uint64_t)(int64_t)local}, all[2 * TD_COMM_MAX_RANKS];
    if (!local) {
        XXH3_state_t h;
        XXH3_64bits_reset(&h);
        XXH3_64bits_update(&h, &n_seqs, sizeof n_seqs);
        for (int32_t i = 0; i < n_seqs; i++) {
            const td_seq_chunk *s = &seqs[i];
            int32_t hdr[4] = {s->n_tokens, s->pos0,
                              (s->logits_all ? 1 : 0) | (s->no_logits ? 2 : 0),
                              (s->pos0 + s->n_tokens + e->cp_bs - 1) / e->cp_bs};
            XXH3_64bits_update(&h, hdr, sizeof hdr);
            XXH3_64bits_update(&h, s->tokens, (size_t)s->n_tokens * sizeof(int32_t));
            XXH3_64bits_update(&h, s->block_table, (size_t)hdr[3] * sizeof(int32_t));
        }
        mine[0] = XXH3_64bits_digest(&h);
    }
    td_status st = cp_all_gather(e, mine, all, sizeof mine);
    if (st) return st;
    for (int r = 0; r < e->cp_n; r++) {
        if (all[2 * r + 1] != 0) {
            if (!local) TD_LOG_ERROR("context-parallel rank %d refused the batch", r);
            return local ? local : TD_ERR_INVALID;
        }
    }
    for (int r = 0; r < e->cp_n; r++) {
        if (all[2 * r] != mine[0]) {
            TD_LOG_ERROR("context-parallel ranks %d and %d were given different batches", e->cp_r,
                         r);
            return TD_ERR_INVALID;
        }
    }
    return TD_OK;
}

/* This rank's rows of the (validated) batch, replacing the whole-batch rows:
 * every token of a DCP chunk, the tokens of its own blocks for a PCP chunk,
 * in batch order. Also each sequence's held blocks, and for the logits,
 * which rank computes each logit row: a DCP row is taken from rank 0, a
 * PCP row from its block's owner, whose rows rank 0 receives after its own
 * local rows (rank by rank, in batch order). *n_logit_p: logit rows on
 * rank 0, 0 on the others. Returns the positions attended by the rows. */
static int64_t cp_plan(td_engine *e, const td_seq_chunk *seqs, int32_t n_seqs, int32_t *n_logit_p) {
    const int C = e->cp_n, me = e->cp_r, bs = e->cp_bs;
    int32_t T = 0, n_logit = 0, n_dcp = 0;
    int64_t cost = 0, dcp_cost = 0;
    memset(e->cp_k, 0, sizeof e->cp_k);
    for (int32_t i = 0; i < n_seqs; i++) {
        const td_seq_chunk *s = &seqs[i];
        bool split = cp_is_split(e, s);
        e->cp_split[i] = split;
        e->cp_row0[i] = T;
        int32_t nb = (s->pos0 + s->n_tokens + bs - 1) / bs;
        int32_t *lt = e->cp_ltab + (size_t)i * (size_t)e->cp_maxb;
        for (int32_t j = me, x = 0; j < nb; j += C) lt[x++] = s->block_table[j];
        for (int32_t j = 0; j < s->n_tokens; j++) {
            int32_t p = s->pos0 + j;
            int o = (p / bs) % C;
            bool mine = !split || o == me;
            if (!s->no_logits && (s->logits_all || j == s->n_tokens - 1)) {
                if (!split || o == 0) {
                    if (me == 0) {
                        e->cp_lsrc[n_logit] = 0;
                        e->logit_tok[n_logit++] = T;
                    }
                } else {
                    if (me == 0) {
                        e->cp_lsrc[n_logit] = o;
                        e->logit_tok[n_logit++] = e->cp_k[o];
                    } else if (o == me) {
                        e->cp_send_row[e->cp_k[o]] = T;
                    }
                    e->cp_k[o]++;
                }
            }
            if (!mine) continue;
            e->tok_seq[T] = i;
            e->tok_pos[T] = p;
            cost += p + 1;
            if (!split) {
                e->cp_dcp_row[n_dcp++] = T;
                dcp_cost += p + 1;
            }
            T++;
        }
        e->cp_nrow[i] = T - e->cp_row0[i];
    }
    if (me == 0) { /* rows from rank r land after the local rows and ranks 1..r-1 */
        int32_t off[TD_COMM_MAX_RANKS];
        off[1] = T;
        for (int r = 2; r < C; r++) off[r] = off[r - 1] + e->cp_k[r - 1];
        for (int32_t i = 0; i < n_logit; i++)
            if (e->cp_lsrc[i] > 0) e->logit_tok[i] += off[e->cp_lsrc[i]];
    }
    e->n_tok = T;
    e->n_dcp = n_dcp;
    e->cp_dcp_cost = dcp_cost;
    e->cp_n_seqs = n_seqs;
    *n_logit_p = n_logit;
    return cost;
}

/* An attention step of this rank's CP rows (kinds: backend.h). */
static void cp_attn(td_engine *e, td_cp_attn_kind kind, const td_backend_kv *kv,
                    const int32_t *table, int offset, int32_t row0, int32_t n_items, int64_t cost) {
    td_backend_cp_attn a = {.kind = kind,
                            .kv = *kv,
                            .table = table,
                            .offset = offset,
                            .row0 = row0,
                            .n_items = n_items,
                            .cost = cost,
                            .q = BV(e->q),
                            .att = BV(e->att),
                            .part = BV(e->cp_part),
                            .ms = BV(e->cp_ms),
                            .nh = e->nh,
                            .nkv = e->nkv,
                            .head_dim = e->head_dim,
                            .scale = e->attn_scale};
    OP(e, attn_cp)(e->be, &a);
}

/* Blocks of [0, end) that CP rank r holds. */
static int32_t cp_held(const td_engine *e, int32_t end, int r) {
    int32_t nb = (end + e->cp_bs - 1) / e->cp_bs;
    return nb > r ? (nb - r + e->cp_n - 1) / e->cp_n : 0;
}

/* PCP, allgather mode: every rank gathers the whole context [0, end) of the
 * sequence (each rank's blocks, padded to the same count) and attends over
 * it in position order with the single-rank kernel, so the attention of a
 * row is bit-identical to the single-rank engine's. */
static td_status cp_pcp_allgather(td_engine *e, const td_backend_kv *own, int32_t seq) {
    const td_seq_chunk *s = &e->seqs[seq];
    const int C = e->cp_n;
    const int32_t end = s->pos0 + s->n_tokens, nb = (end + e->cp_bs - 1) / e->cp_bs;
    const int32_t maxb = cp_held(e, end, 0);
    /* blk, chunk: bytes */
    const size_t blk = (size_t)e->cp_bs * (size_t)e->kv_dim * e->kv_lay.elem_bytes,
                 chunk = 2 * (size_t)maxb * blk;
    td_bview mine = td_bview_bytes(BV(e->cp_kv), (size_t)e->cp_r * chunk);
    OP(e, kv_pack)(e->be, own, seq, end, mine, maxb);
    td_status st = cp_all_gather(e, CPTR(e, mine), CPTR(e, BV(e->cp_kv)), chunk);
    if (st) return st;
    for (int32_t j = 0; j < nb; j++) e->cp_gtab[j] = (j % C) * 2 * maxb + j / C;
    td_backend_kv all = {.k = BV(e->cp_kv),
                         .v = td_bview_bytes(BV(e->cp_kv), (size_t)maxb * blk),
                         .dtype = e->kv_lay.dtype,
                         .block_size = e->cp_bs,
                         .n_kv_heads = e->nkv,
                         .head_dim = e->head_dim};
    cp_attn(e, TD_CP_ATTN_PCP_FULL, &all, e->cp_gtab, 0, e->cp_row0[seq], e->cp_nrow[seq],
            (int64_t)e->cp_nrow[seq] * end);
    return TD_OK;
}

/* PCP, ring mode: each rank starts with the partial over its own blocks;
 * then the ranks' K/V chunks travel around the ring (to rank + 1, from
 * rank - 1) for cp - 1 steps, and each chunk that arrives adds its partial
 * by the online-softmax merge. Sends are rendezvous: even ranks send first
 * and odd ranks receive first, so every send meets a posted receive. */
static td_status cp_pcp_ring(td_engine *e, const td_backend_kv *own, int32_t seq) {
    const td_seq_chunk *s = &e->seqs[seq];
    const int C = e->cp_n, me = e->cp_r, next = (me + 1) % C, prev = (me + C - 1) % C;
    const int32_t end = s->pos0 + s->n_tokens;
    const size_t blk = (size_t)e->cp_bs * (size_t)e->kv_dim * e->kv_lay.elem_bytes; /* bytes */
    td_bview buf[2] = {BV(e->cp_kv), td_bview_bytes(BV(e->cp_kv), 2 * (size_t)e->cp_maxb * blk)};
    const int32_t row0 = e->cp_row0[seq], n_items = e->cp_nrow[seq];
    const int64_t cost = (int64_t)n_items * end / C;
    cp_attn(e, TD_CP_ATTN_PCP_OWN, own, NULL, 0, row0, n_items, cost);
    int32_t held = cp_held(e, end, me);
    OP(e, kv_pack)(e->be, own, seq, end, buf[0], held);
    for (int32_t x = 0; x < e->cp_maxb; x++) e->cp_gtab[x] = x;
    for (int step = 1; step < C; step++) {
        int origin = (me - step + C) % C;
        int32_t in_held = cp_held(e, end, origin);
        size_t out_bytes = 2 * (size_t)held * blk;
        size_t in_bytes = 2 * (size_t)in_held * blk;
        td_status st;
        if (me % 2 == 0) {
            if ((st = ENGINE_COMM(
                     e, e->cp, out_bytes,
                     td_comm_send(e->cp, CPTR(e, buf[0]), out_bytes, next, CSTREAM(e)))) ||
                (st =
                     ENGINE_COMM(e, e->cp, 0,
                                 td_comm_recv(e->cp, CPTR(e, buf[1]), in_bytes, prev, CSTREAM(e)))))
                return st;
        } else {
            if ((st = ENGINE_COMM(
                     e, e->cp, 0,
                     td_comm_recv(e->cp, CPTR(e, buf[1]), in_bytes, prev, CSTREAM(e)))) ||
                (st = ENGINE_COMM(
                     e, e->cp, out_bytes,
                     td_comm_send(e->cp, CPTR(e, buf[0]), out_bytes, next, CSTREAM(e)))))
                return st;
        }
        e->timing.cp_bytes += out_bytes;
        if (in_held > 0) {
            td_backend_kv in = *own;
            in.k = buf[1];
            in.v = td_bview_bytes(buf[1], (size_t)in_held * blk);
            cp_attn(e, TD_CP_ATTN_PCP_MERGE, &in, e->cp_gtab, origin, row0, n_items, cost);
        }
        td_bview tmp = buf[0];
        buf[0] = buf[1];
        buf[1] = tmp;
        held = in_held;
    }
    return TD_OK;
}

/* Attention of this rank's rows for one layer (own: this rank's cache
 * layer, where the rows' K/V were just written on their blocks' owners). */
static td_status cp_attention(td_engine *e, const td_backend_kv *own) {
    td_status st;
    if (e->n_dcp > 0) {
        /* DCP: partials over each rank's positions, gathered and merged in
         * rank order (on the backend), so every rank gets the same bits. */
        cp_attn(e, TD_CP_ATTN_DCP_PART, own, NULL, 0, 0, e->n_dcp, e->cp_dcp_cost / e->cp_n);
        size_t bytes = (size_t)e->n_dcp * (size_t)e->nh * ((size_t)e->head_dim + 2) * sizeof(float);
        if ((st = cp_all_gather(e, CPTR(e, td_bview_bytes(BV(e->cp_part), (size_t)e->cp_r * bytes)),
                                CPTR(e, BV(e->cp_part)), bytes)))
            return st;
        cp_attn(e, TD_CP_ATTN_DCP_MERGE, own, NULL, 0, 0, e->n_dcp,
                e->n_dcp * (int64_t)e->cp_n * 8);
    }
    for (int32_t i = 0; i < e->cp_n_seqs; i++) {
        if (!e->cp_split[i]) continue;
        st = e->p.cp_mode == TD_CP_RING ? cp_pcp_ring(e, own, i) : cp_pcp_allgather(e, own, i);
        if (st) return st;
    }
    return TD_OK;
}

/* Rank 0 receives the final hidden state of the logit rows other ranks
 * computed (PCP rows), after its own rows in x, as cp_plan laid out. */
static td_status cp_gather_logit_rows(td_engine *e) {
    const int C = e->cp_n, me = e->cp_r;
    const size_t row = (size_t)e->n_embd * sizeof(float);
    size_t sb[TD_COMM_MAX_RANKS] = {0}, sd[TD_COMM_MAX_RANKS] = {0};
    size_t rb[TD_COMM_MAX_RANKS] = {0}, rd[TD_COMM_MAX_RANKS] = {0};
    int32_t total = 0;
    for (int r = 1; r < C; r++) total += e->cp_k[r];
    if (total == 0) return TD_OK;
    if (me == 0) {
        size_t off = (size_t)e->n_tok * row;
        for (int r = 1; r < C; r++) {
            rb[r] = (size_t)e->cp_k[r] * row;
            rd[r] = off;
            off += rb[r];
        }
    } else {
        OP(e, copy_rows)(e->be, BV(e->xn), BV(e->x), e->cp_send_row, e->cp_k[me], row);
        sb[0] = (size_t)e->cp_k[me] * row;
        e->timing.cp_bytes += sb[0];
    }
    return ENGINE_COMM(e, e->cp, sb[0],
                       td_comm_all_to_all_v(e->cp, CPTR(e, BV(e->xn)), sb, sd, CPTR(e, BV(e->x)),
                                            rb, rd, CSTREAM(e)));
}

/* ---------------------------------------------------------------- forward */

/* Layer l's K (v false) or V region of the KV storage. */
static td_bview kv_view(const td_engine *e, int l, bool v) {
    return td_bview_bytes(BV(e->kvb), ((size_t)l * 2u + v) * e->kv_lay.layer_bytes);
}

static bool kv_holds_data(const td_engine *e) {
    td_kv_counts c;
    td_kv_pool_counts(e->kv, &c);
    return c.used > 0 || c.cached > 0;
}

td_status td_engine_kv_place(td_engine *e, const td_kv_mem_hook *hook) {
    if (!e) return TD_ERR_INVALID;
    if (kv_holds_data(e)) {
        TD_LOG_ERROR("KV storage can move only while the pool holds no data");
        return TD_ERR_INVALID;
    }
    td_bbuf *b = OP(e, kv_alloc)(e->be, &e->kv_lay, hook);
    if (!b) return TD_ERR_NOMEM; /* the old storage stays */
    td_backend_free(e->be, e->kvb);
    e->kvb = b;
    return TD_OK;
}

void td_engine_kv_release(td_engine *e) {
    if (!e) return;
    td_backend_free(e->be, e->kvb);
    e->kvb = NULL;
}

td_status td_engine_kv_storage(td_engine *e, td_kv_storage *out) {
    if (!e || !out || !e->kvb) return TD_ERR_INVALID;
    out->layout = e->kv_lay;
    out->base = OP(e, addr)(e->be, BV(e->kvb));
    return TD_OK;
}

/* The per-expert counts of the step come back once, at its end, with the
 * flag the EP exchange raises when the ranks were given different batches. */
static td_status expert_load_done(td_engine *e, int n_layers) {
    const size_t n = (size_t)n_layers * (size_t)e->n_expert;
    const bool ep = e->ep_size > 1;
    OP(e, copy_to_host)(e->be, e->load_h, BV(e->load_cnt), (n + ep) * sizeof(int32_t));
    for (size_t i = 0; i < n; i++) e->load_last[i] = e->load_h[i];
    if (ep && e->load_h[e->load_err]) {
        TD_LOG_ERROR("expert parallelism: an EP rank sent more rows than its block holds: the EP "
                     "group's ranks ran different batches");
        return TD_ERR_INVALID;
    }
    return TD_OK;
}

/* The final norm of the logit rows of x (the first n_logit rows, or those
 * of the batch's logit_src) into xn. */
static void final_norm(td_engine *e, int32_t n_logit, bool logit_rows) {
    OP(e, rmsnorm)
    (e->be, BV(e->x), (td_bview){0}, BV(e->xn), n_logit, logit_rows, td_model_output_norm(e->m),
     e->n_embd, e->eps);
}

/* The final norm and the head, into logits (host), a group of rows at a
 * time: each logit is one dot product whatever the group. */
static void head_local(td_engine *e, int32_t n_logit, bool logit_rows, float *logits) {
    const size_t E = (size_t)e->n_embd, V = (size_t)e->n_vocab;
    final_norm(e, n_logit, logit_rows);
    const td_weight *wh[] = {td_model_output(e->m)};
    for (int32_t i0 = 0; i0 < n_logit; i0 += e->head_out_rows) {
        int32_t g = TD_MIN(e->head_out_rows, n_logit - i0);
        td_bview yh[] = {BV(e->lg)};
        size_t ldh[] = {V};
        matmul(e, wh, 1, BF(e->xn, (size_t)i0 * E), E, yh, ldh, g);
        OP(e, copy_to_host)
        (e->be, logits + (size_t)i0 * V, BV(e->lg), (size_t)g * V * sizeof(float));
    }
}

static int32_t seq_logit_rows(const td_seq_chunk *s) {
    return s->no_logits ? 0 : s->logits_all ? s->n_tokens : 1;
}

/* Attention-DP, last stage: the hidden states of every rank's logit rows go
 * to EP rank 0 (one all-to-all), which runs the final norm and the head
 * over the whole batch's rows in the order of seqs. */
static td_status ep_logits(td_engine *e, const td_seq_chunk *seqs, int32_t n_seqs, int32_t n_logit,
                           float *logits) {
    const int P = e->ep_size;
    const size_t E = (size_t)e->n_embd, row = E * sizeof(float);
    OP(e, copy_rows)(e->be, BV(e->xn), BV(e->x), e->logit_tok, n_logit, row);
    size_t *sb = e->a2a, *sd = sb + P, *rb = sd + P, *rd = rb + P;
    size_t n_all = 0;
    for (int k = 0; k < P; k++) {
        size_t n = 0;
        for (int32_t i = 0; i < n_seqs; i++)
            if (seq_owner(e, &seqs[i]) == k) n += (size_t)seq_logit_rows(&seqs[i]);
        sb[k] = k == 0 ? (size_t)n_logit * row : 0;
        sd[k] = 0;
        rb[k] = e->ep_rank == 0 ? n * row : 0;
        rd[k] = n_all * row;
        n_all += n;
    }
    td_status st = ENGINE_COMM(e, e->p.ep_comm, sb[0],
                               td_comm_all_to_all_v(e->p.ep_comm, CPTR(e, BV(e->xn)), sb, sd,
                                                    CPTR(e, BV(e->o)), rb, rd, CSTREAM(e)));
    if (st || e->ep_rank != 0 || n_all == 0) return st;
    /* Sender-major (each sender's rows in its sequences' order) to the
     * order of seqs; rd becomes each sender's read cursor, in rows. */
    for (int k = 0; k < P; k++) rd[k] /= row;
    size_t out = 0;
    for (int32_t i = 0; i < n_seqs; i++) {
        size_t n = (size_t)seq_logit_rows(&seqs[i]);
        int k = seq_owner(e, &seqs[i]);
        OP(e, copy)(e->be, BF(e->x, out * E), BF(e->o, rd[k] * E), n * row);
        rd[k] += n;
        out += n;
    }
    head_local(e, (int32_t)n_all, false, logits);
    return TD_OK;
}

static td_status validate(const td_engine *e, const td_seq_chunk *seqs, int32_t n_seqs) {
    if (n_seqs < 1 || n_seqs > e->p.max_seqs || !seqs) {
        TD_LOG_ERROR("batch of %d sequences (limit %d)", n_seqs, e->p.max_seqs);
        return TD_ERR_INVALID;
    }
    const td_kv_params *kp = td_kv_pool_params(e->kv);
    int64_t total = 0;
    for (int32_t i = 0; i < n_seqs; i++) {
        const td_seq_chunk *s = &seqs[i];
        if (s->n_tokens < 1 || !s->tokens || s->pos0 < 0 || !s->block_table || s->n_blocks < 0) {
            TD_LOG_ERROR("sequence %d: bad chunk (%d tokens at position %d)", i, s->n_tokens,
                         s->pos0);
            return TD_ERR_INVALID;
        }
        int64_t end = (int64_t)s->pos0 + s->n_tokens;
        if (end > e->p.max_ctx) {
            TD_LOG_ERROR("sequence %d: position %lld past the context limit %d", i,
                         (long long)end - 1, e->p.max_ctx);
            return TD_ERR_INVALID;
        }
        if ((int64_t)s->n_blocks * kp->block_size < end) {
            TD_LOG_ERROR("sequence %d: %d blocks do not cover %lld positions", i, s->n_blocks,
                         (long long)end);
            return TD_ERR_INVALID;
        }
        int64_t nb = (end + kp->block_size - 1) / kp->block_size;
        for (int64_t b = 0; b < nb; b++) {
            if (s->block_table[b] < 0 || s->block_table[b] >= kp->n_blocks) {
                TD_LOG_ERROR("sequence %d: block id %d out of range", i, s->block_table[b]);
                return TD_ERR_INVALID;
            }
        }
        for (int32_t j = 0; j < s->n_tokens; j++) {
            if (s->tokens[j] < 0 || s->tokens[j] >= e->n_vocab) {
                TD_LOG_ERROR("sequence %d: token id %d out of the vocabulary (%d)", i, s->tokens[j],
                             e->n_vocab);
                return TD_ERR_INVALID;
            }
        }
        total += s->n_tokens;
    }
    if (total > e->p.max_batch_tokens) {
        TD_LOG_ERROR("batch of %lld tokens (limit %d)", (long long)total, e->p.max_batch_tokens);
        return TD_ERR_INVALID;
    }
    return TD_OK;
}

td_status td_engine_validate(const td_engine *e, const td_seq_chunk *seqs, int32_t n_seqs) {
    return validate(e, seqs, n_seqs);
}

td_status td_engine_forward(td_engine *e, const td_seq_chunk *seqs, int32_t n_seqs, float *logits) {
    return td_engine_forward_stage(e, seqs, n_seqs, NULL, NULL, logits);
}

/* Vocab-parallel head: this rank's logits of each group of rows straight
 * into its block of head_buf, one all-gather, then every rank's block to
 * its columns of the group's logits, copied out. Each logit is one dot
 * product, as with one rank. */
static td_status head_vocab_parallel(td_engine *e, int32_t n_logit, float *logits) {
    const size_t E = (size_t)e->n_embd, W = (size_t)e->vocab_per_rank, V = (size_t)e->n_vocab;
    final_norm(e, n_logit, true);
    const td_weight *wh[] = {td_model_output(e->m)};
    const int rank = td_comm_rank(e->comm);
    for (int32_t i0 = 0; i0 < n_logit; i0 += e->head_rows) {
        int32_t g = TD_MIN(e->head_rows, n_logit - i0);
        size_t blk = (size_t)g * W;
        td_bview yh[] = {BF(e->head_buf, (size_t)rank * blk)};
        size_t ldh[] = {W};
        matmul(e, wh, 1, BF(e->xn, (size_t)i0 * E), E, yh, ldh, g);
        td_status st =
            ENGINE_COMM(e, e->comm, blk * sizeof(float),
                        td_comm_all_gather(e->comm, CPTR(e, yh[0]), CPTR(e, BV(e->head_buf)),
                                           blk * sizeof(float), CSTREAM(e)));
        if (st) return st;
        /* g <= head_rows <= head_out_rows: the group fits in lg */
        OP(e, head_place)
        (e->be, BV(e->lg), BV(e->head_buf), g, e->vocab_per_rank, e->n_vocab, e->vocab_tp);
        OP(e, copy_to_host)
        (e->be, logits + (size_t)i0 * V, BV(e->lg), (size_t)g * V * sizeof(float));
    }
    return TD_OK;
}

static td_status forward_stage_run(td_engine *e, const td_seq_chunk *seqs, int32_t n_seqs,
                                   const float *x_in, float *x_out, float *logits);

td_status td_engine_forward_stage(td_engine *e, const td_seq_chunk *seqs, int32_t n_seqs,
                                  const float *x_in, float *x_out, float *logits) {
    uint64_t t0 = td_time_ns();
    memset(&e->timing, 0, sizeof e->timing);
    e->comm_ns = 0;
    td_status st = forward_stage_run(e, seqs, n_seqs, x_in, x_out, logits);
    td_status bst = OP(e, status)(e->be); /* an op's failure, which it cannot return */
    if (!st && bst) {
        TD_LOG_ERROR("backend %s: an op of this step failed", e->be->i->name);
        st = bst;
    }
    uint64_t total = td_time_ns() - t0;
    e->timing.comm_s = (double)e->comm_ns * 1e-9;
    e->timing.compute_s = (double)(total - TD_MIN(total, e->comm_ns)) * 1e-9;
    return st;
}

td_engine_timing td_engine_last_timing(const td_engine *e) { return e->timing; }

void td_engine_set_layer_hook(td_engine *e, void (*fn)(void *ctx, int32_t layer), void *ctx) {
    e->p.layer_done = fn;
    e->p.layer_done_ctx = ctx;
}

static td_status forward_stage_run(td_engine *e, const td_seq_chunk *seqs, int32_t n_seqs,
                                   const float *x_in, float *x_out, float *logits) {
    const td_model *m = e->m;
    bool first = td_model_tok_embd(m) != NULL, last = td_model_output(m) != NULL;
    td_status st = TD_OK;
    if (first == (x_in != NULL) || last == (x_out != NULL)) {
        TD_LOG_ERROR("stage [%d, %d): hidden-state input %s and output %s do not match the stage",
                     td_model_layer_begin(m), td_model_layer_end(m), x_in ? "given" : "missing",
                     x_out ? "given" : "missing");
        st = TD_ERR_INVALID;
    }
    if (!st) st = validate(e, seqs, n_seqs);
    /* with CP, the logits are written on CP rank 0 only; with attention-DP
     * on EP rank 0 only */
    int32_t n_out = !st && last && e->cp_r == 0 && !(e->ep_dp && e->ep_rank != 0)
                        ? td_engine_n_logit_rows(seqs, n_seqs)
                        : 0;
    if (n_out > 0 && !logits) {
        TD_LOG_ERROR("batch produces %d logit rows but no logits buffer was given", n_out);
        st = TD_ERR_INVALID;
    }
    if (e->cp_n > 1) st = cp_agree(e, seqs, n_seqs, st); /* the CP ranks fail together */
    if (st) return st;
    e->seqs = seqs;
    int32_t T = 0, n_logit = 0;
    int64_t attn_cost = 0; /* positions attended, summed over rows */
    for (int32_t i = 0; i < n_seqs; i++) {
        const td_seq_chunk *s = &seqs[i];
        e->seq_tab[i] = s->block_table;
        e->seq_nb[i] = s->n_blocks;
        if (!seq_mine(e, s)) continue;
        for (int32_t j = 0; j < s->n_tokens; j++, T++) {
            e->tok_seq[T] = i;
            e->tok_pos[T] = s->pos0 + j;
            attn_cost += s->pos0 + j + 1;
            if (!s->no_logits && (s->logits_all || j == s->n_tokens - 1))
                e->logit_tok[n_logit++] = T;
        }
    }
    e->n_tok = T;
    if (e->cp_n > 1) { /* CP: this rank's rows replace the batch's */
        attn_cost = cp_plan(e, seqs, n_seqs, &n_logit);
        T = e->n_tok;
    }
    for (int32_t r = 0; r < T; r++) {
        const td_seq_chunk *s = &seqs[e->tok_seq[r]];
        e->tok_id[r] = s->tokens[e->tok_pos[r] - s->pos0];
    }
    td_backend_batch batch = {.n_rows = T,
                              .row_seq = e->tok_seq,
                              .row_pos = e->tok_pos,
                              .row_tok = e->tok_id,
                              .logit_src = e->logit_tok,
                              .n_seqs = n_seqs,
                              .seq_table = e->seq_tab,
                              .seq_n_blocks = e->seq_nb,
                              .cp_n = e->cp_n,
                              .cp_r = e->cp_r,
                              .cp_maxb = e->cp_maxb,
                              .cp_ltab = e->cp_ltab,
                              .cp_dcp_row = e->cp_dcp_row,
                              .n_dcp = e->n_dcp};
    OP(e, set_batch)(e->be, &batch);
    if (!e->kvb) {
        TD_LOG_ERROR("the engine's KV storage was released");
        return TD_ERR_INVALID;
    }
    if (e->ep_size > 1) {
        ep_plan(e, seqs, n_seqs);
        const int32_t zero = 0;
        OP(e, copy_from_host)(e->be, BI(e->load_cnt, e->load_err), &zero, sizeof zero);
    }
    const size_t E = (size_t)e->n_embd;

    if (first) {
        OP(e, embed)(e->be, td_model_tok_embd(m), e->vocab_begin, e->vocab_end, BV(e->x));
        if (e->vocab_tp > 1 && (st = all_reduce(e, e->comm, BV(e->x), (size_t)T * E))) return st;
    } else {
        OP(e, copy_from_host)(e->be, BV(e->x), x_in, (size_t)T * E * sizeof(float));
    }

    int lb = td_model_layer_begin(m), le = td_model_layer_end(m);
    const td_kv_params *kp = td_kv_pool_params(e->kv);
    for (int l = lb; l < le; l++) {
        const td_layer_weights *lw = td_model_layer(m, l);

        /* attention block */
        const td_weight *wqkv[] = {&lw->wq, &lw->wk, &lw->wv};
        OP(e, rmsnorm)
        (e->be, BV(e->x), l > lb ? BV(e->o) : (td_bview){0}, BV(e->xn), T, false, lw->attn_norm,
         e->n_embd, e->eps);
        td_bview y3[] = {BV(e->q), BV(e->k), BV(e->v)};
        size_t ld3[] = {(size_t)e->q_dim, (size_t)e->kv_dim, (size_t)e->kv_dim};
        matmul(e, wqkv, 3, BV(e->xn), E, y3, ld3, T);

        td_backend_kv kvl = {.k = kv_view(e, l - lb, false),
                             .v = kv_view(e, l - lb, true),
                             .dtype = e->kv_lay.dtype,
                             .block_size = kp->block_size,
                             .n_kv_heads = e->nkv,
                             .head_dim = e->head_dim};
        OP(e, rope_store)
        (e->be, BV(e->q), BV(e->k), BV(e->v), lw->bq, lw->bk, lw->bv, &e->rope, &kvl);
        if (e->cp_n > 1) {
            if ((st = cp_attention(e, &kvl))) return st;
        } else {
            OP(e, attn)(e->be, BV(e->q), BV(e->att), &kvl, e->nh, e->attn_scale, attn_cost);
        }
        if (e->p.layer_done) { /* the hook reads the layer's K/V: written by now */
            OP(e, sync)(e->be);
            e->p.layer_done(e->p.layer_done_ctx, l - lb);
        }

        const td_weight *wo[] = {&lw->wo};
        td_bview yo[] = {BV(e->o)};
        size_t ldo[] = {E};
        matmul(e, wo, 1, BV(e->att), (size_t)e->q_dim, yo, ldo, T);
        if ((st = all_reduce(e, e->comm, BV(e->o), (size_t)T * E))) return st;

        /* MLP block */
        OP(e, rmsnorm)
        (e->be, BV(e->x), BV(e->o), BV(e->xn), T, false, lw->ffn_norm, e->n_embd, e->eps);
        if (e->ep_size > 1) {
            if ((st = moe_ffn_ep(e, lw, l - lb))) return st;
        } else if (e->n_expert > 0) {
            moe_ffn(e, lw, l - lb);
        } else {
            const td_weight *wgu[] = {&lw->w_gate, &lw->w_up};
            td_bview ygu[] = {BV(e->g), BV(e->u)};
            size_t ldgu[] = {(size_t)e->n_ff, (size_t)e->n_ff};
            matmul(e, wgu, 2, BV(e->xn), E, ygu, ldgu, T);

            const td_weight *wd[] = {&lw->w_down};
            OP(e, swiglu)(e->be, BV(e->g), BV(e->u), T, e->n_ff);
            matmul(e, wd, 1, BV(e->g), (size_t)e->n_ff, yo, ldo, T);
        }
        if ((st = all_reduce(e, e->comm, BV(e->o), (size_t)T * E))) return st;
        if (e->ep_sum && (st = all_reduce(e, e->p.ep_comm, BV(e->o), (size_t)T * E))) return st;
    }

    /* last residual for every row, then norm + head only for the logit rows */
    OP(e, add)(e->be, BV(e->x), BV(e->o), T, e->n_embd);
    /* A bad exchange is reported after the step's collectives, which every
     * rank of the group runs whatever it found. */
    td_status load_st = e->n_expert > 0 ? expert_load_done(e, le - lb) : TD_OK;
    if (!last) {
        OP(e, copy_to_host)(e->be, x_out, BV(e->x), (size_t)T * E * sizeof(float));
        return load_st;
    }
    if (e->cp_n > 1 && (st = cp_gather_logit_rows(e))) return st;
    if (e->ep_dp)
        st = ep_logits(e, seqs, n_seqs, n_logit, logits);
    else if (n_logit > 0 && e->vocab_tp > 1)
        st = head_vocab_parallel(e, n_logit, logits);
    else if (n_logit > 0)
        head_local(e, n_logit, true, logits);
    return st ? st : load_st;
}

_Static_assert(TD_BACKEND_MAX_CP_RANKS >= TD_COMM_MAX_RANKS, "a CP group merges in one call");
