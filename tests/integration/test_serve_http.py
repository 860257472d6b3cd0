"""The OpenAI HTTP surface of `tandem serve` (common/api/http.c) on a tiny
random model, with the official `openai` client and raw sockets.

One server for the whole file (starting one per test would dominate the
runtime). References are independent of the server: `tandem generate`
(the engine in-process, no scheduler, no HTTP) for greedy text, the
Hugging Face `tokenizers` package on the model's tokenizer.json for token
ids, and `tandem eval` (raw logits) for logprobs. The last test checks that
after every scenario above, faults included, no KV block is used or
reserved and nothing runs.

Every test runs twice (the srv fixture's params): against `tandem serve`,
and against a tandem-router over one prefill and one decode instance with
the same keys and limits (serve_util.Front: requests go to the router;
scheduler gauges, counters, KV blocks and /internal/v1/state are the
decode instance's).
"""

import http.client
import json
import math
import socket
import threading
import time

import numpy as np
import openai
import pytest

from conftest import run_tandem, scaled, tandem_eval_raw, wait_until
from reference_util import byte_decoder
from serve_util import Cluster, Front, Server, metric, state_load

NAME = "tiny-chat"
KEY = "sk-test-0123456789"
KEY2 = "second-key"
CTX = 4096
MAX_RUNNING = 8
MAX_WAITING = 8  # queued requests beyond which submissions get 429
PING_S = 0.5
# A request that runs for many seconds on the tiny model (8 choices of ~4000
# tokens, attention over a growing context); used only by the tests that
# cancel it, which check that it was cancelled (the abort counter).
LONG = dict(max_tokens=CTX - 64, ignore_eos=True, n=MAX_RUNNING, temperature=1.0)


def _variant(manifest, fmt):
    for m in manifest:
        if m["format"] == fmt and m["arch"] == "llama" and m["variant"] == "smollm2" \
                and m["wtype"] in ("F32", "f32"):
            return m
    pytest.fail(f"no smollm2 F32 {fmt} model in models.json")


@pytest.fixture(scope="module")
def model_path(test_models, manifest):
    return test_models / _variant(manifest, "gguf")["path"]


@pytest.fixture(scope="module")
def hf_tokenizer(test_models, manifest):
    tokenizers = pytest.importorskip("tokenizers")
    d = test_models / _variant(manifest, "hf")["path"]
    return tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))


class KeyedServer(Server):
    """serve_util's Server, reading /internal/v1/state with the API key
    (every endpoint but /health, /ready and /metrics needs it)."""

    def state(self, since=None):
        path = "/internal/v1/state" + ("" if since is None else f"?since={since}")
        status, _, data = self.request("GET", path, headers=auth())
        if status != 200:
            pytest.fail(f"GET {path}: {status} {data[:300]!r}")
        return json.loads(data)


SERVE_ARGS = ["--ctx", CTX, "--kv-blocks", (MAX_RUNNING + 2) * CTX // 16,
              "--max-running", MAX_RUNNING, "--max-waiting", MAX_WAITING,
              "--ping-interval", PING_S, "--threads", 1]
# The router's own limits: the API keys, the context (--max-ctx), its queue
# (--max-queued, then 429) and the ping interval of its streams.
# The router reads its keys from a file (a mounted Secret), a key per line.
ROUTER_ARGS = ["--served-model-name", NAME, "--max-ctx", CTX, "--max-queued", MAX_WAITING,
               "--ping-interval", PING_S]


