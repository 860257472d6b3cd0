#!/usr/bin/env python3
"""Side-by-side engine benchmark: `tandem bench-engine` vs llama.cpp's
`llama-bench` on the same GGUF files, same thread count, same machine, in
the same run (docs/PERFORMANCE.md).

    compare_engine.py --tandem build/tandem --llama-bench PATH/llama-bench \
        --membw build/td-membw MODEL.gguf [MODEL.gguf ...] [--threads 2]
        [--rounds 5] [-p 512] [-n 128]

The two engines alternate within each round (so a noisy neighbour hits both
alike); each round runs each engine with -r 3 and keeps its mean; the table
reports the median over rounds of those means, and the ratio tandem/llama.cpp.
Generation's fraction of the memory-bandwidth limit is
tg t/s / (read bandwidth / weight bytes read per token), with the bandwidth
measured by td-membw with the same thread count in the same run.
Prints a Markdown table; --json OUT also writes the raw samples.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys


def run_json(cmd, env=None):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=1800)
    return json.loads(out.stdout)


def tandem_round(args, model):
    j = run_json([args.tandem, "bench-engine", "--model", model, "-p", str(args.p), "-n",
                  str(args.n), "-r", "3", "--threads", str(args.threads), "--json"])
    res = {t["test"][:2]: t["avg_ts"] for t in j["tests"]}
    return res, j


def llama_round(args, model):
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.path.dirname(os.path.abspath(args.llama_bench))
    j = run_json([args.llama_bench, "-m", model, "-t", str(args.threads), "-p", str(args.p),
                  "-n", str(args.n), "-r", "3", "-o", "json"], env=env)
    res = {}
    for t in j:
        res["pp" if t["n_prompt"] > 0 else "tg"] = t["avg_ts"]
    return res, j


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--membw", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()

    bw = [run_json([args.membw, "--threads", str(args.threads)])["read_gb_s"] for _ in range(3)]
    bw_gbs = statistics.median(bw)
    rows, raw = [], {"membw_gb_s": bw, "models": {}}
    for model in args.models:
        samples = {"tandem": {"pp": [], "tg": []}, "llama": {"pp": [], "tg": []}}
        wbytes = None
        for r in range(args.rounds):
            order = [("tandem", tandem_round), ("llama", llama_round)]
            if r % 2:
                order.reverse()
            for name, fn in order:
                res, j = fn(args, model)
                if name == "tandem":
                    wbytes = j["weight_bytes_per_token"]
                for k in ("pp", "tg"):
                    samples[name][k].append(res[k])
            print(f"{os.path.basename(model)} round {r + 1}/{args.rounds}: "
                  f"tandem {samples['tandem']['pp'][-1]:.1f}/{samples['tandem']['tg'][-1]:.1f}, "
                  f"llama.cpp {samples['llama']['pp'][-1]:.1f}/{samples['llama']['tg'][-1]:.1f} "
                  "(pp/tg t/s)", file=sys.stderr)
        raw["models"][model] = samples
        med = {e: {k: statistics.median(v) for k, v in s.items()} for e, s in samples.items()}
        limit = bw_gbs * 1e9 / wbytes
        for k, label in (("pp", f"pp{args.p}"), ("tg", f"tg{args.n}")):
            t, l = med["tandem"][k], med["llama"][k]
            frac = f"{t / limit:.0%} (llama.cpp {l / limit:.0%})" if k == "tg" else ""
            rows.append(f"| {os.path.basename(model)} | {label} | {t:.1f} | {l:.1f} | "
                        f"{t / l:.2f}x | {frac} |")
    print(f"\nthreads {args.threads}, read bandwidth {bw_gbs:.1f} GB/s (td-membw median of 3), "
          f"median of {args.rounds} rounds of mean-of-3\n")
    print("| model | test | tandem t/s | llama.cpp t/s | ratio | tg fraction of bandwidth limit |")
    print("|---|---|---:|---:|---:|---|")
    print("\n".join(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
