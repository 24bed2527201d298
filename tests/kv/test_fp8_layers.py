"""Hybrid cache with per-layer FP8 overrides (KVCacheSpec.fp8_layers): formats, bytes, layout, write/read, engine.

Tolerances, and why:
- cache read-back: exact (torch.equal) against the m3serve.quant reference rounding of the layer's format; the
  cache must apply exactly that rounding in fp32, and a layout error moves whole tokens.
- engine with every sparse layer overridden vs the all-FP8 engine: identical greedy tokens and bit-identical
  cache bytes; both store exactly the same FP8 values through the same code, only the spec's route differs.
"""

from __future__ import annotations

import pytest
import torch

from m3serve.config import M3Config
from m3serve.engine.engine import EngineConfig, LLMEngine
from m3serve.engine.sampling_params import SamplingParams
from m3serve.kv import KVCacheSpec, PagedKVCache, SlotLayout
from m3serve.kv.scales import apply_kv_amax
from m3serve.model.loader import load_model
from m3serve.quant.fp8 import cast_to_fp8, dequantize_fp8
from m3serve.quant.nvfp4 import dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4
from tests.kv.kvutil import small_spec

H, D, DI, P = 2, 32, 16, 8


def hybrid_spec(fp8_layers=(1,), draft: int = 1, **kw) -> KVCacheSpec:
    """small_spec's 4 layers (1 and 3 sparse) in the hybrid cache, with `fp8_layers` overridden."""
    base = dict(page_size=P, num_layers=4, sparse_layers=(1, 3), num_kv_heads=H, head_dim=D, index_head_dim=DI,
                kv_cache_dtype="nvfp4", num_draft_layers=draft)
    base.update(kw)
    return KVCacheSpec(**base, fp8_layers=fp8_layers)


# ----------------------------------------------------------------------------- spec
def test_formats_and_bytes_per_token():
    spec = hybrid_spec((1,))
    assert [spec.kv_format(i) for i in range(5)] == ["fp8", "fp8", "fp8", "nvfp4", "fp8"]
    assert spec.index_k_format() == "fp32"                   # index-K of the overridden layer stays
    kv = 2 * H * D                                           # K + V values per token per layer
    want = {"sparse_kv": kv + kv // 2, "sparse_kv_scale": kv // 16, "dense_kv": 2 * kv,
            "index_k": 2 * DI * 4, "draft_kv": kv}
    want["total"] = sum(want.values())
    assert spec.bytes_per_token() == want
    # Overriding every sparse layer: no NVFP4 layer, no scale bytes, same bytes as the all-FP8 cache's K/V.
    every = hybrid_spec((1, 3))
    assert all(every.kv_format(i) == "fp8" for i in range(5))
    fp8 = small_spec("fp8", "auto", draft=1)
    assert every.bytes_per_token() == fp8.bytes_per_token()


def test_m3_split_summary_and_bytes():
    spec = KVCacheSpec.from_model_config(M3Config(), tp_size=4, kv_cache_dtype="nvfp4", num_draft_layers=1,
                                         fp8_layers=(3,))
    assert spec.split_summary() == ("56 sparse = NVFP4/P128, 1 sparse = FP8/P128, 3 dense = FP8/P128, "
                                    "1 draft = FP8/P128, index-K = BF16")
    bpt = spec.bytes_per_token()
    assert bpt["sparse_kv"] == 56 * 2 * 128 // 2 + 1 * 2 * 128          # one head per rank at TP 4
    assert bpt["sparse_kv_scale"] == 56 * 2 * 128 // 16
    # The default keeps the plain hybrid summary.
    plain = KVCacheSpec.from_model_config(M3Config(), tp_size=4, kv_cache_dtype="nvfp4", num_draft_layers=1)
    assert plain.split_summary() == "57 sparse = NVFP4/P128, 3 dense = FP8/P128, 1 draft = FP8/P128, index-K = BF16"
    lay = SlotLayout(spec)
    assert lay.padding_bytes == 0 and lay.scale_padding_bytes == 0
    assert lay.slot_bytes + lay.scale_slot_bytes == bpt["total"] * spec.page_size


