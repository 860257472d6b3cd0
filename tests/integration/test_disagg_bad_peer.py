"""Bad peers on the KV-transfer control channel: a real
tandem-prefill (P, tiny model) receives malformed, oversized and
out-of-range control messages and descriptors from td-xfer-peer, a
harness that speaks the real UCX channel (tools/bench/xfer_peer.c) and
builds its messages here from the tree's proto/ (generated at test time).

After each: P is alive, /health answers 200, and the rejection is logged
(or, where the message carries a reply path P trusts, the harness
receives a PrefillRejected). A valid request whose destination is the
harness's own registered region shows that P writes exactly the
destination blocks' K/V rows and nothing else (the rest keeps its guard
pattern); a region whose claimed size is a lie is never written outside.
Finally a real tandem-decode paired with the same P gets the same answers
as `tandem serve`, and P's block counts are back at idle."""

import contextlib
import json
import os
import pathlib
import random
import re
import select
import subprocess
import time
import types

import pytest

from conftest import register_log, scaled
from serve_util import TOKEN, Server, linked, metric

MODEL = "llama2-f32-gguf"
NB = 8  # blocks of the harness's region
MIB16 = 16 << 20


# ---------------------------------------------------------------------------
# protobuf classes from proto/, in a private descriptor pool (so they never
# clash with grpc_stubs' tandem_pb2 in the default pool)

def load_protos(source_dir, out_dir):
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    from grpc_tools import protoc

    out = pathlib.Path(out_dir) / "internal.desc"
    wkt = pathlib.Path(protoc.__file__).parent / "_proto"
    args = ["grpc_tools.protoc", f"-I{source_dir}", f"-I{wkt}", "--include_imports",
            f"--descriptor_set_out={out}", "proto/internal.proto", "proto/tandem.proto"]
    if protoc.main(args) != 0:
        pytest.fail(f"grpc_tools.protoc failed: {' '.join(args)}")
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for f in fds.file:
        pool.Add(f)
    ns = types.SimpleNamespace()
    for full in ("tandem.internal.v1.ControlMessage", "tandem.internal.v1.Peer",
                 "tandem.internal.v1.Plan", "tandem.internal.v1.KvGeometry",
                 "tandem.internal.v1.RankEndpoint", "tandem.internal.v1.Exchange",
                 "tandem.internal.v1.RankBlocks", "tandem.internal.v1.PrefillRequest",
                 "tandem.internal.v1.PrefillDone", "tandem.internal.v1.PrefillRejected",
                 "tandem.internal.v1.TransferFailed", "tandem.internal.v1.TransferConsumed",
                 "tandem.internal.v1.Abort", "tandem.internal.v1.LeaseRenewal",
                 "tandem.v1.SamplingParams"):
        setattr(ns, full.rsplit(".", 1)[1],
                message_factory.GetMessageClass(pool.FindMessageTypeByName(full)))
    ns.reason = {v.number: v.name for v in
                 pool.FindEnumTypeByName("tandem.internal.v1.RejectReason").values}
    return ns


# ---------------------------------------------------------------------------
# the harness

