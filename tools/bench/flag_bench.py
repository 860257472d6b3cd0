#!/usr/bin/env python3
"""One tandem build measured with and without a flag: `tandem bench-engine
-p P -n N` for every model, the two settings alternating within each round
(so a noisy neighbour hits them alike); the table reports the median over
rounds of each run's mean (-r, --reps) and the flag's speed relative to the
default (docs/PERFORMANCE.md, "Int8 activations").

    flag_bench.py --tandem build/tandem --flag=--act-int8 [--threads 2]
        [-p 512] [-n 128] [--rounds 5] [--reps 3] [--json OUT] MODEL...
"""
import argparse
import json
import statistics
import sys

from compare_engine import run_json


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--flag", required=True, help="the option measured against none")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="repetitions per run (-r)")
    ap.add_argument("--json")
    ap.add_argument("models", nargs="+")
    args = ap.parse_args()
    settings = {"default": [], args.flag: [args.flag]}
    samples = {m: {s: {} for s in settings} for m in args.models}
    for r in range(args.rounds):
        for m in args.models:
            order = list(settings) if r % 2 == 0 else list(settings)[::-1]
            for s in order:
                cmd = [args.tandem, "bench-engine", "--model", m, "-p", str(args.p), "-n",
                       str(args.n), "-r", str(args.reps), "--threads", str(args.threads),
                       "--json", *settings[s]]
                for t in run_json(cmd)["tests"]:
                    samples[m][s].setdefault(t["test"], []).append(t["avg_ts"])
            print(f"round {r + 1}/{args.rounds} {m}: " +
                  "; ".join(f"{s} " + ", ".join(f"{t} {v[-1]:.1f}" for t, v in samples[m][s].items())
                            for s in settings), file=sys.stderr)
    print(f"\nthreads {args.threads}, median of {args.rounds} rounds of mean-of-{args.reps} (t/s)\n")
    print(f"| model | test | default | {args.flag} | ratio |")
    print("|---|---|---:|---:|---:|")
    for m in args.models:
        for t, v in samples[m]["default"].items():
            a, b = statistics.median(v), statistics.median(samples[m][args.flag][t])
            print(f"| {m.rsplit('/', 1)[-1]} | {t} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "flag": args.flag, "reps": args.reps,
                       "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
