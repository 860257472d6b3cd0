/* In-process runtime for the CLI commands: ISA, thread pool, model, KV
 * pool, comm and engine, brought up and torn down in one place. */
#include "runtime.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

td_runtime_params td_runtime_default_params(void) {
    td_runtime_params p = {.model_path = NULL,
                           .n_threads = 0,
                           .isa_name = NULL,
                           .ctx_len = 0,
                           .n_seqs = 1,
                           .max_batch_tokens = 0,
                           .max_seqs = 0,
                           .block_size = 0,
                           .kv_dtype = NULL,
                           .kv_blocks = 0,
                           .kv_memory = 0,
                           .quiet = false};
    return p;
}

td_status td_runtime_forward(td_runtime *rt, const td_seq_chunk *seqs, int32_t n_seqs,
                             float *logits) {
    return td_exec_forward(rt->exec, seqs, n_seqs, logits);
}

int32_t td_runtime_blocks_for(const td_runtime *rt, int32_t n_tokens) {
    /* in 64 bits: n_tokens near INT32_MAX (--ctx) must not wrap negative */
    return (int32_t)(((int64_t)n_tokens + rt->block_size - 1) / rt->block_size);
}

/* The compute backend every engine of this process and its rank processes
 * creates (they read TANDEM_BACKEND, which the rank processes inherit).
 * *auto_cuda: the choice was cuda by default, so a model the GPU cannot
 * run falls back to the CPU. */
static td_status select_device(const td_runtime_params *p, bool *auto_cuda) {
    *auto_cuda = false;
    const char *name = p->device;
    const char *env = getenv("TANDEM_BACKEND");
    if (!name && env && *env) return TD_OK; /* td_backend_kind_from_env reports a bad one */
    const int n_gpus = td_backend_cuda_devices();
    if (!name) {
        *auto_cuda = n_gpus > 0;
        name = *auto_cuda ? "cuda:0" : "cpu";
    }
    td_backend_kind kind;
    int dev;
    if (td_backend_parse(name, &kind, &dev) != TD_OK || kind == TD_BACKEND_CPU_CHECK) {
        TD_LOG_ERROR("unknown device '%s' (cpu, cuda, cuda:N)", name);
        return TD_ERR_INVALID;
    }
    if (kind == TD_BACKEND_CUDA && !td_backend_cuda_built()) {
        TD_LOG_ERROR("--device %s: this build has no CUDA backend (configure with -DTD_CUDA=ON "
                     "where the CUDA toolkit is)",
                     name);
        return TD_ERR_UNSUPPORTED;
    }
    if (kind == TD_BACKEND_CUDA && dev >= n_gpus) {
        TD_LOG_ERROR("--device %s: no such GPU (%d visible)", name, n_gpus);
        return TD_ERR_UNSUPPORTED;
    }
    setenv("TANDEM_BACKEND", kind == TD_BACKEND_CUDA ? name : "cpu", 1);
    return TD_OK;
}

static td_status select_isa(const td_runtime_params *p, td_isa *isa_p) {
    td_isa isa = td_backend_isa_best();
    if (p->isa_name) {
        int i = td_backend_isa_parse(p->isa_name);
        if (i < 0) {
            TD_LOG_ERROR("unknown ISA '%s' (scalar, avx2, avx512)", p->isa_name);
            return TD_ERR_INVALID;
        }
        isa = (td_isa)i;
    }
    if (!td_backend_isa_select(isa)) {
        TD_LOG_ERROR("this CPU cannot run the %s kernels", td_backend_isa_name(isa));
        return TD_ERR_UNSUPPORTED;
    }
    *isa_p = isa;
    return TD_OK;
}

/* The KV dtype when none is given: f16 on the CPU (half the bytes per
 * position of f32 to store, read and transfer, docs/PERFORMANCE.md); f32
 * on a GPU, whose attention kernels read f32 only. */
static td_dtype kv_dtype_auto(void) {
    return td_backend_kind_from_env() == TD_BACKEND_CUDA ? TD_TYPE_F32 : TD_TYPE_F16;
}

