"""The gRPC stubs: attention.v1's (attention_pb2, attention_pb2_grpc, imported here)
and KServe v2's with Triton's extensions (grpc_service_pb2, grpc_service_pb2_grpc,
model_config_pb2; imported by mha_serve.shared_memory when used).

An installed mha_serve carries them, generated at build time by setup.py. Imported
from a source checkout instead (client/python on sys.path), they are generated from
proto/attention.proto and proto/inference/ into a temporary directory on first import,
which joins this package's __path__ and is removed at exit.
"""

import atexit
import os
import shutil
import tempfile

from . import _generate

_HERE = os.path.dirname(os.path.abspath(__file__))

if not all(os.path.isfile(os.path.join(_HERE, name)) for name in _generate.GENERATED):
    _out = tempfile.mkdtemp(prefix="mha_serve_stubs_")
    atexit.register(shutil.rmtree, _out, ignore_errors=True)
    _generate.generate(_generate.default_proto(_HERE), _out)
    __path__.append(_out)  # noqa: F821 (a package's __path__)

from . import attention_pb2, attention_pb2_grpc  # noqa: E402

__all__ = ["attention_pb2", "attention_pb2_grpc"]
