"""Chat templates on `tandem serve` (common/template through
common/tokenizer/chat.c): the model's own template and --chat-template FILE
render what transformers renders, through /tokenize with messages and the
official openai client; a template that raises is a 400 with its message
and the server keeps serving; a --chat-template that does not load stops
the server at start with the reason; tools, tool calls (arguments sent as
a JSON string), reasoning_content, chat_template_kwargs and
continue_final_message reach real templates as transformers passes them."""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from conftest import scaled
from serve_util import Cluster, serve  # noqa: F401  (serve: the fixture)

openai = pytest.importorskip("openai")
chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")

CUSTOM = ("{% for m in messages %}[{{ m.role | upper }}] {{ m.content | trim }}\n{% endfor %}"
          "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
RAISING = ("{% if messages | length > 1 %}{{ raise_exception('one message only, please') }}"
           "{% endif %}<|im_start|>user\n{{ messages[0].content }}<|im_end|>\n<|im_start|>assistant\n")
MESSAGES = [{"role": "system", "content": "  Be brief. "},
            {"role": "user", "content": "What is the capital of France?"}]


def reference(text, messages, add_generation_prompt=True):
    rendered, _ = chat_template_utils.render_jinja_template(
        conversations=[messages], chat_template=text, add_generation_prompt=add_generation_prompt,
        bos_token="", eos_token="")
    return rendered[0]


def tokens_of(srv, body):
    status, out = srv.post_json("/tokenize", body)
    assert status == 200, out
    return out["tokens"]


def test_a_template_file_renders_as_transformers_does(serve, default_model, tmp_path):
    f = tmp_path / "custom.jinja"
    f.write_text(CUSTOM)
    srv = serve(default_model, "--chat-template", str(f))
    for agp in (True, False):
        want = tokens_of(srv, {"prompt": reference(CUSTOM, MESSAGES, agp), "add_special_tokens": False})
        got = tokens_of(srv, {"messages": MESSAGES, "add_generation_prompt": agp})
        assert got == want
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x")
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES,
                                       max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == len(tokens_of(srv, {"messages": MESSAGES}))


def test_the_models_own_template_is_rendered(serve, default_model):
    """SmolLM2's own template (its default system prompt when none is given),
    against transformers over the template text the GGUF carries."""
    gguf = pytest.importorskip("gguf")
    r = gguf.GGUFReader(str(default_model))
    field = r.fields["tokenizer.chat_template"]
    text = bytes(field.parts[field.data[0]]).decode()
    srv = serve(default_model)
    msgs = [{"role": "user", "content": "Hi"}]
    want = tokens_of(srv, {"prompt": reference(text, msgs), "add_special_tokens": False})
    assert tokens_of(srv, {"messages": msgs}) == want
    assert len(want) > 10  # the default system prompt is there


def test_a_raising_template_is_a_400_and_the_server_serves_on(serve, default_model, tmp_path):
    f = tmp_path / "raising.jinja"
    f.write_text(RAISING)
    srv = serve(default_model, "--chat-template", str(f))
    status, out = srv.post_json("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert status == 400, out
    assert "one message only, please" in out["error"]["message"]
    assert out["error"]["param"] == "messages"
    status, out = srv.post_json("/v1/chat/completions",
                                {"messages": MESSAGES[1:], "max_tokens": 2, "temperature": 0})
    assert status == 200, out
    srv.wait_idle()


@pytest.mark.parametrize("content,needle", [
    ("{% for m in messages %}{{ m.content }}", "line 1"),
    (None, "neither a name"),
])
def test_a_chat_template_that_does_not_load_stops_the_server(tandem, default_model, tmp_path,
                                                            content, needle):
    f = tmp_path / "t.jinja"
    if content is not None:
        f.write_text(content)
    r = tandem("serve", "--model", str(default_model), "--port", "0", "--grpc-port", "-1",
               "--chat-template", str(f), timeout=60, check=False)
    assert r.returncode != 0
    assert needle in r.stderr, r.stderr


TEMPLATE_DIR = pathlib.Path(os.environ.get(
    "TANDEM_TEMPLATE_DIR", pathlib.Path.home() / ".cache/tandem/templates/llama.cpp-11434.0.0"))
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
# as an OpenAI client sends them: arguments as a JSON string
TOOL_CHAT = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris \\u00e9\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]


def normalised(messages):
    """What the server hands the template: text parts joined by a newline,
    arguments parsed, a missing assistant content empty (vLLM's rules)."""
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"])
        if m.get("content") is None:
            m["content"] = ""
        if "tool_calls" in m:
            m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=json.loads(c["function"]["arguments"])))
                               for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.mark.parametrize("name,kwargs", [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", {}),
    ("Qwen-Qwen3-0.6B.jinja", {"enable_thinking": False}),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", {}),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", {}),
])
def test_tools_tool_calls_and_kwargs_reach_the_template(serve, default_model, name, kwargs):
    path = TEMPLATE_DIR / name
    assert path.exists(), f"{path}: scripts/fetch-test-models.sh fetches the templates"
    text = path.read_text()
    srv = serve(default_model, "--chat-template", str(path))
    rendered, _ = chat_template_utils.render_jinja_template(
        conversations=[normalised(TOOL_CHAT)], tools=TOOLS, chat_template=text,
        add_generation_prompt=True, bos_token="<|im_start|>", eos_token="<|im_end|>", **kwargs)
    want = tokens_of(srv, {"prompt": rendered[0], "add_special_tokens": False})
    body = {"messages": TOOL_CHAT, "tools": TOOLS}
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    assert tokens_of(srv, body) == want
    # a kwarg may not replace a variable the server passes
    status, out = srv.post_json("/tokenize", dict(body, chat_template_kwargs={"tools": []}))
    assert status == 400 and out["error"]["param"] == "chat_template_kwargs", out