def start_front(kind, tandem_bin, model_path, log_dir):
    """kind "serve": `tandem serve` with the API keys and limits; "router":
    the same limits on a decode instance (and the model's context on the
    prefill instance) behind a tandem-router with the API keys."""
    keys = log_dir / "api-keys"
    if kind == "serve":  # a key by flag, a key by file
        keys.write_text(f"{KEY2}\n")
        return Front.serve(KeyedServer.start(
            tandem_bin, model_path, ["--served-model-name", NAME, "--api-key", KEY,
                                     "--api-key-file", keys, *SERVE_ARGS], log_dir))
    keys.write_text(f"{KEY}\n\n  {KEY2}\r\n")
    return Front.router(Cluster(tandem_bin, log_dir, model_path, n_prefill=1, n_decode=1,
                                p_args=["--ctx", CTX, "--kv-blocks", 2 * CTX // 16],
                                d_args=SERVE_ARGS,
                                r_args=[*ROUTER_ARGS, "--api-key-file", keys]))


@pytest.fixture(scope="module", params=["serve", "router"])
def srv(request, tandem_bin, model_path, tmp_path_factory):
    s = start_front(request.param, tandem_bin, model_path,
                    tmp_path_factory.mktemp(f"serve-http-{request.param}"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0,
                         timeout=scaled(120))


def auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def post(srv, path, obj, key=KEY, timeout=120):
    h = {"Content-Type": "application/json"}
    if key:
        h.update(auth(key))
    body = obj if isinstance(obj, (bytes, bytearray)) else json.dumps(obj).encode()
    status, headers, data = srv.request("POST", path, body, h, timeout=timeout)
    try:
        parsed = json.loads(data)
    except ValueError:
        parsed = None
    return status, headers, parsed


def internal_auth(srv):
    """Headers for /internal/ paths: the API key on serve, the cluster token
    on an instance behind a router."""
    return srv.inst.internal_headers if srv.routed else auth()


def assert_error(status, body, want_status, param=None, code=None):
    assert status == want_status, body
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    e = body["error"]
    assert isinstance(e.get("message"), str) and e["message"], e
    assert isinstance(e.get("type"), str) and e["type"], e
    if param is not None:
        assert e.get("param") == param, e
    if code is not None:
        assert e.get("code") == code, e
    return e


def generate_ref(tandem_bin, model_path, *args):
    """Greedy text from `tandem generate` (it prints a final newline)."""
    r = run_tandem("generate", "--model", model_path, "--temperature", "0", "--threads", "1",
                   "--ctx", CTX, *args, binary=tandem_bin, timeout=120)
    out = r.stdout
    assert out.endswith("\n"), r.describe()
    return out[:-1]


def collect_stream(stream):
    """(text by choice index, finish by index, usage, chunks) of an openai stream."""
    texts, finish, usage, chunks = {}, {}, None, []
    for ch in stream:
        chunks.append(ch)
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            piece = getattr(c, "text", None)
            if piece is None:
                piece = c.delta.content or ""
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                assert c.index not in finish, "two finish_reasons for one choice"
                finish[c.index] = c.finish_reason
    return texts, finish, usage, chunks


# ---------------------------------------------------------------------------
# Happy paths


def test_models_list(client, srv):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [NAME]
    assert models.data[0].owned_by == "tandem"
    status, _, raw = srv.request("GET", "/v1/models", headers=auth())
    assert status == 200
    d = json.loads(raw)
    assert d["object"] == "list" and d["data"][0]["max_model_len"] == CTX


def test_completion_greedy_matches_generate(client, tandem_bin, model_path, hf_tokenizer):
    prompt = "The quick brown fox"
    want = generate_ref(tandem_bin, model_path, "--prompt", prompt, "--max-tokens", "12")
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-")
    assert r.model == NAME
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.text == want
    assert c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(hf_tokenizer.encode(prompt).ids)
    assert 1 <= r.usage.completion_tokens <= 12
    if c.finish_reason == "length":
        assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # The whole OpenAI shape, including the cached-tokens detail.
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_stream_equals_non_stream(client):
    prompt = "Once upon a time"
    full = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
    s = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0,
                                  stream=True, stream_options={"include_usage": True})
    texts, finish, usage, chunks = collect_stream(s)
    assert texts == {0: full.choices[0].text}
    assert finish == {0: full.choices[0].finish_reason}
    # include_usage: one last chunk with no choices and the totals.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(ch.usage is None for ch in chunks[:-1])
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert all(ch.id == chunks[0].id for ch in chunks)


def test_chat_greedy_matches_generate(client, tandem_bin, model_path):
    want = generate_ref(tandem_bin, model_path, "--chat", "Hello there", "--max-tokens", "10")
    r = client.chat.completions.create(model=NAME, max_tokens=10, temperature=0,
                                       messages=[{"role": "user", "content": "Hello there"}])
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert c.message.content == want
    # The same conversation as content parts renders the same prompt.
    r2 = client.chat.completions.create(
        model=NAME, max_tokens=10, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}])
    assert r2.choices[0].message.content == want
    assert r2.usage.prompt_tokens == r.usage.prompt_tokens


