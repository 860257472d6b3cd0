"""tandem-prefill + tandem-decode on loopback (tiny models): outputs through
P+D equal `tandem serve`'s bit for bit (greedy, logprobs, seeded sampling,
single and 16 concurrent requests, prompts over several prefill chunks and
prefix hits on either side), the routing counters, the cluster token on the
internal endpoints, and every block count back at idle afterwards."""

import concurrent.futures as cf
import random

import pytest

from conftest import manifest_model
from serve_util import TOKEN, Pair, Server, metric, wait_until

# The weight types past F32 and Q8_0: one model each (the Q4_K_M mix holds
# Q4_K, Q6_K, Q5_0 and Q8_0).
MODELS = ["llama2-f32-gguf", "qwen2-q8_0-gguf", "llama3-q5_0-gguf", "qwen2-q5_1-gguf",
          "qwen25-q4_k-gguf", "qwen25-q5_k-gguf", "qwen25-q6_k-gguf", "tinyllama-q4_k_m-gguf"]




@pytest.fixture
def pair(tandem_bin, tmp_path):
    made = []

    def start(model, p_args=(), d_args=(), env=None):
        pr = Pair(tandem_bin, tmp_path / f"pair{len(made)}", model, p_args, d_args, env)
        made.append(pr)
        return pr

    yield start
    for pr in reversed(made):
        pr.close()


@pytest.fixture
def colocated(tandem_bin, tmp_path):
    made = []

    def start(model, *args):
        s = Server.start(tandem_bin, model, ["--threads", "1", *args], tmp_path / "serve")
        made.append(s)
        return s

    yield start
    for s in reversed(made):
        s.close()


def complete(srv, body):
    status, out = srv.post_json("/v1/completions", body, timeout=120)
    assert status == 200, (status, out, srv.log_tail())
    return out


def answer(out):
    """What must match: text, tokens with their logprobs, finish reason."""
    ch = out["choices"][0]
    return ch["text"], ch["logprobs"], ch["finish_reason"], out["usage"]["completion_tokens"]


