"""DraftKVView: the shared Eagle3 draft layer presented as an ordinary single-pool paged cache.

Shape legend:
    pool           [num_pages, H, P, D]   flat sub-page pool rooted at the draft layer's K page of slot 0
    slot_table     int32 [S, B]           from the manager's live host rows (-1 -> 0)
    subpage_table  int32 [S, 2, B]        K = slot*index_scale, V = K + 1 (indices into `pool`)

The draft layer lives in the same slots as the target layers at the native page size (P128 for
M3), so it needs no allocator, no private table copy and no per-step host expansion: its table is
filled by the same single device operation as the target's (block_table.py), from the manager's
rows. The page bound is computed from the view's own root, `(num_slots-1)*index_scale + 2`; TRT
PR #17656 computed it from the wrong base, valid draft pages looked out of range at cold start and
the acceptance length silently collapsed. Freeing stays with the manager (free() is a no-op).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from m3serve.kv.block_manager import BlockManager
from m3serve.kv.block_table import DeviceBlockTables
from m3serve.kv.spec import FMT_TORCH_DTYPE


class DraftKVView:
    num_pools = 1

    # cache: the PagedKVCache whose shared draft layer this views (PagedKVCache.draft_view builds it)
    def __init__(self, cache, manager: BlockManager, *, tree_drafts: bool = False,
                 relocate_accepted_tokens: bool = False, ring_size: int = 3) -> None:
        spec = cache.spec
        if spec.num_draft_layers != 1:
            raise ValueError(f"spec.num_draft_layers: the draft view needs exactly 1 local draft layer, "
                             f"found {spec.num_draft_layers}")
        if manager.num_slots != cache.num_slots or manager.page_size != cache.page_size:
            raise ValueError(f"manager: expected num_slots={cache.num_slots}, page_size={cache.page_size} "
                             f"(the cache's), found {manager.num_slots}, {manager.page_size}")
        if spec.kv_cache_dtype == "nvfp4":
            # With NVFP4 target layers, moving accepted tokens would move packed bytes but not their
            # block scales (mechanisms.md §1.1): only linear, append-only drafting is allowed.
            if tree_drafts:
                raise ValueError("tree_drafts: dynamic-tree drafting is not supported with kv_cache_dtype='nvfp4' "
                                 "(relocating accepted tokens would not move their NVFP4 block scales)")
            if relocate_accepted_tokens:
                raise ValueError("relocate_accepted_tokens: relocating accepted draft tokens is not supported with "
                                 "kv_cache_dtype='nvfp4'; use linear (append-only) drafting")
        self.cache = cache
        self.manager = manager
        self.layer = cache.draft_layer
        self.format = spec.kv_format(self.layer)
        self.dtype = FMT_TORCH_DTYPE[self.format]
        self.page_size = cache.page_size
        geom = cache.geometry(self.layer)
        self.index_scale = geom.index_scale
        self.kv_offset = geom.kv_offset
        self.num_pages = geom.num_pages(cache.num_slots)
        self.pool = cache.flat_subpage_pool(self.layer)
        # Byte offset of the root (the draft K page of slot 0) from the data pool base.
        self.root_byte_offset = cache.layout.pages[(self.layer, "k")].offset
        self.tables = DeviceBlockTables(manager, cache.device, self.index_scale, self.kv_offset, ring_size)

    @property
    def host_table(self) -> np.ndarray:
        """The manager's live host rows (no private copy)."""
        return self.manager.host_table

    def build(self, seq_ids: list[int]) -> tuple[Tensor, Tensor]:
        """(slot_table, subpage_table) for the batch: one device operation, see block_table.py."""
        return self.tables.build(seq_ids)

    def _check_layer(self, layer: int) -> None:
        if layer != self.layer:
            raise ValueError(f"layer: this view only serves the draft layer {self.layer}, found {layer!r}")

    def num_attention_pages(self, layer: int) -> int:
        """Page bound of the flat pool (length of `pool`)."""
        self._check_layer(layer)
        return self.num_pages

    def kv_page_offset(self, layer: int) -> int:
        self._check_layer(layer)
        return self.kv_offset

    def write(self, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
        self.cache.write(self.layer, slot_mapping, k, v)

    def read(self, slots: Tensor, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        k, v, _ = self.cache.read(self.layer, slots, length, dtype)
        return k, v

    def free(self, seq_id: int) -> None:
        """No-op: the block life cycle belongs to the shared BlockManager."""
