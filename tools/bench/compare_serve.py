#!/usr/bin/env python3
"""Serving benchmark, side by side in one run: `tandem bench` against
`tandem serve` and against llama.cpp's `llama-server` on the same machine,
same GGUF, same threads, llama-server's -np equal to Tandem's --max-running
(docs/PERFORMANCE.md).

    compare_serve.py [--tandem BIN] [--model GGUF] [--llama-server PATH]
        [--tandem-variant NAME=ARGS ...]
        [--threads 2] [--max-running 16] [--repeats 2] [--concurrency 1,4,16]
        [--num-prompts 16,32,64] [--input-len 256] [--output-len 64]
        [--prefix-len 192] [--prefix-input-len 64] [--json OUT]

For every repeat, each server is started alone (the other one stopped),
warmed up with a few requests, then measured on
  random         --input-len prompt tokens, each prompt different;
  shared-prefix  4 groups of a --prefix-len token system prompt followed by a
                 --prefix-input-len token question (the same prompt length as
                 random by default, so the two rows differ by the cache);
at each concurrency (with the matching --num-prompts). ignore_eos makes every
output exactly --output-len tokens on both servers. The servers alternate
order between repeats so a noisy neighbour hits both alike; the table shows
the median over repeats of each figure, and Tandem/llama ratios.

--tandem-variant NAME=ARGS (repeatable) runs `tandem serve` once per
variant with ARGS added (e.g. `tpot25=--tpot-target-ms 25`), each measured
against the same llama-server runs, one table per variant; without it, one
variant `tandem` with no extra arguments. Every server of a repeat runs in
turn, the order rotated between repeats.

Both servers get the same KV capacity: llama-server -c = max-running *
ctx-per-slot; tandem serve --ctx ctx-per-slot and --kv-blocks =
max-running * ctx-per-slot / 16 (block size 16); and the same KV cache type,
--kv-dtype (tandem --kv-dtype, llama-server -ctk/-ctv; default f16).

Serving overhead at concurrency 1: Tandem's TTFT P50 on random minus the
engine's own prefill time for the same prompt length (`tandem bench-engine
-p N -n 0 -r 5`, median of its timed repetitions, same threads, run right
after that repeat's server run), N being the prompt tokens the server
reported; the median over repeats of the differences.
Note: on a shared machine other tenants' load swamps these figures (and
may hurt the two servers' thread pools differently); run it on a
quiet machine.

Prints progress on stderr and a Markdown table on stdout; --json OUT writes
every bench report and the raw medians.
"""
import argparse
import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))
DEFAULT_MODEL = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                             "tandem", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
READY_RE = re.compile(r"^tandem serve: listening http=(\S+):(\d+) grpc=\S+")


