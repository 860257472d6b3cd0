"""The grammar engine's parser (common/grammar/grammar.c: the lexer DFA and
the Earley parser over lexemes) and its Lark-style grammar language
(common/grammar/lark.c), through td-grammar-match
(tests/bench/grammar_match.c), against independent recognizers:

- random context-free grammars over one-character terminals (nullable
  rules, left and right recursion, ambiguity, unit cycles) against a
  chart recognizer written here in Python from the textbook definition
  (a nonterminal derives a span if one of its rules' symbol sequences
  splits the span), on every string up to a length over the alphabet;
- a JSON grammar in Lark syntax against Python's json module on random
  compact documents and their mutations (a character inserted, deleted or
  replaced, a prefix), so greedy lexing across lexeme boundaries is
  covered on real structure;
- the grammar language's refusals, each a message naming the construct
  and the line."""

import itertools
import json
import random

import pytest

from grammar_util import GrammarMatch

SEED = 20261207


@pytest.fixture(scope="module")
def gm(build_dir):
    m = GrammarMatch(build_dir)
    m.compile = m.grammar  # this module's constraints are grammars
    yield m
    m.close()


# ---------------------------------------------------------------------------
# Random grammars against a chart recognizer


def derives(rules, start, s):
    """rules: {nonterminal: [tuple of symbols]}; terminals are one-char
    strings not in rules. True if start derives s."""
    n = len(s)
    memo = {}

    def span(a, i, j):
        return memo.get((a, i, j), False)

    def seq(rhs, i, j):
        # can rhs derive s[i:j]? (with the current span table)
        if not rhs:
            return i == j
        x, rest = rhs[0], rhs[1:]
        for k in range(i, j + 1):
            if x in rules:
                ok = span(x, i, k)
            else:
                ok = k == i + 1 and s[i] == x
            if ok and seq(rest, k, j):
                return True
        return False

    for length in range(n + 1):
        for i in range(n - length + 1):
            j = i + length
            changed = True
            while changed:  # unit and nullable cycles within one span
                changed = False
                for a, alts in rules.items():
                    if span(a, i, j):
                        continue
                    if any(seq(r, i, j) for r in alts):
                        memo[(a, i, j)] = True
                        changed = True
    return span(start, 0, n)


def random_grammar(rng):
    nts = ["start"] + [f"n{i}" for i in range(rng.randrange(1, 4))]
    alphabet = ["a", "b", "c"]
    rules = {}
    for a in nts:
        # one alternative of terminals only keeps every nonterminal productive
        alts = [tuple(rng.choice(alphabet) for _ in range(rng.randrange(0, 3)))]
        for _ in range(rng.randrange(1, 4)):
            alts.append(tuple(rng.choice(nts + alphabet + alphabet)
                              for _ in range(rng.randrange(0, 4))))
        rules[a] = alts
    return rules


def test_random_grammars_match_chart_recognizer(gm):
    rng = random.Random(SEED)
    grammars = points = accepted = 0
    while grammars < 120:
        rules = random_grammar(rng)
        # the grammar language has no empty string; an empty rule is an
        # empty alternative
        text = "\n".join(
            f"{a}: " + " | ".join(" ".join(f'"{x}"' if x not in rules else x for x in r)
                                  for r in alts)
            for a, alts in rules.items())
        r = gm.compile(text)
        assert r.startswith("ok"), (text, r)
        grammars += 1
        for length in range(0, 6):
            for t in itertools.product("abc", repeat=length):
                s = "".join(t)
                want = derives(rules, "start", s)
                assert gm.match(s) == want, (text, s, want)
                points += 1
                accepted += want
    assert points > 30000 and 0.01 * points < accepted < 0.9 * points, (accepted, points)


# ---------------------------------------------------------------------------
# JSON in Lark syntax against Python's json

