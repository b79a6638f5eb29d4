#!/usr/bin/python3
"""System shared memory against inline tensors (issue 33's figures), from a Python
gRPC client (the generated stubs; attention_client has no --shared_memory yet):

  bert_base (B 8, Q = K 128, d 768) self-attention at concurrency 1: p50 end to end,
    inline (raw_input_contents / raw_output_contents) and by region (input and output
    in shared memory), each over the server's median compute_us (its access log) and
    over mha_core_bench Forward/bert_base/f32's median run with the server's threads;
  toy (the embedded default model; B 2, Q 4, K 6 cross-attention) at concurrency 1:
    requests per second, inline and by region.

RUNS rounds, the four measurements alternated within each round; each figure is the
median over rounds. The server runs with --compute_threads=THREADS, batching as
configured in deploy/models.

    flock -x /work/cpu.lock chrt -r 10 tests/bench/shared_memory_bench.py [BUILD_DIR]

Env: RUNS (5), BERT_REQUESTS (30 per run), TOY_SECONDS (2 per run), THREADS (nproc).
"""

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing import shared_memory

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from server_harness import start_server, stop_server  # noqa: E402
import kserve_shared_memory_test as shm_test  # noqa: E402

RUNS = int(os.environ.get("RUNS", "5"))
BERT_REQUESTS = int(os.environ.get("BERT_REQUESTS", "30"))
TOY_SECONDS = float(os.environ.get("TOY_SECONDS", "2"))
THREADS = int(os.environ.get("THREADS", str(os.cpu_count())))


