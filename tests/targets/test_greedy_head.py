"""The model's greedy head (targets.routing.HeadKernel on head.head12 for 1-8 rows, head.bf16 above): planned for a
dense bf16 head on one rank, bound by install (the 12-bit tiles bit-checked there, a refused head kept on head.bf16),
and its ids equal the stock path's argmax of the bf16 logits (the Triton interpreter and the PTX emulator on CPU,
with cells for the tiny head's shape and the CUDA gate opened)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from m3serve.kernels.catalog import Cell
from m3serve.kernels.head import bf16 as HB
from m3serve.model.loader import load_model
from m3serve.targets import explain, routing


def _tiny(**kw):
    return load_model("tiny", device="cpu", dtype=torch.bfloat16, random_weights=True, seed=0, **kw)


def _with_tiny_cell(monkeypatch, model):
    v, k = model.lm_head.out_features, model.lm_head.in_features
    cell = Cell(rows=(1, 16), shape=(v, k), why="test: the tiny head", config={"head": HB.HeadConfig(BM=16)})
    monkeypatch.setattr(HB, "ENTRIES", (dataclasses.replace(HB.ENTRY, cells=HB.CELLS + (cell,)),))


def test_the_plan_routes_a_bf16_heads_greedy_rows_and_keeps_its_logits_on_cublas():
    model = _tiny()
    plan = routing.install(model, "auto")
    head = plan.module("lm_head")
    assert head.role == "head" and head.routes["greedy"].kind == "head.bf16"
    assert model.lm_head.kernel is None                 # the logits: F.linear
    assert isinstance(model.greedy_head, routing.HeadKernel)
    lines = {p.module: p for p in explain.module_placements(model, 1)}
    assert lines["lm_head"].entry == "torch:F.linear"
    assert lines["lm_head [head.bf16]"].entry is None    # no cell for the tiny vocabulary: logits + argmax
    routing.install(model, "off")
    assert model.greedy_head is None


def test_no_greedy_head_for_a_quantized_or_fp32_head():
    fp32 = load_model("tiny", device="cpu", dtype=torch.float32, random_weights=True, seed=0)
    assert "head" not in {mp.role for mp in routing.install(fp32, "auto").modules}
    assert fp32.greedy_head is None


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_greedy_tokens_equal_argmax_of_the_stock_logits(monkeypatch, rows):
    model = _tiny()
    _with_tiny_cell(monkeypatch, model)
    routing.install(model, "auto")
    monkeypatch.setattr(routing, "_routes", lambda t: True)
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, model.cfg.hidden_size, generator=g).to(torch.bfloat16)
    # an exact tie: row 0's winner copied to another vocabulary row (equal logits: the smaller index must win)
    with torch.no_grad():
        j = int(model.logits(h[:1]).argmax(-1))
        model.lm_head.weight[(j + 200) % model.lm_head.out_features] = model.lm_head.weight[j]
    fired = []
    launch = model.greedy_head.table(rows)
    run = launch.run
    launch.run = lambda *a: fired.append(a[0].shape[0]) or run(*a)
    with torch.no_grad():
        stock = model.logits(h).argmax(-1)
        got = model.greedy_tokens(h)
    assert fired == [rows]
    assert got.dtype == torch.int64 and torch.equal(got, stock)
    # rows without a cell (17) take the logits
    with torch.no_grad():
        h17 = torch.randn(17, model.cfg.hidden_size, generator=g).to(torch.bfloat16)
        assert torch.equal(model.greedy_tokens(h17), model.logits(h17).argmax(-1))
    assert fired == [rows]


def _with_tiny_head12_cell(monkeypatch, model):
    from m3serve.kernels.head import head12 as H12
    from m3serve.kernels.head._head12_mma import Head12MmaConfig
    from m3serve.targets import plan as plan_mod
    v, k = model.lm_head.out_features, model.lm_head.in_features
    cell = Cell(rows=(1, 8), shape=(v, k), why="test: the tiny head as head12",
                config={"head": Head12MmaConfig(BN_REDUCE=128)})
    monkeypatch.setattr(H12, "ENTRIES", (dataclasses.replace(H12.ENTRY, cells=H12.CELLS + (cell,)), H12.LOGITS_ENTRY))
    monkeypatch.setattr(plan_mod, "HEAD12", True)


@pytest.mark.parametrize("rows", [1, 8])
def test_head12_takes_rows_1_to_8_and_the_bf16_head_the_rest(monkeypatch, rows):
    model = _tiny()
    _with_tiny_cell(monkeypatch, model)
    _with_tiny_head12_cell(monkeypatch, model)
    plan = routing.install(model, "auto")
    assert plan.module("lm_head").routes["greedy12"].kind == "head.head12"
    head = model.greedy_head
    assert head.tiles is not None and head.table12 is not None
    monkeypatch.setattr(routing, "_routes", lambda t: True)
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, model.cfg.hidden_size, generator=g).to(torch.bfloat16)
    fired, wrapped = {}, set()
    for name, table in (("head12", head.table12), ("bf16", head.table)):
        for launch in table.launches():
            if id(launch) not in wrapped:
                wrapped.add(id(launch))
                run = launch.run
                launch.run = lambda *a, run=run, name=name: fired.setdefault(name, []).append(a[0].shape[0]) or run(*a)
    with torch.no_grad():
        assert torch.equal(model.greedy_tokens(h), model.logits(h).argmax(-1))
        h9 = torch.randn(9, model.cfg.hidden_size, generator=g).to(torch.bfloat16)
        assert torch.equal(model.greedy_tokens(h9), model.logits(h9).argmax(-1))
    assert fired == {"head12": [rows], "bf16": [9]}


def test_a_head_the_12_bit_layout_refuses_keeps_the_bf16_head(monkeypatch, caplog):
    model = _tiny()
    _with_tiny_cell(monkeypatch, model)
    _with_tiny_head12_cell(monkeypatch, model)
    with torch.no_grad():
        model.lm_head.weight[:16, :128] = 2.0 ** 100   # a tile whose base the MMA head's step scale cannot express
    with caplog.at_level("WARNING"):
        routing.install(model, "auto")
    assert model.greedy_head.tiles is None and model.greedy_head.table12 is None
    assert "MMA layout refused" in caplog.text and "tile_base[0, 0]" in caplog.text


def test_explain_names_the_head_that_serves_each_bucket(monkeypatch):
    model = _tiny()
    _with_tiny_cell(monkeypatch, model)
    _with_tiny_head12_cell(monkeypatch, model)
    routing.install(model, "auto")
    kinds = {b: {p.module for p in explain.module_placements(model, b)} for b in (8, 9)}
    assert "lm_head [head.head12]" in kinds[8] and "lm_head [head.bf16]" in kinds[9]
    model.greedy_head.table12 = None         # as when bind's bit check refused the tiles
    assert "lm_head [head.bf16]" in {p.module for p in explain.module_placements(model, 8)}


def _with_tiny_head12_logits_cell(monkeypatch, model):
    from m3serve.kernels.head import head12 as H12
    from m3serve.kernels.head._head12_mma import Head12MmaConfig
    from m3serve.targets import plan as plan_mod
    v, k = model.lm_head.out_features, model.lm_head.in_features
    greedy = Cell(rows=(1, 8), shape=(v, k), why="test: the tiny head as head12",
                  config={"head": Head12MmaConfig(BN_REDUCE=128)})
    logits = dataclasses.replace(greedy, why="test: the tiny head's head12 logits")
    monkeypatch.setattr(H12, "ENTRIES", (dataclasses.replace(H12.ENTRY, cells=H12.CELLS + (greedy,)),
                                         dataclasses.replace(H12.LOGITS_ENTRY, cells=H12.LOGITS_CELLS + (logits,))))
    monkeypatch.setattr(plan_mod, "HEAD12", True)
    monkeypatch.setattr(plan_mod, "HEAD12_LOGITS", True)


def test_head12_logits_switched_off_keep_the_logits_on_cublas(monkeypatch):
    from m3serve.targets import plan as plan_mod
    model = _tiny()
    _with_tiny_head12_logits_cell(monkeypatch, model)
    monkeypatch.setattr(plan_mod, "HEAD12_LOGITS", False)
    plan = routing.install(model, "auto")
    assert "logits12" not in plan.module("lm_head").routes and model.lm_head.kernel is None
    assert plan_mod.HEAD12 and "greedy12" in plan.module("lm_head").routes


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_head12_logits_serve_rows_1_to_8_within_the_gemm_band_of_the_stock_logits(monkeypatch, rows):
    from m3serve.kernels.catalog import assert_band, gemm_band, true_fp32
    model = _tiny()
    _with_tiny_head12_logits_cell(monkeypatch, model)
    plan = routing.install(model, "auto")
    assert plan.module("lm_head").routes["logits12"].kind == "head.head12_logits"
    kernel = model.lm_head.kernel
    assert isinstance(kernel, routing.HeadLogitsKernel) and kernel.tiles is not None
    assert ("lm_head", rows) in routing.warm_calls(plan, 8)        # compiled before serving
    monkeypatch.setattr(routing, "_routes", lambda t: True)
    fired = []
    for launch in kernel.table.launches():
        run = launch.run
        launch.run = lambda *a, run=run: fired.append(a[0].shape[0]) or run(*a)
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, model.cfg.hidden_size, generator=g).to(torch.bfloat16)
    w = model.lm_head.weight
    with torch.no_grad():
        got = model.logits(h)                      # fp32 of the bf16 logits, through the bound kernel
        h9 = torch.randn(9, model.cfg.hidden_size, generator=g).to(torch.bfloat16)
        stock9 = (h9 @ w.T).float()
        got9 = model.logits(h9)                    # 9 rows: no cell, cuBLAS (here torch's CPU GEMM)
    assert fired == [rows] and got.shape == (rows, w.shape[0])
    with true_fp32():
        ref = h.float() @ w.float().T
        absprod = h.float().abs() @ w.float().abs().T
    assert_band("lm_head logits", got, ref, gemm_band(ref, absprod, h.shape[1]))
    # bf16 values (rounded once), as the stock head returns
    assert torch.equal(got, got.to(torch.bfloat16).float())
    assert torch.equal(got9, stock9)
    lines = {p.module: p for p in explain.module_placements(model, rows)}
    assert lines["lm_head [head.head12_logits]"].entry == "head.head12_logits"
    assert "lm_head" not in lines                  # the cuBLAS line gives way where the 12-bit logits serve
