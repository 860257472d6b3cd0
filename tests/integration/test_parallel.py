"""Parallel plans against one rank (equivalence), on the tiny
random models of tests/models/make_models.py, through `tandem eval` with the
plan flags (real rank processes over the shm comm backend).

For each model and plan, three runs of the same token sequences (8 prompt
tokens + 32 forced tokens, 3 sequences): one chunk per sequence (prefill),
one token per call (32 decode steps reading K/V back from the paged cache:
teacher forcing), and all sequences batched in 5-token chunks (several
sequences per step, so pipeline stages get several micro-batches).

What must hold, against the single-rank run of the same mode:
  PP alone        bit-identical logits (stages only move hidden states; the
                  engine is batch-invariant, so micro-batches change nothing).
  TP, CP (and PP) rel_t = max_v |plan - one| / max_v |one| <= TOL = 1e-4 at
                  every position: the all-reduces add the ranks' partial
                  sums in rank order instead of one dot product, and CP
                  merges per-rank attention partials (DCP decode rows, ring
                  PCP rows), f32 reorderings (measured ~2e-6 on these
                  models).
  argmax          at every forced step where the single-rank top-1/top-2
                  margin exceeds DELTA * max_v |one| (DELTA = 2e-3, 20x TOL),
                  the plan's argmax is the single-rank argmax; at least
                  MIN_CHECKED of the 32 steps clear the margin, so the check is
                  never vacuous.

The whole matrix (every model x {tp 1,2,3,4} x {pp 1,2} the shapes allow)
runs in test_parallel_nightly.py (label nightly); this file runs a subset
that covers every mechanism on every CI run.
"""
import os
import pathlib
import random
import time

import numpy as np
import pytest

from conftest import tandem_eval_raw, stale_exec_segments

MODELS = pathlib.Path(os.environ.get("TANDEM_TEST_MODELS", ""))
TOL = 1e-4
DELTA = 2e-3
MIN_CHECKED = 8
N_PROMPT, N_FORCED = 8, 32


def sequences(vocab, n=3, seed=7):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(N_PROMPT + N_FORCED)] for _ in range(n)]


def run(model, seqs, plan, mode, kv=None):
    kw = {"prefill": dict(chunk=N_PROMPT + N_FORCED), "decode": dict(chunk=1),
          "batch": dict(chunk=5, batch=True)}[mode]
    extra = list(plan) + (["--kv-dtype", kv] if kv else [])
    r, out = tandem_eval_raw(str(model), seqs, extra=extra, timeout=180, **kw)
    assert out is not None, r.describe()
    if len(plan) and plan != ["--tp", "1"]:
        assert "plan: " in r.stderr, r.describe()
    return out


def compare(one, many, exact, what):
    """Checks one plan's logits against the single-rank ones; returns the
    number of forced steps whose argmax was checked."""
    checked = 0
    for a, b in zip(one, many):
        assert a.shape == b.shape, what
        if exact:
            assert np.array_equal(a, b), f"{what}: not bit-identical (max diff " \
                                         f"{float(np.abs(a - b).max())})"
        scale = np.abs(a).max(axis=1)
        rel = np.abs(a - b).max(axis=1) / scale
        assert float(rel.max()) <= TOL, f"{what}: rel error {float(rel.max()):.3g} > {TOL}"
        for t in range(N_PROMPT - 1, a.shape[0] - 1):  # the forced steps
            top2 = np.sort(a[t])[-2:]
            if top2[1] - top2[0] > DELTA * scale[t]:
                checked += 1
                assert int(np.argmax(b[t])) == int(np.argmax(a[t])), f"{what}: argmax at {t}"
    return checked


def plan_size(plan, flag):
    """The size a plan gives an axis (1 when the flag is absent)."""
    return int(plan[plan.index(flag) + 1]) if flag in plan else 1


def check_plans(model, plans, modes=("prefill", "decode", "batch"), kv=None):
    """kv: the KV dtype of every run (one rank and the plans alike)."""
    seqs = sequences(512)
    for mode in modes:
        one = run(model, seqs, [], mode, kv)
        for plan in plans:
            exact = plan_size(plan, "--tp") == 1 and plan_size(plan, "--cp") == 1
            many = run(model, seqs, plan, mode, kv)
            checked = compare(one, many, exact, f"{model.name} {' '.join(plan)} {mode}")
            if mode == "decode":
                assert checked >= MIN_CHECKED * len(seqs), (plan, checked)


