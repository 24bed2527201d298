"""Weight-decoding GEMM for prefill rows (>= 49): y[M, N] = x[M, K] @ W^T with W in NVFP4 / MXFP8 / FP8 decoded
in registers (exact bf16 tensor-core operands, fp32 accumulation), tiled over M as well as N, so a prefill chunk
reads each weight tile from HBM about once and (below 512 rows) never materialises a dequantized weight.

Shape legend:
    x      [M, K]   bf16 activations, row stride stride_xm
    W      format-specific (see _decode), rows of N contiguous along K
    alpha  [N]      fp32 per-row epilogue factor, stride alpha_stride (0: a scalar)
    y      [M, N]   bf16

Schedule: program (m, n) computes the [BM, BN] tile through _wstream's dot_tile (weight tile [BN, BK] x the
token tile [BK, BM]), no split-K (M tiles fill the machine). Programs run in groups of GM M tiles with the N tile
outer: the GM programs that share an N tile read its weight tile once, and the group's GM x tiles stay in L2 while
the N tiles pass over them. The kernel does not specialise on M, so one compiled variant serves a whole cell.

Long chunks (TiledGemmConfig.DEQUANT_MM, the cells from 512 rows): the weight is decoded ONCE per call into a bf16
scratch holding exactly the group-scaled values the tiles above multiply (NVFP4: e2m1 * scale * 2**-8, at most 6
significant bits; MXFP8: e4m3 * 2**e; FP8: e4m3 -- each exact in bf16), cuBLAS multiplies x by it with fp32
accumulation and fp32 output, and one epilogue launch applies the same per-row factor (apply_alpha) and rounds
once to bf16: the same operands, accumulation precision and single rounding as the tiled kernel, so the entry's
band is unchanged. Why: at these row counts the GEMM is compute-bound and cuBLAS's Hopper kernels run about
twice as fast as this Triton tile loop, while the decode costs one read of the packed weight and one write + read
of its bf16 form (~2.5 B per weight element, tens of microseconds per M3 linear against milliseconds of GEMM).
The scratch is one buffer per device, grown to the largest weight and row chunk seen (calls are stream-ordered).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from m3serve.kernels.formats._decode import to_bf16, x_cols
from m3serve.kernels.formats._e2m1_ptx import use_ptx
from m3serve.kernels._jit import is_compiled, kernel, kernel_unspecialized
from m3serve.kernels.moe._grouped import swizzle
from m3serve.kernels.gemm._wstream import apply_alpha, dot_tile, load_w_tile
from m3serve.kernels.gemm._gemm_tiles import check_tiled


@dataclass(frozen=True)
class TiledGemmConfig:
    BM: int
    BN: int = 128
    BK: int = 64
    GM: int = 8
    num_warps: int = 8
    num_stages: int = 3
    SPLIT: int = 1  # no split-K (_linear.make_workspace reads it: the workspace is then a stub)
    DEQUANT_MM: bool = False  # decode the weight to bf16 once, then cuBLAS (module docstring)
    MM_ROWS: int = 4096  # rows per cuBLAS call of the DEQUANT_MM path: bounds its fp32 scratch at MM_ROWS x N


@kernel_unspecialized("M")
def tiled_gemm(x_ptr, w_ptr, s_ptr, alpha_ptr, y_ptr, M, N, K, stride_xm, stride_ym, alpha_stride,
               FMT: tl.constexpr, ALPHA: tl.constexpr, GS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, GM: tl.constexpr, CUDA: tl.constexpr, PTX: tl.constexpr, TILED: tl.constexpr):
    """grid (cdiv(M, BM) * N / BN,). TILED: NVFP4 / MXFP8 weights in the MMA tile layout."""
    pid_m, pid_n = swizzle(tl.program_id(0), tl.cdiv(M, BM), N // BN, GM)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BN, BM], tl.float32)
    acc = dot_tile(acc, x_ptr, w_ptr, s_ptr, rn, rm, M, K, 0, K, stride_xm, FMT, GS, BM, BN, BK, CUDA, PTX, TILED)
    out = apply_alpha(tl.trans(acc), alpha_ptr, rn, alpha_stride, ALPHA)  # [BM, BN]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], to_bf16(out, CUDA),
             mask=rm[:, None] < M)


def launch_tiled_gemm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, alpha: torch.Tensor, alpha_stride: int,
                      out: torch.Tensor, *, fmt: int, alpha_mode: int, gs: int, n: int, k: int,
                      cfg: TiledGemmConfig, tiled: bool = False) -> torch.Tensor:
    """The linear entries' raw calls hand their kernel views here for a TiledGemmConfig (any row count >= 1).
    tiled: NVFP4 / MXFP8 weights in the MMA tile layout (m3serve.quant.tiles)."""
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
    check_tiled(tiled, fmt, n, k)
    if cfg.DEQUANT_MM:
        return _dequant_mm(x, w, s, alpha, alpha_stride, out, fmt=fmt, alpha_mode=alpha_mode, gs=gs, n=n, k=k,
                           cfg=cfg, tiled=tiled)
    grid = (triton.cdiv(m, cfg.BM) * (n // cfg.BN),)
    tiled_gemm[grid](x, w, s, alpha, out, m, n, k, x.stride(0), out.stride(0), alpha_stride, FMT=fmt,
                     ALPHA=alpha_mode, GS=gs, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GM=cfg.GM, CUDA=is_compiled(x),
                     PTX=use_ptx(x), TILED=tiled, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


@kernel
def dequant_weight(w_ptr, s_ptr, wb_ptr, K, FMT: tl.constexpr, GS: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, CUDA: tl.constexpr, PTX: tl.constexpr, TILED: tl.constexpr):
    """grid (N / BN, K / BK): wb[N, K] bf16 = the group-scaled weight tile values, in natural column order
    (row-major whatever the layout the weight is read in: cuBLAS reads it next)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    w = load_w_tile(w_ptr, s_ptr, rn, k0, K, FMT, BN, BK, GS, CUDA, PTX, TILED)  # [BN, BK], columns in x_cols order
    cols = x_cols(k0, BK, FMT)
    tl.store(wb_ptr + rn.to(tl.int64)[:, None] * K + cols[None, :], to_bf16(w.to(tl.float32), CUDA))


