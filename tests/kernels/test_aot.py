"""Every kernel compiles for sm_90 (Triton's bundled ptxas; no GPU needed) at a real M3 cell,
without register spills. The full sweep over all cells is `python -m m3serve.kernels.aot_check`."""

from __future__ import annotations

import pytest
import torch

from m3serve.kernels import aot_check
from m3serve.kernels.catalog import all_entries

ENTRIES = all_entries()
# one real cell per kernel family: split-K GEMM per weight format, both heads, the norm, the MoE (attn.prefill_sparse:
# its FP8 cell, the tightest on registers)
PICK = {"linear.nvfp4": 0, "linear.mxfp8": 0, "linear.fp8": 0, "linear.nvfp4.tiled": 1, "linear.mxfp8.tiled": 1,
        "linear.fp8.tiled": 1, "head.bf16": 0, "head.head12": 0, "head.head12_logits": 0,
        "norm.add_rms": 0, "moe.nvfp4": 0, "moe.grouped": None, "kv.write": 0, "msa.scores": 0, "msa.select": 0,
        "attn.paged": 4, "attn.prefill": 0, "attn.prefill_sparse": 1, "norm.rms": 0, "attn.qk_prep": 0,
        "mlp.swiglu_oai": 0, "moe.route_small": 0, "sample.race": 0}


@pytest.mark.parametrize("name", sorted(PICK))
def test_kernels_compile_for_sm90_without_spills(name: str) -> None:
    e = ENTRIES[name]
    if name == "moe.grouped":  # NVFP4 experts decoded in registers at M3 TP1 prefill rows (BM 128)
        cell = next(c for c in e.cells if c.shape == (0, 128, 6144, 3072, 4) and c.rows[0] == 2049)
    else:
        cell = e.cells[PICK[name]]
    one = type(e)(**{**e.__dict__, "cells": (cell,)})
    results = aot_check.run([one], arch=90)
    assert results, f"{name}: no kernel launch captured"
    for _, _, r in results:
        assert r.regs > 0, f"{name}/{r.name}: cubin has no register count"
        assert r.stack == 0 and r.local == 0, f"{name}/{r.name}: spills ({r.stack} B stack) at {cell.why}"


@pytest.mark.parametrize("ifmt", ["bf16", "fp8"])
def test_msa_scores_prefill_tiling_compiles_for_sm90_without_spills(ifmt: str) -> None:
    """msa.scores' prefill-chunk cell at M3 TP1 (Hk 4, Di 128, P 128) launches the query-stationary kernel (a
    128-row index-q tile held across the block walk) and it builds without spills for both index-K formats."""
    from m3serve.kernels.attention import msa_index as mi
    e = ENTRIES["msa.scores"]
    cell = next(c for c in e.cells if c.shape == (4, 128, 128, mi.IFMT_CODE[ifmt], 16) and c.rows[0] > 48)
    one = type(e)(**{**e.__dict__, "cells": (cell,)})
    assert {kern.__name__ for _, _, kern, _, _ in aot_check.collect([one]).values()} == {"_block_scores_prefill_kernel"}
    for _, _, r in aot_check.run([one], arch=90):
        assert r.regs > 0 and r.stack == 0 and r.local == 0, f"{r.name}: {r.regs} regs, {r.stack} B stack"


@pytest.mark.parametrize("tiled", [False, True], ids=["rows", "tiled"])
def test_mma_moe_layouts_compile_for_sm90_without_spills(monkeypatch, tiled: bool) -> None:
    """moe.nvfp4's MMA step (1-8 tokens) with its weights row-major and in the MMA tile layout (moe/_mma.py,
    launch_mma_moe's tiled, forced here whatever layout make_case picks): both variants' load blocks assemble
    for sm_90 and both kernels stay spill-free."""
    from m3serve.kernels.moe import nvfp4 as moe_nvfp4
    from m3serve.kernels.moe._mma import MmaMoEConfig

    real = moe_nvfp4.launch_mma_moe
    monkeypatch.setattr(moe_nvfp4, "launch_mma_moe", lambda *a, **kw: real(*a, **{**kw, "tiled": tiled}))
    e = ENTRIES["moe.nvfp4"]
    cell = e.cells[PICK["moe.nvfp4"]]
    assert isinstance(cell.config["moe"], MmaMoEConfig), cell.why
    one = type(e)(**{**e.__dict__, "cells": (cell,)})
    mma = {kern.__name__: kwargs["TILED"] for _, _, kern, _, kwargs in aot_check.collect([one]).values()
           if "TILED" in kwargs}
    assert mma == {"mma_moe_gate_up": tiled, "mma_moe_down": tiled}
    for _, _, r in aot_check.run([one], arch=90):
        assert r.regs > 0 and r.stack == 0 and r.local == 0, f"{r.name}: {r.regs} regs, {r.stack} B stack"


