#!/usr/bin/env python3
"""Goodput under overload, through the router (issue 19's benchmark).

For each build (--build NAME=DIR, the directory with tandem, tandem-prefill,
tandem-decode and tandem-router) and each topology (--topology 1p1d,2p2d:
that many prefill and decode instances, one compute thread each, behind a
tandem-router on loopback), it sweeps the request rate upwards (Poisson
arrivals, `tandem bench`, --duration seconds a run) until goodput stops
growing, takes the rate where it peaked, and then runs --repeat times at
that rate, at 2x and at 3x it (interleaved, the same duration). Goodput:
requests per second that completed within the SLO (default TTFT 2 s, TPOT
100 ms); a 429 or any other error counts as not good. It also counts the
fences of a prefill instance (every decode instance's log: "fencing it";
no instance is stopped or killed here, so every one is of a live peer).

The table: per build and topology, the peak rate and the median goodput of
its repeats (the peak), and the 2x / 3x runs' median and minimum goodput as
a share of it (the bar: >= 90% at 2x, >= 80% at 3x), their fences and the
errors other than 429 at 3x. --json keeps every run's figures (TTFT and
TPOT P50 too). Give the builds in one invocation so that they run on the
machine in the same state.

Usage:
  tools/bench/overload.py --build old=/tmp/old/build,--local-prefill-threshold,0 \\
      --build new=build,--local-prefill-threshold,0,--reject-unmeetable,--ttft-slo-ms,1500 \\
      --model ~/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
      [--topology 1p1d,2p2d] [--duration 60] [--start-rate 0.25] [--repeat 3] [--json OUT]
"""

import argparse
import json
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from chaos import Cluster  # noqa: E402  (the same cluster as the chaos soak)


def bench(bin_dir, port, rate, a, out_json, seed):
    n = max(1, round(rate * a.duration))
    cmd = [pathlib.Path(bin_dir) / "tandem", "bench", "--url", f"http://127.0.0.1:{port}",
           "--num-prompts", n, "--request-rate", rate, "--input-len", a.input_len,
           "--output-len", a.output_len, "--seed", seed, "--slo", a.slo, "--timeout", 60,
           "--no-progress", "--json", out_json]
    subprocess.run([str(c) for c in cmd], stdout=subprocess.DEVNULL, check=False)
    rep = json.loads(pathlib.Path(out_json).read_text())
    # the run's length is its arrivals' span, the same at every rate
    good = rep["good_requests"] or 0
    return {"rate": rate, "requests": rep["num_prompts"], "completed": rep["completed"],
            "errors": rep["errors"], "good": good, "goodput": good / a.duration,
            "ttft_p50_ms": (rep["ttft_ms"] or {}).get("p50"),
            "tpot_p50_ms": (rep["tpot_ms"] or {}).get("p50")}


def one(name, bin_dir, topo, a, out, extra_r):
    n_p, n_d = int(topo[0]), int(topo[2])
    runs = []
    c = Cluster(bin_dir, a.model, n_p, n_d, out / f"{name}-{topo}", r_args=extra_r)
    try:
        c.start()
        c.wait_linked()

        def run(rate, what):
            f0 = sum(c.fences().values())
            r = bench(bin_dir, c.router.port, rate, a, out / f"{name}-{topo}-{what}-{rate}.json",
                      a.seed)
            c.wait_idle(120)
            r["fences"] = sum(c.fences().values()) - f0
            r["what"] = what
            runs.append(r)
            print(f"{name} {topo} {what:<6} rate {rate:6.2f}/s: goodput {r['goodput']:.2f}/s "
                  f"({r['good']}/{r['requests']}), errors {r['errors']}, fences {r['fences']}",
                  flush=True)
            return r
        run(a.start_rate, "warm")  # speeds measured, endpoints made
        best, rate = None, a.start_rate
        while True:
            r = run(rate, "sweep")
            if best is None or r["goodput"] > best["goodput"]:
                best = r
            elif r["goodput"] < best["goodput"] * 0.95 or rate >= 8 * best["rate"]:
                break
            rate *= 1.5
        peak = best["rate"]
        for _ in range(a.repeat):  # interleaved: the machine's drift hits the three alike
            for k, what in ((1, "peak"), (2, "2x"), (3, "3x")):
                run(peak * k, what)
    finally:
        c.stop()
    return {"build": name, "topology": topo, "peak_rate": peak, "runs": runs,
            **{f"{w}_goodput": [r["goodput"] for r in runs if r["what"] == w]
               for w in ("peak", "2x", "3x")}}


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", action="append", required=True,
                   help="NAME=DIR[,ROUTER-ARG...] (repeatable): a build and the extra arguments "
                   "of its router, e.g. new=build,--reject-unmeetable,--ttft-slo-ms,2000")
    p.add_argument("--model", required=True)
    p.add_argument("--topology", default="1p1d,2p2d")
    p.add_argument("--duration", type=float, default=60)
    p.add_argument("--start-rate", type=float, default=0.25)
    p.add_argument("--input-len", default="64:512")
    p.add_argument("--output-len", default="16:64")
    p.add_argument("--slo", default="ttft:2000,tpot:100")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3,
                   help="runs at the peak rate and at 2x and 3x it (interleaved); the table "
                   "gives their medians and minimums")
    p.add_argument("--out", help="logs and bench reports (default: a new temporary directory)")
    p.add_argument("--json", help="every run's figures")
    a = p.parse_args(argv)
    out = pathlib.Path(a.out or tempfile.mkdtemp(prefix="tandem-overload-"))
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for topo in a.topology.split(","):
        if not re.fullmatch(r"\dp\dd", topo):
            raise SystemExit(f"overload: topology {topo!r} is not like 1p1d")
        for spec in a.build:
            name, _, rest = spec.partition("=")
            d, *extra_r = rest.split(",")
            results.append(one(name, d, topo, a, out, extra_r))
    print("\n| build | topology | peak rate | peak goodput | 2x goodput: median, min (share of "
          "the peak) | 3x goodput: median, min (share) | fences at 2x / 3x | errors at 3x "
          "(not 429) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        pk = statistics.median(r["peak_goodput"]) or float("nan")

        def cell(w):
            g = r[f"{w}_goodput"]
            m, lo = statistics.median(g), min(g)
            return f"{m:.2f}/s ({m / pk:.0%}), {lo:.2f}/s ({lo / pk:.0%})"

        def total(w, f):
            return sum(f(x) for x in r["runs"] if x["what"] == w)
        other = total("3x", lambda x: sum(n for k, n in x["errors"].items() if k != "http_429"))
        print(f"| {r['build']} | {r['topology']} | {r['peak_rate']:.2f}/s | {pk:.2f}/s | "
              f"{cell('2x')} | {cell('3x')} | {total('2x', lambda x: x['fences'])} / "
              f"{total('3x', lambda x: x['fences'])} | {other} |")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"duration_s": a.duration, "slo": a.slo, "repeat": a.repeat,
                                                    "input_len": a.input_len,
                                                    "output_len": a.output_len,
                                                    "results": results}, indent=1) + "\n")
    print(f"logs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
