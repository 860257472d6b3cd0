"""Structured outputs at volume on `tandem serve` (label heavy: the release
step runs it, the sanitizer step leaves it out): 200 seeded temperature-1
requests, 16 at a time, over the 16 JSON Schemas of tests/grammar/schemas,
through the official `openai` client with response_format json_schema.
Every output that finishes validates with the `jsonschema` package and a
FormatChecker; those max_tokens ends are counted apart (and must be a
minority). The same seed gives the same text again."""
import concurrent.futures
import json

import pytest

from serve_util import serve  # noqa: F401  (the fixture)
from test_structured_outputs import SCHEMAS, client_of, validator

openai = pytest.importorskip("openai")


def test_seeded_requests_validate(serve, default_model):
    """200 seeded temperature-1 requests over the 16 schemas of
    tests/grammar/schemas, 16 at a time: every one that finishes validates
    (jsonschema with a FormatChecker); those the budget ends are counted
    apart. The same seed gives the same text again."""
    srv = serve(default_model)
    c, model = client_of(srv)
    schemas = [(p.name, json.loads(p.read_text())) for p in sorted(SCHEMAS.glob("*.json"))]
    assert len(schemas) == 16

    def one(i):
        name, schema = schemas[i % len(schemas)]
        r = c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"An example for {name}, as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
            max_tokens=160, seed=i, temperature=1.0)
        return name, schema, r.choices[0]

    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, range(200)))
    stopped = 0
    for name, schema, ch in results:
        if ch.finish_reason == "length":
            continue
        assert ch.finish_reason == "stop", (name, ch)
        validator(schema).validate(json.loads(ch.message.content))
        stopped += 1
    print(f"{stopped} of 200 finished and validate; {200 - stopped} ended by max_tokens")
    assert stopped >= 100, stopped
    again = one(17)[2].message.content
    assert again == results[17][2].message.content