class XferPeer:
    """td-xfer-peer: a UCX worker with a guarded region, driven line by line."""

    def __init__(self, binary, region_bytes, log_path):
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen([str(binary), "--region-bytes", str(region_bytes)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, start_new_session=True)
        register_log("td-xfer-peer", log_path, self.proc)
        hello = self._line(30)
        self.address = bytes.fromhex(hello["address"])
        self.rkey = bytes.fromhex(hello["rkey"])
        self.base, self.bytes = hello["base"], hello["bytes"]
        assert self.bytes == region_bytes

    def _line(self, timeout):
        r, _, _ = select.select([self.proc.stdout], [], [], scaled(timeout))
        if not r:
            pytest.fail(f"td-xfer-peer: no answer within {scaled(timeout):.0f} s")
        ln = self.proc.stdout.readline()
        if not ln:
            pytest.fail(f"td-xfer-peer exited ({self.proc.wait()})")
        return json.loads(ln)

    def cmd(self, line, timeout=30, ok=True):
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()
        out = self._line(timeout)
        if ok:
            assert out["ok"], (line[:80], out)
        return out

    def send(self, data, tmp_dir=None):
        if len(data) > (1 << 20):
            path = pathlib.Path(tmp_dir) / "big-message.bin"
            path.write_bytes(data)
            return self.cmd(f"sendfile {path}")
        return self.cmd("send " + data.hex())

    def recv(self, timeout_ms):
        return [bytes.fromhex(h) for h in self.cmd(f"recv {timeout_ms}",
                                                  timeout=timeout_ms / 1000 + 30)["msgs"]]

    def close(self):
        """Quits (kills after 10 s); returns the exit status."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b"quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=scaled(10))
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def rank_kv_bytes(n_layer, n_head_kv, head_dim, block_size, n_blocks):
    """One rank of a tp = pp = cp = 1 plan: every layer and head, K and V, f32."""
    return n_layer * n_head_kv * head_dim * block_size * n_blocks * 2 * 4


class Cluster:
    """P, its exchange, the harness and the helpers the tests share."""

    def __init__(self, pb, p, harness, n_vocab, tmp):
        self.pb, self.p, self.h, self.n_vocab, self.tmp = pb, p, harness, n_vocab, tmp
        st, _, body = p.request("GET", "/internal/v1/kv/exchange", headers=p.internal_headers)
        assert st == 200, st
        m = pb.ControlMessage.FromString(body)
        assert m.WhichOneof("body") == "exchange"
        self.p_ex = m.exchange
        self.p_from = getattr(m, "from")
        kv = self.p_ex.kv
        self.n_layer, self.n_head_kv, self.head_dim = kv.n_layer, kv.n_head_kv, kv.head_dim
        self.bs = kv.block_size
        self.compat = bytes(self.p_ex.compat)
        self.row = self.n_head_kv * self.head_dim * 4
        self.max_ctx = None
        harness.cmd("connect " + self.p_ex.ranks[0].worker_address.hex())

    # -- messages
    def identity(self):
        return ("bad-peer-%d" % random.randrange(1 << 30), random.randrange(1, 1 << 63))

    def envelope(self, who=None, token=TOKEN.encode()):
        m = self.pb.ControlMessage(cluster_token=token)
        inst, epoch = who or self.identity()
        getattr(m, "from").CopyFrom(self.pb.Peer(instance_id=inst, epoch=epoch))
        return m

    def exchange(self, n_blocks=NB, kv_bytes=None, address=None, rkey=None, ex_id=None, **geom):
        g = dict(n_layer=self.n_layer, n_head_kv=self.n_head_kv, head_dim=self.head_dim,
                 block_size=self.bs, n_blocks=n_blocks)
        g.update(geom)
        pb = self.pb
        return pb.Exchange(
            exchange_id=ex_id or random.randrange(1, 1 << 63),
            plan=pb.Plan(tp=1, pp=1, cp=1, stage_begin=[0, self.n_layer]),
            kv=pb.KvGeometry(**g),
            ranks=[pb.RankEndpoint(
                rank=0, worker_address=self.h.address if address is None else address,
                kv_rkey=self.h.rkey if rkey is None else rkey, kv_base=self.h.base,
                kv_bytes=rank_kv_bytes(self.n_layer, self.n_head_kv, self.head_dim,
                                       self.bs, n_blocks) if kv_bytes is None else kv_bytes)],
            compat=self.compat)

    def request(self, tokens, dest, who=None, ex=None, ex_id=None, req_id=None, deadline=10000,
                compat=None, cached=0, sampling=None):
        m = self.envelope(who)
        r = m.prefill_request
        r.request_id = req_id or "bp-%d" % random.randrange(1 << 30)
        r.tokens.extend(tokens)
        r.cached_tokens = cached
        r.dest.add(rank=0, block_ids=dest)
        if ex_id is not None:
            r.exchange_id = ex_id
        else:
            r.exchange.CopyFrom(ex if ex is not None else self.exchange())
        r.deadline_ms = deadline
        r.compat = self.compat if compat is None else compat
        r.sampling.CopyFrom(sampling or self.pb.SamplingParams(temperature=0.0))
        return m

    # -- observations
    def log_mark(self):
        return self.p.err_path.stat().st_size

    def wait_log(self, mark, needle, what, timeout=10):
        deadline = time.monotonic() + scaled(timeout)
        while True:
            with open(self.p.err_path, "rb") as f:
                f.seek(mark)
                new = f.read().decode(errors="replace")
            if needle in new:
                return new
            if self.p.proc.poll() is not None:
                pytest.fail(f"{what}: P exited with {self.p.proc.returncode}\n{self.p.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: no log line with {needle!r} within {timeout} s; "
                            f"new log:\n{new[-2000:]}")
            time.sleep(0.02)

    def alive(self, what):
        assert self.p.proc.poll() is None, f"{what}: P exited\n{self.p.log_tail()}"
        st, _, _ = self.p.request("GET", "/health")
        assert st == 200, what

    def sent_rejected(self, data, needle, what):
        """Sends data; P logs a line with needle and stays up."""
        mark = self.log_mark()
        self.h.send(data, self.tmp)
        line = self.wait_log(mark, needle, what)
        self.alive(what)
        return line

    def windows(self, dest, n_tokens, first=0, n_blocks=NB):
        """(offset, len) of the K/V rows [first, n_tokens) of dest in the
        layout (n_layer, 2, n_blocks, block_size, n_head_kv, head_dim) f32, in
        logical order (layer, K/V, position)."""
        out = []
        for layer in range(self.n_layer):
            for kv in range(2):
                for i, b in enumerate(dest):
                    a, e = max(first, i * self.bs), min(n_tokens, (i + 1) * self.bs)
                    if a >= e:
                        continue
                    off = (((layer * 2 + kv) * n_blocks + b) * self.bs + a - i * self.bs) * self.row
                    out.append((off, (e - a) * self.row))
        return out

    def check(self, wins):
        self.h.cmd("allow clear")
        for off, ln in wins:
            self.h.cmd(f"allow {off} {ln}")
        return self.h.cmd("check")

    def decode(self, raw):
        m = self.pb.ControlMessage.FromString(raw)
        assert bytes(m.cluster_token) == TOKEN.encode()
        assert getattr(m, "from").instance_id == self.p_from.instance_id
        return m

    def wait_reply(self, req_id, body, what, timeout_ms=15000):
        """The first answer about req_id (P's JobProgress, which says a
        chunk started, is not one); it must be of kind body."""
        deadline = time.monotonic() + scaled(timeout_ms / 1000)
        while time.monotonic() < deadline:
            for raw in self.h.recv(500):
                m = self.decode(raw)
                kind = m.WhichOneof("body")
                if kind == "job_progress" and body != "job_progress":
                    continue
                if getattr(m, kind).request_id == req_id:
                    assert kind == body, (what, kind, str(m)[:500])
                    return getattr(m, kind)
        pytest.fail(f"{what}: no {body} for {req_id}\n{self.p.log_tail()}")

    def barrier(self):
        """Returns once P has handled every message sent before: a body P
        only logs, on the same endpoint (active messages stay in order)."""
        m = self.envelope()
        m.prefill_done.request_id = "barrier"
        m.prefill_done.first_token = 3
        self.sent_rejected(m.SerializeToString(), "ignoring control message", "barrier")

    def consume(self, req_id, who):
        m = self.envelope(who)
        m.transfer_consumed.request_id = req_id
        self.h.send(m.SerializeToString())


@pytest.fixture(scope="module")
def pb(source_dir, tmp_path_factory):
    return load_protos(source_dir, tmp_path_factory.mktemp("proto"))


@pytest.fixture(scope="module")
def model(manifest, test_models):
    for m in manifest:
        if m["name"] == MODEL:
            return test_models / m["path"], m["config"]
    pytest.fail(f"no test model {MODEL}")


@contextlib.contextmanager
def prefill_and_harness(pb, model, tandem_bin, tmp):
    """A fresh P and a harness connected to it (both stopped on exit)."""
    peer_bin = tandem_bin.parent / "td-xfer-peer"
    if not peer_bin.exists():
        pytest.fail(f"{peer_bin} not built")
    path, cfg = model
    # an f32 cache: the harness lays out and sizes its KV region in f32
    p = Server.start(tandem_bin, path,
                     ["--cluster-token", TOKEN, "--threads", "1", "--kv-dtype", "f32"],
                     tmp / "prefill", cmd=[tandem_bin.parent / "tandem-prefill"],
                     cluster_token=TOKEN)
    h = None
    try:
        kv = rank_kv_bytes(cfg["n_layer"], cfg["n_head_kv"], cfg["head_dim"], 16, NB)
        h = XferPeer(peer_bin, kv, tmp / "xfer-peer.err")
        c = Cluster(pb, p, h, cfg["n_vocab"], tmp)
        assert c.bs == 16 and c.n_layer == cfg["n_layer"] and c.n_head_kv == cfg["n_head_kv"]
        yield c
        # both exit cleanly (under sanitizers: no report)
        rc = h.close()
        assert rc == 0, f"td-xfer-peer exited with {rc}: see {tmp / 'xfer-peer.err'}"
        rc = p.stop()
        assert rc == 0, f"P exited with {rc}\n{p.log_tail()}"
    finally:
        if h:
            h.close()
        p.close()


@pytest.fixture(scope="module")
def cluster(pb, model, tandem_bin, tmp_path_factory):
    with prefill_and_harness(pb, model, tandem_bin, tmp_path_factory.mktemp("badpeer")) as c:
        yield c


@pytest.fixture(scope="module")
def colocated(model, tandem_bin, tmp_path_factory):
    s = Server.start(tandem_bin, model[0], ["--threads", "1", "--kv-dtype", "f32"],
                     tmp_path_factory.mktemp("serve"))
    yield s
    s.close()


def prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


# ---------------------------------------------------------------------------

def test_malformed_envelopes_are_dropped(cluster):
    """Bytes that are not a valid control message from this cluster: logged,
    dropped, P stays up."""
    c = cluster
    good = c.request(prompt(20, 1), [0, 1]).SerializeToString()
    no_token = c.request(prompt(20, 1), [0, 1])
    no_token.ClearField("cluster_token")
    no_peer = c.request(prompt(20, 1), [0, 1])
    no_peer.ClearField("from")
    zero_epoch = c.request(prompt(20, 1), [0, 1], who=("bad-peer", 0))
    bad_inst = c.request(prompt(20, 1), [0, 1], who=("bad\x01peer", 5))
    cases = [
        ("garbage", bytes(random.Random(3).randrange(256) for _ in range(300)),
         "do not unpack"),
        ("truncated", good[:len(good) // 2], "do not unpack"),
        ("empty", b"", "wrong cluster token"),
        ("wrong token", c.request(prompt(20, 1), [0, 1]).SerializeToString().replace(
            TOKEN.encode(), TOKEN[:-1].encode() + b"X"), "wrong cluster token"),
        ("token prefix", c.envelope(token=TOKEN[:-1].encode()).SerializeToString(),
         "wrong cluster token"),
        ("missing token", no_token.SerializeToString(), "wrong cluster token"),
        ("missing peer", no_peer.SerializeToString(), "without a valid peer"),
        ("epoch 0", zero_epoch.SerializeToString(), "without a valid peer"),
        ("unprintable instance", bad_inst.SerializeToString(), "without a valid peer"),
        ("over 16 MiB", b"\x0a" + b"\xff" * (MIB16 + 64), "dropped a"),
    ]
    for what, data, needle in cases:
        c.sent_rejected(data, needle, what)
    # A message body P never takes (PrefillDone): ignored (logged).
    c.barrier()
    assert c.h.recv(0) == []  # none of these had a reply path
    c.p.wait_idle()


def test_bad_prefill_requests_are_rejected(cluster):
    """PrefillRequests with one field out of range each: rejected at
    decoding (one log line naming the field), nothing queued or written."""
    c = cluster
    toks = prompt(40, 2)
    kvb = rank_kv_bytes(c.n_layer, c.n_head_kv, c.head_dim, c.bs, NB)
    rnd = random.Random(4)
    big = [5] * (1 << 20)  # far over the context

    def req(**kw):
        return c.request(kw.pop("tokens", toks), kw.pop("dest", [0, 1, 2]), **kw)

    def tweak(m, fn):
        fn(m.prefill_request)
        return m

    cases = [
        ("block id out of range", req(dest=[0, 1, NB]), "out of the pool"),
        ("block id negative", req(dest=[0, -1, 2]), "out of the pool"),
        ("too few blocks", req(dest=[0, 1]), "destination blocks"),
        ("too many blocks", req(dest=[0, 1, 2, 3]), "destination blocks"),
        ("token over the vocabulary", req(tokens=toks[:-1] + [c.n_vocab]), "out of the vocabulary"),
        ("token negative", req(tokens=[-1] + toks[1:]), "out of the vocabulary"),
        ("too many tokens", req(tokens=big, dest=[0] * (len(big) // 16)), "tokens (1 .."),
        ("no tokens", req(tokens=[], dest=[]), "tokens (1 .."),
        ("cached not whole blocks", req(cached=5), "cached tokens"),
        ("cached the whole prompt", req(tokens=toks[:32], dest=[0, 1], cached=32),
         "cached tokens"),
        ("region size a lie (larger)", req(ex=c.exchange(kv_bytes=kvb * 2)), "KV region of"),
        ("region size a lie (smaller)", req(ex=c.exchange(kv_bytes=kvb - 1)), "KV region of"),
        ("region wraps", tweak(req(), lambda r: setattr(r.exchange.ranks[0], "kv_base",
                                                        (1 << 64) - 4096)), "KV region of"),
        ("geometry: layers", req(ex=c.exchange(n_layer=c.n_layer + 1)), "KV geometry"),
        ("geometry: heads", req(ex=c.exchange(n_head_kv=c.n_head_kv * 2)), "KV geometry"),
        ("geometry: head dim", req(ex=c.exchange(head_dim=c.head_dim + 1)), "KV geometry"),
        ("geometry: block size", req(ex=c.exchange(block_size=32)), "KV geometry"),
        ("geometry: no blocks", req(ex=c.exchange(n_blocks=0, kv_bytes=0)), "KV pool of 0"),
        ("bad compat hash", req(compat=bytes(16)), "compatibility hash differs"),
        ("short compat hash", req(compat=c.compat[:8]), "compatibility hash differs"),
        ("deadline 0", req(deadline=0), "deadline 0 ms"),
        ("deadline too long", req(deadline=600001), "deadline 600001 ms"),
        ("unprintable request id", req(req_id="bad\nid"), "bad request id"),
        ("request id too long", req(req_id="x" * 64), "bad request id"),
        ("empty address", req(ex=c.exchange(address=b"")), "worker address or rkey"),
        ("huge rkey", req(ex=c.exchange(rkey=b"\x00" * 5000)), "worker address or rkey"),
        ("exchange id 0", tweak(req(), lambda r: setattr(r.exchange, "exchange_id", 0)),
         "exchange id 0"),
        ("no exchange", req(ex_id=0), "neither an exchange nor its id"),
    ]
    for what, m, needle in cases:
        c.sent_rejected(m.SerializeToString(), needle, what)
    assert c.h.recv(0) == []  # no reply path for any of these
    # Descriptors that pass decoding but are not what they claim to be:
    # P cannot make an endpoint or an rkey of them (ucx.c checks the
    # framing before UCX parses them): it drops the request or fails it
    # (TransferFailed), never writes and never reports success (it may say
    # a chunk started: JobProgress).
    c.h.cmd("reset")
    for what, ex in (
            ("random worker address", c.exchange(address=rnd.randbytes(len(c.h.address)))),
            ("random rkey", c.exchange(rkey=rnd.randbytes(len(c.h.rkey)))),
            ("truncated rkey", c.exchange(rkey=c.h.rkey[:-7])),
            ("rkey with a flipped bit", c.exchange(
                rkey=c.h.rkey[:40] + bytes([c.h.rkey[40] ^ 1]) + c.h.rkey[41:]))):
        c.sent_rejected(req(ex=ex).SerializeToString(), "rejected a", what)
    c.p.wait_idle()
    kinds = [c.decode(r).WhichOneof("body") for r in c.h.recv(200)]
    assert set(kinds) <= {"prefill_rejected", "transfer_failed", "job_progress"}, kinds
    assert c.check([])["guard_ok"]


def test_unknown_ids_and_bad_lease_messages(cluster):
    """LeaseRenewal, Abort, TransferConsumed for ids P never saw change
    nothing; malformed ones are rejected at decoding."""
    c = cluster
    for body in ("abort", "transfer_consumed"):
        m = c.envelope()
        getattr(m, body).request_id = "never-seen"
        mark = c.log_mark()
        c.h.send(m.SerializeToString())
        c.barrier()
        c.alive(body)
        assert "rejected" not in open(c.p.err_path, "rb").read()[mark:].decode(errors="replace")
    m = c.envelope()
    m.lease_renewal.request_ids.extend(["never-seen", "also-unknown"])
    m.lease_renewal.lease_ms = 600000
    c.h.send(m.SerializeToString())
    bad = []
    for ids, ms in (([], 1000), (["a"], 0), (["a"], 600001), (["x"] * 1025, 1000),
                    (["ok", "bad id"], 1000)):
        m = c.envelope()
        m.lease_renewal.request_ids.extend(ids)
        m.lease_renewal.lease_ms = ms
        bad.append(m)
    for i, m in enumerate(bad):
        c.sent_rejected(m.SerializeToString(), "lease renewal", f"lease renewal {i}")
    m = c.envelope()
    m.abort.request_id = "a"
    m.abort.message = "caf\u00e9"
    raw = m.SerializeToString().replace(b"caf\xc3\xa9", b"caf\xff\xfe")  # not UTF-8 on the wire
    c.sent_rejected(raw, "control message rejected", "abort with invalid UTF-8")
    assert c.h.recv(0) == []
    c.p.wait_idle()


def test_puts_stay_inside_the_destination(cluster, colocated):
    """A valid request naming the harness's region: P writes exactly the K/V
    rows of the destination blocks (every other byte keeps its guard), the
    same bytes whichever blocks are named and whether P computed them or
    pushed them from its prefix cache, and sends PrefillDone with the first
    token `tandem serve` gives."""
    c = cluster
    who = c.identity()
    toks = prompt(40, 7)
    st, ref = colocated.post_json("/v1/completions",
                                  {"prompt": toks, "max_tokens": 1, "temperature": 0,
                                   "logprobs": 1})
    assert st == 200, ref
    ref_text = ref["choices"][0]["text"]
    ref_lp = ref["choices"][0]["logprobs"]["token_logprobs"][0]
    ex = c.exchange(ex_id=random.randrange(1, 1 << 63))
    hashes, hits = [], []
    for dest, cached in (([5, 2, 6], 0), ([0, 1, 7], 0), ([3, 4, 5], 16)):
        c.h.cmd("reset")
        rid = "bp-put-%d-%d" % (dest[0], cached)
        c.h.send(c.request(toks, dest, who=who, ex=ex, req_id=rid, cached=cached,
                           sampling=c.pb.SamplingParams(temperature=0.0, logprobs=True)
                           ).SerializeToString())
        done = c.wait_reply(rid, "prefill_done", f"put into {dest}")
        assert 0 <= done.first_token < c.n_vocab
        hits.append(metric(c.p.metrics(), "vllm:prefix_cache_hits_total"))
        wins = c.windows(dest, len(toks), first=cached)
        chk = c.check(wins)
        assert chk["guard_ok"], (dest, chk)
        assert chk["window_bytes"] == sum(n for _, n in wins)
        # f32 K/V of a random model: a byte equal to its guard by chance is rare
        assert chk["window_changed"] > 0.9 * chk["window_bytes"], (dest, chk)
        if cached == 0:
            hashes.append(chk["window_hash"])
        else:
            # D claimed the first block: P wrote none of its rows
            full = c.check(c.windows(dest, len(toks)))
            assert full["guard_ok"] and full["window_changed"] == chk["window_changed"]
        # D's acknowledgement counts only from the D that sent the job
        assert c.p.state()["transfer"]["awaiting_consume"] == 1
        c.consume(rid, c.identity())
        c.consume(rid, (who[0], who[1] + 1))
        m = c.envelope((who[0], who[1] + 1))
        m.abort.request_id = rid
        c.h.send(m.SerializeToString())
        c.barrier()
        assert c.p.state()["transfer"]["awaiting_consume"] == 1
        c.consume(rid, who)
        deadline = time.monotonic() + scaled(5)
        while c.p.state()["transfer"]["awaiting_consume"] != 0:
            assert time.monotonic() < deadline, "TransferConsumed not taken"
            time.sleep(0.02)
        # serve's greedy first token: the same text and the same logprob
        # (the bit-identical contract; the JSON carries it rounded)
        st, det = colocated.post_json("/detokenize", {"tokens": [done.first_token]})
        assert st == 200 and det["prompt"].strip() == ref_text.strip(), (det, ref_text)
        assert abs(done.logprob - ref_lp) < 1e-4, (done.logprob, ref_lp)
    # P computed the first run and served the later ones from its prefix
    # cache (P's hit counter grows): the same KV bytes, whichever blocks
    # they land in
    assert hits[0] < hits[1] < hits[2], hits
    assert hashes[0] == hashes[1]

    # With the exchange known, P answers bad requests on this endpoint.
    rnd = "bp-rej-%d" % random.randrange(1 << 30)
    cases = [
        ("unknown exchange id", dict(ex_id=ex.exchange_id + 1), "REJECT_UNKNOWN_EXCHANGE"),
        ("block out of the linked pool", dict(ex_id=ex.exchange_id, dest=[0, 1, NB + 3]),
         "REJECT_INVALID"),
        ("too few blocks for the linked pool", dict(ex_id=ex.exchange_id, dest=[0, 1]),
         "REJECT_INVALID"),
        ("logit bias outside the vocabulary", dict(
            ex_id=ex.exchange_id, sampling=c.pb.SamplingParams(logit_bias={c.n_vocab + 9: 5.0})),
         "REJECT_INVALID"),
        ("stop id outside the vocabulary", dict(
            ex_id=ex.exchange_id, sampling=c.pb.SamplingParams(stop_token_ids=[-4])),
         "REJECT_INVALID"),
        ("negative temperature", dict(
            ex_id=ex.exchange_id, sampling=c.pb.SamplingParams(temperature=-1.0)),
         "REJECT_INVALID"),
        ("too many top logprobs", dict(
            ex_id=ex.exchange_id, sampling=c.pb.SamplingParams(top_logprobs=500)),
         "REJECT_INVALID"),
    ]
    c.h.cmd("reset")
    for i, (what, kw, reason) in enumerate(cases):
        rid = f"{rnd}-{i}"
        dest = kw.pop("dest", [0, 1, 2])
        c.h.send(c.request(toks, dest, who=who, req_id=rid, **kw).SerializeToString())
        rej = c.wait_reply(rid, "prefill_rejected", what)
        assert c.pb.reason[rej.reason] == reason, (what, rej)
        c.alive(what)
    chk = c.check([])
    assert chk["guard_ok"], chk  # rejected: nothing written
    c.p.wait_idle()


# A consistent lie about the region's size (kv_bytes matching the claimed
# geometry) passes the message checks; over the shared-memory transports a
# put is a memcpy into P's own mapping of the peer's segment, which UCX does
# not bound, so P checks the claimed region against that mapping when it
# unpacks the rkey (td_ucx_rkey_create) and refuses the peer.
@pytest.mark.parametrize("lie,dest", [(2 * NB, [2 * NB - 3, 2 * NB - 2, 2 * NB - 1]),
                                      (4096, [4093, 4094, 4095])])
def test_region_size_lie_is_never_written_outside(lie, dest, pb, model, tandem_bin, tmp_path):
    """The harness claims a pool of `lie` blocks (kv_bytes consistent with
    that geometry) over a region that holds 8, and names blocks past its
    end. P may only write inside what the peer registered: it must refuse
    (a PrefillRejected or TransferFailed, or no answer and a log line), never
    answer PrefillDone, never crash, and leave the real region untouched
    (under the lying layout even the first layer's rows fall at other
    offsets of it). Its own P: this one may be damaged."""
    with prefill_and_harness(pb, model, tandem_bin, tmp_path) as c:
        who = c.identity()
        toks = prompt(40, 11)
        rid = "bp-lie"
        mark = c.log_mark()
        c.h.send(c.request(toks, dest, who=who, ex=c.exchange(n_blocks=lie),
                           req_id=rid).SerializeToString())
        deadline = time.monotonic() + scaled(3)
        kinds = []
        while time.monotonic() < deadline and not kinds:
            kinds += [c.decode(r).WhichOneof("body") for r in c.h.recv(200)]
            assert c.p.proc.poll() is None, f"P died on a lying region\n{c.p.log_tail()}"
        c.alive("region size lie")
        new_log = open(c.p.err_path, "rb").read()[mark:].decode(errors="replace")
        assert "prefill_done" not in kinds, (kinds, new_log[-2000:])
        # no answer is allowed only with the refusal of the claimed region
        # in P's log (td_ucx_rkey_create), not any warning line
        assert kinds or re.search(r"rejected (an rkey: the region|the remote region)", new_log), \
            (kinds, new_log[-2000:])
        chk = c.check([])
        assert chk["guard_ok"], chk
        c.p.wait_idle()


def test_prefill_still_serves(cluster, model, colocated, tandem_bin, tmp_path):
    """After every bad peer above, a real decode instance paired with the
    same P gets `tandem serve`'s answers, and both are idle afterwards."""
    c = cluster
    d = Server.start(tandem_bin, model[0],
                     ["--prefill", f"127.0.0.1:{c.p.port}", "--cluster-token", TOKEN,
                      "--threads", "1", "--kv-dtype", "f32"], tmp_path / "decode",
                     cmd=[tandem_bin.parent / "tandem-decode"], cluster_token=TOKEN)
    try:
        deadline = time.monotonic() + scaled(20)
        while not linked(d):
            assert time.monotonic() < deadline, "decode not linked"
            time.sleep(0.05)
        for i, n in enumerate((5, 17, 40, 70)):
            body = {"prompt": prompt(n, 100 + i), "max_tokens": 8, "temperature": 0,
                    "logprobs": 2}
            st, got = d.post_json("/v1/completions", body)
            assert st == 200, (got, d.log_tail())
            st, want = colocated.post_json("/v1/completions", body)
            assert st == 200
            g, w = got["choices"][0], want["choices"][0]
            assert (g["text"], g["logprobs"], g["finish_reason"]) == \
                (w["text"], w["logprobs"], w["finish_reason"]), i
        d.wait_idle()
        c.p.wait_idle()
        c.alive("after serving")
    finally:
        d.close()
