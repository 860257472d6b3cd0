"""Regression tests for the ownership protocol's hard cases (default model;
they come from an independent review that reproduced each failure):

- a prefill request that waited in a stopped P's queue past D's deadline:
  once D has fenced P and reused the blocks for other sequences, the resumed
  P must not start it (P takes D's deadline as a point in time, checks it at
  every put, and D keeps the blocks quarantined until P's deadline has
  surely passed); the canaries that took the blocks decode exactly as
  `tandem serve` does, over shared memory and over TCP (over TCP the
  fence has also destroyed the link worker P put into, so the resumed P
  finds its endpoints to D failed before its deadline check is reached);
- client cancels racing with P's answer never leak quarantined blocks;
- P honours the lease D asks for (a prefill longer than P's own default
  lease is not aborted while D renews it)."""

import os
import random
import signal
import threading
import time

import pytest

from conftest import wait_until
from serve_util import Pair, Server, metric


def lp_of(out):
    return out["choices"][0]["logprobs"]["token_logprobs"]


@pytest.mark.parametrize("tls", ["default", "tcp"])
def test_stale_request_after_fence(tls, tandem_bin, default_model, tmp_path):
    env = {} if tls == "default" else {"UCX_TLS": "tcp"}
    rng = random.Random(5)
    a = [rng.randrange(3, 512) for _ in range(100)]
    canaries = [[rng.randrange(3, 512) for _ in range(256)] for _ in range(2)]
    body = {"max_tokens": 40, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    ref = Server.start(tandem_bin, default_model, ["--threads", "1", "--no-prefix-cache"],
                       tmp_path / "ref", ready_timeout=120)
    try:
        want = []
        for c in canaries:
            st, out = ref.post_json("/v1/completions", dict(body, prompt=c), timeout=300)
            assert st == 200, out
            want.append(lp_of(out))
    finally:
        ref.close()
    # a pool of 40 blocks: the canaries must reuse A's destination blocks
    pr = Pair(tandem_bin, tmp_path / "pair", default_model, [],
              ["--transfer-deadline-ms", "1500", "--no-prefix-cache", "--kv-blocks", "40"],
              env=env, ready_timeout=120)
    try:
        st, _ = pr.d.post_json("/v1/completions", {"prompt": canaries[0][:40], "max_tokens": 2})
        assert st == 200
        pr.d.wait_idle()
        os.killpg(pr.p.proc.pid, signal.SIGSTOP)
        results = [None, None]
        try:
            st, out = pr.d.post_json("/v1/completions",
                                     {"prompt": a, "max_tokens": 1, "temperature": 0}, timeout=60)
            assert st == 200, out  # D's deadline, the fence, a local prefill
            pr.d.wait_idle(timeout=15)  # the quarantine ended

            def run(i):
                s, o = pr.d.post_json("/v1/completions", dict(body, prompt=canaries[i]),
                                      timeout=300)
                results[i] = (s, o)

            ths = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in ths:
                t.start()
            # the canaries have their blocks and decode (or are done)
            wait_until(lambda: pr.d.blocks()["running"] >= 2 or any(results), timeout=60,
                       what="both canaries running on D", proc=pr.d.proc)
        finally:
            os.killpg(pr.p.proc.pid, signal.SIGCONT)
        for t in ths:
            t.join(timeout=300)
        for i in range(2):
            st, out = results[i]
            assert st == 200, out
            assert lp_of(out) == want[i], f"canary {i}: its KV was overwritten"
        pr.d.wait_idle(timeout=20)
        pr.p.wait_idle(timeout=20)
        # what stopped the resumed P: its deadline check, or (TCP, where the
        # fence destroyed D's link worker) its endpoints to D failing
        p_log = pr.p.log_tail(20000)
        stopped_by = ["past its deadline"] + (["unreachable: closing"] if tls == "tcp" else [])
        assert any(w in p_log for w in stopped_by), p_log
    finally:
        pr.close()


def test_cancels_racing_the_answer_leak_nothing(tandem_bin, default_model, tmp_path):
    rng = random.Random(3)
    pr = Pair(tandem_bin, tmp_path / "pair", default_model, [], ["--no-prefix-cache"],
              ready_timeout=120)
    try:
        def prompt():
            return [rng.randrange(3, 512) for _ in range(60)]
        t0 = time.monotonic()
        st, _ = pr.d.post_json("/v1/completions", {"prompt": prompt(), "max_tokens": 1})
        ttft = time.monotonic() - t0
        assert st == 200
        stop = threading.Event()

        def busy():  # D's scheduler keeps stepping
            while not stop.is_set():
                pr.d.post_json("/v1/completions",
                               {"prompt": prompt(), "max_tokens": 32, "ignore_eos": True},
                               timeout=120)
        ths = [threading.Thread(target=busy) for _ in range(2)]
        for t in ths:
            t.start()
        try:
            time.sleep(0.5)
            for _ in range(30):
                s = pr.d.open_stream("/v1/completions",
                                     {"prompt": prompt(), "max_tokens": 4, "stream": True})
                time.sleep(ttft * rng.uniform(0.6, 1.4))
                s.abort()
                time.sleep(0.03)
        finally:
            stop.set()
            for t in ths:
                t.join(timeout=120)
        pr.d.wait_idle(timeout=30)
        pr.p.wait_idle(timeout=30)
    finally:
        pr.close()


def test_prefill_honours_the_decode_lease(tandem_bin, default_model, tmp_path):
    rng = random.Random(3)
    # P's own default lease is 3 s; this prefill takes longer on one thread
    pr = Pair(tandem_bin, tmp_path / "pair", default_model, [],
              ["--lease-ms", "12000", "--transfer-deadline-ms", "120000"], ready_timeout=120)
    try:
        st, out = pr.d.post_json("/v1/completions",
                                 {"prompt": [rng.randrange(3, 512) for _ in range(1500)],
                                  "max_tokens": 1}, timeout=300)
        assert st == 200, out
        m = pr.d.metrics()
        assert metric(m, "tandem:remote_prefill_total") == 1
        assert metric(m, "tandem:local_prefill_total") == 0
        assert metric(m, "tandem:kv_transfer_seconds_count") == 1
        pr.d.wait_idle()
        pr.p.wait_idle()
    finally:
        pr.close()
