"""Explicit routing of one model's modules to certified Triton entries (the Hopper decode target), bound once.

    install(model, mode, max_rows)   build the model's kernel plan (targets.plan) and bind it
    bind(model, plan)                each routed module gets ONE bound implementation, `module.kernel` (None = the
                                     stock path); its forward calls it. The implementation holds, per row range,
                                     the prepared launch of the plan's cell (raw call, tile config, workspace),
                                     so a call picks its launch by row count alone: no catalog, no lookup.
    warmup(model, max_rows)          compiles the plan's cells

    mode "off"      the stock path, byte for byte (no module has a kernel)
    mode "auto"     rows that lie in a certified cell run the entry; others stock
    mode "require"  as auto, but rows outside every certified cell raise, naming the module, rows and cell (at
                    build for the rows 1..max_rows the plan promises, at the call for any others)

The plan belongs to the model it is bound to: two models in one process route independently. Nothing here
reads the environment.
Routed today: quantized linears (linear.nvfp4 / linear.mxfp8 / linear.fp8; qkv.{fmt} for an attention layer's
projections as one GEMM) and the MoE layer (moe.nvfp4: router + routed experts + shared expert in three launches;
moe.grouped for every other expert format and row count); on bf16 CUDA activations the decoder-level Gemma norms
(norm.rms; norm.add_rms where a residual add precedes the norm), each attention layer's q/k norms + RoPE
(attn.qk_prep, one launch), the dense MLPs' SwiGLU-OAI (mlp.swiglu_oai) and, in the dense all-experts MoE, the
router (moe.route_small) and the stacked experts' activation. CPU or fp32 activations always take the stock path
(byte for byte). A dense bf16 LM head on one rank gets the model's greedy head (head.bf16: GEMV + argmax of the
bf16 logits in two launches, no logits written), which the decode graphs' greedy variant calls; its logits stay
cuBLAS. With targets.plan.HEAD12 the greedy head's 1-8 rows run head.head12 over the head's 12-bit tiles
(head12_tiles: bit-checked at bind, else head.bf16). A quantized head is a linear like any other.
"""

from __future__ import annotations

import logging
from bisect import bisect_right

import torch

from m3serve.kernels.gemm._gemm_tiles import make_workspace as gemm_workspace
from m3serve.kernels.head.bf16 import make_head_workspace
from m3serve.kernels.head.head12 import make_head12_workspace
from m3serve.kernels.moe.grouped import make_workspace as grouped_workspace
from m3serve.kernels.moe.nvfp4 import make_moe_workspace
from m3serve.model.eagle3 import Eagle3Attention, Eagle3MLP, LlamaRMSNorm
from m3serve.model.layers import Linear, RMSNorm, rope_inv_freq, swiglu_oai
from m3serve.model.m3 import Attention
from m3serve.model.moe import DenseMLP, MoE, route as stock_route
from m3serve.quant.head12 import try_encode_head12
from m3serve.quant.head12_tiles import Head12Tiles, tile_head12
from m3serve.quant.tiles import TILED_FORMATS
from m3serve.targets import fused_projection
from m3serve.targets.dispatch import miss
from m3serve.targets.plan import (ALL_EXPERTS_MAX, GROUPED_FMT, KernelPlan, Route, build_drafter_plan,
                                  build_plan)

log = logging.getLogger(__name__)

__all__ = ["install", "install_drafter", "bind", "mode_of", "plan_of", "warmup", "moe_all_experts",
           "combine_selected", "launches", "ALL_EXPERTS_MAX", "GROUPED_FMT"]

# the classes whose instances carry a `kernel` slot (bind clears it on every instance the plan does not route)
ROUTED_CLASSES = (Linear, RMSNorm, Attention, DenseMLP, MoE, LlamaRMSNorm, Eagle3Attention, Eagle3MLP)


# --- the prepared launches ---------------------------------------------------------------------------------
class Launch:
    """One certified cell of one module, ready to launch: the entry's raw call, the cell's tile config and the
    call site's workspace (made on its first call, then kept: one per module and cell, as the entries require)."""
    __slots__ = ("run", "entry", "cell", "config", "workspace")

    def __init__(self, entry, cell, config_key: str | None):
        self.run = entry.raw_call
        self.entry, self.cell = entry, cell
        self.config = cell.config[config_key] if config_key else None
        self.workspace = None


class Uncovered:
    """require mode: rows of a module that no certified cell covers; a call there raises naming them."""
    __slots__ = ("where", "kind", "shape")

    def __init__(self, where: str, kind: str, shape: tuple[int, ...]):
        self.where, self.kind, self.shape = where, kind, shape

    def fail(self, rows: int):
        raise ValueError(f"{self.where}: require mode, but {miss(self.kind, rows, self.shape)}")


