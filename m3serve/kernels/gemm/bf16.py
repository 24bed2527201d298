"""Catalog entry linear.bf16: y[M, N] = x[M, K] @ w[N, K]^T with BF16 weights at 1-4 rows, on the decode GEMV
(gemm/_gemv.py, FMT_BF16): one launch where cuBLAS runs a split-K GEMM and a reduce kernel.

Why: quantized M3 checkpoints keep the lightning indexer in BF16, so every MSA layer of the decode step projects
index-q | index-k ([Hk * Di + Di, H] = 640 x 6144 at TP1, 7.9 MB) beside the quantized q|k|v. cuBLAS takes two
launches for it at one row (a split-K GEMM and its reduce, ~7 us on the H100); the decode GEMV takes one. Rows above
4 keep cuBLAS (targets.fused_projection). The plan routes that group here only with targets.plan.INDEX_GEMV
(opt-in: in the decode step it measured level with cuBLAS, see targets/plan.py).

Shape legend:
    x      [M, K]   bf16 activations (M = 1..4 tokens), unit column stride
    w      [N, K]   bf16, contiguous
    out    [M, N]   bf16
"""

from __future__ import annotations

import torch

from m3serve.kernels.catalog import (Case, Cell, Entry, assert_band, check_tensor, device_rng, gemm_band, poisoned,
                                     true_fp32)
from m3serve.kernels.formats._decode import FMT_BF16
from m3serve.kernels.gemm import _linear as L
from m3serve.kernels.gemm._gemm_tiles import GemmWorkspace, make_workspace
from m3serve.kernels.gemm._gemv import GemvConfig, gemv_split, launch_gemv

ENABLED = True  # the one switch: False sends every linear.bf16 call down the stock path (cuBLAS); the plan routes
# the index projections here only where targets.plan.INDEX_GEMV says so (opt-in: measured level with cuBLAS in the step)

GS = 32  # columns summed before they join the accumulator (no scale: only the summation order)


def bf16_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, workspace: GemmWorkspace,
                config: GemvConfig) -> torch.Tensor:
    """Raw call. Writes and returns `out`."""
    n, k = w.shape
    check_tensor("w", w, torch.bfloat16, (n, k), device=x.device)
    if not w.is_contiguous():
        raise ValueError("w: expected a contiguous tensor")
    if not isinstance(config, GemvConfig):
        raise ValueError(f"config: linear.bf16 runs the decode GEMV (GemvConfig), found {type(config).__name__}")
    return launch_gemv(x, w, w, w, 0, out, workspace, fmt=FMT_BF16, alpha_mode=0, gs=GS, n=n, k=k, cfg=config)


def bf16_linear_reference(x, w, out=None, workspace=None, config=None) -> torch.Tensor:
    """fp32 [M, N] = x.float() @ w.float().T in true fp32."""
    with true_fp32():
        return x.float() @ w.float().T


def bf16_linear_stock(x, w, out=None, workspace=None, config=None) -> torch.Tensor:
    return x @ w.T


def compare(out: torch.Tensor, ref: torch.Tensor, case: Case) -> None:
    """Band: gemm_band (one bf16 ulp + 2*K*u*sum|x*w|): the products are exact in fp32, only the sums round."""
    x, w = case.args[:2]
    with true_fp32():
        absprod = x.float().abs() @ w.float().abs().T
    assert_band("linear.bf16", out, ref, gemm_band(ref, absprod, x.shape[1]))


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    n, k = cell.shape
    cfg: GemvConfig = cell.config["gemm"]
    if gen is None:   # compile-only warm-up and 'meta' tensors (aot_check)
        w = torch.zeros(n, k, dtype=torch.bfloat16, device=device)
    else:
        w = (torch.randn(n, k, generator=device_rng(gen, device), device=device) * 0.02).to(torch.bfloat16)
    x = L.fresh_x(rows, k, device, gen)
    out = poisoned((rows, n), torch.bfloat16, device)
    ws = make_workspace(cfg, n, device)
    return Case(args=(x, w, out, ws, cfg), kwargs={}, bytes_moved=n * k * 2 + rows * k * 2 + rows * n * 2)


# the dense index-q | index-k group of an MSA layer: TP1 (4 x 128 + 128), TP2 (2 x 128 + 128)
INDEX_SHAPES = (((640, 6144), "index-q|index-k of an MSA layer, TP1 (512+128)"),
                ((384, 6144), "index-q|index-k of an MSA layer, TP2 (256+128)"))
ROWS = ((1, 1), (2, 2), (3, 4))


def _cfg(rows_hi: int, n: int, k: int) -> GemvConfig:
    # 16 rows x 256 columns a program (8 KB of weights), K split toward 1056 programs (8 an SM; 9 fit at the
    # GEMV's registers): 40 x 8 = 320 programs at TP1, each with its next tile in flight (PREFETCH)
    bm = 1 if rows_hi <= 1 else 2 if rows_hi <= 2 else 4
    return GemvConfig(BM=bm, BN=16, BK=256, SPLIT=gemv_split(n, k, 16, 256, 1056), num_warps=4, PREFETCH=True)


CELLS = tuple(Cell(rows=(lo, hi), shape=(n, k), why=f"decode GEMV: {why}; rows {lo}-{hi}",
                   config={"gemm": _cfg(hi, n, k)})
              for (n, k), why in INDEX_SHAPES for lo, hi in ROWS)
INTERP_CELLS = (
    Cell(rows=(1, 1), shape=(64, 256), why="interpreter: BF16 GEMV, one row, split-K 2",
         config={"gemm": GemvConfig(BM=1, BN=16, BK=64, SPLIT=2)}),
    Cell(rows=(2, 4), shape=(64, 256), why="interpreter: BF16 GEMV, 2-4 rows (3 masked to 4), no split, no prefetch",
         config={"gemm": GemvConfig(BM=4, BN=32, BK=64, SPLIT=1, PREFETCH=False)}),
)


def warmup(device: torch.device) -> None:
    L.warmup_cells(CELLS, make_case, bf16_linear, device)


ENTRY = Entry(
    name="linear.bf16", kind="linear.bf16", raw_call=bf16_linear, reference=bf16_linear_reference,
    compare=compare, make_case=make_case, cells=CELLS, interp_cells=INTERP_CELLS, warmup=warmup,
    enabled=lambda: ENABLED, stock=bf16_linear_stock,
)
ENTRIES = (ENTRY,)