def test_chat_stream(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count"}]
    full = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12,
                                          temperature=0)
    s = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    texts, finish, usage, chunks = collect_stream(s)
    # The first chunk carries the role (and empty content), before any token.
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == ""
    assert all(c.delta.role is None for ch in chunks[1:] for c in ch.choices)
    assert chunks[0].object == "chat.completion.chunk"
    assert texts == {0: full.choices[0].message.content}
    assert finish == {0: full.choices[0].finish_reason}
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # Without include_usage there is no usage chunk.
    s = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=4, temperature=0,
                                       stream=True)
    _, _, usage, chunks = collect_stream(s)
    assert usage is None and all(ch.choices for ch in chunks)


def test_sse_framing(srv):
    """The bytes on the wire: `data: {json}` events, `data: [DONE]` last."""
    st = srv.open_stream("/v1/completions", {"prompt": "abc", "max_tokens": 3, "stream": True,
                                             "temperature": 0}, headers=auth())
    try:
        assert st.status == 200
        assert st.headers["content-type"].startswith("text/event-stream")
        evs = list(st.events())
    finally:
        st.close()
    assert evs[-1] == "[DONE]" and "[DONE]" not in evs[:-1]
    assert all(isinstance(e, dict) and e["object"] == "text_completion" for e in evs[:-1])


def test_stop_strings(client):
    prompt = "A B C D"
    base = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    # A stop string from the middle of the greedy text; the output must end
    # right before its first occurrence.
    cut = None
    for i in range(2, len(text) - 2):
        s = text[i:i + 2]
        if s.strip() and "\ufffd" not in s and text.find(s) == i:
            cut = (i, s)
            break
    if cut is None:
        pytest.fail(f"no usable stop string in {text!r}")
    i, s = cut
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                  stop=[s, "never-generated-zzz"], extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text == text[:i]
    assert c.finish_reason == "stop"
    assert c.model_extra.get("stop_reason") == s
    # include_stop_str_in_output keeps it (vLLM).
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                  stop=s, extra_body={"ignore_eos": True,
                                                      "include_stop_str_in_output": True})
    assert r.choices[0].text == text[:i + len(s)]
    # Streaming stops at the same place.
    st = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                   stop=s, stream=True, extra_body={"ignore_eos": True})
    texts, finish, _, _ = collect_stream(st)
    assert texts == {0: text[:i]} and finish == {0: "stop"}


def test_max_tokens_and_length(client):
    for mt in (1, 7):
        r = client.completions.create(model=NAME, prompt="x", max_tokens=mt, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == mt
        assert r.choices[0].finish_reason == "length"
    # max_completion_tokens is accepted and wins over max_tokens.
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True, "max_tokens": 9})
    assert r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "length"


def test_seed_reproducible(client):
    kw = dict(model=NAME, prompt="Seeds", max_tokens=24, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b
    # Other seeds give other samples (with temperature 1 over 24 tokens of
    # a 512-token vocabulary, four identical texts would be a broken seed).
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3, 4)}
    assert len(others | {a}) > 1
    # A seeded stream equals the seeded non-stream.
    s = client.completions.create(seed=1234, stream=True, **kw)
    texts, _, _, _ = collect_stream(s)
    assert texts == {0: a}


