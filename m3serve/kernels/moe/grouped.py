"""Catalog entry moe.grouped: the MiniMax-M3 routed experts for any row count (1..16384) and any expert weight
format (BF16, FP8, MXFP8, NVFP4), graph-safe: every shape and grid depends on the token count T only.

Steps (all on the device, none syncs with the host):
  1. route       fp32 sigmoid router, top-k of (sigmoid + bias) (the bias only selects), weights renormalised
                 x routed_scaling: model/moe.py's `route` op for op; each token's slots then sorted by expert id
  2. group       (token, slot) pairs sorted by expert (stable), each expert's run padded to a multiple of BM,
                 into a FIXED length L = NP + min(E, NP) (BM - 1) (NP = T A): torch sort / searchsorted / cumsum /
                 scatter, no `.item()`, `.tolist()`, `unique` or `nonzero`. Decode batches (T <= 64): steps 1-2
                 after the router GEMM are one single-program launch (route_group_small), same values
  3. gate|up     one launch over (block, N tile), SwiGLU-OAI epilogue, bf16 activations (_grouped)
  4. down        one launch over (block, H tile), bf16 expert output per pair
  5. combine     one launch: out = bf16((sum_a y_a * w_a) * routed_scaling + shared), slots in expert order

Row bands: steps 3-4 decode quantized experts in registers (every tile of every block), except in the decode-once
band (quantized experts at the M3 TP1 shape from DECODE_ONCE_ROWS = 4096 tokens, GroupedConfig.DECODE_ONCE): there
the experts are decoded in groups of EXPERT_GROUP (32: a 2.4 GB bf16 scratch at M3 dims) into one bf16 scratch
(_grouped.decode_experts: the exact group-scaled values load_w_tile hands the MMA), and the same gate|up and down
kernels run per group on the bf16 operand path, restricted to the group's experts, with the quantized format's
per-row factor applied to the fp32 sums as before (_grouped.row_factor): the same operands, accumulation precision,
factor and roundings, so the same compare bands (only the summation order differs). Why: at prefill chunks every
expert tile is decoded by every block of that expert (T A / E / BM of them: 2 at 8192 tokens, BM 128), and the
in-register decode keeps the MMA loop off tensor-core rate (NVFP4 8192-token prefill of minimax-m3:5 on the H200:
~38 ms in moe.grouped vs ~16 ms with BF16 experts, ~11 ms more per layer), while decoding a layer's 128 experts once
writes ~14.5 GB of bf16 (~3-5 ms at HBM rate). At 4096 tokens the difference is half that, about the decode's
cost: the band starts there. The groups bound the scratch; their loop is over host ints fixed by E, so the call
stays graph-safe and free of host syncs. DECODE_AHEAD (opt-in; on the H200 not faster than serial, so no cell uses it)
double-buffers the scratch: the next group's decode (memory-bound) runs on a side stream while this group's GEMM
(tensor-core-bound) runs, each GEMM still reading exactly what the serial band reads (_decode_ahead);
bench/moe_grouped.py --decode-once times the serial band against it (groups of 16, the same 2.4 GB, and of 32).

Semantics (the reference, fp32 with TF32 off):
    ids, w = route(x)                               (w renormalised, times routed_scaling in the combine)
    act_e  = bf16(swiglu_oai(x @ W13_e^T))          (gate rows first, then up rows: the stock layout)
    y_e    = bf16(act_e @ W2_e^T)                   (stock rounds each expert's output to bf16 as well)
    out    = bf16((sum_k w_k y_{e_k}) * routed_scaling + shared)
The shared expert is the caller's: `shared` is its bf16 output [T, H] (or None). The routing hook computes it
with the model's own DenseMLP, whose linears are routed (linear.* entries, cuBLAS for BF16): one dense MLP over
all T tokens is a plain GEMM that those paths already run at full rate, so folding it into the grouped launches
as an extra "expert" would only add one more A-row block per token to the combine.

Cell shape key: (FMT, E, H, I, A) with FMT the _decode code (0 NVFP4, 1 MXFP8, 2 FP8, 3 BF16).

Shape legend (see _grouped for the kernels' views):
    x [T, H] bf16; router_w [E, H] fp32/bf16; router_bias [E] fp32
    dense  w13 [E, 2I, H] bf16,   s13 None,                   f13 None
    fp8    w13 [E, 2I, H] e4m3,   s13 None,                   f13 [E, P13] fp32 DECODE (W = q f)
    mxfp8  w13 [E, 2I, H] e4m3,   s13 [E, 2I, H/32] uint8 E8M0, f13 None
    nvfp4  w13 [E, 2I, H/2] uint8, s13 [E, 2I, H/16] e4m3,    f13 [E, P13] fp32 ENCODE (W = e2m1 s / f)
    w2, s2, f2 the same for [E, H, I] (P2 parts); shared [T, H] bf16 or None; out [T, H] bf16.
These are the in-memory QWeight layouts (m3serve/model/qweight.py): both published NVFP4 checkpoint layouts
(ModelOpt, compressed-tensors) are normalised to `packed, scale, global_scale` (ENCODE) at load.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch
import triton

from m3serve.kernels.formats._decode import FMT_BF16, FMT_FP8, FMT_MXFP8, FMT_NVFP4
from m3serve.kernels.formats._e2m1_ptx import use_ptx
from m3serve.kernels._jit import is_compiled
from m3serve.kernels.gemm._linear import fresh_x
from m3serve.kernels.gemm._tiled import _scratch as bf16_scratch
from m3serve.kernels.moe._grouped import (decode_experts, grouped_combine, grouped_down, grouped_gate_up,
                                          route_group_small)
from m3serve.kernels.catalog import (BF16_REL, FP32_U, Case, Cell, Entry, assert_band, device_rng, gemm_band,
                                     poisoned, true_fp32)
from m3serve.kernels.gemm.mxfp8 import random_e4m3
from m3serve.kernels.moe.nvfp4 import SWIGLU_ALPHA, SWIGLU_LIMIT, check_swiglu, random_experts, swiglu_oai_ref
from m3serve.model.layers import swiglu_oai
from m3serve.model.qweight import QWeight
from m3serve.quant.tiles import tileable, to_layout

ENABLED = True  # the one switch: False sends moe.grouped calls down the stock path

FMT_NAMES = {FMT_NVFP4: "nvfp4", FMT_MXFP8: "mxfp8", FMT_FP8: "fp8", FMT_BF16: "dense"}
FMT_CODES = {v: k for k, v in FMT_NAMES.items()}
_GS = {FMT_NVFP4: 16, FMT_MXFP8: 32, FMT_FP8: 32, FMT_BF16: 32}  # decode group (FP8 / BF16: no group scale)


@dataclass(frozen=True)
class GroupedConfig:
    BM: int  # padded pairs per block (the MMA's narrow side): one block = one expert
    BN: int = 64  # gate|up N tile (over I)
    BK: int = 128
    DBN: int = 0  # down N tile over H (0: BN)
    DBK: int = 0  # down K tile over I (0: BK)
    num_warps: int = 4
    num_stages: int = 3
    down_warps: int = 0  # 0: num_warps
    down_stages: int = 0  # 0: num_stages
    GM: int = 8  # blocks per program group sharing each weight tile (_grouped.swizzle)
    CBT: int = 4  # combine: tokens x hidden columns per program
    CBH: int = 512
    DECODE_ONCE: bool = False  # quantized experts decoded to a bf16 scratch per expert group (module docstring)
    EXPERT_GROUP: int = 32  # experts per decoded group: the scratch holds EXPERT_GROUP x 2I x H bf16
    DECODE_AHEAD: bool = False  # decode-once band: the next group's decode on a side stream into a second scratch
                                # while this group's GEMM runs (_decode_ahead)
    DEC_BN: int = 64  # decode_experts tile (rows x columns of one expert weight per program)
    DEC_BK: int = 128

    @property
    def dbn(self) -> int:
        return self.DBN or self.BN

    @property
    def dbk(self) -> int:
        return self.DBK or self.BK


def padded_length(t: int, e: int, a: int, bm: int) -> tuple[int, int]:
    """(L, NB): the fixed padded pair count (a multiple of BM) and block count for T tokens: each expert's run
    of c pairs takes ceil(c / BM) blocks, at most NP / BM + (experts touched) <= NP / BM + min(E, NP)."""
    np_ = t * a
    nb = triton.cdiv(np_ + min(e, np_) * (bm - 1), bm)
    return nb * bm, nb


@dataclass
class GroupedWorkspace:
    """The two large intermediates (allocated by the caller; the routing hook makes one per call so that any
    row count costs only its own size) and, after a call, the routing it used (for the compare)."""
    act: torch.Tensor  # [L, I] bf16
    y: torch.Tensor  # [T*A, H] bf16
    ids: torch.Tensor | None = None  # [T, A] int64 (int32 from the decode-batch path), each row ascending
    weights: torch.Tensor | None = None  # [T, A] fp32, sum 1 per row (before routed_scaling)
    pair: torch.Tensor | None = None  # [L] int32
    blk_e: torch.Tensor | None = None  # [NB] int32
    extra: dict = field(default_factory=dict)
    wdec: torch.Tensor | None = None  # decode-once band: [decode_scratch_numel] bf16, one group's decoded weight


def decode_scratch_numel(cfg: GroupedConfig, e: int, h: int, i: int) -> int:
    """bf16 elements of the decode-once scratch: one group's gate|up [G, 2I, H] or down [G, H, I] weight at a time
    (down is decoded after the group's gate|up launch has read gate|up: stream order); two such buffers with
    DECODE_AHEAD (one decoded while the GEMM reads the other)."""
    return (2 if cfg.DECODE_AHEAD else 1) * min(cfg.EXPERT_GROUP, e) * 2 * i * h


def make_workspace(cfg: GroupedConfig, t: int, e: int, h: int, i: int, a: int, device: torch.device
                   ) -> GroupedWorkspace:
    """act and y sized by this call's rows; in the decode-once band also the decode scratch, which is the
    device's one bf16 scratch (gemm/_tiled's, shared with the dense linears' decode; grown, never shrunk): every
    layer and call reuses it (calls are stream-ordered; two streams must not run the band at once)."""
    length, _ = padded_length(t, e, a, cfg.BM)
    wdec = bf16_scratch(device, torch.bfloat16, decode_scratch_numel(cfg, e, h, i)) if cfg.DECODE_ONCE else None
    return GroupedWorkspace(act=torch.empty(length, i, dtype=torch.bfloat16, device=device),
                            y=torch.empty(t * a, h, dtype=torch.bfloat16, device=device), wdec=wdec)


# --- steps 1-2: routing and grouping (torch, no host sync) ------------------------------------------


def route_sorted(x: torch.Tensor, router_w: torch.Tensor, router_bias: torch.Tensor, top_k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (ids [T, A] int64 ascending per row, weights [T, A] fp32 summing to 1): model/moe.py's
    `route` op for op (so the same bits on the same device), then each token's slots in expert order."""
    scores = torch.sigmoid(x.float() @ router_w.float().t())                        # [T, E]
    _, ids = torch.topk(scores + router_bias.float(), top_k, dim=-1)                # the bias only selects
    w = scores.gather(1, ids)
    w = w / w.sum(dim=-1, keepdim=True)
    ids, order = ids.sort(dim=1)
    return ids, w.gather(1, order)


def group_pairs(ids: torch.Tensor, e: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, A] -> (pair [L] int32, blk_e [NB] int32): the pairs p = t*A + a sorted by expert (stable: pair
    order within an expert), each expert's run starting at a multiple of BM; -1 at padded positions; blk_e the
    expert of each block (E past the last used block). Shapes depend on T only."""
    t, a = ids.shape
    np_ = t * a
    length, nb = padded_length(t, e, a, bm)
    dev = ids.device
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)                                         # [NP]
    sorted_e = flat[order]
    experts = torch.arange(e, device=dev, dtype=flat.dtype)
    start = torch.searchsorted(sorted_e, experts)                                     # [E] first sorted index
    count = torch.searchsorted(sorted_e, experts, right=True) - start
    padded = (count + bm - 1) // bm * bm
    pend = torch.cumsum(padded, 0)                                                    # [E] padded run ends
    dest = (pend - padded)[sorted_e] + torch.arange(np_, device=dev) - start[sorted_e]
    pair = torch.full((length,), -1, dtype=torch.int32, device=dev)
    pair.scatter_(0, dest, order.to(torch.int32))                                     # distinct destinations
    blk_e = torch.searchsorted(pend, torch.arange(nb, device=dev) * bm, right=True).to(torch.int32)
    return pair, blk_e


# Decode batches (T <= SMALL_T, E <= SMALL_E): after the router GEMM, the routing and the grouping run as one
# single-program launch (route_group_small) instead of a dozen small torch ops. Its tiles are sized for SMALL_T
# whatever T is, so one compiled variant serves every decode row count of a cell.
SMALL_T = 64
SMALL_E = 256


def _route_group_small(x, router_w, router_bias, top_k: int, bm: int, length: int, nb: int):
    """route_sorted + group_pairs for T <= SMALL_T: (ids int32, weights, pair, blk_e), the same values (weights up
    to the order of the 4-term renormalising sum)."""
    t, e = x.shape[0], router_w.shape[0]
    dev = x.device
    logits = x.float() @ router_w.float().t()                                        # [T, E], as route
    ids = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    pair = torch.empty(length, dtype=torch.int32, device=dev)
    blk_e = torch.empty(nb, dtype=torch.int32, device=dev)
    l_max, nb_max = padded_length(SMALL_T, e, top_k, bm)
    route_group_small[(1,)](logits, router_bias, ids, weights, pair, blk_e, t, e, length, nb, A=top_k, BM=bm,
                            TP=SMALL_T, EP=triton.next_power_of_2(e), LP=triton.next_power_of_2(l_max),
                            NBP=triton.next_power_of_2(nb_max), num_warps=16)
    return ids, weights, pair, blk_e


# --- the raw call -------------------------------------------------------------------------------


def _check_weight(name: str, fmt: int, w, s, f, e: int, n: int, k: int, dev) -> int:
    """Validates one stacked expert weight; returns its part count P (1 without per-part factors)."""

    def need(label, t, dtype, shape):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{label}: expected a torch.Tensor for {FMT_NAMES[fmt]} experts, found {type(t).__name__}")
        if t.dtype != dtype:
            raise TypeError(f"{label}: expected dtype {dtype} for {FMT_NAMES[fmt]} experts, found {t.dtype}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"{label}: expected shape {tuple(shape)}, found {tuple(t.shape)}")
        if t.device != dev or not t.is_contiguous():
            raise ValueError(f"{label}: expected a contiguous tensor on {dev}, found {t.device} strides {t.stride()}")

    def none(label, t):
        if t is not None:
            raise ValueError(f"{label}: expected None for {FMT_NAMES[fmt]} experts")

    p = 1
    if fmt in (FMT_FP8, FMT_NVFP4):
        if not isinstance(f, torch.Tensor) or f.dim() != 2 or f.shape[0] != e or f.shape[1] not in (1, 2) \
                or n % f.shape[1]:
            raise ValueError(f"{name} factors: expected fp32 [E={e}, P] with P in (1, 2) dividing {n}, found "
                             f"{None if not isinstance(f, torch.Tensor) else tuple(f.shape)}")
        need(f"{name} factors", f, torch.float32, None)
        p = f.shape[1]
    if fmt == FMT_BF16:
        need(name, w, torch.bfloat16, (e, n, k))
        none(f"{name} scale", s)
        none(f"{name} factors", f)
    elif fmt == FMT_FP8:
        need(name, w, torch.float8_e4m3fn, (e, n, k))
        none(f"{name} scale", s)
    elif fmt == FMT_MXFP8:
        need(name, w, torch.float8_e4m3fn, (e, n, k))
        need(f"{name} scale", s, torch.uint8, (e, n, k // 32))
        none(f"{name} factors", f)
    else:
        need(name, w, torch.uint8, (e, n, k // 2))
        need(f"{name} scale", s, torch.float8_e4m3fn, (e, n, k // 16))
    return p


def _kernel_views(fmt: int, w, s, f):
    """(weight pointer tensor, scale pointer tensor, factor pointer tensor) as the kernels read them."""
    if fmt == FMT_NVFP4:
        return w.view(torch.int32), s.view(torch.uint8), f
    if fmt == FMT_MXFP8:
        return w.view(torch.uint8), s, w.view(torch.uint8)
    if fmt == FMT_FP8:
        return w.view(torch.uint8), w.view(torch.uint8), f
    return w, w, w


def _check_decode_once(fmt: int, cfg: GroupedConfig, e: int, h: int, i: int, ws: GroupedWorkspace, dev) -> None:
    if fmt == FMT_BF16:
        raise ValueError(f"config {cfg}: DECODE_ONCE decodes quantized experts; {FMT_NAMES[fmt]} experts have "
                         "nothing to decode (use a config without it)")
    if cfg.EXPERT_GROUP < 1:
        raise ValueError(f"config {cfg}: EXPERT_GROUP must be at least 1, found {cfg.EXPERT_GROUP}")
    for what, size, tile in (("2I", 2 * i, cfg.DEC_BN), ("H", h, cfg.DEC_BN), ("H", h, cfg.DEC_BK),
                             ("I", i, cfg.DEC_BK)):
        if size % tile:
            raise ValueError(f"shape (E={e}, H={h}, I={i}): {what} = {size} is not a multiple of the decode tile "
                             f"{tile} of config {cfg}")
    if cfg.DEC_BK % _GS[fmt]:
        raise ValueError(f"config {cfg}: DEC_BK must be a multiple of {_GS[fmt]} for {FMT_NAMES[fmt]} experts")
    need = decode_scratch_numel(cfg, e, h, i)
    wd = ws.wdec
    if not isinstance(wd, torch.Tensor) or wd.dtype != torch.bfloat16 or wd.dim() != 1 or wd.numel() < need \
            or wd.device != dev or not wd.is_contiguous():
        raise ValueError(f"workspace.wdec: expected a contiguous bf16 [>= {need}] on {dev} (EXPERT_GROUP "
                         f"{cfg.EXPERT_GROUP} x 2I {2 * i} x H {h}; make_workspace), found "
                         f"{None if not isinstance(wd, torch.Tensor) else (wd.dtype, tuple(wd.shape), wd.device)}")


def _tiles(fmt: int, w, s) -> bool:
    """Whether experts of format `fmt` ((w, s) as the raw call takes them) have the MMA tile layout."""
    return fmt in (FMT_NVFP4, FMT_MXFP8) and tileable(FMT_NAMES[fmt], w, s)


def decode_group(fmt: int, w, s, e0: int, eg: int, wdec: torch.Tensor, cfg: GroupedConfig,
                 tiled: bool = False) -> torch.Tensor:
    """Experts e0 .. e0 + eg - 1 of a stacked quantized weight [E, N, K] (the raw call's (w, s) tensors; tiled:
    NVFP4 / MXFP8 in the MMA tile layout) -> their group-scaled values, exact in bf16, as a row-major [eg, N, K] view of
    wdec (one decode_experts launch)."""
    n, k = w.shape[1], w.shape[2] * (2 if fmt == FMT_NVFP4 else 1)
    wa, sa, _ = _kernel_views(fmt, w, s, None)
    out = wdec[: eg * n * k].view(eg, n, k)
    decode_experts[(eg * (n // cfg.DEC_BN), k // cfg.DEC_BK)](
        wa, sa, out, e0, n, k, FMT=fmt, GS=_GS[fmt], BN=cfg.DEC_BN, BK=cfg.DEC_BK, CUDA=is_compiled(w),
        PTX=use_ptx(w), TILED=tiled, num_warps=4)
    return out


def expert_launches(x, fmt: int, w13, s13, f13, w2, s2, f2, ws: GroupedWorkspace, cfg: GroupedConfig, top_k: int,
                    swiglu_alpha: float, swiglu_limit: float, *, decode: bool = True, gemm: bool = True,
                    tiled: bool = False) -> None:
    """Steps 3-4 on the routing already in ws (pair, blk_e): x -> ws.act -> ws.y. In-register decode: one gate|up
    and one down launch over every block. Decode-once band: per group of EXPERT_GROUP experts, decode gate|up into
    ws.wdec, gate|up on it (that group's blocks), decode down into ws.wdec, down on it. decode / gemm False leave
    out the decode or the GEMM launches (bench/moe_grouped.py times them apart; the raw call runs both). tiled:
    NVFP4 / MXFP8 experts in the MMA tile layout (the decode-once scratch is row-major bf16 whatever it is)."""
    t, h = x.shape
    e = w13.shape[0]
    i = w2.shape[-1] * (2 if fmt == FMT_NVFP4 else 1)
    length, nb = ws.pair.shape[0], ws.blk_e.shape[0]
    p13 = f13.shape[1] if f13 is not None else 1
    p2 = f2.shape[1] if f2 is not None else 1
    cuda, ptx = is_compiled(x), use_ptx(x)
    _, _, c13 = _kernel_views(fmt, w13, s13, f13)
    _, _, c2 = _kernel_views(fmt, w2, s2, f2)
    up_warps, up_stages = cfg.num_warps, cfg.num_stages
    dn_warps, dn_stages = cfg.down_warps or cfg.num_warps, cfg.down_stages or cfg.num_stages

    def gate_up(wa, sa, e0, eg, wfmt):
        grouped_gate_up[(nb * (i // cfg.BN),)](
            x, wa, sa, c13, ws.pair, ws.blk_e, ws.act, t, length, nb, h, i, e0, eg, p13, x.stride(0),
            float(swiglu_alpha), float(swiglu_limit), A=top_k, FMT=wfmt, RF=fmt, GS=_GS[wfmt], BM=cfg.BM, BN=cfg.BN,
            BK=cfg.BK, GM=cfg.GM, CUDA=cuda, PTX=ptx, TILED=tiled and wfmt != FMT_BF16, num_warps=up_warps,
            num_stages=up_stages)

    def down(wa, sa, e0, eg, wfmt):
        grouped_down[(nb * (h // cfg.dbn),)](
            ws.act, wa, sa, c2, ws.pair, ws.blk_e, ws.y, t, length, nb, h, i, e0, eg, p2, FMT=wfmt, RF=fmt,
            GS=_GS[wfmt], BM=cfg.BM, BN=cfg.dbn, BK=cfg.dbk, GM=cfg.GM, CUDA=cuda, PTX=ptx,
            TILED=tiled and wfmt != FMT_BF16, num_warps=dn_warps, num_stages=dn_stages)

    if not cfg.DECODE_ONCE:
        if gemm:
            a13, b13, _ = _kernel_views(fmt, w13, s13, f13)
            a2, b2, _ = _kernel_views(fmt, w2, s2, f2)
            gate_up(a13, b13, 0, e, fmt)
            down(a2, b2, 0, e, fmt)
        return
    g = min(cfg.EXPERT_GROUP, e)
    # the band's jobs in order: per group, gate|up then down, each a decode into the scratch and the GEMM reading it
    jobs = [(w, sc, e0, min(g, e - e0), launch) for e0 in range(0, e, g)
            for w, sc, launch in ((w13, s13, gate_up), (w2, s2, down))]
    if cfg.DECODE_AHEAD:
        _decode_ahead(fmt, jobs, ws.wdec, cfg, decode, gemm, tiled)
        return
    for w, sc, e0, eg, launch in jobs:
        wb = decode_group(fmt, w, sc, e0, eg, ws.wdec, cfg, tiled) if decode else ws.wdec
        if gemm:
            launch(wb, wb, e0, eg, FMT_BF16)


_SIDE_STREAMS: dict = {}


def _side_stream(dev: torch.device) -> torch.cuda.Stream:
    """One side stream per device for the band's decodes (created once: a capture must find the same stream)."""
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=key)
    return _SIDE_STREAMS[key]


def _decode_ahead(fmt: int, jobs: list, wdec: torch.Tensor, cfg: GroupedConfig, decode: bool, gemm: bool,
                  tiled: bool = False) -> None:
    """The band's jobs double-buffered: job j's decode goes to scratch half j % 2 on a side stream, so job j + 1's
    decode (memory-bound) runs while job j's GEMM (tensor-core-bound) does. Job j + 2's decode waits for job j's
    GEMM (it overwrites the half that GEMM reads); job j's GEMM waits for job j's decode. The side stream forks from
    the current stream (it waits for what was queued there: the routing, x) and every piece of its work is joined
    back through those waits (the last GEMM waits for the last decode), so the call stays stream-ordered for its
    caller and capturable. Same launches, operands and order of sums per GEMM as the serial band: the same output
    bit for bit. Off the GPU (interpreter) the same order runs on one stream."""
    half = wdec.numel() // 2
    bufs = (wdec[:half], wdec[half:2 * half])
    cuda = wdec.device.type == "cuda"
    main = torch.cuda.current_stream(wdec.device) if cuda else None
    side = _side_stream(wdec.device) if cuda else None

    def mark(stream):
        """An event recorded on `stream` now (None off the GPU, where one stream orders everything)."""
        if not cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    fork = mark(main)
    ready: list = [None, None]     # decode into half b done (on side)
    free: list = [fork, fork]      # GEMM reading half b done (on main); at first, what main queued before the call

    def issue_decode(j: int) -> None:
        w, sc, e0, eg, _ = jobs[j]
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            if cuda:
                side.wait_event(free[j % 2])
            decode_group(fmt, w, sc, e0, eg, bufs[j % 2], cfg, tiled)
            ready[j % 2] = mark(side)

    if decode:
        issue_decode(0)
    for j, (_, _, e0, eg, launch) in enumerate(jobs):
        if decode and j + 1 < len(jobs):
            issue_decode(j + 1)           # into the other half, before this job's GEMM is queued
        if ready[j % 2] is not None:
            main.wait_event(ready[j % 2])
        if gemm:
            launch(bufs[j % 2], bufs[j % 2], e0, eg, FMT_BF16)
        free[j % 2] = mark(main)


def moe_grouped(x, router_w, router_bias, fmt: int, w13, s13, f13, w2, s2, f2, shared, routed_scaling: float,
                out: torch.Tensor, workspace: GroupedWorkspace, config: GroupedConfig, top_k: int = 4,
                swiglu_alpha: float = SWIGLU_ALPHA, swiglu_limit: float = SWIGLU_LIMIT,
                tiled: bool = False) -> torch.Tensor:
    """Raw call: routing and grouping (torch ops), then three launches, all on the current stream and free of
    host syncs. Writes and returns `out`; workspace.act / .y and the routing stay readable. tiled: NVFP4 / MXFP8
    experts in the MMA tile layout (m3serve.quant.tiles, per expert matrix), the layout the target holds."""
    cfg = config
    check_swiglu(swiglu_alpha, swiglu_limit)
    if fmt not in FMT_NAMES:
        raise ValueError(f"fmt: expected one of {FMT_NAMES} (the _decode codes), found {fmt!r}")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous bf16 [T, H], found "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    t, h = x.shape
    dev = x.device
    if t < 1:
        raise ValueError("x: expected at least one token")
    if router_w.dtype not in (torch.float32, torch.bfloat16) or router_w.dim() != 2 or router_w.shape[1] != h:
        raise ValueError(f"router_w: expected fp32/bf16 [E, H={h}], found {router_w.dtype} {tuple(router_w.shape)}")
    e = router_w.shape[0]
    if router_bias.dtype != torch.float32 or tuple(router_bias.shape) != (e,):
        raise ValueError(f"router_bias: expected fp32 [E={e}], found {router_bias.dtype} {tuple(router_bias.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= e:
        raise ValueError(f"top_k: expected an int in 1..{e}, found {top_k!r}")
    i = w2.shape[-1] * (2 if fmt == FMT_NVFP4 else 1)
    _check_weight("w13", fmt, w13, s13, f13, e, 2 * i, h, dev)
    _check_weight("w2", fmt, w2, s2, f2, e, h, i, dev)
    if tiled and not (_tiles(fmt, w13, s13) and _tiles(fmt, w2, s2)):
        raise ValueError(f"tiled: the MMA tile layout is defined for NVFP4 and MXFP8 experts with H and I multiples of "
                         f"128, found {FMT_NAMES[fmt]} experts, H={h}, I={i}")
    bk_unit = 32 if fmt == FMT_MXFP8 else 16
    for what, size, tile in (("H", h, cfg.BK), ("I", i, cfg.BN), ("I", i, cfg.dbk), ("H", h, cfg.dbn),
                             ("H", h, cfg.CBH)):
        if size % tile:
            raise ValueError(f"shape (E={e}, H={h}, I={i}): {what} = {size} is not a multiple of the tile {tile} "
                             f"of config {cfg}")
    if cfg.BK % bk_unit or cfg.dbk % bk_unit:
        raise ValueError(f"config {cfg}: K tiles must be multiples of {bk_unit} for {FMT_NAMES[fmt]} experts")
    if cfg.DECODE_ONCE:
        _check_decode_once(fmt, cfg, e, h, i, workspace, dev)
    if shared is not None and (shared.dtype != torch.bfloat16 or tuple(shared.shape) != (t, h)
                               or not shared.is_contiguous()):
        raise ValueError(f"shared: expected a contiguous bf16 [T={t}, H={h}] or None, found "
                         f"{shared.dtype} {tuple(shared.shape)}")
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (t, h) or not out.is_contiguous() or out.device != dev:
        raise ValueError(f"out: expected a contiguous bf16 [T={t}, H={h}] on {dev}, found {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    length, nb = padded_length(t, e, top_k, cfg.BM)
    ws = workspace
    for name, got, want in (("act", ws.act, (length, i)), ("y", ws.y, (t * top_k, h))):
        if got.dtype != torch.bfloat16 or tuple(got.shape) != want or got.device != dev or not got.is_contiguous():
            raise ValueError(f"workspace.{name}: expected contiguous bf16 {want} on {dev} (make_workspace), found "
                             f"{got.dtype} {tuple(got.shape)} on {got.device}")

    cuda = is_compiled(x)
    if t <= SMALL_T and e <= SMALL_E:
        ids, weights, pair, blk_e = _route_group_small(x, router_w, router_bias, top_k, cfg.BM, length, nb)
    else:
        ids, weights = route_sorted(x, router_w, router_bias, top_k)
        pair, blk_e = group_pairs(ids, e, cfg.BM)
    ws.ids, ws.weights, ws.pair, ws.blk_e = ids, weights, pair, blk_e

    expert_launches(x, fmt, w13, s13, f13, w2, s2, f2, ws, cfg, top_k, swiglu_alpha, swiglu_limit, tiled=tiled)
    grouped_combine[(triton.cdiv(t, cfg.CBT), h // cfg.CBH)](
        ws.y, weights, shared if shared is not None else ws.y, out, t, h, float(routed_scaling), A=top_k,
        HAS_SHARED=shared is not None, BT=cfg.CBT, BH=cfg.CBH, CUDA=cuda, num_warps=4)
    return out


# --- reference ----------------------------------------------------------------------------------


def qweight_of(fmt: int, w, s, f, tiled: bool = False) -> QWeight:
    """The raw call's (w, s, f) triple as the QWeight it came from (for the fp32 dequantization)."""
    if fmt == FMT_BF16:
        return QWeight("dense", {"w": w})
    if fmt == FMT_FP8:
        return QWeight("fp8", {"q": w, "scale": f})
    if fmt == FMT_MXFP8:
        return QWeight("mxfp8", {"q": w, "scale": s}, "mma_tile" if tiled else "rows")
    return QWeight("nvfp4", {"packed": w, "scale": s, "global_scale": f}, "mma_tile" if tiled else "rows")


@dataclass
class GroupedReference:
    y: torch.Tensor  # fp32 [T, H] before the final bf16 rounding
    logits: torch.Tensor  # fp32 [T, E]
    ids: torch.Tensor  # int64 [T, A] ascending per row
    w: torch.Tensor  # fp32 [T, A] (sum 1, before routed_scaling)


def route_reference(x, router_w, router_bias, top_k, ids_override=None):
    with true_fp32():
        logits = x.float() @ router_w.float().T
    sig = torch.sigmoid(logits)
    ids = torch.topk(sig + router_bias.float(), top_k, dim=-1).indices if ids_override is None else ids_override
    ids = ids.long().sort(dim=1).values
    w = sig.gather(1, ids)
    return logits, ids, w / w.sum(dim=-1, keepdim=True)


def moe_grouped_reference(x, router_w, router_bias, fmt, w13, s13, f13, w2, s2, f2, shared, routed_scaling,
                          out=None, workspace=None, config=None, top_k: int = 4, swiglu_alpha: float = SWIGLU_ALPHA,
                          swiglu_limit: float = SWIGLU_LIMIT, ids_override=None,
                          tiled: bool = False) -> GroupedReference:
    logits, ids, w = route_reference(x, router_w, router_bias, top_k, ids_override)
    q13, q2 = qweight_of(fmt, w13, s13, f13, tiled), qweight_of(fmt, w2, s2, f2, tiled)
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        wf = q13.dequantize(torch.float32, e)
        i = wf.shape[0] // 2
        with true_fp32():
            hh = x[tok].float() @ wf.T
            a = swiglu_oai_ref(hh[:, :i], hh[:, i:], swiglu_alpha, swiglu_limit).to(torch.bfloat16).float()
            ye = (a @ q2.dequantize(torch.float32, e).T).to(torch.bfloat16).float()
        y.index_add_(0, tok, ye * w[tok, slot].unsqueeze(-1))
    y = y * routed_scaling
    if shared is not None:
        y = y + shared.float()
    return GroupedReference(y=y, logits=logits, ids=ids, w=w)


def moe_grouped_stock(x, router_w, router_bias, fmt, w13, s13, f13, w2, s2, f2, shared, routed_scaling, out=None,
                      workspace=None, config=None, top_k: int = 4, swiglu_alpha: float = SWIGLU_ALPHA,
                      swiglu_limit: float = SWIGLU_LIMIT, tiled: bool = False) -> torch.Tensor:
    """Without the engine: the stock MoE loop (per touched expert: dequantize, bf16 GEMMs), for the benchmark."""
    ids, w = route_sorted(x, router_w, router_bias, top_k)
    q13, q2 = qweight_of(fmt, w13, s13, f13, tiled), qweight_of(fmt, w2, s2, f2, tiled)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        a = swiglu_oai(x[tok] @ q13.dequantize(x.dtype, e).T, swiglu_alpha, swiglu_limit).to(x.dtype)
        y.index_add_(0, tok, (a @ q2.dequantize(x.dtype, e).T).float() * w[tok, slot].unsqueeze(-1))
    y = y * routed_scaling
    if shared is not None:
        y = y + shared.float()
    return y.to(torch.bfloat16)


# --- compare ------------------------------------------------------------------------------------


def compare(out: torch.Tensor, ref: GroupedReference, case: Case) -> None:
    """Five checks, each against a true-fp32 reference of its stage with its own band (docs/kernels.md,
    moe.grouped):

    1. routing: each token's expert set equals the reference's, or (a near-tie legitimately resolved either way)
       every kernel pick scores within 2 (b/4) of the reference k-th best, b = 2 H u sum|x wr| the logit
       summation bound; weights within 8u relative + that bound through sigmoid and the renormalisation.
    2. grouping: every (token, slot) pair sits at exactly one padded position, in a block of its expert.
    3. activations at every used position: one bf16 ulp + the gate/up summation bound 2 H u sum|x w| through
       SwiGLU-OAI's derivative bounds (|da/dg| <= 1.2 (|u| + 1), |da/du| <= |g|), as moe.nvfp4.
    4. expert outputs y per pair vs the kernel's own activations through the reference W2: gemm_band (one bf16
       ulp + 2 I u sum|a w|).
    5. out vs the kernel's own y and weights: one bf16 ulp + 2 (A + 1) u sum of |terms| (fp32 combine order)."""
    (x, router_w, router_bias, fmt, w13, s13, f13, w2, s2, f2, shared, scaling, _, ws, cfg) = case.args
    top_k = case.kwargs.get("top_k", 4)
    alpha = case.kwargs.get("swiglu_alpha", SWIGLU_ALPHA)
    limit = case.kwargs.get("swiglu_limit", SWIGLU_LIMIT)
    tiled = case.kwargs.get("tiled", False)
    t, h = x.shape
    e_n = router_w.shape[0]
    dev = x.device
    # 1. routing
    with true_fp32():
        b_logit = 2.0 * h * FP32_U * (x.float().abs() @ router_w.float().abs().T)
    ids = ws.ids.long()
    if bool((ids < 0).any()) or bool((ids >= e_n).any()) or bool((ids[:, 1:] <= ids[:, :-1]).any()):
        raise AssertionError(f"moe.grouped routing: ids out of range, repeated or unsorted: {ids[:4].tolist()}")
    sig = torch.sigmoid(ref.logits)
    b_sig = b_logit.max(dim=1, keepdim=True).values / 4.0
    if not torch.equal(ids, ref.ids):
        score = sig + router_bias.float()
        kth = torch.topk(score, top_k, dim=1).values[:, -1:]
        if bool((score.gather(1, ids) < kth - 2.0 * b_sig - 1e-7).any()):
            raise AssertionError(f"moe.grouped routing: kernel ids {ids.tolist()} vs reference {ref.ids.tolist()} "
                                 f"are not within the near-tie slack")
        ref = moe_grouped_reference(*case.args, **case.kwargs, ids_override=ids)
    sig_k = sig.gather(1, ids)
    w_ref = sig_k / sig_k.sum(dim=1, keepdim=True)
    w_band = 8 * FP32_U * w_ref.abs() + 5.0 * b_sig / sig_k.sum(dim=1, keepdim=True) + 1e-30
    assert_band("moe.grouped routing weights", ws.weights, w_ref, w_band)
    # 2. grouping
    pair = ws.pair.long()
    valid = pair >= 0
    got = torch.sort(pair[valid]).values
    if not torch.equal(got, torch.arange(t * top_k, device=dev)):
        raise AssertionError(f"moe.grouped grouping: the padded positions hold {got.numel()} pairs, not each of the "
                             f"{t * top_k} (token, slot) pairs once")
    pos = torch.nonzero(valid).flatten()
    blk = ws.blk_e.long()[pos // cfg.BM]
    if not torch.equal(blk, ids.reshape(-1)[pair[pos]]):
        raise AssertionError("moe.grouped grouping: a pair sits in a block of another expert")
    # 3-4. activations and expert outputs, expert by expert
    q13, q2 = qweight_of(fmt, w13, s13, f13, tiled), qweight_of(fmt, w2, s2, f2, tiled)
    i = ws.act.shape[1]
    for e in torch.unique(blk).tolist():
        p_e = pos[blk == e]
        pr = pair[p_e]
        xt = x[pr // top_k].float()
        wf = q13.dequantize(torch.float32, e)
        with true_fp32():
            hh = xt @ wf.T
            bh = 2.0 * h * FP32_U * (xt.abs() @ wf.abs().T)
        g, u = hh[:, :i], hh[:, i:]
        a_ref = swiglu_oai_ref(g, u, alpha, limit)
        a_band = BF16_REL * a_ref.abs() + 1.2 * (u.abs().clamp(max=limit) + 1) * bh[:, :i] \
            + g.abs().clamp(max=limit) * bh[:, i:] + 1e-30
        a_k = ws.act[p_e].float()
        assert_band(f"moe.grouped act (expert {e})", a_k, a_ref, a_band)
        w2f = q2.dequantize(torch.float32, e)
        with true_fp32():
            y_ref = a_k @ w2f.T
            absprod = a_k.abs() @ w2f.abs().T
        assert_band(f"moe.grouped y (expert {e})", ws.y[pr].float(), y_ref, gemm_band(y_ref, absprod, i))
    # 5. combine
    yk = ws.y.float().view(t, top_k, h)
    terms = yk * ws.weights.unsqueeze(-1)
    want = terms.sum(1) * scaling
    mag = terms.abs().sum(1) * abs(scaling)
    if shared is not None:
        want = want + shared.float()
        mag = mag + shared.float().abs()
    assert_band("moe.grouped out", out, want, BF16_REL * want.abs() + 2.0 * (top_k + 1) * FP32_U * mag + 1e-30)


# --- cases and cells ----------------------------------------------------------------------------


def random_weight(fmt: int, e: int, n: int, k: int, parts: int, device: torch.device, gen):
    """(w, s, f) of a stacked [E, n, k] expert weight in format fmt, values of a few hundredths, so gate/up sums
    of a few units at M3 widths (SwiGLU's clamps are exercised). gen None: zeros (compile-only warm-up)."""
    if fmt == FMT_NVFP4:
        packed, scale, gs = random_experts(e, n, k, device, gen)
        f = torch.stack([gs] + [random_experts(e, 1, 16, device, gen)[2] for _ in range(parts - 1)], dim=1)
        return packed, scale, f.contiguous()
    dg = device_rng(gen, device) if gen is not None else None
    if fmt == FMT_BF16:
        if gen is None:
            return torch.zeros(e, n, k, dtype=torch.bfloat16, device=device), None, None
        return (0.02 * torch.randn(e, n, k, generator=dg, device=device)).to(torch.bfloat16), None, None
    q = random_e4m3((e, n, k), gen, device)
    if fmt == FMT_FP8:
        f = torch.ones(e, parts, device=device) if gen is None else \
            1e-4 * (0.5 + 1.5 * torch.rand(e, parts, generator=dg, device=device))
        return q, None, f
    s = torch.full((e, n, k // 32), 127, dtype=torch.uint8, device=device) if gen is None else \
        torch.randint(112, 116, (e, n, k // 32), generator=dg, dtype=torch.uint8, device=device)
    return q, s, None


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    fmt, e, h, i, a = cell.shape
    cfg: GroupedConfig = cell.config["moe"]
    w13, s13, f13 = random_weight(fmt, e, 2 * i, h, 2, device, gen)
    w2, s2, f2 = random_weight(fmt, e, h, i, 1, device, gen)
    if gen is None:
        router_w = torch.zeros(e, h, dtype=torch.float32, device=device)
        bias = torch.zeros(e, dtype=torch.float32, device=device)
    else:
        dg = device_rng(gen, device)
        router_w = 0.02 * torch.randn(e, h, generator=dg, device=device)
        bias = 0.05 * torch.randn(e, generator=dg, device=device)
    x = fresh_x(rows, h, device, gen)
    shared = None
    if cell.config.get("shared", True):
        shared = fresh_x(rows, h, device, gen)
    out = poisoned((rows, h), torch.bfloat16, device)
    ws = make_workspace(cfg, rows, e, h, i, a, device)
    if gen is not None:
        ws.act.fill_(float("nan"))  # the intermediates are checked too: poison them
        ws.y.fill_(float("nan"))
        if ws.wdec is not None:  # a weight read before its group's decode would show
            ws.wdec.fill_(float("nan"))
    per_elem = {FMT_NVFP4: 9 / 16, FMT_MXFP8: 33 / 32, FMT_FP8: 1.0, FMT_BF16: 2.0}[fmt]
    wbytes = int(min(e, rows * a) * 3 * h * i * per_elem)
    kwargs = {"top_k": a}
    if _tiles(fmt, w13, s13) and _tiles(fmt, w2, s2):  # the layout the target holds them in
        name = FMT_NAMES[fmt]
        w13, s13 = to_layout(name, w13, s13, "rows", "mma_tile")
        w2, s2 = to_layout(name, w2, s2, "rows", "mma_tile")
        kwargs["tiled"] = True
    return Case(args=(x, router_w, bias, fmt, w13, s13, f13, w2, s2, f2, shared, 2.0, out, ws, cfg),
                kwargs=kwargs, bytes_moved=wbytes + e * h * 4 + rows * h * 6)


# Row bands and their tiles. A block holds one expert's pairs, so BM follows the expected pairs per expert
# (T A / E): 16 (the MMA minimum) for decode batches, 64 / 128 for prefill chunks.
M3_BANDS = (
    ((1, 64), GroupedConfig(BM=16, BN=64, BK=128, num_warps=4)),
    ((65, 512), GroupedConfig(BM=32, BN=64, BK=128, num_warps=4)),
    ((513, 2048), GroupedConfig(BM=64, BN=128, BK=64, num_warps=8, CBT=8)),
    ((2049, 16384), GroupedConfig(BM=128, BN=128, BK=64, num_warps=8, CBT=8)),
)
# The decode-once band (module docstring): quantized experts at the M3 TP1 shape from DECODE_ONCE_ROWS tokens, the
# in-register BM 128 tiles below it. Its GEMMs run on the BF16 operand path, so it takes the BF16 band's tiles.
DECODE_ONCE_ROWS = 4096
M3_DECODE_ONCE_BANDS = M3_BANDS[:3] + (
    ((2049, DECODE_ONCE_ROWS - 1), M3_BANDS[3][1]),
    ((DECODE_ONCE_ROWS, 16384), replace(M3_BANDS[3][1], DECODE_ONCE=True, EXPERT_GROUP=32)),
)
SMALL_BANDS = (  # the tiny preset (H 128, I 64) and the embedded model (H 256, I 128): 8 experts, top-2
    ((1, 64), GroupedConfig(BM=16, BN=32, BK=32, CBH=128)),
    ((65, 1024), GroupedConfig(BM=64, BN=32, BK=32, CBH=128)),
    ((1025, 16384), GroupedConfig(BM=128, BN=32, BK=32, CBH=128, num_warps=8)),
)
SHAPES = (
    ((128, 6144, 3072, 4), "M3 MoE layers (TP1: expert width 3072)", M3_BANDS),
    ((128, 6144, 1536, 4), "M3 MoE layers (TP2: expert width 1536)", M3_BANDS),
    ((8, 256, 128, 2), "the embedded model's MoE layers", SMALL_BANDS),
    ((8, 128, 64, 2), "the tiny preset's MoE layers", SMALL_BANDS),
)


def _bands(fmt: int, shape: tuple, bands: tuple) -> tuple:
    return M3_DECODE_ONCE_BANDS if fmt != FMT_BF16 and shape == (128, 6144, 3072, 4) else bands


def _why(fmt: int, why: str, rows: tuple, cfg: GroupedConfig) -> str:
    band = (f", experts decoded once per call to bf16 in groups of {cfg.EXPERT_GROUP}"
            + (", each decoded while the previous group's GEMM runs" if cfg.DECODE_AHEAD else "")
            if cfg.DECODE_ONCE else "")
    return f"{why}, {FMT_NAMES[fmt]} experts, {rows[0]}-{rows[1]} tokens{band}"


CELLS = tuple(
    Cell(rows=rows, shape=(fmt, *shape), why=_why(fmt, why, rows, cfg), config={"moe": cfg})
    for fmt in (FMT_BF16, FMT_FP8, FMT_MXFP8, FMT_NVFP4) for shape, why, bands in SHAPES
    for rows, cfg in _bands(fmt, shape, bands)
)
_ICFG = GroupedConfig(BM=16, BN=32, BK=32, CBH=64, CBT=2, GM=3)
INTERP_CELLS = tuple(
    Cell(rows=rows, shape=(fmt, e, 64, 32, a), why=f"interpreter: {FMT_NAMES[fmt]}, {why}",
         config={"moe": cfg, "shared": shared})
    for fmt in (FMT_BF16, FMT_FP8, FMT_MXFP8, FMT_NVFP4)
    for rows, e, a, cfg, shared, why in (
        ((1, 2), 8, 2, _ICFG, True, "1-2 tokens, top-2 of 8"),
        ((9, 9), 4, 4, _ICFG, False, "9 tokens top-4 of 4: 9 pairs per expert, no shared expert"),
        ((40, 40), 8, 2, GroupedConfig(BM=32, BN=32, BK=64, DBN=64, DBK=32, CBH=64, CBT=8), True,
         "40 tokens: runs longer than a block, other down tiles"),
        ((70, 70), 8, 2, GroupedConfig(BM=32, BN=32, BK=32, CBH=64, CBT=8, GM=4), True,
         "70 tokens: routing and grouping by torch ops (beyond the decode-batch launch)"),
    )
) + tuple(
    Cell(rows=rows, shape=(fmt, 8, 64, 32, a), why=f"interpreter: {FMT_NAMES[fmt]}, decode-once band, {why}",
         config={"moe": replace(cfg, DECODE_ONCE=True, DEC_BN=32, DEC_BK=32), "shared": True})
    for fmt in (FMT_FP8, FMT_MXFP8, FMT_NVFP4)
    for rows, a, cfg, why in (
        ((70, 70), 2, GroupedConfig(BM=32, BN=32, BK=32, CBH=64, CBT=8, GM=4, EXPERT_GROUP=3),
         "70 tokens, groups of 3 of 8 experts (the last one partial)"),
        ((1, 2), 2, replace(_ICFG, EXPERT_GROUP=2), "1-2 tokens top-2, groups of 2 of 8 experts: some get no token"),
        ((71, 71), 2, GroupedConfig(BM=32, BN=32, BK=32, CBH=64, CBT=8, GM=4, EXPERT_GROUP=3, DECODE_AHEAD=True),
         "71 tokens, groups of 3 decoded ahead into two scratch halves"),
    )
)


def warmup(device: torch.device) -> None:
    """One call per cell: the kernels do not specialise on the row count (kernel_unspecialized), so a cell's
    variants are its constexprs alone."""
    for c in CELLS:
        case = make_case(c, c.rows[0], device, None)
        moe_grouped(*case.args, **case.kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


ENTRY = Entry(
    name="moe.grouped", kind="moe.grouped", raw_call=moe_grouped, reference=moe_grouped_reference, compare=compare,
    make_case=make_case, cells=CELLS, interp_cells=INTERP_CELLS, warmup=warmup, enabled=lambda: ENABLED,
    stock=moe_grouped_stock,
)
ENTRIES = (ENTRY,)
