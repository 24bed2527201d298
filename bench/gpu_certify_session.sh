#!/usr/bin/env bash
# One device call that certifies this round's kernels and paths on the H200 and measures them, phase by phase,
# each under its own time limit so that partial logs always come back:
#   bash bench/gpu_certify_session.sh tests     GPU tests of the new / changed cells and paths
#   bash bench/gpu_certify_session.sh measure   decode target (BF16 / NVFP4, KV rotation on/off), bucket check
#   bash bench/gpu_certify_session.sh serve     serving sweeps (Pareto), prefill TTFT vs transformers, KV rotation
#   bash bench/gpu_certify_session.sh suite     the whole `pytest -m gpu`, sharded over parallel processes
#   ... spec-round | final-round | serve-round | prefill-round2 | prefill-round | backlog | verify | followup | closing | kv | kv-cost | closing2 | final: the later rounds' calls (each mode's comment)
# Wheels the image lacks (xgrammar and its needs) are installed from .whl/ when present. Output: $OUT.
set -u
export PYTHONUNBUFFERED=1
# the device copy's .git may be stale: results record the commit the caller passes (M3SERVE_COMMIT=$(git rev-parse HEAD))
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# at most 8 files come back from a device call: the logs travel as one archive
pack_logs() { (cd "$OUT" && tar czf logs.tgz --remove-files $(ls *.log *.txt 2>/dev/null)); }
trap pack_logs EXIT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site || exit 1
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
phase() {  # name, seconds, command...
  local name=$1 t=$2; shift 2
  local s=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "[$name: rc $? in $(( $(date +%s) - s )) s]" | tee -a "$OUT/phases.txt"
  tail -5 "$OUT/$name.log"
}
case "${1:-tests}" in
suite)   # the whole `pytest -m gpu`, in parallel: the 700 kernel cells of tests/kernels/test_gpu.py in $SHARDS shards,
         # the other kernel / cache files in one process, the model-building paths (runtime, spec, model, train, TP)
         # in one process (they hold real-dims weights), each process under the same time limit
  k="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --timeout ${T_TEST:-300}"
  python3 -m pytest -m gpu --collect-only -q -p no:cacheprovider tests/kernels/test_gpu.py 2>/dev/null | grep '::' \
    | grep -E -- "${CELLS:-.}" > "$OUT/cells.txt"
  # the M3-size MoE cells hold up to ~60 GB of experts each: they run in one process of their own, the rest in shards
  grep -F "moe.grouped-(" "$OUT/cells.txt" | grep -F ", 128, 6144," > "$OUT/cells-moe-m3" || true
  grep -v -F -f "$OUT/cells-moe-m3" "$OUT/cells.txt" > "$OUT/cells-rest" || true
  [ -s "$OUT/cells-rest" ] && split -n r/${SHARDS:-6} -d "$OUT/cells-rest" "$OUT/cells-shard-"
  [ -s "$OUT/cells-moe-m3" ] && mv "$OUT/cells-moe-m3" "$OUT/cells-shard-moe-m3"
  rm -f "$OUT/cells-rest" "$OUT/cells-moe-m3"
  s=$(date +%s)
  for f in $(ls "$OUT"/cells-shard-* 2>/dev/null); do
    # node ids hold spaces ("(9856, 6144)"): pytest reads them from the shard file, one per line
    timeout ${T_SUITE:-540} python3 -c 'import sys, pytest; sys.exit(pytest.main(sys.argv[2:] + open(sys.argv[1]).read().splitlines()))' \
      "$f" -m gpu -q -p no:cacheprovider -rfE --timeout ${T_TEST:-300} > "$OUT/pytest-$(basename "$f").log" 2>&1 &
  done
  [ -n "${SKIP_KERNEL_FILES:-}" ] || timeout ${T_SUITE:-540} $k tests/kernels --ignore=tests/kernels/test_gpu.py tests/kv \
    tests/quant tests/targets > "$OUT/pytest-kernel-files.log" 2>&1 &
  timeout ${T_SUITE:-540} $k ${GPU_PATHS:-tests/runtime tests/spec tests/model tests/train tests/distributed} \
    > "$OUT/pytest-paths.log" 2>&1 &
  wait
  rm -f "$OUT"/cells-shard-*
  echo "[gpu suite: $(( $(date +%s) - s )) s]" | tee -a "$OUT/phases.txt"
  for l in "$OUT"/pytest-*.log; do echo "== $l"; grep -E "^(FAILED|ERROR)" "$l" | head -20; tail -1 "$l"; done | tee -a "$OUT/phases.txt"
  ;;
