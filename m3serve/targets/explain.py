"""What runs where on the decode target: per module and batch bucket, the catalog entry and certified cell, or
why the module runs stock. `m3serve explain` prints it; `LLMEngine.enable_target` uses the attention part to
decide (auto) or insist (require) that every attention layer of a decode step lies in certified cells.

Rows, per entry kind: linears, MoE, norms and heads see the step's tokens (= the bucket in a decode step);
kv.write sees the step's tokens; msa.scores / msa.select / attn.paged see the query tokens per sequence (1 in a
decode step, K+1 in a speculative verify).
"""

from __future__ import annotations

from dataclasses import dataclass

from m3serve.kernels.attention.kv_write import FMT_CODE, NO_INDEX
from m3serve.kernels.attention.msa_index import IFMT_CODE
from m3serve.kernels.attention.paged import FMT_CODES
from m3serve.model.layers import Linear, RMSNorm
from m3serve.model.m3 import Attention
from m3serve.model.moe import MoE
from m3serve.targets.dispatch import lookup
from m3serve.targets.fused_projection import QUANT_FORMATS, projection_parts
from m3serve.targets.routing import ALL_EXPERTS_MAX, grouped_shape, nvfp4_shape


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


def module_placements(model, bucket: int) -> list[Placement]:
    """Quantized linears, MoE layers and decoder norms at `bucket` rows (what routing.install's hooks will
    choose)."""
    out, fused_parts = [], {}
    for name, mod in model.named_modules():
        if isinstance(mod, Attention):
            parts = projection_parts(mod)
            fmts = {p.fmt for p in parts}
            if len(fmts) != 1:
                continue
            fmt, n, k = fmts.pop(), sum(p.out_features for p in parts), parts[0].in_features
            if fmt == "dense":
                placed = Placement(f"{name}.qkv", bucket, "torch:fused-GEMM",
                                   f"q|k|v{'|index-q|index-k' if mod.sparse else ''} as one cuBLAS GEMM ({n} x {k})")
            elif fmt in QUANT_FORMATS:
                placed = _place(f"{name}.qkv", bucket, f"qkv.{fmt}", bucket, (n, k))
                if placed.entry is None:   # the parts run one by one through their own linear entries
                    continue
            else:
                continue
            out.append(placed)
            fused_parts.update((id(p), placed.module) for p in parts)
        elif isinstance(mod, MoE):
            nv = nvfp4_shape(mod)
            if mod.w13.fmt == "dense" and mod.w2.fmt == "dense" and mod.w13.num_experts <= ALL_EXPERTS_MAX:
                out.append(Placement(name, bucket, "torch:all-experts",
                                     f"dense experts ({mod.w13.num_experts} <= {ALL_EXPERTS_MAX}): every expert on "
                                     "every token, masked (no host sync, capturable)"))
            elif nv is not None and lookup("moe.nvfp4", bucket, nv, "auto") is not None:
                out.append(_place(name, bucket, "moe.nvfp4", bucket, nv))
            elif grouped_shape(mod) is not None:
                out.append(_place(name, bucket, "moe.grouped", bucket, grouped_shape(mod)))
            else:
                out.append(Placement(name, bucket, None, f"experts gate|up {mod.w13.fmt} / down {mod.w2.fmt}: no "
                                     "entry takes them; the stock loop (syncs the host: not capturable)"))
        elif isinstance(mod, RMSNorm) and (name == "norm" or name.endswith(("input_norm", "post_norm"))):
            # every decoder-level norm but the first follows a residual add and fuses with it
            kind = "norm.rms" if name == "layers.0.input_norm" else "norm.add_rms"
            out.append(_place(name, bucket, kind, bucket, (mod.weight.shape[0],)))
        elif isinstance(mod, Linear) and mod.num_experts is None:
            if id(mod) in fused_parts:
                out.append(Placement(name, bucket, "(fused)", f"runs inside {fused_parts[id(mod)]}"))
            elif mod.fmt in ("nvfp4", "mxfp8", "fp8"):
                out.append(_place(name, bucket, f"linear.{mod.fmt}", bucket, (mod.out_features, mod.in_features)))
            else:
                out.append(Placement(name, bucket, "torch:F.linear",
                                     f"{mod.fmt} weights: cuBLAS (no catalog entry for unquantized linears)"))
    return out


def explain(model, kv, table_width: int, buckets: tuple[int, ...]) -> list[Placement]:
    out = []
    for b in buckets:
        out += module_placements(model, b) + attention_placements(model, kv, table_width, b)
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
