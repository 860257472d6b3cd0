"""The JSON Schema compiler (common/grammar/json_schema.c) on what a
client may send: semantics case by case (each expected answer checked with
the PyPI `jsonschema` package, so no case can pass with a wrong verdict),
refusals that name the keyword's JSON Pointer, and hostile schemas that
must end with a clear error within their bounds. Run through
td-grammar-match, one process per test; under the sanitizer build a leak on
any path fails the process's exit code."""

import json
import time

import jsonschema
import pytest

from grammar_util import GrammarMatch


@pytest.fixture
def gm(build_dir):
    g = GrammarMatch(build_dir)
    yield g
    g.close()


def compile_ok(gm, schema):
    r = gm.schema(schema if isinstance(schema, str) else json.dumps(schema))
    assert r.startswith("ok "), r
    return r


def refused(gm, schema):
    r = gm.schema(schema if isinstance(schema, str) else json.dumps(schema))
    assert r.startswith("err "), r
    return r[4:]


# (schema, documents): each document's verdict is jsonschema's, with a
# FormatChecker; the compact writing is the document's own
CASES = [
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
      "required": ["a"]},
     ['{"a":1}', '{"a":1,"b":"x"}', '{"b":"x"}', '{"a":1,"zz":[1]}', '{}', '{"a":1.5}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
     ['{"a":1}', '{}', '{"a":1,"b":2}', '{"b":2}']),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "boolean"}},
     ['{"a":null,"b":true}', '{"b":1}', '{"a":1,"c":false,"d":true}']),
    ({"type": "integer", "minimum": -5, "maximum": 12},
     ["-5", "-6", "12", "13", "0", "7", "-0", "~12.0"]),
    ({"type": "integer", "minimum": 0, "maximum": 12}, ["0", "~-0"]),
    ({"type": "integer", "maximum": 12}, ["-3", "~-0"]),
    ({"type": "number", "exclusiveMinimum": 1.5, "maximum": 3},
     ["1.5", "1.50001", "3", "3.0", "3.01", "2", "1.6", "1.49"]),
    ({"type": "number", "minimum": -1e-3, "exclusiveMaximum": 1e3},
     ["-0.001", "-0.0011", "999.999", "1000", "0", "-0.0005", "~1e2"]),
    ({"type": "integer", "multipleOf": 7}, ["0", "14", "-21", "15", "700"]),
    ({"type": "number", "multipleOf": 0.25, "maximum": 2}, ["0.25", "1.5", "1.75", "1.3", "2", "2.25"]),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ['"a"', '"ab"', '"abc"', '"abcd"', '"é1"']),
    ({"type": "string", "pattern": "^[a-z]+$"}, ['"abc"', '"aB"', '""']),
    ({"type": "string", "pattern": "b+"}, ['"abbc"', '"ac"']),
    ({"type": "string", "format": "date"},
     ['"2024-02-29"', '"2023-02-29"', '"2000-02-29"', '"1900-02-29"', '"2023-13-01"']),
    ({"type": "string", "format": "date-time"},
     ['"2024-01-02T03:04:05Z"', '"2024-01-02T03:04:05.5+01:00"', '"2024-01-02T24:00:00Z"']),
    ({"type": "string", "format": "uuid"},
     ['"123e4567-e89b-12d3-a456-426614174000"', '"123e4567e89b12d3a456426614174000"']),
    ({"type": "string", "format": "ipv4"}, ['"10.0.0.1"', '"256.1.1.1"', '"01.1.1.1"']),
    ({"enum": ["a", 1, None, [1, 2], {"x": True}]},
     ['"a"', "1", "null", "[1,2]", '{"x":true}', '{"x":false}', "2"]),
    ({"const": "a\nb"}, ['"a\\nb"', '"a\\u000ab"', '"a\\u000Ab"', '"ab"']),
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                      "additionalProperties": False}}, "$ref": "#/$defs/n"},
     ["{}", '{"next":{"next":{}}}', '{"next":1}']),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
     ["[]", "[1]", '[1,"a"]', '[1,"a",2]', '["a"]']),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
     ["[1]", "[1,2]", "[1,2,3]", "[1,2,3,4]"]),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                {"required": ["a"]}]}, ["{}", '{"a":1}', '{"a":"x"}']),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, ['"x"', "1", "null", "1.5"]),
    ({"type": ["string", "null"], "maxLength": 2}, ['"ab"', '"abc"', "null", "1"]),
    ({"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"]},
     ['{"kind":"x","\\u006bind":1}', '{"kind":"x","k\\u0069nd2":1}', '{"kind":"x","o":1}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "additionalProperties": False, "minProperties": 1},
     ["{}", '{"a":1}', '{"b":1}', '{"a":1,"b":2}']),
    ({}, ["1", '"x"', '[1,{"a":null}]', '{"a":[true]}', "-0.5e+3"]),
    (True, ["null", "[]"]),
    # llguidance's x-guidance separators (the written form changes)
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
      "x-guidance": {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}},
     ['{"a": [1, 2]}', '~{"a":[1,2]}', '{"a": [1, "x"]}']),
]