tests)   # certification + the decode-step side-by-side runs (one call)
  phase pytest-gpu-cells ${T_CELLS:-120} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 110 -rfE \
    tests/kernels/test_gpu.py -k "norm.rms or norm.add_rms or attn.qk_prep or mlp.swiglu_oai or moe.route_small or attn.rope or mlp.silu_mul or moe.grouped or tiled or spec."
  phase pytest-gpu-paths ${T_PATHS:-200} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 -rfE \
    ${GPU_TESTS:-tests/runtime/test_no_cliffs_gpu.py tests/kernels/moe/test_moe_grouped_gpu.py tests/runtime/test_structured_gpu.py tests/runtime/test_token_filters_gpu.py tests/kernels/attention/test_kv_write.py tests/kernels/attention/test_paged_attention_gpu.py}
  phase graph-buckets 60 python3 bench/debug/graph_buckets.py
  phase decode-m3_5-bf16 ${T_DECODE:-90} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 \
    --steps 20 --routes target --quantization none --out "$OUT/decode-target-h200-bf16.json"
  ;;
serve)   # serving sweeps, prefill TTFT beside transformers, KV rotation at real dims, rotation cost on the step
  phase serve-pareto ${T_SERVE:-110} python3 bench/serve_pareto.py --runs embedded:plain embedded:spec \
    --out "$OUT/serve-pareto-h200.json"
  phase prefill ${T_PREFILL:-100} python3 bench/prefill.py --model minimax-m3:5 --tokens 8192 --quant nvfp4,none \
    --chunk 8192 --repeat 2 --out "$OUT/prefill-h200.json"
  phase decode-m3_5-nvfp4-rotated ${T_DECODE:-80} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 \
    --context 512 --steps 20 --routes target --quantization nvfp4 --kv-rotation auto --out "$OUT/decode-target-h200.json"
  ;;
verify)  # GPU path tests, one pytest process per file in parallel (Triton compiles on all cores), then measurements
  s=$(date +%s)
  for f in ${GPU_TESTS:-tests/runtime/test_no_cliffs_gpu.py tests/kernels/moe/test_moe_grouped_gpu.py tests/runtime/test_structured_gpu.py tests/runtime/test_token_filters_gpu.py tests/kernels/attention/test_kv_write.py tests/kernels/attention/test_paged_attention_gpu.py}; do
    n=$(basename "$f" .py)
    timeout ${T_PATHS:-200} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 190 -rfE "$f" > "$OUT/pytest-$n.log" 2>&1 &
  done
  wait
  echo "[parallel gpu tests: $(( $(date +%s) - s )) s]" | tee -a "$OUT/phases.txt"
  for l in "$OUT"/pytest-*.log; do echo "== $l"; tail -3 "$l"; done | tee -a "$OUT/phases.txt"
  phase decode-m3_5-bf16 ${T_DECODE:-100} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 \
    --steps 20 --routes target --quantization none --out "$OUT/decode-target-h200-bf16.json"
  phase generate-cold 60 bash -c 'time python3 -c "from m3serve.cli import main; main()" generate'
  phase generate-warm 60 bash -c 'time python3 -c "from m3serve.cli import main; main()" generate'
  phase prefill ${T_PREFILL:-120} python3 bench/prefill.py --model minimax-m3:5 --tokens 8192 --quant nvfp4,mxfp8,none \
    --chunk 8192 --repeat 2 --out "$OUT/prefill-h200.json"
  phase serve-spec ${T_SERVE:-120} python3 bench/serve_pareto.py --runs embedded:spec --out "$OUT/serve-pareto-spec-h200.json"
  ;;
