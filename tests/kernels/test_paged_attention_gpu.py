"""attn.paged on the GPU (H200, sm_90): every certified cell at several (batch, context) points up
to 32k keys, against the entry's fp32 reference and band, and against an fp64 attention with a
tight band; determinism; CUDA-graph replay with new step metadata; exact compiled KV decoding.

Run on the device machine: `python -m pytest -m gpu tests/kernels/test_paged_attention_gpu.py -q`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from m3serve.kernels._paged_attn_case import CaseShape, build_case, resample_step
from m3serve.kernels.paged_attention import CELLS, ENTRY
from tests.kernels.test_paged_attention import attention_fp64, decoded_page_matches_cache, poison_outputs, tight_check

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


@pytest.mark.parametrize("bn,stages,warps", [(128, 1, 4), (128, 2, 4), (64, 1, 4), (128, 1, 8)])
def test_prefetch_matches_the_reference_and_the_default_path(bn: int, stages: int, warps: int) -> None:
    """The sweep-only TileConfig.PREFETCH path (the next key tile's slot id and raw K/V loaded into registers before
    the current tile's math) on every dense cell (FP8, BF16 and FP32 pages; decode and multi-token rows), against
    the fp32 reference band and the fp64 attention, and bit for bit against the same tile without PREFETCH (the
    raw bytes are converted at use by the same operations; only the load schedule differs)."""
    from m3serve.kernels._paged_attn_call import tile_config
    dev = _dev()
    dense = [c for c in CELLS if c.shape[-1] == 0]
    assert {c.shape[0] for c in dense} >= {2, 3}, "dense FP8 and BF16 cells"
    for k, cell in enumerate(dense):
        for rows in sorted({cell.rows[0], cell.rows[1]}):
            pc = build_case(cell.shape, rows, dev, torch.Generator().manual_seed(77 + k),
                            CaseShape(batch=3, context=min(5000, 64 * cell.shape[4])))
            a, kw = pc.case.args, pc.case.kwargs
            base = tile_config(a[0].shape[1] // a[1].shape[1], a[1].shape[2], kw["max_query_len"], False)
            tile = replace(base, BN=min(bn, base.BN), num_stages=stages, num_warps=max(warps, base.num_warps))
            poison_outputs(a)
            want = ENTRY.raw_call(*a, **kw, tile=tile).clone()
            poison_outputs(a)
            out = ENTRY.raw_call(*a, **kw, tile=replace(tile, PREFETCH=True))
            torch.cuda.synchronize()
            ref = ENTRY.reference(*a, **kw)
            ENTRY.compare(out, ref, pc.case)
            tight_check(out, attention_fp64(pc.case), ref)
            assert torch.equal(out.view(torch.int16), want.view(torch.int16)), \
                f"{cell.why}, rows {rows}: {int((out.view(torch.int16) != want.view(torch.int16)).sum())} outputs differ"
            del pc, out, want, ref
    torch.cuda.empty_cache()
