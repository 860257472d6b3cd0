"""Killing any prefill or decode instance while `tandem bench` drives the
router (2 prefill + 2 decode instances, tiny model): no request that had
not yet produced a token is lost (the router retries it on another
instance, or the decode instance falls back to local prefill), the only
failures are streams the killed decode instance was sending, and every
surviving instance returns to idle with no KV block used, reserved, leased
or quarantined."""

import json
import signal
import subprocess

import pytest

from conftest import manifest_model, scaled, wait_until
from serve_util import Cluster, metric

N, CONC = 40, 6


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_kill_during_bench(tandem_bin, manifest, test_models, tmp_path, victim):
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    # long outputs (a 4096 context) so that streams are cut mid-way (300
    # tokens took 20 ms on an AVX-512 machine: a kill then often found
    # decode0 between streams); a short
    # transfer deadline so that a decode instance fences a dead prefill
    # instance, and frees what it quarantined, within seconds
    c = Cluster(tandem_bin, tmp_path, model,
                r_args=["--max-ctx", 4096, "--local-prefill-threshold", 0,
                        "--local-prefill-max-tokens", 0, "--max-retries", 3],
                d_args=["--ctx", 4096, "--transfer-deadline-ms", 2000])
    bench = None
    try:
        out = tmp_path / "bench.json"
        bench = subprocess.Popen(
            [str(a) for a in [tandem_bin, "bench", "--url", c.router.base_url, "--dataset",
                              "random", "--num-prompts", N, "--concurrency", CONC,
                              "--input-len", 48, "--output-len", 1500, "--ignore-eos",
                              "--seed", 1, "--json", out]],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        wait_until(lambda: metric(c.router.metrics(), "tandem:router_decisions_total") >= 20,
                   timeout=60, what="20 requests routed", proc=bench)
        dead = (c.ds if victim == "decode" else c.ps)[0]
        if victim == "decode":  # the kill must find streams to cut
            wait_until(lambda: metric(dead.metrics(), "vllm:num_requests_running") >= 1,
                       timeout=60, what="decode0 streaming", proc=bench)
        dead.proc.send_signal(signal.SIGKILL)
        dead.proc.wait()
        _, err = bench.communicate(timeout=scaled(300))
        assert bench.returncode == 0, err
        rep = json.loads(out.read_text())
        m = c.router.metrics()
        before = metric(m, "tandem:router_failed_total", stage="before_first_token")
        after = metric(m, "tandem:router_failed_total", stage="after_first_token")
        assert rep["num_prompts"] == N
        assert before == 0, (rep["errors"], c.router.log_tail())
        # the failures are exactly the streams the kill cut
        assert rep["failed"] == after, (rep["errors"], after)
        if victim == "prefill":
            assert rep["failed"] == 0, rep["errors"]
        else:
            assert rep["failed"] <= CONC, rep["errors"]
            # the kill hit requests: cut streams, or retried ones
            assert rep["failed"] + metric(m, "tandem:router_retries_total") >= 1
        assert rep["completed"] == N - rep["failed"]
        survivors = [s for s in c.ds + c.ps if s is not dead]
        for s in survivors:
            s.wait_idle(timeout=20)
        c.wait_ready(survivors)
    finally:
        if bench is not None and bench.poll() is None:
            bench.kill()
            bench.wait()
        c.close()
