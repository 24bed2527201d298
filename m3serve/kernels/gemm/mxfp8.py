"""Catalog entry linear.mxfp8: y[M, N] = x[M, K] @ W^T with W in MXFP8 (E4M3 + one E8M0 scale
per 32 columns), read once, decoded to bf16 in registers (q * 2**e is exact in bf16),
bf16 tensor-core MMA, fp32 accumulation.

Shape legend:
    x      [M, K]      bf16 activations (M = 1..48 tokens)
    q      [N, K]      float8_e4m3fn
    scale  [N, K/32]   uint8 E8M0: W = q * 2**(scale - 127) (m3serve.quant.mxfp8)
    out    [M, N]      bf16
"""

from __future__ import annotations

import torch

from m3serve.kernels.gemm._gemm_tiles import make_workspace
from m3serve.kernels.gemm import _linear as L
from m3serve.kernels.formats._decode import FMT_MXFP8
from m3serve.kernels.gemm._gemv import GemvConfig, launch_gemv
from m3serve.kernels._jit import is_compiled
from m3serve.kernels.gemm._mma_gemv import MmaGemvConfig, interpreted_config, launch_mma_gemv
from m3serve.kernels.gemm._tiled import TiledGemmConfig, launch_tiled_gemm
from m3serve.kernels.catalog import (Case, Cell, Entry, assert_band, check_tensor, device_rng, gemm_band, poisoned,
                                     true_fp32)
from m3serve.quant.mxfp8 import dequantize_mxfp8, tile_mxfp8, untile_mxfp8
from m3serve.quant.tiles import tileable

ENABLED = True  # the one switch: False sends every linear.mxfp8 call down the stock path

WEIGHT_BYTES = 1.0 + 1.0 / 32


