/* Chat templates through the template engine; the six built-in names are
 * the Jinja texts below (the same as tests/tokenizer/templates/, from
 * which tests/unit/test_chat.c checks them and their jinja2 goldens). */
#include "chat.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/template/template.h"
#include "tokenizer-impl.h"

struct td_chat {
    td_tmpl *t;
    char *label;
};

/* clang-format off */
static const struct {
    const char *name, *text;
} k_builtin[] = {
    {"chatml",
     "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"},
    {"smollm2",
     "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
     "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
     "' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n"
     "' + message['content'] + '<|im_end|>' + '\n"
     "'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n"
     "' }}{% endif %}"},
    {"llama3",
     "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n"
     "\n"
     "'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n"
     "\n"
     "' }}{% endif %}"},
    {"llama2",
     "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"},
    {"mistral",
     "{%- if messages[0]['role'] == 'system' %}\n"
     "    {%- set system_message = messages[0]['content'] %}\n"
     "    {%- set loop_messages = messages[1:] %}\n"
     "{%- else %}\n"
     "    {%- set loop_messages = messages %}\n"
     "{%- endif %}\n"
     "\n"
     "{{- bos_token }}\n"
     "{%- for message in loop_messages %}\n"
     "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
     "        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}\n"
     "    {%- endif %}\n"
     "    {%- if message['role'] == 'user' %}\n"
     "        {%- if loop.first and system_message is defined %}\n"
     "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
     "        {%- else %}\n"
     "            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n"
     "        {%- endif %}\n"
     "    {%- elif message['role'] == 'assistant' %}\n"
     "        {{- ' ' + message['content'] + eos_token}}\n"
     "    {%- else %}\n"
     "        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}\n"
     "    {%- endif %}\n"
     "{%- endfor %}\n"},
    {"zephyr",
     "{% for message in messages %}\n"
     "{% if message['role'] == 'user' %}\n"
     "{{ '<|user|>\n"
     "' + message['content'] + eos_token }}\n"
     "{% elif message['role'] == 'system' %}\n"
     "{{ '<|system|>\n"
     "' + message['content'] + eos_token }}\n"
     "{% elif message['role'] == 'assistant' %}\n"
     "{{ '<|assistant|>\n"
     "'  + message['content'] + eos_token }}\n"
     "{% endif %}\n"
     "{% if loop.last and add_generation_prompt %}\n"
     "{{ '<|assistant|>' }}\n"
     "{% endif %}\n"
     "{% endfor %}"},
};
/* clang-format on */

const char *td_chat_builtin(const char *name) {
    if (!name) return NULL;
    for (size_t i = 0; i < TD_ARRAY_SIZE(k_builtin); i++)
        if (strcmp(k_builtin[i].name, name) == 0) return k_builtin[i].text;
    return NULL;
}

td_status td_chat_compile(const char *jinja, const char *label, td_chat **chat_p, char *err,
                          size_t errlen) {
    td_chat *c = calloc(1, sizeof *c);
    if (!c) return TD_ERR_NOMEM;
    c->label = strdup(label ? label : "the chat template");
    if (!c->label) {
        free(c);
        return TD_ERR_NOMEM;
    }
    char msg[384];
    c->t = td_tmpl_compile(jinja, msg, sizeof msg);
    if (!c->t) {
        if (err && errlen) snprintf(err, errlen, "%s does not compile: %s", c->label, msg);
        free(c->label);
        free(c);
        return TD_ERR_INVALID;
    }
    *chat_p = c;
    return TD_OK;
}

td_status td_chat_load(const char *spec, td_chat **chat_p, char *err, size_t errlen) {
    const char *b = td_chat_builtin(spec);
    if (b) return td_chat_compile(b, spec, chat_p, err, errlen);
    char *text = NULL;
    const td_status rs = td_tok_read_text(spec, 64u << 20, &text); /* no template is that large */
    if (rs == TD_ERR_NOT_FOUND) {
        if (err && errlen)
            snprintf(err, errlen,
                     "unknown chat template '%s': neither a name (chatml, smollm2, llama3, llama2, "
                     "mistral, zephyr) nor a readable file",
                     spec);
        return TD_ERR_NOT_FOUND;
    }
    if (rs != TD_OK) {
        if (err && errlen) snprintf(err, errlen, "cannot read the chat template file %s", spec);
        return TD_ERR_IO;
    }
    const td_status st = td_chat_compile(text, spec, chat_p, err, errlen);
    free(text);
    return st;
}

