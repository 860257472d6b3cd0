"""The planner against measured runs: for each case (a cluster shape and a
workload), the simulator's prediction (tandem plan --config SHAPE) and
real runs of the same workload (tandem up with the shape, pinned with
--cpus; tandem bench --trace with the workload's arrivals), side by side.

  python3 tools/planner/validate.py --cases CASES.json --out RESULTS.json [--repeats 3]

CASES.json: {"slo": "ttft_p90:MS,tpot_p90:MS", "host_cores": C,
             "profiles": {"NAME": "PROFILE.json", ...},
             "cases": [{"name": ..., "profile": NAME, "config": "colocated=1",
                        "threads": 1, "cpus": "0", "workload": "W.json or trace",
                        "num_requests": N, "length_scale": S, "trace_speed": X,
                        "local_prefill_threshold": T}, ...]}
host_cores (default 0): the cores of the machine the runs share, for
tandem plan --host-cores (instances side by side slow each other).
Percentiles compared: P50 and P90 of TTFT and TPOT (P99 only where a run
holds >= 1000 requests), and goodput; each prediction's error against the
median of the repeats, and the repeats' own spread (max - min over median).
The repeats run in rounds (every case once, then every case again), so a
case's repeats lie minutes apart and their spread includes the machine's
drift over the validation; each run's start time is kept ("started").
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import plan  # noqa: E402
import stepcheck  # noqa: E402
from steptrace import Trace, TraceError  # noqa: E402
from upctl import Up, stop_on_sigterm  # noqa: E402

STATS = [("ttft", "p50"), ("ttft", "p90"), ("tpot", "p50"), ("tpot", "p90")]


def tandem():
    return os.environ.get("TANDEM_BIN") or str(HERE.parent.parent / "build" / "tandem")


def up_argv(case, model, traces=None):
    cfg = dict(kv.split("=") for kv in case["config"].split(","))
    argv = [tandem(), "up", "--port", "0", "--grpc-port", "-1", "--threads",
            str(case.get("threads", 1)), "--cpus", case["cpus"]]
    if model:
        argv += ["--model", model]
    if "colocated" in cfg:
        argv += ["--colocated", cfg["colocated"]]
    else:
        argv += ["--prefill", cfg["prefill"], "--decode", cfg["decode"],
                 f"--router-arg=--local-prefill-threshold={case.get('local_prefill_threshold', 512)}"]
    if traces:  # one step trace per instance ({i}: its index)
        argv += [f"--decode-arg=--step-trace={traces}-" + ("colocated" if "colocated" in cfg
                                                          else "decode") + "{i}.jsonl"]
        if "prefill" in cfg:
            argv += [f"--prefill-arg=--step-trace={traces}-prefill{{i}}.jsonl"]
    return argv


def replay_flags(case):
    """A trace case's replay, the same for tandem plan and tandem bench."""
    out = []
    if case.get("length_scale"):
        out += ["--trace-length-scale", str(case["length_scale"])]
    if case.get("trace_speed"):
        out += ["--trace-speed", str(case["trace_speed"])]
    return out


def real_run(case, trace, model, slo, workdir, k, trace_dir=None):
    traces = f"{trace_dir}/{case['name']}-{k}" if trace_dir else None
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    up = Up(up_argv(case, model, traces), workdir / f"{case['name']}-{k}.up.err")
    try:
        out = workdir / f"{case['name']}-{k}.bench.json"
        argv = [tandem(), "bench", "--url", up.url, "--trace", str(trace), "--no-progress",
                "--json", str(out), "--slo", plan.goodput_bounds(plan.parse_slo(slo)),
                "--seed", str(k + 1)]
        if case.get("num_requests"):
            argv += ["--num-prompts", str(case["num_requests"])]
        subprocess.run(argv + replay_flags(case), check=True, stdout=subprocess.DEVNULL)
        rep = json.loads(out.read_text())
        rep.pop("requests", None)
        rep["started"] = started
        return rep
    finally:
        up.stop()


def run_steps(case, prof, trace_dir, k, beside):
    """Each instance's steps in run k against its profile (stepcheck.py;
    prof: the profile's JSON): how much slower than the model it computed
    in all, the median and p99 of its steps' ratios, and the slow steps; a
    noisy run shows there."""
    out = {}
    for path in sorted(pathlib.Path(trace_dir).glob(f"{case['name']}-{k}-*.jsonl")):
        inst = path.stem[len(f"{case['name']}-{k}-"):]
        role = inst.rstrip("0123456789")
        try:
            c = stepcheck.check(prof, role, Trace(path), beside and role == "colocated")
            kinds = c["kinds"].values()
            out[inst] = {"model": "beside" if beside and role == "colocated" else "alone",
                         "in_all": sum(v["measured_s"] for v in kinds) /
                         max(1e-12, sum(v["model_s"] for v in kinds)),
                         "ratio_p50": c["ratio_quantiles"]["p50"],
                         "ratio_p99": c["ratio_quantiles"]["p99"],
                         "slow_share": c["slow_steps"]["share"],
                         "slow_excess_of_busy": c["slow_steps"]["excess_share_of_busy"]}
        except (TraceError, ValueError, KeyError) as e:  # a trace with no steps, a bad one
            out[inst] = {"error": str(e)}
    return out


