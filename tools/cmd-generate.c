/* tandem generate: one prompt or chat message through the engine in-process,
 * streaming the answer to stdout and the speed to stderr. */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/engine/forward.h"
#include "common/runtime/cli.h"
#include "common/runtime/runtime.h"
#include "common/sched/sampler.h"
#include "common/sched/stop.h"
#include "common/tokenizer/chat.h"
#include "common/tokenizer/tokenizer.h"
#include "tools.h"

#define GEN_MAX_STOP      16
#define GEN_PREFILL_CHUNK 512 /* tokens per prefill forward call */

enum {
    G_MODEL,
    G_PROMPT,
    G_CHAT,
    G_SYSTEM,
    G_CHAT_TEMPLATE,
    G_MAX_TOKENS,
    G_TEMPERATURE,
    G_TEMP,
    G_TOP_K,
    G_TOP_P,
    G_MIN_P,
    G_REPEAT_PENALTY,
    G_FREQUENCY_PENALTY,
    G_PRESENCE_PENALTY,
    G_SEED,
    G_STOP,
    G_THREADS,
    G_ISA,
    G_DEVICE,
    G_CTX,
    G_KV_DTYPE,
    G_ACT_INT8,
    G_MMAP,
    G_N
};
static td_opt k_gen_opts[G_N] = {
    /* the --model help names the default: set in parse_args */
    [G_MODEL] = {"model", 'm', "PATH", "GGUF file or Hugging Face directory"},
    [G_PROMPT] = {"prompt", 'p', "TEXT",
                  "raw prompt (BOS added as the model says; special tokens parsed)"},
    [G_CHAT] = {"chat", 0, "TEXT", "user message, formatted with the model's chat template"},
    [G_SYSTEM] = {"system", 0, "TEXT", "system message for --chat"},
    [G_CHAT_TEMPLATE] = {"chat-template", 0, "NAME|FILE", TD_CLI_HELP_CHAT_TEMPLATE},
    [G_MAX_TOKENS] = {"max-tokens", 'n', "N", "most tokens to generate (default 256)"},
    [G_TEMPERATURE] = {"temperature", 0, "T", "0 = greedy (default 0, so output is reproducible)"},
    [G_TEMP] = {"temp", 0, "T", NULL},
    [G_TOP_K] = {"top-k", 0, "K", "keep the K most likely tokens (default 0 = off)"},
    [G_TOP_P] = {"top-p", 0, "P", "nucleus sampling mass in (0, 1] (default 1 = off)"},
    [G_MIN_P] = {"min-p", 0, "P", "drop tokens below P x the top probability (default 0 = off)"},
    [G_REPEAT_PENALTY] = {"repeat-penalty", 0, "R",
                          "repetition penalty over prompt and output (default 1 = off)"},
    [G_FREQUENCY_PENALTY] = {"frequency-penalty", 0, "F", "OpenAI frequency penalty (default 0)"},
    [G_PRESENCE_PENALTY] = {"presence-penalty", 0, "F", "OpenAI presence penalty (default 0)"},
    [G_SEED] = {"seed", 0, "S", "sampling seed (default: random; fixed seed = same output)"},
    [G_STOP] = {"stop", 0, "TEXT", "stop string (repeatable, up to " TD_STR(GEN_MAX_STOP) ")"},
    [G_THREADS] = {"threads", 't', "N", "worker threads (default: every core)"},
    [G_ISA] = {"isa", 0, "NAME", "kernel set: scalar, avx2, avx512 (default: best available)"},
    [G_DEVICE] = {"device", 0, "D",
                  "device: cpu, cuda, cuda:N (default: a GPU when built and visible, else cpu)"},
    [G_CTX] = {"ctx", 'c', "N", "context length in tokens (default: min(trained, 4096))"},
    [G_KV_DTYPE] = {"kv-dtype", 0, "T", TD_KV_DTYPE_HELP},
    [G_ACT_INT8] = {"act-int8", 0, NULL, TD_ACT_INT8_HELP},
    [G_MMAP] = {"mmap", 0, NULL, TD_MMAP_HELP},
};

static void gen_usage(FILE *f, void *ctx) {
    TD_UNUSED(ctx);
    fprintf(f, "usage: tandem generate [--model PATH] (--prompt TEXT | --chat TEXT) [options]\n"
               "\n"
               "Runs the model in-process, streams the generated text to stdout and prints\n"
               "prompt and generation speed to stderr.\n"
               "\n");
    td_opts_print(f, k_gen_opts, G_N);
    fprintf(f, "\nparallel plan (validated against the model; --plan-dry-run shows it):\n");
    td_cli_plan_usage(f);
}

