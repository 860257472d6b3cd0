"""Token masks of the grammar engine against llguidance (the PyPI package),
on the default model's vocabulary (SmolLM2, 49k tokens) and on Qwen2's
(152k, from the Qwen2.5-Coder-0.5B file the test command fetches).

llguidance gets its tokenizer from the GGUF file through gguf-py, built
here (each token's bytes decoded from the vocabulary's byte-level
strings; control tokens special; text tokenized by the PyPI `tokenizers`
package from the same vocabulary and merges, which llguidance needs for
its masks), never from bytes Tandem exports. Tandem
computes masks with `tandem grammar masks` from the same file. For each
constraint (Lark grammars both accept, regular expressions, choices, and the
JSON Schemas of tests/grammar/schemas written compactly on both sides), token
prefixes come from random walks through llguidance's own masks (every
step a token it allows, so the walks reach deep states of the constraint)
and from random token sequences (so rejections are compared too). At
every point the two allowed sets must be equal, the end-of-generation
tokens included (Tandem allows all of the model's, llguidance its EOS:
both exactly when the constraint accepts). llguidance runs with
`no_forcing` (see llg_grammar): forced tokens are not compared yet.

Where the sets differ, every token llguidance allows and Tandem does not
must fall in a category of tests/grammar/llguidance-differences.md (where
llguidance admits strings the schema forbids), and such points stay at or
under 0.5% of all."""

import json
import os
import pathlib
import random
import re
import subprocess

import numpy as np
import pytest

from reference_util import byte_decoder, gguf_bpe_tokenizer, kquant_model_path


SEED = 20261207

JSON_LARK = r"""
start: value
value: object | array | STRING | NUMBER | "true" | "false" | "null"
object: "{" [pair ("," pair)*] "}"
pair: STRING ":" value
array: "[" [value ("," value)*] "]"
STRING: /"(?:[^"\\\x00-\x1f]|\\["\\\/bfnrt]|\\u[0-9a-fA-F]{4})*"/
NUMBER: /-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?/
"""

# the same JSON with whitespace between lexemes (%ignore), Lark's common
# terminals (%import), a name with '-', an alias, a {m,n} repetition and a
# case-insensitive literal
JSON_WS_LARK = r"""
%llguidance {"no_forcing": true}
start: value
value: object | array | ESCAPED_STRING | SIGNED_NUMBER | "true"i | "false" | "null"
object: "{" [pair ("," pair){0,6}] "}" -> obj
pair: ESCAPED_STRING ":" value
array: "[" [value ("," value)*] "]"
%import common.ESCAPED_STRING
%import common (SIGNED_NUMBER, WS)
%ignore WS
"""

# a tool call, llguidance's example: free text, or JSON under a schema
# inline (%json; compact through llguidance's x-guidance options, which
# Tandem reads too)
TOOL_LARK = r"""
start: TEXT | fun_call
TEXT: /[^{][\s\S]*/
fun_call: %json {
  "type": "object",
  "properties": {
    "name": {"const": "get_weather"},
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                   "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                   "required": ["city"]}
  },
  "required": ["name", "parameters"],
  "x-guidance": {"whitespace_flexible": false, "item_separator": ",", "key_separator": ":"}
}
"""

# lazy lexemes: a rule with lexeme options ends at its first match
LAZY_LARK = r"""
start: "Thought: " thought "Code:\n" code DONE
thought[capture, suffix="\n"]: /[^\n]*/
code[lazy]: /[\s\S]*\n```/
DONE: "."
"""