@pytest.mark.parametrize("name,rows", [("linear.mxfp8", (1, 1)), ("linear.mxfp8", (3, 8)), ("linear.nvfp4", (1, 8)),
                                       ("linear.mxfp8", (9, 16))])
def test_tiled_linears_compile_for_sm90_without_spills(name: str, rows: tuple) -> None:
    """The linear cells read the MMA tile layout (their cases hold tiled weights, as the target does): the GEMV, the
    MMA GEMV (its tiled load block: MXFP8's 2 KB tiles) and the tensor-core GEMM compile with TILED and no spills."""
    e = ENTRIES[name]
    cell = next(c for c in e.cells if c.rows == rows and c.shape == (24576, 6144))
    one = type(e)(**{**e.__dict__, "cells": (cell,)})
    launched = [(kern.__name__, kwargs.get("TILED")) for _, _, kern, _, kwargs in aot_check.collect([one]).values()]
    assert launched and all(t is True for _, t in launched), launched
    for _, _, r in aot_check.run([one], arch=90):
        assert r.regs > 0 and r.stack == 0 and r.local == 0, f"{r.name}: {r.regs} regs, {r.stack} B stack"


def test_an_interpreted_launch_leaves_triton_language_as_it_was(tmp_path, monkeypatch) -> None:
    """A CPU (interpreted) launch must not leave triton.language's builtins patched: a kernel compiled later in the
    same process (here norm.rms, with an empty Triton cache so it really is built) would otherwise be built with
    the interpreter's builtins and fail."""
    import torch
    import triton.language as tl
    import triton.language.core as core

    before = {name: getattr(core, name) for name in ("add", "mul", "load", "program_id", "arange")}
    before_tl = {name: getattr(tl, name) for name in ("sum", "zeros", "where")}
    e = ENTRIES["norm.rms"]
    cell = e.interp_cells[0]
    case = e.make_case(cell, cell.rows[0], torch.device("cpu"), torch.Generator().manual_seed(0))
    e.raw_call(*case.args, **case.kwargs)
    assert {n: getattr(core, n) for n in before} == before
    assert {n: getattr(tl, n) for n in before_tl} == before_tl
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    one = type(e)(**{**e.__dict__, "cells": (e.cells[0],)})
    assert all(r.regs > 0 for _, _, r in aot_check.run([one], arch=90))


ROTATED = [("kv.write", i) for i, c in enumerate(ENTRIES["kv.write"].cells) if c.config.get("rotate")
           and c.rows[0] == 1] + [("attn.paged", i) for i, c in enumerate(ENTRIES["attn.paged"].cells)
                                  if c.config["case"].rotate and c.shape[1] != 32]


@pytest.mark.parametrize("name,i", ROTATED, ids=[f"{n}-{i}" for n, i in ROTATED])
def test_rotated_nvfp4_variants_compile_for_sm90_without_spills(name: str, i: int) -> None:
    """The Hadamard-rotated kernels (kv.write's butterfly, attn.paged's q rotation and output un-rotation) compile
    for sm_90 without spills at M3 TP1 and the embedded model's shapes. (M3 TP2's rotated attn.paged has one
    specialisation at 128 registers with an 8-byte stack: docs/kernels.md, known limits.)"""
    e = ENTRIES[name]
    one = type(e)(**{**e.__dict__, "cells": (e.cells[i],)})
    results = aot_check.run([one], arch=90)
    assert results, f"{name}: no kernel launch captured"
    for _, _, r in results:
        assert r.stack == 0 and r.local == 0, f"{name}/{r.name}: spills ({r.stack} B stack) at {e.cells[i].why}"


