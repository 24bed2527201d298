"""Decode GEMV (m3serve/kernels/gemm/_gemv.py) under the Triton interpreter at tiny shapes, through the
linear.nvfp4 / linear.mxfp8 raw calls (a GemvConfig selects it), checked with each entry's own
reference and compare (band: catalog.gemm_band, one bf16 ulp + 2*K*u*sum|x*w|; the GEMV's
decoded weights and products are exact and its fp32 summation depth is far below K, so the band
needs no widening). Fresh random inputs per case; outputs are poisoned with NaN by make_case."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl

from m3serve.kernels.gemm._gemm_tiles import make_workspace
from m3serve.kernels.gemm import _linear as L
from m3serve.kernels.gemm import mxfp8 as linear_mxfp8, nvfp4 as linear_nvfp4
from m3serve.kernels.gemm._gemv import GemvConfig, e2m1_words_f32, interp_gemv_cells
from m3serve.kernels._jit import kernel
from m3serve.kernels.catalog import Case, Cell, poisoned

CPU = torch.device("cpu")
ENTRIES = {"linear.nvfp4": linear_nvfp4.ENTRY, "linear.mxfp8": linear_mxfp8.ENTRY}
CELLS = interp_gemv_cells((64, 256))
CASES = [(name, i, rows) for name in ENTRIES for i, c in enumerate(CELLS) for rows in c.row_counts()]


def _run(name: str, cell: Cell, rows: int, seed: int):
    e = ENTRIES[name]
    case = e.make_case(cell, rows, CPU, torch.Generator().manual_seed(seed))
    assert torch.isnan(case.args[-3].float()).all()  # the output starts poisoned
    out = e.raw_call(*case.args, **case.kwargs)
    ref = e.reference(*case.args, **case.kwargs)
    return e, case, out, ref


@pytest.mark.parametrize("name,i,rows", CASES, ids=[f"{n}-c{i}-r{r}" for n, i, r in CASES])
def test_gemv_matches_reference(name: str, i: int, rows: int) -> None:
    e, case, out, ref = _run(name, CELLS[i], rows, seed=100 * i + rows)
    e.compare(out, ref, case)
    assert int(case.args[-2].count.abs().sum()) == 0, "split-K counters must be left at zero"


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_gemv_is_deterministic_with_split_k(name: str) -> None:
    cell = CELLS[1]  # split-K 2: the last-arriving program sums the partials in a fixed order
    assert cell.config["gemm"].SPLIT > 1
    e, case, out, _ = _run(name, cell, 2, seed=5)
    first = out.clone()
    case.args[-3].fill_(float("nan"))
    assert torch.equal(e.raw_call(*case.args, **case.kwargs), first)


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_compare_rejects_corrupted_and_unwritten_gemv_outputs(name: str) -> None:
    e, case, out, ref = _run(name, CELLS[0], 1, seed=9)
    e.compare(out, ref, case)
    bad = out.clone()
    bad.view(-1)[bad.numel() // 2] = bad.view(-1)[bad.numel() // 2].float() * 1.5 + 1.0
    with pytest.raises(AssertionError):
        e.compare(bad, ref, case)
    bad = out.clone()
    bad.view(-1)[-1] = float("nan")
    with pytest.raises(AssertionError):
        e.compare(bad, ref, case)


def test_nvfp4_gemv_row_strided_x_and_per_row_global_scale() -> None:
    """x with a row stride > K and a [N] ENCODE scale vector (the fused projection's form)."""
    n, k, rows = 64, 256, 3
    g = torch.Generator().manual_seed(3)
    packed, scale, _ = linear_nvfp4.random_nvfp4_weight(n, k, CPU, g)
    gs = 100.0 + 3000.0 * torch.rand(n, generator=g)
    x = L.fresh_x(rows, 2 * k, CPU, g)[:, :k]
    assert x.stride(0) == 2 * k
    cfg = GemvConfig(BM=4, BN=32, BK=64, SPLIT=2)
    out = poisoned((rows, n), torch.bfloat16, CPU)
    ws = make_workspace(cfg, n, CPU)
    args = (x, packed, scale, gs, out, ws, cfg)
    linear_nvfp4.nvfp4_linear(*args)
    linear_nvfp4.compare(out, linear_nvfp4.nvfp4_linear_reference(*args), Case(args=args, kwargs={}, bytes_moved=0))


@kernel
def _decode_words(w_ptr, y_ptr, R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)[:, None]
    w = tl.load(w_ptr + r * C + tl.arange(0, C)[None, :])
    tl.store(y_ptr + r * (8 * C) + tl.arange(0, 8 * C)[None, :], e2m1_words_f32(w))


def test_e2m1_natural_order_decoder_is_exact_for_every_byte() -> None:
    """All 256 bytes (both nibbles, every sign/code) in random word positions -> e2m1 * 2**-14,
    column 2i from the low nibble of byte i (natural order, unlike the MMA pair order)."""
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(1)).to(torch.uint8)
    packed = perm.reshape(8, 32)  # [R=8, 32 bytes] = 8 int32 words per row
    y = torch.full((8, 64), float("nan"))
    _decode_words[(1,)](packed.view(torch.int32), y, R=8, C=8)
    nib = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(8, 64).long()
    want = table[nib & 7] * torch.where(nib >= 8, -1.0, 1.0) * 2.0**-14
    assert torch.equal(y, want) and torch.equal(torch.signbit(y), nib >= 8)  # -0 keeps its sign


def test_gemv_config_and_rows_are_validated() -> None:
    with pytest.raises(ValueError, match=r"GemvConfig.BM: expected one of \(1, 2, 4\), found 3"):
        GemvConfig(BM=3, BN=32, BK=64, SPLIT=1)
    with pytest.raises(ValueError, match=r"GemvConfig.BN: expected a positive power of two, found 48"):
        GemvConfig(BM=1, BN=48, BK=64, SPLIT=1)
    cfg = GemvConfig(BM=2, BN=32, BK=64, SPLIT=1)
    case = linear_mxfp8.make_case(Cell(rows=(3, 3), shape=(64, 256), why="t", config={"gemm": cfg}), 3, CPU,
                                  torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"x: this config \(BM=2\) serves 1..2 rows, found M=3"):
        linear_mxfp8.mxfp8_linear(*case.args, **case.kwargs)


GPU_SHAPES = ((6144, 8192), (512, 6144))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(ENTRIES))
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_gemv_compiled_real_shapes(name: str, rows: int) -> None:
    """Compiled GEMV at real shapes with the proposed configs (gemv_cells), fresh inputs, twice
    (bitwise equal: fixed reduction order), counters back at zero."""
    from m3serve.kernels.gemm._gemv import gemv_cells

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device("cuda")
    e = ENTRIES[name]
    for cell in gemv_cells(tuple((s, "gpu test") for s in GPU_SHAPES)):
        if not cell.rows[0] <= rows <= cell.rows[1]:
            continue
        case = e.make_case(cell, rows, dev, torch.Generator().manual_seed(rows))
        out = e.raw_call(*case.args, **case.kwargs).clone()
        e.compare(out, e.reference(*case.args, **case.kwargs), case)
        case.args[-3].fill_(float("nan"))
        assert torch.equal(e.raw_call(*case.args, **case.kwargs), out)
        assert int(case.args[-2].count.abs().sum()) == 0