JSON_LARK = r"""
start: value
?value: object | array | STRING | NUMBER | "true" | "false" | "null"
object: "{" [pair ("," pair)*] "}"
pair: STRING ":" value
array: "[" [value ("," value)*] "]"
STRING: /"(?:[^"\\\x00-\x1f]|\\["\\\/bfnrt]|\\u[0-9a-fA-F]{4})*"/
NUMBER: "-"? INT FRAC? EXP?
INT: "0" | "1".."9" DIGIT*
FRAC: "." DIGIT+
EXP: ("e" | "E") ("+" | "-")? DIGIT+
DIGIT: "0".."9"
"""


def random_value(rng, depth=0):
    k = rng.randrange(8 if depth < 4 else 5)
    if k == 0:
        return rng.choice([True, False, None])
    if k == 1:
        return rng.choice([0, -1, 7, 123456789, -42, 10 ** 20])
    if k == 2:
        return rng.choice([0.5, -1.25e-7, 3.0e20, 1e100, -0.0])
    if k in (3, 4):
        return "".join(rng.choice(['a', 'é', '"', '\\', '\n', '\x01', '/', '中', '😀', ' ', 'u'])
                       for _ in range(rng.randrange(0, 6)))
    if k == 5:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {"k" + str(i) + rng.choice(["", "é", '"']): random_value(rng, depth + 1)
            for i in range(rng.randrange(0, 4))}


def compact_json(text):
    """The oracle: text is JSON (json.loads, no NaN/Infinity) with no white
    space outside strings."""
    def no_constants(c):
        raise ValueError(c)
    try:
        json.loads(text, parse_constant=no_constants)
    except (ValueError, RecursionError):
        return False
    in_str = esc = False
    for c in text:
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in " \t\n\r":
            return False
    return True


def test_json_grammar_matches_python_json(gm):
    r = gm.compile(JSON_LARK)
    assert r.startswith("ok"), r
    rng = random.Random(SEED)
    n = ok = 0
    for _ in range(600):
        doc = json.dumps(random_value(rng), separators=(",", ":"), ensure_ascii=rng.random() < 0.3)
        texts = [doc, doc[:rng.randrange(len(doc) + 1)]]
        for _ in range(4):
            i = rng.randrange(len(doc) + 1)
            c = rng.choice(list('",:{}[]1e-+. \\uatfn0E'))
            m = rng.randrange(3)
            texts.append(doc[:i] + c + doc[i:] if m == 0 else doc[:i] + doc[i + 1:] if m == 1
                         else doc[:i] + c + doc[i + 1:])
        for t in texts:
            want = compact_json(t)
            assert gm.match(t) == want, (t, want)
            n += 1
            ok += want
    assert n == 600 * 6 and 0.2 * n < ok < 0.8 * n, (ok, n)


# ---------------------------------------------------------------------------
# The language's own cases


