"""Shared helpers for the KV-cache tests: small specs and the combinations of roles and dtypes."""

from __future__ import annotations

import itertools

import torch

from m3serve.kv import KVCacheSpec

KV_DTYPES = ("auto", "bf16", "fp8", "nvfp4")
INDEX_DTYPES = ("auto", "bf16", "fp8")


def small_spec(kv: str = "auto", index: str = "auto", draft: int = 1, heads: int = 2,
               model_dtype: torch.dtype = torch.float32, page_size: int = 8, draft_heads: int | None = None
               ) -> KVCacheSpec:
    """4 target layers (1 and 3 sparse, 0 and 2 dense) plus an optional draft layer; tiny dims."""
    return KVCacheSpec(page_size=page_size, num_layers=4, sparse_layers=(1, 3), num_kv_heads=heads, head_dim=32,
                       index_head_dim=16, kv_cache_dtype=kv, index_k_dtype=index, model_dtype=model_dtype,
                       num_draft_layers=draft, draft_num_kv_heads=draft_heads)


def all_combos():
    """Every (kv dtype, index-K dtype, draft layers, model dtype) combination."""
    return list(itertools.product(KV_DTYPES, INDEX_DTYPES, (0, 1), (torch.float32, torch.bfloat16)))
