"""`tandem eval` (contract in tools/cmd-eval.c) on tiny models: output layout,
the invariance contract through the CLI (--batch, --chunk, --threads give the
same bytes), and the error paths (exit 1 with one line, exit 2 on usage).

The logits' values are checked against the NumPy reference in
test_numerics.py; here the tests check what the CLI adds on top of the engine.
"""

import json
import os
import pathlib

import numpy as np
import pytest

from conftest import run_tandem, tandem_eval_raw

MODEL = "gguf/smollm2-mixed.gguf"  # quantized, GQA, tied head: the default model's shape
SEQS = [
    [1, 17, 200, 33, 45, 46, 47, 300, 301, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [5],
    [7, 8, 9, 400, 401, 402, 403],
    [],
    [100 + i for i in range(40)],
]


@pytest.fixture
def model(test_models):
    return str(test_models / MODEL)


def _n_vocab(manifest):
    for e in manifest:
        if e["path"] == MODEL:
            return e["config"]["n_vocab"]
    pytest.fail(f"{MODEL} missing from models.json")


def test_layout_and_isa_line(model, manifest, tandem_bin, tmp_path):
    r, out = tandem_eval_raw(model, SEQS, binary=tandem_bin, workdir=tmp_path)
    V = _n_vocab(manifest)
    assert [a.shape for a in out] == [(len(s), V) for s in SEQS]
    for a in out:
        assert np.isfinite(a).all()
    # different positions give different logits (not a constant row)
    assert not np.array_equal(out[0][0], out[0][1])
    assert any(line.startswith("isa: ") for line in r.stderr.splitlines()), r.stderr


@pytest.mark.parametrize("opts", [
    dict(batch=True),
    dict(chunk=1),
    dict(chunk=5, batch=True),
    dict(chunk=16, threads=1),
    dict(chunk=3, batch=True, threads=2),
])
def test_same_bytes_any_schedule(model, tandem_bin, tmp_path, opts):
    _, ref = tandem_eval_raw(model, SEQS, binary=tandem_bin, workdir=tmp_path)
    _, got = tandem_eval_raw(model, SEQS, binary=tandem_bin, workdir=tmp_path, **opts)
    for a, b in zip(ref, got):
        assert a.tobytes() == b.tobytes()


def test_isa_forced(model, tandem_bin, tmp_path):
    r, out = tandem_eval_raw(model, SEQS[:1], isa="scalar", binary=tandem_bin, workdir=tmp_path)
    assert "isa: scalar" in r.stderr
    assert out[0].shape[0] == len(SEQS[0])


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _one_error_line(r):
    lines = [l for l in r.stderr.splitlines() if l.strip() and not l.startswith("isa: ")]
    assert len(lines) == 1, r.describe()
    return lines[0]


@pytest.mark.parametrize("tokens, needle", [
    ('{"sequences": [[1, 2, 999999]]}', "token id 999999"),
    ('{"sequences": [[1, -1]]}', "token id -1"),
    ('{"sequences": [[1, 2', "in.json"),
    ('{"sequences": 5}', "sequences"),
    ('{"sequences": [[1, 2.5]]}', "not a token id"),
    ('[]', "sequences"),
])
def test_bad_input_exit_1(model, tmp_path, tokens, needle):
    tin = _write(tmp_path, "in.json", tokens)
    out = tmp_path / "out.bin"
    r = run_tandem("eval", "--model", model, "--tokens", tin, "--out", out, check=False)
    assert r.returncode == 1, r.describe()
    assert needle in _one_error_line(r), r.describe()


def test_unreadable_files_exit_1(model, tmp_path):
    tin = _write(tmp_path, "in.json", '{"sequences": [[1, 2]]}')
    r = run_tandem("eval", "--model", tmp_path / "nope.gguf", "--tokens", tin,
                   "--out", tmp_path / "o.bin", check=False)
    assert r.returncode == 1 and "nope.gguf" in _one_error_line(r), r.describe()
    r = run_tandem("eval", "--model", model, "--tokens", tmp_path / "missing.json",
                   "--out", tmp_path / "o.bin", check=False)
    assert r.returncode == 1 and "missing.json" in _one_error_line(r), r.describe()
    r = run_tandem("eval", "--model", model, "--tokens", tin,
                   "--out", tmp_path / "no-such-dir" / "o.bin", check=False)
    assert r.returncode == 1 and "no-such-dir" in _one_error_line(r), r.describe()
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + os.urandom(200))
    r = run_tandem("eval", "--model", garbage, "--tokens", tin, "--out", tmp_path / "o.bin",
                   check=False)
    assert r.returncode == 1 and "garbage.gguf" in _one_error_line(r), r.describe()


@pytest.mark.parametrize("args", [
    [],
    ["--tokens", "x.json"],
    ["--chunk", "0", "--tokens", "x.json", "--out", "o.bin"],
    ["--threads", "abc", "--tokens", "x.json", "--out", "o.bin"],
    ["--threads", "4097", "--tokens", "x.json", "--out", "o.bin"],  # generate's bound
    ["--bogus"],
])
def test_usage_exit_2(args):
    r = run_tandem("eval", *args, check=False)
    assert r.returncode == 2, r.describe()


def test_unknown_isa_exit_1(model, tmp_path):
    tin = _write(tmp_path, "in.json", '{"sequences": [[1, 2]]}')
    r = run_tandem("eval", "--model", model, "--tokens", tin, "--out", tmp_path / "o.bin",
                   "--isa", "sse9", check=False)
    assert r.returncode == 1 and "sse9" in _one_error_line(r), r.describe()
