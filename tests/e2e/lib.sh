# Shared by overload.sh and soak.sh: start and stop attention_server, run
# `attention_client bench`, read its JSON report, sample the server's RSS and fds.
# Source it; needs BUILD (a build directory with server/ and client/).

die() { echo "error: $*" >&2; exit 2; }

# start_server ARGS...: sets SERVER_PID, SERVER_TARGET; the log goes to $WORK/server.log.
start_server() {
  local server="$BUILD/server/attention_server"
  [[ -x "$server" ]] || die "missing $server (cmake --build --preset release)"
  local extra=()
  # Flags of the dynamic batcher, passed only when this server has them.
  if "$server" --help 2>&1 | grep -q -- '--batching'; then extra+=(--batching=true); fi
  "$server" --port=0 "${extra[@]}" "$@" >"$WORK/server.out" 2>"$WORK/server.log" &
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

# bench NAME ARGS...: runs the load client against the server, JSON to $WORK/NAME.json.
bench() {
  local name="$1"
  shift
  local client="$BUILD/client/attention_client"
  [[ -x "$client" ]] || die "missing $client (the load client, attention_client bench)"
  "$client" bench --target="$SERVER_TARGET" --json="$WORK/$name.json" "$@" \
    >"$WORK/$name.out" 2>&1 || die "bench $name failed: $(tail -5 "$WORK/$name.out")"
}

# metric NAME FIELD: one figure from $WORK/NAME.json. FIELD is one of rps, p50_ms,
# p99_ms, ok, errors, or error:CODE (e.g. error:RESOURCE_EXHAUSTED).
metric() {
  "${PYTHON:-python3}" "$(dirname "${BASH_SOURCE[0]}")/bench_report.py" "$WORK/$1.json" "$2"
}

rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$SERVER_PID/status"; }
fd_count() { ls "/proc/$SERVER_PID/fd" | wc -l; }

# le A B: A <= B for decimals.
le() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a <= b) }'; }
calc() { awk "BEGIN { printf \"%.3f\", $* }"; }
