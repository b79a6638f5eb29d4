#!/usr/bin/env bash
# Protocol benchmark: the same request over attention.v1 (Attend), the Open Inference
# Protocol over gRPC (ModelInfer, raw FP32 bytes) and its KServe v2 REST form over
# HTTP (binary tensor data), at concurrency 1 and 64, for the toy model (a server
# without --model_repository, the default infer request: B 2, Q 4, K 6) and
# bert_base (deploy/models; B 8, Q = K = 128 self-attention, at concurrency 1 only).
# One server per model; each figure is the median of RUNS short bench runs, the
# protocols alternated within each round (attention, kserve, http, attention, ...)
# so that drift on a shared machine hits all three alike. Prints one table with
# the ratios kserve/attention and http/attention of req/s and p50, and the server's CPU
# time per request (utime + stime of /proc/PID/stat over the requests its /metrics
# counted, warm-up included) for each protocol, and the client's over the same requests.
#
#   tests/bench/protocol_bench.sh
#   RUNS=3 DURATION=2s tests/bench/protocol_bench.sh
#
# Env: BUILD (build/release), RUNS (5), WARMUP (1s) and DURATION (10s, measured; whole
# seconds) per run, THREADS (the server's compute threads and OMP_NUM_THREADS; nproc),
# HTTP_THREADS (the server's --http_threads; 0: one event loop per CPU), PROTOCOLS
# ("attention kserve http"), MODELS ("toy bert_base": either or both), OUT (a temp dir)
# for the JSON reports and server logs.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build/release}
RUNS=${RUNS:-5}
WARMUP=${WARMUP:-1s}
DURATION=${DURATION:-10s}
THREADS=${THREADS:-$(nproc)}
HTTP_THREADS=${HTTP_THREADS:-0}
OUT=${OUT:-$(mktemp -d /tmp/mha_protocol_bench.XXXXXX)}
SERVER=$BUILD/server/attention_server
CLIENT=$BUILD/client/attention_client
read -r -a PROTOCOLS <<<"${PROTOCOLS:-attention kserve http}"
MODELS=${MODELS:-toy bert_base}
CONCURRENCY=(1 64)
export OMP_NUM_THREADS=$THREADS

PID=
cleanup() {
  if [[ -n $PID ]]; then
    kill -TERM "$PID" 2>/dev/null || true
    wait "$PID" || true
  fi
}
trap cleanup EXIT

start_server() {  # $1: log file; rest: flags. Sets PID, PORT, HTTP_PORT and METRICS_PORT.
  local log=$1
  shift
  "$SERVER" --port=0 --http_port=0 --http_threads="$HTTP_THREADS" --metrics_port=0 \
    --compute_threads="$THREADS" "$@" \
    >"$log.out" 2>"$log.err" &
  PID=$!
  for _ in $(seq 300); do
    if grep -q "^listening on" "$log.out" 2>/dev/null && grep -q "^http on" "$log.out"; then
      PORT=$(sed -n 's/^listening on .*:\([0-9]*\)$/\1/p' "$log.out")
      HTTP_PORT=$(sed -n 's/^http on .*:\([0-9]*\)$/\1/p' "$log.out")
      METRICS_PORT=$(sed -n 's/^metrics on .*:\([0-9]*\)$/\1/p' "$log.out")
      return 0
    fi
    kill -0 "$PID" 2>/dev/null || { cat "$log.err" >&2; return 1; }
    sleep 0.1
  done
  echo "server did not start" >&2
  return 1
}

stop_server() {
  kill -TERM "$PID"
  wait "$PID" || true
  PID=
}

# Measured seconds -> bench windows of 1 s (at least one), all of them summarised.
windows=$((${DURATION%s}))
(( windows >= 1 )) || windows=1

# The server's CPU ticks (utime + stime) and the requests its /metrics counted.
server_usage() {
  local ticks requests
  ticks=$(awk '{print $14 + $15}' "/proc/$PID/stat")
  requests=$(curl -s "127.0.0.1:$METRICS_PORT/metrics" |
    awk '/^mha_requests_total\{/ {n += $NF} END {printf "%d", n}')
  echo "$ticks $requests"
}

run() {  # $1 model label, $2 protocol, $3 concurrency, $4 round; rest: request flags
  local label=$1 protocol=$2 concurrency=$3 round=$4
  shift 4
  local target=127.0.0.1:$PORT
  [[ $protocol == http ]] && target=127.0.0.1:$HTTP_PORT
  local before after
  local cell=$OUT/${label}_${protocol}_c${concurrency}_r${round}
  before=$(server_usage)
  # The subshell's `times` (second line: its children's user and system time) gives
  # the client's CPU time.
  (
    "$CLIENT" bench --protocol="$protocol" --target="$target" "$@" \
      --concurrency="$concurrency" --warmup="$WARMUP" --window=1s --max_windows="$windows" \
      --stable_windows="$windows" --duration=$((windows + 3))s --timeout=30s --progress=false \
      --json="$cell.json" >/dev/null
    times >"$cell.client"
  )
  after=$(server_usage)
  echo "$before $after $(getconf CLK_TCK)" >"$cell.cpu"
}

