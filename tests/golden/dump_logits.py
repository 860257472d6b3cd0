#!/usr/bin/env python3
"""Dumps the logits of a fixed set of forward-pass cases through `tandem
eval`, so that two builds (before and after a restructuring of the forward
pass) can be compared bit for bit in one run on one machine.

  dump_logits.py --tandem BIN --models DIR [--default-model GGUF] --out DIR
                 [--only REGEX] [--list]

The cases are those the numerics, invariance and parallel-plan suites check
(tests/integration/test_numerics.py, tests/unit/test_invariance.c,
test_parallel*.py), with the same kinds of inputs:
  numerics/   every tiny model (every architecture x weight type x format),
              one chunk per sequence, and one model per weight type through
              every kernel ISA the machine has
  invariance/ chunk sizes 1, 5 and whole; batched; 1 and 2 threads
  plans/      TP, PP, CP (allgather and ring), TP x PP x CP, MoE EP and
              attention-DP, on dense and MoE models
  default/    the default model (when --default-model is given): one chunk,
              decode steps, a batch, TP 3, PP 2, CP 2
Inputs are seeded, so both builds see the same tokens. Each case writes
OUT/<case>.bin (float32 logits as `tandem eval` writes them) and one line in
OUT/index.json: {case: {"argv": [...], "sha256": ..., "floats": N}}; a case
that the build refuses (an ISA the machine lacks) is recorded with its exit
status and message instead, so both builds must refuse it alike.

The goldens depend on the machine (AVX2, AVX-512 and AMX kernels round
differently): never commit them, regenerate both sides here
(scripts/golden-compare.sh does).
"""
import argparse
import hashlib
import json
import os
import pathlib
import random
import re
import subprocess
import sys
import tempfile

ISAS = ("scalar", "avx2", "avx512")


