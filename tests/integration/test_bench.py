"""`tandem bench` against a real `tandem serve` on loopback (tiny random model).

Every figure of the JSON report is checked against something the bench did
not compute itself: the requested lengths (ignore_eos makes outputs exact),
the server's own counters in /metrics, percentiles recomputed with NumPy from
the per-request records, the concurrency bound from the records' intervals,
and SLOs chosen so that the goodput is known in advance.

Error handling contract (tools/bench/serve_bench.py --help): failed requests
are counted by kind in the report; the exit status is 1 when no request
completed, 0 otherwise, 2 for bad arguments or dataset files.
"""
import json
import socket

import numpy as np
import pytest

from conftest import free_port, run_tandem, wait_until
from serve_util import metric, serve  # noqa: F401  (serve is a fixture)

MODEL = "gguf/llama2-f32.gguf"  # vocab 512, context 256
KEY = "bench-key"
NAME = "tiny"


def start(serve, test_models, *extra):
    return serve(test_models / MODEL, "--max-running", "8", "--served-model-name", NAME, *extra)


def bench(tmp_path, url, *args, rc=0, key=None, model=NAME):
    out = tmp_path / f"bench-{len(list(tmp_path.glob('bench-*.json')))}.json"
    argv = ["bench", "--url", url, "--json", out, *args]
    if key:
        argv += ["--api-key", key]
    if model:
        argv += ["--model", model]
    r = run_tandem(*argv, timeout=180, check=False)
    assert r.returncode == rc, r.describe()
    with open(out) as f:
        return json.load(f), r


def check_summary(rep):
    """The report's statistics equal NumPy's over the per-request records."""
    ok = [q for q in rep["requests"] if q["success"]]
    assert rep["completed"] == len(ok)
    assert rep["failed"] == len(rep["requests"]) - len(ok)
    series = {
        "ttft_ms": [q["ttft_ms"] for q in ok],
        "e2e_ms": [q["e2e_ms"] for q in ok],
        "tpot_ms": [q["tpot_ms"] for q in ok if q["output_tokens"] > 1],
        "itl_ms": [x for q in ok for x in q["itl_ms"]],
    }
    for key, vals in series.items():
        s = rep[key]
        assert s["count"] == len(vals), key
        if not vals:
            # e.g. ITL when every answer arrived in one chunk (a fast model
            # outruns the client): no statistic at all, not a made-up one
            assert all(s[k] is None for k in ("mean", "min", "p50", "p90", "p95", "p99",
                                              "max")), (key, s)
            continue
        v = np.array(vals, dtype=np.float64)
        assert s["mean"] == pytest.approx(v.mean(), rel=1e-9), key
        for p in (50, 90, 95, 99):
            assert s[f"p{p}"] == pytest.approx(np.percentile(v, p), rel=1e-9), (key, p)
        assert s["min"] <= s["p50"] <= s["p90"] <= s["p95"] <= s["p99"] <= s["max"], key
    for q in ok:
        # TPOT by its definition, from the record's own E2E, TTFT and usage.
        if q["output_tokens"] > 1:
            want = (q["e2e_ms"] - q["ttft_ms"]) / (q["output_tokens"] - 1)
            assert q["tpot_ms"] == pytest.approx(want, rel=1e-9)
        assert 0 < q["ttft_ms"] <= q["e2e_ms"]
        # Gaps between text-bearing chunks: at most one per token after the first.
        assert len(q["itl_ms"]) <= q["output_tokens"] - 1
        assert q["usage"], "output tokens must come from the usage chunk"
    out_tok = sum(q["output_tokens"] for q in ok)
    in_tok = sum(q["prompt_tokens"] for q in ok)
    assert rep["total_output_tokens"] == out_tok
    assert rep["total_input_tokens"] == in_tok
    d = rep["duration_s"]
    assert rep["request_throughput"] == pytest.approx(len(ok) / d, rel=1e-9)
    assert rep["output_throughput"] == pytest.approx(out_tok / d, rel=1e-9)
    assert rep["total_token_throughput"] == pytest.approx((in_tok + out_tok) / d, rel=1e-9)
    # The run lasts at least as long as its longest request.
    assert d * 1e3 >= max(q["e2e_ms"] for q in ok)


def max_overlap(recs):
    ev = []
    for q in recs:
        ev.append((q["start_s"], 1))
        ev.append((q["start_s"] + q["e2e_ms"] / 1e3, -1))
    ev.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    cur = best = 0
    for _, d in ev:
        cur += d
        best = max(best, cur)
    return best


def server_counts(srv):
    m = srv.metrics()
    return {
        "gen": metric(m, "vllm:generation_tokens_total"),
        "prompt": metric(m, "vllm:prompt_tokens_total"),
        "length": metric(m, "vllm:request_success_total", finished_reason="length"),
        "hits": metric(m, "vllm:prefix_cache_hits_total"),
    }


