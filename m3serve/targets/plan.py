"""The kernel plan of one model on the decode target: for each routed module (by its qualified name) and each key
it launches, the entry and certified cell that serve every row count, resolved once from the catalog and the
dispatch tables. `routing.bind` gives each module the plan's launches, `routing.warmup` compiles the plan's
cells, and `m3serve explain` prints it: all three read this one object.

    build_plan(model, mode, max_rows)           the M3 model (m3serve.model.m3)
    build_drafter_plan(drafter, mode, max_rows)  an Eagle3 drafter (m3serve.model.eagle3)

Each module kind's key (kind, shape) is derived by ONE function below (linear_key, head_key, qkv_key, qk_prep_key,
norm_keys, swiglu_key, moe_nvfp4_key, moe_grouped_key, all_experts_keys, rope_key, silu_mul_key).

Modes: "off" plans nothing (every module stock). "auto": rows no certified cell serves run stock. "require": as
auto, but on a CUDA model every row count 1..max_rows a module can reach must lie in a certified cell, or
build_plan raises naming the module, its rows and the nearest cell; rows past max_rows raise when a call reaches
them (as dispatch.lookup does). moe.nvfp4 and qkv.{fmt} are always planned as auto: where they do not serve,
moe.grouped and the parts' own linears take the rows (and carry require mode).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

import torch

from m3serve.kernels.catalog import all_entries
from m3serve.model.eagle3 import Eagle3Attention, Eagle3Layer, Eagle3MLP, LlamaRMSNorm
from m3serve.model.layers import Linear, RMSNorm
from m3serve.model.m3 import Attention
from m3serve.model.moe import DenseMLP, MoE
from m3serve.targets.dispatch import MODES, Span, miss, resolve

QUANT_FORMATS = ("nvfp4", "mxfp8", "fp8")

# A dense-weight MoE with at most this many experts runs every expert on every token (masked): no host sync,
# so it can be captured in a CUDA graph; beyond it the wasted FLOPs outweigh that (the stock loop runs).
ALL_EXPERTS_MAX = 16

# moe.grouped's format codes (m3serve.kernels.formats._decode) by QWeight format
GROUPED_FMT = {"nvfp4": 0, "mxfp8": 1, "fp8": 2, "dense": 3}

# the dense index-q|index-k group beside a quantized q|k|v on linear.bf16 at 1-4 rows (else cuBLAS). Its cells pass
# the GPU tests (H100), and in the decode step it measured level with cuBLAS's split-K GEMM + reduce: 2.856 against
# 2.858 ms a step for minimax-m3:12 at one row (bench/results/decode/decode-target-h100-m3_12-head12.json, route
# target-index-gemv), one launch fewer a layer for the same time. Opt-in: nothing to gain measured yet
INDEX_GEMV = False

# the greedy head's 1-8 rows on head.head12 (the 12-bit coded head through the MMA head) where the head encodes
# (targets.routing.head12_tiles: bit-checked, else head.bf16). On the H100 the decode step measured 1.471 against
# 1.652 ms (minimax-m3:5) and 2.687 against 2.858 ms (minimax-m3:12) at one row
# (bench/results/decode/decode-target-h100-m3_{5,12}-head12.json, route target-head12 beside target)
HEAD12 = True

# the head's logits rows (1-8: decode rows that sample or want logprobs, and the Eagle3 passes that do) as bf16 logits
# from the same 12-bit tiles (head.head12_logits) instead of cuBLAS over the BF16 weight, where HEAD12 holds too. On
# the H100 minimax-m3:5's sampled decode step (temperature 1) measured 1.922 against 2.121 ms at one row and 3.151
# against 3.351 ms at eight, the same sampled tokens (head 603 against 827 us a step;
# bench/results/decode/decode-target-h100-m3_5-head12-logits-sampled.json, route target-head12-logits beside target)
HEAD12_LOGITS = True

# the cell config a launch of each kind takes (the others take none)
CONFIG_KEY = {**{f"linear.{f}": "gemm" for f in QUANT_FORMATS}, **{f"qkv.{f}": "gemm" for f in QUANT_FORMATS},
              "linear.bf16": "gemm", "moe.nvfp4": "moe", "moe.grouped": "moe", "head.bf16": "head",
              "head.head12": "head", "head.head12_logits": "head"}

Key = tuple[str, tuple[int, ...]]


# --- keys: one function per routed module kind -------------------------------------------------------------
def linear_key(lin: Linear) -> Key | None:
    """A quantized, unstacked linear: linear.{fmt} over (N, K). Dense linears are cuBLAS (no entry); stacked
    expert linears run inside their MoE layer's entry."""
    if lin.num_experts is not None or lin.fmt not in QUANT_FORMATS:
        return None
    return f"linear.{lin.fmt}", (lin.out_features, lin.in_features)


