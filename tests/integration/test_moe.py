"""Mixture-of-experts models (Mixtral, Qwen2-MoE) on one rank: engine logits
vs the independent NumPy reference, batch invariance, and bad files.

Models: the "moe_models" of tests/models/make_models.py's manifest — for each
of mixtral (GGUF arch "llama" + llama.expert_count, 4 experts, top-2,
renormalised) and qwen2moe (8 experts, top-2, not renormalised, shared expert
with a sigmoid gate): GGUF F32 (merged 3-D expert tensors), GGUF Q8_0
(mixtral: one tensor per expert, the older llama.cpp layout; qwen2moe:
merged) and an HF safetensors directory.

Tolerances are test_numerics.py's classes, for the same reason: the engine
is an F32 computation on the weights as the file defines them (router and
shared-expert gate included, kept F32 as llama.cpp's quantizer keeps them),
the reference a float64 one. Routing is a discrete choice, so the two agree
only if no token's k-th and (k+1)-th router probabilities are closer than
F32 rounding (~1e-7 relative); the routers are scaled (ROUTER_SCALE in
make_models.py) so such near-ties do not occur in these fixed sequences, and
test_routing_is_not_degenerate checks that routing really varies between
tokens, so agreement is not vacuous.
"""

import json
import pathlib
import sys

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "reference"))
sys.path.insert(0, str(HERE.parent / "models"))
sys.path.insert(0, str(HERE))

import reference as R  # noqa: E402
from conftest import ensure_test_models, tandem_eval_raw  # noqa: E402
from test_numerics import (DELTA, MIN_CHECKED, PROMPT_LEN, SEQ_LENS, TF_STEPS,  # noqa: E402
                           rel_errors, seed_of, tolerances)

MODELS_DIR = ensure_test_models()
with open(MODELS_DIR / "models.json") as _f:
    MOE = json.load(_f).get("moe_models", [])
BY_NAME = {m["name"]: m for m in MOE}
NAMES = [m["name"] for m in MOE]
VARIANTS = sorted({m["variant"] for m in MOE})

_REF = {}


def ref_model(entry):
    if entry["name"] not in _REF:
        _REF[entry["name"]] = R.load(model_path(entry))
    return _REF[entry["name"]]


def model_path(entry):
    return str(MODELS_DIR / entry["path"])


def sequences_for(entry):
    rng = np.random.default_rng(seed_of(entry["variant"]))
    return [rng.integers(0, entry["config"]["n_vocab"], n).tolist() for n in SEQ_LENS]


def run_engine(entry, seqs, kv="f32", **kw):
    """tandem eval with a KV cache of kv (f32 unless said: the f32 arithmetic
    the tolerances are for; test_numerics.tolerances gives f16's)."""
    r, out = tandem_eval_raw(model_path(entry), seqs, check=False, extra=("--kv-dtype", kv), **kw)
    assert r.returncode == 0, f"tandem eval failed on {entry['name']}\n{r.describe()}"
    for s, o in zip(seqs, out):
        assert o.shape == (len(s), entry["config"]["n_vocab"])
        assert np.isfinite(o).all()
    return out


# ---------------------------------------------------------------------------
# The manifest and the reference (no engine)


def test_manifest_has_both_styles_and_layouts():
    got = {(m["variant"], m["format"], m["wtype"]) for m in MOE}
    for v in ("mixtral", "qwen2moe"):
        assert (v, "gguf", "F32") in got and (v, "gguf", "Q8_0") in got and (v, "hf", "F32") in got
    assert {m["expert_layout"] for m in MOE} == {"merged", "per_expert", "hf"}
    for m in MOE:
        moe = m["config"]["moe"]
        assert moe["n_expert"] % 4 == 0 and m["config"]["n_head"] % 4 == 0
        assert 1 <= moe["n_expert_used"] < moe["n_expert"]


def test_reference_routing_rule():
    """Top-k ties go to the lower expert id; renormalisation only when asked."""
    ids, w = R.route(np.array([0.1, 0.3, 0.3, 0.3]), 2, True)
    assert list(ids) == [1, 2] and np.allclose(w, [0.5, 0.5])
    ids, w = R.route(np.array([0.4, 0.1, 0.2, 0.3]), 2, False)
    assert list(ids) == [0, 3] and np.allclose(w, [0.4, 0.3])


