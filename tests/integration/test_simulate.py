"""`tandem simulate`: the cluster simulator (planner/sim.c) from its files.

- Cases worked out by hand through the command: isolated requests whose
  TTFT and E2E follow from the step model alone, their percentiles as
  numpy's linear interpolation gives them, goodput against an SLO; a
  router in front of one prefill and one decode instance adds the
  transfer's fixed and per-token time to the TTFT.
- Several clusters in one file run in parallel and come back in order.
- Bad input (malformed or truncated JSON, a field out of range, an unknown
  role, arrivals out of order, a missing file) is a one-line error naming
  the file (and line), exit 1, never a crash.
"""

import json
import subprocess

import numpy as np
import pytest

from conftest import scaled

STEP = {"c0": 0.010, "c_tok": 0.001}  # 10 ms + 1 ms per batch token


def colocated(name="colo", overhead=0.0):
    return {"name": name, "router": False, "request_overhead_s": overhead,
            "instances": [{"role": "colocated", "n_blocks": 256,
                           "sched": {"max_running": 8, "max_batch_tokens": 512, "max_ctx": 1024},
                           "step": STEP}]}


def simulate(tandem_bin, tmp_path, cluster, workload, *extra):
    c = tmp_path / "cluster.json"
    w = tmp_path / "workload.jsonl"
    c.write_text(cluster if isinstance(cluster, str) else json.dumps(cluster))
    w.write_text(workload if isinstance(workload, str)
                 else "".join(json.dumps(r) + "\n" for r in workload))
    return subprocess.run([str(tandem_bin), "simulate", "--cluster", str(c), "--workload", str(w),
                           *extra], capture_output=True, text=True, timeout=scaled(60))


def ok(p):
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_isolated_requests_by_hand(tandem_bin, tmp_path):
    # Prompts of 100, 200, 400 tokens, one every 10 s (never overlapping),
    # 5 output tokens: TTFT = 10 ms + n ms (+ 2 ms overhead), each decode
    # step 11 ms, so E2E = TTFT + 44 ms and TPOT = 11 ms.
    reqs = [{"t": 10.0 * i, "seg": [[-1, n]], "out": 5} for i, n in enumerate((100, 200, 400))]
    r = ok(simulate(tandem_bin, tmp_path, colocated(overhead=0.002), reqs,
                    "--slo", "ttft:250,tpot:20"))
    ttft = np.array([112.0, 212.0, 412.0])
    assert r["completed"] == 3 and r["failed"] == 0
    for p in (50, 90, 99):
        assert r["ttft_ms"][f"p{p}"] == pytest.approx(np.percentile(ttft, p), abs=1e-6)
        assert r["e2e_ms"][f"p{p}"] == pytest.approx(np.percentile(ttft + 44, p), abs=1e-6)
        assert r["tpot_ms"][f"p{p}"] == pytest.approx(11.0, abs=1e-6)
    assert r["ttft_ms"]["count"] == 3 and r["itl_ms"]["count"] == 12
    assert r["good_requests"] == 2  # the 400-token prompt misses TTFT 250 ms
    assert r["steps"] == 3 * 5
    assert r["duration_s"] == pytest.approx(20.0 + 0.410 + 0.044, abs=1e-9)
    assert r["cdf"]["ttft_ms"][0] == pytest.approx(112.0) and len(r["cdf"]["ttft_ms"]) == 101


def test_prefill_decode_by_hand(tandem_bin, tmp_path):
    inst = colocated()["instances"][0]
    cluster = {"name": "1P+1D", "router": True, "xfer_fixed_s": 0.005, "xfer_s_per_token": 1e-5,
               "instances": [dict(inst, role="prefill"), dict(inst, role="decode")]}
    # 1000 tokens: over the router's local threshold (512), so prefilled on
    # P in chunks of 512 + 488 (522 + 498 ms), the transfer 5 + 10 ms; a
    # 100-token prompt stays on D (110 ms).
    reqs = [{"t": 0.0, "seg": [[-1, 1000]], "out": 3}, {"t": 10.0, "seg": [[-1, 100]], "out": 3}]
    r = ok(simulate(tandem_bin, tmp_path, [cluster], reqs))
    assert isinstance(r, list) and len(r) == 1
    r = r[0]
    assert r["name"] == "1P+1D" and r["remote_prefills"] == 1
    assert r["ttft_ms"]["min"] == pytest.approx(110.0, abs=1e-6)
    assert r["ttft_ms"]["max"] == pytest.approx(522 + 498 + 15.0, abs=1e-6)


