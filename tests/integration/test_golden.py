"""The golden-logit tools of tests/golden/ (the bit-for-bit check of a
restructuring, scripts/golden-compare.sh): a dump made twice by one build is
bit-identical (the forward pass is deterministic run to run: threads, ranks
and batching do not change a bit), and the comparison finds a single flipped
bit, a case only one side has, and a case one build refuses and the other
runs, each named with where it differs."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np

from conftest import scaled

SRC = pathlib.Path(os.environ.get("TANDEM_SOURCE_DIR", pathlib.Path(__file__).parents[2]))
DUMP = SRC / "tests/golden/dump_logits.py"
COMPARE = SRC / "tests/golden/compare_logits.py"
MODELS = pathlib.Path(os.environ.get("TANDEM_TEST_MODELS", ""))
# a case of each group: a quantised model, chunked and threaded, a plan
# with ranks (TP x PP x CP), MoE with EP, and an ISA the machine may lack
ONLY = (r"^(numerics/llama3-q4_1-gguf(\.isa-(scalar|avx512))?|invariance/qwen2-q4_1-gguf\.(chunk1"
        r"|threads2)|plans/llama3-q4_0-gguf\.tp2-pp2-cp2\.batch|plans/qwen2moe-f32-gguf\.tp4-ep2"
        r"\.decode)$")


def dump(out):
    p = subprocess.run([sys.executable, str(DUMP), "--tandem", os.environ["TANDEM_BIN"],
                        "--models", str(MODELS), "--out", str(out), "--only", ONLY],
                       capture_output=True, text=True, timeout=scaled(300))
    assert p.returncode == 0, p.stderr
    return json.loads((out / "index.json").read_text())


def compare(a, b):
    return subprocess.run([sys.executable, str(COMPARE), str(a), str(b)],
                          capture_output=True, text=True, timeout=scaled(60))


def test_dump_is_deterministic_and_compare_finds_each_difference(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    idx = dump(one)
    assert len(idx) == 7, sorted(idx)
    ran = [k for k, v in idx.items() if "sha256" in v]
    assert len(ran) >= 6, idx  # only the avx512 case may be refused
    for k in ran:
        assert idx[k]["floats"] > 0 and (one / (k + ".bin")).stat().st_size == 4 * idx[k]["floats"]
    assert dump(two) == idx
    r = compare(one, two)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "7 of 7 cases bit-identical" in r.stdout, r.stdout

    # one flipped bit (the lowest of one float in the middle of a plan's run)
    case = "plans/llama3-q4_0-gguf.tp2-pp2-cp2.batch"
    f = two / (case + ".bin")
    a = np.fromfile(f, dtype="<u4")
    a[a.size // 2] ^= 1
    a.tofile(f)
    idx2 = json.loads((two / "index.json").read_text())
    idx2[case]["sha256"] = "0" * 64
    (two / "index.json").write_text(json.dumps(idx2))
    r = compare(one, two)
    assert r.returncode == 1, r.stdout
    assert f"DIFFERS {case}: 1 of {a.size} floats differ, first at {a.size // 2}" in r.stdout, r.stdout

    # a case only one side has, and one refused by one build and run by the other
    three = tmp_path / "three"
    shutil.copytree(one, three)
    idx3 = json.loads((three / "index.json").read_text())
    gone = "invariance/qwen2-q4_1-gguf.chunk1"
    del idx3[gone]
    idx3["numerics/llama3-q4_1-gguf.isa-scalar"] = {"argv": [], "exit": 1, "error": "E refused"}
    (three / "index.json").write_text(json.dumps(idx3))
    r = compare(one, three)
    assert r.returncode == 1, r.stdout
    assert f"DIFFERS {gone}: only in old" in r.stdout, r.stdout
    assert "DIFFERS numerics/llama3-q4_1-gguf.isa-scalar: old ran" in r.stdout, r.stdout
