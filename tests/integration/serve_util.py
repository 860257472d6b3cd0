"""Helpers for tests that run a real `tandem serve` on loopback.

    from serve_util import serve  # noqa: F401  (the pytest fixture)

    def test_x(serve, test_models):
        srv = serve(test_models / "gguf/llama2-f32.gguf", "--max-running", 4)
        status, body = srv.post_json("/v1/completions", {...})
        m = srv.metrics()                       # {(name, labels): value}
        assert metric(m, "vllm:num_preemptions_total") == 0
        srv.wait_idle()                         # used == reserved == 0, nothing runs

API (kept small on purpose):
  serve (fixture)       serve(model, *args, env=None, ready_timeout=60) -> Server.
                        Starts `tandem serve --model MODEL --port 0 --grpc-port -1
                        ARGS...` (pass "--grpc-port", "0" in ARGS to get gRPC) and
                        waits for the ready line; every server is stopped at
                        teardown, even when the test fails.
  Server.start(binary, model, args, log_dir, env=None, ready_timeout=60)
                        the same without the fixture (call .close() yourself).
  Server attributes     proc (Popen), host, port, grpc_port (None when off),
                        base_url ("http://HOST:PORT"), out_path / err_path (logs).
  Server.request(method, path, body=None, headers=None, timeout=30)
                        -> (status, {lower-case header: value}, bytes)
  Server.post_json(path, obj, headers=None, timeout=60) -> (status, parsed JSON or None)
  Server.get_json(path, timeout=30) -> (status, parsed JSON or None)
  Server.open_stream(path, obj, headers=None, timeout=60) -> SSEStream: a raw
                        streaming POST; .status, .events() yields each `data:`
                        payload parsed as JSON (the string "[DONE]" for the end
                        marker), .abort() closes the socket at once (a client
                        that disconnects), .close().
  Server.metrics() -> dict {(name, frozenset(labels.items())): float} of /metrics
  Server.state(since=None) -> the JSON of /internal/v1/state[?since=N]
  Server.blocks() -> {"used", "reserved", "cached", "empty", "total", "running",
                        "waiting"} from /metrics (tandem:kv_blocks and the vLLM gauges)
  Server.wait_idle(timeout=10) polls until nothing runs or waits and the KV
                        used and reserved counts are 0 (in /metrics and in
                        /internal/v1/state); fails the test with the last values.
  Server.stop(sig=SIGTERM, timeout=30) -> exit status (fails the test if it
                        does not exit in time); Server.close() kills if needed.
  Server.log_tail(n=4000) -> the end of stderr, for failure messages.
  parse_metrics(text), metric(samples, name, **labels): sum of the samples of
                        `name` whose labels include `labels` (the family must
                        exist; 0.0 when no labelled sample matches).
  state_load(state) -> the load figures of a /internal/v1/state JSON as a flat
                        dict (running, waiting, kv_used, kv_reserved, ...).
  ready_line_ports(line) -> (host, http_port, grpc_port or None).
  Pair(tandem_bin, log_dir, model, p_args, d_args, env, d_model=None)
                        a tandem-prefill and a tandem-decode wired together
                        (cluster token TOKEN, one thread each); .p, .d
                        (Servers), .wait_linked(), .close().
  Cluster(tandem_bin, log_dir, model, n_prefill=2, n_decode=2, p_args, d_args,
          r_args, env, d_args_each=None)
                        prefill and decode instances (every decode instance
                        knows every prefill instance) behind a tandem-router;
                        .ps, .ds, .router (Servers), .view() (the router's
                        /internal/v1/cluster), .inst(server) (that instance in
                        the view), .wait_ready(), .wait_idle(), .wait_settled()
                        (idle, and so is the router's view of every instance),
                        .close().

Timeouts go through conftest.scaled() (TANDEM_TEST_TIMEOUT_SCALE).
"""

import contextlib
import http.client
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import time

import pytest

from conftest import register_log, scaled, wait_until

