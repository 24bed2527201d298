"""Launch and cells shared by the weight-streaming linear entries (tile configs, workspaces and argument checks:
_gemm_tiles).

Shape legend:
    x      [M, K]            bf16, M = rows (tokens in the step), unit column stride
    out    [M, N]            bf16, unit column stride
    part   [SPLIT * BM * N]  fp32 split-K partials (GemmWorkspace)
    count  [N / BN]          int32 split-K arrival counters, zero between launches
"""

from __future__ import annotations

from typing import Callable

import torch

from m3serve.kernels.formats._e2m1_ptx import use_ptx
from m3serve.kernels.gemm._gemm_tiles import GemmConfig, GemmWorkspace, check_gemm_args, check_tiled
from m3serve.kernels.gemm._gemv import GemvConfig, gemv_split
from m3serve.kernels._jit import is_compiled
from m3serve.kernels.gemm._mma_gemv import MmaGemvConfig, mma_split
from m3serve.kernels.gemm._wstream import wstream_gemm
from m3serve.kernels.catalog import Cell, device_rng

# Row ranges served by one compiled variant each; BM is the padded MMA width for the range.
ROW_RANGES = ((1, 4), (5, 16), (17, 32), (33, 48))
N_SM = 132  # H200 multiprocessors: split-K aims for >= 2 resident programs per SM
# M3 shapes (N, K) at TP1 and TP2 with the reason each exists.
M3_LINEAR_SHAPES: tuple[tuple[tuple[int, int], str], ...] = (
    ((9856, 6144), "fused q|k|v|index-q|index-k projection, TP1 (8192+512+512+512+128)"),
    ((4992, 6144), "fused q|k|v|index-q|index-k projection, TP2 (4096+256+256+256+128)"),
    ((8192, 6144), "q_proj alone, TP1 (checkpoints keep the indexer BF16, so q/k/v cannot fuse with it)"),
    ((4096, 6144), "q_proj alone, TP2"),
    ((512, 6144), "k_proj / v_proj alone, TP1"),
    ((256, 6144), "k_proj / v_proj alone, TP2"),
    ((6144, 8192), "attention output projection o_proj, TP1"),
    ((6144, 4096), "attention output projection o_proj, TP2 (K halved)"),
    ((24576, 6144), "dense-layer gate|up (2 x 12288), TP1"),
    ((12288, 6144), "dense-layer gate|up, TP2 (N halved)"),
    ((6144, 12288), "dense-layer down projection, TP1"),
    ((6144, 6144), "dense-layer down projection TP2 / shared-expert gate|up (2 x 3072) TP1"),
    ((3072, 6144), "shared-expert gate|up, TP2 (2 x 1536)"),
    ((6144, 3072), "shared-expert down projection, TP1"),
    ((6144, 1536), "shared-expert down projection, TP2 (K halved)"),
)


def bm_for(rows_hi: int) -> int:
    return 16 if rows_hi <= 16 else 32 if rows_hi <= 32 else 64


def choose_config(rows_hi: int, n: int, k: int, weight_bytes: float, bn: int = 64, bk: int = 128) -> GemmConfig:
    """Deterministic tile config for a cell. Split K (powers of two) until >= 2*N_SM programs,
    keeping >= 2 K-steps per program and the fp32 partial traffic (write + read,
    8 * SPLIT * rows * N bytes) under a quarter of the weight bytes."""
    tiles = n // bn
    iters = k // bk
    split = 1
    while (tiles * split < 2 * N_SM and iters % (2 * split) == 0 and iters // (2 * split) >= 2
           and 8 * (2 * split) * rows_hi <= 0.25 * k * weight_bytes):
        split *= 2
    bm = bm_for(rows_hi)
    # BM = 64 holds a [64, 64] fp32 accumulator plus the decoded tile: 8 warps keep it in registers
    return GemmConfig(BM=bm, BN=bn, BK=bk, SPLIT=split, num_warps=8 if bm >= 64 else 4)


def linear_cells(weight_bytes: float, shapes=M3_LINEAR_SHAPES, why_prefix: str = "") -> tuple[Cell, ...]:
    cells = []
    for (n, k), why in shapes:
        for lo, hi in ROW_RANGES:
            # narrow projections (k/v: 512 rows) use 32-row weight tiles so enough programs stream them
            cfg = choose_config(hi, n, k, weight_bytes, bn=32 if n < 2048 else 64)
            cells.append(Cell(rows=(lo, hi), shape=(n, k), why=f"{why_prefix}{why}; rows {lo}-{hi}", config={"gemm": cfg}))
    return tuple(cells)


