"""A prefill instance that knows its queue (default model, 1P+1D, one
thread each): a job its queue cannot start and finish before the deadline
is rejected on arrival (PrefillRejected, reason would-miss-deadline, with
when it could start), and the decode instance prefills it locally at once
instead of waiting out the deadline and fencing a live P.

The deadline is set from this machine's own speed: a reference instance's
TTFT of one ~400-token prompt (t1) gives D a deadline of 3 x t1 (at least
one second), and 8 such prompts sent at once queue about 8 x t1 of work on
P, so the later ones cannot make it on any machine; P's estimate uses the
prefill speed its own steps measured (a first request warms it)."""

import concurrent.futures as cf
import random
import re
import time

from serve_util import Pair, Server, metric


def prompt(rng, n):
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_would_miss_is_rejected_at_once(tandem_bin, default_model, tmp_path):
    rng = random.Random(19)
    warm = {"prompt": prompt(rng, 400), "max_tokens": 4, "temperature": 0}
    bodies = [{"prompt": prompt(rng, rng.randrange(380, 420)), "max_tokens": 8,
               "temperature": 0} for _ in range(8)]
    ref = Server.start(tandem_bin, default_model, ["--threads", "1"], tmp_path / "ref",
                       ready_timeout=120)
    try:
        ref.post_json("/v1/completions", warm, timeout=300)
        t0 = time.monotonic()
        ref.post_json("/v1/completions", dict(bodies[0], max_tokens=1), timeout=300)
        t1 = time.monotonic() - t0
        want = []
        for b in bodies:
            st, out = ref.post_json("/v1/completions", b, timeout=300)
            assert st == 200, out
            want.append(out["choices"][0]["text"])
    finally:
        ref.close()
    deadline_ms = max(1000, int(3 * t1 * 1e3))
    pr = Pair(tandem_bin, tmp_path, default_model, ready_timeout=120,
              d_args=["--transfer-deadline-ms", deadline_ms, "--local-prefill-threshold", 0,
                      "--max-running", 8])
    try:
        st, _ = pr.d.post_json("/v1/completions", warm, timeout=300)  # P measures its speed
        assert st == 200
        with cf.ThreadPoolExecutor(len(bodies)) as ex:
            got = list(ex.map(lambda b: pr.d.post_json("/v1/completions", b, timeout=300),
                              bodies))
        for i, ((st, out), w) in enumerate(zip(got, want)):
            assert st == 200, (i, out)
            assert out["choices"][0]["text"] == w, i  # the local prefill answers the same
        p_log, d_log = pr.p.log_tail(200000), pr.d.log_tail(200000)
        rejected = re.findall(r"prefill (\S+) rejected: would miss its deadline \((\d+) ms\): "
                              r"(\d+) queued prompt tokens at (\d+) tokens/s start it in (\d+) ms",
                              p_log)
        assert rejected, (f"t1 {t1:.3f} s, deadline {deadline_ms} ms: P took every job\n"
                          + p_log[-4000:])
        for rid, p_deadline, queued, rate, start in rejected:
            # D heard it on arrival and prefilled that request locally
            assert re.search(rf"request {re.escape(rid)}: prefill instance \S+ rejected it: "
                             r"would miss its deadline", d_log), rid
            assert int(p_deadline) < deadline_ms and int(queued) > 0 and int(rate) > 0
        m = pr.d.metrics()
        assert metric(m, "tandem:kv_transfer_failures_total", reason="rejected") == len(rejected)
        assert metric(m, "tandem:local_prefill_total", reason="fallback") >= len(rejected)
        pr.d.wait_idle(timeout=60)
        pr.p.wait_idle(timeout=60)
    finally:
        pr.close()
