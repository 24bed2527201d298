"""The memory plan (runtime/memory_plan.py): the working memory reserved before the KV cache is sized, by term, and
the runner / tensor-parallel ranks sizing their caches by it (CUDA's memory queries mocked: the rule is host
arithmetic; tests/runtime/test_no_cliffs_gpu.py holds the plan above what start-up really takes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from m3serve.config import M3Config
from m3serve.engine.engine import EngineConfig
from m3serve.runtime import memory_plan as mp
from m3serve.runtime.memory_plan import (DRIVER_RESERVE_BYTES, WorkingMemory, kv_budget_bytes, plan_working_memory,
                                         sampled_rows_bytes, step_bytes_per_token)
from m3serve.runtime.step_inputs import buckets_up_to

M3 = M3Config()   # the real dims: vocab 200064, hidden 6144, 128 experts of 3072


def _plan(**kw):
    args = dict(max_num_seqs=64, max_num_batched_tokens=2048, max_step_tokens=2048, max_model_len=131072,
                graphs=True, prefill_graph_tokens=1024)
    args.update(kw)
    return plan_working_memory(M3, **args)


def test_terms_follow_the_limits_they_stand_for():
    base = _plan()
    v, per_token = M3.vocab_size, step_bytes_per_token(M3, 131072)
    assert base.eager_step == 2048 * per_token + sampled_rows_bytes(64, v)
    assert base.decode_graphs == 2 * sum(buckets_up_to(64)) * v * 4 + 64 * per_token + sampled_rows_bytes(64, v)
    assert base.prefill_graphs == 1024 * per_token + sampled_rows_bytes(64, v)
    assert base.spec_graphs == 0 and base.driver == DRIVER_RESERVE_BYTES
    assert base.engine_state == 64 * v * 10 + 64 * v // 8
    assert base.total == sum(base.__dict__.values())
    # graphs off (enforce_eager, route off, TP): no pool is reserved
    eager = _plan(graphs=False)
    assert eager.decode_graphs == eager.spec_graphs == eager.prefill_graphs == 0 and eager.total < base.total
    # speculation: verify rows S (K + 1), each bucket's outputs, the step's q rows, next_q in the engine state
    k3 = _plan(spec_k=3, max_step_tokens=2048 + 64 * 3)
    assert k3.spec_graphs >= sampled_rows_bytes(64 * 4, v) + 64 * 3 * v * 4
    assert k3.engine_state - base.engine_state == 65 * 3 * v * 4
    assert _plan(spec_k=5).spec_graphs > _plan(spec_k=3).spec_graphs
    # more sequences, longer steps, longer contexts: never less
    assert _plan(max_num_seqs=128).total > base.total
    assert _plan(max_num_batched_tokens=8192, max_step_tokens=8192).eager_step > base.eager_step
    assert _plan(max_model_len=1 << 20).eager_step > base.eager_step


def test_quantized_experts_reserve_the_decode_once_scratch_from_its_rows():
    scratch = 32 * 2 * 3072 * 6144 * 2            # 32 experts' gate|up in bf16: 2.4 GB
    small = dict(max_num_batched_tokens=2048, max_step_tokens=2048)
    big = dict(max_num_batched_tokens=8192, max_step_tokens=8192)
    assert _plan(quantized_experts=True, **small).eager_step == _plan(**small).eager_step
    assert _plan(quantized_experts=True, **big).eager_step - _plan(**big).eager_step == scratch


def test_the_failing_h100_configuration_is_reserved_for():
    """minimax-m3:5 NVFP4 + Eagle3 (K = 3) at 128 sequences failed on the 80 GB H100 with the cache at 90 % of the
    card less the weights: the 8 GB left could not hold the speculative graphs' 512 sampled rows. The plan now
    reserves them, and more than those 8 GB in all."""
    from m3serve.model.loader import resolve_config
    cfg = resolve_config("minimax-m3:5")
    w = plan_working_memory(cfg, max_num_seqs=128, max_num_batched_tokens=2048, max_step_tokens=2048 + 128 * 3,
                            max_model_len=cfg.max_position_embeddings, graphs=True, prefill_graph_tokens=1024,
                            spec_k=3, quantized_experts=True)
    assert w.spec_graphs > sampled_rows_bytes(512, cfg.vocab_size) > 4 << 30
    assert w.total > 8 << 30


def test_kv_budget_subtracts_use_and_plan_and_names_the_figures_when_nothing_is_left():
    w = WorkingMemory(eager_step=3 << 30, decode_graphs=1 << 30, spec_graphs=0, prefill_graphs=0, engine_state=0,
                      driver=1 << 30)
    total, free = 80 << 30, 70 << 30                                   # 10 GiB in use (the weights)
    assert kv_budget_bytes(free, total, 0.9, w) == int(0.9 * total) - (10 << 30) - (5 << 30)
    assert kv_budget_bytes(free, total, 0.9, 5 << 30) == int(0.9 * total) - (15 << 30)   # plain bytes (TP ranks)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.15 allows 12.00 GiB.*10.00 GiB are in use.*"
                                         r"5.00 GiB \(eager step 3.00, decode graphs 1.00, driver 1.00\)"):
        kv_budget_bytes(free, total, 0.15, w)
    with pytest.raises(ValueError, match="gpu_memory_utilization: expected a fraction"):
        kv_budget_bytes(free, total, 1.5, w)


def test_plan_rejects_bad_limits():
    with pytest.raises(ValueError, match="max_num_seqs must be a positive int, found 0"):
        _plan(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_model_len must be a positive int, found True"):
        _plan(max_model_len=True)


class _FakeCuda:
    """torch.cuda's memory queries for a card of `total` bytes; `used` moves as the test allocates."""

    def __init__(self, total: int, used: int):
        self.total, self.used, self.emptied = total, used, 0

    def mem_get_info(self, device=None):
        return self.total - self.used, self.total

    def empty_cache(self):
        self.emptied += 1


