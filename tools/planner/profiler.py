"""tandem profile: measures what the simulator needs of one instance plan
and writes it as a versioned JSON profile.

It starts the instances itself with `tandem up` (pinned with --cpus, every
scheduler writing its step trace), sends controlled loads through the
router with tandem bench's client, stops them, and fits from the traces:

  loads        isolated prompts of 16 to 3072 tokens, a cached prefix, decode
               batches of 1-16 sequences at three contexts (lockstep: sent
               at once), then two traffic loads of Poisson arrivals with
               mixed lengths at 35% and 70% of the instance's time
  step model   forward = c0 + c_tok N + c_tok2 N^2 + c_attn A + c_attn2 A2
               + c_ctx C + c_seq B + sum_k c_nk max(0, N - k) over every
               step (N batch tokens, A attention pairs, A2 their squared
               positions, C the context read, B sequences, the hinges at
               k = 2, 4, 8, 16 a piecewise-linear cost per token: the
               matmul's batch regimes; planner/sim.h), a
               least-squares fit of the relative error; it holds prefill as
               a function of the batch's new tokens and of its cached
               prefix (A grows with pos0), and decode as a function of the
               batch size and the total context; the residuals are reported
               overall and per step kind (prefill, decode, mixed)
  overhead     the scheduler's own time per step (the median gap between a
               step's forward pass and the next one's start while busy,
               added to every simulated step), and the client-side
               time outside the scheduler (HTTP, tokenizing, the router's
               hop: measured TTFT of isolated requests minus the model's)
  transfer     (--role both) the time from a request's arrival at the
               decode instance to its remote prefill's end, beyond the
               prefill instance's own steps, fitted as fixed + per token;
               --role both runs twice: every prompt prefilled remotely (the
               prefill steps, the transfer, decode), then every isolated
               prompt prefilled on the decode instance (its own prefill)
  KV capacity  the pool's blocks and block size, and the scheduler's
               parameters, from the trace's header
  beside       (--neighbour-cpus LIST, colocated) every load again on this
               instance and on a second one of the plan pinned to LIST,
               sent to both at once: the step model and gap of an instance
               stepping beside a busy neighbour (sharing the machine's
               caches, memory bandwidth, perhaps its physical cores), which
               tandem plan --host-cores charges while a neighbour steps
  speed check  the first phase's lockstep decode load of 4 sequences at the
               middle context repeated at its end: how far the machine's
               speed moved while it was profiled (the change of its TPOT
               P50); tandem plan warns when that exceeds its --margin

usage: tandem profile [--model PATH] [--role colocated|both] [--cpus LIST]
                      [--threads T] [--neighbour-cpus LIST] [--out FILE.json] [--quick]
                      [INSTANCE FLAGS...]

Flags it does not know go to every instance (plan flags such as --tp 2,
--kv-blocks N, --max-batch-tokens N, --kv-dtype ...). --role both profiles
a prefill and a decode instance (1P+1D, one --cpus share each) and the
transfer between them; colocated (the default) one tandem serve instance.
"""

import argparse
import datetime
import hashlib
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
from scipy.optimize import lsq_linear, nnls

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench"))
sys.path.insert(0, str(HERE))

import serve_bench  # noqa: E402
from steptrace import FEATURES, HINGES, SIGNED, Trace, TraceError, predict  # noqa: E402
from upctl import Up, UpError, stop_on_sigterm  # noqa: E402

PROFILE_VERSION = 1
# The traffic loads: Poisson arrivals of mixed lengths keeping the instance
# this share of its time busy, so the fit sees steps as serving runs them
# (arrivals, tokenizing and streaming on the instance's cores between and
# during its steps), not only the lockstep batches of the loads above.
TRAFFIC = (0.35, 0.7)
SPEED_CHECK = "speed-check"  # a decode load repeated at the end of the loads


class ProfileError(Exception):
    pass


