"""Equivalence through the router: greedy and seeded answers through
tandem-router (2 prefill + 2 decode instances, remote and local prefill
both exercised) equal `tandem serve`'s on the same tiny model, over HTTP
(completions and chat, logprobs, stop strings, n > 1, echo, streaming) and
gRPC (text, token ids, chat). The router tokenizes and applies the chat
template itself and sends token ids; the decode instance detokenizes and
applies the stop rules, so equal answers check the whole path. The usage
(cached tokens included) is compared too: before each routed request the
router's view is let settle (Cluster.wait_settled), so that a prompt seen
before goes where its prefix is cached, as it does in `tandem serve`."""

import concurrent.futures as cf

import grpc
import pytest

from conftest import scaled
from grpc_stubs import load_stubs
from serve_util import Cluster, Server

BODIES = [
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 12,
                         "temperature": 0, "logprobs": 3}),
    ("/v1/completions", {"prompt": [5, 17, 99, 300, 41] * 30, "max_tokens": 10,
                         "temperature": 0, "logprobs": 2}),
    ("/v1/completions", {"prompt": "once upon a time", "max_tokens": 16, "temperature": 0.8,
                         "top_k": 40, "seed": 11, "n": 2}),
    ("/v1/completions", {"prompt": "a b c d e f", "max_tokens": 24, "temperature": 0,
                         "stop": [" e", "zz"], "echo": True}),
    ("/v1/completions", {"prompt": "hello hello hello", "max_tokens": 10, "temperature": 0.7,
                         "seed": 3, "repetition_penalty": 1.3, "min_tokens": 4,
                         "logit_bias": {"7": 5.0}}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Name a colour."}],
                              "max_tokens": 12, "temperature": 0, "logprobs": True,
                              "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count: one two"}],
                              "max_tokens": 20, "temperature": 0, "stop": ["three"]}),
]


def chat_model(manifest, test_models):
    for m in manifest:
        if m["format"] == "gguf" and m["arch"] == "llama" and m["variant"] == "smollm2" \
                and m["wtype"] in ("F32", "f32"):
            return test_models / m["path"]
    pytest.fail("no smollm2 F32 gguf model in models.json")


@pytest.fixture(scope="module")
def both(tandem_bin, manifest, test_models, tmp_path_factory):
    model = chat_model(manifest, test_models)
    d = tmp_path_factory.mktemp("equiv")
    serve = Server.start(tandem_bin, model, ["--threads", 1, "--grpc-port", 0], d / "serve")
    try:
        # prompts under 64 uncached tokens prefill on the decode instance
        c = Cluster(tandem_bin, d, model,
                    r_args=["--local-prefill-threshold", 64, "--local-prefill-fraction", 0])
    except BaseException:
        serve.close()
        raise
    yield serve, c
    c.close()
    serve.close()


def strip(out):
    """What must be equal: everything but ids and timestamps."""
    out = dict(out)
    for k in ("id", "created", "system_fingerprint"):
        out.pop(k, None)
    return out


@pytest.mark.parametrize("i", range(len(BODIES)))
def test_http_equal(both, i):
    serve, c = both
    path, body = BODIES[i]
    s1, want = serve.post_json(path, body, timeout=120)
    c.wait_settled()
    s2, got = c.router.post_json(path, body, timeout=120)
    assert s1 == 200, want
    assert s2 == 200, (got, c.router.log_tail())
    assert strip(got) == strip(want)


def stream_text(srv, path, body):
    st = srv.open_stream(path, dict(body, stream=True,
                                    stream_options={"include_usage": True}), timeout=120)
    try:
        assert st.status == 200
        text, finish, usage = {}, {}, None
        for e in st.events():
            if e == "[DONE]":
                break
            assert "error" not in e, e
            usage = e.get("usage") or usage
            for ch in e["choices"]:
                piece = ch.get("text")
                if piece is None:
                    piece = (ch.get("delta") or {}).get("content") or ""
                text[ch["index"]] = text.get(ch["index"], "") + piece
                if ch.get("finish_reason"):
                    finish[ch["index"]] = ch["finish_reason"]
        return text, finish, usage
    finally:
        st.close()


@pytest.mark.parametrize("i", [0, 2, 3, 5])
def test_stream_equal(both, i):
    serve, c = both
    path, body = BODIES[i]
    want = stream_text(serve, path, body)
    c.wait_settled()
    assert stream_text(c.router, path, body) == want


