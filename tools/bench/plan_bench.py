#!/usr/bin/env python3
"""Step time of parallel plans, split into compute and communication
(docs/PERFORMANCE.md).

For each plan, runs `tandem bench-engine --json -p P -n N -r R PLAN...`
(one prefill step of P tokens; N decode steps of one token) and prints one
markdown row per plan and phase: the wall time of a step (median over the
repetitions), and per rank the mean compute and communication time of a
step (communication = inside comm calls, waiting for peers included, as
the ranks measure it). Plans run one after another in the same invocation,
so they share the machine's state; repeat the whole command and take
medians on a noisy machine.

  tools/bench/plan_bench.py --tandem build/tandem [--model PATH] \
      [-p 256] [-n 64] [-r 5] [--plan "--tp 3"] [--plan "--pp 2"] ...
"""
import argparse
import json
import shlex
import statistics
import subprocess
import sys

DEFAULT_PLANS = ["", "--tp 3", "--pp 2", "--tp 3 --pp 2"]


def run(tandem, model, p, n, r, plan, threads):
    argv = [tandem, "bench-engine", "--json", "-p", str(p), "-n", str(n), "-r", str(r)]
    if model:
        argv += ["--model", model]
    if threads:
        argv += ["--threads", str(threads)]
    argv += shlex.split(plan)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{out.stderr}")
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--model")
    ap.add_argument("-p", type=int, default=256)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-r", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0,
                    help="threads per rank (default: cores / ranks)")
    ap.add_argument("--plan", action="append", help="plan flags (repeatable)")
    a = ap.parse_args()
    plans = a.plan if a.plan else DEFAULT_PLANS
    print("| plan | ranks | phase | step ms | compute ms per rank | comm ms per rank |")
    print("|---|---|---|---|---|---|")
    for plan in plans:
        js = run(a.tandem, a.model, a.p, a.n, a.r, plan, a.threads)
        for t in js["tests"]:
            steps = t["n_prompt"] and 1 or t["n_gen"]
            step_ms = statistics.median(ns / 1e6 / steps for ns in t["samples_ns"])
            ranks = t.get("ranks") or []
            comp = " / ".join(f"{rk['step_compute_ms']:.2f}" for rk in ranks) or "-"
            comm = " / ".join(f"{rk['step_comm_ms']:.2f}" for rk in ranks) or "-"
            if js.get("world", 1) == 1:
                comp, comm = f"{step_ms:.2f}", "0"
            print(f"| {plan or 'one rank'} | {js.get('world', 1)} | {t['test']} | {step_ms:.2f} "
                  f"| {comp} | {comm} |", flush=True)


if __name__ == "__main__":
    main()
