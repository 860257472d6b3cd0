"""Review reproducers for tandem-router: fake decode instances (a Python
/internal/v1/state endpoint plus a Python Decode/Generate gRPC server) so
that the router meets exactly the answers a test wants."""

import http.server
import json
import threading
import time
from concurrent import futures

import pytest

from conftest import manifest_model, wait_until
from grpc_stubs import load_stubs
from serve_util import TOKEN, Server

grpc = pytest.importorskip("grpc")

MODEL = "llama2-f32-gguf"
COMPAT = "0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def stubs(source_dir, tmp_path_factory):
    return load_stubs(source_dir, tmp_path_factory.mktemp("stubs"))


class FakeDecode:
    """A decode instance that answers its state and every Generate the way
    `behaviour` says: "ok" (one token, then Complete length), "error503"
    (an in-stream Error 503, then status UNAVAILABLE: what a real decode
    instance sends when its remote prefill failed)."""

    def __init__(self, stubs, behaviour, state_patch=None):
        self.pb = stubs.tandem
        self.behaviour = behaviour
        self.calls = 0
        self.lock = threading.Lock()
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        handler = grpc.method_handlers_generic_handler("tandem.internal.v1.Decode", {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.generate, request_deserializer=None,
                response_serializer=lambda m: m.SerializeToString())})
        self.grpc.add_generic_rpc_handlers((handler,))
        self.grpc_port = self.grpc.add_insecure_port("127.0.0.1:0")
        self.grpc.start()
        self.state = {
            "role": "decode", "instance_id": "fake", "epoch": "00000000000000a1",
            "compat": COMPAT, "last_seq": 0, "full": True, "hashes": [], "draining": False,
            "max_ctx": 4096, "grpc_port": self.grpc_port,
            "load": {"running": 0, "waiting": 0, "queued_prefill_tokens": 0,
                     "kv": {"block_size": 16, "total": 100000, "free": 100000, "used": 0,
                            "cached": 0}},
            "transfer": {"peers": []}}
        self.on_get = None
        self.gets = 0  # state pulls answered
        self.dead = threading.Event()
        if state_patch:
            state_patch(self.state)
        fake = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if fake.behaviour == "hang" and fake.calls:
                    time.sleep(5)  # the host is gone: the state pull times out
                    return
                if fake.on_get:
                    fake.on_get(fake.state)
                body = json.dumps(fake.state).encode()
                with fake.lock:
                    fake.gets += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def generate(self, request_bytes, context):
        with self.lock:
            self.calls += 1
        pb = self.pb
        if self.behaviour == "slow":
            for i in range(30):
                if not context.is_active():
                    return
                time.sleep(0.01)
                yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=[7], text="x"))
            yield pb.GenerateResponse(complete=pb.Complete(
                finish_reason="length", prompt_tokens=4, completion_tokens=30))
            return
        if self.behaviour == "hang":
            self.dead.wait(60)
            return
        if self.behaviour == "unavailable":
            context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
        if self.behaviour == "error503":
            yield pb.GenerateResponse(error=pb.Error(
                message="remote prefill failed", type="service_unavailable",
                http_status=503))
            context.abort(grpc.StatusCode.UNAVAILABLE, "remote prefill failed")
        else:
            yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=[7], text="x"))
            yield pb.GenerateResponse(complete=pb.Complete(
                finish_reason="length", prompt_tokens=4, completion_tokens=1))

    def close(self):
        self.http.shutdown()
        self.http.server_close()
        self.grpc.stop(0)


@pytest.fixture
def fakes():
    made = []
    yield made
    for f in made:
        f.close()


def start_router(tandem_bin, model, tmp_path, decodes, extra=()):
    args = ["--cluster-token", TOKEN, "--grpc-port", "-1", "--poll-interval-ms", 50,
            "--decode", ",".join(f"127.0.0.1:{d.port}" for d in decodes), *extra]
    return Server.start(tandem_bin, model, args, tmp_path / "router",
                        cmd=[tandem_bin.parent / "tandem-router"], cluster_token=TOKEN)


def view(r):
    status, body = r.get_json("/internal/v1/cluster", headers={"X-Tandem-Cluster-Token": TOKEN})
    assert status == 200, body
    return body


def all_ready(r, n):
    v = view(r)
    return sum(1 for x in v["instances"] if x["ready"]) == n


def test_in_stream_503_is_retried_on_another_instance(tandem_bin, manifest, test_models,
                                                       tmp_path, stubs, fakes):
    """A decode instance that fails a request before its first token with
    an in-stream Error 503 (its remote prefill failed) must not fail the
    client's request: the router retries it on the other decode instance,
    as it does for a bare UNAVAILABLE status."""
    model = manifest_model(manifest, test_models, MODEL)
    bad, good = FakeDecode(stubs, "error503"), FakeDecode(stubs, "ok")
    fakes += [bad, good]
    r = start_router(tandem_bin, model, tmp_path, [bad, good],
                     ["--policy", "round-robin"])
    try:
        wait_until(lambda: all_ready(r, 2), timeout=20, what="both fakes ready", proc=r.proc)
        failures = []
        for i in range(6):
            status, out = r.post_json("/v1/completions",
                                      {"prompt": [5, 6, 7, 8], "max_tokens": 1}, timeout=30)
            if status != 200:
                failures.append((status, out))
            # the bad one is marked down on nothing (its state is fine): let
            # round-robin hit it again
        assert bad.calls > 0, "round-robin never reached the failing instance"
        assert not failures, (f"{len(failures)} of 6 requests failed although the other "
                              f"instance was healthy: {failures[:2]}\n{r.log_tail()}")
    finally:
        r.close()


