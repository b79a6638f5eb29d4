#!/usr/bin/python3
"""The serving path against its ceilings, in one run (tests/bench/serving_path.sh).

Starts attention_server on deploy/models twice, batching on (the defaults) and
--batching=false, both on loopback, and drives them with attention_client bench on
the same machine: the client shares the cores with the server. Each ratio is the
median of --runs measurements, its two sides alternated, the first side swapped every
run (A B, B A, A B, ...) so that neither always runs first:

  health     toy default request (B 2, Q 4, K 6) req/s / Health req/s, concurrency 64
  batching   batching on / off req/s, toy and bert_base (B 1, Q = K = 32), c 1, 8, 64;
             also the mean rows per forward call batching on
  core       bert_base (8, 128) end-to-end p50 / core-alone Forward (mha_core_bench)
  cold       a fresh server's first bert_base (1, 96) request / median of the next 20
             (one fresh server per run; Python client, timed around the call, after a
             toy-model call has set up the connection and the client's first call)
  health_p99 Health p99 while bert_base (8, 128) requests run at concurrency 8
  floor      the floor under health and core: the same bench steps against
             transport_floor (tests/bench/transport_floor.cc), a gRPC server that answers
             Attend with zeros and does nothing else. Its toy / Health ratio is the most
             health could read if attention_server cost nothing but gRPC; its bert_base
             (8, 128) p50 / core Forward is the least that core's ratio could read above
             1, with glibc's allocator as attention_server has it and with large
             blocks kept (no mmap, no trim: no page faults under the copies).
             Printed as figures, not targets. Not in the default --only.

    tests/bench/serving_path.sh [--runs=5] [--duration=2] [--only=health,batching,...]
    tests/bench/serving_path.sh --only=floor
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BERT_TARGET_ROWS = 8


class Server:
    """An attention_server on a free loopback port, ready when it prints `listening on`."""

    def __init__(self, build, flags, log_dir, name, command=None, env=None):
        self.out = open(os.path.join(log_dir, name + ".out"), "w+")
        self.err = open(os.path.join(log_dir, name + ".err"), "w+")
        if command is None:
            command = [os.path.join(build, "server", "attention_server"), "--port=0",
                       "--metrics_port=-1", "--http_port=-1",
                       "--model_repository=" + os.path.join(ROOT, "deploy", "models")]
        self.proc = subprocess.Popen(command + flags, stdout=self.out, stderr=self.err, cwd=ROOT,
                                     env=None if env is None else dict(os.environ, **env))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            self.out.seek(0)
            match = re.search(r"^listening on (\S+)$", self.out.read(), re.M)
            if match:
                self.target = match.group(1)
                return
            if self.proc.poll() is not None:
                self.err.seek(0)
                sys.exit("server exited: " + self.err.read())
            time.sleep(0.02)
        sys.exit("server did not start in 120 s")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def bench(build, target, args, json_path, rpc="attend"):
    """One attention_client bench step; its JSON step."""
    subprocess.run(
        [os.path.join(build, "client", "attention_client"), "bench", "--target=" + target,
         "--rpc=" + rpc, "--warmup=1s", "--window=1s", "--progress=false", "--timeout=30s",
         "--json=" + json_path] + args, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    with open(json_path) as f:
        return json.load(f)["steps"][0]


def alternated(run, first, second):
    """(first(), second()), run in that order on even runs and swapped on odd ones."""
    if run % 2 == 0:
        x = first()
        return x, second()
    y = second()
    return first(), y


def ratio_line(name, ratios, target, better="higher"):
    median = statistics.median(ratios)
    ok = median >= target if better == "higher" else median <= target
    runs = " ".join(f"{r:.2f}" for r in ratios)
    sign = ">=" if better == "higher" else "<="
    print(f"{name:<44} {median:6.2f}  (target {sign} {target}; runs {runs})  "
          f"{'met' if ok else 'NOT met'}", flush=True)
    return ok


def measure_health(a, opts, tmp):
    ratios = []
    args = ["--model=toy", "--concurrency=64", f"--duration={opts.duration}s"]
    for run in range(opts.runs):
        toy, health = alternated(
            run, lambda: bench(opts.build, a.target, args, tmp + "/t.json"),
            lambda: bench(opts.build, a.target, args, tmp + "/h.json", rpc="health"))
        ratios.append(toy["requests_per_s"] / health["requests_per_s"])
    return ratio_line("toy req/s / Health req/s, c 64", ratios, 0.6)


def measure_batching(a, b, opts, tmp):
    ok = True
    for model in opts.models.split(","):
        for conc in map(int, opts.concurrency.split(",")):
            ratios, rows = [], []
            args = [f"--model={model}", "--batch=1", "--num_queries=32", "--num_keys=0",
                    "--valid_lens=none", f"--concurrency={conc}", f"--duration={opts.duration}s"]
            for run in range(opts.runs):
                on, off = alternated(run, lambda: bench(opts.build, a.target, args, tmp + "/on.json"),
                                     lambda: bench(opts.build, b.target, args, tmp + "/off.json"))
                ratios.append(on["requests_per_s"] / off["requests_per_s"])
                rows.append(on["server"]["batch_rows"])
            ok &= ratio_line(f"batching on/off {model} c {conc}", ratios,
                             1.1 if (model, conc) == ("bert_base", 8) else 0.97)
            print(f"{'':<44} mean rows per call, batching on: {statistics.median(rows):.1f}")
    return ok


def core_forward_ms(opts):
    out = subprocess.run(
        [os.path.join(opts.build, "tests", "bench", "mha_core_bench"),
         "--benchmark_filter=^Forward/bert_base/f32", "--benchmark_format=json",
         "--benchmark_min_time=0.5"], check=True, capture_output=True, text=True).stdout
    result = json.loads(out)["benchmarks"][0]
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0}[result["time_unit"]]
    return result["real_time"] * scale


def bert_core_args(opts):
    """bert_base (8, 128) self-attention requests, one at a time."""
    return ["--model=bert_base", f"--batch={BERT_TARGET_ROWS}", "--num_queries=128",
            "--num_keys=0", "--valid_lens=none", "--concurrency=1", f"--duration={opts.duration}s"]


def measure_core(a, opts, tmp):
    ratios = []
    for _ in range(opts.runs):
        served = bench(opts.build, a.target, bert_core_args(opts), tmp + "/core.json")
        ratios.append(served["latency_us"]["p50"] / 1e3 / core_forward_ms(opts))
    return ratio_line("bert_base (8, 128) p50 / core Forward", ratios, 1.1, better="lower")


def measure_cold(opts, tmp):
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))
    import numpy as np
    import mha_serve
    ratios = []
    rng = np.random.default_rng(0)
    queries = rng.standard_normal((1, 96, 768), dtype=np.float32)
    for run in range(opts.runs):
        server = Server(opts.build, opts.server_flags.split(), tmp, f"cold{run}")
        try:
            with mha_serve.Client(server.target) as client:
                # The connection and the client's own first call (toy model, another
                # shape) come before the clock: the figure is the server's for the shape.
                client.attend(np.zeros((1, 4, 100), np.float32), model="toy")
                times = []
                for _ in range(21):
                    start = time.perf_counter()
                    client.attend(queries, model="bert_base")
                    times.append(time.perf_counter() - start)
        finally:
            server.stop()
        ratios.append(times[0] / statistics.median(times[1:]))
        print(f"{'':<44} run {run}: first {times[0] * 1e3:.2f} ms, next 20 median "
              f"{statistics.median(times[1:]) * 1e3:.2f} ms", flush=True)
    return ratio_line("fresh server: first / next-20 median (1, 96)", ratios, 2, better="lower")


def measure_health_p99(a, opts, tmp):
    p99s = []
    for _ in range(opts.runs):
        load = subprocess.Popen(
            [os.path.join(opts.build, "client", "attention_client"), "bench",
             "--target=" + a.target, "--model=bert_base", f"--batch={BERT_TARGET_ROWS}",
             "--num_queries=128", "--num_keys=0", "--valid_lens=none", "--concurrency=8",
             "--warmup=0s", f"--duration={opts.duration + 3}s", "--progress=false",
             "--timeout=30s"], stdout=subprocess.DEVNULL, cwd=ROOT)
        time.sleep(1.0)
        health = bench(opts.build, a.target, ["--model=bert_base", "--concurrency=1", f"--duration={opts.duration}s"],
                       tmp + "/hp.json", rpc="health")
        load.wait(timeout=120)
        p99s.append(health["latency_us"]["p99"] / 1e3)
    return ratio_line("Health p99 ms beside bert_base (8, 128) c 8", p99s, 5, better="lower")


def figure_line(name, figures, unit=""):
    runs = " ".join(f"{f:.2f}" for f in figures)
    print(f"{name:<44} {statistics.median(figures):6.2f}{unit}  (runs {runs})", flush=True)


def measure_floor(a, opts, tmp):
    """The health and core ratios' floors, from transport_floor beside server `a`."""
    binary = [os.path.join(opts.build, "tests", "bench", "transport_floor")]
    flags = ["--models_from=" + a.target]
    floor = Server(opts.build, flags, tmp, "floor", command=binary)
    kept = Server(opts.build, flags, tmp, "floor_kept", command=binary,
                  env={"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432:"
                                         "glibc.malloc.trim_threshold=67108864"})
    toy_args = ["--model=toy", "--concurrency=64", f"--duration={opts.duration}s"]
    toy_health, health_real, bert_core, kept_core = [], [], [], []
    try:
        for run in range(opts.runs):
            toy, health = alternated(
                run, lambda: bench(opts.build, floor.target, toy_args, tmp + "/ft.json"),
                lambda: bench(opts.build, floor.target, toy_args, tmp + "/fh.json", rpc="health"))
            toy_health.append(toy["requests_per_s"] / health["requests_per_s"])
            real = bench(opts.build, a.target, toy_args, tmp + "/rh.json", rpc="health")
            health_real.append(real["requests_per_s"] / health["requests_per_s"])
            p50s = alternated(
                run, lambda: bench(opts.build, floor.target, bert_core_args(opts), tmp + "/fc.json"),
                lambda: bench(opts.build, kept.target, bert_core_args(opts), tmp + "/kc.json"))
            core = core_forward_ms(opts)
            bert_core.append(p50s[0]["latency_us"]["p50"] / 1e3 / core)
            kept_core.append(p50s[1]["latency_us"]["p50"] / 1e3 / core)
    finally:
        floor.stop()
        kept.stop()
    figure_line("floor: toy req/s / Health req/s, c 64", toy_health)
    figure_line("Health req/s, attention_server / floor", health_real)
    figure_line("floor: bert_base (8, 128) p50 / core Forward", bert_core)
    figure_line("  the same, large blocks kept", kept_core)
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build", "release"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--duration", type=int, default=2, help="seconds per bench step")
    parser.add_argument("--only", default="health,batching,core,cold,health_p99")
    parser.add_argument("--server_flags", default="", help="extra flags for every server")
    parser.add_argument("--models", default="toy,bert_base", help="batching: the models")
    parser.add_argument("--concurrency", default="1,8,64", help="batching: the levels")
    opts = parser.parse_args()
    only = set(opts.only.split(","))
    tmp = tempfile.mkdtemp(prefix="mha_serving_path.")
    print(f"{os.cpu_count()} CPUs shared by server and client; {opts.runs} alternated runs; "
          f"logs in {tmp}", flush=True)
    results = []
    if only & {"health", "batching", "core", "health_p99", "floor"}:
        extra = opts.server_flags.split()
        a = Server(opts.build, extra, tmp, "batching_on")
        b = Server(opts.build, extra + ["--batching=false"], tmp, "batching_off")
        try:
            if "health" in only:
                results.append(measure_health(a, opts, tmp))
            if "batching" in only:
                results.append(measure_batching(a, b, opts, tmp))
            if "core" in only:
                results.append(measure_core(a, opts, tmp))
            if "health_p99" in only:
                results.append(measure_health_p99(a, opts, tmp))
            if "floor" in only:
                results.append(measure_floor(a, opts, tmp))
        finally:
            a.stop()
            b.stop()
    if "cold" in only:
        results.append(measure_cold(opts, tmp))
    print("all targets met" if all(results) else "some targets not met")


if __name__ == "__main__":
    main()
