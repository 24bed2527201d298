"""Catalog entry moe.nvfp4: the MiniMax-M3 MoE block for 1..48 tokens in three launches
(router + top-k, gate|up + SwiGLU-OAI, down + weighted sum + shared expert). See moe/_nvfp4.py; at up to
ROUTER_ROWS (8) tokens the router is one program per expert (moe_router_rows), above it split over H
(moe_router); at 1-8 tokens with an NVFP4 shared expert the gate|up and down launches run on the
register-operand MMA step (moe/_mma.py, config MmaMoEConfig).

Semantics (the reference, all fp32 with TF32 off):
    logits = x.float() @ router_w.float().T;  sig = sigmoid(logits)
    ids    = top-4 of (sig + bias)            (the bias only selects)
    w      = sig[ids] / sum(sig[ids]) * routed_scaling
    act_e  = bf16(swiglu_oai(x @ W13_e^T))    (gate rows, then up rows; rounded to bf16 as the
                                               input of the down GEMM, like the stock path;
                                               alpha / limit = the raw call's swiglu_alpha /
                                               swiglu_limit, default M3's 1.702 / 7.0)
    y      = bf16( sum_k w_k * (act_e @ W2_e^T) + act_sh @ W2_sh^T )

Cell shape key: (E, H, I, shared_bf16) with shared_bf16 = 1 for a BF16 shared expert, else 0.

Shape legend: x [T, H] bf16; router_w [E, H] fp32/bf16; bias [E] fp32;
    w13 [E, 2I, H/2] uint8, s13 [E, 2I, H/16] e4m3, g13 [E, 2] fp32 (ENCODE scales gate, up);
    w2 [E, H, I/2] uint8, s2 [E, H, I/16] e4m3, g2 [E] fp32;
    shared: the same with E = 1, or BF16 sh_w13 [2I, H], sh_w2 [H, I] with the scale
    arguments None; out [T, H] bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton

from m3serve.kernels.formats._decode import FMT_BF16, FMT_NVFP4
from m3serve.kernels.formats._e2m1_ptx import use_ptx
from m3serve.kernels._jit import is_compiled
from m3serve.kernels.gemm._linear import fresh_x
from m3serve.kernels.gemm._mma_gemv import STEP
from m3serve.kernels.moe._mma import MmaMoEConfig, gate_up_split_sizes, launch_mma_moe
from m3serve.kernels.moe._nvfp4 import moe_down, moe_gate_up, moe_router, moe_router_rows
from m3serve.kernels.catalog import (BF16_REL, FP32_U, Case, Cell, Entry, assert_band, check_tensor, device_rng,
                                     gemm_band, poisoned, true_fp32)
from m3serve.quant.nvfp4 import dequantize_nvfp4, tile_nvfp4, untile_nvfp4
from m3serve.quant.tiles import tileable

ENABLED = True  # the one switch: False sends moe.nvfp4 calls down the stock path

TOPK = 4
SWIGLU_ALPHA = 1.702  # MiniMax-M3's config values (config.swiglu_alpha / swiglu_limit), the raw call's defaults
SWIGLU_LIMIT = 7.0


@dataclass(frozen=True)
class MoEConfig:
    BT: int  # padded tokens (MMA narrow side)
    BN: int = 64
    BK: int = 128
    RBE: int = 16  # router experts per program
    RBK: int = 128
    RSPLIT: int = 16  # router K split
    DSPLIT: int = 4  # down-projection K (= I) split
    num_warps: int = 4
    num_stages: int = 3
    router_warps: int = 4  # the routing step holds [SP, BT, TOPK] and [BT, TOPK, E] tiles
    ROUTER_ROWS: int = 8  # token counts up to this take moe_router_rows (one program per expert; 0: never)
    RKC: int = 2048  # moe_router_rows' columns per step (at most; the largest power of two dividing H)
    DBN: int = 0  # down-projection tile over H (0: BN)
    DBK: int = 0  # down-projection K tile (0: BK); I / DSPLIT must be a multiple
    down_warps: int = 0  # 0: num_warps
    down_stages: int = 0  # 0: num_stages

    @property
    def dbn(self) -> int:
        return self.DBN or self.BN

    @property
    def dbk(self) -> int:
        return self.DBK or self.BK


@dataclass
class MoEWorkspace:
    rpart: torch.Tensor
    rcount: torch.Tensor
    ids: torch.Tensor
    tw: torch.Tensor
    slot_e: torch.Tensor
    slot_w: torch.Tensor
    act: torch.Tensor
    dpart: torch.Tensor
    dcount: torch.Tensor
    gpart: torch.Tensor  # the MMA step's gate|up split: fp32 partials [GSPLIT, S + 1, T, 2I] (1 element: no split)
    gcount: torch.Tensor  # its tickets [(S + 1) I / BNA], zero between launches


def n_slots(t: int, e: int) -> int:
    return min(TOPK * t, e)


def make_moe_workspace(cfg: MoEConfig | MmaMoEConfig, t: int, e: int, h: int, i: int, device: torch.device) -> MoEWorkspace:
    """Per call site and token count, allocated once before graph capture (counters start at
    zero and every completed launch leaves them at zero)."""
    s = n_slots(t, e)
    sp = triton.next_power_of_2(s)
    gp, gc = gate_up_split_sizes(cfg, t, s, i) if isinstance(cfg, MmaMoEConfig) and i % cfg.bna == 0 else (1, 1)
    return MoEWorkspace(
        rpart=torch.empty(cfg.RSPLIT * cfg.BT * e, dtype=torch.float32, device=device),
        rcount=torch.zeros(1, dtype=torch.int32, device=device),
        ids=torch.full((t, TOPK), -1, dtype=torch.int32, device=device),
        tw=torch.zeros(t, TOPK, dtype=torch.float32, device=device),
        slot_e=torch.full((sp,), -1, dtype=torch.int32, device=device),
        slot_w=torch.zeros(sp, t, dtype=torch.float32, device=device),
        act=torch.empty(s + 1, t, i, dtype=torch.bfloat16, device=device),
        dpart=torch.empty(cfg.DSPLIT * cfg.BT * h if cfg.DSPLIT > 1 else 1, dtype=torch.float32, device=device),
        dcount=torch.zeros(max(h // cfg.dbn, 1), dtype=torch.int32, device=device),
        gpart=torch.empty(gp, dtype=torch.float32, device=device),
        gcount=torch.zeros(gc, dtype=torch.int32, device=device),
    )


def _check(x, router_w, router_bias, w13, s13, g13, w2, s2, g2, sh_w13, sh_s13, sh_g13, sh_w2, sh_s2, sh_g2, out, ws,
           cfg, tiled: bool = False) -> tuple[int, int, int, int, int]:
    check_tensor("x", x, torch.bfloat16)
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous [T, H], found {tuple(x.shape)}")
    t, h = x.shape
    if not 1 <= t <= cfg.BT:
        raise ValueError(f"x: this config (BT={cfg.BT}) serves 1..{cfg.BT} tokens, found T={t}")
    dev = x.device
    if router_w.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"router_w: expected torch.float32 or torch.bfloat16, found {router_w.dtype}")
    e = router_w.shape[0]
    check_tensor("router_w", router_w, shape=(e, h), device=dev)
    check_tensor("router_bias", router_bias, torch.float32, (e,), dev)
    i = w2.shape[2] * 2
    check_tensor("w13", w13, torch.uint8, (e, 2 * i, h // 2), dev)
    check_tensor("s13", s13, torch.float8_e4m3fn, (e, 2 * i, h // 16), dev)
    check_tensor("g13", g13, torch.float32, (e, 2), dev)
    check_tensor("w2", w2, torch.uint8, (e, h, i // 2), dev)
    check_tensor("s2", s2, torch.float8_e4m3fn, (e, h, i // 16), dev)
    check_tensor("g2", g2, torch.float32, (e,), dev)
    if sh_w13.dtype == torch.bfloat16:
        check_tensor("sh_w13", sh_w13, torch.bfloat16, (2 * i, h), dev)
        check_tensor("sh_w2", sh_w2, torch.bfloat16, (h, i), dev)
        if any(a is not None for a in (sh_s13, sh_g13, sh_s2, sh_g2)):
            raise ValueError("sh_s13/sh_g13/sh_s2/sh_g2: expected None for a BF16 shared expert")
        shared_fmt = FMT_BF16
    else:
        check_tensor("sh_w13", sh_w13, torch.uint8, (1, 2 * i, h // 2), dev)
        check_tensor("sh_s13", sh_s13, torch.float8_e4m3fn, (1, 2 * i, h // 16), dev)
        check_tensor("sh_g13", sh_g13, torch.float32, (1, 2), dev)
        check_tensor("sh_w2", sh_w2, torch.uint8, (1, h, i // 2), dev)
        check_tensor("sh_s2", sh_s2, torch.float8_e4m3fn, (1, h, i // 16), dev)
        check_tensor("sh_g2", sh_g2, torch.float32, (1,), dev)
        shared_fmt = FMT_NVFP4
    for name, a in (("router_w", router_w), ("w13", w13), ("s13", s13), ("w2", w2), ("s2", s2), ("sh_w13", sh_w13),
                    ("sh_w2", sh_w2)):
        if not a.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor")
    check_tensor("out", out, torch.bfloat16, (t, h), dev)
    if not out.is_contiguous():
        raise ValueError("out: expected a contiguous tensor")
    if isinstance(cfg, MmaMoEConfig):
        why = cfg.fits(h, i, tiled)
        if shared_fmt != FMT_NVFP4:
            why = "the MMA MoE serves an NVFP4 shared expert only (a BF16 one keeps MoEConfig's kernels)"
        if why or e % cfg.RBE or h % (cfg.RBK * cfg.RSPLIT) or e > 1024:
            raise ValueError(f"shape (E={e}, H={h}, I={i}) does not fit config {cfg}" + (f": {why}" if why else ""))
    elif e % cfg.RBE or h % (cfg.RBK * cfg.RSPLIT) or h % cfg.BK or h % cfg.dbn or i % cfg.BN \
            or i % (cfg.dbk * cfg.DSPLIT) or e > 1024:
        raise ValueError(f"shape (E={e}, H={h}, I={i}) does not fit config {cfg}")
    s = n_slots(t, e)
    want = make_moe_workspace(cfg, t, e, h, i, torch.device("meta"))
    for name in ("rpart", "rcount", "ids", "tw", "slot_e", "slot_w", "act", "dpart", "dcount", "gpart", "gcount"):
        got = getattr(ws, name)
        ref = getattr(want, name)
        if got.dtype != ref.dtype or got.device != dev or got.numel() < ref.numel() or not got.is_contiguous():
            raise ValueError(f"workspace.{name}: expected contiguous {ref.dtype} with >= {ref.numel()} elements on "
                             f"{dev} (make_moe_workspace), found {got.dtype} {tuple(got.shape)} on {got.device}")
    if tuple(ws.act.shape) != (s + 1, t, i):
        raise ValueError(f"workspace.act: expected shape {(s + 1, t, i)}, found {tuple(ws.act.shape)}")
    return t, h, e, i, shared_fmt


def check_swiglu(swiglu_alpha: float, swiglu_limit: float) -> None:
    for name, v in (("swiglu_alpha", swiglu_alpha), ("swiglu_limit", swiglu_limit)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise TypeError(f"{name}: expected a finite float, found {v!r}")
    if swiglu_limit <= 0:
        raise ValueError(f"swiglu_limit: expected > 0, found {swiglu_limit}")


def moe_nvfp4(x, router_w, router_bias, w13, s13, g13, w2, s2, g2, sh_w13, sh_s13, sh_g13, sh_w2, sh_s2, sh_g2,
              routed_scaling: float, out: torch.Tensor, workspace: MoEWorkspace, config: MoEConfig | MmaMoEConfig,
              swiglu_alpha: float = SWIGLU_ALPHA, swiglu_limit: float = SWIGLU_LIMIT,
              launches: str = "rgd", tiled: bool = False) -> torch.Tensor:
    """Raw call: three launches on the current stream. Writes and returns `out`; the routing
    (workspace.ids / .tw / .slot_e / .slot_w) and activations (workspace.act) stay readable.
    swiglu_alpha / swiglu_limit: the model config's SwiGLU-OAI constants (runtime kernel arguments).
    launches: the subset of r(outer), g(ate|up), d(own) to issue, for timing one launch alone (the
    ones before it must have run on the same workspace and inputs). tiled: the NVFP4 experts and an NVFP4
    shared expert are in the MMA tile layout (m3serve.quant.nvfp4.tile_nvfp4, per expert matrix), the layout
    the target holds them in."""
    cfg = config
    check_swiglu(swiglu_alpha, swiglu_limit)
    t, h, e, i, shared_fmt = _check(x, router_w, router_bias, w13, s13, g13, w2, s2, g2, sh_w13, sh_s13, sh_g13,
                                    sh_w2, sh_s2, sh_g2, out, workspace, cfg, tiled)
    if tiled and not (tileable("nvfp4", w13, s13) and tileable("nvfp4", w2, s2)):
        raise ValueError(f"tiled: the MMA tile layout needs H and I multiples of 128, found H={h}, I={i}")
    ws = workspace
    cuda = is_compiled(x)
    ptx = use_ptx(x)
    s = n_slots(t, e)
    sp = ws.slot_e.numel()
    if set(launches) - set("rgd"):
        raise ValueError(f"launches: expected letters of 'rgd', found {launches!r}")
    if "r" in launches and t <= cfg.ROUTER_ROWS:
        moe_router_rows[(e,)](
            x, router_w, router_bias, ws.rpart, ws.rcount, ws.ids, ws.tw, ws.slot_e, ws.slot_w, t, h, e, x.stride(0),
            s, float(routed_scaling), TOPK=TOPK, BT=triton.next_power_of_2(t), KC=min(cfg.RKC, h & -h),
            EP=triton.next_power_of_2(e), SP=sp, num_warps=cfg.router_warps)
    elif "r" in launches:
        moe_router[(e // cfg.RBE, cfg.RSPLIT)](
            x, router_w, router_bias, ws.rpart, ws.rcount, ws.ids, ws.tw, ws.slot_e, ws.slot_w, t, h, e, x.stride(0),
            s, float(routed_scaling), TOPK=TOPK, BT=cfg.BT, BE=cfg.RBE, BK=cfg.RBK, RSPLIT=cfg.RSPLIT,
            EP=triton.next_power_of_2(e), SP=sp, num_warps=cfg.router_warps)
    if shared_fmt == FMT_NVFP4:
        sw13, ss13, sg13 = sh_w13.view(torch.int32), sh_s13.view(torch.uint8), sh_g13
        sw2, ss2, sg2 = sh_w2.view(torch.int32), sh_s2.view(torch.uint8), sh_g2
    else:
        sw13, ss13, sg13, sw2, ss2, sg2 = sh_w13, g13, g13, sh_w2, g2, g2  # scale pointers unused
    if isinstance(cfg, MmaMoEConfig):
        if cuda:
            launch_mma_moe(x, w13.view(torch.int32), s13.view(torch.uint8), g13, w2.view(torch.int32),
                           s2.view(torch.uint8), g2, sw13, ss13, sg13, sw2, ss2, sg2, ws, out, t=t, h=h, e=e, i=i, s=s,
                           swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, cfg=cfg, launches=launches,
                           tiled=tiled)
            return out
        cfg = interpreted_config(cfg)  # the interpreter cannot run inline PTX: _nvfp4's kernels, same workspace
    if "g" in launches:
        moe_gate_up[(s + 1, i // cfg.BN)](
            x, w13.view(torch.int32), s13.view(torch.uint8), g13, sw13, ss13, sg13, ws.slot_e, ws.act, t, h, i,
            x.stride(0), s, float(swiglu_alpha), float(swiglu_limit), SHARED_FMT=shared_fmt, BT=cfg.BT, BN=cfg.BN,
            BK=cfg.BK, CUDA=cuda, PTX=ptx, TILED=tiled, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if "d" in launches:
        moe_down[(h // cfg.dbn, cfg.DSPLIT)](
            ws.act, w2.view(torch.int32), s2.view(torch.uint8), g2, sw2, ss2, sg2, ws.slot_e, ws.slot_w, out,
            ws.dpart, ws.dcount, t, h, i, s, out.stride(0), SHARED_FMT=shared_fmt, DSPLIT=cfg.DSPLIT, BT=cfg.BT,
            BN=cfg.dbn, BK=cfg.dbk, KT=i // cfg.DSPLIT // cfg.dbk, SP=sp, CUDA=cuda, PTX=ptx, TILED=tiled,
            num_warps=cfg.down_warps or cfg.num_warps, num_stages=cfg.down_stages or cfg.num_stages)
    return out


def interpreted_config(cfg: MmaMoEConfig) -> MoEConfig:
    """The _nvfp4 kernels' config that computes the same function in the same workspace on CPU tensors."""
    return MoEConfig(BT=cfg.BT, BN=cfg.bna, BK=STEP, RBE=cfg.RBE, RBK=cfg.RBK, RSPLIT=cfg.RSPLIT, DSPLIT=cfg.DSPLIT,
                     router_warps=cfg.router_warps, ROUTER_ROWS=cfg.ROUTER_ROWS, RKC=cfg.RKC, DBN=cfg.dbn, DBK=STEP)


