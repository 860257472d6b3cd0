#!/usr/bin/env python3
"""Compares logit dumps of tests/golden/dump_logits.py for the GPU check
(scripts/gpu-check.sh). Standard library only (the device image may lack
numpy's pinned version; this reads float32 with the array module).

  gpu_compare.py numerics CPU_DIR GPU_DIR [--tol-f32 T] [--tol-half T]
      every case both dumps computed: max |gpu - cpu| / max |cpu|, against
      the tolerance of the case's weight type; cases the GPU refused are
      listed with its message (quantized weights, CP and MoE are refused
      for now), cases only one side computed fail
  gpu_compare.py invariance GPU_DIR
      per model, every variant (chunk sizes, thread counts, the same three
      sequences in one batch) bit for bit against the whole-prompt case

Exit status 0 when every computed case is within its tolerance (numerics)
or bit-identical (invariance) and at least one was computed, 1 otherwise;
the table goes to stdout."""
import argparse
import array
import json
import pathlib
import sys


def load(d):
    d = pathlib.Path(d)
    return d, json.loads((d / "index.json").read_text())


def floats(d, case):
    a = array.array("f")
    a.frombytes((d / f"{case}.bin").read_bytes())
    return a


def computed(entry):
    return "sha256" in entry


def tolerance(case, a):
    # F16/BF16 weights are widened to f32 in both backends, but the GPU's
    # fused multiply-adds and warp-tree sums round differently from the
    # CPU's SIMD order: a few f32 ulps per dot product, compounded over the
    # layers; relative to the largest logit
    return a.tol_half if ("f16" in case or "bf16" in case) else a.tol_f32


def numerics(a):
    cd, ci = load(a.cpu)
    gd, gi = load(a.gpu)
    bad = n = 0
    print("| case | max abs diff / max abs logit | tolerance | verdict |")
    print("|---|---:|---:|---|")
    for case in sorted(ci):
        g = gi.get(case)
        if g is None:
            continue
        if not computed(g):
            print(f"| {case} | refused: {str(g.get('error', ''))[:80]} | | refused |")
            continue
        if not computed(ci[case]):
            print(f"| {case} | the CPU refused it | | FAIL |")
            bad += 1
            continue
        x, y = floats(cd, case), floats(gd, case)
        if len(x) != len(y):
            print(f"| {case} | {len(y)} floats against {len(x)} | | FAIL |")
            bad += 1
            continue
        scale = max((abs(v) for v in x), default=0.0) or 1.0
        err = max((abs(p - q) for p, q in zip(x, y)), default=0.0) / scale
        tol = tolerance(case, a)
        ok = err <= tol and all(v == v for v in y)
        bad += not ok
        n += 1
        print(f"| {case} | {err:.3g} | {tol:.3g} | {'ok' if ok else 'FAIL'} |")
    print(f"\n{n} cases compared, {bad} failed")
    return 1 if bad or n == 0 else 0


def invariance(a):
    gd, gi = load(a.gpu)
    bad = n = 0
    models = sorted({c.rsplit(".", 1)[0] for c in gi if c.startswith("invariance/")})
    print("| model | variant | against whole | verdict |")
    print("|---|---|---|---|")
    for m in models:
        whole = gi.get(f"{m}.whole")
        if not whole or not computed(whole):
            print(f"| {m} | whole | refused by the GPU backend | refused |")
            continue
        ref = floats(gd, f"{m}.whole")
        for case in sorted(c for c in gi if c.startswith(m + ".") and c != f"{m}.whole"):
            v = case[len(m) + 1:]
            if not computed(gi[case]):
                print(f"| {m} | {v} | refused | FAIL |")
                bad += 1
                continue
            got = floats(gd, case)  # the same three sequences, however they were run
            same = got.tobytes() == ref.tobytes()
            bad += not same
            n += 1
            print(f"| {m} | {v} | {'bit-identical' if same else 'differs'} | "
                  f"{'ok' if same else 'FAIL'} |")
    print(f"\n{n} variants compared, {bad} differ")
    return 1 if bad or n == 0 else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("numerics")
    n.add_argument("cpu")
    n.add_argument("gpu")
    n.add_argument("--tol-f32", type=float, default=1e-4)
    n.add_argument("--tol-half", type=float, default=1e-3)
    i = sub.add_parser("invariance")
    i.add_argument("gpu")
    a = ap.parse_args()
    sys.exit(numerics(a) if a.cmd == "numerics" else invariance(a))


if __name__ == "__main__":
    main()
