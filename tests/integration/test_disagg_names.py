"""How a decode instance names its prefill instances (a
Kubernetes headless Service answers with one address per ready prefill
pod, and tandem-decode's manifest gives it that Service's name).

- Several names of one prefill instance (localhost and 127.0.0.1, a
  Service name and a pod IP) are one link: a second name is an alias of the
  linked one, both carry requests, none is fenced.
- A name with several addresses: every address is a prefill instance, each
  linked once and kept (no instance is taken for a restart of another); the
  router, resolving the same name, names them as D does; an address that
  leaves the name and goes down is fenced and then forgotten (the slots are
  bounded, an autoscaled pool keeps bringing new addresses); a new address
  is linked at the next resolution. Nothing leaks: every instance returns to
  idle.

The multi-address name is a hosts file bind-mounted over /etc/hosts in a
private mount namespace (`unshare -m`, root) of D and of the router only;
the prefill instances listen on 127.0.0.2..4, one port.
"""

import os
import socket
import time

import pytest

from conftest import manifest_model, wait_until
from grpc_stubs import load_stubs
from serve_util import (TOKEN, Server, metric, private_hosts, private_hosts_cmd,
                        write_hosts)
from test_disagg_internal import call, internal_generate

NAME = "tdprefill.test"


def peers(d):
    return {p["address"]: p for p in d.state()["transfer"]["peers"]}


def complete(srv, prompt, max_tokens=4):
    status, body = srv.post_json("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]


def transfers(srv):
    return metric(srv.metrics(), "tandem:kv_transfer_seconds_count")


def start_prefill(tandem_bin, model, log_dir, host="127.0.0.1", port=0):
    return Server.start(tandem_bin, model,
                        ["--cluster-token", TOKEN, "--threads", 1, "--host", host,
                         "--port", port],
                        log_dir, cmd=[tandem_bin.parent / "tandem-prefill"], cluster_token=TOKEN)


def test_two_names_one_link(manifest, test_models, tandem_bin, tmp_path, source_dir):
    """D is given `localhost:PORT`; the router's name for the same instance
    is 127.0.0.1:PORT (and a third request names it localhost:PORT)."""
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    p = start_prefill(tandem_bin, model, tmp_path / "p")
    d = None
    try:
        d = Server.start(tandem_bin, model,
                         ["--prefill", f"localhost:{p.port}", "--cluster-token", TOKEN,
                          "--threads", 1, "--grpc-port", "0", "--dns-interval", "0.2"],
                         tmp_path / "d", cmd=[tandem_bin.parent / "tandem-decode"],
                         cluster_token=TOKEN)
        ip = f"127.0.0.1:{p.port}"
        # the name resolves to the address P listens on (and maybe ::1, which
        # P does not: that one stays unlinked)
        wait_until(lambda: peers(d).get(ip, {}).get("ready"), timeout=20,
                   what="127.0.0.1 linked", proc=d.proc)
        assert f"localhost:{p.port}" not in peers(d)  # a name, not an instance
        stubs = load_stubs(source_dir, tmp_path / "stubs")
        pb = stubs.tandem
        tok = TOKEN.encode()
        n0 = transfers(p)
        for i, name in enumerate([ip, f"localhost:{p.port}", f"localhost:{p.port}", ip]):
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5 + i, 17, 33, 250] * 6),
                                     sampling=pb.SamplingParams(temperature=0, max_tokens=3))
            call(stubs, d, internal_generate(tok, req, prefill=name))
            if name != ip and i == 1:
                # the first request under a new name may prefill elsewhere
                # (locally) while that name is being linked
                wait_until(lambda: peers(d).get(name, {}).get("alias_of") == ip, timeout=20,
                           what="localhost an alias of 127.0.0.1", proc=d.proc)
        pp = peers(d)
        assert pp[f"localhost:{p.port}"]["alias_of"] == ip
        assert pp[f"localhost:{p.port}"]["ready"] and pp[ip]["ready"]
        assert pp[f"localhost:{p.port}"]["epoch"] == pp[ip]["epoch"]
        assert transfers(p) >= n0 + 3
        assert metric(d.metrics(), "tandem:kv_transfer_failures_total") == 0
        assert "fencing" not in d.log_tail(100000)
        d.wait_idle()
        p.wait_idle()
    finally:
        if d:
            d.close()
        p.close()


