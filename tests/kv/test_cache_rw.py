"""PagedKVCache.write/read: exact round trips, quantization via m3serve.quant, NVFP4 byte layout."""

from __future__ import annotations

import zlib

import pytest
import torch

from m3serve.config import M3Config
from m3serve.kv import DEFAULT_NVFP4_KV_AMAX, KVCacheSpec, PagedKVCache
from m3serve.kv.spec import FMT_TORCH_DTYPE
from m3serve.quant.fp8 import cast_to_fp8, dequantize_fp8
from m3serve.quant.nvfp4 import dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4, v_scale_to_quad_order
from tests.kv.kvutil import INDEX_DTYPES, KV_DTYPES, small_spec

P = 8
# Two sequences over shuffled slots; slot 2 is never used, to catch stray writes.
SEQS = {"a": ([4, 1, 5], 19), "b": ([0, 3], 11)}
NUM_SLOTS = 6
UNUSED_SLOT = 2


def reference(fmt: str, x: torch.Tensor, gs: torch.Tensor | None) -> torch.Tensor:
    """What the cache must return for x, by the same m3serve.quant roundings, in fp32."""
    if fmt == "nvfp4":
        return dequantize_nvfp4(*quantize_nvfp4(x.float(), gs), gs, torch.float32)
    if fmt == "fp8":
        return dequantize_fp8(cast_to_fp8(x.float()), 1.0, torch.float32)
    return x.to(FMT_TORCH_DTYPE[fmt]).float()


def poisoned_cache(spec: KVCacheSpec) -> PagedKVCache:
    cache = PagedKVCache(spec, NUM_SLOTS, "cpu")
    # 0xFF bytes are NaN in fp32/bf16/fp16/E4M3: an unwritten token read back shows up as NaN.
    cache.data.fill_(0xFF)
    if cache.scales is not None:
        cache.scales.fill_(0xFF)
    return cache


