#!/usr/bin/env bash
# The decode target on the GPU, in two device calls of <= 10 min each (outputs to $OUT, default /tmp/out):
#   bash bench/gpu_decode_target.sh certify   # GPU tests: the attention family, the fused elementwise entries,
#                                             # the NVFP4 decode cells, the runtime (graphs, capture at real dims)
#   bash bench/gpu_decode_target.sh measure   # bench/attention.py, bench/decode.py (embedded + minimax-m3:5),
#                                             # step profiles, NVFP4 kernels
#   bash bench/gpu_decode_target.sh attention # bench/attention.py with its decode-step rows (4k, 128k context)
#   bash bench/gpu_decode_target.sh sampling  # sampled / penalised graphs: test, bench, eval graphs vs eager
# Run from a committed tree with M3SERVE_COMMIT=$(git rev-parse --short HEAD) exported on the device (the device
# copy carries no usable git history). Every phase has its own timeout so partial results always come back.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; L=$OUT/logs; mkdir -p "$L"
PHASE=${1:?usage: $0 certify|measure|attention|sampling}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$L/gpu.txt" 2>&1
pyt() { timeout "$1" python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" --timeout 200 "${@:2}"; }
case "$PHASE" in
  certify)
    pyt 200 tests/kernels/attention/test_paged_attention_gpu.py tests/kernels/attention/test_kv_write.py tests/kernels/attention/test_msa_index.py \
        tests/kernels/attention/test_prefill_attention.py > "$L/pytest-attention.log" 2>&1; tail -2 "$L/pytest-attention.log"
    pyt 150 tests/kernels/test_fused_elementwise_gpu.py tests/kernels/test_gpu.py \
        -k "norm or qk_prep or swiglu or route or warmup or elementwise" > "$L/pytest-fused.log" 2>&1
    tail -2 "$L/pytest-fused.log"
    pyt 120 tests/kernels/test_gpu.py -k "linear.nvfp4 or moe.nvfp4 or decoder" > "$L/pytest-nvfp4.log" 2>&1
    tail -2 "$L/pytest-nvfp4.log"
    pyt 150 tests/runtime tests/targets -s > "$L/pytest-runtime.log" 2>&1; tail -4 "$L/pytest-runtime.log"
    ;;
  measure)
    timeout 120 python3 bench/attention.py --only decode,msa,kv_write,prefill --out "$OUT/attention-h200.json" \
        > "$L/bench-attention.log" 2>&1
    tail -3 "$L/bench-attention.log"
    timeout 300 python3 bench/decode.py --models m3-tiny-verse,minimax-m3:5 --batch 1,8,16 --context 512 \
        --routes off,auto,target --out "$OUT/decode-target-h200.json" > "$L/bench-decode.log" 2>&1
    grep -E '"route"' "$L/bench-decode.log" | cut -c1-220
    timeout 60 python3 bench/profile_step.py --model m3-tiny-verse --batch 1 --out "$L/profile-tiny-b1.txt" \
        > /dev/null 2>&1
    timeout 90 python3 bench/profile_step.py --model minimax-m3:5 --batch 1 --context 512 \
        --out "$L/profile-m3_5-b1.txt" > /dev/null 2>&1
    ;;
  attention)
    # every attention row plus the whole decode-step rows at 4k and 128k (a 131k-token prefill of minimax-m3:5)
    timeout 560 python3 bench/attention.py --out "$OUT/attention-h200.json" > "$L/bench-attention.log" 2>&1
    tail -6 "$L/bench-attention.log"
    ;;
  sampling)
    # the graphs' sampling / processed variants: equality with the eager target, cost per step, and the eval pair
    # whose recorded outputs the CPU stock run is compared with (m3serve eval ... recorded:FILE#CONFIG)
    pyt 90 tests/runtime/test_decode_target_gpu.py -k samples > "$L/pytest-sampled.log" 2>&1; tail -2 "$L/pytest-sampled.log"
    timeout 60 python3 bench/decode.py --models m3-tiny-verse --batch 1,8 --context 512 --steps 10 --routes target \
        --temperature 1.0 --top-p 0.9 --repetition-penalty 1.1 --frequency-penalty 0.2 \
        --out "$OUT/decode-target-tiny-sampled-penalised-h200.json" > "$L/bench-sampled.log" 2>&1
    timeout 90 python3 -m m3serve.eval --config-a engine:dtype=bf16,route=auto --config-b \
        engine:dtype=bf16,route=auto,eager=1 --json "$OUT/eval-target-graphs-vs-eager-h200.json" > "$L/eval.log" 2>&1
    tail -3 "$L/eval.log"
    ;;
  *) echo "usage: $0 certify|measure|attention|sampling"; exit 2 ;;
esac
tar czf "$OUT/logs.tgz" -C "$OUT" logs
