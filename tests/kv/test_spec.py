"""KVCacheSpec: per-layer formats, bytes per token (real M3 numbers), validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from m3serve.config import M3Config
from m3serve.kv import KVCacheSpec
from tests.kv.kvutil import all_combos, small_spec


def m3_spec(tp: int, kv: str, index: str = "auto", draft: int = 0, model_dtype=torch.bfloat16) -> KVCacheSpec:
    return KVCacheSpec.from_model_config(M3Config(), tp_size=tp, kv_cache_dtype=kv, index_k_dtype=index,
                                         model_dtype=model_dtype, num_draft_layers=draft)


def test_m3_bf16_tp4_matches_architecture_doc():
    # m3-architecture.md §3.1: K/V 30,720 B + index-K 14,592 B = 45,312 B/token at TP4 (one KV head per rank),
    # and x128 tokens = 5,799,936 B per page (tokenspeed's reported page size).
    spec = m3_spec(4, "bf16")
    assert spec.num_kv_heads == 1 and spec.page_size == 128
    bpt = spec.bytes_per_token()
    assert bpt["sparse_kv"] + bpt["dense_kv"] == 30_720
    assert bpt["index_k"] == 14_592
    assert bpt["total"] == 45_312
    assert bpt["total"] * 128 == 5_799_936


def test_m3_bf16_tp1_full_model_total():
    # §3.1: 61,440 K/V elements + 7,296 index-K elements per token at BF16 = 137,472 B.
    assert m3_spec(1, "bf16").bytes_per_token()["total"] == 137_472


def test_m3_nvfp4_hybrid_tp4_with_draft():
    bpt = m3_spec(4, "nvfp4", draft=1).bytes_per_token()
    # 57 sparse layers x (K+V) x 1 head x 128 dims at 4 bits; scales: one byte per 16 values.
    assert bpt["sparse_kv"] == 57 * 2 * 128 // 2 == 7296
    assert bpt["sparse_kv_scale"] == 57 * 2 * 128 // 16 == 912
    # Dense layers 0-2 and the draft layer are FP8 (1 byte) in the hybrid cache.
    assert bpt["dense_kv"] == 3 * 2 * 128 == 768
    assert bpt["draft_kv"] == 2 * 128 == 256
    assert bpt["index_k"] == 57 * 128 * 2  # auto = model dtype bf16
    assert bpt["total"] == 7296 + 912 + 768 + 256 + 14_592


def test_m3_fp8_index_and_replicated_heads():
    spec = m3_spec(8, "fp8", index="fp8")
    assert spec.num_kv_heads == 1  # 4 heads over 8 ranks: replicated, one per rank
    assert spec.bytes_per_token()["index_k"] == 57 * 128
    assert m3_spec(2, "fp8").num_kv_heads == 2


def test_split_summary_names_hybrid_roles():
    assert m3_spec(4, "nvfp4", draft=1).split_summary() == (
        "57 sparse = NVFP4/P128, 3 dense = FP8/P128, 1 draft = FP8/P128, index-K = BF16")


_BITS = {torch.float32: 32, torch.bfloat16: 16}


@pytest.mark.parametrize("kv,index,draft,model_dtype", all_combos())
def test_bytes_per_token_every_combination(kv, index, draft, model_dtype):
    spec = small_spec(kv, index, draft, model_dtype=model_dtype, draft_heads=3 if draft else None)
    h, d, di = 2, 32, 16
    auto_bits = _BITS[model_dtype]
    sparse_bits = {"auto": auto_bits, "bf16": 16, "fp8": 8, "nvfp4": 4}[kv]
    dense_bits = {"auto": auto_bits, "bf16": 16, "fp8": 8, "nvfp4": 8}[kv]
    index_bits = {"auto": auto_bits, "bf16": 16, "fp8": 8}[index]
    want = {
        "sparse_kv": 2 * 2 * h * d * sparse_bits // 8,  # 2 sparse layers x (K, V)
        "sparse_kv_scale": 2 * 2 * h * d // 16 if kv == "nvfp4" else 0,
        "dense_kv": 2 * 2 * h * d * dense_bits // 8,
        "index_k": 2 * di * index_bits // 8,
        "draft_kv": draft * 2 * 3 * d * dense_bits // 8,  # draft head count 3
    }
    want["total"] = sum(want.values())
    assert spec.bytes_per_token() == want
    auto_name = "fp32" if model_dtype == torch.float32 else "bf16"
    assert spec.kv_format(1) == (auto_name if kv == "auto" else kv)
    assert spec.kv_format(0) == (auto_name if kv == "auto" else "fp8" if kv == "nvfp4" else kv)
    assert spec.index_k_format() == (auto_name if index == "auto" else index)


def test_from_model_config_duck_typing_and_layer_types():
    cfg = M3Config().truncated(5)
    spec = KVCacheSpec.from_model_config(cfg, tp_size=4)
    assert spec.sparse_layers == (3, 4) and spec.dense_layers == (0, 1, 2)
    bad = dataclasses.replace(cfg)
    object.__setattr__(bad, "layer_types", ["full", "full", "full", "sparse", "window"])
    with pytest.raises(ValueError, match=r"layer_types\[4\]"):
        KVCacheSpec.from_model_config(bad)
    with pytest.raises(ValueError, match="tp_size"):
        KVCacheSpec.from_model_config(cfg, tp_size=0)


@pytest.mark.parametrize("field,value,match", [
    ("num_draft_layers", 2, "num_draft_layers"),
    ("kv_cache_dtype", "int8", "kv_cache_dtype"),
    ("index_k_dtype", "nvfp4", "index_k_dtype"),
    ("sparse_layers", (1, 9), "sparse_layers"),
    ("sparse_layers", (1, 1), "sparse_layers"),
    ("page_size", 0, "page_size"),
    ("head_dim", -4, "head_dim"),
])
def test_spec_rejects_bad_fields(field, value, match):
    base = dict(page_size=8, num_layers=4, sparse_layers=(1, 3), num_kv_heads=2, head_dim=32, index_head_dim=16)
    base[field] = value
    with pytest.raises(ValueError, match=match):
        KVCacheSpec(**base)


def test_spec_nvfp4_constraints():
    with pytest.raises(ValueError, match="head_dim"):
        KVCacheSpec(page_size=8, num_layers=2, sparse_layers=(1,), num_kv_heads=1, head_dim=24, index_head_dim=8,
                    kv_cache_dtype="nvfp4")
    with pytest.raises(ValueError, match="page_size"):
        KVCacheSpec(page_size=6, num_layers=2, sparse_layers=(1,), num_kv_heads=1, head_dim=32, index_head_dim=8,
                    kv_cache_dtype="nvfp4")
    with pytest.raises(TypeError, match="model_dtype"):
        KVCacheSpec(page_size=8, num_layers=2, sparse_layers=(1,), num_kv_heads=1, head_dim=32, index_head_dim=8,
                    model_dtype=torch.int8)


def test_check_layer_names_draft():
    spec = small_spec(draft=0)
    with pytest.raises(ValueError, match="no draft layer"):
        spec.check_layer(spec.draft_layer)
    small_spec(draft=1).check_layer(4)
