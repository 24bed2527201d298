#!/usr/bin/env bash
# Kernel catalog on the GPU in ONE device call: the GPU certification tests, then the benchmark.
# Logs, the benchmark JSON and a sm_90 resource report go to $OUT (default /tmp/out).
#   bash bench/gpu_check.sh            # full: every cell tested, every cell benchmarked
#   bash bench/gpu_check.sh quick      # smoke: tests of linear.nvfp4 / moe / heads cells only,
#                                      # benchmark TP1 rows 1 and 4 only
#   bash bench/gpu_check.sh tests      # only the tests (all cells), up to ~9 min
#   bash bench/gpu_check.sh bench      # only the benchmark (all cells), up to ~9 min
# Budget: the device allows 10 min per command; the phases have their own timeouts so that
# partial logs always come back.
set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODE=${1:-full}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

SEL=(); BENCH=(); T_TESTS=${TEST_TIMEOUT:-330}; T_BENCH=${BENCH_TIMEOUT:-230}
case "$MODE" in
  quick) SEL=(-k "linear.nvfp4 or moe.nvfp4 or head or decoder or split_k or graph"); BENCH=(--quick) ;;
  tests) T_TESTS=${TEST_TIMEOUT:-540}; T_BENCH=0 ;;
  bench) T_TESTS=0; T_BENCH=${BENCH_TIMEOUT:-540} ;;
  full) ;;
  *) echo "usage: $0 [full|quick|tests|bench]"; exit 2 ;;
esac
rc_tests=skipped; rc_bench=skipped
if [ "$T_TESTS" != 0 ]; then
start=$(date +%s)
timeout $T_TESTS python3 -m pytest -m gpu tests/kernels -q -p no:cacheprovider --timeout 300 \
    -o addopts="" -m gpu "${SEL[@]}" 2>&1 | tee "$OUT/pytest-gpu-kernels.log" | tail -40
rc_tests=${PIPESTATUS[0]}
echo "tests: rc=$rc_tests in $(( $(date +%s) - start )) s"
fi
if [ "$T_BENCH" != 0 ]; then
start=$(date +%s)
timeout $T_BENCH python3 bench/kernels.py --out-dir "$OUT" "${BENCH[@]}" 2>&1 \
    | tee "$OUT/bench-kernels.log" | tail -60
rc_bench=${PIPESTATUS[0]}
echo "bench: rc=$rc_bench in $(( $(date +%s) - start )) s"
fi
echo "tests rc=$rc_tests bench rc=$rc_bench" | tee "$OUT/rc.txt"
[ "$rc_tests" != 0 ] && [ "$rc_tests" != skipped ] && exit 1
[ "$rc_bench" != 0 ] && [ "$rc_bench" != skipped ] && exit 1
exit 0
