"""Shared by the suites that hold a real model's logits to the float64
reference (tests/reference) or to a peer: the real files' paths, a
tokenizer built from a GGUF's own vocabulary and merges, and the logits
check."""

import os
import pathlib

import numpy as np
import pytest

KQUANT_MODEL = "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"


def kquant_model_path():
    """The real Qwen2.5-Coder-0.5B-Instruct Q4_K_M file that
    scripts/fetch-test-models.sh puts in the model cache."""
    d = os.environ.get("TANDEM_MODEL_DIR") or os.path.expanduser("~/.cache/tandem/models")
    p = pathlib.Path(d) / KQUANT_MODEL
    if not p.exists():
        pytest.skip(f"{p} is missing: scripts/fetch-test-models.sh fetches it")
    return p


def gguf_bpe_tokenizer(path):
    """A byte-level BPE tokenizer of the PyPI `tokenizers` package made from
    the GGUF file's vocabulary and merges, independent of Tandem's; the
    <|...|> tokens are special. GPT-2's pre-tokenizer split: equal to the
    models' own on plain text without digits."""
    import gguf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    r = gguf.GGUFReader(str(path))
    toks = r.fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ", 1)) for m in r.fields["tokenizer.ggml.merges"].contents()]
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(toks)}, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([t for t in toks if t.startswith("<|") and t.endswith("|>")])
    return tk


def check_logits(a, b, what, tol, mean_tol, delta, min_checked):
    """The engine's logits a against the reference's b, both (positions,
    n_vocab): rel_t = max|a-b| / max|b| <= tol at every position and <=
    mean_tol on average; at every position whose reference top-1/top-2
    margin exceeds delta * max|b|, the same argmax, and at least
    min_checked such positions."""
    rel = np.abs(a - b).max(axis=1) / np.abs(b).max(axis=1)
    msg = f"{what}: max rel {rel.max():.3g} at position {int(rel.argmax())}, mean {rel.mean():.3g}"
    print(msg)
    assert rel.max() <= tol, msg
    assert rel.mean() <= mean_tol, msg
    bad, checked = [], 0
    for t in range(a.shape[0]):
        srt = np.sort(b[t])
        if srt[-1] - srt[-2] <= delta * np.abs(b[t]).max():
            continue
        checked += 1
        if np.argmax(a[t]) != np.argmax(b[t]):
            bad.append((t, int(np.argmax(a[t])), int(np.argmax(b[t]))))
    assert not bad, f"argmax disagreements (t, engine, ref): {bad}"
    assert checked >= min_checked, f"only {checked} positions clear delta"


def byte_decoder():
    """Byte-level BPE (GPT-2's encoder): each printable character of a
    vocabulary string -> the byte it stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}
