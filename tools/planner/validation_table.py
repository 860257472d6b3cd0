"""The Markdown table of a validate.py result (docs/PERFORMANCE.md):
    python3 tools/planner/validation_table.py RESULTS.json
Per case: each percentile predicted / measured median (the repeats'
spread), its error, whether it is within the bound (15% at P50, 25% at
P90/P99, or the repeats' spread where larger), and the verdicts."""

import json
import sys


def bound(key, spread):
    return max(0.15 if key.endswith("p50") else 0.25, spread or 0)


def main(argv):
    res = json.load(open(argv[0]))
    keys = ["ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"]
    print("| case | " + " | ".join(f"{k} pred / meas (spread) ms" for k in keys)
          + " | goodput pred / meas | verdict pred / meas |")
    print("|---|" + "---|" * (len(keys) + 2))
    n_in = n_all = 0
    for name, r in res.items():
        cells = []
        for k in keys:
            c = r["compare"].get(k)
            if not c or c["error"] is None:
                cells.append("-")
                continue
            ok = abs(c["error"]) <= bound(k, c["spread"])
            n_in += ok
            n_all += 1
            cells.append(f"{c['predicted']:.0f} / {c['measured_median']:.0f} ({c['spread']:.0%}) "
                         f"{c['error']:+.0%}{'' if ok else ' **out**'}")
        g = r["goodput"]
        gm = sorted(g["measured"])[len(g["measured"]) // 2]
        vm = r["measured_meets"]
        verdict_meas = ("meets" if all(vm) else "misses" if not any(vm)
                        else f"{sum(vm)}/{len(vm)} meet")
        right = (r["predicted_meets"] and all(vm)) or (not r["predicted_meets"] and not any(vm))
        print(f"| {name} | " + " | ".join(cells)
              + f" | {g['predicted']:.0%} / {gm:.0%} | "
              f"{'meets' if r['predicted_meets'] else 'misses'} / {verdict_meas}"
              f"{'' if right else ' **wrong**'} |")
    print(f"\n{n_in} of {n_all} predicted percentiles within their bound.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
