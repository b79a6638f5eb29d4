#!/usr/bin/python3
"""Installs mha_serve (client/python) into a fresh venv the way users do, offline on
Debian's packages, then runs this directory's pytest tests from that venv against
real servers they start.

    run_tests.py --server SERVER --client ATTENTION_CLIENT --source SOURCE_DIR \
        --venv DIR [pytest args...]

The venv is made anew (/usr/bin/python3 -m venv --system-site-packages DIR) and the
package installed with pip --no-index --no-build-isolation from a copy of
client/python, proto/attention.proto and the KServe protos (proto/inference/) in a
temporary directory, so the source tree
gets no build/ or egg-info/.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time


def step(what, command, **kwargs):
    start = time.monotonic()
    subprocess.run(command, check=True, **kwargs)
    print(f"{what}: {time.monotonic() - start:.1f} s", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--client", required=True)
    parser.add_argument("--source", required=True)
    parser.add_argument("--venv", required=True)
    args, pytest_args = parser.parse_known_args()
    source = os.path.abspath(args.source)

    shutil.rmtree(args.venv, ignore_errors=True)
    step("venv", ["/usr/bin/python3", "-m", "venv", "--system-site-packages", args.venv])
    with tempfile.TemporaryDirectory(prefix="mha_serve_pkg_") as copy:
        package = os.path.join(copy, "client", "python")
        shutil.copytree(os.path.join(source, "client", "python"), package,
                        ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__",
                                                      "attention_pb2*.py", "grpc_service_pb2*.py",
                                                      "model_config_pb2.py"))
        os.makedirs(os.path.join(copy, "proto", "inference"))
        for proto in ("attention.proto", "inference/grpc_service.proto",
                      "inference/model_config.proto"):
            shutil.copy(os.path.join(source, "proto", proto),
                        os.path.join(copy, "proto", proto))
        step("pip install", [os.path.join(args.venv, "bin", "pip"), "install", "--no-index",
                             "--no-build-isolation", "--quiet", package])

    env = dict(os.environ, MHA_SERVER=os.path.abspath(args.server),
               MHA_CLIENT=os.path.abspath(args.client), MHA_SOURCE_DIR=source,
               MHA_VENV=os.path.abspath(args.venv), PYTHONDONTWRITEBYTECODE="1",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    env.pop("PYTHONPATH", None)  # only the venv's mha_serve
    tests = os.path.dirname(os.path.abspath(__file__))
    return subprocess.call(
        [os.path.join(args.venv, "bin", "python"), "-m", "pytest", "-p", "no:cacheprovider",
         "-q", "--durations=5", tests, *pytest_args], env=env, cwd=args.venv)


if __name__ == "__main__":
    sys.exit(main())
