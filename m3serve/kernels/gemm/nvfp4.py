"""Catalog entry linear.nvfp4: y[M, N] = x[M, K] @ W^T with W in NVFP4, read once, decoded in
registers (H200 has no FP4 tensor cores), bf16 tensor-core MMA, fp32 accumulation.

Shape legend:
    x             [M, K]      bf16 activations (M = 1..48 tokens)
    packed        [N, K/2]    uint8, column 2j in the low nibble (m3serve.quant.nvfp4)
    block_scale   [N, K/16]   float8_e4m3fn
    global_scale  []          fp32 ENCODE scale: W = e2m1 * block_scale / global_scale
    out           [M, N]      bf16 (poisoned by tests; fully written)
"""

from __future__ import annotations

import torch

from m3serve.kernels.gemm._gemm_tiles import make_workspace
from m3serve.kernels.gemm import _linear as L
from m3serve.kernels.formats._decode import FMT_NVFP4
from m3serve.kernels.gemm._gemv import GemvConfig, launch_gemv
from m3serve.kernels._jit import is_compiled
from m3serve.kernels.gemm._mma_gemv import MmaGemvConfig, interpreted_config, launch_mma_gemv
from m3serve.kernels.gemm._tiled import TiledGemmConfig, launch_tiled_gemm
from m3serve.kernels.catalog import (Case, Cell, Entry, assert_band, check_tensor, device_rng, gemm_band, poisoned,
                                     true_fp32)
from m3serve.quant.nvfp4 import dequantize_nvfp4, tile_nvfp4, untile_nvfp4
from m3serve.quant.tiles import tileable

ENABLED = True  # the one switch: False sends every linear.nvfp4 call down the stock path

WEIGHT_BYTES = 0.5 + 1.0 / 16  # E2M1 + one E4M3 scale per 16


