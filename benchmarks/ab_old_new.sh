#!/usr/bin/env bash
# One device call: GPU tests of the touched code, host breakdown and shape-1 Linear
# steps, the working tree against an older commit unpacked in .oldtree (git archive REV |
# tar -x -C .oldtree; carry it), in the same call. TESTS, HOST_RECIPES, SHAPES, RECIPES
# override the defaults.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LOWPREC_RESULTS="$OUT/results.csv"
if ls .whl/torchao-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/torchao-*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
T0=$(date +%s); t() { echo "== $* (t=$(( $(date +%s) - T0 ))s)"; }
t tests
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x -p no:cacheprovider ${TESTS:-tests/formats/test_kernels_fp8.py tests/test_backends_gpu.py tests/test_grad_split.py} > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -3 "$OUT/tests.log"
t host
python3 benchmarks/host_breakdown.py --recipes ${HOST_RECIPES:-current,delayed} > "$OUT/host_new.log" 2>&1
(cd .oldtree && python3 benchmarks/host_breakdown.py --recipes ${HOST_RECIPES:-current,delayed} > "$OUT/host_old.log" 2>&1)
grep -E "^(bf16|lowprec|#####)" "$OUT/host_new.log" "$OUT/host_old.log"
t linear
for tree in new old; do
  dir=.; [ $tree = old ] && dir=.oldtree
  (cd $dir && python3 benchmarks/bench_linear.py --shapes ${SHAPES:-16384x4096x4096} \
      --recipes ${RECIPES:-current,delayed,block} --torchao tensorwise --rounds 2 \
      --warmup-seconds 1 --no-csv > "$OUT/linear_$tree.log" 2>&1)
  echo "-- $tree"; grep -E "^  linear " "$OUT/linear_$tree.log"
done
t done
