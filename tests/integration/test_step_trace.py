"""The scheduler's step trace (`tandem serve --step-trace`) and `tandem
replay`, which drives the scheduling core (common/sched/core.c, the code the
simulator runs) with a trace's arrivals, tokens and ends on a pool of the
recorded size and checks it admits, preempts and batches exactly as the real
scheduler did at every step.

- A real run under a load that exhausts the KV pool (preemptions) and hits
  the prefix cache: its trace replays with every decision equal.
- A trace recorded before the scheduling policy moved into core.c
  (tests/golden/step-trace-preempt.jsonl, made by the scheduler of commit
  8f0b21a with the trace events added) replays equal: the restructuring
  changed no decision. Re-record it when the policy changes on purpose.
- Tampered traces (a batch chunk changed, an admission dropped, a
  preemption added) are caught at the step they differ; a malformed,
  truncated or foreign file is a one-line error, never a crash.
"""

import concurrent.futures as cf
import json
import random
import subprocess

import openai
import pytest

from conftest import manifest_model, scaled
from serve_util import serve  # noqa: F401  (the fixture)

MODEL = "llama3-q8_0-gguf"  # 2 layers, ctx 256, vocab 512


def load(base_url, n=24, conc=8, seed=7):
    """n completions of token-id prompts (a third share a 48-token prefix),
    greedy with ignore_eos, conc at a time."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(48)]
    reqs = []
    for i in range(n):
        body = [rng.randrange(3, 512) for _ in range(rng.randrange(8, 60))]
        # long outputs: the sequences overlap (and exhaust the pool) however
        # slowly the client threads start
        reqs.append(((prefix if i % 3 == 0 else []) + body, rng.randrange(90, 140)))
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0,
                           timeout=scaled(120))

    def one(r):
        out = client.completions.create(model="tiny", prompt=r[0], max_tokens=r[1], temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == r[1]

    with cf.ThreadPoolExecutor(conc) as ex:
        list(ex.map(one, reqs))


def replay(tandem_bin, path, *extra):
    return subprocess.run([str(tandem_bin), "replay", "--trace", str(path), *extra],
                          capture_output=True, text=True, timeout=scaled(120))


def read_trace(path):
    lines = path.read_text().splitlines()
    return json.loads(lines[0]), [json.loads(x) for x in lines[1:]]


def write_trace(path, header, steps):
    path.write_text("".join(json.dumps(x) + "\n" for x in [header] + steps))


def record_trace(tandem_bin, model, d, flags):
    """The step trace of `load` on an instance of the tiny model with flags."""
    from serve_util import Server
    path = d / "steps.jsonl"
    srv = Server.start(tandem_bin, model, ["--served-model-name", "tiny", "--threads", "1",
                                           *flags, "--step-trace", str(path)], d)
    try:
        load(srv.base_url)
        srv.wait_idle()
    finally:
        srv.close()
    return path


@pytest.fixture(scope="module")
def real_trace(tandem_bin, tmp_path_factory, test_models, manifest):
    """A trace of a run that preempts and hits the prefix cache."""
    return record_trace(tandem_bin, manifest_model(manifest, test_models, MODEL),
                        tmp_path_factory.mktemp("trace"),
                        ["--kv-blocks", "22", "--max-running", "8", "--max-batch-tokens", "48",
                         "--reserve-output-tokens", "0"])


def test_real_run_replays_equal(tandem_bin, real_trace):
    header, steps = read_trace(real_trace)
    assert header["tandem_step_trace"] == 1 and header["n_blocks"] == 22
    kinds = [e[0] for s in steps for e in s["ev"]]
    assert kinds.count("in") == 24 and kinds.count("end") == 24
    assert kinds.count("pre") > 0, "the load did not exhaust the pool (no preemption to check)"
    r = replay(tandem_bin, real_trace, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["same"] and out["requests"] == 24 and out["preemptions"] == kinds.count("pre")
    assert out["admissions"] == kinds.count("adm") and out["tokens"] == kinds.count("tok")
    # a batch entry's chunk never exceeds the step budget, as recorded
    for s in steps:
        for e in s["ev"]:
            if e[0] == "b":
                assert sum(x[2] for x in e[3]) <= header["max_batch_tokens"]


@pytest.fixture(scope="module")
def tpot_trace(tandem_bin, tmp_path_factory, test_models, manifest):
    """A trace of a run under --tpot-target-ms 5: the prompt tokens a step
    beside decodes takes come from the step times measured."""
    return record_trace(tandem_bin, manifest_model(manifest, test_models, MODEL),
                        tmp_path_factory.mktemp("tpot"),
                        ["--kv-blocks", "200", "--max-running", "8", "--max-batch-tokens", "256",
                         "--tpot-target-ms", "5"])


def test_tpot_target_run_replays_equal(tandem_bin, tpot_trace, tmp_path):
    """The budget beside decodes is a function of the trace (the step times
    it records, exactly): the replay takes every decision the scheduler
    took; with the recorded step times a hundred times longer, it does
    not."""
    header, steps = read_trace(tpot_trace)
    assert header["tpot_target_s"] == 0.005
    r = replay(tandem_bin, tpot_trace, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["same"] and out["requests"] == 24
    # prompt chunks beside decodes of more than a token (the budget's
    # floor): a hundredfold slower machine would have held them to one
    big = sum(1 for s in steps for e in s["ev"]
              if e[0] == "b" and any(x[2] == 1 for x in e[3])
              for x in e[3] if x[2] > 1)
    assert big, "no prompt chunk of 2+ tokens ran beside decodes: the load did not mix them"
    t = json.loads(json.dumps(steps))
    for s in t:
        for e in s["ev"]:
            if e[0] == "b":
                e[2] *= 100
    bad = tmp_path / "scaled.jsonl"
    write_trace(bad, header, t)
    r = replay(tandem_bin, bad)
    assert r.returncode == 1 and "batch" in r.stderr, (big, r.stderr)


def test_trace_from_before_the_core_replays_equal(tandem_bin, source_dir):
    path = source_dir / "tests/golden/step-trace-preempt.jsonl"
    r = replay(tandem_bin, path, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["same"] and out["preemptions"] > 0 and out["requests"] > 0


def first_step_with(steps, kind):
    for i, s in enumerate(steps):
        if any(e[0] == kind for e in s["ev"]):
            return i
    pytest.fail(f"no {kind} event in the trace")


def test_tampered_traces_are_caught(tandem_bin, real_trace, tmp_path):
    header, steps = read_trace(real_trace)
    bad = tmp_path / "bad.jsonl"

    # a prefill chunk one token shorter than the scheduler took
    i = next(i for i, s in enumerate(steps) for e in s["ev"] if e[0] == "b" and
             any(x[2] > 1 for x in e[3]))
    t = json.loads(json.dumps(steps))
    b = next(e for e in t[i]["ev"] if e[0] == "b")
    x = next(x for x in b[3] if x[2] > 1)
    x[2] -= 1
    write_trace(bad, header, t)
    r = replay(tandem_bin, bad)
    assert r.returncode == 1 and f"step {steps[i]['step']}: batch entry" in r.stderr, r.stderr

    # an admission the scheduler did not take
    i = first_step_with(steps, "adm")
    t = json.loads(json.dumps(steps))
    t[i]["ev"] = [e for e in t[i]["ev"] if e[0] != "adm"]
    write_trace(bad, header, t)
    r = replay(tandem_bin, bad)
    assert r.returncode == 1 and "adm" in r.stderr and f"step {steps[i]['step']}" in r.stderr

    # a preemption the core would not make
    i = first_step_with(steps, "b")
    t = json.loads(json.dumps(steps))
    first = t[i]["ev"][[e[0] for e in t[i]["ev"]].index("b")][3][0][0]
    t[i]["ev"].insert([e[0] for e in t[i]["ev"]].index("b"), ["pre", first])
    write_trace(bad, header, t)
    r = replay(tandem_bin, bad)
    assert r.returncode == 1 and "pre" in r.stderr, r.stderr

    # a pool of another size changes the decisions
    h = dict(header, n_blocks=header["n_blocks"] + 40)
    write_trace(bad, h, steps)
    r = replay(tandem_bin, bad)
    assert r.returncode == 1 and "differs" in r.stderr, r.stderr


@pytest.mark.parametrize("content, words", [
    ("", "empty trace"),
    ("not json\n", "not JSON"),
    ('{"hello": 1}\n', "not a step-trace header"),
    ('{"tandem_step_trace":1,"max_running":4,"max_batch_tokens":64,"max_waiting":8,'
     '"reserve_output_tokens":0,"max_ctx":64,"prefix_cache":true,'
     '"compat":"00000000000000000000000000000000","n_blocks":8,"block_size":16}\n'
     '{"step":0,"ev":[["in",1,4,[1,2,3]]', "not JSON"),
    ('{"tandem_step_trace":1,"max_running":4,"max_batch_tokens":64,"max_waiting":8,'
     '"reserve_output_tokens":0,"max_ctx":64,"prefix_cache":true,'
     '"compat":"00000000000000000000000000000000","n_blocks":8,"block_size":16}\n'
     '{"step":0,"ev":[["in",1,4,[1,-2,3]]]}\n', "not a token id"),
    ('{"tandem_step_trace":1,"max_running":4,"max_batch_tokens":64,"max_waiting":8,'
     '"reserve_output_tokens":0,"max_ctx":64,"prefix_cache":true,'
     '"compat":"00000000000000000000000000000000","n_blocks":8,"block_size":16}\n'
     '{"step":0,"ev":[["end",5]]}\n', "unknown ticket"),
    ('{"tandem_step_trace":1,"max_running":4,"max_batch_tokens":64,"max_waiting":8,'
     '"reserve_output_tokens":0,"max_ctx":64,"prefix_cache":true,'
     '"compat":"00000000000000000000000000000000","n_blocks":8,"block_size":16}\n'
     '{"step":0,"ev":[["in",1,4,[1,2,3],0.1],["adm",1,1]]}\n', "remote prefills"),
    ('{"tandem_step_trace":1,"max_running":4,"max_batch_tokens":64,"max_waiting":8,'
     '"reserve_output_tokens":0,"max_ctx":64,"prefix_cache":true,'
     '"compat":"00000000000000000000000000000000","n_blocks":8,"block_size":16,'
     '"tpot_target_s":-1}\n', "tpot_target_s"),
    ('{"tandem_step_trace":1,"max_running":4,"max_batch_tokens":64,"max_waiting":8,'
     '"reserve_output_tokens":0,"max_ctx":64,"prefix_cache":true,'
     '"compat":"00000000000000000000000000000000","n_blocks":8,"block_size":16,'
     '"tpot_decode_factor":"x"}\n', "tpot_decode_factor"),
    ('{"tandem_step_trace":1,"max_running":4,"max_batch_tokens":64,"max_waiting":8,'
     '"reserve_output_tokens":0,"max_ctx":64,"prefix_cache":true,'
     '"compat":"00000000000000000000000000000000","n_blocks":8,"block_size":16}\n'
     '{"step":0,"ev":[["in",1,4,[1,2,3],0.1],["adm",1,0],["b",0.1,"x",[[1,0,3]]]]}\n',
     "dt is a number"),
])
def test_bad_traces_one_line(tandem_bin, tmp_path, content, words):
    p = tmp_path / "t.jsonl"
    p.write_text(content)
    r = replay(tandem_bin, p)
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and str(p) in lines[0], r.stderr


def test_replay_usage(tandem_bin, tmp_path):
    r = subprocess.run([str(tandem_bin), "replay"], capture_output=True, text=True)
    assert r.returncode == 2 and "--trace" in r.stderr
    r = replay(tandem_bin, tmp_path / "missing.jsonl")
    assert r.returncode == 1 and "missing.jsonl" in r.stderr
