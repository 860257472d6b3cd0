#!/usr/bin/env python3
"""Generate tiny random Llama-family test models (GGUF and HF safetensors).

    make_models.py --out DIR [--force]

Writes, deterministically (fixed seeds) and in a few seconds:
  DIR/gguf/<arch>-<wtype>.gguf     every architecture x F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0
                                   Q5_1 MIXED; K-quants (Q4_K Q5_K Q6_K Q4_K_M) where
                                   the shapes allow (see K-QUANTS below)
  DIR/hf/<arch>-<dtype>/           every architecture x F32 F16 BF16 (config.json,
                                   model.safetensors, tokenizer.json, tokenizer_config.json)
  DIR/hf/<arch>-<dtype>-sharded/   one sharded directory (index.json + 2 shards)
  DIR/models.json                  the manifest (see MANIFEST below)
  DIR/.stamp                       VERSION; when it matches, nothing is regenerated

All files of one architecture hold the same underlying weights (seeded by the
architecture name), converted the way the real tools convert them:
  * HF safetensors: HF tensor names, Q/K rows in HF order (RoPE rotates the
    two halves of each head: NeoX style "rotate_half").
  * GGUF "llama": Q/K rows permuted exactly as convert_hf_to_gguf.py's
    LlamaModel.permute does, so that llama.cpp's NORM RoPE (adjacent pairs)
    computes the same function.  GGUF "qwen2": not permuted (NeoX RoPE).
  * Llama-3 RoPE scaling: config.json carries rope_scaling {rope_type llama3,
    factor, low_freq_factor, high_freq_factor, original_max_position_embeddings};
    GGUF carries the per-frequency factors as the F32 tensor rope_freqs.weight
    (n_rot/2 values; the angle of pair i is pos * theta^(-2i/n_rot) / rope_freqs[i]),
    as convert_hf_to_gguf.py writes for Llama 3.1+ (no scaling metadata keys).
  * 1-D tensors (norms, biases, rope_freqs) stay F32 in every GGUF file, as
    llama.cpp's converter and quantizer keep them.
  * MIXED mirrors the default model's file: Q4_1 layer matrices, Q8_0
    token_embd (and output when untied), F32 norms.
  * K-QUANTS. Q4_K, Q5_K and Q6_K pack rows in super-blocks of 256, so a file
    of one K type exists only for a variant whose every matrix row (n_embd,
    n_head*head_dim, n_ff) is a multiple of 256 (qwen25). Q4_K_M is
    llama.cpp's mix (llama-quant.cpp, llama_tensor_get_type): Q4_K, but Q6_K
    for output (token_embd when tied) and for attn_v and ffn_down of the
    layers use_more_bits picks (the last one of 2 or 3 layers), and where a
    row is not whole super-blocks its fallback, Q5_0 for Q4_K and Q8_0 for
    Q6_K; written for every variant where at least one matrix gets a K type
    (qwen25: Q4_K and Q6_K only; llama3, smollm2, tinyllama, whose n_ff is
    256: K types in ffn_down, Q5_0 and Q8_0 elsewhere). The K types are
    quantized by tests/models/quants_k.py (gguf-py has no K quantizer);
    Q5_0/Q5_1 by gguf-py.
  * Tokenizer: one small byte-level BPE (vocab 512: 3 special tokens, 256
    byte tokens, 253 merges) trained with the `tokenizers` package; written as
    tokenizer.json in HF dirs and as tokenizer.ggml.* (model gpt2, pre
    "default") in GGUF files.

The output head is scaled (output_scale) so that logits are peaked: at random
positions the top-1/top-2 logit margin is typically > 1.

Mixture-of-experts models (MOE_VARIANTS) go to DIR/gguf/<variant>-<wtype>.gguf
(F32, Q8_0 and Q5_0) and DIR/hf/<variant>-f32/, listed under "moe_models" (not
"models", whose consumers expect dense FFN tensors):
  * mixtral: GGUF arch "llama" with llama.expert_count / expert_used_count,
    router blk.N.ffn_gate_inp.weight (n_expert, n_embd), experts as merged 3-D
    blk.N.ffn_{gate,up,down}_exps.weight (F32 file) or, as older llama.cpp
    conversions wrote them, one blk.N.ffn_{gate,up,down}.E.weight per expert
    (Q8_0 file); HF MixtralForCausalLM (block_sparse_moe.gate,
    block_sparse_moe.experts.E.w1/w2/w3; w1 gate, w3 up, w2 down).
  * qwen2moe: GGUF arch "qwen2moe" (expert_feed_forward_length,
    expert_shared_feed_forward_length, ffn_*_exps, ffn_*_shexp and the 1-D
    sigmoid gate ffn_gate_inp_shexp.weight); HF Qwen2MoeForCausalLM (mlp.gate,
    mlp.experts.E.*_proj, mlp.shared_expert.*_proj, mlp.shared_expert_gate
    (1, n_embd)), norm_topk_prob false (Qwen1.5-MoE's setting).
  Routers and the shared-expert gate stay F32 in quantized files (llama.cpp's
  quantizer leaves ffn_gate_inp alone).

Padded-vocabulary models (VOCAB_VARIANTS) go to DIR/hf/<variant>-f32/ and
DIR/hf/<variant>-f32-passthrough/, listed under "vocab_models": config.json
declares vocab_size past the tokenizer's 512 tokens (as Qwen2's configs do),
so the embedding and head have rows no token text reaches and a count that
TP splits unevenly. The passthrough directory holds the same weights with
o_proj and down_proj zero: every layer adds exactly 0 to the residual
stream, so the logits are the head applied to the normed embedding and
agree bit for bit across TP splits (the embedding and head isolated).

MANIFEST (models.json): {"version": VERSION, "models": [entry...],
  "moe_models": [entry...], "vocab_models": [entry...]}, entry =
  name, path (relative to DIR), format ("gguf"|"hf"), arch ("llama"|"qwen2"),
  variant (llama2, llama3, mistral, qwen2, qwen25, smollm2, tinyllama), wtype
  (F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 MIXED Q4_K Q5_K Q6_K Q4_K_M),
  tensor_types ({tensor role: type of layer 0's tensor, plus "blk.N.role":
  type for a layer whose type differs}), tol_class
  ("f32"|"f16"|"bf16"|"q8"|"q4"|"q5"|"qk"), sharded, tied, config {n_vocab n_embd
  n_layer n_head n_head_kv head_dim n_ff n_ctx_train rope_theta rms_eps
  rope_mode ("norm"|"neox": the convention of THIS file) rope_scaling (null or
  {type factor low_freq_factor high_freq_factor original_ctx}) qkv_bias bos
  eos}; MoE entries add config.moe {n_expert n_expert_used n_ff_exp
  n_ff_shexp norm_topk_prob} and expert_layout ("merged"|"per_expert"|"hf").
"""

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quants_k  # noqa: E402

