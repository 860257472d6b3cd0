#!/usr/bin/env python3
"""Disaggregated prefill/decode against colocated serving (measurements (b)
and (c) of docs/PERFORMANCE.md). Standard library only.
Starts every process itself (ephemeral ports, cluster token, one thread per
P and D instance) and stops them all on the way out, errors included.

  tools/bench/pd_bench.py tail  --build BUILD [--model GGUF] [--prompt-len 2048]
        [--reps 5] [--max-tokens 2] [--serve-threads 1,2] [--json OUT]
  tools/bench/pd_bench.py mixed --build BUILD [--model GGUF] [--long-len 2048]
        [--long-rate 0.1] [--long-num 8] [--long-out 16] [--streams 8]
        [--stream-len 64] [--stream-out 256] [--stream-num 64] [--repeats 2]
        [--slo-tpot MS] [--slo-ttft-stream MS] [--slo-ttft-long MS]
        [--save-dir DIR] [--json OUT]

tail: the exposed transfer tail and TTFT for one prompt of --prompt-len
  tokens. Four setups run side by side: P+D with layer-wise streaming (the
  default), P+D with `tandem-prefill --no-layerwise`, and `tandem serve` at
  each of --serve-threads. After one warm-up request each, every round sends
  one request to each setup in turn (one request in flight at a time, so
  the setups never compete), each with a prompt of its own (random words,
  fitted to the length with the server's /tokenize), so neither side's
  prefix cache ever hits. TTFT is the client's time from sending the
  streaming request to the first text chunk. The tail is D's
  tandem:kv_transfer_tail_seconds (PrefillDone's arrival at D minus the end
  of P's last layer; one host, one clock) read from D's /metrics before and
  after each request: the sum's increase over the count's (which must be 1).
  Medians over the rounds.

mixed: two request classes at once, each driven by its own `tandem bench`
  process (--dataset FILE, ignore_eos, --json), against one colocated
  `tandem serve --threads 2`, then against tandem-prefill + tandem-decode at
  one thread each (the same total threads), the order alternating over
  --repeats: long prompts (--long-len tokens, --long-out output tokens,
  Poisson at --long-rate per second, --long-num of them) and --streams
  concurrent streams (--stream-len-token prompts, --stream-out output
  tokens, --stream-num in all). Both classes use the same prompt files for
  both setups (random words fitted with /tokenize, all different, so no
  prefix is shared). Prints, per setup, the medians over the repeats of the
  streams' TPOT P50/P99 and ITL P99, the TTFT of both classes and each
  class's goodput (`tandem bench`'s: requests meeting the class's --slo-*
  bounds per second of that class's run), and the ratio disaggregated /
  colocated. Every prefill goes to P (tandem-decode's default
  --local-prefill-threshold 0); --d-extra passes flags to D only. --save-dir keeps every `tandem bench` JSON
  (pd-mixed-<setup>-<class>-<repeat>.json; --compact leaves out the
  per-request ITL lists).

Noise: the machines this runs on are shared. Before every measured request
(tail) and every run (mixed) the script waits until other processes use
less than --max-foreign of the CPUs over 2 s (at most --quiet-timeout s),
and records the share they used during the measurement ("others' CPU": the
machine's busy time from /proc/stat, steal included, minus the CPU time of
this script's own processes). tail redoes a request during which others
used more than --max-foreign (up to --retries times, each with a fresh
prompt). --no-wait measures at once (tests).
"""
import argparse
import http.client
import json
import os
import pathlib
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import serve_bench  # noqa: E402  (the same words and prompt fitting as `tandem bench`)

TOKEN = "pd-bench-token"
READY_RE = re.compile(
    r"^(?:tandem serve|tandem-prefill|tandem-decode|tandem-router): listening http=(\S+) "
    r"grpc=(\S+)\s*$")
