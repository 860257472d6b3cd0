"""The service binaries run with exactly the arguments, environment and
ports deploy/k8s gives them (the cpu-demo overlay, rendered by `kubectl
kustomize`), on loopback and with the default model (what the overlay
mounts): the probes answer as the manifests expect while starting, when
ready and while draining, and the drain order holds:
  - a prefill pod sent SIGTERM stops being ready at once, stays alive
    (liveness keeps passing) until the KV it produced has been consumed,
    then exits 0;
  - a decode pod sent SIGTERM finishes its streams, and the router stops
    sending to it before it stops;
  - a router sent SIGTERM finishes its in-flight streams, then exits 0;
  - each exits within terminationGracePeriodSeconds minus the preStop.
Only what a pod's surroundings provide is replaced: binaries under
/usr/local/bin by the build's, the model volume by the default model, the
Secret volume by a file with the Secret's token, the cluster DNS by a
private /etc/hosts of the pods' processes naming every Service 127.0.0.1
(where a private mount namespace cannot be made: the Service names by
localhost), the pod IP by 127.0.0.1 and 0.0.0.0 binds by 127.0.0.1."""

import base64
import os
import re
import signal
import socket
import subprocess
import time

import pytest

import k8s_util
from conftest import register_log, scaled, wait_until
from serve_util import (SSEStream, metric, parse_metrics, private_hosts, private_hosts_cmd,
                        write_hosts)

OVERLAY = "deploy/k8s/overlays/cpu-demo"


