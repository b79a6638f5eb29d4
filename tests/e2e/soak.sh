#!/usr/bin/env bash
# Soak: 10 minutes at 70% of the measured capacity (not in every CI run).
# Pass: zero errors, RSS growth < 5% from the end of warm-up (60 s) to the end,
# no growth in open file descriptors, and a clean exit on SIGTERM. Samples the
# server's RSS and fd count every 10 s and prints them.
#
# Usage: tests/e2e/soak.sh [BUILD_DIR] [DURATION_S]   (build/release, 600)
# Env: SERVER_ARGS (extra server flags), MODEL_ARGS, BENCH_ARGS (as overload.sh), CONCURRENCY (64), OMP_NUM_THREADS.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
BUILD="${1:-$here/../../build/release}"
duration="${2:-600}"
warmup=60
WORK="$(mktemp -d /tmp/mha_soak.XXXXXX)"
source "$here/lib.sh"
concurrency="${CONCURRENCY:-64}"
trap 'stop_server || true' EXIT
write_models "$WORK/models" 256

# shellcheck disable=SC2086
start_server ${MODEL_ARGS:---model_repository=$WORK/models}
echo "server $SERVER_TARGET (pid $SERVER_PID); work dir $WORK"
bench capacity 15 --concurrency="$concurrency"
capacity="$(metric capacity rps)"
rate="$(awk "BEGIN { printf \"%d\", 0.7 * $capacity + 0.5 }")"
echo "capacity ${capacity} req/s; soaking at ${rate} req/s for ${duration} s"

windows=$(((duration + 9) / 10))
"$BUILD/client/attention_client" bench --target="$SERVER_TARGET" --request_rate="$rate" \
  --warmup=1s --window=10s --max_windows="$windows" --stable_windows=$((windows + 1)) \
  --duration="$((windows * 10 + 2))s" --progress=false --json="$WORK/soak.json" \
  ${BENCH_ARGS:-$DEFAULT_BENCH_ARGS} \
  >"$WORK/soak.out" 2>&1 &
client=$!
printf '%6s %10s %5s\n' t_s rss_kib fds | tee "$WORK/samples.txt"
rss_warm= fds_warm=
for ((t = 0; t <= duration; t += 10)); do
  printf '%6d %10d %5d\n' "$t" "$(rss_kib)" "$(fd_count)" | tee -a "$WORK/samples.txt"
  if ((t == warmup)); then rss_warm="$(rss_kib)"; fds_warm="$(fd_count)"; fi
  kill -0 "$client" 2>/dev/null || break
  sleep 10
done
wait "$client" || die "bench failed: $(tail -5 "$WORK/soak.out")"
rss_end="$(rss_kib)"
fds_end="$(fd_count)"
errors="$(metric soak errors)"
growth="$(calc "100 * ($rss_end - $rss_warm) / $rss_warm")"
echo "soak: ${rate} req/s offered, $(metric soak rps) req/s served, p50 $(metric soak p50_ms) ms, p99 $(metric soak p99_ms) ms, errors ${errors}"
echo "soak: RSS ${rss_warm} KiB after warm-up -> ${rss_end} KiB at the end (${growth}%); fds ${fds_warm} -> ${fds_end}"

status=0
((errors == 0)) || { echo "FAIL: ${errors} errors"; status=1; }
le "$growth" 5 || { echo "FAIL: RSS grew ${growth}% (limit 5%)"; status=1; }
((fds_end <= fds_warm)) || { echo "FAIL: fds grew ${fds_warm} -> ${fds_end}"; status=1; }
stop_server || { echo "FAIL: server exit status $?"; status=1; }
trap - EXIT
((status == 0)) && echo "soak: PASS" || echo "soak: FAIL"
exit $status
