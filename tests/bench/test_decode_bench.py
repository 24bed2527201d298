"""bench/decode.py's per-class GPU time: every catalog kernel is attributed to its op family by the package's own
kernel objects (no hand-kept name list), cuBLAS / copies / PyTorch kernels to their classes."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from decode import kernel_class, triton_families  # noqa: E402


def test_every_family_is_found_and_named_by_its_sub_package():
    fam = triton_families()
    want = {"_kv_write_kernel": "attention", "paged_attn_split": "attention", "_block_scores_kernel": "attention",
            "_rms_norm_kernel": "norm", "_add_rmsnorm_kernel": "norm", "grouped_gate_up": "moe",
            "grouped_down": "moe", "_gate_kernel": "mlp", "_prepare_kernel": "kv"}
    assert {k: fam.get(k) for k in want} == want
    assert {"gemm", "moe", "attention", "norm", "mlp", "head", "spec", "kv"} <= set(fam.values())


def test_other_kernels_by_name():
    fam = triton_families()
    assert kernel_class("grouped_down", fam) == "moe"
    assert kernel_class("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn>", fam) \
        == "cublas"
    assert kernel_class("nvjet_tst_128x64_64x8_1x1_v_bz_TNN", fam) == "cublas"
    assert kernel_class("Memcpy DtoD (Device -> Device)", fam) == "copy"
    assert kernel_class("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", fam) \
        == "torch"


def test_kernel_gaps_measure_the_idle_time_between_kernels():
    from decode import kernel_gaps
    # 2 steps; kernel 3 overlaps kernel 2 (no gap), kernel 4 starts inside kernel 2's reach (none either)
    spans = [(0.0, 10.0), (12.0, 20.0), (15.0, 18.0), (19.0, 25.0), (30.0, 31.0), (31.0, 40.0)]
    g = kernel_gaps(list(reversed(spans)), steps=2)
    assert g["kernels_per_step"] == 3.0
    assert g["gpu_idle_s"] == (2.0 + 5.0) / 1e6 / 2          # 10 -> 12 and 25 -> 30
    assert (g["gap_us_p50"], g["gap_us_max"]) == (0.0, 5.0)   # gaps 2, 0, 0, 5, 0: median 0
    assert g["gap_us_p90"] == 5.0
    assert g["long_gaps_per_step"] == 0.0 and g["idle_in_long_gaps_s"] == 0.0   # 5 µs is not over LONG_GAP_US
    wide = kernel_gaps([(0.0, 1.0), (1.5, 2.0), (9.0, 10.0)], steps=1)          # gaps 0.5 and 7
    assert wide["long_gaps_per_step"] == 1.0 and wide["idle_in_long_gaps_s"] == 7.0 / 1e6
    one = kernel_gaps([(0.0, 1.0)], steps=1)
    assert one["gpu_idle_s"] == 0.0 and one["gap_us_max"] is None


def test_top_kernels_rank_by_time_per_step_with_calls_and_mean():
    from decode import top_kernels
    times = {"a": [1.0, 1.0, 1.0, 1.0], "b": [10.0, 6.0], "c": [0.5]}
    rows = top_kernels(times, steps=2, n=2)
    assert [r["kernel"] for r in rows] == ["b", "a"]          # 16 µs over 2 steps, then 4: "c" left out
    assert rows[0]["s_per_step"] == 8.0e-6 and rows[0]["calls_per_step"] == 1.0 and rows[0]["us_per_call"] == 8.0
    assert rows[1]["calls_per_step"] == 2.0 and rows[1]["us_per_call"] == 1.0


def test_cell_variant_routes_bind_the_cells_and_give_them_back():
    """target-gate-up-whole binds moe.nvfp4's MMA-step cells with GSPLIT 1, target-split-router every cell with the
    K-split router (ROUTER_ROWS 0), target-mma-gemv-uncapped the MXFP8 MMA GEMV cells of linear.mxfp8 and qkv.mxfp8
    without their register cap (and nothing else); variant None gives the catalog's configs back (here a cell given
    a split first, as a tuning run would)."""
    import dataclasses

    from decode import route_binding, set_cell_variant

    from m3serve.kernels.catalog import all_entries
    from m3serve.kernels.gemm._mma_gemv import MmaGemvConfig
    from m3serve.kernels.moe import nvfp4 as moe_nvfp4
    from m3serve.kernels.moe._mma import MmaMoEConfig
    assert route_binding("target") == ("auto", None, True, None, ())
    assert route_binding("target-gate-up-whole") == ("auto", None, True, "gate-up-whole", ())
    assert route_binding("target-split-router") == ("auto", None, True, "split-router", ())
    assert route_binding("target-gate-up-split") == ("auto", None, True, "gate-up-split", ())
    assert route_binding("target-mma-gemv-uncapped") == ("auto", None, True, "mma-gemv-uncapped", ())
    assert route_binding("target-pdl") == ("auto", None, True, None, ())
    assert route_binding("target-rows") == ("auto", "rows", True, None, ())
    assert route_binding("target-index-gemv") == ("auto", None, True, None, (("INDEX_GEMV", True),))
    assert route_binding("target-head12") == ("auto", None, True, None, (("HEAD12", True),))
    assert route_binding("target-head-bf16") == ("auto", None, True, None, (("HEAD12", False),))
    assert route_binding("target-opt-in") == ("auto", None, True, None, (("HEAD12", True), ("INDEX_GEMV", True)))
    assert route_binding("target-round3") == ("auto", None, True, "round3", ())
    assert route_binding("target-head12-logits") == ("auto", None, True, None,
                                                     (("HEAD12", True), ("HEAD12_LOGITS", True)))
    entries = all_entries()
    gemv = [c for n in ("linear.mxfp8", "qkv.mxfp8") for c in entries[n].cells
            if isinstance(c.config["gemm"], MmaGemvConfig)]
    assert gemv and all(c.config["gemm"].maxnreg == 80 for c in gemv)
    nvfp4_gemv = [c.config["gemm"] for c in entries["linear.nvfp4"].cells]
    mma = [c for c in moe_nvfp4.CELLS if isinstance(c.config["moe"], MmaMoEConfig)]
    assert mma
    first = mma[0].config["moe"]
    mma[0].config["moe"] = dataclasses.replace(first, GSPLIT=4, GSPLIT_SLOTS=20)
    try:
        before = [c.config["moe"] for c in moe_nvfp4.CELLS]
        assert any(c.ROUTER_ROWS > 0 for c in before)
        saved: dict = {}
        set_cell_variant("gate-up-whole", saved)
        assert all(c.config["moe"].GSPLIT == 1 for c in mma)
        set_cell_variant("gate-up-split", saved)
        assert all((c.config["moe"].GSPLIT, c.config["moe"].GSPLIT_SLOTS, c.config["moe"].maxnreg)
                   == (4, 20, 64) for c in mma)
        set_cell_variant("down-uncapped", saved)
        assert all(c.config["moe"].down_maxnreg == 0 and c.config["moe"].GSPLIT ==
                   saved[("moe.nvfp4", moe_nvfp4.CELLS.index(c))]["moe"].GSPLIT for c in mma)
        assert all(not isinstance(c.config["moe"], MmaMoEConfig) or c in mma for c in moe_nvfp4.CELLS)
        set_cell_variant("split-router", saved)
        assert all(c.config["moe"].ROUTER_ROWS == 0 for c in moe_nvfp4.CELLS)
        assert mma[0].config["moe"].GSPLIT == 4
        set_cell_variant("mma-gemv-uncapped", saved)
        assert all(c.config["gemm"].maxnreg == 0 for c in gemv)
        assert [c.config["moe"] for c in moe_nvfp4.CELLS] == before
        assert [c.config["gemm"] for c in entries["linear.nvfp4"].cells] == nvfp4_gemv
        row1 = [c for n in ("linear.mxfp8", "qkv.mxfp8") for c in entries[n].cells
                if type(c.config["gemm"]).__name__ == "GemvConfig"]
        splits = [c.config["gemm"].SPLIT for c in row1]
        set_cell_variant("gemv-split2x", saved)
        assert row1 and [c.config["gemm"].SPLIT for c in row1] == [
            2 * v if c.shape[1] % (c.config["gemm"].BK * v * 4) == 0 else v for c, v in zip(row1, splits)]
        assert any(c.config["gemm"].SPLIT == 2 * v for c, v in zip(row1, splits))
        set_cell_variant("round3", saved)   # every change of the round undone at once
        assert all(c.config["gemm"].maxnreg == 0 for c in gemv)
        assert all(c.config["moe"].down_maxnreg == 0 for c in mma)
        qkv1 = next(c for c in row1 if c.shape == (9856, 6144) and c.rows == (1, 1))
        assert qkv1.config["gemm"].SPLIT == 1   # 308 tiles: 528 programs hold no split, 1056 hold 2
        set_cell_variant(None, saved)
        assert [c.config["moe"] for c in moe_nvfp4.CELLS] == before
        assert all(c.config["gemm"].maxnreg == 80 for c in gemv)
        assert [c.config["gemm"].SPLIT for c in row1] == splits
        assert qkv1.config["gemm"].SPLIT == 2
    finally:
        mma[0].config["moe"] = first


def test_step_bytes_counts_the_head_as_the_step_reads_it():
    """The 12-bit tiles for greedy rows the bound greedy head serves on head.head12, the BF16 weight otherwise (more
    rows than its cells, sampling, or no tiles)."""
    from types import SimpleNamespace

    from decode import step_bytes

    head = SimpleNamespace(table12=lambda rows: object() if rows <= 8 else None,
                           tiles=SimpleNamespace(nbytes=lambda: 75))
    model = SimpleNamespace(layers=[], cfg=None, greedy_head=head,
                            lm_head=SimpleNamespace(qweight=SimpleNamespace(nbytes=lambda: 100)))
    llm = SimpleNamespace(model=model, engine=SimpleNamespace(
        kv=SimpleNamespace(spec=SimpleNamespace(bytes_per_token=lambda: {"total": 2}))))
    assert step_bytes(llm, 1, 10) == 75 + 20
    assert step_bytes(llm, 8, 10) == 75 + 160
    assert step_bytes(llm, 9, 10) == 100 + 180
    assert step_bytes(llm, 1, 10, greedy=False) == 100 + 20
    head.table12 = None
    assert step_bytes(llm, 1, 10) == 100 + 20


def test_results_are_written_whole_and_marked(tmp_path):
    """write_results replaces the file in one rename (no temporary left behind) and records whether the run had
    rows still to measure: a partial write, then the final one over it."""
    import json

    from decode import write_results
    path = tmp_path / "sub" / "decode.json"
    write_results(str(path), {"bench": "decode", "results": [{"route": "target"}]}, complete=False)
    first = json.loads(path.read_text())
    assert first["complete"] is False and first["results"] == [{"route": "target"}]
    write_results(str(path), {"bench": "decode", "results": [{"route": "target"}, {"route": "target-pdl"}]},
                  complete=True)
    last = json.loads(path.read_text())
    assert last["complete"] is True and len(last["results"]) == 2
    assert sorted(p.name for p in path.parent.iterdir()) == ["decode.json"]
