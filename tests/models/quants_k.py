"""Quantizers for the GGUF K-quant types Q4_K, Q5_K and Q6_K (NumPy).

gguf-py dequantizes these types but has no quantizer for them, so the tiny
test models (make_models.py) are quantized here, written from the block
layouts of GGUF (ggml-common.h; the engine's copy is kernels/dtype.h), not
ported from llama.cpp's quantizer. Any valid quantization serves the tests:
the engine and the reference (tests/reference, gguf.quants.dequantize) both
read what the file holds. The scheme is the plain one, without llama.cpp's
error-minimising search:

  Q4_K, Q5_K  Super-block of 256 = 8 sub-blocks of 32. Sub-block j has the
              min m_j = -min(0, min x) and the top hi_j = max(0, max x).
              dmin = max m_j / 63 and the 6-bit m'_j = ceil(m_j / dmin), so
              that M_j = dmin*m'_j >= m_j; s_j = (hi_j + M_j) / (2^b - 1),
              d = max s_j / 63, sc_j = ceil(s_j / d) (d and dmin fp16,
              rounded up): every element lies in [-M_j, -M_j + (2^b - 1)*S_j]
              with S_j = d*sc_j, and q = round((x + M_j) / S_j) never clips,
              so |error| <= S_j / 2 <= (s_j + d) / 2.
  Q6_K        Super-block of 256 = 16 groups of 16. s_g = max |x| / 31,
              d = max s_g / 127 (fp16, rounded up), int8 sc_g = ceil(s_g / d),
              q = round(x / (d*sc_g)) in [-31, 31]: |error| <= (s_g + d) / 2.

Byte layouts (little-endian), per 256-element block:
  Q4_K (144 B)  fp16 d | fp16 dmin | scales[12] | qs[128]
  Q5_K (176 B)  fp16 d | fp16 dmin | scales[12] | qh[32] | qs[128]
  Q6_K (210 B)  ql[128] | qh[64] | int8 scales[16] | fp16 d
scales[12] packs the eight 6-bit (sc, m) pairs: for j < 4, scales[j] and
scales[j+4] hold sc_j and m_j in their low 6 bits; sc_{j+4} and m_{j+4} keep
their low 4 bits in scales[j+8] (sc low nibble, m high nibble) and their top
2 bits in bits 6-7 of scales[j] (sc) and scales[j+4] (m).
qs: four 32-byte chunks c; sub-block 2c is the low nibbles of chunk c and
2c+1 the high nibbles. Q5_K's fifth bit of element l of sub-block j is bit j
of qh[l]. Q6_K: two halves of 128 elements (ql 64 bytes, qh 32 bytes, 8
scales each); element 32g + l (g < 4, l < 32) of a half has its low 4 bits
in the low (g < 2) or high (g >= 2) nibble of ql[l + 32*(g & 1)], its top 2
bits in bits 2g, 2g+1 of qh[l], and is stored plus 32; its scale is
2g + l // 16 of its half.

quantize(arr, "Q4_K"|"Q5_K"|"Q6_K") -> uint8 array (rows, row_bytes), the
form GGUFWriter.add_tensor(..., raw_dtype=...) takes.
"""

import numpy as np

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _fp16_up(x):
    """The smallest fp16 >= each float32 value (x >= 0), and it as float32."""
    x = np.asarray(x, dtype=np.float32)
    h = x.astype(np.float16)
    h = np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)
    return h, h.astype(np.float32)


def _safe_div(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1), 0)


def _pack_scales(sc, m):
    """(n, 8) 6-bit scales and mins -> (n, 12) bytes (layout in the docstring)."""
    sc = sc.astype(np.uint8)
    m = m.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


