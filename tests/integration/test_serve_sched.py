"""`tandem serve` scheduling on a tiny random model (greedy): continuous
batching, chunked prefill, KV exhaustion (preemption), waiting, a prompt
that can never fit, client disconnects, the KV event log of
/internal/v1/state, and min_tokens.

The reference for every output is the same request run alone on a server
with --max-running 1 and --no-prefix-cache (nothing batched, nothing
reused). Prompts are token-id lists, so the tokenizer plays no part in
what the model sees. A run is compared on its text, its per-token strings
and logprobs (logprobs=1), its finish reason and its completion token
count: the engine's contract is bit-identical results whatever the
batching, chunking, prefix hits or recompute (DESIGN.md §10), so the
logprob floats must be exactly equal, and two different token sequences
would have to agree on every token string and every logprob bit to pass.
"""

import concurrent.futures as cf
import ctypes
import ctypes.util
import functools
import random
import threading
import time

import openai
import pytest

from conftest import scaled
from serve_util import Server, metric, serve, state_load  # noqa: F401  (serve: fixture)

MODEL = "llama3-q8_0-gguf"  # GQA, 2 layers, n_ctx 256, vocab 512
SERVED = "tiny"
CTX = 256
BLOCK = 16
EOG_IDS = (0, 2)  # <|endoftext|>, <|im_end|> (tests/models/make_models.py)


def model_path(test_models, manifest):
    for e in manifest:
        if e["name"] == MODEL:
            return test_models / e["path"]
    pytest.fail(f"{MODEL} not in the test models manifest")


def rand_prompt(rng, n):
    return [rng.randrange(3, 512) for _ in range(n)]  # no special tokens


# ---------------------------------------------------------------------------
# Request specs. Each: prompt ids, max_tokens, ignore_eos, stream.


def burst_specs():
    rng = random.Random(1234)
    specs = []
    # Lengths around block boundaries and the chunk budget, plus random ones.
    lengths = [1, 2, 7, 13, 15, 16, 17, 31, 32, 33, 48, 64, 100, 150, 170]
    while len(lengths) < 28:
        lengths.append(rng.randrange(1, 180))
    for i, n in enumerate(lengths):
        mt = rng.choice([1, 2, 5, 17, 40, 64])
        mt = min(mt, CTX - n)
        specs.append(dict(prompt=rand_prompt(rng, n), max_tokens=mt, ignore_eos=(i % 3 != 0),
                          stream=(i % 4 == 1)))
    # Four requests sharing a 40-token prefix (arriving together they may or
    # may not find one another's blocks; either way the output is the same).
    shared = rand_prompt(rng, 40)
    for i in range(4):
        specs.append(dict(prompt=shared + rand_prompt(rng, 3 + 5 * i), max_tokens=24,
                          ignore_eos=True, stream=(i % 2 == 0)))
    assert len(specs) == 32
    return specs


def exhaustion_specs():
    """Six sequences of 20-30 prompt tokens growing to <= 120 tokens (8
    blocks) each: with 12 blocks only one or two fit at full length, while
    admission (prompt + 1 reserved output token) lets six in at once."""
    rng = random.Random(77)
    return [dict(prompt=rand_prompt(rng, rng.randrange(20, 31)), max_tokens=90, ignore_eos=True,
                 stream=(i % 2 == 0)) for i in range(6)]


def waiting_specs():
    rng = random.Random(99)
    return [dict(prompt=rand_prompt(rng, rng.randrange(5, 40)), max_tokens=120, ignore_eos=True,
                 stream=False) for i in range(10)]


def key(spec):
    return (tuple(spec["prompt"]), spec["max_tokens"], spec["ignore_eos"])


# ---------------------------------------------------------------------------
# Running requests


def client_for(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=scaled(120))


def run_openai(client, spec):
    """One completion through the openai client; returns the comparable
    outcome (text, tokens, token_logprobs, finish_reason, completion_tokens)."""
    kw = dict(model=SERVED, prompt=spec["prompt"], max_tokens=spec["max_tokens"], temperature=0,
              logprobs=1, extra_body={"ignore_eos": spec["ignore_eos"]})
    if not spec.get("stream"):
        r = client.completions.create(**kw)
        c = r.choices[0]
        return (c.text, tuple(c.logprobs.tokens), tuple(c.logprobs.token_logprobs),
                c.finish_reason, r.usage.completion_tokens)
    text, toks, lps, finish, usage = [], [], [], None, None
    for ch in client.completions.create(stream=True, stream_options={"include_usage": True},
                                        **kw):
        if ch.usage is not None:
            usage = ch.usage.completion_tokens
        for c in ch.choices:
            text.append(c.text or "")
            if c.logprobs is not None:
                toks += c.logprobs.tokens or []
                lps += c.logprobs.token_logprobs or []
            if c.finish_reason is not None:
                finish = c.finish_reason
    return ("".join(text), tuple(toks), tuple(lps), finish, usage)


