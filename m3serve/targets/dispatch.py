"""Explicit dispatch: for each module kind, the row ranges each fast path serves.

    lookup(kind, rows, shape, mode) -> Entry | None
    resolve(kind, shape) -> spans       the same answer for every row count at once (a kernel plan's rows)

mode "off"      -> None: the stock path, always.
mode "auto"     -> the entry when (rows, shape) lies inside one of its certified cells, else None.
mode "require"  -> the entry, or ValueError naming the kind, the rows/shape and the nearest
                   certified cell. A covered shape never falls back silently.
An unknown mode (or kind) raises: a typo is never read as "off".

An entry whose module constant ENABLED is False is switched off on purpose: lookup returns
None for it in every mode (that is the documented way to turn one fast path off).

Every row count a table lists must be a certified cell of its entry for the shapes the entry
certifies; tests/kernels/test_dispatch.py checks the tables against the catalog both ways.
The table reads no environment variables; the mode is the caller's (e.g. a target's setting).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from m3serve.kernels.catalog import Cell, Entry, all_entries

MODES = ("off", "auto", "require")

# kind -> ((first row, last row), entry name), ranges disjoint and ascending.
TABLES: dict[str, tuple[tuple[tuple[int, int], str], ...]] = {
    "linear.nvfp4": (((1, 48), "linear.nvfp4"), ((49, 16384), "linear.nvfp4.tiled")),
    "linear.mxfp8": (((1, 48), "linear.mxfp8"), ((49, 16384), "linear.mxfp8.tiled")),
    "linear.fp8": (((1, 48), "linear.fp8"), ((49, 16384), "linear.fp8.tiled")),
    # the dense index-q|index-k group beside a quantized q|k|v at decode rows (cuBLAS above)
    "linear.bf16": (((1, 4), "linear.bf16"),),
    "qkv.nvfp4": (((1, 48), "qkv.nvfp4"),),
    "qkv.mxfp8": (((1, 48), "qkv.mxfp8"),),
    "qkv.fp8": (((1, 48), "qkv.fp8"),),
    "moe.nvfp4": (((1, 48), "moe.nvfp4"),),
    # every expert format, decode batches to prefill chunks (NVFP4 1-48 rows stay on moe.nvfp4 where it serves)
    "moe.grouped": (((1, 16384), "moe.grouped"),),
    "norm.add_rms": (((1, 16384), "norm.add_rms"),),
    "head.bf16": (((1, 48), "head.bf16"),),
    "head.head12": (((1, 8), "head.head12"),),   # one MMA column a token row (9-48: head.bf16)
    "head.head12_logits": (((1, 8), "head.head12_logits"),),   # the rows that sample (9 up: cuBLAS)
    # attention on the paged cache: rows = tokens of the step (kv.write) or query tokens per sequence
    "kv.write": (((1, 8192), "kv.write"),),
    "msa.scores": (((1, 8192), "msa.scores"),),
    "msa.select": (((1, 8192), "msa.select"),),
    "attn.paged": (((1, 48), "attn.paged"),),
    "attn.prefill": (((1, 16384), "attn.prefill"),),
    "attn.prefill_sparse": (((1, 16384), "attn.prefill_sparse"),),
    # fused elementwise steps of the decode target (rows = tokens of the step)
    "norm.rms": (((1, 16384), "norm.rms"),),
    "attn.qk_prep": (((1, 16384), "attn.qk_prep"),),
    "mlp.swiglu_oai": (((1, 16384), "mlp.swiglu_oai"),),
    "moe.route_small": (((1, 16384), "moe.route_small"),),
    # the Eagle3 draft layer on the target (rows = tokens of the pass)
    "attn.rope": (((1, 16384), "attn.rope"),),
    "mlp.silu_mul": (((1, 16384), "mlp.silu_mul"),),
    # a speculative step's bookkeeping (rows = sequences of the bucket; shape = (K,))
    "spec.inputs": (((1, 256), "spec.inputs"),),
    "spec.accept": (((1, 256), "spec.accept"),),
    "spec.commit": (((1, 256), "spec.commit"),),
    # the decode graphs' sampling variant (rows = sequences of the bucket; shape = (V,))
    "sample.race": (((1, 512), "sample.race"),),
}


def _fmt_cell(entry: Entry, rows: int, shape: tuple[int, ...]) -> str:
    c = entry.nearest_cell(rows, shape)
    if c is None:
        return "no certified cells"
    return f"nearest certified cell: rows {c.rows[0]}-{c.rows[1]} shape {c.shape} ({c.why})"


def miss(kind: str, rows: int, shape: tuple[int, ...], entries: dict[str, Entry] | None = None) -> str:
    """Why no certified cell of `kind` serves (rows, shape): the table range and entry it falls in (or that it lies
    outside every listed range) and the nearest certified cell. The text require mode raises."""
    entries = entries if entries is not None else all_entries()
    shape = tuple(int(s) for s in shape)
    for (lo, hi), name in TABLES[kind]:
        if lo <= rows <= hi:
            return (f"{kind}: rows {rows} shape {shape} is in the table's range {lo}-{hi} for {name}, but no "
                    f"certified cell covers it; {_fmt_cell(entries[name], rows, shape)}")
    ranges = ", ".join(f"{lo}-{hi} ({name})" for (lo, hi), name in TABLES[kind])
    return (f"{kind}: rows {rows} shape {shape} is outside every listed row range ({ranges}); "
            f"{_fmt_cell(entries[TABLES[kind][0][1]], rows, shape)}")


def lookup(kind: str, rows: int, shape: tuple[int, ...], mode: str) -> Entry | None:
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, found {mode!r}")
    if mode == "off":
        return None
    if kind not in TABLES:
        raise ValueError(f"kind: expected one of {tuple(TABLES)}, found {kind!r}")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows: expected a positive int, found {rows!r}")
    shape = tuple(int(s) for s in shape)
    entries = all_entries()
    for (lo, hi), name in TABLES[kind]:
        if lo <= rows <= hi:
            entry = entries[name]
            if not entry.enabled():
                return None
            if entry.cell_for(rows, shape) is not None:
                return entry
            break
    if mode == "require":
        raise ValueError(miss(kind, rows, shape, entries))
    return None


# the open end of the last span: row counts past every listed range
END = sys.maxsize


@dataclass(frozen=True)
class Span:
    """Row counts lo..hi (inclusive) of one (kind, shape) that lookup answers alike: `cell` of `entry` serves
    them, or none does (cell None: stock in auto, miss(...) in require; off: the entry is switched off, stock in
    every mode)."""
    lo: int
    hi: int
    entry: Entry | None      # the table's entry for these rows (None past every listed range)
    cell: Cell | None
    off: bool = False


def resolve(kind: str, shape: tuple[int, ...], entries: dict[str, Entry] | None = None) -> tuple[Span, ...]:
    """Every row count 1..END of (kind, shape) as ascending, disjoint spans: what lookup(kind, rows, shape, mode)
    answers for each row, worked out once (each row's cell is the first of its entry's cells covering it, as
    Entry.cell_for picks)."""
    if kind not in TABLES:
        raise ValueError(f"kind: expected one of {tuple(TABLES)}, found {kind!r}")
    entries = entries if entries is not None else all_entries()
    shape = tuple(int(s) for s in shape)
    out: list[Span] = []

    def add(lo: int, hi: int, entry, cell, off: bool = False) -> None:
        last = out[-1] if out else None
        if last is not None and last.hi + 1 == lo and last.entry is entry and last.cell is cell and last.off == off:
            out[-1] = Span(last.lo, hi, entry, cell, off)
        else:
            out.append(Span(lo, hi, entry, cell, off))

    nxt = 1
    for (lo, hi), name in TABLES[kind]:
        if lo > nxt:
            add(nxt, lo - 1, None, None)
        entry = entries[name]
        if not entry.enabled():
            add(lo, hi, entry, None, off=True)
        else:
            cuts = {lo, hi + 1}
            for c in entry.cells:
                if c.shape == shape:
                    cuts.update(r for r in (c.rows[0], c.rows[1] + 1) if lo < r <= hi)
            cuts = sorted(cuts)
            for a, b in zip(cuts[:-1], cuts[1:]):
                add(a, b - 1, entry, entry.cell_for(a, shape))
        nxt = hi + 1
    add(nxt, END, None, None)
    return tuple(out)
