#!/usr/bin/env bash
# Tile-config sweep of attn.paged on the GPU (bench/paged_attention.py with overrides); one device call.
# Its 2026-11-30 H200 result set attention/_paged_call.py's tile_config (BN 128 / 4 warps / 2 stages for one-token
# rows on fp8/bf16 pages; BN 64 / 3 stages for NVFP4) and the MSA split rule (1 block per split).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
B="timeout 100 python3 bench/paged_attention.py --iters 20"
for cfg in "--bn 64 --warps 4 --stages 3" "--bn 128 --warps 4 --stages 2" "--bn 128 --warps 8 --stages 3" \
           "--bn 64 --warps 8 --stages 4" "--bn 32 --warps 2 --stages 4"; do
  echo "== $cfg"; $B $cfg --only "fp8 decode b" --splits 0 128 2>&1 | grep -v "copy bandwidth"
done
for cfg in "--bn 64 --warps 4 --stages 3" "--bn 128 --warps 8 --stages 2" "--bn 32 --warps 4 --stages 3"; do
  echo "== $cfg"; $B $cfg --only "msa nvfp4 decode b" --splits 8 16 2>&1 | grep -v "copy bandwidth"
done
