"""The attention layer's q | k | v (| index-q | index-k) projections in as few GEMMs as their formats allow, on the
decode target.

The parts are grouped by format (plan.projection_groups): all of them when they share one; or q|k|v in their
quantized format and index-q|index-k dense, as every quantized M3 checkpoint stores them (the indexer is never
quantized). Each group's weights are concatenated along N once, on the first routed call, and each Linear's own
tensors become row views of its group's concatenation: the stock path reads the same bytes, nothing is stored twice.

    dense (bf16)        one torch GEMM over the group's [N_group, H] weight (cuBLAS, as the stock path's F.linear:
                        every output is the same dot product; only the GEMM's blocking may differ); the index group
                        beside a quantized q|k|v at the rows linear.bf16 certifies (1-4), where the plan routes it
                        (opt-in: plan.INDEX_GEMV): that entry's one GEMV launch instead of cuBLAS's split-K GEMM and
                        reduce
    nvfp4/mxfp8/fp8     the catalog's qkv.{fmt} entry (one weight-streaming launch, per-row part scales)

Shape legend: T tokens, H hidden, N_total = Hq*D + 2*Hk*D (+ Hk*Di + Di on MSA layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from m3serve.kernels.gemm._gemm_tiles import make_workspace
from m3serve.kernels.gemm.qkv_fused import fuse_projection_weights
from m3serve.quant.tiles import TILED_FORMATS
from m3serve.targets.plan import QUANT_FORMATS, projection_groups, projection_parts


@dataclass
class FusedGroup:
    fmt: str
    tensors: tuple[torch.Tensor, ...]   # dense: (w [N_group, H],); quantized: the qkv entry's weight arguments
    splits: tuple[int, ...]             # output columns of each part of the group, in order
    views: tuple[torch.Tensor, ...]     # the tensor each part was rebound to (its weight / packed / q)
    parts: tuple                        # the group's Linears


@dataclass
class FusedProjection:
    groups: tuple[FusedGroup, ...]      # in the parts' order: q|k|v(|index), or q|k|v then index-q|index-k

    @property
    def splits(self) -> tuple[int, ...]:
        return tuple(n for g in self.groups for n in g.splits)


def _rows(t: torch.Tensor, offsets: list[int]) -> list[torch.Tensor]:
    return [t[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def _fuse_group(parts: list) -> FusedGroup | None:
    """Concatenate one group's weights (one format) and rebind each part to its row view."""
    fmt = parts[0].fmt
    splits = tuple(p.out_features for p in parts)
    offsets = [0]
    for n in splits:
        offsets.append(offsets[-1] + n)
    if fmt == "dense":
        w = torch.cat([p.weight.detach() for p in parts]).contiguous()
        for p, view in zip(parts, _rows(w, offsets)):
            p.weight = nn.Parameter(view, requires_grad=False)
        return FusedGroup(fmt, (w,), splits, tuple(p.weight for p in parts), tuple(parts))
    if fmt not in QUANT_FORMATS:
        return None
    keys = {"nvfp4": ("packed", "scale", "global_scale"), "mxfp8": ("q", "scale"), "fp8": ("q", "scale")}[fmt]
    fused = fuse_projection_weights(fmt, [tuple(getattr(p, f"q_{k}") for k in keys) for p in parts])
    # the per-row tensors (not the per-part scales) become views: packed / q and the block scales
    row_keys = {"nvfp4": ("packed", "scale"), "mxfp8": ("q", "scale"), "fp8": ("q",)}[fmt]
    for i, key in enumerate(row_keys):
        for p, view in zip(parts, _rows(fused.tensors[i], offsets)):
            p.register_buffer(f"q_{key}", view)
    return FusedGroup(fmt, fused.tensors, splits, tuple(getattr(p, f"q_{row_keys[0]}") for p in parts), tuple(parts))


def fuse(attn) -> FusedProjection | None:
    """The layer's projections fused group by group (plan.projection_groups); None for a mix of formats no group
    serves."""
    groups = projection_groups(attn)
    if groups is None:
        return None
    fused = [_fuse_group(g) for g in groups]
    return None if any(g is None for g in fused) else FusedProjection(tuple(fused))


def _view_key(fmt: str) -> str:
    return "weight" if fmt == "dense" else ("q_packed" if fmt == "nvfp4" else "q_q")


def _still_views(attn, fp: FusedProjection) -> bool:
    """Whether every part still reads its rows of its group's concatenation (a later set_weight rebinds a part):
    an identity check per part, cheap enough for every eager call."""
    held = [(p, getattr(p, _view_key(g.fmt), None) is v) for g in fp.groups for p, v in zip(g.parts, g.views)]
    return [p for p, _ in held] == projection_parts(attn) and all(same for _, same in held)


def _layout(g: FusedGroup) -> str | None:
    """The layout all of a group's parts are in now (their bytes are the concatenation's rows, re-laid out in place
    by Linear.set_layout), None when they differ (the parts then run one by one); "rows" for untiled formats."""
    if g.fmt not in TILED_FORMATS:
        return "rows"
    layouts = {p.q_layout for p in g.parts}
    return layouts.pop() if len(layouts) == 1 else None


def project(attn, x: torch.Tensor, qkv=None, index=None) -> tuple[torch.Tensor, ...] | None:
    """x [T, H] bf16 -> the parts' outputs (views of one [T, N_group] buffer per group), or None when no fused
    projection serves this layer and row count (the caller then runs the parts one by one). qkv: the layer's
    bound qkv.{fmt} row table (routing.RowTable: rows -> launch or None), needed by a quantized group; index: its
    linear.bf16 row table for the dense group beside it (rows it does not serve take cuBLAS)."""
    store = attn.__dict__.setdefault("_routed_workspaces", {})   # made once per layer, refreshed when replaced
    fp = store.get("fused_projection", False)
    if fp is False or (fp is not None and not _still_views(attn, fp)):   # first call, or weights replaced since
        fp = store["fused_projection"] = fuse(attn)
    if fp is None:
        return None
    t = x.shape[0]
    # every group's route first: a group without one sends all parts down their own routes
    plans = []
    for g in fp.groups:
        if g.fmt == "dense":
            if g.tensors[0].dtype != x.dtype:
                return None
            plans.append((g, index(t) if index is not None and len(fp.groups) > 1 else None, None))
            continue
        # Both routes are catalog entries (the parts' own linear.{fmt} kernels enforce require mode), so rows without
        # a certified fused cell take the per-part route rather than raising here (the plan's qkv route is never
        # strict).
        launch = qkv(t) if qkv is not None else None
        layout = _layout(g)
        if launch is None or layout is None:
            return None
        plans.append((g, launch, layout))
    outs = []
    for g, launch, layout in plans:
        if launch is None:
            out = torch.mm(x, g.tensors[0].t())
        else:   # qkv.{fmt}, or linear.bf16 for the dense index group (its raw call takes (x, w, out, ws, cfg))
            cfg = launch.config
            ws = launch.workspace
            n = sum(g.splits)
            if ws is None:
                ws = launch.workspace = make_workspace(cfg, n, x.device)
            out = torch.empty(t, n, dtype=torch.bfloat16, device=x.device)
            if g.fmt in TILED_FORMATS:
                launch.run(x.contiguous(), *g.tensors, out, ws, cfg, tiled=layout == "mma_tile")
            else:
                launch.run(x.contiguous(), *g.tensors, out, ws, cfg)
        outs += torch.split(out, list(g.splits), dim=-1)
    return tuple(outs)
