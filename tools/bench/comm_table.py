#!/usr/bin/env python3
"""Median bus bandwidth of the shm comm backend over several runs of
td-comm-bench (docs/PERFORMANCE.md), next to this machine's
main-memory read bandwidth from td-membw with as many threads as ranks:
the ceiling a shared-memory collective works against once messages leave
the caches (every byte of an all-reduce is written into the staging
buffers and read out of them).

  tools/bench/comm_table.py --build build [--ranks 2] [--runs 5] \
      [--max-bytes 16777216]

Prints one markdown row per message size: all-reduce and all-gather time
(us) and bus bandwidth (GB/s, nccl-tests convention), medians over the
runs, and each busbw as a fraction of the median read bandwidth.
"""
import argparse
import pathlib
import json
import statistics
import subprocess
import sys


def comm_run(binary, ranks, max_bytes):
    out = subprocess.run([binary, "--ranks", str(ranks), "--max-bytes", str(max_bytes)],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit(f"td-comm-bench failed:\n{out.stderr}")
    rows = {}
    for ln in out.stdout.splitlines():
        f = ln.replace("|", " ").split()
        if len(f) == 8 and f[0].isdigit():
            rows[int(f[0])] = [float(x) for x in f[2:]]
    return rows


def read_gbs(binary, threads):
    out = subprocess.run([binary, "--threads", str(threads)], capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0:
        sys.exit(f"td-membw failed:\n{out.stderr}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["read_gb_s"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", required=True, help="build directory with td-comm-bench, td-membw")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-bytes", type=int, default=16 << 20)
    a = ap.parse_args()
    b = pathlib.Path(a.build)
    runs, mem = [], []
    for _ in range(a.runs):
        mem.append(read_gbs(str(b / "td-membw"), a.ranks))
        runs.append(comm_run(str(b / "td-comm-bench"), a.ranks, a.max_bytes))
    mc = statistics.median(mem)
    print(f"main-memory read bandwidth (td-membw --threads {a.ranks}, median of {a.runs}): "
          f"{mc:.2f} GB/s; {a.ranks} ranks, median of {a.runs} runs")
    print()
    print("| bytes | all-reduce us | AR busbw GB/s | AR / read bw | all-gather us "
          "| AG busbw GB/s | AG / read bw |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size in sorted(runs[0]):
        col = [statistics.median(r[size][i] for r in runs if size in r) for i in range(6)]
        print(f"| {size} | {col[0]:.1f} | {col[2]:.2f} | {col[2] / mc:.2f} | {col[3]:.1f} "
              f"| {col[5]:.2f} | {col[5] / mc:.2f} |")


if __name__ == "__main__":
    main()
