"""m3serve.targets.dispatch: modes, coverage, errors, the ENABLED switch, and the tables checked
against the catalog in both directions (claims tests)."""

from __future__ import annotations

import importlib

import pytest

from m3serve.kernels.catalog import all_entries
from m3serve.targets import dispatch
from m3serve.targets.dispatch import TABLES, lookup

ENTRIES = all_entries()


def test_off_is_always_stock() -> None:
    assert lookup("linear.nvfp4", 1, (6144, 6144), "off") is None
    assert lookup("no.such.kind", 1, (1,), "off") is None  # off never inspects anything


def test_auto_inside_and_outside_cells() -> None:
    e = lookup("linear.nvfp4", 4, (6144, 8192), "auto")
    assert e is ENTRIES["linear.nvfp4"]
    assert e.cell_for(4, (6144, 8192)).rows == (1, 8)  # rows 1-8: the MMA GEMV cell (reading the tile layout)
    assert lookup("linear.nvfp4", 49, (6144, 8192), "auto") is ENTRIES["linear.nvfp4.tiled"]  # prefill rows
    assert lookup("linear.nvfp4", 16385, (6144, 8192), "auto") is None  # beyond the table
    assert lookup("linear.nvfp4", 4, (6144, 1000), "auto") is None  # uncertified shape
    assert lookup("moe.nvfp4", 48, (128, 6144, 1536, 0), "auto") is ENTRIES["moe.nvfp4"]
    assert lookup("moe.nvfp4", 3, (128, 6144, 3072, 1), "auto") is ENTRIES["moe.nvfp4"]  # BF16 shared expert
    assert lookup("moe.nvfp4", 9, (128, 6144, 3072, 2), "auto") is None  # no such shared format
    assert lookup("head.head12", 8, (200064, 6144), "auto") is ENTRIES["head.head12"]
    assert lookup("head.head12", 9, (200064, 6144), "auto") is None  # one MMA column a row: 9-48 on head.bf16


def test_require_raises_with_kind_shape_and_nearest_cell() -> None:
    with pytest.raises(ValueError, match=r"linear.mxfp8: rows 4 shape \(6144, 1000\).*nearest certified cell: "
                                         r"rows 3-4 shape \(6144, 1536\)"):
        lookup("linear.mxfp8", 4, (6144, 1000), "require")
    with pytest.raises(ValueError, match=r"norm.add_rms: rows 16385 shape \(6144,\) is outside every listed row range"):
        lookup("norm.add_rms", 16385, (6144,), "require")
    assert lookup("norm.add_rms", 16384, (6144,), "require") is ENTRIES["norm.add_rms"]


@pytest.mark.parametrize("mode", ["Auto", "on", "", None, 1])
def test_unknown_mode_raises(mode) -> None:
    with pytest.raises(ValueError, match=r"mode: expected one of \('off', 'auto', 'require'\)"):
        lookup("linear.nvfp4", 1, (6144, 6144), mode)


def test_unknown_kind_and_bad_rows_raise() -> None:
    with pytest.raises(ValueError, match=r"kind: expected one of .*found 'linear.int4'"):
        lookup("linear.int4", 1, (6144, 6144), "auto")
    with pytest.raises(ValueError, match=r"rows: expected a positive int, found 0"):
        lookup("linear.nvfp4", 0, (6144, 6144), "require")


def test_enabled_constant_turns_the_fast_path_off(monkeypatch) -> None:
    mod = importlib.import_module("m3serve.kernels.gemm.nvfp4")
    monkeypatch.setattr(mod, "ENABLED", False)
    assert lookup("linear.nvfp4", 1, (6144, 6144), "auto") is None
    assert lookup("linear.nvfp4", 1, (6144, 6144), "require") is None
    monkeypatch.setattr(mod, "ENABLED", True)
    assert lookup("linear.nvfp4", 1, (6144, 6144), "require") is ENTRIES["linear.nvfp4"]


def _rotated(cell) -> bool:
    """The rotated-K/V variant of a cell (kv.write: config "rotate"; attn.paged: its case's `rotate`)."""
    return bool(cell.config.get("rotate") or getattr(cell.config.get("case"), "rotate", False))


def test_every_listed_row_is_a_certified_cell() -> None:
    """Claims test, table -> catalog: for each kind and each shape its entry certifies, the listed row counts
    from the first one up to the shape's largest certified count are each covered by exactly one cell (a shape
    may stop short of the table's end: the embedded model's prompts never exceed its 4096-token context;
    beyond it `require` raises naming the nearest cell)."""
    for kind, rows_table in TABLES.items():
        for (lo, hi), name in rows_table:
            e = ENTRIES[name]
            assert e.kind == kind, f"{kind}: table points at {name} of kind {e.kind}"
            # a shape certified twice, plain and with its K/V rotated (kv.write / attn.paged on rotated NVFP4
            # layers: config "rotate"), has one cell per row count in each variant
            for shape, rot in {(c.shape, _rotated(c)) for c in e.cells}:
                same = [c for c in e.cells if c.shape == shape and _rotated(c) == rot]
                top = max(c.rows[1] for c in same)
                assert top >= min(hi, 48), f"{kind}: shape {shape} stops at rows {top}, inside the decode range"
                for r in range(lo, min(hi, top) + 1):
                    n = sum(c.covers(r, shape) for c in same)
                    assert n == 1, f"{kind}: rows {r} shape {shape} (rotated {rot}) covered by {n} cells of {name}"


def test_every_entry_is_dispatched_and_cells_inside_the_table() -> None:
    """Claims test, catalog -> table: no entry or cell is certified but unreachable."""
    listed = {name: rng for t in TABLES.values() for rng, name in t}
    assert set(listed) == set(ENTRIES), f"entries without a table row: {set(ENTRIES) - set(listed)}"
    for name, e in ENTRIES.items():
        lo, hi = listed[name]
        for c in e.cells:
            assert lo <= c.rows[0] and c.rows[1] <= hi, f"{name}: cell rows {c.rows} outside table {lo}-{hi}"


def test_tables_ranges_are_disjoint_and_sorted() -> None:
    for kind, t in TABLES.items():
        prev = 0
        for (lo, hi), _ in t:
            assert prev < lo <= hi, f"{kind}: ranges overlap or are unsorted"
            prev = hi


def test_dispatch_module_reads_no_environment() -> None:
    src = open(dispatch.__file__).read()
    assert "os.environ" not in src and "getenv" not in src
