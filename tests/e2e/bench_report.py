#!/usr/bin/env python3
"""Reads one figure from an `attention_client bench --json` report.

Usage: bench_report.py REPORT.json FIELD
FIELD: rps | p50_ms | p99_ms | ok | errors | error:CODE

The report's layout is the load client's (client/); this reader looks the figures
up by the names that client uses, with a few spellings accepted, so that a renamed
key fails loudly here rather than giving a silent 0.
"""
import json
import sys

NAMES = {
    "rps": ("requests_per_second", "throughput_rps", "rps", "req_per_s", "qps"),
    "p50_ms": ("p50_ms", "latency_p50_ms", "p50"),
    "p99_ms": ("p99_ms", "latency_p99_ms", "p99"),
    "ok": ("ok", "succeeded", "ok_requests", "successes"),
    "errors": ("errors", "failed", "error_count", "errors_total"),
}
ERROR_MAPS = ("errors_by_code", "codes", "status_codes", "by_code")


def walk(node, path=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield path + (key,), value
            yield from walk(value, path + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from walk(value, path + (str(i),))


def find(report, names):
    # Prefer the shallowest match (the overall figure over a per-window one).
    hits = [(len(p), v) for p, v in walk(report) if p[-1] in names and isinstance(v, (int, float))]
    if not hits:
        return None
    return sorted(hits, key=lambda h: h[0])[0][1]


def main():
    report = json.load(open(sys.argv[1]))
    field = sys.argv[2]
    if field.startswith("error:"):
        code = field.split(":", 1)[1]
        for path, value in walk(report):
            if path[-1] in ERROR_MAPS and isinstance(value, dict):
                print(value.get(code, 0))
                return
        print(0)  # no error map: no errors were reported
        return
    value = find(report, NAMES[field])
    if value is None:
        if field == "errors":
            total = 0
            for path, v in walk(report):
                if path[-1] in ERROR_MAPS and isinstance(v, dict):
                    total = sum(x for x in v.values() if isinstance(x, (int, float)) and True)
                    break
            print(total)
            return
        sys.exit("bench_report: no %s (%s) in %s" % (field, "/".join(NAMES[field]), sys.argv[1]))
    print(value)


if __name__ == "__main__":
    main()
