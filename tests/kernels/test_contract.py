"""The catalog contract itself: every entry is complete, every cell says why, every module has
its ENABLED switch, nothing reads the environment, and the linear configs are consistent."""

from __future__ import annotations

import importlib
import inspect
import pathlib

import pytest

import m3serve.kernels as kernels_pkg
from m3serve.kernels import catalog
from m3serve.kernels.catalog import all_entries

ENTRIES = all_entries()
ROW_PARALLEL = ("norm.rms", "norm.add_rms", "attn.qk_prep", "mlp.swiglu_oai", "moe.route_small", "attn.rope",
                "mlp.silu_mul", "spec.inputs", "spec.accept", "spec.commit")


def test_entries_are_complete() -> None:
    assert set(ENTRIES) == {"linear.nvfp4", "linear.mxfp8", "linear.fp8", "linear.bf16", "qkv.nvfp4", "qkv.mxfp8", "qkv.fp8",
                            "linear.nvfp4.tiled", "linear.mxfp8.tiled", "linear.fp8.tiled",
                            "norm.add_rms", "head.bf16", "head.head12", "head.head12_logits", "moe.nvfp4", "moe.grouped",
                            "kv.write", "msa.scores", "msa.select", "attn.paged", "attn.prefill", "attn.prefill_sparse",
                            "norm.rms", "attn.qk_prep", "mlp.swiglu_oai", "moe.route_small",
                            "attn.rope", "mlp.silu_mul", "spec.inputs", "spec.accept", "spec.commit",
                            "sample.race"}
    for name, e in ENTRIES.items():
        assert e.cells and e.interp_cells, name
        assert e.archs == ("sm_90",)
        for c in e.cells + e.interp_cells:
            assert c.why.strip(), f"{name}: a cell without a reason"
            # kv.write rows = tokens in the step, msa.* rows = query rows per sequence: both have prefill cells
            top = 8192 if e.kind in ("kv.write", "msa.scores", "msa.select") else 48
            # rows = query tokens per sequence (prefill chunks)
            top = 16384 if e.kind in ("attn.prefill", "attn.prefill_sparse") else top
            # row-parallel elementwise entries and the speculative bookkeeping serve every decode graph bucket
            top = catalog.ROW_CELLS_MAX if e.kind in ROW_PARALLEL else top
            top = 256 if e.kind.startswith("spec.") else top
            # prefill chunks (rows = tokens of the step): the grouped MoE and the M-tiled quantized linears
            top = 16384 if e.kind == "moe.grouped" or name.endswith(".tiled") else top
            top = 256 if e.kind.startswith("spec.") else top  # rows = sequences of a bucket (up to 256)
            top = 512 if e.kind == "sample.race" else top      # rows = sequences of a decode graph bucket
            assert 1 <= c.rows[0] <= c.rows[1] <= top, f"{name}: rows {c.rows}"
        # raw call and reference share the signature (the reference may ignore outputs/workspaces)
        assert list(inspect.signature(e.raw_call).parameters)[:3] == list(inspect.signature(e.reference).parameters)[:3]


@pytest.mark.parametrize("mod", catalog.ENTRY_MODULES)
def test_each_entry_module_has_one_enabled_switch(mod: str) -> None:
    m = importlib.import_module(mod)
    assert m.ENABLED is True, f"{mod}: fast paths are on by default"
    for e in m.ENTRIES:
        assert e.enabled() is True


def test_no_environment_reads() -> None:
    root = pathlib.Path(kernels_pkg.__file__).parent
    for p in root.rglob("*.py"):
        src = p.read_text()
        assert "os.environ" not in src and "getenv" not in src, f"{p.relative_to(root)} reads the environment"


def test_linear_configs_divide_their_shapes() -> None:
    for name in ("linear.nvfp4", "linear.mxfp8", "linear.fp8", "qkv.nvfp4", "qkv.mxfp8", "qkv.fp8"):
        for c in ENTRIES[name].cells:
            n, k = c.shape
            g = c.config["gemm"]
            assert n % g.BN == 0 and k % (g.BK * g.SPLIT) == 0 and k // (g.BK * g.SPLIT) >= 2, (name, c)
            assert c.rows[1] <= g.BM, (name, c)
            # Narrow k/v projections (<= 3 MB at N <= 512) may use fewer programs: more split-K would move more
            # fp32 partials than weight bytes, and at that size the launch, not the stream, sets the time.
            min_programs = 96 if n >= 2048 else 16
            assert (n // g.BN) * g.SPLIT >= min_programs, f"{name} {c.shape}: too few programs to stream the weight"


def test_step_metadata_pointers_are_not_specialised_on_alignment():
    """Sequence lengths and query starts are views at offsets of one staged upload, so their 16-byte alignment
    follows the step's sequence and token counts: specialised on it, a kernel would build a variant per alignment
    while serving (seen on the H200: msa.scores compiled after the warm-up when a step's count moved the lengths
    onto an aligned address)."""
    from m3serve.kernels.attention._paged import paged_attn_split
    from m3serve.kernels.attention.msa_index import _block_scores_kernel, _block_scores_prefill_kernel, _select_kernel
    from m3serve.kernels.attention.prefill import _prefill_attention_kernel
    for k, names in ((paged_attn_split, ("len_ptr", "qs_ptr")), (_block_scores_kernel, ("lens_ptr", "qs_ptr")),
                     (_block_scores_prefill_kernel, ("lens_ptr", "qs_ptr")),
                     (_select_kernel, ("lens_ptr", "qs_ptr")),
                     (_prefill_attention_kernel, ("seq_lens_ptr", "qstart_ptr"))):
        params = {p.name: p for p in k.gpu.params}
        assert all(params[n].do_not_specialize_on_alignment for n in names), k.__name__
        assert not params["q_ptr" if "q_ptr" in params else "scores_ptr"].do_not_specialize_on_alignment
