#!/usr/bin/env bash
# Before/after comparison of two builds on this machine, alternated so that both
# see the same noise: mha_core_bench's Forward shapes, and batching_bench.sh's toy
# and bert_base rows (req/s with batching on and off at concurrency 1, 8, 64; the
# load client shares the cores with the server). Prints the median of RUNS runs of
# each figure per build and B/A.
#
#   git worktree add /tmp/before <commit> && (cd /tmp/before && cmake --preset release &&
#     cmake --build --preset release --target attention_server attention_client mha_core_bench)
#   tests/bench/ab_compare.sh /tmp/before/build/release build/release
#
# Env: RUNS (5), DURATION per batching step (3s), CORE_FILTER (Forward shapes).
set -euo pipefail
cd "$(dirname "$0")/../.."
A=$1
B=$2
RUNS=${RUNS:-5}
export DURATION=${DURATION:-3s}
CORE_FILTER=${CORE_FILTER:-'Forward/(bert|long|small|padded)'}
OUT=$(mktemp -d /tmp/mha_ab.XXXXXX)
echo "A=$A B=$B runs=$RUNS; reports in $OUT"
for run in $(seq "$RUNS"); do
  for side in A B; do
    build=${!side}
    dir="$OUT/$side$run"
    mkdir -p "$dir"
    echo "== run $run, $side"
    "$build/tests/bench/mha_core_bench" --benchmark_filter="$CORE_FILTER" \
      --benchmark_min_time=0.2 --benchmark_out="$dir/core.json" --benchmark_out_format=json \
      >/dev/null
    BUILD=$build OUT=$dir tests/bench/batching_bench.sh >"$dir/batching.txt" 2>&1
  done
done
python3 - "$OUT" "$RUNS" <<'PY'
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
def figures(side, run):
    d = f"{out}/{side}{run}"
    f = {}
    for b in json.load(open(f"{d}/core.json"))["benchmarks"]:
        f[f"core {b['name']} us"] = b["real_time"] * {"ns": 1e-3, "us": 1, "ms": 1e3}[b["time_unit"]]
    for model in ("toy", "bert_base"):
        for on in ("true", "false"):
            for s in json.load(open(f"{d}/{model}_batching_{on}.json"))["steps"]:
                key = f"{model} batching {'on' if on == 'true' else 'off'} c{s['concurrency']} req/s"
                f[key] = s["requests_per_s"]
    return f
a = [figures("A", r) for r in range(1, runs + 1)]
b = [figures("B", r) for r in range(1, runs + 1)]
print(f"\n{'figure':48} {'A median':>10} {'B median':>10} {'B/A':>6}")
for key in a[0]:
    ma = statistics.median(x[key] for x in a)
    mb = statistics.median(x[key] for x in b)
    print(f"{key:48} {ma:10.1f} {mb:10.1f} {mb / ma:6.3f}")
print("\ncore rows: time per call (lower is better); batching rows: req/s (higher is better)")
PY
