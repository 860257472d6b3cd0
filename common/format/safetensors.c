/* safetensors reader. A file is: u64 little-endian header length N | N bytes
 * of JSON (an object: tensor name -> {dtype, shape, data_offsets}, plus an
 * optional "__metadata__" object) | the data section, to which every
 * data_offsets pair is relative. */
#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/dtype.h"

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
               "safetensors reader assumes a little-endian host");

/* The reference implementation's limit on the JSON header. */
#define ST_MAX_HEADER  100000000ull
#define ST_MAX_INDEX   (64ull << 20)
#define ST_INDEX_NAME  "model.safetensors.index.json"
#define ST_SINGLE_NAME "model.safetensors"

typedef struct {
    char *path;
    void *map; /* NULL for a caller's buffer */
    size_t map_size;
} st_file;

typedef struct {
    td_st_tensor t;
    int file; /* index into files */
} st_entry;

struct td_st {
    char *name;
    st_file *files;
    int n_files;
    st_entry *entries;
    int64_t n_tensors;
    int64_t cap_tensors;
    uint32_t *index; /* open addressing, entry index + 1, 0 = empty */
    size_t index_cap;
};

typedef struct {
    const char *s;
    int type;
    size_t elsize;
} st_dtype;

static const st_dtype g_dtypes[] = {
    {"F32", TD_TYPE_F32, 4}, {"F16", TD_TYPE_F16, 2}, {"BF16", TD_TYPE_BF16, 2},
    {"F64", -1, 8},          {"I64", -1, 8},          {"U64", -1, 8},
    {"I32", -1, 4},          {"U32", -1, 4},          {"I16", -1, 2},
    {"U16", -1, 2},          {"I8", -1, 1},           {"U8", -1, 1},
    {"BOOL", -1, 1},         {"F8_E5M2", -1, 1},      {"F8_E4M3", -1, 1},
    {"F8_E8M0", -1, 1},      {"C64", -1, 8},
};

#define PERR(fn, ...) td_log(TD_LOG_ERROR, (fn), __VA_ARGS__)

/* Printable, bounded rendering of an untrusted name for a log line. */
static const char *printable(const char *s, char *buf, size_t cap) {
    static const char hex[] = "0123456789abcdef";
    size_t o = 0, i;
    for (i = 0; s[i] && o + 8 <= cap; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') {
            buf[o++] = (char)c;
        } else {
            buf[o++] = '\\';
            buf[o++] = 'x';
            buf[o++] = hex[c >> 4];
            buf[o++] = hex[c & 15];
        }
    }
    if (s[i]) {
        memcpy(buf + o, "...", 3);
        o += 3;
    }
    buf[o] = '\0';
    return buf;
}

static uint64_t hash_name(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ull;
    }
    return h;
}

static int64_t index_find(const td_st *st, const char *name) {
    if (!st->index) return -1;
    size_t m = st->index_cap - 1;
    for (size_t i = (size_t)hash_name(name) & m;; i = (i + 1) & m) {
        if (st->index[i] == 0) return -1;
        int64_t e = (int64_t)st->index[i] - 1;
        if (strcmp(st->entries[e].t.name, name) == 0) return e;
    }
}

static td_status index_grow(td_st *st, size_t need) {
    if (need * 2 <= st->index_cap) return TD_OK;
    size_t cap = st->index_cap ? st->index_cap : 16;
    while (cap < need * 2) cap <<= 1;
    uint32_t *tab = calloc(cap, sizeof *tab);
    if (!tab) return TD_ERR_NOMEM;
    for (size_t j = 0; j < st->index_cap; j++) {
        if (!st->index[j]) continue;
        const char *name = st->entries[st->index[j] - 1].t.name;
        size_t i = (size_t)hash_name(name) & (cap - 1);
        while (tab[i]) i = (i + 1) & (cap - 1);
        tab[i] = st->index[j];
    }
    free(st->index);
    st->index = tab;
    st->index_cap = cap;
    return TD_OK;
}

static void index_add(td_st *st, int64_t e) {
    size_t m = st->index_cap - 1;
    size_t i = (size_t)hash_name(st->entries[e].t.name) & m;
    while (st->index[i]) i = (i + 1) & m;
    st->index[i] = (uint32_t)(e + 1);
}

