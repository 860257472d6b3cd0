/* tandem generate: one prompt or chat message through the engine in-process,
 * streaming the answer to stdout and the speed to stderr. */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static void gen_usage(FILE *f) {
    fprintf(
        f,
        "usage: tandem generate [--model PATH] (--prompt TEXT | --chat TEXT) [options]\n"
        "\n"
        "Runs the model in-process, streams the generated text to stdout and prints\n"
        "prompt and generation speed to stderr.\n"
        "\n"
        "  --model PATH          GGUF file or Hugging Face directory (default: %s)\n"
        "  --prompt TEXT         raw prompt (BOS added as the model says; special tokens parsed)\n"
        "  --chat TEXT           user message, formatted with the model's chat template\n"
        "  --system TEXT         system message for --chat\n"
        "  --chat-template NAME  force a template: chatml, smollm2, llama3, llama2, mistral, "
        "zephyr\n"
        "  --max-tokens N        most tokens to generate (default 256)\n"
        "  --temperature T       0 = greedy (default 0, so output is reproducible)\n"
        "  --top-k K             keep the K most likely tokens (default 0 = off)\n"
        "  --top-p P             nucleus sampling mass in (0, 1] (default 1 = off)\n"
        "  --min-p P             drop tokens below P x the top probability (default 0 = off)\n"
        "  --repeat-penalty R    repetition penalty over prompt and output (default 1 = off)\n"
        "  --frequency-penalty F OpenAI frequency penalty (default 0)\n"
        "  --presence-penalty F  OpenAI presence penalty (default 0)\n"
        "  --seed S              sampling seed (default: random; fixed seed = same output)\n"
        "  --stop TEXT           stop string (repeatable, up to %d)\n"
        "  --threads N           worker threads (default: every core)\n"
        "  --isa NAME            kernel set: scalar, avx2, avx512 (default: best available)\n"
        "  --device D            device: cpu, cuda, cuda:N (default: a GPU when built and visible, "
        "else cpu)\n"
        "  --ctx N               context length in tokens (default: min(trained, 4096))\n",
        td_default_model_path(), GEN_MAX_STOP);
    fprintf(f, "\nparallel plan (validated against the model; --plan-dry-run shows it):\n%s",
            td_plan_flags_help());
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
    const char *stops[GEN_MAX_STOP];
    size_t n_stops;
    td_sampler_params sp;
    td_cli_plan plan;
} gen_args;