def flat_slots(slots: list[int], length: int) -> torch.Tensor:
    pos = torch.arange(length)
    return torch.tensor(slots)[pos // P] * P + pos % P


def write_all(cache: PagedKVCache, gen: torch.Generator, scale: float = 1.0) -> dict:
    """Write both sequences to every layer in one shuffled call with -1 padding; returns the inputs."""
    spec = cache.spec
    mapping = torch.cat([flat_slots(*SEQS["a"]), flat_slots(*SEQS["b"]), torch.full((5,), -1)])
    perm = torch.randperm(mapping.shape[0], generator=gen)
    mapping = mapping[perm]
    written = {}
    for layer in range(spec.num_attention_layers):
        t, h = mapping.shape[0], spec.kv_heads(layer)
        k = torch.randn(t, h, spec.head_dim, generator=gen) * scale
        v = torch.randn(t, h, spec.head_dim, generator=gen) * scale
        ik = torch.randn(t, spec.index_head_dim, generator=gen) * scale if spec.is_sparse(layer) else None
        cache.write(layer, mapping, k, v, ik)
        written[layer] = (mapping, k, v, ik)
    return written


def tokens_of(seq: str, mapping: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Rows of x that belong to sequence `seq`, in sequence order."""
    want = flat_slots(*SEQS[seq])
    idx = torch.stack([(mapping == s).nonzero()[0, 0] for s in want])
    return x[idx]


@pytest.mark.parametrize("index", INDEX_DTYPES)
@pytest.mark.parametrize("kv", KV_DTYPES)
def test_write_read_matches_reference_every_combination(kv, index):
    spec = small_spec(kv, index, draft=1, heads=2, draft_heads=1)
    cache = poisoned_cache(spec)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kv}/{index}".encode()))
    written = write_all(cache, gen)
    for layer in range(spec.num_attention_layers):
        mapping, k, v, ik = written[layer]
        fmt = spec.kv_format(layer)
        for seq, (slots, length) in SEQS.items():
            rk, rv, rik = cache.read(layer, torch.tensor(slots), length, torch.float32)
            # Tolerance 0: the cache must apply exactly the reference rounding (same fp32 ops), and
            # in fp32 "auto" that is the identity; any layout error moves whole tokens and shows.
            want_k = reference(fmt, tokens_of(seq, mapping, k), cache.kv_global_scale[layer, 0])
            want_v = reference(fmt, tokens_of(seq, mapping, v), cache.kv_global_scale[layer, 1])
            assert torch.equal(rk, want_k) and torch.equal(rv, want_v), (layer, seq)
            if fmt == "fp32":
                assert torch.equal(rk, tokens_of(seq, mapping, k))
            if spec.is_sparse(layer):
                assert torch.equal(rik, reference(spec.index_k_format(), tokens_of(seq, mapping, ik), None))
            else:
                assert rik is None
            # Reading into bf16 is the fp32 result rounded once.
            bk, _, _ = cache.read(layer, torch.tensor(slots), length, torch.bfloat16)
            assert bk.dtype == torch.bfloat16 and torch.equal(bk, want_k.to(torch.bfloat16))
    # Nothing landed in the unused slot (the -1 padding tokens were skipped).
    assert bool((cache.data[UNUSED_SLOT] == 0xFF).all())
    if cache.scales is not None:
        assert bool((cache.scales[UNUSED_SLOT] == 0xFF).all())


def test_nvfp4_page_bytes_follow_mechanisms_layout():
    spec = small_spec("nvfp4", draft=0, heads=2)
    cache = poisoned_cache(spec)
    gen = torch.Generator().manual_seed(7)
    layer, slot, g = 1, 3, spec.head_dim // 16
    # A full page in reversed token order, so the token -> byte mapping cannot be accidental.
    offs = torch.arange(P - 1, -1, -1)
    k = torch.randn(P, 2, spec.head_dim, generator=gen)
    v = torch.randn(P, 2, spec.head_dim, generator=gen) * 3
    cache.write(layer, slot * P + offs, k, v, torch.randn(P, spec.index_head_dim, generator=gen))
    gk, gv = cache.kv_global_scale[layer]
    kq, ks = quantize_nvfp4(k, gk)
    vq, vs = quantize_nvfp4(v, gv)
    kpage = cache.pages(layer, "k")[slot]  # [H, P, D/2] packed
    kscale = cache.pages(layer, "k_scale")[slot].view(torch.uint8)  # [H, P*G]
    vscale = cache.pages(layer, "v_scale")[slot].view(torch.uint8)
    for i, t in enumerate(offs.tolist()):
        for h in range(2):
            assert torch.equal(kpage[h, t], kq[i, h])
            assert torch.equal(cache.pages(layer, "v")[slot][h, t], vq[i, h])
            for col in range(g):
                # K: token-major linear; V: 4x4 token quads (mechanisms.md §1.1).
                assert kscale[h, t * g + col] == ks[i, h, col].view(torch.uint8)
                assert vscale[h, (t // 4) * (4 * g) + 4 * col + t % 4] == vs[i, h, col].view(torch.uint8)
    # Same page through m3serve.quant's own quad-order helper (tokens in page order).
    order = torch.argsort(offs)
    assert torch.equal(vscale, v_scale_to_quad_order(vs[order].transpose(0, 1)).view(torch.uint8))


def test_nvfp4_global_scale_is_applied_per_layer():
    spec = small_spec("nvfp4", draft=0)
    cache = PagedKVCache(spec, NUM_SLOTS, "cpu")
    want = nvfp4_global_scale(DEFAULT_NVFP4_KV_AMAX)
    assert torch.equal(cache.kv_global_scale[1], torch.stack([want, want]))
    assert torch.equal(cache.kv_global_scale[0], torch.ones(2))  # dense FP8 layer: unscaled
    cache.set_nvfp4_amax(3, 1.0, 2.0)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(P, 2, spec.head_dim, generator=gen) * 4
    cache.write(3, torch.arange(P), x, x, torch.randn(P, spec.index_head_dim, generator=gen))
    rk, rv, _ = cache.read(3, torch.tensor([0]), P, torch.float32)
    # amax is the clip bound: block scales saturate at 448, so |K| <= 1 and |V| <= 2 exactly.
    assert rk.abs().max().item() == 1.0 and rv.abs().max().item() == 2.0
    with pytest.raises(ValueError, match="not nvfp4"):
        cache.set_nvfp4_amax(0, 1.0, 1.0)


def test_fp8_layers_saturate():
    spec = small_spec("nvfp4", draft=1)
    cache = PagedKVCache(spec, NUM_SLOTS, "cpu")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(P, 2, spec.head_dim, generator=gen) * 1000
    for layer in (0, spec.draft_layer):  # dense and draft layers are FP8 in the hybrid cache
        cache.write(layer, torch.arange(P) + P, x, -x)
        rk, rv, _ = cache.read(layer, torch.tensor([1]), P, torch.float32)
        assert rk.abs().max().item() == 448.0 and not torch.isnan(rk).any()
        assert torch.equal(rv, -rk)


def test_auto_bf16_model_dtype_stores_bf16():
    spec = small_spec("auto", "auto", model_dtype=torch.bfloat16)
    cache = PagedKVCache(spec, NUM_SLOTS, "cpu")
    assert cache.pages(1, "k").dtype == torch.bfloat16 and cache.pages(1, "index_k").dtype == torch.bfloat16
    x = torch.randn(3, 2, spec.head_dim, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    cache.write(0, torch.tensor([5, 6, 7]), x, x)
    rk, _, _ = cache.read(0, torch.tensor([0]), 8, torch.bfloat16)
    assert torch.equal(rk[5:8], x)  # bf16 in, bf16 storage: exact


def test_write_read_errors():
    spec = small_spec("auto", draft=0)
    cache = PagedKVCache(spec, NUM_SLOTS, "cpu")
    k = torch.randn(2, 2, spec.head_dim)
    ik = torch.randn(2, spec.index_head_dim)
    sm = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="index_k.*sparse"):
        cache.write(1, sm, k, k)
    with pytest.raises(ValueError, match="index_k.*dense"):
        cache.write(0, sm, k, k, ik)
    with pytest.raises(ValueError, match=r"k: expected shape"):
        cache.write(0, sm, k[:, :1], k)
    with pytest.raises(TypeError, match="slot_mapping"):
        cache.write(0, sm.int(), k, k)
    with pytest.raises(ValueError, match="flat slots <"):
        cache.write(0, torch.tensor([0, NUM_SLOTS * P]), k, k)
    with pytest.raises(ValueError, match="no draft layer"):
        cache.write(spec.draft_layer, sm, k, k)
    with pytest.raises(ValueError, match="length"):
        cache.read(0, torch.tensor([0]), P + 1, torch.float32)
    with pytest.raises(ValueError, match="slot ids"):
        cache.read(0, torch.tensor([NUM_SLOTS]), 1, torch.float32)


def test_m3_hybrid_real_shapes_roundtrip():
    spec = KVCacheSpec.from_model_config(M3Config(), tp_size=4, kv_cache_dtype="nvfp4", index_k_dtype="fp8",
                                         model_dtype=torch.bfloat16, num_draft_layers=1)
    cache = PagedKVCache(spec, 3, "cpu")
    gen = torch.Generator().manual_seed(11)
    t = 150  # crosses a 128-token page boundary
    slots = torch.tensor([2, 0])
    mapping = slots[torch.arange(t) // 128] * 128 + torch.arange(t) % 128
    for layer in (0, 3, 59, spec.draft_layer):
        k = torch.randn(t, 1, 128, generator=gen).to(torch.bfloat16)
        v = torch.randn(t, 1, 128, generator=gen).to(torch.bfloat16)
        ik = torch.randn(t, 128, generator=gen).to(torch.bfloat16) if spec.is_sparse(layer) else None
        cache.write(layer, mapping, k, v, ik)
        rk, rv, rik = cache.read(layer, slots, t, torch.float32)
        fmt = spec.kv_format(layer)
        # Tolerance 0: identical m3serve.quant roundings on identical inputs.
        assert torch.equal(rk, reference(fmt, k, cache.kv_global_scale[layer, 0]))
        assert torch.equal(rv, reference(fmt, v, cache.kv_global_scale[layer, 1]))
        if ik is not None:
            assert torch.equal(rik, reference("fp8", ik, None))


@pytest.mark.gpu
@pytest.mark.parametrize("kv", KV_DTYPES)
def test_cuda_matches_cpu_bytes(kv):
    # Same m3serve.quant fp32 ops on both devices; elementwise IEEE ops without fusion round the same,
    # so the stored bytes must be identical (tolerance 0).
    spec = small_spec(kv, "fp8", draft=1)
    caches = [PagedKVCache(spec, NUM_SLOTS, dev) for dev in ("cpu", "cuda")]
    gen = torch.Generator().manual_seed(77)
    for layer in range(spec.num_attention_layers):
        mapping = torch.randperm(NUM_SLOTS * P, generator=gen)[:20]
        k = torch.randn(20, 2, spec.head_dim, generator=gen) * 3
        v = torch.randn(20, 2, spec.head_dim, generator=gen)
        ik = torch.randn(20, spec.index_head_dim, generator=gen) if spec.is_sparse(layer) else None
        for c in caches:
            d = c.device
            c.write(layer, mapping.to(d), k.to(d), v.to(d), None if ik is None else ik.to(d))
    assert torch.equal(caches[0].data, caches[1].data.cpu())
    if caches[0].scales is not None:
        assert torch.equal(caches[0].scales, caches[1].scales.cpu())
    slots = torch.tensor([5, 0, 3])
    for layer in range(spec.num_attention_layers):
        a = caches[0].read(layer, slots, 20, torch.float32)
        b = caches[1].read(layer, slots.cuda(), 20, torch.float32)
        for x, y in zip(a, b):
            assert (x is None and y is None) or torch.equal(x, y.cpu())
