#!/usr/bin/env bash
# Batching benchmark: small requests (B 1, Q = K = 32, self-attention) for the toy
# and the BERT-base-sized model, at concurrency 1, 8 and 64, with dynamic batching
# on and off, against a real server on loopback, driven by attention_client bench
# on the same machine. Then the core alone (mha_core_bench Rows/) on the rows the
# batcher formed, as the ceiling the service is compared with.
#
#   tests/bench/batching_bench.sh                     # 1 worker x all cores
#   WORKERS=2 THREADS=1 tests/bench/batching_bench.sh # 2 workers x 1 thread
#
# Env: BUILD (build/release), WORKERS (1), THREADS (threads per worker; nproc /
# WORKERS), DURATION per step (12s), OUT (a temp dir) for the JSON reports,
# BATCHING_FLAGS (extra flags for the batching server, e.g. --max_queue_delay_us=500).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build/release}
WORKERS=${WORKERS:-1}
THREADS=${THREADS:-$(($(nproc) / WORKERS))}
DURATION=${DURATION:-12s}
OUT=${OUT:-$(mktemp -d /tmp/mha_batching_bench.XXXXXX)}
SERVER=$BUILD/server/attention_server
CLIENT=$BUILD/client/attention_client
export OMP_NUM_THREADS=$THREADS

start_server() {  # $1: log file; rest: flags. Sets PID and PORT.
  local log=$1
  shift
  "$SERVER" --port=0 --metrics_port=-1 --model_repository=deploy/models \
    --compute_workers="$WORKERS" --compute_threads=$((WORKERS * THREADS)) "$@" \
    >"$log.out" 2>"$log.err" &
  PID=$!
  for _ in $(seq 300); do
    if grep -q "^listening on" "$log.out" 2>/dev/null; then
      PORT=$(sed -n 's/^listening on .*:\([0-9]*\)$/\1/p' "$log.out")
      return 0
    fi
    kill -0 "$PID" 2>/dev/null || { cat "$log.err" >&2; return 1; }
    sleep 0.1
  done
  echo "server did not start" >&2
  return 1
}

echo "workers $WORKERS x threads $THREADS; batching flags: ${BATCHING_FLAGS:-none}; reports in $OUT"
for batching in true false; do
  flags=(--batching=$batching)
  [[ $batching == true ]] && flags+=(${BATCHING_FLAGS:-})
  start_server "$OUT/server_$batching" "${flags[@]}"
  for model in toy bert_base; do
    echo "== $model, batching $batching"
    "$CLIENT" bench --target="127.0.0.1:$PORT" --model=$model --batch=1 --num_queries=32 \
      --num_keys=0 --valid_lens=none --concurrency=1:64:x8 --warmup=2s --window=2s \
      --duration="$DURATION" --timeout=30s --progress=false \
      --json="$OUT/${model}_batching_$batching.json" | tail -n +2
  done
  kill -TERM "$PID"
  wait "$PID" || true
done

"$BUILD/tests/bench/mha_core_bench" --benchmark_filter='Rows/' --benchmark_min_time=0.5 \
  --benchmark_format=console --benchmark_out="$OUT/core_rows.json" \
  --benchmark_out_format=json >/dev/null

python3 - "$OUT" "$WORKERS" <<'EOF'
import json, math, sys
out, workers = sys.argv[1], int(sys.argv[2])
core = {}
for b in json.load(open(f"{out}/core_rows.json"))["benchmarks"]:
    name, rows = b["name"].split("/")[1], int(b["name"].split("/")[2])
    core.setdefault(name.removesuffix("_q32"), {})[rows] = b["requests/s"]

def ceiling(model, rows):
    """Core requests/s at `rows` rows per call (log-linear between measured sizes)."""
    pts = sorted(core[model].items())
    rows = min(max(rows, pts[0][0]), pts[-1][0])
    for (r0, v0), (r1, v1) in zip(pts, pts[1:]):
        if r0 <= rows <= r1:
            t = (math.log(rows) - math.log(r0)) / (math.log(r1) - math.log(r0))
            return workers * (v0 + t * (v1 - v0))
    return workers * pts[-1][1]

print(f"\n{'model':10} {'conc':>5} {'on req/s':>9} {'off req/s':>9} {'on/off':>6} "
      f"{'on p50 ms':>9} {'on p99 ms':>9} {'off p99 ms':>10} {'batch':>6} {'core req/s':>10} {'svc/core':>8}")
for model in ("toy", "bert_base"):
    on = {s["concurrency"]: s for s in json.load(open(f"{out}/{model}_batching_true.json"))["steps"]}
    off = {s["concurrency"]: s for s in json.load(open(f"{out}/{model}_batching_false.json"))["steps"]}
    for c in sorted(on):
        a, b = on[c], off[c]
        rows = max(a["server"]["batch_rows"], 1.0)
        cap = ceiling(model, rows)
        print(f"{model:10} {c:5d} {a['requests_per_s']:9.0f} {b['requests_per_s']:9.0f} "
              f"{a['requests_per_s'] / b['requests_per_s']:6.2f} {a['latency_us']['p50'] / 1e3:9.2f} "
              f"{a['latency_us']['p99'] / 1e3:9.2f} {b['latency_us']['p99'] / 1e3:10.2f} "
              f"{rows:6.1f} {cap:10.0f} {a['requests_per_s'] / cap:8.2f}")
print("\nbatch: mean rows per forward call on the server (batching on); core req/s: "
      "mha_core_bench Rows/ at that many rows x workers; svc/core: service over core.")
EOF
