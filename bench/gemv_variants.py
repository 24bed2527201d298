"""Decode GEMV variants vs the certified cell: the CUDA-core GEMV (m3serve/kernels/gemm/_gemv.py, rows 1-4) and the
register-operand MMA GEMV (m3serve/kernels/gemm/_mma_gemv.py, rows 1-8).

For linear.nvfp4 and linear.mxfp8, each real (N, K) shape and rows 1, 2, 4: the entry's current
cell config ("cell") and each GEMV config below run on the SAME fresh random inputs through the
entry's raw call; every output is checked against the entry's reference with the entry's
compare (a failure is reported and the run continues), then timed like bench/kernels.py (CUDA
graph replay, 256 MB L2 flush before each replay, median of --iters) and reported as GB/s over
the bytes the call must move and as a fraction of this run's device-to-device copy bandwidth.
"det" says whether the last timed replay reproduced the first output bit for bit.
With --seq, each variant is also timed as decode runs it: R launches back to back in one CUDA graph, each
on its own copy of the weights (R copies >= 512 MB, so nothing stays in the 60 MB L2), reported per launch
as us_seq / frac_copy_seq.

Usage:
    python3 bench/gemv_variants.py [--iters 20] [--budget-s 210] [--out-dir DIR]   (GPU; ~2-4 min)
    python3 bench/gemv_variants.py --cpu-smoke                                     (interpreter)
Writes gemv_variants-<date>.json to $OUT (or --out-dir) and bench/results/gemv_variants/ (GPU runs).
A variant still compiling when --budget-s has passed finishes; later ones are skipped (listed).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from m3serve.kernels.gemm._gemm_tiles import make_workspace  # noqa: E402
from m3serve.kernels.gemm import _linear as L  # noqa: E402
from m3serve.kernels.gemm import mxfp8 as linear_mxfp8, nvfp4 as linear_nvfp4  # noqa: E402
from m3serve.kernels.gemm._gemv import GemvConfig, gemv_split  # noqa: E402
from m3serve.kernels.gemm._mma_gemv import MmaGemvConfig, mma_split  # noqa: E402
from m3serve.kernels.catalog import Case, Cell, poisoned  # noqa: E402

# every M3 linear shape with N or K >= 6144 (TP1 and TP2), the 512/256-wide k/v projections being fused away
SHAPES = ((9856, 6144), (4992, 6144), (8192, 6144), (4096, 6144), (6144, 8192), (6144, 4096), (24576, 6144),
          (12288, 6144), (6144, 12288), (6144, 6144), (3072, 6144), (6144, 3072), (6144, 1536))
ROWS = (1, 4, 8)
ENTRIES = (linear_nvfp4.ENTRY, linear_mxfp8.ENTRY)
# (name, BN, BK, num_warps, target programs, PREFETCH, num_stages); SPLIT follows from the target
GEMV_GRID = (
    ("g32x256w4", 32, 256, 4, 528, True, 1),
    ("g16x512w4", 16, 512, 4, 528, True, 1),
    ("g64x256w8", 64, 256, 8, 264, True, 1),
    ("g32x256w4p1k", 32, 256, 4, 1056, True, 1),
    ("g32x256w4s3", 32, 256, 4, 528, False, 3),  # no manual prefetch: does the pipeliner do it?
)
# (name, RP, num_warps, STAGES, target CTAs); SPLIT follows from the target (>= 2 K steps per CTA). The
# shared-memory (cp.async) ring measured in 0596e85:bench/results/gemv_variants-h200-smem-ring-2026-12-01.json
# (git history) was removed after it lost to the register ring (its code: commit 15c92c4).
MMA_GRID = (
    ("r1w4s2c1056", 1, 4, 2, 1056),
    ("r1w2s2c2640", 1, 2, 2, 2640),
    ("r1w8s2c924", 1, 8, 2, 924),
    ("r2w4s2c924", 2, 4, 2, 924),
    ("r2w2s2c1848", 2, 2, 2, 1848),
    ("r1w4s3c1056", 1, 4, 3, 1056),
)
SMOKE_SHAPES = ((64, 512), (32, 256))
SMOKE_GRID = (("s16x64", 16, 64, 2, 8, True, 1), ("s32x128np", 32, 128, 4, 4, False, 1))


def _load_kernels_bench():
    """bench/kernels.py's timing helpers (one methodology for both benchmarks)."""
    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def variants(n: int, k: int, rows: int, cell_cfg, grid, mma_grid=(), fmt: int = 0) -> list[tuple[str, object]]:
    bm = 1 if rows <= 1 else 2 if rows <= 2 else 4
    out: list[tuple[str, object]] = [("cell", cell_cfg)] if cell_cfg is not None else []
    for name, rp, warps, stages, ctas in mma_grid:
        bn = 16 * rp * warps
        cfg = MmaGemvConfig(SPLIT=mma_split(n, k, bn, ctas), RP=rp, num_warps=warps, STAGES=stages)
        try:
            cfg.check_format(fmt)
        except ValueError:
            continue
        if n % bn or k % 256:
            continue
        out.append((f"{name}/s{cfg.SPLIT}", cfg))
    for name, bn, bk, warps, programs, prefetch, stages in grid:
        if rows > 4 or n % bn or k % bk or k // bk < 2:
            continue
        split = gemv_split(n, k, bn, bk, programs)
        out.append((f"{name}/s{split}", GemvConfig(BM=bm, BN=bn, BK=bk, SPLIT=split, num_warps=warps,
                                                   num_stages=stages, PREFETCH=prefetch)))
    return out


