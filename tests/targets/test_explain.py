"""`m3serve explain`'s placements on CPU: the fused projection replaces the per-part lines where it serves,
MoE and attention lines name what runs, and a shape outside every certified cell says why."""

from __future__ import annotations

import torch

from m3serve.model.loader import load_model
from m3serve.targets.explain import module_placements


def test_embedded_model_placements_name_the_fused_projection_and_the_all_experts_moe():
    from m3serve.eval.cli import default_model_dir
    model = load_model(str(default_model_dir()), device="cpu", dtype=torch.bfloat16)
    by_module = {p.module: p for p in module_placements(model, 1)}
    qkv = by_module["layers.2.attn.qkv"]
    assert qkv.entry == "torch:fused-GEMM" and "index-q|index-k" in qkv.detail
    assert "index-q" not in by_module["layers.0.attn.qkv"].detail      # a dense-attention layer: q|k|v only
    for part in ("q_proj", "k_proj", "v_proj", "index_q_proj", "index_k_proj"):
        p = by_module[f"layers.2.attn.{part}"]
        assert p.entry == "(fused)" and "layers.2.attn.qkv" in p.detail
    assert by_module["layers.2.attn.o_proj"].entry == "torch:F.linear"
    assert by_module["layers.2.mlp"].entry == "torch:all-experts"


def test_quantized_parts_without_a_fused_cell_are_placed_one_by_one():
    from m3serve.model.qweight import QWeight
    from m3serve.quant.mxfp8 import quantize_mxfp8
    from m3serve.targets.fused_projection import projection_parts
    model = load_model("tiny", device="cpu", dtype=torch.float32, random_weights=True, seed=1)
    attn = model.layers[0].attn
    for p in projection_parts(attn):
        q, s = quantize_mxfp8(p.weight.detach().float())
        p.set_weight(QWeight("mxfp8", {"q": q, "scale": s}))
    by_module = {p.module: p for p in module_placements(model, 2)}
    assert "layers.0.attn.qkv" not in by_module
    q = by_module["layers.0.attn.q_proj"]
    assert q.entry is None and "linear.mxfp8" in q.detail and "no certified cell" in q.detail


def test_graph_memory_report_lists_each_captured_set_and_the_total():
    """explain --graph-memory's lines: each set of graphs the engine holds (engine.graph_sets), with its buckets and
    the memory its capture reserved, then the total; a set without graphs, or an object that is no graph set (a
    test stand-in without memory_bytes), is not listed."""
    from types import SimpleNamespace

    from m3serve.engine.engine import LLMEngine
    from m3serve.targets.explain_cli import graph_memory_lines
    decode = SimpleNamespace(memory_bytes=300 << 20, captured=(1, 2, 4))
    prefill = SimpleNamespace(memory_bytes=1 << 30, captured=[(16, 1), (1024, 2)])
    runner = SimpleNamespace(graphs=decode, prefill_graphs=prefill)
    eng = SimpleNamespace(runner=runner, speculation=SimpleNamespace(spec_steps=object()))
    eng.graph_sets = lambda: LLMEngine.graph_sets(eng)
    assert eng.graph_sets() == {"decode": decode, "prefill": prefill}
    assert graph_memory_lines(eng) == ["decode graphs: 300 MiB reserved at capture; buckets [1, 2, 4]",
                                       "prefill graphs: 1024 MiB reserved at capture; buckets [(16, 1), (1024, 2)]",
                                       "CUDA graphs in all: 1324 MiB"]
    runner.graphs = runner.prefill_graphs = None
    assert graph_memory_lines(eng) == ["no CUDA graphs captured"]


def test_graph_memory_needs_cuda(capsys):
    import argparse

    from m3serve.targets import explain_cli
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    explain_cli.register(sub)
    args = p.parse_args(["explain", "--device", "cpu", "--graph-memory"])
    assert explain_cli.cmd_explain(args) == 2
    assert "captured and measured on CUDA only" in capsys.readouterr().err


def test_engine_stats_report_graph_memory_without_graphs():
    from m3serve import LLM
    llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=1 << 20)
    assert llm.engine.stats()["graph_memory_bytes"] == {}


def test_a_quantized_qkv_beside_a_dense_index_is_explained_as_two_gemms(monkeypatch):
    """A sparse layer whose q|k|v are quantized and whose indexer is dense (every quantized M3 checkpoint): where its
    qk_prep and qkv routes serve, explain prints the qkv GEMM and the index-q|index-k GEMM (linear.bf16 where it
    serves, else cuBLAS), and each part as fused into the one that runs it."""
    import torch

    from m3serve.model.loader import load_model
    from m3serve.targets import plan as plan_mod
    from m3serve.targets.explain import plan_placements

    model = load_model("tiny", device="cpu", dtype=torch.bfloat16, random_weights=True, quantization="mxfp8", seed=0,
                       keep_quantized=True)
    assert not any(m.routes.get("index") for m in plan_mod.build_plan(model, "auto").modules)   # opt-in
    monkeypatch.setattr(plan_mod, "INDEX_GEMV", True)
    bound = plan_mod.build_plan(model, "auto")
    assert bound.modules and any(m.routes.get("index") is not None for m in bound.modules)
    # as if the tiny shapes had cells (linear.bf16's: 1-4 rows)
    monkeypatch.setattr(plan_mod.Route, "serves", lambda self, rows: self.kind != "linear.bf16" or rows <= 4)
    at8 = {p.module: p for p in plan_placements(bound, 8)}
    assert at8["layers.1.attn.index_qk"].entry == "torch:fused-GEMM"
    assert "index-q|index-k as one GEMM (96 x 128" in at8["layers.1.attn.index_qk"].detail
    assert "linear.bf16" in at8["layers.1.attn.index_qk"].detail
    at1 = {p.module: p for p in plan_placements(bound, 1)}
    assert at1["layers.1.attn.index_qk"].entry != "torch:fused-GEMM"   # the linear.bf16 route's placement
    lines = at8
    assert lines["layers.1.attn.q_proj"].detail == "runs inside layers.1.attn.qkv"
    assert lines["layers.1.attn.index_k_proj"].detail == "runs inside layers.1.attn.index_qk"
    assert "layers.0.attn.index_qk" not in lines                               # a dense-attention layer: q|k|v only


def test_the_sampling_line_names_the_race_kernel_or_why_not(monkeypatch):
    from m3serve.eval.cli import default_model_dir
    from m3serve.kernels.sample import race
    from m3serve.targets.explain import sampling_placement
    model = load_model(str(default_model_dir()), device="cpu", dtype=torch.bfloat16)
    assert sampling_placement(model, 8).entry == "sample.race"
    assert sampling_placement(model, 513).entry is None and "sample.race" in sampling_placement(model, 513).detail
    monkeypatch.setattr(race, "ENABLED", False)
    off = sampling_placement(model, 8)
    assert off.entry is None and "switched off" in off.detail