typedef struct {
    const char *model;
    const char *prompt;
    const char *chat;
    const char *system;
    const char *chat_template;
    const char *isa;
    const char *device;
    long max_tokens;
    long threads;
    long ctx;
    const char *kv_dtype;
    bool act_int8;
    bool mmap;
    const char *stops[GEN_MAX_STOP];
    size_t n_stops;
    td_sampler_params sp;
    td_cli_plan plan;
} gen_args;

static bool set_gen_opt(void *ctx, int i, const char *val, bool *printed) {
    gen_args *a = ctx;
    long l;
    bool ok;
    TD_UNUSED(printed);
    switch (i) {
    case G_MODEL: a->model = val; return true;
    case G_PROMPT: a->prompt = val; return true;
    case G_CHAT: a->chat = val; return true;
    case G_SYSTEM: a->system = val; return true;
    case G_CHAT_TEMPLATE: a->chat_template = val; return true;
    case G_ISA: a->isa = val; return true;
    case G_DEVICE: a->device = val; return true;
    case G_MAX_TOKENS: return td_cli_parse_long(val, 1, INT32_MAX, &a->max_tokens);
    case G_THREADS: return td_cli_parse_long(val, 1, 4096, &a->threads);
    case G_CTX: return td_cli_parse_long(val, 1, INT32_MAX, &a->ctx);
    case G_KV_DTYPE: return td_cli_parse_kv_dtype(val, &a->kv_dtype);
    case G_ACT_INT8: a->act_int8 = true; return true;
    case G_MMAP: a->mmap = true; return true;
    case G_TEMPERATURE:
    case G_TEMP: return td_cli_parse_float(val, &a->sp.temperature);
    case G_TOP_K:
        ok = td_cli_parse_long(val, 0, INT32_MAX, &l);
        a->sp.top_k = (int32_t)l;
        return ok;
    case G_TOP_P: return td_cli_parse_float(val, &a->sp.top_p);
    case G_MIN_P: return td_cli_parse_float(val, &a->sp.min_p);
    case G_REPEAT_PENALTY: return td_cli_parse_float(val, &a->sp.repetition_penalty);
    case G_FREQUENCY_PENALTY: return td_cli_parse_float(val, &a->sp.frequency_penalty);
    case G_PRESENCE_PENALTY: return td_cli_parse_float(val, &a->sp.presence_penalty);
    case G_SEED: return td_cli_parse_u64(val, &a->sp.seed) && a->sp.seed != TD_SAMPLER_SEED_RANDOM;
    case G_STOP:
        if (a->n_stops == GEN_MAX_STOP || !*val) return false;
        a->stops[a->n_stops++] = val;
        return true;
    }
    return false;
}

/* Returns 0 to go on, else the exit status (2 usage, -1 for --help). */
static int parse_args(int argc, char **argv, gen_args *a) {
    k_gen_opts[G_MODEL].help = td_cli_model_help();
    td_optset sets[] = {{k_gen_opts, G_N, set_gen_opt, a}, td_cli_plan_optset(&a->plan)};
    int rc = td_opts_parse("tandem generate", argc, argv, sets, 2, gen_usage, NULL);
    if (rc == 1) return -1;
    if (rc) return 2;
    if (!a->prompt == !a->chat && !a->plan.dry_run) {
        fprintf(stderr, "tandem generate: give exactly one of --prompt and --chat (see --help)\n");
        return 2;
    }
    if (a->system && !a->chat) {
        fprintf(stderr, "tandem generate: --system needs --chat\n");
        return 2;
    }
    if (a->chat_template && !td_chat_builtin(a->chat_template) && access(a->chat_template, R_OK)) {
        fprintf(stderr,
                "tandem generate: unknown chat template '%s': neither a name (chatml, smollm2, "
                "llama3, llama2, mistral, zephyr) nor a readable file\n",
                a->chat_template);
        return 2;
    }
    if (a->chat_template && !a->chat) {
        fprintf(stderr, "tandem generate: --chat-template needs --chat\n");
        return 2;
    }
    return 0;
}

