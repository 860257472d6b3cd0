/* Chat templates: the model's own Jinja template (or one given by name or
 * file), compiled once by the template engine (common/template) and
 * rendered with the variables transformers' apply_chat_template passes.
 * The six names of the --chat-template flag (chatml, smollm2, llama3,
 * llama2, mistral, zephyr) are embedded Jinja texts run by the same
 * engine. */
#ifndef TD_CHAT_H
#define TD_CHAT_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "common/base/base.h"
#include "common/tokenizer/tokenizer.h"

typedef struct td_chat td_chat;

typedef struct {
    const char *role; /* "system" | "user" | "assistant" | "tool" ... */
    const char *content;
} td_chat_msg;

/* The embedded template of one of the six names; NULL for another name. */
const char *td_chat_builtin(const char *name);

/* Compiles jinja (label names it in messages: "the model's template", a
 * file path, a name). *chat_p must be freed with td_chat_free.
 * TD_ERR_INVALID with the compiler's message (construct and line) in err. */
td_status td_chat_compile(const char *jinja, const char *label, td_chat **chat_p, char *err,
                          size_t errlen);
/* spec: one of the six names, else the path of a Jinja file. TD_ERR_NOT_FOUND
 * for neither (err says so), TD_ERR_IO for an unreadable file, TD_ERR_INVALID
 * for a template that does not compile. */
td_status td_chat_load(const char *spec, td_chat **chat_p, char *err, size_t errlen);
/* What a serving binary or `tandem generate` uses: spec (--chat-template
 * NAME|FILE) when given, else the model's own template text (model_tmpl,
 * may be NULL). TD_ERR_NOT_FOUND when there is neither (err: start with
 * --chat-template), else td_chat_load's or td_chat_compile's status. */
td_status td_chat_pick(const char *spec, const char *model_tmpl, td_chat **chat_p, char *err,
                       size_t errlen);
/* What a serving binary renders chat with: *chat_p as td_chat_pick gives
 * it, and *tools_p the model's "tool_use" template, for requests with
 * tools as transformers picks it (NULL when spec is given or the model has
 * none). A spec that does not load: its status, the reason in why. A model
 * without a usable template of its own: TD_OK with *chat_p NULL and the
 * reason in why (logged: chat requests are 400 with it). A tool_use
 * template that does not compile is logged and left out. */
td_status td_chat_pick_serving(const char *spec, const td_tokenizer *tok, td_chat **chat_p,
                               td_chat **tools_p, char *why, size_t whylen);
void td_chat_free(td_chat *c);
const char *td_chat_label(const td_chat *c);

/* Renders c over ctx (a JSON object: each key a template variable).
 * *out_p malloc'd, NUL-terminated; TD_ERR_INVALID when the template raises
 * (its message in err); TD_ERR_NOMEM. */
td_status td_chat_render(const td_chat *c, const json_t *ctx, char **out_p, char *err,
                         size_t errlen);

/* Sets in ctx the variables transformers' apply_chat_template passes
 * besides messages: tools (NULL: None), documents (None),
 * add_generation_prompt, bos_token, eos_token (NULL: ""). false when out
 * of memory. */
bool td_chat_context_set(json_t *ctx, const json_t *tools, bool add_generation_prompt,
                         const char *bos, const char *eos);

/* Renders msgs with add_generation_prompt, bos_token and eos_token (the
 * model's BOS/EOS texts, may be ""). *out_p is malloc'd, NUL-terminated
 * (caller frees). TD_ERR_INVALID when the template raises (its message,
 * e.g. raise_exception's, in err); TD_ERR_NOMEM. */
td_status td_chat_apply(const td_chat *c, const td_chat_msg *msgs, size_t n,
                        bool add_generation_prompt, const char *bos, const char *eos, char **out_p,
                        char *err, size_t errlen);

#endif