/* Non-negative JSON integer. */
static bool json_u64(const json_t *v, uint64_t *u_p) {
    if (!json_is_integer(v)) return false;
    json_int_t i = json_integer_value(v);
    if (i < 0) return false;
    *u_p = (uint64_t)i;
    return true;
}

static int cmp_by_data(const void *a, const void *b) {
    const td_st_tensor *x = *(const td_st_tensor *const *)a;
    const td_st_tensor *y = *(const td_st_tensor *const *)b;
    uintptr_t px = (uintptr_t)x->data, py = (uintptr_t)y->data;
    if (px != py) return px < py ? -1 : 1;
    return x->nbytes < y->nbytes ? -1 : x->nbytes > y->nbytes;
}

/* Rejects tensors whose byte ranges overlap (empty tensors overlap nothing). */
static td_status check_overlaps(td_st *st, int64_t first, const char *fn, const char *file) {
    int64_t n = st->n_tensors - first;
    if (n < 2) return TD_OK;
    const td_st_tensor **v = malloc((size_t)n * sizeof *v);
    if (!v) return TD_ERR_NOMEM;
    int64_t k = 0;
    for (int64_t i = first; i < st->n_tensors; i++)
        if (st->entries[i].t.nbytes) v[k++] = &st->entries[i].t;
    qsort(v, (size_t)k, sizeof *v, cmp_by_data);
    td_status s = TD_OK;
    for (int64_t i = 1; i < k; i++) {
        if ((const uint8_t *)v[i - 1]->data + v[i - 1]->nbytes > (const uint8_t *)v[i]->data) {
            char p1[96], p2[96];
            PERR(fn, "%s: tensor '%s': data overlaps tensor '%s'", file,
                 printable(v[i]->name, p1, sizeof p1), printable(v[i - 1]->name, p2, sizeof p2));
            s = TD_ERR_FORMAT;
            break;
        }
    }
    free(v);
    return s;
}