/* Returns 0 to go on, else the exit status (2 usage, 0 for --help). */
static int parse_args(int argc, char **argv, gen_args *a) {
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i];
        if (!strcmp(opt, "--help") || !strcmp(opt, "-h")) {
            gen_usage(stdout);
            return -1;
        }
        int pf = td_cli_plan_flag(&a->plan, argc, argv, &i);
        if (pf < 0) return 2;
        if (pf > 0) continue;
        if (i + 1 >= argc) {
            fprintf(stderr, "tandem generate: %s needs a value (or is unknown)\n", opt);
            return 2;
        }
        const char *val = argv[++i];
        long l;
        bool ok = true;
        if (!strcmp(opt, "--model") || !strcmp(opt, "-m"))
            a->model = val;
        else if (!strcmp(opt, "--prompt") || !strcmp(opt, "-p"))
            a->prompt = val;
        else if (!strcmp(opt, "--chat"))
            a->chat = val;
        else if (!strcmp(opt, "--system"))
            a->system = val;
        else if (!strcmp(opt, "--chat-template"))
            a->chat_template = val;
        else if (!strcmp(opt, "--isa"))
            a->isa = val;
        else if (!strcmp(opt, "--device"))
            a->device = val;
        else if (!strcmp(opt, "--max-tokens") || !strcmp(opt, "-n"))
            ok = td_cli_parse_long(val, 1, INT32_MAX, &a->max_tokens);
        else if (!strcmp(opt, "--threads") || !strcmp(opt, "-t"))
            ok = td_cli_parse_long(val, 1, 4096, &a->threads);
        else if (!strcmp(opt, "--ctx") || !strcmp(opt, "-c"))
            ok = td_cli_parse_long(val, 1, INT32_MAX, &a->ctx);
        else if (!strcmp(opt, "--temperature") || !strcmp(opt, "--temp"))
            ok = td_cli_parse_float(val, &a->sp.temperature);
        else if (!strcmp(opt, "--top-k")) {
            ok = td_cli_parse_long(val, 0, INT32_MAX, &l);
            a->sp.top_k = (int32_t)l;
        } else if (!strcmp(opt, "--top-p"))
            ok = td_cli_parse_float(val, &a->sp.top_p);
        else if (!strcmp(opt, "--min-p"))
            ok = td_cli_parse_float(val, &a->sp.min_p);
        else if (!strcmp(opt, "--repeat-penalty"))
            ok = td_cli_parse_float(val, &a->sp.repetition_penalty);
        else if (!strcmp(opt, "--frequency-penalty"))
            ok = td_cli_parse_float(val, &a->sp.frequency_penalty);
        else if (!strcmp(opt, "--presence-penalty"))
            ok = td_cli_parse_float(val, &a->sp.presence_penalty);
        else if (!strcmp(opt, "--seed")) {
            ok = td_cli_parse_u64(val, &a->sp.seed) && a->sp.seed != TD_SAMPLER_SEED_RANDOM;
        } else if (!strcmp(opt, "--stop")) {
            if (a->n_stops == GEN_MAX_STOP || !*val)
                ok = false;
            else
                a->stops[a->n_stops++] = val;
        } else {
            fprintf(stderr, "tandem generate: unknown option '%s' (see --help)\n", opt);
            return 2;
        }
        if (!ok) {
            fprintf(stderr, "tandem generate: bad value '%s' for %s\n", val, opt);
            return 2;
        }
    }
    if (!a->prompt == !a->chat && !a->plan.dry_run) {
        fprintf(stderr, "tandem generate: give exactly one of --prompt and --chat (see --help)\n");
        return 2;
    }
    if (a->system && !a->chat) {
        fprintf(stderr, "tandem generate: --system needs --chat\n");
        return 2;
    }
    if (a->chat_template && td_chat_template_from_name(a->chat_template) == TD_CHAT_UNKNOWN) {
        fprintf(stderr,
                "tandem generate: unknown chat template '%s' (known: chatml, smollm2, llama3, "
                "llama2, mistral, zephyr)\n",
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

    td_chat_template t;
    if (a->chat_template) {
        t = td_chat_template_from_name(a->chat_template);
    } else {
        const char *tmpl = td_tokenizer_chat_template(tok);
        if (!tmpl) {
            fprintf(stderr, "tandem generate: the model has no chat template; give "
                            "--chat-template NAME or use --prompt\n");
            return TD_ERR_NOT_FOUND;
        }
        t = td_chat_template_detect(tmpl);
        if (t == TD_CHAT_UNKNOWN) {
            fprintf(stderr, "tandem generate: the model's chat template is not one Tandem "
                            "recognises; give --chat-template NAME or use --prompt\n");
            return TD_ERR_UNSUPPORTED;
        }
    }
    td_chat_msg msgs[2];
    size_t n = 0;
    if (a->system) msgs[n++] = (td_chat_msg){"system", a->system};
    msgs[n++] = (td_chat_msg){"user", a->chat};
    int32_t bos = td_tokenizer_bos(tok), eos = td_tokenizer_eos(tok);
    const char *bos_text = bos >= 0 ? td_tokenizer_token_text(tok, bos) : NULL;
    const char *eos_text = eos >= 0 ? td_tokenizer_token_text(tok, eos) : NULL;
    char *text = NULL;
    td_status st =
        td_chat_apply(t, msgs, n, true, bos_text ? bos_text : "", eos_text ? eos_text : "", &text);
    if (st != TD_OK) {
        fprintf(stderr,
                "tandem generate: the %s chat template cannot format this "
                "conversation: %s\n",
                td_chat_template_name(t), td_status_str(st));
        return st;
    }
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
