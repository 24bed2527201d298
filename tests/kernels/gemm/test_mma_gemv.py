"""The register-operand MMA GEMV (m3serve/kernels/gemm/_mma_gemv.py) on the CPU.

Its inline PTX cannot run under the Triton interpreter, so these tests execute the very PTX text that is
compiled (asm_args), on the warp-level emulator (_ptx_emu), through the kernel's own step logic (emulate), and
check the result against each entry's reference with the entry's own band (gemm_band: one bf16 ulp + the fp32
summation bound; the decoded weights are exact, so nothing else may differ). Every output starts as NaN, so an
unwritten element fails. Compiled checks (no GPU needed): every certified MMA cell builds for sm_90 without
spills, and its register bundles hold exactly 2 elements per thread (one asm invocation each).
"""

from __future__ import annotations

import re

import pytest
import torch

from m3serve.kernels.gemm import _mma_gemv as G
from m3serve.kernels.gemm import _mma_ptx as P
from m3serve.kernels.gemm import mxfp8 as LM
from m3serve.kernels.gemm import nvfp4 as LN
from m3serve.kernels.catalog import Case
from m3serve.quant.mxfp8 import tile_mxfp8
from m3serve.quant.nvfp4 import tile_nvfp4

CPU = torch.device("cpu")

# (fmt, RP, warps, SPLIT, rows, STAGES, per-row global scale)
CASES = [
    (0, 1, 1, 1, 1, 2, False),
    (0, 2, 2, 2, 5, 3, True),
    (0, 1, 2, 2, 8, 2, False),
    (0, 2, 1, 1, 3, 3, True),
    (1, 1, 2, 1, 8, 3, False),
    (1, 1, 1, 2, 2, 2, False),
    (1, 1, 2, 2, 4, 3, False),
]