followup)  # failed GPU tests rerun with full logs (heavy one alone, light ones beside it), prefill profile, Eagle3 sweep
  timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 160 -rfE tests/kernels/moe/test_moe_grouped_gpu.py \
    > "$OUT/pytest-moe-grouped.log" 2>&1 &
  timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 160 -rfE tests/runtime/test_token_filters_gpu.py \
    tests/kernels/test_fused_elementwise_gpu.py > "$OUT/pytest-light.log" 2>&1 &
  wait
  for l in "$OUT"/pytest-*.log; do echo "== $l"; tail -4 "$l"; done | tee -a "$OUT/phases.txt"
  phase prefill-profile ${T_PREFILL:-110} python3 bench/prefill.py --model minimax-m3:5 --tokens 8192 --quant nvfp4,none \
    --chunk 8192 --repeat 1 --no-transformers --profile-dir "$OUT" --out "$OUT/prefill-profile-h200.json"
  phase serve-spec ${T_SERVE:-130} python3 bench/serve_pareto.py --runs embedded:spec --out "$OUT/serve-pareto-spec-h200.json"
  ;;
closing)  # the round's new cells and fixed paths (kernel tests beside the model-building tests), then prefill,
          # serving (plain + Eagle3) and the decode step for the no-regression check
  k="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
  timeout ${T_TESTS:-170} $k --timeout 160 tests/kernels/test_gpu.py -k "msa.select or (tiled and r512)" > "$OUT/pytest-cells-gemm.log" 2>&1 &
  timeout ${T_TESTS:-170} $k --timeout 160 tests/kernels/test_gpu.py -k "norm.rms or norm.add_rms or attn.qk_prep or mlp.swiglu_oai or moe.route_small or attn.rope or mlp.silu_mul" > "$OUT/pytest-cells-rows.log" 2>&1 &
  timeout ${T_TESTS:-170} $k --timeout 160 tests/kernels/moe/test_moe_grouped_gpu.py -k every_expert_format tests/runtime/test_token_filters_gpu.py > "$OUT/pytest-paths.log" 2>&1 &
  wait
  for l in "$OUT"/pytest-*.log; do echo "== $l"; tail -4 "$l"; done | tee -a "$OUT/phases.txt"
  phase prefill ${T_PREFILL:-90} python3 bench/prefill.py --model minimax-m3:5 --tokens 8192 --quant ${PREFILL_QUANT:-nvfp4,mxfp8,none} \
    --chunk 8192 --repeat ${PREFILL_REPEAT:-2} --out "$OUT/prefill-h200.json"
  phase serve ${T_SERVE:-230} python3 bench/serve_pareto.py --runs embedded:plain embedded:spec \
    --requests-per-user ${SERVE_RPU:-4} --out "$OUT/serve-pareto-h200.json"
  [ "${T_DECODE:-70}" -gt 0 ] && phase decode-m3_5-nvfp4 ${T_DECODE:-70} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 \
    --steps 20 --routes target --quantization nvfp4 --out "$OUT/decode-target-h200-nvfp4.json"
  # the same bench from an older tree in .baseline/ (git archive of $BASELINE_COMMIT: its package and bench/decode.py),
  # right after, on the same GPU: the side-by-side no-regression check
  if [ -d .baseline ] && [ "${T_DECODE:-70}" -gt 0 ]; then
    (cd .baseline && M3SERVE_COMMIT=${BASELINE_COMMIT:-unknown} PYTHONPATH=$PWD:${PYTHONPATH#$OLDPWD} phase decode-m3_5-nvfp4-baseline \
      ${T_DECODE:-70} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 --steps 20 --routes target \
      --quantization nvfp4 --out "$OUT/decode-target-h200-nvfp4-baseline.json")
  fi
  ;;
kv)      # the main job cold / warm, and the hybrid KV cache on the H200 target: real-dims rotation error, held-out
         # accuracy (BF16 KV vs the default hybrid and vs every sparse layer NVFP4), the rotation's cost on the step
  phase generate ${T_GENERATE:-100} python3 bench/generate_main_job.py --runs 2 --out "$OUT/generate-h200.json"
  phase kv-rotation ${T_KVROT:-90} python3 bench/kv_rotation.py --preset minimax-m3:5 --device cuda --tokens 4096 \
    --json "$OUT/kv-rotation-h200.json"
  phase eval-kv-hybrid ${T_EVAL:-110} python3 -m m3serve.eval --config-a engine:kv=bf16,route=auto \
    --config-b engine:kv=nvfp4,route=auto --device cuda --json "$OUT/eval-kv-bf16-vs-hybrid-target-h200.json"
  phase eval-kv-all-nvfp4 ${T_EVAL:-110} python3 -m m3serve.eval \
    --config-a "recorded:$OUT/eval-kv-bf16-vs-hybrid-target-h200.json#engine:kv=bf16,route=auto" \
    --config-b engine:kv=nvfp4,fp8=none,route=auto --device cuda --json "$OUT/eval-kv-bf16-vs-nvfp4-target-h200.json"
  for rot in off auto; do
    phase decode-m3_5-nvfp4-rot-$rot ${T_DECODE:-50} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 \
      --context 512 --steps 20 --routes target --quantization nvfp4 --kv-rotation $rot \
      --out "$OUT/decode-target-h200-kv-rotation-$rot.json"
  done
  ;;
