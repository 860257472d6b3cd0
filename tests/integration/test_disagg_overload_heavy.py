"""Overload between one prefill and one decode instance (default model, one
thread each), without fencing a live P.

test_busy_prefill_is_never_fenced: the scenario of issue 19 (D's deadline
3 s, twelve distinct ~400-token prompts at concurrency 4 sent to D). P is
alive and busy; before, D fenced it again and again ("missed the deadline")
and threw away the answers P computed anyway. Now the deadline bounds the
start, P's progress keeps a started job alive, a job P cannot start in time
is refused or failed by P itself, and D gives up on one job with an Abort
that P acknowledges: zero fences, zero answers thrown away, every answer
equal to a colocated instance's, the remote share printed.

test_would_miss_is_rejected_at_once: a job its queue cannot start before
the deadline is rejected on arrival (PrefillRejected, reason
would-miss-deadline, with when it could start), and the decode instance
prefills it locally at once.

test_refused_job_goes_to_another_prefill: with two prefill instances, a
job one refuses goes to the other, and one that said it is saturated gets
no new jobs for a while.

test_router_rejects_unmeetable: tandem-router --reject-unmeetable answers
429 at once to a request whose first token the chosen instance's queue and
measured prefill speed put past --ttft-slo-ms.

The deadline is set from this machine's own speed: a reference instance's
TTFT of one ~400-token prompt (t1) gives D a deadline of 3 x t1 (at least
one second), and 8 such prompts sent at once queue about 8 x t1 of work on
P, so the later ones cannot make it on any machine; P's estimate uses the
prefill speed its own steps measured (a first request warms it)."""

import concurrent.futures as cf
import json
import random
import re
import statistics
import time

from conftest import wait_until
from grpc_stubs import load_stubs
from serve_util import TOKEN, Cluster, Pair, Server, metric
from test_disagg_internal import call, internal_generate, public


def prompt(rng, n):
    return [rng.randrange(100, 40000) for _ in range(n)]


def texts(srv, bodies):
    """The completion text srv gives for each body."""
    out = []
    for b in bodies:
        st, o = srv.post_json("/v1/completions", b, timeout=300)
        assert st == 200, o
        out.append(o["choices"][0]["text"])
    return out


def test_busy_prefill_is_never_fenced(tandem_bin, default_model, tmp_path):
    rng = random.Random(1)
    bodies = [{"prompt": prompt(rng, rng.randrange(380, 420)), "max_tokens": 16,
               "temperature": 0} for _ in range(12)]
    ref = Server.start(tandem_bin, default_model, ["--threads", "1"], tmp_path / "ref",
                       ready_timeout=120)
    try:
        want = texts(ref, bodies)
    finally:
        ref.close()
    pr = Pair(tandem_bin, tmp_path, default_model, ready_timeout=120,
              d_args=["--transfer-deadline-ms", 3000, "--local-prefill-threshold", 0])
    try:
        with cf.ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda b: pr.d.post_json("/v1/completions", b, timeout=300),
                              bodies))
        for i, ((st, out), w) in enumerate(zip(got, want)):
            assert st == 200, (i, out)
            assert out["choices"][0]["text"] == w, i
        pr.d.wait_idle(timeout=60)
        pr.p.wait_idle(timeout=60)
        d_log, p_log = pr.d.log_tail(400000), pr.p.log_tail(400000)
        fences = re.findall(r"fencing it|prefill instance \S+ fenced", d_log)
        thrown = re.findall(r"ignored \(not in flight\)|answered after it was given up", d_log)
        assert not fences and not thrown, d_log[-6000:]
        m = pr.d.metrics()
        sent = metric(m, "tandem:remote_prefill_total")  # sent to P
        fallback = metric(m, "tandem:local_prefill_total", reason="fallback")
        assert sent + metric(m, "tandem:local_prefill_total") - fallback == len(bodies)
        print(f"\nremote share: {sent - fallback:.0f} of {len(bodies)} prefills done on P; "
              f"{fallback:.0f} sent there prefilled here instead (P refused "
              f"{p_log.count('would miss its deadline')} on arrival and failed "
              f"{p_log.count('not started before its deadline')} it could not start in time; "
              f"D gave up on {len(re.findall(r'aborting it there', d_log))})")
    finally:
        pr.close()