def test_peer_load_figures_at_int64_limits(tandem_bin, manifest, test_models, tmp_path, stubs,
                                           fakes):
    """A decode instance whose state reports extreme (but well-typed)
    figures must not crash the router (signed overflow in the scoring is
    undefined behaviour: UBSan aborts a sanitizer build)."""
    model = manifest_model(manifest, test_models, MODEL)

    def patch(s):
        s["load"]["kv"]["used"] = 9223372036854775807
        s["load"]["running"] = 2147483647

    f = FakeDecode(stubs, "ok", patch)
    fakes.append(f)
    r = start_router(tandem_bin, model, tmp_path, [f])
    try:
        wait_until(lambda: all_ready(r, 1), timeout=20, what="fake ready", proc=r.proc)
        for _ in range(2):
            # answered (whatever the status): a router that crashed on the
            # figures would not answer
            status, out = r.post_json("/v1/completions", {"prompt": [5, 6, 7, 8],
                                                          "max_tokens": 1}, timeout=30)
            assert status in (200, 429, 503), (status, out, r.log_tail())
        assert r.proc.poll() is None, f"router died ({r.proc.returncode}):\n{r.log_tail()}"
        status, _, _ = r.request("GET", "/health")
        assert status == 200
    finally:
        r.close()


def sanitizer_reports(r):
    t = r.log_tail(200000)
    return [ln for ln in t.splitlines()
            if "AddressSanitizer" in ln or "LeakSanitizer" in ln or "runtime error" in ln]


def test_cancel_storm_retries_queue_and_shutdown(tandem_bin, manifest, test_models, tmp_path,
                                                 stubs, fakes):
    """Streaming clients that drop at random points while the router
    retries (an instance failing every call with UNAVAILABLE), then a
    second router whose only instance has no KV headroom (every request
    queued), its clients dropping and the router stopped with requests
    still queued and running: no sanitizer report, exit 0."""
    import random
    from serve_util import SSEStream
    model = manifest_model(manifest, test_models, MODEL)
    slow, flaky = FakeDecode(stubs, "slow"), FakeDecode(stubs, "unavailable")
    fakes += [slow, flaky]
    r = start_router(tandem_bin, model, tmp_path, [slow, flaky],
                     ["--policy", "round-robin", "--drain-timeout", "1"])
    rng = random.Random(1)

    def client(i):
        try:
            s = SSEStream(r.host, r.port, "/v1/completions",
                          {"prompt": [5, 6, 7, 8], "max_tokens": 30, "stream": True})
            n = rng.randrange(0, 8)
            for k, _ in enumerate(s.events()):
                if k >= n:
                    break
            s.abort()
        except Exception:
            pass

    try:
        wait_until(lambda: all_ready(r, 2), timeout=20, what="fakes ready", proc=r.proc)
        for _ in range(3):
            with futures.ThreadPoolExecutor(16) as ex:
                list(ex.map(client, range(48)))
            wait_until(lambda: all_ready(r, 2), timeout=20, what="fakes back", proc=r.proc)
        # in flight at the stop
        ths = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in ths:
            t.start()
        time.sleep(0.05)
        rc = r.stop()
        for t in ths:
            t.join()
        assert rc == 0, r.log_tail()
        assert not sanitizer_reports(r), sanitizer_reports(r)
    finally:
        r.close()

    def no_room(s):
        s["load"]["kv"]["free"] = 0

    full = FakeDecode(stubs, "ok", no_room)
    fakes.append(full)
    r2 = start_router(tandem_bin, model, tmp_path / "r2", [full],
                      ["--drain-timeout", "0.5", "--queue-timeout", "0.3"])
    try:
        wait_until(lambda: all_ready(r2, 1), timeout=20, what="full fake ready", proc=r2.proc)
        def queued(i):
            try:
                s = SSEStream(r2.host, r2.port, "/v1/completions",
                              {"prompt": [5, 6, 7, 8], "max_tokens": 3, "stream": True},
                              timeout=5)
                if i % 2:
                    s.abort()
                else:
                    list(s.events())
                    s.close()
            except Exception:
                pass
        with futures.ThreadPoolExecutor(16) as ex:
            list(ex.map(queued, range(32)))
        ths = [threading.Thread(target=queued, args=(2 * i,)) for i in range(6)]
        for t in ths:
            t.start()
        time.sleep(0.1)
        rc = r2.stop()
        for t in ths:
            t.join()
        assert rc == 0, r2.log_tail()
        assert not sanitizer_reports(r2), sanitizer_reports(r2)
    finally:
        r2.close()


