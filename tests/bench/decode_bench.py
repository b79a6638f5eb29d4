#!/usr/bin/env python3
"""Decode benchmark: attention sessions against their stateless equivalent, on the
decoder model (deploy/models/decoder: p_o 768, h 12), with attention_client decode
against a real server on loopback. The client shares the machine's cores with the
server.

Each round measures, one after another:
  step 64      one session, prefill 1, 63 one-token steps: p50 of steps at context <= 64
  step 512     prefill 448, 64 steps (contexts 449-512): p50
  step 2048    prefill 1984, 64 steps (contexts 1985-2048): p50
  stateless    the same two runs with --stateless: each step one Attend whose queries
               are the new token and whose keys and values are every token so far
  tokens/s     prefill 128, 128 steps: 1 session, then 16 sessions at once
and prints each round's ratios, then their medians over the rounds against the
bounds (docs/performance.md, "Sessions"):
  step 512 / step 64 <= 2; stateless / session >= 10 at 512 and >= 50 at 2048;
  16 sessions' tokens/s / 1 session's >= 4.

  tests/bench/decode_bench.py [--rounds=5] [--build=build/release]
Exit status 0 whatever the figures (a benchmark, not a test); 1 if a run failed.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
from server_harness import start_server, stop_server  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def decode(client, target, out, name, *flags):
    """Runs attention_client decode; returns its JSON report."""
    path = os.path.join(out, name + ".json")
    subprocess.run([client, "decode", f"--target={target}", "--model=decoder", "--timeout=60s",
                    f"--json={path}", *flags], check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        return json.load(f)


def p50(report, label):
    """p50 (ms) of the decode steps in the context bucket `label` ("<=512")."""
    for bucket in report["decode_buckets"]:
        if bucket["label"] == label:
            return bucket["latency_us"]["p50"] / 1000
    raise KeyError(f"no decode steps at context {label}")


def round_figures(client, target, out, r):
    run = lambda name, *flags: decode(client, target, out, f"{name}_{r}", *flags)  # noqa: E731
    f = {}
    f["step64"] = p50(run("s64", "--sessions=1", "--prefill=1", "--decode_tokens=63"), "<=64")
    for ctx, prefill in ((512, 448), (2048, 1984)):
        flags = ("--sessions=1", f"--prefill={prefill}", "--decode_tokens=64")
        f[f"step{ctx}"] = p50(run(f"s{ctx}", *flags), f"<={ctx}")
        f[f"stateless{ctx}"] = p50(run(f"x{ctx}", *flags, "--stateless"), f"<={ctx}")
    for s in (1, 16):
        report = run(f"t{s}", f"--sessions={s}", "--prefill=128", "--decode_tokens=128")
        f[f"tokens{s}"] = report["decode"]["tokens_per_s"]
    f["flat"] = f["step512"] / f["step64"]
    f["x512"] = f["stateless512"] / f["step512"]
    f["x2048"] = f["stateless2048"] / f["step2048"]
    f["scale16"] = f["tokens16"] / f["tokens1"]
    return f


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--build", default=os.path.join(ROOT, "build", "release"))
    args = parser.parse_args()
    server_bin = os.path.join(args.build, "server", "attention_server")
    client = os.path.join(args.build, "client", "attention_client")
    out = tempfile.mkdtemp(prefix="mha_decode_bench.")
    proc, target = start_server(server_bin,
                                [f"--model_repository={os.path.join(ROOT, 'deploy', 'models')}"])
    try:
        print(f"decoder (p_o 768, h 12, f32), server and client on this machine's "
              f"{os.cpu_count()} cores; {args.rounds} rounds; reports in {out}")
        print(f"{'round':>5} {'step64':>8} {'step512':>8} {'step2048':>9} {'sl512':>8} "
              f"{'sl2048':>8} {'tok/s 1':>8} {'tok/s 16':>9} {'512/64':>7} {'x512':>6} "
              f"{'x2048':>6} {'16/1':>5}")
        rounds = []
        for r in range(args.rounds):
            f = round_figures(client, target, out, r)
            rounds.append(f)
            print(f"{r + 1:>5} {f['step64']:>8.3f} {f['step512']:>8.3f} {f['step2048']:>9.3f} "
                  f"{f['stateless512']:>8.2f} {f['stateless2048']:>8.2f} {f['tokens1']:>8.0f} "
                  f"{f['tokens16']:>9.0f} {f['flat']:>7.2f} {f['x512']:>6.1f} "
                  f"{f['x2048']:>6.1f} {f['scale16']:>5.2f}", flush=True)
        med = {k: statistics.median(f[k] for f in rounds) for k in rounds[0]}
        print(f"median: step p50 {med['step64']:.3f} / {med['step512']:.3f} / "
              f"{med['step2048']:.3f} ms at context 64 / 512 / 2048; stateless "
              f"{med['stateless512']:.2f} / {med['stateless2048']:.2f} ms at 512 / 2048; "
              f"{med['tokens1']:.0f} tokens/s with 1 session, {med['tokens16']:.0f} with 16")
        for name, value, bound, ok in (
                ("step 512 / step 64", med["flat"], "<= 2", med["flat"] <= 2),
                ("stateless / session at 512", med["x512"], ">= 10", med["x512"] >= 10),
                ("stateless / session at 2048", med["x2048"], ">= 50", med["x2048"] >= 50),
                ("16 sessions / 1, tokens/s", med["scale16"], ">= 4", med["scale16"] >= 4)):
            print(f"  {name:<30} {value:7.2f}  ({bound}: {'met' if ok else 'NOT met'})")
    finally:
        stop_server(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
