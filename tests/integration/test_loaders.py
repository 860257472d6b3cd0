"""Corrupt model files through the real CLI: every variant of a tiny test
model (tests/models) that is truncated, lies about a size or offset, names an
unknown or unsupported type, lacks a tensor, has a wrong shape or a special
token id outside its vocabulary, or (K-quant files) has a tensor whose bytes
do not match its shape, a row that is not whole super-blocks or a NaN or
infinite block scale makes
`tandem generate` exit with a nonzero status and a one-line error naming the
file (and the tensor where there is one): never a signal, never a sanitizer
report. The GGUF header is walked here from the spec, independently of the
C reader."""
import json
import pathlib
import shutil
import struct

import pytest

GGUF_MODEL = "gguf/smollm2-q8_0.gguf"  # n_embd 96, n_ff 256, Q8_0 matrices
HF_MODEL = "hf/llama2-f32"

SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def walk_gguf(b):
    """Offsets of the header fields of a GGUF v2/v3 file."""
    assert b[:4] == b"GGUF"
    n_tensors, n_kv = struct.unpack_from("<QQ", b, 8)
    off = 24

    def skip_value(t, off):
        if t in SCALAR_SIZES:
            return off + SCALAR_SIZES[t]
        if t == 8:
            (n,) = struct.unpack_from("<Q", b, off)
            return off + 8 + n
        assert t == 9
        et, n = struct.unpack_from("<IQ", b, off)
        off += 12
        if et in SCALAR_SIZES:
            return off + n * SCALAR_SIZES[et]
        for _ in range(n):
            off = skip_value(et, off)
        return off

    kv = {}
    for _ in range(n_kv):
        (kl,) = struct.unpack_from("<Q", b, off)
        key = b[off + 8:off + 8 + kl].decode()
        kv[key] = off
        off += 8 + kl
        (t,) = struct.unpack_from("<I", b, off)
        off = skip_value(t, off + 4)
    tensors = {}
    for _ in range(n_tensors):
        (nl,) = struct.unpack_from("<Q", b, off)
        name = b[off + 8:off + 8 + nl].decode()
        info = {"name": off + 8}
        off += 8 + nl
        (nd,) = struct.unpack_from("<I", b, off)
        info["n_dims"] = off
        info["ne"] = off + 4
        info["ne_values"] = struct.unpack_from(f"<{nd}Q", b, off + 4)
        off += 4 + 8 * nd
        info["type"] = off
        info["offset"] = off + 4
        off += 12
        tensors[name] = info
    return {"kv": kv, "tensors": tensors, "end_of_infos": off}


def gguf_variants(b):
    h = walk_gguf(b)
    t = h["tensors"]
    out = {}

    def patched(at, fmt, *vals):
        c = bytearray(b)
        struct.pack_into(fmt, c, at, *vals)
        return bytes(c)

    out["bad_magic"] = (b"GGML" + b[4:], None)
    out["version_9"] = (patched(4, "<I", 9), None)
    out["huge_n_kv"] = (patched(16, "<Q", 1 << 62), None)
    out["huge_n_tensors"] = (patched(8, "<Q", (1 << 64) - 1), None)
    first_key = min(h["kv"].values())
    out["key_length_lie"] = (patched(first_key, "<Q", 1 << 40), None)
    for cut in (3, 23, first_key + 5, h["end_of_infos"] - 3, h["end_of_infos"] + 40, len(b) - 1):
        out[f"truncated_at_{cut}"] = (b[:cut], None)
    q = t["blk.0.attn_q.weight"]
    out["n_dims_5"] = (patched(q["n_dims"], "<I", 5), "blk.0.attn_q.weight")
    out["unknown_type"] = (patched(q["type"], "<I", 77), "blk.0.attn_q.weight")
    # iq4_nl: a real GGUF type (32 elements in 18 bytes) that Tandem does not compute with
    out["unsupported_type"] = (patched(q["type"], "<I", 20), "blk.0.attn_q.weight")
    out["offset_misaligned"] = (patched(q["offset"], "<Q", 8), "blk.0.attn_q.weight")
    out["offset_past_end"] = (patched(q["offset"], "<Q", len(b)), "blk.0.attn_q.weight")
    # the same name length: the tensor the model needs is missing
    c = bytearray(b)
    c[q["name"]:q["name"] + len("blk.0.attn_q")] = b"blk.0.attn_x"
    out["missing_tensor"] = (bytes(c), "blk.0.attn_q.weight")
    # ffn_up is (n_embd=96, n_ff=256): swapping keeps the byte size, breaks the shape
    up = t["blk.0.ffn_up.weight"]
    ne0, ne1 = up["ne_values"][:2]
    out["wrong_shape"] = (patched(up["ne"], "<QQ", ne1, ne0), "blk.0.ffn_up.weight")
    # a special token id one past the vocabulary (the u32 value after each
    # key this file has: its name's length, the name, the type)
    def key_value(key):
        return h["kv"][key] + 8 + len(key) + 4
    (n_vocab,) = struct.unpack_from("<Q", b, key_value("tokenizer.ggml.tokens") + 4)
    for k in ("bos", "eos"):
        key = f"tokenizer.ggml.{k}_token_id"
        out[f"{k}_out_of_vocab"] = (patched(key_value(key), "<I", n_vocab), key)
    return out


