"""GPU certification: every certified cell of every entry on the real device (H200, sm_90),
fresh random inputs per case, outputs poisoned, reference in true fp32 on the same device.

Run on the device machine: `python -m pytest -m gpu tests/kernels -q` (bench/gpu_check.sh).

Rows per cell: the row count is a runtime argument inside one compiled variant (it only masks
rows), except that M == 1 is specialised by Triton; so each cell runs at its first and last
row count, plus one random interior count for the linears and the norm (heads and the MoE
have expensive references). Set ALL_ROWS = True to run every row count.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from m3serve.kernels.formats._decode import FMT_BF16, FMT_FP8, FMT_MXFP8, FMT_NVFP4
from m3serve.kernels.catalog import Cell, all_entries, true_fp32

pytestmark = pytest.mark.gpu

ALL_ROWS = False
ENTRIES = all_entries()
CELLS = [(name, i) for name, e in ENTRIES.items() for i in range(len(e.cells))]


def _dev() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


def _rows(kind: str, cell, rnd: random.Random) -> list[int]:
    lo, hi = cell.rows
    if ALL_ROWS:
        return list(range(lo, hi + 1))
    rows = {lo, hi}
    # heads and the MoE: the end points only (their references are the expensive part)
    if hi - lo >= 2 and not kind.startswith(("head", "moe")):
        rows.add(rnd.randint(lo + 1, hi - 1))
    return sorted(rows)


@pytest.mark.parametrize("name,i", CELLS, ids=[f"{n}-{ENTRIES[n].cells[i].shape}-r{ENTRIES[n].cells[i].rows[0]}-"
                                               f"{ENTRIES[n].cells[i].rows[1]}" for n, i in CELLS])
def test_cell(name: str, i: int) -> None:
    dev = _dev()
    e = ENTRIES[name]
    cell = e.cells[i]
    rnd = random.Random(hash((name, i)) & 0xFFFF)
    for rows in _rows(e.kind, cell, rnd):
        gen = torch.Generator().manual_seed(rnd.randint(0, 2**31))
        case = e.make_case(cell, rows, dev, gen)
        out = e.raw_call(*case.args, **case.kwargs)
        torch.cuda.synchronize()
        ref = e.reference(*case.args, **case.kwargs)
        e.compare(out, ref, case)
        del case, out, ref
    torch.cuda.empty_cache()


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_warmup_compiles_every_cell(name: str) -> None:
    ENTRIES[name].warmup(_dev())


# --- compiled decoders (the bf16 LOWP path and native fp8 conversion exist only here) -------


@pytest.mark.parametrize("fmt", [FMT_NVFP4, FMT_MXFP8, FMT_FP8, FMT_BF16])
@pytest.mark.parametrize("lowp", [False, True])
def test_group_decoder_is_exact_compiled(fmt: int, lowp: bool) -> None:
    from tests.kernels.formats.test_decode import decoded_tile

    o, ref, xc = decoded_tile(fmt, 16, 256, _dev(), cuda=True, lowp=lowp, gen=torch.Generator().manual_seed(fmt))
    assert sorted(xc.tolist()) == list(range(256))
    assert torch.equal(o, ref[:, xc]), "compiled decode (incl. bf16 subnormal E2M1 x scale) must be exact"


def test_scalar_decoders_compiled() -> None:
    from tests.kernels.formats.test_decode import _scalar

    dev = _dev()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(dev)
    finite = (codes & 0x7F) != 0x7F
    got = _scalar(0, codes, cuda=True)
    assert torch.equal(got[finite], codes.view(torch.float8_e4m3fn).float()[finite])
    x = torch.randn(1 << 16, device=dev) * torch.exp2(torch.randint(-60, 60, (1 << 16,), device=dev).float())
    assert torch.equal(_scalar(2, x, cuda=True).view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


# --- split-K tickets, determinism and CUDA graphs --------------------------------------------


def _split_cell(name: str):
    e = ENTRIES[name]
    for i, c in enumerate(e.cells):
        if "gemm" in c.config and c.config["gemm"].SPLIT > 1:
            return e, c
    raise AssertionError(f"{name}: no split-K cell")


@pytest.mark.parametrize("name", ["linear.nvfp4", "linear.mxfp8"])
def test_split_k_is_deterministic_and_leaves_counters_at_zero(name: str) -> None:
    dev = _dev()
    e, cell = _split_cell(name)
    case = e.make_case(cell, cell.rows[1], dev, torch.Generator().manual_seed(1))
    out = e.raw_call(*case.args, **case.kwargs).clone()
    for _ in range(5):
        again = e.raw_call(*case.args, **case.kwargs)
        assert torch.equal(again.view(torch.int16), out.view(torch.int16)), "split-K sums in a fixed order"
    ws = case.args[-2]
    torch.cuda.synchronize()
    assert int(ws.count.abs().sum()) == 0


def _graph_check(e, cell, rows: int, fresh_inputs) -> None:
    """Capture one raw call after warmup, then replay it on fresh inputs copied into the
    captured buffers; every replay must match its reference (counters reset between replays)."""
    dev = _dev()
    gen = torch.Generator().manual_seed(5)
    case = e.make_case(cell, rows, dev, gen)
    e.raw_call(*case.args, **case.kwargs)  # compile + warm outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            e.raw_call(*case.args, **case.kwargs)
    torch.cuda.current_stream().wait_stream(s)
    for k in range(3):
        fresh_inputs(case, torch.Generator().manual_seed(100 + k))
        g.replay()
        torch.cuda.synchronize()
        e.compare(_outputs(e, case), e.reference(*case.args, **case.kwargs), case)


def _outputs(e, case):
    """The raw call's outputs inside case.args: (ids, best) for the greedy heads, the tokens of sample.race, else `out`
    (the logits head's too)."""
    if e.kind in ("head.bf16", "head.head12"):
        return case.args[-5], case.args[-4]
    if e.kind == "sample.race":   # (logits, temperature, key_lo, key_hi, positions, tokens, config)
        return case.args[5]
    return case.args[-3]


def _fresh_x(case, gen: torch.Generator) -> None:
    x = case.args[0]
    x.copy_((torch.randn(x.shape, generator=gen) * 2).to(x.dtype).to(x.device))


@pytest.mark.parametrize("name", ["linear.nvfp4", "qkv.mxfp8", "moe.nvfp4", "head.head12", "head.head12_logits",
                                  "sample.race"])
def test_cuda_graph_replay(name: str) -> None:
    e = ENTRIES[name]
    cell = _split_cell(name)[1] if name.startswith(("linear", "qkv")) else e.cells[0]
    _graph_check(e, cell, cell.rows[1], _fresh_x)


def test_head12_agrees_with_bf16_head_on_the_same_weights() -> None:
    from m3serve.kernels.head import head12 as H12
    from m3serve.kernels.head import bf16 as HB
    from m3serve.quant.head12 import encode_head12
    from m3serve.quant.head12_tiles import tile_head12

    dev = _dev()
    cell = HB.CELLS[0]
    case = HB.make_case(cell, 8, dev, torch.Generator().manual_seed(9))
    x, w = case.args[0], case.args[1]
    t = tile_head12(encode_head12(w))
    assert t.esc_row.numel() > 0, "the test weights must exercise escapes"
    ids_b, best_b = HB.head_bf16_argmax(*case.args, **case.kwargs)
    ids_b, best_b = ids_b.clone(), best_b.clone()
    cfg = H12.CELLS[0].config["head"]
    ids12 = torch.full((8,), -1, dtype=torch.int64, device=dev)
    best12 = torch.full((8,), float("nan"), dtype=torch.float32, device=dev)
    H12.head12_argmax(x, *t.args(), ids12, best12, H12.make_head12_workspace(cfg, w.shape[0], dev), case.args[5], cfg)
    logits = HB.head_bf16_reference(x, w)
    with true_fp32():
        absprod = x.float().abs() @ w.float().abs().T
    HB.compare_argmax("head12 vs bf16", (ids12, best12), logits, absprod, x.shape[1], case.args[5])
    HB.compare_argmax("bf16", (ids_b, best_b), logits, absprod, x.shape[1], case.args[5])


MOE_SLOTS_AT_ONE_TOKEN = 5  # M3's top-4 experts + the shared one


def test_mma_moe_every_token_count_and_split_determinism() -> None:
    """The MMA-step MoE cells (1-8 tokens): every token count (the token columns are masked in PTX, so each
    count is its own path through the stores), then the down split's fixed-order sum: repeated calls are
    bit-identical and leave the counters at zero; the same for the opt-in gate|up split at one token, which also
    replays in a CUDA graph on fresh inputs."""
    from m3serve.kernels.moe._mma import MmaMoEConfig
    dev = _dev()
    e = ENTRIES["moe.nvfp4"]
    cells = [c for c in e.cells if isinstance(c.config["moe"], MmaMoEConfig)]
    assert cells, "moe.nvfp4 has MMA-step cells"
    for cell in cells:
        lo, hi = cell.rows
        for rows in range(lo, hi + 1):
            case = e.make_case(cell, rows, dev, torch.Generator().manual_seed(300 + rows))
            out = e.raw_call(*case.args, **case.kwargs).clone()
            torch.cuda.synchronize()
            e.compare(out, e.reference(*case.args, **case.kwargs), case)
            if rows in (lo, hi):   # one token: the gate|up split's tickets too (MmaMoEConfig.gate_up_split)
                for _ in range(3):
                    assert torch.equal(e.raw_call(*case.args, **case.kwargs).view(torch.int16), out.view(torch.int16))
                torch.cuda.synchronize()
                ws = case.args[-2]
                assert int(ws.dcount.abs().sum()) == 0 and int(ws.rcount.abs().sum()) == 0
                assert int(ws.gcount.abs().sum()) == 0
            del case, out
    # the opt-in gate|up split over H (MmaMoEConfig.GSPLIT) on the first MMA cell's shape at one token: its band,
    # its fixed-order sum (repeat calls bit-identical), its tickets back at zero, and a replay inside a CUDA graph
    cfg = dataclasses.replace(cells[0].config["moe"], GSPLIT=4, GSPLIT_SLOTS=4 * MOE_SLOTS_AT_ONE_TOKEN)
    assert cfg.gate_up_split(MOE_SLOTS_AT_ONE_TOKEN) == 4
    split = Cell(rows=(1, 1), shape=cells[0].shape, why="gate|up split 4 ways (opt-in)", config={"moe": cfg})
    case = e.make_case(split, 1, dev, torch.Generator().manual_seed(399))
    out = e.raw_call(*case.args, **case.kwargs).clone()
    e.compare(out, e.reference(*case.args, **case.kwargs), case)
    for _ in range(3):
        assert torch.equal(e.raw_call(*case.args, **case.kwargs).view(torch.int16), out.view(torch.int16))
    torch.cuda.synchronize()
    assert int(case.args[-2].gcount.abs().sum()) == 0
    _graph_check(e, split, 1, _fresh_x)


def _moe_variants_give_the_same_bits(e, dev, cfg_new, cfg_old, shape, rows: int, seed: int) -> None:
    """Two configs of one moe.nvfp4 MMA cell on the same inputs: the same routing, every touched slot's activations
    (and the shared expert's) and the output bit for bit; cfg_new's result also meets the reference, and both leave
    the split counters at zero."""
    got = []
    for cfg in (cfg_new, cfg_old):
        cell = Cell(rows=(rows, rows), shape=shape, why="two loop variants, same bits", config={"moe": cfg})
        case = e.make_case(cell, rows, dev, torch.Generator().manual_seed(seed))
        out = e.raw_call(*case.args, **case.kwargs).clone()
        torch.cuda.synchronize()
        if cfg is cfg_new:
            e.compare(out, e.reference(*case.args, **case.kwargs), case)
        ws = case.args[-2]
        n_valid = int((ws.slot_e >= 0).sum())
        act = torch.cat([ws.act[:n_valid], ws.act[-1:]]).clone()   # the touched slots and the shared expert
        got.append((out, act, ws.slot_e.clone()))
        assert int(ws.gcount.abs().sum()) == 0
        del case
    (out_n, act_n, slots_n), (out_o, act_o, slots_o) = got
    assert torch.equal(slots_n, slots_o), "the two runs must route alike (same inputs)"
    assert torch.equal(act_n.view(torch.int16), act_o.view(torch.int16)), "activations differ"
    assert torch.equal(out_n.view(torch.int16), out_o.view(torch.int16)), "outputs differ"


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("shape,gsplit,dsplit", [((128, 6144, 3072, 0), 1, 8), ((128, 6144, 3072, 0), 2, 8),
                                                 ((128, 6144, 1536, 0), 1, 2), ((16, 384, 256, 0), 1, 2)])
def test_mma_moe_paired_loops_give_the_one_step_loops_bits(shape, gsplit: int, dsplit: int, rows: int) -> None:
    """MmaMoEConfig.PAIRED walks gate|up's K steps and down's flat (slot, K tile) steps two an iteration (their
    register buffers alternating; down's addresses from per-slot bases) where the one-step loops copy their ring:
    the same steps in the same order and the same folds, so every touched slot's activations and the output are the
    same bits. Shapes: M3 TP1 (down: 3 K tiles a slot, an odd step count at one token), gate|up split 2 ways over H,
    TP2 (6 tiles a slot), and H = 384 (gate|up: 3 steps, an odd count; down: 1 tile a slot, a new slot every step).
    The paired result also meets the reference."""
    from m3serve.kernels.moe._mma import MmaMoEConfig
    dev = _dev()
    e = ENTRIES["moe.nvfp4"]
    base = next(c.config["moe"] for c in e.cells if isinstance(c.config["moe"], MmaMoEConfig))
    base = dataclasses.replace(base, GSPLIT=gsplit, GSPLIT_SLOTS=gsplit * MOE_SLOTS_AT_ONE_TOKEN, DSPLIT=dsplit,
                               RSPLIT=min(base.RSPLIT, shape[1] // base.RBK))
    _moe_variants_give_the_same_bits(e, dev, dataclasses.replace(base, PAIRED=True),
                                     dataclasses.replace(base, PAIRED=False), shape, rows, seed=77 + rows)


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("gsplit", [1, 2])
def test_mma_moe_hoisted_gate_up_loads_give_the_default_bits(gsplit: int, rows: int) -> None:
    """MmaMoEConfig.HOIST computes gate|up's per-thread load offsets once before the K loop (the prologue block of
    _mma_ptx.gate_up_lane_offsets_asm) and the loop's load blocks only add them to each step's bases: the same bytes
    into the same registers, so every touched slot's activations and the output are the default loop's bits. M3 TP1
    (the certified MMA cell, its tiled experts) whole over H and split 2 ways over H (the one-token launch's
    GSPLIT); the hoisted result also meets the reference."""
    from m3serve.kernels.moe._mma import MmaMoEConfig
    dev = _dev()
    e = ENTRIES["moe.nvfp4"]
    shape = (128, 6144, 3072, 0)
    base = next(c.config["moe"] for c in e.cells if isinstance(c.config["moe"], MmaMoEConfig) and c.shape == shape)
    base = dataclasses.replace(base, GSPLIT=gsplit, GSPLIT_SLOTS=gsplit * MOE_SLOTS_AT_ONE_TOKEN)
    _moe_variants_give_the_same_bits(e, dev, dataclasses.replace(base, HOIST=True),
                                     dataclasses.replace(base, HOIST=False), shape, rows, seed=177 + rows)


@pytest.mark.parametrize("name,shape,rows", [("linear.nvfp4", (9856, 6144), 1), ("linear.nvfp4", (4096, 6144), 8),
                                             ("linear.mxfp8", (9856, 6144), 8), ("linear.mxfp8", (4096, 6144), 3),
                                             ("qkv.mxfp8", (4992, 6144), 8)])
def test_mma_gemv_paired_loop_gives_the_one_step_loops_bits(name: str, shape, rows: int) -> None:
    """MmaGemvConfig.PAIRED (paired_k_steps: two K steps an iteration) against the one-step loop on the same inputs:
    the same bits, and the paired result meets its cell's band. 12 steps a CTA at (9856, 6144) (SPLIT 4 over 6144),
    3 at (4096, 6144) (SPLIT 16: an odd count), 6 at (4992, 6144)."""
    from m3serve.kernels.gemm._mma_gemv import MmaGemvConfig
    dev = _dev()
    e = ENTRIES[name]
    cell = next(c for c in e.cells if c.shape == shape and isinstance(c.config.get("gemm"), MmaGemvConfig))
    got = []
    for paired in (True, False):
        cfg = dataclasses.replace(cell.config["gemm"], PAIRED=paired)
        c2 = Cell(rows=(rows, rows), shape=cell.shape, why="paired vs one-step GEMV",
                  config={**cell.config, "gemm": cfg})
        case = e.make_case(c2, rows, dev, torch.Generator().manual_seed(91 + rows))
        e.raw_call(*case.args, **case.kwargs)
        torch.cuda.synchronize()
        out = _outputs(e, case).clone()
        if paired:
            e.compare(out, e.reference(*case.args, **case.kwargs), case)
        got.append(out)
        del case
    assert torch.equal(got[0].view(torch.int16), got[1].view(torch.int16)), f"{name} {shape} at {rows} rows"


MSA_CELLS = [i for i, c in enumerate(ENTRIES["attn.paged"].cells) if c.shape[5] > 0]


@pytest.mark.parametrize("i", MSA_CELLS, ids=[str(ENTRIES["attn.paged"].cells[i].shape) for i in MSA_CELLS])
def test_attn_paged_msa_walk_bound_meets_the_reference(monkeypatch, i: int) -> None:
    """attn.paged's MSA cells with the tile walk bounded by the selection slots that can hold a block
    (_paged_call.SEL_WALK_ALL False, opt-in), at the cell's first and last row counts, on contexts of a quarter of
    top-k pages (the cells' own contexts hold more than top-k pages, where the bound is top-k itself), against the
    reference."""
    from m3serve.kernels.attention import _paged_call
    from m3serve.kernels.attention._paged_case import build_case
    monkeypatch.setattr(_paged_call, "SEL_WALK_ALL", False)
    dev = _dev()
    e = ENTRIES["attn.paged"]
    cell = e.cells[i]
    topk, page = cell.shape[5], cell.shape[4]
    short = dataclasses.replace(cell.config["case"], context=page * topk // 4)
    for rows in sorted({cell.rows[0], cell.rows[1]}):
        case = build_case(cell.shape, rows, dev, torch.Generator().manual_seed(500 + rows + i), short).case
        assert bool((case.args[9] == -1).any()), "short contexts leave selection slots -1"
        out = e.raw_call(*case.args, **case.kwargs)
        torch.cuda.synchronize()
        e.compare(out, e.reference(*case.args, **case.kwargs), case)
        del case, out