class RowTable:
    """A route bound for one module: row count -> its Launch, None (stock) or, in require mode, a raise."""
    __slots__ = ("starts", "slots", "kind")

    def __init__(self, route: Route, where: str, mode: str):
        strict = route.strict and mode == "require"
        slots = []
        for s in route.spans:
            if s.cell is not None:
                slots.append(Launch(s.entry, s.cell, route.config_key))
            else:
                slots.append(Uncovered(where, route.kind, route.shape) if strict and not s.off else None)
        self.starts, self.slots, self.kind = route.starts, tuple(slots), route.kind

    def __call__(self, rows: int) -> Launch | None:
        got = self.slots[bisect_right(self.starts, rows) - 1]
        if got.__class__ is Uncovered:
            got.fail(rows)
        return got

    def launches(self):
        return [s for s in self.slots if isinstance(s, Launch)]


def _routes(t: torch.Tensor) -> bool:
    """Whether the entries run on `t`'s device: CUDA only (CPU tensors take the stock path, byte for byte, also
    under require; the CPU tests open this gate to run the entries under the Triton interpreter)."""
    return t.device.type == "cuda"


def _bf16_cuda(where: str, t: torch.Tensor, mode: str) -> bool:
    """Whether the fused entries may take `t`: off CUDA never (_routes); on CUDA anything but bf16 raises under
    require."""
    if not _routes(t):
        return False
    if t.dtype != torch.bfloat16:
        if mode == "require":
            raise ValueError(f"{where}: require mode needs bf16 activations, found {t.dtype}")
        return False
    return True