def _quantize_affine(x, bits):
    """Q4_K / Q5_K common part: x (n, 256) float32 -> (d16, dmin16, sc, m, q)."""
    n = x.shape[0]
    nmax = (1 << bits) - 1
    sub = x.reshape(n, 8, 32)
    mn = -np.minimum(sub.min(axis=2), 0.0)  # (n, 8), >= 0
    hi = np.maximum(sub.max(axis=2), 0.0)
    # Mins round up, so the stored min covers the sub-block's lowest value...
    dmin16, dmin = _fp16_up(mn.max(axis=1) / 63)
    m = np.minimum(np.ceil(_safe_div(mn, dmin[:, None])), 63)
    em = dmin[:, None] * m  # the min as a dequantizer computes it
    # ...and scales round up from the span above that min, so no element clips.
    s = (hi + em) / nmax
    d16, d = _fp16_up(s.max(axis=1) / 63)
    sc = np.minimum(np.ceil(_safe_div(s, d[:, None])), 63)
    es = d[:, None] * sc
    q = np.rint(_safe_div(sub + em[:, :, None], es[:, :, None]))
    q = np.clip(q, 0, nmax).astype(np.uint8)  # (n, 8, 32)
    return d16, dmin16, sc, m, q


def _pack_nibbles(q):
    """(n, 8, 32) values 0..15 -> (n, 128): chunk c = sub-blocks 2c (low), 2c+1 (high)."""
    q = q & 15
    return (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(q.shape[0], 128)


def quantize_q4_k(x):
    d16, dmin16, sc, m, q = _quantize_affine(x, 4)
    n = x.shape[0]
    return np.concatenate([d16.view(np.uint8).reshape(n, 2), dmin16.view(np.uint8).reshape(n, 2),
                           _pack_scales(sc, m), _pack_nibbles(q)], axis=1)


def quantize_q5_k(x):
    d16, dmin16, sc, m, q = _quantize_affine(x, 5)
    n = x.shape[0]
    # qh[l] bit j = bit 4 of element l of sub-block j
    hb = ((q >> 4) & 1).astype(np.uint8)  # (n, 8, 32)
    qh = np.zeros((n, 32), dtype=np.uint8)
    for j in range(8):
        qh |= hb[:, j, :] << j
    return np.concatenate([d16.view(np.uint8).reshape(n, 2), dmin16.view(np.uint8).reshape(n, 2),
                           _pack_scales(sc, m), qh, _pack_nibbles(q)], axis=1)


def quantize_q6_k(x):
    n = x.shape[0]
    grp = x.reshape(n, 16, 16)
    s = np.abs(grp).max(axis=2) / 31  # (n, 16)
    d16, d = _fp16_up(s.max(axis=1) / 127)
    sc = np.minimum(np.ceil(_safe_div(s, d[:, None])), 127)  # up: no element clips
    es = d[:, None] * sc
    q = np.clip(np.rint(_safe_div(grp, es[:, :, None])), -32, 31)
    u = (q + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # (block, half, g, l)
    lo, hi2 = u & 15, u >> 4
    ql = np.empty((n, 2, 64), dtype=np.uint8)
    ql[:, :, 0:32] = lo[:, :, 0, :] | (lo[:, :, 2, :] << 4)  # g&1 = 0: g 0 low, g 2 high
    ql[:, :, 32:64] = lo[:, :, 1, :] | (lo[:, :, 3, :] << 4)  # g&1 = 1: g 1 low, g 3 high
    qh = (hi2[:, :, 0, :] | (hi2[:, :, 1, :] << 2) | (hi2[:, :, 2, :] << 4)
          | (hi2[:, :, 3, :] << 6))  # (n, 2, 32)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64),
                           sc.astype(np.int8).view(np.uint8), d16.view(np.uint8).reshape(n, 2)],
                          axis=1)


_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize(arr, ttype):
    """arr (..., row) float -> uint8 (..., row // 256 * block bytes); row % 256 == 0."""
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if arr.shape[-1] % QK_K:
        raise ValueError(f"{ttype}: row length {arr.shape[-1]} is not a multiple of {QK_K}")
    blocks = arr.reshape(-1, QK_K)
    out = _QUANTIZERS[ttype](blocks)
    assert out.shape == (blocks.shape[0], BLOCK_BYTES[ttype])
    return out.reshape(*arr.shape[:-1], arr.shape[-1] // QK_K * BLOCK_BYTES[ttype])
