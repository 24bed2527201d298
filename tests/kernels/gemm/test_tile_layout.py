"""The MMA tile layout of NVFP4 and MXFP8 weights (m3serve.quant.tiles) read by every linear.nvfp4 / linear.mxfp8
config (GEMV, tensor-core, the MMA GEMV's CPU run, tiled prefill, decode-once) on the CPU (interpreter): the same
bits out as the row-major weight, and reading a row-major weight as tiled gives a different answer (so the flag
reaches the kernels)."""

from __future__ import annotations

import pytest
import torch

from m3serve.kernels.gemm import mxfp8 as LM, nvfp4 as LN
from m3serve.kernels.gemm._gemm_tiles import GemmConfig, make_workspace
from m3serve.kernels.gemm._linear import fresh_x
from m3serve.kernels.gemm._mma_gemv import MmaGemvConfig
from m3serve.kernels.gemm._tiled import TiledGemmConfig
from m3serve.kernels.gemm._gemv import GemvConfig
from m3serve.kernels.catalog import poisoned
from m3serve.quant.mxfp8 import tile_mxfp8
from m3serve.quant.nvfp4 import tile_nvfp4, untile_nvfp4
from m3serve.quant.tiles import tileable, to_layout

N, K = 64, 256


def _run(cfg, rows, packed, scale, gs, x, tiled):
    out = poisoned((rows, N), torch.bfloat16, torch.device("cpu"))
    ws = make_workspace(cfg, N, torch.device("cpu"))
    return LN.nvfp4_linear(x, packed, scale, gs, out, ws, cfg, tiled=tiled)


CONFIGS = [
    (GemmConfig(BM=16, BN=64, BK=128, SPLIT=1), 3),
    (GemmConfig(BM=16, BN=32, BK=128, SPLIT=2), 9),
    (MmaGemvConfig(SPLIT=2, RP=1, num_warps=2), 1),          # the CPU runs its tiles through _wstream
    (TiledGemmConfig(BM=16, BN=32, BK=64, num_warps=4), 20),
    (TiledGemmConfig(BM=16, BN=64, BK=128, DEQUANT_MM=True), 33),
    (GemvConfig(BM=1, BN=16, BK=128, SPLIT=2), 1),
]


@pytest.mark.parametrize("cfg,rows", CONFIGS, ids=lambda v: type(v).__name__ if not isinstance(v, int) else str(v))
def test_every_linear_config_reads_the_tile_layout_bit_for_bit(cfg, rows):
    gen = torch.Generator().manual_seed(rows)
    packed, scale, gs = LN.random_nvfp4_weight(N, K, torch.device("cpu"), gen)
    x = fresh_x(rows, K, torch.device("cpu"), gen)
    ref = _run(cfg, rows, packed, scale, gs, x, tiled=False)
    tp, ts = tile_nvfp4(packed, scale)
    got = _run(cfg, rows, tp, ts, gs, x, tiled=True)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    wrong = _run(cfg, rows, packed, scale, gs, x, tiled=True)   # row-major bytes read as tiles
    assert not torch.equal(wrong.view(torch.int16), ref.view(torch.int16))


MX_CONFIGS = CONFIGS + [(GemvConfig(BM=2, BN=32, BK=256, SPLIT=1), 2)]


@pytest.mark.parametrize("cfg,rows", MX_CONFIGS, ids=lambda v: type(v).__name__ if not isinstance(v, int) else str(v))
def test_every_mxfp8_config_reads_the_tile_layout_bit_for_bit(cfg, rows):
    gen = torch.Generator().manual_seed(100 + rows)
    q = LM.random_e4m3((N, K), gen, torch.device("cpu"))
    scale = torch.randint(112, 136, (N, K // 32), generator=gen, dtype=torch.uint8)
    x = fresh_x(rows, K, torch.device("cpu"), gen)

    def run(q_, s_, tiled):
        out = poisoned((rows, N), torch.bfloat16, torch.device("cpu"))
        return LM.mxfp8_linear(x, q_, s_, out, make_workspace(cfg, N, torch.device("cpu")), cfg, tiled=tiled)

    ref = run(q, scale, False)
    tq, ts = tile_mxfp8(q, scale)
    assert torch.equal(run(tq, ts, True).view(torch.int16), ref.view(torch.int16))
    assert not torch.equal(run(q, scale, True).view(torch.int16), ref.view(torch.int16))


def test_tiles_are_a_permutation_inside_blocks_of_16_rows_and_128_columns():
    gen = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (2, 32, 128), generator=gen, dtype=torch.uint8)
    scale = torch.randint(0, 127, (2, 32, 16), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    tp, ts = tile_nvfp4(packed, scale)
    up, us = untile_nvfp4(tp, ts)
    assert torch.equal(up, packed) and torch.equal(us.view(torch.uint8), scale.view(torch.uint8))
    assert not torch.equal(tp, packed)
    # a whole block keeps its bytes: block (rb=1, ks=1) of expert 1 is rows 16..31, bytes 64..127
    blk = packed[1, 16:32, 64:128]
    assert torch.equal(tp[1].reshape(-1)[16 * 128 + 1024:16 * 128 + 2048].sort().values, blk.reshape(-1).sort().values)
    # row 16 rb + 8 h + g, bytes 64 ks + 16 c .. + 15 sit at lane 4 g + c of half h
    g, c, h = 5, 2, 1
    row, off = 16 + 8 * h + g, 16 * 128 + 1024 + h * 512 + (4 * g + c) * 16
    assert torch.equal(tp[1].reshape(-1)[off:off + 16], packed[1, row, 64 + 16 * c:64 + 16 * c + 16])
    # scales: groups 8 ks + 2 c, + 1 of that row at [g, c, h, 2] of the block's 128 B
    soff = 16 * 16 + 128 + g * 16 + c * 4 + h * 2
    assert torch.equal(ts[1].view(torch.uint8).reshape(-1)[soff:soff + 2],
                       scale[1, row, 8 + 2 * c:8 + 2 * c + 2].view(torch.uint8))
    assert to_layout("nvfp4", packed, scale, "rows", "rows")[0] is packed
    with pytest.raises(ValueError, match="layout"):
        to_layout("nvfp4", packed, scale, "rows", "cols")
    assert not tileable("nvfp4", packed[:, :24], scale[:, :24]) and not tileable("fp8", packed, scale)
    with pytest.raises(ValueError, match="N % 16"):
        tile_nvfp4(packed[:, :24], scale[:, :24])


def test_kernels_refuse_tiles_the_layout_does_not_define():
    from m3serve.kernels.gemm._gemm_tiles import check_tiled
    check_tiled(True, 0, 64, 256)
    check_tiled(True, 1, 64, 256)
    check_tiled(False, 2, 7, 9)                                   # row-major: anything goes
    with pytest.raises(ValueError, match="NVFP4 and MXFP8"):
        check_tiled(True, 2, 64, 256)                             # FP8 has no tile layout
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 128 == 0"):
        check_tiled(True, 0, 64, 192)
    packed, scale, gs = LN.random_nvfp4_weight(N, 192, torch.device("cpu"), torch.Generator().manual_seed(0))
    x = fresh_x(1, 192, torch.device("cpu"), torch.Generator().manual_seed(1))
    cfg = GemmConfig(BM=16, BN=64, BK=64, SPLIT=1)
    with pytest.raises(ValueError, match="K % 128"):
        LN.nvfp4_linear(x, packed, scale, gs, poisoned((1, N), torch.bfloat16, torch.device("cpu")),
                        make_workspace(cfg, N, torch.device("cpu")), cfg, tiled=True)
