"""Tile config, split-K workspace and argument checks shared by the three weight-streaming GEMMs (_wstream
through _linear.launch_gemm, _gemv, _mma_gemv): one workspace layout and one set of checks for all three.

Shape legend:
    x      [M, K]            bf16, M = rows (tokens in the step), unit column stride
    out    [M, N]            bf16, unit column stride
    part   [SPLIT * BM * N]  fp32 split-K partials (GemmWorkspace)
    count  [N / BN]          int32 split-K arrival counters, zero between launches
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3serve.kernels.catalog import check_tensor


@dataclass(frozen=True)
class GemmConfig:
    BM: int
    BN: int
    BK: int
    SPLIT: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass
class GemmWorkspace:
    part: torch.Tensor
    count: torch.Tensor


def make_workspace(cfg: GemmConfig, n: int, device: torch.device) -> GemmWorkspace:
    """Per call site, allocated once (before graph capture); the counters must start at zero and
    are left at zero by every completed launch. Two launches in flight at once (two streams)
    must not share a workspace."""
    part = torch.empty(max(cfg.SPLIT, 1) * cfg.BM * n if cfg.SPLIT > 1 else 1, dtype=torch.float32, device=device)
    count = torch.zeros(max(n // cfg.BN, 1), dtype=torch.int32, device=device)
    return GemmWorkspace(part=part, count=count)


def check_gemm_args(x: torch.Tensor, out: torch.Tensor, n: int, k: int, cfg: GemmConfig, ws: GemmWorkspace) -> int:
    check_tensor("x", x, torch.bfloat16)
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x: expected [M, {k}] with unit column stride, found shape {tuple(x.shape)} "
                         f"strides {tuple(x.stride())}")
    m = x.shape[0]
    if not 1 <= m <= cfg.BM:
        raise ValueError(f"x: this config (BM={cfg.BM}) serves 1..{cfg.BM} rows, found M={m}")
    check_tensor("out", out, torch.bfloat16, (m, n), x.device)
    if out.stride(1) != 1:
        raise ValueError(f"out: expected unit column stride, found strides {tuple(out.stride())}")
    if n % cfg.BN or k % (cfg.BK * cfg.SPLIT):
        raise ValueError(f"shape (N={n}, K={k}): expected N % {cfg.BN} == 0 and K % {cfg.BK * cfg.SPLIT} == 0 "
                         f"for config {cfg}")
    if cfg.SPLIT > 1:
        check_tensor("workspace.part", ws.part, torch.float32)
        if ws.part.numel() < cfg.SPLIT * cfg.BM * n:
            raise ValueError(f"workspace.part: expected >= {cfg.SPLIT * cfg.BM * n} fp32, found {ws.part.numel()}")
        check_tensor("workspace.count", ws.count, torch.int32)
        if ws.count.numel() < n // cfg.BN:
            raise ValueError(f"workspace.count: expected >= {n // cfg.BN} int32, found {ws.count.numel()}")
    return m


def check_tiled(tiled: bool, fmt: int, n: int | None = None, k: int | None = None) -> None:
    """Raise unless a `tiled` weight is one the MMA tile layout defines: NVFP4 or MXFP8 (formats 0, 1),
    N % 16 == 0 and K % 128 == 0 (m3serve.quant.tiles)."""
    if not tiled:
        return
    if fmt not in (0, 1):
        raise ValueError(f"tiled: the MMA tile layout is defined for NVFP4 and MXFP8 weights, found format {fmt}")
    if (n is not None and n % 16) or (k is not None and k % 128):
        raise ValueError(f"tiled: the MMA tile layout needs N % 16 == 0 and K % 128 == 0, found N={n}, K={k}")