CONSTRAINTS = [
    ("lark", JSON_LARK),
    ("lark", LAZY_LARK),
    ("lark", JSON_WS_LARK),
    ("lark", TOOL_LARK),
    # regex flags: i (ASCII letters either case), s ('.' takes line breaks)
    ("lark", 'start: G " " N "!"\nG: /hello|hi|hey/i\nN: /[a-z]+( [a-z]+)?/i\n'
             'S: /x.y/s\nrest: S'),
    ("lark", 'start: "<" B ">"\nB: /[a-z]{1,8}/ | /x.y/s'),
    ("lark", 'start: stmt+\nstmt: CNAME "=" expr ";"\nexpr: term (("+" | "-") term)*\n'
             'term: INT | CNAME | "(" expr ")"\nC: C_COMMENT\n%import common.CNAME\n'
             '%import common.INT\n%import common.C_COMMENT\n%import common.WS_INLINE\n'
             '%ignore WS_INLINE\n%ignore C'),
    ("lark", 'start: "The answer is " ANSWER "."\nANSWER: /yes|no|maybe( not)?/'),
    ("lark", 'start: item ("\\n" item)*\nitem: "- " WORD (" " WORD)*\nWORD: /[A-Za-z]+/'),
    ("lark", 'start: expr\nexpr: expr OP expr | "(" expr ")" | NUM\nOP: /[-+*\\/]/\n'
             'NUM: /[0-9]+/'),
    ("regex", r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]"),
    ("regex", r"(Paris|London|Berlin|[A-Z][a-z]+ City)"),
    # (\\w is ASCII in ECMAScript, Unicode in llguidance's Rust dialect)
    ("regex", r"[A-Za-z0-9_.]+@[a-z0-9]+\.(com|org)"),
    ("regex", r"-?(0|[1-9][0-9]*)(\.[0-9]+)? ?(°C|K)"),
    ("choice", ["yes", "no", "maybe", "yes, but", "né", "\"quoted\"", "a,b"]),
]
# JSON Schemas (tests/grammar/schemas): compact JSON on both sides, the
# separators "," and ":" and no whitespace (llguidance's x-guidance options)
SCHEMA_DIR = pathlib.Path(__file__).resolve().parents[1] / "grammar" / "schemas"
CONSTRAINTS += [("json", p.read_text()) for p in sorted(SCHEMA_DIR.glob("*.json"))]
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def _ends_in_token(pattern):
    """A category test: text (the prefix's bytes and the token's) has a match
    of pattern that ends inside the token's bytes."""
    rx = re.compile(pattern)
    return lambda text, start: any(m.end() > start for m in rx.finditer(text))


def _not_leap(m):
    y = int(m.group(1))
    return not (y % 4 == 0 and (y % 100 != 0 or y % 400 == 0))


def _calendar(text, start):
    return (any(m.end() > start and _not_leap(m) for m in re.finditer(rb"([0-9]{4})-02-29", text))
            or any(m.end() > start for m in re.finditer(rb'"0000', text)))


# Where a token llguidance allows and Tandem does not is expected: the
# headings of tests/grammar/llguidance-differences.md, each with its test
DIFFERENCES = {
    "leap-second": _ends_in_token(rb"[0-9]{2}:[0-5][0-9]:6"),
    "calendar-date": _calendar,
}
# and the other way: a token Tandem allows and llguidance does not (a number
# between an integer exclusive bound and the next integer, with a fraction
# ending in 0, ended by the token)
WIDER = {
    "exclusive-bound-zero": _ends_in_token(rb"(?<![0-9.])-?0\.[0-9]*0[^0-9.eE]"),
}
DIFF_FILE = pathlib.Path(__file__).resolve().parents[1] / "grammar" / "llguidance-differences.md"
DIFF_SHARE = 0.005
# walks per constraint: 12 in CI (about 6,500 points per vocabulary);
# TANDEM_ORACLE_WALKS raises it; test_grammar_llguidance_nightly.py runs 40
# (over 20,000 per vocabulary)
WALKS = int(os.environ.get("TANDEM_ORACLE_WALKS", "12"))
WALK_LEN = 24
RANDOM_PREFIXES = 20