VERSION = "tandem-test-models-v10"

N_VOCAB = 512
N_CTX = 256
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID = 1  # as SmolLM2: <|im_start|>
EOS_ID = 2  # <|im_end|>
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Architecture variants. head_dim * n_head == n_embd for all (as in the real
# models); every row length is a multiple of 32 (quant block size).
VARIANTS = {
    # Llama-2 style: multi-head attention (n_head_kv == n_head), separate head.
    "llama2": dict(arch="llama", hf_arch="LlamaForCausalLM", n_embd=64, n_head=4,
                   n_head_kv=4, n_ff=192, n_layer=2, rope_theta=10000.0, rms_eps=1e-5,
                   tied=False, rope_scaling=None),
    # Llama-3.2 style: GQA 2:1, tied head, llama3 RoPE scaling.  original_ctx
    # is small so that the three frequency bands (kept, smoothed, divided by
    # factor) all occur at head_dim 32.
    "llama3": dict(arch="llama", hf_arch="LlamaForCausalLM", n_embd=128, n_head=4,
                   n_head_kv=2, n_ff=256, n_layer=2, rope_theta=500000.0, rms_eps=1e-5,
                   tied=True,
                   rope_scaling=dict(type="llama3", factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_ctx=64)),
    # Mistral: llama arch, multi-query (n_head_kv 1), separate head.
    "mistral": dict(arch="llama", hf_arch="MistralForCausalLM", n_embd=64, n_head=4,
                    n_head_kv=1, n_ff=192, n_layer=2, rope_theta=1000000.0, rms_eps=1e-5,
                    tied=False, rope_scaling=None),
    # Qwen2: QKV bias, NeoX RoPE, tied head.
    "qwen2": dict(arch="qwen2", hf_arch="Qwen2ForCausalLM", n_embd=64, n_head=4,
                  n_head_kv=2, n_ff=192, n_layer=2, rope_theta=1000000.0, rms_eps=1e-6,
                  tied=True, rope_scaling=None),
    # SmolLM2: llama arch, GQA 3:1 (9:3 in the real one), tied head, 3 layers.
    "smollm2": dict(arch="llama", hf_arch="LlamaForCausalLM", n_embd=96, n_head=6,
                    n_head_kv=2, n_ff=256, n_layer=3, rope_theta=100000.0, rms_eps=1e-5,
                    tied=True, rope_scaling=None),
    # TinyLlama: GQA 4:1 (32:4 in the real one), separate head.
    "tinyllama": dict(arch="llama", hf_arch="LlamaForCausalLM", n_embd=128, n_head=8,
                      n_head_kv=2, n_ff=256, n_layer=2, rope_theta=10000.0, rms_eps=1e-5,
                      tied=False, rope_scaling=None),
    # Qwen2.5-0.5B's shape (QKV bias, GQA, head_dim 64, tied) at the smallest
    # width whose every row is whole K-quant super-blocks: n_embd 256 (one per
    # row), n_ff 768 (three, in ffn_down's rows).
    "qwen25": dict(arch="qwen2", hf_arch="Qwen2ForCausalLM", n_embd=256, n_head=4,
                   n_head_kv=2, n_ff=768, n_layer=2, rope_theta=1000000.0, rms_eps=1e-6,
                   tied=True, rope_scaling=None),
}

# Mixture-of-experts variants: n_ff is one expert's width; 2 and 4 divide the
# heads and the experts, and 4-way shards of every row (head_dim 32, FFN widths)
# are whole Q8_0 blocks. The router's rows are scaled (ROUTER_SCALE) so that
# the routing probabilities are far from uniform.
MOE_VARIANTS = {
    "mixtral": dict(arch="llama", hf_arch="MixtralForCausalLM", n_embd=128, n_head=4,
                    n_head_kv=2, n_ff=128, n_layer=2, rope_theta=1000000.0, rms_eps=1e-5,
                    tied=False, rope_scaling=None, n_expert=4, n_used=2, n_ff_shexp=0,
                    norm_topk=True),
    "qwen2moe": dict(arch="qwen2moe", hf_arch="Qwen2MoeForCausalLM", n_embd=128, n_head=4,
                     n_head_kv=2, n_ff=128, n_layer=2, rope_theta=1000000.0, rms_eps=1e-6,
                     tied=False, rope_scaling=None, n_expert=8, n_used=2, n_ff_shexp=256,
                     norm_topk=False, dense_ff=128),
}
MOE_GGUF_WTYPES = ["F32", "Q8_0", "Q5_0"]  # Q5_0: a new type through the expert path
MOE_HF_DTYPES = ["F32"]
PER_EXPERT_GGUF = ("mixtral", "Q8_0")  # the one GGUF file with per-expert tensors
ROUTER_SCALE = 3.0

# Padded vocabulary: 515 rows (neither 2 nor 3 divides it); 6 heads, 6 KV
# heads and n_ff 192 allow TP 2 and 3.
VOCAB_VARIANTS = {
    "vocab515": dict(arch="llama", hf_arch="LlamaForCausalLM", n_embd=96, n_head=6,
                     n_head_kv=6, n_ff=192, n_layer=2, rope_theta=10000.0, rms_eps=1e-5,
                     tied=False, rope_scaling=None, n_vocab=515),
}

GGUF_WTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MIXED"]
K_WTYPES = ["Q4_K", "Q5_K", "Q6_K"]  # where every row is whole super-blocks
QK_K = 256
HF_DTYPES = ["F32", "F16", "BF16"]
SHARDED = ("tinyllama", "BF16")  # the one sharded HF directory

TOL_CLASS = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8", "Q4_0": "q4",
             "Q4_1": "q4", "MIXED": "q4", "Q5_0": "q5", "Q5_1": "q5", "Q4_K": "qk",
             "Q5_K": "qk", "Q6_K": "qk", "Q4_K_M": "qk"}