def test_concurrent_equal(both):
    """Sixteen requests at once, spread over both decode instances."""
    serve, c = both
    bodies = [{"prompt": [3 + i, 40, 41, 42 + i] * (5 + 3 * i), "max_tokens": 8,
               "temperature": 0} for i in range(16)]
    want = [serve.post_json("/v1/completions", b)[1]["choices"] for b in bodies]
    with cf.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda b: c.router.post_json("/v1/completions", b, timeout=120), bodies))
    for (status, out), w in zip(got, want):
        assert status == 200, out
        assert out["choices"] == w
    assert all(c.inst(d)["routed"] > 0 for d in c.ds)
    c.wait_idle()


def test_grpc_equal(both, source_dir, tmp_path_factory):
    serve, c = both
    stubs = load_stubs(source_dir, tmp_path_factory.mktemp("stubs"))
    pb = stubs.tandem
    reqs = [
        pb.GenerateRequest(text="The capital of France is",
                           sampling=pb.SamplingParams(temperature=0, max_tokens=10, logprobs=True,
                                                      top_logprobs=2)),
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[9, 8, 7, 6] * 25),
                           sampling=pb.SamplingParams(temperature=0, max_tokens=8)),
        pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Hi")]),
                           sampling=pb.SamplingParams(temperature=0.9, seed=5, max_tokens=12,
                                                      stop=["."])),
    ]

    def run(srv, req):
        ch = grpc.insecure_channel(f"{srv.host}:{srv.grpc_port}")
        try:
            out = []
            for r in stubs.tandem_grpc.GenerateStub(ch).Generate(req, timeout=scaled(60)):
                kind = r.WhichOneof("response")
                if kind == "chunk":
                    out.append(("chunk", list(r.chunk.token_ids), r.chunk.text,
                                [(lp.token_id, round(lp.logprob, 5)) for lp in r.chunk.logprobs]))
                else:
                    out.append((kind, str(getattr(r, kind))))
            return out
        finally:
            ch.close()

    def flat(out):
        """Chunk boundaries depend on timing: compare the concatenation."""
        ids, text, lps, end = [], "", [], None
        for o in out:
            if o[0] == "chunk":
                ids += o[1]
                text += o[2]
                lps += o[3]
            else:
                end = o
        return ids, text, lps, end

    for req in reqs:
        want = flat(run(serve, req))
        c.wait_settled()
        assert flat(run(c.router, req)) == want


def test_models_tokenize_served_by_router(both):
    serve, c = both
    for path, body in (("/tokenize", {"prompt": "hello world"}),
                       ("/detokenize", {"tokens": [5, 6, 7]})):
        assert c.router.post_json(path, body) == serve.post_json(path, body)
    s1, m1 = serve.get_json("/v1/models")
    s2, m2 = c.router.get_json("/v1/models")
    assert s1 == s2 == 200
    assert [m["id"] for m in m1["data"]] == [m["id"] for m in m2["data"]]


TOOL_BODY = {
    "messages": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Oslo?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}],
}


def test_chat_template_paths_served_by_router(both):
    """/apply-template and /tokenize with messages are answered by the router
    itself, as `tandem serve` answers them; a chat with tools and tool calls
    through router, prefill and decode equals serve's."""
    serve, c = both
    for path, body in (("/apply-template", TOOL_BODY),
                       ("/apply-template", dict(TOOL_BODY, add_generation_prompt=False)),
                       ("/tokenize", TOOL_BODY)):
        s1, o1 = serve.post_json(path, body)
        s2, o2 = c.router.post_json(path, body)
        assert s1 == s2 == 200, (o1, o2)
        assert o1 == o2
    s, o = serve.post_json("/apply-template", TOOL_BODY)
    assert "Oslo" in o["prompt"] and o["prompt"].endswith("assistant\n")
    # a bad tool call is a 400 from either, before anything is routed
    bad = dict(TOOL_BODY, messages=[dict(TOOL_BODY["messages"][2], tool_calls=[
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}])])
    for srv in (serve, c.router):
        status, out = srv.post_json("/v1/chat/completions", dict(bad, max_tokens=2))
        assert status == 400 and out["error"]["param"] == "messages", out
    body = dict(TOOL_BODY, max_tokens=8, temperature=0)
    c.wait_settled()
    s1, o1 = serve.post_json("/v1/chat/completions", body)
    s2, o2 = c.router.post_json("/v1/chat/completions", body)
    assert s1 == s2 == 200, (o1, o2)
    assert strip(o1) == strip(o2)
