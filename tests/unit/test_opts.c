/* Command-line options from tables (common/base/opts.h): what getopt_long
 * accepts (both value forms, short names, flags, options of several
 * tables), what it refuses with status 2 (an abbreviation, an unknown
 * option, a missing value, a bad value, a stray argument), --help (status
 * 1, the usage on stdout), and the --help lines the table prints. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/base/opts.h"

enum { A_PORT, A_NAME, A_QUIET, A_INTERNAL, A_N };
static const td_opt k_a[A_N] = {
    [A_PORT] = {"port", 'p', "N", "the port (0..65535)"},
    [A_NAME] = {"name", 0, "TEXT", "a name\nover two lines"},
    [A_QUIET] = {"quiet", 'q', NULL, "no output"},
    [A_INTERNAL] = {"internal", 0, "X", NULL},
};
enum { B_TP, B_DRY, B_N };
static const td_opt k_b[B_N] = {
    [B_TP] = {"tp", 0, "N", "ranks"},
    [B_DRY] = {"a-rather-long-option-name", 0, "VALUE", "its help on the next line"},
};

typedef struct {
    long port, tp;
    const char *name, *internal, *dry;
    bool quiet;
    int calls;
    bool own_message; /* the handler says it printed its own message */
} vals;

static bool set_a(void *ctx, int i, const char *val, bool *printed) {
    vals *v = ctx;
    v->calls++;
    char *end;
    switch (i) {
    case A_PORT:
        v->port = strtol(val, &end, 10);
        return *val && !*end && v->port >= 0 && v->port <= 65535;
    case A_NAME: v->name = val; return true;
    case A_QUIET: v->quiet = val == NULL; return true;
    case A_INTERNAL: v->internal = val; return true;
    }
    *printed = v->own_message;
    return false;
}

static bool set_b(void *ctx, int i, const char *val, bool *printed) {
    vals *v = ctx;
    v->calls++;
    if (i == B_TP) {
        if (!strcmp(val, "mine")) {
            fprintf(stderr, "prog: my own message\n");
            *printed = true;
            return false;
        }
        v->tp = atol(val);
        return v->tp > 0;
    }
    v->dry = val;
    return true;
}

static int g_usage_calls;
static void usage(FILE *f, void *ctx) {
    g_usage_calls++;
    fprintf(f, "usage: prog [options]\n");
    assert_ptr_equal(ctx, &g_usage_calls);
}

/* Runs td_opts_parse over a NULL-terminated word list (argv[0] "prog")
 * with stderr caught; returns the status, the message in err. */
static int parse(vals *v, char *err, size_t err_cap, ...) {
    char *argv[32] = {"prog"};
    int argc = 1;
    va_list ap;
    va_start(ap, err_cap);
    for (char *w; (w = va_arg(ap, char *)) != NULL;) argv[argc++] = w;
    va_end(ap);
    memset(v, 0, sizeof *v);
    td_optset sets[2] = {{k_a, A_N, set_a, v}, {k_b, B_N, set_b, v}};
    fflush(stderr);
    int saved = dup(2);
    FILE *tmp = tmpfile();
    assert_non_null(tmp);
    dup2(fileno(tmp), 2);
    int rc = td_opts_parse("prog", argc, argv, sets, 2, usage, &g_usage_calls);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    rewind(tmp);
    size_t n = fread(err, 1, err_cap - 1, tmp);
    err[n] = 0;
    fclose(tmp);
    return rc;
}

static void test_accepts(void **state) {
    (void)state;
    vals v;
    char err[512];
    assert_int_equal(parse(&v, err, sizeof err, "--port", "80", "--name=x=y", "-q", "--tp", "4",
                           "--internal", "i", NULL),
                     0);
    assert_string_equal(err, "");
    assert_int_equal(v.port, 80);
    assert_string_equal(v.name, "x=y"); /* only the first '=' splits */
    assert_true(v.quiet);
    assert_int_equal(v.tp, 4); /* from the second table */
    assert_string_equal(v.internal, "i");
    assert_int_equal(v.calls, 5);
    /* short names, with the value attached or apart; a value that looks
     * like an option is a value */
    assert_int_equal(parse(&v, err, sizeof err, "-p8080", "--name", "--tp", NULL), 0);
    assert_int_equal(v.port, 8080);
    assert_string_equal(v.name, "--tp");
    assert_int_equal(parse(&v, err, sizeof err, "-p", "1", "--a-rather-long-option-name=", NULL),
                     0);
    assert_int_equal(v.port, 1);
    assert_string_equal(v.dry, "");
    assert_int_equal(parse(&v, err, sizeof err, NULL), 0);
    assert_int_equal(v.calls, 0);
}

