"""Weight-decoding GEMM for prefill rows (>= 49): y[M, N] = x[M, K] @ W^T with W in NVFP4 / MXFP8 / FP8 decoded
in registers (exact bf16 tensor-core operands, fp32 accumulation), tiled over M as well as N, so a prefill chunk
reads each weight tile from HBM about once and never materialises a dequantized weight (the stock path
dequantizes the whole weight on every call).

Shape legend:
    x      [M, K]   bf16 activations, row stride stride_xm
    W      format-specific (see _decode), rows of N contiguous along K
    alpha  [N]      fp32 per-row epilogue factor, stride alpha_stride (0: a scalar)
    y      [M, N]   bf16

Schedule: program (m, n) computes the [BM, BN] tile through _wstream's dot_tile (weight tile [BN, BK] x the
token tile [BK, BM]), no split-K (M tiles fill the machine). Programs run in groups of GM M tiles with the N tile
outer: the GM programs that share an N tile read its weight tile once, and the group's GM x tiles stay in L2 while
the N tiles pass over them. The kernel does not specialise on M, so one compiled variant serves a whole cell.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from m3serve.kernels.formats._decode import to_bf16
from m3serve.kernels.formats._e2m1_ptx import use_ptx
from m3serve.kernels._jit import is_compiled, kernel_unspecialized
from m3serve.kernels.moe._grouped import swizzle
from m3serve.kernels.gemm._wstream import apply_alpha, dot_tile


@dataclass(frozen=True)
class TiledGemmConfig:
    BM: int
    BN: int = 128
    BK: int = 64
    GM: int = 8
    num_warps: int = 8
    num_stages: int = 3
    SPLIT: int = 1  # no split-K (_linear.make_workspace reads it: the workspace is then a stub)


@kernel_unspecialized("M")
def tiled_gemm(x_ptr, w_ptr, s_ptr, alpha_ptr, y_ptr, M, N, K, stride_xm, stride_ym, alpha_stride,
               FMT: tl.constexpr, ALPHA: tl.constexpr, GS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, GM: tl.constexpr, CUDA: tl.constexpr, PTX: tl.constexpr):
    """grid (cdiv(M, BM) * N / BN,)."""
    pid_m, pid_n = swizzle(tl.program_id(0), tl.cdiv(M, BM), N // BN, GM)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BN, BM], tl.float32)
    acc = dot_tile(acc, x_ptr, w_ptr, s_ptr, rn, rm, M, K, 0, K, stride_xm, FMT, GS, BM, BN, BK, CUDA, PTX)
    out = apply_alpha(tl.trans(acc), alpha_ptr, rn, alpha_stride, ALPHA)  # [BM, BN]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], to_bf16(out, CUDA),
             mask=rm[:, None] < M)


def launch_tiled_gemm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, alpha: torch.Tensor, alpha_stride: int,
                      out: torch.Tensor, *, fmt: int, alpha_mode: int, gs: int, n: int, k: int,
                      cfg: TiledGemmConfig) -> torch.Tensor:
    """The linear entries' raw calls hand their kernel views here for a TiledGemmConfig (any row count >= 1)."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k \
            or x.stride(1) != 1 or x.shape[0] < 1:
        raise ValueError(f"x: expected bf16 [M >= 1, {k}] with unit column stride, found "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    m = x.shape[0]
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (m, n) or out.stride(1) != 1 or out.device != x.device:
        raise ValueError(f"out: expected bf16 [{m}, {n}] with unit column stride on {x.device}, found {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if n % cfg.BN or k % cfg.BK or cfg.BK % gs:
        raise ValueError(f"shape (N={n}, K={k}): expected N % {cfg.BN} == 0, K % {cfg.BK} == 0 and BK % {gs} == 0 "
                         f"for config {cfg}")
    grid = (triton.cdiv(m, cfg.BM) * (n // cfg.BN),)
    tiled_gemm[grid](x, w, s, alpha, out, m, n, k, x.stride(0), out.stride(0), alpha_stride, FMT=fmt,
                     ALPHA=alpha_mode, GS=gs, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GM=cfg.GM, CUDA=is_compiled(x),
                     PTX=use_ptx(x), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
