/* Chat templates: recognise the common families from the model's Jinja
 * template text and render them exactly as the template would (byte for
 * byte, including SmolLM2's default system prompt). No Jinja engine: each
 * family is a hand-written renderer, chosen by detection or by name. */
#ifndef TD_CHAT_H
#define TD_CHAT_H

#include <stdbool.h>
#include <stddef.h>

#include "common/base/base.h"

typedef enum {
    TD_CHAT_UNKNOWN = -1,
    TD_CHAT_CHATML = 0, /* <|im_start|>role\ncontent<|im_end|>\n */
    TD_CHAT_SMOLLM2,    /* ChatML + default system prompt when none is given */
    TD_CHAT_LLAMA3,     /* <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> */
    TD_CHAT_LLAMA2,     /* [INST] <<SYS>> ... */
    TD_CHAT_MISTRAL,    /* [INST] ... [/INST] (system folded into the first user turn) */
    TD_CHAT_ZEPHYR,     /* <|user|>\ncontent</s>\n */
    TD_CHAT_COUNT
} td_chat_template;

typedef struct {
    const char *role; /* "system" | "user" | "assistant" */
    const char *content;
} td_chat_msg;

/* Detects the family from template text; TD_CHAT_UNKNOWN if unrecognised. */
td_chat_template td_chat_template_detect(const char *tmpl);
/* "chatml", "smollm2", "llama3", "llama2", "mistral", "zephyr"; UNKNOWN otherwise. */
td_chat_template td_chat_template_from_name(const char *name);
const char *td_chat_template_name(td_chat_template t);

/* Renders msgs. bos/eos: the model's BOS/EOS token texts (may be "").
 * *out_p is malloc'd, NUL-terminated (caller frees). TD_ERR_INVALID for an
 * unknown template or a role the template cannot express. */
td_status td_chat_apply(td_chat_template t, const td_chat_msg *msgs, size_t n,
                        bool add_generation_prompt, const char *bos, const char *eos, char **out_p);

#endif
