"""The whole equivalence matrix of the parallel plans (label nightly; CI runs the
subset in test_parallel.py and test_parallel_moe.py): every tiny random
dense model family x weight type that has one x {tp 1,2,3,4} x {pp 1,2} x
{cp 1, 2 allgather, 2 ring} that the model's shape allows, and every tiny
MoE model with EP 2 and 4 (inside TP), attention-DP, PP and CP, against the
single-rank run, with the tolerances and the teacher-forcing check of
test_parallel.py.

Run it with:  ctest -L nightly --output-on-failure   (in a build tree)."""
import json
import os
import pathlib

import pytest

import test_parallel as P

MODELS = pathlib.Path(os.environ.get("TANDEM_TEST_MODELS", ""))
# Elements per quant block of a tol_class (K-quants: 256-element super-blocks;
# the Q4_K_M mixes hold both, the larger decides).
QBLOCK = {"f32": 1, "f16": 1, "bf16": 1, "q8": 32, "q4": 32, "q5": 32, "qk": 256}


def allowed(cfg, tol_class, tp):
    heads, kv, ff, hd = cfg["n_head"], cfg["n_head_kv"], cfg["n_ff"], cfg["head_dim"]
    if heads % tp or ff % tp or (kv % tp and tp % kv):
        return False
    be = QBLOCK[tol_class]
    return tp == 1 or ((heads // tp) * hd % be == 0 and (ff // tp) % be == 0)


def plans(cfg, tol_class):
    out = []
    for tp in (1, 2, 3, 4):
        if not allowed(cfg, tol_class, tp):
            continue
        for pp in (1, 2):
            for cp in ([], ["--cp", "2", "--cp-mode", "allgather", "--cp-min-tokens", "4"],
                       ["--cp", "2", "--cp-mode", "ring", "--cp-min-tokens", "4"]):
                if tp == 1 and pp == 1 and not cp:
                    continue
                out.append(["--tp", str(tp), "--pp", str(pp)] + cp)
    return out


def cases():
    man = json.loads((MODELS / "models.json").read_text()) if (MODELS / "models.json").exists() \
        else {"models": []}
    for m in man["models"]:
        if m["format"] == "gguf" or m["name"].endswith("f32-hf"):
            yield pytest.param(m, id=m["name"])


@pytest.mark.parametrize("m", list(cases()))
def test_matrix(m):
    # f32 KV caches: TOL (test_parallel.py) bounds f32 reorderings of the
    # plan's sums; with the default f16 cache a K element whose f32 value
    # differs by an ulp between the plans can round to the other f16 (on
    # qwen25-q5_0 at --tp 4: 1.07e-4, against 4.4e-7 with f32 caches).
    # test_parallel.py's test_plans_with_half_kv_caches covers f16 and bf16.
    P.check_plans(MODELS / m["path"], plans(m["config"], m["tol_class"]), kv="f32")


def moe_cases():
    man = json.loads((MODELS / "models.json").read_text()) if (MODELS / "models.json").exists() \
        else {"moe_models": []}
    for m in man.get("moe_models", []):
        yield pytest.param(m, id=m["name"])


@pytest.mark.parametrize("m", list(moe_cases()))
def test_moe_matrix(m):
    # 4 heads, 8 experts top-2 (tests/models/make_models.py). EP defaults to
    # the TP group; --ep 2 inside TP 4; attention-DP (bit-identical); with
    # PP, and with CP inside each CP rank's TP group.
    import test_parallel_moe as M
    plans = [["--tp", "2"], ["--tp", "4"], ["--tp", "4", "--ep", "2"], ["--pp", "2"],
             ["--tp", "2", "--pp", "2"], ["--tp", "2", "--attn-dp"], ["--tp", "4", "--attn-dp"],
             ["--tp", "2", "--attn-dp", "--pp", "2"],
             ["--tp", "2", "--cp", "2", "--cp-min-tokens", "4"],
             ["--cp", "2", "--cp-mode", "ring", "--cp-min-tokens", "4"]]
    M.check(MODELS / m["path"], plans, modes=("prefill", "decode", "batch"))
