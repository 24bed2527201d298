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

    python3 bench/moe_grouped.py --decode-tiles [--fmts nvfp4,mxfp8] [--out-dir DIR]            (GPU, ~1 minute)
decode_experts alone on one group of 16 experts' gate|up weight per (DEC_BN, DEC_BK) tile: exactness against the
default tile, time, share of HBM rate. Writes kernels-moe-decode-tiles-h200.json.

    python3 bench/moe_grouped.py --decode-once [--out-dir DIR]                                (GPU, ~1 minute)
The decode-once band (issue 29) against the in-register path, one layer at M3 dims: NVFP4 / MXFP8 / BF16 experts
(--fmts) at 2048 / 4096 / 8192 / 16384 tokens (--rows; defaults differ in this mode). Per (format, T): the
in-register path as the catalog had it before the band (the 513-2048 cell's tiles at <= 2048 tokens, the BM 128
tiles above), the decode-once path (the band serial, groups of 32, at every T so the threshold can be read off) and
decoded ahead (DECODE_AHEAD: the next group's decode on a side stream while this group's GEMM runs; groups of 16
and of 32), each as
total (the raw call: routing, grouping, expert launches, combine), gemm (the gate|up + down launches alone; for the
in-register path they include its decode) and, decode-once, decode (the decode_experts launches alone); CUDA graphs,
median of --iters (default 5 here). The cases at <= --check-rows tokens (4096) first pass the entry's compare; the
larger ones are certified by the GPU tests. BF16 experts have no decode-once path: their row is the floor the band
aims at. Writes kernels-moe-grouped-decode-once-h200.json (--name) with one line printed per row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from m3serve.benchmeta import run_metadata  # noqa: E402
from m3serve.kernels.moe import grouped as G  # noqa: E402
from m3serve.kernels.formats._decode import FMT_BF16, FMT_FP8, FMT_MXFP8, FMT_NVFP4  # noqa: E402
from m3serve.quant.tiles import tileable, to_layout  # noqa: E402

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


def _paths(fmt: int, rows: int, shape: tuple, cells: tuple) -> dict[str, G.GroupedConfig]:
    """{path: config} at `rows` tokens: the in-register path as before the band, and (quantized) the band's."""
    cells = [c for c in cells if c.shape == (fmt, *shape)]
    band = next(c for c in cells if c.config["moe"].DECODE_ONCE) if fmt != FMT_BF16 else None
    cur = next(c for c in cells if c.rows[0] <= rows <= c.rows[1]).config["moe"]
    out = {"in_register": replace(cur, DECODE_ONCE=False, DECODE_AHEAD=False)}
    if band is not None:
        cfg = band.config["moe"]
        # the band serial (groups of 32, one scratch) and decoded ahead (two halves of 16 and of 32 experts)
        out["decode_once"] = replace(cfg, DECODE_AHEAD=False, EXPERT_GROUP=32)
        out["decode_ahead"] = replace(cfg, DECODE_AHEAD=True, EXPERT_GROUP=16)
        out["decode_ahead_32"] = replace(cfg, DECODE_AHEAD=True, EXPERT_GROUP=32)
    return out


def _timed(fn, iters: int) -> float:
    """Median seconds of fn, graphed (eager if capture fails); no L2 flush (every call streams gigabytes)."""
    g = graphed(fn)
    return time_call(g if g is not None else fn, iters, None)


