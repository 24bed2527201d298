#!/usr/bin/env bash
# One device call that certifies and measures on the H200, phase by phase, each under its own time limit so that
# partial logs always come back:
#   bash bench/gpu_certify_session.sh suite          the whole `pytest -m gpu`, sharded over parallel processes
#   bash bench/gpu_certify_session.sh spec-round     issue 28: prefill graphs' GPU tests, the eager step, closed loop
#   bash bench/gpu_certify_session.sh final-round    no regression, side by side with an older tree in baseline/
#   bash bench/gpu_certify_session.sh MODE MODE ...  several modes in turn (NO_MEM / NO_M3 / NO_EMB drop a phase)
#   ... round12 | round11 | target-tests | stream-staged | round9-bench | round9-tests | paired-tests | paired-bench | combine-fold | rings-goal | race-sampler | logits-default | head12-logits | spec-warmup | interpreter-ab | head12-last | head12-h200 | head12-mma | deep-decode-h200 | deep-decode-round4 | deep-decode-cells | deep-decode-depth | msa-variants | prefill-round7 | prefill-round6 | prefill-round3 | head12-round | policy-auto2 | memory-check | memory-round | moe-split-round | moe-split-deep | depth-round | head-layout-round | head-layout-decode | moe-round | policy-round2 | policy-round | client-round | defaults-round | serve-round | serve-m3 | prefill-f16 | prefill-round2 | prefill-round | backlog: the open issues' measurement
#   calls (each mode's comment)
# Modes of earlier rounds live in git history. Wheels the image lacks (xgrammar and its needs) are installed from
# .whl/ when present. Output: $OUT.
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
# the card in result names (the H100 also serves calls planned for the H200)
case "$(head -1 "$OUT/gpu.txt")" in *H100*) TAG=h100 ;; *) TAG=h200 ;; esac
phase() {  # name, seconds, command...
  local name=$1 t=$2; shift 2
  local s=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "[$name: rc $? in $(( $(date +%s) - s )) s]" | tee -a "$OUT/phases.txt"
  tail -5 "$OUT/$name.log"
}
for MODE in "${@:-suite}"; do  # several modes run in turn in one call
case "$MODE" in
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
spec-round)  # issue 28: the prefill graphs' GPU tests (capture == padded program == eager step); the main job
             # (`m3serve generate`, cold and warm: load and tok/s); the closed-loop breakdown side by side with
             # and without prefill graphs (-pg), admission batching (-aw) and without a policy (spec, whose arrival
             # steps were the loss; a finished prompt now drafts on the device one step later); short prompts' TTFT
             # of minimax-m3:5
             # NVFP4 with and without prefill graphs. (bench/debug/spec_eager_profile.py profiles the eager step.)
  phase pytest-prefill-graphs ${T_P:-190} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 -rfE \
    tests/runtime/test_prefill_graphs_gpu.py
  phase generate ${T_GENERATE:-120} python3 bench/generate_main_job.py --runs 2 --out "$OUT/generate-h200.json"
  phase spec-serving-steps ${T_B:-150} python3 bench/spec_serving_steps.py \
    --engines plain,plain-pg,plain-pg-aw,spec,spec-pg,spec-pg-aw,spec-2 --concurrency 1,4,16,64 \
    --out "$OUT/spec-serving-steps-h200.json"
  phase prefill-graphs-ttft ${T_C:-120} python3 bench/prefill.py --model minimax-m3:5 --tokens 128,1024 \
    --quant nvfp4 --chunk 8192 --prefill-graph-tokens 0,1024 --repeat 3 --no-transformers \
    --out "$OUT/prefill-graphs-ttft-h200.json"
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
serve-round)  # issue 28's served sweep, embedded model, 128/128 tokens at C = 1 .. 128: plain and Eagle3 (default
              # policy), then with prefill graphs (-pg) plain and Eagle3 without a policy (spec-always), the latter
              # also with admission batching (-aw); the server logs stay in the phase log
  phase serve-pareto ${T_SERVE:-560} python3 bench/serve_pareto.py --runs embedded:plain embedded:plain-pg \
    embedded:spec embedded:spec-always-pg embedded:spec-always-pg-aw --requests-per-user 4 --timeout 100 \
    --out "$OUT/serve-pareto-h200.json"
  grep -n "WARNING\|ERROR\|left out\|off (" "$OUT/serve-pareto.log" | head -40
  ;;
head-layout-round)  # issue 30 items 1 and 3, first call: GPU tests of the tile layout (every NVFP4 cell family gives
                   # the same bits on tiles as on row-major weights), of the certified NVFP4 / qkv / head cells on their
                   # cases, of the decode graphs' fused greedy head; minimax-m3:4 routed vs stock; the decode step of
                   # minimax-m3:5 side by side: tiles + fused head (target), row-major (target-rows), logits head
                   # (target-logits-head); then the MoE's MMA step per launch, tiles vs row-major
  phase pytest-tiles-head ${T_A:-200} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 -rfE \
    tests/kernels/test_tile_layout_gpu.py tests/runtime/test_greedy_head_gpu.py tests/kernels/test_gpu.py \
    -k "tiles or moe.nvfp4 or qkv or 24576 or head.bf16 or greedy_head"
  phase pytest-routed ${T_R:-100} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 95 -rfE \
    tests/targets/test_routing.py -k routed_matches_stock
  phase decode-m3_5 ${T_B:-170} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 --steps 20 \
    --routes target,target-rows,target-logits-head --quantization nvfp4 --out "$OUT/decode-target-$TAG-m3_5-tiles-head.json"
  phase moe-tiles ${T_C:-100} python3 bench/kernel_variants.py --only moe --moe-tokens ${MOE_TOKENS:-1,8} --moe-mma-only \
    --iters 20 --name kernel-variants-moe-tiles-$TAG.json --out-dir "$OUT"
  ;;
head-layout-decode)  # second call: the fused greedy head's GPU test, the moe.nvfp4 1-8 token cell (down split 8) certified;
                     # the decode step side by side (tiles + fused head, row-major, logits head) of minimax-m3:5 and
                     # the deepest model the card holds (MODELS; default minimax-m3:24 on an H200, minimax-m3:12 on an
                     # H100: its NVFP4 weights alone are ~100 GB); the 8k prefill of minimax-m3:5 in both layouts
  [ "$TAG" = h100 ] && deep=${MODELS:-minimax-m3:12} || deep=${MODELS:-minimax-m3:24}
  phase pytest-head-moe ${T_A:-150} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 140 -rfE \
    tests/runtime/test_greedy_head_gpu.py "tests/kernels/test_gpu.py::test_cell[moe.nvfp4-(128, 6144, 3072, 0)-r1-8]" \
    "tests/kernels/test_gpu.py::test_cuda_graph_replay[moe.nvfp4]"
  phase decode-m3_5 ${T_B:-120} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 --steps 20 \
    --routes target,target-rows,target-logits-head --quantization nvfp4 --out "$OUT/decode-target-$TAG-m3_5-tiles-head.json"
  phase decode-deep ${T_C:-200} python3 bench/decode.py --models $deep --batch 1,8 --context 512 --steps 20 \
    --routes target,target-rows,target-logits-head --quantization nvfp4 --out "$OUT/decode-target-$TAG-deep-tiles-head.json"
  phase prefill-tile-layout ${T_D:-100} python3 bench/prefill.py --model minimax-m3:5 --tokens 8192 --quant nvfp4 \
    --chunk 8192 --repeat 2 --no-transformers --weight-layouts default,rows --out "$OUT/prefill-tile-layout-$TAG.json"
  ;;