def test_continue_final_message_as_transformers(serve, default_model):
    path = TEMPLATE_DIR / "Qwen-Qwen2.5-7B-Instruct.jinja"
    text = path.read_text()
    srv = serve(default_model, "--chat-template", str(path))
    msgs = [{"role": "user", "content": "Count to three."},
            {"role": "assistant", "content": "One, two,"}]
    rendered, _ = chat_template_utils.render_jinja_template(
        conversations=[msgs], chat_template=text, continue_final_message=True,
        bos_token="<|im_start|>", eos_token="<|im_end|>")
    want = tokens_of(srv, {"prompt": rendered[0], "add_special_tokens": False})
    assert tokens_of(srv, {"messages": msgs, "continue_final_message": True,
                           "add_generation_prompt": False}) == want
    status, out = srv.post_json("/v1/chat/completions", {
        "messages": msgs, "continue_final_message": True, "max_tokens": 2, "temperature": 0})
    assert status == 200, out


DEFAULT_T = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
             "{% if add_generation_prompt %}<assistant>{% endif %}")
TOOL_T = ("TOOLS {{ tools | map(attribute='function') | map(attribute='name') | join(',') }} "
          + DEFAULT_T)
JINJA_FILE_T = "FROM chat_template.jinja " + DEFAULT_T


def check_named(srv):
    msgs = [{"role": "user", "content": "hi"}]
    status, out = srv.post_json("/apply-template", {"messages": msgs})
    assert status == 200, out
    return out["prompt"], srv.post_json("/apply-template", {"messages": msgs, "tools": TOOLS})


def test_named_templates_of_a_gguf_and_the_tool_use_choice(serve, test_models, tmp_path):
    """tokenizer.chat_template.tool_use, written by gguf-py's own metadata
    tool from a tokenizer_config.json list, serves requests with tools (as
    transformers picks it); the default serves the others."""
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": [{"name": "default", "template": DEFAULT_T},
                                                 {"name": "tool_use", "template": TOOL_T}]}))
    out = tmp_path / "named.gguf"
    p = subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata",
                        str(test_models / "gguf/smollm2-f32.gguf"), str(out),
                        "--chat-template-config", str(cfg), "--force"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    srv = serve(out)
    plain, (status, with_tools) = check_named(srv)
    assert plain == reference(DEFAULT_T, [{"role": "user", "content": "hi"}])
    assert status == 200, with_tools
    assert with_tools["prompt"] == chat_template_utils.render_jinja_template(
        conversations=[[{"role": "user", "content": "hi"}]], tools=TOOLS, chat_template=TOOL_T,
        add_generation_prompt=True)[0][0]
    assert with_tools["prompt"].startswith("TOOLS get_weather ")


def test_chat_template_jinja_and_list_form_of_an_hf_directory(serve, test_models, tmp_path):
    """An HF directory: chat_template.jinja is the default template (it wins
    over tokenizer_config.json's, as in transformers); the list form's
    tool_use still serves requests with tools."""
    d = tmp_path / "smollm2"
    shutil.copytree(test_models / "hf/smollm2-f32", d)
    cfgp = d / "tokenizer_config.json"
    cfg = json.loads(cfgp.read_text())
    cfg["chat_template"] = [{"name": "default", "template": DEFAULT_T},
                            {"name": "tool_use", "template": TOOL_T}]
    cfgp.write_text(json.dumps(cfg))
    (d / "chat_template.jinja").write_text(JINJA_FILE_T)
    srv = serve(d)
    plain, (status, with_tools) = check_named(srv)
    assert plain == reference(JINJA_FILE_T, [{"role": "user", "content": "hi"}])
    assert status == 200 and with_tools["prompt"].startswith("TOOLS get_weather "), with_tools