# Logit scale: the final RMSNorm output has unit RMS, the head rows have unit
# RMS after scaling by 1/sqrt(n_embd), so logits would be ~N(0, 1); this factor
# makes the top-1/top-2 margin typically > 1 (see tests/reference self-check).
OUTPUT_SCALE = 8.0
EMBD_TIED = 0.15


# ----------------------------------------------------------------------------
# Tokenizer


def _corpus():
    """Deterministic training text: fixed sentences plus seeded pseudo-words."""
    base = (
        "The quick brown fox jumps over the lazy dog. What is the capital of France? "
        "Paris is the capital of France. Hello, world! It's 2024 and we've got 12345 "
        "tokens; don't they'll re-use them? Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. "
        "    indented   code() { return x + y * 2; }\n\ttabs\nnew lines\n"
        "caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \U0001F600 emoji.\n"
    )
    rng = np.random.default_rng(12345)
    syll = ["ka", "to", "ri", "an", "en", "th", "er", "in", "on", "st", "re", "ou", "ing",
            "ed", "es", "al", "le", "de", "co", "pro", "ma", "ne", "si", "lu", "ve", "ol"]
    words = []
    for _ in range(4000):
        n = int(rng.integers(1, 4))
        w = "".join(syll[int(i)] for i in rng.integers(0, len(syll), n))
        if rng.random() < 0.1:
            w = w.capitalize()
        if rng.random() < 0.05:
            w += str(int(rng.integers(0, 1000)))
        words.append(w)
        if rng.random() < 0.08:
            words.append(rng.choice([",", ".", "!", "?", ";"]))
    return [base] * 20 + [" ".join(words[i:i + 40]) for i in range(0, len(words), 40)]


