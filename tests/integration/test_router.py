"""tandem-router on loopback with two prefill and two decode instances
(tiny model): prefix affinity measured in hit tokens (kv-aware against
round-robin on the same workload), load spreading, the KV headroom filter,
draining and killed instances, conditional disaggregation, the bounded
queue with 429, and every block back at idle afterwards."""

import concurrent.futures as cf
import json
import os
import random
import signal
import time

import pytest

from conftest import manifest_model, scaled, wait_until
from serve_util import Cluster, metric

MODEL = "llama2-f32-gguf"
# Every prompt is prefilled remotely unless a test says otherwise.
REMOTE_ALWAYS = ["--local-prefill-threshold", 0, "--local-prefill-max-tokens", 0]


@pytest.fixture
def model(manifest, test_models):
    return manifest_model(manifest, test_models, MODEL)


@pytest.fixture
def cluster(tandem_bin, tmp_path):
    made = []

    def start(model, **kw):
        c = Cluster(tandem_bin, tmp_path / f"c{len(made)}", model, **kw)
        made.append(c)
        return c

    yield start
    for c in reversed(made):
        c.close()


def complete(srv, body, timeout=120):
    status, out = srv.post_json("/v1/completions", body, timeout=timeout)
    assert status == 200, (status, out, srv.log_tail())
    return out


def tokens(n, rng):
    return [rng.randrange(3, 500) for _ in range(n)]


def routed(c, srv):
    return c.inst(srv)["routed"]


def hits(servers):
    """Prompt tokens the instances served from their own prefix caches."""
    return sum(metric(s.metrics(), "vllm:prefix_cache_hits_total") for s in servers)


def affinity_run(c, seed):
    """Seven families of prompts, each a 128-token shared prefix plus a
    16-token suffix, sent one family member at a time, three rounds (an odd
    number of families, so that round-robin's rotation does not happen to
    send every family back to the same pair)."""
    rng = random.Random(seed)
    prefixes = [tokens(128, rng) for _ in range(7)]
    for _ in range(3):
        for p in prefixes:
            complete(c.router, {"prompt": p + tokens(16, rng), "max_tokens": 2,
                                "temperature": 0})
            # the KV events and the freed blocks reach the router with the
            # next state pull (every 50 ms; later on a loaded machine)
            c.wait_settled()
    c.wait_idle()
    return hits(c.ps), hits(c.ds)


def misrouted(c):
    """The router's decisions (--log-decisions) that sent a prompt to a
    prefill instance holding fewer of its blocks than another usable one
    did, each with the view of the instances it was made on."""
    out = []
    for d in c.decisions():
        held = {x["address"]: x["overlap_blocks"] for x in d["instances"]
                if x["role"] == "prefill" and x["usable"]}
        p = (d["choice"] or {}).get("prefill")
        if p is not None and held and held.get(p, 0) < max(held.values()):
            out.append(d)
    return out


def test_prefix_affinity_kv_aware_against_round_robin(model, cluster):
    """The same 21 requests: kv-aware sends a prompt where its prefix is
    cached, round-robin does not; measured in prefix-cache hit tokens on the
    instances themselves (not the router's own view), and in the router's
    logged decisions. Each prompt is sent once the router's view is settled
    (wait_settled: no load anywhere, as of pulls sent after the previous
    request ended), and the measured transfer tails are left out of the
    score (--transfer-weight 0: on a loaded machine one slow first transfer
    may cost a pair more than a cached prefix saves, as intended), so that
    the prefix alone decides."""
    kv = cluster(model, r_args=REMOTE_ALWAYS + ["--log-decisions", "--transfer-weight", 0])
    kv_p, kv_d = affinity_run(kv, 1)
    view = kv.view()
    rr = cluster(model, r_args=REMOTE_ALWAYS + ["--policy", "round-robin"])
    rr_p, rr_d = affinity_run(rr, 1)
    # every decision sent the prompt to the prefill instance holding the
    # most of it, as the router's own view had it
    bad = misrouted(kv)
    assert not bad, json.dumps(bad, indent=1)
    # kv-aware: 14 of 21 prompts find their 128-token prefix on P and on D
    # (with each instance's state-pull failures and last error)
    health = [(x["address"], x["failures"], x["error"], x["routed"]) for x in view["instances"]]
    assert kv_p >= 14 * 128 and kv_d >= 14 * 128, (kv_p, kv_d, rr_p, rr_d, health)
    assert kv_p + kv_d >= 1.5 * (rr_p + rr_d), (kv_p, kv_d, rr_p, rr_d)
    m = kv.router.metrics()
    assert metric(m, "tandem:router_decisions_total", policy="kv-aware", reason="remote") == 21
    assert metric(m, "tandem:router_prefix_hit_tokens_total", role="prefill") >= 14 * 128
    assert sum(x["cached_blocks_indexed"] for x in view["instances"]) > 0
    assert metric(rr.router.metrics(), "tandem:router_decisions_total",
                  policy="round-robin") == 21


