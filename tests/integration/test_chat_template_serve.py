"""Chat templates on `tandem serve` (common/template through
common/tokenizer/chat.c): the model's own template and --chat-template FILE
render what transformers renders, through /tokenize with messages and the
official openai client; a template that raises is a 400 with its message
and the server keeps serving; a --chat-template that does not load stops
the server at start with the reason."""
import pytest

from serve_util import serve  # noqa: F401  (the fixture)

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
    import gguf
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