deep-decode-cells)  # issue 30, third round, first call: the GPU cells of the two changed decode kernels (attn.paged's rotated
              # NVFP4 cells: M read row by row in 16-byte vectors instead of gathered; moe.nvfp4's 1-8 token cells: the
              # router as one program per expert), then minimax-m3:5's decode step with the router side by side
              # (target vs target-split-router) and with the K/V rotation off, each result with its top kernels
  phase pytest-cells ${T_A:-240} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 -rfE \
    tests/kernels/test_gpu.py -k "attn.paged or moe.nvfp4"
  phase decode-m3_5 ${T_B:-150} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 --steps 20 \
    --routes target,target-split-router --quantization nvfp4 --out "$OUT/decode-target-$TAG-m3_5-router-rot.json"
  phase decode-m3_5-rot-off ${T_C:-100} python3 bench/decode.py --models minimax-m3:5 --batch 1 --context 512 --steps 20 \
    --routes target --quantization nvfp4 --kv-rotation off --out "$OUT/decode-target-$TAG-m3_5-rot-off.json"
  ;;
msa-variants)  # issue 30: the MSA decode case alone (one token, 16 selected NVFP4 blocks per KV head, context 4096)
              # over split counts 8 / 16 / 32 and the page tiles, unrotated and rotated, each checked against the first
  phase msa-variants ${T_A:-300} python3 bench/kernel_variants.py --only msa --iters 30 --out-dir "$OUT" \
    --name "kernel-variants-msa-rotated-$TAG.json"
  ;;
interpreter-ab)  # issue 28: the served sweep of the embedded model, plain with the server's defaults (start-up heap frozen),
                # with the heap left to the collector (-pyd) and with a 0.2 ms GIL switch interval (-si), and Eagle3
                # (the default policy, 8192-token steps), two interleaved repeats
  phase serve-pareto ${T_SERVE:-560} python3 bench/serve_pareto.py --runs embedded:plain-pg embedded:plain-pg-pyd \
    embedded:plain-pg-si embedded:spec-pg-t8k --repeats ${REPEATS:-2} --requests-per-user ${RPU:-8} --timeout 70 \
    --out "$OUT/serve-pareto-interpreter-$TAG.json"
  grep -n "WARNING\|ERROR" "$OUT/serve-pareto.log" | head -20
  ;;
paired-tests)  # issue 30, eighth round: the MMA loops (MoE gate|up and down, GEMV) two steps an iteration (no ring
              # copies) and MSA rows walking only the selection slots that can hold a block: the MMA MoE and MMA GEMV
              # cells, paired == one-step loops bit for bit, the attn.paged cells, the paged-attention and decode-graph
              # GPU files
  phase pytest-cells ${T_A:-240} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 -rfE \
    tests/kernels/test_gpu.py -k "attn.paged or walk_bound or (moe.nvfp4 and r1-8) or mma_moe or paired or (replay and moe) or \
(linear.nvfp4 and r1-8) or (linear.mxfp8 and r3-8) or (qkv and (r1-8 or r3-8))"
  phase pytest-attn ${T_A2:-240} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 -rfE \
    tests/kernels/attention/test_paged_attention_gpu.py tests/runtime/test_decode_target_gpu.py
  ;;
paired-bench)  # the goal rows side by side with the paired loops, with gate|up also split 2 ways at one token, with
               # the MSA walk bounded (all three opt-in when this ran, at 80dc892), and with PDL
  [ "$TAG" = h100 ] && deep=${MODELS:-minimax-m3:12} || deep=${MODELS:-minimax-m3:24}
  phase decode-deep ${T_C:-300} python3 bench/decode.py --models $deep --batch 1,8 --context 512 --steps 20 \
    --routes ${ROUTES:-target,target-paired,target-paired-split2,target-msa-bound,target-pdl} \
    --quantization nvfp4 --out "$OUT/decode-target-$TAG-${deep/minimax-m3:/m3_}-${NAME:-paired}.json"
  phase decode-m3_5 ${T_B:-120} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 --steps 20 \
    --routes ${ROUTES5:-target,target-paired,target-msa-bound} --quantization nvfp4 \
    --out "$OUT/decode-target-$TAG-m3_5-${NAME:-paired}.json"
  # the same context growth (160 tokens) in 5 windows of 32 steps: the drained start of each window charged 4x less
  phase decode-deep-window32 ${T_W:-60} python3 bench/decode.py --models $deep --batch 1,8 --context 512 --steps 5 \
    --window 32 --routes target --quantization nvfp4 \
    --out "$OUT/decode-target-$TAG-${deep/minimax-m3:/m3_}-window32.json"
  ;;
round9-bench)  # issue 30, ninth round: the goal rows at the new defaults (paired MMA loops, MSA walk bounded, gate|up
              # split 2 ways at one token) side by side with the seventh round's cells, gate|up whole, the hoisted
              # gate|up loads (opt-in) and PDL
  [ "$TAG" = h100 ] && deep=${MODELS:-minimax-m3:12} || deep=${MODELS:-minimax-m3:24}
  phase decode-deep ${T_C:-240} python3 bench/decode.py --models $deep --batch 1,8 --context 512 --steps 20 \
    --routes ${ROUTES:-target,target-round7,target-gate-up-whole,target-gate-up-hoist,target-pdl} \
    --quantization nvfp4 --out "$OUT/decode-target-$TAG-${deep/minimax-m3:/m3_}-${NAME:-round9}.json"
  phase decode-m3_5 ${T_B:-100} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 --steps 20 \
    --routes ${ROUTES5:-target,target-round7,target-gate-up-hoist,target-pdl} --quantization nvfp4 \
    --out "$OUT/decode-target-$TAG-m3_5-${NAME:-round9}.json"
  ;;
