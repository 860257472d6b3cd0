#!/usr/bin/env python3
"""Old build against new build of tandem, interleaved in one run: for a
restructuring that must not cost speed (docs/PERFORMANCE.md).

Each round runs `tandem bench-engine --json -r R` of both binaries on every
model, alternating which goes first; the table gives the median over rounds
of each build's mean tokens/s and the ratio new / old.

    tools/bench/compare_builds.py --old OLD/tandem --new build/tandem \
        --rounds 5 --threads 2 MODEL.gguf [MODEL.gguf ...]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys


def bench(binary, model, args):
    cmd = [binary, "bench-engine", "--json", "--model", model, "-r", str(args.reps),
           "-p", str(args.n_prompt), "-n", str(args.n_gen), "--threads", str(args.threads)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        sys.exit(f"compare_builds: {' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    out = json.loads(p.stdout)
    return out["isa"], {t["test"]: t["avg_ts"] for t in out["tests"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the tandem binary before the change")
    ap.add_argument("--new", required=True, help="the tandem binary after it")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="bench-engine -r per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", help="also write the samples here")
    ap.add_argument("models", nargs="+")
    args = ap.parse_args()

    samples = {}  # (model, test, build) -> [t/s per round]
    isa = None
    for r in range(args.rounds):
        for model in args.models:
            order = [("old", args.old), ("new", args.new)]
            if r % 2:
                order.reverse()
            for name, binary in order:
                isa, tests = bench(binary, model, args)
                for test, ts in tests.items():
                    samples.setdefault((model, test, name), []).append(ts)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    print(f"threads {args.threads}, isa {isa}, median of {args.rounds} rounds "
          f"of bench-engine -r {args.reps}, old and new alternating\n")
    print("| model | test | old t/s | new t/s | new / old |")
    print("|---|---|---:|---:|---:|")
    worst = None
    for model in args.models:
        tests = sorted({t for (m, t, _) in samples if m == model}, key=lambda t: (t[:2] != "pp", t))
        for test in tests:
            old = statistics.median(samples[(model, test, "old")])
            new = statistics.median(samples[(model, test, "new")])
            ratio = new / old
            worst = ratio if worst is None else min(worst, ratio)
            print(f"| {os.path.basename(model)} | {test} | {old:.1f} | {new:.1f} | {ratio:.3f} |")
    print(f"\nslowest row: new / old = {worst:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": isa, "threads": args.threads,
                       "samples": [{"model": m, "test": t, "build": b, "ts": v}
                                   for (m, t, b), v in samples.items()]}, f, indent=1)


if __name__ == "__main__":
    main()
