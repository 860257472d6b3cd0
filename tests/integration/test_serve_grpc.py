"""The gRPC API of `tandem serve` (proto/tandem.proto, grpc.health.v1) through
a real grpcio client whose stubs are generated from proto/ at test time.

References are independent of the gRPC front end: the HTTP API of the same
server (/v1/completions, /v1/chat/completions, /tokenize, /detokenize: a
different front end over the same engine), the block and request gauges in
/metrics and /internal/v1/state, and the status codes proto/tandem.proto
documents. A tiny random GGUF model keeps every run short.

Every test runs against `tandem serve` and against a tandem-router over one
prefill and one decode instance (serve_util.Front: calls go to the router's
gRPC port; scheduler gauges and KV blocks are the decode instance's).
"""

import signal
import socket
import time

import grpc
import pytest

from conftest import scaled, wait_until
from grpc_stubs import load_stubs
from serve_util import Cluster, Front, Server, metric

MAX_LONG = 12000  # a generation that takes seconds on this model, ended early by the tests
CTX = 16384
PROMPTS = ["hello world", "The quick brown fox", "a b c d e f g"]


@pytest.fixture(scope="module")
def stubs(source_dir, tmp_path_factory):
    return load_stubs(source_dir, tmp_path_factory.mktemp("grpc-stubs"))


@pytest.fixture(scope="module")
def model(manifest, test_models):
    for m in manifest:
        if m["format"] == "gguf" and m["variant"] == "llama2" and m["wtype"] == "Q8_0":
            return test_models / m["path"]
    pytest.fail("models.json has no llama2 Q8_0 GGUF model")


def start_server(tandem_bin, model, tmp_path_factory, *args):
    return Server.start(tandem_bin, model,
                        ["--grpc-port", "0", "--ctx", CTX, "--kv-blocks", 2 * CTX // 16 + 64,
                         "--threads", 1, *args],
                        tmp_path_factory.mktemp("serve-grpc"))