round12)  # issue 30, twelfth round: PDL from 8 rows as the default. The goal rows at the defaults beside the same graphs
         # without PDL (the deep model first), then the decode graphs' GPU tests and the PDL ones at that default
  [ "$TAG" = h100 ] && deep=${MODELS:-minimax-m3:12} || deep=${MODELS:-minimax-m3:24}
  phase decode-deep ${T_C:-240} python3 bench/decode.py --models $deep --batch 1,8 --context 512 --steps 20 \
    --routes ${ROUTES:-target,target-nopdl} --quantization nvfp4 \
    --out "$OUT/decode-target-$TAG-${deep/minimax-m3:/m3_}-${NAME:-round12}.json"
  phase decode-m3_5 ${T_B:-60} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 --steps 20 \
    --routes ${ROUTES5:-target,target-nopdl} --quantization nvfp4 \
    --out "$OUT/decode-target-$TAG-m3_5-${NAME:-round12}.json"
  phase pytest-target ${T_A2:-200} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 160 -rfE \
    tests/runtime/test_decode_target_gpu.py tests/kernels/test_gpu.py \
    -k "(graph or race or mma_moe or paired or real_dims or embedded or pdl) and not warmup"
  ;;
round11)  # issue 30, eleventh round: the goal rows at today's defaults beside PDL (from 8 rows, or every bucket), gate|up
         # split 4 ways at one token (the paired loop compiles it at 64 registers without a spill) and the seventh
         # round's cells (the deep model first: it is the goal; rows in priority order, each written as it lands),
         # then the GPU tests that certify PDL and HOIST
  [ "$TAG" = h100 ] && deep=${MODELS:-minimax-m3:12} || deep=${MODELS:-minimax-m3:24}
  phase decode-deep ${T_C:-300} python3 bench/decode.py --models $deep --batch 1,8 --context 512 --steps 20 \
    --routes ${ROUTES:-target,target-pdl8,target-pdl,target-gate-up-split,target-round7} --quantization nvfp4 \
    --out "$OUT/decode-target-$TAG-${deep/minimax-m3:/m3_}-${NAME:-round11}.json"
  phase decode-m3_5 ${T_B:-110} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 --steps 20 \
    --routes ${ROUTES5:-target,target-pdl8,target-pdl} --quantization nvfp4 \
    --out "$OUT/decode-target-$TAG-m3_5-${NAME:-round11}.json"
  phase pytest-pdl-hoist ${T_A:-110} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 100 -rfE \
    tests/runtime/test_decode_target_gpu.py tests/kernels/test_gpu.py -k "with_and_without_pdl or mma_moe_hoisted"
  ;;
target-tests)  # the decode graphs' GPU tests (graphs vs eager and stock, sample.race, the real-dims capture) and the MoE
              # MMA bit tests (paired, hoisted) at today's defaults: what a call too short for round9-tests runs
  phase pytest-target ${T_A2:-170} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 160 -rfE \
    tests/runtime/test_decode_target_gpu.py tests/kernels/test_gpu.py -k "(graph or race or mma_moe or paired or real_dims or embedded) and not warmup"
  ;;
stream-staged)  # issue 30's next lever, measured before it is built: one-token gate|up-shaped streams with the decode's
               # instruction load, loads in flight in registers vs a shared-memory ring (cp.async / TMA)
  phase stream-staged ${T_S:-120} python3 bench/stream_patterns.py --staged-only --out-dir "$OUT"
  ;;
round9-tests)  # the same defaults' GPU tests: the MMA MoE / GEMV and attn.paged cells (paired, split, bounded walk),
               # then the paged-attention and decode-graph GPU files
  phase pytest-cells ${T_A:-200} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 -rfE \
    tests/kernels/test_gpu.py -k "attn.paged or walk_bound or (moe.nvfp4 and r1-8) or mma_moe or paired or (replay and moe) or \
(linear.nvfp4 and r1-8) or (linear.mxfp8 and r3-8) or (qkv and (r1-8 or r3-8))"
  phase pytest-attn ${T_A2:-300} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 -rfE \
    tests/kernels/attention/test_paged_attention_gpu.py tests/runtime/test_decode_target_gpu.py
  ;;
combine-fold)  # attn.paged's split-KV merge in the split kernel's last arrival (at <= MERGE_IN_SPLIT_MAX splits): the attention GPU
              # cells, graph replay and warm-up, the paged-attention GPU file, the decode target's GPU tests (graphs vs
              # eager, sample.race included: the run() refactor), then the deep model and minimax-m3:5 beside the
              # separate combine launch, side by side on one engine (NAME: the results' suffix, e.g. merge-policy for
              # the run after the merge went to the split kernel only at <= MERGE_IN_SPLIT_MAX splits)
  phase pytest-cells ${T_A:-150} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 -rfE \
    tests/kernels/test_gpu.py -k "attn.paged or race"
  phase pytest-attn ${T_A2:-240} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 -rfE \
    tests/kernels/attention/test_paged_attention_gpu.py tests/runtime/test_decode_target_gpu.py
  [ "$TAG" = h100 ] && deep=${MODELS:-minimax-m3:12} || deep=${MODELS:-minimax-m3:24}
  phase decode-deep ${T_C:-200} python3 bench/decode.py --models $deep --batch 1,8 --context 512 --steps 20 \
    --routes ${ROUTES:-target,target-combine-launch} --quantization nvfp4 \
    --out "$OUT/decode-target-$TAG-${deep/minimax-m3:/m3_}-${NAME:-combine-fold}.json"
  phase decode-m3_5 ${T_B:-100} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 --steps 20 \
    --routes ${ROUTES:-target,target-combine-launch} --quantization nvfp4 --out "$OUT/decode-target-$TAG-m3_5-${NAME:-combine-fold}.json"
  phase paged-attention ${T_D:-120} python3 bench/paged_attention.py --combine-launch both --iters 30 \
    --out "$OUT/paged-attention-$TAG-${NAME:-combine-fold}.json"
  ;;
rings-goal)  # issue 30's goal rows on the card that comes, beside the MoE's register rings one step deeper (gate|up,
            # down, both: more weight loads in flight a warp; level on the H100 before, not yet run on the H200, where
            # the one-token MoE ran at about the H100's microseconds), then minimax-m3:5's sampled step on sample.race
            # beside the torch sampler
  # (on the H200 also programmatic dependent launch: launch latency is a larger share of its faster step)
  [ "$TAG" = h100 ] && deep=${MODELS:-minimax-m3:12} || deep=${MODELS:-minimax-m3:24}
  [ "$TAG" = h100 ] && more=target-down-stages3 || more=target-pdl
  phase decode-deep ${T_C:-300} python3 bench/decode.py --models $deep --batch 1,8 --context 512 --steps 20 \
    --routes target,target-rings3,$more --quantization nvfp4 \
    --out "$OUT/decode-target-$TAG-${deep/minimax-m3:/m3_}-rings.json"
  phase decode-m3_5 ${T_B:-120} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 --steps 20 \
    --routes target,target-rings3 --quantization nvfp4 --out "$OUT/decode-target-$TAG-m3_5-rings.json"
  [ "$TAG" = h200 ] && phase decode-m3_5-race ${T_D:-120} python3 bench/decode.py --models minimax-m3:5 --batch 1,8,32 \
    --context 512 --steps 20 --routes target,target-torch-sampler --quantization nvfp4 --temperature 1.0 \
    --out "$OUT/decode-target-$TAG-m3_5-race-sampled.json"
  ;;