def with_config(case: Case, cfg, n: int, device: torch.device) -> Case:
    """The same inputs with a fresh poisoned output, a fresh workspace and another config."""
    inputs = case.args[:-3]
    out = poisoned(tuple(case.args[-3].shape), torch.bfloat16, device)
    return Case(args=(*inputs, out, make_workspace(cfg, n, device), cfg), kwargs=case.kwargs,
                bytes_moved=case.bytes_moved)


def cfg_dict(cfg) -> dict:
    return {"type": type(cfg).__name__, **cfg.__dict__}


def weight_copies(case: Case, budget: int = 512 << 20, most: int = 16) -> list[tuple]:
    """Copies of the case's weight tensors (everything between x and out) filling >= `budget` bytes."""
    weights = case.args[1:-3]
    nbytes = sum(t.numel() * t.element_size() for t in weights if isinstance(t, torch.Tensor))
    r = max(2, min(most, -(-budget // max(nbytes, 1))))
    return [tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in weights) for _ in range(r)]


def time_in_sequence(kb, e, case: Case, copies: list[tuple], iters: int) -> float:
    """Seconds per launch of len(copies) launches back to back in one CUDA graph, each on its own weights."""
    x, out, ws, cfg = case.args[0], case.args[-3], case.args[-2], case.args[-1]

    def body() -> None:
        for wts in copies:
            e.raw_call(x, *wts, out, ws, cfg, **case.kwargs)

    replay = kb.graphed(body)
    if replay is None:
        raise RuntimeError("time_in_sequence: graph capture failed")
    return kb.time_call(replay, iters, None) / len(copies)  # R copies >= 512 MB: nothing to flush


def run(a: argparse.Namespace) -> dict:
    cpu = a.cpu_smoke
    dev = torch.device("cpu" if cpu else "cuda")
    kb = None if cpu else _load_kernels_bench()
    shapes, grid = (SMOKE_SHAPES, SMOKE_GRID) if cpu else (SHAPES, GEMV_GRID if a.gemv else ())
    mma_grid = () if cpu else MMA_GRID
    shapes = [sh for sh in shapes if not a.shapes or f"{sh[0]}x{sh[1]}" in a.shapes.split(",")]
    rows_list = [int(r) for r in a.rows.split(",")] if a.rows else (ROWS if not cpu else (1, 2, 4))
    t0 = time.time()
    bw = None
    flush = None
    if not cpu:
        bw = kb.copy_bandwidth(dev)
        flush = torch.empty(kb.FLUSH_BYTES, dtype=torch.uint8, device=dev)
        print(f"device {torch.cuda.get_device_name(dev)}; copy bandwidth {bw / 1e12:.3f} TB/s (read + write)", flush=True)
    gen = torch.Generator().manual_seed(0)
    results: list[dict] = []
    skipped: list[str] = []
    entries = [e for e in ENTRIES if not a.entries or e.name in a.entries.split(",")]
    for e in entries:
        for n, k in shapes:
            for rows in rows_list:
                cell = e.cell_for(rows, (n, k))
                cell_cfg = cell.config["gemm"] if cell is not None else None
                if cpu:  # tiny shapes have no certified cell: exercise the tensor-core path at a small tile
                    cell_cfg = L.GemmConfig(BM=16, BN=32, BK=64, SPLIT=2)
                base_cfg = cell_cfg or GemvConfig(BM=4, BN=16, BK=64, SPLIT=1)
                base = e.make_case(Cell(rows=(rows, rows), shape=(n, k), why="bench", config={"gemm": base_cfg}),
                                   rows, dev, gen)
                ref = e.reference(*base.args, **base.kwargs)
                copies = weight_copies(base) if (a.seq and not cpu) else None
                fmt = 0 if e.name == "linear.nvfp4" else 1
                for vname, cfg in variants(n, k, rows, cell_cfg, grid, mma_grid, fmt):
                    tag = f"{e.name} {(n, k)} rows {rows} {vname}"
                    if time.time() - t0 > a.budget_s:
                        skipped.append(tag)
                        continue
                    rec = {"entry": e.name, "shape": [n, k], "rows": rows, "variant": vname, "config": cfg_dict(cfg)}
                    try:
                        case = with_config(base, cfg, n, dev)
                        tc = time.time()
                        out = e.raw_call(*case.args, **case.kwargs).clone()
                        rec["first_call_s"] = time.time() - tc  # compile (GPU) or interpret (CPU) time
                        e.compare(out, ref, case)
                        rec["ok"] = True
                        if not cpu:
                            call = lambda case=case, e=e: e.raw_call(*case.args, **case.kwargs)  # noqa: E731
                            replay = kb.graphed(call)
                            t = kb.time_call(replay or call, a.iters, flush, "read" if a.flush == "read" else "write")
                            torch.cuda.synchronize()
                            rec.update(graph=replay is not None, us=t * 1e6, bytes=case.bytes_moved,
                                       GBps=case.bytes_moved / t / 1e9, frac_copy=case.bytes_moved / t / bw,
                                       flush="read" if a.flush == "read" else "write")
                            if a.flush == "both":
                                tr = kb.time_call(replay or call, a.iters, flush, "read")
                                rec.update(us_read_flush=tr * 1e6, frac_copy_read_flush=case.bytes_moved / tr / bw)
                            rec["det"] = bool(torch.equal(case.args[-3], out))
                            rec["counters_zero"] = bool((case.args[-2].count == 0).all())
                            if copies is not None:
                                ts = time_in_sequence(kb, e, case, copies, max(5, a.iters // 2))
                                rec.update(us_seq=ts * 1e6, frac_copy_seq=case.bytes_moved / ts / bw,
                                           seq_launches=len(copies))
                        else:
                            rec["det"] = bool(torch.equal(e.raw_call(*case.args, **case.kwargs), out))
                    except Exception as exc:  # report, keep going: one bad variant must not end the run
                        rec["ok"] = False
                        rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                        rec["trace"] = traceback.format_exc(limit=3)[-1500:]
                        if not cpu:
                            torch.cuda.synchronize()
                    results.append(rec)
                    line = (f"{e.name:13s} {str((n, k)):14s} rows {rows}  {vname:22s} "
                            + ("FAIL " + rec["error"][:160] if not rec["ok"] else
                               f"ok  interpreted in {rec['first_call_s']:.2f} s  det={rec['det']}" if cpu else
                               f"ok  {rec.get('us', float('nan')):8.1f} us  {rec.get('GBps', float('nan')):7.0f} GB/s  "
                               f"{100 * rec.get('frac_copy', float('nan')):5.1f}% copy  det={rec['det']}"
                               + (f"  seq {rec['us_seq']:7.1f} us {100 * rec['frac_copy_seq']:5.1f}%"
                                  if "us_seq" in rec else "")
                               + (f"  rflush {rec['us_read_flush']:7.1f} us {100 * rec['frac_copy_read_flush']:5.1f}%"
                                  if "us_read_flush" in rec else "")))
                    print(line, flush=True)
                del base, ref, copies
                if not cpu:
                    torch.cuda.empty_cache()
    from m3serve.benchmeta import git_commit
    doc = {"gpu": "cpu-interpreter" if cpu else torch.cuda.get_device_name(dev), "command": " ".join(sys.argv),
           "git_commit": git_commit(),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "copy_bandwidth_Bps": bw, "iters": a.iters,
           "wall_s": time.time() - t0, "results": results, "skipped": skipped, "summary": summarize(results)}
    return doc


def summarize(results: list[dict]) -> list[dict]:
    """Per (entry, rows): each variant family's geometric-mean fraction of copy bandwidth over the
    shapes it ran correctly on, and per (entry, shape, rows) the best correct variant vs the cell."""
    out: list[dict] = []
    fam: dict[tuple, list[float]] = {}
    best: dict[tuple, dict] = {}
    cell: dict[tuple, dict] = {}
    for r in results:
        if not r.get("ok") or "frac_copy" not in r:
            continue
        key = (r["entry"], tuple(r["shape"]), r["rows"])
        fam.setdefault((r["entry"], r["rows"], r["variant"].split("/")[0]), []).append(r["frac_copy"])
        if r["variant"] == "cell":
            cell[key] = r
        if key not in best or r["frac_copy"] > best[key]["frac_copy"]:
            best[key] = r
    for (ent, rows, v), fr in sorted(fam.items()):
        out.append({"entry": ent, "rows": rows, "variant": v, "n_shapes": len(fr),
                    "geomean_frac_copy": math.exp(sum(math.log(f) for f in fr) / len(fr))})
    for key, r in sorted(best.items()):
        c = cell.get(key)
        out.append({"entry": key[0], "shape": list(key[1]), "rows": key[2], "best": r["variant"],
                    "best_frac_copy": r["frac_copy"], "cell_frac_copy": c["frac_copy"] if c else None,
                    "speedup_vs_cell": c["us"] / r["us"] if c else None})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=210.0, help="stop starting new variants after this")
    ap.add_argument("--out-dir", default=os.environ.get("OUT"))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes under the Triton interpreter")
    ap.add_argument("--seq", action="store_true", help="also time each variant back to back in one graph")
    ap.add_argument("--gemv", action="store_true", help="also run the CUDA-core GEMV grid (rows <= 4)")
    ap.add_argument("--flush", choices=("write", "read", "both"), default="write",
                    help="L2 flush before each timed launch (bench/kernels.py flush_l2); both: time each way")
    ap.add_argument("--shapes", default="", help="comma list NxK (default: all)")
    ap.add_argument("--rows", default="", help="comma list (default 1,4,8)")
    ap.add_argument("--entries", default="", help="comma list of entry names (default: linear.nvfp4,linear.mxfp8)")
    a = ap.parse_args(argv)
    if not a.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: use --cpu-smoke", file=sys.stderr)
        return 2
    if not a.cpu_smoke:
        torch.backends.cuda.matmul.allow_tf32 = False
    doc = run(a)
    fails = [r for r in doc["results"] if not r["ok"]]
    for s in doc["summary"]:
        if "geomean_frac_copy" in s:
            print(f"  {s['entry']:13s} rows {s['rows']}  {s['variant']:14s} geomean {100 * s['geomean_frac_copy']:5.1f}% "
                  f"copy over {s['n_shapes']} shapes")
    print(f"{len(doc['results'])} runs, {len(fails)} failed, {len(doc['skipped'])} skipped (budget); "
          f"wall {doc['wall_s']:.0f} s")
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    name = f"gemv_variants-{'cpu-smoke' if a.cpu_smoke else 'gpu'}-{date}.json"
    _load_kernels_bench().write_results(doc, name, a.out_dir, to_results=not a.cpu_smoke,
                                           bench="gemv_variants")
    return 1 if a.cpu_smoke and fails else 0


if __name__ == "__main__":
    sys.exit(main())