def progress(k, n, what):
    if not sys.stderr.isatty():
        sys.stderr.write(f"tandem profile: {k}/{n} {what}\n")
        return
    width = 24
    done = int(width * k / max(n, 1))
    sys.stderr.write(f"\rtandem profile [{'#' * done}{'.' * (width - done)}] {k}/{n} {what:<48}")
    sys.stderr.flush()
    if k == n:
        sys.stderr.write("\n")


def machine():
    cpu = platform.processor()
    flags = []
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        m = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
        cpu = m.group(1).strip() if m else cpu
        m = re.search(r"^flags\s*:\s*(.+)$", info, re.M)
        have = set(m.group(1).split()) if m else set()
        flags = sorted(have & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile",
                               "amx_bf16", "amx_int8", "fma"})
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "isa": flags, "host": platform.node(),
            "kernel": platform.release()}


def model_identity(path):
    """Size and the SHA-256 of the first and last MiB: enough to tell model
    files apart without reading gigabytes."""
    p = pathlib.Path(path)
    st = p.stat()
    h = hashlib.sha256()
    with open(p, "rb") as f:
        h.update(f.read(1 << 20))
        if st.st_size > 2 << 20:
            f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read(1 << 20))
    return {"file": p.name, "size_bytes": st.st_size, "sha256_ends": h.hexdigest()}


def cluster_argv(tandem, args, extra, workdir, tag, threshold, cpus=None, name="colocated"):
    """tandem up for one phase of loads: the plan pinned to its cores (cpus,
    default --cpus), the step traces written into workdir (a colocated
    instance's as NAME{tag}.jsonl)."""
    up = [tandem, "up", "--port", "0", "--grpc-port", "-1", "--threads", str(args.threads),
          "--cpus", cpus or args.cpus, "--ready-timeout", "300"]
    if args.model:
        up += ["--model", args.model]
    if args.role == "colocated":
        up += ["--colocated", "1", f"--decode-arg=--step-trace={workdir}/{name}{tag}.jsonl"]
    else:
        up += ["--prefill", "1", "--decode", "1",
               f"--prefill-arg=--step-trace={workdir}/prefill{tag}.jsonl",
               f"--decode-arg=--step-trace={workdir}/decode{tag}.jsonl",
               f"--router-arg=--local-prefill-threshold={threshold}"]
    for a in extra:
        up += [f"--decode-arg={a}"] + ([f"--prefill-arg={a}"] if args.role != "colocated" else [])
    return up


def bench_argv(url, workdir, name, seed, flags):
    """tandem bench's flags for one load, its report into bench-NAME.json."""
    return ["--url", url, "--no-progress", "--json", str(workdir / f"bench-{name}.json"),
            "--seed", str(seed), *map(str, flags)]


def bench(url, workdir, name, seed, *flags):
    """One tandem bench run through the router; its report. Each load has
    its own seed: prompts of one load are no prefix of another's (the
    prefix cache would serve them)."""
    out = workdir / f"bench-{name}.json"
    argv = bench_argv(url, workdir, name, seed, flags)
    with open(workdir / f"bench-{name}.txt", "w") as f:
        old = sys.stdout
        sys.stdout = f
        try:
            rc = serve_bench.main(argv)
        finally:
            sys.stdout = old
    if rc != 0:
        raise ProfileError(f"tandem bench {' '.join(argv)} failed (exit {rc}); "
                           f"see {workdir}/bench-{name}.txt")
    rep = json.loads(out.read_text())
    if rep["failed"]:
        raise ProfileError(f"{rep['failed']} requests of the '{name}' load failed: "
                           f"{rep['errors']}")
    return rep


