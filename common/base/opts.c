/* Command-line options over getopt_long (opts.h). */
#include "opts.h"

#include <getopt.h>
#include <stdlib.h>
#include <string.h>

#define HELP_COL 29

void td_opts_print(FILE *f, const td_opt *opts, int n) {
    for (int i = 0; i < n; i++) {
        const td_opt *o = &opts[i];
        if (!o->help) continue; /* an alias */
        int w = o->short_name ? fprintf(f, "  -%c, --%s", o->short_name, o->name)
                              : fprintf(f, "  --%s", o->name);
        if (o->arg) w += fprintf(f, " %s", o->arg);
        const char *h = o->help;
        if (w >= HELP_COL) {
            fputc('\n', f);
            w = 0;
        }
        for (bool first = true; first || *h; first = false) {
            const char *nl = strchr(h, '\n');
            size_t len = nl ? (size_t)(nl - h) : strlen(h);
            fprintf(f, "%*s%.*s\n", first ? HELP_COL - w : HELP_COL, "", (int)len, h);
            h += len + (nl ? 1 : 0);
        }
    }
}

/* Global option index -> (set, index in it). */
static bool locate(const td_optset *sets, int n_sets, int g, int *s, int *i) {
    for (*s = 0; *s < n_sets; (*s)++) {
        if (g < sets[*s].n) {
            *i = g;
            return true;
        }
        g -= sets[*s].n;
    }
    return false;
}

int td_opts_parse(const char *prog, int argc, char **argv, const td_optset *sets, int n_sets,
                  void (*usage)(FILE *f, void *ctx), void *usage_ctx) {
    int total = 0;
    for (int s = 0; s < n_sets; s++) total += sets[s].n;
    struct option *lo = calloc((size_t)total + 2, sizeof *lo);
    char *shorts = malloc(3 * (size_t)total + 8);
    if (!lo || !shorts) {
        free(lo);
        free(shorts);
        fprintf(stderr, "%s: out of memory\n", prog);
        return 2;
    }
    /* '+': stop at the first argument that is no option (an error below);
     * ':': a missing value is ':', not '?' */
    size_t ns = 0;
    shorts[ns++] = '+';
    shorts[ns++] = ':';
    shorts[ns++] = 'h';
    int g = 0;
    for (int s = 0; s < n_sets; s++)
        for (int i = 0; i < sets[s].n; i++, g++) {
            const td_opt *o = &sets[s].opts[i];
            lo[g] =
                (struct option){o->name, o->arg ? required_argument : no_argument, NULL, 256 + g};
            if (o->short_name) {
                shorts[ns++] = o->short_name;
                if (o->arg) shorts[ns++] = ':';
            }
        }
    shorts[ns] = 0;
    lo[g] = (struct option){"help", no_argument, NULL, 'h'};

    int rc = 0;
    opterr = 0;
    optind = 0; /* glibc: a full re-initialisation */
    while (rc == 0) {
        int at = optind ? optind : 1, li = -1;
        int c = getopt_long(argc, argv, shorts, lo, &li);
        if (c == -1) break;
        const char *word = at < argc ? argv[at] : "";
        if (li >= 0 && !strncmp(word, "--", 2)) {
            size_t len = strcspn(word + 2, "=");
            if (len != strlen(lo[li].name) || strncmp(word + 2, lo[li].name, len) != 0) {
                fprintf(stderr, "%s: unknown option '%.*s' (see --help)\n", prog, (int)(len + 2),
                        word);
                rc = 2;
                break;
            }
        }
        if (c == 'h') {
            if (usage) usage(stdout, usage_ctx);
            rc = 1;
        } else if (c == '?') {
            if (optopt && optopt < 256)
                fprintf(stderr, "%s: unknown option '-%c' (see --help)\n", prog, optopt);
            else if (optopt >= 256) /* a flag given a value */
                fprintf(stderr, "%s: --%s takes no value\n", prog, lo[optopt - 256].name);
            else
                fprintf(stderr, "%s: unknown option '%s' (see --help)\n", prog, word);
            rc = 2;
        } else if (c == ':') {
            fprintf(stderr, "%s: %s needs a value\n", prog, word);
            rc = 2;
        } else {
            int gi = c >= 256 ? c - 256 : -1;
            if (gi < 0) /* a short option: its table entry */
                for (int k = 0; k < total && gi < 0; k++) {
                    int s = 0, i = 0;
                    if (locate(sets, n_sets, k, &s, &i) && sets[s].opts[i].short_name == c) gi = k;
                }
            int s = 0, i = 0;
            if (gi < 0 || !locate(sets, n_sets, gi, &s, &i)) {
                fprintf(stderr, "%s: unknown option '%s' (see --help)\n", prog, word);
                rc = 2;
                break;
            }
            const td_opt *o = &sets[s].opts[i];
            bool printed = false;
            if (!sets[s].set(sets[s].ctx, i, o->arg ? optarg : NULL, &printed)) {
                if (!printed) {
                    if (o->arg)
                        fprintf(stderr, "%s: bad value '%s' for --%s\n", prog, optarg, o->name);
                    else
                        fprintf(stderr, "%s: --%s cannot be given here\n", prog, o->name);
                }
                rc = 2;
            }
        }
    }
    if (rc == 0 && optind < argc) {
        fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", prog, argv[optind]);
        rc = 2;
    }
    free(lo);
    free(shorts);
    return rc;
}