race-sampler)  # the sampling variant's draw on sample.race (temperature / greedy rows; top-k / top-p steps go to the
              # processed variant): its GPU cells (M3 and embedded vocabularies, rows 1-512), its graph replay, the
              # decode graphs' tokens against graphs on the torch sampler (and the existing sampling / processed
              # variants against the eager target), then minimax-m3:5's sampled step (temperature 1) on sample.race
              # beside the torch sampler, side by side on one engine
  phase pytest-race ${T_A:-200} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 -rfE \
    tests/kernels/test_gpu.py tests/runtime/test_decode_target_gpu.py -k "race or samples_inside"
  phase decode-m3_5-race ${T_B:-150} python3 bench/decode.py --models minimax-m3:5 --batch 1,8,32 --context 512 \
    --steps 20 --routes target,target-torch-sampler --quantization nvfp4 --temperature 1.0 \
    --out "$OUT/decode-target-$TAG-m3_5-race-sampled.json"
  ;;
logits-default)  # head.head12_logits on by default: its graph-replay test, the greedy head's decode-graph tests with it bound
                # (fused greedy, 12-bit greedy, sampling graphs on the 12-bit logits)
  phase pytest-logits-default ${T_A:-150} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 -rfE \
    "tests/kernels/test_gpu.py::test_cuda_graph_replay[head.head12_logits]" tests/runtime/test_greedy_head_gpu.py
  ;;
head12-logits)  # issue 30 item 3, sampling side: head.head12_logits' GPU cells (both heads' cells, graph replay) and the
               # sampling graphs on it (test_head12_logits_in_the_sampling_graphs), then minimax-m3:5's sampled decode
               # step (temperature 1) on the default (cuBLAS logits) beside target-head12-logits
  phase pytest-head12-logits ${T_A:-120} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 100 -rfE \
    tests/kernels/test_gpu.py tests/runtime/test_greedy_head_gpu.py -k "head12"
  phase decode-m3_5-sampled ${T_B:-120} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 \
    --steps 20 --routes target,target-head12-logits --quantization nvfp4 --temperature 1.0 \
    --out "$OUT/decode-target-$TAG-m3_5-head12-logits-sampled.json"
  ;;
spec-warmup)  # issue 28 item 5: Eagle3 on minimax-m3:5 beside plain (the 12-bit head in the verify rows and draft passes);
             # the log must name no kernel variant built after the warm-up (the block-table kernels now take the draft
             # view's index_scale / kv_offset unspecialised: that variant was built while serving before)
  phase spec-m3_5 ${T_D:-100} python3 bench/spec_target.py --models minimax-m3:5 --batch 1,4 --k 3 \
    --out "$OUT/spec-target-m3_5-warmup-$TAG.json"
  echo "[variants built after the warm-up: $(grep -c 'variant was built after the warm-up' "$OUT/spec-m3_5.log")]" \
    | tee -a "$OUT/phases.txt"
  grep 'variant was built after the warm-up' "$OUT/spec-m3_5.log" | cut -c1-300 | head -5
  ;;
head12-last)  # head12-h200 in the order that matters for the card when little device time is left: on an H200 the
             # goal rows first (the deepest model, then minimax-m3:5, on the defaults beside the BF16 head), then the
             # head configs and the GPU tests; on an H100 the GPU tests of the new default cells, Eagle3 on
             # minimax-m3:5 with the 12-bit head, the head configs, then minimax-m3:5
  if [ "$TAG" = h200 ]; then
    phase decode-deep ${T_C:-110} python3 bench/decode.py --models minimax-m3:24 --batch 1,8 --context 512 --steps 20 \
      --routes target,target-head-bf16 --quantization nvfp4 --out "$OUT/decode-target-h200-m3_24-head12-default.json"
    phase decode-m3_5 ${T_B:-60} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 --steps 20 \
      --routes target,target-head-bf16 --quantization nvfp4 --out "$OUT/decode-target-h200-m3_5-head12-default.json"
    phase head-variants ${T_H:-30} python3 bench/kernel_variants.py --only head --iters 30 \
      --name kernel-variants-head12-mma-h200.json --out-dir "$OUT"
  else
    phase pytest-head12 ${T_A:-60} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 55 -rfE \
      tests/kernels/test_gpu.py tests/runtime/test_greedy_head_gpu.py -k "head or greedy"
    phase spec-m3_5 ${T_D:-80} python3 bench/spec_target.py --models minimax-m3:5 --batch 1,4 --k 3 \
      --out "$OUT/spec-target-m3_5-head12-h100.json"
    phase head-variants ${T_H:-30} python3 bench/kernel_variants.py --only head --iters 30 \
      --name kernel-variants-head12-mma-h100-default.json --out-dir "$OUT"
  fi
  ;;
head12-h200)  # issue 30's goal rows with the 12-bit MMA head as the default greedy head: its GPU cells (RP 2 x 2
             # warps) and the greedy head in the decode graphs, its configs beside the BF16 head, then minimax-m3:5
             # and the deepest model the card holds on the defaults beside the BF16 head (target-head-bf16)
  [ -z "${NO_TESTS:-}" ] && phase pytest-head12 ${T_A:-110} python3 -m pytest -m gpu -q -p no:cacheprovider \
    --timeout 100 -rfE tests/kernels/test_gpu.py tests/runtime/test_greedy_head_gpu.py -k "head or greedy"
  phase head-variants ${T_H:-70} python3 bench/kernel_variants.py --only head --iters 30 \
    --name kernel-variants-head12-mma-$TAG.json --out-dir "$OUT"
  phase decode-m3_5 ${T_B:-120} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 --steps 20 \
    --routes target,target-head-bf16 --quantization nvfp4 --out "$OUT/decode-target-$TAG-m3_5-head12-default.json"
  [ "$TAG" = h100 ] && deep=${MODELS:-minimax-m3:12} || deep=${MODELS:-minimax-m3:24}
  phase decode-deep ${T_C:-240} python3 bench/decode.py --models $deep --batch 1,8 --context 512 --steps 20 \
    --routes target,target-head-bf16 --quantization nvfp4 \
    --out "$OUT/decode-target-$TAG-${deep/minimax-m3:/m3_}-head12-default.json"
  # Eagle3 on minimax-m3:5 (its drafter shares the target's head: verify rows and every draft pass take the 12-bit
  # head now) beside plain on the same engine; before: 0.90x plain at batch 1 (spec-target-m3_5-h200.json)
  phase spec-m3_5 ${T_D:-100} python3 bench/spec_target.py --models minimax-m3:5 --batch 1,4 --k 3 \
    --out "$OUT/spec-target-m3_5-head12-$TAG.json"
  ;;
