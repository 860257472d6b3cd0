"""Engine logits vs the independent NumPy reference (tests/reference).

For every tiny random model of tests/models/make_models.py (every architecture
variant x weight type, GGUF and HF safetensors) the engine's logits from
`tandem eval` (contract in tools/cmd-eval.c) are compared with
tests/reference/reference.py run in float64 on the weights as stored in the
file (dequantized for F16/BF16/quantized types).

Error norm, per position t:  rel_t = max_v |engine[t,v] - ref[t,v]| / max_v |ref[t,v]|.

Tolerances (largest rel_t allowed) and why:
  f32   1e-4  The engine computes in F32, the reference in float64; F32
              rounding through 2-3 layers of these sizes is ~1e-6.
  f16,  1e-4  F16/BF16 weights convert exactly to F32 and the kernels pair
  bf16        float weights with F32 activations (kernels/cpu/cpu.h: "F32 for
              float weights"), so the only difference is F32 rounding, as for F32.
  q8,   1e-4  Quantized matmuls dequantize the weights exactly as GGUF
  q4          defines them (only q4_1's d*q+m rounds, once, to F32) and
              multiply them with F32 activations (the CPU backend's matmul), so
              the engine is an F32 computation on the same dequantized
              weights the reference uses: the same bound as F32. Measured on
              these models: rel_t < 1e-6 on every ISA. (With 8-bit
              activations, --act-int8, rel_t reaches 0.055: see
              test_act_int8_against_reference.)
  q5,   1e-4  Q5_0/Q5_1 (q5) and Q4_K/Q5_K/Q6_K and the Q4_K_M mix (qk): the
  qk          same argument. Each element's products (d*q; K-quants: d*sc*q,
              dmin*m) are exact in F32 and the engine dequantizes as GGUF
              defines, rounding each element once as gguf.quants.dequantize
              does, so the error is F32 arithmetic again; the bounds and the
              teacher-forcing delta are those of the older quantized types.

Teacher forcing: prompt of 8 random tokens + 32 tokens of the reference's
greedy continuation, run through the engine one token per forward call
(--chunk 1, i.e. decode steps reading K/V back from the paged cache). At each
of the 32 steps whose next token is fed back, the engine's argmax must equal
the reference's wherever the reference's top-1/top-2 margin exceeds
delta = DELTA[class] * max_v |ref[t,v]|:
  every class   DELTA 2e-3  (20x the logits tolerance: any real disagreement is a
                            bug; quantized classes are F32 computations too, see above)
and at least MIN_CHECKED[class] of the 32 steps must clear delta, so the check
is never vacuous.

KV cache dtypes. The tolerances above are for an f32 KV cache (--kv-dtype f32:
the engine's f32 arithmetic alone). Every model also runs with f16, the
default on the CPU, and the models of the ISA list with bf16: the reference
rounds K and V as the cache stores them (reference.round_kv: the f32 value, to
nearest even), and the engine must match it within KV_TOL (max rel_t) and
KV_MEAN_TOL (mean). Rounding is discontinuous, so where the engine's f32 K
lies within its own rounding error of a tie the two sides can round one
element differently: one f16 step moves a logit by a few 1e-5 (measured at
most 1.5e-4 over every model, mean at most 2.4e-5), one bf16 step (8 times
coarser) by up to 4.3e-4 on the models of the ISA list. The unrounded
reference is off by 1.5e-4 to 4.1e-4 in mean and 3.0e-4 to 9.4e-4 at most for
f16, 1.2e-3 to 3.3e-3 in mean and 2.2e-3 to 7.1e-3 at most for bf16 on the
models of the ISA list (the cost in fidelity of each dtype): above the mean
tolerance everywhere, so a cache that ignored its dtype fails.

Also: one model per weight type through every kernel ISA (--isa scalar, avx2,
avx512; an ISA the CPU lacks is skipped, except scalar and, on a CPU with
AVX2/FMA/F16C, avx2), same tolerances; out-of-range token ids are rejected
with a nonzero exit and an error line; and self-checks of the reference and
the generated models that need no engine.
"""

