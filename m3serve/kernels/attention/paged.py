"""Catalog entry attn.paged: decode / verify / MSA-sparse attention over the paged hybrid KV cache.

    paged_attention(q, k_pages, v_pages, k_scale, v_scale, kv_gs, slot_table, seq_lens, query_start, sel,
                    out, workspace, *, fmt, sm_scale, max_query_len, num_splits) -> out

All sequences of a step in one split-KV launch (grid T x Hk x num_splits); with 2-8 splits the last split of each
(row, KV head) to finish merges them in order, with more an ordered combine launch does; see attention/_paged.py (kernels), attention/_paged_call.py (checks,
tile config, workspace, choose_num_splits), attention/_paged_ref.py (reference and band),
attention/_paged_case.py (cases on a real PagedKVCache).

Cell shape key: (fmt code, Hq, Hk, D, P, topk or 0), fmt codes FMT_CODES (nvfp4 0, fp8 2, bf16 3,
fp32 4); rows = query tokens per sequence: 1 (decode) or 2..48 (speculative verify, short chunks).
A cell's config "case" is the (batch, context) its generic GPU test runs at.
"""

from __future__ import annotations

import dataclasses

import torch

from m3serve.kernels.attention._paged_call import (FMT_CODES, AttnWorkspace, choose_num_splits, make_workspace,
                                              paged_attention, paged_attention_stock, tile_config)
from m3serve.kernels.attention._paged_case import CaseShape, build_case
from m3serve.kernels.attention._paged_ref import compare, paged_attention_reference
from m3serve.kernels.catalog import Case, Cell, Entry

ENABLED = True  # the one switch: False sends attn.paged calls down the stock path

__all__ = ["paged_attention", "make_workspace", "choose_num_splits", "AttnWorkspace", "tile_config", "FMT_CODES",
           "ENTRY", "ENTRIES"]


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    return build_case(cell.shape, rows, device, gen, cell.config["case"]).case


_NV, _F8, _BF, _F32 = FMT_CODES["nvfp4"], FMT_CODES["fp8"], FMT_CODES["bf16"], FMT_CODES["fp32"]
_MODELS = (
    ((64, 4, 128, 128), 16, "M3 TP1", CaseShape(batch=4, context=3000)),
    ((32, 2, 128, 128), 16, "M3 TP2", CaseShape(batch=4, context=3000)),
    ((4, 2, 64, 32), 8, "embedded model", CaseShape(batch=3, context=700)),
)
# (fmt, sparse) pairs per model: the hybrid cache keeps MSA layers in NVFP4 and dense ones in FP8; a
# uniform bf16 / fp8 (or, embedded, fp32) cache holds both kinds of layer in its one format.
_FORMATS = {
    "M3 TP1": ((_F8, False), (_BF, False), (_NV, True), (_F8, True), (_BF, True)),
    "M3 TP2": ((_F8, False), (_BF, False), (_NV, True), (_F8, True), (_BF, True)),
    "embedded model": ((_BF, False), (_F32, False), (_F8, False), (_NV, True), (_BF, True), (_F32, True),
                       (_F8, True)),
}
_NAMES = {v: k for k, v in FMT_CODES.items()}


def _cells() -> tuple[Cell, ...]:
    out = []
    for (hq, hk, d, p), topk, model, cs in _MODELS:
        for code, sparse in _FORMATS[model]:
            kind = f"MSA top-{topk}" if sparse else "dense causal"
            key = (code, hq, hk, d, p, topk if sparse else 0)
            ranges = ((1, 48),) if sparse else ((1, 1), (2, 48))
            for lo, hi in ranges:
                use = "decode" if hi == 1 else "verify / short chunks" if lo > 1 else "decode, verify, short chunks"
                for rot in ((False, True) if code == _NV else (False,)):
                    case = dataclasses.replace(cs, rotate=True) if rot else cs
                    out.append(Cell(rows=(lo, hi), shape=key, config={"case": case},
                                    why=f"{model} {kind} attention on a {_NAMES[code]} KV cache"
                                        f"{' (K/V Hadamard-rotated)' if rot else ''} (Hq {hq}, Hk {hk}, D {d}, "
                                        f"P {p}): {use}, {lo}-{hi} query tokens per sequence"))
    return tuple(out)


CELLS = _cells()
INTERP_CELLS = (
    Cell(rows=(1, 2), shape=(_BF, 4, 2, 32, 16, 0), config={"case": CaseShape(batch=3, context=60, num_splits=3)},
         why="interpreter: dense bf16, decode and 2-token verify (QB 2), 3 splits + combine, padding sequence"),
    Cell(rows=(3, 3), shape=(_F8, 4, 2, 32, 16, 0), config={"case": CaseShape(batch=2, context=45, num_splits=1)},
         why="interpreter: dense fp8, 3 query tokens stacked (QB 4), no split"),
    Cell(rows=(1, 2), shape=(_NV, 4, 2, 32, 16, 3), config={"case": CaseShape(batch=2, context=70, num_splits=2)},
         why="interpreter: MSA top-3 on NVFP4 pages, 2 splits"),
    Cell(rows=(2, 2), shape=(_F32, 4, 2, 32, 16, 2), config={"case": CaseShape(batch=2, context=50, num_splits=1)},
         why="interpreter: MSA top-2 on an fp32 cache (rounded to bf16 on read), no split"),
    Cell(rows=(1, 2), shape=(_NV, 4, 2, 32, 16, 3),
         config={"case": CaseShape(batch=2, context=70, num_splits=2, rotate=True)},
         why="interpreter: MSA top-3 on Hadamard-rotated NVFP4 pages (q rotated, output un-rotated), 2 splits"),
    Cell(rows=(1, 1), shape=(_NV, 4, 2, 64, 16, 2),
         config={"case": CaseShape(batch=2, context=50, num_splits=1, rotate=True)},
         why="interpreter: MSA top-2 on rotated NVFP4 pages at the embedded model's D 64, no split"),
)


def _warm_rows(cell: Cell) -> list[int]:
    """One row count per distinct tile config of a cell (QB follows next_pow2(rows) up to its cap),
    plus both ends (Triton specialises rows == 1)."""
    lo, hi = cell.rows
    _, hq, hk, _, p, topk = cell.shape
    seen, rows = set(), []
    for r in sorted({lo, hi, *(2**k for k in range(1, 7) if lo <= 2**k <= hi)}):
        cfg = tile_config(hq // hk, p, r, topk > 0, cell.shape[0] == _NV)
        if (cfg, r == 1) not in seen or r in (lo, hi):
            seen.add((cfg, r == 1))
            rows.append(r)
    return rows


def warmup(device: torch.device) -> None:
    """Compiles each cell's tile configs at its case's split count; a call site with another
    num_splits (a constexpr) compiles that variant on its first call, so warm it there too."""
    for c in CELLS:
        for rows in _warm_rows(c):
            case = make_case(c, rows, device, None)
            paged_attention(*case.args, **case.kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


ENTRY = Entry(
    name="attn.paged", kind="attn.paged", raw_call=paged_attention, reference=paged_attention_reference,
    compare=compare, make_case=make_case, cells=CELLS, interp_cells=INTERP_CELLS, warmup=warmup,
    enabled=lambda: ENABLED, stock=paged_attention_stock,
)
ENTRIES = (ENTRY,)