head12-mma)  # issue 30 item 3, fifth round: the 12-bit head as a register-operand MMA head (head.head12 rewritten) and
            # the index projections on linear.bf16: their GPU cells and the greedy head in the decode graphs, the
            # MMA head's configs beside the BF16 head (bench/kernel_variants.py --only head), then minimax-m3:5 and
            # the deepest model the card holds with each opt-in (target-head12, target-index-gemv, both) beside the
            # default, on one engine
  [ -z "${NO_TESTS:-}" ] && phase pytest-head12 ${T_A:-110} python3 -m pytest -m gpu -q -p no:cacheprovider \
    --timeout 100 -rfE tests/kernels/test_gpu.py tests/runtime/test_greedy_head_gpu.py \
    -k "head or linear.bf16 or greedy"
  phase head-variants ${T_H:-70} python3 bench/kernel_variants.py --only head --iters 30 \
    --name kernel-variants-head12-mma-$TAG.json --out-dir "$OUT"
  r5=${ROUTES:-target,target-head12,target-index-gemv,target-opt-in}
  phase decode-m3_5 ${T_B:-140} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 --steps 20 \
    --routes $r5 --quantization nvfp4 --out "$OUT/decode-target-$TAG-m3_5-head12.json"
  [ "$TAG" = h100 ] && deep=${MODELS:-minimax-m3:12} || deep=${MODELS:-minimax-m3:24}
  phase decode-deep ${T_C:-260} python3 bench/decode.py --models $deep --batch 1,8 --context 512 --steps 20 \
    --routes $r5 --quantization nvfp4 --out "$OUT/decode-target-$TAG-${deep/minimax-m3:/m3_}-head12.json"
  ;;
deep-decode-h200)  # issue 30, fourth round, the goal rows: the GPU cells of the MXFP8 GEMV's new split (rows 1-2) and of
                  # linear.bf16 (the index projections, opt-in), then minimax-m3:5 and the deepest model the card
                  # holds with the index projections on linear.bf16 (target-index-gemv) and every change of the round
                  # undone (target-round3) beside the default, on one engine
  phase pytest-gemv ${T_A:-120} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 110 -rfE \
    tests/kernels/test_gpu.py -k "(mxfp8 and (r1-1 or r2-2)) or linear.bf16"
  phase decode-m3_5 ${T_B:-150} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 --steps 20 \
    --routes target,target-index-gemv,target-round3 --quantization nvfp4 \
    --out "$OUT/decode-target-$TAG-m3_5-round4-goal.json"
  [ "$TAG" = h100 ] && deep=${MODELS:-minimax-m3:12} || deep=${MODELS:-minimax-m3:24}
  phase decode-deep ${T_C:-300} python3 bench/decode.py --models $deep --batch 1,8 --context 512 --steps 20 \
    --routes target,target-index-gemv,target-round3 --quantization nvfp4 \
    --out "$OUT/decode-target-$TAG-${deep/minimax-m3:/m3_}-round4-goal.json"
  ;;
deep-decode-round4)  # issue 30, fourth round: the GPU cells of the changed launches (moe.nvfp4's one-token down capped at
                    # 80 registers; the MXFP8 MMA GEMV at 3-8 rows capped at 80), then minimax-m3:5 and the deepest
                    # model the card holds with each change undone beside the default (down-uncapped,
                    # mma-gemv-uncapped, splits-up: attn.paged's split count rounded up as before), the gate|up
                    # split at one token (64 / 72 registers) and programmatic dependent launch, on one engine
  # NO_TESTS=1 skips the cells (certified on an H100 at fe829b3); ROUTES overrides the side-by-side routes
  [ -z "${NO_TESTS:-}" ] && phase pytest-cells ${T_A:-170} python3 -m pytest -m gpu -q -p no:cacheprovider \
    --timeout 160 -rfE tests/kernels/test_gpu.py -k "moe.nvfp4 or (mxfp8 and r3-8) or (attn.paged and M3)"
  r4=target,target-down-uncapped,target-mma-gemv-uncapped,target-splits-up,target-gate-up-split
  r4=${ROUTES:-$r4,target-gate-up-split-r72,target-pdl}
  phase decode-m3_5 ${T_B:-130} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 --steps 20 \
    --routes $r4 --quantization nvfp4 --out "$OUT/decode-target-$TAG-m3_5-round4.json"
  [ "$TAG" = h100 ] && deep=${MODELS:-minimax-m3:12} || deep=${MODELS:-minimax-m3:24}
  phase decode-deep ${T_C:-280} python3 bench/decode.py --models $deep --batch 1,8 --context 512 --steps 20 \
    --routes $r4 --quantization nvfp4 --out "$OUT/decode-target-$TAG-${deep/minimax-m3:/m3_}-round4.json"
  ;;
deep-decode-depth)  # second call: minimax-m3:5, then the deepest model the card holds with the router side by side,
                   # each result with its top kernels (the issue's goal rows on an H200)
  phase decode-m3_5 ${T_A:-120} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 --steps 20 \
    --routes target --quantization nvfp4 --out "$OUT/decode-target-$TAG-m3_5-round3.json"
  [ "$TAG" = h100 ] && deep=${MODELS:-minimax-m3:12} || deep=${MODELS:-minimax-m3:24}
  phase decode-deep ${T_B:-420} python3 bench/decode.py --models $deep --batch 1,8 --context 512 --steps 20 \
    --routes target,target-split-router --quantization nvfp4 \
    --out "$OUT/decode-target-$TAG-${deep/minimax-m3:/m3_}-router-rot.json"
  ;;
