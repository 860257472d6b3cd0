"""tandem plan: the cheapest cluster that meets TTFT/TPOT SLO percentiles
for a workload.

  tandem plan --profile P.json [--profile Q.json ...] --workload W
              --slo ttft_p99:MS,tpot_p99:MS[,...] [--cost prefill=1,decode=1,colocated=1]
              [--max-instances N] [--max-cores C] [--margin 0.1] [--method sim|mean]
              [--config SHAPE] [--json] [--report plan.html] [--write-trace FILE]

Every configuration the profiles allow (K colocated instances for each
colocated profile; P prefill + D decode instances for each prefill/decode
profile; at most --max-instances in all) runs the workload through the
simulator (tandem simulate: the real scheduler and router scoring on a
virtual clock, step and transfer times from the profile). A configuration
meets the SLOs when every predicted percentile, raised by --margin, is
within its bound and no request fails; the cheapest such (by --cost) is
the answer (--cost is per core: an instance of T threads costs T times its
role's), with its neighbours, its bottleneck and the deployable result
(a kustomize overlay and KEDA thresholds). --method mean sizes the pools
with Dynamo's replica formula instead (averages and per-instance
throughput at the SLO), and simulates its answer for comparison.

SLO keys: ttft, tpot, itl, e2e, each with _p50, _p90, _p95, _p99 or _mean
(ms); goodput checks use ttft and tpot bounds as tandem bench --slo does.
--config SHAPE (colocated=K or prefill=P,decode=D) evaluates one shape only.
Exit 0 with an answer (also "no configuration meets the SLOs", which says
which SLO missed by how much and the best found), 1 when an input cannot be
used (one line naming it), 2 for bad usage.
"""

import argparse
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workload as wl  # noqa: E402

PROFILE_VERSION = 1
SLO_METRICS = ("ttft", "tpot", "itl", "e2e")
SLO_STATS = ("p50", "p90", "p95", "p99", "mean")
ROLE_KEYS = ("sched", "n_blocks", "block_size", "step", "fit", "overhead", "compat")
STEP_KEYS = ("c0", "c_tok", "c_tok2", "c_attn", "c_attn2", "c_ctx", "c_seq",
             "c_n2", "c_n4", "c_n8", "c_n16")
SIGNED_KEYS = ("c_n2", "c_n4", "c_n8", "c_n16")  # the hinges may lower the slope


class PlanError(Exception):
    pass


# ---------------------------------------------------------------- inputs

def parse_slo(text):
    slo = {}
    for part in text.split(","):
        key, sep, val = part.strip().partition(":")
        metric, _, stat = key.partition("_")
        if not sep or metric not in SLO_METRICS or stat not in SLO_STATS:
            raise PlanError(f"--slo: expected METRIC_STAT:MS with METRIC one of "
                            f"{', '.join(SLO_METRICS)} and STAT one of {', '.join(SLO_STATS)}, "
                            f"got {part!r}")
        try:
            ms = float(val)
        except ValueError:
            raise PlanError(f"--slo: {key} needs a number of milliseconds, got {val!r}")
        if not (ms > 0 and math.isfinite(ms)):
            raise PlanError(f"--slo: {key} must be > 0 ms")
        slo[key] = ms
    return slo


def parse_cost(text):
    cost = {"prefill": 1.0, "decode": 1.0, "colocated": 1.0}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        k, sep, v = part.strip().partition("=")
        if not sep or k not in cost:
            raise PlanError(f"--cost: expected prefill=X,decode=Y,colocated=Z, got {part!r}")
        try:
            cost[k] = float(v)
        except ValueError:
            raise PlanError(f"--cost: {k} needs a number, got {v!r}")
        if not (cost[k] >= 0 and math.isfinite(cost[k])):
            raise PlanError(f"--cost: {k} must be >= 0")
    return cost


def _need(o, key, kind, where):
    if not isinstance(o, dict) or key not in o:
        raise PlanError(f"{where}: missing {key}")
    v = o[key]
    ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
          if kind == "num" else isinstance(v, kind))
    if not ok:
        raise PlanError(f"{where}: {key} has the wrong type")
    return v


def check_role(r, where):
    if not isinstance(r, dict):
        raise PlanError(f"{where}: must be an object")
    for k in ROLE_KEYS:
        if k not in r:
            raise PlanError(f"{where}: missing {k}")
    check_step_model(r, where)
    for k in ("max_running", "max_batch_tokens", "max_waiting", "reserve_output_tokens",
              "max_ctx"):
        if _need(r["sched"], k, int, f"{where}.sched") < 0:
            raise PlanError(f"{where}.sched: {k} is negative")
    if _need(r, "n_blocks", int, where) < 1 or _need(r, "block_size", int, where) < 1:
        raise PlanError(f"{where}: n_blocks and block_size must be >= 1")
    _need(r["overhead"], "request_overhead_s", "num", f"{where}.overhead")


