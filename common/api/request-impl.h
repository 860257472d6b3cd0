/* Internals of request.c that the HTTP front end shares (/tokenize takes
 * the same messages as chat; responses need valid UTF-8 for JSON). */
#ifndef TD_API_REQUEST_IMPL_H
#define TD_API_REQUEST_IMPL_H

#include <jansson.h>

#include "request.h"

/* Parses a chat "messages" array (the rules of /v1/chat/completions:
 * non-empty, each {role, content} with content a string, null for the
 * assistant, or a list of {"type": "text", "text": ...} parts; "developer"
 * is "system"). *msgs_p (role/content malloc'd) and *n_p on success;
 * free with td_api_messages_free(). Fills err (400, param "messages"). */
td_status td_api_messages_parse(const json_t *arr, td_chat_msg **msgs_p, int32_t *n_p,
                                td_api_error *err);
void td_api_messages_free(td_chat_msg *msgs, int32_t n);

/* Renders messages with the model's chat template (BOS/EOS texts from the
 * tokenizer). *text_p malloc'd on success; 400 (err) if the model has no
 * usable template or the template cannot express the conversation. */
td_status td_api_render_chat(const td_api_model *mdl, const td_chat_msg *msgs, int32_t n,
                             bool add_generation_prompt, char **text_p, td_api_error *err);

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
