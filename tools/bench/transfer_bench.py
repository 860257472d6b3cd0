#!/usr/bin/env python3
"""KV migration channel put throughput against ucx_perftest
(docs/PERFORMANCE.md): `tandem bench-transfer` and
`ucx_perftest -t ucp_put_bw -e` with the same put size, iteration count,
UCX_TLS and error-handling mode, alternating, several repetitions.

  tools/bench/transfer_bench.py --tandem build/tandem [--sizes 65536,1048576,4194304]
      [--reps 5] [--gib 4] [--tls tcp] [--json FILE]

Both sides run with UCX_POSIX_ERROR_HANDLING=y and UCX_SYSV_ERROR_HANDLING=y
(as the services do) and peer error handling on their endpoints
(ucx_perftest -e). Prints a markdown table of median GB/s (10^9 bytes/s;
ucx_perftest's "MB/s" are MiB/s and are converted), the ratio
ours/perftest, and the transports UCX selected for our endpoint.
"""
import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_ours(tandem, size, iters, warmup, env, timeout):
    out = subprocess.run([tandem, "bench-transfer", "-s", str(size), "-n", str(iters), "-w",
                          str(warmup), "--json"], capture_output=True, text=True, env=env,
                         timeout=timeout)
    if out.returncode != 0:
        sys.exit(f"tandem bench-transfer failed ({out.returncode}):\n{out.stderr}")
    r = json.loads(out.stdout)
    if not r["verified"]:
        sys.exit("tandem bench-transfer: the server's bytes differ")
    return r["gbps"], r["transports"]


FINAL = re.compile(r"^Final:\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)")


def run_perftest(size, iters, warmup, env, timeout):
    port = free_port()
    server = subprocess.Popen(["ucx_perftest", "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + timeout
        while True:  # the server listens once it is up: retry the client until then
            cl = subprocess.run(["ucx_perftest", "127.0.0.1", "-p", str(port), "-t", "ucp_put_bw",
                                 "-s", str(size), "-n", str(iters), "-w", str(warmup), "-e"],
                                capture_output=True, text=True, env=env, timeout=timeout)
            for ln in cl.stdout.splitlines():
                m = FINAL.match(ln.strip())
                if m:
                    return float(m.group(6)) * 1024 * 1024 / 1e9  # overall MiB/s -> GB/s
            if time.monotonic() > deadline or server.poll() is not None:
                sys.exit(f"ucx_perftest gave no final line:\n{cl.stdout}\n{cl.stderr}")
            time.sleep(0.2)
    finally:
        stop(server)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tandem", required=True, help="path of the tandem binary")
    ap.add_argument("--sizes", default="65536,1048576,4194304", help="put sizes in bytes")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each tool per size")
    ap.add_argument("--gib", type=float, default=4,
                    help="GiB put per timed run (iterations = this / size, at least 100)")
    ap.add_argument("--iters", type=int, default=None, help="timed puts per run (overrides --gib)")
    ap.add_argument("--tls", default=None, help="UCX_TLS for both tools (default: unset)")
    ap.add_argument("--timeout", type=float, default=120, help="seconds per run")
    ap.add_argument("--json", default=None, help="also write every sample to this file")
    a = ap.parse_args()

    env = dict(os.environ)
    env.pop("UCX_TLS", None)
    if a.tls:
        env["UCX_TLS"] = a.tls
    # with UCX_TLS=tcp these would only make UCX warn that they are unused
    shm = not a.tls or any(w in ("all", "sm", "shm", "posix", "sysv", "mm")
                           for w in a.tls.split(",")) or a.tls.startswith("^")
    if shm:
        env["UCX_POSIX_ERROR_HANDLING"] = "y"
        env["UCX_SYSV_ERROR_HANDLING"] = "y"
    env.setdefault("UCX_MEM_MALLOC_HOOKS", "no")

    sizes = [int(s) for s in a.sizes.split(",")]
    iters = {s: a.iters or max(100, int(a.gib * (1 << 30)) // s) for s in sizes}
    warmup = {s: max(10, iters[s] // 20) for s in sizes}
    samples = {s: {"ours": [], "perftest": []} for s in sizes}
    transports = set()
    for rep in range(a.reps):
        for s in sizes:
            # alternate which tool goes first, so drift in the machine's load
            # falls on both alike
            order = ("ours", "perftest") if rep % 2 == 0 else ("perftest", "ours")
            for tool in order:
                if tool == "ours":
                    g, t = run_ours(a.tandem, s, iters[s], warmup[s], env, a.timeout)
                    transports.add(t)
                else:
                    g = run_perftest(s, iters[s], warmup[s], env, a.timeout)
                samples[s][tool].append(g)
            print(f"rep {rep + 1}/{a.reps} size {s}: ours {samples[s]['ours'][-1]:.2f} GB/s, "
                  f"perftest {samples[s]['perftest'][-1]:.2f} GB/s", file=sys.stderr)

    print(f"UCX_TLS={a.tls or '(unset)'}; peer error handling; "
          f"UCX_POSIX/SYSV_ERROR_HANDLING={'y' if shm else '(not used)'}; "
          f"{f'{a.iters} puts' if a.iters else f'{a.gib:g} GiB'} per run (+5% untimed warm-up); "
          f"median of {a.reps} runs each")
    print(f"transports (tandem endpoint): {', '.join(sorted(transports))}")
    print()
    print("| put size | puts per run | tandem bench-transfer (GB/s) "
          "| ucx_perftest ucp_put_bw -e (GB/s) | ratio |")
    print("|---:|---:|---:|---:|---:|")
    rows = []
    for s in sizes:
        o = statistics.median(samples[s]["ours"])
        p = statistics.median(samples[s]["perftest"])
        label = f"{s // 1048576} MiB" if s % 1048576 == 0 else f"{s // 1024} KiB"
        print(f"| {label} | {iters[s]} | {o:.2f} | {p:.2f} | {o / p:.2f} |")
        rows.append({"size": s, "ours_gbps": samples[s]["ours"],
                     "perftest_gbps": samples[s]["perftest"], "ours_median": o,
                     "perftest_median": p, "ratio": o / p})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tls": a.tls, "iters": iters, "warmup": warmup, "reps": a.reps,
                       "transports": sorted(transports), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