def test_help_documents_file_format_and_exit_status(tandem):
    r = tandem("bench", "--help")
    assert '{"prompt": "text", "output_len": 128}' in r.stdout
    assert "exit status" in r.stdout
    r = tandem("bench", "--url", "http://127.0.0.1:1", "--input-len", "9:3", check=False)
    assert r.returncode == 2 and "--input-len" in r.stderr


def test_random_concurrency(serve, test_models, tmp_path):
    srv = start(serve, test_models)
    before = server_counts(srv)
    rep, r = bench(tmp_path, srv.base_url, "--dataset", "random", "--num-prompts", "16",
                   "--input-len", "16:40", "--output-len", "4:12", "--concurrency", "3",
                   "--slo", "ttft:100000,tpot:100000", "--seed", "7")
    after = server_counts(srv)
    assert rep["completed"] == 16 and rep["failed"] == 0 and rep["errors"] == {}
    recs = rep["requests"]
    assert [q["index"] for q in recs] == list(range(16))
    for q in recs:
        assert 4 <= q["output_len"] <= 12 and 16 <= q["input_len"] <= 40
        assert q["output_tokens"] == q["output_len"]  # ignore_eos + min_tokens: exact
        # Prompts fitted with the server's /tokenize: the tiny BPE moves the
        # count by up to ~4 tokens per word, plus the BOS the server adds.
        assert abs(q["prompt_tokens"] - q["input_len"]) <= 5, q
    assert rep["prompt_lengths_calibrated"] is True
    check_summary(rep)
    assert max_overlap(recs) <= 3
    # The server's own counters saw exactly these requests.
    assert after["gen"] - before["gen"] == sum(q["output_len"] for q in recs)
    assert after["prompt"] - before["prompt"] == sum(q["prompt_tokens"] for q in recs)
    assert after["length"] - before["length"] == 16
    # Every request meets a 100 s SLO: goodput is the request throughput.
    assert rep["good_requests"] == 16
    assert rep["goodput"] == pytest.approx(rep["request_throughput"], rel=1e-12)
    # The table on stdout and the progress bar on stderr.
    assert "Successful requests:" in r.stdout and "TTFT" in r.stdout and "P99" in r.stdout
    assert "16/16 requests" in r.stderr
    # Different seeds make different prompts; the same seed the same lengths.
    rep2, _ = bench(tmp_path, srv.base_url, "--num-prompts", "4", "--input-len", "16:40",
                    "--output-len", "4:12", "--concurrency", "2", "--seed", "7",
                    "--no-progress")
    assert [(q["input_len"], q["output_len"]) for q in rep2["requests"]] == \
        [(q["input_len"], q["output_len"]) for q in recs[:4]]
    srv.wait_idle()


def test_random_rate_and_unmeetable_slo(serve, test_models, tmp_path):
    srv = start(serve, test_models)
    rep, _ = bench(tmp_path, srv.base_url, "--num-prompts", "16", "--input-len", "24",
                   "--output-len", "6", "--request-rate", "8", "--slo", "ttft:0.001",
                   "--seed", "3", "--no-progress")
    assert rep["completed"] == 16
    assert all(q["output_tokens"] == 6 for q in rep["requests"])
    check_summary(rep)
    # Poisson arrivals at 8/s: 15 gaps sum to less than 0.2 s with
    # probability ~1e-9, whereas "all at once" would start within ms.
    starts = [q["start_s"] for q in rep["requests"]]
    assert max(starts) - min(starts) > 0.2
    assert rep["mode"] == {"request_rate": 8.0}
    # Nobody gets a first token within 1 microsecond.
    assert rep["good_requests"] == 0 and rep["goodput"] == 0.0
    assert rep["goodput"] <= rep["request_throughput"]
    srv.wait_idle()


def test_shared_prefix(serve, test_models, tmp_path):
    srv = start(serve, test_models)
    before = server_counts(srv)
    rep, _ = bench(tmp_path, srv.base_url, "--dataset", "shared-prefix", "--prefix-len", "64",
                   "--num-groups", "2", "--num-prompts", "16", "--input-len", "12",
                   "--output-len", "5", "--concurrency", "4", "--slo", "ttft:100000",
                   "--no-progress")
    after = server_counts(srv)
    assert rep["completed"] == 16 and rep["failed"] == 0
    check_summary(rep)
    for q in rep["requests"]:
        assert q["group"] == q["index"] % 2
        assert q["output_tokens"] == 5
        assert abs(q["prompt_tokens"] - (64 + 12)) <= 8, q
    assert after["gen"] - before["gen"] == 16 * 5
    # 64 shared tokens are 4 full blocks of 16: later requests of a group hit.
    assert after["hits"] - before["hits"] >= 16
    assert rep["goodput"] <= rep["request_throughput"]
    srv.wait_idle()