def decode_linear_cells(weight_bytes: float, gemv: dict, gemv_rows: tuple[tuple[int, int], ...],
                        shapes=M3_LINEAR_SHAPES, mma: dict | None = None,
                        mma_rows: tuple[int, int] | None = None) -> tuple[Cell, ...]:
    """Per shape: GEMV cells (m3serve.kernels.gemm._gemv) for the decode row ranges `gemv_rows`, an MMA GEMV cell
    (m3serve.kernels.gemm._mma_gemv) for `mma_rows`, tensor-core cells for the rest of 1-48. `gemv`: BN, BK,
    num_warps, programs, PREFETCH, num_stages; `mma`: RP, num_warps, STAGES, ctas and optionally min_k (shapes
    with fewer columns keep the tensor-core cells at those rows) and maxnreg (registers per thread capped) — the
    families chosen from the measurements (bench/results/gemv_variants-*.json, decode/*-wave-caps.json)."""
    cells = []
    for (n, k), why in shapes:
        bn, bk = gemv["BN"], gemv["BK"]
        fits = n % bn == 0 and k % bk == 0 and k // bk >= 2
        covered = list(gemv_rows if fits else ())
        for lo, hi in covered:
            cfg = GemvConfig(BM=1 if hi <= 1 else 2 if hi <= 2 else 4, BN=bn, BK=bk,
                             SPLIT=gemv_split(n, k, bn, bk, gemv["programs"]), num_warps=gemv["num_warps"],
                             num_stages=gemv["num_stages"], PREFETCH=gemv["PREFETCH"])
            cells.append(Cell(rows=(lo, hi), shape=(n, k), why=f"decode GEMV: {why}; rows {lo}-{hi}",
                              config={"gemm": cfg}))
        if mma is not None and mma_rows is not None:
            mbn = 16 * mma["RP"] * mma["num_warps"]
            if n % mbn == 0 and k % 256 == 0 and k >= mma.get("min_k", 0):
                cfg = MmaGemvConfig(SPLIT=mma_split(n, k, mbn, mma["ctas"]), RP=mma["RP"], num_warps=mma["num_warps"],
                                    STAGES=mma["STAGES"], maxnreg=mma.get("maxnreg", 0))
                lo, hi = mma_rows
                cells.append(Cell(rows=(lo, hi), shape=(n, k), why=f"MMA GEMV: {why}; rows {lo}-{hi}",
                                  config={"gemm": cfg}))
                covered.append(mma_rows)
        top = max((hi for _, hi in covered), default=0)
        for lo, hi in ROW_RANGES:
            lo = max(lo, top + 1)
            if lo > hi:
                continue
            cfg = choose_config(hi, n, k, weight_bytes, bn=32 if n < 2048 else 64)
            cells.append(Cell(rows=(lo, hi), shape=(n, k), why=f"{why}; rows {lo}-{hi}", config={"gemm": cfg}))
    return tuple(cells)


def interp_cells(shapes: tuple[tuple[int, int], ...], mma: bool = False) -> tuple[Cell, ...]:
    """Tiny cells for the interpreter: split-K on and off, both padded widths that matter."""
    out = []
    for n, k in shapes:
        out.append(Cell(rows=(1, 3), shape=(n, k), why="interpreter: BM 16, no split",
                        config={"gemm": GemmConfig(BM=16, BN=64, BK=128, SPLIT=1)}))
        out.append(Cell(rows=(2, 2), shape=(n, k), why="interpreter: split-K 2, ticket + ordered reduce",
                        config={"gemm": GemmConfig(BM=16, BN=64, BK=128, SPLIT=2)}))
        out.append(Cell(rows=(17, 17), shape=(n, k), why="interpreter: BM 32 padding",
                        config={"gemm": GemmConfig(BM=32, BN=64, BK=128, SPLIT=1)}))
        if mma and n % 32 == 0 and k % 256 == 0:
            out.append(Cell(rows=(1, 8), shape=(n, k), why="interpreter: an MMA GEMV config (CPU runs its tiles "
                            "through _wstream; the PTX itself is emulated in test_mma_gemv.py)",
                            config={"gemm": MmaGemvConfig(SPLIT=2, RP=1, num_warps=2)}))
    return tuple(out)


def launch_gemm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, alpha: torch.Tensor, alpha_stride: int,
                out: torch.Tensor, ws: GemmWorkspace, *, fmt: int, alpha_mode: int, gs: int, n: int, k: int,
                cfg: GemmConfig, tiled: bool = False) -> torch.Tensor:
    """tiled: NVFP4 / MXFP8 weights in the MMA tile layout (m3serve.quant.tiles)."""
    m = check_gemm_args(x, out, n, k, cfg, ws)
    check_tiled(tiled, fmt, n, k)
    grid = (n // cfg.BN, cfg.SPLIT)
    wstream_gemm[grid](
        x, w, s, alpha, out, ws.part, ws.count, m, n, k, x.stride(0), out.stride(0), alpha_stride,
        FMT=fmt, ALPHA=alpha_mode, GS=gs, SPLIT=cfg.SPLIT, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK,
        CUDA=is_compiled(x), PTX=use_ptx(x), TILED=tiled, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def fresh_x(rows: int, k: int, device: torch.device, gen: torch.Generator | None) -> torch.Tensor:
    """Activations with a realistic spread: normal, with a few large outlier columns
    (gen=None: zeros, for compile-only warmup)."""
    if gen is None:
        return torch.zeros(rows, k, dtype=torch.bfloat16, device=device)
    g = device_rng(gen, device)
    x = torch.randn(rows, k, generator=g, device=device)
    cols = torch.randint(0, k, (max(k // 512, 1),), generator=g, device=device)
    x[:, cols] *= 20.0
    return x.to(torch.bfloat16)


def warmup_cells(cells: tuple[Cell, ...], make_case: Callable, raw_call: Callable, device: torch.device) -> None:
    """Compile every cell's variant by running it once on zero-filled inputs (gen=None); cells
    that share a variant compile once (Triton caches by constexprs and specialization)."""
    for c in cells:
        case = make_case(c, c.rows[1], device, None)
        raw_call(*case.args, **case.kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
