/* OpenAI request parsing and validation (vLLM's rules); see request.h. */
#include "request.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "request-impl.h"

/* ------------------------------------------------------------------ errors */

/* Copies src into dst[cap] without splitting a UTF-8 character. */
static void copy_trunc(char *dst, size_t cap, const char *src) {
    size_t n = src ? strlen(src) : 0;
    if (n >= cap) n = td_api_utf8_complete_len(src, cap - 1);
    if (n) memcpy(dst, src, n);
    dst[n] = 0;
}

void td_api_error_set(td_api_error *err, int http_status, const char *type, const char *code,
                      const char *param, const char *fmt, ...) {
    if (!err) return;
    err->http_status = http_status;
    copy_trunc(err->type, sizeof(err->type), type);
    copy_trunc(err->code, sizeof(err->code), code);
    copy_trunc(err->param, sizeof(err->param), param);
    char msg[sizeof(err->message) + 8];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    copy_trunc(err->message, sizeof(err->message), msg);
}

static json_t *str_or_null(const char *s) {
    if (!s || !*s) return json_null();
    size_t n = 0;
    char *fixed = td_api_utf8_fix(s, strlen(s), &n);
    json_t *v = fixed ? json_stringn(fixed, n) : NULL;
    free(fixed);
    return v;
}

char *td_api_error_json(const td_api_error *err) {
    json_t *msg = str_or_null(err->message[0] ? err->message : "error");
    json_t *root = json_pack("{s:{s:o*,s:s,s:o*,s:o*}}", "error", "message", msg, "type",
                             err->type[0] ? err->type : "server_error", "param",
                             str_or_null(err->param), "code", str_or_null(err->code));
    if (!root) return NULL;
    char *out = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return out;
}

void td_api_error_from_status(td_api_error *err, td_status st, const char *what) {
    const char *w = what ? what : "request";
    switch (st) {
    case TD_AGAIN:
        td_api_error_set(err, 429, "rate_limit_error", "", "",
                         "%s: the server is busy (too many requests waiting); retry later", w);
        break;
    case TD_ERR_UNAVAILABLE:
        td_api_error_set(err, 503, "service_unavailable", "", "",
                         "%s: the server is not ready or is shutting down", w);
        break;
    case TD_ERR_RANGE:
        td_api_error_set(err, 400, "invalid_request_error", "context_length_exceeded", "",
                         "%s: the request does not fit in the model's context", w);
        break;
    case TD_ERR_INVALID:
        td_api_error_set(err, 400, "invalid_request_error", "", "", "%s: invalid request", w);
        break;
    default:
        td_api_error_set(err, 500, "server_error", "", "", "%s failed: %s", w, td_status_str(st));
        break;
    }
}

