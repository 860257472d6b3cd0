#!/usr/bin/env python3
"""Chaos soak: a disaggregated cluster under steady load while faults are
injected on a schedule drawn from a seed; every request's outcome checked.

The cluster (one compute thread each): two prefill instances
(tandem-prefill), two decode instances (tandem-decode, --prefill both, a
3 s start deadline and a 1.5 s lease, a pool of --kv-blocks blocks), and a
tandem-router over all four, on loopback except for prefill1 with the
"cut" fault: it then runs in a network namespace of its own joined by a
veth pair, with UCX over TCP on it (prefill0 keeps shared memory). With
the "dns" fault the decode instances find the prefill instances by name
(prefillI.chaos.test, --dns-interval 1 s) through a DNS server of the
soak's (127.77.0.53, each decode instance in a mount namespace whose
/etc/resolv.conf names only it). Fixed ports, so a killed instance
restarts where it was (a new epoch). The load: two `tandem bench` runs
against the router for the whole duration, Poisson arrivals with a fixed
seed, one greedy and one with seeded sampling (--request-seed), random
prompts of 64-400 tokens and 8-32 output tokens, each request's body and
streamed text recorded (--record-text).

Faults (kinds, a time for each drawn from --seed over 10%-85% of the run,
at least 12 s apart; --faults picks the kinds, repeated to fill longer
runs):
  stop        SIGSTOP a prefill or decode instance for 6 s (past D's start
              deadline and two leases), then SIGCONT;
  kill        SIGKILL a prefill or decode instance, restart it 2 s later
              on the same port (a new epoch);
              (both once the instance has work in flight, or after 10 s)
  disconnect  three clients drop their stream after its first token, three
              before it (mid-prefill);
  burst       three times the steady rate for 5 s, on top of it;
  kv          eight long requests straight at decode instance 1, more than
              its pool holds at once (it queues or preempts);
  cut         prefill1's end of its veth down for 6 s, then up (this side's
              neighbour entry pinned: packets to it vanish silently, as
              behind a cut beyond the first hop, past the start deadline
              and the leases);
  dns         every DNS answer 4 s late for 12 s (the decode instances
              resolve the prefill names every second).
The cut and dns kinds need root (namespaces, port 53) and dnspython.

Checks, each a line of the summary (exit status 1 when one fails):
  - every request (the bench runs', the burst's, the kv fault's) either
    completed with the text a colocated `tandem serve` gives for the same
    body (greedy and seeded sampling), or failed cleanly: an HTTP error
    status before the first token, or an error event in the stream after
    it. A truncated stream, a dropped connection or a wrong token fails;
  - after the schedule every instance returns to idle: no KV block used or
    reserved, no request running or waiting, no transfer in flight, no
    leased, quarantined or held block (/internal/v1/state);
  - canaries: prompts sent twice after the faults (the second time read
    from the blocks the first wrote, which reuse blocks the faults
    freed) answer as the reference does;
  - no instance holds more file descriptors at the end than after its
    warm-up (plus --fd-slack), and none grew over the canary round;
  - after every process exited, no /dev/shm file the cluster's processes
    mapped and no SysV shared-memory segment they created (ipcs -m -p) is
    left (other processes on the machine are left out).
The outcomes are printed per source (the two loads, the burst, the kv
fault, the canaries) and per fault kind (the requests in flight during a
fault or within 3 s after it; "none": during none).

Usage:
  tools/bench/chaos.py --bin-dir build --model PATH [--duration 180]
      [--seed 1] [--rate 1.0] [--out DIR] [--json OUT]
"""

import argparse
import concurrent.futures as cf
import http.client
import json
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

TOKEN = "chaos-soak-cluster-token"
READY_RE = re.compile(r"^(?:tandem serve|tandem-prefill|tandem-decode|tandem-router): "
                      r"listening http=(\S+) grpc=(\S+)")