def _per_row(lin, t: torch.Tensor, n: int) -> torch.Tensor:
    """A [P] per-part scale as the entries take it: 0-dim when P == 1, else one value per output row (kept on
    the module, so it lives and dies with the weight it belongs to)."""
    if t.numel() == 1:
        return t.reshape(())
    cached = getattr(lin, "_routed_row_scale", None)
    if cached is None or cached.shape[0] != n:
        cached = lin._routed_row_scale = t.float().repeat_interleave(n // t.numel()).contiguous()
    return cached


# --- bound implementations, one per module role ------------------------------------------------------------
class LinearKernel:
    """A quantized linear on linear.{fmt}: (linear, x [..., K]) -> bf16 [..., N], or None (stock)."""
    __slots__ = ("table", "fmt", "n", "k", "mode")

    def __init__(self, lin: Linear, table: RowTable, mode: str):
        self.table, self.fmt, self.n, self.k, self.mode = table, lin.fmt, lin.out_features, lin.in_features, mode

    def __call__(self, lin, x: torch.Tensor):
        if not _routes(x):
            return None
        if lin.fmt != self.fmt:
            raise ValueError(f"{lin.name}: weights are {lin.fmt} now, the kernel plan bound {self.fmt}: bind the "
                             "plan again after replacing weights")
        n, k = self.n, self.k
        x2 = x.reshape(-1, k)
        if x2.dtype != torch.bfloat16:
            if self.mode == "require":
                raise ValueError(f"{lin.name}: require mode needs bf16 activations, found {x2.dtype}")
            return None
        rows = x2.shape[0]
        if rows == 0:
            return None
        launch = self.table(rows)
        if launch is None:
            return None
        cfg = launch.config
        ws = launch.workspace
        if ws is None:
            ws = launch.workspace = gemm_workspace(cfg, n, x.device)
        out = torch.empty(rows, n, dtype=torch.bfloat16, device=x.device)
        x2 = x2.contiguous()
        if self.fmt == "nvfp4":
            launch.run(x2, lin.q_packed, lin.q_scale, _per_row(lin, lin.q_global_scale, n), out, ws, cfg,
                       tiled=lin.q_layout == "mma_tile")
        elif self.fmt == "mxfp8":
            launch.run(x2, lin.q_q, lin.q_scale, out, ws, cfg, tiled=lin.q_layout == "mma_tile")
        else:
            launch.run(x2, lin.q_q, _per_row(lin, lin.q_scale, n), out, ws, cfg)
        return out.view(*x.shape[:-1], n)


class HeadKernel:
    """The LM head's greedy rows: (lm_head, h [R, H]) -> token ids [R] int64, argmax of the bf16 logits (first index on
    ties) without writing them, on head.head12 (1-8 rows, where the head has its 12-bit tiles) or head.bf16; None
    (the caller takes argmax of the logits) off CUDA, for non-bf16 activations, or where no cell serves R (the head
    is never required: the logits path is the stock one)."""
    __slots__ = ("table", "table12", "tiles")

    def __init__(self, table: RowTable, table12: RowTable | None = None, tiles: Head12Tiles | None = None):
        self.table, self.table12, self.tiles = table, table12, tiles

    def __call__(self, lin, h: torch.Tensor):
        if not _routes(h) or h.dtype != torch.bfloat16 or h.dim() != 2:
            return None
        rows = h.shape[0]
        coded = self.table12(rows) if self.table12 is not None else None
        launch = coded if coded is not None else self.table(rows)
        if launch is None:
            return None
        ids = torch.empty(rows, dtype=torch.int64, device=h.device)
        best = torch.empty(rows, dtype=torch.float32, device=h.device)
        if coded is not None:
            if launch.workspace is None:
                launch.workspace = make_head12_workspace(launch.config, self.tiles.shape[0], h.device)
            launch.run(h.contiguous(), *self.tiles.args(), ids, best, launch.workspace, 0, launch.config)
        else:
            w = lin.weight
            if launch.workspace is None:
                launch.workspace = make_head_workspace(launch.config, w.shape[0], w.device)
            launch.run(h.contiguous(), w, ids, best, launch.workspace, 0, launch.config)
        return ids


class HeadLogitsKernel:
    """The LM head's logits rows, bound on the head Linear: (lm_head, h [R, H]) -> bf16 logits [R, V] on
    head.head12_logits (1-8 rows) from the head's 12-bit tiles; None (cuBLAS over the BF16 weight) elsewhere."""
    __slots__ = ("table", "tiles")

    def __init__(self, table: RowTable, tiles: Head12Tiles):
        self.table, self.tiles = table, tiles

    def __call__(self, lin, h: torch.Tensor):
        if not _routes(h) or h.dtype != torch.bfloat16 or h.dim() != 2:
            return None
        launch = self.table(h.shape[0])
        if launch is None:
            return None
        v = self.tiles.shape[0]
        if launch.workspace is None:
            launch.workspace = make_head12_workspace(launch.config, v, h.device)
        out = torch.empty(h.shape[0], v, dtype=torch.bfloat16, device=h.device)
        return launch.run(h.contiguous(), *self.tiles.args(), out, launch.workspace, launch.config)


def head12_tiles(lin) -> Head12Tiles | None:
    """The head's 12-bit tiles (quant.head12_tiles), built once per weight and kept on the Linear: encoded, decoded
    and compared bit for bit with the BF16 weight (quant.head12.try_encode_head12), then laid out for the MMA head;
    None (the BF16 head serves) when the check or the layout refuses, with the reason logged."""
    w = lin.weight
    key = (w.data_ptr(), w._version, tuple(w.shape))
    cached = getattr(lin, "_head12", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    tiles = None
    with torch.no_grad():
        h = try_encode_head12(w.detach())
        if h is None:
            log.warning("%s: the 12-bit head refused this weight (escape rate or bit check); the BF16 head serves",
                        lin.name or "lm_head")
        else:
            try:
                tiles = tile_head12(h)
            except ValueError as exc:
                log.warning("%s: the 12-bit head's MMA layout refused this weight (%s); the BF16 head serves",
                            lin.name or "lm_head", exc)
            del h
    lin._head12 = (key, tiles)
    return tiles


class NormKernel:
    """A decoder-level Gemma norm: norm(norm, x) through norm.rms, add_norm(norm, residual, delta) -> (h, y)
    through norm.add_rms; each None where stock runs."""
    __slots__ = ("where", "rms", "add_rms", "mode")

    def __init__(self, where: str, rms: RowTable, add_rms: RowTable, mode: str):
        self.where, self.rms, self.add_rms, self.mode = where, rms, add_rms, mode

    def weight(self, norm) -> torch.Tensor:
        return norm.weight

    def norm(self, norm, x: torch.Tensor):
        """x [..., H] -> Gemma RMSNorm of it (1 + weight applied)."""
        if not _bf16_cuda(self.where, x, self.mode) or x.numel() == 0:
            return None
        h = x.shape[-1]
        rows = x.numel() // h
        launch = self.rms(rows)
        if launch is None:
            return None
        x2 = x.reshape(rows, h)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        out = torch.empty(rows, h, dtype=torch.bfloat16, device=x.device)
        launch.run(x2, self.weight(norm), float(norm.eps), out)
        return out.view(x.shape)

    def add_norm(self, norm, residual: torch.Tensor, delta: torch.Tensor):
        """(residual + delta, the norm of it) in one launch."""
        where = self.where
        if not (_bf16_cuda(where, residual, self.mode) and _bf16_cuda(where, delta, self.mode)) \
                or residual.numel() == 0:
            return None
        h = residual.shape[-1]
        rows = residual.numel() // h
        launch = self.add_rms(rows)
        if launch is None:
            return None
        r2, d2 = residual.reshape(rows, h), delta.reshape(rows, h)
        r2 = r2 if r2.stride(1) == 1 else r2.contiguous()
        d2 = d2 if d2.stride(1) == 1 else d2.contiguous()
        h_out = torch.empty(rows, h, dtype=torch.bfloat16, device=residual.device)
        y_out = torch.empty(rows, h, dtype=torch.bfloat16, device=residual.device)
        launch.run(d2, r2, self.weight(norm), float(norm.eps), h_out, y_out)
        return h_out.view(residual.shape), y_out.view(residual.shape)


class LlamaNormKernel(NormKernel):
    """A drafter's Llama norm as norm.rms / norm.add_rms with its exact Gemma-form weight (w - 1, set at bind)."""
    __slots__ = ()

    def weight(self, norm) -> torch.Tensor:
        return norm.gemma_weight


class QkPrepKernel:
    """Attention.project with the q/k (and index q/k) norms and RoPE in one attn.qk_prep launch, after the
    projections as one fused GEMM a format group (targets.fused_projection; qkv.{fmt} when quantized, linear.bf16
    for the dense index group beside it at 1-4 rows) or, where none serves,
    through each part's own linear kernel. (attn, x [T, H], positions) -> (q, k, v, iq, ik), or None (stock)."""
    __slots__ = ("where", "prep", "qkv", "index", "mode", "inv_freq")

    def __init__(self, where: str, prep: RowTable, qkv: RowTable | None, mode: str, index: RowTable | None = None):
        self.where, self.prep, self.qkv, self.index, self.mode = where, prep, qkv, index, mode
        self.inv_freq = None

    def __call__(self, attn, x: torch.Tensor, positions: torch.Tensor):
        if not _bf16_cuda(self.where, x, self.mode) or x.dim() != 2 or x.shape[0] == 0:
            return None
        t = x.shape[0]
        launch = self.prep(t)
        if launch is None:
            return None
        cfg = attn.cfg
        d = cfg.head_dim
        inv_freq = self.inv_freq
        if inv_freq is None or inv_freq.device != x.device:
            inv_freq = self.inv_freq = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, x.device)
        fused = fused_projection.project(attn, x, self.qkv, self.index)   # one GEMM a group, or None: one a part
        sparse = attn.sparse
        if fused is not None:
            q, k, v, *idx = fused
            index_in = dict(iq=idx[0], ik=idx[1]) if sparse else {}
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            index_in = dict(iq=attn.index_q_proj(x), ik=attn.index_k_proj(x)) if sparse else {}
        v = v.view(t, attn.hk, d)
        q_out = torch.empty(t, attn.hq, d, dtype=torch.bfloat16, device=x.device)
        k_out = torch.empty(t, attn.hk, d, dtype=torch.bfloat16, device=x.device)
        index = {}
        if sparse:
            di = cfg.index_head_dim
            index = dict(**index_in, iq_norm_w=attn.index_q_norm.weight, ik_norm_w=attn.index_k_norm.weight,
                         iq_out=torch.empty(t, attn.hk, di, dtype=torch.bfloat16, device=x.device),
                         ik_out=torch.empty(t, di, dtype=torch.bfloat16, device=x.device))
        q_out, k_out, iq_out, ik_out = launch.run(q, k, positions.contiguous(), attn.q_norm.weight,
                                                  attn.k_norm.weight, inv_freq, float(attn.q_norm.eps), q_out,
                                                  k_out, **index)
        return q_out, k_out, v, iq_out, ik_out


class SwigluKernel:
    """A dense MLP's SwiGLU-OAI activation: (mlp, gate_up [..., 2I]) -> bf16 [..., I] (mlp.swiglu_oai)."""
    __slots__ = ("where", "table", "mode")

    def __init__(self, where: str, table: RowTable, mode: str):
        self.where, self.table, self.mode = where, table, mode

    def __call__(self, mlp, gate_up: torch.Tensor):
        if not _bf16_cuda(self.where, gate_up, self.mode) or gate_up.numel() == 0:
            return None
        two_i = gate_up.shape[-1]
        rows, i = gate_up.numel() // two_i, two_i // 2
        launch = self.table(rows)
        if launch is None:
            return None
        out = torch.empty(1, rows, i, dtype=torch.bfloat16, device=gate_up.device)
        launch.run(gate_up.reshape(1, rows, two_i).contiguous(), float(mlp.alpha), float(mlp.limit), out)
        return out.view(*gate_up.shape[:-1], i)


def combine_selected(y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [E, T, H] every expert's output, ids / weights [T, A] -> fp32 [T, H]: sum over a of
    y[ids[t, a], t] * weights[t, a], as one reduction over E (see moe_all_experts for its exactness)."""
    e, t = y.shape[0], y.shape[1]
    coef = torch.zeros(t, e, dtype=torch.float32, device=y.device).scatter_(1, ids, weights)  # [T, E], A non-zero
    coef = coef.t().unsqueeze(-1)                                                    # [E, T, 1]
    # an unselected expert contributes an exact 0 even where its output overflowed (stock never computes it)
    return torch.where(coef != 0, y * coef, 0.0).sum(0)


def moe_all_experts(m, x: torch.Tensor, router: RowTable | None = None, act: RowTable | None = None
                    ) -> torch.Tensor:
    """The stock MoE without `torch.unique(...).tolist()`: every expert's GEMMs on all T tokens (two batched
    matmuls), then one reduction over the experts of the masked, weighted outputs. x [T, H] -> [T, H].

    Exactness of that reduction: a token's terms are its A selected experts' products y_e * w_e (fp32, each
    rounded once, as stock's) and exact zeros for the others. Adding an exact zero is exact, so any
    summation order rounds only where two non-zero partial sums meet: with A <= 2 (the embedded model) that is
    the single rounding of p1 + p2, and the one-op sum equals stock's ascending-expert loop bit for bit; with
    A > 2 it is within (A - 1) u sum|p| of it (torch's reduction order). Without router / act tables (and on CPU
    or fp32) everything else is the stock arithmetic, so the result differs from the stock MoE only in the
    GEMMs' blocking. With them (the bound plan, bf16 CUDA activations) the router is moe.route_small (its
    logits in another fp32 summation order: a near-tie may select differently) and the experts' activation
    mlp.swiglu_oai (one bf16 ulp), each within its entry's stated tolerance; require raises outside their
    certified cells."""
    t, e = x.shape[0], m.w13.num_experts
    fused = _routes(x) and x.dtype == torch.bfloat16 and t > 0
    launch = router(t) if fused and router is not None else None
    if launch is not None:
        weights = torch.empty(t, m.top_k, dtype=torch.float32, device=x.device)
        ids = torch.empty(t, m.top_k, dtype=torch.int64, device=x.device)
        launch.run(x.contiguous(), m.router, m.e_score_correction_bias, m.top_k, weights, ids)
    else:
        ids, weights = stock_route(x, m.router, m.e_score_correction_bias, m.top_k)      # [T, A]
    w13, w2 = m.w13.dense_weight(x.dtype), m.w2.dense_weight(x.dtype)               # [E, 2I, H], [E, H, I]
    xe = x.unsqueeze(0).expand(e, *x.shape)                                          # [E, T, H]
    gate_up = torch.bmm(xe, w13.transpose(1, 2))                                     # [E, T, 2I]
    i = gate_up.shape[-1] // 2
    launch = act(t) if fused and act is not None else None
    if launch is not None:
        a = torch.empty(e, t, i, dtype=torch.bfloat16, device=x.device)
        launch.run(gate_up.contiguous(), float(m.alpha), float(m.limit), a)
    else:
        a = swiglu_oai(gate_up, m.alpha, m.limit).to(x.dtype)                       # [E, T, I]
    y = torch.bmm(a, w2.transpose(1, 2))                                             # [E, T, H]
    out = combine_selected(y, ids, weights) * m.scaling
    if m.shared is not None:
        out = out + m.shared(x).float()
    return out.to(x.dtype)


class AllExpertsKernel:
    """A dense MoE of at most ALL_EXPERTS_MAX experts: moe_all_experts with the plan's router and activation."""
    __slots__ = ("router", "act")

    def __init__(self, router: RowTable, act: RowTable):
        self.router, self.act = router, act

    def __call__(self, m, x: torch.Tensor):
        if not _routes(x):
            return None
        return moe_all_experts(m, x, self.router, self.act)


def _expert_args(lin) -> tuple:
    """A stacked expert Linear's tensors as moe.grouped takes them: (w, group scale, per-part factors [E, P])."""
    e = lin.num_experts
    if lin.fmt == "dense":
        return lin.weight, None, None
    if lin.fmt == "fp8":
        return lin.q_q, None, lin.q_scale.reshape(e, -1)
    if lin.fmt == "mxfp8":
        return lin.q_q, lin.q_scale, None
    return lin.q_packed, lin.q_scale, lin.q_global_scale.reshape(e, -1)


class MoEKernel:
    """The MoE layer: NVFP4 at 1-48 rows on moe.nvfp4 where one of its cells serves; everything else (every
    format, 1..16384 rows) on moe.grouped. (moe, x [T, H]) -> this rank's partial [T, H], or None (stock)."""
    __slots__ = ("nvfp4", "grouped", "grouped_shape", "mode")

    def __init__(self, nvfp4: RowTable | None, grouped: RowTable | None, grouped_shape: tuple[int, ...] | None,
                 mode: str):
        self.nvfp4, self.grouped, self.grouped_shape, self.mode = nvfp4, grouped, grouped_shape, mode

    def __call__(self, m, x: torch.Tensor):
        if not _routes(x):
            return None
        y = self.run_nvfp4(m, x)
        return y if y is not None else self.run_grouped(m, x)

    def run_nvfp4(self, m, x: torch.Tensor):
        """moe.nvfp4 (the tuned 1-48 row NVFP4 entry) where one of its cells serves, else None."""
        if self.nvfp4 is None or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[0] == 0:
            return None
        rows = x.shape[0]
        launch = self.nvfp4(rows)
        if launch is None:
            return None
        e, h, i, shared_bf16 = m.w13.num_experts, m.w13.in_features, m.w2.in_features, launch.cell.shape[3]
        cfg = launch.config
        store = launch.workspace
        if store is None:
            store = launch.workspace = {}
        ws = store.get(rows)
        if ws is None:   # sized by the row count: one per call site and rows, made before any capture needs it
            ws = store[rows] = make_moe_workspace(cfg, rows, e, h, i, x.device)
        sh = m.shared
        if shared_bf16:
            sh_args = (sh.gate_up_proj.weight, None, None, sh.down_proj.weight, None, None)
        else:
            gu, dn = sh.gate_up_proj, sh.down_proj
            sh_args = (gu.q_packed.unsqueeze(0), gu.q_scale.unsqueeze(0), gu.q_global_scale.reshape(1, 2),
                       dn.q_packed.unsqueeze(0), dn.q_scale.unsqueeze(0), dn.q_global_scale.reshape(1))
        out = torch.empty(rows, h, dtype=torch.bfloat16, device=x.device)
        launch.run(x.contiguous(), m.router, m.e_score_correction_bias,
                   m.w13.q_packed, m.w13.q_scale, m.w13.q_global_scale.reshape(e, 2),
                   m.w2.q_packed, m.w2.q_scale, m.w2.q_global_scale.reshape(e),
                   *sh_args, m.scaling, out, ws, cfg, swiglu_alpha=m.alpha, swiglu_limit=m.limit,
                   tiled=m.w13.q_layout == "mma_tile")
        return out

    def run_grouped(self, m, x: torch.Tensor):
        """moe.grouped: routing, grouping and both expert GEMMs on the device in fixed shapes (graph-safe); the
        shared expert through the model's own DenseMLP (its linears routed as usual)."""
        if self.grouped is None or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[0] == 0:
            if self.mode == "require":
                raise ValueError(f"{m.w13.name}: require mode, but moe.grouped takes bf16 activations [T, H] and "
                                 f"experts in one of {tuple(GROUPED_FMT)} (bf16 when dense); found {x.dtype} "
                                 f"{tuple(x.shape)}, gate|up {m.w13.fmt} / down {m.w2.fmt}")
            return None
        rows = x.shape[0]
        launch = self.grouped(rows)
        if launch is None:
            return None
        cfg = launch.config
        fmt, e, h, i, a = self.grouped_shape
        ws = grouped_workspace(cfg, rows, e, h, i, a, x.device)  # per call: sized by this step's rows only
        shared = m.shared(x).contiguous() if m.shared is not None else None
        out = torch.empty(rows, h, dtype=torch.bfloat16, device=x.device)
        return launch.run(x.contiguous(), m.router, m.e_score_correction_bias, fmt, *_expert_args(m.w13),
                          *_expert_args(m.w2), shared, m.scaling, out, ws, cfg, top_k=m.top_k,
                          swiglu_alpha=m.alpha, swiglu_limit=m.limit, tiled=m.w13.q_layout == "mma_tile")


class RopeKernel:
    """The draft layer's q/k RoPE in one attn.rope launch: (attn, q [T, Hq, D], k [T, Hk, D] (views of the joined
    q|k|v GEMM), positions, inv_freq) -> (q, k) rotated, or None (stock)."""
    __slots__ = ("where", "table", "mode")

    def __init__(self, where: str, table: RowTable, mode: str):
        self.where, self.table, self.mode = where, table, mode

    def __call__(self, attn, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
        if not (_bf16_cuda(self.where, q, self.mode) and _bf16_cuda(self.where, k, self.mode)) or q.dim() != 3 \
                or q.shape[0] == 0:
            return None
        t, hq, d = q.shape
        hk = k.shape[1]
        launch = self.table(t)
        if launch is None:
            return None
        q2, k2 = q.reshape(t, hq * d), k.reshape(t, hk * d)
        if q2.stride(1) != 1 or k2.stride(1) != 1:
            return None
        q_out = torch.empty(t, hq, d, dtype=torch.bfloat16, device=q.device)
        k_out = torch.empty(t, hk, d, dtype=torch.bfloat16, device=q.device)
        return launch.run(q2, k2, positions.contiguous(), inv_freq, q_out, k_out)


class SiluMulKernel:
    """The draft layer MLP's silu(gate) * up: (mlp, gate_up [T, 2I]) -> bf16 [T, I] (mlp.silu_mul), or None."""
    __slots__ = ("where", "table", "mode")

    def __init__(self, where: str, table: RowTable, mode: str):
        self.where, self.table, self.mode = where, table, mode

    def __call__(self, mlp, gate_up: torch.Tensor):
        if not _bf16_cuda(self.where, gate_up, self.mode) or gate_up.dim() != 2 or gate_up.numel() == 0:
            return None
        rows, two_i = gate_up.shape
        launch = self.table(rows)
        if launch is None:
            return None
        out = torch.empty(1, rows, two_i // 2, dtype=torch.bfloat16, device=gate_up.device)
        launch.run(gate_up.contiguous().view(1, rows, two_i), out)
        return out.view(rows, two_i // 2)


# --- binding -----------------------------------------------------------------------------------------------
def _kernel_for(mod, mp, mode: str):
    """The bound implementation of module `mod` for its plan `mp` (None: the stock path)."""
    t = {slot: RowTable(route, mp.name, mode) for slot, route in mp.routes.items()}
    role = mp.role
    if role == "linear":
        return LinearKernel(mod, t["linear"], mode)
    if role == "head":
        t12 = t.get("greedy12")
        tiles = head12_tiles(mod) if t12 is not None and t12.launches() else None
        return HeadKernel(t["greedy"], t12 if tiles is not None else None, tiles)
    if role == "norm":
        return NormKernel(mp.name, t["rms"], t["add_rms"], mode)
    if role == "drafter.norm":
        mod.gemma_weight = (mod.weight.detach().float() - 1.0).contiguous()
        return LlamaNormKernel(mp.name, t["rms"], t["add_rms"], mode)
    if role == "attention":
        return QkPrepKernel(mp.name, t["qk_prep"], t.get("qkv"), mode, t.get("index"))
    if role == "mlp":
        return SwigluKernel(f"{mp.name} activation", t["act"], mode)
    if role == "moe.all_experts":
        return AllExpertsKernel(t["router"], t["act"])
    if role == "moe":
        grouped = mp.routes.get("grouped")
        return MoEKernel(t.get("nvfp4"), t.get("grouped"), grouped.shape if grouped is not None else None, mode)
    if role == "moe.stock":   # require: a call names the layer no entry takes (build_plan already did on CUDA)
        return MoEKernel(None, None, None, mode) if mode == "require" else None
    if role == "drafter.attention":
        mod.fuse_projections()
        return RopeKernel("drafter rope", t["rope"], mode)
    if role == "drafter.mlp":
        mod.fuse_projections()
        return SiluMulKernel("drafter mlp activation", t["act"], mode)
    return None     # planned stock / torch: nothing to bind


def _head_logits_kernel(mod, mp, mode: str) -> HeadLogitsKernel | None:
    """The head Linear's bound logits path: head.head12_logits where the plan routes it and the head's 12-bit
    tiles were accepted (head12_tiles), else None (cuBLAS)."""
    route = mp.routes.get("logits12")
    if route is None:
        return None
    table = RowTable(route, mp.name, mode)
    tiles = head12_tiles(mod) if table.launches() else None
    return HeadLogitsKernel(table, tiles) if tiles is not None else None


def _layout_groups(model) -> list[list[Linear]]:
    """The model's NVFP4 / MXFP8 linears in groups that one kernel reads together, so they share one layout: an MoE
    layer's experts with its shared expert (moe.nvfp4 takes one flag for both), every other linear alone (a fused
    projection joins its parts' own layouts; fused_projection.project checks they agree)."""
    groups, grouped = [], set()
    for mod in model.modules():
        if isinstance(mod, MoE):
            members = [mod.w13, mod.w2]
            if mod.shared is not None:
                members += [mod.shared.gate_up_proj, mod.shared.down_proj]
            members = [m for m in members if m.fmt in TILED_FORMATS]
            grouped.update(id(m) for m in members)
            if members:
                groups.append(members)
    for mod in model.modules():
        if isinstance(mod, Linear) and mod.fmt in TILED_FORMATS and id(mod) not in grouped:
            groups.append([mod])
    return groups


def default_weight_layout(model, mode: str) -> str:
    """NVFP4 / MXFP8 weights in the MMA tile layout wherever the decode target runs them (CUDA, mode auto /
    require): every cell of those formats reads it (docs/kernels.md); the stock path (mode off, CPU) keeps the
    checkpoint's row-major bytes."""
    param = next(model.parameters(), None)
    return "mma_tile" if mode != "off" and param is not None and param.device.type == "cuda" else "rows"


def weight_layouts(model, layout: str) -> list[tuple[Linear, str]]:
    """(linear, its layout) for every NVFP4 / MXFP8 linear of `model` when the model is laid out in `layout`: each
    weight group (_layout_groups) takes `layout` where the whole group is tileable, row-major otherwise."""
    out = []
    for group in _layout_groups(model):
        want = layout if all(lin.tileable() for lin in group) else "rows"
        out += [(lin, want) for lin in group]
    return out


def set_weight_layout(model, layout: str) -> int:
    """Every NVFP4 / MXFP8 linear of `model` to its layout of weight_layouts(model, layout), in place. Returns the
    number of linears in the tile layout."""
    placed = weight_layouts(model, layout)
    for lin, want in placed:
        lin.set_layout(want)
    return sum(want == "mma_tile" for _, want in placed)


def bind(model, plan: KernelPlan, weight_layout: str | None = None) -> None:
    """Give every module of `model` its bound implementation from `plan` (modules the plan does not route, and
    every module when its mode is off, get none: the stock path) and keep the plan on the model. NVFP4 / MXFP8
    weights are re-laid out in place to `weight_layout` (default: default_weight_layout)."""
    set_weight_layout(model, weight_layout or default_weight_layout(model, plan.mode))
    # graphs captured under the previous binding are stale from here on (runtime.capture_check.check_binding)
    model.kernel_binding = getattr(model, "kernel_binding", 0) + 1
    modules = dict(model.named_modules())
    for mod in modules.values():
        if isinstance(mod, ROUTED_CLASSES):
            mod.kernel = None
    if hasattr(model, "greedy_head"):
        model.greedy_head = None
    for mp in plan.modules:
        mod = modules.get(mp.name)
        if mod is None:
            raise ValueError(f"kernel plan: module {mp.name!r} is not in this model (a plan binds the model it was "
                             "built for)")
        if mp.role == "head":     # its greedy rows are the model's; its logits rows cuBLAS, or the 12-bit tiles'
            model.greedy_head = _kernel_for(mod, mp, plan.mode)
            mod.kernel = _head_logits_kernel(mod, mp, plan.mode)
            continue
        mod.kernel = _kernel_for(mod, mp, plan.mode)
    model.kernel_plan = plan


def install(model, mode: str, max_rows: int | None = None, weight_layout: str | None = None) -> KernelPlan:
    """Build `model`'s kernel plan in `mode` for forwards of up to max_rows tokens and bind it (replacing any
    earlier plan; weight_layout as bind). Returns the plan."""
    plan = build_plan(model, mode, max_rows)
    bind(model, plan, weight_layout)
    return plan


def install_drafter(drafter, mode: str, max_rows: int | None = None) -> KernelPlan:
    """Route an Eagle3 drafter's pieces on the decode target (targets.plan.build_drafter_plan): its exact Llama
    norms through norm.rms / norm.add_rms, the q/k RoPE through attn.rope, the MLP's silu(gate) * up through
    mlp.silu_mul, and q|k|v and gate|up joined into one GEMM each. mode off: every module back to stock (the
    joined weights stay)."""
    plan = build_drafter_plan(drafter, mode, max_rows)
    bind(drafter, plan)
    return plan


def plan_of(model) -> KernelPlan | None:
    return getattr(model, "kernel_plan", None)


def mode_of(model) -> str:
    plan = plan_of(model)
    return plan.mode if plan is not None else "off"


def launches(model):
    """(module name, kind, Launch) of every prepared launch bound on `model` (tests and benches inspect them)."""
    for name, mod in model.named_modules():
        k = getattr(mod, "kernel", None) if isinstance(mod, ROUTED_CLASSES) else None
        if k is None:
            continue
        slots = [slot for cls in type(k).__mro__ for slot in getattr(cls, "__slots__", ())]
        for slot in slots:
            table = getattr(k, slot, None)
            if isinstance(table, RowTable):
                for launch in table.launches():
                    yield name, table.kind, launch


# entries whose kernels do not specialise on the row count (kernel_unspecialized): warm-up runs one call per cell
ROW_AGNOSTIC = frozenset({"linear.nvfp4.tiled", "linear.mxfp8.tiled", "linear.fp8.tiled", "moe.grouped"})
# the routes warm-up compiles: the GEMM-heavy ones, whose first call (at every row count that changes Triton's
# integer specialisation) would otherwise compile in front of a request; the elementwise entries are compiled by
# the decode buckets' graph capture and the engine's warm-up requests
WARMED = {"linear": ("linear",), "moe": ("nvfp4", "grouped"), "head": ("logits12",)}


def warm_calls(plan: KernelPlan, max_rows: int) -> list[tuple[str, int]]:
    """(module name, rows) of the calls that compile every variant of the plan's linear and MoE cells reachable
    in steps of 1..max_rows tokens: for each distinct (kind, shape), EVERY row count of a decode cell (Triton also
    specialises on integer arguments (== 1, divisible by 16), so a cell compiles up to three variants) and one per
    cell of a row-count-agnostic entry, at its first row count the module sends there."""
    calls, seen = [], set()
    for mp, slot, route, span in plan.cells(max_rows):
        if mp.role not in WARMED or slot not in WARMED[mp.role]:
            continue
        nv = mp.routes.get("nvfp4") if slot == "grouped" else None
        for rows in range(span.lo, min(span.hi, max_rows) + 1):
            if nv is not None and nv.serves(rows):
                continue          # moe.nvfp4 takes these rows: the call would not reach moe.grouped
            agnostic = span.entry.name in ROW_AGNOSTIC
            key = (route.kind, route.shape, span.cell.rows if agnostic else rows)
            if key not in seen:
                seen.add(key)
                calls.append((mp.name, rows))
            if agnostic:
                break
    return calls


def warmup(model, max_rows: int = 48) -> int:
    """Compile, before serving, the plan's linear and MoE cells for steps of up to max_rows tokens (warm_calls):
    each call runs the module on zero activations. Triton compiles on first use; doing it here keeps JIT time out
    of the first requests and out of any later CUDA-graph capture. Returns the number of module calls."""
    plan = plan_of(model)
    if plan is None or plan.mode == "off" or model.device.type != "cuda":
        return 0
    modules = dict(model.named_modules())
    calls = warm_calls(plan, max_rows)
    with torch.no_grad():
        for name, rows in calls:
            mod = modules[name]
            width = mod.in_features if isinstance(mod, Linear) else mod.w13.in_features
            mod(torch.zeros(rows, width, dtype=torch.bfloat16, device=model.device))
    torch.cuda.synchronize(model.device)
    return len(calls)
