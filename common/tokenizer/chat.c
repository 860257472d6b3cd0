/* Chat templates: each family is rendered by hand exactly as its reference
 * Jinja template renders (HF's apply_chat_template: trim_blocks and
 * lstrip_blocks on). The reference texts are kept under
 * tests/tokenizer/templates/, and tests/unit/test_chat.c compares with
 * what jinja2 renders from them. */
#include "chat.h"

#include <string.h>

#include "common/base/strbuf.h"
#include "tokenizer-impl.h"

static const char *const names[TD_CHAT_COUNT] = {
    [TD_CHAT_CHATML] = "chatml", [TD_CHAT_SMOLLM2] = "smollm2", [TD_CHAT_LLAMA3] = "llama3",
    [TD_CHAT_LLAMA2] = "llama2", [TD_CHAT_MISTRAL] = "mistral", [TD_CHAT_ZEPHYR] = "zephyr",
};

#define SMOLLM2_SYSTEM "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

static bool has(const char *s, const char *needle) { return strstr(s, needle) != NULL; }

td_chat_template td_chat_template_detect(const char *t) {
    if (!t) return TD_CHAT_UNKNOWN;
    if (has(t, "<|im_start|>")) {
        if (has(t, "<|im_sep|>") || has(t, "<end_of_utterance>")) return TD_CHAT_UNKNOWN;
        if (has(t, "named SmolLM")) return TD_CHAT_SMOLLM2;
        if (has(t, "tools") || has(t, "<think>"))
            return TD_CHAT_UNKNOWN; /* tool/reasoning variants */
        return TD_CHAT_CHATML;
    }
    if (has(t, "<|start_header_id|>") && has(t, "<|end_header_id|>") && has(t, "<|eot_id|>")) {
        /* Llama 3.1+ templates inject dates and tool prompts: not this renderer */
        if (has(t, "Cutting Knowledge Date") || has(t, "tools")) return TD_CHAT_UNKNOWN;
        return TD_CHAT_LLAMA3;
    }
    if (has(t, "[INST]")) {
        if (has(t, "' [INST] ' + system_message")) return TD_CHAT_MISTRAL;
        if (has(t, "<<SYS>>") && has(t, "bos_token + '[INST] ' + content.strip()"))
            return TD_CHAT_LLAMA2;
        return TD_CHAT_UNKNOWN;
    }
    if (has(t, "<|user|>") && has(t, "<|assistant|>") && has(t, "<|system|>") &&
        !has(t, "<|end|>") && has(t, "eos_token"))
        return TD_CHAT_ZEPHYR;
    return TD_CHAT_UNKNOWN;
}

td_chat_template td_chat_template_from_name(const char *name) {
    if (!name) return TD_CHAT_UNKNOWN;
    for (int i = 0; i < TD_CHAT_COUNT; i++)
        if (strcmp(names[i], name) == 0) return (td_chat_template)i;
    return TD_CHAT_UNKNOWN;
}

const char *td_chat_template_name(td_chat_template t) {
    if (t < 0 || t >= TD_CHAT_COUNT) return "unknown";
    return names[t];
}

/* Python's str.isspace() set, which Jinja's trim and str.strip() use. */
static size_t space_at(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    if (n == 0) return 0;
    if (u[0] == ' ' || (u[0] >= 0x09 && u[0] <= 0x0D) || (u[0] >= 0x1C && u[0] <= 0x1F)) return 1;
    uint32_t cp;
    size_t l = td_utf8_decode(u, n, &cp);
    if (l == 0) return 0;
    if (cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
        cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000)
        return l;
    return 0;
}

/* Python str.strip(): the stripped range of s as (*start_p, *len_p). */
static void strip(const char *s, bool left, size_t *start_p, size_t *len_p) {
    size_t n = strlen(s), a = 0;
    if (left) {
        size_t k;
        while (a < n && (k = space_at(s + a, n - a)) > 0) a += k;
    }
    /* from the right: find the end of the last non-space character */
    size_t end = a, i = a;
    while (i < n) {
        size_t k = space_at(s + i, n - i);
        if (k > 0) {
            i += k;
        } else {
            uint32_t cp;
            size_t l = td_utf8_decode((const unsigned char *)s + i, n - i, &cp);
            i += l ? l : 1;
            end = i;
        }
    }
    *start_p = a;
    *len_p = end - a;
}

static void put_stripped(td_strbuf *b, const char *s, bool left) {
    size_t a, l;
    strip(s, left, &a, &l);
    td_strbuf_put(b, s + a, l);
}

static bool is(const char *role, const char *r) { return role && strcmp(role, r) == 0; }

