#!/usr/bin/env python3
"""Writes the seed corpora of fuzz_gguf and fuzz_safetensors (a few tiny valid
files, each under 4 KiB) with the PyPI gguf and safetensors packages, plus two
hand-laid files for what those writers cannot produce (GGUF v2, nested arrays,
BF16). Run from anywhere; the seeds are committed."""
import json
import os
import struct

import gguf
import numpy as np
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
GDIR = os.path.join(HERE, "corpus", "fuzz_gguf")
SDIR = os.path.join(HERE, "corpus", "fuzz_safetensors")


def gguf_seed(path, align, tensors):
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_uint32("llama.context_length", 64)
    w.add_int32("t.i32", -3)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "ab", "<s>"])
    w.add_array("tokenizer.ggml.merges", ["a b"])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 1, 3])
    w.add_array("t.f32s", [0.5, 1.5])
    if align:
        w.add_custom_alignment(align)
    for name, arr, raw in tensors:
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def q(x, t):
    return gguf.quants.quantize(x, t)


def main():
    os.makedirs(GDIR, exist_ok=True)
    os.makedirs(SDIR, exist_ok=True)
    Q = gguf.GGMLQuantizationType
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
    gguf_seed(os.path.join(GDIR, "f32_f16_q8.gguf"), 0, [
        ("token_embd.weight", np.arange(8, dtype=np.float32).reshape(2, 4), None),
        ("blk.0.attn_norm.weight", np.ones(4, dtype=np.float16), None),
        ("output.weight", q(x, Q.Q8_0), Q.Q8_0),
    ])
    gguf_seed(os.path.join(GDIR, "q4_align64.gguf"), 64, [
        ("a.weight", q(x, Q.Q4_0), Q.Q4_0),
        ("b.weight", q(x, Q.Q4_1), Q.Q4_1),
    ])
    # the K-quant mix's types: Q5_0/Q5_1 by gguf's quantizer, Q4_K/Q5_K/Q6_K
    # as raw blocks (gguf has no K quantizer) with finite fp16 scales, one
    # Q4_K block with a NaN scale (the loader refuses it; the reader must
    # not care) and a type Tandem does not compute with (IQ4_XS)
    rng = np.random.default_rng(7)

    def raw_blocks(t, scale_at):
        bb = gguf.GGML_QUANT_SIZES[t][1]
        b = rng.integers(0, 256, size=(1, bb), dtype=np.uint8)
        for at in scale_at:
            b[0, at:at + 2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
        return b
    nan = raw_blocks(Q.Q4_K, (0, 2))
    nan[0, 0:2] = np.frombuffer(np.float16(np.nan).tobytes(), dtype=np.uint8)
    gguf_seed(os.path.join(GDIR, "kquants.gguf"), 0, [
        ("q5_0.weight", q(x, Q.Q5_0), Q.Q5_0),
        ("q5_1.weight", q(x, Q.Q5_1), Q.Q5_1),
        ("q4_k.weight", raw_blocks(Q.Q4_K, (0, 2)), Q.Q4_K),
        ("q5_k.weight", raw_blocks(Q.Q5_K, (0, 2)), Q.Q5_K),
        ("q6_k.weight", raw_blocks(Q.Q6_K, (208,)), Q.Q6_K),
        ("nan_scale.weight", nan, Q.Q4_K),
        ("iq4_xs.weight", raw_blocks(Q.IQ4_XS, (0,)), Q.IQ4_XS),
    ])
    # GGUF v2 with an array of arrays, one tensor, laid out by hand
    def s(b):
        return struct.pack("<Q", len(b)) + b
    kv = s(b"general.architecture") + struct.pack("<I", 8) + s(b"llama")
    kv += s(b"nested") + struct.pack("<IIQ", 9, 9, 2)
    kv += struct.pack("<IQ", 0, 2) + b"\x01\x02"
    kv += struct.pack("<IQ", 8, 1) + s(b"q")
    ti = s(b"w") + struct.pack("<I", 2) + struct.pack("<QQ", 2, 2) + struct.pack("<IQ", 0, 0)
    head = b"GGUF" + struct.pack("<IQQ", 2, 1, 2) + kv + ti
    head += b"\0" * (-len(head) % 32)
    with open(os.path.join(GDIR, "v2_nested.gguf"), "wb") as f:
        f.write(head + struct.pack("<4f", 1, 2, 3, 4))

    save_file({"model.embed_tokens.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
               "model.norm.weight": np.ones(4, dtype=np.float16),
               "step": np.array(3, dtype=np.int64)},
              os.path.join(SDIR, "f32_f16_i64.safetensors"), metadata={"format": "pt"})
    # BF16 and an empty tensor, laid out by hand (numpy has no bfloat16)
    hdr = {"__metadata__": {"format": "pt"},
           "w.bf16": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]},
           "e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [8, 8]},
           "b": {"dtype": "U8", "shape": [3], "data_offsets": [8, 11]}}
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(SDIR, "bf16_empty.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + bytes([0, 0x3f, 0x80, 0x3f, 0, 0x40, 0, 0xc0, 1, 2, 3]))
    for d in (GDIR, SDIR):
        for n in os.listdir(d):
            assert os.path.getsize(os.path.join(d, n)) < 4096, n


if __name__ == "__main__":
    main()