class GGUFTokenizer:
    """What llguidance's TokenizerWrapper needs, from the GGUF metadata."""

    def __init__(self, path):
        import gguf
        r = gguf.GGUFReader(str(path))

        def field(k):
            f = r.fields[k]
            return [f.parts[i] for i in f.data]
        assert bytes(field("tokenizer.ggml.model")[0]).decode() == "gpt2"
        toks = [bytes(t).decode() for t in field("tokenizer.ggml.tokens")]
        types = [int(t[0]) for t in field("tokenizer.ggml.token_type")]
        dec = byte_decoder()
        self.tokens = []
        self.special_token_ids = []
        for i, (t, ty) in enumerate(zip(toks, types)):
            if ty == 3:  # CONTROL
                self.special_token_ids.append(i)
                self.tokens.append(t.encode())
            else:
                self.tokens.append(bytes(dec[c] for c in t))
        self.eos_token_id = int(field("tokenizer.ggml.eos_token_id")[0][0])
        self.bos_token_id = None
        self.bpe = gguf_bpe_tokenizer(path)

    def __call__(self, s):
        if isinstance(s, bytes):
            s = s.decode("utf-8", errors="replace")
        return self.bpe.encode(s).ids


@pytest.fixture(scope="module", params=["smollm2", "qwen2"])
def vocab(request, default_model):
    import llguidance
    path = default_model if request.param == "smollm2" else kquant_model_path()
    gt = GGUFTokenizer(path)
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(gt))
    return path, gt, tok


def llg_grammar(kind, text):
    """llguidance's grammar for a constraint, with its forcing turned off:
    where the grammar forces bytes, llguidance's default mask is the one
    token of their canonical tokenization; Tandem has no forced tokens yet
    and allows every token the bytes admit, as llguidance does with
    no_forcing."""
    import llguidance
    if kind == "json":
        schema = json.loads(text)
        schema["x-guidance"] = COMPACT
        lark = "start: %json " + json.dumps(schema)
    else:
        lark = (text if kind == "lark" else f"start: /{text}/" if kind == "regex" else
                "start: " + " | ".join(json.dumps(c) for c in text))
    if "%llguidance" not in lark:
        lark = '%llguidance {"no_forcing": true}\n' + lark
    return llguidance.grammar_from("lark", lark)


