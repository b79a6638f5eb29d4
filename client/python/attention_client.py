#!/usr/bin/python3
"""Example Python client for attention_server (attention.v1.AttentionService).

Generates the gRPC stubs from proto/attention.proto at run time with
grpc_tools.protoc (Debian: python3-grpcio, python3-grpc-tools) into a temporary
directory, sends the seeds' toy request (queries (2, 4, 100), keys = values
(2, 6, 100), valid_lens [3, 2]) and prints the output shape.

    /usr/bin/python3 client/python/attention_client.py --target 127.0.0.1:50051

Also usable as a module: load_api(), tensor(), to_nested() and attend().
"""

import argparse
import atexit
import math
import os
import shutil
import sys
import tempfile

import grpc
from grpc_tools import protoc

DEFAULT_PROTO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "proto")


def load_api(proto_dir=DEFAULT_PROTO_DIR):
    """Compiles attention.proto into a temp dir; returns (attention_pb2, attention_pb2_grpc)."""
    out_dir = tempfile.mkdtemp(prefix="attention_stubs_")
    atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    code = protoc.main([
        "grpc_tools.protoc", f"-I{proto_dir}", f"-I{include}", f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}", os.path.join(proto_dir, "attention.proto")])
    if code != 0:
        raise RuntimeError(f"protoc failed on {proto_dir}/attention.proto (exit {code})")
    sys.path.insert(0, out_dir)
    import attention_pb2  # noqa: E402  (generated above)
    import attention_pb2_grpc  # noqa: E402
    return attention_pb2, attention_pb2_grpc


def tensor(pb2, shape, data):
    """A row-major float32 attention.v1.Tensor from a shape and a flat list."""
    return pb2.Tensor(shape=list(shape), data=list(data))


def to_nested(t):
    """attention.v1.Tensor -> (shape tuple, flat list of floats)."""
    return tuple(t.shape), list(t.data)


def attend(stub, pb2, queries, keys=None, values=None, valid_lens=(), model="",
           causal=False, return_attention=False, timeout=30.0):
    """Calls Attend. queries/keys/values are (shape, flat data) pairs."""
    request = pb2.AttendRequest(model=model, queries=tensor(pb2, *queries),
                                valid_lens=list(valid_lens), causal=causal,
                                return_attention=return_attention)
    if keys is not None:
        request.keys.CopyFrom(tensor(pb2, *keys))
        request.values.CopyFrom(tensor(pb2, *values))
    return stub.Attend(request, timeout=timeout)


def toy_inputs():
    """The seeds' toy shapes with deterministic values."""
    queries = ((2, 4, 100), [math.sin(0.37 * i) for i in range(2 * 4 * 100)])
    keys = ((2, 6, 100), [math.sin(0.37 * i + 1.0) for i in range(2 * 6 * 100)])
    return queries, keys


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="127.0.0.1:50051", help="server HOST:PORT")
    parser.add_argument("--model", default="", help='model name; "" = the default model')
    parser.add_argument("--proto_dir", default=DEFAULT_PROTO_DIR,
                        help="directory holding attention.proto")
    args = parser.parse_args()

    pb2, pb2_grpc = load_api(args.proto_dir)
    options = [("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(args.target, options=options) as channel:
        stub = pb2_grpc.AttentionServiceStub(channel)
        info = stub.GetModel(pb2.GetModelRequest(model=args.model), timeout=10)
        print(f"model {info.name}: p_o {info.num_hiddens}, h {info.num_heads}, "
              f"d_q {info.query_size}, d_k {info.key_size}, d_v {info.value_size}")
        queries, keys = toy_inputs()
        try:
            response = attend(stub, pb2, queries, keys, keys, valid_lens=[3, 2],
                              model=args.model)
        except grpc.RpcError as error:
            print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
        shape = ", ".join(str(d) for d in response.output.shape)
        print(f"output shape: ({shape})")
        print(f"first values: {[round(v, 5) for v in response.output.data[:4]]}")
        print(f"timing: queue {response.timing.queue_us} us, "
              f"compute {response.timing.compute_us} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
