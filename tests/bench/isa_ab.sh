#!/usr/bin/env bash
# Our kernels' builds for two instruction sets on this CPU (core/kernels.h, Isa),
# alternated round by round: the attention-only decode (f32 and bf16 caches), a full
# model's decode steps and the batcher's rows from mha_core_bench --isa=..., then
# paged_read, which runs every lower build beside the best. Prints lscpu's model and
# the 2-thread read loop first; no load client.
#
#   tests/bench/isa_ab.sh [BUILD=build/release] [ISA_A=avx2] [ISA_B=baseline] [ROUNDS=2]
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build/release}
A=${2:-avx2}
B=${3:-baseline}
ROUNDS=${4:-2}
BENCH=$BUILD/tests/bench
FILTER='Decode/attention_only/G:8/|Decode/step/sessions:(1|12)/context:(64|2048)/|Rows/bert_base'
lscpu | grep -E 'Model name|CPU family|^Model:'
"$BENCH/memory_read" --bytes=1073741824 --threads=2 | tail -1
for round in $(seq "$ROUNDS"); do
  for isa in "$A" "$B"; do
    echo "== round $round, --isa=$isa"
    "$BENCH/mha_core_bench" --isa="$isa" --benchmark_filter="$FILTER" 2>&1 |
      grep -E '^kernels:|^(Decode|Rows)/' | grep -vE '_(mean|stddev|cv) '
  done
done
"$BENCH/paged_read" --rounds=7
