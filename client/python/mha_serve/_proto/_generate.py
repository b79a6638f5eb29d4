"""Generates the gRPC stubs from proto/ with grpc_tools.protoc (Debian:
python3-grpc-tools): attention.v1's (attention_pb2.py, attention_pb2_grpc.py, from
proto/attention.proto) and KServe v2's, with Triton's extensions
(grpc_service_pb2.py, grpc_service_pb2_grpc.py, model_config_pb2.py, from
proto/inference/grpc_service.proto and the model_config.proto it imports), which
mha_serve.shared_memory speaks.

Used at build time by setup.py (build_py writes them into the built package,
mha_serve/_proto/) and, from a source checkout that was never installed, by
mha_serve._proto at import time (into a temporary directory). All five land flat in
one directory, their imports of each other made relative to it. The stubs are never
committed. This file imports nothing from mha_serve, so setup.py can load it by path.
"""

import os
import re

# The protos, relative to the proto directory (the one holding attention.proto).
PROTOS = ("attention.proto", os.path.join("inference", "grpc_service.proto"),
          os.path.join("inference", "model_config.proto"))
GENERATED = ("attention_pb2.py", "attention_pb2_grpc.py", "grpc_service_pb2.py",
             "grpc_service_pb2_grpc.py", "model_config_pb2.py")
# protoc writes `import attention_pb2 as ...` and `from inference import X_pb2 as ...`
# (top-level names); in mha_serve._proto they import from the package.
_ABSOLUTE_IMPORT = re.compile(r"^(?:import (attention_pb2)|from inference import (\w+_pb2)) as ",
                              re.M)


def default_proto(package_dir):
    """attention.proto of the source tree: <repo>/proto/attention.proto, where
    package_dir is <repo>/client/python/mha_serve/_proto (or the environment's
    MHA_SERVE_PROTO, a path to attention.proto; the KServe protos are read from the
    inference/ directory beside it)."""
    return os.environ.get("MHA_SERVE_PROTO") or os.path.normpath(
        os.path.join(package_dir, "..", "..", "..", "..", "proto", "attention.proto"))


def generate(proto_file, out_dir):
    """Runs protoc on proto_file (attention.proto) and the KServe protos under
    inference/ beside it, writing the stubs of GENERATED into out_dir with their
    imports of each other made relative (protoc writes top-level imports)."""
    import tempfile

    from grpc_tools import protoc

    proto_dir = os.path.dirname(os.path.abspath(proto_file))
    files = [os.path.join(proto_dir, name) for name in PROTOS]
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path}: not found; build mha_serve from the mha-serve source tree "
                "(client/python next to proto/) or set MHA_SERVE_PROTO to attention.proto "
                "(with inference/grpc_service.proto and inference/model_config.proto beside it)")
    os.makedirs(out_dir, exist_ok=True)
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    written = []
    with tempfile.TemporaryDirectory(prefix="mha_serve_protoc_") as raw:
        code = protoc.main([
            "grpc_tools.protoc", f"-I{proto_dir}", f"-I{include}", f"--python_out={raw}",
            f"--grpc_python_out={raw}", *PROTOS])
        if code != 0:
            raise RuntimeError(f"grpc_tools.protoc failed on {', '.join(files)} (exit {code})")
        for name in GENERATED:
            source = os.path.join(raw, name)
            if not os.path.isfile(source):
                source = os.path.join(raw, "inference", name)
            with open(source) as f:
                text = f.read()
            text = _ABSOLUTE_IMPORT.sub(
                lambda m: f"from . import {m.group(1) or m.group(2)} as ", text)
            if re.search(r"^(import \w+_pb2|from inference import)", text, re.M):
                raise RuntimeError(f"{name}: an import of a stub left absolute")
            path = os.path.join(out_dir, name)
            with open(path, "w") as f:
                f.write(text)
            written.append(path)
    return written
