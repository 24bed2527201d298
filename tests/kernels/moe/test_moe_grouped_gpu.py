"""moe.grouped on the H200: every certified cell vs the true-fp32 reference (first and last row count), CUDA-graph
capture + replay bit-identical to eager (for the captured routing and for a new one), no host sync under torch's
sync debug mode, and LLM construction (graph capture included) for BF16 / FP8 / MXFP8 / NVFP4 experts at real dims.

Run: python -m pytest -m gpu tests/kernels/moe/test_moe_grouped_gpu.py -q
"""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest
import torch

from m3serve.kernels.moe import grouped as G
from m3serve.kernels.formats._decode import FMT_BF16, FMT_FP8, FMT_MXFP8, FMT_NVFP4

pytestmark = pytest.mark.gpu

CELLS = list(enumerate(G.CELLS))


def _dev() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


def _cell(fmt: int, shape: tuple, rows: int):
    return next(c for c in G.CELLS if c.shape == (fmt, *shape) and c.rows[0] <= rows <= c.rows[1])


@pytest.mark.parametrize("i,cell", CELLS, ids=[f"{c.shape}-r{c.rows[0]}-{c.rows[1]}" for _, c in CELLS])
def test_cell_matches_reference(i, cell):
    dev = _dev()
    for rows in sorted({cell.rows[0], cell.rows[1]}):
        case = G.make_case(cell, rows, dev, torch.Generator().manual_seed(1000 * i + rows))
        out = G.moe_grouped(*case.args, **case.kwargs)
        torch.cuda.synchronize()
        ref = G.moe_grouped_reference(*case.args, **case.kwargs)
        G.compare(out, ref, case)
        del case, out, ref


M3 = (128, 6144, 3072, 4)


@pytest.mark.parametrize("fmt", [FMT_BF16, FMT_FP8, FMT_MXFP8, FMT_NVFP4])
@pytest.mark.parametrize("rows", [1, 8, 64, 256, 2048, G.DECODE_ONCE_ROWS])
def test_graph_replay_is_bit_identical_to_eager(fmt, rows):
    """Capture the raw call (routing and grouping included) for one row count; replay equals eager bit for bit,
    and after new activations are copied in (another routing), replay equals eager on those too."""
    dev = _dev()
    cell = _cell(fmt, M3, rows)
    case = G.make_case(cell, rows, dev, torch.Generator().manual_seed(rows))
    args = list(case.args)
    x, out = args[0], args[12]
    G.moe_grouped(*args, **case.kwargs)  # compile outside the capture
    eager = out.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph, stream=s):
            G.moe_grouped(*args, **case.kwargs)
    torch.cuda.current_stream().wait_stream(s)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x_new = torch.randn(x.shape, device=dev, generator=torch.Generator(device=dev).manual_seed(99)).to(x.dtype)
    x.copy_(x_new)
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    G.moe_grouped(*args, **case.kwargs)
    torch.cuda.synchronize()
    assert not torch.equal(replayed, eager), "the new activations changed nothing: the replay ignored x"
    assert torch.equal(replayed, out)


