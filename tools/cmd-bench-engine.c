/* tandem bench-engine: prompt processing and generation speed measured the
 * way llama-bench measures them, so the two tools' numbers compare directly:
 *   ppN: one forward call over N random token ids into an empty KV cache
 *        (logits of the last token only);
 *   tgN: N single-token forward calls starting from an empty KV cache, each
 *        feeding a random token id (llama-bench's test_gen: no sampling).
 * With --depth D (llama-bench -d) the KV cache first holds D random tokens,
 * prefilled untimed, and the test runs at positions D onwards.
 * One warm-up run of each test, then r timed repetitions with a fresh KV
 * cache each; reported as mean +- sample standard deviation of tokens/s. */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <jansson.h>

#include "common/engine/forward.h"
#include "common/runtime/cli.h"
#include "common/runtime/runtime.h"
#include "tools.h"

#define BENCH_MAX_REPS 1000

enum {
    B_MODEL,
    B_N_PROMPT,
    B_N_GEN,
    B_DEPTH,
    B_REPS,
    B_THREADS,
    B_ISA,
    B_DEVICE,
    B_KV_DTYPE,
    B_ACT_INT8,
    B_MMAP,
    B_JSON,
    B_N
};
static td_opt k_bench_opts[B_N] = {
    /* the --model help names the default: set below */
    [B_MODEL] = {"model", 'm', "PATH", "GGUF file or Hugging Face directory"},
    [B_N_PROMPT] = {"n-prompt", 'p', "N", "prompt tokens (default 512; 0 skips pp)"},
    [B_N_GEN] = {"n-gen", 'n', "N", "generated tokens (default 128; 0 skips tg)"},
    [B_DEPTH] = {"depth", 'd', "N", "tokens already in the KV cache before each test (default 0)"},
    [B_REPS] = {"repetitions", 'r', "N", "timed repetitions (default 5)"},
    [B_THREADS] = {"threads", 't', "N",
                   "worker threads (default: every core); with a plan of\n"
                   "several ranks: threads per rank (default: cores / ranks)"},
    [B_ISA] = {"isa", 0, "NAME", "kernel set: scalar, avx2, avx512 (default: best available)"},
    [B_DEVICE] = {"device", 0, "D",
                  "device: cpu, cuda, cuda:N (default: a GPU when built and visible, else cpu)"},
    [B_KV_DTYPE] = {"kv-dtype", 0, "T", TD_KV_DTYPE_HELP},
    [B_ACT_INT8] = {"act-int8", 0, NULL, TD_ACT_INT8_HELP},
    [B_MMAP] = {"mmap", 0, NULL, TD_MMAP_HELP},
    [B_JSON] = {"json", 0, NULL, "one JSON object on stdout instead of the table"},
};

static void bench_usage(FILE *f, void *ctx) {
    TD_UNUSED(ctx);
    fprintf(f, "usage: tandem bench-engine [--model PATH] [-p N] [-n N] [-d N] [-r N]\n"
               "                           [--threads N] [--isa NAME] [--device D]\n"
               "                           [--kv-dtype T] [--act-int8] [--mmap] [--json]\n"
               "                           [plan flags]\n"
               "\n"
               "Measures prompt processing (ppN: N tokens in one batch) and generation (tgN:\n"
               "N tokens one at a time from an empty context) like llama-bench: one warm-up,\n"
               "then mean +- sd of tokens/s over the repetitions, a fresh KV cache each time.\n"
               "\n");
    td_opts_print(f, k_bench_opts, B_N);
    fprintf(f, "\nparallel plan:\n");
    td_cli_plan_usage(f);
}

typedef struct {
    const char *model, *isa, *device;
    long n_prompt, n_gen, depth, reps, threads;
    const char *kv_dtype;
    bool act_int8;
    bool mmap;
    bool json;
} bench_args;

static bool set_bench_opt(void *ctx, int i, const char *val, bool *printed) {
    bench_args *a = ctx;
    TD_UNUSED(printed);
    switch (i) {
    case B_MODEL: a->model = val; return true;
    case B_ISA: a->isa = val; return true;
    case B_DEVICE: a->device = val; return true;
    case B_N_PROMPT: return td_cli_parse_long(val, 0, 1 << 20, &a->n_prompt);
    case B_N_GEN: return td_cli_parse_long(val, 0, 1 << 20, &a->n_gen);
    case B_DEPTH: return td_cli_parse_long(val, 0, 1 << 20, &a->depth);
    case B_KV_DTYPE: return td_cli_parse_kv_dtype(val, &a->kv_dtype);
    case B_ACT_INT8: a->act_int8 = true; return true;
    case B_MMAP: a->mmap = true; return true;
    case B_REPS: return td_cli_parse_long(val, 1, BENCH_MAX_REPS, &a->reps);
    case B_THREADS: return td_cli_parse_long(val, 1, 4096, &a->threads);
    case B_JSON: a->json = true; return true;
    }
    return false;
}