def test_multi_turn_carries_history(serve, test_models, tmp_path):
    srv = start(serve, test_models)
    rep, _ = bench(tmp_path, srv.base_url, "--dataset", "multi-turn", "--num-groups", "2",
                   "--num-prompts", "6", "--input-len", "8", "--output-len", "4",
                   "--concurrency", "2", "--no-progress")
    assert rep["completed"] == 6
    check_summary(rep)
    recs = rep["requests"]
    for q in recs[2:]:
        prev = recs[q["index"] - 2]
        assert (q["group"], q["turn"]) == (prev["group"], prev["turn"] + 1)
        # The later turn holds the earlier prompt and answer (4 tokens) plus a
        # new question, and starts only after the earlier turn ended.
        assert q["prompt_tokens"] >= prev["prompt_tokens"] + 4 + 4
        assert q["start_s"] >= prev["start_s"] + prev["e2e_ms"] / 1e3
    srv.wait_idle()


def test_file_dataset(serve, test_models, tmp_path):
    srv = start(serve, test_models)
    f = tmp_path / "trace.jsonl"
    lens = [3, 5, 7]
    f.write_text("".join(json.dumps({"prompt": f"Once upon a time {i}", "output_len": n}) + "\n"
                         for i, n in enumerate(lens)))
    rep, _ = bench(tmp_path, srv.base_url, "--dataset", str(f), "--ignore-eos",
                   "--request-rate", "inf", "--no-progress")
    assert rep["completed"] == 3 and rep["num_prompts"] == 3
    assert [q["output_tokens"] for q in rep["requests"]] == lens
    check_summary(rep)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "output_len": 2}\n{"prompt": 5}\n')
    r = run_tandem("bench", "--url", srv.base_url, "--model", NAME, "--dataset", bad,
                   timeout=60, check=False)
    assert r.returncode == 2 and "bad.jsonl:2:" in r.stderr, r.describe()
    srv.wait_idle()


def test_errors_by_kind(serve, test_models, tmp_path):
    # Nothing listens on a port that was free a moment ago.
    port = free_port()
    rep, r = bench(tmp_path, f"http://127.0.0.1:{port}", "--num-prompts", "4",
                   "--input-len", "8", "--output-len", "2", "--concurrency", "2", rc=1)
    assert rep["completed"] == 0 and rep["failed"] == 4
    assert rep["errors"] == {"connection": 4}
    assert all(q["error_kind"] == "connection" and q["error"] for q in rep["requests"])
    assert rep["ttft_ms"]["p50"] is None and rep["request_throughput"] == 0
    assert "Errors: connection 4" in r.stdout

    # A peer that accepts connections (the kernel's backlog) but never
    # answers: every request runs into --timeout.
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        rep, _ = bench(tmp_path, f"http://127.0.0.1:{hole.getsockname()[1]}", "--num-prompts", "2",
                       "--input-len", "4", "--output-len", "2", "--concurrency", "2",
                       "--timeout", "0.5", "--no-progress", rc=1)
    assert rep["errors"] == {"timeout": 2}

    srv = start(serve, test_models, "--api-key", KEY)
    # No API key: every request is refused with 401 and counted as such.
    rep, _ = bench(tmp_path, srv.base_url, "--num-prompts", "3", "--input-len", "8",
                   "--output-len", "2", "--concurrency", "3", "--no-progress", rc=1)
    assert rep["errors"] == {"http_401": 3}
    # With the key, an unknown model is 404.
    rep, _ = bench(tmp_path, srv.base_url, "--num-prompts", "2", "--input-len", "8",
                   "--output-len", "2", "--concurrency", "1", "--no-progress",
                   model="no-such-model", key=KEY, rc=1)
    assert rep["errors"] == {"http_404": 2}
    # A prompt longer than the context (256) is 400: the others still complete.
    f = tmp_path / "mixed.jsonl"
    f.write_text(json.dumps({"prompt": "hello world", "output_len": 2}) + "\n"
                 + json.dumps({"prompt": " hello" * 400, "output_len": 2}) + "\n")
    rep, _ = bench(tmp_path, srv.base_url, "--dataset", str(f), "--concurrency", "1",
                   "--no-progress", key=KEY, rc=0)
    assert rep["completed"] == 1 and rep["errors"] == {"http_400": 1}
    assert "context" in rep["requests"][1]["error"].lower()
    # /internal/v1/state needs the key here; /metrics does not.
    wait_until(lambda: (lambda b: b["used"] == b["reserved"] == b["running"] == 0)(srv.blocks()),
               timeout=10, what="idle KV blocks")
