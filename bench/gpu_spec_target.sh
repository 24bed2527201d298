#!/usr/bin/env bash
# Eagle3 speculation on the decode target, on the GPU (outputs to $OUT, default /tmp/out):
#   bash bench/gpu_spec_target.sh certify   # GPU tests: the draft layer's and the step's entries (attn.rope,
#                                           # mlp.silu_mul, spec.*), the routed drafter layer, graphs vs eager vs plain
#   bash bench/gpu_spec_target.sh tiny      # bench/spec_target.py on the embedded model (b1, b4; K 3-5) + profile
#   bash bench/gpu_spec_target.sh m3        # bench/spec_target.py on minimax-m3:5 (forced AL 2.78, K 3) + profile
#   bash bench/gpu_spec_target.sh sampled   # the sampled graphs: GPU tests, bench at temperature 1 / top-p 0.95
# Run from a committed tree with M3SERVE_COMMIT=$(git rev-parse --short HEAD) exported on the device (the device
# copy carries no usable git history). Every phase has its own timeout so partial results always come back.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; L=$OUT/logs; mkdir -p "$L"
pyt() { timeout "$1" python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" --timeout 200 -rf "${@:2}"; }
for phase in "$@"; do
  case "$phase" in
    certify)
      pyt 150 tests/kernels/test_gpu.py -k "rope or silu or spec or rms" \
          > "$L/pytest-spec-entries-h200.log" 2>&1; tail -3 "$L/pytest-spec-entries-h200.log"
      pyt 200 tests/spec/test_gpu_spec.py > "$L/pytest-spec-gpu-h200.log" 2>&1; tail -3 "$L/pytest-spec-gpu-h200.log"
      ;;
    tiny)
      timeout 240 python3 bench/spec_target.py --models m3-tiny-verse --batch 1,4 --k 3,4,5 --groups 4 \
          --out "$OUT/spec-target-h200.json" > "$L/bench-spec-target-tiny-h200.txt" 2>&1
      grep -E "x, AL" "$L/bench-spec-target-tiny-h200.txt"
      timeout 90 python3 bench/profile_step.py --model m3-tiny-verse --spec 3 --steps 10 \
          --out "$L/profile-tiny-spec3-b1-h200.txt" > /dev/null 2>&1; sed -n 4p "$L/profile-tiny-spec3-b1-h200.txt"
      ;;
    m3)
      timeout 300 python3 bench/spec_target.py --models minimax-m3:5 --batch 1,4 --k 3 \
          --out "$OUT/spec-target-m3_5-h200.json" > "$L/bench-spec-target-m3_5-h200.txt" 2>&1
      grep -E "x, AL" "$L/bench-spec-target-m3_5-h200.txt"
      timeout 150 python3 bench/profile_step.py --model minimax-m3:5 --context 512 --spec 3 --steps 10 \
          --out "$L/profile-m3_5-spec3-b1-h200.txt" > /dev/null 2>&1; sed -n 4p "$L/profile-m3_5-spec3-b1-h200.txt"
      ;;
    sampled)
      pyt 300 tests/spec/test_gpu_spec.py tests/kernels/test_gpu.py -k "sampled or spec or rope or silu" \
          > "$L/pytest-spec-sampled-h200.log" 2>&1; tail -3 "$L/pytest-spec-sampled-h200.log"
      timeout 240 python3 bench/spec_target.py --models m3-tiny-verse --batch 1,4 --k 3 --groups 4 \
          --temperature 1.0 --top-p 0.95 --out "$OUT/spec-target-sampled-h200.json" \
          > "$L/bench-spec-target-sampled-h200.txt" 2>&1
      grep -E "x, AL" "$L/bench-spec-target-sampled-h200.txt"
      ;;
    *) echo "usage: $0 certify|tiny|m3|sampled ..."; exit 2 ;;
  esac
done
