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
3. One copy of the model: a folder bert_copy (bert_base under another name) is
   added and loaded (its default warm-up included: the weights packed as serving
   packs them; the workspaces are the server's shared pool), RSS measured before and
   after at rest; then it is removed again. A reload of the tiny model "toy" before
   each reading retires a model, which returns freed pages (malloc_trim), so both
   readings are of trimmed heaps.
Prints every figure, and the bound on the extra peak: one model copy + 10% of the
steady RSS. Fails when a bench request fails, or when the RSS at rest (no load,
freed pages returned) grows by a model copy or more from the first swap to the
last (old versions not freed). Slow: skipped (exit 77) unless MHA_SLOW_TESTS=1. The load client shares the machine's
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


def main():
    if os.environ.get("MHA_SLOW_TESTS") != "1":
        print("reload_memory: skipped (slow; MHA_SLOW_TESTS=1 runs it)")
        return 77
    parser = argparse.ArgumentParser()
    parser.add_argument("server")
    parser.add_argument("client")
    parser.add_argument("source_dir")
    parser.add_argument("--swaps", type=int, default=3)
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="mha_reload_memory_")
    repository = os.path.join(work, "models")
    for name in ("bert_base", "toy"):
        shutil.copytree(os.path.join(args.source_dir, "deploy", "models", name),
                        os.path.join(repository, name))
    config = os.path.join(repository, "bert_base", "config.pbtxt")
    proc, target = start_server(args.server, [f"--model_repository={repository}",
                                              "--http_port=-1"])
    failed = False
    peaks, afters = [], []
    reloads = 0
    try:
        log = StderrLines(proc)

        def reload():
            nonlocal reloads
            reloads += 1
            proc.send_signal(signal.SIGHUP)
            log.wait_for("repository: reload done", reloads)

        def set_seed(path, seed):
            with open(path) as f:
                text = f.read()
            with open(path, "w") as f:
                f.write(re.sub(r"seed: \d+", f"seed: {seed}", text))

        def trimmed_rss(seed):  # reloading toy retires a model: its pages go back
            set_seed(os.path.join(repository, "toy", "config.pbtxt"), seed)
            reload()
            return status_kb(proc.pid, "VmRSS")

        bench(args.client, target, 8)
        steady = status_kb(proc.pid, "VmRSS")
        print(f"steady RSS after 8 s of bench (B 8, Q 128, c 8): {steady / 1024:.1f} MiB")

        before = trimmed_rss(1000)
        copy = os.path.join(repository, "bert_copy")
        shutil.copytree(os.path.join(repository, "bert_base"), copy)
        with open(os.path.join(copy, "config.pbtxt")) as f:
            text = f.read()
        with open(os.path.join(copy, "config.pbtxt"), "w") as f:
            f.write(text.replace('name: "bert_base"', 'name: "bert_copy"'))
        reload()
        model = trimmed_rss(1001) - before
        shutil.rmtree(copy)
        reload()

        def window_peak():  # VmHWM over a 4 s bench window
            with open(f"/proc/{proc.pid}/clear_refs", "w") as f:
                f.write("5")
            bench(args.client, target, 4)
            return status_kb(proc.pid, "VmHWM")

        for swap in range(1, args.swaps + 1):
            control = window_peak()
            set_seed(config, 100 + swap)
            reloads += 1
            proc.send_signal(signal.SIGHUP)
            peak = window_peak()  # the reload happens during this window
            log.wait_for("repository: reload done", reloads)
            after = trimmed_rss(2000 + swap)  # at rest: no load, freed pages returned
            peaks.append(peak - control)
            afters.append(after)
            print(f"swap {swap}: VmHWM {peak / 1024:.1f} MiB against {control / 1024:.1f} MiB in "
                  f"the window before without a swap (+{(peak - control) / 1024:.1f}), RSS at "
                  f"rest after it {after / 1024:.1f} MiB, bench 0 failed")
    finally:
        stop_server(proc)
    weights = 4 * (768 * 768 + 768) * 4
    print(f"bert_base: weights {weights / 2**20:.1f} MiB as f32 parameters; one loaded, warmed "
          f"copy holds {model / 1024:.1f} MiB resident")
    bound = model + steady * 0.10
    print(f"a swap's extra peak: max +{max(peaks) / 1024:.1f} MiB; bound one model copy + 10% "
          f"of steady = +{bound / 1024:.1f} MiB (with the f32 parameters instead of the "
          f"resident copy: +{(weights / 1024 + steady * 0.10) / 1024:.1f} MiB)")
    # The old versions are freed: RSS at rest does not grow with the swaps (each
    # leaked version would add a model copy).
    growth = afters[-1] - afters[0]
    print(f"RSS at rest from swap 1 to swap {len(afters)}: {growth / 1024:+.1f} MiB")
    if growth >= model:
        print("FAIL: RSS at rest grew by a model copy or more: old versions stay")
        failed = True
    shutil.rmtree(work, ignore_errors=True)
    print("reload_memory: " + ("FAILED" if failed else "passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