def test_router_poll_lag(tandem_bin, tmp_path):
    # The cluster file's poll_interval_s reaches the simulator: two colocated
    # instances behind the router, a burst of 8 equal prompts in 80 ms; the
    # router polling every 10 s sees both idle all along and spreads the
    # burst by what it routed since its poll, as evenly as with exact
    # figures (the decisions themselves: tests/unit/test_sim.c).
    inst = colocated()["instances"][0]
    reqs = [{"t": 0.01 * i, "seg": [[-1, 100]], "out": 4} for i in range(8)]
    runs = {}
    for poll in (0, 10.0):
        c = {"name": f"poll{poll}", "router": True, "poll_interval_s": poll,
             "instances": [dict(inst, count=2)]}
        runs[poll] = ok(simulate(tandem_bin, tmp_path, c, reqs))
    assert runs[0]["polls"] == 0 and runs[10.0]["polls"] >= 1
    for r in runs.values():
        assert r["completed"] == 8
        assert r["busy"][0] == pytest.approx(r["busy"][1], rel=0.05)


def test_neighbours_on_a_host(tandem_bin, tmp_path):
    # Two colocated instances on one machine (host 0), their step model
    # beside a stepping neighbour twice the alone one (220 ms against 110
    # for a 100-token prompt): one prompt at 0, the next at 50 ms on the
    # other instance; the first step's last 60/110 run at the beside pace
    # (120 ms, ending at 170 ms), the second's first 120 ms too, and its
    # rest alone (50 ms): both TTFTs 170 ms. Without a host (-1, the
    # default) or without "beside", both 110 ms.
    inst = dict(colocated()["instances"][0], count=2)
    beside = {"step": {"c0": 0.020, "c_tok": 0.002}, "step_overhead_s": 0}
    reqs = [{"t": 0.0, "seg": [[-1, 100]], "out": 1}, {"t": 0.05, "seg": [[-1, 100]], "out": 1}]
    for extra, want, n_beside in (({"host": 0, "beside": beside}, 170.0, 2),
                                  ({"beside": beside}, 110.0, 0), ({"host": 0}, 110.0, 0)):
        c = {"name": "2C", "router": True, "instances": [dict(inst, **extra)]}
        r = ok(simulate(tandem_bin, tmp_path, c, reqs))
        assert r["ttft_ms"]["min"] == pytest.approx(want, abs=1e-6)
        assert r["ttft_ms"]["max"] == pytest.approx(want, abs=1e-6)
        assert r["steps_beside"] == n_beside


def test_clusters_in_parallel_in_order(tandem_bin, tmp_path):
    reqs = [{"t": 0.05 * i, "seg": [[0, 64], [-1, 50 + 7 * (i % 13)]], "out": 4 + i % 5}
            for i in range(300)]
    names = [f"c{k}" for k in range(6)]
    clusters = [colocated(n) for n in names]
    for k, c in enumerate(clusters):
        c["instances"][0]["sched"]["max_running"] = 1 + k
    out = ok(simulate(tandem_bin, tmp_path, clusters, reqs, "--threads", "2"))
    assert [r["name"] for r in out] == names
    one = ok(simulate(tandem_bin, tmp_path, clusters[2], reqs, "--threads", "1"))
    assert one["ttft_ms"] == out[2]["ttft_ms"]  # the same run, threads or not
    # a batch of one is never faster than a batch of six
    assert out[0]["ttft_ms"]["p90"] >= out[5]["ttft_ms"]["p90"]