def test_pp_is_bit_identical():
    check_plans(MODELS / "gguf/llama2-q8_0.gguf", [["--pp", "2"]])
    check_plans(MODELS / "gguf/smollm2-f32.gguf", [["--pp", "2", "--pp-layers", "2,1"]],
                modes=("batch",))


def test_tp_and_pp():
    check_plans(MODELS / "gguf/llama2-f32.gguf",
                [["--tp", "2"], ["--tp", "4"], ["--tp", "2", "--pp", "2"]])


def test_cp_prefill_and_decode():
    # Chunks of >= 4 tokens split by block owner (PCP), single tokens on
    # every CP rank with merged partials (DCP), both modes, with TP and PP.
    check_plans(MODELS / "gguf/llama2-f32.gguf",
                [["--cp", "2", "--cp-mode", "allgather", "--cp-min-tokens", "4"],
                 ["--cp", "2", "--cp-mode", "ring", "--cp-min-tokens", "4"],
                 ["--tp", "2", "--pp", "2", "--cp", "2", "--cp-mode", "ring",
                  "--cp-min-tokens", "4"]])


@pytest.mark.parametrize("kv", ["f16", "bf16"])
def test_plans_with_half_kv_caches(kv):
    # Every rank's cache holds kv: PP stays bit-identical, TP and CP (the
    # K/V chunks packed, gathered and passed around the ring in the
    # cache's bytes) stay within TOL of one rank with the same cache.
    check_plans(MODELS / "gguf/llama2-f32.gguf",
                [["--pp", "2"], ["--tp", "2"],
                 ["--cp", "2", "--cp-mode", "allgather", "--cp-min-tokens", "4"],
                 ["--cp", "2", "--cp-mode", "ring", "--cp-min-tokens", "4"]], kv=kv)


def test_tp_replicates_kv_heads():
    # 4 query heads, 1 KV head: every TP rank holds the one KV head.
    check_plans(MODELS / "gguf/mistral-f32.gguf", [["--tp", "4"]], modes=("decode",))


def test_tp_hf_qkv_bias():
    check_plans(MODELS / "hf/qwen2-f32", [["--tp", "2", "--pp", "2"]], modes=("batch",))


def test_plan_errors_are_clear():
    seqs = sequences(512, n=1)
    r, out = tandem_eval_raw(str(MODELS / "gguf/llama2-f32.gguf"), seqs, chunk=4,
                             extra=["--tp", "3"], check=False)
    assert out is None and r.returncode != 0
    assert "does not divide the 4 attention heads" in r.stderr, r.describe()
    # A token id out of the vocabulary is refused on the driver, before any
    # rank sees the step; the ranks are stopped and nothing is left behind.
    r, out = tandem_eval_raw(str(MODELS / "gguf/llama2-f32.gguf"), [[1, 2, 600]], chunk=4,
                             extra=["--pp", "2"], check=False)
    assert out is None and r.returncode != 0
    assert "out of the vocabulary" in r.stderr, r.describe()
    assert not stale_exec_segments()


def test_a_dead_drivers_segment_is_removed():
    # A driver killed before its ranks attached leaves its segment behind;
    # the next plan started on the host removes it.
    pid = next(p for p in range(4000000, 4100000) if not os.path.exists(f"/proc/{p}"))
    stale = pathlib.Path(f"/dev/shm/tandem-exec-{pid}-0")
    stale.write_bytes(b"\0" * 64)
    # older than twice the attach deadline: a live driver's segment never is
    old = time.time() - 3600
    os.utime(stale, (old, old))
    fresh = pathlib.Path(f"/dev/shm/tandem-exec-{pid}-1")
    fresh.write_bytes(b"\0" * 64)
    try:
        run(MODELS / "gguf/llama2-f32.gguf", sequences(512, n=1), ["--pp", "2"], "prefill")
        assert not stale.exists()
        # a recent one may belong to a driver in another pid namespace
        assert fresh.exists()
    finally:
        stale.unlink(missing_ok=True)
        fresh.unlink(missing_ok=True)
