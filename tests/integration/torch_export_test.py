#!/usr/bin/python3
"""Serves nn.MultiheadAttention exports (python -m mha_serve.export --random) and
checks the server's output against PyTorch's to 1e-4 over gRPC with mha_serve, the
package imported from the source tree (client/python; stubs generated at import).
tests/python covers the installed package in depth; this checks a source checkout.

    torch_export_test.py SERVER_BINARY SOURCE_DIR
"""

import os
import subprocess
import sys
import tempfile

import numpy as np

from server_harness import start_server, stop_server

TOLERANCE = 1e-4
EXPORTS = {
    # PyTorch's packed in_proj_weight, self-attention (K = 0).
    "torch_self": ["--embed-dim", "64", "--num-heads", "8", "--sample", "3,9,0", "--seed", "1"],
    # kdim/vdim differ: q/k/v_proj_weight, cross-attention.
    "torch_kvdim": ["--embed-dim", "48", "--num-heads", "4", "--kdim", "40", "--vdim", "24",
                    "--sample", "3,6,11", "--seed", "2"],
    # No biases.
    "torch_nobias": ["--embed-dim", "32", "--num-heads", "2", "--no-bias", "--sample", "3,5,7",
                     "--seed", "3"],
}


def main():
    binary, source = sys.argv[1], sys.argv[2]
    package = os.path.join(source, "client", "python")
    sys.path.insert(0, package)
    import mha_serve
    from mha_serve.safetensors import read_safetensors

    workdir = tempfile.TemporaryDirectory(prefix="torch_export_")
    repository = workdir.name
    env = dict(os.environ, PYTHONPATH=package)
    for name, flags in EXPORTS.items():
        subprocess.run([sys.executable, "-m", "mha_serve.export", "--random", "--output",
                        repository, "--name", name, *flags], check=True, env=env)

    proc, target = start_server(binary, [f"--model_repository={repository}"])
    failures = 0
    try:
        with mha_serve.Client(target, timeout=60) as client:
            for name in EXPORTS:
                io = read_safetensors(os.path.join(repository, name, "io.safetensors"))
                output = client.attend(io["queries"], io.get("keys"), io.get("values"),
                                       valid_lens=io["valid_lens"], model=name)
                expected = io["output"]
                diff = float(np.max(np.abs(output - expected)))
                ok = output.shape == expected.shape and diff <= TOLERANCE
                failures += not ok
                print(f"{name}: shape {output.shape}, max |server - torch| = {diff:.2e} "
                      f"{'OK' if ok else 'FAIL'}")
    finally:
        code = stop_server(proc)
    if code != 0:
        print(f"server exit code {code}")
        failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
