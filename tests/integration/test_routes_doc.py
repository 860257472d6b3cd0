"""The HTTP endpoints docs/OPERATIONS.md and the README name against the
servers' route table (common/api/http.c, the one table every binary's HTTP
server answers from): every endpoint the docs name is a route, with the
method they give it; every route is named in OPERATIONS.md. Checked on
planted texts too, so the check cannot pass by reading nothing."""

import os
import pathlib
import re

SRC = pathlib.Path(os.environ.get("TANDEM_SOURCE_DIR", pathlib.Path(__file__).parents[2]))
# {"/path", R_NAME, post} in the routes[] initialiser
ROUTE = re.compile(r'\{\s*"(/[^"]*)"\s*,\s*R_[A-Z_]+\s*,\s*(true|false)\s*\}')
# a path of ours in a doc: /v1/..., /internal/..., /health, /ready, /metrics,
# /tokenize, /detokenize, /apply-template (also in a URL, after its port),
# optionally after an HTTP method
NAMED = re.compile(r"(?:\b(GET|POST|HEAD|PUT|DELETE|PATCH)\s+)?"
                   r"(?<![A-Za-z_./-])(/(?:v1|internal)(?:/[a-z0-9_][a-z0-9_.-]*)+|/health|/ready|/metrics"
                   r"|/tokenize|/detokenize|/apply-template)(?![\w/-])")


def routes(http_c):
    """{path: method} of the route table."""
    table = http_c[http_c.index("} routes[] = {"):]
    table = table[: table.index("};")]
    return {p: ("POST" if post == "true" else "GET") for p, post in ROUTE.findall(table)}


def named(text):
    """[(method or None, path)] the text names."""
    return [(m or None, p) for m, p in NAMED.findall(text)]


def check(table, docs, ops):
    """(named but not routes, with the wrong method, routes OPERATIONS.md does not name)."""
    missing, wrong = set(), set()
    for text in docs:
        for method, path in named(text):
            if path not in table:
                missing.add(path)
            elif method and method != table[path] and not (method == "HEAD" and table[path] == "GET"):
                wrong.add(f"{method} {path} (the server answers {table[path]})")
    in_ops = {p for _, p in named(ops)}
    undocumented = {p for p in table if p not in in_ops}
    return sorted(missing), sorted(wrong), sorted(undocumented)


def test_docs_name_the_routes():
    table = routes((SRC / "common/api/http.c").read_text())
    assert len(table) >= 10, table
    ops = (SRC / "docs/OPERATIONS.md").read_text()
    readme = (SRC / "README.md").read_text()
    missing, wrong, undocumented = check(table, [ops, readme], ops)
    assert not missing, f"the docs name endpoints no server has: {missing}"
    assert not wrong, f"the docs give endpoints the wrong method: {wrong}"
    assert not undocumented, f"routes docs/OPERATIONS.md does not name: {undocumented}"


def test_the_check_finds_planted_differences():
    http_c = ('} routes[] = {\n    {"/v1/completions", R_COMPLETIONS, true},\n'
              '    {"/internal/v1/kv/exchange", R_EXCHANGE, false},\n'
              '    {"/metrics", R_METRICS, false},\n};\n')
    table = routes(http_c)
    assert table == {"/v1/completions": "POST", "/internal/v1/kv/exchange": "GET",
                     "/metrics": "GET"}
    ops = ("`POST /internal/v1/kv/exchange` and POST /v1/completions, "
           "`/internal/v1/gone`, http://host:8000/metrics?x")
    missing, wrong, undocumented = check(table, [ops], ops)
    assert missing == ["/internal/v1/gone"]
    assert wrong == ["POST /internal/v1/kv/exchange (the server answers GET)"]
    assert undocumented == []
    missing, wrong, undocumented = check(table, ["GET /metrics"], "GET /metrics")
    assert (missing, wrong, undocumented) == ([], [], ["/internal/v1/kv/exchange",
                                                      "/v1/completions"])
