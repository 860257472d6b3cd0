"""Structured outputs through `tandem serve` (common/api/request.c reads the
constraint, common/grammar compiles it, common/sched masks every step):
the official `openai` client's response_format (json_object and
json_schema, stream and not), vLLM's structured_outputs and guided_*
spellings and llama.cpp's json_schema and grammar, over HTTP. The outputs
are checked by the `jsonschema` package with a FormatChecker, by Python's
`re` and by membership, never by Tandem itself. Bad constraints are 400s
decided before any header (a streaming request gets a real 400), and the
server serves on."""
import json
import pathlib
import re

import pytest

from serve_util import serve  # noqa: F401  (the fixture)

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = pathlib.Path(__file__).resolve().parents[1] / "grammar" / "schemas"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "email": {"type": "string", "format": "email"}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Give me an example as JSON."}]


def validator(schema):
    cls = jsonschema.Draft202012Validator
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def client_of(srv):
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    return c, c.models.list().data[0].id


def test_response_format_json_schema_and_json_object(serve, default_model):
    srv = serve(default_model)
    c, model = client_of(srv)
    v = validator(PERSON)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(4):
        r = c.chat.completions.create(model=model, messages=ASK, response_format=fmt,
                                      max_tokens=120, seed=seed, temperature=1.0)
        ch = r.choices[0]
        if ch.finish_reason == "stop":
            v.validate(json.loads(ch.message.content))
        else:
            assert ch.finish_reason == "length"
    # streamed: the same tokens (same seed), in pieces
    r = c.chat.completions.create(model=model, messages=ASK, response_format=fmt, max_tokens=120,
                                  seed=7, temperature=1.0)
    s = c.chat.completions.create(model=model, messages=ASK, response_format=fmt, max_tokens=120,
                                  seed=7, temperature=1.0, stream=True)
    text, finish = "", None
    for ev in s:
        if ev.choices:
            text += ev.choices[0].delta.content or ""
            finish = ev.choices[0].finish_reason or finish
    assert text == r.choices[0].message.content and finish == r.choices[0].finish_reason
    # strict false is enforced too (as vLLM does)
    fmt["json_schema"]["strict"] = False
    r = c.chat.completions.create(model=model, messages=ASK, response_format=fmt, max_tokens=120,
                                  seed=3, temperature=1.0)
    if r.choices[0].finish_reason == "stop":
        v.validate(json.loads(r.choices[0].message.content))
    # json_object: a JSON object
    done = 0
    for seed in range(4):
        r = c.chat.completions.create(model=model, messages=ASK,
                                      response_format={"type": "json_object"}, max_tokens=120,
                                      seed=seed, temperature=0.7)
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
            done += 1
    # text: no constraint
    r = c.chat.completions.create(model=model, messages=ASK, response_format={"type": "text"},
                                  max_tokens=8, temperature=0)
    assert r.choices[0].message.content


def test_vllm_and_llama_cpp_spellings(serve, default_model):
    srv = serve(default_model)
    c, model = client_of(srv)

    def chat(extra, **kw):
        return c.chat.completions.create(model=model, messages=ASK, max_tokens=40, seed=1,
                                         extra_body=extra, **kw).choices[0]

    colors = ["red", "green", "light blue"]
    for extra in ({"structured_outputs": {"choice": colors}}, {"guided_choice": colors}):
        ch = chat(extra)
        assert ch.message.content in colors and ch.finish_reason == "stop"
    pat = r"[0-9]{3}-[a-z]{2,4}"
    for extra in ({"structured_outputs": {"regex": pat}}, {"guided_regex": pat}):
        ch = chat(extra)
        assert re.fullmatch(pat, ch.message.content), ch.message.content
    lark = 'start: "answer: " WORD ("," WORD){0,2}\nWORD: /[a-z]+/'
    for extra in ({"structured_outputs": {"grammar": lark}}, {"guided_grammar": lark},
                  {"grammar": lark}):
        ch = chat(extra, temperature=0.8)
        if ch.finish_reason == "stop":
            assert re.fullmatch(r"answer: [a-z]+(,[a-z]+){0,2}", ch.message.content), ch
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}
    for extra in ({"structured_outputs": {"json": small}}, {"guided_json": small},
                  {"guided_json": json.dumps(small)}, {"json_schema": small},
                  {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}}):
        ch = chat(extra)
        if "json_object" in json.dumps(extra):  # any object: it may run past 40 tokens
            assert ch.finish_reason == "length" or isinstance(json.loads(ch.message.content), dict)
            continue
        assert ch.finish_reason == "stop", (extra, ch)
        validator(small).validate(json.loads(ch.message.content))
    # the completions endpoint too
    r = c.completions.create(model=model, prompt="The colour is", max_tokens=10,
                             extra_body={"guided_choice": colors})
    assert r.choices[0].text in colors