def check_nvfp4_weight(packed: torch.Tensor, block_scale: torch.Tensor, n: int, k: int, prefix: str = "") -> None:
    check_tensor(f"{prefix}packed", packed, torch.uint8, (n, k // 2))
    check_tensor(f"{prefix}block_scale", block_scale, torch.float8_e4m3fn, (n, k // 16))
    if not packed.is_contiguous() or not block_scale.is_contiguous():
        raise ValueError(f"{prefix}packed/block_scale: expected contiguous tensors")
    if packed.data_ptr() % 16:
        raise ValueError(f"{prefix}packed: expected a 16-byte aligned base (read as int32 words), "
                         f"found address % 16 = {packed.data_ptr() % 16}")


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                 out: torch.Tensor, workspace: L.GemmWorkspace, config: L.GemmConfig | GemvConfig | MmaGemvConfig | TiledGemmConfig,
                 tiled: bool = False) -> torch.Tensor:
    """Raw call. Writes and returns `out`. `global_scale` may also be a [N] fp32 vector (one
    ENCODE scale per output row; used by the fused projection entry). tiled: packed / block_scale are in
    the MMA tile layout (m3serve.quant.nvfp4.tile_nvfp4), the layout the target holds them in; every
    config reads it."""
    n, k = packed.shape[0], packed.shape[1] * 2
    check_nvfp4_weight(packed, block_scale, n, k)
    check_tensor("global_scale", global_scale, torch.float32, device=x.device)
    if global_scale.numel() not in (1, n) or global_scale.dim() > 1:
        raise ValueError(f"global_scale: expected a 0-dim/1-element or [{n}] tensor, found {tuple(global_scale.shape)}")
    stride = 1 if global_scale.numel() == n and n > 1 else 0
    w, s = packed.view(torch.int32), block_scale.view(torch.uint8)
    if isinstance(config, TiledGemmConfig):  # prefill rows (linear.nvfp4.tiled, gemm/_tiled.py), same contract
        return launch_tiled_gemm(x, w, s, global_scale, stride, out, fmt=FMT_NVFP4, alpha_mode=2, gs=16, n=n, k=k,
                                 cfg=config, tiled=tiled)
    if isinstance(config, GemvConfig):  # decode GEMV for 1-4 rows (gemm/_gemv.py), same contract
        return launch_gemv(x, w, s, global_scale, stride, out, workspace, fmt=FMT_NVFP4, alpha_mode=2, gs=16, n=n,
                           k=k, cfg=config, tiled=tiled)
    if isinstance(config, MmaGemvConfig):  # register-operand MMA GEMV for 1-8 rows (gemm/_mma_gemv.py)
        if is_compiled(x):
            return launch_mma_gemv(x, w, s, global_scale, stride, out, workspace, fmt=FMT_NVFP4, alpha_mode=2, n=n,
                                   k=k, cfg=config, tiled=tiled)
        config = interpreted_config(config)  # CPU: the same tiles through the interpreted _wstream kernel
    return L.launch_gemm(x, w, s, global_scale, stride, out, workspace, fmt=FMT_NVFP4, alpha_mode=2, gs=16, n=n, k=k,
                         cfg=config, tiled=tiled)


def _dequant(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
             tiled: bool = False) -> torch.Tensor:
    if tiled:
        packed, block_scale = untile_nvfp4(packed, block_scale)
    if global_scale.numel() > 1:  # per-row ENCODE scales (fused projection)
        return dequantize_nvfp4(packed, block_scale, torch.ones((), device=packed.device)) / global_scale[:, None]
    return dequantize_nvfp4(packed, block_scale, global_scale.reshape(()))


def nvfp4_linear_reference(x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor,
                           global_scale: torch.Tensor, out: torch.Tensor | None = None,
                           workspace: L.GemmWorkspace | None = None, config: L.GemmConfig | None = None,
                           tiled: bool = False) -> torch.Tensor:
    """fp32 [M, N] = x.float() @ dequantize_nvfp4(W).T in true fp32 (the contract)."""
    with true_fp32():
        return x.float() @ _dequant(packed, block_scale, global_scale, tiled).T


def nvfp4_linear_stock(x, packed, block_scale, global_scale, out=None, workspace=None, config=None,
                       tiled: bool = False) -> torch.Tensor:
    """The path without this kernel: dequantize to bf16, then a bf16 GEMM (benchmark only)."""
    w = _dequant(packed, block_scale, global_scale, tiled).to(torch.bfloat16)
    return x @ w.T


def compare(out: torch.Tensor, ref: torch.Tensor, case: Case) -> None:
    """Band: gemm_band (one bf16 ulp of the reference + 2*K*u*sum|x*w| for fp32 summation
    order). The decoded weights are exact, so nothing else may differ."""
    x, packed, block_scale, global_scale = case.args[:4]
    with true_fp32():
        absprod = x.float().abs() @ _dequant(packed, block_scale, global_scale, case.kwargs.get("tiled", False)).abs().T
    assert_band("linear.nvfp4", out, ref, gemm_band(ref, absprod, x.shape[1]))


def random_nvfp4_weight(n: int, k: int, device: torch.device, gen: torch.Generator | None) -> tuple[torch.Tensor, ...]:
    """Uniform random codes (all 16 E2M1 codes, -0 included), random finite non-negative E4M3
    block scales (subnormals and 0 included) and a realistic ENCODE scale 2688 / amax.
    gen=None gives zero-filled tensors of the same shapes (warmup: compile only)."""
    if gen is None:
        return (torch.zeros(n, k // 2, dtype=torch.uint8, device=device),
                torch.zeros(n, k // 16, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn),
                torch.ones((), dtype=torch.float32, device=device))
    g = device_rng(gen, device)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8, device=device)
    scale = torch.randint(0, 0x7F, (n, k // 16), generator=g, dtype=torch.uint8, device=device)
    amax = 0.05 + 2.0 * torch.rand((), generator=gen)
    gs = torch.tensor(448.0 * 6.0, dtype=torch.float32) / amax
    return packed, scale.view(torch.float8_e4m3fn), gs.to(device)


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    n, k = cell.shape
    cfg: L.GemmConfig = cell.config["gemm"]
    packed, scale, gs = random_nvfp4_weight(n, k, device, gen)
    tiled = tileable("nvfp4", packed, scale)
    if tiled:  # the layout the target holds the weight in
        packed, scale = tile_nvfp4(packed, scale)
    x = L.fresh_x(rows, k, device, gen)
    out = poisoned((rows, n), torch.bfloat16, device)
    ws = make_workspace(cfg, n, device)
    return Case(args=(x, packed, scale, gs, out, ws, cfg), kwargs={"tiled": tiled},
                bytes_moved=n * k // 2 + n * k // 16 + rows * k * 2 + rows * n * 2)


# Rows 1-8: the register-operand MMA GEMV reading the MMA tile layout, whose cost does not grow with the rows (the
# 8 token columns ride in one MMA). Rows 2-8 row-major: 1.5-3.3x the tensor-core cells at 4 / 8 rows
# (bench/results/gemv_variants/gemv_variants-h200-mma-2026-12-01.json, family r1w4s2c1056). Row 1: in the tile
# layout it is ahead of the CUDA-core GEMV on row-major weights (g16x512w4, the former row-1 cell) on all six M3
# shapes, 10.6-36.4 us against 10.7-40.3 us (bench/results/tiled_layout/tiled-layout-h200.json). The GEMV family
# stays defined for the benches' comparisons (the GEMV reads either layout).
GEMV_FAMILY = {"BN": 16, "BK": 512, "num_warps": 4, "programs": 528, "PREFETCH": True, "num_stages": 1}
GEMV_ROWS = ()
MMA_FAMILY = {"RP": 1, "num_warps": 4, "STAGES": 2, "ctas": 1056}
MMA_ROWS = (1, 8)
CELLS = L.decode_linear_cells(WEIGHT_BYTES, GEMV_FAMILY, GEMV_ROWS, mma=MMA_FAMILY, mma_rows=MMA_ROWS)
INTERP_CELLS = L.interp_cells(((128, 256),), mma=True)


def warmup(device: torch.device) -> None:
    L.warmup_cells(CELLS, make_case, nvfp4_linear, device)


ENTRY = Entry(
    name="linear.nvfp4", kind="linear.nvfp4", raw_call=nvfp4_linear, reference=nvfp4_linear_reference,
    compare=compare, make_case=make_case, cells=CELLS, interp_cells=INTERP_CELLS, warmup=warmup,
    enabled=lambda: ENABLED, stock=nvfp4_linear_stock,
)
ENTRIES = (ENTRY,)
