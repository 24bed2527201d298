"""Weight-streaming GEMM shared by the linear entries: y[M, N] = x[M, K] @ W[N, K]^T.

Shape legend:
    x        [M, K]            bf16 activations, row stride stride_xm (unit column stride)
    W        format-specific, see formats/_decode.py (rows of N, contiguous along K)
    alpha    [N]               fp32 per-row post factor, read with stride alpha_stride (0: scalar)
    y        [M, N]            bf16, row stride stride_ym
    part     [SPLIT, BM, N]    fp32 split-K partial sums (workspace; unused when SPLIT == 1)
    count    [N / BN]          int32 arrival counters, zero between launches (workspace)

Schedule ("swap AB"): program (n, k) computes tl.dot(W_tile [BN, BK], x_tile^T [BK, BM]) over
its K slice, so the long N dimension feeds the MMA's M side and 1..48 tokens only pad the
narrow side (BM = 16/32/64). Tensor cores rather than CUDA-core FMAs do the multiply-adds:
compiled for sm_90 the NVFP4 loop body is ~4.8 instructions per weight element (ptxas output
read with m3serve.kernels.aot_check --sass-dir), against ~19 for a broadcast-multiply + tl.sum GEMV, whose reductions
compile to warp shuffles. The decoded tile is built directly in bf16 (_decode LOWP) and
multiplied by its group scale in bf16; e2m1*scale (q*2**e) is exact in bf16, so the MMA sees
exact operands and accumulates in fp32. Every weight byte is read exactly once per launch.

Split-K (SPLIT > 1) exists because N/BN tiles alone do not fill 132 SMs (N = 6144, BN = 64:
96 programs): the ticketed fixed-order reduction of gemm/_splitk.py (deterministic, counters reset
in-kernel).

PTX selects the inline-PTX NVFP4 decoder (formats/_e2m1_ptx.py; compiled only, same exact values).

ALPHA selects the per-row epilogue: 0 none, 1 multiply (FP8 decode scale), 2 divide (NVFP4
ENCODE global scale; acc * 2**8 / gs undoes the NVFP4 unit of _decode).
CUDA is True when compiled for the GPU. Interpreted runs (CUDA=False) take the dot on fp32
operands with ieee precision, because the Triton interpreter mis-computes tl.dot on bf16
operands; the values are identical because the decoded operands are exact in bf16.
"""

from __future__ import annotations

import triton.language as tl

from m3serve.kernels.formats._decode import (NVFP4_UNIT, load_w_groups, nvfp4_scale_offsets, nvfp4_word_offsets,
                                             to_bf16, x_cols)
from m3serve.kernels.formats._e2m1_ptx import nvfp4_words_scaled, scale_bf16_2_118
from m3serve.kernels._jit import helper, kernel
from m3serve.kernels._pdl import pdl_release, pdl_wait
from m3serve.kernels.gemm._splitk import ordered_sum, put_partial, release_ticket, take_ticket


@helper
def apply_alpha(acc, alpha_ptr, rn, alpha_stride, ALPHA: tl.constexpr):
    """acc [..., BN] fp32 with rows rn [BN] along the last axis -> acc with the row epilogue."""
    if ALPHA == 1:
        acc = acc * tl.load(alpha_ptr + rn * alpha_stride)
    elif ALPHA == 2:
        acc = (acc * NVFP4_UNIT) / tl.load(alpha_ptr + rn * alpha_stride)
    return acc


@helper
def load_w_tile(w_ptr, s_ptr, rn, k0, K, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                GS: tl.constexpr, CUDA: tl.constexpr, PTX: tl.constexpr, TILED: tl.constexpr = False):
    """Group-scaled weight tile [BN, BK] in x_cols order: bf16 compiled, fp32 interpreted.
    PTX (compiled NVFP4 only): the inline-PTX decoder of _e2m1_ptx (same values, fewer
    instructions); otherwise _decode's bit tricks and a separate group-scale multiply.
    TILED: NVFP4 / MXFP8 in the MMA tile layout (same values: only the addresses change)."""
    if FMT == 0 and PTX:
        kw = k0 // 8 + tl.arange(0, BK // 8)
        wd = tl.load(w_ptr + nvfp4_word_offsets(rn, kw, K, TILED))
        ks = k0 // 16 + tl.arange(0, BK // 16)
        sc = scale_bf16_2_118(tl.load(s_ptr + nvfp4_scale_offsets(rn, ks, K, TILED)), CUDA)
        return nvfp4_words_scaled(wd, sc, False)
    else:
        w, s = load_w_groups(w_ptr, s_ptr, rn, k0, K, FMT, BN, BK, GS, CUDA, CUDA, TILED)
        if FMT == 0 or FMT == 1:
            w = w * s[:, :, None]
        return w.reshape(BN, BK)


