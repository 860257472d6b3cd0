/* OpenAI request parsing and validation, shared by the HTTP and gRPC front
 * ends: JSON body (or a gRPC message) -> a validated td_api_request ->
 * prompt tokens + td_gen_request for the scheduler. Rules follow vLLM
 * (DESIGN.md §7): temperature in [0, 2], top_p in (0, 1], top_k -1 or >= 0
 * (0 and -1 mean off), min_p in [0, 1], presence/frequency penalties in
 * [-2, 2], repetition_penalty in (0, 2], max_tokens >= 1, min_tokens <=
 * max_tokens, 1 <= n <= limits.max_n, at most limits.max_stop non-empty
 * stop strings, logprobs / top_logprobs in [0, 20], logit_bias ids in the
 * vocabulary and values in [-100, 100], seed an integer. Wrong JSON types
 * are 400s naming the parameter; unknown fields are ignored and logged at
 * INFO once per request ("ignoring unknown fields: a, b"). Both max_tokens
 * and max_completion_tokens are accepted (the latter wins if both).
 *
 * Errors are the OpenAI error object. Thread-safe: no shared state. */
#ifndef TD_API_REQUEST_H
#define TD_API_REQUEST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "common/base/base.h"
#include "common/grammar/constraint.h"
#include "common/sched/sched.h"
#include "common/tokenizer/chat.h"
#include "common/tokenizer/tokenizer.h"

/* A chat request's input to the chat template (request.c): the
 * normalised messages (content parts flattened into one string, "developer"
 * as "system", each tool call's arguments an object, every other field
 * kept), the tools, and the variables the request adds. */
typedef struct {
    json_t *messages;            /* a list, never NULL once parsed */
    json_t *tools;               /* a list, or NULL: the template sees None */
    json_t *kwargs;              /* chat_template_kwargs (an object), or NULL */
    char *template_text;         /* the request's own chat_template, or NULL */
    bool add_generation_prompt;  /* default true */
    bool continue_final_message; /* default false */
} td_api_chat;

typedef enum {
    TD_API_COMPLETIONS = 0, /* /v1/completions */
    TD_API_CHAT = 1,        /* /v1/chat/completions */
} td_api_kind;

/* An error as the client sees it. */
typedef struct {
    int http_status; /* 400, 401, 404, 413, 429, 500, 503 */
    char type[40];   /* "invalid_request_error", "authentication_error", "not_found_error",
                      * "rate_limit_error", "server_error", "service_unavailable" */
    char code[40];   /* e.g. "context_length_exceeded", "model_not_found",
                      * "invalid_api_key"; "" for none (JSON null) */
    char param[64];  /* the offending parameter, "" for none (JSON null) */
    char message[512];
} td_api_error;