# --- reference ------------------------------------------------------------------------------


def swiglu_oai_ref(g: torch.Tensor, u: torch.Tensor, alpha: float = SWIGLU_ALPHA,
                   limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    g = g.clamp(max=limit)
    u = u.clamp(-limit, limit)
    return g * torch.sigmoid(alpha * g) * (u + 1.0)


def expert_w13(w13, s13, g13, e: int) -> torch.Tensor:
    """fp32 [2I, H] of expert e (gate rows with g13[e, 0], up rows with g13[e, 1])."""
    i = w13.shape[1] // 2
    if w13.dtype == torch.bfloat16:
        return w13.float()
    gate = dequantize_nvfp4(w13[e, :i], s13[e, :i], g13[e, 0])
    up = dequantize_nvfp4(w13[e, i:], s13[e, i:], g13[e, 1])
    return torch.cat([gate, up])


def expert_w2(w2, s2, g2, e: int) -> torch.Tensor:
    if w2.dtype == torch.bfloat16:
        return w2.float()
    return dequantize_nvfp4(w2[e], s2[e], g2[e])


@dataclass
class MoEReference:
    y: torch.Tensor  # fp32 [T, H]
    logits: torch.Tensor  # fp32 [T, E]
    ids: torch.Tensor  # int64 [T, TOPK]
    w: torch.Tensor  # fp32 [T, TOPK]


def route_reference(x, router_w, router_bias, routed_scaling, ids_override=None):
    with true_fp32():
        logits = x.float() @ router_w.float().T
    sig = torch.sigmoid(logits)
    ids = torch.topk(sig + router_bias.float(), TOPK, dim=-1).indices if ids_override is None else ids_override.long()
    w = sig.gather(1, ids)
    return logits, ids, w / w.sum(dim=-1, keepdim=True) * routed_scaling


def expert_act(x, w13, s13, g13, e: int, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """fp32 SwiGLU-OAI activations [T, I] of expert e for all tokens (before the bf16 cast)."""
    w = expert_w13(w13, s13, g13, e)
    i = w.shape[0] // 2
    with true_fp32():
        hh = x.float() @ w.T
    return swiglu_oai_ref(hh[:, :i], hh[:, i:], alpha, limit)


def row_major(w13, s13, w2, s2, sh_w13, sh_s13, sh_w2, sh_s2, tiled: bool) -> tuple:
    """The experts' (and an NVFP4 shared expert's) packed bytes and scales in the row-major layout the references
    dequantize: untiled when `tiled`, else as given."""
    if not tiled:
        return w13, s13, w2, s2, sh_w13, sh_s13, sh_w2, sh_s2
    w13, s13 = untile_nvfp4(w13, s13)
    w2, s2 = untile_nvfp4(w2, s2)
    if sh_s13 is not None:
        sh_w13, sh_s13 = untile_nvfp4(sh_w13, sh_s13)
        sh_w2, sh_s2 = untile_nvfp4(sh_w2, sh_s2)
    return w13, s13, w2, s2, sh_w13, sh_s13, sh_w2, sh_s2


def moe_reference(x, router_w, router_bias, w13, s13, g13, w2, s2, g2, sh_w13, sh_s13, sh_g13, sh_w2, sh_s2, sh_g2,
                  routed_scaling, out=None, workspace=None, config=None, swiglu_alpha: float = SWIGLU_ALPHA,
                  swiglu_limit: float = SWIGLU_LIMIT, ids_override=None, tiled: bool = False) -> MoEReference:
    w13, s13, w2, s2, sh_w13, sh_s13, sh_w2, sh_s2 = row_major(w13, s13, w2, s2, sh_w13, sh_s13, sh_w2, sh_s2, tiled)
    logits, ids, w = route_reference(x, router_w, router_bias, routed_scaling, ids_override)
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        a = expert_act(x, w13, s13, g13, e, swiglu_alpha, swiglu_limit).to(torch.bfloat16).float()
        with true_fp32():
            ye = a @ expert_w2(w2, s2, g2, e).T
        coef = (w * (ids == e)).sum(dim=1, keepdim=True)  # 0 for tokens not routed to e
        y += coef * ye
    sh13 = (sh_w13, sh_s13, sh_g13) if sh_s13 is not None else (sh_w13, None, None)
    a_sh = expert_act(x, *sh13, 0, swiglu_alpha, swiglu_limit).to(torch.bfloat16).float()
    with true_fp32():
        y += a_sh @ expert_w2(sh_w2, sh_s2, sh_g2, 0).T
    return MoEReference(y=y, logits=logits, ids=ids, w=w)


def moe_stock(x, router_w, router_bias, w13, s13, g13, w2, s2, g2, sh_w13, sh_s13, sh_g13, sh_w2, sh_s2, sh_g2,
              routed_scaling, out=None, workspace=None, config=None, swiglu_alpha: float = SWIGLU_ALPHA,
              swiglu_limit: float = SWIGLU_LIMIT, tiled: bool = False) -> torch.Tensor:
    """Without the engine: torch routing, then per touched expert dequantize + bf16 GEMMs."""
    w13, s13, w2, s2, sh_w13, sh_s13, sh_w2, sh_s2 = row_major(w13, s13, w2, s2, sh_w13, sh_s13, sh_w2, sh_s2, tiled)
    _, ids, w = route_reference(x, router_w, router_bias, routed_scaling)
    y = torch.zeros_like(x, dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        rows = (ids == e).any(dim=1).nonzero().flatten()
        w1 = expert_w13(w13, s13, g13, e).to(torch.bfloat16)
        hh = (x[rows] @ w1.T).float()
        i = hh.shape[1] // 2
        a = swiglu_oai_ref(hh[:, :i], hh[:, i:], swiglu_alpha, swiglu_limit).to(torch.bfloat16)
        ye = (a @ expert_w2(w2, s2, g2, e).to(torch.bfloat16).T).float()
        y[rows] += (w[rows] * (ids[rows] == e)).sum(dim=1, keepdim=True) * ye
    sh13 = (sh_w13, sh_s13, sh_g13) if sh_s13 is not None else (sh_w13, None, None)
    hh = (x @ expert_w13(*sh13, 0).to(torch.bfloat16).T).float()
    i = hh.shape[1] // 2
    a = swiglu_oai_ref(hh[:, :i], hh[:, i:], swiglu_alpha, swiglu_limit).to(torch.bfloat16)
    y += (a @ expert_w2(sh_w2, sh_s2, sh_g2, 0).to(torch.bfloat16).T).float()
    return y.to(torch.bfloat16)


# --- compare --------------------------------------------------------------------------------


def compare(out: torch.Tensor, ref: MoEReference, case: Case) -> None:
    """Three checks, each with its own band (see docs/kernels.md, moe.nvfp4):

    1. routing. Logits differ from the reference only by fp32 summation order:
       |dlogit| <= b = 2*H*u*sum|x*wr|, so |dsigmoid| <= b/4. Each token's kernel top-4 set
       must equal the reference set, or every kernel pick must score within 2*(b/4) of the
       reference 4th-best (a near-tie, legitimately resolved either way). Weights:
       <= 8u relative + the propagated sigmoid band (renormalisation of 4 terms).
    2. activations (workspace.act, bf16) of every touched expert vs the fp32 reference:
       one bf16 ulp (2**-7 |a|) + the gate/up accumulation bound (2*H*u*sum|x*w13|)
       propagated through SwiGLU-OAI's derivative bounds: |da/dg| <= 1.2 (|u|+1) (for any
       alpha: d/dg g*sigmoid(alpha*g) = sig(z) + z*sig(z)*(1-sig(z)), z = alpha*g, is at most 1.1),
       |da/du| <= |g|.
    3. output vs the kernel's own activations and routing weights pushed through the
       reference down projection: gemm_band with K = I + slots + 1 terms per output."""
    x, router_w, router_bias, w13, s13, g13, w2, s2, g2, sh_w13, sh_s13, sh_g13, sh_w2, sh_s2, sh_g2, scaling, _, ws, _ = \
        case.args
    alpha = case.kwargs.get("swiglu_alpha", SWIGLU_ALPHA)
    limit = case.kwargs.get("swiglu_limit", SWIGLU_LIMIT)
    w13, s13, w2, s2, sh_w13, sh_s13, sh_w2, sh_s2 = row_major(w13, s13, w2, s2, sh_w13, sh_s13, sh_w2, sh_s2,
                                                               case.kwargs.get("tiled", False))
    t, h = x.shape
    e_n = router_w.shape[0]
    with true_fp32():
        b_logit = 2.0 * h * FP32_U * (x.float().abs() @ router_w.float().abs().T)
    ids = ws.ids[:t].long()
    sig = torch.sigmoid(ref.logits)
    score = sig + router_bias.float()
    same = torch.equal(torch.sort(ids, dim=1).values, torch.sort(ref.ids, dim=1).values)
    if not same:
        kth = torch.topk(score, TOPK, dim=1).values[:, -1:]
        slack = 2.0 * (b_logit.max(dim=1, keepdim=True).values / 4.0) + 1e-7
        picked = score.gather(1, ids)
        if bool((picked < kth - slack).any()) or bool((ids < 0).any()) or bool((ids >= e_n).any()):
            raise AssertionError(f"moe.nvfp4 routing: kernel ids {ids.tolist()} vs reference {ref.ids.tolist()} "
                                 f"are not within the near-tie slack {float(slack.max()):.3g}")
        ref = moe_reference(*case.args, **case.kwargs, ids_override=ids)  # legitimate near-tie: certify the rest on it
    sig_k = sig.gather(1, ids)
    w_ref = sig_k / sig_k.sum(dim=1, keepdim=True) * scaling
    # |dw_k| <= scaling * (|ds_k| + (s_k/sum) * sum|ds|) / sum <= scaling * 5 * (b/4) / sum, |ds| <= b/4
    b_sig = b_logit.max(dim=1, keepdim=True).values / 4.0
    w_band = 8 * FP32_U * w_ref.abs() + scaling * 5.0 * b_sig / sig_k.sum(dim=1, keepdim=True) + 1e-30
    # compare per (token, expert id): the kernel stores its picks in score order, as does topk
    order_k = torch.argsort(ids, dim=1)
    assert_band("moe.nvfp4 routing weights", ws.tw[:t].gather(1, order_k), w_ref.gather(1, order_k), w_band)
    # 2. activations of every slot
    s = n_slots(t, e_n)
    slot_e = ws.slot_e[:s].long()
    touched = torch.unique(ids)
    if not torch.equal(slot_e[slot_e >= 0], touched) or bool((slot_e[len(touched):] != -1).any()):
        raise AssertionError(f"moe.nvfp4 slots: {slot_e.tolist()} vs touched experts {touched.tolist()}")
    sh13 = (sh_w13, sh_s13, sh_g13) if sh_s13 is not None else (sh_w13, None, None)
    sh2 = (sh_w2, sh_s2, sh_g2)
    slots = [(k, int(e), (w13, s13, g13), (w2, s2, g2), int(e)) for k, e in enumerate(slot_e.tolist()) if e >= 0]
    slots.append((s, -1, sh13, sh2, 0))
    y2 = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    absprod = torch.zeros_like(y2)
    for k, e, p13, p2, ei in slots:
        wf = expert_w13(*p13, ei)
        i = wf.shape[0] // 2
        with true_fp32():
            hh = x.float() @ wf.T
            bh = 2.0 * h * FP32_U * (x.float().abs() @ wf.abs().T)
        g, u = hh[:, :i], hh[:, i:]
        a_ref = swiglu_oai_ref(g, u, alpha, limit)
        a_band = BF16_REL * a_ref.abs() + 1.2 * (u.abs().clamp(max=limit) + 1) * bh[:, :i] \
            + g.abs().clamp(max=limit) * bh[:, i:] + 1e-30
        a_k = ws.act[k].float()
        assert_band(f"moe.nvfp4 act (slot {k}, expert {e})", a_k, a_ref, a_band)
        coef = ws.slot_w[k, :t].float()[:, None] if e >= 0 else torch.ones(t, 1, device=x.device)
        if e >= 0:
            want = (w_ref * (ids == e)).sum(dim=1, keepdim=True)
            assert_band(f"moe.nvfp4 slot_w (slot {k})", coef, want, 8 * FP32_U * want.abs() + w_band.max() + 1e-30)
        w2f = expert_w2(*p2, ei)
        with true_fp32():
            y2 += coef * (a_k @ w2f.T)
            absprod += coef.abs() * (a_k.abs() @ w2f.abs().T)
    i = w2.shape[2] * 2
    assert_band("moe.nvfp4 y", out, y2, gemm_band(y2, absprod, i + len(slots)))


# --- cases and cells ------------------------------------------------------------------------


def random_experts(e: int, rows: int, cols: int, device: torch.device, gen: torch.Generator | None):
    """NVFP4 experts [e, rows, cols]: uniform codes, E4M3 block scales in [0.5, 32), ENCODE
    scales 2688 / U(0.5, 2): gate/up values of a few units, so SwiGLU's clamps are exercised."""
    if gen is None:
        return (torch.zeros(e, rows, cols // 2, dtype=torch.uint8, device=device),
                torch.zeros(e, rows, cols // 16, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn),
                torch.ones(e, dtype=torch.float32, device=device))
    dg = device_rng(gen, device)
    packed = torch.randint(0, 256, (e, rows, cols // 2), generator=dg, dtype=torch.uint8, device=device)
    scale = torch.randint(0x30, 0x68, (e, rows, cols // 16), generator=dg, dtype=torch.uint8, device=device)
    gs = 2688.0 / (0.5 + 1.5 * torch.rand(e, generator=dg, device=device))
    return packed, scale.view(torch.float8_e4m3fn), gs


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    e, h, i, shared_bf16 = cell.shape
    cfg: MoEConfig = cell.config["moe"]
    w13, s13, g13a = random_experts(e, 2 * i, h, device, gen)
    g13b = random_experts(e, 1, 16, device, gen)[2] if gen is not None else g13a
    g13 = torch.stack([g13a, g13b], dim=1).contiguous()
    w2, s2, g2 = random_experts(e, h, i, device, gen)
    if shared_bf16:
        if gen is None:
            sh = (torch.zeros(2 * i, h, dtype=torch.bfloat16, device=device), None, None,
                  torch.zeros(h, i, dtype=torch.bfloat16, device=device), None, None)
        else:
            dg = device_rng(gen, device)
            sh = ((0.02 * torch.randn(2 * i, h, generator=dg, device=device)).to(torch.bfloat16), None, None,
                  (0.02 * torch.randn(h, i, generator=dg, device=device)).to(torch.bfloat16), None, None)
    else:
        a, b, c = random_experts(1, 2 * i, h, device, gen)
        c2 = random_experts(1, 1, 16, device, gen)[2] if gen is not None else c
        d, f, g = random_experts(1, h, i, device, gen)
        sh = (a, b, torch.stack([c, c2], dim=1).contiguous(), d, f, g)
    if gen is None:
        router_w = torch.zeros(e, h, dtype=torch.float32, device=device)
        bias = torch.zeros(e, dtype=torch.float32, device=device)
    else:
        dg = device_rng(gen, device)
        router_w = 0.02 * torch.randn(e, h, generator=dg, device=device)
        bias = 0.05 * torch.randn(e, generator=dg, device=device)
    x = fresh_x(rows, h, device, gen)
    out = poisoned((rows, h), torch.bfloat16, device)
    ws = make_moe_workspace(cfg, rows, e, h, i, device)
    if gen is not None:
        ws.act.fill_(float("nan"))  # the activations are checked too: poison them
    tiled = tileable("nvfp4", w13, s13) and tileable("nvfp4", w2, s2)
    if tiled:  # the layout the target holds the experts in
        w13, s13 = tile_nvfp4(w13, s13)
        w2, s2 = tile_nvfp4(w2, s2)
        if not shared_bf16:
            sh = (*tile_nvfp4(sh[0], sh[1]), sh[2], *tile_nvfp4(sh[3], sh[4]), sh[5])
    n_exp = min(e, TOPK * rows)  # touched experts, upper bound
    wbytes = (n_exp + 1) * 3 * h * i * 9 // 16
    return Case(args=(x, router_w, bias, w13, s13, g13, w2, s2, g2, *sh, 2.0, out, ws, cfg), kwargs={"tiled": tiled},
                bytes_moved=wbytes + e * h * router_w.element_size() + rows * h * 4)


MOE_ROW_RANGES = ((1, 4), (5, 16), (17, 32), (33, 48))


def _bt(hi: int) -> int:
    return 16 if hi <= 16 else 32 if hi <= 32 else 64


def _moe_cfg(lo: int, hi: int, i: int, shared_bf16: int) -> MoEConfig:
    """Warps grow with the padded token count so that the [BN, BT] accumulators and the
    routing tiles stay in registers (aot_check reports no spills with these). At 5-16 tokens with
    an NVFP4 shared expert the down projection takes 256-wide K tiles over 256-wide splits with 2
    stages: at 16 tokens 8 % faster than the 128-wide default on the H200, at 1 token 6 % slower,
    with a BF16 shared expert 5 % slower (bench/results/kernel_variants/kernel-variants-h200.json, d64x256k12s2 vs
    base); the other cells were not swept and keep the default."""
    bt = _bt(hi)
    cfg = MoEConfig(BT=bt, num_warps=4 if bt == 16 else 8, router_warps={16: 4, 32: 8, 64: 16}[bt])
    if lo > 4 and bt == 16 and not shared_bf16:
        cfg = replace(cfg, DBK=256, DSPLIT=i // 256, down_stages=2)
    return cfg


# 1-8 tokens with an NVFP4 shared expert: gate|up and down on the register-operand MMA step (_mma). I = 3072:
# * down split 8 ways (on MMA tiles, H100, bench/kernel_variants.py --moe-mma-only: 109.8 / 379.8 us at 1 / 8 tokens
#   against 116.5 / 406.1 us split 4, kernel-variants-moe-tiles-h100.json), capped at 80 registers a thread: its
#   96 x 8 = 768 CTAs of 4 warps need 6 a SM to run in one wave, and the one-token variant compiles to 90 registers
#   (5 a SM: a second wave of 108 CTAs). In the decode step's graph the cap takes down from 37.0 to 30.5 us a layer
#   at one token and is level at 8 (H100, decode/decode-target-h100-m3_12-wave-caps.json, route
#   target-down-uncapped). On MMA tiles only: row-major weights keep 8 bytes on the stack at 80 (_mma);
# * gate|up split 2 ways over H at one token (GSPLIT 2 while (touched slots + shared) x 2 <= 10: 960 CTAs, one
#   wave). The paired loop compiles to 64 registers uncapped, no stack, so the split no longer needs the register
#   cap that spilled (split 4 ways capped at 64: 8 bytes on the stack, refused). In the 12-layer step on the H100,
#   paired: 44.6 against 48.4 us a layer whole (decode/decode-target-h100-m3_12-paired.json, route
#   target-paired-split2); whole-H side by side: route target-gate-up-whole.
# The TP2 shard (1536) keeps its measured down split (96 x 2 CTAs: one wave uncapped).
MMA_MOE_ROWS = (1, 8)
MMA_MOE = {3072: MmaMoEConfig(DSPLIT=8, down_maxnreg=80, GSPLIT=2, GSPLIT_SLOTS=10), 1536: MmaMoEConfig(DSPLIT=2)}


def _row_ranges(sb: int) -> tuple[tuple[int, int], ...]:
    if sb:
        return MOE_ROW_RANGES
    return (MMA_MOE_ROWS, (MMA_MOE_ROWS[1] + 1, 16)) + MOE_ROW_RANGES[2:]


def _cell_cfg(lo: int, hi: int, i: int, sb: int):
    if not sb and (lo, hi) == MMA_MOE_ROWS:
        return MMA_MOE[i]
    return _moe_cfg(lo, hi, i, sb)


CELLS = tuple(
    Cell(rows=(lo, hi), shape=(128, 6144, i, sb),
         why=f"M3 MoE layers 3-59 ({tp}: expert width {i}, {'BF16' if sb else 'NVFP4'} shared expert), {lo}-{hi} tokens"
             + (" (MMA step)" if not sb and (lo, hi) == MMA_MOE_ROWS else ""),
         config={"moe": _cell_cfg(lo, hi, i, sb)})
    for sb in (0, 1) for i, tp in ((3072, "TP1"), (1536, "TP2")) for lo, hi in _row_ranges(sb)
)
_ICFG = MoEConfig(BT=16, BN=64, BK=64, RBE=16, RBK=64, RSPLIT=2, DSPLIT=2, RKC=64)  # RKC: moe_router_rows loops
_ICFG_KT = MoEConfig(BT=16, BN=64, BK=64, RBE=16, RBK=64, RSPLIT=2, DSPLIT=1, DBK=32)
INTERP_CELLS = (
    Cell(rows=(1, 3), shape=(16, 256, 128, 0), why="interpreter: 1-3 tokens, 4-12 of 16 experts, NVFP4 shared",
         config={"moe": _ICFG}),
    Cell(rows=(5, 5), shape=(16, 256, 128, 0), why="interpreter: 20 picks > 16 experts: S = E slots, -1 padded",
         config={"moe": _ICFG}),
    Cell(rows=(2, 2), shape=(16, 256, 128, 1), why="interpreter: BF16 shared expert", config={"moe": _ICFG}),
    Cell(rows=(1, 2), shape=(16, 256, 128, 0), why="interpreter: the K-split router (moe_router) at decode token "
         "counts (ROUTER_ROWS 0)", config={"moe": replace(_ICFG, ROUTER_ROWS=0)}),
    Cell(rows=(3, 3), shape=(16, 256, 128, 0), why="interpreter: 4 down K tiles per slot (flat loop, no split)",
         config={"moe": _ICFG_KT}),
    Cell(rows=(2, 2), shape=(16, 256, 128, 1), why="interpreter: BF16 shared expert, 2 down K tiles per slot",
         config={"moe": MoEConfig(BT=16, BN=64, BK=64, RBE=16, RBK=64, RSPLIT=2, DSPLIT=2, DBN=32, DBK=32)}),
    Cell(rows=(1, 4), shape=(16, 256, 256, 0), why="interpreter: an MMA config on the CPU (its interpreted_config)",
         config={"moe": MmaMoEConfig(RBE=16, RBK=64, RSPLIT=2, DSPLIT=2)}),
)


def warmup(device: torch.device) -> None:
    for c in CELLS:
        case = make_case(c, c.rows[1], device, None)
        moe_nvfp4(*case.args, **case.kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


ENTRY = Entry(
    name="moe.nvfp4", kind="moe.nvfp4", raw_call=moe_nvfp4, reference=moe_reference, compare=compare,
    make_case=make_case, cells=CELLS, interp_cells=INTERP_CELLS, warmup=warmup, enabled=lambda: ENABLED,
    stock=moe_stock,
)
ENTRIES = (ENTRY,)