static td_status parse_tensor(td_st *st, const char *fn, const char *file, const char *key,
                              json_t *obj, const uint8_t *data, size_t data_size, int file_idx) {
    char pbuf[96];
    const char *pn = printable(key, pbuf, sizeof pbuf);
    if (!json_is_object(obj)) {
        PERR(fn, "%s: tensor '%s': header entry is not an object", file, pn);
        return TD_ERR_FORMAT;
    }
    json_t *jd = json_object_get(obj, "dtype");
    json_t *js = json_object_get(obj, "shape");
    json_t *jo = json_object_get(obj, "data_offsets");
    if (!json_is_string(jd)) {
        PERR(fn, "%s: tensor '%s': missing or non-string \"dtype\"", file, pn);
        return TD_ERR_FORMAT;
    }
    if (!json_is_array(js)) {
        PERR(fn, "%s: tensor '%s': missing or non-array \"shape\"", file, pn);
        return TD_ERR_FORMAT;
    }
    if (!json_is_array(jo) || json_array_size(jo) != 2) {
        PERR(fn, "%s: tensor '%s': \"data_offsets\" is not an array of two integers", file, pn);
        return TD_ERR_FORMAT;
    }
    const st_dtype *dt = NULL;
    for (size_t i = 0; i < TD_ARRAY_SIZE(g_dtypes); i++)
        if (strcmp(json_string_value(jd), g_dtypes[i].s) == 0) dt = &g_dtypes[i];
    if (!dt) {
        char dbuf[48];
        PERR(fn, "%s: tensor '%s': unknown or unsupported dtype '%s'", file, pn,
             printable(json_string_value(jd), dbuf, sizeof dbuf));
        return TD_ERR_UNSUPPORTED;
    }
    size_t rank = json_array_size(js);
    if (rank > 4) {
        PERR(fn, "%s: tensor '%s': rank %zu is not supported (at most 4)", file, pn, rank);
        return TD_ERR_UNSUPPORTED;
    }
    int64_t shape[4] = {1, 1, 1, 1};
    size_t n_el = 1;
    for (size_t d = 0; d < rank; d++) {
        uint64_t v;
        if (!json_u64(json_array_get(js, d), &v)) {
            PERR(fn, "%s: tensor '%s': shape[%zu] is not a non-negative integer", file, pn, d);
            return TD_ERR_FORMAT;
        }
        shape[d] = (int64_t)v;
        if (v > SIZE_MAX || td_mul_overflow(n_el, (size_t)v, &n_el)) {
            PERR(fn, "%s: tensor '%s': element count overflows", file, pn);
            return TD_ERR_FORMAT;
        }
    }
    size_t nbytes;
    if (td_mul_overflow(n_el, dt->elsize, &nbytes)) {
        PERR(fn, "%s: tensor '%s': byte size overflows", file, pn);
        return TD_ERR_FORMAT;
    }
    uint64_t begin, end;
    if (!json_u64(json_array_get(jo, 0), &begin) || !json_u64(json_array_get(jo, 1), &end)) {
        PERR(fn, "%s: tensor '%s': \"data_offsets\" is not an array of two non-negative integers",
             file, pn);
        return TD_ERR_FORMAT;
    }
    if (begin > end || end > data_size) {
        PERR(fn, "%s: tensor '%s': data_offsets [%llu, %llu) outside the data section of %zu bytes",
             file, pn, (unsigned long long)begin, (unsigned long long)end, data_size);
        return TD_ERR_FORMAT;
    }
    if (end - begin != nbytes) {
        PERR(fn, "%s: tensor '%s': data_offsets span %llu bytes but shape x %s needs %zu", file, pn,
             (unsigned long long)(end - begin), dt->s, nbytes);
        return TD_ERR_FORMAT;
    }
    if (index_find(st, key) >= 0) {
        PERR(fn, "%s: tensor '%s' appears twice", file, pn);
        return TD_ERR_FORMAT;
    }
    if (st->n_tensors == st->cap_tensors) {
        int64_t cap = st->cap_tensors ? st->cap_tensors * 2 : 64;
        st_entry *e = realloc(st->entries, (size_t)cap * sizeof *e);
        if (!e) return TD_ERR_NOMEM;
        st->entries = e;
        st->cap_tensors = cap;
    }
    if (index_grow(st, (size_t)st->n_tensors + 1) != TD_OK) return TD_ERR_NOMEM;
    char *name = strdup(key);
    if (!name) return TD_ERR_NOMEM;
    st_entry *e = &st->entries[st->n_tensors];
    *e = (st_entry){.file = file_idx};
    e->t.name = name;
    e->t.type = dt->type;
    e->t.dtype = dt->s;
    e->t.n_dims = (int)rank;
    memcpy(e->t.shape, shape, sizeof shape);
    e->t.data = data + begin;
    e->t.nbytes = nbytes;
    index_add(st, st->n_tensors);
    st->n_tensors++;
    return TD_OK;
}

/* Parses one safetensors image and appends its tensors. */
static td_status parse_file(td_st *st, const char *fn, const char *file, const uint8_t *base,
                            size_t size, int file_idx) {
    if (size < 8) {
        PERR(fn, "%s: file too small for a safetensors header (%zu bytes)", file, size);
        return TD_ERR_FORMAT;
    }
    uint64_t hlen;
    memcpy(&hlen, base, 8);
    if (hlen > ST_MAX_HEADER || hlen > size - 8) {
        PERR(fn, "%s: header length %llu exceeds %s (%zu bytes after the length)", file,
             (unsigned long long)hlen, hlen > ST_MAX_HEADER ? "the 100 MB limit" : "the file",
             size - 8);
        return TD_ERR_FORMAT;
    }
    if (hlen < 2) {
        PERR(fn, "%s: header length %llu is too small for a JSON object", file,
             (unsigned long long)hlen);
        return TD_ERR_FORMAT;
    }
    json_error_t jerr;
    json_t *root = json_loadb((const char *)base + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        PERR(fn, "%s: header is not valid JSON: %s (line %d, column %d)", file, jerr.text,
             jerr.line, jerr.column);
        return TD_ERR_FORMAT;
    }
    td_status s = TD_OK;
    if (!json_is_object(root)) {
        PERR(fn, "%s: header is not a JSON object", file);
        s = TD_ERR_FORMAT;
        goto free_root;
    }
    const uint8_t *data = base + 8 + hlen;
    size_t data_size = size - 8 - (size_t)hlen;
    int64_t first = st->n_tensors;
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (strcmp(key, "__metadata__") == 0) {
            if (!json_is_object(val)) {
                PERR(fn, "%s: \"__metadata__\" is not an object", file);
                s = TD_ERR_FORMAT;
                goto free_root;
            }
            continue;
        }
        s = parse_tensor(st, fn, file, key, val, data, data_size, file_idx);
        if (s != TD_OK) goto free_root;
    }
    s = check_overlaps(st, first, fn, file);
