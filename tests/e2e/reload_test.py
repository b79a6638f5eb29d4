#!/usr/bin/python3
"""Model hot reload under load, end to end: the real attention_server and
attention_client.

Run twice: --model_control=none (each re-read triggered by SIGHUP) and
--model_control=poll --repository_poll_secs=1 (no signal; the poller finds the
change). In each mode:

  1. A temporary repository with models a (seed 1) and b (seed 2), toy sizes
     (p_o 100, h 5). The server starts on it.
  2. OLD = a's answer to fixed inputs X (attention.v1 Attend).
  3. `attention_client bench` drives a at concurrency 8 for 10 s. Meanwhile:
     (i)  a's config.pbtxt becomes seed 7 -> the server logs `model a: reloaded`
          and `repository: reload done (loaded 1, unloaded 0, failed 0)`;
     (ii) folder c (seed 7, the same model as the new a) appears and folder b
          goes -> `model c: loaded`, `model b: unloaded`, reload done (1, 1, 0).
     A thread calls a with X back to back: every answer is OLD or NEW (NEW = c's
     answer to X), and after the first NEW no answer is OLD.
  4. bench failed no request; a answers NEW (!= OLD); b answers NOT_FOUND naming
     b; RepositoryIndex lists a and c READY (no reason) and not b.
  5. a's config.pbtxt names a truncated weights.safetensors -> `model a: load
     failed, the previous version keeps serving: ...weights.safetensors...`,
     reload done (0, 0, 1); a still answers NEW; RepositoryIndex lists a READY
     with a reason naming weights.safetensors.
  6. SIGTERM: the server exits 0.

In poll mode the server may log a reload-done line on every poll (zeros when
idle), and one change may straddle two polls: each step waits until the counts
of the reload-done lines logged since the change add up to what the step
expects (and fails if they go past it). In none mode each SIGHUP must produce exactly one line with
exactly those counts. At the end the counts of every reload-done line of the
run must add up to (loaded 2, unloaded 1, failed 1): nothing was reloaded twice.

Every change to the repository is atomic on disk (a file or folder is staged
outside the repository and renamed in; b is renamed out before it is deleted),
so a poll never sees a half-written config or a half-deleted folder.

    reload_test.py SERVER_BINARY CLIENT_BINARY [SOURCE_DIR] [--mode=none|poll|both]
                   [--show_log]

The gRPC stubs are generated at run time from SOURCE_DIR/proto into a
temporary directory (as tests/integration/kserve_grpc_test.py does).
"""

import argparse
import json
import os
import re
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types

import grpc
import numpy as np
from grpc_tools import protoc

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))

from server_harness import start_server, stop_server  # noqa: E402

TOY = "num_hiddens: 100 num_heads: 5"
SEED_A, SEED_B, SEED_NEW = 1, 2, 7
POLL_SECS = 1
BENCH_SECONDS = 10
BENCH_CONCURRENCY = 8
TOLERANCE = 1e-6        # same model, same inputs: bitwise in practice
DISTINCT = 1e-3         # different seeds differ by O(0.1)
CALL_TIMEOUT = 10.0     # each gRPC call
START_TIMEOUT = 60.0    # server start-up and models READY
RELOAD_TIMEOUT = 30.0   # one reload step (a load with its warm-up, plus a poll)
BENCH_START_TIMEOUT = 20.0
CHECKER_MIN_CALLS = 20  # answers the checker must see before a change and after NEW
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1),
                   ("grpc.max_send_message_length", -1)]

RELOAD_DONE = re.compile(r"repository: reload done \(loaded (\d+), unloaded (\d+), failed (\d+)\)")


class TestFailure(AssertionError):
    pass


def check(condition, message):
    if not condition:
        raise TestFailure(message)


# --- stubs ---------------------------------------------------------------------

