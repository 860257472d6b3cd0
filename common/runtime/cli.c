/* The option parsers and files every command and service shares (cli.h). */
#include "cli.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/base.h"
#include "common/base/httpc.h"
#include "common/kv/kv.h"
#include "common/transfer/ucx.h"

#define DEFAULT_MODEL_FILE "SmolLM2-135M-Instruct.Q4_1.gguf"

bool td_process_init(const char *prog) {
    td_ucx_env_init();
    if (!td_httpc_global_init()) {
        fprintf(stderr, "%s: cannot initialise libcurl\n", prog);
        return false;
    }
    return true;
}

const char *td_model_stem(const char *path, char *buf, size_t cap) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--; /* a directory given as dir/ */
    size_t b = n;
    while (b > 0 && path[b - 1] != '/') b--;
    size_t len = n - b;
    if (len > 5 && strncmp(path + n - 5, ".gguf", 5) == 0) len -= 5;
    if (len >= cap) len = cap - 1;
    memcpy(buf, path + b, len);
    buf[len] = 0;
    return buf;
}

bool td_served_names_add(td_served_names *s, const char *name) {
    if (!name || !*name || s->n >= TD_MAX_SERVED_NAMES) return false;
    s->names[s->n++] = name;
    return true;
}

const char *td_served_names_resolve(td_served_names *s, const char *model_path,
                                    const char *general_name) {
    s->n_aliases = 0;
    if (s->n) {
        for (int i = 1; i < s->n; i++) s->aliases[s->n_aliases++] = s->names[i];
        return s->names[0];
    }
    td_model_stem(model_path, s->stem, sizeof s->stem);
    if (!s->stem[0]) snprintf(s->stem, sizeof s->stem, "model");
    if (general_name && *general_name && strcmp(general_name, s->stem) != 0)
        s->aliases[s->n_aliases++] = general_name; /* the id before the stem */
    return s->stem;
}

const char *td_default_model_path(void) {
    static char buf[4096];
    const char *env = getenv("TANDEM_MODEL");
    if (env && env[0]) {
        snprintf(buf, sizeof buf, "%s", env);
        return buf;
    }
    const char *xdg = getenv("XDG_CACHE_HOME");
    if (xdg && xdg[0]) {
        snprintf(buf, sizeof buf, "%s/tandem/models/%s", xdg, DEFAULT_MODEL_FILE);
        return buf;
    }
    const char *home = getenv("HOME");
    snprintf(buf, sizeof buf, "%s/.cache/tandem/models/%s", home && home[0] ? home : ".",
             DEFAULT_MODEL_FILE);
    return buf;
}

const char *td_cli_model_help(void) {
    static char buf[4200];
    snprintf(buf, sizeof buf, "GGUF file or Hugging Face directory (default: %s)",
             td_default_model_path());
    return buf;
}

bool td_cli_parse_long(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

bool td_cli_parse_kv_dtype(const char *s, const char **out) {
    td_dtype t;
    if (!td_kv_dtype_parse(s, &t)) return false;
    *out = s;
    return true;
}

bool td_cli_parse_seconds(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v) || v < 0 || v > 86400) return false;
    *out = v;
    return true;
}

bool td_cli_parse_float(const char *s, float *out) {
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end || !isfinite(v)) return false;
    *out = v;
    return true;
}

bool td_cli_parse_u64(const char *s, uint64_t *out) {
    char *end;
    errno = 0;
    if (*s == '-') return false;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end) return false;
    *out = (uint64_t)v;
    return true;
}

char *td_cli_read_secret(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) {
        TD_LOG_ERROR("cannot read the cluster token file %s: %s", path, strerror(errno));
        return NULL;
    }
    char buf[1024];
    char *line = fgets(buf, sizeof buf, f);
    fclose(f);
    size_t n = line ? strcspn(buf, "\r\n") : 0;
    if (n == 0) {
        TD_LOG_ERROR("the cluster token file %s is empty", path);
        return NULL;
    }
    buf[n] = 0;
    return strdup(buf);
}

char *td_cli_read_keys(const char *path, const char **keys, int *n, int max) {
    FILE *f = fopen(path, "r");
    if (!f) {
        TD_LOG_ERROR("cannot read the API key file %s: %s", path, strerror(errno));
        return NULL;
    }
    enum { LIMIT = 64 * 1024 };
    char *buf = malloc(LIMIT + 1);
    size_t len = buf ? fread(buf, 1, LIMIT + 1, f) : 0;
    bool err = ferror(f);
    fclose(f);
    if (!buf || err || len > LIMIT) {
        TD_LOG_ERROR("the API key file %s: %s", path,
                     !buf  ? "out of memory"
                     : err ? "read error"
                           : "over 64 KiB");
        free(buf);
        return NULL;
    }
    buf[len] = 0;
    int n0 = *n;
    for (char *line = buf, *next; line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        while (*line == ' ' || *line == '\t' || *line == '\r') line++;
        char *e = line + strlen(line);
        while (e > line && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\r')) *--e = 0;
        if (!*line) continue;
        if (*n == max) {
            TD_LOG_ERROR("the API key file %s: more than %d keys", path, max);
            *n = n0;
            free(buf);
            return NULL;
        }
        keys[(*n)++] = line;
    }
    if (*n == n0) {
        TD_LOG_ERROR("the API key file %s holds no key", path);
        free(buf);
        return NULL;
    }
    return buf;
}
