"""The MoE on the register-operand MMA step (m3serve/kernels/moe/_mma.py) on the CPU.

The router runs interpreted (its Triton kernel, as on the GPU); the gate|up and down kernels' PTX blocks run on
the warp emulator (gemm/_ptx_emu.py) through their own step logic (moe/_mma.py's emulate), and the result goes through
moe.nvfp4's certified compare: routing, every slot's activations (one bf16 ulp + the gate/up summation bound
through SwiGLU-OAI's derivative bounds) and the output (gemm_band against the kernel's own activations). The
activations and the output start as NaN, so an unwritten element fails. The emulator's exp2 is numpy's; the
hardware's ex2.approx is within 2 fp32 ulp of it, far inside the one-bf16-ulp term.

The tiled variant (weights in the MMA tile layout of m3serve.quant.nvfp4.tile_nvfp4) is checked against the
row-major one bit for bit: it must hand every lane the same registers, so the band adds nothing there.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from m3serve.kernels.gemm import _mma_ptx as P
from m3serve.kernels.moe import _mma as MM
from m3serve.kernels.moe import nvfp4 as MOE
from m3serve.kernels.catalog import Cell
from m3serve.quant.nvfp4 import tile_nvfp4, untile_nvfp4

CPU = torch.device("cpu")


def _case(cfg: MM.MmaMoEConfig, tokens: int, i: int, seed: int):
    cell = Cell(rows=(tokens, tokens), shape=(16, 256, i, 0), why="test", config={"moe": cfg})
    case = MOE.make_case(cell, tokens, CPU, torch.Generator().manual_seed(seed))
    MOE.moe_nvfp4(*case.args, launches="r")  # the routing, interpreted
    return case


def _tiled(case) -> bool:
    """Whether make_case put the experts in the MMA tile layout (case.kwargs tells the raw call and the reference)."""
    return bool(case.kwargs.get("tiled", False))


def _emulate(case, cfg: MM.MmaMoEConfig, alpha: float = MOE.SWIGLU_ALPHA, limit: float = MOE.SWIGLU_LIMIT):
    x, _, _, w13, s13, g13, w2, s2, g2, sw13, ss13, sg13, sw2, ss2, sg2, _, out, ws, _ = case.args
    s = MOE.n_slots(x.shape[0], 16)
    act, y = MM.emulate(x, w13, s13, g13, w2, s2, g2, sw13, ss13, sg13, sw2, ss2, sg2, ws.slot_e, ws.slot_w[:, :],
                        s=s, cfg=cfg, swiglu_alpha=alpha, swiglu_limit=limit, tiled=_tiled(case))
    ws.act.copy_(act)
    out.copy_(y)
    return out, ws


# (tokens, I, RP, gate|up warps, STAGES, DSPLIT, down warps, down stages)
CASES = [
    (1, 128, 1, 4, 2, 1, 4, 2),
    (3, 256, 1, 2, 3, 2, 2, 3),
    (8, 128, 1, 4, 2, 1, 2, 2),
    (5, 256, 2, 2, 2, 2, 1, 3),
]


@pytest.mark.parametrize("tokens,i,rp,w,st,ds,dw,dst", CASES)
def test_emulated_moe_matches_the_reference(tokens, i, rp, w, st, ds, dw, dst) -> None:
    cfg = MM.MmaMoEConfig(BT=16, RBE=16, RBK=64, RSPLIT=2, RP=rp, num_warps=w, STAGES=st, DSPLIT=ds, down_warps=dw,
                          down_stages=dst)
    case = _case(cfg, tokens, i, 50 + tokens)
    out, ws = _emulate(case, cfg)
    assert bool(torch.isfinite(out.float()).all())
    MOE.compare(out, MOE.moe_reference(*case.args, **case.kwargs), case)


def test_other_swiglu_constants_reach_the_epilogue() -> None:
    """alpha / limit are runtime inputs of the PTX epilogue: another config's values give other activations, and
    those pass the compare made with the same values."""
    cfg = MM.MmaMoEConfig(BT=16, RBE=16, RBK=64, RSPLIT=2, DSPLIT=1)
    case = _case(cfg, 2, 128, 7)
    case.kwargs.update(swiglu_alpha=1.2, swiglu_limit=3.0)
    out, ws = _emulate(case, cfg, 1.2, 3.0)
    MOE.compare(out, MOE.moe_reference(*case.args, **case.kwargs), case)
    layout = {k: v for k, v in case.kwargs.items() if k == "tiled"}
    with pytest.raises(AssertionError):
        MOE.compare(out, MOE.moe_reference(*case.args, **layout), dataclasses.replace(case, kwargs=layout))


def _patched(monkeypatch, fn_name: str, key: str, old: str, new: str) -> None:
    real = getattr(MM, fn_name).__wrapped__

    def patched(*a):
        blocks = dict(real(*a))
        assert old in blocks[key]
        blocks[key] = blocks[key].replace(old, new)
        return blocks

    monkeypatch.setattr(MM, fn_name, patched)


@pytest.mark.parametrize("fn_name,key,old,new,what", [
    ("gate_up_asm", "LOAD", "add.s64 wb, wa, $18;", "add.s64 wb, wa, 0;", "up rows read as the gate rows"),
    ("down_asm", "FOLD", "selp.f32 w1, w1, 0f3F800000, pw;", "selp.f32 w1, 0f3F800000, 0f3F800000, pw;",
     "odd tokens' routing weight replaced by 1"),
])
def test_wrong_ptx_is_caught(monkeypatch, fn_name, key, old, new, what) -> None:
    cfg = MM.MmaMoEConfig(BT=16, RBE=16, RBK=64, RSPLIT=2, DSPLIT=1, num_warps=2, down_warps=2)
    case = _case(cfg, 2, 128, 11)
    _patched(monkeypatch, fn_name, key, old, new)
    out, ws = _emulate(case, cfg)
    with pytest.raises(AssertionError):
        MOE.compare(out, MOE.moe_reference(*case.args, **case.kwargs), case)


def test_config_and_argument_errors() -> None:
    with pytest.raises(ValueError, match="STAGES"):
        MM.MmaMoEConfig(STAGES=4)
    with pytest.raises(ValueError, match="down_warps"):
        MM.MmaMoEConfig(down_warps=3)
    assert "multiple" in MM.MmaMoEConfig(DSPLIT=5).fits(6144, 3072)
    cfg = MM.MmaMoEConfig(BT=16, RBE=16, RBK=64, RSPLIT=2, DSPLIT=1)
    cell = Cell(rows=(2, 2), shape=(16, 256, 128, 1), why="test", config={"moe": cfg})
    case = MOE.make_case(cell, 2, CPU, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="NVFP4 shared expert only"):
        MOE.moe_nvfp4(*case.args, **case.kwargs)


def test_cpu_raw_call_interprets_the_same_function() -> None:
    """On CPU tensors the raw call with an MmaMoEConfig runs moe/_nvfp4.py's kernels in the same workspace."""
    cfg = MM.MmaMoEConfig(BT=16, RBE=16, RBK=64, RSPLIT=2, DSPLIT=2)
    cell = Cell(rows=(3, 3), shape=(16, 256, 256, 0), why="test", config={"moe": cfg})
    case = MOE.make_case(cell, 3, CPU, torch.Generator().manual_seed(5))
    out = MOE.moe_nvfp4(*case.args, **case.kwargs)
    MOE.compare(out, MOE.moe_reference(*case.args, **case.kwargs), case)


