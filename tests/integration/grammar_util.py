"""The grammar tests' driver: td-grammar-match (tests/bench/grammar_match.c)
as one process a module talks to line by line."""

import subprocess


class GrammarMatch:
    """Patterns (P, B, N) and Lark grammars (G) in, texts (S) matched."""

    def __init__(self, build_dir):
        assert build_dir is not None, "TANDEM_BUILD_DIR is not set"
        exe = build_dir / "td-grammar-match"
        assert exe.exists(), f"{exe} is missing: build the td-grammar-match target"
        self.p = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)

    def ask(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        out = self.p.stdout.readline()
        assert out, f"td-grammar-match exited ({self.p.poll()}) on {line[:200]!r}"
        return out.rstrip("\n")

    def compile(self, pattern, search=False, flags=0):
        """flags: regex.h's TD_RX_ICASE (2) and TD_RX_DOTALL (4)."""
        return self.ask(f"P {int(search) | flags} {pattern.encode().hex()}")

    def both(self, a, b, search=False):
        return self.ask(f"B {int(search)} {a.encode().hex()} {b.encode().hex()}")

    def complement(self, pattern, search=False):
        return self.ask(f"N {int(search)} {pattern.encode().hex()}")

    def grammar(self, text):
        return self.ask(f"G {text.encode().hex()}")

    def schema(self, text):
        """A JSON Schema (text) as the grammar."""
        return self.ask(f"J {text.encode().hex()}")

    def match(self, text):
        """The text matches (a grammar: every byte taken and accepting)."""
        data = text if isinstance(text, bytes) else text.encode()
        r = self.ask(f"S {data.hex()}")
        assert r in ("0", "1") or r.startswith("0 "), r
        return r == "1"

    def close(self):
        self.p.stdin.close()
        rc = self.p.wait(timeout=10)
        self.p.stdout.close()
        assert rc == 0, rc
