"""The Markdown table of a validate.py result (docs/PERFORMANCE.md):
    python3 tools/planner/validation_table.py RESULTS.json
Per case: each percentile predicted / measured median (the repeats'
spread), its error, whether it is within the bound (15% at P50, 25% at
P90/P99, or the repeats' spread where larger), and the verdicts; with
the runs' steps in the result (validate.py --step-traces), how fast the
machine computed in each run against the profile (its instances' step
time over the model's). The count at the end leaves out saturated
shapes: those where the prediction has more than a tenth of the requests
miss the SLO's bounds (goodput below 90%), decided before the runs. With
validate.py --at-run-speed, a second table: each percentile's error
when predicted at the speed each run's steps show (the median over the
runs), which leaves the model's error once the machine's drift from its
profile is taken out."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from validate import run_speed  # noqa: E402


def bound(key, spread):
    return max(0.15 if key.endswith("p50") else 0.25, spread or 0)


SATURATED = 0.90  # predicted goodput below this: the shape is past what it serves


def saturated(r):
    return r["goodput"]["predicted"] < SATURATED


def speeds(r):
    """Each run's step time over the profile's model (validate.run_speed),
    or None where the runs' steps are not in the result."""
    out = [run_speed(run) for run in r.get("steps") or []]
    return None if not out or None in out else out


def main(argv):
    res = json.load(open(argv[0]))
    keys = ["ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"]
    print("| case | " + " | ".join(f"{k} pred / meas (spread) ms" for k in keys)
          + " | goodput pred / meas | verdict pred / meas | steps / model |")
    print("|---|" + "---|" * (len(keys) + 3))
    n_in = n_all = 0
    for name, r in res.items():
        g = r["goodput"]
        gm = sorted(g["measured"])[len(g["measured"]) // 2]
        sat = saturated(r)
        cells = []
        for k in keys:
            c = r["compare"].get(k)
            if not c or c["error"] is None:
                cells.append("-")
                continue
            ok = abs(c["error"]) <= bound(k, c["spread"])
            n_in += ok and not sat
            n_all += not sat
            cells.append(f"{c['predicted']:.0f} / {c['measured_median']:.0f} ({c['spread']:.0%}) "
                         f"{c['error']:+.0%}{'' if ok else ' **out**'}")
        vm = r["measured_meets"]
        verdict_meas = ("meets" if all(vm) else "misses" if not any(vm)
                        else f"{sum(vm)}/{len(vm)} meet")
        right = (r["predicted_meets"] and all(vm)) or (not r["predicted_meets"] and not any(vm))
        sp = speeds(r)
        print(f"| {name}{' (saturated)' if sat else ''} | " + " | ".join(cells)
              + f" | {g['predicted']:.0%} / {gm:.0%} | "
              f"{'meets' if r['predicted_meets'] else 'misses'} / {verdict_meas}"
              f"{'' if right else ' **wrong**'} | "
              + (" ".join(f"{x:.2f}" for x in sp) if sp else "-") + " |")
    print(f"\n{n_in} of {n_all} predicted percentiles of the shapes below saturation "
          f"within their bound.")
    rows = {n: r for n, r in res.items() if r.get("at_run_speed")}
    if not rows:
        return 0
    print("\nPredicted again at each run's speed (steps / model as above), the median "
          "error over the runs:\n")
    print("| case | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    n_in = n_all = 0
    for name, r in rows.items():
        sat = saturated(r)
        cells = []
        for k in keys:
            a = r["at_run_speed"]["compare"].get(k)
            if not a:
                cells.append("-")
                continue
            ok = abs(a["error"]) <= bound(k, r["compare"][k]["spread"])
            n_in += ok and not sat
            n_all += not sat
            cells.append(f"{a['error']:+.0%}{'' if ok else ' **out**'}")
        print(f"| {name}{' (saturated)' if sat else ''} | " + " | ".join(cells) + " |")
    print(f"\n{n_in} of {n_all} within their bound at the runs' speed.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
