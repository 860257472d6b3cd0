/* GGUF v2/v3 reader, memory-mapped.
 *
 * The file is untrusted: td_gguf_open validates every offset, size, count
 * and string length against the mapping (with overflow checks) before
 * use, and every tensor's data range, alignment and type. On failure it
 * logs one line naming the file (and tensor or key) and the problem, and
 * returns TD_ERR_IO / TD_ERR_FORMAT / TD_ERR_UNSUPPORTED; it never reads
 * past the mapping and never aborts. Tensor types outside td_dtype are
 * accepted at parse time (their sizes are known from the GGUF type table)
 * so that a loader can name the unsupported tensor; td_gguf_tensor.type
 * keeps the raw id. Duplicate keys or tensor names, overlapping tensor data,
 * n_dims outside 1..4, ne <= 0 and unknown type ids are TD_ERR_FORMAT; GGUF
 * v1 and big-endian files are TD_ERR_UNSUPPORTED. Arrays of arrays are
 * walked (nesting depth <= 4) but not exposed.
 *
 * Strings returned by the getters are NUL-terminated copies owned by the
 * td_gguf and live until td_gguf_close(). Not thread-safe for writes;
 * concurrent reads are fine. */
#ifndef TD_GGUF_H
#define TD_GGUF_H

#include <stdbool.h>

#include "common/base/base.h"

typedef enum {
    TD_GGUF_UINT8 = 0,
    TD_GGUF_INT8 = 1,
    TD_GGUF_UINT16 = 2,
    TD_GGUF_INT16 = 3,
    TD_GGUF_UINT32 = 4,
    TD_GGUF_INT32 = 5,
    TD_GGUF_FLOAT32 = 6,
    TD_GGUF_BOOL = 7,
    TD_GGUF_STRING = 8,
    TD_GGUF_ARRAY = 9,
    TD_GGUF_UINT64 = 10,
    TD_GGUF_INT64 = 11,
    TD_GGUF_FLOAT64 = 12,
} td_gguf_type;

typedef struct td_gguf td_gguf;

typedef struct {
    const char *name; /* NUL-terminated */
    int type;         /* raw GGUF type id (td_dtype when supported) */
    int n_dims;       /* 1..4 */
    int64_t ne[4];    /* ne[0] is the innermost (contiguous) dimension; unused dims are 1 */
    const void *data; /* inside the mapping, validated */
    size_t nbytes;
} td_gguf_tensor;

/* Maps and parses `path`. Free with td_gguf_close(). */
td_status td_gguf_open(const char *path, td_gguf **g_p);
/* Parses a buffer the caller keeps alive (fuzzing, tests). `name` is used in
 * error messages. Free with td_gguf_close() (which does not free `data`). */
td_status td_gguf_open_buffer(const void *data, size_t size, const char *name, td_gguf **g_p);
void td_gguf_close(td_gguf *g); /* accepts NULL */

const char *td_gguf_path(const td_gguf *g);
uint32_t td_gguf_version(const td_gguf *g);
/* general.alignment (a power of two, default 32): tensor data offsets are
 * multiples of it, relative to the data section, which starts at a multiple
 * of it. */
size_t td_gguf_alignment(const td_gguf *g);

/* Block geometry of a GGUF tensor type id (ggml's block structs): elements
 * per block and bytes per block. False for unknown or removed ids. Pure. */
bool td_gguf_type_info(int type, int *block_elems_p, size_t *block_bytes_p);

/* ---- metadata ---- */
int64_t td_gguf_n_kv(const td_gguf *g);
int64_t td_gguf_find_key(const td_gguf *g, const char *key); /* -1 if absent */
const char *td_gguf_key_name(const td_gguf *g, int64_t i);   /* NULL if i out of range */
td_gguf_type td_gguf_kv_type(const td_gguf *g, int64_t i);   /* (td_gguf_type)-1 if out of range */

/* Typed getters by key. Return TD_OK, TD_ERR_NOT_FOUND if the key is
 * absent, TD_ERR_FORMAT if the value has an incompatible type or does not
 * fit. Integer getters accept any integer type whose value fits; get_f32
 * accepts FLOAT32/FLOAT64. Outputs are written only on success. */
td_status td_gguf_get_u32(const td_gguf *g, const char *key, uint32_t *v_p);
td_status td_gguf_get_i64(const td_gguf *g, const char *key, int64_t *v_p);
td_status td_gguf_get_f32(const td_gguf *g, const char *key, float *v_p);
td_status td_gguf_get_bool(const td_gguf *g, const char *key, bool *v_p);
td_status td_gguf_get_str(const td_gguf *g, const char *key, const char **s_p);
/* As get_str, also giving the length in bytes (the value may contain NULs). */
td_status td_gguf_get_str_len(const td_gguf *g, const char *key, const char **s_p, size_t *len_p);

/* Arrays: element type and count. For numeric arrays *data_p points at the
 * raw little-endian elements inside the mapping (validated, not necessarily
 * aligned for the element type: copy with memcpy); for string arrays *data_p
 * is NULL, use td_gguf_get_arr_str. Arrays of arrays are validated at open
 * time but not exposed: TD_ERR_UNSUPPORTED. Any output pointer may be NULL. */
td_status td_gguf_get_arr(const td_gguf *g, const char *key, td_gguf_type *elem_type_p,
                          uint64_t *n_p, const void **data_p);
/* String element i of a string array; *s_p NUL-terminated, *len_p its
 * length in bytes (strings may contain NUL bytes). TD_ERR_RANGE if i >= n,
 * TD_ERR_FORMAT if the key is not an array of strings. len_p may be NULL. */
td_status td_gguf_get_arr_str(const td_gguf *g, const char *key, uint64_t i, const char **s_p,
                              size_t *len_p);

/* ---- tensors ---- */
int64_t td_gguf_n_tensors(const td_gguf *g);
const td_gguf_tensor *td_gguf_tensor_at(const td_gguf *g, int64_t i); /* NULL if out of range */
const td_gguf_tensor *td_gguf_find_tensor(const td_gguf *g, const char *name); /* NULL if absent */

#endif
