#!/usr/bin/env python3
"""The answers of a disaggregated cluster, for comparing two builds bit for
bit across a restructuring of the transfer or the router.

  pd_answers.py BUILD_DIR [--model GGUF] > answers.json
  cmp old.json new.json

Runs `BUILD_DIR/tandem up --prefill 1 --decode 1` (the default model unless
--model), sends fixed greedy completions and chat completions with
logprobs through the router, long enough that the router sends every one
to the prefill instance (checked: its decisions must all be "remote"),
and prints the answers as JSON with the fields that differ between runs
(ids, times) removed. Exits 1 if the cluster does not come up, a request
fails or one was prefilled locally."""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

PROMPTS = ["The capital of France is. " * 150, "Once upon a time " * 200,
           "def fibonacci(n):\n    return n\n" * 90, "List three colours: " + "red, " * 400]


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build_dir")
    ap.add_argument("--model")
    a = ap.parse_args()
    argv = [os.path.join(a.build_dir, "tandem"), "up", "--prefill", "1", "--decode", "1",
            "--port", "0", "--grpc-port", "-1", "--threads", "1"]
    if a.model:
        argv += ["--model", a.model]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         start_new_session=True)
    try:
        port, t0 = None, time.monotonic()
        while port is None and time.monotonic() - t0 < 300:
            line = p.stdout.readline()
            if not line:
                break
            m = re.search(r"ready http=http://\S+:(\d+)", line)
            port = int(m.group(1)) if m else None
        if port is None:
            sys.exit("pd_answers: the cluster did not come up")
        out = []
        for text in PROMPTS:
            for path, body in (("/v1/completions", {"prompt": text, "logprobs": 3}),
                               ("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": text}],
                                 "logprobs": True, "top_logprobs": 2})):
                r = post(port, path, dict(body, max_tokens=24, temperature=0))
                for k in ("id", "created", "system_fingerprint"):
                    r.pop(k, None)
                out.append(r)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        local = [ln for ln in metrics.splitlines()
                 if ln.startswith("tandem:router_decisions_total") and 'reason="remote"' not in ln
                 and not ln.endswith(" 0")]
        if local:
            sys.exit(f"pd_answers: requests prefilled locally: {local}")
        print(json.dumps(out, sort_keys=True, indent=1))
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=60)


if __name__ == "__main__":
    main()