def tandem_masks(tandem_bin, model, kind, text, prefixes, tmp_path):
    p = tmp_path / "prefixes.json"
    p.write_text(json.dumps({"prefixes": prefixes}))
    out = tmp_path / "masks.txt"
    args = [str(tandem_bin), "grammar", "masks", "--model", str(model), "--prefixes", str(p),
            "--out", str(out), "--forced"]
    if kind in ("lark", "json"):
        g = tmp_path / "g.txt"
        g.write_text(text)
        args += ["--grammar" if kind == "lark" else "--json-schema", str(g)]
    elif kind == "regex":
        args += ["--regex", text]
    else:
        args += ["--choice", ",".join(c.replace("\\", "\\\\").replace(",", "\\,") for c in text)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = out.read_text().splitlines()
    assert len(lines) == len(prefixes)
    return lines


def allowed_from_hex(h, n):
    """Tandem's mask line as one bool per token."""
    bits = np.unpackbits(np.frombuffer(bytes.fromhex(h), dtype=np.uint8), bitorder="little")
    return bits[:n].astype(bool)


def llg_allowed(m, n):
    """llguidance's mask as one bool per token."""
    mask = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
    return np.unpackbits(mask, bitorder="little")[:n].astype(bool)


def test_masks_equal_llguidance(tandem_bin, vocab, tmp_path):
    points = compare_masks(tandem_bin, vocab, tmp_path, WALKS)
    assert points >= 1500, points


def compare_masks(tandem_bin, vocab, tmp_path, walks):
    """The comparison over every constraint, with `walks` random walks
    each; returns the points compared."""
    import llguidance
    model, gt, tok = vocab
    n = len(gt.tokens)
    special = np.zeros(n, dtype=bool)
    special[gt.special_token_ids] = True
    rng = random.Random(SEED)

    def end_by_other_eog(m0, seq, line):
        """The end spelled by another of the model's end-of-generation
        tokens (Tandem ends on each, llguidance on its EOS only): the last
        token is a control token, llguidance takes everything before it and
        would take its EOS there, and Tandem takes the end and then allows
        nothing."""
        if not seq or not special[seq[-1]] or seq[-1] == gt.eos_token_id:
            return False
        if not line.startswith("ok ") or allowed_from_hex(line[3:].split(" ")[0], n).any():
            return False
        m = m0.deep_copy()
        return all(m.consume_token(t) for t in seq[:-1]) and bool(llg_allowed(m, n)[gt.eos_token_id])

    points = 0
    differing = {}  # category: points
    forced_points = 0
    refused = set()
    listed = re.findall(r"^## ([a-z-]+)$", DIFF_FILE.read_text(), re.M)
    assert set(DIFFERENCES) | set(WIDER) <= set(listed), (sorted(DIFFERENCES), listed)
    for kind, text in CONSTRAINTS:
        grammar = llg_grammar(kind, text)
        m0 = llguidance.LLMatcher(tok, grammar, log_level=0)
        assert not m0.is_error(), m0.get_error()
        prefixes = []
        for _ in range(walks):  # walks through llguidance's masks
            m = m0.deep_copy()
            seq = []
            for _ in range(WALK_LEN):
                prefixes.append(list(seq))
                allowed = np.nonzero(llg_allowed(m, n) & ~special)[0]
                if not len(allowed):
                    break
                t = int(allowed[rng.randrange(len(allowed))])
                assert m.consume_token(t), m.get_error()
                seq.append(t)
        for _ in range(RANDOM_PREFIXES):  # mostly rejected somewhere
            base = rng.choice(prefixes)
            prefixes.append(base + [rng.randrange(n) for _ in range(rng.randrange(1, 3))])
        lines = tandem_masks(tandem_bin, model, kind, text, prefixes, tmp_path)
        for seq, line in zip(prefixes, lines):
            m = m0.deep_copy()
            ok = all(m.consume_token(t) for t in seq)
            if not ok and end_by_other_eog(m0, seq, line):
                points += 1
                continue
            if not ok:
                assert line.startswith("reject "), (kind, text, seq, line[:40])
                points += 1
                continue
            if line.startswith("reject "):
                # a walk that went on past a listed difference: the token
                # Tandem refuses must be one; the walk's later prefixes are
                # past it (one point per refused prefix)
                k = int(line.split()[1])
                if tuple(seq[:k + 1]) in refused:
                    continue
                refused.add(tuple(seq[:k + 1]))
                prefix = b"".join(gt.tokens[t] for t in seq[:k])
                cat = next((c for c, f in DIFFERENCES.items()
                            if f(prefix + gt.tokens[seq[k]], len(prefix))), None)
                assert cat, (kind, text, seq, line)
                differing[cat] = differing.get(cat, 0) + 1
                points += 1
                continue
            assert line.startswith("ok "), (kind, text, seq, line[:40])
            hexmask, ff, ft = line[3:].split(" ")
            # the forced bytes: llguidance's fast-forward bytes
            assert ff.startswith("ff=") and ft.startswith("ft="), line[-80:]
            ours_ff = bytes.fromhex(ff[3:])
            assert ours_ff == bytes(m.compute_ff_bytes()), (kind, text, seq, ours_ff,
                                                            m.compute_ff_bytes())
            # the forced tokens: their bytes start the forced bytes (the
            # tokenization is each tokenizer's own, so only that is compared)
            ft_ids = [int(x) for x in ft[3:].split(",") if x]
            assert ours_ff.startswith(b"".join(gt.tokens[t] for t in ft_ids)), (kind, seq, ft_ids)
            forced_points += bool(ours_ff)
            ours = allowed_from_hex(hexmask, n)
            theirs = llg_allowed(m, n)
            # the end of generation: llguidance's EOS, Tandem's whole EOG set
            # (control tokens): allowed exactly when llguidance allows its EOS
            eos_ok = bool(theirs[gt.eos_token_id])
            assert bool(ours[gt.eos_token_id]) == eos_ok, (kind, text, seq)
            assert eos_ok or not (ours & special).any(), (kind, text, seq)
            assert not (theirs & special & ~ours).any() or not eos_ok, (kind, text, seq)
            diff = np.nonzero((ours ^ theirs) & ~special)[0]
            points += 1
            if not len(diff):
                continue
            # only tokens llguidance admits, each in a listed category
            prefix = b"".join(gt.tokens[t] for t in seq)
            cats = set()
            for i in diff:
                cat = next((c for c, f in (WIDER if ours[i] else DIFFERENCES).items()
                            if f(prefix + gt.tokens[i], len(prefix))), None)
                assert cat, (kind, text, seq, prefix, int(i), gt.tokens[i], bool(ours[i]))
                cats.add(cat)
            for c in cats:
                differing[c] = differing.get(c, 0) + 1
    n_diff = sum(differing.values())
    print(f"{points} (constraint, prefix) points compared with llguidance's; "
          f"{points - n_diff} equal, the others in listed categories: {differing}; "
          f"forced bytes equal at every point, {forced_points} of them non-empty")
    assert n_diff <= DIFF_SHARE * points, (differing, points)
    return points


def test_token_terminal_against_llguidance(tandem_bin, vocab, tmp_path):
    """A grammar that requires a special token (<|im_start|>, a control
    token in both vocabularies) then text: the mask at the start is that
    token alone on both sides; after it, the forced text is the same bytes
    and llguidance's forced token is in Tandem's mask; past it, the masks
    over the free word are equal. llguidance runs with its forcing here
    (with no_forcing its mask leaves special tokens out)."""
    import llguidance
    model, gt, tok = vocab
    n = len(gt.tokens)
    lark = 'start: <|im_start|> "assistant\\n" WORD\nWORD: /[a-z]+/'
    special = np.zeros(n, dtype=bool)
    special[gt.special_token_ids] = True
    im_start = next(i for i in gt.special_token_ids if gt.tokens[i] == b"<|im_start|>")
    m = llguidance.LLMatcher(tok, llguidance.grammar_from("lark", lark), log_level=0)
    assert not m.is_error(), m.get_error()
    # (llguidance also admits a text token holding byte 0xFF there, the
    # first byte of its own spelling of special tokens; Tandem admits no
    # token with 0xFF, which no UTF-8 text holds)
    ff_tokens = np.array([b"\xff" in t for t in gt.tokens])
    theirs = llg_allowed(m, n) & ~ff_tokens
    assert list(np.nonzero(theirs)[0]) == [im_start]
    assert m.consume_token(im_start)
    forced = bytes(m.compute_ff_bytes())
    llg_first = int(np.nonzero(llg_allowed(m, n))[0][0])
    word = [t for t in gt.bpe.encode("hello").ids]
    prefixes = [[], [im_start]]
    seq = [im_start] + gt.bpe.encode("assistant\n").ids
    prefixes += [seq + word[:k] for k in range(len(word) + 1)]
    lines = tandem_masks(tandem_bin, model, "lark", lark, prefixes, tmp_path)
    ours0 = allowed_from_hex(lines[0].split()[1], n)
    assert list(np.nonzero(ours0)[0]) == [im_start]
    assert lines[0].split()[3].startswith(f"ft={im_start}")
    ff1 = bytes.fromhex(lines[1].split()[2][3:])
    assert ff1 == forced == b"assistant\n", (ff1, forced)
    assert allowed_from_hex(lines[1].split()[1], n)[llg_first]
    for t in seq[1:]:
        assert m.consume_token(t)
    for k, line in enumerate(lines[2:]):
        ours = allowed_from_hex(line.split()[1], n)
        theirs = llg_allowed(m, n)
        diff = np.nonzero((ours ^ theirs) & ~special)[0][:10]
        assert not len(diff), (k, [(int(i), gt.tokens[i]) for i in diff])
        # (at the end, Tandem allows the model's whole end-of-generation
        # set, llguidance its EOS)
        assert not (ours & special & ~theirs).any() or theirs[gt.eos_token_id]
        if k < len(word):
            assert m.consume_token(word[k])
