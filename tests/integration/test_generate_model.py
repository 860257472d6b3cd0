"""`tandem generate` on the default model (SmolLM2-135M-Instruct Q4_1).

Real output: greedy chat answer names Paris. Also: --prompt, seeded sampling
reproducibility, and the peak-RSS budget (model file + KV cache +
64 MiB), measured by the kernel (ru_maxrss of the child process).
"""

import os
import re
import subprocess
import sys

import pytest

BIN = os.environ.get("TANDEM_BIN", "")


def default_model():
    env = os.environ.get("TANDEM_MODEL")
    if env:
        return env
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "tandem", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


MODEL = default_model()

pytestmark = [
    pytest.mark.skipif(not BIN or not os.access(BIN, os.X_OK), reason="TANDEM_BIN not set"),
    pytest.mark.skipif(not os.path.isfile(MODEL), reason=f"default model missing: {MODEL}"),
]

SPEED_PROMPT = re.compile(r"^prompt: (\d+) tokens, [0-9.]+ s, ([0-9.]+) tokens/s$", re.M)
SPEED_GEN = re.compile(r"^generation: (\d+) tokens, [0-9.]+ s, ([0-9.]+) tokens/s", re.M)
KV_LINE = re.compile(r"^kv cache: (\d+) bytes", re.M)


def generate(*args, timeout=600):
    cmd = [BIN, "generate", "--threads", "2", *args]
    return subprocess.run(cmd, capture_output=True, timeout=timeout)


def test_capital_of_france_greedy():
    # The "real output" check. Note on this exact input (SmolLM2's
    # template with its default system prompt, 37 tokens, this Q4_1 file):
    # the first answer token is a knife edge. A float64 forward pass on the
    # dequantized weights (tests/reference) picks "The" (-> "The capital of
    # France is Paris.") by 0.08 logits over "L"; rounding the matmul inputs
    # to 8 bits, as llama.cpp and Tandem do, moves that margin by a few
    # tenths, and llama.cpp itself (same file, same tokens, greedy) answers
    # "L'Étoile, la Marseillaise, ...". This test states the requirement as
    # the issue gives it.
    r = generate("--chat", "What is the capital of France?", "--max-tokens", "48")
    err = r.stderr.decode(errors="replace")
    out = r.stdout.decode(errors="replace")
    assert r.returncode == 0, err
    mp = SPEED_PROMPT.search(err)
    mg = SPEED_GEN.search(err)
    assert mp and mg, err
    # The ChatML prompt with SmolLM2's default system prompt is 37 tokens.
    assert int(mp.group(1)) == 37
    assert 1 <= int(mg.group(1)) <= 48
    assert float(mp.group(2)) > 0 and float(mg.group(2)) > 0
    assert "Paris" in out, f"answer was: {out!r}"


def test_greedy_is_deterministic():
    a = generate("--chat", "What is the capital of France?", "--max-tokens", "24")
    b = generate("--chat", "What is the capital of France?", "--max-tokens", "24")
    assert a.returncode == 0 and b.returncode == 0
    assert a.stdout == b.stdout


def test_stops_at_end_of_generation_token():
    # A short arithmetic answer ends with <|im_end|> well before 48 tokens;
    # generation must stop there and the token's text must not leak out.
    r = generate("--chat", "What is 2+2?", "--max-tokens", "48")
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 0, err
    assert "finish: stop" in err, err
    assert b"<|im_end|>" not in r.stdout and b"<|im_start|>" not in r.stdout
    assert b"4" in r.stdout, r.stdout
    assert int(SPEED_GEN.search(err).group(1)) < 48


def test_raw_prompt():
    r = generate("--prompt", "The capital of France is", "--max-tokens", "8")
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 0, err
    mg = SPEED_GEN.search(err)
    assert mg, err
    assert r.stdout.strip(), "no text generated"
    # Without a template the model continues the sentence and runs to the limit
    # unless it emits EOS; either way at most 8 tokens.
    assert 1 <= int(mg.group(1)) <= 8


def test_stop_string_truncates():
    # Greedy: the first run shows where the answer goes; stopping at its
    # second word must cut the output right before that word.
    full = generate("--chat", "What is the capital of France?", "--max-tokens", "48")
    assert full.returncode == 0
    words = full.stdout.decode().split()
    assert len(words) >= 2, full.stdout
    stop = words[1]
    cut = generate("--chat", "What is the capital of France?", "--max-tokens", "48",
                   "--stop", stop)
    assert cut.returncode == 0, cut.stderr.decode()
    text = full.stdout.decode()
    expected = text[:text.index(stop)]
    assert cut.stdout.decode() == expected + "\n"


def test_seeded_sampling_reproducible():
    args = ["--chat", "Write a short poem about the sea.", "--max-tokens", "40",
            "--temperature", "1.0", "--top-p", "0.95"]
    a = generate(*args, "--seed", "1234")
    b = generate(*args, "--seed", "1234")
    c = generate(*args, "--seed", "98765")
    for r in (a, b, c):
        assert r.returncode == 0, r.stderr.decode()
    assert a.stdout == b.stdout
    # 40 tokens at temperature 1 from a poem prompt: two seeds giving the same
    # text would mean the seed is ignored (this can fail, and would be a bug).
    assert a.stdout != c.stdout


def test_peak_rss_within_budget():
    # ru_maxrss of RUSAGE_CHILDREN in a fresh interpreter is exactly this
    # child's peak resident set (KiB on Linux).
    probe = (
        "import resource, subprocess, sys\n"
        "r = subprocess.run(sys.argv[1:], capture_output=True)\n"
        "sys.stderr.buffer.write(r.stderr)\n"
        "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    cmd = [sys.executable, "-c", probe, BIN, "generate", "--threads", "2", "--chat",
           "What is the capital of France?", "--max-tokens", "32"]
    r = subprocess.run(cmd, capture_output=True, timeout=600)
    err = r.stderr.decode(errors="replace")
    rc, maxrss_kib = (int(x) for x in r.stdout.split())
    assert rc == 0, err
    m = KV_LINE.search(err)
    assert m, err
    kv_bytes = int(m.group(1))
    budget = os.path.getsize(MODEL) + kv_bytes + 64 * 1024 * 1024
    peak = maxrss_kib * 1024
    assert peak <= budget, f"peak RSS {peak} > budget {budget} (kv {kv_bytes})"
