"""Programmatic dependent launch (m3serve/kernels/_pdl.py, _jit.PDL_ENABLED) on the CPU: which kernels take part,
what DualKernel passes them, and what the compiled code contains (sm_90 PTX, no GPU needed)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from m3serve.kernels import _jit
from m3serve.kernels._jit import DualKernel, aot_build, capture_launches
from m3serve.kernels.catalog import all_entries

META = torch.device("meta")

# the decode step's kernels: each follows _pdl's contract (release, wait before any activation access)
DECODE_STEP_KERNELS = {
    "gemv_stream", "mma_gemv", "wstream_gemm", "mma_moe_gate_up", "mma_moe_down", "moe_router", "moe_gate_up",
    "moe_down", "moe_router_rows", "head_partial_argmax", "argmax_reduce", "paged_attn_split", "paged_attn_combine",
    "_add_rmsnorm_kernel", "_rms_norm_kernel", "_kv_write_kernel", "_block_scores_kernel", "_select_kernel",
    "_qk_prep_kernel", "_route_small_kernel", "_gate_kernel", "head12_mma_logits", "head12_escape_argmax",
    "head12_escape_logits", "race_max", "race_sum", "race_argmax",
}


def _all_kernels() -> dict[str, DualKernel]:
    out = {}
    for mod in ("gemm._gemv", "head._argmax", "head._head12_mma", "gemm._mma_gemv", "moe._mma", "moe._nvfp4", "attention._paged",
                "gemm._wstream", "norm.add_rms", "attention.kv_write", "attention.msa_index", "attention.qk_prep",
                "norm.rms", "moe.route_small", "mlp.swiglu", "spec.step", "attention.prefill", "sample.race"):
        m = importlib.import_module(f"m3serve.kernels.{mod}")
        out.update({k.__name__: k for k in vars(m).values() if isinstance(k, DualKernel)})
    return out


def test_the_decode_step_kernels_take_part() -> None:
    kernels = _all_kernels()
    pdl = {name for name, k in kernels.items() if k.pdl}
    assert pdl == DECODE_STEP_KERNELS
    for name in pdl:
        src = inspect.getsource(kernels[name].fn)
        assert src.count("pdl_wait(PDL)") == 1 and src.count("pdl_release(PDL)") == 1, name
        # before the wait: no load, store or atomic of Triton's, no x / activation asm load; only the two GEMVs
        # and the MMA head issue their first weight loads there (load_asm blocks, load_raw of w_ptr / s_ptr)
        body = src[src.index("):\n") + 3:]  # past the signature
        before = body[:body.index("pdl_wait(PDL)")]
        for op in ("tl.load(", "tl.store(", "tl.atomic", "XLOAD, XLOAD_C", "take_ticket", "put_partial"):
            assert op not in before, (name, op)
        assert ("LOAD, LOAD_C" in before or "load_raw(" in before) == (name in ("mma_gemv", "gemv_stream", "head12_mma_logits")), name


def _launches(entry_name: str, rows: int = 4):
    e = all_entries()[entry_name]
    cell = next(c for c in e.cells if c.rows[0] <= rows <= c.rows[1])
    case = e.make_case(cell, rows, META, None)
    with capture_launches() as rec:
        e.raw_call(*case.args, **case.kwargs)
    return rec


@pytest.mark.parametrize("enabled", [True, False])
def test_the_switch_reaches_the_launch(monkeypatch, enabled: bool) -> None:
    monkeypatch.setattr(_jit, "PDL_ENABLED", enabled)
    rec = _launches("linear.nvfp4")
    pdl = [kw for k, _, _, kw in rec if k.pdl]
    assert pdl and all(kw["PDL"] is enabled for kw in pdl)


@pytest.mark.parametrize("inside", [True, False])
def test_pdl_launches_sets_the_switch_for_its_block_only(monkeypatch, inside: bool) -> None:
    """pdl_launches(inside): the launches inside the block see `inside`, those after it the switch as it was, also
    when the block raises (DecodeGraphs captures a bucket's graphs inside it)."""
    monkeypatch.setattr(_jit, "PDL_ENABLED", not inside)
    with _jit.pdl_launches(inside):
        pdl = [kw for k, _, _, kw in _launches("linear.nvfp4") if k.pdl]
        assert pdl and all(kw["PDL"] is inside for kw in pdl)
    assert _jit.PDL_ENABLED is (not inside)
    with pytest.raises(RuntimeError, match="capture failed"), _jit.pdl_launches(inside):
        raise RuntimeError("capture failed")
    assert _jit.PDL_ENABLED is (not inside)


def test_cpu_launches_never_use_pdl(monkeypatch) -> None:
    """On CPU tensors the interpreter runs with PDL=False, whatever the switch (the helpers are inline PTX)."""
    monkeypatch.setattr(_jit, "PDL_ENABLED", True)
    seen = []
    k = _all_kernels()["_rms_norm_kernel"]
    real = k.cpu

    class Spy:
        def __getitem__(self, grid):
            def run(*a, **kw):
                seen.append(dict(kw))
                return real[grid](*a, **kw)
            return run

    monkeypatch.setattr(k, "cpu", Spy())
    e = all_entries()["norm.rms"]
    cell = e.interp_cells[0]
    case = e.make_case(cell, cell.rows[0], torch.device("cpu"), torch.Generator().manual_seed(0))
    out = e.raw_call(*case.args, **case.kwargs)
    e.compare(out, e.reference(*case.args, **case.kwargs), case)
    assert seen and all(kw["PDL"] is False and "launch_pdl" not in kw for kw in seen)


@pytest.mark.parametrize("entry_name", ["linear.nvfp4", "norm.add_rms"])
def test_compiled_code_has_the_grid_dependency_instructions(monkeypatch, entry_name: str) -> None:
    for enabled in (True, False):
        monkeypatch.setattr(_jit, "PDL_ENABLED", enabled)
        kern, _, args, kw = next(r for r in _launches(entry_name) if r[0].pdl)
        ptx = aot_build(kern, args, kw).asm["ptx"]
        n_wait, n_rel = ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")
        assert (n_wait, n_rel) == ((1, 1) if enabled else (0, 0)), (entry_name, enabled, n_wait, n_rel)
