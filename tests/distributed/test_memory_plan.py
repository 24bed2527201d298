"""bench/memory_plan.py prices the weights a rank really holds: at tiny scale its byte count must equal the
bytes of the loaded shard exactly, for every format and TP size; at full scale it must agree with the
config's own parameter count."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from m3serve.config import M3Config, preset
from m3serve.kv.layout import SlotLayout
from m3serve.kv.spec import KVCacheSpec
from m3serve.model.loader import load_model
from m3serve.model.parallel import TPGroup

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan_mod():
    spec = importlib.util.spec_from_file_location("memory_plan", ROOT / "bench" / "memory_plan.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["memory_plan"] = mod
    spec.loader.exec_module(mod)
    return mod


def _resident_bytes(model) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("quant,n", [(None, 2), ("nvfp4", 2), ("nvfp4", 4), ("mxfp8", 2)])
def test_weight_bytes_equal_the_loaded_shard(plan_mod, quant, n):
    cfg = preset("tiny")
    want = plan_mod.weight_bytes(cfg, n, quant, torch.bfloat16)
    for r in range(n):
        shard = load_model(cfg, dtype=torch.bfloat16, tp=TPGroup(r, n), random_weights=True, quantization=quant,
                           keep_quantized=True)
        assert _resident_bytes(shard) == want["total"], (quant, n, r)
    assert sum(plan_mod.weight_bytes(cfg, n, quant, by_layer=True)["layers"]) < want["total"]


def test_full_model_bytes_match_the_parameter_count(plan_mod):
    cfg = M3Config()
    dense = plan_mod.weight_bytes(cfg, 1, None, torch.bfloat16)
    # bf16 everywhere except fp32 norms/routers/biases (0.18 GB): bytes = 2 x params + 2 x those params
    params = (dense["total"] - dense["other"] / 2) / 2
    assert abs(params - cfg.num_parameters()) / cfg.num_parameters() < 1e-9
    # sharding conserves bytes up to the replicated tensors (index-K head, norms, routers; KV heads at TP8)
    q1 = plan_mod.weight_bytes(cfg, 1, "nvfp4")["total"]
    q4 = plan_mod.weight_bytes(cfg, 4, "nvfp4")["total"]
    assert 4 * q4 > q1 and 4 * q4 - q1 < 0.02 * q1


def test_plan_uses_the_rank_kv_layout_and_finds_capacity(plan_mod):
    cfg = M3Config()
    p4 = plan_mod.plan(cfg, 4, "nvfp4", index_k_dtype="bf16")
    spec = KVCacheSpec.from_model_config(cfg, tp_size=4, kv_cache_dtype="nvfp4", index_k_dtype="bf16",
                                         model_dtype=torch.bfloat16)
    layout = SlotLayout(spec)
    assert p4["kv"]["page_bytes"] == layout.slot_bytes + layout.scale_slot_bytes
    assert p4["kv_tokens"] == p4["kv_pages"] * 128 and p4["kv_pages"] > 0
    # the engine's rule: the steps' planned working memory stays free of the cache too (runtime/memory_plan.py)
    assert p4["working_memory"] > 1 << 30
    used = p4["weights"]["total"] + p4["reserve"] + p4["working_memory"] + p4["kv_pages"] * p4["kv"]["page_bytes"]
    assert used <= 0.9 * plan_mod.H200_BYTES < used + p4["kv"]["page_bytes"]
    p8 = plan_mod.plan(cfg, 8, "nvfp4", index_k_dtype="bf16")
    assert p8["weights"]["total"] < p4["weights"]["total"] and p8["kv_tokens"] > p4["kv_tokens"]


def test_max_layers_is_the_deepest_fit(plan_mod):
    budget = 141e9
    n = plan_mod.max_layers(1, budget, "nvfp4")
    assert 3 < n < 60
    base = M3Config()
    full = {t: plan_mod.weight_bytes(base, t, "nvfp4", torch.bfloat16, by_layer=True) for t in (1,)}
    fits = [plan_mod.bench_bytes(base.truncated(k), 1, "nvfp4", torch.bfloat16, 2176, 3 * 2304, full) <= budget
            for k in (n, n + 1)]
    assert fits == [True, False]
