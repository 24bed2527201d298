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
block (_mma_ptx.py) that computes its own addresses from %laneid and %tid: Triton supplies the K loop, one
step of register prefetch (the next step's loads are issued before this step's decode), and the split-K
reduction. The Triton tensors that carry the registers are [64 * num_warps] (2 elements per thread, pack=2:
exactly one asm invocation per thread), opaque bundles whose element order means nothing.

Cost per weight (NVFP4, thread instructions in the K loop, static count from aot_check --sass-stats): the
decode of _e2m1_ptx (13 integer ops + 4 packed bf16 multiplies per 8), the scale conversion (~10 per 32
per row pair), 2 PRMT per x pair (shared by the thread's rows), 1 HMMA per 256 weights of the warp.

Numerics: decoded weights are exact bf16 (_e2m1_ptx; MXFP8: the hardware E4M3 -> f16 conversion, exact,
then x 2**(s-127) in bf16, exact for E8M0 s in [3, 246], which mxfp8_linear checks), the MMA multiplies
exact bf16 operands and accumulates in fp32 like _wstream's tl.dot, the split-K partials are summed in the
order 0..SPLIT-1 by the last arrival (_splitk), and the epilogue rounds once to bf16. Inside gemm_band.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from m3serve.kernels import _mma_ptx as P
from m3serve.kernels._jit import helper, kernel
from m3serve.kernels._linear import GemmWorkspace, check_gemm_args
from m3serve.kernels._splitk import ordered_sum, release_ticket, take_ticket
from m3serve.kernels._wstream import apply_alpha

MMA_ROWS = 8  # tokens one launch serves: the N of mma.m16n8k16
STEP = 128  # K columns per step (4 lanes x 32)
RPS = (1, 2)
MAX_SMEM_ROWS = 128  # 64 KB


@dataclass(frozen=True)
class MmaGemvConfig:
    """BM/BN/BK/SPLIT as _linear.GemmConfig (same workspace and checks); the type selects this kernel."""

    SPLIT: int
    RP: int = 2  # row pairs per thread
    num_warps: int = 4
    STAGES: int = 4  # steps of weights per thread in the ring (STAGES - 1 in flight while one is decoded)
    REGS: bool = False  # the ring in registers (ld.global, STAGES 2 or 3) instead of cp.async into shared memory
    BM: int = MMA_ROWS
    BK: int = STEP

    def __post_init__(self) -> None:
        if self.RP not in RPS:
            raise ValueError(f"MmaGemvConfig.RP: expected one of {RPS}, found {self.RP}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"MmaGemvConfig.num_warps: expected 1, 2, 4 or 8, found {self.num_warps}")
        if self.SPLIT < 1 or self.SPLIT & (self.SPLIT - 1):
            raise ValueError(f"MmaGemvConfig.SPLIT: expected a power of two, found {self.SPLIT}")
        if not 2 <= self.STAGES <= (3 if self.REGS else 8):
            raise ValueError(f"MmaGemvConfig.STAGES: expected 2..{3 if self.REGS else 8}, found {self.STAGES}")
        if self.BM != MMA_ROWS or self.BK != STEP:
            raise ValueError(f"MmaGemvConfig: BM and BK are fixed at {MMA_ROWS} and {STEP}, found {self.BM}, {self.BK}")

    @property
    def BN(self) -> int:
        return 16 * self.RP * self.num_warps

    def smem_rows(self, fmt: int) -> int:
        """reserve_smem's ROWS: the stages' bytes / 512, rounded up to a power of two (Triton caps a layout
        conversion's scratch at 64 KB, so that is the most a config may use)."""
        need = 0 if self.REGS else P.smem_bytes(fmt, self.RP, self.num_warps, self.STAGES)
        rows = 16
        while rows * 512 < need:
            rows *= 2
        if rows > MAX_SMEM_ROWS:
            raise ValueError(f"MmaGemvConfig: {self.STAGES} stages of {self.RP} row pairs x {self.num_warps} warps "
                             f"need {need} bytes of shared memory; at most {MAX_SMEM_ROWS * 512} can be reserved")
        return rows

    def check_format(self, fmt: int) -> None:
        """Raise unless this config compiles for `fmt` without spills (MXFP8 holds twice the words per row)."""
        if fmt == P.FMT_MXFP8 and self.RP > 1:  # noqa: SIM102
            raise ValueError(f"MmaGemvConfig.RP: MXFP8 serves RP=1 only (RP=2 spills registers), found {self.RP}")
        self.smem_rows(fmt)


def _c(text_cons: tuple[str, str]) -> tuple[tl.constexpr, tl.constexpr]:
    return tl.constexpr(text_cons[0]), tl.constexpr(text_cons[1])


# jit code reads module globals only as constexprs, by name: one per variant
_IS_N1, _IS_N1_C = _c(P.issue_asm(P.FMT_NVFP4, 1))
_IS_N2, _IS_N2_C = _c(P.issue_asm(P.FMT_NVFP4, 2))
_IS_M1, _IS_M1_C = _c(P.issue_asm(P.FMT_MXFP8, 1))
_IS_M2, _IS_M2_C = _c(P.issue_asm(P.FMT_MXFP8, 2))
_MM_N1, _MM_N1_C = _c(P.compute_asm(P.FMT_NVFP4, 1))
_MM_N2, _MM_N2_C = _c(P.compute_asm(P.FMT_NVFP4, 2))
_MM_M1, _MM_M1_C = _c(P.compute_asm(P.FMT_MXFP8, 1))
_MM_M2, _MM_M2_C = _c(P.compute_asm(P.FMT_MXFP8, 2))
_LW_N1, _LW_N1_C = _c(P.load_words_asm(P.FMT_NVFP4, 1))
_LW_N2, _LW_N2_C = _c(P.load_words_asm(P.FMT_NVFP4, 2))
_LW_M1, _LW_M1_C = _c(P.load_words_asm(P.FMT_MXFP8, 1))
_NLW_N1 = tl.constexpr((P.word_regs(0, 1) + P.scale_regs(1)) // 2)
_NLW_N2 = tl.constexpr((P.word_regs(0, 2) + P.scale_regs(2)) // 2)
_NLW_M1 = tl.constexpr((P.word_regs(1, 1) + P.scale_regs(1)) // 2)
_MR_N1, _MR_N1_C = _c(P.compute_asm(P.FMT_NVFP4, 1, regs=True))
_MR_N2, _MR_N2_C = _c(P.compute_asm(P.FMT_NVFP4, 2, regs=True))
_MR_M1, _MR_M1_C = _c(P.compute_asm(P.FMT_MXFP8, 1, regs=True))
_XL, _XL_C = _c(P.xload_asm())
_NX = tl.constexpr(P.X_REGS // 2)
_W1, _W_C = _c(P.wait_asm(1))
_W2, _ = _c(P.wait_asm(2))
_W3, _ = _c(P.wait_asm(3))
_W4, _ = _c(P.wait_asm(4))
_W5, _ = _c(P.wait_asm(5))
_W6, _ = _c(P.wait_asm(6))
_W7, _ = _c(P.wait_asm(7))
_ST_P1, _ST_P1_C = _c(P.store_asm(1, P.MODE_PARTIAL, 0))
_ST_P2, _ST_P2_C = _c(P.store_asm(2, P.MODE_PARTIAL, 0))
_ST_F1A0, _ST_F1A0_C = _c(P.store_asm(1, P.MODE_FINAL, 0))
_ST_F1A1, _ST_F1A1_C = _c(P.store_asm(1, P.MODE_FINAL, 1))
_ST_F1A2, _ST_F1A2_C = _c(P.store_asm(1, P.MODE_FINAL, 2))
_ST_F2A0, _ST_F2A0_C = _c(P.store_asm(2, P.MODE_FINAL, 0))
_ST_F2A1, _ST_F2A1_C = _c(P.store_asm(2, P.MODE_FINAL, 1))
_ST_F2A2, _ST_F2A2_C = _c(P.store_asm(2, P.MODE_FINAL, 2))
MAX_STAGES = 8


@helper
def issue_step(wk, sk, sw, ss, soff, nt, FMT: tl.constexpr, RP: tl.constexpr):
    """cp.async of one step's weight and scale bytes into the stage at byte offset soff (one commit group)."""
    args = (wk, sk, sw, ss, soff, nt)
    if FMT == 0:
        if RP == 1:
            return tl.inline_asm_elementwise(_IS_N1, _IS_N1_C, args, dtype=tl.int32, is_pure=False, pack=2)
        else:
            return tl.inline_asm_elementwise(_IS_N2, _IS_N2_C, args, dtype=tl.int32, is_pure=False, pack=2)
    else:
        if RP == 1:
            return tl.inline_asm_elementwise(_IS_M1, _IS_M1_C, args, dtype=tl.int32, is_pure=False, pack=2)
        else:
            return tl.inline_asm_elementwise(_IS_M2, _IS_M2_C, args, dtype=tl.int32, is_pure=False, pack=2)


@helper
def load_words(wk, sk, sw, ss, FMT: tl.constexpr, RP: tl.constexpr):
    """Register ring: one step's weight words and scale bits of this thread (opaque [T] int32 tuple)."""
    args = (wk, sk, sw, ss)
    if FMT == 0:
        if RP == 1:
            return tl.inline_asm_elementwise(_LW_N1, _LW_N1_C, args, dtype=(tl.int32,) * _NLW_N1, is_pure=False, pack=2)
        else:
            return tl.inline_asm_elementwise(_LW_N2, _LW_N2_C, args, dtype=(tl.int32,) * _NLW_N2, is_pure=False, pack=2)
    else:
        return tl.inline_asm_elementwise(_LW_M1, _LW_M1_C, args, dtype=(tl.int32,) * _NLW_M1, is_pure=False, pack=2)


@helper
def mma_regs(acc, st, xs, FMT: tl.constexpr, RP: tl.constexpr):
    """Register ring: acc += the step whose words load_words returned, with x registers xs."""
    args = acc + st + xs
    n: tl.constexpr = 2 * RP
    if FMT == 0:
        if RP == 1:
            return tl.inline_asm_elementwise(_MR_N1, _MR_N1_C, args, dtype=(tl.float32,) * n, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(_MR_N2, _MR_N2_C, args, dtype=(tl.float32,) * n, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(_MR_M1, _MR_M1_C, args, dtype=(tl.float32,) * n, is_pure=True, pack=2)


@helper
def load_x(xk, sx, mm):
    return tl.inline_asm_elementwise(_XL, _XL_C, (xk, sx, mm), dtype=(tl.int32,) * _NX, is_pure=False, pack=2)


@helper
def wait_stage(dep, STAGES: tl.constexpr):
    """cp.async.wait_group STAGES - 1: the oldest stage in flight has landed (dep orders it after the issue)."""
    if STAGES == 2:
        return tl.inline_asm_elementwise(_W1, _W_C, (dep,), dtype=tl.int32, is_pure=False, pack=2)
    elif STAGES == 3:
        return tl.inline_asm_elementwise(_W2, _W_C, (dep,), dtype=tl.int32, is_pure=False, pack=2)
    elif STAGES == 4:
        return tl.inline_asm_elementwise(_W3, _W_C, (dep,), dtype=tl.int32, is_pure=False, pack=2)
    elif STAGES == 5:
        return tl.inline_asm_elementwise(_W4, _W_C, (dep,), dtype=tl.int32, is_pure=False, pack=2)
    elif STAGES == 6:
        return tl.inline_asm_elementwise(_W5, _W_C, (dep,), dtype=tl.int32, is_pure=False, pack=2)
    elif STAGES == 7:
        return tl.inline_asm_elementwise(_W6, _W_C, (dep,), dtype=tl.int32, is_pure=False, pack=2)
    else:
        return tl.inline_asm_elementwise(_W7, _W_C, (dep,), dtype=tl.int32, is_pure=False, pack=2)


@helper
def mma_step(acc, xs, soff, nt, FMT: tl.constexpr, RP: tl.constexpr):
    """acc (2 * RP opaque [T] fp32) += the step in the stage at soff, with x registers xs."""
    args = acc + xs + (soff, nt)
    n: tl.constexpr = 2 * RP
    if FMT == 0:
        if RP == 1:
            return tl.inline_asm_elementwise(_MM_N1, _MM_N1_C, args, dtype=(tl.float32,) * n, is_pure=False, pack=2)
        else:
            return tl.inline_asm_elementwise(_MM_N2, _MM_N2_C, args, dtype=(tl.float32,) * n, is_pure=False, pack=2)
    else:
        if RP == 1:
            return tl.inline_asm_elementwise(_MM_M1, _MM_M1_C, args, dtype=(tl.float32,) * n, is_pure=False, pack=2)
        else:
            return tl.inline_asm_elementwise(_MM_M2, _MM_M2_C, args, dtype=(tl.float32,) * n, is_pure=False, pack=2)


@helper
def store_acc(acc, ya, n0, m, rs, aa, ast, RP: tl.constexpr, PARTIAL: tl.constexpr, ALPHA: tl.constexpr):
    """Write the accumulators (see _mma_ptx.store_asm); returns a dummy tensor."""
    args = acc + (ya, n0, m, rs, aa, ast)
    if PARTIAL:
        if RP == 1:
            return tl.inline_asm_elementwise(_ST_P1, _ST_P1_C, args, dtype=tl.int32, is_pure=False, pack=2)
        else:
            return tl.inline_asm_elementwise(_ST_P2, _ST_P2_C, args, dtype=tl.int32, is_pure=False, pack=2)
    elif RP == 1:
        if ALPHA == 0:
            return tl.inline_asm_elementwise(_ST_F1A0, _ST_F1A0_C, args, dtype=tl.int32, is_pure=False, pack=2)
        elif ALPHA == 1:
            return tl.inline_asm_elementwise(_ST_F1A1, _ST_F1A1_C, args, dtype=tl.int32, is_pure=False, pack=2)
        else:
            return tl.inline_asm_elementwise(_ST_F1A2, _ST_F1A2_C, args, dtype=tl.int32, is_pure=False, pack=2)
    else:
        if ALPHA == 0:
            return tl.inline_asm_elementwise(_ST_F2A0, _ST_F2A0_C, args, dtype=tl.int32, is_pure=False, pack=2)
        elif ALPHA == 1:
            return tl.inline_asm_elementwise(_ST_F2A1, _ST_F2A1_C, args, dtype=tl.int32, is_pure=False, pack=2)
        else:
            return tl.inline_asm_elementwise(_ST_F2A2, _ST_F2A2_C, args, dtype=tl.int32, is_pure=False, pack=2)


@helper
def step_addrs(w_row, s_row, k0, FMT: tl.constexpr):
    """Byte addresses of column k0 in the CTA's first weight row and its scale row."""
    if FMT == 0:
        return w_row + k0 // 2, s_row + k0 // 16
    else:
        return w_row + k0, s_row + k0 // 32


@helper
def reserve_smem(ptr, N, ROWS: tl.constexpr):
    """Never runs (N >= 0): the dead transpose makes Triton reserve ROWS * 512 bytes of dynamic shared memory
    (its layout-conversion scratch, at offset 0 of global_smem), which the cp.async stages use; nothing else
    in the kernel touches shared memory (checked at compile time by tests/kernels/test_mma_gemv.py)."""
    if N < 0:
        offs = tl.arange(0, ROWS)[:, None] * 128 + tl.arange(0, 128)[None, :]
        offs_t = tl.arange(0, 128)[:, None] * ROWS + tl.arange(0, ROWS)[None, :]
        tl.store(ptr + offs_t, tl.trans(tl.load(ptr + offs)))


@kernel
def mma_gemv(x_ptr, w_ptr, s_ptr, alpha_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xb, stride_ym, stride_wb,
             stride_sb, alpha_stride, SPLIT, FMT: tl.constexpr, ALPHA: tl.constexpr, SPLITK: tl.constexpr,
             RP: tl.constexpr, NW: tl.constexpr, BM: tl.constexpr, STAGES: tl.constexpr, SMEM_ROWS: tl.constexpr,
             REGS: tl.constexpr):
    """Strides ending in b are in bytes; stride_ym and alpha_stride in elements. SPLIT is a runtime value
    (one compiled variant serves every split count); SPLITK = SPLIT > 1 selects the partial-sum epilogue.
    STAGES steps of weights are in flight per thread (cp.async into private shared-memory chunks)."""
    T: tl.constexpr = 64 * NW
    NT: tl.constexpr = 32 * NW
    BN: tl.constexpr = 16 * RP * NW
    STAGE_BYTES: tl.constexpr = (RP * (2 if FMT == 0 else 4) + 1) * NT * 16
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
    sw = zi + stride_wb
    ss = zi + stride_sb
    sx = zi + stride_xb
    mm = zi + (M - 1)
    nt = zi + NT
    last = k_hi - 128
    acc = (tl.zeros([T], tl.float32),) * (2 * RP)
    xs = load_x(zl + (x_base + k_lo * 2), sx, mm)
    if REGS:
        # register ring: STAGES - 1 steps of words in flight (loaded steps ahead of their decode)
        wk, sk = step_addrs(w_row, s_row, k_lo, FMT)
        st0 = load_words(zl + wk, zl + sk, sw, ss, FMT, RP)
        if STAGES == 3:
            wk, sk = step_addrs(w_row, s_row, tl.minimum(k_lo + 128, last), FMT)
            st1 = load_words(zl + wk, zl + sk, sw, ss, FMT, RP)
            for k0 in range(k_lo, k_hi, 128):
                wk, sk = step_addrs(w_row, s_row, tl.minimum(k0 + 256, last), FMT)
                nxt = load_words(zl + wk, zl + sk, sw, ss, FMT, RP)
                xn = load_x(zl + (x_base + tl.minimum(k0 + 128, last) * 2), sx, mm)
                acc = mma_regs(acc, st0, xs, FMT, RP)
                st0 = st1
                st1 = nxt
                xs = xn
        else:
            for k0 in range(k_lo, k_hi, 128):
                wk, sk = step_addrs(w_row, s_row, tl.minimum(k0 + 128, last), FMT)
                nxt = load_words(zl + wk, zl + sk, sw, ss, FMT, RP)
                xn = load_x(zl + (x_base + tl.minimum(k0 + 128, last) * 2), sx, mm)
                acc = mma_regs(acc, st0, xs, FMT, RP)
                st0 = nxt
                xs = xn
    else:
        # shared-memory ring: stages 0 .. STAGES-2 in flight (steps past the slice reload the last one: one group
        # each, so the wait count stays STAGES - 1)
        reserve_smem(part_ptr, N, SMEM_ROWS)
        for s in tl.static_range(STAGES - 1):
            wk, sk = step_addrs(w_row, s_row, tl.minimum(k_lo + 128 * s, last), FMT)
            issue_step(zl + wk, zl + sk, sw, ss, zi + s * STAGE_BYTES, nt, FMT, RP)
        i = 0
        for k0 in range(k_lo, k_hi, 128):
            ahead = (i + STAGES - 1) % STAGES
            wk, sk = step_addrs(w_row, s_row, tl.minimum(k0 + 128 * (STAGES - 1), last), FMT)
            dep = issue_step(zl + wk, zl + sk, sw, ss, zi + ahead * STAGE_BYTES, nt, FMT, RP)
            xn = load_x(zl + (x_base + tl.minimum(k0 + 128, last) * 2), sx, mm)
            dep = wait_stage(dep, STAGES)
            acc = mma_step(acc, xs, zi + (i % STAGES) * STAGE_BYTES + dep, nt, FMT, RP)
            xs = xn
            i += 1
    if not SPLITK:
        store_acc(acc, zl + y_ptr.to(tl.int64), zi + n0, zi + M, zi + stride_ym, zl + alpha_ptr.to(tl.int64),
                  zi + alpha_stride, RP, False, ALPHA)
    else:
        slab = part_ptr.to(tl.int64) + pid_k.to(tl.int64) * (BM * N * 4)
        store_acc(acc, zl + slab, zi + n0, zi + M, zi + N, zl, zi, RP, True, 0)
        if take_ticket(count_ptr + pid_n, SPLIT):
            rn = n0 + tl.arange(0, BN)
            rm = tl.arange(0, BM)
            tile = rm[:, None] * N + rn[None, :]
            ymask = rm[:, None] < M
            total = ordered_sum(part_ptr, BM * N, tile, ymask, SPLIT)
            total = apply_alpha(total, alpha_ptr, rn, alpha_stride, ALPHA)
            tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], total.to(tl.bfloat16), mask=ymask)
            release_ticket(count_ptr + pid_n)


def check_mma_args(x: torch.Tensor, out: torch.Tensor, n: int, k: int, cfg: MmaGemvConfig, ws: GemmWorkspace) -> int:
    m = check_gemm_args(x, out, n, k, cfg, ws)
    if x.data_ptr() % 16 or (x.stride(0) * 2) % 16:
        raise ValueError(f"x: the MMA GEMV reads 16-byte vectors of each row; expected a 16-byte aligned base "
                         f"and row stride, found address % 16 = {x.data_ptr() % 16}, row stride {x.stride(0)} elements")
    return m


def launch_mma_gemv(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, alpha: torch.Tensor, alpha_stride: int,
                    out: torch.Tensor, ws: GemmWorkspace, *, fmt: int, alpha_mode: int, n: int, k: int,
                    cfg: MmaGemvConfig) -> torch.Tensor:
    """Same arguments as _linear.launch_gemm (w: int32 words for NVFP4, uint8 E4M3 for MXFP8). Compiled
    only: the raw calls send CPU tensors to _wstream with the same tiles (interpreted_config)."""
    if x.device.type not in ("cuda", "meta"):
        raise ValueError(f"x: the MMA GEMV runs compiled only (inline PTX), found a {x.device.type} tensor; "
                         "the raw call interprets _wstream_gemm for CPU tensors")
    m = check_mma_args(x, out, n, k, cfg, ws)
    cfg.check_format(fmt)
    grid = (n // cfg.BN, cfg.SPLIT)
    compiled = mma_gemv[grid](
        x, w, s, alpha, out, ws.part, ws.count, m, n, k, x.stride(0) * 2, out.stride(0), w.stride(0) * w.element_size(),
        s.stride(0) * s.element_size(), alpha_stride, cfg.SPLIT, FMT=fmt, ALPHA=alpha_mode, SPLITK=cfg.SPLIT > 1, RP=cfg.RP,
        NW=cfg.num_warps, BM=cfg.BM, STAGES=cfg.STAGES, SMEM_ROWS=cfg.smem_rows(fmt), REGS=cfg.REGS,
        num_warps=cfg.num_warps,
        num_stages=1,
    )
    if x.device.type == "cuda":
        _check_reserved(compiled, fmt, cfg)
    return out


_RESERVED_OK: set = set()


def _check_reserved(compiled, fmt: int, cfg: MmaGemvConfig) -> None:
    """The cp.async stages live in the shared memory Triton reserved for reserve_smem's dead transpose; raise
    (once per variant) if Triton reserved less than the stages need, instead of corrupting memory."""
    key = (fmt, cfg.RP, cfg.num_warps, cfg.STAGES)
    if cfg.REGS or key in _RESERVED_OK:
        return
    need = P.smem_bytes(fmt, cfg.RP, cfg.num_warps, cfg.STAGES)
    have = getattr(getattr(compiled, "metadata", None), "shared", None)
    if have is None or have < need:
        raise RuntimeError(f"mma_gemv {cfg}: the kernel reserved {have} bytes of shared memory, its {cfg.STAGES} "
                           f"cp.async stages need {need}; choose fewer stages or more warps")
    _RESERVED_OK.add(key)


def interpreted_config(cfg: MmaGemvConfig):
    """The _wstream tile that computes the same function on CPU tensors (interpreter: fp32 dots)."""
    from m3serve.kernels._linear import GemmConfig
    return GemmConfig(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, SPLIT=cfg.SPLIT, num_warps=cfg.num_warps)


def mma_split(n: int, k: int, cfg_bn: int, ctas: int = 396, min_steps: int = 2) -> int:
    """Split K (powers of two) until ~`ctas` CTAs (3 per H200 SM), keeping >= min_steps K steps each."""
    split = 1
    while (n // cfg_bn) * split * 2 <= ctas and k % (STEP * split * 2) == 0 and k // (STEP * split * 2) >= min_steps:
        split *= 2
    return split


# --- CPU execution of the same PTX (tests) ----------------------------------------------------------------


def emulate(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, alpha: torch.Tensor, alpha_stride: int, *, fmt: int,
            alpha_mode: int, n: int, k: int, cfg: MmaGemvConfig) -> torch.Tensor:
    """y [M, N] bf16 from running mma_gemv's PTX blocks on _ptx_emu, CTA by CTA and warp by warp, with the
    kernel's own scalar logic (the cp.async stage ring and its clamped steps, split-K in order 0..SPLIT-1,
    the Triton epilogue of the split path). CPU tensors; slow (meant for tiny shapes)."""
    import numpy as np

    from m3serve.kernels import _ptx_emu as E

    m = x.shape[0]
    if not 1 <= m <= cfg.BM or n % cfg.BN or k % (cfg.BK * cfg.SPLIT):
        raise ValueError(f"emulate: shape (M={m}, N={n}, K={k}) does not fit {cfg}")
    mem = E.Memory()
    xa = mem.add(x.contiguous().view(torch.int16).numpy())
    wa = mem.add(w.contiguous().numpy())
    sa = mem.add(s.contiguous().view(torch.uint8).numpy())
    aa = mem.add(alpha.contiguous().float().numpy())
    ya = mem.add(np.full((m, n), 0x7FC0, np.uint16))
    y = mem.regions[-1][1].view(np.uint16).reshape(m, n)  # the region's own buffer (stores land there)
    pa = mem.add(np.full(cfg.SPLIT * cfg.BM * n, np.nan, np.float32))
    part = mem.regions[-1][1].view(np.float32)
    stride_wb = w.stride(0) * w.element_size()
    stride_sb = s.stride(0) * s.element_size()
    issue, _ = P.issue_asm(fmt, cfg.RP)
    xload, _ = P.xload_asm()
    wait, _ = P.wait_asm(cfg.STAGES - 1)
    comp, _ = P.compute_asm(fmt, cfg.RP)
    comp_regs, _ = P.compute_asm(fmt, cfg.RP, regs=True)
    load_w, load_w_c = P.load_words_asm(fmt, cfg.RP)
    n_lw = load_w_c.count("=")
    n_acc = P.acc_regs(cfg.RP)
    nt = 32 * cfg.num_warps
    stage_bytes = P.chunks(fmt, cfg.RP) * nt * 16

    def pair(*vals: int) -> list[np.ndarray]:
        return [np.full(E.LANES, v & 0xFFFFFFFFFFFFFFFF, np.uint64) for v in vals for _ in range(2)]

    k_len = k // cfg.SPLIT
    for pid_n in range(n // cfg.BN):
        n0 = pid_n * cfg.BN
        for pid_k in range(cfg.SPLIT):
            k_lo, k_hi = pid_k * k_len, (pid_k + 1) * k_len
            last = k_hi - STEP
            shared = E.Shared(cfg.STAGES * stage_bytes)

            def wsk(k0: int) -> tuple[int, int]:
                if fmt == P.FMT_NVFP4:
                    return wa + n0 * stride_wb + k0 // 2, sa + n0 * stride_sb + k0 // 16
                return wa + n0 * stride_wb + k0, sa + n0 * stride_sb + k0 // 32

            for warp in range(cfg.num_warps):
                def issue_at(k0: int, slot: int) -> None:
                    wk, sk = wsk(min(k0, last))
                    E.run_block(issue, warp, pair(wk, sk, stride_wb, stride_sb, slot * stage_bytes, nt), 2, mem, shared)

                def words_at(k0: int) -> list[np.ndarray]:
                    wk, sk = wsk(min(k0, last))
                    return E.run_block(load_w, warp, pair(wk, sk, stride_wb, stride_sb), n_lw, mem, shared)

                def x_at(k0: int) -> list[np.ndarray]:
                    return E.run_block(xload, warp, pair(xa + min(k0, last) * 2, x.stride(0) * 2, m - 1), P.X_REGS,
                                       mem, shared)

                xs = x_at(k_lo)
                acc = [np.zeros(E.LANES, np.uint64) for _ in range(n_acc)]
                if cfg.REGS:
                    ring = [words_at(k_lo + STEP * d) for d in range(cfg.STAGES - 1)]
                    for k0 in range(k_lo, k_hi, STEP):
                        ring.append(words_at(k0 + STEP * (cfg.STAGES - 1)))
                        xn = x_at(k0 + STEP)
                        acc = E.run_block(comp_regs, warp, acc + ring.pop(0) + xs, n_acc, mem, shared)
                        xs = xn
                else:
                    for st in range(cfg.STAGES - 1):
                        issue_at(k_lo + STEP * st, st)
                    for i, k0 in enumerate(range(k_lo, k_hi, STEP)):
                        issue_at(k0 + STEP * (cfg.STAGES - 1), (i + cfg.STAGES - 1) % cfg.STAGES)
                        xn = x_at(k0 + STEP)
                        E.run_block(wait, warp, [], 2, mem, shared)
                        acc = E.run_block(comp, warp, acc + xs + pair((i % cfg.STAGES) * stage_bytes, nt), n_acc,
                                          mem, shared)
                        xs = xn
                if cfg.SPLIT == 1:
                    text, _ = P.store_asm(cfg.RP, P.MODE_FINAL, alpha_mode)
                    E.run_block(text, warp, acc + pair(ya, n0, m, n, aa, alpha_stride), 2, mem, shared)
                else:
                    text, _ = P.store_asm(cfg.RP, P.MODE_PARTIAL, 0)
                    E.run_block(text, warp, acc + pair(pa + pid_k * cfg.BM * n * 4, n0, m, n, 0, 0), 2, mem, shared)
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
