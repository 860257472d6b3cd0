"""Workloads for tandem plan: a trace file (Azure, BurstGPT, Mooncake: read
by tandem bench's own reader) or a JSON description of distributions, made
into requests, into the simulator's workload (JSON Lines of segments) and
into a Mooncake trace that `tandem bench --trace` replays with the same
timing and prefix sharing.

A description (every field but "rate" optional):
  {"rate": 2.0,                            requests/s (mean)
   "arrival": "poisson" | "bursty",        bursty: gamma inter-arrivals whose
   "burst_factor": 3,                      coefficient of variation is this
   "num_requests": 1000, "duration_s": S,  how many (default 1000), or for how long
   "diurnal": [[0, 0.5], [0.5, 1.5], [1, 0.5]],
                                           the rate's multiplier over the run
                                           (fraction of duration_s, piecewise linear)
   "input": DIST, "output": DIST,          prompt and output tokens
   "shared_prefix": {"share": 0.5, "tokens": 512, "groups": 2},
                                           that share of requests starts with one of
                                           `groups` shared prefixes (a multiple of 512
                                           tokens: Mooncake's block)
   "seed": 1}
DIST: {"fixed": N} | {"uniform": [LO, HI]} |
      {"lognormal": {"median": M, "sigma": S, "min": 1, "max": MAX}} |
      {"histogram": [[LO, HI, WEIGHT], ...]} | {"empirical": [N, ...]} |
      {"mixture": [[WEIGHT, DIST], ...]}
"""

import json
import math
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench"))

import serve_bench  # noqa: E402

BLOCK = serve_bench.MOONCAKE_BLOCK
BOS_SEGMENT = 1 << 62  # the tokens the server adds to every prompt (BOS): shared by all
MAX_TOKENS = 1 << 20
MAX_REQUESTS = 1 << 22


class WorkloadError(Exception):
    pass


def _num(o, k, lo, hi, where, default=None, integer=False):
    v = o.get(k, default)
    if v is None:
        raise WorkloadError(f"{where}: {k} is required")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise WorkloadError(f"{where}: {k} must be a{'n integer' if integer else ' number'}")
    if not (lo <= v <= hi) or (isinstance(v, float) and not math.isfinite(v)):
        raise WorkloadError(f"{where}: {k} must be in [{lo}, {hi}], got {v}")
    return v


def make_dist(d, where):
    """A sampler rng -> tokens (>= 1) and its mean, from a DIST."""
    if not isinstance(d, dict) or len(d) != 1:
        raise WorkloadError(f"{where}: a distribution is one of fixed, uniform, lognormal, "
                            "histogram, empirical, mixture")
    (kind, v), = d.items()
    if kind == "fixed":
        n = _num(d, "fixed", 1, MAX_TOKENS, where, integer=True)
        return (lambda rng: n), float(n)
    if kind == "uniform":
        if not (isinstance(v, list) and len(v) == 2):
            raise WorkloadError(f"{where}: uniform is [LO, HI]")
        lo = _num({"lo": v[0]}, "lo", 1, MAX_TOKENS, where, integer=True)
        hi = _num({"hi": v[1]}, "hi", lo, MAX_TOKENS, where, integer=True)
        return (lambda rng: rng.randint(lo, hi)), (lo + hi) / 2.0
    if kind == "lognormal":
        if not isinstance(v, dict):
            raise WorkloadError(f"{where}: lognormal is {{median, sigma, min, max}}")
        med = _num(v, "median", 1, MAX_TOKENS, where)
        sig = _num(v, "sigma", 0, 5, where)
        lo = _num(v, "min", 1, MAX_TOKENS, where, default=1, integer=True)
        hi = _num(v, "max", lo, MAX_TOKENS, where, default=MAX_TOKENS, integer=True)
        mu = math.log(med)
        f = lambda rng: min(hi, max(lo, int(round(rng.lognormvariate(mu, sig)))))  # noqa: E731
        r = random.Random(12345)
        return f, sum(f(r) for _ in range(4000)) / 4000.0
    if kind == "histogram":
        if not isinstance(v, list) or not v:
            raise WorkloadError(f"{where}: histogram is [[LO, HI, WEIGHT], ...]")
        bins = []
        for k, b in enumerate(v):
            w = f"{where}: histogram[{k}]"
            if not (isinstance(b, list) and len(b) == 3):
                raise WorkloadError(f"{w}: a bin is [LO, HI, WEIGHT]")
            lo = _num({"lo": b[0]}, "lo", 1, MAX_TOKENS, w, integer=True)
            hi = _num({"hi": b[1]}, "hi", lo, MAX_TOKENS, w, integer=True)
            bins.append((lo, hi, _num({"weight": b[2]}, "weight", 0, 1e12, w)))
        total = sum(b[2] for b in bins)
        if total <= 0:
            raise WorkloadError(f"{where}: histogram weights sum to 0")
        weights = [b[2] for b in bins]
        f = lambda rng: (lambda b: rng.randint(b[0], b[1]))(  # noqa: E731
            rng.choices(bins, weights)[0])
        return f, sum(b[2] * (b[0] + b[1]) / 2.0 for b in bins) / total
    if kind == "empirical":
        if not isinstance(v, list) or not v or len(v) > 1 << 20:
            raise WorkloadError(f"{where}: empirical is a non-empty list of lengths")
        vals = [_num({"n": x}, "n", 1, MAX_TOKENS, f"{where}: empirical", integer=True) for x in v]
        return (lambda rng: rng.choice(vals)), sum(vals) / len(vals)
    if kind == "mixture":
        if not isinstance(v, list) or not v:
            raise WorkloadError(f"{where}: mixture is [[WEIGHT, DIST], ...]")
        parts = []
        for k, c in enumerate(v):
            w = f"{where}: mixture[{k}]"
            if not (isinstance(c, list) and len(c) == 2):
                raise WorkloadError(f"{w}: a component is [WEIGHT, DIST]")
            parts.append((_num({"weight": c[0]}, "weight", 0, 1e12, w), make_dist(c[1], w)))
        total = sum(p[0] for p in parts)
        if total <= 0:
            raise WorkloadError(f"{where}: mixture weights sum to 0")
        weights = [p[0] for p in parts]
        f = lambda rng: rng.choices(parts, weights)[0][1][0](rng)  # noqa: E731
        return f, sum(p[0] * p[1][1] for p in parts) / total
    raise WorkloadError(f"{where}: unknown distribution '{kind}'")


