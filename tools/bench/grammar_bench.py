#!/usr/bin/env python3
"""Structured-output speed: Tandem's grammar engine against llguidance (the
PyPI package) on the same JSON Schemas, the same documents and the same
vocabulary, in one run.

For each DIR/NAME.json the documents are DIR/NAME.jsonl (one JSON text a
line). Tandem: `tandem grammar bench --json` (compile each schema, walk each
document token by token, timing the mask before every token and after the
last). llguidance: the same schemas (compact JSON: x-guidance with no
whitespace, "," and ":"), an LLMatcher per schema (its construction, the
grammar's compile, timed), the same documents tokenized from the same GGUF
vocabulary (gguf-py, as the oracle test builds it), walked along the token
ids Tandem's tokenizer gives each document (`--tokens-out`), compute_bitmask
timed before every token and after the last.

    python3 tools/bench/grammar_bench.py --tandem build/tandem \\
        --model ~/.cache/tandem/models/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf \\
        --schemas tests/grammar/schemas --rounds 3 --out docs/bench/cpu/grammar-bench-X.json

--make-docs N writes N documents per schema first (llguidance random walks,
biased toward closing strings and containers, each checked with the
`jsonschema` package and its FormatChecker)."""

import argparse
import importlib.metadata
import json
import pathlib
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "integration"))

COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def llg_grammar(schema_text):
    import llguidance
    schema = json.loads(schema_text)
    schema["x-guidance"] = COMPACT
    return llguidance.grammar_from("json_schema", json.dumps(schema))


def make_docs(tok, gt, schemas, n, seed):
    import jsonschema
    import llguidance
    import numpy as np
    rng = random.Random(seed)
    size = len(gt.tokens)
    closers = np.array([len(t) > 0 and t[:1] in (b'"', b",", b"}", b"]") for t in gt.tokens])
    for path in schemas:
        schema = json.loads(path.read_text())
        v = jsonschema.Draft202012Validator(
            schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        m0 = llguidance.LLMatcher(tok, llg_grammar(path.read_text()), log_level=0)
        docs, tries = [], 0
        while len(docs) < n and tries < 50 * n:
            tries += 1
            m, out = m0.deep_copy(), []
            for _ in range(400):
                mask = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8),
                                     bitorder="little")[:size].astype(bool)
                if mask[gt.eos_token_id] and (rng.random() < 0.5 or mask.sum() == 1):
                    break
                mask[gt.special_token_ids] = False
                pick = np.nonzero(mask & closers)[0] if rng.random() < 0.35 else []
                if not len(pick):
                    pick = np.nonzero(mask)[0]
                if not len(pick):
                    break
                t = int(pick[rng.randrange(len(pick))])
                m.consume_token(t)
                out.append(t)
            if not m.is_accepting():
                continue
            text = b"".join(gt.tokens[t] for t in out).decode("utf-8", errors="strict")
            if v.is_valid(json.loads(text)):
                docs.append(text)
        path.with_suffix(".jsonl").write_text("".join(d + "\n" for d in docs))
        print(f"{path.name}: {len(docs)} documents", file=sys.stderr)


def pct99(xs):
    xs = sorted(xs)
    k = max(1, int(len(xs) * 0.99 + 0.999999))
    return xs[k - 1]


def run_llguidance(tok, schemas, token_ids):
    import llguidance
    rows, all_masks, comp = [], [], []
    for path in schemas:
        g = llg_grammar(path.read_text())
        t0 = time.perf_counter()
        m0 = llguidance.LLMatcher(tok, g, log_level=0)
        ct = time.perf_counter() - t0
        assert not m0.is_error(), m0.get_error()
        comp.append(ct)
        masks = []
        for ids in token_ids[path.name]:
            m = m0.deep_copy()
            for i in range(len(ids) + 1):
                t0 = time.perf_counter()
                m.compute_bitmask()
                masks.append(time.perf_counter() - t0)
                if i < len(ids):
                    assert m.consume_token(ids[i]), (path.name, i)
            assert m.is_accepting(), (path.name, ids)
        all_masks += masks
        rows.append({"name": path.name, "compile_ms": ct * 1e3, "masks": len(masks),
                     "mask_mean_us": statistics.fmean(masks) * 1e6,
                     "mask_p99_us": pct99(masks) * 1e6, "mask_max_us": max(masks) * 1e6})
    return {"schemas": rows, "masks": len(all_masks),
            "mask_mean_us": statistics.fmean(all_masks) * 1e6,
            "mask_p99_us": pct99(all_masks) * 1e6, "mask_max_us": max(all_masks) * 1e6,
            "compile_median_ms": statistics.median(comp) * 1e3,
            "compile_p99_ms": pct99(comp) * 1e3}


