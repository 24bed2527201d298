"""One GEMM for an attention layer's q | k | v (| index-q | index-k) projections on the decode target.

The parts' weights are concatenated along N once, on the first routed call, and each Linear's own tensors
become row views of the concatenation: the stock path reads the same bytes, nothing is stored twice.

    dense (bf16)        one torch GEMM over the [N_total, H] weight (cuBLAS, as the stock path's F.linear:
                        every output is the same dot product; only the GEMM's blocking may differ)
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
from m3serve.targets.plan import QUANT_FORMATS, projection_parts


@dataclass
class FusedProjection:
    fmt: str
    tensors: tuple[torch.Tensor, ...]   # dense: (w [N_total, H],); quantized: the qkv entry's weight arguments
    splits: tuple[int, ...]             # output columns of each part, in order
    views: tuple[torch.Tensor, ...]     # the tensor each part was rebound to (its weight / packed / q)


def _rows(t: torch.Tensor, offsets: list[int]) -> list[torch.Tensor]:
    return [t[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def fuse(attn) -> FusedProjection | None:
    """Concatenate the parts' weights (one format for all, unstacked) and rebind each part to its row view;
    None when the parts differ in format."""
    parts = projection_parts(attn)
    fmts = {p.fmt for p in parts}
    if len(fmts) != 1 or any(p.num_experts is not None for p in parts):
        return None
    fmt = fmts.pop()
    splits = tuple(p.out_features for p in parts)
    offsets = [0]
    for n in splits:
        offsets.append(offsets[-1] + n)
    if fmt == "dense":
        w = torch.cat([p.weight.detach() for p in parts]).contiguous()
        for p, view in zip(parts, _rows(w, offsets)):
            p.weight = nn.Parameter(view, requires_grad=False)
        return FusedProjection(fmt, (w,), splits, tuple(p.weight for p in parts))
    if fmt not in QUANT_FORMATS:
        return None
    keys = {"nvfp4": ("packed", "scale", "global_scale"), "mxfp8": ("q", "scale"), "fp8": ("q", "scale")}[fmt]
    fused = fuse_projection_weights(fmt, [tuple(getattr(p, f"q_{k}") for k in keys) for p in parts])
    # the per-row tensors (not the per-part scales) become views: packed / q and the block scales
    row_keys = {"nvfp4": ("packed", "scale"), "mxfp8": ("q", "scale"), "fp8": ("q",)}[fmt]
    for i, key in enumerate(row_keys):
        for p, view in zip(parts, _rows(fused.tensors[i], offsets)):
            p.register_buffer(f"q_{key}", view)
    return FusedProjection(fmt, fused.tensors, splits, tuple(getattr(p, f"q_{row_keys[0]}") for p in parts))


def _still_views(attn, fp: FusedProjection) -> bool:
    """Whether every part still reads its rows of the concatenation (a later set_weight rebinds a part): an
    identity check per part, cheap enough for every eager call."""
    key = "weight" if fp.fmt == "dense" else ("q_packed" if fp.fmt == "nvfp4" else "q_q")
    return all(getattr(p, key, None) is v for p, v in zip(projection_parts(attn), fp.views))


def _layout(attn, fp: FusedProjection) -> str | None:
    """The layout all parts are in now (their bytes are the concatenation's rows, re-laid out in place by
    Linear.set_layout), None when they differ (the parts then run one by one); "rows" for untiled formats."""
    if fp.fmt not in TILED_FORMATS:
        return "rows"
    layouts = {p.q_layout for p in projection_parts(attn)}
    return layouts.pop() if len(layouts) == 1 else None


def project(attn, x: torch.Tensor, qkv=None) -> tuple[torch.Tensor, ...] | None:
    """x [T, H] bf16 -> the parts' outputs (views of one [T, N_total] buffer), or None when no fused
    projection serves this layer and row count (the caller then runs the parts one by one). qkv: the layer's
    bound qkv.{fmt} row table (routing.RowTable: rows -> launch or None), needed by quantized parts."""
    store = attn.__dict__.setdefault("_routed_workspaces", {})   # made once per layer, refreshed when replaced
    fp = store.get("fused_projection", False)
    if fp is False or (fp is not None and not _still_views(attn, fp)):   # first call, or weights replaced since
        fp = store["fused_projection"] = fuse(attn)
    if fp is None:
        return None
    t, h = x.shape
    n = sum(fp.splits)
    if fp.fmt == "dense":
        w = fp.tensors[0]
        if w.dtype != x.dtype:
            return None
        out = torch.mm(x, w.t())
    else:
        # Both routes are catalog entries (the parts' own linear.{fmt} kernels enforce require mode), so rows
        # without a certified fused cell take the per-part route rather than raising here (the plan's qkv route
        # is never strict).
        launch = qkv(t) if qkv is not None else None
        layout = _layout(attn, fp)
        if launch is None or layout is None:
            return None
        cfg = launch.config
        ws = launch.workspace
        if ws is None:
            ws = launch.workspace = make_workspace(cfg, n, x.device)
        out = torch.empty(t, n, dtype=torch.bfloat16, device=x.device)
        if fp.fmt in TILED_FORMATS:
            launch.run(x.contiguous(), *fp.tensors, out, ws, cfg, tiled=layout == "mma_tile")
        else:
            launch.run(x.contiguous(), *fp.tensors, out, ws, cfg)
    return tuple(torch.split(out, list(fp.splits), dim=-1))