def test_n_choices(client):
    kw = dict(model=NAME, prompt="Many", max_tokens=10, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    r = client.completions.create(n=3, **kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 30
    assert r.usage.prompt_tokens == client.completions.create(
        model=NAME, prompt="Many", max_tokens=1).usage.prompt_tokens
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # choices get different seeds ...
    again = client.completions.create(n=3, **kw)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts  # ... repeatably
    # Streaming n=2 chat: both choices, each with its own role chunk and end.
    s = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                       n=2, max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    t, finish, usage, chunks = collect_stream(s)
    assert sorted(t) == [0, 1] and sorted(finish) == [0, 1]
    roles = [c.index for ch in chunks for c in ch.choices if c.delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    one = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=6, temperature=0)
    assert t == {0: one.choices[0].message.content, 1: one.choices[0].message.content}
    assert usage.completion_tokens == 2 * one.usage.completion_tokens


def test_prompt_batch_and_token_ids(client, hf_tokenizer):
    single = [client.completions.create(model=NAME, prompt=p, max_tokens=6, temperature=0)
              .choices[0].text for p in ("alpha", "beta")]
    r = client.completions.create(model=NAME, prompt=["alpha", "beta"], max_tokens=6,
                                  temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == single
    # The same prompts as token ids (from the HF tokenizer).
    ids = [hf_tokenizer.encode(p).ids for p in ("alpha", "beta")]
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == single
    r = client.completions.create(model=NAME, prompt=ids[0], max_tokens=6, temperature=0)
    assert r.choices[0].text == single[0]


def test_echo(client):
    r = client.completions.create(model=NAME, prompt="Echo me", max_tokens=4, temperature=0,
                                  echo=True)
    plain = client.completions.create(model=NAME, prompt="Echo me", max_tokens=4, temperature=0)
    assert r.choices[0].text == "Echo me" + plain.choices[0].text
    s = client.completions.create(model=NAME, prompt="Echo me", max_tokens=4, temperature=0,
                                  echo=True, stream=True)
    texts, _, _, _ = collect_stream(s)
    assert texts == {0: r.choices[0].text}


def _bytes_to_id(hf_tokenizer):
    """Byte-level BPE: each vocabulary string maps to the bytes it stands for."""
    dec = byte_decoder()
    out = {}
    for s, i in hf_tokenizer.get_vocab(with_added_tokens=True).items():
        try:
            out[bytes(dec[ch] for ch in s)] = i
        except KeyError:
            continue
    return out


def test_chat_logprobs_match_eval(client, srv, hf_tokenizer, tandem_bin, model_path, tmp_path):
    msgs = [{"role": "user", "content": "Logprobs please"}]
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    b2id = _bytes_to_id(hf_tokenizer)
    out_ids = [b2id[bytes(e.bytes)] for e in content]
    # The prompt as the server tokenized it (its /tokenize; checked against
    # the HF tokenizer in test_tokenize_detokenize).
    status, _, tk = post(srv, "/tokenize", {"messages": msgs})
    assert status == 200
    prompt_ids = tk["tokens"]
    assert len(prompt_ids) == r.usage.prompt_tokens
    _, logits = tandem_eval_raw(model_path, [prompt_ids + out_ids[:-1]], binary=tandem_bin,
                                workdir=tmp_path)
    lg = logits[0].astype(np.float64)
    for k, e in enumerate(content):
        row = lg[len(prompt_ids) - 1 + k]
        ls = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
        # Greedy: the chosen token is the argmax and its logprob the raw
        # log-softmax (tolerance: float32 logits, two summation orders).
        assert out_ids[k] == int(np.argmax(row))
        assert math.isclose(e.logprob, ls[out_ids[k]], abs_tol=2e-3), (k, e.logprob)
        assert len(e.top_logprobs) == 3
        order = np.argsort(-ls, kind="stable")[:3]
        for t, want in zip(e.top_logprobs, order):
            assert b2id[bytes(t.bytes)] == int(want)
            assert math.isclose(t.logprob, ls[want], abs_tol=2e-3)
    # Streaming carries the same logprobs, chunk by chunk.
    s = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3, stream=True,
                                       extra_body={"ignore_eos": True})
    streamed = [e for ch in s for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [bytes(e.bytes) for e in streamed] == [bytes(e.bytes) for e in content]
    assert [round(e.logprob, 4) for e in streamed] == [round(e.logprob, 4) for e in content]


def test_completion_logprobs_shape(client):
    r = client.completions.create(model=NAME, prompt="Shape", max_tokens=6, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == \
        len(lp.text_offset) == 6
    for k in range(6):
        assert lp.token_logprobs[k] <= 0
        assert 1 <= len(lp.top_logprobs[k]) <= 2
        # Greedy: the sampled token's logprob is the best of the top ones.
        assert math.isclose(lp.token_logprobs[k], max(lp.top_logprobs[k].values()), abs_tol=1e-6)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # logprobs=0: only the sampled token's.
    r = client.completions.create(model=NAME, prompt="Shape", max_tokens=3, temperature=0,
                                  logprobs=0)
    assert all(len(t) == 0 for t in r.choices[0].logprobs.top_logprobs)
    # Without logprobs the field is null.
    r = client.completions.create(model=NAME, prompt="Shape", max_tokens=3, temperature=0)
    assert r.choices[0].logprobs is None


def test_tokenize_detokenize(srv, hf_tokenizer):
    # (No digits: the GGUF "default" pre-tokenizer splits them as llama.cpp
    # does, not as tokenizer.json's ByteLevel regex.)
    text = "Hello, world! <|im_end|> the end"
    status, _, body = post(srv, "/tokenize", {"prompt": text})
    assert status == 200
    want = hf_tokenizer.encode(text).ids
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["max_model_len"] == CTX
    status, _, body = post(srv, "/detokenize", {"tokens": want})
    assert status == 200 and body["prompt"] == hf_tokenizer.decode(want, skip_special_tokens=False)
    # Chat messages render the ChatML template (tokens per the HF tokenizer).
    status, _, body = post(srv, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200
    assert body["tokens"] == hf_tokenizer.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n").ids
    status, _, body = post(srv, "/detokenize", {"tokens": [10 ** 6]})
    assert_error(status, body, 400, param="tokens")
    status, _, body = post(srv, "/tokenize", {"model": "nope", "prompt": "x"})
    assert_error(status, body, 404, code="model_not_found")


def test_health_ready_metrics_state(srv):
    # No key needed for these three.
    for path in ("/health", "/ready"):
        status, _, _ = srv.request("GET", path)
        assert status == 200
    status, headers, data = srv.request("GET", "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    assert b"vllm:num_requests_running" in data
    # The router's endpoint needs the key (an instance behind a router: the
    # cluster token; the router's own view too).
    inst, iauth = srv.inst, internal_auth(srv)
    status, _, _ = inst.request("GET", "/internal/v1/state")
    assert status == 401
    if srv.routed:
        assert inst.request("GET", "/internal/v1/state", headers=auth())[0] == 401
        assert srv.request("GET", "/internal/v1/cluster", headers=auth())[0] == 401
    status, _, raw = inst.request("GET", "/internal/v1/state?since=0", headers=iauth)
    assert status == 200
    st = json.loads(raw)
    assert isinstance(st["instance_id"], str) and st["instance_id"]
    assert isinstance(st["epoch"], str) and len(st["epoch"]) == 16
    int(st["epoch"], 16)
    assert isinstance(st["full"], bool) and isinstance(st["last_seq"], int)
    ld = state_load(st)
    assert ld["kv_total"] == (MAX_RUNNING + 2) * CTX // 16
    assert ld["kv_free"] == ld["kv_empty"] + ld["kv_cached"] - ld["kv_reserved"]
    assert ld["kv_block_size"] == 16
    # Earlier tests stored full blocks: the log has them, and a reader that
    # has seen everything gets an empty diff.
    assert st["last_seq"] > 0
    if st["full"]:
        assert all(len(h) == 32 for h in st["hashes"])
    else:
        assert [e["seq"] for e in st["events"]] == list(range(1, st["last_seq"] + 1))
        assert all(e["type"] in ("stored", "removed", "cleared") for e in st["events"])
    status, _, raw = inst.request("GET", f"/internal/v1/state?since={st['last_seq']}",
                                  headers=iauth)
    later = json.loads(raw)
    assert later["last_seq"] >= st["last_seq"]
    if later["last_seq"] == st["last_seq"]:
        assert later["full"] is False and later["events"] == []
    status, _, raw = inst.request("GET", "/internal/v1/state?since=abc", headers=iauth)
    assert_error(status, json.loads(raw), 400, param="since")


# ---------------------------------------------------------------------------
# Bad input


def test_auth(client, srv):
    bad = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as ei:
        bad.completions.create(model=NAME, prompt="x", max_tokens=1)
    assert ei.value.status_code == 401
    # Missing, wrong scheme, a prefix of the key, the key plus a byte: all 401.
    for h in ({}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY},
              auth(KEY[:-1]), auth(KEY + "x"), auth("")):
        status, headers, data = srv.request("POST", "/v1/completions",
                                            json.dumps({"prompt": "x"}).encode(),
                                            {"Content-Type": "application/json", **h})
        assert_error(status, json.loads(data), 401)
    status, _, data = srv.request("GET", "/v1/models")
    assert status == 401
    # Both configured keys work.
    for k in (KEY, KEY2):
        status, _, body = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 1}, key=k)
        assert status == 200, body


def test_malformed_and_wrong_types(srv):
    for raw in (b"{", b"not json", b"[1,2]", b"", b'{"prompt": "x",}', b"\xff\xfe{}"):
        status, _, body = post(srv, "/v1/completions", raw)
        assert_error(status, body, 400)
        status, _, body = post(srv, "/v1/chat/completions", raw)
        assert_error(status, body, 400)
    cases = [
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "stop": 3}, "stop"),
        ({"prompt": 3}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": "x", "logit_bias": [1]}, "logit_bias"),
        ({"prompt": "x", "seed": "s"}, "seed"),
    ]
    for obj, param in cases:
        status, _, body = post(srv, "/v1/completions", obj)
        assert_error(status, body, 400, param=param)
    status, _, body = post(srv, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": 5}]})
    assert_error(status, body, 400, param="messages")
    status, _, body = post(srv, "/v1/chat/completions", {"messages": "hi"})
    assert_error(status, body, 400, param="messages")


def test_out_of_range(client, srv):
    cases = [
        ({"temperature": 2.5}, "temperature"), ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -5}, "top_k"),
        ({"min_p": 2}, "min_p"), ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 5, "min_tokens": 6}, "min_tokens"), ({"n": 0}, "n"), ({"n": 100}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"), ({"stop": [""]}, "stop"),
        ({"stop": [str(i) for i in range(100)]}, "stop"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"), ({"logit_bias": {"1": 500}}, "logit_bias"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ]
    for extra, param in cases:
        status, _, body = post(srv, "/v1/completions", {"prompt": "x", **extra})
        assert_error(status, body, 400, param=param)
    status, _, body = post(srv, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30,
                            "logprobs": True})
    assert_error(status, body, 400, param="top_logprobs")
    # Through the official client: BadRequestError with the parameter.
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=NAME, prompt="x", temperature=9)
    assert ei.value.status_code == 400


