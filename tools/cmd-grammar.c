/* tandem grammar: the structured-output engine from the command line.
 *
 *   tandem grammar check --model PATH CONSTRAINT DOC...
 *   tandem grammar masks --model PATH CONSTRAINT --prefixes IN.json --out OUT.txt
 *   tandem grammar bench --model PATH --schemas DIR [--json] [--tokens-out F.json]
 *
 * CONSTRAINT: --json-schema FILE | --grammar FILE | --regex R | --choice A,B
 *
 * --model is a GGUF file (a vocab-only one will do: only the tokenizer is
 * read) or a Hugging Face directory. --grammar is a Lark-style grammar
 * (common/grammar/lark.h), --json-schema a JSON Schema (json_schema.h), --regex an ECMAScript
 * pattern matched whole,
 * --choice a comma-separated list of strings, one of which is the output
 * (a backslash escapes a comma or a backslash).
 *
 * check tokenizes each DOC with the model's tokenizer (no special tokens)
 * and walks the tokens through the matcher: "accept" when the DOC is a
 * whole output of the constraint, else "reject at byte B (token T, id I)"
 * or "incomplete". A DOC given as @FILE is the file's bytes. Exit 0 when
 * every DOC is accepted, 1 when one is not,
 * 2 when the constraint is refused (its reason on stderr) or on bad usage.
 *
 * masks reads {"prefixes": [[token ids], ...]} and writes one line per
 * prefix: "ok HEX" with the allowed-token mask after the prefix (mask
 * word i, bit j is token 32i + j; the words little-endian, as hex bytes),
 * or "reject N" when the prefix's token N cannot be taken: for oracles.
 * With --forced, an "ok" line goes on with " ff=HEX" (the bytes every
 * continuation starts with, td_gm_forced_bytes) and " ft=ID,..." (the
 * tokens the scheduler may append unsampled, td_gm_forced_tokens).
 *
 * bench compiles every DIR/NAME.json schema (timed) and walks each
 * document of DIR/NAME.jsonl (one JSON text a line) token by token, timing
 * the mask before every token and the one after the last (where the end of
 * generation must be allowed): per schema and over all, compile time and
 * mask time mean, P99 and largest. A document the matcher does not accept
 * is an error (exit 1). --json writes the figures as one JSON object;
 * --tokens-out F writes {NAME.json: [[token ids of each document]]}, so
 * that another engine can walk the same tokens. */
#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/base/base.h"
#include "common/format/gguf.h"
#include "common/grammar/constraint.h"
#include "common/grammar/grammar.h"
#include "common/grammar/json_schema.h"
#include "common/grammar/lark.h"
#include "common/grammar/vocab.h"
#include "common/tokenizer/tokenizer.h"
#include "tools.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: tandem grammar check --model PATH CONSTRAINT DOC...\n"
            "       tandem grammar masks --model PATH CONSTRAINT --prefixes IN.json --out OUT.txt\n"
            "       tandem grammar bench --model PATH --schemas DIR [--json] [--tokens-out F]\n"
            "CONSTRAINT: --json-schema FILE | --grammar FILE | --regex R | --choice A,B\n\n"
            "Runs the structured-output engine on its own: check says whether each DOC\n"
            "(tokenized with the model's tokenizer) is a whole output of the constraint;\n"
            "masks writes the allowed-token mask after each token prefix.\n\n"
            "  --model PATH        GGUF file (vocab-only will do) or Hugging Face directory\n"
            "  --json-schema FILE  a JSON Schema (compact JSON: no whitespace)\n"
            "  --grammar FILE      a Lark-style grammar\n"
            "  --regex R           an ECMAScript regular expression, matched whole\n"
            "  --choice A,B        one of these strings (\\, is a comma, \\\\ a backslash)\n"
            "  DOC                 the text, or @FILE for a file's bytes\n"
            "  --schemas DIR       bench: NAME.json schemas, each walked along NAME.jsonl\n"
            "  --json              bench: the figures as one JSON object on stdout\n"
            "  --tokens-out F.json bench: each document's token ids, by schema\n"
            "  --prefixes IN.json  masks: {\"prefixes\": [[token ids], ...]}\n"
            "  --out OUT.txt       masks: one line per prefix, \"ok HEX\" or \"reject N\"\n"
            "  --forced            masks: \" ff=HEX\" after each mask: the forced bytes\n"
            "                      then, and \" ft=ID,ID\" the forced tokens\n");
}

