/* Internals of request.c that the HTTP front end shares (/tokenize takes
 * the same messages as chat; responses need valid UTF-8 for JSON). */
#ifndef TD_API_REQUEST_IMPL_H
#define TD_API_REQUEST_IMPL_H

#include <jansson.h>

#include "request.h"

/* Parses a chat "messages" array (the rules of /v1/chat/completions:
 * non-empty, each an object with a string role and content a string, null
 * or absent for the assistant, or a list of {"type": "text", "text": ...}
 * parts; "developer" is "system"; each tool call's arguments a JSON string
 * or an object) into *msgs_p, the normalised copy the template sees
 * (td_api_chat). Fills err (400, param "messages"). */
td_status td_api_messages_parse(const json_t *arr, json_t **msgs_p, td_api_error *err);

/* The chat fields of a request body: messages, tools, chat_template_kwargs
 * (which may not set a variable the server passes), add_generation_prompt,
 * continue_final_message (which turns add_generation_prompt off; both true
 * is a 400). Free with td_api_chat_free (accepts a zeroed chat). */
td_status td_api_chat_parse(const json_t *root, td_api_chat *chat, td_api_error *err);
void td_api_chat_free(td_api_chat *chat);

/* Renders a chat with the model's chat template, with the variables
 * transformers' apply_chat_template passes (messages with its reasoning
 * aliases, tools, documents, add_generation_prompt, bos_token and
 * eos_token from the tokenizer, chat_template_kwargs) and its
 * continue_final_message rule. *text_p malloc'd on success; 400 (err) if
 * the model has no usable template or the template raises. */
td_status td_api_render_chat(const td_api_model *mdl, const td_api_chat *chat, char **text_p,
                             td_api_error *err);

/* td_api_chat_parse of a request body, then td_api_render_chat: the
 * text a chat request with this body renders (/tokenize, /apply-template). */
td_status td_api_render_chat_body(const td_api_model *mdl, const json_t *root, char **text_p,
                                  td_api_error *err);

/* Checks the model name against the served one: NULL is accepted, another
 * name is 404 model_not_found. */
td_status td_api_check_model(const td_api_model *mdl, const char *model, td_api_error *err);

/* Length of the longest prefix of s[0..n) that ends on a UTF-8 character
 * boundary, counting invalid bytes as (one-byte) characters: what can be
 * sent now without splitting a character that the next bytes may complete. */
size_t td_api_utf8_complete_len(const char *s, size_t n);
/* s[0..n) with every maximal ill-formed UTF-8 subpart replaced by one
 * U+FFFD (what Python's decode(errors="replace") gives): a
 * malloc'd, NUL-terminated copy (*len_p its length); NULL when out of memory. */
char *td_api_utf8_fix(const char *s, size_t n, size_t *len_p);

#endif