def build_tokenizer():
    """Returns (tokenizer.json text, tokens list, token types, merges list)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=N_VOCAB, min_frequency=1,
                                  special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() != N_VOCAB:
        raise SystemExit(f"make_models: tokenizer has {tok.get_vocab_size()} tokens, want {N_VOCAB}")
    text = tok.to_str(pretty=False)
    j = json.loads(text)
    vocab = j["model"]["vocab"]
    tokens = [None] * N_VOCAB
    for s, i in vocab.items():
        tokens[i] = s
    for at in j.get("added_tokens", []):
        tokens[at["id"]] = at["content"]
    if any(t is None for t in tokens):
        raise SystemExit("make_models: tokenizer vocabulary has holes")
    merges = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
    # llama.cpp token types: 1 normal, 3 control.
    types = [3 if t in SPECIAL_TOKENS else 1 for t in tokens]
    return text, tokens, types, merges


# ----------------------------------------------------------------------------
# Weights (HF layout, float32 master copy)


def make_weights(variant, v):
    """HF-named float32 weights for a variant, deterministic in its name."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(variant)) + 1000
    rng = np.random.default_rng(seed)
    E, H, KV, F, L = v["n_embd"], v["n_head"], v["n_head_kv"], v["n_ff"], v["n_layer"]
    D = E // H
    V = v.get("n_vocab", N_VOCAB)

    def mat(rows, cols, scale=1.0):
        return (rng.standard_normal((rows, cols)) * (scale / np.sqrt(cols))).astype(np.float32)

    def gain(n):
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    w = {}
    # Embedding rows: unit RMS when the head is separate.  A tied head reads
    # logits from the embedding, and the final hidden state still contains the
    # input token's own embedding, so with unit-RMS rows a random tied model
    # just echoes its input; small rows (EMBD_TIED) keep the residual stream
    # dominated by the layers, and the final norm carries the head's scale.
    embd_scale = EMBD_TIED if v["tied"] else 1.0
    w["model.embed_tokens.weight"] = (embd_scale * rng.standard_normal((V, E))).astype(np.float32)
    for l in range(L):
        p = f"model.layers.{l}."
        w[p + "input_layernorm.weight"] = gain(E)
        # Unit-RMS q and k rows: attention scores ~N(0, 1), visibly
        # non-uniform without making the model hypersensitive to rounding.
        w[p + "self_attn.q_proj.weight"] = mat(H * D, E)
        w[p + "self_attn.k_proj.weight"] = mat(KV * D, E)
        w[p + "self_attn.v_proj.weight"] = mat(KV * D, E)
        if v["arch"] in ("qwen2", "qwen2moe"):
            w[p + "self_attn.q_proj.bias"] = (0.5 * rng.standard_normal(H * D)).astype(np.float32)
            w[p + "self_attn.k_proj.bias"] = (0.5 * rng.standard_normal(KV * D)).astype(np.float32)
            w[p + "self_attn.v_proj.bias"] = (0.5 * rng.standard_normal(KV * D)).astype(np.float32)
        w[p + "self_attn.o_proj.weight"] = mat(E, H * D)
        w[p + "post_attention_layernorm.weight"] = gain(E)
        if "n_expert" in v and v["arch"] == "llama":
            m = p + "block_sparse_moe."
            w[m + "gate.weight"] = mat(v["n_expert"], E, ROUTER_SCALE)
            for x in range(v["n_expert"]):
                w[m + f"experts.{x}.w1.weight"] = mat(F, E)
                w[m + f"experts.{x}.w3.weight"] = mat(F, E)
                w[m + f"experts.{x}.w2.weight"] = mat(E, F)
        elif "n_expert" in v:
            S = v["n_ff_shexp"]
            w[p + "mlp.gate.weight"] = mat(v["n_expert"], E, ROUTER_SCALE)
            for x in range(v["n_expert"]):
                w[p + f"mlp.experts.{x}.gate_proj.weight"] = mat(F, E)
                w[p + f"mlp.experts.{x}.up_proj.weight"] = mat(F, E)
                w[p + f"mlp.experts.{x}.down_proj.weight"] = mat(E, F)
            w[p + "mlp.shared_expert.gate_proj.weight"] = mat(S, E)
            w[p + "mlp.shared_expert.up_proj.weight"] = mat(S, E)
            w[p + "mlp.shared_expert.down_proj.weight"] = mat(E, S)
            w[p + "mlp.shared_expert_gate.weight"] = mat(1, E)
        else:
            w[p + "mlp.gate_proj.weight"] = mat(F, E)
            w[p + "mlp.up_proj.weight"] = mat(F, E)
            w[p + "mlp.down_proj.weight"] = mat(E, F)
    if v["tied"]:
        w["model.norm.weight"] = (gain(E) * OUTPUT_SCALE / (EMBD_TIED * np.sqrt(E))).astype(np.float32)
    else:
        w["model.norm.weight"] = gain(E)
        w["lm_head.weight"] = mat(V, E, OUTPUT_SCALE)
    return w