def check_step_model(m, where):
    """A step model as a profile holds it: its coefficients (m["step"]) and
    the scheduler's time per step (m["overhead"]["step_overhead_s"])."""
    for k in STEP_KEYS:
        v = _need(m["step"], k, "num", f"{where}.step")
        if (v < 0 and k not in SIGNED_KEYS) or abs(v) > 100:
            raise PlanError(f"{where}.step: {k} is {'negative' if v < 0 else 'too large'}")
    if not 0 <= _need(m["overhead"], "step_overhead_s", "num", f"{where}.overhead") < 10:
        raise PlanError(f"{where}.overhead: step_overhead_s must be 0 to 10 s")


def check_beside(b, where):
    """The step model measured beside a neighbour (tandem profile --neighbour-cpus)."""
    if not isinstance(b, dict) or not isinstance(b.get("step"), dict) or \
            not isinstance(b.get("overhead"), dict):
        raise PlanError(f"{where}: must be an object with step and overhead")
    check_step_model(b, where)


def load_profile(path):
    try:
        with open(path, encoding="utf-8") as f:
            p = json.load(f)
    except OSError as e:
        raise PlanError(f"--profile {path}: {e.strerror}")
    except ValueError as e:
        raise PlanError(f"--profile {path}: not JSON, or truncated ({e})")
    if not isinstance(p, dict) or "tandem_profile" not in p:
        raise PlanError(f"--profile {path}: not a tandem profile (tandem profile --out)")
    if p["tandem_profile"] != PROFILE_VERSION:
        raise PlanError(f"--profile {path}: profile version {p['tandem_profile']!r}; this "
                        f"tandem reads version {PROFILE_VERSION}")
    for k in ("model", "plan", "roles", "machine"):
        if not isinstance(p.get(k), dict):
            raise PlanError(f"--profile {path}: missing {k}")
    roles = p["roles"]
    if set(roles) not in ({"colocated"}, {"prefill", "decode"}):
        raise PlanError(f"--profile {path}: roles must be colocated, or prefill and decode")
    for name, r in roles.items():
        check_role(r, f"--profile {path}: roles.{name}")
        if "beside" in r:
            check_beside(r["beside"], f"--profile {path}: roles.{name}.beside")
    if p.get("speed_check") is not None:
        _need(p["speed_check"], "change", "num", f"--profile {path}: speed_check")
    extra = p.get("prompt_extra_tokens", 0)
    if not isinstance(extra, int) or isinstance(extra, bool) or not 0 <= extra < 64:
        raise PlanError(f"--profile {path}: prompt_extra_tokens must be an integer 0 to 63")
    if "prefill" in roles:
        t = p.get("transfer")
        if not isinstance(t, dict):
            raise PlanError(f"--profile {path}: a prefill/decode profile needs transfer")
        for k in ("fixed_s", "s_per_token"):
            if _need(t, k, "num", f"--profile {path}: transfer") < 0:
                raise PlanError(f"--profile {path}: transfer.{k} is negative")
    p["path"] = str(path)
    return p


def drift_warnings(profiles, margin):
    """The profiles whose machine changed speed while they were measured
    (the speed check: a load repeated at the end of the profile) by more
    than the margin: the predictions carry that error."""
    out = []
    for p in profiles:
        sc = p.get("speed_check")
        if sc and abs(sc["change"]) > margin:
            out.append(f"profile {p['path']}: the machine's speed moved by {sc['change']:+.0%} "
                       f"while it was profiled ({sc.get('load', 'a load')} repeated at the end); "
                       f"the predictions may be off by as much: take a --margin of at least "
                       f"{abs(sc['change']):.2f}, or profile again on a quieter machine")
    return out


def check_same_model(profiles, model_path):
    ids = {}
    for p in profiles:
        m = p["model"]
        ids.setdefault((m.get("size_bytes"), m.get("sha256_ends")), []).append(p)
    if len(ids) > 1:
        (a, *_), (b, *_) = list(ids.values())[:2]
        raise PlanError(f"profiles of different models: {a['path']} is of {a['model'].get('file')}"
                        f", {b['path']} of {b['model'].get('file')}")
    if model_path:
        sys.path.insert(0, str(HERE))
        from profiler import model_identity
        want = model_identity(model_path)
        have = profiles[0]["model"]
        if (want["size_bytes"], want["sha256_ends"]) != (have.get("size_bytes"),
                                                         have.get("sha256_ends")):
            raise PlanError(f"--model {model_path} is not the model profiled in "
                            f"{profiles[0]['path']} ({have.get('file')})")


