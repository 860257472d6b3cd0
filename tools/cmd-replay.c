/* tandem replay: checks the scheduling core against a real scheduler's
 * step trace (planner/replay.h).
 *
 *   tandem replay --trace TRACE.jsonl [--json]
 *
 * Exit 0 when the core took every recorded decision, 1 when one differed
 * (the first is named) or the trace cannot be replayed, 2 for bad usage. */
#include <stdio.h>
#include <string.h>

#include "common/base/opts.h"
#include "planner/replay.h"
#include "tools.h"

enum { R_TRACE, R_JSON, R_N };
static const td_opt k_replay_opts[R_N] = {
    [R_TRACE] = {"trace", 0, "PATH", "a step trace (tandem serve --step-trace PATH)"},
    [R_JSON] = {"json", 0, NULL, "print the result as JSON"},
};

typedef struct {
    const char *trace;
    bool json;
} replay_args;

static bool set_replay_opt(void *ctx, int i, const char *val, bool *printed) {
    replay_args *a = ctx;
    TD_UNUSED(printed);
    switch (i) {
    case R_TRACE: a->trace = val; return *val != '\0';
    case R_JSON: a->json = true; return true;
    }
    return false;
}

static void usage(FILE *f, void *ctx) {
    TD_UNUSED(ctx);
    fprintf(f, "usage: tandem replay --trace TRACE.jsonl [--json]\n\n"
               "Replays a scheduler's step trace through the scheduling core (the code the\n"
               "simulator runs) on a KV pool of the recorded size, feeding it the recorded\n"
               "arrivals, tokens and ends, and checks that it admits, preempts and batches\n"
               "exactly as the real scheduler did at every step. Exit 0: every decision\n"
               "equal; 1: one differed (the first is named) or the trace is unusable.\n\n");
    td_opts_print(f, k_replay_opts, R_N);
}

int td_cmd_replay(int argc, char **argv) {
    replay_args a = {0};
    td_optset set = {k_replay_opts, R_N, set_replay_opt, &a};
    int rc = td_opts_parse("tandem replay", argc, argv, &set, 1, usage, NULL);
    if (rc) return rc == 1 ? 0 : 2;
    if (!a.trace) {
        fprintf(stderr, "tandem replay: --trace is needed (see --help)\n");
        return 2;
    }
    td_replay_result r;
    td_status st = td_replay_step_trace(a.trace, &r);
    if (a.json) {
        printf("{\"status\":\"%s\",\"same\":%s,\"steps\":%lld,\"batches\":%lld,"
               "\"requests\":%lld,\"admissions\":%lld,\"preemptions\":%lld,"
               "\"batch_entries\":%lld,\"tokens\":%lld}\n",
               td_status_str(st), st == TD_OK && r.same ? "true" : "false", (long long)r.steps,
               (long long)r.batches, (long long)r.requests, (long long)r.admissions,
               (long long)r.preemptions, (long long)r.batch_seqs, (long long)r.tokens);
    }
    if (st != TD_OK) {
        fprintf(stderr, "tandem replay: %s\n", r.why);
        return 1;
    }
    if (!r.same) {
        fprintf(stderr, "tandem replay: the core differs from the trace: %s\n", r.why);
        return 1;
    }
    if (!a.json)
        printf("replayed %lld steps (%lld batches, %lld requests, %lld admissions, %lld "
               "preemptions, %lld batch entries, %lld tokens): the scheduling core took every "
               "recorded decision\n",
               (long long)r.steps, (long long)r.batches, (long long)r.requests,
               (long long)r.admissions, (long long)r.preemptions, (long long)r.batch_seqs,
               (long long)r.tokens);
    return 0;
}
