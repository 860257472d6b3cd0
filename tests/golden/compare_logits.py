#!/usr/bin/env python3
"""Compares two dumps of tests/golden/dump_logits.py bit for bit.

  compare_logits.py OLD_DIR NEW_DIR

Every case must be in both, with the same bytes (or refused by both builds
with the same exit status). For a case that differs it prints where: the
first differing float (sequence-major, as `tandem eval` writes) and the
largest absolute difference. Exits 1 if any case differs or is missing.
"""
import json
import pathlib
import sys

import numpy as np


def main():
    if len(sys.argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    old_dir, new_dir = (pathlib.Path(p) for p in sys.argv[1:])
    old = json.loads((old_dir / "index.json").read_text())
    new = json.loads((new_dir / "index.json").read_text())
    bad, same = [], 0
    for name in sorted(set(old) | set(new)):
        if name not in old or name not in new:
            bad.append(f"{name}: only in {'new' if name in new else 'old'}")
            continue
        o, n = old[name], new[name]
        if "exit" in o or "exit" in n:
            if o.get("exit") != n.get("exit"):
                bad.append(f"{name}: old {o.get('exit', 'ran')} ({o.get('error', '')}), "
                           f"new {n.get('exit', 'ran')} ({n.get('error', '')})")
            else:
                same += 1
            continue
        if o["sha256"] == n["sha256"]:
            same += 1
            continue
        a = np.fromfile(old_dir / (name + ".bin"), dtype="<f4")
        b = np.fromfile(new_dir / (name + ".bin"), dtype="<f4")
        if a.size != b.size:
            bad.append(f"{name}: {a.size} floats old, {b.size} new")
            continue
        diff = np.flatnonzero(a.view("<u4") != b.view("<u4"))
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
        bad.append(f"{name}: {diff.size} of {a.size} floats differ, first at {diff[0]} "
                   f"({a[diff[0]]!r} vs {b[diff[0]]!r}), max |diff| {np.nanmax(d):.3g}")
    print(f"compare_logits: {same} of {len(set(old) | set(new))} cases bit-identical")
    for b in bad:
        print("  DIFFERS " + b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