def log(msg):
    sys.stderr.write(f"[compare_serve {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_ok(url, timeout=2.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


class Server:
    """A server process in its own process group, stopped by close()."""

    def __init__(self, name, argv, env, logdir, ready_line=False):
        """ready_line: the server prints its address on stdout (tandem)."""
        self.name = name
        self.log_path = os.path.join(logdir, f"{name}.log")
        self.log = open(self.log_path, "wb")
        log(f"start {name}: {' '.join(argv)}")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE if ready_line else self.log,
                                     stderr=self.log, env=env, start_new_session=True)
        self.url = None

    def wait_tandem_ready(self, timeout):
        deadline = time.monotonic() + timeout
        # The ready line is the first line on stdout; the rest of stdout is
        # drained into a file so the server never blocks on a full pipe.
        fd = self.proc.stdout.fileno()
        buf = b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.fail(f"no ready line (got {buf!r})")
            if select.select([fd], [], [], min(left, 0.5))[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    self.fail(f"stdout closed before the ready line (got {buf!r})")
                buf += chunk
        line = buf.split(b"\n", 1)[0].decode(errors="replace")
        m = READY_RE.match(line.strip())
        if not m:
            self.fail(f"no ready line (got {line!r})")
        out_log = open(self.log_path + ".stdout", "wb")
        out_log.write(buf)

        def drain():
            while True:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                out_log.write(chunk)
            out_log.close()

        threading.Thread(target=drain, daemon=True).start()
        self.url = f"http://{m.group(1)}:{m.group(2)}"
        while not http_ok(self.url + "/ready"):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.fail("not ready")
            time.sleep(0.1)

    def wait_http_ready(self, url, timeout):
        self.url = url
        deadline = time.monotonic() + timeout
        while not http_ok(url + "/health"):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.fail("not ready")
            time.sleep(0.2)

    def fail(self, why):
        self.close()
        with open(self.log_path, errors="replace") as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{self.name}: {why}\n--- log tail ---\n{tail}")

    def close(self):
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    pass
        self.log.close()


def start_tandem(args, logdir, name, extra):
    blocks = args.max_running * args.ctx_per_slot // 16
    argv = [args.tandem, "serve", "--model", args.model, "--port", "0", "--grpc-port", "-1",
            "--threads", str(args.threads), "--max-running", str(args.max_running),
            "--ctx", str(args.ctx_per_slot), "--kv-blocks", str(blocks),
            "--served-model-name", "bench-model", "--kv-dtype", args.kv_dtype] + extra
    s = Server(name, argv, dict(os.environ), logdir, ready_line=True)
    s.wait_tandem_ready(args.ready_timeout)
    return s


def start_llama(args, logdir):
    port = free_port()
    env = dict(os.environ)
    libdir = os.path.dirname(os.path.abspath(args.llama_server))
    env["LD_LIBRARY_PATH"] = libdir + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    argv = [args.llama_server, "-m", args.model, "-t", str(args.threads), "-np",
            str(args.max_running), "-c", str(args.max_running * args.ctx_per_slot),
            "--host", "127.0.0.1", "--port", str(port), "-a", "bench-model",
            "-ctk", args.kv_dtype, "-ctv", args.kv_dtype]
    s = Server("llama", argv, env, logdir)
    s.wait_http_ready(f"http://127.0.0.1:{port}", args.ready_timeout)
    return s


def run_bench(args, url, extra, json_path):
    argv = [args.tandem, "bench", "--url", url, "--model", "bench-model", "--seed", "1",
            "--output-len", str(args.output_len), "--json", json_path, "--no-progress",
            "--timeout", "600"] + extra
    r = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"tandem bench failed ({r.returncode}): {' '.join(argv)}\n"
                           f"{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    with open(json_path) as f:
        rep = json.load(f)
    if rep["failed"]:
        raise RuntimeError(f"{rep['failed']} requests failed: {rep['errors']} ({' '.join(argv)})")
    return rep


def dataset_args(args, ds):
    if ds == "random":
        return ["--dataset", "random", "--input-len", str(args.input_len)]
    return ["--dataset", "shared-prefix", "--prefix-len", str(args.prefix_len), "--num-groups", "4",
            "--input-len", str(args.prefix_input_len)]


def measure_server(args, name, logdir, tmp, rep_i, results, raw):
    srv = (start_tandem(args, logdir, name, args.variants[name]) if name in args.variants
           else start_llama(args, logdir))
    try:
        # Warm-up: page the weights in, let both servers reach steady state.
        run_bench(args, srv.url, dataset_args(args, "random") + ["--num-prompts", "4",
                                                                 "--concurrency", "4"],
                  os.path.join(tmp, "warmup.json"))
        for ds in args.datasets:
            for conc, n in zip(args.concurrency, args.num_prompts):
                path = os.path.join(tmp, f"{name}-{ds}-c{conc}-r{rep_i}.json")
                rep = run_bench(args, srv.url, dataset_args(args, ds)
                                + ["--num-prompts", str(n), "--concurrency", str(conc)], path)
                fig = {"output_tps": rep["output_throughput"],
                       "ttft_p50": rep["ttft_ms"]["p50"], "ttft_p99": rep["ttft_ms"]["p99"],
                       "tpot_p50": rep["tpot_ms"]["p50"], "tpot_p99": rep["tpot_ms"]["p99"],
                       "prompt_tokens_p50": statistics.median(
                           r["prompt_tokens"] for r in rep["requests"])}
                if name in args.variants and ds == "random" and conc == 1:
                    fig.update(paired_overhead(srv.log_path, rep["requests"]))
                    if fig.get("paired_overhead_p50") is not None:
                        log(f"tandem serving overhead (client TTFT - server prefill compute, "
                            f"per request): P50 {fig['paired_overhead_p50']:.2f} ms, "
                            f"P90 {fig['paired_overhead_p90']:.2f} ms over "
                            f"{fig['paired_overhead_n']} requests")
                results.setdefault((name, ds, conc), []).append(fig)
                rep.pop("requests")
                raw.append({"server": name, "dataset": ds, "concurrency": conc, "repeat": rep_i,
                            "report": rep})
                log(f"{name} {ds} c={conc} repeat {rep_i + 1}: {fig['output_tps']:.1f} tok/s, "
                    f"TTFT P50 {fig['ttft_p50']:.1f} ms, TPOT P50 {fig['tpot_p50']:.1f} ms")
    finally:
        srv.close()


def paired_overhead(log_path, requests):
    """Per request: the client's TTFT minus the forward-pass time the
    server spent on that request before its first token (the log line's
    prefill_compute_ms), paired by response id. Same request, same moment,
    so machine noise in the forward pass cancels out."""
    compute = {}
    with open(log_path, errors="replace") as f:
        for line in f:
            m = re.search(r"request: id=(\S+) .*prefill_compute_ms=([0-9.]+)", line)
            if m:
                compute[m.group(1)] = float(m.group(2))
    d = sorted(r["ttft_ms"] - compute[r["id"] + "-0"] for r in requests
               if r.get("success") and r.get("id") and r["id"] + "-0" in compute)
    if not d:
        return {"paired_overhead_p50": None, "paired_overhead_p90": None, "paired_overhead_n": 0}
    return {"paired_overhead_p50": statistics.median(d),
            "paired_overhead_p90": d[min(len(d) - 1, int(0.9 * len(d)))],
            "paired_overhead_n": len(d)}


def engine_prefill_ms(args, n_tokens):
    r = subprocess.run([args.tandem, "bench-engine", "--model", args.model, "-p", str(n_tokens),
                        "-n", "0", "-r", "5", "--threads", str(args.threads), "--json"],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"tandem bench-engine failed: {r.stderr[-2000:]}")
    j = json.loads(r.stdout)
    ns = j["tests"][0]["samples_ns"]
    return statistics.median(ns) / 1e6, j


def med(results, key, fld):
    vals = [f[fld] for f in results.get(key, []) if f[fld] is not None]
    return statistics.median(vals) if vals else None


def f1(v):
    return "-" if v is None else f"{v:.1f}"


def ratio(a, b):
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def parse_list(text, name):
    try:
        v = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"{name}: expected a comma-separated list of integers")
    if not v or min(v) < 1:
        raise SystemExit(f"{name}: values must be >= 1")
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--tandem", default=os.environ.get("TANDEM_BIN") or shutil.which("tandem"),
                    help="the tandem binary (default $TANDEM_BIN, else tandem on PATH)")
    ap.add_argument("--model", default=os.environ.get("TANDEM_MODEL") or DEFAULT_MODEL)
    ap.add_argument("--llama-server", default="/work/llamacpp/build/bin/llama-server")
    ap.add_argument("--tandem-variant", action="append", default=[], metavar="NAME=ARGS",
                    help="a tandem serve run with ARGS added (repeatable; default: one, "
                    "'tandem', with none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--ctx-per-slot", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of the whole grid per server; figures are medians (default 2; "
                    "the time of each repeat is logged with an estimate of the rest)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--num-prompts", default="16,32,64",
                    help="requests per run, one per concurrency level")
    ap.add_argument("--datasets", default="random,shared-prefix")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=192)
    ap.add_argument("--prefix-input-len", type=int, default=64)
    ap.add_argument("--ready-timeout", type=float, default=120)
    ap.add_argument("--kv-dtype", choices=("f16", "bf16", "f32"), default="f16",
                    help="both servers' KV cache type (default f16: both defaults on the CPU)")
    ap.add_argument("--no-overhead", action="store_true", help="skip the bench-engine prefill runs")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    args.concurrency = parse_list(args.concurrency, "--concurrency")
    args.num_prompts = parse_list(args.num_prompts, "--num-prompts")
    if len(args.num_prompts) != len(args.concurrency):
        raise SystemExit("--num-prompts needs one value per --concurrency value")
    args.variants = {}
    for v in args.tandem_variant or ["tandem="]:
        name, sep, extra = v.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.+-]+", name) or name == "llama" or \
                name in args.variants:
            raise SystemExit(f"--tandem-variant {v!r}: NAME=ARGS, NAME unique, letters, digits "
                             "and _.+- (not 'llama')")
        args.variants[name] = shlex.split(extra)
    first = next(iter(args.variants))
    args.datasets = args.datasets.split(",")
    for ds in args.datasets:
        if ds not in ("random", "shared-prefix"):
            raise SystemExit(f"--datasets: unknown {ds!r}")
    if not args.tandem or not os.path.exists(args.tandem):
        raise SystemExit("tandem binary not found: pass --tandem or set TANDEM_BIN")
    for p, what in ((args.model, "model"), (args.llama_server, "llama-server")):
        if not os.path.exists(p):
            raise SystemExit(f"{what} not found: {p}")
    longest = max(args.input_len if "random" in args.datasets else 0,
                  args.prefix_len + args.prefix_input_len if "shared-prefix" in args.datasets else 0)
    need = longest + args.output_len + 8  # + BOS and the fitting slack of the prompt lengths
    if need > args.ctx_per_slot:
        raise SystemExit(f"--ctx-per-slot {args.ctx_per_slot} < {need} tokens a request needs")

    t_start = time.monotonic()
    results, raw = {}, []
    want_overhead = not args.no_overhead and 1 in args.concurrency and "random" in args.datasets
    pairs, engine_runs = [], []
    logdir = tempfile.mkdtemp(prefix="compare-serve-")
    log(f"server logs in {logdir}")
    with tempfile.TemporaryDirectory() as tmp:
        for rep_i in range(args.repeats):
            names = list(args.variants) + ["llama"]
            k = rep_i % len(names)
            order = names[k:] + names[:k]
            for name in order:
                measure_server(args, name, logdir, tmp, rep_i, results, raw)
                if name == first and want_overhead:
                    # Right after the server run (server stopped), so both
                    # figures see the same machine state.
                    fig = results[(first, "random", 1)][-1]
                    n_tok = int(round(fig["prompt_tokens_p50"]))
                    pre_ms, engine = engine_prefill_ms(args, n_tok)
                    engine_runs.append(engine)
                    pairs.append({"prompt_tokens": n_tok, "ttft_p50_ms": fig["ttft_p50"],
                                  "engine_prefill_ms": pre_ms,
                                  "overhead_ms": fig["ttft_p50"] - pre_ms})
                    log(f"engine prefill of {n_tok} tokens: {pre_ms:.2f} ms; serving overhead "
                        f"{pairs[-1]['overhead_ms']:.2f} ms")
            took = time.monotonic() - t_start
            log(f"repeat {rep_i + 1}/{args.repeats} done after {took / 60:.1f} min; about "
                f"{took / (rep_i + 1) * (args.repeats - rep_i - 1) / 60:.1f} min to go")

    overhead = None
    if pairs:
        overhead = {k: statistics.median(p[k] for p in pairs)
                    for k in ("prompt_tokens", "ttft_p50_ms", "engine_prefill_ms", "overhead_ms")}
        overhead["prompt_tokens"] = int(overhead["prompt_tokens"])
        overhead["repeats"] = pairs

    out = sys.stdout
    out.write(f"\nSame machine, same run; model {os.path.basename(args.model)}, "
              f"{args.threads} threads, max-running / -np {args.max_running}, "
              f"output {args.output_len} tokens (ignore_eos), medians of {args.repeats} "
              f"repeat(s). Random: {args.input_len}-token prompts; shared-prefix: 4 groups, "
              f"{args.prefix_len}-token system prompt + {args.prefix_input_len}-token question.\n\n")
    table = []
    figs = ("output_tps", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")
    for name, extra in args.variants.items():
        if len(args.variants) > 1 or extra:
            out.write(f"\nTandem variant `{name}`: `tandem serve {' '.join(extra)}`\n\n")
        out.write("| dataset | conc | Tandem tok/s | llama tok/s | ratio | Tandem TTFT P50/P99 ms "
                  "| llama TTFT P50/P99 ms | ratio P50/P99 | Tandem TPOT P50/P99 ms "
                  "| llama TPOT P50/P99 ms | ratio P50/P99 |\n")
        out.write("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
        for ds in args.datasets:
            for conc in args.concurrency:
                t = {k: med(results, (name, ds, conc), k) for k in figs}
                ll = {k: med(results, ("llama", ds, conc), k) for k in figs}
                table.append({"variant": name, "args": extra, "dataset": ds,
                              "concurrency": conc, "tandem": t, "llama": ll})
                out.write(
                    f"| {ds} | {conc} | {f1(t['output_tps'])} | {f1(ll['output_tps'])} "
                    f"| {ratio(t['output_tps'], ll['output_tps'])} "
                    f"| {f1(t['ttft_p50'])} / {f1(t['ttft_p99'])} "
                    f"| {f1(ll['ttft_p50'])} / {f1(ll['ttft_p99'])} "
                    f"| {ratio(t['ttft_p50'], ll['ttft_p50'])} / {ratio(t['ttft_p99'], ll['ttft_p99'])} "
                    f"| {f1(t['tpot_p50'])} / {f1(t['tpot_p99'])} "
                    f"| {f1(ll['tpot_p50'])} / {f1(ll['tpot_p99'])} "
                    f"| {ratio(t['tpot_p50'], ll['tpot_p50'])} / {ratio(t['tpot_p99'], ll['tpot_p99'])} |\n")
    if overhead:
        out.write(f"\nServing overhead at concurrency 1 (random), median over repeats of "
                  f"(TTFT P50 - engine prefill, measured right after): "
                  f"{overhead['overhead_ms']:.2f} ms (TTFT P50 {overhead['ttft_p50_ms']:.2f} ms, "
                  f"prefill of {overhead['prompt_tokens']} tokens "
                  f"{overhead['engine_prefill_ms']:.2f} ms: tandem bench-engine -p "
                  f"{overhead['prompt_tokens']} -n 0 -r 5 --threads {args.threads}, median)\n")
    po = [f["paired_overhead_p50"] for f in results.get((first, "random", 1), [])
          if f.get("paired_overhead_p50") is not None]
    if po:
        out.write(f"\nServing overhead at concurrency 1 (random), paired per request: client TTFT "
                  f"minus the forward-pass time the server spent on that request before its first "
                  f"token (its log line's prefill_compute_ms): median over repeats of the per-run "
                  f"P50 {statistics.median(po):.2f} ms (per-run P50s: "
                  f"{', '.join(f'{v:.2f}' for v in po)})\n")
    elapsed = time.monotonic() - t_start
    out.write(f"\nCommand: {' '.join(sys.argv)}  ({elapsed / 60:.1f} min)\n")
    out.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items()}, "table": table,
                       "overhead": overhead, "engine": engine_runs, "runs": raw,
                       "elapsed_s": elapsed}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:
        sys.stderr.write(f"compare_serve: {e}\n")
        sys.exit(1)