KINDS = ("stop", "kill", "disconnect", "burst", "kv", "cut", "dns")
CLEAN = re.compile(r"^(http_\d+|stream_error)$")
OUTCOMES = ("correct", "wrong", "clean_error", "unclean")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Inst:
    """One process of the cluster: started (and restarted) with the same
    argv and ports."""

    def __init__(self, name, argv, port, log_dir, env=None, host="127.0.0.1"):
        self.name, self.argv, self.port, self.host = name, [str(a) for a in argv], port, host
        self.log_dir = pathlib.Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, **(env or {}))
        self.proc = None
        self.starts = 0
        self.fd_base = None

    def start(self, timeout=120):
        self.starts += 1
        out = self.log_dir / f"{self.name}-{self.starts}.out"
        err = self.log_dir / f"{self.name}-{self.starts}.err"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=fo,
                                         stderr=fe, env=self.env, start_new_session=True)
        self.err_path = err
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(READY_RE.match(ln) for ln in out.read_text(errors="replace").splitlines()):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before ready:\n"
                                   + err.read_text(errors="replace")[-3000:])
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready after {timeout} s")

    def signal(self, sig):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout=60):
        """SIGTERM (drain), then SIGKILL; returns the exit status."""
        if not self.proc:
            return None
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        return self.proc.returncode

    def http(self, method, path, body=None, headers=None, timeout=30):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def state(self):
        st, data = self.http("GET", "/internal/v1/state",
                             headers={"X-Tandem-Cluster-Token": TOKEN})
        if st != 200:
            raise RuntimeError(f"{self.name}: /internal/v1/state {st}")
        return json.loads(data)

    def busy(self):
        """What keeps the instance from idle (empty: idle)."""
        st = self.state()
        load, kv, xf = st["load"], st["load"]["kv"], st.get("transfer", {})
        figs = {"running": load["running"], "waiting": load["waiting"], "kv_used": kv["used"],
                "kv_reserved": kv["reserved"]}
        for k in ("in_flight", "leased_blocks", "quarantined_blocks", "held_blocks",
                  "awaiting_consume"):
            figs[k] = xf.get(k, 0)
        return {k: v for k, v in figs.items() if v}

    def fds(self):
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def log(self):
        return "".join(p.read_text(errors="replace")
                       for p in sorted(self.log_dir.glob(f"{self.name}-*.err")))


class Cluster:
    """n_p prefill and n_d decode instances (one compute thread each, the
    decode instances' --prefill naming every prefill instance) and a
    tandem-router over them, on loopback with fixed ports; d_args and
    r_args: the decode instances' and the router's extra arguments."""

    def __init__(self, bin_dir, model, n_p, n_d, out, d_args=(), r_args=(), net=None, dns=None):
        """net: a Netns the last prefill instance runs in (its HTTP and KV
        endpoints on the namespace's address, UCX over TCP on its veth);
        dns: a SlowDns through which the decode instances find the prefill
        instances by name (prefillI.chaos.test)."""
        b = pathlib.Path(bin_dir)
        self.ps, self.ds = [], []
        for i in range(n_p):
            port = free_port()
            argv = [b / "tandem-prefill", "--model", model, "--threads", 1, "--cluster-token",
                    TOKEN, "--port", port]
            host, env = "127.0.0.1", None
            if net and i == n_p - 1:
                host, env = net.addr, net.env
                argv = net.prefix + argv + ["--host", host, "--kv-listen", host]
            self.ps.append(Inst(f"prefill{i}", argv, port, out, env=env, host=host))
            if dns:
                dns.names[f"prefill{i}.chaos.test."] = host
        plist = ",".join(f"{p.host}:{p.port}" for p in self.ps)
        dlist = ",".join(f"prefill{i}.chaos.test:{p.port}" for i, p in enumerate(self.ps))
        for i in range(n_d):
            port = free_port()
            self.ds.append(Inst(f"decode{i}", [
                *(dns.prefix if dns else []),
                b / "tandem-decode", "--model", model, "--threads", 1, "--cluster-token", TOKEN,
                "--port", port, "--grpc-port", free_port(), "--prefill", dlist if dns else plist,
                *d_args], port, out))
        rport = free_port()
        self.router = Inst("router", [
            b / "tandem-router", "--model", model, "--cluster-token", TOKEN, "--port", rport,
            "--grpc-port", -1, "--prefill", plist,
            "--decode", ",".join(f"127.0.0.1:{d.port}" for d in self.ds),
            "--poll-interval-ms", 100, *r_args], rport, out)
        self.insts = self.ps + self.ds

    def start(self):
        for x in self.insts + [self.router]:
            x.start()

    def stop(self):
        for x in [self.router] + self.ds + self.ps:  # the decode instances before their peers
            x.stop()

    def wait_linked(self, timeout=60):
        """Whether every decode instance linked every prefill instance in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if all(sum(p["ready"] for p in d.state()["transfer"]["peers"]) == len(self.ps)
                       for d in self.ds):
                    return True
            except (OSError, RuntimeError, KeyError, ValueError, http.client.HTTPException):
                pass
            time.sleep(0.2)
        return False

    def wait_idle(self, timeout):
        """None once every instance is idle; what keeps them busy at the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            busy = {}
            for x in self.insts:
                try:
                    b = x.busy()
                except (OSError, RuntimeError, http.client.HTTPException, ValueError) as e:
                    b = {"error": repr(e)}
                if b:
                    busy[x.name] = b
            if not busy:
                return None
            if time.monotonic() > deadline:
                return busy
            time.sleep(0.2)

    def fences(self):
        """The decode instances' fences of a prefill instance so far, by name."""
        return {d.name: len(re.findall(r"fencing it", d.log())) for d in self.ds}