def seqs(vocab, lens, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def vocab_of(entry):
    return int(entry["config"]["n_vocab"])


def cases(models_dir, default_model):
    """(name, model path, sequences, extra argv) for every case."""
    man = json.loads((models_dir / "models.json").read_text())
    dense = {e["name"]: e for e in man["models"]}
    every = {**dense, **{e["name"]: e for e in man.get("moe_models", [])}}
    out = []

    def add(group, name, entry, lens, seed, extra):
        out.append((f"{group}/{name}", models_dir / entry["path"],
                    seqs(vocab_of(entry), lens, seed), list(extra)))

    for name, e in sorted(every.items()):
        add("numerics", name, e, (1, 7, 33), 11, ["--chunk", "64"])
    for wtype in ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mixed",
                  "q4_k_m"):
        e = dense[f"llama3-{wtype}-gguf"]
        for isa in ISAS:
            add("numerics", f"llama3-{wtype}-gguf.isa-{isa}", e, (5, 19), 12, ["--isa", isa])
    for wtype in ("q4_k", "q5_k", "q6_k"):  # whole 256-element super-blocks: qwen25
        e = dense[f"qwen25-{wtype}-gguf"]
        for isa in ISAS:
            add("numerics", f"qwen25-{wtype}-gguf.isa-{isa}", e, (5, 19), 12, ["--isa", isa])
    # int8 activations (--act-int8), each quantized type and ISA
    act = [f"llama3-{w}-gguf" for w in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m")]
    act += [f"qwen25-{w}-gguf" for w in ("q4_k", "q5_k", "q6_k")]
    for name in act:
        for isa in ISAS:
            add("numerics", f"{name}.act-int8.isa-{isa}", dense[name], (5, 19), 12,
                ["--isa", isa, "--act-int8"])

    for name in ("llama2-q8_0-gguf", "llama3-f32-gguf", "qwen2-q4_1-gguf", "mistral-mixed-gguf",
                 "tinyllama-bf16-hf-sharded", "mixtral-q8_0-gguf", "qwen25-q4_k-gguf",
                 "tinyllama-q4_k_m-gguf"):
        e = every[name]
        for mode, extra in (("chunk1", ["--chunk", "1"]), ("chunk5", ["--chunk", "5"]),
                            ("whole", ["--chunk", "64"]),
                            ("batch5", ["--chunk", "5", "--batch"]),
                            ("threads1", ["--threads", "1", "--chunk", "5"]),
                            ("threads2", ["--threads", "2", "--chunk", "5"])):
            add("invariance", f"{name}.{mode}", e, (8, 21, 40), 13, extra)

    cp = ["--cp-min-tokens", "4"]
    plans = [
        ("llama2-q8_0-gguf", "pp2", ["--pp", "2"]),
        ("smollm2-f32-gguf", "pp2-2,1", ["--pp", "2", "--pp-layers", "2,1"]),
        ("tinyllama-f32-gguf", "tp2", ["--tp", "2"]),
        ("tinyllama-f32-gguf", "tp4", ["--tp", "4"]),
        ("qwen2-f32-hf", "tp2-pp2", ["--tp", "2", "--pp", "2"]),
        ("llama3-f32-gguf", "cp2-allgather", ["--cp", "2", "--cp-mode", "allgather"] + cp),
        ("llama3-f32-gguf", "cp2-ring", ["--cp", "2", "--cp-mode", "ring"] + cp),
        ("llama3-q4_0-gguf", "tp2-pp2-cp2", ["--tp", "2", "--pp", "2", "--cp", "2",
                                              "--cp-mode", "ring"] + cp),
        ("qwen2moe-f32-gguf", "tp2", ["--tp", "2"]),
        ("qwen2moe-f32-gguf", "tp4-ep2", ["--tp", "4", "--ep", "2"]),
        ("mixtral-q8_0-gguf", "tp4-pp2", ["--tp", "4", "--pp", "2"]),
        ("qwen2moe-f32-hf", "tp2-attn-dp", ["--tp", "2", "--attn-dp"]),
        ("mixtral-f32-gguf", "tp4-attn-dp", ["--tp", "4", "--attn-dp"]),
        ("mixtral-f32-gguf", "tp2-cp2", ["--tp", "2", "--cp", "2", "--cp-min-tokens", "1"]),
    ]
    for name, tag, plan in plans:
        e = every[name]
        for mode, extra in (("prefill", ["--chunk", "64"]), ("decode", ["--chunk", "1"]),
                            ("batch", ["--chunk", "5", "--batch"])):
            add("plans", f"{name}.{tag}.{mode}", e, (40, 40, 40), 14, plan + extra)

    if default_model:
        vocab = 49152  # SmolLM2's; the tokens only need to be in range
        d = pathlib.Path(default_model)
        rng_lens = (12, 30)
        for tag, extra in (("whole", ["--chunk", "64"]), ("chunk1", ["--chunk", "1"]),
                           ("batch8", ["--chunk", "8", "--batch"]),
                           ("tp3", ["--tp", "3", "--chunk", "64"]),  # 3 KV heads
                           ("pp2", ["--pp", "2", "--chunk", "8", "--batch"]),
                           ("cp2", ["--cp", "2", "--cp-min-tokens", "8", "--chunk", "64"]),
                           ("act-int8", ["--act-int8", "--chunk", "64"])):
            out.append((f"default/{tag}", d, seqs(vocab, rng_lens, 15), extra))
    return out


def run_case(tandem, model, sequences, extra, path, timeout):
    with tempfile.TemporaryDirectory() as td:
        tin = os.path.join(td, "in.json")
        with open(tin, "w") as f:
            json.dump({"sequences": sequences}, f)
        argv = [tandem, "eval", "--model", str(model), "--tokens", tin, "--out", str(path)]
        argv += extra
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    shown = ["tandem", "eval", "--model", str(model), *extra]
    if p.returncode != 0:
        path.unlink(missing_ok=True)
        last = [ln for ln in p.stderr.splitlines() if ln.strip()][-1:] or [""]
        return {"argv": shown, "exit": p.returncode, "error": last[0]}
    data = path.read_bytes()
    return {"argv": shown, "sha256": hashlib.sha256(data).hexdigest(), "floats": len(data) // 4}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tandem", required=True, help="the tandem binary")
    ap.add_argument("--models", required=True, type=pathlib.Path,
                    help="the tiny test models (tests/models/make_models.py --out)")
    ap.add_argument("--default-model", help="the default model's GGUF (cases default/*)")
    ap.add_argument("--out", type=pathlib.Path, help="where the .bin files and index.json go")
    ap.add_argument("--only", help="the cases whose name matches this regex")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per case")
    a = ap.parse_args()
    selected = [c for c in cases(a.models, a.default_model)
                if not a.only or re.search(a.only, c[0])]
    if a.list:
        print("\n".join(c[0] for c in selected))
        return 0
    if not a.out:
        ap.error("--out is required")
    index = {}
    for name, model, sequences, extra in selected:
        path = a.out / (name + ".bin")
        path.parent.mkdir(parents=True, exist_ok=True)
        index[name] = run_case(a.tandem, model, sequences, extra, path, a.timeout)
    (a.out / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    refused = sum("exit" in v for v in index.values())
    print(f"dump_logits: {len(index)} cases ({refused} refused by this build) in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
