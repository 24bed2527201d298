#!/usr/bin/env bash
# First GPU call: GPU tests of the formats, KV cache and stock model; host overhead; stock decode at real dims.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
export PYTHONPATH=$PWD
timeout 240 python3 -m pytest -q -m gpu tests/quant tests/kv tests/model -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
timeout 90 python3 bench/host_overhead.py --device cuda --out-dir "$OUT" 2>&1 | tail -15
timeout 200 python3 bench/decode.py --preset minimax-m3:4 --quantization nvfp4 --batch 1,4 --context 1024 \
    --steps 6 --routes off --out "$OUT/decode-smoke.json" 2>&1 | tail -8