static td_status bad(td_api_error *err, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static td_status bad(td_api_error *err, const char *param, const char *fmt, ...) {
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    td_api_error_set(err, 400, "invalid_request_error", "", param, "%s", msg);
    return TD_ERR_INVALID;
}

static td_status oom(td_api_error *err) {
    td_api_error_set(err, 500, "server_error", "", "", "out of memory");
    return TD_ERR_NOMEM;
}

td_api_limits td_api_default_limits(void) {
    return (td_api_limits){
        .max_body_bytes = 4u << 20,
        .max_n = 8,
        .max_stop = 16,
        .max_prompt_items = 16,
        .max_stop_ids = 256,
    };
}

/* ------------------------------------------------------------------- UTF-8 */

/* The UTF-8 sequence at s[0..n): returns its length when valid; else 0
 * with *bad = the length of its maximal ill-formed subpart (>= 1), which is
 * replaced by one U+FFFD (Unicode's recommended practice, as Python and
 * browsers decode), and *trunc = true when that subpart is a valid prefix
 * cut by the end of the input. */
static int utf8_seq(const unsigned char *s, size_t n, int *bad, bool *trunc) {
    unsigned c = s[0];
    *trunc = false;
    *bad = 1;
    if (c < 0x80) return 1;
    int len;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF)
        len = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F; /* no surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else
        return 0;
    for (int k = 1; k < len; k++) {
        if ((size_t)k >= n) {
            *bad = k;
            *trunc = true;
            return 0;
        }
        unsigned b = s[k];
        unsigned l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
        if (b < l || b > h) {
            *bad = k;
            return 0;
        }
    }
    return len;
}

size_t td_api_utf8_complete_len(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        int bad;
        bool trunc;
        int l = utf8_seq(u + i, n - i, &bad, &trunc);
        if (trunc) return i;
        i += (size_t)(l ? l : bad);
    }
    return n;
}

char *td_api_utf8_fix(const char *s, size_t n, size_t *len_p) {
    const unsigned char *u = (const unsigned char *)s;
    size_t cap;
    if (td_mul_overflow(n, 3, &cap) || td_add_overflow(cap, 1, &cap)) return NULL;
    char *out = malloc(cap);
    if (!out) return NULL;
    size_t o = 0, i = 0;
    while (i < n) {
        int bad;
        bool trunc;
        int l = utf8_seq(u + i, n - i, &bad, &trunc);
        if (l > 0) {
            memcpy(out + o, s + i, (size_t)l);
            o += (size_t)l;
            i += (size_t)l;
        } else {
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i += (size_t)bad;
        }
    }
    out[o] = 0;
    *len_p = o;
    return out;
}

/* ------------------------------------------------------------ field access */

static const char *type_name(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "a value";
}

/* The value of key, or NULL when absent or null (the default applies). */
static json_t *field(const json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return json_is_null(v) ? NULL : v;
}

/* An integer, or a number with no fractional part (pydantic's lax ints). */
static bool as_int(const json_t *v, long long *out) {
    if (json_is_integer(v)) {
        *out = (long long)json_integer_value(v);
        return true;
    }
    if (json_is_real(v)) {
        double d = json_real_value(v);
        if (d == floor(d) && d >= -9.2e18 && d <= 9.2e18) {
            *out = (long long)d;
            return true;
        }
    }
    return false;
}

static td_status get_int(const json_t *obj, const char *key, long long lo, long long hi,
                         long long *out, bool *present, td_api_error *err) {
    json_t *v = field(obj, key);
    *present = v != NULL;
    if (!v) return TD_OK;
    long long x;
    if (!as_int(v, &x)) return bad(err, key, "'%s' must be an integer, not %s", key, type_name(v));
    if (x < lo || x > hi) {
        if (hi == LLONG_MAX)
            return bad(err, key, "'%s' must be at least %lld, got %lld", key, lo, x);
        return bad(err, key, "'%s' must be in [%lld, %lld], got %lld", key, lo, hi, x);
    }
    *out = x;
    return TD_OK;
}

/* A number in [lo, hi] (lo_open: (lo, hi]). */
static td_status get_num(const json_t *obj, const char *key, double lo, bool lo_open, double hi,
                         float *out, td_api_error *err) {
    json_t *v = field(obj, key);
    if (!v) return TD_OK;
    if (!json_is_number(v))
        return bad(err, key, "'%s' must be a number, not %s", key, type_name(v));
    double x = json_number_value(v);
    if (!isfinite(x) || (lo_open ? x <= lo : x < lo) || x > hi)
        return bad(err, key, "'%s' must be in %s%g, %g], got %g", key, lo_open ? "(" : "[", lo, hi,
                   x);
    *out = (float)x;
    return TD_OK;
}

static td_status get_bool(const json_t *obj, const char *key, bool *out, td_api_error *err) {
    json_t *v = field(obj, key);
    if (!v) return TD_OK;
    if (!json_is_boolean(v))
        return bad(err, key, "'%s' must be a boolean, not %s", key, type_name(v));
    *out = json_is_true(v);
    return TD_OK;
}

static td_status dup_str(const json_t *v, char **out, td_api_error *err) {
    *out = strndup(json_string_value(v), json_string_length(v));
    return *out ? TD_OK : oom(err);
}

/* ---------------------------------------------------------------- messages */

/* Content as one string: text parts joined with "\n" (as vLLM does). */
static td_status message_content(const json_t *c, int32_t i, bool assistant, json_t **out,
                                 td_api_error *err) {
    if (!c) {
        if (!assistant) return bad(err, "messages", "messages[%d]: 'content' is required", (int)i);
        *out = json_string("");
        return *out ? TD_OK : oom(err);
    }
    if (json_is_string(c)) {
        *out = json_copy((json_t *)c);
        return *out ? TD_OK : oom(err);
    }
    if (!json_is_array(c))
        return bad(err, "messages",
                   "messages[%d].content must be a string or a list of parts, not %s", (int)i,
                   type_name(c));
    size_t total = 0, k;
    json_t *part;
    json_array_foreach(c, k, part) {
        if (!json_is_object(part))
            return bad(err, "messages", "messages[%d].content[%zu] must be an object", (int)i, k);
        json_t *type = json_object_get(part, "type");
        if (!json_is_string(type))
            return bad(err, "messages", "messages[%d].content[%zu].type must be a string", (int)i,
                       k);
        if (strcmp(json_string_value(type), "text") != 0)
            return bad(err, "messages",
                       "messages[%d].content[%zu]: content part type '%s' is not supported "
                       "(only 'text')",
                       (int)i, k, json_string_value(type));
        json_t *text = json_object_get(part, "text");
        if (!json_is_string(text))
            return bad(err, "messages", "messages[%d].content[%zu].text must be a string", (int)i,
                       k);
        total += json_string_length(text) + 1;
    }
    char *s = malloc(total + 1);
    if (!s) return oom(err);
    size_t o = 0;
    json_array_foreach(c, k, part) {
        json_t *text = json_object_get(part, "text");
        if (k) s[o++] = '\n';
        memcpy(s + o, json_string_value(text), json_string_length(text));
        o += json_string_length(text);
    }
    *out = json_stringn_nocheck(s, o);
    free(s);
    return *out ? TD_OK : oom(err);
}

/* x's "function" object when x is {"function": {"name": "...", ...}, ...}
 * (a tool, or a tool call), else NULL. */
static json_t *named_function(const json_t *x) {
    json_t *fn = json_object_get(x, "function");
    return json_is_object(x) && json_is_object(fn) && json_is_string(json_object_get(fn, "name"))
               ? fn
               : NULL;
}

/* An assistant's tool_calls as the template sees them: each function's
 * arguments an object, parsed from the JSON string the OpenAI API sends
 * (vLLM's rule; invalid JSON is a 400). */
static td_status message_tool_calls(json_t *calls, size_t i, td_api_error *err) {
    if (!json_is_array(calls))
        return bad(err, "messages", "messages[%zu].tool_calls must be a list, not %s", i,
                   type_name(calls));
    size_t k;
    json_t *c;
    json_array_foreach(calls, k, c) {
        json_t *fn = named_function(c);
        if (!fn)
            return bad(err, "messages",
                       "messages[%zu].tool_calls[%zu] must be {\"type\": \"function\", "
                       "\"function\": {\"name\": ..., \"arguments\": ...}}",
                       i, k);
        json_t *args = json_object_get(fn, "arguments");
        if (json_is_string(args)) {
            json_error_t je;
            json_t *parsed = json_loadb(json_string_value(args), json_string_length(args),
                                        JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
            if (!parsed)
                return bad(err, "messages",
                           "messages[%zu].tool_calls[%zu].function.arguments is not valid JSON: "
                           "%.200s",
                           i, k, je.text);
            if (json_object_set_new(fn, "arguments", parsed) != 0) return oom(err);
        } else if (!json_is_object(args)) {
            return bad(err, "messages",
                       "messages[%zu].tool_calls[%zu].function.arguments must be a JSON string "
                       "or an object",
                       i, k);
        }
    }
    return TD_OK;
}

td_status td_api_messages_parse(const json_t *arr, json_t **msgs_p, td_api_error *err) {
    if (!arr) return bad(err, "messages", "'messages' is required");
    if (!json_is_array(arr))
        return bad(err, "messages", "'messages' must be a list, not %s", type_name(arr));
    size_t n = json_array_size(arr);
    if (n == 0) return bad(err, "messages", "'messages' must not be empty");
    if (n > INT32_MAX) return bad(err, "messages", "too many messages");
    json_t *out = json_array();
    if (!out) return oom(err);
    td_status st = TD_OK;
    size_t i;
    json_t *m;
    json_array_foreach(arr, i, m) {
        if (!json_is_object(m)) {
            st = bad(err, "messages", "messages[%zu] must be an object, not %s", i, type_name(m));
            break;
        }
        json_t *role = json_object_get(m, "role");
        if (!json_is_string(role)) {
            st = bad(err, "messages", "messages[%zu].role must be a string", i);
            break;
        }
        const char *r = json_string_value(role);
        /* every field goes to the template (tool_call_id, name, reasoning
         * ...); role, content and tool_calls normalised */
        json_t *c = json_deep_copy(m);
        if (!c || json_array_append_new(out, c) != 0) {
            st = oom(err);
            break;
        }
        /* OpenAI's "developer" is the system message of newer clients. */
        if (json_object_set_new(c, "role",
                                json_string(strcmp(r, "developer") == 0 ? "system" : r)) != 0) {
            st = oom(err);
            break;
        }
        json_t *content = NULL;
        st = message_content(field(m, "content"), (int32_t)i, strcmp(r, "assistant") == 0, &content,
                             err);
        if (st != TD_OK) break;
        if (json_object_set_new(c, "content", content) != 0) {
            st = oom(err);
            break;
        }
        json_t *calls = field(c, "tool_calls");
        if (calls && (st = message_tool_calls(calls, i, err)) != TD_OK) break;
    }
    if (st != TD_OK) {
        json_decref(out);
        return st;
    }
    *msgs_p = out;
    return TD_OK;
}

/* The request's tools: a list of objects (each {"type": "function",
 * "function": {...}}), passed to the template as they are. */
static td_status parse_tools(const json_t *t, json_t **tools_p, td_api_error *err) {
    if (!t) return TD_OK;
    if (!json_is_array(t)) return bad(err, "tools", "'tools' must be a list, not %s", type_name(t));
    size_t k;
    json_t *x;
    json_array_foreach(t, k, x) {
        if (!named_function(x))
            return bad(err, "tools",
                       "tools[%zu] must be {\"type\": \"function\", \"function\": {\"name\": "
                       "...}}",
                       k);
    }
    *tools_p = json_deep_copy(t);
    return *tools_p ? TD_OK : oom(err);
}

/* The variables a template sees besides chat_template_kwargs, which may
 * not replace them. */
static const char *const k_template_vars[] = {
    "messages",  "tools",    "documents", "add_generation_prompt", "continue_final_message",
    "bos_token", "eos_token"};

static td_status parse_template_kwargs(const json_t *k, json_t **kw_p, td_api_error *err) {
    if (!k) return TD_OK;
    if (!json_is_object(k))
        return bad(err, "chat_template_kwargs", "'chat_template_kwargs' must be an object, not %s",
                   type_name(k));
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)k, key, v) {
        for (size_t i = 0; i < TD_ARRAY_SIZE(k_template_vars); i++)
            if (strcmp(key, k_template_vars[i]) == 0)
                return bad(err, "chat_template_kwargs",
                           "chat_template_kwargs may not set '%s', which the server passes", key);
    }
    *kw_p = json_deep_copy(k);
    return *kw_p ? TD_OK : oom(err);
}

