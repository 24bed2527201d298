#!/usr/bin/env bash
# Final call: routing test (near-tie aware), speculation throughput, the kernel cells quick mode skipped,
# GEMV variants benchmark + tests.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; L=$OUT/logs; mkdir -p "$L"
timeout 60 python3 -m pytest -q -m gpu tests/targets -p no:cacheprovider -s > "$L/pytest-routing.log" 2>&1
grep -E "rows [0-9]+ seed" "$L/pytest-routing.log"; tail -1 "$L/pytest-routing.log"
timeout 100 python3 bench/spec_decode.py --device cuda --out "$L/spec-decode-h200.json" > "$L/spec-decode.log" 2>&1
tail -6 "$L/spec-decode.log"
timeout 120 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider --timeout 100 -o addopts="" -m gpu \
    -k "not (linear.nvfp4 or moe.nvfp4 or head or decoder or split_k or graph or gemv)" > "$L/pytest-kernels-rest.log" 2>&1
tail -3 "$L/pytest-kernels-rest.log"
timeout 230 python3 bench/gemv_variants.py --out-dir "$L" > "$L/gemv.log" 2>&1; tail -30 "$L/gemv.log"
timeout 50 python3 -m pytest -q -m gpu tests/kernels/test_gemv_interp.py -p no:cacheprovider -o addopts="" -m gpu \
    > "$L/pytest-gemv.log" 2>&1; tail -2 "$L/pytest-gemv.log"
tar czf "$OUT/logs.tgz" -C "$OUT" logs
