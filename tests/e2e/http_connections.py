#!/usr/bin/python3
"""Issue 32's out-of-CI check of the event-driven HTTP front (label `slow`): 1,000 idle
keep-alive connections held while `attention_client bench --protocol=http
--concurrency=64` runs (zero errors, every one of the 1,000 then answers GET
/v2/health/live, the server's thread count changes by at most 2), and a bench at c 8
with 50 slow senders connected against the same bench without them (p50 <= 1.2x,
runs alternated). Prints the figures docs/performance.md quotes.

    MHA_SLOW_TESTS=1 http_connections.py SERVER CLIENT SOURCE_DIR
"""

import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

IDLE = 1000
SLOW = 50


def threads_of(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads line")


def health(sock):
    sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"{}"):
        chunk = sock.recv(4096)
        if not chunk:
            raise AssertionError("connection closed")
        data += chunk
    return int(data.split(b" ", 2)[1])


def bench(client, port, concurrency, seconds, out):
    subprocess.run([client, "bench", "--protocol=http", f"--target=127.0.0.1:{port}",
                    f"--concurrency={concurrency}", "--warmup=1s", "--window=1s",
                    f"--max_windows={seconds}", f"--stable_windows={seconds}",
                    f"--duration={seconds + 3}s", "--timeout=30s", "--progress=false",
                    f"--json={out}"], check=True, stdout=subprocess.DEVNULL)
    step = json.load(open(out))["steps"][0]
    return step["requests_per_s"], step["latency_us"]["p50"] / 1e3, sum(step["errors"].values())


def main():
    if os.environ.get("MHA_SLOW_TESTS") != "1":
        print("skipped: set MHA_SLOW_TESTS=1")
        return 77
    server, client, source = sys.argv[1:4]
    sys.path.insert(0, source + "/tests/integration")
    from server_harness import start_server, stop_server
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    proc, _ = start_server(server, ["--http_port=0", "--http_idle_timeout=3600s"])
    port = proc.http_port
    tmp = tempfile.mkdtemp(prefix="mha_http_connections.")
    try:
        idle = []
        for _ in range(IDLE):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            idle.append(s)
        for s in idle[:10]:  # some used once, then idle: keep-alive connections
            assert health(s) == 200
        threads_before = threads_of(proc.pid)
        rps, p50, errors = bench(client, port, 64, 10, f"{tmp}/c64.json")
        threads_after = threads_of(proc.pid)
        print(f"http_connections: {IDLE} idle connections held; bench c 64: {rps:.0f} req/s, "
              f"p50 {p50:.3f} ms, {errors} errors; server threads {threads_before} -> "
              f"{threads_after}")
        assert errors == 0, "errors under the idle connections"
        assert abs(threads_after - threads_before) <= 2, "threads changed"
        start = time.monotonic()
        for s in idle:
            assert health(s) == 200
        print(f"http_connections: all {IDLE} answered GET /v2/health/live in "
              f"{time.monotonic() - start:.2f} s")
        for s in idle:
            s.close()

        stop = threading.Event()

        def slow_sender():
            while not stop.is_set():
                s = None
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=30)
                    s.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
                    while not stop.is_set():
                        s.sendall(b"X")
                        time.sleep(0.1)
                except OSError:
                    pass  # 408 at the header deadline: connect again
                finally:
                    if s is not None:
                        s.close()

        p50s = {"without": [], "with": []}
        for round_ in range(3):
            for case in ("without", "with"):
                senders = []
                if case == "with":
                    stop.clear()
                    senders = [threading.Thread(target=slow_sender) for _ in range(SLOW)]
                    for t in senders:
                        t.start()
                    time.sleep(1)
                _, p50, errors = bench(client, port, 8, 5, f"{tmp}/c8_{case}_{round_}.json")
                assert errors == 0
                p50s[case].append(p50)
                stop.set()
                for t in senders:
                    t.join()
        ratio = statistics.median(p50s["with"]) / statistics.median(p50s["without"])
        print(f"http_connections: bench c 8 p50 without slow senders "
              f"{[round(x, 3) for x in p50s['without']]} ms, with {SLOW} "
              f"{[round(x, 3) for x in p50s['with']]} ms: median ratio {ratio:.2f}")
        assert ratio <= 1.2, "slow senders slow the others down"
    finally:
        if stop_server(proc) != 0:
            raise AssertionError("the server did not drain cleanly")
    print("http_connections: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
