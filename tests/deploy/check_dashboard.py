#!/usr/bin/python3
"""Checks the Grafana dashboard and the Prometheus alerts against the server.

    check_dashboard.py SOURCE_DIR SERVER_BINARY PROMTOOL

- deploy/grafana/dashboards/*.json parses, every panel has a query, and every PromQL
  expression (panels, template variables, deploy/prometheus/alerts.yml) is valid
  PromQL: they are written into a rules file (Grafana's $variables replaced by
  values) and `promtool check rules` parses it.
- Every metric a query names is one the server exports: the names come from a
  live scrape of a fresh attention_server's /metrics after a few toy requests
  (sent with the Python example client).
- The panels the deploy issue asks for are there: request rate by code, p50 and
  p99 latency, queue vs compute time, batch size, queue depth, memory.
"""

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import yaml

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
            "or", "unless", "offset", "inf", "nan", "atan2"}
# Series Prometheus makes itself for every target.
SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def metric_names(expr):
    """The metric names a PromQL expression selects (not functions, labels or keywords)."""
    label_values = re.fullmatch(r"\s*label_values\(\s*([a-zA-Z_:][\w:]*)\s*,.*\)\s*", expr)
    if label_values:
        return {label_values.group(1)}
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)            # strings
    text = re.sub(r"\{[^}]*\}", " ", text)                         # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)                        # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)",
                  " ", text)                                       # label lists
    names = set()
    for match in re.finditer(r"(?<![\w.$])([a-zA-Z_:][\w:]*)(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if call or name in KEYWORDS or re.fullmatch(r"\d.*", name):
            continue
        names.add(name)
    return names


def grafana_to_promql(expr):
    """A Grafana query as plain PromQL (its template variables given values)."""
    expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")
    expr = expr.replace("$__range", "1h")
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def dashboard_queries(dashboard):
    """[(where, expr)] for every panel target and query variable."""
    queries, empty = [], []
    panels = list(dashboard.get("panels", []))
    while panels:
        panel = panels.pop()
        panels.extend(panel.get("panels", []))          # rows
        if panel.get("type") == "row":
            continue
        exprs = [t.get("expr", "") for t in panel.get("targets", []) if t.get("expr")]
        if not exprs:
            empty.append(panel.get("title"))
        queries += [(f"panel {panel.get('title')!r}", e) for e in exprs]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var.get("query")
            query = query.get("query") if isinstance(query, dict) else query
            queries.append((f"variable {var['name']!r}", query))
    return queries, empty


def promtool_parses(promtool, exprs):
    """Runs `promtool check rules` on the expressions; returns its complaint or ""."""
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"check:expr_{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        yaml.safe_dump(rules, f)
    try:
        proc = subprocess.run([promtool, "check", "rules", f.name], capture_output=True,
                              text=True, timeout=60)
    finally:
        os.unlink(f.name)
    return "" if proc.returncode == 0 else proc.stdout + proc.stderr


def read_lines(proc, want, timeout, grace=3.0):
    """Reads the server's output until every pattern in `want` matched, `timeout`
    passed, or `grace` seconds passed since the first match; returns {pattern: first
    match's group 1}."""
    found, buffer = {}, ""
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while len(found) < len(want) and time.monotonic() < deadline:
        if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
            break
        chunk = os.read(proc.stdout.fileno(), 4096).decode()
        if not chunk:
            break
        buffer += chunk
        for pattern in want:
            match = re.search(pattern, buffer, re.M)
            if match and pattern not in found:
                found[pattern] = match.group(1)
                deadline = min(deadline, time.monotonic() + grace)
    return found


def scrape_server(binary, source):
    """Starts a server (free ports), sends toy requests, returns the sample names on
    its /metrics."""
    listening, metrics_on = r"^listening on \S+:(\d+)", r"^metrics on \S+:(\d+)"
    proc = subprocess.Popen([binary, "--port=0", "--metrics_port=0", "--http_port=-1"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        found = read_lines(proc, [listening, metrics_on], timeout=30)
        if listening not in found:
            raise SystemExit("FAIL: the server printed no 'listening on' line")
        if metrics_on not in found:
            raise SystemExit("FAIL: the server printed no 'metrics on' line")
        env = dict(os.environ, PYTHONPATH=os.path.join(source, "client", "python"))
        for _ in range(3):  # the Python client, mha_serve, from the source tree
            subprocess.run([sys.executable, "-m", "mha_serve",
                            f"--target=127.0.0.1:{found[listening]}"],
                           check=True, capture_output=True, timeout=60, env=env)
        url = f"http://127.0.0.1:{found[metrics_on]}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    return {re.match(r"[a-zA-Z_:][\w:]*", line).group(0)
            for line in text.splitlines() if line and not line.startswith("#")}


def main():
    if len(sys.argv) != 4:
        print(__doc__)
        return 2
    source, binary, promtool = sys.argv[1:]
    errors = []
    dashboards_dir = os.path.join(source, "deploy", "grafana", "dashboards")
    queries = []
    for name in sorted(os.listdir(dashboards_dir)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(dashboards_dir, name)) as f:
            dashboard = json.load(f)           # raises (fails the test) on bad JSON
        found, empty = dashboard_queries(dashboard)
        errors += [f"{name}: panel {t!r} has no query" for t in empty]
        queries += [(f"{name} {where}", expr) for where, expr in found]
    if not queries:
        errors.append("no dashboard queries found")
    with open(os.path.join(source, "deploy", "prometheus", "alerts.yml")) as f:
        alerts = yaml.safe_load(f)
    alert_queries = [(f"alerts.yml {r['alert']}", r["expr"])
                     for g in alerts["groups"] for r in g["rules"]]

    promql = [grafana_to_promql(e) for _, e in queries if not e.startswith("label_values(")]
    complaint = promtool_parses(promtool, promql)
    if complaint:
        errors.append(f"promtool does not parse the dashboard's queries:\n{complaint}")

    exported = scrape_server(binary, source)
    print(f"the server exports {len(exported)} series names: {', '.join(sorted(exported))}")
    for where, expr in queries + alert_queries:
        names = metric_names(expr)
        if not names:
            errors.append(f"{where}: names no metric: {expr}")
        for n in sorted(names - exported - SYNTHETIC):
            errors.append(f"{where}: {n} is not exported by the server")

    required = {
        "request rate by code": r"by \(code\) \(rate\(mha_requests_total",
        "p50 latency": r"histogram_quantile\(0\.5, .*mha_request_duration_seconds_bucket",
        "p99 latency": r"histogram_quantile\(0\.99, .*mha_request_duration_seconds_bucket",
        "queue time": r"mha_queue_duration_seconds",
        "compute time": r"mha_compute_duration_seconds",
        "batch size": r"mha_batch_size",
        "queue depth": r"mha_queue_depth",
        "memory": r"process_resident_memory_bytes",
    }
    for what, pattern in required.items():
        if not any(re.search(pattern, e) for _, e in queries):
            errors.append(f"no panel shows {what} (/{pattern}/)")

    for e in errors:
        print("FAIL", e)
    if errors:
        return 1
    print(f"{len(queries)} dashboard queries and {len(alert_queries)} alerts parse and name "
          "only exported metrics")
    return 0


if __name__ == "__main__":
    sys.exit(main())
