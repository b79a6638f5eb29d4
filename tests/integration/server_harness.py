"""Starts the real attention_server for Python-driven tests (loopback, free port)."""

import selectors
import signal
import subprocess
import time


def start_server(binary, args=(), timeout=30.0):
    """Starts `binary --port=0 args`; returns (process, "127.0.0.1:PORT") once it
    prints its 'listening on' line. Raises RuntimeError with its stderr if it
    exits first or stays silent past `timeout`."""
    proc = subprocess.Popen([binary, "--port=0", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not selector.select(timeout=left):
            proc.kill()
            raise RuntimeError(f"server silent for {timeout}s: {proc.communicate()[1]}")
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            raise RuntimeError(f"server exited ({proc.returncode}): {proc.stderr.read()}")
        if line.startswith("listening on "):
            return proc, "127.0.0.1:" + line.strip().rsplit(":", 1)[1]


def stop_server(proc, timeout=30.0):
    """SIGTERM; returns the exit code (the server exits 0 after draining)."""
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if proc.returncode != 0:
        print(err)
    return proc.returncode