def ip(*args, check=True):
    r = subprocess.run(["ip", *map(str, args)], capture_output=True, text=True, timeout=20)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(map(str, args))}: exit {r.returncode}: "
                           f"{r.stderr.strip()}")
    return r


class Netns:
    """A network namespace joined to this one by a veth pair (a private
    /30 from the pid: 10.204.A.B+1 inside, +2 here). An instance started
    with .prefix (`ip netns exec`) and .env (UCX over TCP on the veth only:
    shared memory would bypass a cut) is reached at .addr. cut() takes the
    namespace's end down (packets to it vanish; this side's neighbour entry
    is pinned so that they vanish silently instead of failing the ARP
    resolution), restore() brings it back."""

    def __init__(self):
        pid = os.getpid()
        a, b = (pid // 64) % 256, (pid % 64) * 4
        self.ns, self.dev, self.peer = f"tdc-{pid}", f"tdcn{pid}", f"tdch{pid}"
        self.addr, self.here = f"10.204.{a}.{b + 1}", f"10.204.{a}.{b + 2}"
        self.prefix = ["ip", "netns", "exec", self.ns]
        self.env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.dev}
        self.made = False

    def create(self):
        ip("netns", "add", self.ns)
        self.made = True
        ip("link", "add", self.dev, "type", "veth", "peer", "name", self.peer)
        ip("link", "set", self.dev, "netns", self.ns)
        ip("-n", self.ns, "addr", "add", f"{self.addr}/30", "dev", self.dev)
        ip("addr", "add", f"{self.here}/30", "dev", self.peer)
        for args in (("-n", self.ns, "link", "set", self.dev, "up"),
                     ("-n", self.ns, "link", "set", "lo", "up"), ("link", "set", self.peer, "up")):
            ip(*args)

    def pin(self):
        mac = json.loads(ip("-n", self.ns, "-j", "link", "show", "dev", self.dev).stdout)[0]
        ip("neigh", "replace", self.addr, "lladdr", mac["address"], "dev", self.peer, "nud",
           "permanent")

    def cut(self):
        self.pin()
        ip("-n", self.ns, "link", "set", "dev", self.dev, "down")

    def restore(self):
        ip("-n", self.ns, "link", "set", "dev", self.dev, "up")

    def destroy(self):
        """Kills what is left inside (only ours can be), deletes the
        namespace (the veth pair goes with it)."""
        if not self.made:
            return
        r = ip("netns", "pids", self.ns, check=False)
        for pid in r.stdout.split() if r.returncode == 0 else []:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        ip("netns", "del", self.ns, check=False)
        ip("link", "del", self.peer, check=False)