def test_layers_are_kept_sorted():
    assert hybrid_spec([3, 1]).fp8_layers == (1, 3) and hybrid_spec([3, 1]) == hybrid_spec((1, 3))


@pytest.mark.parametrize("kw,err,match", [
    (dict(fp8_layers=(0,)), ValueError, r"fp8_layers: expected sparse \(MSA\) layers from \(1, 3\), found \[0\]"),
    (dict(fp8_layers=(4,)), ValueError, r"found \[4\]"),                    # the draft layer
    (dict(fp8_layers=(1, 1)), ValueError, "fp8_layers: expected distinct"),
    (dict(fp8_layers=(1,), kv_cache_dtype="bf16"), ValueError, "fp8_layers: .*found kv_cache_dtype 'bf16'"),
    (dict(fp8_layers=(1,), kv_cache_dtype="fp8"), ValueError, "fp8_layers: .*hybrid cache"),
    (dict(fp8_layers=("1",)), TypeError, "fp8_layers: expected a tuple of int"),
    (dict(fp8_layers=(True,)), TypeError, "fp8_layers"),
    (dict(fp8_layers=1), TypeError, "fp8_layers"),
])
def test_spec_rejects_bad_fp8_layers(kw, err, match):
    base = dict(page_size=P, num_layers=4, sparse_layers=(1, 3), num_kv_heads=H, head_dim=D, index_head_dim=DI,
                kv_cache_dtype="nvfp4")
    base.update(kw)
    with pytest.raises(err, match=match):
        KVCacheSpec(**base)


def test_nvfp4_constraints_only_bind_nvfp4_layers():
    # head_dim 24 is not a multiple of the NVFP4 block: fine once no layer is NVFP4, an error otherwise.
    hybrid_spec((1, 3), head_dim=24)
    with pytest.raises(ValueError, match="head_dim"):
        hybrid_spec((1,), head_dim=24)
    assert KVCacheSpec(page_size=P, num_layers=4, sparse_layers=(1, 3), num_kv_heads=H, head_dim=D,
                       index_head_dim=DI, kv_cache_dtype="bf16", fp8_layers=()).fp8_layers == ()