@helper
def x_tile(x_ptr, rm, M, k0, stride_xm, FMT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """x[rm, k0:k0+BK]^T as the [BK, BM] operand, in the column order of load_w_tile's tiles
    (rows rm >= M read as 0)."""
    mmask = rm[None, :] < M
    if FMT == 0:
        # contiguous (vectorisable) loads, then the pair-order permutation in registers:
        # position 2a + b of each 8 holds column a + 4b (= x_cols); a gather through x_cols
        # costs one 2-byte load per element
        kk = k0 + tl.arange(0, BK)
        xn = tl.load(x_ptr + rm[None, :] * stride_xm + kk[:, None], mask=mmask, other=0.0)
        xt = xn.reshape(BK // 8, 2, 4, BM).permute(0, 2, 1, 3).reshape(BK, BM)
    else:
        kk = x_cols(k0, BK, FMT)
        xt = tl.load(x_ptr + rm[None, :] * stride_xm + kk[:, None], mask=mmask, other=0.0)
    return xt


@helper
def mma(acc, w, xt, CUDA: tl.constexpr):
    """acc [BN, BM] += w [BN, BK] @ xt [BK, BM] (fp32 operands with ieee dots when interpreted)."""
    if CUDA:
        return tl.dot(w, xt, acc)
    else:
        return tl.dot(w, xt.to(tl.float32), acc, input_precision="ieee")


@helper
def dot_tile(acc, x_ptr, w_ptr, s_ptr, rn, rm, M, K, k_lo, k_hi, stride_xm, FMT: tl.constexpr,
             GS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CUDA: tl.constexpr,
             PTX: tl.constexpr, TILED: tl.constexpr = False):
    """acc [BN, BM] += W[rn, k_lo:k_hi] @ x[rm, k_lo:k_hi]^T (group-scaled, before alpha)."""
    for k0 in range(k_lo, k_hi, BK):
        w = load_w_tile(w_ptr, s_ptr, rn, k0, K, FMT, BN, BK, GS, CUDA, PTX, TILED)
        acc = mma(acc, w, x_tile(x_ptr, rm, M, k0, stride_xm, FMT, BM, BK), CUDA)
    return acc


@kernel
def wstream_gemm(x_ptr, w_ptr, s_ptr, alpha_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_ym,
                 alpha_stride, FMT: tl.constexpr, ALPHA: tl.constexpr, GS: tl.constexpr, SPLIT: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CUDA: tl.constexpr, PTX: tl.constexpr,
                 TILED: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_wait(PDL)  # before any global access (_pdl)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    k_len = K // SPLIT
    acc = tl.zeros([BN, BM], tl.float32)
    acc = dot_tile(acc, x_ptr, w_ptr, s_ptr, rn, rm, M, K, pid_k * k_len, (pid_k + 1) * k_len, stride_xm,
                   FMT, GS, BM, BN, BK, CUDA, PTX, TILED)
    pdl_release(PDL)  # the main loop is done: let the next kernel's CTAs in (_pdl)
    out = tl.trans(acc)  # [BM, BN]
    ymask = rm[:, None] < M
    if SPLIT == 1:
        out = apply_alpha(out, alpha_ptr, rn, alpha_stride, ALPHA)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], to_bf16(out, CUDA), mask=ymask)
    else:
        tile = rm[:, None] * N + rn[None, :]
        put_partial(part_ptr, pid_k, BM * N, tile, out, ymask)
        if take_ticket(count_ptr + pid_n, SPLIT):
            total = ordered_sum(part_ptr, BM * N, tile, ymask, SPLIT)
            total = apply_alpha(total, alpha_ptr, rn, alpha_stride, ALPHA)
            tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], to_bf16(total, CUDA), mask=ymask)
            release_ticket(count_ptr + pid_n)