DEFAULT_MODEL = (pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
                 / "tandem" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")


class BenchError(Exception):
    pass


# ---------------------------------------------------------------- processes


class Proc:
    """One server process, started with --port 0 and parsed from its ready line."""

    def __init__(self, name, argv, log_dir, env=None, ready_timeout=120):
        self.name, self.argv = name, [str(a) for a in argv]
        self.out = pathlib.Path(log_dir) / f"{name}.out"
        self.err = pathlib.Path(log_dir) / f"{name}.err"
        full_env = dict(os.environ)
        full_env.update(env or {})
        with open(self.out, "wb") as fo, open(self.err, "wb") as fe:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=fo,
                                         stderr=fe, env=full_env, start_new_session=True)
        self.host = self.port = None
        deadline = time.monotonic() + ready_timeout
        while self.port is None:
            with open(self.out, errors="replace") as f:
                for ln in f:
                    m = READY_RE.match(ln.strip())
                    if m:
                        host, port = m.group(1).rsplit(":", 1)
                        self.host, self.port = host.strip("[]"), int(port)
                        break
            if self.port is not None:
                break
            if self.proc.poll() is not None:
                raise BenchError(f"{name} exited with {self.proc.returncode} before ready\n"
                                 f"$ {' '.join(self.argv)}\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"{name} not ready after {ready_timeout} s\n{self.log_tail()}")
            time.sleep(0.05)
        self.url = f"http://{self.host}:{self.port}"

    def log_tail(self, n=3000):
        try:
            return self.err.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def request(self, method, path, body=None, headers=None, timeout=60):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def get_json(self, path, headers=None):
        status, data = self.request("GET", path, headers=headers)
        if status != 200:
            raise BenchError(f"{self.name}: GET {path}: {status} {data[:200]!r}")
        return json.loads(data)

    def metrics(self):
        status, data = self.request("GET", "/metrics")
        if status != 200:
            raise BenchError(f"{self.name}: GET /metrics: {status}")
        out = {}
        for ln in data.decode().splitlines():
            if not ln or ln.startswith("#"):
                continue
            m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)", ln)
            if not m:
                continue
            try:  # summed over the labels
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
            except ValueError:
                continue
        return out

    def stop(self):
        p = self.proc
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            if p.poll() is not None:
                return
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                return
            try:
                p.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass


class Setup:
    """A named target: one `tandem serve`, or a tandem-prefill + tandem-decode pair."""

    def __init__(self, name, procs, front, pair):
        self.name, self.procs, self.front, self.pair = name, procs, front, pair

    def stop(self):
        for p in reversed(self.procs):
            p.stop()


def start_serve(args, log_dir, threads, name):
    p = Proc(name, [args.build / "tandem", "serve", "--model", args.model, "--port", "0",
                    "--grpc-port", "-1", "--threads", threads, "--ctx", args.ctx,
                    *args.extra], log_dir)
    return Setup(name, [p], p, False)


def start_pair(args, log_dir, name, layerwise=True):
    procs = []
    try:
        pa = [args.build / "tandem-prefill", "--model", args.model, "--port", "0",
              "--grpc-port", "-1", "--cluster-token", TOKEN, "--threads", "1", "--ctx", args.ctx]
        if not layerwise:
            pa.append("--no-layerwise")
        p = Proc(name + "-prefill", pa + list(args.extra), log_dir)
        procs.append(p)
        d = Proc(name + "-decode",
                 [args.build / "tandem-decode", "--model", args.model, "--port", "0",
                  "--grpc-port", "-1", "--prefill", f"127.0.0.1:{p.port}", "--cluster-token",
                  TOKEN, "--threads", "1", "--ctx", args.ctx, *args.extra, *args.d_extra],
                 log_dir)
        procs.append(d)
        deadline = time.monotonic() + 60
        hdr = {"X-Tandem-Cluster-Token": TOKEN}
        while True:
            peers = d.get_json("/internal/v1/state", hdr).get("transfer", {}).get("peers", [])
            if peers and all(pp.get("ready") for pp in peers):
                break
            if time.monotonic() > deadline:
                raise BenchError(f"{name}: decode not linked to prefill after 60 s\n"
                                 f"{d.log_tail()}")
            time.sleep(0.1)
    except BaseException:
        for pr in reversed(procs):
            pr.stop()
        raise
    return Setup(name, procs, d, True)


# ---------------------------------------------------------------- noise


HZ = os.sysconf("SC_CLK_TCK")
NCPU = os.cpu_count() or 1