@pytest.mark.parametrize("grammar,yes,no", [
    # left recursion, right recursion
    ('start: start "a" | "b"', ["b", "baaa"], ["", "a", "ab"]),
    ('start: "a" start | "b"', ["b", "aaab"], ["ba"]),
    # ambiguity: both parses end in the same place
    ('start: x | y\nx: "a" "b"\ny: "a" "b"', ["ab"], ["a"]),
    # nullable symbols before and after
    ('start: e "x" e\ne: | "y"', ["x", "yx", "xy", "yxy"], ["yy", ""]),
    # operators
    ('start: "a"? "b"+ ("c" | "d")* ["e"] "f" ~ 2..3', ["bff", "abbcdcdeff", "bfff"],
     ["bf", "bffff", "abcf"]),
    # one lexeme may have several parses around it (two terminals, same text)
    ('start: A | B "!"\nA: /[a-z]+/\nB: "hi"', ["hi", "hello", "hi!"], ["hello!"]),
    # greedy: the longer lexeme wins where it can continue
    ('start: WORD+\nWORD: /[a-z]+/', ["abc"], [""]),
    ('start: NUM "." NUM\nNUM: /[0-9]+/', ["12.5"], ["12.", ".5"]),
    # a lexer state equal to the lexeme's start after a byte is not its start
    ('start: A?\nA: /x*y/', ["", "y", "xxy"], ["x", "xx"]),
    ('start: A "!"?\nA: /(ab)*c/', ["c", "ababc!"], ["ab", "ab!", "abab"]),
    # multi-line rules and comments
    ('start: "a"\n    | "b" // comment\n    # another\n    | "c"', ["a", "b", "c"], ["d"]),
    ("start: 'single' \"\\u00e9\\n\"", ["singleé\n"], ["single"]),
    ('start: LETTER+\nLETTER: "a".."c" | "é"', ["abcé"], ["d"]),
    ('start: X\nX: Y Y\nY: /[0-9]/ ~ 2', ["1234"], ["123"]),
    # a token terminal: the token's engine bytes (0xFF and its id), no text
    ('start: "a" <[258]> "b"', [b"a\xff\x00\x00\x01\x02b"], ["ab", b"a\xff\x00\x00\x01\x03b"]),
    # a token terminal of several ids: any one of them
    ("start: <[258,260-261]>", [b"\xff\x00\x00\x01\x02", b"\xff\x00\x00\x01\x05"],
     [b"\xff\x00\x00\x01\x03"]),
    # %ignore (llguidance's reading): before a lexeme that is not the first,
    # where a lexeme can follow
    ('start: "a"+\n%ignore " "', ["a", "a a", "a  a ", "aa"], [" a", "", " "]),
    ('start: "a" "b"\n%ignore " "\n%ignore "-"', ["a b", "a- b", "ab"], ["a b ", " ab"]),
    # Lark's common terminals, by name or aliased
    ("start: NUMBER\n%import common.NUMBER", ["1", "1.5e-3", ".5", "7."], ["-1", "1e", "."]),
    ('start: "a" SPACE "b"\n%import common.WS -> SPACE', ["a \n b"], ["ab"]),
    ('start: C\n%import common.C_COMMENT -> C', ["/* a * b */", "/**/"], ["/* */ */", "/*/"]),
    ('start: ESCAPED_STRING\n%import common (ESCAPED_STRING)', ['"a\\"b"', '"x\ny"'],
     ['"a\\\nb"', '"a"b"']),
    # {m,n} repetition, '-' in names, an alias, a case-insensitive literal
    ('start: "a"{2,3} "b"{,1} "c"{2,}', ["aacc", "aaabccc"], ["acc", "aabbcc", "aac"]),
    ('start: my-rule\nmy-rule: "x" -> named', ["x"], ["y"]),
    ('start: "Yes"i | "no"', ["yes", "YES", "yEs", "no"], ["NO", "ye"]),
    ('%llguidance {\n  "no_forcing": true\n}\nstart: "a"', ["a"], ["b"]),
    # lexeme options: lazy (the first match ends the lexeme), suffix, capture
    ('start: d "x"\nd[lazy]: /[0-9]+/', ["1x"], ["12x", "x"]),
    ('start: w+\nw[capture, suffix=";"]: /[a-z]+/', ["ab;cd;", "ab;"], ["ab", "a;;"]),
    ('start: w\nw[lazy]: /.*<end>/', ["foo<end>", "<end>"], ["foo<end>bar<end>", "foo"]),
    # regex flags: i (ASCII letters either case, and U+212A/U+017F for k/s
    # as Unicode's simple folding has them), s ('.' takes line breaks)
    ("start: /hi|hello/i /[a-k]+/i", ["HIabc", "Hellok", "hi\u212a"], ["hey", "hi\u017f"]),
    ('start: "s"i "x"', ["sx", "Sx", "\u017fx"], ["tx"]),
    ("start: /a.b/s", ["a\nb", "a\u2028b", "axb"], ["ab"]),
    ("start: /a.b/", ["axb"], ["a\nb", "a\rb"]),
    # a JSON Schema inline, as a rule
    ('start: "n=" %json {"type": "integer", "maximum": 5} | "s=" %json {\n  "type": "string"\n}',
     ["n=5", "n=-3", 's="x"'], ["n=6", 's=1', "n=\"x\""]),
])
def test_grammar_cases(gm, grammar, yes, no):
    r = gm.compile(grammar)
    assert r.startswith("ok"), (grammar, r)
    for t in yes:
        assert gm.match(t), (grammar, t)
    for t in no:
        assert not gm.match(t), (grammar, t)


