"""DraftKVView: root, scale, offset, page bound, table = manager's live rows expanded, errors."""

from __future__ import annotations

import pytest
import torch

from m3serve.config import M3Config
from m3serve.kv import BlockManager, KVCacheSpec, PagedKVCache, build_block_tables_reference
from m3serve.quant.fp8 import cast_to_fp8, dequantize_fp8
from tests.kv.kvutil import small_spec

P = 8


def make(kv: str = "nvfp4", num_slots: int = 7, draft_heads: int | None = None):
    spec = small_spec(kv, "bf16", draft=1, heads=2, draft_heads=draft_heads)
    cache = PagedKVCache(spec, num_slots, "cpu")
    mgr = BlockManager(num_slots, P, max_seqs=4, max_blocks_per_seq=5)
    return spec, cache, mgr


@pytest.mark.parametrize("kv", ["auto", "bf16", "fp8", "nvfp4"])
def test_view_geometry_root_and_bound(kv):
    spec, cache, mgr = make(kv, draft_heads=1)
    view = cache.draft_view(mgr)
    layer = spec.draft_layer
    k_page = cache.layout.pages[(layer, "k")]
    assert view.layer == layer == cache.draft_layer == spec.num_layers
    assert view.num_pools == 1 and view.kv_offset == 1
    assert view.index_scale == cache.layout.slot_bytes // k_page.nbytes  # sub-pages per slot
    assert view.root_byte_offset == k_page.offset
    assert view.pool.data_ptr() == cache.data.data_ptr() + k_page.offset
    n = cache.num_slots
    # Bound from the view's own root (TRT PR #17656 used another base and valid draft pages looked
    # out of range): 2 past the last slot's K, so the last slot's V is in range and nothing beyond.
    assert view.num_pages == (n - 1) * view.index_scale + 2 == view.pool.shape[0]
    assert (n - 1) * view.index_scale + view.kv_offset == view.num_pages - 1
    assert view.num_attention_pages(layer) == view.num_pages and view.kv_page_offset(layer) == 1
    assert view.root_byte_offset + view.num_pages * k_page.nbytes <= cache.data.numel()
    fmt_dtype = {"auto": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
                 "nvfp4": torch.float8_e4m3fn}[kv]
    assert view.dtype == fmt_dtype and view.pool.dtype == fmt_dtype
    assert view.pool.shape[1:] == (1, P, spec.head_dim)  # draft head count 1, HND pages
    g = torch.Generator().manual_seed(2)
    cache.data.copy_(torch.randint(0, 256, cache.data.shape, dtype=torch.uint8, generator=g))
    for slot in range(n):
        k = view.pool[slot * view.index_scale].view(torch.uint8)
        v = view.pool[slot * view.index_scale + 1].view(torch.uint8)
        assert torch.equal(k, cache.pages(layer, "k")[slot].view(torch.uint8))
        assert torch.equal(v, cache.pages(layer, "v")[slot].view(torch.uint8))


def test_view_table_is_managers_live_rows_expanded():
    spec, cache, mgr = make()
    view = cache.draft_view(mgr)
    assert view.host_table is mgr.host_table  # live rows, no private copy
    mgr.allocate(10, list(range(20)))
    mgr.allocate(11, list(range(3)))
    mgr.allocate(12, list(range(9)))
    for batch in ([10, 11, 12], [12, 10]):
        slot, sub = view.build(batch)
        ref_slot, ref_sub = build_block_tables_reference(mgr.host_table, [mgr.row_of(s) for s in batch],
                                                         view.index_scale, 1)
        assert torch.equal(slot, ref_slot) and torch.equal(sub, ref_sub)
    mgr.free(11)
    mgr.append_slots(12, 30)
    slot, sub = view.build([12, 10])
    ref = build_block_tables_reference(mgr.host_table, [mgr.row_of(12), mgr.row_of(10)], view.index_scale, 1)
    assert torch.equal(slot, ref[0]) and torch.equal(sub, ref[1])
    view.free(12)  # no-op: the manager owns the life cycle
    assert mgr.slot_ids(12) == slot[0, :4].tolist()