def test_would_miss_is_rejected_at_once(tandem_bin, default_model, tmp_path):
    rng = random.Random(19)
    warm = {"prompt": prompt(rng, 400), "max_tokens": 4, "temperature": 0}
    bodies = [{"prompt": prompt(rng, rng.randrange(380, 420)), "max_tokens": 8,
               "temperature": 0} for _ in range(8)]
    ref = Server.start(tandem_bin, default_model, ["--threads", "1"], tmp_path / "ref",
                       ready_timeout=120)
    try:
        ref.post_json("/v1/completions", warm, timeout=300)
        # one prompt's prefill alone: the median of three (one sample
        # slowed down by the shared machine would set a deadline P never misses)
        samples = []
        for _ in range(3):
            t0 = time.monotonic()
            ref.post_json("/v1/completions", dict(bodies[0], max_tokens=1), timeout=300)
            samples.append(time.monotonic() - t0)
        t1 = statistics.median(samples)
        want = texts(ref, bodies)
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


def test_refused_job_goes_to_another_prefill(tandem_bin, default_model, tmp_path, source_dir):
    """Two prefill instances; the router names the first for every one of 8
    long prompts sent at once (internal Generate). The first refuses the
    ones its queue cannot start in time; D offers each to the second
    instead of prefilling it here (which prefills it, refuses it too, or,
    its queue slower than it measured on a loaded machine, fails it for not
    starting it by the deadline or, finishing it after D's deadline, for
    the transfer D no longer takes, or D's deadline passes first and D aborts
    it there), and, told the first is saturated, sends
    the next ones the router names it for to the second directly (local
    prefill reason `saturated` only when both say so). Every answer equals
    a colocated instance's; both prefill instances and D end idle."""
    stubs = load_stubs(source_dir, tmp_path / "stubs")
    pb = stubs.tandem
    rng = random.Random(23)
    warm = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt(rng, 400)),
                              sampling=pb.SamplingParams(temperature=0, max_tokens=2))
    reqs = [pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt(rng, rng.randrange(380, 420))),
                               sampling=pb.SamplingParams(temperature=0, max_tokens=6))
            for _ in range(8)]
    ref = Server.start(tandem_bin, default_model, ["--threads", "1", "--grpc-port", "0"],
                       tmp_path / "ref", ready_timeout=120)
    try:
        public(stubs, ref, warm)
        samples = []  # the median of three, as above
        for _ in range(3):
            t0 = time.monotonic()
            public(stubs, ref, reqs[0])
            samples.append(time.monotonic() - t0)
        t1 = statistics.median(samples)
        want = [public(stubs, ref, r) for r in reqs]
    finally:
        ref.close()
    deadline_ms = max(1000, int(3 * t1 * 1e3))
    ps, d = [], None
    try:
        for i in range(2):
            ps.append(Server.start(tandem_bin, default_model,
                                   ["--cluster-token", TOKEN, "--threads", 1],
                                   tmp_path / f"p{i}", cmd=[tandem_bin.parent / "tandem-prefill"],
                                   cluster_token=TOKEN, ready_timeout=120))
        names = [f"127.0.0.1:{p.port}" for p in ps]
        d = Server.start(tandem_bin, default_model,
                         ["--prefill", ",".join(names), "--cluster-token", TOKEN,
                          "--threads", 1, "--grpc-port", "0", "--max-running", 8,
                          "--transfer-deadline-ms", deadline_ms, "--local-prefill-threshold", 0],
                         tmp_path / "d", cmd=[tandem_bin.parent / "tandem-decode"],
                         cluster_token=TOKEN, ready_timeout=120)
        wait_until(lambda: sum(p["ready"] for p in d.state()["transfer"]["peers"]) == 2,
                   timeout=30, what="both prefill instances linked", proc=d.proc)
        tok = TOKEN.encode()
        for name in names:  # each measures its prefill speed
            call(stubs, d, internal_generate(tok, warm, prefill=name), timeout=300)
        with cf.ThreadPoolExecutor(len(reqs)) as ex:
            got = list(ex.map(lambda r: call(stubs, d, internal_generate(tok, r, prefill=names[0]),
                                             timeout=300), reqs))
        assert got == want
        d_log = d.log_tail(200000)
        offered = re.findall(r"request (\S+): offered to prefill instance (\S+) instead", d_log)
        assert offered and {n for _, n in offered} == {names[1]}, d_log[-6000:]
        m = d.metrics()
        second = metric(ps[1].metrics(), "tandem:kv_transfer_seconds_count") - 1  # less warm-up
        p1_log = ps[1].log_tail(200000)
        n1 = re.escape(names[1])

        def ended_at_second(rid):
            """How a job offered to the second ended there, or None."""
            r = re.escape(rid)
            if re.search(rf"request {r}: prefill instance {n1} rejected it", d_log):
                return "refused"
            # it took the job and its queue, slower than its measured speed
            # on a loaded machine, did not start it by the deadline, or
            # finished it after D's deadline had passed, so D no longer took
            # the blocks (transfer error)
            if re.search(rf"request {r}: prefill instance {n1} failed it: ", d_log):
                return "failed"
            # or D's clock ran out first: P's scheduler ends a job it did
            # not start in time between steps, and one 1-thread step of a
            # ~400-token prompt lasts most of a second on a loaded machine;
            # D aborts it there and prefills it here
            if re.search(rf"request {r}: (prefill instance {n1} did not start it within \d+ ms"
                         rf"|no word from prefill instance {n1} for)", d_log):
                return "given up"
            if re.search(rf"request: id={r} ", p1_log) and \
                    not re.search(rf"prefill {r} for \S+ failed", p1_log):
                return "prefilled"
            return None

        ends = {rid: ended_at_second(rid) for rid, _ in offered}
        print(f"\ndeadline {deadline_ms} ms: {len(offered)} refused by the first and offered to "
              f"the second, which prefilled {second:.0f}; each ended there as {ends}; local "
              f"{metric(m, 'tandem:local_prefill_total'):.0f} (saturated "
              f"{metric(m, 'tandem:local_prefill_total', reason='saturated'):.0f})")
        # each job offered to the second ended there in one of those ways
        assert second >= 1, d_log[-6000:]
        assert None not in ends.values(), (ends, d_log[-6000:], p1_log[-3000:])
        d.wait_idle(timeout=60)
        for p in ps:
            p.wait_idle(timeout=60)
    finally:
        if d:
            d.close()
        for p in ps:
            p.close()