# --- the MMA tile layout ------------------------------------------------------------------------------------


def _weights(case) -> dict:
    """The NVFP4 (packed, scales) pairs of a case, row-major: routed gate|up and down, then the shared expert's."""
    _, _, _, w13, s13, _, w2, s2, _, sw13, ss13, _, sw2, ss2, *_ = case.args
    pairs = {"w13": (w13, s13), "w2": (w2, s2), "sw13": (sw13, ss13), "sw2": (sw2, ss2)}
    return {name: untile_nvfp4(*pair) for name, pair in pairs.items()} if _tiled(case) else pairs


def _emulate_weights(case, cfg: MM.MmaMoEConfig, weights: dict, tiled: bool):
    """(act, y) of emulate with `weights` in place of the case's, read in the layout `tiled` names."""
    x, _, _, _, _, g13, _, _, g2, _, _, sg13, _, _, sg2, _, _, ws, _ = case.args
    return MM.emulate(x, *weights["w13"], g13, *weights["w2"], g2, *weights["sw13"], sg13, *weights["sw2"], sg2,
                      ws.slot_e, ws.slot_w, s=MOE.n_slots(x.shape[0], 16), cfg=cfg, swiglu_alpha=MOE.SWIGLU_ALPHA,
                      swiglu_limit=MOE.SWIGLU_LIMIT, tiled=tiled)


