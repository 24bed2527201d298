#!/usr/bin/env bash
# The no-cliffs checks in ONE device call: GPU tests of every weight format at real dims, graph buckets up to
# max_num_seqs (plain and speculative), the spec.* cells, then the serving sweeps into one Pareto file.
#   bash bench/gpu_no_cliffs.sh [tests|serve|all] [RUN ...]     (RUN as bench/serve_pareto.py --runs)
# Logs and results go to $OUT (default /tmp/out).
set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODE=${1:-all}; shift || true
RUNS=("$@"); [ ${#RUNS[@]} -eq 0 ] && RUNS=(embedded:plain embedded:spec)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "$MODE" != serve ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 280 -rfE \
    tests/runtime/test_no_cliffs_gpu.py "tests/kernels/test_gpu.py::test_cell" -k "not test_cell or spec." \
    2>&1 | tee "$OUT/pytest-no-cliffs-h200.log" | tail -40
fi
if [ "$MODE" != tests ]; then
  timeout ${SERVE_TIMEOUT:-280} python3 bench/serve_pareto.py --runs "${RUNS[@]}" \
    --out "$OUT/serve-pareto-h200.json" 2>&1 | tee "$OUT/serve-pareto-h200.log" | tail -30
fi