td_status td_chat_apply(td_chat_template t, const td_chat_msg *msgs, size_t n,
                        bool add_generation_prompt, const char *bos, const char *eos,
                        char **out_p) {
    if (!out_p || (n > 0 && !msgs)) return TD_ERR_INVALID;
    if (t < 0 || t >= TD_CHAT_COUNT) {
        TD_LOG_ERROR("unknown chat template (known: chatml, smollm2, llama3, llama2, mistral, "
                     "zephyr)");
        return TD_ERR_INVALID;
    }
    for (size_t i = 0; i < n; i++) {
        if (!msgs[i].role || !msgs[i].content) {
            TD_LOG_ERROR("chat message %zu has no role or content", i);
            return TD_ERR_INVALID;
        }
    }
    if (!bos) bos = "";
    if (!eos) eos = "";
    td_strbuf b = {0};
    td_strbuf_put(&b, "", 0);
    td_status st = TD_OK;

    switch (t) {
    case TD_CHAT_CHATML:
    case TD_CHAT_SMOLLM2:
        for (size_t i = 0; i < n; i++) {
            if (t == TD_CHAT_SMOLLM2 && i == 0 && !is(msgs[0].role, "system"))
                td_strbuf_puts(&b, "<|im_start|>system\n" SMOLLM2_SYSTEM "<|im_end|>\n");
            td_strbuf_puts(&b, "<|im_start|>");
            td_strbuf_puts(&b, msgs[i].role);
            td_strbuf_puts(&b, "\n");
            td_strbuf_puts(&b, msgs[i].content);
            td_strbuf_puts(&b, "<|im_end|>\n");
        }
        if (add_generation_prompt) td_strbuf_puts(&b, "<|im_start|>assistant\n");
        break;
    case TD_CHAT_LLAMA3:
        for (size_t i = 0; i < n; i++) {
            if (i == 0) td_strbuf_puts(&b, bos);
            td_strbuf_puts(&b, "<|start_header_id|>");
            td_strbuf_puts(&b, msgs[i].role);
            td_strbuf_puts(&b, "<|end_header_id|>\n\n");
            put_stripped(&b, msgs[i].content, true);
            td_strbuf_puts(&b, "<|eot_id|>");
        }
        if (add_generation_prompt)
            td_strbuf_puts(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    case TD_CHAT_LLAMA2:
    case TD_CHAT_MISTRAL: {
        size_t first = 0;
        const char *sys = NULL;
        if (n > 0 && is(msgs[0].role, "system")) {
            sys = msgs[0].content;
            first = 1;
        }
        if (t == TD_CHAT_MISTRAL) td_strbuf_puts(&b, bos);
        for (size_t i = first; i < n; i++) {
            size_t idx = i - first;
            const char *role = msgs[i].role;
            if (is(role, "user") != (idx % 2 == 0)) {
                TD_LOG_ERROR("chat template %s: roles must alternate user/assistant after the "
                             "optional system message (message %zu is '%s')",
                             names[t], i, role);
                st = TD_ERR_INVALID;
                goto out;
            }
            if (t == TD_CHAT_LLAMA2) {
                if (is(role, "user")) {
                    td_strbuf_puts(&b, bos);
                    td_strbuf_puts(&b, "[INST] ");
                    if (idx == 0 && sys) {
                        /* content.strip() of "<<SYS>>\n" + sys + ... + content:
                         * the leading strip never reaches past "<<SYS>>" */
                        td_strbuf_puts(&b, "<<SYS>>\n");
                        td_strbuf_puts(&b, sys);
                        td_strbuf_puts(&b, "\n<</SYS>>\n\n");
                        put_stripped(&b, msgs[i].content, false);
                    } else {
                        put_stripped(&b, msgs[i].content, true);
                    }
                    td_strbuf_puts(&b, " [/INST]");
                } else if (is(role, "assistant")) { /* never idx 0: roles alternate */
                    td_strbuf_puts(&b, " ");
                    put_stripped(&b, msgs[i].content, true);
                    td_strbuf_puts(&b, " ");
                    td_strbuf_puts(&b, eos);
                }
                /* other roles at assistant positions render nothing */
            } else {
                if (is(role, "user")) {
                    td_strbuf_puts(&b, " [INST] ");
                    if (idx == 0 && sys) {
                        td_strbuf_puts(&b, sys);
                        td_strbuf_puts(&b, "\n\n");
                    }
                    td_strbuf_puts(&b, msgs[i].content);
                    td_strbuf_puts(&b, " [/INST]");
                } else if (is(role, "assistant")) {
                    td_strbuf_puts(&b, " ");
                    td_strbuf_puts(&b, msgs[i].content);
                    td_strbuf_puts(&b, eos);
                } else {
                    TD_LOG_ERROR("chat template mistral: only user and assistant roles after an "
                                 "optional first system message (message %zu is '%s')",
                                 i, role);
                    st = TD_ERR_INVALID;
                    goto out;
                }
            }
        }
        break;
    }
    case TD_CHAT_ZEPHYR:
        for (size_t i = 0; i < n; i++) {
            const char *role = msgs[i].role;
            if (is(role, "user") || is(role, "system") || is(role, "assistant")) {
                td_strbuf_puts(&b, "<|");
                td_strbuf_puts(&b, role);
                td_strbuf_puts(&b, "|>\n");
                td_strbuf_puts(&b, msgs[i].content);
                td_strbuf_puts(&b, eos);
                td_strbuf_puts(&b, "\n");
            }
            if (i + 1 == n && add_generation_prompt) td_strbuf_puts(&b, "<|assistant|>\n");
        }
        break;
    default: st = TD_ERR_INVALID; break;
    }
out:
    if (!st && b.oom) st = TD_ERR_NOMEM;
    if (st) {
        free(b.v);
        return st;
    }
    *out_p = b.v;
    return TD_OK;
}
