/* Command-line options from one table per command: libc's getopt_long
 * parses them, and the same table prints the command's --help.
 *
 * Long options take their value as the next argument or after '='
 * (--port 8000, --port=8000); a long option must be spelt out in full
 * (getopt_long's abbreviations are refused: "--po" is not --port). A
 * command's options may come from several tables (its own and, say, the
 * parallel-plan flags), each with the handler that stores its values.
 * Not thread-safe (getopt_long's globals): parse in main. */
#ifndef TD_BASE_OPTS_H
#define TD_BASE_OPTS_H

#include <stdbool.h>
#include <stdio.h>

typedef struct {
    const char *name; /* "port" for --port */
    char short_name;  /* 'm' for -m; 0: none */
    const char *arg;  /* the value's name in --help ("N", "PATH"); NULL: a flag */
    /* The --help text; '\n' starts a new line under the first. NULL: parsed
     * but not printed (an alias, or an option for the tool's own use). */
    const char *help;
} td_opt;

typedef struct {
    const td_opt *opts;
    int n;
    /* opts[i] was given with val (NULL for a flag). Returns false for a
     * bad value ("PROG: bad value 'VAL' for --NAME" is printed), or prints
     * its own message and sets *printed. */
    bool (*set)(void *ctx, int i, const char *val, bool *printed);
    void *ctx;
} td_optset;

/* Parses argv[1..] (argv[0] is the command) over the sets. --help and -h
 * print the usage (td_opts_usage) on stdout: returns 1. An unknown or
 * abbreviated option, a missing value, a bad value or a stray argument
 * prints one line "PROG: ..." on stderr: returns 2. Else 0. */
int td_opts_parse(const char *prog, int argc, char **argv, const td_optset *sets, int n_sets,
                  void (*usage)(FILE *f, void *ctx), void *usage_ctx);

/* The options of a table, one per line: "  --NAME ARG" (or "-S, --NAME
 * ARG"), the help from column 29 (the next line when the name is longer),
 * its continuation lines under it. */
void td_opts_print(FILE *f, const td_opt *opts, int n);

#endif
