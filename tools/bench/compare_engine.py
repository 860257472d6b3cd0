#!/usr/bin/env python3
"""Side-by-side engine benchmark: `tandem bench-engine` vs llama.cpp's
`llama-bench` on the same GGUF files, same thread count, same machine, in
the same run (docs/PERFORMANCE.md).

    compare_engine.py --tandem build/tandem --llama-bench PATH/llama-bench \
        --membw build/td-membw MODEL.gguf [MODEL.gguf ...] [--threads 2]
        [--rounds 5] [-p 512] [-n 128] [-d DEPTH] [--kv-dtype f32|f16|bf16]
        [--act-int8]

The two engines alternate within each round (so a noisy neighbour hits both
alike); each round runs each engine with -r 3 (--reps) and keeps its mean; the table
reports the median over rounds of those means, and the ratio tandem/llama.cpp.
Generation's fraction of the memory-bandwidth limit is
tg t/s / (read bandwidth / weight bytes read per token), with the bandwidth
measured by td-membw with the same thread count right before each engine
run (a shared host's bandwidth moves by half between phases: one figure
for the whole run would credit or blame an engine for the phase it ran
in); the table gives the median over rounds of each run's fraction. With
-d DEPTH both engines first fill their KV cache with DEPTH tokens
(llama-bench -d; untimed) and hold it in --kv-dtype (llama-bench -ctk/-ctv);
the limit then counts the K/V bytes a token reads besides the weights
(DEPTH + n/2 positions on average, every layer, K and V).
With --act-int8 each round also runs `tandem bench-engine --act-int8`
(int8 activations for the quantized matmuls) beside the default f32 mode,
and the table gets its rows too.
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


def tandem_round(args, model, act_int8=False):
    cmd = [args.tandem, "bench-engine", "--model", model, "-p", str(args.p), "-n", str(args.n),
           "-r", str(args.reps), "--threads", str(args.threads), "--json"]
    if act_int8:
        cmd.append("--act-int8")
    if args.d:
        cmd += ["-d", str(args.d)]
    if args.kv_dtype:
        cmd += ["--kv-dtype", args.kv_dtype]
    j = run_json(cmd)
    res = {t["test"][:2]: t["avg_ts"] for t in j["tests"]}
    return res, j


def llama_round(args, model):
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.path.dirname(os.path.abspath(args.llama_bench))
    cmd = [args.llama_bench, "-m", model, "-t", str(args.threads), "-p", str(args.p),
           "-n", str(args.n), "-r", str(args.reps), "-o", "json"]
    if args.d:
        cmd += ["-d", str(args.d)]
    if args.kv_dtype:
        cmd += ["-ctk", args.kv_dtype, "-ctv", args.kv_dtype]
    j = run_json(cmd, env=env)
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
    ap.add_argument("--reps", type=int, default=3,
                    help="repetitions per engine run (-r), whose mean is the round's figure")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-d", type=int, default=0, help="KV cache depth before each test")
    ap.add_argument("--kv-dtype", choices=("f32", "f16", "bf16"),
                    help="both engines' KV cache type (default: each engine's own)")
    ap.add_argument("--act-int8", action="store_true",
                    help="also run tandem with --act-int8 in each round")
    ap.add_argument("--json")
    args = ap.parse_args()

    def membw():
        return run_json([args.membw, "--threads", str(args.threads)])["read_gb_s"]

    bw_all = []
    rows, raw = [], {"depth": args.d, "kv_dtype": args.kv_dtype, "models": {}}
    tests = [k for k, n in (("pp", args.p), ("tg", args.n)) if n > 0]
    for model in args.models:
        engines = ["tandem", "llama"] + (["tandem-int8"] if args.act_int8 else [])
        samples = {e: {k: [] for k in tests} for e in engines}
        bw = {e: [] for e in engines}  # GB/s right before each of e's runs
        wbytes = kv_bytes = None
        fns = {"tandem": tandem_round, "llama": llama_round,
               "tandem-int8": lambda a, m: tandem_round(a, m, act_int8=True)}
        for r in range(args.rounds):
            order = list(engines)
            if r % 2:
                order.reverse()
            for name in order:
                bw[name].append(membw())
                res, j = fns[name](args, model)
                if name == "tandem":
                    wbytes = j["weight_bytes_per_token"]
                    kv_bytes = j.get("kv_bytes_per_position", 0)
                for k in tests:
                    samples[name][k].append(res[k])
            print(f"{os.path.basename(model)} round {r + 1}/{args.rounds}: " +
                  ", ".join(f"{e} " + "/".join(f"{samples[e][k][-1]:.1f}" for k in tests)
                            for e in engines) + f" ({'/'.join(tests)} t/s; td-membw " +
                  ", ".join(f"{bw[e][-1]:.1f}" for e in engines) + " GB/s)",
                  file=sys.stderr)
        raw["models"][model] = dict(samples, membw_gb_s=bw)
        bw_all += [b for e in engines for b in bw[e]]
        med = {e: {k: statistics.median(v) for k, v in s.items()} for e, s in samples.items()}
        bytes_tok = wbytes + kv_bytes * (args.d + args.n / 2)

        def frac(e):  # the median over rounds of tg t/s over the run's own limit
            return statistics.median(t * bytes_tok / (b * 1e9)
                                     for t, b in zip(samples[e]["tg"], bw[e]))

        at = f" @ d{args.d}" if args.d else ""
        for k, label in (("pp", f"pp{args.p}{at}"), ("tg", f"tg{args.n}{at}")):
            if k not in tests:
                continue
            t, l = med["tandem"][k], med["llama"][k]
            fr = f"{frac('tandem'):.0%} (llama.cpp {frac('llama'):.0%})" if k == "tg" else ""
            rows.append(f"| {os.path.basename(model)} | {label} | {t:.1f} | {l:.1f} | "
                        f"{t / l:.2f}x | {fr} |")
            if args.act_int8:
                t8 = med["tandem-int8"][k]
                fr8 = f"{frac('tandem-int8'):.0%}" if k == "tg" else ""
                rows.append(f"| {os.path.basename(model)} | {label} --act-int8 | {t8:.1f} | "
                            f"{l:.1f} | {t8 / l:.2f}x | {fr8} |")
    print(f"\nthreads {args.threads}, read bandwidth {statistics.median(bw_all):.1f} GB/s "
          f"(td-membw before each engine run: median, {min(bw_all):.1f}-{max(bw_all):.1f}), "
          f"median of {args.rounds} rounds of mean-of-{args.reps}, KV cache "
          f"{args.kv_dtype or 'each engine default'}\n")
    print("| model | test | tandem t/s | llama.cpp t/s | ratio | tg fraction of bandwidth limit |")
    print("|---|---|---:|---:|---:|---|")
    print("\n".join(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
