#!/usr/bin/env bash
# Certify the GEMV cells adopted for rows 1-4 (NVFP4) / 1-2 (MXFP8), re-measure those entries, rerun routing.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; L=$OUT/logs; mkdir -p "$L"
timeout 200 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider --timeout 150 -o addopts="" -m gpu \
    -k "linear.nvfp4 or linear.mxfp8 or dispatch or warmup" > "$L/pytest-linear-cells.log" 2>&1
tail -3 "$L/pytest-linear-cells.log"
timeout 60 python3 -m pytest -q -m gpu tests/targets -p no:cacheprovider -s > "$L/pytest-routing.log" 2>&1
grep -E "rows [0-9]+ seed" "$L/pytest-routing.log"; tail -1 "$L/pytest-routing.log"
timeout 120 python3 bench/kernels.py --quick --entry linear.nvfp4 --entry linear.mxfp8 --out-dir "$L" \
    > "$L/bench-linear.log" 2>&1; grep -E "rows  [14] " "$L/bench-linear.log" | head -40
tar czf "$OUT/logs.tgz" -C "$OUT" logs