bench_model() {  # $1 label, $2 concurrency levels ("1 64"); rest: request flags
  local label=$1
  local -a levels
  read -r -a levels <<<"$2"
  shift 2
  for concurrency in "${levels[@]}"; do
    for round in $(seq "$RUNS"); do
      for protocol in "${PROTOCOLS[@]}"; do
        run "$label" "$protocol" "$concurrency" "$round" "$@"
      done
    done
    echo "  $label concurrency $concurrency: $RUNS rounds done" >&2
  done
}

echo "protocol bench: $RUNS runs per cell (warm-up $WARMUP, $windows s measured); server" \
  "--compute_threads=$THREADS --http_threads=$HTTP_THREADS; reports in $OUT"
if [[ " $MODELS " == *" toy "* ]]; then
  start_server "$OUT/server_toy"
  bench_model toy "${CONCURRENCY[*]}"
  stop_server
fi
if [[ " $MODELS " == *" bert_base "* ]]; then
  start_server "$OUT/server_bert" --model_repository=deploy/models
  bench_model bert_base 1 --model=bert_base --batch=8 --num_queries=128 --num_keys=0 --valid_lens=none
  stop_server
fi

python3 - "$OUT" "$RUNS" "$(nproc)" "${PROTOCOLS[*]}" "$MODELS" <<'EOF'
import json, statistics, sys
out, runs, cores = sys.argv[1], int(sys.argv[2]), sys.argv[3]
protocols = tuple(sys.argv[4].split())
models = tuple(sys.argv[5].split())
requests = {"toy": "B 2, Q 4, K 6 (default infer request)", "bert_base": "B 8, Q = K = 128"}
levels = {"toy": (1, 64), "bert_base": (1,)}

def cell(model, protocol, c):
    reports = [json.load(open(f"{out}/{model}_{protocol}_c{c}_r{r}.json")) for r in range(1, runs + 1)]
    steps = [rep["steps"][0] for rep in reports]
    errors = sum(sum(s["errors"].values()) for s in steps)
    cpu, client = [], []
    for r in range(1, runs + 1):
        t0, n0, t1, n1, hz = map(int, open(f"{out}/{model}_{protocol}_c{c}_r{r}.cpu").read().split())
        cpu.append((t1 - t0) / hz * 1e6 / max(1, n1 - n0))
        # `times`: the shell's user and system time, then its children's ("0m1.234s 0m0.567s").
        seconds = sum(int(t.split("m")[0]) * 60 + float(t.split("m")[1].rstrip("s"))
                      for t in open(f"{out}/{model}_{protocol}_c{c}_r{r}.client").read().split()[2:])
        client.append(seconds * 1e6 / max(1, n1 - n0))
    return (statistics.median(s["requests_per_s"] for s in steps),
            statistics.median(s["latency_us"]["p50"] for s in steps) / 1e3, errors,
            statistics.median(cpu), statistics.median(client))

print(f"\nmedian of {runs} runs per cell; protocols alternated within each round; one server "
      f"per model.\nThe client (load generator) shares the machine's {cores} cores with the "
      f"server: absolute figures are lower than a separate client would measure.\n")
print(f"{'model':10} {'conc':>4} {'protocol':9} {'req/s':>9} {'p50 ms':>8} {'errors':>6} "
      f"{'CPU us/req':>10} {'client us/req':>13} {'req/s vs attention':>18} "
      f"{'p50 vs attention':>16} {'CPU vs attention':>16}")
for model in (m for m in ("toy", "bert_base") if m in models):
    for c in levels[model]:
        base = cell(model, "attention", c)
        for protocol in protocols:
            rps, p50, errors, cpu, client = cell(model, protocol, c)
            ratio = "" if protocol == "attention" else (
                f"{rps / base[0]:18.2f} {p50 / base[1]:16.2f} {cpu / base[3]:16.2f}")
            print(f"{model:10} {c:4d} {protocol:9} {rps:9.0f} {p50:8.3f} {errors:6d} {cpu:10.0f} "
                  f"{client:13.0f} {ratio}")
print("\nrequests: " + "; ".join(f"{m}: {r}" for m, r in requests.items()) +
      ".\nattention: attention.v1 Attend; kserve: inference ModelInfer with raw FP32 "
      "bytes; http: POST /v2/models/{model}/infer with binary tensor data, one keep-alive "
      "connection per concurrency slot.\nRatios are protocol / attention: req/s below 1 "
      "and p50 above 1 are the protocol's overhead. CPU us/req: the server's utime + stime "
      "over the requests its /metrics counted (warm-up included), median of the runs; client "
      "us/req: the load client's, over the same requests.")
EOF
