"""Every rank's KV cache must hold the same slots (rank 0's block manager hands out slot ids for all of them):
each rank computes how many fit its own memory, and the group takes the minimum."""

from __future__ import annotations

import torch

from m3serve.kv.layout import SlotLayout
from m3serve.kv.spec import KVCacheSpec
from m3serve.runtime.memory_plan import kv_budget_bytes

CPU_DEFAULT_KV_BYTES = 256 << 20   # LLMEngine's budget on CPU when none is given


def rank_kv_spec(model, kv_cache_dtype: str, index_k_dtype: str, draft_kv_heads: int | None = None) -> KVCacheSpec:
    """draft_kv_heads: with speculation, the replicated drafter's KV heads (every rank holds all of them, as
    runtime.model_runner.cache_spec lays them out); None: no draft layer."""
    draft = {} if draft_kv_heads is None else {"num_draft_layers": 1,
                                               "draft_num_kv_heads": draft_kv_heads * model.tp.size}
    return KVCacheSpec.from_model_config(model.cfg, tp_size=model.tp.size, kv_cache_dtype=kv_cache_dtype,
                                         index_k_dtype=index_k_dtype, model_dtype=model.dtype, **draft)


def slot_bytes(spec: KVCacheSpec) -> int:
    layout = SlotLayout(spec)
    return layout.slot_bytes + layout.scale_slot_bytes


def local_kv_slots(spec: KVCacheSpec, device: torch.device, kv_cache_bytes: int | None,
                   gpu_memory_utilization: float, working_memory_bytes: int = 0) -> int:
    """Slots this rank could hold, by the rule LLMEngine applies (explicit bytes, else the CPU default, else
    the fraction of GPU memory left after the weights and the steps' planned working memory:
    runtime/memory_plan.py)."""
    if kv_cache_bytes is not None or device.type != "cuda":
        budget = kv_cache_bytes if kv_cache_bytes is not None else CPU_DEFAULT_KV_BYTES
    else:
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        budget = kv_budget_bytes(free, total, gpu_memory_utilization, working_memory_bytes)
    slots = int(budget) // slot_bytes(spec)
    if slots < 1:
        raise ValueError(f"KV cache budget {budget} B on {device} does not hold one {spec.page_size}-token slot "
                         f"({slot_bytes(spec)} B); raise kv_cache_bytes or gpu_memory_utilization")
    return slots