def http_status(port, path, headers=None):
    import http.client
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        c.request("GET", path, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read()
    except OSError:
        return None, b""
    finally:
        c.close()


@pytest.fixture(scope="module")
def rendered(source_dir):
    objs = k8s_util.render(source_dir / OVERLAY)
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def find(objs, kind, name_prefix):
    for (k, n), o in objs.items():
        if k == kind and n.startswith(name_prefix):
            return o
    pytest.fail(f"no {kind} {name_prefix}* in {OVERLAY}")


class Pod:
    """One Deployment's container as the kubelet would start it."""

    def __init__(self, objs, role, build_dir, model, tmp, hosts):
        self.dep = find(objs, "Deployment", f"tandem-{role}")
        spec = self.dep["spec"]["template"]["spec"]
        self.c = spec["containers"][0]
        self.grace = spec["terminationGracePeriodSeconds"]
        self.pre_stop = self.c["lifecycle"]["preStop"]["sleep"]["seconds"]
        self.ports = {p["name"]: p["containerPort"] for p in self.c["ports"]}
        mounts = {m["mountPath"]: m["name"] for m in self.c.get("volumeMounts", [])}
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        env = {}
        for e in self.c.get("env", []):
            if "value" in e:
                env[e["name"]] = e["value"]
                continue
            src = e["valueFrom"]
            if "configMapKeyRef" in src:
                r = src["configMapKeyRef"]
                env[e["name"]] = objs[("ConfigMap", r["name"])]["data"][r["key"]]
            elif "secretKeyRef" in src:
                r = src["secretKeyRef"]
                env[e["name"]] = base64.b64decode(
                    objs[("Secret", r["name"])]["data"][r["key"]]).decode()
            elif src["fieldRef"]["fieldPath"] == "metadata.name":
                env[e["name"]] = f"tandem-{role}-0"
            elif src["fieldRef"]["fieldPath"] == "status.podIP":
                env[e["name"]] = "127.0.0.1"
            else:
                pytest.fail(f"{role}: env {e} not understood")
        self.env = env
        # Kubernetes expands $(VAR) in args from the container's env.
        args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in self.c["args"]]
        services = {n: o for (k, n), o in objs.items() if k == "Service"}
        out, self.files = [], {}
        for i, a in enumerate(args):
            prev = args[i - 1] if i else ""
            if prev == "--host" and a == "0.0.0.0":
                a = "127.0.0.1"
            elif prev == "--model":
                assert a.startswith("/models/") and "/models" in mounts, a
                a = str(model)
            elif prev in ("--cluster-token-file", "--api-key-file"):
                d = os.path.dirname(a)
                secret = vols[mounts[d]]["secret"]["secretName"]
                data = objs[("Secret", secret)]["data"][os.path.basename(a)]
                f = tmp / f"{role}-{prev[2:]}"
                f.write_bytes(base64.b64decode(data))
                self.files[prev] = f
                a = str(f)
            elif prev in ("--prefill", "--prefill-dns", "--decode-dns"):
                name, port = a.rsplit(":", 1)
                svc = services[name]  # a Service of the render, with that port
                assert int(port) in [p["port"] for p in svc["spec"]["ports"]], (name, port)
                if hosts is None:
                    a = f"localhost:{port}"
            out.append(a)
        cmd = self.c["command"]
        assert len(cmd) == 1 and cmd[0].startswith("/usr/local/bin/"), cmd
        self.argv = [str(build_dir / os.path.basename(cmd[0]))] + out
        if hosts is not None:
            self.argv = private_hosts_cmd(hosts) + self.argv
        self.role, self.tmp, self.proc = role, tmp, None
        self.probes = {k: self.c[k]["httpGet"] for k in
                       ("startupProbe", "readinessProbe", "livenessProbe")}

    def probe_port(self, kind):
        p = self.probes[kind]["port"]
        return self.ports[p] if isinstance(p, str) else p

    def probe(self, kind):
        return http_status(self.probe_port(kind), self.probes[kind]["path"])[0]

    def start(self):
        env = dict(os.environ)
        env.update(self.env)
        self.log = open(self.tmp / f"{self.role}.log", "ab")
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=self.log, env=env, start_new_session=True)
        register_log(self.role, self.tmp / f"{self.role}.log", self.proc)
        # the startup probe's budget: periodSeconds x failureThreshold
        sp = self.c["startupProbe"]
        budget = sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3)
        wait_until(lambda: self.probe("startupProbe") == 200, timeout=min(budget, 120),
                   what=f"{self.role} startup probe", proc=self.proc)
        assert self.probe("livenessProbe") == 200

    def wait_ready(self, timeout=60):
        wait_until(lambda: self.probe("readinessProbe") == 200, timeout=timeout,
                   what=f"{self.role} readiness probe", proc=self.proc)

    def wait_not_ready(self):
        """Out of the Service within a readiness period of the SIGTERM."""
        period = self.c["readinessProbe"].get("periodSeconds", 10)
        wait_until(lambda: self.probe("readinessProbe") == 503, timeout=period,
                   what=f"{self.role} not ready after SIGTERM", proc=self.proc)

    def term(self):
        """What the kubelet does: preStop, then SIGTERM; returns the SIGTERM time.
        (The preStop sleep only gives the endpoints time to go; here the
        router's own poll does that, so it is not slept through.)"""
        self.proc.send_signal(signal.SIGTERM)
        return time.monotonic()

    def wait_exit(self, t_term):
        budget = self.grace - self.pre_stop
        rc = self.proc.wait(timeout=scaled(budget))
        took = time.monotonic() - t_term
        assert rc == 0, self.tail()
        assert took < budget, (self.role, took, budget)
        return took

    def tail(self):
        self.log.flush()
        return (self.tmp / f"{self.role}.log").read_text(errors="replace")[-3000:]

    def close(self):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def free(port):
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def test_probes_and_drain_order(rendered, build_dir, default_model, tmp_path):
    hosts, _ = private_hosts(tmp_path / "hosts")
    if hosts is not None:
        write_hosts(hosts, {n: ["127.0.0.1"] for (k, n) in rendered if k == "Service"})
    pods = {r: Pod(rendered, r, build_dir, default_model, tmp_path, hosts)
            for r in ("prefill", "decode", "router")}
    # The manifests' ports are fixed, and some (50200) lie in the kernel's
    # ephemeral range, where another test's client connection may hold one
    # for a moment: wait for them rather than skip, and name the holder if
    # one stays.
    ports = [p for pod in pods.values() for p in pod.ports.values()]
    deadline = time.monotonic() + scaled(60)
    while True:
        busy = [p for p in ports if not free(p)]
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if busy:
        try:
            held = subprocess.run(["ss", "-Htanp"], capture_output=True, text=True).stdout
        except OSError as e:
            held = f"(ss: {e})"
        held = [ln for ln in held.splitlines() if any(f":{p} " in ln for p in busy)]
        pytest.fail(f"the manifests' fixed ports {busy} stayed in use for 60 s: {held}")
    P, D, R = pods["prefill"], pods["decode"], pods["router"]
    # the router's key is a file of the Secret, not in the environment
    kf = R.files.get("--api-key-file")
    assert kf is not None and "TANDEM_API_KEY" not in R.env, R.argv
    key = kf.read_text().split()[0]
    auth = {"Authorization": f"Bearer {key}"}
    try:
        P.start()
        P.wait_ready()
        # Starting: the router is alive (startup and liveness probes pass)
        # but not ready while no decode instance is, then ready.
        R.start()
        assert R.probe("readinessProbe") == 503
        D.start()
        D.wait_ready()
        R.wait_ready()
        rport = R.ports["http"]
        ctok = base64.b64decode(find(rendered, "Secret", "tandem-cluster-token")["data"]["token"])

        def view():
            import json
            _, body = http_status(rport, "/internal/v1/cluster",
                                  {"X-Tandem-Cluster-Token": ctok.decode()})
            return json.loads(body)

        def routed_to_decode():
            return sum(x["routed"] for x in view()["instances"] if x["role"] == "decode")

        # the router's /ready needs a decode instance only: the prefill
        # instance is in rotation once its state was pulled
        wait_until(lambda: {x["role"] for x in view()["instances"] if x["ready"]} ==
                   {"prefill", "decode"}, timeout=30, what="both pools in the router's view")

        def post(body):
            return SSEStream("127.0.0.1", rport, "/v1/completions",
                             dict(body, stream=True, stream_options={"include_usage": True}),
                             auth, 300)

        def finish(st):
            usage, reason = None, None
            for e in st.events():
                if e == "[DONE]":
                    break
                assert "error" not in e, e
                usage = e.get("usage") or usage
                for ch in e["choices"]:
                    reason = ch.get("finish_reason") or reason
            st.close()
            return reason, usage

        # 1. Prefill drain: a remote prefill in flight (over the router's
        # 512-token local threshold), then SIGTERM to the prefill pod.
        long_prompt = "The history of the city " * 160
        st = post({"prompt": long_prompt, "max_tokens": 8, "temperature": 0})
        assert st.status == 200
        wait_until(lambda: metric(parse_metrics(http_status(P.ports["http"], "/metrics")[1]
                                                .decode()), "vllm:num_requests_running") >= 1,
                   timeout=30, what="the prefill instance working")
        t = P.term()
        P.wait_not_ready()  # out of the Service at once
        assert P.probe("livenessProbe") == 200  # but never restarted while draining
        reason, usage = finish(st)
        assert reason == "length" and usage["completion_tokens"] == 8
        P.wait_exit(t)
        dm = parse_metrics(http_status(D.ports["http"], "/metrics")[1].decode())
        assert metric(dm, "tandem:remote_prefill_total") == 1
        assert metric(dm, "tandem:local_prefill_total", reason="fallback") == 0  # KV consumed

        # 2. Decode drain: a stream in flight through the router.
        st = post({"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
                   "temperature": 0})
        assert st.status == 200
        events = st.events()
        first = next(events)
        assert "error" not in first
        t = D.term()
        D.wait_not_ready()
        assert D.probe("livenessProbe") == 200
        # the router stops sending to it within a few of its polls: a request
        # now is refused by the router, not routed to the draining pod
        wait_until(lambda: http_status(rport, "/ready")[0] == 503, timeout=5,
                   what="the router sees no ready decode instance")
        before = routed_to_decode()
        late = SSEStream("127.0.0.1", rport, "/v1/completions",
                         {"prompt": "Hello", "max_tokens": 4, "stream": True}, auth, 60)
        assert late.status == 503
        late.close()
        assert routed_to_decode() == before
        reason, usage = finish(st)
        assert reason == "length" and usage["completion_tokens"] == 200
        D.wait_exit(t)

        # 3. Router drain: a decode pod again (a new one, same manifest),
        # a stream in flight, SIGTERM to the router.
        D.start()
        D.wait_ready()
        R.wait_ready()
        st = post({"prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True,
                   "temperature": 0})
        assert st.status == 200
        t = R.term()
        R.wait_not_ready()
        assert R.probe("livenessProbe") == 200
        reason, usage = finish(st)
        assert reason == "length" and usage["completion_tokens"] == 120
        R.wait_exit(t)
        t = D.term()
        D.wait_exit(t)
    finally:
        for p in pods.values():
            p.close()
