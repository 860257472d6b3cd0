/* tandem grammar: the structured-output engine from the command line.
 *
 *   tandem grammar check --model PATH CONSTRAINT DOC...
 *   tandem grammar masks --model PATH CONSTRAINT --prefixes IN.json --out OUT.txt
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
 * or "reject N" when the prefix's token N cannot be taken: for oracles. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/base/base.h"
#include "common/format/gguf.h"
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
            "  --prefixes IN.json  masks: {\"prefixes\": [[token ids], ...]}\n"
            "  --out OUT.txt       masks: one line per prefix, \"ok HEX\" or \"reject N\"\n");
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

int td_cmd_grammar(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *cmd = argv[1];
    const bool check = !strcmp(cmd, "check"), masks = !strcmp(cmd, "masks");
    if (!check && !masks) {
        fprintf(stderr, "tandem grammar: unknown subcommand '%s' (check, masks)\n", cmd);
        return 2;
    }
    const char *model = NULL, *grammar = NULL, *schema = NULL, *regex = NULL, *choice = NULL,
               *prefixes = NULL, *out = NULL;
    char **docs = calloc((size_t)argc, sizeof *docs);
    int ndocs = 0;
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
    if (grammar || schema) {
        size_t n = 0;
        const char *path = grammar ? grammar : schema;
        char *src = read_file(path, &n);
        if (!src) {
            fprintf(stderr, "tandem grammar: cannot read %s\n", path);
            goto done;
        }
        g = grammar ? td_lark_compile(src, n, NULL, err, sizeof err)
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
    if (!(tok = load_tokenizer(model))) {
        fprintf(stderr, "tandem grammar: cannot read a tokenizer from %s\n", model);
        goto done;
    }
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