def decode_once_sweep(fmts: list[str], rows_list: list[int], iters: int, check_rows: int, *,
                      dev: torch.device | None = None, shape: tuple = SHAPE, cells: tuple = G.CELLS,
                      timed=_timed) -> list[dict]:
    """The --decode-once rows (module docstring). dev / shape / cells / timed: the CPU smoke test's small stand-ins."""
    dev = dev or torch.device("cuda")
    e, h, i, a = shape
    alpha, limit = G.SWIGLU_ALPHA, G.SWIGLU_LIMIT
    out = []
    for f in fmts:
        fmt = FMTS[f]
        t_max = max(rows_list)
        band = next(c for c in cells if c.shape == (fmt, *shape) and c.rows[0] <= t_max <= c.rows[1])
        base = G.make_case(band, t_max, dev, torch.Generator().manual_seed(29))  # the weights, made once per format
        (x_all, router_w, bias, _, w13, s13, f13, w2, s2, f2, sh_all, scaling, _, _, _) = base.args
        tiled = base.kwargs.get("tiled", False)   # the layout the target holds the experts in
        del base
        for rows in sorted(rows_list):
            rec = {"fmt": f, "rows": rows}
            x, shared = x_all[:rows], sh_all[:rows]
            for path, cfg in _paths(fmt, rows, shape, cells).items():
                ws = G.make_workspace(cfg, rows, e, h, i, a, dev)
                o = torch.full((rows, h), float("nan"), dtype=torch.bfloat16, device=dev)
                args = (x, router_w, bias, fmt, w13, s13, f13, w2, s2, f2, shared, scaling, o, ws, cfg)
                kw = {"top_k": a, "tiled": tiled}
                case = G.Case(args=args, kwargs=kw, bytes_moved=0)
                try:
                    G.moe_grouped(*args, **kw)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    if rows <= check_rows:
                        G.compare(o, G.moe_grouped_reference(*args, **kw), case)
                        rec[f"{path}_checked"] = True
                    rec[f"{path}_config"] = repr(cfg)
                    rec[f"{path}_total_ms"] = timed(lambda: G.moe_grouped(*args, **kw), iters) * 1e3

                    def gemm_only(x=x, ws=ws, cfg=cfg):
                        G.expert_launches(x, fmt, w13, s13, f13, w2, s2, f2, ws, cfg, a, alpha, limit, decode=False,
                                          tiled=tiled)
                    rec[f"{path}_gemm_ms"] = timed(gemm_only, iters) * 1e3
                    if cfg.DECODE_ONCE and not cfg.DECODE_AHEAD:
                        def decode_only(x=x, ws=ws, cfg=cfg):
                            G.expert_launches(x, fmt, w13, s13, f13, w2, s2, f2, ws, cfg, a, alpha, limit, gemm=False,
                                              tiled=tiled)
                        rec[f"{path}_decode_ms"] = timed(decode_only, iters) * 1e3
                    rec[f"{path}_ok"] = True
                except AssertionError as err:
                    rec[f"{path}_ok"], rec[f"{path}_error"] = False, str(err)[:400]
                except Exception:  # noqa: BLE001 - recorded, the sweep goes on
                    rec[f"{path}_ok"], rec[f"{path}_error"] = False, traceback.format_exc()[-600:]
                del ws, o, args, case
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            if "decode_once_total_ms" in rec and "in_register_total_ms" in rec:
                rec["speedup"] = rec["in_register_total_ms"] / rec["decode_once_total_ms"]
            if "decode_once_total_ms" in rec and "decode_ahead_total_ms" in rec:
                rec["ahead_speedup"] = rec["decode_once_total_ms"] / rec["decode_ahead_total_ms"]
            out.append(rec)
            print(_summary(rec), flush=True)
        del x_all, sh_all, w13, s13, f13, w2, s2, f2
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _summary(rec: dict) -> str:
    def ms(key):
        v = rec.get(key)
        return "  -  " if v is None else f"{v:6.2f}"
    line = (f"{rec['fmt']:>5} T={rec['rows']:>5}: in-register total {ms('in_register_total_ms')} ms "
            f"(gemm {ms('in_register_gemm_ms')})")
    if "decode_once_config" in rec or "decode_once_error" in rec:
        line += (f" | decode-once total {ms('decode_once_total_ms')} ms (decode {ms('decode_once_decode_ms')}, "
                 f"gemm {ms('decode_once_gemm_ms')}) | ahead {ms('decode_ahead_total_ms')}, ahead-32 "
                 f"{ms('decode_ahead_32_total_ms')}")
        if "speedup" in rec:
            line += f" x{rec['speedup']:.2f}"
    errs = [k for k in rec if k.endswith("_error")]
    return line + (f"  FAILED: {', '.join(errs)}" if errs else "")


DECODE_TILES = ((64, 128), (32, 128), (64, 256), (128, 128), (128, 64), (32, 256), (16, 512))


