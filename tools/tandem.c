/* The tandem CLI: one binary, one subcommand per job. */
#include <stdio.h>
#include <string.h>

#include "common/parallel/exec.h"
#include "common/runtime/cli.h"
#include "common/transfer/xext.h"
#include "tools.h"

static const struct {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *help;
} k_cmds[] = {
    {"generate", td_cmd_generate, "generate text from a prompt or a chat message"},
    {"bench-engine", td_cmd_bench_engine,
     "measure prompt and generation speed (llama-bench style)"},
    {"eval", td_cmd_eval, "dump logits for token sequences (used by the numerics tests)"},
    {"serve", td_cmd_serve, "serve the model over the OpenAI HTTP API and gRPC"},
    {"up", td_cmd_up, "run a router, prefill and decode instances on this machine"},
    {"bench", td_cmd_bench, "load-test an OpenAI-compatible endpoint"},
    {"bench-transfer", td_cmd_bench_transfer,
     "KV transfer channel put throughput (ucx_perftest ucp_put_bw style)"},
    {"replay", td_cmd_replay, "check the scheduling core against a scheduler's step trace"},
    {"simulate", td_cmd_simulate, "run a workload through simulated clusters (the planner's core)"},
    {"profile", td_cmd_profile, "measure an instance plan's step, transfer and KV figures"},
    {"plan", td_cmd_plan, "size the pools against TTFT/TPOT SLOs for a workload"},
    {"grammar", td_cmd_grammar,
     "check documents and token masks against a structured-output constraint"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: tandem COMMAND [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof k_cmds / sizeof k_cmds[0]; i++)
        fprintf(f, "  %-14s %s\n", k_cmds[i].name, k_cmds[i].help);
    fprintf(f, "\n'tandem COMMAND --help' describes each command's options.\n");
}

int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!td_process_init("tandem")) return 1;
    /* internal: a rank process of a parallel plan, started by the driver */
    if (strcmp(argv[1], "rank") == 0) return td_exec_rank_main(argc - 1, argv + 1, &td_xext_ops);
    for (size_t i = 0; i < sizeof k_cmds / sizeof k_cmds[0]; i++)
        if (strcmp(argv[1], k_cmds[i].name) == 0) return k_cmds[i].fn(argc - 1, argv + 1);
    /* one line, whatever the number of commands */
    fprintf(stderr, "tandem: unknown command '%s'; commands:", argv[1]);
    for (size_t i = 0; i < sizeof k_cmds / sizeof k_cmds[0]; i++)
        fprintf(stderr, " %s", k_cmds[i].name);
    fprintf(stderr, " ('tandem --help' describes them)\n");
    return 2;
}
