"""Expert parallelism through the real rank processes:
`tandem eval` on the tiny MoE models of tests/models/make_models.py with EP
plans, against the single-rank run, with the checks of test_parallel.py.

  EP inside TP (--tp N, EP defaulting to the TP group; --tp 4 --ep 2; with
  PP, and with CP, each CP rank's TP group its own EP group):
      attention and the shared expert are TP-split, so the TP tolerance and
      argmax-under-teacher-forcing rules apply.
  --attn-dp (attention data-parallel over the EP group, experts whole):
      bit-identical to one rank, with and without pipeline stages (no
      row's value depends on another rank's partial sums).
"""
import os

import numpy as np
import pathlib

from test_parallel import MIN_CHECKED, compare, run, sequences

MODELS = pathlib.Path(os.environ.get("TANDEM_TEST_MODELS", ""))


def check(model, plans, modes=("decode", "batch")):
    seqs = sequences(512)
    for mode in modes:
        one = run(model, seqs, [], mode)
        for plan in plans:
            exact = "--attn-dp" in plan
            many = run(model, seqs, plan, mode)
            checked = compare(one, many, exact, f"{model.name} {' '.join(plan)} {mode}")
            if mode == "decode":
                assert checked >= MIN_CHECKED * len(seqs), (plan, checked)


def test_ep_inside_tp():
    check(MODELS / "gguf/qwen2moe-f32.gguf", [["--tp", "2"], ["--tp", "4", "--ep", "2"]])
    check(MODELS / "gguf/mixtral-q8_0.gguf", [["--tp", "4", "--pp", "2"]], modes=("batch",))
    # EP inside each CP rank's TP group (PCP splits every prompt chunk).
    check(MODELS / "gguf/qwen2moe-f32.gguf",
          [["--tp", "2", "--cp", "2", "--cp-min-tokens", "1"]], modes=("prefill", "decode"))


def test_attn_dp_is_bit_identical():
    check(MODELS / "hf/qwen2moe-f32", [["--tp", "2", "--attn-dp"],
                                       ["--tp", "4", "--attn-dp", "--pp", "2"]])
    check(MODELS / "gguf/mixtral-f32.gguf", [["--tp", "4", "--attn-dp"]], modes=("batch",))


def test_attn_dp_sequences_keep_their_rank_as_the_batch_changes():
    # Sequences of different lengths in one batch: when the short one ends,
    # the others move up in the batch; each must stay on the EP rank that
    # holds its K/V (a rank chosen by batch position read K/V it never wrote).
    import random

    from conftest import tandem_eval_raw
    rng = random.Random(3)
    seqs = [[rng.randrange(3, 512) for _ in range(n)] for n in (10, 40, 23, 40)]
    model = str(MODELS / "gguf/qwen2moe-f32.gguf")
    r, one = tandem_eval_raw(model, seqs, chunk=5, batch=True)
    assert one is not None, r.describe()
    for plan in (["--tp", "2", "--attn-dp"], ["--tp", "4", "--attn-dp"]):
        r, many = tandem_eval_raw(model, seqs, chunk=5, batch=True, extra=plan)
        assert many is not None, r.describe()
        for a, b in zip(one, many):
            assert np.array_equal(a, b), (plan, float(np.abs(a - b).max()))