kv-cost)  # the H200 KV eval (every sparse layer NVFP4 vs BF16 KV) beside the GPU tests of the warm-up and of every
          # expert format, then the rotation's cost on the minimax-m3:5 NVFP4 decode step, side by side
  k="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
  timeout ${T_EVAL:-200} python3 -m m3serve.eval --config-a engine:kv=bf16,route=auto \
    --config-b engine:kv=nvfp4,fp8=none,route=auto --device cuda --json "$OUT/eval-kv-bf16-vs-nvfp4-target-h200.json" \
    > "$OUT/eval-kv.log" 2>&1 &
  timeout ${T_TESTS:-200} $k --timeout 190 tests/runtime/test_no_cliffs_gpu.py -k no_kernel_variant > "$OUT/pytest-warmup.log" 2>&1 &
  timeout ${T_TESTS:-200} $k --timeout 190 tests/kernels/moe/test_moe_grouped_gpu.py -k every_expert_format \
    tests/runtime/test_token_filters_gpu.py > "$OUT/pytest-formats.log" 2>&1 &
  wait
  for l in "$OUT"/pytest-*.log "$OUT"/eval-kv.log; do echo "== $l"; tail -4 "$l"; done | tee -a "$OUT/phases.txt"
  for rot in off auto; do
    phase decode-m3_5-nvfp4-rot-$rot ${T_DECODE:-100} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 \
      --context 512 --steps 20 --routes target --quantization nvfp4 --kv-rotation $rot \
      --out "$OUT/decode-target-h200-kv-rotation-$rot.json"
  done
  ;;
closing2)  # the round's GPU tests in parallel (the MoE decode-once band, no compile after the warm-up, the
           # speculation batch-size policy), then: the decode-once band timed, prefill at 8k beside transformers,
           # serving plain vs Eagle3 (policy on), the minimax-m3:5 NVFP4 decode step (no-regression)
  k="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
  timeout ${T_TESTS:-120} $k --timeout 110 tests/kernels/moe/test_moe_grouped_gpu.py \
    -k "decode_once or (4096 and not cell_matches)" > "$OUT/pytest-moe-band.log" 2>&1 &
  timeout ${T_TESTS:-120} $k --timeout 110 tests/kernels/test_gpu.py -k "moe.grouped and 3072 and (r4096 or r2049)" \
    > "$OUT/pytest-moe-cells.log" 2>&1 &
  timeout ${T_TESTS:-120} $k --timeout 110 tests/runtime/test_no_cliffs_gpu.py -k no_kernel_variant \
    > "$OUT/pytest-warmup.log" 2>&1 &
  timeout ${T_TESTS:-120} $k --timeout 110 tests/spec/test_gpu_spec.py -k batch_size_policy > "$OUT/pytest-policy.log" 2>&1 &
  wait
  for l in "$OUT"/pytest-*.log; do echo "== $l"; tail -4 "$l"; done | tee -a "$OUT/phases.txt"
  phase moe-decode-once ${T_MOE:-60} python3 bench/moe_grouped.py --decode-once --fmts nvfp4,mxfp8,bf16 \
    --rows 2048,4096,8192 --iters 5 --out-dir "$OUT"
  phase prefill ${T_PREFILL:-90} python3 bench/prefill.py --model minimax-m3:5 --tokens 8192 --quant nvfp4,mxfp8 \
    --chunk 8192 --repeat 2 --out "$OUT/prefill-h200.json"
  phase serve ${T_SERVE:-170} python3 bench/serve_pareto.py --runs embedded:plain embedded:spec \
    --requests-per-user ${SERVE_RPU:-4} --out "$OUT/serve-pareto-h200.json"
  phase decode-m3_5-nvfp4 ${T_DECODE:-90} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 \
    --steps 20 --routes target --quantization nvfp4 --out "$OUT/decode-target-h200-nvfp4.json"
  ;;
