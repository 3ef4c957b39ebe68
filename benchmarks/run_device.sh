#!/usr/bin/env bash
# One device call: the benchmarks, then the GPU backend tests; logs and results.csv go to $OUT.
#   bash benchmarks/run_device.sh validate   # short smoke of every benchmark, then the tests
#   bash benchmarks/run_device.sh full       # every benchmark at full length, then the tests
#   bash benchmarks/run_device.sh moe        # the MoE GPU tests, the block kernel's configs
#                                            # (the warp-specialized one too), the MoE layer
#   bash benchmarks/run_device.sh moe-model  # the whole HF MoE model steps, compiled
#   bash benchmarks/run_device.sh conformance  # the whole CUDA conformance matrix
#   bash benchmarks/run_device.sh compile  # "1b"'s first three steps, compile included, a
#                                          # fresh process a peer (PEERS: which, in order)
#   bash benchmarks/run_device.sh model    # "1b" and "8b-wide" compiled: torchao tensorwise,
#                                          # lowprec delayed and current, one process a model
# TEST_TIMEOUT (seconds, default 150) caps the test run. torchao (optional) is installed
# from .whl/ when present (carry it: run(carry=['.whl'])).
set -u
MODE=${1:-validate}
OUT=${OUT:-/tmp/lowprec_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LOWPREC_RESULTS="$OUT/results.csv"
if ls .whl/torchao-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/torchao-*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
T0=$(date +%s)
t() { echo "== $* (t=$(( $(date +%s) - T0 ))s)"; }
if [ "$MODE" = moe ]; then
  t moe_tests; timeout 300 python3 -m pytest -q -p no:cacheprovider -k gpu \
    tests/linear/test_grouped_block_fp8.py tests/linear/test_grouped_block_experts.py \
    tests/linear/test_grouped_nvfp4_experts.py > "$OUT/moe_tests.log" 2>&1
  t probe; PYTHONPATH=. python3 tools/probe_block_grouped.py --gluon --configs 128,2,0,8,4 128,4,1,8,8 \
    128,2,2,8,4 128,3,2,8,4 128,4,2,8,4 > "$OUT/probe.log" 2>&1
  t layer; python3 benchmarks/bench_moe.py --recipes current-e4m3,block --no-loop \
    > "$OUT/moe.log" 2>&1
  t done
  grep -E "passed|failed|error" "$OUT/moe_tests.log" | tail -3
  grep -E "gluon|triton" "$OUT/probe.log" | cut -c1-200
  grep -E "^(mixtral|qwen3|bf16|lowprec|torchao)" "$OUT/moe.log" | cut -c1-120
  exit 0
elif [ "$MODE" = conformance ]; then
  # the whole CUDA conformance matrix (seed 0 and the named recipes), a case a process
  # task in 8 workers: about 3 s a case in one cold process, 171 cases
  t conformance; timeout "${TEST_TIMEOUT:-500}" python3 -m tests.conformance.run_matrix \
    --device cuda --seeds 0 --workers 8 --out "$OUT/conformance.csv" > "$OUT/conformance.log" 2>&1
  t done
  grep -vE "^ok " "$OUT/conformance.log" | tail -20
  exit 0
elif [ "$MODE" = compile ]; then
  # torchao both first and last: a loan's first process also pays for cold disks and
  # libraries, so the peers compare in the places after it
  t compile; timeout "${TEST_TIMEOUT:-560}" python3 tools/compile_costs.py --model 1b \
    --peers "${PEERS:-torchao-tensorwise,lowprec-current,lowprec-delayed,torchao-tensorwise}" \
    > "$OUT/compile.log" 2>&1
  t done
  grep -E "^(torchao|lowprec|bf16)" "$OUT/compile.log"
  exit 0
elif [ "$MODE" = model ]; then
  # the per-tensor recipes against torchao at both widths (issue 98's speed targets)
  for m in 1b 8b-wide; do
    t "$m"; timeout "${TEST_TIMEOUT:-280}" python3 benchmarks/bench_model.py --model "$m" \
      --modes compiled --recipes "${RECIPES:-delayed,current}" --torchao tensorwise \
      --bf16 none > "$OUT/model_$m.log" 2>&1
  done
  t done
  grep -hE "^(torchao|lowprec)" "$OUT"/model_*.log | cut -c1-120
  exit 0
elif [ "$MODE" = moe-model ]; then
  for spec in mixtral:2 qwen3:4; do  # model:layers, as the README's rows
    m=${spec%:*}
    t "$m"; python3 benchmarks/bench_moe.py --model "$m" --layers "${spec#*:}" \
      --modes compiled --recipes current-e4m3,block --top-kernels 12 > "$OUT/model_$m.log" 2>&1
  done
  t done
  grep -hE "^(mixtral|qwen3|bf16|lowprec)" "$OUT"/model_*.log | cut -c1-120
  exit 0
elif [ "$MODE" = validate ]; then
  t gemm;     python3 benchmarks/bench_gemm.py --shapes 16384x4096x4096 --iters 10 > "$OUT/gemm.log" 2>&1
  t quantize; python3 benchmarks/bench_quantize.py --iters 10 --reference > "$OUT/quantize.log" 2>&1
  t linear;   python3 benchmarks/bench_linear.py --shapes 16384x4096x4096 --rounds 1 --warmup 2 --iters 5 > "$OUT/linear.log" 2>&1
  t memory;   python3 benchmarks/bench_memory.py --shapes 16384x4096x4096 --torchao tensorwise > "$OUT/memory.log" 2>&1
else
  t gemm;     python3 benchmarks/bench_gemm.py > "$OUT/gemm.log" 2>&1
  t quantize; python3 benchmarks/bench_quantize.py > "$OUT/quantize.log" 2>&1
  t linear;   python3 benchmarks/bench_linear.py --mlp > "$OUT/linear.log" 2>&1
  # the same Linear steps at the clock the GPU settles at under each step's own load
  t linear_steady; python3 benchmarks/bench_linear.py --rounds 2 --warmup-seconds 1 \
                     > "$OUT/linear_steady.log" 2>&1
  t memory;   python3 benchmarks/bench_memory.py --mlp > "$OUT/memory.log" 2>&1
fi
t tests
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -s -p no:cacheprovider tests/gemm/test_backends_gpu.py \
  > "$OUT/tests.log" 2>&1; echo "tests rc=$?"
t done
# compact summary last (the reply shows the tail)
grep -E "^(shape|16384)" "$OUT/gemm.log" | cut -c1-90
grep -E "^(recipe|d2d|fp8|block|mxfp8|nvfp4)" "$OUT/quantize.log" | cut -c1-80
grep -E "^  (linear|mlp) " "$OUT/linear.log"
grep -A30 "^targets" "$OUT/linear.log"
[ -f "$OUT/linear_steady.log" ] && grep -A20 "^targets" "$OUT/linear_steady.log"
grep -E "^  (linear|mlp) |^peak memory" "$OUT/memory.log"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
grep -B2 -A44 "^worst" "$OUT/tests.log" | grep -E "emulated|cublas|Linear" | awk '{print $1, $2, $3, $4}' | sort -k4 -g | tail -6
