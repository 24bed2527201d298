"""The kernel plan (targets.plan): resolved once at build (its spans answer what dispatch.lookup answers for every
row count), bound modules launch without any catalog lookup, explain prints the bound plan itself, warm-up
compiles exactly its cells, and require raises at build naming the module, its rows and the nearest cell."""

from __future__ import annotations

import pytest
import torch

from m3serve.kernels import catalog
from m3serve.model.loader import load_model
from m3serve.targets import dispatch, explain, plan, routing
from m3serve.targets.dispatch import TABLES, lookup, resolve


def _tiny_nvfp4():
    """The tiny preset with NVFP4 weights kept quantized: its MoE layers lie in moe.grouped's tiny cells (the
    interpreter runs them on CPU), its other modules in no certified cell (stock)."""
    return load_model("tiny", device="cpu", dtype=torch.bfloat16, random_weights=True, quantization="nvfp4", seed=0,
                      keep_quantized=True)


def test_resolved_spans_answer_what_lookup_answers():
    """For every kind, every certified shape and the row counts around each cell edge and table range (plus
    1-299 and past the last range): the span holding the row names lookup's entry and the cell cell_for picks."""
    entries = catalog.all_entries()
    checked = 0
    for kind, table in TABLES.items():
        cells = [c for _, name in table for c in entries[name].cells]
        rows = set(range(1, 300)) | {16384, 16385, 10**6}
        rows |= {c.rows[i] + d for c in cells for i in (0, 1) for d in (-1, 0, 1)}
        rows |= {r + d for (lo, hi), _ in table for r in (lo, hi) for d in (-1, 0, 1)}
        for shape in {c.shape for c in cells} | {(7,)}:
            spans = resolve(kind, shape, entries)
            assert spans[0].lo == 1 and spans[-1].hi == dispatch.END
            assert all(a.hi + 1 == b.lo for a, b in zip(spans, spans[1:])), "spans tile the rows without gaps"
            route = plan.Route(kind, shape, spans)
            for r in sorted(x for x in rows if x >= 1):
                span = route.span(r)
                assert span.lo <= r <= span.hi
                want = lookup(kind, r, shape, "auto")
                assert (span.entry if span.cell is not None else None) is want, (kind, shape, r)
                if want is not None:
                    assert span.cell is want.cell_for(r, shape)
                else:
                    with pytest.raises(ValueError) as e:
                        lookup(kind, r, shape, "require")
                    assert route.detail(r) == str(e.value)
                checked += 1
    assert checked > 10_000


def test_a_bound_forward_looks_nothing_up(monkeypatch):
    """After install, a routed forward (the interpreter on CPU, the CUDA gate opened) launches its bound cells
    with the catalog, the tables and the resolver all made to raise: the plan was resolved once, at build."""
    model = _tiny_nvfp4()
    ids = torch.tensor([1, 7, 9, 30, 31])
    from m3serve.model.m3 import ForwardBatch, SeqSpan
    batch = lambda: ForwardBatch(ids, torch.arange(5), [SeqSpan(0, 5, 5)])  # noqa: E731
    with torch.no_grad():
        stock = model(batch())
    routing.install(model, "auto", max_rows=16)
    fired = []
    for name, kind, launch in routing.launches(model):
        run = launch.run
        launch.run = lambda *a, _run=run, _n=name, _k=kind, _c=launch.cell, **k: fired.append((_n, _k, _c.rows)) \
            or _run(*a, **k)

    def forbidden(*a, **k):
        raise AssertionError("a call reached the catalog after the plan was bound")

    for mod, attr in ((dispatch, "lookup"), (dispatch, "resolve"), (dispatch, "all_entries"), (plan, "resolve"),
                      (plan, "all_entries"), (catalog, "all_entries")):
        monkeypatch.setattr(mod, attr, forbidden)
    monkeypatch.setattr(routing, "_routes", lambda t: True)
    with torch.no_grad():
        got = model(batch())
    moes = [name for name, m in model.named_modules() if type(m).__name__ == "MoE"]
    assert sorted(fired) == sorted((n, "moe.grouped", (1, 64)) for n in moes)
    # moe.grouped vs the stock MoE: a few bf16 ulps of each layer's output (test_moe_grouped); the logits of the
    # tiny random model move by far less than their scale unless a layer ran wrongly
    assert torch.isfinite(got).all()
    assert (got - stock).abs().max() <= 0.05 * stock.abs().max()


