/* tandem eval: logits of every position of token sequences, for the
 * numerics tests.
 *
 *   tandem eval --model PATH --tokens IN.json --out OUT.bin [--threads N]
 *               [--chunk N] [--batch] [--isa NAME]
 *
 * IN.json is {"sequences": [[ids...], ...]}. OUT.bin is raw little-endian
 * float32: for each sequence in order, (len(seq), n_vocab) logits. --chunk N
 * prefills N tokens per forward call (default: the whole sequence); --batch
 * runs all sequences together, each call carrying the next chunk of every
 * unfinished sequence (default: one sequence at a time). A call never
 * carries more than the engine's batch limit; larger steps are split over
 * several calls, which the invariance contract makes equivalent. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "common/runtime/cli.h"
#include "common/runtime/runtime.h"
#include "tools.h"

#define EVAL_LOGIT_FLOATS (32u << 20) /* cap on one call's logits buffer (128 MiB) */

typedef struct {
    int32_t *ids;
    int32_t len;
    int32_t done;    /* tokens already run */
    int32_t *blocks; /* block table */
    int32_t n_blocks;
    float *out; /* (len, n_vocab) inside the output buffer */
} eval_seq;

enum {
    E_MODEL,
    E_TOKENS,
    E_OUT,
    E_THREADS,
    E_CHUNK,
    E_BATCH,
    E_ISA,
    E_KV_DTYPE,
    E_ACT_INT8,
    E_MMAP,
    E_N
};
static td_opt k_eval_opts[E_N] = {
    /* the --model help names the default: set below */
    [E_MODEL] = {"model", 'm', "PATH", "GGUF file or Hugging Face directory"},
    [E_TOKENS] = {"tokens", 0, "IN.json", "{\"sequences\": [[token ids], ...]}"},
    [E_OUT] = {"out", 0, "OUT.bin", "float32 logits, (len, n_vocab) per sequence, in order"},
    [E_THREADS] = {"threads", 0, "N", "worker threads (default: every core)"},
    [E_CHUNK] = {"chunk", 0, "N", "tokens per forward call (default: the whole sequence)"},
    [E_BATCH] = {"batch", 0, NULL, "every sequence in each call (default: one at a time)"},
    [E_ISA] = {"isa", 0, "NAME", "kernel set: scalar, avx2, avx512 (default: best available)"},
    [E_KV_DTYPE] = {"kv-dtype", 0, "T", TD_KV_DTYPE_HELP},
    [E_ACT_INT8] = {"act-int8", 0, NULL, TD_ACT_INT8_HELP},
    [E_MMAP] = {"mmap", 0, NULL, TD_MMAP_HELP},
};

static void usage(FILE *f, void *ctx) {
    TD_UNUSED(ctx);
    fprintf(f, "usage: tandem eval --model PATH --tokens IN.json --out OUT.bin [--threads N]\n"
               "                   [--chunk N] [--batch] [--isa NAME] [--kv-dtype T]\n"
               "                   [plan flags]\n\n");
    td_opts_print(f, k_eval_opts, E_N);
    fprintf(f, "\nparallel plan:\n");
    td_cli_plan_usage(f);
}

typedef struct {
    const char *model, *tokens, *out, *isa;
    long threads, chunk;
    const char *kv_dtype;
    bool act_int8;
    bool mmap;
    bool batch;
} eval_args;

static bool set_eval_opt(void *ctx, int i, const char *val, bool *printed) {
    eval_args *a = ctx;
    TD_UNUSED(printed);
    switch (i) {
    case E_MODEL: a->model = val; return true;
    case E_TOKENS: a->tokens = val; return true;
    case E_OUT: a->out = val; return true;
    case E_ISA: a->isa = val; return true;
    case E_BATCH: a->batch = true; return true;
    case E_KV_DTYPE: return td_cli_parse_kv_dtype(val, &a->kv_dtype);
    case E_ACT_INT8: a->act_int8 = true; return true;
    case E_MMAP: a->mmap = true; return true;
    /* the same bound as generate and bench-engine */
    case E_THREADS: return td_cli_parse_long(val, 1, 4096, &a->threads);
    case E_CHUNK: return td_cli_parse_long(val, 1, INT32_MAX, &a->chunk);
    }
    return false;
}