def prompts(n, vocab=512, seed=1):
    rng = random.Random(seed)
    lengths = [3, 15, 16, 17, 40, 100, 150, 33]
    return [[rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


BODIES = [
    {"max_tokens": 12, "temperature": 0, "logprobs": 3},
    {"max_tokens": 10, "temperature": 0.9, "top_k": 40, "seed": 7, "logprobs": 2},
    {"max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "seed": 1234,
     "repetition_penalty": 1.2, "min_tokens": 2},
]


@pytest.mark.parametrize("name", MODELS)
def test_outputs_equal_serve(name, manifest, test_models, pair, colocated):
    """Single requests, sequentially: prompts of one to ten blocks, greedy and
    seeded sampling (the first token is drawn on P, the rest on D with P's
    sampler state), P prefilling in chunks of 32 tokens."""
    model = manifest_model(manifest, test_models, name)
    s = colocated(model)
    pr = pair(model, p_args=["--max-batch-tokens", "32"])
    for i, toks in enumerate(prompts(8)):
        body = dict(BODIES[i % len(BODIES)], prompt=toks)
        assert answer(complete(pr.d, body)) == answer(complete(s, body)), (name, i)
    m = pr.d.metrics()
    assert metric(m, "tandem:remote_prefill_total") == 8
    assert metric(m, "tandem:local_prefill_total") == 0
    assert metric(m, "tandem:kv_transfer_bytes_total") > 0
    pm = pr.p.metrics()
    assert metric(pm, "tandem:kv_transfer_bytes_total") > 0
    assert metric(pm, "tandem:kv_transfer_seconds_count") == 8
    pr.d.wait_idle()
    pr.p.wait_idle()


def test_sixteen_concurrent(manifest, test_models, pair, colocated):
    """16 requests at once through one P+D: P batches the jobs, D decodes
    them together; every answer equals serve's (batch invariance)."""
    model = manifest_model(manifest, test_models, "llama3-f32-gguf")
    s = colocated(model)
    pr = pair(model, d_args=["--max-running", "16"], p_args=["--max-batch-tokens", "256"])
    bodies = [dict(BODIES[i % 2], prompt=toks, max_tokens=16)
              for i, toks in enumerate(prompts(16, seed=5))]
    want = [answer(complete(s, b)) for b in bodies]
    with cf.ThreadPoolExecutor(16) as ex:
        got = list(ex.map(lambda b: answer(complete(pr.d, b)), bodies))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, i
    assert metric(pr.d.metrics(), "tandem:remote_prefill_total") == 16
    pr.d.wait_idle()
    pr.p.wait_idle()


def test_prefix_hits_on_both_sides(manifest, test_models, pair, colocated):
    """A prompt D already holds is only partly prefilled remotely
    (cached_tokens in the usage), and a prefix P holds but D does not (D
    without a prefix cache) is pushed from P's cache, not recomputed."""
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    s = colocated(model)
    toks = prompts(1, seed=9)[0] * 1 + list(range(10, 90))
    body = {"prompt": toks, "max_tokens": 8, "temperature": 0}
    ref = answer(complete(s, body))
    pr = pair(model)
    assert answer(complete(pr.d, body)) == ref
    out = complete(pr.d, dict(body, prompt=toks + [5]))
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert answer(out) == answer(complete(s, dict(body, prompt=toks + [5])))

    pr2 = pair(model, d_args=["--no-prefix-cache"])
    assert answer(complete(pr2.d, body)) == ref
    hits0 = metric(pr2.p.metrics(), "vllm:prefix_cache_hits_total")
    assert answer(complete(pr2.d, body)) == ref
    assert metric(pr2.p.metrics(), "vllm:prefix_cache_hits_total") > hits0
    for x in (pr.d, pr.p, pr2.d, pr2.p):
        x.wait_idle()


def test_local_prefill_threshold(manifest, test_models, pair, colocated):
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    s = colocated(model)
    pr = pair(model, d_args=["--local-prefill-threshold", "50"])
    short, long_ = prompts(1, seed=3)[0][:20], prompts(7, seed=3)[5]
    for toks in (short, long_):
        body = {"prompt": toks, "max_tokens": 6, "temperature": 0}
        assert answer(complete(pr.d, body)) == answer(complete(s, body))
    m = pr.d.metrics()
    assert metric(m, "tandem:local_prefill_total", reason="threshold") == 1
    assert metric(m, "tandem:remote_prefill_total") == 1
    pr.d.wait_idle()


def test_internal_endpoints_need_the_cluster_token(manifest, test_models, pair):
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    pr = pair(model)
    for srv in (pr.p, pr.d):
        for hdr in ({}, {"X-Tandem-Cluster-Token": "wrong"},
                    {"X-Tandem-Cluster-Token": TOKEN + "x"}):
            st, _, _ = srv.request("GET", "/internal/v1/state", headers=hdr)
            assert st == 401, (srv.argv[0], hdr)
    st, _, _ = pr.p.request("GET", "/internal/v1/kv/exchange")
    assert st == 401
    st, hdrs, body = pr.p.request("GET", "/internal/v1/kv/exchange", headers=pr.p.internal_headers)
    assert st == 200 and hdrs["content-type"] == "application/x-protobuf" and len(body) > 64
    # a prefill instance does not serve the public API; a decode instance has
    # no exchange to give
    st, _ = pr.p.post_json("/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
    assert st == 404
    st, _, _ = pr.d.request("GET", "/internal/v1/kv/exchange", headers=pr.d.internal_headers)
    assert st == 404
    for srv in (pr.p, pr.d):
        assert srv.request("GET", "/health")[0] == 200
        assert srv.request("GET", "/ready")[0] == 200


def test_flags_are_checked(tandem_bin, manifest, test_models, tmp_path):
    import subprocess
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    d = tandem_bin.parent / "tandem-decode"
    p = tandem_bin.parent / "tandem-prefill"
    cases = [
        ([d, "--model", model, "--cluster-token", "t"], "--prefill"),
        ([d, "--model", model, "--prefill", "127.0.0.1:1"], "cluster token"),
        ([d, "--model", model, "--prefill", "nocolon", "--cluster-token", "t"], "bad value"),
        ([p, "--model", model, "--cluster-token", "t", "--kv-listen", "10.254.254.254"],
         "no interface"),
        ([p, "--model", model, "--cluster-token-file", tmp_path / "absent"], "cluster token"),
        ([d, "--model", model, "--prefill", "h:1", "--cluster-token", "t", "--dns-interval", "0"],
         "bad value"),
        ([d, "--model", model, "--prefill", "h:1", "--cluster-token", "t",
          "--forget-prefill-after", "soon"], "bad value"),
    ]
    # API key files: absent, empty, too many keys; on every binary that takes them
    empty = tmp_path / "empty-keys"
    empty.write_text("\n  \n")
    many = tmp_path / "many-keys"
    many.write_text("".join(f"key-{i}\n" for i in range(17)))
    r = tandem_bin.parent / "tandem-router"
    for argv in ([tandem_bin, "serve", "--model", model],
                 [d, "--model", model, "--prefill", "h:1", "--cluster-token", "t"],
                 [r, "--model", model, "--decode", "h:1", "--cluster-token", "t"]):
        cases += [(argv + ["--api-key-file", tmp_path / "absent"], "cannot read the API key file"),
                  (argv + ["--api-key-file", empty], "holds no key")]
    cases.append(([tandem_bin, "serve", "--model", model, "--api-key-file", many],
                  "more than 16 keys"))
    for argv, msg in cases:
        r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=30)
        assert r.returncode == 2, (argv, r.stderr)
        assert msg in r.stderr, (argv, r.stderr)


def test_kv_dtype_pairs(tandem_bin, manifest, test_models, pair, colocated, tmp_path):
    """P and D with an f16 KV cache (the default on the CPU) answer as
    `tandem serve` bit for bit and move half the bytes an f32 pair moves for
    the same prompts; a D whose cache holds another dtype than its P's never
    pairs with it (the link is refused, saying why) and prefills locally."""
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    s16 = colocated(model)
    p16 = pair(model)
    f32 = ["--kv-dtype", "f32"]
    p32 = pair(model, p_args=f32, d_args=f32)
    bodies = [dict(BODIES[i % len(BODIES)], prompt=toks) for i, toks in enumerate(prompts(4))]
    for b in bodies:
        assert answer(complete(p16.d, b)) == answer(complete(s16, b))
        complete(p32.d, b)
    for pr in (p16, p32):
        assert metric(pr.d.metrics(), "tandem:remote_prefill_total") == len(bodies)
    moved16 = metric(p16.p.metrics(), "tandem:kv_transfer_bytes_total")
    moved32 = metric(p32.p.metrics(), "tandem:kv_transfer_bytes_total")
    assert moved16 > 0 and moved16 * 2 == moved32, (moved16, moved32)
    assert p16.p.state()["compat"] != p32.p.state()["compat"]

    # D (f32) pointed at P (f16): refused at the link; answers from a local prefill
    d = Server.start(tandem_bin, model,
                     ["--prefill", f"127.0.0.1:{p16.p.port}", "--cluster-token", TOKEN,
                      "--threads", "1", *f32],
                     tmp_path / "mixed", cmd=[tandem_bin.parent / "tandem-decode"],
                     cluster_token=TOKEN)
    try:
        wait_until(lambda: "its KV cache holds f16, ours f32" in d.log_tail(),
                   timeout=20, what="the refused link", proc=d.proc)
        s32 = colocated(model, *f32)
        for b in bodies[:2]:
            assert answer(complete(d, b)) == answer(complete(s32, b))
        m = d.metrics()
        assert metric(m, "tandem:remote_prefill_total") == 0
        assert metric(m, "tandem:local_prefill_total", reason="no_peer") == 2
        d.wait_idle()
    finally:
        d.close()
    for x in (p16.d, p16.p, p32.d, p32.p):
        x.wait_idle()