def run_concurrently(srv, specs, workers=None):
    client = client_for(srv)
    with cf.ThreadPoolExecutor(max_workers=workers or len(specs)) as ex:
        futs = [ex.submit(run_openai, client, s) for s in specs]
        return [f.result(timeout=scaled(300)) for f in futs]


def assert_same(specs, got, refs, what):
    bad = []
    for i, (s, g) in enumerate(zip(specs, got)):
        want = refs[key(s)]
        if g != want:
            diff = [name for name, a, b in zip(("text", "tokens", "logprobs", "finish", "n_tokens"),
                                               g, want) if a != b]
            bad.append(f"request {i} (prompt {len(s['prompt'])} tokens, max_tokens "
                       f"{s['max_tokens']}, ignore_eos {s['ignore_eos']}, stream {s['stream']}): "
                       f"{', '.join(diff)} differ; got finish {g[3]!r} n {g[4]} text {g[0][:60]!r}, "
                       f"alone finish {want[3]!r} n {want[4]} text {want[0][:60]!r}")
    if bad:
        pytest.fail(f"{what}: {len(bad)} of {len(specs)} outputs differ from the solo run:\n"
                    + "\n".join(bad))


@pytest.fixture(scope="module")
def tiny(test_models, manifest):
    return model_path(test_models, manifest)


@pytest.fixture(scope="module")
def solo_refs(tandem_bin, tiny, tmp_path_factory):
    """Every spec of this module run alone, one after another, on a server
    that neither batches nor reuses prefixes."""
    srv = Server.start(tandem_bin, tiny, ["--served-model-name", SERVED, "--max-running", 1,
                                          "--no-prefix-cache"], tmp_path_factory.mktemp("solo"))
    try:
        client = client_for(srv)
        refs = {}
        for s in burst_specs() + exhaustion_specs() + waiting_specs():
            out = run_openai(client, dict(s, stream=False))
            assert out[4] >= 1 and out[3] in ("stop", "length"), out
            if s["ignore_eos"]:
                assert out[3] == "length" and out[4] == s["max_tokens"], out
            refs[key(s)] = out
        srv.wait_idle()
        assert srv.stop() == 0, srv.log_tail()
    finally:
        srv.close()
    return refs


# ---------------------------------------------------------------------------
# Tests


def test_batching_equals_solo(serve, tiny, solo_refs):
    """32 concurrent requests (mixed lengths, max_tokens, streaming or not,
    four sharing a prefix) return exactly what each returns alone. The
    server is held (SIGSTOP) until all 32 are sent, so that they arrive
    together and batching must happen: sent by 32 client threads on a
    loaded machine, each could have run alone."""
    srv = serve(tiny, "--served-model-name", SERVED, "--max-running", 32)
    specs = burst_specs()
    with cf.ThreadPoolExecutor(1) as ex:
        with srv.held(len(specs)):
            fut = ex.submit(run_concurrently, srv, specs)
        got = fut.result()
    assert_same(specs, got, solo_refs, "32 concurrent requests")
    m = srv.metrics()
    # Batching did happen: fewer forward steps than tokens generated.
    steps = metric(m, "vllm:iteration_tokens_total_count")
    gen = metric(m, "vllm:generation_tokens_total")
    assert gen == sum(g[4] for g in got)
    assert steps < gen, f"{steps} forward steps for {gen} generated tokens: nothing was batched"
    srv.wait_idle()


def test_chunked_prefill_equals_solo(serve, tiny, solo_refs):
    """A 13-token step budget (prompts up to 170 tokens are cut into many
    chunks whose edges mostly fall inside blocks) changes nothing."""
    srv = serve(tiny, "--served-model-name", SERVED, "--max-running", 8, "--max-batch-tokens", 13)
    specs = burst_specs()
    got = run_concurrently(srv, specs)
    assert_same(specs, got, solo_refs, "--max-batch-tokens 13")
    m = srv.metrics()
    # No forward step exceeded the budget: every step of the
    # vllm:iteration_tokens_total histogram is in the smallest bucket whose
    # edge is >= 13 (and that edge must be <= 16 for this to mean much).
    buckets = {float(dict(ls)["le"]): v for (n, ls), v in m.items()
               if n == "vllm:iteration_tokens_total_bucket"}
    total = metric(m, "vllm:iteration_tokens_total_count")
    edge = min(le for le in buckets if le >= 13)
    assert edge <= 16, f"no bucket edge in [13, 16]: {sorted(buckets)}"
    assert buckets[edge] == total, f"steps over 13 tokens: {total - buckets[edge]} of {total}"
    srv.wait_idle()


