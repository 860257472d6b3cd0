"""`tandem bench-transfer`: a short run between two processes (the command
spawns its own server) over UCX's default transports and over TCP only,
into a region allocated through the channel or plain registered pages;
the JSON accounts for every byte, the server's region holds what was put
(verified by hash), and the transports UCX chose are named. Bad flags
exit 2 without starting anything."""

import json
import re

import pytest
from conftest import run_tandem


def bench(*args, env=None):
    r = run_tandem("bench-transfer", *args, "--json", env=env, timeout=60)
    return json.loads(r.stdout)


@pytest.mark.parametrize("tls,target", [(None, "alloc"), (None, "map"), ("tcp", "alloc")])
def test_bench_transfer_json(tls, target):
    env = {"UCX_TLS": tls} if tls else None
    size, iters = 65536 + 8, 40
    r = bench("-s", str(size), "-n", str(iters), "-w", "3", "--window", "4", "--spread", "3",
              "--target", target, env=env)
    assert r["size"] == size and r["iters"] == iters and r["window"] == 4 and r["spread"] == 3
    assert r["target"] == target
    assert r["bytes"] == size * iters
    assert r["seconds"] > 0 and r["gbps"] > 0
    assert abs(r["gbps"] - r["bytes"] / r["seconds"] / 1e9) < 1e-6 * r["gbps"]
    assert r["verified"] is True
    assert r["transports"].strip()
    if tls == "tcp":
        assert r["transports"] == "tcp/lo"


def test_bench_transfer_table():
    r = run_tandem("bench-transfer", "-s", "4096", "-n", "5", "-w", "0", timeout=60)
    assert re.match(r"transports: \S", r.stdout)
    assert re.search(r"^\|\s+4096 \|\s+5 \|\s+16 \|\s+1 \|.*\|\s+yes \|$", r.stdout, re.M)


@pytest.mark.parametrize("args", [["-s", "0"], ["-n", "x"], ["--window", "0"], ["--bogus", "1"],
                                  ["--spread", "2000"], ["--target", "gpu"]])
def test_bench_transfer_bad_flags(args):
    r = run_tandem("bench-transfer", *args, check=False, timeout=30)
    assert r.returncode == 2