def measured_runs(row, n_prompts):
    """The runs of an earlier result, as far as the comparison needs them."""
    n = len(row["goodput"]["measured"])
    runs = [{"num_prompts": n_prompts, "failed": 0} for _ in range(n)]
    for key, c in row["compare"].items():
        m, s = key.split("_")
        for r, v in zip(runs, c["measured"]):
            r.setdefault(f"{m}_ms", {})[s] = v
    for r, g, ok in zip(runs, row["goodput"]["measured"], row["measured_meets"]):
        r["good_fraction"] = g
        r["meets"] = ok
    return runs


def predict(case, spec, base, workdir, plan_args):
    """The simulator's prediction for a case (tandem plan --config; its
    JSON) and the trace its real runs replay (a workload description
    written out as the Mooncake trace the prediction simulated)."""
    wpath = base / case["workload"]
    trace = wpath
    pargv = [tandem(), "plan", "--profile", str(base / spec["profiles"][case["profile"]]),
             "--workload", str(wpath), "--config", case["config"], "--slo", spec["slo"],
             "--json", "--margin", "0",
             "--local-prefill-threshold", str(case.get("local_prefill_threshold", 512)),
             "--host-cores", str(spec.get("host_cores", 0)), *plan_args]
    if case.get("num_requests"):
        pargv += ["--num-requests", str(case["num_requests"])]
    pargv += replay_flags(case)
    if str(wpath).endswith(".json"):
        trace = workdir / f"{case['name']}.mooncake.jsonl"
        pargv += ["--write-trace", str(trace)]
    return json.loads(subprocess.run(pargv, check=True, capture_output=True,
                                     text=True).stdout), trace


def run_speed(steps):
    """How much slower than its profile the machine computed in one run:
    its instances' step time over the model's (their mean), or None."""
    v = [i["in_all"] for i in steps.values() if "in_all" in i]
    return statistics.mean(v) if v else None


def at_run_speed(case, spec, base, workdir, plan_args, row):
    """The prediction again for each run with the profile's step models
    scaled to the speed that run's steps show (a diagnostic, made after
    the runs: what is left of an error once the machine's speed in the run
    is known is the model's; the rest is the machine drifting from its
    profile). Per percentile: each run's error and their median."""
    prof = json.loads((base / spec["profiles"][case["profile"]]).read_text())
    speeds = [run_speed(r) for r in row["steps"]]
    out = {"speeds": speeds, "compare": {k: {"predicted": [], "errors": []}
                                         for k in row["compare"]}}
    for k, sp in enumerate(speeds):
        if sp is None:
            return None
        p = json.loads(json.dumps(prof))
        for r in p["roles"].values():
            for m in [r] + ([r["beside"]] if "beside" in r else []):
                m["step"] = {c: v * sp for c, v in m["step"].items()}
        path = workdir / f"{case['name']}-at-run-{k}.json"
        path.write_text(json.dumps(p))
        pred, _ = predict(case, {**spec, "profiles": {case["profile"]: str(path.resolve())}},
                          base, workdir, plan_args)
        res = pred["configs"][0]["result"]
        for key, c in out["compare"].items():
            m, q = key.split("_")
            c["predicted"].append(res[f"{m}_ms"][q])
            c["errors"].append(res[f"{m}_ms"][q] / row["compare"][key]["measured"][k] - 1)
    for c in out["compare"].values():
        c["error"] = statistics.median(c["errors"])
    return out


