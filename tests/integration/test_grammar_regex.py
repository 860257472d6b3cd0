"""The grammar engine's regular expressions (common/grammar/regex.c) against
RE2 (the PyPI `google-re2` package), an independent automaton-based
implementation that, unlike `re`, never backtracks exponentially, through
td-grammar-match (tests/bench/grammar_match.c).

Patterns are random expression trees written twice: in ECMAScript syntax
for Tandem (JSON Schema's `pattern` dialect) and in RE2 syntax with the
same meaning (ECMAScript's `.`, \\d, \\w and \\s spelled out as the classes
ECMAScript defines, \\A and \\z for ^ and $). Texts are made
from each tree (matching by construction, then mutated by a character
inserted, deleted or replaced) plus random strings over the pattern's
alphabet and beyond ASCII, and every one is matched both ways: whole-text
matching (fullmatch) and JSON Schema's search semantics (search).
The engine matches UTF-8 bytes; malformed UTF-8 must never match. Hand
written cases cover the escapes, classes and anchors; unsupported
constructs must be refused with a message naming them."""

import random
import re
import subprocess

import pytest

from grammar_util import GrammarMatch

SEED = 20261207
N_TREES = 400
TEXTS_PER_TREE = 14

# ECMAScript's \s: white space and line terminators
ES_SPACE = "[\t\n\x0b\x0c\r \xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff]"
ES_NOT_SPACE = ES_SPACE.replace("[", "[^", 1)
SYNTAX = set("^$\\.*+?()[]{}|/-")
ALPHABET = ["a", "b", "c", "x", "0", "7", "_", " ", "-", ".", "\n", "é", "ß", "中", "€", "😀",
            "\u2028", "\xa0", "Z", "{", "}"]


@pytest.fixture(scope="module")
def matcher(build_dir):
    m = GrammarMatch(build_dir)
    yield m
    m.close()


# ---------------------------------------------------------------------------
# Random trees: (es, py, gen) where gen(rng) returns a matching text


def lit(c):
    es = "\\" + c if c in SYNTAX else c
    return (es, _py_escape(c), lambda r: c)


def _py_escape(c):
    return "\\" + c if c in SYNTAX else c


