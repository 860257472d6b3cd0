/* safetensors reader (single file, or a Hugging Face directory with
 * model.safetensors or a sharded model.safetensors.index.json), memory-mapped.
 *
 * Untrusted input: the 8-byte header length, the JSON header (parsed with
 * jansson), every dtype, shape and data_offsets pair are validated against
 * the file (overflow-checked, in bounds, shape x dtype size == byte length,
 * no overlaps outside the data section). Errors are one logged line naming
 * the file, the tensor and the problem. F32, F16 and BF16 are supported;
 * other dtypes (F64, I64, U64, I32, U32, I16, U16, I8, U8, BOOL, F8_E5M2,
 * F8_E4M3, F8_E8M0, C64) parse, keep type -1 and are named by the loader that
 * needs them. Return codes: TD_ERR_NOT_FOUND (no such file, or a directory
 * without model.safetensors[.index.json]), TD_ERR_IO, TD_ERR_FORMAT (lying or
 * malformed file, a tensor listed in the index but missing from its shard),
 * TD_ERR_UNSUPPORTED (unknown dtype string, rank > 4). Tensor data points
 * into the mapping and is not necessarily aligned to the element size.
 * Concurrent reads of an open td_st are fine. */
#ifndef TD_SAFETENSORS_H
#define TD_SAFETENSORS_H

#include "common/base/base.h"

typedef struct td_st td_st;

typedef struct {
    const char *name;  /* NUL-terminated */
    int type;          /* td_dtype (F32/F16/BF16), or -1 for other dtypes */
    const char *dtype; /* the dtype string from the header, e.g. "BF16" */
    int n_dims;        /* 0..4 */
    int64_t shape[4];  /* row-major, shape[n_dims-1] innermost (contiguous) */
    const void *data;
    size_t nbytes;
} td_st_tensor;

/* Opens one .safetensors file, or a directory (model.safetensors, or the
 * shards named by model.safetensors.index.json). Free with td_st_close(). */
td_status td_st_open(const char *path, td_st **st_p);
/* Parses an in-memory safetensors file the caller keeps alive (fuzzing). */
td_status td_st_open_buffer(const void *data, size_t size, const char *name, td_st **st_p);
void td_st_close(td_st *st); /* accepts NULL */

int64_t td_st_n_tensors(const td_st *st);
const td_st_tensor *td_st_tensor_at(const td_st *st, int64_t i);
const td_st_tensor *td_st_find(const td_st *st, const char *name); /* NULL if absent */

#endif