BAD_CLUSTERS = [
    ("{", "cluster.json:"),
    ('{"instances": []}', "instances must be a non-empty array"),
    ('{"instances": [{"role": "router", "n_blocks": 8, "sched": {"max_ctx": 64}, "step": {}}]}',
     "role 'router'"),
    ('{"instances": [{"role": "colocated", "n_blocks": 8, "sched": {"max_ctx": 64}, '
     '"step": {"c0": "x"}}]}', "step coefficient"),
    ('{"instances": [{"role": "colocated", "n_blocks": 2, "sched": {"max_ctx": 64}, '
     '"step": {}}]}', "cannot run"),
    ('{"instances": [{"role": "decode", "n_blocks": 8, "sched": {"max_ctx": 64}, "step": {}}]}',
     "need the router"),
    ('{"router": true, "instances": [{"role": "prefill", "n_blocks": 8, "sched": {"max_ctx": 64},'
     ' "step": {}}]}', "no decode or colocated"),
    ('{"router": true, "poll_interval_s": 1e-6, "instances": [{"role": "colocated", '
     '"n_blocks": 8, "sched": {"max_ctx": 64}, "step": {}}]}', "poll_interval_s"),
    ('{"router": true, "poll_interval_s": -1, "instances": [{"role": "colocated", '
     '"n_blocks": 8, "sched": {"max_ctx": 64}, "step": {}}]}', "poll_interval_s"),
    ('{"router": true, "instances": [{"role": "colocated", "host": 99, '
     '"n_blocks": 8, "sched": {"max_ctx": 64}, "step": {}}]}', "host is -1 to 63"),
    ('{"router": true, "instances": [{"role": "colocated", "host": 0, "beside": {"step": 1}, '
     '"n_blocks": 8, "sched": {"max_ctx": 64}, "step": {}}]}', "beside is"),
    ('{"router": true, "instances": [{"role": "colocated", "host": 0, "beside": {"step": '
     '{"c0": 1e9}}, "n_blocks": 8, "sched": {"max_ctx": 64}, "step": {}}]}', "beside is"),
]


@pytest.mark.parametrize("text,msg", BAD_CLUSTERS)
def test_bad_cluster(tandem_bin, tmp_path, text, msg):
    p = simulate(tandem_bin, tmp_path, text, [{"t": 0, "seg": [[-1, 5]], "out": 2}])
    assert p.returncode == 1 and p.stdout == ""
    assert msg in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


BAD_WORKLOADS = [
    ('{"t": 0, "seg": [[-1, 5]], "out": 2}\n{"t": 1, "seg": [[-1, 5]', ":2: not JSON"),
    ('{"t": 0, "seg": [[-1, 0]], "out": 2}\n', ":1: expected"),
    ('{"t": 0, "seg": [[-2, 4]], "out": 2}\n', ":1: expected"),
    ('{"t": 0, "seg": [[-1, 4]], "out": 0}\n', ":1: expected"),
    ('{"t": -1, "seg": [[-1, 4]], "out": 1}\n', ":1: expected"),
    ('{"t": 2, "seg": [[-1, 4]], "out": 1}\n{"t": 1, "seg": [[-1, 4]], "out": 1}\n',
     ":2: arrivals must be in order"),
    ("\n\n", "no requests"),
]


@pytest.mark.parametrize("text,msg", BAD_WORKLOADS)
def test_bad_workload(tandem_bin, tmp_path, text, msg):
    p = simulate(tandem_bin, tmp_path, colocated(), text)
    assert p.returncode == 1 and p.stdout == ""
    assert msg in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_missing_file_and_usage(tandem_bin, tmp_path):
    p = subprocess.run([str(tandem_bin), "simulate", "--cluster", str(tmp_path / "no.json"),
                        "--workload", str(tmp_path / "no.jsonl")], capture_output=True, text=True)
    assert p.returncode == 1 and "no.json" in p.stderr
    p = subprocess.run([str(tandem_bin), "simulate", "--cluster", "x"], capture_output=True,
                       text=True)
    assert p.returncode == 2 and "--workload" in p.stderr
    p = subprocess.run([str(tandem_bin), "simulate", "--cluster", "x", "--workload", "y",
                        "--slo", "ttft:-3"], capture_output=True, text=True)
    assert p.returncode == 2
