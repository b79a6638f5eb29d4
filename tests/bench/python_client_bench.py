#!/usr/bin/python3
"""Python client cost per Attend request: the old path (repeated float `data` built
from lists, decoded with list(), as client/python/attention_client.py did) against
mha_serve's (raw little-endian bytes from numpy, np.frombuffer), on a running server.

    /usr/bin/python3 tests/bench/python_client_bench.py --target=127.0.0.1:50051 \
        [--model=bert_base --batch=8 --num_queries=128 --num_keys=0 --requests=10 --runs=5]

Per request it times, in the calling thread: the build (the request message and its
serialisation: old, protobuf's SerializeToString; new, mha_serve.client.encode_request),
the round trip (gRPC call on bytes: transfer, server), the decode (old, protobuf's
parse and list(); new, mha_serve.client.decode_response_bytes, what attend() does);
and reads the server's compute_us
from response.timing. The two paths alternate, `--runs` runs of `--requests` requests
each (after a warm-up request per path); each figure is the median over runs of the
run's mean per request. mha_serve is imported from the source tree (client/python)
unless installed.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np

try:
    import mha_serve
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "client", "python"))
    import mha_serve
import grpc
from mha_serve.client import MAX_MESSAGE_BYTES, decode_response_bytes, encode_request, pb2


def old_build(model, queries, keys, values, valid_lens):
    """What the old example client did: flat lists into `repeated float data`."""
    def tensor(array):
        return pb2.Tensor(shape=list(array.shape), data=list(array.ravel().tolist()))

    request = pb2.AttendRequest(model=model, queries=tensor(queries), valid_lens=valid_lens)
    if keys is not None:
        request.keys.CopyFrom(tensor(keys))
        request.values.CopyFrom(tensor(values))
    return request.SerializeToString()


def old_decode(response_bytes):
    response = pb2.AttendResponse.FromString(response_bytes)
    return tuple(response.output.shape), list(response.output.data)


def new_build(model, queries, keys, values, valid_lens):
    return encode_request(queries, keys, values, valid_lens=valid_lens, model=model)


def new_decode(response_bytes):
    return decode_response_bytes(response_bytes)


PATHS = {
    "old: data, lists": (old_build, old_decode),
    "new: raw, numpy": (new_build, new_decode),
}


def one_request(attend, path, inputs):
    build, decode = PATHS[path]
    t0 = time.perf_counter()
    request = build(*inputs)
    t1 = time.perf_counter()
    response_bytes = attend(request, timeout=120)
    t2 = time.perf_counter()
    decode(response_bytes)
    t3 = time.perf_counter()
    timing = pb2.AttendResponse.FromString(response_bytes).timing  # not timed
    return {"build": t1 - t0, "round trip": t2 - t1, "decode": t3 - t2,
            "compute": timing.compute_us * 1e-6}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--model", default="bert_base")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--num_queries", type=int, default=128)
    parser.add_argument("--num_keys", type=int, default=0, help="0 = self-attention")
    parser.add_argument("--requests", type=int, default=10, help="requests per run and path")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with mha_serve.Client(args.target, timeout=120) as client:
        info = client.model(args.model)
    b, q, k = args.batch, args.num_queries, args.num_keys
    shapes = [(b, q, info.query_size)]
    if k:
        shapes += [(b, k, info.key_size), (b, k, info.value_size)]
    arrays = mha_serve.uniform_inputs(args.seed, shapes) + [None, None]
    inputs = (info.name, arrays[0], arrays[1], arrays[2], [])
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    with grpc.insecure_channel(args.target, options=options) as channel:
        attend = channel.unary_unary("/attention.v1.AttentionService/Attend")  # bytes
        for path in PATHS:  # warm-up
            one_request(attend, path, inputs)
        old_output = old_decode(attend(old_build(*inputs), timeout=120))
        new_output = new_decode(attend(new_build(*inputs), timeout=120))
        assert np.array_equal(np.float32(old_output[1]), new_output.ravel()), "paths disagree"

        runs = {path: [] for path in PATHS}
        for _ in range(args.runs):
            for path in PATHS:
                times = [one_request(attend, path, inputs) for _ in range(args.requests)]
                runs[path].append({key: statistics.fmean(t[key] for t in times)
                                   for key in times[0]})

    kind = "self-attention" if not k else f"cross-attention, K {k}"
    request_mb = sum(np.prod(s) for s in shapes) * 4 / 2**20
    print(f"{info.name}: B {b}, Q {q}, p_o {info.num_hiddens}, h {info.num_heads}, {kind}; "
          f"{request_mb:.1f} MiB of inputs, {b * q * info.num_hiddens * 4 / 2**20:.1f} MiB "
          f"of output; median of {args.runs} runs x {args.requests} requests per path")
    print("| path | build ms | decode ms | Python (build + decode) ms | server compute ms "
          "| round trip ms | Python / compute |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for path, results in runs.items():
        med = {key: statistics.median(r[key] for r in results) * 1e3 for key in results[0]}
        python = statistics.median((r["build"] + r["decode"]) * 1e3 for r in results)
        print(f"| {path} | {med['build']:.2f} | {med['decode']:.2f} | {python:.2f} | "
              f"{med['compute']:.2f} | {med['round trip']:.2f} | "
              f"{100 * python / med['compute']:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