import json
import pathlib
import sys
import zlib
from functools import lru_cache

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "reference"))
sys.path.insert(0, str(HERE.parent / "models"))
sys.path.insert(0, str(HERE))

import reference as R  # noqa: E402
from conftest import ensure_test_models, load_manifest, tandem_eval_raw  # noqa: E402

TOL = {"f32": 1e-4, "f16": 1e-4, "bf16": 1e-4, "q8": 1e-4, "q4": 1e-4, "q5": 1e-4, "qk": 1e-4}
MEAN_TOL = {"f32": 1e-4, "f16": 1e-4, "bf16": 1e-4, "q8": 1e-4, "q4": 1e-4, "q5": 1e-4,
            "qk": 1e-4}
DELTA = {"f32": 2e-3, "f16": 2e-3, "bf16": 2e-3, "q8": 2e-3, "q4": 2e-3, "q5": 2e-3, "qk": 2e-3}
MIN_CHECKED = {"f32": 24, "f16": 24, "bf16": 24, "q8": 24, "q4": 24, "q5": 24, "qk": 24}

KV_TOL = {"f16": 2e-4, "bf16": 1e-3}
KV_MEAN_TOL = 5e-5

SEQ_LENS = (40, 37, 23)
PROMPT_LEN = 8
TF_STEPS = 32

MODELS_DIR = ensure_test_models()
MANIFEST = load_manifest(MODELS_DIR)
BY_NAME = {m["name"]: m for m in MANIFEST}


@lru_cache(maxsize=4)
def ref_model(path):
    return R.load(path)


def model_path(entry):
    return str(MODELS_DIR / entry["path"])


def seed_of(name):
    return zlib.crc32(name.encode())


def rel_errors(a, b):
    """Per-position rel_t (see module docstring)."""
    return np.abs(a.astype(np.float64) - b).max(axis=1) / np.abs(b).max(axis=1)


def sequences_for(entry):
    # Same sequences for every weight type of a variant (seeded by variant).
    rng = np.random.default_rng(seed_of(entry["variant"]))
    V = entry["config"]["n_vocab"]
    return [rng.integers(0, V, n).tolist() for n in SEQ_LENS]


def run_engine(entry, seqs, kv="f32", extra=(), **kw):
    """tandem eval with a KV cache of kv (f32: the engine's f32 arithmetic
    alone, which the f64 reference checks to TOL)."""
    r, out = tandem_eval_raw(model_path(entry), seqs, check=False,
                             extra=("--kv-dtype", kv, *extra), **kw)
    assert r.returncode == 0, f"tandem eval failed on {entry['name']}\n{r.describe()}"
    V = entry["config"]["n_vocab"]
    for s, o in zip(seqs, out):
        assert o.shape == (len(s), V), f"{entry['name']}: logits shape {o.shape}, want {(len(s), V)}"
        assert np.isfinite(o).all(), f"{entry['name']}: non-finite logits"
    return out


# ---------------------------------------------------------------------------
# Self-checks of the reference and the generated models (no engine involved)


VARIANTS = sorted({m["variant"] for m in MANIFEST})


@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_gguf_equals_hf(variant):
    """The GGUF file (Q/K permuted, NORM RoPE for llama; rope_freqs tensor for
    Llama-3 scaling) and the HF directory (unpermuted, NeoX RoPE; config.json
    rope_scaling) of the same F32 weights give the same logits."""
    g = ref_model(model_path(BY_NAME[f"{variant}-f32-gguf"]))
    h = ref_model(model_path(BY_NAME[f"{variant}-f32-hf"]))
    toks = sequences_for(BY_NAME[f"{variant}-f32-gguf"])[0]
    a, b = R.forward(g, toks), R.forward(h, toks)
    # rope_freqs.weight is stored as F32, the HF path computes it in float64.
    tol = 1e-5 if g.config["freq_divisors"] is not None else 1e-10
    assert rel_errors(a, b).max() < tol
    # Tied / untied as declared.
    assert g.config["tied"] == h.config["tied"] == BY_NAME[f"{variant}-f32-gguf"]["tied"]


