#!/usr/bin/env bash
# The GPU test suite in parts, each within one 10-minute device call (on a fresh machine
# Triton compiles every kernel variant again and the whole suite runs past 10 minutes).
#   bash scripts/run_gpu_tests.sh a       # formats, backends, compare, distributed
#   bash scripts/run_gpu_tests.sh b       # fused, modules, ops and the top-level tests
#   bash scripts/run_gpu_tests.sh slow    # the kernel fuzzers of tests/slow (minutes each)
# TEST_TIMEOUT (seconds, default 540) caps the run; pytest is interrupted with SIGINT so
# it still prints its summary and the slowest tests. The log goes to $OUT/tests_<part>.log.
set -u
PART=${1:?part a, b or slow}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case "$PART" in
  a) FILES="tests/formats tests/backends tests/compare tests/distributed" ;;
  b) FILES="tests/fused tests/modules tests/ops $(ls tests/test_*.py | tr '\n' ' ')" ;;
  slow) FILES="--slow tests/slow" ;;
  *) echo "unknown part '$PART': use a, b or slow" >&2; exit 2 ;;
esac
LOG="$OUT/tests_$PART.log"
timeout -s INT "${TEST_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider --durations=10 \
  $FILES > "$LOG" 2>&1
echo "tests $PART rc=$?"
grep -E "^(FAILED|ERROR)" "$LOG" | head -20
grep -E "passed|failed|error|interrupted" "$LOG" | tail -3
