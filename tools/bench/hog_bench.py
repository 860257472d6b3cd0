#!/usr/bin/env python3
"""Generation with a core taken away: `tandem bench-engine` (and llama.cpp's
`llama-bench` beside it, and optionally an older tandem build) at 1 thread,
at 2 threads, and at 2 threads while another process spins on one core
(docs/PERFORMANCE.md).

    hog_bench.py --tandem build/tandem [--baseline OLD/tandem]
        [--llama-bench PATH/llama-bench] [--model GGUF] [--rounds 5]
        [-n 128] [--hog-cpu 1] [--json OUT]

The spinning process is a Python busy loop pinned to --hog-cpu (default: the
last CPU this process may run on), started before and stopped after each
measurement that wants it; the engines' threads are not pinned, as a user's
would not be. Each round runs every engine in every setting once (tg with
-r 3, its mean kept), in an order rotated between rounds so a noisy moment
hits all alike; the table reports medians over rounds and, per engine, the
ratio of 2 threads beside the spinner to 1 thread (the bar: at least 1.0).
The load average and CPU model are printed with the table.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_engine import run_json  # noqa: E402  (runs a benchmark, parses its JSON)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class Hog:
    """A busy loop pinned to one CPU, stopped on exit."""

    def __init__(self, cpu):
        self.p = subprocess.Popen([sys.executable, "-c",
                                   f"import os\nos.sched_setaffinity(0, {{{cpu}}})\n"
                                   "while True:\n    pass\n"])
        time.sleep(0.3)  # running before the engine starts

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.p.kill()
        self.p.wait()


def tandem_tg(binary, model, threads, n):
    j = run_json([binary, "bench-engine", "--model", model, "-p", "0", "-n", str(n), "-r", "3",
                  "--threads", str(threads), "--json"])
    return next(t["avg_ts"] for t in j["tests"] if t["test"].startswith("tg"))


def llama_tg(binary, model, threads, n):
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.path.dirname(os.path.abspath(binary))
    j = run_json([binary, "-m", model, "-t", str(threads), "-p", "0", "-n", str(n), "-r", "3",
                  "-o", "json"], env=env)
    return next(t["avg_ts"] for t in j if t["n_gen"] > 0)


SETTINGS = [("1 thread", 1, False), ("2 threads", 2, False), ("2 threads + spinner", 2, True)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--baseline", help="an older tandem binary, measured the same way")
    ap.add_argument("--llama-bench")
    ap.add_argument("--model", default=os.path.expanduser(
        "~/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--hog-cpu", type=int, default=max(os.sched_getaffinity(0)))
    ap.add_argument("--json")
    a = ap.parse_args()
    engines = [("tandem", lambda t: tandem_tg(a.tandem, a.model, t, a.n))]
    if a.baseline:
        engines.append(("tandem baseline", lambda t: tandem_tg(a.baseline, a.model, t, a.n)))
    if a.llama_bench:
        engines.append(("llama.cpp", lambda t: llama_tg(a.llama_bench, a.model, t, a.n)))
    load0 = os.getloadavg()
    runs = [(e, s) for e in range(len(engines)) for s in range(len(SETTINGS))]
    samples = {k: [] for k in runs}
    for r in range(a.rounds):
        k = r % len(runs)
        for e, s in runs[k:] + runs[:k]:
            name, fn = engines[e]
            label, threads, hog = SETTINGS[s]
            if hog:
                with Hog(a.hog_cpu):
                    v = fn(threads)
            else:
                v = fn(threads)
            samples[(e, s)].append(v)
            sys.stderr.write(f"[hog_bench] round {r + 1}/{a.rounds} {name} {label}: "
                             f"{v:.1f} t/s\n")
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"\nCPU: {cpu_model()}, {os.cpu_count()} CPUs; load average before: "
          f"{load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; model {os.path.basename(a.model)}; "
          f"tg{a.n}, medians of {a.rounds} rounds of mean-of-3; spinner on CPU {a.hog_cpu}\n")
    print("| engine | " + " | ".join(f"{s[0]} t/s" for s in SETTINGS) +
          " | spinner / 1 thread |")
    print("|---|" + "---:|" * (len(SETTINGS) + 1))
    table = []
    for e, (name, _) in enumerate(engines):
        row = [med[(e, s)] for s in range(len(SETTINGS))]
        table.append({"engine": name, **{SETTINGS[s][0]: row[s] for s in range(len(SETTINGS))},
                      "samples": {SETTINGS[s][0]: samples[(e, s)] for s in range(len(SETTINGS))}})
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in row) + f" | {row[2] / row[0]:.2f} |")
    print(f"\nCommand: {' '.join(sys.argv)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_model(), "loadavg_before": load0, "rounds": a.rounds,
                       "n": a.n, "hog_cpu": a.hog_cpu, "table": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