def test_instance_usable_after_nine_restarts_with_new_compat(tandem_bin, manifest, test_models,
                                                             tmp_path, stubs, fakes):
    """An instance restarted with a different model configuration (a new
    compat and epoch) nine times over the router's life, then settled:
    it must be in rotation again (the router's compatibility groups are
    never freed; the ninth distinct compat gets no group)."""
    model = manifest_model(manifest, test_models, MODEL)
    f = FakeDecode(stubs, "ok")
    fakes.append(f)
    seen = {"n": 0}

    def rolling(s):
        # one restart per poll for the first 9 polls, then stable
        if seen["n"] < 9:
            seen["n"] += 1
            s["compat"] = "%032x" % (0x1000 + seen["n"])
            s["epoch"] = "%016x" % (0x100 + seen["n"])

    f.on_get = rolling
    r = start_router(tandem_bin, model, tmp_path, [f])
    try:
        wait_until(lambda: seen["n"] >= 9, timeout=20, what="nine restarts", proc=r.proc)
        # back in rotation with a later poll (not at a given time: the
        # polls are late on a loaded machine)
        wait_until(lambda: view(r)["instances"][0]["ready"], timeout=10,
                   what="the instance back in rotation once the restarts stopped",
                   proc=r.proc)
    finally:
        r.close()


def test_index_bounded_by_what_an_instance_can_hold(tandem_bin, manifest, test_models, tmp_path,
                                                   stubs, fakes):
    """An instance that reports 1000 KV blocks but keeps sending 'stored'
    events of new hashes (and never 'removed'): the router's index must not
    grow without bound (it holds every hash ever announced)."""
    model = manifest_model(manifest, test_models, MODEL)

    def small(s):
        s["load"]["kv"]["total"] = s["load"]["kv"]["free"] = 1000
        s["full"] = False

    f = FakeDecode(stubs, "ok", small)
    fakes.append(f)
    ctr = {"seq": 0}

    def events(s):
        base = ctr["seq"]
        ctr["seq"] += 5000
        s["last_seq"] = ctr["seq"]
        s["events"] = [{"type": "stored", "hash": "%032x" % (base + k + 1)}
                       for k in range(5000)]

    f.on_get = events
    r = start_router(tandem_bin, model, tmp_path, [f])
    try:
        wait_until(lambda: ctr["seq"] >= 100000, timeout=30, what="20 polls", proc=r.proc)
        n = view(r)["index_blocks"]
        assert n <= 10 * 1000, f"{n} blocks indexed for an instance of 1000"
    finally:
        r.close()


def test_call_on_a_vanished_instance_does_not_hang(tandem_bin, manifest, test_models, tmp_path,
                                                   stubs, fakes):
    """A decode instance that vanishes mid-request (its host gone: neither
    its state nor the call answer, no RST): the router marks it unhealthy
    within a poll timeout, but the call in flight on it is never ended
    (no call timeout by default, no keepalive on the channel), so the
    client waits forever and the slot stays in flight."""
    model = manifest_model(manifest, test_models, MODEL)
    f = FakeDecode(stubs, "hang")
    fakes.append(f)
    r = start_router(tandem_bin, model, tmp_path, [f], ["--poll-timeout-ms", 300])
    try:
        wait_until(lambda: all_ready(r, 1), timeout=20, what="fake ready", proc=r.proc)
        t0 = time.monotonic()
        try:
            status, out = r.post_json("/v1/completions", {"prompt": [5, 6, 7, 8],
                                                          "max_tokens": 1}, timeout=8)
        except Exception as e:  # the client's own timeout
            status, out = None, repr(e)
        assert status is not None, (f"no answer within {time.monotonic() - t0:.1f} s although "
                                    f"the router saw the instance down: {view(r)['instances']}")
    finally:
        f.dead.set()
        r.close()


def test_cluster_view_lists_an_instance_with_a_long_utf8_id(tandem_bin, manifest, test_models,
                                                            tmp_path, stubs, fakes):
    """An instance_id of 62 ASCII characters and an 'é': the router keeps
    the first 63 bytes (half of the 'é'), and the instance then vanishes from
    /internal/v1/cluster (json_pack refuses the invalid UTF-8)."""
    model = manifest_model(manifest, test_models, MODEL)

    def long_id(s):
        s["instance_id"] = "i" * 62 + "\u00e9"

    f = FakeDecode(stubs, "ok", long_id)
    fakes.append(f)
    r = start_router(tandem_bin, model, tmp_path, [f])
    try:
        # two state pulls answered: the first one's reply has been applied
        # (the router sends the second after applying the first)
        wait_until(lambda: f.gets >= 2, timeout=20, what="two state pulls", proc=r.proc)
        v = view(r)
        assert len(v["instances"]) == 1, v
    finally:
        r.close()