td_status td_api_chat_parse(const json_t *root, td_api_chat *chat, td_api_error *err) {
    memset(chat, 0, sizeof *chat);
    chat->add_generation_prompt = true;
    td_status st = td_api_messages_parse(field(root, "messages"), &chat->messages, err);
    if (st == TD_OK) st = parse_tools(field(root, "tools"), &chat->tools, err);
    if (st == TD_OK)
        st = parse_template_kwargs(field(root, "chat_template_kwargs"), &chat->kwargs, err);
    json_t *t = field(root, "chat_template");
    if (st == TD_OK && t) {
        if (!json_is_string(t))
            st = bad(err, "chat_template", "'chat_template' must be a string (Jinja text)");
        else
            st = dup_str(t, &chat->template_text, err);
    }
    json_t *v = field(root, "add_generation_prompt");
    if (st == TD_OK && v) {
        if (!json_is_boolean(v))
            st = bad(err, "add_generation_prompt", "'add_generation_prompt' must be a boolean");
        else
            chat->add_generation_prompt = json_is_true(v);
    }
    v = field(root, "continue_final_message");
    if (st == TD_OK && v) {
        if (!json_is_boolean(v))
            st = bad(err, "continue_final_message", "'continue_final_message' must be a boolean");
        else
            chat->continue_final_message = json_is_true(v);
    }
    if (st == TD_OK && chat->continue_final_message && chat->add_generation_prompt &&
        field(root, "add_generation_prompt"))
        st = bad(err, "continue_final_message",
                 "continue_final_message and add_generation_prompt cannot both be true");
    if (st == TD_OK && chat->continue_final_message) chat->add_generation_prompt = false;
    if (st != TD_OK) td_api_chat_free(chat);
    return st;
}

td_status td_api_render_chat_body(const td_api_model *mdl, const json_t *root, char **text_p,
                                  td_api_error *err) {
    td_api_chat chat;
    td_status st = td_api_chat_parse(root, &chat, err);
    if (st != TD_OK) return st;
    st = td_api_render_chat(mdl, &chat, text_p, err);
    td_api_chat_free(&chat);
    return st;
}

void td_api_chat_free(td_api_chat *chat) {
    if (!chat) return;
    json_decref(chat->messages);
    json_decref(chat->tools);
    json_decref(chat->kwargs);
    free(chat->template_text);
    memset(chat, 0, sizeof *chat);
}

/* ------------------------------------------------------------------ prompt */

static td_status parse_id_list(const json_t *arr, const char *what, int32_t n_vocab,
                               int32_t **ids_p, int32_t *n_p, td_api_error *err) {
    size_t n = json_array_size(arr);
    if (n == 0) return bad(err, "prompt", "%s must not be empty", what);
    if (n > INT32_MAX) return bad(err, "prompt", "%s is too long", what);
    int32_t *ids = malloc(n * sizeof(*ids));
    if (!ids) return oom(err);
    size_t k;
    json_t *v;
    json_array_foreach(arr, k, v) {
        long long x;
        if (!as_int(v, &x)) {
            free(ids);
            return bad(err, "prompt", "%s[%zu] must be a token id, not %s", what, k, type_name(v));
        }
        if (x < 0 || (n_vocab > 0 && x >= n_vocab) || x > INT32_MAX) {
            free(ids);
            return bad(err, "prompt", "%s[%zu]: token id %lld is out of vocabulary (size %d)", what,
                       k, x, (int)n_vocab);
        }
        ids[k] = (int32_t)x;
    }
    *ids_p = ids;
    *n_p = (int32_t)n;
    return TD_OK;
}

static td_status parse_prompt(const json_t *p, const td_api_limits *lim, int32_t n_vocab,
                              td_api_request *req, td_api_error *err) {
    if (!p) return bad(err, "prompt", "'prompt' is required");
    if (json_is_string(p)) {
        req->prompts = calloc(1, sizeof(char *));
        if (!req->prompts) return oom(err);
        req->n_prompts = 1;
        return dup_str(p, &req->prompts[0], err);
    }
    if (!json_is_array(p))
        return bad(err, "prompt",
                   "'prompt' must be a string, a list of strings, a list of token ids or a list "
                   "of token-id lists, not %s",
                   type_name(p));
    size_t n = json_array_size(p);
    if (n == 0) return bad(err, "prompt", "'prompt' must not be empty");
    json_t *first = json_array_get(p, 0);
    if (json_is_integer(first) || json_is_real(first)) {
        /* One prompt of token ids. */
        req->prompt_ids = calloc(1, sizeof(int32_t *));
        req->prompt_ids_len = calloc(1, sizeof(int32_t));
        if (!req->prompt_ids || !req->prompt_ids_len) return oom(err);
        req->n_prompts = 1;
        return parse_id_list(p, "prompt", n_vocab, &req->prompt_ids[0], &req->prompt_ids_len[0],
                             err);
    }
    if (n > (size_t)lim->max_prompt_items)
        return bad(err, "prompt", "at most %d prompts per request, got %zu",
                   (int)lim->max_prompt_items, n);
    size_t k;
    json_t *v;
    if (json_is_string(first)) {
        req->prompts = calloc(n, sizeof(char *));
        if (!req->prompts) return oom(err);
        req->n_prompts = (int32_t)n;
        json_array_foreach(p, k, v) {
            if (!json_is_string(v))
                return bad(err, "prompt", "prompt[%zu] must be a string like prompt[0], not %s", k,
                           type_name(v));
            td_status st = dup_str(v, &req->prompts[k], err);
            if (st != TD_OK) return st;
        }
        return TD_OK;
    }
    if (json_is_array(first)) {
        req->prompt_ids = calloc(n, sizeof(int32_t *));
        req->prompt_ids_len = calloc(n, sizeof(int32_t));
        if (!req->prompt_ids || !req->prompt_ids_len) return oom(err);
        req->n_prompts = (int32_t)n;
        json_array_foreach(p, k, v) {
            if (!json_is_array(v))
                return bad(err, "prompt", "prompt[%zu] must be a list of token ids, not %s", k,
                           type_name(v));
            char what[40];
            snprintf(what, sizeof(what), "prompt[%zu]", k);
            td_status st =
                parse_id_list(v, what, n_vocab, &req->prompt_ids[k], &req->prompt_ids_len[k], err);
            if (st != TD_OK) return st;
        }
        return TD_OK;
    }
    return bad(err, "prompt",
               "prompt[0] must be a string, a token id or a list of token ids, not %s",
               type_name(first));
}

