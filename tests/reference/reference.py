"""Independent NumPy reference of the Llama-family forward pass (float64).

Written from the model definitions (Llama / Mistral / Qwen2 as Hugging Face
transformers and llama.cpp define them), not from Tandem's C code. It reads
weights itself: GGUF through the gguf package (GGUFReader, and
gguf.quants.dequantize for F16/BF16/Q8_0/Q4_0/Q4_1/...), Hugging Face
directories through its own safetensors parser (numpy has no bfloat16, so the
safetensors package cannot read BF16 into numpy; for F32/F16 the parser is
checked against the package in tests).

    m = load(path)                  # GGUF file or HF directory
    logits = forward(m, tokens)     # (len(tokens), n_vocab) float64
    m.config                        # dict of hyper-parameters

Model definition implemented here, per layer l, for token rows x (T, E):
    h  = RMSNorm(x) * attn_norm                   RMSNorm(x) = x / sqrt(mean(x^2) + eps)
    q  = h Wq^T (+ bq), k = h Wk^T (+ bk), v = h Wv^T (+ bv)       (Qwen2: biases)
    q, k = RoPE(q, pos), RoPE(k, pos)
    a_h = softmax(q_h k_g^T / sqrt(D) + causal mask) v_g,   g = h // (H / KV)   (GQA)
    x  = x + concat(a) Wo^T
    h  = RMSNorm(x) * ffn_norm
    x  = x + (silu(h Wgate^T) * (h Wup^T)) Wdown^T
logits = (RMSNorm(x) * output_norm) Wout^T, Wout = token_embd when tied.

Mixture of experts (config "moe", Mixtral / Qwen2-MoE as transformers'
MixtralSparseMoeBlock and Qwen2MoeSparseMoeBlock define them), replacing the
FFN line for each token row h:
    p  = softmax(h Wrouter^T)                     (n_expert,)
    S  = the n_expert_used largest p (ties: lower expert id first)
    w_e = p_e / sum_S p  if norm_topk_prob (Mixtral always; Qwen2-MoE per
          config, false by default) else p_e
    ffn = sum_{e in S} w_e (silu(h Wg_e^T) * (h Wu_e^T)) Wd_e^T
          + sigmoid(h . w_shgate) * (silu(h Wg_sh^T) * (h Wu_sh^T)) Wd_sh^T   (Qwen2-MoE)
Expert tensors: GGUF merged blk.N.ffn_{gate,up,down}_exps (ne [cols, rows,
n_expert]) or per-expert blk.N.ffn_{gate,up,down}.E; HF Mixtral
block_sparse_moe.experts.E.w1/w3/w2, Qwen2-MoE mlp.experts.E.*_proj.

RoPE: angle(pos, i) = pos * inv_freq[i], inv_freq[i] = theta^(-2i/n_rot), i < n_rot/2.
  NORM (llama.cpp's LLAMA_ROPE_TYPE_NORM, used for GGUF arch "llama" whose Q/K
        rows convert_hf_to_gguf.py permuted): rotates pairs (2i, 2i+1).
  NEOX (HF "rotate_half", GGUF "qwen2"): rotates pairs (i, i + n_rot/2).
  Llama-3 scaling: HF config rope_scaling {rope_type: llama3, factor,
  low_freq_factor, high_freq_factor, original_max_position_embeddings} changes
  inv_freq per band; GGUF stores the per-frequency divisor as rope_freqs.weight.
  Linear scaling: inv_freq / factor.

act_round (optional): rounds the *input* of each matmul the way an engine
might before a low-precision dot product ("q8_0": per 32-block absmax int8,
"f16", "bf16"); used only to estimate how large such an engine's legitimate
deviation is, never to produce the expected values the engine is compared to.
"""

import json
import os
import struct

# Small matmuls: single-threaded BLAS is faster and does not fight other
# processes for cores (effective only when numpy is not imported yet).
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402

# ---------------------------------------------------------------------------
# Loading


class Model:
    def __init__(self, path, config, tensors):
        self.path = path
        self.config = config  # dict, see _finish_config
        self.t = tensors  # canonical name -> float64 array (rows = output features)
        self.wtypes = {}  # canonical name -> source type name (e.g. "Q4_1", "F32")