def test_explain_prints_the_bound_plan(monkeypatch):
    """module_placements of an installed model reads the bound plan object (building another one raises here) and
    each line names the entry and cell of that plan's span at the bucket."""
    model = _tiny_nvfp4()
    bound = routing.install(model, "auto")
    monkeypatch.setattr(explain, "build_plan", lambda *a, **k: pytest.fail("explain re-derived the plan"))
    for bucket in (1, 8, 70):
        lines = {p.module: p for p in explain.module_placements(model, bucket)}
        assert lines == {p.module: p for p in explain.plan_placements(bound, bucket)}
        for mp in bound.modules:
            for route in mp.routes.values():
                if route.kind.startswith("qkv.") or route.kind == "linear.bf16":
                    continue     # printed as `<attention>.qkv` / `.index_qk` only where the fused projection runs
                if route.kind in ("head.head12", "head.head12_logits"):
                    continue     # printed in head.bf16's / cuBLAS's place where it serves and bind kept the tiles
                name = mp.name if mp.role in ("linear", "mlp", "moe") else f"{mp.name} [{route.kind}]"
                p, want = lines[name], route.span(bucket)
                assert p.entry == (want.entry.name if want.cell is not None else None), name
                assert p.detail == route.detail(bucket), name
    assert lines["layers.1.mlp"].entry == "moe.grouped" and "65-1024" in lines["layers.1.mlp"].detail   # bucket 70


def test_warmup_compiles_exactly_the_plans_cells():
    """warm_calls: one call per moe.grouped cell (a row-count-agnostic entry) and shape the plan reaches within
    max_rows, at the cell's first row count; nothing for cells past max_rows or for dense all-experts layers."""
    model = _tiny_nvfp4()
    bound = routing.install(model, "auto")
    cells = {(route.kind, route.shape, span.cell.rows) for _, _, route, span in bound.cells(2048)}
    assert cells == {("moe.grouped", (0, 8, 128, 64, 2), r) for r in ((1, 64), (65, 1024), (1025, 16384))}
    assert routing.warm_calls(bound, 2048) == [("layers.1.mlp", 1), ("layers.1.mlp", 65), ("layers.1.mlp", 1025)]
    assert routing.warm_calls(bound, 64) == [("layers.1.mlp", 1)]
    dense = load_model("tiny", device="cpu", dtype=torch.bfloat16, random_weights=True, seed=0)
    dense_plan = routing.install(dense, "auto")
    assert "moe.all_experts" in {mp.role for mp in dense_plan.modules}
    assert routing.warm_calls(dense_plan, 2048) == []


def test_require_raises_at_build_naming_the_module(monkeypatch):
    """On a CUDA model, require checks the rows 1..max_rows at build: the first module outside every certified
    cell is named with its kind, rows and the nearest cell. Without max_rows nothing is promised (a call raises);
    auto plans the same model without raising."""
    model = _tiny_nvfp4()
    monkeypatch.setattr(plan, "_device", lambda m: torch.device("cuda"))
    with pytest.raises(ValueError, match=r"route='require': layers\.0\.input_norm \(norm\.rms\) rows 1-4 of the 1-4 "
                                         r".*outside the certified cells; norm\.rms: rows 1 shape \(128,\).*nearest"):
        plan.build_plan(model, "require", max_rows=4)
    assert plan.build_plan(model, "require").mode == "require"
    assert plan.build_plan(model, "auto", max_rows=4).max_rows == 4


def test_a_covered_require_plan_builds(monkeypatch):
    """require builds where every reachable row is certified: a tiny MoE layer without its shared expert
    (moe.grouped's tiny cells hold 1-16384 rows)."""
    model = _tiny_nvfp4()
    monkeypatch.setattr(plan, "_device", lambda m: torch.device("cuda"))
    moe = model.layers[1].mlp
    moe.shared = None
    p = plan.build_plan(torch.nn.Sequential(moe), "require", max_rows=2048)
    assert [(m.name, m.role, tuple(m.routes)) for m in p.modules] == [("0", "moe", ("grouped",))]


def test_row_table_returns_the_prepared_launch():
    """A bound route maps every row of a cell to the same prepared Launch (made once, at bind) and rows no cell
    serves to None (auto) or a raise naming the module (require)."""
    model = _tiny_nvfp4()
    p = plan.build_plan(model, "auto")
    route = p.module("layers.1.mlp").routes["grouped"]
    table = routing.RowTable(route, "layers.1.mlp", "auto")
    assert table(1) is table(64) and table(65) is table(1024) and table(1) is not table(65)
    assert table(20000) is None
    strict = routing.RowTable(route, "layers.1.mlp", "require")
    with pytest.raises(ValueError, match=r"layers\.1\.mlp: require mode, but moe\.grouped: rows 20000 .* outside"):
        strict(20000)