def _run(fmt: int, cfg: G.MmaGemvConfig, rows: int, per_row: bool, gen: torch.Generator, k_steps: int = 2):
    n, k = cfg.BN * 2, G.STEP * k_steps * cfg.SPLIT
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    x[:, torch.randint(0, k, (4,), generator=gen)] *= 20.0  # a few large columns, as fresh_x
    if fmt == P.FMT_NVFP4:
        packed, scale, gs = LN.random_nvfp4_weight(n, k, CPU, gen)
        if per_row:
            gs = (gs * (0.5 + torch.rand(n, generator=gen))).contiguous()
        y = G.emulate(x, packed.view(torch.int32), scale.view(torch.uint8), gs.reshape(-1), 1 if per_row else 0,
                      fmt=fmt, alpha_mode=2, n=n, k=k, cfg=cfg)
        case = Case(args=(x, packed, scale, gs), kwargs={}, bytes_moved=0)
        return y, LN.nvfp4_linear_reference(x, packed, scale, gs), LN.compare, case
    q = LM.random_e4m3((n, k), gen, CPU)
    sc = torch.randint(110, 136, (n, k // 32), generator=gen, dtype=torch.uint8)
    sc[0, 0], sc[1, 0] = 0, 1  # the E8M0 edge codes: 0 -> the subnormal 2**-127, 1 -> 2**-126
    y = G.emulate(x, q.view(torch.uint8), sc, torch.ones(1), 0, fmt=fmt, alpha_mode=0, n=n, k=k, cfg=cfg)
    return y, LM.mxfp8_linear_reference(x, q, sc), LM.compare, Case(args=(x, q, sc), kwargs={}, bytes_moved=0)


@pytest.mark.parametrize("fmt,rp,warps,split,rows,stages,per_row", CASES)
def test_emulated_ptx_matches_the_reference(fmt, rp, warps, split, rows, stages, per_row) -> None:
    cfg = G.MmaGemvConfig(SPLIT=split, RP=rp, num_warps=warps, STAGES=stages)
    y, ref, compare, case = _run(fmt, cfg, rows, per_row, torch.Generator().manual_seed(1000 + rows + 7 * split))
    assert y.shape == ref.shape and bool(torch.isfinite(y.float()).all())
    compare(y, ref, case)


def _with_patched_block(monkeypatch, key: str, edit) -> None:
    """asm_args with one PTX block edited (the emulator then runs the wrong text)."""
    real = G.asm_args.__wrapped__

    def patched(*a):
        args = dict(real(*a))
        args[key] = edit(args[key])
        return args

    monkeypatch.setattr(G, "asm_args", patched)


def test_x_from_the_wrong_columns_is_caught(monkeypatch) -> None:
    """Lane c reading x 64 bytes off (its neighbour's columns) must fail the band."""
    _with_patched_block(monkeypatch, "XLOAD", lambda t: t.replace("shl.b32 cb, c, 6;", "shl.b32 cb, c, 5;"))
    cfg = G.MmaGemvConfig(SPLIT=1, RP=1, num_warps=2, STAGES=2)
    y, ref, compare, case = _run(P.FMT_NVFP4, cfg, 2, False, torch.Generator().manual_seed(5))
    with pytest.raises(AssertionError):
        compare(y, ref, case)


def test_a_wrong_fragment_order_is_caught(monkeypatch) -> None:
    """Swapping the two x halves of the B fragment (a plausible layout slip) must fail the band."""
    _with_patched_block(monkeypatch, "MMA", lambda t: t.replace("0x5410;", "0x7632_;").replace("0x7632;", "0x5410;")
                        .replace("0x7632_;", "0x7632;"))
    cfg = G.MmaGemvConfig(SPLIT=1, RP=1, num_warps=1, STAGES=2)
    y, ref, compare, case = _run(P.FMT_NVFP4, cfg, 1, False, torch.Generator().manual_seed(6))
    with pytest.raises(AssertionError):
        compare(y, ref, case)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"MmaGemvConfig.RP: expected one of \(1, 2\), found 3"):
        G.MmaGemvConfig(SPLIT=1, RP=3)
    with pytest.raises(ValueError, match=r"MmaGemvConfig.STAGES: expected 2 or 3, found 4"):
        G.MmaGemvConfig(SPLIT=1, STAGES=4)
    with pytest.raises(ValueError, match=r"MmaGemvConfig.SPLIT: expected a power of two, found 3"):
        G.MmaGemvConfig(SPLIT=3)
    with pytest.raises(ValueError, match=r"BM and BK are fixed at 8 and 128"):
        G.MmaGemvConfig(SPLIT=1, BM=16)
    with pytest.raises(ValueError, match=r"MXFP8 serves RP=1 only"):
        G.MmaGemvConfig(SPLIT=1, RP=2).check_format(P.FMT_MXFP8)


def test_launch_refuses_cpu_tensors_and_unaligned_x() -> None:
    cfg = G.MmaGemvConfig(SPLIT=1, RP=1, num_warps=1)
    from m3serve.kernels.gemm._gemm_tiles import make_workspace
    w = torch.zeros(32, 32, dtype=torch.int32)
    s = torch.zeros(32, 16, dtype=torch.uint8)
    ws = make_workspace(cfg, 32, CPU)
    with pytest.raises(ValueError, match=r"x: the MMA GEMV runs compiled only"):
        G.launch_mma_gemv(torch.zeros(1, 256, dtype=torch.bfloat16), w, s, torch.ones(1), 0,
                          torch.zeros(1, 32, dtype=torch.bfloat16), ws, fmt=0, alpha_mode=2, n=32, k=256, cfg=cfg)
    meta = torch.device("meta")
    x = torch.empty(2, 260, dtype=torch.bfloat16, device=meta)[:, :256]  # row stride 260 elements = 520 bytes
    with pytest.raises(ValueError, match=r"x: the MMA GEMV reads 16-byte vectors of each row"):
        G.check_mma_args(x, torch.empty(2, 32, dtype=torch.bfloat16, device=meta), 32, 256, cfg,
                         make_workspace(cfg, 32, meta))


def _certified_mma_cells(entry) -> list:
    return [c for c in entry.cells if isinstance(c.config["gemm"], G.MmaGemvConfig)]


def test_every_decode_shape_has_an_mma_cell() -> None:
    for e, rows, fam in ((LN.ENTRY, LN.MMA_ROWS, LN.MMA_FAMILY), (LM.ENTRY, LM.MMA_ROWS, LM.MMA_FAMILY)):
        shapes = {c.shape for c in e.cells if c.shape[1] >= fam.get("min_k", 0)}
        mma = _certified_mma_cells(e)
        assert {c.shape for c in mma} == shapes, f"{e.name}: shapes without an MMA cell"
        for shape in {c.shape for c in e.cells} - shapes:  # narrow K: the tensor-core cells serve the rows
            assert e.cell_for(rows[1], shape) is not None and e.cell_for(rows[1], shape).config["gemm"].BM == 16
        assert all(c.rows == rows for c in mma)
        for c in mma:
            n, k = c.shape
            cfg = c.config["gemm"]
            assert n % cfg.BN == 0 and k % (cfg.BK * cfg.SPLIT) == 0 and k // (cfg.BK * cfg.SPLIT) >= 2


@pytest.mark.parametrize("name", ["linear.nvfp4", "linear.mxfp8"])
def test_mma_cells_compile_without_spills_and_one_invocation_per_thread(name: str) -> None:
    """Each distinct compiled variant of the entry's MMA cells: sm_90 build with no spills, and every register
    bundle of the TTGIR is a [64 * warps] tensor of 2 elements per thread (the asm's pack), so each thread runs
    each block exactly once."""
    from m3serve.kernels import aot_check
    from m3serve.kernels.catalog import all_entries

    e = all_entries()[name]
    cells = _certified_mma_cells(e)
    seen = set()
    for cell in cells:
        one = type(e)(**{**e.__dict__, "cells": (cell,)})
        for key, (_e, why, kern, args, kwargs) in aot_check.collect([one]).items():
            if key in seen:
                continue
            seen.add(key)
            res = aot_check.aot_compile(kern, args, kwargs)
            assert res.stack == 0 and res.local == 0, f"{name}: spills at {why}"
            layouts = _bundle_layouts(kern, args, kwargs)
            assert layouts and all(per_thread == 2 for per_thread in layouts), (why, layouts)
    assert seen


def _bundle_layouts(kern, args, kwargs) -> list[int]:
    """Elements per thread of each 1-D tensor fed to an inline-asm block in the compiled TTGIR."""
    from m3serve.kernels._jit import aot_build

    warps = kwargs["num_warps"]
    compiled = aot_build(kern, args, kwargs)
    ttgir = compiled.asm["ttgir"]
    layouts = dict(re.findall(r"^(#blocked\d*) = #ttg.blocked<\{sizePerThread = \[(\d+)\], threadsPerWarp = \[32\], "
                              r"warpsPerCTA = \[\d+\]", ttgir, re.M))
    out = []
    for m in re.finditer(r"tt.elementwise_inline_asm .*? : (tensor<(\d+)x\w+, (#blocked\d*)>)", ttgir):
        size, lay = int(m.group(2)), m.group(3)
        if lay in layouts:
            out.append(size // (32 * warps))
    return out


@pytest.mark.parametrize("rp,warps,split,rows,stages", [(1, 2, 1, 3, 2), (2, 1, 2, 8, 3), (1, 1, 2, 1, 3)])
def test_tiled_layout_gives_the_same_bits(rp, warps, split, rows, stages) -> None:
    """NVFP4 in the MMA tile layout (tile_nvfp4 + tiled_load_asm) feeds every lane the same registers as the
    row-major layout, so the output is bit-identical, and inside the reference's band."""
    cfg = G.MmaGemvConfig(SPLIT=split, RP=rp, num_warps=warps, STAGES=stages)
    gen = torch.Generator().manual_seed(77 + rows)
    n, k = cfg.BN * 2, G.STEP * 2 * split
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    packed, scale, gs = LN.random_nvfp4_weight(n, k, CPU, gen)
    tp, ts = tile_nvfp4(packed, scale)
    assert not torch.equal(tp, packed)
    kw = dict(fmt=P.FMT_NVFP4, alpha_mode=2, n=n, k=k, cfg=cfg)
    y = G.emulate(x, packed.view(torch.int32), scale.view(torch.uint8), gs.reshape(-1), 0, **kw)
    yt = G.emulate(x, tp.view(torch.int32), ts.view(torch.uint8), gs.reshape(-1), 0, tiled=True, **kw)
    assert torch.equal(y.view(torch.int16), yt.view(torch.int16))
    LN.compare(yt, LN.nvfp4_linear_reference(x, packed, scale, gs), Case(args=(x, packed, scale, gs), kwargs={},
                                                                         bytes_moved=0))
    # the layout is a permutation: a row-major read of the tiled bytes is wrong
    yw = G.emulate(x, tp.view(torch.int32), ts.view(torch.uint8), gs.reshape(-1), 0, **kw)
    assert not torch.equal(yw.view(torch.int16), y.view(torch.int16))


@pytest.mark.parametrize("warps,split,rows,stages", [(2, 1, 3, 2), (4, 2, 8, 3), (2, 2, 1, 2)])
def test_mxfp8_tiled_layout_gives_the_same_bits(warps, split, rows, stages) -> None:
    """MXFP8 in the MMA tile layout (tile_mxfp8 + tiled_load_asm(fmt=MXFP8): 2 KB tiles, each of a lane's 16-byte
    halves its own 512 B warp load) feeds every lane the same registers as the row-major layout: bit-identical."""
    cfg = G.MmaGemvConfig(SPLIT=split, RP=1, num_warps=warps, STAGES=stages)
    gen = torch.Generator().manual_seed(91 + rows)
    n, k = cfg.BN * 2, G.STEP * 2 * split
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    q = LM.random_e4m3((n, k), gen, CPU)
    scale = torch.randint(118, 130, (n, k // 32), generator=gen, dtype=torch.uint8)
    tq, ts = tile_mxfp8(q, scale)
    assert not torch.equal(tq.view(torch.uint8), q.view(torch.uint8)) and not torch.equal(ts, scale)
    kw = dict(fmt=P.FMT_MXFP8, alpha_mode=0, n=n, k=k, cfg=cfg)
    one = torch.ones(1)
    y = G.emulate(x, q.view(torch.uint8), scale, one, 0, **kw)
    yt = G.emulate(x, tq.view(torch.uint8), ts, one, 0, tiled=True, **kw)
    assert torch.equal(y.view(torch.int16), yt.view(torch.int16))
    LM.compare(yt, LM.mxfp8_linear_reference(x, q, scale), Case(args=(x, q, scale), kwargs={}, bytes_moved=0))
    yw = G.emulate(x, q.view(torch.uint8), scale, one, 0, tiled=True, **kw)
    assert not torch.equal(yw.view(torch.int16), y.view(torch.int16))