def head_key(model, lin: Linear) -> Key | None:
    """The LM head's greedy rows: head.bf16 over (V, K), fused GEMV + argmax (no logits written), for a dense bf16
    head on one rank (a vocab-parallel head would need a cross-rank max of the partial picks)."""
    if lin is not getattr(model, "lm_head", None) or model.tp.size != 1 or lin.fmt != "dense" \
            or lin.weight.dtype != torch.bfloat16:
        return None
    return "head.bf16", (lin.out_features, lin.in_features)


def head12_key(model, lin: Linear) -> Key | None:
    """The same head's 1-8 greedy rows as the 12-bit coded head (head.head12 over (V, K)), where HEAD12 says so."""
    key = head_key(model, lin)
    return ("head.head12", key[1]) if key is not None and HEAD12 else None


def head12_logits_key(model, lin: Linear) -> Key | None:
    """The same head's 1-8 logits rows from the 12-bit tiles (head.head12_logits over (V, K)), where HEAD12 and
    HEAD12_LOGITS say so."""
    key = head12_key(model, lin)
    return ("head.head12_logits", key[1]) if key is not None and HEAD12_LOGITS else None


def projection_parts(attn: Attention) -> list[Linear]:
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    if attn.sparse:
        parts += [attn.index_q_proj, attn.index_k_proj]
    return parts


def projection_format(attn: Attention) -> str | None:
    """The one format of every q|k|v (| index) projection, None when they differ or one is stacked."""
    parts = projection_parts(attn)
    fmts = {p.fmt for p in parts}
    if len(fmts) != 1 or any(p.num_experts is not None for p in parts):
        return None
    return fmts.pop()


def projection_groups(attn: Attention) -> list[list[Linear]] | None:
    """The attention projections in the groups that each run as one GEMM (targets.fused_projection): all parts when
    they share a format; or, as every quantized M3 checkpoint stores them (the indexer is never quantized), q|k|v in
    their quantized format and index-q|index-k dense; None for any other mix or a stacked part."""
    parts = projection_parts(attn)
    if any(p.num_experts is not None for p in parts):
        return None
    if projection_format(attn) is not None:
        return [parts]
    qkv, index = parts[:3], parts[3:]
    if len({p.fmt for p in qkv}) == 1 and qkv[0].fmt in QUANT_FORMATS and index and \
            all(p.fmt == "dense" for p in index):
        return [qkv, index]
    return None


def qkv_key(attn: Attention) -> Key | None:
    """The attention projections' quantized group (projection_groups) as one GEMM: qkv.{fmt} over (N_group, H); None
    without one (dense groups join as one cuBLAS GEMM each)."""
    for group in projection_groups(attn) or []:
        if group[0].fmt in QUANT_FORMATS:
            return f"qkv.{group[0].fmt}", (sum(p.out_features for p in group), group[0].in_features)
    return None


def index_key(attn: Attention) -> Key | None:
    """The dense index-q|index-k group beside a quantized q|k|v (projection_groups) as one BF16 GEMV: linear.bf16
    over (N_group, H); None without such a group."""
    groups = projection_groups(attn) or []
    if len(groups) == 2 and groups[1][0].fmt == "dense":
        return "linear.bf16", (sum(p.out_features for p in groups[1]), groups[1][0].in_features)
    return None


def qk_prep_key(attn: Attention) -> Key:
    """The q/k (and index q/k) norms and RoPE in one launch: attn.qk_prep over (Hq, Hk, D, Di, rotary dim)."""
    cfg = attn.cfg
    return "attn.qk_prep", (attn.hq, attn.hk, cfg.head_dim, cfg.index_head_dim if attn.sparse else 0,
                            cfg.rotary_dim)


def norm_keys(weight: torch.Tensor) -> tuple[Key, Key]:
    """A decoder-level norm alone (norm.rms) and after its residual add (norm.add_rms), over (H,)."""
    h = (int(weight.shape[0]),)
    return ("norm.rms", h), ("norm.add_rms", h)