def run_xgrammar(gt, schemas, token_ids):
    """xgrammar on the same vocabulary (raw token bytes; control tokens as
    empty strings, which it never admits), compact JSON (no whitespace, ","
    and ":"), strict_mode off (JSON Schema's own defaults for additional
    properties and items), one thread, no compile cache. A document whose
    token xgrammar refuses ends its walk there, counted in "refused"."""
    import xgrammar as xgr
    special = set(gt.special_token_ids)
    vocab = [b"" if i in special else t for i, t in enumerate(gt.tokens)]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab),
                             stop_token_ids=[gt.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    rows, all_masks, comp, refused = [], [], [], 0
    for path in schemas:
        text = path.read_text()
        t0 = time.perf_counter()
        cg = compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"),
                                          strict_mode=False)
        comp.append(time.perf_counter() - t0)
        masks, refused0 = [], refused
        for ids in token_ids[path.name]:
            m = xgr.GrammarMatcher(cg)
            for i in range(len(ids) + 1):
                t0 = time.perf_counter()
                m.fill_next_token_bitmask(bitmask)
                masks.append(time.perf_counter() - t0)
                if i < len(ids) and not m.accept_token(ids[i]):
                    refused += 1
                    break
        all_masks += masks
        rows.append({"name": path.name, "compile_ms": comp[-1] * 1e3, "masks": len(masks),
                     "refused": refused - refused0, "mask_mean_us": statistics.fmean(masks) * 1e6,
                     "mask_p99_us": pct99(masks) * 1e6, "mask_max_us": max(masks) * 1e6})
    return {"schemas": rows, "masks": len(all_masks), "refused": refused,
            "mask_mean_us": statistics.fmean(all_masks) * 1e6,
            "mask_p99_us": pct99(all_masks) * 1e6, "mask_max_us": max(all_masks) * 1e6,
            "compile_median_ms": statistics.median(comp) * 1e3,
            "compile_p99_ms": pct99(comp) * 1e3}


def run_tandem(tandem, model, schema_dir, tokens_out):
    r = subprocess.run([str(tandem), "grammar", "bench", "--model", str(model), "--schemas",
                        str(schema_dir), "--json", "--tokens-out", str(tokens_out)],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--model", required=True, help="GGUF file whose vocabulary both use")
    ap.add_argument("--schemas", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--make-docs", type=int, default=0)
    ap.add_argument("--seed", type=int, default=20261207)
    ap.add_argument("--xgrammar", action="store_true",
                    help="xgrammar too (needs torch: run with a Python that has it)")
    ap.add_argument("--out")
    a = ap.parse_args()
    import llguidance
    from test_grammar_llguidance import GGUFTokenizer
    gt = GGUFTokenizer(pathlib.Path(a.model))
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(gt))
    schema_dir = pathlib.Path(a.schemas)
    schemas = sorted(schema_dir.glob("*.json"))
    if a.make_docs:
        make_docs(tok, gt, schemas, a.make_docs, a.seed)
    td, lg, xg = [], [], []
    ids_file = pathlib.Path(tempfile.mkdtemp()) / "ids.json"
    for _ in range(a.rounds):  # alternated, medians taken
        td.append(run_tandem(a.tandem, a.model, schema_dir, ids_file))
        # the same token ids on both sides: Tandem's tokenization of each
        # document (the `tokenizers` BPE the oracle builds uses GPT-2's
        # pre-tokenizer, not Qwen2's, and splits some texts differently)
        lg.append(run_llguidance(tok, schemas, json.loads(ids_file.read_text())))
        if a.xgrammar:
            xg.append(run_xgrammar(gt, schemas, json.loads(ids_file.read_text())))
    assert td[0]["masks"] == lg[0]["masks"], ("token counts differ", td[0]["masks"], lg[0]["masks"])

    def med(runs, key):
        return statistics.median(r[key] for r in runs)

    keys = ["mask_mean_us", "mask_p99_us", "mask_max_us", "compile_median_ms", "compile_p99_ms"]
    summary = {
        "machine": platform.processor() or platform.machine(),
        "vocab_size": len(gt.tokens), "schemas": len(schemas), "masks": td[0]["masks"],
        "rounds": a.rounds, "llguidance_version": llguidance.__version__,
        "tandem": {k: med(td, k) for k in keys}, "llguidance": {k: med(lg, k) for k in keys},
        **({"xgrammar": {**{k: med(xg, k) for k in keys}, "masks": xg[-1]["masks"],
                         "refused_documents": xg[-1]["refused"]},
            "xgrammar_version": importlib.metadata.version("xgrammar")} if xg else {}),
        "per_schema": [
            {"name": t["name"],
             **{f"tandem_{k}": t[k] for k in ("compile_ms", "mask_mean_us", "mask_p99_us")},
             **{f"llguidance_{k}": g[k] for k in ("compile_ms", "mask_mean_us", "mask_p99_us")},
             **({f"xgrammar_{k}": xg[-1]["schemas"][i][k]
                 for k in ("compile_ms", "mask_mean_us", "mask_p99_us", "refused")} if xg else {})}
            for i, (t, g) in enumerate(zip(td[-1]["schemas"], lg[-1]["schemas"]))],
    }
    s = summary
    print(f"{s['schemas']} schemas, {s['masks']} masks over {s['vocab_size']} tokens, "
          f"median of {a.rounds} rounds")
    print(f"{'':22} {'Tandem':>10} {'llguidance':>11} {'ratio':>7}")
    for k in keys:
        t, g = s["tandem"][k], s["llguidance"][k]
        x = f" xgrammar {s['xgrammar'][k]:10.1f} ratio {t / s['xgrammar'][k]:6.2f}" if xg else ""
        print(f"{k:22} {t:10.1f} {g:11.1f} {t / g:7.2f}{x}")
    if xg:
        print(f"xgrammar: {s['xgrammar']['masks']} masks, "
              f"{s['xgrammar']['refused_documents']} documents refused")
    print(f"{'schema':20} {'td mean us':>10} {'llg mean':>9} {'td p99':>8} {'llg p99':>8} "
          f"{'td comp ms':>10} {'llg comp':>9}")
    for r in s["per_schema"]:
        print(f"{r['name']:20} {r['tandem_mask_mean_us']:10.1f} {r['llguidance_mask_mean_us']:9.1f} "
              f"{r['tandem_mask_p99_us']:8.1f} {r['llguidance_mask_p99_us']:8.1f} "
              f"{r['tandem_compile_ms']:10.2f} {r['llguidance_compile_ms']:9.2f}")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