free_root:
    json_decref(root);
    return s;
}

void td_st_close(td_st *st) {
    if (!st) return;
    for (int64_t i = 0; i < st->n_tensors; i++) free((char *)st->entries[i].t.name);
    free(st->entries);
    free(st->index);
    for (int i = 0; i < st->n_files; i++) {
        if (st->files[i].map) munmap(st->files[i].map, st->files[i].map_size);
        free(st->files[i].path);
    }
    free(st->files);
    free(st->name);
    free(st);
}

static td_st *st_new(const char *name) {
    td_st *st = calloc(1, sizeof *st);
    if (!st) return NULL;
    st->name = strdup(name);
    if (!st->name) {
        free(st);
        return NULL;
    }
    return st;
}

td_status td_st_open_buffer(const void *data, size_t size, const char *name, td_st **st_p) {
    if (!st_p || (!data && size)) return TD_ERR_INVALID;
    td_st *st = st_new(name ? name : "<buffer>");
    if (!st) return TD_ERR_NOMEM;
    td_status s = parse_file(st, "td_st_open_buffer", st->name, data, size, 0);
    if (s != TD_OK) {
        td_st_close(st);
        return s;
    }
    *st_p = st;
    return TD_OK;
}

/* Maps `path` read-only into a new st->files entry. */
static td_status map_file(td_st *st, const char *path, int *idx_p) {
    td_status s = TD_OK;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        PERR("td_st_open", "%s: cannot open: %s", path, strerror(errno));
        return errno == ENOENT ? TD_ERR_NOT_FOUND : TD_ERR_IO;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        PERR("td_st_open", "%s: not a regular file", path);
        s = TD_ERR_IO;
        goto close_fd;
    }
    if (sb.st_size < 8) {
        PERR("td_st_open", "%s: file too small for a safetensors header (%lld bytes)", path,
             (long long)sb.st_size);
        s = TD_ERR_FORMAT;
        goto close_fd;
    }
    st_file *files = realloc(st->files, (size_t)(st->n_files + 1) * sizeof *files);
    if (!files) {
        s = TD_ERR_NOMEM;
        goto close_fd;
    }
    st->files = files;
    st_file *f = &files[st->n_files];
    *f = (st_file){0};
    f->path = strdup(path);
    if (!f->path) {
        s = TD_ERR_NOMEM;
        goto close_fd;
    }
    void *map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
        PERR("td_st_open", "%s: mmap of %lld bytes: %s", path, (long long)sb.st_size,
             strerror(errno));
        free(f->path);
        s = TD_ERR_IO;
        goto close_fd;
    }
    f->map = map;
    f->map_size = (size_t)sb.st_size;
    *idx_p = st->n_files++;
close_fd:
    close(fd);
    return s;
}

static td_status open_one(td_st *st, const char *path) {
    int idx;
    td_status s = map_file(st, path, &idx);
    if (s != TD_OK) return s;
    return parse_file(st, "td_st_open", path, st->files[idx].map, st->files[idx].map_size, idx);
}

static char *path_join(const char *dir, const char *file) {
    size_t a = strlen(dir), b = strlen(file);
    char *p = malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, file, b + 1);
    return p;
}

/* A shard name from the index must name a file inside the directory. */
static bool shard_name_ok(const char *s) {
    return s[0] && s[0] != '.' && !strchr(s, '/') && strlen(s) < 4096;
}