def test_router_rejects_unmeetable(tandem_bin, default_model, tmp_path):
    """One prefill and one decode instance behind a router with
    --reject-unmeetable --ttft-slo-ms 50. Before any prefill speed is
    measured the router cannot know, and takes the request; once the
    instances published theirs (/internal/v1/state), a ~400-token prompt
    (hundreds of ms of prefill on any CPU this runs on) is answered 429 with
    Retry-After at once, counted in tandem:router_unmeetable_total, while
    the cluster keeps serving."""
    rng = random.Random(29)
    long_b = {"prompt": prompt(rng, 400), "max_tokens": 2, "temperature": 0}
    c = Cluster(tandem_bin, tmp_path, default_model, n_prefill=1, n_decode=1,
                r_args=["--reject-unmeetable", "--ttft-slo-ms", 50, "--retry-after", 2],
                ready_timeout=120)
    try:
        st, out = c.router.post_json("/v1/completions", long_b, timeout=300)
        assert st == 200, out  # no speed known yet: taken
        wait_until(lambda: any(x["load"]["prefill_tokens_per_s"] > 0
                               for x in c.view()["instances"]),
                   timeout=10, what="a prefill speed in the router's view")
        status, headers, body = c.router.request(
            "POST", "/v1/completions",
            json.dumps(dict(long_b, prompt=prompt(rng, 400))).encode(),
            {"Content-Type": "application/json"})
        assert status == 429, body
        assert headers.get("retry-after") == "2"
        m = c.router.metrics()
        assert metric(m, "tandem:router_unmeetable_total") == 1
        # at once, not after a wait in the router's queue
        assert metric(m, "tandem:router_queue_rejected_total") == 0
        assert metric(m, "tandem:router_queue_timeouts_total") == 0
        c.wait_idle(timeout=30)
    finally:
        c.close()