static char *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    size_t cap = 0, len = 0;
    for (;;) {
        if (len + 65536 > cap) {
            cap = cap ? cap * 2 : 65536 * 2;
            char *nb = realloc(buf, cap);
            if (!nb) break;
            buf = nb;
        }
        size_t r = fread(buf + len, 1, cap - len, f);
        len += r;
        if (r == 0) break;
    }
    fclose(f);
    if (buf) *n = len;
    return buf;
}

static td_tokenizer *load_tokenizer(const char *path) {
    struct stat st;
    td_tokenizer *tok = NULL;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        if (td_tokenizer_from_hf_dir(path, &tok)) return NULL;
        return tok;
    }
    td_gguf *g = NULL;
    if (td_gguf_open(path, &g)) return NULL;
    td_status s = td_tokenizer_from_gguf(g, &tok);
    td_gguf_close(g);
    return s ? NULL : tok;
}

/* --choice A,B: the strings split at unescaped commas. */
static td_gram *choice_grammar(const char *spec, char *err, size_t errlen) {
    const size_t n = strlen(spec);
    char *buf = malloc(n + 1);
    const char **items = calloc(n + 1, sizeof *items);
    size_t *lens = calloc(n + 1, sizeof *lens);
    td_gram *g = NULL;
    if (buf && items && lens) {
        size_t k = 0, ni = 0;
        items[0] = buf;
        for (size_t i = 0; i < n; i++) {
            if (spec[i] == '\\' && i + 1 < n && (spec[i + 1] == ',' || spec[i + 1] == '\\')) {
                buf[k++] = spec[++i];
            } else if (spec[i] == ',') {
                lens[ni] = (size_t)(buf + k - items[ni]);
                items[++ni] = buf + k;
            } else {
                buf[k++] = spec[i];
            }
        }
        lens[ni] = (size_t)(buf + k - items[ni]);
        g = td_gram_from_choices(items, lens, ni + 1, NULL, err, errlen);
    } else {
        snprintf(err, errlen, "out of memory");
    }
    free(buf);
    free(items);
    free(lens);
    return g;
}

typedef struct {
    double *v;
    size_t n, cap;
} samples;