def test_prefill_attention_fp8_default_compiles_for_sm90_without_spills(tmp_path) -> None:
    """attn.prefill's default tiles for FP8 pages (fp16 operands, 128 keys a step, two heads: the fastest after
    120k of context in bench/prefill_attention_variants.py): they build for sm_90, keep their registers, and the K
    loop converts no E4M3 to bf16 (no F2F instruction: the f16x2 conversion replaces them)."""
    from m3serve.kernels.attention import prefill as pa
    from m3serve.kernels.catalog import Cell
    e = ENTRIES["attn.prefill"]
    tiles = pa.default_tiles(128, 128, torch.float8_e4m3fn)
    assert tiles.f16 and tiles.block_n == 128
    cell = Cell(rows=(4096, 4096), shape=(64, 4, 128, 128, 8), why="fp16 operands", config={"tiles": tiles})
    results = aot_check.run([type(e)(**{**e.__dict__, "cells": (cell,)})], arch=90, sass_dir=str(tmp_path))
    assert results
    for _, _, r in results:
        assert r.regs > 0 and r.stack == 0 and r.local == 0, r
        loops = aot_check.innermost_loops(r.sass)
        assert loops and all("F2F" not in loop.mix for loop in loops), [loop.mix for loop in loops]


@pytest.mark.parametrize("i", range(len(ENTRIES["attn.prefill_sparse"].cells)),
                         ids=[str(c.shape) for c in ENTRIES["attn.prefill_sparse"].cells])
def test_prefill_sparse_cells_compile_for_sm90_without_spills(i: int) -> None:
    """attn.prefill_sparse at every certified cell (M3 TP1/TP2 and the embedded model, bf16 and FP8 pages): the
    selection walk (a counted loop over the selected blocks' key tiles) builds for sm_90 with the cell's tiles and
    no spills; the FP8 tiles (128 rows, 8 warps) are the tight ones."""
    e = ENTRIES["attn.prefill_sparse"]
    results = aot_check.run([type(e)(**{**e.__dict__, "cells": (e.cells[i],)})], arch=90)
    assert results
    for _, _, r in results:
        assert r.regs > 0 and r.stack == 0 and r.local == 0, f"{r.name}: {r.regs} regs, {r.stack} B stack"


def test_ctas_per_sm_follows_the_sm90_limits() -> None:
    """Registers go per warp in units of 256 (a thread's count rounded up to 8): 90 registers x 4 warps hold 5 CTAs
    an SM, 80 hold 6 (the MoE down launch's cap), 255 hold 2 (attn.paged's split); warps, the CTA limit and
    shared memory (plus the 1 KB each CTA reserves) bound it too."""
    assert aot_check.ctas_per_sm(90, 4, 1024) == 5
    assert aot_check.ctas_per_sm(80, 4, 1024) == 6
    assert aot_check.ctas_per_sm(255, 4, 0) == 2
    assert aot_check.ctas_per_sm(16, 1, 0) == 32              # the CTA limit
    assert aot_check.ctas_per_sm(32, 8, 0) == 8               # 64 warps an SM
    assert aot_check.ctas_per_sm(32, 4, 100 * 1024) == 2      # shared memory
    assert aot_check.ctas_per_sm(200, 8, 0) == 1


def test_waves_reports_the_moe_down_launch_in_one_wave() -> None:
    """The one-token MMA-step MoE cell's down launch: 96 x 8 CTAs at <= 80 registers, 6 an SM, under one wave."""
    e = ENTRIES["moe.nvfp4"]
    cell = next(c for c in e.cells if c.rows[0] == 1 and c.shape[2] == 3072 and c.shape[3] == 0)
    import dataclasses
    import re

    lines = aot_check.waves([dataclasses.replace(e, cells=(cell,))], (1,))
    down = [ln for ln in lines if " mma_moe_down " in ln]
    assert len(down) == 1, lines
    m = re.search(r"\(96, 8\)\s+(\d+)\s+(\d+)\s+4\s+(\d+)\s+([\d.]+)", down[0])
    assert m, down[0]
    ctas, regs, per_sm, waves = int(m[1]), int(m[2]), int(m[3]), float(m[4])
    assert (ctas, per_sm) == (768, 6) and regs <= 80 and waves < 1.0, down[0]