def _diurnal(curve, where):
    if not isinstance(curve, list) or len(curve) < 2:
        raise WorkloadError(f"{where}: diurnal is [[FRACTION, MULTIPLIER], ...] (>= 2 points)")
    pts = []
    for k, p in enumerate(curve):
        if not (isinstance(p, list) and len(p) == 2):
            raise WorkloadError(f"{where}: diurnal[{k}] is [FRACTION, MULTIPLIER]")
        pts.append((_num({"x": p[0]}, "x", 0, 1, where), _num({"m": p[1]}, "m", 0, 1e3, where)))
    if [p[0] for p in pts] != sorted(p[0] for p in pts) or pts[0][0] != 0 or pts[-1][0] != 1:
        raise WorkloadError(f"{where}: diurnal fractions run from 0 to 1 in order")

    def m(x):
        for (x0, m0), (x1, m1) in zip(pts, pts[1:]):
            if x <= x1:
                return m0 if x1 == x0 else m0 + (m1 - m0) * (x - x0) / (x1 - x0)
        return pts[-1][1]
    return m, max(p[1] for p in pts)


def generate(spec, where="workload"):
    """The requests of a description: [(t s, input tokens, output tokens,
    hash ids)] in time order, and a summary of it."""
    if not isinstance(spec, dict):
        raise WorkloadError(f"{where}: a workload description is a JSON object")
    known = {"rate", "arrival", "burst_factor", "num_requests", "duration_s", "diurnal", "input",
             "output", "shared_prefix", "seed", "name"}
    extra = sorted(set(spec) - known)
    if extra:
        raise WorkloadError(f"{where}: unknown field {extra[0]!r}")
    rate = _num(spec, "rate", 1e-6, 1e6, where)
    arrival = spec.get("arrival", "poisson")
    if arrival not in ("poisson", "bursty"):
        raise WorkloadError(f"{where}: arrival is poisson or bursty")
    cv = _num(spec, "burst_factor", 0.01, 100, where, default=1.0) if arrival == "bursty" else 1.0
    seed = _num(spec, "seed", 0, 2 ** 63, where, default=1, integer=True)
    dur = spec.get("duration_s")
    if dur is not None:
        dur = _num(spec, "duration_s", 1e-3, 1e7, where)
    n = _num(spec, "num_requests", 1, MAX_REQUESTS, where, default=None if dur else 1000,
             integer=True) if "num_requests" in spec or dur is None else None
    curve = None
    if "diurnal" in spec:
        if dur is None:
            raise WorkloadError(f"{where}: a diurnal curve needs duration_s")
        curve = _diurnal(spec["diurnal"], where)
    inp, in_mean = make_dist(spec.get("input", {"fixed": 256}), f"{where}: input")
    out, out_mean = make_dist(spec.get("output", {"fixed": 64}), f"{where}: output")
    sp = spec.get("shared_prefix")
    share = tokens = groups = 0
    if sp is not None:
        if not isinstance(sp, dict):
            raise WorkloadError(f"{where}: shared_prefix is {{share, tokens, groups}}")
        share = _num(sp, "share", 0, 1, f"{where}: shared_prefix")
        tokens = _num(sp, "tokens", BLOCK, MAX_TOKENS, f"{where}: shared_prefix", integer=True)
        groups = _num(sp, "groups", 1, 1 << 16, f"{where}: shared_prefix", default=1,
                      integer=True)
        if tokens % BLOCK:
            raise WorkloadError(f"{where}: shared_prefix.tokens must be a multiple of {BLOCK} "
                                "(Mooncake's block of hashed tokens)")
    rng = random.Random(seed)
    peak = rate * (curve[1] if curve else 1.0)
    shape = 1.0 / (cv * cv)
    rows, t = [], 0.0
    next_id = 1 << 40  # unique block ids, above the shared ones
    while True:
        gap = rng.gammavariate(shape, 1.0 / (shape * peak)) if arrival == "bursty" \
            else rng.expovariate(peak)
        t += gap
        if dur is not None and t > dur:
            break
        if curve and rng.random() * curve[1] > curve[0](t / dur):
            continue  # thinned: the curve is below its peak here
        n_in, n_out = inp(rng), out(rng)
        ids = []
        if share and rng.random() < share:
            g = rng.randrange(groups)
            ids = [g * 4096 + k for k in range(tokens // BLOCK)]
            n_in += tokens
        own = (n_in - len(ids) * BLOCK + BLOCK - 1) // BLOCK
        ids += list(range(next_id, next_id + own))
        next_id += own
        rows.append((t, n_in, n_out, ids))
        if n is not None and len(rows) >= n:
            break
        if len(rows) >= MAX_REQUESTS:
            raise WorkloadError(f"{where}: more than {MAX_REQUESTS} requests")
    if not rows:
        raise WorkloadError(f"{where}: no request arrives within duration_s")
    t0 = rows[0][0]  # from 0, in whole ms as a Mooncake trace holds them
    rows = [(round((r[0] - t0) * 1000) / 1000.0, *r[1:]) for r in rows]
    summary = {"kind": "description", "requests": len(rows), "rate": rate, "arrival": arrival,
               "burst_factor": cv, "input_mean": in_mean + share * tokens,
               "output_mean": out_mean, "shared_prefix_share": share, "seed": seed}
    return rows, summary


def load(path, trace_format="auto", speed=1.0, length_scale=1.0, limit=None):
    """A workload file: a description (.json) or a trace (tandem bench's
    formats). Returns (rows, summary, scale) where scale is the tokens of
    one Mooncake block over 512 (length_scale for traces)."""
    if str(path).endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                spec = json.load(f)
        except OSError as e:
            raise WorkloadError(f"{path}: {e.strerror}")
        except ValueError as e:
            raise WorkloadError(f"{path}: not JSON ({e})")
        rows, summary = generate(spec, str(path))
        summary["file"] = str(path)
        return rows[:limit] if limit else rows, summary, 1.0
    notes = set()
    try:
        fmt, rows = serve_bench.read_trace(str(path), trace_format, notes)
    except serve_bench.UsageError as e:
        raise WorkloadError(str(e).replace("--trace ", ""))
    if limit:
        rows = rows[:limit]
    rows = [(t / speed, max(1, round(a * length_scale)), max(1, round(b * length_scale)), ids)
            for t, a, b, ids in rows]
    n = len(rows)
    dur = rows[-1][0] if n > 1 else 0.0
    summary = {"kind": "trace", "file": str(path), "format": fmt, "requests": n,
               "rate": (n - 1) / dur if dur > 0 else float(n),
               "input_mean": sum(r[1] for r in rows) / n, "output_mean": sum(r[2] for r in rows) / n,
               "speed": speed, "length_scale": length_scale, "notes": sorted(notes)}
    return rows, summary, length_scale


def segments(row, scale, extra_tokens):
    """The simulator's segments of one request, as tandem bench builds its
    prompt: each hash id a block of 512 x scale tokens (the last one what
    is left), shared by every request with that id; no ids: all its own."""
    _, n_in, _, ids = row
    seg = [[BOS_SEGMENT, extra_tokens]] if extra_tokens > 0 else []
    if ids is None:
        return seg + [[-1, n_in]]
    left, bt = n_in, max(1, round(BLOCK * scale))
    for h in ids:
        k = min(left, bt)
        if k <= 0:
            break
        seg.append([h, k])
        left -= k
    if left > 0:
        seg.append([-1, left])
    return seg


def write_sim(rows, scale, extra_tokens, path):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"t": round(r[0], 6), "seg": segments(r, scale, extra_tokens),
                                "out": r[2]}) + "\n")


def write_mooncake(rows, path):
    """The rows as a Mooncake trace (timestamps in ms) for tandem bench --trace."""
    with open(path, "w") as f:
        for t, n_in, n_out, ids in rows:
            if ids is None:
                raise WorkloadError("a trace without hash ids is replayed as it is (tandem bench "
                                    "--trace FILE)")
            f.write(json.dumps({"timestamp": int(round(t * 1000)), "input_length": n_in,
                                "output_length": n_out, "hash_ids": ids}) + "\n")
