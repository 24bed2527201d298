"""What runs where on the decode target: per module and batch bucket, the catalog entry and certified cell, or
why the module runs stock. The modules' part is the model's kernel plan (targets.plan) as it is bound, printed
(no key is derived here); the attention part is the paged-cache kernels of a step. `m3serve explain` prints both;
`LLMEngine.enable_target` uses the attention part to decide (auto) or insist (require) that every attention layer
of a decode step lies in certified cells.

Rows, per entry kind: linears, MoE, norms and heads see the step's tokens (= the bucket in a decode step);
kv.write sees the step's tokens; msa.scores / msa.select / attn.paged see the query tokens per sequence (1 in a
decode step, K+1 in a speculative verify).
"""

from __future__ import annotations

from dataclasses import dataclass

from m3serve.kernels.attention.kv_write import FMT_CODE, NO_INDEX
from m3serve.kernels.attention.msa_index import IFMT_CODE
from m3serve.kernels.attention.paged import FMT_CODES
from m3serve.targets.dispatch import lookup
from m3serve.targets.plan import KernelPlan, Route, build_plan
from m3serve.targets.routing import plan_of


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "index_q_proj", "index_k_proj")


@dataclass(frozen=True)
class Placement:
    module: str       # e.g. "layers.3.self_attn [msa.scores]"
    bucket: int       # decode batch bucket
    entry: str | None  # catalog entry that runs, None = stock
    detail: str       # the certified cell's reason, or why it falls back

    def line(self) -> str:
        where = self.entry or "stock"
        return f"{self.module:<48} bucket {self.bucket:>3}  {where:<14} {self.detail}"


def _place(module: str, bucket: int, kind: str, rows: int, shape: tuple) -> Placement:
    try:
        entry = lookup(kind, rows, shape, "require")
    except ValueError as e:
        return Placement(module, bucket, None, str(e))
    if entry is None:
        return Placement(module, bucket, None, f"{kind}: switched off (the entry module's ENABLED is False)")
    return Placement(module, bucket, entry.name, entry.cell_for(rows, shape).why)


def attention_placements(model, kv, table_width: int, bucket: int, query_len: int = 1) -> list[Placement]:
    """kv.write / msa.scores / msa.select / attn.paged of every attention layer for a decode step of `bucket`
    sequences with `query_len` query tokens each, over block tables `table_width` pages wide."""
    import triton

    spec, cfg = kv.spec, model.cfg
    out = []
    for layer in model.layers:
        a = layer.attn
        i = a.layer
        name = f"layers.{i}.self_attn"
        fmt = spec.kv_format(i)
        hk, d, p = spec.kv_heads(i), spec.head_dim, spec.page_size
        ifmt = spec.index_k_format() if a.sparse else None
        di = spec.index_head_dim if a.sparse else 0
        kv_shape = (hk, d, p, di, FMT_CODE[fmt], FMT_CODE[ifmt] if ifmt else NO_INDEX)
        out.append(_place(f"{name} [kv.write]", bucket, "kv.write", bucket * query_len, kv_shape))
        topk = cfg.index_topk_blocks if a.sparse else 0
        if a.sparse:
            if ifmt not in IFMT_CODE:
                out.append(Placement(f"{name} [msa.scores]", bucket, None,
                                     f"msa.scores: index-K stored as {ifmt}; the kernel reads bf16 or fp8"))
            else:
                out.append(_place(f"{name} [msa.scores]", bucket, "msa.scores", query_len,
                                  (hk, di, p, IFMT_CODE[ifmt], topk)))
            out.append(_place(f"{name} [msa.select]", bucket, "msa.select", query_len,
                              (hk, p, topk, triton.next_power_of_2(table_width))))
        if fmt not in FMT_CODES:
            out.append(Placement(f"{name} [attn.paged]", bucket, None,
                                 f"attn.paged: KV stored as {fmt}; the kernel reads {sorted(FMT_CODES)}"))
        else:
            out.append(_place(f"{name} [attn.paged]", bucket, "attn.paged", query_len,
                              (FMT_CODES[fmt], a.hq, hk, d, p, topk)))
    return out


