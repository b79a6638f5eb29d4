#!/usr/bin/env bash
# System shared memory against inline tensors (issue 33's figures), with the C++
# client (attention_client bench --protocol=kserve [--shared_memory=system]):
#   bert_base (deploy/models; B 8, Q = K 128, d 768 self-attention) at concurrency 1:
#     p50 end to end inline and by region, each over mha_core_bench
#     Forward/bert_base/f32's median (run here with the server's thread count), and
#     the server's median compute_us and total_us from its access log;
#   the toy request (the client's default, B 2, Q 4, K 6 on bert_base's sibling
#     model toy) at concurrency 1: req/s inline and by region.
# RUNS rounds, inline and shm alternated within each; figures are medians over rounds.
#
#   flock -x /work/cpu.lock chrt -r 10 tests/bench/shared_memory_bench.sh
#
# Env: BUILD (build/release), RUNS (5), DURATION (4s per run, warm-up 1s),
# THREADS (the server's compute threads and OMP_NUM_THREADS; nproc), OUT (a temp dir).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build/release}
RUNS=${RUNS:-5}
DURATION=${DURATION:-4s}
THREADS=${THREADS:-$(nproc)}
OUT=${OUT:-$(mktemp -d /tmp/mha_shm_bench.XXXXXX)}
SERVER=$BUILD/server/attention_server
CLIENT=$BUILD/client/attention_client
export OMP_NUM_THREADS=$THREADS

PID=
cleanup() {
  if [[ -n $PID ]]; then
    kill -TERM "$PID" 2>/dev/null || true
    wait "$PID" || true
  fi
}
trap cleanup EXIT

"$SERVER" --port=0 --http_port=-1 --metrics_port=-1 --model_repository=deploy/models \
  --compute_threads="$THREADS" --shared_memory=system --log_requests --log_format=json \
  >"$OUT/server.out" 2>"$OUT/server.log" &
PID=$!
for _ in $(seq 300); do
  grep -q '^listening on' "$OUT/server.out" 2>/dev/null && break
  sleep 0.1
done
TARGET=127.0.0.1:$(sed -n 's/^listening on .*:\([0-9]*\)$/\1/p' "$OUT/server.out")

bench() {  # NAME MODEL SHAPE-FLAGS... ; writes $OUT/NAME.RUN.json
  local name=$1 run=$2 model=$3
  shift 3
  "$CLIENT" bench --protocol=kserve --target="$TARGET" --model="$model" "$@" --concurrency=1 \
    --duration="$DURATION" --warmup=1s --window=1s --max_windows=100 \
    --json="$OUT/$name.$run.json" >/dev/null
}

for run in $(seq "$RUNS"); do
  bench bert_inline "$run" bert_base --batch=8 --num_queries=128 --num_keys=0
  bench bert_shm "$run" bert_base --batch=8 --num_queries=128 --num_keys=0 --shared_memory=system
  bench toy_inline "$run" toy
  bench toy_shm "$run" toy --shared_memory=system
done
cleanup
PID=

"$BUILD/tests/bench/mha_core_bench" --benchmark_filter='^Forward/bert_base/f32/' \
  --benchmark_repetitions=5 --benchmark_report_aggregates_only=true \
  --benchmark_format=json >"$OUT/core.json"

python3 - "$OUT" "$RUNS" "$THREADS" <<'EOF'
import json, statistics, subprocess, sys
out, runs, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def step(name, run):
    with open(f"{out}/{name}.{run}.json") as f:
        return json.load(f)["steps"][0]
core = json.load(open(f"{out}/core.json"))
forward_ms = next(b["real_time"] for b in core["benchmarks"] if b["name"].endswith("_median"))
unit = next(b["time_unit"] for b in core["benchmarks"] if b["name"].endswith("_median"))
forward_ms *= {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
compute, total = [], []
for line in open(f"{out}/server.log"):
    if '"bert_base"' in line and '"compute_us"' in line:
        record = json.loads(line[line.index("{"):])
        compute.append(record["compute_us"] / 1e3)
        total.append(record["total_us"] / 1e3)
model = next((l.split(":", 1)[1].strip() for l in subprocess.run(
    ["lscpu"], capture_output=True, text=True).stdout.splitlines()
    if l.startswith("Model name")), "?")
print(f"CPU: {model}; server --compute_threads={threads}; {runs} alternated runs")
print(f"mha_core_bench Forward/bert_base/f32 median {forward_ms:.2f} ms; server (every "
      f"bert_base request, both forms) compute_us median {statistics.median(compute):.2f} ms, "
      f"total_us median {statistics.median(total):.2f} ms")
for name in ("bert_inline", "bert_shm"):
    p50 = [step(name, r)["latency_us"]["p50"] / 1e3 for r in range(1, runs + 1)]
    m = statistics.median(p50)
    print(f"{name:12s} p50 {m:7.2f} ms / forward {m / forward_ms:.3f}   runs: "
          + ", ".join(f"{v:.2f}" for v in p50))
rates = {}
for name in ("toy_inline", "toy_shm"):
    rps = [step(name, r)["requests_per_s"] for r in range(1, runs + 1)]
    rates[name] = statistics.median(rps)
    print(f"{name:12s} {rates[name]:8.0f} req/s   runs: " + ", ".join(f"{v:.0f}" for v in rps))
print(f"toy shm / inline req/s: {rates['toy_shm'] / rates['toy_inline']:.3f}")
EOF
echo "reports and logs: $OUT"
