"""Hybrid paged KV cache: one slot allocator for K/V, index-K, NVFP4 scales and the draft layer.

Typical wiring (engine side):

    spec = KVCacheSpec.from_model_config(cfg, tp_size=4, kv_cache_dtype="nvfp4", num_draft_layers=1)
    cache = PagedKVCache.from_budget(spec, device="cuda", budget_bytes=budget)   # runtime/memory_plan.py
    log(cache.describe())
    mgr = BlockManager(cache.num_slots, cache.page_size, max_seqs, max_blocks_per_seq)
    dense = DeviceBlockTables(mgr, "cuda", cache.uniform_index_scale(spec.dense_layers))
    draft = cache.draft_view(mgr)                      # only with num_draft_layers=1
    # per step, after the scheduler's allocate / append_slots / free:
    slot_table, subpage_table = dense.build(seq_ids)   # MSA kernels read slot_table (slot ids);
    slot_mapping = dense.slot_mapping(tok_seq, pos)    # dense kernels index flat_subpage_pool(l)
    cache.write(layer, slot_mapping, k, v, index_k)    # reference write (Triton kernels to come)
"""

from __future__ import annotations

from m3serve.kv.block_manager import BlockManager, OutOfPagesError
from m3serve.kv.block_table import DeviceBlockTables, build_block_tables_reference
from m3serve.kv.cache import DEFAULT_NVFP4_KV_AMAX, PagedKVCache
from m3serve.kv.draft_view import DraftKVView
from m3serve.kv.layout import SlotLayout, SubpageGeometry
from m3serve.kv.spec import KVCacheSpec

__all__ = [
    "BlockManager",
    "DEFAULT_NVFP4_KV_AMAX",
    "DeviceBlockTables",
    "DraftKVView",
    "KVCacheSpec",
    "OutOfPagesError",
    "PagedKVCache",
    "SlotLayout",
    "SubpageGeometry",
    "build_block_tables_reference",
]
