#!/usr/bin/python3
"""Client-side round_robin over three servers: what the headless Service gives in k8s.

    round_robin_test.py SERVER_BINARY CLIENT_BINARY

Starts three attention_server processes on loopback (free ports), runs
`attention_client bench --targets=a,b,c` against all three for a few seconds, then
reads each server's mha_requests_total from its /metrics. Passes when every server
holds between 25% and 42% of the requests (a third each, give or take), and the
servers together counted exactly the Attend requests bench reports (its --json).
"""

import json
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

SERVERS = 3
LOW, HIGH = 0.25, 0.42
MIN_TOTAL = 150


def start(binary):
    proc = subprocess.Popen([binary, "--port=0", "--metrics_port=0", "--http_port=-1", "--compute_threads=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    target = metrics = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (target and metrics):
        line = proc.stdout.readline()
        if not line:
            break
        found = re.search(r"^listening on \S+:(\d+)", line)
        target = f"127.0.0.1:{found.group(1)}" if found else target
        found = re.search(r"^metrics on \S+:(\d+)", line)
        metrics = f"127.0.0.1:{found.group(1)}" if found else metrics
    if not (target and metrics):
        proc.kill()
        raise SystemExit(f"FAIL: server did not print 'listening on' and 'metrics on': "
                         f"{proc.communicate()[0]}")
    return proc, target, metrics


def requests_total(metrics):
    """Sum of mha_requests_total over every model and code."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(m.group(1)) for m in
               re.finditer(r"^mha_requests_total(?:\{[^}]*\})? (\S+)$", text, re.M))


def main():
    server_binary, client_binary = sys.argv[1:3]
    servers = []
    try:
        for _ in range(SERVERS):
            servers.append(start(server_binary))
        targets = ",".join(t for _, t, _ in servers)
        with tempfile.NamedTemporaryFile(suffix=".json") as report:
            # Bounded by count, not time, so a busy machine only makes it slower.
            command = [client_binary, "bench", f"--targets={targets}", "--max_requests=600",
                       "--duration=90s", "--concurrency=6", "--progress=false",
                       f"--json={report.name}"]
            print("$", " ".join(command), flush=True)
            bench = subprocess.run(command, capture_output=True, text=True, timeout=180)
            print(bench.stdout[-3000:], bench.stderr[-2000:])
            if bench.returncode != 0:
                print(f"FAIL: bench exited {bench.returncode}")
                return 1
            with open(report.name) as f:
                sent = json.load(f)["attend_requests"]
        counts = [requests_total(m) for _, _, m in servers]
    finally:
        for proc, _, _ in servers:
            proc.send_signal(signal.SIGTERM)
        for proc, _, _ in servers:
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    total = sum(counts)
    shares = [c / total if total else 0.0 for c in counts]
    for (_, target, _), count, share in zip(servers, counts, shares):
        print(f"{target}: mha_requests_total {count:.0f} ({share:.1%})")
    if total != sent:
        print(f"FAIL: bench reports {sent} Attend requests, the servers counted {total:.0f}")
        return 1
    if total < MIN_TOTAL:
        print(f"FAIL: only {total:.0f} requests reached the servers (need {MIN_TOTAL})")
        return 1
    bad = [s for s in shares if not LOW <= s <= HIGH]
    if bad:
        print(f"FAIL: every server should hold {LOW:.0%}-{HIGH:.0%} of the requests")
        return 1
    print(f"round_robin: {total:.0f} requests over {SERVERS} servers, each {LOW:.0%}-{HIGH:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
