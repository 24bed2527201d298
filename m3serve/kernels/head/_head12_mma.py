"""The register-operand MMA GEMV over the 12-bit coded LM head: logits[M, V] (fp32, escapes not yet added) =
x[M, K] @ W^T for M = 1..8 tokens, each weight read once (1.5 bytes) and decoded in the register that is the
MMA's A operand (kernels/head/_head12_ptx.py; the frame of gemm/_mma_gemv.py). head.head12 then adds the
escapes, rounds to bf16 and reduces to the greedy ids (kernels/head/_argmax.py).

Shape legend:
    x        [M, K]          bf16, M = 1..8, rows 16-byte aligned
    planes   quant.head12_tiles.Head12Tiles: sm [V, K], codes [V, K/2], tile_base [V/16, K/128] (tile layouts)
    logits   [>= M, V]       fp32, row stride V (the head's workspace)
    per CTA: BN = 16 * RP * num_warps rows, all K in steps of 128 (no split: V / BN CTAs fill the GPU)

Cost per weight (thread instructions in the K loop): 4 integer operations a bf16 pair (2 a weight), 1 HMMA per
256 weights of a warp, 16 bf16x2 multiplies a step for x (shared by the thread's rows), 4 FMAs per row pair a step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton.language as tl

from m3serve.kernels.gemm import _mma_ptx as P
from m3serve.kernels.gemm._mma_gemv import asm_block, ring_advance
from m3serve.kernels.head import _head12_ptx as H
from m3serve.kernels._jit import kernel
from m3serve.kernels._pdl import pdl_release, pdl_wait

MMA_ROWS = 8
STEP = 128


@dataclass(frozen=True)
class Head12MmaConfig:
    RP: int = 1  # row pairs (tiles of 16 rows) per warp
    num_warps: int = 4
    STAGES: int = 2  # steps of words per thread in the register ring: STAGES - 1 in flight while one decodes
    maxnreg: int = 0  # registers per thread capped (0: as compiled)
    BM: int = MMA_ROWS  # token rows served (the head's workspace is [BM, ...])
    BN_REDUCE: int = 1024  # vocabulary rows per program of the escape + argmax pass

    def __post_init__(self) -> None:
        if self.RP not in (1, 2):
            raise ValueError(f"Head12MmaConfig.RP: expected 1 or 2, found {self.RP}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"Head12MmaConfig.num_warps: expected 1, 2, 4 or 8, found {self.num_warps}")
        if self.STAGES not in (2, 3):
            raise ValueError(f"Head12MmaConfig.STAGES: expected 2 or 3, found {self.STAGES}")
        if self.BM != MMA_ROWS:
            raise ValueError(f"Head12MmaConfig.BM: fixed at {MMA_ROWS} (the N of mma.m16n8k16), found {self.BM}")
        if self.maxnreg and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"Head12MmaConfig.maxnreg: expected 0 or 24..255, found {self.maxnreg}")
        if self.BN_REDUCE & (self.BN_REDUCE - 1) or not 16 <= self.BN_REDUCE <= 4096:
            raise ValueError(f"Head12MmaConfig.BN_REDUCE: expected a power of two in 16..4096, found {self.BN_REDUCE}")

    @property
    def BN(self) -> int:
        return 16 * self.RP * self.num_warps


@functools.lru_cache(maxsize=None)
def asm_args(rp: int) -> dict:
    load, load_c = H.load_asm(rp)
    mma, mma_c = H.compute_asm(rp)
    xload, xload_c = P.xload_asm()
    store, store_c = P.store_asm(rp, P.MODE_PARTIAL, 0)
    return dict(LOAD=load, LOAD_C=load_c, N_LOAD=load_c.count("=") // 2, MMA=mma, MMA_C=mma_c, XLOAD=xload,
                XLOAD_C=xload_c, STORE=store, STORE_C=store_c)


@kernel
def head12_mma_logits(x_ptr, sm_ptr, cd_ptr, tb_ptr, out_ptr, M, V, K, stride_xb, RP: tl.constexpr,
                      NW: tl.constexpr, STAGES: tl.constexpr, LOAD: tl.constexpr, LOAD_C: tl.constexpr,
                      N_LOAD: tl.constexpr, MMA: tl.constexpr, MMA_C: tl.constexpr, XLOAD: tl.constexpr,
                      XLOAD_C: tl.constexpr, STORE: tl.constexpr, STORE_C: tl.constexpr, PDL: tl.constexpr = False):
    """stride_xb in bytes. One CTA: BN rows, all K; out[t, n] = the raw fp32 sums for tokens t < M."""
    T: tl.constexpr = 64 * NW
    BN: tl.constexpr = 16 * RP * NW
    NACC: tl.constexpr = 2 * RP  # accumulator tensors (2 registers each: pack 2)
    pid = tl.program_id(0)
    n0 = pid * BN
    steps = K // 128
    zl = tl.zeros([T], tl.int64)
    zi = tl.zeros([T], tl.int32)
    rb0 = (n0 // 16).to(tl.int64) * steps  # the CTA's first tile, in tiles
    sm_row = sm_ptr.to(tl.int64) + rb0 * 2048
    cd_row = cd_ptr.to(tl.int64) + rb0 * 1024
    tb_row = tb_ptr.to(tl.int64) + rb0
    ssw = zi + steps * 2048
    csw = zi + steps * 1024
    bsw = zi + steps
    sx = zi + stride_xb
    mm = zi + (M - 1)
    last = steps - 1
    acc = (tl.zeros([T], tl.float32),) * NACC
    st0 = asm_block((zl + sm_row, zl + cd_row, zl + tb_row, ssw, csw, bsw), False, N_LOAD, LOAD, LOAD_C, False)
    st1 = st0
    if STAGES == 3:
        s1 = tl.minimum(1, last)
        st1 = asm_block((zl + (sm_row + s1 * 2048), zl + (cd_row + s1 * 1024), zl + (tb_row + s1), ssw, csw, bsw),
                        False, N_LOAD, LOAD, LOAD_C, False)
    pdl_wait(PDL)
    x_base = x_ptr.to(tl.int64)
    xs = asm_block((zl + x_base, sx, mm), False, P.X_REGS // 2, XLOAD, XLOAD_C, False)
    for s in range(0, steps):
        sn = tl.minimum(s + STAGES - 1, last)  # steps past the end reload the last one (an L2 hit), no branch
        nxt = asm_block((zl + (sm_row + sn * 2048), zl + (cd_row + sn * 1024), zl + (tb_row + sn), ssw, csw, bsw),
                        False, N_LOAD, LOAD, LOAD_C, False)
        xn = asm_block((zl + (x_base + tl.minimum(s + 1, last) * 256), sx, mm), False, P.X_REGS // 2, XLOAD,
                       XLOAD_C, False)
        acc, st0, st1 = ring_advance(acc, st0, st1, nxt, xs, NACC, MMA, MMA_C, STAGES)
        xs = xn
    pdl_release(PDL)
    asm_block(acc + (zl + out_ptr.to(tl.int64), zi + n0, zi + M, zi + V, zl, zi), False, 1, STORE, STORE_C, False)


def launch_head12_mma(x: torch.Tensor, sm: torch.Tensor, codes: torch.Tensor, tile_base: torch.Tensor,
                      logits: torch.Tensor, v: int, k: int, cfg: Head12MmaConfig) -> torch.Tensor:
    """logits[:M] (fp32, row stride V) from the compiled kernel; CUDA tensors only (inline PTX)."""
    if x.device.type not in ("cuda", "meta"):
        raise ValueError(f"x: the MMA head runs compiled only (inline PTX), found a {x.device.type} tensor; "
                         "emulate() runs the same PTX on the CPU")
    if x.data_ptr() % 16 or (x.stride(0) * 2) % 16:
        raise ValueError(f"x: the MMA head reads 16-byte vectors of each row; expected a 16-byte aligned base and "
                         f"row stride, found address % 16 = {x.data_ptr() % 16}, row stride {x.stride(0)} elements")
    if v % cfg.BN:
        raise ValueError(f"head shape (V={v}): expected V % {cfg.BN} == 0 for {cfg}")
    grid = (v // cfg.BN,)
    head12_mma_logits[grid](x, sm, codes, tile_base, logits, x.shape[0], v, k, x.stride(0) * 2, RP=cfg.RP,
                            NW=cfg.num_warps, STAGES=cfg.STAGES, **asm_args(cfg.RP), num_warps=cfg.num_warps,
                            num_stages=1, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))
    return logits


def emulate(x: torch.Tensor, sm: torch.Tensor, codes: torch.Tensor, tile_base: torch.Tensor, logits: torch.Tensor,
            v: int, k: int, cfg: Head12MmaConfig) -> torch.Tensor:
    """logits[:M] from running the kernel's PTX blocks on gemm/_ptx_emu, CTA by CTA and warp by warp, with the
    kernel's ring of loads STAGES - 1 steps ahead (its clamped last steps included). CPU tensors, tiny shapes."""
    import numpy as np

    from m3serve.kernels.gemm import _ptx_emu as E

    m = x.shape[0]
    if not 1 <= m <= cfg.BM or v % cfg.BN or k % STEP:
        raise ValueError(f"emulate: shape (M={m}, V={v}, K={k}) does not fit {cfg}")
    mem = E.Memory()
    xa = mem.add(x.contiguous().view(torch.int16).numpy())
    sa = mem.add(sm.contiguous().numpy())
    ca = mem.add(codes.contiguous().numpy())
    ta = mem.add(tile_base.contiguous().numpy())
    out = logits.view(-1)[:m * v].numpy().view(np.float32)
    oa, region = mem.add_view(np.full(m * v, np.nan, np.float32))  # poisoned: every element must be written
    blocks = asm_args(cfg.RP)
    n_load = 2 * blocks["N_LOAD"]
    steps = k // STEP

    def pair(*vals: int) -> list[np.ndarray]:
        return [np.full(E.LANES, val & 0xFFFFFFFFFFFFFFFF, np.uint64) for val in vals for _ in range(2)]

    for pid in range(v // cfg.BN):
        rb0 = pid * cfg.BN // 16 * steps
        for warp in range(cfg.num_warps):
            def words_at(st: int) -> list[np.ndarray]:
                st = min(st, steps - 1)
                return E.run_block(blocks["LOAD"], warp, pair(sa + (rb0 + st) * 2048, ca + (rb0 + st) * 1024,
                                                              ta + rb0 + st, steps * 2048, steps * 1024, steps),
                                   n_load, mem)

            def x_at(st: int) -> list[np.ndarray]:
                return E.run_block(blocks["XLOAD"], warp, pair(xa + min(st, steps - 1) * 256, x.stride(0) * 2, m - 1),
                                   P.X_REGS, mem)

            xs = x_at(0)
            acc = [np.zeros(E.LANES, np.uint64) for _ in range(4 * cfg.RP)]
            ring = [words_at(d) for d in range(cfg.STAGES - 1)]
            for st in range(steps):
                ring.append(words_at(st + cfg.STAGES - 1))
                xn = x_at(st + 1)
                acc = E.run_block(blocks["MMA"], warp, acc + ring.pop(0) + xs, 4 * cfg.RP, mem)
                xs = xn
            E.run_block(blocks["STORE"], warp, acc + pair(oa, pid * cfg.BN, m, v, 0, 0), 2, mem)
    out[:] = region
    return logits
