#!/usr/bin/env python3
"""tandem-router's performance evidence (docs/PERFORMANCE.md):
kv-aware routing against round-robin, and the latency the router adds.
Standard library only. Starts every process itself (ephemeral ports, a
cluster token, one thread per instance) and stops them all on the way out,
errors included. Processes, noise control and /metrics reading come from
pd_bench.py.

  tools/bench/router_perf.py policies --build BUILD [--model GGUF] [--reps 3]
        [--datasets shared-prefix,multi-turn] [--sp-* / --mt-* shape flags]
        [--slo ttft:MS,tpot:MS] [--save-dir DIR] [--json OUT]
  tools/bench/router_perf.py overhead --build BUILD [--model GGUF] [--n 300]
        [--json OUT]

policies: for every dataset and repeat, and for each policy (kv-aware,
  round-robin; the order alternates from one run to the next), a fresh
  cluster: --prefill tandem-prefill and --decode tandem-decode instances
  (--threads 1 each; every decode instance knows every prefill instance)
  behind a tandem-router --policy P. Once the router's /internal/v1/cluster
  shows every instance ready and every decode instance's
  /internal/v1/state shows all its transfer peers ready, one
  `tandem bench --url ROUTER --dataset D ... --seed S --json` runs (S =
  --seed + repeat: both policies get the same requests). Then every
  instance's /metrics is read (increase since the cluster became ready):
    hit rate            what the clients were told: the sum of the usage's
                        prompt_tokens_details.cached_tokens over the sum of
                        prompt_tokens (`tandem bench`'s prefix_cache_hit_rate):
                        prompt tokens nobody computed, whichever instance held
                        them (the headline figure)
    hit rate (prefill)  sum of vllm:prefix_cache_hits_total over the prefill
                        instances / sum of vllm:prefix_cache_queries_total
                        over them (prompt tokens whose KV was reused on the
                        prefill side; null when no prompt went to a prefill
                        instance)
    hit rate (all)      the same over every instance, prefill and decode (a
                        decode instance queries its cache for every prompt,
                        local or remote: it tells the prefill instance how
                        much of the prompt it holds already; so a remote
                        prompt counts twice, once on each side)
    hit rate (decode)   the same over the decode instances only
    router hit rate     the router's own view: tandem:router_prefix_hit_tokens
                        {role="prefill"} (the cached prompt tokens, as its index
                        saw them, at the instance that prefills: the prefill
                        instance, or the decode instance for local prefill) /
                        tandem:router_prompt_tokens; kv-aware only (the other
                        policies never look the prompt up)
  and the router's tandem:router_decisions_total by reason. Printed per
  dataset: the medians over the repeats, per policy, of both hit rates,
  TTFT P50 / P99, goodput at --slo, E2E P50, completed / failed; and the
  ratio kv-aware / round-robin.

  The default shapes: shared-prefix sends prompt i to group (i mod G), and
  multi-turn sends turn t of conversation c as request t*G + c. With G even
  and round-robin over two instances, group (conversation) g would always
  land on instance g mod 2, and round-robin would get kv-aware's affinity by
  accident; both default G (15) are odd, so round-robin alternates between
  the instances. With 3 prompts per group (45 of them), a shared prefix is
  reused twice: kv-aware can reuse it both times, round-robin only the
  third time (its first visit to each instance misses). With 3 turns per
  conversation, round-robin sends turn 2 back to turn 0's instance, so it
  reuses turn 0; kv-aware reuses turn 1 (more turns narrow the gap:
  round-robin always finds the history up to two turns back).

overhead: one tandem-prefill, one tandem-decode (--local-prefill-threshold
  high, so a request sent to it directly prefills locally, as the router
  asks it to for a short prompt) and a tandem-router in front. Sequential
  non-streaming /v1/completions (max_tokens 1, temperature 0, a new
  connection each), alternating direct-to-decode and via-router request by
  request (which goes first alternates too), --n of each, for (a) the prompt
  as token ids (no tokenization anywhere: the router's own cost) and (b)
  the same prompt as text (the router tokenizes instead of the decode
  instance; reported separately). P50 and P90 of each, and router - direct.
  The mean decision time is the router's tandem:router_decision_seconds
  sum / count.

Noise: the machines this runs on are shared. Before every run (policies) and
every --chunk of request pairs (overhead) the script waits until other
processes use less than --max-foreign of the CPUs over 2 s (at most
--quiet-timeout s), and records the share they used during the measurement
(pd_bench.py's "others' CPU"). --no-wait measures at once (tests).
"""
import argparse
import http.client
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import serve_bench  # noqa: E402  (percentiles as `tandem bench` computes them)
from pd_bench import (BenchError, Foreign, Proc, add_common_args, fmt, med,  # noqa: E402
                      on_sigterm, run_logged, wait_quiet)

