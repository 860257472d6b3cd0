"""The JSON Schema compiler (common/grammar/json_schema.c) on
JSON-Schema-Test-Suite: drafts 2020-12 and 7 as python-jsonschema 4.26.0's
source package carries them (scripts/fetch-test-models.sh), and draft 7
from Debian's json-schema-test-suite package.

One td-grammar-match process per schema file. Each schema is compiled; if
Tandem refuses it, its instances are not run (the refusal is counted, with
llguidance's verdict on the same schema beside it). Otherwise every
instance is written as compact JSON (`json.dumps` with "," and ":" and
ensure_ascii off) with its properties in schema order, and matched whole.
Which instances are valid is decided by the PyPI `jsonschema` package with
a FormatChecker (so `format` counts), not by the suite's labels.

The bar: no invalid instance accepted, ever; of the schemas llguidance
compiles, Tandem compiles at least 90%. Valid instances rejected (a number with
an exponent under a bound, properties in another order than the ones this
reordering finds) are counted and printed, not failed."""

import json
import os
from pathlib import Path

import pytest

from grammar_util import GrammarMatch

SUITE_VER = "4.26.0"
SUITE = Path(os.environ.get(
    "TANDEM_JSON_SUITE_DIR",
    Path.home() / ".cache/tandem/json-schema-test-suite" / f"jsonschema-{SUITE_VER}"))
DEBIAN = Path("/usr/share/json-schema-test-suite/tests")

DRAFTS = {
    "draft2020-12": "https://json-schema.org/draft/2020-12/schema",
    "draft7": "http://json-schema.org/draft-07/schema#",
}


def suite_files():
    out = []
    for d in DRAFTS:
        out += [(d, p) for p in sorted((SUITE / d).glob("*.json"))]
    out += [("draft7", p) for p in sorted((DEBIAN / "draft7").glob("*.json"))]
    return out


def validator(draft, schema):
    import jsonschema
    cls = jsonschema.Draft202012Validator if draft == "draft2020-12" else jsonschema.Draft7Validator
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def prop_order(schema, root, seen=()):
    """The property names in the order the compiler writes them: the
    schema's own, then those its allOf branches and $ref target add."""
    if not isinstance(schema, dict) or id(schema) in seen:
        return []
    seen = seen + (id(schema),)
    names = []
    for k, v in schema.items():
        more = []
        if k == "properties" and isinstance(v, dict):
            more = list(v)
        elif k == "const" and isinstance(v, dict):  # a constant's own order
            more = list(v)
        elif k == "required" and isinstance(v, list):
            more = [n for n in v if isinstance(n, str)]
        elif k == "allOf" and isinstance(v, list):
            for b in v:
                more += prop_order(b, root, seen)
        elif k == "$ref" and isinstance(v, str) and v.startswith("#"):
            more = prop_order(resolve(root, v), root, seen)
        names += [n for n in more if n not in names]
    return names


def resolve(root, ref):
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def sub_schema(schema, root, key):
    """The schema of property key (for reordering nested objects)."""
    if not isinstance(schema, dict):
        return None
    if "$ref" in schema and isinstance(schema["$ref"], str) and schema["$ref"].startswith("#"):
        r = sub_schema(resolve(root, schema["$ref"]), root, key)
        if r is not None:
            return r
    props = schema.get("properties")
    if isinstance(props, dict) and key in props:
        return props[key]
    for b in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
        r = sub_schema(b, root, key)
        if r is not None:
            return r
    return None


def reorder(inst, schema, root):
    if isinstance(inst, dict):
        order = prop_order(schema, root)
        keys = [k for k in order if k in inst] + [k for k in inst if k not in order]
        return {k: reorder(inst[k], sub_schema(schema, root, k), root) for k in keys}
    if isinstance(inst, list) and isinstance(schema, dict):
        pre = schema.get("prefixItems") or (schema.get("items") if isinstance(schema.get("items"), list) else [])
        items = schema.get("items") if isinstance(schema.get("items"), dict) else None
        return [reorder(x, pre[i] if i < len(pre) else items, root) for i, x in enumerate(inst)]
    return inst


def llg_compiles(schema):
    import llguidance
    s = dict(schema) if isinstance(schema, dict) else schema
    if isinstance(s, dict):
        s["x-guidance"] = {"whitespace_flexible": False, "item_separator": ",",
                           "key_separator": ":"}
    g = llguidance.grammar_from("json_schema", json.dumps(s))
    return llguidance.LLMatcher.validate_grammar(g, None) == ""


TOTALS = {}


@pytest.mark.parametrize("draft,path", suite_files(),
                         ids=lambda x: x if isinstance(x, str) else f"{x.parent.parent.name}-{x.name}")
def test_suite_file(build_dir, draft, path):
    groups = json.loads(path.read_text())
    gm = GrammarMatch(build_dir)
    t = TOTALS.setdefault(draft, {"schemas": 0, "compiled": 0, "llg": 0, "both": 0,
                                  "valid_ok": 0, "valid_rejected": 0, "invalid_rejected": 0,
                                  "invalid_accepted": []})
    try:
        for grp in groups:
            schema = grp["schema"]
            if isinstance(schema, dict) and "$schema" not in schema:
                schema = {"$schema": DRAFTS[draft], **schema}
            t["schemas"] += 1
            llg = llg_compiles(schema)
            t["llg"] += llg
            r = gm.schema(json.dumps(schema))
            assert r.startswith("ok ") or r.startswith("err "), r
            if r.startswith("err "):
                continue
            t["compiled"] += 1
            t["both"] += llg
            v = validator(draft, schema)
            for case in grp["tests"]:
                inst = case["data"]
                doc = json.dumps(reorder(inst, schema, schema), separators=(",", ":"),
                                 ensure_ascii=False)
                valid = v.is_valid(inst)
                ok = gm.match(doc)
                if valid:
                    t["valid_ok" if ok else "valid_rejected"] += 1
                elif ok:
                    t["invalid_accepted"].append((path.name, grp["description"],
                                                  case["description"], doc))
                else:
                    t["invalid_rejected"] += 1
    finally:
        gm.close()
    bad = [x for x in t["invalid_accepted"] if x[0] == path.name]
    assert not bad, bad


def test_suite_present():
    """The suite is on this machine (an empty parameter list would pass)."""
    for d in DRAFTS:
        n = len(list((SUITE / d).glob("*.json")))
        assert n >= 30, f"{SUITE / d} holds {n} files: scripts/fetch-test-models.sh fetches them"
    assert len(list((DEBIAN / "draft7").glob("*.json"))) >= 30, \
        "Debian's json-schema-test-suite package is missing (scripts/setup.sh installs it)"


def test_suite_totals():
    """Runs after the files (pytest keeps file order): the compile bar and
    the counts for the notes."""
    assert TOTALS, "the suite files did not run before this test"
    for draft, t in TOTALS.items():
        print(f"{draft}: {t['compiled']}/{t['schemas']} schemas compiled "
              f"(llguidance {t['llg']}, both {t['both']}); valid accepted {t['valid_ok']}, "
              f"rejected {t['valid_rejected']}; invalid rejected {t['invalid_rejected']}, "
              f"accepted {len(t['invalid_accepted'])}")
        assert not t["invalid_accepted"]
        # of the schemas llguidance compiles, Tandem compiles 90% or more
        assert t["both"] >= 0.9 * t["llg"], t