static void test_refuses(void **state) {
    (void)state;
    vals v;
    char err[512];
    struct {
        const char *w[4];
        const char *msg;
    } cases[] = {
        {{"--po", "1"}, "prog: unknown option '--po' (see --help)\n"}, /* no abbreviations */
        {{"--po=1"}, "prog: unknown option '--po' (see --help)\n"},
        {{"--ports", "1"}, "prog: unknown option '--ports' (see --help)\n"},
        {{"-x"}, "prog: unknown option '-x' (see --help)\n"},
        {{"--port"}, "prog: --port needs a value\n"},
        {{"-p"}, "prog: -p needs a value\n"},
        {{"--port", "x"}, "prog: bad value 'x' for --port\n"},
        {{"--port=70000"}, "prog: bad value '70000' for --port\n"},
        {{"-p", "-1"}, "prog: bad value '-1' for --port\n"},
        {{"--quiet=yes"}, "prog: --quiet takes no value\n"},
        {{"--tp", "mine"}, "prog: my own message\n"},
        {{"extra"}, "prog: unexpected argument 'extra' (see --help)\n"},
        {{"-q", "extra", "--port", "1"}, "prog: unexpected argument 'extra' (see --help)\n"},
        {{"--"}, ""}, /* the end of the options: nothing after it */
        {{"--", "x"}, "prog: unexpected argument 'x' (see --help)\n"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const char **w = cases[k].w;
        int rc = parse(&v, err, sizeof err, w[0], w[1], w[2], w[3], NULL);
        if (!*cases[k].msg) {
            assert_int_equal(rc, 0);
            continue;
        }
        if (rc != 2 || strcmp(err, cases[k].msg) != 0)
            fail_msg("case %zu (%s ...): rc %d, %s", k, w[0], rc, err);
    }
    /* the first bad option stops the parse: nothing after it is stored */
    assert_int_equal(parse(&v, err, sizeof err, "--port", "x", "--name", "n", NULL), 2);
    assert_null(v.name);
}

static void test_help(void **state) {
    (void)state;
    vals v;
    char err[64];
    g_usage_calls = 0;
    fflush(stdout);
    int saved = dup(1);
    FILE *tmp = tmpfile();
    assert_non_null(tmp);
    dup2(fileno(tmp), 1);
    int rc1 = parse(&v, err, sizeof err, "--port", "1", "--help", "--port", "x", NULL);
    int rc2 = parse(&v, err, sizeof err, "-h", NULL);
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    rewind(tmp);
    char out[256];
    size_t n = fread(out, 1, sizeof out - 1, tmp);
    out[n] = 0;
    fclose(tmp);
    assert_int_equal(rc1, 1);
    assert_int_equal(rc2, 1);
    assert_int_equal(g_usage_calls, 2);
    assert_string_equal(out, "usage: prog [options]\nusage: prog [options]\n");
    assert_int_equal(parse(&v, err, sizeof err, "--he", NULL), 2); /* no abbreviation either */
}

static void test_print(void **state) {
    (void)state;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_non_null(f);
    td_opts_print(f, k_a, A_N);
    td_opts_print(f, k_b, B_N);
    fclose(f);
    assert_string_equal(buf, "  -p, --port N               the port (0..65535)\n"
                             "  --name TEXT                a name\n"
                             "                             over two lines\n"
                             "  -q, --quiet                no output\n"
                             "  --tp N                     ranks\n"
                             "  --a-rather-long-option-name VALUE\n"
                             "                             its help on the next line\n");
    free(buf);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_accepts),
        cmocka_unit_test(test_refuses),
        cmocka_unit_test(test_help),
        cmocka_unit_test(test_print),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
