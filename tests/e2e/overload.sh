#!/usr/bin/env bash
# Overload: offered load at 3x the measured capacity for 30 s.
#   1. capacity: closed loop at --concurrency=CONCURRENCY for 15 s -> C req/s
#   2. unloaded p99: one request at a time for 10 s
#   3. overload: open loop at --request_rate=3C for 30 s, on a new server whose queue
#      is also bounded in expected wait (max_queue_size / C, see MAX_QUEUE_WAIT_MS)
#   4. recovery: --request_rate=C/2 for 10 s
# Pass: admitted p99 <= 2 x unloaded p99 + queue bound ((max_queue_size + max batch) / C),
# refusals are RESOURCE_EXHAUSTED, nothing else fails, no error after the burst,
# the server exits 0 on SIGTERM. Prints every figure. Only the overload step expects
# errors (bench --allow_errors=RESOURCE_EXHAUSTED): any other error makes that bench
# exit 1, and this script with it.
#
# Usage: tests/e2e/overload.sh [BUILD_DIR]   (default build/release)
# Env: SERVER_ARGS (extra server flags), MODEL_ARGS (default: bert_base with max_queue_size MAX_QUEUE_SIZE), BENCH_ARGS (one
#      bert_base sequence of 64 tokens, see lib.sh), MAX_QUEUE_SIZE (64),
#      MAX_QUEUE_WAIT_MS (the overload server's --max_queue_wait_us in ms; default
#      "auto", max_queue_size / C; 0 = none, the queue bounded in requests only),
#      CONCURRENCY (64), OMP_NUM_THREADS.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
BUILD="${1:-$here/../../build/release}"
WORK="$(mktemp -d /tmp/mha_overload.XXXXXX)"
source "$here/lib.sh"
max_queue="${MAX_QUEUE_SIZE:-64}"
wait_ms="${MAX_QUEUE_WAIT_MS:-auto}"
concurrency="${CONCURRENCY:-64}"
trap 'stop_server || true' EXIT
write_models "$WORK/models" "$max_queue"

# Capacity and unloaded latency on a server bounded in requests only: a bound in time
# would refuse part of the closed loop at concurrency 64 and understate C.
# shellcheck disable=SC2086
start_server --max_queue_size="$max_queue" ${MODEL_ARGS:---model_repository=$WORK/models}
echo "server $SERVER_TARGET (pid $SERVER_PID), max_queue_size $max_queue; work dir $WORK"
bench capacity 15 --concurrency="$concurrency"
capacity="$(metric capacity rps)"
bench unloaded 10 --concurrency=1
p99_unloaded="$(metric unloaded p99_ms)"
stop_server
# A request admitted at the tail of a full queue waits for the max_queue requests ahead
# of it, then runs in a batch of up to max_batch (32, lib.sh's config): both at the
# measured capacity C.
queue_bound_ms="$(calc "1000 * ($max_queue + 32) / $capacity")"
echo "capacity ${capacity} req/s (concurrency $concurrency); unloaded p50 $(metric unloaded p50_ms) ms, p99 ${p99_unloaded} ms; queue bound ${queue_bound_ms} ms"

# The overload server also bounds the queue's expected wait (--max_queue_wait_us) at
# what max_queue requests take at C: the same bound, held in time as compute slows.
[[ "$wait_ms" == auto ]] && wait_ms="$(calc "1000 * $max_queue / $capacity")"
wait_us="$(awk "BEGIN { printf \"%d\", 1000 * $wait_ms + 0.5 }")"
# shellcheck disable=SC2086
start_server --max_queue_size="$max_queue" --max_queue_wait_us="$wait_us" \
  ${MODEL_ARGS:---model_repository=$WORK/models}
echo "server $SERVER_TARGET (pid $SERVER_PID), max_queue_size $max_queue, max_queue_wait ${wait_ms} ms"
rss_start="$(rss_kib)"

offered="$(awk "BEGIN { printf \"%d\", 3 * $capacity + 0.5 }")"
bench overload 30 --request_rate="$offered" --allow_errors=RESOURCE_EXHAUSTED
admitted_rps="$(metric overload rps)"
p99_admitted="$(metric overload p99_ms)"
refused="$(metric overload error:RESOURCE_EXHAUSTED)"
errors="$(metric overload errors)"
other=$((errors - refused))
rss_peak="$(awk '/^VmHWM:/ {print $2}' "/proc/$SERVER_PID/status")"
limit="$(calc "2 * $p99_unloaded + $queue_bound_ms")"
echo "overload: offered ${offered} req/s for 30 s; admitted ${admitted_rps} req/s, p50 $(metric overload p50_ms) ms, p99 ${p99_admitted} ms (limit ${limit} ms); RESOURCE_EXHAUSTED ${refused}, other errors ${other}; RSS ${rss_start} -> peak ${rss_peak} KiB"

half="$(awk "BEGIN { printf \"%d\", $capacity / 2 + 0.5 }")"
bench recovery 10 --request_rate="$half"
echo "recovery: ${half} req/s, p99 $(metric recovery p99_ms) ms, errors $(metric recovery errors)"

status=0
le "$p99_admitted" "$limit" || { echo "FAIL: admitted p99 ${p99_admitted} ms > ${limit} ms"; status=1; }
((refused > 0)) || { echo "FAIL: no RESOURCE_EXHAUSTED at 3x capacity"; status=1; }
((other == 0)) || { echo "FAIL: ${other} errors other than RESOURCE_EXHAUSTED"; status=1; }
(($(metric recovery errors) == 0)) || { echo "FAIL: errors after the burst"; status=1; }
le "$(metric recovery p99_ms)" "$(calc "2 * $p99_unloaded + 5")" ||
  { echo "FAIL: p99 after the burst did not return near the unloaded p99"; status=1; }
stop_server || { echo "FAIL: server exit status $?"; status=1; }
trap - EXIT
((status == 0)) && echo "overload: PASS" || echo "overload: FAIL"
exit $status
