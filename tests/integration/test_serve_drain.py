"""SIGTERM drains `tandem serve`: /ready answers 503 at
once, new requests get 503, running streams finish within --drain-timeout,
then the process exits 0. With a drain timeout too short for the work in
flight, the unfinished streams are ended (an error event or a finish
reason, then the connection closes) and the process still exits 0 promptly.

A tiny random model keeps the run short; the streams are long (ignore_eos,
2,000 tokens in the first test) so that they are still running when the
signal arrives, and every stream is read by its own thread from the start,
as real clients do.
"""

import http.client
import random
import signal
import threading
import time

import pytest

from conftest import scaled, wait_until
from serve_util import metric, serve  # noqa: F401  (serve: fixture)

MODEL = "llama3-q8_0-gguf"
SERVED = "tiny"


@pytest.fixture(scope="module")
def tiny(test_models, manifest):
    for e in manifest:
        if e["name"] == MODEL:
            return test_models / e["path"]
    pytest.fail(f"{MODEL} not in the test models manifest")


class StreamReader(threading.Thread):
    """Reads one SSE completion stream to its end on its own thread."""

    def __init__(self, srv, body):
        super().__init__(daemon=True)
        self.srv, self.body = srv, body
        self.events, self.error, self.status = [], None, None
        self.first = threading.Event()
        self.t_end = None

    def run(self):
        try:
            st = self.srv.open_stream("/v1/completions", self.body, timeout=120)
            self.status = st.status
            try:
                for ev in st.events():
                    self.events.append(ev)
                    if isinstance(ev, dict) and ev.get("choices") and ev["choices"][0].get("text"):
                        self.first.set()
            finally:
                st.close()
        except Exception as e:  # noqa: BLE001 (reported by the test)
            self.error = e
        finally:
            self.t_end = time.monotonic()
            self.first.set()

    def finish_reasons(self):
        return [c.get("finish_reason") for ev in self.events if isinstance(ev, dict)
                for c in ev.get("choices", []) if c.get("finish_reason")]

    def usage(self):
        us = [ev["usage"] for ev in self.events if isinstance(ev, dict) and ev.get("usage")]
        return us[-1] if us else None

    def error_events(self):
        return [ev for ev in self.events if isinstance(ev, dict) and "error" in ev]

    def describe(self):
        return (f"status {self.status}, exception {self.error!r}, {len(self.events)} events, "
                f"finish {self.finish_reasons()}, usage {self.usage()}, "
                f"last {self.events[-2:]!r}")


def t_ms(t0):
    return f"{(time.monotonic() - t0) * 1e3:.0f}"


def stream_body(rng, max_tokens):
    return {"model": SERVED, "prompt": [rng.randrange(3, 512) for _ in range(8)],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def start_streams(srv, n, max_tokens, seed):
    rng = random.Random(seed)
    readers = [StreamReader(srv, stream_body(rng, max_tokens)) for _ in range(n)]
    for r in readers:
        r.start()
    return readers


def test_sigterm_drains_running_streams(serve, tiny):
    # The checks after SIGTERM need requests still running in the server,
    # and that is judged by the server (vllm:num_requests_running), not by
    # the client threads: the server writes a stream faster than a Python
    # reader on a loaded machine consumes it, so a reader still reading
    # says nothing (once, all eight readers were open while the server had
    # finished seven requests and exited). The eight requests arrive
    # together (the server is held until all are sent: the last client
    # thread once sent its request 3 s after the first) and last seconds
    # (4,000 tokens, a context of 4,096: 2,000 took 2 s on an AVX-512
    # machine; with 240 they ended within 0.3 s).
    # The drain timeout is long because the speed varies as much the other
    # way: in the sanitizer build the streams take minutes, and a 60 s
    # timeout cut them at 1,233 tokens. What is checked is that they
    # finish, not how fast.
    drain = 900
    n, n_tokens = 8, 4000
    srv = serve(tiny, "--served-model-name", SERVED, "--max-running", n, "--drain-timeout", drain,
                "--ctx", 4096)
    readers = []
    try:
        with srv.held(n):
            readers = start_streams(srv, n, n_tokens, seed=1)

        def running():
            return metric(srv.metrics(), "vllm:num_requests_running")

        wait_until(lambda: running() == n, timeout=30, what=f"{n} requests running",
                   proc=srv.proc)
        # The SIGTERM lands while they still run: the server is frozen right
        # after it said so, and gets the signal as it resumes (on a fast
        # machine the eight streams once all ended between the last poll and
        # the signal, and the drain had nothing left to wait for).
        srv.proc.send_signal(signal.SIGSTOP)
        t_sig = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.send_signal(signal.SIGCONT)
        # At once: not ready, and new work refused, while the streams run.
        # "At once" is bounded by signal delivery: the signal thread must be
        # scheduled (milliseconds on a busy 2-core machine), so /ready gets
        # 0.5 s, far less than the streams have left.
        deadline = time.monotonic() + scaled(0.5)
        while True:
            try:
                status, _, _ = srv.request("GET", "/ready", timeout=5)
            except (ConnectionError, http.client.HTTPException) as e:
                # Refused: the server had exited. Closed unanswered: it was
                # exiting, or it dropped a probe it should have answered
                # with 503 (its log, in the report, tells which).
                alive = sum(r.is_alive() for r in readers)
                pytest.fail(f"/ready {t_ms(t_sig)} ms after SIGTERM: {e!r}; server "
                            f"{'running' if srv.proc.poll() is None else 'exited'}, {alive} of "
                            f"{n} streams of {n_tokens} tokens still read by their clients")
            if status == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.002)
        assert status == 503, f"/ready still answered {status} 0.5 s after SIGTERM"
        t_ready = time.monotonic() - t_sig
        status, body = srv.post_json("/v1/completions", {
            "model": SERVED, "prompt": [5, 6, 7], "max_tokens": 2}, timeout=5)
        assert status == 503, (status, body)
        assert isinstance(body, dict) and body["error"]["message"], body
        still = running()
        assert still >= 1, (f"all {n} requests of {n_tokens} tokens ended in the server before "
                            f"the checks (/ready 503 after {t_ready * 1e3:.0f} ms): drain not "
                            f"exercised")
        for r in readers:
            r.join(max(0.0, t_sig + drain - time.monotonic()))
            assert not r.is_alive(), f"a stream did not end within the drain timeout ({drain} s)"
        for i, r in enumerate(readers):
            assert r.error is None, f"stream {i}: {r.describe()}"
            assert r.finish_reasons() == ["length"], f"stream {i}: {r.describe()}"
            assert r.usage() and r.usage()["completion_tokens"] == n_tokens, f"stream {i}: {r.describe()}"
            assert not r.error_events(), f"stream {i}: {r.describe()}"
            assert r.events[-1] == "[DONE]", f"stream {i}: {r.describe()}"
        # Once the last stream has ended the process exits (its front ends
        # get 2 s to write the last bytes).
        t_streams = time.monotonic()
        rc = srv.proc.wait(timeout=scaled(30))
        assert rc == 0, f"exit status {rc}\n{srv.log_tail()}"
        assert time.monotonic() - t_streams < scaled(15)
    finally:
        for r in readers:
            r.join(0.1)