prefill-round7)  # issue 29's 131k goal: attn.prefill's context-copy form (K/V by TMA from a head-major bf16 copy of a long
              # step's pages): its GPU tests, then minimax-m3:5 at 8k and 131k, on the default cache and on the hybrid
              # NVFP4 / FP8 one, and the deepest model at 8k, each with the copy on and off on one engine, profiled
  phase pytest-ctx ${T_A:-120} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 100 -rfE \
    tests/kernels/attention/test_prefill_attention.py tests/targets/test_attention_target_cpu.py -k "context_copy"
  phase prefill-131k-ctx ${T_B:-190} python3 bench/prefill.py --model minimax-m3:5 --tokens 8192,131072 --quant nvfp4 \
    --chunk 16384 --repeat 2 --no-transformers --context-copy on,off --profile-dir "$OUT" \
    --out "$OUT/prefill-nvfp4-8k-128k-c16k-context-copy-$TAG.json"
  phase prefill-131k-ctx-kv-nvfp4 ${T_C:-130} python3 bench/prefill.py --model minimax-m3:5 --tokens 131072 \
    --quant nvfp4 --chunk 16384 --repeat 1 --no-transformers --kv-cache-dtype nvfp4 --context-copy on,off \
    --out "$OUT/prefill-nvfp4-128k-c16k-kv-nvfp4-context-copy-$TAG.json"
  [ "$TAG" = h100 ] && deep=${MODELS:-minimax-m3:12} || deep=${MODELS:-minimax-m3:24}
  phase prefill-deep-8k-ctx ${T_D:-150} python3 bench/prefill.py --model $deep --tokens 8192 --quant nvfp4 --chunk 8192 \
    --repeat 2 --no-transformers --context-copy on,off --out "$OUT/prefill-${deep/minimax-m3:/m3_}-8k-context-copy-$TAG.json"
  ;;
prefill-round6)  # issue 29's 131k goal: attn.prefill's conditional rescale (PrefillTiles.lazy): its GPU tests, the tiles
              # at the engine's 16k chunk after 112k of context and at an 8k first chunk, then minimax-m3:5 at 8k and
              # 131k with it off and on, side by side on one engine, profiled
  phase pytest-lazy ${T_A:-90} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 80 -rfE \
    tests/kernels/attention/test_prefill_attention.py -k "lazy or 8k"
  phase attn-variants-16k ${T_B:-120} python3 bench/prefill_attention_variants.py --n 16384 --ctx 114688 --kv 16 \
    --iters 3 --variants 0,4,23,24,25,26,27 --out-dir "$OUT/ctx112k"
  phase attn-variants-8k ${T_C:-60} python3 bench/prefill_attention_variants.py --n 8192 --ctx 0 --kv 16 \
    --iters 5 --variants 0,23,24 --out-dir "$OUT/first8k"
  phase prefill-131k-lazy ${T_D:-220} python3 bench/prefill.py --model minimax-m3:5 --tokens 8192,131072 --quant nvfp4 \
    --chunk 16384 --repeat 2 --no-transformers --lazy-rescale off,on --profile-dir "$OUT" \
    --out "$OUT/prefill-nvfp4-8k-128k-c16k-lazy-rescale-$TAG.json"
  ;;
prefill-round3)  # issue 29, one call: the GPU tests of the two new prefill paths (attn.prefill_sparse; msa.scores'
              # query-stationary tiling), then the deepest model at 8k and minimax-m3:5 at 131k with the MSA prefill
              # path on and off on one engine (both rows with the new scorer), then msa.scores / msa.select tiles
              # at a 16k chunk after 112k of context
  phase pytest-prefill-paths ${T_A:-110} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 90 -rfE \
    tests/kernels/attention/test_prefill_sparse.py tests/kernels/attention/test_msa_index.py -k "prefill or sparse"
  [ "$TAG" = h100 ] && deep=${MODELS:-minimax-m3:12} || deep=${MODELS:-minimax-m3:24}
  phase prefill-deep-8k ${T_C:-190} python3 bench/prefill.py --model $deep --tokens 8192 --quant nvfp4 --chunk 8192 \
    --repeat 2 --no-transformers --sparse-prefill on,off --profile-dir "$OUT" \
    --out "$OUT/prefill-${deep/minimax-m3:/m3_}-8k-sparse-prefill-$TAG.json"
  phase prefill-131k ${T_D:-120} python3 bench/prefill.py --model minimax-m3:5 --tokens 131072 --quant nvfp4 \
    --chunk 16384 --repeat 1 --no-transformers --sparse-prefill on,off \
    --out "$OUT/prefill-nvfp4-128k-c16k-sparse-prefill-$TAG.json"
  phase msa-scores-prefill ${T_E:-100} python3 bench/msa_index_bw.py --prefill-chunk 16384 --prefill-ctx 114688 \
    --out "$OUT/msa-scores-prefill-$TAG.json"
  ;;
head12-round)  # issue 30 item 3: the 12-bit head's pair decode (10.8 SASS instructions a weight at one row, from 16.2)
              # certified on the card (its cells, the agreement with the BF16 head), then its tiles (the catalog's
              # n64w4s3 among them) beside the BF16 head at 1 and 8 rows (bench/kernel_variants.py --only head);
              # then issue 28's 128-sequence memory plan on this card (start-up of a cold card took > 140 s)
  phase pytest-head12 ${T_A:-120} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 110 -rfE \
    tests/kernels/test_gpu.py -k "head"
  phase head-variants ${T_B:-150} python3 bench/kernel_variants.py --only head --iters 30 \
    --name kernel-variants-head12-pairs-$TAG.json --out-dir "$OUT"
  [ -n "${NO_MEM:-}" ] || phase memory-startup ${T_MEM:-280} python3 bench/memory_plan_startup.py \
    --out "$OUT/memory-plan-startup-$TAG.json"
  ;;
policy-auto2)  # issue 28: the bounded measured policy ("auto:2": measured choice up to 2 requests, plain above) beside
              # plain and the fixed threshold, minimax-m3:5 NVFP4 (forced acceptance 2.78: the fixed rule lost at one
              # user there) and the embedded model, interleaved twice (phases sum to 500 s of the 600 s call)
  [ -n "${NO_M3:-}" ] || phase serve-pareto-m3 ${T_SERVE_M3:-300} python3 bench/serve_pareto.py --runs minimax-m3:5:plain-pg:nvfp4 \
    minimax-m3:5:spec-pg:nvfp4 minimax-m3:5:spec-auto2-pg:nvfp4 --repeats 2 --requests-per-user 4 --timeout 100 \
    --out "$OUT/serve-pareto-m3_5-policy-auto2-$TAG.json"
  [ -n "${NO_EMB:-}" ] || phase serve-pareto ${T_SERVE:-200} python3 bench/serve_pareto.py --runs embedded:plain-pg embedded:spec-pg \
    embedded:spec-auto2-pg --repeats 2 --requests-per-user ${RPU:-8} --timeout 60 \
    --out "$OUT/serve-pareto-policy-auto2-$TAG.json"
  ;;
