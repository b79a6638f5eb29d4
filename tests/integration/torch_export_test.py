#!/usr/bin/python3
"""Serves nn.MultiheadAttention exports (tests/tools/export_torch.py) and checks
the server's output against PyTorch's to 1e-4 over gRPC, using the Python client.

    torch_export_test.py SERVER_BINARY SOURCE_DIR
"""

import json
import os
import subprocess
import sys
import tempfile

from server_harness import start_server, stop_server

TOLERANCE = 1e-4
EXPORTS = {
    # PyTorch's packed in_proj_weight, self-attention.
    "torch_self": ["--embed_dim", "64", "--num_heads", "8", "--self_attention",
                   "--queries", "9", "--seed", "1"],
    # kdim/vdim differ: q/k/v_proj_weight, cross-attention.
    "torch_kvdim": ["--embed_dim", "48", "--num_heads", "4", "--kdim", "40", "--vdim", "24",
                    "--queries", "6", "--keys", "11", "--seed", "2"],
    # No biases.
    "torch_nobias": ["--embed_dim", "32", "--num_heads", "2", "--no_bias", "--seed", "3"],
}


def main():
    binary, source = sys.argv[1], sys.argv[2]
    sys.path.insert(0, os.path.join(source, "client", "python"))
    import attention_client as client

    workdir = tempfile.TemporaryDirectory(prefix="torch_export_")
    repository = workdir.name
    for name, flags in EXPORTS.items():
        subprocess.run([sys.executable, os.path.join(source, "tests", "tools", "export_torch.py"),
                        "--repository", repository, "--name", name, *flags], check=True)

    pb2, pb2_grpc = client.load_api(os.path.join(source, "proto"))
    import grpc
    proc, target = start_server(binary, [f"--model_repository={repository}"])
    failures = 0
    try:
        with grpc.insecure_channel(target) as channel:
            stub = pb2_grpc.AttentionServiceStub(channel)
            for name in EXPORTS:
                with open(os.path.join(repository, f"{name}.io.json")) as f:
                    io = json.load(f)
                pair = lambda t: (t["shape"], t["data"])  # noqa: E731
                keys = None if io["self_attention"] else pair(io["keys"])
                values = None if io["self_attention"] else pair(io["values"])
                response = client.attend(stub, pb2, pair(io["queries"]), keys, values,
                                         valid_lens=io["valid_lens"], model=name)
                shape, data = client.to_nested(response.output)
                expected = io["output"]
                diff = max(abs(a - b) for a, b in zip(data, expected["data"]))
                ok = list(shape) == expected["shape"] and diff <= TOLERANCE
                failures += not ok
                print(f"{name}: shape {shape}, max |server - torch| = {diff:.2e} "
                      f"{'OK' if ok else 'FAIL'}")
    finally:
        code = stop_server(proc)
    if code != 0:
        print(f"server exit code {code}")
        failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
