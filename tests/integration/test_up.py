"""`tandem up` (tools/cmd-up.c): a router, N prefill and M decode instances
on loopback, started from the binaries next to `tandem`; one ready line on
stdout once the router is ready and lists every instance as ready; SIGTERM
stops every child and exits 0; a child that dies stops the rest and makes
`up` exit 1; bad usage exits 2 with a message naming the flag. With
--colocated K, K `tandem serve` instances stand behind the router instead;
--cpus pins the instances, --prefill-arg/--decode-arg pass flags on."""

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
from openai import OpenAI

from conftest import manifest_model, register_log, run_tandem, scaled, wait_until

READY_RE = re.compile(r"^tandem up: ready http=http://(\S+):(\d+) grpc=(\S+):(\d+) "
                      r"\((?:prefill (\d+), decode (\d+)|colocated (\d+))\)$", re.M)
CHILD_RE = re.compile(r"^tandem up: (\S+) \(pid (\d+)\): (\S+)", re.M)
BINARY = {"prefill": "tandem-prefill", "decode": "tandem-decode", "router": "tandem-router",
          "colocated": "tandem"}


def alive(pid):
    """Whether pid is a live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def proc_stat(pid):
    """(ppid, pgid) of pid."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[2])


def cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]


class Up:
    """A running `tandem up` with its logs; close() stops it and every child
    it reported, even when the test failed."""

    def __init__(self, tandem_bin, log_dir, *args):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = log_dir / "up.out", log_dir / "up.err"
        self.argv = [str(tandem_bin), "up", *[str(a) for a in args]]
        with open(self.out_path, "wb") as fo, open(self.err_path, "wb") as fe:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=fo,
                                         stderr=fe, start_new_session=True)
        register_log("tandem up (and its instances, line by line)", self.err_path, self.proc)
        self.kids = {}

    def out(self):
        return self.out_path.read_text(errors="replace")

    def err(self):
        return self.err_path.read_text(errors="replace")

    def describe(self):
        return (f"$ {' '.join(self.argv)}\nexit {self.proc.poll()}\n--- stdout ---\n{self.out()}"
                f"\n--- stderr (tail) ---\n{self.err()[-6000:]}")

    def children(self):
        """{name: pid} of the children `up` reported starting."""
        self.kids.update({m.group(1): int(m.group(2)) for m in CHILD_RE.finditer(self.err())})
        return dict(self.kids)

    def wait_ready(self, timeout=60):
        deadline = time.monotonic() + scaled(timeout)
        while True:
            m = READY_RE.search(self.out())
            if m:
                self.children()
                return m
            if self.proc.poll() is not None:
                pytest.fail(f"tandem up exited before ready\n{self.describe()}")
            if time.monotonic() > deadline:
                pytest.fail(f"tandem up not ready after {scaled(timeout):.0f} s\n{self.describe()}")
            time.sleep(0.05)

    def wait_exit(self, timeout=60):
        try:
            return self.proc.wait(timeout=scaled(timeout))
        except subprocess.TimeoutExpired:
            pytest.fail(f"tandem up did not exit within {scaled(timeout):.0f} s\n{self.describe()}")

    def close(self):
        self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=scaled(30))
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for name, pid in self.kids.items():  # its own process group (see cmd-up.c)
            try:
                if alive(pid) and any(BINARY[name.split("-")[0]] in a for a in cmdline(pid)[:2]):
                    os.killpg(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass  # gone meanwhile


@pytest.fixture
def up(tandem_bin, tmp_path):
    ups = []

    def start(*args):
        u = Up(tandem_bin, tmp_path / f"up{len(ups)}", *args)
        ups.append(u)
        return u

    yield start
    for u in ups:
        u.close()


def http_get(host, port, path, headers=None):
    c = http.client.HTTPConnection(host, port, timeout=scaled(10))
    try:
        c.request("GET", path, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def test_usage_errors(tandem, manifest, test_models):
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    for args, flag in ((["--bogus"], "--bogus"), (["--prefill", "0"], "--prefill"),
                       (["--prefill", "17"], "--prefill"), (["--decode", "x"], "--decode"),
                       (["--port", "70000"], "--port"), (["--grpc-port", "-2"], "--grpc-port"),
                       (["--threads", "0"], "--threads"), (["--ready-timeout", "-1"],
                                                          "--ready-timeout"),
                       (["--drain-timeout", "nan"], "--drain-timeout"), (["--decode"], "--decode"),
                       (["--model", model, "--cluster-token-file", "/nonexistent/token"],
                        "/nonexistent/token"),
                       (["--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
                       (["--colocated", "2", "--prefill", "1"], "--colocated"),
                       (["--colocated", "0"], "--colocated"), (["--cpus", "1-0"], "--cpus"),
                       (["--cpus", "0,,1"], "--cpus"), (["--cpus", "x"], "--cpus"),
                       (["--kv-dtype", "q8_0"], "--kv-dtype")):
        r = tandem("up", *args, check=False, timeout=30)
        assert r.returncode == 2, r.describe()
        assert flag in r.stderr and r.stdout == "", r.describe()
    r = tandem("up", "--help")
    assert "tandem up: ready http=http://HOST:PORT" in r.stdout
    assert re.search(r"^  up +run a router", tandem("--help").stdout, re.M)


def test_missing_sibling(tandem_bin, manifest, test_models, tmp_path):
    """The services are looked up next to the running binary, with a clear
    error naming the one that is missing, before anything starts."""
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    lone = tmp_path / "bin" / "tandem"
    lone.parent.mkdir()
    shutil.copy2(tandem_bin, lone)
    r = run_tandem("up", "--model", model, "--port", "0", binary=lone, check=False, timeout=30)
    assert r.returncode == 1, r.describe()
    assert f"tandem-prefill not found next to tandem ({lone.parent}/tandem-prefill" in r.stderr
    assert "(pid" not in r.stderr and r.stdout == ""


def test_up_serves_and_stops(up, manifest, test_models):
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    u = up("--prefill", 1, "--decode", 2, "--model", model, "--port", 0, "--grpc-port", 0,
           "--threads", 1, "--ready-timeout", scaled(60))
    m = u.wait_ready()
    host, port, grpc_host, grpc_port = m.group(1), int(m.group(2)), m.group(3), int(m.group(4))
    assert (m.group(5), m.group(6)) == ("1", "2")
    assert port != 0 and grpc_port != 0 and port != grpc_port

    # the children: its own, each in its own process group, the right binary
    kids = u.children()
    assert sorted(kids) == ["decode-0", "decode-1", "prefill-0", "router"], u.describe()
    for name, pid in kids.items():
        ppid, pgid = proc_stat(pid)
        assert ppid == u.proc.pid and pgid == pid, (name, pid, ppid, pgid)
        argv = cmdline(pid)
        assert any(os.path.basename(a) == BINARY[name.split("-")[0]] for a in argv[:2]), argv
    # every child's output comes through behind its name
    err = u.err()
    for name in ("prefill-0", "decode-0", "decode-1"):
        assert re.search(rf"^\[{name}\] tandem-{name[:-2]}: listening http=127\.0\.0\.1:\d+", err,
                         re.M), err[-4000:]

    # a fresh token in a 0600 file that every child was given
    argv = cmdline(kids["router"])
    token_path = pathlib.Path(argv[argv.index("--cluster-token-file") + 1])
    assert token_path.stat().st_mode & 0o777 == 0o600
    token = token_path.read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    for pid in kids.values():
        a = cmdline(pid)
        assert a[a.index("--cluster-token-file") + 1] == str(token_path)

    # the router's own view agrees: one prefill and two decode instances, ready
    status, body = http_get(host, port, "/internal/v1/cluster",
                            {"X-Tandem-Cluster-Token": token})
    assert status == 200, body
    insts = json.loads(body)["instances"]
    assert sorted(i["role"] for i in insts) == ["decode", "decode", "prefill"]
    assert all(i["ready"] for i in insts), insts
    assert http_get(host, port, "/ready")[0] == 200

    # a completion through the router with a real client; gRPC listens too
    client = OpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused",
                    timeout=scaled(60), max_retries=0)
    name = client.models.list().data[0].id
    r = client.completions.create(model=name, prompt="The quick brown fox", max_tokens=6,
                                  temperature=0)
    assert 1 <= r.usage.completion_tokens <= 6 and r.usage.prompt_tokens > 0
    assert r.choices[0].finish_reason in ("length", "stop")
    socket.create_connection((grpc_host, grpc_port), timeout=scaled(5)).close()

    u.proc.send_signal(signal.SIGTERM)
    assert u.wait_exit() == 0, u.describe()
    for name, pid in kids.items():
        assert not alive(pid), f"{name} (pid {pid}) outlived tandem up\n{u.describe()}"
    assert not token_path.exists()
    assert "tandem up: stopped\n" in u.err(), u.describe()


def test_child_death_stops_everything(up, manifest, test_models, tmp_path):
    """A decode instance killed from outside: `up` stops the rest and exits 1
    naming it; a given token file is used as is and left in place."""
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    token_path = tmp_path / "token"
    token_path.write_text("a-given-token\n")
    u = up("--model", model, "--port", 0, "--grpc-port", 0, "--threads", 1,
           "--cluster-token-file", token_path, "--drain-timeout", 5)
    m = u.wait_ready()
    kids = u.children()
    assert sorted(kids) == ["decode-0", "prefill-0", "router"], u.describe()
    status, body = http_get(m.group(1), int(m.group(2)), "/internal/v1/cluster",
                            {"X-Tandem-Cluster-Token": "a-given-token"})
    assert status == 200, body
    os.kill(kids["decode-0"], signal.SIGKILL)
    assert u.wait_exit() == 1, u.describe()
    err = u.err()
    assert re.search(rf"tandem up: decode-0 \(tandem-decode, pid {kids['decode-0']}\) was killed "
                     r"by signal 9 \(Killed\) while the cluster was serving", err), err[-4000:]
    for name, pid in kids.items():
        assert not alive(pid), f"{name} (pid {pid}) outlived tandem up\n{u.describe()}"
    assert token_path.read_text() == "a-given-token\n"


def test_child_fails_to_start(up, tmp_path):
    """A model file the services cannot load: the first prefill instance
    exits before it listens, nothing else is started, `up` exits 1 naming it."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    u = up("--model", bad, "--port", 0, "--grpc-port", 0, "--threads", 1)
    assert u.wait_exit(30) == 1, u.describe()
    err = u.err()
    assert re.search(r"tandem up: prefill-0 \(tandem-prefill, pid \d+\) exited with status \d+ "
                     r"before it was listening", err), err[-4000:]
    assert sorted(u.children()) == ["prefill-0"]
    assert u.out() == ""
    wait_until(lambda: not any(alive(p) for p in u.children().values()), timeout=10,
               what="no child left")


def test_ready_timeout(up, manifest, test_models):
    """Readiness is bounded: a child is only seen listening after `up` has
    read its output, which cannot happen within 1 ms of starting it, so
    --ready-timeout 0.001 always runs out, in one of the pools' starts."""
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    u = up("--model", model, "--port", 0, "--grpc-port", 0, "--threads", 1,
           "--ready-timeout", "0.001")
    assert u.wait_exit(30) == 1, u.describe()
    err = u.err()
    assert re.search(r"^tandem up: (prefill|decode)-0 did not print its listening line within "
                     r"0\.001 s \(--ready-timeout\)$", err, re.M), err[-4000:]
    assert "router" not in u.children() and u.out() == ""
    wait_until(lambda: not any(alive(p) for p in u.children().values()), timeout=10,
               what="no child left")


def test_chat_once(tandem, manifest, test_models):
    """--chat: the README's main command. The answer through the router
    (greedy) equals `tandem generate --chat` (the engine in-process), and
    everything stops with exit 0."""
    model = next(test_models / m["path"] for m in manifest
                 if m["format"] == "gguf" and m["variant"] == "smollm2"
                 and m["wtype"] in ("F32", "f32"))
    r = tandem("up", "--model", model, "--port", "0", "--grpc-port", "0", "--threads", "1",
               "--chat", "What is the capital of France?", "--max-tokens", "12", timeout=120)
    first, answer = r.stdout.split("\n", 1)
    assert READY_RE.match(first), r.describe()
    ref = tandem("generate", "--model", model, "--chat", "What is the capital of France?",
                 "--max-tokens", "12", "--temperature", "0", "--threads", "1")
    assert answer == ref.stdout, r.describe()
    assert "tandem up: stopped\n" in r.stderr


def test_chat_once_kv_dtype(tandem, manifest, test_models):
    """--kv-dtype reaches every instance (both say so), so they pair (no
    link refused), and the answer equals `tandem generate` with the same
    cache."""
    model = next(test_models / m["path"] for m in manifest
                 if m["format"] == "gguf" and m["variant"] == "smollm2"
                 and m["wtype"] in ("F32", "f32"))
    r = tandem("up", "--model", model, "--port", "0", "--grpc-port", "0", "--threads", "1",
               "--kv-dtype", "bf16", "--chat", "What is the capital of France?",
               "--max-tokens", "12", timeout=120)
    first, answer = r.stdout.split("\n", 1)
    assert READY_RE.match(first), r.describe()
    for who in ("prefill-0", "decode-0"):
        assert re.search(rf"^\[{who}\] model: .*, KV cache bf16$", r.stderr, re.M), r.describe()
    ref = tandem("generate", "--model", model, "--chat", "What is the capital of France?",
                 "--max-tokens", "12", "--temperature", "0", "--threads", "1",
                 "--kv-dtype", "bf16")
    assert answer == ref.stdout, r.describe()
    assert "its KV cache holds" not in r.stderr, r.describe()


def cpus_allowed(pid):
    with open(f"/proc/{pid}/status") as f:
        return re.search(r"^Cpus_allowed_list:\s*(\S+)$", f.read(), re.M).group(1)


def test_up_colocated_pinned(up, manifest, test_models, tmp_path):
    """--colocated 2: two tandem serve instances behind the router, each on
    the core --cpus gives it (in start order, wrapping round), each with the
    --decode-arg flags ({i} its index)."""
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    n_cpu = os.cpu_count()
    cpus = [n_cpu - 1, 0]
    u = up("--colocated", 2, "--model", model, "--port", 0, "--grpc-port", 0, "--threads", 1,
           "--cpus", ",".join(map(str, cpus)), f"--decode-arg=--step-trace={tmp_path}/c{{i}}.jsonl",
           "--decode-arg=--max-running=3", "--ready-timeout", scaled(60))
    m = u.wait_ready()
    host, port = m.group(1), int(m.group(2))
    assert m.group(7) == "2"
    kids = u.children()
    assert sorted(kids) == ["colocated-0", "colocated-1", "router"], u.describe()
    for k in range(2):
        pid = kids[f"colocated-{k}"]
        argv = cmdline(pid)
        assert argv[1] == "serve" and os.path.basename(argv[0]) == "tandem", argv
        assert f"--step-trace={tmp_path}/c{k}.jsonl" in argv
        assert cpus_allowed(pid) == str(cpus[k])
    assert cpus_allowed(kids["router"]) == cpus_allowed(u.proc.pid)  # the router unpinned
    argv = cmdline(kids["router"])
    token = pathlib.Path(argv[argv.index("--cluster-token-file") + 1]).read_text().strip()
    status, body = http_get(host, port, "/internal/v1/cluster", {"X-Tandem-Cluster-Token": token})
    assert status == 200, body
    insts = json.loads(body)["instances"]
    assert [i["role"] for i in insts] == ["decode", "decode"] and all(i["ready"] for i in insts)

    client = OpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused",
                    timeout=scaled(60), max_retries=0)
    name = client.models.list().data[0].id
    for k in range(4):
        r = client.completions.create(model=name, prompt=f"Count to {k}", max_tokens=4,
                                      temperature=0)
        assert r.usage.completion_tokens >= 1
    u.proc.send_signal(signal.SIGTERM)
    assert u.wait_exit() == 0, u.describe()
    served = 0
    for k in range(2):
        lines = (tmp_path / f"c{k}.jsonl").read_text().splitlines()
        assert json.loads(lines[0])["max_running"] == 3
        served += sum(1 for x in lines[1:] for e in json.loads(x)["ev"] if e[0] == "in")
    assert served == 4