memory-round)  # issue 28's memory plan (runtime/memory_plan.py): its GPU tests (the plan holds what start-up and a full
              # batch of 128 sampled Eagle3 requests take, embedded and minimax-m3:5 NVFP4; the sampler's bytes per
              # logit; graphs up to 128 sequences still captured), then minimax-m3:5 NVFP4 served plain and Eagle3 at
              # 1..128 users with max_num_seqs 128 (on the 80 GB H100 every Eagle3 request failed before the plan)
  phase pytest-memory-plan ${T_A:-240} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 -rfE \
    tests/runtime/test_no_cliffs_gpu.py -k "memory_plan or sampler_peak or up_to_max_num_seqs"
  [ -n "${NO_M3:-}" ] || phase serve-pareto-m3 ${T_SERVE_M3:-300} python3 bench/serve_pareto.py --runs minimax-m3:5:plain-pg:nvfp4 \
    minimax-m3:5:spec-pg:nvfp4 --requests-per-user 4 --timeout 140 --out "$OUT/serve-pareto-m3_5-memory-plan-$TAG.json"
  grep -n "memory plan\|WARNING\|ERROR\|Traceback" "$OUT/serve-pareto-m3.log" | head -20
  ;;
memory-check)  # the memory plan's GPU tests again (after the sampler's measured bytes per logit), then issue 28's plain
              # vs Eagle3 per user with the same 8192-token step budget for both (-t8k), two interleaved repeats
  phase pytest-memory-plan ${T_A:-200} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 180 -rfE \
    tests/runtime/test_no_cliffs_gpu.py -k "memory_plan or sampler_peak"
  phase serve-pareto ${T_SERVE:-300} python3 bench/serve_pareto.py --runs embedded:plain-pg embedded:spec-pg-t8k \
    --repeats 2 --requests-per-user ${RPU:-8} --timeout 70 --out "$OUT/serve-pareto-policy-t8k-repeats-$TAG.json"
  ;;
moe-split-round)  # issue 30 item 2, first call: the MoE's MMA-step gate|up split over H at 1-2 tokens (GSPLIT):
                 # its GPU tests (every token count, determinism, tickets at zero, graph replay at one token, the
                 # tile-layout bit equality), the split variants beside the whole-K ones at 1, 2 and 8 tokens, then
                 # minimax-m3:5's decode step side by side: split (target) vs whole-K gate|up, row-major, logits head
  phase pytest-moe-split ${T_A:-170} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 -rfE \
    "tests/kernels/test_gpu.py::test_mma_moe_every_token_count_and_split_determinism" \
    "tests/kernels/test_gpu.py::test_cell[moe.nvfp4-(128, 6144, 3072, 0)-r1-8]" \
    tests/kernels/test_tile_layout_gpu.py -k "mma_moe or MmaMoEConfig or 3072"
  phase moe-split-variants ${T_B:-170} python3 bench/kernel_variants.py --only moe --moe-tokens ${MOE_TOKENS:-1,2,8} \
    --moe-mma-only --iters 20 --name kernel-variants-moe-gate-up-split-$TAG.json --out-dir "$OUT"
  phase decode-m3_5 ${T_C:-200} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 --steps 20 \
    --routes target,target-gate-up-whole,target-rows,target-logits-head --quantization nvfp4 \
    --out "$OUT/decode-target-$TAG-m3_5-gate-up-split.json"
  ;;
moe-split-deep)  # second call: the deepest model the card holds, split vs whole-K gate|up vs row-major, with its
                 # top kernels; then issue 28's served plain vs Eagle3 (policy-round2's first phase)
  [ "$TAG" = h100 ] && deep=${MODELS:-minimax-m3:12} || deep=${MODELS:-minimax-m3:24}
  phase decode-deep ${T_D:-250} python3 bench/decode.py --models $deep --batch 1,8 --context 512 --steps 20 \
    --routes target,target-gate-up-whole,target-rows --quantization nvfp4 \
    --out "$OUT/decode-target-$TAG-deep-gate-up-split.json"
  phase serve-pareto ${T_SERVE:-300} python3 bench/serve_pareto.py --runs embedded:plain-pg embedded:spec-pg \
    --repeats 2 --requests-per-user ${RPU:-16} --timeout 120 --out "$OUT/serve-pareto-policy-repeats-$TAG.json"
  ;;
depth-round)  # issue 30, second round's first call: the decode step side by side (tiles + fused head, row-major,
             # logits head) of minimax-m3:5 and the deepest model the card holds, now with each result's top kernels by
             # GPU time (bench/decode.py's top_kernels: where a layer's time goes, launch by launch), and the token
             # columns the fixed bench makes valid (no prefill graphs, one binding per route)
  [ "$TAG" = h100 ] && deep=${MODELS:-minimax-m3:12} || deep=${MODELS:-minimax-m3:24}
  phase decode-m3_5 ${T_B:-120} python3 bench/decode.py --models minimax-m3:5 --batch 1,8 --context 512 --steps 20 \
    --routes target,target-rows,target-logits-head --quantization nvfp4 --out "$OUT/decode-target-$TAG-m3_5-kernels.json"
  phase decode-deep ${T_C:-220} python3 bench/decode.py --models $deep --batch 1,8 --context 512 --steps 20 \
    --routes target,target-rows,target-logits-head --quantization nvfp4 --out "$OUT/decode-target-$TAG-deep-kernels.json"
  ;;
moe-round)  # the MoE decode-once band decoded ahead (the next group's decode on a side stream while this group's
            # GEMM runs): GPU tests (bit-equal to serial, capture, no host sync), the layer timed serial vs ahead,
            # decode_experts' tiles, then the prefills it is for: minimax-m3:24 at 8k (with its kernel profile) and
            # minimax-m3:5 at 131k, as the cells stand (serial band: adopt DECODE_AHEAD in the M3 band if the layer
            # bench says so, then rerun the two prefill phases)
  phase pytest-moe-ahead ${T_A:-120} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 110 -rfE \
    "tests/kernels/moe/test_moe_grouped_gpu.py::test_graph_replay_is_bit_identical_to_eager[4096-0]" \
    tests/kernels/moe/test_moe_grouped_gpu.py::test_decode_ahead_equals_the_serial_band_bit_for_bit
  phase moe-decode-once ${T_B:-75} python3 bench/moe_grouped.py --decode-once --fmts nvfp4 --rows 8192,16384 \
    --out-dir "$OUT"
  phase moe-decode-tiles ${T_C:-45} python3 bench/moe_grouped.py --decode-tiles --fmts nvfp4 --out-dir "$OUT"
  phase prefill-m3_24-8k ${T_D:-150} python3 bench/prefill.py --model minimax-m3:24 --tokens 8192 --quant nvfp4 \
    --chunk 8192 --repeat 2 --no-transformers --profile-dir "$OUT" --out "$OUT/prefill-m3_24-8k-profile-h200.json"
  phase prefill-131k-c16k ${T_E:-150} python3 bench/prefill.py --model minimax-m3:5 --tokens 131072 --quant nvfp4 \
    --chunk 16384 --repeat 1 --no-transformers --out "$OUT/prefill-nvfp4-128k-c16k-h200.json"
  ;;