def test_kv_exhaustion_preempts_and_recovers(serve, tiny, solo_refs):
    """12 KV blocks, 1 reserved output token: six sequences that each grow
    to 8 blocks are admitted together and must preempt one another; all
    finish with the solo outputs and nothing stays used or reserved. The
    server is held (SIGSTOP) until all six are sent, so that they arrive
    together: sent by six client threads on a loaded machine, the first
    could finish before the last arrived, and nothing would preempt."""
    srv = serve(tiny, "--served-model-name", SERVED, "--kv-blocks", 12,
                "--reserve-output-tokens", 1, "--max-running", 8)
    specs = exhaustion_specs()
    with cf.ThreadPoolExecutor(1) as ex:
        with srv.held(len(specs)):
            fut = ex.submit(run_concurrently, srv, specs)
        got = fut.result()
    assert_same(specs, got, solo_refs, "KV exhaustion")
    m = srv.metrics()
    assert metric(m, "vllm:num_preemptions_total") > 0, "no preemption with 12 blocks"
    assert metric(m, "tandem:kv_blocks", state="total") == 12
    srv.wait_idle()
    ld = state_load(srv.state())
    assert ld["kv_used"] == 0 and ld["kv_reserved"] == 0, ld


def test_waiting_requests_all_finish(serve, tiny, solo_refs):
    """10 requests, --max-running 2: eight wait, none is lost or changed.
    The server is stopped (SIGSTOP) until all ten have been sent, so that
    they arrive together: one takes about 20 ms here, and sent by ten
    client threads on a loaded machine they did not always overlap."""
    srv = serve(tiny, "--served-model-name", SERVED, "--max-running", 2)
    specs = waiting_specs()
    seen = {"running": 0, "waiting": 0}
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            b = srv.blocks()
            seen["running"] = max(seen["running"], b["running"])
            seen["waiting"] = max(seen["waiting"], b["waiting"])
            time.sleep(0.005)

    t = threading.Thread(target=poll)
    try:
        with cf.ThreadPoolExecutor(1) as ex:
            # the poller's first sample waits for the server too
            with srv.held(len(specs), before_resume=t.start):
                fut = ex.submit(run_concurrently, srv, specs)
            got = fut.result()
    finally:
        stop.set()
        if t.is_alive():
            t.join()
    assert_same(specs, got, solo_refs, "--max-running 2")
    assert seen["running"] <= 2, seen
    assert seen["waiting"] >= 1, f"no request was ever seen waiting: {seen}"
    srv.wait_idle()


