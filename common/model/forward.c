/* The forward pass over a batch of sequence chunks.
 *
 * All tokens of all chunks are rows of one activation matrix, so every
 * weight matrix is streamed once per call. Each step is per token row (norm,
 * bias, RoPE, KV write, SwiGLU), per (row, output row) dot product (matmul,
 * shared out in tiles of output rows), or per (token, head)
 * (attention, reading K/V back from the paged cache). None of them splits a
 * reduction across threads or depends on which other rows are present, so
 * a row's values are the same whatever the batch, chunking or thread count:
 * that is the invariance contract of forward.h. Rows are handed to threads
 * only to share work; small row counts run on the calling thread, which
 * computes exactly the same values. MoE layers keep the contract: routing
 * is per row, grouping tokens by expert only decides which rows share an
 * expert's matmul call (never a row's value), and each row adds its
 * experts' outputs in its own selection order.
 *
 * Activations stay f32 for every matmul: quantized weights are dequantized
 * on the fly (td_cpu_matmul_f32act), so the only error against a float64
 * forward pass on the dequantized weights is f32 rounding. Quantizing the
 * activations to 8 bits as well (llama.cpp's scheme) flipped the greedy
 * answer of the default Q4_1 model on a 0.08-logit margin. */
#include "forward.h"

#include <math.h>
#include <stdatomic.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#include "../parallel/plan.h"
#include "kernels/cpu/attn-cp.h"
#include "kernels/cpu/qmatmul.h"

#define N_MM         3  /* most weights sharing one input in a matmul step */
#define ROW_TILE     16 /* matmul output rows are split between threads in tiles */
#define ROW_TILE_FEW 64 /* the same for fewer than MIN_PAR_ROWS token rows (decode) */
#define MIN_PAR_ROWS 4  /* fewer token rows than this: elementwise steps run inline */
#define ROW_CHUNK    4  /* token rows claimed at a time by elementwise steps */
/* Vocab-parallel head: most logits all-gathered at a time (bounds its scratch). */
#define HEAD_GATHER_FLOATS (1 << 21)

struct td_engine {
    const td_model *m;
    td_kv_pool *kv;
    td_threadpool *tp;
    td_comm *comm;
    td_engine_params p;
    int nth;
    int n_embd, head_dim, n_rot, nh, nkv, q_dim, kv_dim, n_ff;
    int32_t n_vocab;
    float eps, attn_scale;
    td_rope_mode rope_mode;
    const float *inv_freq;

    /* scratch, T = max_batch_tokens */
    float *x;     /* (T, n_embd) residual stream */
    float *xn;    /* (T, n_embd) normed rows */
    float *q;     /* (T, q_dim) */
    float *k, *v; /* (T, kv_dim) */
    float *att;   /* (T, q_dim) attention output */
    float *o;     /* (T, n_embd) wo / w_down output */
    float *g, *u; /* (T, n_ff) local MLP width (the shared expert's for MoE) */
    /* MoE scratch (n_expert > 0), K = n_expert_used */
    int n_expert, n_used, n_ff_exp;
    bool norm_topk;
    float *rl;           /* (T, n_expert) router logits */
    int32_t *sel_id;     /* (T, K) chosen experts, by descending probability */
    float *sel_w;        /* (T, K) their weights */
    int32_t *sel_slot;   /* (T, K) grouped slot holding each choice */
    int32_t *slot_row;   /* (T * K) token row of each slot, slots grouped by expert */
    int32_t *exp_off;    /* (n_expert + 1) first slot of each expert */
    float *xg;           /* (T * K, n_embd) token rows gathered per expert */
    float *gg, *ug;      /* (T * K, n_ff_exp) local expert width */
    float *yg;           /* (T * K, n_embd) expert outputs */
    float *attn_scratch; /* (nth, max_ctx) */
    int32_t *tok_seq;    /* (T) sequence of each row */
    int32_t *tok_pos;    /* (T) position of each row */
    int32_t *logit_tok;  /* (T) row feeding each logit row */
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
    int32_t *ep_cnt;               /* (rg_size, n_expert) choices per expert of each rank's rows */
    size_t *a2a;                   /* (4, ep_size) send bytes, displs, recv bytes, displs */
    int32_t *ep_eoff;              /* (n_exp_loc + 1) first received row of each local expert */
    int64_t *load_cur, *load_last; /* (local layers, n_expert) choices per expert */
    const td_seq_chunk *seqs;
    int32_t n_tok;
    _Atomic int64_t work_next; /* next unclaimed work item of the running step */
    /* vocab-parallel embedding and head (model tp_size > 1): rows of other
     * ranks' tokens are zeros, summed over comm; logits all-gathered */
    int vocab_tp;                   /* ranks sharing the vocabulary (the model's tp_size) */
    int32_t vocab_begin, vocab_end; /* this rank's tokens */
    int32_t vocab_per_rank;         /* ceil(n_vocab / vocab_tp): every rank's block width */
    int32_t head_rows;              /* logit rows per all-gather */
    float *head_buf;                /* (vocab_tp, head_rows, vocab_per_rank) or NULL (tp 1) */
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
    float *cp_part; /* (cp_n, T, nh, head_dim + 2) DCP partials: out, max, exp-sum */
    float *cp_kv;   /* allgather: (cp_n, 2, B, blk) K then V of each rank; ring: two
                     * (2, B, blk) chunk buffers */
    float *cp_ms;   /* (T, nh, 2) ring: running max and exp-sum of each query */
    float *cp_tmp;  /* (nth, head_dim) one partial's output per thread */
};

/* Every td_comm_* call of the forward pass goes through ENGINE_COMM, which
 * charges its wall time (waiting for peers included) to comm_s of
 * td_engine_timing, counts it and adds bytes (the payload this rank hands
 * over) to comm_bytes; calls on a communicator of one rank are not timed
 * (they are no-ops). It evaluates to the call's td_status:
 *   if ((st = ENGINE_COMM(e, e->comm, n * sizeof(float),
 *                         td_comm_all_reduce_sum(e->comm, buf, n))))
 *       return st;
 * The comma operator times exactly the call: the clock starts before it is
 * evaluated and stops after. */
#define ENGINE_COMM(e, comm, bytes, call)                                                          \
    (engine_comm_start((e), (comm)), engine_comm_stop((e), (bytes), (call)))

static void engine_comm_start(td_engine *e, const td_comm *comm) {
    e->comm_timed = comm && td_comm_size(comm) > 1;
    if (e->comm_timed) e->comm_t0 = td_time_ns();
}

static td_status engine_comm_stop(td_engine *e, size_t bytes, td_status st) {
    if (e->comm_timed) {
        e->comm_ns += td_time_ns() - e->comm_t0;
        e->timing.comm_calls++;
        e->timing.comm_bytes += bytes;
        e->comm_timed = false;
    }
    return st;
}