/* -------------------------------------------------------------- parameters */

static const char *const common_fields[] = {
    "model",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "n",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "logprobs",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "user",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_whitespace_pattern",
    "guided_decoding_backend",
    "json_schema",
    "grammar",
};
static const char *const completion_fields[] = {"prompt", "echo", "suffix", "best_of"};
static const char *const chat_fields[] = {
    "messages", "top_logprobs",         "add_generation_prompt", "continue_final_message",
    "tools",    "chat_template_kwargs", "chat_template"};

static bool in_list(const char *key, const char *const *list, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (strcmp(key, list[i]) == 0) return true;
    return false;
}

/* One INFO line naming the fields this server does not know (as vLLM). */
static void log_unknown_fields(td_api_kind kind, const json_t *root) {
    char names[512];
    size_t o = 0;
    int count = 0;
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)root, key, v) {
        if (in_list(key, common_fields, TD_ARRAY_SIZE(common_fields))) continue;
        if (kind == TD_API_COMPLETIONS &&
            in_list(key, completion_fields, TD_ARRAY_SIZE(completion_fields)))
            continue;
        if (kind == TD_API_CHAT && in_list(key, chat_fields, TD_ARRAY_SIZE(chat_fields))) continue;
        if (o < sizeof(names) - 1) {
            int w = snprintf(names + o, sizeof(names) - o, "%s%s", count ? ", " : "", key);
            if (w > 0) o = TD_MIN(o + (size_t)w, sizeof(names) - 1);
        }
        count++;
    }
    if (!count) return;
    /* The names are the client's bytes; keep the log line valid UTF-8. */
    size_t fixed_len = 0;
    char *fixed = td_api_utf8_fix(names, td_api_utf8_complete_len(names, o), &fixed_len);
    TD_LOG_INFO("ignoring unknown fields: %s", fixed ? fixed : "(out of memory)");
    free(fixed);
}

static td_status parse_stop(const json_t *root, const td_api_limits *lim, td_api_request *req,
                            td_api_error *err) {
    json_t *v = field(root, "stop");
    if (!v) return TD_OK;
    size_t n;
    if (json_is_string(v))
        n = 1;
    else if (json_is_array(v))
        n = json_array_size(v);
    else
        return bad(err, "stop", "'stop' must be a string or a list of strings, not %s",
                   type_name(v));
    if (n > (size_t)lim->max_stop)
        return bad(err, "stop", "at most %d stop strings, got %zu", (int)lim->max_stop, n);
    if (n == 0) return TD_OK;
    req->stop = calloc(n, sizeof(char *));
    if (!req->stop) return oom(err);
    for (size_t k = 0; k < n; k++) {
        json_t *s = json_is_string(v) ? v : json_array_get(v, k);
        if (!json_is_string(s))
            return bad(err, "stop", "stop[%zu] must be a string, not %s", k, type_name(s));
        if (json_string_length(s) == 0) return bad(err, "stop", "stop strings must not be empty");
        td_status st = dup_str(s, &req->stop[k], err);
        if (st != TD_OK) return st;
        req->n_stop = (int32_t)(k + 1);
    }
    return TD_OK;
}

static td_status parse_stop_ids(const json_t *root, const td_api_limits *lim, int32_t n_vocab,
                                td_api_request *req, td_api_error *err) {
    json_t *v = field(root, "stop_token_ids");
    if (!v) return TD_OK;
    if (!json_is_array(v))
        return bad(err, "stop_token_ids", "'stop_token_ids' must be a list of token ids, not %s",
                   type_name(v));
    size_t n = json_array_size(v);
    if (n > (size_t)lim->max_stop_ids)
        return bad(err, "stop_token_ids", "at most %d stop_token_ids, got %zu",
                   (int)lim->max_stop_ids, n);
    if (n == 0) return TD_OK;
    req->stop_ids = malloc(n * sizeof(int32_t));
    if (!req->stop_ids) return oom(err);
    size_t k;
    json_t *x;
    json_array_foreach(v, k, x) {
        long long id;
        if (!as_int(x, &id))
            return bad(err, "stop_token_ids", "stop_token_ids[%zu] must be an integer, not %s", k,
                       type_name(x));
        if (id < 0 || (n_vocab > 0 && id >= n_vocab) || id > INT32_MAX)
            return bad(err, "stop_token_ids",
                       "stop_token_ids[%zu]: token id %lld is out of "
                       "vocabulary (size %d)",
                       k, id, (int)n_vocab);
        req->stop_ids[k] = (int32_t)id;
        req->n_stop_ids = (int32_t)(k + 1);
    }
    return TD_OK;
}

static td_status parse_logit_bias(const json_t *root, int32_t n_vocab, td_api_request *req,
                                  td_api_error *err) {
    json_t *v = field(root, "logit_bias");
    if (!v) return TD_OK;
    if (!json_is_object(v))
        return bad(err, "logit_bias",
                   "'logit_bias' must be an object mapping token ids to "
                   "numbers, not %s",
                   type_name(v));
    size_t n = json_object_size(v);
    if (n == 0) return TD_OK;
    req->logit_bias = calloc(n, sizeof(td_logit_bias));
    if (!req->logit_bias) return oom(err);
    const char *key;
    json_t *x;
    int32_t k = 0;
    json_object_foreach(v, key, x) {
        char *end = NULL;
        errno = 0;
        long long id = strtoll(key, &end, 10);
        if (!*key || *end || errno || id < 0 || (n_vocab > 0 && id >= n_vocab) || id > INT32_MAX)
            return bad(err, "logit_bias",
                       "logit_bias: '%.64s' is not a token id in the "
                       "vocabulary (size %d)",
                       key, (int)n_vocab);
        if (!json_is_number(x))
            return bad(err, "logit_bias", "logit_bias[%.64s] must be a number, not %s", key,
                       type_name(x));
        double b = json_number_value(x);
        if (!(b >= -100.0 && b <= 100.0))
            return bad(err, "logit_bias", "logit_bias[%.64s] must be in [-100, 100], got %g", key,
                       b);
        req->logit_bias[k].token = (int32_t)id;
        req->logit_bias[k].bias = (float)b;
        req->n_logit_bias = ++k;
    }
    return TD_OK;
}

