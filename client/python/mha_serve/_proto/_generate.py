"""Generates the gRPC stubs attention_pb2.py and attention_pb2_grpc.py from
proto/attention.proto with grpc_tools.protoc (Debian: python3-grpc-tools).

Used at build time by setup.py (build_py writes them into the built package,
mha_serve/_proto/) and, from a source checkout that was never installed, by
mha_serve._proto at import time (into a temporary directory). The stubs are
never committed. This file imports nothing from mha_serve, so setup.py can load
it by path.
"""

import os
import re

GENERATED = ("attention_pb2.py", "attention_pb2_grpc.py")


def default_proto(package_dir):
    """attention.proto of the source tree: <repo>/proto/attention.proto, where
    package_dir is <repo>/client/python/mha_serve/_proto (or the environment's
    MHA_SERVE_PROTO, a path to attention.proto)."""
    return os.environ.get("MHA_SERVE_PROTO") or os.path.normpath(
        os.path.join(package_dir, "..", "..", "..", "..", "proto", "attention.proto"))


def generate(proto_file, out_dir):
    """Runs protoc on proto_file, writing the two stubs into out_dir, and makes
    the _grpc stub import its messages relative to its package (protoc writes a
    top-level `import attention_pb2`)."""
    from grpc_tools import protoc

    proto_file = os.path.abspath(proto_file)
    if not os.path.isfile(proto_file):
        raise FileNotFoundError(
            f"{proto_file}: not found; build mha_serve from the mha-serve source tree "
            "(client/python next to proto/) or set MHA_SERVE_PROTO to attention.proto")
    os.makedirs(out_dir, exist_ok=True)
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    code = protoc.main([
        "grpc_tools.protoc", f"-I{os.path.dirname(proto_file)}", f"-I{include}",
        f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", proto_file])
    if code != 0:
        raise RuntimeError(f"grpc_tools.protoc failed on {proto_file} (exit {code})")
    grpc_stub = os.path.join(out_dir, GENERATED[1])
    with open(grpc_stub) as f:
        text = f.read()
    text, count = re.subn(r"^import attention_pb2 as ", "from . import attention_pb2 as ",
                          text, flags=re.M)
    if count != 1:
        raise RuntimeError(f"{grpc_stub}: no `import attention_pb2` line to make relative")
    with open(grpc_stub, "w") as f:
        f.write(text)
    return [os.path.join(out_dir, name) for name in GENERATED]