/* The prompt as tokens: the chat template applied for --chat. */
static td_status build_prompt(const gen_args *a, const td_tokenizer *tok, int32_t **toks_p,
                              size_t *n_p) {
    if (a->prompt)
        return td_tokenizer_encode(tok, a->prompt, strlen(a->prompt), true, true, toks_p, n_p);

    td_chat *t = NULL;
    char err[512];
    td_status st =
        td_chat_pick(a->chat_template, td_tokenizer_chat_template(tok), &t, err, sizeof err);
    if (st != TD_OK) {
        fprintf(stderr, "tandem generate: %s%s\n", err,
                a->chat_template ? "" : " (or use --prompt)");
        return st;
    }
    td_chat_msg msgs[2];
    size_t n = 0;
    if (a->system) msgs[n++] = (td_chat_msg){"system", a->system};
    msgs[n++] = (td_chat_msg){"user", a->chat};
    int32_t bos = td_tokenizer_bos(tok), eos = td_tokenizer_eos(tok);
    const char *bos_text = bos >= 0 ? td_tokenizer_token_text(tok, bos) : NULL;
    const char *eos_text = eos >= 0 ? td_tokenizer_token_text(tok, eos) : NULL;
    char *text = NULL;
    st = td_chat_apply(t, msgs, n, true, bos_text ? bos_text : "", eos_text ? eos_text : "", &text,
                       err, sizeof err);
    if (st != TD_OK) {
        fprintf(stderr, "tandem generate: %s cannot format this conversation: %s\n",
                td_chat_label(t), err);
        td_chat_free(t);
        return st;
    }
    td_chat_free(t);
    /* The template renders BOS itself where the model wants it (as
     * Hugging Face's apply_chat_template does), so no special tokens are
     * added here; the template's control tokens are parsed as such. */
    st = td_tokenizer_encode(tok, text, strlen(text), false, true, toks_p, n_p);
    free(text);
    return st;
}

static void emit(const char *s, size_t n) {
    if (n) {
        fwrite(s, 1, n, stdout);
        fflush(stdout);
    }
}

