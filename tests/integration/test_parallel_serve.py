"""`tandem serve` with a parallel plan: mixed load through
--tp 2 --pp 2 gives the single-rank tokens, /metrics shows per-rank compute
and communication time, and a rank that dies makes the instance fail fast
and visibly instead of hanging."""
import concurrent.futures as cf
import os
import pathlib
import signal
import time

import pytest

from conftest import stale_exec_segments
from serve_util import metric, serve  # noqa: F401  (fixture)

MODELS = pathlib.Path(os.environ.get("TANDEM_TEST_MODELS", ""))
MODEL = MODELS / "gguf/llama2-f32.gguf"


def children(pid):
    out = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        kids = (task / "children").read_text().split()
        out += [int(k) for k in kids]
    return sorted(out)


def completions(srv, n):
    """n concurrent greedy completions with different prompts and lengths."""
    def one(i):
        body = {"model": "m", "prompt": f"request {i}: " + "tandem " * (i % 5 + 1),
                "max_tokens": 8 + i % 9, "temperature": 0}
        st, js = srv.post_json("/v1/completions", body, timeout=120)
        assert st == 200, js
        c = js["choices"][0]
        return c["text"], c["finish_reason"], js["usage"]["completion_tokens"]
    with cf.ThreadPoolExecutor(n) as ex:
        return list(ex.map(one, range(n)))


def test_mixed_load_matches_one_rank(serve):
    one = serve(MODEL, "--max-running", "16", "--max-batch-tokens", "256", "--served-model-name", "m")
    want = completions(one, 16)
    compat = one.state()["compat"]
    one.stop()
    srv = serve(MODEL, "--tp", "2", "--pp", "2", "--max-running", "16", "--served-model-name", "m",
                "--max-batch-tokens", "256")
    got = completions(srv, 16)
    assert got == want
    # the plan is not part of the KV compatibility hash (the transfer maps
    # between plans): same model, same hash
    assert srv.state()["compat"] == compat
    m = srv.metrics()
    assert metric(m, "tandem:plan_steps_total") > 0
    for r in range(4):
        assert metric(m, "tandem:rank_compute_seconds_total", rank=str(r)) > 0, r
        # every rank of a 2x2 plan talks: all-reduces, stage hand-offs, logits
        assert metric(m, "tandem:rank_comm_seconds_total", rank=str(r)) > 0, r
    srv.wait_idle()
    assert srv.stop() == 0
    # the ranks are gone with the instance, and so is the shared memory
    assert not stale_exec_segments()


def test_a_dead_rank_fails_the_instance_fast(serve):
    srv = serve(MODEL, "--pp", "2", "--max-running", "4", "--served-model-name", "m")
    ranks = children(srv.proc.pid)
    assert len(ranks) == 1, ranks
    # The tiny model can finish 200 tokens before the client has read a
    # few events (the server then coalesces them), so freeze the rank once
    # tokens flow and check that the request is still running before the
    # kill; if it had already finished, thaw and try another one.
    for attempt in range(5):
        body = {"model": "m", "prompt": f"a long one {attempt}", "max_tokens": 200,
                "min_tokens": 200, "temperature": 0, "stream": True}
        stream = srv.open_stream("/v1/completions", body, timeout=60)
        assert stream.status == 200
        events = stream.events()
        ev = next(events)  # the request is running: tokens are flowing
        assert isinstance(ev, dict) and "choices" in ev, ev
        os.kill(ranks[0], signal.SIGSTOP)
        if metric(srv.metrics(), "vllm:num_requests_running") == 1:
            break
        os.kill(ranks[0], signal.SIGCONT)
        list(events)
        stream.close()
    else:
        pytest.fail("every 200-token request finished before the rank was frozen")
    t0 = time.monotonic()
    os.kill(ranks[0], signal.SIGKILL)
    rest = list(events)
    # the stream ends with an error, never a normal finish
    finished = [e for e in rest if isinstance(e, dict) and e.get("choices") and
                e["choices"][0].get("finish_reason") in ("stop", "length")]
    errors = [e for e in rest if isinstance(e, dict) and ("error" in e or (
        e.get("choices") and e["choices"][0].get("finish_reason") == "error"))]
    assert not finished, rest
    assert errors, rest
    stream.close()
    rc = srv.proc.wait(timeout=15)
    assert rc != 0
    assert time.monotonic() - t0 < 15
    log = srv.err_path.read_text()
    assert "was killed by signal 9" in log, log[-3000:]
    assert "a rank of the parallel plan failed" in log, log[-3000:]
    assert not stale_exec_segments()


@pytest.mark.parametrize("plan", [["--tp", "2"], ["--pp", "2"]])
def test_moe_expert_load_in_metrics(serve, plan):
    # Qwen2-MoE tiny model: 2 layers, 8 experts, top-2. Under --tp 2 the
    # experts are EP-sharded over the TP group; under --pp 2 each stage
    # counts its layer and concurrent requests make several micro-batches
    # per step. Every computed token is routed to 2 experts in each of the
    # 2 layers, whichever rank routed it.
    srv = serve(MODELS / "gguf/qwen2moe-f32.gguf", *plan, "--served-model-name", "m",
                "--no-prefix-cache", "--max-running", "8")

    def one(i):
        st, js = srv.post_json("/v1/completions", {"model": "m", "prompt": f"moe {i} " * (i + 1),
                                                   "max_tokens": 6, "temperature": 0})
        assert st == 200, js
        u = js["usage"]
        return u["prompt_tokens"] + u["completion_tokens"] - 1  # the last token is not fed back
    with cf.ThreadPoolExecutor(6) as ex:
        fed = sum(ex.map(one, range(6)))
    m = srv.metrics()
    assert metric(m, "vllm:num_preemptions_total") == 0
    per_expert = [metric(m, "tandem:expert_tokens_total", expert=str(e)) for e in range(8)]
    assert sum(per_expert) == fed * 2 * 2, (per_expert, fed)
    imb = metric(m, "tandem:expert_load_imbalance")
    # max / mean of the last routed step: at least 1, at most the expert count
    assert 1.0 <= imb <= 8.0, imb
    assert srv.stop() == 0