static bool add_sample(samples *s, double x) {
    if (s->n == s->cap) {
        size_t nc = s->cap ? s->cap * 2 : 1024;
        double *nv = realloc(s->v, nc * sizeof *nv);
        if (!nv) return false;
        s->v = nv;
        s->cap = nc;
    }
    s->v[s->n++] = x;
    return true;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Sorts s; the mean, P99 (nearest rank) and largest. */
static void stats(samples *s, double *mean, double *p99, double *max) {
    *mean = *p99 = *max = 0;
    if (!s->n) return;
    qsort(s->v, s->n, sizeof *s->v, cmp_double);
    double sum = 0;
    for (size_t i = 0; i < s->n; i++) sum += s->v[i];
    *mean = sum / (double)s->n;
    size_t k = (size_t)((double)s->n * 0.99 + 0.999999);
    *p99 = s->v[(k ? k : 1) - 1];
    *max = s->v[s->n - 1];
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* One document walked token by token; its mask times added to all and
 * one. -1 when the matcher does not accept it. */
static int bench_doc(td_gram *g, td_tokenizer *tok, td_vocab *voc, uint32_t *mask, const char *doc,
                     size_t n, samples *all, samples *one, json_t *ids_out, char *why,
                     size_t whylen) {
    int32_t *ids = NULL;
    size_t nt = 0;
    if (td_tokenizer_encode(tok, doc, n, false, false, &ids, &nt)) {
        snprintf(why, whylen, "cannot tokenize");
        return -1;
    }
    if (ids_out) {
        json_t *a = json_array();
        for (size_t i = 0; i < nt; i++) json_array_append_new(a, json_integer(ids[i]));
        json_array_append_new(ids_out, a);
    }
    td_gm *m = td_gm_new(g);
    int rc = m ? 0 : -1;
    for (size_t i = 0; m && i <= nt && rc == 0; i++) {
        const double t0 = td_time_s();
        const int64_t k = td_gm_mask(m, voc, mask);
        const double dt = td_time_s() - t0;
        if (k < 0 || !add_sample(all, dt) || !add_sample(one, dt)) {
            snprintf(why, whylen, "%s", k < 0 ? td_gm_error(m) : "out of memory");
            rc = -1;
        } else if (i < nt) {
            const bool allowed = (mask[ids[i] / 32] >> (ids[i] % 32)) & 1;
            if (!allowed || td_gm_consume_token(m, voc, ids[i], NULL) != TD_GM_OK) {
                snprintf(why, whylen, "token %zu (id %d) is not allowed", i, ids[i]);
                rc = -1;
            }
        } else if (!td_gm_accepting(m)) {
            snprintf(why, whylen, "incomplete");
            rc = -1;
        }
    }
    td_gm_free(m);
    free(ids);
    return rc;
}

static int bench(const char *model, const char *dir, bool json_out, const char *tokens_out) {
    DIR *d = opendir(dir);
    if (!d) {
        fprintf(stderr, "tandem grammar bench: cannot open %s\n", dir);
        return 2;
    }
    char **names = NULL;
    size_t nn = 0, cap = 0;
    for (struct dirent *e; (e = readdir(d));) {
        size_t l = strlen(e->d_name);
        if (l < 6 || strcmp(e->d_name + l - 5, ".json")) continue;
        if (nn == cap) {
            cap = cap ? cap * 2 : 64;
            char **nv = realloc(names, cap * sizeof *nv);
            if (!nv) break;
            names = nv;
        }
        if (!(names[nn] = strdup(e->d_name))) break;
        nn++;
    }
    closedir(d);
    if (nn) qsort(names, nn, sizeof *names, cmp_str);
    int rc = 1;
    td_tokenizer *tok = load_tokenizer(model);
    td_vocab *voc = tok ? td_vocab_new(tok) : NULL;
    uint32_t *mask = voc ? malloc(td_vocab_mask_words(voc) * sizeof *mask) : NULL;
    samples all = {0}, one = {0}, comp = {0};
    json_t *out = json_object(), *rows = json_array();
    json_object_set_new(out, "schemas", rows);
    json_t *all_ids = json_object();
    if (!mask) {
        fprintf(stderr, "tandem grammar bench: cannot read a tokenizer from %s\n", model);
        goto done;
    }
    if (!json_out)
        printf("%-24s %10s %7s %10s %10s %10s\n", "schema", "compile ms", "masks", "mean us",
               "p99 us", "max us");
    for (size_t i = 0; i < nn; i++) {
        char path[4096], err[512];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        size_t n = 0;
        char *src = read_file(path, &n);
        if (!src) {
            fprintf(stderr, "tandem grammar bench: cannot read %s\n", path);
            goto done;
        }
        const double t0 = td_time_s();
        td_gram *g = td_gram_from_json_schema(src, n, NULL, NULL, err, sizeof err);
        const double ct = td_time_s() - t0;
        free(src);
        if (!g) {
            fprintf(stderr, "tandem grammar bench: %s: refused: %s\n", names[i], err);
            goto done;
        }
        add_sample(&comp, ct);
        one.n = 0;
        snprintf(path + strlen(path) - 5, sizeof path - strlen(path) + 5, ".jsonl");
        char *docs = read_file(path, &n);
        size_t ndocs = 0;
        json_t *ids_out = json_array();
        json_object_set_new(all_ids, names[i], ids_out);
        for (char *p = docs, *end = docs ? docs + n : NULL; p && p < end;) {
            char *nl = memchr(p, '\n', (size_t)(end - p));
            size_t len = nl ? (size_t)(nl - p) : (size_t)(end - p);
            char why[512];
            if (len && bench_doc(g, tok, voc, mask, p, len, &all, &one, ids_out, why, sizeof why)) {
                fprintf(stderr, "tandem grammar bench: %s line %zu: %s\n", path, ndocs + 1, why);
                free(docs);
                td_gram_free(g);
                goto done;
            }
            ndocs += len > 0;
            p += len + 1;
        }
        free(docs);
        td_gram_free(g);
        double mean, p99, max;
        stats(&one, &mean, &p99, &max);
        if (json_out) {
            json_array_append_new(rows,
                                  json_pack("{s:s, s:f, s:i, s:i, s:f, s:f, s:f}", "name", names[i],
                                            "compile_ms", ct * 1e3, "documents", (json_int_t)ndocs,
                                            "masks", (json_int_t)one.n, "mask_mean_us", mean * 1e6,
                                            "mask_p99_us", p99 * 1e6, "mask_max_us", max * 1e6));
        } else {
            printf("%-24s %10.2f %7zu %10.1f %10.1f %10.1f\n", names[i], ct * 1e3, one.n,
                   mean * 1e6, p99 * 1e6, max * 1e6);
        }
    }
    double mean, p99, max, cmean, cp99, cmax;
    stats(&all, &mean, &p99, &max);
    stats(&comp, &cmean, &cp99, &cmax);
    const double cmed = comp.n ? comp.v[(comp.n - 1) / 2] : 0;
    if (json_out) {
        json_object_set_new(out, "vocab_size", json_integer(td_vocab_size(voc)));
        json_object_set_new(out, "masks", json_integer((json_int_t)all.n));
        json_object_set_new(out, "mask_mean_us", json_real(mean * 1e6));
        json_object_set_new(out, "mask_p99_us", json_real(p99 * 1e6));
        json_object_set_new(out, "mask_max_us", json_real(max * 1e6));
        json_object_set_new(out, "compile_median_ms", json_real(cmed * 1e3));
        json_object_set_new(out, "compile_p99_ms", json_real(cp99 * 1e3));
        char *txt = json_dumps(out, JSON_INDENT(1));
        if (txt) puts(txt);
        free(txt);
    } else {
        printf("all: %zu schemas, %zu masks over %d tokens: mask mean %.1f us, p99 %.1f us, "
               "max %.1f us; compile median %.2f ms, p99 %.2f ms\n",
               comp.n, all.n, td_vocab_size(voc), mean * 1e6, p99 * 1e6, max * 1e6, cmed * 1e3,
               cp99 * 1e3);
    }
    rc = 0;
    if (tokens_out && json_dump_file(all_ids, tokens_out, 0)) {
        fprintf(stderr, "tandem grammar bench: cannot write %s\n", tokens_out);
        rc = 1;
    }
done:
    json_decref(all_ids);
    json_decref(out);
    free(all.v);
    free(one.v);
    free(comp.v);
    free(mask);
    td_vocab_free(voc);
    td_tokenizer_free(tok);
    for (size_t i = 0; i < nn; i++) free(names[i]);
    free(names);
    return rc;
}

int td_cmd_grammar(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "bench")) {
        const char *model = NULL, *dir = NULL, *tokens_out = NULL;
        bool js = false;
        for (int i = 2; i < argc; i++) {
            if (!strcmp(argv[i], "--model") && i + 1 < argc)
                model = argv[++i];
            else if (!strcmp(argv[i], "--schemas") && i + 1 < argc)
                dir = argv[++i];
            else if (!strcmp(argv[i], "--tokens-out") && i + 1 < argc)
                tokens_out = argv[++i];
            else if (!strcmp(argv[i], "--json"))
                js = true;
            else {
                fprintf(stderr, "tandem grammar bench: unexpected argument '%s' (see --help)\n",
                        argv[i]);
                return 2;
            }
        }
        if (!model || !dir) {
            fprintf(stderr, "tandem grammar bench: --model and --schemas are needed\n");
            return 2;
        }
        return bench(model, dir, js, tokens_out);
    }
    const bool check = !strcmp(cmd, "check"), masks = !strcmp(cmd, "masks");
    if (!check && !masks) {
        fprintf(stderr, "tandem grammar: unknown subcommand '%s' (check, masks, bench)\n", cmd);
        return 2;
    }
    const char *model = NULL, *grammar = NULL, *schema = NULL, *regex = NULL, *choice = NULL,
               *prefixes = NULL, *out = NULL;
    char **docs = calloc((size_t)argc, sizeof *docs);
    int ndocs = 0;
    bool forced = false;
    if (!docs) return 1;
    for (int i = 2; i < argc; i++) {
        const char **slot = !strcmp(argv[i], "--model")         ? &model
                            : !strcmp(argv[i], "--grammar")     ? &grammar
                            : !strcmp(argv[i], "--json-schema") ? &schema
                            : !strcmp(argv[i], "--regex")       ? &regex
                            : !strcmp(argv[i], "--choice")      ? &choice
                            : !strcmp(argv[i], "--prefixes")    ? &prefixes
                            : !strcmp(argv[i], "--out")         ? &out
                                                                : NULL;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            free(docs);
            return 0;
        }
        if (!strcmp(argv[i], "--forced") && masks) {
            forced = true;
            continue;
        }
        if (slot) {
            if (i + 1 >= argc) {
                fprintf(stderr, "tandem grammar: %s needs a value\n", argv[i]);
                free(docs);
                return 2;
            }
            *slot = argv[++i];
        } else if (!strncmp(argv[i], "--", 2) && check) {
            fprintf(stderr, "tandem grammar: unknown option %s (see --help)\n", argv[i]);
            free(docs);
            return 2;
        } else if (check) {
            docs[ndocs++] = argv[i];
        } else {
            fprintf(stderr, "tandem grammar: unexpected argument '%s' (see --help)\n", argv[i]);
            free(docs);
            return 2;
        }
    }
    if (!model || (!!grammar + !!schema + !!regex + !!choice) != 1 ||
        (masks && (!prefixes || !out))) {
        fprintf(stderr,
                "tandem grammar %s: --model, one of --json-schema, --grammar, --regex and "
                "--choice%s are needed "
                "(see --help)\n",
                cmd, masks ? ", --prefixes and --out" : "");
        free(docs);
        return 2;
    }

    int rc = 2;
    td_tokenizer *tok = NULL;
    td_vocab *voc = NULL;
    td_gram *g = NULL;
    td_gm *m = NULL;
    uint32_t *mask = NULL;
    json_t *pj = NULL;
    FILE *fo = NULL;
    char err[512] = "";
    /* the tokenizer first: a grammar's token terminals are looked up in it */
    if (!(tok = load_tokenizer(model))) {
        fprintf(stderr, "tandem grammar: cannot read a tokenizer from %s\n", model);
        rc = 1;
        goto done;
    }
    if (grammar || schema) {
        size_t n = 0;
        const char *path = grammar ? grammar : schema;
        char *src = read_file(path, &n);
        if (!src) {
            fprintf(stderr, "tandem grammar: cannot read %s\n", path);
            goto done;
        }
        g = grammar ? td_lark_compile_tokens(src, n, NULL, td_constraint_resolve_token, tok, err,
                                             sizeof err)
                    : td_gram_from_json_schema(src, n, NULL, NULL, err, sizeof err);
        free(src);
    } else if (regex) {
        g = td_gram_from_regex(regex, strlen(regex), NULL, err, sizeof err);
    } else {
        g = choice_grammar(choice, err, sizeof err);
    }
    if (!g) {
        fprintf(stderr, "tandem grammar: %s\n", err);
        goto done;
    }
    rc = 1;
    if (!(voc = td_vocab_new(tok)) || !(mask = malloc(td_vocab_mask_words(voc) * sizeof *mask))) {
        fprintf(stderr, "tandem grammar: out of memory\n");
        goto done;
    }
    if (check) {
        rc = 0;
        for (int d = 0; d < ndocs; d++) {
            int32_t *ids = NULL;
            size_t n = 0, dn = strlen(docs[d]);
            char *text = docs[d], *file = NULL;
            if (text[0] == '@') {
                if (!(file = read_file(text + 1, &dn))) {
                    fprintf(stderr, "tandem grammar: cannot read %s\n", text + 1);
                    rc = 1;
                    continue;
                }
                text = file;
            }
            const td_status ts = td_tokenizer_encode(tok, text, dn, false, false, &ids, &n);
            free(file);
            if (ts) {
                fprintf(stderr, "tandem grammar: cannot tokenize DOC %d\n", d + 1);
                rc = 1;
                continue;
            }
            td_gm_free(m);
            if (!(m = td_gm_new(g))) {
                free(ids);
                fprintf(stderr, "tandem grammar: out of memory\n");
                rc = 1;
                goto done;
            }
            size_t byte = 0, i = 0;
            td_gm_result r = TD_GM_OK;
            for (; i < n; i++) {
                size_t taken = 0;
                r = td_gm_consume_token(m, voc, ids[i], &taken);
                if (r != TD_GM_OK) {
                    byte += taken;
                    break;
                }
                byte = td_gm_depth(m);
            }
            if (r == TD_GM_LIMIT)
                printf("limit: %s\n", td_gm_error(m));
            else if (r != TD_GM_OK)
                printf("reject at byte %zu (token %zu, id %d)\n", byte, i, ids[i]);
            else if (!td_gm_accepting(m))
                printf("incomplete\n");
            else
                printf("accept\n");
            if (r != TD_GM_OK || !td_gm_accepting(m)) rc = 1;
            free(ids);
        }
        goto done;
    }
    json_error_t je;
    pj = json_load_file(prefixes, 0, &je);
    json_t *arr = pj ? json_object_get(pj, "prefixes") : NULL;
    if (!json_is_array(arr)) {
        fprintf(stderr, "tandem grammar: %s: expected {\"prefixes\": [[ids], ...]}\n", prefixes);
        goto done;
    }
    if (!(fo = fopen(out, "w"))) {
        fprintf(stderr, "tandem grammar: cannot write %s\n", out);
        goto done;
    }
    double mask_sum = 0, mask_max = 0;
    size_t nmask = 0;
    for (size_t p = 0; p < json_array_size(arr); p++) {
        json_t *ids = json_array_get(arr, p);
        td_gm_free(m);
        if (!(m = td_gm_new(g))) goto done;
        size_t i = 0;
        td_gm_result r = TD_GM_OK;
        for (; i < json_array_size(ids); i++) {
            json_t *x = json_array_get(ids, i);
            if (!json_is_integer(x)) {
                fprintf(stderr, "tandem grammar: prefix %zu: not a token id\n", p);
                goto done;
            }
            if ((r = td_gm_consume_token(m, voc, (int32_t)json_integer_value(x), NULL)) != TD_GM_OK)
                break;
        }
        const double t0 = td_time_s();
        if (r == TD_GM_LIMIT || (r == TD_GM_OK && td_gm_mask(m, voc, mask) < 0)) {
            fprintf(stderr, "tandem grammar: prefix %zu: %s\n", p, td_gm_error(m));
            goto done;
        }
        if (r != TD_GM_OK) {
            fprintf(fo, "reject %zu\n", i);
            continue;
        }
        const double dt = td_time_s() - t0;
        mask_sum += dt;
        mask_max = dt > mask_max ? dt : mask_max;
        nmask++;
        fputs("ok ", fo);
        for (size_t w = 0; w < td_vocab_mask_words(voc); w++)
            fprintf(fo, "%02x%02x%02x%02x", mask[w] & 255, (mask[w] >> 8) & 255,
                    (mask[w] >> 16) & 255, mask[w] >> 24);
        if (forced) {
            uint8_t fb[256];
            int32_t ft[256];
            const int64_t nb = td_gm_forced_bytes(m, fb, sizeof fb);
            const int64_t nt = nb < 0 ? -1 : td_gm_forced_tokens(m, voc, tok, ft, 256);
            if (nb < 0 || nt < 0) {
                fprintf(stderr, "tandem grammar: prefix %zu: %s\n", p, td_gm_error(m));
                goto done;
            }
            fputs(" ff=", fo);
            for (int64_t q = 0; q < nb; q++) fprintf(fo, "%02x", fb[q]);
            fputs(" ft=", fo);
            for (int64_t q = 0; q < nt; q++) fprintf(fo, "%s%d", q ? "," : "", ft[q]);
        }
        fputc('\n', fo);
    }
    if (nmask)
        fprintf(stderr, "tandem grammar masks: %zu masks, mean %.1f us, max %.1f us\n", nmask,
                mask_sum / (double)nmask * 1e6, mask_max * 1e6);
    rc = 0;
done:
    if (fo && fclose(fo) && rc == 0) rc = 1;
    json_decref(pj);
    free(mask);
    td_gm_free(m);
    td_gram_free(g);
    td_vocab_free(voc);
    td_tokenizer_free(tok);
    free(docs);
    return rc;
}
