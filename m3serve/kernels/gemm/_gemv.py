"""Decode GEMV for 1-4 rows: y[M, N] = x[M, K] @ W[N, K]^T on CUDA cores, W in NVFP4, MXFP8 or BF16.

Shape legend:
    x        [M, K]            bf16 activations, M = 1..BM (BM in 1, 2, 4), unit column stride
    W        NVFP4: int32 words [N, K/8] + uint8 E4M3 scales [N, K/16];
             MXFP8: uint8 E4M3 [N, K] + uint8 E8M0 scales [N, K/32] (see formats/_decode.py);
             BF16: bf16 [N, K], no scales (s is not read; GS only groups the sums)
    alpha    [N]               fp32 per-row post factor (stride alpha_stride; 0 = scalar)
    y        [M, N]            bf16
    part     [SPLIT, BM, N]    fp32 split-K partials (GemmWorkspace, as _wstream)
    count    [N / BN]          int32 arrival counters, zero between launches
    per program tile: w [BN, G, GS] decoded fp32, s [BN, G] group scale, acc_m [BN, G] fp32

Why a separate kernel for 1-4 rows: the "swap AB" tensor-core path pads the rows to 16 and
moves the decoded tile into the MMA operand layout every K step; at 1-4 rows that padding and
the layout traffic cost more than the multiply-adds themselves. Here every weight element is
used where it was loaded:

* the weight tile is loaded as raw words (16-byte vectors: 32 NVFP4 / 16 MXFP8 elements per
  thread per vector; row strides are passed as arguments so Triton can prove 16-byte
  alignment), and with PREFETCH the next tile's words are requested before the current tile is
  decoded: two tiles of loads in flight per program, without relying on the software pipeliner
  (which targets loads that feed tl.dot);
* NVFP4 decode, compiled (PTX, the default): the inline-PTX decoder of formats/_e2m1_ptx.py (13 integer
  instructions per 8 weights), the group scale applied per weight as packed bf16 multiplies
  (exact), and each bf16 turned into fp32 by one shift / AND inside the same asm: ~3.1
  instructions per weight, and no per-group scale multiply afterwards (row_part PRESCALED).
  Interpreted (or PTX off): the shift-and-mask pair trick of _decode.e2m1_pair (two nibbles per
  ~4 integer ops) into fp16 bits, one cvt to fp32 per element, the scale once per group. Both
  are joined in NATURAL column order (unlike _decode's MMA pair order) so x is loaded with
  contiguous vector loads;
* each row's products are summed over one scale group (16 / 32 columns, whole groups per
  thread for NVFP4; two threads per group for MXFP8), then multiplied by the group scale ONCE
  and added into a small [BN, G] accumulator: one mul/FMA per element and row, one FMA per group
  and row for the scale. The cross-thread reduction over G happens once, after the K loop.

Instruction count per weight element: `python -m m3serve.kernels.aot_check --sass-stats` (the K
loop read from the SASS; 0596e85:bench/results/logs/nvfp4-sass-count.txt). The H200 issue budget at 70 %
of copy bandwidth is ~5.6 instructions per NVFP4 element (~11 per MXFP8 byte). At one row the
loop is ~6 per weight with either decoder: besides the ~3 of the decode, x's bf16 -> fp32
conversion and its broadcast through shared memory cost ~2 per weight (the next thing to cut).

Exactness and the contract band: decoded weights are exact in fp32; products w * x are exact
(<= 3 + 8 significant bits; prescaled PTX weights have <= 6; BF16 weights 8 + 8: all exact); the per-group sums,
the scale multiply and the accumulation round in fp32 with a depth of at most GS + K/GS + SPLIT additions, far inside gemm_band's 2*K*u*sum|x*w|.
The reduction order is fixed by the compiled code and the split-K partials are summed in the
order 0..SPLIT-1 by the last-arriving program (as _wstream): results are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from m3serve.kernels.formats._decode import (
    FMT_BF16,
    FMT_MXFP8,
    FMT_NVFP4,
    e2m1_pair,
    e4m3_to_f32,
    e8m0_to_f32,
    mxfp8_byte_offsets,
    mxfp8_scale_offsets,
    nvfp4_scale_offsets,
    nvfp4_word_offsets,
    to_bf16,
)
from m3serve.kernels.formats._e2m1_ptx import nvfp4_words_scaled, scale_bf16_2_118, use_ptx
from m3serve.kernels._jit import helper, is_compiled, kernel
from m3serve.kernels._pdl import pdl_release, pdl_wait
from m3serve.kernels.gemm._gemm_tiles import GemmWorkspace, check_gemm_args, check_tiled
from m3serve.kernels.gemm._splitk import ordered_sum, put_partial, release_ticket, take_ticket
from m3serve.kernels.gemm._wstream import apply_alpha
from m3serve.kernels.catalog import Cell

GEMV_BMS = (1, 2, 4)


@dataclass(frozen=True)
class GemvConfig:
    """A decode-GEMV tile config. Field names BM/BN/BK/SPLIT match _gemm_tiles.GemmConfig so the same
    workspace (make_workspace) and argument checks (check_gemm_args) serve both kernels; the type
    itself is what selects this kernel in the linear raw calls."""

    BM: int  # rows served: 1, 2 or 4 (rows above M are masked)
    BN: int
    BK: int
    SPLIT: int
    num_warps: int = 4
    num_stages: int = 1
    PREFETCH: bool = True

    def __post_init__(self) -> None:
        if self.BM not in GEMV_BMS:
            raise ValueError(f"GemvConfig.BM: expected one of {GEMV_BMS}, found {self.BM}")
        for name in ("BN", "BK", "SPLIT", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name}: expected a positive power of two, found {v!r}")
        if self.BK < 32:
            raise ValueError(f"GemvConfig.BK: expected >= 32 (one MXFP8 scale group), found {self.BK}")


@helper
def e2m1_words_f32(w):
    """int32 words [R, C] (nibble j of word c = column 8c+j) -> fp32 [R, 8C] in natural column
    order, value e2m1 * 2**-14 (fp16 bits s<<15 | eem<<9, see _decode). The pair trick puts
    nibbles j and j+4 in the low/high halves of one register; the joins below only rename
    registers: join(l_j, h_j) is the h (j+4) axis, then b and a with j = 2b + a, the outer join
    fastest, so the flat index is 4h + 2b + a = the column."""
    w = w.to(tl.uint32, bitcast=True)
    p0 = e2m1_pair(w, 0, 9)
    p1 = e2m1_pair(w, 1, 9)
    p2 = e2m1_pair(w, 2, 9)
    p3 = e2m1_pair(w, 3, 9)
    l0 = p0.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    h0 = (p0 >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    l1 = p1.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    h1 = (p1 >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    l2 = p2.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    h2 = (p2 >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    l3 = p3.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    h3 = (p3 >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    # [R, C, h]: columns j and j+4
    t0 = tl.join(l0, h0)
    t1 = tl.join(l1, h1)
    t2 = tl.join(l2, h2)
    t3 = tl.join(l3, h3)
    # [R, C, h, b] for a = 0 (j = 0, 2) and a = 1 (j = 1, 3), then [R, C, h, b, a]
    u0 = tl.join(t0, t2)
    u1 = tl.join(t1, t3)
    return tl.join(u0, u1).reshape(w.shape[0], w.shape[1] * 8)


@helper
def load_raw(w_ptr, s_ptr, rn, k0, K, stride_w, stride_s, FMT: tl.constexpr, BK: tl.constexpr, GS: tl.constexpr,
             TILED: tl.constexpr):
    """Raw weight words/bytes and scale bytes of rows rn [BN], columns [k0, k0+BK) (TILED: in the MMA tile
    layout). Weights are read once per launch: evict them first so x and the partials keep the cache."""
    if FMT == 3:  # BF16: no scales (the words stand in for them; decode_tile ignores them)
        wr = tl.load(w_ptr + rn[:, None] * stride_w + (k0 + tl.arange(0, BK))[None, :], eviction_policy="evict_first")
        sr = wr
    else:
        wr, sr = load_scaled_raw(w_ptr, s_ptr, rn, k0, K, stride_w, stride_s, FMT, BK, GS, TILED)
    return wr, sr


@helper
def load_scaled_raw(w_ptr, s_ptr, rn, k0, K, stride_w, stride_s, FMT: tl.constexpr, BK: tl.constexpr,
                    GS: tl.constexpr, TILED: tl.constexpr):
    """load_raw of the scaled formats (NVFP4, MXFP8)."""
    G: tl.constexpr = BK // GS
    rn2 = rn[:, None]
    ks = k0 // GS + tl.arange(0, G)
    if FMT == 0:
        kw = k0 // 8 + tl.arange(0, BK // 8)
        if TILED:
            wo, so = nvfp4_word_offsets(rn, kw, K, True), nvfp4_scale_offsets(rn, ks, K, True)
        else:
            wo, so = rn2 * stride_w + kw[None, :], rn2 * stride_s + ks[None, :]
    else:
        kk = k0 + tl.arange(0, BK)
        if TILED:
            wo, so = mxfp8_byte_offsets(rn, kk, K, True), mxfp8_scale_offsets(rn, ks, K, True)
        else:
            wo, so = rn2 * stride_w + kk[None, :], rn2 * stride_s + ks[None, :]
    sr = tl.load(s_ptr + so, eviction_policy="evict_first")
    wr = tl.load(w_ptr + wo, eviction_policy="evict_first")
    return wr, sr


@helper
def decode_tile(wr, sr, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GS: tl.constexpr,
                CUDA: tl.constexpr, PTX: tl.constexpr):
    """-> (w [BN, G, GS] fp32, s [BN, G] fp32). NVFP4: w * s = e2m1 * scale * 2**-8 (the
    NVFP4_UNIT of _decode, undone by ALPHA=2); MXFP8: w * s = e4m3 * 2**(b-127).
    NVFP4 with PTX: w is already scaled (inline-PTX decoder, exact bf16, then fp32) and s is
    unused (row_part's PRESCALED)."""
    G: tl.constexpr = BK // GS
    if FMT == 3:  # BF16: exact in fp32, unscaled (row_part's PRESCALED)
        w = wr.to(tl.float32).reshape(BN, G, GS)
        s = tl.full([BN, G], 1.0, tl.float32)
    elif FMT == 0 and PTX:
        w = nvfp4_words_scaled(wr, scale_bf16_2_118(sr, CUDA), True).reshape(BN, G, GS)
        s = tl.full([BN, G], 1.0, tl.float32)
    elif FMT == 0:
        w = e2m1_words_f32(wr).reshape(BN, G, GS)
        s = e4m3_to_f32(sr, CUDA) * 64.0  # e2m1 * 2**-14 * scale * 2**6 = weight * 2**-8
    else:
        w = e4m3_to_f32(wr, CUDA).reshape(BN, G, GS)
        s = e8m0_to_f32(sr)
    return w, s


@helper
def row_part(w, s, x_ptr, m, M, stride_xm, k0, BK: tl.constexpr, GS: tl.constexpr, MASKED: tl.constexpr,
             PRESCALED: tl.constexpr):
    """sum over each group of (w * x[m]) times the group scale (unless PRESCALED: w carries it):
    [BN, G] fp32 (0 when m >= M)."""
    G: tl.constexpr = BK // GS
    kk = k0 + tl.arange(0, BK)
    if MASKED:
        xv = tl.load(x_ptr + m * stride_xm + kk, mask=(kk * 0 + m) < M, other=0.0)
    else:
        xv = tl.load(x_ptr + m * stride_xm + kk)
    xv = xv.to(tl.float32).reshape(G, GS)
    if PRESCALED:
        return tl.sum(w * xv[None, :, :], axis=2)
    else:
        return tl.sum(w * xv[None, :, :], axis=2) * s


@helper
def store_row(v, y_ptr, alpha_ptr, rn, m, M, stride_ym, alpha_stride, ALPHA: tl.constexpr, CUDA: tl.constexpr):
    v = apply_alpha(v, alpha_ptr, rn, alpha_stride, ALPHA)
    tl.store(y_ptr + m * stride_ym + rn, to_bf16(v, CUDA), mask=(rn * 0 + m) < M)


@helper
def put_part(v, part_ptr, rn, m, M, pid_k, N, BM: tl.constexpr):
    put_partial(part_ptr, pid_k, BM * N, m * N + rn, v, (rn * 0 + m) < M)


@helper
def reduce_row(part_ptr, y_ptr, alpha_ptr, rn, m, M, N, stride_ym, alpha_stride, ALPHA: tl.constexpr,
               SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CUDA: tl.constexpr):
    """The last-arriving program: partials of row m summed in the fixed order 0..SPLIT-1."""
    total = ordered_sum(part_ptr, BM * N, m * N + rn, (rn * 0 + m) < M, SPLIT)
    store_row(total, y_ptr, alpha_ptr, rn, m, M, stride_ym, alpha_stride, ALPHA, CUDA)


@kernel
def gemv_stream(x_ptr, w_ptr, s_ptr, alpha_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_ym,
                stride_w, stride_s, alpha_stride, FMT: tl.constexpr, ALPHA: tl.constexpr, GS: tl.constexpr,
                SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                PREFETCH: tl.constexpr, CUDA: tl.constexpr, PTX: tl.constexpr, TILED: tl.constexpr = False,
                PDL: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    G: tl.constexpr = BK // GS
    PRE: tl.constexpr = (FMT == 0 and PTX) or FMT == 3  # PTX-decoded NVFP4 comes scaled; BF16 has no scale
    rn = pid_n * BN + tl.arange(0, BN)
    k_len = K // SPLIT
    k_lo = tl.multiple_of(pid_k * k_len, BK)
    k_hi = k_lo + k_len
    # One [BN, G] accumulator per row; rows are a compile-time count (BM) so each stays in registers.
    acc0 = tl.zeros([BN, G], tl.float32)
    if BM > 1:
        acc1 = tl.zeros([BN, G], tl.float32)
    if BM > 2:
        acc2 = tl.zeros([BN, G], tl.float32)
        acc3 = tl.zeros([BN, G], tl.float32)
    if PREFETCH:  # weights only: they may go out before the previous kernel has finished (_pdl)
        wr, sr = load_raw(w_ptr, s_ptr, rn, k_lo, K, stride_w, stride_s, FMT, BK, GS, TILED)
    pdl_wait(PDL)
    for k0 in range(k_lo, k_hi, BK):
        # K slices are whole BK steps (check_gemm_args): the hint lets loads use 16-byte vectors
        k0 = tl.multiple_of(k0, BK)
        if PREFETCH:
            # next tile's loads go out before this tile is decoded; the last step re-reads its own
            # tile (an L1/L2 hit) instead of branching
            kn = tl.multiple_of(tl.minimum(k0 + BK, k_hi - BK), BK)
            wn, sn = load_raw(w_ptr, s_ptr, rn, kn, K, stride_w, stride_s, FMT, BK, GS, TILED)
        else:
            wr, sr = load_raw(w_ptr, s_ptr, rn, k0, K, stride_w, stride_s, FMT, BK, GS, TILED)
        w, s = decode_tile(wr, sr, FMT, BN, BK, GS, CUDA, PTX)
        acc0 += row_part(w, s, x_ptr, 0, M, stride_xm, k0, BK, GS, False, PRE)
        if BM > 1:
            acc1 += row_part(w, s, x_ptr, 1, M, stride_xm, k0, BK, GS, True, PRE)
        if BM > 2:
            acc2 += row_part(w, s, x_ptr, 2, M, stride_xm, k0, BK, GS, True, PRE)
            acc3 += row_part(w, s, x_ptr, 3, M, stride_xm, k0, BK, GS, True, PRE)
        if PREFETCH:
            wr, sr = wn, sn
    pdl_release(PDL)  # the main loop is done: let the next kernel's CTAs in (_pdl)
    if SPLIT == 1:
        store_row(tl.sum(acc0, axis=1), y_ptr, alpha_ptr, rn, 0, M, stride_ym, alpha_stride, ALPHA, CUDA)
        if BM > 1:
            store_row(tl.sum(acc1, axis=1), y_ptr, alpha_ptr, rn, 1, M, stride_ym, alpha_stride, ALPHA, CUDA)
        if BM > 2:
            store_row(tl.sum(acc2, axis=1), y_ptr, alpha_ptr, rn, 2, M, stride_ym, alpha_stride, ALPHA, CUDA)
            store_row(tl.sum(acc3, axis=1), y_ptr, alpha_ptr, rn, 3, M, stride_ym, alpha_stride, ALPHA, CUDA)
    else:
        put_part(tl.sum(acc0, axis=1), part_ptr, rn, 0, M, pid_k, N, BM)
        if BM > 1:
            put_part(tl.sum(acc1, axis=1), part_ptr, rn, 1, M, pid_k, N, BM)
        if BM > 2:
            put_part(tl.sum(acc2, axis=1), part_ptr, rn, 2, M, pid_k, N, BM)
            put_part(tl.sum(acc3, axis=1), part_ptr, rn, 3, M, pid_k, N, BM)
        if take_ticket(count_ptr + pid_n, SPLIT):
            reduce_row(part_ptr, y_ptr, alpha_ptr, rn, 0, M, N, stride_ym, alpha_stride, ALPHA, SPLIT, BM, BN, CUDA)
            if BM > 1:
                reduce_row(part_ptr, y_ptr, alpha_ptr, rn, 1, M, N, stride_ym, alpha_stride, ALPHA, SPLIT, BM, BN,
                           CUDA)
            if BM > 2:
                reduce_row(part_ptr, y_ptr, alpha_ptr, rn, 2, M, N, stride_ym, alpha_stride, ALPHA, SPLIT, BM, BN,
                           CUDA)
                reduce_row(part_ptr, y_ptr, alpha_ptr, rn, 3, M, N, stride_ym, alpha_stride, ALPHA, SPLIT, BM, BN,
                           CUDA)
            release_ticket(count_ptr + pid_n)


def launch_gemv(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, alpha: torch.Tensor, alpha_stride: int,
                out: torch.Tensor, ws: GemmWorkspace, *, fmt: int, alpha_mode: int, gs: int, n: int, k: int,
                cfg: GemvConfig, tiled: bool = False) -> torch.Tensor:
    """Same arguments as _linear.launch_gemm (w: int32 words for NVFP4, uint8 for MXFP8, bf16 for BF16 with s any
    tensor, not read; tiled: in the MMA tile layout)."""
    if fmt not in (FMT_NVFP4, FMT_MXFP8, FMT_BF16):
        raise ValueError(f"fmt: the decode GEMV serves NVFP4 ({FMT_NVFP4}), MXFP8 ({FMT_MXFP8}) and BF16 ({FMT_BF16}), "
                         f"found {fmt}")
    m = check_gemm_args(x, out, n, k, cfg, ws)
    check_tiled(tiled, fmt, n, k)   # refuses BF16 tiles too
    grid = (n // cfg.BN, cfg.SPLIT)
    gemv_stream[grid](
        x, w, s, alpha, out, ws.part, ws.count, m, n, k, x.stride(0), out.stride(0), w.stride(0), s.stride(0),
        alpha_stride, FMT=fmt, ALPHA=alpha_mode, GS=gs, SPLIT=cfg.SPLIT, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK,
        PREFETCH=cfg.PREFETCH, CUDA=is_compiled(x), PTX=use_ptx(x), TILED=tiled, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def gemv_split(n: int, k: int, bn: int, bk: int, programs: int = 528) -> int:
    """Split K (powers of two) until ~`programs` programs (4 per H200 SM: with prefetch each
    holds two tiles of loads in flight), keeping >= 2 K steps per program."""
    split = 1
    while (n // bn) * split * 2 <= programs and k % (bk * split * 2) == 0 and k // (bk * split * 2) >= 2:
        split *= 2
    return split


def gemv_config(rows_hi: int, n: int, k: int, bn: int = 32, bk: int = 256, num_warps: int = 4,
                programs: int = 528, prefetch: bool = True) -> GemvConfig:
    bm = 1 if rows_hi <= 1 else 2 if rows_hi <= 2 else 4
    return GemvConfig(BM=bm, BN=bn, BK=bk, SPLIT=gemv_split(n, k, bn, bk, programs), num_warps=num_warps,
                      PREFETCH=prefetch)


def gemv_cells(shapes: tuple[tuple[tuple[int, int], str], ...], why_prefix: str = "decode GEMV: ",
               **kw) -> tuple[Cell, ...]:
    """Proposed cells for rows 1, 2 and 3-4 (NOT in any entry's certified cells yet: the lead adopts
    them after the bench). Same `config={"gemm": cfg}` key as the tensor-core cells."""
    cells = []
    for (n, k), why in shapes:
        for lo, hi in ((1, 1), (2, 2), (3, 4)):
            cells.append(Cell(rows=(lo, hi), shape=(n, k), why=f"{why_prefix}{why}; rows {lo}-{hi}",
                              config={"gemm": gemv_config(hi, n, k, **kw)}))
    return tuple(cells)


def interp_gemv_cells(shape: tuple[int, int] = (64, 256)) -> tuple[Cell, ...]:
    """Tiny cells for the interpreter: every BM, split-K on/off, prefetch on/off, masked rows."""
    k = shape[1]
    return (
        Cell(rows=(1, 1), shape=shape, why="gemv interp: BM 1, no split, prefetch",
             config={"gemm": GemvConfig(BM=1, BN=32, BK=64, SPLIT=1)}),
        Cell(rows=(1, 2), shape=shape, why="gemv interp: BM 2, split-K 2, prefetch",
             config={"gemm": GemvConfig(BM=2, BN=16, BK=64, SPLIT=2)}),
        Cell(rows=(3, 4), shape=shape, why="gemv interp: BM 4 (3 rows masked), split-K 2, no prefetch",
             config={"gemm": GemvConfig(BM=4, BN=32, BK=32 if k % 64 else 64, SPLIT=2, PREFETCH=False)}),
        Cell(rows=(4, 4), shape=shape, why="gemv interp: BM 4, no split, one K step per program",
             config={"gemm": GemvConfig(BM=4, BN=64, BK=k, SPLIT=1)}),
    )