td_engine_params td_engine_default_params(void) {
    td_engine_params p = {
        .max_batch_tokens = 2048, .max_seqs = 256, .max_ctx = 0, .cp_min_tokens = 256};
    return p;
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
    if (c->head_dim > TD_CPU_ATTN_MERGE_MAX_HEAD_DIM) {
        TD_LOG_ERROR("head size %d too large for context parallelism (at most %d)", c->head_dim,
                     TD_CPU_ATTN_MERGE_MAX_HEAD_DIM);
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
    e->cp_part = scratch_alloc(C * T, nhd * sizeof(float), fail);
    e->cp_kv =
        scratch_alloc((e->p.cp_mode == TD_CP_RING ? 2 : C) * 2 * B, blk * sizeof(float), fail);
    e->cp_ms = scratch_alloc(T * (size_t)e->nh * 2, sizeof(float), fail);
    e->cp_tmp = scratch_alloc((size_t)e->nth * (size_t)e->head_dim, sizeof(float), fail);
    /* allgather pads each rank's blocks: no uninitialised bytes go to the comm */
    if (e->cp_kv)
        memset(e->cp_kv, 0, (e->p.cp_mode == TD_CP_RING ? 2 : C) * 2 * B * blk * sizeof(float));
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
    free(e->cp_part);
    free(e->cp_kv);
    free(e->cp_ms);
    free(e->cp_tmp);
}

static void engine_free_scratch(td_engine *e) {
    cp_free(e);
    free(e->x);
    free(e->xn);
    free(e->q);
    free(e->k);
    free(e->v);
    free(e->att);
    free(e->o);
    free(e->g);
    free(e->u);
    free(e->attn_scratch);
    free(e->tok_seq);
    free(e->tok_pos);
    free(e->logit_tok);
    free(e->rl);
    free(e->sel_id);
    free(e->sel_w);
    free(e->sel_slot);
    free(e->slot_row);
    free(e->exp_off);
    free(e->xg);
    free(e->gg);
    free(e->ug);
    free(e->yg);
    free(e->ep_cnt);
    free(e->a2a);
    free(e->ep_eoff);
    free(e->load_cur);
    free(e->load_last);
    free(e->head_buf);
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
    e->tp = tp;
    e->comm = comm;
    e->p = ep;
    e->nth = tp ? td_threadpool_size(tp) : 1;
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
    e->rope_mode = c->rope_mode;
    e->inv_freq = td_model_rope_inv_freq(m);

    size_t T = (size_t)ep.max_batch_tokens;
    bool fail = false;
    e->x = scratch_alloc(T * (size_t)e->n_embd, sizeof(float), &fail);
    e->xn = scratch_alloc(T * (size_t)e->n_embd, sizeof(float), &fail);
    e->o = scratch_alloc(T * (size_t)e->n_embd, sizeof(float), &fail);
    e->q = scratch_alloc(T * (size_t)e->q_dim, sizeof(float), &fail);
    e->att = scratch_alloc(T * (size_t)e->q_dim, sizeof(float), &fail);
    e->k = scratch_alloc(T * (size_t)e->kv_dim, sizeof(float), &fail);
    e->v = scratch_alloc(T * (size_t)e->kv_dim, sizeof(float), &fail);
    e->g = scratch_alloc(T * (size_t)e->n_ff, sizeof(float), &fail);
    e->u = scratch_alloc(T * (size_t)e->n_ff, sizeof(float), &fail);
    e->attn_scratch = scratch_alloc((size_t)e->nth * (size_t)ep.max_ctx, sizeof(float), &fail);
    e->tok_seq = scratch_alloc(T, sizeof(int32_t), &fail);
    e->tok_pos = scratch_alloc(T, sizeof(int32_t), &fail);
    e->logit_tok = scratch_alloc(T, sizeof(int32_t), &fail);
    if (e->n_expert > 0) {
        size_t TK = T * (size_t)e->n_used;
        e->rl = scratch_alloc(T * (size_t)e->n_expert, sizeof(float), &fail);
        e->sel_id = scratch_alloc(TK, sizeof(int32_t), &fail);
        e->sel_w = scratch_alloc(TK, sizeof(float), &fail);
        e->sel_slot = scratch_alloc(TK, sizeof(int32_t), &fail);
        e->slot_row = scratch_alloc(TK, sizeof(int32_t), &fail);
        e->exp_off = scratch_alloc((size_t)e->n_expert + 1, sizeof(int32_t), &fail);
        e->xg = scratch_alloc(TK * (size_t)e->n_embd, sizeof(float), &fail);
        e->gg = scratch_alloc(TK * (size_t)e->n_ff_exp, sizeof(float), &fail);
        e->ug = scratch_alloc(TK * (size_t)e->n_ff_exp, sizeof(float), &fail);
        e->yg = scratch_alloc(TK * (size_t)e->n_embd, sizeof(float), &fail);
        size_t NL = (size_t)n_local_layers * (size_t)e->n_expert;
        e->load_cur = scratch_alloc(NL, sizeof(int64_t), &fail);
        e->load_last = scratch_alloc(NL, sizeof(int64_t), &fail);
        if (e->load_last) memset(e->load_last, 0, NL * sizeof(int64_t));
        if (e->ep_size > 1) {
            e->ep_cnt =
                scratch_alloc((size_t)e->rg_size * (size_t)e->n_expert, sizeof(int32_t), &fail);
            e->a2a = scratch_alloc(4 * (size_t)e->ep_size, sizeof(size_t), &fail);
            e->ep_eoff = scratch_alloc((size_t)e->n_exp_loc + 1, sizeof(int32_t), &fail);
        }
    }
    if (e->vocab_tp > 1) {
        size_t per_row = (size_t)e->vocab_tp * (size_t)e->vocab_per_rank;
        e->head_rows = (int32_t)TD_MAX((size_t)1, TD_MIN(T, HEAD_GATHER_FLOATS / per_row));
        e->head_buf = scratch_alloc((size_t)e->head_rows * per_row, sizeof(float), &fail);
        /* Columns past a short slice are never computed (and never read):
         * initialised once, so no uninitialised bytes go to the comm. */
        if (e->head_buf) memset(e->head_buf, 0, (size_t)e->head_rows * per_row * sizeof(float));
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

/* ------------------------------------------------------------------ tasks */

/* Threads claim work items (rows, row tiles, heads) from a shared counter
 * instead of fixed shares, so a thread the OS deschedules delays nobody:
 * which thread computes an item never changes its value. */
static bool claim(td_engine *e, int64_t n, int64_t chunk, int64_t *b, int64_t *end) {
    int64_t s = atomic_fetch_add_explicit(&e->work_next, chunk, memory_order_relaxed);
    if (s >= n) return false;
    *b = s;
    *end = TD_MIN(s + chunk, n);
    return true;
}

static void dispatch(td_engine *e, td_task_fn fn, void *ctx, bool parallel) {
    atomic_store_explicit(&e->work_next, 0, memory_order_relaxed);
    if (parallel)
        td_threadpool_run(e->tp, fn, ctx); /* publishes the reset to the workers */
    else
        fn(ctx, 0, 1);
}

static void run(td_engine *e, td_task_fn fn, void *ctx, int n_rows) {
    dispatch(e, fn, ctx, e->tp && e->nth > 1 && n_rows >= MIN_PAR_ROWS);
}

/* Row step: [x += o] ; xn = rmsnorm(x[src], w). */
typedef struct {
    td_engine *e;
    int32_t n_rows;
    bool add;
    const int32_t *src_row; /* NULL: identity */
    const float *norm_w;
} norm_task;

static void task_norm(void *ctx, int ith, int nth) {
    const norm_task *t = ctx;
    td_engine *e = t->e;
    (void)ith;
    (void)nth;
    int64_t r0, r1;
    size_t E = (size_t)e->n_embd;
    while (claim(e, t->n_rows, ROW_CHUNK, &r0, &r1))
        for (int64_t r = r0; r < r1; r++) {
            float *x = e->x + (size_t)(t->src_row ? t->src_row[r] : r) * E;
            if (t->add) td_cpu_add(x, e->o + (size_t)r * E, x, (int64_t)E);
            float *xn = e->xn + (size_t)r * E;
            td_cpu_rmsnorm(x, t->norm_w, xn, (int64_t)E, e->eps);
        }
}

/* y_i = W_i x for up to N_MM weights reading the same f32 rows x (n_rows,
 * ldx); each thread takes tiles of output rows. */
typedef struct {
    td_engine *e;
    int32_t n_rows;
    int n_w;
    const td_weight *w[N_MM];
    const float *x;
    size_t ldx;
    float *y[N_MM];
    size_t ldy[N_MM];
} matmul_task;

static void task_matmul(void *ctx, int ith, int nth) {
    (void)ith;
    (void)nth;
    const matmul_task *t = ctx;
    int64_t tiles[N_MM], total = 0, b, end;
    const int64_t tile = t->n_rows < MIN_PAR_ROWS ? ROW_TILE_FEW : ROW_TILE;
    for (int i = 0; i < t->n_w; i++) {
        tiles[i] = (t->w[i]->rows + tile - 1) / tile;
        total += tiles[i];
    }
    while (claim(t->e, total, 1, &b, &end)) {
        int i = 0;
        while (b >= tiles[i]) b -= tiles[i++];
        const td_weight *w = t->w[i];
        int64_t r0 = b * tile, r1 = TD_MIN(r0 + tile, w->rows);
        td_cpu_matmul_f32act(w->type, w->data, w->stride, t->x, t->ldx, t->n_rows, w->cols, t->y[i],
                             t->ldy[i], (int)r0, (int)r1);
    }
}

static void matmul(td_engine *e, const td_weight *const *w, int n_w, const float *x, size_t ldx,
                   float *const *y, const size_t *ldy, int32_t n_rows) {
    TD_ASSERT(n_w >= 1 && n_w <= N_MM);
    matmul_task t = {.e = e, .n_rows = n_rows, .n_w = n_w, .x = x, .ldx = ldx};
    for (int i = 0; i < n_w; i++) {
        t.w[i] = w[i];
        t.y[i] = y[i];
        t.ldy[i] = ldy[i];
    }
    dispatch(e, task_matmul, &t, e->tp && e->nth > 1);
}

/* Bias, RoPE and the KV write of each row. */
typedef struct {
    td_engine *e;
    const td_layer_weights *lw;
    float *kc, *vc; /* this layer's cache regions */
} qkv_task;

static void task_qkv(void *ctx, int ith, int nth) {
    const qkv_task *t = ctx;
    td_engine *e = t->e;
    const td_layer_weights *lw = t->lw;
    int bs = td_kv_pool_params(e->kv)->block_size;
    (void)ith;
    (void)nth;
    int64_t r0, r1;
    while (claim(e, e->n_tok, ROW_CHUNK, &r0, &r1))
        for (int64_t r = r0; r < r1; r++) {
            float *q = e->q + (size_t)r * (size_t)e->q_dim;
            float *k = e->k + (size_t)r * (size_t)e->kv_dim;
            float *v = e->v + (size_t)r * (size_t)e->kv_dim;
            if (lw->bq) td_cpu_add(q, lw->bq, q, e->q_dim);
            if (lw->bk) td_cpu_add(k, lw->bk, k, e->kv_dim);
            if (lw->bv) td_cpu_add(v, lw->bv, v, e->kv_dim);
            int32_t pos = e->tok_pos[r];
            td_cpu_rope(q, e->nh, e->head_dim, e->n_rot, pos, e->inv_freq, e->rope_mode);
            td_cpu_rope(k, e->nkv, e->head_dim, e->n_rot, pos, e->inv_freq, e->rope_mode);
            if (e->cp_n > 1 && (pos / bs) % e->cp_n != e->cp_r) continue; /* CP: not our block */
            const td_seq_chunk *s = &e->seqs[e->tok_seq[r]];
            size_t cell = (size_t)s->block_table[pos / bs] * (size_t)bs + (size_t)(pos % bs);
            memcpy(t->kc + cell * (size_t)e->kv_dim, k, (size_t)e->kv_dim * sizeof(float));
            memcpy(t->vc + cell * (size_t)e->kv_dim, v, (size_t)e->kv_dim * sizeof(float));
        }
}

/* Attention per (row, head) item, claimed one at a time (items differ in
 * cost with the context length). */
typedef struct {
    td_engine *e;
    td_cpu_kv_layer kvl;
} attn_task;

static void task_attn(void *ctx, int ith, int nth) {
    (void)nth;
    const attn_task *t = ctx;
    td_engine *e = t->e;
    float *scratch = e->attn_scratch + (size_t)ith * (size_t)e->p.max_ctx;
    int group = e->nh / e->nkv;
    int64_t i0, i1;
    while (claim(e, (int64_t)e->n_tok * e->nh, 1, &i0, &i1)) {
        int32_t r = (int32_t)(i0 / e->nh);
        int h = (int)(i0 % e->nh);
        const td_seq_chunk *s = &e->seqs[e->tok_seq[r]];
        int n_ctx = e->tok_pos[r] + 1; /* causal: positions [0, pos] */
        size_t off = (size_t)r * (size_t)e->q_dim + (size_t)h * (size_t)e->head_dim;
        td_cpu_attn_paged(e->q + off, &t->kvl, h / group, s->block_table, n_ctx, e->attn_scale,
                          e->att + off, scratch);
    }
}

/* g = silu(g) * u over n_rows rows of width n. */
typedef struct {
    td_engine *e;
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
    while (claim(t->e, t->n_rows, ROW_CHUNK, &r0, &r1))
        for (int64_t r = r0; r < r1; r++) {
            float *g = t->g + (size_t)r * (size_t)t->n;
            td_cpu_swiglu(g, t->u + (size_t)r * (size_t)t->n, g, t->n);
        }
}

/* ------------------------------------------------------------------- MoE */

/* Routing of each row: softmax over the router logits, the K most probable
 * experts (a strict > comparison over ascending ids, so ties go to the lower
 * id), renormalised when norm_topk. Per row, so batch-invariant. */
typedef struct {
    td_engine *e;
    int32_t r0, n_rows; /* rows [r0, r0 + n_rows) */
} route_task;

static void task_route(void *ctx, int ith, int nth) {
    const route_task *t = ctx;
    td_engine *e = t->e;
    (void)ith;
    (void)nth;
    const int NE = e->n_expert, K = e->n_used;
    int64_t i0, i1;
    while (claim(e, t->n_rows, ROW_CHUNK, &i0, &i1))
        for (int64_t r = t->r0 + i0; r < t->r0 + i1; r++) {
            float *p = e->rl + (size_t)r * (size_t)NE; /* logits -> probabilities in place */
            float mx = p[0], sum = 0.0f;
            for (int x = 1; x < NE; x++) mx = p[x] > mx ? p[x] : mx;
            for (int x = 0; x < NE; x++) {
                p[x] = expf(p[x] - mx);
                sum += p[x];
            }
            for (int x = 0; x < NE; x++) p[x] /= sum;
            int32_t *id = e->sel_id + (size_t)r * (size_t)K;
            float *w = e->sel_w + (size_t)r * (size_t)K;
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
            if (e->norm_topk) {
                float s = 0.0f;
                for (int j = 0; j < K; j++) s += w[j];
                for (int j = 0; j < K; j++) w[j] /= s;
            }
        }
}

/* xg[slot] = xn[slot_row[slot]] */
typedef struct {
    td_engine *e;
    int32_t n_slots;
} gather_task;

static void task_gather(void *ctx, int ith, int nth) {
    const gather_task *t = ctx;
    td_engine *e = t->e;
    (void)ith;
    (void)nth;
    size_t E = (size_t)e->n_embd;
    int64_t s0, s1;
    while (claim(e, t->n_slots, ROW_CHUNK, &s0, &s1))
        for (int64_t s = s0; s < s1; s++)
            memcpy(e->xg + (size_t)s * E, e->xn + (size_t)e->slot_row[s] * E, E * sizeof(float));
}

/* o[r] = (shared ? sigmoid(shexp_inp . xn[r]) * o[r] : 0) + sum_j w_j yg[slot_j],
 * the sum in the row's selection order. */
typedef struct {
    td_engine *e;
    const float *shexp_inp; /* NULL: no shared-expert gate */
    bool shared;            /* o holds the shared expert's output */
    int32_t r0, r1;         /* rows with routed outputs; the others get none */
    bool shared_outside;    /* rows outside [r0, r1) keep their shared part, else are zeroed */
} combine_task;

static void task_combine(void *ctx, int ith, int nth) {
    const combine_task *t = ctx;
    td_engine *e = t->e;
    (void)ith;
    (void)nth;
    const size_t E = (size_t)e->n_embd;
    const int K = e->n_used;
    int64_t r0, r1;
    while (claim(e, e->n_tok, ROW_CHUNK, &r0, &r1))
        for (int64_t r = r0; r < r1; r++) {
            float *o = e->o + (size_t)r * E;
            bool routed = r >= t->r0 && r < t->r1;
            if (t->shared && (routed || t->shared_outside)) {
                float gs = 1.0f;
                if (t->shexp_inp) {
                    const float *xn = e->xn + (size_t)r * E;
                    float d = 0.0f;
                    for (size_t i = 0; i < E; i++) d += t->shexp_inp[i] * xn[i];
                    gs = 1.0f / (1.0f + expf(-d));
                }
                for (size_t i = 0; i < E; i++) o[i] *= gs;
            } else {
                memset(o, 0, E * sizeof(float));
            }
            for (int j = 0; routed && j < K; j++) {
                float w = e->sel_w[(size_t)r * (size_t)K + (size_t)j];
                const float *y = e->yg + (size_t)e->sel_slot[(size_t)r * (size_t)K + (size_t)j] * E;
                for (size_t i = 0; i < E; i++) o[i] += w * y[i];
            }
        }
}

/* The MoE FFN of one layer on xn (T, n_embd), result in o (this rank's
 * partial sum under TP, like the dense FFN). Tokens are grouped by expert
 * (a counting sort over the rows in order), so each expert's matrices are
 * streamed once over all of its tokens. */
static void moe_ffn(td_engine *e, const td_layer_weights *lw, int li) {
    const int32_t T = e->n_tok;
    const int K = e->n_used, NE = e->n_expert;
    const size_t E = (size_t)e->n_embd, F = (size_t)e->n_ff_exp;

    const td_weight *wr[] = {&lw->router};
    float *yr[] = {e->rl};
    size_t ldr[] = {(size_t)NE};
    matmul(e, wr, 1, e->xn, E, yr, ldr, T);
    route_task rt = {.e = e, .r0 = 0, .n_rows = T};
    run(e, task_route, &rt, T);

    int32_t *off = e->exp_off;
    memset(off, 0, ((size_t)NE + 1) * sizeof *off);
    for (size_t i = 0; i < (size_t)T * (size_t)K; i++) off[e->sel_id[i] + 1]++;
    for (int x = 0; x < NE; x++) off[x + 1] += off[x];
    for (int32_t r = 0; r < T; r++)
        for (int j = 0; j < K; j++) {
            size_t i = (size_t)r * (size_t)K + (size_t)j;
            int32_t slot = off[e->sel_id[i]]++;
            e->sel_slot[i] = slot;
            e->slot_row[slot] = r;
        }
    for (int x = NE; x > 0; x--) off[x] = off[x - 1]; /* back to first slots */
    off[0] = 0;
    for (int x = 0; x < NE; x++)
        e->load_cur[(size_t)li * (size_t)NE + (size_t)x] = off[x + 1] - off[x];
    int32_t n_slots = T * K;
    gather_task gt = {.e = e, .n_slots = n_slots};
    run(e, task_gather, &gt, n_slots);

    for (int32_t i = 0; i < lw->n_experts_local; i++) {
        const td_expert_weights *ex = &lw->experts[i];
        int32_t s0 = off[ex->id], n = off[ex->id + 1] - s0;
        if (n == 0) continue;
        const td_weight *wgu[] = {&ex->gate, &ex->up};
        float *ygu[] = {e->gg + (size_t)s0 * F, e->ug + (size_t)s0 * F};
        size_t ldgu[] = {F, F};
        matmul(e, wgu, 2, e->xg + (size_t)s0 * E, E, ygu, ldgu, n);
    }
    swiglu_task sw = {.e = e, .g = e->gg, .u = e->ug, .n_rows = n_slots, .n = (int)F};
    run(e, task_swiglu, &sw, n_slots);
    for (int32_t i = 0; i < lw->n_experts_local; i++) {
        const td_expert_weights *ex = &lw->experts[i];
        int32_t s0 = off[ex->id], n = off[ex->id + 1] - s0;
        if (n == 0) continue;
        const td_weight *wd[] = {&ex->down};
        float *yd[] = {e->yg + (size_t)s0 * E};
        size_t ldd[] = {E};
        matmul(e, wd, 1, e->gg + (size_t)s0 * F, F, yd, ldd, n);
    }

    bool shared = e->n_ff > 0;
    if (shared) {
        const td_weight *wgu[] = {&lw->shexp_gate, &lw->shexp_up};
        float *ygu[] = {e->g, e->u};
        size_t ldgu[] = {(size_t)e->n_ff, (size_t)e->n_ff};
        matmul(e, wgu, 2, e->xn, E, ygu, ldgu, T);
        swiglu_task ss = {.e = e, .g = e->g, .u = e->u, .n_rows = T, .n = e->n_ff};
        run(e, task_swiglu, &ss, T);
        const td_weight *wd[] = {&lw->shexp_down};
        float *yo[] = {e->o};
        size_t ldo[] = {E};
        matmul(e, wd, 1, e->g, (size_t)e->n_ff, yo, ldo, T);
    }
    combine_task ct = {.e = e, .shexp_inp = lw->shexp_inp, .shared = shared, .r0 = 0, .r1 = T};
    run(e, task_combine, &ct, T);
}
/* Rows of the expert-parallel exchange: a is sender-major (as an
 * all-to-all lands them: sender j's rows for each local expert in turn), b
 * expert-major (each local expert's rows of every sender, so one matmul per
 * expert); to_b copies a into b, else b back into a. */
static void ep_permute(const td_engine *e, float *a, float *b, bool to_b) {
    const size_t E = (size_t)e->n_embd;
    const size_t *rd = e->a2a + 3 * (size_t)e->ep_size;
    size_t nb = 0;
    for (int i = 0; i < e->n_exp_loc; i++)
        for (int j = 0; j < e->ep_size; j++) {
            const int32_t *cs =
                e->ep_cnt + (size_t)(e->ep_base + j) * (size_t)e->n_expert + e->exp0;
            size_t na = rd[j] / (E * sizeof(float));
            for (int k = 0; k < i; k++) na += (size_t)cs[k];
            size_t n = (size_t)cs[i];
            if (n && to_b)
                memcpy(b + nb * E, a + na * E, n * E * sizeof(float));
            else if (n)
                memcpy(a + na * E, b + nb * E, n * E * sizeof(float));
            nb += n;
        }
}

/* The MoE FFN of one layer under expert parallelism. This rank routes its
 * share [r0, r1) of the rows and groups the choices by expert as moe_ffn
 * does, so the slots of the experts of EP rank j are contiguous: block j
 * of the dispatch. The per-expert counts of every row-group rank (one
 * all-gather) size every transfer and give the load of the whole batch.
 * Each local expert runs once over the rows of all senders, the outputs go
 * back into the slots they came from (combine), and each row adds its
 * experts in its selection order, as on one rank. Rows outside [r0, r1)
 * get no routed part: the sum over the row group after the FFN (the TP
 * all-reduce, or ep_sum) completes them. */
static td_status moe_ffn_ep(td_engine *e, const td_layer_weights *lw, int li) {
    const int32_t T = e->n_tok;
    const int K = e->n_used, NE = e->n_expert, P = e->ep_size, NL = e->n_exp_loc;
    const size_t E = (size_t)e->n_embd, F = (size_t)e->n_ff_exp, row = E * sizeof(float);
    const int32_t r0 = e->ep_dp ? 0 : (int32_t)((int64_t)T * e->rg_rank / e->rg_size);
    const int32_t r1 = e->ep_dp ? T : (int32_t)((int64_t)T * (e->rg_rank + 1) / e->rg_size);
    const int32_t nr = r1 - r0;
    td_status st;

    if (nr > 0) {
        const td_weight *wr[] = {&lw->router};
        float *yr[] = {e->rl + (size_t)r0 * (size_t)NE};
        size_t ldr[] = {(size_t)NE};
        matmul(e, wr, 1, e->xn + (size_t)r0 * E, E, yr, ldr, nr);
        route_task rt = {.e = e, .r0 = r0, .n_rows = nr};
        run(e, task_route, &rt, nr);
    }
    int32_t *off = e->exp_off;
    int32_t *mine = e->ep_cnt + (size_t)e->rg_rank * (size_t)NE;
    memset(off, 0, ((size_t)NE + 1) * sizeof *off);
    for (size_t i = (size_t)r0 * (size_t)K; i < (size_t)r1 * (size_t)K; i++)
        off[e->sel_id[i] + 1]++;
    for (int x = 0; x < NE; x++) mine[x] = off[x + 1];
    for (int x = 0; x < NE; x++) off[x + 1] += off[x];
    for (int32_t r = r0; r < r1; r++)
        for (int j = 0; j < K; j++) {
            size_t i = (size_t)r * (size_t)K + (size_t)j;
            int32_t slot = off[e->sel_id[i]]++;
            e->sel_slot[i] = slot;
            e->slot_row[slot] = r;
        }
    for (int x = NE; x > 0; x--) off[x] = off[x - 1];
    off[0] = 0;
    int32_t n_slots = nr * K;
    gather_task gt = {.e = e, .n_slots = n_slots};
    run(e, task_gather, &gt, n_slots);

    if ((st = ENGINE_COMM(
             e, e->rg_comm, (size_t)NE * sizeof(int32_t),
             td_comm_all_gather(e->rg_comm, mine, e->ep_cnt, (size_t)NE * sizeof(int32_t)))))
        return st;
    for (int x = 0; x < NE; x++) {
        int64_t n = 0;
        for (int k = 0; k < e->rg_size; k++) n += e->ep_cnt[(size_t)k * (size_t)NE + (size_t)x];
        e->load_cur[(size_t)li * (size_t)NE + (size_t)x] = n;
    }
    size_t *sb = e->a2a, *sd = sb + P, *rb = sd + P, *rd = rb + P;
    size_t n_recv = 0;
    for (int j = 0; j < P; j++) {
        sd[j] = (size_t)off[j * NL] * row;
        sb[j] = (size_t)(off[(j + 1) * NL] - off[j * NL]) * row;
        const int32_t *cs = e->ep_cnt + (size_t)(e->ep_base + j) * (size_t)NE + e->exp0;
        size_t n = 0;
        for (int i = 0; i < NL; i++) n += (size_t)cs[i];
        rd[j] = n_recv * row;
        rb[j] = n * row;
        n_recv += n;
    }
    /* The senders share one batch, so this holds unless the ranks were given
     * different batches. */
    if (n_recv > (size_t)e->p.max_batch_tokens * (size_t)K) {
        TD_LOG_ERROR("expert parallelism: %zu rows for this rank's experts, more than %d tokens "
                     "x %d: the EP group's ranks ran different batches",
                     n_recv, e->p.max_batch_tokens, K);
        return TD_ERR_INVALID;
    }
    /* Dispatch: my slots (xg) to the experts' ranks, theirs into yg. */
    if ((st = ENGINE_COMM(e, e->p.ep_comm, (size_t)n_slots * row,
                          td_comm_all_to_all_v(e->p.ep_comm, e->xg, sb, sd, e->yg, rb, rd))))
        return st;
    ep_permute(e, e->yg, e->xg, true);
    int32_t *eoff = e->ep_eoff;
    eoff[0] = 0;
    for (int i = 0; i < NL; i++) {
        eoff[i + 1] = eoff[i];
        for (int j = 0; j < P; j++)
            eoff[i + 1] += e->ep_cnt[(size_t)(e->ep_base + j) * (size_t)NE + (size_t)(e->exp0 + i)];
    }
    for (int i = 0; i < NL; i++) {
        const td_expert_weights *ex = &lw->experts[i];
        int32_t s0 = eoff[i], n = eoff[i + 1] - s0;
        if (n == 0) continue;
        const td_weight *wgu[] = {&ex->gate, &ex->up};
        float *ygu[] = {e->gg + (size_t)s0 * F, e->ug + (size_t)s0 * F};
        size_t ldgu[] = {F, F};
        matmul(e, wgu, 2, e->xg + (size_t)s0 * E, E, ygu, ldgu, n);
    }
    swiglu_task sw = {.e = e, .g = e->gg, .u = e->ug, .n_rows = (int32_t)n_recv, .n = (int)F};
    run(e, task_swiglu, &sw, (int)n_recv);
    for (int i = 0; i < NL; i++) {
        const td_expert_weights *ex = &lw->experts[i];
        int32_t s0 = eoff[i], n = eoff[i + 1] - s0;
        if (n == 0) continue;
        const td_weight *wd[] = {&ex->down};
        float *yd[] = {e->yg + (size_t)s0 * E};
        size_t ldd[] = {E};
        matmul(e, wd, 1, e->gg + (size_t)s0 * F, F, yd, ldd, n);
    }
    /* Combine: the outputs back to the ranks (and slots) they came from. */
    ep_permute(e, e->xg, e->yg, false);
    if ((st = ENGINE_COMM(e, e->p.ep_comm, n_recv * row,
                          td_comm_all_to_all_v(e->p.ep_comm, e->xg, rb, rd, e->yg, sb, sd))))
        return st;

    /* The shared expert is split like a dense FFN over TP (every rank, every
     * row, a partial sum); with TP 1 each rank computes its own rows whole. */
    bool shared = e->n_ff > 0, tp = !e->ep_sum && !e->ep_dp;
    int32_t h0 = tp ? 0 : r0, hn = tp ? T : nr;
    if (shared && hn > 0) {
        size_t FS = (size_t)e->n_ff;
        const td_weight *wgu[] = {&lw->shexp_gate, &lw->shexp_up};
        float *ygu[] = {e->g + (size_t)h0 * FS, e->u + (size_t)h0 * FS};
        size_t ldgu[] = {FS, FS};
        matmul(e, wgu, 2, e->xn + (size_t)h0 * E, E, ygu, ldgu, hn);
        swiglu_task ss = {.e = e, .g = ygu[0], .u = ygu[1], .n_rows = hn, .n = e->n_ff};
        run(e, task_swiglu, &ss, hn);
        const td_weight *wd[] = {&lw->shexp_down};
        float *yo[] = {e->o + (size_t)h0 * E};
        size_t ldo[] = {E};
        matmul(e, wd, 1, ygu[0], FS, yo, ldo, hn);
    }
    combine_task ct = {.e = e,
                       .shexp_inp = lw->shexp_inp,
                       .shared = shared,
                       .r0 = r0,
                       .r1 = r1,
                       .shared_outside = tp};
    run(e, task_combine, &ct, T);
    return TD_OK;
}

/* Embedding rows: dequantised straight from the (possibly quantised) table. */
typedef struct {
    td_engine *e;
} embd_task;

static void task_embd(void *ctx, int ith, int nth) {
    td_engine *e = ((const embd_task *)ctx)->e;
    const td_weight *w = td_model_tok_embd(e->m);
    (void)ith;
    (void)nth;
    int64_t r0, r1;
    while (claim(e, e->n_tok, ROW_CHUNK, &r0, &r1))
        for (int64_t r = r0; r < r1; r++) {
            const td_seq_chunk *s = &e->seqs[e->tok_seq[r]];
            int32_t id = s->tokens[e->tok_pos[r] - s->pos0];
            float *x = e->x + (size_t)r * (size_t)e->n_embd;
            if (id < e->vocab_begin || id >= e->vocab_end) {
                memset(x, 0, (size_t)e->n_embd * sizeof(float)); /* another rank's row */
                continue;
            }
            td_cpu_dequant_row(w->type,
                               (const uint8_t *)w->data + (size_t)(id - e->vocab_begin) * w->stride,
                               x, w->cols);
        }
}

/* ---------------------------------------------------- context parallelism */

/* Collectives over the CP group, counting the bytes this rank sends (an
 * all-gather sends its block to each of the other ranks). */
static td_status cp_all_gather(td_engine *e, const void *send, void *recv, size_t bytes) {
    e->timing.cp_bytes += bytes * (size_t)(e->cp_n - 1);
    return ENGINE_COMM(e, e->cp, bytes, td_comm_all_gather(e->cp, send, recv, bytes));
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

typedef enum {
    CP_DCP_PART,  /* DCP row: partial over this rank's blocks into its slot of cp_part */
    CP_DCP_MERGE, /* DCP row: merge the cp_n partials in rank order into att */
    CP_PCP_FULL,  /* PCP row, allgather: attention over the gathered context */
    CP_PCP_OWN,   /* PCP row, ring: partial over this rank's blocks into att, cp_ms */
    CP_PCP_MERGE, /* PCP row, ring: partial over a received chunk, merged into att, cp_ms */
} cp_attn_kind;

typedef struct {
    td_engine *e;
    cp_attn_kind kind;
    td_cpu_kv_layer kvl;   /* this rank's layer, or the gathered / received K/V */
    const int32_t *table;  /* PCP: block table of kvl */
    int offset;            /* CP_PCP_MERGE: rank whose blocks kvl holds */
    int32_t row0, n_items; /* PCP: first local row; items are rows (x heads) */
} cp_attn_task;

static void task_cp_attn(void *ctx, int ith, int nth) {
    (void)nth;
    const cp_attn_task *t = ctx;
    td_engine *e = t->e;
    float *scratch = e->attn_scratch + (size_t)ith * (size_t)e->p.max_ctx;
    const int nh = e->nh, hd = e->head_dim, group = e->nh / e->nkv, C = e->cp_n;
    const size_t slot = (size_t)hd + 2;
    int64_t i0, i1;
    while (claim(e, (int64_t)t->n_items * nh, 1, &i0, &i1)) {
        int32_t item = (int32_t)(i0 / nh);
        int h = (int)(i0 % nh);
        bool dcp = t->kind == CP_DCP_PART || t->kind == CP_DCP_MERGE;
        int32_t r = dcp ? e->cp_dcp_row[item] : t->row0 + item;
        int32_t seq = e->tok_seq[r];
        int n_ctx = e->tok_pos[r] + 1; /* causal: positions [0, pos] */
        size_t off = (size_t)r * (size_t)e->q_dim + (size_t)h * (size_t)hd;
        const float *q = e->q + off;
        const int32_t *ltab = e->cp_ltab + (size_t)seq * (size_t)e->cp_maxb;
        float *ms = e->cp_ms + ((size_t)r * (size_t)nh + (size_t)h) * 2;
        td_cpu_attn_part part;
        switch (t->kind) {
        case CP_DCP_PART: {
            float *sl =
                e->cp_part +
                (((size_t)e->cp_r * (size_t)e->n_dcp + (size_t)item) * (size_t)nh + (size_t)h) *
                    slot;
            part.out = sl;
            td_cpu_attn_partial(q, &t->kvl, h / group, ltab, n_ctx, C, e->cp_r, e->attn_scale,
                                &part, scratch);
            sl[hd] = part.m;
            sl[hd + 1] = part.s;
            break;
        }
        case CP_DCP_MERGE: {
            td_cpu_attn_part parts[TD_COMM_MAX_RANKS];
            for (int k = 0; k < C; k++) {
                float *sl =
                    e->cp_part +
                    (((size_t)k * (size_t)e->n_dcp + (size_t)item) * (size_t)nh + (size_t)h) * slot;
                parts[k] = (td_cpu_attn_part){.out = sl, .m = sl[hd], .s = sl[hd + 1]};
            }
            td_cpu_attn_merge(parts, C, hd, e->att + off, NULL);
            break;
        }
        case CP_PCP_FULL:
            td_cpu_attn_paged(q, &t->kvl, h / group, t->table, n_ctx, e->attn_scale, e->att + off,
                              scratch);
            break;
        case CP_PCP_OWN:
            part.out = e->att + off;
            td_cpu_attn_partial(q, &t->kvl, h / group, ltab, n_ctx, C, e->cp_r, e->attn_scale,
                                &part, scratch);
            ms[0] = part.m;
            ms[1] = part.s;
            break;
        case CP_PCP_MERGE: {
            td_cpu_attn_part parts[2] = {{.out = e->att + off, .m = ms[0], .s = ms[1]},
                                         {.out = e->cp_tmp + (size_t)ith * (size_t)hd}};
            td_cpu_attn_partial(q, &t->kvl, h / group, t->table, n_ctx, C, t->offset, e->attn_scale,
                                &parts[1], scratch);
            td_cpu_attn_part merged;
            td_cpu_attn_merge(parts, 2, hd, e->att + off, &merged);
            ms[0] = merged.m;
            ms[1] = merged.s;
            break;
        }
        }
    }
}

static void cp_dispatch(td_engine *e, cp_attn_task *t, int64_t cost) {
    if (t->n_items > 0) dispatch(e, task_cp_attn, t, e->tp && e->nth > 1 && cost * e->nh >= 1024);
}

/* K and V of the blocks of [0, end) this rank holds, as n_held K blocks
 * then n_held V blocks from dst and dst + stride_blocks blocks. */
static void cp_pack(const td_engine *e, const td_cpu_kv_layer *own, int32_t seq, int32_t end,
                    float *dst, int32_t stride_blocks) {
    const size_t blk = (size_t)e->cp_bs * (size_t)e->kv_dim;
    const int32_t *lt = e->cp_ltab + (size_t)seq * (size_t)e->cp_maxb;
    for (int32_t j = e->cp_r, x = 0; (int64_t)j * e->cp_bs < end; j += e->cp_n, x++) {
        memcpy(dst + (size_t)x * blk, own->k + (size_t)lt[x] * blk, blk * sizeof(float));
        memcpy(dst + ((size_t)stride_blocks + (size_t)x) * blk, own->v + (size_t)lt[x] * blk,
               blk * sizeof(float));
    }
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
static td_status cp_pcp_allgather(td_engine *e, const td_cpu_kv_layer *own, int32_t seq) {
    const td_seq_chunk *s = &e->seqs[seq];
    const int C = e->cp_n;
    const int32_t end = s->pos0 + s->n_tokens, nb = (end + e->cp_bs - 1) / e->cp_bs;
    const int32_t maxb = cp_held(e, end, 0);
    const size_t blk = (size_t)e->cp_bs * (size_t)e->kv_dim, chunk = 2 * (size_t)maxb * blk;
    float *mine = e->cp_kv + (size_t)e->cp_r * chunk;
    cp_pack(e, own, seq, end, mine, maxb);
    td_status st = cp_all_gather(e, mine, e->cp_kv, chunk * sizeof(float));
    if (st) return st;
    for (int32_t j = 0; j < nb; j++) e->cp_gtab[j] = (j % C) * 2 * maxb + j / C;
    cp_attn_task t = {.e = e,
                      .kind = CP_PCP_FULL,
                      .kvl = {.k = e->cp_kv,
                              .v = e->cp_kv + (size_t)maxb * blk,
                              .block_size = e->cp_bs,
                              .n_kv_heads = e->nkv,
                              .head_dim = e->head_dim},
                      .table = e->cp_gtab,
                      .row0 = e->cp_row0[seq],
                      .n_items = e->cp_nrow[seq]};
    cp_dispatch(e, &t, (int64_t)t.n_items * end);
    return TD_OK;
}

/* PCP, ring mode: each rank starts with the partial over its own blocks;
 * then the ranks' K/V chunks travel around the ring (to rank + 1, from
 * rank - 1) for cp - 1 steps, and each chunk that arrives adds its partial
 * by the online-softmax merge. Sends are rendezvous: even ranks send first
 * and odd ranks receive first, so every send meets a posted receive. */
static td_status cp_pcp_ring(td_engine *e, const td_cpu_kv_layer *own, int32_t seq) {
    const td_seq_chunk *s = &e->seqs[seq];
    const int C = e->cp_n, me = e->cp_r, next = (me + 1) % C, prev = (me + C - 1) % C;
    const int32_t end = s->pos0 + s->n_tokens;
    const size_t blk = (size_t)e->cp_bs * (size_t)e->kv_dim;
    float *buf[2] = {e->cp_kv, e->cp_kv + 2 * (size_t)e->cp_maxb * blk};
    cp_attn_task t = {.e = e,
                      .kind = CP_PCP_OWN,
                      .kvl = *own,
                      .row0 = e->cp_row0[seq],
                      .n_items = e->cp_nrow[seq]};
    const int64_t cost = (int64_t)t.n_items * end / C;
    cp_dispatch(e, &t, cost);
    int32_t held = cp_held(e, end, me);
    cp_pack(e, own, seq, end, buf[0], held);
    for (int32_t x = 0; x < e->cp_maxb; x++) e->cp_gtab[x] = x;
    for (int step = 1; step < C; step++) {
        int origin = (me - step + C) % C;
        int32_t in_held = cp_held(e, end, origin);
        size_t out_bytes = 2 * (size_t)held * blk * sizeof(float);
        size_t in_bytes = 2 * (size_t)in_held * blk * sizeof(float);
        td_status st;
        if (me % 2 == 0) {
            if ((st = ENGINE_COMM(e, e->cp, out_bytes,
                                  td_comm_send(e->cp, buf[0], out_bytes, next))) ||
                (st = ENGINE_COMM(e, e->cp, 0, td_comm_recv(e->cp, buf[1], in_bytes, prev))))
                return st;
        } else {
            if ((st = ENGINE_COMM(e, e->cp, 0, td_comm_recv(e->cp, buf[1], in_bytes, prev))) ||
                (st = ENGINE_COMM(e, e->cp, out_bytes,
                                  td_comm_send(e->cp, buf[0], out_bytes, next))))
                return st;
        }
        e->timing.cp_bytes += out_bytes;
        if (in_held > 0) {
            t.kind = CP_PCP_MERGE;
            t.kvl.k = buf[1];
            t.kvl.v = buf[1] + (size_t)in_held * blk;
            t.table = e->cp_gtab;
            t.offset = origin;
            cp_dispatch(e, &t, cost);
        }
        float *tmp = buf[0];
        buf[0] = buf[1];
        buf[1] = tmp;
        held = in_held;
    }
    return TD_OK;
}

/* Attention of this rank's rows for one layer (own: this rank's cache
 * layer, where the rows' K/V were just written on their blocks' owners). */
static td_status cp_attention(td_engine *e, const td_cpu_kv_layer *own) {
    td_status st;
    if (e->n_dcp > 0) {
        /* DCP: partials over each rank's positions, gathered and merged in
         * rank order, so every rank gets the same bits. */
        cp_attn_task t = {.e = e, .kind = CP_DCP_PART, .kvl = *own, .n_items = e->n_dcp};
        cp_dispatch(e, &t, e->cp_dcp_cost / e->cp_n);
        size_t bytes = (size_t)e->n_dcp * (size_t)e->nh * ((size_t)e->head_dim + 2) * sizeof(float);
        if ((st = cp_all_gather(e, (uint8_t *)e->cp_part + (size_t)e->cp_r * bytes, e->cp_part,
                                bytes)))
            return st;
        t.kind = CP_DCP_MERGE;
        cp_dispatch(e, &t, e->n_dcp * (int64_t)e->cp_n * 8);
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
        for (int32_t i = 0; i < e->cp_k[me]; i++)
            memcpy(e->xn + (size_t)i * (size_t)e->n_embd,
                   e->x + (size_t)e->cp_send_row[i] * (size_t)e->n_embd, row);
        sb[0] = (size_t)e->cp_k[me] * row;
        e->timing.cp_bytes += sb[0];
    }
    return ENGINE_COMM(e, e->cp, sb[0], td_comm_all_to_all_v(e->cp, e->xn, sb, sd, e->x, rb, rd));
}

/* ---------------------------------------------------------------- forward */

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
    for (int32_t i = 0; i < n_logit; i++)
        memcpy(e->xn + (size_t)i * E, e->x + (size_t)e->logit_tok[i] * E, row);
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
                               td_comm_all_to_all_v(e->p.ep_comm, e->xn, sb, sd, e->o, rb, rd));
    if (st || e->ep_rank != 0 || n_all == 0) return st;
    /* Sender-major (each sender's rows in its sequences' order) to the
     * order of seqs; rd becomes each sender's read cursor, in rows. */
    for (int k = 0; k < P; k++) rd[k] /= row;
    size_t out = 0;
    for (int32_t i = 0; i < n_seqs; i++) {
        size_t n = (size_t)seq_logit_rows(&seqs[i]);
        int k = seq_owner(e, &seqs[i]);
        memcpy(e->x + out * E, e->o + rd[k] * E, n * row);
        rd[k] += n;
        out += n;
    }
    norm_task nh = {
        .e = e, .n_rows = (int32_t)n_all, .add = false, .norm_w = td_model_output_norm(e->m)};
    run(e, task_norm, &nh, (int32_t)n_all);
    const td_weight *wh[] = {td_model_output(e->m)};
    float *yh[] = {logits};
    size_t ldh[] = {(size_t)e->n_vocab};
    matmul(e, wh, 1, e->xn, E, yh, ldh, (int32_t)n_all);
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
 * its columns of logits. Each logit is one dot product, as with one rank. */
typedef struct {
    td_engine *e;
    int32_t i0, n_rows; /* logit rows of this group */
    float *logits;
} head_place_task;

static void task_head_place(void *ctx, int ith, int nth) {
    const head_place_task *t = ctx;
    td_engine *e = t->e;
    (void)ith;
    (void)nth;
    const size_t W = (size_t)e->vocab_per_rank, V = (size_t)e->n_vocab;
    const size_t blk = (size_t)t->n_rows * W;
    int64_t r0, r1;
    while (claim(e, t->n_rows, ROW_CHUNK, &r0, &r1))
        for (int64_t r = r0; r < r1; r++)
            for (int q = 0; q < e->vocab_tp; q++) {
                size_t v0 = (size_t)q * W;
                if (v0 >= V) break;
                memcpy(t->logits + (size_t)(t->i0 + r) * V + v0,
                       e->head_buf + (size_t)q * blk + (size_t)r * W,
                       TD_MIN(W, V - v0) * sizeof(float));
            }
}

static td_status head_vocab_parallel(td_engine *e, int32_t n_logit, float *logits) {
    const size_t E = (size_t)e->n_embd, W = (size_t)e->vocab_per_rank;
    const td_weight *wh[] = {td_model_output(e->m)};
    const int rank = td_comm_rank(e->comm);
    for (int32_t i0 = 0; i0 < n_logit; i0 += e->head_rows) {
        int32_t g = TD_MIN(e->head_rows, n_logit - i0);
        size_t blk = (size_t)g * W;
        float *yh[] = {e->head_buf + (size_t)rank * blk};
        size_t ldh[] = {W};
        matmul(e, wh, 1, e->xn + (size_t)i0 * E, E, yh, ldh, g);
        td_status st =
            ENGINE_COMM(e, e->comm, blk * sizeof(float),
                        td_comm_all_gather(e->comm, yh[0], e->head_buf, blk * sizeof(float)));
        if (st) return st;
        head_place_task t = {.e = e, .i0 = i0, .n_rows = g, .logits = logits};
        run(e, task_head_place, &t, g);
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
    const size_t E = (size_t)e->n_embd;

    if (first) {
        embd_task et = {.e = e};
        run(e, task_embd, &et, T);
        if (e->vocab_tp > 1 &&
            (st = ENGINE_COMM(e, e->comm, (size_t)T * E * sizeof(float),
                              td_comm_all_reduce_sum(e->comm, e->x, (size_t)T * E))))
            return st;
    } else {
        memcpy(e->x, x_in, (size_t)T * E * sizeof(float));
    }

    int lb = td_model_layer_begin(m), le = td_model_layer_end(m);
    const td_kv_params *kp = td_kv_pool_params(e->kv);
    for (int l = lb; l < le; l++) {
        const td_layer_weights *lw = td_model_layer(m, l);

        /* attention block */
        const td_weight *wqkv[] = {&lw->wq, &lw->wk, &lw->wv};
        norm_task nt = {.e = e, .n_rows = T, .add = l > lb, .norm_w = lw->attn_norm};
        run(e, task_norm, &nt, T);
        float *y3[] = {e->q, e->k, e->v};
        size_t ld3[] = {(size_t)e->q_dim, (size_t)e->kv_dim, (size_t)e->kv_dim};
        matmul(e, wqkv, 3, e->xn, E, y3, ld3, T);

        qkv_task qt = {.e = e,
                       .lw = lw,
                       .kc = td_kv_layer_k(e->kv, l - lb),
                       .vc = td_kv_layer_v(e->kv, l - lb)};
        run(e, task_qkv, &qt, T);

        attn_task at = {.e = e,
                        .kvl = {.k = qt.kc,
                                .v = qt.vc,
                                .block_size = kp->block_size,
                                .n_kv_heads = e->nkv,
                                .head_dim = e->head_dim}};
        if (e->cp_n > 1) {
            if ((st = cp_attention(e, &at.kvl))) return st;
        } else {
            /* attention cost grows with context: worth threads even for one row */
            dispatch(e, task_attn, &at, e->tp && e->nth > 1 && attn_cost * e->nh >= 1024);
        }
        if (e->p.layer_done) e->p.layer_done(e->p.layer_done_ctx, l - lb);

        const td_weight *wo[] = {&lw->wo};
        float *yo[] = {e->o};
        size_t ldo[] = {E};
        matmul(e, wo, 1, e->att, (size_t)e->q_dim, yo, ldo, T);
        if ((st = ENGINE_COMM(e, e->comm, (size_t)T * E * sizeof(float),
                              td_comm_all_reduce_sum(e->comm, e->o, (size_t)T * E))))
            return st;

        /* MLP block */
        norm_task nt2 = {.e = e, .n_rows = T, .add = true, .norm_w = lw->ffn_norm};
        run(e, task_norm, &nt2, T);
        if (e->ep_size > 1) {
            if ((st = moe_ffn_ep(e, lw, l - lb))) return st;
        } else if (e->n_expert > 0) {
            moe_ffn(e, lw, l - lb);
        } else {
            const td_weight *wgu[] = {&lw->w_gate, &lw->w_up};
            float *ygu[] = {e->g, e->u};
            size_t ldgu[] = {(size_t)e->n_ff, (size_t)e->n_ff};
            matmul(e, wgu, 2, e->xn, E, ygu, ldgu, T);

            const td_weight *wd[] = {&lw->w_down};
            swiglu_task sw = {.e = e, .g = e->g, .u = e->u, .n_rows = T, .n = e->n_ff};
            run(e, task_swiglu, &sw, T);
            matmul(e, wd, 1, e->g, (size_t)e->n_ff, yo, ldo, T);
        }
        if ((st = ENGINE_COMM(e, e->comm, (size_t)T * E * sizeof(float),
                              td_comm_all_reduce_sum(e->comm, e->o, (size_t)T * E))))
            return st;
        if (e->ep_sum &&
            (st = ENGINE_COMM(e, e->p.ep_comm, (size_t)T * E * sizeof(float),
                              td_comm_all_reduce_sum(e->p.ep_comm, e->o, (size_t)T * E))))
            return st;
    }
    if (e->n_expert > 0)
        memcpy(e->load_last, e->load_cur,
               (size_t)(le - lb) * (size_t)e->n_expert * sizeof(int64_t));

    /* last residual for every row, then norm + head only for the logit rows */
    for (int32_t r = 0; r < T; r++)
        td_cpu_add(e->x + r * E, e->o + r * E, e->x + r * E, (int64_t)E);
    if (!last) {
        memcpy(x_out, e->x, (size_t)T * E * sizeof(float));
        return TD_OK;
    }
    if (e->cp_n > 1 && (st = cp_gather_logit_rows(e))) return st;
    if (e->ep_dp) return ep_logits(e, seqs, n_seqs, n_logit, logits);
    if (n_logit == 0) return TD_OK;
    const td_weight *wh[] = {td_model_output(m)};
    norm_task nh = {.e = e,
                    .n_rows = n_logit,
                    .add = false,
                    .src_row = e->logit_tok,
                    .norm_w = td_model_output_norm(m)};
    run(e, task_norm, &nh, n_logit);
    if (e->vocab_tp > 1) return head_vocab_parallel(e, n_logit, logits);
    float *yh[] = {logits};
    size_t ldh[] = {(size_t)e->n_vocab};
    matmul(e, wh, 1, e->xn, E, yh, ldh, n_logit);
    return TD_OK;
}