/* splitmix64: random token ids that do not depend on libc's rand(). */
static uint64_t bench_rand(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

#define BENCH_MAX_RANKS 64

typedef struct {
    td_runtime *rt;
    /* per-rank compute / comm seconds summed over the steps of the timed
     * repetitions of the test running now (acc false: warm-up) */
    bool acc;
    double rank_compute[BENCH_MAX_RANKS], rank_comm[BENCH_MAX_RANKS];
    int64_t steps;
    int32_t *blocks;      /* (blocks for depth + the longest test) */
    int32_t *tokens;      /* (max(n_prompt, depth chunk)) */
    int32_t depth, chunk; /* tokens before each test; prefilled chunk tokens per step */
    float *logits;        /* (n_vocab) */
    uint64_t rng;
} bench_ctx;

/* One step, adding the ranks' times when the context accumulates. */
static td_status bench_step(bench_ctx *b, const td_seq_chunk *c) {
    td_status st = td_runtime_forward(b->rt, c, 1, b->logits);
    if (st == TD_OK && b->acc) {
        td_rank_time t[BENCH_MAX_RANKS];
        int n = TD_MIN(td_exec_last_times(b->rt->exec, t, BENCH_MAX_RANKS), BENCH_MAX_RANKS);
        for (int r = 0; r < n; r++) {
            b->rank_compute[r] += t[r].compute_s;
            b->rank_comm[r] += t[r].comm_s;
        }
        b->steps++;
    }
    return st;
}

/* Allocates the blocks of depth + n tokens and prefills the depth tokens
 * (untimed); false on error, with nothing held. */
static bool begin_test(bench_ctx *b, int32_t n, int32_t *nb) {
    *nb = td_runtime_blocks_for(b->rt, b->depth + n);
    if (td_kv_block_alloc(b->rt->kv, *nb, b->blocks) != TD_OK) {
        fprintf(stderr, "tandem bench-engine: KV pool too small for %d tokens\n", b->depth + n);
        return false;
    }
    int32_t nv = b->rt->cfg->n_vocab;
    for (int32_t p = 0; p < b->depth; p += b->chunk) {
        int32_t m = TD_MIN(b->chunk, b->depth - p);
        for (int32_t i = 0; i < m; i++)
            b->tokens[i] = (int32_t)(bench_rand(&b->rng) % (uint64_t)nv);
        td_seq_chunk c = {.tokens = b->tokens,
                          .n_tokens = m,
                          .pos0 = p,
                          .block_table = b->blocks,
                          .n_blocks = td_runtime_blocks_for(b->rt, p + m)};
        td_status st = td_runtime_forward(b->rt, &c, 1, b->logits);
        if (st != TD_OK) {
            fprintf(stderr, "tandem bench-engine: forward failed: %s\n", td_status_str(st));
            td_kv_block_free(b->rt->kv, b->blocks, *nb);
            return false;
        }
    }
    return true;
}

/* Seconds for one ppN run, or < 0 on error. */
static double run_pp(bench_ctx *b, int32_t n) {
    int32_t nb;
    if (!begin_test(b, n, &nb)) return -1;
    int32_t nv = b->rt->cfg->n_vocab;
    for (int32_t i = 0; i < n; i++) b->tokens[i] = (int32_t)(bench_rand(&b->rng) % (uint64_t)nv);
    td_seq_chunk c = {.tokens = b->tokens,
                      .n_tokens = n,
                      .pos0 = b->depth,
                      .block_table = b->blocks,
                      .n_blocks = nb};
    double t0 = td_time_s();
    td_status st = bench_step(b, &c);
    double t = td_time_s() - t0;
    td_kv_block_free(b->rt->kv, b->blocks, nb);
    if (st != TD_OK) {
        fprintf(stderr, "tandem bench-engine: forward failed: %s\n", td_status_str(st));
        return -1;
    }
    return t;
}

/* Seconds for one tgN run, or < 0 on error. */
static double run_tg(bench_ctx *b, int32_t n) {
    int32_t nb;
    if (!begin_test(b, n, &nb)) return -1;
    int32_t nv = b->rt->cfg->n_vocab;
    int32_t bos = td_tokenizer_bos(b->rt->tok);
    int32_t tok = b->depth == 0 && td_tokenizer_adds_bos(b->rt->tok) && bos >= 0
                      ? bos
                      : (int32_t)(bench_rand(&b->rng) % (uint64_t)nv);
    td_status st = TD_OK;
    double t0 = td_time_s();
    for (int32_t i = b->depth; i < b->depth + n && st == TD_OK; i++) {
        td_seq_chunk c = {.tokens = &tok,
                          .n_tokens = 1,
                          .pos0 = i,
                          .block_table = b->blocks,
                          .n_blocks = td_runtime_blocks_for(b->rt, i + 1)};
        st = bench_step(b, &c);
        tok = (int32_t)(bench_rand(&b->rng) % (uint64_t)nv);
    }
    double t = td_time_s() - t0;
    td_kv_block_free(b->rt->kv, b->blocks, nb);
    if (st != TD_OK) {
        fprintf(stderr, "tandem bench-engine: forward failed: %s\n", td_status_str(st));
        return -1;
    }
    return t;
}

typedef struct {
    char name[32];
    int32_t n_prompt, n_gen, n_depth;
    double ts[BENCH_MAX_REPS]; /* tokens/s per repetition */
    double ns[BENCH_MAX_REPS]; /* nanoseconds per repetition */
    int n;
    double avg, sd;
    int n_ranks;
    double step_compute_ms[BENCH_MAX_RANKS], step_comm_ms[BENCH_MAX_RANKS]; /* mean per step */
} bench_result;

static void summarise(bench_result *r) {
    double s = 0;
    for (int i = 0; i < r->n; i++) s += r->ts[i];
    r->avg = s / r->n;
    double v = 0;
    for (int i = 0; i < r->n; i++) v += (r->ts[i] - r->avg) * (r->ts[i] - r->avg);
    r->sd = r->n > 1 ? sqrt(v / (r->n - 1)) : 0.0;
}

/* Parameters counted from the configuration (whole model, as llama-bench). */
static double count_params(const td_model_config *c) {
    double hd = c->head_dim, e = c->n_embd;
    double attn = e * c->n_head * hd * 2 + e * c->n_head_kv * hd * 2;
    if (c->qkv_bias) attn += (c->n_head + 2.0 * c->n_head_kv) * hd;
    double layer = attn + 3.0 * e * c->n_ff + 2.0 * e;
    double total = (double)c->n_vocab * e + c->n_layer * layer + e;
    if (!c->tied_output) total += (double)c->n_vocab * e;
    return total;
}

/* Bytes on disk: the file, or the sum of a directory's .safetensors files. */
static uint64_t model_size_bytes(const char *path) {
    struct stat sb;
    if (stat(path, &sb) != 0) return 0;
    if (!S_ISDIR(sb.st_mode)) return (uint64_t)sb.st_size;
    uint64_t total = 0;
    DIR *d = opendir(path);
    if (!d) return 0;
    struct dirent *de;
    char sub[4096];
    while ((de = readdir(d)) != NULL) {
        size_t n = strlen(de->d_name);
        if (n < 12 || strcmp(de->d_name + n - 12, ".safetensors") != 0) continue;
        int w = snprintf(sub, sizeof sub, "%s/%s", path, de->d_name);
        if (w > 0 && (size_t)w < sizeof sub && stat(sub, &sb) == 0) total += (uint64_t)sb.st_size;
    }
    closedir(d);
    return total;
}

int td_cmd_bench_engine(int argc, char **argv) {
    bench_args ba = {.n_prompt = 512, .n_gen = 128, .reps = 5};
    td_cli_plan plan = {.p = td_plan_default_params()};
    k_bench_opts[B_MODEL].help = td_cli_model_help();
    td_optset sets[] = {{k_bench_opts, B_N, set_bench_opt, &ba}, td_cli_plan_optset(&plan)};
    int orc = td_opts_parse("tandem bench-engine", argc, argv, sets, 2, bench_usage, NULL);
    if (orc) return orc == 1 ? 0 : 2;
    const char *model = ba.model, *isa = ba.isa, *device = ba.device;
    long n_prompt = ba.n_prompt, n_gen = ba.n_gen, reps = ba.reps, threads = ba.threads;
    bool json = ba.json;
    if (n_prompt == 0 && n_gen == 0) {
        fprintf(stderr, "tandem bench-engine: nothing to measure (-p 0 and -n 0)\n");
        return 2;
    }
    int prc = td_cli_plan_check("bench-engine", &plan, model ? model : td_default_model_path());
    if (prc >= 0) return prc;

    int exit_code = 1;
    bench_ctx b = {.rng = 0x7a6e64656d2d6265ull};
    bench_result *res = calloc(2, sizeof *res);
    int n_res = 0;
    int32_t depth = (int32_t)ba.depth, longest = depth + (int32_t)TD_MAX(n_prompt, n_gen);
    b.depth = depth;
    b.chunk = (int32_t)TD_MAX(n_prompt, TD_MIN(depth, 512));
    if (b.chunk < 1) b.chunk = 1;
    td_runtime_params rp = td_runtime_default_params();
    rp.model_path = model;
    rp.isa_name = isa;
    rp.device = device;
    rp.n_threads = (int)threads;
    rp.ctx_len = longest;
    rp.n_seqs = 1;
    rp.max_batch_tokens = b.chunk;
    rp.kv_dtype = ba.kv_dtype;
    rp.act_int8 = ba.act_int8;
    rp.mmap_weights = ba.mmap;
    rp.quiet = json;
    rp.plan = &plan.p;
    if (!res) goto out;
    if (td_runtime_open(&rp, &b.rt) != TD_OK) goto out;
    b.blocks = malloc((size_t)td_runtime_blocks_for(b.rt, longest) * sizeof *b.blocks);
    b.tokens = malloc((size_t)b.chunk * sizeof *b.tokens);
    b.logits = malloc((size_t)b.rt->cfg->n_vocab * sizeof *b.logits);
    if (!b.blocks || !b.tokens || !b.logits) {
        fprintf(stderr, "tandem bench-engine: out of memory\n");
        goto out;
    }

    for (int test = 0; test < 2; test++) {
        int32_t n = (int32_t)(test == 0 ? n_prompt : n_gen);
        if (n == 0) continue;
        bench_result *r = &res[n_res++];
        if (depth > 0)
            snprintf(r->name, sizeof r->name, "%s%d@d%d", test == 0 ? "pp" : "tg", n, depth);
        else
            snprintf(r->name, sizeof r->name, "%s%d", test == 0 ? "pp" : "tg", n);
        r->n_depth = depth;
        r->n_prompt = test == 0 ? n : 0;
        r->n_gen = test == 0 ? 0 : n;
        /* Warm-up: pages the weights in and settles the thread pool. */
        b.acc = false;
        if ((test == 0 ? run_pp(&b, n) : run_tg(&b, n)) < 0) goto out;
        b.acc = true;
        b.steps = 0;
        memset(b.rank_compute, 0, sizeof b.rank_compute);
        memset(b.rank_comm, 0, sizeof b.rank_comm);
        for (long k = 0; k < reps; k++) {
            double t = test == 0 ? run_pp(&b, n) : run_tg(&b, n);
            if (t < 0) goto out;
            r->ns[r->n] = t * 1e9;
            r->ts[r->n] = t > 0 ? n / t : 0;
            r->n++;
        }
        summarise(r);
        r->n_ranks = TD_MIN(td_exec_world(b.rt->exec), BENCH_MAX_RANKS);
        for (int q = 0; q < r->n_ranks && b.steps > 0; q++) {
            r->step_compute_ms[q] = b.rank_compute[q] * 1e3 / (double)b.steps;
            r->step_comm_ms[q] = b.rank_comm[q] * 1e3 / (double)b.steps;
        }
    }

    const char *path = model ? model : td_default_model_path();
    uint64_t size = model_size_bytes(path);
    double params = count_params(b.rt->cfg);
    size_t wbytes = td_exec_weight_bytes(b.rt->exec); /* the whole model's, over the ranks */
    int nth = b.rt->n_threads;
    const char *isa_name = td_backend_isa_name(b.rt->isa);
    if (json) {
        json_t *o = json_object(), *tests = json_array();
        json_object_set_new(o, "model", json_string(path));
        json_object_set_new(o, "model_name", json_string(b.rt->cfg->name));
        json_object_set_new(o, "model_size", json_integer((json_int_t)size));
        json_object_set_new(o, "n_params", json_integer((json_int_t)params));
        json_object_set_new(o, "weight_type", json_string(td_dtype_name(b.rt->cfg->wtype)));
        json_object_set_new(o, "weight_bytes_per_token", json_integer((json_int_t)wbytes));
        json_object_set_new(o, "threads", json_integer(nth));
        json_object_set_new(o, "isa", json_string(isa_name));
        json_object_set_new(o, "kv_dtype", json_string(td_dtype_name(b.rt->kv_dtype)));
        json_object_set_new(o, "act_int8", json_boolean(ba.act_int8));
        json_object_set_new(o, "mmap", json_boolean(ba.mmap));
        /* K and V of one position, every layer (rank 0's pool) */
        const td_kv_params *kvp = td_kv_pool_params(b.rt->kv);
        json_object_set_new(
            o, "kv_bytes_per_position",
            json_integer((json_int_t)(td_kv_block_bytes(kvp) / (size_t)kvp->block_size)));
        json_object_set_new(o, "repetitions", json_integer(reps));
        json_object_set_new(o, "world", json_integer(td_exec_world(b.rt->exec)));
        for (int i = 0; i < n_res; i++) {
            json_t *t = json_object(), *ts = json_array(), *ns = json_array();
            json_object_set_new(t, "test", json_string(res[i].name));
            json_object_set_new(t, "n_prompt", json_integer(res[i].n_prompt));
            json_object_set_new(t, "n_gen", json_integer(res[i].n_gen));
            json_object_set_new(t, "n_depth", json_integer(res[i].n_depth));
            json_object_set_new(t, "avg_ts", json_real(res[i].avg));
            json_object_set_new(t, "stddev_ts", json_real(res[i].sd));
            for (int k = 0; k < res[i].n; k++) {
                json_array_append_new(ts, json_real(res[i].ts[k]));
                json_array_append_new(ns, json_integer((json_int_t)res[i].ns[k]));
            }
            json_object_set_new(t, "samples_ts", ts);
            json_object_set_new(t, "samples_ns", ns);
            json_t *ranks = json_array();
            for (int q = 0; q < res[i].n_ranks; q++) {
                json_t *rk = json_object();
                json_object_set_new(rk, "step_compute_ms", json_real(res[i].step_compute_ms[q]));
                json_object_set_new(rk, "step_comm_ms", json_real(res[i].step_comm_ms[q]));
                json_array_append_new(ranks, rk);
            }
            json_object_set_new(t, "ranks", ranks);
            json_array_append_new(tests, t);
        }
        json_object_set_new(o, "tests", tests);
        char *txt = json_dumps(o, JSON_INDENT(2));
        json_decref(o);
        if (!txt) goto out;
        printf("%s\n", txt);
        free(txt);
    } else {
        char sz[32], pr[32];
        snprintf(sz, sizeof sz, "%.2f MiB", (double)size / (1024.0 * 1024.0));
        snprintf(pr, sizeof pr, "%.2f M", params / 1e6);
        printf("| %-24s | %12s | %10s | %7s | %6s | %13s | %20s |\n", "model", "size", "params",
               "threads", "isa", "test", "t/s");
        printf("| %.24s | %.12s | %.10s | %.7s | %.6s | %.13s | %.20s |\n",
               "------------------------------", "--------------------", "--------------------",
               "----------", "--------", "----------------", "------------------------------");
        for (int i = 0; i < n_res; i++) {
            char tsb[48];
            snprintf(tsb, sizeof tsb, "%.2f ± %.2f", res[i].avg, res[i].sd);
            printf("| %-24.24s | %12s | %10s | %7d | %6s | %13s | %21s |\n", b.rt->cfg->name, sz,
                   pr, nth, isa_name, res[i].name, tsb);
        }
        printf("\nweight bytes read per generated token: %zu (%.2f MiB)\n", wbytes,
               (double)wbytes / (1024.0 * 1024.0));
        if (td_exec_world(b.rt->exec) > 1) {
            printf("\nper step and rank, mean over the timed repetitions (ms): compute / comm\n");
            for (int i = 0; i < n_res; i++) {
                printf("%-13s", res[i].name);
                for (int q = 0; q < res[i].n_ranks; q++)
                    printf("  r%d %.3f / %.3f", q, res[i].step_compute_ms[q],
                           res[i].step_comm_ms[q]);
                printf("\n");
            }
        }
    }
    exit_code = 0;

out:
    free(b.blocks);
    free(b.tokens);
    free(b.logits);
    free(res);
    td_runtime_close(b.rt);
    return exit_code;
}
