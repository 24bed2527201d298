"""The decode target's step packing on CPU: buckets, the padded staged upload, and where a bucket's inputs sit.
(Graph capture and replay themselves run on the GPU: tests/runtime/test_decode_graphs_gpu.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from m3serve.kv.block_manager import BlockManager
from m3serve.kv.block_table import DeviceBlockTables
from m3serve.runtime.decode_graphs import pack_decode, stage_offsets
from m3serve.runtime.step_inputs import bucket_for, buckets_up_to


def test_buckets():
    assert buckets_up_to(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)       # the default max_num_seqs has its graph
    assert buckets_up_to(20) == (1, 2, 4, 8, 16, 20)                   # never padded past the limit
    assert buckets_up_to(256) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    assert buckets_up_to(300)[-2:] == (256, 300)
    assert buckets_up_to(1) == (1,)
    with pytest.raises(ValueError, match="max_num_seqs"):
        buckets_up_to(0)
    assert bucket_for(3, (1, 2, 4, 8)) == 4 and bucket_for(8, (1, 2, 4, 8)) == 8
    assert bucket_for(9, (1, 2, 4, 8)) is None


def _manager_with(seqs: dict[int, int], page=4, max_seqs=8, max_blocks=6):
    mgr = BlockManager(32, page, max_seqs=max_seqs, max_blocks_per_seq=max_blocks, enable_prefix_caching=False)
    for sid, ntok in seqs.items():
        mgr.allocate(sid, list(range(1, ntok + 1)))
    return mgr


def test_padded_prepare_puts_bucket_inputs_at_fixed_offsets():
    """pad_to=bucket: real rows first, then the padding row (slot 0 everywhere, token slot -1); token ids and
    sequence lengths ride in the same upload at the offsets the captured graph reads."""
    rng = np.random.default_rng(0)
    for trial in range(4):
        lens = {10 + i: int(rng.integers(1, 20)) for i in range(int(rng.integers(1, 4)))}
        mgr = _manager_with({sid: n + 1 for sid, n in lens.items()})
        tables = DeviceBlockTables(mgr, "cpu", index_scale=1, max_tokens=16)
        bucket = 4
        ids = [int(t) for t in rng.integers(0, 1000, len(lens))]
        tsi, pos, extra = pack_decode(bucket, ids, list(lens.values()))
        slot_table, _, slot_mapping = tables.prepare(list(lens), tsi, pos, extra=extra, pad_to=bucket)
        off = stage_offsets(bucket)
        stage = tables._dev_stage
        n = len(lens)
        assert stage[off["token_ids"]][:n].tolist() == ids and stage[off["token_ids"]][n:].tolist() == [0] * (bucket - n)
        assert stage[off["positions"]][:n].tolist() == list(lens.values())
        assert stage[off["seq_lens"]].tolist() == [p + 1 for p in lens.values()] + [0] * (bucket - n)
        for i, (sid, p) in enumerate(lens.items()):
            row = mgr.host_table[mgr.rows_of([sid])[0]]
            assert slot_table[i, :len(row)].tolist() == np.maximum(row, 0).tolist()
            assert int(slot_mapping[i]) == int(row[p // 4]) * 4 + p % 4
        assert slot_table[n:].eq(0).all() and slot_mapping[n:].eq(-1).all(), "padding must touch no page"
        assert torch.equal(tables.mirror[tables.pad_row], torch.full_like(tables.mirror[0], -1))


def test_prepare_rejects_a_pad_smaller_than_the_batch():
    mgr = _manager_with({1: 3, 2: 3})
    tables = DeviceBlockTables(mgr, "cpu", index_scale=1, max_tokens=16)
    with pytest.raises(ValueError, match="padded to 1"):
        tables.prepare([1, 2], np.array([0, 1]), np.array([2, 2]), pad_to=1)


def test_unchanged_rows_are_not_uploaded_again_with_padding():
    mgr = _manager_with({1: 3})
    tables = DeviceBlockTables(mgr, "cpu", index_scale=1, max_tokens=16)
    tsi, pos, extra = pack_decode(2, [5], [2])
    tables.prepare([1], tsi, pos, extra=extra, pad_to=2)
    assert tables.last_num_uploaded_rows == 1
    tables.prepare([1], tsi, pos, extra=extra, pad_to=2)
    assert tables.last_num_uploaded_rows == 0


def test_a_bucket_stages_at_the_same_offsets_whatever_changed_so_its_graph_can_expand_it():
    """The graph captures expand_staged with fixed arguments: for one bucket, stage() must return the same
    (S, T, offsets) whether 0, 1 or all rows changed and whatever the batch size up to the bucket; expanding the
    staged step then gives what prepare() gives. The all-padding stage (the graphs' warm-up input) touches no page."""
    lengths = {1: 3, 2: 9, 3: 14}
    mgr = _manager_with(lengths)
    tables = DeviceBlockTables(mgr, "cpu", index_scale=2, max_tokens=16)
    ref = DeviceBlockTables(mgr, "cpu", index_scale=2, max_tokens=16)
    bucket, layouts = 4, set()
    for seq_ids, grow in (([1, 2, 3], None), ([1, 2, 3], None), ([2], 2), ([3, 1], 1), ([], None)):
        if grow is not None:
            lengths[grow] += 4
            assert mgr.append_slots(grow, lengths[grow])   # one more page for that sequence: its row changes
        pos = [lengths[s] - 1 for s in seq_ids]
        tsi, p, extra = pack_decode(bucket, [7] * len(seq_ids), pos)
        staged = tables.stage(seq_ids, tsi, p, extra=extra, pad_to=bucket)
        layouts.add(staged)
        got = [x.clone() for x in tables.expand_staged(*staged)]
        want = ref.prepare(seq_ids, tsi, p, extra=extra, pad_to=bucket)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    assert len(layouts) == 1
    assert got[0].eq(0).all() and got[2].eq(-1).all(), "an all-padding step must touch no page"
