"""Engine logits vs the NumPy reference on the real default model
(SmolLM2-135M-Instruct, GGUF Q4_1 with a Q8_0 tied embedding).

The prompt is the SmolLM2 chat rendering of "What is the capital of
France?", tokenized independently of Tandem with the PyPI `tokenizers`
package from the GGUF's own vocabulary and merges (the text is plain ASCII
without digits, so the byte-level GPT-2 split equals SmolLM2's pre-tokenizer
here), followed by the answer "The capital of France is Paris." as teacher.

Checks:
  * the reference itself (float64, dequantized weights) predicts the answer
    token by token, i.e. greedy decoding from the reference says Paris;
  * the engine's logits at every position: rel_t = max|a-b| / max|b| <= 1e-4,
    mean over positions <= 1e-4. The engine dequantizes Q4_1/Q8_0 weights
    exactly (as the reference does) and multiplies them with F32 activations,
    so the only difference is F32 rounding through 30 layers: measured rel_t
    <= 1.6e-6 (avx512), 2.7e-6 (avx2), 2.4e-6 (scalar); the bound leaves a
    ~40x margin and is what test_numerics.py uses for every class. (With
    8-bit activations, the earlier scheme, rel_t was 0.091, and greedy
    decoding answered something else: see test_generate_model.py.)
  * the same with an f16 KV cache (the default on the CPU) against the
    reference rounding K and V the same way (reference.round_kv): where the
    engine's f32 K or V lies within its rounding error of an f16 tie the
    two round one element apart, and 30 layers carry such flips on, so the
    bound is rel_t <= 1e-3, mean <= 4e-4 (measured 6.8e-4 and 2.5e-4 on
    avx512). Against the unrounded reference the engine is off by 1.75e-3,
    mean 6.4e-4 (the cost in fidelity of f16), so a cache that ignored its
    dtype fails;
  * teacher forcing (both caches): the engine's argmax equals the reference's wherever the
    reference's top-1/top-2 margin exceeds 2e-3 * max|ref| (20x the logits
    tolerance, as in test_numerics.py). 43 of the 44 positions clear it,
    among them the first answer token ("The", margin 0.08 logits = 3.2e-3 *
    max|ref|).
"""

import pathlib
import sys

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "reference"))
sys.path.insert(0, str(HERE))

import reference as R  # noqa: E402
from reference_util import check_logits, gguf_bpe_tokenizer  # noqa: E402

PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
          "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
          "<|im_end|>\n<|im_start|>assistant\n")
ANSWER = "The capital of France is Paris."
TOL, MEAN_TOL, DELTA = 1e-4, 1e-4, 2e-3
KV_TOL, KV_MEAN_TOL = 1e-3, 4e-4  # f16 cache: see the docstring
MIN_CHECKED = 40  # of the 44 positions, 43 clear delta with the reference


@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_default_model_matches_reference(default_model, tandem_eval, kv):
    tk = gguf_bpe_tokenizer(default_model)
    prompt = tk.encode(PROMPT).ids
    answer = tk.encode(ANSWER).ids
    assert tk.decode(answer) == ANSWER
    seq = prompt + answer
    m = R.load(str(default_model))
    b = R.forward(m, seq, kv_dtype=kv)
    # The reference predicts every answer token (= its greedy output is the answer).
    n0 = len(prompt) - 1
    ref_pred = [int(np.argmax(b[t])) for t in range(n0, n0 + len(answer))]
    assert ref_pred == answer, f"reference says {tk.decode(ref_pred)!r}"

    (a,) = tandem_eval(str(default_model), [seq], timeout=300, extra=("--kv-dtype", kv))
    assert a.shape == (len(seq), m.config["n_vocab"])
    tol, mean_tol = (TOL, MEAN_TOL) if kv == "f32" else (KV_TOL, KV_MEAN_TOL)
    check_logits(a, b, f"KV {kv}", tol, mean_tol, DELTA, MIN_CHECKED)