def test_unknown_fields_accepted(client, srv):
    status, _, body = post(srv, "/v1/completions",
                           {"prompt": "x", "max_tokens": 2, "frobnicate": {"a": [1]},
                            "use_beam_search": False, "metadata": None})
    assert status == 200 and body["choices"], body
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, extra_body={"some_future_field": 1,
                                                                 "tools": []})
    assert r.choices[0].finish_reason in ("stop", "length")
    # The server said so in its log, naming them.
    wait_until(lambda: "frobnicate" in srv.log_tail(200000), timeout=5,
               what="the unknown-field log line")


def test_oversized_body_and_headers(srv):
    big = json.dumps({"prompt": "a" * (5 << 20)}).encode()
    status, _, body = post(srv, "/v1/completions", big)
    assert_error(status, body, 413)
    # Headers beyond the connection's memory limit: libmicrohttpd answers itself.
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=scaled(30))
    try:
        conn.request("GET", "/health", headers={"X-Big": "b" * (64 << 10)})
        r = conn.getresponse()
        r.read()
        assert r.status in (413, 431)
    except (ConnectionError, http.client.HTTPException):
        pass  # it may also just close: the server must still serve (checked below)
    finally:
        conn.close()
    assert srv.request("GET", "/health")[0] == 200


def test_context_length_exceeded(client, srv):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=NAME, prompt=[1] * CTX, max_tokens=1)
    assert ei.value.code == "context_length_exceeded"
    status, _, body = post(srv, "/v1/completions", {"prompt": [5] * 100, "max_tokens": CTX})
    assert_error(status, body, 400, param="max_tokens", code="context_length_exceeded")
    status, _, body = post(srv, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "word " * (2 * CTX)}]})
    assert_error(status, body, 400, code="context_length_exceeded")
    # Just inside: prompt + max_tokens == CTX works.
    status, _, body = post(srv, "/v1/completions", {"prompt": [5] * (CTX - 2), "max_tokens": 2,
                                                    "temperature": 0})
    assert status == 200, body