def check_mxfp8_weight(q: torch.Tensor, scale: torch.Tensor, n: int, k: int, prefix: str = "") -> None:
    check_tensor(f"{prefix}q", q, torch.float8_e4m3fn, (n, k))
    check_tensor(f"{prefix}scale", scale, torch.uint8, (n, k // 32))
    if k % 32:
        raise ValueError(f"{prefix}q: expected K % 32 == 0 (whole MX blocks), found K={k}")
    if not q.is_contiguous() or not scale.is_contiguous():
        raise ValueError(f"{prefix}q/scale: expected contiguous tensors")


_ONE: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    # alpha is unused for MXFP8 (ALPHA=0) but the kernel still takes a pointer
    t = _ONE.get(device)
    if t is None:
        t = _ONE[device] = torch.ones(1, dtype=torch.float32, device=device)
    return t


def mxfp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                 workspace: L.GemmWorkspace, config: L.GemmConfig | GemvConfig | MmaGemvConfig,
                 tiled: bool = False) -> torch.Tensor:
    """Raw call. Writes and returns `out`. A GemvConfig selects the decode GEMV (gemm/_gemv.py). tiled: q / scale
    are in the MMA tile layout (m3serve.quant.mxfp8.tile_mxfp8), the layout the target holds them in; every config
    reads it."""
    n, k = q.shape
    check_mxfp8_weight(q, scale, n, k)
    qb = q.view(torch.uint8)
    if isinstance(config, TiledGemmConfig):  # prefill rows (linear.mxfp8.tiled, gemm/_tiled.py), same contract
        return launch_tiled_gemm(x, qb, scale, _one(x.device), 0, out, fmt=FMT_MXFP8, alpha_mode=0, gs=32, n=n, k=k,
                                 cfg=config, tiled=tiled)
    if isinstance(config, GemvConfig):  # decode GEMV for 1-4 rows (gemm/_gemv.py), same contract
        return launch_gemv(x, qb, scale, _one(x.device), 0, out, workspace, fmt=FMT_MXFP8, alpha_mode=0, gs=32, n=n,
                           k=k, cfg=config, tiled=tiled)
    if isinstance(config, MmaGemvConfig):  # register-operand MMA GEMV for 1-8 rows (gemm/_mma_gemv.py)
        if is_compiled(x):
            if q.data_ptr() % 16:
                raise ValueError(f"q: the MMA GEMV reads 16-byte vectors; expected a 16-byte aligned base, found "
                                 f"address % 16 = {q.data_ptr() % 16}")
            return launch_mma_gemv(x, qb, scale, _one(x.device), 0, out, workspace, fmt=FMT_MXFP8, alpha_mode=0, n=n,
                                   k=k, cfg=config, tiled=tiled)
        config = interpreted_config(config)  # CPU: the same tiles through the interpreted _wstream kernel
    return L.launch_gemm(x, qb, scale, _one(x.device), 0, out, workspace, fmt=FMT_MXFP8, alpha_mode=0, gs=32, n=n,
                         k=k, cfg=config, tiled=tiled)


def _dequant(q: torch.Tensor, scale: torch.Tensor, tiled: bool = False, dtype=torch.float32) -> torch.Tensor:
    if tiled:
        q, scale = untile_mxfp8(q, scale)
    return dequantize_mxfp8(q, scale, dtype)


def mxfp8_linear_reference(x, q, scale, out=None, workspace=None, config=None, tiled: bool = False) -> torch.Tensor:
    """fp32 [M, N] = x.float() @ dequantize_mxfp8(q, scale).T in true fp32."""
    with true_fp32():
        return x.float() @ _dequant(q, scale, tiled).T


def mxfp8_linear_stock(x, q, scale, out=None, workspace=None, config=None, tiled: bool = False) -> torch.Tensor:
    return x @ _dequant(q, scale, tiled, torch.bfloat16).T


def compare(out: torch.Tensor, ref: torch.Tensor, case: Case) -> None:
    """Band: gemm_band (one bf16 ulp + 2*K*u*sum|x*w|); the decoded weights are exact."""
    x, q, scale = case.args[:3]
    with true_fp32():
        absprod = x.float().abs() @ _dequant(q, scale, case.kwargs.get("tiled", False)).abs().T
    assert_band("linear.mxfp8", out, ref, gemm_band(ref, absprod, x.shape[1]))


def random_e4m3(shape: tuple[int, ...], gen: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """All finite E4M3 codes (both signs, subnormals, +-0) uniformly; never the NaN codes."""
    if gen is None:
        return torch.zeros(shape, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    b = torch.randint(0, 254, shape, generator=device_rng(gen, device), dtype=torch.int32, device=device)
    b = torch.where(b >= 0x7F, b + 1, b)  # skip 0x7F; 254 values -> 0..0xFE without 0x7F/0xFF
    return b.to(torch.uint8).view(torch.float8_e4m3fn)


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    n, k = cell.shape
    cfg: L.GemmConfig = cell.config["gemm"]
    q = random_e4m3((n, k), gen, device)
    if gen is None:
        scale = torch.full((n, k // 32), 127, dtype=torch.uint8, device=device)
    else:  # 2**-17 .. 2**8: the range real MXFP8 checkpoints use, extremes included
        scale = torch.randint(110, 136, (n, k // 32), generator=device_rng(gen, device), dtype=torch.uint8, device=device)
    tiled = tileable("mxfp8", q, scale)
    if tiled:  # the layout the target holds the weight in (every config reads it)
        q, scale = tile_mxfp8(q, scale)
    x = L.fresh_x(rows, k, device, gen)
    out = poisoned((rows, n), torch.bfloat16, device)
    ws = make_workspace(cfg, n, device)
    return Case(args=(x, q, scale, out, ws, cfg), kwargs={"tiled": tiled},
                bytes_moved=n * k + n * k // 32 + rows * k * 2 + rows * n * 2)


# Rows 1-2: the GEMV measured 1.42x / 1.19x faster than the tensor-core cell (family g32x256w4s3); at 3-4
# rows the tensor-core cell wins (H200, bench/results/gemv_variants/gemv_variants-h200-2026-11-30.json).
# Rows 3-8 with K >= 4096: the register-operand MMA GEMV, 1.02-1.5x the tensor-core cells at 4 / 8 rows; at
# K = 3072 it measured 0.88-0.92x, so those shapes keep the tensor-core cells (gemv_variants-h200-mma-2026-12-01.json,
# family r1w4s2c1056), capped at 80 registers a thread: compiled as is the MXFP8 step takes 85 (5 CTAs of 4 warps an
# SM), so the 768 CTAs of o_proj and the dense MLP shapes ran 1.16 waves; at 80 (no spill; 72 spills) 6 fit and
# they run in one (python -m m3serve.kernels.aot_check --entry linear.mxfp8 --waves 8). The rows-1-2 GEMV splits K
# toward 1056 programs (8 an SM; it holds 9 at 56 registers), from 528: the fused q|k|v|index projection 2 ways and
# o_proj 4, twice as many loads in flight; in minimax-m3:12's decode step 26.5 against 29.2 us a launch at one row
# (H100, decode/decode-target-h100-m3_12-gemv-split-stages.json, route target-gemv-split2x).
GEMV_FAMILY = {"BN": 32, "BK": 256, "num_warps": 4, "programs": 1056, "PREFETCH": False, "num_stages": 3}
GEMV_ROWS = ((1, 1), (2, 2))
MMA_FAMILY = {"RP": 1, "num_warps": 4, "STAGES": 2, "ctas": 1056, "min_k": 4096, "maxnreg": 80}
MMA_ROWS = (3, 8)
CELLS = L.decode_linear_cells(WEIGHT_BYTES, GEMV_FAMILY, GEMV_ROWS, mma=MMA_FAMILY, mma_rows=MMA_ROWS)
INTERP_CELLS = L.interp_cells(((128, 256),), mma=True)


def warmup(device: torch.device) -> None:
    L.warmup_cells(CELLS, make_case, mxfp8_linear, device)


ENTRY = Entry(
    name="linear.mxfp8", kind="linear.mxfp8", raw_call=mxfp8_linear, reference=mxfp8_linear_reference,
    compare=compare, make_case=make_case, cells=CELLS, interp_cells=INTERP_CELLS, warmup=warmup,
    enabled=lambda: ENABLED, stock=mxfp8_linear_stock,
)
ENTRIES = (ENTRY,)
