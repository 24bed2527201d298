"""CPU checks of the inline-PTX NVFP4 wiring (no GPU): the SASS loop counter of aot_check on a
hand-made listing; the NVFP4 GEMM / GEMV compiled for sm_90 with and without the PTX decoder
(no spills, the K loop really uses packed bf16 multiplies, fewer instructions per weight on the
tensor-core path); and the MoE kernels honouring SwiGLU alpha / limit other than M3's.

Tolerances: the MoE check uses the entry's own compare (bands derived in moe/nvfp4.py's compare);
instruction counts are compared only as "fewer than", never against fixed numbers."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

import pytest
import torch

from m3serve.kernels import aot_check
from m3serve.kernels.formats import _e2m1_ptx
from m3serve.kernels.moe import nvfp4 as MOE
from m3serve.kernels.catalog import all_entries

_FAKE_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x0 */
        /*0010*/                   LOP3.LUT R2, R3, 0xf000f, RZ, 0xc0, !PT ;   /* 0x0 */
        /*0020*/                   IMAD R2, R2, 0x1040, RZ ;              /* 0x0 */
        /*0030*/               @P0 BRA 0x10 ;                             /* 0x0 */
        /*0040*/                   HMUL2.BF16_V2 R4, R4, R5.H0_H0 ;       /* 0x0 */
        /*0050*/                   FFMA R6, R6, R7, R8 ;                  /* 0x0 */
        /*0060*/                   NOP ;                                  /* 0x0 */
        /*0070*/              @!P1 BRA 0x40 ;                             /* 0x0 */
        /*0080*/                   BRA 0x0 ;                              /* 0x0 */
        /*0090*/                   EXIT ;                                 /* 0x0 */
"""


def test_innermost_loops_and_per_weight_count() -> None:
    loops = aot_check.innermost_loops(_FAKE_SASS)
    # 0x0..0x80 contains both other loops, so only [0x10, 0x30] and [0x40, 0x70] are innermost
    assert [(lp.start, lp.end, lp.count) for lp in loops] == [(0x10, 0x30, 3), (0x40, 0x70, 3)]
    assert loops[1].mix == {"HMUL2": 1, "FFMA": 1, "BRA": 1}  # the NOP is not counted
    loop, per_w = aot_check.k_loop_stats(_FAKE_SASS, {"BN": 4, "BK": 8, "num_warps": 1})
    assert loop is not None and per_w == pytest.approx(3 * 32 / 32)


def _one_cell(name: str, pred) -> object:
    e = all_entries()[name]
    cell = next(c for c in e.cells if pred(c))
    return dataclasses.replace(e, cells=(cell,))


def _k_loop_counts(kind: str) -> dict:
    """Compile one NVFP4 cell both ways and count its inner loop (run in a fresh interpreter, see below)."""
    if kind == "gemv":  # no NVFP4 cell runs the CUDA-core GEMV any more (rows 1-8: the MMA GEMV on tiles); its
        # family's row-1 cell, as the benches still launch it on row-major weights
        from m3serve.kernels.gemm import _linear as L, nvfp4 as LN
        cell = L.decode_linear_cells(LN.WEIGHT_BYTES, LN.GEMV_FAMILY, ((1, 1),))[0]
        one = dataclasses.replace(all_entries()["linear.nvfp4"], cells=(cell,))
    else:
        one = _one_cell("linear.nvfp4", lambda c: type(c.config["gemm"]).__name__ == "GemmConfig" and c.rows == (9, 16))
    lines = aot_check.sass_stats([one], ("triton", "ptx"))
    out = {"switch_restored": _e2m1_ptx.PTX_E2M1 is True, "lines": len(lines)}
    for mode in ("triton", "ptx"):
        _e2m1_ptx.PTX_E2M1 = mode == "ptx"
        try:
            for _key, (_e, _why, kern, args, kwargs) in aot_check.collect([one]).items():
                res = aot_check.aot_compile(kern, args, kwargs, sass=True)
                loop, per_w = aot_check.k_loop_stats(res.sass, kwargs)
                out[mode] = {"stack": res.stack, "local": res.local, "per_weight": per_w,
                             "hmul2": loop.mix.get("HMUL2", 0), "BN": kwargs["BN"], "BK": kwargs["BK"],
                             "num_warps": kwargs.get("num_warps", 4)}
        finally:
            _e2m1_ptx.PTX_E2M1 = True
    return out


@pytest.mark.parametrize("kind", ["gemv", "wstream"])
def test_nvfp4_k_loop_with_and_without_ptx(kind: str) -> None:
    # A fresh process: after hundreds of interpreter launches in the same process, Triton's front end has been
    # seen to fail compiling these kernels ("ir.value has no attribute dtype"); the compile itself is what we test.
    code = ("import json, sys; from tests.kernels.test_nvfp4_ptx_wiring import _k_loop_counts; "
            f"print(json.dumps(_k_loop_counts({kind!r})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=str(pathlib.Path(__file__).resolve().parents[2]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["switch_restored"], "sass_stats must restore the module switch"
    assert got["lines"] >= 2
    for mode in ("triton", "ptx"):
        assert got[mode]["stack"] == 0 and got[mode]["local"] == 0, f"{mode}: spills"
    p = got["ptx"]
    assert p["hmul2"] * 2 * 32 * p["num_warps"] >= p["BN"] * p["BK"], \
        "the PTX path must scale every weight with a packed bf16 multiply"
    if kind == "wstream":
        wt, wp = got["triton"]["per_weight"], p["per_weight"]
        assert wp < wt, f"tensor-core NVFP4 loop: PTX {wp:.2f} vs Triton {wt:.2f} instructions per weight"


def _moe_case(gen: torch.Generator, **kw):
    cell = MOE.INTERP_CELLS[0]
    case = MOE.make_case(cell, 2, torch.device("cpu"), gen)
    return dataclasses.replace(case, kwargs={**case.kwargs, **kw})   # the case's weight layout stays


def test_moe_honours_swiglu_alpha_and_limit() -> None:
    gen = torch.Generator().manual_seed(7)
    case = _moe_case(gen, swiglu_alpha=1.25, swiglu_limit=2.5)
    out = MOE.moe_nvfp4(*case.args, **case.kwargs)
    ref = MOE.moe_reference(*case.args, **case.kwargs)
    MOE.compare(out, ref, case)
    # the same kernel output must fail against M3's constants: the clamp at 2.5 is exercised
    with pytest.raises(AssertionError):
        layout = {"tiled": case.kwargs["tiled"]}
        MOE.compare(out, MOE.moe_reference(*case.args, **layout), dataclasses.replace(case, kwargs=layout))


@pytest.mark.parametrize("kw,exc", [({"swiglu_alpha": float("nan")}, TypeError),
                                    ({"swiglu_limit": "7"}, TypeError),
                                    ({"swiglu_limit": 0.0}, ValueError)])
def test_moe_rejects_bad_swiglu_constants(kw: dict, exc: type) -> None:
    case = _moe_case(torch.Generator().manual_seed(1))
    with pytest.raises(exc, match="swiglu_"):
        MOE.moe_nvfp4(*case.args, **case.kwargs, **kw)
