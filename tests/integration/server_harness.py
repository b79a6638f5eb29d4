"""Starts the real attention_server for Python-driven tests (loopback, free port)."""

import os
import selectors
import signal
import socket
import subprocess
import time


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago. Another process may bind it
    before the caller's program does (tests run in parallel): callers that start a
    server on it retry on another port when that happens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(binary, args=(), timeout=30.0):
    """Starts `binary --port=0 --metrics_port=0 --http_port=-1 args` (the HTTP
    front off unless `args` sets --http_port); returns (process,
    "127.0.0.1:PORT") once it prints its 'listening on' line. The process's
    `metrics_port` and `http_port` attributes hold the ports of the /metrics and
    HTTP fronts it printed before that line (0 = off). Raises RuntimeError with
    its stderr if it exits first or stays silent past `timeout`."""
    if not any(a.startswith("--metrics_port") for a in args):
        args = [*args, "--metrics_port=0"]
    if not any(a.startswith("--http_port") for a in args):
        args = [*args, "--http_port=-1"]
    proc = subprocess.Popen([binary, "--port=0", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.metrics_port = 0
    proc.http_port = 0
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    pending = b""
    while True:
        # Raw reads: a buffered readline could swallow the next line unseen.
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            line = line.decode()
            if line.startswith("metrics on "):
                proc.metrics_port = int(line.rsplit(":", 1)[1])
            if line.startswith("http on "):
                proc.http_port = int(line.rsplit(":", 1)[1])
            if line.startswith("listening on "):
                return proc, "127.0.0.1:" + line.strip().rsplit(":", 1)[1]
        left = deadline - time.monotonic()
        if left <= 0 or not selector.select(timeout=left):
            proc.kill()
            raise RuntimeError(f"server silent for {timeout}s: {proc.communicate()[1]}")
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            proc.wait()
            raise RuntimeError(f"server exited ({proc.returncode}): {proc.stderr.read()}")
        pending += chunk


def stop_server(proc, timeout=30.0):
    """SIGTERM; returns the exit code (the server exits 0 after draining)."""
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if proc.returncode != 0:
        print(err.decode(errors="replace"))
    return proc.returncode