# ----------------------------------------------------------------------------- layout
def test_layout_of_an_overridden_layer():
    lay = SlotLayout(hybrid_spec((1,)))
    k1, k3 = lay.page(1, "k"), lay.page(3, "k")
    assert k1.dtype == torch.float8_e4m3fn and k1.shape == (H, P, D) and k1.nbytes == H * P * D
    assert k3.dtype == torch.uint8 and k3.shape == (H, P, D // 2) and k3.nbytes == H * P * D // 2
    assert (1, "k_scale") not in lay.scale_pages and (3, "k_scale") in lay.scale_pages
    assert (1, "index_k") in lay.pages
    with pytest.raises(ValueError, match="no NVFP4 scale pages"):
        lay.scale_geometry(1)
    spans = sorted((p.offset, p.offset + p.nbytes) for p in lay.pages.values())
    assert all(a1 <= b0 for (_, a1), (b0, _) in zip(spans, spans[1:]))
    for layer in range(5):
        g = lay.geometry(layer)
        assert g.index_scale * g.unit_bytes == lay.slot_bytes and g.layer_offset * g.unit_bytes == lay.page(layer, "k").offset
    no_scales = SlotLayout(hybrid_spec((1, 3)))
    assert no_scales.scale_slot_bytes == 0 and not no_scales.scale_pages


# ----------------------------------------------------------------------------- write / read
def test_write_read_parity_of_an_overridden_layer():
    spec = hybrid_spec((1,))
    cache = PagedKVCache(spec, 4, "cpu")
    cache.data.fill_(0xFF)                     # NaN in fp32 and E4M3: an unwritten token reads back as NaN
    cache.scales.fill_(0xFF)
    assert apply_kv_amax(cache, {1: (9.0, 9.0), 3: (5.0, 3.0)}) == [3]      # the FP8 layer keeps scale 1
    assert cache.kv_global_scale[1].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="stored as fp8, not nvfp4"):
        cache.set_nvfp4_amax(1, 4.0, 4.0)
    g = torch.Generator().manual_seed(19)
    slots = torch.tensor([3, 0])
    n = 13
    mapping = slots[torch.arange(n) // P] * P + torch.arange(n) % P
    for layer in (1, 3):
        k = torch.randn(n, H, D, generator=g) * 3
        v = torch.randn(n, H, D, generator=g)
        ik = torch.randn(n, DI, generator=g)
        perm = torch.randperm(n, generator=g)
        cache.write(layer, mapping[perm], k[perm], v[perm], ik[perm])
        rk, rv, rik = cache.read(layer, slots, n, torch.float32)
        if layer == 1:
            want_k, want_v = (dequantize_fp8(cast_to_fp8(x), 1.0, torch.float32) for x in (k, v))
        else:
            gk, gv = nvfp4_global_scale(5.0), nvfp4_global_scale(3.0)
            want_k = dequantize_nvfp4(*quantize_nvfp4(k, gk), gk, torch.float32)
            want_v = dequantize_nvfp4(*quantize_nvfp4(v, gv), gv, torch.float32)
        assert torch.equal(rk, want_k) and torch.equal(rv, want_v), layer
        assert torch.equal(rik, ik)
    assert bool((cache.data[1:3] == 0xFF).all()) and bool((cache.scales[1:3] == 0xFF).all())   # unused slots


# ----------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def tiny_model():
    return load_model("tiny", random_weights=True, dtype=torch.float32, seed=3)


def test_engine_config_option(tiny_model):
    kw = dict(kv_cache_bytes=1 << 20, kv_cache_dtype="nvfp4")
    assert LLMEngine(tiny_model, EngineConfig(**kw)).kv.spec.fp8_layers == ()           # "auto": none here
    eng = LLMEngine(tiny_model, EngineConfig(kv_fp8_layers=(2,), **kw))
    assert eng.kv.spec.fp8_layers == (2,) and eng.kv.spec.kv_format(2) == "fp8"
    with pytest.raises(ValueError, match="EngineConfig.kv_fp8_layers: expected 'auto'"):
        LLMEngine(tiny_model, EngineConfig(kv_fp8_layers="all", **kw))
    with pytest.raises(ValueError, match=r"KVCacheSpec.fp8_layers: expected sparse \(MSA\) layers"):
        LLMEngine(tiny_model, EngineConfig(kv_fp8_layers=(0,), **kw))


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    reqs = [engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for p in prompts]
    while engine.has_work():
        engine.step()
    return [list(r.output_token_ids) for r in reqs]


def test_engine_with_every_sparse_layer_overridden_is_the_fp8_engine(tiny_model):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 19, 11)]
    fp8 = LLMEngine(tiny_model, EngineConfig(kv_cache_bytes=1 << 20, kv_cache_dtype="fp8"))
    hybrid = LLMEngine(tiny_model, EngineConfig(kv_cache_bytes=1 << 20, kv_cache_dtype="nvfp4",
                                                kv_fp8_layers=(1, 2, 3)))
    assert hybrid.kv.layout.slot_bytes == fp8.kv.layout.slot_bytes and hybrid.kv.scales is None
    assert _greedy(hybrid, prompts) == _greedy(fp8, prompts)
    # Same pages in the same order: the FP8 bytes of every (layer, role) sub-page match.
    for key, page in fp8.kv.layout.pages.items():
        assert hybrid.kv.layout.pages[key] == page
    assert torch.equal(hybrid.kv.data, fp8.kv.data)