# (tokens, I, RP, gate|up warps, STAGES, GSPLIT, GSPLIT_SLOTS): H = 256 is two MMA steps, so a 2-way split gives each
# split one step (the ring's clamped reloads run from the first step); a second column of CTAs (I = 256, RP 1, 2
# warps: BNA 16) has its own ticket
SPLIT_CASES = [
    (1, 128, 1, 4, 2, 2, 64),
    pytest.param(3, 256, 1, 2, 3, 2, 64, marks=pytest.mark.slow),   # 53 s on 2 cores: slow tier
    (2, 128, 2, 2, 2, 2, 64),
]


@pytest.mark.parametrize("tokens,i,rp,w,st,gs,slots", SPLIT_CASES)
def test_gate_up_split_matches_the_reference(tokens, i, rp, w, st, gs, slots) -> None:
    """The gate|up launch split over H (each split's raw sums through gate_up_partial_asm, the last arrival's
    ordered sum and SwiGLU in swiglu_of_sums' operations) passes moe.nvfp4's compare: act starts as NaN, so a
    tile no split finished fails. At H = 256 each split is one MMA step, whose sum starts from +0.0, so the two
    partials added are exactly the whole-K launch's running sum: the split's act must equal the unsplit launch's
    bit for bit, which checks the partials' places (gate / up, token rows, columns) and that the Triton epilogue
    is swiglu_store_asm's operation for operation."""
    cfg = MM.MmaMoEConfig(BT=16, RBE=16, RBK=64, RSPLIT=2, RP=rp, num_warps=w, STAGES=st, DSPLIT=1, down_warps=2,
                          GSPLIT=gs, GSPLIT_SLOTS=slots)
    s = MOE.n_slots(tokens, 16)
    assert cfg.gate_up_split(s + 1) == gs
    case = _case(cfg, tokens, i, 70 + tokens)
    out, ws = _emulate(case, cfg)
    MOE.compare(out, MOE.moe_reference(*case.args, **case.kwargs), case)
    split_act = ws.act.clone()
    whole = dataclasses.replace(cfg, GSPLIT=1)
    _emulate(case, whole)
    assert _same_bits(split_act, ws.act)


def test_gate_up_split_is_chosen_by_the_slot_count() -> None:
    cfg = MM.MmaMoEConfig(GSPLIT=4, GSPLIT_SLOTS=20)
    assert [cfg.gate_up_split(n) for n in (5, 9, 13, 17, 33)] == [4, 2, 1, 1, 1]
    assert MM.MmaMoEConfig().gate_up_split(5) == 1            # the class default: no split
    assert MM.MmaMoEConfig(GSPLIT=3, GSPLIT_SLOTS=20).gate_up_split(5) == 3
    with pytest.raises(ValueError, match="GSPLIT"):
        MM.MmaMoEConfig(GSPLIT=5)
    assert "GSPLIT" in MM.MmaMoEConfig(GSPLIT=8).fits(512, 3072)   # H / 8 = 64 is less than one MMA step


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


# (tokens, I, RP, gate|up warps, STAGES, DSPLIT, down warps, down stages): RP * warps even everywhere (tiled needs
# whole 16-row blocks per gate|up CTA); the first and last span two row blocks per CTA in both kernels, so the
# row-block strides sw / ss are exercised, not only the CTA's first block; I = 256 for down's words to move too
TILED_CASES = [
    (1, 128, 1, 4, 2, 1, 2, 2),
    (5, 128, 2, 2, 3, 1, 1, 3),
    (1, 256, 2, 1, 3, 2, 2, 2),
    pytest.param(3, 256, 1, 2, 2, 2, 4, 3, marks=pytest.mark.slow),   # the heaviest case (16 s on 2 cores): slow tier
]


