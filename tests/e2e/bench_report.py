#!/usr/bin/env python3
"""Reads one figure from an `attention_client bench --json` report (its last step).

Usage: bench_report.py REPORT.json FIELD
FIELD: rps | p50_ms | p99_ms | ok | requests | errors | error:CODE
(CODE as the client names it, e.g. RESOURCE_EXHAUSTED). A missing key is an error,
never a silent 0.
"""
import json
import sys


def main():
    report = json.load(open(sys.argv[1]))
    field = sys.argv[2]
    step = report["steps"][-1]
    errors = step["errors"]
    if field.startswith("error:"):
        value = errors.get(field.split(":", 1)[1], 0)
    elif field == "errors":
        value = sum(errors.values())
    elif field == "rps":
        value = step["requests_per_s"]
    elif field in ("p50_ms", "p99_ms"):
        value = step["latency_us"][field[:3]] / 1000.0
    elif field in ("ok", "requests"):
        value = step[field]
    else:
        sys.exit("bench_report: unknown field " + field)
    print(round(value, 3) if isinstance(value, float) else value)


if __name__ == "__main__":
    main()
