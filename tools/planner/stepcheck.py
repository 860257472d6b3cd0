"""A profile's step model against the steps of another run: each step's
measured forward time over the model's, by step kind and, for decode
steps, by batch size; the quantiles of every step's ratio and the slow
steps (over 1.3x: how often, and how much of the time stepping they add);
and the scheduler's gap between steps against the profile's. Where a
prediction misses, this says whether the instance computed slower than
its profile (and at which batches, or in a tail of slow steps: a noisy
machine) or the time went elsewhere.

  python3 tools/planner/stepcheck.py PROFILE.json TRACE.jsonl [--role colocated|decode|prefill]
                                     [--beside]

--beside: against the role's step model measured beside a busy neighbour
(tandem profile --neighbour-cpus) instead of the one measured alone.

TRACE: a --step-trace of the run (validate.py --step-traces DIR keeps
one per instance and run)."""

import argparse
import collections
import json
import pathlib
import statistics
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from steptrace import Trace, TraceError, predict  # noqa: E402


SLOW = 1.3  # a step this many times its model's or more counts as slow


def check(prof, role, trace, beside=False):
    roles = prof.get("roles") if isinstance(prof, dict) else None
    if not isinstance(roles, dict) or role not in roles:
        have = ", ".join(roles) if isinstance(roles, dict) else "none"
        raise ValueError(f"the profile has no {role!r} role (it has: {have})")
    r = roles[role]
    if beside:
        if "beside" not in r:
            raise ValueError(f"the profile's {role} role has no step model beside a neighbour "
                             f"(tandem profile --neighbour-cpus)")
        r = r["beside"]
    coef, out = r["step"], {"kinds": {}, "decode_by_batch": {}}
    by_kind, by_batch = collections.defaultdict(list), collections.defaultdict(list)
    for s in trace.steps:
        m = predict(coef, s.features())
        if m <= 0:
            continue
        by_kind[s.kind()].append((s.dt, m))
        if s.kind() == "decode":
            by_batch[len(s.entries)].append(s.dt / m)
    ratios = sorted(a / b for v in by_kind.values() for a, b in v)
    slow = [(a, b) for v in by_kind.values() for a, b in v if a > SLOW * b]
    busy = sum(a for v in by_kind.values() for a, _ in v)
    if ratios:
        out["ratio_quantiles"] = {f"p{q}": ratios[min(len(ratios) - 1, int(q / 100 * len(ratios)))]
                                  for q in (50, 90, 99)}
        out["slow_steps"] = {"over": SLOW, "share": len(slow) / len(ratios),
                             "excess_share_of_busy": sum(a - b for a, b in slow) / busy}
    for k, v in by_kind.items():
        out["kinds"][k] = {"steps": len(v), "median_ratio": statistics.median(a / b for a, b in v),
                           "measured_s": sum(a for a, _ in v), "model_s": sum(b for _, b in v)}
    for b, v in sorted(by_batch.items()):
        out["decode_by_batch"][b] = {"steps": len(v), "median_ratio": statistics.median(v)}
    gaps = [s.gap for s in trace.steps if s.gap is not None]
    out["gap_ms"] = {"median": statistics.median(gaps) * 1e3 if gaps else None,
                     "profile": r["overhead"]["step_overhead_s"] * 1e3}
    return out


def main(argv):
    p = argparse.ArgumentParser(prog="stepcheck.py", description=__doc__.split("\n\n")[0])
    p.add_argument("profile")
    p.add_argument("trace")
    p.add_argument("--role", default="colocated")
    p.add_argument("--json", action="store_true")
    p.add_argument("--beside", action="store_true",
                   help="the step model measured beside a busy neighbour")
    args = p.parse_args(argv)
    try:
        prof = json.loads(pathlib.Path(args.profile).read_text())
        trace = Trace(args.trace)
        out = check(prof, args.role, trace, args.beside)
    except (OSError, ValueError, KeyError, TypeError, TraceError) as e:
        sys.stderr.write(f"stepcheck.py: {e}\n")
        return 1
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for k, v in out["kinds"].items():
        print(f"{k:8} {v['steps']:5} steps: measured / model median {v['median_ratio']:.3f}, "
              f"in all {v['measured_s']:.2f} s / {v['model_s']:.2f} s "
              f"({v['measured_s'] / v['model_s']:.3f})")
    print("decode by batch size (steps, median measured / model): " + ", ".join(
        f"{b}: {v['steps']} {v['median_ratio']:.2f}" for b, v in out["decode_by_batch"].items()))
    if "ratio_quantiles" in out:
        q, sl = out["ratio_quantiles"], out["slow_steps"]
        print(f"every step, measured / model: p50 {q['p50']:.2f}, p90 {q['p90']:.2f}, "
              f"p99 {q['p99']:.2f}; {sl['share']:.1%} of the steps over {SLOW}x, their time "
              f"beyond the model {sl['excess_share_of_busy']:.1%} of the time stepping")
    g = out["gap_ms"]
    if g["median"] is not None:
        print(f"gap between steps: median {g['median']:.2f} ms (profile {g['profile']:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