def test_reference_norm_rope_equals_unpermuted_neox():
    """GGUF's Q/K permutation + NORM RoPE == un-permuted Q/K + NeoX RoPE, and
    the wrong pairing really changes the result (so the check has teeth)."""
    for variant in VARIANTS:
        e = BY_NAME[f"{variant}-f32-gguf"]
        if e["arch"] != "llama":
            continue
        m = ref_model(model_path(e))
        toks = sequences_for(e)[0]
        a = R.forward(m, toks)
        u = R.Model(m.path, m.config, dict(m.t))
        c = m.config
        for l in range(c["n_layer"]):
            u.t[f"{l}.wq"] = R.unpermute_qk(m.t[f"{l}.wq"], c["n_head"])
            u.t[f"{l}.wk"] = R.unpermute_qk(m.t[f"{l}.wk"], c["n_head_kv"])
        b = R.forward(u, toks, rope_mode="neox")
        assert rel_errors(a, b).max() < 1e-10, variant
        wrong = R.forward(m, toks, rope_mode="neox")
        assert rel_errors(wrong, a).max() > 1e-2, variant


def test_reference_sharded_and_readers():
    """Sharded HF dir == single-file dir; the reference's own safetensors
    reader matches the safetensors package (F32/F16) and the gguf package's
    BF16 (same round-to-nearest-even values in both formats)."""
    from safetensors.numpy import load_file

    sh = [m for m in MANIFEST if m["sharded"]]
    assert sh, "no sharded model in the manifest"
    for e in sh:
        single = e["path"].removesuffix("-sharded")
        a = ref_model(model_path(e))
        b = ref_model(str(MODELS_DIR / single))
        assert set(a.t) == set(b.t)
        for k in a.t:
            assert np.array_equal(a.t[k], b.t[k]), k
        idx = json.load(open(MODELS_DIR / e["path"] / "model.safetensors.index.json"))
        assert len(set(idx["weight_map"].values())) == 2
    for dt in ("f32", "f16"):
        d = MODELS_DIR / BY_NAME[f"llama2-{dt}-hf"]["path"] / "model.safetensors"
        ours, _ = R.read_safetensors(str(d))
        theirs = load_file(str(d))
        assert set(ours) == set(theirs)
        for k in ours:
            assert np.array_equal(ours[k], theirs[k].astype(np.float64)), k
    hf = ref_model(model_path(BY_NAME["llama2-bf16-hf"]))
    gg = ref_model(model_path(BY_NAME["llama2-bf16-gguf"]))
    assert np.array_equal(hf.t["tok_embd"], gg.t["tok_embd"])
    assert np.array_equal(hf.t["1.w_down"], gg.t["1.w_down"])


def test_reference_is_causal_and_uses_positions():
    """Logits at t depend only on tokens <= t; RoPE makes them depend on position."""
    e = BY_NAME["qwen2-f32-gguf"]
    m = ref_model(model_path(e))
    toks = sequences_for(e)[0]
    full = R.forward(m, toks)
    part = R.forward(m, toks[:17])
    assert np.abs(full[:17] - part).max() < 1e-10
    # Same two tokens at positions (0,1) vs (5,6) after a repeated token: the
    # second logits row differs because relative/absolute positions differ.
    x = R.forward(m, [7, 9])[1]
    y = R.forward(m, [7, 7, 7, 7, 7, 7, 9])[6]
    assert np.abs(x - y).max() > 1e-3