@pytest.mark.parametrize("schema,docs", CASES, ids=[str(i) for i in range(len(CASES))])
def test_semantics(gm, schema, docs):
    compile_ok(gm, schema)
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    v = jsonschema.Draft202012Validator(schema, format_checker=checker)
    for d in docs:
        # "~": a valid document the compiler does not write (a restriction
        # docs/GRAMMAR.md states); every other one is in the written form
        unwritten = d.startswith("~")
        d = d.lstrip("~")
        valid = v.is_valid(json.loads(d))
        ours = gm.match(d)
        assert not (ours and not valid), ("false accept", schema, d)
        assert ours == (valid and not unwritten), (schema, d, ours, valid)


@pytest.mark.parametrize("schema,where", [
    ({"not": {"type": "string"}}, "at /not:"),
    ({"properties": {"a": {"if": {}, "then": {}}}}, "at /properties/a/if:"),
    ({"properties": {"a/b": {"contains": {}}}}, "at /properties/a~1b/contains:"),
    ({"items": {"uniqueItems": True}}, "at /items/uniqueItems:"),
    ({"patternProperties": {"^x": {}}}, "at /patternProperties:"),
    ({"format": "idn-email"}, "at /format:"),
    ({"$ref": "other.json#/a"}, "at /$ref:"),
    ({"$defs": {"a": {"$ref": "#/$defs/missing"}}, "$ref": "#/$defs/a"}, "at /$defs/a/$ref:"),
    ({"type": "strnig"}, "at /type:"),
    ({"minLength": -1}, "at /minLength:"),
    ({"required": "a"}, "at /required:"),
    ({"properties": {"a": {"pattern": "(?<=x)y"}}}, "at /properties/a/pattern:"),
    ({"properties": {"a": {"pattern": "(a)\\1"}}}, "at /properties/a/pattern:"),
    ({"multipleOf": 0}, "at /multipleOf:"),
    ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, "at the root: oneOf"),
    ({"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                      "$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "cycle of $ref"),
    ({"x-guidance": {"whitespace_flexible": True}}, "at /x-guidance/whitespace_flexible:"),
    ({"x-guidance": {"lenient": True}}, "at /x-guidance/lenient:"),
    ({"x-guidance": 1}, "at /x-guidance:"),
])
def test_refusal_names_the_pointer(gm, schema, where):
    msg = refused(gm, schema)
    assert where in msg, msg
    compile_ok(gm, {"type": "integer"})  # and the process serves on


@pytest.mark.parametrize("text,words", [
    ("", "not JSON"),
    ('{"type": "string"', "not JSON"),
    ('{"type": "string", "type": "integer"}', "not JSON"),
    ("[1, 2]", "object or a boolean"),
    ("42", "object or a boolean"),
    ('{"properties": 5}', "must be an object"),
    ('{"enum": 5}', "must be an array"),
    ('{"$ref": 5}', "must be a string"),
    ('{"allOf": []}', "non-empty array"),
    ('{"type": "integer", "minimum": 5, "maximum": 1}', "unsatisfiable"),
    ('{"type": "object", "required": ["a"], "additionalProperties": false}', "unsatisfiable"),
    ('{"$ref": "#"}', "derives no sentence"),
    ('{"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}',
     "derives no sentence"),
])
def test_malformed(gm, text, words):
    msg = refused(gm, text)
    assert words in msg, msg


def test_hostile_schemas_end_at_their_bounds(gm):
    """Each ends with a clear error, or compiles, within seconds."""
    deep = {"type": "string"}
    for _ in range(500):
        deep = {"type": "array", "items": deep}
    explode = {"allOf": [{"anyOf": [{"type": "object", "properties": {f"p{i}{j}": {"type": "integer"}}}
                                    for j in range(4)]} for i in range(12)]}
    big_enum = {"enum": [f"value number {i} with some padding text" for i in range(25000)]}
    wide = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 8}
                                             for i in range(20000)}}
    many_items = {"type": "array", "items": {"type": "integer"}, "maxItems": 4000000000}
    for schema, expect in [(deep, "nested more than"), (explode, "too large"),
                           (big_enum, None), (wide, None), (many_items, None)]:
        text = json.dumps(schema)
        t0 = time.monotonic()
        r = gm.schema(text)
        dt = time.monotonic() - t0
        assert dt < 30, (len(text), dt)
        if expect:
            assert r.startswith("err ") and expect in r, r[:200]
        else:
            assert r.startswith("ok ") or r.startswith("err "), r[:200]
    assert len(json.dumps(big_enum)) > 1_000_000
    compile_ok(gm, {"type": "integer"})


def test_exploding_pattern_is_bounded(gm):
    """A pattern whose DFA is exponential: matching stops at the lexer-state
    bound with an error, or answers, and the process serves on."""
    compile_ok(gm, {"type": "string", "pattern": "^(a|b)*a(a|b){18}$"})
    t0 = time.monotonic()
    r = gm.ask("S " + ('"' + "ab" * 4000 + '"').encode().hex())
    assert time.monotonic() - t0 < 60
    assert r in ("0", "1") or r.startswith("0 ") or r.startswith("err "), r
    compile_ok(gm, {"type": "integer"})
    assert gm.match("12")