/* Reads the sequences; one error line on failure. */
static int read_tokens(const char *path, eval_seq **seqs_p, int32_t *n_p) {
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root) {
        fprintf(stderr, "tandem eval: %s: %s (line %d)\n", path, jerr.text, jerr.line);
        return -1;
    }
    int rc = -1;
    eval_seq *seqs = NULL;
    json_t *arr = json_object_get(root, "sequences");
    if (!json_is_object(root) || !json_is_array(arr)) {
        fprintf(stderr, "tandem eval: %s: expected {\"sequences\": [[ids...], ...]}\n", path);
        goto done;
    }
    size_t n = json_array_size(arr);
    if (n > 1000000) {
        fprintf(stderr, "tandem eval: %s: too many sequences (%zu)\n", path, n);
        goto done;
    }
    seqs = calloc(n ? n : 1, sizeof *seqs);
    if (!seqs) goto nomem;
    for (size_t i = 0; i < n; i++) {
        json_t *s = json_array_get(arr, i);
        if (!json_is_array(s) || json_array_size(s) > INT32_MAX / 2) {
            fprintf(stderr, "tandem eval: %s: sequence %zu is not an array of token ids\n", path,
                    i);
            goto done;
        }
        size_t len = json_array_size(s);
        seqs[i].len = (int32_t)len;
        seqs[i].ids = malloc((len ? len : 1) * sizeof(int32_t));
        if (!seqs[i].ids) goto nomem;
        for (size_t j = 0; j < len; j++) {
            json_t *t = json_array_get(s, j);
            if (!json_is_integer(t) || json_integer_value(t) < INT32_MIN ||
                json_integer_value(t) > INT32_MAX) {
                fprintf(stderr, "tandem eval: %s: sequence %zu, item %zu is not a token id\n", path,
                        i, j);
                goto done;
            }
            seqs[i].ids[j] = (int32_t)json_integer_value(t);
        }
    }
    *seqs_p = seqs;
    *n_p = (int32_t)n;
    seqs = NULL;
    rc = 0;
    goto done;
nomem:
    fprintf(stderr, "tandem eval: out of memory\n");
done:
    if (seqs) {
        for (size_t i = 0; i < json_array_size(arr); i++) free(seqs[i].ids);
        free(seqs);
    }
    json_decref(root);
    return rc;
}

/* Runs one forward call over the chunks and copies each chunk's logits
 * into its sequence's rows. */
static int run_call(td_runtime *rt, eval_seq **which, td_seq_chunk *chunks, int32_t n,
                    float *logits) {
    td_status st = td_runtime_forward(rt, chunks, n, logits);
    if (st) {
        fprintf(stderr, "tandem eval: forward pass failed: %s\n", td_status_str(st));
        return -1;
    }
    size_t V = (size_t)rt->cfg->n_vocab;
    size_t row = 0;
    for (int32_t i = 0; i < n; i++) {
        eval_seq *s = which[i];
        memcpy(s->out + (size_t)chunks[i].pos0 * V, logits + row * V,
               (size_t)chunks[i].n_tokens * V * sizeof(float));
        row += (size_t)chunks[i].n_tokens;
        s->done += chunks[i].n_tokens;
    }
    return 0;
}

