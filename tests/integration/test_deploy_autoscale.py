"""The autoscalers' queries of deploy/k8s/overlays/autoscale, evaluated on
the real processes' /metrics under load (KEDA scales decode on
vllm:num_requests_waiting and prefill on tandem:prefill_queue_tokens).

A router, one prefill and one decode instance (the tiny test model) stand
for the three Services; each sample of their /metrics is labelled as the
ServiceMonitor's targets are (namespace, service) and every ScaledObject's
query is evaluated on it. A burst that exhausts the decode instance's KV
must ask for more decode pods (the router holds the requests back, the
decode instance's own queue stays empty: the query must read both), a
burst of prompts that outruns the prefill instance must show queued prompt
tokens, and once the bursts are served both queries read 0."""

import math
import threading

import pytest

import k8s_util
import promql_sum
from conftest import manifest_model
from serve_util import Cluster, parse_metrics

OVERLAY = "deploy/k8s/overlays/autoscale"
SERVICE_OF = {"router": "tandem-router", "prefill": "tandem-prefill", "decode": "tandem-decode"}


@pytest.fixture(scope="module")
def scaled_objects(source_dir):
    objs = k8s_util.render(source_dir / OVERLAY)
    sos = {o["spec"]["scaleTargetRef"]["name"]: o for o in objs if o["kind"] == "ScaledObject"}
    assert set(sos) == {"tandem-decode", "tandem-prefill"}
    return sos


def trigger(so):
    (t,) = so["spec"]["triggers"]
    md = t["metadata"]
    return md["query"], float(md["threshold"]), so["metadata"].get("namespace", "")


def sample(procs, namespace):
    """Every process's /metrics as (metric, labels, value) with the labels
    Prometheus adds to a ServiceMonitor target."""
    series = []
    for role, srv in procs:
        _, _, body = srv.request("GET", "/metrics")
        for (name, labels), v in parse_metrics(body.decode()).items():
            series.append((name, dict(labels, namespace=namespace, service=SERVICE_OF[role]), v))
    return series


def desired(value, threshold):
    """KEDA's prometheus scaler (AverageValue): the replicas the HPA asks for."""
    return math.ceil(value / threshold)


def test_queries_follow_the_load(scaled_objects, manifest, test_models, tandem_bin, tmp_path):
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    # D: two long requests' KV at a time (40 blocks of 16 tokens); P: small
    # prefill chunks, so a burst of prompts queues there.
    c = Cluster(tandem_bin, tmp_path, model, n_prefill=1, n_decode=1,
                p_args=["--max-batch-tokens", 16, "--max-running", 16],
                d_args=["--kv-blocks", 40, "--max-running", 16],
                r_args=["--local-prefill-threshold", 0, "--local-prefill-max-tokens", 0])
    try:
        procs = [("router", c.router), ("prefill", c.ps[0]), ("decode", c.ds[0])]
        dq, dthr, ns = trigger(scaled_objects["tandem-decode"])
        pq, pthr, _ = trigger(scaled_objects["tandem-prefill"])
        _, matchers = promql_sum.parse(dq)

        def burst(n, prompt, max_tokens, prefill_only=False):
            errors = []

            def go(i):
                st, body = c.router.post_json(
                    "/v1/completions", {"prompt": f"{i} {prompt}", "max_tokens": max_tokens,
                                        "ignore_eos": True, "temperature": 0}, timeout=300)
                if st != 200:
                    errors.append((st, body))

            ts = [threading.Thread(target=go, args=(i,)) for i in range(n)]
            if prefill_only:
                # The router is held until all n are in its sockets, so the
                # prompts reach P together: a prompt's prefill takes ms, and
                # sent by n threads on a loaded machine they came one after
                # another and never queued (peak 0 in all three bursts).
                with c.router.held(n):
                    for t in ts:
                        t.start()
            else:
                for t in ts:
                    t.start()
            peak = {"decode": 0.0, "decode_own": 0.0, "prefill": 0.0}
            while any(t.is_alive() for t in ts):
                if prefill_only:  # the tiny model's prefill queue lasts milliseconds
                    peak["prefill"] = max(peak["prefill"],
                                          promql_sum.evaluate(pq, sample(procs[1:2], ns)))
                    continue
                s = sample(procs, ns)
                peak["decode"] = max(peak["decode"], promql_sum.evaluate(dq, s))
                peak["decode_own"] = max(peak["decode_own"], sum(
                    v for n_, ls, v in s if n_ == "vllm:num_requests_waiting"
                    and ls["service"] == "tandem-decode" and promql_sum.matches(matchers, ls)))
                peak["prefill"] = max(peak["prefill"], promql_sum.evaluate(pq, s))
            for t in ts:
                t.join()
            assert not errors, errors[:3]
            return peak

        # Decode KV exhausted: 32 requests of ~230 tokens each on a pool of
        # 640 tokens; the router holds them back.
        peak = burst(32, "tell me", 220)
        assert desired(peak["decode"], dthr) >= 2, peak
        assert peak["decode"] > peak["decode_own"], peak  # the routers' queue counted
        # A burst of prompts longer than P's chunk, all at once: queued
        # prompt tokens (a transient of tens of ms here: up to three bursts
        # to see it).
        for k in range(3):
            peak = burst(32, f"{k} a longer prompt about the weather " * 4, 2, True)
            if peak["prefill"] > 0:
                break
        assert peak["prefill"] > 0, peak
        c.wait_idle()
        s = sample(procs, ns)
        assert promql_sum.evaluate(dq, s) == 0 and promql_sum.evaluate(pq, s) == 0
        # another namespace's series are not read
        assert promql_sum.evaluate(dq, sample(procs, "elsewhere")) == 0
    finally:
        c.close()
