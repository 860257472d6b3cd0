"""Engine logits vs the NumPy reference on a real K-quant file:
Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2; Q4_K, Q6_K, Q5_0, Q8_0 and F32
tensors, as llama.cpp's quantizer mixes them), fetched by
scripts/fetch-test-models.sh (the test command runs it).

The token ids are the ChatML rendering of a question and a plain English
answer, tokenized independently of Tandem with the PyPI `tokenizers`
package from the GGUF's own vocabulary and merges (byte-level BPE; the text
has no digits, so GPT-2's split and Qwen2's agree), 64 positions or more.
The ids only need to be the same on both sides: the comparison is of
logits on given ids (teacher forcing), not of a tokenizer.

Checks, as test_numerics_default_model.py does for the default model:
  * the engine's logits at every position: rel_t = max|a-b| / max|b|
    <= 1e-4, mean <= 1e-4 with an f32 KV cache. The engine dequantizes every
    block type exactly as gguf.quants.dequantize does (test_dequant_gguf.c)
    and multiplies in F32, so the only difference from the float64
    reference is F32 rounding through 24 layers: the tolerance every
    quantized class of test_numerics.py uses;
  * teacher forcing: the engine's argmax equals the reference's wherever the
    reference's top-1/top-2 margin exceeds 2e-3 * max|ref|, on at least 48
    positions.
"""

import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "reference"))
sys.path.insert(0, str(HERE))

import reference as R  # noqa: E402
from reference_util import (check_logits, gguf_bpe_tokenizer,  # noqa: E402
                            kquant_model_path as model_path)

PROMPT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
          "Why do leaves change colour in autumn? Answer in a few sentences.<|im_end|>\n"
          "<|im_start|>assistant\n")
ANSWER = ("Leaves change colour in autumn because the trees stop making chlorophyll, the "
          "green pigment that captures sunlight. As the days grow shorter and cooler, the "
          "green fades and the yellow and orange pigments that were there all along become "
          "visible, while some trees also make red pigments from the sugars left in the leaves.")
TOL, MEAN_TOL, DELTA = 1e-4, 1e-4, 2e-3
MIN_POSITIONS, MIN_CHECKED = 64, 48


def test_qwen_q4_k_m_matches_reference(tandem_eval):
    path = model_path()
    tk = gguf_bpe_tokenizer(path)
    seq = tk.encode(PROMPT + ANSWER).ids
    assert tk.decode(seq, skip_special_tokens=False) == PROMPT + ANSWER
    assert len(seq) >= MIN_POSITIONS
    m = R.load(str(path))
    b = R.forward(m, seq, kv_dtype="f32")
    (a,) = tandem_eval(str(path), [seq], timeout=600, extra=("--kv-dtype", "f32"))
    assert a.shape == (len(seq), m.config["n_vocab"])
    check_logits(a, b, f"{len(seq)} positions", TOL, MEAN_TOL, DELTA, MIN_CHECKED)


def test_bench_engine_counts_mixed_weight_bytes(tandem):
    """bench-engine --json's weight_bytes_per_token, the basis of its
    bandwidth fraction, is the bytes of every matrix a token reads in this
    mixed file (Q8_0 head, Q5_0/Q8_0/Q4_K/Q6_K layers), counted here from the
    file by gguf's reader: every 2-D tensor but the embedding, of which a
    token reads one row (the head is a tensor of its own in this file)."""
    import json

    import gguf

    path = model_path()
    r = gguf.GGUFReader(str(path))
    names = {t.name for t in r.tensors}
    assert "output.weight" in names
    want = sum(int(t.n_bytes) for t in r.tensors
               if len(t.shape) >= 2 and t.name != "token_embd.weight")
    types = {t.tensor_type.name for t in r.tensors if len(t.shape) >= 2}
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= types
    out = tandem("bench-engine", "--model", path, "-p", "16", "-n", "4", "-r", "1", "--json",
                 timeout=300)
    d = json.loads(out.stdout)
    d = d[0] if isinstance(d, list) else d
    assert d["weight_bytes_per_token"] == want, (d["weight_bytes_per_token"], want)


def test_mmap_equals_the_weight_copy(tandem_eval):
    """--mmap (the matmuls read the file mapping) against the default
    private weight copy: the same bits on a mixed K-quant file, whose Q6_K
    and Q5_0 rows are not 4-byte aligned."""
    path = model_path()
    seq = list(range(1000, 1040))
    (a,) = tandem_eval(str(path), [seq], timeout=300)
    (b,) = tandem_eval(str(path), [seq], timeout=300, extra=("--mmap",))
    assert np.array_equal(a, b)