def test_load_spreads_when_prefixes_differ(model, cluster):
    """Eight prompts sharing nothing, arriving together (the router is held,
    SIGSTOP, until all eight are in its sockets: sent one after another, each
    would find every instance idle, and equal costs pick the same prefill
    instance): the router's own pending figures spread them."""
    c = cluster(model, r_args=REMOTE_ALWAYS)
    rng = random.Random(7)
    bodies = [{"prompt": tokens(40, rng), "max_tokens": 4, "temperature": 0} for _ in range(8)]
    with cf.ThreadPoolExecutor(len(bodies)) as ex:
        with c.router.held(len(bodies)):
            futs = [ex.submit(complete, c.router, b) for b in bodies]
        for f in futs:
            f.result()
    v = c.view()
    for s in c.ps + c.ds:
        assert c.inst(s, v)["routed"] >= 2, v["instances"]
    c.wait_idle()


def test_no_headroom_gets_nothing(model, cluster):
    """A decode instance whose pool cannot hold the request is filtered out
    (it would otherwise be chosen: it is idle and the other one is not)."""
    c = cluster(model, n_prefill=1, r_args=REMOTE_ALWAYS,
                d_args_each=[["--kv-blocks", 8], ["--kv-blocks", 200]])
    small, big = c.ds
    rng = random.Random(3)
    for _ in range(4):
        complete(c.router, {"prompt": tokens(150, rng), "max_tokens": 16, "temperature": 0})
    assert routed(c, small) == 0
    assert routed(c, big) == 4
    # a short request fits the small one and goes to the least loaded
    for _ in range(4):
        complete(c.router, {"prompt": tokens(20, rng), "max_tokens": 4, "temperature": 0})
    assert routed(c, small) >= 1
    c.wait_idle()


def test_draining_instance_gets_nothing_new_and_finishes(model, cluster):
    # a context of 4096 for a stream that runs for seconds on the tiny model
    c = cluster(model, r_args=REMOTE_ALWAYS + ["--max-ctx", 4096],
                d_args=["--drain-timeout", 60, "--ctx", 4096])
    rng = random.Random(11)
    long_body = {"prompt": tokens(30, rng), "max_tokens": 3000, "ignore_eos": True,
                 "temperature": 0, "stream": True,
                 "stream_options": {"include_usage": True}}
    st = c.router.open_stream("/v1/completions", long_body, timeout=120)
    events = st.events()
    first = next(events)
    assert first["choices"][0]["text"] is not None
    v = c.view()
    busy = [d for d in c.ds if c.inst(d, v)["in_flight"] == 1]
    assert len(busy) == 1, v["instances"]
    busy = busy[0]
    other = [d for d in c.ds if d is not busy][0]
    before = routed(c, busy)
    busy.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: not c.inst(busy)["ready"], timeout=5, what="router sees the drain")
    for _ in range(4):
        complete(c.router, {"prompt": tokens(30, rng), "max_tokens": 4, "temperature": 0})
    assert routed(c, busy) == before
    usage, finish = None, None
    for e in events:
        if e == "[DONE]":
            break
        assert "error" not in e, e
        usage = e.get("usage") or usage
        if e["choices"]:
            finish = e["choices"][0]["finish_reason"] or finish
    assert finish == "length"
    assert usage["completion_tokens"] == 3000
    assert busy.proc.wait(timeout=scaled(60)) == 0
    st.close()
    c.wait_ready([other])


