"""Every rank's KV cache must hold the same slots (rank 0's block manager hands out slot ids for all of them):
each rank computes how many fit its own memory, and the group takes the minimum."""

from __future__ import annotations

import torch

from m3serve.kv.layout import SlotLayout
from m3serve.kv.spec import KVCacheSpec

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
                   gpu_memory_utilization: float) -> int:
    """Slots this rank could hold, by the rule LLMEngine applies (explicit bytes, else the CPU default, else
    the fraction of GPU memory left after the weights)."""
    if kv_cache_bytes is not None or device.type != "cuda":
        budget = kv_cache_bytes if kv_cache_bytes is not None else CPU_DEFAULT_KV_BYTES
    else:
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: expected a fraction in (0, 1], found {gpu_memory_utilization}")
        free, total = torch.cuda.mem_get_info(device)
        budget = int(gpu_memory_utilization * total) - (total - free)
    slots = int(budget) // slot_bytes(spec)
    if slots < 1:
        raise ValueError(f"KV cache budget {budget} B on {device} does not hold one {spec.page_size}-token slot "
                         f"({slot_bytes(spec)} B); raise kv_cache_bytes or gpu_memory_utilization")
    return slots