def test_unknown_model_path_method(client, srv):
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert ei.value.code == "model_not_found"
    status, _, data = srv.request("GET", "/v1/nothing", headers=auth())
    assert_error(status, json.loads(data), 404)
    status, headers, data = srv.request("GET", "/v1/completions", headers=auth())
    assert_error(status, json.loads(data), 405)
    assert "POST" in headers.get("allow", "")
    status, _, data = srv.request("DELETE", "/health")
    assert status == 405


def _raw_exchange(srv, payload, timeout=10):
    s = socket.create_connection((srv.host, srv.port), timeout=scaled(timeout))
    try:
        s.sendall(payload)
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        chunks = []
        while True:
            try:
                b = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)
    finally:
        s.close()


def test_garbage_on_the_port(srv):
    rng = np.random.default_rng(3)
    payloads = [b"\x00\xff\x13garbage\r\n\r\n", b"GET\r\n\r\n", b"HELLO WORLD HTTP/9.9\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"zz\r\n", bytes(rng.integers(0, 256, 4096, dtype=np.uint8))]
    for p in payloads:
        reply = _raw_exchange(srv, p)
        if reply:
            assert reply.startswith(b"HTTP/1."), reply[:100]
            code = int(reply.split(b" ", 2)[1])
            # libmicrohttpd answers these itself: 4xx, or 505 for a bad version.
            assert 400 <= code < 500 or code == 505, reply[:200]
    # Still serving.
    status, _, body = post(srv, "/v1/completions", {"prompt": "ok", "max_tokens": 2})
    assert status == 200, body


# ---------------------------------------------------------------------------
# Clients that go away, queueing, pings


def _counter(s, reason):
    return metric(s.metrics(), "vllm:request_success_total", finished_reason=reason)


def _running(s):
    return metric(s.metrics(), "vllm:num_requests_running")


def _levels(srv):
    """Where a cancelled request must show: serve; or the router (its
    requests) and the decode instance (its scheduler)."""
    return [srv.api, srv.inst] if srv.routed else [srv.api]


def test_disconnect_mid_stream_cancels(srv):
    levels = _levels(srv)
    aborted = [_counter(s, "abort") for s in levels]
    st = srv.open_stream("/v1/completions", {"prompt": "long", "stream": True, **LONG},
                         headers=auth())
    try:
        assert st.status == 200
        it = st.events()
        got = [next(it) for _ in range(3)]
        assert all(isinstance(e, dict) and "error" not in e for e in got), got
        # The gauges are published after each scheduler step, so the first
        # tokens (all from one step) can arrive before the step's figures.
        # Every choice running at every level: a choice the router cancels
        # before the decode instance has it is no abort there.
        wait_until(lambda: all(_running(s) == LONG["n"] for s in levels), timeout=10,
                   what="every choice to run")
    finally:
        st.abort()
    wait_until(lambda: all(_running(s) == 0 for s in levels), timeout=2,
               what="running gauge back to 0")
    # Cancelled, not finished: every choice counted as aborted.
    wait_until(lambda: [_counter(s, "abort") for s in levels] == [a + LONG["n"] for a in aborted],
               timeout=2, what="abort counter")


def test_disconnect_mid_non_stream_cancels(srv):
    levels = _levels(srv)
    aborted = [_counter(s, "abort") for s in levels]
    body = json.dumps({"prompt": "long", **LONG}).encode()
    s = socket.create_connection((srv.host, srv.port), timeout=scaled(10))
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                  + body)
        # every choice running at every level (see above)
        wait_until(lambda: all(_running(x) == LONG["n"] for x in levels), timeout=10,
                   what="every choice to run")
    finally:
        s.close()
    wait_until(lambda: all(_running(x) == 0 for x in levels), timeout=2,
               what="running gauge back to 0")
    wait_until(lambda: [_counter(x, "abort") for x in levels] == [a + LONG["n"] for a in aborted],
               timeout=2, what="abort counter")