def test_runner_sizes_its_cache_by_the_plan_and_measures_what_start_up_took(monkeypatch):
    from m3serve.kv.cache import PagedKVCache
    from m3serve.runtime.model_runner import ModelRunner
    fake = _FakeCuda(total=80 << 30, used=12 << 30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", fake.mem_get_info)
    monkeypatch.setattr(torch.cuda, "empty_cache", fake.empty_cache)
    budgets = []

    def from_budget(spec, *, device, budget_bytes):
        budgets.append(budget_bytes)
        fake.used += budget_bytes                 # the cache takes its budget
        return SimpleNamespace(num_slots=budget_bytes // 4096)
    monkeypatch.setattr(PagedKVCache, "from_budget", staticmethod(from_budget))
    experts = SimpleNamespace(num_experts=128, fmt="nvfp4")
    for eager in (False, True):
        model = SimpleNamespace(cfg=M3, dtype=torch.bfloat16, tp=SimpleNamespace(size=1),
                                device=torch.device("cuda"), modules=lambda: [experts])
        config = EngineConfig(max_num_seqs=128, max_num_batched_tokens=8192, enforce_eager=eager)
        runner = SimpleNamespace(model=model, config=config, max_step_tokens=8192 + 128 * 3, _used_after_cache=None)
        runner.target_possible = lambda: ModelRunner.target_possible(runner)
        fake.used = 12 << 30
        ModelRunner._cache_from_memory_plan(runner, None, 3)
        plan = runner.working_memory
        assert plan == plan_working_memory(M3, max_num_seqs=128, max_num_batched_tokens=8192,
                                           max_step_tokens=8192 + 384, max_model_len=M3.max_position_embeddings,
                                           graphs=not eager, prefill_graph_tokens=0 if eager else 1024, spec_k=3,
                                           quantized_experts=True)
        assert budgets[-1] == int(0.9 * (80 << 30)) - (12 << 30) - plan.total
        fake.used += 3 << 30                      # graphs, warm-up, engine state
        assert ModelRunner.measured_working_bytes(runner) == 3 << 30
        runner.measured_working_bytes = lambda: ModelRunner.measured_working_bytes(runner)
        assert ModelRunner.check_memory_plan(runner) == {"planned_working_bytes": plan.total,
                                                         "measured_working_bytes": 3 << 30}
    assert fake.emptied == 2
    assert budgets[1] > budgets[0]                # enforce_eager: no graph pools reserved, a larger cache


def test_check_memory_plan_warns_when_start_up_took_more(monkeypatch, caplog):
    from m3serve.runtime.model_runner import ModelRunner
    runner = SimpleNamespace(working_memory=WorkingMemory(1 << 30, 0, 0, 0, 0, 0),
                             measured_working_bytes=lambda: 2 << 30)
    with caplog.at_level("WARNING", logger="m3serve"):
        got = ModelRunner.check_memory_plan(runner)
    assert got == {"planned_working_bytes": 1 << 30, "measured_working_bytes": 2 << 30}
    assert "planned 1.00 GiB, taken after start-up 2.00 GiB (above the plan" in caplog.text
    assert ModelRunner.check_memory_plan(SimpleNamespace(measured_working_bytes=lambda: None)) is None


def test_tensor_parallel_ranks_keep_the_planned_bytes_free(monkeypatch):
    from m3serve.distributed.kv_slots import local_kv_slots, slot_bytes
    from m3serve.kv.spec import KVCacheSpec
    spec = KVCacheSpec.from_model_config(M3Config(num_hidden_layers=4, layer_types=["full"] + ["sparse"] * 3,
                                                  mlp_layer_types=["dense"] + ["moe"] * 3))
    fake = _FakeCuda(total=80 << 30, used=40 << 30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", fake.mem_get_info)
    monkeypatch.setattr(torch.cuda, "empty_cache", fake.empty_cache)
    dev = torch.device("cuda", 0)
    without = local_kv_slots(spec, dev, None, 0.9, 0)
    with_plan = local_kv_slots(spec, dev, None, 0.9, 6 << 30)
    assert without == (int(0.9 * (80 << 30)) - (40 << 30)) // slot_bytes(spec)
    assert with_plan == (int(0.9 * (80 << 30)) - (46 << 30)) // slot_bytes(spec)
    with pytest.raises(ValueError, match="KV cache: no memory left"):
        local_kv_slots(spec, dev, None, 0.9, 40 << 30)


def test_llm_tells_the_engine_when_no_graphs_will_be_captured():
    """On the CPU the route is off: no graphs, so the plan (were it on a GPU) reserves none; enforce_eager too."""
    from m3serve import LLM
    assert LLM(max_model_len=256).engine.config.enforce_eager is True
    assert mp.experts_quantized(SimpleNamespace(modules=lambda: [SimpleNamespace(num_experts=None, fmt="nvfp4"),
                                                                 SimpleNamespace(num_experts=8, fmt="dense")])) is False
    assert mp.experts_quantized(SimpleNamespace(modules=lambda: [SimpleNamespace(num_experts=8, fmt="mxfp8")]))
