#!/usr/bin/python3
"""Sessions behind a real L7 proxy, end to end: Debian's HAProxy 2.6 in front of
three attention_server processes on loopback, HTTP/2 on both sides, round robin.

HAProxy runs deploy/haproxy/haproxy.cfg (compose's "replicas" profile) with only its
addresses changed: the frontend binds a free loopback port, the three servers are the
three local processes, the Docker DNS resolvers go, and a stats socket is added. It
runs in the foreground (-db) from a temporary directory, never as a system service.

  1. Three servers (--port=0, --metrics_port=0, --compute_threads=1) on one
     repository: toy (p_o 100, h 5, seed 0) and bert_base (768, 12 heads, seed 1).
     HAProxy in front; the test waits until its stats show all three servers UP.
  2. Unary: 60 causal Attend calls over ONE client channel through the proxy. Each
     server's mha_requests_total{code="OK",model,protocol="attention_v1"} grew by
     25-42% of them (they add up to 60), and HAProxy's frontend counted no new client
     connection for them: the proxy balances per request (HTTP/2 stream), not per
     connection.
  3. Sessions: 6 SELF causal AttendSession streams on the same channel (3 on toy, 3
     on bert_base), opened one after another, each prefilling P tokens; each lands
     on the replica whose mha_sessions_total grew. Sessions must land on more than
     one replica. Then decode steps of one token each, interleaved across sessions;
     every response's context_tokens counts the session's tokens so far.
  4. A replica dies (SIGKILL) with sessions open on it: each of those fails at its
     next step (the code is printed: through HAProxy 2.6 a stream the server ends
     reaches the client as CANCELLED), while the sessions on the other replicas go
     on. Each failed session reopens through the proxy (it lands on a live replica),
     re-prefills every token so far in one step and goes on decoding.
  5. Every session's outputs, concatenated, equal one stateless causal Attend on all
     its tokens to 1e-5 (max abs); so do the re-prefills, on their tokens. 30 more
     unary calls all succeed and reach both live replicas (HAProxy retries a refused
     connection on another server). Sessions half-close and end OK; the two live
     servers exit 0 on SIGTERM.

    proxy_test.py SERVER_BINARY [SOURCE_DIR] [--show_log]

Stubs and tensor coding come from the mha_serve package of SOURCE_DIR/client/python
(stubs generated from proto/ at import). Every process started here is killed at
exit, on failure too.
"""

import argparse
import csv
import io
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "deploy"))

from check_deploy import read_haproxy, render_haproxy  # noqa: E402
from reload_test import ServerLog, TestFailure, check, max_diff  # noqa: E402
from server_harness import free_port, start_server, stop_server  # noqa: E402  (reload_test's path)

REPLICAS = 3
MODELS = {  # name: (config.pbtxt, d = d_q = d_k = d_v, prefill P, decode steps)
    "toy": ("num_hiddens: 100 num_heads: 5 seeded { seed: 0 }", 100, 24, 24),
    "bert_base": ("num_hiddens: 768 num_heads: 12 bias: true seeded { seed: 1 }\n"
                  "limits { max_batch_size: 8 max_sequence_length: 512 }", 768, 16, 16),
}
SESSIONS = ["toy", "bert_base"] * 3
UNARY_CALLS = 60
UNARY_AFTER_DEATH = 30
SHARE_LOW, SHARE_HIGH = 0.25, 0.42   # each replica's share of the unary calls
TOLERANCE = 1e-5         # session steps (paged attention) vs stateless Attend (oneDNN)
CALL_TIMEOUT = 30.0      # each unary call
STREAM_TIMEOUT = 180.0   # each session's whole stream
START_TIMEOUT = 60.0     # a server's start-up (models loaded and warmed up)
PROXY_TIMEOUT = 20.0     # HAProxy up with every server UP
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1),
                   ("grpc.max_send_message_length", -1)]

pb = mc = pb_grpc = None  # mha_serve's attention_pb2, client module, attention_pb2_grpc