static td_status parse_logprobs(td_api_kind kind, const json_t *root, td_api_request *req,
                                td_api_error *err) {
    long long x = 0;
    bool present = false;
    td_status st;
    if (kind == TD_API_COMPLETIONS) {
        json_t *v = field(root, "logprobs");
        if (v && json_is_boolean(v))
            return bad(err, "logprobs",
                       "'logprobs' must be an integer (the number of top "
                       "logprobs), not a boolean");
        st = get_int(root, "logprobs", 0, TD_SAMPLER_MAX_LOGPROBS, &x, &present, err);
        if (st != TD_OK) return st;
        req->logprobs = present;
        req->top_logprobs = (int32_t)x;
        return TD_OK;
    }
    st = get_bool(root, "logprobs", &req->logprobs, err);
    if (st != TD_OK) return st;
    st = get_int(root, "top_logprobs", 0, TD_SAMPLER_MAX_LOGPROBS, &x, &present, err);
    if (st != TD_OK) return st;
    if (present && !req->logprobs)
        return bad(err, "top_logprobs", "when using 'top_logprobs', 'logprobs' must be true");
    req->top_logprobs = (int32_t)x;
    return TD_OK;
}

static td_status parse_sampling(const json_t *root, td_api_request *req, td_api_error *err) {
    td_sampler_params *sp = &req->sampling;
    td_status st;
    if ((st = get_num(root, "temperature", 0, false, 2, &sp->temperature, err))) return st;
    if ((st = get_num(root, "top_p", 0, true, 1, &sp->top_p, err))) return st;
    if ((st = get_num(root, "min_p", 0, false, 1, &sp->min_p, err))) return st;
    if ((st = get_num(root, "presence_penalty", -2, false, 2, &sp->presence_penalty, err)))
        return st;
    if ((st = get_num(root, "frequency_penalty", -2, false, 2, &sp->frequency_penalty, err)))
        return st;
    if ((st = get_num(root, "repetition_penalty", 0, true, 2, &sp->repetition_penalty, err)))
        return st;
    long long x = 0;
    bool present = false;
    if ((st = get_int(root, "top_k", -1, INT32_MAX, &x, &present, err))) return st;
    if (present) sp->top_k = x <= 0 ? 0 : (int32_t)x;
    if ((st = get_int(root, "seed", LLONG_MIN, LLONG_MAX, &x, &present, err))) return st;
    req->has_seed = present;
    if (present) {
        /* UINT64_MAX means "seed from the OS" to the sampler; seed -1 shares
         * its neighbour's stream instead. */
        uint64_t s = (uint64_t)x;
        sp->seed = s == TD_SAMPLER_SEED_RANDOM ? s - 1 : s;
    }
    return TD_OK;
}

/* ---------------------------------------------------- structured outputs */

/* Sets the request's constraint from field (a static name for messages):
 * text is a string's bytes or, for a JSON value, its compact text. A
 * second constraint is a 400. */
static td_status set_constraint(td_api_request *req, td_constraint_kind kind, const char *field,
                                const json_t *v, td_api_error *err) {
    if (req->constraint.kind != TD_CONSTRAINT_NONE)
        return bad(err, field, "'%s' and '%s' both constrain the output: give one",
                   req->constraint.field, field);
    char *text = json_is_string(v) ? strndup(json_string_value(v), json_string_length(v))
                                   : json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!text) {
        td_api_error_set(err, 500, "server_error", "", "", "out of memory");
        return TD_ERR_NOMEM;
    }
    req->constraint = (td_constraint){kind, text, strlen(text), field};
    return TD_OK;
}

/* A JSON Schema: an object or a boolean, or a string holding one. */
static td_status schema_value(td_api_request *req, const char *field, const json_t *v,
                              td_api_error *err) {
    if (!json_is_object(v) && !json_is_boolean(v) && !json_is_string(v))
        return bad(err, field, "'%s' must be a JSON Schema (an object), not %s", field,
                   type_name(v));
    return set_constraint(req, TD_CONSTRAINT_JSON, field, v, err);
}

static td_status string_value(td_api_request *req, td_constraint_kind kind, const char *field,
                              const json_t *v, td_api_error *err) {
    if (!json_is_string(v))
        return bad(err, field, "'%s' must be a string, not %s", field, type_name(v));
    return set_constraint(req, kind, field, v, err);
}

static td_status choice_value(td_api_request *req, const char *field, const json_t *v,
                              td_api_error *err) {
    if (!json_is_array(v) || !json_array_size(v))
        return bad(err, field, "'%s' must be a non-empty array of strings", field);
    size_t i;
    json_t *x;
    json_array_foreach(v, i, x) if (!json_is_string(x)) return bad(
        err, field, "'%s' must be a non-empty array of strings (item %zu is %s)", field, i,
        type_name(x));
    return set_constraint(req, TD_CONSTRAINT_CHOICE, field, v, err);
}

/* A constraint field's value by its kind. */
static td_status constraint_value(td_api_request *req, td_constraint_kind kind, const char *name,
                                  const json_t *v, td_api_error *err) {
    switch (kind) {
    case TD_CONSTRAINT_JSON: return schema_value(req, name, v, err);
    case TD_CONSTRAINT_CHOICE: return choice_value(req, name, v, err);
    default: return string_value(req, kind, name, v, err);
    }
}

static td_status parse_response_format(const json_t *v, td_api_request *req, td_api_error *err) {
    if (!json_is_object(v))
        return bad(err, "response_format", "'response_format' must be an object, not %s",
                   type_name(v));
    json_t *t = field(v, "type");
    const char *type = json_is_string(t) ? json_string_value(t) : NULL;
    if (!type) return bad(err, "response_format", "'response_format.type' must be a string");
    if (!strcmp(type, "text")) return TD_OK;
    if (!strcmp(type, "json_object")) {
        json_t *o = json_pack("{s:s}", "type", "object");
        td_status st =
            o ? set_constraint(req, TD_CONSTRAINT_JSON, "response_format", o, err) : TD_ERR_NOMEM;
        json_decref(o);
        return st;
    }
    if (!strcmp(type, "json_schema")) {
        /* enforced whether strict is true or false, as vLLM does */
        json_t *js = field(v, "json_schema");
        if (!json_is_object(js))
            return bad(err, "response_format",
                       "'response_format.json_schema' must be an object with a 'schema'");
        json_t *sc = field(js, "schema");
        if (!sc)
            return bad(err, "response_format", "'response_format.json_schema.schema' is missing");
        return schema_value(req, "response_format", sc, err);
    }
    return bad(err, "response_format",
               "'response_format.type' must be text, json_object or json_schema, not '%s'", type);
}