def test_pings_while_queued_and_429(srv):
    """A stream that waits behind MAX_RUNNING long requests gets `: ping`
    comments until it runs; a request that would queue more than
    MAX_WAITING is refused with 429 and Retry-After; then the blockers are
    dropped. Behind a router the queue is the decode instance's, and its
    429 (no other instance to retry on) reaches the client as a 429."""
    blocker = srv.open_stream("/v1/completions", {"prompt": "block", "stream": True, **LONG},
                              headers=auth())
    waiter = None
    try:
        it = blocker.events()
        next(it)
        wait_until(lambda: _running(srv.inst) == MAX_RUNNING, timeout=10,
                   what="all slots busy")
        waiter = srv.open_stream("/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "wait"}],
                                  "stream": True, "max_tokens": 2}, headers=auth())
        assert waiter.status == 200
        # Read raw lines: the role chunk first, then pings while queued.
        lines = []
        deadline = time.monotonic() + scaled(10)
        while waiter.comments < 2 and time.monotonic() < deadline:
            ln = waiter.resp.readline().decode()
            lines.append(ln)
            if ln.startswith(":"):
                assert ln.strip() == ": ping"
                waiter.comments += 1
        assert waiter.comments >= 2, lines
        # Waiting in the scheduler (behind a router: the decode instance's).
        assert metric(srv.inst.metrics(), "vllm:num_requests_waiting") >= 1
        # 1 waiting + 8 more choices > MAX_WAITING: refused as a whole.
        status, headers, body = post(srv, "/v1/completions",
                                     {"prompt": "more", "n": 8, "max_tokens": 4})
        e = assert_error(status, body, 429)
        assert e["type"] == "rate_limit_error"
        assert int(headers["retry-after"]) >= 1
    finally:
        blocker.abort()
        if waiter is not None:
            waiter.abort()
    wait_until(lambda: all(_running(s) == 0 for s in _levels(srv)), timeout=5,
               what="running gauge back to 0")