@pytest.mark.parametrize("tokens,i,rp,w,st,ds,dw,dst", TILED_CASES)
def test_tiled_layout_gives_the_same_bits(tokens, i, rp, w, st, ds, dw, dst) -> None:
    """Every expert's weights in the MMA tile layout (routed and shared, gate|up and down), read by the tiled load
    blocks and step addresses, give act and y bit-identical to the row-major weights read row-major; the
    tiled reads of the row-major bytes give something else (the layout is a real permutation of what is read)."""
    cfg = MM.MmaMoEConfig(BT=16, RBE=16, RBK=64, RSPLIT=2, RP=rp, num_warps=w, STAGES=st, DSPLIT=ds, down_warps=dw,
                          down_stages=dst)
    case = _case(cfg, tokens, i, 60 + tokens)
    rows = _weights(case)
    tiles = {name: tile_nvfp4(*pair) for name, pair in rows.items()}
    # at K = 128 (down with I = 128) a tile's bytes are in row order already and only the scales move
    assert not any(torch.equal(tiles[n][0], rows[n][0]) and torch.equal(tiles[n][1], rows[n][1]) for n in rows)
    act, y = _emulate_weights(case, cfg, rows, tiled=False)
    assert bool(torch.isfinite(y.float()).all())
    act_t, y_t = _emulate_weights(case, cfg, tiles, tiled=True)
    assert _same_bits(act_t, act)
    assert _same_bits(y_t, y)
    act_w, y_w = _emulate_weights(case, cfg, rows, tiled=True)
    assert not _same_bits(act_w, act)
    assert not _same_bits(y_w, y)


@pytest.mark.parametrize("rp", [1, 2])
def test_load_blocks_of_each_layout(rp) -> None:
    """The row-major variants keep load_asm's text; the tiled ones swap in the tiled loads only, and the tiled
    gate|up load has load_asm(gate_up=True)'s operands in its order, so the decode and SwiGLU blocks read both."""
    rows_gu = P.load_asm(P.FMT_NVFP4, rp, gate_up=True)
    assert (MM.gate_up_asm(rp)["LOAD"], MM.gate_up_asm(rp)["LOAD_C"]) == rows_gu
    tiled_gu = MM.gate_up_asm(rp, True)
    assert (tiled_gu["LOAD"], tiled_gu["LOAD_C"]) == P.tiled_gate_up_load_asm(rp)
    assert tiled_gu["LOAD_C"] == rows_gu[1]
    rest = lambda blocks: {k: v for k, v in blocks.items() if k not in ("LOAD", "LOAD_C")}  # noqa: E731
    assert rest(tiled_gu) == rest(MM.gate_up_asm(rp))
    for partial in (False, True):
        rows_dn = MM.down_asm(rp, partial)
        assert (rows_dn["LOAD"], rows_dn["LOAD_C"]) == P.load_asm(P.FMT_NVFP4, rp)
        tiled_dn = MM.down_asm(rp, partial, True)
        assert (tiled_dn["LOAD"], tiled_dn["LOAD_C"]) == P.tiled_load_asm(rp)
        assert rest(tiled_dn) == rest(rows_dn)


def test_tiled_needs_whole_row_blocks_per_gate_up_cta() -> None:
    """8 * RP * num_warps gate|up columns a CTA: with RP * num_warps odd a CTA would start mid-block."""
    cfg = MM.MmaMoEConfig(BT=16, RBE=16, RBK=64, RSPLIT=2, RP=1, num_warps=1, DSPLIT=1)
    assert cfg.fits(256, 128) is None
    assert "RP=1, num_warps=1" in cfg.fits(256, 128, tiled=True)
    case = _case(cfg, 2, 128, 13)
    with pytest.raises(ValueError, match="RP=1, num_warps=1"):
        _emulate_weights(case, cfg, {n: tile_nvfp4(*p) for n, p in _weights(case).items()}, tiled=True)
    x = torch.empty(2, 256, dtype=torch.bfloat16, device="meta")  # passes the device check, launches nothing
    with pytest.raises(ValueError, match="RP=1, num_warps=1"):
        MM.launch_mma_moe(x, *([None] * 14), t=2, h=256, e=16, i=128, s=8, swiglu_alpha=MOE.SWIGLU_ALPHA,
                          swiglu_limit=MOE.SWIGLU_LIMIT, cfg=cfg, launches="gd", tiled=True)


# --- hoisted gate|up loads (MmaMoEConfig.HOIST) ---------------------------------------------------------------

# (tokens, I, RP, gate|up warps, tiled, GSPLIT): every token count of {1, 3, 8} in both layouts and both row-pair
# counts; at 1 and 3 tokens lanes of tokens >= T load no x (the offset's ~0 stands for the predicate); 8 * RP * warps
# is a multiple of 16 where tiled; the last case splits H (the loop from another k_lo)
HOIST_CASES = [
    (1, 128, 1, 2, True, 1),
    (1, 128, 2, 1, False, 1),
    (3, 128, 1, 2, False, 1),
    (3, 256, 2, 1, True, 1),
    (8, 128, 1, 4, True, 1),
    (8, 128, 2, 2, False, 1),
    (2, 128, 1, 2, True, 2),
]