@pytest.mark.parametrize("fmt,rows", [(FMT_BF16, 300), (FMT_NVFP4, 300), (FMT_NVFP4, G.DECODE_ONCE_ROWS)])
def test_no_host_sync(fmt, rows):
    dev = _dev()
    case = G.make_case(_cell(fmt, M3, rows), rows, dev, torch.Generator().manual_seed(3))
    G.moe_grouped(*case.args, **case.kwargs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        G.moe_grouped(*case.args, **case.kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("fmt", [FMT_FP8, FMT_MXFP8, FMT_NVFP4])
def test_decode_once_scratch_is_exact_compiled(fmt):
    """The compiled decode_experts (NVFP4 through the inline-PTX decoder when PTX_E2M1 is on, E4M3 / E8M0 through
    the hardware conversions) writes the reference's group-scaled values bit for bit, for every finite group-scale
    code, at the M3 gate|up shape (2 experts of a 3-expert stack, so the expert offset is exercised)."""
    from tests.kernels.moe.test_moe_grouped import _stacked
    dev = _dev()
    w, s, f = (t.to(dev) if t is not None else None for t in _stacked(fmt, 3, 6144, 6144, seed=fmt))
    cfg = _cell(fmt, M3, G.DECODE_ONCE_ROWS).config["moe"]
    q = G.qweight_of(fmt, w, s, f)
    wdec = torch.full((2 * 6144 * 6144,), float("nan"), dtype=torch.bfloat16, device=dev)
    got = G.decode_group(fmt, w, s, 1, 2, wdec, cfg)
    torch.cuda.synchronize()
    for el in range(2):
        if fmt == FMT_NVFP4:
            want = q.dequantize_factored(torch.float32, 1 + el)[0] * 2.0 ** -8
        elif fmt == FMT_FP8:
            want = w[1 + el].float()
        else:
            want = q.dequantize(torch.float32, 1 + el)
        assert torch.equal(got[el].float(), want), f"expert {1 + el}"


@pytest.mark.parametrize("fmt", [FMT_FP8, FMT_MXFP8, FMT_NVFP4])
def test_decode_once_and_in_register_paths_agree(fmt):
    """The same inputs (and so the same routing) through the decode-once config and the in-register config at 4096
    tokens: both within the entry's bands of the same true-fp32 reference (the decode-once band claims no other
    tolerance: same operands, fp32 accumulation and row factors, only the summation order differs)."""
    dev = _dev()
    once = _cell(fmt, M3, G.DECODE_ONCE_ROWS)
    reg = _cell(fmt, M3, G.DECODE_ONCE_ROWS - 1)
    assert once.config["moe"].DECODE_ONCE and not reg.config["moe"].DECODE_ONCE
    case = G.make_case(once, G.DECODE_ONCE_ROWS, dev, torch.Generator().manual_seed(41))
    out = G.moe_grouped(*case.args, **case.kwargs).clone()
    torch.cuda.synchronize()
    ref = G.moe_grouped_reference(*case.args, **case.kwargs)
    G.compare(out, ref, case)
    args = list(case.args)
    cfg = reg.config["moe"]
    args[13] = G.make_workspace(cfg, G.DECODE_ONCE_ROWS, *M3, dev)
    args[14] = cfg
    args[12] = torch.full_like(args[12], float("nan"))
    out_reg = G.moe_grouped(*args, **case.kwargs)
    torch.cuda.synchronize()
    G.compare(out_reg, ref, replace(case, args=tuple(args)))
    assert not bool(out_reg.isnan().any())


@pytest.mark.parametrize("fmt", [FMT_MXFP8, FMT_NVFP4])
def test_decode_ahead_equals_the_serial_band_bit_for_bit(fmt):
    """The band decoded ahead (decodes on a side stream, two scratch halves of 16 experts) against the band run
    serially at 8192 tokens (groups of 32): per GEMM the same operands and order of sums, so the output is equal bit
    for bit; a scratch half overwritten before its GEMM read it (a missing wait) would show here. Both configs
    need the same scratch, so the case's workspace serves both."""
    dev = _dev()
    rows = 8192
    cell = _cell(fmt, M3, rows)
    serial_cfg = cell.config["moe"]
    assert serial_cfg.DECODE_ONCE
    case = G.make_case(cell, rows, dev, torch.Generator().manual_seed(43))
    args = list(case.args)
    args[14] = replace(serial_cfg, DECODE_AHEAD=True, EXPERT_GROUP=16)
    ahead = G.moe_grouped(*args, **case.kwargs).clone()
    args[14] = replace(serial_cfg, DECODE_AHEAD=False)
    args[12] = torch.full_like(args[12], float("nan"))
    serial = G.moe_grouped(*args, **case.kwargs)
    torch.cuda.synchronize()
    assert not bool(ahead.isnan().any())
    assert torch.equal(ahead, serial)


@pytest.mark.parametrize("quant", [None, "fp8", "mxfp8", "nvfp4"])
def test_llm_builds_and_captures_every_expert_format(quant):
    """LLM(...) with the defaults (route auto, CUDA graphs) at real dims: minimax-m3:4 (three dense layers and one
    MoE layer; minimax-m3:2 has no MoE layer). Construction captures the decode graphs through the MoE, and every
    bucket must capture (no capture blocker left for the MoE); a short greedy generation then runs on them (and
    prefill through moe.grouped)."""
    _dev()
    from m3serve import LLM, SamplingParams
    from m3serve.model.moe import MoE
    llm = LLM("minimax-m3:4", device="cuda", random_weights=True, quantization=quant)
    try:
        moe = next(m for m in llm.model.modules() if isinstance(m, MoE))
        assert moe.w13.fmt == {None: "dense"}.get(quant, quant)
        graphs = llm.engine.runner.graphs
        assert graphs is not None, "decode target off under the defaults"
        assert not graphs.blocked, f"buckets left eager: {graphs.blocked}"
        assert set(graphs.captured) == set(graphs.buckets)
        out = llm.generate([{"prompt_token_ids": list(range(1, 200))}] * 3,
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    finally:  # a failed case must not keep its model's memory from the next one
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