def loads(max_ctx, quick):
    """The controlled loads: (name, bench flags, isolated?)."""
    room = max_ctx - 64
    lens = [n for n in (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072)
            if n <= room]
    if quick:
        lens = lens[::2] + ([lens[-1]] if len(lens) % 2 == 0 else [])
    out = [(f"prefill-{n}", ["--input-len", n, "--output-len", 2, "--num-prompts",
                             1 if quick else 2, "--concurrency", 1], True) for n in lens]
    pre = min(512, room // 2)
    out.append(("cached-prefix", ["--dataset", "shared-prefix", "--prefix-len", pre,
                                  "--num-groups", 1, "--input-len", min(64, room - pre),
                                  "--output-len", 2, "--num-prompts", 3 if quick else 6,
                                  "--concurrency", 1], True))
    concs = (1, 4, 8) if quick else (1, 2, 4, 8, 16)
    ctxs = [n for n in (48, 480, 1400) if n + 64 <= room] or [max(8, room // 4)]
    if quick:
        ctxs = ctxs[:2]
    for c in concs:
        for n in ctxs:
            out.append((f"decode-c{c}-{n}", ["--input-len", n, "--output-len", 24 if quick else 48,
                                             "--num-prompts", c, "--concurrency", c], False))
    hi = max(33, min(512, room))
    for u in TRAFFIC[-1:] if quick else TRAFFIC:
        # the rate (None here) is set from the loads before it (traffic_rate)
        out.append((f"traffic-{round(100 * u)}", ["--request-rate", None, "--input-len",
                                                  f"32:{hi}", "--output-len", "16:48",
                                                  "--num-prompts", 16 if quick else 40], False))
    ref = f"decode-c4-{ctxs[min(1, len(ctxs) - 1)]}"
    out.append((SPEED_CHECK, next(f for n, f, _ in out if n == ref), False))
    return out


def speed_check(plan, reports, started):
    """The speed check's load against the same load earlier (None where a
    refitted work directory has no speed check)."""
    ref = next(n for n, f, _ in plan if n != SPEED_CHECK and f == plan[-1][1])
    if SPEED_CHECK not in reports:
        return None
    a, b = reports[ref]["tpot_ms"]["p50"], reports[SPEED_CHECK]["tpot_ms"]["p50"]
    return {"load": ref, "tpot_ms_p50": [a, b], "change": b / a - 1,
            "minutes_apart": (started[SPEED_CHECK] - started[ref]) / 60
            if SPEED_CHECK in started and ref in started else None}


def traffic_rate(name, flags, reports):
    """A traffic load's Poisson rate: its share u of the instance's time
    over one request's service time alone, the isolated prefill of its mean
    prompt (interpolated between the prefill loads' TTFTs) plus 32 decode
    steps of one sequence (the decode-c1 load's TPOT)."""
    u = int(name.split("-")[1]) / 100
    lo, hi = map(int, flags[flags.index("--input-len") + 1].split(":"))
    pre = sorted((int(n.split("-")[1]), r["ttft_ms"]["p50"]) for n, r in reports.items()
                 if re.fullmatch(r"prefill-\d+", n))
    dec = [r["tpot_ms"]["p50"] for n, r in reports.items() if n.startswith("decode-c1-")]
    if not pre or not dec:
        raise ProfileError("the traffic loads need the isolated prefill and decode-c1 loads")
    service_s = (np.interp((lo + hi) / 2, [n for n, _ in pre], [t for _, t in pre]) +
                 32 * dec[0]) / 1e3
    return u / service_s


def with_rate(flags, rate):
    return [f"{rate:.4f}" if f is None else f for f in flags]


def fit_steps(steps):
    """The non-negative fit of the relative error of every step's forward
    time; its coefficients, residuals and the scheduler's own time per
    step (the gap before the next step that continued it)."""
    rows = [s for s in steps if s.dt > 0]
    if len(rows) < len(FEATURES) + 2:
        raise ProfileError(f"only {len(rows)} steps to fit the step model from (need "
                           f"{len(FEATURES) + 2})")
    X = np.array([s.features() for s in rows])
    y = np.array([s.dt for s in rows])
    kinds = np.array([s.kind() for s in rows])
    # each kind (prefill, decode, mixed) weighs the same in all, however
    # many steps it has: the few long prefill steps are not drowned
    count = {k: int((kinds == k).sum()) for k in set(kinds)}
    w = np.array([1.0 / np.sqrt(count[k]) for k in kinds])
    scale = np.maximum(np.abs(X).max(axis=0), 1e-30)  # conditioning
    lower = [-np.inf if f in SIGNED else 0.0 for f in FEATURES]
    coef = lsq_linear(X / scale * (w / y)[:, None], w, bounds=(lower, np.inf)).x / scale
    pred = X @ coef
    rel = np.abs(pred - y) / y

    def stats(mask):
        if not mask.any():
            return None
        return {"n": int(mask.sum()), "rel_err_p50": float(np.percentile(rel[mask], 50)),
                "rel_err_p90": float(np.percentile(rel[mask], 90)),
                "rms_ms": float(1e3 * np.sqrt(np.mean((pred[mask] - y[mask]) ** 2)))}

    c = dict(zip(FEATURES, coef))
    slopes = [c["c_tok"] + sum(c[f"c_n{k}"] for k in HINGES if k < edge) for edge in
              (*HINGES, HINGES[-1] + 1)]
    fit = {"form": "forward = c0 + c_tok N + c_tok2 N^2 + c_attn A + c_attn2 A2 + c_ctx C + c_seq B"
                   " + sum_k c_nk max(0, N - k), k in 2, 4, 8, 16",
           "method": "least squares of the relative error, each step kind weighing the same; "
                     "every coefficient >= 0 but the hinges'",
           "monotone_in_tokens": bool(min(slopes) >= 0),
           **stats(np.ones(len(y), bool)),
           "by_kind": {k: stats(kinds == k) for k in ("prefill", "decode", "mixed")}}
    gaps = np.array([s.gap for s in steps if s.gap is not None and s.gap >= 0]) \
        if any(s.gap is not None for s in steps) else np.zeros(1)
    return dict(zip(FEATURES, map(float, coef))), fit, {
        "step_overhead_s": float(np.percentile(gaps, 50)),
        "step_gap_ms_p90": float(1e3 * np.percentile(gaps, 90))}


def isolated_records(reports):
    """The records of the isolated loads in the order they were sent."""
    recs = []
    for rep in reports:
        recs += sorted(rep["requests"], key=lambda r: r["start_s"])
    return recs


def role_section(trace, coef, fit, overhead):
    h = trace.header
    return {"sched": {k: h[k] for k in ("max_running", "max_batch_tokens", "max_waiting",
                                        "reserve_output_tokens", "max_ctx", "prefix_cache")},
            "n_blocks": h["n_blocks"], "block_size": h["block_size"], "compat": h["compat"],
            "step": coef, "fit": fit, "overhead": overhead}


def client_overhead(trace, tickets, recs):
    """The time outside the scheduler (HTTP, tokenizing, the router's hop,
    the wake-up before the first step): each isolated request's measured
    TTFT minus the time from its arrival at the scheduler to the end of
    its last prefill step, both measured (the model's own error stays in
    the model's residuals; matched in arrival order: they were sent one at
    a time)."""
    out = []
    for tk, rec in zip(tickets, recs):
        steps = trace.prompt_steps(tk)
        if not steps or rec["ttft_ms"] is None:
            continue
        last = trace.steps[steps[-1]]
        inside = last.t + last.dt - trace.arrivals[tk][0]
        out.append(rec["ttft_ms"] / 1e3 - inside)
    return out


def wait_header(path):
    for _ in range(200):  # the header is written when the scheduler starts
        try:
            with open(path) as f:
                return json.loads(f.readline())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise ProfileError(f"no step trace header in {path}")


def phases(args):
    """(tag, router threshold, which loads): colocated, one phase; both, a
    phase with every prompt prefilled remotely (the prefill instance's
    steps, the transfer, the decode steps) and one with every prompt
    prefilled on the decode instance (its own prefill steps)."""
    if args.role == "colocated":
        return [("", None, "all")]
    return [("", 0, "all"), ("-local", 1 << 24, "isolated")]


def run(args, extra):
    tandem = os.environ.get("TANDEM_BIN") or str(HERE.parent.parent / "build" / "tandem")
    if not os.access(tandem, os.X_OK):
        raise ProfileError(f"no tandem binary at {tandem} (set TANDEM_BIN)")
    model = args.model or os.path.expanduser(
        "~/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(model):
        raise ProfileError(f"cannot read the model {model}")
    first = "colocated" if args.role == "colocated" else "decode"
    if args.refit:
        workdir = pathlib.Path(args.refit)
        try:
            with open(workdir / f"{first}.jsonl") as f:
                head = json.loads(f.readline())
            plan = loads(int(head["max_ctx"]), args.quick)
            reports = {}
            for tag, _, which in phases(args):
                for n, _, iso in plan:
                    f = workdir / f"bench-{tag}{n}.json"
                    if (which == "all" or iso) and (n != SPEED_CHECK or f.exists()):
                        reports[tag + n] = json.loads(f.read_text())
        except (OSError, ValueError, KeyError) as e:
            raise ProfileError(f"--refit {workdir}: not the work directory of a profile run of "
                               f"this --role and --quick ({e})")
        return analyse(args, extra, model, workdir, plan, reports)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="tandem-profile-"))
    reports = {}
    args.rates = {}  # the traffic loads' rates, set by the first phase
    args.started = {}  # the first phase's loads' start times (time.time())
    plan = measure(tandem, args, extra, workdir, first, reports)
    if args.neighbour_cpus:
        measure_beside(tandem, args, extra, workdir, plan)
    return analyse(args, extra, model, workdir, plan, reports)


def measure_beside(tandem, args, extra, workdir, plan):
    """The loads again, on the instance (--cpus) and a second instance of
    its plan (--neighbour-cpus) at once, each load sent to both at the
    same moment: every step measured beside a neighbour that runs a step
    like it, as the instances of a shape of several run side by side under
    a router that spreads the load evenly (sharing the machine's caches,
    memory bandwidth and perhaps physical cores). The two step traces are
    colocated-beside.jsonl and neighbour-beside.jsonl."""
    clusters = []
    try:
        for name, cpus in (("colocated", args.cpus), ("neighbour", args.neighbour_cpus)):
            try:
                clusters.append(Up(cluster_argv(tandem, args, extra, workdir, "-beside", None,
                                                cpus, name), workdir / f"up-beside-{name}.err"))
            except UpError as e:
                raise ProfileError(f"the {name} instance side by side: {e}")
        plan = [x for x in plan if x[0] != SPEED_CHECK]
        for k, (load, flags, _) in enumerate(plan):
            progress(k, len(plan), "side by side " + load)
            procs = []
            try:
                for cl, name in zip(clusters, ("colocated", "neighbour")):
                    tag = f"beside-{name}-{load}"
                    argv = [sys.executable, serve_bench.__file__,
                            *bench_argv(cl.url, workdir, tag, 1000 + k,
                                        with_rate(flags, args.rates.get(load, 0)))]
                    with open(workdir / f"bench-{tag}.txt", "w") as f:
                        procs.append((subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                                       stdin=subprocess.DEVNULL), tag))
                failed = [tag for p, tag in procs if p.wait() != 0]
            finally:  # interrupted: no load left running
                for p, _ in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            if failed:
                raise ProfileError(f"tandem bench failed side by side: see "
                                   f"{workdir}/bench-{failed[0]}.txt")
        progress(len(plan), len(plan), "done")
    finally:
        for cl in clusters:
            cl.stop()


def measure(tandem, args, extra, workdir, first, reports):
    """Runs every phase's loads against its cluster; the loads (reports by
    load name into reports)."""
    plan = None
    for tag, threshold, which in phases(args):
        try:
            cl = Up(cluster_argv(tandem, args, extra, workdir, tag, threshold),
                    workdir / f"up{tag}.err")
        except UpError as e:
            raise ProfileError(str(e))
        try:
            if plan is None:
                plan = loads(int(wait_header(workdir / f"{first}{tag}.jsonl")["max_ctx"]),
                             args.quick)
            to_run = [x for x in plan if which == "all" or x[2]]
            for k, (name, flags, _) in enumerate(to_run):
                progress(k, len(to_run), tag[1:] + " " + name if tag else name)
                if not tag:
                    args.started[name] = time.time()
                if None in flags:
                    args.rates[name] = args.rates.get(name) or traffic_rate(name, flags, reports)
                    flags = with_rate(flags, args.rates[name])
                reports[tag + name] = bench(cl.url, workdir, tag + name, 1000 + k, *flags)
            progress(len(to_run), len(to_run), "done")
        finally:
            cl.stop()
    return plan


def analyse(args, extra, model, workdir, plan, reports):
    iso_names = [n for n, _, isolated in plan if isolated]
    iso = isolated_records([reports[n] for n in iso_names])
    prompt_extra = [r["prompt_tokens"] - r["input_len"] for r in iso if r["prompt_tokens"]]
    prof = {"tandem_profile": PROFILE_VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "model": model_identity(model),
            "plan": {"role": args.role, "threads": args.threads, "cpus": args.cpus,
                     "flags": extra},
            # the second instance of the side-by-side loads (None: measured alone only)
            "neighbour": {"cpus": args.neighbour_cpus} if args.neighbour_cpus else None,
            "command": ["tandem", "profile", *sys.argv[1:]],
            "prompt_extra_tokens": int(np.median(prompt_extra)) if prompt_extra else 0,
            # requests/s of each traffic load (None: refitted, see the workdir's bench-*.txt)
            "traffic_rates": getattr(args, "rates", None),
            # a decode load repeated at the end: how far the machine drifted
            "speed_check": speed_check(plan, reports, getattr(args, "started", {})),
            "roles": {}}
    n_iso = len(iso)
    if args.role == "colocated":
        tr = Trace(workdir / "colocated.jsonl")
        coef, fit, ovh = fit_steps(tr.steps)
        co = client_overhead(tr, list(tr.arrivals)[:n_iso], iso)
        ovh["request_overhead_s"] = float(np.median(co)) if co else 0.0
        prof["roles"]["colocated"] = role_section(tr, coef, fit, ovh)
        if args.neighbour_cpus:
            prof["roles"]["colocated"]["beside"] = fit_beside(workdir, coef)
    else:
        pt, dt = Trace(workdir / "prefill.jsonl"), Trace(workdir / "decode.jsonl")
        dl = Trace(workdir / "decode-local.jsonl")
        pc, pfit, povh = fit_steps(pt.steps)
        dc, dfit, dovh = fit_steps(dt.steps + dl.steps)
        iso_local = isolated_records([reports["-local" + n] for n in iso_names])
        co = client_overhead(dl, list(dl.arrivals)[:n_iso], iso_local)
        dovh["request_overhead_s"] = float(np.median(co)) if co else 0.0
        povh["request_overhead_s"] = dovh["request_overhead_s"]
        prof["roles"]["prefill"] = role_section(pt, pc, pfit, povh)
        prof["roles"]["decode"] = role_section(dt, dc, dfit, dovh)
        prof["transfer"] = fit_transfer(pt, dt, list(dt.arrivals)[:n_iso])
    prof["workdir"] = str(workdir)
    return prof


def fit_beside(workdir, alone):
    """The step model of the side-by-side loads (both instances' steps),
    its scheduler gap, and how the steps compare with the model measured
    alone (median measured / alone model, by step kind)."""
    steps = []
    for name in ("colocated", "neighbour"):
        steps += Trace(workdir / f"{name}-beside.jsonl").steps
    coef, fit, ovh = fit_steps(steps)
    ratio = {}
    for kind in ("prefill", "decode", "mixed"):
        r = [s.dt / m for s in steps if s.dt > 0 and s.kind() == kind
             for m in [predict(alone, s.features())] if m > 0]
        ratio[kind] = float(np.median(r)) if r else None
    return {"step": coef, "fit": fit, "overhead": ovh, "over_alone_p50": ratio}


def fit_transfer(pt, dt, d_tickets):
    """For each isolated remote prefill: the time the simulator does not
    model as P's steps, measured (both traces' clocks are the machine's
    monotonic clock): from its arrival at D to P's first step for it, plus
    from P's last step's end to the PrefillDone at D; fixed + per token."""
    p_tickets = list(pt.arrivals)
    remote = [tk for tk in d_tickets if tk in dt.remote_done]
    if len(remote) > len(p_tickets):
        raise ProfileError("the decode instance's remote prefills outnumber the prefill "
                           "instance's arrivals")
    xs, ys, lat = [], [], []
    for k, dtk in enumerate(remote):
        ptk = p_tickets[k]
        n = dt.arrivals[dtk][1]
        if pt.arrivals[ptk][1] != n:
            raise ProfileError(f"remote prefill {k}: {n} prompt tokens on the decode instance, "
                               f"{pt.arrivals[ptk][1]} on the prefill instance")
        steps = pt.prompt_steps(ptk)
        if not steps:
            continue
        first, last = pt.steps[steps[0]], pt.steps[steps[-1]]
        start = (pt.t0 + first.t) - (dt.t0 + dt.arrivals[dtk][0])
        tail = (dt.t0 + dt.remote_done[dtk]) - (pt.t0 + last.t + last.dt)
        xs.append(n)
        ys.append(start + tail)
        lat.append((pt.t0 + pt.arrivals[ptk][0]) - (dt.t0 + dt.arrivals[dtk][0]))
    if len(xs) < 2:
        raise ProfileError(f"only {len(xs)} isolated remote prefills to fit the transfer from")
    X = np.array([[1.0, x] for x in xs])
    y = np.array(ys)
    coef, _ = nnls(X, y)
    res = X @ coef - y
    return {"fixed_s": float(coef[0]), "s_per_token": float(coef[1]), "n": len(xs),
            "form": "(arrival at D to P's first step) + (P's last step's end to PrefillDone "
                    "at D) = fixed + s_per_token x prompt tokens",
            "rms_ms": float(1e3 * np.sqrt(np.mean(res ** 2))),
            "request_latency_ms_p50": float(1e3 * np.median(lat))}


def main(argv):
    p = argparse.ArgumentParser(prog="tandem profile", description=__doc__.split("\n\n")[0],
                                epilog="Flags it does not know go to every instance.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", "-m", metavar="PATH", help="GGUF file (default: the default model)")
    p.add_argument("--role", choices=("colocated", "both"), default="colocated",
                   help="one colocated instance, or a prefill and a decode instance and the "
                   "transfer between them (default colocated)")
    p.add_argument("--cpus", metavar="LIST",
                   help="cores to pin to (default 0 for colocated, 0,1 for both)")
    p.add_argument("--threads", type=int, default=1, metavar="T",
                   help="threads per instance (default 1)")
    p.add_argument("--out", metavar="FILE.json", help="write the profile here (default: stdout)")
    p.add_argument("--neighbour-cpus", metavar="LIST",
                   help="then run every load again on this instance and a second one of its "
                   "plan on these cores at once, for the step model beside a busy neighbour "
                   "(colocated; tandem plan charges it to instances sharing a machine)")
    p.add_argument("--quick", action="store_true", help="fewer, shorter loads (tests)")
    p.add_argument("--refit", metavar="DIR",
                   help="fit again from the traces and loads a run left in DIR (its work "
                   "directory, named in the profile) instead of measuring")
    args, extra = p.parse_known_args(argv)
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.neighbour_cpus and args.role != "colocated":
        p.error("--neighbour-cpus profiles colocated instances side by side (not --role both)")
    if args.cpus is None:
        n = args.threads * (1 if args.role == "colocated" else 2)
        args.cpus = ",".join(str(i % (os.cpu_count() or 1)) for i in range(n))
    stop_on_sigterm()
    try:
        prof = run(args, extra)
    except (ProfileError, TraceError, serve_bench.UsageError) as e:
        sys.stderr.write(f"\ntandem profile: {e}\n")
        return 1
    text = json.dumps(prof, indent=1) + "\n"
    if args.out:
        pathlib.Path(args.out).write_text(text)
        roles = ", ".join(f"{r}: step model rel. error p50 {s['fit']['rel_err_p50']:.1%} "
                          f"p90 {s['fit']['rel_err_p90']:.1%}" for r, s in prof["roles"].items())
        sys.stderr.write(f"tandem profile: wrote {args.out} ({roles})\n")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.stderr.write("\ntandem profile: interrupted\n")
        sys.exit(130)