def _hoist_pair(tokens, i, rp, w, tiled, gs, seed):
    """(case, config, the case's weights in the layout `tiled` names) for comparing HOIST against the default."""
    cfg = MM.MmaMoEConfig(BT=16, RBE=16, RBK=64, RSPLIT=2, RP=rp, num_warps=w, DSPLIT=1, down_warps=2, GSPLIT=gs,
                          GSPLIT_SLOTS=64 if gs > 1 else 0)
    case = _case(cfg, tokens, i, seed)
    weights = _weights(case)
    if tiled:
        weights = {name: tile_nvfp4(*pair) for name, pair in weights.items()}
    return case, cfg, weights


@pytest.mark.parametrize("tokens,i,rp,w,tiled,gs", HOIST_CASES)
def test_hoisted_gate_up_loads_give_the_same_bits(tokens, i, rp, w, tiled, gs) -> None:
    """HOIST runs the offsets' prologue once and the hoisted load blocks in the loop: they read the same bytes into
    the same registers, so act and y are the default blocks' bits (both start as NaN: an unwritten element differs
    from a written one)."""
    case, cfg, weights = _hoist_pair(tokens, i, rp, w, tiled, gs, 80 + tokens + 10 * rp)
    act, y = _emulate_weights(case, cfg, weights, tiled)
    assert bool(torch.isfinite(y.float()).all())
    act_h, y_h = _emulate_weights(case, dataclasses.replace(cfg, HOIST=True), weights, tiled)
    assert _same_bits(act_h, act)
    assert _same_bits(y_h, y)


def test_wrong_hoisted_offsets_are_caught(monkeypatch) -> None:
    """The comparison above sees a hoisted block that reads other bytes: a prologue that drops the lane's 16 bytes
    from the tiled word offset gives other activations."""
    case, cfg, weights = _hoist_pair(3, 128, 1, 2, True, 1, 83)
    act, _ = _emulate_weights(case, cfg, weights, True)
    real = MM.gate_up_asm.__wrapped__

    def patched(rp, tiled=False, hoist=False):
        blocks = dict(real(rp, tiled, hoist))
        if hoist:
            assert "mad.lo.u32 cb, lane, 16, cb;" in blocks["OFFS"]
            blocks["OFFS"] = blocks["OFFS"].replace("mad.lo.u32 cb, lane, 16, cb;", "mad.lo.u32 cb, lane, 0, cb;")
        return blocks

    monkeypatch.setattr(MM, "gate_up_asm", patched)
    act_h, _ = _emulate_weights(case, dataclasses.replace(cfg, HOIST=True), weights, True)
    assert not _same_bits(act_h, act)


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("rp", [1, 2])
def test_hoisted_blocks_leave_the_lane_arithmetic_to_the_prologue(rp, tiled) -> None:
    """The hoisted loop's blocks read no special register (their per-thread values come from the prologue, which
    does), keep the default blocks' outputs, and everything else of gate_up_asm is unchanged."""
    hoisted, default = MM.gate_up_asm(rp, tiled, True), MM.gate_up_asm(rp, tiled)
    for key in ("LOAD", "XLOAD"):
        assert "%laneid" not in hoisted[key] and "%tid" not in hoisted[key]
        assert "%laneid" in default[key]
    assert "%laneid" in hoisted["OFFS"] and "%tid.x" in hoisted["OFFS"]
    assert hoisted["N_LOAD"] == default["N_LOAD"] and hoisted["HOIST"] is True
    assert hoisted["LOAD_C"].count("=") == default["LOAD_C"].count("=")
    assert hoisted["XLOAD_C"].count("=") == default["XLOAD_C"].count("=")
    same = ("MMA", "MMA_C", "STORE", "STORE_C", "PART", "PART_C")
    assert {k: hoisted[k] for k in same} == {k: default[k] for k in same}
    assert not {"HOIST", "OFFS", "OFFS_C", "N_OFF"} & set(default)


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("rp", [1, 2])
def test_hoisted_blocks_load_the_default_blocks_registers(rp, tiled) -> None:
    """Block by block on random bytes: after the prologue, the hoisted weight and x loads give every lane of every
    warp the registers the default blocks give it, lanes of tokens >= T included (poisoned alike: neither loads)."""
    import numpy as np

    from m3serve.kernels.gemm import _ptx_emu as E

    mem = E.Memory()
    base = mem.add(np.random.default_rng(17 + rp).integers(0, 256, 1 << 20, dtype=np.uint8))
    wk, sk, xk = base + 4096, base + 300_000, base + 600_000   # a step's bases, 16-byte aligned
    sw, ss, sx, ub, usb = 4096, 512, 2 * 4096, 100_000, 150_000

    def pair(*vals):
        return [np.full(E.LANES, v, np.uint64) for v in vals for _ in range(2)]

    default, hoisted = MM.gate_up_asm(rp, tiled), MM.gate_up_asm(rp, tiled, True)
    n_load = 2 * default["N_LOAD"]
    for tokens in (1, 3, 8):
        for warp in range(4):
            offs = E.run_block(hoisted["OFFS"], warp, pair(sw, ss, sx, tokens - 1), 2 * hoisted["N_OFF"], mem)
            want = E.run_block(default["LOAD"], warp, pair(wk, sk, sw, ss, ub, usb), n_load, mem)
            got = E.run_block(hoisted["LOAD"], warp, pair(wk, sk) + offs[2:] + pair(ub, usb), n_load, mem)
            assert all(np.array_equal(a, b) for a, b in zip(got, want))
            want = E.run_block(default["XLOAD"], warp, pair(xk, sx, tokens - 1), P.X_REGS, mem)
            got = E.run_block(hoisted["XLOAD"], warp, pair(xk) + offs[:2], P.X_REGS, mem)
            assert all(np.array_equal(a, b) for a, b in zip(got, want))
            assert (np.asarray(want[0]) == 0x7FC07FC0).sum() == 4 * (8 - tokens)   # the lanes that load nothing


