"""Manager + device tables + cache together: slot mappings from the tables, prefix reuse of every role."""

from __future__ import annotations

import torch

from m3serve.kv import BlockManager, DeviceBlockTables, PagedKVCache
from tests.kv.kvutil import small_spec

P = 8


def write_prompt(cache: PagedKVCache, tables: DeviceBlockTables, batch_pos: int, start: int, end: int,
                 gen: torch.Generator) -> None:
    """Write tokens [start, end) of batch row `batch_pos` to every layer, slots from the device tables."""
    spec = cache.spec
    pos = torch.arange(start, end)
    mapping = tables.slot_mapping(torch.full_like(pos, batch_pos), pos)
    assert bool((mapping >= 0).all())
    for layer in range(spec.num_attention_layers):
        h = spec.kv_heads(layer)
        k = torch.randn(len(pos), h, spec.head_dim, generator=gen)
        v = torch.randn(len(pos), h, spec.head_dim, generator=gen)
        ik = torch.randn(len(pos), spec.index_head_dim, generator=gen) if spec.is_sparse(layer) else None
        cache.write(layer, mapping, k, v, ik)


def test_prefix_hit_reuses_kv_index_k_and_draft_pages():
    spec = small_spec("nvfp4", "fp8", draft=1)
    cache = PagedKVCache(spec, 12, "cpu")
    cache.data.fill_(0xFF)  # poison: NaN in every float format
    cache.scales.fill_(0xFF)
    mgr = BlockManager(cache.num_slots, P, max_seqs=4, max_blocks_per_seq=6)
    tables = DeviceBlockTables(mgr, "cpu", cache.uniform_index_scale(spec.dense_layers))
    gen = torch.Generator().manual_seed(31)
    prompt_a = list(range(21))  # 2 full pages + 5 tokens
    assert mgr.allocate(1, prompt_a) == 0
    tables.build([1])
    write_prompt(cache, tables, 0, 0, 21, gen)
    mgr.commit_full_pages(1, prompt_a)
    slots_a = torch.tensor(mgr.slot_ids(1))
    before = {layer: cache.read(layer, slots_a[:2], 2 * P, torch.float32)
              for layer in range(spec.num_attention_layers)}
    mgr.free(1)
    prompt_b = prompt_a[:16] + [500, 501, 502]
    assert mgr.allocate(2, prompt_b) == 16
    tables.build([2])
    write_prompt(cache, tables, 0, 16, 19, gen)  # only the uncached tail is computed
    slots_b = torch.tensor(mgr.slot_ids(2))
    assert torch.equal(slots_b[:2], slots_a[:2])
    for layer in range(spec.num_attention_layers):
        k, v, ik = cache.read(layer, slots_b, 19, torch.float32)
        bk, bv, bik = before[layer]
        # Tolerance 0: the same bytes are read back; K/V, index-K and the draft layer share the slot.
        assert torch.equal(k[:16], bk) and torch.equal(v[:16], bv)
        assert (ik is None) == (bik is None) and (ik is None or torch.equal(ik[:16], bik))
        assert not torch.isnan(k).any() and not torch.isnan(v).any()


def test_dense_kernel_addressing_via_subpage_table():
    # A dense-attention kernel's view: pool = flat_subpage_pool(layer), pages = subpage_table[b, 0/1, j].
    spec = small_spec("fp8", "bf16", draft=0)
    cache = PagedKVCache(spec, 10, "cpu")
    mgr = BlockManager(cache.num_slots, P, max_seqs=3, max_blocks_per_seq=4)
    scale = cache.uniform_index_scale(spec.dense_layers)
    tables = DeviceBlockTables(mgr, "cpu", scale)
    gen = torch.Generator().manual_seed(37)
    mgr.allocate(7, list(range(3)))
    mgr.allocate(8, list(range(27)))
    tables.build([8, 7])
    write_prompt(cache, tables, 0, 0, 27, gen)
    write_prompt(cache, tables, 1, 0, 3, gen)
    _, sub = tables.build([8, 7])
    for layer in spec.dense_layers:
        pool = cache.flat_subpage_pool(layer)
        kp = pool[sub[0, 0, :4].long()].permute(0, 2, 1, 3).reshape(-1, spec.num_kv_heads, spec.head_dim)[:27]
        vp = pool[sub[0, 1, :4].long()].permute(0, 2, 1, 3).reshape(-1, spec.num_kv_heads, spec.head_dim)[:27]
        k, v, _ = cache.read(layer, torch.tensor(mgr.slot_ids(8)), 27, torch.float32)
        assert torch.equal(kp.float(), k) and torch.equal(vp.float(), v)  # FP8 -> fp32 is exact
