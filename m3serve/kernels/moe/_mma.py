"""The MoE's gate|up and down projections on the register-operand MMA step of _mma_gemv, for 1-8 tokens
(compiled for sm_90 only; the router is _nvfp4.moe_router, and on the CPU the raw call interprets _nvfp4's kernels).

Shape legend (T tokens <= 8, E experts, H hidden, I expert width, S routed slots; slot S is the shared expert):
    x          [T, H]        bf16
    w13, s13   [E, 2I, H/8] int32 words, [E, 2I, H/16] E4M3 (gate rows, then up rows); g13 [E, 2] fp32
    w2, s2     [E, H, I/8], [E, H, I/16]; g2 [E]
    shared     the same with E = 1 (NVFP4 only: a BF16 shared expert keeps _nvfp4's kernels)
    layout     w*/s* (routed and shared alike) row-major, or with tiled=True each expert's matrix in the MMA tile
               layout of m3serve.quant.nvfp4.tile_nvfp4 (same shapes; needs 8 * RP * num_warps % 16 == 0)
    slot_e     [SP]          touched experts ascending, -1 padded (moe_router)
    slot_w     [SP, T]       fp32 routing weight of token t for slot s (0: not routed)
    act        [S + 1, T, I] bf16 SwiGLU-OAI activations
    part       [DSPLIT, 8, H] fp32 down partials; count [H / BN] int32, zero between launches

Why: each touched expert at 1-8 tokens is a GEMV whose token columns come free with mma.m16n8k16, so both
projections run _mma_gemv's step (16-byte loads decoded in the registers that are the MMA's A operand) over
all T tokens, whether or not a token was routed to the expert: a token's activations for an expert it was not
routed to are computed and then weighted by 0 (slot_w), which costs MMA columns, not bytes.

Tiled: in the MMA tile layout each warp load reads 512 contiguous bytes of a 1 KB tile instead of 8 rows x 64 B
(1.2-1.4x on the linear MMA GEMV, bench/results/tiled_layout/tiled-layout-h200.json); the registers each lane
ends up with are the same, so only the load blocks and the step addresses differ.

gate|up (grid (I / BNA, S + 1), BNA = 8 * RP * warps activation columns): a thread's row pair is (gate row n,
up row n) (load_asm's gate_up pairing), so its accumulators hold both inputs of SwiGLU for the same (n, token)
and the epilogue (swiglu_store_asm) writes act directly; the whole K = H range per CTA (no partial workspace).
Opt-in (GSPLIT > 1, at few touched slots): grid (I / BNA, S + 1, split), each CTA over H / split, raw sums to
gpart and the last arrival's ordered sum + SwiGLU in Triton (swiglu_of_sums); see gate_up_split for why it is off.

down (grid (H / BN, DSPLIT), BN = 16 * RP * warps rows of H): one CTA walks the slots (touched experts in
ascending order, then the shared one), each over its I / DSPLIT slice; the register ring runs across slot
boundaries (the flat step index picks the slot), and at a slot's end fold_asm adds acc * 2**8 / g2[e] *
slot_w[s, t] into the output registers. Split over I with _splitk's ordered reduction.

Paired loops (MmaMoEConfig.PAIRED, on by default): at ring depth 2 a loop that runs one step an iteration must copy
the step it just loaded into the registers the next iteration reads (~25 MOVs of ~250 instructions a step, and the
one-token MoE's time follows its instructions: its microseconds are the same on the H100 and the H200); two steps an
iteration let the buffers alternate. Same steps, same order, same bits (a GPU test compares the two).

Hoisted gate|up loads (MmaMoEConfig.HOIST, opt-in, paired loop only): the load blocks otherwise derive a thread's
lane, warp, row block, half tile and x token from %laneid / %tid every step, though only the step's bases move; with
HOIST a prologue block (gate_up_lane_offsets_asm) computes the thread's offsets once and the loop's load blocks only
add them (the same addresses, so the same registers and bits). paired_k_steps takes the load blocks' trailing
operands as tuples, so the same loop runs either set of blocks.

Numerics (inside moe.nvfp4's bands): the decoded weights and the MMA are _mma_gemv's (exact products, fp32
accumulation); gate and up are scaled acc * 2**8 / g (correctly rounded division) as _nvfp4, SwiGLU-OAI in fp32
with the hardware exp2, activations rounded once to bf16; per-expert sums are weighted and added in slot order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton.language as tl

from m3serve.kernels.gemm import _mma_ptx as P
from m3serve.kernels._jit import helper, kernel
from m3serve.kernels._pdl import pdl_release, pdl_wait
from m3serve.kernels.gemm._mma_gemv import (MMA_ROWS, STEP, asm_block, mma_epilogue, paired_k_steps, ring_advance,
                                            step_addrs)
from m3serve.kernels.gemm._splitk import ordered_sum, release_ticket, take_ticket

_NX = tl.constexpr(P.X_REGS // 2)
_NVFP4 = tl.constexpr(P.FMT_NVFP4)  # step_addrs' format (jit code reads module globals only as constexprs)


@dataclass(frozen=True)
class MmaMoEConfig:
    """moe.nvfp4 on the MMA step at 1-8 tokens. The router fields and BT (its padded token tile) are
    MoEConfig's; DSPLIT splits the down projection's I range (I / DSPLIT a multiple of 128)."""

    BT: int = 16
    RBE: int = 16
    RBK: int = 128
    RSPLIT: int = 16
    router_warps: int = 4
    ROUTER_ROWS: int = 8  # MoEConfig's: token counts up to this take moe_router_rows
    RKC: int = 2048
    RP: int = 1
    num_warps: int = 4  # gate|up
    STAGES: int = 2
    # PAIRED: both K loops two steps an iteration, so the ring's two buffers alternate instead of being copied at
    # each back edge (~25 MOVs a step), and down's addresses from per-slot bases instead of a slot lookup and a
    # division every step: 250 -> 224 (gate|up) and 312 -> ~250 (down, a new slot every 3 steps) instructions a step,
    # gate|up at 64 registers instead of 72 (aot_check). Ring depth 2 only; same steps, same bits (a GPU test compares
    # the two loops bit for bit); the one-step loops side by side: bench/decode.py route target-moe-rolled
    PAIRED: bool = True
    # HOIST (opt-in, PAIRED at STAGES 2 only): gate|up's per-thread load offsets (lane, warp, row block, half tile,
    # x token) computed once before the K loop instead of in every step's load blocks, which then only add them to
    # the step's bases (_mma_ptx.gate_up_lane_offsets_asm): the same addresses, so the same bits. aot_check on M3 TP1
    # (tiled), instructions per paired iteration (two steps): 450 -> 418 at one token (the split launch), 446 -> 429
    # at 8 (ptxas already kept part of the lane arithmetic out of the default loop); but the split launch compiles to
    # 72 registers instead of 64 (ptxas overlaps more loads; capped at 64 it spills): 7 CTAs an SM, so its 960 CTAs
    # take 1.04 waves instead of 0.91 (whole-K launches: 64 -> 63 registers).
    # Its GPU test (hoisted == default, bit for bit) failed on the H100 at bacb4ea: the prologue ran pure and Triton
    # folded it into a splat (fixed at b717fe1); it passed at 01043e5. Off until a timing says which way this goes
    HOIST: bool = False
    DSPLIT: int = 4
    down_warps: int = 4
    down_stages: int = 2
    GSPLIT: int = 1  # gate|up K (= H) split at most this many ways ...
    GSPLIT_SLOTS: int = 0  # ... while (touched slots + shared) x split <= this (gate_up_split)
    maxnreg: int = 0  # split gate|up launches' registers per thread capped (ptxas maxnreg; 0: as compiled): more
    # CTAs resident. Whole-K launches keep theirs: capped at 64 they lost 5 % at 8 tokens on the H200
    down_maxnreg: int = 0  # the same for down, on MMA tiles only (row-major weights keep 8 bytes on the stack at 80)

    def __post_init__(self) -> None:
        for name in ("STAGES", "down_stages"):
            if getattr(self, name) not in (2, 3):
                raise ValueError(f"MmaMoEConfig.{name}: expected 2 or 3, found {getattr(self, name)}")
        for name in ("num_warps", "down_warps"):
            if getattr(self, name) not in (1, 2, 4, 8):
                raise ValueError(f"MmaMoEConfig.{name}: expected 1, 2, 4 or 8, found {getattr(self, name)}")
        if self.RP not in (1, 2):
            raise ValueError(f"MmaMoEConfig.RP: expected 1 or 2, found {self.RP}")
        if self.DSPLIT < 1:
            raise ValueError(f"MmaMoEConfig.DSPLIT: expected >= 1, found {self.DSPLIT}")
        for name in ("maxnreg", "down_maxnreg"):
            if getattr(self, name) and not 24 <= getattr(self, name) <= 255:
                raise ValueError(f"MmaMoEConfig.{name}: expected 0 or 24..255, found {getattr(self, name)}")
        if self.GSPLIT not in (1, 2, 3, 4, 6, 8):
            raise ValueError(f"MmaMoEConfig.GSPLIT: expected 1, 2, 3, 4, 6 or 8, found {self.GSPLIT}")
        if self.HOIST and not (self.PAIRED and self.STAGES == 2):
            raise ValueError(f"MmaMoEConfig.HOIST: the hoisted gate|up loads serve the paired loop only (PAIRED=True, "
                             f"STAGES=2), found PAIRED={self.PAIRED}, STAGES={self.STAGES}")

    def gate_up_split(self, slots: int) -> int:
        """The gate|up launch's K split for `slots` gate|up columns of CTAs (touched experts + the shared one): GSPLIT
        halved (rounding down) until its product with slots is <= GSPLIT_SLOTS (1: no split). Why: at one
        token the launch is 5 x I / BNA CTAs of whole-K rows, ~15 warps an SM, where 72 registers allow 28; a split
        multiplies the warps (more tokens touch enough experts by themselves). Alone it did not pay on the H100; with
        the split launches capped at 64 registers (maxnreg) it is ~4 % faster a layer, but the split variant then
        keeps 8 bytes on the stack inside its K loop, which the no-spill rule refuses (moe/nvfp4.py's MMA_MOE)."""
        p = self.GSPLIT
        while p > 1 and slots * p > self.GSPLIT_SLOTS:
            p //= 2
        return p

    @property
    def bna(self) -> int:
        """gate|up activation columns per CTA."""
        return 8 * self.RP * self.num_warps

    @property
    def dbn(self) -> int:
        """down rows of H per CTA."""
        return 16 * self.RP * self.down_warps

    def fits(self, h: int, i: int, tiled: bool = False) -> str | None:
        """None, or why (E, H, I) does not fit this config (tiled: with weights in the MMA tile layout)."""
        if tiled and self.bna % 16:
            # a gate|up CTA's first column must start a 16-row block, or its tiles would straddle two
            return (f"tiled: the gate|up tile 8 * RP * num_warps = {self.bna} (RP={self.RP}, num_warps="
                    f"{self.num_warps}) is not a multiple of the 16-row block of the MMA tile layout")
        if i % self.bna:
            return f"I={i} is not a multiple of the gate|up tile {self.bna}"
        if h % self.dbn:
            return f"H={h} is not a multiple of the down tile {self.dbn}"
        if h % (STEP * self.GSPLIT) or i % (STEP * self.DSPLIT):
            return (f"H / GSPLIT={h}/{self.GSPLIT} and I / DSPLIT={i}/{self.DSPLIT} must be multiples of "
                    f"{STEP}")
        return None


@functools.lru_cache(maxsize=None)
def gate_up_asm(rp: int, tiled: bool = False, hoist: bool = False) -> dict:
    """gate|up's PTX blocks (tiled: weights in the MMA tile layout) as the kernel's constexpr arguments. hoist
    (MmaMoEConfig.HOIST): LOAD / XLOAD are the hoisted blocks and OFFS their prologue (HOIST, OFFS, OFFS_C and N_OFF
    are passed only then, so the default variant's arguments stay as they were)."""
    if hoist:
        load, load_c = P.gate_up_load_hoisted_asm(rp, tiled)
        xload, xload_c = P.xload_hoisted_asm()
    else:
        load, load_c = P.tiled_gate_up_load_asm(rp) if tiled else P.load_asm(P.FMT_NVFP4, rp, gate_up=True)
        xload, xload_c = P.xload_asm()
    mma, mma_c = P.compute_asm(P.FMT_NVFP4, rp)
    store, store_c = P.swiglu_store_asm(rp)
    part, part_c = P.gate_up_partial_asm(rp)
    blocks = dict(LOAD=load, LOAD_C=load_c, N_LOAD=load_c.count("=") // 2, MMA=mma, MMA_C=mma_c, XLOAD=xload,
                  XLOAD_C=xload_c, STORE=store, STORE_C=store_c, PART=part, PART_C=part_c)
    if hoist:
        offs, offs_c = P.gate_up_lane_offsets_asm(rp, tiled)
        blocks.update(HOIST=True, OFFS=offs, OFFS_C=offs_c, N_OFF=offs_c.count("=") // 2)
    return blocks


def check_hoist_offsets(cfg: MmaMoEConfig, h: int, x_row_bytes: int) -> None:
    """Raise unless the hoisted blocks' 32-bit offsets hold every offset they stand for: a gate|up CTA's gate words
    lie within BNA * H / 2 bytes of its first row's (tiled: its row blocks' tiles, + the last half tile's 1 KB), its
    scales in fewer, and x's tokens within 8 row strides of the first."""
    if cfg.bna * (h // 2) + 1024 >= 2**32 or MMA_ROWS * x_row_bytes >= 2**32:
        raise ValueError(f"HOIST: the hoisted gate|up offsets are 32-bit; H={h} (BNA {cfg.bna}) or x's row stride of "
                         f"{x_row_bytes} bytes is too large for them")


@functools.lru_cache(maxsize=None)
def down_asm(rp: int, partial: bool, tiled: bool = False) -> dict:
    """down's PTX blocks (tiled: weights in the MMA tile layout, read by the linear GEMV's tiled load: down's row
    pairs are its (rA, rA + 8)) as the kernel's constexpr arguments."""
    load, load_c = P.tiled_load_asm(rp) if tiled else P.load_asm(P.FMT_NVFP4, rp)
    mma, mma_c = P.compute_asm(P.FMT_NVFP4, rp)
    xload, xload_c = P.xload_asm()
    fold, fold_c = P.fold_asm(rp)
    store, store_c = P.store_asm(rp, P.MODE_PARTIAL if partial else P.MODE_FINAL, 0)
    return dict(LOAD=load, LOAD_C=load_c, N_LOAD=load_c.count("=") // 2, MMA=mma, MMA_C=mma_c, XLOAD=xload,
                XLOAD_C=xload_c, FOLD=fold, FOLD_C=fold_c, STORE=store, STORE_C=store_c)


@helper
def swiglu_of_sums(g, u, gg, gu, alpha, limit):
    """swiglu_store_asm's epilogue in Triton, operation for operation (fp32): g * 2**8 / gg and u * 2**8 / gu
    (correctly rounded), g = min(g, limit), u = clamp(u, -limit, limit), g * (1 / (1 + 2**(-alpha g log2 e))) *
    (u + 1) with the hardware exp2 (ex2.approx; its flush of a subnormal result cannot change 1 + z)."""
    g = tl.div_rn(g * 256.0, gg)
    u = tl.div_rn(u * 256.0, gu)
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    z = tl.math.exp2((alpha * g) * -1.4426950216293335)  # -log2(e) as the fp32 the PTX block uses (0xBFB8AA3B)
    sg = tl.div_rn(tl.full(g.shape, 1.0, tl.float32), z + 1.0)
    return (g * sg) * (u + 1.0)


@kernel
def mma_moe_gate_up(x_ptr, w13_ptr, s13_ptr, g13_ptr, sw13_ptr, ss13_ptr, sg13_ptr, slot_e_ptr, act_ptr, part_ptr,
                    count_ptr, T, H, I, stride_xb, S, swiglu_alpha, swiglu_limit, GSPLIT, RP: tl.constexpr,
                    NW: tl.constexpr, STAGES: tl.constexpr, TILED: tl.constexpr, SPLITK: tl.constexpr,
                    PAIRED: tl.constexpr,
                    LOAD: tl.constexpr, LOAD_C: tl.constexpr, N_LOAD: tl.constexpr, MMA: tl.constexpr,
                    MMA_C: tl.constexpr, XLOAD: tl.constexpr, XLOAD_C: tl.constexpr, STORE: tl.constexpr,
                    STORE_C: tl.constexpr, PART: tl.constexpr, PART_C: tl.constexpr, PDL: tl.constexpr = False,
                    HOIST: tl.constexpr = False, OFFS: tl.constexpr = "", OFFS_C: tl.constexpr = "",
                    N_OFF: tl.constexpr = 0):
    """grid (I / BNA, S + 1, GSPLIT): program (j, s, k) -> act[s, :T, j*BNA:(j+1)*BNA] over H / GSPLIT columns of
    x. Padding slots (slot_e = -1) exit. SPLITK (GSPLIT > 1): each split stores its raw gate / up sums to
    part [GSPLIT, S + 1, T, 2I] fp32 and the last arrival of the (j, s) tile (count [(S + 1) I / BNA]) sums them in
    split order (_splitk) and applies SwiGLU-OAI (swiglu_of_sums). TILED: w13 / sw13 in the MMA tile layout (LOAD
    is tiled_gate_up_load_asm; BNA a multiple of 16). HOIST (PAIRED only): OFFS (gate_up_lane_offsets_asm) computes
    the thread's offsets once, and LOAD / XLOAD are the hoisted blocks that take them (gate_up_asm(hoist=True))."""
    pdl_wait(PDL)  # before any global access (_pdl)
    Tn: tl.constexpr = 64 * NW
    BNA: tl.constexpr = 8 * RP * NW
    NACC: tl.constexpr = 4 * RP // 2
    s = tl.program_id(1)
    n0 = tl.program_id(0) * BNA
    pid_k = tl.program_id(2)
    k_len = H // GSPLIT
    k_lo = pid_k * k_len
    k_hi = k_lo + k_len
    routed = s < S
    e = tl.load(slot_e_ptr + s, mask=routed, other=0)
    if (not routed) or e >= 0:
        row_b = (H // 2).to(tl.int64)
        srow_b = (H // 16).to(tl.int64)
        e64 = e.to(tl.int64)
        w_base = tl.where(routed, w13_ptr.to(tl.int64) + e64 * (2 * I) * row_b, sw13_ptr.to(tl.int64))
        s_base = tl.where(routed, s13_ptr.to(tl.int64) + e64 * (2 * I) * srow_b, ss13_ptr.to(tl.int64))
        gg = tl.where(routed, tl.load(g13_ptr + 2 * e), tl.load(sg13_ptr))
        gu = tl.where(routed, tl.load(g13_ptr + 2 * e + 1), tl.load(sg13_ptr + 1))
        zl = tl.zeros([Tn], tl.int64)
        zi = tl.zeros([Tn], tl.int32)
        zf = tl.zeros([Tn], tl.float32)
        w_row = w_base + n0.to(tl.int64) * row_b
        s_row = s_base + n0.to(tl.int64) * srow_b
        ub = zl + I * row_b  # the up row of activation column n is I rows after its gate row
        usb = zl + I * srow_b
        sw = zi + (H // 2) * (16 if TILED else 1)  # TILED: the next row block's tile
        ss = zi + (H // 16) * (16 if TILED else 1)
        sx = zi + stride_xb
        mm = zi + (T - 1)
        x_base = x_ptr.to(tl.int64)
        last = k_hi - 128
        acc = (zf,) * NACC
        if HOIST:
            # the thread's loop-invariant offsets, once (gate_up_lane_offsets_asm: x's, then the weights'); LOAD and
            # XLOAD are then the hoisted blocks, which only add them to a step's bases. Not pure: Triton folds a pure
            # block over uniform (splat) inputs into a splat of its first output, which would hand every thread's
            # second register (SO) the first (WO) - the GPU test caught it, the CPU emulation cannot
            offs = asm_block((sw, ss, sx, mm), False, N_OFF, OFFS, OFFS_C, False)
            load_tail = offs[1:] + (ub, usb)
            x_tail = (offs[0],)
        else:
            load_tail = (sw, ss, ub, usb)
            x_tail = (sx, mm)
        xs = asm_block((zl + (x_base + k_lo * 2),) + x_tail, False, _NX, XLOAD, XLOAD_C, False)
        wk, sk = step_addrs(w_row, s_row, k_lo, _NVFP4, TILED)
        st0 = asm_block((zl + wk, zl + sk) + load_tail, False, N_LOAD, LOAD, LOAD_C, False)
        st1 = st0
        if PAIRED:
            acc = paired_k_steps(acc, st0, xs, w_row, s_row, load_tail, x_base, k_lo, k_len // 128, last, zl, x_tail,
                                 _NVFP4, TILED, N_LOAD, LOAD, LOAD_C, XLOAD, XLOAD_C, NACC, MMA, MMA_C)
        else:
            if STAGES == 3:
                wk, sk = step_addrs(w_row, s_row, tl.minimum(k_lo + 128, last), _NVFP4, TILED)
                st1 = asm_block((zl + wk, zl + sk, sw, ss, ub, usb), False, N_LOAD, LOAD, LOAD_C, False)
            for k0 in range(k_lo, k_hi, 128):
                wk, sk = step_addrs(w_row, s_row, tl.minimum(k0 + 128 * (STAGES - 1), last), _NVFP4, TILED)
                nxt = asm_block((zl + wk, zl + sk, sw, ss, ub, usb), False, N_LOAD, LOAD, LOAD_C, False)
                xn = asm_block((zl + (x_base + tl.minimum(k0 + 128, last) * 2), sx, mm), False, _NX, XLOAD, XLOAD_C,
                               False)
                acc, st0, st1 = ring_advance(acc, st0, st1, nxt, xs, NACC, MMA, MMA_C, STAGES)
                xs = xn
        pdl_release(PDL)  # the main loop is done: let the next kernel's CTAs in (_pdl)
        if not SPLITK:
            act_slot = act_ptr.to(tl.int64) + s.to(tl.int64) * T * I * 2
            asm_block(acc + (zl + act_slot, zi + n0, zi + T, zi + I, zf + gg, zf + gu, zf + swiglu_alpha,
                             zf + swiglu_limit), False, 1, STORE, STORE_C, False)
        else:
            tile_stride = (tl.full([], 1, tl.int64) + S) * T * (2 * I)  # one split's [S + 1, T, 2I] (S, T may be
            # constexpr ints: Triton specializes a 1)
            slab = part_ptr.to(tl.int64) + (pid_k.to(tl.int64) * tile_stride + s.to(tl.int64) * T * (2 * I)) * 4
            asm_block(acc + (zl + slab, zi + n0, zi + T, zi + 2 * I, zi + I), False, 1, PART, PART_C, False)
            counter = count_ptr + s * (I // BNA) + tl.program_id(0)
            if take_ticket(counter, GSPLIT):
                rt = tl.arange(0, 8)
                rn = n0 + tl.arange(0, BNA)
                tile = s.to(tl.int64) * T * (2 * I) + rt[:, None] * (2 * I) + rn[None, :]
                tmask = rt[:, None] < T
                g = ordered_sum(part_ptr, tile_stride, tile, tmask, GSPLIT)
                u = ordered_sum(part_ptr, tile_stride, tile + I, tmask, GSPLIT)
                a = swiglu_of_sums(g, u, gg, gu, swiglu_alpha, swiglu_limit)
                tl.store(act_ptr + s.to(tl.int64) * T * I + rt[:, None] * I + rn[None, :], a.to(tl.bfloat16),
                         mask=tmask)
                release_ticket(counter)


@helper
def down_step(j, total, KT, n_valid, k_lo, n0, slot_e_ptr, w2_ptr, s2_ptr, sw2_ptr, ss2_ptr, act_ptr, T, H, I, S,
              TILED: tl.constexpr):
    """Byte addresses of flat step j (clamped to the last) of a down CTA: slot j // KT, its K tile j % KT:
    the weights and scales of the CTA's first row there (TILED: of its first tile of that step), and the
    slot's activations at that column."""
    j = tl.minimum(j, total - 1)
    s = j // KT
    k0 = k_lo + (j - s * KT) * 128
    w_row, s_row, a_base = down_slot_bases(s, n_valid, n0, slot_e_ptr, w2_ptr, s2_ptr, sw2_ptr, ss2_ptr, act_ptr, T, H,
                                           I, S)
    wk, sk = step_addrs(w_row, s_row, k0, _NVFP4, TILED)
    return wk, sk, a_base + k0 * 2


@helper
def down_slot_bases(s, n_valid, n0, slot_e_ptr, w2_ptr, s2_ptr, sw2_ptr, ss2_ptr, act_ptr, T, H, I, S):
    """Byte addresses of a down CTA's first weight row and scale row in slot s (a touched expert, or the shared one
    at s == n_valid), and of the slot's activations at column 0: once a slot in the paired loop, every step in the
    one-step loop (down_step)."""
    routed = s < n_valid
    e = tl.load(slot_e_ptr + s, mask=routed, other=0).to(tl.int64)
    row_b = (I // 2).to(tl.int64)
    srow_b = (I // 16).to(tl.int64)
    w_base = tl.where(routed, w2_ptr.to(tl.int64) + e * H * row_b, sw2_ptr.to(tl.int64))
    s_base = tl.where(routed, s2_ptr.to(tl.int64) + e * H * srow_b, ss2_ptr.to(tl.int64))
    a_slot = tl.where(routed, s, S).to(tl.int64)
    a_base = act_ptr.to(tl.int64) + a_slot * T * I * 2
    return w_base + n0.to(tl.int64) * row_b, s_base + n0.to(tl.int64) * srow_b, a_base


@helper
def down_fold(out, acc, s, n_valid, slot_e_ptr, g2_ptr, sg2_ptr, slot_w_ptr, T, zl, zi, zf, NACC: tl.constexpr,
              FOLD: tl.constexpr, FOLD_C: tl.constexpr):
    """out + slot s's sum acc * 2**8 / its global scale * each token's routing weight (the shared expert at s ==
    n_valid: weight 1)."""
    routed = s < n_valid
    e = tl.load(slot_e_ptr + s, mask=routed, other=0)
    cs = 256.0 / tl.where(routed, tl.load(g2_ptr + e), tl.load(sg2_ptr))
    wr = tl.where(routed, slot_w_ptr.to(tl.int64) + s.to(tl.int64) * T * 4, 0)
    return asm_block(out + acc + (zl + wr, zf + cs, zi + T), True, NACC, FOLD, FOLD_C, True)


@kernel
def mma_moe_down(act_ptr, w2_ptr, s2_ptr, g2_ptr, sw2_ptr, ss2_ptr, sg2_ptr, slot_e_ptr, slot_w_ptr, y_ptr, part_ptr,
                 count_ptr, T, H, I, S, stride_y, DSPLIT, KT, SP: tl.constexpr, SPLITK: tl.constexpr,
                 RP: tl.constexpr, NW: tl.constexpr, STAGES: tl.constexpr, PAIRED: tl.constexpr,
                 TILED: tl.constexpr, LOAD: tl.constexpr,
                 LOAD_C: tl.constexpr, N_LOAD: tl.constexpr, MMA: tl.constexpr, MMA_C: tl.constexpr,
                 XLOAD: tl.constexpr, XLOAD_C: tl.constexpr, FOLD: tl.constexpr, FOLD_C: tl.constexpr,
                 STORE: tl.constexpr, STORE_C: tl.constexpr, PDL: tl.constexpr = False):
    """grid (H / BN, DSPLIT): y[:T, tile] = sum_slots w_slot * (act_slot @ W2_e^T) / g2_e + act_S @ W2_sh^T /
    sg2, each CTA over I columns [pid_k * KT * 128, +KT * 128) of every slot (KT steps a slot). TILED: w2 / sw2
    in the MMA tile layout (LOAD is tiled_load_asm)."""
    pdl_wait(PDL)  # before any global access (_pdl)
    Tn: tl.constexpr = 64 * NW
    BN: tl.constexpr = 16 * RP * NW
    BM: tl.constexpr = 8
    NACC: tl.constexpr = 4 * RP // 2
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BN
    k_lo = pid_k * (KT * 128)
    n_valid = tl.sum((tl.load(slot_e_ptr + tl.arange(0, SP)) >= 0).to(tl.int32), axis=0)
    total = (n_valid + 1) * KT  # the touched slots, then the shared expert
    zl = tl.zeros([Tn], tl.int64)
    zi = tl.zeros([Tn], tl.int32)
    zf = tl.zeros([Tn], tl.float32)
    sw = zi + (I // 2) * (16 if TILED else 1)  # TILED: the next row block's tile
    ss = zi + (I // 16) * (16 if TILED else 1)
    sx = zi + I * 2
    mm = zi + (T - 1)
    zero = (zf,) * NACC
    acc = zero
    out = zero
    if PAIRED:
        # Two flat steps an iteration, the ring's two buffers alternating (no copies at the back edge), and the
        # addresses from per-slot bases (one slot_e load and no division a slot, not a step). (ls, lk): the slot
        # and K tile of the next step to load, (lw, lsb, la) its slot's bases. Same steps, same order, same folds
        # as the one-step loop, so the same bits.
        lw, lsb, la = down_slot_bases(0, n_valid, n0, slot_e_ptr, w2_ptr, s2_ptr, sw2_ptr, ss2_ptr, act_ptr, T, H,
                                      I, S)
        wk, sk = step_addrs(lw, lsb, k_lo, _NVFP4, TILED)
        st0 = asm_block((zl + wk, zl + sk, sw, ss), False, N_LOAD, LOAD, LOAD_C, False)
        xs = asm_block((zl + (la + k_lo * 2), sx, mm), False, _NX, XLOAD, XLOAD_C, False)
        ls = n_valid * 0
        lk = n_valid * 0
        for jp in range(0, total // 2):
            for half in tl.static_range(2):
                # advance the load cursor; a new slot's bases when it wraps (past the last step: the shared slot's
                # first step again, in bounds and unused). The cursor is one step ahead of the step computed below,
                # so a wrap means that step closes its slot, the one the cursor left (fs)
                fs = ls
                lk += 1
                wrapped = lk == KT
                if wrapped:
                    lk = lk * 0
                    ls = tl.minimum(ls + 1, n_valid)
                    lw, lsb, la = down_slot_bases(ls, n_valid, n0, slot_e_ptr, w2_ptr, s2_ptr, sw2_ptr, ss2_ptr,
                                                  act_ptr, T, H, I, S)
                k0 = k_lo + lk * 128
                wk, sk = step_addrs(lw, lsb, k0, _NVFP4, TILED)
                if half == 0:
                    sta = asm_block((zl + wk, zl + sk, sw, ss), False, N_LOAD, LOAD, LOAD_C, False)
                    xsa = asm_block((zl + (la + k0 * 2), sx, mm), False, _NX, XLOAD, XLOAD_C, False)
                    acc = asm_block(acc + st0 + xs, True, NACC, MMA, MMA_C, True)
                else:
                    st0 = asm_block((zl + wk, zl + sk, sw, ss), False, N_LOAD, LOAD, LOAD_C, False)
                    xs = asm_block((zl + (la + k0 * 2), sx, mm), False, _NX, XLOAD, XLOAD_C, False)
                    acc = asm_block(acc + sta + xsa, True, NACC, MMA, MMA_C, True)
                if wrapped:  # the computed step closed slot fs: fold it into out
                    out = down_fold(out, acc, fs, n_valid, slot_e_ptr, g2_ptr, sg2_ptr, slot_w_ptr, T, zl, zi, zf,
                                    NACC, FOLD, FOLD_C)
                    acc = zero
        if total % 2 == 1:  # odd step count: the last step (it closes the shared expert's slot)
            acc = asm_block(acc + st0 + xs, True, NACC, MMA, MMA_C, True)
            out = down_fold(out, acc, n_valid, n_valid, slot_e_ptr, g2_ptr, sg2_ptr, slot_w_ptr, T, zl, zi, zf, NACC,
                            FOLD, FOLD_C)
    else:
        wk, sk, xa = down_step(0, total, KT, n_valid, k_lo, n0, slot_e_ptr, w2_ptr, s2_ptr, sw2_ptr, ss2_ptr, act_ptr,
                               T, H, I, S, TILED)
        st0 = asm_block((zl + wk, zl + sk, sw, ss), False, N_LOAD, LOAD, LOAD_C, False)
        xs = asm_block((zl + xa, sx, mm), False, _NX, XLOAD, XLOAD_C, False)
        st1 = st0
        if STAGES == 3:
            wk, sk, xa = down_step(1, total, KT, n_valid, k_lo, n0, slot_e_ptr, w2_ptr, s2_ptr, sw2_ptr, ss2_ptr,
                                   act_ptr, T, H, I, S, TILED)
            st1 = asm_block((zl + wk, zl + sk, sw, ss), False, N_LOAD, LOAD, LOAD_C, False)
        for s in range(0, n_valid + 1):
            for kk in range(0, KT):
                j = s * KT + kk
                # x one step ahead; the weights STAGES - 1 steps ahead (the same step at ring depth 2: one address
                # walk)
                wk, sk, xa = down_step(j + 1, total, KT, n_valid, k_lo, n0, slot_e_ptr, w2_ptr, s2_ptr, sw2_ptr,
                                       ss2_ptr, act_ptr, T, H, I, S, TILED)
                if STAGES == 3:
                    wk, sk, _ = down_step(j + 2, total, KT, n_valid, k_lo, n0, slot_e_ptr, w2_ptr, s2_ptr, sw2_ptr,
                                           ss2_ptr, act_ptr, T, H, I, S, TILED)
                nxt = asm_block((zl + wk, zl + sk, sw, ss), False, N_LOAD, LOAD, LOAD_C, False)
                xn = asm_block((zl + xa, sx, mm), False, _NX, XLOAD, XLOAD_C, False)
                acc, st0, st1 = ring_advance(acc, st0, st1, nxt, xs, NACC, MMA, MMA_C, STAGES)
                xs = xn
            out = down_fold(out, acc, s, n_valid, slot_e_ptr, g2_ptr, sg2_ptr, slot_w_ptr, T, zl, zi, zf, NACC, FOLD,
                            FOLD_C)
            acc = zero
    pdl_release(PDL)  # the main loop is done: let the next kernel's CTAs in (_pdl)
    mma_epilogue(out, y_ptr, part_ptr, count_ptr, y_ptr, pid_n, pid_k, n0, T, H, stride_y, 0, DSPLIT, zl, zi, SPLITK,
                 0, BM, BN, STORE, STORE_C)


def launch_mma_moe(x, w13, s13, g13, w2, s2, g2, sw13, ss13, sg13, sw2, ss2, sg2, ws, out, *, t: int, h: int, e: int,
                   i: int, s: int, swiglu_alpha: float, swiglu_limit: float, cfg: MmaMoEConfig,
                   launches: str, tiled: bool = False) -> None:
    """The gate|up and down launches after moe_router (w*: int32 words, s*: uint8 scales; shared NVFP4).
    tiled: all of w13/s13, w2/s2, sw13/ss13, sw2/ss2 in the MMA tile layout (tile_nvfp4, per expert)."""
    if x.device.type not in ("cuda", "meta"):
        raise ValueError(f"x: the MMA MoE runs compiled only (inline PTX), found a {x.device.type} tensor")
    if t > MMA_ROWS:
        raise ValueError(f"x: the MMA MoE serves 1..{MMA_ROWS} tokens, found T={t}")
    if x.data_ptr() % 16:
        raise ValueError(f"x: the MMA MoE reads 16-byte vectors of each row; expected a 16-byte aligned base, found "
                         f"address % 16 = {x.data_ptr() % 16}")
    why = cfg.fits(h, i, tiled)
    if why:
        raise ValueError(f"shape (E={e}, H={h}, I={i}) does not fit {cfg}: {why}")
    sp = ws.slot_e.numel()
    if "g" in launches:
        gs = cfg.gate_up_split(s + 1)
        if gs > 1 and (ws.gpart.numel() < gs * (s + 1) * t * 2 * i or ws.gcount.numel() < (s + 1) * (i // cfg.bna)):
            raise ValueError(f"ws: the gate|up split {gs} needs gpart >= {gs * (s + 1) * t * 2 * i} and gcount >= "
                             f"{(s + 1) * (i // cfg.bna)} elements, found {ws.gpart.numel()} / {ws.gcount.numel()} "
                             "(make_moe_workspace sizes them for the token count)")
        if cfg.HOIST:
            check_hoist_offsets(cfg, h, x.stride(0) * 2)
        mma_moe_gate_up[(i // cfg.bna, s + 1, gs)](
            x, w13, s13, g13, sw13, ss13, sg13, ws.slot_e, ws.act, ws.gpart, ws.gcount, t, h, i, x.stride(0) * 2, s,
            float(swiglu_alpha), float(swiglu_limit), gs, RP=cfg.RP, NW=cfg.num_warps, STAGES=cfg.STAGES,
            TILED=tiled, SPLITK=gs > 1, PAIRED=cfg.PAIRED and cfg.STAGES == 2,
            **gate_up_asm(cfg.RP, tiled, cfg.HOIST), num_warps=cfg.num_warps, num_stages=1,
            **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and gs > 1 else {}))
    if "d" in launches:
        kt = i // cfg.DSPLIT // STEP
        mma_moe_down[(h // cfg.dbn, cfg.DSPLIT)](
            ws.act, w2, s2, g2, sw2, ss2, sg2, ws.slot_e, ws.slot_w, out, ws.dpart, ws.dcount, t, h, i, s,
            out.stride(0), cfg.DSPLIT, kt, SP=sp, SPLITK=cfg.DSPLIT > 1, RP=cfg.RP, NW=cfg.down_warps,
            STAGES=cfg.down_stages, PAIRED=cfg.PAIRED and cfg.down_stages == 2, TILED=tiled,
            **down_asm(cfg.RP, cfg.DSPLIT > 1, tiled), num_warps=cfg.down_warps,
            num_stages=1, **({"maxnreg": cfg.down_maxnreg} if cfg.down_maxnreg and tiled else {}))


def dpart_numel(cfg: MmaMoEConfig, h: int) -> int:
    return cfg.DSPLIT * MMA_ROWS * h if cfg.DSPLIT > 1 else 1


def gate_up_split_sizes(cfg: MmaMoEConfig, t: int, s: int, i: int) -> tuple[int, int]:
    """(gpart, gcount) elements for t tokens over s routed slots: the gate|up split's fp32 partials and its tickets
    (1, 1 without a split)."""
    gs = cfg.gate_up_split(s + 1)
    if gs == 1:
        return 1, 1
    return gs * (s + 1) * t * 2 * i, (s + 1) * (i // cfg.bna)


# --- CPU execution of the same PTX (tests) ----------------------------------------------------------------


def _swiglu_of_sums_np(g, u, gg: float, gu: float, alpha: float, limit: float):
    """swiglu_of_sums in numpy fp32 (exp2: numpy's, within 2 ulp of the hardware's; see _ptx_emu)."""
    import numpy as np

    f32 = np.float32
    g = (g * f32(256.0)).astype(f32) / f32(gg)
    u = (u * f32(256.0)).astype(f32) / f32(gu)
    g = np.minimum(g, f32(limit))
    u = np.minimum(np.maximum(u, f32(-limit)), f32(limit))
    z = np.exp2(((f32(alpha) * g).astype(f32) * f32(-1.4426950216293335)).astype(f32)).astype(f32)
    sg = f32(1.0) / (z + f32(1.0)).astype(f32)
    return ((g * sg).astype(f32) * (u + f32(1.0)).astype(f32)).astype(f32)


def emulate(x, w13, s13, g13, w2, s2, g2, sw13, ss13, sg13, sw2, ss2, sg2, slot_e, slot_w, *, s: int, cfg: MmaMoEConfig,
            swiglu_alpha: float, swiglu_limit: float, tiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(act [S + 1, T, I] bf16, y [T, H] bf16) from running both kernels' PTX blocks on _ptx_emu, CTA by CTA
    and warp by warp, with the kernels' own scalar logic (slot order, the ring across slot boundaries and its
    clamped last steps, split-K in order). CPU tensors (w*: uint8 packed bytes, s*: E4M3), tiny shapes.
    tiled: every w*/s* in the MMA tile layout, as launch_mma_moe's."""
    import numpy as np

    from m3serve.kernels.gemm import _ptx_emu as E

    t, h = x.shape
    i = w2.shape[2] * 2
    why = cfg.fits(h, i, tiled)
    if why or t > MMA_ROWS:
        raise ValueError(f"emulate: shape (T={t}, H={h}, I={i}) does not fit {cfg}: {why}")
    mem = E.Memory()
    xa = mem.add(x.contiguous().view(torch.int16).numpy())
    regions = {}
    for name, a in (("w13", w13), ("s13", s13), ("w2", w2), ("s2", s2), ("sw13", sw13), ("ss13", ss13), ("sw2", sw2),
                    ("ss2", ss2)):
        regions[name] = mem.add(a.contiguous().view(torch.uint8).numpy())
    swa = mem.add(slot_w.contiguous().float().numpy())
    act_base, act = mem.add_view(np.full((s + 1, t, i), 0x7FC0, np.uint16))
    y_base, y = mem.add_view(np.full((t, h), 0x7FC0, np.uint16))
    pa, part = mem.add_view(np.full(cfg.DSPLIT * MMA_ROWS * h, np.nan, np.float32))
    e_list = slot_e.tolist()
    n_valid = sum(1 for v in e_list if v >= 0)

    def pair(*vals) -> list:
        out = []
        for v in vals:
            if isinstance(v, float):
                v = int(np.float32(v).view(np.uint32))
            out += [np.full(E.LANES, int(v) & 0xFFFFFFFFFFFFFFFF, np.uint64)] * 2
        return out

    def ring(warp, n_steps, ahead, words_at, x_at, mma_text, n_acc, acc):
        """The kernels' loop: loads STAGES - 1 steps ahead (clamped to the last step), x one step ahead."""
        xs = x_at(0)
        pending = [words_at(d) for d in range(ahead)]
        for j in range(n_steps):
            pending.append(words_at(j + ahead))
            xn = x_at(j + 1)
            acc = E.run_block(mma_text, warp, acc + pending.pop(0) + xs, n_acc, mem)
            xs = xn
        return acc

    def step(w_row: int, s_row: int, k0: int) -> tuple[int, int]:
        """step_addrs of the kernels."""
        if tiled:
            return w_row + (k0 // STEP) * 1024, s_row + (k0 // STEP) * 128
        return w_row + k0 // 2, s_row + k0 // 16

    n_acc = P.acc_regs(cfg.RP)
    # gate|up (split over K when gate_up_split says so: each split's raw sums stored by PART, then the last
    # arrival's ordered sum and swiglu_of_sums, here in numpy fp32)
    gu = gate_up_asm(cfg.RP, tiled, cfg.HOIST)
    n_load = 2 * gu["N_LOAD"]
    row_b, srow_b = h // 2, h // 16
    block_b, sblock_b = (16 * row_b, 16 * srow_b) if tiled else (row_b, srow_b)  # the kernels' sw, ss
    gsplit = cfg.gate_up_split(s + 1)
    steps = h // STEP // gsplit
    gpa, gpart = mem.add_view(np.full((gsplit, s + 1, t, 2 * i), np.nan, np.float32))
    f32 = np.float32
    for sl in range(s + 1):
        routed = sl < s
        ex = e_list[sl] if routed else 0
        if routed and ex < 0:
            continue
        wb = regions["w13"] + ex * 2 * i * row_b if routed else regions["sw13"]
        sb = regions["s13"] + ex * 2 * i * srow_b if routed else regions["ss13"]
        gg, gup = (float(g13[ex, 0]), float(g13[ex, 1])) if routed else (float(sg13[0, 0]), float(sg13[0, 1]))
        for j in range(i // cfg.bna):
            n0 = j * cfg.bna
            for kk in range(gsplit):
                k_lo = kk * steps * STEP
                for warp in range(cfg.num_warps):
                    # the load blocks' operands after the step's bases: the strides, or (HOIST) the offsets of the
                    # kernel's prologue, run once before the loop (x's pair first, then the weights')
                    if cfg.HOIST:
                        offs = E.run_block(gu["OFFS"], warp, pair(block_b, sblock_b, h * 2, t - 1), 2 * gu["N_OFF"],
                                           mem)
                        load_tail, x_tail = offs[2:] + pair(i * row_b, i * srow_b), offs[:2]
                    else:
                        load_tail, x_tail = pair(block_b, sblock_b, i * row_b, i * srow_b), pair(h * 2, t - 1)

                    def words_at(st, n0=n0, wb=wb, sb=sb, k_lo=k_lo, load_tail=load_tail):
                        wk, sk = step(wb + n0 * row_b, sb + n0 * srow_b, k_lo + min(st, steps - 1) * STEP)
                        return E.run_block(gu["LOAD"], warp, pair(wk, sk) + load_tail, n_load, mem)

                    def x_at(st, k_lo=k_lo, x_tail=x_tail):
                        xk = xa + (k_lo + min(st, steps - 1) * STEP) * 2
                        return E.run_block(gu["XLOAD"], warp, pair(xk) + x_tail, P.X_REGS, mem)

                    acc = ring(warp, steps, cfg.STAGES - 1, words_at, x_at, gu["MMA"], n_acc,
                               [np.zeros(E.LANES, np.uint64) for _ in range(n_acc)])
                    if gsplit == 1:
                        E.run_block(gu["STORE"], warp, acc + pair(act_base + sl * t * i * 2, n0, t, i, gg, gup,
                                                                  float(swiglu_alpha), float(swiglu_limit)), 2, mem)
                    else:
                        E.run_block(gu["PART"], warp, acc + pair(gpa + (kk * (s + 1) + sl) * t * 2 * i * 4, n0, t,
                                                                 2 * i, i), 2, mem)
            if gsplit > 1:
                g = np.zeros((t, cfg.bna), f32)
                u = np.zeros((t, cfg.bna), f32)
                for kk in range(gsplit):
                    g = (g + gpart[kk, sl, :, n0:n0 + cfg.bna]).astype(f32)
                    u = (u + gpart[kk, sl, :, i + n0:i + n0 + cfg.bna]).astype(f32)
                act[sl, :, n0:n0 + cfg.bna] = E._f32_to_bf16_rne(
                    _swiglu_of_sums_np(g, u, gg, gup, swiglu_alpha, swiglu_limit)).astype(np.uint16)
    # down
    dn = down_asm(cfg.RP, cfg.DSPLIT > 1, tiled)
    n_load = 2 * dn["N_LOAD"]
    row_b, srow_b = i // 2, i // 16
    block_b, sblock_b = (16 * row_b, 16 * srow_b) if tiled else (row_b, srow_b)
    kt = i // cfg.DSPLIT // STEP
    total = (n_valid + 1) * kt
    for pid_n in range(h // cfg.dbn):
        n0 = pid_n * cfg.dbn
        for pid_k in range(cfg.DSPLIT):
            k_lo = pid_k * kt * STEP
            for warp in range(cfg.down_warps):
                def at(jj):
                    jj = min(jj, total - 1)
                    sl = jj // kt
                    routed = sl < n_valid
                    ex = e_list[sl] if routed else 0
                    wb = regions["w2"] + ex * h * row_b if routed else regions["sw2"]
                    sb = regions["s2"] + ex * h * srow_b if routed else regions["ss2"]
                    k0 = k_lo + (jj - sl * kt) * STEP
                    return (*step(wb + n0 * row_b, sb + n0 * srow_b, k0),
                            act_base + ((sl if routed else s) * t * i + k0) * 2)

                def words_at(jj):
                    wk, sk, _ = at(jj)
                    return E.run_block(dn["LOAD"], warp, pair(wk, sk, block_b, sblock_b), n_load, mem)

                def x_at(jj):
                    return E.run_block(dn["XLOAD"], warp, pair(at(jj)[2], i * 2, t - 1), P.X_REGS, mem)

                out = [np.zeros(E.LANES, np.uint64) for _ in range(n_acc)]
                xs = x_at(0)
                pending = [words_at(d) for d in range(cfg.down_stages - 1)]
                for sl in range(n_valid + 1):
                    acc = [np.zeros(E.LANES, np.uint64) for _ in range(n_acc)]
                    for kk in range(kt):
                        jj = sl * kt + kk
                        pending.append(words_at(jj + cfg.down_stages - 1))
                        xn = x_at(jj + 1)
                        acc = E.run_block(dn["MMA"], warp, acc + pending.pop(0) + xs, n_acc, mem)
                        xs = xn
                    routed = sl < n_valid
                    gs = float(g2[e_list[sl]]) if routed else float(sg2[0])
                    cs = float(np.float32(256.0) / np.float32(gs))
                    wr = swa + sl * t * 4 if routed else 0
                    out = E.run_block(dn["FOLD"], warp, out + acc + pair(wr, cs, t), n_acc, mem)
                if cfg.DSPLIT == 1:
                    E.run_block(dn["STORE"], warp, out + pair(y_base, n0, t, h, 0, 0), 2, mem)
                else:
                    E.run_block(dn["STORE"], warp, out + pair(pa + pid_k * MMA_ROWS * h * 4, n0, t, h, 0, 0), 2, mem)
        if cfg.DSPLIT > 1:
            tile = part.reshape(cfg.DSPLIT, MMA_ROWS, h)[:, :t, n0:n0 + cfg.dbn]
            tot = np.zeros(tile.shape[1:], np.float32)
            for sp_ in range(cfg.DSPLIT):
                tot = (tot + tile[sp_]).astype(np.float32)
            y[:, n0:n0 + cfg.dbn] = E._f32_to_bf16_rne(tot).astype(np.uint16)
    as_bf16 = lambda a: torch.from_numpy(a.astype(np.int16).copy()).view(torch.bfloat16)  # noqa: E731
    return as_bf16(act), as_bf16(y)