def core_forward_ms(build):
    """mha_core_bench Forward/bert_base/f32: the median of 5 repetitions, ms."""
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    out = subprocess.run(
        [os.path.join(build, "tests", "bench", "mha_core_bench"),
         "--benchmark_filter=^Forward/bert_base/f32$", "--benchmark_repetitions=5",
         "--benchmark_report_aggregates_only=true", "--benchmark_format=csv"],
        env=env, capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if "_median" in line:
            fields = line.split(",")
            real, unit = float(fields[2]), fields[4].strip('"')
            return real * {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
    raise RuntimeError(f"no median in mha_core_bench's output:\n{out}")


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build", "release")
    out_dir = tempfile.mkdtemp(prefix="mha_shm_bench_")
    shm_test.API = shm_test.load_api(ROOT, out_dir)
    api = shm_test.API
    log_path = os.path.join(out_dir, "server.log")
    proc, target = start_server(
        os.path.join(build, "server", "attention_server"),
        ["--shared_memory=system", f"--model_repository={ROOT}/deploy/models",
         f"--compute_threads={THREADS}", "--log_requests", "--log_format=json"])
    # The access log goes to stderr: drain it to a file so that the server never blocks.
    drain = subprocess.Popen(["cat"], stdin=proc.stderr, stdout=open(log_path, "w"))
    channel = grpc.insecure_channel(target, options=shm_test.CHANNEL_OPTIONS)
    stub = api.inf_grpc.GRPCInferenceServiceStub(channel)
    regions = []
    try:
        rng = np.random.default_rng(1)
        q = rng.uniform(-1, 1, (8, 128, 768)).astype(np.float32)
        bert_in, bert_out = shared_memory.SharedMemory(create=True, size=q.nbytes), \
            shared_memory.SharedMemory(create=True, size=q.nbytes)
        regions += [bert_in, bert_out]
        bert_in.buf[:q.nbytes] = q.tobytes()
        for name, region in (("bert_in", bert_in), ("bert_out", bert_out)):
            stub.SystemSharedMemoryRegister(api.inf.SystemSharedMemoryRegisterRequest(
                name=name, key="/" + region.name, byte_size=q.nbytes), timeout=60)

        def bert_request(shm):
            request = shm_test.build_request(
                [("queries", "FP32", q, ("bert_in", q.nbytes, 0) if shm else None)],
                [("output", ("bert_out", q.nbytes, 0) if shm else None)], model="bert_base")
            return request

        tq, tk, tv = (rng.uniform(-1, 1, s).astype(np.float32)
                      for s in ((2, 4, 100), (2, 6, 100), (2, 6, 100)))
        toy = shared_memory.SharedMemory(create=True, size=1 << 16)
        regions.append(toy)
        offsets = (0, 4096, 12288, 20480)
        for offset, array in zip(offsets, (tq, tk, tv)):
            toy.buf[offset:offset + array.nbytes] = array.tobytes()
        stub.SystemSharedMemoryRegister(api.inf.SystemSharedMemoryRegisterRequest(
            name="toy", key="/" + toy.name, byte_size=1 << 16), timeout=60)

        def toy_request(shm):
            inputs = [(n, "FP32", a, ("toy", a.nbytes, o) if shm else None)
                      for n, a, o in zip(("queries", "keys", "values"), (tq, tk, tv), offsets)]
            return shm_test.build_request(
                inputs, [("output", ("toy", 2 * 4 * 100 * 4, offsets[3]) if shm else None)])

        def p50_ms(request):
            for _ in range(3):
                stub.ModelInfer(request, timeout=60)  # warm
            times = []
            for _ in range(BERT_REQUESTS):
                start = time.perf_counter()
                stub.ModelInfer(request, timeout=60)
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)

        def req_per_s(request):
            for _ in range(20):
                stub.ModelInfer(request, timeout=60)
            count, start = 0, time.perf_counter()
            while time.perf_counter() - start < TOY_SECONDS:
                stub.ModelInfer(request, timeout=60)
                count += 1
            return count / (time.perf_counter() - start)

        requests = {"bert inline": bert_request(False), "bert shm": bert_request(True),
                    "toy inline": toy_request(False), "toy shm": toy_request(True)}
        # The two forms answer the same.
        inline = stub.ModelInfer(requests["bert inline"], timeout=60)
        stub.ModelInfer(requests["bert shm"], timeout=60)
        got = np.frombuffer(bert_out.buf[:q.nbytes], dtype="<f4")
        want = np.frombuffer(inline.raw_output_contents[0], dtype="<f4")
        assert float(np.max(np.abs(got - want))) <= 1e-6
        figures = {name: [] for name in requests}
        for _ in range(RUNS):
            for name, request in requests.items():
                figures[name].append(p50_ms(request) if name.startswith("bert")
                                     else req_per_s(request))
    finally:
        channel.close()
        code = stop_server(proc)
        drain.wait()
        for region in regions:
            region.close()
            region.unlink()
    # compute_us of bert_base requests from the access log (JSON lines).
    compute = []
    with open(log_path) as f:
        for line in f:
            if '"bert_base"' in line and '"compute_us"' in line:
                match = re.search(r'"compute_us":\s*(\d+)', line)
                if match:
                    compute.append(int(match.group(1)) / 1e3)
    forward = core_forward_ms(build)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((l.split(":", 1)[1].strip() for l in cpu.splitlines()
                  if l.startswith("Model name")), "?")
    median = {name: statistics.median(v) for name, v in figures.items()}
    server_compute = statistics.median(compute) if compute else float("nan")
    print(f"CPU: {model}; server --compute_threads={THREADS}; {RUNS} alternated runs; "
          f"server exit {code}")
    print(f"mha_core_bench Forward/bert_base/f32 median: {forward:.2f} ms; "
          f"server compute_us median (bert_base): {server_compute:.2f} ms")
    for name in ("bert inline", "bert shm"):
        runs = ", ".join(f"{v:.2f}" for v in figures[name])
        print(f"{name:12s} p50 {median[name]:7.2f} ms  (runs {runs})  "
              f"/ core forward {median[name] / forward:.3f}  "
              f"/ server compute {median[name] / server_compute:.3f}")
    for name in ("toy inline", "toy shm"):
        runs = ", ".join(f"{v:.0f}" for v in figures[name])
        print(f"{name:12s} {median[name]:7.0f} req/s  (runs {runs})")
    print(f"toy shm / inline req/s: {median['toy shm'] / median['toy inline']:.3f}")
    shutil.rmtree(out_dir, ignore_errors=True)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