policy-round2)  # the policy's served comparison with less noise: plain vs Eagle3 (default 2048-token steps, and
                # 8192 like plain: under the load-counting policy its speculative steps hold at most 2 requests),
                # interleaved twice, 16 requests per user; minimax-m3:5 NVFP4 plain vs Eagle3 once (monotone per user?)
  phase serve-pareto ${T_SERVE:-300} python3 bench/serve_pareto.py --runs embedded:plain-pg embedded:spec-pg \
    ${MORE_RUNS:-} --repeats 2 --requests-per-user 16 --timeout 120 \
    --out "$OUT/serve-pareto-policy-repeats-h200.json"
  phase pytest-graph-memory ${T_A:-100} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 95 -rfE \
    tests/runtime/test_no_cliffs_gpu.py -k "up_to_max_num_seqs"
  phase serve-pareto-m3 ${T_SERVE_M3:-170} python3 bench/serve_pareto.py --runs minimax-m3:5:plain-pg:nvfp4 \
    minimax-m3:5:spec-pg:nvfp4 --requests-per-user 4 --timeout 80 --out "$OUT/serve-pareto-m3_5-policy-h200.json"
  ;;
policy-round)  # Eagle3's batch-size policy counting the requests in the engine: the embedded model served plain and
               # Eagle3 (both with prefill graphs), interleaved twice, 8 requests per user, the client spread over
               # processes (bench serve's default); attn.prefill's bf16-page tiles after 120k of context (the 131k
               # prompt's dense layers spend 68 % of its time there)
  phase serve-pareto ${T_SERVE:-360} python3 bench/serve_pareto.py --runs embedded:plain-pg embedded:spec-pg \
    --repeats 2 --requests-per-user 8 --timeout 90 --out "$OUT/serve-pareto-policy-h200.json"
  grep -n "WARNING\|ERROR\|Traceback" "$OUT/serve-pareto.log" | head -20
  phase attn-prefill-bf16-ctx120k ${T_B:-200} python3 bench/prefill_attention_variants.py --n 8192 --ctx 122880 \
    --kv 16 --iters 3 --variants 0,1,3,4,5,7,8,11,12,16 --out-dir "$OUT/ctx120k"
  ;;
client-round)  # the next call: no kernel variant built after the warm-up with prefill graphs on (the warm-up's eager
               # pass), then the served sweeps again with the client spread over processes (bench serve
               # --client-procs auto: the figures from 16 users up were client-bound), embedded and minimax-m3:5 NVFP4;
               # the closed loop with staggered arrivals (the served pattern, without HTTP)
  phase pytest-no-compiles ${T_A:-150} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 140 -rfE \
    tests/runtime/test_no_cliffs_gpu.py -k "after_the_warm_up"
  phase serve-pareto ${T_SERVE:-200} python3 bench/serve_pareto.py --runs embedded:plain embedded:plain-pg \
    embedded:spec-pg embedded:spec-always-pg --requests-per-user 4 --timeout 60 --out "$OUT/serve-pareto-h200.json"
  phase serve-pareto-m3 ${T_SERVE_M3:-200} python3 bench/serve_pareto.py --runs minimax-m3:5:plain-pg:nvfp4 \
    minimax-m3:5:spec-pg:nvfp4 minimax-m3:5:spec-always-pg:nvfp4 --requests-per-user 4 --timeout 60 \
    --out "$OUT/serve-pareto-m3_5-h200.json"
  phase spec-serving-steps-staggered ${T_B:-120} python3 bench/spec_serving_steps.py --stagger \
    --engines plain-pg,spec-pg,spec-2-pg --concurrency 1,4,16,64 --out "$OUT/spec-serving-steps-staggered-h200.json"
  ;;
defaults-round)  # the defaults this round adopted, checked and measured: attn.prefill's FP8-page cells (fp16 operands,
                 # 128 keys a step) on the GPU; the main job with prefill graphs on by default (load <= 10 s?);
                 # the embedded model served plain and Eagle3 with prefill graphs, Eagle3 also with the plain
                 # target's 8192-token step budget (-t8k) with and without its batch-size policy; a host profile of
                 # serving's split step (16 streams decoding while 1 or 8 prompts arrive)
  phase gpu-attn-prefill ${T_A:-150} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 -rfE \
    tests/kernels/test_gpu.py -k "attn.prefill" tests/kernels/attention/test_prefill_attention.py
  phase generate ${T_GENERATE:-90} python3 bench/generate_main_job.py --runs 2 --out "$OUT/generate-h200.json"
  phase serve-pareto ${T_SERVE:-200} python3 bench/serve_pareto.py --runs embedded:plain-pg embedded:spec-pg \
    embedded:spec-pg-t8k ${MORE_RUNS:-embedded:spec-always-pg-t8k} --requests-per-user 4 --timeout 60 \
    --out "$OUT/serve-pareto-h200.json"
  grep -n "WARNING\|ERROR\|left out\|off (" "$OUT/serve-pareto.log" | head -20
  phase spec-split-profile ${T_PROFILE:-60} python3 bench/debug/spec_eager_profile.py --n 1,8 --running 16 \
    --out-dir "$OUT"
  ;;
serve-m3)  # issue 28's minimax-m3:5 NVFP4 sweep (random weights, token-id prompts, Eagle3 with forced acceptance):
           # no level slower per user than the next higher one; plain and Eagle3, each with and without prefill graphs
  phase serve-pareto-m3 ${T_SERVE:-560} python3 bench/serve_pareto.py --runs minimax-m3:5:plain:nvfp4 \
    minimax-m3:5:plain-pg:nvfp4 minimax-m3:5:spec:nvfp4 minimax-m3:5:spec-always-pg:nvfp4 --requests-per-user 4 \
    --timeout 130 --out "$OUT/serve-pareto-m3_5-h200.json"
  grep -n "WARNING\|ERROR\|left out\|off (" "$OUT/serve-pareto-m3.log" | head -40
  ;;
prefill-f16)  # issue 29's 131k goal: attn.prefill on FP8 pages (the hybrid cache's dense layers) with fp16 MMA operands
              # (tiles.f16, attn.paged's scheme) against the bf16-conversion default, checked and timed at an 8k
              # first chunk and after 120k of context; a winner becomes default_tiles' FP8 choice, then the 131k
              # prompt is rerun (prefill-round)
  phase attn-prefill-fp8-8k ${T_A:-240} python3 bench/prefill_attention_variants.py --n 8192 --kv 8 --iters 10 \
    --out-dir "$OUT/first-chunk"
  phase attn-prefill-fp8-ctx120k ${T_B:-240} python3 bench/prefill_attention_variants.py --n 8192 --ctx 122880 \
    --kv 8 --iters 3 --variants 11,0,17,18,19,20,21,22 --out-dir "$OUT/ctx120k"
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
esac
done