def test_paused_decode_instance_is_waited_for(model, cluster):
    """A decode instance that does not run for a moment (a CPU-throttled pod,
    a loaded machine) while the router connects to it for the first time is
    waited for, not failed: the router gave a connection attempt 100 ms
    (gRPC's minimum connect timeout is GRPC_ARG_MIN_RECONNECT_BACKOFF_MS), so
    a healthy but slow instance failed the request with 503 and was marked
    down (the cause of test_draining_instance_gets_nothing_new_and_finishes
    failing beside the rest of the suite)."""
    c = cluster(model, n_prefill=1, n_decode=1)
    d = c.ds[0]
    rng = random.Random(17)
    body = {"prompt": tokens(30, rng), "max_tokens": 4, "temperature": 0}
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        with cf.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(c.router.post_json, "/v1/completions", body, None, 60)
            # four times the old 100 ms; the router's state pull of d waits
            # too, and its timeout is 1 s
            time.sleep(0.4)
            os.kill(d.proc.pid, signal.SIGCONT)
            status, out = fut.result()
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    assert status == 200, (status, out)
    assert out["choices"][0]["finish_reason"] == "length"
    assert metric(c.router.metrics(), "tandem:router_retries_total") == 0
    c.wait_ready()
    c.wait_idle()


def test_stopped_and_continued_router_keeps_serving(model, cluster):
    """A router stopped and continued (SIGSTOP then SIGCONT: a debugger,
    `docker pause`, job control) goes on serving: its wait for SIGTERM
    returns EINTR on SIGCONT (signal(7)), which it took for a signal to
    stop, and it drained and exited."""
    c = cluster(model, n_prefill=1, n_decode=1)
    rng = random.Random(19)
    body = {"prompt": tokens(12, rng), "max_tokens": 2, "temperature": 0}
    for _ in range(2):
        os.kill(c.router.proc.pid, signal.SIGSTOP)
        time.sleep(0.1)
        os.kill(c.router.proc.pid, signal.SIGCONT)
        status, out = c.router.post_json("/v1/completions", body, None, 30)
        assert status == 200, (status, out)
        assert c.router.proc.poll() is None, "the router exited after SIGCONT"
    status, _, _ = c.router.request("GET", "/ready")
    assert status == 200
    c.wait_idle()


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_killed_instance_is_routed_around(model, cluster, victim):
    # a short transfer deadline: the decode instance fences the dead prefill
    # instance (and frees the blocks it quarantined) within seconds
    c = cluster(model, r_args=REMOTE_ALWAYS + ["--poll-interval-ms", 100],
                d_args=["--transfer-deadline-ms", 2000])
    rng = random.Random(5)
    dead = (c.ds if victim == "decode" else c.ps)[0]
    dead.proc.send_signal(signal.SIGKILL)
    dead.proc.wait()
    t0 = time.monotonic()
    # at once, before the next poll: a request sent to the dead decode
    # instance is retried elsewhere; the dead prefill instance makes the
    # decode instance fall back to local prefill
    bodies = [{"prompt": tokens(40, rng), "max_tokens": 4, "temperature": 0} for _ in range(6)]
    with cf.ThreadPoolExecutor(3) as ex:
        outs = list(ex.map(lambda b: complete(c.router, b), bodies))
    assert all(o["choices"][0]["finish_reason"] == "length" for o in outs)
    wait_until(lambda: not c.inst(dead)["ready"], timeout=2, what="router marks it down")
    assert time.monotonic() - t0 < scaled(30)
    before = routed(c, dead)
    for b in bodies[:3]:
        complete(c.router, b)
    assert routed(c, dead) == before
    for s in c.ds + c.ps:
        if s is not dead:
            s.wait_idle()


def test_local_below_threshold_remote_above(model, cluster):
    c = cluster(model, r_args=["--local-prefill-threshold", 64, "--local-prefill-fraction", 0])
    rng = random.Random(13)
    for n in (20, 40, 63):
        complete(c.router, {"prompt": tokens(n, rng), "max_tokens": 3, "temperature": 0})
    for n in (64, 100):
        complete(c.router, {"prompt": tokens(n, rng), "max_tokens": 3, "temperature": 0})
    m = c.router.metrics()
    assert metric(m, "tandem:router_decisions_total", reason="local_short") == 3
    assert metric(m, "tandem:router_decisions_total", reason="remote") == 2
    dm = [d.metrics() for d in c.ds]
    assert sum(metric(x, "tandem:local_prefill_total", reason="router") for x in dm) == 3
    assert sum(metric(x, "tandem:remote_prefill_total") for x in dm) == 2
    c.wait_idle()