def swiglu_key(mlp: DenseMLP) -> Key:
    """A dense MLP's activation: mlp.swiglu_oai over (1, I)."""
    return "mlp.swiglu_oai", (1, mlp.gate_up_proj.out_features // 2)


def all_experts_keys(m: MoE) -> tuple[Key, Key] | None:
    """A dense MoE of at most ALL_EXPERTS_MAX experts runs every expert on every token: its router
    (moe.route_small over (E, H, top-k)) and its stacked experts' activation (mlp.swiglu_oai over (E, I)).
    None for any other MoE."""
    if m.w13.fmt != "dense" or m.w2.fmt != "dense" or m.w13.num_experts > ALL_EXPERTS_MAX:
        return None
    e = m.w13.num_experts
    return ("moe.route_small", (e, m.w13.in_features, m.top_k)), ("mlp.swiglu_oai", (e, m.w13.out_features // 2))


def moe_nvfp4_key(m: MoE) -> Key | None:
    """moe.nvfp4 over (E, H, I, shared_bf16), or None when that entry cannot take the layer (experts not NVFP4,
    no NVFP4 / BF16 shared expert as wide as the routed ones, or not top-4)."""
    if m.w13.fmt != "nvfp4" or m.w2.fmt != "nvfp4":
        return None
    sh = m.shared
    shared_bf16 = int(sh is not None and sh.gate_up_proj.fmt == "dense")
    i = m.w2.in_features
    if sh is None or (not shared_bf16 and sh.gate_up_proj.fmt != "nvfp4") or sh.down_proj.in_features != i \
            or m.top_k != 4:
        return None
    return "moe.nvfp4", (m.w13.num_experts, m.w13.in_features, i, shared_bf16)


def moe_grouped_key(m: MoE) -> Key | None:
    """moe.grouped over (FMT, E, H, I, A), or None when its experts are in no format the entry takes (gate|up and
    down in different formats, or dense weights other than bf16)."""
    fmt = m.w13.fmt
    if fmt != m.w2.fmt or fmt not in GROUPED_FMT or (fmt == "dense" and m.w13.weight.dtype != torch.bfloat16):
        return None
    return "moe.grouped", (GROUPED_FMT[fmt], m.w13.num_experts, m.w13.in_features, m.w2.in_features, m.top_k)


def rope_key(attn: Eagle3Attention, rotary_dim: int) -> Key:
    """The draft layer's q/k RoPE: attn.rope over (Hq, Hk, D, rotary dim)."""
    return "attn.rope", (attn.hq, attn.hk, attn.d, 2 * ((rotary_dim + 1) // 2))


def silu_mul_key(mlp: Eagle3MLP) -> Key:
    """The draft layer MLP's silu(gate) * up: mlp.silu_mul over (1, I)."""
    return "mlp.silu_mul", (1, mlp.gate_proj.out_features)


# --- the plan ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    """One key of one module over every row count. strict: looked up in the plan's mode (False: always auto,
    another route takes the rows it leaves)."""
    kind: str
    shape: tuple[int, ...]
    spans: tuple[Span, ...]
    strict: bool = True
    starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "starts", tuple(s.lo for s in self.spans))

    def span(self, rows: int) -> Span:
        return self.spans[bisect_right(self.starts, rows) - 1]

    def serves(self, rows: int) -> bool:
        return self.span(rows).cell is not None

    def detail(self, rows: int) -> str:
        """The serving cell's reason, or why these rows run stock (require mode's message)."""
        s = self.span(rows)
        if s.cell is not None:
            return s.cell.why
        if s.off:
            return f"{self.kind}: switched off (the entry module's ENABLED is False)"
        return miss(self.kind, rows, self.shape)

    @property
    def config_key(self) -> str | None:
        return CONFIG_KEY.get(self.kind)


@dataclass(frozen=True)
class ModulePlan:
    """One module's routes by slot. role names the bound implementation routing.bind gives it:
    linear | head | norm | attention | mlp | moe | moe.all_experts | moe.stock | drafter.norm | drafter.attention |
    drafter.mlp. A role without routes is planned stock or torch (note says which and why)."""
    name: str
    role: str
    routes: dict[str, Route] = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True)
class KernelPlan:
    mode: str
    max_rows: int                  # row counts the plan promises (require checked them at build)
    modules: tuple[ModulePlan, ...]

    def module(self, name: str) -> ModulePlan:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"kernel plan: no module named {name!r}")

    def cells(self, max_rows: int | None = None):
        """(module plan, slot, route, span) of every certified cell some row count 1..max_rows reaches (default:
        the plan's max_rows), in module order: what warm-up compiles."""
        limit = self.max_rows if max_rows is None else max_rows
        for m in self.modules:
            for slot, route in m.routes.items():
                for s in route.spans:
                    if s.cell is not None and s.lo <= limit:
                        yield m, slot, route, s


class _Resolver:
    """resolve() once per (kind, shape) of one build: a model's layers share their shapes."""

    def __init__(self):
        self.entries = all_entries()
        self.spans: dict[Key, tuple[Span, ...]] = {}

    def __call__(self, key: Key | None, strict: bool = True) -> Route | None:
        if key is None:
            return None
        kind, shape = key[0], tuple(int(s) for s in key[1])
        spans = self.spans.get((kind, shape))
        if spans is None:
            spans = self.spans[(kind, shape)] = resolve(kind, shape, self.entries)
        return Route(kind, shape, spans, strict)


def _device(model) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"route mode: expected one of {MODES}, found {mode!r}")


def build_plan(model, mode: str, max_rows: int | None = None) -> KernelPlan:
    """The plan of `model`'s quantized linears, MoE layers, decoder norms, attention q/k prep (+ the fused
    projection) and dense-MLP activations. max_rows: the most tokens a forward will carry (None: no promise;
    require then raises only when a call reaches uncovered rows)."""
    _check_mode(mode)
    if mode == "off":
        return KernelPlan(mode, max_rows or 0, ())
    route = _Resolver()
    # the per-head q/k norms belong to attn.qk_prep: they run only when it falls back, on [T, heads, D]
    head_norms = {id(n) for a in model.modules() if isinstance(a, Attention)
                  for n in (a.q_norm, a.k_norm, getattr(a, "index_q_norm", None), getattr(a, "index_k_norm", None))
                  if n is not None}
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, Linear):
            lin = route(linear_key(mod))
            head = route(head_key(model, mod), strict=False)
            if head is not None:
                head12 = route(head12_key(model, mod), strict=False)
                logits12 = route(head12_logits_key(model, mod), strict=False)
                out.append(ModulePlan(name, "head", {"greedy": head, **({"greedy12": head12} if head12 else {}),
                                                     **({"logits12": logits12} if logits12 else {})},
                                      "logits (sampling, logprobs, prefill): cuBLAS" + (", 1-8 rows from the 12-bit "
                                      "tiles" if logits12 else "") + "; greedy decode-graph steps: the fused head + "
                                      "argmax"))
            elif lin is not None:
                out.append(ModulePlan(name, "linear", {"linear": lin}))
            elif mod.num_experts is None:
                out.append(ModulePlan(name, "linear.torch", note=f"{mod.fmt} weights: cuBLAS (no catalog entry for "
                                                                 "unquantized linears)"))
        elif isinstance(mod, RMSNorm) and id(mod) not in head_norms:
            rms, add = norm_keys(mod.weight)
            out.append(ModulePlan(name, "norm", {"rms": route(rms), "add_rms": route(add)}))
        elif isinstance(mod, Attention):
            routes = {"qk_prep": route(qk_prep_key(mod))}
            qkv = route(qkv_key(mod), strict=False)
            if qkv is not None:
                routes["qkv"] = qkv
            index = route(index_key(mod), strict=False) if qkv is not None and INDEX_GEMV else None
            if index is not None:
                routes["index"] = index
            note = ""
            if projection_format(mod) == "dense":   # one cuBLAS GEMM: no catalog entry, no rows to plan
                parts = projection_parts(mod)
                note = (f"q|k|v{'|index-q|index-k' if mod.sparse else ''} as one cuBLAS GEMM "
                        f"({sum(p.out_features for p in parts)} x {parts[0].in_features})")
            elif qkv is not None and len(projection_groups(mod)) > 1:
                dense = projection_groups(mod)[1]
                how = "linear.bf16 where its rows are certified, else cuBLAS" if index is not None else "cuBLAS"
                note = (f"index-q|index-k as one GEMM ({sum(p.out_features for p in dense)} x "
                        f"{dense[0].in_features}: {how}) beside the {qkv.kind} of q|k|v")
            out.append(ModulePlan(name, "attention", routes, note))
        elif isinstance(mod, DenseMLP):
            out.append(ModulePlan(name, "mlp", {"act": route(swiglu_key(mod))}))
        elif isinstance(mod, MoE):
            out.append(_moe_plan(name, mod, route))
    plan = KernelPlan(mode, max_rows or 0, tuple(out))
    if mode == "require" and max_rows and _device(model).type == "cuda":
        _require_covered(plan)
    return plan


def _moe_plan(name: str, m: MoE, route: _Resolver) -> ModulePlan:
    dense = all_experts_keys(m)
    if dense is not None:
        router, act = dense
        return ModulePlan(name, "moe.all_experts", {"router": route(router), "act": route(act)},
                          f"dense experts ({m.w13.num_experts} <= {ALL_EXPERTS_MAX}): every expert on every token, "
                          "masked (no host sync, capturable)")
    routes = {}
    nv = route(moe_nvfp4_key(m), strict=False)
    if nv is not None:
        routes["nvfp4"] = nv
    grouped = route(moe_grouped_key(m))
    if grouped is not None:
        routes["grouped"] = grouped
    if not routes:
        return ModulePlan(name, "moe.stock", note=f"experts gate|up {m.w13.fmt} / down {m.w2.fmt}: no entry takes "
                                                  "them; the stock loop (syncs the host: not capturable)")
    return ModulePlan(name, "moe", routes)


def build_drafter_plan(drafter, mode: str, max_rows: int | None = None) -> KernelPlan:
    """An Eagle3 drafter's plan: its Llama norms (y = x * rsqrt(mean(x^2) + eps) * w), alone or after the residual
    add, through norm.rms / norm.add_rms, which apply (1 + w'): a norm is planned only where w' = w - 1 in fp32
    gives back w exactly for every element (so the product is the stock one), else it stays stock; the q/k RoPE
    through attn.rope and the MLP's silu(gate) * up through mlp.silu_mul."""
    _check_mode(mode)
    if mode == "off":
        return KernelPlan(mode, max_rows or 0, ())
    route = _Resolver()
    rotary = {id(layer.self_attn): layer.cfg.rotary_dim for layer in drafter.modules() if isinstance(layer, Eagle3Layer)}
    out = []
    for name, mod in drafter.named_modules():
        if isinstance(mod, LlamaRMSNorm):
            w = mod.weight.detach().float()
            if not torch.equal(1.0 + (w - 1.0), w):
                out.append(ModulePlan(name, "drafter.norm.stock", note="1 + (w - 1) != w in fp32: the stock norm"))
                continue
            rms, add = norm_keys(mod.weight)
            out.append(ModulePlan(name, "drafter.norm", {"rms": route(rms), "add_rms": route(add)}))
        elif isinstance(mod, Eagle3Attention) and id(mod) in rotary:
            out.append(ModulePlan(name, "drafter.attention", {"rope": route(rope_key(mod, rotary[id(mod)]))}))
        elif isinstance(mod, Eagle3MLP):
            out.append(ModulePlan(name, "drafter.mlp", {"act": route(silu_mul_key(mod))}))
    plan = KernelPlan(mode, max_rows or 0, tuple(out))
    if mode == "require" and max_rows and _device(drafter).type == "cuda":
        _require_covered(plan)
    return plan


def _bypassed(plan: KernelPlan) -> dict[str, list[tuple[Route, ...]]]:
    """Per module name, the route sets that skip it where they all serve: an attention's qk_prep + qkv skip its
    projections (one fused launch); a MoE's moe.nvfp4 skips its moe.grouped and its shared expert (inside it)."""
    out: dict[str, list[tuple[Route, ...]]] = {}
    for m in plan.modules:
        if m.role == "attention" and "qkv" in m.routes:
            for part in ("q_proj", "k_proj", "v_proj", "index_q_proj", "index_k_proj"):
                out.setdefault(f"{m.name}.{part}", []).append((m.routes["qk_prep"], m.routes["qkv"]))
        if m.role == "moe" and "nvfp4" in m.routes:
            out.setdefault(m.name, []).append((m.routes["nvfp4"],))
            prefix = f"{m.name}.shared"   # the MoE's DenseMLP attribute
            for other in plan.modules:
                if other.name == prefix or other.name.startswith(prefix + "."):
                    out.setdefault(other.name, []).append((m.routes["nvfp4"],))
    return out


def _require_covered(plan: KernelPlan) -> None:
    """require: every row count 1..max_rows that reaches a strict route lies in one of its certified cells."""
    bypassed = _bypassed(plan)
    for m in plan.modules:
        if m.role == "moe.stock":
            raise ValueError(f"route='require': {m.name}: {m.note}")
        for slot, route in m.routes.items():
            if not route.strict:
                continue
            skip = bypassed.get(m.name, []) if slot in ("linear", "grouped", "act") else []
            for s in route.spans:
                if s.cell is not None or s.off or s.lo > plan.max_rows:
                    continue
                for rows in range(s.lo, min(s.hi, plan.max_rows) + 1):
                    if not any(all(r.serves(rows) for r in by) for by in skip):
                        last = min(s.hi, plan.max_rows)
                        raise ValueError(f"route='require': {m.name} ({route.kind}) rows {rows}-{last} of the 1-"
                                         f"{plan.max_rows} a forward may carry lie outside the certified cells; "
                                         f"{miss(route.kind, rows, route.shape)}")
