"""Run one linear variant a few times, for a profiler (ncu) to attach to: no timing, no checks.

    ncu --clock-control none -k regex:NAME python3 bench/ncu_variant.py --entry linear.nvfp4 --shape 24576x6144 \
        --rows 1 --variant m1w4s2c1056      (a name from bench/gemv_variants.py's grids, or "cell")
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gemv_variants as GV  # noqa: E402
from m3serve.kernels.catalog import Cell, all_entries  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entry", default="linear.nvfp4")
    ap.add_argument("--shape", default="24576x6144")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--variant", action="append", required=True)
    ap.add_argument("--launches", type=int, default=3)
    a = ap.parse_args(argv)
    e = all_entries()[a.entry]
    n, k = (int(v) for v in a.shape.split("x"))
    dev = torch.device("cuda")
    cell = e.cell_for(a.rows, (n, k))
    fmt = 0 if a.entry == "linear.nvfp4" else 1
    found = dict(GV.variants(n, k, a.rows, cell.config["gemm"] if cell else None, GV.GEMV_GRID, GV.MMA_GRID, fmt))
    gen = torch.Generator().manual_seed(0)
    for want in a.variant:
        name = next((v for v in found if v.split("/")[0] == want), None)
        if name is None:
            raise SystemExit(f"--variant {want}: not in {sorted(found)}")
        cfg = found[name]
        case = e.make_case(Cell(rows=(a.rows, a.rows), shape=(n, k), why="ncu", config={"gemm": cfg}), a.rows, dev, gen)
        for _ in range(a.launches):
            e.raw_call(*case.args, **case.kwargs)
        torch.cuda.synchronize()
        print(f"{name}: {a.launches} launches of {cfg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