static td_status parse_structured_outputs(const json_t *v, td_api_request *req, td_api_error *err) {
    if (!json_is_object(v))
        return bad(err, "structured_outputs", "'structured_outputs' must be an object, not %s",
                   type_name(v));
    const char *key;
    json_t *x;
    td_status st = TD_OK;
    json_object_foreach((json_t *)v, key, x) {
        if (json_is_null(x)) continue;
        if (!strcmp(key, "json"))
            st = constraint_value(req, TD_CONSTRAINT_JSON, "structured_outputs.json", x, err);
        else if (!strcmp(key, "regex"))
            st = constraint_value(req, TD_CONSTRAINT_REGEX, "structured_outputs.regex", x, err);
        else if (!strcmp(key, "choice"))
            st = constraint_value(req, TD_CONSTRAINT_CHOICE, "structured_outputs.choice", x, err);
        else if (!strcmp(key, "grammar"))
            st = constraint_value(req, TD_CONSTRAINT_GRAMMAR, "structured_outputs.grammar", x, err);
        else if (!strcmp(key, "json_object")) {
            if (!json_is_boolean(x))
                return bad(err, "structured_outputs",
                           "'structured_outputs.json_object' must be a boolean");
            if (json_is_true(x)) {
                json_t *o = json_pack("{s:s}", "type", "object");
                st = o ? set_constraint(req, TD_CONSTRAINT_JSON, "structured_outputs.json_object",
                                        o, err)
                       : TD_ERR_NOMEM;
                json_decref(o);
            }
        } else if (!strcmp(key, "disable_any_whitespace") || !strcmp(key, "disable_fallback") ||
                   !strcmp(key, "disable_additional_properties")) {
            /* JSON is always compact here; there is no fallback backend */
            if (!json_is_boolean(x))
                return bad(err, "structured_outputs", "'structured_outputs.%s' must be a boolean",
                           key);
            if (!strcmp(key, "disable_additional_properties") && json_is_true(x))
                return bad(err, "structured_outputs",
                           "'structured_outputs.disable_additional_properties' is not supported");
        } else {
            return bad(err, "structured_outputs", "'structured_outputs.%s' is not supported", key);
        }
        if (st != TD_OK) return st;
    }
    return TD_OK;
}

/* The output's constraint, from every spelling the peers accept. */
static td_status parse_constraint(const json_t *root, td_api_request *req, td_api_error *err) {
    static const struct {
        const char *name;
        td_constraint_kind kind;
    } flat[] = {
        {"guided_json", TD_CONSTRAINT_JSON},     {"guided_regex", TD_CONSTRAINT_REGEX},
        {"guided_choice", TD_CONSTRAINT_CHOICE}, {"guided_grammar", TD_CONSTRAINT_GRAMMAR},
        {"json_schema", TD_CONSTRAINT_JSON}, /* llama.cpp */
        {"grammar", TD_CONSTRAINT_GRAMMAR},  /* llama.cpp (in Lark syntax here) */
    };
    td_status st = TD_OK;
    json_t *v;
    if ((v = field(root, "response_format")) && !json_is_null(v) &&
        (st = parse_response_format(v, req, err)))
        return st;
    if ((v = field(root, "structured_outputs")) && !json_is_null(v) &&
        (st = parse_structured_outputs(v, req, err)))
        return st;
    for (size_t i = 0; i < TD_ARRAY_SIZE(flat); i++)
        if ((v = field(root, flat[i].name)) && !json_is_null(v) &&
            (st = constraint_value(req, flat[i].kind, flat[i].name, v, err)))
            return st;
    if ((v = field(root, "guided_whitespace_pattern")) && !json_is_null(v))
        return bad(err, "guided_whitespace_pattern",
                   "'guided_whitespace_pattern' is not supported: JSON is written compactly");
    return TD_OK;
}

td_status td_api_request_grammar(const td_api_request *req, const td_tokenizer *tok, td_gram **g,
                                 td_api_error *err) {
    *g = NULL;
    if (req->constraint.kind == TD_CONSTRAINT_NONE) return TD_OK;
    char why[400];
    if (!(*g = td_constraint_compile(&req->constraint, tok, why, sizeof why)))
        return bad(err, req->constraint.field, "%s", why);
    return TD_OK;
}

static td_status parse_body(td_api_kind kind, const json_t *root, const td_api_limits *lim,
                            int32_t n_vocab, td_api_request *req, td_api_error *err) {
    td_status st;
    json_t *v = field(root, "model");
    if (v) {
        if (!json_is_string(v))
            return bad(err, "model", "'model' must be a string, not %s", type_name(v));
        if ((st = dup_str(v, &req->model, err))) return st;
    }

    if (kind == TD_API_COMPLETIONS) {
        if ((st = parse_prompt(field(root, "prompt"), lim, n_vocab, req, err))) return st;
    } else {
        if ((st = td_api_chat_parse(root, &req->chat, err))) return st;
    }

    long long x = 0;
    bool present = false;
    if ((st = get_int(root, "max_tokens", 1, LLONG_MAX, &x, &present, err))) return st;
    if (present) req->max_tokens = (int32_t)TD_MIN(x, (long long)INT32_MAX);
    if ((st = get_int(root, "max_completion_tokens", 1, LLONG_MAX, &x, &present, err))) return st;
    if (present) req->max_tokens = (int32_t)TD_MIN(x, (long long)INT32_MAX);
    if ((st = get_int(root, "min_tokens", 0, INT32_MAX, &x, &present, err))) return st;
    if (present) req->min_tokens = (int32_t)x;
    if (req->max_tokens > 0 && req->min_tokens > req->max_tokens)
        return bad(err, "min_tokens", "'min_tokens' (%d) must be at most 'max_tokens' (%d)",
                   (int)req->min_tokens, (int)req->max_tokens);
    if ((st = get_int(root, "n", 1, lim->max_n, &x, &present, err))) return st;
    if (present) req->n = (int32_t)x;

    if ((st = get_bool(root, "stream", &req->stream, err))) return st;
    v = field(root, "stream_options");
    if (v) {
        if (!json_is_object(v))
            return bad(err, "stream_options", "'stream_options' must be an object, not %s",
                       type_name(v));
        if (!req->stream)
            return bad(err, "stream_options",
                       "'stream_options' can only be given when 'stream' is true");
        if ((st = get_bool(v, "include_usage", &req->include_usage, err))) return st;
    }

    if ((st = parse_sampling(root, req, err))) return st;
    if ((st = parse_stop(root, lim, req, err))) return st;
    if ((st = parse_stop_ids(root, lim, n_vocab, req, err))) return st;
    if ((st = parse_logit_bias(root, n_vocab, req, err))) return st;
    req->sampling.logit_bias = req->logit_bias;
    req->sampling.n_logit_bias = req->n_logit_bias;
    if ((st = parse_logprobs(kind, root, req, err))) return st;

    if ((st = get_bool(root, "ignore_eos", &req->ignore_eos, err))) return st;
    if ((st = get_bool(root, "skip_special_tokens", &req->skip_special_tokens, err))) return st;
    if ((st = get_bool(root, "include_stop_str_in_output", &req->include_stop_str_in_output, err)))
        return st;
    v = field(root, "user");
    if (v) {
        if (!json_is_string(v))
            return bad(err, "user", "'user' must be a string, not %s", type_name(v));
        if ((st = dup_str(v, &req->user, err))) return st;
    }

    if ((st = parse_constraint(root, req, err))) return st;

    if (kind == TD_API_COMPLETIONS) {
        if ((st = get_bool(root, "echo", &req->echo, err))) return st;
        if (req->echo && req->logprobs)
            return bad(err, "echo",
                       "'echo' together with 'logprobs' needs the prompt's "
                       "logprobs, which this server does not compute");
        if (field(root, "suffix")) return bad(err, "suffix", "'suffix' is not supported");
        if ((st = get_int(root, "best_of", 1, LLONG_MAX, &x, &present, err))) return st;
        if (present && x != req->n)
            return bad(err, "best_of",
                       "'best_of' must equal 'n' (%d): ranking extra "
                       "candidates is not supported",
                       (int)req->n);
    }
    return TD_OK;
}