def free_port(hosts):
    """A port free on every address of hosts."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        ok = True
        for h in hosts[1:]:
            with socket.socket() as s:
                try:
                    s.bind((h, port))
                except OSError:
                    ok = False
        if ok:
            return port
    pytest.skip("no port free on every test address")


def refusing_resolver(tmp_path):
    """A resolv.conf whose server refuses at once (nothing listens on
    127.0.0.78:53): a name not in the hosts file fails the same way every
    time, without waiting and without the machine's DNS."""
    f = tmp_path / "resolv-refusing.conf"
    f.write_text("nameserver 127.0.0.78\noptions timeout:1 attempts:1\n")
    return f


def test_unresolvable_name(manifest, test_models, tandem_bin, tmp_path, mount_ns):
    """A name that does not resolve (yet: a Service without ready pods) is
    said once and tried again; D serves meanwhile, prefilling itself."""
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    d = Server.start(tandem_bin, model,
                     ["--prefill", "no-such-prefill.test:8100", "--cluster-token", TOKEN,
                      "--threads", 1, "--dns-interval", "0.1"],
                     tmp_path / "d",
                     cmd=private_hosts_cmd(mount_ns, refusing_resolver(tmp_path)) + [
                         tandem_bin.parent / "tandem-decode"], cluster_token=TOKEN)
    try:
        assert complete(d, "The name does not resolve, but")
        wait_until(lambda: d.log_tail(100000).count("no-such-prefill.test") >= 1, timeout=10,
                   what="the resolution error said", proc=d.proc)
        time.sleep(1.0)  # ten more resolutions
        assert d.log_tail(100000).count("no-such-prefill.test") == 1
        assert metric(d.metrics(), "tandem:local_prefill_total", reason="no_peer") == 1
        assert d.state()["transfer"]["peers"] == []
        d.wait_idle()
    finally:
        d.close()


@pytest.fixture
def mount_ns(tmp_path):
    hosts, why = private_hosts(tmp_path / "hosts")
    if hosts is None:
        pytest.skip(why)
    return hosts


def set_name(hosts, addrs):
    write_hosts(hosts, {NAME: addrs})