@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_gguf_equals_hf(variant):
    """GGUF (merged or per-expert tensors, Q/K permuted for llama) and the HF
    directory of the same F32 weights give the same logits."""
    g = ref_model(BY_NAME[f"{variant}-f32-gguf"])
    h = ref_model(BY_NAME[f"{variant}-f32-hf"])
    toks = sequences_for(BY_NAME[f"{variant}-f32-gguf"])[0]
    assert rel_errors(R.forward(g, toks), R.forward(h, toks)).max() < 1e-10
    assert g.config["moe"] == h.config["moe"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_routing_is_not_degenerate(variant):
    """Every expert is chosen by some token of the test sequences, and the
    routed part matters: the FFN output changes by far more than the
    tolerances when the second choice is dropped."""
    e = BY_NAME[f"{variant}-f32-gguf"]
    m = ref_model(e)
    c = m.config
    toks = np.concatenate(sequences_for(e))
    x = m.t["tok_embd"][toks]
    h = R._rmsnorm(x, m.t["0.ffn_norm"], c["rms_eps"])
    lg = h @ m.t["0.router"].T
    p = np.exp(lg - lg.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    chosen = {int(i) for row in p for i in R.route(row, c["moe"]["n_expert_used"], True)[0]}
    assert chosen == set(range(c["moe"]["n_expert"]))
    srt = np.sort(p, axis=1)
    k = c["moe"]["n_expert_used"]
    # no near-tie at the top-k boundary: the gap is >= 20x the F32 rounding of the
    # probabilities (router logits ~3, 128-term F32 dots: ~1e-7)
    assert (srt[:, -k] - srt[:, -k - 1]).min() > 2e-6
    full = R.moe_ffn(m, 0, h)
    top1 = R.Model(m.path, dict(c, moe=dict(c["moe"], n_expert_used=1)), m.t)
    assert np.abs(full - R.moe_ffn(top1, 0, h)).max() > 1e-2 * np.abs(full).max()


# ---------------------------------------------------------------------------
# Engine vs reference


@pytest.mark.parametrize("kv", ["f32", "f16"])  # f16: the CPU default
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_reference(name, kv):
    e = BY_NAME[name]
    cls = e["tol_class"]
    seqs = sequences_for(e)
    out = run_engine(e, seqs, kv=kv)
    m = ref_model(e)
    rel = np.concatenate([rel_errors(a, R.forward(m, s, kv_dtype=kv)) for s, a in zip(seqs, out)])
    msg = f"{name} ({cls}, KV {kv}): max rel {rel.max():.3g}, mean {rel.mean():.3g}"
    print(msg)
    tol, mean_tol = tolerances(cls, kv)
    assert rel.max() <= tol, msg
    assert rel.mean() <= mean_tol, msg


@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("name", NAMES)
def test_teacher_forcing_argmax(name, kv):
    e = BY_NAME[name]
    cls = e["tol_class"]
    m = ref_model(e)
    rng = np.random.default_rng(seed_of(e["variant"]) + 1)
    prompt = rng.integers(0, e["config"]["n_vocab"], PROMPT_LEN).tolist()
    seq = R.greedy(m, prompt, TF_STEPS)
    b = R.forward(m, seq, kv_dtype=kv)
    (a,) = run_engine(e, [seq], kv=kv, chunk=1)
    checked, bad = 0, []
    for t in range(PROMPT_LEN - 1, PROMPT_LEN - 1 + TF_STEPS):
        srt = np.sort(b[t])
        if srt[-1] - srt[-2] <= DELTA[cls] * np.abs(b[t]).max():
            continue
        checked += 1
        if int(np.argmax(a[t])) != int(np.argmax(b[t])):
            bad.append((t, int(np.argmax(a[t])), int(np.argmax(b[t]))))
    msg = f"{name}: {checked}/{TF_STEPS} steps clear delta; disagreements {bad}"
    print(msg)
    assert not bad, msg
    assert checked >= MIN_CHECKED[cls], msg
    assert rel_errors(a, b).max() <= tolerances(cls, kv)[0]


@pytest.mark.parametrize("name", ["mixtral-q8_0-gguf", "qwen2moe-f32-gguf"])
def test_batch_invariance(name):
    """A sequence's logits are bit-identical whatever the chunking, the batch
    composition (tokens of several sequences grouped per expert together)
    and the thread count."""
    e = BY_NAME[name]
    seqs = sequences_for(e)
    base = run_engine(e, seqs, threads=1)
    for kw in ({"chunk": 1, "threads": 2}, {"batch": True, "threads": 2},
               {"batch": True, "chunk": 5, "threads": 1}):
        for s, a, b in zip(seqs, base, run_engine(e, seqs, **kw)):
            assert np.array_equal(a, b), f"{name} {kw}: logits differ for a {len(s)}-token sequence"


# ---------------------------------------------------------------------------
# Bad files: one clear error line, non-zero exit, no crash


def _expect_error(path, *needles):
    r, out = tandem_eval_raw(str(path), [[1, 2, 3]], check=False)
    assert out is None and r.returncode is not None and r.returncode > 0, r.describe()
    err = r.stderr.lower()
    for n in needles:
        assert n.lower() in err, f"{n!r} not in the error\n{r.describe()}"


@pytest.fixture(scope="module")
def mm():
    import make_models
    return make_models


@pytest.fixture(scope="module")
def tok(mm):
    return mm.build_tokenizer()


def _gguf(mm, tok, path, variant, wtype="F32", skip=None, mangle=None, **over):
    """Writes one MoE GGUF with make_models' writer: variant fields in over,
    tensor `skip` left out, tensor named in mangle (name -> fn(arr)) changed."""
    v = dict(mm.MOE_VARIANTS[variant], **over)
    w = mm.make_weights(variant, v)
    orig = mm._gguf_tensor

    def put(writer, name, arr, ttype):
        if name == skip:
            return
        if mangle and name in mangle:
            arr = mangle[name](arr)
        orig(writer, name, arr, ttype)

    mm._gguf_tensor = put
    try:
        mm.write_gguf(str(path), variant, v, w, wtype, tok)
    finally:
        mm._gguf_tensor = orig
    return path


def test_bad_gguf_expert_used_count(mm, tok, tmp_path):
    p = _gguf(mm, tok, tmp_path / "m.gguf", "mixtral", n_used=5)
    _expect_error(p, "expert_used_count 5 exceeds expert_count 4")


def test_bad_gguf_missing_merged_expert_tensor(mm, tok, tmp_path):
    p = _gguf(mm, tok, tmp_path / "m.gguf", "qwen2moe", skip="blk.1.ffn_up_exps.weight")
    _expect_error(p, "blk.1.ffn_up_exps.weight", "missing")


def test_bad_gguf_missing_per_expert_tensor(mm, tok, tmp_path):
    p = _gguf(mm, tok, tmp_path / "m.gguf", "mixtral", wtype="Q8_0", skip="blk.1.ffn_up.3.weight")
    _expect_error(p, "blk.1.ffn_up.3.weight", "missing")


def test_bad_gguf_expert_tensor_shape(mm, tok, tmp_path):
    p = _gguf(mm, tok, tmp_path / "m.gguf", "qwen2moe",
              mangle={"blk.0.ffn_down_exps.weight": lambda a: a[:7]})
    _expect_error(p, "blk.0.ffn_down_exps.weight", "shape [128, 128, 7], expected [128, 128, 8]")


def test_bad_gguf_missing_shared_gate(mm, tok, tmp_path):
    p = _gguf(mm, tok, tmp_path / "m.gguf", "qwen2moe", skip="blk.0.ffn_gate_inp_shexp.weight")
    _expect_error(p, "blk.0.ffn_gate_inp_shexp.weight", "missing")


def _hf(mm, tok, path, variant, drop=None, cfg_over=None):
    v = mm.MOE_VARIANTS[variant]
    w = mm.make_weights(variant, v)
    if drop:
        del w[drop]
    mm.write_hf(str(path), variant, v, w, "F32", tok, False)
    if cfg_over:
        cp = path / "config.json"
        cfg = json.loads(cp.read_text())
        cfg.update(cfg_over)
        cp.write_text(json.dumps(cfg))
    return path


def test_bad_hf_experts_per_tok(mm, tok, tmp_path):
    p = _hf(mm, tok, tmp_path / "m", "mixtral", cfg_over={"num_experts_per_tok": 9})
    _expect_error(p, "num_experts_per_tok 9 exceeds the 4 experts")


def test_bad_hf_missing_expert(mm, tok, tmp_path):
    name = "model.layers.1.mlp.experts.6.down_proj.weight"
    p = _hf(mm, tok, tmp_path / "m", "qwen2moe", drop=name)
    _expect_error(p, name, "missing")


def test_bad_hf_router_shape(mm, tok, tmp_path):
    p = _hf(mm, tok, tmp_path / "m", "mixtral", cfg_over={"num_local_experts": 8})
    _expect_error(p, "model.layers.0.block_sparse_moe.gate.weight", "expected [128, 8]")


def test_bad_hf_dense_layers_unsupported(mm, tok, tmp_path):
    p = _hf(mm, tok, tmp_path / "m", "qwen2moe", cfg_over={"mlp_only_layers": [1]})
    _expect_error(p, "mlp_only_layers")