READY_RE = re.compile(
    r"^(?:tandem serve|tandem-prefill|tandem-decode|tandem-router): listening http=(\S+) "
    r"grpc=(\S+)\s*$")


def ready_line_ports(line):
    """Parses `tandem serve: listening http=HOST:PORT grpc=HOST:PORT|off`."""
    m = READY_RE.match(line.strip())
    if not m:
        return None
    host, port = m.group(1).rsplit(":", 1)
    host = host.strip("[]")
    grpc = None if m.group(2) in ("off", "none") else int(m.group(2).rsplit(":", 1)[1])
    return host, int(port), grpc


# ---------------------------------------------------------------------------
# Prometheus text format

_SAMPLE_RE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$')
_LABEL_RE = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(,|$)')


def _unescape(v):
    return re.sub(r'\\(.)', lambda m: {"n": "\n", "\\": "\\", '"': '"'}.get(m.group(1), m.group(0)), v)


def parse_metrics(text):
    """{(name, frozenset(labels.items())): float} for every sample line.
    Fails the test on a line that is not valid exposition format."""
    out = {}
    for ln in text.splitlines():
        if not ln.strip() or ln.startswith("#"):
            continue
        m = _SAMPLE_RE.match(ln)
        if not m:
            pytest.fail(f"/metrics: not a sample line: {ln!r}")
        labels = {}
        body = m.group(3) or ""
        pos = 0
        while pos < len(body):
            lm = _LABEL_RE.match(body, pos)
            if not lm:
                pytest.fail(f"/metrics: bad labels in {ln!r}")
            labels[lm.group(1)] = _unescape(lm.group(2))
            pos = lm.end()
        key = (m.group(1), frozenset(labels.items()))
        if key in out:
            pytest.fail(f"/metrics: duplicate sample {ln!r}")
        out[key] = float(m.group(4))
    return out


def metric(samples, name, **labels):
    """Sum of the samples of `name` whose labels include `labels`. Fails when
    no sample of `name` exists at all (a misspelt name must not read as 0)."""
    found = False
    total = 0.0
    want = set(labels.items())
    for (n, ls), v in samples.items():
        if n != name:
            continue
        found = True
        if want <= set(ls):
            total += v
    if not found:
        names = sorted({n for n, _ in samples})
        pytest.fail(f"/metrics has no {name}; it has: {', '.join(names)}")
    return total


# ---------------------------------------------------------------------------
# /internal/v1/state

def state_load(st):
    """The load figures of a /internal/v1/state body (shape in
    common/api/http.h) as a flat dict: running, waiting,
    queued_prefill_tokens, kv_total, kv_empty, kv_cached, kv_used,
    kv_reserved, kv_free, kv_block_size. Fails the test when "load" or
    "load.kv" is missing."""
    load = st.get("load")
    if not isinstance(load, dict) or not isinstance(load.get("kv"), dict):
        pytest.fail(f"/internal/v1/state without load / load.kv: {st!r}")
    flat = {k: v for k, v in load.items() if k != "kv"}
    flat.update({"kv_" + k: v for k, v in load["kv"].items()})
    return flat


# ---------------------------------------------------------------------------
# SSE