@kernel_unspecialized("M")
def alpha_epilogue(y_ptr, alpha_ptr, out_ptr, M, N, stride_om, alpha_stride, ALPHA: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, CUDA: tl.constexpr):
    """grid (cdiv(M, BM), N / BN): out[M, N] bf16 = apply_alpha(y[M, N] fp32), one rounding."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = rm[:, None] < M
    y = tl.load(y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], mask=mask, other=0.0)
    y = apply_alpha(y, alpha_ptr, rn, alpha_stride, ALPHA)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], to_bf16(y, CUDA), mask=mask)


_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []   # outgrown scratch buffers a captured CUDA graph may still address
_keep_outgrown = False


def keep_outgrown_scratch() -> None:
    """From now on an outgrown scratch buffer stays allocated: a CUDA graph captured on it (runtime/prefill_graphs.py,
    whose steps from 512 rows take the DEQUANT_MM path) replays the addresses it recorded, while later eager calls
    (a longer chunk, the MoE's decode-once band) grow the scratch into a new buffer. Freed, the old one would be
    handed to other tensors and the graph would write into them."""
    global _keep_outgrown
    _keep_outgrown = True


def _scratch(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The device's scratch of `dtype`, at least `numel` elements (grown, never shrunk). Process-wide, so it is
    made outside inference mode: an inference tensor (made inside an engine step) could not be written later by a
    call outside it (the next LLM's routing warm-up in the same process)."""
    buf = _SCRATCH.get((device, dtype))
    if buf is None or buf.numel() < numel:
        if buf is not None and _keep_outgrown:
            _RETIRED.append(buf)
        with torch.inference_mode(False):
            buf = _SCRATCH[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def held_scratch(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor | None:
    """The first `numel` elements of the scratch already allocated, or None when it is smaller (nothing is
    allocated: for callers that may use it only within what start-up reserved)."""
    buf = _SCRATCH.get((device, dtype))
    return buf[:numel] if buf is not None and buf.numel() >= numel else None


def _dequant_mm(x, w, s, alpha, alpha_stride, out, *, fmt, alpha_mode, gs, n, k, cfg, tiled) -> torch.Tensor:
    m, compiled = x.shape[0], is_compiled(x)
    bn, bk = 64, 128 if k % 128 == 0 else cfg.BK
    if n % bn or k % bk or bk % gs:
        raise ValueError(f"shape (N={n}, K={k}): the weight decode needs N % {bn} == 0, K % {bk} == 0")
    wb = _scratch(x.device, torch.bfloat16, n * k).view(n, k)
    dequant_weight[(n // bn, k // bk)](w, s, wb, k, FMT=fmt, GS=gs, BN=bn, BK=bk, CUDA=compiled, PTX=use_ptx(x),
                                       TILED=tiled, num_warps=4)
    rows = max(1, min(cfg.MM_ROWS, m))
    y = None if alpha_mode == 0 and compiled else _scratch(x.device, torch.float32, rows * n).view(rows, n)
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        if y is None:  # no row factor: cuBLAS's fp32 accumulator is rounded once, into out
            torch.mm(x[r0:r1], wb.T, out=out[r0:r1])
            continue
        yr = y[: r1 - r0]
        if compiled:
            torch.mm(x[r0:r1], wb.T, out_dtype=torch.float32, out=yr)
        else:  # CPU (interpreter tests): the same exact operands, fp32 products and sums
            torch.mm(x[r0:r1].float(), wb.float().T, out=yr)
        alpha_epilogue[(triton.cdiv(r1 - r0, 64), n // 64)](yr, alpha, out[r0:r1], r1 - r0, n, out.stride(0),
                                                           alpha_stride, ALPHA=alpha_mode, BM=64, BN=64,
                                                           CUDA=compiled, num_warps=4)
    return out