def permute_qk(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute: HF half-split rows of each
    head -> interleaved pairs (row 2i = HF row i, row 2i+1 = HF row i + D/2)."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(v):
    """Per-frequency divisors of Llama-3 scaling, as convert_hf_to_gguf.py
    writes them to rope_freqs.weight."""
    rs = v["rope_scaling"]
    D = v["n_embd"] // v["n_head"]
    freqs = 1.0 / (v["rope_theta"] ** (np.arange(0, D, 2, dtype=np.float64) / D))
    low_wl = rs["original_ctx"] / rs["low_freq_factor"]
    high_wl = rs["original_ctx"] / rs["high_freq_factor"]
    out = []
    for f in freqs:
        wl = 2 * np.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(rs["factor"])
        else:
            s = (rs["original_ctx"] / wl - rs["low_freq_factor"]) / (
                rs["high_freq_factor"] - rs["low_freq_factor"])
            out.append(1.0 / ((1 - s) / rs["factor"] + s))
    return np.array(out, dtype=np.float32)


# ----------------------------------------------------------------------------
# GGUF


def _gguf_tensor(writer, name, arr, ttype):
    import gguf
    qt = gguf.GGMLQuantizationType[ttype]
    if ttype == "F32":
        writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    elif ttype == "F16":
        writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float16))
    elif ttype in K_WTYPES:
        writer.add_tensor(name, quants_k.quantize(arr, ttype), raw_dtype=qt)
    else:
        q = gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qt)
        writer.add_tensor(name, q, raw_dtype=qt)