def test_a_request_chat_template_needs_the_trust_flag(serve, default_model):
    own = "{% for m in messages %}OWN {{ m.content }}{% endfor %}"
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": own}
    srv = serve(default_model)
    status, out = srv.post_json("/apply-template", body)
    assert status == 400 and out["error"]["param"] == "chat_template", out
    assert "--trust-request-chat-template" in out["error"]["message"]
    status, out = srv.post_json("/v1/chat/completions", dict(body, max_tokens=2))
    assert status == 400 and out["error"]["param"] == "chat_template", out
    trusting = serve(default_model, "--trust-request-chat-template")
    status, out = trusting.post_json("/apply-template", body)
    assert status == 200 and out["prompt"] == "OWN hi", out
    status, out = trusting.post_json("/v1/chat/completions", dict(body, max_tokens=2))
    assert status == 200, out
    # one that does not compile is a 400 naming the line
    status, out = trusting.post_json("/apply-template", dict(body, chat_template="{% if x %}"))
    assert status == 400 and "line 1" in out["error"]["message"], out


def test_several_served_model_names(serve, default_model):
    """vLLM's --served-model-name with several names: the first is the id
    /v1/models lists and responses carry; every one is accepted."""
    srv = serve(default_model, "--served-model-name", "first", "--served-model-name", "second")
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x")
    assert [m.id for m in client.models.list().data] == ["first"]
    for name in ("first", "second"):
        r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=1, temperature=0)
        assert r.model == "first"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="Hi", max_tokens=1)


@pytest.mark.parametrize("template,needle", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "iterations"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nested deeper"),
    ("{{ 'x' * 100000000 }}", "output limit"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}{{ ns.s }}", "limit"),
])
def test_hostile_request_templates_are_400s_within_the_bound(serve, default_model, template, needle):
    """A request's template that loops, recurses or builds a 100 MB string
    stops at a limit: a 400 naming it, quickly; the server serves on and
    holds no KV afterwards."""
    srv = serve(default_model, "--trust-request-chat-template")
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": template,
            "max_tokens": 2}
    t0 = time.monotonic()
    status, out = srv.post_json("/v1/chat/completions", body, timeout=scaled(60))
    assert status == 400 and needle in out["error"]["message"], out
    assert time.monotonic() - t0 < scaled(20)
    status, out = srv.post_json("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0})
    assert status == 200, out
    srv.wait_idle()


def test_a_context_nested_too_deep_is_a_400(serve, default_model):
    srv = serve(default_model)
    deep = {}
    for _ in range(100):
        deep = {"d": deep}
    status, out = srv.post_json("/apply-template", {
        "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": deep}})
    assert status == 400 and "deeper" in out["error"]["message"], out


def test_template_flags_on_a_router_over_1p_1d(tandem_bin, default_model, tmp_path):
    """--chat-template FILE, --trust-request-chat-template and several
    --served-model-name on tandem-router over one tandem-prefill and one
    tandem-decode: the router renders and tokenizes, the official client
    sees the names, and the rendered prompt is the one /tokenize counts."""
    f = tmp_path / "custom.jinja"
    f.write_text(CUSTOM)
    c = Cluster(tandem_bin, tmp_path / "cluster", default_model, n_prefill=1, n_decode=1,
                r_args=["--chat-template", str(f), "--trust-request-chat-template",
                        "--served-model-name", "a", "--served-model-name", "b"])
    try:
        r = c.router
        want = tokens_of(r, {"prompt": reference(CUSTOM, MESSAGES), "add_special_tokens": False})
        assert tokens_of(r, {"messages": MESSAGES}) == want
        client = openai.OpenAI(base_url=r.base_url + "/v1", api_key="x")
        assert [m.id for m in client.models.list().data] == ["a"]
        out = client.chat.completions.create(model="b", messages=MESSAGES, max_tokens=4,
                                             temperature=0)
        assert out.model == "a" and out.usage.prompt_tokens == len(want)
        status, o = r.post_json("/apply-template", {"messages": MESSAGES[1:],
                                                    "chat_template": "{{ messages[0].content }}"})
        assert status == 200 and o["prompt"] == MESSAGES[1]["content"], o
    finally:
        c.close()


def test_a_model_without_a_template(serve, tandem, test_models, tmp_path):
    """No tokenizer.chat_template: chat is a 400 saying to start with
    --chat-template (as vLLM); completions still work; --chat-template
    FILE makes chat work, on serve and on `tandem generate`."""
    bare = tmp_path / "bare.gguf"
    p = subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata",
                        str(test_models / "gguf/smollm2-f32.gguf"), str(bare),
                        "--remove-metadata", "tokenizer.chat_template", "--force"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    srv = serve(bare)
    status, out = srv.post_json("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert status == 400 and "--chat-template" in out["error"]["message"], out
    status, out = srv.post_json("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200, out
    f = tmp_path / "custom.jinja"
    f.write_text(CUSTOM)
    srv2 = serve(bare, "--chat-template", str(f))
    status, out = srv2.post_json("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert status == 200, out
    r = tandem("generate", "--model", str(bare), "--chat", "Hi", "--max-tokens", "2",
               timeout=60, check=False)
    assert r.returncode != 0 and "--chat-template" in r.stderr, r.stderr
    r = tandem("generate", "--model", str(bare), "--chat", "Hi", "--max-tokens", "2",
               "--chat-template", str(f), timeout=60)
    assert r.returncode == 0
