"""Catalog entries qkv.{nvfp4,mxfp8,fp8}: the q | k | v | index-q | index-k projections as ONE
weight-streaming GEMM. The five weights are concatenated along N once, at load
(fuse_projection_weights); each call returns one [M, N_total] output that the caller splits
with split_projection. Per-tensor scales (NVFP4 global, FP8) become one fp32 scale per output
row, so each part keeps its own scale exactly.

Shape legend:
    x        [M, 6144]           bf16 hidden states (M = 1..48 tokens)
    parts    q [8192 | 4096], k [512 | 256], v [512 | 256], index-q [512 | 256], index-k [128]
             rows at TP1 | TP2 (index-k is one head, replicated on every rank; dense-attention layers
             have q | k | v only)
    out      [M, N_total]        bf16, N_total = 9856 | 4992 (MSA layers, TP1 | TP2), 9216 | 4608 (dense)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from m3serve.kernels.gemm._gemm_tiles import make_workspace
from m3serve.kernels.gemm import _linear as L
from m3serve.kernels.gemm import fp8 as linear_fp8, mxfp8 as linear_mxfp8, nvfp4 as linear_nvfp4
from m3serve.kernels.catalog import Case, Cell, Entry, assert_band, device_rng, gemm_band, poisoned, true_fp32
from m3serve.quant.tiles import tileable, to_layout

ENABLED = True  # the one switch for all three fused-projection entries

QKV_PARTS_TP1 = (8192, 512, 512, 512, 128)
QKV_PARTS_TP2 = (4096, 256, 256, 256, 128)
_SHAPES = (
    ((sum(QKV_PARTS_TP1), 6144), "fused q|k|v|index-q|index-k, TP1"),
    ((sum(QKV_PARTS_TP2), 6144), "fused q|k|v|index-q|index-k, TP2"),
    ((sum(QKV_PARTS_TP1[:3]), 6144), "fused q|k|v of a dense-attention layer, TP1"),
    ((sum(QKV_PARTS_TP2[:3]), 6144), "fused q|k|v of a dense-attention layer, TP2"),
)
_PARTS_BY_N = {sum(p): p for p in (QKV_PARTS_TP1, QKV_PARTS_TP2, QKV_PARTS_TP1[:3], QKV_PARTS_TP2[:3])}
_INTERP_PARTS = (64, 16, 16, 16, 16)


@dataclass
class FusedWeight:
    """The concatenated weight of one fused projection (built once at load)."""

    fmt: str  # "nvfp4" | "mxfp8" | "fp8"
    tensors: tuple[torch.Tensor, ...]  # raw-call weight arguments, in order
    splits: tuple[int, ...]  # rows of each part, for split_projection


def fuse_projection_weights(fmt: str, parts: Sequence[tuple[torch.Tensor, ...]]) -> FusedWeight:
    """parts: per projection, nvfp4 (packed, block_scale, global_scale), mxfp8 (q, scale) or
    fp8 (q, scale). Returns the concatenation along N with per-row scales where needed."""
    if not parts:
        raise ValueError("parts: expected at least one projection weight, found none")
    if fmt == "nvfp4":
        rows = [p[0].shape[0] for p in parts]
        packed = torch.cat([p[0] for p in parts]).contiguous()
        scale = torch.cat([p[1] for p in parts]).contiguous()
        gs = torch.cat([p[2].float().reshape(()).expand(r) for p, r in zip(parts, rows)]).contiguous()
        return FusedWeight(fmt, (packed, scale, gs), tuple(rows))
    if fmt == "mxfp8":
        rows = [p[0].shape[0] for p in parts]
        return FusedWeight(fmt, (torch.cat([p[0] for p in parts]).contiguous(),
                                 torch.cat([p[1] for p in parts]).contiguous()), tuple(rows))
    if fmt == "fp8":
        rows = [p[0].shape[0] for p in parts]
        scale = torch.cat([p[1].float().reshape(()).expand(r) for p, r in zip(parts, rows)]).contiguous()
        return FusedWeight(fmt, (torch.cat([p[0] for p in parts]).contiguous(), scale), tuple(rows))
    raise ValueError(f"fmt: expected one of 'nvfp4', 'mxfp8', 'fp8', found {fmt!r}")


def split_projection(out: torch.Tensor, splits: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """[M, N_total] -> views (q, k, v, index_q, index_k), no copies."""
    if sum(splits) != out.shape[-1]:
        raise ValueError(f"splits: expected rows summing to {out.shape[-1]}, found {tuple(splits)}")
    return tuple(torch.split(out, list(splits), dim=-1))


def _make(fmt: str, raw: Callable, ref: Callable, stock: Callable, weight_bytes: float,
          random_part: Callable[[int, int, torch.device, torch.Generator | None], tuple], dequant: Callable,
          gemv: tuple[dict, tuple] | None = None, mma: tuple[dict, tuple] | None = None,
          tiles: bool = False) -> Entry:
    """gemv: the linear entry's decode GEMV family and row ranges, so a fused projection at 1-4 rows streams its
    weight with the same kernel the separate projections would use. tiles: the format has the MMA tile layout
    (NVFP4, MXFP8), which every cell reads: the cases hold the fused weight in it, as the target does."""
    name = f"qkv.{fmt}"

    def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
        n, k = cell.shape
        split = cell.config["parts"]
        fused = fuse_projection_weights(fmt, [random_part(r, k, device, gen) for r in split])
        cfg: L.GemmConfig = cell.config["gemm"]
        weights, kwargs = fused.tensors, {}
        if tiles and tileable(fmt, *weights[:2]):
            weights, kwargs = (*to_layout(fmt, *weights[:2], "rows", "mma_tile"), *weights[2:]), {"tiled": True}
        x = L.fresh_x(rows, k, device, gen)
        out = poisoned((rows, n), torch.bfloat16, device)
        ws = make_workspace(cfg, n, device)
        wbytes = sum(t.numel() * t.element_size() for t in weights)
        return Case(args=(x, *weights, out, ws, cfg), kwargs=kwargs, bytes_moved=wbytes + rows * (k + n) * 2)

    def compare(out: torch.Tensor, refv: torch.Tensor, case: Case) -> None:
        """Band: gemm_band (one bf16 ulp + 2*(K+1)*u*sum|x*w|: fp32 summation order, plus the
        per-row scale applied once to the sum instead of to each weight)."""
        x = case.args[0]
        w = dequant(*case.args[1:-3], **case.kwargs)
        with true_fp32():
            absprod = x.float().abs() @ w.abs().T
        assert_band(name, out, refv, gemm_band(refv, absprod, x.shape[1] + 1))

    cells = tuple(Cell(rows=c.rows, shape=c.shape, why=c.why,
                       config={**c.config, "parts": _PARTS_BY_N[c.shape[0]]})
                  for c in (L.decode_linear_cells(weight_bytes, *gemv, shapes=_SHAPES, mma=mma[0] if mma else None,
                                                  mma_rows=mma[1] if mma else None) if gemv is not None
                            else L.linear_cells(weight_bytes, _SHAPES)))
    interp = tuple(Cell(rows=c.rows, shape=c.shape, why=c.why, config={**c.config, "parts": _INTERP_PARTS})
                   for c in L.interp_cells(((sum(_INTERP_PARTS), 256),), mma=fmt in ("nvfp4", "mxfp8")))

    def warmup(device: torch.device) -> None:
        L.warmup_cells(cells, make_case, raw, device)

    return Entry(name=name, kind=name, raw_call=raw, reference=ref, compare=compare, make_case=make_case,
                 cells=cells, interp_cells=interp, warmup=warmup, enabled=lambda: ENABLED, stock=stock)


def _nvfp4_part(r: int, k: int, device: torch.device, gen: torch.Generator | None) -> tuple:
    return linear_nvfp4.random_nvfp4_weight(r, k, device, gen)


def _mxfp8_part(r: int, k: int, device: torch.device, gen: torch.Generator | None) -> tuple:
    q = linear_mxfp8.random_e4m3((r, k), gen, device)
    if gen is None:
        return q, torch.full((r, k // 32), 127, dtype=torch.uint8, device=device)
    return q, torch.randint(110, 136, (r, k // 32), generator=device_rng(gen, device), dtype=torch.uint8, device=device)


def _fp8_part(r: int, k: int, device: torch.device, gen: torch.Generator | None) -> tuple:
    s = 1.0 if gen is None else float(1e-4 + 1e-2 * torch.rand((), generator=gen))
    return linear_mxfp8.random_e4m3((r, k), gen, device), torch.tensor(s, dtype=torch.float32, device=device)


QKV_NVFP4 = _make("nvfp4", linear_nvfp4.nvfp4_linear, linear_nvfp4.nvfp4_linear_reference,
                  linear_nvfp4.nvfp4_linear_stock, linear_nvfp4.WEIGHT_BYTES, _nvfp4_part, linear_nvfp4._dequant,
                  gemv=(linear_nvfp4.GEMV_FAMILY, linear_nvfp4.GEMV_ROWS),
                  mma=(linear_nvfp4.MMA_FAMILY, linear_nvfp4.MMA_ROWS), tiles=True)
QKV_MXFP8 = _make("mxfp8", linear_mxfp8.mxfp8_linear, linear_mxfp8.mxfp8_linear_reference,
                  linear_mxfp8.mxfp8_linear_stock, linear_mxfp8.WEIGHT_BYTES, _mxfp8_part,
                  linear_mxfp8._dequant, gemv=(linear_mxfp8.GEMV_FAMILY, linear_mxfp8.GEMV_ROWS),
                  mma=(linear_mxfp8.MMA_FAMILY, linear_mxfp8.MMA_ROWS), tiles=True)
QKV_FP8 = _make("fp8", linear_fp8.fp8_linear, linear_fp8.fp8_linear_reference, linear_fp8.fp8_linear_stock, 1.0,
                _fp8_part, linear_fp8._dequant)
ENTRIES = (QKV_NVFP4, QKV_MXFP8, QKV_FP8)