TOKEN = "router-perf-token"
POLICIES = ("kv-aware", "round-robin")
HDR = {"X-Tandem-Cluster-Token": TOKEN}
SAMPLE_RE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
LABEL_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def labelled_metrics(proc):
    """[(name, {label: value}, float)] of proc's /metrics."""
    status, data = proc.request("GET", "/metrics")
    if status != 200:
        raise BenchError(f"{proc.name}: GET /metrics: {status}")
    out = []
    for ln in data.decode().splitlines():
        if not ln or ln.startswith("#"):
            continue
        m = SAMPLE_RE.match(ln)
        if not m:
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), dict(LABEL_RE.findall(m.group(2) or "")), v))
    return out


def msum(samples, name, **labels):
    return sum(v for n, ls, v in samples if n == name
               and all(ls.get(k) == x for k, x in labels.items()))


def ratio(a, b):
    return a / b if a is not None and b else None


# ---------------------------------------------------------------- cluster


class Cluster:
    """n_prefill tandem-prefill + n_decode tandem-decode behind a tandem-router."""

    def __init__(self, args, log_dir, tag, policy, n_prefill, n_decode, d_extra=(),
                 r_extra=()):
        self.procs, self.ps, self.ds = [], [], []
        b = args.build
        common = ["--model", args.model, "--port", "0", "--cluster-token", TOKEN, "--threads",
                  "1", "--ctx", args.ctx, *args.extra]
        try:
            for i in range(n_prefill):
                p = Proc(f"{tag}-prefill{i}", [b / "tandem-prefill", "--grpc-port", "-1", *common],
                         log_dir)
                self.procs.append(p)
                self.ps.append(p)
            plist = ",".join(f"127.0.0.1:{p.port}" for p in self.ps)
            for i in range(n_decode):
                # Every decode instance needs a gRPC port: the router talks to it there.
                d = Proc(f"{tag}-decode{i}",
                         [b / "tandem-decode", "--grpc-port", "0", *common, "--prefill", plist,
                          *d_extra, *args.d_extra], log_dir)
                self.procs.append(d)
                self.ds.append(d)
            self.router = Proc(f"{tag}-router",
                               [b / "tandem-router", "--model", args.model, "--port", "0",
                                "--grpc-port", "-1", "--cluster-token", TOKEN, "--prefill", plist,
                                "--decode", ",".join(f"127.0.0.1:{d.port}" for d in self.ds),
                                "--policy", policy, "--seed", args.seed, *r_extra,
                                *args.r_extra], log_dir)
            self.procs.append(self.router)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout=60):
        deadline = time.monotonic() + timeout
        want = {f"127.0.0.1:{p.port}" for p in self.ps + self.ds}
        while True:
            linked = all(
                (lambda peers: peers and all(pp.get("ready") for pp in peers))(
                    d.get_json("/internal/v1/state", HDR).get("transfer", {}).get("peers", []))
                for d in self.ds)
            view = self.router.get_json("/internal/v1/cluster", HDR)
            ready = {x["address"] for x in view.get("instances", []) if x.get("ready")}
            if linked and want <= ready:
                return
            for p in self.procs:
                if p.proc.poll() is not None:
                    raise BenchError(f"{p.name} exited with {p.proc.returncode}\n{p.log_tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"cluster not ready after {timeout} s: decode linked {linked}, "
                                 f"router sees ready {sorted(ready)} of {sorted(want)}\n"
                                 f"{self.router.log_tail()}")
            time.sleep(0.1)

    def pids(self):
        return [p.proc.pid for p in self.procs]

    def snapshot(self):
        return {p.name: labelled_metrics(p) for p in self.procs}

    def stop(self):
        for p in reversed(self.procs):
            p.stop()