def model_plan(model) -> KernelPlan:
    """The plan bound on `model`, or (unrouted, e.g. `m3serve explain` on a CPU) the one a CUDA run with route=auto
    would bind."""
    plan = plan_of(model)
    return plan if plan is not None and plan.mode != "off" else build_plan(model, "auto")


def _route_placement(module: str, bucket: int, route: Route) -> Placement:
    span = route.span(bucket)
    return Placement(module, bucket, span.entry.name if span.cell is not None else None, route.detail(bucket))


def plan_placements(plan: KernelPlan, bucket: int, head12_bound: bool = True,
                    logits12_bound: bool = True) -> list[Placement]:
    """The plan at `bucket` rows, one line per module key (a module with several keys: `name [kind]`): the entry
    and cell that run, the torch path that runs, or why the module runs stock. head12_bound: whether the greedy
    head got its 12-bit tiles at bind (else head.bf16 serves the rows the plan gave head.head12); logits12_bound:
    whether the head Linear's logits kernel did (else cuBLAS serves the rows the plan gave head.head12_logits)."""
    out, fused = [], {}
    for mp in plan.modules:
        routes = mp.routes
        if mp.role == "attention":
            prep = routes["qk_prep"]
            out.append(_route_placement(f"{mp.name} [{prep.kind}]", bucket, prep))
            # the projections join only inside attn.qk_prep: where it falls back, each part runs alone
            qkv = routes.get("qkv")
            if prep.serves(bucket) and qkv is None and mp.note:          # every part dense: one cuBLAS GEMM
                placed = Placement(f"{mp.name}.qkv", bucket, "torch:fused-GEMM", mp.note)
                out.append(placed)
                fused.update((f"{mp.name}.{part}", placed.module) for part in PROJECTIONS)
            elif prep.serves(bucket) and qkv is not None and qkv.serves(bucket):
                placed = _route_placement(f"{mp.name}.qkv", bucket, qkv)
                out.append(placed)
                fused.update((f"{mp.name}.{part}", placed.module) for part in PROJECTIONS[:3 if mp.note else 5])
                if mp.note:                                              # the dense index parts beside it
                    bf16 = routes.get("index")
                    index = (_route_placement(f"{mp.name}.index_qk", bucket, bf16)
                             if bf16 is not None and bf16.serves(bucket)
                             else Placement(f"{mp.name}.index_qk", bucket, "torch:fused-GEMM", mp.note))
                    out.append(index)
                    fused.update((f"{mp.name}.{part}", index.module) for part in PROJECTIONS[3:])
        elif mp.role in ("linear", "linear.torch"):
            if mp.name in fused:
                out.append(Placement(mp.name, bucket, "(fused)", f"runs inside {fused[mp.name]}"))
            elif mp.role == "linear":
                out.append(_route_placement(mp.name, bucket, routes["linear"]))
            else:
                out.append(Placement(mp.name, bucket, "torch:F.linear", mp.note))
        elif mp.role == "head":      # its logits: cuBLAS or the 12-bit tiles; the greedy rows take the fused head
            logits = routes.get("logits12") if logits12_bound else None
            if logits is not None and logits.serves(bucket):
                out.append(_route_placement(f"{mp.name} [{logits.kind}]", bucket, logits))
            else:
                out.append(Placement(mp.name, bucket, "torch:F.linear", mp.note))
            greedy = routes.get("greedy12") if head12_bound else None
            if greedy is None or not greedy.serves(bucket):
                greedy = routes["greedy"]
            out.append(_route_placement(f"{mp.name} [{greedy.kind}]", bucket, greedy))
        elif mp.role == "moe.all_experts":
            out.append(Placement(mp.name, bucket, "torch:all-experts", mp.note))
            out += [_route_placement(f"{mp.name} [{r.kind}]", bucket, r) for r in routes.values()]
        elif mp.role == "moe":
            nv = routes.get("nvfp4")
            if nv is not None and nv.serves(bucket) or "grouped" not in routes:
                out.append(_route_placement(mp.name, bucket, nv))
            else:
                out.append(_route_placement(mp.name, bucket, routes["grouped"]))
        elif mp.role == "moe.stock" or not routes:
            out.append(Placement(mp.name, bucket, None, mp.note))
        elif len(routes) == 1:
            (route,) = routes.values()
            out.append(_route_placement(mp.name, bucket, route))
        else:
            out += [_route_placement(f"{mp.name} [{r.kind}]", bucket, r) for r in routes.values()]
    return out


