"""`tandem serve` with the default model (SmolLM2-135M-Instruct Q4_1) through
the official `openai` client: the happy paths of test_serve_http.py on a
real model. The reference for greedy text is `tandem generate` (the engine
in-process, no scheduler, no HTTP); the facts about the model (its name,
the 37-token ChatML prompt with SmolLM2's default system prompt) come from
the GGUF file and from test_generate_model.py.
"""

import json

import openai
import pytest

from conftest import run_tandem, scaled
from serve_util import Server

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def gguf_name(default_model):
    gguf = pytest.importorskip("gguf")
    f = gguf.GGUFReader(str(default_model)).fields["general.name"]
    return bytes(f.parts[f.data[0]]).decode()


@pytest.fixture(scope="module")
def srv(tandem_bin, default_model, tmp_path_factory):
    s = Server.start(tandem_bin, default_model, ["--threads", 2, "--max-running", 4],
                     tmp_path_factory.mktemp("serve-http-model"), ready_timeout=120)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(srv):
    # No --api-key: any key (the client needs one) is accepted.
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=scaled(300))


def generate_ref(tandem_bin, default_model, *args):
    r = run_tandem("generate", "--model", default_model, "--temperature", "0", "--threads", "2",
                   *args, binary=tandem_bin, timeout=300)
    assert r.stdout.endswith("\n"), r.describe()
    return r.stdout[:-1]


def test_models_lists_the_file_stem_and_accepts_the_gguf_name(client, default_model, gguf_name):
    ids = [m.id for m in client.models.list().data]
    # --served-model-name defaults to the file's name without .gguf; the
    # model's own name (general.name), the id before, is still accepted.
    assert ids == [default_model.name.removesuffix(".gguf")] == ["SmolLM2-135M-Instruct.Q4_1"]
    for name in (ids[0], gguf_name):
        r = client.completions.create(model=name, prompt="Hi", max_tokens=1, temperature=0)
        assert r.model == ids[0]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=1)


def test_chat_capital_of_france(client, tandem_bin, default_model):
    want = generate_ref(tandem_bin, default_model, "--chat", QUESTION, "--max-tokens", "48")
    r = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=48,
                                       temperature=0,
                                       messages=[{"role": "user", "content": QUESTION}])
    c = r.choices[0]
    assert "Paris" in c.message.content, c.message.content
    assert c.message.content == want
    assert r.usage.prompt_tokens == 37  # ChatML + SmolLM2's default system prompt
    assert 1 <= r.usage.completion_tokens <= 48
    assert c.finish_reason in ("stop", "length")
    # The stream says the same, chunk by chunk, and ends with the usage.
    s = client.chat.completions.create(model=r.model, max_tokens=48, temperature=0,
                                       messages=[{"role": "user", "content": QUESTION}],
                                       stream=True, stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for ch in s:
        if ch.usage is not None:
            usage = ch.usage
        for cc in ch.choices:
            text += cc.delta.content or ""
            finish = cc.finish_reason or finish
    assert text == c.message.content
    assert finish == c.finish_reason
    assert usage.completion_tokens == r.usage.completion_tokens


def test_completion_matches_generate(client, tandem_bin, default_model):
    prompt = "The capital of France is"
    want = generate_ref(tandem_bin, default_model, "--prompt", prompt, "--max-tokens", "8")
    r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                  max_tokens=8, temperature=0)
    assert r.choices[0].text == want


def test_chat_logprobs_and_stop(client):
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=48,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        # Greedy: the sampled token is the most likely one.
        assert e.token == e.top_logprobs[0].token
        assert abs(e.logprob - e.top_logprobs[0].logprob) < 1e-6
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    text = r.choices[0].message.content
    # Stop at the first "Paris" (the greedy answer names it: see above).
    assert "Paris" in text, text
    cut = client.chat.completions.create(model=model, messages=msgs, max_tokens=48,
                                         temperature=0, stop=["Paris"])
    assert cut.choices[0].message.content == text[:text.index("Paris")]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra.get("stop_reason") == "Paris"


def test_seeded_sampling_reproducible(client):
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=[{"role": "user", "content": "Write a short poem."}],
              max_tokens=24, temperature=1.0, top_p=0.95)
    a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    assert a == b


def test_tokenize_count(srv):
    status, _, data = srv.request("POST", "/tokenize",
                                  json.dumps({"messages": [{"role": "user",
                                                            "content": QUESTION}]}).encode(),
                                  {"Content-Type": "application/json"})
    assert status == 200
    body = json.loads(data)
    assert body["count"] == 37 == len(body["tokens"])


def test_zz_idle(srv):
    srv.wait_idle(timeout=10)