static td_status open_index(td_st *st, const char *dir, const char *index_path) {
    const char *fn = "td_st_open";
    struct stat sb;
    if (stat(index_path, &sb) != 0 || !S_ISREG(sb.st_mode) || (uint64_t)sb.st_size > ST_MAX_INDEX) {
        PERR(fn, "%s: not a regular file of at most %llu bytes", index_path,
             (unsigned long long)ST_MAX_INDEX);
        return TD_ERR_FORMAT;
    }
    json_error_t jerr;
    json_t *root = json_load_file(index_path, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        PERR(fn, "%s: not valid JSON: %s (line %d, column %d)", index_path, jerr.text, jerr.line,
             jerr.column);
        return TD_ERR_FORMAT;
    }
    td_status s = TD_OK;
    json_t *wm = json_object_get(root, "weight_map");
    if (!json_is_object(wm) || json_object_size(wm) == 0) {
        PERR(fn, "%s: missing or empty \"weight_map\" object", index_path);
        s = TD_ERR_FORMAT;
        goto free_root;
    }
    /* Open each distinct shard once, in order of first mention. */
    const char **shards = calloc(json_object_size(wm), sizeof *shards);
    if (!shards) {
        s = TD_ERR_NOMEM;
        goto free_root;
    }
    size_t n_shards = 0;
    const char *key;
    json_t *val;
    json_object_foreach(wm, key, val) {
        char pbuf[96];
        if (!json_is_string(val) || !shard_name_ok(json_string_value(val))) {
            PERR(fn, "%s: weight_map['%s'] is not a file name inside the directory", index_path,
                 printable(key, pbuf, sizeof pbuf));
            s = TD_ERR_FORMAT;
            goto free_shards;
        }
        const char *f = json_string_value(val);
        bool seen = false;
        for (size_t i = 0; i < n_shards && !seen; i++) seen = strcmp(shards[i], f) == 0;
        if (!seen) shards[n_shards++] = f;
    }
    for (size_t i = 0; i < n_shards; i++) {
        char *p = path_join(dir, shards[i]);
        if (!p) {
            s = TD_ERR_NOMEM;
            goto free_shards;
        }
        s = open_one(st, p);
        free(p);
        if (s != TD_OK) goto free_shards;
    }
    /* Every tensor the index names must be in the shard it names. */
    json_object_foreach(wm, key, val) {
        char pbuf[96];
        int64_t e = index_find(st, key);
        const char *f = json_string_value(val);
        const char *got = e < 0 ? NULL : strrchr(st->files[st->entries[e].file].path, '/') + 1;
        if (!got || strcmp(got, f) != 0) {
            char fbuf[96];
            PERR(fn, "%s: tensor '%s' listed in weight_map is not in shard '%s'", index_path,
                 printable(key, pbuf, sizeof pbuf), printable(f, fbuf, sizeof fbuf));
            s = TD_ERR_FORMAT;
            goto free_shards;
        }
    }
free_shards:
    free(shards);
free_root:
    json_decref(root);
    return s;
}

td_status td_st_open(const char *path, td_st **st_p) {
    if (!path || !st_p) return TD_ERR_INVALID;
    td_st *st = st_new(path);
    if (!st) return TD_ERR_NOMEM;
    td_status s;
    struct stat sb;
    if (stat(path, &sb) != 0) {
        PERR("td_st_open", "%s: %s", path, strerror(errno));
        s = errno == ENOENT ? TD_ERR_NOT_FOUND : TD_ERR_IO;
    } else if (S_ISDIR(sb.st_mode)) {
        char *idx = path_join(path, ST_INDEX_NAME);
        char *single = path_join(path, ST_SINGLE_NAME);
        if (!idx || !single) {
            s = TD_ERR_NOMEM;
        } else if (access(idx, F_OK) == 0) {
            s = open_index(st, path, idx);
        } else if (access(single, F_OK) == 0) {
            s = open_one(st, single);
        } else {
            PERR("td_st_open", "%s: directory has neither %s nor %s", path, ST_SINGLE_NAME,
                 ST_INDEX_NAME);
            s = TD_ERR_NOT_FOUND;
        }
        free(idx);
        free(single);
    } else {
        s = open_one(st, path);
    }
    if (s != TD_OK) {
        td_st_close(st);
        return s;
    }
    *st_p = st;
    return TD_OK;
}

int64_t td_st_n_tensors(const td_st *st) { return st->n_tensors; }

const td_st_tensor *td_st_tensor_at(const td_st *st, int64_t i) {
    return i >= 0 && i < st->n_tensors ? &st->entries[i].t : NULL;
}

const td_st_tensor *td_st_find(const td_st *st, const char *name) {
    if (!name) return NULL;
    int64_t e = index_find(st, name);
    return e < 0 ? NULL : &st->entries[e].t;
}
