"""moe.grouped at M3 dims (E 128, H 6144, I 3072, top-4) for each expert format and row count, timed like
bench/kernels.py (the raw call captured in a CUDA graph, L2 flushed before each replay, median of --iters), beside
the stock per-expert loop (eager: it syncs, so it cannot be captured) and, for NVFP4 at <= 48 rows, moe.nvfp4.

Figures per row: us; the touched experts' weight bytes / time as a fraction of the H200's 4.8 TB/s (the roofline
of small row counts); the routed expert FLOPs (2 * 3 * H * I per pair) / time as a fraction of the dense BF16
tensor peak (~790 TFLOP/s, the roofline of prefill chunks). Every case first passes the entry's compare
(correctness before speed); a failure is recorded ("ok": false) and the run goes on.

    python3 bench/moe_grouped.py [--rows 1,8,64,256,2048,8192] [--fmts bf16,fp8,mxfp8,nvfp4] [--iters 20]
                                 [--stock] [--variants] [--name FILE] [--out-dir DIR]        (GPU)
--variants also times a few tile variants of each case's certified config (same inputs, each through the compare
first) for choosing the cells' configs; under 10 minutes a call, split by --fmts / --rows.
Writes bench/results/kernels-moe-grouped-h200.json (and a copy under --out-dir).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from m3serve.benchmeta import run_metadata  # noqa: E402
from m3serve.kernels.moe import grouped as G  # noqa: E402
from m3serve.kernels.formats._decode import FMT_BF16, FMT_FP8, FMT_MXFP8, FMT_NVFP4  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from kernels import flush_l2, graphed, time_call  # noqa: E402

HBM = 4.8e12
BF16_PEAK = 790e12
FMTS = {"bf16": FMT_BF16, "fp8": FMT_FP8, "mxfp8": FMT_MXFP8, "nvfp4": FMT_NVFP4}
BYTES = {FMT_NVFP4: 9 / 16, FMT_MXFP8: 33 / 32, FMT_FP8: 1.0, FMT_BF16: 2.0}
SHAPE = (128, 6144, 3072, 4)


def _touched(ids: torch.Tensor) -> int:
    return int(torch.unique(ids).numel())


def variants(cfg: G.GroupedConfig, rows: int) -> list[G.GroupedConfig]:
    """A few neighbours of a certified config: N / K tiles, warps, stages, block size, group size."""
    if rows <= 64:
        out = [replace(cfg, BN=32), replace(cfg, BN=128), replace(cfg, BK=256), replace(cfg, num_stages=4),
               replace(cfg, DBN=128), replace(cfg, DBN=32, DBK=256)]
    elif rows <= 512:
        out = [replace(cfg, BM=16), replace(cfg, BM=64, BN=128, BK=64, num_warps=8), replace(cfg, BN=128),
               replace(cfg, num_stages=4)]
    else:
        out = [replace(cfg, BM=64 if cfg.BM == 128 else 128), replace(cfg, BK=128, num_stages=2),
               replace(cfg, num_warps=4), replace(cfg, GM=4), replace(cfg, GM=16), replace(cfg, num_stages=4)]
    return [c for c in out if c != cfg]


def bench_one(fmt: int, rows: int, iters: int, stock: bool, flush: torch.Tensor,
              config: G.GroupedConfig | None = None) -> dict:
    cell = next(c for c in G.CELLS if c.shape == (fmt, *SHAPE) and c.rows[0] <= rows <= c.rows[1])
    if config is not None:
        cell = replace(cell, config={**cell.config, "moe": config})
    e, h, i, a = SHAPE
    case = G.make_case(cell, rows, torch.device("cuda"), torch.Generator().manual_seed(rows))
    rec = {"fmt": G.FMT_NAMES[fmt], "rows": rows, "cell": f"{cell.rows[0]}-{cell.rows[1]}",
           "config": repr(cell.config["moe"]), "variant": config is not None}
    out = G.moe_grouped(*case.args, **case.kwargs)
    torch.cuda.synchronize()
    try:
        G.compare(out, G.moe_grouped_reference(*case.args, **case.kwargs), case)
        rec["ok"] = True
    except AssertionError as err:
        rec["ok"], rec["error"] = False, str(err)[:400]
    ws = case.args[13]
    touched = _touched(ws.ids)
    wbytes = touched * 3 * h * i * BYTES[fmt]
    flops = rows * a * 2 * 3 * h * i
    fn = graphed(lambda: G.moe_grouped(*case.args, **case.kwargs))
    cold = flush if wbytes < 2e9 else None  # beyond the L2 many times over: no flush needed
    t = time_call(fn if fn is not None else (lambda: G.moe_grouped(*case.args, **case.kwargs)), iters, cold)
    rec.update(us=t * 1e6, graphed=fn is not None, touched_experts=touched, weight_bytes=int(wbytes),
               frac_hbm=wbytes / t / HBM, tflops=flops / t / 1e12, frac_bf16_peak=flops / t / BF16_PEAK)
    if stock:
        ts = time_call(lambda: G.moe_grouped_stock(*case.args, **case.kwargs), max(3, iters // 4), cold)
        rec.update(stock_us=ts * 1e6, speedup_vs_stock=ts / t)
    print(json.dumps(rec), flush=True)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,64,256,2048,8192")
    ap.add_argument("--fmts", default="bf16,fp8,mxfp8,nvfp4")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--stock", action="store_true", help="also time the stock per-expert loop (eager)")
    ap.add_argument("--variants", action="store_true", help="also time tile variants of each certified config")
    ap.add_argument("--name", default="kernels-moe-grouped-h200.json")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    flush_l2(flush)
    results = []
    for f in args.fmts.split(","):
        for r in (int(v) for v in args.rows.split(",")):
            base = next(c for c in G.CELLS if c.shape == (FMTS[f], *SHAPE) and c.rows[0] <= r <= c.rows[1])
            for cfg in [None] + (variants(base.config["moe"], r) if args.variants else []):
                try:
                    results.append(bench_one(FMTS[f], r, args.iters, args.stock and cfg is None, flush, cfg))
                    torch.cuda.empty_cache()  # the case and its graph are gone: give their memory back
                except Exception:  # noqa: BLE001 - recorded, the sweep goes on
                    results.append({"fmt": f, "rows": r, "config": repr(cfg), "ok": False,
                                    "error": traceback.format_exc()[-600:]})
                    print(results[-1]["error"], flush=True)
    doc = {**run_metadata(), "shape": {"E": SHAPE[0], "H": SHAPE[1], "I": SHAPE[2], "top_k": SHAPE[3]},
           "hbm_bytes_per_s": HBM, "bf16_peak_flops": BF16_PEAK, "results": results}
    for d in [ROOT / "bench" / "results"] + ([Path(args.out_dir)] if args.out_dir else []):
        d.mkdir(parents=True, exist_ok=True)
        (d / args.name).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
