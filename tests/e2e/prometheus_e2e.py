#!/usr/bin/python3
"""A real Prometheus scrapes a real attention_server.

Starts the server (loopback, free ports), writes a scrape config pointing at its
/metrics, checks it with `promtool check config`, starts Debian's `prometheus` on
a free loopback port, sends requests (OK and INVALID_ARGUMENT), then asks
Prometheus's HTTP API for mha_requests_total until it holds exactly what was sent.

    prometheus_e2e.py SERVER_BINARY REPO_ROOT
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

REPO = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
sys.path.insert(0, os.path.join(REPO, "client", "python"))

import mha_serve  # noqa: E402  (the source tree's package; stubs generated at import)
from mha_serve.toy import uniform_inputs  # noqa: E402
from server_harness import free_port, start_server, stop_server  # noqa: E402

SENT_OK = 17
SENT_INVALID = 4
SCRAPE_CONFIG = """\
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: mha-serve
    metrics_path: /metrics
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


def start_prometheus(config, work):
    """Starts Prometheus on a free port; returns (process, address) once it is ready.
    The port is picked, then bound by Prometheus: another process (tests run in
    parallel) may take it between the two, so a start that fails to bind is tried
    again on another port."""
    log_path = os.path.join(work, "prometheus.log")
    for _ in range(3):
        address = f"127.0.0.1:{free_port()}"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={work}/data",
                 f"--web.listen-address={address}", "--log.level=warn"],
                stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://{address}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return proc, address
            except OSError:
                pass  # not listening yet
            time.sleep(0.2)
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
            raise RuntimeError(f"prometheus on {address} not ready in 60 s: " +
                               open(log_path).read())
        text = open(log_path).read()
        if "address already in use" not in text:
            raise RuntimeError(f"prometheus exited: {text}")
    raise RuntimeError(f"prometheus found no free port in 3 tries: {text}")


def query(prometheus, expr):
    url = f"http://{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as reply:
        body = json.load(reply)
    if body.get("status") != "success":
        raise RuntimeError(f"query {expr} failed: {body}")
    return {tuple(sorted(r["metric"].items())): float(r["value"][1])
            for r in body["data"]["result"]}


def main():
    binary = sys.argv[1]
    server, target = start_server(binary, ["--max_queue_delay_us=0"])
    work = tempfile.mkdtemp(prefix="mha_prometheus_")
    prometheus = None
    try:
        config = os.path.join(work, "prometheus.yml")
        with open(config, "w") as f:
            f.write(SCRAPE_CONFIG.format(port=server.metrics_port))
        subprocess.run(["promtool", "check", "config", config], check=True)

        prometheus, address = start_prometheus(config, work)

        queries, keys = uniform_inputs(0, [(2, 4, 100), (2, 6, 100)])
        with mha_serve.Client(target, timeout=60) as client:
            for _ in range(SENT_OK):
                client.attend(queries, keys, keys, valid_lens=[3, 2])
            for _ in range(SENT_INVALID):
                try:
                    client.attend(queries, keys[:, :, :99], keys[:, :, :99])
                    raise AssertionError("a malformed request succeeded")
                except mha_serve.Error as e:
                    assert e.code.name == "INVALID_ARGUMENT", e

        expected = {"OK": SENT_OK, "INVALID_ARGUMENT": SENT_INVALID}
        deadline = time.monotonic() + 90
        seen = None
        while time.monotonic() < deadline:
            if prometheus.poll() is not None:
                raise RuntimeError("prometheus exited: " +
                                   open(os.path.join(work, "prometheus.log")).read())
            try:
                result = query(address, 'sum by (code) (mha_requests_total{job="mha-serve",model="default"})')
                seen = {dict(k)["code"]: v for k, v in result.items()}
                if all(seen.get(code) == n for code, n in expected.items()):
                    up = query(address, 'up{job="mha-serve"}')
                    assert list(up.values()) == [1.0], up
                    print(f"prometheus {address} scraped mha_requests_total: {seen}")
                    return 0
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        raise AssertionError(f"prometheus never saw {expected}; last seen {seen}")
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        stop_server(server)
        subprocess.run(["rm", "-rf", work], check=False)


if __name__ == "__main__":
    sys.exit(main())
