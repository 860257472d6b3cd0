/* What every command and service parses its command line with: strict
 * number parsing, the secret and key files, the plan flags, the default
 * model's path. */
#ifndef TD_RUNTIME_CLI_H
#define TD_RUNTIME_CLI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* The process-wide set-up of tandem, tandem-prefill and tandem-decode,
 * first in main, before any thread starts: the UCX environment
 * (td_ucx_env_init) and libcurl's global state (td_httpc_global_init).
 * Prints why and returns false when it fails. */
bool td_process_init(const char *prog);

/* Path of the default model (SmolLM2-135M-Instruct Q4_1 in the cache
 * directory the setup script fills): $TANDEM_MODEL, else
 * $XDG_CACHE_HOME/tandem/models/..., else ~/.cache/tandem/models/....
 * Returns a static buffer. */
const char *td_default_model_path(void);

/* The id a model is served under by default: the file's name without its
 * directory and .gguf extension (a directory: its name), e.g.
 * "SmolLM2-135M-Instruct.Q4_1". Written to buf (cap bytes); returns buf. */
const char *td_model_stem(const char *path, char *buf, size_t cap);

/* The names a served model answers to: the --served-model-name values
 * (repeatable: the first is the id /v1/models lists and responses carry),
 * else the file's stem, with the model's own general.name as an alias. */
#define TD_MAX_SERVED_NAMES 16
typedef struct {
    const char *names[TD_MAX_SERVED_NAMES]; /* as given on the command line */
    int n;
    char stem[256];
    const char *aliases[TD_MAX_SERVED_NAMES + 1]; /* accepted besides the id */
    int n_aliases;
} td_served_names;

/* --help texts of the naming and chat-template flags every binary with an
 * OpenAI front end shares (serve, prefill, decode, router). */
#define TD_CLI_HELP_SERVED_NAME                                                                    \
    "a name of the model in the API, repeatable: the first is\n"                                   \
    "the id listed, every one is accepted (default: the model\n"                                   \
    "file's name without .gguf; the model's own name accepted too)"
#define TD_CLI_HELP_TRUST_TEMPLATE "accept a chat_template (Jinja text) in chat requests"
#define TD_CLI_HELP_CHAT_TEMPLATE                                                                  \
    "the chat template: chatml, smollm2, llama3, llama2, mistral,\n"                               \
    "zephyr, or a Jinja file (default: the model's own)"

/* Adds one --served-model-name value; false when empty or too many. */
bool td_served_names_add(td_served_names *s, const char *name);
/* The id to serve under, with s->aliases filled. general_name may be NULL. */
const char *td_served_names_resolve(td_served_names *s, const char *model_path,
                                    const char *general_name);
/* The --model option's help line, naming that default (a static buffer). */
const char *td_cli_model_help(void);

/* Strict option parsing: the whole string, in range; false otherwise. */
bool td_cli_parse_long(const char *s, long lo, long hi, long *out);
bool td_cli_parse_float(const char *s, float *out);    /* finite */
bool td_cli_parse_u64(const char *s, uint64_t *out);   /* no sign */
bool td_cli_parse_seconds(const char *s, double *out); /* 0 .. 86400, finite */
/* --kv-dtype: a name td_kv_dtype_parse knows (f32, f16, bf16); *out keeps
 * the string (runtime params take the name). */
bool td_cli_parse_kv_dtype(const char *s, const char **out);
/* --act-int8's help: quantized-weight matmuls on 8-bit activations. */
#define TD_ACT_INT8_HELP                                                                           \
    "CPU: quantized-weight matmuls take 8-bit activations (llama.cpp's\n"                          \
    "scheme: faster prompts, changed results); default f32 activations"
/* --mmap's help: the CPU matmuls read the weights in place. */
#define TD_MMAP_HELP                                                                               \
    "CPU: matmuls read the weights in place in the model file's mapping\n"                         \
    "(page cache, shared between processes); default a private copy in\n"                          \
    "transparent huge pages (2-5% faster generation)"
/* The first line of a secret file (the cluster token), malloc'd; NULL
 * (logged) when it cannot be read or is empty. */
char *td_cli_read_secret(const char *path);
/* The API keys of a key file (a mounted Secret): one per line, blank lines
 * and the blanks around a key ignored, appended to keys[*n..max). Returns
 * the buffer the keys point into (freed after them); NULL (logged) when the
 * file cannot be read, is over 64 KiB, holds no key or more than fit. */
char *td_cli_read_keys(const char *path, const char **keys, int *n, int max);

#include "common/base/opts.h"
#include "common/parallel/plan.h"

/* Plan flags (plan.h) plus --plan-dry-run, shared by serve, generate, eval
 * and bench-engine. */
typedef struct {
    td_plan_params p;
    bool given;   /* a plan flag was on the command line */
    bool dry_run; /* --plan-dry-run */
} td_cli_plan;

/* The plan flags' table (base/opts.h), its handler into cp and its
 * --help lines. */
extern const td_opt td_cli_plan_opts[];
extern const int td_cli_plan_n_opts;
td_optset td_cli_plan_optset(td_cli_plan *cp);
void td_cli_plan_usage(FILE *f);
/* After parsing: -1 to go on (run the plan: td_runtime_params.plan);
 * otherwise the exit status (0 after printing the --plan-dry-run report,
 * 1 for a model that does not load, 2 for a plan the model does not allow). */
int td_cli_plan_check(const char *cmd, const td_cli_plan *cp, const char *model_path);

#endif