def test_short_drain_timeout_ends_streams(serve, tiny):
    """--drain-timeout 0.3 with far more work queued than that allows (one
    sequence at a time, 96 streams of 240 tokens; the tiny model makes a
    stream in ~18 ms on an idle 2-core VM): SIGTERM once the server reports
    every request in and at least 48 still waiting (~0.9 s of work, three
    drains). The streams still running or waiting when it expires are
    ended with an error event or a finish reason, and the process exits 0
    soon after. (With 32 streams and no bound on the waiting ones, a CI run
    under load saw every stream end before the poll saw them all in.)"""
    drain = 0.3
    n = 96
    srv = serve(tiny, "--served-model-name", SERVED, "--max-running", 1,
                "--drain-timeout", drain)
    readers = start_streams(srv, n, 240, seed=2)
    try:
        # any stream's first token: with one sequence at a time the server
        # takes them in its own order, and the first reader's may come last
        # (once it did, 5 s in, and the drain had nothing left to cut)
        wait_until(lambda: any(r.first.is_set() for r in readers), timeout=30,
                   what="a first token", proc=srv.proc)

        def all_submitted():
            m = srv.metrics()
            waiting = metric(m, "vllm:num_requests_waiting")
            return (metric(m, "vllm:num_requests_running") + waiting
                    + metric(m, "vllm:request_success_total")) == n and waiting >= n // 2

        wait_until(all_submitted, timeout=30, what=f"{n} requests in, {n // 2} of them waiting",
                   proc=srv.proc)
        t_sig = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(timeout=drain + scaled(15))
        t_exit = time.monotonic() - t_sig
        assert rc == 0, f"exit status {rc}\n{srv.log_tail()}"
        assert t_exit < drain + scaled(5), f"exited {t_exit:.1f} s after SIGTERM (drain {drain} s)"
        for r in readers:
            r.join(scaled(10))
            assert not r.is_alive(), "a stream stayed open after the process exited"
        complete = [r for r in readers if r.usage() and r.usage()["completion_tokens"] == 240
                    and r.finish_reasons() == ["length"]]
        cut = [r for r in readers if r not in complete]
        assert cut, "every stream finished: the drain timeout never cut anything"
        for r in cut:
            if r.status is not None and r.status != 200:
                # Never admitted before the drain began: refused outright.
                assert r.status == 503, r.describe()
                continue
            ended = r.error_events() or (r.finish_reasons() and r.finish_reasons()[-1] != "length")
            assert ended, f"an unfinished stream ended without an error or finish reason: {r.describe()}"
            assert r.events and r.events[-1] == "[DONE]", f"no [DONE] after the end: {r.describe()}"
    finally:
        for r in readers:
            r.join(0.1)
