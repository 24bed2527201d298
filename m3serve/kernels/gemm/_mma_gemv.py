"""Register-operand MMA GEMV for decode, 1-8 rows: y[M, N] = x[M, K] @ W[N, K]^T, W in NVFP4 or MXFP8
(compiled for sm_90 only; the interpreter runs _wstream's pure-Triton kernel on the same tiles and workspace).

Shape legend:
    x        [M, K]            bf16, M = 1..8, rows 16-byte aligned
    W        NVFP4: int32 words [N, K/8] + E4M3 scales [N, K/16]; MXFP8: E4M3 [N, K] + E8M0 [N, K/32]
    alpha    [N]               fp32 row epilogue (stride alpha_stride; 0 = one scalar), see _wstream
    y        [M, N]            bf16
    part     [SPLIT, BM, N]    fp32 split-K partials (GemmWorkspace), BM = 8
    count    [N / BN]          int32 arrival counters, zero between launches
    per CTA: BN = 16 * RP * num_warps rows, K / SPLIT columns in steps of 128

Why: at 1-8 tokens a weight-streaming GEMM is a stream of bytes, and the tensor-core path of _wstream spends
its time moving each decoded tile through shared memory into the MMA operand layout (stores, barriers,
ldmatrix) for an MMA that is 1/16 busy, while the CUDA-core GEMV of _gemv pays a multiply-add and an fp32
conversion per weight and element of x. Here every weight goes from its 16-byte load straight into the
register it is decoded in, and that register is the A operand of an mma.sync: no shared memory, no
barriers, and the multiply-adds of all 8 token columns come with the MMA. The price is that Triton's layouts
cannot express "this register is that MMA fragment", so each thread's share of a step is one inline-PTX
block (gemm/_mma_ptx.py) that computes its own addresses from %laneid and %tid: Triton supplies the K loop, a
register ring of STAGES - 1 steps of loads issued ahead of their decode, and the split-K reduction. The Triton tensors that carry the registers are [64 * num_warps] (2 elements per thread, pack=2:
exactly one asm invocation per thread), opaque bundles whose element order means nothing.

Cost per weight (NVFP4, thread instructions in the K loop, static count from aot_check --sass-stats): the
decode of _e2m1_ptx (13 integer ops + 4 packed bf16 multiplies per 8), the scale conversion (~10 per 32
per row pair), 2 PRMT per x pair (shared by the thread's rows), 1 HMMA per 256 weights of the warp.

Numerics: decoded weights are exact bf16 (_e2m1_ptx; MXFP8: the hardware E4M3 -> f16 conversion, exact,
then x 2**(s-127) in bf16, exact for E8M0 s in [3, 246] as _wstream's bf16 path; outside it a product leaves
bf16's range the same way there), the MMA multiplies
exact bf16 operands and accumulates in fp32 like _wstream's tl.dot, the split-K partials are summed in the
order 0..SPLIT-1 by the last arrival (_splitk), and the epilogue rounds once to bf16. Inside gemm_band.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton.language as tl

from m3serve.kernels.gemm import _mma_ptx as P
from m3serve.kernels._jit import helper, kernel
from m3serve.kernels._pdl import pdl_release, pdl_wait
from m3serve.kernels.gemm._gemm_tiles import GemmConfig, GemmWorkspace, check_gemm_args, check_tiled
from m3serve.kernels.gemm._splitk import ordered_sum, release_ticket, take_ticket
from m3serve.kernels.gemm._wstream import apply_alpha

MMA_ROWS = 8  # tokens one launch serves: the N of mma.m16n8k16
STEP = 128  # K columns per step (4 lanes x 32)
RPS = (1, 2)


@dataclass(frozen=True)
class MmaGemvConfig:
    """BM/BN/BK/SPLIT as _gemm_tiles.GemmConfig (same workspace and checks); the type selects this kernel."""

    SPLIT: int
    RP: int = 1  # row pairs per thread
    num_warps: int = 4
    STAGES: int = 2  # steps of weights per thread in the register ring: STAGES - 1 in flight while one decodes
    BM: int = MMA_ROWS
    BK: int = STEP
    maxnreg: int = 0  # registers per thread capped (ptxas maxnreg; 0: as compiled), so that more CTAs are resident
    PAIRED: bool = True  # the K loop two steps an iteration at ring depth 2 (paired_k_steps: no ring copies)

    def __post_init__(self) -> None:
        if self.RP not in RPS:
            raise ValueError(f"MmaGemvConfig.RP: expected one of {RPS}, found {self.RP}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"MmaGemvConfig.num_warps: expected 1, 2, 4 or 8, found {self.num_warps}")
        if self.SPLIT < 1 or self.SPLIT & (self.SPLIT - 1):
            raise ValueError(f"MmaGemvConfig.SPLIT: expected a power of two, found {self.SPLIT}")
        if self.STAGES not in (2, 3):
            raise ValueError(f"MmaGemvConfig.STAGES: expected 2 or 3, found {self.STAGES}")
        if self.BM != MMA_ROWS or self.BK != STEP:
            raise ValueError(f"MmaGemvConfig: BM and BK are fixed at {MMA_ROWS} and {STEP}, found {self.BM}, {self.BK}")
        if self.maxnreg and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"MmaGemvConfig.maxnreg: expected 0 or 24..255, found {self.maxnreg}")

    @property
    def BN(self) -> int:
        return 16 * self.RP * self.num_warps

    def check_format(self, fmt: int) -> None:
        """Raise unless this config compiles for `fmt` without spills (MXFP8 holds twice the words per row)."""
        if fmt == P.FMT_MXFP8 and self.RP > 1:
            raise ValueError(f"MmaGemvConfig.RP: MXFP8 serves RP=1 only (RP=2 spills registers), found {self.RP}")


@functools.lru_cache(maxsize=None)
def asm_args(fmt: int, rp: int, alpha: int, partial: bool, tiled: bool = False) -> dict:
    """The PTX blocks of one variant as the kernel's constexpr arguments (text, constraints, output counts).
    tiled: weights in the MMA tile layout (m3serve.quant.tiles)."""
    load, load_c = P.tiled_load_asm(rp, fmt) if tiled else P.load_asm(fmt, rp)
    mma, mma_c = P.compute_asm(fmt, rp)
    xload, xload_c = P.xload_asm()
    store, store_c = P.store_asm(rp, P.MODE_PARTIAL if partial else P.MODE_FINAL, 0 if partial else alpha)
    return dict(LOAD=load, LOAD_C=load_c, N_LOAD=load_c.count("=") // 2, MMA=mma, MMA_C=mma_c, XLOAD=xload,
                XLOAD_C=xload_c, STORE=store, STORE_C=store_c)


_NX = tl.constexpr(P.X_REGS // 2)  # x bundle tensors (jit code reads module globals only as constexprs)


@helper
def asm_block(args, FLOAT: tl.constexpr, N_OUT: tl.constexpr, TEXT: tl.constexpr, CONS: tl.constexpr,
              PURE: tl.constexpr):
    """One PTX block over the thread's [T] bundles (pack 2: one invocation per thread): N_OUT output tensors,
    fp32 (FLOAT: the accumulators) or int32 (raw registers)."""
    if FLOAT:
        return tl.inline_asm_elementwise(TEXT, CONS, args, dtype=(tl.float32,) * N_OUT, is_pure=PURE, pack=2)
    else:
        return tl.inline_asm_elementwise(TEXT, CONS, args, dtype=(tl.int32,) * N_OUT, is_pure=PURE, pack=2)


@helper
def step_addrs(w_row, s_row, k0, FMT: tl.constexpr, TILED: tl.constexpr = False):
    """Byte addresses of column k0 in the CTA's first weight row and its scale row (TILED: of the CTA's first
    tile of that step; a row block's tiles start where its first row does in the row-major layout)."""
    if TILED and FMT == 0:
        return w_row + (k0 // 128) * 1024, s_row + (k0 // 128) * 128
    elif TILED:
        return w_row + (k0 // 128) * 2048, s_row + (k0 // 128) * 64
    elif FMT == 0:
        return w_row + k0 // 2, s_row + k0 // 16
    else:
        return w_row + k0, s_row + k0 // 32


@helper
def ring_advance(acc, st0, st1, nxt, xs, NACC: tl.constexpr, MMA: tl.constexpr, MMA_C: tl.constexpr,
                 STAGES: tl.constexpr):
    """One step of the register ring: decode + MMA the oldest step's words (st0) with x (xs), then shift the ring
    by one (nxt: the step just loaded; with STAGES == 2, st1 is only a placeholder). Returns (acc, st0, st1)."""
    acc = asm_block(acc + st0 + xs, True, NACC, MMA, MMA_C, True)
    if STAGES == 3:
        return acc, st1, nxt
    else:
        return acc, nxt, nxt


@helper
def paired_k_steps(acc, st0, xs, w_row, s_row, load_tail, x_base, k_lo, n_steps, last, zl, x_tail,
                   FMT: tl.constexpr, TILED: tl.constexpr, N_LOAD: tl.constexpr, LOAD: tl.constexpr,
                   LOAD_C: tl.constexpr, XLOAD: tl.constexpr, XLOAD_C: tl.constexpr, NACC: tl.constexpr,
                   MMA: tl.constexpr, MMA_C: tl.constexpr):
    """The ring-depth-2 K loop two steps an iteration: acc after n_steps steps from k_lo, st0 / xs holding the first
    step's words and x. Step k + 256 loads into the registers step k's MMA just freed, so the two buffers alternate
    and nothing is copied at the back edge (a one-step loop must move the step it loaded into the registers the next
    iteration reads: ~25 MOVs a step, which an issue-bound decode pays). Same steps in the same order as the
    one-step loop, so the same bits; an odd count ends on one more step. load_tail / x_tail: the LOAD / XLOAD
    block's operands after its step addresses (the strides, or moe/_mma.py's hoisted offsets)."""
    for kp in range(0, n_steps // 2):
        k0 = k_lo + kp * 256
        wk, sk = step_addrs(w_row, s_row, k0 + 128, FMT, TILED)
        sta = asm_block((zl + wk, zl + sk) + load_tail, False, N_LOAD, LOAD, LOAD_C, False)
        xa = asm_block((zl + (x_base + (k0 + 128) * 2),) + x_tail, False, _NX, XLOAD, XLOAD_C, False)
        acc = asm_block(acc + st0 + xs, True, NACC, MMA, MMA_C, True)
        k2 = tl.minimum(k0 + 256, last)  # past the slice: the last step again (an L2 hit, unused)
        wk, sk = step_addrs(w_row, s_row, k2, FMT, TILED)
        st0 = asm_block((zl + wk, zl + sk) + load_tail, False, N_LOAD, LOAD, LOAD_C, False)
        xs = asm_block((zl + (x_base + k2 * 2),) + x_tail, False, _NX, XLOAD, XLOAD_C, False)
        acc = asm_block(acc + sta + xa, True, NACC, MMA, MMA_C, True)
    if n_steps % 2 == 1:
        acc = asm_block(acc + st0 + xs, True, NACC, MMA, MMA_C, True)
    return acc


@helper
def mma_epilogue(acc, y_ptr, part_ptr, count_ptr, alpha_ptr, pid_n, pid_k, n0, M, N, stride_ym, alpha_stride, SPLIT,
                 zl, zi, SPLITK: tl.constexpr, ALPHA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 STORE: tl.constexpr, STORE_C: tl.constexpr):
    """y[:M, n0:n0+BN] from the accumulators of row-pair rows (16 * (RP * warp + p) + g, + 8): the PTX store of
    bf16 with the row epilogue (SPLIT == 1), or the fp32 partial of split pid_k, then the last arrival's ordered
    sum of the SPLIT partials (_splitk) and the epilogue in Triton. part: [SPLIT, BM, N]."""
    if not SPLITK:
        asm_block(acc + (zl + y_ptr.to(tl.int64), zi + n0, zi + M, zi + stride_ym, zl + alpha_ptr.to(tl.int64),
                         zi + alpha_stride), False, 1, STORE, STORE_C, False)
    else:
        slab = part_ptr.to(tl.int64) + pid_k.to(tl.int64) * (BM * N * 4)
        asm_block(acc + (zl + slab, zi + n0, zi + M, zi + N, zl, zi), False, 1, STORE, STORE_C, False)
        if take_ticket(count_ptr + pid_n, SPLIT):
            rn = n0 + tl.arange(0, BN)
            rm = tl.arange(0, BM)
            tile = rm[:, None] * N + rn[None, :]
            ymask = rm[:, None] < M
            total = ordered_sum(part_ptr, BM * N, tile, ymask, SPLIT)
            total = apply_alpha(total, alpha_ptr, rn, alpha_stride, ALPHA)
            tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], total.to(tl.bfloat16), mask=ymask)
            release_ticket(count_ptr + pid_n)


@kernel
def mma_gemv(x_ptr, w_ptr, s_ptr, alpha_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xb, stride_ym, stride_wb,
             stride_sb, alpha_stride, SPLIT, FMT: tl.constexpr, ALPHA: tl.constexpr, SPLITK: tl.constexpr,
             RP: tl.constexpr, NW: tl.constexpr, BM: tl.constexpr, STAGES: tl.constexpr, PAIRED: tl.constexpr,
             TILED: tl.constexpr,
             LOAD: tl.constexpr, LOAD_C: tl.constexpr, N_LOAD: tl.constexpr, MMA: tl.constexpr, MMA_C: tl.constexpr,
             XLOAD: tl.constexpr, XLOAD_C: tl.constexpr, STORE: tl.constexpr, STORE_C: tl.constexpr, PDL: tl.constexpr = False):
    """Strides ending in b are in bytes; stride_ym and alpha_stride in elements. SPLIT is a runtime value
    (one compiled variant serves every split count); SPLITK = SPLIT > 1 selects the partial-sum epilogue.
    LOAD / MMA / XLOAD / STORE are the variant's PTX blocks (asm_args)."""
    T: tl.constexpr = 64 * NW
    BN: tl.constexpr = 16 * RP * NW
    NACC: tl.constexpr = 2 * RP
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BN
    k_len = K // SPLIT
    k_lo = pid_k * k_len
    k_hi = k_lo + k_len
    zl = tl.zeros([T], tl.int64)
    zi = tl.zeros([T], tl.int32)
    w_row = w_ptr.to(tl.int64) + n0.to(tl.int64) * stride_wb
    s_row = s_ptr.to(tl.int64) + n0.to(tl.int64) * stride_sb
    x_base = x_ptr.to(tl.int64)
    sw = zi + stride_wb * (16 if TILED else 1)  # TILED: the next row block's tile
    ss = zi + stride_sb * (16 if TILED else 1)
    sx = zi + stride_xb
    mm = zi + (M - 1)
    last = k_hi - 128
    acc = (tl.zeros([T], tl.float32),) * NACC
    # the register ring: the words of STAGES - 1 steps are loaded ahead of their decode; steps past the slice
    # reload the last one (an L2 hit) instead of branching. Its first steps are weights only: they go out
    # before the previous kernel has finished (_pdl), x after.
    wk, sk = step_addrs(w_row, s_row, k_lo, FMT, TILED)
    st0 = asm_block((zl + wk, zl + sk, sw, ss), False, N_LOAD, LOAD, LOAD_C, False)
    st1 = st0
    if STAGES == 3:
        wk, sk = step_addrs(w_row, s_row, tl.minimum(k_lo + 128, last), FMT, TILED)
        st1 = asm_block((zl + wk, zl + sk, sw, ss), False, N_LOAD, LOAD, LOAD_C, False)
    pdl_wait(PDL)
    xs = asm_block((zl + (x_base + k_lo * 2), sx, mm), False, _NX, XLOAD, XLOAD_C, False)
    if PAIRED:
        acc = paired_k_steps(acc, st0, xs, w_row, s_row, (sw, ss), x_base, k_lo, k_len // 128, last, zl, (sx, mm),
                             FMT, TILED, N_LOAD, LOAD, LOAD_C, XLOAD, XLOAD_C, NACC, MMA, MMA_C)
    else:
        for k0 in range(k_lo, k_hi, 128):
            wk, sk = step_addrs(w_row, s_row, tl.minimum(k0 + 128 * (STAGES - 1), last), FMT, TILED)
            nxt = asm_block((zl + wk, zl + sk, sw, ss), False, N_LOAD, LOAD, LOAD_C, False)
            xn = asm_block((zl + (x_base + tl.minimum(k0 + 128, last) * 2), sx, mm), False, _NX, XLOAD, XLOAD_C,
                           False)
            acc, st0, st1 = ring_advance(acc, st0, st1, nxt, xs, NACC, MMA, MMA_C, STAGES)
            xs = xn
    pdl_release(PDL)  # the main loop is done: let the next kernel's CTAs in (_pdl)
    mma_epilogue(acc, y_ptr, part_ptr, count_ptr, alpha_ptr, pid_n, pid_k, n0, M, N, stride_ym, alpha_stride, SPLIT,
                 zl, zi, SPLITK, ALPHA, BM, BN, STORE, STORE_C)


def check_mma_args(x: torch.Tensor, out: torch.Tensor, n: int, k: int, cfg: MmaGemvConfig, ws: GemmWorkspace) -> int:
    m = check_gemm_args(x, out, n, k, cfg, ws)
    if x.data_ptr() % 16 or (x.stride(0) * 2) % 16:
        raise ValueError(f"x: the MMA GEMV reads 16-byte vectors of each row; expected a 16-byte aligned base "
                         f"and row stride, found address % 16 = {x.data_ptr() % 16}, row stride {x.stride(0)} elements")
    return m


def launch_mma_gemv(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, alpha: torch.Tensor, alpha_stride: int,
                    out: torch.Tensor, ws: GemmWorkspace, *, fmt: int, alpha_mode: int, n: int, k: int,
                    cfg: MmaGemvConfig, tiled: bool = False) -> torch.Tensor:
    """Same arguments as _linear.launch_gemm (w: int32 words for NVFP4, uint8 E4M3 for MXFP8). Compiled
    only: the raw calls send CPU tensors to _wstream with the same tiles (interpreted_config).
    tiled: w and s are in the MMA tile layout of m3serve.quant.tiles (same shapes and strides)."""
    if x.device.type not in ("cuda", "meta"):
        raise ValueError(f"x: the MMA GEMV runs compiled only (inline PTX), found a {x.device.type} tensor; "
                         "the raw call interprets _wstream_gemm for CPU tensors")
    m = check_mma_args(x, out, n, k, cfg, ws)
    check_tiled(tiled, fmt, n, k)
    cfg.check_format(fmt)
    grid = (n // cfg.BN, cfg.SPLIT)
    mma_gemv[grid](
        x, w, s, alpha, out, ws.part, ws.count, m, n, k, x.stride(0) * 2, out.stride(0), w.stride(0) * w.element_size(),
        s.stride(0) * s.element_size(), alpha_stride, cfg.SPLIT, FMT=fmt, ALPHA=alpha_mode, SPLITK=cfg.SPLIT > 1,
        RP=cfg.RP, NW=cfg.num_warps, BM=cfg.BM, STAGES=cfg.STAGES, PAIRED=cfg.PAIRED and cfg.STAGES == 2,
        TILED=tiled, **asm_args(fmt, cfg.RP, alpha_mode, cfg.SPLIT > 1, tiled),
        num_warps=cfg.num_warps, num_stages=1, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )
    return out


def interpreted_config(cfg: MmaGemvConfig) -> GemmConfig:
    """The _wstream tile that computes the same function on CPU tensors (interpreter: fp32 dots)."""
    return GemmConfig(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, SPLIT=cfg.SPLIT, num_warps=cfg.num_warps)


def mma_split(n: int, k: int, cfg_bn: int, ctas: int = 396, min_steps: int = 2) -> int:
    """Split K (powers of two) until ~`ctas` CTAs (3 per H200 SM), keeping >= min_steps K steps each."""
    split = 1
    while (n // cfg_bn) * split * 2 <= ctas and k % (STEP * split * 2) == 0 and k // (STEP * split * 2) >= min_steps:
        split *= 2
    return split


# --- CPU execution of the same PTX (tests) ----------------------------------------------------------------


def emulate(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, alpha: torch.Tensor, alpha_stride: int, *, fmt: int,
            alpha_mode: int, n: int, k: int, cfg: MmaGemvConfig, tiled: bool = False) -> torch.Tensor:
    """y [M, N] bf16 from running mma_gemv's PTX blocks (asm_args) on _ptx_emu, CTA by CTA and warp by warp,
    with the kernel's own scalar logic (the ring of loads STAGES - 1 steps ahead and its clamped last steps,
    split-K in order 0..SPLIT-1, the Triton epilogue of the split path). CPU tensors; meant for tiny shapes."""
    import numpy as np

    from m3serve.kernels.gemm import _ptx_emu as E

    m = x.shape[0]
    if not 1 <= m <= cfg.BM or n % cfg.BN or k % (cfg.BK * cfg.SPLIT):
        raise ValueError(f"emulate: shape (M={m}, N={n}, K={k}) does not fit {cfg}")
    mem = E.Memory()
    xa = mem.add(x.contiguous().view(torch.int16).numpy())
    wa = mem.add(w.contiguous().numpy())
    sa = mem.add(s.contiguous().view(torch.uint8).numpy())
    aa = mem.add(alpha.contiguous().float().numpy())
    ya, y = mem.add_view(np.full((m, n), 0x7FC0, np.uint16))  # poisoned: every element must be written
    pa, part = mem.add_view(np.full(cfg.SPLIT * cfg.BM * n, np.nan, np.float32))
    stride_wb = w.stride(0) * w.element_size()
    stride_sb = s.stride(0) * s.element_size()
    blocks = asm_args(fmt, cfg.RP, alpha_mode, cfg.SPLIT > 1, tiled)
    n_load = 2 * blocks["N_LOAD"]
    n_acc = P.acc_regs(cfg.RP)

    def pair(*vals: int) -> list[np.ndarray]:
        return [np.full(E.LANES, v & 0xFFFFFFFFFFFFFFFF, np.uint64) for v in vals for _ in range(2)]

    k_len = k // cfg.SPLIT
    for pid_n in range(n // cfg.BN):
        n0 = pid_n * cfg.BN
        for pid_k in range(cfg.SPLIT):
            k_lo, k_hi = pid_k * k_len, (pid_k + 1) * k_len
            last = k_hi - STEP
            for warp in range(cfg.num_warps):
                def words_at(k0: int) -> list[np.ndarray]:
                    k0 = min(k0, last)
                    if tiled:
                        tw, ts = (1024, 128) if fmt == P.FMT_NVFP4 else (2048, 64)   # one tile's bytes / scales
                        wk, sk = wa + n0 * stride_wb + (k0 // STEP) * tw, sa + n0 * stride_sb + (k0 // STEP) * ts
                        return E.run_block(blocks["LOAD"], warp, pair(wk, sk, 16 * stride_wb, 16 * stride_sb), n_load,
                                           mem)
                    wk = wa + n0 * stride_wb + (k0 // 2 if fmt == P.FMT_NVFP4 else k0)
                    sk = sa + n0 * stride_sb + k0 // (16 if fmt == P.FMT_NVFP4 else 32)
                    return E.run_block(blocks["LOAD"], warp, pair(wk, sk, stride_wb, stride_sb), n_load, mem)

                def x_at(k0: int) -> list[np.ndarray]:
                    return E.run_block(blocks["XLOAD"], warp, pair(xa + min(k0, last) * 2, x.stride(0) * 2, m - 1),
                                       P.X_REGS, mem)

                xs = x_at(k_lo)
                acc = [np.zeros(E.LANES, np.uint64) for _ in range(n_acc)]
                ring = [words_at(k_lo + STEP * d) for d in range(cfg.STAGES - 1)]
                for k0 in range(k_lo, k_hi, STEP):
                    ring.append(words_at(k0 + STEP * (cfg.STAGES - 1)))
                    xn = x_at(k0 + STEP)
                    acc = E.run_block(blocks["MMA"], warp, acc + ring.pop(0) + xs, n_acc, mem)
                    xs = xn
                if cfg.SPLIT == 1:
                    E.run_block(blocks["STORE"], warp, acc + pair(ya, n0, m, n, aa, alpha_stride), 2, mem)
                else:
                    E.run_block(blocks["STORE"], warp, acc + pair(pa + pid_k * cfg.BM * n * 4, n0, m, n, 0, 0), 2,
                                mem)
        if cfg.SPLIT > 1:  # the last arrival's Triton epilogue: partials in order 0..SPLIT-1, then alpha
            tile = part.reshape(cfg.SPLIT, cfg.BM, n)[:, :m, n0:n0 + cfg.BN]
            total = np.zeros(tile.shape[1:], np.float32)
            for sp in range(cfg.SPLIT):
                total = (total + tile[sp]).astype(np.float32)
            a_rows = alpha.float().numpy().reshape(-1)[np.arange(n0, n0 + cfg.BN) * alpha_stride]
            if alpha_mode == 1:
                total = total * a_rows
            elif alpha_mode == 2:
                total = (total * np.float32(256.0)) / a_rows
            y[:, n0:n0 + cfg.BN] = E._f32_to_bf16_rne(total.astype(np.float32)).astype(np.uint16)
    return torch.from_numpy(y.astype(np.int16).copy()).view(torch.bfloat16)