class SSEStream:
    """A raw streaming POST on its own socket (http.client), so a test can
    read a few events and then drop the connection like a real client."""

    def __init__(self, host, port, path, obj, headers=None, timeout=60):
        self.conn = http.client.HTTPConnection(host, port, timeout=scaled(timeout))
        body = json.dumps(obj).encode()
        h = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        h.update(headers or {})
        self.conn.request("POST", path, body=body, headers=h)
        self.resp = self.conn.getresponse()
        self.status = self.resp.status
        self.headers = {k.lower(): v for k, v in self.resp.getheaders()}
        self.comments = 0

    def events(self):
        """Yields each event's data: a parsed JSON object, or "[DONE]". A
        non-200 response yields its parsed body once. Ends at EOF."""
        if self.status != 200:
            raw = self.resp.read()
            try:
                yield json.loads(raw)
            except ValueError:
                yield {"_raw": raw.decode(errors="replace")}
            return
        data = []
        while True:
            line = self.resp.readline()
            if not line:
                return
            line = line.decode("utf-8", errors="replace").rstrip("\r\n")
            if line.startswith(":"):
                self.comments += 1
                continue
            if line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
                continue
            if line == "" and data:
                payload = "\n".join(data)
                data = []
                if payload == "[DONE]":
                    yield "[DONE]"
                else:
                    yield json.loads(payload)

    def abort(self):
        """Closes the connection at once (RST when unread data remains)."""
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            except OSError:
                pass
        self.close()

    def close(self):
        try:
            self.resp.close()
        finally:
            self.conn.close()


# ---------------------------------------------------------------------------
# The server


def requests_received(port):
    """How many connections to 127.0.0.1:port hold request bytes the server
    has not read (accepted or still in the listen backlog): /proc/net/tcp."""
    n = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for ln in f:
            fields = ln.split()
            local, st, queues = fields[1], fields[3], fields[4]
            if st == "01" and int(local.split(":")[1], 16) == port \
                    and int(queues.split(":")[1], 16) > 0:
                n += 1
    return n


