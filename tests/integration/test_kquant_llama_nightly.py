"""Tandem against llama.cpp on the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M
file (label nightly: needs a llama.cpp build, which CI never makes).

The same token ids through both engines, teacher-forced: at least 512
tokens of ordinary English prose (the opening of the GNU GPL v3 as Debian
ships it, /usr/share/common-licenses/GPL-3), tokenized independently of
both engines with the PyPI `tokenizers` package from the GGUF's vocabulary
and merges. llama.cpp's logits come from tests/reference/llama_logits.c,
built here against the libllama of a llama.cpp build
($LLAMA_CPP_DIR, default ~/.cache/tandem-peer/llama.cpp: the source tree
in src/ and a CMake build of it in build/, whose bin/ holds libllama.so);
Tandem's from `tandem eval`, with f32 activations (the default) and with
--act-int8; both engines keep an f32 KV cache. The float64 reference
(tests/reference) computes the same positions from the dequantized weights.

Bars: mean KL(llama.cpp || Tandem) <= 0.02 nats over the full vocabulary
(the K-quant issue's), and top-1 agreement >= 98% at the positions whose
top-1/top-2 margin (Tandem's logits) exceeds MARGIN. The two engines round
differently: llama.cpp quantizes the activations to 8 bits for its
quantized dot products, Tandem keeps them in f32 (24-bit fixed point per
256 elements for the K-quant rows on AMX CPUs). With f32 activations
Tandem's top-1 must equal the float64 reference's at >= 99.5% of the
positions; llama.cpp's agreement with the reference is printed beside it,
and the raw Tandem/llama.cpp agreement cannot exceed what llama.cpp's
rounding leaves. Measured on this text (2026-12-06, 600 positions, Intel
with AMX): mean KL 0.0028, raw top-1 agreement 97.3% (98.3% on the
Apache-2.0 text), every disagreement at a margin of at most 0.21 logits;
Tandem's top-1 equals the float64 reference's at all 600 positions,
llama.cpp's at 97.3%: the 16 flips are llama.cpp's. So the issue's raw 98%
is not met on this text by any engine that computes exactly, and the test
asserts it where the margin is clear of that rounding. With --act-int8 Tandem rounds
its activations too, but per 32 elements where llama.cpp rounds a K row's
per 256: mean KL 0.0029, raw top-1 97.2%, no closer."""

import os
import pathlib
import subprocess

import sys

import numpy as np
import pytest

from reference_util import gguf_bpe_tokenizer, kquant_model_path as model_path

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "reference"))
import reference as R  # noqa: E402

LLAMA = pathlib.Path(os.environ.get("LLAMA_CPP_DIR",
                                    os.path.expanduser("~/.cache/tandem-peer/llama.cpp")))
TEXT = pathlib.Path("/usr/share/common-licenses/GPL-3")
MIN_TOKENS = 512
MARGIN = 0.25  # logits: above the largest flip measured (0.21), see the docstring
REF_TOP1 = 0.995  # Tandem (f32 activations) against the float64 reference


def build_dump_tool(tmp_path):
    lib = LLAMA / "build" / "bin" / "libllama.so"
    if not lib.exists():
        pytest.skip(f"no llama.cpp build at {LLAMA} (its build/bin/libllama.so)")
    src = pathlib.Path(__file__).resolve().parents[1] / "reference" / "llama_logits.c"
    exe = tmp_path / "llama_logits"
    subprocess.run(["cc", "-O2", "-o", str(exe), str(src), f"-I{LLAMA}/src/include",
                    f"-I{LLAMA}/src/ggml/include", f"-L{lib.parent}", "-lllama",
                    f"-Wl,-rpath,{lib.parent}"], check=True)
    return exe


def log_softmax(z):
    z = z.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


@pytest.mark.parametrize("mode", ["f32-act", "act-int8"])
def test_qwen_q4_k_m_agrees_with_llama_cpp(tandem_eval, tmp_path, mode):
    path = model_path()
    exe = build_dump_tool(tmp_path)
    text = TEXT.read_text()[:4000]
    tk = gguf_bpe_tokenizer(path)
    ids = tk.encode(text).ids
    assert len(ids) >= MIN_TOKENS, len(ids)
    ids = ids[:600]
    tok = tmp_path / "tokens.i32"
    np.asarray(ids, dtype="<i4").tofile(tok)
    out = tmp_path / "llama.f32"
    subprocess.run([str(exe), str(path), str(tok), str(out), "2"], check=True,
                   capture_output=True, timeout=900)
    b = np.fromfile(out, dtype="<f4")
    extra = ("--kv-dtype", "f32") + (("--act-int8",) if mode == "act-int8" else ())
    (a,) = tandem_eval(str(path), [ids], timeout=900, extra=extra)
    b = b.reshape(len(ids), -1)
    assert a.shape == b.shape, (a.shape, b.shape)
    lp, lq = log_softmax(b), log_softmax(a)  # p: llama.cpp, q: Tandem
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1)
    same = a.argmax(axis=1) == b.argmax(axis=1)
    srt = np.sort(a, axis=1)
    clear = (srt[:, -1] - srt[:, -2]) > MARGIN
    top1, top1_clear = float(same.mean()), float(same[clear].mean())
    msg = (f"{mode}: {len(ids)} positions: top-1 agreement {top1:.4f} ({top1_clear:.4f} at the "
           f"{int(clear.sum())} with a margin over {MARGIN}), mean KL {kl.mean():.5f}, "
           f"max KL {kl.max():.4f}")
    print(msg)
    assert kl.mean() <= 0.02, msg
    assert clear.sum() >= len(ids) // 2, msg
    assert top1_clear >= 0.98, msg
    if mode != "f32-act":
        return
    r = R.forward(R.load(str(path)), ids, kv_dtype="f32")
    t_ref = float((a.argmax(axis=1) == r.argmax(axis=1)).mean())
    l_ref = float((b.argmax(axis=1) == r.argmax(axis=1)).mean())
    msg = (f"top-1 agreement with the float64 reference: Tandem {t_ref:.4f}, "
           f"llama.cpp {l_ref:.4f}")
    print(msg)
    assert t_ref >= REF_TOP1, msg
