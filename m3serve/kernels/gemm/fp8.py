"""Catalog entry linear.fp8: y[M, N] = (x[M, K] @ q^T) * scale with per-tensor FP8 E4M3 weights
(E4M3 is a subset of bf16: exact bf16 MMA operands, fp32 accumulation, scale in the epilogue).

Shape legend:
    x      [M, K]   bf16 activations (M = 1..48 tokens)
    q      [N, K]   float8_e4m3fn
    scale  []       fp32 DECODE scale, W = q * scale (m3serve.quant.fp8); a [N] vector is also
                    accepted (one scale per output row: the fused projection entry)
    out    [M, N]   bf16
"""

from __future__ import annotations

import torch

from m3serve.kernels.gemm._gemm_tiles import make_workspace
from m3serve.kernels.gemm import _linear as L
from m3serve.kernels.formats._decode import FMT_FP8
from m3serve.kernels.gemm._tiled import TiledGemmConfig, launch_tiled_gemm
from m3serve.kernels.catalog import Case, Cell, Entry, assert_band, check_tensor, gemm_band, poisoned, true_fp32
from m3serve.kernels.gemm.mxfp8 import random_e4m3
from m3serve.quant.fp8 import dequantize_fp8

ENABLED = True  # the one switch: False sends every linear.fp8 call down the stock path


def check_fp8_weight(q: torch.Tensor, scale: torch.Tensor, n: int, k: int, device: torch.device, prefix: str = "") -> int:
    check_tensor(f"{prefix}q", q, torch.float8_e4m3fn, (n, k))
    if not q.is_contiguous():
        raise ValueError(f"{prefix}q: expected a contiguous tensor")
    check_tensor(f"{prefix}scale", scale, torch.float32, device=device)
    if scale.numel() not in (1, n) or scale.dim() > 1:
        raise ValueError(f"{prefix}scale: expected a 0-dim/1-element or [{n}] tensor, found {tuple(scale.shape)}")
    return 1 if scale.numel() == n and n > 1 else 0


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
               workspace: L.GemmWorkspace, config: L.GemmConfig | TiledGemmConfig) -> torch.Tensor:
    """Raw call. Writes and returns `out`."""
    n, k = q.shape
    stride = check_fp8_weight(q, scale, n, k, x.device)
    if isinstance(config, TiledGemmConfig):  # prefill rows (linear.fp8.tiled, gemm/_tiled.py), same contract
        return launch_tiled_gemm(x, q.view(torch.uint8), scale, scale, stride, out, fmt=FMT_FP8, alpha_mode=1,
                                 gs=16, n=n, k=k, cfg=config)
    return L.launch_gemm(x, q.view(torch.uint8), scale, scale, stride, out, workspace,
                         fmt=FMT_FP8, alpha_mode=1, gs=16, n=n, k=k, cfg=config)


def _dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if scale.numel() > 1:
        return q.float() * scale.reshape(-1, 1)
    return dequantize_fp8(q, scale.reshape(()))


def fp8_linear_reference(x, q, scale, out=None, workspace=None, config=None) -> torch.Tensor:
    """fp32 [M, N] = x.float() @ (q.float() * scale).T in true fp32."""
    with true_fp32():
        return x.float() @ _dequant(q, scale).T


def fp8_linear_stock(x, q, scale, out=None, workspace=None, config=None) -> torch.Tensor:
    return x @ _dequant(q, scale).to(torch.bfloat16).T


def compare(out: torch.Tensor, ref: torch.Tensor, case: Case) -> None:
    """Band: gemm_band (one bf16 ulp + 2*K*u*sum|x*w|), plus one fp32 rounding of the scale
    product (kernel scales the sum, the reference each weight): 2u * sum|x*w|, inside the band."""
    x, q, scale = case.args[:3]
    with true_fp32():
        absprod = x.float().abs() @ _dequant(q, scale).abs().T
    assert_band("linear.fp8", out, ref, gemm_band(ref, absprod, x.shape[1] + 1))


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    n, k = cell.shape
    cfg: L.GemmConfig = cell.config["gemm"]
    q = random_e4m3((n, k), gen, device)
    s = 1.0 if gen is None else float(1e-4 + 1e-2 * torch.rand((), generator=gen))
    scale = torch.tensor(s, dtype=torch.float32, device=device)
    x = L.fresh_x(rows, k, device, gen)
    out = poisoned((rows, n), torch.bfloat16, device)
    ws = make_workspace(cfg, n, device)
    return Case(args=(x, q, scale, out, ws, cfg), kwargs={}, bytes_moved=n * k + rows * k * 2 + rows * n * 2)


CELLS = L.linear_cells(1.0)
INTERP_CELLS = L.interp_cells(((128, 256),))


def warmup(device: torch.device) -> None:
    L.warmup_cells(CELLS, make_case, fp8_linear, device)


ENTRY = Entry(
    name="linear.fp8", kind="linear.fp8", raw_call=fp8_linear, reference=fp8_linear_reference,
    compare=compare, make_case=make_case, cells=CELLS, interp_cells=INTERP_CELLS, warmup=warmup,
    enabled=lambda: ENABLED, stock=fp8_linear_stock,
)
ENTRIES = (ENTRY,)