def test_prompt_that_never_fits(serve, tiny):
    """4 blocks of 16 tokens: a 100-token prompt (well inside the 256
    context) can never be admitted: a clear 400, and the server goes on."""
    srv = serve(tiny, "--served-model-name", SERVED, "--kv-blocks", 4)
    rng = random.Random(5)
    status, body = srv.post_json("/v1/completions", {
        "model": SERVED, "prompt": rand_prompt(rng, 100), "max_tokens": 4, "temperature": 0})
    assert status == 400, (status, body)
    err = body["error"]
    assert err["code"] == "context_length_exceeded", body
    assert err["message"], body
    # Streaming: refused before the headers, with the same error object.
    st = srv.open_stream("/v1/completions", {"model": SERVED, "prompt": rand_prompt(rng, 100),
                                             "max_tokens": 4, "stream": True})
    assert st.status == 400
    ev = next(st.events())
    st.close()
    assert ev["error"]["code"] == "context_length_exceeded", ev
    # A request that fits still works.
    status, body = srv.post_json("/v1/completions", {
        "model": SERVED, "prompt": rand_prompt(rng, 20), "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 8
    srv.wait_idle()


def test_output_that_outgrows_the_pool(serve, tiny):
    """4 blocks (64 tokens): a 50-token prompt fits, but 30 more tokens do
    not fit even alone. The request must end (refused up front, or cut
    with finish_reason "length" when the pool is full), not wait forever,
    and must not block the requests queued behind it."""
    srv = serve(tiny, "--served-model-name", SERVED, "--kv-blocks", 4)
    rng = random.Random(6)
    big = {"model": SERVED, "prompt": rand_prompt(rng, 50), "max_tokens": 30, "temperature": 0,
           "ignore_eos": True}
    small = {"model": SERVED, "prompt": rand_prompt(rng, 5), "max_tokens": 4, "temperature": 0,
             "ignore_eos": True}
    with cf.ThreadPoolExecutor(max_workers=2) as ex:
        fb = ex.submit(srv.post_json, "/v1/completions", big, None, 60)
        time.sleep(0.05)  # queue order only; correctness does not depend on it
        fs = ex.submit(srv.post_json, "/v1/completions", small, None, 60)
        try:
            status, body = fb.result(timeout=scaled(30))
        except cf.TimeoutError:
            pytest.fail(f"a request whose output outgrows the pool never ended; blocks "
                        f"{srv.blocks()}")
        s_status, s_body = fs.result(timeout=scaled(30))
    if status == 200:
        c = body["choices"][0]
        assert c["finish_reason"] == "length", body
        assert 1 <= body["usage"]["completion_tokens"] <= 30, body
    else:
        assert status == 400 and body["error"]["message"], (status, body)
    assert s_status == 200 and s_body["usage"]["completion_tokens"] == 4, s_body
    srv.wait_idle()


def test_client_disconnect_mid_stream(serve, tiny):
    """Four streams dropped after their first tokens: they are cancelled,
    nothing keeps running, every block is released. The streams are long
    (4,000 tokens, a context of 4,096): with 240 all four had finished
    before a loaded machine ran this thread again to drop them."""
    n_tokens = 4000
    srv = serve(tiny, "--served-model-name", SERVED, "--max-running", 4, "--ctx", 4096)
    rng = random.Random(8)
    before = srv.metrics()
    streams = []
    try:
        for _ in range(4):
            st = srv.open_stream("/v1/completions", {
                "model": SERVED, "prompt": rand_prompt(rng, 10), "max_tokens": n_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True})
            assert st.status == 200
            streams.append(st)
        for st in streams:
            ev = next(st.events())
            assert isinstance(ev, dict) and ev["choices"][0]["finish_reason"] is None, ev
    finally:
        for st in streams:
            st.abort()
    t0 = time.monotonic()
    srv.wait_idle(timeout=5)
    idle_after = time.monotonic() - t0
    m = srv.metrics()
    aborted = (metric(m, "vllm:request_success_total", finished_reason="abort")
               - metric(before, "vllm:request_success_total", finished_reason="abort"))
    lengths = (metric(m, "vllm:request_success_total", finished_reason="length")
               - metric(before, "vllm:request_success_total", finished_reason="length"))
    assert aborted + lengths == 4, (aborted, lengths)
    assert aborted >= 1, (f"all four {n_tokens}-token streams finished before their clients left "
                          f"(idle {idle_after:.2f} s later): the test did not exercise a cancel")
    # And the server still serves.
    status, body = srv.post_json("/v1/completions", {
        "model": SERVED, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0,
        "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    srv.wait_idle()


# -- /internal/v1/state and the block hash chain -----------------------------

@functools.lru_cache(maxsize=None)
def _xxh3_128():
    name = ctypes.util.find_library("xxhash")
    if not name:
        pytest.fail("libxxhash not found (ctypes)")
    lib = ctypes.CDLL(name)

    class H128(ctypes.Structure):
        _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]

    f = lib.XXH3_128bits
    f.restype = H128
    f.argtypes = [ctypes.c_char_p, ctypes.c_size_t]

    def h(data):
        r = f(data, len(data))
        return r.low64, r.high64
    return h


def block_hash(parent, tokens):
    """hash.h: XXH3_128(parent (lo, hi as little-endian u64) || token ids as
    little-endian u32), as 32 hex digits printed hi then lo."""
    data = parent[0].to_bytes(8, "little") + parent[1].to_bytes(8, "little")
    data += b"".join(t.to_bytes(4, "little") for t in tokens)
    lo, hi = _xxh3_128()(data)
    return f"{hi:016x}{lo:016x}"


def parse_hex(s):
    assert isinstance(s, str) and len(s) == 32 and s == s.lower(), s
    v = int(s, 16)
    return v & (2**64 - 1), v >> 64


def test_state_events(serve, tiny):
    """since=0 on a fresh server, then a request: since=last is a diff of
    "stored" events, one per full prompt block, each hash chained from the
    previous one exactly as hash.h says (recomputed here with libxxhash); a
    `since` from the future is a full snapshot holding them; the same
    prompt again is served from the cache."""
    srv = serve(tiny, "--served-model-name", SERVED)
    st0 = srv.state(since=0)
    assert st0["full"] is False and st0["events"] == [] and st0["last_seq"] == 0, st0
    assert isinstance(st0["epoch"], str) and len(st0["epoch"]) == 16, st0
    assert isinstance(st0.get("instance_id"), str) and st0["instance_id"], st0
    ld = state_load(st0)
    assert ld["kv_block_size"] == BLOCK and ld["kv_used"] == 0, ld
    assert ld["kv_free"] == ld["kv_empty"] + ld["kv_cached"] - ld["kv_reserved"], ld

    rng = random.Random(21)
    prompt = rand_prompt(rng, 56)  # three full blocks + 8 tokens
    status, body = srv.post_json("/v1/completions", {
        "model": SERVED, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert status == 200, body
    srv.wait_idle()
    st1 = srv.state(since=0)
    assert st1["full"] is False, st1
    assert st1["epoch"] == st0["epoch"]
    evs = st1["events"]
    # 56 prompt tokens computed, the one output token never fed back: 3 full blocks.
    assert [(e["seq"], e["type"]) for e in evs] == [(1, "stored"), (2, "stored"), (3, "stored")], evs
    assert st1["last_seq"] == 3
    hs = [e["hash"] for e in evs]
    # Block 0 chains from the published compatibility hash.
    assert hs[0] == block_hash(parse_hex(st1["compat"]), prompt[:BLOCK]), (st1["compat"], hs)
    for b in (1, 2):
        assert hs[b] == block_hash(parse_hex(hs[b - 1]), prompt[b * BLOCK:(b + 1) * BLOCK]), (
            f"block {b}'s hash is not XXH3_128(parent || tokens) of block {b - 1}'s: {hs}")
    # Up to date: an empty diff.
    st2 = srv.state(since=3)
    assert st2["full"] is False and st2["events"] == [] and st2["last_seq"] == 3, st2
    # From the future (a reader that knew another epoch): a full snapshot.
    st3 = srv.state(since=1000)
    assert st3["full"] is True and st3["last_seq"] == 3, st3
    assert sorted(st3["hashes"]) == sorted(hs), st3
    # Not a number: 400.
    status, _, _ = srv.request("GET", "/internal/v1/state?since=abc")
    assert status == 400
    # The same prompt again is served from the cache (three blocks, 48 tokens).
    hits0 = metric(srv.metrics(), "vllm:prefix_cache_hits_total")
    status, body = srv.post_json("/v1/completions", {
        "model": SERVED, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert status == 200
    assert metric(srv.metrics(), "vllm:prefix_cache_hits_total") - hits0 == 48
    srv.wait_idle()
    assert srv.state(since=3)["events"] == [], "a cache hit stored its blocks again"


# -- min_tokens --------------------------------------------------------------

def test_min_tokens(serve, tiny):
    """With EOS pushed to the top (logit_bias +100), a request stops at its
    first token; min_tokens=N holds every end-of-generation token back for N
    tokens (vLLM's rule: they cannot be sampled), so it stops with EOS as
    token N+1 and its text is what greedy gives with the EOG tokens banned;
    ignore_eos + min_tokens runs to max_tokens."""
    srv = serve(tiny, "--served-model-name", SERVED)
    rng = random.Random(31)
    prompt = rand_prompt(rng, 12)
    N = 9

    def req(**kw):
        body = {"model": SERVED, "prompt": prompt, "temperature": 0}
        body.update(kw)
        status, r = srv.post_json("/v1/completions", body)
        assert status == 200, r
        return r["choices"][0], r["usage"]["completion_tokens"]

    c, n = req(max_tokens=30, logit_bias={"2": 100})
    assert (c["finish_reason"], n) == ("stop", 1), (c, n)
    c, n = req(max_tokens=30, logit_bias={"2": 100}, min_tokens=N)
    assert (c["finish_reason"], n) == ("stop", N + 1), (c, n)
    ref, rn = req(max_tokens=N, logit_bias={str(t): -100 for t in EOG_IDS})
    assert rn == N
    assert c["text"] == ref["text"], (c["text"], ref["text"])
    c, n = req(max_tokens=20, logit_bias={"2": 100}, min_tokens=N, ignore_eos=True)
    assert (c["finish_reason"], n) == ("length", 20), (c, n)
    # Stop strings are not matched before min_tokens either: a stop string
    # equal to the first token's text ends at once without min_tokens, not with it.
    first, _ = req(max_tokens=1, ignore_eos=True)
    if first["text"]:
        c, n = req(max_tokens=12, ignore_eos=True, stop=[first["text"]])
        assert c["finish_reason"] == "stop" and c["text"] == "", (c, n)
        c, n = req(max_tokens=12, ignore_eos=True, stop=[first["text"]], min_tokens=4)
        assert n >= 4, (c, n)
    srv.wait_idle()