def test_name_with_several_addresses(manifest, test_models, tandem_bin, tmp_path, mount_ns):
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    port = free_port(["127.0.0.2", "127.0.0.3", "127.0.0.4"])
    a2, a3, a4 = (f"127.0.0.{k}:{port}" for k in (2, 3, 4))
    set_name(mount_ns, ["127.0.0.2", "127.0.0.3"])
    ps, d, r, p4 = [], None, None, None
    try:
        for k in (2, 3):
            ps.append(start_prefill(tandem_bin, model, tmp_path / f"p{k}", f"127.0.0.{k}", port))
        d = Server.start(tandem_bin, model,
                         ["--prefill", f"{NAME}:{port}", "--cluster-token", TOKEN, "--threads",
                          1, "--grpc-port", "0", "--dns-interval", "0.2",
                          "--forget-prefill-after", "1"],
                         tmp_path / "d", cmd=private_hosts_cmd(mount_ns) + [
                             tandem_bin.parent / "tandem-decode"], cluster_token=TOKEN)
        wait_until(lambda: all(peers(d).get(a, {}).get("ready") for a in (a2, a3)), timeout=20,
                   what="both addresses of the name linked", proc=d.proc)
        epochs = {a: peers(d)[a]["epoch"] for a in (a2, a3)}
        # requests straight to D go round the instances
        n = [transfers(p) for p in ps]
        for i in range(6):
            complete(d, f"Request number {i} asks for something rather long to prefill.")
        assert all(transfers(p) > n0 for p, n0 in zip(ps, n))
        # the router resolves the name the same way: its names are D's
        r = Server.start(tandem_bin, model,
                         ["--cluster-token", TOKEN, "--grpc-port", "0", "--poll-interval-ms", 50,
                          "--prefill-dns", f"{NAME}:{port}", "--dns-interval", "0.2",
                          "--decode", f"127.0.0.1:{d.port}", "--local-prefill-threshold", 0,
                          "--local-prefill-max-tokens", 0],
                         tmp_path / "r", cmd=private_hosts_cmd(mount_ns) + [
                             tandem_bin.parent / "tandem-router"], cluster_token=TOKEN)
        wait_until(lambda: r.request("GET", "/ready")[0] == 200, timeout=20,
                   what="router ready", proc=r.proc)

        def router_sees_prefill():
            st, view = r.get_json("/internal/v1/cluster", headers={"X-Tandem-Cluster-Token": TOKEN})
            return st == 200 and {x["address"] for x in view["instances"]
                                  if x["role"] == "prefill" and x["ready"]} == {a2, a3}

        # its /ready needs a decode instance only: wait for both prefill ones
        wait_until(router_sees_prefill, timeout=20, what="the router's view of the name",
                   proc=r.proc)
        n = [transfers(p) for p in ps]
        for i in range(6):
            complete(r, f"Routed request {i}: " + "a prompt long enough for a remote prefill " * 3)
        assert sum(transfers(p) for p in ps) >= sum(n) + 6
        assert set(peers(d)) == {a2, a3}  # no alias: the router named them as D does
        # no instance was taken for a restart of the other
        assert {a: peers(d)[a]["epoch"] for a in (a2, a3)} == epochs
        assert "fencing" not in d.log_tail(100000)
        # scale in: 127.0.0.3 leaves the name and stops
        set_name(mount_ns, ["127.0.0.2"])
        ps[1].wait_idle()
        assert ps[1].stop() == 0
        wait_until(lambda: a3 not in peers(d), timeout=30,
                   what="the stopped instance forgotten", proc=d.proc)
        # scale out: 127.0.0.4 joins
        p4 = start_prefill(tandem_bin, model, tmp_path / "p4", "127.0.0.4", port)
        set_name(mount_ns, ["127.0.0.2", "127.0.0.4"])
        wait_until(lambda: peers(d).get(a4, {}).get("ready"), timeout=20,
                   what="the new address linked", proc=d.proc)
        n4 = transfers(p4)
        for i in range(4):
            complete(d, f"After the change {i}: another prompt to prefill somewhere else.")
        assert transfers(p4) > n4
        assert set(peers(d)) == {a2, a4}
        assert peers(d)[a2]["epoch"] == epochs[a2]
        for s in (d, ps[0], p4):
            s.wait_idle()
    finally:
        for s in [r, d, p4] + ps:
            if s is not None:
                s.close()


def test_a_name_that_stops_resolving(manifest, test_models, tandem_bin, tmp_path, mount_ns):
    """Two names. One stops resolving (a Service with no ready pod) while
    the other moves to a new pod: the first keeps its instance, the old pod
    of the second gets none of D's own requests once it has left the name
    (a pod draining away) and is forgotten once it is gone."""
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    port = free_port(["127.0.0.2", "127.0.0.3", "127.0.0.4"])
    a2, a3, a4 = (f"127.0.0.{k}:{port}" for k in (2, 3, 4))
    other = "tdother.test"
    write_hosts(mount_ns, {NAME: ["127.0.0.2"], other: ["127.0.0.3"]})
    ps, d = {}, None
    try:
        for k in (2, 3, 4):
            ps[k] = start_prefill(tandem_bin, model, tmp_path / f"p{k}", f"127.0.0.{k}", port)
        d = Server.start(tandem_bin, model,
                         ["--prefill", f"{NAME}:{port},{other}:{port}", "--cluster-token", TOKEN,
                          "--threads", 1, "--dns-interval", "0.2", "--forget-prefill-after", "1"],
                         tmp_path / "d",
                         cmd=private_hosts_cmd(mount_ns, refusing_resolver(tmp_path)) + [
                             tandem_bin.parent / "tandem-decode"], cluster_token=TOKEN)
        wait_until(lambda: all(peers(d).get(a, {}).get("ready") for a in (a2, a3)), timeout=20,
                   what="both names linked", proc=d.proc)
        # the second name fails from now on; the first moves to 127.0.0.4
        write_hosts(mount_ns, {NAME: ["127.0.0.4"]})
        wait_until(lambda: peers(d).get(a4, {}).get("ready"), timeout=20,
                   what="the new address linked", proc=d.proc)
        n = {k: transfers(p) for k, p in ps.items()}
        for i in range(6):
            complete(d, f"Request {i} after the move, long enough to prefill remotely.")
        now = {k: transfers(p) for k, p in ps.items()}
        assert now[2] == n[2], (n, now)  # left its name: none of D's own requests
        assert now[3] > n[3] and now[4] > n[4], (n, now)
        # 127.0.0.2 stops: fenced, then forgotten; 127.0.0.3 stays (its
        # name does not resolve: it keeps what it had)
        ps[2].wait_idle()
        assert ps[2].stop() == 0
        wait_until(lambda: a2 not in peers(d), timeout=30, what="the stopped pod forgotten",
                   proc=d.proc)
        time.sleep(1.5)  # beyond --forget-prefill-after
        pp = peers(d)
        assert set(pp) == {a3, a4} and pp[a3]["ready"] and pp[a4]["ready"], pp
        # said once, though tried every 0.2 s
        wait_until(lambda: f"resolving {other}:{port}" in d.log_tail(100000), timeout=10,
                   what="the resolution error said", proc=d.proc)
        assert d.log_tail(100000).count(f"resolving {other}:{port}") == 1
        for s in (d, ps[3], ps[4]):
            s.wait_idle()
    finally:
        for s in [d] + list(ps.values()):
            if s is not None:
                s.close()