def find_haproxy():
    for path in [shutil.which("haproxy"), "/usr/sbin/haproxy", "/usr/local/sbin/haproxy"]:
        if path and os.access(path, os.X_OK):
            return path
    raise TestFailure("haproxy not found (PATH, /usr/sbin, /usr/local/sbin): this test runs "
                      "Debian's HAProxy 2.6; install it with scripts/deps.sh "
                      "(apt-get install haproxy)")


def with_parent(argv):
    """argv run so that the process gets SIGKILL when this one dies (even killed by
    ctest's timeout): util-linux's setpriv sets the parent-death signal, then execs."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv else argv


# --- metrics -------------------------------------------------------------------------

SAMPLE = re.compile(r"^(\w+)(?:\{([^}]*)\})? (\S+)$", re.M)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(metrics_port):
    """{(name, frozenset(labels)): value} of a server's /metrics."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {(m.group(1), frozenset(LABEL.findall(m.group(2) or ""))): float(m.group(3))
            for m in SAMPLE.finditer(text)}


def requests_ok(samples):
    """attention.v1 requests answered OK, every model."""
    return sum(v for (name, labels), v in samples.items()
               if name == "mha_requests_total" and ("code", "OK") in labels
               and ("protocol", "attention_v1") in labels)


def gauge(samples, name):
    return samples.get((name, frozenset()), 0.0)


# --- HAProxy -------------------------------------------------------------------------

