#!/usr/bin/env bash
# Runs every libFuzzer target for SECONDS each and prints its figures.
# Usage: tests/fuzz/run_fuzzers.sh SECONDS [BUILD_DIR]   (BUILD_DIR: build/fuzz)
#   cmake --preset fuzz && cmake --build --preset fuzz && tests/fuzz/run_fuzzers.sh 60
# The committed seeds (tests/fuzz/corpus/<target>) are read, never written: new
# inputs go to a scratch corpus, crash/leak/timeout inputs to $MHA_FUZZ_OUT
# (default: a temporary directory), which is printed. Exit status 1 if any target
# found a crash, a leak or a timeout. MHA_FUZZ_TARGETS (default: every target) picks
# some, e.g. MHA_FUZZ_TARGETS=session_request. MHA_FUZZ_JOBS (default: the number
# of CPUs) targets run at once, each on one thread for its SECONDS; the figures are
# printed in the targets' order once all have finished.
set -uo pipefail
seconds="${1:?usage: run_fuzzers.sh SECONDS [BUILD_DIR]}"
here="$(cd "$(dirname "$0")" && pwd)"
build="${2:-$here/../../build/fuzz}"
out="${MHA_FUZZ_OUT:-$(mktemp -d /tmp/mha_fuzz.XXXXXX)}"
mkdir -p "$out"
export OMP_NUM_THREADS=1
# Our code checks its own invariants with abort(); UBSan must stop too.
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

declare -A max_len=([request]=4096 [safetensors]=4096 [config]=2048 [http_body]=8192 [http_framing]=4096 [http_response]=4096
  [inference_request]=4096 [session_request]=4096 [shared_memory]=1024)
# getconf, not nproc: nproc follows the OMP_NUM_THREADS=1 set above.
parallel="${MHA_FUZZ_JOBS:-$(getconf _NPROCESSORS_ONLN)}"
targets="${MHA_FUZZ_TARGETS:-request safetensors config http_body http_framing http_response inference_request session_request shared_memory}"
for target in $targets; do
  if [[ ! -x "$build/tests/fuzz/${target}_fuzzer" ]]; then
    echo "missing $build/tests/fuzz/${target}_fuzzer (cmake --preset fuzz && cmake --build --preset fuzz)" >&2
    exit 2
  fi
done

# One target: its figures (and, on a finding, the finding and its input) into
# $out/$target.summary.
run_target() {
  local target="$1"
  local binary="$build/tests/fuzz/${target}_fuzzer"
  local work="$out/$target.corpus"
  mkdir -p "$work" "$out/$target.artifacts"
  local log="$out/$target.log"
  "$binary" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -max_len="${max_len[$target]}" -print_final_stats=1 \
    -artifact_prefix="$out/$target.artifacts/" "$work" "$here/corpus/$target" >"$log" 2>&1
  local rc=$?
  # The last status line: "#N  DONE|pulse|NEW ... cov: C ft: F ... exec/s: E ...".
  local line execs rate cov ft result=ok
  line="$(grep -E '^#[0-9]+' "$log" | tail -1)"
  execs="$(sed -nE 's/^stat::number_of_executed_units: *([0-9]+).*/\1/p' "$log" | tail -1)"
  rate="$(sed -nE 's/^stat::average_exec_per_sec: *([0-9]+).*/\1/p' "$log" | tail -1)"
  cov="$(sed -nE 's/.* cov: ([0-9]+).*/\1/p' <<<"$line")"
  ft="$(sed -nE 's/.* ft: ([0-9]+).*/\1/p' <<<"$line")"
  if ((rc != 0)) || ls "$out/$target.artifacts/"* >/dev/null 2>&1; then
    result="FAILED (exit $rc; see $log)"
  fi
  {
    printf '%-12s %8s %10s %8s %8s %8s  %s\n' "$target" "$seconds" "${execs:-?}" \
      "${rate:-?}" "${cov:-?}" "${ft:-?}" "$result"
    if [[ "$result" != ok ]]; then
      # The log dies with the machine in CI: show the finding and its input here.
      grep -A40 -m1 -E '^==[0-9]+==|ERROR: libFuzzer|runtime error:' "$log" | sed 's/^/    /'
      for artefact in "$out/$target.artifacts/"*; do
        [[ -f "$artefact" ]] || continue
        echo "    input $artefact (base64):"
        head -c 4096 "$artefact" | base64 | sed 's/^/    /'
      done
    fi
  } >"$out/$target.summary"
}

for target in $targets; do
  while (($(jobs -rp | wc -l) >= parallel)); do wait -n; done
  run_target "$target" &
done
wait

status=0
printf '%-12s %8s %10s %8s %8s %8s  %s\n' target seconds execs exec/s cov ft result
for target in $targets; do
  cat "$out/$target.summary"
  head -1 "$out/$target.summary" | grep -q ' ok$' || status=1
done
echo "logs, scratch corpora and artefacts: $out"
exit $status