def test_manifest_covers_every_variant_and_type():
    got = {(m["variant"], m["format"], m["wtype"]) for m in MANIFEST}
    for v in VARIANTS:
        for wt in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MIXED"):
            assert (v, "gguf", wt) in got
        for wt in ("F32", "F16", "BF16"):
            assert (v, "hf", wt) in got
    kv = {(m["config"]["n_head"], m["config"]["n_head_kv"]) for m in MANIFEST}
    assert any(h == k for h, k in kv) and any(k == 1 for _, k in kv)
    assert any(m["tied"] for m in MANIFEST) and any(not m["tied"] for m in MANIFEST)
    # Each K type alone, and the Q4_K_M mix: Q4_K, Q6_K and, for rows that
    # are not whole 256-element super-blocks, Q5_0 (and Q8_0 for Q6_K's).
    for wt in ("Q4_K", "Q5_K", "Q6_K", "Q4_K_M"):
        assert any(m["wtype"] == wt for m in MANIFEST), wt
    mixes = [set(m["tensor_types"].values()) for m in MANIFEST if m["wtype"] == "Q4_K_M"]
    assert any({"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= t for t in mixes), mixes


# The K-quantizer's error bound (tests/models/quants_k.py): every element is
# within half a step S = d*sc of its value, S <= s + d with s the sub-block's
# unrounded step and d the super-block scale; 1.01 covers d's rounding up to
# fp16 (relative 2^-11) and the F32 products of the dequantizer.
K_LEVELS = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 31}


def k_error_bound(x, ttype):
    """Per-element bound of |dequant(quant(x)) - x| for x (rows, 256*k)."""
    if ttype == "Q6_K":
        g = x.reshape(-1, 16, 16)  # super-block, group of 16
        s = np.abs(g).max(axis=2) / 31
        d = s.max(axis=1, keepdims=True) / 127
    else:
        g = x.reshape(-1, 8, 32)  # super-block, sub-block of 32
        mn = -np.minimum(g.min(axis=2), 0)
        dmin = mn.max(axis=1, keepdims=True) / 63
        s = (np.maximum(g.max(axis=2), 0) + mn + dmin) / K_LEVELS[ttype]
        d = s.max(axis=1, keepdims=True) / 63
    b = 1.01 * (s + d) / 2
    return np.repeat(b[:, :, None], g.shape[2], axis=2).reshape(x.shape)


@pytest.mark.parametrize("ttype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quantizer_round_trips(ttype):
    """tests/models/quants_k.py, read back by gguf-py's independent
    dequantizer, is within its error bound on every element (random rows, a
    zero super-block, one-signed rows, an outlier sub-block that makes the
    other sub-blocks' 6-bit scales small), and the error is a real
    quantization error (not zero; about step/sqrt(12) in RMS). A wrong byte
    layout (nibble order, qh bit, scale packing) moves elements by whole
    steps of other sub-blocks, far past the bound."""
    import gguf
    import quants_k  # tests/models

    rng = np.random.default_rng(7)
    x = (rng.standard_normal((16, 768)) / np.sqrt(768)).astype(np.float32)
    x[1, :256] = 0
    x[2] = np.abs(x[2])
    x[3] = -np.abs(x[3])
    x[4, 32:64] *= 40
    x[5, :] = 1e-3
    q = quants_k.quantize(x, ttype)
    assert q.dtype == np.uint8 and q.shape == (16, 3 * quants_k.BLOCK_BYTES[ttype])
    y = gguf.quants.dequantize(q, gguf.GGMLQuantizationType[ttype])
    assert y.shape == x.shape
    err = np.abs(y.astype(np.float64) - x)
    bound = k_error_bound(x.astype(np.float64), ttype)
    worst = np.unravel_index(np.argmax(err / np.maximum(bound, 1e-30)), x.shape)
    print(f"{ttype}: max err/bound {(err / np.maximum(bound, 1e-30)).max():.3f} at {worst}")
    assert (err <= bound).all(), \
        f"{ttype}: element {worst} off by {err[worst]:.3g} > {bound[worst]:.3g}"
    assert np.array_equal(y[1, :256], np.zeros(256))
    rms = np.sqrt((err[6:] ** 2).mean() / (x[6:] ** 2).mean())
    assert 0.003 < rms < {"Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.025}[ttype], rms
    with pytest.raises(ValueError):
        quants_k.quantize(x[:, :160], ttype)


K_FILES = [m["name"] for m in MANIFEST if m["wtype"] in ("Q4_K", "Q5_K", "Q6_K", "Q4_K_M")]


@pytest.mark.parametrize("name", K_FILES)
def test_k_quant_files(name):
    """Each K-quant file holds the types its manifest entry names, K types
    only on rows of whole 256-element super-blocks (the mix: Q6_K, or its
    fallback Q8_0, for the head and the last layer's attn_v and ffn_down, as
    llama.cpp's Q4_K_M), and every quantized matrix, read back by gguf-py,
    is the F32 file's matrix within its quantizer's bound (K types) or within
    a quantization-sized error (the mix's Q5_0 and Q8_0)."""
    import gguf

    e = BY_NAME[name]
    tt = e["tensor_types"]
    qfile = {t.name: t for t in gguf.GGUFReader(model_path(e)).tensors}
    f32 = BY_NAME[f"{e['variant']}-f32-gguf"]
    ffile = {t.name: t for t in gguf.GGUFReader(model_path(f32)).tensors}
    assert set(qfile) == set(ffile)
    last = e["config"]["n_layer"] - 1
    n_k = 0
    for tname, t in qfile.items():
        key = tname.removesuffix(".weight")
        role = key.split(".", 2)[2] if key.startswith("blk.") else key
        ty = t.tensor_type.name
        assert ty == tt.get(key, tt[role]), (tname, ty, tt)
        x = np.asarray(ffile[tname].data, dtype=np.float64)
        if ty == "F32":
            assert np.array_equal(np.asarray(t.data, dtype=np.float64), x), tname
            continue
        row = int(t.shape[0])  # GGUF ne0
        if e["wtype"] != "Q4_K_M":
            assert ty == e["wtype"], tname
        elif tname in ("output.weight", f"blk.{last}.attn_v.weight",
                       f"blk.{last}.ffn_down.weight") \
                or (e["tied"] and tname == "token_embd.weight"):
            assert ty == ("Q6_K" if row % 256 == 0 else "Q8_0"), (tname, ty)
        else:
            assert ty == ("Q4_K" if row % 256 == 0 else "Q5_0"), (tname, ty)
        y = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        assert y.shape == x.shape, tname
        if ty in K_LEVELS:
            n_k += 1
            assert row % 256 == 0, tname
            bound = k_error_bound(x, ty)
            assert (np.abs(y - x) <= bound).all(), f"{tname} ({ty}): off by more than the bound"
        else:
            blk = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True)
            assert (np.abs(y - x).reshape(-1, 32) <= blk / 8).all(), f"{tname} ({ty})"
        rel = np.sqrt(((y - x) ** 2).mean() / (x ** 2).mean())
        assert 1e-4 < rel < 0.1, (tname, ty, rel)  # quantized, and well
    assert n_k > 0, f"{name} holds no K-quant tensor"


def test_models_are_peaked():
    """The head scaling makes the top-1/top-2 margin typically > 1."""
    for v in VARIANTS:
        e = BY_NAME[f"{v}-f32-gguf"]
        b = R.forward(ref_model(model_path(e)), sequences_for(e)[0])
        s = np.sort(b, axis=1)
        assert np.median(s[:, -1] - s[:, -2]) > 1.0, v


# ---------------------------------------------------------------------------
# Engine vs reference


def tolerances(cls, kv):
    """(max, mean) rel_t allowed for a weight class and a KV dtype."""
    if kv == "f32":
        return TOL[cls], MEAN_TOL[cls]
    return KV_TOL[kv], KV_MEAN_TOL


# f32: the engine's arithmetic; f16: the default on the CPU (every model both ways)
@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("name", [m["name"] for m in MANIFEST])
def test_logits_match_reference(name, kv):
    e = BY_NAME[name]
    cls = e["tol_class"]
    seqs = sequences_for(e)
    out = run_engine(e, seqs, kv=kv)
    m = ref_model(model_path(e))
    rels = []
    for s, a in zip(seqs, out):
        rels.append(rel_errors(a, R.forward(m, s, kv_dtype=kv)))
    rel = np.concatenate(rels)
    worst = int(rel.argmax())
    tol, mean_tol = tolerances(cls, kv)
    msg = (f"{name} ({cls}, KV {kv}): max rel {rel.max():.3g} at position {worst}, "
           f"mean {rel.mean():.3g}; tolerance {tol:g}, mean tolerance {mean_tol:g}")
    print(msg)
    assert rel.max() <= tol, msg
    assert rel.mean() <= mean_tol, msg


@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("name", [m["name"] for m in MANIFEST])
def test_teacher_forcing_argmax(name, kv):
    e = BY_NAME[name]
    cls = e["tol_class"]
    m = ref_model(model_path(e))
    rng = np.random.default_rng(seed_of(e["variant"]) + 1)
    prompt = rng.integers(0, e["config"]["n_vocab"], PROMPT_LEN).tolist()
    seq = R.greedy(m, prompt, TF_STEPS)
    b = R.forward(m, seq, kv_dtype=kv)
    (a,) = run_engine(e, [seq], kv=kv, chunk=1)
    steps = range(PROMPT_LEN - 1, PROMPT_LEN - 1 + TF_STEPS)  # logits that chose seq[t+1]
    checked, bad = 0, []
    for t in steps:
        srt = np.sort(b[t])
        margin = srt[-1] - srt[-2]
        if margin <= DELTA[cls] * np.abs(b[t]).max():
            continue
        checked += 1
        if int(np.argmax(a[t])) != int(np.argmax(b[t])):
            bad.append((t, int(np.argmax(a[t])), int(np.argmax(b[t])), float(margin)))
    msg = f"{name}: {checked}/{TF_STEPS} steps clear delta; disagreements (t, engine, ref, margin): {bad}"
    print(msg)
    assert not bad, msg
    assert checked >= MIN_CHECKED[cls], msg
    # The decode-step logits also meet the logits tolerance.
    rel = rel_errors(a, b)
    tol = tolerances(cls, kv)[0]
    assert rel.max() <= tol, f"{name}: chunk-1 max rel {rel.max():.3g} > {tol:g}"


# ---------------------------------------------------------------------------
# Bad input to `tandem eval`


@pytest.mark.parametrize("bad", [512, 513, 1 << 31, -1])
@pytest.mark.parametrize("name", ["llama2-f32-gguf", "qwen2-f32-hf"])
def test_eval_rejects_out_of_range_token(name, bad):
    e = BY_NAME[name]
    assert e["config"]["n_vocab"] == 512
    r, out = tandem_eval_raw(model_path(e), [[1, 2, 3], [4, bad, 6]], check=False)
    assert out is None
    assert r.returncode is not None and r.returncode > 0, r.describe()
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines, "no error message on stderr\n" + r.describe()
    assert any("token" in ln.lower() or str(bad) in ln for ln in lines), r.describe()


# ---------------------------------------------------------------------------
# Every kernel ISA against the reference (the default run above uses the best
# one the CPU has; the invariance tests compare ISAs only with each other).

ISA_MODELS = ["llama2-f32-gguf", "llama3-f16-gguf", "mistral-bf16-gguf", "qwen2-q8_0-gguf",
              "smollm2-q4_0-gguf", "tinyllama-q4_1-gguf", "smollm2-mixed-gguf", "qwen2-bf16-hf",
              "llama3-q5_0-gguf", "mistral-q5_1-gguf", "qwen25-q4_k-gguf", "qwen25-q5_k-gguf",
              "qwen25-q6_k-gguf", "tinyllama-q4_k_m-gguf"]


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("name", ISA_MODELS)
def test_logits_match_reference_every_isa(name, isa):
    e = BY_NAME[name]
    cls = e["tol_class"]
    seqs = sequences_for(e)[:2]
    r, out = tandem_eval_raw(model_path(e), seqs, isa=isa, check=False,
                             extra=("--kv-dtype", "f32"))
    if r.returncode != 0:
        must = isa == "scalar" or (isa == "avx2" and {"avx2", "fma", "f16c"} <= _cpu_flags())
        if not must and "cannot run" in r.stderr:
            pytest.skip(f"this CPU has no {isa}: {r.stderr.strip().splitlines()[-1]}")
        pytest.fail(f"tandem eval --isa {isa} failed\n{r.describe()}")
    m = ref_model(model_path(e))
    rel = np.concatenate([rel_errors(a, R.forward(m, s)) for s, a in zip(seqs, out)])
    msg = f"{name} --isa {isa}: max rel {rel.max():.3g}, mean {rel.mean():.3g}"
    print(msg)
    assert rel.max() <= TOL[cls], msg
    assert rel.mean() <= MEAN_TOL[cls], msg


@pytest.mark.parametrize("text", [
    '{"sequences": [[1, 2.5, 3]]}',
    '{"sequences": [[1, "2", 3]]}',
    '{"sequences": [1, 2, 3]}',
    '{"tokens": [[1, 2, 3]]}',
    '{"sequences": [[1, 2, 3]]',
    'not json at all',
])
def test_eval_rejects_malformed_tokens_file(text, tmp_path):
    from conftest import run_tandem

    tin = tmp_path / "in.json"
    tin.write_text(text)
    r = run_tandem("eval", "--model", model_path(BY_NAME["llama2-f32-gguf"]), "--tokens", tin,
                   "--out", tmp_path / "out.bin", check=False)
    assert r.returncode is not None and r.returncode > 0, r.describe()
    assert any(str(tin) in ln or "sequence" in ln.lower() or "json" in ln.lower()
               for ln in r.stderr.splitlines()), r.describe()


# ---------------------------------------------------------------------------
# KV cache dtypes: the engine with --kv-dtype against the reference rounding
# K and V the same way (see the module docstring for the tolerances).


def kv_rel(e, seqs, out, kv):
    m = ref_model(model_path(e))
    return np.concatenate([rel_errors(a, R.forward(m, s, kv_dtype=kv)) for s, a in zip(seqs, out)])


@pytest.mark.parametrize("kv", ["bf16"])  # f16: test_logits_match_reference, every model
@pytest.mark.parametrize("name", ISA_MODELS)
def test_logits_match_reference_kv_dtype(name, kv):
    e = BY_NAME[name]
    seqs = sequences_for(e)
    out = run_engine(e, seqs, kv=kv)
    rel = kv_rel(e, seqs, out, kv)
    msg = f"{name} --kv-dtype {kv}: max rel {rel.max():.3g}, mean {rel.mean():.3g}"
    print(msg)
    assert rel.max() <= KV_TOL[kv], msg
    assert rel.mean() <= KV_MEAN_TOL, msg


@pytest.mark.parametrize("isa", ["scalar", "avx2"])
@pytest.mark.parametrize("kv", ["f16", "bf16"])
def test_kv_dtype_every_isa_and_decode_steps(kv, isa):
    """The scalar and AVX2 kernels, one token per call (decode steps reading
    K/V back from the cache), against the rounded reference; the AVX-512
    kernels (the default here) with chunk 1 give the same bits as whole
    prompts (the invariance contract holds for every KV dtype)."""
    e = BY_NAME["llama3-f16-gguf"]
    seqs = sequences_for(e)[:2]
    r, out = tandem_eval_raw(model_path(e), seqs, isa=isa, chunk=1, check=False,
                             extra=("--kv-dtype", kv))
    assert r.returncode == 0, r.describe()
    rel = kv_rel(e, seqs, out, kv)
    msg = f"--isa {isa} --kv-dtype {kv} --chunk 1: max rel {rel.max():.3g}, mean {rel.mean():.3g}"
    print(msg)
    assert rel.max() <= KV_TOL[kv] and rel.mean() <= KV_MEAN_TOL, msg
    whole = run_engine(e, seqs, kv=kv)
    steps = run_engine(e, seqs, kv=kv, chunk=1)
    for a, b in zip(whole, steps):
        assert np.array_equal(a, b), "chunk 1 and whole prompts differ"


@pytest.mark.parametrize("bad", ["q8_0", "F16", "", "f64"])
def test_eval_rejects_bad_kv_dtype(bad):
    e = BY_NAME["llama2-f32-gguf"]
    r, out = tandem_eval_raw(model_path(e), [[1, 2, 3]], check=False, extra=("--kv-dtype", bad))
    assert out is None and r.returncode == 2, r.describe()
    assert "--kv-dtype" in r.stderr, r.describe()


# ---------------------------------------------------------------------------
# --act-int8: the quantized models' matmuls on activations quantized to 8 bits
# per 32-element block (llama.cpp's scheme). The reference quantizes nothing,
# so the engine's error is that rounding: bounded by ACT_INT8_TOL (max rel_t)
# and ACT_INT8_MEAN_TOL (mean), and above the f32-activation path's own error
# in mean (the flag takes effect). One token per call gives the same bits as
# whole prompts (the invariance contract holds with int8 activations; ctest
# also runs the invariance suite with them, test_invariance_act_int8).
# Every quantized type has int8-activation kernels (td_dtype_has_int8_kernels):
# every model with a quantized tensor runs here. A fused matmul whose weights
# differ in type (a Q4_K_M mix's Q4_K attn_q/attn_k beside its Q6_K attn_v)
# keeps f32 activations. Float weights keep f32 activations under the flag:
# the same bits as without it (test_act_int8_keeps_f32_for_float_weights).
ACT_INT8_TOL = 0.1
ACT_INT8_MEAN_TOL = 0.03
INT8_KERNEL_TYPES = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
QUANT_MODELS = [m["name"] for m in MANIFEST if INT8_KERNEL_TYPES & set(m["tensor_types"].values())]
FLOAT_MODELS = [m["name"] for m in MANIFEST if m["name"].startswith("qwen25-")
                and not INT8_KERNEL_TYPES & set(m["tensor_types"].values())]


@pytest.mark.parametrize("name", QUANT_MODELS)
def test_act_int8_against_reference(name):
    e = BY_NAME[name]
    seqs = sequences_for(e)[:2]
    m = ref_model(model_path(e))
    refs = [R.forward(m, s) for s in seqs]
    out = run_engine(e, seqs, extra=("--act-int8",))
    rel = np.concatenate([rel_errors(a, r) for a, r in zip(out, refs)])
    base = np.concatenate([rel_errors(a, r) for a, r in zip(run_engine(e, seqs), refs)])
    msg = (f"{name} --act-int8: max rel {rel.max():.3g}, mean {rel.mean():.3g} "
           f"(f32 activations: mean {base.mean():.3g})")
    print(msg)
    assert rel.max() <= ACT_INT8_TOL and rel.mean() <= ACT_INT8_MEAN_TOL, msg
    assert rel.mean() > 10 * base.mean(), f"--act-int8 had no effect: {msg}"
    steps = run_engine(e, seqs, extra=("--act-int8",), chunk=1)
    for a, b in zip(out, steps):
        assert np.array_equal(a, b), f"{name} --act-int8: chunk 1 and whole prompts differ"


@pytest.mark.parametrize("name", FLOAT_MODELS)
def test_act_int8_keeps_f32_for_float_weights(name):
    e = BY_NAME[name]
    seqs = sequences_for(e)[:2]
    base = run_engine(e, seqs)
    for chunk in (None, 1):
        out = run_engine(e, seqs, extra=("--act-int8",), chunk=chunk)
        for a, b in zip(out, base):
            assert np.array_equal(a, b), f"{name}: --act-int8 changed the logits (chunk {chunk})"


# ---------------------------------------------------------------------------
# The CPU matmuls read a private huge-page copy of the weights by default and
# the file mapping itself with --mmap: the same bytes, so the same bits, for
# a mixed-type GGUF, a model with biases, sharded safetensors (one mapping
# per shard: several copied ranges) and a TP plan (sliced weights), whole
# prompts and one token per call (the decode-sized matmuls).
@pytest.mark.parametrize("name,plan", [("llama3-mixed-gguf", ()), ("qwen2-q4_1-gguf", ()),
                                       ("tinyllama-bf16-hf-sharded", ()),
                                       ("llama2-q8_0-gguf", ("--tp", "2"))])
def test_weight_copy_same_bits_as_mmap(name, plan, monkeypatch):
    e = BY_NAME[name]
    seqs = sequences_for(e)[:2]
    monkeypatch.setenv("TD_LOG_LEVEL", "debug")  # the copy says so
    for mmap in ((), ("--mmap",)):
        r, _ = tandem_eval_raw(model_path(e), seqs, extra=(*mmap, *plan), check=False)
        assert r.returncode == 0, r.describe()
        assert ("copied to huge pages" in r.stderr) == (not mmap), r.describe()
    for chunk in (None, 1):
        copy = run_engine(e, seqs, extra=plan, threads=2, chunk=chunk)
        mapped = run_engine(e, seqs, extra=("--mmap", *plan), threads=2, chunk=chunk)
        for a, b in zip(copy, mapped):
            assert np.array_equal(a, b), f"{name} {plan}: the weight copy and --mmap differ"