class Proxy:
    """HAProxy in the foreground on deploy/haproxy/haproxy.cfg, addresses swapped."""

    def __init__(self, binary, source, work, backends):
        self.work = work
        self.socket = os.path.join(work, "haproxy.sock")
        self.log_path = os.path.join(work, "haproxy.log")
        self.port = None
        self.proc = None
        self.servers = []  # backend server names, in the config's order
        self.log = None
        deployed = os.path.join(source, "deploy", "haproxy", "haproxy.cfg")
        self.sections = read_haproxy(deployed)
        try:
            self._start(binary, backends)
        except BaseException:
            self.stop()
            raise

    def _start(self, binary, backends):
        for attempt in range(3):  # another process may take the free port first
            self.port = free_port()
            config = self._local(backends)
            path = os.path.join(self.work, "haproxy.cfg")
            with open(path, "w") as f:
                f.write(config)
            checked = subprocess.run([binary, "-c", "-f", path], capture_output=True,
                                     text=True, timeout=30)
            check(checked.returncode == 0,
                  f"haproxy -c refuses the test's config:\n{checked.stdout}{checked.stderr}"
                  f"\n--- config ---\n{config}")
            self.log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(with_parent([binary, "-db", "-f", path]),
                                         stdin=subprocess.DEVNULL, stdout=self.log,
                                         stderr=subprocess.STDOUT)
            if self._wait_up():
                return
            self.stop()
            print(f"haproxy did not come up on port {self.port} (attempt {attempt + 1}): "
                  f"{self.log_tail()}", flush=True)
        raise TestFailure(f"haproxy did not start with every server UP: {self.log_tail()}")

    def _local(self, backends):
        """The deployed config with loopback addresses (and a stats socket)."""
        out, self.servers = [], []
        for section in self.sections:
            keyword = section["header"][0]
            if keyword == "resolvers":
                continue  # Docker's DNS; the servers here are IP addresses
            lines = []
            for words in section["lines"]:
                words = list(words)
                if "resolvers" in words:
                    i = words.index("resolvers")
                    del words[i:i + 2]
                if keyword == "frontend" and words[0] == "bind":
                    check("h2" in words, f"deploy/haproxy/haproxy.cfg: {' '.join(words)}: no h2")
                    words[1] = f"127.0.0.1:{self.port}"
                if keyword == "backend" and words[0] == "server":
                    index = len(self.servers)
                    check(index < len(backends),
                          f"deploy/haproxy/haproxy.cfg has more than {len(backends)} servers")
                    self.servers.append(words[1])
                    words[2] = backends[index]
                lines.append(words)
            if keyword == "global":
                lines.append(["stats", "socket", self.socket, "mode", "600", "level", "user"])
            out.append({"header": section["header"], "lines": lines})
        check(len(self.servers) == len(backends),
              f"deploy/haproxy/haproxy.cfg names {len(self.servers)} servers, the test "
              f"starts {len(backends)}")
        return render_haproxy(out)

    def _wait_up(self):
        deadline = time.monotonic() + PROXY_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                rows = self.stats()
                if all(rows.get(name, {}).get("status") == "UP" for name in self.servers):
                    return True
            except (OSError, KeyError, ValueError):
                pass  # the socket not there yet, or a partial answer
            time.sleep(0.1)
        return False

    def stats(self):
        """`show stat` as {svname: row} (FRONTEND, BACKEND and the servers)."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(self.socket)
            s.sendall(b"show stat\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        text = data.decode().lstrip("# ")
        return {row["svname"]: row for row in csv.DictReader(io.StringIO(text))}

    def counters(self):
        rows = self.stats()
        return {"connections": int(rows["FRONTEND"]["conn_tot"] or 0),
                **{name: int(rows[name]["stot"] or 0) for name in self.servers}}

    def log_tail(self, lines=20):
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.close()
            self.log = None


# --- a session -----------------------------------------------------------------------

class Session:
    """One AttendSession stream, a step at a time: each step puts one message on the
    stream's request iterator and reads its one response."""

    def __init__(self, stub, model, tokens):
        self.model = model
        self.tokens = tokens          # (1, N, d): every token the session will send
        self.outputs = []             # (1, T, p_o) per answered step, in order
        self.sent = 0                 # tokens answered so far
        self.replica = None
        self.history = []             # replicas served by, in order
        self.reprefills = []          # (tokens, output) of each re-prefill
        self.failures = []            # (code, details) of each stream that ended early
        self._open(stub)

    def _open(self, stub):
        self._queue = queue.Queue()
        self._closed = threading.Event()
        self._first = True
        self.call = stub.AttendSession(self._requests(self._queue, self._closed),
                                       timeout=STREAM_TIMEOUT)

    @staticmethod
    def _requests(messages, closed):
        """The stream's request iterator (gRPC reads it on its own thread): the
        queue's messages until None, or until `closed` is set."""
        while not closed.is_set():
            try:
                message = messages.get(timeout=0.5)
            except queue.Empty:
                continue
            if message is None:
                return
            yield message

    def step(self, count):
        """Sends the next `count` tokens; returns the output (1, count, p_o)."""
        request = pb.SessionRequest(
            queries=mc.encode_tensor(self.tokens[:, self.sent:self.sent + count]))
        if self._first:
            request.model, request.kind, request.causal = self.model, pb.SELF, True
            self._first = False
        self._queue.put(request)
        response = next(self.call)  # grpc.RpcError when the stream ended
        output = mc.decode_tensor(response.output)
        check(output.shape[:2] == (1, count),
              f"session on {self.model}: a step of {count} token(s) answered shape "
              f"{output.shape}")
        check(response.context_tokens == self.sent + count,
              f"session on {self.model}: context_tokens {response.context_tokens} after "
              f"{self.sent + count} tokens: the stream's steps did not all reach one cache")
        self.sent += count
        return output

    def reopen(self, stub):
        """A new stream re-prefilling every token answered so far plus the next one."""
        self.abort()
        self._open(stub)
        done, self.sent = self.sent, 0
        output = self.step(done + 1)
        self.reprefills.append((self.tokens[:, :done + 1], output))
        self.outputs.append(output[:, done:])

    def close(self):
        """Half-close: the server ends the stream with OK."""
        self._queue.put(None)
        rest = list(self.call)
        check(not rest and self.call.code() == grpc.StatusCode.OK,
              f"session on {self.model}: half-close ended with {self.call.code()} and "
              f"{len(rest)} extra response(s)")

    def abort(self):
        self._closed.set()
        self._queue.put(None)
        self.call.cancel()


