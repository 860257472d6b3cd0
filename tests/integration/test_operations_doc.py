"""docs/OPERATIONS.md against the real binaries.

Flags: the set of `--flags` in each binary's real `--help` equals the set
documented in the table of that binary's section (the section of the flags
common to `tandem serve`, `tandem-prefill` and `tandem-decode` counts for
all three); no section mentions a flag its binary lacks; every
`(default ...)` of a `--help` appears verbatim in the doc's section.

Metrics: a tandem-router over one tandem-prefill and one tandem-decode on
the tiny model (one request prefilled remotely, so the parallel-plan
families appear on both pool instances); every family on their /metrics
is a row of the doc's metrics table with the same type, the same set of
binaries in its "Who" column, and every label name in its labels column;
every row of the table is a family some binary exposes.
"""

import os
import re
import subprocess

import pytest

from serve_util import Cluster

FLAG_RE = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# "(default ...)" with at most one level of nested parentheses.
DEFAULT_RE = re.compile(r"\(default[^()]*(?:\([^()]*\)[^()]*)*\)")
HEADING_RE = re.compile(r"^(#{1,6}) (.*?)\s*$", re.M)

COMMON = "Common to `tandem serve`, `tandem-prefill` and `tandem-decode`"
# doc heading -> (argv after the build dir, whether the common table applies)
BINARIES = {
    "`tandem serve`": (["tandem", "serve", "--help"], True),
    "`tandem-prefill`": (["tandem-prefill", "--help"], True),
    "`tandem-decode`": (["tandem-decode", "--help"], True),
    "`tandem-router`": (["tandem-router", "--help"], False),
    "`tandem up`": (["tandem", "up", "--help"], False),
    "`tandem bench`": (["tandem", "bench", "--help"], False),
    "`tandem profile`": (["tandem", "profile", "--help"], False),
    "`tandem plan`": (["tandem", "plan", "--help"], False),
    "`tandem simulate`": (["tandem", "simulate", "--help"], False),
}
WHO = {"R": "router", "P": "prefill", "D": "decode"}


def norm(text):
    """Whitespace collapsed, markdown's escaped pipes unescaped, the home
    directory written as ~ (the model default is under $HOME)."""
    home = os.path.expanduser("~").rstrip("/")
    text = text.replace("\\|", "|")
    if home:
        text = text.replace(home + "/", "~/")
    return " ".join(text.split())


@pytest.fixture(scope="module")
def doc(source_dir):
    path = source_dir / "docs" / "OPERATIONS.md"
    assert path.exists(), f"{path} is missing"
    return path.read_text()


def section(doc, title):
    """The body under the heading `title`, up to the next heading of the
    same or a higher level. Fails when the heading is absent or repeated."""
    hs = list(HEADING_RE.finditer(doc))
    found = [i for i, h in enumerate(hs) if h.group(2) == title]
    assert len(found) == 1, f"docs/OPERATIONS.md: {len(found)} headings {title!r} (want 1)"
    i = found[0]
    level = len(hs[i].group(1))
    end = len(doc)
    for h in hs[i + 1:]:
        if len(h.group(1)) <= level:
            end = h.start()
            break
    return doc[hs[i].end():end]


def table_rows(body):
    """Cells of every markdown table row that is not a header or rule."""
    rows = []
    for ln in body.splitlines():
        ln = ln.strip()
        if not ln.startswith("|") or re.match(r"^\|[-| :]+\|$", ln):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", ln)[1:-1]]
        rows.append(cells)
    return rows


def documented_flags(body):
    """Flags named in the first column of the section's tables."""
    out = set()
    for cells in table_rows(body):
        out |= set(FLAG_RE.findall(cells[0]))
    return out


def help_text(build, argv):
    env = dict(os.environ, COLUMNS="80")
    # The model default is $TANDEM_MODEL, else under $XDG_CACHE_HOME, else
    # ~/.cache (common/runtime/cli.c): the doc quotes the last form.
    env.pop("TANDEM_MODEL", None)
    env.pop("XDG_CACHE_HOME", None)
    exe = build / argv[0]
    assert exe.exists(), f"{exe} is missing"
    r = subprocess.run([str(exe), *argv[1:]], capture_output=True, text=True, timeout=30,
                       env=env)
    assert r.returncode == 0, f"{argv}: exit {r.returncode}: {r.stderr[-2000:]}"
    text = r.stdout + r.stderr
    assert FLAG_RE.search(text), f"{argv}: no flags in --help: {text[:500]!r}"
    return text


@pytest.mark.parametrize("title", list(BINARIES))
def test_flags_match_help(doc, tandem_bin, title):
    argv, with_common = BINARIES[title]
    helptext = help_text(tandem_bin.parent, argv)
    have = set(FLAG_RE.findall(helptext))
    body = section(doc, title)
    common = section(doc, COMMON) if with_common else ""
    documented = documented_flags(body) | documented_flags(common)

    missing = sorted(have - documented)
    assert not missing, f"{title}: --help has flags the doc's table lacks: {missing}"
    # `--help` itself: every binary answers it (it just did).
    invented = sorted(set(FLAG_RE.findall(body + common)) - have - {"--help"})
    assert not invented, f"{title}: the doc names flags --help does not have: {invented}"
    extra_rows = sorted(documented - have)
    assert not extra_rows, f"{title}: table rows for flags --help lacks: {extra_rows}"

    where = norm(body + " " + common)
    for d in DEFAULT_RE.findall(norm(helptext)):
        assert d in where, f"{title}: --help says {d!r}; the doc's section does not"


