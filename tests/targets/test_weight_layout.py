"""NVFP4 and MXFP8 weights in the MMA tile layout on the decode target (targets.routing.set_weight_layout): which linears
are re-laid out (an MoE layer's experts and NVFP4 shared expert together, or not at all), in place and reversibly,
with the stock path reading either layout bit for bit, and the bound kernels told each module's layout."""

from __future__ import annotations

import pytest
import torch

from dataclasses import replace

from m3serve import config
from m3serve.model.loader import load_model
from m3serve.model.m3 import ForwardBatch, SeqSpan
from m3serve.model.moe import MoE
from m3serve.model.layers import Linear
from m3serve.targets import routing


@pytest.fixture
def tileable_preset(monkeypatch):
    """The tiny preset with a hidden size of 256 and expert widths of 256, so its MoE layers' NVFP4 weights have the
    tile layout (the tiny preset's 64 does not: K % 128) and span two column steps (whose bytes it permutes)."""
    monkeypatch.setitem(config.PRESETS, "tiny-tiles",
                        lambda: replace(config.preset("tiny"), hidden_size=256, intermediate_size=256,
                                        shared_intermediate_size=256))
    return "tiny-tiles"


def _nvfp4(name: str = "tiny"):
    """NVFP4 as M3 publishes it: experts and shared experts NVFP4, attention and dense MLPs MXFP8."""
    return load_model(name, device="cpu", dtype=torch.bfloat16, random_weights=True, quantization="nvfp4", seed=0,
                      keep_quantized=True)


def _linears(model, fmts=("nvfp4", "mxfp8")) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear) and m.fmt in fmts}


def _forward(model):
    ids = torch.tensor([1, 7, 9, 30, 31])
    with torch.no_grad():
        return model(ForwardBatch(ids, torch.arange(5), [SeqSpan(0, 5, 5)]))


def test_layouts_follow_the_groups_and_the_stock_path_reads_both(tileable_preset):
    model = _nvfp4(tileable_preset)
    lins = _linears(model)
    before = {n: tuple(t.view(torch.uint8).clone() for t in m._row_tensors()) for n, m in lins.items()}
    stock = _forward(model)
    tiled = routing.set_weight_layout(model, "mma_tile")
    # NVFP4: 3 MoE layers' w13, w2, shared gate|up and down; MXFP8: every attention and dense-MLP linear
    assert len(_linears(model, ("nvfp4",))) == 4 * 3 and len(_linears(model, ("mxfp8",))) > 12
    assert tiled == len(lins)
    for n, m in lins.items():
        w, _ = m._row_tensors()
        assert m.q_layout == "mma_tile" and not torch.equal(w.view(torch.uint8), before[n][0]), n
    assert torch.equal(_forward(model), stock)             # the stock path untiles: the same bits
    routing.set_weight_layout(model, "rows")
    for n, (p, s) in before.items():
        m = lins[n]
        w, sc = m._row_tensors()
        assert m.q_layout == "rows" and torch.equal(w.view(torch.uint8), p) and torch.equal(sc.view(torch.uint8), s)


def test_a_group_with_one_untileable_weight_stays_row_major():
    """The tiny preset's expert down projection has K = 64: its MoE layer's experts and shared expert all stay
    row-major, because moe.nvfp4 reads them under one flag."""
    model = _nvfp4()
    assert routing.set_weight_layout(model, "mma_tile") == len(_linears(model, ("mxfp8",)))   # those all tile
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert moe.w13.tileable() and not moe.w2.tileable()
    assert {m.q_layout for m in _linears(model, ("nvfp4",)).values()} == {"rows"}


def test_install_lays_out_by_device_and_mode(monkeypatch, tileable_preset):
    model = _nvfp4(tileable_preset)
    q = model.layers[1].mlp.w13
    routing.install(model, "auto")                          # a CPU model: the stock path, row-major
    assert q.q_layout == "rows"
    routing.install(model, "auto", weight_layout="mma_tile")
    assert q.q_layout == "mma_tile"
    routing.install(model, "off")                           # mode off restores the checkpoint's bytes
    assert q.q_layout == "rows"
    monkeypatch.setattr(routing, "default_weight_layout", lambda m, mode: "mma_tile" if mode != "off" else "rows")
    routing.install(model, "auto")
    assert q.q_layout == "mma_tile"


def test_the_moe_kernel_passes_the_layers_layout(monkeypatch, tileable_preset):
    """The bound moe.nvfp4 launch gets tiled=True exactly when the layer's experts are in the tile layout."""
    model = _nvfp4(tileable_preset)
    moe = model.layers[1].mlp
    routing.set_weight_layout(model, "mma_tile")
    seen = []

    class FakeLaunch:
        config = None
        workspace = {1: object()}
        cell = type("C", (), {"shape": (8, 256, 256, 0)})()

        def run(self, *a, tiled=False, **k):
            seen.append(tiled)
            a[-3].zero_()

    kernel = routing.MoEKernel(lambda rows: FakeLaunch(), None, None, "auto")
    x = torch.zeros(1, moe.w13.in_features, dtype=torch.bfloat16)
    kernel.run_nvfp4(moe, x)
    routing.set_weight_layout(model, "rows")
    kernel.run_nvfp4(moe, x)
    assert seen == [True, False]


def test_set_layout_refuses_what_the_layout_does_not_cover():
    model = _nvfp4()
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 128 == 0"):
        moe.w2.set_layout("mma_tile")
    dense = load_model("tiny", device="cpu", dtype=torch.bfloat16, random_weights=True, seed=0)
    with pytest.raises(ValueError, match="only NVFP4 and MXFP8"):
        dense.layers[0].attn.q_proj.set_layout("mma_tile")


def test_explain_says_how_a_target_run_holds_the_weights(tileable_preset):
    from m3serve.targets.explain_cli import weight_layout_line
    model = _nvfp4(tileable_preset)
    line = weight_layout_line(model)
    assert line.startswith("weights on a CUDA target run: ") and "12 nvfp4 in MMA tiles" in line
    assert f"{len(_linears(model, ('mxfp8',)))} mxfp8 in MMA tiles" in line
    assert {m.q_layout for m in _linears(model).values()} == {"rows"}     # saying so lays nothing out
    tiny = _nvfp4()                                                       # its MoE groups stay row-major
    assert "12 nvfp4 row-major (not tileable)" in weight_layout_line(tiny)
    dense = load_model("tiny", device="cpu", dtype=torch.bfloat16, random_weights=True, seed=0)
    assert weight_layout_line(dense) == "weights: no NVFP4 / MXFP8 linears (nothing to lay out)"
