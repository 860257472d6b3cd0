"""Prefix cache on the default model (SmolLM2-135M-Instruct Q4_1): chat
requests sharing a ~600-token system prompt.

After the first (cold) request, every later one finds the shared blocks:
vllm:prefix_cache_hits_total grows by about the shared length each time,
so a warm request computes under a fifth of the prompt tokens the cold one
computed (a cold request computes ~600+ prompt tokens; a warm one only its
own ~20-token suffix and the last partial block, < 16 tokens), and the
outputs (text, token strings and logprobs, greedy) are exactly those of a
server started with --no-prefix-cache. The time to first token this saves
is a benchmark's to measure (docs/PERFORMANCE.md), not a test's: it goes
with the failure message only.
"""

import random
import statistics
import time

import openai
import pytest

from conftest import scaled
from serve_util import metric, serve  # noqa: F401  (serve: fixture)

SERVED = "smollm2"
BLOCK = 16

WORDS = ("the system keeps every record of shipments orders and invoices for the warehouse "
         "team which works in three shifts and reports each morning to the regional office "
         "about stock levels delayed trucks damaged goods and customer complaints that need "
         "attention before noon while the night crew checks inventory counts against the "
         "database and flags any mismatch larger than five units").split()

QUESTIONS = [
    "What does the night crew check?",
    "When are reports sent to the regional office?",
    "How many shifts does the team work?",
    "What mismatch gets flagged?",
    "What must get attention before noon?",
]
# Compared with the --no-prefix-cache server (each costs a full cold
# prefill there, seconds on a loaded 2-core machine): two warm ones.
COMPARED = (1, 2)


def system_prompt():
    rng = random.Random(2024)
    sentences = []
    for i in range(32):
        n = rng.randrange(9, 14)
        sentences.append(f"Rule {i + 1}: " + " ".join(rng.choice(WORDS) for _ in range(n)) + ".")
    return "You are the warehouse assistant. Follow these rules.\n" + "\n".join(sentences)


def stream_chat(client, system, question, max_tokens=12):
    """Streams one greedy chat completion; returns (ttft_s, text, logprobs
    [(token, logprob)], finish_reason, usage)."""
    t0 = time.perf_counter()
    ttft = None
    text, lps, finish, usage = [], [], None, None
    stream = client.chat.completions.create(
        model=SERVED, messages=[{"role": "system", "content": system},
                                {"role": "user", "content": question}],
        max_tokens=max_tokens, temperature=0, logprobs=True, stream=True,
        stream_options={"include_usage": True})
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            if c.delta and c.delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(c.delta.content)
            if c.logprobs is not None and c.logprobs.content:
                lps += [(x.token, x.logprob) for x in c.logprobs.content]
            if c.finish_reason is not None:
                finish = c.finish_reason
    assert ttft is not None, "no content in the stream"
    return ttft, "".join(text), lps, finish, usage


def client_for(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=scaled(120))


def test_shared_system_prompt(serve, default_model):
    system = system_prompt()
    srv = serve(default_model, "--served-model-name", SERVED)
    client = client_for(srv)
    # Warm-up: an unrelated short prompt (touches the weights once).
    stream_chat(client, "You are terse.", "Say hi.", max_tokens=2)
    srv.wait_idle()

    hits = [metric(srv.metrics(), "vllm:prefix_cache_hits_total")]
    results = []
    for q in QUESTIONS:
        results.append(stream_chat(client, system, q))
        srv.wait_idle()
        hits.append(metric(srv.metrics(), "vllm:prefix_cache_hits_total"))
    prompt_tokens = [r[4].prompt_tokens for r in results]
    assert min(prompt_tokens) >= 550, f"system prompt shorter than intended: {prompt_tokens}"

    # The cold request found nothing of the system prompt (the warm-up
    # shares at most the template's first block); every later one found at
    # least every full block of the shared part (the system prompt is the
    # first message, so it is a common prefix; one block of slack for where
    # the user turn starts).
    shared = min(prompt_tokens) - 40
    assert hits[1] - hits[0] <= BLOCK, f"cold request hit the cache: {hits}"
    for i in range(1, len(QUESTIONS)):
        grew = hits[i + 1] - hits[i]
        assert grew >= (shared // BLOCK - 1) * BLOCK, (
            f"request {i}: prefix_cache_hits_total grew by {grew}, expected about {shared}: {hits}")
        assert grew <= prompt_tokens[i], (grew, prompt_tokens[i])

    # Same outputs without the prefix cache.
    srv_nc = serve(default_model, "--served-model-name", SERVED, "--no-prefix-cache")
    client_nc = client_for(srv_nc)
    stream_chat(client_nc, "You are terse.", "Say hi.", max_tokens=2)
    ref = {i: stream_chat(client_nc, system, QUESTIONS[i]) for i in COMPARED}
    for i, b in ref.items():
        a = results[i]
        assert (a[1], a[3]) == (b[1], b[3]), f"request {i}: {a[1]!r} ({a[3]}) vs no cache {b[1]!r} ({b[3]})"
        assert a[2] == b[2], f"request {i}: logprobs differ with the prefix cache\n{a[2]}\n{b[2]}"
        assert a[4].completion_tokens == b[4].completion_tokens
    assert metric(srv_nc.metrics(), "vllm:prefix_cache_hits_total") == 0
    srv_nc.wait_idle()

    # Less prefill work (see the module docstring): the prompt tokens each
    # request computed, by the server's own count; the client-side TTFT
    # goes with the message only (a test never judges a latency).
    computed = [prompt_tokens[i] - (hits[i + 1] - hits[i]) for i in range(len(QUESTIONS))]
    cold, warm = computed[0], statistics.median(computed[1:])
    ttft = [round(r[0] * 1e3) for r in results]
    assert warm < 0.2 * cold, f"prompt tokens computed {computed} (TTFT ms {ttft})"