td_status td_runtime_open(const td_runtime_params *p, td_runtime **rt_p) {
    td_runtime_params dp = td_runtime_default_params();
    if (!p) p = &dp;
    if (!rt_p) return TD_ERR_INVALID;
    td_runtime *rt = calloc(1, sizeof *rt);
    if (!rt) {
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    td_status st;
    bool auto_cuda;
    if ((st = select_isa(p, &rt->isa)) || (st = select_device(p, &auto_cuda))) goto fail;
    if (p->act_int8 && td_backend_kind_from_env() == TD_BACKEND_CUDA) {
        TD_LOG_ERROR("--act-int8 is a CPU backend option (--device cpu)");
        st = TD_ERR_INVALID;
        goto fail;
    }
    if (!p->quiet)
        fprintf(stderr, "isa: %s\nbackend: %s\n", td_backend_isa_name(rt->isa),
                getenv("TANDEM_BACKEND") && td_backend_kind_from_env() == TD_BACKEND_CUDA
                    ? getenv("TANDEM_BACKEND")
                    : td_backend_kind_name(td_backend_kind_from_env()));
    td_exec_params xp = td_exec_default_params();
    xp.model_path = p->model_path ? p->model_path : td_default_model_path();
    if (p->plan) xp.plan = *p->plan;
    xp.engine.max_ctx = p->ctx_len;
    xp.engine.max_batch_tokens = p->max_batch_tokens > 0 ? p->max_batch_tokens : 512;
    xp.engine.max_seqs = p->max_seqs > 0 ? p->max_seqs : TD_MAX(p->n_seqs, 1);
    xp.block_size = p->block_size > 0 ? p->block_size : 16;
    if (p->kv_dtype && !td_kv_dtype_parse(p->kv_dtype, &xp.kv_dtype)) {
        TD_LOG_ERROR("unknown KV dtype '%s' (f32, f16, bf16)", p->kv_dtype);
        st = TD_ERR_INVALID;
        goto fail;
    }
    if (!p->kv_dtype) xp.kv_dtype = kv_dtype_auto();
    xp.kv_blocks = p->kv_blocks;
    xp.kv_memory = p->kv_memory;
    xp.kv_seqs = p->n_seqs > 0 ? p->n_seqs : 1;
    xp.n_threads = p->n_threads;
    xp.isa = rt->isa;
    xp.act_int8 = p->act_int8;
    xp.weight_copy = !p->mmap_weights;
    st = td_exec_create(&xp, &rt->exec);
    if (st == TD_ERR_UNSUPPORTED && auto_cuda) {
        TD_LOG_WARN("the GPU backend cannot run this model (see above): using the CPU "
                    "(--device cpu says so up front)");
        setenv("TANDEM_BACKEND", "cpu", 1);
        if (!p->quiet) fprintf(stderr, "backend: cpu\n");
        if (!p->kv_dtype) xp.kv_dtype = kv_dtype_auto();
        st = td_exec_create(&xp, &rt->exec);
    }
    if (st) goto fail;
    rt->model = td_exec_model(rt->exec);
    rt->kv = td_exec_kv(rt->exec);
    rt->cfg = td_model_get_config(rt->model);
    rt->tok = td_model_tokenizer(rt->model);
    rt->n_threads = td_exec_threads_per_rank(rt->exec);
    rt->block_size = xp.block_size;
    rt->kv_dtype = xp.kv_dtype;
    rt->ctx_len = td_exec_max_ctx(rt->exec);
    if (!p->quiet)
        fprintf(stderr, "model: %s (%d layers, %d embd, vocab %d, %s), %d threads, KV cache %s%s\n",
                rt->cfg->name, rt->cfg->n_layer, rt->cfg->n_embd, rt->cfg->n_vocab,
                td_dtype_name(rt->cfg->wtype), rt->n_threads, td_dtype_name(rt->kv_dtype),
                p->act_int8 ? ", int8 activations" : "");
    *rt_p = rt;
    return TD_OK;
fail:
    td_runtime_close(rt);
    return st;
}

void td_runtime_close(td_runtime *rt) {
    if (!rt) return;
    td_exec_destroy(rt->exec);
    free(rt);
}
