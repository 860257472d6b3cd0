/* Shared set-up for the CLI commands that run the model (generate,
 * bench-engine, eval, serve): selects the kernel ISA and brings up the
 * parallel plan's executor (parallel/exec.h: on one rank the thread pool,
 * model, KV pool and engine in-process; on more, the rank processes too).
 *
 * Not thread-safe; one runtime per process is the expected use. */
#ifndef TD_RUNTIME_RUNTIME_H
#define TD_RUNTIME_RUNTIME_H

#include "common/base/threadpool.h"
#include "common/comm/comm.h"
#include "common/engine/forward.h"
#include "common/kv/kv.h"
#include "common/model/model.h"
#include "common/parallel/exec.h"
#include "common/parallel/plan.h"

typedef struct {
    const char *model_path;     /* NULL: td_default_model_path() */
    int n_threads;              /* <= 0: every online core */
    const char *isa_name;       /* NULL: best this CPU runs; else "scalar" | "avx2" | "avx512" */
    const char *device;         /* "cpu" | "cuda" | "cuda:N" | NULL (auto: TANDEM_BACKEND if set,
                                 * else cuda:0 when CUDA is built and a GPU is visible and
                                 * the model runs on it, else cpu) */
    int32_t ctx_len;            /* tokens of KV per sequence; <= 0: min(n_ctx_train, 4096) */
    int32_t n_seqs;             /* sequences that may hold ctx_len tokens at once (default 1) */
    int32_t max_batch_tokens;   /* most tokens per forward call; <= 0: 512 */
    int32_t max_seqs;           /* most sequences per forward call; <= 0: n_seqs */
    int32_t block_size;         /* KV block size in tokens; <= 0: 16 */
    const char *kv_dtype;       /* of the K and V elements: "f32" | "f16" | "bf16" | NULL
                                 * (f16 on the CPU; f32 on a GPU, whose kernels read f32) */
    int32_t kv_blocks;          /* > 0: pool of exactly this many blocks (overrides n_seqs) */
    size_t kv_memory;           /* > 0: pool of as many blocks as fit in this many bytes */
    bool act_int8;              /* CPU: quantized-weight matmuls on int8 activations
                                 * (td_backend_set_act_int8; default f32) */
    bool mmap_weights;          /* CPU: matmuls read the weights in place in the file
                                 * mapping, not a private huge-page copy
                                 * (td_backend_set_weight_copy; default: the copy) */
    bool quiet;                 /* do not print the ISA / model summary on stderr */
    const td_plan_params *plan; /* NULL: one rank */
} td_runtime_params;

typedef struct {
    td_exec *exec;
    const td_model *model;      /* rank 0's shard, borrowed from exec */
    td_kv_pool *kv;             /* rank 0's pool (block ids of every rank), borrowed */
    int n_threads;              /* per rank */
    const td_model_config *cfg; /* borrowed from model */
    const td_tokenizer *tok;    /* borrowed from model */
    td_isa isa;                 /* the selected kernel set */
    int32_t ctx_len;            /* effective tokens per sequence */
    int32_t block_size;         /* KV block size (tokens) */
    td_dtype kv_dtype;          /* of the KV cache */
} td_runtime;

td_runtime_params td_runtime_default_params(void);

/* Brings everything up; on failure logs one line (where the error is first
 * understood) and returns its status, leaving nothing allocated.
 * Prints "isa: NAME" on stderr unless p->quiet. Free with td_runtime_close(). */
td_status td_runtime_open(const td_runtime_params *p, td_runtime **rt_p);
void td_runtime_close(td_runtime *rt); /* accepts NULL */

/* One step through the plan (td_exec_forward). */
td_status td_runtime_forward(td_runtime *rt, const td_seq_chunk *seqs, int32_t n_seqs,
                             float *logits);

/* Blocks needed for n tokens. */
int32_t td_runtime_blocks_for(const td_runtime *rt, int32_t n_tokens);

#endif
