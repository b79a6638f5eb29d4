#!/usr/bin/env python3
"""Memory across a model swap: the server's peak RSS (VmHWM) while bert_base is
reloaded under load, against its steady RSS and the memory one loaded copy of the
model holds.

  reload_memory.py SERVER CLIENT SOURCE_DIR [--swaps=3]

1. Steady state: a server on a copy of deploy/models/bert_base serves
   attention_client bench (B 8, Q 128, self-attention, concurrency 8) for 8 s;
   VmRSS after it is the steady RSS.
2. Each swap: a 4 s bench window without a swap gives the control peak (VmHWM,
   reset by /proc/PID/clear_refs 5 before each window: the load's own peak, from
   the requests' buffers in flight); then the model's seed changes, SIGHUP, and a
   second 4 s window runs through the reload. The swap's extra peak is the second
   window's VmHWM over the first's; VmRSS after it shows the old version freed.
3. One copy of the model: a second server, explicit model control and no default
   warm-up, loads bert_base and answers one (1, 16) request (its weights packed);
   the RSS it gained is the model's resident size.
Prints every figure, and the bound on the extra peak: one model copy + 10% of the
steady RSS. Fails when a bench request fails, or when the RSS after a swap is
over steady + one model copy + 10% (the old version was not freed). The load client shares the machine's
cores with the server.
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
from server_harness import start_server, stop_server  # noqa: E402


def status_kb(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


def bench(client, target, seconds):
    out = subprocess.run(
        [client, "bench", f"--target={target}", "--model=bert_base", "--batch=8",
         "--num_queries=128", "--num_keys=0", "--valid_lens=none", "--concurrency=8",
         f"--duration={seconds}s", "--warmup=0s", "--max_errors=0"],
        capture_output=True, text=True, timeout=seconds + 120)
    if out.returncode != 0:
        raise RuntimeError(f"bench failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out.stdout


class StderrLines:
    """The server's stderr, read by a thread so the pipe never fills."""

    def __init__(self, proc):
        import threading
        self.lines = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, args=(proc.stderr,), daemon=True)
        self.thread.start()

    def _read(self, pipe):
        for raw in iter(pipe.readline, b""):
            with self.lock:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    def wait_for(self, needle, count, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if sum(needle in line for line in self.lines) >= count:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"no {count}x '{needle}' in time:\n" + "\n".join(self.lines))


def model_resident_kb(server, client, repository):
    proc, target = start_server(server, ["--model_control=explicit", "--default_warmup=false",
                                         f"--model_repository={repository}", "--http_port=-1"])
    try:
        StderrLines(proc)
        before = status_kb(proc.pid, "VmRSS")
        subprocess.run([sys.executable, "-c", LOAD_SNIPPET, target], check=True, timeout=120)
        subprocess.run([client, "infer", f"--target={target}", "--model=bert_base", "--batch=1",
                        "--num_queries=16", "--num_keys=0", "--valid_lens=none"],
                       check=True, capture_output=True, timeout=120)
        return status_kb(proc.pid, "VmRSS") - before
    finally:
        stop_server(proc)


# RepositoryModelLoad over the KServe gRPC API, with stubs generated on the fly.
LOAD_SNIPPET = r"""
import os, sys, tempfile, importlib
from grpc_tools import protoc
import grpc
src = os.environ["MHA_PROTO_DIR"]
out = tempfile.mkdtemp()
protoc.main(["protoc", f"-I{src}", f"--python_out={out}", f"--grpc_python_out={out}",
             os.path.join(src, "inference", "grpc_service.proto"),
             os.path.join(src, "inference", "model_config.proto")])
sys.path.insert(0, out)
pb = importlib.import_module("inference.grpc_service_pb2")
rpc = importlib.import_module("inference.grpc_service_pb2_grpc")
stub = rpc.GRPCInferenceServiceStub(grpc.insecure_channel(sys.argv[1]))
stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="bert_base"), timeout=120)
"""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("server")
    parser.add_argument("client")
    parser.add_argument("source_dir")
    parser.add_argument("--swaps", type=int, default=3)
    args = parser.parse_args()
    os.environ["MHA_PROTO_DIR"] = os.path.join(args.source_dir, "proto")

    work = tempfile.mkdtemp(prefix="mha_reload_memory_")
    repository = os.path.join(work, "models")
    shutil.copytree(os.path.join(args.source_dir, "deploy", "models", "bert_base"),
                    os.path.join(repository, "bert_base"))
    config = os.path.join(repository, "bert_base", "config.pbtxt")
    proc, target = start_server(args.server, [f"--model_repository={repository}",
                                              "--http_port=-1"])
    failed = False
    peaks, afters = [], []
    try:
        log = StderrLines(proc)
        bench(args.client, target, 8)
        steady = status_kb(proc.pid, "VmRSS")
        print(f"steady RSS after 8 s of bench (B 8, Q 128, c 8): {steady / 1024:.1f} MiB")

        def window_peak():  # VmHWM over a 4 s bench window
            with open(f"/proc/{proc.pid}/clear_refs", "w") as f:
                f.write("5")
            bench(args.client, target, 4)
            return status_kb(proc.pid, "VmHWM")

        for swap in range(1, args.swaps + 1):
            control = window_peak()
            with open(config) as f:
                text = f.read()
            with open(config, "w") as f:
                f.write(re.sub(r"seed: \d+", f"seed: {100 + swap}", text))
            proc.send_signal(signal.SIGHUP)
            peak = window_peak()  # the reload happens during this window
            log.wait_for("repository: reload done (loaded 1", swap)
            after = status_kb(proc.pid, "VmRSS")
            peaks.append(peak - control)
            print(f"swap {swap}: VmHWM {peak / 1024:.1f} MiB against {control / 1024:.1f} MiB in "
                  f"the window before without a swap (+{(peak - control) / 1024:.1f}), RSS after "
                  f"{after / 1024:.1f} MiB, bench 0 failed")
            afters.append(after)
    finally:
        stop_server(proc)
    model = model_resident_kb(args.server, args.client, repository)
    weights = 4 * (768 * 768 + 768) * 4
    print(f"bert_base: weights {weights / 2**20:.1f} MiB as f32 parameters; one loaded, packed "
          f"copy holds {model / 1024:.1f} MiB resident")
    bound = model + steady * 0.10
    print(f"a swap's extra peak: max +{max(peaks) / 1024:.1f} MiB; bound one model copy + 10% "
          f"of steady = +{bound / 1024:.1f} MiB (with the f32 parameters instead of the "
          f"resident copy: +{(weights / 1024 + steady * 0.10) / 1024:.1f} MiB)")
    # The old version is freed: RSS after every swap within the steady RSS, the new
    # version's own packed layouts (one model copy) and 10%.
    for swap, after in enumerate(afters, 1):
        if after > steady * 1.10 + model:
            print(f"FAIL: RSS after swap {swap} over steady + one model copy + 10%")
            failed = True
    shutil.rmtree(work, ignore_errors=True)
    print("reload_memory: " + ("FAILED" if failed else "passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
