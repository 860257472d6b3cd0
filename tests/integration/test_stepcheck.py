"""tools/planner/stepcheck.py: a profile's step model against a run's step
trace, on a trace written by hand.

The model is c0 = 10 ms + c_seq = 1 ms per sequence. The trace: a
100-token prefill taking exactly the model's 11 ms, a decode step of 2
sequences taking twice the model's 12 ms, a decode step of 3 taking the
model's 13 ms, 0.5 ms and 1 ms apart. So prefill 1.0x, decode 1.5x median
(2.0x at 2 sequences, 1.0x at 3), 37 ms measured against 25 ms, gaps of
median 0.75 ms. Against a beside model (--beside) of c0 = 20 ms + 2 ms per
sequence, each step at half its ratio to the alone one. Bad input (a truncated trace, a profile without the role)
is a one-line error, exit 1. validate.py keeps the same figures for each
run and instance from the traces its runs leave.
"""

import json
import pathlib
import subprocess
import sys

import pytest

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "planner" / "stepcheck.py"
ALONE = {"c0": 0.010, "c_tok": 0, "c_tok2": 0, "c_attn": 0, "c_attn2": 0, "c_ctx": 0,
         "c_seq": 0.001, "c_n2": 0, "c_n4": 0, "c_n8": 0, "c_n16": 0}
PROFILE = {"roles": {"colocated": {
    "step": ALONE, "overhead": {"step_overhead_s": 0.0005},
    "beside": {"step": {k: 2 * v for k, v in ALONE.items()},
               "overhead": {"step_overhead_s": 0.001}}}}}
STEPS = [(0.0, 0.011, [[1, 0, 100]]),
         (0.0115, 0.024, [[1, 100, 1], [2, 50, 1]]),
         (0.0365, 0.013, [[1, 101, 1], [2, 51, 1], [3, 40, 1]])]


def write(tmp_path, steps=STEPS, tail="", profile=PROFILE):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(profile))
    tr = tmp_path / "trace.jsonl"
    lines = [json.dumps({"tandem_step_trace": 1, "t0": 0.0})]
    lines += [json.dumps({"step": k, "ev": [["b", t, dt, e]]}) for k, (t, dt, e) in enumerate(steps)]
    tr.write_text("\n".join(lines) + "\n" + tail)
    return prof, tr


def run(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True,
                          text=True, timeout=60)


def test_ratios_by_hand(tmp_path):
    prof, tr = write(tmp_path)
    p = run(prof, tr, "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    k = out["kinds"]
    assert k["prefill"]["steps"] == 1 and k["prefill"]["median_ratio"] == pytest.approx(1.0)
    assert k["decode"]["steps"] == 2 and k["decode"]["median_ratio"] == pytest.approx(1.5)
    assert k["decode"]["measured_s"] == pytest.approx(0.037)
    assert k["decode"]["model_s"] == pytest.approx(0.025)
    by = out["decode_by_batch"]
    assert by["2"]["median_ratio"] == pytest.approx(2.0) and by["3"]["median_ratio"] == pytest.approx(1.0)
    assert out["gap_ms"]["median"] == pytest.approx(0.75) and out["gap_ms"]["profile"] == pytest.approx(0.5)
    # ratios 1, 2, 1: one step of three over 1.3x, adding 12 of the 48 ms
    assert out["ratio_quantiles"]["p50"] == pytest.approx(1.0)
    assert out["ratio_quantiles"]["p99"] == pytest.approx(2.0)
    assert out["slow_steps"]["share"] == pytest.approx(1 / 3)
    assert out["slow_steps"]["excess_share_of_busy"] == pytest.approx(12 / 48)
    text = run(prof, tr)
    assert text.returncode == 0 and "decode by batch size" in text.stdout
    p = run(prof, tr, "--json", "--beside")
    assert p.returncode == 0, p.stderr
    b = json.loads(p.stdout)
    assert b["kinds"]["prefill"]["median_ratio"] == pytest.approx(0.5)
    assert b["kinds"]["decode"]["median_ratio"] == pytest.approx(0.75)
    assert b["gap_ms"]["profile"] == pytest.approx(1.0)


def test_bad_input(tmp_path):
    prof, tr = write(tmp_path, tail='{"step": 3, "ev": [["b", 0.05,')
    p = run(prof, tr)
    assert p.returncode == 1 and "not JSON" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    prof, tr = write(tmp_path)
    p = run(prof, tr, "--role", "prefill")
    assert p.returncode == 1 and "no 'prefill' role" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    alone = {k: v for k, v in PROFILE["roles"]["colocated"].items() if k != "beside"}
    prof, tr = write(tmp_path, profile={"roles": {"colocated": alone}})
    p = run(prof, tr, "--beside")
    assert p.returncode == 1 and "no step model beside" in p.stderr, p.stderr


def test_validate_keeps_each_runs_steps(tmp_path):
    # validate.py --step-traces: each instance's steps of run k against the
    # profile, from the traces named {case}-{k}-{instance}.jsonl; the same
    # figures as above (48 ms measured against 36 in all, one step of three
    # slow), and against the beside model for instances sharing a machine
    sys.path.insert(0, str(TOOL.parent))
    import validate
    path, tr = write(tmp_path)
    prof = json.loads(path.read_text())
    tr.rename(tmp_path / "2C-0-colocated1.jsonl")
    (tmp_path / "2C-0-colocated0.jsonl").write_text("{")  # a broken one: an error, no crash
    got = validate.run_steps({"name": "2C"}, prof, tmp_path, 0, False)
    assert set(got) == {"colocated0", "colocated1"} and "error" in got["colocated0"]
    c = got["colocated1"]
    assert c["model"] == "alone" and c["in_all"] == pytest.approx(48 / 36)
    assert c["slow_share"] == pytest.approx(1 / 3) and c["ratio_p99"] == pytest.approx(2.0)
    b = validate.run_steps({"name": "2C"}, prof, tmp_path, 0, True)["colocated1"]
    assert b["model"] == "beside" and b["in_all"] == pytest.approx(48 / 72)
    assert validate.run_steps({"name": "2C"}, prof, tmp_path, 1, False) == {}
