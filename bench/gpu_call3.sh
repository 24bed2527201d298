#!/usr/bin/env bash
# One device call: kernel certification (quick cells) + kernel benchmark, routed-vs-stock model test,
# decode benchmark (stock vs dispatch table) at real dimensions.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TEST_TIMEOUT=210 BENCH_TIMEOUT=150 bash bench/gpu_check.sh quick 2>&1 | tail -45
timeout 120 python3 -m pytest -q -m gpu tests/targets -p no:cacheprovider -s 2>&1 | tee "$OUT/pytest-routing.log" | tail -8
timeout 150 python3 bench/decode.py --preset minimax-m3:8 --quantization nvfp4 --batch 1,4,16 --context 1024 \
    --steps 6 --routes off,auto --out "$OUT/decode-m3_8-nvfp4.json" 2>&1 | tail -10