void td_api_error_set(td_api_error *err, int http_status, const char *type, const char *code,
                      const char *param, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
/* {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
 * malloc'd, NUL-terminated (caller frees); NULL only when out of memory. */
char *td_api_error_json(const td_api_error *err);
/* The one status -> error mapping for failures that come from below the
 * API (td_sched_submit and friends): TD_AGAIN -> 429, TD_ERR_UNAVAILABLE ->
 * 503, TD_ERR_RANGE -> 400 context_length_exceeded, TD_ERR_INVALID -> 400,
 * TD_ERR_NOMEM / others -> 500. */
void td_api_error_from_status(td_api_error *err, td_status st, const char *what);

typedef struct {
    size_t max_body_bytes;    /* default 4 MiB; larger bodies are 413 */
    int32_t max_n;            /* default 8 */
    int32_t max_stop;         /* default 16 */
    int32_t max_prompt_items; /* completions: most prompts in one batch request (default 16) */
    int32_t max_stop_ids;     /* most stop_token_ids (default 256) */
} td_api_limits;

td_api_limits td_api_default_limits(void);

typedef struct {
    td_api_kind kind;
    char *model; /* as sent; NULL if absent */
    /* The prompt, exactly one of: */
    char **prompts;          /* completions: (n_prompts) strings */
    int32_t **prompt_ids;    /* completions: (n_prompts) token-id lists ... */
    int32_t *prompt_ids_len; /* ... and their lengths */
    int32_t n_prompts;       /* completions: >= 1 */
    td_api_chat chat;        /* chat: messages, tools, template variables */
    /* Generation. */
    int32_t max_tokens; /* 0 = not given: up to the context */
    int32_t min_tokens;
    int32_t n;
    bool stream;
    bool include_usage;         /* stream_options.include_usage */
    td_sampler_params sampling; /* sampling.logit_bias points into logit_bias below */
    td_logit_bias *logit_bias;
    int32_t n_logit_bias;
    bool has_seed;
    char **stop; /* (n_stop) non-empty */
    int32_t n_stop;
    int32_t *stop_ids; /* stop_token_ids (vLLM) */
    int32_t n_stop_ids;
    bool logprobs;        /* chat: logprobs=true; completions: logprobs=N given */
    int32_t top_logprobs; /* chat: top_logprobs; completions: logprobs=N */
    bool echo;            /* completions: prepend the prompt to the text */
    bool ignore_eos;
    bool skip_special_tokens;        /* default true */
    bool include_stop_str_in_output; /* default false */
    char *user;                      /* accepted, logged only */
    /* The output's constraint (structured outputs): from response_format,
     * structured_outputs, the guided_* fields or llama.cpp's json_schema
     * and grammar; kind NONE when none. */
    td_constraint constraint;
} td_api_request;

/* Parses and validates a JSON body. On failure fills *err (400 for bad
 * JSON, wrong types and values; 413 for a body over max_body_bytes) and
 * leaves req empty. On success req owns its allocations: free with
 * td_api_request_free(). */
td_status td_api_request_parse(td_api_kind kind, const char *body, size_t len,
                               const td_api_limits *lim, int32_t n_vocab, td_api_request *req,
                               td_api_error *err);
void td_api_request_free(td_api_request *req); /* accepts a zeroed or freed req */

/* The request's constraint compiled for tok (*g NULL when it has none).
 * A refusal is a 400 naming the field and the reason. *g is the caller's
 * (td_gen_request.grammar, or td_gram_free). */
td_status td_api_request_grammar(const td_api_request *req, const td_tokenizer *tok, td_gram **g,
                                 td_api_error *err);

/* What the front ends need to turn a request into scheduler work. */
typedef struct {
    const td_tokenizer *tok;
    const td_chat *chat;         /* NULL: chat requests are 400 with chat_error */
    const td_chat *chat_tools;   /* the model's "tool_use" template, for requests with tools
                                    (transformers' choice); NULL: chat serves them too */
    const char *chat_error;      /* why there is no chat template (NULL: a generic reason) */
    bool trust_request_template; /* a request's chat_template is accepted (vLLM's
                                    --trust-request-chat-template); else a 400 */
    const char *model_name;      /* served model name; requests naming another are 404 */
    const char *const *aliases;  /* (n_aliases) other names requests may use; they must
                                    outlive the server */
    int n_aliases;
    int32_t max_ctx; /* context length (prompt + output) */
} td_api_model;

/* Checks the model name (NULL/absent is accepted), renders the chat
 * template or takes prompt i (0 <= i < n_prompts; 0 for chat), tokenizes
 * (BOS as the model says; special tokens are parsed in both kinds, as
 * vLLM does),
 * and checks the context: prompt + 1 > max_ctx, or prompt + max_tokens >
 * max_ctx, is 400 context_length_exceeded. *tokens_p (malloc'd, caller
 * frees) and *n_p on success; *max_tokens_p: the effective max_tokens
 * (max_ctx - prompt when not given). */
td_status td_api_request_tokens(const td_api_model *mdl, const td_api_request *req, int32_t i,
                                int32_t **tokens_p, int32_t *n_p, int32_t *max_tokens_p,
                                td_api_error *err);

/* Fills g for choice `choice` (0..n-1) of prompt tokens (borrowed: g points
 * into req and tokens, which must outlive the submit). A fixed seed gives
 * choice c the seed + c, so n > 1 choices differ but repeat run to run. */
void td_api_request_to_gen(const td_api_request *req, const int32_t *tokens, int32_t n_tokens,
                           int32_t max_tokens, int32_t choice, td_gen_request *g);

/* A decode instance's hook on every generation request the front ends
 * submit (it attaches the KV import of remote prefill; fn NULL: none), or
 * the whole back end of a front end without a scheduler (the router). */
typedef struct {
    void (*fn)(void *ctx, td_gen_request *g);
    /* Replaces td_sched_submit (the front ends' sched is then NULL): the
     * same contract (TD_AGAIN 429, TD_ERR_UNAVAILABLE 503, ...), the stream
     * made with td_gen_stream_create. NULL: the scheduler's. */
    td_status (*submit)(void *ctx, const td_gen_request *g, td_gen_stream **st_p);
    /* NULL while serving, else why not (a static string; /ready answers 503
     * and gRPC health NOT_SERVING with it). NULL function: the
     * scheduler's draining flag. */
    const char *(*not_ready)(void *ctx);
    void *ctx;
} td_api_submit_hook;

/* Why the front end does not serve now (h->not_ready, or "draining" when
 * the scheduler drains), or NULL. */
const char *td_api_not_ready(td_sched *s, const td_api_submit_hook *h);

/* Runs the hook on g, then td_sched_submit (or h->submit); when the submit
 * fails, gives the hook's import context back (its release). */
td_status td_api_submit(td_sched *s, const td_api_submit_hook *h, td_gen_request *g,
                        td_gen_stream **st_p);

#endif
