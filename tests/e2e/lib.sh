# Shared by overload.sh and soak.sh: start and stop attention_server, run
# `attention_client bench`, read its JSON report, sample the server's RSS and fds.
# Source it; needs BUILD (a build directory with server/ and client/).

die() { echo "error: $*" >&2; exit 2; }

# write_models DIR MAX_QUEUE_SIZE: a repository with bert_base (deploy/models' sizes, a
# 500 us queue delay) whose queue bound is MAX_QUEUE_SIZE, so that the bound is known here.
write_models() {
  mkdir -p "$1/bert_base"
  cat >"$1/bert_base/config.pbtxt" <<CONFIG
num_hiddens: 768 num_heads: 12 bias: true seeded { seed: 1 }
limits { max_batch_size: 64 max_sequence_length: 512 }
batching { max_batch_size: 32 max_queue_delay_us: 500 max_queue_size: $2 }
CONFIG
}

# The request every bench sends (BENCH_ARGS overrides): one BERT-base sequence of 64
# tokens, self-attention. Compute, not gRPC's per-call cost, then sets the capacity, so
# the load generator sharing the machine does not decide the result.
DEFAULT_BENCH_ARGS="--model=bert_base --batch=1 --num_queries=64 --num_keys=0 --valid_lens=none"

# start_server ARGS...: sets SERVER_PID, SERVER_TARGET; the log goes to $WORK/server.log.
# SERVER_ARGS (env) adds flags to every server these scripts start.
start_server() {
  local server="$BUILD/server/attention_server"
  [[ -x "$server" ]] || die "missing $server (cmake --build --preset release)"
  local extra=()
  extra+=(--batching=true)  # the dynamic batcher (the default; stated for the record)
  # shellcheck disable=SC2086
  "$server" --port=0 --metrics_port=0 --http_port=-1 "${extra[@]}" ${SERVER_ARGS:-} "$@" >"$WORK/server.out" \
    2>"$WORK/server.log" &
  SERVER_PID=$!
  local i
  for ((i = 0; i < 300; ++i)); do
    if grep -q '^listening on ' "$WORK/server.out" 2>/dev/null; then
      SERVER_TARGET="$(sed -n 's/^listening on //p' "$WORK/server.out" | head -1)"
      return 0
    fi
    kill -0 "$SERVER_PID" 2>/dev/null || die "server exited: $(cat "$WORK/server.log")"
    sleep 0.1
  done
  die "server did not start in 30 s"
}

stop_server() {
  [[ -n "${SERVER_PID:-}" ]] || return 0
  kill -TERM "$SERVER_PID" 2>/dev/null
  wait "$SERVER_PID"
  local rc=$?
  SERVER_PID=
  return $rc
}

# bench NAME SECONDS ARGS...: one bench step of SECONDS measured (1 s warm-up, 5 s
# windows, all of them: no early stop on stability), JSON to $WORK/NAME.json. Dies when
# bench fails: it measured nothing, or a request failed with a code ARGS do not allow
# (--allow_errors=CODE,...).
bench() {
  local name="$1" seconds="$2"
  shift 2
  local client="$BUILD/client/attention_client"
  [[ -x "$client" ]] || die "missing $client (the load client, attention_client bench)"
  local windows=$(((seconds + 4) / 5))
  "$client" bench --target="$SERVER_TARGET" --json="$WORK/$name.json" --progress=false \
    --warmup=1s --window=5s --max_windows="$windows" --stable_windows=$((windows + 1)) \
    --duration="$((windows * 5 + 2))s" ${BENCH_ARGS:-$DEFAULT_BENCH_ARGS} "$@" \
    >"$WORK/$name.out" 2>&1 || die "bench $name failed: $(tail -5 "$WORK/$name.out")"
}

# metric NAME FIELD: one figure from $WORK/NAME.json. FIELD is one of rps, p50_ms,
# p99_ms, ok, requests, errors, or error:CODE (e.g. error:RESOURCE_EXHAUSTED).
metric() {
  "${PYTHON:-python3}" "$(dirname "${BASH_SOURCE[0]}")/bench_report.py" "$WORK/$1.json" "$2"
}

rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$SERVER_PID/status"; }
fd_count() { ls "/proc/$SERVER_PID/fd" | wc -l; }

# le A B: A <= B for decimals.
le() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a <= b) }'; }
calc() { awk "BEGIN { printf \"%.3f\", $* }"; }
