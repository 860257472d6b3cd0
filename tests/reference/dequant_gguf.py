#!/usr/bin/env python3
"""The PyPI gguf package's dequantizer (gguf.quants.dequantize) as an
independent reference for tests/unit/test_dequant_gguf.c.

    dequant_gguf.py blocks TYPE IN OUT   IN: raw blocks of GGML type TYPE
                                         (a name: Q4_K); OUT: their f32 values
    dequant_gguf.py file PATH            every quantized tensor of the GGUF
                                         file PATH, in file order, to stdout:
                                         a line "name type n_elements", then
                                         n_elements little-endian f32; "END"

Exit 77 when numpy or gguf is missing (the C test then skips, which the
strict test command turns into a failure)."""

import sys

try:
    import numpy as np
    import gguf
    from gguf.quants import dequantize
except ImportError:
    sys.exit(77)

FLOAT_TYPES = {"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"}


def blocks(type_name, src, dst):
    qt = gguf.GGMLQuantizationType[type_name]
    raw = np.fromfile(src, dtype=np.uint8)
    be, bb = gguf.GGML_QUANT_SIZES[qt]
    if raw.size % bb:
        sys.exit(f"dequant_gguf: {src}: {raw.size} bytes is not whole {type_name} blocks")
    out = dequantize(raw.reshape(-1, bb), qt).astype(np.float32, copy=False)
    out.reshape(-1).astype("<f4").tofile(dst)


def whole_file(path):
    r = gguf.GGUFReader(path)
    w = sys.stdout.buffer
    for t in r.tensors:
        name = t.tensor_type.name
        if name in FLOAT_TYPES:
            continue
        v = dequantize(t.data, t.tensor_type).astype("<f4", copy=False).reshape(-1)
        w.write(f"{t.name} {name} {v.size}\n".encode())
        w.write(v.tobytes())
        w.flush()
    w.write(b"END\n")
    w.flush()


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "blocks":
        blocks(sys.argv[2], sys.argv[3], sys.argv[4])
    elif len(sys.argv) == 3 and sys.argv[1] == "file":
        whole_file(sys.argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
