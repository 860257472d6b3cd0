#!/usr/bin/env python3
"""Top-1 agreement of Tandem, llama.cpp and the float64 reference on the
real Qwen2.5-Coder-0.5B-Instruct Q4_K_M file, text by text, for the K-quant
issue's "top-1 >= 98% against llama.cpp" bar (docs/PERFORMANCE.md).

    python3 tools/bench/kquant_top1_texts.py --tandem build/tandem \\
        [--llama-cpp ~/.cache/tandem-peer/llama.cpp] [--out FILE] [TEXT ...]

For each plain-text file: its first 600 tokens (tokenized with the PyPI
`tokenizers` package from the GGUF's own vocabulary, as the nightly test
does), teacher-forced through `tandem eval` (f32 activations, f32 KV
cache), through llama.cpp (tests/reference/llama_logits.c linked against
its libllama, f32 KV cache) and through the float64 reference
(tests/reference). Prints, per text and in total, how often each pair's
top-1 tokens agree. Without TEXT arguments it reads the Debian licence
texts and README files listed in DEFAULT_TEXTS.

--emulate-llama-act also runs the reference with llama.cpp's activation
rounding (q8_K per 256 elements for the K-quant rows, q8_0 with an fp16
scale for the Q5_0/Q8_0 rows), to show how much of llama.cpp's distance
from the exact result that rounding explains.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

HERE = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(HERE / "tests" / "reference"))
sys.path.insert(0, str(HERE / "tests" / "integration"))
import reference as R  # noqa: E402
from reference_util import KQUANT_MODEL, gguf_bpe_tokenizer  # noqa: E402

DEFAULT_TEXTS = [
    "/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0",
    "/usr/share/common-licenses/MPL-2.0", "/usr/share/common-licenses/Artistic",
    "/usr/share/common-licenses/GFDL-1.3", "/usr/share/common-licenses/LGPL-2.1",
    "/usr/share/doc/python3-dbus/README", "/usr/share/doc/python3-dev/README.Debian",
    "/usr/share/doc/python3-distutils/README.Debian", "/usr/share/doc/python3-httplib2/README.md",
    "/usr/share/doc/python3-jwt/README.rst", "/usr/share/doc/python3-pip/README.Debian",
]
N_TOKENS = 600


def q8_k(x):
    """llama.cpp's quantize_row_q8_K_ref on f32 rows, dequantized: per 256
    elements iscale = -127 / (the element of largest magnitude), q =
    round-to-even(iscale * x) capped at 127, d = 1 / iscale."""
    shp = x.shape
    xb = x.astype(np.float32).reshape(-1, 256)
    mx = xb[np.arange(len(xb)), np.abs(xb).argmax(axis=1)]
    out = np.zeros(xb.shape, dtype=np.float64)
    nz = mx != 0
    isc = (np.float32(-127.0) / mx[nz]).astype(np.float32)
    q = np.minimum(np.rint((isc[:, None] * xb[nz]).astype(np.float32)), 127)
    out[nz] = q * (np.float32(1.0) / isc).astype(np.float64)[:, None]
    return out.reshape(shp)


def q8_0_fp16(x):
    """llama.cpp's x86 quantize_row_q8_0: per 32 elements d = amax / 127,
    q = round-to-even(x / d) in f32, d stored as fp16."""
    shp = x.shape
    xb = x.astype(np.float32).reshape(-1, 32)
    d = (np.abs(xb).max(axis=1) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint((xb * inv[:, None]).astype(np.float32))
    return (q * d.astype(np.float16).astype(np.float64)[:, None]).reshape(shp)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--llama-cpp", default=os.path.expanduser("~/.cache/tandem-peer/llama.cpp"))
    ap.add_argument("--model", default=os.path.join(
        os.environ.get("TANDEM_MODEL_DIR") or os.path.expanduser("~/.cache/tandem/models"),
        KQUANT_MODEL))
    ap.add_argument("--emulate-llama-act", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("texts", nargs="*")
    a = ap.parse_args()
    llama = pathlib.Path(a.llama_cpp)
    lib = llama / "build" / "bin"
    tk = gguf_bpe_tokenizer(a.model)
    m = R.load(a.model)
    if a.emulate_llama_act:
        plain = R._round_act
        R._round_act = lambda x, mode: (q8_k(x) if mode == "q8_K" else
                                        q8_0_fp16(x) if mode == "q8_0_fp16" else plain(x, mode))
    act = {"Q4_K": "q8_K", "Q5_K": "q8_K", "Q6_K": "q8_K", "Q5_0": "q8_0_fp16",
           "Q8_0": "q8_0_fp16"} if a.emulate_llama_act else None
    lines, tot = [], {"n": 0, "tl": 0, "tr": 0, "lr": 0, "le": 0}
    with tempfile.TemporaryDirectory() as td:
        td = pathlib.Path(td)
        exe = td / "llama_logits"
        subprocess.run(["cc", "-O2", "-o", str(exe), str(HERE / "tests/reference/llama_logits.c"),
                        f"-I{llama}/src/include", f"-I{llama}/src/ggml/include", f"-L{lib}",
                        "-lllama", f"-Wl,-rpath,{lib}"], check=True)
        for path in a.texts or DEFAULT_TEXTS:
            ids = tk.encode(pathlib.Path(path).read_text(errors="replace")[:8000]).ids[:N_TOKENS]
            n = len(ids)
            np.asarray(ids, dtype="<i4").tofile(td / "t.i32")
            subprocess.run([str(exe), a.model, str(td / "t.i32"), str(td / "l.f32"), "2"],
                           check=True, capture_output=True)
            lb = np.fromfile(td / "l.f32", dtype="<f4").reshape(n, -1).argmax(axis=1)
            (td / "in.json").write_text(json.dumps({"sequences": [ids]}))
            subprocess.run([a.tandem, "eval", "--model", a.model, "--tokens", str(td / "in.json"),
                            "--out", str(td / "o.bin"), "--kv-dtype", "f32"], check=True,
                           capture_output=True)
            tb = np.fromfile(td / "o.bin", dtype="<f4").reshape(n, -1).argmax(axis=1)
            rb = R.forward(m, ids, kv_dtype="f32").argmax(axis=1)
            c = {"n": n, "tl": int((tb == lb).sum()), "tr": int((tb == rb).sum()),
                 "lr": int((lb == rb).sum())}
            extra = ""
            if act:
                eb = R.forward(m, ids, act_round=act, kv_dtype="f32").argmax(axis=1)
                c["le"] = int((lb == eb).sum())
                extra = f"  llama.cpp~ref-with-llama-act {c['le'] / n:.4f}"
            for k, v in c.items():
                tot[k] += v
            line = (f"{path}: {n} positions  tandem~llama.cpp {c['tl'] / n:.4f}  "
                    f"tandem~ref {c['tr'] / n:.4f}  llama.cpp~ref {c['lr'] / n:.4f}{extra}")
            print(line, flush=True)
            lines.append(line)
    n = tot["n"]
    line = (f"all: {n} positions  tandem~llama.cpp {tot['tl'] / n:.4f}  tandem~ref "
            f"{tot['tr'] / n:.4f}  llama.cpp~ref {tot['lr'] / n:.4f}" +
            (f"  llama.cpp~ref-with-llama-act {tot['le'] / n:.4f}" if act else ""))
    print(line)
    lines.append(line)
    if a.out:
        pathlib.Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
