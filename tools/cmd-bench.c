/* tandem bench: the serving load generator lives in Python
 * (tools/bench/serve_bench.py, standard library only); this command runs it
 * with the same arguments, so `tandem bench --help` is its help. The script
 * is found under $TANDEM_SOURCE_DIR, else the source tree the binary was
 * built from; the interpreter is $TANDEM_PYTHON, else python3 on PATH. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/runtime/cli.h"
#include "tools.h"

#ifndef TD_SOURCE_DIR
#define TD_SOURCE_DIR ""
#endif

#define BENCH_SCRIPT "/tools/bench/serve_bench.py"

int td_cmd_bench(int argc, char **argv) {
    const char *src = getenv("TANDEM_SOURCE_DIR");
    if (!src || !*src) src = TD_SOURCE_DIR;
    if (!*src) {
        fprintf(stderr, "tandem bench: set TANDEM_SOURCE_DIR to the Tandem source tree\n");
        return 1;
    }
    size_t n = strlen(src) + sizeof BENCH_SCRIPT;
    char *script = malloc(n);
    char **args = calloc((size_t)argc + 2, sizeof *args);
    if (!script || !args) {
        fprintf(stderr, "tandem bench: out of memory\n");
        free(script);
        free(args);
        return 1;
    }
    snprintf(script, n, "%s%s", src, BENCH_SCRIPT);
    if (access(script, R_OK) != 0) {
        fprintf(stderr, "tandem bench: cannot read %s: %s (set TANDEM_SOURCE_DIR)\n", script,
                strerror(errno));
        free(script);
        free(args);
        return 1;
    }
    const char *py = getenv("TANDEM_PYTHON");
    if (!py || !*py) py = "python3";
    /* argv[0] is "bench"; the script takes the rest. */
    args[0] = (char *)py;
    args[1] = script;
    for (int i = 1; i < argc; i++) args[i + 1] = argv[i];
    args[argc + 1] = NULL;
    fflush(stdout);
    fflush(stderr);
    execvp(py, args);
    fprintf(stderr, "tandem bench: cannot run %s: %s\n", py, strerror(errno));
    free(script);
    free(args);
    return 1;
}
