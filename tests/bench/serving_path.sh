#!/usr/bin/env bash
# The serving path against its ceilings: see tests/bench/serving_path.py.
#   nice -n -20 tests/bench/serving_path.sh [--runs=5] [--only=health,batching,core,cold,health_p99,floor]
set -euo pipefail
cd "$(dirname "$0")/../.."
exec /usr/bin/python3 tests/bench/serving_path.py "$@"
