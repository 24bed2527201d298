#!/usr/bin/env bash
# One call on 2 x H200: drafter training (GPU 0) in parallel with spec/routing GPU tests + host overhead (GPU 1);
# then the TP2-vs-TP1 benchmark and TP GPU tests on both GPUs; then end-to-end speculation throughput.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; L=$OUT/logs; mkdir -p "$L"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$L/gpu.txt"
( CUDA_VISIBLE_DEVICES=0 timeout 230 python3 -m m3serve.train.eagle3 --target m3serve/assets/m3-tiny-verse \
    --data .traindata --out "$L/eagle3" --device cuda --max-seconds 110 > "$L/train-eagle3.log" 2>&1 ) &
TRAIN=$!
( export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 -m pytest -q -m gpu tests/spec tests/targets -p no:cacheprovider -s > "$L/pytest-spec-routing.log" 2>&1
  timeout 60 python3 bench/host_overhead.py --device cuda --out-dir "$L" > "$L/host-overhead.log" 2>&1 ) &
OTHER=$!
wait $TRAIN $OTHER
tail -3 "$L/train-eagle3.log"; tail -2 "$L/pytest-spec-routing.log"; tail -3 "$L/host-overhead.log"
timeout 210 python3 bench/tp.py --preset minimax-m3:12 --out "$L/tp-h200x2-m3_12.json" > "$L/tp.log" 2>&1; echo "tp rc=$?"
tail -12 "$L/tp.log"
timeout 80 python3 -m pytest -q -m gpu tests/distributed -p no:cacheprovider > "$L/pytest-tp.log" 2>&1; tail -2 "$L/pytest-tp.log"
if [ -f "$L/eagle3/config.json" ]; then
  timeout 90 python3 bench/spec_decode.py --device cuda --drafter "$L/eagle3" --out "$L/spec-decode-h200.json" \
      > "$L/spec-decode.log" 2>&1; tail -5 "$L/spec-decode.log"
fi
tar czf "$OUT/logs.tgz" -C "$OUT" logs