def start_front(kind, tandem_bin, model, tmp_path_factory, *args):
    """kind "serve": start_server(...args); "router": the same context and
    pool on a decode instance behind a tandem-router (its gRPC port), with
    args (API keys, drain timeout) given to the router."""
    if kind == "serve":
        return Front.serve(start_server(tandem_bin, model, tmp_path_factory, *args))
    kv = ["--ctx", CTX, "--kv-blocks", 2 * CTX // 16 + 64]
    return Front.router(Cluster(tandem_bin, tmp_path_factory.mktemp("router-grpc"), model,
                                n_prefill=1, n_decode=1, p_args=kv, d_args=kv,
                                r_args=["--max-ctx", CTX, *args]))


KINDS = ["serve", "router"]


@pytest.fixture(scope="module", params=KINDS)
def srv(request, tandem_bin, model, tmp_path_factory):
    s = start_front(request.param, tandem_bin, model, tmp_path_factory)
    yield s
    # A clean exit after everything above (a sanitizer build exits nonzero
    # on a leak or an error it found); behind a router, of every process.
    rc = s.stop()
    s.close()
    assert rc == 0, s.logs()


class Client:
    def __init__(self, stubs, server, metadata=()):
        self.pb = stubs.tandem
        self.hpb = stubs.health
        self.channel = grpc.insecure_channel(f"{server.host}:{server.grpc_port}")
        self.gen = stubs.tandem_grpc.GenerateStub(self.channel)
        self.health = stubs.health_grpc.HealthStub(self.channel)
        self.md = list(metadata)

    def request(self, text=None, ids=None, chat=None, request_id="", model="", **sampling):
        kw = {}
        if text is not None:
            kw["text"] = text
        if ids is not None:
            kw["token_ids"] = self.pb.TokenIds(ids=ids)
        if chat is not None:
            kw["chat"] = self.pb.Chat(messages=[self.pb.ChatMessage(role=r, content=c)
                                                for r, c in chat])
        return self.pb.GenerateRequest(request_id=request_id, model=model,
                                       sampling=self.pb.SamplingParams(**sampling), **kw)

    def generate(self, req, timeout=60, metadata=None):
        """All responses of one Generate: (token ids, text, [chunk], complete)."""
        ids, text, chunks, end = [], "", [], None
        for r in self.gen.Generate(req, timeout=scaled(timeout),
                                   metadata=self.md if metadata is None else metadata):
            kind = r.WhichOneof("response")
            assert end is None, f"message after the end: {r}"
            if kind == "chunk":
                ids += list(r.chunk.token_ids)
                text += r.chunk.text
                chunks.append(r.chunk)
            elif kind == "complete":
                end = r.complete
            else:
                pytest.fail(f"unexpected {kind}: {r}")
        assert end is not None, "stream ended without a Complete message"
        return ids, text, chunks, end

    def error_of(self, req, timeout=30, metadata=None):
        with pytest.raises(grpc.RpcError) as ei:
            self.generate(req, timeout=timeout, metadata=metadata)
        return ei.value.code(), ei.value.details()

    def close(self):
        self.channel.close()


@pytest.fixture
def client(stubs, srv):
    c = Client(stubs, srv)
    yield c
    c.close()


def http_completion(srv, prompt, **params):
    status, body = srv.post_json("/v1/completions", {"prompt": prompt, **params})
    assert status == 200, body
    return body


def tokenize(srv, text):
    status, body = srv.post_json("/tokenize", {"prompt": text})
    assert status == 200, body
    return body["tokens"]


def detokenize(srv, ids):
    status, body = srv.post_json("/detokenize", {"tokens": ids})
    assert status == 200, body
    return body["prompt"]


# ---------------------------------------------------------------------------


def test_health_check(client, srv):
    hpb = client.hpb
    for name in ("", "tandem.v1.Generate"):
        r = client.health.Check(hpb.HealthCheckRequest(service=name), timeout=scaled(10))
        assert r.status == hpb.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as ei:
        client.health.Check(hpb.HealthCheckRequest(service="no.such.Service"), timeout=scaled(10))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    # Watch reports an unknown service in a message (the protocol's rule), not an error.
    w = client.health.Watch(hpb.HealthCheckRequest(service="no.such.Service"), timeout=scaled(10))
    assert next(w).status == hpb.HealthCheckResponse.SERVICE_UNKNOWN
    w.cancel()


def test_greedy_text_and_token_ids_equal_http(client, srv):
    for prompt in PROMPTS:
        ref = http_completion(srv, prompt, max_tokens=12, temperature=0)
        ids, text, _, end = client.generate(client.request(text=prompt, temperature=0,
                                                           max_tokens=12))
        assert text == ref["choices"][0]["text"]
        assert end.finish_reason == ref["choices"][0]["finish_reason"]
        assert end.prompt_tokens == ref["usage"]["prompt_tokens"]
        assert end.completion_tokens == ref["usage"]["completion_tokens"] == len(ids)
        # The ids are the text: the HTTP detokenizer turns them into it. Bytes
        # that are not UTF-8 (a random model emits some) become U+FFFD, one
        # per ill-formed piece, which differ between whole-text and streamed
        # decoding; the rest must agree.
        detok = detokenize(srv, ids)
        assert detok.replace("\ufffd", "") == text.replace("\ufffd", "")
        if "\ufffd" not in text:
            assert detok == text
        # The same prompt as token ids (from the HTTP tokenizer) gives the same output.
        prompt_ids = tokenize(srv, prompt)
        assert len(prompt_ids) == end.prompt_tokens
        ids2, text2, _, end2 = client.generate(client.request(ids=prompt_ids, temperature=0,
                                                              max_tokens=12))
        assert (ids2, text2) == (ids, text)
        assert end2.prompt_tokens == end.prompt_tokens


def test_chat_equals_http(client, srv):
    msgs = [("system", "be brief"), ("user", "hi there")]
    status, ref = srv.post_json("/v1/chat/completions", {
        "messages": [{"role": r, "content": c} for r, c in msgs],
        "max_tokens": 10, "temperature": 0})
    assert status == 200, ref
    _, text, _, end = client.generate(client.request(chat=msgs, temperature=0, max_tokens=10))
    assert text == ref["choices"][0]["message"]["content"]
    assert end.prompt_tokens == ref["usage"]["prompt_tokens"]


def test_seed_reproducible(client, srv):
    def run(seed):
        ids, text, _, _ = client.generate(client.request(text="seeded", temperature=1.0,
                                                         seed=seed, max_tokens=16))
        return ids, text

    a, b, c = run(1234), run(1234), run(99)
    assert a == b
    assert a != c, "two seeds gave the same 16 tokens from a 512-token vocabulary"
    ref = http_completion(srv, "seeded", max_tokens=16, temperature=1.0, seed=1234)
    assert a[1] == ref["choices"][0]["text"]


def test_stop_strings(client, srv):
    _, full, _, _ = client.generate(client.request(text="stop here", temperature=0,
                                                   max_tokens=40, ignore_eos=True))
    # A stop string from the middle of the greedy output (ASCII letters, so it
    # is not split by a replacement character).
    stop = None
    for i in range(3, len(full) - 2):
        cand = full[i:i + 2]
        if cand.isascii() and cand.isalnum():
            stop = cand
            break
    assert stop is not None, f"no ASCII stop candidate in {full!r}"
    idx = full.index(stop)
    _, text, _, end = client.generate(client.request(text="stop here", temperature=0,
                                                     max_tokens=40, ignore_eos=True,
                                                     stop=[stop]))
    assert end.finish_reason == "stop"
    assert end.WhichOneof("stop_reason") == "stop_str" and end.stop_str == stop
    assert text == full[:idx]
    _, text2, _, _ = client.generate(client.request(text="stop here", temperature=0,
                                                    max_tokens=40, ignore_eos=True,
                                                    stop=[stop], include_stop_str_in_output=True))
    assert text2 == full[:idx + len(stop)]
    ref = http_completion(srv, "stop here", max_tokens=40, temperature=0, ignore_eos=True,
                          stop=[stop])
    assert ref["choices"][0]["text"] == text


def test_max_tokens_length(client, srv):
    ids, _, chunks, end = client.generate(client.request(text="count", temperature=0,
                                                         max_tokens=5, ignore_eos=True))
    assert end.finish_reason == "length"
    assert end.completion_tokens == 5 and len(ids) == 5
    assert end.prompt_tokens == len(tokenize(srv, "count"))


def test_logprobs(client, srv):
    ids, _, chunks, _ = client.generate(client.request(text="lp", temperature=0, max_tokens=6,
                                                       logprobs=True, top_logprobs=3))
    lps = [lp for ch in chunks for lp in ch.logprobs]
    assert [lp.token_id for lp in lps] == ids
    ref = http_completion(srv, "lp", max_tokens=6, temperature=0, logprobs=3)
    ref_lp = ref["choices"][0]["logprobs"]["token_logprobs"]
    assert len(ref_lp) == len(lps)
    for lp, r in zip(lps, ref_lp):
        assert len(lp.top_logprobs) == 3
        # Greedy: the sampled token is the most likely one.
        assert lp.top_logprobs[0].token_id == lp.token_id
        assert lp.top_logprobs[0].logprob == lp.logprob
        tops = [t.logprob for t in lp.top_logprobs]
        assert tops == sorted(tops, reverse=True) and tops[0] <= 0
        # float32 on both sides; JSON may print fewer digits.
        assert abs(lp.logprob - r) <= 1e-5


@pytest.mark.parametrize("sampling,extra", [
    ({"temperature": 2.5}, {}),
    ({"top_p": 0.0}, {}),
    ({"max_tokens": 0}, {}),
    ({"min_tokens": 9, "max_tokens": 3}, {}),
    ({"stop": [""]}, {}),
    ({"top_logprobs": 21}, {}),
    ({"temperature": float("nan")}, {}),
    ({}, {"ids": [1, 999999]}),
    ({}, {"ids": []}),
    ({}, {"text": None}),
    ({}, {"text": "x " * (CTX + 10)}),
])
def test_invalid_params(client, srv, sampling, extra):
    kw = {"text": "hi"}
    kw.update(extra)
    if kw.get("text") is None:
        kw.pop("text")
    code, details = client.error_of(client.request(**kw, **sampling))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details


def test_unknown_model_and_method(client, srv):
    before = metric(srv.metrics(), "tandem:request_errors_total", code="404")
    code, details = client.error_of(client.request(text="hi", model="no-such-model"))
    assert code == grpc.StatusCode.NOT_FOUND, details
    # Counted like the HTTP API's 404.
    assert metric(srv.metrics(), "tandem:request_errors_total", code="404") == before + 1
    call = client.channel.unary_unary("/tandem.v1.Generate/Nope")
    with pytest.raises(grpc.RpcError) as ei:
        call(b"", timeout=scaled(10))
    assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_oversized_message(client, srv):
    # Over the server's message limit (the HTTP body limit, 4 MiB by default).
    code, _ = client.error_of(client.request(text="y" * (5 << 20), max_tokens=2))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    _, _, _, end = client.generate(client.request(text="after", max_tokens=2, ignore_eos=True))
    assert end.completion_tokens == 2
    srv.wait_idle()


def test_malformed_message(client, srv):
    raw = client.channel.unary_stream("/tandem.v1.Generate/Generate")
    for junk in (b"\xff\xff\xff\xff", b"\x0a\x80", b"\x1a\x05ab"):
        with pytest.raises(grpc.RpcError) as ei:
            list(raw(junk, timeout=scaled(10)))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, junk
    srv.wait_idle()


def long_request(client, request_id=""):
    return client.request(text="go on", request_id=request_id, temperature=0,
                          max_tokens=MAX_LONG, ignore_eos=True)


def test_abort(client, srv):
    it = client.gen.Generate(long_request(client, "abort-me"), timeout=scaled(120))
    first = next(it)
    assert first.WhichOneof("response") == "chunk"
    assert first.request_id == "abort-me"
    t0 = time.monotonic()
    r = client.gen.Abort(client.pb.AbortRequest(request_id="abort-me"), timeout=scaled(10))
    assert r.found
    end = None
    for msg in it:
        if msg.WhichOneof("response") == "complete":
            end = msg.complete
    assert end is not None
    assert end.finish_reason == "abort"
    assert end.completion_tokens < MAX_LONG
    assert time.monotonic() - t0 < scaled(5)
    for rid in ("abort-me", "", "never-ran"):
        r = client.gen.Abort(client.pb.AbortRequest(request_id=rid), timeout=scaled(10))
        assert not r.found, rid
    srv.wait_idle()


def test_duplicate_request_id(client, srv):
    it = client.gen.Generate(long_request(client, "dup"), timeout=scaled(120))
    next(it)
    code, _ = client.error_of(long_request(client, "dup"))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    it.cancel()
    srv.wait_idle()


def test_bad_request_id(client, srv):
    # Ids go into log lines and responses: a newline (a forged log line),
    # non-ASCII bytes or an overlong id are refused, a good one is echoed.
    for rid in ("a\nI request: id=forged", "caf\u00e9", "x" * 64, "with space"):
        code, details = client.error_of(client.request(text="hi", request_id=rid, max_tokens=1))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (rid, details)
        assert "request_id" in details
    msgs = list(client.gen.Generate(client.request(text="hi", request_id="ok-" + "x" * 60,
                                                   max_tokens=1), timeout=scaled(30)))
    assert msgs[-1].request_id == "ok-" + "x" * 60
    srv.wait_idle()


def test_client_cancel_frees_request(client, srv):
    it = client.gen.Generate(long_request(client), timeout=scaled(120))
    next(it)
    # The gauges are published after each scheduler step: poll (behind a
    # router: the decode instance's scheduler, and the router's own count).
    wait_until(lambda: (metric(m := srv.inst.metrics(), "vllm:num_requests_running") == 1
                        and metric(m, "tandem:kv_blocks", state="used") > 0
                        and metric(srv.metrics(), "vllm:num_requests_running") == 1),
               timeout=10, what="the running request in /metrics")
    it.cancel()
    srv.wait_idle()
    # A deadline cancels the same way.
    with pytest.raises(grpc.RpcError) as ei:
        client.generate(long_request(client), timeout=0.5)
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    srv.wait_idle()


def _garbage_payloads():
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    return [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        bytes(range(256)) * 8,
        preface + b"\x00\x00\x06\x04\x00\x00\x00\x00\x00" + b"\xff" * 6,  # bad SETTINGS
        preface + b"\xff\xff\xff\x01\x05\x00\x00\x00\x01" + b"A" * 200,   # huge HEADERS frame
        preface + b"\x00\x00\x04\x08\x00\x00\x00\x00\x00" + b"\x7f\xff\xff\xff",  # WINDOW_UPDATE
        b"\x00" * 10,
    ]


def test_garbage_bytes_then_generate(client, srv):
    # Every garbage connection stays open (some wait for more bytes) while a
    # real client is served.
    socks = []
    try:
        for junk in _garbage_payloads():
            s = socket.create_connection((srv.host, srv.grpc_port), timeout=scaled(5))
            socks.append(s)
            s.sendall(junk)
        ids, _, _, end = client.generate(client.request(text="still alive", temperature=0,
                                                        max_tokens=4, ignore_eos=True))
        assert end.finish_reason == "length" and len(ids) == 4
        r = client.health.Check(client.hpb.HealthCheckRequest(), timeout=scaled(10))
        assert r.status == client.hpb.HealthCheckResponse.SERVING
    finally:
        for s in socks:
            s.close()
    _, _, _, end = client.generate(client.request(text="after", max_tokens=2, ignore_eos=True))
    assert end.completion_tokens == 2
    srv.wait_idle()


@pytest.mark.parametrize("kind", KINDS)
def test_api_key(kind, stubs, tandem_bin, model, tmp_path_factory):
    s = start_front(kind, tandem_bin, model, tmp_path_factory, "--api-key", "k-one",
                    "--api-key", "k-two")
    c = Client(stubs, s)
    try:
        req = c.request(text="hi", max_tokens=3)
        for md in ([], [("authorization", "Bearer wrong")], [("authorization", "k-one")]):
            code, _ = c.error_of(req, metadata=md)
            assert code == grpc.StatusCode.UNAUTHENTICATED, md
        with pytest.raises(grpc.RpcError) as ei:
            c.gen.Abort(c.pb.AbortRequest(request_id="x"), timeout=scaled(10))
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for key in ("k-one", "k-two"):
            _, _, _, end = c.generate(req, metadata=[("authorization", f"Bearer {key}")])
            assert end.completion_tokens == 3
        # Health needs no key.
        r = c.health.Check(c.hpb.HealthCheckRequest(), timeout=scaled(10))
        assert r.status == c.hpb.HealthCheckResponse.SERVING
        assert s.stop() == 0, s.logs()
    finally:
        c.close()
        s.close()


@pytest.mark.parametrize("kind", KINDS)
def test_drain_not_serving(kind, stubs, tandem_bin, model, tmp_path_factory):
    """SIGTERM drains (behind a router: the router is the one stopped)."""
    s = start_front(kind, tandem_bin, model, tmp_path_factory, "--drain-timeout", 60)
    c = Client(stubs, s)
    try:
        hpb = c.hpb
        watch = c.health.Watch(hpb.HealthCheckRequest(service=""), timeout=scaled(60))
        assert next(watch).status == hpb.HealthCheckResponse.SERVING
        it = c.gen.Generate(long_request(c, "running"), timeout=scaled(120))
        next(it)
        s.proc.send_signal(signal.SIGTERM)
        # Watch reports the change without being asked again.
        assert next(watch).status == hpb.HealthCheckResponse.NOT_SERVING
        r = c.health.Check(hpb.HealthCheckRequest(), timeout=scaled(10))
        assert r.status == hpb.HealthCheckResponse.NOT_SERVING
        code, _ = c.error_of(c.request(text="late", max_tokens=2))
        assert code == grpc.StatusCode.UNAVAILABLE
        # The running request goes on until aborted; then the server exits.
        assert c.gen.Abort(c.pb.AbortRequest(request_id="running"), timeout=scaled(10)).found
        ends = [m.complete.finish_reason for m in it if m.WhichOneof("response") == "complete"]
        assert ends == ["abort"]
        assert s.stop(timeout=30) == 0, s.logs()
    finally:
        c.close()
        s.close()


@pytest.mark.parametrize("kind", KINDS)
def test_drain_timeout_ends_stream_with_abort(kind, stubs, tandem_bin, model, tmp_path_factory):
    s = start_front(kind, tandem_bin, model, tmp_path_factory, "--drain-timeout", 0.5)
    c = Client(stubs, s)
    try:
        it = c.gen.Generate(long_request(c), timeout=scaled(120))
        next(it)
        s.proc.send_signal(signal.SIGTERM)
        ends = [m.complete for m in it if m.WhichOneof("response") == "complete"]
        assert len(ends) == 1 and ends[0].finish_reason == "abort"
        assert ends[0].completion_tokens < MAX_LONG
        if s.routed:
            # The router exits; the decode instance let go of the request.
            assert s.api.proc.wait(timeout=scaled(30)) == 0, s.logs()
            s.inst.wait_idle()
        assert s.stop(timeout=30) == 0, s.logs()
    finally:
        c.close()
        s.close()