def module_placements(model, bucket: int) -> list[Placement]:
    """Every routed module of `model` at `bucket` rows: its kernel plan (model_plan) printed."""
    head = getattr(model, "greedy_head", None)   # head.head12 serves only where its tiles were accepted at bind
    logits = getattr(getattr(model, "lm_head", None), "kernel", None)     # so does head.head12_logits
    return plan_placements(model_plan(model), bucket, head12_bound=getattr(head, "table12", None) is not None,
                           logits12_bound=getattr(logits, "tiles", None) is not None)


def sampling_placement(model, bucket: int) -> Placement:
    """The decode graphs' sampling variant at `bucket` rows: sample.race draws temperature and greedy rows (a step
    with a top-k / top-p row replays the processed variant: the torch sampler)."""
    return _place("sampling [sample.race]", bucket, "sample.race", bucket, (model.cfg.vocab_size,))


def explain(model, kv, table_width: int, buckets: tuple[int, ...]) -> list[Placement]:
    out = []
    for b in buckets:
        out += (module_placements(model, b) + attention_placements(model, kv, table_width, b)
                + [sampling_placement(model, b)])
    return out


def draft_attention_placements(drafter, kv, bucket: int, query_len: int) -> list[Placement]:
    """kv.write / attn.paged of the Eagle3 draft layer (a dense layer of the same cache) for `bucket` sequences
    with `query_len` query tokens each: K+1 in the first draft pass of a speculative step, 1 in the others."""
    spec, c = kv.spec, drafter.cfg
    i = spec.draft_layer
    fmt, hk, p = spec.kv_format(i), spec.kv_heads(i), spec.page_size
    name = f"draft layer {i}"
    out = [_place(f"{name} [kv.write]", bucket, "kv.write", bucket * query_len,
                  (hk, c.head_dim, p, 0, FMT_CODE[fmt], NO_INDEX))]
    if fmt not in FMT_CODES:
        out.append(Placement(f"{name} [attn.paged]", bucket, None,
                             f"attn.paged: KV stored as {fmt}; the kernel reads {sorted(FMT_CODES)}"))
    else:
        out.append(_place(f"{name} [attn.paged]", bucket, "attn.paged", query_len,
                          (FMT_CODES[fmt], c.num_attention_heads, hk, c.head_dim, p, 0)))
    return out


def spec_step_placements(buckets: tuple[int, ...], k: int) -> list[Placement]:
    """The speculative step's bookkeeping launches (spec.inputs / spec.accept / spec.commit) per bucket."""
    return [_place(f"speculative step [{name}]", b, name, b, (k,)) for b in buckets
            for name in ("spec.inputs", "spec.accept", "spec.commit")]


def uncertified_attention(model, kv, table_width: int, buckets: tuple[int, ...], query_len: int = 1
                          ) -> list[Placement]:
    """The attention placements of a step with `query_len` query tokens per sequence (1: decode; K+1: a
    speculative verify) that would not run a certified cell (empty = all certified)."""
    return [p for b in buckets for p in attention_placements(model, kv, table_width, b, query_len)
            if p.entry is None]


def uncertified_draft_attention(drafter, kv, buckets: tuple[int, ...], k: int) -> list[Placement]:
    """The draft layer's placements of a speculative step (pass 1: K+1 rows per sequence; passes 2..K: 1) that
    would not run a certified cell."""
    lens = (k + 1, 1) if k > 1 else (k + 1,)
    return [p for b in buckets for q in lens for p in draft_attention_placements(drafter, kv, b, q)
            if p.entry is None]