int td_cmd_eval(int argc, char **argv) {
    eval_args ea = {0};
    td_cli_plan cp = {.p = td_plan_default_params()};
    k_eval_opts[E_MODEL].help = td_cli_model_help();
    td_optset sets[] = {{k_eval_opts, E_N, set_eval_opt, &ea}, td_cli_plan_optset(&cp)};
    int orc = td_opts_parse("tandem eval", argc, argv, sets, 2, usage, NULL);
    if (orc) return orc == 1 ? 0 : 2;
    if (!cp.dry_run && (!ea.tokens || !ea.out)) {
        fprintf(stderr, "tandem eval: --tokens and --out are needed (see --help)\n");
        return 2;
    }
    if (cp.dry_run) /* (a plan that does not fit fails in td_runtime_open, as before) */
        return td_cli_plan_check("eval", &cp, ea.model ? ea.model : td_default_model_path());
    const char *model = ea.model, *tokens = ea.tokens, *out = ea.out, *isa = ea.isa;
    int threads = (int)ea.threads, chunk = (int)ea.chunk, batch = ea.batch;
    td_plan_params plan = cp.p;

    eval_seq *seqs = NULL;
    int32_t n_seqs = 0;
    if (read_tokens(tokens, &seqs, &n_seqs)) return 1;

    int rc = 1;
    td_runtime *rt = NULL;
    float *all = NULL, *logits = NULL;
    td_seq_chunk *chunks = NULL;
    eval_seq **which = NULL;
    FILE *f = NULL;
    int32_t max_len = 1;
    size_t total = 0;
    for (int32_t i = 0; i < n_seqs; i++) {
        max_len = TD_MAX(max_len, seqs[i].len);
        total += (size_t)seqs[i].len;
    }

    td_runtime_params rp = td_runtime_default_params();
    rp.model_path = model;
    rp.n_threads = threads;
    rp.isa_name = isa;
    rp.ctx_len = max_len;
    rp.kv_dtype = ea.kv_dtype;
    rp.act_int8 = ea.act_int8;
    rp.mmap_weights = ea.mmap;
    rp.n_seqs = batch ? TD_MAX(n_seqs, 1) : 1;
    rp.quiet = true;
    rp.max_batch_tokens = 512;
    rp.plan = &plan;
    if (td_runtime_open(&rp, &rt)) goto done; /* the cause is logged where it is known */
    fprintf(stderr, "isa: %s\n", td_backend_isa_name(rt->isa));
    const size_t V = (size_t)rt->cfg->n_vocab;
    int32_t cap = (int32_t)TD_MAX(1, TD_MIN(512, EVAL_LOGIT_FLOATS / V));
    for (int32_t i = 0; i < n_seqs; i++) {
        for (int32_t j = 0; j < seqs[i].len; j++) {
            if (seqs[i].ids[j] < 0 || (size_t)seqs[i].ids[j] >= V) {
                fprintf(stderr,
                        "tandem eval: sequence %d, position %d: token id %d is out of the "
                        "vocabulary (%zu)\n",
                        i, j, seqs[i].ids[j], V);
                goto done;
            }
        }
    }
    size_t all_floats;
    if (td_mul_overflow(total, V, &all_floats)) goto nomem;
    all = malloc((all_floats ? all_floats : 1) * sizeof(float));
    logits = malloc((size_t)cap * V * sizeof(float));
    chunks = calloc((size_t)TD_MAX(n_seqs, 1), sizeof *chunks);
    which = calloc((size_t)TD_MAX(n_seqs, 1), sizeof *which);
    if (!all || !logits || !chunks || !which) goto nomem;
    size_t off = 0;
    for (int32_t i = 0; i < n_seqs; i++) {
        seqs[i].out = all + off * V;
        off += (size_t)seqs[i].len;
        seqs[i].n_blocks = td_runtime_blocks_for(rt, seqs[i].len);
        seqs[i].blocks = malloc((size_t)TD_MAX(seqs[i].n_blocks, 1) * sizeof(int32_t));
        if (!seqs[i].blocks) goto nomem;
    }
    int32_t step = chunk > 0 ? TD_MIN(chunk, cap) : cap;

    if (!batch) {
        for (int32_t i = 0; i < n_seqs; i++) {
            eval_seq *s = &seqs[i];
            if (td_kv_block_alloc(rt->kv, s->n_blocks, s->blocks)) {
                fprintf(stderr, "tandem eval: KV pool exhausted\n");
                goto done;
            }
            while (s->done < s->len) {
                int32_t n = TD_MIN(step, s->len - s->done);
                chunks[0] = (td_seq_chunk){.tokens = s->ids + s->done,
                                           .n_tokens = n,
                                           .pos0 = s->done,
                                           .block_table = s->blocks,
                                           .n_blocks = s->n_blocks,
                                           .logits_all = true};
                which[0] = s;
                if (run_call(rt, which, chunks, 1, logits)) goto done;
            }
            td_kv_block_free(rt->kv, s->blocks, s->n_blocks);
        }
    } else {
        for (int32_t i = 0; i < n_seqs; i++) {
            if (td_kv_block_alloc(rt->kv, seqs[i].n_blocks, seqs[i].blocks)) {
                fprintf(stderr, "tandem eval: KV pool exhausted\n");
                goto done;
            }
        }
        for (;;) {
            /* One step: the next chunk of every unfinished sequence, packed
             * into calls of at most `cap` tokens. */
            int32_t n = 0, toks = 0;
            bool any = false;
            for (int32_t i = 0; i < n_seqs; i++) {
                eval_seq *s = &seqs[i];
                if (s->done >= s->len) continue;
                any = true;
                int32_t want = chunk > 0 ? TD_MIN(chunk, s->len - s->done) : s->len - s->done;
                want = TD_MIN(want, step);
                if (toks + want > cap && n > 0) {
                    if (run_call(rt, which, chunks, n, logits)) goto done;
                    n = toks = 0;
                }
                chunks[n] = (td_seq_chunk){.tokens = s->ids + s->done,
                                           .n_tokens = want,
                                           .pos0 = s->done,
                                           .block_table = s->blocks,
                                           .n_blocks = s->n_blocks,
                                           .logits_all = true};
                which[n++] = s;
                toks += want;
            }
            if (!any) break;
            if (n > 0 && run_call(rt, which, chunks, n, logits)) goto done;
        }
        for (int32_t i = 0; i < n_seqs; i++)
            td_kv_block_free(rt->kv, seqs[i].blocks, seqs[i].n_blocks);
    }

    f = fopen(out, "wb");
    if (!f) {
        fprintf(stderr, "tandem eval: %s: %s\n", out, strerror(errno));
        goto done;
    }
    if (all_floats && fwrite(all, sizeof(float), all_floats, f) != all_floats) {
        fprintf(stderr, "tandem eval: %s: write failed: %s\n", out, strerror(errno));
        goto done;
    }
    if (fclose(f) != 0) {
        f = NULL;
        fprintf(stderr, "tandem eval: %s: write failed: %s\n", out, strerror(errno));
        goto done;
    }
    f = NULL;
    rc = 0;
    goto done;
nomem:
    fprintf(stderr, "tandem eval: out of memory\n");
done:
    if (f) fclose(f);
    for (int32_t i = 0; i < n_seqs; i++) {
        free(seqs[i].ids);
        free(seqs[i].blocks);
    }
    free(seqs);
    free(which);
    free(chunks);
    free(logits);
    free(all);
    td_runtime_close(rt);
    return rc;
}
