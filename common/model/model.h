/* Model: configuration and weights of a Llama-family model, loaded from a
 * GGUF file or a Hugging Face directory (config.json + safetensors), as the
 * shard for (tp_rank, tp_size) and the layer range [layer_begin, layer_end)
 * of a pipeline stage.
 *
 * Weight matrices point into the memory-mapped file: column-parallel
 * shards (Q/K/V/gate/up rows) are contiguous slices, row-parallel shards
 * (attn_output, ffn_down columns) keep the full row stride and start at the
 * shard's first column block. Only tensors whose data is not suitably
 * aligned in the file, and converted small tensors (norms, biases as F32),
 * are owned copies. The model file is untrusted input: a
 * missing tensor, a shape mismatch, an unknown type or an inconsistent
 * config is one logged line naming the file and tensor, and an error.
 *
 * Mixture of experts (n_expert > 0): Mixtral (GGUF arch "llama" with
 * llama.expert_count, HF MixtralForCausalLM) and Qwen2-MoE (GGUF "qwen2moe",
 * HF Qwen2MoeForCausalLM). Each layer's FFN is a router (n_expert, n_embd)
 * and per-expert SwiGLU matrices, each expert its own td_weight entries
 * tagged with its expert id (a slice of GGUF's merged 3-D tensor, or its own
 * tensor), so an expert-parallel shard holds its contiguous range of
 * experts (td_model_params.ep_rank / ep_size); Qwen2-MoE
 * adds a shared expert scaled by sigmoid(shexp_inp . x). Routing: softmax
 * over the router logits, the n_expert_used largest probabilities (ties go
 * to the lower expert id), renormalised to sum 1 when norm_topk_prob
 * (always for Mixtral; config.json norm_topk_prob / GGUF
 * qwen2moe.expert_weights_norm for Qwen2-MoE, false by default). */
#ifndef TD_MODEL_H
#define TD_MODEL_H

#include <stdbool.h>

#include "common/base/base.h"
#include "common/tokenizer/tokenizer.h"
#include "kernels/types.h"

typedef enum {
    TD_ARCH_LLAMA = 0,    /* Llama 1/2/3, Mistral, SmolLM2, TinyLlama */
    TD_ARCH_QWEN2 = 1,    /* QKV bias, NeoX RoPE */
    TD_ARCH_QWEN2MOE = 2, /* qwen2 attention, routed experts + a sigmoid-gated shared expert */
} td_arch;

typedef enum {
    TD_ROPE_SCALING_NONE = 0,
    TD_ROPE_SCALING_LINEAR = 1,
    TD_ROPE_SCALING_LLAMA3 = 2,
} td_rope_scaling;

typedef struct {
    td_arch arch;
    char name[128]; /* model name for display / served-model-name */
    int32_t n_vocab;
    int32_t n_embd;
    int32_t n_layer; /* layers of the whole model */
    int32_t n_head;  /* query heads of the whole model */
    int32_t n_head_kv;
    int32_t head_dim;
    int32_t n_ff;
    int32_t n_ctx_train;
    int32_t n_rot; /* rotated dims per head (== head_dim for these archs) */
    float rope_theta;
    float rms_eps;
    td_rope_mode rope_mode; /* NORM for GGUF llama (Q/K permuted), NEOX for HF llama and qwen2 */
    td_rope_scaling rope_scaling;
    float rope_factor;
    float rope_low_freq_factor;
    float rope_high_freq_factor;
    int32_t rope_orig_ctx;
    bool qkv_bias;
    bool tied_output;      /* output head shares token_embd */
    td_dtype wtype;        /* type of most matrices (for display and compatibility) */
    int32_t n_expert;      /* routed experts per layer; 0: dense FFN (n_ff) */
    int32_t n_expert_used; /* experts per token (top-k), 1..n_expert */
    int32_t n_ff_exp;      /* width of one routed expert */
    int32_t n_ff_shexp;    /* width of the shared expert; 0: none */
    bool norm_topk_prob;   /* renormalise the top-k probabilities to sum 1 */
} td_model_config;

/* A 2-D weight: rows x cols elements of `type`, row r at data + r * stride. */
typedef struct {
    td_dtype type;
    int64_t rows;
    int64_t cols;
    size_t stride; /* bytes between rows */
    const void *data;
} td_weight;

/* One routed expert of a layer. */
typedef struct {
    int32_t id;         /* expert index in the router's output, 0..n_expert-1 */
    td_weight gate, up; /* (local n_ff_exp, n_embd) */
    td_weight down;     /* (n_embd, local n_ff_exp) */
} td_expert_weights;

