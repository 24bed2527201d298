"""Microbenchmark of attn.paged (m3serve/kernels/attention/paged.py) on the GPU.

Each point: one step of `batch` sequences, each with `context` keys and `rows` query tokens, on
an M3 TP1 cache (Hq 64, Hk 4, D 128, P 128); the raw call captured in a CUDA graph, the 60 MB
L2 flushed by a 256 MB memset before each replay (outside the CUDA events), median of --iters.
Reported: time, the KV bytes the step must read (every visible key's K and V once, NVFP4 scales
included), their rate and its fraction of this run's device-to-device copy bandwidth.

Goals (measured, never gated): dense decode on an FP8 cache, batch 1 at 32k and batch 16 at 4k,
>= 70 % of copy bandwidth; MSA (NVFP4, top-16) decode at 128k within 1.3x of its time at 4k.

The "... 512 (decode splits)" points are a short context at the split count a decode graph uses (fixed per bucket
by the block table's width, here a 32k-token table: most splits hold no key). --combine-launch
chooses who merges the splits: default (_paged_call's rule, MERGE_IN_SPLIT_MAX), off (the split kernel's last
arrival at every split count), on (the separate combine launch, _paged_call.COMBINE_LAUNCH), both (off and on on
the same case, side by side). Each result records which one ran (combine_launch; null with one split).

Usage (device machine, repository root):
    python3 bench/paged_attention.py [--iters 50] [--splits 0] [--bn 64 --warps 4 --stages 3]
                                     [--combine-launch default|off|on|both] [--out F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import FLUSH_BYTES, copy_bandwidth, graphed, time_call  # noqa: E402
from m3serve.benchmeta import run_metadata  # noqa: E402
from m3serve.kernels.attention import _paged_call as call  # noqa: E402
from m3serve.kernels.attention._paged_case import CaseShape, build_case  # noqa: E402
from m3serve.kernels.attention.paged import FMT_CODES, paged_attention  # noqa: E402

# (name, fmt, topk, batch, context, rows[, splits]): splits given = the decode graph's count for a 32k table
POINTS = (
    ("dense fp8 decode b1 512 (decode splits)", "fp8", 0, 1, 512, 1, 64),
    ("msa nvfp4 decode b1 512 (decode splits)", "nvfp4", 16, 1, 512, 1, 16),
    ("msa nvfp4 decode b8 512 (decode splits)", "nvfp4", 16, 8, 512, 1, 8),
    ("dense fp8 decode b1 32k", "fp8", 0, 1, 32768, 1),
    ("dense fp8 decode b16 4k", "fp8", 0, 16, 4096, 1),
    ("dense fp8 decode b64 4k", "fp8", 0, 64, 4096, 1),
    ("dense bf16 decode b1 32k", "bf16", 0, 1, 32768, 1),
    ("dense fp8 verify4 b16 4k", "fp8", 0, 16, 4096, 4),
    ("msa nvfp4 decode b1 4k", "nvfp4", 16, 1, 4096, 1),
    ("msa nvfp4 decode b1 128k", "nvfp4", 16, 1, 131072, 1),
    ("msa nvfp4 decode b16 4k", "nvfp4", 16, 16, 4096, 1),
    ("msa nvfp4 decode b16 128k", "nvfp4", 16, 16, 131072, 1),
    ("msa fp8 decode b16 4k", "fp8", 16, 16, 4096, 1),
)


def kv_bytes(fmt: str, hk: int, d: int, keys: int) -> int:
    per = {"fp8": 2 * d, "bf16": 4 * d, "fp32": 8 * d, "nvfp4": d + 2 * d // 16}[fmt]
    return keys * hk * per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--splits", type=int, nargs="*", default=[0], help="0: choose_num_splits")
    ap.add_argument("--bn", type=int, default=0)
    ap.add_argument("--warps", type=int, default=0)
    ap.add_argument("--stages", type=int, default=0)
    ap.add_argument("--only", default="")
    ap.add_argument("--combine-launch", default="default", choices=("default", "off", "on", "both"),
                    help="who merges the splits: default (_paged_call's rule), off (the split kernel at every count), "
                         "on (the combine launch), both (off and on, side by side)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.bn or a.warps or a.stages:
        base = call.tile_config

        def tuned(g, p, mql, sparse, nvfp4=False):
            c = base(g, p, mql, sparse, nvfp4)
            return call.TileConfig(QB=c.QB, BM=c.BM, BN=a.bn or c.BN, num_warps=a.warps or c.num_warps,
                                   num_stages=a.stages or c.num_stages)

        call.tile_config = tuned
    dev = torch.device("cuda")
    copy_bw = copy_bandwidth(dev)
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    hq, hk, d, p = 64, 4, 128, 128
    results = []
    modes = {"default": (None,), "off": (False,), "on": (True,), "both": (False, True)}[a.combine_launch]
    rule = call.MERGE_IN_SPLIT_MAX
    for name, fmt, topk, batch, context, rows, *fixed in POINTS:
        if a.only and a.only not in name:
            continue
        for ns, launch in [(n, m) for n in (fixed or a.splits) for m in modes]:
            call.COMBINE_LAUNCH = bool(launch)
            call.MERGE_IN_SPLIT_MAX = rule if launch is None else call.MAX_SPLITS
            cs = CaseShape(batch=batch, context=context, num_splits=ns or None, padding=False)
            pc = build_case((FMT_CODES[fmt], hq, hk, d, p, topk), rows, dev, torch.Generator().manual_seed(1), cs)
            case = pc.case
            keys = batch * (min(context, topk * p) if topk else context) * (rows if topk else 1)
            nbytes = kv_bytes(fmt, hk, d, keys)

            def fn(case=case):
                paged_attention(*case.args, **case.kwargs)

            g = graphed(fn)
            t = time_call(g or fn, a.iters, flush)
            rate = nbytes / t
            splits = case.kwargs["num_splits"]
            ran_launch = None if splits == 1 else not call.merges_in_split(splits)
            r = dict(point=name, num_splits=splits, combine_launch=ran_launch, us=t * 1e6,
                     kv_bytes=nbytes, tb_s=rate / 1e12,
                     frac_copy=rate / copy_bw, cfg=str(call.tile_config(hq // hk, p, rows, topk > 0, fmt == "nvfp4")))
            results.append(r)
            how = "one split" if ran_launch is None else "launch" if ran_launch else "merged"
            print(f"{name:40s} splits {r['num_splits']:3d} {how:9s}  {r['us']:8.2f} us  "
                  f"{nbytes / 2**20:8.2f} MiB  "
                  f"{r['tb_s']:5.2f} TB/s  {100 * r['frac_copy']:5.1f} % of copy", flush=True)
            del pc, case, g
            torch.cuda.empty_cache()
            if a.out:  # after every point: a run cut short by its time limit keeps what it measured
                Path(a.out).write_text(json.dumps(dict(**run_metadata(), copy_bandwidth_Bps=copy_bw, results=results),
                                                  indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
