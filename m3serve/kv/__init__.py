"""Hybrid paged KV cache: one slot allocator for K/V, index-K, NVFP4 scales and the draft layer."""

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
