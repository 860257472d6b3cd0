/* td-template: renders a chat template over a JSON context with the
 * engine of common/template, for the differential tests against jinja2
 * and the rendering benchmark.
 *
 *   td-template TEMPLATE CONTEXT.json [--now SECONDS] [--repeat N]
 *
 * Prints the rendered text to stdout (exit 0), or one line
 * "compile error: ..." / "render error: ..." to stdout (exit 2 / 3). With
 * --repeat N it renders N times and prints, instead of the text, one JSON
 * line with the compile time and the median render time in microseconds.
 * --now fixes strftime_now()'s clock. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/template/template.h"

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    if (s) s[n] = 0;
    fclose(f);
    return s;
}

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: td-template TEMPLATE CONTEXT.json [--now SECONDS] [--repeat N]\n");
        return 1;
    }
    td_tmpl_limits lim = td_tmpl_default_limits();
    int repeat = 0;
    for (int i = 3; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--now"))
            lim.now = strtoll(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--repeat"))
            repeat = atoi(argv[i + 1]);
    }
    char *src = read_file(argv[1]);
    if (!src) {
        fprintf(stderr, "td-template: cannot read %s\n", argv[1]);
        return 1;
    }
    json_error_t je;
    json_t *ctx = json_load_file(argv[2], 0, &je);
    if (!ctx) {
        fprintf(stderr, "td-template: %s: %s\n", argv[2], je.text);
        free(src);
        return 1;
    }
    char err[512];
    const double t0 = now_us();
    td_tmpl *t = td_tmpl_compile(src, err, sizeof err);
    const double t_compile = now_us() - t0;
    int rc = 0;
    if (!t) {
        printf("compile error: %s\n", err);
        rc = 2;
        goto done;
    }
    char *out = NULL;
    size_t n = 0;
    if (td_tmpl_render(t, ctx, &lim, &out, &n, err, sizeof err) != TD_OK) {
        printf("render error: %s\n", err);
        rc = 3;
        goto done;
    }
    if (repeat <= 0) {
        fwrite(out, 1, n, stdout);
        free(out);
        goto done;
    }
    free(out);
    double *us = malloc(sizeof(double) * (size_t)repeat);
    for (int r = 0; r < repeat; r++) {
        const double a = now_us();
        if (td_tmpl_render(t, ctx, &lim, &out, &n, err, sizeof err) != TD_OK) abort();
        us[r] = now_us() - a;
        free(out);
    }
    qsort(us, (size_t)repeat, sizeof *us, cmp_d);
    printf("{\"compile_us\": %.1f, \"render_us_median\": %.2f, \"bytes\": %zu, \"repeat\": %d}\n",
           t_compile, us[repeat / 2], n, repeat);
    free(us);
done:
    td_tmpl_free(t);
    json_decref(ctx);
    free(src);
    return rc;
}