def test_queue_then_429_and_timeout(model, cluster):
    """No decode instance has the headroom: the request waits in the
    router's queue (--queue-timeout, then an error), beyond --max-queued it
    gets 429 with Retry-After; the instance keeps serving what fits."""
    c = cluster(model, n_prefill=1, n_decode=1, d_args=["--kv-blocks", 12],
                r_args=["--max-queued", 1, "--queue-timeout", 1, "--retry-after", 3])
    rng = random.Random(17)
    # 250 tokens fit the model's context (256) but need 16 blocks of 12
    big = {"prompt": tokens(150, rng), "max_tokens": 100, "temperature": 0}
    with cf.ThreadPoolExecutor(2) as ex:
        waiting = ex.submit(c.router.post_json, "/v1/completions", big, None, 60)
        wait_until(lambda: metric(c.router.metrics(), "tandem:router_queue_length") == 1,
                   timeout=5, what="queued")
        status, headers, _ = c.router.request("POST", "/v1/completions",
                                              __import__("json").dumps(big).encode(),
                                              {"Content-Type": "application/json"})
        assert status == 429
        assert headers.get("retry-after") == "3"
        status, body = waiting.result()
    assert status == 503, body
    assert body["error"]["message"]
    m = c.router.metrics()
    assert metric(m, "tandem:router_queue_rejected_total") == 1
    assert metric(m, "tandem:router_queue_timeouts_total") == 1
    complete(c.router, {"prompt": tokens(20, rng), "max_tokens": 4, "temperature": 0})
    c.wait_idle()


def test_cluster_view_and_auth(model, cluster):
    c = cluster(model, r_args=REMOTE_ALWAYS)
    v = c.view()
    assert v["policy"] == "kv-aware"
    assert {x["role"] for x in v["instances"]} == {"prefill", "decode"}
    assert all(x["ready"] and x["healthy"] for x in v["instances"])
    assert all(len(x["compat"]) == 32 for x in v["instances"])
    assert len({x["group"] for x in v["instances"]}) == 1
    status, _ = c.router.get_json("/internal/v1/cluster")
    assert status == 401
    status, _ = c.router.get_json("/internal/v1/cluster",
                                  headers={"X-Tandem-Cluster-Token": "wrong"})
    assert status == 401
    rng = random.Random(2)
    complete(c.router, {"prompt": tokens(40, rng), "max_tokens": 2, "temperature": 0})
    wait_until(lambda: len(c.view()["pairs"]) >= 1, timeout=5, what="a measured pair")
    # the client has its answer at the stream's last message, the router
    # counts the call done at its status, a moment later
    wait_until(lambda: c.view()["running"] == 0, timeout=10, what="the router idle")
    m = c.router.metrics()
    assert metric(m, "tandem:router_pair_transfer_ms") > 0
    assert metric(m, "tandem:router_instance_ready") == 4
    assert metric(m, "vllm:num_requests_running") == 0
    status, _ = c.router.get_json("/ready")
    assert status == 200


def test_dns_discovery(model, tandem_bin, tmp_path):
    """--prefill-dns / --decode-dns NAME:PORT: every address NAME resolves to
    becomes an instance (here "localhost": 127.0.0.1, and ::1 where it
    resolves to it too, where nothing listens: that one stays out of
    rotation), re-resolved every --dns-interval."""
    from serve_util import TOKEN, Server
    base = Cluster(tandem_bin, tmp_path / "base", model, n_prefill=1, n_decode=1,
                   r_args=REMOTE_ALWAYS)
    try:
        r = Server.start(tandem_bin, model,
                         ["--cluster-token", TOKEN, "--dns-interval", 0.2,
                          "--prefill-dns", f"localhost:{base.ps[0].port}",
                          "--decode-dns", f"localhost:{base.ds[0].port}", *REMOTE_ALWAYS],
                         tmp_path / "router-dns", cmd=[tandem_bin.parent / "tandem-router"],
                         cluster_token=TOKEN)
        try:
            def view():
                return r.get_json("/internal/v1/cluster",
                                  headers={"X-Tandem-Cluster-Token": TOKEN})[1]
            wait_until(lambda: sum(x["ready"] for x in view()["instances"]) == 2, timeout=10,
                       what="both discovered instances ready", proc=r.proc)
            v = view()
            assert all(x["discovered"] for x in v["instances"])
            ready = {x["role"]: x["address"] for x in v["instances"] if x["ready"]}
            assert ready == {"prefill": f"127.0.0.1:{base.ps[0].port}",
                             "decode": f"127.0.0.1:{base.ds[0].port}"}
            rng = random.Random(23)
            out = complete(r, {"prompt": tokens(40, rng), "max_tokens": 3, "temperature": 0})
            assert out["usage"]["completion_tokens"] == 3
            m = r.metrics()
            assert metric(m, "tandem:router_decisions_total", reason="remote") == 1
        finally:
            r.close()
        base.wait_idle()
    finally:
        base.close()
