"""Slot layout: sub-page placement invariants and the flat sub-page arithmetic kernels rely on."""

from __future__ import annotations

import pytest
import torch

from m3serve.config import M3Config
from m3serve.kv import KVCacheSpec, PagedKVCache, SlotLayout
from tests.kv.kvutil import all_combos, small_spec


def _check_pool(pages: dict, slot_bytes: int, padding: int) -> None:
    spans = sorted((p.offset, p.offset + p.nbytes) for p in pages.values())
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0, "sub-pages overlap"
    if spans:
        assert spans[-1][1] <= slot_bytes
    assert padding == slot_bytes - sum(p.nbytes for p in pages.values())


@pytest.mark.parametrize("kv,index,draft,model_dtype", all_combos())
def test_layout_invariants_every_combination(kv, index, draft, model_dtype):
    spec = small_spec(kv, index, draft, heads=3, model_dtype=model_dtype, draft_heads=1 if draft else None)
    lay = SlotLayout(spec)
    _check_pool(lay.pages, lay.slot_bytes, lay.padding_bytes)
    _check_pool(lay.scale_pages, lay.scale_slot_bytes, lay.scale_padding_bytes)
    for layer in range(spec.num_attention_layers):
        k, v = lay.pages[(layer, "k")], lay.pages[(layer, "v")]
        g = lay.geometry(layer)
        assert v.offset == k.offset + k.nbytes  # V directly follows K
        assert g.index_scale * g.unit_bytes == lay.slot_bytes
        assert g.layer_offset * g.unit_bytes == k.offset
        assert ((layer, "index_k") in lay.pages) == spec.is_sparse(layer)
        has_scales = spec.kv_format(layer) == "nvfp4"
        assert ((layer, "k_scale") in lay.scale_pages) == has_scales
        if has_scales:
            sg = lay.scale_geometry(layer)
            assert sg.index_scale * sg.unit_bytes == lay.scale_slot_bytes
            ks, vs = lay.scale_pages[(layer, "k_scale")], lay.scale_pages[(layer, "v_scale")]
            assert vs.offset == ks.offset + sg.unit_bytes
    # With power-of-two sub-page sizes (2 heads, dims 32/16, page 8) largest-first placement leaves no
    # alignment gaps: the only padding rounds slot_bytes up to a multiple of the largest K/V sub-page.
    pow2 = SlotLayout(small_spec(kv, index, draft, heads=2, model_dtype=model_dtype))
    largest_kv = max(p.nbytes for (_, role), p in pow2.pages.items() if role in ("k", "v"))
    assert pow2.padding_bytes == -sum(p.nbytes for p in pow2.pages.values()) % largest_kv
    assert pow2.scale_padding_bytes == 0


@pytest.mark.parametrize("tp", [4, 8])
@pytest.mark.parametrize("kv,index", [("bf16", "auto"), ("fp8", "fp8"), ("nvfp4", "auto"), ("nvfp4", "fp8")])
def test_m3_layouts_have_no_padding(tp, kv, index):
    # All M3 sub-page sizes are powers of two at TP >= 4: the slot is exactly the true hybrid bytes.
    spec = KVCacheSpec.from_model_config(M3Config(), tp_size=tp, kv_cache_dtype=kv, index_k_dtype=index,
                                         num_draft_layers=1)
    lay = SlotLayout(spec)
    assert lay.padding_bytes == 0 and lay.scale_padding_bytes == 0
    assert lay.slot_bytes + lay.scale_slot_bytes == spec.bytes_per_token()["total"] * spec.page_size


@pytest.mark.parametrize("kv", ["auto", "bf16", "fp8", "nvfp4"])
def test_flat_subpage_pool_addresses_each_layers_pages(kv):
    spec = small_spec(kv, "fp8", draft=1, heads=2)
    cache = PagedKVCache(spec, 5, "cpu")
    g = torch.Generator().manual_seed(1)
    cache.data.copy_(torch.randint(0, 256, cache.data.shape, dtype=torch.uint8, generator=g))
    if cache.scales is not None:
        cache.scales.copy_(torch.randint(0, 256, cache.scales.shape, dtype=torch.uint8, generator=g))
    n = cache.num_slots
    for layer in range(spec.num_attention_layers):
        geom = cache.geometry(layer)
        unit = geom.unit_bytes
        flat = cache.flat_subpage_pool(layer)
        assert flat.shape[0] == geom.num_pages(n) == (n - 1) * geom.index_scale + 2
        # Base-rooted pool of this layer's unit: K = slot*scale + layer_offset, V = K + 1.
        base = cache.data.view(-1).view(n * geom.index_scale, unit)
        for slot in range(n):
            kpage = cache.pages(layer, "k")[slot]
            vpage = cache.pages(layer, "v")[slot]
            kbytes, vbytes = kpage.contiguous().view(torch.uint8), vpage.contiguous().view(torch.uint8)
            assert torch.equal(flat[slot * geom.index_scale].view(torch.uint8), kbytes)
            assert torch.equal(flat[slot * geom.index_scale + 1].view(torch.uint8), vbytes)
            kb = geom.k_page(slot)
            assert torch.equal(base[kb], kpage.contiguous().view(torch.uint8).reshape(-1))
            assert torch.equal(base[kb + geom.kv_offset], vpage.contiguous().view(torch.uint8).reshape(-1))
        # The pool ends inside the allocation (its bound is computed from its own root).
        root = cache.layout.pages[(layer, "k")].offset
        assert root + flat.shape[0] * unit <= cache.data.numel()
        if spec.kv_format(layer) == "nvfp4":
            sg = cache.layout.scale_geometry(layer)
            sflat = cache.flat_scale_pool(layer)
            assert sflat.shape[0] == sg.num_pages(n)
            for slot in (0, n - 1):
                assert torch.equal(sflat[slot * sg.index_scale].view(torch.uint8),
                                   cache.pages(layer, "k_scale")[slot].contiguous().view(torch.uint8))
                assert torch.equal(sflat[slot * sg.index_scale + 1].view(torch.uint8),
                                   cache.pages(layer, "v_scale")[slot].contiguous().view(torch.uint8))


def test_geometry_errors():
    cache = PagedKVCache(small_spec("nvfp4"), 2, "cpu")
    with pytest.raises(ValueError, match="no NVFP4 scale pages"):
        cache.flat_scale_pool(0)
    with pytest.raises(ValueError, match="index_k"):
        cache.pages(0, "index_k")


def test_uniform_index_scale_for_dense_layers():
    spec = KVCacheSpec.from_model_config(M3Config(), tp_size=4, kv_cache_dtype="nvfp4", num_draft_layers=1)
    cache = PagedKVCache(spec, 2, "cpu")
    # Dense FP8 layers 0-2 and the FP8 draft layer share one sub-page size, so one table serves them.
    assert cache.uniform_index_scale(spec.dense_layers + (spec.draft_layer,)) == 179
    assert cache.uniform_index_scale([0, 3]) is None  # FP8 dense vs NVFP4 sparse sub-pages differ
