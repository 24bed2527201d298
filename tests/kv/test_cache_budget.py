"""PagedKVCache.from_budget sizing and the describe() start-up report."""

from __future__ import annotations

import pytest

from m3serve.config import M3Config
from m3serve.kv import KVCacheSpec, PagedKVCache, SlotLayout
from tests.kv.kvutil import small_spec


def test_from_budget_uses_true_hybrid_bytes():
    spec = small_spec("nvfp4", "fp8", draft=1)
    lay = SlotLayout(spec)
    per_slot = lay.slot_bytes + lay.scale_slot_bytes
    pad = lay.padding_bytes + lay.scale_padding_bytes
    assert per_slot == spec.bytes_per_token()["total"] * spec.page_size + pad
    cache = PagedKVCache.from_budget(spec, device="cpu", budget_bytes=10 * per_slot + per_slot - 1)
    assert cache.num_slots == 10
    assert cache.data.numel() + cache.scales.numel() == 10 * per_slot


def test_from_budget_errors():
    spec = small_spec("bf16")
    per_slot = SlotLayout(spec).slot_bytes
    with pytest.raises(ValueError, match="budget_bytes"):
        PagedKVCache.from_budget(spec, device="cpu", budget_bytes=per_slot - 1)
    with pytest.raises(ValueError, match="num_slots"):
        PagedKVCache(spec, 0, "cpu")


def test_describe_reports_pages_tokens_and_roles():
    spec = KVCacheSpec.from_model_config(M3Config(), tp_size=4, kv_cache_dtype="nvfp4", num_draft_layers=1)
    per_slot = 23_824 * 128  # hybrid TP4 with draft, bf16 index-K (test_spec checks the split)
    cache = PagedKVCache.from_budget(spec, device="cpu", budget_bytes=3 * per_slot)
    text = cache.describe()
    assert cache.num_slots == 3
    assert "3 pages x 128 tokens = 384 tokens" in text
    assert f"{per_slot} B/page" in text and "padding 0" in text
    assert "57 sparse = NVFP4/P128, 3 dense = FP8/P128, 1 draft = FP8/P128, index-K = BF16" in text
    assert "sparse_kv=7296 sparse_kv_scale=912 dense_kv=768 index_k=14592 draft_kv=256 total=23824" in text