def cls(rng):
    kind = rng.randrange(6)
    if kind == 0:
        return ("\\d", "[0-9]", lambda r: r.choice("0123456789"))
    if kind == 1:
        return ("\\w", "[0-9A-Za-z_]", lambda r: r.choice("abcXYZ09_"))
    if kind == 2:
        return ("\\s", ES_SPACE, lambda r: r.choice(" \t\n\u2028\xa0\ufeff"))
    if kind == 3:
        return (".", "[^\n\r\u2028\u2029]", lambda r: r.choice("ab é中😀-"))
    chars = rng.sample([c for c in ALPHABET if c not in "\\]^-"], rng.randrange(1, 4))
    lo, hi = sorted(rng.sample(["a", "c", "m", "z", "0", "9", "α", "ω", "中", "😀"], 2),
                    key=ord)
    body_es = "".join("\\" + c if c in SYNTAX else c for c in chars) + f"{lo}-{hi}"
    body_py = "".join(_py_escape(c) for c in chars) + f"{lo}-{hi}"
    members = chars + [lo, hi, chr((ord(lo) + ord(hi)) // 2)]
    if kind == 4:
        return (f"[{body_es}]", f"[{body_py}]", lambda r: r.choice(members))
    outside = [c for c in ALPHABET if c not in members and not lo <= c <= hi]
    return (f"[^{body_es}]", f"[^{body_py}]", lambda r: r.choice(outside))


def tree(rng, depth=0):
    k = rng.randrange(10) if depth < 4 else rng.randrange(2)
    if k == 0:
        return lit(rng.choice(ALPHABET))
    if k == 1:
        return cls(rng)
    if k in (2, 3):
        parts = [tree(rng, depth + 1) for _ in range(rng.randrange(2, 4))]
        return ("".join(p[0] for p in parts), "".join(p[1] for p in parts),
                lambda r: "".join(p[2](r) for p in parts))
    if k in (4, 5):
        parts = [tree(rng, depth + 1) for _ in range(rng.randrange(2, 4))]
        return ("(?:" + "|".join(p[0] for p in parts) + ")",
                "(?:" + "|".join(p[1] for p in parts) + ")",
                lambda r: r.choice(parts)[2](r))
    sub = tree(rng, depth + 1)
    q = rng.choice(["*", "+", "?", "{2}", "{0,3}", "{1,}", "{2,4}", "*?", "+?"])
    lo, hi = {"*": (0, 3), "+": (1, 3), "?": (0, 1), "{2}": (2, 2), "{0,3}": (0, 3),
              "{1,}": (1, 4), "{2,4}": (2, 4), "*?": (0, 3), "+?": (1, 3)}[q]
    group = k % 2 == 0
    es = f"(?:{sub[0]}){q}" if group else f"({sub[0]}){q}"
    py = f"(?:{sub[1]}){q}"
    return (es, py, lambda r: "".join(sub[2](r) for _ in range(r.randint(lo, hi))))


def texts(rng, gen):
    out = []
    for _ in range(TEXTS_PER_TREE):
        t = gen(rng)
        m = rng.randrange(4)
        if m == 1 and t:
            i = rng.randrange(len(t))
            t = t[:i] + t[i + 1:]
        elif m == 2:
            i = rng.randrange(len(t) + 1)
            t = t[:i] + rng.choice(ALPHABET) + t[i:]
        elif m == 3 and t:
            i = rng.randrange(len(t))
            t = t[:i] + rng.choice(ALPHABET) + t[i + 1:]
        out.append(t)
    out.append("")
    out.append("".join(rng.choice(ALPHABET) for _ in range(rng.randrange(1, 8))))
    return out


def test_random_trees_match_re2(matcher):
    import re2
    rng = random.Random(SEED)
    n = matched = 0
    for _ in range(N_TREES):
        es, py, gen = tree(rng)
        anchor = rng.randrange(4)
        search = rng.random() < 0.5
        es_p, py_p = es, py
        if search and anchor & 1:
            es_p, py_p = "^" + es_p, "\\A" + py_p
        if search and anchor & 2:
            es_p, py_p = es_p + "$", py_p + "\\z"
        r = matcher.compile(es_p, search)
        assert r.startswith("ok"), (es_p, r)
        rx = re2.compile(py_p)
        for t in texts(rng, gen):
            want = bool(rx.search(t) if search else rx.fullmatch(t))
            got = matcher.match(t)
            assert got == want, (es_p, py_p, search, t)
            n += 1
            matched += want
    # both outcomes well represented
    assert n >= N_TREES * TEXTS_PER_TREE
    assert 0.25 * n < matched < 0.9 * n, (matched, n)


# The flags i and s (Lark's /.../is) against RE2's (?i) and (?s): ASCII
# patterns (flag i refuses others), texts with the two code points Unicode's
# simple case folding maps to ASCII letters (U+212A KELVIN SIGN, U+017F LONG
# S) and line terminators
FLAG_TEXT = ["a", "A", "k", "K", "\u212a", "s", "S", "\u017f", "z", "0", "_", " ", "\n", "\r",
             "\u2028", "é", "É", "-"]


def flag_tree(rng, depth=0):
    k = rng.randrange(7) if depth < 3 else rng.randrange(3)
    if k == 0:
        c = rng.choice("aAkKsSz0_ -")
        return (c if c != "-" else "\\-", re.escape(c))
    if k == 1:
        return rng.choice([("[a-f]", "[a-f]"), ("[^k]", "[^k]"), ("[A-Z0-9]", "[A-Z0-9]"),
                           ("[s-z_]", "[s-z_]"), ("\\w", "[0-9A-Za-z_]"), ("\\d", "[0-9]")])
    if k == 2:
        return (".", None)  # '.': the pattern's own per flags
    if k in (3, 4):
        parts = [flag_tree(rng, depth + 1) for _ in range(rng.randrange(2, 4))]
        if k == 3:
            return ("".join(p[0] for p in parts), parts)
        return ("(?:" + "|".join(p[0] for p in parts) + ")", ("alt", parts))
    sub = flag_tree(rng, depth + 1)
    q = rng.choice(["*", "+", "?", "{1,3}"])
    return (f"(?:{sub[0]}){q}", ("rep", sub, q))


def flag_py(t, dotall):
    es, py = t
    if es == ".":
        return "." if dotall else "[^\n\r\u2028\u2029]"
    if isinstance(py, str):
        return py
    if isinstance(py, list):
        return "".join(flag_py(p, dotall) for p in py)
    if py[0] == "alt":
        return "(?:" + "|".join(flag_py(p, dotall) for p in py[1]) + ")"
    return f"(?:{flag_py(py[1], dotall)}){py[2]}"


def test_flags_match_re2(matcher):
    import re2
    rng = random.Random(SEED + 1)
    n = matched = 0
    for i in range(300):
        tree_ = flag_tree(rng)
        icase, dotall = i % 3 != 1, i % 3 != 0
        flags = (2 if icase else 0) | (4 if dotall else 0)
        r = matcher.compile(tree_[0], False, flags)
        assert r.startswith("ok"), (tree_[0], r)
        py = ("(?i)" if icase else "") + ("(?s)" if dotall else "") + flag_py(tree_, dotall)
        rx = re2.compile(py)
        for _ in range(12):
            t = "".join(rng.choice(FLAG_TEXT) for _ in range(rng.randrange(0, 5)))
            want = bool(rx.fullmatch(t))
            assert matcher.match(t) == want, (tree_[0], py, flags, t)
            n += 1
            matched += want
    assert matched > 0.05 * n, (matched, n)


def test_flag_i_refuses_non_ascii(matcher):
    for p in ["é", "[à-ÿ]", "\\u00e9", "[a-\\u00ff]"]:
        r = matcher.compile(p, False, 2)
        assert r.startswith("err") and "must be ASCII" in r, (p, r)


def test_intersection_and_complement_match_re2(matcher):
    """td_rx_and and td_rx_not (the JSON Schema compiler's tools) against
    RE2 run on each operand: A&B matches where both do, ~A where A does
    not (over UTF-8 texts)."""
    import re2
    rng = random.Random(SEED + 1)
    n = both_n = 0
    for _ in range(N_TREES // 2):
        a, b = tree(rng), tree(rng)
        search = rng.random() < 0.5
        ra, rb = re2.compile(a[1]), re2.compile(b[1])

        def m(rx, t):
            return bool(rx.search(t) if search else rx.fullmatch(t))
        ts = texts(rng, a[2]) + texts(rng, b[2])
        assert matcher.both(a[0], b[0], search).startswith("ok")
        for t in ts:
            want = m(ra, t) and m(rb, t)
            assert matcher.match(t) == want, (a[0], b[0], search, t)
            both_n += want
        assert matcher.complement(a[0], search).startswith("ok")
        for t in ts:
            assert matcher.match(t) == (not m(ra, t)), (a[0], search, t)
            n += 1
    assert n > 5000 and both_n > 100, (n, both_n)
    # the complement is over all byte strings: malformed UTF-8 is in it
    assert matcher.complement("a").startswith("ok")
    assert matcher.match(b"\xff") and matcher.match("") and not matcher.match("a")


CASES = [
    # (pattern, search, texts that match, texts that do not)
    ("abc", False, ["abc"], ["ab", "abcd", ""]),
    ("abc", True, ["abc", "xxabcxx"], ["ab", "acb"]),
    ("^abc", True, ["abc", "abcx"], ["xabc"]),
    ("abc$", True, ["abc", "xabc"], ["abcx", "abc\n"]),
    ("^\\d{3}-\\d{4}$", True, ["555-1234"], ["5551234", "555-12345", "٥٥٥-1234"]),
    ("^[a-z]+(?:-[a-z]+)*$", True, ["a", "ab-cd-e"], ["-a", "a-", "A"]),
    ("^\\u00e9\\x41\\u{1F600}\\t$", True, ["éA😀\t"], ["éA😀 "]),
    ("^\\uD83D\\uDE00$", True, ["😀"], ["\ud83d".encode("utf-8", "surrogatepass")]),
    ("^[\\b]$", True, ["\b"], ["b"]),
    ("^\\cJ$", True, ["\n"], ["J"]),
    ("^a{2,}$", True, ["aa", "aaaa"], ["a"]),
    ("^a{,2}$", True, ["a{,2}"], ["aa"]),  # not a quantifier: literal (Annex B)
    ("^(?<year>\\d{4})$", True, ["2026"], ["26"]),
    ("^.$", True, ["a", "é", "😀"], ["\n", "\r", "\u2028", "ab", ""]),
    ("^\\s$", True, [" ", "\t", "\ufeff", "\u3000"], ["a", "\x1c", "\x85"]),
    ("^\\W$", True, ["é", "-"], ["a", "_", "5"]),
    ("^[\\w.-]+@[\\w-]+\\.[a-z]{2,}$", True, ["a.b-c@d-e.org"], ["a@b.c", "@b.org"]),
    ("", True, ["", "anything"], []),
    ("", False, [""], ["a"]),
    ("a|", False, ["a", ""], ["b"]),
    ("(?:)", False, [""], ["a"]),
]


@pytest.mark.parametrize("pattern,search,yes,no", CASES)
def test_cases(matcher, pattern, search, yes, no):
    r = matcher.compile(pattern, search)
    assert r.startswith("ok"), r
    for t in yes:
        assert matcher.match(t), (pattern, t)
    for t in no:
        assert not matcher.match(t), (pattern, t)


def test_negated_empty_class_is_any_char(matcher):
    # ECMAScript: [^] matches any one character, [] none
    assert matcher.compile("[^]").startswith("ok")
    assert matcher.match("😀") and matcher.match("\n") and not matcher.match("ab")
    assert matcher.compile("a[]").startswith("ok")
    assert not matcher.match("a") and not matcher.match("a]")


def test_malformed_utf8_never_matches(matcher):
    for pattern in ("[^a]", ".", "[\\s\\S]*", "[\\u0080-\\u{10FFFF}]"):
        assert matcher.compile(pattern).startswith("ok")
        for bad in (b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82",
                    b"\x80"):
            assert not matcher.match(bad), (pattern, bad)
    assert matcher.compile("[\\s\\S]*").startswith("ok")
    assert matcher.match("é😀€\x00")


@pytest.mark.parametrize("pattern,needle", [
    ("a(?=b)", "lookaround"), ("a(?!b)", "lookaround"), ("(?<=a)b", "lookaround"),
    ("(?<!a)b", "lookaround"), ("(a)\\1", "backreference"), ("\\bword", "\\b"),
    ("a\\B", "\\B"), ("\\p{L}", "property"), ("a^b", "anchor"), ("a$b", "anchor"),
    ("(a", "unbalanced"), ("a)", "unbalanced"), ("[a", "unterminated"), ("*a", "nothing to repeat"),
    ("a**", "nothing to repeat"), ("a{3,2}", "out of order"), ("[z-a]", "out of order"),
    ("a{100000}", "repetition count"), ("\\", "trailing backslash"), ("\\u12", "hex digits"),
    ("\\uD800", "surrogate"), ("\\k<x>", "backreference"), ("[\\d-z]", "range"),
    ("(" * 300 + ")" * 300, "nested deeper"),
])
def test_unsupported_is_refused_by_name(matcher, pattern, needle):
    r = matcher.compile(pattern, True)
    assert r.startswith("err regex: "), (pattern, r)
    assert needle in r, (pattern, r)
    assert "offset" in r, r


def test_malformed_utf8_pattern_is_refused(matcher, build_dir):
    exe = build_dir / "td-grammar-match"
    bad = b"a\xffb".hex()
    out = subprocess.run([str(exe)], input=f"P 0 {bad}\n", capture_output=True, text=True,
                         timeout=10).stdout
    assert out.startswith("err regex: malformed UTF-8"), out


def test_blowup_is_bounded(matcher):
    # (a|b)*a(a|b){n}: a DFA with 2^n states; walking a long text explores many
    r = matcher.compile("(?:a|b)*a(?:a|b){18}")
    assert r.startswith("ok"), r
    rng = random.Random(1)
    text = "".join(rng.choice("ab") for _ in range(4000))
    import re
    want = bool(re.fullmatch("(?:a|b)*a(?:a|b){18}", text))
    assert matcher.match(text) == want