spec-round)  # issue 28's Eagle3 loss under load: where the eager speculative step's time goes now that it runs the
             # paged kernels (cProfile at 1 and 16 prompts), the closed-loop breakdown, then the served sweep
  phase spec-eager-profile ${T_A:-60} python3 bench/debug/spec_eager_profile.py --n 1,16 --out-dir "$OUT"
  phase spec-serving-steps ${T_B:-90} python3 bench/spec_serving_steps.py --engines plain,spec-2 \
    --concurrency 1,4,16,64 --out "$OUT/spec-serving-steps-h200.json"
  phase serve-pareto ${T_SERVE:-300} python3 bench/serve_pareto.py --runs embedded:plain embedded:spec \
    minimax-m3:5:plain:nvfp4 minimax-m3:5:spec:nvfp4 --requests-per-user 4 --timeout 120 \
    --out "$OUT/serve-pareto-h200.json"
  ;;
final-round)  # no regression from the model runner, side by side: baseline/ holds the tree before it (m3serve/ and
              # bench/ of BASE_COMMIT, from `git archive`), each side runs its own benches; then issue 28's sweeps
  base="env -C baseline PYTHONPATH=$PWD/baseline:/tmp/site M3SERVE_COMMIT=${BASE_COMMIT:?}"   # timeout runs it
  phase regress-decode-base ${T_A:-70} $base python3 bench/decode.py --models m3-tiny-verse --batch 1,8 --context 512 \
    --steps 20 --routes target --out "$OUT/decode-regress-base.json"
  phase regress-decode-new ${T_A:-70} python3 bench/decode.py --models m3-tiny-verse --batch 1,8 --context 512 \
    --steps 20 --routes target --out "$OUT/decode-regress-new.json"
  phase regress-spec-base ${T_B:-60} $base python3 bench/spec_target.py --models m3-tiny-verse --batch 1,4 --k 3 \
    --out "$OUT/spec-regress-base.json"
  phase regress-spec-new ${T_B:-60} python3 bench/spec_target.py --models m3-tiny-verse --batch 1,4 --k 3 \
    --out "$OUT/spec-regress-new.json"
  phase serve-pareto ${T_SERVE:-270} python3 bench/serve_pareto.py --runs embedded:plain embedded:spec \
    minimax-m3:5:plain:nvfp4 minimax-m3:5:spec:nvfp4 --requests-per-user 4 --timeout 170 \
    --out "$OUT/serve-pareto-h200.json"
  grep -n "variant was built\|ERROR\|off (" "$OUT/serve-pareto.log" | cut -c1-300 | head -20
  phase spec-plain-step-cost ${T_C:-60} python3 bench/spec_plain_step_cost.py --batch 128 \
    --out "$OUT/spec-plain-step-cost-h200.json"
  ;;
serve-round)  # issue 28's sweeps on one machine: the embedded model plain / Eagle3 and minimax-m3:5 NVFP4 plain /
              # Eagle3 (forced acceptance), 128/128 tokens at C = 1 .. 128; the server logs stay in the phase log
  phase serve-pareto ${T_SERVE:-560} python3 bench/serve_pareto.py --runs embedded:plain embedded:spec \
    minimax-m3:5:plain:nvfp4 minimax-m3:5:spec:nvfp4 --requests-per-user 4 --timeout 170 \
    --out "$OUT/serve-pareto-h200.json"
  grep -n "WARNING\|ERROR\|left out\|off (" "$OUT/serve-pareto.log" | head -40
  ;;