typedef struct {
    const float *attn_norm;    /* (n_embd) */
    td_weight wq, wk, wv;      /* (local heads * head_dim, n_embd) */
    const float *bq, *bk, *bv; /* (local rows) or NULL */
    td_weight wo;              /* (n_embd, local q heads * head_dim) */
    const float *ffn_norm;     /* (n_embd) */
    td_weight w_gate, w_up;    /* (local n_ff, n_embd) */
    td_weight w_down;          /* (n_embd, local n_ff) */
    /* MoE layers only (n_expert > 0; w_gate/w_up/w_down are then empty): */
    td_weight router;               /* (n_expert, n_embd), replicated on every rank */
    td_expert_weights *experts;     /* (n_experts_local), ascending id */
    int32_t n_experts_local;        /* experts this shard holds: all, or n_expert / ep_size */
    td_weight shexp_gate, shexp_up; /* (local n_ff_shexp, n_embd), when n_ff_shexp > 0 */
    td_weight shexp_down;           /* (n_embd, local n_ff_shexp) */
    const float *shexp_inp;         /* (n_embd) shared-expert gate, or NULL */
} td_layer_weights;

typedef struct {
    const char *path; /* GGUF file or HF directory */
    int tp_rank;      /* 0..tp_size-1 */
    int tp_size;      /* >= 1; divides n_head and n_ff (n_ff_exp and n_ff_shexp for MoE:
                         every expert is split like a dense FFN; n_ff_shexp only under EP),
                         and n_head_kv divides it or it
                         divides n_head_kv (KV heads replicated when tp_size > n_head_kv);
                         row-parallel slices must split at quant-block boundaries */
    int layer_begin;  /* first layer of this stage */
    int layer_end;    /* one past the last layer; -1 = n_layer */
    /* Expert parallelism (MoE models only): with ep_size > 1 the shard holds
     * the routed experts [ep_rank * n / ep_size, (ep_rank + 1) * n / ep_size)
     * of every layer (n = n_expert, which ep_size must divide), each WHOLE:
     * not split over TP, whatever tp_size is (tp_size then splits attention
     * and the shared expert only, and n_ff_exp need not divide by it). The
     * router is replicated. Default 0 / 1 (every expert, TP-split). */
    int ep_rank;
    int ep_size;
} td_model_params;

typedef struct td_model td_model;

td_model_params td_model_default_params(void);

/* Loads the model. Free with td_model_free(). */
td_status td_model_load(const td_model_params *p, td_model **m_p);
void td_model_free(td_model *m); /* accepts NULL */
/* The configuration and the tokenizer of the model at path, no weights
 * read (what the router needs: name, context length, tokenizer, chat
 * template). The fields that come from the weights (tied_output, wtype)
 * are not filled, nor is the configuration checked against them. Free
 * *tok_p with td_tokenizer_free(). */
td_status td_model_describe(const char *path, td_model_config *cfg, td_tokenizer **tok_p);

const td_model_config *td_model_get_config(const td_model *m);
const td_tokenizer *td_model_tokenizer(const td_model *m);
/* Plan of this shard. */
int td_model_tp_rank(const td_model *m);
int td_model_tp_size(const td_model *m);
int td_model_ep_rank(const td_model *m);
int td_model_ep_size(const td_model *m);
int td_model_layer_begin(const td_model *m);
int td_model_layer_end(const td_model *m);
int td_model_n_head_local(const td_model *m);
int td_model_n_head_kv_local(const td_model *m);
/* Layer l (global index, layer_begin <= l < layer_end). */
const td_layer_weights *td_model_layer(const td_model *m, int l);
/* Vocab-parallel embedding and output head: a shard holds only rows
 * [*v0_p, *v1_p) of token_embd and output (tied or not), slices of
 * ceil(n_vocab / tp_size) rows in rank order (the last ones shorter, or
 * empty when tp_size rows do not all fit); [0, n_vocab) for tp_size 1.
 * Row r of td_model_tok_embd / td_model_output is token *v0_p + r. Any
 * weight type slices this way (rows are independent). */
void td_model_vocab_range(const td_model *m, int32_t *v0_p, int32_t *v1_p);
const td_weight *
td_model_tok_embd(const td_model *m); /* (v1 - v0, n_embd); NULL on non-first stages */
const float *td_model_output_norm(const td_model *m); /* NULL on non-last stages */
const td_weight *
td_model_output(const td_model *m); /* (v1 - v0, n_embd); NULL on non-last stages */
/* RoPE angular frequencies, (n_rot / 2), scaling applied. */
const float *td_model_rope_inv_freq(const td_model *m);
/* Bytes of weights this shard reads per token (for bandwidth figures): its
 * slices of every matrix, the output head's vocabulary slice included (the
 * embedding is one row per token and not counted). */
size_t td_model_weight_bytes(const td_model *m);

#endif