td_status td_api_request_parse(td_api_kind kind, const char *body, size_t len,
                               const td_api_limits *lim_in, int32_t n_vocab, td_api_request *req,
                               td_api_error *err) {
    td_api_limits lim = lim_in ? *lim_in : td_api_default_limits();
    memset(req, 0, sizeof(*req));
    if (kind != TD_API_COMPLETIONS && kind != TD_API_CHAT)
        return bad(err, "", "unknown request kind");
    if (len > lim.max_body_bytes) {
        td_api_error_set(err, 413, "invalid_request_error", "", "",
                         "request body of %zu bytes exceeds the limit of %zu bytes", len,
                         lim.max_body_bytes);
        return TD_ERR_RANGE;
    }
    json_error_t jerr;
    json_t *root = json_loadb(body ? body : "", body ? len : 0, 0, &jerr);
    if (!root) {
        /* jerr.text quotes the input near the error: keep it printable. */
        size_t fl = 0;
        char *fixed = td_api_utf8_fix(jerr.text, strnlen(jerr.text, sizeof(jerr.text)), &fl);
        td_status st = bad(err, "", "malformed JSON body: %s (line %d, column %d)",
                           fixed ? fixed : "parse error", jerr.line, jerr.column);
        free(fixed);
        return st;
    }
    if (!json_is_object(root)) {
        td_status st =
            bad(err, "", "the request body must be a JSON object, not %s", type_name(root));
        json_decref(root);
        return st;
    }
    req->kind = kind;
    req->n = 1;
    req->sampling = td_sampler_default_params();
    req->sampling.temperature = 1.0f; /* OpenAI's and vLLM's default */
    req->skip_special_tokens = true;
    td_status st = parse_body(kind, root, &lim, n_vocab, req, err);
    if (st == TD_OK) log_unknown_fields(kind, root);
    json_decref(root);
    if (st != TD_OK) {
        td_api_request_free(req);
        req->kind = kind;
    }
    return st;
}

void td_api_request_free(td_api_request *req) {
    if (!req) return;
    free(req->model);
    if (req->prompts)
        for (int32_t i = 0; i < req->n_prompts; i++) free(req->prompts[i]);
    free(req->prompts);
    if (req->prompt_ids)
        for (int32_t i = 0; i < req->n_prompts; i++) free(req->prompt_ids[i]);
    free(req->prompt_ids);
    free(req->prompt_ids_len);
    td_api_chat_free(&req->chat);
    free(req->logit_bias);
    if (req->stop)
        for (int32_t i = 0; i < req->n_stop; i++) free(req->stop[i]);
    free(req->stop);
    free(req->stop_ids);
    free(req->user);
    td_constraint_clear(&req->constraint);
    memset(req, 0, sizeof(*req));
}

/* ------------------------------------------------------------ tokenization */

td_status td_api_check_model(const td_api_model *mdl, const char *model, td_api_error *err) {
    if (!model || !mdl->model_name || strcmp(model, mdl->model_name) == 0) return TD_OK;
    for (int i = 0; i < mdl->n_aliases; i++)
        if (strcmp(model, mdl->aliases[i]) == 0) return TD_OK;
    td_api_error_set(err, 404, "not_found_error", "model_not_found", "model",
                     "The model '%.200s' does not exist.", model);
    return TD_ERR_NOT_FOUND;
}

/* transformers' reasoning aliases: a message with reasoning_content,
 * thinking or reasoning gets all of "thinking" (first) and
 * "reasoning_content" (last), which is what chat templates read */
static bool alias_reasoning(json_t *msgs) {
    static const char *const fields[] = {"reasoning_content", "thinking", "reasoning"};
    size_t i;
    json_t *m;
    json_array_foreach(msgs, i, m) {
        json_t *r = NULL;
        for (size_t k = 0; k < TD_ARRAY_SIZE(fields) && !r; k++) r = field(m, fields[k]);
        if (!r) continue;
        json_incref(r);
        json_t *a = json_object();
        const char *key;
        json_t *v;
        bool ok = a && json_object_set(a, "thinking", r) == 0;
        json_object_foreach(m, key, v) ok = ok && json_object_set(a, key, v) == 0;
        /* Python's {"thinking": r, **m, "reasoning_content": r}: a key keeps
         * its first position, takes its last value */
        ok = ok && json_object_set(a, "reasoning_content", r) == 0 &&
             json_array_set_new(msgs, i, a) == 0;
        json_decref(r);
        if (!ok) return false;
    }
    return true;
}

#define CONTINUE_TAG "CONTINUE_FINAL_MESSAGE_TAG "

static td_status render_with(const td_api_model *mdl, const td_chat *tc, const td_api_chat *chat,
                             char **text_p, td_api_error *err);

td_status td_api_render_chat(const td_api_model *mdl, const td_api_chat *chat, char **text_p,
                             td_api_error *err) {
    if (chat->template_text) { /* the request's own, compiled for it alone */
        if (!mdl->trust_request_template)
            return bad(err, "chat_template",
                       "a chat_template in the request is refused: the server was not started "
                       "with --trust-request-chat-template");
        td_chat *own = NULL;
        char cmsg[512];
        td_status cs = td_chat_compile(chat->template_text, "the request's chat_template", &own,
                                       cmsg, sizeof cmsg);
        if (cs == TD_ERR_NOMEM) return oom(err);
        if (cs != TD_OK) return bad(err, "chat_template", "%s", cmsg);
        cs = render_with(mdl, own, chat, text_p, err);
        td_chat_free(own);
        return cs;
    }
    if (!mdl->chat)
        return bad(err, "messages", "%s",
                   mdl->chat_error ? mdl->chat_error
                                   : "this model has no chat template; start the server with "
                                     "--chat-template NAME|FILE, or use /v1/completions");
    return render_with(mdl, chat->tools && mdl->chat_tools ? mdl->chat_tools : mdl->chat, chat,
                       text_p, err);
}

