/* The commands that live in Python (standard library, numpy and scipy):
 * tandem bench (tools/bench/serve_bench.py), tandem profile
 * (tools/planner/profiler.py) and tandem plan (tools/planner/plan.py).
 * Each runs its script with the same arguments, so `tandem CMD --help` is
 * the script's help. The scripts are found under $TANDEM_SOURCE_DIR, else
 * the source tree the binary was built from; the interpreter is
 * $TANDEM_PYTHON, else python3 on PATH; $TANDEM_BIN is set to this binary
 * for the scripts that start instances. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/runtime/cli.h"
#include "tools.h"

#ifndef TD_SOURCE_DIR
#define TD_SOURCE_DIR ""
#endif

static int run_script(const char *cmd, const char *rel, int argc, char **argv) {
    const char *src = getenv("TANDEM_SOURCE_DIR");
    if (!src || !*src) src = TD_SOURCE_DIR;
    if (!*src) {
        fprintf(stderr, "tandem %s: set TANDEM_SOURCE_DIR to the Tandem source tree\n", cmd);
        return 1;
    }
    size_t n = strlen(src) + strlen(rel) + 1;
    char *script = malloc(n);
    char **args = calloc((size_t)argc + 2, sizeof *args);
    if (!script || !args) {
        fprintf(stderr, "tandem %s: out of memory\n", cmd);
        free(script);
        free(args);
        return 1;
    }
    snprintf(script, n, "%s%s", src, rel);
    if (access(script, R_OK) != 0) {
        fprintf(stderr, "tandem %s: cannot read %s: %s (set TANDEM_SOURCE_DIR)\n", cmd, script,
                strerror(errno));
        free(script);
        free(args);
        return 1;
    }
    char self[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len > 0 && !getenv("TANDEM_BIN")) {
        self[len] = '\0';
        setenv("TANDEM_BIN", self, 1);
    }
    const char *py = getenv("TANDEM_PYTHON");
    if (!py || !*py) py = "python3";
    /* argv[0] is the command's name; the script takes the rest. */
    args[0] = (char *)py;
    args[1] = script;
    for (int i = 1; i < argc; i++) args[i + 1] = argv[i];
    args[argc + 1] = NULL;
    fflush(stdout);
    fflush(stderr);
    execvp(py, args);
    fprintf(stderr, "tandem %s: cannot run %s: %s\n", cmd, py, strerror(errno));
    free(script);
    free(args);
    return 1;
}

int td_cmd_bench(int argc, char **argv) {
    return run_script("bench", "/tools/bench/serve_bench.py", argc, argv);
}

int td_cmd_profile(int argc, char **argv) {
    return run_script("profile", "/tools/planner/profiler.py", argc, argv);
}

int td_cmd_plan(int argc, char **argv) {
    return run_script("plan", "/tools/planner/plan.py", argc, argv);
}