def check_plan_flags(profiles, flags):
    """--plan-flags: the instance flags the plan is for; every profile must
    have been measured with them."""
    want = flags.split()
    for p in profiles:
        if p["plan"].get("flags", []) != want:
            raise PlanError(f"--profile {p['path']} was measured with the instance flags "
                            f"{' '.join(p['plan'].get('flags', [])) or '(none)'}, not "
                            f"{' '.join(want) or '(none)'}")


# ---------------------------------------------------------------- configurations

def instance(role_name, r, count, host=-1):
    x = {"role": role_name, "count": count, "n_blocks": r["n_blocks"],
         "block_size": r["block_size"], "sched": r["sched"],
         "step": {k: r["step"][k] for k in STEP_KEYS},
         "step_overhead_s": r["overhead"]["step_overhead_s"], "host": host}
    if host >= 0 and "beside" in r:
        b = r["beside"]
        x["beside"] = {"step": {k: b["step"][k] for k in STEP_KEYS},
                       "step_overhead_s": b["overhead"]["step_overhead_s"]}
    return x


def cluster(prof, shape, name, local_threshold, poll_ms, host_cores=0):
    """The simulator's cluster of a shape {"colocated": K} or {"prefill": P,
    "decode": D} on a profile, behind a router polling every poll_ms. With
    host_cores, colocated instances fill machines of that many cores in
    turn, and those that share one step at the profile's beside model
    while a neighbour steps (when the profile has it)."""
    roles = prof["roles"]
    c = {"name": name, "router": True, "poll_interval_s": poll_ms / 1000.0,
         "score": {"local_prefill_tokens": local_threshold}}
    if "colocated" in shape:
        r, k = roles["colocated"], shape["colocated"]
        per_host = max(1, host_cores // threads(prof)) if host_cores else 0
        if per_host > 1:  # an instance alone on its machine has no neighbour
            counts = [min(per_host, k - h * per_host) for h in range((k + per_host - 1) // per_host)]
            c["instances"] = [instance("colocated", r, n, h if n > 1 else -1)
                              for h, n in enumerate(counts)]
        else:
            c["instances"] = [instance("colocated", r, k)]
    else:
        r = roles["decode"]
        c["instances"] = [instance("prefill", roles["prefill"], shape["prefill"]),
                          instance("decode", r, shape["decode"])]
        c["xfer_fixed_s"] = prof["transfer"]["fixed_s"]
        c["xfer_s_per_token"] = prof["transfer"]["s_per_token"]
    c["score"]["reserve_output_tokens"] = r["sched"]["reserve_output_tokens"]
    c["request_overhead_s"] = max(0.0, r["overhead"]["request_overhead_s"])
    return c


def label_profiles(profiles):
    """A short label per profile: its threads per instance ("2t"), or its
    file's name where two profiles of a kind share that."""
    keys = [("colocated" in p["roles"], p["plan"].get("threads", 1)) for p in profiles]
    for p, k in zip(profiles, keys):
        p["label"] = (f"{k[1]}t" if keys.count(k) == 1
                      else pathlib.Path(p["path"]).stem)


def shape_name(shape, prof):
    if "colocated" in shape:
        return f"{shape['colocated']}C@{prof['label']}"
    return f"{shape['prefill']}P+{shape['decode']}D@{prof['label']}"


def threads(prof):
    t = prof["plan"].get("threads", 1)
    return t if isinstance(t, int) and not isinstance(t, bool) and t >= 1 else 1


def shape_cost(shape, cost, prof):
    """--cost is per core: an instance of T threads costs T times its role's."""
    return sum(cost[k] * v * threads(prof) for k, v in shape.items())


def shape_cores(shape, prof):
    return sum(shape.values()) * threads(prof)


def enumerate_shapes(profiles, max_instances, max_cores):
    out = []
    for i, p in enumerate(profiles):
        if "colocated" in p["roles"]:
            shapes = [{"colocated": k} for k in range(1, max_instances + 1)]
        else:
            shapes = [{"prefill": a, "decode": b} for a in range(1, max_instances)
                      for b in range(1, max_instances - a + 1)]
        out += [(i, s) for s in shapes if not max_cores or shape_cores(s, p) <= max_cores]
    return out


def parse_config(text, profiles):
    shape = {}
    for part in text.split(","):
        k, sep, v = part.strip().partition("=")
        if not sep or k not in ("colocated", "prefill", "decode") or not v.isdigit() or int(v) < 1:
            raise PlanError(f"--config: expected colocated=K or prefill=P,decode=D, got {text!r}")
        shape[k] = int(v)
    if set(shape) not in ({"colocated"}, {"prefill", "decode"}):
        raise PlanError(f"--config: expected colocated=K or prefill=P,decode=D, got {text!r}")
    for i, p in enumerate(profiles):
        if ("colocated" in shape) == ("colocated" in p["roles"]):
            return [(i, shape)]
    raise PlanError(f"--config {text}: no profile of that kind (give a "
                    f"{'colocated' if 'colocated' in shape else 'prefill/decode'} profile)")


# ---------------------------------------------------------------- simulation

def goodput_bounds(slo):
    """The bounds a good request must hold, as tandem bench --slo takes them
    (ttft:MS,tpot:MS): the tightest SLO of each metric."""
    bounds = {}
    for k, v in slo.items():
        m = k.split("_")[0]
        if m in ("ttft", "tpot", "e2e"):
            bounds[m] = min(bounds.get(m, v), v)
    return ",".join(f"{m}:{v:g}" for m, v in bounds.items())


def simulate(clusters, sim_workload, slo, workdir):
    tandem = os.environ.get("TANDEM_BIN") or str(HERE.parent.parent / "build" / "tandem")
    cpath = workdir / "clusters.json"
    cpath.write_text(json.dumps(clusters))
    argv = [tandem, "simulate", "--cluster", str(cpath), "--workload", str(sim_workload)]
    bench_slo = goodput_bounds(slo)
    if bench_slo:
        argv += ["--slo", bench_slo]
    try:
        p = subprocess.run(argv, capture_output=True, text=True)
    except OSError as e:
        raise PlanError(f"cannot run {tandem}: {e.strerror} (set TANDEM_BIN)")
    if p.returncode != 0:
        raise PlanError(p.stderr.strip().splitlines()[-1] if p.stderr.strip() else
                        f"tandem simulate exited {p.returncode}")
    return json.loads(p.stdout)


def stat_of(res, key):
    m, stat = key.split("_")
    v = res[f"{m}_ms"][stat]
    return v


def verdict(res, slo, margin):
    """(meets, {slo key: (predicted, bound, predicted x (1 + margin) / bound)})."""
    detail = {}
    ok = res["failed"] == 0
    for k, bound in slo.items():
        v = stat_of(res, k)
        if v is None:  # no request had this figure (e.g. TPOT of one-token outputs)
            continue
        ratio = v * (1 + margin) / bound
        detail[k] = (v, bound, ratio)
        ok = ok and ratio <= 1.0
    return ok, detail


def bottleneck(res, shape, prof, summary):
    busy = res["busy"]
    if "colocated" in shape:
        share = max(busy) if busy else 0
        if res["preemptions"] > 0 or (res["max_router_queue"] > 0 and share < 0.85):
            return "KV capacity"
        return "compute (colocated: prefill and decode share it)"
    p_busy = max(busy[: shape["prefill"]])
    d_busy = max(busy[shape["prefill"]:])
    if res["preemptions"] > 0 or (res["max_router_queue"] > 0 and d_busy < 0.85):
        return "KV capacity"
    t = prof["transfer"]
    xfer_ms = 1e3 * (t["fixed_s"] + t["s_per_token"] * summary["input_mean"])
    ttft = res["ttft_ms"]["p50"] or 0
    if ttft > 0 and xfer_ms > 0.5 * ttft and res["remote_prefills"] > 0:
        return "transfer"
    return "prefill compute" if p_busy >= d_busy else "decode compute"


# ---------------------------------------------------------------- Dynamo's method

def step_time(role, n_tok, pos_tokens, n_seq):
    """The step model at a batch of n_seq entries, each chunk n_tok / n_seq
    after pos_tokens."""
    s = role["step"]
    ovh = role["overhead"]["step_overhead_s"]
    chunk = n_tok / n_seq
    lo, hi = pos_tokens, pos_tokens + chunk
    a = n_seq * (hi * (hi + 1) - lo * (lo + 1)) / 2.0
    a2 = n_seq * (hi * (hi + 1) * (2 * hi + 1) - lo * (lo + 1) * (2 * lo + 1)) / 6.0
    return (s["c0"] + s["c_tok"] * n_tok + s["c_tok2"] * n_tok ** 2 + s["c_attn"] * a
            + s["c_attn2"] * a2 + s["c_ctx"] * n_seq * hi + s["c_seq"] * n_seq + ovh
            + sum(s[f"c_n{k}"] * max(0.0, n_tok - k) for k in (2, 4, 8, 16)))


def prefill_time(role, isl):
    """An isolated prompt's prefill, in chunks of max_batch_tokens."""
    mbt = role["sched"]["max_batch_tokens"]
    t, done = 0.0, 0
    while done < isl:
        k = min(mbt, isl - done)
        t += step_time(role, k, done, 1)
        done += k
    return t


def decode_throughput(role, ctx, itl_ms):
    """Dynamo's decode interpolation: the most tokens/s one instance gives
    at context ctx with each step within the ITL bound (and the KV pool)."""
    cap = role["n_blocks"] * role["block_size"] // max(1, int(ctx))
    best = 0.0
    for b in range(1, min(role["sched"]["max_running"], max(cap, 1)) + 1):
        t = step_time(role, b, ctx, b)
        if itl_ms is None or 1e3 * t <= itl_ms:
            best = max(best, b / t)
    return best


def mean_method(profiles, summary, slo, cost, max_instances):
    """Dynamo's replica formula (docs: planner, SLA-based): prefill replicas
    = ceil(rate x ISL / prefill throughput per replica), decode replicas =
    ceil(rate x OSL / decode throughput per replica at the ITL target), from
    the mean ISL, OSL and rate alone. Colocated instances share the two
    loads: ceil(rate ISL / prefill tput + rate OSL / decode tput)."""
    rate, isl, osl = summary["rate"], summary["input_mean"], summary["output_mean"]
    itl = min([v for k, v in slo.items() if k.startswith(("tpot_", "itl_"))], default=None)
    best = None
    for i, p in enumerate(profiles):
        roles = p["roles"]
        if "colocated" in roles:
            r = roles["colocated"]
            tp = isl / prefill_time(r, int(round(isl)))
            td = decode_throughput(r, isl + osl / 2, itl)
            k = math.ceil(rate * isl / tp + (rate * osl / td if td > 0 else math.inf))
            shape = {"colocated": max(1, k)} if math.isfinite(k) else None
        else:
            tp = isl / prefill_time(roles["prefill"], int(round(isl)))
            td = decode_throughput(roles["decode"], isl + osl / 2, itl)
            if td <= 0:
                continue
            shape = {"prefill": max(1, math.ceil(rate * isl / tp)),
                     "decode": max(1, math.ceil(rate * osl / td))}
        if shape is None:
            continue
        c = shape_cost(shape, cost, p)
        n = sum(shape.values())
        if best is None or c < best[2]:
            best = (i, shape, c, n, {"prefill_tokens_per_s": tp, "decode_tokens_per_s": td})
    return best


# ---------------------------------------------------------------- output

def kustomize_patch(prof, shape, local_threshold):
    """A kustomize overlay (over deploy/k8s/base) for the shape."""
    lines = ["# tandem plan: an overlay of deploy/k8s/base (kustomize build)",
             "apiVersion: kustomize.config.k8s.io/v1beta1", "kind: Kustomization",
             "resources:", "  - ../../base", "replicas:"]
    colocated = "colocated" in shape
    if colocated:
        # colocated instances stand in the decode pool: the decode Deployment
        # runs tandem serve (behind the router, with the cluster token)
        lines += ["  - name: tandem-decode", f"    count: {shape['colocated']}",
                  "  - name: tandem-prefill", "    count: 0"]
        r = prof["roles"]["colocated"]
    else:
        lines += ["  - name: tandem-prefill", f"    count: {shape['prefill']}",
                  "  - name: tandem-decode", f"    count: {shape['decode']}"]
        r = prof["roles"]["decode"]
    plan = prof["plan"]
    lines += ["configMapGenerator:", "  - name: tandem-flags", "    behavior: merge",
              "    literals:", f"      - TANDEM_THREADS=\"{plan.get('threads', 1)}\"",
              f"      - TANDEM_MAX_RUNNING=\"{r['sched']['max_running']}\"",
              f"      - TANDEM_MAX_BATCH_TOKENS=\"{r['sched']['max_batch_tokens']}\"",
              "patches:", "  - target: {kind: Deployment, name: tandem-router}", "    patch: |-",
              "      - op: add", "        path: /spec/template/spec/containers/0/args/-",
              "        value: --local-prefill-threshold", "      - op: add",
              "        path: /spec/template/spec/containers/0/args/-",
              f"        value: \"{local_threshold}\""]
    if colocated:
        serve = ["serve", "--host", "0.0.0.0", "--port", "8200", "--grpc-port", "50200",
                 "--cluster-token-file", "/var/run/tandem/cluster-token/token", "--instance-id",
                 "$(POD_NAME)", "--model", "$(TANDEM_MODEL)", "--threads", "$(TANDEM_THREADS)",
                 "--kv-memory", "$(TANDEM_KV_MEMORY)", "--max-running", "$(TANDEM_MAX_RUNNING)",
                 "--max-batch-tokens", "$(TANDEM_MAX_BATCH_TOKENS)", "--drain-timeout",
                 "$(TANDEM_DECODE_DRAIN_TIMEOUT)"]
        lines += ["  - target: {kind: Deployment, name: tandem-decode}", "    patch: |-",
                  "      - op: replace", "        path: /spec/template/spec/containers/0/command",
                  "        value: [/usr/local/bin/tandem]", "      - op: replace",
                  "        path: /spec/template/spec/containers/0/args",
                  f"        value: {json.dumps(serve)}"]
    flags = plan.get("flags") or []
    if flags:
        for dep in ("tandem-prefill", "tandem-decode"):
            lines += [f"  - target: {{kind: Deployment, name: {dep}}}", "    patch: |-"]
            for f in flags:
                lines += ["      - op: add", "        path: /spec/template/spec/containers/0/args/-",
                          f"        value: {json.dumps(f)}"]
    return "\n".join(lines) + "\n"


def keda_thresholds(prof, shape, summary, slo):
    """The thresholds of deploy/k8s/overlays/autoscale that hold the shape:
    a prefill pod per the prompt tokens it clears within the TTFT bound,
    a decode pod per the requests that can wait one TTFT bound."""
    ttft = min([v for k, v in slo.items() if k.startswith("ttft_")], default=None)
    budget = (ttft or 2000.0) / 1e3
    out = {}
    if "colocated" in shape:
        r = prof["roles"]["colocated"]
    else:
        rp = prof["roles"]["prefill"]
        tput = summary["input_mean"] / prefill_time(rp, max(1, int(round(summary["input_mean"]))))
        out["tandem-prefill"] = {"query": "tandem:prefill_queue_tokens",
                                 "threshold": max(1, int(tput * budget))}
        r = prof["roles"]["decode"]
    per_req = prefill_time(r, max(1, int(round(summary["input_mean"]))))
    out["tandem-decode"] = {"query": "vllm:num_requests_waiting",
                            "threshold": max(1, int(budget / max(per_req, 1e-6)))}
    return out


def miss_text(k, m, margin):
    if k == "failed_requests":
        return f"{m['predicted']} failed requests"
    if m["over_pct"] > 0:
        return f"{k} by {m['over_pct']:.0f}% ({fmt_ms(m['predicted'])} ms against {m['bound']:g})"
    return (f"{k} by {m['over_pct_with_margin']:.0f}% with the {margin:.0%} margin "
            f"({fmt_ms(m['predicted'])} ms against {m['bound']:g})")


def fmt_ms(v):
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def print_text(out, f):
    w = f.write
    for x in out["warnings"]:
        w(f"warning: {x}\n")
    s = out["workload"]
    w(f"workload: {s.get('file', '')} {s['requests']} requests, {s['rate']:.3g} req/s, mean "
      f"input {s['input_mean']:.0f}, output {s['output_mean']:.0f} tokens\n")
    w(f"SLOs: {', '.join(f'{k} {v:g} ms' for k, v in out['slo'].items())} (margin "
      f"{out['margin']:.0%}); method {out['method']}\n\n")
    keys = list(out["slo"])
    w(f"{'config':<10} {'cost':>5} {'meets':>5}  " + "  ".join(f"{k:>10}" for k in keys)
      + f"  {'goodput':>8}  bottleneck\n")
    for c in out["configs"]:
        w(f"{c['config']:<10} {c['cost']:>5g} {'yes' if c['meets'] else 'no':>5}  "
          + "  ".join(f"{fmt_ms(c['predicted'].get(k)):>10}" for k in keys)
          + f"  {c['goodput_fraction']:>8.1%}  {c['bottleneck']}\n")
    w("\n")
    ch = out["answer"]
    if ch:
        w(f"answer: {ch['config']} (cost {ch['cost']:g}), profile {ch['profile']}\n")
        w("  predicted: " + ", ".join(f"{k} {fmt_ms(v)} ms" for k, v in ch["predicted"].items())
          + f"; goodput {ch['goodput_fraction']:.1%} of requests\n")
        w(f"  bottleneck: {ch['bottleneck']}\n")
        w("  KEDA thresholds: " + ", ".join(f"{d} {v['query']} > {v['threshold']}"
                                            for d, v in out["keda"].items()) + "\n")
        w("  kustomize overlay:\n" + "".join(f"    {x}\n" for x in out["kustomize"].splitlines()))
    else:
        b = out["best"]
        w(f"no configuration within {out['max_instances']} instances meets the SLOs; the best, "
          f"{b['config']}, misses " + ", ".join(miss_text(k, m, out["margin"])
                                               for k, m in b["misses"].items()) + "\n")


def main(argv):
    p = argparse.ArgumentParser(prog="tandem plan", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", action="append", required=True, metavar="P.json",
                   help="a tandem profile (repeatable)")
    p.add_argument("--workload", required=True, metavar="W",
                   help="a description (.json) or a trace (Azure, BurstGPT, Mooncake)")
    p.add_argument("--slo", required=True, metavar="KEY:MS,...",
                   help="the SLO percentiles, e.g. ttft_p99:3000,tpot_p99:100")
    p.add_argument("--cost", metavar="ROLE=X,...",
                   help="cost per core of each role (default prefill=1,decode=1,colocated=1)")
    p.add_argument("--max-instances", type=int, default=8, metavar="N",
                   help="at most this many instances in all (default 8)")
    p.add_argument("--max-cores", type=int, default=0, metavar="C",
                   help="at most this many cores in all (instances x threads; default no bound)")
    p.add_argument("--margin", type=float, default=0.10, metavar="F",
                   help="predictions are raised by this share before the check (default 0.10)")
    p.add_argument("--method", choices=("sim", "mean"), default="sim",
                   help="sim: the simulator over every configuration; mean: Dynamo's replica "
                   "formula from the averages (default sim)")
    p.add_argument("--config", metavar="SHAPE",
                   help="evaluate one shape only: colocated=K or prefill=P,decode=D")
    p.add_argument("--model", metavar="PATH",
                   help="the model the plan is for (checked against the profiles)")
    p.add_argument("--local-prefill-threshold", type=int, default=512, metavar="N",
                   help="the router's: prompts with fewer uncached tokens are prefilled on the "
                   "decode instance (default 512)")
    p.add_argument("--poll-interval-ms", type=float, default=100, metavar="MS",
                   help="the router's state polls, as its --poll-interval-ms: the simulated "
                   "router sees the instances as of its last poll (default 100; 0: exact)")
    p.add_argument("--host-cores", type=int, default=0, metavar="C",
                   help="the instances share machines of C cores, filled in turn: those "
                   "sharing one are charged the step model their profile measured beside a "
                   "busy neighbour (a side-by-side profile) while a neighbour steps "
                   "(default 0: a machine each)")
    p.add_argument("--plan-flags", metavar="FLAGS",
                   help="the instance flags the plan is for (checked against the profiles)")
    p.add_argument("--trace-format", default="auto", metavar="FMT",
                   help="a trace's format: auto, azure, burstgpt, mooncake (default auto)")
    p.add_argument("--trace-speed", type=float, default=1.0, metavar="X",
                   help="a trace replayed this many times faster (default 1)")
    p.add_argument("--trace-length-scale", type=float, default=1.0, metavar="X",
                   help="a trace's lengths scaled (default 1)")
    p.add_argument("--num-requests", type=int, metavar="N",
                   help="take the first N requests of the workload")
    p.add_argument("--write-trace", metavar="FILE",
                   help="write the workload as a Mooncake trace, for tandem bench to replay")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--report", metavar="FILE.html",
                   help="write a self-contained HTML report here")
    p.add_argument("--validation", action="append", default=[], metavar="BENCH.json",
                   help="a tandem bench --json report of a real run of the answer (for the report)")
    args = p.parse_args(argv)
    try:
        out = run(args)
    except (PlanError, wl.WorkloadError) as e:
        sys.stderr.write(f"tandem plan: {e}\n")
        return 1
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print_text(out, sys.stdout)
    return 0


def run(args):
    t_start = time.monotonic()
    if args.max_instances < 1 or args.max_instances > 64:
        raise PlanError("--max-instances must be 1 to 64")
    if not 0 <= args.local_prefill_threshold <= 1 << 24:
        raise PlanError("--local-prefill-threshold must be 0 to 2^24")
    if not (args.poll_interval_ms == 0 or 1 <= args.poll_interval_ms <= 60000):
        raise PlanError("--poll-interval-ms must be 0 or 1 to 60000")
    if not 0 <= args.host_cores <= 4096:
        raise PlanError("--host-cores must be 0 to 4096")
    if not (0 <= args.margin < 10):
        raise PlanError("--margin must be in [0, 10)")
    slo = parse_slo(args.slo)
    cost = parse_cost(args.cost)
    profiles = [load_profile(x) for x in args.profile]
    label_profiles(profiles)
    check_same_model(profiles, args.model)
    if args.plan_flags is not None:
        check_plan_flags(profiles, args.plan_flags)
    rows, summary, scale = wl.load(args.workload, args.trace_format, args.trace_speed,
                                   args.trace_length_scale, args.num_requests)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="tandem-plan-"))
    try:
        return plan_in(args, t_start, slo, cost, profiles, rows, summary, scale, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def plan_in(args, t_start, slo, cost, profiles, rows, summary, scale, workdir):
    if args.write_trace:
        wl.write_mooncake(rows, args.write_trace)
    wpath = workdir / "workload.jsonl"
    wl.write_sim(rows, scale, profiles[0].get("prompt_extra_tokens", 0), wpath)

    mean = None
    if args.config:
        shapes = parse_config(args.config, profiles)
    elif args.method == "mean":
        mean = mean_method(profiles, summary, slo, cost, args.max_instances)
        if mean is None:
            raise PlanError("the mean method found no throughput within the SLOs")
        shapes = [(mean[0], mean[1])]
    else:
        shapes = enumerate_shapes(profiles, args.max_instances, args.max_cores)
        if not shapes:
            raise PlanError(f"no configuration fits in --max-cores {args.max_cores}")
    clusters = [cluster(profiles[i], s, shape_name(s, profiles[i]), args.local_prefill_threshold,
                        args.poll_interval_ms, args.host_cores)
                for i, s in shapes]
    results = simulate(clusters, wpath, slo, workdir)
    configs = []
    for (i, shape), cl, res in zip(shapes, clusters, results):
        ok, detail = verdict(res, slo, args.margin)
        configs.append({
            "config": shape_name(shape, profiles[i]), "shape": shape,
            "profile": profiles[i]["path"], "cost": shape_cost(shape, cost, profiles[i]),
            "instances": sum(shape.values()), "cores": shape_cores(shape, profiles[i]),
            "meets": ok,
            # steps charged at the profile's beside model: instances sharing a machine
            "neighbours_modelled": any("beside" in x for x in cl["instances"]),
            "predicted": {k: stat_of(res, k) for k in slo},
            "margin_ratio": {k: d[2] for k, d in detail.items()},
            "failed": res["failed"],
            "goodput_fraction": (res["good_requests"] or 0) / max(1, res["num_prompts"]),
            "goodput_rps": res["goodput"], "bottleneck": bottleneck(res, shape, profiles[i],
                                                                     summary),
            "result": res})
    configs.sort(key=lambda c: (c["cost"], c["instances"], c["config"]))
    meeting = [c for c in configs if c["meets"]]
    answer = meeting[0] if meeting else None
    out = {"tandem_plan": 1, "method": args.method, "workload": summary, "slo": slo,
           "margin": args.margin, "max_instances": args.max_instances, "cost": cost,
           "host_cores": args.host_cores,
           "warnings": drift_warnings(profiles, args.margin),
           "answer": answer, "configs": configs,
           "wall_s": time.monotonic() - t_start,
           "simulated_requests": len(rows) * len(configs),
           "profiles": [{"path": x["path"], "model": x["model"], "plan": x["plan"],
                         "machine": x["machine"].get("cpu")} for x in profiles]}
    if mean:
        out["mean_method"] = {"shape": mean[1], **mean[4]}
    if answer:
        prof = profiles[[x["path"] for x in profiles].index(answer["profile"])]
        out["kustomize"] = kustomize_patch(prof, answer["shape"], args.local_prefill_threshold)
        out["keda"] = keda_thresholds(prof, answer["shape"], summary, slo)
        same = [c for c in configs if c["profile"] == answer["profile"] and c is not answer]
        same.sort(key=lambda c: abs(c["cost"] - answer["cost"]))
        out["neighbours"] = [c["config"] for c in same[:3]]
    else:
        def worst(c):
            return max(c["margin_ratio"].values(), default=math.inf) + (c["failed"] > 0)
        best = min(configs, key=worst)
        out["best"] = {"config": best["config"], "misses": {
            k: {"predicted": best["predicted"][k], "bound": slo[k],
                "over_pct": 100.0 * (best["predicted"][k] / slo[k] - 1),
                "over_pct_with_margin": 100.0 * (r - 1)}
            for k, r in best["margin_ratio"].items() if r > 1.0}}
        if best["failed"]:
            out["best"]["misses"]["failed_requests"] = {"predicted": best["failed"], "bound": 0,
                                                       "over_pct": None}
    for c in configs:  # the per-config result stays in --json, trimmed
        c["result"] = {k: c["result"][k] for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "busy",
                                                    "preemptions", "remote_prefills",
                                                    "max_router_queue", "steps", "steps_beside",
                                                    "cdf",
                                                    "sim_requests_per_s", "duration_s")}
    if args.report:
        import report
        runs = []
        for v in args.validation:
            try:
                runs.append(json.loads(pathlib.Path(v).read_text()))
            except (OSError, ValueError) as e:
                raise PlanError(f"--validation {v}: not a readable tandem bench --json report ({e})")
            if not isinstance(runs[-1], dict) or "ttft_ms" not in runs[-1]:
                raise PlanError(f"--validation {v}: not a tandem bench --json report")
        try:
            report.write(out, args.report, runs)
        except OSError as e:
            raise PlanError(f"--report {args.report}: {e.strerror}")
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