/* Renders chat with template tc (the model's or the request's own). */
static td_status render_with(const td_api_model *mdl, const td_chat *tc, const td_api_chat *chat,
                             char **text_p, td_api_error *err) {
    const char *bos = "", *eos = "";
    if (mdl->tok) {
        int32_t b = td_tokenizer_bos(mdl->tok), e = td_tokenizer_eos(mdl->tok);
        const char *bt = b >= 0 ? td_tokenizer_token_text(mdl->tok, b) : NULL;
        const char *et = e >= 0 ? td_tokenizer_token_text(mdl->tok, e) : NULL;
        bos = bt ? bt : "";
        eos = et ? et : "";
    }
    /* the context transformers' apply_chat_template builds */
    json_t *ctx = json_object(), *msgs = json_deep_copy(chat->messages);
    json_t *final_content = NULL;
    bool ok = ctx && msgs && json_object_set_new(ctx, "messages", msgs) == 0;
    if (!ok) json_decref(msgs);
    ok = ok && alias_reasoning(msgs);
    if (ok && chat->continue_final_message) {
        /* transformers: the final message's content, tagged, then cut at the tag */
        json_t *last = json_array_get(msgs, json_array_size(msgs) - 1);
        json_t *c = json_object_get(last, "content");
        if (!json_is_string(c)) {
            json_decref(ctx);
            return bad(err, "continue_final_message",
                       "continue_final_message is set but the final message has no content to "
                       "continue");
        }
        final_content = json_copy(c);
        size_t n = json_string_length(c);
        char *t = malloc(n + sizeof CONTINUE_TAG);
        ok = t && final_content;
        if (ok) {
            memcpy(t, json_string_value(c), n);
            memcpy(t + n, CONTINUE_TAG, sizeof CONTINUE_TAG);
            ok = json_object_set_new(last, "content",
                                     json_stringn_nocheck(t, n + sizeof CONTINUE_TAG - 1)) == 0;
        }
        free(t);
    }
    const char *key;
    json_t *v;
    if (ok && chat->kwargs)
        json_object_foreach(chat->kwargs, key, v) ok = ok && json_object_set(ctx, key, v) == 0;
    ok = ok && td_chat_context_set(ctx, chat->tools, chat->add_generation_prompt, bos, eos);
    if (!ok) {
        json_decref(ctx);
        json_decref(final_content);
        return oom(err);
    }
    char *text = NULL;
    char msg[512];
    td_status st = td_chat_render(tc, ctx, &text, msg, sizeof msg);
    json_decref(ctx);
    if (st == TD_ERR_NOMEM) {
        json_decref(final_content);
        return oom(err);
    }
    if (st != TD_OK) {
        json_decref(final_content);
        return bad(err, "messages", "%s cannot format this conversation: %s", td_chat_label(tc),
                   msg);
    }
    if (final_content) {
        /* the final message must survive the template, tag and all */
        char *tag = strstr(text, "CONTINUE_FINAL_MESSAGE_TAG"), *last = NULL;
        while (tag) {
            last = tag;
            tag = strstr(tag + 1, "CONTINUE_FINAL_MESSAGE_TAG");
        }
        json_decref(final_content);
        if (!last) {
            free(text);
            return bad(err, "continue_final_message",
                       "continue_final_message is set but the final message does not appear in "
                       "the chat after applying the chat template");
        }
        if (strncmp(last, CONTINUE_TAG, sizeof CONTINUE_TAG - 1) == 0) {
            *last = 0;
        } else { /* the template trimmed the trailing space: cut more cautiously */
            while (last > text && isspace((unsigned char)last[-1])) last--;
            *last = 0;
        }
    }
    *text_p = text;
    return TD_OK;
}

td_status td_api_request_tokens(const td_api_model *mdl, const td_api_request *req, int32_t i,
                                int32_t **tokens_p, int32_t *n_p, int32_t *max_tokens_p,
                                td_api_error *err) {
    td_status st = td_api_check_model(mdl, req->model, err);
    if (st != TD_OK) return st;
    int32_t *toks = NULL;
    size_t n = 0;
    const char *what = req->kind == TD_API_CHAT ? "messages" : "prompt";
    if (req->kind == TD_API_CHAT) {
        char *text = NULL;
        st = td_api_render_chat(mdl, &req->chat, &text, err);
        if (st != TD_OK) return st;
        /* The template writes BOS itself where the model wants it. */
        st = td_tokenizer_encode(mdl->tok, text, strlen(text), false, true, &toks, &n);
        free(text);
    } else {
        if (i < 0 || i >= req->n_prompts) return bad(err, "prompt", "no prompt %d", (int)i);
        if (req->prompts) {
            st = td_tokenizer_encode(mdl->tok, req->prompts[i], strlen(req->prompts[i]), true, true,
                                     &toks, &n);
        } else {
            n = (size_t)req->prompt_ids_len[i];
            toks = malloc(n * sizeof(int32_t));
            if (!toks) return oom(err);
            memcpy(toks, req->prompt_ids[i], n * sizeof(int32_t));
        }
    }
    if (st == TD_ERR_NOMEM) return oom(err);
    if (st != TD_OK) {
        td_api_error_set(err, 500, "server_error", "", "", "tokenization failed: %s",
                         td_status_str(st));
        return st;
    }
    if (n == 0) {
        free(toks);
        return bad(err, what, "the %s is empty after tokenization", what);
    }
    int64_t ctx = mdl->max_ctx;
    if ((int64_t)n + 1 > ctx) {
        td_api_error_set(err, 400, "invalid_request_error", "context_length_exceeded", what,
                         "This model's maximum context length is %lld tokens. However, your "
                         "request has %zu input tokens. Please reduce the length of the input.",
                         (long long)ctx, n);
        free(toks);
        return TD_ERR_RANGE;
    }
    int32_t max_tokens = (int32_t)(ctx - (int64_t)n);
    if (req->max_tokens > 0) {
        if ((int64_t)n + req->max_tokens > ctx) {
            td_api_error_set(err, 400, "invalid_request_error", "context_length_exceeded",
                             "max_tokens",
                             "This model's maximum context length is %lld tokens. However, you "
                             "requested %lld tokens (%zu in the %s, %d in the completion). Please "
                             "reduce the length of the %s or completion.",
                             (long long)ctx, (long long)n + req->max_tokens, n, what,
                             (int)req->max_tokens, what);
            free(toks);
            return TD_ERR_RANGE;
        }
        max_tokens = req->max_tokens;
    }
    *tokens_p = toks;
    *n_p = (int32_t)n;
    *max_tokens_p = max_tokens;
    return TD_OK;
}

void td_api_request_to_gen(const td_api_request *req, const int32_t *tokens, int32_t n_tokens,
                           int32_t max_tokens, int32_t choice, td_gen_request *g) {
    td_gen_request_init(g);
    g->prompt = tokens;
    g->n_prompt = n_tokens;
    g->max_tokens = max_tokens;
    g->min_tokens = TD_MIN(req->min_tokens, max_tokens);
    g->sampling = req->sampling;
    g->sampling.logit_bias = req->logit_bias;
    g->sampling.n_logit_bias = req->n_logit_bias;
    g->sampling.logprobs = req->logprobs;
    g->sampling.n_logprobs = req->logprobs ? req->top_logprobs : 0;
    if (req->has_seed) {
        uint64_t s = req->sampling.seed + (uint64_t)choice;
        g->sampling.seed = s == TD_SAMPLER_SEED_RANDOM ? 0 : s;
    }
    g->stop_ids = req->stop_ids;
    g->n_stop_ids = req->n_stop_ids;
    g->stop = (const char *const *)req->stop;
    g->n_stop = req->n_stop;
    g->include_stop_str = req->include_stop_str_in_output;
    g->ignore_eos = req->ignore_eos;
    g->skip_special = req->skip_special_tokens;
}

td_status td_api_submit(td_sched *s, const td_api_submit_hook *h, td_gen_request *g,
                        td_gen_stream **st_p) {
    if (h && h->fn) h->fn(h->ctx, g);
    td_status st = h && h->submit ? h->submit(h->ctx, g, st_p) : td_sched_submit(s, g, st_p);
    if (st != TD_OK && g->kv_import.release) g->kv_import.release(g->kv_import.ctx);
    return st;
}

const char *td_api_not_ready(td_sched *s, const td_api_submit_hook *h) {
    if (h && h->not_ready) return h->not_ready(h->ctx);
    return s && td_sched_draining(s) ? "draining" : NULL;
}