def compare(case, spec, base, pred, runs, trace_dir):
    """A case's result: each predicted percentile against the median and
    spread of its runs, goodput, the verdicts, and (with trace_dir) each
    run's steps against the profile."""
    prof = base / spec["profiles"][case["profile"]]
    cfg = pred["configs"][0]
    row = {"config": case["config"], "workload": case["workload"], "profile": str(prof),
           "predicted_meets": cfg["meets"], "compare": {}}
    n = runs[0]["num_prompts"]
    stats = STATS + ([("ttft", "p99"), ("tpot", "p99")] if n >= 1000 else [])
    for m, s in stats:
        meas = [r[f"{m}_ms"][s] for r in runs]
        med = statistics.median(meas)
        pv = cfg["result"][f"{m}_ms"][s]
        row["compare"][f"{m}_{s}"] = {
            "predicted": pv, "measured": meas, "measured_median": med,
            "error": (pv - med) / med if med else None,
            "spread": (max(meas) - min(meas)) / med if med else None}
    good = [r["good_fraction"] if "good_fraction" in r else r["good_requests"] / r["num_prompts"]
            for r in runs]
    row["goodput"] = {"predicted": cfg["goodput_fraction"], "measured": good}
    row["num_prompts"] = n
    slo = plan.parse_slo(spec["slo"])
    row["measured_meets"] = [r["meets"] if "meets" in r else
                             all(r[f"{k.split('_')[0]}_ms"][k.split("_")[1]] <= v
                                 for k, v in slo.items()) and r["failed"] == 0 for r in runs]
    row["utilisation"] = cfg["result"]["busy"]
    if all("started" in r for r in runs):
        row["started"] = [r["started"] for r in runs]
    if trace_dir:  # the runs' traces kept there (or left there by an earlier run)
        prof_json = json.loads(prof.read_text())
        row["steps"] = [run_steps(case, prof_json, trace_dir, k, cfg["neighbours_modelled"])
                        for k in range(len(runs))]
    if all("p99" in r.get("ttft_ms", {}) for r in runs):  # runs measured here, not reused
        row["measured_p99"] = {m: [r[f"{m}_ms"]["p99"] for r in runs] for m in ("ttft", "tpot")}
        row["predicted_p99"] = {m: cfg["result"][f"{m}_ms"]["p99"] for m in ("ttft", "tpot")}
    return row


def main(argv):
    p = argparse.ArgumentParser(prog="validate.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", help="run only the cases whose name contains this")
    p.add_argument("--model")
    p.add_argument("--step-traces", metavar="DIR",
                   help="keep every instance's step trace of every run here, and each run's "
                   "steps against the profile in the result (stepcheck.py; with --reuse, from "
                   "the traces an earlier run left here)")
    p.add_argument("--plan-arg", action="append", default=[], metavar="FLAG",
                   help="a flag for tandem plan's prediction, e.g. --plan-arg=--poll-interval-ms=0")
    p.add_argument("--at-run-speed", action="store_true",
                   help="with --step-traces: predict each run again at the speed its steps "
                   "show against the profile (model error apart from the machine's drift)")
    p.add_argument("--reuse", metavar="RESULTS.json",
                   help="take the measured runs from an earlier result (the same cases and "
                   "workloads) and predict again: for a changed profile or model")
    args = p.parse_args(argv)
    if args.at_run_speed and not args.step_traces:
        p.error("--at-run-speed needs --step-traces (the runs' steps give their speed)")
    stop_on_sigterm()
    if args.step_traces:
        pathlib.Path(args.step_traces).mkdir(parents=True, exist_ok=True)
    spec = json.loads(pathlib.Path(args.cases).read_text())
    base = pathlib.Path(args.cases).parent
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="tandem-validate-"))
    results = json.loads(pathlib.Path(args.out).read_text()) if os.path.exists(args.out) else {}
    reuse = json.loads(pathlib.Path(args.reuse).read_text()) if args.reuse else {}
    cases = [c for c in spec["cases"] if not args.only or args.only in c["name"]]
    preds, runs = {}, {}
    for case in cases:
        preds[case["name"]] = predict(case, spec, base, workdir, args.plan_arg)
        runs[case["name"]] = (measured_runs(reuse[case["name"]],
                                            preds[case["name"]][0]["workload"]["requests"])
                              if case["name"] in reuse else [])
    # Round k runs every case's k-th repeat: a case's repeats lie minutes
    # apart, so their spread samples how the machine's speed drifts over
    # the validation rather than three moments of the same state.
    for k in range(args.repeats):
        for case in cases:
            if len(runs[case["name"]]) > k:
                continue
            t0 = time.monotonic()
            runs[case["name"]].append(real_run(case, preds[case["name"]][1], args.model,
                                               spec["slo"], workdir, k, args.step_traces))
            sys.stderr.write(f"validate: {case['name']} run {k + 1}/{args.repeats} "
                             f"({time.monotonic() - t0:.0f} s)\n")
            results[case["name"]] = compare(case, spec, base, preds[case["name"]][0],
                                            runs[case["name"]], args.step_traces)
            pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    for case in cases:
        row = results[case["name"]] = compare(case, spec, base, preds[case["name"]][0],
                                              runs[case["name"]], args.step_traces)
        if args.at_run_speed and args.step_traces:
            row["at_run_speed"] = at_run_speed(case, spec, base, workdir, args.plan_arg, row)
        errs = ", ".join(f"{k} {v['error']:+.0%} (spread {v['spread']:.0%})"
                         for k, v in row["compare"].items() if v["error"] is not None)
        sys.stderr.write(f"validate: {case['name']}: {errs}\n")
    pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
