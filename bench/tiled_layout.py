"""Does the MMA tile layout lift the register-operand MMA GEMV to the bandwidth limit?

The MMA GEMV's lanes read 8 rows x 64 B per warp instruction from row-major NVFP4 weights; tile_nvfp4 re-lays
the same bytes so that each warp instruction reads 512 contiguous bytes (m3serve/kernels/gemm/_mma_gemv.py). This
times both layouts side by side on the same weights, in one run, for the M3 NVFP4 linear shapes at 1, 4 and 8
rows, with bench/kernels.py's methodology (CUDA graph, L2 flushed before each replay: "write" memset as the goal
figure, "read" sum as a decode step finds the L2), plus back to back in one graph over weight copies of >= 512 MB
(the steady state between kernels). Checks: the two layouts' outputs are bit-identical (same registers, same
order), and the row-major one passes linear.nvfp4's compare. Row 1's certified cell (the CUDA-core GEMV) is timed
beside them.

    python3 bench/tiled_layout.py [--iters 20] [--out-dir DIR]      (GPU, ~1 min)
Writes bench/results/tiled_layout/tiled-layout-h200.json (and a copy under --out-dir).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from m3serve.benchmeta import run_metadata  # noqa: E402
from m3serve.kernels.gemm._gemm_tiles import make_workspace  # noqa: E402
from m3serve.kernels.gemm import _linear as L  # noqa: E402
from m3serve.kernels.gemm import _mma_gemv as G  # noqa: E402
from m3serve.kernels.gemm import nvfp4 as LN  # noqa: E402
from m3serve.kernels.catalog import Case, poisoned  # noqa: E402
from m3serve.quant.nvfp4 import tile_nvfp4  # noqa: E402

SHAPES = ((24576, 6144), (9856, 6144), (6144, 8192), (6144, 12288), (6144, 6144), (6144, 3072))
ROWS = (1, 4, 8)
# (name, RP, warps, STAGES, target CTAs)
CONFIGS = (("r1w4s2c1056", 1, 4, 2, 1056), ("r1w4s3c1056", 1, 4, 3, 1056), ("r2w4s2c924", 2, 4, 2, 924),
           ("r1w8s2c924", 1, 8, 2, 924))


def _kb():
    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out-dir", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/tiled_layout.py needs a CUDA GPU")
    kb = _kb()
    dev = torch.device("cuda")
    t0 = time.time()
    bw = kb.copy_bandwidth(dev)
    flush = torch.empty(kb.FLUSH_BYTES, dtype=torch.uint8, device=dev)
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    results = []
    for n, k in SHAPES:
        gen = torch.Generator().manual_seed(n + k)
        packed, scale, gs = LN.random_nvfp4_weight(n, k, dev, gen)
        tp, ts = tile_nvfp4(packed, scale)
        nbytes_w = packed.numel() + scale.numel()
        reps = max(2, min(16, -(-(512 << 20) // nbytes_w)))
        copies = {False: [(packed.clone(), scale.clone()) for _ in range(reps)],
                  True: [(tp.clone(), ts.clone()) for _ in range(reps)]}
        for rows in ROWS:
            x = L.fresh_x(rows, k, dev, gen)
            nbytes = nbytes_w + rows * k * 2 + rows * n * 2
            cell = next(c for c in LN.ENTRY.cells if c.shape == (n, k) and c.rows[0] <= rows <= c.rows[1])
            runs = [("cell", cell.config["gemm"], False)]
            for name, rp, w, st, ctas in CONFIGS:
                cfg = G.MmaGemvConfig(SPLIT=G.mma_split(n, k, 16 * rp * w, ctas), RP=rp, num_warps=w, STAGES=st)
                if n % cfg.BN:
                    continue
                runs += [(f"{name}/s{cfg.SPLIT}", cfg, False), (f"{name}/s{cfg.SPLIT}/tiled", cfg, True)]
            ref_bits = {}
            for vname, cfg, tiled in runs:
                out = poisoned((rows, n), torch.bfloat16, dev)
                ws = make_workspace(cfg, n, dev)
                if isinstance(cfg, G.MmaGemvConfig):
                    def call(w=None, s=None, cfg=cfg, tiled=tiled, out=out, ws=ws):
                        w = (tp if tiled else packed) if w is None else w
                        s = (ts if tiled else scale) if s is None else s
                        G.launch_mma_gemv(x, w.view(torch.int32), s.view(torch.uint8), gs, 0, out, ws,
                                          fmt=0, alpha_mode=2, n=n, k=k, cfg=cfg, tiled=tiled)
                else:
                    def call(w=None, s=None, cfg=cfg, out=out, ws=ws):
                        LN.nvfp4_linear(x, packed if w is None else w, scale if s is None else s, gs, out, ws, cfg)
                call()
                torch.cuda.synchronize()
                rec = {"shape": [n, k], "rows": rows, "variant": vname, "tiled": tiled, "bytes": nbytes,
                       "config": {"type": type(cfg).__name__, **cfg.__dict__}}
                key = vname.replace("/tiled", "")
                if tiled:
                    rec["bit_identical_to_row_major"] = bool(torch.equal(out.view(torch.int16), ref_bits[key]))
                else:
                    ref_bits[key] = out.view(torch.int16).clone()
                    try:
                        LN.compare(out, LN.nvfp4_linear_reference(x, packed, scale, gs),
                                   Case(args=(x, packed, scale, gs), kwargs={}, bytes_moved=0))
                        rec["ok"] = True
                    except AssertionError as exc:
                        rec["ok"], rec["why"] = False, str(exc)[:200]
                replay = kb.graphed(call)
                for mode in ("write", "read"):
                    t = kb.time_call(replay, a.iters, flush, mode)
                    rec[f"us_{mode}_flush"] = t * 1e6
                    rec[f"frac_copy_{mode}_flush"] = nbytes / t / bw
                seq = kb.graphed(lambda call=call, tiled=tiled: [call(w, s) for w, s in copies[tiled]])
                t = kb.time_call(seq, a.iters, None) / reps
                rec["us_seq"], rec["frac_copy_seq"] = t * 1e6, nbytes / t / bw
                results.append(rec)
                print(f"{n:6d}x{k:<6d} r{rows} {vname:24s} write {rec['us_write_flush']:7.1f} us "
                      f"{100 * rec['frac_copy_write_flush']:5.1f}%  read {100 * rec['frac_copy_read_flush']:5.1f}%  "
                      f"seq {100 * rec['frac_copy_seq']:5.1f}%  "
                      f"{'' if rec.get('ok', rec.get('bit_identical_to_row_major')) else 'CHECK FAILED'}", flush=True)
    meta = run_metadata()
    doc = {**{k_: meta[k_] for k_ in ("commit", "gpu", "command", "date", "torch")},
           "triton": __import__("triton").__version__, "copy_bandwidth_Bps": bw, "iters": a.iters,
           "l2_flush_bytes": kb.FLUSH_BYTES, "wall_s": time.time() - t0, "results": results}
    kb.write_results(doc, "tiled-layout-h200.json", a.out_dir, bench="tiled_layout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