def decode_tile_sweep(fmts: list[str], iters: int, group: int = 16, dev: torch.device | None = None,
                      shape: tuple = SHAPE, tiles: tuple = DECODE_TILES, timed=None) -> list[dict]:
    """--decode-tiles: decode_experts alone on one group of `group` experts' gate|up weight [G, 2I, H] (in the MMA
    tile layout the target holds it in) for each (DEC_BN, DEC_BK): each variant's scratch first equals the default
    tile's bit for bit, then the median time and the bytes it moves (quantized weight and scales read, bf16 written)
    as a share of the H200's HBM rate."""
    dev = dev or torch.device("cuda")
    timed = timed or _timed
    e, h, i, _ = shape
    out = []
    for f in fmts:
        fmt = FMTS[f]
        w, sc, _ = G.random_weight(fmt, group, 2 * i, h, 1, dev, torch.Generator().manual_seed(5))
        tiled = f in ("nvfp4", "mxfp8") and tileable(f, w, sc)
        if tiled:
            w, sc = to_layout(f, w, sc, "rows", "mma_tile")
        moved = group * 2 * i * h * (BYTES[fmt] + 2.0)
        ref = None
        for bn, bk in tiles:
            cfg = G.GroupedConfig(BM=128, DECODE_ONCE=True, EXPERT_GROUP=group, DEC_BN=bn, DEC_BK=bk)
            rec = {"fmt": f, "group": group, "dec_bn": bn, "dec_bk": bk}
            try:
                wdec = torch.full((group * 2 * i * h,), float("nan"), dtype=torch.bfloat16, device=dev)
                got = G.decode_group(fmt, w, sc, 0, group, wdec, cfg, tiled)
                if ref is None:
                    ref = got.clone()
                rec["exact"] = bool(torch.equal(got, ref))
                sec = timed(lambda: G.decode_group(fmt, w, sc, 0, group, wdec, cfg, tiled), iters)
                rec.update(ms=sec * 1e3, frac_hbm=moved / sec / HBM)
            except Exception:  # noqa: BLE001 - recorded, the sweep goes on
                rec["error"] = traceback.format_exc()[-400:]
            out.append(rec)
            print(json.dumps(rec), flush=True)
        del w, sc, ref
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,64,256,2048,8192")
    ap.add_argument("--fmts", default="bf16,fp8,mxfp8,nvfp4")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--stock", action="store_true", help="also time the stock per-expert loop (eager)")
    ap.add_argument("--variants", action="store_true", help="also time tile variants of each certified config")
    ap.add_argument("--name", default=None, help="results file name (default by mode)")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--decode-once", action="store_true", help="the decode-once band vs the in-register path")
    ap.add_argument("--check-rows", type=int, default=4096, help="--decode-once: compare the cases up to these rows")
    ap.add_argument("--decode-tiles", action="store_true", help="decode_experts alone per (DEC_BN, DEC_BK)")
    args = ap.parse_args(argv)
    if args.decode_tiles:
        fmts = args.fmts if args.fmts != ap.get_default("fmts") else "nvfp4,mxfp8"
        results = decode_tile_sweep(fmts.split(","), args.iters)
        _write({**run_metadata(), "results": results}, args.name or "kernels-moe-decode-tiles-h200.json",
               args.out_dir)
        return 0 if all("error" not in r and r["exact"] for r in results) else 1
    if args.decode_once:
        t0 = time.time()
        rows = args.rows if args.rows != ap.get_default("rows") else "2048,4096,8192,16384"
        fmts = args.fmts if args.fmts != ap.get_default("fmts") else "nvfp4,mxfp8,bf16"
        iters = args.iters if args.iters != ap.get_default("iters") else 5
        results = decode_once_sweep(fmts.split(","), [int(v) for v in rows.split(",")], iters, args.check_rows)
        doc = {**run_metadata(), "shape": {"E": SHAPE[0], "H": SHAPE[1], "I": SHAPE[2], "top_k": SHAPE[3]},
               "decode_once_rows": G.DECODE_ONCE_ROWS, "iters": iters, "wall_s": round(time.time() - t0, 1),
               "results": results}
        _write(doc, args.name or "kernels-moe-grouped-decode-once-h200.json", args.out_dir)
        print(f"wall {doc['wall_s']} s", flush=True)
        return 0 if all(not k.endswith("_error") for r in results for k in r) else 1
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
    _write(doc, args.name or "kernels-moe-grouped-h200.json", args.out_dir)
    return 0


def _write(doc: dict, name: str, out_dir: str | None) -> None:
    for d in [ROOT / "bench" / "results"] + ([Path(out_dir)] if out_dir else []):
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