# ---------------------------------------------------------------- policies


def bench_args(args, dataset):
    """`tandem bench` flags of the dataset's shape, as (flag, value) pairs."""
    if dataset == "shared-prefix":
        out = [("--prefix-len", args.sp_prefix_len), ("--input-len", args.sp_input_len),
               ("--output-len", args.sp_output_len), ("--num-groups", args.sp_num_groups),
               ("--num-prompts", args.sp_num_prompts)]
        rate, conc = args.sp_request_rate, args.sp_concurrency
    else:
        out = [("--input-len", args.mt_input_len), ("--output-len", args.mt_output_len),
               ("--num-groups", args.mt_num_groups), ("--num-prompts", args.mt_num_prompts)]
        rate, conc = args.mt_request_rate, args.mt_concurrency
    out.append(("--request-rate", rate) if rate is not None else ("--concurrency", conc))
    return out


def bench_flags(args, dataset):
    return [str(x) for pair in bench_args(args, dataset) for x in pair]


def one_run(args, log_dir, save_dir, dataset, policy, rep):
    tag = f"{dataset}-{policy}-{rep}"
    cl = Cluster(args, log_dir, tag, policy, args.prefill, args.decode)
    try:
        wait_quiet(cl.pids(), args.max_foreign, args.quiet_timeout, args.quiet)
        before = cl.snapshot()
        out = save_dir / f"router-{tag}.json"
        cmd = [str(args.build / "tandem"), "bench", "--url", cl.router.url, "--dataset", dataset,
               *bench_flags(args, dataset), "--seed", str(args.seed + rep),
               "--slo", args.slo, "--timeout", "600", "--no-progress", "--json", str(out)]
        env = dict(os.environ, TANDEM_SOURCE_DIR=str(HERE.parent.parent))
        fg = Foreign(cl.pids())
        fg.start()
        with open(log_dir / f"bench-{tag}.out", "wb") as fo:
            p = subprocess.Popen(cmd, stdout=fo, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
            try:
                rc = p.wait(timeout=3600)
            finally:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        foreign = fg.stop()
        if rc != 0:
            raise BenchError(f"tandem bench exited {rc}: see {log_dir}/bench-{tag}.out")
        after = cl.snapshot()
    finally:
        cl.stop()
    with open(out) as f:
        rep_json = json.load(f)

    def delta(names, metric, **labels):
        return sum(msum(after[n], metric, **labels) - msum(before[n], metric, **labels)
                   for n in names)

    pn = [p.name for p in cl.ps]
    alln = pn + [d.name for d in cl.ds]
    q_p = delta(pn, "vllm:prefix_cache_queries_total")
    h_p = delta(pn, "vllm:prefix_cache_hits_total")
    q_a = delta(alln, "vllm:prefix_cache_queries_total")
    h_a = delta(alln, "vllm:prefix_cache_hits_total")
    rn = [cl.router.name]
    decisions = {}
    for n, ls, v in after[cl.router.name]:
        if n == "tandem:router_decisions_total" and ls.get("policy") == policy:
            decisions[ls.get("reason", "")] = v - msum(before[cl.router.name], n, **ls)
    per_inst = {n: {"queries": delta([n], "vllm:prefix_cache_queries_total"),
                    "hits": delta([n], "vllm:prefix_cache_hits_total")} for n in alln}
    row = {
        # What the clients were told: usage.prompt_tokens_details.cached_tokens
        # over prompt tokens (cached on the instance that prefilled, or on the
        # decode instance: tokens nobody computed).
        "hit_rate": rep_json.get("prefix_cache_hit_rate"),
        "hit_rate_prefill": ratio(h_p, q_p),
        "hit_rate_all": ratio(h_a, q_a),
        "hit_rate_decode": ratio(h_a - h_p, q_a - q_p),
        # Only kv-aware looks the prompt up in the router's index.
        "router_hit_rate": ratio(delta(rn, "tandem:router_prefix_hit_tokens_total",
                                       role="prefill"),
                                 delta(rn, "tandem:router_prompt_tokens_total"))
        if policy == "kv-aware" else None,
        "ttft_p50_ms": rep_json["ttft_ms"]["p50"],
        "ttft_p99_ms": rep_json["ttft_ms"]["p99"],
        "goodput": rep_json["goodput"],
        "e2e_p50_ms": rep_json["e2e_ms"]["p50"],
        "tpot_p50_ms": rep_json["tpot_ms"]["p50"],
        "completed": rep_json["completed"],
        "failed": rep_json["failed"],
        "duration_s": rep_json["duration_s"],
        "foreign_cpu": foreign,
        "prefix_cache_queries_prefill": q_p,
        "prefix_cache_hits_prefill": h_p,
        "prefix_cache_queries_all": q_a,
        "prefix_cache_hits_all": h_a,
        "per_instance": per_inst,
        "decisions": decisions,
        "retries": delta(rn, "tandem:router_retries_total"),
    }
    return row, {"servers": [" ".join(p.argv) for p in cl.procs], "bench": " ".join(cmd)}


SUMMARY_KEYS = ("hit_rate", "hit_rate_prefill", "hit_rate_all", "hit_rate_decode", "router_hit_rate",
                "ttft_p50_ms", "ttft_p99_ms", "goodput", "e2e_p50_ms", "tpot_p50_ms", "completed", "failed",
                "duration_s", "foreign_cpu")


def cmd_policies(args, log_dir):
    save_dir = pathlib.Path(args.save_dir) if args.save_dir else log_dir
    save_dir.mkdir(parents=True, exist_ok=True)
    out = {"mode": "policies", "model": str(args.model), "reps": args.reps, "slo": args.slo,
           "instances": {"prefill": args.prefill, "decode": args.decode, "threads_each": 1},
           "datasets": {}}
    k = 0
    for dataset in args.datasets:
        runs = {p: [] for p in POLICIES}
        commands = {}
        for rep in range(args.reps):
            for policy in (POLICIES if k % 2 == 0 else POLICIES[::-1]):
                row, cmds = one_run(args, log_dir, save_dir, dataset, policy, rep)
                runs[policy].append(row)
                commands[policy] = cmds
                if not args.quiet:
                    sys.stderr.write(
                        f"{dataset} rep {rep} {policy}: hit rate {fmt(row['hit_rate'])} (all "
                        f"instances' counters {fmt(row['hit_rate_all'])}, "
                        f"prefill {fmt(row['hit_rate_prefill'])}), TTFT P50 "
                        f"{fmt(row['ttft_p50_ms'])} P99 {fmt(row['ttft_p99_ms'])} ms, "
                        f"{row['completed']} done {row['failed']} failed, decisions "
                        f"{row['decisions']}, others used {100 * row['foreign_cpu']:.0f}% of "
                        "the CPUs\n")
            k += 1
        medians = {p: {key: med([r[key] for r in runs[p]]) for key in SUMMARY_KEYS}
                   for p in POLICIES}
        for p in POLICIES:
            medians[p]["decisions"] = {
                reason: med([r["decisions"].get(reason, 0) for r in runs[p]])
                for reason in sorted({x for r in runs[p] for x in r["decisions"]})}
        ratios = {key: ratio(medians["kv-aware"][key], medians["round-robin"][key])
                  for key in SUMMARY_KEYS if key not in ("completed", "failed", "foreign_cpu")}
        out["datasets"][dataset] = {
            "shape": {k.lstrip("-"): v for k, v in bench_args(args, dataset)}, "runs": runs,
            "medians": medians, "ratios": ratios, "commands": commands}
        print(f"{dataset} ({' '.join(bench_flags(args, dataset))}); "
              f"{args.prefill}P+{args.decode}D, one thread each; medians of {args.reps} "
              f"repeats; SLO {args.slo}")
        print("| figure | kv-aware | round-robin | kv-aware / round-robin |")
        print("|---|---:|---:|---:|")
        for key in SUMMARY_KEYS:
            a, b = medians["kv-aware"][key], medians["round-robin"][key]
            r = ratios.get(key)
            print(f"| {key} | {fmt(a)} | {fmt(b)} | {'-' if r is None else f'{r:.2f}'} |")
        for p in POLICIES:
            print(f"decisions ({p}): " + ", ".join(
                f"{reason} {v:g}" for reason, v in medians[p]["decisions"].items()))
        print()
    return out


# ---------------------------------------------------------------- overhead


def timed_completion(proc, prompt, timeout=60):
    """One non-streaming /v1/completions on a new connection; its wall time in ms."""
    body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    conn = http.client.HTTPConnection(proc.host, proc.port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    ms = (time.perf_counter() - t0) * 1e3
    if r.status != 200:
        raise BenchError(f"{proc.name}: HTTP {r.status}: {data[:300]!r}")
    usage = json.loads(data).get("usage") or {}
    if usage.get("completion_tokens") != 1:
        raise BenchError(f"{proc.name}: usage {usage}, want one completion token")
    return ms


def pstats(vals):
    v = sorted(vals)
    return {"n": len(v), "p50_ms": serve_bench.percentile(v, 50),
            "p90_ms": serve_bench.percentile(v, 90), "mean_ms": statistics.fmean(v)}


def cmd_overhead(args, log_dir):
    # D prefills a short prompt locally whether it comes from the router
    # (local_short) or directly (its own threshold): the same work both ways.
    cl = Cluster(args, log_dir, "overhead", "kv-aware", 1, 1,
                 d_extra=["--local-prefill-threshold", "1000000"])
    try:
        d, rt = cl.ds[0], cl.router
        status, data = d.request("POST", "/tokenize", json.dumps({"prompt": args.prompt}).encode(),
                                 {"Content-Type": "application/json"})
        if status != 200:
            raise BenchError(f"/tokenize: {status} {data[:200]!r}")
        ids = json.loads(data)["tokens"]
        prompts = {"ids": ids, "text": args.prompt}
        for _ in range(args.warmup):
            for kind in prompts:
                for target in (d, rt):
                    timed_completion(target, prompts[kind])
        before = labelled_metrics(rt)
        times = {kind: {"direct": [], "router": []} for kind in prompts}
        foreign = []
        i = 0
        while i < args.n:
            wait_quiet(cl.pids(), args.max_foreign, args.quiet_timeout, args.quiet)
            fg = Foreign(cl.pids())
            fg.start()
            for _ in range(min(args.chunk, args.n - i)):
                for kind in prompts:
                    order = (("direct", d), ("router", rt))
                    for name, target in (order if i % 2 == 0 else order[::-1]):
                        times[kind][name].append(timed_completion(target, prompts[kind]))
                i += 1
            foreign.append(fg.stop())
        after = labelled_metrics(rt)
    finally:
        cl.stop()
    n_dec = (msum(after, "tandem:router_decision_seconds_count")
             - msum(before, "tandem:router_decision_seconds_count"))
    s_dec = (msum(after, "tandem:router_decision_seconds_sum")
             - msum(before, "tandem:router_decision_seconds_sum"))
    decisions = {ls.get("reason", ""): v - msum(before, n, **ls) for n, ls, v in after
                 if n == "tandem:router_decisions_total" and v - msum(before, n, **ls) > 0}
    out = {"mode": "overhead", "model": str(args.model), "n": args.n, "prompt": args.prompt,
           "prompt_tokens": len(ids), "foreign_cpu_max": max(foreign) if foreign else None,
           "decision_count": n_dec, "decision_mean_us": s_dec / n_dec * 1e6 if n_dec else None,
           "decisions": decisions, "commands": [" ".join(p.argv) for p in cl.procs]}
    print(f"router overhead: sequential /v1/completions, max_tokens 1, prompt "
          f"{len(ids)} tokens, {args.n} requests each way, alternating")
    print("| prompt | direct P50 ms | router P50 ms | added P50 ms | direct P90 ms | "
          "router P90 ms | added P90 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in prompts:
        dr, ro = pstats(times[kind]["direct"]), pstats(times[kind]["router"])
        out[kind] = {"direct": dr, "router": ro,
                     "added_p50_ms": ro["p50_ms"] - dr["p50_ms"],
                     "added_p90_ms": ro["p90_ms"] - dr["p90_ms"],
                     "samples_ms": times[kind]}
        print(f"| {'token ids' if kind == 'ids' else 'text'} | {dr['p50_ms']:.3f} | "
              f"{ro['p50_ms']:.3f} | {out[kind]['added_p50_ms']:.3f} | {dr['p90_ms']:.3f} | "
              f"{ro['p90_ms']:.3f} | {out[kind]['added_p90_ms']:.3f} |")
    print(f"mean decision time {fmt(out['decision_mean_us'])} us over {n_dec:g} decisions "
          f"({', '.join(f'{k} {v:g}' for k, v in decisions.items())}); others used at most "
          f"{100 * (out['foreign_cpu_max'] or 0):.0f}% of the CPUs")
    return out


# ---------------------------------------------------------------- main


def main(argv):
    signal.signal(signal.SIGTERM, on_sigterm)
    ap = argparse.ArgumentParser(prog="router_perf.py", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("policies", "overhead"):
        sp = sub.add_parser(name)
        add_common_args(sp, "tandem, tandem-prefill, tandem-decode, tandem-router", "instance")
        sp.add_argument("--extra", action="append", default=[],
                        help="one more argument for every prefill and decode instance "
                        "(repeatable; --extra=--flag for a flag)")
        sp.add_argument("--d-extra", action="append", default=[],
                        help="one more argument for the decode instances only (repeatable)")
        sp.add_argument("--r-extra", action="append", default=[],
                        help="one more argument for tandem-router (repeatable)")
        if name == "policies":
            sp.add_argument("--reps", type=int, default=3, help="repeats per policy (3)")
            sp.add_argument("--datasets", default="shared-prefix,multi-turn")
            sp.add_argument("--prefill", type=int, default=2, help="prefill instances (2)")
            sp.add_argument("--decode", type=int, default=2, help="decode instances (2)")
            sp.add_argument("--sp-prefix-len", type=int, default=512)
            sp.add_argument("--sp-input-len", type=int, default=64)
            sp.add_argument("--sp-output-len", type=int, default=32)
            sp.add_argument("--sp-num-groups", type=int, default=15,
                            help="shared-prefix groups (15; odd, see above)")
            sp.add_argument("--sp-num-prompts", type=int, default=45)
            sp.add_argument("--sp-concurrency", type=int, default=4)
            sp.add_argument("--sp-request-rate", type=float,
                            help="Poisson arrivals per second instead of --sp-concurrency")
            sp.add_argument("--mt-input-len", type=int, default=64)
            sp.add_argument("--mt-output-len", type=int, default=32)
            sp.add_argument("--mt-num-groups", type=int, default=15,
                            help="multi-turn conversations (15; odd, see above)")
            sp.add_argument("--mt-num-prompts", type=int, default=45)
            sp.add_argument("--mt-concurrency", type=int, default=4)
            sp.add_argument("--mt-request-rate", type=float,
                            help="Poisson arrivals per second instead of --mt-concurrency")
            sp.add_argument("--slo", default="ttft:2000,tpot:100",
                            help="goodput bounds, as `tandem bench --slo` (ttft:2000,tpot:100)")
            sp.add_argument("--save-dir", help="keep every `tandem bench` JSON here")
        else:
            sp.add_argument("--n", type=int, default=300, help="requests each way (300)")
            sp.add_argument("--warmup", type=int, default=5)
            sp.add_argument("--chunk", type=int, default=50,
                            help="request pairs between two waits for a quiet machine (50)")
            sp.add_argument("--prompt", default="The capital of France is",
                            help="the short prompt")
    args = ap.parse_args(argv)
    args.build = args.build.resolve()
    for b in ("tandem", "tandem-prefill", "tandem-decode", "tandem-router"):
        if not (args.build / b).exists():
            ap.error(f"{args.build / b} not found")
    if not args.model.exists():
        ap.error(f"model {args.model} not found")
    if args.cmd == "policies":
        args.datasets = [d for d in args.datasets.split(",") if d]
        for d in args.datasets:
            if d not in ("shared-prefix", "multi-turn"):
                ap.error(f"--datasets: {d} is not shared-prefix or multi-turn")
        if args.reps < 1:
            ap.error("--reps must be at least 1")
    elif args.n < 1:
        ap.error("--n must be at least 1")
    return run_logged(args, "router_perf",
                      cmd_policies if args.cmd == "policies" else cmd_overhead)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