def test_kernel_style_read_through_subpage_table():
    # What a draft attention kernel does: gather pool[K page] / pool[V page] from the subpage table.
    spec, cache, mgr = make("nvfp4")
    view = cache.draft_view(mgr)
    mgr.allocate(1, list(range(5)))  # occupy slot 0 so the sequence does not start at slot 0
    mgr.allocate(2, list(range(19)))
    slots = mgr.slot_ids(2)
    g = torch.Generator().manual_seed(4)
    k = torch.randn(19, 2, spec.head_dim, generator=g)
    v = torch.randn(19, 2, spec.head_dim, generator=g)
    pos = torch.arange(19)
    view.write(torch.tensor(slots)[pos // P] * P + pos % P, k, v)
    _, sub = view.build([2])
    kp = view.pool[sub[0, 0, :3].long()]  # [3, H, P, D] fp8
    vp = view.pool[sub[0, 1, :3].long()]
    got_k = dequantize_fp8(kp.permute(0, 2, 1, 3).reshape(-1, 2, spec.head_dim)[:19], 1.0)
    got_v = dequantize_fp8(vp.permute(0, 2, 1, 3).reshape(-1, 2, spec.head_dim)[:19], 1.0)
    # Tolerance 0: the FP8 draft layer stores a saturating E4M3 cast; same rounding on both sides.
    assert torch.equal(got_k, dequantize_fp8(cast_to_fp8(k), 1.0))
    assert torch.equal(got_v, dequantize_fp8(cast_to_fp8(v), 1.0))
    rk, rv = view.read(torch.tensor(slots), 19, torch.float32)
    assert torch.equal(rk, got_k) and torch.equal(rv, got_v)


def test_view_rejects_what_the_layout_cannot_do():
    spec, cache, mgr = make("nvfp4")
    with pytest.raises(ValueError, match="tree_drafts"):
        cache.draft_view(mgr, tree_drafts=True)
    with pytest.raises(ValueError, match="relocate_accepted_tokens"):
        cache.draft_view(mgr, relocate_accepted_tokens=True)
    _, fp8_cache, fp8_mgr = make("fp8")
    fp8_cache.draft_view(fp8_mgr, tree_drafts=True)  # fine without NVFP4 block scales
    view = cache.draft_view(mgr)
    with pytest.raises(ValueError, match="only serves the draft layer"):
        view.num_attention_pages(0)
    no_draft = PagedKVCache(small_spec("fp8", draft=0), 3, "cpu")
    with pytest.raises(ValueError, match="num_draft_layers"):
        no_draft.draft_view(BlockManager(3, P, 2, 2))
    with pytest.raises(ValueError, match="num_draft_layers"):
        small_spec("fp8", draft=2)
    with pytest.raises(ValueError, match="manager"):
        cache.draft_view(BlockManager(5, P, 2, 2))


def test_m3_hybrid_draft_view_numbers():
    spec = KVCacheSpec.from_model_config(M3Config(), tp_size=4, kv_cache_dtype="nvfp4", num_draft_layers=1)
    cache = PagedKVCache(spec, 2, "cpu")
    view = cache.draft_view(BlockManager(2, 128, 2, 8))
    # FP8 draft K page: 1 head x 128 tokens x 128 B = 16 KiB; the slot is 2,932,736 B (23,824 B/token
    # minus the 912 B/token of NVFP4 scales, x128), so 179 draft-sized sub-pages per slot.
    assert view.dtype == torch.float8_e4m3fn
    assert cache.layout.slot_bytes == (23_824 - 912) * 128 == 179 * 16_384
    assert view.index_scale == 179 and view.num_pages == 179 + 2