def test_common_table_is_common(doc, tandem_bin):
    """The common table holds only flags all three engine binaries take."""
    common = documented_flags(section(doc, COMMON))
    assert common, "the common flags table is empty"
    for title in ("`tandem serve`", "`tandem-prefill`", "`tandem-decode`"):
        have = set(FLAG_RE.findall(help_text(tandem_bin.parent, BINARIES[title][0])))
        assert common <= have, f"{title} lacks common flags {sorted(common - have)}"


def doc_metrics(doc):
    """{name: (type, who set, labels cell)} from the metrics table."""
    out = {}
    for cells in table_rows(section(doc, "Metrics")):
        m = re.fullmatch(r"`([a-z_:][a-z0-9_:]*)`", cells[0])
        if not m or len(cells) != 5:
            continue
        who = set(cells[3].split())
        assert who <= set(WHO), f"{m.group(1)}: bad Who column {cells[3]!r}"
        assert m.group(1) not in out, f"{m.group(1)} is listed twice"
        out[m.group(1)] = (cells[1], {WHO[w] for w in who}, cells[2])
    assert out, "no metrics table under ## Metrics"
    return out


def exposed(text):
    """{family: type} from the # TYPE lines, and {family: label names} from
    the samples (histogram/summary suffixes folded into their family)."""
    types = {}
    for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.M):
        types[m.group(1)] = m.group(2)
    labels = {f: set() for f in types}
    for ln in text.splitlines():
        if not ln or ln.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s", ln)
        assert m, f"/metrics: bad line {ln!r}"
        name = m.group(1)
        fam = name if name in types else re.sub(r"_(bucket|sum|count)$", "", name)
        assert fam in types, f"/metrics: sample {name} without a # TYPE line"
        for k in re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="', m.group(2) or ""):
            if k not in ("le", "quantile"):
                labels[fam].add(k)
    return types, labels


def test_metrics_match_binaries(doc, tandem_bin, test_models, tmp_path):
    listed = doc_metrics(doc)
    model = test_models / "gguf" / "llama2-f32.gguf"
    cl = Cluster(tandem_bin, tmp_path, model, n_prefill=1, n_decode=1,
                 r_args=["--local-prefill-threshold", "0", "--local-prefill-fraction", "0"])
    try:
        status, body = cl.router.post_json("/v1/completions",
                                           {"prompt": "the quick brown fox", "max_tokens": 3})
        assert status == 200, f"completion through the router: {status} {body!r}"
        # A bad request on the router and on D, so that the error family has
        # labelled samples whose label names are checked too.
        for srv in (cl.router, cl.ds[0]):
            status, _, _ = srv.request("POST", "/v1/completions", body=b"{",
                                       headers={"Content-Type": "application/json"})
            assert status == 400, f"a truncated JSON body got {status}"
        texts = {}
        for role, srv in (("router", cl.router), ("prefill", cl.ps[0]), ("decode", cl.ds[0])):
            status, _, raw = srv.request("GET", "/metrics")
            assert status == 200, f"{role} /metrics: {status}"
            texts[role] = raw.decode()
    finally:
        cl.close()
    assert re.search(r'^tandem:request_errors_total\{[^}]*code="400"', texts["router"], re.M), \
        "the router's /metrics has no sample of the 400 it answered"
    remote = re.search(r"^tandem:remote_prefill_total\{[^}]*\} (\S+)$", texts["decode"], re.M)
    assert remote and float(remote.group(1)) >= 1, "the request was not prefilled remotely"

    seen = {}  # family -> (type, roles, labels)
    for role, text in texts.items():
        types, labels = exposed(text)
        for fam, typ in types.items():
            t, roles, ls = seen.setdefault(fam, (typ, set(), set()))
            assert t == typ, f"{fam}: type {typ} on {role}, {t} elsewhere"
            roles.add(role)
            ls |= labels[fam]

    for fam, (typ, roles, labels) in sorted(seen.items()):
        assert fam in listed, f"{fam} ({typ}, on {sorted(roles)}) is not in the doc's table"
        dtype, droles, dlabels = listed[fam]
        assert dtype == typ, f"{fam}: the doc says {dtype}, /metrics says {typ}"
        assert droles == roles, f"{fam}: the doc says {sorted(droles)}, exposed by {sorted(roles)}"
        for lb in labels:
            assert re.search(rf"(?<![\w]){lb}(?![\w])", dlabels), \
                f"{fam}: label {lb} is not in the doc's labels {dlabels!r}"
    invented = sorted(set(listed) - set(seen))
    assert not invented, f"the doc lists metrics no binary exposes: {invented}"


def test_every_flag_named_anywhere_exists(doc, tandem_bin):
    """Prose, alerts and runbooks name only flags some binary takes."""
    have = {"--help"}
    for argv, _ in BINARIES.values():
        have |= set(FLAG_RE.findall(help_text(tandem_bin.parent, argv)))
    unknown = sorted(set(FLAG_RE.findall(doc)) - have)
    assert not unknown, f"docs/OPERATIONS.md names flags no binary has: {unknown}"