def _gguf_field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def load_gguf(path):
    import gguf

    r = gguf.GGUFReader(path)
    arch = _gguf_field(r, "general.architecture")
    if arch not in ("llama", "qwen2", "qwen2moe"):
        raise ValueError(f"{path}: unsupported architecture {arch!r}")

    def kv(k, default=None):
        return _gguf_field(r, f"{arch}.{k}", default)

    n_embd = int(kv("embedding_length"))
    n_head = int(kv("attention.head_count"))
    cfg = {
        "arch": arch,
        "n_embd": n_embd,
        "n_layer": int(kv("block_count")),
        "n_head": n_head,
        "n_head_kv": int(kv("attention.head_count_kv", n_head)),
        "n_ff": int(kv("feed_forward_length")),
        "head_dim": int(kv("attention.key_length", n_embd // n_head)),
        "n_rot": int(kv("rope.dimension_count", n_embd // n_head)),
        "rope_theta": float(kv("rope.freq_base", 10000.0)),
        "rms_eps": float(kv("attention.layer_norm_rms_epsilon")),
        "n_ctx_train": int(kv("context_length", 0)),
        # llama.cpp: arch llama -> NORM rope (Q/K permuted by the converter),
        # qwen2 / qwen2moe -> NEOX.
        "rope_mode": "norm" if arch == "llama" else "neox",
        "linear_factor": 1.0,
        "freq_divisors": None,
    }
    if kv("rope.scaling.type") == "linear":
        cfg["linear_factor"] = float(kv("rope.scaling.factor", 1.0))
    n_expert = int(kv("expert_count", 0))
    if n_expert > 0:
        used = int(kv("expert_used_count"))
        cfg["moe"] = {"n_expert": n_expert, "n_expert_used": used,
                      "norm_topk_prob": arch == "llama" or bool(kv("expert_weights_norm", False))}

    names = {
        "token_embd.weight": "tok_embd",
        "output_norm.weight": "output_norm",
        "output.weight": "output",
        "rope_freqs.weight": "rope_freqs",
    }
    per_layer = {
        "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk",
        "attn_v.weight": "wv", "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
        "attn_output.weight": "wo", "ffn_norm.weight": "ffn_norm", "ffn_gate.weight": "w_gate",
        "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
        "ffn_gate_inp.weight": "router", "ffn_gate_exps.weight": "exp_gate",
        "ffn_up_exps.weight": "exp_up", "ffn_down_exps.weight": "exp_down",
        "ffn_gate_inp_shexp.weight": "sh_inp", "ffn_gate_shexp.weight": "sh_gate",
        "ffn_up_shexp.weight": "sh_up", "ffn_down_shexp.weight": "sh_down",
    }
    t, types = {}, {}
    for ti in r.tensors:
        if ti.name in names:
            key = names[ti.name]
        elif ti.name.startswith("blk."):
            _, l, rest = ti.name.split(".", 2)
            parts = rest.split(".")
            if len(parts) == 3 and parts[0] in ("ffn_gate", "ffn_up", "ffn_down"):
                # per-expert tensor blk.N.ffn_gate.E.weight
                key = f"{int(l)}.exp_{parts[0][4:]}.{int(parts[1])}"
            elif rest not in per_layer:
                continue
            else:
                key = f"{int(l)}.{per_layer[rest]}"
        else:
            continue
        shape = tuple(int(x) for x in reversed(ti.shape))  # GGUF ne is innermost-first
        arr = gguf.quants.dequantize(ti.data, ti.tensor_type).astype(np.float64)
        t[key] = arr.reshape(shape) if len(shape) > 1 else arr.reshape(-1)
        types[key] = ti.tensor_type.name
    if "rope_freqs" in t:
        cfg["freq_divisors"] = t.pop("rope_freqs")
    if "moe" in cfg:
        _stack_experts(t, types, cfg)
    cfg["tied"] = "output" not in t
    cfg["n_vocab"] = int(t["tok_embd"].shape[0])
    m = Model(path, _finish_config(cfg), t)
    m.wtypes = types
    return m


def _stack_experts(t, types, cfg):
    """Per-expert tensors "L.exp_gate.E" -> one (n_expert, rows, cols) array
    "L.exp_gate", as GGUF's merged form and the forward pass expect."""
    n = cfg["moe"]["n_expert"]
    for l in range(cfg["n_layer"]):
        for part in ("gate", "up", "down"):
            key = f"{l}.exp_{part}"
            if key in t:
                if t[key].shape[0] != n:
                    raise ValueError(f"{key}: {t[key].shape[0]} experts, want {n}")
                continue
            mats = []
            for x in range(n):
                k = f"{key}.{x}"
                if k not in t:
                    raise ValueError(f"missing expert tensor {k}")
                mats.append(t.pop(k))
                types[key] = types.pop(k)
            t[key] = np.stack(mats)


_ST_DTYPES = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": (None, 2), "F64": ("<f8", 8)}


def read_safetensors(path):
    """name -> float64 array. Bounds-checked; raises ValueError on a bad file."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: truncated")
    (hlen,) = struct.unpack("<Q", data[:8])
    if 8 + hlen > len(data):
        raise ValueError(f"{path}: header length {hlen} past end")
    header = json.loads(data[8:8 + hlen])
    base = 8 + hlen
    out, types = {}, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = info["dtype"]
        if dt not in _ST_DTYPES:
            raise ValueError(f"{path}: {name}: dtype {dt} unsupported")
        b, e = info["data_offsets"]
        shape = tuple(info["shape"])
        n = int(np.prod(shape)) if shape else 1
        if not (0 <= b <= e and base + e <= len(data)) or e - b != n * _ST_DTYPES[dt][1]:
            raise ValueError(f"{path}: {name}: bad data_offsets {b}..{e}")
        raw = data[base + b:base + e]
        if dt == "BF16":
            u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = u.view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=_ST_DTYPES[dt][0])
        out[name] = arr.astype(np.float64).reshape(shape)
        types[name] = dt
    return out, types


def load_hf(path):
    with open(os.path.join(path, "config.json")) as f:
        hc = json.load(f)
    archs = hc.get("architectures") or []
    if archs and archs[0] in ("LlamaForCausalLM", "MistralForCausalLM"):
        arch = "llama"
    elif archs and archs[0] == "Qwen2ForCausalLM":
        arch = "qwen2"
    elif archs and archs[0] == "MixtralForCausalLM":
        arch = "mixtral"
    elif archs and archs[0] == "Qwen2MoeForCausalLM":
        arch = "qwen2moe"
    else:
        raise ValueError(f"{path}: unsupported architectures {archs}")
    n_embd = hc["hidden_size"]
    n_head = hc["num_attention_heads"]
    head_dim = hc.get("head_dim") or n_embd // n_head
    cfg = {
        "arch": arch,
        "n_embd": n_embd,
        "n_layer": hc["num_hidden_layers"],
        "n_head": n_head,
        "n_head_kv": hc.get("num_key_value_heads") or n_head,
        "n_ff": hc["intermediate_size"],
        "head_dim": head_dim,
        "n_rot": head_dim,
        "rope_theta": float(hc.get("rope_theta", 10000.0)),
        "rms_eps": float(hc["rms_norm_eps"]),
        "n_ctx_train": int(hc.get("max_position_embeddings", 0)),
        "rope_mode": "neox",  # HF rotate_half, Q/K in checkpoint order
        "linear_factor": 1.0,
        "freq_divisors": None,
    }
    if arch == "mixtral":
        cfg["moe"] = {"n_expert": hc["num_local_experts"],
                      "n_expert_used": hc["num_experts_per_tok"], "norm_topk_prob": True}
    elif arch == "qwen2moe":
        cfg["moe"] = {"n_expert": hc["num_experts"], "n_expert_used": hc["num_experts_per_tok"],
                      "norm_topk_prob": bool(hc.get("norm_topk_prob", False))}
    rs = hc.get("rope_scaling")
    if rs:
        rtype = rs.get("rope_type", rs.get("type"))
        if rtype == "llama3":
            cfg["freq_divisors"] = _hf_llama3_divisors(cfg, rs)
        elif rtype == "linear":
            cfg["linear_factor"] = float(rs["factor"])
        elif rtype not in (None, "default"):
            raise ValueError(f"{path}: rope_scaling type {rtype} unsupported")

    idx = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    raw, rtypes = {}, {}
    for fn in files:
        a, ty = read_safetensors(os.path.join(path, fn))
        raw.update(a)
        rtypes.update(ty)

    t, types = {}, {}

    def take(hf, key, required=True):
        if hf in raw:
            t[key] = raw[hf]
            types[key] = rtypes[hf]
        elif required:
            raise ValueError(f"{path}: missing tensor {hf}")

    take("model.embed_tokens.weight", "tok_embd")
    take("model.norm.weight", "output_norm")
    take("lm_head.weight", "output", required=not hc.get("tie_word_embeddings", False))
    for l in range(cfg["n_layer"]):
        p = f"model.layers.{l}."
        take(p + "input_layernorm.weight", f"{l}.attn_norm")
        for hn, k in (("q", "q"), ("k", "k"), ("v", "v")):
            take(p + f"self_attn.{hn}_proj.weight", f"{l}.w{k}")
            take(p + f"self_attn.{hn}_proj.bias", f"{l}.b{k}", required=False)
        take(p + "self_attn.o_proj.weight", f"{l}.wo")
        take(p + "post_attention_layernorm.weight", f"{l}.ffn_norm")
        if arch == "mixtral":
            take(p + "block_sparse_moe.gate.weight", f"{l}.router")
            for x in range(cfg["moe"]["n_expert"]):
                e = p + f"block_sparse_moe.experts.{x}."
                take(e + "w1.weight", f"{l}.exp_gate.{x}")
                take(e + "w3.weight", f"{l}.exp_up.{x}")
                take(e + "w2.weight", f"{l}.exp_down.{x}")
        elif arch == "qwen2moe":
            take(p + "mlp.gate.weight", f"{l}.router")
            for x in range(cfg["moe"]["n_expert"]):
                e = p + f"mlp.experts.{x}."
                take(e + "gate_proj.weight", f"{l}.exp_gate.{x}")
                take(e + "up_proj.weight", f"{l}.exp_up.{x}")
                take(e + "down_proj.weight", f"{l}.exp_down.{x}")
            if hc["shared_expert_intermediate_size"] > 0:
                take(p + "mlp.shared_expert.gate_proj.weight", f"{l}.sh_gate")
                take(p + "mlp.shared_expert.up_proj.weight", f"{l}.sh_up")
                take(p + "mlp.shared_expert.down_proj.weight", f"{l}.sh_down")
                take(p + "mlp.shared_expert_gate.weight", f"{l}.sh_inp")
                t[f"{l}.sh_inp"] = t[f"{l}.sh_inp"].reshape(-1)
        else:
            take(p + "mlp.gate_proj.weight", f"{l}.w_gate")
            take(p + "mlp.up_proj.weight", f"{l}.w_up")
            take(p + "mlp.down_proj.weight", f"{l}.w_down")
    if "moe" in cfg:
        _stack_experts(t, types, cfg)
    cfg["tied"] = "output" not in t
    cfg["n_vocab"] = int(t["tok_embd"].shape[0])
    m = Model(path, _finish_config(cfg), t)
    m.wtypes = types
    return m


def _hf_llama3_divisors(cfg, rs):
    """transformers' _compute_llama3_parameters, expressed as divisors of the
    unscaled inverse frequencies."""
    d = cfg["n_rot"]
    inv = cfg["rope_theta"] ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    factor = float(rs["factor"])
    lo = float(rs["low_freq_factor"])
    hi = float(rs["high_freq_factor"])
    old = float(rs["original_max_position_embeddings"])
    wavelen = 2 * np.pi / inv
    new = np.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * new / factor + smooth * new
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    new = np.where(medium, smoothed, new)
    return inv / new


def _finish_config(cfg):
    d = cfg["n_rot"]
    inv = cfg["rope_theta"] ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    if cfg["freq_divisors"] is not None:
        inv = inv / np.asarray(cfg["freq_divisors"], dtype=np.float64)
    cfg["inv_freq"] = inv / cfg["linear_factor"]
    return cfg


def load(path):
    """A GGUF file or a Hugging Face directory."""
    if os.path.isdir(path):
        return load_hf(path)
    return load_gguf(path)


# ---------------------------------------------------------------------------
# Forward


def _round_act(x, mode):
    if mode is None:
        return x
    if mode == "f16":
        return x.astype(np.float16).astype(np.float64)
    if mode == "bf16":
        u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        return u.astype(np.uint32).view(np.float32).astype(np.float64)
    if mode == "q8_0":
        shp = x.shape
        b = x.reshape(*shp[:-1], shp[-1] // 32, 32)
        amax = np.abs(b).max(axis=-1, keepdims=True)
        d = (amax / 127.0).astype(np.float16).astype(np.float64)
        safe = np.where(d == 0, 1.0, d)
        q = np.where(d == 0, 0.0, np.round(b / safe))
        return (q * d).reshape(shp)
    raise ValueError(mode)


def _act_mode(m, key, act_round):
    """act_round: None, a mode string for every matmul, or a dict weight-type -> mode."""
    if act_round is None or isinstance(act_round, str):
        return act_round
    return act_round.get(m.wtypes.get(key, "F32"))


def _matmul(m, x, key, act_round):
    return _round_act(x, _act_mode(m, key, act_round)) @ m.t[key].T


def _rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, inv_freq, mode):
    """x (T, heads, D); rotates the first n_rot = 2 * len(inv_freq) dims."""
    n_rot = 2 * len(inv_freq)
    ang = pos[:, None].astype(np.float64) * inv_freq[None, :]  # (T, n_rot/2)
    cos = np.cos(ang)[:, None, :]
    sin = np.sin(ang)[:, None, :]
    out = x.copy()
    if mode == "norm":
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    elif mode == "neox":
        h = n_rot // 2
        a, b = x[..., :h], x[..., h:n_rot]
        out[..., :h] = a * cos - b * sin
        out[..., h:n_rot] = a * sin + b * cos
    else:
        raise ValueError(mode)
    return out


def round_kv(x, kv_dtype):
    """K or V as a KV cache of kv_dtype holds them: the float32 values the
    engine computes, rounded to nearest even in f16 or bf16."""
    if kv_dtype in (None, "f32"):
        return x
    return _round_act(x.astype(np.float32).astype(np.float64), kv_dtype)


def forward(m, tokens, act_round=None, rope_mode=None, kv_dtype=None):
    """Logits (T, n_vocab) for every position of one sequence starting at
    position 0. rope_mode overrides the file's convention (for self-checks).
    kv_dtype ("f16", "bf16"): attention reads K and V rounded to it, as the
    engine's KV cache stores them (--kv-dtype); None or "f32": unrounded."""
    c = m.config
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 1 or len(tokens) == 0:
        raise ValueError("tokens must be a non-empty 1-D sequence")
    if tokens.min() < 0 or tokens.max() >= c["n_vocab"]:
        raise ValueError("token id out of range")
    T = len(tokens)
    H, KV, D = c["n_head"], c["n_head_kv"], c["head_dim"]
    mode = rope_mode or c["rope_mode"]
    pos = np.arange(T)
    x = m.t["tok_embd"][tokens].copy()  # (T, E)
    causal = np.triu(np.full((T, T), -np.inf), k=1)
    for l in range(c["n_layer"]):
        p = f"{l}."
        h = _rmsnorm(x, m.t[p + "attn_norm"], c["rms_eps"])
        q = _matmul(m, h, p + "wq", act_round)
        k = _matmul(m, h, p + "wk", act_round)
        v = _matmul(m, h, p + "wv", act_round)
        if p + "bq" in m.t:
            q = q + m.t[p + "bq"]
            k = k + m.t[p + "bk"]
            v = v + m.t[p + "bv"]
        q = rope(q.reshape(T, H, D), pos, c["inv_freq"], mode)
        k = round_kv(rope(k.reshape(T, KV, D), pos, c["inv_freq"], mode), kv_dtype)
        v = round_kv(v.reshape(T, KV, D), kv_dtype)
        g = np.arange(H) // (H // KV)
        s = np.einsum("thd,shd->hts", q, k[:, g, :]) / np.sqrt(D) + causal
        s = s - s.max(axis=-1, keepdims=True)
        pr = np.exp(s)
        pr /= pr.sum(axis=-1, keepdims=True)
        a = np.einsum("hts,shd->thd", pr, v[:, g, :]).reshape(T, H * D)
        x = x + _matmul(m, a, p + "wo", act_round)
        h = _rmsnorm(x, m.t[p + "ffn_norm"], c["rms_eps"])
        if "moe" in c:
            x = x + moe_ffn(m, l, h, act_round)
            continue
        gt = _matmul(m, h, p + "w_gate", act_round)
        up = _matmul(m, h, p + "w_up", act_round)
        x = x + _matmul(m, gt / (1.0 + np.exp(-gt)) * up, p + "w_down", act_round)
    h = _rmsnorm(x, m.t["output_norm"], c["rms_eps"])
    return _matmul(m, h, "tok_embd" if c["tied"] else "output", act_round)


def route(probs, k, norm):
    """(ids, weights) of the k most probable experts of one row, ties to the
    lower id (a stable sort of -p keeps ascending ids among equals)."""
    ids = np.argsort(-probs, kind="stable")[:k]
    w = probs[ids]
    if norm:
        w = w / w.sum()
    return ids, w


def moe_ffn(m, l, h, act_round=None):
    """The MoE FFN of layer l on normed rows h (T, E) (see the module docstring)."""
    c = m.config["moe"]
    p = f"{l}."
    logits = _matmul(m, h, p + "router", act_round)
    logits = logits - logits.max(axis=-1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.zeros_like(h)
    wg, wu, wd = m.t[p + "exp_gate"], m.t[p + "exp_up"], m.t[p + "exp_down"]
    for t in range(h.shape[0]):
        ids, w = route(probs[t], c["n_expert_used"], c["norm_topk_prob"])
        ht = _round_act(h[t:t + 1], _act_mode(m, p + "exp_gate", act_round))
        for e, we in zip(ids, w):
            g = ht @ wg[e].T
            a = g / (1.0 + np.exp(-g)) * (ht @ wu[e].T)
            a = _round_act(a, _act_mode(m, p + "exp_down", act_round))
            out[t] += we * (a @ wd[e].T)[0]
    if p + "sh_gate" in m.t:
        g = _matmul(m, h, p + "sh_gate", act_round)
        a = g / (1.0 + np.exp(-g)) * _matmul(m, h, p + "sh_up", act_round)
        sh = _matmul(m, a, p + "sh_down", act_round)
        gate = 1.0 / (1.0 + np.exp(-(h @ m.t[p + "sh_inp"])))
        out += gate[:, None] * sh
    return out


def greedy(m, prompt, n):
    """Reference greedy continuation: prompt + n argmax tokens."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(forward(m, seq)[-1])))
    return seq


def unpermute_qk(w, n_head):
    """Inverse of convert_hf_to_gguf.py's permute: GGUF interleaved-pair rows
    of each head back to HF half-split order."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def main(argv=None):
    """Command line: print the reference's top tokens per position, or its
    greedy continuation, or save the logits (debugging aid)."""
    import argparse

    ap = argparse.ArgumentParser(description="NumPy reference forward pass (float64)")
    ap.add_argument("model", help="GGUF file or Hugging Face directory")
    ap.add_argument("--tokens", required=True, help="comma-separated token ids")
    ap.add_argument("--top", type=int, default=3, help="top-k ids printed per position")
    ap.add_argument("--greedy", type=int, default=0, help="print N greedy tokens instead")
    ap.add_argument("--out", help="save logits (T, n_vocab) float32, raw little-endian")
    a = ap.parse_args(argv)
    m = load(a.model)
    toks = [int(t) for t in a.tokens.split(",") if t.strip()]
    if a.greedy:
        print(",".join(str(t) for t in greedy(m, toks, a.greedy)[len(toks):]))
        return 0
    lg = forward(m, toks)
    if a.out:
        lg.astype("<f4").tofile(a.out)
    for t, row in enumerate(lg):
        top = np.argsort(-row)[:a.top]
        print(t, " ".join(f"{int(i)}:{row[i]:.4f}" for i in top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