@pytest.mark.parametrize("grammar,needle", [
    ("start: x", "undefined rule x"),
    ("start: X", "undefined terminal X"),
    ('start: "a"\nstart: "b"', "defined twice"),
    ('x: "a"', "no rule named start"),
    ('start: A\nA: B\nB: A', "refers to itself"),
    ('start: A\nA: "a" start', "cannot refer to the rule"),
    ('start: ""', "empty string"),
    ("start: /a*/", "empty string"),
    ('start: "é"i', "must be ASCII"),
    ("start: /a/x", "the regex flag /.../x is not supported"),
    ("start: /é/i", "must be ASCII"),
    ('%declare X\nstart: "a"', "directive %declare"),
    ('start: "a" %ignore " "', "must start a line"),
    ('%ignore ""\nstart: "a"', "empty string"),
    ('%import foo.BAR\nstart: "a"', "only Lark's common"),
    ('%import common.FOO\nstart: "a"', "common has no terminal FOO"),
    ('%import common.WS -> ws\nstart: "a"', "no terminal name"),
    ('%import common.WS\n%import common.WS\nstart: "a"', "defined twice"),
    ('%llguidance {"allow_invalid_utf8": true}\nstart: "a"', "allow_invalid_utf8 is not"),
    ('%llguidance [1]\nstart: "a"', "JSON object"),
    ("start: <|im_end|>", "needs the model's vocabulary"),
    ("start: <[5-1]>", "expected ids and ranges"),
    ("start: <[0-5000]>", "more than 4096"),
    ('start{x}: "a"', "templates"),
    ('start: x\nx[lazy]: /.*/', "empty string"),
    ('start: x\nx[stop="a"]: /.*/', "suffix= keeps it"),
    ('start: x\nx[max_tokens=5]: /.*/', "x[max_tokens]: the option is not supported"),
    ('start: x\nx[temperature=0.7]: /.*/', "x[temperature]: the option is not supported"),
    ('start: X\nX[lazy]: /a/', "for rules"),
    ('start: x\nx[lazy]: "a" y\ny: "b"', "cannot refer to the rule"),
    ('start: x\nx: %regex {"substring_words": "a b"}', "inline %regex"),
    ('start: X\nX: %json {"type": "string"}', "a terminal cannot hold it"),
    ('start: %json {"type": "strnig"}', "%json: at /type:"),
    ('start: %json {"type": "string"', "expected a JSON object"),
    ("start: @sub", "other grammars"),
    ('start: "a"{3,2}', "out of order"),
    ('start: "a"{}', "expected {n}"),
    ("start: <[42]", "unterminated token terminal"),
    ('start.2: "a"', "priorities"),
    ('start: "a" ~ 5..2', "out of order"),
    ('start: ("a"', "expected ')'"),
    ('start: "a\n', "unterminated string"),
    ("start: /(?=a)b/", "lookaround"),
    ('start: "\\q"', "unsupported escape"),
    ('start: "a" ~ 2000', "above 1000"),
])
def test_grammar_refusals(gm, grammar, needle):
    r = gm.compile(grammar)
    assert r.startswith("err grammar: "), (grammar, r)
    assert needle in r, (grammar, r)
    assert "line " in r, r


def test_highly_ambiguous_grammar(gm):
    # Catalan-many parses of a run of a's: Earley's chart stays cubic
    r = gm.compile('start: x\nx: x x | "a"')
    assert r.startswith("ok"), r
    assert gm.match("a" * 60)
    assert not gm.match("a" * 60 + "b")
