"""The MMA tile layout of NVFP4 and MXFP8 weights on the H200, compiled: each cell family reading tiles gives the
same bits as on the row-major weight (the GEMV and the register-operand MMA GEMV at 1-8 rows, the tensor-core GEMM at
9-48, the prefill GEMM and its decode-once path; the MoE's MMA step at 1-8 tokens and its tensor-core kernels;
moe.grouped's in-register and decode-once bands), and row-major bytes read as tiles do not (the flag reaches the
compiled kernel).

Run: python -m pytest -m gpu tests/kernels/test_tile_layout_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from m3serve.kernels.catalog import poisoned
from m3serve.kernels.formats._decode import FMT_NVFP4
from m3serve.kernels.gemm import mxfp8 as LM, nvfp4 as LN
from m3serve.kernels.gemm import tiled as LT
from m3serve.kernels.gemm._gemm_tiles import make_workspace
from m3serve.kernels.moe import grouped as G
from m3serve.kernels.moe import nvfp4 as M
from m3serve.quant.nvfp4 import untile_nvfp4
from m3serve.quant.tiles import to_layout

pytestmark = pytest.mark.gpu


def _dev() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


ROWS = (1, 2, 4, 8, 9, 48, 49, 300, 1024)
LINEAR_CELLS = [(mod, c, r) for mod, tiled_entry in ((LN, LT.ENTRIES[0]), (LM, LT.ENTRIES[1]))
                for c in mod.CELLS + tiled_entry.cells if c.shape == (24576, 6144)
                for r in ROWS if c.rows[0] <= r <= c.rows[1]]


@pytest.mark.parametrize("mod,cell,rows", LINEAR_CELLS, ids=[
    f"{m.ENTRY.name}-{type(c.config['gemm']).__name__}-r{r}" for m, c, r in LINEAR_CELLS])
def test_linear_cells_read_tiles_bit_for_bit(mod, cell, rows):
    dev = _dev()
    case = mod.make_case(cell, rows, dev, torch.Generator().manual_seed(rows))
    assert case.kwargs["tiled"]
    x, w, s, *rest = case.args
    out, ws, cfg = rest[-3:]
    fmt = "nvfp4" if mod is LN else "mxfp8"
    w_rows, s_rows = to_layout(fmt, w, s, "mma_tile", "rows")

    def run(w_, s_, tiled):
        return mod.ENTRY.raw_call(x, w_, s_, *rest[:-3], poisoned(out.shape, torch.bfloat16, dev),
                                  make_workspace(cfg, out.shape[1], dev), cfg, tiled=tiled).clone()

    got, ref, wrong = run(w, s, True), run(w_rows, s_rows, False), run(w_rows, s_rows, True)
    torch.cuda.synchronize()
    assert _same(got, ref)
    assert not _same(wrong, ref)


def _untiled(args: list, pairs: tuple) -> list:
    """args with the NVFP4 (bytes, scales) at each pair of positions back in the row-major layout."""
    out = list(args)
    for w, s in pairs:
        out[w], out[s] = untile_nvfp4(args[w], args[s])
    return out


def _moe_reads_tiles_bit_for_bit(entry, cell, rows: int, pairs: tuple, out_at: int, make_ws) -> None:
    """An MoE entry's case (experts tiled) run on tiles, on the same experts row-major, and on row-major bytes read as
    tiles: the first two give the same bits, the third does not. pairs: the experts' (bytes, scales) positions;
    out_at: the output's, the workspace's follows it (each run a poisoned output and make_ws(args, dev))."""
    dev = _dev()
    case = entry.make_case(cell, rows, dev, torch.Generator().manual_seed(rows))
    assert case.kwargs["tiled"]
    args = list(case.args)
    rows_args = _untiled(args, pairs)
    kw = {k: v for k, v in case.kwargs.items() if k != "tiled"}

    def run(a, tiled):
        a = list(a)
        a[out_at] = poisoned(a[out_at].shape, torch.bfloat16, dev)
        a[out_at + 1] = make_ws(a, dev)
        return entry.raw_call(*a, **kw, tiled=tiled).clone()

    got, ref, wrong = run(args, True), run(rows_args, False), run(rows_args, True)
    torch.cuda.synchronize()
    assert _same(got, ref)
    assert not _same(wrong, ref)


MOE_CELLS = [(c, r) for c in M.CELLS if c.shape == (128, 6144, 3072, 0) for r in (1, 4, 8, 16, 48)
             if c.rows[0] <= r <= c.rows[1]]


@pytest.mark.parametrize("cell,rows", MOE_CELLS, ids=[f"{type(c.config['moe']).__name__}-t{r}" for c, r in MOE_CELLS])
def test_moe_nvfp4_reads_tiles_bit_for_bit(cell, rows):
    _moe_reads_tiles_bit_for_bit(M.ENTRY, cell, rows, ((3, 4), (6, 7), (9, 10), (12, 13)), 16,   # routed, shared
                                 lambda a, dev: M.make_moe_workspace(a[18], rows, 128, 6144, 3072, dev))


GROUPED = [(c, r) for c in G.CELLS if c.shape == (FMT_NVFP4, 128, 6144, 3072, 4) for r in (64, 2049, 4096)
           if c.rows[0] <= r <= c.rows[1]]


@pytest.mark.parametrize("cell,rows", GROUPED, ids=[f"r{r}" for _, r in GROUPED])
def test_moe_grouped_reads_tiles_bit_for_bit(cell, rows):
    _moe_reads_tiles_bit_for_bit(G.ENTRY, cell, rows, ((4, 5), (7, 8)), 12,
                                 lambda a, dev: G.make_workspace(a[14], rows, 128, 6144, 3072, 4, dev))
