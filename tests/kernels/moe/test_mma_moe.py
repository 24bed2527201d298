"""The MoE on the register-operand MMA step (m3serve/kernels/moe/_mma.py) on the CPU.

The router runs interpreted (its Triton kernel, as on the GPU); the gate|up and down kernels' PTX blocks run on
the warp emulator (gemm/_ptx_emu.py) through their own step logic (moe/_mma.py's emulate), and the result goes through
moe.nvfp4's certified compare: routing, every slot's activations (one bf16 ulp + the gate/up summation bound
through SwiGLU-OAI's derivative bounds) and the output (gemm_band against the kernel's own activations). The
activations and the output start as NaN, so an unwritten element fails. The emulator's exp2 is numpy's; the
hardware's ex2.approx is within 2 fp32 ulp of it, far inside the one-bf16-ulp term.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from m3serve.kernels.moe import _mma as MM
from m3serve.kernels.moe import nvfp4 as MOE
from m3serve.kernels.catalog import Cell

CPU = torch.device("cpu")


def _case(cfg: MM.MmaMoEConfig, tokens: int, i: int, seed: int):
    cell = Cell(rows=(tokens, tokens), shape=(16, 256, i, 0), why="test", config={"moe": cfg})
    case = MOE.make_case(cell, tokens, CPU, torch.Generator().manual_seed(seed))
    MOE.moe_nvfp4(*case.args, launches="r")  # the routing, interpreted
    return case


def _emulate(case, cfg: MM.MmaMoEConfig, alpha: float = MOE.SWIGLU_ALPHA, limit: float = MOE.SWIGLU_LIMIT):
    x, _, _, w13, s13, g13, w2, s2, g2, sw13, ss13, sg13, sw2, ss2, sg2, _, out, ws, _ = case.args
    s = MOE.n_slots(x.shape[0], 16)
    act, y = MM.emulate(x, w13, s13, g13, w2, s2, g2, sw13, ss13, sg13, sw2, ss2, sg2, ws.slot_e, ws.slot_w[:, :],
                        s=s, cfg=cfg, swiglu_alpha=alpha, swiglu_limit=limit)
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
    MOE.compare(out, MOE.moe_reference(*case.args), case)


def test_other_swiglu_constants_reach_the_epilogue() -> None:
    """alpha / limit are runtime inputs of the PTX epilogue: another config's values give other activations, and
    those pass the compare made with the same values."""
    cfg = MM.MmaMoEConfig(BT=16, RBE=16, RBK=64, RSPLIT=2, DSPLIT=1)
    case = _case(cfg, 2, 128, 7)
    case.kwargs.update(swiglu_alpha=1.2, swiglu_limit=3.0)
    out, ws = _emulate(case, cfg, 1.2, 3.0)
    MOE.compare(out, MOE.moe_reference(*case.args, **case.kwargs), case)
    with pytest.raises(AssertionError):
        MOE.compare(out, MOE.moe_reference(*case.args), dataclasses.replace(case, kwargs={}))


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
        MOE.compare(out, MOE.moe_reference(*case.args), case)


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
        MOE.moe_nvfp4(*case.args)


def test_cpu_raw_call_interprets_the_same_function() -> None:
    """On CPU tensors the raw call with an MmaMoEConfig runs moe/_nvfp4.py's kernels in the same workspace."""
    cfg = MM.MmaMoEConfig(BT=16, RBE=16, RBK=64, RSPLIT=2, DSPLIT=2)
    cell = Cell(rows=(3, 3), shape=(16, 256, 256, 0), why="test", config={"moe": cfg})
    case = MOE.make_case(cell, 3, CPU, torch.Generator().manual_seed(5))
    out = MOE.moe_nvfp4(*case.args)
    MOE.compare(out, MOE.moe_reference(*case.args), case)
