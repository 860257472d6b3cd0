/* In-process runtime for the CLI commands: ISA, thread pool, model, KV
 * pool, comm and engine, brought up and torn down in one place; and the
 * option parsers every command shares. */
#include "runtime.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tools.h"

#define DEFAULT_MODEL_FILE "SmolLM2-135M-Instruct.Q4_1.gguf"

const char *td_default_model_path(void) {
    static char buf[4096];
    const char *env = getenv("TANDEM_MODEL");
    if (env && env[0]) {
        snprintf(buf, sizeof buf, "%s", env);
        return buf;
    }
    const char *xdg = getenv("XDG_CACHE_HOME");
    if (xdg && xdg[0]) {
        snprintf(buf, sizeof buf, "%s/tandem/models/%s", xdg, DEFAULT_MODEL_FILE);
        return buf;
    }
    const char *home = getenv("HOME");
    snprintf(buf, sizeof buf, "%s/.cache/tandem/models/%s", home && home[0] ? home : ".",
             DEFAULT_MODEL_FILE);
    return buf;
}

bool td_cli_parse_long(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

bool td_cli_parse_float(const char *s, float *out) {
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end || !isfinite(v)) return false;
    *out = v;
    return true;
}

bool td_cli_parse_u64(const char *s, uint64_t *out) {
    char *end;
    errno = 0;
    if (*s == '-') return false;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end) return false;
    *out = (uint64_t)v;
    return true;
}

td_runtime_params td_runtime_default_params(void) {
    td_runtime_params p = {.model_path = NULL,
                           .n_threads = 0,
                           .isa_name = NULL,
                           .ctx_len = 0,
                           .n_seqs = 1,
                           .max_batch_tokens = 0,
                           .max_seqs = 0,
                           .block_size = 0,
                           .kv_blocks = 0,
                           .kv_memory = 0,
                           .quiet = false};
    return p;
}

int32_t td_runtime_blocks_for(const td_runtime *rt, int32_t n_tokens) {
    /* in 64 bits: n_tokens near INT32_MAX (--ctx) must not wrap negative */
    return (int32_t)(((int64_t)n_tokens + rt->block_size - 1) / rt->block_size);
}

static td_status select_isa(const td_runtime_params *p, td_isa *isa_p) {
    td_isa isa = td_cpu_isa_best();
    if (p->isa_name) {
        int i = td_cpu_isa_parse(p->isa_name);
        if (i < 0) {
            TD_LOG_ERROR("unknown ISA '%s' (scalar, avx2, avx512)", p->isa_name);
            return TD_ERR_INVALID;
        }
        isa = (td_isa)i;
    }
    if (!td_cpu_select(isa)) {
        TD_LOG_ERROR("this CPU cannot run the %s kernels", td_cpu_isa_name(isa));
        return TD_ERR_UNSUPPORTED;
    }
    *isa_p = isa;
    return TD_OK;
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
    if ((st = select_isa(p, &rt->isa))) goto fail;
    if (!p->quiet) fprintf(stderr, "isa: %s\n", td_cpu_isa_name(rt->isa));
    if ((st = td_threadpool_create(p->n_threads, &rt->tp))) goto fail;

    td_model_params mp = td_model_default_params();
    mp.path = p->model_path ? p->model_path : td_default_model_path();
    if ((st = td_model_load(&mp, &rt->model))) goto fail;
    rt->cfg = td_model_get_config(rt->model);
    rt->tok = td_model_tokenizer(rt->model);

    int32_t ctx = p->ctx_len > 0 ? p->ctx_len : TD_MIN(rt->cfg->n_ctx_train, 4096);
    int32_t n_seqs = p->n_seqs > 0 ? p->n_seqs : 1;
    td_kv_params kp = td_kv_default_params();
    kp.n_layers = td_model_layer_end(rt->model) - td_model_layer_begin(rt->model);
    kp.n_kv_heads = td_model_n_head_kv_local(rt->model);
    kp.head_dim = rt->cfg->head_dim;
    if (p->block_size > 0) kp.block_size = p->block_size;
    rt->block_size = kp.block_size;
    rt->ctx_len = ctx;
    int64_t blocks = (int64_t)td_runtime_blocks_for(rt, ctx) * n_seqs;
    if (p->kv_blocks > 0) {
        blocks = p->kv_blocks;
    } else if (p->kv_memory > 0) {
        size_t per = td_kv_block_bytes(&kp);
        blocks = per ? (int64_t)(p->kv_memory / per) : 0;
        if (blocks < 1) {
            TD_LOG_ERROR("--kv-memory %zu bytes holds no KV block (%zu bytes each)", p->kv_memory,
                         per);
            st = TD_ERR_INVALID;
            goto fail;
        }
    }
    if (blocks > INT32_MAX) {
        TD_LOG_ERROR("KV pool of %lld blocks is too large", (long long)blocks);
        st = TD_ERR_RANGE;
        goto fail;
    }
    kp.n_blocks = (int32_t)blocks;
    if ((st = td_kv_pool_create(&kp, &rt->kv))) goto fail;
    if ((st = td_comm_create_single(&rt->comm))) goto fail;

    td_engine_params ep = td_engine_default_params();
    ep.max_ctx = ctx;
    ep.max_batch_tokens = p->max_batch_tokens > 0 ? p->max_batch_tokens : 512;
    ep.max_seqs = p->max_seqs > 0 ? p->max_seqs : TD_MAX(n_seqs, 1);
    if ((st = td_engine_create(rt->model, rt->kv, rt->tp, rt->comm, &ep, &rt->engine))) goto fail;
    if (!p->quiet)
        fprintf(stderr, "model: %s (%d layers, %d embd, vocab %d, %s), %d threads\n", rt->cfg->name,
                rt->cfg->n_layer, rt->cfg->n_embd, rt->cfg->n_vocab, td_dtype_name(rt->cfg->wtype),
                td_threadpool_size(rt->tp));
    *rt_p = rt;
    return TD_OK;
fail:
    td_runtime_close(rt);
    return st;
}

void td_runtime_close(td_runtime *rt) {
    if (!rt) return;
    td_engine_destroy(rt->engine);
    td_comm_destroy(rt->comm);
    td_kv_pool_destroy(rt->kv);
    td_model_free(rt->model);
    td_threadpool_destroy(rt->tp);
    free(rt);
}
