#!/usr/bin/env bash
# The GPU test suite in parts, each meant for one 10-minute device call:
#   bash scripts/run_gpu_tests.sh a       # formats, gemm, kernels, linear
#   bash scripts/run_gpu_tests.sh b       # recipe, memory, model, compile, fused, modules, ops,
#                                         # debug, optim and the top-level tests
#   bash scripts/run_gpu_tests.sh c       # compare, distributed (gloo ranks on the CPU),
#                                         # integrations
#   bash scripts/run_gpu_tests.sh slow    # the kernel fuzzers of tests/slow (minutes each)
# Serially a part runs past 10 minutes on a fresh machine (Triton compiles every kernel
# variant). With pytest-xdist importable (its wheel and execnet's carried in .whl/ and
# installed to /tmp/site) each part runs on XDIST_WORKERS workers (default 14): on an H100,
# part a takes about 90 s, b about 200 s, c about 220 s.
# TEST_TIMEOUT (seconds, default 540) caps the run; pytest is interrupted with SIGINT so
# it still prints its summary and the slowest tests. The log goes to $OUT/tests_<part>.log.
set -u
PART=${1:?part a, b, c or slow}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case "$PART" in
  a) FILES="tests/formats tests/gemm tests/kernels tests/linear" ;;
  b) FILES="tests/recipe tests/memory tests/model tests/compile tests/fused tests/modules tests/ops
     tests/debug tests/optim $(ls tests/test_*.py | tr '\n' ' ')" ;;
  c) FILES="tests/compare tests/distributed tests/integrations" ;;
  slow) FILES="--slow tests/slow" ;;
  *) echo "unknown part '$PART': use a, b, c or slow" >&2; exit 2 ;;
esac
if ls .whl/pytest_xdist-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/pytest_xdist-*.whl \
    .whl/execnet-*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
PARALLEL=""
python3 -c "import xdist" 2>/dev/null && PARALLEL="-n ${XDIST_WORKERS:-14}"
LOG="$OUT/tests_$PART.log"
timeout -s INT "${TEST_TIMEOUT:-540}" python3 -m pytest -v -p no:cacheprovider --durations=10 \
  $PARALLEL $FILES > "$LOG" 2>&1
echo "tests $PART rc=$?"
grep -E "^(FAILED|ERROR)| (FAILED|ERROR) " "$LOG" | head -20
grep -E "passed|failed|error|interrupted" "$LOG" | tail -3
