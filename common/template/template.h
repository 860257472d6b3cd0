/* Chat templates: a Jinja interpreter for the templates models ship, with
 * the semantics of the environment transformers builds for
 * apply_chat_template (jinja2's ImmutableSandboxedEnvironment with
 * trim_blocks, lstrip_blocks and the loopcontrols extension; the tojson
 * filter, raise_exception() and strftime_now() it adds).
 *
 * A template is compiled once (td_tmpl_compile: lexer and parser to an
 * AST) and rendered any number of times, from any number of threads at
 * once, over a context of JSON values (td_tmpl_render). Python's
 * semantics are kept where rendered bytes depend on them: str() and repr()
 * of None, booleans, floats, lists and dicts; `/` giving a float; lengths
 * and slices in code points; dicts in insertion order; undefined names and
 * attributes as jinja2's default Undefined. A construct outside the
 * supported subset is an error naming it and its line, at compile time
 * where the parser sees it; nothing renders a wrong prompt silently.
 *
 * Rendering is bounded (td_tmpl_limits): output bytes, memory, loop
 * iterations, call depth and evaluation steps; crossing one is an error
 * that names the limit. */
#ifndef TD_TEMPLATE_H
#define TD_TEMPLATE_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "common/base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_tmpl td_tmpl;

typedef struct {
    size_t max_output;  /* bytes of rendered text (default 16 MiB) */
    size_t max_memory;  /* bytes the evaluation may allocate (default 256 MiB) */
    uint64_t max_steps; /* expression and statement evaluations (default 10^7) */
    uint64_t max_iters; /* loop iterations over the whole render (default 10^6) */
    int max_depth;      /* nested macro calls and expression depth (default 64) */
    int64_t now;        /* strftime_now()'s clock, seconds since the epoch, local
                           time; 0: the real clock */
} td_tmpl_limits;

/* The defaults above. */
td_tmpl_limits td_tmpl_default_limits(void);

/* Compiles src (NUL-terminated). NULL on error, with a message naming the
 * construct and line in err. */
td_tmpl *td_tmpl_compile(const char *src, char *err, size_t errlen);
void td_tmpl_free(td_tmpl *t);

/* Renders t over ctx (a JSON object: each key a template variable).
 * *out is malloc'd and NUL-terminated (caller frees); *out_len its length.
 * TD_ERR_INVALID with a message in err when the template raises (an
 * undefined attribute of an undefined value, a type error, a limit,
 * raise_exception()); TD_ERR_NOMEM on allocation failure. lim NULL: the
 * defaults. */
td_status td_tmpl_render(const td_tmpl *t, const json_t *ctx, const td_tmpl_limits *lim, char **out,
                         size_t *out_len, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif
