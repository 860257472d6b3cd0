"""The router's internal Generate on a decode instance's gRPC port
(tandem.internal.v1.Decode/Generate): the public request plus the router's
choice of prefill, which overrides D's own --local-prefill-threshold; the
cluster token in the message; a prefill instance D was not started with
is linked on first use. The responses are the public Generate's and equal
`tandem serve`'s."""

import grpc
import pytest

from conftest import manifest_model, scaled, wait_until
from grpc_stubs import load_stubs
from serve_util import TOKEN, Pair, Server, metric

METHOD = "/tandem.internal.v1.Decode/Generate"


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def internal_generate(token, request, prefill=None, local=None):
    """tandem.internal.v1.InternalGenerate in protobuf's wire format: the
    public GenerateRequest (serialised by the generated classes) embedded as
    field 2, the token field 1, the prefill choice field 3 or 4 (the Python
    stubs are generated from tandem.proto only; internal.proto imports it by
    another path)."""
    out = b"\x0a" + varint(len(token)) + token
    req = request.SerializeToString()
    out += b"\x12" + varint(len(req)) + req
    if prefill is not None:
        p = prefill.encode()
        out += b"\x1a" + varint(len(p)) + p
    if local is not None:
        out += b"\x20" + varint(1 if local else 0)
    return out


@pytest.fixture(scope="module")
def stubs(source_dir, tmp_path_factory):
    return load_stubs(source_dir, tmp_path_factory.mktemp("grpc-stubs"))




def call(stubs, srv, body, timeout=60):
    ch = grpc.insecure_channel(f"{srv.host}:{srv.grpc_port}")
    try:
        rpc = ch.unary_stream(METHOD, request_serializer=lambda b: b,
                              response_deserializer=stubs.tandem.GenerateResponse.FromString)
        ids, end = [], None
        for r in rpc(body, timeout=scaled(timeout)):
            if r.WhichOneof("response") == "chunk":
                ids += list(r.chunk.token_ids)
            elif r.WhichOneof("response") == "complete":
                end = r.complete
        assert end is not None
        return ids
    finally:
        ch.close()


def public(stubs, srv, request):
    ch = grpc.insecure_channel(f"{srv.host}:{srv.grpc_port}")
    try:
        ids = []
        for r in stubs.tandem_grpc.GenerateStub(ch).Generate(request, timeout=scaled(60)):
            if r.WhichOneof("response") == "chunk":
                ids += list(r.chunk.token_ids)
        return ids
    finally:
        ch.close()


def test_router_choice(stubs, manifest, test_models, tandem_bin, tmp_path):
    model = manifest_model(manifest, test_models, "llama2-f32-gguf")
    pb = stubs.tandem
    reqs = [pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7 + i, 99, 3, 250] * (5 + i)),
                               sampling=pb.SamplingParams(temperature=0, max_tokens=10))
            for i in range(3)]
    ref = Server.start(tandem_bin, model, ["--threads", "1", "--grpc-port", "0"], tmp_path / "ref")
    try:
        want = [public(stubs, ref, r) for r in reqs]
        # a colocated server has no internal Generate
        with pytest.raises(grpc.RpcError) as ei:
            call(stubs, ref, internal_generate(TOKEN.encode(), reqs[0], local=True))
        assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        ref.close()
    # D prefills locally below 1000 tokens on its own: the router's choice wins
    pr = Pair(tandem_bin, tmp_path / "pair", model, [],
              ["--grpc-port", "0", "--local-prefill-threshold", "1000"])
    p2 = None
    try:
        tok = TOKEN.encode()
        assert call(stubs, pr.d, internal_generate(tok, reqs[0], local=True)) == want[0]
        m = pr.d.metrics()
        assert metric(m, "tandem:local_prefill_total", reason="router") == 1
        assert metric(m, "tandem:remote_prefill_total") == 0
        p_addr = f"127.0.0.1:{pr.p.port}"
        assert call(stubs, pr.d, internal_generate(tok, reqs[1], prefill=p_addr)) == want[1]
        m = pr.d.metrics()
        assert metric(m, "tandem:remote_prefill_total") == 1
        assert metric(m, "tandem:local_prefill_total", reason="threshold") == 0
        # a prefill instance D does not know yet: linked on first use (the
        # first request may still go to the known one while the link is made)
        p2 = pr.start_prefill()
        p2_addr = f"127.0.0.1:{p2.port}"
        call(stubs, pr.d, internal_generate(tok, reqs[2], prefill=p2_addr))
        wait_until(lambda: any(pp["address"] == p2_addr and pp["ready"]
                               for pp in pr.d.state()["transfer"]["peers"]),
                   timeout=20, what="the router's prefill instance linked")
        n2 = metric(p2.metrics(), "tandem:kv_transfer_seconds_count")
        assert call(stubs, pr.d, internal_generate(tok, reqs[2], prefill=p2_addr)) == want[2]
        assert metric(p2.metrics(), "tandem:kv_transfer_seconds_count") == n2 + 1
        # the token is checked; a malformed message is a clean error
        for bad in (internal_generate(b"wrong", reqs[0], local=True),
                    internal_generate(b"", reqs[0], local=True)):
            with pytest.raises(grpc.RpcError) as ei:
                call(stubs, pr.d, bad)
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for bad in (b"\xff\xff\xff", internal_generate(tok, reqs[0], prefill="nocolon")):
            with pytest.raises(grpc.RpcError) as ei:
                call(stubs, pr.d, bad)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        pr.d.wait_idle()
        pr.p.wait_idle()
        p2.wait_idle()
    finally:
        if p2:
            p2.close()
        pr.close()