def test_n_choices_min_tokens_and_logprobs(serve, default_model):
    srv = serve(default_model)
    c, model = client_of(srv)
    colors = ["red", "green", "light blue"]
    r = c.chat.completions.create(model=model, messages=ASK, max_tokens=20, n=3, seed=5,
                                  temperature=1.0, extra_body={"guided_choice": colors})
    assert len(r.choices) == 3 and all(ch.message.content in colors for ch in r.choices)
    # the grammar's end ends the output, whatever min_tokens and ignore_eos ask
    r = c.chat.completions.create(model=model, messages=ASK, max_tokens=30, temperature=0,
                                  extra_body={"guided_choice": ["yes"], "min_tokens": 20,
                                              "ignore_eos": True})
    assert r.choices[0].message.content == "yes" and r.choices[0].finish_reason == "stop"
    # logprobs: the masked distribution (a token outside the grammar is never listed)
    r = c.chat.completions.create(model=model, messages=ASK, max_tokens=4, temperature=0,
                                  logprobs=True, top_logprobs=5,
                                  extra_body={"guided_regex": "[0-9]+"})
    for t in r.choices[0].logprobs.content:
        for alt in t.top_logprobs:
            assert alt.logprob == float("-inf") or re.fullmatch(r"[0-9]*", alt.token), alt
    # the budget ending first: finish_reason length, the text a prefix
    r = c.chat.completions.create(model=model, messages=ASK, max_tokens=3, temperature=0,
                                  response_format={"type": "json_schema", "json_schema": {
                                      "name": "p", "schema": PERSON}})
    assert r.choices[0].finish_reason == "length"
    assert '{"name":"'.startswith(r.choices[0].message.content[:8])  # a prefix of the form


@pytest.mark.parametrize("body,where", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strnig"}}}},
     "at /type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}},
     "'not' is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"response_format": {"type": "xml"}}, "json_schema"),
    ({"response_format": "json"}, "must be an object"),
    ({"structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 1}}},
     "unsatisfiable"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "lookaround"),
    ({"structured_outputs": {"choice": []}}, "non-empty"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "undefined rule"),
    ({"structured_outputs": {"whitespace_pattern": " *"}}, "not supported"),
    ({"guided_json": "{not json"}, "not JSON"),
    ({"guided_regex": 5}, "must be a string"),
    ({"guided_choice": ["a", 1]}, "array of strings"),
    ({"guided_grammar": 'root ::= "a"'}, "GBNF"),
    ({"grammar": "start: /a/x"}, "flag"),
    ({"json_schema": {"$ref": "#/$defs/missing"}}, "$ref"),
    ({"guided_whitespace_pattern": "[ ]*", "guided_json": {}}, "not supported"),
    ({"guided_json": {"type": "string"}, "guided_regex": "a"}, "both constrain"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "both constrain"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "both constrain"),
    ({"guided_json": {"enum": [f"v{i}" for i in range(60000)]}}, "too large"),
])
def test_refused_constraints_are_400s(serve, default_model, body, where):
    srv = serve(default_model)
    for stream in (False, True):
        req = {"messages": ASK, "max_tokens": 5, "stream": stream, **body}
        status, out = srv.post_json("/v1/chat/completions", req)
        assert status == 400, (body, out)
        assert where in out["error"]["message"], out
    status, out = srv.post_json("/v1/chat/completions",
                                {"messages": ASK, "max_tokens": 2, "temperature": 0})
    assert status == 200, out  # and the server serves on


def test_not_yet_through_prefill_decode_or_the_router(tandem_bin, default_model, tmp_path):
    """Until the constraint travels to the prefill instance (issue 41's
    next part), a decode instance and the router refuse it with a 400 that
    says so, rather than answering unconstrained."""
    from serve_util import Cluster, Pair
    pr = Pair(tandem_bin, tmp_path / "pair", default_model)
    try:
        status, out = pr.d.post_json("/v1/chat/completions",
                                     {"messages": ASK, "max_tokens": 4, "guided_choice": ["a"]})
        assert status == 400 and "tandem serve" in out["error"]["message"], out
        status, out = pr.d.post_json("/v1/chat/completions", {"messages": ASK, "max_tokens": 2})
        assert status == 200, out
    finally:
        pr.close()
    c = Cluster(tandem_bin, tmp_path / "cluster", default_model, n_prefill=1, n_decode=1)
    try:
        status, out = c.router.post_json("/v1/chat/completions",
                                         {"messages": ASK, "max_tokens": 4,
                                          "response_format": {"type": "json_object"}})
        assert status == 400 and "tandem serve" in out["error"]["message"], out
    finally:
        c.close()
