"""attn.paged on the GPU (H200, sm_90): every certified cell at several (batch, context) points up
to 32k keys, against the entry's fp32 reference and band, and against an fp64 attention with a
tight band; determinism; CUDA-graph replay with new step metadata; exact compiled KV decoding.

Run on the device machine: `python -m pytest -m gpu tests/kernels/attention/test_paged_attention_gpu.py -q`.
"""

from __future__ import annotations

import pytest
import torch

from m3serve.kernels.attention._paged_case import CaseShape, build_case, resample_step
from m3serve.kernels.attention.paged import CELLS, ENTRY
from tests.kernels.attention.test_paged_attention import attention_fp64, decoded_page_matches_cache, tight_check

pytestmark = pytest.mark.gpu


def _dev() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


# (batch, context, rows from the cell: "lo" | "hi")
POINTS = ((1, 32768, "lo"), (1, 32768, "hi"), (16, 4096, "lo"), (5, 1000, "hi"))


@pytest.mark.parametrize("i", range(len(CELLS)), ids=[f"{c.shape}-r{c.rows[0]}-{c.rows[1]}" for c in CELLS])
def test_cell_at_batch_and_context_points(i: int) -> None:
    dev = _dev()
    cell = CELLS[i]
    for k, (batch, context, which) in enumerate(POINTS):
        rows = cell.rows[0] if which == "lo" else cell.rows[1]
        gen = torch.Generator().manual_seed(1000 * i + k)
        pc = build_case(cell.shape, rows, dev, gen, CaseShape(batch=batch, context=context))
        out = ENTRY.raw_call(*pc.case.args, **pc.case.kwargs)
        torch.cuda.synchronize()
        ref = ENTRY.reference(*pc.case.args, **pc.case.kwargs)
        ENTRY.compare(out, ref, pc.case)
        tight_check(out, attention_fp64(pc.case), ref)
        del pc, out, ref
    torch.cuda.empty_cache()


@pytest.mark.parametrize("fmt_i", [0, 4, 6])  # fp8 dense decode (many splits), NVFP4 MSA, bf16 MSA
def test_repeated_calls_are_bitwise_identical(fmt_i: int) -> None:
    dev = _dev()
    cell = CELLS[fmt_i]
    pc = build_case(cell.shape, cell.rows[0], dev, torch.Generator().manual_seed(3), CaseShape(batch=2, context=9000))
    first = ENTRY.raw_call(*pc.case.args, **pc.case.kwargs).clone()
    assert pc.case.kwargs["num_splits"] > 1
    for _ in range(4):
        again = ENTRY.raw_call(*pc.case.args, **pc.case.kwargs)
        assert torch.equal(again.view(torch.int16), first.view(torch.int16)), "the split combine sums in a fixed order"


@pytest.mark.parametrize("fmt_i", [0, 4])
def test_cuda_graph_replay_with_new_step_metadata(fmt_i: int) -> None:
    """Capture once; replay after writing another step's lengths (some now padding), queries and
    selections into the captured buffers: no re-capture, every replay matches its reference."""
    dev = _dev()
    cell = CELLS[fmt_i]
    pc = build_case(cell.shape, 1, dev, torch.Generator().manual_seed(10), CaseShape(batch=6, context=5000, num_splits=8))
    case = pc.case
    ENTRY.raw_call(*case.args, **case.kwargs)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        ENTRY.raw_call(*case.args, **case.kwargs)
    torch.cuda.current_stream().wait_stream(s)
    for k in range(3):
        resample_step(pc, torch.Generator().manual_seed(20 + k))
        g.replay()
        torch.cuda.synchronize()
        ENTRY.compare(case.args[10], ENTRY.reference(*case.args, **case.kwargs), case)


@pytest.mark.parametrize("fmt", ["bf16", "fp32", "fp8", "nvfp4"])
def test_compiled_kv_decoding_is_bitwise_equal_to_cache_read(fmt: str) -> None:
    decoded_page_matches_cache(fmt, _dev())


def test_warmup_compiles_every_cell() -> None:
    ENTRY.warmup(_dev())


@pytest.mark.parametrize("bn,stages", [(128, 2), (64, 3)])
def test_fp8_pages_read_as_pairs_match_the_reference(bn: int, stages: int) -> None:
    """The sweep-only TileConfig.PAIRS path (FP8 pages read as 16-bit pairs, one cvt per pair in registers) on
    the dense FP8 cells, decode and multi-token rows, against the fp32 reference band and the fp64 attention."""
    from m3serve.kernels.attention._paged_call import TileConfig, tile_config
    dev = _dev()
    fp8 = [c for c in CELLS if c.shape[0] == 2 and c.shape[-1] == 0]   # FP8 pages, dense
    assert fp8, "no dense FP8 cell"
    for k, cell in enumerate(fp8):
        for rows in sorted({cell.rows[0], min(cell.rows[1], 4)}):
            pc = build_case(cell.shape, rows, dev, torch.Generator().manual_seed(77 + k),
                            CaseShape(batch=3, context=min(5000, 64 * cell.shape[4])))
            q, pages = pc.case.args[0], pc.case.args[1]
            base = tile_config(q.shape[1] // pages.shape[1], pages.shape[2], pc.case.kwargs["max_query_len"], False)
            tile = TileConfig(QB=base.QB, BM=base.BM, BN=min(bn, base.BN), num_warps=base.num_warps, num_stages=stages,
                              PAIRS=True)
            pc.case.args[10].fill_(float("nan"))
            out = ENTRY.raw_call(*pc.case.args, **pc.case.kwargs, tile=tile)
            torch.cuda.synchronize()
            ref = ENTRY.reference(*pc.case.args, **pc.case.kwargs)
            ENTRY.compare(out, ref, pc.case)
            tight_check(out, attention_fp64(pc.case), ref)