td_status td_chat_pick(const char *spec, const char *model_tmpl, td_chat **chat_p, char *err,
                       size_t errlen) {
    if (spec) return td_chat_load(spec, chat_p, err, errlen);
    if (!model_tmpl) {
        if (err && errlen)
            snprintf(
                err, errlen,
                "the model has no chat template: start with --chat-template NAME|FILE (chatml, "
                "smollm2, llama3, llama2, mistral, zephyr, or a Jinja file)");
        return TD_ERR_NOT_FOUND;
    }
    return td_chat_compile(model_tmpl, "the model's chat template", chat_p, err, errlen);
}

td_status td_chat_pick_serving(const char *spec, const td_tokenizer *tok, td_chat **chat_p,
                               td_chat **tools_p, char *why, size_t whylen) {
    *chat_p = *tools_p = NULL;
    const td_status st = td_chat_pick(spec, td_tokenizer_chat_template(tok), chat_p, why, whylen);
    if (st != TD_OK) {
        *chat_p = NULL;
        if (spec) return st;
        TD_LOG_WARN("%s: /v1/chat/completions will answer 400", why);
    }
    const char *tool_tmpl = td_tokenizer_chat_template_named(tok, "tool_use");
    if (spec || !tool_tmpl) return TD_OK;
    char msg[512];
    if (td_chat_compile(tool_tmpl, "the model's tool_use chat template", tools_p, msg,
                        sizeof msg) != TD_OK) {
        *tools_p = NULL;
        TD_LOG_WARN("%s: requests with tools use the default template", msg);
    }
    return TD_OK;
}

void td_chat_free(td_chat *c) {
    if (!c) return;
    td_tmpl_free(c->t);
    free(c->label);
    free(c);
}

const char *td_chat_label(const td_chat *c) { return c->label; }

bool td_chat_context_set(json_t *ctx, const json_t *tools, bool add_generation_prompt,
                         const char *bos, const char *eos) {
    return json_object_set_new(ctx, "tools", tools ? json_incref((json_t *)tools) : json_null()) ==
               0 &&
           json_object_set_new(ctx, "documents", json_null()) == 0 &&
           json_object_set_new(ctx, "add_generation_prompt", json_boolean(add_generation_prompt)) ==
               0 &&
           json_object_set_new(ctx, "bos_token", json_string_nocheck(bos ? bos : "")) == 0 &&
           json_object_set_new(ctx, "eos_token", json_string_nocheck(eos ? eos : "")) == 0;
}

td_status td_chat_render(const td_chat *c, const json_t *ctx, char **out_p, char *err,
                         size_t errlen) {
    char *out = NULL;
    size_t len = 0;
    const td_status st = td_tmpl_render(c->t, ctx, NULL, &out, &len, err, errlen);
    if (st != TD_OK) return st;
    *out_p = out;
    return TD_OK;
}

td_status td_chat_apply(const td_chat *c, const td_chat_msg *msgs, size_t n,
                        bool add_generation_prompt, const char *bos, const char *eos, char **out_p,
                        char *err, size_t errlen) {
    json_t *ctx = json_object(), *arr = json_array();
    if (!ctx || !arr) {
        json_decref(ctx);
        json_decref(arr);
        return TD_ERR_NOMEM;
    }
    bool ok = json_object_set_new(ctx, "messages", arr) == 0;
    for (size_t i = 0; ok && i < n; i++) {
        json_t *m = json_object();
        ok = m && json_array_append_new(arr, m) == 0 &&
             json_object_set_new(m, "role",
                                 json_string_nocheck(msgs[i].role ? msgs[i].role : "")) == 0 &&
             json_object_set_new(m, "content",
                                 msgs[i].content ? json_string_nocheck(msgs[i].content)
                                                 : json_null()) == 0;
    }
    ok = ok && td_chat_context_set(ctx, NULL, add_generation_prompt, bos, eos);
    if (!ok) {
        json_decref(ctx);
        return TD_ERR_NOMEM;
    }
    const td_status st = td_chat_render(c, ctx, out_p, err, errlen);
    json_decref(ctx);
    return st;
}
