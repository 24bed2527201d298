"""The MoE entries read NVFP4 (and moe.grouped MXFP8) experts in the MMA tile layout (m3serve.quant.nvfp4.tile_nvfp4) on the CPU
(interpreter): moe.nvfp4 (its tensor-core config and the CPU run of its MMA config) and moe.grouped (in-register,
decode-once and decode-ahead bands) give the same bits as on the row-major experts, and row-major experts read as
tiles give something else (the flag reaches the kernels). The PTX of the MMA step on tiles: test_mma_moe.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from m3serve.kernels.catalog import Cell
from m3serve.kernels.formats._decode import FMT_FP8, FMT_MXFP8, FMT_NVFP4
from m3serve.kernels.moe import grouped as G
from m3serve.kernels.moe import nvfp4 as M
from m3serve.kernels.moe._mma import MmaMoEConfig
from m3serve.quant.nvfp4 import untile_nvfp4
from m3serve.quant.tiles import to_layout

CPU = torch.device("cpu")


def _untiled_args(args: tuple, idx: tuple[tuple[int, int], ...]) -> tuple:
    args = list(args)
    for w, s in idx:
        args[w], args[s] = untile_nvfp4(args[w], args[s])
    return tuple(args)


def _fresh_outputs(case, out_pos: int, ws_pos: int, make_ws):
    args = list(case.args)
    args[out_pos] = torch.full_like(args[out_pos], float("nan"))
    args[ws_pos] = make_ws()
    return args


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("cfg,rows", [
    (M.MoEConfig(BT=16, BN=64, BK=64, RBE=16, RBK=64, RSPLIT=2, DSPLIT=2), 2),
    pytest.param(MmaMoEConfig(RBE=16, RBK=64, RSPLIT=2, DSPLIT=2), 1, marks=pytest.mark.slow),
], ids=["tensor-core", "mma-config-interpreted"])
def test_moe_nvfp4_reads_tiles_bit_for_bit(cfg, rows):
    e, h, i = 16, 256, 256
    cell = Cell(rows=(rows, rows), shape=(e, h, i, 0), why="test", config={"moe": cfg})
    case = M.make_case(cell, rows, CPU, torch.Generator().manual_seed(rows))
    assert case.kwargs["tiled"]
    # experts (3, 4) / (6, 7) and the NVFP4 shared expert (9, 10) / (12, 13) back to row-major
    pairs = ((3, 4), (6, 7), (9, 10), (12, 13))
    rows_args = _untiled_args(case.args, pairs)

    def run(args, tiled):
        a = list(args)
        a[16] = torch.full_like(a[16], float("nan"))
        a[17] = M.make_moe_workspace(cfg, rows, e, h, i, CPU)
        return M.moe_nvfp4(*a, tiled=tiled)

    ref = run(rows_args, False)
    got = run(case.args, True)
    assert torch.equal(_bits(got), _bits(ref))
    assert not torch.equal(_bits(run(rows_args, True)), _bits(ref))


BANDS = [
    G.GroupedConfig(BM=16, BN=32, BK=128, CBH=64, CBT=2),
    G.GroupedConfig(BM=32, BN=32, BK=128, CBH=64, CBT=8, DECODE_ONCE=True, EXPERT_GROUP=3, DEC_BN=32, DEC_BK=128),
    G.GroupedConfig(BM=32, BN=32, BK=128, CBH=64, CBT=8, DECODE_ONCE=True, EXPERT_GROUP=3, DEC_BN=32, DEC_BK=128,
                    DECODE_AHEAD=True),
]


# the decode-ahead band and MXFP8's decode-once run the kernels the other cases run, in another order or format:
# the slow tier
@pytest.mark.parametrize("fmt,cfg", [(FMT_NVFP4, BANDS[0]), (FMT_NVFP4, BANDS[1]),
                                     pytest.param(FMT_NVFP4, BANDS[2], marks=pytest.mark.slow), (FMT_MXFP8, BANDS[0]),
                                     pytest.param(FMT_MXFP8, BANDS[1], marks=pytest.mark.slow)],
                         ids=["nvfp4-in-register", "nvfp4-decode-once", "nvfp4-decode-ahead", "mxfp8-in-register",
                              "mxfp8-decode-once"])
def test_moe_grouped_reads_tiles_bit_for_bit(fmt, cfg):
    e, h, i, a, rows = 8, 256, 128, 2, 9
    cell = Cell(rows=(rows, rows), shape=(fmt, e, h, i, a), why="test", config={"moe": cfg, "shared": True})
    case = G.make_case(cell, rows, CPU, torch.Generator().manual_seed(7))
    assert case.kwargs["tiled"]
    name = G.FMT_NAMES[fmt]
    rows_args = list(case.args)
    for w, s in ((4, 5), (7, 8)):
        rows_args[w], rows_args[s] = to_layout(name, case.args[w], case.args[s], "mma_tile", "rows")
    kw = {k: v for k, v in case.kwargs.items() if k != "tiled"}

    def run(args, tiled):
        a_ = list(args)
        a_[12] = torch.full_like(a_[12], float("nan"))
        a_[13] = G.make_workspace(cfg, rows, e, h, i, a, CPU)
        return G.moe_grouped(*a_, **kw, tiled=tiled)

    ref = run(rows_args, False)
    got = run(case.args, True)
    assert torch.equal(_bits(got), _bits(ref))
    assert not torch.equal(_bits(run(rows_args, True)), _bits(ref))


def test_tiles_need_experts_the_layout_covers():
    cfg = G.GroupedConfig(BM=16, BN=32, BK=32, CBH=64, CBT=2)
    cell = Cell(rows=(2, 2), shape=(FMT_NVFP4, 8, 64, 32, 2), why="test", config={"moe": cfg, "shared": False})
    case = G.make_case(cell, 2, CPU, torch.Generator().manual_seed(1))
    assert "tiled" not in case.kwargs        # H = 64: no tile layout, the case stays row-major
    with pytest.raises(ValueError, match="tile layout"):
        G.moe_grouped(*case.args, **case.kwargs, tiled=True)
    fp8 = Cell(rows=(2, 2), shape=(FMT_FP8, 8, 256, 128, 2), why="test", config={"moe": cfg, "shared": False})
    case = G.make_case(fp8, 2, CPU, torch.Generator().manual_seed(1))
    assert "tiled" not in case.kwargs        # FP8 has no tile layout
    with pytest.raises(ValueError, match="NVFP4 and MXFP8"):
        G.moe_grouped(*case.args, **case.kwargs, tiled=True)
