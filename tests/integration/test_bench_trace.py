"""`tandem bench --trace`: the public trace formats (Azure LLM inference,
BurstGPT, Mooncake) replayed against a real `tandem serve` on loopback
(tiny random model) with their recorded timing and lengths, the shipped
samples and the generator that made them (tools/bench/trace_gen.py), and
a trace that lies (a bad row, a missing column, hash ids that do not match
the length) refused with the file and line.

The expected arrivals and lengths are read from the trace files here with
the csv and json modules, not taken from the bench's report."""
import csv
import datetime
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys

import pytest

from conftest import run_tandem, scaled
from serve_util import serve  # noqa: F401  (serve is a fixture)

MODEL = "gguf/llama2-f32.gguf"  # vocab 512, context 256
NAME = "tiny"
SRC = pathlib.Path(os.environ.get("TANDEM_SOURCE_DIR", pathlib.Path(__file__).parents[2]))
TRACES = SRC / "tools" / "bench" / "traces"
GEN = SRC / "tools" / "bench" / "trace_gen.py"


def expected(path, fmt):
    """(arrival s from the first, input tokens, output tokens, hash ids) in time order."""
    rows = []
    with open(path, newline="") as f:
        if fmt == "mooncake":
            for line in f:
                o = json.loads(line)
                rows.append((o["timestamp"] / 1000, o["input_length"], o["output_length"],
                             o["hash_ids"]))
        else:
            for r in csv.DictReader(f):
                if fmt == "azure":
                    head, _, frac = r["TIMESTAMP"].partition(".")
                    t = datetime.datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp() \
                        + float("0." + frac)
                    rows.append((t, int(r["ContextTokens"]), int(r["GeneratedTokens"]), None))
                elif int(r["Response tokens"]) > 0:
                    rows.append((float(r["Timestamp"]), int(r["Request tokens"]),
                                 int(r["Response tokens"]), None))
    rows.sort(key=lambda x: x[0])
    return [(t - rows[0][0], a, b, h) for (t, a, b, h) in rows]


def bench(tmp_path, url, *args, rc=0):
    out = tmp_path / f"bench-{len(list(tmp_path.glob('bench-*.json')))}.json"
    r = run_tandem("bench", "--url", url, "--model", NAME, "--no-progress", "--json", out, *args,
                   timeout=240, check=False)
    assert r.returncode == rc, r.describe()
    return (json.loads(out.read_text()) if rc == 0 else None), r


@pytest.mark.parametrize("fmt,speed,scale", [("azure", 4.0, 0.2), ("burstgpt", 2.0, 0.2)])
def test_replay_timing_and_lengths(serve, test_models, tmp_path, fmt, speed, scale):
    path = TRACES / f"sample-{fmt}.csv"
    want = expected(path, fmt)
    s = serve(test_models / MODEL, "--max-running", "8", "--served-model-name", NAME)
    rep, _ = bench(tmp_path, s.base_url, "--trace", path, "--trace-speed", speed,
                   "--trace-length-scale", scale)
    assert rep["dataset"] == f"trace:{fmt}" and rep["trace"]["format"] == fmt
    assert rep["num_prompts"] == len(want) and rep["failed"] == 0, rep["errors"]
    reqs = sorted(rep["requests"], key=lambda q: q["index"])
    for q, (t, n_in, n_out, _) in zip(reqs, want):
        # sent at the recorded offset, sped up; never early, and late only by
        # what a loaded 2-core machine costs the sender's thread
        assert t / speed - 0.005 <= q["start_s"] <= t / speed + scaled(2.0), \
            (q["index"], q["start_s"], t)
        # the recorded output length, scaled (ignore_eos: exact)
        assert q["output_tokens"] == max(1, round(n_out * scale)), q
        assert q["output_len"] == max(1, round(n_out * scale))
        assert q["input_len"] == max(1, round(n_in * scale))
    # the replay lasts as long as the trace, sped up
    assert rep["duration_s"] >= want[-1][0] / speed


def test_burstgpt_failed_rows_left_out(serve, test_models, tmp_path):
    path = tmp_path / "b.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "0,ChatGPT,20,4,24,Conversation log\n"
                    "0.5,ChatGPT,30,0,30,Conversation log\n"
                    "1.0,GPT-4,10,3,13,API log\n")
    s = serve(test_models / MODEL, "--served-model-name", NAME)
    rep, _ = bench(tmp_path, s.base_url, "--trace", path)
    assert rep["num_prompts"] == 2 and rep["completed"] == 2
    assert [q["output_tokens"] for q in sorted(rep["requests"], key=lambda q: q["index"])] == [4, 3]
    assert any("1 requests of the trace with 0 response tokens" in n for n in rep["notes"])