def load_api(source, out_dir):
    """Generates the attention.v1 and inference stubs of SOURCE/proto into out_dir."""
    proto_dir = os.path.join(source, "proto")
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    files = ["attention.proto", "inference/grpc_service.proto", "inference/model_config.proto"]
    code = protoc.main(["grpc_tools.protoc", f"-I{proto_dir}", f"-I{include}",
                        f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", *files])
    if code != 0:
        raise RuntimeError(f"protoc failed on {proto_dir} (exit {code})")
    sys.path.insert(0, out_dir)
    import attention_pb2  # noqa: E402  (generated above)
    import attention_pb2_grpc  # noqa: E402
    from inference import grpc_service_pb2  # noqa: E402
    from inference import grpc_service_pb2_grpc  # noqa: E402
    return types.SimpleNamespace(a=attention_pb2, a_grpc=attention_pb2_grpc,
                                 inf=grpc_service_pb2, inf_grpc=grpc_service_pb2_grpc)


API = None


def inputs_x():
    """Fixed cross-attention inputs: queries (2, 4, 100), keys and values (2, 6, 100)."""
    rng = np.random.default_rng(20240611)
    def draw(*shape):
        return rng.uniform(-1.0, 1.0, shape).astype(np.float32)
    return draw(2, 4, 100), draw(2, 6, 100), draw(2, 6, 100)


def attend(stub, model, x, timeout=CALL_TIMEOUT):
    """attention.v1 Attend of `model` on x = (queries, keys, values); the output."""
    def tensor(array):
        array = np.ascontiguousarray(array, dtype="<f4")
        return API.a.Tensor(shape=list(array.shape), raw=array.tobytes())
    q, k, v = x
    request = API.a.AttendRequest(model=model, queries=tensor(q), keys=tensor(k),
                                  values=tensor(v))
    out = stub.Attend(request, timeout=timeout).output
    shape = tuple(out.shape)
    if out.raw:
        return np.frombuffer(out.raw, dtype="<f4").reshape(shape)
    return np.array(out.data, dtype=np.float32).reshape(shape)


def max_diff(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def index_of(inf_stub):
    """RepositoryIndex as {name: ModelIndex}."""
    response = inf_stub.RepositoryIndex(API.inf.RepositoryIndexRequest(), timeout=CALL_TIMEOUT)
    return {m.name: m for m in response.models}


def describe_index(index):
    return "; ".join(f"{m.name} {m.state} reason={m.reason!r}" for m in index.values()) or "(empty)"


# --- the server's output ---------------------------------------------------------

class ServerLog:
    """Drains the server's stdout and stderr (start_server leaves both as pipes)
    into lines, non-blockingly, on a thread; wait() blocks on a condition until
    a predicate over the stderr lines holds. stop() ends the thread without
    closing the pipes, so that stop_server can read the rest."""

    def __init__(self, proc):
        self.proc = proc
        self.lines = []        # stderr, decoded
        self.out_lines = []    # stdout
        self.closed = False    # both pipes at EOF: the server exited
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="server-log", daemon=True)
        self._thread.start()

    def _run(self):
        selector = selectors.DefaultSelector()
        pending = {}
        for stream, sink in ((self.proc.stderr, self.lines), (self.proc.stdout, self.out_lines)):
            selector.register(stream.fileno(), selectors.EVENT_READ, sink)
            pending[stream.fileno()] = b""
        open_fds = len(pending)
        while open_fds and not self._stop.is_set():
            for key, _ in selector.select(timeout=0.1):
                chunk = os.read(key.fd, 65536)
                with self._cond:
                    if not chunk:
                        selector.unregister(key.fd)
                        open_fds -= 1
                        if pending[key.fd]:
                            key.data.append(pending[key.fd].decode(errors="replace"))
                            pending[key.fd] = b""
                    else:
                        data = pending[key.fd] + chunk
                        *complete, pending[key.fd] = data.split(b"\n")
                        key.data.extend(line.decode(errors="replace") for line in complete)
                    self._cond.notify_all()
        with self._cond:
            self.closed = open_fds == 0
            self._cond.notify_all()
        selector.close()

    def mark(self):
        with self._cond:
            return len(self.lines)

    def since(self, mark):
        with self._cond:
            return list(self.lines[mark:])

    def wait(self, predicate, timeout, what):
        """Waits until predicate(lines) returns a non-None value and returns it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                result = predicate(list(self.lines))
                if result is not None:
                    return result
                if self.closed:
                    code = self.proc.wait()
                    name = f" ({signal.Signals(-code).name})" if code < 0 else ""
                    raise TestFailure(f"the server exited with {code}{name} while waiting "
                                      f"for {what}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TestFailure(f"timed out after {timeout:.0f}s waiting for {what}")
                self._cond.wait(min(left, 0.5))

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5)

    def dump(self, out=sys.stdout):
        with self._cond:
            lines = list(self.lines)
        print(f"--- server stderr ({len(lines)} lines) ---", file=out)
        for line in lines:
            print(f"  {line}", file=out)
        print("--- end of server stderr ---", file=out, flush=True)


def reload_counts(lines):
    """[(index, (loaded, unloaded, failed))] of the reload-done lines."""
    found = []
    for i, line in enumerate(lines):
        match = RELOAD_DONE.search(line)
        if match:
            found.append((i, tuple(int(g) for g in match.groups())))
    return found


def wait_reload(log, mark, expected, mode, what):
    """Waits for the reload-done line(s) of a change made after `mark`; returns the
    stderr lines from `mark` to the last of them (the per-model lines come first).

    none: the first reload-done line after mark must carry exactly `expected`.
    poll: the counts of the reload-done lines since mark must add up to
    `expected` (a change may straddle two polls; idle polls log zeros)."""
    expected = tuple(expected)
    labels = ("loaded", "unloaded", "failed")

    def show(counts):
        return ", ".join(f"{l} {c}" for l, c in zip(labels, counts))

    def done(lines):
        found = [(i, c) for i, c in reload_counts(lines) if i >= mark]
        if mode == "none":
            if not found:
                return None
            index, counts = found[0]
            check(counts == expected,
                  f"{what}: the reload after SIGHUP logged ({show(counts)}), expected "
                  f"({show(expected)}): {lines[index]!r}")
            return index
        total = (0, 0, 0)
        for index, counts in found:
            total = tuple(t + c for t, c in zip(total, counts))
            check(all(t <= e for t, e in zip(total, expected)),
                  f"{what}: the polls since the change logged ({show(total)}) in all, more "
                  f"than the expected ({show(expected)}): "
                  f"{[lines[i] for i, _ in found[:found.index((index, counts)) + 1]]}")
            if total == expected:
                return index
        return None

    how = "SIGHUP" if mode == "none" else f"a poll (every {POLL_SECS}s)"
    last = log.wait(done, RELOAD_TIMEOUT,
                    f"{what}: 'repository: reload done ({show(expected)})' after {how}")
    return log.since(mark)[:last - mark + 1]


def expect_line(lines, needle, what, also=None):
    """The first of `lines` containing `needle` (and `also`, when given)."""
    for line in lines:
        if needle in line and (also is None or also in line):
            return line
    extra = f" and {also!r}" if also else ""
    raise TestFailure(f"{what}: no stderr line with {needle!r}{extra} before the reload-done "
                      f"line; lines since the change: {lines}")


def expect_no_line(lines, needle, what):
    bad = [line for line in lines if needle in line]
    check(not bad, f"{what}: unexpected stderr line(s) {bad}")


# --- the repository ----------------------------------------------------------------

def truncated_safetensors(path):
    """A safetensors file whose header promises 120000 bytes of data and that
    holds 64: a weights file cut short."""
    header = json.dumps({"in_proj_weight": {"dtype": "F32", "shape": [300, 100],
                                            "data_offsets": [0, 120000]}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + b"\0" * 64)


class Repository:
    """DIR/<model>/config.pbtxt, changed atomically: files and folders are written
    under `staging` (same file system, outside DIR) and renamed in."""

    def __init__(self, work):
        self.path = os.path.join(work, "models")
        self.staging = os.path.join(work, "staging")
        os.makedirs(self.path)
        os.makedirs(self.staging)
        self._n = 0

    def _staged(self, name):
        self._n += 1
        return os.path.join(self.staging, f"{self._n}-{name}")

    def add_model(self, name, config, extra_files=()):
        """A new folder `name` with config.pbtxt (and (file name, writer) pairs),
        appearing in one rename."""
        folder = self._staged(name)
        os.makedirs(folder)
        with open(os.path.join(folder, "config.pbtxt"), "w") as f:
            f.write(config + "\n")
        for file_name, write in extra_files:
            write(os.path.join(folder, file_name))
        os.rename(folder, os.path.join(self.path, name))

    def write_config(self, name, config):
        """Replaces <name>/config.pbtxt in one rename; its mtime always changes
        (bumped when the file system's clock did not move)."""
        target = os.path.join(self.path, name, "config.pbtxt")
        before = os.stat(target).st_mtime_ns
        staged = self._staged("config.pbtxt")
        with open(staged, "w") as f:
            f.write(config + "\n")
        if os.stat(staged).st_mtime_ns == before:
            os.utime(staged, ns=(before + 10**9, before + 10**9))
        os.replace(staged, target)

    def remove_model(self, name):
        """The folder leaves the repository in one rename, then is deleted."""
        gone = self._staged(name)
        os.rename(os.path.join(self.path, name), gone)
        shutil.rmtree(gone)


def seeded(seed):
    return f"{TOY} seeded {{ seed: {seed} }}"


# --- the load: attention_client bench, and a checker thread -----------------------------

class Bench:
    """attention_client bench against one model; output in files (no pipes to drain)."""

    def __init__(self, client, target, model, work):
        self.json_path = os.path.join(work, "bench.json")
        self.out_path = os.path.join(work, "bench.out")
        self.err_path = os.path.join(work, "bench.err")
        self.command = [
            client, "bench", f"--target={target}", f"--model={model}",
            f"--concurrency={BENCH_CONCURRENCY}", f"--duration={BENCH_SECONDS}s",
            "--warmup=0s", "--window=1s",
            # Never "stable": the step runs the whole duration, every window counted.
            "--max_windows=1000", "--stable_windows=1000",
            # Count every failure instead of ending the run at the 10th.
            "--max_errors=0", "--timeout=30s", "--progress=true",
            f"--json={self.json_path}"]
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=err)

    def output(self):
        text = ""
        for label, path in (("stdout", self.out_path), ("stderr", self.err_path)):
            with open(path) as f:
                text += f"--- bench {label} ---\n{f.read()}"
        return text

    def wait_first_window(self):
        """Until bench has measured its first window (load is flowing)."""
        deadline = time.monotonic() + BENCH_START_TIMEOUT
        while time.monotonic() < deadline:
            with open(self.err_path) as f:
                if re.search(r"window 1:", f.read()):
                    return
            if self.proc.poll() is not None:
                raise TestFailure(f"bench exited ({self.proc.returncode}) before its first "
                                  f"window:\n{self.output()}")
            time.sleep(0.05)
        raise TestFailure(f"bench measured no window in {BENCH_START_TIMEOUT:.0f}s:\n"
                          f"{self.output()}")

    def running(self):
        return self.proc.poll() is None

    def finish(self):
        """Waits for the end; returns (exit code, the step of the JSON report)."""
        try:
            code = self.proc.wait(timeout=BENCH_SECONDS + 60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise TestFailure(f"bench did not end within {BENCH_SECONDS + 60}s of "
                              f"--duration={BENCH_SECONDS}s:\n{self.output()}")
        if not os.path.exists(self.json_path):
            raise TestFailure(f"bench exited {code} without its JSON report:\n{self.output()}")
        with open(self.json_path) as f:
            report = json.load(f)
        steps = report.get("steps", [])
        check(len(steps) == 1, f"bench: expected one step, got {len(steps)}:\n{self.output()}")
        return code, steps[0]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Checker(threading.Thread):
    """Calls `model` with x back to back, recording each answer (or error) in order.
    One call at a time, so answer i+1 was admitted after answer i came back."""

    def __init__(self, stub, model, x):
        super().__init__(name="checker", daemon=True)
        self.stub, self.model, self.x = stub, model, x
        self.answers = {}     # bytes -> (id, array)
        self.sequence = []    # answer ids in order; -1 = an error
        self.errors = []      # (call number, code, details)
        self._halt = threading.Event()
        self._cond = threading.Condition()

    def run(self):
        while not self._halt.is_set():
            try:
                out = attend(self.stub, self.model, self.x)
                key = out.tobytes()
                with self._cond:
                    if key not in self.answers:
                        self.answers[key] = (len(self.answers), out.copy())
                    self.sequence.append(self.answers[key][0])
                    self._cond.notify_all()
            except grpc.RpcError as e:
                with self._cond:
                    self.errors.append((len(self.sequence), e.code().name, e.details()))
                    self.sequence.append(-1)
                    self._cond.notify_all()
                time.sleep(0.01)

    def calls(self):
        with self._cond:
            return len(self.sequence)

    def wait_calls(self, count, timeout, what):
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.sequence) < count:
                left = deadline - time.monotonic()
                if left <= 0 or not self.is_alive():
                    raise TestFailure(f"checker: {len(self.sequence)} calls of {self.model} "
                                      f"in {timeout:.0f}s, expected {count} ({what})")
                self._cond.wait(min(left, 0.5))

    def stop(self):
        self._halt.set()
        self.join(timeout=CALL_TIMEOUT + 5)

    def verify(self, old, new):
        """Every answer OLD or NEW, none failed, OLD seen, NEW seen, and no OLD after
        the first NEW. Returns a summary."""
        check(not self.errors,
              f"checker: {len(self.errors)} of {len(self.sequence)} calls of {self.model} "
              f"failed during the reloads; first ones: {self.errors[:5]}")
        label = {}
        for _, (answer_id, out) in self.answers.items():
            d_old, d_new = max_diff(out, old), max_diff(out, new)
            if d_old <= TOLERANCE:
                label[answer_id] = "OLD"
            elif d_new <= TOLERANCE:
                label[answer_id] = "NEW"
            else:
                calls = [i for i, a in enumerate(self.sequence) if a == answer_id]
                raise TestFailure(
                    f"checker: call(s) {calls[:5]} (of {len(self.sequence)}) of "
                    f"{self.model} answered neither OLD (max diff {d_old:.3g}) nor NEW "
                    f"(max diff {d_new:.3g}), tolerance {TOLERANCE}")
        labels = [label[a] for a in self.sequence]
        check("OLD" in labels, f"checker: no answer equal to OLD in {len(labels)} calls "
                               "(the checker started after the reload?)")
        check("NEW" in labels, f"checker: no answer equal to NEW in {len(labels)} calls "
                               "(a never served the new weights to the checker)")
        first_new = labels.index("NEW")
        late_old = [i for i in range(first_new, len(labels)) if labels[i] == "OLD"]
        check(not late_old,
              f"checker: call {first_new} of {self.model} answered NEW, yet later calls "
              f"{late_old[:10]} ({len(late_old)} in all) answered OLD: the swap is not "
              "atomic")
        return (f"{len(labels)} calls: {first_new} OLD then {len(labels) - first_new} NEW, "
                f"{len(self.answers)} distinct answer(s)")


# --- one mode ------------------------------------------------------------------------

def run_mode(mode, server_binary, client_binary, show_log=False):
    started = time.monotonic()
    work = tempfile.mkdtemp(prefix=f"mha_reload_{mode}_")
    repo = Repository(work)
    # a also holds a truncated weights.safetensors from the start: unused while a
    # is seeded, so that breaking a in step 5 is one atomic change (config.pbtxt
    # only) rather than two that a poll could see apart.
    repo.add_model("a", seeded(SEED_A),
                   extra_files=[("weights.safetensors", truncated_safetensors)])
    repo.add_model("b", seeded(SEED_B))
    args = [f"--model_repository={repo.path}", f"--model_control={mode}"]
    if mode == "poll":
        args.append(f"--repository_poll_secs={POLL_SECS}")

    proc, target = start_server(server_binary, args, timeout=START_TIMEOUT)
    log = ServerLog(proc)
    channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    bench = checker = None
    stopped = False
    print(f"[{mode}] server {target}, repository {repo.path}", flush=True)
    try:
        att = API.a_grpc.AttentionServiceStub(channel)
        inf = API.inf_grpc.GRPCInferenceServiceStub(channel)
        x = inputs_x()

        # 1-2: both models READY, then OLD.
        deadline = time.monotonic() + START_TIMEOUT
        for name in ("a", "b"):
            while True:
                try:
                    if inf.ModelReady(API.inf.ModelReadyRequest(name=name),
                                      timeout=CALL_TIMEOUT).ready:
                        break
                except grpc.RpcError as e:
                    if time.monotonic() > deadline:
                        raise TestFailure(f"model {name} not ready: {e.code().name}: "
                                          f"{e.details()}")
                check(time.monotonic() < deadline,
                      f"model {name} not READY {START_TIMEOUT:.0f}s after start-up")
                time.sleep(0.05)
        old = attend(att, "a", x)
        check(max_diff(old, attend(att, "a", x)) <= TOLERANCE,
              "a answers the same inputs differently twice in a row")
        check(max_diff(old, attend(att, "b", x)) > DISTINCT,
              "a (seed 1) and b (seed 2) answer alike: the seeds do not matter?")

        # 3: load on a, and the checker.
        bench = Bench(client_binary, target, "a", work)
        bench.wait_first_window()
        checker = Checker(att, "a", x)
        checker.start()
        checker.wait_calls(CHECKER_MIN_CALLS, 10, "before the first change")

        def trigger():
            if mode == "none":
                proc.send_signal(signal.SIGHUP)

        # (i) a changes: seed 7.
        mark = log.mark()
        repo.write_config("a", seeded(SEED_NEW))
        trigger()
        lines = wait_reload(log, mark, (1, 0, 0), mode, "step (i), a rewritten with seed 7")
        expect_line(lines, "model a: reloaded", "step (i)")
        expect_no_line(lines, "load failed", "step (i)")
        print(f"[{mode}] (i) {lines[-1].strip()}", flush=True)

        # (ii) c appears (seed 7, as the new a), b goes.
        mark = log.mark()
        repo.add_model("c", seeded(SEED_NEW))
        repo.remove_model("b")
        trigger()
        lines = wait_reload(log, mark, (1, 1, 0), mode, "step (ii), c added and b removed")
        expect_line(lines, "model c: loaded", "step (ii)")
        expect_line(lines, "model b: unloaded", "step (ii)")
        expect_no_line(lines, "load failed", "step (ii)")
        expect_no_line(lines, "model a: reloaded", "step (ii)")
        print(f"[{mode}] (ii) {lines[-1].strip()}", flush=True)
        check(bench.running(),
              f"bench ended before both reloads were done (--duration={BENCH_SECONDS}s): "
              "the reloads were not tested under load; is the machine that slow?")

        new = attend(att, "c", x)
        check(max_diff(new, old) > DISTINCT,
              "c (seed 7) answers like the old a (seed 1): the seeds do not matter?")
        checker.wait_calls(checker.calls() + CHECKER_MIN_CALLS, 10, "after c loaded")
        checker.stop()
        check(not checker.is_alive(), "the checker thread did not stop")

        # 4: bench's verdict, the checker's, the answers and the index.
        code, step = bench.finish()
        failed = sum(step.get("all_errors", {}).values())
        check(failed == 0 and code == 0,
              f"bench: {failed} failed request(s) {step.get('all_errors')}, exit {code}, "
              "while a was reloaded and b unloaded (bench's output above)")
        check(step.get("ok", 0) > 0, "bench: no request succeeded (bench's output above)")
        print(f"[{mode}] bench: {step['sent']} sent, {step['ok']} ok in the measured windows, "
              f"{step['requests_per_s']:.0f} req/s, 0 failed", flush=True)
        summary = checker.verify(old, new)
        print(f"[{mode}] checker: {summary}", flush=True)

        after = attend(att, "a", x)
        check(max_diff(after, new) <= TOLERANCE,
              f"a after the reload does not answer like c (same seed): max diff "
              f"{max_diff(after, new):.3g}")
        check(max_diff(after, old) > DISTINCT, "a still answers OLD after the reload")

        try:
            attend(att, "b", x)
            raise TestFailure("b answered after its folder was removed")
        except grpc.RpcError as e:
            check(e.code() == grpc.StatusCode.NOT_FOUND,
                  f"b after removal: expected NOT_FOUND, got {e.code().name}: {e.details()}")
            check(re.search(r"(^|[^A-Za-z0-9_])b([^A-Za-z0-9_]|$)", e.details() or ""),
                  f"b after removal: NOT_FOUND does not name b: {e.details()!r}")

        index = index_of(inf)
        for name in ("a", "c"):
            check(name in index and index[name].state == "READY",
                  f"RepositoryIndex: {name} not READY: {describe_index(index)}")
            check(index[name].reason == "",
                  f"RepositoryIndex: READY {name} carries a reason: {describe_index(index)}")
        check("b" not in index, f"RepositoryIndex still lists b: {describe_index(index)}")

        # 5: break a; the previous version (seed 7) keeps serving.
        mark = log.mark()
        repo.write_config("a", f'{TOY} file: "weights.safetensors"')
        trigger()
        lines = wait_reload(log, mark, (0, 0, 1), mode,
                            "step 5, a pointing at a truncated weights.safetensors")
        failure = expect_line(lines, "model a: load failed, the previous version keeps serving: ",
                              "step 5", also="weights.safetensors")
        expect_no_line(lines, "model a: reloaded", "step 5")
        expect_no_line(lines, ": unloaded", "step 5")
        done = lines[-1]
        check("failed 1" in done, f"step 5: the reload-done line does not say failed 1: {done!r}")
        print(f"[{mode}] (5) {failure.strip()}", flush=True)

        still = attend(att, "a", x)
        check(max_diff(still, new) <= TOLERANCE,
              f"a after the failed load does not answer NEW: max diff "
              f"{max_diff(still, new):.3g} (OLD: {max_diff(still, old):.3g})")
        index = index_of(inf)
        check("a" in index and index["a"].state == "READY",
              f"RepositoryIndex after the failed load: a not READY: {describe_index(index)}")
        check("weights.safetensors" in index["a"].reason,
              f"RepositoryIndex: a's reason does not name weights.safetensors: "
              f"{describe_index(index)}")
        check("c" in index and index["c"].state == "READY",
              f"RepositoryIndex after the failed load: c not READY: {describe_index(index)}")

        # Nothing reloads twice (a failed load is not retried until its files
        # change): poll mode, a few more polls first.
        if mode == "poll":
            time.sleep(2.5 * POLL_SECS)
        found = reload_counts(log.since(0))
        total = tuple(sum(c[k] for _, c in found) for k in range(3))
        check(total == (2, 1, 1),
              f"the reload-done lines of the run add up to (loaded, unloaded, failed) = "
              f"{total}, expected (2, 1, 1): {[log.since(0)[i] for i, c in found if any(c)]}")
        if mode == "none":
            check(len(found) == 3, f"{len(found)} reload-done lines for 3 SIGHUPs")

        # 6: a clean stop.
        channel.close()
        log.stop()
        stopped = True
        code = stop_server(proc)
        check(code == 0, f"the server exited {code} on SIGTERM")
        print(f"[{mode}] passed in {time.monotonic() - started:.1f}s", flush=True)
        if show_log:
            log.dump()
    except BaseException:
        print(f"[{mode}] FAILED after {time.monotonic() - started:.1f}s", flush=True)
        log.dump()
        if bench is not None:
            print(bench.output(), flush=True)
        raise
    finally:
        # Every step runs even if one before it raises: no server or bench is left.
        def kill_server():
            if not stopped:
                log.stop()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        cleanups = [kill_server]
        if bench is not None:
            cleanups.append(bench.kill)
        if checker is not None:
            cleanups.append(checker.stop)
        cleanups += [channel.close, lambda: shutil.rmtree(work, ignore_errors=True)]
        for cleanup in cleanups:
            try:
                cleanup()
            except Exception as e:  # noqa: BLE001 (cleanup goes on; the test's error stands)
                print(f"[{mode}] cleanup: {e!r}", file=sys.stderr, flush=True)


def main():
    global API
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("server")
    parser.add_argument("client")
    parser.add_argument("source", nargs="?", default=os.path.join(HERE, "..", ".."))
    parser.add_argument("--mode", choices=["none", "poll", "both"], default="both")
    parser.add_argument("--show_log", action="store_true",
                        help="print the server's stderr after a passing mode too")
    args = parser.parse_args()
    stubs = tempfile.mkdtemp(prefix="mha_reload_stubs_")
    try:
        API = load_api(os.path.abspath(args.source), stubs)
        modes = ["none", "poll"] if args.mode == "both" else [args.mode]
        for mode in modes:
            run_mode(mode, os.path.abspath(args.server), os.path.abspath(args.client),
                     args.show_log)
    except TestFailure as e:
        print(f"reload_test: FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutil.rmtree(stubs, ignore_errors=True)
    print(f"reload_test: passed in mode(s) {', '.join(modes)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
