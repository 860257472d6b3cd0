#!/usr/bin/env python3
"""Re-encode the weight matrices of a GGUF file to another type (benchmarks).

    convert_gguf.py IN.gguf OUT.gguf --type f16|q8_0|q4_0|q4_1|f32|bf16

Every 2-D tensor (including token_embd) is dequantized with the gguf package
and quantized again to --type; 1-D tensors (norms, biases) stay F32. The
metadata is copied unchanged except general.file_type. Used to make the Q8_0
and F16 conversions of the default model that docs/PERFORMANCE.md compares
against llama.cpp on the same files.
"""
import argparse
import sys

import numpy as np
from gguf import GGUFReader, GGUFWriter, GGUFValueType, GGMLQuantizationType
from gguf import quants

FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "bf16": 32}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--type", required=True, choices=sorted(FILE_TYPES))
    args = ap.parse_args()
    qtype = GGMLQuantizationType[args.type.upper()]

    r = GGUFReader(args.src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(args.dst, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            w.add_uint32(name, FILE_TYPES[args.type])
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            w.add_array(name, field.contents())
        else:
            w.add_key_value(name, field.contents(), vtype)
    for t in r.tensors:
        shape = [int(x) for x in reversed(t.shape)]  # numpy order: rows first
        data = quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if len(shape) == 2:
            if qtype in (GGMLQuantizationType.F32,):
                out = data
            elif qtype == GGMLQuantizationType.F16:
                out = data.astype(np.float16)
            else:
                out = quants.quantize(data, qtype)
            w.add_tensor(t.name, out, raw_dtype=qtype)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