def test_mooncake_hash_ids_share_prefixes(serve, test_models, tmp_path):
    """Requests that start with a block id an earlier one had, sent after
    that one's first token (its prefill is done: the client's own timeline,
    not the trace's), are served partly from the prefix cache; requests
    whose first block is new share nothing."""
    path = TRACES / "sample-mooncake.jsonl"
    want = expected(path, "mooncake")
    scale = 0.05  # 512-token blocks of 26 tokens, prompts of ~75
    s = serve(test_models / MODEL, "--max-running", "8", "--served-model-name", NAME)
    rep, _ = bench(tmp_path, s.base_url, "--trace", path, "--trace-length-scale", scale)
    assert rep["dataset"] == "trace:mooncake" and rep["failed"] == 0, rep["errors"]
    reqs = sorted(rep["requests"], key=lambda q: q["index"])
    first_seen = {}  # block id -> when the first request with it had its first token
    shared, fresh = 0, 0
    for q, (_, _, _, ids) in zip(reqs, want):
        seen = first_seen.get(ids[0])
        if seen is None:
            assert q["cached_tokens"] == 0, (q["index"], ids, q["cached_tokens"])
            fresh += 1
        elif seen <= q["start_s"]:
            assert q["cached_tokens"] >= 16, (q["index"], ids, q["cached_tokens"])
            shared += 1
        first_seen.setdefault(ids[0], q["start_s"] + q["ttft_ms"] / 1e3)
    assert shared >= 3 and fresh >= 3, (shared, fresh)
    assert rep["prefix_cache_hit_rate"] > 0


BAD = [
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,3\n"
     "yesterday,10,3\n", ":3: TIMESTAMP is not a date and time"),
    ("azure", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.1,10\n",
     ":1: the azure format needs the columns"),
    ("burstgpt", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
     "0,M,-4,3,0,x\n", ":2: Request tokens must be >= 1"),
    ("burstgpt", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
     "nan,M,4,3,7,x\n", ":2: Timestamp must be a finite number"),
    ("mooncake", '{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1]}\n',
     ":1: 1 hash_ids for 600 tokens"),
    ("mooncake", '{"timestamp": 0, "input_length": 6, "output_length": 2, "hash_ids": [1]}\n'
     "{not json\n", ":2: not JSON"),
    ("mooncake", '{"timestamp": "0", "input_length": 6, "output_length": 2, "hash_ids": [1]}\n',
     ":1: timestamp must be an integer"),
    ("unknown", "a,b,c\n1,2,3\n", "not a trace tandem bench knows"),
]


@pytest.mark.parametrize("fmt,text,msg", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_lying_traces_are_refused(tmp_path, fmt, text, msg):
    path = tmp_path / f"t-{fmt}.txt"
    path.write_text(text)
    # nothing is sent: the trace is refused before any request (no server)
    _, r = bench(tmp_path, "http://127.0.0.1:9", "--trace", path, "--timeout", "2", rc=2)
    assert str(path) in r.stderr and msg in r.stderr, r.describe()


@pytest.mark.parametrize("args,msg", [
    (["--concurrency", "2"], "--trace brings its own arrivals"),
    (["--trace-speed", "0"], "--trace-speed must be > 0"),
    (["--trace-length-scale", "-1"], "--trace-length-scale must be > 0"),
    (["--dataset", "shared-prefix"], "--trace replaces --dataset"),
])
def test_trace_flags_are_checked(tmp_path, args, msg):
    _, r = bench(tmp_path, "http://127.0.0.1:9", "--trace", TRACES / "sample-azure.csv", *args,
                 rc=2)
    assert msg in r.stderr, r.describe()


def gen(tmp_path, fmt, *args):
    out = tmp_path / f"g-{fmt}-{len(list(tmp_path.iterdir()))}"
    subprocess.run([sys.executable, str(GEN), "--format", fmt, "--out", str(out), *map(str, args)],
                   check=True, timeout=60)
    return out


@pytest.mark.parametrize("burst", [1, 4])
def test_generator_distributions(tmp_path, burst):
    """Arrivals at the stated rate, with a squared coefficient of variation
    of the gaps near 1 (Poisson) or the burst factor; lognormal lengths
    with the stated medians."""
    n, rate = 4000, 5.0
    rows = expected(gen(tmp_path, "burstgpt", "--num", n, "--rate", rate, "--burst", burst,
                        "--input-median", 300, "--output-median", 40, "--seed", 7), "burstgpt")
    gaps = [b[0] - a[0] for a, b in zip(rows, rows[1:])]
    mean = statistics.fmean(gaps)
    cv2 = statistics.pvariance(gaps) / mean ** 2
    assert abs(mean - 1 / rate) < 0.1 / rate, mean
    assert abs(cv2 - burst) < 0.2 * burst, cv2
    assert abs(statistics.median(r[1] for r in rows) / 300 - 1) < 0.08
    assert abs(statistics.median(r[2] for r in rows) / 40 - 1) < 0.08


def test_generator_formats_agree(tmp_path):
    """The same seed gives the same requests in every format (the Azure
    clock and BurstGPT's seconds to the millisecond), and Mooncake's ids
    cover every prompt with one id per 512 tokens, groups sharing leading ids."""
    a = expected(gen(tmp_path, "azure", "--num", 200, "--seed", 5), "azure")
    b = expected(gen(tmp_path, "burstgpt", "--num", 200, "--seed", 5), "burstgpt")
    m = expected(gen(tmp_path, "mooncake", "--num", 200, "--seed", 5, "--input-median", 2000),
                 "mooncake")
    assert [(x[1], x[2]) for x in a] == [(x[1], x[2]) for x in b]
    assert all(abs(x[0] - y[0]) < 0.002 for x, y in zip(a, b))
    assert all(len(h) == math.ceil(n_in / 512) for _, n_in, _, h in m)
    firsts = [h[0] for _, _, _, h in m]
    assert len(set(firsts)) < len(firsts)  # some prompts share their first block
