#!/usr/bin/env bash
# Issue 29 on the GPU in ONE device call: moe.grouped's decode-once band certified (its own tests, then the
# entry's M3 TP1 prefill cells through tests/kernels/test_gpu.py), then timed against the in-register path.
# Logs and the benchmark JSON go to $OUT (default /tmp/out).
#   bash bench/gpu_moe_decode_once.sh          # band tests + prefill cells + benchmark (each phase has a timeout)
#   bash bench/gpu_moe_decode_once.sh tests    # the tests only
#   bash bench/gpu_moe_decode_once.sh bench    # the benchmark only (~1 min; python3 bench/moe_grouped.py --decode-once)
# Every moe.grouped cell (all shapes and row bands): pytest -m gpu tests/kernels/test_gpu.py -k "moe.grouped".
set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODE=${1:-full}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
T_BAND=0; T_CELLS=0; T_BENCH=0
case "$MODE" in
  full) T_BAND=150; T_CELLS=240; T_BENCH=150 ;;
  tests) T_BAND=240; T_CELLS=330 ;;
  bench) T_BENCH=300 ;;
  *) echo "usage: $0 [full|tests|bench]"; exit 2 ;;
esac
rc_band=skipped; rc_cells=skipped; rc_bench=skipped
if [ "$T_BAND" != 0 ]; then
  start=$(date +%s)
  timeout $T_BAND python3 -m pytest -m gpu tests/kernels/moe/test_moe_grouped_gpu.py -q -o addopts="" \
      -p no:cacheprovider -k "decode_once or (4096 and not cell_matches)" 2>&1 | tee "$OUT/pytest-moe-decode-once.log" | tail -30
  rc_band=${PIPESTATUS[0]}
  echo "band tests: rc=$rc_band in $(( $(date +%s) - start )) s"
fi
if [ "$T_CELLS" != 0 ]; then
  start=$(date +%s)
  timeout $T_CELLS python3 -m pytest -m gpu tests/kernels/test_gpu.py -q -o addopts="" -p no:cacheprovider \
      -k "moe.grouped and 3072 and (r4096 or r2049 or r513)" 2>&1 | tee "$OUT/pytest-moe-grouped-cells.log" | tail -30
  rc_cells=${PIPESTATUS[0]}
  echo "prefill cells: rc=$rc_cells in $(( $(date +%s) - start )) s"
fi
if [ "$T_BENCH" != 0 ]; then
  start=$(date +%s)
  timeout $T_BENCH python3 bench/moe_grouped.py --decode-once --out-dir "$OUT" 2>&1 \
      | tee "$OUT/bench-moe-decode-once.log" | tail -20
  rc_bench=${PIPESTATUS[0]}
  echo "bench: rc=$rc_bench in $(( $(date +%s) - start )) s"
fi
echo "band rc=$rc_band cells rc=$rc_cells bench rc=$rc_bench" | tee "$OUT/rc.txt"
for rc in "$rc_band" "$rc_cells" "$rc_bench"; do
  [ "$rc" != 0 ] && [ "$rc" != skipped ] && exit 1
done
exit 0
