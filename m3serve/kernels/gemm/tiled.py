"""Catalog entries linear.nvfp4.tiled / linear.mxfp8.tiled / linear.fp8.tiled: the quantized dense linears for
prefill rows (49..16384) on the M-tiled weight-decoding GEMM of gemm/_tiled.py. Same raw calls, references,
compares and cases as the 1-48 row entries (linear.nvfp4 / linear.mxfp8 / linear.fp8: a TiledGemmConfig selects
this kernel); only the cells differ: every M3 linear shape (_linear.M3_LINEAR_SHAPES) in three row bands, the last
(512+ rows) decoding the weight to exact bf16 once per call for cuBLAS.

Why: without them a prefill chunk runs the stock path, which dequantizes each whole weight to bf16 on every
call (for every chunk) before its GEMM; here the weight tiles are decoded in registers (exact bf16 operands) and
each is read about once per chunk.
"""

from __future__ import annotations

import torch

from m3serve.kernels.gemm import fp8 as linear_fp8, mxfp8 as linear_mxfp8, nvfp4 as linear_nvfp4
from m3serve.kernels.gemm._linear import M3_LINEAR_SHAPES
from m3serve.kernels.gemm._tiled import TiledGemmConfig
from m3serve.kernels.catalog import Cell, Entry

ENABLED = True  # the one switch: False sends prefill-row quantized linears down the stock path

# Row bands: BM 64 while a chunk's M tiles alone would not fill the 132 SMs at the narrow shapes, BM 128 beyond;
# from 512 rows the weight is decoded once to bf16 and cuBLAS runs the GEMM (gemm/_tiled.py's docstring: the
# decode's extra weight traffic is repaid once the GEMM's compute passes ~200 rows, taken with a 2x margin).
BANDS = (((49, 256), TiledGemmConfig(BM=64, BN=128, BK=64, num_warps=4)),
         ((257, 511), TiledGemmConfig(BM=128, BN=128, BK=64, num_warps=8)),
         ((512, 16384), TiledGemmConfig(BM=128, BN=128, BK=64, num_warps=8, DEQUANT_MM=True)))


def _cells() -> tuple[Cell, ...]:
    return tuple(Cell(rows=rows, shape=(n, k), why=f"{why}; prefill rows {rows[0]}-{rows[1]}",
                      config={"gemm": cfg})
                 for (n, k), why in M3_LINEAR_SHAPES for rows, cfg in BANDS)


CELLS = _cells()
INTERP_CELLS = (
    Cell(rows=(49, 49), shape=(128, 256), why="interpreter: 49 rows, BM 32 (two M tiles, the last partial)",
         config={"gemm": TiledGemmConfig(BM=32, BN=64, BK=64, GM=2)}),
    Cell(rows=(70, 70), shape=(128, 256), why="interpreter: 70 rows, BM 16, groups of 3 M tiles",
         config={"gemm": TiledGemmConfig(BM=16, BN=32, BK=128, GM=3)}),
    Cell(rows=(75, 75), shape=(128, 256), why="interpreter: weight decoded to bf16, GEMM in row chunks of 32 (the "
         "last partial), epilogue per chunk", config={"gemm": TiledGemmConfig(BM=16, DEQUANT_MM=True, MM_ROWS=32)}),
)


def _warmup(module, make_case):
    def warmup(device: torch.device) -> None:
        """One call per cell: the kernel does not specialise on M."""
        for c in CELLS:
            case = make_case(c, c.rows[0], device, None)
            module.ENTRY.raw_call(*case.args, **case.kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return warmup


def _entry(module, fmt: str) -> Entry:
    base: Entry = module.ENTRY
    return Entry(name=f"linear.{fmt}.tiled", kind=f"linear.{fmt}", raw_call=base.raw_call, reference=base.reference,
                 compare=base.compare, make_case=base.make_case, cells=CELLS, interp_cells=INTERP_CELLS,
                 warmup=_warmup(module, base.make_case), enabled=lambda: ENABLED and base.enabled(), stock=base.stock)


ENTRIES = (_entry(linear_nvfp4, "nvfp4"), _entry(linear_mxfp8, "mxfp8"), _entry(linear_fp8, "fp8"))
