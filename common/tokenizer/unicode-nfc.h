/* Unicode NFC normalisation (canonical decomposition, canonical ordering,
 * canonical composition), for tokenizer.json NFC normalizers. Internal. */
#ifndef TD_UNICODE_NFC_H
#define TD_UNICODE_NFC_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/base.h"

extern const uint32_t td_nfc_ccc[];
extern const size_t td_nfc_ccc_n;
extern const uint32_t td_nfc_decomp[][3];
extern const size_t td_nfc_decomp_n;
extern const uint64_t td_nfc_comp[][2];
extern const size_t td_nfc_comp_n;

/* NFC of s[0..n): *out_p malloc'd, NUL-terminated, *len_p its length.
 * Invalid UTF-8 bytes are copied unchanged and end a composition run. */
td_status td_nfc(const char *s, size_t n, char **out_p, size_t *len_p);

#endif