class Server:
    def __init__(self):
        self.proc = None
        self.host = self.port = self.grpc_port = None
        self.base_url = None
        self.out_path = self.err_path = None
        self.argv = None
        self.internal_headers = {}

    @classmethod
    def start(cls, binary, model, args, log_dir, env=None, ready_timeout=60, cmd=None,
              cluster_token=None):
        """cmd: the argv before --model (default [binary, "serve"]), e.g.
        [build/"tandem-prefill"]; cluster_token: sent on /internal/ paths."""
        s = cls()
        if cluster_token:
            s.internal_headers = {"X-Tandem-Cluster-Token": cluster_token}
        log_dir = pathlib.Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        n = len(list(log_dir.glob("serve-*.out")))
        s.out_path = log_dir / f"serve-{n}.out"
        s.err_path = log_dir / f"serve-{n}.err"
        args = [str(a) for a in args]
        s.argv = [str(c) for c in (cmd or [binary, "serve"])] + ["--model", str(model),
                                                                  "--port", "0"]
        if "--grpc-port" not in args:
            s.argv += ["--grpc-port", "-1"]
        s.argv += args
        full_env = dict(os.environ)
        if env:
            full_env.update({k: str(v) for k, v in env.items()})
        with open(s.out_path, "wb") as fo, open(s.err_path, "wb") as fe:
            s.proc = subprocess.Popen(s.argv, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                      env=full_env, start_new_session=True)
        what = os.path.basename(str(cmd[-1])) if cmd else "tandem serve"
        register_log(f"{what} ({log_dir.name}, pid {s.proc.pid})", s.err_path, s.proc)
        try:
            deadline = time.monotonic() + scaled(ready_timeout)
            while True:
                with open(s.out_path, errors="replace") as f:
                    for ln in f:
                        ports = ready_line_ports(ln)
                        if ports:
                            s.host, s.port, s.grpc_port = ports
                            break
                if s.port:
                    break
                if s.proc.poll() is not None:
                    pytest.fail(f"tandem serve exited with {s.proc.returncode} before ready\n"
                                f"$ {' '.join(s.argv)}\n{s.log_tail()}")
                if time.monotonic() > deadline:
                    pytest.fail(f"tandem serve not ready after {scaled(ready_timeout):.0f} s\n"
                                f"$ {' '.join(s.argv)}\n{s.log_tail()}")
                time.sleep(0.02)
        except BaseException:
            s.close()
            raise
        s.base_url = f"http://{s.host}:{s.port}"
        return s

    # -- plumbing
    def log_tail(self, n=4000):
        try:
            with open(self.err_path, errors="replace") as f:
                return f.read()[-n:]
        except (OSError, TypeError):
            return ""

    def request(self, method, path, body=None, headers=None, timeout=30):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=scaled(timeout))
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            data = r.read()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, data
        finally:
            conn.close()

    def post_json(self, path, obj, headers=None, timeout=60):
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        status, _, data = self.request("POST", path, json.dumps(obj).encode(), h, timeout)
        try:
            return status, json.loads(data)
        except ValueError:
            return status, None

    def get_json(self, path, timeout=30, headers=None):
        status, _, data = self.request("GET", path, headers=headers, timeout=timeout)
        try:
            return status, json.loads(data)
        except ValueError:
            return status, None

    def open_stream(self, path, obj, headers=None, timeout=60):
        return SSEStream(self.host, self.port, path, obj, headers, timeout)

    # -- observability
    def metrics(self):
        status, _, data = self.request("GET", "/metrics")
        if status != 200:
            pytest.fail(f"GET /metrics: {status} {data[:300]!r}")
        return parse_metrics(data.decode())

    def state(self, since=None):
        path = "/internal/v1/state" + ("" if since is None else f"?since={since}")
        status, body = self.get_json(path, headers=self.internal_headers)
        if status != 200 or not isinstance(body, dict):
            pytest.fail(f"GET {path}: {status} {body!r}")
        return body

    @contextlib.contextmanager
    def held(self, n_requests, timeout=30, before_resume=None):
        """Stops the process (SIGSTOP) for the body of the with statement,
        which starts n_requests requests on other threads; on leaving it,
        waits until all of them are in the server's sockets, calls
        before_resume (if given: e.g. a thread whose requests must queue
        behind them), then resumes it (SIGCONT), so they arrive together
        however late the client threads ran on a loaded machine."""
        self.proc.send_signal(signal.SIGSTOP)
        try:
            yield
            wait_until(lambda: requests_received(self.port) >= n_requests, timeout=timeout,
                       interval=0.01, what=f"{n_requests} requests in the server's sockets",
                       proc=self.proc)
            if before_resume:
                before_resume()
        finally:
            self.proc.send_signal(signal.SIGCONT)

    def blocks(self):
        m = self.metrics()
        out = {s: metric(m, "tandem:kv_blocks", state=s)
               for s in ("used", "reserved", "cached", "empty", "total")}
        out["running"] = metric(m, "vllm:num_requests_running")
        out["waiting"] = metric(m, "vllm:num_requests_waiting")
        return out

    def wait_idle(self, timeout=10):
        """Polls until nothing runs or waits and no KV block is used or
        reserved, in /metrics and in /internal/v1/state."""
        deadline = time.monotonic() + scaled(timeout)
        last = None
        while True:
            b = self.blocks()
            st = self.state()
            ld = state_load(st)
            xf = st.get("transfer", {})
            last = (b, ld, xf)
            ok = (b["used"] == 0 and b["reserved"] == 0 and b["running"] == 0
                  and b["waiting"] == 0
                  and b["empty"] + b["cached"] == b["total"]
                  and ld.get("kv_used", -1) == 0 and ld.get("kv_reserved", -1) == 0
                  and ld.get("running", -1) == 0 and ld.get("waiting", -1) == 0
                  and all(xf.get(k, 0) == 0 for k in ("in_flight", "leased_blocks",
                                                      "quarantined_blocks", "held_blocks")))
            if ok:
                return b
            if self.proc.poll() is not None:
                pytest.fail(f"server exited ({self.proc.returncode}) while waiting for idle\n"
                            f"{self.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"not idle after {scaled(timeout):.0f} s: metrics {last[0]}, "
                            f"state {last[1]}, transfer {last[2]}")
            time.sleep(0.05)

    # -- lifetime
    def stop(self, sig=signal.SIGTERM, timeout=30):
        """Sends sig and waits for the exit; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=scaled(timeout))
        except subprocess.TimeoutExpired:
            self.close()
            pytest.fail(f"tandem serve did not exit within {scaled(timeout):.0f} s of "
                        f"signal {sig}\n{self.log_tail()}")

    def close(self):
        p = self.proc
        if p is None:
            return
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            if p.poll() is not None:
                break
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def serve(tandem_bin, tmp_path):
    """serve(model, *args, env=None, ready_timeout=60) -> a ready Server,
    stopped at teardown."""
    servers = []

    def start(model, *args, env=None, ready_timeout=60):
        s = Server.start(tandem_bin, model, args, tmp_path, env=env, ready_timeout=ready_timeout)
        servers.append(s)
        return s

    yield start
    for s in reversed(servers):
        s.close()


TOKEN = "test-cluster-secret"


def linked(d):
    """A decode instance knows some prefill instance and has linked every
    one it knows (the names D resolves arrive after it started)."""
    peers = d.state()["transfer"]["peers"]
    return bool(peers) and all(pp["ready"] for pp in peers)


# ---------------------------------------------------------------------------
# A private /etc/hosts: names that resolve as a cluster's DNS would (a
# headless Service with one address per pod), for the processes started
# under it only (a private mount namespace; root and unshare(1)).

def write_hosts(path, names):
    """names: {name: [address, ...]}; rewritten in place (a bind mount holds
    the inode), localhost kept."""
    lines = ["127.0.0.1 localhost\n"] + [f"{a} {n}\n" for n, addrs in names.items()
                                         for a in addrs]
    with open(path, "a+") as f:
        f.truncate(0)
        f.write("".join(lines))


def private_hosts_cmd(hosts, resolv=None):
    """The argv prefix that runs a command with `hosts` as its /etc/hosts
    (and `resolv` as its /etc/resolv.conf)."""
    if resolv is None:
        return ["unshare", "-m", "--propagation", "private", "sh", "-c",
                'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts)]
    return ["unshare", "-m", "--propagation", "private", "sh", "-c",
            'mount --bind "$0" /etc/hosts && mount --bind "$1" /etc/resolv.conf && shift && '
            'exec "$@"', str(hosts), str(resolv)]


def private_hosts(path):
    """Creates `path` (only localhost) and returns (path, None), or (None,
    why) where no private mount namespace can be made."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return None, "needs root and unshare(1) for a private /etc/hosts"
    write_hosts(path, {})
    r = subprocess.run(private_hosts_cmd(path) + ["getent", "hosts", "localhost"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"no private mount namespace here: {r.stderr.strip()}"
    return path, None


class Pair:
    """One prefill and one decode instance wired together."""

    def __init__(self, tandem_bin, log_dir, model, p_args=(), d_args=(), env=None,
                 threads=1, ready_timeout=60):
        self.bin_dir = tandem_bin.parent
        self.tandem_bin, self.log_dir, self.model = tandem_bin, log_dir, model
        self.p_args, self.env, self.threads = list(p_args), env, threads
        self.ready_timeout = ready_timeout
        self.p = self.start_prefill()
        try:
            self.d = Server.start(tandem_bin, model,
                                  ["--prefill", f"127.0.0.1:{self.p.port}", "--cluster-token",
                                   TOKEN, "--threads", threads, *d_args],
                                  log_dir / "decode", env=env,
                                  cmd=[self.bin_dir / "tandem-decode"], cluster_token=TOKEN,
                                  ready_timeout=ready_timeout)
        except BaseException:
            self.p.close()
            raise
        self.wait_linked()

    def start_prefill(self, port=None):
        """A prefill instance (port: a fixed HTTP port, for a restart)."""
        args = ["--cluster-token", TOKEN, "--threads", self.threads, *self.p_args]
        s = Server.start(self.tandem_bin, self.model, args, self.log_dir / "prefill",
                         env=self.env, cmd=[self.bin_dir / "tandem-prefill"],
                         cluster_token=TOKEN, ready_timeout=self.ready_timeout)
        if port is not None and s.port != port:
            s.close()
            pytest.fail("start_prefill(port) needs --port in p_args")
        return s

    def wait_linked(self, timeout=20):
        wait_until(lambda: linked(self.d),
                   timeout=timeout, what="decode linked to prefill", proc=self.d.proc)

    def close(self):
        self.d.close()
        self.p.close()


class Cluster:
    """Prefill and decode instances behind one tandem-router (loopback,
    cluster token TOKEN, one thread each). d_args_each: per decode instance
    extra arguments (a list of lists)."""

    def __init__(self, tandem_bin, log_dir, model, n_prefill=2, n_decode=2, p_args=(),
                 d_args=(), r_args=(), env=None, d_args_each=None, threads=1,
                 ready_timeout=60, router_model=None):
        bin_dir = tandem_bin.parent
        self.ps, self.ds, self.router = [], [], None
        try:
            for i in range(n_prefill):
                self.ps.append(Server.start(
                    tandem_bin, model, ["--cluster-token", TOKEN, "--threads", threads, *p_args],
                    log_dir / f"prefill{i}", env=env, cmd=[bin_dir / "tandem-prefill"],
                    cluster_token=TOKEN, ready_timeout=ready_timeout))
            plist = ",".join(f"127.0.0.1:{p.port}" for p in self.ps)
            for i in range(n_decode):
                extra = list(d_args_each[i]) if d_args_each else []
                self.ds.append(Server.start(
                    tandem_bin, model,
                    ["--prefill", plist or "127.0.0.1:1", "--cluster-token", TOKEN,
                     "--threads", threads, "--grpc-port", "0", *d_args, *extra],
                    log_dir / f"decode{i}", env=env, cmd=[bin_dir / "tandem-decode"],
                    cluster_token=TOKEN, ready_timeout=ready_timeout))
            args = ["--cluster-token", TOKEN, "--grpc-port", "0", "--poll-interval-ms", 50]
            if self.ps:
                args += ["--prefill", plist]
            args += ["--decode", ",".join(f"127.0.0.1:{d.port}" for d in self.ds), *r_args]
            self.router = Server.start(tandem_bin, router_model or model, args,
                                       log_dir / "router", env=env,
                                       cmd=[bin_dir / "tandem-router"], cluster_token=TOKEN,
                                       ready_timeout=ready_timeout)
            for d in self.ds:
                if self.ps:
                    wait_until(lambda d=d: linked(d), timeout=20, what="decode linked to prefill", proc=d.proc)
            self.wait_ready()
        except BaseException:
            self.close()
            raise

    def view(self):
        status, body = self.router.get_json("/internal/v1/cluster",
                                            headers={"X-Tandem-Cluster-Token": TOKEN})
        if status != 200 or not isinstance(body, dict):
            pytest.fail(f"GET /internal/v1/cluster: {status} {body!r}")
        return body

    def inst(self, srv, view=None):
        addr = f"127.0.0.1:{srv.port}"
        for x in (view or self.view())["instances"]:
            if x["address"] == addr:
                return x
        pytest.fail(f"{addr} is not in the router's view")

    def decisions(self):
        """The router's routing decisions so far, as it logged them
        (tandem-router --log-decisions), in order."""
        out = []
        with open(self.router.err_path, errors="replace") as f:
            for line in f:
                at = line.find("decision {")
                if at >= 0:
                    out.append(json.loads(line[at + len("decision "):]))
        return out

    def wait_ready(self, servers=None, timeout=20):
        servers = self.ps + self.ds if servers is None else servers
        wait_until(lambda: all(self.inst(s)["ready"] for s in servers), timeout=timeout,
                   what="every instance ready in the router's view", proc=self.router.proc)

    def wait_idle(self, timeout=10):
        for s in self.ds + self.ps:
            if s.proc.poll() is None:
                s.wait_idle(timeout)
        wait_until(lambda: (lambda v: v["running"] == 0 and v["queued"] == 0)(self.view()),
                   timeout=timeout, what="router idle", proc=self.router.proc)

    def wait_settled(self, timeout=10):
        """wait_idle, and then the router's view of it as of a state pull of
        every live instance sent after that: each ready, with nothing in
        flight, pending (blocks, prefill tokens), queued, waiting, running
        or used. The router's figures come from its pulls, and a reply sent
        while a request still ran may be applied after the request ended,
        holding it for one more pull (so the next request, even one with
        the same prefix, may go elsewhere): a test that needs the routing to
        follow the prefix alone waits for this first. The router applies a
        round's replies before it sends the next round, so the second pull
        applied after this point was sent after it."""
        self.wait_idle(timeout)
        live = [s for s in self.ps + self.ds if s.proc.poll() is None]
        v0 = self.view()
        base = {s.port: self.inst(s, v0)["pulls"] for s in live}

        def settled():
            v = self.view()
            for s in live:
                x = self.inst(s, v)
                ld = x["load"]
                if not (x["pulls"] >= base[s.port] + 2 and x["ready"] and x["in_flight"] == 0
                        and x["pending_blocks"] == 0 and x["pending_prefill"] == 0
                        and ld["running"] == 0 and ld["waiting"] == 0
                        and ld["queued_prefill_tokens"] == 0 and ld["kv"]["used"] == 0):
                    return False
            return True

        wait_until(settled, timeout=timeout, what="the router's view of every instance idle",
                   proc=self.router.proc)

    def close(self):
        for s in [self.router] + self.ds + self.ps:
            if s is not None:
                s.close()


class Front:
    """The public API under test, the same tests for both shapes:
    kind "serve": one `tandem serve`; kind "router": a tandem-router over
    one prefill and one decode instance (a Cluster).
      .api    the Server that takes the requests (serve, or the router);
              host, port, grpc_port, base_url, proc, request, post_json,
              get_json, open_stream, metrics and log_tail are its own
      .inst   where the scheduler runs (serve, or the decode instance):
              scheduler gauges and counters, KV blocks, /internal/v1/state
      .insts  every instance (serve; or decode and prefill)
      .cluster  the Cluster (None for serve)
    wait_idle() waits for every instance (and the router) to be idle;
    stop() stops the router first, then the instances: 0 when every
    process exited 0, else the first other status; close() kills all."""

    def __init__(self, kind, api, insts, cluster=None):
        self.kind, self.api, self.insts, self.cluster = kind, api, list(insts), cluster
        self.inst = self.insts[0]

    @classmethod
    def serve(cls, server):
        return cls("serve", server, [server])

    @classmethod
    def router(cls, cluster):
        return cls("router", cluster.router, cluster.ds + cluster.ps, cluster)

    @property
    def routed(self):
        return self.kind == "router"

    def __getattr__(self, name):
        if name in ("host", "port", "grpc_port", "base_url", "proc", "request", "post_json",
                    "get_json", "open_stream", "metrics", "log_tail", "err_path"):
            return getattr(self.api, name)
        raise AttributeError(name)

    def state(self, since=None):
        return self.inst.state(since)

    def blocks(self):
        return self.inst.blocks()

    def wait_idle(self, timeout=10):
        if self.cluster is not None:
            return self.cluster.wait_idle(timeout)
        return self.api.wait_idle(timeout)

    def logs(self, n=3000):
        """Every process's stderr tail, labelled (for failure messages)."""
        procs = [self.api] + ([s for s in self.insts if s is not self.api])
        return "\n".join(f"--- {' '.join(s.argv[:1])}\n{s.log_tail(n)}" for s in procs)

    def stop(self, sig=signal.SIGTERM, timeout=30):
        rcs = [self.api.stop(sig, timeout)]
        rcs += [s.stop(sig, timeout) for s in self.insts if s is not self.api]
        return next((rc for rc in rcs if rc != 0), 0)

    def close(self):
        if self.cluster is not None:
            self.cluster.close()
        else:
            self.api.close()