def hf_variants(b):
    (hlen,) = struct.unpack_from("<Q", b, 0)
    header = b[8:8 + hlen]
    hdr = json.loads(header)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert hdr[name]["dtype"] == "F32"
    out = {}

    def with_header(new):
        new = new.encode() if isinstance(new, str) else new
        return struct.pack("<Q", len(new)) + new + b[8 + hlen:]

    out["header_length_lie"] = (struct.pack("<Q", len(b)) + b[8:], None)
    out["header_not_json"] = (with_header(header[:-10]), None)
    out["header_not_object"] = (with_header("[1, 2, 3]"), None)
    for cut in (5, 8 + hlen // 2, 8 + hlen + 10, len(b) - 1):
        out[f"truncated_at_{cut}"] = (b[:cut], None)
    h = json.loads(header)
    h[name]["data_offsets"][1] += 4
    out["offsets_mismatch"] = (with_header(json.dumps(h)), name)
    h = json.loads(header)
    h[name]["shape"] = [1, 1, 1, 1, 1]
    out["rank_5"] = (with_header(json.dumps(h)), name)
    h = json.loads(header)
    h[name]["dtype"] = "I32"  # same size: parses, the model cannot use it
    out["unsupported_dtype"] = (with_header(json.dumps(h)), name)
    h = json.loads(header)
    h[name]["shape"] = list(reversed(h[name]["shape"])) + [1]
    out["wrong_shape"] = (with_header(json.dumps(h)), name)
    h = json.loads(header)
    h["model.layers.0.self_attn.q_proj.weight_renamed"] = h.pop(name)
    out["missing_tensor"] = (with_header(json.dumps(h)), name)
    return out


def check_clean_failure(r, path, tensor):
    assert r.returncode is not None and r.returncode > 0, r.describe()
    assert "Sanitizer" not in r.stderr and "runtime error" not in r.stderr, r.describe()
    errors = [line for line in r.stderr.splitlines() if line.startswith("E ")]
    assert errors, r.describe()
    first = errors[0]
    assert str(path) in first or path.name in first, r.describe()
    if tensor:
        assert any(tensor in e for e in errors), r.describe()


def _gguf_cases():
    return ["bad_magic", "version_9", "huge_n_kv", "huge_n_tensors", "key_length_lie",
            "truncated", "n_dims_5", "unknown_type", "unsupported_type", "offset_misaligned",
            "offset_past_end", "missing_tensor", "wrong_shape", "bos_out_of_vocab",
            "eos_out_of_vocab"]


@pytest.mark.parametrize("case", _gguf_cases())
def test_corrupt_gguf(case, test_models, tandem, tmp_path):
    src = pathlib.Path(test_models) / GGUF_MODEL
    b = src.read_bytes()
    variants = {k: v for k, v in gguf_variants(b).items() if k == case or k.startswith(case + "_at_")}
    assert variants
    for name, (data, tensor) in variants.items():
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(data)
        r = tandem("generate", "--model", p, "--prompt", "hi", "--max-tokens", "1",
                   check=False, timeout=60)
        check_clean_failure(r, p, tensor)


def test_unsupported_type_is_named(test_models, tandem, tmp_path):
    data, tensor = gguf_variants((pathlib.Path(test_models) / GGUF_MODEL).read_bytes())[
        "unsupported_type"]
    p = tmp_path / "iq4_nl.gguf"
    p.write_bytes(data)
    r = tandem("generate", "--model", p, "--prompt", "hi", "--max-tokens", "1", check=False,
               timeout=60)
    check_clean_failure(r, p, tensor)
    assert "type iq4_nl is not supported" in r.stderr, r.describe()


# ---- K-quant files: a tiny model of make_models.py with Q4_K and Q6_K matrices

Q4_K, Q6_K, IQ4_XS = 12, 14, 23


def kquant_model(test_models):
    """The first tiny GGUF model holding both Q4_K and Q6_K matrices."""
    man = json.loads((pathlib.Path(test_models) / "models.json").read_text())
    for m in man["models"]:
        if m["format"] == "gguf" and {"Q4_K", "Q6_K"} <= set(m["tensor_types"].values()):
            return pathlib.Path(test_models) / m["path"]
    pytest.fail("no tiny model with Q4_K and Q6_K matrices in models.json")


def kquant_variants(b):
    """Corruptions of a K-quant file: (bytes, tensor the error must name, text it must say)."""
    h = walk_gguf(b)
    data_start = -(-h["end_of_infos"] // 32) * 32  # default alignment (no general.alignment)

    def first(ttype):
        for name, info in h["tensors"].items():
            (t,) = struct.unpack_from("<I", b, info["type"])
            if t == ttype and name.startswith("blk."):
                return name, info
        pytest.fail(f"no tensor of type {ttype}")

    def patched(at, fmt, *vals):
        c = bytearray(b)
        struct.pack_into(fmt, c, at, *vals)
        return bytes(c)

    def block0(info):
        (off,) = struct.unpack_from("<Q", b, info["offset"])
        return data_start + off

    out = {}
    n4, i4 = first(Q4_K)
    n6, i6 = first(Q6_K)
    # Q4_K -> Q6_K: the same 256-element blocks in 210 bytes, not 144: the
    # tensor's bytes (from its shape) run into the next tensor or past the end
    out["kq_size_lie"] = (patched(i4["type"], "<I", Q6_K), n4, "")
    # a row of 288 elements: not whole 256-element super-blocks
    ne = list(i4["ne_values"])
    out["kq_row_not_block"] = (patched(i4["ne"], "<Q", 288), n4, "block size 256")
    # non-finite scales: Q4_K's d (NaN), Q4_K's dmin (+inf), Q6_K's d (-inf, last in its block)
    out["kq_nan_scale"] = (patched(block0(i4), "<H", 0x7e00), n4, "non-finite scale")
    out["kq_inf_min"] = (patched(block0(i4) + 2, "<H", 0x7c00), n4, "non-finite min")
    out["kq_q6_k_inf_scale"] = (patched(block0(i6) + 208, "<H", 0xfc00), n6, "non-finite scale")
    # a K type Tandem does not compute with (256 elements in 136 bytes: it fits)
    out["kq_unsupported"] = (patched(i4["type"], "<I", IQ4_XS), n4,
                             "type iq4_xs is not supported")
    assert ne[0] % 256 == 0
    return out


@pytest.mark.parametrize("case", ["kq_size_lie", "kq_row_not_block", "kq_nan_scale", "kq_inf_min",
                                  "kq_q6_k_inf_scale", "kq_unsupported"])
def test_corrupt_kquant_gguf(case, test_models, tandem, tmp_path):
    data, tensor, text = kquant_variants(kquant_model(test_models).read_bytes())[case]
    p = tmp_path / f"{case}.gguf"
    p.write_bytes(data)
    r = tandem("generate", "--model", p, "--prompt", "hi", "--max-tokens", "1", check=False,
               timeout=60)
    check_clean_failure(r, p, tensor)
    assert text in r.stderr, r.describe()


def test_valid_kquant_gguf_still_loads(test_models, tandem):
    r = tandem("generate", "--model", kquant_model(test_models), "--prompt", "hi",
               "--max-tokens", "1", timeout=60)
    assert r.returncode == 0


def test_valid_gguf_still_loads(test_models, tandem):
    # the unmodified file works, so each failure above is the corruption's
    r = tandem("generate", "--model", pathlib.Path(test_models) / GGUF_MODEL, "--prompt", "hi",
               "--max-tokens", "1", timeout=60)
    assert r.returncode == 0


def _hf_cases():
    return ["header_length_lie", "header_not_json", "header_not_object", "truncated",
            "offsets_mismatch", "rank_5", "unsupported_dtype", "wrong_shape", "missing_tensor"]


@pytest.mark.parametrize("case", _hf_cases())
def test_corrupt_safetensors_dir(case, test_models, tandem, tmp_path):
    src = pathlib.Path(test_models) / HF_MODEL
    b = (src / "model.safetensors").read_bytes()
    variants = {k: v for k, v in hf_variants(b).items() if k == case or k.startswith(case + "_at_")}
    assert variants
    for name, (data, tensor) in variants.items():
        d = tmp_path / name
        shutil.copytree(src, d)
        (d / "model.safetensors").write_bytes(data)
        r = tandem("generate", "--model", d, "--prompt", "hi", "--max-tokens", "1",
                   check=False, timeout=60)
        check_clean_failure(r, d, tensor)


def test_valid_safetensors_dir_still_loads(test_models, tandem):
    r = tandem("generate", "--model", pathlib.Path(test_models) / HF_MODEL, "--prompt", "hi",
               "--max-tokens", "1", timeout=60)
    assert r.returncode == 0
