"""Python gRPC stubs generated from the repository's proto/ at test time.

    from grpc_stubs import load_stubs
    stubs = load_stubs(source_dir, tmp_dir)   # once per module or session
    stub = stubs.tandem_grpc.GenerateStub(channel)
    req = stubs.tandem.GenerateRequest(text="hi")

Runs grpc_tools.protoc (PyPI grpcio-tools) over proto/tandem.proto and
proto/health.proto into out_dir and imports the generated modules, so the
tests always speak the .proto in the tree, never a copy. Independent of
conftest (usable from any test file or script).
"""

import importlib
import pathlib
import sys
import types

PROTOS = ("tandem", "health")


def load_stubs(source_dir, out_dir):
    """Generates and imports the stubs; returns a namespace with tandem,
    tandem_grpc, health, health_grpc (the *_pb2 / *_pb2_grpc modules).
    Raises RuntimeError with protoc's message when generation fails."""
    from grpc_tools import protoc  # grpcio-tools

    proto_dir = pathlib.Path(source_dir) / "proto"
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # grpc_tools ships the well-known types; give protoc their include path
    # as its own command-line entry point does.
    wkt = pathlib.Path(protoc.__file__).parent / "_proto"
    args = ["grpc_tools.protoc", f"-I{proto_dir}", f"-I{wkt}", f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}"] + [str(proto_dir / f"{p}.proto") for p in PROTOS]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"grpc_tools.protoc failed ({rc}): {' '.join(args)}")
    # The generated *_pb2_grpc modules import their *_pb2 by top-level name.
    if str(out_dir) not in sys.path:
        sys.path.insert(0, str(out_dir))
    ns = types.SimpleNamespace()
    for p in PROTOS:
        for suffix, attr in (("_pb2", p), ("_pb2_grpc", p + "_grpc")):
            name = p + suffix
            mod = sys.modules.get(name)
            if mod is not None and pathlib.Path(getattr(mod, "__file__", "")).parent != out_dir:
                # Another directory's copy: load ours instead.
                del sys.modules[name]
            setattr(ns, attr, importlib.import_module(name))
    return ns
