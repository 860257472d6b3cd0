"""P and D with different parallel plans (the pairings below): every rank
of the prefill instance puts its own layers, KV heads and CP blocks into
the decode ranks that hold them (transfer/map.h, transfer/xrank.h). The
outputs match `tandem serve` running D's plan by the parallel-plan
criteria: on these f32 test models the greedy tokens are equal, and the
logprobs of the tokens agree within the TP tolerance (the prefill's KV
comes from a different reduction order, a few ulp apart)."""

import concurrent.futures as cf
import os
import pathlib
import random
import signal
import time

import pytest

from conftest import manifest_model, wait_until
from serve_util import TOKEN, Pair, Server, metric

LOGPROB_TOL = 2e-3
QUARANTINE_S = 30 + 15  # D's default transfer deadline, and slack




def prompts(n, vocab=512, seed=11):
    rng = random.Random(seed)
    lengths = [5, 16, 17, 40, 70, 33, 100, 9]
    return [[rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def run(srv, toks):
    body = {"prompt": toks, "max_tokens": 10, "temperature": 0, "logprobs": 1}
    st, out = srv.post_json("/v1/completions", body, timeout=120)
    assert st == 200, (st, out, srv.log_tail())
    lp = out["choices"][0]["logprobs"]
    return out["choices"][0]["text"], lp["tokens"], lp["token_logprobs"]


def assert_close(got, want, what):
    assert got[1] == want[1], (what, got[1], want[1])  # the greedy tokens
    assert got[0] == want[0], what
    for a, b in zip(got[2], want[2]):
        assert abs(a - b) <= LOGPROB_TOL, (what, got[2], want[2])


# (prefill plan, decode plan): the pairings the transfer map names, plus PP on both sides
# and TP with replicated KV heads (tp 4 over a model of 2 KV heads).
PAIRINGS = [
    (["--tp", "2"], []),
    ([], ["--tp", "2"]),
    (["--pp", "2"], ["--tp", "2"]),
    (["--cp", "2", "--cp-min-tokens", "16"], []),
    ([], ["--cp", "2", "--cp-min-tokens", "16"]),
    (["--tp", "2", "--pp", "2"], ["--pp", "2"]),
]


@pytest.mark.parametrize("p_plan,d_plan", PAIRINGS,
                         ids=["p-tp2", "d-tp2", "p-pp2_d-tp2", "p-cp2", "d-cp2", "p-tp2pp2_d-pp2"])
def test_pairing_matches_serve(p_plan, d_plan, manifest, test_models, tandem_bin, tmp_path):
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    ref = Server.start(tandem_bin, model, ["--threads", "1", *d_plan], tmp_path / "ref")
    try:
        want = [run(ref, t) for t in prompts(8)]
        want2 = [run(ref, t) for t in prompts(8, seed=12)]
    finally:
        ref.close()
    pr = Pair(tandem_bin, tmp_path / "pair", model, ["--max-batch-tokens", "64", *p_plan],
              d_plan)
    try:
        got = [run(pr.d, t) for t in prompts(8)]
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, (p_plan, d_plan, i))
        # concurrent requests batched on P (several jobs in one step; other
        # prompts, so that D's prefix cache holds none of them)
        with cf.ThreadPoolExecutor(8) as ex:
            got = list(ex.map(lambda t: run(pr.d, t), prompts(8, seed=12)))
        for i, (g, w) in enumerate(zip(got, want2)):
            assert_close(g, w, (p_plan, d_plan, "concurrent", i))
        m = pr.d.metrics()
        assert metric(m, "tandem:remote_prefill_total") == 16
        # Every request went to P. Under the sanitizers (a Debug+ASan world
        # of up to 6 ranks on 2 cores) a few of them fell back to a local
        # prefill once (cause under investigation, see the issue note);
        # the answers are right either way, and most transfers complete.
        done = metric(m, "tandem:kv_transfer_seconds_count")
        fell_back = metric(m, "tandem:local_prefill_total")
        assert done + fell_back == 16 and done >= 8, (done, fell_back,
                                                      pr.d.log_tail(3000), pr.p.log_tail(3000))
        # a transfer that fell back after a fence keeps its blocks
        # quarantined until its deadline (D's default, 30 s) has passed
        pr.d.wait_idle(timeout=QUARANTINE_S)
        pr.p.wait_idle(timeout=QUARANTINE_S)
    finally:
        pr.close()


def test_replicated_kv_heads(manifest, test_models, tandem_bin, tmp_path):
    """P with TP 4 over a model of fewer KV heads (each head on two ranks:
    D reads each from one replica) into D with TP 2, and back."""
    cands = [m for m in manifest if m["config"]["n_head_kv"] < 4 and m["wtype"] == "F32"
             and m["format"] == "gguf" and m["config"]["n_head"] % 4 == 0]
    if not cands:
        pytest.skip("no f32 test model with fewer than 4 KV heads")
    model = test_models / cands[0]["path"]
    for p_plan, d_plan in ((["--tp", "4"], ["--tp", "2"]), (["--tp", "2"], ["--tp", "4"])):
        ref = Server.start(tandem_bin, model, ["--threads", "1", *d_plan], tmp_path / "ref")
        try:
            want = [run(ref, t) for t in prompts(4, seed=3)]
        finally:
            ref.close()
        pr = Pair(tandem_bin, tmp_path / "pair", model, p_plan, d_plan)
        try:
            for i, t in enumerate(prompts(4, seed=3)):
                assert_close(run(pr.d, t), want[i], (p_plan, d_plan, i))
            pr.d.wait_idle(timeout=QUARANTINE_S)
            pr.p.wait_idle(timeout=QUARANTINE_S)
        finally:
            pr.close()


def fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def rank_pids(pid):
    """The rank processes D forked: every process whose parent is D. (Read
    from each process's stat, not from /proc/PID/task/TID/children: a
    thread of D can exit between listing its tasks and reading one.)"""
    out = []
    for ent in pathlib.Path("/proc").iterdir():
        if not ent.name.isdigit():
            continue
        try:
            stat = (ent / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        # the command name is in parentheses and may hold spaces
        if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
            out.append(int(ent.name))
    return sorted(out)


def test_fence_reaches_every_decode_rank(manifest, test_models, tandem_bin, tmp_path):
    """D with TP 2 over TCP: a stopped P misses D's deadline, D fences it
    (each of its ranks destroys the link worker that P put into: D rank 1
    holds fewer descriptors until the relink opens a new one, and no more
    than before afterwards), the request is answered by a local prefill,
    and once P resumes D relinks and prefills remotely again."""
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    d_plan = ["--tp", "2"]
    ref = Server.start(tandem_bin, model, ["--threads", "1", *d_plan], tmp_path / "ref")
    try:
        want = [run(ref, t) for t in prompts(3, seed=21)]
    finally:
        ref.close()
    env = {"UCX_TLS": "tcp"}
    pr = Pair(tandem_bin, tmp_path / "pair", model, [], [*d_plan, "--transfer-deadline-ms", "1500"],
              env=env)
    try:
        ranks = rank_pids(pr.d.proc.pid)
        assert len(ranks) == 1, ranks  # rank 1 (rank 0 is the instance's process)
        pr.wait_linked()
        t = prompts(3, seed=21)
        assert_close(run(pr.d, t[0]), want[0], "before")
        assert metric(pr.d.metrics(), "tandem:kv_transfer_seconds_count") == 1
        pr.d.wait_idle()
        n_fds = fds(ranks[0])
        os.killpg(pr.p.proc.pid, signal.SIGSTOP)
        try:
            assert_close(run(pr.d, t[1]), want[1], "fallback")  # after the deadline
            m = pr.d.metrics()
            assert metric(m, "tandem:local_prefill_total", reason="fallback") == 1
            # the fence completes on D's link thread once every rank has
            # destroyed its link worker: it may end after the local answer
            wait_until(lambda: "fenced" in pr.d.log_tail(20000), timeout=15,
                       what="D to finish fencing P", proc=pr.d.proc)
            pr.d.wait_idle(timeout=15)  # the quarantine ended (P's deadline + 1 s)
            # rank 1 destroyed its link worker for P (P is still stopped, so
            # no relink has opened another): its sockets and fds are gone
            assert fds(ranks[0]) < n_fds, (fds(ranks[0]), n_fds)
        finally:
            os.killpg(pr.p.proc.pid, signal.SIGCONT)
        pr.wait_linked(timeout=30)
        assert_close(run(pr.d, t[2]), want[2], "after")
        assert metric(pr.d.metrics(), "tandem:kv_transfer_seconds_count") == 2
        pr.d.wait_idle()
        pr.p.wait_idle(timeout=15)
        # one link worker per rank again, the fenced one gone (a leak would
        # keep its sockets, event fds and shared-memory descriptors)
        assert fds(ranks[0]) <= n_fds, (fds(ranks[0]), n_fds)
    finally:
        pr.close()


def test_a_stalled_decode_instance_holds_up_no_other(manifest, test_models, tandem_bin,
                                                     tmp_path):
    """One P, two D over TCP. D1 (TP 2) has its rank 1 stopped (SIGSTOP)
    while a request's KV is on its way there: P's flush to that rank cannot
    complete. D2's request meanwhile is prefilled on P and answered at once,
    not after the stalled job's deadline (P's step used to wait for that
    flush until then, holding up every other job). D1's rank resumed, its
    request is answered and every count returns to idle."""
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    t = prompts(3, seed=31)
    want = {}
    for plan in ((), ("--tp", "2")):
        ref = Server.start(tandem_bin, model, ["--threads", "1", *plan], tmp_path / f"ref{len(plan)}")
        try:
            want[plan] = [run(ref, p) for p in t]
        finally:
            ref.close()
    env = {"UCX_TLS": "tcp"}
    d1_plan = ("--tp", "2")
    pr = Pair(tandem_bin, tmp_path / "pair", model, [],
              [*d1_plan, "--transfer-deadline-ms", "20000"], env=env)
    d2 = None
    try:
        d2 = Server.start(tandem_bin, model,
                          ["--prefill", f"127.0.0.1:{pr.p.port}", "--cluster-token", TOKEN,
                           "--threads", "1"],
                          tmp_path / "d2", env=env, cmd=[tandem_bin.parent / "tandem-decode"],
                          cluster_token=TOKEN)
        deadline = time.monotonic() + 20
        while not d2.state()["transfer"]["peers"][0]["ready"]:
            assert time.monotonic() < deadline, d2.log_tail()
            time.sleep(0.05)
        assert_close(run(pr.d, t[0]), want[d1_plan][0], "d1 first")
        assert_close(run(d2, t[0]), want[()][0], "d2 first")
        assert metric(d2.metrics(), "tandem:kv_transfer_seconds_count") == 1
        rank1 = rank_pids(pr.d.proc.pid)[0]
        os.kill(rank1, signal.SIGSTOP)
        with cf.ThreadPoolExecutor(1) as ex:
            try:
                f1 = ex.submit(run, pr.d, t[1])
                # P has the job, and its flush to D1's rank 1 cannot complete
                deadline = time.monotonic() + 15
                while pr.p.state()["transfer"]["in_flight"] < 1:
                    assert time.monotonic() < deadline, pr.p.log_tail()
                    time.sleep(0.05)
                # (half a second more for P to reach the stalled flush: without
                # it the test still holds, it just proves less)
                time.sleep(0.5)
                assert_close(run(d2, t[2]), want[()][2], "d2 while d1 stalls")
                assert metric(d2.metrics(), "tandem:kv_transfer_seconds_count") == 2
                # D2 was served while the stalled job still held P's transfer
                # (not after its 20 s deadline): the proof is the order, not
                # how long D2's request took
                assert pr.p.state()["transfer"]["in_flight"] >= 1, pr.p.log_tail()
            finally:
                os.kill(rank1, signal.SIGCONT)
            assert_close(f1.result(timeout=120), want[d1_plan][1], "d1 after the stall")
        for srv in (pr.d, d2, pr.p):
            srv.wait_idle(timeout=QUARANTINE_S)
    finally:
        if d2:
            d2.close()
        pr.close()