def matrix_rows(v):
    """Row lengths of the variant's 2-D weights (GGUF ne0: the input width)."""
    return {v["n_embd"], v["n_ff"], v["n_head"] * (v["n_embd"] // v["n_head"])}


def k_wtypes(v):
    """The K-quant file types written for a variant (see K-QUANTS above)."""
    rows = matrix_rows(v)
    if "n_expert" in v or not any(r % QK_K == 0 for r in rows):
        return []
    return (K_WTYPES if all(r % QK_K == 0 for r in rows) else []) + ["Q4_K_M"]


def _use_more_bits(i_layer, n_layer):
    """llama-quant.cpp's use_more_bits (integer arithmetic as in C++)."""
    return (i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8
            or (i_layer - n_layer // 8) % 3 == 2)


def q4_k_m_type(name, row, n_layer, tied):
    """llama.cpp's Q4_K_M choice for a 2-D tensor of a dense model."""
    t = "Q4_K"
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        t = "Q6_K"
    elif name.endswith((".attn_v.weight", ".ffn_down.weight")):
        if _use_more_bits(int(name.split(".")[1]), n_layer):
            t = "Q6_K"
    if row % QK_K:
        t = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[t]
    return t


def write_gguf(path, variant, v, w, wtype, tok):
    import gguf
    _, tokens, types, merges = tok
    arch = v["arch"]
    E, H, KV, L = v["n_embd"], v["n_head"], v["n_head_kv"], v["n_layer"]
    D = E // H
    ftype = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
             "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
             "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0, "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
             "MIXED": gguf.LlamaFileType.MOSTLY_Q4_1,
             # one K type throughout: the nearest llama.cpp name
             "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_S, "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_S,
             "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
             "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M}[wtype]
    mat_t = "Q4_1" if wtype == "MIXED" else wtype
    embd_t = "Q8_0" if wtype == "MIXED" else wtype

    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_name(f"tandem-test-{variant}-{wtype}")
    wr.add_file_type(int(ftype))
    wr.add_vocab_size(N_VOCAB)
    wr.add_context_length(N_CTX)
    wr.add_embedding_length(E)
    wr.add_block_count(L)
    wr.add_feed_forward_length(v.get("dense_ff", v["n_ff"]))
    if "n_expert" in v:
        wr.add_expert_count(v["n_expert"])
        wr.add_expert_used_count(v["n_used"])
        if arch == "qwen2moe":
            wr.add_expert_feed_forward_length(v["n_ff"])
            wr.add_expert_shared_feed_forward_length(v["n_ff_shexp"])
    wr.add_head_count(H)
    wr.add_head_count_kv(KV)
    wr.add_rope_dimension_count(D)
    wr.add_rope_freq_base(v["rope_theta"])
    wr.add_layer_norm_rms_eps(v["rms_eps"])
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("default")
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
    wr.add_bos_token_id(BOS_ID)
    wr.add_eos_token_id(EOS_ID)
    wr.add_add_bos_token(False)
    wr.add_chat_template(CHAT_TEMPLATE)
    wr.add_quantization_version(gguf.GGML_QUANT_VERSION)

    types_used = {}

    def put(name, arr, t):
        if t == "Q4_K_M":
            t = q4_k_m_type(name, arr.shape[-1], L, v["tied"])
        _gguf_tensor(wr, name, arr, t)
        role = name.split(".", 2)[2] if name.startswith("blk.") else name
        if types_used.setdefault(role.removesuffix(".weight"), t) != t:
            types_used[name.removesuffix(".weight")] = t

    put("token_embd.weight", w["model.embed_tokens.weight"], embd_t)
    if v["rope_scaling"] is not None:
        put("rope_freqs.weight", llama3_rope_factors(v), "F32")
    for l in range(L):
        p, b = f"model.layers.{l}.", f"blk.{l}."
        q = w[p + "self_attn.q_proj.weight"]
        k = w[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = permute_qk(q, H), permute_qk(k, KV)
        put(b + "attn_norm.weight", w[p + "input_layernorm.weight"], "F32")
        put(b + "attn_q.weight", q, mat_t)
        put(b + "attn_k.weight", k, mat_t)
        put(b + "attn_v.weight", w[p + "self_attn.v_proj.weight"], mat_t)
        if arch in ("qwen2", "qwen2moe"):
            put(b + "attn_q.bias", w[p + "self_attn.q_proj.bias"], "F32")
            put(b + "attn_k.bias", w[p + "self_attn.k_proj.bias"], "F32")
            put(b + "attn_v.bias", w[p + "self_attn.v_proj.bias"], "F32")
        put(b + "attn_output.weight", w[p + "self_attn.o_proj.weight"], mat_t)
        put(b + "ffn_norm.weight", w[p + "post_attention_layernorm.weight"], "F32")
        if "n_expert" not in v:
            put(b + "ffn_gate.weight", w[p + "mlp.gate_proj.weight"], mat_t)
            put(b + "ffn_up.weight", w[p + "mlp.up_proj.weight"], mat_t)
            put(b + "ffn_down.weight", w[p + "mlp.down_proj.weight"], mat_t)
            continue
        if arch == "llama":
            names = {"gate_inp": "block_sparse_moe.gate.weight",
                     "exp": "block_sparse_moe.experts.{x}.{m}.weight",
                     "gate": "w1", "up": "w3", "down": "w2"}
        else:
            names = {"gate_inp": "mlp.gate.weight", "exp": "mlp.experts.{x}.{m}.weight",
                     "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
        put(b + "ffn_gate_inp.weight", w[p + names["gate_inp"]], "F32")
        for part in ("gate", "up", "down"):
            mats = [w[p + names["exp"].format(x=x, m=names[part])] for x in range(v["n_expert"])]
            if (variant, wtype) == PER_EXPERT_GGUF:
                for x, a in enumerate(mats):
                    put(b + f"ffn_{part}.{x}.weight", a, mat_t)
            else:
                put(b + f"ffn_{part}_exps.weight", np.stack(mats), mat_t)
        if arch == "qwen2moe":
            put(b + "ffn_gate_inp_shexp.weight",
                w[p + "mlp.shared_expert_gate.weight"].reshape(-1), "F32")
            for part in ("gate", "up", "down"):
                put(b + f"ffn_{part}_shexp.weight",
                    w[p + f"mlp.shared_expert.{part}_proj.weight"], mat_t)
    put("output_norm.weight", w["model.norm.weight"], "F32")
    if not v["tied"]:
        put("output.weight", w["lm_head.weight"], embd_t)

    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return types_used


# ----------------------------------------------------------------------------
# Hugging Face directories


def _to_dtype(arr, dtype):
    """(safetensors dtype string, raw little-endian bytes)."""
    if dtype == "F32":
        return "F32", np.ascontiguousarray(arr, dtype="<f4").tobytes()
    if dtype == "F16":
        return "F16", np.ascontiguousarray(arr, dtype="<f2").tobytes()
    import gguf
    # gguf's BF16 conversion rounds to nearest even (and keeps NaN quiet).
    q = gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32),
                             gguf.GGMLQuantizationType.BF16)
    return "BF16", q.tobytes()


def write_safetensors(path, tensors, dtype):
    """safetensors file: u64 LE header size, JSON header, data.  Written here
    rather than with safetensors.numpy.save_file because numpy has no bfloat16
    (the reader side is checked against the package for F32/F16)."""
    header = {"__metadata__": {"format": "pt"}}
    blobs, off = [], 0
    for name in sorted(tensors):
        arr = tensors[name]
        st, raw = _to_dtype(arr, dtype)
        header[name] = {"dtype": st, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(hj).to_bytes(8, "little"))
        f.write(hj)
        for b in blobs:
            f.write(b)
    return off


def write_hf(dirpath, variant, v, w, dtype, tok, sharded):
    os.makedirs(dirpath)
    E, H = v["n_embd"], v["n_head"]
    cfg = {
        "architectures": [v["hf_arch"]],
        "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                       "Qwen2ForCausalLM": "qwen2", "MixtralForCausalLM": "mixtral",
                       "Qwen2MoeForCausalLM": "qwen2_moe"}[v["hf_arch"]],
        "hidden_size": E,
        "intermediate_size": v["n_ff"],
        "num_attention_heads": H,
        "num_key_value_heads": v["n_head_kv"],
        "num_hidden_layers": v["n_layer"],
        "head_dim": E // H,
        "hidden_act": "silu",
        "rms_norm_eps": v["rms_eps"],
        "rope_theta": v["rope_theta"],
        "rope_scaling": None,
        "tie_word_embeddings": v["tied"],
        "vocab_size": v.get("n_vocab", N_VOCAB),
        "max_position_embeddings": N_CTX,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "attention_bias": v["arch"] in ("qwen2", "qwen2moe"),
        "torch_dtype": {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dtype],
    }
    rs = v["rope_scaling"]
    if rs is not None:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": rs["factor"],
                               "low_freq_factor": rs["low_freq_factor"],
                               "high_freq_factor": rs["high_freq_factor"],
                               "original_max_position_embeddings": rs["original_ctx"]}
    if v["hf_arch"] in ("MistralForCausalLM", "MixtralForCausalLM"):
        cfg["sliding_window"] = None
    if v["hf_arch"] == "MixtralForCausalLM":
        cfg["num_local_experts"] = v["n_expert"]
        cfg["num_experts_per_tok"] = v["n_used"]
    if v["hf_arch"] == "Qwen2MoeForCausalLM":
        cfg["intermediate_size"] = v["dense_ff"]
        cfg["num_experts"] = v["n_expert"]
        cfg["num_experts_per_tok"] = v["n_used"]
        cfg["moe_intermediate_size"] = v["n_ff"]
        cfg["shared_expert_intermediate_size"] = v["n_ff_shexp"]
        cfg["norm_topk_prob"] = v["norm_topk"]
        cfg["decoder_sparse_step"] = 1
        cfg["mlp_only_layers"] = []
        cfg["use_sliding_window"] = False
    with open(os.path.join(dirpath, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if not sharded:
        write_safetensors(os.path.join(dirpath, "model.safetensors"), w, dtype)
    else:
        names = sorted(w)
        half = len(names) // 2
        parts = [names[:half], names[half:]]
        wmap, total = {}, 0
        for i, part in enumerate(parts):
            fn = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            total += write_safetensors(os.path.join(dirpath, fn), {n: w[n] for n in part}, dtype)
            for n in part:
                wmap[n] = fn
        with open(os.path.join(dirpath, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=2)
    with open(os.path.join(dirpath, "tokenizer.json"), "w") as f:
        f.write(tok[0])
    tc = {"add_bos_token": False, "add_eos_token": False, "bos_token": SPECIAL_TOKENS[BOS_ID],
          "eos_token": SPECIAL_TOKENS[EOS_ID], "unk_token": None,
          "pad_token": SPECIAL_TOKENS[0], "chat_template": CHAT_TEMPLATE,
          "model_max_length": N_CTX, "tokenizer_class": "PreTrainedTokenizerFast"}
    with open(os.path.join(dirpath, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=2)


# ----------------------------------------------------------------------------


def config_entry(v, rope_mode):
    E, H = v["n_embd"], v["n_head"]
    return {
        "n_vocab": v.get("n_vocab", N_VOCAB), "n_embd": E, "n_layer": v["n_layer"], "n_head": H,
        "n_head_kv": v["n_head_kv"], "head_dim": E // H, "n_ff": v["n_ff"],
        "n_ctx_train": N_CTX, "rope_theta": v["rope_theta"], "rms_eps": v["rms_eps"],
        "rope_mode": rope_mode, "rope_scaling": v["rope_scaling"],
        "qkv_bias": v["arch"] in ("qwen2", "qwen2moe"), "bos": BOS_ID, "eos": EOS_ID,
        **({"moe": {"n_expert": v["n_expert"], "n_expert_used": v["n_used"],
                    "n_ff_exp": v["n_ff"], "n_ff_shexp": v["n_ff_shexp"],
                    "norm_topk_prob": v["norm_topk"]}} if "n_expert" in v else {}),
    }


def generate(out):
    tmp = os.path.join(out, f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "gguf"))
    os.makedirs(os.path.join(tmp, "hf"))
    tok = build_tokenizer()
    models = []
    for variant, v in VARIANTS.items():
        w = make_weights(variant, v)
        gguf_mode = "norm" if v["arch"] == "llama" else "neox"
        for wt in GGUF_WTYPES + k_wtypes(v):
            rel = f"gguf/{variant}-{wt.lower()}.gguf"
            tt = write_gguf(os.path.join(tmp, rel), variant, v, w, wt, tok)
            models.append({"name": f"{variant}-{wt.lower()}-gguf", "path": rel, "format": "gguf",
                           "arch": v["arch"], "variant": variant, "wtype": wt,
                           "tensor_types": tt, "tol_class": TOL_CLASS[wt], "sharded": False,
                           "tied": v["tied"], "config": config_entry(v, gguf_mode)})
        for dt in HF_DTYPES:
            for sharded in (False, True):
                if sharded and (variant, dt) != SHARDED:
                    continue
                rel = f"hf/{variant}-{dt.lower()}" + ("-sharded" if sharded else "")
                write_hf(os.path.join(tmp, rel), variant, v, w, dt, tok, sharded)
                models.append({"name": f"{variant}-{dt.lower()}-hf" + ("-sharded" if sharded else ""),
                               "path": rel, "format": "hf", "arch": v["arch"],
                               "variant": variant, "wtype": dt, "tensor_types": {"all": dt},
                               "tol_class": TOL_CLASS[dt], "sharded": sharded,
                               "tied": v["tied"], "config": config_entry(v, "neox")})
    moe_models = []
    for variant, v in MOE_VARIANTS.items():
        w = make_weights(variant, v)
        gguf_mode = "norm" if v["arch"] == "llama" else "neox"
        for wt in MOE_GGUF_WTYPES:
            rel = f"gguf/{variant}-{wt.lower()}.gguf"
            tt = write_gguf(os.path.join(tmp, rel), variant, v, w, wt, tok)
            layout = "per_expert" if (variant, wt) == PER_EXPERT_GGUF else "merged"
            moe_models.append({"name": f"{variant}-{wt.lower()}-gguf", "path": rel,
                               "format": "gguf", "arch": v["arch"], "variant": variant,
                               "wtype": wt, "tensor_types": tt, "tol_class": TOL_CLASS[wt],
                               "sharded": False, "tied": v["tied"], "expert_layout": layout,
                               "config": config_entry(v, gguf_mode)})
        for dt in MOE_HF_DTYPES:
            rel = f"hf/{variant}-{dt.lower()}"
            write_hf(os.path.join(tmp, rel), variant, v, w, dt, tok, False)
            moe_models.append({"name": f"{variant}-{dt.lower()}-hf", "path": rel, "format": "hf",
                               "arch": v["arch"], "variant": variant, "wtype": dt,
                               "tensor_types": {"all": dt}, "tol_class": TOL_CLASS[dt],
                               "sharded": False, "tied": v["tied"], "expert_layout": "hf",
                               "config": config_entry(v, "neox")})
    vocab_models = []
    for variant, v in VOCAB_VARIANTS.items():
        w = make_weights(variant, v)
        zero = {n: (np.zeros_like(a) if n.endswith(("o_proj.weight", "down_proj.weight")) else a)
                for n, a in w.items()}
        for suffix, weights in (("", w), ("-passthrough", zero)):
            rel = f"hf/{variant}-f32{suffix}"
            write_hf(os.path.join(tmp, rel), variant, v, weights, "F32", tok, False)
            vocab_models.append({"name": f"{variant}-f32-hf{suffix}", "path": rel, "format": "hf",
                                 "arch": v["arch"], "variant": variant, "wtype": "F32",
                                 "tensor_types": {"all": "F32"}, "tol_class": "f32",
                                 "sharded": False, "tied": v["tied"],
                                 "passthrough": bool(suffix), "config": config_entry(v, "neox")})
    with open(os.path.join(tmp, "models.json"), "w") as f:
        json.dump({"version": VERSION, "models": models, "moe_models": moe_models,
                   "vocab_models": vocab_models}, f, indent=1)
    # Move into place, then stamp last: an interrupted run leaves no stamp.
    for sub in ("gguf", "hf", "models.json"):
        dst = os.path.join(out, sub)
        if os.path.isdir(dst):
            shutil.rmtree(dst)
        elif os.path.exists(dst):
            os.remove(dst)
        os.rename(os.path.join(tmp, sub), dst)
    shutil.rmtree(tmp, ignore_errors=True)
    with open(os.path.join(out, ".stamp"), "w") as f:
        f.write(VERSION + "\n")
    return len(models) + len(moe_models) + len(vocab_models)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--force", action="store_true", help="regenerate even if the stamp matches")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    stamp = os.path.join(a.out, ".stamp")
    if not a.force and os.path.exists(stamp):
        with open(stamp) as f:
            if f.read().strip() == VERSION:
                print(f"make_models: {a.out} is up to date ({VERSION})")
                return 0
    if os.path.exists(stamp):
        os.remove(stamp)
    t0 = time.time()
    n = generate(a.out)
    print(f"make_models: wrote {n} models to {a.out} in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