prefill-round2)  # the fixes' GPU checks (no serving compile, token filters), the chunk size vs running streams
                 # at 2k / 4k / 8k, the 131k prompt at 16k chunks with its kernel profile
  phase pytest-no-compile ${T_A:-150} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 140 -rfE \
    tests/runtime/test_no_cliffs_gpu.py tests/runtime/test_token_filters_gpu.py -k "no_kernel_variant and False or token_filters"
  phase prefill-interference ${T_C:-120} python3 bench/prefill_interference.py --model minimax-m3:5 --quant nvfp4 \
    --prompt 32768 --chunks 2048,4096,8192 --streams 4 --out "$OUT/prefill-interference-h200.json"
  phase prefill-131k-c16k ${T_B:-270} python3 bench/prefill.py --model minimax-m3:5 --tokens 131072 --quant nvfp4 \
    --chunk 16384 --repeat 1 --no-transformers --profile-dir "$OUT" --out "$OUT/prefill-nvfp4-128k-c16k-h200.json"
  ;;
prefill-round)  # issue 29's open goals: the 131k prompt at 16k chunks (profiled), minimax-m3:24 at 8k, the chunk
                # size against running streams, attn.prefill's tiles after a 120k context
  phase prefill-131k-c16k ${T_A:-170} python3 bench/prefill.py --model minimax-m3:5 --tokens 131072 --quant nvfp4 \
    --chunk 16384 --repeat 1 --no-transformers --profile-dir "$OUT" --out "$OUT/prefill-nvfp4-128k-c16k-h200.json"
  phase prefill-m3_24-8k ${T_B:-150} python3 bench/prefill.py --model minimax-m3:24 --tokens 8192 --quant nvfp4 \
    --chunk 8192 --repeat 2 --no-transformers --out "$OUT/prefill-m3_24-8k-h200.json"
  phase prefill-interference ${T_C:-200} python3 bench/prefill_interference.py --model minimax-m3:5 --quant nvfp4 \
    --prompt 32768 --chunks 2048,8192 --streams 4 --out "$OUT/prefill-interference-h200.json"
  phase attn-prefill-ctx120k ${T_D:-70} python3 bench/prefill_attention_variants.py --n 8192 --ctx 122880 --iters 5 \
    --out-dir "$OUT"
  ;;
backlog)  # last round's unrun GPU checks, each test file alone (parallel runs shared the memory), then the
          # deep-decode baseline with its per-class breakdown and the 24-layer 8k prefill
  phase pytest-no-compile ${T_A:-150} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 140 -rfE \
    tests/runtime/test_no_cliffs_gpu.py -k no_kernel_variant
  phase pytest-moe-m3 ${T_B:-110} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 100 -rfE \
    tests/kernels/test_gpu.py -k "moe.grouped and 3072 and (r4096 or r2049)"
  phase pytest-formats ${T_C:-170} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 160 -rfE \
    tests/runtime/test_no_cliffs_gpu.py tests/runtime/test_token_filters_gpu.py -k "every_format or token_filters"
  phase decode-m3_24 ${T_DECODE:-150} python3 bench/decode.py --models minimax-m3:24 --batch 1,8 --context 512 \
    --steps 20 --routes target --quantization nvfp4 --out "$OUT/decode-target-h200-m3_24.json"
  ;;
final)   # the one-call version when device time is short: certification first, then the headline measurements
  phase pytest-gpu-cells ${T_CELLS:-100} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 90 -rfE \
    tests/kernels/test_gpu.py -k "norm.rms or norm.add_rms or attn.qk_prep or mlp.swiglu_oai or moe.route_small or attn.rope or mlp.silu_mul or moe.grouped or tiled or spec."
  phase pytest-gpu-paths ${T_PATHS:-170} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 -rfE \
    tests/runtime/test_no_cliffs_gpu.py tests/kernels/moe/test_moe_grouped_gpu.py tests/runtime/test_structured_gpu.py \
    tests/kernels/attention/test_kv_write.py
  phase graph-buckets 50 python3 bench/debug/graph_buckets.py
  phase decode-m3_5-bf16 ${T_DECODE:-80} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 \
    --steps 20 --routes target --quantization none --out "$OUT/decode-target-h200-bf16.json"
  phase serve-pareto ${T_SERVE:-100} python3 bench/serve_pareto.py --runs embedded:plain embedded:spec \
    --out "$OUT/serve-pareto-h200.json"
  ;;
esac