def test_dns_outage_delays_nothing(manifest, test_models, tandem_bin, tmp_path, mount_ns):
    """A name whose DNS server never answers (30 s a query) next to a
    working address: D links the working one at once, serves through it,
    and stops at once on SIGTERM; the router in the same situation finds
    its static instances and gets ready."""
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    server = f"127.0.{os.getpid() % 250 + 1}.77"  # apart from concurrent runs
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sink.bind((server, 53))
    except OSError as e:
        sink.close()
        pytest.skip(f"no UDP port 53 on {server} for a silent DNS server: {e}")
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(f"nameserver {server}\noptions timeout:30 attempts:1\n")
    p = d = r = None
    try:
        p = start_prefill(tandem_bin, model, tmp_path / "p")
        ip = f"127.0.0.1:{p.port}"
        d = Server.start(tandem_bin, model,
                         ["--prefill", f"hung.example.com:8100,{ip}", "--cluster-token", TOKEN,
                          "--threads", 1, "--grpc-port", "0"],
                         tmp_path / "d", cmd=private_hosts_cmd(mount_ns, resolv) + [
                             tandem_bin.parent / "tandem-decode"], cluster_token=TOKEN)
        wait_until(lambda: peers(d).get(ip, {}).get("ready"), timeout=10,
                   what="the working address linked while the DNS hangs", proc=d.proc)
        n = transfers(p)
        complete(d, "Served while the other name hangs in DNS, prefilled remotely.")
        assert transfers(p) == n + 1
        sink.settimeout(10)
        try:
            sink.recv(512)  # the name was asked for (and never answered)
        except socket.timeout:
            pytest.skip("the resolver never asked the silent DNS server (not glibc's DNS?)")
        r = Server.start(tandem_bin, model,
                         ["--cluster-token", TOKEN, "--grpc-port", "0", "--prefill", ip,
                          "--decode", f"127.0.0.1:{d.port}", "--prefill-dns",
                          "hung-prefill.example.com:8100", "--poll-interval-ms", 50],
                         tmp_path / "r", cmd=private_hosts_cmd(mount_ns, resolv) + [
                             tandem_bin.parent / "tandem-router"], cluster_token=TOKEN)
        wait_until(lambda: r.request("GET", "/ready")[0] == 200, timeout=10,
                   what="the router ready while the DNS hangs", proc=r.proc)
        assert complete(r, "Through the router while the DNS hangs")
        t = time.monotonic()
        assert r.stop(timeout=10) == 0
        assert d.stop(timeout=10) == 0
        assert time.monotonic() - t < 10
        p.wait_idle()
    finally:
        for s in (r, d, p):
            if s is not None:
                s.close()
        sink.close()
