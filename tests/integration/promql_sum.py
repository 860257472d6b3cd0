"""The one PromQL form the autoscalers in deploy/k8s use,
`sum(METRIC{label="v",label=~"re",...})`, parsed and evaluated over
samples with labels: the tests check which Services a query reads and what
it adds up to against the real processes' /metrics. A query of another
form fails the test that reads it (extend this parser with the query)."""

import re

_QUERY = re.compile(r"^\s*sum\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}\s*\)\s*$")
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')


def parse(query):
    """-> (metric, [(label, op, value), ...]); ValueError for another form."""
    m = _QUERY.match(query)
    if not m:
        raise ValueError(f"not sum(METRIC{{...}}): {query!r}")
    metric, body = m.groups()
    matchers, pos = [], 0
    while pos < len(body):
        mm = _MATCHER.match(body, pos)
        if not mm:
            raise ValueError(f"label matchers not understood at {body[pos:]!r} in {query!r}")
        matchers.append((mm.group(1), mm.group(2), mm.group(3)))
        pos = mm.end()
    return metric, matchers


def matches(matchers, labels):
    """Whether a label map satisfies every matcher (regexes anchored, as in
    PromQL; a missing label is the empty string)."""
    for name, op, value in matchers:
        v = labels.get(name, "")
        if op == "=" and v != value:
            return False
        if op == "!=" and v == value:
            return False
        if op == "=~" and not re.fullmatch(value, v):
            return False
        if op == "!~" and re.fullmatch(value, v):
            return False
    return True


def evaluate(query, series):
    """series: [(metric, {label: value}, float)] -> the query's sum."""
    metric, matchers = parse(query)
    return sum(v for n, ls, v in series if n == metric and matches(matchers, ls))
