"""The default model (SmolLM2-135M-Instruct Q4_1: 9 heads, 3 KV heads, 30
layers) under TP 3, TP 3 x PP 2, CP 2 and TP 3 x CP 2 against one rank
(equivalence), through `tandem eval` with the plan flags;
tolerances and the teacher-forcing check as in test_parallel.py: logits
within rel 1e-4 at every position, and at every forced step whose
single-rank top-1/top-2 margin exceeds 2e-3 * max|logits| the argmax agrees
(and at least 8 of the 32 steps per sequence clear that margin). PP 2 alone
is bit-identical."""
import os
import pathlib
import random

import numpy as np

import test_parallel as P
from conftest import tandem_eval_raw


# An f32 cache: TP and CP change the f32 rounding of K and V in the last
# bits, which an f16 cache (the CPU default) turns into one-step flips that
# 30 layers carry to 3e-4 (rel); the plans with f16 caches are checked on the
# tiny models (test_parallel.py, test_plans_with_half_kv_caches).
KV = ["--kv-dtype", "f32"]


def default_model():
    env = os.environ.get("TANDEM_MODEL")
    if env:
        return pathlib.Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.environ["HOME"], ".cache")
    return pathlib.Path(base) / "tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_default_model_tp3_and_pp():
    model = default_model()
    assert model.exists(), model
    rng = random.Random(11)
    seqs = [[rng.randrange(100, 49000) for _ in range(P.N_PROMPT + P.N_FORCED)]]
    # decode: the 32 teacher-forced steps under TP 3, TP 3 x PP 2 and CP 2
    # (single tokens: DCP, partials merged); batch (8-token chunks of two
    # sequences, so PP gets two micro-batches): PP 2 alone, bit for bit, and
    # TP 3 x CP 2 (chunks split by block owner: PCP). (Kept small: this also
    # runs in the sanitizer build.)
    cp = ["--cp", "2", "--cp-min-tokens", "8", "--cp-mode"]
    for mode, kw, plans in (
            ("decode", dict(chunk=1), ((["--tp", "3"], False), (["--tp", "3", "--pp", "2"], False),
                                       (cp + ["ring"], False))),
            ("batch", dict(chunk=8, batch=True), ((["--pp", "2"], True),
                                                  (["--tp", "3"] + cp + ["allgather"], False)))):
        run_seqs = seqs if mode == "decode" else seqs + [seqs[0][::-1]]
        r, one = tandem_eval_raw(str(model), run_seqs, timeout=900, extra=KV, **kw)
        assert one is not None, r.describe()
        for plan, exact in plans:
            r, many = tandem_eval_raw(str(model), run_seqs, timeout=900, extra=plan + KV, **kw)
            assert many is not None, r.describe()
            checked = P.compare(one, many, exact, f"default model {plan} {mode}")
            if mode == "decode":
                assert checked >= P.MIN_CHECKED * len(run_seqs), (plan, checked)