int td_cmd_generate(int argc, char **argv) {
    gen_args a = {.max_tokens = 256,
                  .sp = td_sampler_default_params(),
                  .plan = {.p = td_plan_default_params()}};
    int rc = parse_args(argc, argv, &a);
    if (rc) return rc < 0 ? 0 : rc;
    rc = td_cli_plan_check("generate", &a.plan, a.model ? a.model : td_default_model_path());
    if (rc >= 0) return rc;

    int exit_code = 1;
    td_runtime *rt = NULL;
    td_sampler *smp = NULL;
    td_stop *stop = NULL;
    int32_t *prompt = NULL, *blocks = NULL;
    float *logits = NULL;
    int32_t n_blocks = 0;
    td_status st;

    td_runtime_params rp = td_runtime_default_params();
    rp.model_path = a.model;
    rp.plan = &a.plan.p;
    rp.n_threads = (int)a.threads;
    rp.isa_name = a.isa;
    rp.device = a.device;
    rp.ctx_len = (int32_t)a.ctx;
    rp.kv_dtype = a.kv_dtype;
    rp.act_int8 = a.act_int8;
    rp.mmap_weights = a.mmap;
    rp.n_seqs = 1;
    rp.max_batch_tokens = GEN_PREFILL_CHUNK;
    if (td_runtime_open(&rp, &rt) != TD_OK) goto out;
    const td_tokenizer *tok = rt->tok;
    int32_t n_vocab = rt->cfg->n_vocab;

    size_t n_prompt = 0;
    if (build_prompt(&a, tok, &prompt, &n_prompt) != TD_OK) goto out;
    if (n_prompt == 0) {
        fprintf(stderr, "tandem generate: the prompt is empty\n");
        goto out;
    }
    if (n_prompt >= (size_t)rt->ctx_len) {
        fprintf(stderr, "tandem generate: the prompt has %zu tokens; the context holds %d\n",
                n_prompt, rt->ctx_len);
        goto out;
    }
    int32_t max_new = (int32_t)TD_MIN((long)(rt->ctx_len - (int32_t)n_prompt), a.max_tokens);
    if (max_new < a.max_tokens)
        fprintf(stderr, "tandem generate: at most %d new tokens fit in the context of %d\n",
                max_new, rt->ctx_len);

    /* KV for the whole sequence, taken once. */
    int32_t n_total = (int32_t)n_prompt + max_new;
    n_blocks = td_runtime_blocks_for(rt, n_total);
    blocks = malloc((size_t)n_blocks * sizeof *blocks);
    logits = malloc((size_t)n_vocab * sizeof *logits);
    if (!blocks || !logits) {
        fprintf(stderr, "tandem generate: out of memory\n");
        goto out;
    }
    if (td_kv_block_alloc(rt->kv, n_blocks, blocks) != TD_OK) {
        fprintf(stderr, "tandem generate: the KV pool has no room for %d tokens\n", n_total);
        n_blocks = 0;
        goto out;
    }

    if (td_sampler_create(&a.sp, n_vocab, &smp) != TD_OK) {
        fprintf(stderr, "tandem generate: bad sampling options\n");
        exit_code = 2;
        goto out;
    }
    if (td_sampler_accept_prompt(smp, prompt, n_prompt) != TD_OK) goto out;
    td_stop_params stp = td_stop_default_params();
    stp.stop_strings = a.stops;
    stp.n_stop_strings = a.n_stops;
    if (td_stop_create(&stp, tok, &stop) != TD_OK) goto out;

    /* Prefill in chunks of the engine's batch limit; logits of the last only. */
    const int32_t chunk_max = GEN_PREFILL_CHUNK;
    double t0 = td_time_s();
    for (size_t done = 0; done < n_prompt;) {
        int32_t n = (int32_t)TD_MIN((size_t)chunk_max, n_prompt - done);
        bool last = done + (size_t)n == n_prompt;
        td_seq_chunk c = {.tokens = prompt + done,
                          .n_tokens = n,
                          .pos0 = (int32_t)done,
                          .block_table = blocks,
                          .n_blocks = td_runtime_blocks_for(rt, (int32_t)done + n),
                          .logits_all = false,
                          .no_logits = !last};
        st = td_runtime_forward(rt, &c, 1, last ? logits : NULL);
        if (st != TD_OK) {
            fprintf(stderr, "tandem generate: prefill failed: %s\n", td_status_str(st));
            goto out;
        }
        done += (size_t)n;
    }
    double t1 = td_time_s();

    td_detok dt;
    td_detok_init(&dt, true);
    char piece[256];
    const char *out;
    size_t out_len;
    bool stopped = false;
    int32_t n_gen = 0, pos = (int32_t)n_prompt;
    const char *finish = "length";
    while (n_gen < max_new) {
        td_sample_result r;
        if (td_sampler_sample(smp, logits, &r) != TD_OK) goto out;
        n_gen++;
        if (td_stop_is_stop_token(stop, r.token)) {
            finish = "stop";
            break;
        }
        if (td_sampler_accept(smp, r.token) != TD_OK) goto out;
        size_t np = td_detok_push(tok, &dt, r.token, piece, sizeof piece);
        if (td_stop_feed(stop, piece, np, &out, &out_len, &stopped) != TD_OK) goto out;
        emit(out, out_len);
        if (stopped) {
            finish = "stop";
            break;
        }
        if (n_gen == max_new) break;
        td_seq_chunk c = {.tokens = &r.token,
                          .n_tokens = 1,
                          .pos0 = pos,
                          .block_table = blocks,
                          .n_blocks = td_runtime_blocks_for(rt, pos + 1)};
        st = td_runtime_forward(rt, &c, 1, logits);
        if (st != TD_OK) {
            fprintf(stderr, "tandem generate: decode failed at position %d: %s\n", pos,
                    td_status_str(st));
            goto out;
        }
        pos++;
    }
    if (!stopped) {
        size_t np = td_detok_flush(&dt, piece, sizeof piece);
        if (td_stop_feed(stop, piece, np, &out, &out_len, &stopped) != TD_OK) goto out;
        emit(out, out_len);
        if (!stopped) {
            td_stop_flush(stop, &out, &out_len);
            emit(out, out_len);
        }
    }
    double t2 = td_time_s();
    emit("\n", 1);

    const td_kv_params *kvp = td_kv_pool_params(rt->kv);
    size_t kv_bytes = td_kv_block_bytes(kvp) * (size_t)kvp->n_blocks;
    double tp = t1 - t0, tg = t2 - t1;
    fprintf(stderr, "prompt: %zu tokens, %.3f s, %.2f tokens/s\n", n_prompt, tp,
            tp > 0 ? (double)n_prompt / tp : 0.0);
    fprintf(stderr, "generation: %d tokens, %.3f s, %.2f tokens/s (finish: %s)\n", n_gen, tg,
            tg > 0 ? (double)n_gen / tg : 0.0, finish);
    fprintf(stderr, "kv cache: %zu bytes (%d blocks of %d tokens)\n", kv_bytes, kvp->n_blocks,
            kvp->block_size);
    exit_code = 0;

out:
    if (n_blocks > 0) td_kv_block_free(rt->kv, blocks, n_blocks);
    td_stop_destroy(stop);
    td_sampler_destroy(smp);
    free(logits);
    free(blocks);
    free(prompt);
    td_runtime_close(rt);
    return exit_code;
}