def cpu_jiffies(pids):
    """(busy jiffies of the whole machine, steal included; jiffies of pids and
    of this script)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
    own = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            own += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    t = os.times()
    own += int((t.user + t.system + t.children_user + t.children_system) * HZ)
    return busy, own


class Foreign:
    """Share of the machine's CPUs used by anything but our own processes
    (other users' jobs, the hypervisor's steal) between start() and stop()."""

    def __init__(self, pids):
        self.pids = list(pids)

    def start(self):
        self.t0, (self.b0, self.o0) = time.monotonic(), cpu_jiffies(self.pids)

    def stop(self):
        dt = time.monotonic() - self.t0
        b1, o1 = cpu_jiffies(self.pids)
        return max(0.0, ((b1 - self.b0) - (o1 - self.o0)) / (HZ * NCPU * max(dt, 1e-3)))


def wait_quiet(pids, limit, timeout, quiet=False):
    """Waits until others use less than `limit` of the CPUs over 2 s (or
    timeout s); returns the seconds waited."""
    t0 = time.monotonic()
    if limit is None:
        return 0.0
    fg = Foreign(pids)
    told = False
    while True:
        fg.start()
        time.sleep(2.0)
        f = fg.stop()
        if f < limit or time.monotonic() - t0 > timeout:
            return time.monotonic() - t0
        if not quiet and not told:
            sys.stderr.write(f"waiting for a quiet machine (others use {100 * f:.0f}% of the "
                             "CPUs)\n")
            told = True


# ---------------------------------------------------------------- prompts


def make_prompts(server_url, n, length, seed):
    """n different prompts of `length` tokens (the server's /tokenize)."""
    srv = serve_bench.Server(server_url, None, 120.0)
    status, obj = srv.call("GET", "/v1/models")
    model = obj["data"][0]["id"]
    counter = serve_bench.TokenCounter(srv, model)
    if counter.style is None:
        raise BenchError(f"{server_url} has no usable /tokenize")
    notes = set()
    rng = random.Random(seed)
    out = [serve_bench.fit_prompt(random.Random(rng.getrandbits(64)), length, counter, notes)
           for _ in range(n)]
    if notes:
        raise BenchError("prompt fitting: " + "; ".join(sorted(notes)))
    return out


# ---------------------------------------------------------------- tail


def one_request(front, prompt, max_tokens, timeout=600):
    """Streams one completion; returns (ttft_ms, e2e_ms, prompt_tokens, output_tokens)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True},
                       "ignore_eos": True, "min_tokens": max_tokens}).encode()
    conn = http.client.HTTPConnection(front.host, front.port, timeout=timeout)
    t0 = time.perf_counter()
    t_first = None
    usage = None
    done = False
    try:
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise BenchError(f"{front.name}: HTTP {resp.status}: {resp.read(500)!r}")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            obj = json.loads(payload)
            if obj.get("error") is not None:
                raise BenchError(f"{front.name}: stream error {obj['error']}")
            if isinstance(obj.get("usage"), dict):
                usage = obj["usage"]
            if t_first is None and any(ch.get("text") for ch in obj.get("choices") or []):
                t_first = time.perf_counter()
    finally:
        conn.close()
    t_end = time.perf_counter()
    if not done or usage is None:
        raise BenchError(f"{front.name}: stream ended without usage / [DONE]")
    if t_first is None:
        t_first = t_end
    return ((t_first - t0) * 1e3, (t_end - t0) * 1e3, usage.get("prompt_tokens"),
            usage.get("completion_tokens"))


def tail_request(setup, prompt, max_tokens):
    before = setup.front.metrics() if setup.pair else None
    ttft, e2e, ptok, otok = one_request(setup.front, prompt, max_tokens)
    rec = {"ttft_ms": ttft, "e2e_ms": e2e, "prompt_tokens": ptok, "output_tokens": otok,
           "tail_ms": None, "transfer_ms": None}
    if setup.pair:
        after = setup.front.metrics()

        def delta(name):
            return after.get(name, 0.0) - before.get(name, 0.0)

        n = delta("tandem:kv_transfer_tail_seconds_count")
        if n != 1:
            raise BenchError(f"{setup.name}: tandem:kv_transfer_tail_seconds_count rose by {n:g} "
                             "for one request (expected 1)")
        rec["tail_ms"] = delta("tandem:kv_transfer_tail_seconds_sum") * 1e3
        if delta("tandem:kv_transfer_seconds_count") == 1:
            rec["transfer_ms"] = delta("tandem:kv_transfer_seconds_sum") * 1e3
        if delta("tandem:remote_prefill_total") != 1:
            raise BenchError(f"{setup.name}: the request was not prefilled remotely")
    return rec


def med(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def cmd_tail(args, log_dir):
    setups = []
    try:
        setups.append(start_pair(args, log_dir, "pd-layerwise", layerwise=True))
        setups.append(start_pair(args, log_dir, "pd-no-layerwise", layerwise=False))
        for t in args.serve_threads:
            setups.append(start_serve(args, log_dir, t, f"serve-t{t}"))
        pids = [p.proc.pid for st in setups for p in st.procs]
        n = len(setups) * (args.reps + 1)
        prompts = make_prompts(setups[-1].front.url, n, args.prompt_len, args.seed)
        spare_seed = args.seed + 1000
        records = {s.name: [] for s in setups}
        discarded = {s.name: 0 for s in setups}
        k = 0
        fg = Foreign(pids)
        for rnd in range(args.reps + 1):  # round 0 is the warm-up
            for s in setups:
                prompt = prompts[k]
                k += 1
                for attempt in range(args.retries + 1):
                    wait_quiet(pids, args.max_foreign, args.quiet_timeout, args.quiet)
                    fg.start()
                    rec = tail_request(s, prompt, args.max_tokens)
                    rec["foreign_cpu"] = fg.stop()
                    rec["round"] = rnd
                    noisy = args.max_foreign is not None and rec["foreign_cpu"] >= args.max_foreign
                    if not args.quiet:
                        tail = "" if rec["tail_ms"] is None else f" tail {rec['tail_ms']:.2f} ms"
                        sys.stderr.write(
                            f"round {rnd}{' (warm-up)' if rnd == 0 else ''} {s.name}: "
                            f"TTFT {rec['ttft_ms']:.1f} ms{tail}, others used "
                            f"{100 * rec['foreign_cpu']:.0f}% of the CPUs"
                            f"{' (discarded)' if noisy and attempt < args.retries else ''}\n")
                    if not noisy or attempt == args.retries:
                        break
                    discarded[s.name] += 1
                    # a fresh prompt: the discarded one is now in both prefix caches
                    spare_seed += 1
                    prompt = make_prompts(s.front.url, 1, args.prompt_len, spare_seed)[0]
                if rnd > 0:
                    records[s.name].append(rec)
    finally:
        for s in setups:
            s.stop()
    rows = []
    for s in setups:
        recs = records[s.name]
        rows.append({
            "setup": s.name,
            "threads": "P 1 + D 1" if s.pair else s.name.split("-t")[1],
            "layerwise": (s.name == "pd-layerwise") if s.pair else None,
            "prompt_tokens": med([r["prompt_tokens"] for r in recs]),
            "ttft_ms": med([r["ttft_ms"] for r in recs]),
            "tail_ms": med([r["tail_ms"] for r in recs]),
            "transfer_ms": med([r["transfer_ms"] for r in recs]),
            "foreign_cpu_max": max(r["foreign_cpu"] for r in recs),
            "discarded_noisy": discarded[s.name],
            "requests": recs,
        })
    ref = rows[0]["ttft_ms"]
    print(f"prompt {args.prompt_len} tokens (+BOS), max_tokens {args.max_tokens}, "
          f"medians of {args.reps} rounds, distinct prompts (no prefix hits)")
    print("| setup | threads | TTFT ms | TTFT vs P+D layer-wise | tail ms (D's "
          "kv_transfer_tail) | D's kv_transfer_seconds ms | others' CPU max | redone |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['setup']} | {r['threads']} | {r['ttft_ms']:.1f} | "
              f"{r['ttft_ms'] / ref:.2f} | "
              f"{'-' if r['tail_ms'] is None else format(r['tail_ms'], '.2f')} | "
              f"{'-' if r['transfer_ms'] is None else format(r['transfer_ms'], '.1f')} | "
              f"{100 * r['foreign_cpu_max']:.0f}% | {r['discarded_noisy']} |")
    return {"mode": "tail", "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "reps": args.reps, "model": str(args.model), "rows": rows}


# ---------------------------------------------------------------- mixed


def write_jsonl(path, prompts, out_len):
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p, "output_len": out_len}) + "\n")


def run_classes(args, setup, files, tag, save_dir, log_dir):
    """Both `tandem bench` processes at once against setup; their JSON reports."""
    env = dict(os.environ, TANDEM_SOURCE_DIR=str(HERE.parent.parent))
    common = [str(args.build / "tandem"), "bench", "--url", setup.front.url, "--ignore-eos",
              "--no-progress", "--timeout", "600"]
    slo_s = f"tpot:{args.slo_tpot:g},ttft:{args.slo_ttft_stream:g}"
    slo_l = f"ttft:{args.slo_ttft_long:g}"
    outs = {c: save_dir / f"pd-mixed-{setup.name}-{c}-{tag}.json" for c in ("long", "streams")}
    cmds = {
        "long": common + ["--dataset", str(files["long"]), "--request-rate", f"{args.long_rate:g}",
                          "--seed", str(args.seed), "--slo", slo_l, "--json", str(outs["long"])],
        "streams": common + ["--dataset", str(files["streams"]), "--concurrency",
                             str(args.streams), "--slo", slo_s, "--json", str(outs["streams"])],
    }
    procs = {}
    try:
        for c in ("long", "streams"):
            procs[c] = subprocess.Popen(cmds[c], stdout=open(log_dir / f"bench-{setup.name}-{c}-{tag}"
                                                             ".out", "wb"),
                                        stderr=subprocess.STDOUT, env=env, start_new_session=True)
        for c, p in procs.items():
            if p.wait(timeout=3600) != 0:
                raise BenchError(f"tandem bench ({c}) exited {p.returncode}: see "
                                 f"{log_dir}/bench-{setup.name}-{c}-{tag}.out")
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    reps = {}
    for c in ("long", "streams"):
        with open(outs[c]) as f:
            reps[c] = json.load(f)
        if args.compact:
            with open(outs[c], "w", encoding="utf-8") as f:
                json.dump(compact(reps[c]), f, indent=1)
                f.write("\n")
        if reps[c]["failed"]:
            raise BenchError(f"{setup.name} {c}: {reps[c]['failed']} failed requests: "
                             f"{reps[c]['errors']}")
    return reps, {c: " ".join(cmds[c]) for c in cmds}


def compact(rep):
    """A `tandem bench` report without the per-request ITL lists (every
    summary, and every request's TTFT, TPOT and E2E, stay)."""
    out = dict(rep)
    out["requests"] = [{k: v for k, v in r.items() if k != "itl_ms"} for r in rep["requests"]]
    return out


def summarize(reps):
    s, lg = reps["streams"], reps["long"]
    t_end = s["duration_s"]
    # The long class must cover the streams' run, or the streams' tail ran alone.
    long_starts = [r["start_s"] for r in lg["requests"]]
    covered = max(long_starts) >= 0.8 * t_end if long_starts else False
    return {
        "streams_tpot_p50_ms": s["tpot_ms"]["p50"],
        "streams_tpot_p99_ms": s["tpot_ms"]["p99"],
        "streams_itl_p99_ms": s["itl_ms"]["p99"],
        "streams_ttft_p50_ms": s["ttft_ms"]["p50"],
        "streams_ttft_p99_ms": s["ttft_ms"]["p99"],
        "long_ttft_p50_ms": lg["ttft_ms"]["p50"],
        "long_ttft_p99_ms": lg["ttft_ms"]["p99"],
        "streams_output_tok_s": s["output_throughput"],
        "streams_goodput": s["goodput"],
        "long_goodput": lg["goodput"],
        "streams_duration_s": s["duration_s"],
        "long_duration_s": lg["duration_s"],
        "long_covers_streams": covered,
    }


def cmd_mixed(args, log_dir):
    save_dir = pathlib.Path(args.save_dir) if args.save_dir else log_dir
    save_dir.mkdir(parents=True, exist_ok=True)
    order = ["serve", "pd"]
    results = {"serve": [], "pd": []}
    commands = {}
    files = {"long": log_dir / "long.jsonl", "streams": log_dir / "streams.jsonl"}
    for rep in range(args.repeats):
        for which in (order if rep % 2 == 0 else order[::-1]):
            if which == "serve":
                setup = start_serve(args, log_dir, 2, "serve-t2")
            else:
                setup = start_pair(args, log_dir, "pd", layerwise=True)
            try:
                if not files["long"].exists():
                    write_jsonl(files["long"], make_prompts(setup.front.url, args.long_num,
                                                            args.long_len, args.seed),
                                args.long_out)
                    write_jsonl(files["streams"],
                                make_prompts(setup.front.url, args.stream_num, args.stream_len,
                                             args.seed + 1), args.stream_out)
                pids = [p.proc.pid for p in setup.procs]
                wait_quiet(pids, args.max_foreign, args.quiet_timeout, args.quiet)
                before = setup.front.metrics() if setup.pair else None
                fg = Foreign(pids)
                fg.start()
                reps, cmds = run_classes(args, setup, files, str(rep), save_dir, log_dir)
                row = summarize(reps)
                row["foreign_cpu"] = fg.stop()
                if setup.pair:
                    after = setup.front.metrics()
                    row["remote_prefills"] = (after.get("tandem:remote_prefill_total", 0)
                                              - before.get("tandem:remote_prefill_total", 0))
                    row["local_prefills"] = (after.get("tandem:local_prefill_total", 0)
                                             - before.get("tandem:local_prefill_total", 0))
                results[which].append(row)
                commands[which] = {"servers": [" ".join(p.argv) for p in setup.procs],
                                   "bench": cmds}
                if not args.quiet:
                    sys.stderr.write(f"repeat {rep} {which}: streams TPOT P99 "
                                     f"{row['streams_tpot_p99_ms']:.1f} ms, long TTFT P50 "
                                     f"{row['long_ttft_p50_ms']:.0f} ms, others used "
                                     f"{100 * row['foreign_cpu']:.0f}% of the CPUs\n")
            finally:
                setup.stop()
    keys = list(results["serve"][0].keys())
    medians = {w: {k: med([r[k] for r in results[w]]) if not isinstance(results[w][0][k], bool)
                   else all(r[k] for r in results[w]) for k in keys} for w in results}
    print(f"mixed workload: {args.streams} concurrent streams ({args.stream_num} requests, "
          f"{args.stream_len}-token prompts, {args.stream_out} output tokens) + long prompts "
          f"({args.long_num} at {args.long_rate:g}/s Poisson, {args.long_len} tokens, "
          f"{args.long_out} output tokens); medians of {args.repeats} repeats")
    print(f"SLO: streams TPOT <= {args.slo_tpot:g} ms and TTFT <= {args.slo_ttft_stream:g} ms; "
          f"long TTFT <= {args.slo_ttft_long:g} ms")
    print("| figure | serve --threads 2 | P+D (1 thread each) | P+D / serve |")
    print("|---|---:|---:|---:|")
    for k in keys:
        a, b = medians["serve"][k], medians["pd"][k]
        if isinstance(a, bool) or k in ("remote_prefills", "local_prefills"):
            continue
        ratio = "-" if a in (None, 0) or b is None else f"{b / a:.2f}"
        print(f"| {k} | {fmt(a)} | {fmt(b)} | {ratio} |")
    if not (medians["serve"]["long_covers_streams"] and medians["pd"]["long_covers_streams"]):
        print("note: the long prompts ended before 80% of the streams' run in some repeat "
              "(raise --long-num)")
    return {"mode": "mixed", "model": str(args.model), "workload": {
        "streams": args.streams, "stream_num": args.stream_num, "stream_len": args.stream_len,
        "stream_out": args.stream_out, "long_num": args.long_num, "long_rate": args.long_rate,
        "long_len": args.long_len, "long_out": args.long_out},
        "slo_ms": {"streams_tpot": args.slo_tpot, "streams_ttft": args.slo_ttft_stream,
                   "long_ttft": args.slo_ttft_long},
        "repeats": results, "medians": medians, "commands": commands,
        "tpot_p99_ratio": (medians["pd"]["streams_tpot_p99_ms"]
                           / medians["serve"]["streams_tpot_p99_ms"]
                           if medians["serve"]["streams_tpot_p99_ms"] else None)}


def fmt(v):
    if v is None:
        return "-"
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


# ---------------------------------------------------------------- main


def on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop the servers


def add_common_args(sp, binaries, unit, foreign_note=""):
    """The options every subcommand of pd_bench.py and router_perf.py takes."""
    sp.add_argument("--build", required=True, type=pathlib.Path,
                    help=f"build directory holding {binaries}")
    sp.add_argument("--model", type=pathlib.Path, default=DEFAULT_MODEL)
    sp.add_argument("--ctx", type=int, default=4096, help=f"--ctx of every {unit} (4096)")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--json", help="write every figure here")
    sp.add_argument("--log-dir", help="keep the servers' logs here (default: a temp dir)")
    sp.add_argument("--quiet", action="store_true")
    sp.add_argument("--max-foreign", type=float, default=0.1,
                    help="before each measurement, wait until other processes use less "
                    "than this share of the CPUs (0.1)" + foreign_note)
    sp.add_argument("--no-wait", dest="max_foreign", action="store_const", const=None,
                    help="measure at once, whatever else runs (for tests)")
    sp.add_argument("--quiet-timeout", type=float, default=900,
                    help="longest wait for a quiet machine, in seconds (900)")


def main(argv):
    signal.signal(signal.SIGTERM, on_sigterm)
    ap = argparse.ArgumentParser(prog="pd_bench.py", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("tail", "mixed"):
        sp = sub.add_parser(name)
        add_common_args(sp, "tandem, tandem-prefill, tandem-decode", "server",
                        "; tail: a request during which they used more is redone")
        sp.add_argument("--extra", action="append", default=[],
                        help="one more argument for every server (repeatable)")
        sp.add_argument("--d-extra", action="append", default=[],
                        help="one more argument for tandem-decode only (repeatable)")
        if name == "tail":
            sp.add_argument("--prompt-len", type=int, default=2048)
            sp.add_argument("--reps", type=int, default=5, help="measured rounds (5)")
            sp.add_argument("--max-tokens", type=int, default=2)
            sp.add_argument("--serve-threads", default="1,2",
                            help="tandem serve thread counts to compare (1,2)")
            sp.add_argument("--retries", type=int, default=3,
                            help="times a request disturbed by other processes is redone "
                            "with a fresh prompt (3)")
        else:
            sp.add_argument("--long-len", type=int, default=2048)
            sp.add_argument("--long-out", type=int, default=16)
            sp.add_argument("--long-rate", type=float, default=0.1)
            sp.add_argument("--long-num", type=int, default=8)
            sp.add_argument("--streams", type=int, default=8)
            sp.add_argument("--stream-len", type=int, default=64)
            sp.add_argument("--stream-out", type=int, default=256)
            sp.add_argument("--stream-num", type=int, default=64)
            sp.add_argument("--repeats", type=int, default=2)
            sp.add_argument("--slo-tpot", type=float, default=50.0)
            sp.add_argument("--slo-ttft-stream", type=float, default=2000.0)
            sp.add_argument("--slo-ttft-long", type=float, default=15000.0)
            sp.add_argument("--save-dir", help="keep every `tandem bench` JSON here")
            sp.add_argument("--compact", action="store_true",
                            help="--save-dir: leave out the per-request ITL lists")
    args = ap.parse_args(argv)
    args.build = args.build.resolve()
    if args.cmd == "tail":
        args.serve_threads = [int(t) for t in args.serve_threads.split(",") if t]
    for b in ("tandem", "tandem-prefill", "tandem-decode"):
        if not (args.build / b).exists():
            ap.error(f"{args.build / b} not found")
    if not args.model.exists():
        ap.error(f"model {args.model} not found")
    return run_logged(args, "pd_bench", cmd_tail if args.cmd == "tail" else cmd_mixed)


def run_logged(args, name, cmd):
    """Runs cmd(args, log_dir) in --log-dir (kept) or a fresh temporary
    directory (removed after a success), adds the load averages, writes
    --json; returns the exit status (1, with the logs kept, on a
    BenchError)."""
    if args.log_dir:
        log_dir = pathlib.Path(args.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
    else:
        log_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"{name.replace('_', '-')}-"))
    load_before = os.getloadavg()
    try:
        out = cmd(args, log_dir)
    except BenchError as e:
        sys.stderr.write(f"{name}: {e}\n(logs kept in {log_dir})\n")
        return 1
    out["load_average_before"] = load_before
    out["load_average_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    if not args.log_dir:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