class SlowDns:
    """A DNS server for the names in .names (A records; every other
    question: NXDOMAIN, AAAA: no answer) on 127.77.0.53:53 whose answers
    take .delay seconds (0 normally; the "dns" fault makes them slow). A
    process started with .prefix sees it as its only name server: its own
    mount namespace with a resolv.conf bound over /etc/resolv.conf."""

    def __init__(self, out):
        import dns.message  # dnspython: parsing and answers
        import dns.rcode
        import dns.rdatatype
        import dns.rrset
        self.dns = dns
        self.names, self.delay, self.queries = {}, 0.0, 0
        self.addr = "127.77.0.53"
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((self.addr, 53))
        self.sock.settimeout(0.5)
        self.stopped = False
        conf = pathlib.Path(out) / "resolv.conf"
        conf.write_text(f"nameserver {self.addr}\noptions timeout:5 attempts:1\n")
        self.prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                       'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(conf)]
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def answer(self, wire, peer, delay):
        d = self.dns
        if delay:
            time.sleep(delay)
        try:
            q = d.message.from_wire(wire)
        except Exception:  # noqa: BLE001 - not ours to answer
            return
        r = d.message.make_response(q)
        for question in q.question:
            name = question.name.to_text().lower()
            if name not in self.names:
                r.set_rcode(d.rcode.NXDOMAIN)
            elif question.rdtype == d.rdatatype.A:
                r.answer.append(d.rrset.from_text(name, 1, "IN", "A", self.names[name]))
        try:
            self.sock.sendto(r.to_wire(), peer)
        except OSError:
            pass

    def loop(self):
        while not self.stopped:
            try:
                wire, peer = self.sock.recvfrom(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            self.queries += 1
            threading.Thread(target=self.answer, args=(wire, peer, self.delay),
                             daemon=True).start()

    def close(self):
        self.stopped = True
        self.thread.join()
        self.sock.close()


class ShmWatch:
    """Which shared memory the cluster's processes used: every 1 s, the
    /dev/shm files each maps (/proc/PID/maps) and every pid seen. Other
    processes on the machine (tests running beside this one) are left
    out: what is left after ours exited is what ours leaked."""

    def __init__(self, procs):
        self.procs, self.names, self.pids = procs, set(), set()
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def sample(self):
        for x in self.procs():
            if not x.proc or x.proc.poll() is not None:
                continue
            self.pids.add(x.proc.pid)
            try:
                with open(f"/proc/{x.proc.pid}/maps") as f:
                    for ln in f:
                        m = re.search(r"/dev/shm/(\S+)", ln)
                        if m:
                            self.names.add(m.group(1))
            except OSError:
                pass

    def loop(self):
        while not self.stop_ev.wait(1.0):
            self.sample()

    def left(self):
        """(/dev/shm files ours mapped that still exist, SysV segments ours
        created that still exist), once every process of ours exited."""
        self.stop_ev.set()
        self.thread.join()
        shm = sorted(self.names & set(os.listdir("/dev/shm")))
        out = subprocess.run(["ipcs", "-m", "-p"], capture_output=True, text=True,
                             check=False).stdout
        sysv = sorted(f[0] for f in (ln.split() for ln in out.splitlines())
                      if len(f) >= 4 and f[0].isdigit() and f[2].isdigit()
                      and int(f[2]) in self.pids)
        return shm, sysv


def stream_request(port, body, drop=None, timeout=120):
    """One streamed completion: (status, text, error_kind). drop: "first"
    drops the connection after the first text, a float drops it after
    that many seconds without reading (mid-prefill)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    body = dict(body, stream=True)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        if isinstance(drop, float):
            time.sleep(drop)
            return None, "", "dropped"
        r = conn.getresponse()
        if r.status != 200:
            r.read()
            return r.status, "", f"http_{r.status}"
        text, done = [], False
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            obj = json.loads(payload)
            if obj.get("error") is not None:
                return 200, "".join(text), "stream_error"
            for ch in obj.get("choices") or []:
                text.append(ch.get("text") or "")
            if drop == "first" and "".join(text):
                return 200, "".join(text), "dropped"
        return 200, "".join(text), None if done else "incomplete_stream"
    except (OSError, http.client.HTTPException) as e:
        return None, "", f"connection: {e!r}"
    finally:
        conn.close()


def words_prompt(rng, n):
    """A prompt of about n tokens of common words (the model's tokenizer
    makes about one token of each)."""
    words = ("the of and to in is was for on that with as by at from his an were are which "
             "this be or has had not but first one their its new after who they have two her "
             "she been other when there all during into school time may years more most only "
             "over city some world would where later up such used many can state about").split()
    return " ".join(rng.choice(words) for _ in range(n))


class Soak:
    def __init__(self, a):
        self.a = a
        self.rng = random.Random(a.seed)
        self.out = pathlib.Path(a.out or tempfile.mkdtemp(prefix="tandem-chaos-"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.bin = pathlib.Path(a.bin_dir)
        self.extra = []  # (body, status, text, error_kind, what, start, end): the soak's own
        self.lock = threading.Lock()
        self.faults = []  # (t, kind, target, detail, t_end)
        self.t0 = time.monotonic()  # the load's start (soak seconds count from it)
        self.failures = []

    # ---------------------------------------------------------------- cluster

    def make_cluster(self):
        a = self.a
        kinds = a.faults.split(",")
        if "cut" in kinds:
            self.net = Netns()
            self.net.create()
        if "dns" in kinds:
            self.dns = SlowDns(self.out)
        self.cluster = Cluster(
            self.bin, a.model, 2, 2, self.out,
            d_args=["--transfer-deadline-ms", 3000, "--lease-ms", 1500, "--kv-blocks", a.kv_blocks,
                    "--dns-interval", 1],
            r_args=["--max-queued", 64, "--queue-timeout", 60,
                    # prompts under 128 uncached tokens prefill on D, the rest on P
                    "--local-prefill-threshold", 128, "--local-prefill-max-tokens", 0],
            net=self.net, dns=self.dns)
        c = self.cluster
        self.ps, self.ds, self.insts, self.router = c.ps, c.ds, c.insts, c.router
        c.start()

    # ---------------------------------------------------------------- faults

    def schedule(self):
        a = self.a
        kinds = [k for k in a.faults.split(",") if k]
        for k in kinds:
            if k not in KINDS:
                raise SystemExit(f"chaos: unknown fault kind {k!r} (known: {', '.join(KINDS)})")
        lo, hi = 0.10 * a.duration, 0.85 * a.duration
        n = max(len(kinds), int((hi - lo) // 20))
        plan = [kinds[i % len(kinds)] for i in range(n)]
        self.rng.shuffle(plan)
        slot = (hi - lo) / n
        out = []
        for i, k in enumerate(plan):
            t = lo + i * slot + self.rng.uniform(0, max(0.0, slot - 12))
            out.append((t, k))
        return out

    def during(self, start, end):
        """The fault kinds a request from start to end (soak seconds) was in
        flight during (a fault's window: from its start to 3 s after its
        end), or ["none"]."""
        kinds = sorted({k for t, k, _, _, t_end in self.faults
                        if start <= t_end + 3 and end >= t})
        return kinds or ["none"]

    def now(self):
        return time.monotonic() - self.t0

    def record(self, body, res, what, start):
        with self.lock:
            self.extra.append((body, res[0], res[1], res[2], what, start, self.now()))

    def body(self, n_prompt, max_tokens, sampled):
        b = {"prompt": words_prompt(self.rng, n_prompt), "max_tokens": max_tokens,
             "temperature": 0.8 if sampled else 0, "ignore_eos": True, "min_tokens": max_tokens}
        if sampled:
            b["seed"] = self.rng.randrange(1 << 30)
        return b

    def fault(self, kind):
        rng = self.rng
        if kind in ("stop", "kill"):
            x = rng.choice(self.insts)
            # when it has work in flight (a prefill job, a running request),
            # waiting at most 10 s
            until = time.monotonic() + 10
            while time.monotonic() < until:
                try:
                    st = x.state()
                    if st.get("transfer", {}).get("in_flight", 0) or st["load"]["running"]:
                        break
                except (OSError, RuntimeError, KeyError, ValueError, http.client.HTTPException):
                    pass
                time.sleep(0.05)
            if kind == "stop":
                x.signal(signal.SIGSTOP)
                time.sleep(6)
                x.signal(signal.SIGCONT)
                return x.name, "SIGSTOP, SIGCONT 6 s later"
            self.shm.sample()  # what it maps, before it goes
            x.signal(signal.SIGKILL)
            x.proc.wait()
            time.sleep(2)
            x.start()
            x.fd_base = None  # a new process: no baseline from the warm-up
            return x.name, "SIGKILL, restarted 2 s later (a new epoch)"
        if kind == "disconnect":
            bodies = [(self.body(rng.randrange(200, 400), 32, False), "first") for _ in range(3)]
            bodies += [(self.body(rng.randrange(300, 400), 16, False), rng.uniform(0.05, 0.3))
                       for _ in range(3)]
            with cf.ThreadPoolExecutor(6) as ex:
                list(ex.map(lambda bd: stream_request(self.router.port, bd[0], bd[1]), bodies))
            return "router", "3 after the first token, 3 mid-prefill"
        if kind == "burst":
            n = max(3, int(3 * 2 * self.a.rate * 5))  # 3x both bench runs' rate, 5 s
            bodies = [self.body(rng.randrange(64, 400), rng.randrange(8, 33), i % 2 == 1)
                      for i in range(n)]

            def one(i):
                time.sleep(5.0 * i / n)
                t = self.now()
                self.record(bodies[i], stream_request(self.router.port, bodies[i]), "burst", t)
            with cf.ThreadPoolExecutor(n) as ex:
                list(ex.map(one, range(n)))
            return "router", f"{n} requests over 5 s"
        if kind == "cut":
            self.net.cut()
            time.sleep(6)
            self.net.restore()
            return self.ps[-1].name, "its veth down 6 s (packets vanish), then up"
        if kind == "dns":
            q0 = self.dns.queries
            self.dns.delay = 4.0
            time.sleep(12)
            self.dns.delay = 0.0
            return "decode*", f"every DNS answer 4 s late for 12 s ({self.dns.queries - q0} queries)"
        if kind == "kv":
            d = self.ds[1]
            bodies = [self.body(rng.randrange(600, 800), 300, i % 2 == 1) for i in range(8)]
            t = self.now()
            with cf.ThreadPoolExecutor(8) as ex:
                res = list(ex.map(lambda bd: stream_request(d.port, bd, timeout=600), bodies))
            for bd, r in zip(bodies, res):
                self.record(bd, r, "kv", t)
            return d.name, "8 x ~700 prompt + 300 output tokens"
        raise AssertionError(kind)

    def run_faults(self, plan):
        for t, kind in plan:
            wait = t - self.now()
            if wait > 0:
                time.sleep(wait)
            t_at = self.now()
            try:
                target, detail = self.fault(kind)
            except Exception as e:  # noqa: BLE001 - a fault that could not run is a failure
                target, detail = "?", f"could not run: {e!r}"
                self.failures.append(f"fault {kind} at {t_at:.0f} s: {e!r}")
            self.faults.append((round(t_at, 1), kind, target, detail, round(self.now(), 1)))
            print(f"chaos: {t_at:6.1f} s  {kind:<10} {target:<9} {detail}", flush=True)

    # ---------------------------------------------------------------- run

    def bench(self, name, extra):
        a = self.a
        n = max(1, int(a.rate * a.duration))
        cmd = [self.bin / "tandem", "bench", "--url", f"http://127.0.0.1:{self.router.port}",
               "--num-prompts", n, "--request-rate", a.rate, "--input-len", "64:400",
               "--output-len", "8:32", "--seed", a.seed, "--timeout", 300, "--no-progress",
               "--record-text", "--json", self.out / f"{name}.json", *extra]
        return subprocess.Popen([str(c) for c in cmd], stdout=open(self.out / f"{name}.out", "w"),
                                stderr=subprocess.STDOUT)

    def reference(self, bodies):
        """The colocated instance's text for each body (non-streamed)."""
        port = free_port()
        ref = Inst("reference", [self.bin / "tandem", "serve", "--model", self.a.model,
                                 "--threads", os.cpu_count() or 1, "--port", port,
                                 "--grpc-port", -1, "--kv-blocks", 1024], port, self.out)
        ref.start()

        def one(b):
            b = {k: v for k, v in b.items() if k not in ("stream", "stream_options")}
            st, data = ref.http("POST", "/v1/completions", json.dumps(b).encode(),
                                {"Content-Type": "application/json"}, timeout=600)
            if st != 200:
                raise RuntimeError(f"reference: {st} {data[:300]!r}")
            return json.loads(data)["choices"][0]["text"]
        try:
            with cf.ThreadPoolExecutor(8) as ex:
                return list(ex.map(one, bodies))
        finally:
            ref.stop()

    def main(self):
        self.cluster = self.net = self.dns = None
        self.shm = ShmWatch(lambda: self.cluster.insts + [self.cluster.router]
                            if self.cluster else [])
        try:
            self.make_cluster()
            return self.soak()
        finally:
            if self.cluster:
                self.cluster.stop()
            if self.net:
                self.net.destroy()
            if self.dns:
                self.dns.close()

    def soak(self):
        a = self.a
        if not self.cluster.wait_linked():
            self.failures.append("the decode instances did not link to both prefill instances")
            return self.report({})
        # warm-up: every pair once (D round-robins its P), and the router
        for port in [d.port for d in self.ds for _ in range(2)] + [self.router.port] * 2:
            r = stream_request(port, self.body(300, 4, False), timeout=300)
            if r[2]:
                self.failures.append(f"warm-up request failed: {r}")
        if self.cluster.wait_idle(60):
            self.failures.append("not idle after the warm-up")
        for x in self.insts:
            x.fd_base = x.fds()
        plan = self.schedule()
        self.t0 = time.monotonic()
        runs = [self.bench("greedy", []),
                self.bench("sampled", ["--temperature", 0.8, "--request-seed", 1000,
                                       "--seed", a.seed + 1])]
        self.run_faults(plan)
        for r in runs:
            r.wait()
        t_load = self.now()
        # every instance back at idle
        busy = self.cluster.wait_idle(120)
        if busy:
            self.failures.append(f"not idle after the schedule: {busy}")
        fd_end = {x.name: x.fds() for x in self.insts}
        # canaries: each twice (the second reads the blocks the first wrote)
        canaries = [self.body(rng_n, 16, False) for rng_n in (380, 300, 220, 350)]
        canary_out = []
        for _ in range(2):
            canary_out.append([stream_request(self.router.port, c) for c in canaries])
        busy = self.cluster.wait_idle(60)
        if busy:
            self.failures.append(f"not idle after the canaries: {busy}")
        fd_after = {x.name: x.fds() for x in self.insts}
        # the outcomes
        records = []
        for name in ("greedy", "sampled"):
            try:
                rep = json.loads((self.out / f"{name}.json").read_text())
            except (OSError, ValueError) as e:
                self.failures.append(f"bench {name}: no report ({e!r}): "
                                     + (self.out / f"{name}.out").read_text()[-2000:])
                continue
            for r in rep["requests"]:  # both runs started at self.t0 (within ms)
                start = r["start_s"]
                records.append((r["body"], 200 if r["success"] else None, r.get("text", ""),
                                None if r["success"] else r["error_kind"], name, start,
                                start + (r.get("e2e_ms") or 0) / 1e3))
        records += self.extra
        for rnd in canary_out:
            for c, res in zip(canaries, rnd):
                records.append((c, res[0], res[1], res[2], "canary", None, None))
        done = [r for r in records if r[3] is None]
        want = dict(zip(map(id, done), self.reference([r[0] for r in done])))
        table, by_fault = {}, {}
        for r in records:
            if r[3] is None:
                how = "correct" if r[2] == want[id(r)] else "wrong"
                if how == "wrong":
                    self.failures.append(f"{r[4]}: wrong answer for {json.dumps(r[0])[:200]}: "
                                         f"got {r[2][:80]!r}, the reference {want[id(r)][:80]!r}")
            else:
                how = "clean_error" if CLEAN.match(r[3]) else "unclean"
                if how == "unclean":
                    self.failures.append(f"{r[4]}: unclean failure {r[3]!r}")
            table.setdefault(r[4], dict.fromkeys(OUTCOMES, 0))[how] += 1
            for row in self.during(r[5], r[6]) if r[5] is not None else ["after (canaries)"]:
                by_fault.setdefault(row, dict.fromkeys(OUTCOMES, 0))[how] += 1
        for x in self.insts:
            if x.fd_base is not None and fd_end[x.name] > x.fd_base + a.fd_slack:
                self.failures.append(f"{x.name}: {fd_end[x.name]} fds at the end, "
                                     f"{x.fd_base} after the warm-up")
            if fd_after[x.name] > fd_end[x.name] + a.fd_slack:
                self.failures.append(f"{x.name}: fds grew over the canaries "
                                     f"({fd_end[x.name]} -> {fd_after[x.name]})")
        fences = self.cluster.fences()
        blocks = {}
        for x in self.insts:
            try:
                st = x.state()
                blocks[x.name] = {"kv": st["load"]["kv"], "transfer": {
                    k: st.get("transfer", {}).get(k) for k in (
                        "in_flight", "leased_blocks", "quarantined_blocks", "held_blocks")}}
            except (OSError, RuntimeError, ValueError, http.client.HTTPException) as e:
                blocks[x.name] = repr(e)
        self.shm.sample()
        self.cluster.stop()
        leaked_shm, leaked_sysv = self.shm.left()
        if leaked_shm or leaked_sysv:
            self.failures.append(f"shared memory left behind: /dev/shm {leaked_shm}, "
                                 f"SysV {leaked_sysv}")
        return self.report({"load_s": round(t_load, 1), "outcomes": table,
                            "outcomes_by_fault": by_fault, "blocks": blocks,
                            "shm_watched": {"dev_shm_files": len(self.shm.names),
                                            "processes": len(self.shm.pids)},
                            "fds": {x.name: {"after_warmup": x.fd_base, "end": fd_end[x.name],
                                             "after_canaries": fd_after[x.name],
                                             "starts": x.starts} for x in self.insts},
                            "fences": fences, "shm_left": leaked_shm, "sysv_left": leaked_sysv})

    def report(self, figs):
        out = {"duration_s": self.a.duration, "seed": self.a.seed, "rate": self.a.rate,
               "faults": [{"t_s": t, "kind": k, "target": x, "detail": d, "end_s": e}
                          for t, k, x, d, e in self.faults],
               **figs, "failures": self.failures, "ok": not self.failures, "logs": str(self.out)}
        if self.a.json:
            pathlib.Path(self.a.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"\nchaos soak: {len(self.faults)} faults over {self.a.duration:.0f} s "
              f"(seed {self.a.seed}), logs in {self.out}")
        for t, k, x, d, _ in self.faults:
            print(f"  {t:6.1f} s  {k:<10} {x:<9} {d}")
        for key, title in (("outcomes", "requests"), ("outcomes_by_fault", "during fault")):
            if not figs.get(key):
                continue
            print(f"  {title:<17} {'correct':>8} {'wrong':>6} {'clean err':>10} {'unclean':>8}")
            for k, row in sorted(figs[key].items()):
                print(f"  {k:<17} {row['correct']:>8} {row['wrong']:>6} "
                      f"{row['clean_error']:>10} {row['unclean']:>8}")
        for name, b in figs.get("blocks", {}).items():
            print(f"  {name}: {b}")
        if "fds" in figs:
            print("  fds:", {k: (v["after_warmup"], v["end"], v["after_canaries"])
                             for k, v in figs["fds"].items()})
            print("  fences of a prefill instance by D:", figs["fences"])
            print(f"  shared memory: {figs['shm_watched']['dev_shm_files']} /dev/shm files "
                  f"mapped by {figs['shm_watched']['processes']} processes; left after they "
                  f"exited: /dev/shm {figs['shm_left']}, SysV {figs['sysv_left']}")
        for f in self.failures:
            print("FAIL:", f)
        print("chaos soak:", "ok" if not self.failures else f"{len(self.failures)} failures")
        return 0 if not self.failures else 1


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin-dir", required=True, help="the build directory (tandem, tandem-*)")
    p.add_argument("--model", required=True, help="the model every instance serves")
    p.add_argument("--duration", type=float, default=180, help="seconds of load (default 180)")
    p.add_argument("--seed", type=int, default=1, help="prompts, arrivals and the fault schedule")
    p.add_argument("--rate", type=float, default=0.5,
                   help="requests/s of each of the two bench runs (default 0.5)")
    p.add_argument("--faults", default=",".join(KINDS),
                   help=f"fault kinds, comma-separated (default {','.join(KINDS)})")
    p.add_argument("--kv-blocks", type=int, default=256,
                   help="the decode instances' KV pool in blocks (default 256)")
    p.add_argument("--fd-slack", type=int, default=8,
                   help="file descriptors an instance may hold beyond its warm-up count")
    p.add_argument("--out", help="logs and reports here (default: a new temporary directory)")
    p.add_argument("--json", help="write the summary as JSON here")
    a = p.parse_args(argv)
    needs_root = {"cut", "dns"} & set(a.faults.split(","))
    if needs_root and os.geteuid() != 0:
        raise SystemExit(f"chaos: the fault kinds {', '.join(sorted(needs_root))} need root "
                         "(network and mount namespaces, port 53): leave them out of --faults")
    # a SIGTERM (a CI timeout, a kill) unwinds like an error: every instance,
    # client, namespace and DNS server started is stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    return Soak(a).main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