@pytest.mark.parametrize("kind", ["serve", "router"])
def test_error_event_after_headers(kind, tandem_bin, model_path, tmp_path):
    """A stream the server has to abort (SIGTERM, drain timeout passed) ends
    with an error event and [DONE], not with a truncated success. Behind a
    router, the router is the one stopped."""
    if kind == "serve":
        s = Front.serve(Server.start(tandem_bin, model_path, ["--ctx", CTX, "--drain-timeout",
                                                              "0.3", "--threads", 1], tmp_path))
    else:
        s = Front.router(Cluster(tandem_bin, tmp_path, model_path, n_prefill=1, n_decode=1,
                                 p_args=["--ctx", CTX], d_args=["--ctx", CTX],
                                 r_args=["--max-ctx", CTX, "--drain-timeout", "0.3"]))
    try:
        st = s.open_stream("/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "go"}], "stream": True,
                            **LONG})
        assert st.status == 200
        it = st.events()
        first = [next(it) for _ in range(LONG["n"] + 2)]  # role chunks + tokens
        assert all(isinstance(e, dict) and "choices" in e for e in first)
        s.proc.send_signal(15)
        rest = list(it)
        st.close()
        assert rest and rest[-1] == "[DONE]", rest[-3:]
        errors = [e for e in rest if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1, rest[-3:]
        assert errors[0]["error"]["type"] == "service_unavailable"
        assert rest[-2] is errors[0]
        # Nothing claims a normal end.
        assert not any(c.get("finish_reason") for e in first + rest if isinstance(e, dict)
                       for c in e.get("choices", []))
        assert s.proc.wait(timeout=scaled(30)) == 0, s.log_tail()
        # The instances behind the router let go of the cancelled requests.
        for x in s.insts:
            if x is not s.api:
                x.wait_idle()
    finally:
        s.close()


def test_concurrent_clients(client):
    """A few clients at once each get the greedy answer they get alone."""
    prompts = [f"Concurrent {i}" for i in range(6)]
    alone = {p: client.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0)
             .choices[0].text for p in prompts}
    results, errors = {}, []

    def run(p):
        try:
            results[p] = client.completions.create(model=NAME, prompt=p, max_tokens=8,
                                                   temperature=0).choices[0].text
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled(60))
    assert not errors, errors
    assert results == alone


def test_zz_idle_after_everything(srv):
    """Runs last: every scenario above left no KV block used or reserved."""
    srv.wait_idle(timeout=10)
    st = srv.state()
    ld = state_load(st)
    assert ld["kv_used"] == 0 and ld["kv_reserved"] == 0
    assert ld["running"] == 0 and ld["waiting"] == 0
    for x in [srv.api] + srv.insts:
        assert x.proc.poll() is None, x.log_tail()
