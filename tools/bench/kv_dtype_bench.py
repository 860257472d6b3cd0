#!/usr/bin/env python3
"""Generation speed by KV cache dtype and depth: `tandem bench-engine -p 0
-n N -d DEPTH --kv-dtype T` for every dtype at every depth, the dtypes
alternating within each round (so a noisy neighbour hits them alike); the
table reports the median over rounds of each run's mean (-r, --reps), and each
dtype's speed relative to f32 at the same depth (docs/PERFORMANCE.md, "The
KV cache dtype").

    kv_dtype_bench.py --tandem build/tandem [--model M.gguf] [--threads 2]
        [--depths 0,2048,8064] [--dtypes f32,f16,bf16] [-n 128] [--rounds 5]
        [--reps 3] [--json OUT]
"""
import argparse
import json
import statistics
import sys

from compare_engine import run_json


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depths", default="0,2048,8064")
    ap.add_argument("--dtypes", default="f32,f16,bf16")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="repetitions per run (-r)")
    ap.add_argument("--json")
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    dtypes = args.dtypes.split(",")
    samples = {d: {t: [] for t in dtypes} for d in depths}
    for r in range(args.rounds):
        for d in depths:
            order = dtypes if r % 2 == 0 else dtypes[::-1]
            for t in order:
                cmd = [args.tandem, "bench-engine", "-p", "0", "-n", str(args.n), "-d", str(d),
                       "-r", str(args.reps), "--threads", str(args.threads), "--kv-dtype", t,
                       "--json"]
                if args.model:
                    cmd += ["--model", args.model]
                j = run_json(cmd)
                samples[d][t].append(j["tests"][0]["avg_ts"])
            print(f"round {r + 1}/{args.rounds} depth {d}: " +
                  ", ".join(f"{t} {samples[d][t][-1]:.1f}" for t in dtypes) + " t/s",
                  file=sys.stderr)
    print(f"\nthreads {args.threads}, tg{args.n}, median of {args.rounds} rounds of "
          f"mean-of-{args.reps} (t/s)\n")
    print("| depth | " + " | ".join(dtypes) + " | " +
          " | ".join(f"{t} / f32" for t in dtypes if t != "f32") + " |")
    print("|---:|" + "---:|" * (2 * len(dtypes) - 1))
    for d in depths:
        med = {t: statistics.median(samples[d][t]) for t in dtypes}
        ratios = [f"{med[t] / med['f32']:.2f}x" for t in dtypes if t != "f32" and "f32" in med]
        print(f"| {d} | " + " | ".join(f"{med[t]:.1f}" for t in dtypes) + " | " +
              " | ".join(ratios) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "n_gen": args.n, "reps": args.reps,
                       "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