def test_hoist_config_errors() -> None:
    """HOIST serves the paired loop at ring depth 2 only; its 32-bit offsets refuse shapes they cannot hold."""
    with pytest.raises(ValueError, match="HOIST.*PAIRED=False"):
        MM.MmaMoEConfig(HOIST=True, PAIRED=False)
    with pytest.raises(ValueError, match="HOIST.*STAGES=3"):
        MM.MmaMoEConfig(HOIST=True, STAGES=3)
    cfg = MM.MmaMoEConfig(HOIST=True)
    MM.check_hoist_offsets(cfg, 6144, 2 * 6144)
    with pytest.raises(ValueError, match="32-bit"):
        MM.check_hoist_offsets(cfg, 2**28, 2 * 6144)
    with pytest.raises(ValueError, match="32-bit"):
        MM.check_hoist_offsets(cfg, 6144, 2**29)
    with pytest.raises(ValueError, match="RP 1 or 2"):
        P.gate_up_lane_offsets_asm(3, True)


@pytest.mark.slow  # an sm_90 build of the M3 gate|up launch (~20 s on 2 cores)
def test_no_asm_block_is_folded_to_a_splat() -> None:
    """Triton folds a pure inline-asm block whose inputs are all uniform (splat) into a splat of its first output:
    every element after the first gets that one (the LLVM call shows an `undef` operand). The hoisted offsets'
    prologue has only uniform inputs and per-thread outputs, so folded it handed each thread its word offset as its
    scale offset (a GPU test caught it; the emulation runs the block's text and cannot). No gate|up block of the
    HOIST launch may be folded."""
    from m3serve.kernels import aot_check
    from m3serve.kernels._jit import aot_build
    from m3serve.kernels.catalog import all_entries

    e = all_entries()["moe.nvfp4"]
    cell = next(c for c in e.cells if isinstance(c.config["moe"], MM.MmaMoEConfig) and c.shape[2] == 3072)
    one = dataclasses.replace(e, cells=(dataclasses.replace(
        cell, rows=(1, 1), config=dict(cell.config, moe=dataclasses.replace(cell.config["moe"], HOIST=True))),))
    checked = 0
    for _key, (_e, _why, kern, args, kwargs) in aot_check.collect([one]).items():
        if kern.__name__ != "mma_moe_gate_up":
            continue
        calls = [line for line in aot_build(kern, args, kwargs).asm["llir"].splitlines() if " asm " in line]
        assert calls and not [c for c in calls if "undef" in c]
        checked += 1
    assert checked == 1