# --- the test ------------------------------------------------------------------------

def write_repository(path):
    for name, (config, *_) in MODELS.items():
        os.makedirs(os.path.join(path, name))
        with open(os.path.join(path, name, "config.pbtxt"), "w") as f:
            f.write(config + "\n")


def causal_attend(stub, model, tokens):
    request = mc.build_request(tokens, causal=True, model=model)
    return mc.decode_tensor(stub.Attend(request, timeout=CALL_TIMEOUT).output)


def share_line(label, counts):
    total = sum(counts.values()) or 1
    parts = ", ".join(f"{name} {n} ({100 * n / total:.0f}%)" for name, n in counts.items())
    return f"{label}: {parts}"


def run(server_binary, haproxy_binary, source, show_log):
    started = time.monotonic()
    work = tempfile.mkdtemp(prefix="mha_proxy_")
    repository = os.path.join(work, "models")
    write_repository(repository)
    servers = []   # [proc, ServerLog, name, alive]
    proxy = channel = None
    sessions = []
    try:
        for i in range(REPLICAS):
            proc, target = start_server(server_binary, [f"--model_repository={repository}",
                                                        "--compute_threads=1"],
                                        timeout=START_TIMEOUT)
            servers.append([proc, ServerLog(proc), target, True])
        proxy = Proxy(haproxy_binary, source, work, [s[2] for s in servers])
        names = proxy.servers  # replica-1..3, in the order of `servers`
        metrics = {names[i]: servers[i][0].metrics_port for i in range(REPLICAS)}
        print(f"servers {', '.join(f'{n} {s[2]}' for n, s in zip(names, servers))}; "
              f"haproxy {haproxy_binary} on 127.0.0.1:{proxy.port} "
              f"({time.monotonic() - started:.1f}s)", flush=True)

        def scrape_all(which=None):
            return {n: scrape(metrics[n]) for n in (which or names)}

        channel = grpc.insecure_channel(f"127.0.0.1:{proxy.port}", options=CHANNEL_OPTIONS)
        grpc.channel_ready_future(channel).result(timeout=PROXY_TIMEOUT)
        stub = pb_grpc.AttentionServiceStub(channel)
        rng = np.random.default_rng(20240917)

        # 2. Unary calls over one channel spread over the three replicas.
        x = rng.uniform(-1, 1, (1, 16, 100)).astype(np.float32)
        before, proxy_before = scrape_all(), proxy.counters()
        first = causal_attend(stub, "toy", x)
        for _ in range(UNARY_CALLS - 1):
            out = causal_attend(stub, "toy", x)
            check(max_diff(out, first) <= TOLERANCE,
                  f"replicas answer the same request differently: {max_diff(out, first):.3g}")
        after, proxy_after = scrape_all(), proxy.counters()
        split = {n: int(requests_ok(after[n]) - requests_ok(before[n])) for n in names}
        print(share_line(f"unary: {UNARY_CALLS} Attend calls over one channel, "
                         "mha_requests_total by replica", split), flush=True)
        print(share_line("unary: HAProxy streams by server",
                         {n: proxy_after[n] - proxy_before[n] for n in names}) +
              f"; client connections opened: "
              f"{proxy_after['connections'] - proxy_before['connections']} "
              f"(total {proxy_after['connections']})", flush=True)
        check(sum(split.values()) == UNARY_CALLS,
              f"the replicas counted {sum(split.values())} Attend calls, {UNARY_CALLS} were made")
        for n, count in split.items():
            check(SHARE_LOW <= count / UNARY_CALLS <= SHARE_HIGH,
                  f"{n} got {count} of {UNARY_CALLS} calls, outside "
                  f"{SHARE_LOW:.0%}-{SHARE_HIGH:.0%}: {split}")
        check(proxy_after["connections"] - proxy_before["connections"] == 0,
              f"the unary calls opened {proxy_after['connections'] - proxy_before['connections']}"
              " new client connection(s) to HAProxy; one channel should keep one")

        # 3. Sessions: opened one by one, each pinned to the replica whose count grew.
        for model in SESSIONS:
            _, d, prefill, steps = MODELS[model]
            tokens = rng.uniform(-1, 1, (1, prefill + steps, d)).astype(np.float32)
            before = scrape_all()
            session = Session(stub, model, tokens)
            sessions.append(session)
            session.outputs.append(session.step(prefill))
            after = scrape_all()
            grew = [n for n in names if gauge(after[n], "mha_sessions_total")
                    > gauge(before[n], "mha_sessions_total")]
            check(len(grew) == 1, f"session {len(sessions) - 1}: mha_sessions_total grew on "
                                  f"{grew}, expected exactly one replica")
            session.replica = grew[0]
            session.history.append(grew[0])
        by_replica = {n: [i for i, s in enumerate(sessions) if s.replica == n] for n in names}
        active = {n: int(gauge(m, "mha_sessions_active")) for n, m in scrape_all().items()}
        print("sessions: " + "; ".join(f"{n}: {by_replica[n]} ({active[n]} active)"
                                       for n in names), flush=True)
        check(sum(active.values()) == len(sessions),
              f"mha_sessions_active adds up to {sum(active.values())}, {len(sessions)} are open")
        check(sum(1 for v in by_replica.values() if v) > 1,
              f"every session landed on one replica: {by_replica}")

        # Decode, interleaved; half way through, the replica of session 0 dies.
        most = max(MODELS[m][3] for m in SESSIONS)
        victim = sessions[0].replica
        for step in range(most):
            if step == most // 2:
                index = names.index(victim)
                servers[index][0].send_signal(signal.SIGKILL)
                servers[index][0].wait(timeout=10)
                servers[index][1].stop()
                servers[index][3] = False
                print(f"step {step}: SIGKILL {victim} (sessions {by_replica[victim]})",
                      flush=True)
            for i, session in enumerate(sessions):
                if session.sent >= session.tokens.shape[1]:
                    continue
                try:
                    session.outputs.append(session.step(1))
                    check(session.replica != victim or step < most // 2,
                          f"session {i} stepped on {victim} after it was killed")
                except grpc.RpcError as e:
                    check(session.replica == victim and step >= most // 2,
                          f"session {i} on {session.replica} failed at step {step}: "
                          f"{e.code()}: {e.details()}")
                    session.failures.append((e.code(), e.details()))
                    live = [n for n in names if servers[names.index(n)][3]]
                    before = scrape_all(live)
                    session.reopen(stub)
                    after = scrape_all(live)
                    grew = [n for n in live if gauge(after[n], "mha_sessions_total")
                            > gauge(before[n], "mha_sessions_total")]
                    check(len(grew) == 1, f"session {i} reopened: mha_sessions_total grew on "
                                          f"{grew} of the live {live}")
                    session.replica = grew[0]
                    session.history.append(grew[0])
                    print(f"step {step}: session {i} ended with {e.code().name} "
                          f"({e.details()!r}); reopened on {grew[0]}, re-prefilled "
                          f"{session.sent} tokens", flush=True)
        failed = [i for i, s in enumerate(sessions) if s.failures]
        check(sorted(failed) == by_replica[victim],
              f"sessions {failed} failed, those on {victim} were {by_replica[victim]}")

        # 5. Every session equals the stateless causal Attend on its tokens.
        worst = 0.0
        for i, session in enumerate(sessions):
            check(session.sent == session.tokens.shape[1],
                  f"session {i}: {session.sent} of {session.tokens.shape[1]} tokens sent")
            reference = causal_attend(stub, session.model, session.tokens)
            got = np.concatenate(session.outputs, axis=1)
            diff = max_diff(got, reference)
            check(diff <= TOLERANCE,
                  f"session {i} ({session.model}, on {session.history}): max abs diff "
                  f"{diff:.3g} against the stateless causal Attend")
            for tokens, output in session.reprefills:
                redo = max_diff(output, reference[:, :tokens.shape[1]])
                check(redo <= TOLERANCE, f"session {i}: the re-prefill of {tokens.shape[1]} "
                                         f"tokens differs by {redo:.3g}")
                diff = max(diff, redo)
            worst = max(worst, diff)
        print(f"sessions: {len(sessions)} equal the stateless causal Attend, max abs diff "
              f"{worst:.3g} (tolerance {TOLERANCE:g})", flush=True)

        live = [n for n in names if servers[names.index(n)][3]]
        before = scrape_all(live)
        for _ in range(UNARY_AFTER_DEATH):
            causal_attend(stub, "toy", x)
        after = scrape_all(live)
        split = {n: int(requests_ok(after[n]) - requests_ok(before[n])) for n in live}
        print(share_line(f"unary after {victim} died: {UNARY_AFTER_DEATH} calls, all OK", split),
              flush=True)
        check(sum(split.values()) == UNARY_AFTER_DEATH and all(split.values()),
              f"after {victim} died: {split}")

        for session in sessions:
            session.close()
        final = scrape_all(live)
        print("mha_sessions_total: " + ", ".join(
            f"{n} {int(gauge(final[n], 'mha_sessions_total'))}" for n in live) +
              f" ({victim} killed with {len(by_replica[victim])})", flush=True)
        channel.close()
        channel = None
        proxy.stop()
        for proc, log, name, alive in servers:
            if alive:
                log.stop()
                code = stop_server(proc)
                check(code == 0, f"{name} exited {code} on SIGTERM")
        if show_log:
            for _, log, _, _ in servers:
                log.dump()
        print(f"passed in {time.monotonic() - started:.1f}s", flush=True)
    except BaseException:
        print(f"FAILED after {time.monotonic() - started:.1f}s", flush=True)
        for _, log, name, _ in servers:
            print(f"=== {name}", flush=True)
            log.dump()
        if proxy is not None:
            print(f"--- haproxy log (tail) ---\n{proxy.log_tail(40)}", flush=True)
        raise
    finally:
        cleanups = [s.abort for s in sessions]
        if channel is not None:
            cleanups.append(channel.close)
        if proxy is not None:
            cleanups.append(proxy.stop)
        for proc, log, _, _ in servers:
            def kill(proc=proc, log=log):
                log.stop()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            cleanups.append(kill)
        cleanups.append(lambda: shutil.rmtree(work, ignore_errors=True))
        for cleanup in cleanups:
            try:
                cleanup()
            except Exception as e:  # noqa: BLE001 (cleanup goes on; the test's error stands)
                print(f"cleanup: {e!r}", file=sys.stderr, flush=True)


def main():
    global pb, mc, pb_grpc
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("server")
    parser.add_argument("source", nargs="?", default=os.path.join(HERE, "..", ".."))
    parser.add_argument("--show_log", action="store_true",
                        help="print the servers' stderr after a pass too")
    args = parser.parse_args()
    source = os.path.abspath(args.source)
    sys.path.insert(0, os.path.join(source, "client", "python"))
    from mha_serve import client as mc  # noqa: E402  (stubs generated at import)
    from mha_serve._proto import attention_pb2 as pb, attention_pb2_grpc as pb_grpc  # noqa
    try:
        haproxy = find_haproxy()
        version = subprocess.run([haproxy, "-v"], capture_output=True, text=True,
                                 timeout=10).stdout.splitlines()[0]
        print(version, flush=True)
        run(os.path.abspath(args.server), haproxy, source, args.show_log)
    except TestFailure as e:
        print(f"proxy_test: FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    print("proxy_test: passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
