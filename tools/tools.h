/* Subcommands of the tandem CLI. Each takes argv starting at its own name
 * and returns the process exit status (0 ok, 1 runtime error, 2 usage). */
#ifndef TD_TOOLS_H
#define TD_TOOLS_H

int td_cmd_generate(int argc, char **argv);
int td_cmd_bench_engine(int argc, char **argv);
int td_cmd_eval(int argc, char **argv);
int td_cmd_serve(int argc, char **argv);
int td_cmd_up(int argc, char **argv);

int td_cmd_bench(int argc, char **argv);
int td_cmd_bench_transfer(int argc, char **argv);
int td_cmd_replay(int argc, char **argv);
int td_cmd_simulate(int argc, char **argv);
int td_cmd_profile(int argc, char **argv);
int td_cmd_plan(int argc, char **argv);
int td_cmd_grammar(int argc, char **argv);

#endif
